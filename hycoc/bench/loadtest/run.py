"""`hycoc loadtest`: many simulated devices against one verifier, and what the verifier delivers (docs/serving.md
"Load test: `hycoc loadtest`").

Each simulated device replays recorded rounds (`hycoc.bench.loadtest.trace`): it opens a session with a recorded
prompt, then per round waits the recorded device time (the phone drafting; or a fixed ``device_ms``), sends the
recorded tree with its root replaced by the session's actual root (`patch_root`), and waits for the reply; it
loops over its config's recorded prompts until the run's duration is over. All devices are asyncio tasks of ONE
process (`run_sessions`), speaking the wire protocol (`hycoc.protocol.wire`, `hycoc.protocol.messages`) over the
websockets asyncio client exactly as the device's `hycoc.runtime.transport.VerifierClient` does over the sync one
(compression off, one session per connection, replies decoded against `wire.Limits.from_opened`). A round costs the
client one frame encode and one decode, so its share of the CPU stays small: each run reports it (toy recipe, 1 to
64 devices: 1-2% of one core).

Per round the client records (`RoundSample`): latency = send -> reply, client side, ms; the reply's server_ms; the
tokens it committed (path + bonus, cut by `commit_cut` as the device does); its rows and context. Every failure
is counted by code (`RunStats.errors`): the ERROR frame's wire code (``bad_root``, ``too_many_sessions``, ...),
``invalid_reply:CODE`` for a reply that fails validation here, ``bad_trace:CODE`` for a recorded tree the
wire refuses to encode, ``http_STATUS`` for a refused WebSocket upgrade (503 at ``max_connections``),
``connection_dropped``, ``timeout``, ``unreachable``. A session that got an error ends (the next device request
starts a new one); a refused OPEN waits ``REFUSED_BACKOFF_S`` before the device tries again.

Timing of a run: all devices start at once, or with ``rate`` their arrivals form a Poisson process of ``rate``
devices per second (seeded, `arrival_delays`); no round starts after ``duration_s``; a round in flight then
completes but only rounds answered within the window count, and the measured window starts once every device
has had its first round answered (the ramp: connects, OPENs and prefills queue up at the start;
`hycoc.bench.loadtest.report.summarize_run`).

The server side: `ServerProcess` starts ``hycoc verify-server RECIPE --port 0`` in its own process (so client and
server never share a GIL), passes ``--batching MODE`` when that server has the option
(`server_batching_support`), and waits for its ``/healthz``; `scrape_metrics` reads ``/metrics`` before and after
each run so the report can take rows per forward from the server's histograms where it has them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from hycoc.bench.loadtest.trace import RequestTrace, patch_root, tree_at, trim_to_allowance
from hycoc.bench.verifier_process import VerifierProcess
from hycoc.protocol import wire
from hycoc.protocol.messages import Close, DraftTree, ErrorReply, Opened, commit_cut
from hycoc.serving_limits import SCORED_MODES, SERVER_MODES
from hycoc.verifier.draft_place import PLACES

#: Seconds a device waits after an OPEN refused for capacity (too_many_sessions, kv_budget_exhausted) before its
#: next request: the server's retry hint is 5 s by default, but a load test wants the pressure to stay on.
REFUSED_BACKOFF_S = 0.5
#: Session counts of the budget's GPU projection (whatever the run's): around 206 / 33 = 6 trees trimming starts.
PROJECTION_SESSIONS = (1, 2, 4, 6, 7, 8, 16, 32, 64)
#: Seconds to wait for any one answer (an OPEN's prefill included) before counting ``timeout``.
ANSWER_TIMEOUT_S = 120.0
#: Server codes that refuse an OPEN for capacity (the device tries again after REFUSED_BACKOFF_S).
CAPACITY_CODES = ("too_many_sessions", "kv_budget_exhausted")


class LoadTestError(RuntimeError):
    """The load test cannot start or go on (the server did not start, a mode it does not have, ...). The message
    says what to do."""


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

    loop = asyncio.get_running_loop()
    limits = wire.Limits(max_frame_bytes=max_frame_bytes)
    try:
        async with connect(
            url,
            compression=None,
            max_size=2 * max_frame_bytes,
            proxy=None,
            open_timeout=ANSWER_TIMEOUT_S,
            ping_interval=None,
        ) as ws:

            async def ask(frame: bytes):
                await ws.send(frame)
                return wire.decode(await asyncio.wait_for(ws.recv(decode=False), ANSWER_TIMEOUT_S), limits)  # binary

            sent = loop.time()
            request = req.open_request()  # with the recorded drafting ms per round (protocol 6)
            if device_ms is not None:  # a fixed drafting time: the same with and without the SLM pass
                request = replace(request, draft_ms_floor=float(device_ms), draft_ms_tree=float(device_ms))
            opened = await ask(wire.encode(request))
            if isinstance(opened, ErrorReply):
                stats.errors[opened.code] += 1
                if opened.code in CAPACITY_CODES:
                    await asyncio.sleep(REFUSED_BACKOFF_S)
                return
            if not isinstance(opened, Opened):
                stats.errors["unexpected_message"] += 1
                return
            stats.opens_ms.append(1000.0 * (loop.time() - sent))
            limits = wire.Limits.from_opened(opened, max_frame_bytes)
            cloud_mtp = not PLACES[req.draft_place].device_rows  # the root alone; the server drafts the chain
            if cloud_mtp:  # root-only trees; the verifier's own chain makes its replies 1 + K rows
                limits = replace(limits, tree_rows=None)
            root, produced, prompt_len = req.prompt[-1], 0, len(req.prompt)
            text: list[int] = []
            seq, allowance = 0, opened.tree_rows
            while True:
                found = tree_at(req, text, seq)
                if found is None:
                    if all(r.committed for r in req.rounds) and len(text) < sum(len(r.committed) for r in req.rounds):
                        stats.requests_off_trace += 1  # the served text left the recording's: trees would not fit
                    stats.requests_truncated += 1
                    break
                rt, tree_tokens, tree_parents, tree_scores = found
                tree_tokens, tree_parents, tree_scores = trim_to_allowance(
                    tree_tokens, tree_parents, tree_scores, allowance
                )
                no_slm = len(tree_tokens) <= chain_rows and rt.head_ms > 0 and not cloud_mtp
                wait = (rt.head_ms if no_slm else rt.device_ms) if device_ms is None else device_ms
                wait /= 1000.0
                if loop.time() + wait >= deadline:
                    break
                slept = loop.time()
                await asyncio.sleep(wait)
                stats.device_waits_ms.append((1000.0 * wait, 1000.0 * (loop.time() - slept)))
                tokens = patch_root(tree_tokens, root)
                try:
                    frame = wire.encode(DraftTree(seq, tokens, tree_parents, tree_scores))
                except wire.WireError as e:  # a tree the wire itself refuses: the trace is bad, not the server
                    stats.errors[f"bad_trace:{e.code}"] += 1
                    break
                sent = loop.time()
                reply = await ask(frame)
                done = loop.time()
                if isinstance(reply, ErrorReply):
                    stats.errors[reply.code] += 1
                    break
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
                    break
                root = new[-1]
                seq += 1
                allowance = reply.allowance or opened.tree_rows
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


# ---- the server ----------------------------------------------------------------------------------------------


def run_summary_lines(mode: str, sessions: int, row: dict, load: tuple) -> str:
    """The two indented lines printed after each run (each under 80 columns for up to 4-digit counts): throughput,
    latency and errors; then the ramp, the client's own CPU (% of a core), the device waits between rounds as
    asked/slept in ms (slept > asked: the client was starved) and the machine's load average before -> after."""
    lat = row["latency_ms"]
    wait = row["device_wait_ms"] or {"asked": math.nan, "slept": math.nan}
    return (
        f"  {mode} {sessions} sessions: {row['tok_per_s']:.1f} tok/s, p50 {lat['p50']:.0f} ms, p90 "
        f"{lat['p90']:.0f} ms, {row['errors_total']} errors\n"
        f"    ramp {row['ramp_s'] or 0:.1f} s ({row['devices_served']}/{sessions} served), client CPU "
        f"{row['client_cpu_pct'] or 0:.0f}%, waits {wait['asked']:.0f}/{wait['slept']:.0f} ms, "
        f"load {load[0]:.1f}->{load[3]:.1f}"
    )


