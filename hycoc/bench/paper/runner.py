"""`hycoc bench`: every configuration of Table 5 on the same prompts, verifier and seed, in one run (paper §4,
App. G; docs/benchmarks.md).

What runs where:

- the verifier is a separate process: ``hycoc verify-server RECIPE --port 0 --keep-set BUNDLE/keep_set.npy``
  (the keep set makes server-head sessions possible), started here and stopped at the end;
- the device side runs in this process: the bundle's graphs on onnxruntime (`hycoc.runtime.client.DeviceRuntime`),
  talking to the verifier over loopback through the real wire protocol, one connection per request;
- ``--link``: a link model applied to every frame (half the round trip + serialization at the link's bandwidth,
  `hycoc.runtime.transport.LinkModel`; lte 58 ms / 20 Mbit/s and 5g 40 ms / 50 Mbit/s are assumed figures bracketing
  the paper's 40-58 ms per round). The delays are **counted, not slept**: each request's delivery time and
  first-token latency get the link time added, so a bench on loopback reports what a phone would see without
  waiting for it. Server times (g) never include the link.

Order: for each run, for each question, every configuration in turn (interleaved, so load drift on a shared
machine spreads over all configurations). Each finished request is appended to ``OUT/records.jsonl`` at once;
an interrupted bench keeps them and ``--resume`` skips what is there. At the end: every answer's text quality
metrics (`score_quality`: repetition, and reference metrics where Spec-Bench has references), the verifier's mean
log-prob of every answer (its own likelihood of the text, labelled as such; the verifier loaded in this process
after the server stopped), the summary
(`hycoc.bench.paper.summary.summarize`), ``OUT/results.json`` (``summary`` + per-request ``records``), the plots and the
table.

Cost model (g projected): ``--cost-model FILE`` (e.g. made on a GPU by ``benchmarks/verifier_cost_model.py
--device cuda``), else one measured here on the recipe's verifier and this machine
(`hycoc.bench.cost_model.measure.measure_recipe_verifier`: busy CPU time of every forward, interleaved repetitions,
each kept), saved as ``OUT/cost_model.json`` and reused by ``--resume`` (``remeasure_cost_model`` redoes it); the
table says which. The projected Δg's interval resamples the cost model's repetitions with the questions.

Output: the tables at the console's width (`hycoc.bench.tables`; ``fmt`` markdown or csv for files), third-party
warnings in ``OUT/bench.log`` (`hycoc.quiet`).

This module runs the bench (`run_bench`) and prints its tables; the work is split by job:
`hycoc.bench.paper.request_loop` (the requests one after another, second turns), `hycoc.bench.verifier_process` (the
verify-server child process and its CPU time), `hycoc.bench.paper.records` (records.jsonl, settings.json, the output
folder, `BenchError`), `hycoc.bench.paper.scoring` (quality and the verifier's log-prob of each answer) and
`hycoc.bench.paper.turns` (the per-turn numbers and table).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from hycoc.bench.datasets import LONG_SUMMARY_CATEGORY, Question
from hycoc.bench.paper.records import (
    RESULTS,
    atomic_write,
    open_out,
    read_records,
)
from hycoc.bench.paper.request_loop import Request, RequestRun, requests_of, run_requests
from hycoc.bench.paper.scoring import score_answers, score_quality
from hycoc.bench.paper.turns import turn_summary, turns_table
from hycoc.table5 import TABLE5_ORDER

#: Table 5 order.
CONFIGS = TABLE5_ORDER


# ---- the run -----------------------------------------------------------------------------------------------------


@dataclass
class BenchPlan:
    """What `run_bench` does: questions, configurations, runs, link, output cap, where."""

    questions: list[Question]
    configs: list[str]
    runs: int
    link: str
    output_cap: int
    out: Path
    turns: int = 1  # 2: questions with a second turn (MT-bench) continue on the same session (paper §4.1)
    thinking: bool = False  # the template's enable_thinking (docs/recipes.md "Chat format": off, as the recipe runs)
    dataset: str = "Spec-Bench"  # what the questions are, for the table's title


@dataclass(frozen=True)
class JobSettings:
    """Where and how a paper job runs (`run_bench`, `hycoc.bench.paper.tune_epsilon.run_tune`; `hycoc bench` and
    `hycoc tune-epsilon`'s common options): ``bundle_dir`` the bundle folder, ``backend`` its backend ("cpu" or
    "htp"), ``resume`` continue ``OUT/records.jsonl`` (``--resume``), ``cost_model_path`` a cost model JSON to project
    g through (None: measure one, ``--cost-model``), ``console`` where the tables go (None: stdout's), ``threads``
    onnxruntime threads per device graph."""

    bundle_dir: Path
    backend: str = "cpu"
    resume: bool = False
    cost_model_path: Path | None = None
    console: Any = None
    threads: int = 1


def run_bench(
    recipe,
    recipe_path: Path,
    plan: BenchPlan,
    job: JobSettings,
    *,
    device_profile_path: Path | None = None,
    remeasure_cost_model: bool = False,
    fmt: str = "table",
) -> dict:
    """Run the bench (module docstring) where and as ``job`` says; returns the results dict written to
    ``OUT/results.json``.

    remeasure_cost_model: measure the cost model again even when ``OUT/cost_model.json`` exists (`cost_model_for`).
    fmt: how the tables are printed (`hycoc.bench.tables.FORMATS`: table, markdown, csv). Third-party warnings
    (torch, transformers, onnxruntime) go to ``OUT/bench.log`` (`hycoc.quiet.third_party_output`).

    Raises BenchError (server, bundle), BundleError, TransportError from a request that fails for a reason other
    than the request itself; KeyboardInterrupt leaves ``records.jsonl`` for ``--resume``.
    """
    from hycoc.quiet import third_party_output

    job = replace(job, console=make_console(job.console))
    plan.out.mkdir(parents=True, exist_ok=True)
    with third_party_output(plan.out / "bench.log", console=job.console):
        return _run_bench(recipe, recipe_path, plan, job, remeasure_cost_model, fmt, device_profile_path)


def _run_bench(
    recipe,
    recipe_path: Path,
    plan: BenchPlan,
    job: JobSettings,
    remeasure_cost_model: bool,
    fmt: str,
    device_profile_path: Path | None,
) -> dict:
    from hycoc.bench.paper.plots import write_plots
    from hycoc.bench.paper.summary import summarize
    from hycoc.runtime.client import load_runtime

    console, bundle_dir, backend = job.console, job.bundle_dir, job.backend
    out = plan.out
    done = open_out(out, run_settings(recipe, plan, bundle_dir, backend), job.resume)
    rt = load_runtime(bundle_dir, backend, threads=job.threads)
    if rt.bundle.manifest.recipe.sha256 != recipe.content_hash():
        console.print(
            f"[yellow]note: bundle {bundle_dir} was built from another version of recipe "
            f"{rt.bundle.manifest.recipe.name!r}; its round constants are the bundle's, sampling and ε "
            "the recipe's[/]"
        )
    # each first turn as the template renders a one-message conversation (ids, and where its model turn opens)
    rendered = {
        q.question_id: rt.bundle.chat.conversation([{"role": "user", "content": q.turns[0]}], plan.thinking)
        for q in plan.questions
    }
    prompts = {qid: r.ids for qid, r in rendered.items()}
    r = rt.bundle.round
    sampling = recipe.sampling.distribution
    epsilon = recipe.acceptance.epsilon  # the recipe's, like its sampling: `hycoc tune-epsilon` writes it there
    todo = _announce(plan, done, epsilon, sampling.temperature, backend, console)
    how = {"turns": plan.turns, "thinking": plan.thinking, "anchors": {q: x.anchor for q, x in rendered.items()}}
    run = RequestRun.for_plan(plan, recipe_path, bundle_dir, prompts, sampling=sampling, seed=r.seed, **how)
    run_requests(rt, todo, run, console)

    records = [
        rec
        for rec in read_records(run.records_path)
        if rec["config"] in plan.configs and rec["question_id"] in prompts and rec["run"] < plan.runs
    ]
    turns = turn_summary(records)
    score_quality(records, {q.question_id: q for q in plan.questions})
    console.print("scoring answers with the verifier (its own log-prob of each answer) ...")
    score_answers(recipe, records, prompts)
    cost, cost_note = cost_model_for(recipe, records, job.cost_model_path, out, console, remeasure=remeasure_cost_model)
    summary = summarize(records, cost_model=cost, server=server_work(recipe))
    results: dict[str, Any] = {
        "meta": _results_meta(recipe_path, plan, bundle_dir, backend, sampling, cost, cost_note),
        "summary": summary,
        "turns": turns,
        "device_time": device_time_for(records, bundle_dir, device_profile_path, console),
        "records": records,
    }
    atomic_write(out / RESULTS, json.dumps(results, indent=1))
    plots = write_plots(summary, out)
    if any(q.category == LONG_SUMMARY_CATEGORY for q in plan.questions):
        from hycoc.bench.paper.long_context import long_context_rows

        results["long_context"] = long_context_rows(records, summary, r.slm_window)
        atomic_write(out / RESULTS, json.dumps(results, indent=1))
    print_results(results, console, fmt, plots=plots, out=out)
    if results.get("long_context") is not None:
        from hycoc.bench.paper.long_context import render_long_context

        render_long_context(
            results["long_context"],
            console,
            title=f"long documents: first reply (hand-off of up to W = {r.head_window} positions) "
            f"and the device's SLM ring prefill (last {r.slm_window} prompt tokens)",
            fmt=fmt,
        )
    return results


def _announce(plan: BenchPlan, done, epsilon: float, temperature: float, backend: str, console) -> list[Request]:
    """The requests of ``plan`` still to run (every run x question x configuration, in that order, less the
    (config, run, question_id) of ``done``), each at ``epsilon``, after printing what the bench runs: the counts,
    the output cap, the temperature and ε, the link and the backend."""
    every = [Request(c, c, epsilon, run, q) for run in range(plan.runs) for q in plan.questions for c in plan.configs]
    todo = [req for req in every if (req.config, req.run, req.question.question_id) not in done]
    turns_note = (
        "turns: 2 per question, slm-alone first turns only"
        if plan.turns > 1 and "slm-alone" in plan.configs
        else "turns"
        if plan.turns > 1
        else "first turns"
    )
    console.print(
        f"bench: {len(plan.questions)} questions x {len(plan.configs)} configurations x {plan.runs} run(s) "
        f"= {requests_of(every, plan.turns)} requests ({turns_note}; {requests_of(todo, plan.turns)} to "
        "run), "
        f"output cap {plan.output_cap}, T={temperature}, ε={epsilon:g}, link {plan.link} (counted, "
        f"not slept), backend {backend}"
    )
    return todo


def _results_meta(
    recipe_path: Path, plan: BenchPlan, bundle_dir: Path, backend: str, sampling, cost, cost_note: str
) -> dict:
    """``results.json``'s ``meta``: what ran (recipe, bundle, backend, questions, configurations, runs, link, output
    cap, temperature), the cost model (its note and points), the machine and the date."""
    return {
        "recipe": str(recipe_path),
        "bundle": str(bundle_dir),
        "backend": backend,
        "questions": len(plan.questions),
        "dataset": plan.dataset,
        "configs": plan.configs,
        "runs": plan.runs,
        "link": plan.link,
        "link_applied": "counted, not slept",
        "output_cap": plan.output_cap,
        "temperature": sampling.temperature,
        "cost_model": cost_note,
        "cost_model_points": [p.model_dump() for p in cost.points],
        "machine": f"{os.cpu_count()} CPUs",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


def result_tables(results: dict) -> list:
    """The tables of a bench's ``results.json`` (`hycoc.bench.tables.TextTable`): main, quality, per category,
    server ms per round (with a projection), per turn (with second turns)."""
    from hycoc.bench.paper.report_tables import categories_table, main_table, quality_table, rounds_table

    meta, summary = results["meta"], results["summary"]
    tables = [
        main_table(
            summary,
            title=f"hycoc bench: {meta['questions']} {meta.get('dataset', 'Spec-Bench')} "
            f"questions, link {meta['link']}",
        ),
        quality_table(summary),
        categories_table(summary),
        rounds_table(summary),
    ]
    if any(t != "1" for by_turn in (results.get("turns") or {}).values() for t in by_turn):
        tables.append(turns_table(results["turns"]))
    return [t for t in tables if t is not None]


def print_results(results: dict, console, fmt: str = "table", *, plots=(), out: Path | None = None) -> None:
    """Print a bench's tables (`result_tables`) in ``fmt`` and the notes under them (what g and g projected are,
    where the files are); in csv the notes are ``#`` lines."""
    from hycoc.bench.tables import print_tables

    print_tables(result_tables(results), console, fmt)
    if (results.get("device_time") or {}).get("configs"):
        from hycoc.bench.paper.device_profile import render_device_table

        render_device_table(results["device_time"]["configs"], results["device_time"]["source"], console, fmt)
    notes = [
        f"g = verifier ms per output token measured on this machine (prefill included); "
        f"{results['meta']['cost_model']}, every server forward (prefill, verification, server-side head "
        "steps). Delivery and first-token times include the link model."
    ]
    if out is not None:
        notes.append(f"wrote {out / RESULTS}" + "".join(f", {p}" for p in plots))
    for note in notes:
        console.print(f"# {note}" if fmt == "csv" else note, markup=False, highlight=False)


