"""Verifier cost model: server milliseconds of one verification round as a function of rows and context (issues 6, 7).

`hycoc bench` measures g (server ms per output token, paper App. G) on whatever machine it runs on -- for the toy
family that is a laptop CPU. To say what g would be on the paper's GPU, it replays the rounds it ran (how many tree
rows each forward carried, and how long the KV cache was) through a cost model measured on that GPU:

    CostModel.predict(rows, context) -> ms of one verification forward

A cost model is a grid of measured points {rows, context, ms}, written as JSON by
``benchmarks/verifier_cost_model.py`` (``--device cuda``: Gemma 4 26B-A4B shape, random bf16 weights, one GPU;
``--device cpu --recipe recipes/toy.toml``: the toy verifier with its real weights).

Units and meaning of a point:

* ``rows``: R, the rows of the one forward that verifies a tree (paper Alg. 4 lines 1-3): B + 1 = 33 for a HyCo
  tree (B = 32), K + 1 = 5 for a Cloud+MTP chain (K = 4), 1 for the verifier alone. int >= 1.
* ``context``: t, the positions already in the verifier's KV cache when that forward runs (prompt without its
  last token, plus every token committed so far). int >= 0.
* ``ms``: milliseconds of that forward as the reference engine runs it (`hycoc.verifier.engine.verify_tree`:
  explicit 4-D tree masks, a ``DynamicCache`` that keeps every position, logits of all R rows), median of
  repeated runs after warm-up. The rest of a round (sampling, acceptance, KV compaction, hand-off packing;
  Alg. 4 lines 5-14) is NOT in it: on a GPU it is a small, context-independent part of a round, and the bench
  measures it on its own machine if it wants it.

Prediction (`CostModel.predict`): the points must form a full rectangular grid (every measured rows value at
every measured context). Between grid lines the model is bilinear in (rows, context). Beyond the largest
context it extrapolates linearly with the slope of the last two contexts at that rows value, with the slope
clamped to >= 0 (so a prediction is never below the nearest measured point: attention work only grows with t).
Below the smallest context it holds the value at the smallest context (no downward extrapolation: a short
cache is dominated by weight reads, and holding is the conservative choice). Rows outside the measured range
are an error (`CostModelError`): measure them (``--rows``) rather than guess; the device pads HyCo trees to
B + 1 rows, so the default grid 1, 5, 33 covers every Table 5 configuration at the paper's K and B.

Prefill is NOT projected. `projected_server_ms` sums the rounds only; a bench that reports a projected g
therefore reports "g over rounds, prefill excluded" and says so. (Scaling the measured prefill by the rounds'
ratio would be wrong: prefill is compute-bound and a round is weight-bandwidth-bound, so the two do not move
together from one machine to another.)

Core module: numpy + pydantic only, no torch, so the bench and the tests can load a model anywhere.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

SCHEMA_VERSION = 1

#: How to make a cost model file; named in every load error.
MAKE_HINT = ("make one with `python benchmarks/verifier_cost_model.py --device cuda --out PATH` (GPU, Gemma 4 "
             "26B-A4B shape) or `--device cpu --recipe recipes/toy.toml --out PATH` (the toy verifier)")


class CostModelError(ValueError):
    """A cost model file that cannot be used (missing, not JSON, a bad or missing field, an incomplete grid), or a
    prediction asked outside what the model can answer. The message names the file and field and how to fix it."""


class CostPoint(BaseModel):
    """One measured point: ``ms`` milliseconds for a verification forward of ``rows`` rows after ``context``
    cached positions (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rows: int = Field(ge=1, description="R, tree rows in the forward (B + 1 for a HyCo tree)")
    context: int = Field(ge=0, description="t, positions already in the KV cache")
    ms: float = Field(gt=0, allow_inf_nan=False, description="median milliseconds of the forward")


class CostModel(BaseModel):
    """A measured grid of verification-forward costs on one device (see the module docstring for units).

    Fields:
      schema_version: 1.
      device: the machine, in words (e.g. "NVIDIA H200", "cpu: 1 thread").
      dtype: the verifier's weight/activation dtype ("bfloat16", "float32").
      model: what was timed (e.g. "Gemma 4 26B-A4B shape, random weights").
      shape: the model's shape (layers, hidden size, heads, experts, vocabulary, ...), free-form numbers.
      points: the grid; every rows value at every context, no duplicates (validated).
      source: "measured" (timed in this process) or "file" (read by `load_cost_model`).
      meta: how it was measured (warm-up, repeats, torch/transformers versions, date, ...), free-form.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: Literal[1] = SCHEMA_VERSION
    device: str = Field(min_length=1)
    dtype: str = Field(min_length=1)
    model: str = Field(min_length=1)
    shape: dict[str, Any] = Field(default_factory=dict)
    points: list[CostPoint] = Field(min_length=1)
    source: Literal["measured", "file"] = "measured"
    meta: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _full_grid(self) -> "CostModel":
        seen: dict[tuple[int, int], float] = {}
        for p in self.points:
            if (p.rows, p.context) in seen:
                raise ValueError(f"points: rows={p.rows}, context={p.context} appears twice; keep one")
            seen[(p.rows, p.context)] = p.ms
        rows, ctxs = sorted({r for r, _ in seen}), sorted({c for _, c in seen})
        missing = [(r, c) for r in rows for c in ctxs if (r, c) not in seen]
        if missing:
            r, c = missing[0]
            raise ValueError(f"points: the grid is incomplete: {len(missing)} of {len(rows) * len(ctxs)} "
                             f"(rows, context) pairs missing, first rows={r}, context={c}; every rows value "
                             f"{rows} must be measured at every context {ctxs}")
        return self

    # ---- the grid ------------------------------------------------------------------------------------------

    @property
    def rows_grid(self) -> np.ndarray:
        """Measured rows values, ascending: int64 (nR,)."""
        return np.array(sorted({p.rows for p in self.points}), dtype=np.int64)

    @property
    def context_grid(self) -> np.ndarray:
        """Measured contexts, ascending: int64 (nC,)."""
        return np.array(sorted({p.context for p in self.points}), dtype=np.int64)

    def table(self) -> np.ndarray:
        """ms grid: float64 (nR, nC), [i, j] = ms at rows_grid[i], context_grid[j]."""
        rows, ctxs = list(self.rows_grid), list(self.context_grid)
        out = np.empty((len(rows), len(ctxs)))
        for p in self.points:
            out[rows.index(p.rows), ctxs.index(p.context)] = p.ms
        return out

    # ---- prediction ----------------------------------------------------------------------------------------

    def _along_context(self, ms_row: np.ndarray, context: float) -> float:
        """One rows line of the grid at ``context``: linear inside, held below, slope-clamped (>= 0) above."""
        ctxs = self.context_grid.astype(np.float64)
        if len(ctxs) == 1 or context <= ctxs[0]:
            return float(ms_row[0])
        if context <= ctxs[-1]:
            return float(np.interp(context, ctxs, ms_row))
        slope = max(0.0, (ms_row[-1] - ms_row[-2]) / (ctxs[-1] - ctxs[-2]))
        return float(ms_row[-1] + slope * (context - ctxs[-1]))

    def predict(self, rows: int, context: int) -> float:
        """Milliseconds of one verification forward of ``rows`` rows after ``context`` cached positions.

        Bilinear inside the grid; linear in context above it (slope clamped to >= 0), held below it (module
        docstring). Raises CostModelError if rows is outside [min, max] of the measured rows or context < 0.
        """
        grid = self.rows_grid
        if not grid[0] <= rows <= grid[-1]:
            raise CostModelError(f"rows = {rows} is outside the cost model's measured rows [{grid[0]}, {grid[-1]}] "
                                 f"({self.model}, {self.device}); measure it: benchmarks/verifier_cost_model.py "
                                 f"--rows {','.join(str(int(r)) for r in sorted(set(grid.tolist()) | {int(rows)}))}")
        if context < 0:
            raise CostModelError(f"context = {context}: a context is a count of cached positions, >= 0")
        table = self.table()
        i = int(np.searchsorted(grid, rows, side="right")) - 1  # grid[i] <= rows
        lo = self._along_context(table[i], float(context))
        if grid[i] == rows:
            return lo
        hi = self._along_context(table[i + 1], float(context))
        w = (rows - grid[i]) / (grid[i + 1] - grid[i])
        return float(lo + w * (hi - lo))

    def projected_server_ms(self, rounds: Iterable[tuple[int, int]]) -> float:
        """Sum of `predict` over rounds, each (rows, context). Prefill is not included (module docstring)."""
        return float(sum(self.predict(int(r), int(c)) for r, c in rounds))

    # ---- files ---------------------------------------------------------------------------------------------

    def to_json(self) -> str:
        """The file form: indented JSON, points sorted by (rows, context)."""
        d = self.model_dump(mode="json")
        d["points"] = sorted(d["points"], key=lambda p: (p["rows"], p["context"]))
        return json.dumps(d, indent=2) + "\n"

    def save(self, path: str | Path) -> Path:
        """Write the model to ``path`` atomically (a temporary file in the same folder, fsync, rename), creating
        the folder if needed. A reader never sees a half-written file. Returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(self.to_json())
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return path


def projected_server_ms(model: CostModel, rounds: Iterable[tuple[int, int]]) -> float:
    """Projected server ms of a request's rounds on the cost model's device: sum of ``model.predict(rows, context)``
    over ``rounds`` (an iterable of (rows, context), one per verification round, context = cached positions
    when that round ran). Prefill is excluded (module docstring). Raises CostModelError as `CostModel.predict`."""
    return model.projected_server_ms(rounds)


def projected_g(model: CostModel, rounds: Iterable[tuple[int, int]], output_tokens: int) -> float:
    """Projected g over rounds: `projected_server_ms` / output_tokens, in ms per output token, prefill excluded.
    Raises CostModelError if output_tokens < 1."""
    if output_tokens < 1:
        raise CostModelError(f"output_tokens = {output_tokens}: g needs at least one output token")
    return projected_server_ms(model, rounds) / output_tokens


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
        raise CostModelError(f"{path}: expected a JSON object with schema_version, device, dtype, model, points; "
                             f"got {type(data).__name__}")
    if "schema_version" in data and data["schema_version"] != SCHEMA_VERSION:
        raise CostModelError(f"{path}: schema_version = {data['schema_version']!r}, this hycoc reads "
                             f"{SCHEMA_VERSION}; remeasure with this hycoc ({MAKE_HINT})")
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


__all__ = ["SCHEMA_VERSION", "CostModelError", "CostPoint", "CostModel", "load_cost_model", "projected_server_ms",
           "projected_g"]
