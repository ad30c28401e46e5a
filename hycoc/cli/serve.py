"""``hycoc verify-server`` (the verifier's WebSocket server) and ``hycoc serve-ray`` (the same verifier as a Ray
Serve deployment). The verifier, aiohttp and Ray are imported inside the command bodies."""

from __future__ import annotations

import inspect
import sys
import time
from pathlib import Path

import typer

from hycoc import serving_limits
from hycoc.cli._common import AUTH_TOKEN_HELP, RECIPE_ARG, Device, _auth_token, _fail, _need_full, _port_error, _recipe


def verify_server(
    ctx: typer.Context,
    recipe: Path = RECIPE_ARG,
    host: str | None = typer.Option(
        None, help="listen address (default: the recipe's verifier.host, 127.0.0.1)", show_default=False
    ),
    port: int | None = typer.Option(
        None,
        min=0,
        max=65535,
        help="TCP port; 0 = any free port, named in the printed URL (default: the recipe's verifier.port, 8765)",
        show_default=False,
    ),
    device: Device | None = typer.Option(
        None, help="torch device (default: the recipe's verifier.device)", show_default=False
    ),
    auth_token: str | None = typer.Option(
        None,
        envvar="HYCOC_AUTH_TOKEN",
        help="require this token from clients, in OPEN or as 'Authorization: "
        f"Bearer TOKEN' (default: none, an open server); {AUTH_TOKEN_HELP}",
        show_default=False,
    ),
    auth_token_file: Path | None = typer.Option(
        None, help="read the token clients must present from this file (one line)", show_default=False
    ),
    keep_set: Path | None = typer.Option(
        None,
        help="keep set for server-head sessions: a .npy of int token ids (the keep-set pass writes "
        "keep_set.npy); without it server-head sessions are refused with error no_keep_set",
        show_default=False,
    ),
    batching: str | None = typer.Option(
        None,
        metavar="batched|serial",
        help="batched: rounds of sessions ready together share one forward, prompts "
        "are prefilled chunk by chunk between them; serial: one engine call at a time (default: the recipe's "
        "verifier.batching, batched)",
        show_default=False,
    ),
    max_batch_rows: int | None = typer.Option(
        None,
        min=1,
        help="most tree rows per batched forward (default: the recipe's verifier.max_batch_rows, "
        f"{serving_limits.DEFAULT_MAX_BATCH_ROWS})",
        show_default=False,
    ),
    max_batch_wait_ms: float | None = typer.Option(
        None,
        min=0.0,
        max=10_000.0,
        help="ms a round waits for other sessions' rounds to join its forward "
        f"(default: the recipe's verifier.max_batch_wait_ms, {serving_limits.DEFAULT_MAX_BATCH_WAIT_MS:g})",
        show_default=False,
    ),
    tree_budget: str | None = typer.Option(
        None,
        metavar="fixed|auto",
        help="auto: rows of the trees sharing a batched forward are chosen by their "
        "scores (most expected tokens per forward ms); fixed: trees verified as sent (default: the recipe's "
        "verifier.tree_budget, auto; fixed with --batching serial)",
        show_default=False,
    ),
) -> None:
    """Serve the verifier: prefill, one-forward tree verification, acceptance, KV compaction, hand-off (Alg. 4).

    WebSocket sessions at ws://HOST:PORT/, GET /healthz (JSON) and GET /metrics (Prometheus) on the same port.

    Prints one line with the URL once listening; stops on Ctrl-C or SIGTERM.

    Trees have the recipe's tree.node_budget + 1 rows; frames above its verifier.max_frame_bytes (bytes) are refused.
    """
    cfg = _recipe("verify-server", recipe)
    _need_full("verify-server")
    auth_token = _auth_token("verify-server", ctx, auth_token, auth_token_file)
    from hycoc.chat import ChatFormatError
    from hycoc.models import ModelNotFoundError
    from hycoc.ports import check_port
    from hycoc.recipe import RecipeError
    from hycoc.verifier.loading import check_batching, check_keep_set, check_recipe_models, server_options

    try:  # the batching options (and the recipe's row cost) before anything loads
        if batching is not None:
            check_batching(batching)
        options = server_options(
            cfg,
            batching=batching,
            max_batch_rows=max_batch_rows,
            max_batch_wait_ms=max_batch_wait_ms,
            tree_budget=tree_budget,
        )
    except ValueError as e:
        raise _fail("verify-server", str(e), code=2) from None
    except RecipeError as e:
        raise _fail("verify-server", f"bad recipe\n{e}") from None
    try:  # the models' folders and chat files, the keep set's ids, then the port: each named before the model loads
        check_recipe_models(cfg)
        ids = check_keep_set(keep_set, cfg) if keep_set is not None else None
    except (ValueError, ModelNotFoundError, ChatFormatError) as e:
        raise _fail("verify-server", str(e)) from None
    host = host or cfg.verifier.host
    port = cfg.verifier.port if port is None else port
    try:
        check_port(host, port)
    except OSError as e:
        raise _fail("verify-server", _port_error(host, port, e, "another server on this port?")) from None
    from hycoc.models import set_threads
    from hycoc.recipe import RecipeError
    from hycoc.verifier.loading import DeviceUnavailable, engine_from_recipe, server_options
    from hycoc.verifier.server import serve

    set_threads(cfg.verifier.threads)
    try:
        import torch

        engine = engine_from_recipe(
            cfg,
            device.value if device is not None else None,
            keep_set=None if ids is None else torch.as_tensor(ids, dtype=torch.long),
        )
    except RecipeError as e:
        raise _fail("verify-server", f"bad recipe\n{e}") from None
    except (ModelNotFoundError, DeviceUnavailable, ChatFormatError, ValueError) as e:
        raise _fail("verify-server", str(e)) from None

    def listening(url: str) -> None:
        from hycoc.models import tokenizer_load_seconds

        parsed = sum(tokenizer_load_seconds().values())
        typer.echo(
            f"hycoc verify-server: listening on {url} (model {cfg.models.verifier}, "
            f"{engine.device.type}, {options['batching']}, tree budget {options['tree_budget']}, "
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


def serve_ray(
    ctx: typer.Context,
    recipe: Path = RECIPE_ARG,
    replicas: int = typer.Option(
        2,
        min=1,
        help="verifier replicas (each loads the recipe's verifier and takes "
        "verifier.threads CPUs, or 1 GPU with --device cuda, from Ray)",
    ),
    host: str | None = typer.Option(
        None,
        help="listen address of Ray Serve's proxy (default: the recipe's verifier.host, 127.0.0.1)",
        show_default=False,
    ),
    port: int | None = typer.Option(
        None,
        min=0,
        max=65535,
        help="TCP port of the proxy; 0 = any free port, "
        "named in the printed URL (default: the recipe's verifier.port, 8765)",
        show_default=False,
    ),
    device: Device | None = typer.Option(
        None, help="torch device of every replica (default: the recipe's verifier.device)", show_default=False
    ),
    auth_token: str | None = typer.Option(
        None,
        envvar="HYCOC_AUTH_TOKEN",
        help="require this token from clients, in OPEN or as 'Authorization: "
        f"Bearer TOKEN' (default: none, an open server); {AUTH_TOKEN_HELP}",
        show_default=False,
    ),
    auth_token_file: Path | None = typer.Option(
        None, help="read the token clients must present from this file (one line)", show_default=False
    ),
    keep_set: Path | None = typer.Option(
        None,
        help="keep set for server-head sessions (the bundle's keep_set.npy); without it they are refused",
        show_default=False,
    ),
    ray_address: str | None = typer.Option(
        None,
        help="Ray cluster to join ('auto': the one `ray start` began on this node; ray://HOST:10001); "
        "default: start a local Ray instance with one CPU per replica thread",
        show_default=False,
    ),
    log_level: str = typer.Option(
        "WARNING",
        metavar="DEBUG|INFO|WARNING|ERROR",
        help="least level of Ray's own log lines on stderr (INFO adds "
        "Serve's per-request access log); Ray's full logs stay under /tmp/ray/session_latest/logs",
    ),
) -> None:
    """Serve the verifier as a Ray Serve deployment: N replicas behind one WebSocket endpoint.

    Same wire protocol, /healthz and /metrics as verify-server, at ws://HOST:PORT/; a session stays on the replica
    that accepted it; new sessions go to the less loaded replica; /healthz and /metrics cover every replica (samples
    labelled replica="ID"). Server limits apply per replica. Needs the serve extra: pip install -e '.\\[serve]'.

    Prints one line with the URL once every replica is up (stdout has hycoc's lines only; Ray's go to stderr);
    stops on Ctrl-C or SIGTERM.
    """
    import importlib.util

    cfg = _recipe("serve-ray", recipe)
    _need_full("serve-ray")
    if importlib.util.find_spec("ray") is None:
        raise _fail("serve-ray", "needs Ray Serve (the serve extra): pip install -e '.[serve]'")
    auth_token = _auth_token("serve-ray", ctx, auth_token, auth_token_file)
    from hycoc.chat import ChatFormatError
    from hycoc.models import ModelNotFoundError
    from hycoc.ports import check_port
    from hycoc.verifier.loading import (
        DeviceUnavailable,
        check_device,
        check_keep_set,
        check_recipe_models,
        server_options,
    )
    from hycoc.verifier.ray_serve import RecipeEngine, build_app, check_log_level, replica_cpus, run

    try:
        log_level = check_log_level(log_level)
    except ValueError as e:
        raise _fail("serve-ray", str(e), code=2) from None

    dev = device.value if device is not None else cfg.verifier.device
    try:  # what each replica will load, checked here once (a replica that fails is retried by Ray)
        check_device(dev)
        check_recipe_models(cfg)
        if keep_set is not None:
            check_keep_set(keep_set, cfg)
    except (ModelNotFoundError, DeviceUnavailable, ChatFormatError, ValueError) as e:
        raise _fail("serve-ray", str(e)) from None
    host = host or cfg.verifier.host
    port = cfg.verifier.port if port is None else port
    try:  # before Ray starts: a busy port would fail only after ~20 s, in a Ray traceback
        port = check_port(host, port, reuse_address=False)  # port 0: the free port picked here, given to Ray
    except OSError as e:
        raise _fail("serve-ray", _port_error(host, port, e, "a verify-server on the default port?")) from None
    options = server_options(cfg) | {"auth_token": auth_token}
    app = build_app(
        RecipeEngine(str(recipe.resolve()), dev, None if keep_set is None else str(keep_set.resolve())),
        replicas=replicas,
        server_kwargs=options,
        cpus_per_replica=replica_cpus(cfg.verifier.threads),
        gpus_per_replica=1 if dev == "cuda" else 0,
        log_level=log_level,
    )
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
