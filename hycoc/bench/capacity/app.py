"""`hycoc capacity`'s two flows (docs/capacity.md): `run_local` for a recipe whose verifier is on this machine
(the toy: its own step cost timed here, recorded rounds replayed, ``--validate`` against `hycoc loadtest`), and
`hycoc.bench.capacity.projection.run_projection` for one that is not (recipes/gemma4.toml: a labelled projection
from the verifier config's cost line or a measured GPU line, fitted trees, over LTE and 5G and drafting x0.7 / x1.3)."""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from hycoc.bench.capacity.options import CapacityPlan
from hycoc.bench.capacity.requests import CapacityError
from hycoc.bench.capacity.run import (
    add_ratios,
    capacity_table,
    host_terms,
    run_point,
    search_devices,
    stamp,
    sweep_table,
    trace_workload,
    write_plot,
)
from hycoc.bench.capacity.simulation import REPLAY_MODES, SimConfig
from hycoc.bench.cost_model.measure import SHAPE_KEYS as COST_SHAPE_KEYS

#: Within this of the measured tok/s and p90 a validation cell counts as reproduced (the issue's +-20%).
TOLERANCE = 0.20
VALIDATE_SESSIONS = (1, 4, 16, 64)
#: The modes the check runs: the load test's (`hycoc.serving_limits.SERVER_MODES`, the one list) whose recorded
#: trees replay as recorded (`hycoc.bench.capacity.simulation.REPLAY_MODES`: not allowance, whose devices redraft).
VALIDATE_MODES = REPLAY_MODES
#: Keys of a cost model's shape (`hycoc.bench.cost_model.measure.SHAPE_KEYS`) left out of the comparison with the
#: recipe's verifier: the attention variants and MoE details.
UNCOMPARED_SHAPE_KEYS = frozenset(
    {
        "global_head_dim",
        "num_global_key_value_heads",
        "sliding_window",
        "enable_moe_block",
        "moe_intermediate_size",
        "num_kv_shared_layers",
    }
)
#: Shape keys compared between a cost model and the recipe's verifier: the cost model's own, in their order, less
#: `UNCOMPARED_SHAPE_KEYS`.
SHAPE_KEYS = tuple(k for k in COST_SHAPE_KEYS if k not in UNCOMPARED_SHAPE_KEYS)


def compared_shape(text_config: Mapping[str, Any]) -> dict:
    """The `SHAPE_KEYS` that ``text_config`` (a config.json's text config, as a dict) sets, in that order."""
    return {k: text_config[k] for k in SHAPE_KEYS if text_config.get(k) is not None}


