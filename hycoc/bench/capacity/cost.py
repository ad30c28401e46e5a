"""What one verifier step costs in `hycoc capacity`'s simulation (`hycoc.bench.capacity.simulation`): a `StepCost`.

A step (`hycoc.verifier.scheduler`'s) is one forward over the rounds it takes plus the host work per round around
it (p~, sampling, acceptance, compaction, hand-off, the reply frame) and prefill chunks. Three sources:

* `MeasuredStepCost` (`hycoc.bench.capacity.measure.measure_step_cost`): timed on this machine on the recipe's
  own verifier, the way the server runs it: `hycoc.verifier.batch.verify_batch` over n scratch sessions
  (`VerifierEngine.open`, prefilled), every session sending an r-row tree, for n in 1, 2, 4, 8, 16 and r in 2, 9,
  17, 33 (device-drafted), and n sessions of each place whose server runs the head (cloud-mtp, server-head), then
  each reply's `hycoc.protocol.wire.encode` (the worker encodes the reply frames inside its step:
  `verifier/scheduler.py` ``_step``); each point the mean CPU ms of the worker thread over a few calls
  (`time.thread_time`). A step of n device rounds with N rows in all is read off that grid (bilinear in n and
  N / n, linear beyond), each other draft place adding its own measured ms per session; the forward alone the same
  way (the budget's `BudgetState` learns host ms from step - forward, as the server's does). A least-squares line
  a + b n + c N is kept beside the grid for a file without one. Prefill: Session.prefill's ms at two prompt
  lengths, linear. The row budget's line is `hycoc.verifier.row_cost_measure.measure_row_cost` with the server's
  own plan (`row_cost_plan`): the same function and points the server measures before it serves. With it
  (`hycoc.bench.capacity.measure.cached_step_cost`) the per-round host work outside the step, measured on the
  recipe's own server (`hycoc.bench.capacity.host`): ``StepCost.host``. Beside the means: ``spread``, every timed
  device step's CPU ms / its point's mean (the simulation draws each step's ratio from it: the steps' tail), and
  ``budget_ms``, the row budget's own work per session (budgeted ``verify_batch`` steps of recorded scored trees
  with the server's `RowBudget` on the measured line, against the grid's step of the rows they kept). The toy's
  own cost "on this machine".
* `ModelStepCost`: a cost-model file (`hycoc.bench.cost_model.model`, e.g. the one ``hycoc bench`` stores or
  ``benchmarks/gpu_check.sh`` writes): forward ms = predict(rows, context) inside its measured rows; a batched
  forward beyond them scales linearly on a CPU and, on a GPU, as max(1, rows / GPU_FLAT_ROWS) x the largest
  measured forward (the H200 ridge point, `hycoc.bench.loadtest.report.GPU_FLAT_ROWS`); cloud-mtp rounds add K head
  steps; host ms per session is not in a cost model (an assumption, given).
* `RooflineStepCost` (`roofline_step_cost`): the real-shape projection's line from the verifier's own config
  (`hycoc.bench.capacity.gpu_cost`: the bytes and FLOPs of a batched forward, the MoE experts its rows touch, the
  sessions' KV reads, against a GPU's bandwidth and compute, fitted to the paper's two measured rounds); cloud-mtp and
  server-head sessions add K batched head steps; host ms per session assumed.
* `LineStepCost` (`line_step_cost`): a cost-model file with a MEASURED batched line (``batch_points``, written by
  ``benchmarks/gpu_check.sh`` on a GPU): the forward read off it, head steps and prefill off its grids.
"""

from __future__ import annotations

import json
import math
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hycoc.verifier.row_budget import RowCost

if TYPE_CHECKING:  # imported where a cost is made
    from hycoc.bench.capacity.gpu_cost import GpuRoofline
    from hycoc.bench.cost_model.model import CostModel

