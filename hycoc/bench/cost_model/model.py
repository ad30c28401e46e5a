"""Verifier cost model: server milliseconds of every forward the verifier runs, as a function of its rows and
context (docs/benchmarks.md "Benchmark": g projected; paper App. G).

`hycoc bench` measures g (server ms per output token, paper App. G) on whatever machine it runs on -- for the toy
family that is a laptop CPU. To say what g would be on the paper's GPU, it replays the work the server did (every
forward of every round, and the prefill chunks) through a cost model measured on that GPU:

    CostModel.predict(rows, context, kind) -> ms of one forward of that kind

A cost model is a grid of measured points {kind, rows, context, ms} per kind, written as JSON by
``benchmarks/verifier_cost_model.py`` (``--device cuda``: Gemma 4 26B-A4B shape, random bf16 weights, one GPU;
``--device cpu --recipe recipes/toy.toml``: the toy verifier with its real weights).

The three kinds of forward (`KINDS`), what a point's ``rows`` and ``context`` mean for each, and who runs them:

* ``verify``: one tree-verification forward (Alg. 4 lines 1-3), every round of every draft place. rows = R, the
  tree's rows: B + 1 = 33 for a HyCo tree (B = 32), K + 1 = 5 for a Cloud+MTP chain (K = 4), 1 for the verifier
  alone; context = t, positions already in the KV cache (the round's root position).
* ``head_step``: one step of the MTP head on the server (one query row; `hycoc.verifier.baselines.draft_cloud_chain`:
  head forward, greedy arg-max, the next input's embedding). rows = 1; context = the verifier KV positions the head
  reads. Cloud+MTP runs K of them BEFORE each verification, reading every committed position (context t);
  server-head runs K AFTER each verification that does not finish the request, reading the W-window
  (context min(W, t')). Device drafting (HyCo, SpecEdge) runs none on the server: that is the point of HyCo (§3.1:
  moving the head to the device takes the server's median round from 26.8 to 21.7 ms).
* ``prefill``: one causal prefill chunk (`hycoc.verifier.forward.prefill`, logits of the last row only). rows = the
  chunk's positions n (at most the engine's chunk, `PREFILL_CHUNK`); context = the positions cached before it.
  A request's prompt (all but its last token) and a second turn's appended tokens are prefilled in such chunks.

``ms``: milliseconds of that forward as the reference engine runs it (explicit 4-D masks, a ``DynamicCache`` that
keeps every position), median of repeated runs after warm-up (a model whose ``meta.statistic`` is a percentile, e.g.
"p25", keeps that percentile instead: `hycoc bench` times busy CPU time and keeps its 25th percentile). The rest of a
round (sampling, acceptance, KV compaction, hand-off packing; Alg. 4 lines 5-14) is NOT in it: on a GPU it is a small,
context-independent part of a round, and the bench measures it on its own machine if it wants it.

Prediction (`CostModel.predict`): each kind's points must form a full rectangular grid (every measured rows value
at every measured context). Between grid lines the model is bilinear in (rows, context). Beyond the largest
context it extrapolates linearly with the slope of the last two contexts at that rows value, with the slope
clamped to >= 0 (so a prediction is never below the nearest measured point: attention work only grows with t).
Below the smallest context it holds the value at the smallest context (no downward extrapolation: a short
cache is dominated by weight reads, and holding is the conservative choice). Rows outside the measured range, and
a kind the model has no points of, are errors (`CostModelError`): measure them (``--rows``) rather than guess; the
device pads HyCo trees to B + 1 rows, so the default grid 1, 5, 33 covers every Table 5 configuration at the
paper's K and B.

Replay (`round_forwards`, `prefill_forwards`: `hycoc.bench.cost_model.forwards`, re-exported here; `request_forwards`):
the forwards the engine runs for one round of a draft place (what the place does asked of its
`hycoc.verifier.draft_place.DraftPlace`), or for one bench record (`hycoc.bench.paper.summary` record), in the engine's
order; `forwards_ms` sums their predictions. `tests/test_device_path.py` holds the account against the forwards
the real engine runs.

The batched line (``batch_points``, optional; ``benchmarks/verifier_cost_model.py --batch-sessions``, which
``benchmarks/gpu_check.sh`` runs): ms of ONE batched verification forward (`hycoc.verifier.batch.batch_forward`, the
server's) of ``sessions`` sessions whose rows add up to ``rows``, each session at ``batch_context`` cached positions:
what `hycoc capacity`'s projection reads (`batch_ms`), bilinear in (sessions, rows) between measured points and
linear beyond them (`hycoc.bench.capacity.cost.line_step_cost`).

Files: schema_version 2 (points carry ``kind``). A schema 1 file (verification points only, from an older hycoc)
still loads; its points are ``verify`` points, and replaying head steps or prefill through it is an error naming
the fix (remeasure).

Core module: numpy + pydantic only, no torch, so the bench and the tests can load a model anywhere.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hycoc.bench.cost_model.forwards import (  # re-exported: the forwards a round runs, replayed through a model
    DRAFT_PLACE_OF,
    PREFILL_CHUNK,
    CostModelError,
    Forward,
    prefill_forwards,
    round_forwards,
    round_place,
)
from hycoc.bench.files import replacing

SCHEMA_VERSION: Final = 2
#: Schema versions `load_cost_model` reads (1: verification points only, no ``kind``).
READABLE_SCHEMAS = (1, 2)

#: The kinds of forward a cost model times (module docstring).
KINDS = ("verify", "head_step", "prefill")

#: The paper's median server ms per round on one RTX PRO 6000 (§3.1): HyCo's (verification only, the head on the
#: device) and Cloud+MTP's (K head steps + verification on the server).
PAPER_ROUND_MS = {"hyco": 21.7, "cloud-mtp": 26.8}

#: How to make a cost model file; named in every load error.
MAKE_HINT = (
    "make one with `python benchmarks/verifier_cost_model.py --device cuda --out PATH` (GPU, Gemma 4 "
    "26B-A4B shape) or `--device cpu --recipe recipes/toy.toml --out PATH` (the toy verifier)"
)


class CostPoint(BaseModel):
    """One measured point: ``ms`` milliseconds for one forward of ``kind`` with ``rows`` rows after ``context``
    cached positions (see the module docstring for what rows and context mean per kind)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["verify", "head_step", "prefill"] = Field("verify", description="which forward (KINDS)")
    rows: int = Field(ge=1, description="rows of the forward: R tree rows, 1 head query, n prefill positions")
    context: int = Field(ge=0, description="t, positions already in the KV cache")
    ms: float = Field(
        gt=0,
        allow_inf_nan=False,
        description="milliseconds of the forward: the median of samples_ms, or the percentile meta.statistic names",
    )
    samples_ms: list[float] | None = Field(
        None,
        description="every timed repetition behind ms, in measurement order (absent in files that predate "
        "them); `bootstrap_tables` resamples them for the projection's interval",
    )


