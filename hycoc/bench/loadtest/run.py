"""`hycoc loadtest`: many simulated devices against one verifier, and what the verifier delivers (docs/serving.md
"Load test: `hycoc loadtest`"). `run_loadtest` runs every (batching mode, sessions) cell and reports them.

The job in three parts: the simulated devices (`hycoc.bench.loadtest.device`: each replays recorded rounds
(`hycoc.bench.loadtest.trace`) over the wire protocol, all of them asyncio tasks of ONE process, `run_sessions`;
what the client records per round, `RoundSample`, and the error codes it counts, `RunStats.errors`, are described
there); the servers (`hycoc.bench.loadtest.server`: ``hycoc verify-server`` in its own process per mode,
`ServerProcess`, its /healthz and /metrics); and here the run of every cell and its report
(`hycoc.bench.loadtest.report`: the table, results.json, the plot).

Timing of a run: all devices start at once, or with ``rate`` their arrivals form a Poisson process of ``rate``
devices per second (seeded, `arrival_delays`); no round starts after ``duration_s``; a round in flight then
completes but only rounds answered within the window count, and the measured window starts once every device
has had its first round answered (the ramp: connects, OPENs and prefills queue up at the start;
`hycoc.bench.loadtest.report.summarize_run`).

The names of the device and server modules that other code uses are importable from here too (``__all__``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from hycoc.bench.loadtest.device import (
    ANSWER_TIMEOUT_S,
    CAPACITY_CODES,
    REFUSED_BACKOFF_S,
    RoundSample,
    RunStats,
    arrival_delays,
    committed_tokens,
    replay_request,
    run_sessions,
)
from hycoc.bench.loadtest.plan import LoadTestRun
from hycoc.bench.loadtest.server import (
    MODE_ARGS,
    LoadTestError,
    ServerProcess,
    check_server,
    healthz,
    parse_metrics,
    scrape_metrics,
    server_batching_support,
    server_mode,
)
from hycoc.bench.loadtest.trace import RequestTrace
from hycoc.serving_limits import SCORED_MODES

#: Session counts of the budget's GPU projection (whatever the run's): around 206 / 33 = 6 trees trimming starts.
PROJECTION_SESSIONS = (1, 2, 4, 6, 7, 8, 16, 32, 64)


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


class _LoadTest:
    """One `run_loadtest` call: its settings, its servers (one per --batching entry, by the mode label its rows get:
    the url, what its /healthz says of its batching, K + 1 and the configurations its devices replay) and the rows
    measured so far."""

    def __init__(self, trace, run: LoadTestRun, *, cost_model, console, probe):
        self.trace, self.configs, self.server_url = trace, run.configs, run.server
        self.rate, self.device_ms, self.cost_model, self.console = run.rate, run.device_ms, cost_model, console
        self.warmup_s, self.probe = run.warmup_s, probe
        self.pass_flag = run.server is None and server_batching_support()
        self.rows: list[dict] = []
        self.windows: list[dict] = []
        self.procs: list[ServerProcess] = []
        self.servers: dict[str, dict] = {}
        self.urls: dict[str, str] = {}
        self.chain_rows: dict[str, int] = {}  # K + 1 per mode's server (/healthz chain_length; 0 for an older server)
        self.replays: dict[str, list[str]] = {}  # what each mode's devices replay: ``configs``, or a MODE:CONFIG's own

    def start(self, entry: str | None, recipe_path: Path | None, keep_set: Path | None) -> None:
        """The server of one --batching entry (`split_mode`): its own `ServerProcess`, or the running one at
        ``server_url``; checks the mode it reports, then serves one device for ``warmup_s`` s, not measured."""
        asked, own = split_mode(entry)
        pass_flag, server_url = self.pass_flag, self.server_url
        if server_url is None:
            if recipe_path is None:
                raise LoadTestError("without --server the load test starts hycoc verify-server: give its recipe")
            self.console.print(
                f"loadtest: starting hycoc verify-server {recipe_path}"
                + (
                    f" {' '.join(MODE_ARGS[asked])}"
                    if pass_flag and asked
                    else ""
                    if pass_flag
                    else " (this verify-server has no --batching)"
                )
            )
            self.procs.append(ServerProcess(recipe_path, batching=asked if pass_flag else None, keep_set=keep_set))
            url, health = self.procs[-1].url, self.procs[-1].health
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
        self.servers[mode] = health.get("batching") or {"mode": "serial", "note": "no batching field in /healthz"}
        self.urls[mode] = url
        self.chain_rows[mode] = int(health.get("chain_length", -1)) + 1
        self.replays[mode] = list(self.configs) if own is None else [own]
        if self.warmup_s > 0:
            run_sessions(
                url,
                devices_for(self.trace, self.replays[mode], 1),
                self.trace.stop_ids,
                self.warmup_s,
                device_ms=self.device_ms,
                chain_rows=self.chain_rows[mode],
            )

    def measure(self, mode: str, n: int, duration_s: float) -> None:
        """One run: ``n`` devices against ``mode``'s server for ``duration_s`` s, its row (`summarize_run`, the
        projection, the speed probes) added and its summary lines printed."""
        from hycoc import progress
        from hycoc.bench.loadtest.report import project, summarize_run

        url, probe = self.urls[mode], self.probe
        speed = [probe(), probe()] if probe is not None else None
        before, load, started = scrape_metrics(url), os.getloadavg(), time.time()
        with progress.step(f"{mode}: {n} sessions", total=int(math.ceil(duration_s)), unit="s") as s:

            def tick(st: RunStats) -> None:
                s.advance(note=f"{len(st.rounds):,} rounds, {sum(st.errors.values())} errors")

            stats = run_sessions(
                url,
                devices_for(self.trace, self.replays[mode], n),
                self.trace.stop_ids,
                duration_s,
                rate=self.rate,
                device_ms=self.device_ms,
                tick=tick,
                chain_rows=self.chain_rows[mode],
            )
            # the end line: every second done, the run's final counts (the last tick's are a second old)
            s.advance(
                max(0, int(math.ceil(duration_s)) - s.done),
                note=f"{len(stats.rounds):,} rounds, {sum(stats.errors.values())} errors",
            )
        after = scrape_metrics(url)
        loads = tuple(round(x, 2) for x in load + os.getloadavg())
        self.windows.append({"mode": mode, "sessions": n, "epoch_s": [started, time.time()]})
        row = summarize_run(mode, n, duration_s, stats, before, after, loads)
        if speed is not None and probe is not None:
            row["speed_probe_ms"] = [*speed, probe(), probe()]
        row["projection"] = project(row, self.cost_model)
        self.rows.append(row)
        self.console.print(run_summary_lines(mode, n, row, loads), soft_wrap=True)

    def stop(self) -> None:
        for proc in self.procs:
            proc.stop()

    def budget_projection(self, sessions: list[int]) -> list[dict] | None:
        """The budget's GPU projection over the recorded trees with scores (`budget_projection`), when a mode
        run chooses rows by score; else None."""
        from hycoc.bench.loadtest.report import budget_projection, gpu_row_cost

        trees = [
            (rt.score_array(), np.asarray(rt.tokens), np.asarray(rt.parents))
            for r in self.trace.requests
            if r.config in self.configs
            for rt in r.rounds
            if rt.scores is not None and len(rt.tokens) > 1
        ]
        if not (trees and any(m in SCORED_MODES for m in self.urls)):
            return None
        first = next(iter(self.servers.values()))
        tree_rows = max(len(t) for _, t, _ in trees)
        return budget_projection(
            trees,
            sorted(set(PROJECTION_SESSIONS) | set(sessions)),
            gpu_row_cost(),
            tree_rows=tree_rows,
            max_batch_rows=int(first.get("max_batch_rows", 16 * tree_rows)),
        )


def _print_report(rows: list[dict], projection, title: str, console) -> None:
    """The table of every run, the budget's projection when there is one, and what the columns mean."""
    from hycoc.bench.loadtest.report import GPU_FLAT_ROWS, render_budget_projection, render_table

    render_table(rows, console, title=title)
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


