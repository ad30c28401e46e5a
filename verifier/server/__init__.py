"""The verifier's network server: the wire protocol over WebSocket, plus ``/healthz`` and ``/metrics``.

One aiohttp application on one port (docs/design.md "Wire protocol"; the device connects with ``--server ws://HOST:PORT``):

    GET /  (WebSocket)  one session per connection, binary frames of `hycoc.protocol.wire`:
                        OPEN -> prefill -> OPENED; ROUND -> REPLY, one per round; after a finished reply, APPEND (the
                        next turn, KV kept) -> OPENED; CLOSE (or a disconnect) frees the KV
    GET /healthz        JSON: status, model, sessions, protocol_version and the limits a client must respect
    GET /metrics        Prometheus text exposition (format 0.0.4), counters over the server's lifetime

The package, by job:

    errors        the session-level ERROR codes (`ServerError` and its subclasses)
    limits        `ServerLimits`: every limit's default, knob and refusal kind (docs/design.md "Limits")
    admission     the ledgers that admit connections, sessions and KV bytes and rate-limit auth failures
    metrics       `ServerMetrics` and its prometheus_client collector (/metrics)
    channels      `Connection`, the `Channel` interface, aiohttp's channel (keepalive) and connection guard
    worker        `EngineWorker`: the engine's one thread and the batch scheduler in front of it; shutdown
    session_loop  `SessionLoop`: one connection's frames (validation, auth, OPEN / ROUND / APPEND / CLOSE)
    app           `VerifierServer`: the above on one aiohttp application (routes, timeouts' sweeper)
    running       `serve` (blocking) and `ServerThread` (in-process, tests and ``hycoc bench``)

Concurrency. Every engine call runs on ONE worker thread (`hycoc.verifier.server.worker`) while the event loop keeps
accepting frames, answering pings and health checks and validating. ``batching="batched"`` (the default; recipe
``verifier.batching``) runs the rounds of sessions ready together as one forward and prefills a long prompt chunk by
chunk between them; ``batching="serial"`` runs one engine call at a time in arrival order. /metrics has the
histograms ``hycoc_batch_rows``, ``hycoc_batch_sessions`` and ``hycoc_queue_wait_seconds`` in both modes.

Frame size. aiohttp's own WebSocket limit is set to twice the incoming frame limit so that a frame above the wire
limit still reaches `hycoc.protocol.wire.decode_header` and gets a ``frame_too_large`` ERROR frame; only frames above
twice the limit are cut by aiohttp (WebSocket close code 1009, no frame). Incoming frames are never larger than an
OPEN with a max_context prompt, the longest auth token and the longest chat contract (the codec's own layout,
`hycoc.protocol.wire.open_nbytes`), so that is the frame limit this server reads with
(`open_frame_bytes`), whatever ``max_frame_bytes`` (which bounds replies) says: an unauthenticated client cannot
make it buffer more than twice that per connection.

Limits: `hycoc.verifier.server.limits` (every refusal is counted in ``hycoc_refusals_total{kind=...}``).
``/healthz`` and ``/metrics`` carry no secrets and need no token.

Entry points: `serve` (blocking, for ``hycoc verify-server``), `VerifierServer.start` / ``stop`` (inside a running
loop), `ServerThread` (in-process on an ephemeral port). Front doors that own their sockets (Ray Serve's replicas)
use `VerifierServer.start_engine` and feed each accepted WebSocket, as a `Channel`, to
`VerifierServer.serve_connection`: the session loop, its idle and handshake timeouts and its close codes are this
package's, whatever the transport.
"""

from .admission import Admission, KvBudget, KvReservation
from .app import VerifierServer
from .channels import Channel, Connection, bearer_token
from .errors import (
    AlreadyOpen,
    AuthRateLimited,
    AuthRefused,
    AuthRequired,
    BadSessionId,
    FrameTimeout,
    HandshakeTimeout,
    IdleTimeout,
    KeepSetMissing,
    KvBudgetExhausted,
    NotOpened,
    ServerError,
    ShuttingDown,
    TooManySessions,
    UnexpectedMessage,
)
from .limits import REFUSAL_KINDS, ServerLimits, open_frame_bytes
from .metrics import METRICS_CONTENT_TYPE, ServerMetrics
from .running import ServerThread, serve
from .settings import ServerSettings
from .worker import BATCHING_MODES, DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_WAIT_MS

__all__ = [
    "VerifierServer",
    "ServerThread",
    "serve",
    "ServerLimits",
    "ServerSettings",
    "REFUSAL_KINDS",
    "open_frame_bytes",
    "Connection",
    "Channel",
    "bearer_token",
    "METRICS_CONTENT_TYPE",
    "ServerMetrics",
    "Admission",
    "KvBudget",
    "KvReservation",
    "BATCHING_MODES",
    "DEFAULT_MAX_BATCH_ROWS",
    "DEFAULT_MAX_BATCH_WAIT_MS",
    "ServerError",
    "AuthRequired",
    "AuthRefused",
    "AuthRateLimited",
    "NotOpened",
    "AlreadyOpen",
    "UnexpectedMessage",
    "BadSessionId",
    "KeepSetMissing",
    "TooManySessions",
    "KvBudgetExhausted",
    "IdleTimeout",
    "HandshakeTimeout",
    "FrameTimeout",
    "ShuttingDown",
]