def server_batching_support() -> bool:
    """Whether this hycoc's ``verify-server`` has the options of every `MODE_ARGS` mode (``--batching``,
    ``--tree-budget``): its ``--help`` names them."""
    out = subprocess.run(
        [sys.executable, "-m", "hycoc.cli", "verify-server", "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        timeout=120,
    )
    return all(arg in out.stdout for args in MODE_ARGS.values() for arg in args if arg.startswith("--"))


#: `hycoc verify-server` arguments of each load-test mode (`hycoc.serving_limits.SERVER_MODES`, the one list).
MODE_ARGS = {mode: list(args) for mode, args in SERVER_MODES.items()}


class ServerProcess(VerifierProcess):
    """``hycoc verify-server RECIPE --host 127.0.0.1 --port 0 [--batching MODE] [--keep-set F]`` in a child
    process (`hycoc.bench.verifier_process.VerifierProcess`), ready once it printed its URL and ``GET /healthz``
    answered status ok. ``url``: ``ws://HOST:PORT``; ``health``: that /healthz document.

    batching: a `MODE_ARGS` mode, passed as its arguments when not None (the caller checks
    `server_batching_support`). Raises
    LoadTestError with the server's stderr when it exits or is not healthy within ``timeout_s``."""

    def __init__(
        self, recipe_path: Path, *, batching: str | None = None, keep_set: Path | None = None, timeout_s: float = 300.0
    ):
        super().__init__(
            recipe_path,
            keep_set,
            timeout_s,
            extra_args=MODE_ARGS[batching] if batching is not None else [],
            error=LoadTestError,
        )
        self.health: dict = {}
        while True:
            try:
                self.health = healthz(self.url)
                if self.health.get("status") == "ok":
                    break
            except OSError:
                pass
            if time.monotonic() > self.deadline or self.proc.poll() is not None:
                self.stop()
                raise LoadTestError(f"the verifier at {self.url} did not answer /healthz: {self.stderr_tail()}")
            time.sleep(0.2)


def server_mode(health: dict) -> str:
    """The load-test mode a server reports in /healthz (``"batching": {"mode": ..., "tree_budget": ...,
    "allowance": ...}``): "allowance" for a batched server with the allowance auto, "budgeted" for one with
    tree_budget auto, else its mode; "serial" for a server without that field (servers before cross-session
    batching verified one session per forward)."""
    batching = health.get("batching")
    if not isinstance(batching, dict):
        return "serial"
    mode = str(batching.get("mode", "serial"))
    if mode == "batched" and batching.get("allowance") == "auto":
        return "allowance"
    return "budgeted" if mode == "batched" and batching.get("tree_budget") == "auto" else mode


def _http(url: str) -> str:
    return "http" + url.removeprefix("ws")


def healthz(url: str, timeout_s: float = 5.0) -> dict:
    """The server's ``GET /healthz`` JSON (url: ``ws://HOST:PORT``). Raises OSError when it does not answer."""
    with urllib.request.urlopen(_http(url) + "/healthz", timeout=timeout_s) as r:
        return json.loads(r.read().decode("utf-8"))


def check_server(url: str, timeout_s: float = 5.0) -> dict:
    """`healthz` of a running server given as ``--server``, or LoadTestError naming the URL and the fix when
    nothing answers (checked before anything is recorded or replayed)."""
    try:
        return healthz(url, timeout_s)
    except (OSError, ValueError) as e:
        raise LoadTestError(
            f"--server {url}: no hycoc verify-server answered {_http(url)}/healthz ({e}): start one "
            "(hycoc verify-server RECIPE) or leave --server out to start one per mode"
        ) from None


def scrape_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The unlabelled samples of the server's ``GET /metrics`` (Prometheus text format 0.0.4): name -> value, e.g.
    ``hycoc_rounds_total``, ``hycoc_batch_rows_sum``, ``hycoc_batch_rows_count``. Labelled samples
    (``name{...}``) are left out. Returns {} when the server does not answer."""
    try:
        with urllib.request.urlopen(_http(url) + "/metrics", timeout=timeout_s) as r:
            text = r.read().decode("utf-8")
    except OSError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: name -> float (NaN for ``NaN``). Comments, blank lines
    and labelled samples are skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) >= 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return out


# ---- the whole load test --------------------------------------------------------------------------------------


def split_mode(entry: str | None) -> tuple[str | None, str | None]:
    """A ``--batching`` entry as (mode, config): "batched" -> ("batched", None) (its devices replay every
    ``--configs`` configuration); "batched:cloud-mtp" -> ("batched", "cloud-mtp") (a server of that mode whose
    devices replay that configuration alone: a baseline beside the others in one run). None -> (None, None)."""
    if entry is None:
        return None, None
    mode, _, config = entry.partition(":")
    return mode, (config or None)


def devices_for(trace, configs: list[str], sessions: int) -> list[list[RequestTrace]]:
    """The recorded requests of each of ``sessions`` devices: device i replays config configs[i % len(configs)]
    (mixed configs share the server, as phones would). Raises TraceError for a config the trace lacks."""
    by_config = {c: trace.for_config(c) for c in configs}
    return [by_config[configs[i % len(configs)]] for i in range(sessions)]


def run_loadtest(
    trace,
    configs: list[str],
    sessions: list[int],
    duration_s: float,
    modes: list[str] | None,
    out: Path,
    *,
    recipe_path: Path | None = None,
    keep_set: Path | None = None,
    server_url: str | None = None,
    rate: float | None = None,
    device_ms: float | None = None,
    cost_model=None,
    console=None,
    meta: dict | None = None,
    warmup_s: float = 2.0,
    probe: Callable[[], float] | None = None,
) -> dict:
    """Every (batching mode, sessions) run, then the report: the table, ``OUT/results.json`` and
    ``OUT/latency_vs_sessions.png`` (`hycoc.bench.loadtest.report`). Returns the results document.

    Without ``server_url`` each mode gets its own `ServerProcess` of ``recipe_path``, started with ``--batching
    MODE`` when that server has the option, all of them up for the whole test, and for each session count the modes
    run one after the other (on a shared machine the modes compared then see the same load); with it, the one
    server there is used. Either way the mode a row is
    labelled with is the one the server reports in /healthz (`server_mode`), and a server that reports another
    mode than asked is an error (modes None with ``server_url``: whatever it reports). Each server first serves
    one device for ``warmup_s`` seconds, not measured. probe: called twice right before and twice right after every
    run (with no run going); its four values go in the row as ``speed_probe_ms`` (e.g. a
    `hycoc.bench.capacity.speed_probe.SpeedProbe`'s ``measure``: the machine's speed on either side of the run). Raises
    LoadTestError (server, mode), TraceError (config)."""
    from hycoc import progress
    from hycoc.bench.loadtest.report import (
        GPU_FLAT_ROWS,
        budget_projection,
        gpu_row_cost,
        project,
        render_budget_projection,
        render_table,
        results_document,
        summarize_run,
        write_plot,
        write_results,
    )

    if console is None:
        from hycoc.bench.paper.runner import make_console

        console = make_console()
    if server_url is not None and modes is not None and len(modes) != 1:
        raise LoadTestError(
            f"--batching {','.join(modes)} with --server: a running server has one mode; give that "
            "one, or leave --server out so each mode gets its own server"
        )
    if server_url is None and not modes:
        modes = ["serial"]
    pass_flag = server_url is None and server_batching_support()
    rows, servers, procs, urls, windows = [], {}, [], {}, []
    chain_rows: dict[str, int] = {}  # K + 1 per mode's server (/healthz chain_length; 0 for an older server)
    replays: dict[str, list[str]] = {}  # what each mode's devices replay: ``configs``, or a MODE:CONFIG entry's own
    try:
        for entry in modes if modes else [None]:  # every server up first: the runs then alternate between them
            asked, own = split_mode(entry)
            if server_url is None:
                console.print(
                    f"loadtest: starting hycoc verify-server {recipe_path}"
                    + (
                        f" {' '.join(MODE_ARGS[asked])}"
                        if pass_flag and asked
                        else ""
                        if pass_flag
                        else " (this verify-server has no --batching)"
                    )
                )
                if recipe_path is None:
                    raise LoadTestError("without --server the load test starts hycoc verify-server: give its recipe")
                procs.append(ServerProcess(recipe_path, batching=asked if pass_flag else None, keep_set=keep_set))
                url, health = procs[-1].url, procs[-1].health
            else:
                url = server_url
                health = check_server(url)
            mode = server_mode(health)
            if asked is not None and mode != asked:
                raise LoadTestError(
                    f"asked for batching {asked!r}, but the verify-server reports {mode!r} in "
                    "/healthz"
                    + ("" if pass_flag or server_url else " and has no --batching option to change it")
                    + f"; use --batching {mode}"
                )
            mode = mode if own is None else f"{mode}:{own}"
            servers[mode] = health.get("batching") or {"mode": "serial", "note": "no batching field in /healthz"}
            urls[mode] = url
            chain_rows[mode] = int(health.get("chain_length", -1)) + 1
            replays[mode] = list(configs) if own is None else [own]
            if warmup_s > 0:
                run_sessions(
                    url,
                    devices_for(trace, replays[mode], 1),
                    trace.stop_ids,
                    warmup_s,
                    device_ms=device_ms,
                    chain_rows=chain_rows[mode],
                )
        # Per session count every mode in turn, so on a shared machine the modes compared see the same load.
        for n in sessions:
            for mode, url in urls.items():
                speed = [probe(), probe()] if probe is not None else None
                before, load, started = scrape_metrics(url), os.getloadavg(), time.time()
                with progress.step(f"{mode}: {n} sessions", total=int(math.ceil(duration_s)), unit="s") as s:

                    def tick(st: RunStats) -> None:
                        s.advance(note=f"{len(st.rounds):,} rounds, {sum(st.errors.values())} errors")

                    stats = run_sessions(
                        url,
                        devices_for(trace, replays[mode], n),
                        trace.stop_ids,
                        duration_s,
                        rate=rate,
                        device_ms=device_ms,
                        tick=tick,
                        chain_rows=chain_rows[mode],
                    )
                    # the end line: every second done, the run's final counts (the last tick's are a second old)
                    s.advance(
                        max(0, int(math.ceil(duration_s)) - s.done),
                        note=f"{len(stats.rounds):,} rounds, {sum(stats.errors.values())} errors",
                    )
                after = scrape_metrics(url)
                loads = tuple(round(x, 2) for x in load + os.getloadavg())
                windows.append({"mode": mode, "sessions": n, "epoch_s": [started, time.time()]})
                row = summarize_run(mode, n, duration_s, stats, before, after, loads)
                if speed is not None and probe is not None:  # speed: measured by probe
                    row["speed_probe_ms"] = [*speed, probe(), probe()]
                row["projection"] = project(row, cost_model)
                rows.append(row)
                console.print(run_summary_lines(mode, n, row, loads), soft_wrap=True)
    finally:
        for proc in procs:
            proc.stop()
    order = list(urls)
    rows.sort(key=lambda r: (order.index(r["mode"]), r["sessions"]))
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        meta or {},
        configs=list(configs),
        sessions=list(sessions),
        duration_s=duration_s,
        servers=servers,
        rate=rate,
        device_ms=device_ms,
        server=server_url or "own verify-server process per mode",
        run_windows=windows,
        machine=f"{os.cpu_count()} CPUs",
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        projection="labelled projection, not a measurement: see hycoc/bench/loadtest/report.py",
    )
    projection = None
    trees = [
        (rt.score_array(), np.asarray(rt.tokens), np.asarray(rt.parents))
        for r in trace.requests
        if r.config in configs
        for rt in r.rounds
        if rt.scores is not None and len(rt.tokens) > 1
    ]
    if trees and any(m in SCORED_MODES for m in urls):
        first = next(iter(servers.values()))
        tree_rows = max(len(t) for _, t, _ in trees)
        projection = budget_projection(
            trees,
            sorted(set(PROJECTION_SESSIONS) | set(sessions)),
            gpu_row_cost(),
            tree_rows=tree_rows,
            max_batch_rows=int(first.get("max_batch_rows", 16 * tree_rows)),
        )
        meta["budget_projection"] = projection
    doc = results_document(rows, meta)
    results = write_results(out / "results.json", doc)
    plot = write_plot(rows, out / "latency_vs_sessions.png")
    render_table(
        rows,
        console,
        title=f"hycoc loadtest: {', '.join(configs)}, {duration_s:g} s per run"
        + (f", {rate:g} arrivals/s" if rate else ""),
    )
    if projection:
        render_budget_projection(
            projection,
            console,
            title="budgeted rows on an assumed GPU (a projection from the recorded trees' scores, not a measurement)",
        )
        console.print(
            f"the budget's rule on a forward that costs the same up to {GPU_FLAT_ROWS} rows (H200 bf16 "
            "ridge point): rows kept per forward, expected committed tokens (sessions + sum of exp(s) "
            "over kept rows) and expected tokens per forward-ms against every row verified."
        )
    basis = next((r["projection"]["basis"] for r in rows if r.get("projection")), None)
    console.print(
        "ramp: seconds until every device had its first round answered (connects, OPENs and prefills "
        "queue up at the start); tok/s: tokens committed by rounds answered after the ramp / that window; "
        "verifier ms/tok: the server's worker ms in rounds per committed token (/metrics; prefill "
        "excluded); p50/p90/p99: round latency send -> reply on the client, after the ramp; rows/fwd: the "
        "server's hycoc_batch_rows histogram (n/a: the server has none)."
    )
    if basis:
        console.print(
            f"proj. (a projection, not a measurement): trees verified per forward and the verifier work "
            f"per token it saves against one tree per forward, {basis}."
        )
    console.print(f"wrote {results}, {plot}")
    return doc


__all__ = [
    "ANSWER_TIMEOUT_S",
    "CAPACITY_CODES",
    "MODE_ARGS",
    "split_mode",
    "LoadTestError",
    "run_summary_lines",
    "REFUSED_BACKOFF_S",
    "RoundSample",
    "RunStats",
    "ServerProcess",
    "arrival_delays",
    "committed_tokens",
    "devices_for",
    "healthz",
    "parse_metrics",
    "replay_request",
    "run_loadtest",
    "run_sessions",
    "scrape_metrics",
    "server_mode",
    "server_batching_support",
]
