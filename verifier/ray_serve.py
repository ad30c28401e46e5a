"""The verifier as a Ray Serve deployment: N replicas behind one WebSocket endpoint (issue 14, DESIGN.md "Serving
many devices"). Needs the ``serve`` extra (``pip install -e ".[serve]"``: ``ray[serve]``).

One Ray Serve application, ``hycoc``, with one deployment, `VerifierReplica`, whose FastAPI ingress answers on the
proxy's port (Ray Serve docs, "Set Up FastAPI and HTTP": WebSockets):

    GET /  (WebSocket)  hycoc's wire protocol, unchanged (`hycoc.verifier.server`): one session per connection
    GET /healthz        JSON over every replica: status, replicas (id, pid, node, sessions, status), the limits
    GET /metrics        Prometheus text: every replica's series, each sample labelled ``replica="ID"``, plus
                        ``hycoc_replicas{state=...}``

Placement. Each replica loads its own engine (``engine_factory()``; for a recipe `RecipeEngine`, which calls the
same `hycoc.verifier.loading.engine_from_recipe` as ``hycoc verify-server``) and wraps it in a
`hycoc.verifier.server.VerifierServer` (its worker thread and, batched, its scheduler; the replica feeds it the
WebSocket's frames through its transport-independent ``_frame``; the loopback port its ``start`` also opens is
unused).
A WebSocket is one ASGI call held by the replica that accepted it, so a session stays on its replica for its
lifetime (its KV lives there). Ray's proxy picks the replica when the connection arrives: the default request
router ("power of two choices", ``ray/serve/_private/request_router/pow_2_router.py``) samples two replicas and
takes the one with fewer ongoing requests among those below ``max_ongoing_requests``; an open WebSocket is an
ongoing request until it closes, so a new session goes to the less loaded of two (with two replicas: the least
loaded) healthy replica. The counts are the proxy's own (``request_router.py``: a cache raised on every
assignment, lowered when a call ends, corrected by each replica's accept/reject answer and re-probed after 10 s),
and they include short HTTP calls such as /healthz, so "least loaded" is exact only between sessions; with
several proxies (one per node) each routes by its own view. A dead replica is skipped as soon as a probe or
call to it fails, and dropped when the controller reports it (Ray then starts a replacement).

Limits. Every `ServerLimits` value applies per replica, as in one ``hycoc verify-server``, with these differences
(the TCP connection belongs to Ray's proxy, not to the replica):
    max_connections       the deployment's ``max_ongoing_requests`` (+ HEALTH_HEADROOM for /healthz and
                          /metrics): connections above it wait in the proxy's queue for a replica with room
    handshake_timeout_s   accept -> first frame (the replica cannot see a TCP connection before its upgrade)
    frame_timeout_s       not applied: the proxy's uvicorn assembles frames (its ws_ping_interval/timeout drop
                          dead peers)
    auth_failures_per_minute  per peer address as the proxy reports it, per replica
    idle_timeout_s, max_sessions, max_kv_bytes, max_frame_bytes, auth: exactly as the single server.

A replica's death. Its sessions end: the proxy closes their sockets without a close frame (WebSocket code 1006;
the device client says the session is lost and to open a new one); the other replicas' sessions go on; new
sessions go to the survivors or to the replacement once it is up.

Entry points: `build_app` (the application), `start` (deploy on a Ray instance, returns the URL), `run` (blocking,
for ``hycoc serve-ray``), `merge_expositions` and `health_summary` (what /metrics and /healthz render).
"""

# No ``from __future__ import annotations``: FastAPI reads the route handlers' annotations (``websocket: WebSocket``)
# at decoration time, and Serve's ingress rebinds the methods where postponed (string) annotations do not resolve.
import asyncio
import json
import os
import re
import signal
import time
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.websockets import WebSocketDisconnect

from .server import (METRICS_CONTENT_TYPE, HandshakeTimeout, IdleTimeout, ServerLimits, UnexpectedMessage,
                     VerifierServer, _bearer, _Connection)


#: The Serve application and deployment names (``serve status`` shows them).
APP_NAME = "hycoc"
DEPLOYMENT_NAME = "HycocVerifier"
#: Ongoing requests a replica takes beyond max_connections: room for /healthz and /metrics when it is full.
HEALTH_HEADROOM = 4
#: Seconds /healthz and /metrics wait for every replica's snapshot.
SNAPSHOT_TIMEOUT_S = 5.0
#: WebSocket close codes (RFC 6455 section 7.4.1): normal, policy violation.
WS_NORMAL, WS_POLICY = 1000, 1008


# --------------------------------------------------------------------------------------------------- engines


