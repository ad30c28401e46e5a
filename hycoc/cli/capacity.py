"""``hycoc capacity``: how many devices one verifier serves, from a discrete-event simulation checked against
measured load tests (docs/capacity.md). The simulation library is imported inside the command body."""

from __future__ import annotations

from pathlib import Path

import typer

from hycoc.cli._common import DEFAULT_DATASET, RECIPE_ARG, REPO_ROOT, _fail, _recipe


def _counts(text: str, option: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise _fail("capacity", f"{option} {text!r}: give comma-separated positive integers such as 1,4,16,64", code=2)
    return out


def capacity(
    recipe: Path = RECIPE_ARG,
    p90_ms: float = typer.Option(
        60.0,
        "--p90-ms",
        min=0.001,
        help="target: verifier round latency p90, ms "
        "(arrival at the verifier -> reply; drafting and the link's RTT excluded)",
    ),
    configs: str | None = typer.Option(
        None,
        help="comma-separated configurations (paper Table 5, those with a verifier) (default: all seven; "
        "for a recipe whose models are not on this machine: hyco, hyco-exact, specedge, cloud-mtp)",
        show_default=False,
    ),
    batching: str | None = typer.Option(
        None,
        help="comma-separated scheduler modes simulated: serial, batched, budgeted, allowance (default: serial,"
        "batched,budgeted here; for a recipe whose models are not on this machine batched,budgeted,allowance)",
        show_default=False,
    ),
    devices: str = typer.Option("1,4,16,64", help="device counts of the sweep table"),
    duration: float = typer.Option(30.0, min=1.0, help="simulated seconds per run"),
    link: str = typer.Option(
        "none", help="link model: lte, 5g, none or RTT_MS:MBPS (the projection runs lte and 5g both)"
    ),
    replicas: int = typer.Option(
        1,
        min=1,
        help="verifier replicas (sticky sessions, a new one to the replica with "
        "the fewest open sessions: Ray Serve's router with two)",
    ),
    cost_model: Path | None = typer.Option(
        None,
        help="cost-model JSON (benchmarks/verifier_cost_model.py; benchmarks/gpu_check.sh writes one on a "
        "GPU) (default: the recipe's own verifier timed here; for a recipe not on this machine the paper's GPU "
        "figures, labelled ASSUMED)",
        show_default=False,
    ),
    device_scale: float = typer.Option(1.0, min=0.01, help="multiply every round's drafting time"),
    allowance_sweep: str | None = typer.Option(
        None,
        help="projection only: also simulate every device drafting a FIXED row count, e.g. 5,6,9,13,17,25,33 (the "
        "check of what any allowance rule can reach; docs/capacity.md)",
        show_default=False,
    ),
    gpu: str = typer.Option(
        "rtx-pro-6000",
        help="the projection's GPU (hycoc/bench/capacity/gpu_cost.py GPU_SPECS: rtx-pro-6000, the paper's; h100; "
        "h200); ignored with --cost-model",
    ),
    validate: bool = typer.Option(
        False,
        "--validate",
        help="also run hycoc loadtest (sessions 1,4,16,64 x serial, "
        "batched, budgeted) here and print predicted vs measured",
    ),
    validate_duration: float = typer.Option(25.0, min=2.0, help="seconds per measured --validate run"),
    validate_sessions: str = typer.Option(
        "1,4,16,64", help="session counts of the --validate cells (to re-run the cells that missed)"
    ),
    validate_modes: str = typer.Option(
        "serial,batched,budgeted", help="batching modes of the --validate cells (comma-separated)"
    ),
    validate_only: bool = typer.Option(
        False, "--validate-only", help="with --validate: stop after the check (no sweep, no capacity search)"
    ),
    prompts: int = typer.Option(4, min=1, help="Spec-Bench questions recorded per configuration (as loadtest)"),
    bundle: Path | None = typer.Option(
        None, help="device bundle whose rounds are recorded (default: bundles/<recipe name>-cpu)", show_default=False
    ),
    trace: Path | None = typer.Option(
        None,
        help="a loadtest trace file to replay instead of the cached one (must be this recipe's and bundle's)",
        show_default=False,
    ),
    remeasure: bool = typer.Option(
        False, "--remeasure", help="time the verifier's steps again (cached per recipe in .hycoc-cache/capacity/)"
    ),
    out: Path = typer.Option(Path("runs/capacity"), help="folder for capacity.json and p90_vs_devices.png"),
) -> None:
    """Simulate N devices in closed loop against one verifier (or --replicas R) for every Table 5 configuration
    with a verifier: committed tok/s per device and in all, round latency p50/p90/p99, the verifier's busy share,
    and the largest N whose verifier p90 meets --p90-ms, against cloud-mtp. Writes OUT/capacity.json and
    OUT/p90_vs_devices.png. For a recipe whose models are not on this machine (recipes/gemma4.toml) it prints the
    real-shape projection, labelled, over LTE and 5G and drafting time x0.7 / x1.3: the verifier's forward priced
    from its config (MoE experts touched, KV, the GPU's bandwidth and compute) or a --cost-model file, trees fitted
    to the paper's MAT, batched / budgeted / the allowance as the server runs them (docs/capacity.md)."""
    from hycoc.bench.capacity.app import VALIDATE_MODES
    from hycoc.bench.capacity.gpu_cost import GPU_SPECS
    from hycoc.bench.capacity.simulation import MODES, CapacityError

    cfg = _recipe("capacity", recipe)
    local = not cfg.is_hub_id("verifier") and (cfg.resolve_path(cfg.models.verifier) or Path("/nonexistent")).is_dir()
    modes = (batching or ("serial,batched,budgeted" if local else "batched,budgeted,allowance")).split(",")
    if any(m not in MODES for m in modes):
        raise _fail("capacity", f"--batching {batching!r}: allowed: {', '.join(MODES)} (comma-separated)", code=2)
    if local and "allowance" in modes:
        raise _fail(
            "capacity",
            f"--batching allowance: {recipe} replays recorded trees, which cannot be redrafted to an allowance; "
            "measure it with `hycoc loadtest --batching allowance`, or project it on recipes/gemma4.toml",
            code=2,
        )
    if gpu not in GPU_SPECS:
        raise _fail("capacity", f"--gpu {gpu!r}: allowed: {', '.join(GPU_SPECS)}", code=2)
    counts = _counts(devices, "--devices")
    sweep_rows = _counts(allowance_sweep, "--allowance-sweep") if allowance_sweep else []
    if sweep_rows and local:
        raise _fail(
            "capacity", "--allowance-sweep: the projection's check (recipes/gemma4.toml), not the toy's", code=2
        )
    check_sessions = _counts(validate_sessions, "--validate-sessions")
    check_modes = validate_modes.split(",")
    if any(m not in VALIDATE_MODES for m in check_modes):
        raise _fail(
            "capacity",
            f"--validate-modes {validate_modes!r}: allowed: {', '.join(VALIDATE_MODES)} (comma-separated)",
            code=2,
        )
    from hycoc.bench.capacity.run import CONFIGS, PROJECTION_CONFIGS

    chosen = configs.split(",") if configs else list(CONFIGS if local else PROJECTION_CONFIGS)
    unknown = [c for c in chosen if c not in CONFIGS]
    if unknown:
        raise _fail(
            "capacity",
            f"--configs: unknown or without a verifier: {', '.join(unknown)}; allowed: {', '.join(CONFIGS)}",
            code=2,
        )
    from hycoc.runtime.transport import parse_link

    try:
        link_model = parse_link(link)
    except ValueError as e:
        raise _fail("capacity", f"--link: {e}", code=2) from None
    if cost_model is not None and not cost_model.is_file():
        raise _fail(
            "capacity",
            f"--cost-model {cost_model}: no such file; make one with "
            "benchmarks/verifier_cost_model.py or leave the option out",
        )
    if validate and not local:
        raise _fail(
            "capacity",
            f"--validate runs hycoc loadtest on this machine, and {recipe}'s verifier "
            f"({cfg.models.verifier}) is not here: validate with recipes/toy.toml",
            code=2,
        )
    from hycoc.bench.capacity.app import run_local
    from hycoc.bench.capacity.cost import StepCostError
    from hycoc.bench.capacity.gpu_cost import GpuCostError
    from hycoc.bench.capacity.projection import run_projection
    from hycoc.bench.cost_model.model import CostModelError
    from hycoc.bench.loadtest.run import LoadTestError
    from hycoc.bench.loadtest.trace import TraceError

    try:
        if local:
            run_local(
                cfg,
                recipe,
                chosen,
                modes,
                counts,
                p90_ms,
                duration,
                link_model,
                replicas,
                cost_model,
                device_scale,
                out,
                validate=validate,
                validate_duration=validate_duration,
                prompts=prompts,
                bundle=bundle,
                trace_path=trace,
                remeasure=remeasure,
                repo_root=REPO_ROOT,
                dataset=DEFAULT_DATASET,
                validate_sessions=tuple(check_sessions),
                validate_modes=tuple(check_modes),
                validate_only=validate_only,
            )
        else:
            run_projection(
                cfg,
                recipe,
                chosen,
                modes,
                p90_ms,
                duration,
                replicas,
                cost_model,
                device_scale,
                out,
                gpu=gpu,
                sweep_rows=tuple(sweep_rows),
            )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (CapacityError, StepCostError, CostModelError, LoadTestError, TraceError, GpuCostError) as e:
        raise _fail("capacity", str(e)) from None
