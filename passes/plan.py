"""Real-shape plan of a recipe, without weights (`hycoc inspect RECIPE`; docs/real-shapes.md).

`real_shape_plan(recipe)` builds the three models of a recipe on torch's meta device (no memory, no weights) and
reports what the compiler will make of them and what the wire will carry:

* the configs: read from ``config.json`` when ``[models].<role>`` is a local folder that has one, else the
  reference shapes below (docs/design.md "Reference shapes"). Every number that is not from a config.json or
  docs/design.md is listed in ``assumptions``.
* each drafter graph's inputs and outputs (names, shapes and dtypes exactly as `hycoc.passes.head.graph.HeadGraph`
  and `hycoc.passes.slm.graph.SlmTreeGraph` declare them), parameter counts, weight bytes at the recipe's bit maps,
  LUT sizes, ring-KV bytes on the device;
* hand-off and tree bytes from `hycoc.protocol.wire` (the same functions the frames are sized with);
* a ``paper`` block: the paper's numbers (App. A Table 3, §3.1) beside ours, with the difference;
* the verifier's KV bytes per session at 2K / 8K / 32K positions (``verifier``), by the formula the server's KV
  reservation uses (`hycoc.verifier.kv_cache.kv_bytes_per_session`), beside the full-length layout.

Byte conventions: MB = 10**6 bytes (the paper's 242 MB is 86,089 x 2,816 = 242.4e6 bytes); an n-bit weight
takes n/8 bytes (packed), each quantized output channel one float32 scale; every other graph parameter (norm
weights, scalars) is counted at 4 bytes (float32 in the QDQ ONNX).

The plan's parts: the models' configs (`hycoc.passes.plan_models`), the graphs and the wire
(`hycoc.passes.plan_graphs`), the verifier's KV and the context budget (`hycoc.passes.plan_budgets`); this module
holds the reference shapes and the paper's numbers, and puts the parts together.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from hycoc.passes import bit_map
from hycoc.passes.plan_budgets import context_budget, verifier_kv
from hycoc.passes.plan_graphs import bit_maps, handoff_plan, head_graph_plan, numel, slm_graph_plan, slm_linears
from hycoc.passes.plan_models import (
    FULL,
    SLIDING,
    HandoffDims,
    PlanError,
    assistant_config,
    check_local_models,
    config_dict,
    gemma4_text_config,
)

from hycoc.protocol import wire
from hycoc.recipe import Recipe

MB = 10**6

#: Gemma 4 26B-A4B's text config (docs/design.md "Reference shapes"; matches public copies of its config.json).
VERIFIER_26B_A4B: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": 262_144,
    "hidden_size": 2816,
    "intermediate_size": 2112,
    "num_hidden_layers": 30,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 256,
    "global_head_dim": 512,
    "num_global_key_value_heads": 2,
    "attention_k_eq_v": True,
    "sliding_window": 1024,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 5,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "num_kv_shared_layers": 0,
    "enable_moe_block": True,
    "num_experts": 128,
    "top_k_experts": 8,
    "moe_intermediate_size": 704,
    "max_position_embeddings": 262_144,
    "tie_word_embeddings": True,
    "rope_parameters": {
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6},
    },
}

#: Gemma 4 E2B's text config (docs/design.md "Reference shapes"). intermediate_size 6144 and the 4 sliding : 1 full
#: layer pattern (full at 4, 9, ..., 34) are from public copies of google/gemma-4-E2B-it's config.json, not from
#: docs/design.md; the SLM's output layer is untied in the graph (keep-set rows).
SLM_E2B: dict[str, Any] = {
    "model_type": "gemma4_text",
    "vocab_size": 262_144,
    "hidden_size": 1536,
    "intermediate_size": 6144,
    "num_hidden_layers": 35,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "global_head_dim": 512,
    "attention_k_eq_v": False,
    "sliding_window": 512,
    "layer_types": ([SLIDING] * 4 + [FULL]) * 7,
    "final_logit_softcapping": 30.0,
    "hidden_size_per_layer_input": 256,
    "vocab_size_per_layer_input": 262_144,
    "num_kv_shared_layers": 20,
    "use_double_wide_mlp": True,
    "enable_moe_block": False,
    "max_position_embeddings": 131_072,
    "tie_word_embeddings": True,
    "rope_parameters": VERIFIER_26B_A4B["rope_parameters"],
}

#: ASSUMED bit map of the E2B QAT mobile checkpoint (its config.json is not here): defined once, in
#: `hycoc.passes.bit_map` (``E2B_ASSUMED``); these names are kept for older callers.
SLM_ASSUMED_BIT_MAP: dict[str, dict] = bit_map.E2B_ASSUMED_MODULES
SLM_ASSUMED_DEFAULT_BITS = bit_map.E2B_ASSUMED_DEFAULT_BITS

#: ASSUMED config of google/gemma-4-26B-A4B-it-assistant until its config.json is given: 4 KV-shared layers
#: (3 sliding + 1 full) of hidden 1,024, MLP 8,192, attention as the verifier's (16 query heads over the verifier's
#: 8 x 256 sliding and 2 x 512 full KV). Taken from public third-party test configs of this pairing; its parameter
#: count, 419.7M, matches the paper's 420M (App. I Table 12). Its output is the assistant's own, never copied from
#: the verifier: no final-logit soft-cap (transformers' Gemma4AssistantForCausalLM applies none) and no ordered
#: embeddings (`hycoc.models.head_output_config`).
HEAD_ASSUMED_TEXT: dict[str, Any] = {
    **{
        k: VERIFIER_26B_A4B[k]
        for k in (
            "model_type",
            "vocab_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "global_head_dim",
            "num_global_key_value_heads",
            "attention_k_eq_v",
            "sliding_window",
            "max_position_embeddings",
            "rope_parameters",
        )
    },
    "hidden_size": 1024,
    "intermediate_size": 8192,
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 4,
    "layer_types": [SLIDING, SLIDING, SLIDING, FULL],
    "hidden_size_per_layer_input": 0,
    "vocab_size_per_layer_input": 0,
    "enable_moe_block": False,
    "use_double_wide_mlp": False,
    "tie_word_embeddings": True,
}
HEAD_ASSUMED: dict[str, Any] = {
    "model_type": "gemma4_assistant",
    "text_config": HEAD_ASSUMED_TEXT,
    "backbone_hidden_size": 2816,
    "use_ordered_embeddings": False,
    "tie_word_embeddings": True,
}

#: The paper's numbers (App. A Table 3; §3.1 and §3.3; Alg. 4 line 14), in bytes.
PAPER = {
    "slm_graph_bytes": (754 * MB, "App. A Table 3: 754 MB NPU graph"),
    "head_graph_bytes": (123 * MB, "App. A Table 3: 123 MB NPU graph at W4"),
    "head_lut_bytes": (242 * MB, "App. A Table 3 / §3.3: 8-bit LUT, 242 MB"),
    "head_side_bytes": (365 * MB, "§6: 'the device stores 365 MB for it' (head graph + E table)"),
    "handoff_bytes_per_round": (5_600, "§3.1: 5.6 KB per round (Alg. 4: 44 B + 5,632 B)"),
    "handoff_bytes_per_position": (6_100, "§3.1: 6.1 KB per output token (Alg. 4: 6,144 B per position)"),
    "tree_bytes_per_round": (2_200, "§3.1: 2.2 KB per round"),
}


# ---- the models' configs ----------------------------------------------------------------------------------


@dataclass
class PlanConfigs:
    """The three models' configs as the plan reads them (`plan_configs`): transformers' ``Gemma4TextConfig`` of the
    verifier and the SLM, ``Gemma4AssistantConfig`` of the head; the SLM's weight bit map (``slm_quant``: a
    quantization_config dict, ``module_quant_configs`` and ``num_bits``) and where it came from; each role's config
    source and every assumption made, as the plan's ``sources`` and ``assumptions`` print them."""

    verifier: Any
    head: Any
    slm: Any
    slm_quant: dict
    slm_map_source: str
    sources: dict[str, str] = field(default_factory=dict)
    assumptions: list[str] = field(default_factory=list)


