"""The verifier's step cost as the running ``hycoc verify-server`` pays it, for `hycoc capacity`'s profile
(`hycoc.bench.capacity_cost.cached_step_cost`; docs/capacity.md "Inputs: measured or assumed").

`hycoc.bench.capacity_cost.measure_step_cost` times `verify_batch` on an engine built inside the ``hycoc capacity``
process, over the whole grid of sessions x rows per tree. The load test's steps run elsewhere: in the
verify-server's worker thread, in its own process, heap and threads. `measure_server_steps` times them there: it
starts the recipe's own ``hycoc verify-server`` (batched, ``--tree-budget auto``, a long ``--max-batch-wait-ms`` so
that the n rounds sent together always share one forward), opens n sessions over WebSockets with recorded requests
(`hycoc.bench.loadtrace.RequestTrace`: their prompts, their trees at the committed text, `tree_at`), sends each
session's next recorded tree at once, and reads the server's /metrics before and after each step:

* ``hycoc_worker_cpu_seconds_total``: the worker thread's CPU over every engine call (`time.thread_time` around
  each, added before the call's replies go out), so its difference across the step is the step's CPU -- the forward,
  the host work around it and the replies' `wire.encode`, what the profile's points hold;
* ``hycoc_forward_ms_total`` and ``hycoc_server_ms_total``: the forward's share of the step's wall time (the
  forward's CPU ms = step CPU x that share, as the profile's);
* ``hycoc_batch_sessions`` / ``hycoc_batch_rows``: the step was ONE forward of all n sessions and how many rows it
  verified (a step split in two, or a session refused, is timed again).

Over the wire a device round has the recipe's B + 1 rows (``tree_rows``), so the server gives the grid's full-tree
column (n x (B + 1) rows, unscored trees: verified whole) and, with the recorded scores sent, budgeted steps (the
server's own `RowBudget` keeps the rows: their CPU against the grid's step of the rows kept is the budget's own
work). Smaller trees reach a server only through its budget; `calibrate` scales the in-process grid's points of n
sessions by the server's ms / the in-process ms at n x (B + 1) rows (one factor per n, interpolated for the places'
and prefill's points), so every point is the server's cost. The row cost line is the server's own (/healthz, measured
in its process before it serves) and the steps' spread the server's steps'.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import numpy as np

#: Counters read per step (sample names of the /metrics exposition; docs/serving.md "Many devices").
CPU_METRIC = "hycoc_worker_cpu_seconds_total"
_READ = (
    CPU_METRIC,
    "hycoc_forward_ms_total",
    "hycoc_server_ms_total",
    "hycoc_batch_sessions_count",
    "hycoc_batch_sessions_sum",
    "hycoc_batch_rows_sum",
    "hycoc_sessions_active",
)
#: How long the profiling server lets the first round of a step wait for the others (ms): all n rounds are sent
#: together and the scheduler dispatches as soon as every open session has one queued, so this never delays a step.
BATCH_WAIT_MS = 2000


def read_counters(http_url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """The `_READ` samples of ``GET http_url/metrics`` (prometheus_client's text parser). Raises StepCostError when
    the server has no ``hycoc_worker_cpu_seconds_total`` (a verify-server older than it)."""
    from prometheus_client.parser import text_string_to_metric_families

    from hycoc.bench.capacity_cost import StepCostError

    with urllib.request.urlopen(http_url + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode("utf-8")
    got = {s.name: float(s.value) for f in text_string_to_metric_families(text) for s in f.samples if not s.labels}
    if CPU_METRIC not in got:
        raise StepCostError(
            f"{http_url}/metrics has no {CPU_METRIC}: a verify-server of an older hycoc; profile with this one's"
        )
    return {k: got.get(k, 0.0) for k in _READ}


class _Device:
    """One replayed session on its own connection: the recorded request, what it committed, its next seq."""

    def __init__(self, reqs, k: int):
        self.reqs, self.k = reqs, k
        self.ws = self.opened = self.limits = None
        self.produced: list[int] = []
        self.seq = 0

    @property
    def req(self):
        return self.reqs[self.k % len(self.reqs)]

    async def open(self, url: str) -> None:
        from websockets.asyncio.client import connect

        from hycoc.bench.capacity_cost import StepCostError
        from hycoc.protocol import wire
        from hycoc.protocol.messages import Opened

        limits = wire.Limits()
        self.ws = await connect(
            url, compression=None, max_size=2 * limits.max_frame_bytes, proxy=None, ping_interval=None
        )
        await self.ws.send(wire.encode(self.req.open_request()))
        opened = wire.decode(await self.ws.recv(), limits)
        if not isinstance(opened, Opened):
            raise StepCostError(
                f"profiling the verify-server: it refused an OPEN ({getattr(opened, 'message', opened)})"
            )
        self.opened, self.limits = opened, wire.Limits.from_opened(opened, limits.max_frame_bytes)
        self.produced, self.seq = [], 0

    async def close(self) -> None:
        from hycoc.protocol import wire
        from hycoc.protocol.messages import Close

        if self.ws is not None:
            try:
                await self.ws.send(wire.encode(Close(self.opened.session_id)))
            finally:
                await self.ws.close()
            self.ws = None

    async def next_tree(self, url: str, scored: bool):
        """The recorded tree at the committed text (root patched to the last committed token; scores only when
        ``scored``); the next recorded request on a new session once this one's recording is over."""
        from hycoc.bench.loadtrace import patch_root, tree_at
        from hycoc.protocol.messages import DraftTree

        for _ in range(len(self.reqs) + 1):
            got = tree_at(self.req, self.produced, self.seq)
            if got is not None:
                _, tokens, parents, scores = got
                tokens = patch_root(tokens, ([*self.req.prompt, *self.produced])[-1])
                return DraftTree(self.seq, tokens, parents, scores if scored else None)
            await self.renew(url)
        raise ValueError("profiling the verify-server: no recorded request has a round to replay")

    async def renew(self, url: str, step: int = 1) -> None:
        """A new session with the recorded request ``step`` further on (this one's recording is over)."""
        await self.close()
        self.k += step
        await self.open(url)

    def commit(self, tree, reply) -> bool:
        """Follow the reply's committed tokens (`hycoc.bench.loadtest.committed_tokens`); False once finished."""
        from hycoc.bench.loadtest import committed_tokens

        new, finish = committed_tokens(
            tree.tokens, reply, self.opened.stop_ids, 10**6, 10**6, self.req.draft_place == "cloud-mtp"
        )
        self.produced += new
        self.seq += 1
        return finish is None and not reply.finished


async def _steps(url: str, http_url: str, replay, sessions, repeats: int, tree_rows: int, log) -> dict:
    """Every point's timed steps (module docstring): {"plain": {n: [step dicts]}, "scored": {n: [...]}}."""
    from hycoc.bench.capacity_cost import StepCostError
    from hycoc.protocol import wire
    from hycoc.protocol.messages import ErrorReply

    out: dict = {"plain": {}, "scored": {}}
    for n in sessions:
        devices = [_Device(replay, i) for i in range(n)]
        for d in devices:
            await d.open(url)
        try:
            for kind in ("plain", "scored") if n > 1 else ("plain",):
                steps, tries = [], 0
                while len(steps) < repeats + 1:  # the first: a warm-up
                    tries += 1
                    if tries > 3 * (repeats + 1):
                        raise StepCostError(
                            f"profiling the verify-server: {n} rounds sent together never shared one forward"
                        )
                    trees = [await d.next_tree(url, kind == "scored") for d in devices]
                    c0 = read_counters(http_url)
                    for d, tree in zip(devices, trees):
                        await d.ws.send(wire.encode(tree))
                    replies = [wire.decode(await d.ws.recv(), d.limits) for d in devices]
                    c1 = read_counters(http_url)
                    for d, tree, reply in zip(devices, trees, replies):
                        if isinstance(reply, ErrorReply):
                            raise StepCostError(
                                f"profiling the verify-server: a round got {reply.code}: {reply.message}"
                            )
                        if not d.commit(tree, reply):
                            await d.renew(url, n)
                    dc = {k: c1[k] - c0[k] for k in _READ}
                    if dc["hycoc_batch_sessions_count"] != 1 or dc["hycoc_batch_sessions_sum"] != n:
                        continue  # not one forward of all n rounds: again
                    if kind == "plain" and dc["hycoc_batch_rows_sum"] != n * tree_rows:
                        continue
                    cpu = dc[CPU_METRIC] * 1e3
                    wall = dc["hycoc_server_ms_total"]
                    steps.append(
                        {
                            "step_ms": cpu,
                            "forward_ms": dc["hycoc_forward_ms_total"] * cpu / wall if wall > 0 else 0.0,
                            "rows": int(dc["hycoc_batch_rows_sum"]),
                        }
                    )
                out[kind][n] = steps[1:]
                ms = statistics.fmean(s["step_ms"] for s in steps[1:])
                log(f"verify-server, {kind} {n} x {tree_rows} rows: {ms:.1f} ms")
        finally:
            for d in devices:
                await d.close()
        ended = time.monotonic() + 30.0
        while read_counters(http_url)["hycoc_sessions_active"] > 0:  # the next group's "every session queued"
            if time.monotonic() > ended:
                raise StepCostError("profiling the verify-server: its sessions did not end within 30 s of closing")
            await asyncio.sleep(0.01)
    return out


def profile_server(url: str, replay, *, sessions, repeats: int = 7, log=lambda s: None) -> dict:
    """Time steps on the running batched verify-server at ``url`` (``ws://HOST:PORT``; module docstring) with the
    recorded requests ``replay`` (device-drafted, with scores): for each n in ``sessions``, ``repeats`` steps of n
    full trees unscored (after a warm-up) and, for n > 1, as many with the recorded scores (the server's row budget,
    if on, choosing rows). Returns {"tree_rows", "row_points" (the server's row cost line or []), "plain": {n:
    [{"step_ms": worker CPU ms, "forward_ms": its forward's share, "rows": rows verified}, ...]}, "scored": {...}}.
    Raises StepCostError when a round fails or n rounds never share one forward."""
    from hycoc.bench.loadtest import healthz

    health = healthz(url)
    tree_rows = int(health["tree_rows"])
    http_url = "http" + url.removeprefix("ws")
    got = asyncio.run(_steps(url, http_url, list(replay), tuple(sessions), repeats, tree_rows, log))
    line = (health.get("batching") or {}).get("row_cost") or {}
    return dict(got, tree_rows=tree_rows, row_points=[tuple(p) for p in line.get("points", [])])


def measure_server_steps(
    recipe_path: Path, replay, *, keep_set: Path | None = None, sessions=(1, 2, 4, 8, 16), repeats: int = 7, log=print
) -> dict:
    """`profile_server` on the recipe's own ``hycoc verify-server`` started here (batched, ``--tree-budget
    auto``, ``--max-batch-wait-ms`` `BATCH_WAIT_MS`), stopped after. About 15 s for the toy (the server's start)."""
    from hycoc.bench.capacity_cost import StepCostError
    from hycoc.bench.loadtest import MODE_ARGS, healthz
    from hycoc.bench.runner import VerifierProcess

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    server = VerifierProcess(
        Path(recipe_path),
        keep_set,
        extra_args=[*MODE_ARGS["budgeted"], "--max-batch-wait-ms", str(BATCH_WAIT_MS)],
        error=StepCostError,
    )
    try:
        while True:
            try:
                if healthz(server.url).get("status") == "ok":
                    break
            except OSError:
                pass
            if time.monotonic() > server.deadline or server.proc.poll() is not None:
                raise StepCostError(f"the verifier at {server.url} did not answer /healthz: {server.stderr_tail()}")
            time.sleep(0.2)
        max_rows = int(healthz(server.url)["batching"]["max_batch_rows"])
        tree_rows = int(healthz(server.url)["tree_rows"])
        fit = [n for n in sessions if n * tree_rows <= max_rows]
        got = profile_server(server.url, replay, sessions=fit, repeats=repeats, log=log)
    finally:
        server.stop()
    got["meta"] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "seconds": round(time.perf_counter() - t0, 1),
        "loadavg_before": [round(x, 2) for x in load0],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
        "repeats": repeats,
    }
    return got


