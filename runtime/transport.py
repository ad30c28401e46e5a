"""The device's connection to the verifier: wire frames over one WebSocket, and a link model (docs/design.md "Wire
protocol"; docs/benchmarks.md "Benchmark": --link).

Ships on the phone: numpy + websockets + `hycoc.protocol.wire` / `hycoc.protocol.messages` only (no torch, no aiohttp,
nothing of the verifier). `VerifierClient` speaks the protocol of docs/design.md "Wire protocol" with
``websockets.sync``: ``open(OpenRequest) -> Opened``, ``round(DraftTree) -> RoundReply``, ``append(AppendTurn) ->
Opened`` (the next turn of a conversation on the same session), ``close()``. Every reply is decoded and
validated against the session's sizes (`hycoc.protocol.wire.Limits.from_opened`) before it is returned.

Every failure ends in a `TransportError` subclass whose message is one line naming the cause:

    ServerUnreachable   nothing listens at the URL, the name does not resolve, the handshake fails or times out
    AuthRefused         the server wants a token (``auth_required``) or refused ours (``auth_refused``, HTTP 401/403)
    ConnectionDropped   the connection closed while a request was waiting for its answer
    ProtocolMismatch    the server speaks another protocol version (its frames, or its ``unsupported_version`` error)

The client speaks protocol version 6 (`hycoc.protocol.wire.PROTOCOL_VERSION`: ROUND carries the rows' scores,
REPLY may name the verified rows and carries the next round's allowance, APPEND keeps a prefix of the re-rendered
conversation) and takes only answers in
that version (a server answers a session in its
OPEN's version; one that answers in another is a ProtocolMismatch).
    RequestTimeout      no answer within ``timeout_s`` (the connection is closed: its session is gone)
    ServerError         the server answered with an ERROR frame; ``code`` and ``server_message`` are its fields
    BadReply            the server's frame fails validation here (wrong sizes, crc, seq, ...)

Link model. ``link`` delays each request and each reply as a phone's link would: RTT/2 plus the frame's
serialization time (bytes x 8 / bandwidth) in each direction, slept on the device side around the real send and
receive (so loopback delivery speed reflects a phone; the bench's ``--link``, docs/benchmarks.md "Benchmark"). Presets
(ASSUMPTIONS, not measurements): ``lte`` = 58 ms RTT at 20 Mbit/s, ``5g`` = 40 ms RTT at 50 Mbit/s. The paper's recorded
Spec-Bench summaries put network plus serialization at roughly 40-58 ms per round over LTE/5G (App. G; "not a standalone
link-RTT measurement"); we take its ends as the RTTs and add serialization on top, so a round with a Gemma 4 sized
hand-off (~30 KB down) costs a few ms more than that range. The bandwidths are typical uplink rates we assume,
applied to both directions (conservative: downlinks are usually faster, and only the replies' hand-offs are large).

Byte counts are whole wire frames (16-byte header + payload), not WebSocket or TCP framing.
"""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidStatus, InvalidURI
from websockets.sync.client import ClientConnection, connect

from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, Close, DraftTree, ErrorReply, Opened, OpenRequest, RoundReply

# --------------------------------------------------------------------------------------------------- link model


@dataclass(frozen=True)
class LinkModel:
    """A link between phone and verifier. rtt_ms: round-trip time in milliseconds (>= 0); mbps: bandwidth in
    megabits per second (10^6 bit/s, > 0), used in both directions."""

    rtt_ms: float
    mbps: float

    def __post_init__(self):
        if not self.rtt_ms >= 0 or not self.mbps > 0:
            raise ValueError(f"LinkModel(rtt_ms={self.rtt_ms}, mbps={self.mbps}): need rtt_ms >= 0 and mbps > 0")

    def one_way_s(self, nbytes: int) -> float:
        """Seconds to deliver a frame of ``nbytes`` one way: half the round trip plus its serialization time."""
        return self.rtt_ms / 2e3 + nbytes * 8 / (self.mbps * 1e6)


#: Named links of ``--link`` (assumed figures; the paper recorded 40-58 ms network + serialization per round, App. G).
LINK_PRESETS: dict[str, LinkModel] = {
    "lte": LinkModel(rtt_ms=58.0, mbps=20.0),
    "5g": LinkModel(rtt_ms=40.0, mbps=50.0),
}

