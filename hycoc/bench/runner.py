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
(`hycoc.bench.summary.summarize`), ``OUT/results.json`` (``summary`` + per-request ``records``), the plots and the
table.

Cost model (g projected): ``--cost-model FILE`` (e.g. made on a GPU by ``benchmarks/verifier_cost_model.py
--device cuda``), else one measured here on the recipe's verifier and this machine
(`hycoc.bench.cost_measure.measure_recipe_verifier`: busy CPU time of every forward, interleaved repetitions,
each kept), saved as ``OUT/cost_model.json`` and reused by ``--resume`` (``remeasure_cost_model`` redoes it); the
table says which. The projected Δg's interval resamples the cost model's repetitions with the questions.

Output: the tables at the console's width (`hycoc.bench.tables`; ``fmt`` markdown or csv for files), third-party
warnings in ``OUT/bench.log`` (`hycoc.quiet`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hycoc.bench.datasets import LONG_SUMMARY_CATEGORY, Question
from hycoc.table5 import TABLE5_ORDER

#: Table 5 order.
CONFIGS = TABLE5_ORDER
RECORDS = "records.jsonl"
SETTINGS = "settings.json"
RESULTS = "results.json"


class BenchError(RuntimeError):
    """The bench cannot start or go on: the server did not start, the bundle does not match the recipe, ...
    The message says what to do."""


# ---- the verifier process ---------------------------------------------------------------------------------------


class VerifierProcess:
    """``hycoc verify-server`` in a child process on a free loopback port; ``url`` once listening.

    extra_args: more verify-server options (e.g. ``["--batching", "serial"]``). error: the exception class raised
    (with the server's stderr) when it exits or does not listen within ``timeout_s`` (default BenchError)."""

    def __init__(
        self,
        recipe_path: Path,
        keep_set: Path | None,
        timeout_s: float = 300.0,
        extra_args: list[str] = (),
        error: type[Exception] | None = None,
    ):
        error = error or BenchError
        cmd = [
            sys.executable,
            "-m",
            "hycoc.cli",
            "verify-server",
            str(recipe_path),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *extra_args,
        ]
        if keep_set is not None:
            cmd += ["--keep-set", str(keep_set)]
        self._err = tempfile.TemporaryFile(mode="w+")
        self._stderr = ""
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.url = None
        deadline = time.monotonic() + timeout_s
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                raise error(f"the verifier server exited before listening: {self.stderr_tail()}")
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
            if time.monotonic() > deadline:
                self.stop()
                raise error(f"the verifier server did not listen within {timeout_s:g} s")
        self.deadline = deadline

    def stderr_tail(self, lines: int = 5) -> str:
        if not self._err.closed:
            self._err.seek(0)
            self._stderr = self._err.read()
        return " | ".join(self._stderr.strip().splitlines()[-lines:]) or "(no output)"

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 20 s) and close its stderr file (its text is kept
        for `stderr_tail`)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._err.closed:
            self.stderr_tail()
            self._err.close()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def __enter__(self) -> VerifierProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- busy time of the verifier process ----------------------------------------------------------------------


