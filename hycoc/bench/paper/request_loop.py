"""The requests of a bench (`hycoc.bench.paper.runner`), one after another: each configuration's request for each
question and run on the device runtime against a ``hycoc verify-server`` child process (`run_requests`), a
question's second turn on the session its first left open (`second_turn`), and each finished request's record
appended to ``OUT/records.jsonl`` at once (`hycoc.bench.paper.records`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hycoc.bench.datasets import Question
from hycoc.bench.paper.records import RECORDS, read_records, record_of
from hycoc.bench.verifier_process import VerifierProcess, busy_since, process_cpu_ms


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


@dataclass(frozen=True)
class RequestRun:
    """Where and how `run_requests` runs a bench's requests (a `hycoc bench` or a `hycoc tune-epsilon`).

    recipe_path: the recipe the ``hycoc verify-server`` child process loads; bundle_dir: the bundle (its
    ``keep_set.npy`` goes to the server); records_path: ``OUT/records.jsonl``, appended to; prompts: question_id ->
    prompt token ids; link: link model name (`hycoc.runtime.transport.parse_link`), counted, not slept; output_cap:
    new tokens per request; sampling: the verifier's p~ (`hycoc.protocol.messages.Sampling`); seed: the runtime's
    seed of run 0 (run k: seed + k); turns: 2 continues every question that has a second turn on the same session
    (`second_turn`; slm-alone answers first turns only); thinking: the second turn's template setting (the prompts'
    is the caller's); anchors: question_id -> the prompt's model-turn opening (`hycoc.chat.Rendered.anchor`, sent in
    OPEN so that a second turn can roll back to it; 0 when absent)."""

    recipe_path: Path
    bundle_dir: Path
    records_path: Path
    prompts: Mapping[int, list[int]]
    link: str
    output_cap: int
    sampling: Any
    seed: int
    turns: int = 1
    thinking: bool = False
    anchors: Mapping[int, int] = field(default_factory=dict)

    @classmethod
    def for_plan(cls, plan: Any, recipe_path: Path, bundle_dir: Path, prompts: Mapping[int, list[int]], **how: Any):
        """The run of a bench's plan (`hycoc.bench.paper.runner.BenchPlan`, `hycoc.bench.paper.tune_epsilon.TunePlan`:
        anything with ``out``, ``link`` and ``output_cap``): records in ``plan.out / records.jsonl``, the plan's link
        and output cap; ``how``: the other fields (sampling and seed at least)."""
        return cls(recipe_path, bundle_dir, plan.out / RECORDS, prompts, plan.link, plan.output_cap, **how)


def _progress_bar(console):
    """The rich progress bar of `run_requests`: description, bar, done/total, elapsed, eta; off the terminal it
    is disabled (the plain progress lines say it all: no leftover bar in a redirected file)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
    )
    return Progress(*columns, console=console, transient=False, disable=not console.is_terminal)


def run_requests(rt, todo: list[Request], run: RequestRun, console) -> None:
    """Run ``todo`` in order on the device runtime ``rt``, each against a ``hycoc verify-server`` child process
    (`VerifierProcess`, started only when a request needs a verifier), and append each finished request's record
    (`record_of`; with its second turn, `second_turn`, when ``run.turns`` is 2) to ``run.records_path`` at once
    (`RequestRun` for the rest). Ctrl-C keeps the records written and re-raises KeyboardInterrupt. Raises
    BenchError (server), TransportError from a request that fails."""
    from hycoc.runtime.transport import parse_link

    if not todo:
        return
    link_model = parse_link(run.link)
    needs_server = any(req.mode != "slm-alone" for req in todo)
    server = VerifierProcess(run.recipe_path, run.bundle_dir / "keep_set.npy") if needs_server else None
    try:
        with _progress_bar(console) as progress, open(run.records_path, "a", encoding="utf-8") as sink:
            total = requests_of(todo, run.turns)
            task = progress.add_task("requests", total=total)
            t_start, n = time.perf_counter(), 0
            for req in todo:
                progress.update(task, description=f"q{req.question.question_id} {req.config:12s}")
                recs, dropped = _request_records(rt, req, run, server, link_model)
                if dropped:  # the context is full: no room for a second turn
                    total -= 1
                    progress.update(task, total=total)
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
            f"[yellow]interrupted: {len(read_records(run.records_path))} requests kept in {run.records_path}; "
            "rerun with --resume to continue[/]"
        )
        raise
    finally:
        if server is not None:
            server.stop()


