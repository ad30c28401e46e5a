"""The simulated devices of `hycoc loadtest` (`hycoc.bench.loadtest.run`): each replays recorded rounds
(`hycoc.bench.loadtest.trace`) against one verifier, and `run_sessions` runs many of them in ONE process.

A device opens a session with a recorded prompt, then per round waits the recorded device time (the phone drafting;
or a fixed ``device_ms``), sends the recorded tree with its root replaced by the session's actual root
(`patch_root`), and waits for the reply; it loops over its config's recorded prompts until the run's duration is
over. The devices are asyncio tasks speaking the wire protocol (`hycoc.protocol.wire`, `hycoc.protocol.messages`)
over the websockets asyncio client exactly as the device's `hycoc.runtime.transport.VerifierClient` does over the
sync one (compression off, one session per connection, replies decoded against `wire.Limits.from_opened`). A round
costs the client one frame encode and one decode, so its share of the CPU stays small: each run reports it (toy
recipe, 1 to 64 devices: 1-2% of one core).

Per round the client records (`RoundSample`): latency = send -> reply, client side, ms; the reply's server_ms; the
tokens it committed (path + bonus, cut by `commit_cut` as the device does); its rows and context. Every failure
is counted by code (`RunStats.errors`): the ERROR frame's wire code (``bad_root``, ``too_many_sessions``, ...),
``invalid_reply:CODE`` for a reply that fails validation here, ``bad_trace:CODE`` for a recorded tree the
wire refuses to encode, ``http_STATUS`` for a refused WebSocket upgrade (503 at ``max_connections``),
``connection_dropped``, ``timeout``, ``unreachable``. A session that got an error ends (the next device request
starts a new one); a refused OPEN waits ``REFUSED_BACKOFF_S`` before the device tries again.

Timing of a run: all devices start at once, or with ``rate`` their arrivals form a Poisson process of ``rate``
devices per second (seeded, `arrival_delays`); no round starts after ``duration_s``; a round in flight then
completes but only rounds answered within the window count.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np

from hycoc.bench.loadtest.trace import RequestTrace, patch_root, tree_at, trim_to_allowance
from hycoc.protocol import wire
from hycoc.protocol.messages import Close, DraftTree, ErrorReply, Opened, commit_cut
from hycoc.verifier.draft_place import PLACES

#: Seconds a device waits after an OPEN refused for capacity (too_many_sessions, kv_budget_exhausted) before its
#: next request: the server's retry hint is 5 s by default, but a load test wants the pressure to stay on.
REFUSED_BACKOFF_S = 0.5
#: Seconds to wait for any one answer (an OPEN's prefill included) before counting ``timeout``.
ANSWER_TIMEOUT_S = 120.0
#: Server codes that refuse an OPEN for capacity (the device tries again after REFUSED_BACKOFF_S).
CAPACITY_CODES = ("too_many_sessions", "kv_budget_exhausted")


# ---- what the client measures --------------------------------------------------------------------------------


@dataclass(frozen=True)
class RoundSample:
    """One answered round. t_done: seconds from the run's start to the reply; latency_ms: send -> reply (client
    side); server_ms: the reply's; committed: tokens committed (path + bonus after the cut); rows: tree rows sent;
    context: the root's position (tokens already in the verifier's KV)."""

    t_done: float
    latency_ms: float
    server_ms: float
    committed: int
    rows: int
    context: int


@dataclass
class RunStats:
    """Everything one run measured on the client (`run_sessions`). rounds: `RoundSample` per answered round;
    opens_ms: OPEN -> OPENED per opened session (prefill included), ms; errors: code -> count; requests_finished /
    requests_truncated: sessions that ended with a finished reply / ran out of recorded rounds first;
    requests_off_trace: of the truncated, those whose served text left the recording's (`tree_at`: only at T > 0
    with a verifier that commits differently from the recording's, e.g. a budgeted one);
    client_cpu_s: this process's CPU seconds during the run (time.process_time); wall_s: the run's wall seconds;
    first_round_s: device index -> seconds from the start to its first answered round (the end of its ramp-up);
    device_waits_ms: (asked, slept) per device wait between rounds, ms (slept > asked: this process was starved of
    CPU, so the simulated phones ran slower than recorded)."""

    rounds: list[RoundSample] = field(default_factory=list)
    opens_ms: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    requests_finished: int = 0
    requests_truncated: int = 0
    requests_off_trace: int = 0
    client_cpu_s: float = 0.0
    wall_s: float = 0.0
    first_round_s: dict[int, float] = field(default_factory=dict)
    device_waits_ms: list[tuple[float, float]] = field(default_factory=list)


def arrival_delays(sessions: int, rate: float | None, seed: int = 0) -> np.ndarray:
    """Start delays in seconds, float64 (sessions,): all zeros without ``rate``; else a Poisson process of ``rate``
    arrivals per second (exponential gaps, numpy's default_rng(seed)), the first device at 0. Raises ValueError
    for rate <= 0."""
    if rate is None:
        return np.zeros(sessions)
    if not rate > 0:
        raise ValueError(f"rate = {rate}: session arrivals per second must be > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, sessions)
    gaps[0] = 0.0
    return np.cumsum(gaps)


# ---- one simulated device ------------------------------------------------------------------------------------


def committed_tokens(
    tokens: np.ndarray, reply, stop_ids, new_room: int, context_room: int, cloud_mtp: bool
) -> tuple[list[int], str | None]:
    """What the device commits from ``reply`` to the tree ``tokens`` (runtime/client.py `_verified`): the accepted
    path's tokens and the bonus (cloud-mtp: the first |P| + 1 samples), cut by `commit_cut` after a stop id and at
    the rooms left (new tokens, context). Returns (tokens, finish reason or None)."""
    if cloud_mtp:
        new = [int(x) for x in reply.samples[: len(reply.path_rows) + 1]]
    else:
        new = [int(tokens[j]) for j in reply.path_rows] + [int(reply.bonus)]
    return commit_cut(new, set(stop_ids), new_room, context_room)


class _Link:
    """One simulated device's connection: `ask` sends a frame and decodes the answer (within ANSWER_TIMEOUT_S)
    against ``limits``, the wire's limits (the session's, `wire.Limits.from_opened`, once it is open)."""

    def __init__(self, ws, limits: wire.Limits):
        self.ws, self.limits = ws, limits

    async def ask(self, frame: bytes):
        await self.ws.send(frame)
        return wire.decode(await asyncio.wait_for(self.ws.recv(decode=False), ANSWER_TIMEOUT_S), self.limits)  # binary


async def _open(link: _Link, req: RequestTrace, stats: RunStats, device_ms: float | None, max_frame_bytes: int):
    """OPEN ``req``'s session; returns the `Opened` reply, or None after counting a refusal (a capacity refusal
    then waits REFUSED_BACKOFF_S). The link's limits become the session's; a cloud-mtp session's replies carry the
    verifier's own chain, so its tree rows are not pinned."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    request = req.open_request()  # with the recorded drafting ms per round (protocol 6)
    if device_ms is not None:  # a fixed drafting time: the same with and without the SLM pass
        request = replace(request, draft_ms_floor=float(device_ms), draft_ms_tree=float(device_ms))
    opened = await link.ask(wire.encode(request))
    if isinstance(opened, ErrorReply):
        stats.errors[opened.code] += 1
        if opened.code in CAPACITY_CODES:
            await asyncio.sleep(REFUSED_BACKOFF_S)
        return None
    if not isinstance(opened, Opened):
        stats.errors["unexpected_message"] += 1
        return None
    stats.opens_ms.append(1000.0 * (loop.time() - sent))
    link.limits = wire.Limits.from_opened(opened, max_frame_bytes)
    if not PLACES[
        req.draft_place
    ].device_rows:  # root-only trees; the verifier's own chain makes its replies 1 + K rows
        link.limits = replace(link.limits, tree_rows=None)
    return opened