#: The statistic of a measured point: the MEAN of the worker thread's CPU ms (time.thread_time) over the repeats.
#: A queue's throughput and waits follow the mean service time (utilization = arrival rate x E[S]), so the mean is
#: the simulation's input; `hycoc.bench.cost_model.measure.BUSY_STATISTIC`'s 25th percentile is a steadier per-forward
#: figure but understated the load test's steps (toy, one 33-row round: p25 13.9 ms against ~19 ms rounds on a
#: quiet machine). CPU time leaves out the waiting for a CPU: machine load is the simulation's input (slowdown).
#: Assumed host ms per session and step on a GPU (sampling, acceptance, KV compaction, reply): not measured here.
ASSUMED_GPU_HOST_MS = 1.0


class StepCostError(ValueError):
    """A step cost that does not fit the recipe asked about (another model or shape) or cannot be read. One line
    naming the input and the fix."""


@dataclass
class StepCost(ABC):
    """Milliseconds of verifier steps (module docstring). Subclasses give `forward_ms`, `host_ms` and
    `prefill_ms` (abstract: a cost without one cannot be made)."""

    label: str = ""
    chain_length: int = 4
    #: The per-round host work outside the step (`hycoc.bench.capacity.host.HostOverhead`'s dict): measured with
    #: the toy's profile (`hycoc.bench.capacity.measure.cached_step_cost`), empty (none) for a cost-model file or
    #: the GPU assumptions.
    host: dict = field(default_factory=dict)
    #: Each timed step's CPU ms / its point's mean, over every measured device point (sorted; mean 1):
    #: `spread_factor` draws from it. Empty (no spread) for a cost-model file or the GPU assumptions.
    spread: tuple = ()
    #: Ms per session a budgeted step spends beyond a plain step of the rows it kept (`budget_step_ms`).
    budget_ms: float = 0.0
    #: A step that starts after the worker idled (`hycoc.bench.capacity.simulation.IDLE_GAP_MS` or more) costs this many
    #: times its back-to-back CPU ms (measured: `hycoc.bench.capacity.measure.measure_step_cost`'s
    #: ``idle_pairs``); 1 where not measured.
    idle_factor: float = 1.0

    def overhead(self):
        """The per-round host work outside the step: a `hycoc.bench.capacity.host.HostOverhead` (zeros when
        this cost has none)."""
        from hycoc.bench.capacity.host import HostOverhead

        return HostOverhead.from_dict(self.host)

    @abstractmethod
    def forward_ms(self, rows: int, sessions: int, context: float) -> float:
        """Ms of one batched forward of ``rows`` rows over ``sessions`` sessions at mean ``context`` positions."""

    @abstractmethod
    def host_ms(self, places: list[str], rows: list[int]) -> float:
        """Ms of a step's work outside the forward for rounds of draft places ``places`` holding ``rows`` rows."""

    @abstractmethod
    def prefill_ms(self, positions: int, context: int) -> float:
        """Ms of a prefill chunk of ``positions`` positions after ``context`` positions already in the KV."""

    def spread_factor(self, rng: np.random.Generator) -> float:
        """One step's cost / the mean cost of its (sessions, rows) point: a draw from the measured ratios
        (``spread``, a sample of repeat ms / point mean ms, mean 1); 1.0 without them (a cost model, the GPU
        assumptions). A queue's throughput follows the mean step, its latency tail the steps' spread."""
        return float(self.spread[int(rng.integers(len(self.spread)))]) if self.spread else 1.0

    def budget_step_ms(self, sessions: int) -> float:
        """Ms a budgeted step of ``sessions`` rounds spends choosing and restricting its rows
        (`hycoc.verifier.row_budget.RowBudget.choose`, ``Session.restrict_round``) beyond a step of the kept rows:
        ``budget_ms`` per session where measured, else 0."""
        return float(self.budget_ms) * sessions if sessions > 1 else 0.0

    def step_ms(self, places: list[str], rows: list[int], contexts: list[int]) -> tuple[float, float]:
        """(forward ms, whole step ms) of one step whose rounds come from sessions of ``places`` (draft places:
        device, cloud-mtp, server-head) with ``rows`` rows verified each (cloud-mtp: root + K chain) at
        ``contexts`` (their root positions)."""
        fwd = self.forward_ms(int(sum(rows)), len(rows), float(np.mean(contexts)) if contexts else 0.0)
        return fwd, fwd + self.host_ms(places, rows)

    def row_cost(self) -> RowCost:
        """The row budget's line (`hycoc.verifier.row_budget.RowCost`): what a budgeted server would measure."""
        pts = [(r, float(self.forward_ms(r, max(2, r // 33), 64.0))) for r in (32, 144, 272, 528)]
        return RowCost(tuple(pts), source=self.label)

    def describe(self) -> dict:
        return {"label": self.label}


@dataclass
class MeasuredStepCost(StepCost):
    """Fitted from `measure_step_cost`'s points (module docstring). step: (a, b, c) of a + b n + c rows, ms;
    forward: the same for the forward alone; place_ms: extra ms per session of a draft place (cloud-mtp,
    server-head) over a device round of the same rows; prefill: (p0, p1) of p0 + p1 x positions, ms;
    row_points: the budget's line as measured ((rows, ms), ...); points: every measured point; meta: load, date."""

    step: tuple[float, float, float] = (0.0, 0.0, 0.0)
    forward: tuple[float, float, float] = (0.0, 0.0, 0.0)
    place_ms: dict = field(default_factory=dict)
    prefill: tuple[float, float] = (0.0, 0.0)
    row_points: tuple = ()
    points: list = field(default_factory=list)
    meta: dict = field(default_factory=dict)

    def _grid(self, key: str, sessions: int, rows: int) -> float | None:
        """``key`` ("step_ms" or "forward_ms") of device rounds at ``sessions`` trees of rows / sessions rows each:
        bilinear on the measured (sessions, rows per tree) grid, linear beyond it (slope of the last two grid
        lines, >= 0), held below it; None without a full grid (then the linear fit answers)."""
        pts = [p for p in self.points if p["place"] == "device"]
        ns = sorted({p["sessions"] for p in pts})
        rs = sorted({p["rows"] // p["sessions"] for p in pts})
        table = {(p["sessions"], p["rows"] // p["sessions"]): p[key] for p in pts}
        if len(ns) < 2 or len(rs) < 2 or len(table) != len(ns) * len(rs):
            return None

        def interp(xs, x, f):
            i = int(np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2))
            lo, hi = f(xs[i]), f(xs[i + 1])
            w = (x - xs[i]) / (xs[i + 1] - xs[i])
            if w < 0:
                return lo
            if w > 1:
                return hi + max(0.0, hi - lo) * (w - 1)
            return lo + w * (hi - lo)

        r = rows / max(1, sessions)
        return float(interp(ns, float(sessions), lambda n: interp(rs, r, lambda k: table[(n, k)])))

    def forward_ms(self, rows: int, sessions: int, context: float) -> float:
        got = self._grid("forward_ms", sessions, rows)
        if got is not None:
            return got
        a, b, c = self.forward
        return max(0.0, a + b * sessions + c * rows)

    def host_ms(self, places: list[str], rows: list[int]) -> float:
        n, total = len(rows), sum(rows)
        extra = sum(self.place_ms.get(p, 0.0) for p in places)
        step = self._grid("step_ms", n, total)
        if step is None:
            a, b, c = self.step
            step = a + b * n + c * total
        return max(0.0, step - self.forward_ms(total, n, 0.0)) + extra

    def prefill_ms(self, positions: int, context: int) -> float:
        return self.prefill[0] + self.prefill[1] * positions if positions > 0 else 0.0

    def row_cost(self) -> RowCost:
        if len(self.row_points) >= 2:
            return RowCost(tuple((int(r), float(m)) for r, m in self.row_points), source=self.label)
        return super().row_cost()

    def describe(self) -> dict:
        return {
            "label": self.label,
            "step": self.step,
            "forward": self.forward,
            "place_ms": self.place_ms,
            "prefill": self.prefill,
            "row_points": self.row_points,
            "host": self.overhead().describe(),
            "spread_p10_p50_p90": [float(np.quantile(self.spread, q)) for q in (0.1, 0.5, 0.9)]
            if self.spread
            else None,
            "budget_ms": self.budget_ms,
            "idle_factor": self.idle_factor,
            "meta": self.meta,
        }

    def save(self, path: Path) -> Path:
        """Write as JSON atomically (temporary name + rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, path)
        return path

    @classmethod
    def load(cls, path: Path) -> MeasuredStepCost:
        """Read `save`'s file. Raises StepCostError naming the file and the fix."""
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
            d["step"], d["forward"], d["prefill"] = tuple(d["step"]), tuple(d["forward"]), tuple(d["prefill"])
            d["row_points"] = tuple(tuple(p) for p in d["row_points"])
            d["spread"] = tuple(d.get("spread", ()))
            d.pop("loop_ms", None)  # files before the host work was measured (always 0 there)
            return cls(**d)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise StepCostError(
                f"{path}: not a step-cost file of this hycoc ({type(e).__name__}: {e}); delete it to remeasure"
            ) from None


@dataclass
class GpuStepCost(StepCost):
    """A GPU step (module docstring): ``verify_ms(rows, context)`` of one forward within the measured rows,
    ``flat_rows`` rows per forward at that cost, linear beyond; ``head_ms``: one head step (cloud-mtp runs K per
    round, batched across sessions); ``host_ms_per_session``; ``prefill_ms_per_chunk`` of 512 positions."""

    verify: Callable[[int, float], float] = field(kw_only=True)  # (rows, context) -> ms
    max_rows: int = 33
    flat_rows: int = 206
    head_step_ms: float = 0.0
    host_ms_per_session: float = ASSUMED_GPU_HOST_MS
    prefill_chunk_ms: float = 0.0
    assumptions: list = field(default_factory=list)

    def forward_ms(self, rows: int, sessions: int, context: float) -> float:
        base = float(self.verify(min(rows, self.max_rows), context))
        if rows <= self.max_rows:
            return base
        top = float(self.verify(self.max_rows, context))
        return top * max(1.0, rows / self.flat_rows)

    def host_ms(self, places: list[str], rows: list[int]) -> float:
        from hycoc.verifier.draft_place import PLACES

        before = any(PLACES[p].server_chain_before for p in places)  # the chain drafted before the forward
        head = self.chain_length * self.head_step_ms if before else 0.0
        return head + self.host_ms_per_session * len(rows)

    def prefill_ms(self, positions: int, context: int) -> float:
        return self.prefill_chunk_ms * math.ceil(positions / 512) if positions > 0 else 0.0

    def row_cost(self) -> RowCost:
        top = float(self.verify(self.max_rows, 512))
        return RowCost(((1, top), (self.flat_rows, top), (2 * self.flat_rows, 2 * top)), source=self.label)

    def describe(self) -> dict:
        return {
            "label": self.label,
            "flat_rows": self.flat_rows,
            "head_step_ms": self.head_step_ms,
            "host_ms_per_session": self.host_ms_per_session,
            "assumptions": self.assumptions,
            "verify_33_ms": float(self.verify(self.max_rows, 512)),
        }


def model_step_cost(
    model, recipe_shape: dict | None, chain_length: int, *, host_ms: float = ASSUMED_GPU_HOST_MS, path: str = ""
) -> GpuStepCost:
    """A `GpuStepCost` from a cost-model file (`hycoc.bench.cost_model.model.CostModel`). recipe_shape: the recipe's
    verifier shape (`hycoc.bench.cost_model.measure.shape_of` keys) to check the file against; None: not checked.
    Raises StepCostError when the file's shape differs or it has no 33-row verification points."""
    from hycoc.bench.cost_model.model import CostModelError
    from hycoc.bench.loadtest.report import GPU_FLAT_ROWS

    if recipe_shape:
        diff = [k for k in recipe_shape if k in model.shape and model.shape[k] != recipe_shape[k]]
        if diff:
            k = diff[0]
            raise StepCostError(
                f"--cost-model {path}: measured on another model ({model.model}: {k} = "
                f"{model.shape[k]}, the recipe's verifier has {recipe_shape[k]}); measure this "
                "recipe's (benchmarks/verifier_cost_model.py --recipe RECIPE) or leave "
                "--cost-model out"
            )
    grid = model.rows_of("verify")
    top = int(grid[-1])
    gpu = "cpu" not in model.device.lower()
    try:
        head = model.predict(1, 512, "head_step") if "head_step" in model.kinds else 0.0
        prefill = (
            model.predict(int(model.rows_of("prefill")[-1]), 0, "prefill")
            if "prefill" in model.kinds
            else model.predict(top, 0)
        )
    except CostModelError as e:
        raise StepCostError(f"--cost-model {path}: {e}") from None
    return GpuStepCost(
        label=f"cost model {path} ({model.model}, {model.device})",
        chain_length=chain_length,
        verify=lambda rows, ctx: model.predict(max(int(grid[0]), int(rows)), int(ctx)),
        max_rows=top,
        flat_rows=GPU_FLAT_ROWS if gpu else top,
        head_step_ms=head,
        host_ms_per_session=host_ms,
        prefill_chunk_ms=prefill,
        assumptions=[
            f"forward beyond {top} rows: "
            + (f"flat to {GPU_FLAT_ROWS} rows (H200 ridge point), linear beyond" if gpu else "linear in rows"),
            f"host work {host_ms} ms per session and step (not in a cost model)",
        ],
    )


def _head_steps(places: list[str], chain_length: int) -> int:
    """Head steps a step of these places runs on the server (`hycoc.verifier.draft_place.DraftPlace.head_steps`):
    K when any session needs the head (its steps are batched across those sessions), else 0."""
    from hycoc.verifier.draft_place import PLACES

    return max((PLACES[p].head_steps(chain_length) for p in places), default=0)


def _plan_line(ms, tree_rows: int, max_batch_rows: int, label: str) -> RowCost:
    """The row budget's line as a live server would measure it (`hycoc.verifier.row_cost_measure.row_cost_plan`:
    n sessions x 2 .. B + 1 rows each), each point ``ms(rows, sessions)``."""
    from hycoc.verifier.row_cost_measure import row_cost_plan

    n, per = row_cost_plan(tree_rows, max_batch_rows, 1 << 20)
    return RowCost(tuple((n * r, float(ms(n * r, n))) for r in per), source=label)


@dataclass
class RooflineStepCost(StepCost):
    """The projection's GPU step from the model (module docstring): ``roof`` a
    `hycoc.bench.capacity.gpu_cost.GpuRoofline`; a step's forward is ``roof.forward_ms`` of its rows over its sessions'
    contexts, plus K batched head steps when a session's place needs the server head, plus ``host_ms_per_session`` per
    round; a prefill chunk is a forward of its positions. ``tree_rows`` / ``max_batch_rows``: the row budget's line plan
    (`_plan_line`)."""

    roof: GpuRoofline = field(kw_only=True)
    host_ms_per_session: float = ASSUMED_GPU_HOST_MS
    prefill_chunk: int = 512
    tree_rows: int = 33
    max_batch_rows: int = 528
    line_context: int = 512
    assumptions: list = field(default_factory=list)

    def forward_ms(self, rows: int, sessions: int, context: float) -> float:
        return float(self.roof.forward_ms(rows, [context] * max(1, sessions)))

    def host_ms(self, places: list[str], rows: list[int]) -> float:
        head = _head_steps(places, self.chain_length)
        ctx = [self.line_context] * len(places)
        return head * self.roof.head_step_ms(ctx) + self.host_ms_per_session * len(rows)

    def step_ms(self, places: list[str], rows: list[int], contexts: list[int]) -> tuple[float, float]:
        from hycoc.verifier.draft_place import PLACES

        fwd = float(self.roof.forward_ms(int(sum(rows)), list(contexts) or [0]))
        heads = [c for p, c in zip(places, contexts) if PLACES[p].needs_head]
        head = _head_steps(places, self.chain_length) * self.roof.head_step_ms(heads) if heads else 0.0
        return fwd, fwd + head + self.host_ms_per_session * len(rows)

    def prefill_ms(self, positions: int, context: int) -> float:
        total, done = 0.0, 0
        while done < positions:
            n = min(self.prefill_chunk, positions - done)
            total += self.roof.forward_ms(n, [context + done])
            done += n
        return total

    def row_cost(self) -> RowCost:
        return _plan_line(
            lambda r, n: self.forward_ms(r, n, self.line_context), self.tree_rows, self.max_batch_rows, self.label
        )

    def describe(self) -> dict:
        return {"label": self.label, "assumptions": self.assumptions, "host_ms_per_session": self.host_ms_per_session}


def roofline_step_cost(
    verifier_config: dict,
    head_config: dict | None,
    *,
    gpu: str,
    chain_length: int,
    tree_rows: int,
    max_batch_rows: int,
    verifier_source: str,
    head_source: str,
    context: int = 512,
    host_ms: float = ASSUMED_GPU_HOST_MS,
) -> RooflineStepCost:
    """The projection's line (`RooflineStepCost`) for a verifier config.json dict and its head's: eta and the
    per-layer ms fitted on the paper's GPU to its two rounds (`hycoc.bench.capacity.gpu_cost.fit_paper`, at
    ``context``), then priced on ``gpu`` (`hycoc.bench.capacity.gpu_cost.GPU_SPECS`). The assumptions list says every
    input's source."""
    from hycoc.bench.capacity.gpu_cost import (
        BF16_WEIGHTS,
        DEFAULT_GPU,
        PAPER_WEIGHTS,
        GpuRoofline,
        ModelShape,
        describe_line,
        fit_paper,
        gpu_spec,
    )
    from hycoc.bench.cost_model.model import PAPER_ROUND_MS

    shape = ModelShape.from_config(verifier_config, verifier_source)
    head = ModelShape.from_config(head_config, head_source) if head_config else None
    if head is None:
        raise StepCostError("the projection's cost line needs the MTP head's config (Cloud+MTP's head steps)")
    eff = fit_paper(
        shape,
        head,
        gpu_spec(DEFAULT_GPU),
        PAPER_WEIGHTS,
        tree_rows=tree_rows,
        chain_length=chain_length,
        hyco_ms=PAPER_ROUND_MS["hyco"],
        cloud_ms=PAPER_ROUND_MS["cloud-mtp"],
        host_ms=host_ms,
        context=context,
    )
    roof = GpuRoofline(shape, gpu_spec(gpu), PAPER_WEIGHTS, eff, head, BF16_WEIGHTS)
    assumptions = describe_line(roof, (context,)) + [
        f"verifier config: {verifier_source}; head config: {head_source} (Cloud+MTP's BF16 head, App. B)",
        f"host work {host_ms:g} ms per session and step (ASSUMED, not in the line); the paper's rounds include one",
        f"the fit's eta and per-layer ms are the paper GPU's; on {gpu} they are kept (ASSUMED) and the peak rates "
        "change"
        if gpu != DEFAULT_GPU
        else "GPU: the paper's, so the one-session rounds are the paper's 21.7 / 26.8 ms by construction",
        "MoE routing: every expert equally likely per row, rows independent (E(1 - (1 - k/E)^n) distinct experts); "
        "a trained router concentrates, so fewer (an upper bound)",
        "head steps: K per step with a cloud-mtp session, batched over those sessions (each reads its verifier KV)",
    ]
    return RooflineStepCost(
        label=f"MODEL: {shape.name} on {gpu_spec(gpu).name}, roofline fitted to the paper's rounds",
        chain_length=chain_length,
        roof=roof,
        host_ms_per_session=host_ms,
        tree_rows=tree_rows,
        max_batch_rows=max_batch_rows,
        line_context=context,
        assumptions=assumptions,
    )


@dataclass
class LineStepCost(StepCost):
    """A MEASURED batched line (`hycoc.bench.cost_model.model.CostModel.batch_points`, module docstring): a step's
    forward is ``model.batch_ms(rows, sessions)`` (at the file's one context), K batched head steps from its head_step
    grid (one session's step: batching head rows is ASSUMED free), ``host_ms_per_session`` per round; prefill chunks
    from its prefill grid."""

    model: CostModel = field(kw_only=True)
    host_ms_per_session: float = ASSUMED_GPU_HOST_MS
    tree_rows: int = 33
    max_batch_rows: int = 528
    assumptions: list = field(default_factory=list)

    def forward_ms(self, rows: int, sessions: int, context: float) -> float:
        return self.model.batch_ms(float(rows), float(max(1, sessions)))

    def _head_ms(self) -> float:
        m = self.model
        return m.predict(1, m.batch_context or int(m.contexts_of("head_step")[0]), "head_step")

    def host_ms(self, places: list[str], rows: list[int]) -> float:
        head = _head_steps(places, self.chain_length)
        return (head * self._head_ms() if head else 0.0) + self.host_ms_per_session * len(rows)

    def prefill_ms(self, positions: int, context: int) -> float:
        m = self.model
        top = int(m.rows_of("prefill")[-1])
        total, done = 0.0, 0
        while done < positions:
            n = min(top, positions - done)
            total += m.predict(max(int(m.rows_of("prefill")[0]), n), context + done, "prefill")
            done += n
        return total

    def row_cost(self) -> RowCost:
        return _plan_line(lambda r, n: self.forward_ms(r, n, 0.0), self.tree_rows, self.max_batch_rows, self.label)

    def describe(self) -> dict:
        return {"label": self.label, "assumptions": self.assumptions}


def line_step_cost(
    model, recipe_shape: dict | None, chain_length: int, *, tree_rows: int, max_batch_rows: int, path: str = ""
) -> StepCost:
    """The step cost of a cost-model FILE for the projection: its measured batched line when it has one
    (`LineStepCost`), else the older single-session grid (`model_step_cost`). Refuses (StepCostError, one line) a
    file measured on another model than the recipe's verifier (``recipe_shape``: its config's shape keys), or
    without head steps (Cloud+MTP cannot be priced)."""
    base = model_step_cost(model, recipe_shape, chain_length, path=path)
    if not model.batch_points:
        return base
    if "head_step" not in model.kinds:
        raise StepCostError(f"--cost-model {path}: no head_step points, so Cloud+MTP rounds cannot be priced")
    return LineStepCost(
        label=f"MEASURED batched line {path} ({model.model}, {model.device}, context {model.batch_context})",
        chain_length=chain_length,
        model=model,
        tree_rows=tree_rows,
        max_batch_rows=max_batch_rows,
        assumptions=[
            f"forward: the measured batched line of {path} ({len(model.batch_points)} points: sessions "
            f"{sorted({p.sessions for p in model.batch_points})}, rows {min(p.rows for p in model.batch_points)}-"
            f"{max(p.rows for p in model.batch_points)}), at context {model.batch_context}; linear beyond",
            "head steps: the file's one-session head step, K per step with a cloud-mtp session (batching ASSUMED free)",
            f"host work {ASSUMED_GPU_HOST_MS:g} ms per session and step (ASSUMED, not in a cost model)",
        ],
    )


__all__ = [
    "ASSUMED_GPU_HOST_MS",
    "LineStepCost",
    "RooflineStepCost",
    "line_step_cost",
    "roofline_step_cost",
    "GpuStepCost",
    "MeasuredStepCost",
    "StepCost",
    "StepCostError",
    "model_step_cost",
]
