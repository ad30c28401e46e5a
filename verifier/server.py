"""The verifier's network server: the wire protocol over WebSocket, plus ``/healthz`` and ``/metrics`` (issue 3).

One aiohttp application on one port (DESIGN.md "Wire protocol"; the device connects with ``--server ws://HOST:PORT``):

    GET /  (WebSocket)  one session per connection, binary frames of `hycoc.protocol.wire`:
                        OPEN -> prefill -> OPENED; ROUND -> REPLY, one per round; after a finished reply, APPEND (the
                        next turn, KV kept) -> OPENED; CLOSE (or a disconnect) frees the KV
    GET /healthz        JSON: status, model, sessions, protocol_version and the limits a client must respect
    GET /metrics        Prometheus text exposition (format 0.0.4), counters over the server's lifetime

Validation. Every frame is decoded with `hycoc.protocol.wire.decode` against the session's `Limits` (vocabulary, tree rows,
max context, max frame bytes), so a bad parent, a cycle, a token outside the vocabulary, a wrong row count, an
oversize frame, a prompt longer than the context, an unknown message type or a wrong protocol version each gets an
ERROR frame with the wire's code (``bad_parent``, ``token_out_of_vocab``, ``wrong_row_count``, ``frame_too_large``,
``context_overflow``, ``unknown_message_type``, ``unsupported_version``, ...). The engine's own checks add
``bad_seq``, ``bad_root``, ``finished`` (`hycoc.verifier.errors`); this module adds the session-level codes of
`ServerError`'s subclasses. A failed frame changes nothing: decoding happens before the engine is called, and the
engine restores its cache and sampler when a round fails (`Session.verify`). Errors never touch other connections.

Auth. With ``auth_token`` set, an OPEN must present it, in the frame's ``auth_token`` or in the WebSocket upgrade's
``Authorization: Bearer T`` header; every token presented must match (compared in constant time). A missing token
gets ``auth_required``, a wrong one ``auth_refused``; both close the connection (WebSocket code 1008).
``/healthz`` and ``/metrics`` carry no secrets and need no token.

Retries. Rounds carry a sequence number. The same frame again with the seq of the last answered round gets the same
reply bytes again without touching the engine (idempotent retry); any other seq gets ``bad_seq``.

Concurrency. The model is shared by all sessions and the engine is not thread-safe, so every engine call (prefill,
verify, free) runs on ONE worker thread (a single-thread executor: the lock the model needs, kept even when the
awaiting connection goes away), while the event loop keeps accepting frames, answering health checks and
validating. ``batching="batched"`` (the default; recipe ``verifier.batching``) puts rounds and prefills in the queue
of a `hycoc.verifier.scheduler.BatchScheduler`: the rounds of sessions ready together (up to ``max_batch_rows``
rows, waiting at most ``max_batch_wait_ms`` for others) run as ONE forward (`hycoc.verifier.batch.verify_batch`)
and a long prompt is prefilled one ``prefill_chunk`` per step between them; ``batching="serial"`` runs one engine
call at a time in arrival order (the server before issue 14). /metrics has the histograms
``hycoc_batch_rows`` (rows per forward), ``hycoc_batch_sessions`` (sessions per forward) and
``hycoc_queue_wait_seconds`` (a round's arrival -> the start of its forward's step), in both modes. A client that disconnects mid-round: its round finishes on the worker, the reply is dropped, and the
session's KV is freed right after (the free is queued on the same worker, so it runs after the round).

Frame size. aiohttp's own WebSocket limit is set to twice the incoming frame limit so that a frame above the wire
limit still reaches `hycoc.protocol.wire.decode_header` and gets a ``frame_too_large`` ERROR frame; only frames above twice
the limit are cut by aiohttp (WebSocket close code 1009, no frame).

Limits (DESIGN.md "Limits"; `ServerLimits`, each a recipe key in ``[verifier]`` with a default). Every refusal
is counted in ``hycoc_refusals_total{kind=...}`` on /metrics, kind = the limit's name:

    handshake_timeout   10 s   TCP connect -> the WebSocket's first frame (OPEN); silent TCP, trickled headers and a
                               silent upgraded socket are closed (ERROR handshake_timeout when a WebSocket is up)
    frame_timeout       30 s   a frame must complete once its first bytes arrived (ERROR frame_timeout, close)
    idle_timeout       300 s   an open session without a frame: KV freed, ERROR idle_timeout, close
    max_connections     256    TCP connections at once; more get ``HTTP 503`` with ``Retry-After`` and are closed
    max_sessions         64    open (or opening) sessions; an OPEN over it gets ERROR too_many_sessions
    max_kv_bytes      8 GiB    KV reserved by sessions: what a session holds at (prompt + max_new_tokens + B + 1,
                               up to max_context) positions, sliding layers capped at their window + B + 1
                               (`VerifierEngine.session_kv_bytes`); an OPEN over it gets ERROR kv_budget_exhausted
    auth_failures_per_minute 10  refused auth attempts per peer address; more get ``HTTP 429`` at the upgrade and
                               ERROR auth_rate_limited on OPEN, before any token is compared
    retry_after_s        5 s   the hint in ``Retry-After`` and in the message of the three capacity refusals

Incoming frames are never larger than an OPEN with a max_context prompt and the longest auth token, so that is
the frame limit this server reads with (`open_frame_bytes`), whatever ``max_frame_bytes`` (which bounds replies)
says: an unauthenticated client cannot make it buffer more than twice that per connection.

Entry points: `serve` (blocking, for ``hycoc verify-server``), `VerifierServer.start` / ``stop`` (inside a running
loop), `ServerThread` (in-process on an ephemeral port, for tests and ``hycoc bench``). Front doors that own their sockets (Ray Serve's replicas) use
`VerifierServer.start_engine` and feed each accepted WebSocket, as a `Channel`, to
`VerifierServer.serve_connection`: the session loop, its idle and handshake timeouts and its close codes are this
module's, whatever the transport.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import signal
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, fields, replace
from typing import Callable, Protocol

from aiohttp import WSCloseCode, WSMsgType, web

from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, Close, DraftTree, Opened, OpenRequest

from .engine import Session, VerifierEngine
from .scheduler import BatchScheduler, StepReport

log = logging.getLogger("hycoc.verifier.server")

#: Verification modes of `VerifierServer` (recipe verifier.batching) and the batching defaults: 16 trees of 33 rows
#: per forward, and 2 ms of waiting for others (a toy round is ~10-25 ms; a GPU round ~20 ms).
BATCHING_MODES = ("batched", "serial")
DEFAULT_MAX_BATCH_ROWS = 528
DEFAULT_MAX_BATCH_WAIT_MS = 2.0

#: Prometheus text exposition format served at /metrics.
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


# --------------------------------------------------------------------------------------------------- errors


class ServerError(Exception):
    """A frame that is well formed but not acceptable in this connection's state. ``code`` goes into the ERROR
    frame (`hycoc.protocol.wire.error_reply` reads the class attribute); the message says what to do instead."""

    code = "server_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class AuthRequired(ServerError):
    """The server runs with an auth token and the OPEN presented none (neither frame nor header)."""

    code = "auth_required"


class AuthRefused(ServerError):
    """A presented auth token does not match the server's."""

    code = "auth_refused"


