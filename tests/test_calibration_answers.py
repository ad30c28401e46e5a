"""The calibration answers pass (passes/calibration_answers.py): batched greedy answers equal one-at-a-time greedy
answers, one answer serves every cap, the artifact round-trips, and the readers' needs are the maxima of theirs."""

from __future__ import annotations

import json

import pytest
import torch
from hycoc.passes import calibration_answers as ca
from hycoc.passes.head.captures import greedy_answer
from tiny_models import tiny_verifier

from hycoc.recipe import Recipe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def verifier():
    return tiny_verifier(seed=0)


def test_batched_greedy_answers_equal_one_at_a_time(verifier):
    # prompts of different lengths share a batch (left padding under the attention mask); batch 2 splits them
    prompts = [[2, 5, 9], [2, 7, 7, 7, 7, 11, 13], [2, 40], [2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]
    stops = {1}
    one = [greedy_answer(verifier, p, 9, stops) for p in prompts]
    steps = []
    batched = ca.greedy_answers(verifier, prompts, 9, stops, batch=2, progress=steps.append)
    assert batched == one
    assert sum(steps) == ca.decode_steps(4, 9, batch=2) == 18
    # a shorter cap gives the prefix: one answer serves every reader's cap
    assert ca.greedy_answers(verifier, prompts, 4, stops) == [a[:4] for a in one]
    with pytest.raises(ValueError, match="an empty prompt"):
        ca.greedy_answers(verifier, [[]], 4, stops)


def test_answers_stop_after_the_first_stop_id(verifier):
    prompt = [2, 5, 9]
    free = ca.greedy_answers(verifier, [prompt], 12, set())[0]
    stop = free[3]
    cut = ca.greedy_answers(verifier, [prompt], 12, {stop})[0]
    assert cut == free[: free.index(stop) + 1] and cut[-1] == stop


def test_take_cuts_answers_and_refuses_what_was_not_made():
    answers = ca.CalibrationAnswers(
        train=[([1, 2], [5, 6, 7]), ([3], [8])], eval=[([4], [9, 9, 9, 9])], train_cap=3, eval_cap=4, source="s"
    )
    assert answers.take("train", 2, 2) == ([[1, 2], [3]], [[5, 6], [8]])
    assert answers.take("eval", 1, 4) == ([[4]], [[9, 9, 9, 9]])
    with pytest.raises(ValueError, match=r"3 train answers of <= 2 tokens asked, 2 of <= 3 made"):
        answers.take("train", 3, 2)
    with pytest.raises(ValueError, match=r"1 eval answers of <= 5 tokens asked, 1 of <= 4 made"):
        answers.take("eval", 1, 5)


def test_artifact_round_trip_and_hash(tmp_path):
    answers = ca.CalibrationAnswers([([1, 2], [5, 6])], [([4], [9])], 2, 1, "file.jsonl after line 3")
    art = ca.CalibrationAnswersArtifact("calibration_answers", answers)
    art.save(tmp_path)
    back = ca.CalibrationAnswersArtifact.load("calibration_answers", tmp_path)
    assert back.payload == answers and back.content_hash() == art.content_hash()
    other = ca.CalibrationAnswersArtifact(
        "calibration_answers", ca.CalibrationAnswers([([1, 2], [5, 7])], [([4], [9])], 2, 1, "x")
    )
    assert other.content_hash() != art.content_hash()
    assert json.loads((tmp_path / "answers.json").read_text())["train"] == [[[1, 2], [5, 6]]]


def test_reader_needs_cover_every_reader():
    recipe = Recipe.model_validate(
        {
            "window": {"head_window": 100, "slm_window": 40, "slm_sliding_window": 20},
            "head_qat": {
                "calibration_prompts": 10,
                "eval_prompts": 3,
                "calibration_max_new_tokens": 300,
                "eval_max_new_tokens": 50,
                "calibration_data": "p.jsonl",
            },
            "slm_calibration": {"prompts": 24},
        }
    )
    # train: max(10 QAT, 24 SLM) prompts at 300 tokens; eval: max(3 QAT, 24 // 4 = 6 SLM held out) prompts at
    # max(50 QAT eval, min(300, 2 x 40) = 80 SLM, min(300, 150) = 150 head calibration) tokens
    assert ca.reader_needs(recipe) == {"train_count": 24, "eval_count": 6, "train_cap": 300, "eval_cap": 150}
