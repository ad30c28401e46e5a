"""`hycoc capacity`'s options checked into a `CapacityPlan` (`plan_capacity`): which flow runs (the recipe's verifier
on this machine, or the real-shape projection), the configurations, scheduler modes and device counts, the link,
and the ``--validate`` cells. `hycoc.bench.capacity.app.run_capacity` runs the plan."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hycoc.bench.capacity.requests import CapacityError
from hycoc.bench.capacity.simulation import MODES
from hycoc.bench.inputs import OptionError
from hycoc.bench.loadtest.app import check_configs, parse_counts

if TYPE_CHECKING:
    from hycoc.runtime.transport import LinkModel


@dataclass(frozen=True)
class CapacityPlan:
    """What `hycoc capacity` runs, its options checked. local: the recipe's verifier is on this machine (the toy
    flow, `hycoc.bench.capacity.app.run_local`), else the projection (`hycoc.bench.capacity.projection`);
    configs, modes, counts: the configurations, scheduler modes and device counts simulated; target_p90_ms: the
    verifier round latency p90 a capacity must meet, ms; duration_s: simulated seconds per run; link: the link
    model (`hycoc.runtime.transport.parse_link`, None for none); replicas: verifier replicas; cost_model: a
    cost-model JSON or None; device_scale: the factor on every round's drafting time; out: the output folder;
    gpu: the projection's GPU; sweep_rows: the projection's fixed row counts (empty: no sweep); validate,
    validate_duration_s, validate_sessions, validate_modes, validate_only: the measured check (toy only);
    prompts: questions recorded per configuration; bundle, trace: a bundle and a trace file given (None: the
    default); remeasure: time the verifier's steps again."""

    local: bool
    configs: list[str]
    modes: list[str]
    counts: list[int]
    target_p90_ms: float
    duration_s: float
    link: LinkModel | None
    replicas: int
    cost_model: Path | None
    device_scale: float
    out: Path
    gpu: str
    sweep_rows: tuple[int, ...]
    validate: bool
    validate_duration_s: float
    validate_sessions: tuple[int, ...]
    validate_modes: tuple[str, ...]
    validate_only: bool
    prompts: int
    bundle: Path | None
    trace: Path | None
    remeasure: bool


def is_local(cfg) -> bool:
    """Whether the recipe's verifier is a folder on this machine (a hub id or a missing folder: the projection)."""
    return not cfg.is_hub_id("verifier") and (cfg.resolve_path(cfg.models.verifier) or Path("/nonexistent")).is_dir()


def _check_modes(recipe: Path, local: bool, batching: str | None) -> list[str]:
    """``--batching`` (default: serial, batched, budgeted here; batched, budgeted, allowance for the projection);
    allowance only for the projection. Raises OptionError."""
    modes = (batching or ("serial,batched,budgeted" if local else "batched,budgeted,allowance")).split(",")
    if any(m not in MODES for m in modes):
        raise OptionError(f"--batching {batching!r}: allowed: {', '.join(MODES)} (comma-separated)")
    if local and "allowance" in modes:
        raise OptionError(
            f"--batching allowance: {recipe} replays recorded trees, which cannot be redrafted to an allowance; "
            "measure it with `hycoc loadtest --batching allowance`, or project it on recipes/gemma4.toml"
        )
    return modes


def plan_capacity(
    cfg,
    recipe: Path,
    *,
    configs: str | None,
    batching: str | None,
    devices: str,
    link: str,
    gpu: str,
    allowance_sweep: str | None,
    validate_sessions: str,
    validate_modes: str,
    cost_model: Path | None,
    validate: bool,
    **given,
) -> CapacityPlan:
    """The plan of the command line's values, checked in the order a user fixes them: ``batching``, ``gpu``,
    ``devices``, ``allowance_sweep`` (the projection's), ``validate_sessions``, ``validate_modes``, ``configs``,
    ``link``, ``cost_model`` (a file), ``validate`` (the toy's). ``given``: the values passed through as they are
    (target_p90_ms, duration_s, replicas, device_scale, out, validate_duration_s, validate_only, prompts, bundle,
    trace, remeasure). Raises OptionError (a usage error), CapacityError (a --cost-model file that is not there)."""
    from hycoc.bench.capacity.app import VALIDATE_MODES
    from hycoc.bench.capacity.gpu_cost import GPU_SPECS
    from hycoc.bench.capacity.run import CONFIGS, PROJECTION_CONFIGS
    from hycoc.runtime.transport import parse_link

    local = is_local(cfg)
    modes = _check_modes(recipe, local, batching)
    if gpu not in GPU_SPECS:
        raise OptionError(f"--gpu {gpu!r}: allowed: {', '.join(GPU_SPECS)}")
    counts = parse_counts(devices, "--devices")
    sweep_rows = parse_counts(allowance_sweep, "--allowance-sweep") if allowance_sweep else []
    if sweep_rows and local:
        raise OptionError("--allowance-sweep: the projection's check (recipes/gemma4.toml), not the toy's")
    check_sessions = parse_counts(validate_sessions, "--validate-sessions")
    check_modes = validate_modes.split(",")
    if any(m not in VALIDATE_MODES for m in check_modes):
        raise OptionError(
            f"--validate-modes {validate_modes!r}: allowed: {', '.join(VALIDATE_MODES)} (comma-separated)"
        )
    chosen = check_configs(configs.split(",") if configs else list(CONFIGS if local else PROJECTION_CONFIGS), CONFIGS)
    try:
        link_model = parse_link(link)
    except ValueError as e:
        raise OptionError(f"--link: {e}") from None
    if cost_model is not None and not cost_model.is_file():
        raise CapacityError(
            f"--cost-model {cost_model}: no such file; make one with "
            "benchmarks/verifier_cost_model.py or leave the option out"
        )
    if validate and not local:
        raise OptionError(
            f"--validate runs hycoc loadtest on this machine, and {recipe}'s verifier "
            f"({cfg.models.verifier}) is not here: validate with recipes/toy.toml"
        )
    return CapacityPlan(
        local=local,
        configs=chosen,
        modes=modes,
        counts=counts,
        link=link_model,
        cost_model=cost_model,
        gpu=gpu,
        sweep_rows=tuple(sweep_rows),
        validate=validate,
        validate_sessions=tuple(check_sessions),
        validate_modes=tuple(check_modes),
        **given,
    )


__all__ = ["CapacityPlan", "is_local", "plan_capacity"]