def process_cpu_ms(pid: int) -> float | None:
    """CPU time (user + system, every thread, exited ones included) the process ``pid`` has used, in ms: fields 14
    and 15 of ``/proc/PID/stat`` (proc(5)) over ``SC_CLK_TCK`` (resolution 1 / SC_CLK_TCK s, 10 ms on Linux). None
    where there is no /proc (not Linux) or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        return 1000.0 * (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def busy_since(pid: int | None, start: float | None) -> float | None:
    """`process_cpu_ms` of ``pid`` now minus ``start`` (ms), None when either is unknown."""
    now = process_cpu_ms(pid) if pid is not None else None
    return None if now is None or start is None else max(0.0, now - start)


# ---- records -----------------------------------------------------------------------------------------------------


def record_of(
    config: str,
    run: int,
    q: Question,
    prompt_tokens: int,
    res,
    virtual_link: bool,
    turn: int = 1,
    chat=None,
    server_busy_ms: float | None = None,
) -> dict:
    """One request as a `hycoc.bench.summary` record (its module docstring lists the keys and units); ``turn``:
    1 for a question's first turn, 2 for its second (same session, `run_requests`). chat: the bundle's
    `hycoc.chat.Chat`: ``text`` is then the final answer, without the reasoning channel (kept as ``thought``), so
    quality scores what the user reads. server_busy_ms: CPU ms the verifier process used while the request ran
    (`process_cpu_ms`), None when unknown."""
    from hycoc.bench.quality import reference_match

    thought, text = None, res.text
    if chat is not None:
        thought, answer = chat.split_thought(list(res.tokens))
        text = chat.tokenizer.decode(answer, skip_special_tokens=True) if thought is not None else res.text
    link = res.link_s if virtual_link else 0.0
    first_link = res.first_token_link_s if virtual_link else 0.0
    return {
        "config": config,
        "run": run,
        "question_id": q.question_id,
        "category": q.category,
        "turn": turn,
        "prompt_tokens": prompt_tokens,
        "tokens": len(res.tokens),
        "rounds": res.rounds,
        "accepted": list(res.accepted),
        "prefill_ms": float(res.prefill_ms),
        "server_ms": [float(x) for x in res.server_ms],
        "rows": list(res.rows),
        "context": list(res.context),
        "seconds": res.seconds + link,
        "first_token_ms": None if res.first_token_s is None else 1000 * (res.first_token_s + first_link),
        "draft_ms": 1000 * res.draft_s,
        "slm_prefill_ms": 1000 * res.slm_prefill_s,
        "bytes_up": [u for u, _ in res.round_bytes],
        "bytes_down": [d for _, d in res.round_bytes],
        "bonus_outside_keep": res.bonus_outside_keep,
        "link_ms": 1000 * res.link_s,
        "text": text,
        "thought": thought,
        "draft_calls": dict(res.draft_calls),
        "draft_graph_ms": 1000 * res.draft_graph_s,
        "prefill_calls": dict(res.prefill_calls),
        "slm_prefill_graph_ms": 1000 * res.prefill_graph_s,
        "output_ids": list(res.tokens),
        "finished": res.finished,
        "finish_reason": res.finish_reason,
        "verifier_logprob": None,
        "reference_match": reference_match(q.category, text, q.reference),
        "server_busy_ms": server_busy_ms,
    }


def read_records(path: Path) -> list[dict]:
    """The records of ``records.jsonl`` (a torn last line from an interrupted write is dropped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary name in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---- quality ------------------------------------------------------------------------------------------------------


def score_quality(records: list[dict], questions: dict[int, Question]) -> None:
    """Fill every record's ``quality`` that is missing (records of an older bench lack it): the answer's
    repetition metrics (`hycoc.bench.quality.answer_metrics` over its text and output ids) and its reference metrics
    against the reference of the record's turn (`Question.reference_for_turn`: an MT-bench second answer against the
    second reference, `hycoc.bench.quality.reference_metrics`). questions: question_id -> Question."""
    from hycoc.bench.quality import answer_metrics, reference_metrics

    for rec in records:
        if rec.get("quality") is not None:
            continue
        q = questions[rec["question_id"]]
        text = rec.get("text") or ""
        rec["quality"] = {
            **answer_metrics(text, rec.get("output_ids")),
            **reference_metrics(q.category, text, q.reference_for_turn(int(rec.get("turn", 1)))),
        }


def score_answers(recipe, records: list[dict], prompts: dict[int, list[int]], console=None) -> None:
    """Fill every record's ``verifier_logprob``: the verifier's mean log-probability (natural log, temperature 1,
    full vocabulary) of the answer's tokens given the prompt. It measures how likely the verifier finds the text,
    which repetition raises (docs/benchmarks.md), so it is reported under that label beside `score_quality`'s metrics,
    never as the quality figure on its own. Runs the recipe's verifier in this process."""
    import torch

    from hycoc.models import load_verifier, set_threads

    set_threads(recipe.verifier.threads)
    model = load_verifier(recipe.model_path("verifier"), dtype=recipe.verifier.dtype, device=recipe.verifier.device)
    with torch.inference_mode():
        for rec in records:
            out = rec.get("output_ids") or []
            if rec.get("verifier_logprob") is not None or not out:
                continue
            prompt = prompts[rec["question_id"]]
            ids = torch.tensor([prompt + out], device=recipe.verifier.device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt) :, None])
            rec["verifier_logprob"] = float(lp.mean())


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


