"""Connections and channels: what the session loop (`hycoc.verifier.server.session_loop`) reads frames from.

`Connection` is one WebSocket's session state; `Channel` the transport-independent socket interface every front
door implements (`AiohttpChannel` here for ``hycoc verify-server``; Starlette's behind Ray Serve in
`hycoc.verifier.ray_serve`). `GuardedProtocol` / `GuardedRunner` put aiohttp's request handler behind the
``max_connections`` ledger (`hycoc.verifier.server.admission.ConnectionSlots`) and feed the handshake and frame
timeouts' watch (`Link`).

Keepalive. `AiohttpChannel` reads the socket in its own task for the connection's whole life: WebSocket pings are
answered (RFC 6455 section 5.5.2) and frames are taken off the wire while the session loop waits for the engine
(a long prefill, an APPEND, a batched round), so a client's keepalive (websockets' default: a ping every 20 s, 20 s
to answer) never drops a healthy connection whose server is busy; complete frames wait in a small queue
(`READ_AHEAD_FRAMES`) for the loop. Ray Serve's proxy (uvicorn) answers pings itself.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from aiohttp import WSMsgType, web

from hycoc.protocol import wire
from hycoc.protocol.messages import Opened

from ..engine import Session
from .admission import KvReservation, Link, SessionSlot

if TYPE_CHECKING:
    from .app import VerifierServer

#: Complete frames a connection's reader holds while the session loop is busy (a client has one request in flight;
#: past this the reader stops reading, as a full TCP window would).
READ_AHEAD_FRAMES = 4


@dataclass
class Connection:
    """One WebSocket connection's state (`VerifierServer.serve_connection`); ``session`` is None until its OPEN is
    answered.

    header_token: the upgrade's ``Authorization: Bearer`` token (`bearer_token`; None without the header).
    peer: the client's address (the auth rate limit counts per peer). connected: when the WebSocket was accepted
    (time.monotonic(); the handshake timeout runs from here when the front door cannot see the TCP connection).
    open_seen: an OPEN frame arrived (whatever its answer): the handshake timeout no longer applies.
    wire_version: the protocol version of the connection's OPEN frame (None before one): every answer goes out in
    it, and the session's frames must speak it.
    slot, kv: the session's admission (a ``max_sessions`` slot and its ``max_kv_bytes`` reservation), held from
    the OPEN's admission until the session ends. snap: the evictable reservation of its conversation snapshot
    (None: it holds none).
    """

    header_token: str | None
    peer: str = ""
    link: Link | None = None
    connected: float = field(default_factory=time.monotonic)
    open_seen: bool = False
    wire_version: int | None = None
    slot: SessionSlot | None = None
    kv: KvReservation | None = None
    snap: KvReservation | None = None
    opened: Opened | None = None
    session: Session | None = None
    session_id: int = 0
    limits: wire.Limits | None = None
    last_seq: int | None = None
    replied_at: float | None = None  # time.monotonic() when the last REPLY went out (the device's away time starts)
    reply_pending: bool = False  # the frame being answered is a round's REPLY (serve_connection stamps replied_at)
    last_request: bytes = b""
    last_reply: bytes = b""

    @property
    def kv_bytes(self) -> int:
        """KV bytes this connection's session holds reserved (0 without a session)."""
        return sum(r.nbytes for r in (self.kv, self.snap) if r is not None)


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
    own socket (`AiohttpChannel` here, Starlette's behind Ray Serve in `hycoc.verifier.ray_serve`)."""

    async def receive(self, timeout: float | None) -> bytes | str | None:
        """The next message: bytes (binary), str (text), or None once the peer closed or the socket failed.
        Raises asyncio.TimeoutError when none arrived within ``timeout`` seconds (None: no limit)."""

    async def send(self, frame: bytes) -> None:
        """Send one binary message; raises ConnectionError when the peer is gone."""

    async def close(self, code: int) -> None:
        """End the connection with this WebSocket close code (RFC 6455 section 7.4.1); never raises."""


class AiohttpChannel:
    """`Channel` over aiohttp's WebSocketResponse (opened with autoping off). A reader task (started on the first
    `receive`) answers pings and queues complete messages at once, whatever the session loop is doing (module
    docstring "Keepalive"); every message that arrives ends the link's frame-timeout watch."""

    def __init__(self, ws: web.WebSocketResponse, link: Link | None):
        self.ws, self.link = ws, link
        self._inbox: asyncio.Queue = asyncio.Queue(READ_AHEAD_FRAMES)
        self._reader: asyncio.Task | None = None

    async def _read(self) -> None:
        try:
            while True:
                msg = await self.ws.receive()
                if self.link is not None:
                    self.link.frame_since = None
                if msg.type == WSMsgType.PING:
                    await self.ws.pong(msg.data)
                    continue
                if msg.type == WSMsgType.PONG:
                    continue
                if msg.type in (WSMsgType.BINARY, WSMsgType.TEXT):
                    await self._inbox.put(msg.data)
                    continue
                break  # CLOSE, CLOSING, CLOSED, or ERROR (e.g. a message over aiohttp's limit)
        except (ConnectionError, RuntimeError):
            pass
        await self._inbox.put(None)

    async def receive(self, timeout: float | None) -> bytes | str | None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        return await asyncio.wait_for(self._inbox.get(), timeout)

    async def send(self, frame: bytes) -> None:
        await self.ws.send_bytes(frame)

    async def close(self, code: int) -> None:
        if self._reader is not None and not self._reader.done():
            self._reader.cancel()
            try:
                await self._reader
            except asyncio.CancelledError:
                pass
        try:
            await self.ws.close(code=code)
        except (ConnectionError, RuntimeError):
            pass


class GuardedProtocol(asyncio.Protocol):
    """aiohttp's request handler for one TCP connection, behind the server's connection limits: a connection over
    ``max_connections`` gets HTTP 503 with Retry-After and never reaches aiohttp; the others are tracked as a
    `Link` for the handshake and frame timeouts (the server's sweeper closes them)."""

    def __init__(self, server: VerifierServer, handler: asyncio.Protocol):
        self.server, self.handler = server, handler
        self.link: Link | None = None
        self.transport: asyncio.Transport | None = None
        self.answered = False

    def connection_made(self, transport) -> None:
        self.transport = transport
        self.link = self.server.admit_connection(transport)
        if self.link is not None:
            self.handler.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if self.link is None:  # refused: answer 503 once, discard the rest
            if not self.answered and self.transport is not None:
                self.answered = True
                self.server.answer_busy(self.transport)
            return
        if self.link.upgraded and self.link.frame_since is None:
            self.link.frame_since = time.monotonic()
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received() if self.link is not None else None

    def connection_lost(self, exc) -> None:
        if self.link is not None:
            self.server.admission.connections.release(self.link)
            self.handler.connection_lost(exc)

    def pause_writing(self) -> None:
        if self.link is not None:
            self.handler.pause_writing()

    def resume_writing(self) -> None:
        if self.link is not None:
            self.handler.resume_writing()


class GuardedRunner(web.AppRunner):
    """An AppRunner whose sites accept connections through `GuardedProtocol`."""

    def __init__(self, app: web.Application, server: VerifierServer, **kwargs):
        super().__init__(app, **kwargs)
        self._guard = server

    @property
    def server(self):
        inner = super().server
        if inner is None:
            return None
        return lambda: GuardedProtocol(self._guard, inner())
