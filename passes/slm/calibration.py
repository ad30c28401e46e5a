"""Calibration inputs of the SLM tree graph from real text, fed exactly as the device runtime feeds it (paper
App. A: A16 ranges from the calibration prompts and the verifier's greedy answers).

The text: the verifier's greedy answers to chat-formatted prompts, made once per build by
`hycoc.passes.calibration_answers` from the head QAT's prompt source (`hycoc.passes.head.prompts.prompt_sources`:
``head_qat.calibration_data``, else the keep-set corpus after the conversations the keep set counted, else the toy
corpus). The first ``slm_calibration.prompts`` training prompts calibrate; the first ``max(2, prompts // 4)``
evaluation prompts (other prompts) give the held-out samples for the SQNR report. Answers are capped at
``min(head_qat.calibration_max_new_tokens, 2 * window.slm_window)`` tokens: enough to wrap the ring once.

The inputs: the device runtime's own SLM side (`hycoc.runtime.slm_drafter.SlmDrafter` and
`hycoc.runtime.tree_builder.TreeBuilder`, numpy only) drives `TorchSlmRunner`, which makes the FLOAT torch
`hycoc.passes.slm.graph.SlmTreeGraph` look like a device graph runner (``shape``, ``run``) and records the feeds
it is given. Per sequence, as `hycoc.runtime.client.DeviceRuntime` runs a request (`drive_sequence`):

* ``start(prompt)``, ``prefill(reserve=K + D)``; the first tree is the SLM's alone (no hand-off yet);
* teacher-forced rounds over the answer: the chain is the next K answer tokens (what the MTP head drafts when it is
  right), one runner-up sibling at each depth 1..D (a random keep-set token other than the chain's: the head's
  runner-up is a plausible alternative, not the answer), ``TreeBuilder.build(..., expand=slm.expand)`` as the
  runtime calls it (Alg. 3: the SLM forward sees the real tree shapes, candidates, trim);
* the verifier's reply is simulated at T = 0: the accepted path follows the answer through the kept tree (the
  lowest row first, as `hycoc.runtime.tree_builder.walk_reply`), cut at an accepted length that cycles through
  0..K (an offset per sequence), then the true next token is the bonus; ``commit(path_nodes, new)``. The chain
  stops before an answer token outside the keep set (the head drafts over the keep set only).

So the rings hold the SLM's own K/V, written by the runtime's commit rule, and the masks, rotary rows and padding
are the runtime's. Every graph call (prefill chunks included) is a candidate sample; `SAMPLES_PER_PROMPT` of each
sequence's calls are kept, at root positions spread over the sequence (targets at fractions (j + u) / n of the
answer, u a per-prompt offset), so the samples cover ring fills from the prompt's length to a full, wrapped ring.
Between targets the drive skips ahead (`drive_sequence`'s ``targets``): the answer up to a few rounds before the
next target is committed at once and the drafter's ``prefill`` computes its K/V in R-row chunks, so only the
rounds around each sample run trees (the toy: ~1,000 rounds for 8 prompts otherwise).
Coverage note: a short prompt with a short answer only reaches small fills; `coverage` reports the live ring
columns of the kept samples (min / quartiles / max, and how many saw a full ring) so a thin coverage shows.

Import direction: this pass imports ``hycoc.runtime`` (numpy only), never the reverse.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from hycoc.runtime.slm_drafter import SlmDrafter
from hycoc.runtime.tree_builder import TreeBuilder

#: Graph calls kept per calibration sequence.
SAMPLES_PER_PROMPT = 4


class TorchSlmRunner:
    """The float torch `SlmTreeGraph` as a device graph runner: ``shape(name)`` of an input, ``run(feeds)`` ->
    {output name: float32 numpy}. Records the feeds of the calls ``keep(index, feeds)`` accepts (all calls when
    ``keep`` is None), copied (the drafter's rings change in place), with ``meta`` -- whatever ``context()``
    returns at call time -- and, with ``keep_outputs``, the outputs. ``calls``: graph calls so far."""

    def __init__(self, graph, *, keep=None, context=None, keep_outputs: bool = False):
        self.graph = graph
        self.keep, self.context, self.keep_outputs = keep, context, keep_outputs
        self.records: list[dict[str, Any]] = []
        self.calls = 0

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.graph.input_shapes[name])

    @torch.no_grad()
    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n], dtype=np.float32)) for n in self.graph.input_names]
        outs = self.graph(*args)
        result = {
            name: y.detach().numpy().astype(np.float32, copy=True) for name, y in zip(self.graph.output_names, outs)
        }
        index = self.calls
        self.calls += 1
        if self.keep is None or self.keep(index, feeds):
            rec = {
                "index": index,
                "feeds": {n: np.array(feeds[n], dtype=np.float32, copy=True) for n in self.graph.input_names},
                "meta": dict(self.context()) if self.context is not None else {},
            }
            if self.keep_outputs:
                rec["outputs"] = result
            self.records.append(rec)
        return result


def runtime_bundle(graph, slm, keep_set: Sequence[int] | np.ndarray) -> SimpleNamespace:
    """What `SlmDrafter` reads from a `DeviceBundle`, made from the compiler's objects: the host section (layer
    types, ring layers, sliding window, per-layer dim), the SLM's LUTs and rotary tables, the keep set."""
    host = SimpleNamespace(
        slm=SimpleNamespace(
            layer_types=list(graph.layer_types),
            kv_layers=list(graph.kv_layers),
            sliding_window=int(graph.config.sliding_window),
            per_layer_dim=int(graph.ple),
        )
    )
    return SimpleNamespace(
        host=host, slm_luts=slm.luts, slm_rotary=slm.rotary, keep_set=np.asarray(keep_set, dtype=np.int64)
    )