def run_bench(
    recipe,
    recipe_path: Path,
    plan: BenchPlan,
    *,
    bundle_dir: Path,
    backend: str = "cpu",
    resume: bool = False,
    cost_model_path: Path | None = None,
    console=None,
    threads: int = 1,
    device_profile_path: Path | None = None,
    remeasure_cost_model: bool = False,
    fmt: str = "table",
) -> dict:
    """Run the bench (module docstring); returns the results dict written to ``OUT/results.json``.

    remeasure_cost_model: measure the cost model again even when ``OUT/cost_model.json`` exists (`cost_model_for`).
    fmt: how the tables are printed (`hycoc.bench.tables.FORMATS`: table, markdown, csv). Third-party warnings
    (torch, transformers, onnxruntime) go to ``OUT/bench.log`` (`hycoc.quiet.third_party_output`).

    Raises BenchError (server, bundle), BundleError, TransportError from a request that fails for a reason other
    than the request itself; KeyboardInterrupt leaves ``records.jsonl`` for ``--resume``.
    """
    from hycoc.quiet import third_party_output

    console = make_console(console)
    plan.out.mkdir(parents=True, exist_ok=True)
    with third_party_output(plan.out / "bench.log", console=console):
        return _run_bench(
            recipe,
            recipe_path,
            plan,
            bundle_dir=bundle_dir,
            backend=backend,
            resume=resume,
            cost_model_path=cost_model_path,
            console=console,
            threads=threads,
            remeasure_cost_model=remeasure_cost_model,
            fmt=fmt,
            device_profile_path=device_profile_path,
        )


def _run_bench(
    recipe,
    recipe_path: Path,
    plan: BenchPlan,
    *,
    bundle_dir: Path,
    backend: str,
    resume: bool,
    cost_model_path: Path | None,
    console,
    threads: int,
    remeasure_cost_model: bool,
    fmt: str,
    device_profile_path: Path | None = None,
) -> dict:
    from hycoc.bench.plots import write_plots
    from hycoc.bench.summary import summarize
    from hycoc.protocol.messages import Sampling
    from hycoc.runtime.client import load_runtime

    console = make_console(console)
    out = plan.out
    records_path = out / RECORDS
    done = open_out(out, run_settings(recipe, plan, bundle_dir, backend), resume)
    rt = load_runtime(bundle_dir, backend, threads=threads)
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
    anchors = {qid: r.anchor for qid, r in rendered.items()}
    r = rt.bundle.round
    sampling = Sampling(recipe.sampling.temperature, recipe.sampling.top_k, recipe.sampling.top_p)
    epsilon = recipe.acceptance.epsilon  # the recipe's, like its sampling: `hycoc tune-epsilon` writes it there
    todo = [
        Request(c, c, epsilon, run, q)
        for run in range(plan.runs)
        for q in plan.questions
        for c in plan.configs
        if (c, run, q.question_id) not in done
    ]
    every = [Request(c, c, epsilon, run, q) for run in range(plan.runs) for q in plan.questions for c in plan.configs]
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
        f"output cap {plan.output_cap}, T={sampling.temperature}, ε={epsilon:g}, link {plan.link} (counted, "
        f"not slept), backend {backend}"
    )
    run_requests(
        rt,
        recipe_path,
        bundle_dir,
        todo,
        prompts,
        records_path,
        link=plan.link,
        output_cap=plan.output_cap,
        sampling=sampling,
        seed=r.seed,
        console=console,
        turns=plan.turns,
        thinking=plan.thinking,
        anchors=anchors,
    )

    records = [
        rec
        for rec in read_records(records_path)
        if rec["config"] in plan.configs and rec["question_id"] in prompts and rec["run"] < plan.runs
    ]
    turns = turn_summary(records)
    score_quality(records, {q.question_id: q for q in plan.questions})
    console.print("scoring answers with the verifier (its own log-prob of each answer) ...")
    score_answers(recipe, records, prompts)
    cost, cost_note = cost_model_for(recipe, records, cost_model_path, out, console, remeasure=remeasure_cost_model)
    summary = summarize(records, cost_model=cost, server=server_work(recipe))
    results = {
        "meta": {
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
        },
        "summary": summary,
        "turns": turns,
        "device_time": device_time_for(records, bundle_dir, device_profile_path, console),
        "records": records,
    }
    atomic_write(out / RESULTS, json.dumps(results, indent=1))
    plots = write_plots(summary, out)
    if any(q.category == LONG_SUMMARY_CATEGORY for q in plan.questions):
        from hycoc.bench.long_context import long_context_rows

        results["long_context"] = long_context_rows(records, summary, r.slm_window)
        atomic_write(out / RESULTS, json.dumps(results, indent=1))
    print_results(results, console, fmt, plots=plots, out=out)
    if results.get("long_context") is not None:
        from hycoc.bench.long_context import render_long_context

        render_long_context(
            results["long_context"],
            console,
            title=f"long documents: first reply (hand-off of up to W = {r.head_window} positions) "
            f"and the device's SLM ring prefill (last {r.slm_window} prompt tokens)",
            fmt=fmt,
        )
    return results


