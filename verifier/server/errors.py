"""The session-level errors of the verifier server: a frame that is well formed but not acceptable in its
connection's state, or a request refused by a limit (`hycoc.verifier.server.limits`).

Each class carries the stable ``code`` that goes into the ERROR frame (`hycoc.protocol.wire.error_reply` reads the
class attribute); the message says what to do instead. The engine's own errors (``bad_seq``, ``bad_root``,
``finished``, ...) are `hycoc.verifier.errors`; the wire's (``bad_parent``, ``frame_too_large``, ...) are
`hycoc.protocol.wire`'s.
"""

from __future__ import annotations


class ServerError(Exception):
    """A frame that is well formed but not acceptable in this connection's state. ``code`` goes into the ERROR
    frame; the message says what to do instead."""

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


class NotOpened(ServerError):
    """A ROUND or APPEND before the connection's OPEN was answered."""

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
    """An OPEN or APPEND whose KV reservation would take the sessions' total past ``max_kv_bytes``."""

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


class ShuttingDown(ServerError):
    """A frame that arrived after the server began to stop (``VerifierServer.stop``): nothing more reaches the
    engine; reconnect to another verifier (or this one once it is back)."""

    code = "shutting_down"


#: Refusals of the auth check: the connection closes (WebSocket code 1008) after their ERROR frame.
AUTH_ERRORS = (AuthRequired, AuthRefused, AuthRateLimited)
#: Every error after which the server closes the connection (1008): auth and capacity refusals, shutdown.
CLOSING_ERRORS = AUTH_ERRORS + (TooManySessions, KvBudgetExhausted, ShuttingDown)
