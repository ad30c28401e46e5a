"""`hycoc capacity`'s runs (docs/capacity.md): sweeps of the simulator (`hycoc.bench.capacity.simulation`) over batching
modes and device counts, the largest device count that meets a p90 target, the check against measured `hycoc loadtest`
runs (`validate`), and the real-shape projection (`projection`).

The target's latency: the verifier's round latency, p90 over the run's answered rounds -- a round's arrival at
the verifier to its reply leaving it (queue, batch wait, the step), the part a verifier deployment controls. The
phone's drafting and the link's RTT are outside it (over LTE the RTT alone is 58 ms); they set how often each
device sends a round, so they move how many devices meet the target.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from hycoc.bench.capacity.requests import CapacityError, FrameBytes, Workload, trace_workload
from hycoc.bench.capacity.sched_sampler import (
    SchedSampler,  # re-exported: the check's reading of the machine's scheduler
)
from hycoc.bench.capacity.simulation import SimConfig, cpu_slowdown, simulate, summarize
from hycoc.serving_limits import DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_WAIT_MS
from hycoc.table5 import WITH_VERIFIER, configuration
from hycoc.verifier.draft_place import PLACES, DraftPlace

#: Table 5's configurations that have a verifier (slm-alone has none).
CONFIGS = WITH_VERIFIER  # every Table 5 configuration with a verifier, in Table 5 order (hycoc.table5)
#: The projection's configurations (issue: hyco, hyco-exact, specedge against cloud-mtp).
PROJECTION_CONFIGS = ("hyco", "hyco-exact", "specedge", "cloud-mtp")
#: Paper Table 2 (SB-480) MAT per configuration: the projection's acceptance (assumed for Gemma 4 on this tool).
PAPER_MAT = {
    "cloud-mtp": 3.05,
    "specedge": 3.53,
    "specedge-eps": 4.13,
    "hyco": 4.71,
    "hyco-2p": 5.27,
    "hyco-exact": 3.84,
    "server-head": 3.79,
}
#: The device anchors (`hycoc.device_time` PAPER_ANCHORS / CHECK_ANCHORS names) giving each configuration's
#: drafting ms per round (paper App. G ms per token x Table 2 MAT); cloud-mtp drafts nothing on the phone.
DEVICE_ANCHOR = {
    "hyco": "HyCo draft per round",
    "specedge": "SpecEdge-style per round",
    "hyco-exact": "HyCo exact per round",
    "hyco-2p": "HyCo-2P per round",
    "server-head": "server head per round",
}
#: Gemma 4 frames (docs/serving.md's table): a 33-row ROUND with scores 287 B; a REPLY's hand-off 44 + 5,632 B
#: per round + 6,144 B per committed position, 4 B per row of samples; cloud-mtp and server-head carry no hand-off.
GEMMA4_FRAMES = FrameBytes(
    up_fixed=287 - 8 * 33,
    up_per_row=8,
    down_fixed=16 + 30 + 44 + 5632,
    down_per_row=4,
    down_per_token=6144,
    open_fixed=64,
    open_down=6_297_313,
)
SERVER_DRAFT_FRAMES = FrameBytes(
    up_fixed=31, up_per_row=8, down_fixed=46, down_per_row=4, down_per_token=0, open_fixed=64, open_down=64
)


def place_of(config: str) -> DraftPlace:
    """The `DraftPlace` of Table 5's ``config`` (`hycoc.table5.configuration`: ValueError for an unknown name);
    CapacityError for one without a verifier (slm-alone), which sends no rounds."""
    name = configuration(config).draft_place
    if name is None:
        raise CapacityError(f"{config} has no verifier: it sends no rounds to simulate")
    return PLACES[name]


def device_ms_of(config: str) -> float:
    """Phone drafting ms per round of ``config`` at Gemma 4's shapes: the `hycoc.device_time` anchor (the paper's
    App. G figure that the device-time estimate is fitted to or checked against); 0 for cloud-mtp."""
    from hycoc.device_time import CHECK_ANCHORS, PAPER_ANCHORS

    if not place_of(config).device_rows:  # the root alone: the phone drafts nothing
        return 0.0
    if config == "specedge-eps":
        config = "specedge"
    name = DEVICE_ANCHOR[config]
    return next(a.ms for a in PAPER_ANCHORS + CHECK_ANCHORS if a.name.startswith(name))


def run_point(workload: Workload, cfg: SimConfig, cost) -> dict:
    """One simulated run summarized (`hycoc.bench.capacity.simulation.summarize`)."""
    return summarize(cfg.mode, cfg, simulate(workload, cfg, cost))


def search_devices(
    make_workload: Callable[[int], Workload],
    cfg: SimConfig,
    cost,
    target_ms: float,
    *,
    max_devices: int = 4096,
    label: str = "",
) -> tuple[int, dict, list[dict]]:
    """The largest device count whose verifier p90 (``server_p90_ms``) is <= ``target_ms``: doubling from 1, then
    bisection (p90 grows with devices in a closed loop). make_workload(n): the workload of n devices. Returns
    (devices, that run's row, every run tried). Raises CapacityError (one line: the target and the fix) when one
    device already misses it."""
    tried: dict[int, dict] = {}

    def p90(n: int) -> float:
        if n not in tried:
            tried[n] = run_point(make_workload(n), replace(cfg, devices=n), cost)
        v = tried[n]["server_p90_ms"]
        return math.inf if v is None or not math.isfinite(v) else v

    if p90(1) > target_ms:
        raise CapacityError(
            f"--p90-ms {target_ms:g}: {label} misses it with one device (verifier p90 "
            f"{p90(1):.1f} ms); raise --p90-ms above that or give a faster cost model"
        )
    lo, hi = 1, 2
    while hi <= max_devices and p90(hi) <= target_ms:
        lo, hi = hi, hi * 2
    if hi > max_devices:
        return lo, tried[lo], [tried[k] for k in sorted(tried)]
    while hi - lo > max(1, lo // 32):
        mid = (lo + hi) // 2
        if p90(mid) <= target_ms:
            lo = mid
        else:
            hi = mid
    return lo, tried[lo], [tried[k] for k in sorted(tried)]


# ---- validation against measured load tests ----------------------------------------------------------------------


#: The share of the server event loop's measured work per round that holds the process's GIL, so that the worker
#: thread's step waits for it when they overlap (`hycoc.bench.capacity.simulation.SimConfig.gil_share`). ASSUMED: all of
#: it (the loop's frame decode, checks and hand-off are Python; its socket calls, which release the lock, are a small
#: part of its CPU on loopback). Only where the host work was measured (the toy's profile), else 0.
LOOP_GIL_SHARE = 1.0


def host_terms(cost, contention: dict | None = None, slowdown: float = 1.0) -> dict:
    """The `SimConfig` fields of the per-round host work outside the step (`hycoc.bench.capacity.host`), from
    ``cost.overhead()`` (the profile's measurement): ``loop_ms`` (the server's event loop, serialised) and
    ``client_ms`` (in parallel), ``wake_ms``, and ``gil_share`` (`LOOP_GIL_SHARE` where the host work was
    measured, else 0).

    Without ``contention`` the parallel part is the profile's client CPU plus its ``wire_ms`` (the wall time of
    the stubbed round trip beyond both processes' CPU: socket and wake-ups at the profile's load), the CPU parts
    x ``slowdown`` (a machine-load stretch given without a measured run). With a run's
    ``contention`` (`SchedSampler.contention`) the wake-ups are that run's instead: two of the server's event loop
    per round (the frame in; the worker's result back through ``call_soon_threadsafe``) and one of the client's
    (the reply) inside the round latency, one of the client's (after the drafting sleep) outside it (``wake_ms``);
    the worker thread's own waits are in the step's stretch. The CPU parts are then the profile's, unstretched: a
    thread's waits for a CPU are its wake-ups' delays, already counted."""
    h = cost.overhead()
    gil = LOOP_GIL_SHARE if h.loop_ms > 0 else 0.0
    if not contention:
        return {
            "loop_ms": h.loop_ms * slowdown,
            "client_ms": h.client_ms * slowdown + h.wire_ms,
            "wake_ms": 0.0,
            "gil_share": gil,
        }
    server_wake, client_wake = contention["server_wake_ms"], contention["client_wake_ms"]
    return {  # the loop's and client's waits are their wake-ups, counted here: their CPU is not stretched again
        "loop_ms": h.loop_ms,
        "client_ms": h.client_ms + 2 * server_wake + client_wake,
        "wake_ms": client_wake,
        "gil_share": gil,
    }


def predicted_for(
    measured: dict,
    workload: Workload,
    cost,
    meta: dict,
    *,
    client_ms: float = 0.0,
    cores: int | None = None,
    contention: dict | None = None,
    replicas: int = 1,
    cpu_scale: float = 1.0,
) -> dict:
    """The simulator's row for one measured load-test row (`hycoc.bench.loadtest.report.summarize_run`'s): same mode,
    sessions and duration; the server's own batching settings and (budgeted) row-cost line from its /healthz
    (``meta["servers"][mode]``); the CPU stretched by the run's load (`cpu_slowdown` of the mean of its load
    averages before and after); with ``contention`` (`SchedSampler.contention` of the run's window) the
    server's measured slowdown instead; the per-round host work outside the step from the cost's profile, with
    that run's wake-ups (`host_terms`). client_ms: more parallel ms per round (none by default). cpu_scale: the
    run's CPU speed against the profile's (`hycoc.bench.capacity.speed_probe`): the steps' CPU ms and the host work's
    CPU parts x it (`SimConfig.cpu_scale`)."""
    mode = measured["mode"]
    server = (meta.get("servers") or {}).get(mode) or {}
    load = measured.get("loadavg") or [0.0] * 6
    load1 = 0.5 * (load[0] + load[3])
    slowdown = cpu_slowdown(load1, cores or os.cpu_count() or 1)
    samples = None
    if contention:
        slowdown = contention["slowdown"]
        samples = tuple((float(a), float(b)) for a, b in contention.get("intervals") or ()) or None
    host = host_terms(cost, contention, slowdown)
    row_cost, free = None, None
    if server.get("row_cost"):
        from hycoc.verifier.row_budget import RowCost

        row_cost = RowCost(tuple((int(r), float(m)) for r, m in server["row_cost"]["points"]), source="server")
        free = int(server.get("free_rows") or 0) or None
    cfg = SimConfig(
        mode=mode,
        devices=int(measured["sessions"]),
        duration_s=float(measured["duration_s"]),
        replicas=replicas,
        max_batch_rows=int(server.get("max_batch_rows", DEFAULT_MAX_BATCH_ROWS)),
        max_batch_wait_ms=float(server.get("max_batch_wait_ms", DEFAULT_MAX_BATCH_WAIT_MS)),
        client_ms=client_ms + host["client_ms"] + (cpu_scale - 1.0) * cost.overhead().client_ms,
        loop_ms=host["loop_ms"] * cpu_scale,
        wake_ms=host["wake_ms"],
        gil_share=host["gil_share"],
        slowdown=slowdown,
        slowdown_samples=samples,
        cpu_scale=cpu_scale,
        row_cost=row_cost,
        free_rows=free,
        chain_length=cost.chain_length,
    )
    row = run_point(workload, cfg, cost)
    row["slowdown"] = cfg.slowdown
    row["cpu_scale"] = cfg.cpu_scale
    row["contention"] = contention
    row["host_terms"] = host
    return row


def within(pred: float | None, meas: float | None, tol: float) -> bool:
    """|pred - meas| <= tol x meas (both finite)."""
    if pred is None or meas is None or not (math.isfinite(pred) and math.isfinite(meas)) or meas <= 0:
        return False
    return bool(abs(pred - meas) <= tol * meas)


def outside_ms(row: dict) -> float | None:
    """A one-session run's mean ms per round outside the verifier: round latency mean - the replies' server_ms
    per round (``reply_ms_per_token`` x MAT): the frames, the event loops, the wake-ups. None for more sessions
    (a batched reply's server_ms is not its own round's) or without rounds."""
    if row.get("sessions") != 1 or not row.get("mat") or row.get("reply_ms_per_token") is None:
        return None
    return row["latency_ms"]["mean"] - row["reply_ms_per_token"] * row["mat"]


def validation_rows(measured_rows: list[dict], predicted_rows: list[dict], tol: float) -> list[dict]:
    """Per cell: mode, sessions, measured and predicted tok/s and p90 (client round latency, ms), their errors
    (predicted / measured - 1), whether both are within ``tol``, and the load averages."""
    out = []
    for m, p in zip(measured_rows, predicted_rows):
        mt, pt = m["tok_per_s"], p["tok_per_s"]
        ml, pl = m["latency_ms"]["p90"], p["latency_ms"]["p90"]
        out.append(
            {
                "mode": m["mode"],
                "sessions": m["sessions"],
                "measured_tok_s": mt,
                "predicted_tok_s": pt,
                "tok_err": pt / mt - 1 if mt else None,
                "measured_p90_ms": ml,
                "predicted_p90_ms": pl,
                "p90_err": pl / ml - 1 if ml else None,
                "ok": within(pt, mt, tol) and within(pl, ml, tol),
                "loadavg": m.get("loadavg"),
                "slowdown": p.get("slowdown"),
                "cpu_scale": p.get("cpu_scale"),  # the run's sampled CPU speed against the profile's (applied)
                "measured_rows_per_forward": m.get("rows_per_forward"),
                "predicted_rows_per_forward": p.get("rows_per_forward"),
                # the busiest server thread's CPU (schedstat) per round the server answered vs the step cost's
                "measured_cpu_ms_per_round": (
                    (p.get("contention") or {}).get("worker_cpu_ms") / m["server_rounds"]
                    if (p.get("contention") or {}).get("worker_cpu_ms") and m.get("server_rounds")
                    else None
                ),
                "predicted_cpu_ms_per_round": p.get("cpu_ms_per_round"),
                # one session: ms per round outside the verifier (latency - the reply's server_ms), the host work
                "measured_outside_ms": outside_ms(m),
                "predicted_outside_ms": outside_ms(p),
            }
        )
    return out


def validation_table(rows: list[dict], tol: float):
    """`hycoc.bench.tables.TextTable` of `validation_rows`."""
    from hycoc.bench.loadtest.report import fmt_num as num
    from hycoc.bench.tables import TextTable

    def pct(x):
        return "n/a" if x is None else f"{100 * x:+.0f}%"

    body = []
    for r in rows:
        load = r["loadavg"] or []
        body.append(
            [
                r["mode"],
                str(r["sessions"]),
                num(r["measured_tok_s"]),
                num(r["predicted_tok_s"]),
                pct(r["tok_err"]),
                num(r["measured_p90_ms"], 0),
                num(r["predicted_p90_ms"], 0),
                pct(r["p90_err"]),
                num(r["measured_rows_per_forward"]),
                num(r["predicted_rows_per_forward"]),
                num(r.get("measured_cpu_ms_per_round")) + " / " + num(r.get("predicted_cpu_ms_per_round")),
                (f"{load[0]:.1f}->{load[3]:.1f}" if len(load) >= 4 else "n/a")
                + ("" if r.get("slowdown") is None else f" (x{r['slowdown']:.1f})"),
                "n/a" if r.get("cpu_scale") is None else f"x{r['cpu_scale']:.2f}",
                "yes" if r["ok"] else "NO",
            ]
        )
    headers = [
        "mode",
        "sessions",
        "tok/s meas.",
        "tok/s pred.",
        "tok/s err",
        "p90 meas.",
        "p90 pred.",
        "p90 err",
        "rows/fwd meas.",
        "rows/fwd pred.",
        "worker CPU ms/round meas. / pred.",
        "load (CPU x)",
        "CPU speed (sampled)",
        f"both within {100 * tol:.0f}%",
    ]
    return TextTable(
        "hycoc capacity --validate: predicted vs measured (hycoc loadtest, same command)",
        headers,
        body,
        keys=2,
        justify=["left"] + ["right"] * 12 + ["left"],
    )


# ---- tables, JSON, plot ----------------------------------------------------------------------------------------


def sweep_table(rows: list[dict], title: str):
    """Per (config, mode, devices): committed tok/s per device and in all, round latency p50/p90/p99 (client
    side, link included), verifier p90, the verifier's busy share and rows per forward."""
    from hycoc.bench.loadtest.report import fmt_num as num
    from hycoc.bench.tables import TextTable

    body = [
        [
            r["config"],
            r["mode"],
            str(r["sessions"]),
            num(r["tok_per_s_per_device"]),
            num(r["tok_per_s"]),
            num(r["latency_ms"]["p50"], 0),
            num(r["latency_ms"]["p90"], 0),
            num(r["latency_ms"]["p99"], 0),
            num(r["server_p90_ms"], 0),
            f"{100 * r['busy_share']:.0f}%",
            num(r["rows_per_forward"]),
        ]
        for r in rows
    ]
    headers = [
        "config",
        "mode",
        "devices",
        "tok/s/device",
        "tok/s all",
        "round p50",
        "round p90",
        "round p99",
        "verifier p90",
        "verifier busy",
        "rows/fwd",
    ]
    return TextTable(title, headers, body, keys=3, justify=["left", "left"] + ["right"] * 9)


def capacity_table(rows: list[dict], title: str):
    """Per (config, mode): the largest device count meeting the target, tok/s per device and in all there, and the
    ratio against cloud-mtp's device count in the same mode."""
    from hycoc.bench.loadtest.report import fmt_num as num
    from hycoc.bench.tables import TextTable

    body = [
        [
            r["config"],
            r["mode"],
            r.get("variant", ""),
            "unreachable" if r["devices"] is None else str(r["devices"]),
            num(r.get("tok_per_s_per_device")),
            num(r.get("tok_per_s")),
            num(r.get("server_p90_ms"), 0),
            num(r.get("round_p90_ms"), 0),
            "n/a" if r.get("vs_cloud_mtp") is None else f"{r['vs_cloud_mtp']:.2f}x",
        ]
        for r in rows
    ]
    headers = [
        "config",
        "mode",
        "variant",
        "devices per verifier",
        "tok/s/device",
        "tok/s all",
        "verifier p90",
        "round p90 (link, no drafting)",
        "vs cloud-mtp",
    ]
    return TextTable(title, headers, body, keys=3, justify=["left", "left", "left"] + ["right"] * 6)


def add_ratios(rows: list[dict]) -> None:
    """Fill ``vs_cloud_mtp``: devices / cloud-mtp's devices of the same mode and variant (None without them)."""
    base = {(r["mode"], r.get("variant", "")): r["devices"] for r in rows if r["config"] == "cloud-mtp"}
    for r in rows:
        b = base.get((r["mode"], r.get("variant", "")))
        r["vs_cloud_mtp"] = r["devices"] / b if b and r["devices"] is not None else None


def write_plot(rows: list[dict], path: Path, target_ms: float | None = None) -> Path:
    """PNG: verifier p90 (ms, log) against devices (log 2), one line per (config, mode[, variant]); the target
    dashed. Written through a temporary name and a rename."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(8, 4.8))
    keys = list(dict.fromkeys((r["config"], r["mode"], r.get("variant", "")) for r in rows))
    for i, key in enumerate(keys):
        rs = sorted(
            (
                r
                for r in rows
                if (r["config"], r["mode"], r.get("variant", "")) == key
                and r.get("server_p90_ms") is not None
                and math.isfinite(r["server_p90_ms"])
            ),
            key=lambda r: r["sessions"],
        )
        if rs:
            ax.plot(
                [r["sessions"] for r in rs],
                [r["server_p90_ms"] for r in rs],
                marker="o",
                color=f"C{i % 10}",
                label=" ".join(k for k in key if k),
            )
    if target_ms:
        ax.axhline(target_ms, linestyle="--", color="grey", label=f"target {target_ms:g} ms")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("devices")
    ax.set_ylabel("verifier round latency p90 (ms)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def stamp() -> dict:
    """When and under what load: date, CPUs, load averages."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "cpus": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }


__all__ = [
    "SchedSampler",
    "CONFIGS",
    "GEMMA4_FRAMES",
    "PAPER_MAT",
    "PROJECTION_CONFIGS",
    "SERVER_DRAFT_FRAMES",
    "add_ratios",
    "capacity_table",
    "host_terms",
    "outside_ms",
    "device_ms_of",
    "place_of",
    "predicted_for",
    "run_point",
    "search_devices",
    "stamp",
    "sweep_table",
    "trace_workload",
    "validation_rows",
    "validation_table",
    "within",
    "write_plot",
]