def result_tables(results: dict) -> list:
    """The tables of a bench's ``results.json`` (`hycoc.bench.tables.TextTable`): main, quality, per category,
    server ms per round (with a projection), per turn (with second turns)."""
    from hycoc.bench.report_tables import categories_table, main_table, quality_table, rounds_table

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
        from hycoc.bench.device_profile import render_device_table

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
    (`hycoc.bench.device_profile.project_records`) from ``--device-profile``, else from the labelled estimate
    (`hycoc.device_time`), which the console is told. {"source", "estimated", "configs"}; "error" instead of
    "configs" when the bundle's graphs cannot be priced."""
    from hycoc.bench.device_profile import (
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
    """The given rich Console, else one on stdout as wide as `hycoc.bench.tables.console_width` says: the
    terminal's width (at least 80), or when stdout is redirected ``COLUMNS`` if set, else 120."""
    from rich.console import Console

    from hycoc.bench.tables import console_width

    if console is None:
        console = Console()
        console = Console(width=console_width(console.is_terminal, console.width))
    return console


def open_out(out: Path, settings: dict, resume: bool) -> set[tuple[str, int, int]]:
    """Make the output folder ready: refuse an existing ``records.jsonl`` without ``resume``, and with it refuse
    records made with other ``settings`` (`run_settings`); write ``settings.json``. Returns the (config, run,
    question_id) of the requests already recorded. Raises BenchError saying which flag or setting to change."""
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / RECORDS
    if records_path.exists() and not resume:
        raise BenchError(f"{records_path} exists: pass --resume to continue that run, or choose another --out")
    settings_path = out / SETTINGS
    if records_path.exists() and settings_path.is_file():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        changed = [k for k in settings if saved.get(k) != settings[k]]
        if changed:
            raise BenchError(
                f"--resume: {out} was run with other settings ("
                + ", ".join(f"{k}: {saved.get(k)!r} there, {settings[k]!r} now" for k in changed)
                + "); use the same ones, or another --out"
            )
    atomic_write(settings_path, json.dumps(settings, indent=1))
    return {(r["config"], r["run"], r["question_id"]) for r in read_records(records_path)}


@dataclass(frozen=True)
class Request:
    """One request of a run: the record's ``config`` label, the runtime ``mode`` (`hycoc.runtime.client.MODES`),
    the acceptance threshold ``epsilon`` sent to the verifier (used by the ε modes), the run index (seed = recipe
    seed + run) and the question (its first turn is the prompt)."""

    config: str
    mode: str
    epsilon: float
    run: int
    question: Question


def requests_of(todo: list[Request], turns: int) -> int:
    """Requests (one per turn) that ``todo`` makes: one per item, two for a question with a second turn when
    ``turns`` is 2 (slm-alone answers first turns only). A first turn that fills the context makes one fewer."""
    return sum(1 + (turns > 1 and len(req.question.turns) > 1 and req.mode != "slm-alone") for req in todo)


def run_requests(
    rt,
    recipe_path: Path,
    bundle_dir: Path,
    todo: list[Request],
    prompts: dict[int, list[int]],
    records_path: Path,
    *,
    link: str,
    output_cap: int,
    sampling,
    seed: int,
    console,
    turns: int = 1,
    thinking: bool = False,
    anchors: dict[int, int] | None = None,
) -> None:
    """Run ``todo`` in order on the device runtime ``rt``, each against a ``hycoc verify-server`` child process
    (`VerifierProcess`, started only when a request needs a verifier), and append each finished request's record
    (`record_of`) to ``records_path`` at once. ``prompts``: question_id -> prompt token ids. ``link``: link model
    name, counted, not slept. turns: 2 continues every question that has a second turn on the same session
    (`second_turn`; slm-alone answers first turns only); thinking: the second turn's template setting (the
    prompts' is the caller's); anchors: question_id -> the prompt's model-turn opening (`hycoc.chat.Rendered.anchor`,
    sent in OPEN so that a second turn can roll back to it). Ctrl-C keeps the records written and re-raises
    KeyboardInterrupt. Raises BenchError (server), TransportError from a request that fails."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from hycoc.runtime.transport import VerifierClient, parse_link

    if not todo:
        return
    link_model = parse_link(link)
    needs_server = any(req.mode != "slm-alone" for req in todo)
    server = VerifierProcess(recipe_path, bundle_dir / "keep_set.npy") if needs_server else None
    try:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
        )
        # off the terminal the plain progress lines say it all: no leftover bar in a redirected file
        with (
            Progress(*columns, console=console, transient=False, disable=not console.is_terminal) as progress,
            open(records_path, "a", encoding="utf-8") as sink,
        ):
            total = requests_of(todo, turns)
            task = progress.add_task("requests", total=total)
            t_start, n = time.perf_counter(), 0
            for req in todo:
                q = req.question
                progress.update(task, description=f"q{q.question_id} {req.config:12s}")
                client = None
                if req.mode != "slm-alone":
                    client = VerifierClient(server.url, timeout_s=600, link=link_model, sleep=lambda s: None)
                two = turns > 1 and len(q.turns) > 1 and client is not None
                pid = server.proc.pid if client is not None else None
                cpu0 = process_cpu_ms(pid) if pid is not None else None
                res = rt.generate(
                    client,
                    prompts[q.question_id],
                    mode=req.mode,
                    max_new_tokens=output_cap,
                    seed=seed + req.run,
                    sampling=sampling,
                    epsilon=req.epsilon,
                    keep_open=two,
                    anchor=(anchors or {}).get(q.question_id, 0),
                )
                recs = [
                    record_of(
                        req.config,
                        req.run,
                        q,
                        len(prompts[q.question_id]),
                        res,
                        virtual_link=True,
                        chat=rt.bundle.chat,
                        server_busy_ms=busy_since(pid, cpu0),
                    )
                ]
                if two and res.finish_reason == "length":  # the context is full: no room for a second turn
                    client.close()
                    total -= 1
                    progress.update(task, total=total)
                elif two:
                    recs.append(
                        second_turn(
                            rt,
                            client,
                            server.url,
                            req,
                            prompts[q.question_id],
                            res,
                            output_cap,
                            sampling,
                            thinking,
                            server_pid=pid,
                        )
                    )
                sink.write("".join(json.dumps(rec) + "\n" for rec in recs))  # both turns, or neither
                sink.flush()
                progress.advance(task, len(recs))
                before, n = n, n + len(recs)
                if not console.is_terminal and (n // 10 > before // 10 or n == total):  # logs get plain lines
                    spent = time.perf_counter() - t_start
                    console.print(
                        f"  {n}/{total} requests, {spent / 60:.1f} min, eta {spent / n * (total - n) / 60:.1f} min"
                    )
    except KeyboardInterrupt:
        console.print(
            f"[yellow]interrupted: {len(read_records(records_path))} requests kept in {records_path}; "
            "rerun with --resume to continue[/]"
        )
        raise
    finally:
        if server is not None:
            server.stop()


def second_turn(
    rt,
    client,
    url: str,
    req: Request,
    prompt: list[int],
    first,
    output_cap: int,
    sampling,
    thinking: bool = False,
    server_pid: int | None = None,
) -> dict:
    """A question's second turn on the session its first turn left open (paper §4.1: MT-bench's second turns;
    the prompt is the whole conversation -- first question, this configuration's own first answer, second question
    -- as the checkpoint's chat template renders it, `hycoc.chat.Chat.conversation`). The verifier keeps the KV of
    what both sides hold of it and prefills the rest (docs/serving.md "Conversations"); to show what that saves,
    the same conversation is also prefilled cold on a new session (opened and closed at once, no rounds).
    Returns the turn's record (``turn`` 2, ``prefill_ms`` the append's, ``prefill_ms_cold`` the cold one's).
    The client is closed. server_pid: the verifier process, whose CPU time over the turn is the record's
    ``server_busy_ms``."""
    import numpy as np

    from hycoc.protocol.messages import OpenRequest
    from hycoc.runtime.transport import VerifierClient

    q = req.question
    chat = rt.bundle.chat
    messages = [
        {"role": "user", "content": q.turns[0]},
        {"role": "assistant", "content": chat.answer_text(first.tokens)},
        {"role": "user", "content": q.turns[1]},
    ]
    rendered = chat.conversation(messages, thinking)
    cpu0 = process_cpu_ms(server_pid) if server_pid is not None else None
    try:
        res = rt.next_turn(client, rendered.ids, anchor=rendered.anchor, max_new_tokens=output_cap)
        busy = busy_since(server_pid, cpu0)  # the turn's own work, not the cold prefill below
    finally:
        client.close()
    conversation = rendered.ids
    cold = VerifierClient(url, timeout_s=600)
    try:
        cold_ms = cold.open(
            OpenRequest(prompt_ids=np.asarray(conversation, np.int32), sampling=sampling, max_new_tokens=1)
        ).prefill_ms
    finally:
        cold.close()
    rec = record_of(
        req.config, req.run, q, len(conversation), res, virtual_link=True, turn=2, chat=chat, server_busy_ms=busy
    )
    rec["prefill_ms_cold"] = float(cold_ms)
    rec["prefill_start"] = int(res.kept)  # the APPEND kept this many ids (the verifier may roll back to its snapshot)
    return rec


def turn_summary(records: list[dict]) -> dict:
    """Per configuration and turn: requests, mean prefill ms (the second turn's: the appended tokens only), mean
    prefill ms saved by keeping the KV (cold prefill of the whole conversation minus the append's; second turns),
    g = (prefill + server ms) / committed tokens pooled, MAT = committed tokens / rounds pooled.
    Records without ``turn`` are first turns; slm-alone records (no verifier) are left out."""
    from hycoc.bench.stats import table5_order as _order

    out: dict[str, dict[str, dict]] = {}
    groups = _groups(records)
    rank = {c: i for i, c in enumerate(_order({c for c, _ in groups}))}  # the main table's order
    for (config, turn), rs in sorted(groups.items(), key=lambda kv: (rank[kv[0][0]], kv[0][1])):
        tokens, rounds = sum(r["tokens"] for r in rs), sum(r["rounds"] for r in rs)
        verifier_ms = sum(r["prefill_ms"] + sum(r["server_ms"]) for r in rs)
        saved = [r["prefill_ms_cold"] - r["prefill_ms"] for r in rs if "prefill_ms_cold" in r]
        out.setdefault(config, {})[str(turn)] = {
            "requests": len(rs),
            "prefill_ms": sum(r["prefill_ms"] for r in rs) / len(rs),
            "prefill_ms_saved": sum(saved) / len(saved) if saved else None,
            "g_ms_per_token": verifier_ms / tokens if tokens else None,
            "mat": tokens / rounds if rounds else None,
        }
    return out


def _groups(records: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if r["config"] != "slm-alone":
            groups.setdefault((r["config"], r.get("turn", 1)), []).append(r)
    return dict(sorted(groups.items()))


def turns_table(turns: dict):
    """The per-turn table of `turn_summary` as a `hycoc.bench.tables.TextTable` (key columns: config, turn), the
    configurations in the main table's order (paper Table 5, `hycoc.bench.stats.TABLE5_ORDER`), turns in order."""
    from hycoc.bench.tables import TextTable

    def num(x, digits=2):
        return "–" if x is None else f"{x:.{digits}f}"

    from hycoc.bench.stats import table5_order as _order

    rows = [
        [
            config,
            turn,
            str(t["requests"]),
            num(t["prefill_ms"], 1),
            num(t["prefill_ms_saved"], 1),
            num(t["g_ms_per_token"]),
            num(t["mat"]),
        ]
        for config in _order(turns)
        for turn, t in sorted(turns[config].items(), key=lambda kv: int(kv[0]))
    ]
    return TextTable(
        title="per turn (second turns continue the session: KV kept, only the new tokens prefilled)",
        headers=["config", "turn", "requests", "prefill ms", "prefill ms saved", "g ms/tok", "MAT"],
        rows=rows,
        keys=2,
    )


def render_turns(turns: dict, console, fmt: str = "table") -> None:
    """Print `turns_table` (``fmt``: `hycoc.bench.tables.FORMATS`)."""
    from hycoc.bench.tables import print_tables

    print_tables([turns_table(turns)], console, fmt)


#: The cost model a bench measured, in its output folder; `cost_model_for` reuses it on --resume.
COST_MODEL = "cost_model.json"


def cost_model_for(
    recipe, records: list[dict], cost_model_path: Path | None, out: Path, console, remeasure: bool = False
):
    """The cost model of g projected and a sentence saying where it came from: ``cost_model_path`` loaded
    (`hycoc.bench.cost_model.load_cost_model`); else ``OUT/cost_model.json`` that an earlier bench in ``out``
    measured (so a ``--resume`` projects through the same model and leaves the summary as it was), unless
    ``remeasure``; else measured here on the recipe's verifier at contexts covering the records'
    (`hycoc.bench.cost_measure.measure_recipe_verifier`: busy CPU time of each forward, interleaved repetitions)
    and saved as ``OUT/cost_model.json``. Raises CostModelError for a bad file."""
    from hycoc.bench.cost_model import load_cost_model

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
    from hycoc.bench.cost_measure import measure_recipe_verifier

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
    """What the cost-model replay needs to know of the server (`hycoc.bench.cost_model.request_forwards`): the
    recipe's K (``[tree] chain_length``, the server head's chain) and W (``[window] head_window``, its window)."""
    return {"chain_length": recipe.tree.chain_length, "head_window": recipe.window.head_window}


def run_settings(recipe, plan: BenchPlan, bundle_dir: Path, backend: str) -> dict:
    """What makes two benches' records comparable; ``--resume`` refuses to mix records made with other values."""
    from hycoc.bundle import sha256_file

    s = recipe.sampling
    return {
        "recipe_sha256": recipe.content_hash(),
        "bundle_manifest_sha256": sha256_file(bundle_dir / "manifest.json"),
        "backend": backend,
        "output_cap": plan.output_cap,
        "link": plan.link,
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "seed": s.seed,
        "turns": plan.turns,
        "thinking": plan.thinking,
    }


def default_bundle_dir(recipe, repo_root: Path) -> Path:
    """Where `hycoc bench` keeps the recipe's cpu bundle when ``--bundle`` is not given."""
    return repo_root / "bundles" / f"{recipe.recipe.name}-cpu"


__all__ = [
    "CONFIGS",
    "BenchError",
    "BenchPlan",
    "Request",
    "VerifierProcess",
    "atomic_write",
    "cost_model_for",
    "busy_since",
    "default_bundle_dir",
    "make_console",
    "process_cpu_ms",
    "print_results",
    "result_tables",
    "open_out",
    "read_records",
    "record_of",
    "run_bench",
    "run_requests",
    "score_answers",
    "score_quality",
    "server_work",
]