class BatchPoint(BaseModel):
    """One measured batched forward: ``ms`` for ``sessions`` sessions with ``rows`` rows in all (module docstring's
    batched line)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sessions: int = Field(ge=1, description="sessions whose rounds share the forward")
    rows: int = Field(ge=1, description="rows of the forward, all sessions together")
    ms: float = Field(gt=0, allow_inf_nan=False, description="median ms of the forward")
    samples_ms: list[float] | None = Field(None, description="every timed repetition behind ms")

    @model_validator(mode="after")
    def _rows_cover_sessions(self) -> BatchPoint:
        if self.rows < self.sessions:
            raise ValueError(f"batch point: {self.rows} rows for {self.sessions} sessions (each sends >= 1 row)")
        return self


class CostModel(BaseModel):
    """A measured grid of verification-forward costs on one device (see the module docstring for units).

    Fields:
      schema_version: 2 (1 is read: verification points only).
      device: the machine, in words (e.g. "NVIDIA H200", "cpu: 1 thread").
      dtype: the verifier's weight/activation dtype ("bfloat16", "float32").
      model: what was timed (e.g. "Gemma 4 26B-A4B shape, random weights").
      shape: the model's shape (layers, hidden size, heads, experts, vocabulary, ...), free-form numbers.
      points: the grids, one per kind; per kind every rows value at every context, no duplicates (validated).
      batch_points: the batched line (module docstring; optional), at ``batch_context`` cached positions each.
      source: "measured" (timed in this process) or "file" (read by `load_cost_model`).
      meta: how it was measured (warm-up, repeats, torch/transformers versions, date, ...), free-form.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1, 2] = SCHEMA_VERSION
    device: str = Field(min_length=1)
    dtype: str = Field(min_length=1)
    model: str = Field(min_length=1)
    shape: dict[str, Any] = Field(default_factory=dict)
    points: list[CostPoint] = Field(min_length=1)
    batch_points: list[BatchPoint] = Field(default_factory=list)
    batch_context: int = Field(0, ge=0, description="cached positions per session of every batch point")
    source: Literal["measured", "file"] = "measured"
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _full_grid(self) -> CostModel:
        for kind in KINDS:
            seen: set[tuple[int, int]] = set()
            for p in self.points:
                if p.kind != kind:
                    continue
                if (p.rows, p.context) in seen:
                    raise ValueError(f"points: {kind} rows={p.rows}, context={p.context} appears twice; keep one")
                seen.add((p.rows, p.context))
            rows, ctxs = sorted({r for r, _ in seen}), sorted({c for _, c in seen})
            missing = [(r, c) for r in rows for c in ctxs if (r, c) not in seen]
            if missing:
                r, c = missing[0]
                raise ValueError(
                    f"points: the {kind} grid is incomplete: {len(missing)} of {len(rows) * len(ctxs)} "
                    f"(rows, context) pairs missing, first rows={r}, context={c}; every rows value "
                    f"{rows} must be measured at every context {ctxs}"
                )
        if not any(p.kind == "verify" for p in self.points):
            raise ValueError("points: no verify points; every cost model times the verification forward")
        return self

    def batch_ms(self, rows: float, sessions: float) -> float:
        """Ms of one batched forward of ``sessions`` sessions with ``rows`` rows in all, from ``batch_points``:
        along each measured sessions value linear in rows (np.interp inside; beyond, the nearest segment's slope,
        >= 0), then linear in sessions between the two nearest measured values (held beyond them). Raises
        CostModelError when the file has no batched line."""
        if not self.batch_points:
            raise CostModelError(
                f"the cost model ({self.model}, {self.device}) has no batched line (batch_points); measure one "
                "with benchmarks/verifier_cost_model.py --batch-sessions 1,4,16,64"
            )
        lines: dict[int, list[tuple[int, float]]] = {}
        for p in self.batch_points:
            lines.setdefault(p.sessions, []).append((p.rows, p.ms))

        def along(pts: list[tuple[int, float]]) -> float:
            pts = sorted(pts)
            r, m = np.array([x for x, _ in pts], float), np.array([y for _, y in pts], float)
            if len(r) == 1:
                return float(m[0])
            if rows > r[-1]:
                return float(m[-1] + max(0.0, (m[-1] - m[-2]) / (r[-1] - r[-2])) * (rows - r[-1]))
            if rows < r[0]:
                return float(max(0.0, m[0] - max(0.0, (m[1] - m[0]) / (r[1] - r[0])) * (r[0] - rows)))
            return float(np.interp(rows, r, m))

        ns = sorted(lines)
        s = float(np.clip(sessions, ns[0], ns[-1]))
        i = int(np.clip(np.searchsorted(ns, s, side="right") - 1, 0, max(0, len(ns) - 2)))
        if len(ns) == 1:
            return along(lines[ns[0]])
        lo, hi = along(lines[ns[i]]), along(lines[ns[i + 1]])
        w = (s - ns[i]) / (ns[i + 1] - ns[i])
        return float(lo + w * (hi - lo))

    @property
    def kinds(self) -> tuple[str, ...]:
        """The kinds this model has points of, in `KINDS` order."""
        have = {p.kind for p in self.points}
        return tuple(k for k in KINDS if k in have)

    # ---- the grid ------------------------------------------------------------------------------------------

    @property
    def rows_grid(self) -> np.ndarray:
        """Measured rows values of the verify grid, ascending: int64 (nR,)."""
        return self.rows_of("verify")

    @property
    def context_grid(self) -> np.ndarray:
        """Measured contexts of the verify grid, ascending: int64 (nC,)."""
        return self.contexts_of("verify")

    def rows_of(self, kind: str) -> np.ndarray:
        """Measured rows values of ``kind``'s grid, ascending: int64 (nR,) (empty without such points)."""
        return np.array(sorted({p.rows for p in self.points if p.kind == kind}), dtype=np.int64)

    def contexts_of(self, kind: str) -> np.ndarray:
        """Measured contexts of ``kind``'s grid, ascending: int64 (nC,) (empty without such points)."""
        return np.array(sorted({p.context for p in self.points if p.kind == kind}), dtype=np.int64)

    def table(self, kind: str = "verify") -> np.ndarray:
        """ms grid of ``kind``: float64 (nR, nC), [i, j] = ms at rows_of(kind)[i], contexts_of(kind)[j]."""
        rows, ctxs = list(self.rows_of(kind)), list(self.contexts_of(kind))
        out = np.empty((len(rows), len(ctxs)))
        for p in self.points:
            if p.kind == kind:
                out[rows.index(p.rows), ctxs.index(p.context)] = p.ms
        return out

    # ---- prediction ----------------------------------------------------------------------------------------

    def predict(self, rows: int, context: int, kind: str = "verify") -> float:
        """Milliseconds of one forward of ``kind`` (`KINDS`) with ``rows`` rows after ``context`` cached positions.

        Bilinear inside the kind's grid; linear in context above it (slope clamped to >= 0), held below it (module
        docstring). Raises CostModelError if the model has no points of ``kind`` (a schema 1 file: remeasure), rows
        is outside [min, max] of the kind's measured rows, or context < 0.
        """
        if kind not in KINDS:
            raise CostModelError(f"kind = {kind!r}: a forward is one of {', '.join(KINDS)}")
        grid = self.rows_of(kind)
        if not len(grid):
            raise CostModelError(
                f"the cost model ({self.model}, {self.device}) has no {kind} points, so the server's "
                f"{kind} forwards cannot be replayed; remeasure it with this hycoc ({MAKE_HINT})"
            )
        if not grid[0] <= rows <= grid[-1]:
            flag = {"verify": "--rows", "head_step": "--rows", "prefill": "--prefill-rows"}[kind]
            raise CostModelError(
                f"rows = {rows} is outside the cost model's measured {kind} rows [{grid[0]}, "
                f"{grid[-1]}] ({self.model}, {self.device}); measure it: "
                f"benchmarks/verifier_cost_model.py {flag} "
                f"{','.join(str(int(r)) for r in sorted(set(grid.tolist()) | {int(rows)}))}"
            )
        if context < 0:
            raise CostModelError(f"context = {context}: a context is a count of cached positions, >= 0")
        ms = interpolate(grid, self.contexts_of(kind), self.table(kind)[None], [rows], [context])
        return float(ms[0, 0])

    def forwards_ms(self, forwards: Iterable[Forward]) -> float:
        """Sum of `predict` over forwards (`Forward` or (kind, rows, context) tuples), ms."""
        return float(sum(self.predict(int(f[1]), int(f[2]), str(f[0])) for f in forwards))

    def projected_server_ms(self, rounds: Iterable[tuple[int, int]]) -> float:
        """Sum of `predict` over verification rounds, each (rows, context): the verify forwards alone (head steps
        and prefill are `forwards_ms` of `round_forwards` / `request_forwards`)."""
        return float(sum(self.predict(int(r), int(c)) for r, c in rounds))

    # ---- files ---------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The file form: indented JSON, points sorted by (kind in `KINDS` order, rows, context)."""
        d = self.model_dump(mode="json")
        d["points"] = sorted(d["points"], key=lambda p: (KINDS.index(p["kind"]), p["rows"], p["context"]))
        return json.dumps(d, indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the model to ``path`` atomically (a temporary file in the same folder, fsync, rename), creating
        the folder if needed, mode 0644. A reader never sees a half-written file. Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json())
            f.flush()
            os.fsync(f.fileno())
        return path


