"""The setup shared by the benchmark scripts that drive a verifier engine in-process on Spec-Bench first turns
(`cloud_mtp_rounds.py`, `two_turn_prefill.py`): their common command-line options and the engine, tokenizer and
sampling a recipe gives. Not a benchmark itself."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hycoc.bench.datasets import SPEC_BENCH


def add_engine_args(ap: argparse.ArgumentParser, *, limit_help: str, cap_help: str) -> None:
    """Add ``recipe``, ``--dataset`` (default: the shipped Spec-Bench), ``--limit`` (default 10),
    ``--max-new-tokens`` (default: the recipe's) and ``--threads`` (torch CPU threads; default the recipe's
    ``verifier.threads``) to ``ap``."""
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--dataset", type=Path, default=SPEC_BENCH, help="default: %(default)s")
    ap.add_argument("--limit", type=int, default=10, help=f"{limit_help} (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help=cap_help)
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: the recipe's verifier.threads)"
    )


@dataclass
class EngineSetup:
    """What `setup_engine` returns: the recipe, its tokenizer (`tokenizers.Tokenizer`), a CPU verifier engine
    (`hycoc.verifier.engine`), the recipe's `Sampling`, the output cap in tokens and the checkpoint's chat format
    (`hycoc.chat.Chat`: prompts and next turns)."""

    recipe: Any
    tok: Any
    engine: Any
    sampling: Any
    cap: int
    chat: Any = None


def setup_engine(args: argparse.Namespace) -> EngineSetup:
    """Load the recipe of ``args`` (`add_engine_args`), set torch's threads, and build the engine on the CPU."""
    import torch
    from hycoc.verifier.loading import engine_from_recipe

    from hycoc.chat_template import chat_from_recipe
    from hycoc.protocol.messages import Sampling
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    torch.set_num_threads(args.threads or recipe.verifier.threads or torch.get_num_threads())
    s = recipe.sampling
    chat = chat_from_recipe(recipe)
    return EngineSetup(
        recipe,
        chat.tokenizer,
        engine_from_recipe(recipe, "cpu"),
        Sampling(s.temperature, s.top_k, s.top_p),
        args.max_new_tokens or s.max_new_tokens,
        chat,
    )


def open_cloud_mtp(setup: EngineSetup, ids, *, cap: int | None = None, anchor: int = 0):
    """Open a Cloud+MTP session (Table 5 row 1: the server drafts, exact acceptance) on ``ids`` (int32 prompt)
    with the recipe's sampling and seed; anchor: the prompt's model-turn opening (`hycoc.chat.Rendered.anchor`,
    for a conversation that continues). The caller prefills it."""
    return setup.engine.open(
        ids,
        sampling=setup.sampling,
        seed=setup.recipe.sampling.seed,
        acceptance="exact",
        epsilon=1.0,
        draft_place="cloud-mtp",
        max_new_tokens=cap or setup.cap,
        anchor=anchor,
    )


def run_rounds(sess) -> None:
    """Verify root-only trees until the session finishes (Cloud+MTP: the server's head drafts each round)."""
    import numpy as np

    seq = 0
    while not sess.finished:
        sess.verify(np.array([sess.root], np.int32), np.array([-1], np.int32), seq)
        seq += 1
