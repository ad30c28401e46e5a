"""`hycoc bench`: every configuration of Table 5 on the same prompts, verifier and seed, in one run (paper §4,
App. G; issue 6).

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
an interrupted bench keeps them and ``--resume`` skips what is there. At the end: the verifier's mean log-prob of
every answer (the quality proxy; the verifier loaded in this process after the server stopped), the summary
(`hycoc.bench_stats.summarize`), ``OUT/results.json`` (``summary`` + per-request ``records``), the plots and the
table.

Cost model (g projected): ``--cost-model FILE`` (e.g. made on a GPU by ``benchmarks/verifier_cost_model.py
--device cuda``), else one measured here on the recipe's verifier and this machine
(`hycoc.verifier.cost_measure.measure_recipe_verifier`), saved as ``OUT/cost_model.json``; the table says which.
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

from hycoc.datasets import Question

#: Table 5 order.
CONFIGS = ("cloud-mtp", "specedge", "specedge-eps", "hyco", "hyco-2p", "hyco-exact", "server-head", "slm-alone")
RECORDS = "records.jsonl"
SETTINGS = "settings.json"
RESULTS = "results.json"


class BenchError(RuntimeError):
    """The bench cannot start or go on: the server did not start, the bundle does not match the recipe, ...
    The message says what to do."""


# ---- the verifier process ---------------------------------------------------------------------------------------


class VerifierProcess:
    """``hycoc verify-server`` in a child process on a free loopback port; ``url`` once listening.

    Raises BenchError with the server's stderr when it exits or does not listen within ``timeout_s``."""

    def __init__(self, recipe_path: Path, keep_set: Path | None, timeout_s: float = 300.0):
        cmd = [sys.executable, "-m", "hycoc.cli", "verify-server", str(recipe_path), "--host", "127.0.0.1",
               "--port", "0"]
        if keep_set is not None:
            cmd += ["--keep-set", str(keep_set)]
        self._err = tempfile.TemporaryFile(mode="w+")
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self.url = None
        deadline = time.monotonic() + timeout_s
        while self.url is None:
            line = self.proc.stdout.readline()
            if not line:
                self.stop()
                raise BenchError(f"the verifier server exited before listening: {self.stderr_tail()}")
            if "listening on " in line:
                self.url = line.split("listening on ", 1)[1].split()[0]
            if time.monotonic() > deadline:
                self.stop()
                raise BenchError(f"the verifier server did not listen within {timeout_s:g} s")

    def stderr_tail(self, lines: int = 5) -> str:
        self._err.seek(0)
        return " | ".join(self._err.read().strip().splitlines()[-lines:]) or "(no output)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> VerifierProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- records -----------------------------------------------------------------------------------------------------