def request_forwards(
    record: Mapping[str, Any],
    *,
    chain_length: int | None = None,
    head_window: int | None = None,
    prefill_chunk: int = PREFILL_CHUNK,
    prefill: bool = True,
) -> list[list[Forward]]:
    """Every forward the server ran for one bench record (`hycoc.bench.paper.summary` record keys), grouped: the prefill
    chunks first (one group, empty without ``prefill``), then one group per round (`round_forwards`).

    Per configuration (`DRAFT_PLACE_OF`): cloud-mtp rounds run rows - 1 head steps at the round's context;
    server-head rounds run ``chain_length`` head steps at min(``head_window``, next round's context) after every
    round but the request's last (its reply ends the request: no chain is drafted); device rounds none. The
    prefill covers [record["prefill_start"], first round's context): prefill_start is 0 for a first turn and the
    kept conversation's last position for a second turn (records without it: 0 for turn 1, and a second turn is
    counted as a cold prefill of the whole conversation, an upper bound).
    Raises CostModelError when a server-head record is replayed without chain_length and head_window, or a
    record's rows and context lists differ in length.
    """
    rows, ctx = list(record.get("rows") or ()), list(record.get("context") or ())
    if len(rows) != len(ctx):
        raise CostModelError(
            f"record {record.get('config')}/{record.get('question_id')}: {len(rows)} rows entries "
            f"but {len(ctx)} context entries"
        )
    name = DRAFT_PLACE_OF.get(str(record.get("config")), "device")
    place = round_place(name)
    if place.server_chain_after and (chain_length is None or head_window is None):
        raise CostModelError(
            f"{name} rounds run the head on the server: replaying them needs the recipe's "
            "chain_length (K) and head_window (W)"
        )
    groups: list[list[Forward]] = [[]]
    if prefill and ctx:
        groups[0] = prefill_forwards(int(record.get("prefill_start") or 0), int(ctx[0]), prefill_chunk)
    for i, (r, t) in enumerate(zip(rows, ctx)):
        if place.server_chain_before:  # the recorded rows are the root and the server's chain
            groups.append(round_forwards(name, int(r), int(t), head_steps=int(r) - 1))
        elif place.server_chain_after and chain_length is not None and head_window is not None:  # both: checked above
            # the next chain after every round but the request's last
            last = i == len(rows) - 1
            t_next = int(ctx[i + 1]) if not last else int(t)
            steps = 0 if last else place.head_steps(int(chain_length))
            groups.append(
                round_forwards(name, int(r), int(t), head_steps=steps, head_context=min(int(head_window), t_next))
            )
        else:
            groups.append(round_forwards(name, int(r), int(t)))
    return groups


