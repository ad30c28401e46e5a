"""Spec-Bench loader: all 480 questions with the right categories; each malformed row names its line."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import pytest

from hycoc.bench.datasets import SPEC_BENCH, DatasetError, Question, find_question, load_spec_bench


def test_spec_bench_ships_in_the_repository_unchanged():
    # benchmarks/data/NOTICE.md names the source and records this digest: the file is the upstream one.
    assert SPEC_BENCH == Path(__file__).resolve().parents[1] / "benchmarks" / "data" / "spec_bench_question.jsonl"
    digest = hashlib.sha256(SPEC_BENCH.read_bytes()).hexdigest()
    assert digest == "4b6d33e79484f9841c487ee87d1cf6aa8c6066f61d5d482ff09e5a007fafdf04"
    assert digest in (SPEC_BENCH.parent / "NOTICE.md").read_text()


def test_spec_bench_has_480_questions_in_its_categories():
    questions = load_spec_bench(SPEC_BENCH)
    assert len(questions) == 480
    assert Counter(q.category for q in questions) == {
        "writing": 10,
        "roleplay": 10,
        "reasoning": 10,
        "math": 10,
        "coding": 10,
        "extraction": 10,
        "stem": 10,
        "humanities": 10,
        "translation": 80,
        "summarization": 80,
        "qa": 80,
        "math_reasoning": 80,
        "rag": 80,
    }
    assert sum(q.reference is not None for q in questions) == 359
    assert [q.question_id for q in questions] == list(range(81, 561))
    assert Counter(len(q.turns) for q in questions) == {1: 400, 2: 80}


def test_spec_bench_rows_are_read_exactly():
    questions = load_spec_bench(SPEC_BENCH)
    first = find_question(questions, 81)
    assert first.category == "writing"
    assert first.turns[0].startswith("Compose an engaging travel blog post about a recent trip to Hawaii")
    assert first.turns[1] == "Rewrite your previous response. Start every sentence with the letter A."
    assert first.reference is None
    translation = find_question(questions, 161)
    assert translation.reference == ("Pawnbrokers shine in Singapore as middle class feel the pinch",)
    rag = find_question(questions, 481)
    assert rag.reference[0][:2] == ("a source of lumber", "aiding in regulating climate ,")


def write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "q.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


GOOD = json.dumps({"question_id": 1, "category": "qa", "turns": ["Why?"], "reference": ["Because."]})


def test_small_file_round_trip(tmp_path):
    path = write(
        tmp_path,
        [GOOD, "", json.dumps({"question_id": 2, "category": "rag", "turns": ["a", "b"], "reference": [["x", "y"]]})],
    )
    assert load_spec_bench(path) == [
        Question(1, "qa", ("Why?",), ("Because.",)),
        Question(2, "rag", ("a", "b"), (("x", "y"),)),
    ]


@pytest.mark.parametrize(
    "bad,problem",
    [
        ("{not json", "not JSON (Expecting property name"),
        ("[1, 2]", "expected a JSON object, got list"),
        (json.dumps({"category": "qa", "turns": ["x"]}), "question_id must be an integer, got None"),
        (json.dumps({"question_id": "7", "category": "qa", "turns": ["x"]}), "question_id must be an integer, got '7'"),
        (json.dumps({"question_id": 7, "turns": ["x"]}), "category must be a non-empty string, got None"),
        (json.dumps({"question_id": 7, "category": "qa", "turns": []}), "turns must be a non-empty list of strings"),
        (
            json.dumps({"question_id": 7, "category": "qa", "turns": ["x"], "reference": [1]}),
            "reference must be a list of strings or of lists of strings",
        ),
        (GOOD, "question_id 1 repeats line 1"),
    ],
)
def test_bad_line_names_its_number(tmp_path, bad, problem):
    path = write(tmp_path, [GOOD, bad])
    with pytest.raises(DatasetError) as info:
        load_spec_bench(path)
    assert str(info.value).startswith(f"{path}:2: {problem}")


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DatasetError, match="dataset file not found"):
        load_spec_bench(tmp_path / "none.jsonl")
    with pytest.raises(DatasetError, match="no questions"):
        load_spec_bench(write(tmp_path, [""]))


def test_unknown_question_id(tmp_path):
    questions = load_spec_bench(write(tmp_path, [GOOD]))
    with pytest.raises(DatasetError, match="no question with id 5; ids run from 1 to 1"):
        find_question(questions, 5)