def record_of(config: str, run: int, q: Question, prompt_tokens: int, res, virtual_link: bool) -> dict:
    """One request as a `hycoc.bench_stats` record (its module docstring lists the keys and units)."""
    from hycoc.bench_stats import reference_match

    link = res.link_s if virtual_link else 0.0
    first_link = res.first_token_link_s if virtual_link else 0.0
    return {
        "config": config, "run": run, "question_id": q.question_id, "category": q.category,
        "prompt_tokens": prompt_tokens, "tokens": len(res.tokens), "rounds": res.rounds,
        "accepted": list(res.accepted), "prefill_ms": float(res.prefill_ms),
        "server_ms": [float(x) for x in res.server_ms], "rows": list(res.rows), "context": list(res.context),
        "seconds": res.seconds + link,
        "first_token_ms": None if res.first_token_s is None else 1000 * (res.first_token_s + first_link),
        "draft_ms": 1000 * res.draft_s, "slm_prefill_ms": 1000 * res.slm_prefill_s,
        "bytes_up": [u for u, _ in res.round_bytes], "bytes_down": [d for _, d in res.round_bytes],
        "bonus_outside_keep": res.bonus_outside_keep, "link_ms": 1000 * res.link_s, "text": res.text,
        "output_ids": list(res.tokens), "finished": res.finished, "verifier_logprob": None,
        "reference_match": reference_match(q.category, res.text, q.reference),
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


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


# ---- quality proxy -----------------------------------------------------------------------------------------------


def score_answers(recipe, records: list[dict], prompts: dict[int, list[int]], console=None) -> None:
    """Fill every record's ``verifier_logprob``: the verifier's mean log-probability (natural log, temperature 1,
    full vocabulary) of the answer's tokens given the prompt -- a cheap proxy of how much the answer stays in the
    verifier's distribution (issue 6 "Quality side"). Runs the recipe's verifier in this process."""
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
            logits = model(ids).logits[0, len(prompt) - 1:-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(1, ids[0, len(prompt):, None])
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


def run_bench(recipe, recipe_path: Path, plan: BenchPlan, *, bundle_dir: Path, backend: str = "cpu",
              resume: bool = False, cost_model_path: Path | None = None, console=None, threads: int = 1) -> dict:
    """Run the bench (module docstring); returns the results dict written to ``OUT/results.json``.

    Raises BenchError (server, bundle), BundleError, TransportError from a request that fails for a reason other
    than the request itself; KeyboardInterrupt leaves ``records.jsonl`` for ``--resume``.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    from hycoc.bench_stats import render_categories, render_table, summarize, write_plots
    from hycoc.chat import format_prompt
    from hycoc.cost_model import load_cost_model
    from hycoc.messages import Sampling
    from hycoc.runtime.client import load_runtime
    from hycoc.runtime.transport import VerifierClient, parse_link

    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file: room for the whole table
            console = Console(width=200)
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / RECORDS
    if records_path.exists() and not resume:
        raise BenchError(f"{records_path} exists: pass --resume to continue that run, or choose another --out")
    settings = run_settings(recipe, plan, bundle_dir, backend)
    settings_path = out / SETTINGS
    if records_path.exists() and settings_path.is_file():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        changed = [k for k in settings if saved.get(k) != settings[k]]
        if changed:
            raise BenchError(f"--resume: {out} was run with other settings ("
                             + ", ".join(f"{k}: {saved.get(k)!r} there, {settings[k]!r} now" for k in changed)
                             + "); use the same ones, or another --out")
    _atomic_write(settings_path, json.dumps(settings, indent=1))
    done = {(r["config"], r["run"], r["question_id"]) for r in read_records(records_path)}
    todo = [(run, q, c) for run in range(plan.runs) for q in plan.questions for c in plan.configs
            if (c, run, q.question_id) not in done]

    rt = load_runtime(bundle_dir, backend, threads=threads)
    if rt.bundle.manifest.recipe.sha256 != recipe.content_hash():
        console.print(f"[yellow]note: bundle {bundle_dir} was built from another version of recipe "
                      f"{rt.bundle.manifest.recipe.name!r}; its round constants are the bundle's[/]")
    tok = rt.bundle.tokenizer
    prompts = {q.question_id: format_prompt(tok, q.turns[0]) for q in plan.questions}
    r = rt.bundle.round
    sampling = Sampling(recipe.sampling.temperature, recipe.sampling.top_k, recipe.sampling.top_p)
    link = parse_link(plan.link)
    console.print(f"bench: {len(plan.questions)} questions x {len(plan.configs)} configurations x {plan.runs} run(s) "
                  f"= {len(plan.questions) * len(plan.configs) * plan.runs} requests ({len(todo)} to run), output cap "
                  f"{plan.output_cap}, T={sampling.temperature}, link {plan.link} (counted, not slept), "
                  f"backend {backend}")
    if todo:
        needs_server = any(c != "slm-alone" for _, _, c in todo)
        server = VerifierProcess(recipe_path, bundle_dir / "keep_set.npy") if needs_server else None
        try:
            columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                       TextColumn("eta"), TimeRemainingColumn())
            with Progress(*columns, console=console, transient=False) as progress, \
                    open(records_path, "a", encoding="utf-8") as sink:
                task = progress.add_task("requests", total=len(todo))
                t_start = time.perf_counter()
                for n, (run, q, config) in enumerate(todo, start=1):
                    progress.update(task, description=f"q{q.question_id} {config:12s}")
                    client = None
                    if config != "slm-alone":
                        client = VerifierClient(server.url, timeout_s=600, link=link, sleep=lambda s: None)
                    res = rt.generate(client, prompts[q.question_id], mode=config, max_new_tokens=plan.output_cap,
                                      seed=r.seed + run, sampling=sampling, epsilon=r.epsilon)
                    rec = record_of(config, run, q, len(prompts[q.question_id]), res, virtual_link=True)
                    sink.write(json.dumps(rec) + "\n")
                    sink.flush()
                    progress.advance(task)
                    if not console.is_terminal and (n % 10 == 0 or n == len(todo)):  # logs get plain lines
                        spent = time.perf_counter() - t_start
                        console.print(f"  {n}/{len(todo)} requests, {spent / 60:.1f} min, eta "
                                      f"{spent / n * (len(todo) - n) / 60:.1f} min")
        except KeyboardInterrupt:
            console.print(f"[yellow]interrupted: {len(read_records(records_path))} requests kept in {records_path}; "
                          "rerun with --resume to continue[/]")
            raise
        finally:
            if server is not None:
                server.stop()

    records = [rec for rec in read_records(records_path)
               if rec["config"] in plan.configs and rec["question_id"] in prompts and rec["run"] < plan.runs]
    console.print("scoring answers with the verifier (quality proxy) ...")
    score_answers(recipe, records, prompts)
    if cost_model_path is not None:
        cost = load_cost_model(cost_model_path)
        cost_note = f"g projected through {cost_model_path} ({cost.device}, {cost.model})"
    else:
        from hycoc.verifier.cost_measure import measure_recipe_verifier

        console.print("measuring the verifier cost model on this machine (no --cost-model given) ...")
        contexts = sorted({64, 128, 256, 512, max(64, int(max((max(x["context"], default=0) for x in records),
                                                                  default=64)))})
        cost = measure_recipe_verifier(recipe, contexts=contexts)
        cost.save(out / "cost_model.json")
        cost_note = (f"g projected through a cost model measured here ({cost.device}, {cost.dtype}): "
                     f"{out / 'cost_model.json'}")
    summary = summarize(records, cost_model=cost)
    results = {"meta": {"recipe": str(recipe_path), "bundle": str(bundle_dir), "backend": backend,
                        "questions": len(plan.questions), "configs": plan.configs, "runs": plan.runs,
                        "link": plan.link, "link_applied": "counted, not slept", "output_cap": plan.output_cap,
                        "temperature": sampling.temperature, "cost_model": cost_note,
                        "cost_model_points": [p.model_dump() for p in cost.points],
                        "machine": f"{os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d %H:%M:%S")},
               "summary": summary, "records": records}
    _atomic_write(out / RESULTS, json.dumps(results, indent=1))
    plots = write_plots(summary, out)
    render_table(summary, console, title=f"hycoc bench: {len(plan.questions)} Spec-Bench questions, link {plan.link}")
    render_categories(summary, console)
    console.print(f"g = verifier ms per output token measured on this machine (prefill included); {cost_note}, "
                  "rounds only. Delivery and first-token times include the link model.")
    console.print(f"wrote {out / RESULTS}, {', '.join(str(p) for p in plots)}")
    return results


def run_settings(recipe, plan: BenchPlan, bundle_dir: Path, backend: str) -> dict:
    """What makes two benches' records comparable; ``--resume`` refuses to mix records made with other values."""
    from hycoc.bundle import sha256_file

    s = recipe.sampling
    return {"recipe_sha256": recipe.content_hash(), "bundle_manifest_sha256": sha256_file(bundle_dir / "manifest.json"),
            "backend": backend, "output_cap": plan.output_cap, "link": plan.link, "temperature": s.temperature,
            "top_k": s.top_k, "top_p": s.top_p, "seed": s.seed}


def default_bundle_dir(recipe, repo_root: Path) -> Path:
    """Where `hycoc bench` keeps the recipe's cpu bundle when ``--bundle`` is not given."""
    return repo_root / "bundles" / f"{recipe.recipe.name}-cpu"


__all__ = ["CONFIGS", "BenchError", "BenchPlan", "VerifierProcess", "default_bundle_dir", "read_records",
           "record_of", "run_bench", "score_answers"]