def _stop_ids(engine) -> tuple[int, ...]:
    """The verifier's stop ids for OPENED: the chat format's order, else sorted; (1,) for an engine with none."""
    fmt = getattr(engine, "chat_format", None)
    if fmt is not None:
        return tuple(fmt.stop_ids)
    return tuple(sorted(engine.eos_token_ids)) or (1,)


class NotOpened(ServerError):
    """A ROUND before the connection's OPEN was answered."""

    code = "not_opened"


class AlreadyOpen(ServerError):
    """A second OPEN on a connection: one session per connection; open another connection."""

    code = "already_open"


class UnexpectedMessage(ServerError):
    """A frame the server never receives (OPENED, REPLY, ERROR) or a WebSocket text message."""

    code = "unexpected_message"


class BadSessionId(ServerError):
    """A CLOSE naming another session than this connection's (0 means "this one")."""

    code = "bad_session_id"


class KeepSetMissing(ServerError):
    """A ``server-head`` session on an engine without a keep set (Table 5: the head drafts over the keep set)."""

    code = "no_keep_set"


class TooManySessions(ServerError):
    """An OPEN while ``max_sessions`` sessions are open; the message says when to retry."""

    code = "too_many_sessions"


class KvBudgetExhausted(ServerError):
    """An OPEN whose KV reservation would take the sessions' total past ``max_kv_bytes``."""

    code = "kv_budget_exhausted"


class AuthRateLimited(ServerError):
    """A peer that failed auth ``auth_failures_per_minute`` times within the last minute."""

    code = "auth_rate_limited"


class IdleTimeout(ServerError):
    """An open session that sent no frame for ``idle_timeout_s``: its KV was freed."""

    code = "idle_timeout"


class HandshakeTimeout(ServerError):
    """No first frame (OPEN) within ``handshake_timeout_s`` of connecting."""

    code = "handshake_timeout"


class FrameTimeout(ServerError):
    """A frame that did not complete within ``frame_timeout_s`` of its first bytes."""

    code = "frame_timeout"


_AUTH_ERRORS = (AuthRequired, AuthRefused, AuthRateLimited)
_CLOSING_ERRORS = _AUTH_ERRORS + (TooManySessions, KvBudgetExhausted)


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits (module docstring "Limits"; recipe ``[verifier]`` keys of the same names).

    handshake_timeout_s, frame_timeout_s, idle_timeout_s, retry_after_s: seconds, > 0. max_connections,
    max_sessions: counts >= 1. max_kv_bytes: bytes >= 1. auth_failures_per_minute: refused attempts per peer
    address within 60 s, >= 1. Raises ValueError naming the field for a value out of range.
    """

    handshake_timeout_s: float = 10.0
    frame_timeout_s: float = 30.0
    idle_timeout_s: float = 300.0
    max_connections: int = 256
    max_sessions: int = 64
    max_kv_bytes: int = 8 << 30
    auth_failures_per_minute: int = 10
    retry_after_s: float = 5.0

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"ServerLimits.{f.name} = {value!r}: must be a finite number > 0 "
                                 "(recipe [verifier] key of the same name)")

    @classmethod
    def from_recipe(cls, verifier) -> "ServerLimits":
        """The limits of a recipe's ``[verifier]`` section (`hycoc.recipe.Verifier`)."""
        return cls(**{f.name: getattr(verifier, f.name) for f in fields(cls)})


#: Refusal kinds counted in hycoc_refusals_total (the names of the limits).
REFUSAL_KINDS = ("handshake_timeout", "frame_timeout", "idle_timeout", "max_connections", "max_sessions",
                 "max_kv_bytes", "auth_failures_per_minute")


def open_frame_bytes(max_context: int) -> int:
    """Bytes of the largest OPEN frame a server with ``max_context`` positions accepts: header, fixed part, a
    prompt of max_context - 1 int32 ids and a 65,535-byte auth token (the largest frame a client ever sends)."""
    return wire.HEADER.size + 36 + 4 * max(max_context - 1, 1) + 65535


# --------------------------------------------------------------------------------------------------- metrics


@dataclass
class Histogram:
    """A Prometheus histogram (cumulative ``_bucket{le=...}`` series, ``_sum``, ``_count``) over fixed upper
    bounds ``bounds`` (increasing; +Inf is added). `observe` adds one value."""

    bounds: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self):
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        i = next((k for k, b in enumerate(self.bounds) if value <= b), len(self.bounds))
        self.counts[i] += 1
        self.total += value
        self.count += 1

    def samples(self) -> list[tuple[str, str, float | int]]:
        """(suffix, labels, value) per series, cumulative buckets first."""
        out, running = [], 0
        for bound, n in zip(list(self.bounds) + [math.inf], self.counts):
            running += n
            le = "+Inf" if bound == math.inf else _number(float(bound))
            out.append(("_bucket", f'{{le="{le}"}}', running))
        return out + [("_sum", "", float(self.total)), ("_count", "", self.count)]


#: Bucket bounds of the batching histograms (rows per forward, sessions per forward, queue wait in seconds).
ROWS_BUCKETS = (1, 2, 4, 8, 16, 33, 66, 132, 264, 528, 1056, 2112)
SESSIONS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