@dataclass(frozen=True)
class RecipeEngine:
    """Builds a recipe's verifier engine inside a replica, as ``hycoc verify-server`` does (picklable: paths only).

    recipe: the recipe TOML's path. device: "cpu" / "cuda" (None: the recipe's ``[verifier].device``).
    keep_set: a ``keep_set.npy`` of int token ids for server-head sessions (None: none; they are refused).
    Calling it sets torch's threads to ``[verifier].threads`` and returns
    `hycoc.verifier.loading.engine_from_recipe` (which raises ModelNotFoundError, RecipeError, DeviceUnavailable).
    """

    recipe: str
    device: str | None = None
    keep_set: str | None = None

    def __call__(self):
        import numpy as np
        import torch

        from hycoc.models import set_threads
        from hycoc.recipe import load_recipe

        from .loading import engine_from_recipe

        cfg = load_recipe(self.recipe)
        set_threads(cfg.verifier.threads)
        ids = None
        if self.keep_set is not None:
            ids = torch.as_tensor(np.load(self.keep_set, allow_pickle=False), dtype=torch.long)
        return engine_from_recipe(cfg, self.device, keep_set=ids)


def check_keep_set(path) -> None:
    """Raise ValueError naming ``--keep-set PATH`` unless it is a non-empty 1-D .npy of int token ids (what the
    keep-set pass writes as ``keep_set.npy``); checked once before the replicas load it."""
    import numpy as np

    try:
        ids = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        raise ValueError(f"--keep-set {path}: not a .npy array file; give the bundle's keep_set.npy (written by "
                         "hycoc build)") from None
    if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) == 0:
        raise ValueError(f"--keep-set {path}: expected a non-empty 1-D array of int token ids, got shape "
                         f"{ids.shape} dtype {ids.dtype}")


# --------------------------------------------------------------------------------------------------- rendering


_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})? (\S+)$")


def merge_expositions(texts: dict[str, str | None]) -> str:
    """One Prometheus text exposition (format 0.0.4) from every replica's: replica id -> its text, or None for a
    replica that did not answer.

    Each family's HELP and TYPE lines appear once, then its samples from every replica in the order of ``texts``,
    each with ``replica="ID"`` as the first label (``a_total{kind="x"} 3`` -> ``a_total{replica="r1",kind="x"} 3``).
    A gauge ``hycoc_replicas{state="up"|"unreachable"}`` counts the replicas. Raises ValueError for a line that is
    neither a comment nor a sample (a replica running another version).
    """
    families: dict[str, list[str]] = {}
    samples: dict[str, list[str]] = {}
    for replica, text in texts.items():
        if text is None:
            continue
        family = None
        for line in text.splitlines():
            if not line:
                continue
            if line.startswith("# "):
                _, kind, name, *_ = line.split(" ", 3)
                family = name
                if name not in samples:
                    families.setdefault(name, [])
                    samples[name] = []
                if kind in ("HELP", "TYPE") and len(families[name]) < 2 and line not in families[name]:
                    families[name].append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                raise ValueError(f"replica {replica}: not a Prometheus sample line: {line!r}")
            name, labels, value = m.groups()
            inner = labels[1:-1] if labels else ""
            labelled = f'replica="{replica}"' + (f",{inner}" if inner else "")
            key = family if family is not None and name.startswith(family) else name  # histogram _bucket/_sum
            samples.setdefault(key, []).append(f"{name}{{{labelled}}} {value}")
    up = sum(text is not None for text in texts.values())
    lines = ["# HELP hycoc_replicas verifier replicas by state (Ray Serve deployment " + DEPLOYMENT_NAME + ")",
             "# TYPE hycoc_replicas gauge",
             f'hycoc_replicas{{state="up"}} {up}',
             f'hycoc_replicas{{state="unreachable"}} {len(texts) - up}']
    for name, rows in samples.items():
        lines += families.get(name, []) + rows
    return "\n".join(lines) + "\n"


def health_summary(snapshots: list[dict | BaseException], static: dict) -> tuple[int, dict]:
    """The /healthz answer over every replica: (HTTP status, JSON body).

    snapshots: one per replica the router knew, each `VerifierReplica.snapshot`'s dict or the exception its call
    raised (a dead replica). static: the fields every replica shares (model, protocol_version, tree_rows, limits,
    ...; a replica's own /healthz keys). status is "ok" when every replica answered, "degraded" when some did,
    "down" (HTTP 503) when none did; ``sessions`` is the sum over the replicas that answered.
    """
    replicas = []
    for snap in snapshots:
        if isinstance(snap, BaseException):
            replicas.append({"replica": None, "status": "unreachable", "error": f"{type(snap).__name__}: {snap}"})
        else:
            replicas.append({k: snap[k] for k in ("replica", "pid", "node", "sessions")} | {"status": "ok"})
    up = [r for r in replicas if r["status"] == "ok"]
    status = "ok" if up and len(up) == len(replicas) else ("degraded" if up else "down")
    replicas.sort(key=lambda r: (r["status"] != "ok", str(r["replica"])))
    body = {"status": status, **static, "sessions": sum(r["sessions"] for r in up),
            "replicas_up": len(up), "replicas": replicas}
    return (200 if up else 503), body


