"""`hycoc capacity --validate`: the simulation checked against load tests measured here (docs/capacity.md). Each
measured cell (`hycoc loadtest`, hyco, sessions x modes) is simulated with its own load, server settings and the
machine's speed through it (`hycoc.bench.capacity.run.predicted_for`), and the two are compared within
`hycoc.bench.capacity.app.TOLERANCE`."""

from __future__ import annotations

import os
from pathlib import Path

from hycoc.bench.capacity.app import TOLERANCE, VALIDATE_MODES, VALIDATE_SESSIONS, trace_for
from hycoc.bench.capacity.run import trace_workload, validation_rows, validation_table

#: The configurations the check records and measures.
CONFIGS = ("hyco",)


def _measure(trace, path: Path, recipe_path: Path, bundle_dir: Path, duration: float, out: Path, console, cells):
    """The load test of every (sessions, mode) cell of ``cells`` (the session counts, the modes) on ``trace``
    (recorded in ``path``), ``duration`` s each, with the servers' threads sampled (`SchedSampler`). Returns (the
    results document, the sampler)."""
    from hycoc.bench.capacity.run import SchedSampler
    from hycoc.bench.loadtest.plan import LoadTestRun
    from hycoc.bench.loadtest.run import run_loadtest

    sessions, modes = cells
    with SchedSampler() as sampler:
        measured = run_loadtest(
            trace,
            LoadTestRun(list(CONFIGS), list(sessions), list(modes), duration, Path(out) / "loadtest"),
            recipe_path=recipe_path,
            keep_set=bundle_dir / "keep_set.npy",
            console=console,
            meta={"recipe": str(recipe_path), "trace": str(path)},
        )
    return measured, sampler


def _predict(measured: dict, sampler, trace, cost, speed, profile_window) -> tuple[list[dict], float | None]:
    """Each measured run simulated with that run's CPU contention and the machine's speed through it against the
    profile's (the speed sampler's mean probe step in each window: the run's steps are simulated at that ratio,
    docs/capacity.md "What is simulated"). Adds ``speed_sampled_ms`` to each run when there is a sampler. Returns
    (the predictions, the profile's mean probe step or None)."""
    from hycoc.bench.capacity.run import predicted_for
    from hycoc.bench.loadtest.run import devices_for

    windows = {(w["mode"], w["sessions"]): w["epoch_s"] for w in measured["meta"].get("run_windows", [])}
    sampled_ref = speed.mean_between(*profile_window) if speed is not None and profile_window else None
    if speed is not None:
        for m in measured["runs"]:
            w = windows.get((m["mode"], m["sessions"]))
            m["speed_sampled_ms"] = speed.mean_between(*w) if w else None
        measured["meta"]["speed_sampled_profile_ms"] = sampled_ref
    predicted = []
    for m in measured["runs"]:
        window = windows.get((m["mode"], m["sessions"]))
        contention = sampler.contention(*window) if window else None
        scale = m["speed_sampled_ms"] / sampled_ref if m.get("speed_sampled_ms") and sampled_ref else 1.0
        predicted.append(
            predicted_for(
                m,
                trace_workload(devices_for(trace, list(CONFIGS), m["sessions"])),
                cost,
                measured["meta"],
                contention=contention,
                cpu_scale=scale,
            )
        )
    return predicted, sampled_ref


def _print_check(rows: list[dict], load0, load1, console) -> int:
    """The comparison's table, the host work outside the verifier at one session, the machine's load and what the
    columns mean. Returns how many cells are within the tolerance."""
    from hycoc.bench.tables import print_tables

    print_tables([validation_table(rows, TOLERANCE)], console)
    ok = sum(r["ok"] for r in rows)
    for r in rows:
        if r["measured_outside_ms"] is not None and r["predicted_outside_ms"] is not None:
            console.print(
                f"{r['mode']}, 1 session: {r['measured_outside_ms']:.1f} ms per round outside the verifier measured "
                f"(latency - the reply's server_ms), {r['predicted_outside_ms']:.1f} ms simulated (host work)",
                markup=False,
            )
    console.print(
        f"machine load (1/5/15-minute load averages, {os.cpu_count()} CPUs): "
        + " ".join(f"{x:.2f}" for x in load0)
        + " before the runs, "
        + " ".join(f"{x:.2f}" for x in load1)
        + " after; the check is meant for a quiet machine (1-minute load <= CPUs)",
        markup=False,
    )
    console.print(
        f"{ok} of {len(rows)} cells within {100 * TOLERANCE:.0f}% for both tok/s and p90 (p90: client "
        "round latency send -> reply, as hycoc loadtest measures it; load: 1-minute load average before "
        "-> after the run; (CPU x): how much longer a CPU ms of the verifier took in that run, from its threads' "
        "/proc schedstat (on-CPU + waiting) / on-CPU, by which the simulation stretches the step cost; worker "
        "CPU ms/round: the busiest server thread's on-CPU ms (schedstat) per round the server answered, prefills "
        "included, against the simulated steps' CPU ms per round; CPU speed (sampled): the speed sampler's mean "
        "probe step during the run / during the profile, by which the run's steps are simulated)"
    )
    return ok


def validate_here(
    cfg,
    recipe_path: Path,
    bundle_dir: Path,
    questions,
    cost,
    duration: float,
    out: Path,
    repo_root: Path,
    console,
    *,
    sessions=VALIDATE_SESSIONS,
    modes=VALIDATE_MODES,
    speed=None,
    profile_window=None,
) -> dict:
    """Run `hycoc loadtest` (hyco; ``sessions`` x ``modes``, by default 1, 4, 16, 64 x serial, batched, budgeted;
    ``duration`` s each) here, simulate every measured cell with its own load and server settings
    (`predicted_for`), print and return the comparison with the machine's load beside it."""
    temperature = 0.0 if cfg.sampling.temperature > 0 else None
    trace, path = trace_for(cfg, bundle_dir, list(CONFIGS), questions, temperature, repo_root, console)
    load0 = os.getloadavg()
    measured, sampler = _measure(trace, path, recipe_path, bundle_dir, duration, out, console, (sessions, modes))
    predicted, sampled_ref = _predict(measured, sampler, trace, cost, speed, profile_window)
    load1 = os.getloadavg()
    rows = validation_rows(measured["runs"], predicted, TOLERANCE)
    ok = _print_check(rows, load0, load1, console)
    return {
        "loadavg_before": list(load0),
        "loadavg_after": list(load1),
        "cells": rows,
        "within": ok,
        "tolerance": TOLERANCE,
        "speed_sampled_profile_ms": sampled_ref,  # the profile's mean probe step (the cpu_scale reference)
        "predicted": predicted,
        "measured": measured["runs"],
        "trace": str(path),
    }


__all__ = ["validate_here"]
