"""The shard plan of the SLM tree graph: which contiguous layers go into which context binary (docs/compiler.md
"Layer-sharded SLM").

A graph whose weights exceed one context's budget (the target profile's ``max_context_bytes``, 3.5 GiB on
htp-v81, lowered by ``[target] context_size_limit_mb``) is split by layers into shards, one context binary each,
loaded into one EP context group at run time and chained by the runtime (`hycoc.passes.slm.graph` "Shards",
`hycoc.runtime.graphs.ShardChainRunner`), as ExecuTorch's and Qualcomm Genie's multi-part Llama/Gemma exports
ship E2B-class models (qai-hub-models splits its LLMs into parts of a few layers each, every part its own
context binary).

`layer_weight_bytes` counts what each layer puts into a context binary: its integer weights at their compiled
width (hycoc's QDQ stores 2- and 4-bit weights as int4, half a byte each, 8-bit ones as int8) plus float32
per-channel scales and float norm weights; shard 0 also holds the per-layer-input projection, the last shard the
final norm and the keep-set rows of the output layer. `plan_shards` splits L layers into N contiguous shards
minimizing the largest shard's bytes (then the spread: the sum of squares), N given or ``"auto"`` (the fewest
shards whose largest fits the budget). The compile still checks every context against the limit before compiling
(`hycoc.targets.htp.plan_context_size`, ContextTooLargeError); this plan is the estimate that chooses the split.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


class ShardPlanError(ValueError):
    """No split fits: a layer alone (with its shard's fixed extra) exceeds the budget, or the shard count is
    outside [1, layers]. The message names the layer or the recipe field and the fix."""


@dataclass(frozen=True)
class ShardPlan:
    """bounds: (0, b_1, ..., L), shard k = layers [bounds[k], bounds[k+1]). shard_bytes: each shard's estimated
    weight bytes. budget: the per-context limit in bytes (None: no limit). fits: every shard within it."""

    bounds: tuple[int, ...]
    shard_bytes: tuple[int, ...]
    budget: int | None

    @property
    def fits(self) -> bool:
        return self.budget is None or max(self.shard_bytes) <= self.budget

    @property
    def shards(self) -> int:
        return len(self.bounds) - 1


def _compiled_bytes(q_shape: tuple[int, int], bits: int, rows: int | None = None) -> int:
    out = int(q_shape[0] if rows is None else rows)
    width = 0.5 if bits <= 4 else 1.0
    return int(np.ceil(out * q_shape[1] * width)) + 4 * out


def layer_weight_bytes(slm, keep_size: int) -> tuple[list[int], int, int]:
    """Estimated context bytes per decoder layer of the surgery output ``slm`` (`SlmIntegerModel`), plus shard 0's
    extra (per-layer-input projection and its norm) and the last shard's (final norm, ``keep_size`` rows of the
    output layer). Returns (per_layer, first_extra, last_extra) in bytes."""
    n = int(slm.config["num_hidden_layers"])
    per_layer, first, last = [0] * n, 0, 0

    def where(name: str) -> tuple[str, int]:
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and parts[2].isdigit():
            return "layer", int(parts[2])
        if name.startswith("model.per_layer"):
            return "first", 0
        return "last", 0

    sizes = [
        (name, _compiled_bytes(w.q.shape, w.bits, rows=keep_size if name == "lm_head" else None))
        for name, w in slm.weights.items()
    ]
    sizes += [(name, 4 * int(np.asarray(value).size)) for name, value in slm.floats.items()]
    for name, size in sizes:
        kind, i = where(name)
        if kind == "layer":
            per_layer[i] += size
        elif kind == "first":
            first += size
        else:
            last += size
    return per_layer, first, last


def _segments(per_layer: Sequence[int], first_extra: int, last_extra: int):
    prefix = np.concatenate([[0], np.cumsum(per_layer)]).astype(np.int64)
    n = len(per_layer)

    def seg(i: int, j: int) -> int:
        return int(prefix[j] - prefix[i]) + (first_extra if i == 0 else 0) + (last_extra if j == n else 0)

    return seg


def _best_split(n: int, k: int, seg) -> tuple[int, tuple[int, ...]]:
    """Exact min over contiguous k-splits of the largest segment, then (among those) the smallest sum of squares."""
    inf = float("inf")
    # 1) min-max: dp[m][j] = best largest segment splitting layers [0, j) into m shards
    dp = [[inf] * (n + 1) for _ in range(k + 1)]
    dp[0][0] = 0
    for m in range(1, k + 1):
        for j in range(m, n + 1):
            dp[m][j] = min(max(dp[m - 1][i], seg(i, j)) for i in range(m - 1, j))
    cap = dp[k][n]
    # 2) among splits with every segment <= cap: the smallest sum of squares (then the earliest bounds)
    sq: list[list[tuple[float, tuple[int, ...]]]] = [[(inf, ())] * (n + 1) for _ in range(k + 1)]
    sq[0][0] = (0, (0,))
    for m in range(1, k + 1):
        for j in range(m, n + 1):
            best: tuple[float, tuple[int, ...]] = (inf, ())
            for i in range(m - 1, j):
                s = seg(i, j)
                if s <= cap and sq[m - 1][i][0] < inf:
                    cand = (sq[m - 1][i][0] + s * s, sq[m - 1][i][1] + (j,))
                    best = min(best, cand)
            sq[m][j] = best
    return int(cap), sq[k][n][1]


def plan_shards(
    per_layer: Sequence[int], *, budget: int | None, shards: int | str, first_extra: int = 0, last_extra: int = 0
) -> ShardPlan:
    """Split ``len(per_layer)`` layers into contiguous shards balanced by weight bytes (module docstring).

    per_layer: bytes per layer; first_extra / last_extra: bytes only shard 0 / the last shard holds. shards: N
    (1 = monolithic; the plan may then not fit, which the compile refuses) or ``"auto"``: the fewest shards whose
    largest fits ``budget`` (bytes; None = no limit, one shard). Raises ShardPlanError for N outside [1, L] or,
    with "auto", a layer that does not fit even alone.
    """
    n = len(per_layer)
    seg = _segments(per_layer, first_extra, last_extra)
    if shards == "auto":
        if budget is not None:
            for i in range(n):
                alone = seg(i, i + 1)
                if alone > budget:
                    raise ShardPlanError(
                        f"layer {i} alone needs {alone:,} bytes, over the context budget of "
                        f"{budget:,}: no layer split fits; raise [target] context_size_limit_mb "
                        f"or quantize the layer harder"
                    )
        for k in range(1, n + 1):
            cap, bounds = _best_split(n, k, seg)
            if budget is None or cap <= budget:
                break
    else:
        k = int(shards)
        if not 1 <= k <= n:
            raise ShardPlanError(f'[target] slm_shards = {k}: must lie in [1, {n}] (the SLM\'s layers) or be "auto"')
        cap, bounds = _best_split(n, k, seg)
    sizes = tuple(seg(a, b) for a, b in zip(bounds, bounds[1:]))
    return ShardPlan(tuple(bounds), sizes, budget)


__all__ = ["ShardPlan", "ShardPlanError", "layer_weight_bytes", "plan_shards"]
