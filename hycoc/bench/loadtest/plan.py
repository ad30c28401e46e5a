"""What a load test runs (`LoadTestRun`, `hycoc.bench.loadtest.run.run_loadtest`'s parameter object) and what
`hycoc loadtest` plans (`LoadTestPlan`: the run plus what the recording needs; `hycoc.bench.loadtest.app`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class LoadTestRun:
    """What `run_loadtest` runs. configs: the configurations the devices replay; sessions: the session counts, one
    run each; modes: the --batching entries (MODE or MODE:CONFIG; None: the default, or whatever a running server
    reports); duration_s: seconds per run; out: the results folder; server: a running verifier's URL (None: one
    started per mode); rate: session arrivals per second (None: all at once); device_ms: a fixed drafting time per
    round, ms (None: the recorded); warmup_s: seconds each server first serves one device, not measured."""

    configs: list[str]
    sessions: list[int]
    modes: list[str] | None
    duration_s: float
    out: Path
    server: str | None = None
    rate: float | None = None
    device_ms: float | None = None
    warmup_s: float = 2.0


@dataclass(frozen=True)
class LoadTestPlan(LoadTestRun):
    """What `hycoc loadtest` runs, its options checked (`hycoc.bench.loadtest.app.plan_loadtest`): the `LoadTestRun`
    and what the recording needs. recorded: every configuration recorded (configs, then each MODE:CONFIG's own);
    max_new_tokens: the recorded requests' output cap (None: the recipe's bench.output_cap); temperature: theirs
    (None: the recipe's)."""

    recorded: list[str] = field(default_factory=list)
    max_new_tokens: int | None = None
    temperature: float | None = None


__all__ = ["LoadTestPlan", "LoadTestRun"]
