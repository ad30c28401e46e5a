"""The toy's step cost measured on this machine (`hycoc.bench.capacity.cost.MeasuredStepCost`, docs/capacity.md
"Inputs"): `measure_step_cost` times the recipe's own verifier the way the server runs it, `cached_step_cost` keeps
the result per recipe.

The pieces, in the order `measure_step_cost` runs them: the (sessions x rows) grid of device-drafted steps, walked
``passes`` times in turn (`_time_grid`); the idle factor from paired probe replays (`_idle_factor`); the spread from
one session replaying whole requests (`_replay_spread`); the steps of the places whose server runs the MTP head
(`_place_points`: the places' `hycoc.verifier.draft_place.DraftPlace` say which, and the rows a round of each sends
and adds to the forward); the least-squares lines and each place's extra ms per session (`_fit_points`); the
prefill line (`_prefill_line`); the row budget's line and its own work (`_budget_ms`). `_StepBench` holds the
scratch sessions and times one step.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from hycoc.bench.capacity.cost import MeasuredStepCost, StepCostError
from hycoc.bench.capacity.speed_probe import SpeedProbe
from hycoc.verifier.row_budget import DEFAULT_MIN_ROWS, RowBudget

#: Session counts and rows per tree of the step measurement (device-drafted rounds).
MEASURE_SESSIONS = (1, 2, 4, 8, 16)
MEASURE_ROWS = (2, 9, 17, 33)


def _fit(xs: list[list[float]], ys: list[float]) -> np.ndarray:
    """Least squares of ys on xs (numpy.linalg.lstsq)."""
    coef, *_ = np.linalg.lstsq(np.asarray(xs, np.float64), np.asarray(ys, np.float64), rcond=None)
    return coef


class _StepBench:
    """Scratch sessions of the recipe's verifier and one timed step over them (`time_step`): device sessions
    replay ``replay``'s recorded requests (their prompts and trees), other places (and device sessions without a
    recording) open random prompts of ``context`` tokens and send random chains. ``rng`` is shared in call order
    (prompts, chains, the prefill line's prompts)."""

    def __init__(self, recipe, engine, context: int, replay, repeats: int):
        from hycoc.protocol.messages import Sampling

        self.recipe, self.engine, self.context, self.replay, self.repeats = recipe, engine, context, replay, repeats
        self.rng = np.random.default_rng(0)
        s = recipe.sampling
        self.sampling = Sampling(s.temperature, s.top_k, s.top_p)

    def open_one(self, i: int, place: str, prompt: int | None = None) -> list:
        """One prefilled scratch session: [session, rounds sent, its replayed request or None, its index]."""
        from hycoc.bench.capacity.requests import TraceRequest
        from hycoc.protocol.messages import Sampling

        engine, tree_rows = self.engine, self.recipe.tree.node_budget + 1
        if place == "device" and self.replay:
            req = self.replay[i % len(self.replay)]
            s = engine.open(
                np.asarray(req.prompt),
                Sampling(req.temperature, req.top_k, req.top_p),
                seed=req.seed,
                acceptance=req.acceptance,
                epsilon=req.epsilon,
                draft_place=place,
                max_new_tokens=10**6,
            )
            s.tree_rows = s.place.tree_rows(tree_rows)  # what a server's OPENED says
            s.prefill()
            return [s, 0, TraceRequest(req), i]
        s = engine.open(
            self.rng.integers(2, engine.vocab_size, self.context if prompt is None else prompt),
            self.sampling,
            seed=i,
            acceptance="exact",
            draft_place=place,
            max_new_tokens=10**6,
        )
        s.tree_rows = s.place.tree_rows(tree_rows)
        s.prefill()
        return [s, 0, None, i]

    def open_sessions(self, n: int, place: str) -> list[list]:
        return [self.open_one(i, place) for i in range(n)]

    def tree_of(self, entry, k: int):
        """The round a session sends: the recorded tree at its text (its first k rows: an ancestor-closed
        subtree, as a budget keeps), or a random chain without a recording."""
        from hycoc.bench.loadtest.trace import patch_root

        s, _, tr, i = entry
        if tr is not None:
            rnd = tr.next_round()
            if rnd is None:  # the recording is over: the next recorded request, a new session (as a load test's
                entry[0].close()  # device i replays requests i, i + 1, ...: hycoc.bench.loadtest.run)
                entry[:] = self.open_one(i + 1, "device")
                return self.tree_of(entry, k)
            scores = None if rnd.tree[0] is None else np.asarray(rnd.tree[0][:k], np.float64)
            toks = patch_root(rnd.tree[1], s.root)[:k].astype(np.int64)
            return toks, np.asarray(rnd.tree[2][:k], np.int64), scores
        toks = np.concatenate([[s.root], self.rng.integers(2, self.engine.vocab_size, k - 1)]).astype(np.int64)
        return toks, np.arange(-1, k - 1, dtype=np.int64), None

    def time_step(self, group, r: int, budget=None, warmup: bool = True):
        """Mean CPU ms, mean forward ms, each repeat's CPU ms and rows verified (kept, with ``budget``) of steps
        where every session of ``group`` sends r rows (its place's `DraftPlace.tree_rows`: the root alone for
        cloud-mtp); the first call a warm-up when ``warmup``."""
        from hycoc.protocol import wire
        from hycoc.verifier.batch import BatchStats, verify_batch

        walls, fwds, kept = [], [], []
        for rep in range(self.repeats + 1 if warmup else self.repeats):
            rounds = []
            for entry in group:
                toks, parents, scores = self.tree_of(entry, entry[0].place.tree_rows(r))
                rounds.append((entry[0], toks, parents, entry[1], scores if budget is not None else None))
            stats = BatchStats()
            w0, c0 = time.perf_counter(), time.thread_time()
            out = verify_batch(self.engine, rounds, stats, budget)
            for reply, rd in zip(out, rounds):  # the reply frames, on the worker as the server's step encodes them
                if not isinstance(reply, BaseException):  # granting the whole tree, as a server would
                    wire.encode(rd[0].grant(reply), version=rd[0].wire_version)
            wall, busy = (time.perf_counter() - w0) * 1e3, (time.thread_time() - c0) * 1e3
            for entry, reply, rd in zip(group, out, rounds):
                if isinstance(reply, BaseException):
                    raise StepCostError(f"measuring the step cost: a scratch round failed ({reply}); report this")
                entry[1] += 1
                if entry[2] is not None:  # the replay follows the text it commits
                    entry[2].commit([int(rd[1][j]) for j in reply.path_rows] + [int(reply.bonus)])
            if rep or not warmup:  # the first call is a warm-up
                walls.append(busy)
                fwds.append(stats.forward_ms * busy / max(wall, 1e-9))  # the forward's share of the busy time
                kept.append(int(stats.rows))
        return float(np.mean(walls)), float(np.mean(fwds)), walls, kept


def _time_grid(bench: _StepBench, groups: dict, rows, passes: int, log) -> tuple[list[dict], list[float]]:
    """The device grid over ``groups`` ({sessions: their scratch sessions}): per (sessions, rows per tree) its mean
    CPU ms and forward ms (points), and every timed step's CPU ms / its point's mean (the spread). The grid is
    walked ``passes`` times in turn, so each point's steps spread over the whole measurement."""
    sessions = list(groups)
    timed: dict[tuple[int, int], list] = {(n, r): [] for n in sessions for r in rows}
    for k in range(passes):
        for n in sessions:
            for r in rows:
                timed[(n, r)].append(bench.time_step(groups[n], r, warmup=k == 0))
    points, spread = [], []
    for n in sessions:
        for r in rows:
            each = [w for _, _, ws, _ in timed[(n, r)] for w in ws]
            wall = float(np.mean(each))
            fwd = float(np.mean([f for _, f, _, _ in timed[(n, r)]]))
            spread += [w / wall for w in each if wall > 0]
            points.append({"place": "device", "sessions": n, "rows": n * r, "step_ms": wall, "forward_ms": fwd})
            log(f"device {n} x {r} rows: {wall:.1f} ms")
    return points, spread


def _idle_factor(probe: SpeedProbe | None, replay, idle_pairs: int, log) -> tuple[float, float, list]:
    """(idle factor, the idle pause ms, the (back to back, paused) probe pairs): a step after the worker idled the
    recorded drafting time against back to back, in A B / B A order so the machine's drift falls on both alike."""
    pause_ab: list[tuple[float, float]] = []
    gap = 0.0
    if probe is not None and idle_pairs:
        gap = float(np.mean([r.device_ms for r in replay[0].rounds if r.device_ms] or [0.0]))
        for k in range(idle_pairs):
            if k % 2 == 0:
                b2b = probe.measure()
                pause_ab.append((b2b, probe.measure(pause_ms=gap)))
            else:
                paused = probe.measure(pause_ms=gap)
                pause_ab.append((probe.measure(), paused))
    factor = float(np.mean([b for _, b in pause_ab]) / np.mean([a for a, _ in pause_ab])) if pause_ab else 1.0
    log(f"a step after the worker idled {gap:.1f} ms: x{factor:.3f} its back-to-back CPU ms")
    return factor, gap, pause_ab


def _replay_spread(bench: _StepBench, replay, spread_steps: int, rows, spread: list, log):
    """(the replayed steps' CPU ms, the spread): with ``replay``, one live-like session replaying whole requests
    in turn, every round as recorded, whose steps' CPU ms / their mean replace the grid's ``spread``."""
    replay_ms: list[float] = []
    if replay and spread_steps:
        one = bench.open_sessions(1, "device")
        for _ in range(max(1, spread_steps // max(1, bench.repeats))):
            replay_ms += bench.time_step(one, rows[-1], warmup=False)[2]
        mean = float(np.mean(replay_ms))
        spread = [w / mean for w in replay_ms]
        log(f"one session replaying whole requests: {mean:.1f} ms a step over {len(replay_ms)} steps")
    return replay_ms, spread


def _place_points(bench: _StepBench, rows, log) -> list[dict]:
    """Steps of 1, 4 and 16 sessions of each place whose server runs the MTP head (`DraftPlace.needs_head`:
    cloud-mtp, server-head), each session sending its place's rows of a B + 1 tree; a place the recipe has no
    head for is logged and left out."""
    from hycoc.verifier.draft_place import PLACES

    points = []
    chain = bench.engine.chain_length
    for name, place in PLACES.items():
        if not place.needs_head:
            continue
        for n in (1, 4, 16):
            try:
                group = bench.open_sessions(n, name)
            except Exception as e:  # noqa: BLE001 -- no head: the place cannot be measured, say so
                log(f"{name}: not measured ({e})")
                break
            r = place.forward_rows(place.tree_rows(rows[-1]), chain)
            wall, fwd, _, _ = bench.time_step(group, rows[-1])
            points.append({"place": name, "sessions": n, "rows": n * r, "step_ms": wall, "forward_ms": fwd})
            log(f"{name} {n}: {wall:.1f} ms")
    return points


def _fit_points(points: list[dict], context: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """(step line, forward line, extra ms per session of each other place): least squares a + b n + c rows over
    the device points; a place's extra ms is its points' step ms beyond the device grid's step of the same rows,
    per session (>= 0)."""
    dev = [p for p in points if p["place"] == "device"]
    xs = [[1.0, p["sessions"], p["rows"]] for p in dev]
    step = _fit(xs, [p["step_ms"] for p in dev])
    fwd = _fit(xs, [p["forward_ms"] for p in dev])
    device_only = MeasuredStepCost(points=points, step=tuple(step), forward=tuple(fwd))
    place_ms = {}
    for place in dict.fromkeys(p["place"] for p in points if p["place"] != "device"):
        pts = [p for p in points if p["place"] == place]
        resid = []
        for p in pts:
            n = p["sessions"]
            resid.append(p["step_ms"] - device_only.step_ms(["device"] * n, [p["rows"] // n] * n, [context])[1])
        place_ms[place] = max(0.0, float(np.sum(resid) / np.sum([p["sessions"] for p in pts])))
    return step, fwd, place_ms


def _prefill_line(bench: _StepBench) -> tuple[float, float]:
    """(p0, p1) of p0 + p1 x positions: `Session.prefill`'s CPU ms at 32 and 256 positions, linear (>= 0)."""
    engine, pre = bench.engine, []
    for n in (32, 256):
        times = []
        for _ in range(bench.repeats):
            s = engine.open(
                bench.rng.integers(2, engine.vocab_size, n + 1), bench.sampling, draft_place="device", max_new_tokens=8
            )
            c0 = time.thread_time()
            s.prefill()
            times.append((time.thread_time() - c0) * 1e3)
            s.close()
        pre.append((n, float(np.mean(times))))
    p1 = (pre[1][1] - pre[0][1]) / (pre[1][0] - pre[0][0])
    return max(0.0, pre[0][1] - p1 * pre[0][0]), max(0.0, p1)


def _budget_ms(line, replay, sessions, rows, repeats: int, log) -> float:
    """The row budget's own work: the server's `RowBudget.choose` on n recorded scored trees, timed on its own
    (CPU ms per session; restrict_round, slicing the pending round to the kept rows, left out). Timed directly:
    the difference of a budgeted step and the grid's plain step of its rows was two noisy numbers' difference (it
    read 0.00-0.38 ms per session in five profiles and 2.30 in a sixth)."""
    extra = []
    pool = [
        (rt.score_array(), np.asarray(rt.tokens), np.asarray(rt.parents))
        for req in replay or ()
        for rt in req.rounds
        if rt.score_array() is not None
    ]
    if pool:
        for n in [m for m in sessions if m > 1]:
            budget = RowBudget(line, max(rows), DEFAULT_MIN_ROWS)
            for rep in range(4 * repeats + 1):
                trees = [pool[(rep * n + j) % len(pool)] for j in range(n)]
                c0 = time.thread_time()
                budget.choose(trees)
                if rep:  # the first call is a warm-up
                    extra.append((time.thread_time() - c0) * 1e3 / n)
    budget_ms = max(0.0, float(np.mean(extra))) if extra else 0.0
    log(f"row budget: {budget_ms:.2f} ms per session and budgeted step")
    return budget_ms


def measure_step_cost(
    recipe,
    *,
    sessions=MEASURE_SESSIONS,
    rows=MEASURE_ROWS,
    context: int = 96,
    repeats: int = 4,
    passes: int = 4,
    spread_steps: int = 240,
    idle_pairs: int = 8,
    replay=None,
    log=lambda s: None,
) -> MeasuredStepCost:
    """Time verifier steps of ``recipe``'s own verifier on this machine (module docstring): about 20-40 s for the
    toy on a 2-core CPU. replay: recorded requests (`hycoc.bench.loadtest.trace.RequestTrace`) whose prompts and trees
    the device sessions replay (their rounds then accept what the recording accepted, so the host work of the
    accepted path -- KV compaction, the hand-off of every committed position -- is in the points); None: random
    chains, which the verifier rejects at the first row. passes x repeats: timed steps per grid point, the grid
    walked ``passes`` times in turn so that each point's mean spans the whole measurement (this machine's speed
    drifts by ~10% from one half-minute to the next; one burst of consecutive steps per point put that drift into
    the points). spread_steps: with ``replay``, one device session replaying whole recorded requests (prefill, every
    round, the next request) for that many steps; each step's CPU ms / their mean is the spread (what a live
    session's steps vary by across a request and over seconds: p90 / mean 1.25-1.30 here, where repeats of one
    point in a row gave 1.03-1.15). idle_pairs: with ``replay``, pairs of `hycoc.bench.capacity.speed_probe.SpeedProbe`
    replays back to back and with the recorded drafting time idle before each step, in A B / B A order; the ratio
    of their means is ``idle_factor`` (a step after the worker waited costs more CPU: its caches went cold; 1.08 -
    1.09 here). Returns the fitted `MeasuredStepCost`. Raises StepCostError when a scratch round fails."""
    import torch

    from hycoc.models import set_threads
    from hycoc.verifier.loading import engine_from_recipe
    from hycoc.verifier.row_cost_measure import measure_row_cost, row_cost_plan

    set_threads(recipe.verifier.threads)
    torch.manual_seed(0)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    engine = engine_from_recipe(recipe, device="cpu")
    engine.eos_token_ids = frozenset()  # scratch sessions never finish on a sampled stop id
    bench = _StepBench(recipe, engine, context, replay, repeats)
    groups = {n: bench.open_sessions(n, "device") for n in sessions}
    probe = SpeedProbe(engine, replay[0]) if replay else None
    if probe is not None:
        probe.measure()  # a warm-up: the first replay on a fresh engine costs more
    points, spread = _time_grid(bench, groups, rows, passes, log)
    idle_factor, gap, pause_ab = _idle_factor(probe, replay, idle_pairs, log)
    replay_ms, spread = _replay_spread(bench, replay, spread_steps, rows, spread, log)
    points += _place_points(bench, rows, log)
    step, fwd, place_ms = _fit_points(points, context)
    prefill = _prefill_line(bench)
    n_rc, rows_rc = row_cost_plan(recipe.tree.node_budget + 1, recipe.verifier.max_batch_rows, engine.max_context)
    line = measure_row_cost(engine, sessions=n_rc, rows_per_tree=rows_rc)
    budget_ms = _budget_ms(line, replay, sessions, rows, repeats, log)
    engine.close()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.perf_counter() - t0, 1),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "threads": recipe.verifier.threads,
        "context": context,
        "repeats": repeats,
        "passes": passes,
        "spread_source": f"one session replaying whole requests, {len(replay_ms)} steps"
        if replay_ms
        else "repeats of each grid point",
        "replay_step_ms": round(float(np.mean(replay_ms)), 3) if replay_ms else None,
        "probe_request": replay[0].question_id if replay else None,
        "idle_pause_ms": round(gap, 3),
        "probe_back_to_back_vs_paused_ms": [[round(a, 3), round(b, 3)] for a, b in pause_ab],
        "recipe_sha256": recipe.content_hash(),
        "cpus": os.cpu_count(),
    }
    return MeasuredStepCost(
        label=f"measured here ({recipe.recipe.name} verifier, cpu, {recipe.verifier.threads} "
        f"thread(s), load {load0[0]:.1f})",
        chain_length=engine.chain_length,
        step=(float(step[0]), float(step[1]), float(step[2])),  # a + b n + c rows
        forward=(float(fwd[0]), float(fwd[1]), float(fwd[2])),
        place_ms=place_ms,
        prefill=prefill,
        row_points=tuple(line.points),
        points=points,
        meta=meta,
        spread=tuple(sorted(float(x) for x in spread)),
        budget_ms=budget_ms,
        idle_factor=idle_factor,
    )


def cached_step_cost(
    recipe,
    cache_dir: Path,
    *,
    remeasure: bool = False,
    replay=None,
    log=lambda s: None,
    recipe_path: Path | None = None,
    keep_set: Path | None = None,
) -> MeasuredStepCost:
    """`measure_step_cost` of ``recipe``, kept in ``cache_dir/step-cost-<recipe hash>.json`` (reused unless
    ``remeasure``; the recipe's hash names it, so another recipe never reads it). With ``recipe_path`` and
    ``replay`` the profile also holds the per-round host work outside the step
    (`hycoc.bench.capacity.host.measure_host_overhead` on the recipe's own verify-server with the first recorded
    request, ``keep_set`` passed to it); a cached file without it is measured again."""
    path = Path(cache_dir) / f"step-cost-{recipe.content_hash()[:16]}.json"
    want_host = recipe_path is not None and bool(replay)
    if path.is_file() and not remeasure:
        cost = MeasuredStepCost.load(path)
        fresh = cost.spread and cost.meta.get("passes")  # files before the spread or the interleaved grid: again
        fresh = fresh and (cost.meta.get("idle_pause_ms") is not None or not replay)  # ... or the idle factor
        if (cost.host or not want_host) and fresh:
            return cost
    cost = measure_step_cost(recipe, replay=replay, log=log)
    if want_host and recipe_path is not None:  # want_host: a recipe_path
        from hycoc.bench.capacity.host import measure_host_overhead

        cost.host = measure_host_overhead(recipe_path, replay[0], keep_set=keep_set, log=log).describe()
    cost.save(path)
    return cost


__all__ = ["MEASURE_ROWS", "MEASURE_SESSIONS", "cached_step_cost", "measure_step_cost"]
