"""Cloud+MTP on the verifier engine: MAT, server ms per round and g on Spec-Bench first turns.

    python benchmarks/cloud_mtp_rounds.py recipes/toy.toml --limit 10

Runs the paper's Cloud+MTP baseline (Table 5 row 1: the head on the server, full precision, whole prefix, full
vocabulary, K-chain, exact acceptance) directly on `hycoc.verifier.VerifierEngine` -- no network -- and prints
per-request and pooled numbers (App. G definitions: MAT counts the bonus token; g = server ms including prefill
per output token). Also runs the verifier alone (one token per forward) as the no-speculation reference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from hycoc.bench.datasets import SPEC_BENCH


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--dataset", type=Path, default=SPEC_BENCH, help="default: %(default)s")
    ap.add_argument("--limit", type=int, default=10, help="first N questions (default %(default)s)")
    ap.add_argument("--max-new-tokens", type=int, default=None, help="default: the recipe's")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the recipe's verifier.threads)")
    args = ap.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from hycoc.chat import format_prompt
    from hycoc.bench.datasets import load_spec_bench
    from hycoc.protocol.messages import Sampling
    from hycoc.models import load_tokenizer
    from hycoc.recipe import load_recipe
    from hycoc.verifier.loading import engine_from_recipe

    recipe = load_recipe(args.recipe)
    torch.set_num_threads(args.threads or recipe.verifier.threads or torch.get_num_threads())
    tok = load_tokenizer(recipe.model_path("tokenizer"))
    engine = engine_from_recipe(recipe, "cpu")
    s = recipe.sampling
    sampling = Sampling(s.temperature, s.top_k, s.top_p)
    cap = args.max_new_tokens or s.max_new_tokens
    table = Table(title=f"Cloud+MTP on {args.recipe.name}, {args.limit} Spec-Bench first turns")
    for col in ("qid", "category", "prompt", "tokens", "rounds", "MAT", "prefill ms", "ms/round", "g ms/tok"):
        table.add_column(col, justify="right")
    pooled = dict(tokens=0, rounds=0, server=0.0, prefill=0.0)
    for q in load_spec_bench(args.dataset)[: args.limit]:
        ids = np.array(format_prompt(tok, q.turns[0]), dtype=np.int32)
        sess = engine.open(ids, sampling=sampling, seed=s.seed, acceptance="exact", epsilon=1.0,
                           draft_place="cloud-mtp", max_new_tokens=cap)
        prefill_ms, _ = sess.prefill()
        seq = 0
        while not sess.finished:
            sess.verify(np.array([sess.root], np.int32), np.array([-1], np.int32), seq)
            seq += 1
        n = len(sess.output)
        server = sum(sess.server_ms) if isinstance(sess.server_ms, list) else sess.server_ms
        pooled["tokens"] += n
        pooled["rounds"] += sess.rounds
        pooled["server"] += server
        pooled["prefill"] += prefill_ms
        table.add_row(str(q.question_id), q.category, str(len(ids)), str(n), str(sess.rounds),
                      f"{n / max(sess.rounds, 1):.2f}", f"{prefill_ms:.1f}", f"{server / max(sess.rounds, 1):.1f}",
                      f"{(server + prefill_ms) / max(n, 1):.2f}")
        sess.close()
    p = pooled
    table.add_row("all", "", "", str(p["tokens"]), str(p["rounds"]), f"{p['tokens'] / p['rounds']:.2f}",
                  f"{p['prefill']:.0f}", f"{p['server'] / p['rounds']:.1f}",
                  f"{(p['server'] + p['prefill']) / p['tokens']:.2f}")
    Console().print(table)


if __name__ == "__main__":
    main()
