"""Text quality metrics (hycoc/bench/paper/quality.py) on hand-made texts with hand-worked values, and their pairing and
flag in the bench summary (hycoc/bench/paper/stats.py)."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from hycoc.bench.paper.quality import (
    answer_metrics,
    distinct_n,
    final_number_match,
    longest_run,
    reference_match,
    reference_metrics,
    repeated_ngram_share,
    rouge_l,
    words,
)
from hycoc.bench.paper.report_tables import render_quality, render_table
from hycoc.bench.paper.summary import summarize


def test_a_pure_repeat_is_all_repetition():
    text = " ".join(["go"] * 8)  # 23 bytes; zlib level 9 writes 13
    m = answer_metrics(text)
    assert m == {
        "words": 8,
        "compression_ratio": 13 / 23,
        "repeated_4gram_share": 1.0,
        "distinct_1": 1 / 8,
        "distinct_2": 1 / 7,
        "longest_run": 8,
    }


def test_a_text_without_a_repeated_bigram():
    m = answer_metrics("The quick brown fox jumps over a lazy dog", token_ids=[3, 9, 9, 4])
    assert (m["words"], m["repeated_4gram_share"], m["distinct_1"], m["distinct_2"]) == (9, 0.0, 1.0, 1.0)
    assert m["longest_run"] == 2  # over the token ids when given


def test_partial_repeats_by_hand():
    w = words("a b c d x a b c d")
    # the 4-gram "a b c d" occurs at words 0 and 5: words 0-3 and 5-8 are covered, "x" is not
    assert repeated_ngram_share(w, 4) == pytest.approx(8 / 9)
    # bigrams ab bc cd dx xa ab bc cd: 8, of which 5 distinct
    assert distinct_n(w, 2) == pytest.approx(5 / 8)
    assert repeated_ngram_share(w[:3], 4) == 0.0 and repeated_ngram_share([], 4) is None
    assert longest_run([5, 5, 5, 7, 5]) == 3 and longest_run([]) == 0
    assert words("Hello, WORLD!") == ["hello", ",", "world", "!"]
    assert answer_metrics("")["compression_ratio"] is None


def test_reference_metrics_on_a_match_and_a_partial_match():
    exact = reference_metrics("summarization", "The cat sat on the mat.", ["The cat sat on the mat."])
    assert exact["rouge_l"] == pytest.approx(100.0) and exact["chrf"] is None
    # LCS 3 of 3 answer words and 6 reference words: F1 = 2 * 1 * 0.5 / 1.5
    assert rouge_l("the cat sat", "the cat sat on the mat") == pytest.approx(200 / 3)
    tr = reference_metrics("translation", "Pawnbrokers shine in Singapore", ["Pawnbrokers shine in Singapore"])
    assert tr["chrf"] == pytest.approx(100.0) and tr["bleu"] == pytest.approx(100.0) and tr["rouge_l"] is None
    assert reference_metrics("writing", "anything", None) == {
        "rouge_l": None,
        "chrf": None,
        "bleu": None,
        "final_number_match": None,
        "reference_match": None,
    }


@pytest.mark.parametrize(
    "category,text,reference,final,contains",
    [
        ("math_reasoning", "First 10, then 1,000 in total.", ["... so 1000.\n#### 1000"], True, True),
        ("math_reasoning", "It is 1000, or maybe 10.", ["#### 1000"], False, True),
        ("math", "So the area is 3.", ["Area is 3", "5pi"], True, True),
        ("math", "The odds are 35/36, not 1/36.", ["35/36"], False, True),
        ("math", "The odds: 35/36", ["35/36"], True, True),
        ("translation", "x", ["y"], None, None),
    ],
)
def test_final_number_match_and_containment(category, text, reference, final, contains):
    assert final_number_match(category, text, reference) is final
    assert reference_match(category, text, reference) is contains


def record(config, qid, **fields) -> dict:
    """A bench record (records.jsonl) of a 10-token, 5-round writing answer at 1 ms a forward; ``fields`` added
    after (quality, verifier_logprob, ...)."""
    return {
        "config": config,
        "run": 0,
        "question_id": qid,
        "category": "writing",
        "tokens": 10,
        "rounds": 5,
        "server_ms": [1.0] * 5,
        "prefill_ms": 1.0,
        "rows": [5] * 5,
        "context": [10] * 5,
        "seconds": 1.0,
        **fields,
    }


def _rec(config, qid, ratio, rep, logprob):
    quality = {"compression_ratio": ratio, "repeated_4gram_share": rep, "longest_run": 2, "rouge_l": None}
    return record(config, qid, verifier_logprob=logprob, reference_match=None, quality=quality)


def test_summary_flags_a_config_worse_than_the_baseline_after_holm():
    """12 questions: hyco's zlib ratio is lower (worse) on every one, so its one-sided sign-flip p-value is the
    exact 1 / 2^12 (one sign pattern of 4096 as extreme); Holm over the run's 6 tests (2 configurations x the 3
    metrics with pairs) multiplies the smallest by 6. hyco-exact alternates +-0.02: no flag."""
    records = [_rec("cloud-mtp", q, 0.50, 0.10, -2.0) for q in range(12)]
    records += [_rec("hyco", q, 0.30 + 0.01 * q, 0.10, -1.5) for q in range(12)]  # repetitive, likelier
    records += [_rec("hyco-exact", q, 0.50 + (0.02 if q % 2 else -0.02), 0.10, -2.0) for q in range(12)]
    s = summarize(records, bootstrap=200)
    hq = s["hyco"]["quality"]
    assert hq["metrics"]["compression_ratio"]["mean"] == pytest.approx(0.355)
    assert hq["metrics"]["compression_ratio"]["delta"] == pytest.approx(-0.145)
    assert hq["metrics"]["compression_ratio"]["p_worse"] == pytest.approx(1 / 4096)
    assert hq["metrics"]["compression_ratio"]["p_holm"] == pytest.approx(6 / 4096)
    assert hq["metrics"]["compression_ratio"]["worse_than_baseline"] is True
    assert hq["metrics"]["repeated_4gram_share"]["worse_than_baseline"] is False  # every difference 0: p = 1
    assert hq["metrics"]["repeated_4gram_share"]["p_worse"] == 1.0
    assert hq["worse_than_baseline"] == ["compression_ratio"] and hq["flag_tests"] == 6
    assert "Holm" in hq["flag_method"]
    assert hq["metrics"]["rouge_l"] == {
        "mean": None,
        "n": 0,
        "delta": None,
        "delta_ci95": None,
        "p_worse": None,
        "p_holm": None,
        "worse_than_baseline": False,
    }
    assert hq["verifier_logprob_delta"] == pytest.approx(0.5) and "not a quality measure" in hq["verifier_logprob_is"]
    ex = s["hyco-exact"]["quality"]
    assert ex["worse_than_baseline"] == [] and ex["metrics"]["compression_ratio"]["delta"] == pytest.approx(0.0)
    lo, hi = ex["metrics"]["compression_ratio"]["delta_ci95"]
    assert lo < 0 < hi
    console = Console(file=io.StringIO(), width=250)
    render_table(s, console)
    render_quality(s, console)
    text = console.file.getvalue()
    assert "0.355 (-0.145)!" in text and "zlib ratio" in text and "Holm" in text


def test_second_turns_pair_with_the_baselines_second_turns():
    from hycoc.bench.paper.stats import pair_records

    base = [{"question_id": 1, "run": 0, "turn": t, "tag": f"b{t}"} for t in (1, 2)]
    recs = [{"question_id": 1, "run": 0, "turn": t, "tag": f"c{t}"} for t in (1, 2)] + [{"question_id": 1, "run": 0}]
    assert [(r["tag"] if "tag" in r else "-", b["tag"]) for r, b in pair_records(recs, base)] == [
        ("c1", "b1"),
        ("c2", "b2"),
        ("-", "b1"),
    ]


def test_a_second_turn_is_scored_against_the_second_reference():
    """MT-bench math rows carry one reference per turn: turn 2's answer is scored against reference[1] (it was
    scored against turn 1's answer), single-turn rows keep their whole reference list."""
    from hycoc.bench.datasets import Question
    from hycoc.bench.paper.scoring import score_quality

    q = Question(111, "math", ("Area of the triangle?", "Area of the circle?"), ("Area is 3", "5pi"))
    assert q.reference_for_turn(1) == ("Area is 3",) and q.reference_for_turn(2) == ("5pi",)
    with pytest.raises(ValueError, match="question 111 has 2 turn"):
        q.reference_for_turn(3)
    rag = Question(7, "rag", ("Who?",), (("James Ray", "George Harrison"),))
    assert rag.reference_for_turn(1) == rag.reference
    recs = [
        {"question_id": 111, "turn": 1, "text": "The area is 3."},
        {"question_id": 111, "turn": 2, "text": "So the answer is 5."},
        {"question_id": 111, "turn": 2, "text": "The area is 3."},
    ]
    score_quality(recs, {111: q})
    assert [r["quality"]["final_number_match"] for r in recs] == [True, True, False]
