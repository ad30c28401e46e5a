"""The verifier server's limits as data (docs/design.md "Limits"; the table in docs/serving.md "Limits"): each has a
documented default, a knob (the recipe's ``[verifier]`` key of the same name), an error code and a
``hycoc_refusals_total{kind=...}`` series on /metrics. Their defaults, units, ranges, error codes and metrics are
`hycoc.serving_limits.LIMITS`' (the one table the recipe, this server, ``--help`` and docs/serving.md read);
`ServerLimits` holds the ones enforced here:

    handshake_timeout   TCP connect -> the WebSocket's first frame (OPEN); silent TCP, trickled headers and a silent
                        upgraded socket are closed (ERROR handshake_timeout when a WebSocket is up)
    frame_timeout       a frame must complete once its first bytes arrived (ERROR frame_timeout, close)
    idle_timeout        an open session without a frame: KV freed, ERROR idle_timeout, close
    max_connections     TCP connections at once; more get ``HTTP 503`` with ``Retry-After`` and are closed
    max_sessions        open (or opening) sessions; an OPEN over it gets ERROR too_many_sessions
    max_kv_bytes        KV reserved by sessions: what a session holds at (prompt + max_new_tokens + B + 1, up to
                        max_context) positions, sliding layers capped at their window + B + 1
                        (`VerifierEngine.session_kv_bytes`); an OPEN or APPEND over it gets ERROR kv_budget_exhausted
    auth_failures_per_minute  refused auth attempts per peer address; more get ``HTTP 429`` at the upgrade and ERROR
                        auth_rate_limited on OPEN, before any token is compared
    retry_after_s       the hint in ``Retry-After`` and in the message of the three capacity refusals

The ledgers that enforce the capacity limits are `hycoc.verifier.server.admission`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from hycoc import serving_limits
from hycoc.protocol import wire
from hycoc.serving_limits import default


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits (module docstring; recipe ``[verifier]`` keys of the same names; defaults
    `hycoc.serving_limits.LIMITS`').

    handshake_timeout_s, frame_timeout_s, idle_timeout_s, retry_after_s: seconds, > 0. max_connections,
    max_sessions: counts >= 1. max_kv_bytes: bytes >= 1. auth_failures_per_minute: refused attempts per peer
    address within 60 s, >= 1. Raises ValueError naming the field for a value out of range.
    """

    handshake_timeout_s: float = float(default("handshake_timeout_s"))
    frame_timeout_s: float = float(default("frame_timeout_s"))
    idle_timeout_s: float = float(default("idle_timeout_s"))
    max_connections: int = int(default("max_connections"))
    max_sessions: int = int(default("max_sessions"))
    max_kv_bytes: int = int(default("max_kv_bytes"))
    auth_failures_per_minute: int = int(default("auth_failures_per_minute"))
    retry_after_s: float = float(default("retry_after_s"))

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(
                    f"ServerLimits.{f.name} = {value!r}: must be a finite number > 0 "
                    "(recipe [verifier] key of the same name)"
                )

    @classmethod
    def from_recipe(cls, verifier) -> ServerLimits:
        """The limits of a recipe's ``[verifier]`` section (`hycoc.recipe.Verifier`)."""
        return cls(**{f.name: getattr(verifier, f.name) for f in fields(cls)})

    def as_dict(self) -> dict:
        """Field name -> value (what /healthz reports under ``limits``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


#: Refusal kinds counted in hycoc_refusals_total (the names of the limits); every one is exposed from the start.
REFUSAL_KINDS = serving_limits.REFUSAL_KINDS


def open_frame_bytes(max_context: int) -> int:
    """Bytes of the largest OPEN frame a server with ``max_context`` positions accepts
    (`hycoc.protocol.wire.open_nbytes`, the codec's own layout): a prompt of max_context - 1 int32 ids, a 65,535-byte
    auth token and a 65,535-byte chat contract. No frame a client sends is larger (an APPEND holds at most
    max_context - 1 ids with a 20-byte fixed part, a ROUND at most max_tree_rows rows)."""
    return wire.open_nbytes(max(max_context - 1, 1), 65535, 65535)
