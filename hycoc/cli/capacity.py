"""``hycoc capacity``: how many devices one verifier serves, from a discrete-event simulation checked against
measured load tests (docs/capacity.md). The command checks its options (`hycoc.bench.capacity.options`) and runs
them (`hycoc.bench.capacity.app.run_capacity`); the simulation library is imported inside the command body."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hycoc.cli._common import DEFAULT_DATASET, RECIPE_ARG, REPO_ROOT, _fail, _recipe
from hycoc.cli.options import unset

#: capacity's long options (`hycoc.cli.options`), in the order of its parameters.
P90Ms = Annotated[
    float,
    typer.Option(
        "--p90-ms",
        min=0.001,
        help="target: verifier round latency p90, ms "
        "(arrival at the verifier -> reply; drafting and the link's RTT excluded)",
    ),
]
Configs = Annotated[
    str | None,
    unset(
        "comma-separated configurations (paper Table 5, those with a verifier) (default: all seven; "
        "for a recipe whose models are not on this machine: hyco, hyco-exact, specedge, cloud-mtp)"
    ),
]
Batching = Annotated[
    str | None,
    unset(
        "comma-separated scheduler modes simulated: serial, batched, budgeted, allowance (default: serial,"
        "batched,budgeted here; for a recipe whose models are not on this machine batched,budgeted,allowance)"
    ),
]
Link = Annotated[
    str, typer.Option(help="link model: lte, 5g, none or RTT_MS:MBPS (the projection runs lte and 5g both)")
]
Replicas = Annotated[
    int,
    typer.Option(
        min=1,
        help="verifier replicas (sticky sessions, a new one to the replica with "
        "the fewest open sessions: Ray Serve's router with two)",
    ),
]
CostModel = Annotated[
    Path | None,
    unset(
        "cost-model JSON (benchmarks/verifier_cost_model.py; benchmarks/gpu_check.sh writes one on a "
        "GPU) (default: the recipe's own verifier timed here; for a recipe not on this machine the paper's GPU "
        "figures, labelled ASSUMED)"
    ),
]
AllowanceSweep = Annotated[
    str | None,
    unset(
        "projection only: also simulate every device drafting a FIXED row count, e.g. 5,6,9,13,17,25,33 (the "
        "check of what any allowance rule can reach; docs/capacity.md)"
    ),
]
Gpu = Annotated[
    str,
    typer.Option(
        help="the projection's GPU (hycoc/bench/capacity/gpu_cost.py GPU_SPECS: rtx-pro-6000, the paper's; h100; "
        "h200); ignored with --cost-model",
    ),
]
Validate = Annotated[
    bool,
    typer.Option(
        "--validate",
        help="also run hycoc loadtest (sessions 1,4,16,64 x serial, "
        "batched, budgeted) here and print predicted vs measured",
    ),
]
ValidateSessions = Annotated[
    str, typer.Option(help="session counts of the --validate cells (to re-run the cells that missed)")
]
ValidateModes = Annotated[str, typer.Option(help="batching modes of the --validate cells (comma-separated)")]
ValidateOnly = Annotated[
    bool,
    typer.Option("--validate-only", help="with --validate: stop after the check (no sweep, no capacity search)"),
]
RecordedBundle = Annotated[
    Path | None, unset("device bundle whose rounds are recorded (default: bundles/<recipe name>-cpu)")
]
Trace = Annotated[
    Path | None,
    unset("a loadtest trace file to replay instead of the cached one (must be this recipe's and bundle's)"),
]
Remeasure = Annotated[
    bool,
    typer.Option("--remeasure", help="time the verifier's steps again (cached per recipe in .hycoc-cache/capacity/)"),
]


def capacity(
    recipe: Path = RECIPE_ARG,
    p90_ms: P90Ms = 60.0,
    configs: Configs = None,
    batching: Batching = None,
    devices: str = typer.Option("1,4,16,64", help="device counts of the sweep table"),
    duration: float = typer.Option(30.0, min=1.0, help="simulated seconds per run"),
    link: Link = "none",
    replicas: Replicas = 1,
    cost_model: CostModel = None,
    device_scale: float = typer.Option(1.0, min=0.01, help="multiply every round's drafting time"),
    allowance_sweep: AllowanceSweep = None,
    gpu: Gpu = "rtx-pro-6000",
    validate: Validate = False,
    validate_duration: float = typer.Option(25.0, min=2.0, help="seconds per measured --validate run"),
    validate_sessions: ValidateSessions = "1,4,16,64",
    validate_modes: ValidateModes = "serial,batched,budgeted",
    validate_only: ValidateOnly = False,
    prompts: int = typer.Option(4, min=1, help="Spec-Bench questions recorded per configuration (as loadtest)"),
    bundle: RecordedBundle = None,
    trace: Trace = None,
    remeasure: Remeasure = False,
    out: Path = typer.Option(Path("runs/capacity"), help="folder for capacity.json and p90_vs_devices.png"),
) -> None:
    """Simulate N devices in closed loop against one verifier (or --replicas R) for every Table 5 configuration
    with a verifier: committed tok/s per device and in all, round latency p50/p90/p99, the verifier's busy share,
    and the largest N whose verifier p90 meets --p90-ms, against cloud-mtp. Writes OUT/capacity.json and
    OUT/p90_vs_devices.png. For a recipe whose models are not on this machine (recipes/gemma4.toml) it prints the
    real-shape projection, labelled, over LTE and 5G and drafting time x0.7 / x1.3: the verifier's forward priced
    from its config (MoE experts touched, KV, the GPU's bandwidth and compute) or a --cost-model file, trees fitted
    to the paper's MAT, batched / budgeted / the allowance as the server runs them (docs/capacity.md)."""
    from hycoc.bench.capacity.options import plan_capacity
    from hycoc.bench.capacity.requests import CapacityError
    from hycoc.bench.inputs import OptionError

    cfg = _recipe("capacity", recipe)
    try:
        plan = plan_capacity(
            cfg,
            recipe,
            configs=configs,
            batching=batching,
            devices=devices,
            link=link,
            gpu=gpu,
            allowance_sweep=allowance_sweep,
            validate_sessions=validate_sessions,
            validate_modes=validate_modes,
            cost_model=cost_model,
            validate=validate,
            target_p90_ms=p90_ms,
            duration_s=duration,
            replicas=replicas,
            device_scale=device_scale,
            out=out,
            validate_duration_s=validate_duration,
            validate_only=validate_only,
            prompts=prompts,
            bundle=bundle,
            trace=trace,
            remeasure=remeasure,
        )
    except OptionError as e:
        raise _fail("capacity", str(e), code=2) from None
    except CapacityError as e:
        raise _fail("capacity", str(e)) from None
    from hycoc.bench.capacity.app import run_capacity
    from hycoc.bench.capacity.cost import StepCostError
    from hycoc.bench.capacity.gpu_cost import GpuCostError
    from hycoc.bench.cost_model.model import CostModelError
    from hycoc.bench.loadtest.run import LoadTestError
    from hycoc.bench.loadtest.trace import TraceError

    try:
        run_capacity(cfg, recipe, plan, repo_root=REPO_ROOT, dataset=DEFAULT_DATASET)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (CapacityError, StepCostError, CostModelError, LoadTestError, TraceError, GpuCostError) as e:
        raise _fail("capacity", str(e)) from None