def device_time_for(records: list[dict], bundle_dir: Path, device_profile_path: Path | None, console) -> dict:
    """``results["device_time"]``: the phone's time per round and delivery tok/s per configuration
    (`hycoc.bench.paper.device_profile.project_records`) from ``--device-profile``, else from the labelled estimate
    (`hycoc.device_time`), which the console is told. {"source", "estimated", "configs"}; "error" instead of
    "configs" when the bundle's graphs cannot be priced."""
    from hycoc.bench.paper.device_profile import (
        DeviceProfileError,
        estimated_device_costs,
        load_device_costs,
        project_records,
    )

    try:
        if device_profile_path is not None:
            costs, label = load_device_costs(device_profile_path)
        else:
            costs, label = estimated_device_costs(bundle_dir)
            console.print(
                "device time: no --device-profile given, so the phone's graph times are an ESTIMATE "
                f"(hycoc/device_time.py, {label.rsplit(', ', 1)[-1]}), not a measurement"
            )
        return {"source": label, "estimated": device_profile_path is None, "configs": project_records(records, costs)}
    except (DeviceProfileError, ValueError, OSError) as e:
        console.print(f"[yellow]device time: not reported ({e})[/]")
        return {"source": None, "estimated": device_profile_path is None, "error": str(e)}