@dataclass
class Metrics:
    """Counters over the server's lifetime (all sessions, all draft places), rendered by `exposition`.

    MAT = tokens_committed / rounds counts the bonus token (paper App. G, as vLLM / SGLang / Spec-Bench).
    g = (server_ms + prefill_ms) / tokens_committed, the verifier's milliseconds per output token incl. prefill.
    """

    rounds: int = 0
    retries: int = 0
    sessions_total: int = 0
    sessions_active: int = 0
    tokens_committed: int = 0
    server_ms: float = 0.0
    prefill_ms: float = 0.0
    errors: Counter = field(default_factory=Counter)
    refusals: Counter = field(default_factory=Counter)
    connections_active: int = 0
    kv_bytes_reserved: int = 0
    batch_rows: Histogram = field(default_factory=lambda: Histogram(ROWS_BUCKETS))
    batch_sessions: Histogram = field(default_factory=lambda: Histogram(SESSIONS_BUCKETS))
    queue_wait: Histogram = field(default_factory=lambda: Histogram(WAIT_BUCKETS))

    def exposition(self) -> str:
        """The Prometheus text format (0.0.4): HELP and TYPE lines, then one sample per series."""
        mat = self.tokens_committed / self.rounds if self.rounds else math.nan
        g = (self.server_ms + self.prefill_ms) / self.tokens_committed if self.tokens_committed else math.nan
        families = [
            ("hycoc_rounds_total", "counter", "rounds verified (one tree forward each; retries not counted)",
             [("", self.rounds)]),
            ("hycoc_retries_total", "counter", "rounds answered again from the last reply (idempotent retry)",
             [("", self.retries)]),
            ("hycoc_sessions_active", "gauge", "sessions open now (each holds a KV cache)",
             [("", self.sessions_active)]),
            ("hycoc_sessions_total", "counter", "sessions opened (prefill done, OPENED sent)",
             [("", self.sessions_total)]),
            ("hycoc_tokens_committed_total", "counter", "output tokens committed, accepted path plus bonus",
             [("", self.tokens_committed)]),
            ("hycoc_mat", "gauge", "mean tokens committed per round, bonus included (NaN before the first round)",
             [("", mat)]),
            ("hycoc_server_ms_total", "counter", "verifier milliseconds spent in rounds",
             [("", self.server_ms)]),
            ("hycoc_prefill_ms_total", "counter", "verifier milliseconds spent in prefills",
             [("", self.prefill_ms)]),
            ("hycoc_g_ms_per_token", "gauge",
             "verifier milliseconds per committed token, prefill included (NaN before the first token)", [("", g)]),
            ("hycoc_errors_total", "counter", "ERROR frames sent, by code",
             [(f'{{kind="{kind}"}}', n) for kind, n in sorted(self.errors.items())]),
            ("hycoc_refusals_total", "counter", "connections, sessions or frames refused by a server limit, by limit",
             [(f'{{kind="{kind}"}}', self.refusals[kind]) for kind in REFUSAL_KINDS]),
            ("hycoc_connections_active", "gauge", "TCP connections open now (HTTP and WebSocket)",
             [("", self.connections_active)]),
            ("hycoc_kv_bytes_reserved", "gauge", "KV bytes reserved by the open sessions (max_kv_bytes budget)",
             [("", self.kv_bytes_reserved)]),
        ]
        histograms = [
            ("hycoc_batch_rows", "tree rows per verification forward (all its sessions' rows, cloud-mtp chains "
             "included)", self.batch_rows),
            ("hycoc_batch_sessions", "sessions per verification forward", self.batch_sessions),
            ("hycoc_queue_wait_seconds", "seconds from a round's arrival to the start of its forward's step",
             self.queue_wait),
        ]
        lines = []
        for name, kind, text, samples in families:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
            lines += [f"{name}{labels} {_number(value)}" for labels, value in samples]
        for name, text, hist in histograms:
            lines += [f"# HELP {name} {text}", f"# TYPE {name} histogram"]
            lines += [f"{name}{suffix}{labels} {_number(value)}" for suffix, labels, value in hist.samples()]
        return "\n".join(lines) + "\n"


def _number(value: float | int) -> str:
    if isinstance(value, int):
        return str(value)
    return "NaN" if math.isnan(value) else repr(float(value))


# --------------------------------------------------------------------------------------------------- server


@dataclass
class Connection:
    """One WebSocket connection's state (`VerifierServer.serve_connection`); ``session`` is None until its OPEN is
    answered.

    header_token: the upgrade's ``Authorization: Bearer`` token (`bearer_token`; None without the header).
    peer: the client's address (the auth rate limit counts per peer). connected: when the WebSocket was accepted
    (time.monotonic(); the handshake timeout runs from here when the front door cannot see the TCP connection).
    open_seen: an OPEN frame arrived (whatever its answer): the handshake timeout no longer applies.
    """

    header_token: str | None
    peer: str = ""
    link: "_Link | None" = None
    connected: float = field(default_factory=time.monotonic)
    open_seen: bool = False
    kv_bytes: int = 0
    opened: Opened | None = None
    session: Session | None = None
    session_id: int = 0
    limits: wire.Limits | None = None
    last_seq: int | None = None
    last_request: bytes = b""
    last_reply: bytes = b""


class _Link:
    """One TCP connection as the limits see it (module docstring "Limits"). Times from time.monotonic()."""

    def __init__(self, transport: asyncio.Transport):
        self.transport = transport
        self.connected = time.monotonic()
        self.opened = False                      # an OPEN frame arrived: the handshake timeout no longer applies
        self.upgraded = False                    # a WebSocket: bytes arriving now belong to a frame
        self.frame_since: float | None = None    # when the bytes of a frame not yet delivered began to arrive
        self.ws: web.WebSocketResponse | None = None
        self.kicked = False


