"""Continuous batching of verification rounds and chunked prefills on the server's one worker thread
(docs/serving.md "Many devices: batched verification"; docs/design.md "Serving many devices").

The server's event loop hands every ROUND (and every prefill: an OPEN's prompt, an APPEND's turn) to a
`BatchScheduler` and awaits its answer. One scheduler task forms steps from what is queued and runs each on the
worker thread, where the model lives:

    a step = the queued rounds, oldest first, up to max_batch_rows tree rows (at least one round, one per
             session), verified in ONE forward (`hycoc.verifier.batch.verify_batch`)
           + prefill chunks of the queued prefills, oldest first, up to engine.prefill_chunk positions in all
             (at least one chunk): several short prompts per step, a long one chunk by chunk; at most
             ``max_prefills`` prefills are under way at once (begun and not finished: each holds a chunk's rows
             and an APPEND's undo copy of its sliding layers, which the server reserves once per such slot), the
             others wait in arrival order

Waiting: once a round is queued the scheduler waits at most ``max_batch_wait_ms`` from its arrival for more, and
dispatches at once when the rows reach ``max_batch_rows`` or every open session has a round queued (nobody else
can join). A round that arrives while a step runs joins the next step. A long prompt's prefill advances one chunk
per step, so other sessions' rounds run between its chunks instead of waiting for the whole prompt; short prompts
share a step's prefill budget (as vLLM's chunked prefill shares max_num_batched_tokens), so N devices opening at
once are prefilled in about N x prompt / prefill_chunk steps, not N steps (measured before the budget: 64 toy
sessions opening together waited a median 8.9 s for their OPEN, one prefill per ~150 ms step).

Errors stay per session: a session's bad round gets its own error (it is checked in `Session.begin_round` before
the forward); only a failure of the shared forward reaches every round in it.

`StepReport` tells the server what each step did (for /metrics): rows and sessions of its forward, and the queue
wait of each round (arrival -> its step starting on the worker).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from hycoc.protocol import wire
from hycoc.protocol.messages import DraftTree

from .allowance import AllowanceRule
from .batch import BatchStats, RowBudget, verify_batch
from .batch_policy import batch_ready, take_rounds
from .engine import Session
from .prefill_job import PrefillJob


@dataclass
class StepReport:
    """One step: ``stats`` of its batched forward (rows, sessions, ms; rows == 0 without rounds), ``waits``: seconds
    each round of the forward waited (arrival -> the step starting on the worker; rounds refused before the forward
    and retries are not counted), ``prefill_chunks``: prefill chunks run (of one or more sessions),
    ``prefills_active``: prefills begun and not finished after the step (<= max_prefills)."""

    stats: BatchStats
    waits: list[float] = field(default_factory=list)
    prefill_chunks: int = 0
    prefills_active: int = 0


@dataclass
class _Round:
    session: Session
    tree: DraftTree
    rows: int
    arrived: float
    future: asyncio.Future


@dataclass
class _Prefill:
    make: Callable[[], PrefillJob]
    future: asyncio.Future
    job: PrefillJob | None = None
    error: BaseException | None = None


class BatchScheduler:
    """Queues rounds and prefills, runs them as batched steps on the worker (module docstring).

    run: ``await run(fn, *args)`` runs fn on the engine's worker thread (the server's single-thread executor).
    max_batch_rows: most tree rows per forward (>= 1; one round is always taken even if larger).
    max_batch_wait_ms: how long the first queued round waits for others (>= 0).
    open_sessions: how many sessions are open now (when all have a round queued, no one else can join).
    on_step: called on the event loop with each step's `StepReport` (metrics).
    chain_length: K, the rows a cloud-mtp session's 1-row round grows to (root + K-chain) in the forward.
    prefill_budget: prompt positions prefilled per step over all queued prefills (>= 1; the server passes the
        engine's prefill_chunk, so a step's prefill work is at most one chunk's, as before, however many wait).
    row_budget: a `RowBudget`: the rows of a step's forward are chosen across its rounds by their tree scores
        (`hycoc.verifier.row_budget`); None (``tree_budget = "fixed"``): every tree verified as sent. Settable
        until the first step (the server measures its row cost on the worker before serving).
    allowance: an `AllowanceRule` (``allowance = "auto"``): each reply grants the session's next round the rows
        the rule sets from the load (`hycoc.verifier.allowance`), and every step teaches it; None: every reply
        grants the whole tree (tree_rows). Settable like row_budget.
    max_prefills: most prefills under way at once (>= 1; module docstring).
    """

    def __init__(
        self,
        run: Callable[..., Awaitable],
        *,
        max_batch_rows: int,
        max_batch_wait_ms: float,
        open_sessions: Callable[[], int],
        on_step: Callable[[StepReport], None],
        chain_length: int = 0,
        prefill_budget: int = 512,
        row_budget: RowBudget | None = None,
        allowance: AllowanceRule | None = None,
        max_prefills: int = 1,
    ):
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows = {max_batch_rows}: must be >= 1")
        if not max_batch_wait_ms >= 0:
            raise ValueError(f"max_batch_wait_ms = {max_batch_wait_ms}: must be >= 0")
        self._run = run
        self.max_batch_rows = int(max_batch_rows)
        self.max_batch_wait_s = float(max_batch_wait_ms) / 1e3
        self._open_sessions = open_sessions
        self._on_step = on_step
        self._chain_length = int(chain_length)
        if prefill_budget < 1:
            raise ValueError(f"prefill_budget = {prefill_budget}: must be >= 1")
        self.prefill_budget = int(prefill_budget)
        if max_prefills < 1:
            raise ValueError(f"max_prefills = {max_prefills}: must be >= 1")
        self.max_prefills = int(max_prefills)
        self.row_budget = row_budget
        self.allowance = allowance
        self._rounds: deque[_Round] = deque()
        self._prefills: deque[_Prefill] = deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the scheduling task on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        """Stop scheduling; queued requests get ConnectionAbortedError."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for item in list(self._rounds) + list(self._prefills):
            if not item.future.done():
                item.future.set_exception(ConnectionAbortedError("the verifier is shutting down"))
        self._rounds.clear()
        self._prefills.clear()

    async def round(self, session: Session, tree: DraftTree):
        """Verify one round in the next step. Returns (reply, reply frame bytes, tokens committed, whether a round
        ran) as the serial server's `_verify`; raises the session's error."""
        rows = session.place.forward_rows(len(tree.tokens), self._chain_length)
        fut = asyncio.get_running_loop().create_future()
        self._rounds.append(_Round(session, tree, rows, time.monotonic(), fut))
        self._wake.set()
        return await fut

    async def prefill(self, make: Callable[[], PrefillJob]) -> tuple[float, int]:
        """Run a prefill chunk by chunk between rounds. make: builds the job on the worker thread (the engine's
        checks run there; their errors are raised here). Returns the job's (prefill_ms, t)."""
        fut = asyncio.get_running_loop().create_future()
        self._prefills.append(_Prefill(make, fut))
        self._wake.set()
        return await fut

    # ------------------------------------------------------------------------------------------------ the loop

    async def _loop(self) -> None:
        while True:
            if not self._rounds and not self._prefills:
                self._wake.clear()
                await self._wake.wait()
            if self._rounds:
                await self._gather()
            batch = self._take()
            # prefills whose client went away are dropped; the rest share the step's prefill budget (`_step`)
            self._prefills = deque(p for p in self._prefills if not p.future.done())
            prefills = list(self._prefills)
            if not batch and not prefills:
                continue
            try:
                report, results = await self._run(
                    _step, batch, prefills, self.prefill_budget, self.row_budget, self.allowance, self.max_prefills
                )
            except BaseException as e:  # a failure outside the engine's handling, or cancelled (then re-raised)
                for item in batch + prefills:
                    if not item.future.done():
                        item.future.set_exception(e if isinstance(e, Exception) else ConnectionAbortedError(str(e)))
                gone = {id(p) for p in prefills}
                self._prefills = deque(p for p in self._prefills if id(p) not in gone)
                if isinstance(e, asyncio.CancelledError):
                    raise
                continue
            for item, result in zip(batch, results):
                if not item.future.done():
                    (item.future.set_exception if isinstance(result, BaseException) else item.future.set_result)(result)
            for prefill in prefills:
                if prefill.error is None and (prefill.job is None or not prefill.job.done):
                    continue  # not started this step, or chunks left
                self._prefills.remove(prefill)  # finished, or failed (its future gets the error)
                if not prefill.future.done():
                    if prefill.error is not None:
                        prefill.future.set_exception(prefill.error)
                    elif prefill.job is not None:  # always, past the check above
                        prefill.future.set_result(prefill.job.result)
            self._on_step(report)

    async def _gather(self) -> None:
        """Wait for more rounds: until max_batch_wait_ms after the oldest arrived, the rows reach max_batch_rows,
        or every open session has a round queued."""
        deadline = self._rounds[0].arrived + self.max_batch_wait_s
        while True:
            if batch_ready(self._rounds, self.max_batch_rows, self._open_sessions()):
                return
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    def _take(self) -> list[_Round]:
        """The rounds of the next step (`hycoc.verifier.batch_policy.take_rounds`): oldest first, up to
        max_batch_rows rows (at least one), one per session; rounds whose client went away are dropped."""
        batch, self._rounds = take_rounds(self._rounds, self.max_batch_rows, gone=lambda r: r.future.done())
        return batch


def _step(
    batch: list[_Round],
    prefills: list[_Prefill],
    prefill_budget: int,
    row_budget: RowBudget | None = None,
    allowance: AllowanceRule | None = None,
    max_prefills: int = 1,
):
    """Worker thread: the rounds of ``batch`` in one forward (rows chosen by ``row_budget`` when given; each reply
    granting its session's next round the rows ``allowance`` sets, the whole tree without one), then
    prefill chunks of ``prefills`` (oldest first) until ``prefill_budget`` positions ran (the first chunk always runs; a
    prefill whose next chunk would pass the budget waits for the next step, and so do the ones after it, keeping
    arrival order); a prefill begins (its job is made) only while fewer than ``max_prefills`` are under way. A prefill
    that fails gets ``error`` set and the others go on. Returns (StepReport, per round (reply, frame, committed,
    verified) or the exception)."""
    start = time.monotonic()
    stats = BatchStats()
    report = StepReport(stats)
    results: list = []
    if batch:
        before = [(len(r.session.tokens), r.session.rounds) for r in batch]
        engine = batch[0].session.engine
        replies = verify_batch(
            engine,
            [(r.session, r.tree.tokens, r.tree.parents, r.tree.seq, getattr(r.tree, "scores", None)) for r in batch],
            stats,
            row_budget,
        )
        if allowance is not None:
            _teach_allowance(allowance, batch, stats, before, replies)
        for r, reply, (n_tokens, n_rounds) in zip(batch, replies, before):
            if isinstance(reply, BaseException):
                results.append(reply)
                continue
            verified = r.session.rounds > n_rounds
            if verified:  # a new round (not a retry): grant the next one its rows
                reply = r.session.grant(reply, allowance)
            try:
                frame = wire.encode(reply, version=r.session.wire_version)  # the client's OPEN version
            except Exception as e:  # noqa: BLE001 -- that session's failure only
                results.append(e)
                continue
            if verified:
                report.waits.append(start - r.arrived)
            results.append((reply, frame, len(r.session.tokens) - n_tokens, verified))
    used = 0
    active = sum(1 for p in prefills if p.job is not None and not p.job.done)
    for prefill in prefills:
        try:
            if prefill.job is None:
                if active >= max_prefills or (report.prefill_chunks and used >= prefill_budget):
                    break
                prefill.job = prefill.make()
                active += 1
            n = min(prefill.job.engine.prefill_chunk, prefill.job.remaining)
            if report.prefill_chunks and used + n > prefill_budget:
                break
            prefill.job.step()
            used += n
            report.prefill_chunks += 1
            active -= prefill.job.done
        except Exception as e:  # noqa: BLE001 -- that prefill's own error, reported to its OPEN / APPEND
            active -= prefill.job is not None
            prefill.job, prefill.error = None, e
    report.prefills_active = active
    return report, results


def _teach_allowance(
    allowance: AllowanceRule, batch: list[_Round], stats: BatchStats, before: list[tuple[int, int]], replies: list
) -> None:
    """The step's lessons for the allowance rule: the scored device-drafted trees as sent (their per-rank values),
    with the tokens each new round committed (``before``: each session's (tokens, rounds) before the step; a
    retry or a failed round commits nothing to learn from), and the step's sessions (the load)."""
    for r, reply, (n_tokens, n_rounds) in zip(batch, replies, before):
        scores = getattr(r.tree, "scores", None)
        if scores is not None and r.session.place.trimmable and len(scores) == len(r.tree.tokens):
            verified = not isinstance(reply, BaseException) and r.session.rounds > n_rounds
            committed = len(r.session.tokens) - n_tokens if verified else None
            allowance.observe_tree(scores, r.tree.tokens, r.tree.parents, committed)
    allowance.observe_step(stats.sessions)
