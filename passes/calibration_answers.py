"""Calibration answers pass: the verifier's greedy answers to the calibration prompts, made once for the build.

The paper calibrates both drafters on the same text (App. A, "Final calibration and training"): 60 first-turn
prompts that the keep set's counts never read, with the verifier's greedy answers (<= 1,024 new tokens), train
the head's QAT and give the activation ranges of both graphs; 60 other prompts, answered the same way (<= 512),
evaluate it. Before this pass, the head QAT, the head's QDQ calibration and the SLM's QDQ calibration each had the
verifier answer their prompts one at a time (about 170 answers per toy build, most of them the same prompts); now
this pass answers each prompt once, in batches, and the three passes read prefixes of its answers.

Prompts (`select_prompts`): the head QAT's prompt source (`hycoc.passes.head.prompts.prompt_sources`), chat-formatted.
``train``: the first `train_count` prompts that fit ``head_qat.max_seq_len - head_qat.calibration_max_new_tokens``
tokens; ``eval``: the first `eval_count` of the evaluation candidates (after the training ones when both come from
one list) that fit ``max_seq_len - eval_cap``. The counts and caps cover every reader:

* head QAT: ``head_qat.calibration_prompts`` / ``eval_prompts`` answers at ``calibration_max_new_tokens`` /
  ``eval_max_new_tokens`` tokens;
* head QDQ calibration (`hycoc.passes.head.calibration`): its first `CALIBRATION_PROMPTS` train and
  `HELD_OUT_PROMPTS` eval prompts (fewer when there are fewer), answers cut at its ``answer_cap``;
* SLM QDQ calibration (`hycoc.passes.slm.calibration`): ``slm_calibration.prompts`` train and
  ``max(2, prompts // 4)`` eval prompts, answers cut at its ``answer_cap``.

Greedy (`greedy_answers`): arg-max decoding with transformers ``generate`` (``do_sample=False``) over left-padded
batches of `BATCH` prompts, cut after the first stop id. A greedy answer to a cap c is the first c tokens of the
answer to a larger cap (cut at the stop), so one answer serves every cap. Batching changes only the shapes of the
matrix products, not the arithmetic each row sees, up to float rounding: the toy verifier's batched answers to the
first 8 calibration prompts (<= 256 tokens, 1,843 in all) are token-identical to its one-at-a-time answers, and
the tiny test models' are too (`tests/test_calibration_answers.py`); an arg-max tie broken the other way by
rounding would change an answer, not its role as the verifier's own text.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from hycoc.passes.artifacts import Artifact, TokenizerArtifact, TorchModelArtifact
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.models import generate_answers
from hycoc.recipe import Recipe

#: Prompts per ``generate`` call. Larger batches amortise transformers' per-step overhead (toy verifier, one CPU
#: thread: ~40 tokens/s one at a time, ~2,800 tokens/s at 64).
BATCH = 64


@dataclass
class CalibrationAnswers:
    """The verifier's greedy answers to the calibration prompts.

    train / eval: lists of (prompt ids, answer ids), prompt ids chat-formatted (`hycoc.chat.Chat.prompt`), the
    answer cut after its first stop id and at ``train_cap`` / ``eval_cap`` tokens; source: where the prompts came
    from (for reports).
    """

    train: list[tuple[list[int], list[int]]]
    eval: list[tuple[list[int], list[int]]]
    train_cap: int
    eval_cap: int
    source: str

    def take(self, split: str, count: int, cap: int) -> tuple[list[list[int]], list[list[int]]]:
        """(prompts, answers cut at ``cap`` tokens) of the first ``count`` pairs of ``split`` ("train" or "eval").

        Raises ValueError when the split has fewer pairs or ``cap`` exceeds the cap it was answered to (the
        recipe changed without rerunning this pass: a pipeline bug)."""
        pairs, made = (self.train, self.train_cap) if split == "train" else (self.eval, self.eval_cap)
        if count > len(pairs) or cap > made:
            raise ValueError(
                f"calibration answers: {count} {split} answers of <= {cap} tokens asked, {len(pairs)} of <= {made} made"
            )
        return [list(p) for p, _ in pairs[:count]], [list(a[:cap]) for _, a in pairs[:count]]


@dataclass
class CalibrationAnswersArtifact(Artifact):
    """kind ``"calibration_answers"``: a `CalibrationAnswers`. Saved as ``answers.json``; hashed over that JSON."""

    type_name: ClassVar[str] = "calibration_answers"
    FILE: ClassVar[str] = "answers.json"

    def _json(self) -> str:
        a = self.payload
        return json.dumps(
            {"train": a.train, "eval": a.eval, "train_cap": a.train_cap, "eval_cap": a.eval_cap, "source": a.source},
            sort_keys=True,
            separators=(",", ":"),
        )

    def save(self, folder: Path) -> None:
        (folder / self.FILE).write_text(self._json(), encoding="utf-8")

    @classmethod
    def load(cls, kind: str, folder: Path) -> CalibrationAnswersArtifact:
        d = json.loads((folder / cls.FILE).read_text(encoding="utf-8"))
        pairs = {k: [(list(p), list(a)) for p, a in d[k]] for k in ("train", "eval")}
        return cls(kind, CalibrationAnswers(pairs["train"], pairs["eval"], d["train_cap"], d["eval_cap"], d["source"]))

    def _compute_hash(self) -> str:
        import hashlib

        return hashlib.sha256(self._json().encode()).hexdigest()


# ---- greedy answers ---------------------------------------------------------------------------------------------


class _DecodeSteps:
    """A transformers streamer (``put``/``end``, `transformers.generation.streamers.BaseStreamer`'s interface) that
    reports each decoding step of a batch to ``progress(1)``; the first ``put`` (the prompt) is not a step."""

    def __init__(self, progress: Callable[[int], None]):
        self.progress, self.calls = progress, 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls > 1:
            self.progress(1)

    def end(self) -> None:
        pass


def decode_steps(prompt_count: int, max_new_tokens: int, batch: int = BATCH) -> int:
    """Decoding steps `greedy_answers` reports for ``prompt_count`` prompts: ``max_new_tokens`` per batch."""
    return -(-prompt_count // batch) * max_new_tokens


@torch.no_grad()
def greedy_answers(
    verifier,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: Collection[int],
    *,
    batch: int = BATCH,
    progress: Callable[[int], None] | None = None,
) -> list[list[int]]:
    """The verifier's greedy answer to every prompt (module docstring), in the prompts' order.

    prompts: token id lists (non-empty); returns id lists of at most ``max_new_tokens``, each cut after its first
    stop id. Prompts are answered in batches of ``batch`` grouped by length (less padding), left-padded with the
    model's pad id under an attention mask. ``progress(n)`` is called as decoding steps finish: `decode_steps`
    in all (a batch that stops early reports its remaining steps at its end).
    """
    if any(len(p) == 0 for p in prompts):
        raise ValueError("greedy_answers: an empty prompt")
    pad = verifier.config.pad_token_id or 0
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    out: list[list[int]] = [[] for _ in prompts]
    for start in range(0, len(order), batch):
        rows = order[start : start + batch]
        steps = _DecodeSteps(progress) if progress is not None else None
        answers = generate_answers(
            verifier,
            [prompts[i] for i in rows],
            max_new_tokens,
            pad=pad,
            stops=stop_ids,
            do_sample=False,
            eos_token_id=sorted(stop_ids) or None,
            top_k=None,
            top_p=None,
            temperature=None,
            streamer=steps,
        )
        for i, answer in zip(rows, answers):
            out[i] = answer
        if progress is not None and steps is not None:  # steps counts when progress is given
            progress(max(0, max_new_tokens - (steps.calls - 1)))
    return out


# ---- prompts ----------------------------------------------------------------------------------------------------


def reader_needs(recipe: Recipe) -> dict[str, int]:
    """How many train / eval answers, and how long, the three reading passes need (module docstring)."""
    from hycoc.passes.head import calibration as hc
    from hycoc.passes.slm import calibration as sc

    q = recipe.head_qat
    slm_cap, head_cap = sc.answer_cap(recipe), hc.answer_cap(recipe)
    return {
        "train_count": max(q.calibration_prompts, recipe.slm_calibration.prompts),
        "eval_count": max(q.eval_prompts, sc.held_out_count(recipe)),
        "train_cap": max(q.calibration_max_new_tokens, slm_cap, head_cap),
        "eval_cap": max(q.eval_max_new_tokens, slm_cap, head_cap),
    }


def select_prompts(recipe: Recipe, tokenizer) -> tuple[list[list[int]], list[list[int]], str]:
    """(train prompts, eval prompts, source) as chat-formatted ids (module docstring). Raises HeadQatError naming
    the recipe key when the source has too few prompts that fit."""
    from hycoc.passes.head.prompts import pick_prompts, prompt_sources

    from hycoc.chat_template import chat_from_recipe

    chat = chat_from_recipe(recipe)
    need = reader_needs(recipe)
    max_len = recipe.head_qat.max_seq_len
    train_texts, eval_texts, source = prompt_sources(recipe)
    train, skipped = pick_prompts(
        chat, train_texts, need["train_count"], max_len - need["train_cap"], "head_qat.calibration_prompts"
    )
    used = need["train_count"] + skipped if train_texts is eval_texts else 0
    evals, _ = pick_prompts(
        chat, eval_texts, need["eval_count"], max_len - need["eval_cap"], "head_qat.eval_prompts", exclude=used
    )
    return train, evals, source


def make_answers(
    verifier, tokenizer, recipe: Recipe, progress: Callable[[int], None] | None = None
) -> CalibrationAnswers:
    """The `CalibrationAnswers` of ``recipe`` (module docstring): `select_prompts`, then `greedy_answers` of the
    train prompts to ``train_cap`` and of the eval prompts to ``eval_cap`` tokens. ``progress(n)``: decoding steps
    done (`decode_steps` of both lists in all)."""
    from hycoc.chat_template import chat_from_recipe

    need = reader_needs(recipe)
    train, evals, source = select_prompts(recipe, tokenizer)
    stops = chat_from_recipe(recipe).stop_ids
    train_answers = greedy_answers(verifier, train, need["train_cap"], stops, progress=progress)
    eval_answers = greedy_answers(verifier, evals, need["eval_cap"], stops, progress=progress)
    return CalibrationAnswers(
        list(zip(train, train_answers)), list(zip(evals, eval_answers)), need["train_cap"], need["eval_cap"], source
    )


class CalibrationAnswersPass(Pass):
    """torch_verifier + tokenizer -> calibration_answers, reading ``[head_qat]`` (prompt source, counts, caps,
    max_seq_len), ``[slm_calibration]`` and ``[window]`` (the calibrations' counts and caps) and ``[keep_set]``
    (the corpus the prompts come after). Greedy decoding: no seed."""

    name = "calibration_answers"
    section = "head_qat"
    also_reads = ("slm_calibration", "window", "keep_set")
    consumes = {"torch_verifier": TorchModelArtifact, "tokenizer": TokenizerArtifact}
    produces = {"calibration_answers": CalibrationAnswersArtifact}

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        from hycoc.passes.head.prompts import prompt_source_key

        return {"prompt_source": prompt_source_key(recipe), "needs": reader_needs(recipe), "batch": BATCH}

    def files_read(self, recipe: Recipe) -> dict[str, Path]:
        # the chat template formats the prompts; generation_config.json gives the stop ids and generate()'s defaults
        from hycoc.chat_template import recipe_chat_files

        return recipe_chat_files(recipe)

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Artifact], PassReport]:
        from hycoc.progress import step

        need = reader_needs(recipe)
        t0 = time.perf_counter()
        total = decode_steps(need["train_count"], need["train_cap"]) + decode_steps(
            need["eval_count"], need["eval_cap"]
        )
        with step("verifier greedy answers, decoding steps", total=total) as s:
            answers = make_answers(
                inputs["torch_verifier"].payload, inputs["tokenizer"].payload, recipe, progress=s.advance
            )
        seconds = time.perf_counter() - t0
        train_tokens = sum(len(a) for _, a in answers.train)
        tokens = train_tokens + sum(len(a) for _, a in answers.eval)
        numbers = {
            "source": answers.source,
            **need,
            "train": len(answers.train),
            "eval": len(answers.eval),
            "answer_tokens": tokens,
            "train_answer_tokens": train_tokens,
            "seconds": round(seconds, 2),
            "tokens_per_second": round(tokens / max(seconds, 1e-9), 1),
            "batch": BATCH,
        }
        summary = (
            f"{len(answers.train)} + {len(answers.eval)} greedy answers ({tokens:,} tokens, <= {need['train_cap']} / "
            f"{need['eval_cap']}) in {seconds:.1f} s, {numbers['tokens_per_second']:,.0f} tokens/s"
        )
        return {"calibration_answers": CalibrationAnswersArtifact("calibration_answers", answers)}, PassReport(
            summary, numbers
        )


__all__ = [
    "BATCH",
    "CalibrationAnswers",
    "CalibrationAnswersArtifact",
    "CalibrationAnswersPass",
    "decode_steps",
    "greedy_answers",
    "make_answers",
    "reader_needs",
    "select_prompts",
]
