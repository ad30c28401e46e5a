"""The three models of a real-shape plan (`hycoc.passes.plan`), read without weights.

A role's config is its ``config.json`` when ``[models].<role>`` is a local folder that has one (`config_dict`);
`gemma4_text_config` and `assistant_config` turn it into transformers' config, refusing as a `PlanError` a model
that is not a Gemma 4 of the expected kind. `HandoffDims` is what the plan reads off the verifier: its two
hand-off producer layers (`hycoc.host.producer_layers`) and their KV shapes.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from hycoc.host import producer_layers
from hycoc.recipe import Recipe

SLIDING = "sliding_attention"
FULL = "full_attention"


class PlanError(ValueError):
    """A recipe whose models cannot be planned: a config.json that is not a Gemma 4 model of the expected kind."""


def config_dict(recipe: Recipe, role: str) -> tuple[dict | None, str]:
    """(config.json as a dict, its path) when [models].<role> is a local folder with one, else (None, reason)."""
    spec = getattr(recipe.models, role)
    if recipe.is_hub_id(role):
        return None, f"hub id {spec} (no local config.json)"
    path = recipe.resolve_path(spec)
    cfg = path / "config.json" if path is not None and path.is_dir() else path
    if cfg is None or not cfg.is_file() or cfg.suffix != ".json":
        return None, f"{spec}: no config.json at {path}"
    try:
        return json.loads(cfg.read_text()), str(cfg)
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"models.{role}: {cfg}: {e}") from None


def check_local_models(recipe: Recipe) -> None:
    """Raise PlanError naming the folder when a role of [models] names a local path (not a hub id) that does not
    exist or holds no config.json: a wrong path must be named before any shape is compared (planning it on the
    reference shapes instead would report a shape mismatch that hides the typo). An assumed head
    (``head_config_assumed``) may be absent."""
    for role in ("verifier", "head", "slm"):
        spec = getattr(recipe.models, role)
        if recipe.is_hub_id(role) or (role == "head" and recipe.models.head_config_assumed):
            continue
        path = recipe.resolve_path(spec)
        if path is None or not path.exists():
            raise PlanError(
                f"models.{role}: {spec}: no such folder ({path}); fix the path in the recipe, or give a "
                f"hub id to plan the reference shapes"
            )
        cfg = path / "config.json" if path.is_dir() else path
        if not cfg.is_file() or cfg.suffix != ".json":
            raise PlanError(
                f"models.{role}: {spec}: no config.json in {path}; give the model's folder (the one with config.json)"
            )


def gemma4_text_config(d: dict, role: str):
    """transformers' ``Gemma4TextConfig`` of a config dict: the text model of the multimodal release (model_type
    ``gemma4``) or the text model itself (``gemma4_text``), without its ``quantization_config``; PlanError for any
    other model type."""
    from transformers import Gemma4TextConfig

    d = dict(d)
    if d.get("model_type") == "gemma4" and "text_config" in d:  # the multimodal release: plan the text model
        d = dict(d["text_config"])
    if d.get("model_type", "gemma4_text") != "gemma4_text":
        raise PlanError(f"models.{role}: model_type {d.get('model_type')!r}, expected gemma4_text or gemma4")
    d.pop("quantization_config", None)
    return Gemma4TextConfig.from_dict(d)


def assistant_config(d: dict, where: str):
    """The head's ``Gemma4AssistantConfig``; PlanError for another model type or an output hycoc does not compile
    (`hycoc.models.check_head_config`: ordered embeddings)."""
    from transformers import Gemma4AssistantConfig

    from hycoc.models import HeadConfigError, check_head_config

    if d.get("model_type") != "gemma4_assistant":
        raise PlanError(f"models.head: model_type {d.get('model_type')!r}, expected gemma4_assistant")
    config = Gemma4AssistantConfig.from_dict(copy.deepcopy(d))
    try:
        check_head_config(config, where)
    except HeadConfigError as e:
        raise PlanError(str(e)) from None
    return config


def layer_shape(config, i: int) -> tuple[int, int]:
    """(kv heads, head dim) of layer i."""
    lc = config.per_layer_config[i]
    return int(lc.num_key_value_heads), int(lc.head_dim)


def producers(config) -> dict[str, int]:
    """`hycoc.host.producer_layers` (the verifier engine's too), refused as a PlanError."""
    try:
        return producer_layers(config)
    except ValueError as err:
        raise PlanError(str(err)) from None


@dataclass(frozen=True)
class HandoffDims:
    """The verifier's hand-off as the wire and the head graph see it: ``layers`` the two producer layers
    (``{"sliding": i, "full": j}``, `producers`), ``hidden`` its hidden size H, and each producer's KV heads and
    head dim. ``kv_dim_sliding`` / ``kv_dim_full``: values per position of one K (or V) row, heads x head dim."""

    layers: dict[str, int]
    hidden: int
    kv_sliding: int
    dim_sliding: int
    kv_full: int
    dim_full: int

    @property
    def kv_dim_sliding(self) -> int:
        return self.kv_sliding * self.dim_sliding

    @property
    def kv_dim_full(self) -> int:
        return self.kv_full * self.dim_full

    @classmethod
    def from_config(cls, config) -> HandoffDims:
        """The hand-off of a verifier's text config; PlanError when it has no producer layer of a type."""
        prod = producers(config)
        kv_s, d_s = layer_shape(config, prod[SLIDING])
        kv_f, d_f = layer_shape(config, prod[FULL])
        return cls(
            layers={"sliding": prod[SLIDING], "full": prod[FULL]},
            hidden=int(config.hidden_size),
            kv_sliding=kv_s,
            dim_sliding=d_s,
            kv_full=kv_f,
            dim_full=d_f,
        )