def projected_server_ms(model: CostModel, rounds: Iterable[Sequence[Any]]) -> float:
    """Projected server ms on the cost model's device. ``rounds``: either (rows, context) pairs, one per
    verification round (the verify forwards alone), or groups of `Forward` (`round_forwards`, `request_forwards`:
    every forward the server ran). Raises CostModelError as `CostModel.predict`."""
    total = 0.0
    for r in rounds:
        if len(r) and isinstance(r[0], (tuple, list)):  # a group of forwards
            total += model.forwards_ms(r)
        elif len(r):
            total += model.predict(int(r[0]), int(r[1]))
    return float(total)


def projected_g(model: CostModel, rounds, output_tokens: int) -> float:
    """Projected g: `projected_server_ms` of ``rounds`` / output_tokens, in ms per output token (prefill included
    exactly when ``rounds`` holds its chunks). Raises CostModelError if output_tokens < 1."""
    if output_tokens < 1:
        raise CostModelError(f"output_tokens = {output_tokens}: g needs at least one output token")
    return projected_server_ms(model, rounds) / output_tokens


def bootstrap_tables(model: CostModel, draws: int, seed: int = 0) -> dict[str, np.ndarray] | None:
    """The cost model's own uncertainty as ``draws`` resampled grids: per kind a float64 (draws, nR, nC) array
    whose [d] is `CostModel.table` with every point's ms replaced by the model's statistic (``meta.statistic``:
    "median", or "pNN" for that percentile) of a resample (with replacement, same size) of that point's
    ``samples_ms`` -- the bootstrap of a quantile (Efron & Tibshirani 1993, ch. 6), each point independently. None when
    any point lacks samples (a file made before they were kept): the projection's interval then covers the questions
    only."""
    if any(not p.samples_ms for p in model.points):
        return None
    rng = np.random.default_rng(seed)
    q = sample_quantile(model.meta.get("statistic", "median"))
    out = {}
    for kind in model.kinds:
        rows, ctxs = list(model.rows_of(kind)), list(model.contexts_of(kind))
        grid = np.empty((draws, len(rows), len(ctxs)))
        for p in sorted((p for p in model.points if p.kind == kind), key=lambda p: (p.rows, p.context)):
            if p.kind == kind:  # a fixed order (the file's): a model and its saved copy draw the same grids
                x = np.asarray(p.samples_ms, dtype=np.float64)
                pick = rng.integers(0, len(x), size=(draws, len(x)))
                grid[:, rows.index(p.rows), ctxs.index(p.context)] = np.percentile(x[pick], q, axis=1)
        out[kind] = grid
    return out