def _factor(ns: list[int], fs: list[float], n: float) -> float:
    """The factor at ``n`` sessions: linear between the measured ns, held beyond them."""
    return float(np.interp(n, ns, fs))


def calibrate(local, server: dict):
    """``local`` (a `hycoc.bench.capacity_cost.MeasuredStepCost` of the in-process grid) moved onto the server's
    steps (module docstring): device points of n sessions x the server's / the local mean at n x tree_rows rows
    (step and forward separately), the places' points by the step factor at their n (``place_ms`` then as
    `measure_step_cost` derives it, over the calibrated device grid), prefill by the
    one-session factor; ``spread`` the server's steps' (CPU ms / their point's mean), ``row_points`` the server's
    line where it has one, ``budget_ms`` from the server's scored steps against the calibrated grid. The factors and
    the server's means are kept in ``meta["server"]``. Returns a new MeasuredStepCost; raises StepCostError when the
    local grid has no point at a server point's rows."""
    from hycoc.bench.capacity_cost import MeasuredStepCost, StepCostError

    rows = int(server["tree_rows"])
    ns, fs, gs, means = [], [], [], {}
    for n, steps in sorted(server["plain"].items()):
        n = int(n)
        at = [p for p in local.points if p["place"] == "device" and p["sessions"] == n and p["rows"] == n * rows]
        if not at or not steps:
            raise StepCostError(f"the in-process profile has no point of {n} x {rows} rows to match the server's")
        step, fwd = statistics.fmean(s["step_ms"] for s in steps), statistics.fmean(s["forward_ms"] for s in steps)
        ns.append(n)
        fs.append(step / at[0]["step_ms"] if at[0]["step_ms"] > 0 else 1.0)
        gs.append(fwd / at[0]["forward_ms"] if at[0]["forward_ms"] > 0 else fs[-1])
        means[n] = {"step_ms": step, "forward_ms": fwd, "in_process_step_ms": at[0]["step_ms"]}
    points = []
    for p in local.points:
        f, g = _factor(ns, fs, p["sessions"]), _factor(ns, gs, p["sessions"])
        points.append(dict(p, step_ms=p["step_ms"] * f, forward_ms=p["forward_ms"] * g))
    dev = [p for p in points if p["place"] == "device"]
    xs = [[1.0, p["sessions"], p["rows"]] for p in dev]

    def fit(key):
        coef, *_ = np.linalg.lstsq(np.asarray(xs), np.asarray([p[key] for p in dev]), rcond=None)
        return tuple(float(x) for x in coef)

    mean_f = statistics.fmean(fs)
    spread = sorted(
        s["step_ms"] / means[int(n)]["step_ms"]
        for n, steps in server["plain"].items()
        for s in steps
        if means[int(n)]["step_ms"] > 0
    )
    out = replace(
        local,
        points=points,
        step=fit("step_ms"),
        forward=fit("forward_ms"),
        place_ms={},
        prefill=(local.prefill[0] * fs[0], local.prefill[1] * fs[0]),
        spread=tuple(float(x) for x in spread) or local.spread,
        row_points=tuple(tuple(p) for p in server.get("row_points") or ()) or local.row_points,
        meta=dict(local.meta, server=dict(server.get("meta", {}), factors=dict(zip(map(str, ns), fs)), points=means)),
        label=local.label.replace("measured here", "measured here in the verify-server", 1),
    )
    device = replace(out, place_ms={})
    for place in local.place_ms:  # as measure_step_cost: the place's points over the device grid's, per session
        pts = [p for p in points if p["place"] == place]
        if pts:
            over = [
                p["step_ms"]
                - device.step_ms(["device"] * p["sessions"], [p["rows"] // p["sessions"]] * p["sessions"], [0])[1]
                for p in pts
            ]
            out.place_ms[place] = max(0.0, sum(over) / sum(p["sessions"] for p in pts))
        else:
            out.place_ms[place] = local.place_ms[place] * mean_f
    extra = []
    for n, steps in server.get("scored", {}).items():
        n = int(n)
        for s in steps:
            extra.append((s["step_ms"] - out.step_ms(["device"] * n, [max(1, s["rows"] // n)] * n, [0])[1]) / n)
    if extra:
        out.budget_ms = max(0.0, statistics.fmean(extra))
    else:
        out.budget_ms = local.budget_ms * mean_f
    assert isinstance(out, MeasuredStepCost)
    return out


__all__ = ["BATCH_WAIT_MS", "CPU_METRIC", "calibrate", "measure_server_steps", "profile_server", "read_counters"]