# --------------------------------------------------------------------------------------------------- replica


ingress = FastAPI(title="hycoc verifier (Ray Serve)")


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress(ingress)
class VerifierReplica:
    """One replica: an engine and its `VerifierServer`, fed the frames of the WebSockets this replica accepted.

    engine_factory: a picklable callable returning a `hycoc.verifier.engine.VerifierEngine` (`RecipeEngine`), run
    in the replica's process. server_kwargs: `VerifierServer`'s keywords (tree_rows, auth_token,
    max_frame_bytes, model_name, limits: `hycoc.verifier.loading.server_options`).
    """

    async def __init__(self, engine_factory: Callable[[], Any], server_kwargs: dict):
        self.server = VerifierServer(engine_factory(), **server_kwargs)
        # start() gives the server its engine worker (and, batched, its scheduler) on this replica's event loop; it
        # also listens on a loopback port of its own, which nothing uses (a transport-free start is not public yet).
        await self.server.start("127.0.0.1", 0)
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name = context.app_name
        self.pid = os.getpid()
        import ray

        self.node = ray.util.get_node_ip_address()
        self._peers = None

    async def __del__(self) -> None:
        """Graceful replica shutdown (Ray awaits it): stop the server's loopback listener, worker and scheduler."""
        await self.server.stop()

    # ----------------------------------------------------------------------------------------- sessions

    @ingress.websocket("/")
    async def session(self, websocket: WebSocket) -> None:
        """One session: the frames of one WebSocket through `VerifierServer` (server.py's ``_websocket`` loop with
        the replica's limits: see the module docstring)."""
        server, limits = self.server, self.server.limits
        await websocket.accept()
        peer = websocket.client.host if websocket.client is not None else ""
        conn = _Connection(header_token=_bearer(websocket.headers), peer=peer)
        first_frame = True
        try:
            while True:
                if conn.session is not None:
                    timeout = limits.idle_timeout_s
                elif first_frame:
                    timeout = limits.handshake_timeout_s
                else:
                    timeout = None
                try:
                    msg = await asyncio.wait_for(websocket.receive(), timeout)
                except asyncio.TimeoutError:
                    await self._time_out(websocket, conn, first_frame)
                    break
                if msg["type"] == "websocket.disconnect":
                    break
                first_frame = False
                if msg.get("bytes") is not None:
                    reply, keep_open = await server._frame(conn, msg["bytes"])
                else:
                    reply, keep_open = server._error(UnexpectedMessage(
                        "a text WebSocket message: the wire protocol uses binary frames only")), True
                if reply is not None:
                    await websocket.send_bytes(reply)
                if not keep_open:
                    await websocket.close(code=WS_NORMAL if reply is None else WS_POLICY)
                    break
        except (WebSocketDisconnect, RuntimeError, ConnectionError):
            pass  # the client left (mid-round: the reply is dropped)
        finally:
            server._end_session(conn)

    async def _time_out(self, websocket: WebSocket, conn: _Connection, handshake: bool) -> None:
        """The handshake or idle timeout fired: count it, free the KV, send the ERROR frame, close (1008)."""
        server, limits = self.server, self.server.limits
        if handshake:
            server.metrics.refusals["handshake_timeout"] += 1
            exc = HandshakeTimeout(f"no OPEN within handshake_timeout_s = {limits.handshake_timeout_s:g} s of "
                                   "connecting")
        else:
            server.metrics.refusals["idle_timeout"] += 1
            server._end_session(conn)  # the KV is freed before the client hears why
            exc = IdleTimeout(f"no frame for idle_timeout_s = {limits.idle_timeout_s:g} s: the session's KV was "
                              "freed; open a new session")
        try:
            await websocket.send_bytes(server._error(exc))
            await websocket.close(code=WS_POLICY)
        except (WebSocketDisconnect, RuntimeError, ConnectionError):
            pass

    # ----------------------------------------------------------------------------------------- health, metrics

    async def snapshot(self) -> dict:
        """This replica's state for /healthz and /metrics (called on every replica by ``handle.broadcast``):
        replica id, pid, node IP, open sessions and the Prometheus text of its `VerifierServer`."""
        return {"replica": self.replica_id, "pid": self.pid, "node": self.node,
                "sessions": self.server.metrics.sessions_active, "metrics": self.server.metrics.exposition()}

    async def _snapshots(self) -> list[dict | BaseException]:
        if self._peers is None:
            self._peers = serve.get_deployment_handle(DEPLOYMENT_NAME, self.app_name)
        try:
            return await self._peers.broadcast("snapshot").results_async(timeout_s=SNAPSHOT_TIMEOUT_S,
                                                                         return_exceptions=True)
        except TimeoutError as e:  # the whole broadcast: answer with this replica alone, marked
            return [await self.snapshot(), e]

    async def _static(self) -> dict:
        """This replica's own /healthz document (`VerifierServer`'s: model, protocol_version, tree_rows, limits,
        ...) without its per-replica status and sessions, which `health_summary` replaces."""
        doc = json.loads((await self.server._healthz(None)).text)
        for key in ("status", "sessions"):
            doc.pop(key, None)
        return doc | {"limits_apply": "per replica"}

    @ingress.get("/healthz")
    async def healthz(self) -> JSONResponse:
        """Every replica's health (`health_summary`): HTTP 200 while one answers, else 503."""
        code, body = health_summary(await self._snapshots(), await self._static())
        return JSONResponse(body, status_code=code)

    @ingress.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's /metrics, labelled by replica (`merge_expositions`)."""
        texts: dict[str, str | None] = {}
        for i, snap in enumerate(await self._snapshots()):
            if isinstance(snap, BaseException):
                texts[f"unreachable-{i}"] = None
            else:
                texts[snap["replica"]] = snap["metrics"]
        return Response(merge_expositions(texts).encode("utf-8"), headers={"Content-Type": METRICS_CONTENT_TYPE})


