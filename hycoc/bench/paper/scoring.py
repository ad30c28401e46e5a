"""Scores of a bench's answers (`hycoc.bench.paper.runner`), filled into its records after the requests ran: text
quality (`score_quality`: repetition, and reference metrics where Spec-Bench has references) and the verifier's own mean
log-prob of each answer (`score_answers`, labelled as such: docs/benchmarks.md).
"""

from __future__ import annotations

from hycoc.bench.datasets import Question


def score_quality(records: list[dict], questions: dict[int, Question]) -> None:
    """Fill every record's ``quality`` that is missing (records of an older bench lack it): the answer's
    repetition metrics (`hycoc.bench.paper.quality.answer_metrics` over its text and output ids) and its reference
    metrics against the reference of the record's turn (`Question.reference_for_turn`: an MT-bench second answer against
    the second reference, `hycoc.bench.paper.quality.reference_metrics`). questions: question_id -> Question."""
    from hycoc.bench.paper.quality import answer_metrics, reference_metrics

    for rec in records:
        if rec.get("quality") is not None:
            continue
        q = questions[rec["question_id"]]
        text = rec.get("text") or ""
        rec["quality"] = {
            **answer_metrics(text, rec.get("output_ids")),
            **reference_metrics(q.category, text, q.reference_for_turn(int(rec.get("turn", 1)))),
        }


def score_answers(recipe, records: list[dict], prompts: dict[int, list[int]], console=None) -> None:
    """Fill every record's ``verifier_logprob``: the verifier's mean log-probability (natural log, temperature 1,
    full vocabulary) of the answer's tokens given the prompt. It measures how likely the verifier finds the text,
    which repetition raises (docs/benchmarks.md), so it is reported under that label beside `score_quality`'s metrics,
    never as the quality figure on its own. Runs the recipe's verifier in this process."""
    import torch

    from hycoc.models import load_verifier, set_threads

    set_threads(recipe.verifier.threads)
    model = load_verifier(recipe.model_path("verifier"), dtype=recipe.verifier.dtype, device=recipe.verifier.device)
    with torch.inference_mode():
        for rec in records:
            out = rec.get("output_ids") or []
            if rec.get("verifier_logprob") is not None or not out:
                continue
            prompt = prompts[rec["question_id"]]
            ids = torch.tensor([prompt + out], device=recipe.verifier.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])
            rec["verifier_logprob"] = float(lp.mean())