def run_loadtest(
    trace,
    run: LoadTestRun,
    *,
    recipe_path: Path | None = None,
    keep_set: Path | None = None,
    cost_model=None,
    console=None,
    meta: dict | None = None,
    probe: Callable[[], float] | None = None,
) -> dict:
    """Every (batching mode, sessions) run of ``run`` (`hycoc.bench.loadtest.plan.LoadTestRun`), then the report: the
    table, ``OUT/results.json`` and ``OUT/latency_vs_sessions.png`` (`hycoc.bench.loadtest.report`). Returns the
    results document.

    Without ``run.server`` each mode gets its own `ServerProcess` of ``recipe_path``, started with ``--batching
    MODE`` when that server has the option, all of them up for the whole test, and for each session count the modes
    run one after the other (on a shared machine the modes compared then see the same load); with it, the one
    server there is used. Either way the mode a row is
    labelled with is the one the server reports in /healthz (`server_mode`), and a server that reports another
    mode than asked is an error (modes None with ``run.server``: whatever it reports). Each server first serves
    one device for ``warmup_s`` seconds, not measured. probe: called twice right before and twice right after every
    run (with no run going); its four values go in the row as ``speed_probe_ms`` (e.g. a
    `hycoc.bench.capacity.speed_probe.SpeedProbe`'s ``measure``: the machine's speed on either side of the run). Raises
    LoadTestError (server, mode), TraceError (config)."""
    from hycoc.bench.loadtest.report import results_document, write_plot, write_results

    if console is None:
        from hycoc.bench.paper.runner import make_console

        console = make_console()
    configs, sessions, modes, duration_s, out = run.configs, run.sessions, run.modes, run.duration_s, run.out
    server_url, rate, device_ms = run.server, run.rate, run.device_ms
    if server_url is not None and modes is not None and len(modes) != 1:
        raise LoadTestError(
            f"--batching {','.join(modes)} with --server: a running server has one mode; give that "
            "one, or leave --server out so each mode gets its own server"
        )
    if server_url is None and not modes:
        modes = ["serial"]
    test = _LoadTest(trace, run, cost_model=cost_model, console=console, probe=probe)
    try:
        for entry in modes if modes else [None]:  # every server up first: the runs then alternate between them
            test.start(entry, recipe_path, keep_set)
        # Per session count every mode in turn, so on a shared machine the modes compared see the same load.
        for n in sessions:
            for mode in test.urls:
                test.measure(mode, n, duration_s)
    finally:
        test.stop()
    order = list(test.urls)
    rows = sorted(test.rows, key=lambda r: (order.index(r["mode"]), r["sessions"]))
    out.mkdir(parents=True, exist_ok=True)
    meta = dict(
        meta or {},
        configs=list(configs),
        sessions=list(sessions),
        duration_s=duration_s,
        servers=test.servers,
        rate=rate,
        device_ms=device_ms,
        server=server_url or "own verify-server process per mode",
        run_windows=test.windows,
        machine=f"{os.cpu_count()} CPUs",
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        projection="labelled projection, not a measurement: see hycoc/bench/loadtest/report.py",
    )
    projection = test.budget_projection(sessions)
    if projection is not None:
        meta["budget_projection"] = projection
    doc = results_document(rows, meta)
    results = write_results(out / "results.json", doc)
    plot = write_plot(rows, out / "latency_vs_sessions.png")
    title = f"hycoc loadtest: {', '.join(configs)}, {duration_s:g} s per run" + (
        f", {rate:g} arrivals/s" if rate else ""
    )
    _print_report(rows, projection, title, console)
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
    "check_server",
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
