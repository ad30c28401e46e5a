"""Benchmark prompts: the Spec-Bench question file (Xia et al., 2024), as used in the paper's §4.

Spec-Bench holds 480 questions, one JSON object per line: the 80 two-turn MT-bench questions (ids 81-160,
10 each of writing, roleplay, reasoning, math, coding, extraction, stem, humanities), then 80 each of
translation, summarization, qa, math_reasoning and rag (one turn). 359 rows carry a ``reference`` list.
No torch here: the device runtime and the bench client read this too.
"""

from __future__ import annotations

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


def load_spec_bench(path: str | Path) -> list[Question]:
    """Read a Spec-Bench JSONL file into Questions, in file order. Blank lines are skipped.

    Raises DatasetError on a missing file, a line that is not JSON, a row without ``question_id`` (int),
    ``category`` (str) or ``turns`` (non-empty list of str), a ``reference`` that is not a list of str (or of
    lists of str),
    or a repeated question_id; each message names ``FILE:LINE``.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: dataset file not found")
    questions: list[Question] = []
    seen: dict[int, int] = {}
    for where, number, row in iter_jsonl(path, DatasetError):
        if not isinstance(row, dict):
            raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
        qid, category, turns, reference = (row.get(k) for k in ("question_id", "category", "turns", "reference"))
        if not isinstance(qid, int) or isinstance(qid, bool):
            raise DatasetError(f"{where}: question_id must be an integer, got {qid!r}")
        if not isinstance(category, str) or not category:
            raise DatasetError(f"{where}: category must be a non-empty string, got {category!r}")
        if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
            raise DatasetError(f"{where}: turns must be a non-empty list of strings")
        if reference is not None and not (isinstance(reference, list) and all(_is_reference(r) for r in reference)):
            raise DatasetError(f"{where}: reference must be a list of strings or of lists of strings")
        if qid in seen:
            raise DatasetError(f"{where}: question_id {qid} repeats line {seen[qid]}")
        seen[qid] = number
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