class _GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler for one TCP connection, behind the server's connection limits: a connection over
    ``max_connections`` gets HTTP 503 with Retry-After and never reaches aiohttp; the others are tracked as a
    `_Link` for the handshake and frame timeouts (the server's sweeper closes them)."""

    def __init__(self, server: "VerifierServer", handler: asyncio.Protocol):
        self.server, self.handler, self.link = server, handler, None
        self.transport, self.answered = None, False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.link = self.server._admit(transport)
        if self.link is not None:
            self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.link is None:              # refused: answer 503 once, discard the rest
            if not self.answered:
                self.answered = True
                self.server._busy(self.transport)
            return
        if self.link.upgraded and self.link.frame_since is None:
            self.link.frame_since = time.monotonic()
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received() if self.link is not None else None

    def connection_lost(self, exc) -> None:
        if self.link is not None:
            self.server._release(self.link)
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.link is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.link is not None:
            self.handler.resume_writing()


class _GuardedRunner(web.AppRunner):
    """An AppRunner whose sites accept connections through `_GuardedProtocol`."""

    def __init__(self, app: web.Application, server: "VerifierServer", **kwargs):
        super().__init__(app, **kwargs)
        self._guard = server

    @property
    def server(self):
        inner = super().server
        if inner is None:
            return None
        return lambda: _GuardedProtocol(self._guard, inner())


def bearer_token(headers) -> str | None:
    """The token of an ``Authorization: Bearer T`` header; None without the header, "" for another scheme (which
    then never matches: a client that sends credentials must send the right ones)."""
    value = headers.get("Authorization")
    if value is None:
        return None
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


class Channel(Protocol):
    """One accepted WebSocket as `VerifierServer.serve_connection` uses it; each front door implements it over its
    own socket (`_AiohttpChannel` here, Starlette's behind Ray Serve in `hycoc.verifier.ray_serve`)."""

    async def receive(self, timeout: float | None) -> bytes | str | None:
        """The next message: bytes (binary), str (text), or None once the peer closed or the socket failed.
        Raises asyncio.TimeoutError when none arrived within ``timeout`` seconds (None: no limit)."""

    async def send(self, frame: bytes) -> None:
        """Send one binary message; raises ConnectionError when the peer is gone."""

    async def close(self, code: int) -> None:
        """End the connection with this WebSocket close code (RFC 6455 section 7.4.1); never raises."""


class _AiohttpChannel:
    """`Channel` over aiohttp's WebSocketResponse (autoping off: pings are answered here, and every message that
    arrives ends the link's frame-timeout watch)."""

    def __init__(self, ws: web.WebSocketResponse, link: _Link | None):
        self.ws, self.link = ws, link

    async def receive(self, timeout: float | None) -> bytes | str | None:
        while True:
            msg = await self.ws.receive(timeout=timeout)
            if self.link is not None:
                self.link.frame_since = None
            if msg.type == WSMsgType.PING:
                await self.ws.pong(msg.data)
                continue
            if msg.type == WSMsgType.PONG:
                continue
            if msg.type in (WSMsgType.BINARY, WSMsgType.TEXT):
                return msg.data
            return None  # CLOSE, CLOSING, CLOSED, or ERROR (e.g. a message over aiohttp's limit)

    async def send(self, frame: bytes) -> None:
        await self.ws.send_bytes(frame)

    async def close(self, code: int) -> None:
        try:
            await self.ws.close(code=code)
        except ConnectionError:
            pass


class VerifierServer:
    """The verifier engine behind the wire protocol (see the module docstring for the routes and the rules).

    engine: the shared `VerifierEngine` (its model, head, keep set, W, K and hand-off scales).
    tree_rows: rows of every ROUND of ``device`` and ``server-head`` sessions, B + 1 (recipe: tree.node_budget + 1);
        ``cloud-mtp`` sessions send the root alone (1 row). Sent in OPENED.
    auth_token: shared secret clients must present (None: open server). Never empty.
    max_frame_bytes: largest frame, header included, in bytes (recipe: verifier.max_frame_bytes); incoming frames
        are further bounded by `open_frame_bytes` (module docstring "Limits").
    model_name: what /healthz reports as the model (recipe: models.verifier as written).
    limits: `ServerLimits` (recipe: the [verifier] keys of the same names).
    batching: "batched" (default): rounds of sessions ready together run in one forward and prefills run chunk
        by chunk between them (`hycoc.verifier.scheduler`); "serial": one engine call at a time, in arrival order
        (the server before issue 14). Recipe: verifier.batching.
    max_batch_rows: most tree rows per batched forward (>= 1; recipe verifier.max_batch_rows).
    max_batch_wait_ms: how long a round waits for others to join its forward, in ms (>= 0; recipe
        verifier.max_batch_wait_ms); it never waits when every open session has a round queued.
    """

    def __init__(self, engine: VerifierEngine, *, tree_rows: int, auth_token: str | None = None,
                 max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES, model_name: str = "verifier",
                 limits: ServerLimits = ServerLimits(), batching: str = "batched",
                 max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS, max_batch_wait_ms: float = DEFAULT_MAX_BATCH_WAIT_MS):
        if not 1 <= tree_rows <= wire.MAX_TREE_ROWS:
            raise ValueError(f"tree_rows = {tree_rows}: must lie in [1, {wire.MAX_TREE_ROWS}] (B + 1)")
        if auth_token is not None and not auth_token:
            raise ValueError("auth_token is empty: give a non-empty token, or None for an open server")
        if batching not in BATCHING_MODES:
            raise ValueError(f"batching = {batching!r}: must be one of {BATCHING_MODES}")
        if not (isinstance(max_batch_rows, int) and max_batch_rows >= 1):
            raise ValueError(f"max_batch_rows = {max_batch_rows!r}: must be an integer >= 1")
        if not (isinstance(max_batch_wait_ms, (int, float)) and 0 <= max_batch_wait_ms <= 10_000):
            raise ValueError(f"max_batch_wait_ms = {max_batch_wait_ms!r}: must lie in [0, 10000] ms")
        if max_frame_bytes < wire.HEADER.size:
            raise ValueError(f"max_frame_bytes = {max_frame_bytes}: must hold at least the "
                             f"{wire.HEADER.size}-byte header")
        self.engine = engine
        self.tree_rows = int(tree_rows)
        self.auth_token = auth_token
        self.max_frame_bytes = int(max_frame_bytes)
        self.model_name = model_name
        self.batching = batching
        self.max_batch_rows = int(max_batch_rows)
        self.max_batch_wait_ms = float(max_batch_wait_ms)
        self._scheduler: BatchScheduler | None = None
        self.metrics = Metrics()
        #: Live sessions by id (each holds a KV cache until its connection ends).
        self.sessions: dict[int, Session] = {}
        self._next_id = 1
        self._worker: ThreadPoolExecutor | None = None
        self._runner: web.AppRunner | None = None
        self._sockets: set[web.WebSocketResponse] = set()
        self.limits = limits
        self._links: dict[asyncio.Transport, _Link] = {}
        self._opening = 0                                   # OPENs admitted whose prefill has not finished
        self._auth_failures: dict[str, deque] = {}          # peer -> monotonic times of refused auth, last 60 s
        self._sweeper: asyncio.Task | None = None
        #: Largest incoming frame: an OPEN with the longest prompt and auth token (ROUND and CLOSE are smaller).
        self.in_frame_bytes = min(self.max_frame_bytes, open_frame_bytes(engine.max_context))
        # Before OPEN only the frame itself is checked; the OPEN's fields are checked after its auth token.
        self._bare_limits = wire.Limits(max_frame_bytes=self.in_frame_bytes)
        self._open_limits = wire.Limits(max_frame_bytes=self.in_frame_bytes, vocab_size=engine.vocab_size,
                                        max_context=engine.max_context)
        self.url: str | None = None

    # ----------------------------------------------------------------------------------------- lifecycle

    def app(self) -> web.Application:
        """The aiohttp application: ``/`` (WebSocket), ``/healthz``, ``/metrics``."""
        app = web.Application()
        app.router.add_get("/", self._websocket)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/metrics", self._metrics)
        app.on_shutdown.append(self._close_sockets)
        return app

    async def start_engine(self) -> None:
        """Start the engine's worker thread and, batched, its scheduler on the running event loop, without
        listening anywhere: for a front door that owns the sockets and feeds `serve_connection` (Ray Serve's
        replicas, `hycoc.verifier.ray_serve`). `start` calls it; `stop` ends both. Raises RuntimeError if already
        started."""
        if self._worker is not None:
            raise RuntimeError("VerifierServer.start_engine: already started; call stop() first")
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hycoc-verifier")
        if self.batching == "batched":
            self._scheduler = BatchScheduler(self._work, max_batch_rows=self.max_batch_rows,
                                             max_batch_wait_ms=self.max_batch_wait_ms,
                                             open_sessions=lambda: len(self.sessions),
                                             on_step=self._observe_step, chain_length=self.engine.chain_length,
                                             prefill_budget=self.engine.prefill_chunk)
            self._scheduler.start()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the engine (`start_engine`), listen on host:port (0 = a free port) and return the
        ``ws://HOST:PORT`` URL. Raises OSError if the address cannot be bound."""
        await self.start_engine()
        self._runner = _GuardedRunner(self.app(), self, handle_signals=False, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        try:
            await site.start()
        except BaseException:
            await self.stop()
            raise
        bound = self._runner.addresses[0]
        url_host = f"[{bound[0]}]" if ":" in bound[0] else bound[0]
        self.url = f"ws://{url_host}:{bound[1]}"
        self._sweeper = asyncio.get_running_loop().create_task(self._sweep())
        return self.url

    async def stop(self) -> None:
        """Close every connection (their sessions are freed), stop listening, finish the worker's queue."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self._scheduler is not None:
            scheduler, self._scheduler = self._scheduler, None
            await scheduler.stop()
        if self._worker is not None:
            worker, self._worker = self._worker, None
            await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    async def _close_sockets(self, app) -> None:
        for ws in list(self._sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

    # ----------------------------------------------------------------------------------------- limits

    def _admit(self, transport: asyncio.Transport) -> _Link | None:
        """A new TCP connection: its `_Link`, or None after answering HTTP 503 when max_connections are open."""
        if len(self._links) >= self.limits.max_connections:
            self.metrics.refusals["max_connections"] += 1
            asyncio.get_running_loop().call_later(self.limits.handshake_timeout_s, transport.close)
            return None
        link = self._links[transport] = _Link(transport)
        self.metrics.connections_active = len(self._links)
        return link

    def _busy(self, transport: asyncio.Transport) -> None:
        """Answer a connection refused by `_admit` once its request arrives (a response sent before the request
        confuses clients): HTTP 503 with Retry-After, then close after a second of discarding its bytes (closing
        with them unread would reset the connection before the client reads the answer)."""
        retry = math.ceil(self.limits.retry_after_s)
        body = (f"max_connections = {self.limits.max_connections} reached; retry after {retry} s\n").encode()
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %d\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (retry, len(body), body))
        asyncio.get_running_loop().call_later(1.0, transport.close)

    def _release(self, link: _Link) -> None:
        self._links.pop(link.transport, None)
        self.metrics.connections_active = len(self._links)

    async def _sweep(self) -> None:
        """Close connections past the handshake timeout (no OPEN yet) or the frame timeout (a frame begun and not
        finished), several times per second."""
        lim = self.limits
        tick = max(0.05, min(1.0, lim.handshake_timeout_s / 4, lim.frame_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for link in list(self._links.values()):
                if link.kicked:
                    continue
                if not link.opened and now - link.connected > lim.handshake_timeout_s:
                    self._kick(link, "handshake_timeout")
                elif link.frame_since is not None and now - link.frame_since > lim.frame_timeout_s:
                    self._kick(link, "frame_timeout")

    def _kick(self, link: _Link, kind: str) -> None:
        """Refuse a connection for a timeout: count it, send an ERROR frame when a WebSocket is up, close."""
        link.kicked = True
        frame = self.time_out(None, kind)

        async def close() -> None:
            try:
                if link.ws is not None and not link.ws.closed:
                    await asyncio.wait_for(link.ws.send_bytes(frame), 1.0)
            except (ConnectionError, asyncio.TimeoutError, RuntimeError):
                pass
            finally:
                link.transport.close()

        asyncio.get_running_loop().create_task(close())

    def _auth_wait(self, peer: str) -> float:
        """Seconds until ``peer`` may try auth again (0 when it may now): auth_failures_per_minute per 60 s."""
        times = self._auth_failures.get(peer)
        if not times:
            return 0.0
        now = time.monotonic()
        while times and now - times[0] > 60.0:
            times.popleft()
        if not times:
            del self._auth_failures[peer]
            return 0.0
        if len(times) < self.limits.auth_failures_per_minute:
            return 0.0
        return 60.0 - (now - times[0])

    def _auth_failed(self, peer: str) -> None:
        self._auth_failures.setdefault(peer, deque()).append(time.monotonic())

    def _reserve(self, req: OpenRequest) -> int:
        """Admit an OPEN under max_sessions and max_kv_bytes; returns the KV bytes reserved for it. Raises
        TooManySessions or KvBudgetExhausted (counted) with the retry hint."""
        lim, eng = self.limits, self.engine
        retry = f"retry after {lim.retry_after_s:g} s"
        if len(self.sessions) + self._opening >= lim.max_sessions:
            self.metrics.refusals["max_sessions"] += 1
            raise TooManySessions(f"{len(self.sessions) + self._opening} sessions are open, max_sessions = "
                                  f"{lim.max_sessions}; {retry}")
        positions = min(eng.max_context, len(req.prompt_ids) + int(req.max_new_tokens) + self.tree_rows)
        need = eng.session_kv_bytes(positions, self.tree_rows)
        if self.metrics.kv_bytes_reserved + need > lim.max_kv_bytes:
            self.metrics.refusals["max_kv_bytes"] += 1
            raise KvBudgetExhausted(f"this request needs {need} KV bytes ({positions} positions), "
                                    f"{self.metrics.kv_bytes_reserved} of max_kv_bytes = {lim.max_kv_bytes} are "
                                    f"reserved; {retry}, or ask for fewer max_new_tokens")
        self.metrics.kv_bytes_reserved += need
        return need

    async def _work(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the engine's worker thread (one at a time, in submission order)."""
        return await asyncio.get_running_loop().run_in_executor(self._worker, fn, *args)

    # ----------------------------------------------------------------------------------------- HTTP routes

    def health(self) -> dict:
        """The /healthz document: status, model, protocol_version, open sessions, tree_rows, max_context,
        vocab_size, max_frame_bytes, auth (bool), batching and limits (`ServerLimits` field -> value)."""
        eng = self.engine
        return {
            "status": "ok",
            "model": self.model_name,
            "protocol_version": wire.PROTOCOL_VERSION,
            "sessions": self.metrics.sessions_active,
            "tree_rows": self.tree_rows,
            "max_context": eng.max_context,
            "vocab_size": eng.vocab_size,
            "max_frame_bytes": self.max_frame_bytes,
            "auth": self.auth_token is not None,
            "batching": {"mode": self.batching, "max_batch_rows": self.max_batch_rows,
                         "max_batch_wait_ms": self.max_batch_wait_ms},
            "limits": {f.name: getattr(self.limits, f.name) for f in fields(self.limits)},
        }

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response(self.health())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.exposition().encode("utf-8"),
                            headers={"Content-Type": METRICS_CONTENT_TYPE})

    # ----------------------------------------------------------------------------------------- WebSocket

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        peer = request.remote or ""
        wait = self._auth_wait(peer) if self.auth_token is not None else 0.0
        if wait > 0:
            self.metrics.refusals["auth_failures_per_minute"] += 1
            return web.Response(status=429, headers={"Retry-After": str(math.ceil(wait))},
                                text=f"too many refused auth attempts from {peer}; retry after {math.ceil(wait)} s\n")
        # autoping off: pings reach the channel, so every frame that arrives ends the frame timeout's watch.
        ws = web.WebSocketResponse(max_msg_size=2 * self.in_frame_bytes, compress=False, autoping=False)
        await ws.prepare(request)
        link = self._links.get(request.transport)
        conn = Connection(header_token=bearer_token(request.headers), peer=peer, link=link)
        if link is not None:
            link.ws, link.upgraded = ws, True
        self._sockets.add(ws)
        try:
            # The handshake and frame timeouts are the sweeper's (it sees the TCP connection before the upgrade).
            await self.serve_connection(conn, _AiohttpChannel(ws, link), handshake_timeout=False)
        finally:
            self._sockets.discard(ws)
        return ws

    async def serve_connection(self, conn: Connection, channel: "Channel", *, handshake_timeout: bool = True) -> None:
        """One WebSocket session from its upgrade to its end, over any transport (this server's aiohttp socket,
        a Ray Serve replica's Starlette socket): every frame through `frame`, its reply sent, the connection
        closed as the reply says (1000 after a CLOSE, 1008 after a refusal), the session freed at the end.

        Timeouts (module docstring "Limits"): an open session that sends nothing for idle_timeout_s, and, with
        ``handshake_timeout`` (for front doors that cannot watch the TCP connection), a connection without an OPEN
        handshake_timeout_s after ``conn.connected``, get the ERROR frame of `time_out` and a 1008 close. A text
        message gets ERROR unexpected_message (binary frames only). Never raises for a client that goes away.
        """
        lim = self.limits
        try:
            while True:
                if conn.session is not None:
                    kind, timeout = "idle_timeout", lim.idle_timeout_s
                elif handshake_timeout and not conn.open_seen:
                    kind = "handshake_timeout"
                    timeout = max(0.0, conn.connected + lim.handshake_timeout_s - time.monotonic())
                else:
                    kind, timeout = None, None
                try:
                    msg = await channel.receive(timeout)
                except asyncio.TimeoutError:
                    frame = self.time_out(conn, kind)
                    try:
                        await channel.send(frame)
                    except ConnectionError:
                        return
                    await channel.close(WSCloseCode.POLICY_VIOLATION)
                    return
                if msg is None:
                    return
                if isinstance(msg, str):
                    reply, keep_open = self.error_frame(UnexpectedMessage(
                        "a text WebSocket message: the wire protocol uses binary frames only")), True
                else:
                    reply, keep_open = await self.frame(conn, msg)
                if reply is not None:
                    try:
                        await channel.send(reply)
                    except ConnectionError:  # the client left mid-round: drop the reply
                        return
                if not keep_open:
                    await channel.close(WSCloseCode.OK if reply is None else WSCloseCode.POLICY_VIOLATION)
                    return
        finally:
            self.end_session(conn)

    def timeout_error(self, kind: str) -> ServerError:
        """The error a timeout of this server's limits sends: kind "handshake_timeout" (HandshakeTimeout),
        "frame_timeout" (FrameTimeout) or "idle_timeout" (IdleTimeout), its message naming the limit's value."""
        lim = self.limits
        if kind == "handshake_timeout":
            return HandshakeTimeout(f"no OPEN within handshake_timeout_s = {lim.handshake_timeout_s:g} s of "
                                    "connecting")
        if kind == "frame_timeout":
            return FrameTimeout(f"a frame took longer than frame_timeout_s = {lim.frame_timeout_s:g} s to arrive")
        if kind == "idle_timeout":
            return IdleTimeout(f"no frame for idle_timeout_s = {lim.idle_timeout_s:g} s: the session's KV was "
                               "freed; open a new session")
        raise ValueError(f"timeout kind {kind!r}: one of handshake_timeout, frame_timeout, idle_timeout")

    def time_out(self, conn: Connection | None, kind: str) -> bytes:
        """A timeout fired on ``conn`` (None: a connection with no WebSocket state yet): count it in
        ``hycoc_refusals_total{kind=KIND}``, free the session's KV (before the client hears why) and return the
        ERROR frame (`timeout_error`) to send before closing with 1008."""
        exc = self.timeout_error(kind)
        self.metrics.refusals[kind] += 1
        if conn is not None:
            self.end_session(conn)
        return self.error_frame(exc)

    def error_frame(self, exc: BaseException) -> bytes:
        """The ERROR frame for ``exc`` (`hycoc.protocol.wire.error_reply`: a wire, engine or `ServerError` code;
        anything else is internal_error, logged with its traceback), counted in ``hycoc_errors_total``."""
        reply = wire.error_reply(exc)
        self.metrics.errors[reply.code] += 1
        if reply.code == "internal_error":
            log.error("internal error on a frame", exc_info=exc)
        return wire.encode(reply)

    async def frame(self, conn: Connection, data: bytes) -> tuple[bytes | None, bool]:
        """Answer one binary frame of ``conn``: (the reply frame, or None after a CLOSE; keep the connection
        open). A bad frame gets its ERROR frame (never an exception); a refused OPEN (auth, capacity) closes."""
        try:
            if conn.session is None:
                msg = wire.decode(data, self._bare_limits)
                if isinstance(msg, OpenRequest):
                    return await self._open(conn, msg), True
                if isinstance(msg, Close):
                    return None, False
                if isinstance(msg, (DraftTree, AppendTurn)):
                    what = "ROUND" if isinstance(msg, DraftTree) else "APPEND"
                    raise NotOpened(f"{what} before OPEN: open a session first")
            else:
                msg = wire.decode(data, conn.limits)
                if isinstance(msg, DraftTree):
                    return await self._round(conn, msg, bytes(data)), True
                if isinstance(msg, Close):
                    if msg.session_id not in (0, conn.session_id):
                        raise BadSessionId(f"CLOSE names session {msg.session_id}; this connection holds session "
                                           f"{conn.session_id} (or send 0)")
                    return None, False
                if isinstance(msg, AppendTurn):
                    return await self._append(conn, msg), True
                if isinstance(msg, OpenRequest):
                    raise AlreadyOpen(f"this connection already holds session {conn.session_id}: one session per "
                                      "connection; CLOSE it or open another connection")
            raise UnexpectedMessage(f"{type(msg).__name__} frames go from the verifier to the device; "
                                    "send OPEN, ROUND or CLOSE")
        except _CLOSING_ERRORS as e:
            return self.error_frame(e), False
        except Exception as e:  # noqa: BLE001 -- every failure becomes an ERROR frame (internal ones are logged)
            return self.error_frame(e), True

    def _check_auth(self, conn: Connection, frame_token: str | None) -> None:
        if self.auth_token is None:
            return
        wait = self._auth_wait(conn.peer)
        if wait > 0:
            self.metrics.refusals["auth_failures_per_minute"] += 1
            raise AuthRateLimited(f"{self.limits.auth_failures_per_minute} refused auth attempts from this address "
                                  f"within a minute; retry after {math.ceil(wait)} s")
        presented = [t for t in (frame_token, conn.header_token) if t is not None]
        if not presented:
            self._auth_failed(conn.peer)
            raise AuthRequired("this verifier requires an auth token: send it in OPEN's auth_token or as "
                               "'Authorization: Bearer TOKEN'")
        expected = self.auth_token.encode("utf-8")
        if not all(hmac.compare_digest(t.encode("utf-8"), expected) for t in presented):
            self._auth_failed(conn.peer)
            raise AuthRefused("the auth token does not match the verifier's (--auth-token)")

    async def _open(self, conn: Connection, req: OpenRequest) -> bytes:
        conn.open_seen = True  # an OPEN arrived: the handshake is over, whatever its answer
        if conn.link is not None:
            conn.link.opened = True
        self._check_auth(conn, req.auth_token)
        wire.validate(req, self._open_limits)  # vocabulary and context, now that the client may know them
        fmt = getattr(self.engine, "chat_format", None)
        if req.chat is not None and fmt is not None:
            fmt.check_contract(req.chat)   # ChatMismatch (chat_mismatch) names both sides
        if req.draft_place == "server-head" and self.engine.keep_set is None:
            raise KeepSetMissing("draft_place 'server-head' needs the keep set (Table 5), and this verifier has "
                                 "none: start it with `hycoc verify-server RECIPE --keep-set BUNDLE/keep_set.npy`, or run "
                                 "the device with another mode (hycoc run --mode hyco: device drafting)")
        kv_bytes = self._reserve(req)
        self._opening += 1
        try:
            if self._scheduler is not None:
                session = self.engine.open(req.prompt_ids, req.sampling, req.seed, req.acceptance, req.epsilon,
                                           req.draft_place, req.max_new_tokens)   # checks only; nothing runs
                prefill_ms, t = await self._scheduler.prefill(session.prefill_job)
            else:
                session, prefill_ms, t = await self._work(self._open_session, req)
        except BaseException:
            self.metrics.kv_bytes_reserved -= kv_bytes
            raise
        finally:
            self._opening -= 1
        conn.kv_bytes = kv_bytes
        session_id, self._next_id = self._next_id, self._next_id + 1
        tree_rows = 1 if req.draft_place == "cloud-mtp" else self.tree_rows
        eng = self.engine
        opened = Opened(session_id=session_id, t=t, prefill_ms=prefill_ms, max_context=eng.max_context,
                        tree_rows=tree_rows, vocab_size=eng.vocab_size, hidden_size=eng.hidden_size,
                        kv_dim_sliding=eng.kv_dim_sliding, kv_dim_full=eng.kv_dim_full,
                        stop_ids=_stop_ids(eng))
        conn.session, conn.session_id, conn.opened = session, session_id, opened
        conn.limits = wire.Limits(max_frame_bytes=self.max_frame_bytes, vocab_size=eng.vocab_size,
                                  tree_rows=tree_rows, max_context=eng.max_context)
        self.sessions[session_id] = session
        self.metrics.sessions_total += 1
        self.metrics.sessions_active += 1
        self.metrics.prefill_ms += prefill_ms
        return wire.encode(opened)

    async def _append(self, conn: Connection, msg: AppendTurn) -> bytes:
        """The next turn on the open session (`Session.append`): its KV stays, only the new tokens are prefilled;
        answered with OPENED (same session id, the new root's t, this prefill's ms). The KV reservation grows to
        the conversation plus the new turn's cap (refused with kv_budget_exhausted when that does not fit)."""
        eng, lim = self.engine, self.limits
        session = conn.session
        positions = min(eng.max_context, len(session.tokens) + len(msg.tokens) + int(msg.max_new_tokens)
                        + self.tree_rows)
        need = eng.session_kv_bytes(positions, self.tree_rows) - conn.kv_bytes
        if need > 0 and self.metrics.kv_bytes_reserved + need > lim.max_kv_bytes:
            self.metrics.refusals["max_kv_bytes"] += 1
            raise KvBudgetExhausted(f"the next turn needs {need} more KV bytes, {self.metrics.kv_bytes_reserved} of "
                                    f"max_kv_bytes = {lim.max_kv_bytes} are reserved; retry after "
                                    f"{lim.retry_after_s:g} s, or ask for fewer max_new_tokens")
        if self._scheduler is not None:
            prefill_ms, t = await self._scheduler.prefill(
                lambda: session.append_job(msg.tokens, int(msg.max_new_tokens)))
        else:
            prefill_ms, t = await self._work(session.append, msg.tokens, int(msg.max_new_tokens))
        if need > 0:
            conn.kv_bytes += need
            self.metrics.kv_bytes_reserved += need
        conn.last_seq, conn.last_request, conn.last_reply = None, b"", b""
        self.metrics.prefill_ms += prefill_ms
        return wire.encode(replace(conn.opened, t=t, prefill_ms=prefill_ms))

    def _open_session(self, req: OpenRequest) -> tuple[Session, float, int]:
        """Worker thread: a new engine session, prefilled."""
        session = self.engine.open(req.prompt_ids, req.sampling, req.seed, req.acceptance, req.epsilon,
                                   req.draft_place, req.max_new_tokens)
        prefill_ms, t = session.prefill()
        return session, prefill_ms, t

    async def _round(self, conn: Connection, tree: DraftTree, data: bytes) -> bytes:
        if tree.seq == conn.last_seq and data == conn.last_request:
            self.metrics.retries += 1
            return conn.last_reply  # idempotent retry: the same bytes, the engine untouched
        if self._scheduler is not None:
            reply, frame, committed, verified = await self._scheduler.round(conn.session, tree)
        else:
            reply, frame, committed, verified, wait = await self._work(self._verify, conn.session, tree,
                                                                        time.monotonic())
            if verified:  # serial: every forward holds one session's rows
                self.metrics.server_ms += reply.server_ms
                self.metrics.queue_wait.observe(wait)
                self.metrics.batch_sessions.observe(1)
                self.metrics.batch_rows.observe(len(reply.samples))
        if verified:
            conn.last_seq, conn.last_request, conn.last_reply = tree.seq, data, frame
            self.metrics.rounds += 1
            self.metrics.tokens_committed += committed
        return frame

    @staticmethod
    def _verify(session: Session, tree: DraftTree, arrived: float):
        """Worker thread (serial mode): one round (Alg. 4) and its reply frame. Returns (reply, frame, tokens
        committed, whether a round ran, seconds since ``arrived`` (time.monotonic()) when it started)."""
        wait = time.monotonic() - arrived
        rounds, before = session.rounds, len(session.tokens)
        reply = session.verify(tree.tokens, tree.parents, tree.seq)
        return reply, wire.encode(reply), len(session.tokens) - before, session.rounds > rounds, wait

    def _observe_step(self, report: StepReport) -> None:
        """Event loop (batched mode): one scheduler step in /metrics."""
        m, stats = self.metrics, report.stats
        if stats.sessions:
            m.batch_rows.observe(stats.rows)
            m.batch_sessions.observe(stats.sessions)
            m.server_ms += stats.total_ms
        for wait in report.waits:
            m.queue_wait.observe(wait)

    def end_session(self, conn: Connection) -> None:
        """Free the connection's session (nothing without one): drop it now, free its KV on the worker after any
        round in flight. Every front door calls it when a connection ends."""
        if conn.session is None:
            return
        session, conn.session = conn.session, None
        self.sessions.pop(conn.session_id, None)
        self.metrics.sessions_active -= 1
        self.metrics.kv_bytes_reserved -= conn.kv_bytes
        conn.kv_bytes = 0
        if self._worker is not None:
            self._worker.submit(session.close)
        else:
            session.close()


# --------------------------------------------------------------------------------------------------- running


def serve(engine: VerifierEngine, host: str = "127.0.0.1", port: int = 8765, *, auth_token: str | None = None,
          tree_rows: int, max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES, model_name: str = "verifier",
          limits: ServerLimits = ServerLimits(), on_listening: Callable[[str], None] | None = None,
          batching: str = "batched", max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
          max_batch_wait_ms: float = DEFAULT_MAX_BATCH_WAIT_MS) -> None:
    """Run the server until SIGINT or SIGTERM (blocking). ``on_listening(url)`` is called once the port is bound.
    The other keywords are `VerifierServer`'s.

    port 0 picks a free port (the URL names it). Raises OSError when the address cannot be bound.
    """
    server = VerifierServer(engine, tree_rows=tree_rows, auth_token=auth_token, max_frame_bytes=max_frame_bytes,
                            model_name=model_name, limits=limits, batching=batching, max_batch_rows=max_batch_rows,
                            max_batch_wait_ms=max_batch_wait_ms)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):  # not the main thread, or no signals here
                pass
        url = await server.start(host, port)
        try:
            if on_listening is not None:
                on_listening(url)
            await stop.wait()
        finally:
            await server.stop()

    asyncio.run(main())


