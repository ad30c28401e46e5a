"""How the server's scheduler forms a batched step from its queue of rounds (docs/serving.md "Many devices: batched
verification"), as functions of the queue alone, with no clock, engine or torch: `verifier/scheduler.py`'s
`BatchScheduler` runs them on its asyncio queue, and `hycoc capacity`'s simulator (hycoc/bench/capacity/simulation.py)
on its simulated one, so the simulated steps are formed by the server's own rule.

A queued round is any object with ``session`` (compared by identity) and ``rows`` (the rows it adds to the forward:
its tree's, or root + K chain for a cloud-mtp session).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar


class QueuedRound(Protocol):
    """What the policy reads of a queued round: its session (compared by identity) and the rows it adds."""

    @property
    def session(self) -> object: ...

    @property
    def rows(self) -> int: ...


R = TypeVar("R", bound=QueuedRound)


def batch_ready(queued: Iterable, max_batch_rows: int, open_sessions: int) -> bool:
    """Whether the scheduler stops waiting for more rounds before its ``max_batch_wait_ms``: the queued rows reach
    ``max_batch_rows``, or every one of ``open_sessions`` open sessions has a round queued (no one else can join)."""
    queued = list(queued)
    return sum(r.rows for r in queued) >= max_batch_rows or len({id(r.session) for r in queued}) >= open_sessions


def take_rounds(
    queue: deque[R], max_batch_rows: int, gone: Callable[[R], bool] | None = None
) -> tuple[list[R], deque[R]]:
    """The rounds of the next step: ``queue``'s rounds oldest first, one per session, up to ``max_batch_rows`` rows
    (at least one round, even a larger one); rounds for which ``gone(round)`` is true (their client went away) are
    dropped. Returns (the step's rounds, the rounds left queued, in their order). ``queue`` is emptied."""
    batch: list[R] = []
    rest: deque[R] = deque()
    rows, seen = 0, set()
    while queue:
        r = queue.popleft()
        if gone is not None and gone(r):
            continue
        if id(r.session) in seen or (batch and rows + r.rows > max_batch_rows):
            rest.append(r)
            continue
        batch.append(r)
        rows += r.rows
        seen.add(id(r.session))
    return batch, rest


__all__ = ["QueuedRound", "batch_ready", "take_rounds"]
