"""Benchmark prompts: the Spec-Bench question file (Xia et al., 2024), as used in the paper's §4.

Spec-Bench holds 480 questions, one JSON object per line: the 80 two-turn MT-bench questions (ids 81-160,
10 each of writing, roleplay, reasoning, math, coding, extraction, stem, humanities), then 80 each of
translation, summarization, qa, math_reasoning and rag (one turn). 359 rows carry a ``reference`` list.
No torch here: the device runtime and the bench client read this too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from hycoc.jsonl import iter_jsonl

#: Spec-Bench's 480 questions as shipped in the repository (benchmarks/data/NOTICE.md: source and license).
#: The default of ``hycoc bench``/``hycoc generate --dataset`` and of the recipes' ``bench.dataset``.
SPEC_BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "spec_bench_question.jsonl"


class DatasetError(ValueError):
    """A dataset file that is missing or malformed; the message names the file and, for a bad row, its line."""


@dataclass(frozen=True)
class Question:
    """One Spec-Bench question.

    question_id: the file's id (81-560 in Spec-Bench). category: e.g. "writing", "translation".
    turns: the user turns, first turn first (1 or 2).
    reference: one entry per reference, None where the file has none. An entry is a reference answer (str), or
    for rag rows a tuple of acceptable gold answers (Spec-Bench stores those as a nested list).
    """

    question_id: int
    category: str
    turns: tuple[str, ...]
    reference: tuple[str | tuple[str, ...], ...] | None = None

    def reference_for_turn(self, turn: int) -> tuple[str | tuple[str, ...], ...] | None:
        """The references that score the answer to user turn ``turn`` (1-based). MT-bench rows with references
        carry one per turn (``reference[i]`` answers ``turns[i]``), so turn t gets ``(reference[t - 1],)``;
        single-turn rows keep their whole list (rag's acceptable answers). Raises ValueError for a turn outside
        [1, len(turns)]."""
        if not 1 <= turn <= len(self.turns):
            raise ValueError(f"question {self.question_id} has {len(self.turns)} turn(s), asked for turn {turn}")
        if self.reference is None or len(self.turns) == 1:
            return self.reference
        if len(self.reference) != len(self.turns):
            return self.reference if turn == 1 else None
        return (self.reference[turn - 1],)


def _object_rows(path: Path) -> Iterator[tuple[str, int, dict]]:
    """``(FILE:LINE, line number, row)`` of each JSON object of the JSONL file ``path`` (`hycoc.jsonl.iter_jsonl`).
    Raises DatasetError for a missing file, a line that is not JSON and a row that is not an object."""
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    for where, number, row in iter_jsonl(path, DatasetError):
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        yield where, number, row


def _integer_id(row: dict, key: str, where: str) -> int:
    """``row[key]`` when it is an integer (a bool is not); else DatasetError naming ``where``."""
    value = row.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise DatasetError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _first_time(seen: dict[int, int], value: int, key: str, where: str, number: int) -> None:
    """Record that id ``value`` is on line ``number``; DatasetError naming both lines when ``seen`` has it already."""
    if value in seen:
        raise DatasetError(f"{where}: {key} {value} repeats line {seen[value]}")
    seen[value] = number


def load_spec_bench(path: str | Path) -> list[Question]:
    """Read a Spec-Bench JSONL file into Questions, in file order. Blank lines are skipped.

    Raises DatasetError on a missing file, a line that is not JSON, a row without ``question_id`` (int),
    ``category`` (str) or ``turns`` (non-empty list of str), a ``reference`` that is not a list of str (or of
    lists of str),
    or a repeated question_id; each message names ``FILE:LINE``.
    """
    path = Path(path)
    questions: list[Question] = []
    seen: dict[int, int] = {}
    for where, number, row in _object_rows(path):
        qid = _integer_id(row, "question_id", where)
        category, turns, reference = (row.get(k) for k in ("category", "turns", "reference"))
        if not isinstance(category, str) or not category:
            raise DatasetError(f"{where}: category must be a non-empty string, got {category!r}")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DatasetError(f"{where}: turns must be a non-empty list of strings")
        if reference is not None and not (isinstance(reference, list) and all(_is_reference(r) for r in reference)):
            raise DatasetError(f"{where}: reference must be a list of strings or of lists of strings")
        _first_time(seen, qid, "question_id", where, number)
        if reference is not None:
            reference = tuple(r if isinstance(r, str) else tuple(r) for r in reference)
        questions.append(Question(qid, category, tuple(turns), reference))
    if not questions:
        raise DatasetError(f"{path}: no questions")
    return questions


def _is_reference(entry: object) -> bool:
    return isinstance(entry, str) or (isinstance(entry, list) and all(isinstance(a, str) for a in entry))


def find_question(questions: list[Question], question_id: int) -> Question:
    """The question with ``question_id``; raises DatasetError naming the id range present when it is absent."""
    for q in questions:
        if q.question_id == question_id:
            return q
    ids = [q.question_id for q in questions]
    raise DatasetError(f"no question with id {question_id}; ids run from {min(ids)} to {max(ids)}")


# ---- long documents: the paper's 32K summarization row (∞Bench En.Sum, App. D) ---------------------------------

#: The long-document summarization file shipped for the toy family (benchmarks/data/NOTICE.md: source, license and
#: how it was made): Python 3.11 documentation pages in ∞Bench's ``longbook_sum_eng`` schema, each cut so that its
#: 2-shot prompt fills the toy verifier's 4,096-position context (3.5-3.8K toy tokens with the chat template).
LONG_SUMMARY = Path(__file__).resolve().parents[2] / "benchmarks" / "data" / "long_summary_toy.jsonl"

#: Built-in dataset names of ``hycoc bench --dataset`` (anything else is a path).
BUILTIN_DATASETS = {"spec-bench": SPEC_BENCH, "long-summary": LONG_SUMMARY}

#: Category of long-document summaries (its answers are scored by ROUGE-L against the reference summary).
LONG_SUMMARY_CATEGORY = "long-summary"

#: The paper's long-document selection (App. D): the first 50 novels of HELMET's seed-42 order, 2 demonstrations.
LONG_SUMMARY_COUNT = 50
LONG_SUMMARY_SHOTS = 2
LONG_SUMMARY_SEED = 42

#: HELMET's ∞Bench En.Sum prompt (princeton-nlp/HELMET, ``data.py`` ``load_infbench``, dataset ``infbench_sum_eng``):
#: the user template, then "\n\n" and the system template "Summary:". ``{demo}`` is `helmet_demos`'s text.
LONG_SUMMARY_TEMPLATE = (
    "You are given a book and you are tasked to summarize it. Write a summary of about 1000 to 1200 words. Only "
    "write about the plot and characters of the story. Do not discuss the themes or background of the book. Do not "
    "provide any analysis or commentary.\n\n{demo}{context}\n\nNow summarize the book.\n\nSummary:"
)


@dataclass(frozen=True)
class LongDocument:
    """One row of an ∞Bench ``longbook_sum_eng``-schema file: ``id`` (int), the document ``context`` (str) and its
    reference summaries ``answer`` (non-empty tuple of str); ``where`` = ``FILE:LINE`` of its row."""

    id: int
    context: str
    answer: tuple[str, ...]
    where: str = ""


def read_long_documents(path: str | Path) -> list[LongDocument]:
    """The rows of an ∞Bench ``longbook_sum_eng.jsonl`` (or a file of its schema, as `LONG_SUMMARY`) in file order.

    Each line: ``{"id": int, "context": str, "input": str, "answer": [str, ...], "options": [...]}`` (``input`` and
    ``options`` are read by the other ∞Bench tasks and ignored here; extra keys are allowed). Raises DatasetError on
    a missing file, a line that is not JSON, a row that is not an object, an ``id`` that is not an integer or repeats,
    an empty ``context`` or an ``answer`` that is not a non-empty list of strings; each message names ``FILE:LINE``.
    """
    path = Path(path)
    docs: list[LongDocument] = []
    seen: dict[int, int] = {}
    for where, number, row in _object_rows(path):
        rid = _integer_id(row, "id", where)
        context, answer = row.get("context"), row.get("answer")
        if not isinstance(context, str) or not context.strip():
            raise DatasetError(f"{where}: context must be a non-empty string (the document)")
        if not (isinstance(answer, list) and answer and all(isinstance(a, str) and a.strip() for a in answer)):
            raise DatasetError(f"{where}: answer must be a non-empty list of non-empty strings (reference summaries)")
        _first_time(seen, rid, "id", where, number)
        docs.append(LongDocument(rid, context, tuple(answer), where))
    if len(docs) <= LONG_SUMMARY_SHOTS:
        raise DatasetError(
            f"{path}: {len(docs)} document(s); the 2-shot prompt needs at least "
            f"{LONG_SUMMARY_SHOTS + 1} (each prompt's demonstrations are other rows' summaries)"
        )
    return docs


def helmet_order(n: int, seed: int = LONG_SUMMARY_SEED) -> list[int]:
    """Row indices in HELMET's order: ``datasets.Dataset.shuffle(seed)`` over n rows, which is numpy's
    ``default_rng(seed).permutation(n)`` (datasets' ``arrow_dataset.py``; HELMET's ``data.py`` selects the test
    rows, and each row's demonstrations, this way)."""
    import numpy as np

    return [int(i) for i in np.random.default_rng(seed).permutation(n)]


def helmet_demos(
    docs: list[LongDocument], index: int, shots: int = LONG_SUMMARY_SHOTS, seed: int = LONG_SUMMARY_SEED
) -> str:
    """The ``{demo}`` text of row ``index``'s prompt, as HELMET's ``add_demos``: the other rows (file order) shuffled
    with ``seed``, the first ``shots`` of them, each as ``"[story text]\\nSummary: " + its first summary`` (the
    demonstration's document is replaced by the placeholder), joined by blank lines, framed by "For example:" and
    "Now, read the following story:"."""
    others = [d for i, d in enumerate(docs) if i != index]
    picked = [others[i] for i in helmet_order(len(others), seed)[:shots]]
    demo = "\n\n".join(f"[story text]\nSummary: {d.answer[0].strip()}" for d in picked)
    return f"For example:\n\n{demo}\n\nNow, read the following story:\n\n"


def long_summary_text(docs: list[LongDocument], index: int, context: str | None = None) -> str:
    """Row ``index``'s user message: `LONG_SUMMARY_TEMPLATE` with its 2-shot demonstrations and its document
    (``context`` replaces the row's own, e.g. a truncated copy)."""
    return LONG_SUMMARY_TEMPLATE.format(
        demo=helmet_demos(docs, index), context=docs[index].context if context is None else context
    )


def fit_context(docs: list[LongDocument], index: int, prompt_tokens, max_prompt_tokens: int) -> str:
    """Row ``index``'s document cut at a line end so that its whole prompt (``prompt_tokens(text) -> int``, e.g.
    ``len(chat.prompt(text))``) has at most ``max_prompt_tokens`` tokens, as HELMET truncates each
    novel to the model's budget (paper App. D: 32K). The document is returned whole when it fits. Raises
    DatasetError naming the row when even an empty document does not fit."""
    context = docs[index].context
    if prompt_tokens(long_summary_text(docs, index, context)) <= max_prompt_tokens:
        return context
    if prompt_tokens(long_summary_text(docs, index, "")) > max_prompt_tokens:
        raise DatasetError(
            f"{docs[index].where}: the prompt without its document already has more than "
            f"{max_prompt_tokens} tokens (its demonstrations are too long)"
        )
    lines = context.splitlines(keepends=True)
    lo, hi = 0, len(lines)  # the longest prefix of whole lines that fits: lines[:lo] fits, [:hi + 1] not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt_tokens(long_summary_text(docs, index, "".join(lines[:mid]).rstrip())) <= max_prompt_tokens:
            lo = mid
        else:
            hi = mid - 1
    return "".join(lines[:lo]).rstrip()


def load_long_summary(
    path: str | Path = LONG_SUMMARY,
    *,
    count: int = LONG_SUMMARY_COUNT,
    prompt_tokens=None,
    max_prompt_tokens: int | None = None,
) -> list[Question]:
    """Long-document summarization requests (paper §4.1, App. D) from an ∞Bench ``longbook_sum_eng``-schema file
    (the real ``longbook_sum_eng.jsonl`` from a local path, or `LONG_SUMMARY`): the first ``count`` rows of
    HELMET's seed-42 order (`helmet_order`; the paper: 50), each a one-turn Question whose text is HELMET's 2-shot
    prompt (`long_summary_text`), category `LONG_SUMMARY_CATEGORY`, reference = the row's summaries.

    prompt_tokens, max_prompt_tokens: when both are given, each document is cut to fit (`fit_context`; the paper
    cut the novels to 32K Gemma tokens). question_id = the row's ``id``. Raises DatasetError (`read_long_documents`;
    count < 1)."""
    if count < 1:
        raise DatasetError(f"count = {count}: must be >= 1")
    docs = read_long_documents(path)
    out = []
    for i in helmet_order(len(docs))[:count]:
        context = None
        if prompt_tokens is not None and max_prompt_tokens is not None:
            context = fit_context(docs, i, prompt_tokens, max_prompt_tokens)
        out.append(Question(docs[i].id, LONG_SUMMARY_CATEGORY, (long_summary_text(docs, i, context),), docs[i].answer))
    return out


def is_long_summary_file(path: str | Path) -> bool:
    """Whether ``path``'s first row has ∞Bench's ``context`` key (else it is read as Spec-Bench). False for a
    missing or unreadable file (the loader then names the problem)."""
    try:
        for _, _, row in iter_jsonl(path, DatasetError, limit=1):
            return isinstance(row, dict) and "context" in row
    except DatasetError:
        return False
    return False


def load_bench_dataset(spec: str | Path, **long_summary) -> list[Question]:
    """The questions of ``hycoc bench --dataset SPEC``: a built-in name (`BUILTIN_DATASETS`: ``spec-bench``, the
    default, or ``long-summary``) or a path to a Spec-Bench file or an ∞Bench ``longbook_sum_eng``-schema file
    (told apart by the first row's keys). ``long_summary``: `load_long_summary`'s keywords (count, prompt_tokens,
    max_prompt_tokens) for long-document files. Raises DatasetError."""
    path = BUILTIN_DATASETS.get(str(spec), Path(spec))
    if is_long_summary_file(path):
        return load_long_summary(path, **long_summary)
    return load_spec_bench(path)