def live_columns(feeds: Mapping[str, np.ndarray], ring: int, name: str = "mask_full") -> int:
    """Live ring columns of a sample: the ring columns row 0 sees in ``name`` (full attention sees them all)."""
    return int((feeds[name][0, 0, 0, :ring] == 0).sum())


@dataclass
class SequenceDrive:
    """What `drive_sequence` did for one sequence: graph calls, rounds, committed answer tokens, the accepted
    lengths of the rounds."""

    calls: int = 0
    rounds: int = 0
    committed: int = 0
    accepted: list[int] = field(default_factory=list)


def accepted_path(built, answer: Sequence[int], start: int, cap: int) -> list[int]:
    """The rows of the longest path below the root whose tokens are ``answer[start:]`` (the lowest matching row
    at each step, as `walk_reply`), at most ``cap`` rows."""
    tokens, parents = np.asarray(built.tokens), np.asarray(built.parents)
    n = len(built.row_node)  # unpadded rows
    path: list[int] = []
    v = 0
    while len(path) < cap and start + len(path) < len(answer):
        want = answer[start + len(path)]
        kids = [j for j in range(1, n) if parents[j] == v and tokens[j] == want]
        if not kids:
            break
        v = min(kids)
        path.append(v)
    return path


@dataclass(frozen=True)
class DriveSettings:
    """The rounds `drive_sequence` drives, as the recipe's ``[tree]`` table sets them: chain_length K (answer tokens
    the MTP head's chain plants per round), sibling_depth D (runner-up siblings at depths 1..D), ln_lambda (ln of
    the depth cost λ, `TreeBuilder`'s), candidates (SLM candidates per expanded row), passes (SLM forwards per
    round), stop_ids (the chat's end-of-turn ids: a round committing one ends the sequence)."""

    chain_length: int
    sibling_depth: int
    ln_lambda: float
    candidates: int
    passes: int
    stop_ids: frozenset[int] = frozenset()

    @classmethod
    def from_tree(cls, tree, stop_ids: Collection[int] = ()) -> DriveSettings:
        """The settings of a recipe's ``[tree]`` (`hycoc.recipe.Tree`) with ``stop_ids``: ln_lambda = ln(depth_cost),
        candidates = slm_candidates, passes = slm_passes."""
        return cls(
            tree.chain_length,
            tree.sibling_depth,
            math.log(tree.depth_cost),
            tree.slm_candidates,
            tree.slm_passes,
            frozenset(stop_ids),
        )


