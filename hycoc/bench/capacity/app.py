"""`hycoc capacity`'s two flows (docs/capacity.md): `run_local` for a recipe whose verifier is on this machine
(the toy: its own step cost timed here, recorded rounds replayed, ``--validate`` against `hycoc loadtest`), and
`hycoc.bench.capacity.projection.run_projection` for one that is not (recipes/gemma4.toml: a labelled projection
from the verifier config's cost line or a measured GPU line, fitted trees, over LTE and 5G and drafting x0.7 / x1.3)."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from hycoc.bench.capacity.run import (
    add_ratios,
    capacity_table,
    host_terms,
    run_point,
    search_devices,
    stamp,
    sweep_table,
    trace_workload,
    validation_rows,
    validation_table,
    write_plot,
)
from hycoc.bench.capacity.simulation import REPLAY_MODES, CapacityError, SimConfig

#: Within this of the measured tok/s and p90 a validation cell counts as reproduced (the issue's +-20%).
TOLERANCE = 0.20
VALIDATE_SESSIONS = (1, 4, 16, 64)
#: The modes the check runs: the load test's (`hycoc.serving_limits.SERVER_MODES`, the one list) whose recorded
#: trees replay as recorded (`hycoc.bench.capacity.simulation.REPLAY_MODES`: not allowance, whose devices redraft).
VALIDATE_MODES = REPLAY_MODES
#: Shape keys compared between a cost model and the recipe's verifier (`hycoc.bench.cost_model.measure.shape_of`).
SHAPE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_experts",
    "top_k_experts",
    "vocab_size",
)


def recipe_shape(cfg) -> dict | None:
    """The recipe's verifier shape from its local config.json (text config), or None when it is not here."""
    try:
        d = json.loads((cfg.model_path("verifier") / "config.json").read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 -- a hub id or a missing folder: nothing to compare against
        return None
    d = d.get("text_config", d)
    return {k: d[k] for k in SHAPE_KEYS if d.get(k) is not None}


def check_trace(trace, cfg, bundle_dir: Path, path: Path) -> None:
    """A trace given with --trace must be this recipe's and bundle's (its meta's hashes). Raises CapacityError."""
    from hycoc.bundle import sha256_file

    meta = trace.meta or {}
    if meta.get("recipe_sha256") not in (None, cfg.content_hash()):
        raise CapacityError(
            f"--trace {path}: recorded with another recipe ({meta.get('recipe')}); leave --trace out "
            "to record this recipe's rounds"
        )
    want = sha256_file(Path(bundle_dir) / "manifest.json")
    if meta.get("bundle_manifest_sha256") != want:
        raise CapacityError(
            f"--trace {path}: recorded with another bundle ({meta.get('bundle', 'unknown')}), not "
            f"{bundle_dir}; leave --trace out to record this bundle's rounds, or pass --bundle "
            f"{meta.get('bundle', 'THAT_BUNDLE')}"
        )


def trace_for(cfg, bundle_dir: Path, configs: list[str], questions, temperature, repo_root: Path, console):
    """The recorded rounds `hycoc loadtest` would replay for these configs, questions and temperature: its cache
    file (same key, `hycoc.bench.loadtest.trace.trace_key`) or a new recording saved there."""
    from hycoc import progress
    from hycoc.bench.loadtest.trace import load_trace, record_trace, save_trace, trace_key
    from hycoc.bundle import sha256_file

    cap = cfg.bench.output_cap
    key = trace_key(
        cfg.content_hash(),
        sha256_file(bundle_dir / "manifest.json"),
        configs,
        [q.question_id for q in questions],
        cap,
        None if temperature is None or temperature == cfg.sampling.temperature else temperature,
    )
    path = repo_root / ".hycoc-cache" / "loadtest" / f"trace-{key}.json"
    if path.is_file():
        return load_trace(path), path
    with progress.step("recording device rounds", total=len(configs) * len(questions)) as s:
        trace = record_trace(
            cfg,
            bundle_dir,
            configs,
            questions,
            cap,
            key=key,
            progress=lambda note: s.advance(note=note),
            temperature=temperature,
        )
    save_trace(trace, path)
    console.print(f"recorded {len(trace.requests)} requests -> {path}")
    return trace, path


def write_document(out: Path, doc: dict) -> Path:
    """OUT/capacity.json, atomically (`hycoc.bench.loadtest.report.write_results`, NaN as null)."""
    from hycoc.bench.loadtest.report import write_results

    return write_results(Path(out) / "capacity.json", _clean(doc))


def _clean(x):
    if isinstance(x, np.generic):  # numpy scalars (np.float64, np.bool_) as their Python values
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _capacity_rows(make, base: SimConfig, cost, target: float, config: str, mode: str, variant: str = ""):
    """One capacity row and the runs its search tried; an unreachable target is a row with devices None and the
    one-line reason."""
    label = f"{config} ({mode}{', ' + variant if variant else ''})"
    try:
        n, row, tried = search_devices(make, base, cost, target, label=label)
    except CapacityError as e:
        return {"config": config, "mode": mode, "variant": variant, "devices": None, "note": str(e)}, []
    return {
        "config": config,
        "mode": mode,
        "variant": variant,
        "devices": n,
        "tok_per_s_per_device": row["tok_per_s_per_device"],
        "tok_per_s": row["tok_per_s"],
        "server_p90_ms": row["server_p90_ms"],
        "round_p90_ms": row["latency_ms"]["p90"],
        "busy_share": row["busy_share"],
    }, [dict(r, config=config, variant=variant) for r in tried]


def run_local(*args, **kwargs) -> dict:
    """The toy flow (module docstring). Prints the tables, writes OUT/capacity.json and OUT/p90_vs_devices.png;
    returns the document. validate_sessions / validate_modes: the measured cells of ``validate`` (default the
    issue's 12); validate_only: stop after the check (no sweep, no plot)."""
    with contextlib.ExitStack() as stack:  # the speed sampler's process stops however the run ends
        return _run_local(stack, *args, **kwargs)


def _run_local(
    stack,
    cfg,
    recipe_path: Path,
    configs,
    modes,
    counts,
    target,
    duration,
    link,
    replicas,
    cost_model_path,
    device_scale,
    out,
    *,
    validate,
    validate_duration,
    prompts,
    bundle,
    trace_path,
    remeasure,
    repo_root: Path,
    dataset: Path,
    validate_sessions=VALIDATE_SESSIONS,
    validate_modes=VALIDATE_MODES,
    validate_only: bool = False,
) -> dict:
    """`run_local` with ``stack`` (a `contextlib.ExitStack`) holding what must stop at its end."""
    from hycoc.bench.capacity.cost import StepCost, model_step_cost
    from hycoc.bench.capacity.measure import cached_step_cost
    from hycoc.bench.cost_model.model import load_cost_model
    from hycoc.bench.datasets import load_spec_bench
    from hycoc.bench.inputs import bench_bundle
    from hycoc.bench.loadtest.run import devices_for
    from hycoc.bench.loadtest.trace import load_trace
    from hycoc.bench.paper.runner import make_console
    from hycoc.bench.tables import print_tables

    console = make_console()
    speed, profile_window = None, None
    bundle_dir = bench_bundle(cfg, recipe_path, bundle, repo_root, command="capacity", say=console.print)
    questions = load_spec_bench(cfg.resolve_path(cfg.bench.dataset) or dataset)[:prompts]
    temperature = 0.0 if "budgeted" in modes and cfg.sampling.temperature > 0 else None
    cost: StepCost
    if cost_model_path is not None:
        cost = model_step_cost(
            load_cost_model(cost_model_path), recipe_shape(cfg), cfg.tree.chain_length, path=str(cost_model_path)
        )
    else:
        console.print(
            "capacity: timing the verifier's steps on this machine, replaying recorded hyco rounds"
            + (" (again: --validate compares with runs made now)" if validate else " (cached per recipe)")
        )
        hyco, hyco_path = trace_for(
            cfg, bundle_dir, ["hyco"], questions, 0.0 if cfg.sampling.temperature > 0 else None, repo_root, console
        )
        if validate:  # the machine's speed sampled through the profile and every run (hycoc.bench.capacity.speed_probe)
            import tempfile

            from hycoc.bench.capacity.speed_probe import SpeedSampler

            speed = stack.enter_context(
                SpeedSampler(
                    recipe_path,
                    hyco_path,
                    hyco.requests[0],
                    Path(tempfile.mkdtemp(prefix="hycoc-speed-")) / "speed.txt",
                )
            )
        profile_t0 = time.time()
        cost = cached_step_cost(
            cfg,
            repo_root / ".hycoc-cache" / "capacity",
            remeasure=remeasure or validate,
            replay=list(hyco.requests),
            log=lambda s: None,
            recipe_path=recipe_path,
            keep_set=bundle_dir / "keep_set.npy",
        )
        profile_window = (profile_t0, time.time())
    console.print(f"step cost: {cost.label}")
    if getattr(cost, "idle_factor", 1.0) != 1.0:
        meta = getattr(cost, "meta", None) or {}
        console.print(
            f"a step after the worker idled {meta.get('idle_pause_ms', 0):.0f} ms: x{cost.idle_factor:.3f} its "
            "back-to-back CPU ms (measured, hycoc.bench.capacity.speed_probe)",
            markup=False,
        )
    if profile_window is not None and speed is not None:
        ref = speed.mean_between(*profile_window)
        if ref is not None:
            console.print(
                f"machine speed while the profile was timed: the speed sampler's probe steps {ref:.1f} ms on average",
                markup=False,
            )
    h = cost.overhead()
    if cost.host:
        console.print(
            f"host work per round outside the step (stubbed round trip, {h.meta.get('repeats')} repeats, load "
            f"{(h.meta.get('loadavg_before') or [0])[0]:.1f}): server event loop {h.loop_ms:.2f} ms (serialised), "
            f"client {h.client_ms:.2f} ms, socket and wake-ups {h.wire_ms:.2f} ms (in parallel)",
            markup=False,
        )
    if cost.spread:
        q = [float(x) for x in np.quantile(cost.spread, (0.1, 0.5, 0.9))]
        console.print(
            f"step spread (step ms / its point's mean, {len(cost.spread)} steps): p10 {q[0]:.2f}, p50 {q[1]:.2f}, "
            f"p90 {q[2]:.2f}; row budget's own work {cost.budget_ms:.2f} ms per session and budgeted step",
            markup=False,
        )
    doc: dict = {
        "schema": 1,
        "recipe": str(recipe_path),
        "kind": "simulation of this machine's verifier",
        "cost": cost.describe(),
        "target_p90_ms": target,
        "link": None if link is None else vars(link),
        "replicas": replicas,
        "device_scale": device_scale,
        "duration_s": duration,
        "machine": stamp(),
    }
    if validate:
        doc["validation"] = validate_here(
            cfg,
            recipe_path,
            bundle_dir,
            questions,
            cost,
            validate_duration,
            out,
            repo_root,
            console,
            sessions=validate_sessions,
            modes=validate_modes,
            speed=speed,
            profile_window=profile_window,
        )
        if validate_only:
            path = write_document(out, doc)
            console.print(f"wrote {path}")
            return doc
    if trace_path is not None:
        trace = load_trace(trace_path)
        check_trace(trace, cfg, bundle_dir, trace_path)
    else:
        trace, trace_path = trace_for(cfg, bundle_dir, list(configs), questions, temperature, repo_root, console)
    base = SimConfig(
        mode=modes[0],
        devices=1,
        duration_s=duration,
        replicas=replicas,
        **host_terms(cost),
        link=link,
        max_batch_rows=cfg.verifier.max_batch_rows,
        max_batch_wait_ms=cfg.verifier.max_batch_wait_ms,
        tree_rows=cfg.tree.node_budget + 1,
        chain_length=cfg.tree.chain_length,
    )
    sweep, capacity, tried_all = [], [], []
    for config in configs:

        def make(n, config=config):
            return trace_workload(devices_for(trace, [config], n), device_scale=device_scale)

        for mode in modes:
            for n in counts:
                row = run_point(make(n), replace(base, mode=mode, devices=n), cost)
                sweep.append(dict(row, config=config))
            row, tried = _capacity_rows(make, replace(base, mode=mode), cost, target, config, mode)
            capacity.append(row)
            tried_all += tried
    add_ratios(capacity)
    print_tables(
        [
            sweep_table(
                sweep, f"hycoc capacity {recipe_path}: simulated ({cost.label}), {duration:g} s, {replicas} replica(s)"
            )
        ],
        console,
    )
    print_tables(
        [capacity_table(capacity, f"devices per verifier at verifier p90 <= {target:g} ms ({replicas} replica(s))")],
        console,
    )
    for r in capacity:
        if r.get("note"):
            console.print(r["note"], markup=False)
    doc.update(trace=str(trace_path), sweep=sweep, capacity=capacity)
    path = write_document(out, doc)
    plot = write_plot(sweep + tried_all, Path(out) / "p90_vs_devices.png", target)
    console.print(f"wrote {path}, {plot}")
    return doc


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
    from hycoc.bench.capacity.run import SchedSampler, predicted_for
    from hycoc.bench.loadtest.run import devices_for, run_loadtest
    from hycoc.bench.tables import print_tables

    configs = ["hyco"]
    temperature = 0.0 if cfg.sampling.temperature > 0 else None
    trace, path = trace_for(cfg, bundle_dir, configs, questions, temperature, repo_root, console)
    load0 = os.getloadavg()
    with SchedSampler() as sampler:
        measured = run_loadtest(
            trace,
            configs,
            list(sessions),
            duration,
            list(modes),
            Path(out) / "loadtest",
            recipe_path=recipe_path,
            keep_set=bundle_dir / "keep_set.npy",
            console=console,
            meta={"recipe": str(recipe_path), "trace": str(path)},
        )
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
        # the machine's CPU speed through the run against the profile's (the speed sampler's mean probe step in
        # each window): the run's steps are simulated at that ratio (docs/capacity.md "What is simulated")
        scale = m["speed_sampled_ms"] / sampled_ref if m.get("speed_sampled_ms") and sampled_ref else 1.0
        predicted.append(
            predicted_for(
                m,
                trace_workload(devices_for(trace, configs, m["sessions"])),
                cost,
                measured["meta"],
                contention=contention,
                cpu_scale=scale,
            )
        )
    load1 = os.getloadavg()
    rows = validation_rows(measured["runs"], predicted, TOLERANCE)
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


__all__ = [
    "TOLERANCE",
    "check_trace",
    "recipe_shape",
    "run_local",
    "trace_for",
    "validate_here",
    "write_document",
]