async def _rounds(
    link: _Link,
    req: RequestTrace,
    opened: Opened,
    stop_ids,
    stats: RunStats,
    t0: float,
    deadline: float,
    *,
    device_ms: float | None,
    device: int,
    chain_rows: int,
) -> None:
    """The rounds of one opened session (`replay_request`), until the reply says finished, the recording runs out
    or ``deadline`` has passed."""
    loop = asyncio.get_running_loop()
    cloud_mtp = not PLACES[req.draft_place].device_rows  # the root alone; the server drafts the chain
    root, produced, prompt_len = req.prompt[-1], 0, len(req.prompt)
    text: list[int] = []
    seq, allowance = 0, opened.tree_rows
    while True:
        found = tree_at(req, text, seq)
        if found is None:
            if all(r.committed for r in req.rounds) and len(text) < sum(len(r.committed) for r in req.rounds):
                stats.requests_off_trace += 1  # the served text left the recording's: trees would not fit
            stats.requests_truncated += 1
            return
        rt, tree_tokens, tree_parents, tree_scores = found
        tree_tokens, tree_parents, tree_scores = trim_to_allowance(tree_tokens, tree_parents, tree_scores, allowance)
        no_slm = len(tree_tokens) <= chain_rows and rt.head_ms > 0 and not cloud_mtp
        wait = (rt.head_ms if no_slm else rt.device_ms) if device_ms is None else device_ms
        wait /= 1000.0
        if loop.time() + wait >= deadline:
            return
        slept = loop.time()
        await asyncio.sleep(wait)
        stats.device_waits_ms.append((1000.0 * wait, 1000.0 * (loop.time() - slept)))
        tokens = patch_root(tree_tokens, root)
        try:
            frame = wire.encode(DraftTree(seq, tokens, tree_parents, tree_scores))
        except wire.WireError as e:  # a tree the wire itself refuses: the trace is bad, not the server
            stats.errors[f"bad_trace:{e.code}"] += 1
            return
        sent = loop.time()
        reply = await link.ask(frame)
        done = loop.time()
        if isinstance(reply, ErrorReply):
            stats.errors[reply.code] += 1
            return
        new, reason = committed_tokens(
            tokens,
            reply,
            stop_ids,
            req.max_new_tokens - produced,
            opened.max_context - prompt_len - produced,
            cloud_mtp,
        )
        stats.rounds.append(
            RoundSample(
                done - t0,
                1000.0 * (done - sent),
                float(reply.server_ms),
                len(new),
                len(tokens),
                prompt_len - 1 + produced,
            )
        )
        stats.first_round_s.setdefault(device, done - t0)
        produced += len(new)
        text.extend(new)
        if reply.finished or reason is not None:
            stats.requests_finished += 1
            return
        root = new[-1]
        seq += 1
        allowance = reply.allowance or opened.tree_rows


