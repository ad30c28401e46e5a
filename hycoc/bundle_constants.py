"""The manifest's constants (`hycoc.bundle.Manifest`'s ``round``, ``quantization``, ``handoff`` and ``host``): the
round constants the recipe sets for the device (`RoundConstants`, each field derived from its recipe key), the
graphs' integer widths, the hand-off's width and scales, and the host-side constants of both drafters.

Core module: stdlib, pydantic, the recipe's tables (`hycoc.recipe.sections`, whose ranges the round constants take)
and the protocol's messages.
"""

from __future__ import annotations

from typing import Any, Literal, cast

import annotated_types
from pydantic import BaseModel, ConfigDict, Field

from hycoc.protocol.messages import Sampling
from hycoc.recipe import sections as recipe_sections


class ManifestModel(BaseModel):
    """Base of every model of the manifest: unknown keys are errors, types are strict, values frozen."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


#: The recipe's tables that hold round constants, by ``[section]`` name (`hycoc.recipe.document.Recipe`'s fields).
ROUND_TABLES: dict[str, type[BaseModel]] = {
    "tree": recipe_sections.Tree,
    "window": recipe_sections.Window,
    "acceptance": recipe_sections.Acceptance,
    "sampling": recipe_sections.Sampling,
}

_BOUNDS = (
    ("gt", annotated_types.Gt),
    ("ge", annotated_types.Ge),
    ("lt", annotated_types.Lt),
    ("le", annotated_types.Le),
)


def _from_recipe(key: str) -> Any:
    """The field of a round constant read from the recipe key ``key`` (``"tree.chain_length"``): that key's range
    and description (`ROUND_TABLES`), no default (a manifest names every constant); the key itself is the field's
    ``recipe`` JSON-schema extra, which `ROUND_SOURCES` reads back. Raises TypeError for a constraint other than a
    bound, so a new kind of range cannot be dropped on the way."""
    section, name = key.split(".")
    source = ROUND_TABLES[section].model_fields[name]
    bounds = {}
    for meta in source.metadata:
        kind = next((k for k, cls in _BOUNDS if isinstance(meta, cls)), None)
        if kind is None:
            raise TypeError(f"recipe key {key}: constraint {meta!r} has no round-constant counterpart")
        bounds[kind] = getattr(meta, kind)
    return Field(description=source.description, json_schema_extra={"recipe": key}, **bounds)


class RoundConstants(ManifestModel):
    """The round's constants (Alg. 1-4, Table 5): the recipe's device-visible keys, named as in the recipe.

    Each field is derived from its recipe key (`_from_recipe`: same range, same description; the type is restated
    for readers and type checkers, and tests/test_round_constants.py holds it to the recipe's), and
    `RoundConstants.from_recipe` fills every field from that key; `ROUND_SOURCES` maps each field to its key."""

    chain_length: int = _from_recipe("tree.chain_length")
    sibling_depth: int = _from_recipe("tree.sibling_depth")
    node_budget: int = _from_recipe("tree.node_budget")
    head_window: int = _from_recipe("window.head_window")
    slm_window: int = _from_recipe("window.slm_window")
    slm_sliding_window: int = _from_recipe("window.slm_sliding_window")
    head_query_position_offset: Literal[-1, 0] = _from_recipe("window.head_query_position_offset")
    depth_cost: float = _from_recipe("tree.depth_cost")
    epsilon: float = _from_recipe("acceptance.epsilon")
    acceptance_mode: Literal["epsilon", "exact"] = _from_recipe("acceptance.mode")
    slm_candidates: int = _from_recipe("tree.slm_candidates")
    slm_passes: Literal[1, 2] = _from_recipe("tree.slm_passes")
    specedge_passes: int = _from_recipe("tree.specedge_passes")
    specedge_nodes: int = _from_recipe("tree.specedge_nodes")
    temperature: float = _from_recipe("sampling.temperature")
    top_k: int = _from_recipe("sampling.top_k")
    top_p: float = _from_recipe("sampling.top_p")
    max_new_tokens: int = _from_recipe("sampling.max_new_tokens")
    seed: int = _from_recipe("sampling.seed")

    @classmethod
    def from_recipe(cls, recipe: Any) -> RoundConstants:
        """The round constants of ``recipe`` (a `hycoc.recipe.Recipe`): each field the value of its recipe key.

        Hand-worked: the default recipe gives chain_length 4 (``tree.chain_length``), acceptance_mode "epsilon"
        (``acceptance.mode``), epsilon 0.005 (``acceptance.epsilon``)."""
        values = {}
        for name, key in ROUND_SOURCES.items():
            section, field = key.split(".")
            values[name] = getattr(getattr(recipe, section), field)
        return cls(**values)

    @property
    def sampling(self) -> Sampling:
        """The protocol's p~ with the bundle's temperature, top-k and top-p (a request's default distribution)."""
        return Sampling(self.temperature, self.top_k, self.top_p)


#: Each round constant's recipe key, ``"section.key"``, in the manifest's field order.
ROUND_SOURCES: dict[str, str] = {
    name: str(cast(dict, info.json_schema_extra)["recipe"]) for name, info in RoundConstants.model_fields.items()
}


class Quantization(ManifestModel):
    """Integer widths the graphs were built with."""

    head_weight_bits: int = Field(ge=2, le=16, description="bits of the head's linear weights")
    slm_activation_bits: int = Field(ge=8, le=16, description="bits of the SLM graph's activations")
    kv_bits: int = Field(ge=8, le=16, description="bits of the SLM's KV ring inputs")


class HandoffInfo(ManifestModel):
    """The hand-off H as it arrives on the wire: ``bits``-wide integers, real value = scale x integer."""

    bits: int = Field(ge=2, le=16)
    hidden: Literal["pre_norm", "post_norm"]
    scale_embedding: float = Field(gt=0)
    scale_hidden: float = Field(gt=0)
    scale_k_sliding: float = Field(gt=0)
    scale_v_sliding: float = Field(gt=0)
    scale_k_full: float = Field(gt=0)
    scale_v_full: float = Field(gt=0)


class LutInfo(ManifestModel):
    """How to read one host embedding LUT (``hycoc.host.EmbeddingLut``): storage width, row width, multiplier."""

    bits: int = Field(description="storage bits per value: 2, 4 or 8")
    dim: int = Field(ge=1, description="values per row")
    embed_scale: float = Field(gt=0, description="Gemma's multiplier applied after dequantization")


class HeadHostInfo(ManifestModel):
    """What the device runtime needs beside the head graph (Alg. 2)."""

    sliding_window: int = Field(ge=1, description="the head's sliding layer reads min(W, this) ring positions")


class SlmHostInfo(ManifestModel):
    """What the device runtime needs beside the SLM tree graph (Alg. 3 line 8)."""

    layer_types: list[str] = Field(description="per decoder layer: sliding_attention or full_attention")
    kv_layers: list[int] = Field(description="layers with a ring (the others share their producer's KV)")
    sliding_window: int = Field(ge=1, description="transformers' sliding_window of the SLM, tokens")
    per_layer_dim: int = Field(ge=0, description="per-layer input width P (0: no per-layer inputs)")
    luts: dict[str, LutInfo] = Field(description="embed_tokens and (with P > 0) embed_tokens_per_layer")


class HostInfo(ManifestModel):
    """The host-side constants of both drafters (model config values the graphs' shapes do not carry)."""

    head: HeadHostInfo
    slm: SlmHostInfo
