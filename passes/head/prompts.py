"""Where the head QAT's calibration prompts come from (paper App. A: UC-tr first turns for training, UC-val for
evaluation, never a Spec-Bench prompt): ``head_qat.calibration_data``, else the keep-set corpus after the
conversations the keep set counted (`prompt_sources`), read as first user turns (`read_prompts`), keyed for the
cache by their file's hash (`prompt_source_key`) and picked where their chat-formatted ids fit (`pick_prompts`).
The calibration answers (`hycoc.passes.calibration_answers`), the hand-off scales and the SLM calibration use the
same source.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hycoc.passes.head.errors import HeadQatError

from hycoc.recipe import Recipe


def _first_user_turn(record: Any, where: str) -> str:
    if not isinstance(record, dict):
        raise HeadQatError(f"{where}: a prompt line must be a JSON object")
    if "question_id" in record and "turns" in record:
        raise HeadQatError(
            f"{where}: this is a Spec-Bench question; head_qat.calibration_data must never hold "
            "benchmark prompts (paper App. A: no SB prompt is used in calibration or QAT)"
        )
    if isinstance(record.get("messages"), list):
        for message in record["messages"]:
            if isinstance(message, dict) and message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):
                    content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
                if isinstance(content, str):
                    return content
    for key in ("prompt", "user"):
        if isinstance(record.get(key), str):
            return record[key]
    raise HeadQatError(f"{where}: no user turn: give 'prompt', 'user' or 'messages' with a user message")


def read_prompts(path: Path, skip: int = 0) -> list[str]:
    """First user turns of a JSONL file, one conversation or prompt per line, after the first ``skip`` lines.

    Raises HeadQatError for a missing file, a line that is not JSON or has no user turn, or a Spec-Bench line.
    """
    if not path.is_file():
        raise HeadQatError(f"head_qat.calibration_data: {path} does not exist")
    out = []
    with path.open(encoding="utf-8") as f:
        lines = [(n, line) for n, line in enumerate(f, start=1) if line.strip()]
    for number, line in lines[skip:]:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise HeadQatError(f"{path}:{number}: not JSON ({e.msg})") from None
        out.append(_first_user_turn(record, f"{path}:{number}"))
    return out


def prompt_sources(recipe: Recipe) -> tuple[list[str], list[str], str]:
    """(training candidates, evaluation candidates, description), both in the order they are taken.

    * ``head_qat.calibration_data`` set: its lines in order; training takes from the front, evaluation from the
      lines after the training ones (give a shuffled file; the paper: 60 UC-tr + 60 UC-val first turns).
    * empty, ``keep_set.corpus`` set: that corpus's lines after the ``keep_set.corpus_conversations`` the keep set
      counted (App. A: prompts from conversations the keep set's counts never read), split the same way.

    Both lists are the same object (callers test ``train is eval``); the files fix the order. Raises HeadQatError
    when both keys are empty or a file is missing.
    """
    path = recipe.resolve_path(recipe.head_qat.calibration_data)
    if path is not None:
        texts = read_prompts(path)
        return texts, texts, str(path)
    corpus = recipe.resolve_path(recipe.keep_set.corpus)
    if corpus is not None:
        texts = read_prompts(corpus, skip=recipe.keep_set.corpus_conversations)
        return texts, texts, f"{corpus} after line {recipe.keep_set.corpus_conversations}"
    raise HeadQatError(
        "head_qat.calibration_data and keep_set.corpus are both empty: the calibration prompts come "
        "from one of them (the paper: UltraChat 200k train_sft first turns)"
    )


def prompt_source_key(recipe: Recipe) -> dict[str, Any]:
    """What identifies `prompt_sources`'s text for cache keys: the sha256 of ``head_qat.calibration_data`` or of
    ``keep_set.corpus`` (the first one set). Raises HeadQatError for a missing file or when both are empty."""
    from hycoc.bundle import sha256_file

    for key, value in (
        ("head_qat.calibration_data", recipe.head_qat.calibration_data),
        ("keep_set.corpus", recipe.keep_set.corpus),
    ):
        path = recipe.resolve_path(value)
        if path is not None:
            if not path.is_file():
                raise HeadQatError(f"{key}: {path} does not exist")
            return {key: sha256_file(path)}
    raise HeadQatError(
        "head_qat.calibration_data and keep_set.corpus are both empty: the calibration prompts come "
        "from one of them (the paper: UltraChat 200k train_sft first turns)"
    )


def pick_prompts(
    chat, candidates: Sequence[str], count: int, budget: int, key: str, exclude: int = 0
) -> tuple[list[list[int]], int]:
    """The first ``count`` of ``candidates[exclude:]`` whose chat-formatted ids (``chat``: the checkpoint's
    `hycoc.chat.Chat`) fit ``budget`` tokens, as id lists, and how many were skipped as too long. Raises
    HeadQatError naming ``key`` when fewer fit."""
    picked: list[list[int]] = []
    skipped = 0
    for text in candidates[exclude:]:
        if len(picked) == count:
            break
        ids = chat.prompt(text)
        if len(ids) > budget:
            skipped += 1
            continue
        picked.append(ids)
    if len(picked) < count:
        raise HeadQatError(
            f"{key} = {count}, but only {len(picked)} prompts of the source fit "
            f"head_qat.max_seq_len minus the answer cap ({budget} tokens; {skipped} longer skipped)"
        )
    return picked, skipped