def recipe_shape(cfg) -> dict | None:
    """The recipe's verifier shape from its local config.json (text config), or None when it is not here."""
    try:
        d = json.loads((cfg.model_path("verifier") / "config.json").read_text(encoding="utf-8"))
    except Exception:  # noqa: BLE001 -- a hub id or a missing folder: nothing to compare against
        return None
    return compared_shape(d.get("text_config", d))


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
    file (`hycoc.bench.loadtest.app.cached_trace`, the same key) or a new recording saved there."""
    from hycoc.bench.loadtest.app import cached_trace

    trace, path, recorded = cached_trace(
        cfg, bundle_dir, configs, questions, cfg.bench.output_cap, temperature, repo_root
    )
    if recorded:
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


def run_capacity(cfg, recipe_path: Path, plan: CapacityPlan, *, repo_root: Path, dataset: Path) -> dict:
    """`hycoc capacity`'s run of a checked plan (`hycoc.bench.capacity.options.plan_capacity`): `run_local` for a
    recipe whose verifier is here, else `hycoc.bench.capacity.projection.run_projection`. Returns the document.
    Raises CapacityError, StepCostError, CostModelError, LoadTestError, TraceError, GpuCostError."""
    if plan.local:
        return run_local(cfg, recipe_path, plan, repo_root=repo_root, dataset=dataset)
    from hycoc.bench.capacity.projection import run_projection

    return run_projection(
        cfg,
        recipe_path,
        plan.configs,
        plan.modes,
        plan.target_p90_ms,
        plan.duration_s,
        plan.replicas,
        plan.cost_model,
        plan.device_scale,
        plan.out,
        gpu=plan.gpu,
        sweep_rows=plan.sweep_rows,
    )


def run_local(cfg, recipe_path: Path, plan: CapacityPlan, *, repo_root: Path, dataset: Path) -> dict:
    """The toy flow (module docstring) of ``plan``. Prints the tables, writes OUT/capacity.json and
    OUT/p90_vs_devices.png; returns the document. ``plan.validate_sessions`` / ``plan.validate_modes``: the
    measured cells of ``plan.validate`` (the issue's 12 by default); ``plan.validate_only``: stop after the check
    (no sweep, no plot). ``dataset``: the Spec-Bench questions when the recipe names none."""
    from hycoc.bench.datasets import load_spec_bench
    from hycoc.bench.inputs import bench_bundle
    from hycoc.bench.loadtest.trace import load_trace
    from hycoc.bench.paper.runner import make_console

    console = make_console()
    bundle_dir = bench_bundle(cfg, recipe_path, plan.bundle, repo_root, command="capacity", say=console.print)
    questions = load_spec_bench(cfg.resolve_path(cfg.bench.dataset) or dataset)[: plan.prompts]
    with contextlib.ExitStack() as stack:  # the speed sampler's process stops however the run ends
        cost, speed, profile_window = _step_cost(
            stack, cfg, recipe_path, plan, bundle_dir, questions, repo_root, console
        )
        _print_cost(cost, speed, profile_window, console)
        doc: dict = {
            "schema": 1,
            "recipe": str(recipe_path),
            "kind": "simulation of this machine's verifier",
            "cost": cost.describe(),
            "target_p90_ms": plan.target_p90_ms,
            "link": None if plan.link is None else vars(plan.link),
            "replicas": plan.replicas,
            "device_scale": plan.device_scale,
            "duration_s": plan.duration_s,
            "machine": stamp(),
        }
        if plan.validate:
            from hycoc.bench.capacity.validate import validate_here

            doc["validation"] = validate_here(
                cfg,
                recipe_path,
                bundle_dir,
                questions,
                cost,
                plan.validate_duration_s,
                plan.out,
                repo_root,
                console,
                sessions=plan.validate_sessions,
                modes=plan.validate_modes,
                speed=speed,
                profile_window=profile_window,
            )
            if plan.validate_only:
                path = write_document(plan.out, doc)
                console.print(f"wrote {path}")
                return doc
        if plan.trace is not None:
            trace, trace_path = load_trace(plan.trace), plan.trace
            check_trace(trace, cfg, bundle_dir, trace_path)
        else:
            temperature = 0.0 if "budgeted" in plan.modes and cfg.sampling.temperature > 0 else None
            trace, trace_path = trace_for(
                cfg, bundle_dir, list(plan.configs), questions, temperature, repo_root, console
            )
        sweep, capacity, tried_all = _simulate(cfg, plan, cost, trace)
        _print_capacity(recipe_path, plan, cost, sweep, capacity, console)
        doc.update(trace=str(trace_path), sweep=sweep, capacity=capacity)
        path = write_document(plan.out, doc)
        plot = write_plot(sweep + tried_all, Path(plan.out) / "p90_vs_devices.png", plan.target_p90_ms)
        console.print(f"wrote {path}, {plot}")
        return doc


def _step_cost(
    stack, cfg, recipe_path: Path, plan: CapacityPlan, bundle_dir: Path, questions, repo_root: Path, console
):
    """What a verifier step costs: the ``plan.cost_model`` file's line, else the recipe's own verifier timed here
    replaying recorded hyco rounds (`hycoc.bench.capacity.measure.cached_step_cost`; again with --remeasure or
    --validate, whose speed sampler then runs in ``stack`` through the profile and every run). Returns (cost, the
    `SpeedSampler` or None, the profile's (start, end) epoch seconds or None)."""
    from hycoc.bench.capacity.cost import StepCost, model_step_cost
    from hycoc.bench.capacity.measure import cached_step_cost
    from hycoc.bench.cost_model.model import load_cost_model

    cost: StepCost
    if plan.cost_model is not None:
        cost = model_step_cost(
            load_cost_model(plan.cost_model), recipe_shape(cfg), cfg.tree.chain_length, path=str(plan.cost_model)
        )
        return cost, None, None
    console.print(
        "capacity: timing the verifier's steps on this machine, replaying recorded hyco rounds"
        + (" (again: --validate compares with runs made now)" if plan.validate else " (cached per recipe)")
    )
    hyco, hyco_path = trace_for(
        cfg, bundle_dir, ["hyco"], questions, 0.0 if cfg.sampling.temperature > 0 else None, repo_root, console
    )
    speed = None
    if (
        plan.validate
    ):  # the machine's speed sampled through the profile and every run (hycoc.bench.capacity.speed_probe)
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
        remeasure=plan.remeasure or plan.validate,
        replay=list(hyco.requests),
        log=lambda s: None,
        recipe_path=recipe_path,
        keep_set=bundle_dir / "keep_set.npy",
    )
    return cost, speed, (profile_t0, time.time())


def _print_cost(cost, speed, profile_window, console) -> None:
    """The step cost's label, its idle factor, the machine's speed while it was timed, the host work per round and
    the steps' spread."""
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


def _simulate(cfg, plan: CapacityPlan, cost, trace):
    """Every configuration x mode: the sweep over ``plan.counts`` devices and the capacity search. Returns (the
    sweep's rows, the capacity rows with their ratios to cloud-mtp, every run the searches tried)."""
    from hycoc.bench.loadtest.run import devices_for

    base = SimConfig(
        mode=plan.modes[0],
        devices=1,
        duration_s=plan.duration_s,
        replicas=plan.replicas,
        **host_terms(cost),
        link=plan.link,
        max_batch_rows=cfg.verifier.max_batch_rows,
        max_batch_wait_ms=cfg.verifier.max_batch_wait_ms,
        tree_rows=cfg.tree.node_budget + 1,
        chain_length=cfg.tree.chain_length,
    )
    sweep, capacity, tried_all = [], [], []
    for config in plan.configs:

        def make(n, config=config):
            return trace_workload(devices_for(trace, [config], n), device_scale=plan.device_scale)

        for mode in plan.modes:
            for n in plan.counts:
                row = run_point(make(n), replace(base, mode=mode, devices=n), cost)
                sweep.append(dict(row, config=config))
            row, tried = _capacity_rows(make, replace(base, mode=mode), cost, plan.target_p90_ms, config, mode)
            capacity.append(row)
            tried_all += tried
    add_ratios(capacity)
    return sweep, capacity, tried_all


def _print_capacity(recipe_path: Path, plan: CapacityPlan, cost, sweep: list, capacity: list, console) -> None:
    """The sweep's table, the capacity table and each capacity row's note (an unreachable target's reason)."""
    from hycoc.bench.tables import print_tables

    print_tables(
        [
            sweep_table(
                sweep,
                f"hycoc capacity {recipe_path}: simulated ({cost.label}), {plan.duration_s:g} s, "
                f"{plan.replicas} replica(s)",
            )
        ],
        console,
    )
    print_tables(
        [
            capacity_table(
                capacity,
                f"devices per verifier at verifier p90 <= {plan.target_p90_ms:g} ms ({plan.replicas} replica(s))",
            )
        ],
        console,
    )
    for r in capacity:
        if r.get("note"):
            console.print(r["note"], markup=False)


__all__ = [
    "TOLERANCE",
    "VALIDATE_MODES",
    "VALIDATE_SESSIONS",
    "SHAPE_KEYS",
    "UNCOMPARED_SHAPE_KEYS",
    "check_trace",
    "compared_shape",
    "recipe_shape",
    "run_capacity",
    "run_local",
    "trace_for",
    "write_document",
]
