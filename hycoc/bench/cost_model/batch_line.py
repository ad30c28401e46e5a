"""Measuring the batched verification line a cost-model file carries (`hycoc.bench.cost_model.model.BatchPoint`): ms of
ONE batched forward of n sessions whose rows add up to R, the forward the server's batched step runs
(`hycoc.verifier.batch.batch_forward`; one session: `hycoc.verifier.engine.verify_tree`, as
`hycoc.verifier.batch.verify_batch` runs it), for every n in ``sessions`` and R in ``rows`` with R >= n.

Each session holds ``context`` random cached positions in the server's session cache
(`hycoc.bench.cost_model.measure.random_cache` with the engine's ``new_cache``: sliding layers windowed); its R / n rows
(spread as evenly as R allows) form a tree of a root, a chain of up to K and siblings
(`hycoc.bench.cost_model.measure.demo_parents`; the cost does not depend on the tree's shape). Random token ids: with
random weights the router spreads rows nearly uniformly over the experts (the projection's own assumption,
`hycoc.bench.capacity.gpu_cost`). Every point runs ``warmup`` untimed and ``repeats`` timed forwards (CUDA events on a
GPU, perf_counter otherwise), each cache restored after each forward; the median is kept. The grid is walked in turn
(every repetition visits every point), as `hycoc.bench.cost_model.measure.measure_grid` does.

Used by ``benchmarks/verifier_cost_model.py --batch-sessions`` (``benchmarks/gpu_check.sh`` runs it on a GPU);
`hycoc capacity RECIPE --cost-model FILE` reads the line (`hycoc.bench.capacity.cost.LineStepCost`).
"""

from __future__ import annotations

import statistics

import numpy as np

from hycoc.bench.cost_model.measure import demo_parents, random_cache, restore_cache, snapshot_cache
from hycoc.bench.cost_model.model import BatchPoint


def batch_grid(sessions, rows) -> list[tuple[int, int]]:
    """The (sessions, rows) points measured: every pair with rows >= sessions, sessions ascending, then rows."""
    return [(int(n), int(r)) for n in sorted(set(sessions)) for r in sorted(set(rows)) if r >= n]


def split_rows(total: int, sessions: int) -> list[int]:
    """``total`` rows over ``sessions`` trees as evenly as possible (the first ones one row more)."""
    base, extra = divmod(int(total), int(sessions))
    return [base + (1 if i < extra else 0) for i in range(int(sessions))]


def measure_batch_line(
    engine, sessions, rows, context: int, *, warmup: int, repeats: int, seed: int = 0, log=None
) -> list[BatchPoint]:
    """The batched line of ``engine`` (a `hycoc.bench.cost_model.measure.measuring_engine`) at ``context`` cached
    positions per session (module docstring). log(sessions, rows, median_ms, times) per point at the end. Returns
    one `BatchPoint` per `batch_grid` point."""
    import torch

    from hycoc.verifier.batch import batch_forward
    from hycoc.verifier.engine import verify_tree
    from hycoc.verifier.forward import Timer

    model, dev = engine.model, torch.device(engine.device)
    grid = batch_grid(sessions, rows)
    most = max(n for n, _ in grid)
    rng = np.random.default_rng(seed)
    caches = [random_cache(model, int(context), dev, engine.new_cache) for _ in range(most)]
    saved = [snapshot_cache(c) for c in caches]
    plans = {}
    for n, r in grid:
        counts = split_rows(r, n)
        plans[(n, r)] = [demo_parents(k, engine.chain_length) for k in counts]
    times: dict[tuple[int, int], list[float]] = {p: [] for p in grid}
    vocab = model.config.vocab_size
    try:
        for i in range(warmup + repeats):
            for n, r in grid:
                parents = plans[(n, r)]
                tokens = [rng.integers(0, vocab, len(p)) for p in parents]
                with torch.inference_mode(), Timer(dev) as timer:
                    if n == 1:
                        ids = torch.as_tensor(tokens[0], device=dev)
                        verify_tree(model, caches[0], engine.tap, ids, parents[0], int(context), engine.dtype)
                    else:
                        batch_forward(engine, caches[:n], [int(context)] * n, tokens, parents)
                for s in saved[:n]:
                    restore_cache(s)
                if i >= warmup:
                    times[(n, r)].append(timer.ms)
    finally:
        caches.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    out = []
    for n, r in grid:
        ms = statistics.median(times[(n, r)])
        if log is not None:
            log(n, r, ms, times[(n, r)])
        out.append(BatchPoint(sessions=n, rows=r, ms=max(ms, 1e-6), samples_ms=[round(x, 4) for x in times[(n, r)]]))
    return out


__all__ = ["batch_grid", "measure_batch_line", "split_rows"]