def verifier_config(recipe: Recipe) -> tuple[Any, str]:
    """(the verifier's text config, where it is from): its config.json, else `VERIFIER_26B_A4B`."""
    vd, where = config_dict(recipe, "verifier")
    if vd is None:
        vd = VERIFIER_26B_A4B
        where = f"reference shapes of Gemma 4 26B-A4B (passes/plan.py), {where}"
    return gemma4_text_config(vd, "verifier"), where


def head_config(recipe: Recipe, verifier_cfg, verifier_source: str, assumptions: list[str]) -> tuple[Any, str]:
    """(the head's assistant config, where it is from): its config.json, else `HEAD_ASSUMED` on the verifier's
    hidden size (an assumption appended to ``assumptions``). PlanError when its backbone is not that verifier."""
    hd, where = config_dict(recipe, "head")
    if hd is None:
        hd = copy.deepcopy(HEAD_ASSUMED)
        hd["backbone_hidden_size"] = int(verifier_cfg.hidden_size)
        where = f"ASSUMED ({where})"
        assumptions.append(
            "head config ASSUMED until its config.json is given (models.head_config_assumed = true): "
            "num_hidden_layers 4 (3 sliding + 1 full, all KV-shared), hidden_size 1024, intermediate_size 8192, "
            "16 query heads over the verifier's KV (8 x 256 sliding, 2 x 512 full), vocab 262,144, tied "
            "embeddings; from public third-party test configs of this pairing; its 419.7M parameters match the "
            "paper's 420M (App. I Table 12)"
        )
    elif recipe.models.head_config_assumed:
        assumptions.append(f"models.head_config_assumed = true although {where} exists: its shapes are used")
    head_cfg = assistant_config(hd, where)
    if int(head_cfg.backbone_hidden_size) != int(verifier_cfg.hidden_size):
        raise PlanError(
            f"models.head: backbone_hidden_size {head_cfg.backbone_hidden_size} ({where}) is "
            f"not the verifier's hidden size {verifier_cfg.hidden_size} ({verifier_source}): the head "
            f"was trained for another verifier, or models.verifier names the wrong model"
        )
    return head_cfg, where