def drive_sequence(
    slm: SlmDrafter,
    builder: TreeBuilder,
    prompt: Sequence[int],
    answer: Sequence[int],
    settings: DriveSettings,
    *,
    rng: np.random.Generator,
    keep_set: np.ndarray,
    targets: Callable[[], Sequence[float]] | None = None,
    warmup: int = 2,
) -> SequenceDrive:
    """One request through the runtime's SLM side, teacher-forced on ``answer`` (module docstring), its rounds as
    ``settings`` says (K, D, the stop ids).

    targets: returns the root positions where samples are still to be taken (sorted), or None to run every round. With
    targets, stretches more than ``warmup`` rounds before the next target are committed in one go and filled by the
    drafter's own ``prefill`` chunks (as a request start does), and the drive ends after the last target: the
    rings still hold the SLM's own K/V of every committed position, at a fraction of the forwards."""
    chain_length, sibling_depth, stop_ids = settings.chain_length, settings.sibling_depth, settings.stop_ids
    calls0 = slm.forwards
    in_keep = set(np.asarray(keep_set).tolist())
    out = SequenceDrive()
    slm.start(prompt)
    slm.prefill(reserve=chain_length + sibling_depth)
    built = builder.build(slm.tokens[-1], [], [], slm.expand)  # the first tree: SLM alone
    offset = int(rng.integers(0, chain_length + 1))
    pos = 0
    while pos < len(answer):
        cap = (out.rounds + offset) % (chain_length + 1)
        path = accepted_path(built, answer, pos, cap)
        new = [int(x) for x in answer[pos : pos + len(path) + 1]]  # the path's tokens and the bonus
        slm.commit([built.row_node[j] for j in path], new)
        out.rounds += 1
        out.accepted.append(len(path))
        pos += len(new)
        if pos >= len(answer) or new[-1] in stop_ids:
            break
        if targets is not None:
            ahead = list(targets())
            if not ahead:
                break
            jump = int(math.ceil(ahead[0])) - warmup * (chain_length + 1) - slm.t
            if jump > 0 and pos + jump < len(answer):
                slm.commit([], [int(x) for x in answer[pos : pos + jump]])
                pos += jump
                slm.prefill(reserve=chain_length + sibling_depth)
        chain = []  # the head drafts over the keep set only
        for y in answer[pos : pos + chain_length]:
            if int(y) not in in_keep:
                break
            chain.append(int(y))
        runner_ups = []
        for y in chain[:sibling_depth]:
            alt = int(keep_set[rng.integers(0, len(keep_set))])
            runner_ups.append(alt if alt != y else int(keep_set[(np.searchsorted(keep_set, y) + 1) % len(keep_set)]))
        built = builder.build(slm.tokens[-1], chain, runner_ups, slm.expand)
    out.committed = pos
    out.calls = slm.forwards - calls0
    return out


@dataclass
class RealCalibration:
    """Samples (graph input dicts) and what made them: ``meta`` per sample (root position t, prompt index,
    first position, live_start, tokens, parents, live columns), ``stats`` (JSON-ready)."""

    samples: list[dict[str, np.ndarray]]
    meta: list[dict[str, Any]]
    stats: dict[str, Any]


