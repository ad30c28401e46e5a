"""What a `hycoc loadtest` run measured, per (batching mode, sessions): numbers, a GPU projection, the table,
``results.json`` and the latency-vs-sessions plot (docs/serving.md "Load test: `hycoc loadtest`").

`summarize_run` turns one run's client samples (`hycoc.bench.loadtest.run.RunStats`) and the server's /metrics before
and after it into one row:

* the window: from the end of the ramp (every device's first round answered: at the start all devices connect,
  OPEN and queue their prefills together, which says nothing about serving rounds) to ``duration_s``; a run whose
  ramp does not end before ``duration_s`` is measured from its start and marked ``steady: false``
  (``devices_served``: how many devices had a round answered at all);
* ``tok_per_s``: output tokens committed by rounds answered within the window / the window (s);
  ``tok_per_s_whole``: the same over the whole run, ramp included;
* ``verifier_ms_per_token``: the verifier's worker milliseconds in rounds per committed token over the run, from
  /metrics (``hycoc_server_ms_total`` / ``hycoc_tokens_committed_total`` differences; prefill not included);
  ``reply_ms_per_token``: the replies' server_ms summed over the window's rounds / their tokens. The two agree on
  a serial server; under batching each reply's server_ms counts the whole shared forward (`verify_batch`), so
  the replies' sum counts a forward once per session in it, and only the first is the verifier's cost. Without
  the /metrics counters ``verifier_ms_per_token`` falls back to the replies';
* ``latency_ms``: round latency send -> reply on the client, mean and p50 / p90 / p99 / max (`percentile`);
* ``rows_per_forward`` / ``sessions_per_forward`` / ``queue_wait_ms``: means over the run from the server's
  histograms ``hycoc_batch_rows``, ``hycoc_batch_sessions``, ``hycoc_queue_wait_seconds`` (their ``_sum`` and
  ``_count`` differences); None ("n/a") when the server has no such histogram (today's serial server);
* ``rows_kept_per_session`` / ``expected_tokens_per_forward`` / ``rows_trimmed``: the row budget's histograms
  ``hycoc_rows_kept_per_session``, ``hycoc_expected_tokens_per_forward`` (means; None without budgeted forwards)
  and counter ``hycoc_rows_trimmed_total`` (difference);
* ``errors``: code -> count (`hycoc.bench.loadtest.run` module docstring lists the codes), and ``rounds``.

Projection (`project`), labelled as such everywhere: what the measured batching would be worth on a GPU, where a
forward's cost hardly depends on its rows until it is compute-bound. Trees per forward = sessions per forward
(else rows per forward / rows per tree; a server without batch histograms verifies one tree per forward). With a
cost model (`hycoc.bench.cost_model.model.CostModel`, e.g. measured on a GPU by ``benchmarks/verifier_cost_model.py
--device cuda --rows ...``) the speed-up over one tree per forward is predict(rows per tree, context) x trees per
forward / predict(rows per forward, context); without one, the ASSUMED flat-then-linear GPU model
cost(R) = max(1, R / GPU_FLAT_ROWS) x cost(one tree) gives trees per forward / max(1, rows per forward /
GPU_FLAT_ROWS).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hycoc.numerics import percentile
from hycoc.protocol import wire

if TYPE_CHECKING:
    from hycoc.bench.tables import TextTable

#: Rows up to which the assumed GPU forward costs the same as a one-tree forward: the bf16 ridge point of an
#: NVIDIA H200 (989 TFLOP/s dense bf16 / 4.8 TB/s HBM3e = 206 FLOP per byte). A bf16 weight (2 bytes) does one
#: multiply-add (2 FLOP) per row, i.e. 1 FLOP per byte per row, so a forward stays weight-bandwidth-bound up to
#: about 206 rows. An assumption from the datasheet, not a measurement: pass a measured cost model to replace it.
GPU_FLAT_ROWS = 206

RESULTS_SCHEMA = 1
#: Keys of every row of results.json's ``runs`` (the test of the schema reads this).
RUN_KEYS = (
    "mode",
    "sessions",
    "duration_s",
    "rounds",
    "committed_tokens",
    "tok_per_s",
    "verifier_ms_per_token",
    "reply_ms_per_token",
    "tok_per_s_whole",
    "ramp_s",
    "steady",
    "devices_served",
    "device_wait_ms",
    "mat",
    "latency_ms",
    "open_ms_p50",
    "rows_per_tree",
    "round_bytes_up",
    "allowance_mean",
    "rows_not_drafted",
    "rows_per_forward",
    "sessions_per_forward",
    "queue_wait_ms",
    "rows_kept_per_session",
    "expected_tokens_per_forward",
    "rows_trimmed",
    "context_mean",
    "errors",
    "errors_total",
    "requests_finished",
    "requests_truncated",
    "requests_off_trace",
    "server_rounds",
    "server_tokens",
    "client_cpu_pct",
    "loadavg",
    "projection",
)


def _hist_mean(before: dict, after: dict, name: str, scale: float = 1.0) -> float | None:
    """Mean of a Prometheus histogram over a run: (sum after - sum before) / (count after - count before) x scale;
    None when the server has no such histogram or it saw nothing."""
    s, c = f"{name}_sum", f"{name}_count"
    if s not in after or c not in after:
        return None
    n = after[c] - before.get(c, 0.0)
    return (after[s] - before.get(s, 0.0)) / n * scale if n > 0 else None


def summarize_run(
    mode: str,
    sessions: int,
    duration_s: float,
    stats,
    metrics_before: dict | None = None,
    metrics_after: dict | None = None,
    loadavg: tuple | None = None,
) -> dict:
    """One row of the report (module docstring) from a run's `RunStats` of ``sessions`` devices; only rounds
    answered within the window (after the ramp, up to ``duration_s`` s from the start) count. Returns a dict with
    the keys `RUN_KEYS` (``projection`` None: see `project`)."""
    before, after = metrics_before or {}, metrics_after or {}
    ramp = max(stats.first_round_s.values()) if len(stats.first_round_s) >= sessions else None
    steady = ramp is not None and ramp < duration_s
    start = ramp if ramp is not None and steady else 0.0
    rounds = [r for r in stats.rounds if start < r.t_done <= duration_s]
    tokens = sum(r.committed for r in rounds)
    whole = sum(r.committed for r in stats.rounds if r.t_done <= duration_s)
    waits = np.asarray(stats.device_waits_ms, dtype=np.float64).reshape(-1, 2)
    lat = [r.latency_ms for r in rounds]

    def diff(name: str) -> int | None:
        return int(after[name] - before.get(name, 0.0)) if name in after else None

    reply_ms = sum(r.server_ms for r in rounds) / tokens if tokens else None
    worker_ms, worker_tokens = (
        after.get(k, 0.0) - before.get(k, 0.0) for k in ("hycoc_server_ms_total", "hycoc_tokens_committed_total")
    )
    has_counters = "hycoc_server_ms_total" in after and worker_tokens > 0
    return {
        "mode": mode,
        "sessions": int(sessions),
        "duration_s": float(duration_s),
        "rounds": len(rounds),
        "committed_tokens": tokens,
        "tok_per_s": tokens / (duration_s - start),
        "tok_per_s_whole": whole / duration_s,
        "ramp_s": ramp,
        "steady": steady,
        "devices_served": len(stats.first_round_s),
        "device_wait_ms": {"asked": float(waits[:, 0].mean()), "slept": float(waits[:, 1].mean())}
        if len(waits)
        else None,
        "verifier_ms_per_token": worker_ms / worker_tokens if has_counters else reply_ms,
        "reply_ms_per_token": reply_ms,
        "mat": tokens / len(rounds) if rounds else None,
        "latency_ms": {
            "mean": float(np.mean(lat)) if lat else math.nan,
            "p50": percentile(lat, 50),
            "p90": percentile(lat, 90),
            "p99": percentile(lat, 99),
            "max": float(np.max(lat)) if lat else math.nan,
        },
        "open_ms_p50": percentile(stats.opens_ms, 50),
        "rows_per_tree": float(np.mean([r.rows for r in rounds])) if rounds else None,
        # the ROUND frames' bytes, device -> verifier (scores included, as the device sends them)
        "round_bytes_up": float(np.mean([wire.tree_nbytes(r.rows) for r in rounds])) if rounds else None,
        "allowance_mean": _hist_mean(before, after, "hycoc_allowance_rows"),
        "rows_not_drafted": diff("hycoc_rows_not_drafted_total"),
        "rows_per_forward": _hist_mean(before, after, "hycoc_batch_rows"),
        "sessions_per_forward": _hist_mean(before, after, "hycoc_batch_sessions"),
        "queue_wait_ms": _hist_mean(before, after, "hycoc_queue_wait_seconds", 1000.0),
        "rows_kept_per_session": _hist_mean(before, after, "hycoc_rows_kept_per_session"),
        "expected_tokens_per_forward": _hist_mean(before, after, "hycoc_expected_tokens_per_forward"),
        "rows_trimmed": diff("hycoc_rows_trimmed_total"),
        "context_mean": float(np.mean([r.context for r in rounds])) if rounds else None,
        "errors": dict(sorted(stats.errors.items())),
        "errors_total": int(sum(stats.errors.values())),
        "requests_finished": stats.requests_finished,
        "requests_truncated": stats.requests_truncated,
        "requests_off_trace": getattr(stats, "requests_off_trace", 0),
        "server_rounds": diff("hycoc_rounds_total"),
        "server_tokens": diff("hycoc_tokens_committed_total"),
        "client_cpu_pct": 100.0 * stats.client_cpu_s / stats.wall_s if stats.wall_s > 0 else None,
        "loadavg": list(loadavg) if loadavg is not None else None,
        "projection": None,
    }


def project(row: dict, cost_model=None) -> dict | None:
    """The GPU projection of a report row (module docstring), or None when the row has no rounds.

    Returns {"trees_per_forward", "rows_per_forward", "speedup", "basis"}: speedup = verifier work per committed
    token with one tree per forward / with the measured batching, on the projected GPU; basis names the cost
    model or the assumption. A cost model that lacks the rows gives speedup None and says which rows to
    measure."""
    from hycoc.bench.cost_model.model import CostModelError

    per_tree = row.get("rows_per_tree")
    if not per_tree:
        return None
    if row.get("sessions_per_forward"):
        trees = float(row["sessions_per_forward"])
    elif row.get("rows_per_forward"):
        trees = float(row["rows_per_forward"]) / per_tree
    else:
        trees = 1.0  # no batch histograms: today's serial server, one tree per forward
    rows = float(row["rows_per_forward"]) if row.get("rows_per_forward") else trees * per_tree
    if cost_model is None:
        speedup = trees / max(1.0, rows / GPU_FLAT_ROWS)
        basis = (
            f"assumed GPU: a forward of up to {GPU_FLAT_ROWS} rows costs one tree's, linear beyond "
            "(H200 bf16 ridge point)"
        )
    else:
        ctx = int(round(row.get("context_mean") or 0))
        basis = f"cost model {cost_model.model} on {cost_model.device}"
        try:
            speedup = cost_model.predict(int(round(per_tree)), ctx) * trees / cost_model.predict(int(round(rows)), ctx)
        except CostModelError as e:
            speedup, basis = None, f"{basis}: {e}"
    return {"trees_per_forward": trees, "rows_per_forward": rows, "speedup": speedup, "basis": basis}


def gpu_row_cost(flat_rows: int = GPU_FLAT_ROWS):
    """The ASSUMED GPU forward as a `hycoc.verifier.row_budget.RowCost` in units of one flat forward: 1 up to
    ``flat_rows`` rows, linear beyond (cost(R) = max(1, R / flat_rows), as `project` assumes)."""
    from hycoc.verifier.row_budget import RowCost

    return RowCost(((1, 1.0), (flat_rows, 1.0), (2 * flat_rows, 2.0)), source=f"assumed GPU, flat to {flat_rows} rows")


def budget_projection(
    trees: list,
    sessions: list[int],
    cost,
    *,
    tree_rows: int,
    max_batch_rows: int,
    min_rows: int = 2,
    draws: int = 200,
    seed: int = 0,
) -> list[dict]:
    """What the row budget (`hycoc.verifier.row_budget.allocate`) would keep on another machine's cost line,
    computed from recorded trees -- a projection, not a measurement.

    trees: recorded rounds as (scores float (R,), tokens, parents). For each session count n, ``draws`` forwards
    of min(n, max_batch_rows // tree_rows) trees drawn at random (seeded) are allocated with free rows
    max(tree_rows, cost.flat_rows()) (the server's rule). Returns per n: {"sessions", "trees_per_forward",
    "rows_fixed", "rows_budgeted" (mean rows per forward), "expected_fixed", "expected_budgeted" (mean expected
    committed tokens per forward: sessions + sum of exp(s)), "trimmed_share" (forwards with any row trimmed),
    "gain"} where gain = (expected_budgeted / cost(rows_budgeted)) / (expected_fixed / cost(rows_fixed)), the
    expected tokens per forward-millisecond of budgeted over fixed. Expected tokens trust the scores
    (exp(s(v)) ~ the chance row v is accepted, paper §3.1); the measured MAT says how far."""
    from hycoc.verifier.row_budget import allocate

    rng = np.random.default_rng(seed)
    free = max(int(tree_rows), cost.flat_rows())
    out = []
    for n in sessions:
        k = max(1, min(int(n), max(1, max_batch_rows // tree_rows)))
        rows_f, rows_b, exp_f, exp_b, trimmed, gains = [], [], [], [], 0, []
        for _ in range(draws):
            batch = [trees[i] for i in rng.integers(0, len(trees), k)]
            full = allocate(batch, cost, free_rows=10**9, min_rows=min_rows)
            got = allocate(batch, cost, free_rows=free, min_rows=min_rows)
            rows_f.append(full.rows_after)
            rows_b.append(got.rows_after)
            exp_f.append(full.expected_tokens)
            exp_b.append(got.expected_tokens)
            trimmed += got.trimmed > 0
            gains.append(
                (got.expected_tokens / float(cost.ms(got.rows_after)))
                / (full.expected_tokens / float(cost.ms(full.rows_after)))
            )
        out.append(
            {
                "sessions": int(n),
                "trees_per_forward": k,
                "rows_fixed": float(np.mean(rows_f)),
                "rows_budgeted": float(np.mean(rows_b)),
                "expected_fixed": float(np.mean(exp_f)),
                "expected_budgeted": float(np.mean(exp_b)),
                "trimmed_share": trimmed / draws,
                "gain": float(np.mean(gains)),
                "basis": cost.source,
            }
        )
    return out


def budget_table(rows: list[dict], title: str) -> TextTable:
    """The budget projection's table (`budget_projection`, keys: sessions), headed as a projection."""
    from hycoc.bench.tables import TextTable

    headers = [
        "sessions",
        "trees/fwd",
        "rows fixed",
        "rows budgeted",
        "exp. tok fixed",
        "exp. tok budgeted",
        "fwds trimmed",
        "exp. tok/ms gain",
    ]
    out = [
        [
            str(r["sessions"]),
            str(r["trees_per_forward"]),
            _num(r["rows_fixed"]),
            _num(r["rows_budgeted"]),
            _num(r["expected_fixed"], 2),
            _num(r["expected_budgeted"], 2),
            f"{100 * r['trimmed_share']:.0f}%",
            f"{r['gain']:.2f}x",
        ]
        for r in rows
    ]
    return TextTable(title, headers, out, keys=1, justify=["right"] * len(headers))


def render_budget_projection(rows: list[dict], console, title: str, fmt: str = "table") -> None:
    """Print `budget_table` on ``console``, split to its width."""
    from hycoc.bench.tables import print_tables

    print_tables([budget_table(rows, title)], console, fmt)


def results_document(rows: list[dict], meta: dict) -> dict:
    """results.json's content: {"schema": RESULTS_SCHEMA, "meta": meta, "runs": rows} (rows as `summarize_run`
    made them, projections filled). NaN becomes null so the file is strict JSON."""

    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return None
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return clean({"schema": RESULTS_SCHEMA, "meta": meta, "runs": rows})


def write_results(path: Path, document: dict) -> Path:
    """Write ``document`` as indented JSON to ``path`` through a temporary name and a rename. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_plot(rows: list[dict], path: Path) -> Path:
    """The PNG: round latency (p50 solid, p90 dashed, p99 dotted, ms, log scale) against sessions on the left,
    committed tok/s against sessions on the right, one colour per batching mode. Written through a temporary name
    and a rename. Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, (ax_lat, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    for i, mode in enumerate(modes):
        rs = sorted((r for r in rows if r["mode"] == mode and r["rounds"]), key=lambda r: r["sessions"])
        if not rs:
            continue
        x = [r["sessions"] for r in rs]
        colour = f"C{i}"
        for q, style in (("p50", "-"), ("p90", "--"), ("p99", ":")):
            ax_lat.plot(x, [r["latency_ms"][q] for r in rs], style, marker="o", color=colour, label=f"{mode} {q}")
        ax_tps.plot(x, [r["tok_per_s"] for r in rs], "-", marker="o", color=colour, label=mode)
    for ax in (ax_lat, ax_tps):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent sessions")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax_lat.set_yscale("log")
    ax_lat.set_ylabel("round latency, send -> reply (ms)")
    ax_lat.set_title("round latency vs sessions")
    ax_tps.set_ylabel("committed tokens / s (all sessions)")
    ax_tps.set_title("throughput vs sessions")
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def fmt_num(x, digits: int = 1) -> str:
    """A table cell: ``x`` with thousands separators and ``digits`` decimals; "n/a" for None, NaN or infinity.
    The load test's and `hycoc capacity`'s tables share it."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:,.{digits}f}"


_num = fmt_num


def load_table(rows: list[dict], title: str) -> TextTable:
    """The summary table (`hycoc.bench.tables.TextTable`, keys: mode and sessions): per (mode, sessions) the
    measured columns (ramp s: seconds until every device had its first round; "(no end)": the run is measured from
    its start), then the projection's two, headed as a projection."""
    from hycoc.bench.tables import TextTable

    headers = [
        "mode",
        "sessions",
        "ramp s",
        "rounds",
        "tok/s",
        "MAT",
        "verifier ms/tok",
        "p50 ms",
        "p90 ms",
        "p99 ms",
        "rows/fwd",
        "rows kept/session",
        "device ms/round",
        "ROUND B",
        "errors",
        "proj.: trees/fwd",
        "proj.: GPU speed-up",
    ]
    out = []
    for r in rows:
        lat, p = r["latency_ms"], r.get("projection") or {}
        errors = ", ".join(f"{k} {v}" for k, v in r["errors"].items()) or "0"
        speedup = p.get("speedup")
        ramp = _num(r["ramp_s"]) + ("" if r["steady"] else " (no end)")
        out.append(
            [
                r["mode"],
                str(r["sessions"]),
                ramp,
                f"{r['rounds']:,}",
                _num(r["tok_per_s"]),
                _num(r["mat"], 2),
                _num(r["verifier_ms_per_token"], 2),
                _num(lat["p50"]),
                _num(lat["p90"]),
                _num(lat["p99"]),
                _num(r["rows_per_forward"]),
                _num(r.get("rows_kept_per_session")),
                _num((r.get("device_wait_ms") or {}).get("asked"), 1),
                _num(r.get("round_bytes_up")),
                errors,
                _num(p.get("trees_per_forward"), 2),
                "n/a" if speedup is None else f"{speedup:.2f}x",
            ]
        )
    justify = ["left", "right"] + ["right"] * 12 + ["left", "right", "right"]
    return TextTable(title, headers, out, keys=2, justify=justify)


def render_table(rows: list[dict], console, title: str, fmt: str = "table") -> None:
    """Print `load_table` on ``console``, split to its width (`hycoc.bench.tables.print_tables`)."""
    from hycoc.bench.tables import print_tables

    print_tables([load_table(rows, title)], console, fmt)


__all__ = [
    "fmt_num",
    "GPU_FLAT_ROWS",
    "RESULTS_SCHEMA",
    "RUN_KEYS",
    "budget_projection",
    "budget_table",
    "gpu_row_cost",
    "load_table",
    "percentile",
    "project",
    "render_budget_projection",
    "render_table",
    "results_document",
    "summarize_run",
    "write_plot",
    "write_results",
]
