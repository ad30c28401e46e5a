"""The per-round host work outside the verifier's step, measured for `hycoc capacity` (docs/capacity.md "Inputs:
measured or assumed"): a `HostOverhead`.

A round costs more than its step on the worker (`hycoc.bench.capacity.cost`): the device encodes its tree and sends
it; the server's event loop receives the WebSocket frame, decodes and checks it (`hycoc.protocol.wire.decode`
against the session's limits), hands the round to the worker and, when the worker is done, sends the reply; the
device receives and decodes the reply. `measure_host_overhead` times exactly that with the forward left out: it
starts the recipe's own ``hycoc verify-server`` (`hycoc.bench.loadtest.run.ServerProcess`), opens one session with a
recorded request, sends the recorded first tree once (a real round), then sends the same frame again ``repeats``
times. The server answers each repeat through its idempotent-retry path (`verifier/server/session_loop.py`
``SessionLoop._round``: same seq and bytes -> the stored reply frame, the engine and the worker untouched), so every
repeat is a round trip of real frames -- the recorded tree up, the real reply with its hand-off down -- through
the server's event loop, the loopback socket and a client that does what `hycoc loadtest`'s does per round
(`wire.encode` of the tree, `wire.decode` of the reply against the OPENED's limits, `committed_tokens`).

Measured per repeat: the wall time (send -> reply decoded), the client's CPU (its thread's `time.thread_time`),
the server process's CPU (its threads' /proc/PID/task/TID/schedstat on-CPU ns, Linux sched-stats; where /proc has
none, the wall time minus the client's CPU is counted as the server's). Means over the repeats. Where each part
runs, the split the simulation uses (`hycoc.bench.capacity.simulation.SimConfig`):

* ``loop_ms``: the server process's CPU per round -- one event loop per verifier, so SERIALISED across sessions
  (a SimPy resource per replica), half before the round reaches the queue (frame in, decode), half after the
  step (reply out);
* ``client_ms``: the client's CPU per round -- each device its own, in PARALLEL, half before the send (encode),
  half after the reply (decode);
* ``wire_ms``: the rest of the wall time (the loopback socket, the two processes' wake-ups), a delay in parallel.

Not in a repeat: the reply's `wire.encode` (on the worker thread after the forward, `verifier/scheduler.py`
``_step`` and ``SessionLoop._verify``) -- `hycoc.bench.capacity.measure.measure_step_cost` times it inside the step,
where it runs -- and the hand-off of the round to the worker thread and back (``run_in_executor``), timed here as
``handoff_ms`` on a one-thread executor (`concurrent.futures.ThreadPoolExecutor`, as `EngineWorker`) left idle
for the same gap between calls, and added to ``loop_ms``.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path


@dataclass
class HostOverhead:
    """Per-round host work outside the verifier's step, ms (module docstring): ``loop_ms`` serialised on the
    server's event loop, ``client_ms`` on each device, ``wire_ms`` a parallel delay, ``handoff_ms`` the worker
    hand-off (inside ``loop_ms``); ``wall_ms``: the stubbed round trip's mean wall time; ``meta``: repeats,
    date, load, reply bytes."""

    loop_ms: float = 0.0
    client_ms: float = 0.0
    wire_ms: float = 0.0
    handoff_ms: float = 0.0
    wall_ms: float = 0.0
    meta: dict = field(default_factory=dict)

    @property
    def round_ms(self) -> float:
        """What the host work adds to one round on an idle verifier: loop + client + wire, ms."""
        return self.loop_ms + self.client_ms + self.wire_ms

    def describe(self) -> dict:
        return dict(asdict(self), round_ms=self.round_ms)

    @classmethod
    def from_dict(cls, d: dict | None) -> HostOverhead:
        """`describe`'s (or `asdict`'s) dict back; None or {} -> no overhead (all zero)."""
        d = dict(d or {})
        d.pop("round_ms", None)
        return cls(**d)


def _server_cpu_ns(pid: int) -> int | None:
    """On-CPU ns of every thread of process ``pid`` so far (`hycoc.bench.capacity.run.SchedSampler.thread_stats`:
    /proc/PID/task/TID/schedstat's first field), or None where /proc has no schedstat."""
    from hycoc.bench.capacity.run import SchedSampler

    got = SchedSampler.thread_stats(pid)
    return sum(run for run, _, _ in got.values()) if got else None


def handoff_ms(repeats: int = 200, gap_s: float = 0.0) -> float:
    """Mean wall ms of ``await loop.run_in_executor(one-thread executor, no-op)`` on a fresh asyncio loop, ``gap_s``
    idle between calls: the event loop handing a round to a parked worker thread and getting its result back
    (`EngineWorker.run`), wake-ups included."""
    from concurrent.futures import ThreadPoolExecutor

    async def main() -> float:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(max_workers=1) as ex:
            await loop.run_in_executor(ex, int)
            total = 0.0
            for _ in range(repeats):
                await asyncio.sleep(gap_s)
                t0 = time.perf_counter()
                await loop.run_in_executor(ex, int)
                total += time.perf_counter() - t0
            return total * 1e3 / repeats

    return asyncio.run(main())


async def _round_trips(url: str, req, repeats: int, pid: int, gap_s: float) -> dict:
    from websockets.asyncio.client import connect

    from hycoc.bench.loadtest.run import committed_tokens
    from hycoc.bench.loadtest.trace import patch_root, tree_at
    from hycoc.protocol import wire
    from hycoc.protocol.messages import Close, DraftTree, ErrorReply, Opened
    from hycoc.verifier.draft_place import PLACES

    limits = wire.Limits()
    loop = asyncio.get_running_loop()
    async with connect(
        url, compression=None, max_size=2 * limits.max_frame_bytes, proxy=None, ping_interval=None
    ) as ws:
        await ws.send(wire.encode(req.open_request()))
        opened = wire.decode(await ws.recv(decode=False), limits)  # the protocol is binary
        if not isinstance(opened, Opened):
            raise RuntimeError(f"the verifier refused the OPEN: {getattr(opened, 'message', opened)}")
        limits = wire.Limits.from_opened(opened, limits.max_frame_bytes)
        _, tokens, parents, scores = tree_at(req, [], 0)
        tokens = patch_root(tokens, req.prompt[-1])
        cloud_mtp = not PLACES[req.draft_place].device_rows  # the root alone: the reply's samples are the commit

        async def one() -> tuple[bytes, float]:
            t = loop.time()
            await ws.send(wire.encode(DraftTree(0, tokens, parents, scores)))
            data = await ws.recv(decode=False)
            reply = wire.decode(data, limits)
            if isinstance(reply, ErrorReply):
                raise RuntimeError(f"the verifier answered {reply.code}: {reply.message}")
            committed_tokens(tokens, reply, opened.stop_ids, 10**6, 10**6, cloud_mtp)
            return data, loop.time() - t

        data, _ = await one()  # the real round (the worker verifies it); the repeats are its retries
        for _ in range(min(20, repeats)):  # warm-up
            await one()
        walls = []
        c0, s0 = time.thread_time(), _server_cpu_ns(pid)
        for _ in range(repeats):
            await asyncio.sleep(gap_s)  # the device drafting: both processes' loops go idle, as in a run
            walls.append((await one())[1])
        client_s, s1 = time.thread_time() - c0, _server_cpu_ns(pid)
        await ws.send(wire.encode(Close(opened.session_id)))
    return {
        "walls_ms": [1e3 * w for w in walls],
        "client_ms": 1e3 * client_s / repeats,
        "server_ms": None if s0 is None or s1 is None else (s1 - s0) / 1e6 / repeats,
        "reply_bytes": len(data),
    }


def measure_host_overhead(
    recipe_path: Path,
    request,
    *,
    keep_set: Path | None = None,
    repeats: int = 300,
    gap_ms: float | None = None,
    log=lambda s: None,
) -> HostOverhead:
    """Time the stubbed round trip (module docstring) on ``recipe_path``'s own verify-server (serial batching; the
    event loop's work per frame does not depend on the mode) with ``request`` (a `hycoc.bench.loadtest.trace.
    RequestTrace`, whose first tree is sent). Between repeats the client sleeps ``gap_ms`` (default: the
    request's mean recorded drafting ms per round), so each round trip starts from idle event loops and pays their
    wake-ups, as a device's round does. About 20 s for the toy (the server's start). Returns a `HostOverhead`.
    Raises RuntimeError when the server refuses the session."""
    from hycoc.bench.loadtest.run import ServerProcess

    if gap_ms is None:
        gap_ms = statistics.fmean(r.device_ms for r in request.rounds) if request.rounds else 0.0
    load0 = os.getloadavg()
    server = ServerProcess(Path(recipe_path), batching="serial", keep_set=keep_set)
    try:
        got = asyncio.run(_round_trips(server.url, request, repeats, server.proc.pid, gap_ms / 1e3))
    finally:
        server.stop()
    hop = handoff_ms(gap_s=gap_ms / 1e3)
    wall = statistics.fmean(got["walls_ms"])  # a mean, as the CPU figures (a queue follows mean times)
    client = got["client_ms"]
    loop_cpu = got["server_ms"] if got["server_ms"] is not None else max(0.0, wall - client)
    out = HostOverhead(
        loop_ms=loop_cpu + hop,
        client_ms=client,
        wire_ms=max(0.0, wall - client - loop_cpu),
        handoff_ms=hop,
        wall_ms=wall,
        meta={
            "repeats": repeats,
            "gap_ms": round(gap_ms, 3),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "loadavg_before": [round(x, 2) for x in load0],
            "loadavg_after": [round(x, 2) for x in os.getloadavg()],
            "reply_bytes": got["reply_bytes"],
            "wall_ms_p10_p90": [
                round(statistics.quantiles(got["walls_ms"], n=10)[0], 3),
                round(statistics.quantiles(got["walls_ms"], n=10)[-1], 3),
            ],
            "server_cpu_source": "schedstat" if got["server_ms"] is not None else "wall - client (no schedstat)",
        },
    )
    log(
        f"host work per round: loop {out.loop_ms:.2f} ms (serialised), client {out.client_ms:.2f} ms, "
        f"wire {out.wire_ms:.2f} ms (wall {wall:.2f} ms)"
    )
    return out


__all__ = ["HostOverhead", "handoff_ms", "measure_host_overhead"]