def record_sequences(
    graph,
    slm,
    keep_set: Sequence[int],
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    settings: DriveSettings,
    *,
    per_prompt: int = SAMPLES_PER_PROMPT,
    seed: int = 0,
    keep_all: bool = False,
    keep_outputs: bool = False,
    progress: Callable[[], None] | None = None,
) -> RealCalibration:
    """Drive every (prompt, answer) through `drive_sequence` (rounds as ``settings`` says) and keep ``per_prompt``
    graph calls of each (all of them with ``keep_all``; their outputs too with ``keep_outputs``). Module docstring
    for the choice. ``progress``: called once per (prompt, answer) driven (`hycoc.progress.ticker`)."""
    keep = np.asarray(keep_set, dtype=np.int64)
    rng = np.random.default_rng(seed)
    choice = _SampleChoice(keep_all)
    runner = TorchSlmRunner(graph, keep=choice.keep, context=choice.context, keep_outputs=keep_outputs)
    drafter = choice.watch(SlmDrafter(runner, runtime_bundle(graph, slm, keep)))
    builder = TreeBuilder(
        ln_lambda=settings.ln_lambda,
        budget=graph.rows,
        rows=graph.rows + 1,
        candidates=settings.candidates,
        passes=settings.passes,
        keep_set=keep,
        stop_ids=sorted(settings.stop_ids),
    )
    drives = []
    start = time.perf_counter()
    golden = (math.sqrt(5) - 1) / 2
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        u = (i * golden) % 1.0
        t0 = len(prompt) - 1
        choice.begin(i, [t0 + (j + u) / per_prompt * max(1, len(answer)) for j in range(per_prompt)])
        targets = None if keep_all else choice.ahead
        drives.append(
            drive_sequence(drafter, builder, prompt, answer, settings, rng=rng, keep_set=keep, targets=targets)
        )
        if progress is not None:
            progress()
    seconds = time.perf_counter() - start
    ring = graph.ring[max(graph.ring, key=graph.ring.get)]
    full = f"mask_{max(graph.ring, key=graph.ring.get).removesuffix('_attention')}"
    samples, meta = [], []
    for rec in runner.records:
        samples.append(rec["feeds"])
        m = dict(rec["meta"], call=rec["index"], live_columns=live_columns(rec["feeds"], ring, full))
        if keep_outputs:
            m["outputs"] = rec["outputs"]
        meta.append(m)
    stats = {
        "sequences": len(drives),
        "prompt_tokens": int(sum(len(p) for p in prompts)),
        "answer_tokens": int(sum(len(a) for a in answers)),
        "graph_calls": runner.calls,
        "rounds": int(sum(d.rounds for d in drives)),
        "accepted_mean": round(float(np.mean([a for d in drives for a in d.accepted] or [0])), 3),
        "samples": len(samples),
        "seconds": round(seconds, 2),
        "coverage": coverage(meta, ring),
    }
    return RealCalibration(samples, meta, stats)


class _SampleChoice:
    """Which graph calls `record_sequences` keeps, and what it notes of each: ``keep(index, feeds)`` takes every
    call with ``keep_all``, else the first call at or past each of the sequence's target root positions (`begin`
    sets them, `ahead` lists those still to come); ``context()`` is the call's rows (tokens, parents, first
    position, live_start, noted by the drafter `watch` wraps), the prompt index and the root position t."""

    def __init__(self, keep_all: bool):
        self.keep_all = keep_all
        self.slm: SlmDrafter | None = None
        self.call: dict[str, Any] = {}
        self.prompt, self.next = 0, 0
        self.targets: list[float] = []

    def watch(self, slm: SlmDrafter) -> SlmDrafter:
        """``slm`` with its ``feeds`` wrapped to note the rows of each call."""
        self.slm, feeds_of = slm, slm.feeds

        def feeds(tokens, parents, first_position, *rest):  # note the rows of each call for `meta`
            self.call = {
                "tokens": [int(x) for x in tokens],
                "parents": [int(x) for x in parents],
                "first_position": int(first_position),
                "live_start": int(slm.live_start),
            }
            return feeds_of(tokens, parents, first_position, *rest)  # rest: SlmDrafter.feeds' optional arguments

        slm.feeds = feeds  # type: ignore[method-assign]  # a per-instance wrapper, to note each call's rows
        return slm

    def begin(self, prompt: int, targets: list[float]) -> None:
        self.prompt, self.next, self.targets = prompt, 0, targets

    def ahead(self) -> list[float]:
        return self.targets[self.next :]

    def keep(self, index: int, feeds) -> bool:
        if self.keep_all:
            return True
        if self.slm is None:
            raise RuntimeError("the sample choice needs watch(slm) before keep")
        if self.next < len(self.targets) and self.slm.t >= self.targets[self.next]:
            self.next += 1
            return True
        return False

    def context(self) -> dict[str, Any]:
        if self.slm is None:
            raise RuntimeError("the sample choice needs watch(slm) before context")
        return dict(self.call, prompt=self.prompt, t=self.slm.t)


