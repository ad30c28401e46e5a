"""`VerifierServer`: the engine, its worker, the admission ledgers, the metrics and the session loop, served on
one aiohttp application (routes in the package docstring, `hycoc.verifier.server`)."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from aiohttp import WSCloseCode, web

from hycoc.protocol import wire

from ..allowance import CLASSES, AllowanceRule
from ..batch import RowBudget
from ..engine import Session, VerifierEngine
from ..row_budget import RowCost
from ..row_cost_measure import measure_row_cost, row_cost_plan
from .admission import Admission, KvReservation, Link
from .channels import AiohttpChannel, Channel, Connection, GuardedRunner, bearer_token
from .errors import ShuttingDown
from .limits import ServerLimits
from .memory import release_memory
from .metrics import METRICS_CONTENT_TYPE, ServerMetrics
from .session_loop import SessionLoop
from .settings import ServerSettings
from .worker import (
    EngineWorker,
)


class VerifierServer:
    """The verifier engine behind the wire protocol (see the package docstring for the routes and the rules).

    engine: the shared `VerifierEngine` (its model, head, keep set, W, K and hand-off scales).
    settings: the server's `ServerSettings` (tree rows, auth, frame bound, batching, row budget, allowance,
        prefills; each documented there); or give them as keywords of the same names (``tree_rows=33``), not both.
    limits: `ServerLimits` (recipe: the [verifier] keys of the same names).
    row_cost: the forward's `RowCost` for tree_budget / allowance "auto" (recipe verifier.row_cost); None: measured
        on the engine when the engine starts (`hycoc.verifier.row_cost_measure`, ~1 s on the toy).

    ``metrics`` (`ServerMetrics`), ``admission`` (`Admission`) and ``sessions`` (live sessions by id) may be read
    from other threads between requests.
    """

    def __init__(
        self,
        engine: VerifierEngine,
        settings: ServerSettings | None = None,
        *,
        limits: ServerLimits = ServerLimits(),
        row_cost: RowCost | None = None,
        **setting: Any,
    ):
        if settings is None:
            settings = ServerSettings(**setting)  # ValueError / TypeError naming a bad or unknown setting
        elif setting:
            raise TypeError(f"give the server's settings as ServerSettings or as keywords, not both: {sorted(setting)}")
        self.settings = settings
        self.engine = engine
        self.limits = limits
        self.row_cost = row_cost
        self._releaser: asyncio.Task | None = None
        self.metrics = ServerMetrics(live_sessions=lambda: len(self.sessions))
        self.admission = Admission(limits, self.metrics.refused)
        self.metrics.admission = self.admission
        self.prefill_pool_bytes = self._prefill_pool_bytes()
        self.prefill_pool: KvReservation | None = None  # its reservation, from `start_engine` to `stop`
        self.worker = EngineWorker(
            engine,
            batching=self.settings.batching,
            max_batch_rows=self.settings.max_batch_rows,
            max_batch_wait_ms=self.settings.max_batch_wait_ms,
            open_sessions=lambda: len(self.sessions),
            on_step=self.metrics.observe_step,
            row_budget=self.row_budget() if row_cost is not None else None,
            max_prefills=self.settings.max_prefills,
        )
        self.worker.after_call = self._sample_kv
        self.loop = SessionLoop(
            engine,
            self.worker,
            self.admission,
            self.metrics,
            limits,
            tree_rows=self.settings.tree_rows,
            auth_token=self.settings.auth_token,
            max_frame_bytes=self.settings.max_frame_bytes,
        )
        #: Live sessions by id (each holds a KV cache until its connection ends).
        self.sessions: dict[int, Session] = self.loop.sessions
        #: Largest incoming frame: an OPEN with the longest prompt and auth token (ROUND and CLOSE are smaller).
        self.in_frame_bytes = self.loop.in_frame_bytes
        self._runner: web.AppRunner | None = None
        self._sockets: set[web.WebSocketResponse] = set()
        self._sweeper: asyncio.Task | None = None
        self.url: str | None = None

    def _prefill_pool_bytes(self) -> int:
        """The prefill pool: a prefilling session's transient KV (its chunk's rows and an APPEND's undo copy of
        its sliding layers) once per session that may prefill at once (max_prefills; 1 serial). ValueError when
        max_kv_bytes cannot hold it."""
        per = getattr(self.engine, "prefill_transient_bytes", None)
        nbytes = (self.settings.max_prefills if self.settings.batching == "batched" else 1) * (
            int(per()) if per is not None else 0
        )
        if nbytes > self.admission.kv.capacity:
            raise ValueError(
                f"max_kv_bytes = {self.admission.kv.capacity} cannot hold the prefill pool: {nbytes} B for "
                f"max_prefills = {self.settings.max_prefills} sessions prefilling at once; raise max_kv_bytes or lower "
                "max_prefills"
            )
        return nbytes

    def _sample_kv(self) -> None:
        """Worker thread, after each engine call: the KV the sessions hold against what is reserved (metrics
        ``hycoc_kv_bytes_held``, ``hycoc_kv_bytes_held_peak``, ``hycoc_kv_held_over_reserved_total``)."""
        held_of = getattr(self.engine, "kv_bytes_held", None)
        if held_of is None:
            return
        budget = self.admission.kv
        with budget.lock:
            held, reserved = int(held_of()), budget.reserved
        self.metrics.observe_kv_held(held, reserved)

    async def _release_memory(self) -> None:
        """Every memory_release_s: the allocator's free pages back to the OS, on the worker between its steps
        (`hycoc.verifier.server.memory.release_memory`); RSS and the bytes released go to the metrics."""
        while True:
            await asyncio.sleep(self.settings.memory_release_s)
            try:
                before, after = await self.worker.run(release_memory)
            except ShuttingDown:
                return
            self.metrics.observe_memory_release(before, after)

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
        self.worker.start()
        if self.settings.memory_release_s > 0:
            self._releaser = asyncio.get_running_loop().create_task(self._release_memory())
        if self.prefill_pool_bytes and self.prefill_pool is None:
            self.prefill_pool = self.admission.kv.reserve(self.prefill_pool_bytes, 0)
            self.metrics.prefill_pool_bytes = self.prefill_pool_bytes
        if self.settings.tree_budget == "auto" or self.settings.allowance == "auto":
            if self.row_cost is None:
                sessions, rows = row_cost_plan(
                    self.settings.tree_rows, self.settings.max_batch_rows, self.engine.max_context
                )
                self.row_cost = await self.worker.run(
                    lambda: measure_row_cost(
                        self.engine,
                        sessions=sessions,
                        rows_per_tree=rows,
                        context=min(64, self.engine.max_context - rows[-1] - 1),
                    )
                )
            budget = self.row_budget()
            self.worker.set_row_budget(budget)
            self.worker.set_allowance(self.allowance_rule(budget))

    def allowance_rule(self, budget: RowBudget | None = None) -> AllowanceRule | None:
        """The replies' `AllowanceRule` ("auto", once the row cost is known), else None (the whole tree). Its free
        rows are the row budget's (one full tree or the cost line's flat part); its floor allowance_floor (0: K + 1),
        its ceiling tree_rows; it shares ``budget``'s learned state (host ms per session, accepted per expected
        token) when one is given."""
        if self.settings.allowance != "auto" or self.row_cost is None:
            return None
        return AllowanceRule.for_server(
            self.row_cost,
            self.settings.tree_rows,
            self.engine.chain_length,
            floor=self.settings.allowance_floor,
            target_ms=self.settings.allowance_target_ms,
            budget=None if budget is None else budget.state,
        )

    def row_budget(self) -> RowBudget | None:
        """The batched steps' `RowBudget` ("auto", once the row cost is known), else None. Its free rows: one full
        tree's (tree_rows) or the row cost's flat part, whichever is larger (so one session is never trimmed)."""
        if self.settings.tree_budget != "auto" or self.row_cost is None:
            return None
        return RowBudget(
            self.row_cost, max(self.settings.tree_rows, self.row_cost.flat_rows()), self.settings.min_rows_per_session
        )

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start the engine (`start_engine`), listen on host:port (0 = a free port) and return the
        ``ws://HOST:PORT`` URL. Raises OSError if the address cannot be bound."""
        await self.start_engine()
        self._runner = GuardedRunner(self.app(), self, handle_signals=False, access_log=None)
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
        """Stop: from now on every frame gets ERROR shutting_down and never reaches the engine (queued rounds and
        prefills get it too); close every connection (their sessions are freed), stop listening, let the worker
        finish what it runs. Front doors that own their sockets (Ray Serve) call it when their replica stops."""
        self.worker.stopping = True
        if self._releaser is not None:
            self._releaser.cancel()
            self._releaser = None
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.worker.stop()
        for _ in range(3):  # the sessions' reservations come back in callbacks the worker's frees scheduled
            await asyncio.sleep(0)
        if self.prefill_pool is not None:
            self.prefill_pool.release()
            self.prefill_pool = None

    async def _close_sockets(self, app) -> None:
        for ws in list(self._sockets):
            await ws.close(code=WSCloseCode.GOING_AWAY, message=b"server shutting down")

    # ----------------------------------------------------------------------------------------- TCP limits

    def admit_connection(self, transport: asyncio.Transport) -> Link | None:
        """A new TCP connection (`GuardedProtocol`): its `Link`, or None (closed after handshake_timeout_s, once
        `answer_busy` answered it) when max_connections are open."""
        link = self.admission.connections.admit(transport)
        if link is None:
            asyncio.get_running_loop().call_later(self.limits.handshake_timeout_s, transport.close)
        return link

    def answer_busy(self, transport: asyncio.Transport) -> None:
        """Answer a connection refused by `admit_connection` once its request arrives (a response sent before the
        request confuses clients): HTTP 503 with Retry-After, then close after a second of discarding its bytes
        (closing with them unread would reset the connection before the client reads the answer)."""
        retry = math.ceil(self.limits.retry_after_s)
        body = (f"max_connections = {self.limits.max_connections} reached; retry after {retry} s\n").encode()
        transport.write(
            b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: %d\r\nContent-Type: text/plain\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (retry, len(body), body)
        )
        asyncio.get_running_loop().call_later(1.0, transport.close)

    async def _sweep(self) -> None:
        """Close connections past the handshake timeout (no OPEN yet) or the frame timeout (a frame begun and not
        finished), several times per second."""
        lim = self.limits
        tick = max(0.05, min(1.0, lim.handshake_timeout_s / 4, lim.frame_timeout_s / 4))
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for link in list(self.admission.connections.links.values()):
                if link.kicked:
                    continue
                if not link.opened and now - link.connected > lim.handshake_timeout_s:
                    self._kick(link, "handshake_timeout")
                elif link.frame_since is not None and now - link.frame_since > lim.frame_timeout_s:
                    self._kick(link, "frame_timeout")

    def _kick(self, link: Link, kind: str) -> None:
        """Refuse a connection for a timeout: count it, send an ERROR frame when a WebSocket is up, close."""
        link.kicked = True
        frame = self.loop.time_out(None, kind)

        async def close() -> None:
            try:
                if link.ws is not None and not link.ws.closed:
                    await asyncio.wait_for(link.ws.send_bytes(frame), 1.0)
            except (TimeoutError, ConnectionError, RuntimeError):
                pass
            finally:
                link.transport.close()

        asyncio.get_running_loop().create_task(close())

    # ----------------------------------------------------------------------------------------- HTTP routes

    def health(self) -> dict:
        """The /healthz document: status, model, protocol_version (the newest spoken), protocol_versions (every
        one served), open sessions, tree_rows, max_context,
        vocab_size, max_frame_bytes, auth (bool), batching and limits (`ServerLimits` field -> value)."""
        eng = self.engine
        return {
            "status": "ok",
            "model": self.settings.model_name,
            "protocol_version": wire.PROTOCOL_VERSION,
            "protocol_versions": list(wire.SUPPORTED_VERSIONS),
            "sessions": self.metrics.sessions_active,
            "tree_rows": self.settings.tree_rows,
            "chain_length": eng.chain_length,
            "max_context": eng.max_context,
            "vocab_size": eng.vocab_size,
            "max_frame_bytes": self.settings.max_frame_bytes,
            "auth": self.settings.auth_token is not None,
            "batching": {
                "mode": self.settings.batching,
                "max_batch_rows": self.settings.max_batch_rows,
                "max_batch_wait_ms": self.settings.max_batch_wait_ms,
                "max_prefills": self.settings.max_prefills,
                "tree_budget": self.settings.tree_budget,
                "allowance": self.settings.allowance,
                **self._budget_health(),
                **self._allowance_health(),
            },
            "limits": self.limits.as_dict(),
        }

    def _budget_health(self) -> dict:
        budget = self.row_budget()
        if budget is None:
            return {}
        return {
            "min_rows_per_session": budget.min_rows,
            "free_rows": budget.free_rows,
            "row_cost": {"points": [list(p) for p in budget.cost.points], "source": budget.cost.source},
        }

    def _allowance_health(self) -> dict:
        rule = self.worker.allowance
        if rule is None:
            return {}
        return {
            "allowance_floor": rule.floor,
            "allowance_target_ms": rule.target_ms,
            "allowance_now": rule.allowance(),
            "sessions_per_step": round(rule.state.sessions, 3),
            "allowance_link_ms": round(rule.state.link_ms, 3),
            "allowance_drafting_ms": [rule.state.draft_floor_ms, rule.state.draft_tree_ms],
            "allowance_yields": {c: round(float(y), 4) for c, y in zip(CLASSES, rule.yields())},
            "allowance_yield_rounds": {c: int(n) for c, n in zip(CLASSES, rule.state.rounds)},
        }

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response(self.health())

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.exposition().encode("utf-8"), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )

    # ----------------------------------------------------------------------------------------- WebSocket

    async def _websocket(self, request: web.Request) -> web.StreamResponse:
        peer = request.remote or ""
        wait = self.admission.auth.refuse_if_limited(peer) if self.settings.auth_token is not None else 0.0
        if wait > 0:
            return web.Response(
                status=429,
                headers={"Retry-After": str(math.ceil(wait))},
                text=f"too many refused auth attempts from {peer}; retry after {math.ceil(wait)} s\n",
            )
        # autoping off: the channel's reader answers pings, so it also sees every frame that arrives (which ends
        # the frame timeout's watch) and keeps doing both while the engine works (channels module "Keepalive").
        ws = web.WebSocketResponse(max_msg_size=2 * self.in_frame_bytes, compress=False, autoping=False)
        await ws.prepare(request)
        link = self.admission.connections.links.get(request.transport) if request.transport else None
        conn = Connection(header_token=bearer_token(request.headers), peer=peer, link=link)
        if link is not None:
            link.ws, link.upgraded = ws, True
        self._sockets.add(ws)
        try:
            # The handshake and frame timeouts are the sweeper's (it sees the TCP connection before the upgrade).
            await self.serve_connection(conn, AiohttpChannel(ws, link), handshake_timeout=False)
        finally:
            self._sockets.discard(ws)
        return ws

    async def serve_connection(self, conn: Connection, channel: Channel, *, handshake_timeout: bool = True) -> None:
        """One WebSocket session from its upgrade to its end, over any transport (`SessionLoop.serve_connection`:
        this server's aiohttp socket, a Ray Serve replica's Starlette socket)."""
        await self.loop.serve_connection(conn, channel, handshake_timeout=handshake_timeout)

    async def frame(self, conn: Connection, data: bytes) -> tuple[bytes | None, bool]:
        """Answer one binary frame of ``conn`` (`SessionLoop.frame`)."""
        return await self.loop.frame(conn, data)

    def end_session(self, conn: Connection) -> None:
        """Free the connection's session and its admission (`SessionLoop.end_session`)."""
        self.loop.end_session(conn)
