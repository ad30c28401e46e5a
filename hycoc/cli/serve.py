"""``hycoc verify-server`` (the verifier's WebSocket server) and ``hycoc serve-ray`` (the same verifier as a Ray
Serve deployment). The verifier, aiohttp and Ray are imported inside the command bodies, after what can be checked
without them (`_preflight`: the address, the keep-set file), so a busy port or a missing file is named at once."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from hycoc import serving_limits
from hycoc.cli._common import (
    AUTH_TOKEN_HELP,
    RECIPE_ARG,
    SERVE_INSTALL,
    Device,
    _auth_token,
    _fail,
    _need_full,
    _port_error,
    _recipe,
)
from hycoc.cli.options import limit_option, unset

# ---- the options both commands take: each defined once (typer docs, "Arguments with Annotated"); where the two
# commands word one differently (the proxy's address, every replica's device), the wording is the alias's argument.


def _host_option(of: str = ""):
    """``--host``: the listen address ``of`` something (a phrase, e.g. " of Ray Serve's proxy")."""
    return typer.Option(help=f"listen address{of} (default: the recipe's verifier.host, 127.0.0.1)", show_default=False)


def _port_option(of: str = ""):
    """``--port``: the TCP port ``of`` something; 0 = any free port."""
    return typer.Option(
        min=0,
        max=65535,
        help=f"TCP port{of}; 0 = any free port, named in the printed URL (default: the recipe's verifier.port, 8765)",
        show_default=False,
    )


def _device_option(of: str = ""):
    """``--device``: the torch device ``of`` something."""
    return typer.Option(help=f"torch device{of} (default: the recipe's verifier.device)", show_default=False)


def _keep_set_option(about: str):
    """``--keep-set``: a bundle's keep_set.npy (`hycoc.keep_set.load_keep_set`); ``about`` completes the help."""
    return typer.Option(help=f"keep set for server-head sessions{about}", show_default=False)


AuthToken = Annotated[
    str | None,
    typer.Option(
        envvar="HYCOC_AUTH_TOKEN",
        help="require this token from clients, in OPEN or as 'Authorization: "
        f"Bearer TOKEN' (default: none, an open server); {AUTH_TOKEN_HELP}",
        show_default=False,
    ),
]
AuthTokenFile = Annotated[
    Path | None,
    typer.Option(help="read the token clients must present from this file (one line)", show_default=False),
]
# the aliases are written out (Annotated at module level) so that mypy reads them as types
Host = Annotated[str | None, _host_option()]
ProxyHost = Annotated[str | None, _host_option(" of Ray Serve's proxy")]
Port = Annotated[int | None, _port_option()]
ProxyPort = Annotated[int | None, _port_option(" of the proxy")]
TorchDevice = Annotated[Device | None, _device_option()]
ReplicaDevice = Annotated[Device | None, _device_option(" of every replica")]
KeepSet = Annotated[
    Path | None,
    _keep_set_option(
        ": a .npy of int token ids (the keep-set pass writes keep_set.npy); without it server-head sessions are "
        "refused with error no_keep_set"
    ),
]
ReplicaKeepSet = Annotated[Path | None, _keep_set_option(" (the bundle's keep_set.npy); without it they are refused")]


def _preflight(command: str, cfg, host, port, keep_set, *, busy_hint: str, reuse_address: bool):
    """What a server command checks before it imports torch or loads anything, each failure one line naming the
    fix: the recipe's model folders (`hycoc.models.model_dir`), the keep-set file (`hycoc.keep_set.load_keep_set`:
    missing, a folder, not a .npy of int ids), then the listen address (`hycoc.ports.check_port`: a busy port, a
    host not on this machine). Returns (host, the port checked:
    for port 0 the free port the OS picked, the keep set's ids or None). Raises typer.Exit (code 1)."""
    from hycoc.keep_set import load_keep_set
    from hycoc.models import ModelNotFoundError, model_dir
    from hycoc.ports import check_port

    try:
        for role in ("verifier", "head", "tokenizer"):  # the folders; their files are checked after the imports
            model_dir(cfg, role)
        ids = load_keep_set(keep_set) if keep_set is not None else None
    except (ModelNotFoundError, ValueError) as e:
        raise _fail(command, str(e)) from None
    host = host or cfg.verifier.host
    port = cfg.verifier.port if port is None else port
    try:
        bound = check_port(host, port, reuse_address=reuse_address)
    except OSError as e:
        raise _fail(command, _port_error(host, port, e, busy_hint)) from None
    return host, bound, ids