def sample_quantile(statistic: str) -> float:
    """The percentile (0-100) a cost model's ``meta.statistic`` names: "median" -> 50, "p25" -> 25. Raises
    CostModelError for another name."""
    if statistic == "median":
        return 50.0
    try:
        q = float(statistic.removeprefix("p")) if statistic.startswith("p") else None
    except ValueError:
        q = None
    if q is None or not 0 <= q <= 100:
        raise CostModelError(f"meta.statistic = {statistic!r}: 'median' or 'pNN' (a percentile, e.g. p25)")
    return q


def interpolate(
    rows_grid: Sequence[float] | np.ndarray,
    context_grid: Sequence[float] | np.ndarray,
    tables: np.ndarray,
    rows,
    context,
) -> np.ndarray:
    """The cost model's interpolation (module docstring): ms of forwards with ``rows`` rows after ``context`` cached
    positions, read off each grid of ``tables``. Bilinear inside the grid; along context held below its smallest
    value and linear above its largest with the last segment's slope clamped to >= 0; rows must lie inside
    ``rows_grid`` (the callers check).

    rows_grid: (nR,) ascending; context_grid: (nC,) ascending; tables: float (draws, nR, nC) ms; rows, context:
    (F,) numbers. Returns float64 (draws, F) ms. The one implementation behind `CostModel.predict` (draws = 1) and
    `predict_tables` (bootstrapped grids)."""
    grid, cgrid = np.asarray(rows_grid, dtype=np.float64), np.asarray(context_grid, dtype=np.float64)
    r, c = np.asarray(rows, dtype=np.float64), np.asarray(context, dtype=np.float64)
    i = np.clip(np.searchsorted(grid, r, side="right") - 1, 0, len(grid) - 1)  # grid[i] <= r
    j = np.minimum(i + 1, len(grid) - 1)
    w = np.where(j > i, (r - grid[i]) / np.where(j > i, grid[j] - grid[i], 1.0), 0.0)
    f = np.arange(len(c))

    def along(lines: np.ndarray) -> np.ndarray:  # (draws, F, nC) -> (draws, F)
        if len(cgrid) == 1:
            return lines[..., 0]
        k = np.clip(np.searchsorted(cgrid, c, side="right") - 1, 0, len(cgrid) - 2)
        a = np.clip((c - cgrid[k]) / (cgrid[k + 1] - cgrid[k]), 0.0, 1.0)
        inside = lines[:, f, k] + a * (lines[:, f, k + 1] - lines[:, f, k])
        slope = np.maximum(0.0, (lines[..., -1] - lines[..., -2]) / (cgrid[-1] - cgrid[-2]))
        above = lines[..., -1] + slope * (c - cgrid[-1])
        return np.where(c > cgrid[-1], above, inside)

    t = np.asarray(tables, dtype=np.float64)
    lo, hi = along(t[:, i, :]), along(t[:, j, :])
    return lo + w * (hi - lo)


