"""The verifier as a Ray Serve deployment: N replicas behind one WebSocket endpoint (docs/design.md "Serving
many devices"; docs/serving.md "Scale out with Ray Serve"). Needs the ``serve`` extra (``ray[serve]``), installed
with the other extras in one command: ``pip install -e ".[full,dev,qnn,hub,serve]"``.

One Ray Serve application, ``hycoc``, with one deployment, `VerifierReplica`, whose FastAPI ingress answers on the
proxy's port (Ray Serve docs, "Set Up FastAPI and HTTP": WebSockets):

    GET /  (WebSocket)  hycoc's wire protocol, unchanged (`hycoc.verifier.server`): one session per connection
    GET /healthz        JSON over every replica: status, replicas (id, pid, node, sessions, status), the limits
    GET /metrics        Prometheus text: every replica's series, each sample labelled ``replica="ID"``, plus
                        ``hycoc_replicas{state=...}``

No /docs, /redoc or /openapi.json (FastAPI's defaults): the wire protocol is binary frames, which OpenAPI does not
describe.

Placement. Each replica loads its own engine (``engine_factory()``; for a recipe `RecipeEngine`, which calls the
same `hycoc.verifier.loading.engine_from_recipe` as ``hycoc verify-server``) and wraps it in a
`hycoc.verifier.server.VerifierServer` started without a listener (``start_engine``: its worker thread and,
batched, its scheduler); each accepted WebSocket goes through ``VerifierServer.serve_connection``, the session
loop ``hycoc verify-server`` runs too.
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
    handshake_timeout_s   accept -> an OPEN frame (the replica cannot see a TCP connection before its upgrade)
    frame_timeout_s       not applied (/healthz lists it under limits_not_applied; its refusal counter stays 0): the
                          proxy's uvicorn assembles each WebSocket message before Ray forwards it, so a replica
                          never sees a frame in progress, and neither Ray Serve 2.60's http_options nor uvicorn
                          have a per-message timeout. A trickled frame is cut by handshake_timeout_s before the
                          OPEN and by idle_timeout_s after it (no complete frame for that long); uvicorn buffers
                          at most its ws_max_size (16 MiB) per message, and its pings (20 s) drop dead peers.
    auth_failures_per_minute  per peer address as the proxy reports it, per replica
    idle_timeout_s, max_sessions, max_kv_bytes, max_frame_bytes, auth: exactly as the single server.

Logs. Ray's own lines (driver, controller, proxies, replicas) reach the console on stderr, at WARNING and above by
default (``run``'s ``log_level``, ``hycoc serve-ray --log-level``; Serve's per-request access log at INFO and
below); every Ray process keeps its full log under Ray's session directory (/tmp/ray/session_latest/logs, Serve's
in logs/serve/). stdout carries hycoc's lines only. A session that ends normally logs nothing at ERROR: after a
CLOSE frame the replica lets the client close the WebSocket (`CLOSE_WAIT_S`) instead of racing it with its own
close, which Ray 2.60's proxy logs as an ERROR with a GeneratorExit traceback.

A replica's death. Its sessions end: the proxy closes their sockets without a close frame (WebSocket code 1006;
the device client says the session is lost and to open a new one); the other replicas' sessions go on; new
sessions go to the survivors or to the replacement once it is up.

Entry points: `build_app` (the application), `start` (deploy on a Ray instance, returns the URL), `run` (blocking,
for ``hycoc serve-ray``), `merge_expositions` and `health_summary` (what /metrics and /healthz render).
"""

# No ``from __future__ import annotations``: FastAPI reads the route handlers' annotations (``websocket: WebSocket``)
# at decoration time, and Serve's ingress rebinds the methods where postponed (string) annotations do not resolve.
import asyncio
import contextlib
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, WebSocket
from fastapi.responses import JSONResponse, Response
from ray import serve
from starlette.websockets import WebSocketDisconnect

from .server import METRICS_CONTENT_TYPE, Connection, ServerLimits, VerifierServer, bearer_token