#: verify-server's batching options (`hycoc.cli.options`): each default is the recipe's verifier table's.
Batching = Annotated[
    str | None,
    unset(
        "batched: rounds of sessions ready together share one forward, prompts "
        "are prefilled chunk by chunk between them; serial: one engine call at a time (default: the recipe's "
        "verifier.batching, batched)",
        metavar="|".join(serving_limits.BATCHING_MODES),
    ),
]
MaxBatchRows = Annotated[int | None, limit_option("max_batch_rows", "most tree rows per batched forward")]
MaxBatchWaitMs = Annotated[
    float | None, limit_option("max_batch_wait_ms", "ms a round waits for other sessions' rounds to join its forward")
]
TreeBudget = Annotated[
    str | None,
    unset(
        "auto: rows of the trees sharing a batched forward are chosen by their "
        "scores (most expected tokens per forward ms); fixed: trees verified as sent (default: the recipe's "
        "verifier.tree_budget, auto; fixed with --batching serial)",
        metavar="|".join(serving_limits.TREE_BUDGETS),
    ),
]
Allowance = Annotated[
    str | None,
    unset(
        "auto: each reply allows the session's next tree the rows that maximise committed tokens per "
        "verifier ms at the current load (whole tree at low load, MTP chain + root at the floor); fixed: the whole "
        "tree every round (default: the recipe's verifier.allowance, auto; fixed with --batching serial)",
        metavar="|".join(serving_limits.ALLOWANCE_MODES),
    ),
]