_CUSTOM_LINK = re.compile(r"^(\d+(?:\.\d+)?):(\d+(?:\.\d+)?)$")


def parse_link(text: str) -> LinkModel | None:
    """``"lte"``, ``"5g"``, ``"none"`` (no delay: None) or ``"RTT_MS:MBPS"`` such as ``"45:50"``.

    Raises ValueError naming the allowed forms (also for a zero bandwidth)."""
    if text == "none":
        return None
    if text in LINK_PRESETS:
        return LINK_PRESETS[text]
    m = _CUSTOM_LINK.match(text)
    if m is not None and float(m[2]) > 0:
        return LinkModel(rtt_ms=float(m[1]), mbps=float(m[2]))
    raise ValueError(
        f"link {text!r}: allowed: lte, 5g, none or RTT_MS:MBPS such as 45:50 "
        "(round trip in ms : bandwidth in Mbit/s > 0)"
    )


# --------------------------------------------------------------------------------------------------- errors


class TransportError(Exception):
    """A request to the verifier failed. ``str(err)`` is one line naming the cause."""

    def __init__(self, message: str):
        super().__init__(" ".join(message.split()))


class ServerUnreachable(TransportError):
    """No verifier answered at the URL."""


class AuthRefused(TransportError):
    """The verifier wants an auth token, or refused the one given."""


class ConnectionDropped(TransportError):
    """The connection closed while waiting for an answer."""


class ProtocolMismatch(TransportError):
    """The verifier speaks another protocol version."""


class RequestTimeout(TransportError):
    """No answer within the client's timeout."""


class BadReply(TransportError):
    """A frame from the verifier that fails validation on the device."""


class ServerError(TransportError):
    """The verifier answered with an ERROR frame. code: its stable code (e.g. ``bad_parent``); server_message: its
    text."""

    def __init__(self, code: str, server_message: str, what: str):
        super().__init__(f"the verifier refused the {what}: {code}: {server_message}")
        self.code, self.server_message = code, server_message


_AUTH_CODES = ("auth_required", "auth_refused")

# proxy=None: the verifier is addressed directly (no HTTP(S)_PROXY detour); legacy=True: a plain connection object,
# not a context manager. Both exist in websockets >= 15 only; older versions connect directly anyway.
_CONNECT_EXTRAS: dict[str, Any] = {
    k: v for k, v in (("proxy", None), ("legacy", True)) if k in inspect.signature(connect).parameters
}


# --------------------------------------------------------------------------------------------------- client