def _request_records(
    rt, req: Request, run: RequestRun, server: VerifierProcess | None, link_model
) -> tuple[list[dict], bool]:
    """One request of `run_requests` on ``rt`` (against ``server`` unless slm-alone), and its second turn on the
    same session where ``run.turns`` asks for it. Returns (its records, whether a second turn was due but the first
    filled the context: then there is none)."""
    from hycoc.runtime.transport import VerifierClient

    q = req.question
    client = None
    if req.mode != "slm-alone" and server is not None:  # started: a request needs it (needs_server)
        client = VerifierClient(server.url, timeout_s=600, link=link_model, sleep=lambda s: None)
    two = run.turns > 1 and len(q.turns) > 1 and client is not None
    pid = server.proc.pid if client is not None and server is not None else None
    cpu0 = process_cpu_ms(pid) if pid is not None else None
    res = rt.generate(
        client,
        run.prompts[q.question_id],
        mode=req.mode,
        max_new_tokens=run.output_cap,
        seed=run.seed + req.run,
        sampling=run.sampling,
        epsilon=req.epsilon,
        keep_open=two,
        anchor=run.anchors.get(q.question_id, 0),
    )
    recs = [
        record_of(
            req.config,
            req.run,
            q,
            len(run.prompts[q.question_id]),
            res,
            virtual_link=True,
            chat=rt.bundle.chat,
            server_busy_ms=busy_since(pid, cpu0),
        )
    ]
    # two implies a client, so a server: the `is not None` tests below say so to the type checker
    if two and client is not None and res.finish_reason == "length":  # context full: no second turn
        client.close()
        return recs, True
    if two and client is not None and server is not None:
        recs.append(
            second_turn(
                rt,
                client,
                server.url,
                req,
                run.prompts[q.question_id],
                res,
                run.output_cap,
                run.sampling,
                run.thinking,
                server_pid=pid,
            )
        )
    return recs, False


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
    the same conversation is also prefilled cold on a new session (opened and closed at once, no rounds), with the
    device's SLM ring filling meanwhile where the configuration uses the SLM, as a new session's OPEN would have it
    (the APPEND's prefill also runs beside the ring's: on one machine both compete for the same cores).
    Returns the turn's record (``turn`` 2, ``prefill_ms`` the append's, ``prefill_ms_cold`` the cold one's).
    The client is closed. server_pid: the verifier process, whose CPU time over the turn is the record's
    ``server_busy_ms``."""
    from concurrent.futures import ThreadPoolExecutor

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
    drafter = rt.drafter(req.mode)
    try:  # a new session's OPEN of the same conversation, as `DeviceRuntime.generate` sends it: where the drafter
        # uses the SLM its ring fills meanwhile (App. C), so on a shared machine both prefills see the same load
        with ThreadPoolExecutor(1, thread_name_prefix="hycoc-cold") as pool:
            opened = pool.submit(
                cold.open,
                OpenRequest(prompt_ids=np.asarray(conversation, np.int32), sampling=sampling, max_new_tokens=1),
            )
            if drafter.uses_slm:
                drafter.start(list(conversation))
                drafter.prefill()
            cold_ms = opened.result().prefill_ms
    finally:
        cold.close()
    rec = record_of(
        req.config, req.run, q, len(conversation), res, virtual_link=True, turn=2, chat=chat, server_busy_ms=busy
    )
    rec["prefill_ms_cold"] = float(cold_ms)
    rec["prefill_start"] = int(res.kept)  # the APPEND kept this many ids (the verifier may roll back to its snapshot)
    return rec