def slm_config(recipe: Recipe, assumptions: list[str]) -> tuple[Any, str, dict, str]:
    """(the SLM's text config, where it is from, its weight bit map, where the map is from): its config.json and
    the checkpoint's quantization_config, else `SLM_E2B` and the assumed E2B map (`hycoc.passes.bit_map`), each
    assumption appended to ``assumptions``. PlanError for a quantization_config the bit map cannot read."""
    sd, where = config_dict(recipe, "slm")
    quant = None
    if sd is None:
        sd = SLM_E2B
        where = f"reference shapes of Gemma 4 E2B (passes/plan.py), {where}"
        assumptions.append(
            "SLM intermediate_size 6144 (12,288 on the 20 KV-shared layers) and its 4 sliding : "
            "1 full layer pattern come from public copies of google/gemma-4-E2B-it's config.json "
            "(not docs/design.md)"
        )
    else:
        try:
            quant = bit_map.checkpoint_quant_config(sd)
        except bit_map.BitMapError as e:
            raise PlanError(f"models.slm: {e}") from None
    slm_cfg = gemma4_text_config(sd, "slm")
    if quant is not None:
        return slm_cfg, where, quant, "the checkpoint's quantization_config"
    qcfg, map_source = bit_map.slm_quant_config(None)
    assumptions.append(
        "SLM weight bit map ASSUMED (the E2B QAT checkpoint's config.json is not here; "
        "hycoc/passes/bit_map.py E2B_ASSUMED): " + bit_map.E2B_ASSUMED_TEXT
    )
    return slm_cfg, where, qcfg, map_source