#: The Serve application and deployment names (``serve status`` shows them).
APP_NAME = "hycoc"
DEPLOYMENT_NAME = "HycocVerifier"
#: Ongoing requests a replica takes beyond max_connections: room for /healthz and /metrics when it is full.
HEALTH_HEADROOM = 4
#: Seconds /healthz and /metrics wait for every replica's snapshot.
SNAPSHOT_TIMEOUT_S = 5.0
#: WebSocket close code (RFC 6455 section 7.4.1): normal closure.
WS_NORMAL = 1000
#: Seconds a replica waits, after a CLOSE frame, for the client to close the WebSocket before closing it itself.
CLOSE_WAIT_S = 2.0
#: Levels of `LOG_LEVELS` for Ray's own logs (driver, controller, proxy, replicas); hycoc's default: WARNING.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
DEFAULT_LOG_LEVEL = "WARNING"


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
        import torch

        from hycoc.keep_set import load_keep_set
        from hycoc.models import set_threads
        from hycoc.recipe import load_recipe

        from .loading import engine_from_recipe

        cfg = load_recipe(self.recipe)
        set_threads(cfg.verifier.threads)
        ids = None
        if self.keep_set is not None:
            ids = torch.as_tensor(load_keep_set(self.keep_set), dtype=torch.long)
        return engine_from_recipe(cfg, self.device, keep_set=ids)


def check_keep_set(path) -> None:
    """Raise ValueError naming ``--keep-set PATH`` unless it is a non-empty 1-D .npy of int token ids (what the
    keep-set pass writes as ``keep_set.npy``; `hycoc.keep_set.load_keep_set`); checked once before the
    replicas load it."""
    from hycoc.keep_set import load_keep_set

    load_keep_set(path)


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
    lines = [
        "# HELP hycoc_replicas verifier replicas by state (Ray Serve deployment " + DEPLOYMENT_NAME + ")",
        "# TYPE hycoc_replicas gauge",
        f'hycoc_replicas{{state="up"}} {up}',
        f'hycoc_replicas{{state="unreachable"}} {len(texts) - up}',
    ]
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
    replicas: list[dict[str, Any]] = []
    for snap in snapshots:
        if isinstance(snap, BaseException):
            replicas.append({"replica": None, "status": "unreachable", "error": f"{type(snap).__name__}: {snap}"})
        else:
            replicas.append({k: snap[k] for k in ("replica", "pid", "node", "sessions")} | {"status": "ok"})
    up = [r for r in replicas if r["status"] == "ok"]
    status = "ok" if up and len(up) == len(replicas) else ("degraded" if up else "down")
    replicas.sort(key=lambda r: (r["status"] != "ok", str(r["replica"])))
    body = {
        "status": status,
        **static,
        "sessions": sum(r["sessions"] for r in up),
        "replicas_up": len(up),
        "replicas": replicas,
    }
    return (200 if up else 503), body


# --------------------------------------------------------------------------------------------------- replica