def make_console(console=None):
    """The given rich Console, else `hycoc.bench.tables.report_console`'s: as wide as the terminal (at least 80),
    or when stdout is redirected ``COLUMNS`` if set, else 120, and then with no line of text wrapped."""
    from hycoc.bench.tables import report_console

    return report_console(console)


#: The cost model a bench measured, in its output folder; `cost_model_for` reuses it on --resume.
COST_MODEL = "cost_model.json"


def cost_model_for(
    recipe, records: list[dict], cost_model_path: Path | None, out: Path, console, remeasure: bool = False
):
    """The cost model of g projected and a sentence saying where it came from: ``cost_model_path`` loaded
    (`hycoc.bench.cost_model.model.load_cost_model`); else ``OUT/cost_model.json`` that an earlier bench in ``out``
    measured (so a ``--resume`` projects through the same model and leaves the summary as it was), unless
    ``remeasure``; else measured here on the recipe's verifier at contexts covering the records'
    (`hycoc.bench.cost_model.measure.measure_recipe_verifier`: busy CPU time of each forward, interleaved repetitions)
    and saved as ``OUT/cost_model.json``. Raises CostModelError for a bad file."""
    from hycoc.bench.cost_model.model import load_cost_model

    if cost_model_path is not None:
        cost = load_cost_model(cost_model_path)
        return cost, f"g projected through {cost_model_path} ({cost.device}, {cost.model})"
    saved = out / COST_MODEL
    if saved.is_file() and not remeasure:
        cost = load_cost_model(saved)
        when = cost.meta.get("date", "earlier")
        return cost, (
            f"g projected through the cost model measured here on {when} ({cost.device}, {cost.dtype}), "
            f"reused from {saved} (--remeasure-cost-model to redo it)"
        )
    from hycoc.bench.cost_model.measure import measure_recipe_verifier

    console.print("measuring the verifier cost model on this machine (no --cost-model given) ...")
    longest = max((max(x["context"], default=0) for x in records), default=64)
    cost = measure_recipe_verifier(recipe, contexts=sorted({64, 128, 256, 512, max(64, int(longest))}))
    cost.save(saved)
    return cost, (
        f"g projected through a cost model measured here ({cost.device}, {cost.dtype}, "
        f"{cost.meta.get('clock', 'wall')}, {cost.meta.get('statistic', 'median')} of "
        f"{cost.meta.get('repeats')} repetitions, load "
        f"{cost.meta.get('loadavg_before')}): {saved}"
    )


