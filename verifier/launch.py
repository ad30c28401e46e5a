"""What a server command loads once its address and keep-set file are checked (``hycoc verify-server``, ``hycoc
serve-ray``; `hycoc.cli.serve`): the batching options (`hycoc.verifier.loading.server_options`), the recipe's model
folders and chat files, the keep set's ids against the verifier's vocabulary, then the engine (`load_engine`) or
the Ray Serve application of N replicas (`ray_app`). Each failure is a `LaunchError` whose message is the one
line the command prints. torch, the server and Ray are imported inside the functions."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hycoc.verifier.engine import VerifierEngine

    from hycoc.recipe import Recipe


class LaunchError(RuntimeError):
    """A server cannot start: the message names what is wrong and the fix; ``code`` is the exit status (2: a
    command-line value, 1: a model, a file, the recipe, the device)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def check_models(cfg: Recipe, ids, keep_set: Path | None, device: str | None = None) -> None:
    """What every replica or engine will load, checked before any weights: ``device`` when given
    (`hycoc.verifier.loading.check_device`), the recipe's model folders and chat files, and the keep set's ``ids``
    (read from ``keep_set``; None: no keep set) against the verifier's vocabulary. Raises LaunchError."""
    from hycoc.verifier.loading import (
        DeviceUnavailable,
        check_device,
        check_keep_set_vocab,
        check_recipe_models,
        verifier_vocab_size,
    )

    from hycoc.chat import ChatFormatError
    from hycoc.models import ModelNotFoundError

    try:
        if device is not None:
            check_device(device)
        check_recipe_models(cfg)
        if ids is not None:
            check_keep_set_vocab(ids, verifier_vocab_size(cfg), keep_set)
    except (ModelNotFoundError, DeviceUnavailable, ChatFormatError, ValueError) as e:
        raise LaunchError(str(e)) from None


def load_engine(
    cfg: Recipe, device: str, ids, keep_set: Path | None, **modes: Any
) -> tuple[VerifierEngine, dict[str, Any]]:
    """The verifier engine ``hycoc verify-server`` serves on ``device`` and the server's keyword arguments
    (`server_options` of the recipe and ``modes``: batching, max_batch_rows, max_batch_wait_ms, tree_budget,
    allowance). ``ids``: the keep set's token ids (None: server-head sessions are refused). torch, transformers and
    the weights take tens of seconds on a first run: the command runs this, and imports this module, inside a
    progress line. Raises LaunchError: a bad option (code 2), models, chat files or keep set that do not fit, a bad
    recipe, a device that is not there."""
    from hycoc.verifier.loading import DeviceUnavailable, engine_from_recipe, server_options

    from hycoc.chat import ChatFormatError
    from hycoc.models import ModelNotFoundError, set_threads
    from hycoc.recipe import RecipeError

    try:  # the batching options (checked before torch was imported) and the recipe's row cost
        options = server_options(cfg, **modes)
    except ValueError as e:
        raise LaunchError(str(e), code=2) from None
    except RecipeError as e:
        raise LaunchError(f"bad recipe\n{e}") from None
    check_models(cfg, ids, keep_set)  # the models' folders and chat files, the keep set: before any weights
    set_threads(cfg.verifier.threads)
    try:
        import torch

        engine = engine_from_recipe(
            cfg, device, keep_set=None if ids is None else torch.as_tensor(ids, dtype=torch.long)
        )
    except RecipeError as e:
        raise LaunchError(f"bad recipe\n{e}") from None
    except (ModelNotFoundError, DeviceUnavailable, ChatFormatError, ValueError) as e:
        raise LaunchError(str(e)) from None
    return engine, options


def ray_app(
    cfg: Recipe,
    recipe: Path,
    device: str,
    ids,
    keep_set: Path | None,
    *,
    replicas: int,
    auth_token: str | None,
    log_level: str,
):
    """The Ray Serve application of ``replicas`` verifier replicas on ``device`` (`hycoc.verifier.ray_serve.build_app`),
    each building the engine from the recipe file ``recipe`` and ``keep_set`` (`RecipeEngine`) with the recipe's
    server options and ``auth_token``, each taking the recipe's verifier.threads CPUs (1 GPU on cuda) from Ray. What
    each replica will load is checked here once first (`check_models`; a replica that fails would be retried by
    Ray). Raises LaunchError."""
    from hycoc.verifier.loading import server_options
    from hycoc.verifier.ray_serve import RecipeEngine, build_app, replica_cpus

    check_models(cfg, ids, keep_set, device=device)
    options = server_options(cfg) | {"auth_token": auth_token}
    return build_app(
        RecipeEngine(str(recipe.resolve()), device, None if keep_set is None else str(keep_set.resolve())),
        replicas=replicas,
        server_kwargs=options,
        cpus_per_replica=replica_cpus(cfg.verifier.threads),
        gpus_per_replica=1 if device == "cuda" else 0,
        log_level=log_level,
    )


__all__ = ["LaunchError", "check_models", "load_engine", "ray_app"]
