"""Measuring the row-cost line a row budget uses (`hycoc.verifier.row_budget.RowCost`), on the server's own
engine, before it serves.

A budgeted server (recipe ``verifier.tree_budget = "auto"`` without ``verifier.row_cost``) times the forward it
actually runs: `hycoc.verifier.batch.batch_forward` over ``sessions`` scratch sessions (each its own cache from
`VerifierEngine.new_cache`, prefilled with ``context`` random tokens), every session sending an r-row chain, for
several r; each point is (sessions x r rows, median ms of ``repeats`` forwards after ``warmup``). The session count
stays fixed, so the line's slope is what one more row costs in a forward of that many sessions -- the trade the
budget makes (it never drops a session, only rows). Each forward's rows are cut from the caches again
(`hycoc.verifier.kv_surgery.crop_cache`). On the toy verifier on this 2-core CPU the whole measurement takes ~2 s.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .batch import batch_forward
from .engine import VerifierEngine
from .forward import prefill
from .kv_surgery import crop_cache
from .row_budget import RowCost

#: Rows per tree of the measured points (with 16 sessions: 32 ... 528 rows).
DEFAULT_ROWS_PER_TREE = (2, 9, 17, 33)


def row_cost_plan(tree_rows: int, max_batch_rows: int, max_context: int) -> tuple[int, list[int]]:
    """What a server measures for its row budget: (sessions, rows per tree). Sessions: the trees a full batched
    forward holds (max_batch_rows // tree_rows), between 2 and 16; rows per tree: 2, ~R/4, ~R/2 and R = tree_rows
    (distinct, increasing, at least two), each below max_context - 1 so a prefilled position fits before them.
    Raises ValueError when the context cannot hold a 2-row tree after one position."""
    top = min(int(tree_rows), int(max_context) - 2)
    if top < 2:
        raise ValueError(f"max_context = {max_context}: too short to measure a row cost (needs >= 4 positions)")
    rows = sorted({2, max(2, top // 4), max(2, top // 2), top})
    if len(rows) < 2:
        rows = [1, 2]
    sessions = max(2, min(16, int(max_batch_rows) // max(1, int(tree_rows))))
    return sessions, rows


@torch.inference_mode()
def measure_row_cost(
    engine: VerifierEngine,
    *,
    sessions: int = 16,
    rows_per_tree=DEFAULT_ROWS_PER_TREE,
    context: int = 64,
    warmup: int = 1,
    repeats: int = 3,
    seed: int = 0,
) -> RowCost:
    """The engine's batched-forward milliseconds against its rows (module docstring).

    sessions: scratch sessions per forward (>= 2; a server passes max_batch_rows // tree_rows). rows_per_tree:
    increasing row counts (>= 1) of each session's chain. context: positions prefilled per session (>= 1, below
    the engine's max_context). Returns a `RowCost` whose source says what was measured. Raises ValueError for
    arguments out of range.
    """
    rows_per_tree = [int(r) for r in rows_per_tree]
    if sessions < 2:
        raise ValueError(f"sessions = {sessions}: a batched forward needs >= 2")
    if len(rows_per_tree) < 2 or rows_per_tree != sorted(set(rows_per_tree)) or rows_per_tree[0] < 1:
        raise ValueError(f"rows_per_tree = {rows_per_tree}: need >= 2 increasing counts >= 1")
    if not 1 <= context < engine.max_context - max(rows_per_tree):
        raise ValueError(
            f"context = {context}: must lie in [1, max_context - rows) = [1, {engine.max_context - max(rows_per_tree)})"
        )
    rng = np.random.default_rng(seed)
    vocab = engine.vocab_size
    caches = []
    for _ in range(sessions):
        cache = engine.new_cache()
        ids = torch.as_tensor(rng.integers(2, vocab, context), device=engine.device)
        prefill(engine.model, cache, engine.tap, ids, engine.prefill_chunk, engine.dtype)
        caches.append(cache)
    points = []
    for r in rows_per_tree:
        tokens = [rng.integers(2, vocab, r) for _ in range(sessions)]
        parents = [np.arange(-1, r - 1, dtype=np.int64) for _ in range(sessions)]
        times = []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            batch_forward(engine, caches, [context] * sessions, tokens, parents)
            if engine.device.type == "cuda":
                torch.cuda.synchronize(engine.device)
            ms = (time.perf_counter() - t0) * 1e3
            for cache in caches:
                crop_cache(cache, context)
            if i >= warmup:
                times.append(ms)
        points.append((sessions * r, float(np.median(times))))
    return RowCost(
        tuple(points),
        source=f"measured: batch_forward of {sessions} sessions x {rows_per_tree} rows at "
        f"context {context}, median of {repeats} on {engine.device.type}",
    )


__all__ = ["DEFAULT_ROWS_PER_TREE", "measure_row_cost", "row_cost_plan"]