def server_work(recipe) -> dict[str, int]:
    """What the cost-model replay needs to know of the server (`hycoc.bench.cost_model.model.request_forwards`): the
    recipe's K (``[tree] chain_length``, the server head's chain) and W (``[window] head_window``, its window)."""
    return {"chain_length": recipe.tree.chain_length, "head_window": recipe.window.head_window}


def run_settings(recipe, plan: BenchPlan, bundle_dir: Path, backend: str) -> dict:
    """What makes two benches' records comparable; ``--resume`` refuses to mix records made with other values."""
    before, after = {"link": plan.link}, {"turns": plan.turns, "thinking": plan.thinking}
    return comparable_settings(recipe, bundle_dir, backend, plan.output_cap, recipe.sampling.temperature, before, after)


def comparable_settings(
    recipe, bundle_dir: Path, backend: str, output_cap: int, temperature: float, before: dict, after: dict
) -> dict:
    """The ``settings.json`` of a bench or an ε sweep (`run_settings`, `hycoc.bench.paper.tune_epsilon.tune_settings`):
    the recipe's and the bundle manifest's sha256, the backend, the output cap, ``before``, the temperature, the
    recipe's top-k, top-p and seed, then ``after`` (the keys in this order, as ``settings.json`` writes them)."""
    from hycoc.bundle import sha256_file

    s = recipe.sampling
    return {
        "recipe_sha256": recipe.content_hash(),
        "bundle_manifest_sha256": sha256_file(bundle_dir / "manifest.json"),
        "backend": backend,
        "output_cap": output_cap,
        **before,
        "temperature": temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "seed": s.seed,
        **after,
    }


def default_bundle_dir(recipe, repo_root: Path) -> Path:
    """Where `hycoc bench` keeps the recipe's cpu bundle when ``--bundle`` is not given."""
    return repo_root / "bundles" / f"{recipe.recipe.name}-cpu"


__all__ = [
    "JobSettings",
    "CONFIGS",
    "BenchPlan",
    "cost_model_for",
    "default_bundle_dir",
    "make_console",
    "print_results",
    "result_tables",
    "run_bench",
    "server_work",
    "COST_MODEL",
    "device_time_for",
    "run_settings",
    "comparable_settings",
]