class ServerThread:
    """A `VerifierServer` on its own event loop in a background thread (tests, ``hycoc bench``).

    ``with ServerThread(engine, tree_rows=33) as srv: ... srv.url ...`` listens on 127.0.0.1 and a free port by
    default. ``url`` is ``ws://HOST:PORT``, ``http_url`` the same with ``http://``. ``server`` is the
    `VerifierServer` (its ``metrics`` and ``sessions`` may be read from other threads between requests).
    """

    def __init__(self, engine: VerifierEngine, host: str = "127.0.0.1", port: int = 0, **server_kwargs):
        self.server = VerifierServer(engine, **server_kwargs)
        self._host, self._port = host, port
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self.url: str | None = None

    @property
    def http_url(self) -> str:
        return "http" + self.url.removeprefix("ws")

    def start(self) -> "ServerThread":
        """Start listening; returns once the port is bound (raises what binding raised)."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="hycoc-verify-server", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._failure is not None:
            self._thread.join()
            raise self._failure
        return self

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self.url = self._loop.run_until_complete(self.server.start(self._host, self._port))
        except BaseException as e:  # noqa: BLE001 -- handed to the starting thread
            self._failure = e
            self._ready.set()
            self._loop.close()
            return
        self._ready.set()
        self._loop.run_forever()
        self._loop.run_until_complete(self.server.stop())
        self._loop.close()

    def stop(self, timeout_s: float = 30.0) -> None:
        """Close every connection, stop listening and join the thread."""
        if self._thread is None or not self._thread.is_alive():
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)

    def __enter__(self) -> "ServerThread":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