def predict_tables(model: CostModel, tables: dict[str, np.ndarray], forwards: Sequence[Forward]) -> np.ndarray:
    """`CostModel.predict` of every forward under every grid of ``tables`` (`bootstrap_tables`), vectorised:
    float64 (draws, len(forwards)) ms. `interpolate`, as `CostModel.predict` (bilinear inside, held below the
    smallest context, slope-clamped linear above the largest); raises CostModelError as it does for rows outside a
    kind's grid or a kind the model lacks."""
    draws = next(iter(tables.values())).shape[0]
    out = np.zeros((draws, len(forwards)))
    kinds = np.array([f.kind for f in forwards])
    rows = np.array([f.rows for f in forwards], dtype=np.float64)
    ctx = np.array([f.context for f in forwards], dtype=np.float64)
    for kind in set(kinds.tolist()):
        sel = np.nonzero(kinds == kind)[0]
        grid, cgrid = model.rows_of(kind).astype(np.float64), model.contexts_of(kind).astype(np.float64)
        if kind not in tables or not len(grid):
            raise CostModelError(f"the cost model ({model.model}, {model.device}) has no {kind} points to replay")
        r, c = rows[sel], ctx[sel]
        if r.min() < grid[0] or r.max() > grid[-1]:
            raise CostModelError(f"rows outside the cost model's measured {kind} rows [{grid[0]:g}, {grid[-1]:g}]")
        out[:, sel] = interpolate(grid, cgrid, tables[kind], r, c)
    return out


