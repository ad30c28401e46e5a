"""`hycoc loadtest`'s flow on a recipe: its options checked into a `LoadTestPlan` (`plan_loadtest`), the rounds the
real device runtime records cached by what they depend on (`cached_trace`, which `hycoc capacity` shares), then
every run (`hycoc.bench.loadtest.run.run_loadtest`). Imports nothing heavy at module level."""

from __future__ import annotations

import sys
from pathlib import Path

from hycoc.bench.inputs import OptionError
from hycoc.bench.loadtest.plan import LoadTestPlan
from hycoc.ports import ws_url_problem
from hycoc.serving_limits import SCORED_MODES, SERVER_MODES
from hycoc.table5 import WITH_VERIFIER

#: Configurations a load test can record and replay (a verifier in every round: not slm-alone).
CONFIGS = WITH_VERIFIER
#: ``--batching`` values (`hycoc.serving_limits.SERVER_MODES`: serial, batched, budgeted, allowance).
BATCHING = tuple(SERVER_MODES)


def parse_counts(text: str, option: str) -> list[int]:
    """A comma-separated list of positive integers such as ``1,4,16,64`` (``--sessions``, ``--devices``). Raises
    `OptionError` naming ``option`` and the value."""
    try:
        out = [int(x) for x in text.split(",")]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise OptionError(f"{option} {text!r}: give comma-separated positive integers such as 1,4,16,64")
    return out


def check_configs(chosen: list[str], allowed: tuple[str, ...]) -> list[str]:
    """``--configs`` as given, every one in ``allowed`` (configurations with a verifier). Raises `OptionError`
    naming the others and every allowed name."""
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        raise OptionError(
            f"--configs: unknown or without a verifier: {', '.join(unknown)}; allowed: {', '.join(allowed)}"
        )
    return chosen


def plan_loadtest(
    *,
    sessions: str,
    configs: str,
    batching: str | None,
    server: str | None,
    duration_s: float,
    out: Path,
    rate: float | None = None,
    device_ms: float | None = None,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
) -> LoadTestPlan:
    """The plan of the command line's values, checked in this order: ``sessions`` (`parse_counts`), ``configs``
    (`CONFIGS`), ``batching`` (`BATCHING` entries, each optionally MODE:CONFIG), one mode with ``server``,
    ``server``'s URL (`hycoc.ports.ws_url_problem`). Raises `OptionError` (a usage error) naming the option."""
    counts = parse_counts(sessions, "--sessions")
    chosen = check_configs(configs.split(","), CONFIGS)
    modes = batching.split(",") if batching else None
    parts = [m.partition(":") for m in modes or []]  # MODE or MODE:CONFIG (that server's devices replay CONFIG)
    if any(m not in BATCHING or (sep and c not in CONFIGS) for m, sep, c in parts):
        raise OptionError(
            f"--batching {batching!r}: allowed: {', '.join(BATCHING)} (comma-separated), each optionally "
            f"as MODE:CONFIG with CONFIG one of {', '.join(CONFIGS)}"
        )
    recorded = chosen + [c for _, sep, c in parts if sep and c not in chosen]  # MODE:CONFIG's configs recorded too
    if server is not None and modes is not None and len(modes) != 1:
        raise OptionError(
            f"--batching {batching!r} with --server: a running server has one mode; give that "
            "one, or leave --server out so each mode gets its own server"
        )
    if server is not None and (problem := ws_url_problem(server)) is not None:
        raise OptionError(f"--server {server!r}: {problem}")
    return LoadTestPlan(
        configs=chosen,
        sessions=counts,
        modes=modes,
        duration_s=duration_s,
        out=out,
        server=server,
        rate=rate,
        device_ms=device_ms,
        recorded=recorded,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
    )


def cached_trace(cfg, bundle_dir: Path, configs: list[str], questions, cap: int, temperature, repo_root: Path):
    """The recorded rounds of ``configs`` on ``questions`` (output cap ``cap``, sampling ``temperature``; None: the
    recipe's): the cache file under ``repo_root/.hycoc-cache/loadtest/`` named by what they depend on
    (`hycoc.bench.loadtest.trace.trace_key`: recipe, bundle manifest, configurations, questions, cap, a temperature
    other than the recipe's), or a new recording (a progress line per request) saved there. Returns (trace, its
    file, whether it was recorded now)."""
    from hycoc import progress
    from hycoc.bench.loadtest.trace import load_trace, record_trace, save_trace, trace_key
    from hycoc.bundle import sha256_file

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
        return load_trace(path), path, False
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
    return trace, path, True


def _note(line: str) -> None:
    """A ``hycoc loadtest:`` line on stderr."""
    sys.stderr.write(f"hycoc loadtest: {line}\n")
    sys.stderr.flush()


def run_recipe(cfg, recipe: Path, bundle_dir: Path, questions, plan: LoadTestPlan, cost, repo_root: Path) -> dict:
    """Record (or reuse) ``bundle_dir``'s rounds on ``questions`` for every configuration of ``plan`` and run the
    load test (`run_loadtest`), its servers started from ``recipe`` unless ``plan.server``; ``cost``: a cost
    model for the GPU projection, or None. A mode that trims trees by score (budgeted, allowance) at a recipe
    temperature above 0 records and replays at temperature 0 unless ``plan.temperature`` says (a line on stderr
    says why). Returns the results document. Raises LoadTestError, TraceError, BundleError, TransportError."""
    from hycoc.bench.inputs import display_path
    from hycoc.bench.loadtest.run import run_loadtest

    cap = plan.max_new_tokens or cfg.bench.output_cap
    temperature = plan.temperature
    asked = {m.partition(":")[0] for m in plan.modes or []}
    if temperature is None and asked & set(SCORED_MODES) and cfg.sampling.temperature > 0:
        temperature = 0.0
        _note(
            f"every mode runs at temperature 0 (the recipe's: {cfg.sampling.temperature:g}):"
            "\n  budgeted and allowance rounds commit less than the recorded ones, and only greedy text"
            "\n  stays the recording's, so its trees still fit (--temperature to choose)"
        )
    trace, trace_path, recorded = cached_trace(cfg, bundle_dir, plan.recorded, questions, cap, temperature, repo_root)
    if recorded:
        _note(
            f"recorded {len(trace.requests)} requests, "
            f"{sum(len(r.rounds) for r in trace.requests)} rounds ->\n  {display_path(trace_path)}"
        )
    else:
        _note(f"recorded rounds from\n  {display_path(trace_path)}")
    return run_loadtest(
        trace,
        plan,
        recipe_path=recipe,
        keep_set=bundle_dir / "keep_set.npy",
        cost_model=cost,
        meta={
            "recipe": str(recipe),
            "bundle": str(bundle_dir),
            "trace": str(trace_path),
            "temperature": cfg.sampling.temperature if temperature is None else temperature,
        },
    )


__all__ = [
    "BATCHING",
    "CONFIGS",
    "LoadTestPlan",
    "cached_trace",
    "check_configs",
    "parse_counts",
    "plan_loadtest",
    "run_recipe",
]