class VerifierClient:
    """One session with a verifier over one WebSocket connection.

    url: ``ws://HOST:PORT`` (or ``wss://``). auth_token: sent as ``Authorization: Bearer`` and in OPEN (None: none).
    timeout_s: seconds to wait for the connection and for each answer (prefill included). link: a `LinkModel` to
    simulate, or None. max_frame_bytes: largest reply frame accepted, in bytes. sleep: the link model's sleep (tests
    pass a fake clock).

    After each request: ``last_up`` / ``last_down`` are its frame bytes; ``round_bytes`` lists (up, down) per round;
    ``bytes_up`` / ``bytes_down`` total every frame (open and close included); ``link_s`` is the time slept for the
    link model, in seconds.
    """

    def __init__(
        self,
        url: str,
        auth_token: str | None = None,
        timeout_s: float = 60.0,
        link: LinkModel | None = None,
        *,
        max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES,
        sleep: Callable[[float], None] = time.sleep,
    ):
        if auth_token == "":
            raise ValueError("auth_token is empty: give a token or None")
        self.url, self.auth_token, self.timeout_s, self.link = url, auth_token, float(timeout_s), link
        self.max_frame_bytes = int(max_frame_bytes)
        self._sleep = sleep
        self._ws: ClientConnection | None = None
        self.opened: Opened | None = None
        self._limits = wire.Limits(max_frame_bytes=self.max_frame_bytes)
        self.last_up = self.last_down = self.bytes_up = self.bytes_down = 0
        self.round_bytes: list[tuple[int, int]] = []
        self.link_s = 0.0

    # ------------------------------------------------------------------------------------------- connection

    def connect(self) -> None:
        """Open the WebSocket (``open`` does it when needed). Raises ServerUnreachable or AuthRefused."""
        if self._ws is not None:
            return
        headers = {"Authorization": f"Bearer {self.auth_token}"} if self.auth_token else None
        where = f"the verifier at {self.url}"
        try:
            # compression off: frames are mostly small integers, and byte counts must be what travels.
            self._ws = connect(
                self.url,
                additional_headers=headers,
                open_timeout=self.timeout_s,
                compression=None,
                max_size=2 * self.max_frame_bytes,
                **_CONNECT_EXTRAS,
            )
        except InvalidURI:
            raise ServerUnreachable(f"{self.url!r} is not a WebSocket URL: expected ws://HOST:PORT") from None
        except InvalidStatus as e:
            status = e.response.status_code
            if status in (401, 403):
                raise AuthRefused(f"{where} refused the connection (HTTP {status}): check the auth token") from None
            retry = e.response.headers.get("Retry-After")
            if status == 429:
                raise AuthRefused(
                    f"{where} refused the connection (HTTP 429): too many refused auth attempts from "
                    f"this address; retry after {retry} s with the right token"
                ) from None
            if status == 503:
                raise ServerUnreachable(
                    f"{where} is at its connection limit (HTTP 503); retry after {retry} s"
                ) from None
            raise ServerUnreachable(
                f"{where} answered HTTP {status}, not a WebSocket: is it a hycoc verify-server?"
            ) from None
        except InvalidHandshake as e:
            raise ServerUnreachable(f"{where} did not complete a WebSocket handshake: {e}") from None
        except ConnectionClosed as e:
            raise ServerUnreachable(
                f"{where} closed the connection during the WebSocket handshake ({_close_reason(e)})"
            ) from None
        except TimeoutError:
            raise ServerUnreachable(f"{where} did not answer within {self.timeout_s:g} s") from None
        except OSError as e:
            raise ServerUnreachable(
                f"cannot reach {where}: {e.strerror or e}; is a verifier running there? start "
                "one with `hycoc verify-server RECIPE --port N`"
            ) from None

    def close(self) -> None:
        """Send CLOSE (the verifier frees the session's KV) and close the connection. Never raises."""
        ws, self._ws = self._ws, None
        if ws is None:
            return
        try:
            if self.opened is not None:
                frame = wire.encode(Close(self.opened.session_id))
                ws.send(frame)
                self.bytes_up += len(frame)
        except ConnectionClosed:
            pass
        finally:
            ws.close()
            self.opened = None

    def __enter__(self) -> VerifierClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------- requests

    def open(self, request: OpenRequest) -> Opened:
        """Start a session: the verifier prefills the prompt (Alg. 1 line 2) and answers its sizes.

        The client's auth token fills ``request.auth_token`` when that is None. Raises a TransportError.
        """
        if self.opened is not None:
            raise TransportError(f"session {self.opened.session_id} is open on this client: close() it first")
        if request.auth_token is None and self.auth_token is not None:
            request = replace(request, auth_token=self.auth_token)
        self.connect()
        opened = self._request(wire.encode(request), Opened, "open request")
        self.opened = opened
        self._limits = wire.Limits.from_opened(opened, self.max_frame_bytes)
        if request.draft_place == "cloud-mtp":
            # The device sends the root alone (tree_rows = 1), but the verifier drafts and verifies root + K rows
            # itself, so its replies carry up to 1 + K samples: their count is not pinned.
            self._limits = replace(self._limits, tree_rows=None)
        return opened

    def append(self, turn: AppendTurn) -> Opened:
        """The next turn on the open session, after a reply that said finished: the verifier keeps the KV of the
        ``turn.keep`` held ids (after checking their crc32) and prefills the rest (docs/serving.md
        "Conversations"). Returns its OPENED (same session id, the new root's
        t, the append's prefill_ms). Raises a TransportError."""
        if self.opened is None:
            raise TransportError("append() before open(): open a session first")
        opened = self._request(wire.encode(turn), Opened, "appended turn")
        if opened.session_id != self.opened.session_id:
            raise BadReply(
                f"the verifier answered the appended turn for session {opened.session_id}, this client "
                f"holds {self.opened.session_id}"
            )
        return opened

    def round(self, tree: DraftTree) -> RoundReply:
        """Send one draft tree (Alg. 1 line 7) and return the verifier's reply (its seq must echo the tree's).

        Raises a TransportError (ServerError carries the verifier's code, e.g. ``bad_parent``)."""
        if self.opened is None:
            raise TransportError("round() before open(): open a session first")
        reply = self._request(wire.encode(tree), RoundReply, f"round {tree.seq}")
        if reply.seq != tree.seq:
            raise BadReply(f"the verifier answered round {reply.seq} to round {tree.seq}")
        self.round_bytes.append((self.last_up, self.last_down))
        return reply

    def _request(self, frame: bytes, expected: type, what: str):
        """Send one frame, wait for one frame; link delays on both sides; map every failure."""
        ws = self._ws
        if ws is None:
            raise ConnectionDropped(f"the {what} needs an open connection to {self.url}: open a session first")
        self._delay(len(frame))
        try:
            ws.send(frame)
            data = ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            self._abandon()
            raise RequestTimeout(f"no answer to the {what} from {self.url} within {self.timeout_s:g} s") from None
        except ConnectionClosed as e:
            told = self._last_words()
            self._abandon()
            if told is not None:  # the server said why before closing (idle_timeout, a limit, ...)
                raise self._error(told, what) from None
            raise ConnectionDropped(
                f"the connection to {self.url} closed during the {what} "
                f"({_close_reason(e)}); the session and its KV on the verifier are gone: "
                "open a new session to continue (behind Ray Serve it goes to a live "
                "replica)"
            ) from None
        self.last_up, self.last_down = len(frame), len(data)
        self.bytes_up += len(frame)
        self.bytes_down += len(data)
        self._delay(len(data))
        if isinstance(data, str):
            raise BadReply(f"the verifier answered the {what} with a text message; the protocol is binary")
        try:
            msg = wire.decode(data, self._limits)
        except wire.UnsupportedVersion as e:
            raise ProtocolMismatch(f"the verifier at {self.url} speaks another protocol: {e.message}") from None
        except wire.WireError as e:
            raise BadReply(f"the verifier's answer to the {what} is invalid: {e.code}: {e.message}") from None
        if isinstance(msg, ErrorReply):
            raise self._error(msg, what)
        version = wire.frame_version(data, self._limits)
        if version != wire.PROTOCOL_VERSION:
            raise ProtocolMismatch(
                f"the verifier at {self.url} answered the {what} in protocol version {version}: "
                f"this client speaks version {wire.PROTOCOL_VERSION}"
            )
        if not isinstance(msg, expected):
            raise BadReply(f"the verifier answered the {what} with {type(msg).__name__}, expected {expected.__name__}")
        return msg

    def _last_words(self) -> ErrorReply | None:
        """An ERROR frame the server sent before closing the connection (still buffered here), else None."""
        if self._ws is None:
            return None
        try:
            data = self._ws.recv(timeout=0)
            msg = wire.decode(data, self._limits) if isinstance(data, bytes) else None
        except Exception:  # noqa: BLE001 -- nothing buffered, or not a frame: there were no last words
            return None
        return msg if isinstance(msg, ErrorReply) else None

    def _error(self, reply: ErrorReply, what: str) -> TransportError:
        if reply.code in _AUTH_CODES:
            self._abandon()
            return AuthRefused(f"the verifier at {self.url} refused the session: {reply.code}: {reply.message}")
        if reply.code == "unsupported_version":
            return ProtocolMismatch(f"the verifier at {self.url} speaks another protocol: {reply.message}")
        return ServerError(reply.code, reply.message, what)

    def _delay(self, nbytes: int) -> None:
        if self.link is not None:
            seconds = self.link.one_way_s(nbytes)
            self.link_s += seconds
            self._sleep(seconds)

    def _abandon(self) -> None:
        """Drop a connection that can no longer carry the session."""
        ws, self._ws, self.opened = self._ws, None, None
        if ws is not None:
            ws.close()


def _close_reason(e: ConnectionClosed) -> str:
    frame = e.rcvd or e.sent
    if frame is None:
        return (
            "WebSocket code 1006, no close frame: the verifier's process, or a proxy or the network between, went away"
        )
    return f"code {frame.code}{': ' + frame.reason if frame.reason else ''}"
