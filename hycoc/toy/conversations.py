"""The toy recipe's conversation files: the toy verifier answering prompts of its own training corpus.

The paper counts the keep set on the assistant turns of 20,000 UC-tr conversations, calibrates the head and the
SLM on 60 other UC-tr first turns, and chooses ε on UC-val (App. A, App. D). The toy family's counterparts ship in
the repository, so that `hycoc build` and `hycoc bench` read nothing outside it (no Debian docs package):

* ``recipes/toy/data/conversations.jsonl`` (UC-tr's role): training-split user turns of `hycoc.toy.corpus`, each
  answered by the toy verifier. The toy recipe's ``keep_set.corpus`` points here; the keep set counts the first
  ``keep_set.corpus_conversations`` lines, and the calibration prompts of the head QAT and of both activation
  calibrations come from the lines after them (`hycoc.passes.head.prompts.prompt_sources`), which the counts never read.
* ``recipes/toy/data/validation.jsonl`` (UC-val's role): held-out user turns, answered the same way; neither the
  keep set nor any calibration reads it (for choosing ε and other settings).

One conversation a line, ``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}]}``.
Answers are sampled with the toy recipe's sampling (T = 0.5, top-k 64, top-p 0.95; `ANSWER_SAMPLING`), at most
`ANSWER_TOKENS` new tokens, in left-padded batches of `BATCH` with transformers ``generate``; prompts are drawn with
``random.Random(seed)`` and torch is seeded, so a rerun with the same seed, thread count and machine writes the
same files. Made by ``python -m hycoc.toy.train --stages conversations`` (needs ``python3.11-doc`` for the prompts);
about 3 MB for the defaults.
"""

from __future__ import annotations

import json
import os
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from hycoc.toy.generation import sample_answers

#: Where the toy recipe expects the files (relative to the repository).
DATA_DIR = Path(__file__).resolve().parents[2] / "recipes" / "toy" / "data"
#: Training-split conversations: keep-set counts (first lines) and calibration prompts (the rest).
TRAIN_CONVERSATIONS = 2400
#: Held-out conversations for validation (ε choice).
VALIDATION_CONVERSATIONS = 120
#: New tokens per answer at most (the toy recipe's sampling.max_new_tokens).
ANSWER_TOKENS = 256
#: The toy recipe's sampling (recipes/toy.toml [sampling]).
ANSWER_SAMPLING = {"temperature": 0.5, "top_k": 64, "top_p": 0.95}
#: Prompts per generate call.
BATCH = 128


def answer_batch(verifier, chat, prompts: Sequence[str], max_new_tokens: int) -> list[list[int]]:
    """Sampled answers (`ANSWER_SAMPLING`) to chat-formatted ``prompts``, one ``generate`` call, left padding.

    chat: the toy checkpoint's `hycoc.chat.Chat`. Returns one id list per prompt, cut after the first stop id
    (the checkpoint's eos_token_id), stop id included.
    """
    stops = chat.stop_ids
    pad = verifier.config.pad_token_id or 0
    ids = [chat.prompt(p) for p in prompts]
    return sample_answers(
        verifier, ids, max_new_tokens, pad=pad, stops=stops, eos_token_id=sorted(stops), **ANSWER_SAMPLING
    )


def conversation_line(tokenizer, user: str, answer: Sequence[int]) -> str:
    """One JSONL line: the user turn and the answer's text (special tokens, the stop included, dropped)."""
    text = tokenizer.decode(list(answer), skip_special_tokens=True)
    return json.dumps(
        {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}]}, ensure_ascii=False
    )


def write_conversations(
    path: Path,
    verifier,
    chat,
    users: Sequence[str],
    *,
    max_new_tokens: int = ANSWER_TOKENS,
    batch: int = BATCH,
    log: Callable[[str], None] = print,
) -> int:
    """Answer ``users`` in batches (``chat``: the toy checkpoint's `hycoc.chat.Chat`) and write ``path``
    atomically (temp file + rename). Returns the bytes written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    t0 = time.perf_counter()
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for start in range(0, len(users), batch):
                chunk = users[start : start + batch]
                for user, answer in zip(chunk, answer_batch(verifier, chat, chunk, max_new_tokens)):
                    f.write(conversation_line(chat.tokenizer, user, answer) + "\n")
                log(
                    f"conversations: {path.name} {min(start + batch, len(users))}/{len(users)} "
                    f"({time.perf_counter() - t0:.0f} s)"
                )
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; these are repository files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


def make_conversation_files(
    verifier, chat, train, held, seed: int, out_dir: Path = DATA_DIR, log: Callable[[str], None] = print
) -> dict[str, int]:
    """Write ``conversations.jsonl`` (`TRAIN_CONVERSATIONS` training prompts) and ``validation.jsonl``
    (`VALIDATION_CONVERSATIONS` held-out prompts) into ``out_dir`` (module docstring). train/held: lists of
    `hycoc.toy.corpus.Conversation`; chat: the toy checkpoint's `hycoc.chat.Chat`. Returns file name -> bytes. Raises
    ValueError when the corpus is too small."""
    if len(train) < TRAIN_CONVERSATIONS or len(held) < VALIDATION_CONVERSATIONS:
        raise ValueError(
            f"the toy corpus has {len(train)} train / {len(held)} held-out conversations; "
            f"{TRAIN_CONVERSATIONS} / {VALIDATION_CONVERSATIONS} are needed"
        )
    rng = random.Random(seed)
    torch.manual_seed(seed)
    sizes = {}
    for name, pool, count in (
        ("conversations.jsonl", train, TRAIN_CONVERSATIONS),
        ("validation.jsonl", held, VALIDATION_CONVERSATIONS),
    ):
        users = [c.user for c in rng.sample(pool, count)]
        sizes[name] = write_conversations(out_dir / name, verifier, chat, users, log=log)
    return sizes