async def replay_request(
    url: str,
    req: RequestTrace,
    stop_ids,
    stats: RunStats,
    t0: float,
    deadline: float,
    *,
    device_ms: float | None = None,
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
    device: int = 0,
    chain_rows: int = 0,
) -> None:
    """One simulated device request on its own connection (module docstring): OPEN, rounds until the reply says
    finished, the recording runs out or ``deadline`` (loop time, s) has passed, then CLOSE. Results go to
    ``stats`` (times relative to ``t0``, loop time; ``device``: the simulated device's index). Each round holds at
    most the last reply's allowance (protocol 6): the recorded tree trimmed to it (`trim_to_allowance`), and a round
    of at most ``chain_rows`` rows (K + 1, the server's chain_length + 1; 0: never) waits only the recorded MTP
    Drafter's share of the drafting time (``head_ms``: the device skips the SLM pass there). Never raises for a
    server or network failure: it is counted."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus

    try:
        async with connect(
            url,
            compression=None,
            max_size=2 * max_frame_bytes,
            proxy=None,
            open_timeout=ANSWER_TIMEOUT_S,
            ping_interval=None,
        ) as ws:
            link = _Link(ws, wire.Limits(max_frame_bytes=max_frame_bytes))
            opened = await _open(link, req, stats, device_ms, max_frame_bytes)
            if opened is None:
                return
            await _rounds(
                link,
                req,
                opened,
                stop_ids,
                stats,
                t0,
                deadline,
                device_ms=device_ms,
                device=device,
                chain_rows=chain_rows,
            )
            await ws.send(wire.encode(Close(opened.session_id)))
    except wire.WireError as e:
        stats.errors[f"invalid_reply:{e.code}"] += 1
    except TimeoutError:
        stats.errors["timeout"] += 1
    except ConnectionClosed:
        stats.errors["connection_dropped"] += 1
    except InvalidStatus as e:  # e.g. HTTP 503 at max_connections
        stats.errors[f"http_{e.response.status_code}"] += 1
        await asyncio.sleep(REFUSED_BACKOFF_S)
    except (OSError, InvalidHandshake):
        stats.errors["unreachable"] += 1
        await asyncio.sleep(REFUSED_BACKOFF_S)


async def _device(
    index: int,
    url: str,
    requests: list[RequestTrace],
    stop_ids,
    stats: RunStats,
    t0: float,
    deadline: float,
    start_delay: float,
    device_ms: float | None,
    chain_rows: int = 0,
) -> None:
    """One simulated device: after ``start_delay`` s, its config's recorded requests in turn (device ``index``
    starts at request ``index``, so devices of one config do not all replay the same prompt) until the deadline."""
    loop = asyncio.get_running_loop()
    await asyncio.sleep(start_delay)
    k = index
    while loop.time() < deadline:
        await replay_request(
            url,
            requests[k % len(requests)],
            stop_ids,
            stats,
            t0,
            deadline,
            device_ms=device_ms,
            device=index,
            chain_rows=chain_rows,
        )
        k += 1


async def _ticker(t0: float, deadline: float, stats: RunStats, tick: Callable[[RunStats], None] | None) -> None:
    while tick is not None and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(1.0)
        tick(stats)


def run_sessions(
    url: str,
    per_device: list[list[RequestTrace]],
    stop_ids,
    duration_s: float,
    *,
    rate: float | None = None,
    device_ms: float | None = None,
    seed: int = 0,
    tick: Callable[[RunStats], None] | None = None,
    chain_rows: int = 0,
) -> RunStats:
    """Run ``len(per_device)`` simulated devices against the verifier at ``url`` for ``duration_s`` seconds
    (module docstring) and return what they measured.

    per_device: for each device, the recorded requests it loops over (its config's). stop_ids: the trace's stop
    ids. rate: device arrivals per second (None: all at once). device_ms: fixed device time per round instead of
    the recorded one, ms. tick: called about once a second with the stats so far (progress). chain_rows: K + 1
    (`replay_request`: rounds that small skip the SLM pass's time). Raises ValueError
    for an empty device list or request list, or duration_s <= 0."""
    if not per_device or any(not reqs for reqs in per_device):
        raise ValueError("per_device: every simulated device needs at least one recorded request")
    if not duration_s > 0:
        raise ValueError(f"duration_s = {duration_s}: must be > 0 seconds")
    delays = arrival_delays(len(per_device), rate, seed)
    stats = RunStats()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        deadline = t0 + duration_s
        ticker = asyncio.create_task(_ticker(t0, deadline, stats, tick))
        await asyncio.gather(
            *(
                _device(i, url, reqs, stop_ids, stats, t0, deadline, float(delays[i]), device_ms, chain_rows)
                for i, reqs in enumerate(per_device)
            )
        )
        ticker.cancel()

    cpu, wall = time.process_time(), time.perf_counter()
    asyncio.run(main())
    stats.client_cpu_s, stats.wall_s = time.process_time() - cpu, time.perf_counter() - wall
    return stats


__all__ = [
    "ANSWER_TIMEOUT_S",
    "CAPACITY_CODES",
    "REFUSED_BACKOFF_S",
    "RoundSample",
    "RunStats",
    "arrival_delays",
    "committed_tokens",
    "replay_request",
    "run_sessions",
]