# --------------------------------------------------------------------------------------------------- running


def build_app(engine_factory: Callable[[], Any], *, replicas: int, server_kwargs: dict, cpus_per_replica: float = 1,
              gpus_per_replica: float = 0):
    """The Serve application: `VerifierReplica` x ``replicas`` (a ``ray.serve.Application`` for `start`).

    cpus_per_replica / gpus_per_replica: Ray resources each replica reserves (the recipe's torch threads; 1 GPU
    per replica on CUDA), so Ray places no more replicas on a node than it has. max_ongoing_requests per replica
    = the limits' max_connections + HEALTH_HEADROOM (module docstring "Limits"). Raises ValueError for
    replicas < 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas = {replicas}: must be >= 1")
    limits: ServerLimits = server_kwargs.get("limits", ServerLimits())
    return VerifierReplica.options(
        num_replicas=replicas,
        max_ongoing_requests=limits.max_connections + HEALTH_HEADROOM,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
    ).bind(engine_factory, server_kwargs)


def start(app, host: str = "127.0.0.1", port: int = 8765) -> str:
    """Deploy ``app`` on the connected Ray instance (``ray.init`` first), its proxy on host:port; returns the
    ``ws://HOST:PORT`` URL once every replica is up. Raises RuntimeError when the deployment fails (a replica's
    constructor raised: the message has its traceback)."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(app, name=APP_NAME, route_prefix="/")
    url_host = f"[{host}]" if ":" in host else host
    return f"ws://{url_host}:{port}"


def run(app, host: str, port: int, *, ray_address: str | None = None, num_cpus: float | None = None,
        on_listening: Callable[[str], None] | None = None) -> None:
    """Start Ray (``ray_address``: None = a local instance; "auto" or ray://... joins a cluster), deploy ``app``
    and block until SIGINT or SIGTERM, then shut Serve and Ray down. ``on_listening(url)`` runs once it serves."""
    import ray

    ray.init(address=ray_address, num_cpus=num_cpus if ray_address is None else None, include_dashboard=False,
             log_to_driver=True)
    try:
        url = start(app, host, port)
        if on_listening is not None:
            on_listening(url)
        stop = {"now": False}

        def stop_now(*_):
            stop["now"] = True

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop_now)
        while not stop["now"]:
            time.sleep(0.2)
        serve.shutdown()
    finally:
        ray.shutdown()


def replica_cpus(threads: int) -> float:
    """Ray CPUs a replica reserves for a recipe's ``[verifier].threads`` (0 = torch's default: counted as 1)."""
    return float(threads) if threads > 0 else 1.0


__all__ = ["APP_NAME", "DEPLOYMENT_NAME", "RecipeEngine", "check_keep_set", "VerifierReplica", "build_app", "start",
           "run", "merge_expositions", "health_summary", "replica_cpus"]
