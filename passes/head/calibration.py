"""Calibration inputs of the MTP head graph, fed exactly as the device runtime feeds it (paper App. A:
A16 ranges and the head's fixed input ranges from the calibration prompts and the verifier's greedy answers).

The hand-offs are real: the verifier engine (`hycoc.verifier.engine.VerifierEngine` over the pipeline's torch
verifier, the recipe's hand-off scales, W, K, pre/post-norm h) opens a session on each calibration prompt,
``prefill``\\s it, and verifies one tree per round at temperature 0 with exact acceptance: the root and a chain of
the next c tokens of the verifier's own greedy answer (`hycoc.passes.calibration_answers`, cut at its stop
tokens and at `answer_cap`), c cycling through 0..K, so the request follows the greedy answer and the hand-offs
carry 1..K+1 committed rows as on the device. Every ``RoundReply.handoff`` is a real int8
`hycoc.protocol.messages.HandOff` (the first one carries up to W prompt rows).

The feeds are the runtime's: each hand-off goes to the device runtime's own `hycoc.runtime.mtp_drafter.MtpDrafter`
(``ingest``: ring columns p mod W, live range, dequantized x_hat), and after the hand-offs that reach the answer offsets
`draft_rounds` picks (`DRAFTS_PER_PROMPT`, spread over the answer) the drafter runs ``draft()`` -- K head calls,
the first on the hand-off's x_hat, the next on [E[i]; h_next] -- through
`TorchHeadRunner`, which makes the FLOAT torch `hycoc.passes.head.graph.HeadGraph` look like a device graph
runner and records every feeds dict. So the samples hold what the device gives the head: the int8 hand-off's
values (outliers included), partly and fully filled rings, masks from `hycoc.host.ring_masks`, rotary rows at the
fixed query position, and the later drafting steps' queries.

Prompts and answers: the build's calibration answers (`hycoc.passes.calibration_answers`: the verifier's greedy
answers, made once for the head QAT and both calibrations), at most `CALIBRATION_PROMPTS` training prompts for the
ranges and `HELD_OUT_PROMPTS` evaluation prompts for the held-out SQNR (fewer when the source is small). The counts
are constants of this module, not recipe keys.

Import direction: this pass imports ``hycoc.runtime`` (numpy only), never the reverse.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from hycoc.runtime.mtp_drafter import MtpDrafter

from hycoc.host import head_sliding_positions

#: Prompts whose hand-offs calibrate the head's ranges.
CALIBRATION_PROMPTS = 16
#: Other prompts for the held-out SQNR report.
HELD_OUT_PROMPTS = 4
#: Rounds per request at which the drafter drafts (K recorded head calls each), spread over the answer.
DRAFTS_PER_PROMPT = 8
#: Most answer tokens one skip-ahead round commits (`drive_request`): a chain as long as the toy's node budget.
SKIP_ROWS = 32


class TorchHeadRunner:
    """The float torch `HeadGraph` as a device graph runner: ``shape(name)`` of an input (``shapes``: input name ->
    static shape), ``run(feeds)`` -> {"logits", "h_next"} float32 numpy. Records a copy of every feeds dict (the
    drafter's rings change in place) in ``records``; ``calls``: graph calls so far."""

    def __init__(self, graph, shapes: Mapping[str, Sequence[int]]):
        from hycoc.passes.head.graph import INPUT_NAMES, OUTPUT_NAMES

        self.graph, self.input_names, self.output_names = graph, INPUT_NAMES, OUTPUT_NAMES
        self.shapes = {k: tuple(int(d) for d in v) for k, v in shapes.items()}
        self.records: list[dict[str, np.ndarray]] = []
        self.calls = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return self.shapes[name]

    @torch.no_grad()
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        copied = {n: np.array(feeds[n], dtype=np.float32, copy=True) for n in self.input_names}
        outs = self.graph(*[torch.from_numpy(copied[n]) for n in self.input_names])
        self.records.append(copied)
        self.calls += 1
        return {
            name: y.detach().float().numpy().astype(np.float32, copy=True) for name, y in zip(self.output_names, outs)
        }


def runtime_bundle(
    recipe, keep_set: Sequence[int], embedding: tuple[np.ndarray, np.ndarray], rotary: Mapping, sliding_window: int
) -> SimpleNamespace:
    """What `MtpDrafter` reads from a `DeviceBundle`, made from the compiler's objects: the round constants K, D, W
    and the query offset (recipe), ``host.head.sliding_window`` (the positions the head's sliding layers read,
    `hycoc.host.head_sliding_positions`), the keep set, E (``embedding``:
    int8 q [|V|, H], float32 scale [|V|, 1], `hycoc.passes.head.graph.embedding_table`) with ``embed_keep``, and
    the head's rotary tables (`hycoc.passes.head.graph.rotary_tables`)."""
    q, scale = (np.asarray(embedding[0]), np.asarray(embedding[1], dtype=np.float32))
    rnd = SimpleNamespace(
        chain_length=recipe.tree.chain_length,
        sibling_depth=recipe.tree.sibling_depth,
        head_window=recipe.window.head_window,
        head_query_position_offset=recipe.window.head_query_position_offset,
    )

    def embed_keep(index: int) -> np.ndarray:  # as DeviceBundle.embed_keep
        return q[index].astype(np.float32) * scale[index, 0]

    return SimpleNamespace(
        round=rnd,
        host=SimpleNamespace(head=SimpleNamespace(sliding_window=int(sliding_window))),
        keep_set=np.asarray(keep_set, dtype=np.int64),
        head_embedding=(q, scale),
        head_rotary=dict(rotary),
        embed_keep=embed_keep,
    )


def handoff_scales(recipe) -> tuple[float, ...]:
    """The six hand-off scales (e, h, k_sliding, v_sliding, k_full, v_full) of ``[handoff]``; RecipeError if unset."""
    s = recipe.handoff.scales()
    return tuple(s[k] for k in ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full"))


def answer_cap(recipe) -> int:
    """Answer length cap: min(head_qat.calibration_max_new_tokens, 1.5 W): long enough that prompt + answer
    wraps the W-column ring, short enough to keep the verifier's rounds few."""
    w = recipe.window.head_window
    return max(1, min(recipe.head_qat.calibration_max_new_tokens, w + w // 2))


def draft_rounds(cap: int, phase: float, per_prompt: int = DRAFTS_PER_PROMPT) -> set[int]:
    """Rounds (0-based, < cap) at which to draft: ``per_prompt`` spread evenly, shifted by ``phase`` in [0, 1)."""
    n = min(per_prompt, cap)
    return {min(cap - 1, int(math.floor((j + phase) * cap / n))) for j in range(n)}


@dataclass
class HeadDrive:
    """What `drive_request` did for one prompt: verifier rounds, hand-offs ingested, drafts, answer tokens."""

    rounds: int = 0
    handoffs: int = 0
    drafts: int = 0
    answer_tokens: int = 0


def drive_request(
    engine,
    drafter: MtpDrafter,
    prompt: Sequence[int],
    cap: int,
    answer: Sequence[int] | None = None,
    targets: Sequence[int] | None = None,
    chain_length: int = 0,
    seed: int = 0,
) -> HeadDrive:
    """One request (module docstring): open, prefill, rounds at T = 0 with exact acceptance until the request
    finishes. A round's tree is the root and, with ``answer`` (the verifier's greedy answer), a chain of the next
    c answer tokens, c cycling through 0..``chain_length`` (accepted lengths as the device sees them; exact
    acceptance keeps the request on the greedy answer either way); without it the root alone. Each hand-off is
    ingested; ``draft()`` runs after a hand-off whose t' reaches the next of ``targets`` (answer offsets, sorted;
    every hand-off when None). Skip-ahead: with ``answer`` and ``targets``, while the next target is more than
    2 (K + 1) tokens away a round's chain is the next ``min(SKIP_ROWS, distance - 2 (K + 1))`` answer tokens, so
    the ring fills as before (every committed row reaches the drafter through the hand-offs) in far fewer
    verifier rounds, and the rounds before each draft still carry 1..K+1 rows."""
    from hycoc.protocol.messages import Sampling

    out = HeadDrive()
    session = engine.open(
        prompt,
        Sampling(temperature=0.0, top_k=1, top_p=1.0),
        seed=seed,
        acceptance="exact",
        epsilon=1.0,
        max_new_tokens=cap,
    )
    start = len(prompt) - 1
    pending = list(targets) if targets is not None else None
    try:
        session.prefill()
        near = 2 * (chain_length + 1)
        while not session.finished:
            pos = len(session.output)
            c = out.rounds % (chain_length + 1) if answer is not None else 0
            if answer is not None and pending:
                ahead = pending[0] + 1 - pos  # tokens to commit before the hand-off that drafts
                if ahead > near:
                    c = min(SKIP_ROWS, ahead - near)
            chain = [int(x) for x in (answer or [])[pos : pos + c]]
            reply = session.verify([session.root, *chain], list(range(-1, len(chain))), out.rounds)
            out.rounds += 1
            if reply.handoff is None:
                break
            drafter.ingest(reply.handoff)
            out.handoffs += 1
            if pending is None or (pending and reply.handoff.t_prime - start > pending[0]):
                while pending and reply.handoff.t_prime - start > pending[0]:
                    pending.pop(0)
                drafter.draft()
                out.drafts += 1
        out.answer_tokens = len(session.output)
    finally:
        session.close()
    return out


@dataclass
class HeadCalibration:
    """Recorded head feeds (graph input dicts) and what made them (``stats``, JSON-ready)."""

    samples: list[dict[str, np.ndarray]]
    stats: dict[str, Any]


def record_requests(
    engine,
    graph,
    shapes,
    bundle,
    prompts: Sequence[Sequence[int]],
    cap: int,
    *,
    answers: Sequence[Sequence[int]] | None = None,
    per_prompt: int = DRAFTS_PER_PROMPT,
    seed: int = 0,
    progress: Callable[[], None] | None = None,
) -> HeadCalibration:
    """Drive every prompt through `drive_request` with a fresh `MtpDrafter` over a recording `TorchHeadRunner`:
    ``per_prompt`` drafts at answer offsets spread over the answer (``cap`` tokens when ``answers`` is None).
    ``progress``: called once per prompt driven (`hycoc.progress.ticker`)."""
    runner = TorchHeadRunner(graph, shapes)
    drafter = MtpDrafter(runner, bundle)
    golden = (math.sqrt(5) - 1) / 2
    drives = []
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        drafter.reset()
        answer = None if answers is None else list(answers[i])
        n = cap if answer is None else max(1, min(cap, len(answer)))
        # the last answer token ends the request (no hand-off): targets among the first n - 1 offsets
        targets = sorted(draft_rounds(max(1, n - 1), (i * golden) % 1.0, per_prompt))
        drives.append(
            drive_request(engine, drafter, prompt, cap, answer, targets, bundle.round.chain_length, seed=seed + i)
        )
        if progress is not None:
            progress()
    w = bundle.round.head_window
    live = [int((s["mask_full"].reshape(-1) == 0).sum()) for s in runner.records]
    stats = {
        "prompts": len(prompts),
        "prompt_tokens": int(sum(len(p) for p in prompts)),
        "answer_tokens": int(sum(d.answer_tokens for d in drives)),
        "rounds": int(sum(d.rounds for d in drives)),
        "tokens_per_round": round(sum(d.answer_tokens for d in drives) / max(1, sum(d.rounds for d in drives)), 3),
        "drafts": int(sum(d.drafts for d in drives)),
        "samples": len(runner.records),
        "seconds": round(time.perf_counter() - start, 2),
        "live_columns": (
            {
                "min": min(live),
                "median": float(np.median(live)),
                "max": max(live),
                "full_ring_share": round(float(np.mean(np.asarray(live) >= w)), 3),
            }
            if live
            else {}
        ),
    }
    return HeadCalibration(runner.records, stats)


def real_head_calibration(
    verifier, quantized, onnx_inputs: Mapping[str, Sequence[int]], tokenizer, recipe, seed: int = 0, answers=None
) -> tuple[HeadCalibration, HeadCalibration, dict[str, Any]]:
    """(calibration, held-out, numbers) for the QAT head ``quantized`` (module docstring). onnx_inputs: the head
    graph's input name -> static shape. ``answers``: the build's `hycoc.passes.calibration_answers.CalibrationAnswers`
    (its first `CALIBRATION_PROMPTS` train and `HELD_OUT_PROMPTS` eval pairs, or all when fewer, answers cut at
    `answer_cap`); None makes them here (`make_answers`). Raises RecipeError (hand-off scales unset), HeadQatError
    (prompts)."""
    from hycoc.passes.calibration_answers import make_answers
    from hycoc.passes.head.graph import HeadGraph, embedding_table, rotary_tables
    from hycoc.passes.head.quantize import dequantized_head
    from hycoc.verifier.engine import VerifierEngine

    from hycoc.chat_template import chat_from_recipe
    from hycoc.progress import step, ticker

    rebuilt = dequantized_head(quantized)
    graph = HeadGraph(rebuilt).eval()
    sliding_window = head_sliding_positions(
        int(rebuilt.config.get_text_config().sliding_window), recipe.window.head_sliding_window_inclusive
    )
    q, scale = embedding_table(verifier, quantized.keep_set)
    bundle = runtime_bundle(
        recipe, quantized.keep_set, (q.numpy(), scale.numpy()), rotary_tables(rebuilt.config), sliding_window
    )
    cap = answer_cap(recipe)
    t0 = time.perf_counter()
    if answers is None:
        answers = make_answers(verifier, tokenizer, recipe)
    answer_s = time.perf_counter() - t0
    source = answers.source
    cal_prompts, cal_answers = answers.take("train", min(CALIBRATION_PROMPTS, len(answers.train)), cap)
    held_prompts, held_answers = answers.take("eval", min(HELD_OUT_PROMPTS, len(answers.eval)), cap)
    engine = VerifierEngine(
        verifier,
        head_window=recipe.window.head_window,
        chain_length=recipe.tree.chain_length,
        handoff_scales=handoff_scales(recipe),
        hidden=recipe.handoff.hidden,
        head_query_position_offset=recipe.window.head_query_position_offset,
        eos_token_ids=chat_from_recipe(recipe).stop_ids,
        device=verifier.device,
    )
    try:
        with step("hand-offs through the MTP Drafter: requests", total=len(cal_prompts) + len(held_prompts)) as s:
            tick = ticker(s)  # one advance per prompt: a count and ETA every progress.LINE_EVERY s
            cal = record_requests(
                engine, graph, onnx_inputs, bundle, cal_prompts, cap, answers=cal_answers, seed=seed, progress=tick
            )
            held = record_requests(
                engine,
                graph,
                onnx_inputs,
                bundle,
                held_prompts,
                cap,
                answers=held_answers,
                seed=seed + 1000,
                progress=tick,
            )
    finally:
        engine.close()  # removes the engine's hook from the shared verifier
    numbers = {
        "source": source,
        "answer_cap": cap,
        "answer_seconds": round(answer_s, 2),
        "drafts_per_prompt": DRAFTS_PER_PROMPT,
        "calibration": cal.stats,
        "held_out": held.stats,
    }
    return cal, held, numbers


__all__ = [
    "CALIBRATION_PROMPTS",
    "DRAFTS_PER_PROMPT",
    "HELD_OUT_PROMPTS",
    "HeadCalibration",
    "HeadDrive",
    "TorchHeadRunner",
    "answer_cap",
    "draft_rounds",
    "drive_request",
    "handoff_scales",
    "real_head_calibration",
    "record_requests",
    "runtime_bundle",
]