def verify_server(
    ctx: typer.Context,
    recipe: Path = RECIPE_ARG,
    host: Host = None,
    port: Port = None,
    device: TorchDevice = None,
    auth_token: AuthToken = None,
    auth_token_file: AuthTokenFile = None,
    keep_set: KeepSet = None,
    batching: Batching = None,
    max_batch_rows: MaxBatchRows = None,
    max_batch_wait_ms: MaxBatchWaitMs = None,
    tree_budget: TreeBudget = None,
    allowance: Allowance = None,
) -> None:
    """Serve the verifier: prefill, one-forward tree verification, acceptance, KV compaction, hand-off (Alg. 4).

    WebSocket sessions at ws://HOST:PORT/, GET /healthz (JSON) and GET /metrics (Prometheus) on the same port.

    Prints one line with the URL once listening; stops on Ctrl-C or SIGTERM.

    Trees have the recipe's tree.node_budget + 1 rows; frames above its verifier.max_frame_bytes (bytes) are refused.
    """
    cfg = _recipe("verify-server", recipe)
    try:  # the modes' values and how they combine, before torch is imported (tens of seconds on a first run)
        v = cfg.verifier
        serving_limits.server_modes(
            (v.batching, v.tree_budget, v.allowance), batching=batching, tree_budget=tree_budget, allowance=allowance
        )
    except ValueError as e:
        raise _fail("verify-server", str(e), code=2) from None
    _need_full("verify-server")
    auth_token = _auth_token("verify-server", ctx, auth_token, auth_token_file)
    host, _, ids = _preflight(
        "verify-server", cfg, host, port, keep_set, busy_hint="another server on this port?", reuse_address=True
    )
    port = cfg.verifier.port if port is None else port  # 0 stays 0: the server picks its own free port
    dev = device.value if device is not None else cfg.verifier.device
    from hycoc.progress import step

    # torch, transformers and the weights take tens of seconds on a first run: a progress line says so meanwhile
    with step(f"verify-server: loading the verifier {cfg.models.verifier} ({dev})"):
        from hycoc.verifier.launch import LaunchError, load_engine
        from hycoc.verifier.server import serve

        try:
            engine, options = load_engine(
                cfg,
                dev,
                ids,
                keep_set,
                batching=batching,
                max_batch_rows=max_batch_rows,
                max_batch_wait_ms=max_batch_wait_ms,
                tree_budget=tree_budget,
                allowance=allowance,
            )
        except LaunchError as e:
            raise _fail("verify-server", str(e), code=e.code) from None

    def listening(url: str) -> None:
        from hycoc.models import tokenizer_load_seconds

        parsed = sum(tokenizer_load_seconds().values())
        typer.echo(
            f"hycoc verify-server: listening on {url} (model {cfg.models.verifier}, "
            f"{engine.device.type}, {options['batching']}, tree budget {options['tree_budget']}, "
            f"allowance {options['allowance']}, "
            f"tokenizer parsed once in {parsed:.2f} s, health {url.replace('ws://', 'http://', 1)}/healthz)"
        )
        sys.stdout.flush()

    started = time.monotonic()
    try:
        serve(engine, host, port, auth_token=auth_token, on_listening=listening, **options)
    except OSError as e:
        raise _fail("verify-server", f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    up = time.monotonic() - started
    typer.echo(f"hycoc verify-server: stopped (SIGINT or SIGTERM) after {up:.0f} s; sessions closed")


RayAddress = Annotated[
    str | None,
    unset(
        "Ray cluster to join ('auto': the one `ray start` began on this node; ray://HOST:10001); "
        "default: start a local Ray instance with one CPU per replica thread"
    ),
]
LogLevel = Annotated[
    str,
    typer.Option(
        metavar="DEBUG|INFO|WARNING|ERROR",
        help="least level of Ray's own log lines on stderr (INFO adds "
        "Serve's per-request access log); Ray's full logs stay under /tmp/ray/session_latest/logs",
    ),
]


def serve_ray(
    ctx: typer.Context,
    recipe: Path = RECIPE_ARG,
    replicas: int = typer.Option(
        2,
        min=1,
        help="verifier replicas (each loads the recipe's verifier and takes "
        "verifier.threads CPUs, or 1 GPU with --device cuda, from Ray)",
    ),
    host: ProxyHost = None,
    port: ProxyPort = None,
    device: ReplicaDevice = None,
    auth_token: AuthToken = None,
    auth_token_file: AuthTokenFile = None,
    keep_set: ReplicaKeepSet = None,
    ray_address: RayAddress = None,
    log_level: LogLevel = "WARNING",
) -> None:
    """Serve the verifier as a Ray Serve deployment: N replicas behind one WebSocket endpoint.

    Same wire protocol, /healthz and /metrics as verify-server, at ws://HOST:PORT/; a session stays on the replica
    that accepted it; new sessions go to the less loaded replica; /healthz and /metrics cover every replica (samples
    labelled replica="ID"). Server limits apply per replica. Needs the serve extra, installed with the others
    in one command: pip install -e ".\\[full,dev,qnn,hub,serve]".

    Prints one line with the URL once every replica is up (stdout has hycoc's lines only; Ray's go to stderr);
    stops on Ctrl-C or SIGTERM.
    """
    import importlib.util

    cfg = _recipe("serve-ray", recipe)
    _need_full("serve-ray")
    if importlib.util.find_spec("ray") is None:
        raise _fail(
            "serve-ray",
            f"needs Ray Serve (the serve extra); install it with the other extras in one command: {SERVE_INSTALL} "
            '(added on its own it upgrades protobuf past qai-hub\'s cap; README "Extras")',
        )
    auth_token = _auth_token("serve-ray", ctx, auth_token, auth_token_file)
    from hycoc.verifier.ray_serve import check_log_level  # a usage error (code 2) before anything is bound

    try:
        log_level = check_log_level(log_level)
    except ValueError as e:
        raise _fail("serve-ray", str(e), code=2) from None
    # before Ray starts: a busy port would fail only after ~20 s, in a Ray traceback; port 0: the free port picked
    # here is given to Ray (its proxy does not set SO_REUSEADDR)
    host, port, ids = _preflight(
        "serve-ray", cfg, host, port, keep_set, busy_hint="a verify-server on the default port?", reuse_address=False
    )
    from hycoc.verifier.launch import LaunchError, ray_app
    from hycoc.verifier.ray_serve import replica_cpus, run

    dev = device.value if device is not None else cfg.verifier.device
    try:  # what each replica will load, checked here once (a replica that fails is retried by Ray)
        app = ray_app(cfg, recipe, dev, ids, keep_set, replicas=replicas, auth_token=auth_token, log_level=log_level)
    except LaunchError as e:
        raise _fail("serve-ray", str(e), code=e.code) from None
    typer.echo(
        f"hycoc serve-ray: starting Ray and {replicas} replica(s) of {cfg.models.verifier} "
        "(each loads the verifier; about half a minute)",
        err=True,
    )

    out = sys.stdout  # run() sends Ray's console output to stderr by making sys.stdout stderr while Ray runs

    def listening(url: str) -> None:
        typer.echo(
            f"hycoc serve-ray: listening on {url} ({replicas} replicas of {cfg.models.verifier}, {dev}, "
            f"health {url.replace('ws://', 'http://', 1)}/healthz)",
            file=out,
        )
        out.flush()

    try:
        run(
            app,
            host,
            port,
            ray_address=ray_address,
            num_cpus=None if ray_address else replicas * replica_cpus(cfg.verifier.threads),
            log_level=log_level,
            on_listening=listening,
        )
    except RuntimeError as e:  # a deployment that failed: Serve's message carries the replica's traceback
        raise _fail("serve-ray", f"the deployment failed: {e}") from None


# Both commands' --help end with the server limits and their defaults, from the one table of them.
for _command in (verify_server, serve_ray):
    _command.__doc__ = f"{inspect.cleandoc(_command.__doc__ or '')}\n\n{serving_limits.help_text()}\n"