def _where(loc: tuple) -> str:
    """pydantic location -> 'points[3].ms'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(top level)"


def load_cost_model(path: str | Path) -> CostModel:
    """Read and validate a cost model JSON file; the result has ``source = "file"``.

    Raises CostModelError naming the file, the field and the fix when the file is missing or unreadable, is not
    JSON, lacks a field or has a bad one (``points[2].ms: ...``), has another schema_version, or its points do
    not form a full grid.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CostModelError(f"{path}: no such cost model file; {MAKE_HINT}") from None
    except OSError as e:
        raise CostModelError(f"{path}: cannot read the cost model: {e.strerror or e}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise CostModelError(f"{path}: not JSON (line {e.lineno}, column {e.colno}: {e.msg}); {MAKE_HINT}") from None
    if not isinstance(data, dict):
        raise CostModelError(
            f"{path}: expected a JSON object with schema_version, device, dtype, model, points; "
            f"got {type(data).__name__}"
        )
    if "schema_version" in data and data["schema_version"] not in READABLE_SCHEMAS:
        raise CostModelError(
            f"{path}: schema_version = {data['schema_version']!r}, this hycoc reads "
            f"{' and '.join(map(str, READABLE_SCHEMAS))}; remeasure with this hycoc ({MAKE_HINT})"
        )
    data["source"] = "file"
    try:
        return CostModel.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        where = _where(err["loc"])
        if err["type"] == "missing":
            msg = f"field {where} is missing"
        elif err["type"] == "extra_forbidden":
            msg = f"field {where} is not a cost model field (allowed: {', '.join(CostModel.model_fields)})"
        else:
            msg = f"field {where}: {err['msg']}" if err["loc"] else err["msg"].removeprefix("Value error, ")
        more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
        raise CostModelError(f"{path}: {msg}{more}; fix the file or {MAKE_HINT}") from None


__all__ = [
    "BatchPoint",
    "bootstrap_tables",
    "interpolate",
    "predict_tables",
    "sample_quantile",
    "DRAFT_PLACE_OF",
    "KINDS",
    "PAPER_ROUND_MS",
    "PREFILL_CHUNK",
    "SCHEMA_VERSION",
    "CostModelError",
    "CostPoint",
    "CostModel",
    "Forward",
    "load_cost_model",
    "prefill_forwards",
    "projected_server_ms",
    "projected_g",
    "request_forwards",
    "round_forwards",
]