# No /docs, /redoc or /openapi.json: the wire protocol is binary WebSocket frames, which OpenAPI does not describe,
# and /healthz and /metrics are the ones of ``hycoc verify-server`` (FastAPI docs, "Metadata and Docs URLs").
ingress = FastAPI(title="hycoc verifier (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


class _StarletteChannel:
    """`hycoc.verifier.server.Channel` over the replica's Starlette WebSocket (messages forwarded by Ray's proxy).

    close(1000) after a CLOSE frame first waits up to CLOSE_WAIT_S for the client to close: hycoc's client closes
    right after sending CLOSE, and a close sent after the client's reaches the proxy's uvicorn as a send on a
    disconnected socket, which Ray's proxy logs at ERROR with a GeneratorExit traceback (Ray 2.60,
    ``proxy.py`` ``send_request_to_replica``)."""

    def __init__(self, websocket: WebSocket):
        self.ws = websocket

    async def receive(self, timeout: float | None) -> bytes | str | None:
        try:
            msg = await asyncio.wait_for(self.ws.receive(), timeout)
        except (WebSocketDisconnect, RuntimeError, ConnectionError):
            return None
        if msg["type"] == "websocket.disconnect":
            return None
        if msg.get("bytes") is not None:
            return msg["bytes"]
        return msg.get("text") or ""

    async def send(self, frame: bytes) -> None:
        try:
            await self.ws.send_bytes(frame)
        except (WebSocketDisconnect, RuntimeError) as e:
            raise ConnectionError(f"the client left: {e}") from e

    async def close(self, code: int) -> None:
        if code == WS_NORMAL:
            deadline = time.monotonic() + CLOSE_WAIT_S
            try:
                while (await self.receive(max(0.0, deadline - time.monotonic()))) is not None:
                    pass  # frames after CLOSE are ignored
                return  # the client closed: nothing more to send
            except TimeoutError:
                pass
        try:
            await self.ws.close(code=code)
        except (WebSocketDisconnect, RuntimeError, ConnectionError):
            pass


@serve.deployment(name=DEPLOYMENT_NAME)
@serve.ingress(ingress)
class VerifierReplica:
    """One replica: an engine and its `VerifierServer`, fed the frames of the WebSockets this replica accepted.

    engine_factory: a picklable callable returning a `hycoc.verifier.engine.VerifierEngine` (`RecipeEngine`), run
    in the replica's process. server_kwargs: `VerifierServer`'s keywords (tree_rows, auth_token,
    max_frame_bytes, model_name, limits: `hycoc.verifier.loading.server_options`).
    """

    async def __init__(self, engine_factory: Callable[[], Any], server_kwargs: dict):  # type: ignore[misc]  # Serve awaits it
        self.server = VerifierServer(engine_factory(), **server_kwargs)
        # The engine's worker (and, batched, its scheduler) on this replica's event loop; the sockets are Ray's.
        await self.server.start_engine()
        context = serve.get_replica_context()
        self.replica_id = context.replica_id.unique_id
        self.app_name = context.app_name
        self.pid = os.getpid()
        import ray

        self.node = ray.util.get_node_ip_address()
        self._peers: Any = None  # Serve's DeploymentHandle to every replica, made on first use

    async def __del__(self) -> None:
        """Graceful replica shutdown (Ray awaits it): stop the server's worker and scheduler."""
        await self.server.stop()

    # ----------------------------------------------------------------------------------------- sessions

    @ingress.websocket("/")
    async def session(self, websocket: WebSocket) -> None:
        """One session: the WebSocket's frames through `VerifierServer.serve_connection` (the same loop as
        ``hycoc verify-server``; its handshake timeout runs from the accept: see the module docstring "Limits")."""
        await websocket.accept()
        peer = websocket.client.host if websocket.client is not None else ""
        conn = Connection(header_token=bearer_token(websocket.headers), peer=peer)
        await self.server.serve_connection(conn, _StarletteChannel(websocket))

    # ----------------------------------------------------------------------------------------- health, metrics

    async def snapshot(self) -> dict:
        """This replica's state for /healthz and /metrics (called on every replica by ``handle.broadcast``):
        replica id, pid, node IP, open sessions and the Prometheus text of its `VerifierServer`."""
        return {
            "replica": self.replica_id,
            "pid": self.pid,
            "node": self.node,
            "sessions": self.server.metrics.sessions_active,
            "metrics": self.server.metrics.exposition(),
        }

    async def _snapshots(self) -> list[dict | BaseException]:
        if self._peers is None:
            self._peers = serve.get_deployment_handle(DEPLOYMENT_NAME, self.app_name)
        try:
            return await self._peers.broadcast("snapshot").results_async(
                timeout_s=SNAPSHOT_TIMEOUT_S, return_exceptions=True
            )
        except TimeoutError as e:  # the whole broadcast: answer with this replica alone, marked
            return [await self.snapshot(), e]

    async def _static(self) -> dict:
        """This replica's own /healthz document (`VerifierServer`'s: model, protocol_version, tree_rows, limits,
        ...) without its per-replica status and sessions, which `health_summary` replaces."""
        doc = self.server.health()
        for key in ("status", "sessions"):
            doc.pop(key, None)
        return doc | {
            "limits_apply": "per replica",
            "limits_not_applied": {
                "frame_timeout_s": "Ray Serve's proxy assembles WebSocket messages: a replica sees whole frames only"
            },
        }

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


def serve_logging(log_level: str = DEFAULT_LOG_LEVEL):
    """Ray Serve's `LoggingConfig` for hycoc (controller, proxies and replicas; Ray Serve docs, "Configure Ray
    Serve logging"): records at ``log_level`` and above (one of LOG_LEVELS), text encoding, and the per-request
    access log (``WS / 1000 12.3ms``) only at DEBUG or INFO. Each actor writes its log file under Ray's session
    directory (``logs/serve/``) whatever the level. Raises ValueError naming --log-level for another level."""
    from ray.serve.schema import LoggingConfig

    level = check_log_level(log_level)
    return LoggingConfig(log_level=level, encoding="TEXT", enable_access_log=level in ("DEBUG", "INFO"))


def check_log_level(log_level: str) -> str:
    """``log_level`` in upper case; ValueError naming --log-level unless it is one of LOG_LEVELS."""
    level = str(log_level).upper()
    if level not in LOG_LEVELS:
        raise ValueError(
            f"--log-level {log_level}: one of {', '.join(LOG_LEVELS)} (Ray's logs; default {DEFAULT_LOG_LEVEL})"
        )
    return level


def build_app(
    engine_factory: Callable[[], Any],
    *,
    replicas: int,
    server_kwargs: dict,
    cpus_per_replica: float = 1,
    gpus_per_replica: float = 0,
    log_level: str = DEFAULT_LOG_LEVEL,
):
    """The Serve application: `VerifierReplica` x ``replicas`` (a ``ray.serve.Application`` for `start`).

    cpus_per_replica / gpus_per_replica: Ray resources each replica reserves (the recipe's torch threads; 1 GPU
    per replica on CUDA), so Ray places no more replicas on a node than it has. max_ongoing_requests per replica
    = the limits' max_connections + HEALTH_HEADROOM (module docstring "Limits"). log_level: the replicas' Serve
    logs (`serve_logging`). Raises ValueError for replicas < 1 or an unknown log level.
    """
    if replicas < 1:
        raise ValueError(f"replicas = {replicas}: must be >= 1")
    limits: ServerLimits = server_kwargs.get("limits", ServerLimits())
    return VerifierReplica.options(  # type: ignore[attr-defined]  # a Deployment: mypy skips class decorators
        num_replicas=replicas,
        max_ongoing_requests=limits.max_connections + HEALTH_HEADROOM,
        ray_actor_options={"num_cpus": cpus_per_replica, "num_gpus": gpus_per_replica},
        logging_config=serve_logging(log_level),
    ).bind(engine_factory, server_kwargs)


def start(app, host: str = "127.0.0.1", port: int = 8765, *, log_level: str = DEFAULT_LOG_LEVEL) -> str:
    """Deploy ``app`` on the connected Ray instance (``ray.init`` first), its proxy on host:port; returns the
    ``ws://HOST:PORT`` URL once every replica is up. log_level: the controller's and proxies' Serve logs
    (`serve_logging`) and this process's ``ray.serve`` logger. Raises RuntimeError when the deployment fails (a
    replica's constructor raised: the message has its traceback)."""
    config = serve_logging(log_level)
    logging.getLogger("ray.serve").setLevel(config.log_level)
    serve.start(http_options={"host": host, "port": port}, logging_config=config)
    serve.run(app, name=APP_NAME, route_prefix="/", logging_config=config)
    url_host = f"[{host}]" if ":" in host else host
    return f"ws://{url_host}:{port}"


def run(
    app,
    host: str,
    port: int,
    *,
    ray_address: str | None = None,
    num_cpus: float | None = None,
    log_level: str = DEFAULT_LOG_LEVEL,
    on_listening: Callable[[str], None] | None = None,
) -> None:
    """Start Ray (``ray_address``: None = a local instance; "auto" or ray://... joins a cluster), deploy ``app``
    and block until SIGINT or SIGTERM, then shut Serve and Ray down. ``on_listening(url)`` runs once it serves.

    Ray's own output goes to stderr, at ``log_level`` and above (default WARNING; `serve_logging`): while Ray
    runs, ``sys.stdout`` is ``sys.stderr`` (the lines Ray prints for its workers and raylet go there), so
    ``on_listening`` should write to a stream it captured before the call (``hycoc serve-ray`` does). Every Ray
    process also keeps its full log under Ray's session directory (/tmp/ray/session_latest/logs).
    """
    import ray

    level = check_log_level(log_level)
    with contextlib.redirect_stdout(sys.stderr):
        ray.init(
            address=ray_address,
            # Ray's init takes whole CPUs (its stubs say int); replica_cpus gives whole numbers, so ceil keeps them
            num_cpus=math.ceil(num_cpus) if ray_address is None and num_cpus is not None else None,
            include_dashboard=False,
            log_to_driver=True,
            logging_level=getattr(logging, level),
        )
        try:
            url = start(app, host, port, log_level=level)
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


__all__ = [
    "APP_NAME",
    "DEPLOYMENT_NAME",
    "LOG_LEVELS",
    "DEFAULT_LOG_LEVEL",
    "RecipeEngine",
    "check_keep_set",
    "check_log_level",
    "serve_logging",
    "VerifierReplica",
    "build_app",
    "start",
    "run",
    "merge_expositions",
    "health_summary",
    "replica_cpus",
]
