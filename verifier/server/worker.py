"""The engine's one worker thread, and the batch scheduler in front of it, as the server's event loop sees them.

The model is shared by all sessions and the engine is not thread-safe, so every engine call (prefill, verify,
free) runs on ONE worker thread (a single-thread executor: the lock the model needs, kept even when the awaiting
connection goes away). ``batching="batched"`` puts rounds and prefills in the queue of a
`hycoc.verifier.scheduler.BatchScheduler` (rounds of sessions ready together run as one forward; a long prompt is
prefilled one chunk per step between them); ``"serial"`` runs one engine call at a time in arrival order.

Shutdown. `EngineWorker.stop` first closes the door (``stopping``: every later `run`, `round` or `prefill` raises
`ShuttingDown` on the event loop, so a frame that arrives after the stop began never reaches the engine), then stops
the scheduler (its queued requests get ShuttingDown), then lets the worker finish what it already runs.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from hycoc import serving_limits
from hycoc.protocol.messages import DraftTree

from ..allowance import AllowanceRule
from ..batch import RowBudget
from ..engine import PrefillJob, Session, VerifierEngine
from ..scheduler import BatchScheduler, StepReport
from .errors import ShuttingDown

#: Verification modes (recipe verifier.batching; `hycoc.serving_limits.BATCHING_MODES`, the one list) and the
#: batching defaults: 16 trees of 33 rows per forward, and 2 ms of waiting for others (a toy round is ~10-25 ms; a
#: GPU round ~20 ms).
BATCHING_MODES = serving_limits.BATCHING_MODES
DEFAULT_MAX_BATCH_ROWS = serving_limits.DEFAULT_MAX_BATCH_ROWS
DEFAULT_MAX_BATCH_WAIT_MS = serving_limits.DEFAULT_MAX_BATCH_WAIT_MS
DEFAULT_MAX_PREFILLS = serving_limits.DEFAULT_MAX_PREFILLS


class EngineWorker:
    """The engine's worker thread (and, batched, its scheduler), started on the running event loop.

    engine: the shared `VerifierEngine`. batching, max_batch_rows, max_batch_wait_ms: `VerifierServer`'s.
    open_sessions: how many sessions are open now (the scheduler stops waiting once each has a round queued).
    on_step: called on the event loop with each batched step's `StepReport` (metrics).
    row_budget: the batched scheduler's `RowBudget` (None: trees verified as sent); `set_row_budget` changes it.
    allowance: the batched scheduler's `AllowanceRule` (None: every reply grants the whole tree); `set_allowance`.
    max_prefills: most prefills under way at once (batched). after_call: called on the worker thread after each
    engine call `run` made (the server samples the KV held there), or None.
    """

    def __init__(
        self,
        engine: VerifierEngine,
        *,
        batching: str,
        max_batch_rows: int,
        max_batch_wait_ms: float,
        open_sessions: Callable[[], int],
        on_step: Callable[[StepReport], None],
        row_budget: RowBudget | None = None,
        allowance: AllowanceRule | None = None,
        max_prefills: int = DEFAULT_MAX_PREFILLS,
    ):
        self.engine = engine
        self.max_prefills = int(max_prefills)
        self.after_call: Callable[[], None] | None = None
        self.row_budget = row_budget
        self.allowance = allowance
        self.batching = batching
        self.max_batch_rows = max_batch_rows
        self.max_batch_wait_ms = max_batch_wait_ms
        self._open_sessions = open_sessions
        self._on_step = on_step
        self._executor: ThreadPoolExecutor | None = None
        self.scheduler: BatchScheduler | None = None
        self.stopping = False
        self._closing = False  # the executor takes no more work; its thread may still run one
        self._late: list[Callable] = []  # frees queued while it finishes: run once its thread has ended

    @property
    def started(self) -> bool:
        return self._executor is not None

    def start(self) -> None:
        """Start the worker thread and, batched, the scheduler task. Raises RuntimeError if already started."""
        if self._executor is not None:
            raise RuntimeError("VerifierServer.start_engine: already started; call stop() first")
        self.stopping = self._closing = False
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hycoc-verifier")
        if self.batching == "batched":
            self.scheduler = BatchScheduler(
                self.run,
                max_batch_rows=self.max_batch_rows,
                max_batch_wait_ms=self.max_batch_wait_ms,
                open_sessions=self._open_sessions,
                on_step=self._on_step,
                chain_length=self.engine.chain_length,
                prefill_budget=self.engine.prefill_chunk,
                row_budget=self.row_budget,
                allowance=self.allowance,
                max_prefills=self.max_prefills,
            )
            self.scheduler.start()

    def set_row_budget(self, budget: RowBudget | None) -> None:
        """Use ``budget`` for the batched steps from now on (the server sets it once its row cost is measured)."""
        self.row_budget = budget
        if self.scheduler is not None:
            self.scheduler.row_budget = budget

    def set_allowance(self, rule: AllowanceRule | None) -> None:
        """Use ``rule`` to grant each reply's allowance from now on (None: the whole tree)."""
        self.allowance = rule
        if self.scheduler is not None:
            self.scheduler.allowance = rule

    def _check_open(self) -> None:
        if self.stopping or self._executor is None:
            raise ShuttingDown(
                "the verifier is shutting down: this frame did not reach the engine; open a new "
                "session on another verifier (or this one once it is back)"
            )

    async def run(self, fn: Callable, *args):
        """``fn(*args)`` on the worker thread (one at a time, in submission order). Raises ShuttingDown once
        `stop` began (fn never runs then)."""
        self._check_open()
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Callable, args: tuple):
        """Worker thread: ``fn(*args)``, then `after_call` (whatever fn did)."""
        try:
            return fn(*args)
        finally:
            if self.after_call is not None:
                self.after_call()

    async def round(self, session: Session, tree: DraftTree):
        """One round (batched mode, `BatchScheduler.round`). Raises ShuttingDown once `stop` began (also for a
        round still queued then)."""
        self._check_open()
        if self.scheduler is None:
            raise RuntimeError("round() is batched mode's: this worker runs serial")
        try:
            return await self.scheduler.round(session, tree)
        except ConnectionAbortedError:
            self._check_open()
            raise

    async def prefill(self, make: Callable[[], PrefillJob]) -> tuple[float, int]:
        """A chunked prefill (batched mode, `BatchScheduler.prefill`). Raises ShuttingDown once `stop` began (also
        for a prefill still queued then)."""
        self._check_open()
        if self.scheduler is None:
            raise RuntimeError("prefill() is batched mode's: this worker runs serial")
        try:
            return await self.scheduler.prefill(make)
        except ConnectionAbortedError:
            self._check_open()
            raise

    def submit(self, fn: Callable) -> None:
        """Queue ``fn()`` on the worker after what it runs (a session's free). While `stop` waits for the worker
        it is kept for after the thread ended; with no worker at all it runs here (nothing else can touch the
        engine then)."""
        if self._executor is not None and not self._closing:
            self._executor.submit(fn)
        elif self._executor is not None:
            self._late.append(fn)
        else:
            fn()

    async def stop(self) -> None:
        """Refuse new work, stop the scheduler (queued requests get ShuttingDown), finish the worker's queue."""
        self.stopping = True
        if self.scheduler is not None:
            scheduler, self.scheduler = self.scheduler, None
            await scheduler.stop()
        if self._executor is not None:
            self._closing = True
            await asyncio.get_running_loop().run_in_executor(None, self._executor.shutdown)
            self._executor = None  # the worker thread has ended: the frees queued meanwhile run here
            late, self._late = self._late, []
            for fn in late:
                fn()
