"""What a simulated device of `hycoc capacity` sends (`hycoc.bench.capacity.simulation`'s devices): its requests and
rounds.

A `SimRequest` gives a device's rounds one at a time (`next_round`), each a `SimRound` (the tree as the row budget
sees it, the rows sent, the drafting before it, the path the verifier accepts and what it commits), learns what
was committed (`commit`) and the next tree's allowance (`allow`), and says what its device reports in an OPEN
(`drafting_ms`: the drafting ms per round without and with the SLM pass, protocol 6). Three kinds: `TraceRequest`
replays a recorded request as `hycoc loadtest` does; `SyntheticRequest` draws rounds at a MAT; `TreeRequest` draws
scored trees fitted to a MAT and drafts them to the allowance (the real-shape projection's device). A `Workload`
gives each device its k-th request; `FrameBytes` the wire bytes its frames take on the link.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hycoc.bench.loadtest.trace import RequestTrace, tree_at
from hycoc.verifier.draft_place import PLACES


class CapacityError(ValueError):
    """A simulation or capacity search that cannot run as asked (a bad input, an unreachable target). The message
    is one line naming the input and the fix."""


# ---- what a device sends ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimRound:
    """One round a device sends. tree: (scores float (R,) or None, tokens int (R,), parents int (R,)) as the
    budget sees it; rows: R as sent (cloud-mtp: 1); device_ms: the drafting before it, ms; path: the recorded
    accepted path as row indices of this tree (root excluded, root-to-leaf order); committed: the tokens that
    path and its bonus commit (len(path) + 1)."""

    tree: tuple
    rows: int
    device_ms: float
    path: tuple[int, ...]
    committed: tuple[int, ...]


class SimRequest(ABC):
    """One request of a device: ``prompt_len`` tokens, ``draft_place``, and its rounds (`next_round`), which depend
    on what was committed so far (`commit`). Subclasses: `TraceRequest`, `SyntheticRequest`, `TreeRequest`."""

    prompt_len: int = 1
    draft_place: str = "device"

    @abstractmethod
    def next_round(self) -> SimRound | None:
        """The next round to send, or None when the request has none left."""

    @abstractmethod
    def commit(self, tokens) -> None:
        """What the round just answered committed (its path tokens and bonus)."""

    @abstractmethod
    def finished(self) -> bool:
        """Whether the request has no round left (the verifier's reply would say finished)."""

    def allow(self, rows: int) -> None:  # noqa: B027  (an optional hook: most requests ignore the allowance)
        """The last reply's allowance: the rows the next round may hold (protocol 6). Requests that do not draft
        to an allowance (recorded trees, fixed-size synthetic ones) ignore it."""

    def drafting_ms(self) -> tuple[float, float]:
        """What the device reports in its OPEN (protocol 6's ``draft_ms_floor``, ``draft_ms_tree``): its drafting
        ms per round without the SLM pass (at or below K + 1 rows) and with it; 0.0 where it does not know."""
        return 0.0, 0.0


def _sub_path(tokens: np.ndarray, parents: np.ndarray, path_rows: tuple[int, ...], d: int) -> tuple[int, ...]:
    """The recorded path below depth ``d`` as row indices of the sub-tree `tree_at` re-roots at path row d - 1
    (its rows in order, the node first): the rows path_rows[d:] renumbered."""
    if d == 0:
        return tuple(int(r) for r in path_rows)
    node = path_rows[d - 1]
    inside = np.zeros(len(tokens), bool)
    inside[node] = True
    for j in range(node + 1, len(tokens)):
        inside[j] = inside[parents[j]]
    index = np.full(len(tokens), -1, np.int64)
    rows = np.nonzero(inside)[0]
    index[rows] = np.arange(len(rows))
    return tuple(int(index[r]) for r in path_rows[d:])


class TraceRequest(SimRequest):
    """A recorded request replayed as `hycoc loadtest` replays it: the tree at the committed text's position
    (`hycoc.bench.loadtest.trace.tree_at`), the recorded drafting time (or ``device_ms``, or scaled by
    ``device_scale``). Requests whose rounds lack the committed tokens (hand-made traces) replay by round."""

    def __init__(self, req: RequestTrace, device_ms: float | None = None, device_scale: float = 1.0):
        self.req, self.fixed_ms, self.scale = req, device_ms, float(device_scale)
        self.prompt_len = len(req.prompt)
        self.draft_place = req.draft_place
        self.produced: list[int] = []
        self.seq = 0
        self.total = sum(len(r.committed) for r in req.rounds)

    def next_round(self) -> SimRound | None:
        if self.total and len(self.produced) >= self.total:
            return None
        found = tree_at(self.req, self.produced, self.seq)
        if found is None:
            return None
        rt, tokens, parents, scores = found
        if rt.committed:
            start = 0
            for r in self.req.rounds:  # where round rt starts in the output
                if r is rt:
                    break
                start += len(r.committed)
            d = len(self.produced) - start
            path = _sub_path(np.asarray(rt.tokens), np.asarray(rt.parents), rt.path_rows, d)
            committed = tuple(rt.committed[d:])
        else:
            path, committed = tuple(rt.path_rows), tuple(rt.committed) or (0,) * (len(rt.path_rows) + 1)
        ms = self.fixed_ms if self.fixed_ms is not None else rt.device_ms * self.scale
        rows = PLACES[self.draft_place].tree_rows(len(tokens))
        return SimRound((scores, tokens, parents), rows, float(ms), path, committed)

    def commit(self, tokens) -> None:
        self.produced.extend(int(t) for t in tokens)
        self.seq += 1

    def drafting_ms(self) -> tuple[float, float]:
        """As `hycoc loadtest` reports it: the recording's (`RequestTrace.drafting_ms`: mean head_ms and mean
        device_ms) x the scale, or the fixed drafting time for both."""
        if self.fixed_ms is not None:
            return float(self.fixed_ms), float(self.fixed_ms)
        floor, tree = self.req.drafting_ms()
        return floor * self.scale, tree * self.scale

    def finished(self) -> bool:
        return self.next_round() is None


class SyntheticRequest(SimRequest):
    """A request of ``output_tokens`` tokens whose rounds each commit ``mat`` tokens on average (a seeded draw of
    floor(mat) or floor(mat) + 1, mean ``mat``), trees of ``rows`` rows without scores (verified as sent), the
    device drafting ``device_ms`` per round (``exponential``: an exponential draw of that mean, seeded): the
    real-shape projection's workload, where no recording exists."""

    def __init__(
        self,
        prompt_len: int,
        output_tokens: int,
        mat: float,
        rows: int,
        device_ms: float,
        draft_place: str,
        rng: np.random.Generator,
        exponential: bool = False,
    ):
        if not mat >= 1:
            raise CapacityError(f"MAT = {mat}: a round commits at least its bonus token (>= 1)")
        self.prompt_len, self.left, self.mat, self.rows = int(prompt_len), int(output_tokens), float(mat), int(rows)
        self.device_ms, self.draft_place, self.rng = float(device_ms), draft_place, rng
        self.exponential = exponential

    def next_round(self) -> SimRound | None:
        if self.left <= 0:
            return None
        base = int(math.floor(self.mat))
        n = min(self.left, base + int(self.rng.random() < self.mat - base))
        rows = PLACES[self.draft_place].tree_rows(self.rows)
        tree = (None, np.zeros(self.rows, np.int32), np.arange(-1, self.rows - 1))
        ms = self.rng.exponential(self.device_ms) if self.exponential else self.device_ms
        return SimRound(tree, rows, float(ms), tuple(range(1, n)), (0,) * n)

    def commit(self, tokens) -> None:
        self.left -= len(tokens)

    def finished(self) -> bool:
        return self.left <= 0

    def drafting_ms(self) -> tuple[float, float]:
        """Its mean drafting time, with and without an SLM pass alike (its trees do not follow an allowance)."""
        return self.device_ms, self.device_ms


class TreeRequest(SimRequest):
    """A request of ``output_tokens`` tokens whose rounds are drawn from a `hycoc.bench.capacity.trees.TreePool`
    (scored trees, their acceptance fitted to a MAT) and drafted to the last reply's allowance: rows =
    min(allowance, ``ceiling``) (`allow`; the ceiling before any reply), the drafting time
    ``phone_ms(rows)`` (ms; the SLM pass skipped at or below ``floor`` rows, each such round leaving ``deferred_ms``
    of SLM catch-up that the next round above the floor pays), the accepted path the pool's walk over the rows
    sent.
    The real-shape projection's device with scores (`hycoc.bench.capacity.run.tree_workload`)."""

    def __init__(
        self,
        prompt_len: int,
        output_tokens: int,
        pool,
        ceiling: int,
        phone_ms: Callable[[int], float],
        draft_place: str,
        rng: np.random.Generator,
        *,
        floor: int = 0,
        deferred_ms: float = 0.0,
    ):
        self.prompt_len, self.left, self.pool = int(prompt_len), int(output_tokens), pool
        self.ceiling = self.rows = int(ceiling)
        self.phone_ms, self.draft_place, self.rng = phone_ms, draft_place, rng
        self.floor, self.deferred_ms, self.owed_ms = int(floor), float(deferred_ms), 0.0

    def allow(self, rows: int) -> None:
        self.rows = max(1, min(self.ceiling, int(rows)))

    def drafting_ms(self) -> tuple[float, float]:
        """The device-time estimate it drafts by: ``phone_ms`` at the floor (no SLM pass; 0.0 without a chain)
        and at its ceiling (the SLM pass)."""
        floor = float(self.phone_ms(self.floor)) if self.floor else 0.0
        return floor, float(self.phone_ms(self.ceiling))

    def next_round(self) -> SimRound | None:
        if self.left <= 0:
            return None
        tree, path = self.pool.sample(self.rng, self.rows)
        n = min(self.left, len(path) + 1)
        ms = float(self.phone_ms(self.rows))
        if self.rows <= self.floor:  # no SLM pass: its catch-up of this round's tokens is owed to the next one
            self.owed_ms += self.deferred_ms
        else:
            ms, self.owed_ms = ms + self.owed_ms, 0.0
        return SimRound(tree, self.rows, ms, path[: n - 1], (0,) * n)

    def commit(self, tokens) -> None:
        self.left -= len(tokens)

    def finished(self) -> bool:
        return self.left <= 0


@dataclass
class Workload:
    """What devices do: ``requests(device, k)`` gives device ``device``'s k-th request (a fresh `SimRequest`)."""

    requests: Callable[[int, int], SimRequest]
    label: str = ""


def trace_workload(
    per_device: list[list[RequestTrace]], device_ms: float | None = None, device_scale: float = 1.0
) -> Workload:
    """Devices replaying recorded requests as `hycoc.bench.loadtest.run._device` does: device i plays its list from
    index i onward, cyclically."""
    return Workload(
        lambda i, k: TraceRequest(per_device[i][(i + k) % len(per_device[i])], device_ms, device_scale),
        "recorded rounds",
    )


# ---- the link and the frames ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FrameBytes:
    """Wire bytes of a round (whole frames, `hycoc.protocol.wire`): up = up_fixed + up_per_row x rows; down =
    down_fixed + down_per_row x rows + down_per_token x committed. ``open_up`` / ``open_down``: the OPEN and
    OPENED frames (prompt ids ride in OPEN: 4 bytes each)."""

    up_fixed: int = 16 + 15
    up_per_row: int = 8
    down_fixed: int = 16 + 30
    down_per_row: int = 4
    down_per_token: int = 0
    open_fixed: int = 64
    open_down: int = 64

    def up(self, rows: int) -> int:
        return self.up_fixed + self.up_per_row * rows

    def down(self, rows: int, committed: int) -> int:
        return self.down_fixed + self.down_per_row * rows + self.down_per_token * committed


__all__ = [
    "CapacityError",
    "FrameBytes",
    "SimRequest",
    "SimRound",
    "SyntheticRequest",
    "TraceRequest",
    "TreeRequest",
    "Workload",
    "trace_workload",
]