def plan_configs(recipe: Recipe) -> PlanConfigs:
    """The three configs of ``recipe`` (`PlanConfigs`), in the order a wrong one is reported: a local folder that
    is missing (`check_local_models`), then the verifier, the head (against the verifier), the SLM."""
    assumptions: list[str] = []
    check_local_models(recipe)
    verifier_cfg, verifier_source = verifier_config(recipe)
    head_cfg, head_source = head_config(recipe, verifier_cfg, verifier_source, assumptions)
    slm_cfg, slm_source, slm_quant, map_source = slm_config(recipe, assumptions)
    return PlanConfigs(
        verifier=verifier_cfg,
        head=head_cfg,
        slm=slm_cfg,
        slm_quant=slm_quant,
        slm_map_source=map_source,
        sources={"verifier": verifier_source, "head": head_source, "slm": slm_source},
        assumptions=assumptions,
    )


# ---- the plan ---------------------------------------------------------------------------------------------


def round_frame_note() -> str:
    """The plan's note on the tree bytes per round, from the wire's own layout (`hycoc.protocol.wire`): the ROUND
    frame's header, fixed part and bytes per row, and the protocol version the device speaks."""
    fixed = wire.tree_nbytes(0)
    per_row = wire.tree_nbytes(1) - fixed
    return (
        f"hycoc's ROUND frame is {wire.HEADER.size} + {fixed - wire.HEADER.size} + {per_row} R bytes (int32 ids, "
        f"int16 parents, fp16 row scores, no mask: the server rebuilds it; protocol v{wire.PROTOCOL_VERSION}); the "
        "paper's 2.2 KB is its own encoding"
    )


def round_shape(recipe: Recipe) -> dict[str, int]:
    """The round's shape the plan is made at: keep set, W, B, the tree the wire carries (root + B nodes), the SLM
    graph's static rows (B: paper App. A's 32 tree rows) and the chain length K."""
    budget = int(recipe.tree.node_budget)
    return {
        "keep_set": int(recipe.keep_set.size),
        "head_window": int(recipe.window.head_window),
        "node_budget": budget,
        "tree_rows": budget + 1,
        "slm_rows": budget,
        "chain_length": int(recipe.tree.chain_length),
    }


def paper_comparison(ours: dict[str, int], head_bits: int) -> dict:
    """Each of the paper's numbers (`PAPER`) beside the plan's in ``ours`` (same keys): the difference in bytes and
    in % of the paper's, its source, and the notes that say why they differ (the ROUND frame's own layout, the
    hand-off's parts, a head not at W4 when ``head_bits`` != 4)."""
    paper = {}
    for key, (value, where) in PAPER.items():
        diff = ours[key] - value
        paper[key] = {
            "paper": value,
            "plan": ours[key],
            "diff": diff,
            "diff_pct": round(100 * diff / value, 2),
            "source": where,
        }
    paper["tree_bytes_per_round"]["note"] = round_frame_note()
    paper["handoff_bytes_per_round"]["note"] = "44 B fixed part + 5,632 B of [e; h] at 8 bits"
    if head_bits != 4:
        paper["head_graph_bytes"]["note"] = (
            f"the recipe's head_qat.weight_bits is {head_bits}, the paper's figure is W4"
        )
    return paper


def models_summary(configs: PlanConfigs, params: dict[str, int]) -> dict:
    """The plan's ``models`` block: each model's parameters (``params``, counted on the meta device), hidden size
    and layers; the head's and the SLM's MLP width; whether the head is assumed; the SLM's KV-shared layers."""
    hcfg = configs.head.get_text_config()
    return {
        "verifier": {
            "params": params["verifier"],
            "hidden_size": int(configs.verifier.hidden_size),
            "layers": int(configs.verifier.num_hidden_layers),
            "vocab_size": int(configs.verifier.vocab_size),
        },
        "head": {
            "params": params["head"],
            "hidden_size": int(hcfg.hidden_size),
            "layers": int(hcfg.num_hidden_layers),
            "intermediate_size": int(hcfg.intermediate_size),
            "assumed": configs.sources["head"].startswith("ASSUMED"),
        },
        "slm": {
            "params": params["slm"],
            "hidden_size": int(configs.slm.hidden_size),
            "layers": int(configs.slm.num_hidden_layers),
            "intermediate_size": int(configs.slm.intermediate_size),
            "kv_shared_layers": int(configs.slm.num_kv_shared_layers),
        },
    }


