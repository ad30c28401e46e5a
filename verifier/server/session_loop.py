"""The session loop: one WebSocket's frames from its upgrade to its end, over any `Channel`.

Every front door (``hycoc verify-server``'s aiohttp socket, a Ray Serve replica's Starlette socket) runs
`SessionLoop.serve_connection`: each binary frame is decoded by `hycoc.protocol.wire.decode` against the
connection's `Limits`, answered (OPEN -> prefill -> OPENED; ROUND -> REPLY; APPEND -> OPENED; CLOSE), and the
connection is closed as the answer says (1000 after a CLOSE, 1008 after a refusal); the session is freed at the end.

Validation. A bad frame gets an ERROR frame with the wire's code (``bad_parent``, ``token_out_of_vocab``,
``wrong_row_count``, ``frame_too_large``, ``context_overflow``, ``unknown_message_type``, ``unsupported_version``,
...), the engine's (``bad_seq``, ``bad_root``, ``finished``: `hycoc.verifier.errors`) or this server's
(`hycoc.verifier.server.errors`). A failed frame changes nothing: decoding happens before the engine is called, and
the engine restores its cache and sampler when a round fails (`Session.verify`). Errors never touch other
connections.

Auth. With ``auth_token`` set, an OPEN must present it, in the frame's ``auth_token`` or in the WebSocket upgrade's
``Authorization: Bearer T`` header; every token presented must match (compared in constant time). A missing token
gets ``auth_required``, a wrong one ``auth_refused``; both close the connection (WebSocket code 1008).

Admission (`hycoc.verifier.server.admission`). An OPEN takes a ``max_sessions`` slot and reserves its KV, (prompt +
max_new_tokens + B + 1, up to max_context) positions as the engine holds them (`session_kv_bytes`), before its prefill
is queued; an APPEND grows the reservation to the conversation plus the new turn's cap, plus the undo copy it keeps
until its last chunk (`rollback_copy_bytes`), before its prefill is queued, gives the copy back when the turn is
prefilled and all it added if the turn fails. A prefill's chunk rows are the server's prefill pool's (reserved at start
for ``max_prefills`` sessions). A conversation snapshot (OPEN's or APPEND's anchor) is reserved apart, from spare room
only, and given up (the snapshot dropped: that session's next turn re-prefills in full) when a session needs the room.
Reservations are given back after the worker freed what they cover, so the KV held never passes what is reserved.

Versions. A connection speaks the protocol version of its OPEN frame (`hycoc.protocol.wire.SUPPORTED_VERSIONS`:
5): every answer on it (OPENED, REPLY, ERROR) goes out in that version, the engine session carries it as
``Session.wire_version`` (a reply encoder writes ``wire.encode(reply, version=session.wire_version)``), and a later
frame in another version gets ``unsupported_version``. Before an OPEN, errors answer in the frame's own version when
it is a supported one or an older one whose ERROR is the same (`hycoc.protocol.wire.LEGACY_ERROR_VERSIONS`: an old
device reads its refusal and the fix), else in `hycoc.protocol.wire.PROTOCOL_VERSION`.

Retries. Rounds carry a sequence number. The same frame again with the seq of the last answered round gets the same
reply bytes again without touching the engine (idempotent retry); any other seq gets ``bad_seq``.

A client that disconnects mid-round: its round finishes on the worker, the reply is dropped, and the session's KV is
freed right after (the free is queued on the same worker, so it runs after the round).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import replace

from aiohttp import WSCloseCode

from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, Close, DraftTree, Opened, OpenRequest

from ..engine import Session, VerifierEngine
from ..kv_cache import full_positions
from .admission import Admission
from .channels import Channel, Connection
from .errors import (
    CLOSING_ERRORS,
    AlreadyOpen,
    AuthRefused,
    AuthRequired,
    BadSessionId,
    FrameTimeout,
    HandshakeTimeout,
    IdleTimeout,
    KeepSetMissing,
    NotOpened,
    ServerError,
    ShuttingDown,
    UnexpectedMessage,
)
from .limits import ServerLimits, open_frame_bytes
from .metrics import ServerMetrics
from .worker import EngineWorker

log = logging.getLogger("hycoc.verifier.server")


def _stop_ids(engine) -> tuple[int, ...]:
    """The verifier's stop ids for OPENED: the chat format's order, else sorted; (1,) for an engine with none."""
    fmt = getattr(engine, "chat_format", None)
    if fmt is not None:
        return tuple(fmt.stop_ids)
    return tuple(sorted(engine.eos_token_ids)) or (1,)


def open_engine_session(engine: VerifierEngine, req: OpenRequest) -> Session:
    """`VerifierEngine.open` with an OPEN's fields: the new session, not prefilled yet (its `prefill_job` for the
    batch scheduler, or `Session.prefill`). Raises what `open` raises for a request it refuses."""
    return engine.open(
        req.prompt_ids,
        req.sampling,
        req.seed,
        req.acceptance,
        req.epsilon,
        req.draft_place,
        req.max_new_tokens,
        anchor=req.anchor,
    )


class SessionLoop:
    """The wire protocol's per-connection logic (module docstring) over one engine.

    engine, worker: the shared `VerifierEngine` and its `EngineWorker`. admission, metrics: the server's ledgers
    and counters. limits: `ServerLimits`. tree_rows: B + 1 rows of device and server-head rounds (cloud-mtp: 1).
    auth_token: the shared secret (None: open). max_frame_bytes: largest reply frame; incoming frames, before and
    inside a session, are bounded by `open_frame_bytes` as well (``in_frame_bytes``: 147,508 B for the toy's 4,096
    positions). ``sessions``: live sessions by id.
    """

    def __init__(
        self,
        engine: VerifierEngine,
        worker: EngineWorker,
        admission: Admission,
        metrics: ServerMetrics,
        limits: ServerLimits,
        *,
        tree_rows: int,
        auth_token: str | None,
        max_frame_bytes: int,
    ):
        self.engine, self.worker, self.admission, self.metrics = engine, worker, admission, metrics
        self.limits = limits
        self.tree_rows = tree_rows
        self.auth_token = auth_token
        self.max_frame_bytes = max_frame_bytes
        self.sessions: dict[int, Session] = {}
        self._next_id = 1
        #: Largest incoming frame: an OPEN with the longest prompt and auth token (ROUND and CLOSE are smaller).
        self.in_frame_bytes = min(max_frame_bytes, open_frame_bytes(engine.max_context))
        # Before OPEN only the frame itself is checked; the OPEN's fields are checked after its auth token.
        self._bare_limits = wire.Limits(max_frame_bytes=self.in_frame_bytes)
        self._open_limits = wire.Limits(
            max_frame_bytes=self.in_frame_bytes, vocab_size=engine.vocab_size, max_context=engine.max_context
        )

    # ----------------------------------------------------------------------------------------- the loop

    async def serve_connection(self, conn: Connection, channel: Channel, *, handshake_timeout: bool = True) -> None:
        """One WebSocket session from its upgrade to its end (module docstring). Timeouts (limits module): an open
        session that sends nothing for idle_timeout_s, and, with ``handshake_timeout`` (for front doors that cannot
        watch the TCP connection), a connection without an OPEN handshake_timeout_s after ``conn.connected``, get
        the ERROR frame of `time_out` and a 1008 close. A text message gets ERROR unexpected_message (binary frames
        only). Never raises for a client that goes away."""
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
                except TimeoutError:
                    assert kind is not None  # receive(None) waits with no timeout
                    frame = self.time_out(conn, kind)
                    try:
                        await channel.send(frame)
                    except ConnectionError:
                        return
                    await channel.close(WSCloseCode.POLICY_VIOLATION)
                    return
                if msg is None:
                    return
                reply: bytes | None
                if isinstance(msg, str):
                    reply, keep_open = (
                        self.error_frame(
                            UnexpectedMessage("a text WebSocket message: the wire protocol uses binary frames only"),
                            conn.wire_version,
                        ),
                        True,
                    )
                else:
                    reply, keep_open = await self.frame(conn, msg)
                if reply is not None:
                    try:
                        await channel.send(reply)
                    except ConnectionError:  # the client left mid-round: drop the reply
                        return
                    conn.replied_at = time.monotonic() if conn.reply_pending else None
                    conn.reply_pending = False
                if not keep_open:
                    await channel.close(WSCloseCode.OK if reply is None else WSCloseCode.POLICY_VIOLATION)
                    return
        finally:
            self.end_session(conn)

    async def frame(self, conn: Connection, data: bytes) -> tuple[bytes | None, bool]:
        """Answer one binary frame of ``conn``: (the reply frame, or None after a CLOSE; keep the connection
        open). A bad frame gets its ERROR frame (never an exception); a refused OPEN (auth, capacity) and any frame
        after the server began to stop (ERROR shutting_down) close."""
        try:
            if self.worker.stopping:
                raise ShuttingDown(
                    "the verifier is shutting down: this frame did not reach the engine; open a new "
                    "session on another verifier (or this one once it is back)"
                )
            if conn.session is None:
                msg = wire.decode(data, self._bare_limits)
                if isinstance(msg, OpenRequest):
                    conn.wire_version = wire.frame_version(data)  # the session speaks its OPEN's version
                    return await self._open(conn, msg), True
                if isinstance(msg, Close):
                    return None, False
                if isinstance(msg, (DraftTree, AppendTurn)):
                    what = "ROUND" if isinstance(msg, DraftTree) else "APPEND"
                    raise NotOpened(f"{what} before OPEN: open a session first")
            else:
                version = wire.frame_version(data, conn.limits)
                if version != conn.wire_version:
                    raise wire.UnsupportedVersion(
                        f"frame speaks protocol version {version}: this session opened with version "
                        f"{conn.wire_version}, and every frame of a session speaks its OPEN's version"
                    )
                msg = wire.decode(data, conn.limits)
                if isinstance(msg, DraftTree):
                    return await self._round(conn, msg, bytes(data)), True
                if isinstance(msg, Close):
                    if msg.session_id not in (0, conn.session_id):
                        raise BadSessionId(
                            f"CLOSE names session {msg.session_id}; this connection holds session "
                            f"{conn.session_id} (or send 0)"
                        )
                    return None, False
                if isinstance(msg, AppendTurn):
                    return await self._append(conn, msg), True
                if isinstance(msg, OpenRequest):
                    raise AlreadyOpen(
                        f"this connection already holds session {conn.session_id}: one session per "
                        "connection; CLOSE it or open another connection"
                    )
            raise UnexpectedMessage(
                f"{type(msg).__name__} frames go from the verifier to the device; send OPEN, ROUND or CLOSE"
            )
        except CLOSING_ERRORS as e:
            return self.error_frame(e, self.answer_version(conn, data)), False
        except Exception as e:  # noqa: BLE001 -- every failure becomes an ERROR frame (internal ones are logged)
            return self.error_frame(e, self.answer_version(conn, data)), True

    @staticmethod
    def answer_version(conn: Connection | None, data: bytes | None = None) -> int:
        """The protocol version to answer ``conn`` in: its OPEN's once one arrived, else the version of ``data``'s
        header when that is a supported one or an older one whose ERROR this server can write
        (`wire.LEGACY_ERROR_VERSIONS`: the old peer reads its refusal), else `wire.PROTOCOL_VERSION`."""
        if conn is not None and conn.wire_version is not None:
            return conn.wire_version
        if data is not None and len(data) >= wire.HEADER.size:
            version = wire.HEADER.unpack_from(data)[1]
            if version in wire.SUPPORTED_VERSIONS or version in wire.LEGACY_ERROR_VERSIONS:
                return version
        return wire.PROTOCOL_VERSION

    # ----------------------------------------------------------------------------------------- OPEN, APPEND

    def _check_auth(self, conn: Connection, frame_token: str | None) -> None:
        if self.auth_token is None:
            return
        self.admission.auth.check(conn.peer)
        presented = [t for t in (frame_token, conn.header_token) if t is not None]
        if not presented:
            self.admission.auth.record(conn.peer)
            raise AuthRequired(
                "this verifier requires an auth token: send it in OPEN's auth_token or as 'Authorization: Bearer TOKEN'"
            )
        expected = self.auth_token.encode("utf-8")
        if not all(hmac.compare_digest(t.encode("utf-8"), expected) for t in presented):
            self.admission.auth.record(conn.peer)
            raise AuthRefused("the auth token does not match the verifier's (--auth-token)")

    def session_kv_bytes(self, positions: int) -> int:
        """KV bytes a session holds at ``positions`` (`VerifierEngine.session_kv_bytes`: sliding layers capped at
        their window + B + 1 rows); an engine without it reserves positions x kv_bytes_per_position."""
        eng = self.engine
        if hasattr(eng, "session_kv_bytes"):
            return int(eng.session_kv_bytes(positions, self.tree_rows))
        return int(positions) * eng.kv_bytes_per_position

    def session_positions(self, context: int, max_new_tokens: int) -> int:
        """KV positions a session reserves for ``context`` tokens and a cap of ``max_new_tokens`` more: the
        context, the cap and one tree (B + 1 rows), at most max_context."""
        return min(self.engine.max_context, int(context) + int(max_new_tokens) + self.tree_rows)

    async def _open(self, conn: Connection, req: OpenRequest) -> bytes:
        assert conn.wire_version is not None  # set from this OPEN's frame before it is dispatched
        conn.open_seen = True  # an OPEN arrived: the handshake is over, whatever its answer
        if conn.link is not None:
            conn.link.opened = True
        self._check_auth(conn, req.auth_token)
        wire.validate(req, self._open_limits)  # vocabulary and context, now that the client may know them
        fmt = getattr(self.engine, "chat_format", None)
        if req.chat is not None and fmt is not None:
            fmt.check_contract(req.chat)  # ChatMismatch (chat_mismatch) names both sides
        if req.draft_place == "server-head" and self.engine.keep_set is None:
            raise KeepSetMissing(
                "draft_place 'server-head' needs the keep set (Table 5), and this verifier has "
                "none: start it with `hycoc verify-server RECIPE --keep-set BUNDLE/keep_set.npy`, or run "
                "the device with another mode (hycoc run --mode hyco: device drafting)"
            )
        eng = self.engine
        slot = self.admission.sessions.acquire()
        try:
            positions = self.session_positions(len(req.prompt_ids), req.max_new_tokens)
            kv = self.admission.kv.reserve(self.session_kv_bytes(positions), positions)
        except BaseException:
            slot.release()
            raise
        snap = self._reserve_snapshot(req.anchor, len(req.prompt_ids) - 1)
        if snap is None and req.anchor:
            req = replace(req, anchor=0)  # no room for a snapshot: this conversation's next turn re-prefills
        try:
            if self.worker.batching == "batched":
                session = open_engine_session(eng, req)  # checks only
                prefill_ms, t = await self.worker.prefill(session.prefill_job)
            else:
                session, prefill_ms, t = await self.worker.run(self._open_session, req)
        except BaseException:
            for held in (kv, snap, slot):  # the failed prefill dropped its cache (`PrefillJob`)
                if held is not None:
                    held.release()
            raise
        conn.slot, conn.kv, conn.snap = slot, kv, snap
        self._evictable(conn, session)
        session_id, self._next_id = self._next_id, self._next_id + 1
        tree_rows = session.place.tree_rows(self.tree_rows)
        opened = Opened(
            session_id=session_id,
            t=t,
            prefill_ms=prefill_ms,
            max_context=eng.max_context,
            tree_rows=tree_rows,
            vocab_size=eng.vocab_size,
            hidden_size=eng.hidden_size,
            kv_dim_sliding=eng.kv_dim_sliding,
            kv_dim_full=eng.kv_dim_full,
            stop_ids=_stop_ids(eng),
        )
        session.wire_version = conn.wire_version  # the session's replies go out in its OPEN's version
        session.tree_rows = session.allowance = tree_rows  # the first round may hold the whole tree
        conn.session, conn.session_id, conn.opened = session, session_id, opened
        conn.limits = wire.Limits(  # in-session frames too are at most the largest OPEN (docs/serving.md "Limits")
            max_frame_bytes=self.in_frame_bytes,
            vocab_size=eng.vocab_size,
            tree_rows=tree_rows,
            max_context=eng.max_context,
        )
        self.sessions[session_id] = session
        rule = self.worker.allowance
        if rule is not None and session.place.device_rows:  # what this device's drafting costs it per round
            rule.observe_drafting(float(req.draft_ms_floor), float(req.draft_ms_tree))
        self.metrics.sessions_total += 1
        self.metrics.prefill_ms += prefill_ms
        return wire.encode(opened, version=conn.wire_version)

    async def _append(self, conn: Connection, msg: AppendTurn) -> bytes:
        """The next turn on the open session (`Session.append`, docs/serving.md "Conversations"): the KV rolls
        back to the ``keep`` ids both sides hold and the rest is prefilled; answered with OPENED (same session id,
        the new root's t, this prefill's ms). The checks (keep, its crc, the turn) run first and change nothing.
        The KV reservation grows to the conversation plus the new turn's cap, plus the rolled-back positions kept
        as a copy until the prefill ends (`Session.append` is all or nothing), BEFORE the prefill is queued
        (refused with kv_budget_exhausted when that does not fit); the copy's share is released when the turn is
        prefilled, everything added when it fails."""
        session = conn.session
        # an APPEND is dispatched on an open session only, which holds all four
        assert session is not None and conn.kv is not None and conn.opened is not None and conn.wire_version is not None
        budget = self.admission.kv
        budget.pin(conn.snap)  # the snapshot this APPEND may restore stays until it ends
        try:
            plan = session.plan_append(msg.tokens, int(msg.keep), int(msg.keep_crc))  # ConversationMismatch ...
            positions = self.session_positions(len(plan.conversation), msg.max_new_tokens)
            base = self.session_kv_bytes(positions)
            # the old cache stays whole until the first chunk replaces its tensors, beside the undo copy
            need = max(conn.kv.nbytes, base) + self.rollback_copy_bytes(session, plan) - conn.kv.nbytes
            added = conn.kv.grow(need, f"the next turn needs {need} more KV bytes")
        except BaseException:
            self._evictable(conn, session)
            raise
        new_snap = self._reserve_snapshot(int(msg.anchor), len(plan.conversation) - 1)
        anchor = int(msg.anchor) if new_snap is not None else 0  # no room: the old snapshot (if any) stays
        kwargs = dict(keep=int(msg.keep), keep_crc=int(msg.keep_crc), anchor=anchor)
        try:
            if self.worker.batching == "batched":
                prefill_ms, t = await self.worker.prefill(
                    lambda: session.append_job(msg.tokens, int(msg.max_new_tokens), **kwargs)
                )
            else:
                prefill_ms, t = await self.worker.run(
                    lambda: session.append(msg.tokens, int(msg.max_new_tokens), **kwargs)
                )
        except BaseException:
            conn.kv.shrink(added)  # the failed turn put the session back and dropped what it made (`PrefillJob`)
            if new_snap is not None:
                new_snap.release()
            self._evictable(conn, session)
            raise
        conn.kv.shrink(conn.kv.nbytes - base)  # the turn's cache is prefilled: the undo copy is gone
        if new_snap is not None:
            if conn.snap is not None:
                conn.snap.release()  # the new snapshot replaced the old one
            conn.snap = new_snap
        self._evictable(conn, session)
        conn.last_seq, conn.last_request, conn.last_reply = None, b"", b""
        session.allowance = session.tree_rows  # a new turn's first round may hold the whole tree again
        self.metrics.prefill_ms += prefill_ms
        plan = session.appends[-1]
        self.metrics.observe_append(plan)
        if plan.kind == "full" and plan.keep > 1:
            log.warning(
                "session %s: the APPEND kept %d ids but the rollback point lies before the snapshot at the "
                "last model turn's opening: the whole conversation (%d ids) was prefilled again (a template "
                "that renders earlier turns differently?)",
                conn.session_id,
                plan.keep,
                len(plan.conversation) - 1,
            )
        return wire.encode(replace(conn.opened, t=t, prefill_ms=prefill_ms), version=conn.wire_version)

    def rollback_copy_bytes(self, session: Session, plan) -> int:
        """Bytes of full-attention KV an APPEND keeps to undo itself while it runs: the positions the full layers
        hold after the rollback point (crop, snapshot: a clone of them; full: the whole old cache, from 0). Its
        sliding layers' copy is the prefill pool's (`VerifierEngine.prefill_transient_bytes`). 0 for an engine
        without a KV layout."""
        layout = getattr(self.engine, "kv_layout", None)
        if layout is None or session.cache is None:
            return 0
        return layout.full_bytes * max(0, full_positions(session.cache) - plan.start)

    def _reserve_snapshot(self, anchor: int, prefilled: int):
        """The spare-room reservation of the snapshot a prefill of ``prefilled`` positions takes at ``anchor``
        (`VerifierEngine.snapshot_bytes`), or None: no anchor, no room, or an engine without snapshots."""
        if not 0 < anchor <= prefilled or not hasattr(self.engine, "snapshot_bytes"):
            return None
        return self.admission.kv.reserve_spare(self.engine.snapshot_bytes(anchor))

    def _evictable(self, conn: Connection, session: Session) -> None:
        """Let the connection's snapshot reservation be given up when room is needed (module docstring): the
        snapshot is dropped first. A session without a snapshot gives its reservation back now."""
        snap = conn.snap
        if snap is None:
            return
        if session.snapshot is None:  # none was taken (an anchor past the prompt) or it is gone
            snap.release()
            conn.snap = None
            return

        def drop() -> None:
            session.snapshot = None
            if conn.snap is snap:
                conn.snap = None

        self.admission.kv.make_evictable(snap, drop)

    def _open_session(self, req: OpenRequest) -> tuple[Session, float, int]:
        """Worker thread (serial mode): a new engine session, prefilled."""
        session = open_engine_session(self.engine, req)
        prefill_ms, t = session.prefill()
        return session, prefill_ms, t

    # ----------------------------------------------------------------------------------------- ROUND

    async def _round(self, conn: Connection, tree: DraftTree, data: bytes) -> bytes:
        if tree.seq == conn.last_seq and data == conn.last_request:
            self.metrics.retries += 1
            return conn.last_reply  # idempotent retry: the same bytes, the engine untouched
        assert conn.session is not None  # a ROUND is dispatched on an open session only
        self._observe_away(conn, len(tree.tokens))
        if self.worker.batching == "batched":
            reply, frame, committed, verified = await self.worker.round(conn.session, tree)
        else:
            reply, frame, committed, verified, wait = await self.worker.run(
                self._verify, conn.session, tree, time.monotonic()
            )
            if verified:  # serial: every forward holds one session's rows
                self.metrics.observe_serial_round(reply.server_ms, len(reply.samples), wait)
        if verified:
            conn.last_seq, conn.last_request, conn.last_reply = tree.seq, data, frame
            self.metrics.rounds += 1
            self.metrics.tokens_committed += committed
            self.metrics.observe_allowance(conn.session, len(tree.tokens), reply.allowance)
            conn.reply_pending = not reply.finished
        return frame

    def _observe_away(self, conn: Connection, rows: int) -> None:
        """Teach the allowance rule how long the device was away between its last REPLY and this ROUND of
        ``rows`` rows (device-drafted places only: a cloud-mtp device drafts nothing)."""
        rule, session = self.worker.allowance, conn.session
        if conn.replied_at is not None and rule is not None and session is not None and session.place.device_rows:
            rule.observe_away(1e3 * (time.monotonic() - conn.replied_at), rows)
        conn.replied_at = None

    @staticmethod
    def _verify(session: Session, tree: DraftTree, arrived: float):
        """Worker thread (serial mode): one round (Alg. 4) and its reply frame. Returns (reply, frame, tokens
        committed, whether a round ran, seconds since ``arrived`` (time.monotonic()) when it started)."""
        wait = time.monotonic() - arrived
        rounds, before = session.rounds, len(session.tokens)
        reply = session.verify(tree.tokens, tree.parents, tree.seq)
        if session.rounds > rounds:  # a new round: serial mode grants the whole tree (no load to size it by)
            reply = session.grant(reply)
        frame = wire.encode(reply, version=session.wire_version)
        return reply, frame, len(session.tokens) - before, session.rounds > rounds, wait

    # ----------------------------------------------------------------------------------------- ends

    def end_session(self, conn: Connection) -> None:
        """Free the connection's session (nothing without one): drop it now, release its session slot, free its KV
        on the worker after any round in flight and give its KV reservations (session and snapshot) back once freed.
        Every front door calls it when a connection ends."""
        if conn.session is None:
            return
        session, conn.session = conn.session, None
        self.sessions.pop(conn.session_id, None)
        if conn.slot is not None:
            conn.slot.release()
        held = [r for r in (conn.kv, conn.snap) if r is not None]
        self.admission.kv.pin(conn.snap)
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None

        def release() -> None:
            for r in held:
                r.release()

        def free() -> None:  # on the worker, after any round in flight: the bytes come back once freed
            session.close()
            if loop is None or loop.is_closed():
                release()
            else:
                loop.call_soon_threadsafe(release)

        self.worker.submit(free)

    def timeout_error(self, kind: str) -> ServerError:
        """The error a timeout of this server's limits sends: kind "handshake_timeout" (HandshakeTimeout),
        "frame_timeout" (FrameTimeout) or "idle_timeout" (IdleTimeout), its message naming the limit's value."""
        lim = self.limits
        if kind == "handshake_timeout":
            return HandshakeTimeout(f"no OPEN within handshake_timeout_s = {lim.handshake_timeout_s:g} s of connecting")
        if kind == "frame_timeout":
            return FrameTimeout(f"a frame took longer than frame_timeout_s = {lim.frame_timeout_s:g} s to arrive")
        if kind == "idle_timeout":
            return IdleTimeout(
                f"no frame for idle_timeout_s = {lim.idle_timeout_s:g} s: the session's KV was "
                "freed; open a new session"
            )
        raise ValueError(f"timeout kind {kind!r}: one of handshake_timeout, frame_timeout, idle_timeout")

    def time_out(self, conn: Connection | None, kind: str) -> bytes:
        """A timeout fired on ``conn`` (None: a connection with no WebSocket state yet): count it in
        ``hycoc_refusals_total{kind=KIND}``, free the session's KV (before the client hears why) and return the
        ERROR frame (`timeout_error`) to send before closing with 1008."""
        exc = self.timeout_error(kind)
        self.metrics.refused(kind)
        if conn is not None:
            self.end_session(conn)
        return self.error_frame(exc, self.answer_version(conn))

    def error_frame(self, exc: BaseException, version: int | None = None) -> bytes:
        """The ERROR frame for ``exc`` (`hycoc.protocol.wire.error_reply`: a wire, engine or `ServerError` code;
        anything else is internal_error, logged with its traceback), counted in ``hycoc_errors_total``. version:
        the connection's protocol version (`answer_version`; None: `wire.PROTOCOL_VERSION`)."""
        reply = wire.error_reply(exc)
        self.metrics.errors[reply.code] += 1
        if reply.code == "internal_error":
            log.error("internal error on a frame", exc_info=exc)
        return wire.encode_error(reply, wire.PROTOCOL_VERSION if version is None else version)