def coverage(meta: Sequence[Mapping[str, Any]], ring: int) -> dict[str, Any]:
    """Live ring columns of the kept samples: min, quartiles, max, distinct values, and the share at a full ring."""
    fills = np.asarray([m["live_columns"] for m in meta], dtype=np.int64)
    if not len(fills):
        return {"ring": ring}
    q = np.percentile(fills, [25, 50, 75])
    return {
        "ring": ring,
        "min": int(fills.min()),
        "q25": float(q[0]),
        "median": float(q[1]),
        "q75": float(q[2]),
        "max": int(fills.max()),
        "distinct": int(len(set(fills.tolist()))),
        "full_ring_share": round(float((fills >= ring).mean()), 3),
    }


# ---- prompts and answers from the recipe ----------------------------------------------------------------------


def answer_cap(recipe) -> int:
    """Answer length cap: min(head_qat.calibration_max_new_tokens, 2 * window.slm_window)."""
    return max(1, min(recipe.head_qat.calibration_max_new_tokens, 2 * recipe.window.slm_window))


def held_out_count(recipe) -> int:
    """Held-out prompts for the SQNR report: max(2, slm_calibration.prompts // 4)."""
    return max(2, recipe.slm_calibration.prompts // 4)


def real_calibration(
    graph, slm, keep_set, verifier, tokenizer, recipe, seed: int = 0, answers=None
) -> tuple[RealCalibration, RealCalibration, dict[str, Any]]:
    """(calibration, held-out, numbers): the first ``slm_calibration.prompts`` training and `held_out_count`
    evaluation pairs of the build's calibration answers (``answers``, a
    `hycoc.passes.calibration_answers.CalibrationAnswers`; None makes them here), cut at `answer_cap`, each driven
    through the runtime's SLM side (module docstring). Raises ValueError when ``answers`` holds too few."""
    from hycoc.passes.calibration_answers import make_answers

    from hycoc.chat_template import chat_from_recipe
    from hycoc.progress import step, ticker

    stops = chat_from_recipe(recipe).stop_ids
    cap = answer_cap(recipe)
    t0 = time.perf_counter()
    if answers is None:
        answers = make_answers(verifier, tokenizer, recipe)
    answer_s = time.perf_counter() - t0
    cal_prompts, cal_answers = answers.take("train", recipe.slm_calibration.prompts, cap)
    held_prompts, held_answers = answers.take("eval", held_out_count(recipe), cap)
    settings = DriveSettings.from_tree(recipe.tree, stops)
    with step("answers through the SLM Drafter", total=len(cal_prompts) + len(held_prompts)) as s:
        tick = ticker(s)  # one advance per answer: a count and ETA every progress.LINE_EVERY s
        cal = record_sequences(graph, slm, keep_set, cal_prompts, cal_answers, settings, seed=seed, progress=tick)
        held = record_sequences(
            graph, slm, keep_set, held_prompts, held_answers, settings, seed=seed + 1, progress=tick
        )
    numbers = {
        "source": answers.source,
        "answer_cap": cap,
        "answer_seconds": round(answer_s, 2),
        "samples_per_prompt": SAMPLES_PER_PROMPT,
        "calibration": cal.stats,
        "held_out": held.stats,
    }
    return cal, held, numbers


__all__ = [
    "SAMPLES_PER_PROMPT",
    "DriveSettings",
    "RealCalibration",
    "SequenceDrive",
    "TorchSlmRunner",
    "accepted_path",
    "answer_cap",
    "coverage",
    "drive_sequence",
    "held_out_count",
    "live_columns",
    "real_calibration",
    "record_sequences",
    "runtime_bundle",
]