def real_shape_plan(recipe: Recipe) -> dict:
    """The real-shape plan of ``recipe`` as a JSON-ready dict (module docstring). No weights are read."""
    import torch
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    configs = plan_configs(recipe)
    shape = round_shape(recipe)
    keep, window = shape["keep_set"], shape["head_window"]
    with torch.device("meta"):
        verifier = Gemma4ForCausalLM(configs.verifier)
        head = Gemma4AssistantForCausalLM(configs.head)
        slm = Gemma4ForCausalLM(configs.slm)
    dims = HandoffDims.from_config(configs.verifier)
    handoff = handoff_plan(dims, window, shape["tree_rows"])
    head_graph = head_graph_plan(recipe, configs.head, head, dims, keep)
    slm_lin, slm_other = slm_linears(slm, configs.slm, keep)
    slm_graph = slm_graph_plan(recipe, configs.slm, slm_lin, slm_other, configs.slm_quant, configs.slm_map_source, keep)
    head_bytes, head_lut = head_graph["weights"]["total_bytes"], head_graph["lut"]["bytes"]
    slm_bytes = slm_graph["weights"]["total_bytes"]
    maps = bit_maps(slm_lin, slm_other, configs.slm, configs.slm_quant, configs.slm_map_source, head_bytes, head_lut)
    budget = context_budget({"slm": slm_bytes, "head": head_bytes}, recipe)
    params = {"verifier": numel(verifier), "head": numel(head), "slm": numel(slm)}
    ours = {
        "slm_graph_bytes": slm_bytes,
        "head_graph_bytes": head_bytes,
        "head_lut_bytes": head_lut,
        "head_side_bytes": head_bytes + head_lut,
        "handoff_bytes_per_round": handoff["handoff_bytes_per_round"],
        "handoff_bytes_per_position": handoff["handoff_bytes_per_position"],
        "tree_bytes_per_round": handoff["tree_bytes_per_round"],
    }
    paper = paper_comparison(ours, int(recipe.head_qat.weight_bits))
    tree_rows = max(shape["tree_rows"], shape["chain_length"] + 1)
    head_sliding = int(configs.head.get_text_config().sliding_window)
    return {
        "recipe": recipe.recipe.name,
        "sources": configs.sources,
        "assumptions": configs.assumptions,
        "round": shape,
        "models": models_summary(configs, params),
        "graphs": {"head": head_graph, "slm": slm_graph},
        "device_bytes": {
            "head_graph": head_bytes,
            "head_lut": head_lut,
            "head_ring_kv_8bit": head_graph["ring_kv"]["bytes_stored_8bit"],
            "slm_graph": slm_bytes,
            "slm_luts": sum(v["bytes"] + v["scale_bytes"] for v in slm_graph["luts"].values()),
            "slm_ring_kv": slm_graph["ring_kv"]["bytes"],
        },
        "handoff": handoff,
        "verifier": verifier_kv(configs.verifier, recipe, tree_rows, window, head_sliding),
        "paper": paper,
        "bit_maps": maps,
        "context_budget": budget,
    }


def plan_json(plan: dict) -> str:
    return json.dumps(plan, indent=2) + "\n"


__all__ = [
    "PlanError",
    "real_shape_plan",
    "round_frame_note",
    "plan_json",
    "PAPER",
    "VERIFIER_26B_A4B",
    "SLM_E2B",
    "HEAD_ASSUMED",
]
