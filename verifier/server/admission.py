"""Admission: the ledgers that decide whether a connection, a session or its KV may be admitted.

Each capacity limit of `hycoc.verifier.server.limits` is one ledger object here, in the spirit of TGI's permits
(``router/src/infer/mod.rs``: admission takes a slot from a semaphore, the slot is held for the request's life and
returned when it ends; the counter only records it). A refusal raises the limit's `ServerError` (its message has
the retry hint) and is counted through ``refused(kind)`` (``hycoc_refusals_total{kind}`` on /metrics); /metrics reads
the ledgers' totals, it never keeps its own copy.

    KvBudget         max_kv_bytes: KV bytes reserved; the prefill pool (max_prefills x a prefilling session's
                     transient, reserved at start), a `KvReservation` per session (grown by APPEND before its
                     prefill runs, by its undo copy too, and released on every path that ends the session or fails
                     the turn, after its memory is freed) and one per conversation snapshot: evictable, taken only
                     where there is room and given up (the snapshot dropped) when a session needs the room
    SessionSlots     max_sessions: a `SessionSlot` per OPEN from admission until the session ends
    ConnectionSlots  max_connections: one `Link` per TCP connection (the handshake and frame timeouts watch it)
    AuthFailures     auth_failures_per_minute: refused auth attempts per peer in a sliding 60 s window

All ledgers live on the server's event loop (one thread); /metrics and tests read their totals between events.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from aiohttp import web

from .errors import AuthRateLimited, KvBudgetExhausted, TooManySessions
from .limits import ServerLimits


class KvReservation:
    """One session's share of the `KvBudget`: ``nbytes`` reserved now. `grow` adds to it (refused like an OPEN when
    the budget has no room), `shrink` gives part back, `release` returns all of it (idempotent)."""

    def __init__(self, budget: KvBudget, nbytes: int):
        self._budget = budget
        self.nbytes = int(nbytes)
        self.spare = False  # made by `KvBudget.reserve_spare`
        budget._live.add(self)

    def grow(self, extra: int, request: str) -> int:
        """Reserve ``extra`` more bytes (<= 0: nothing). Returns the bytes added. Raises KvBudgetExhausted (counted
        as max_kv_bytes) naming ``request`` when the budget lacks them; nothing changes then."""
        if extra <= 0:
            return 0
        self._budget._take(int(extra), request)
        self.nbytes += int(extra)
        self._budget._live.add(self)
        self._budget.check()
        return int(extra)

    def shrink(self, nbytes: int) -> None:
        """Give ``nbytes`` (<= the reservation) back to the budget: a failed APPEND undoing its `grow`."""
        nbytes = min(int(nbytes), self.nbytes)
        if nbytes > 0:
            self.nbytes -= nbytes
            self._budget.reserved -= nbytes
            if not self.nbytes:
                self._budget._live.discard(self)
            self._budget.check()

    def release(self) -> None:
        """Return the whole reservation to the budget (the session ended); a second call does nothing."""
        self.shrink(self.nbytes)
        self._budget._live.discard(self)
        self._budget._evictable.pop(self, None)


class KvBudget:
    """The ``max_kv_bytes`` ledger: ``reserved`` bytes (always <= ``capacity``) over every open or opening session.

    capacity: max_kv_bytes. retry_after_s: the hint in a refusal's message. refused: called with "max_kv_bytes" on
    each refusal (the metrics' counter). peak: the most bytes ever reserved at once (<= capacity).

    Evictable reservations (conversation snapshots, `make_evictable`) hold spare room only: a reservation that does
    not fit gives up the least recently made evictable ones first (their ``drop`` frees the memory, then the bytes
    come back; ``evicted`` counts them); `pin` keeps one while its session's APPEND runs. ``lock`` is held while
    memory is dropped and its bytes given back, and by whoever samples held bytes against ``reserved`` (the
    server's worker thread), so a sample never sees bytes given back before they were freed.

    Invariant, checked (`check`) each time a reservation is made, grown, shrunk or released:
    0 <= reserved <= capacity, and reserved is the sum of the live `KvReservation`s' bytes."""

    def __init__(self, capacity: int, retry_after_s: float, refused: Callable[[str], None]):
        self.capacity = int(capacity)
        self.retry_after_s = float(retry_after_s)
        self.reserved = 0
        self.peak = 0
        self.evicted = 0
        self.lock = threading.Lock()
        self._live: set[KvReservation] = set()
        self._evictable: OrderedDict[KvReservation, Callable[[], None]] = OrderedDict()
        self._refused = refused

    @property
    def evictable_bytes(self) -> int:
        """Bytes held by evictable reservations now (pinned ones not counted)."""
        return sum(r.nbytes for r in self._evictable)

    def make_evictable(self, reservation: KvReservation, drop: Callable[[], None]) -> None:
        """Let ``reservation`` be given up when room is needed: ``drop()`` frees its memory first (called with
        ``lock`` held). The most recently made evictable is given up last."""
        self._evictable.pop(reservation, None)
        self._evictable[reservation] = drop

    def pin(self, reservation: KvReservation | None) -> None:
        """Keep ``reservation`` from being given up (until `make_evictable` again); None: nothing."""
        if reservation is not None:
            self._evictable.pop(reservation, None)

    def _make_room(self, nbytes: int) -> None:
        """Give up evictable reservations, oldest first, until ``nbytes`` more fit (none when they cannot)."""
        if self.reserved + nbytes <= self.capacity or self.reserved - self.evictable_bytes + nbytes > self.capacity:
            return
        while self.reserved + nbytes > self.capacity and self._evictable:
            reservation, drop = self._evictable.popitem(last=False)
            with self.lock:
                drop()
                reservation.release()
            self.evicted += 1

    def check(self) -> None:
        """Raise AssertionError (a bug in the server, never the client's doing) unless 0 <= reserved <= capacity
        and reserved equals the sum of the live reservations. Explicit, so ``python -O`` keeps it."""
        held = sum(r.nbytes for r in self._live)
        if not 0 <= self.reserved <= self.capacity or self.reserved != held:
            raise AssertionError(
                f"KV ledger broken: reserved = {self.reserved}, capacity (max_kv_bytes) = {self.capacity}, "
                f"live reservations hold {held}"
            )

    def _take(self, nbytes: int, request: str) -> None:
        self._make_room(nbytes)
        if self.reserved + nbytes > self.capacity:
            self._refused("max_kv_bytes")
            raise KvBudgetExhausted(
                f"{request}, {self.reserved} of max_kv_bytes = {self.capacity} are reserved; "
                f"retry after {self.retry_after_s:g} s, or ask for fewer max_new_tokens"
            )
        self.reserved += nbytes
        self.peak = max(self.peak, self.reserved)

    def reserve(self, nbytes: int, positions: int) -> KvReservation:
        """A new session's reservation of ``nbytes`` (its ``positions`` KV positions). Raises KvBudgetExhausted
        (counted) when it does not fit; nothing is reserved then. The ledger's invariant is checked on the way
        out (`check`)."""
        self._take(int(nbytes), f"this request needs {int(nbytes)} KV bytes ({positions} positions)")
        reservation = KvReservation(self, nbytes)
        self.check()
        return reservation

    def reserve_spare(self, nbytes: int) -> KvReservation | None:
        """A reservation of ``nbytes`` from room no one else holds (it gives up nothing, refuses nothing: None when
        it does not fit). For what a session may do without (a conversation snapshot)."""
        if nbytes <= 0 or self.reserved + int(nbytes) > self.capacity:
            return None
        self.reserved += int(nbytes)
        self.peak = max(self.peak, self.reserved)
        reservation = KvReservation(self, nbytes)
        reservation.spare = True
        self.check()
        return reservation

    @property
    def spare_bytes(self) -> int:
        """Bytes reserved from spare room now (`reserve_spare`: conversation snapshots)."""
        return sum(r.nbytes for r in self._live if r.spare)


class SessionSlot:
    """One held ``max_sessions`` slot; `release` returns it (idempotent)."""

    def __init__(self, slots: SessionSlots):
        self._slots, self.held = slots, True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._slots.in_use -= 1


class SessionSlots:
    """The ``max_sessions`` ledger: ``in_use`` slots (sessions open or being prefilled), at most ``capacity``."""

    def __init__(self, capacity: int, retry_after_s: float, refused: Callable[[str], None]):
        self.capacity = int(capacity)
        self.retry_after_s = float(retry_after_s)
        self.in_use = 0
        self._refused = refused

    def acquire(self) -> SessionSlot:
        """A slot for a new session. Raises TooManySessions (counted as max_sessions) when all are taken."""
        if self.in_use >= self.capacity:
            self._refused("max_sessions")
            raise TooManySessions(
                f"{self.in_use} sessions are open, max_sessions = {self.capacity}; retry after {self.retry_after_s:g} s"
            )
        self.in_use += 1
        if not 0 < self.in_use <= self.capacity:
            raise AssertionError(f"session ledger broken: in_use = {self.in_use}, max_sessions = {self.capacity}")
        return SessionSlot(self)


class Link:
    """One TCP connection as the limits see it (`ConnectionSlots`). Times from time.monotonic()."""

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.connected = time.monotonic()
        self.opened = False  # an OPEN frame arrived: the handshake timeout no longer applies
        self.upgraded = False  # a WebSocket: bytes arriving now belong to a frame
        self.frame_since: float | None = None  # when the bytes of a frame not yet delivered began to arrive
        self.ws: web.WebSocketResponse | None = None  # the aiohttp WebSocketResponse once upgraded
        self.kicked = False


class ConnectionSlots:
    """The ``max_connections`` ledger: one `Link` per admitted TCP connection (``active`` of them)."""

    def __init__(self, capacity: int, refused: Callable[[str], None]):
        self.capacity = int(capacity)
        self.links: dict[asyncio.Transport, Link] = {}
        self._refused = refused

    @property
    def active(self) -> int:
        return len(self.links)

    def admit(self, transport: asyncio.Transport) -> Link | None:
        """The new connection's `Link`, or None (counted as max_connections) when ``capacity`` are open."""
        if len(self.links) >= self.capacity:
            self._refused("max_connections")
            return None
        link = self.links[transport] = Link(transport)
        return link

    def release(self, link: Link) -> None:
        self.links.pop(link.transport, None)


class AuthFailures:
    """The ``auth_failures_per_minute`` ledger: monotonic times of refused auth attempts per peer, last 60 s."""

    WINDOW_S = 60.0

    def __init__(self, per_minute: int, refused: Callable[[str], None]):
        self.per_minute = int(per_minute)
        self._times: dict[str, deque] = {}
        self._refused = refused

    def wait(self, peer: str) -> float:
        """Seconds until ``peer`` may try auth again (0 when it may now)."""
        times = self._times.get(peer)
        if not times:
            return 0.0
        now = time.monotonic()
        while times and now - times[0] > self.WINDOW_S:
            times.popleft()
        if not times:
            del self._times[peer]
            return 0.0
        if len(times) < self.per_minute:
            return 0.0
        return self.WINDOW_S - (now - times[0])

    def refuse_if_limited(self, peer: str) -> float:
        """Seconds ``peer`` must wait, counted as a refusal (auth_failures_per_minute) when > 0."""
        wait = self.wait(peer)
        if wait > 0:
            self._refused("auth_failures_per_minute")
        return wait

    def check(self, peer: str) -> None:
        """Raise AuthRateLimited (counted) when ``peer`` is over the limit, before any token is compared."""
        wait = self.refuse_if_limited(peer)
        if wait > 0:
            raise AuthRateLimited(
                f"{self.per_minute} refused auth attempts from this address within a minute; "
                f"retry after {math.ceil(wait)} s"
            )

    def record(self, peer: str) -> None:
        """One refused auth attempt by ``peer``."""
        self._times.setdefault(peer, deque()).append(time.monotonic())


class Admission:
    """The server's four ledgers over one `ServerLimits`; ``refused(kind)`` counts each refusal."""

    def __init__(self, limits: ServerLimits, refused: Callable[[str], None]):
        self.kv = KvBudget(limits.max_kv_bytes, limits.retry_after_s, refused)
        self.sessions = SessionSlots(limits.max_sessions, limits.retry_after_s, refused)
        self.connections = ConnectionSlots(limits.max_connections, refused)
        self.auth = AuthFailures(limits.auth_failures_per_minute, refused)
