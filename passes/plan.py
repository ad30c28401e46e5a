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
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any

from hycoc.passes import bit_map

from hycoc.host import head_sliding_positions, producer_layers
from hycoc.models import head_output_config
from hycoc.protocol import wire
from hycoc.recipe import Recipe

SLIDING = "sliding_attention"
FULL = "full_attention"
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

#: Context lengths of the verifier KV table (``verifier.kv_bytes_per_session``), positions.
KV_CONTEXTS = (2048, 8192, 32768)
#: The KV memory the table counts sessions in: 80 GB (10**9 B), an H100's / A100's memory.
KV_POOL_BYTES = 80 * 10**9

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


class PlanError(ValueError):
    """A recipe whose models cannot be planned: a config.json that is not a Gemma 4 model of the expected kind."""


# ---- configs -----------------------------------------------------------------------------------------------


def _config_dict(recipe: Recipe, role: str) -> tuple[dict | None, str]:
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


def _check_local_models(recipe: Recipe) -> None:
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


def _text_config(d: dict, role: str):
    from transformers import Gemma4TextConfig

    d = dict(d)
    if d.get("model_type") == "gemma4" and "text_config" in d:  # the multimodal release: plan the text model
        d = dict(d["text_config"])
    if d.get("model_type", "gemma4_text") != "gemma4_text":
        raise PlanError(f"models.{role}: model_type {d.get('model_type')!r}, expected gemma4_text or gemma4")
    d.pop("quantization_config", None)
    return Gemma4TextConfig.from_dict(d)


def _head_config(d: dict, where: str):
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


def _layer(config, i: int) -> tuple[int, int]:
    """(kv heads, head dim) of layer i."""
    lc = config.per_layer_config[i]
    return int(lc.num_key_value_heads), int(lc.head_dim)


def _producers(config) -> dict[str, int]:
    """`hycoc.host.producer_layers` (the verifier engine's too), refused as a PlanError."""
    try:
        return producer_layers(config)
    except ValueError as err:
        raise PlanError(str(err)) from None


# ---- counting ---------------------------------------------------------------------------------------------


def _bits_for(name: str, modules: dict[str, dict], default_bits: int) -> int:
    """transformers' width for module ``name`` (`hycoc.passes.bit_map.resolve_bits`)."""
    return bit_map.resolve_bits(name, {"num_bits": default_bits, "module_quant_configs": modules})


def _linear_weights(module, prefix: str = "") -> list[tuple[str, int, int]]:
    """[(name, out, in)] of every nn.Linear under module."""
    from torch import nn

    return [(prefix + n, m.out_features, m.in_features) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def _sized(linears: list[tuple[str, int, int]], bits_of, other_params: int) -> dict:
    """Weight bytes of a graph: packed integers + one float32 scale per output channel + float32 other params."""
    by_bits: dict[str, dict[str, int]] = {}
    int_bytes = scales = 0
    for name, out, inp in linears:
        b = bits_of(name)
        n = out * inp
        entry = by_bits.setdefault(f"int{b}", {"tensors": 0, "weights": 0, "bytes": 0})
        entry["tensors"] += 1
        entry["weights"] += n
        entry["bytes"] += math.ceil(n * b / 8)
        int_bytes += math.ceil(n * b / 8)
        scales += 4 * out
    total = int_bytes + scales + 4 * other_params
    return {
        "by_bits": by_bits,
        "integer_bytes": int_bytes,
        "scale_bytes": scales,
        "other_param_bytes": 4 * other_params,
        "total_bytes": total,
    }


def _numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def _macs(*, rows: int, linear: int, lm_head: int, attention: int, lm_head_bytes: int) -> dict:
    """Multiply-accumulates of one call of a drafter graph at the real shape: ``rows`` query rows through every
    linear layer (``linear`` weights per row, the keep-set output layer's ``lm_head`` included) plus attention
    (QK^T and PV over each layer's ring and the call's own rows: 2 x heads x head_dim x columns per row and layer).
    ``lm_head_bytes``: the output layer's packed weight bytes + scales (`hycoc.device_time` rescales it for
    another vocabulary size)."""
    return {
        "rows": rows,
        "linear_per_row": linear,
        "lm_head_per_row": lm_head,
        "attention": attention,
        "total": rows * linear + attention,
        "lm_head_bytes": lm_head_bytes,
    }


def _io(name: str, shape, dtype: str = "float32", note: str = "") -> dict:
    d = {"name": name, "shape": [int(s) for s in shape], "dtype": dtype}
    if note:
        d["note"] = note
    return d


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


def real_shape_plan(recipe: Recipe) -> dict:
    """The real-shape plan of ``recipe`` as a JSON-ready dict (module docstring). No weights are read."""
    import torch
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    assumptions: list[str] = []
    sources: dict[str, str] = {}

    _check_local_models(recipe)
    vd, where = _config_dict(recipe, "verifier")
    if vd is None:
        vd = VERIFIER_26B_A4B
        where = f"reference shapes of Gemma 4 26B-A4B (passes/plan.py), {where}"
    sources["verifier"] = where
    verifier_cfg = _text_config(vd, "verifier")

    hd, where = _config_dict(recipe, "head")
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
    sources["head"] = where
    head_cfg = _head_config(hd, where)
    if int(head_cfg.backbone_hidden_size) != int(verifier_cfg.hidden_size):
        raise PlanError(
            f"models.head: backbone_hidden_size {head_cfg.backbone_hidden_size} ({sources['head']}) is "
            f"not the verifier's hidden size {verifier_cfg.hidden_size} ({sources['verifier']}): the head "
            f"was trained for another verifier, or models.verifier names the wrong model"
        )

    sd, where = _config_dict(recipe, "slm")
    slm_quant = None
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
            slm_quant = bit_map.checkpoint_quant_config(sd)
        except bit_map.BitMapError as e:
            raise PlanError(f"models.slm: {e}") from None
    sources["slm"] = where
    slm_cfg = _text_config(sd, "slm")
    if slm_quant is not None:
        slm_qcfg, slm_map_source = slm_quant, "the checkpoint's quantization_config"
    else:
        slm_qcfg, slm_map_source = bit_map.slm_quant_config(None)
        assumptions.append(
            "SLM weight bit map ASSUMED (the E2B QAT checkpoint's config.json is not here; "
            "hycoc/passes/bit_map.py E2B_ASSUMED): " + bit_map.E2B_ASSUMED_TEXT
        )
    slm_map = dict(slm_qcfg.get("module_quant_configs") or {})
    slm_default = int(slm_qcfg.get("num_bits", 4))

    keep = int(recipe.keep_set.size)
    W = int(recipe.window.head_window)
    B = int(recipe.tree.node_budget)
    rows = B + 1  # the tree the wire carries: root + B nodes
    slm_rows = B  # the SLM graph's static rows (paper App. A: 32 tree rows)

    with torch.device("meta"):
        verifier = Gemma4ForCausalLM(verifier_cfg)
        head = Gemma4AssistantForCausalLM(head_cfg)
        slm = Gemma4ForCausalLM(slm_cfg)

    # ---- hand-off (the verifier's two producer layers) ----
    prod = _producers(verifier_cfg)
    kv_s, d_s = _layer(verifier_cfg, prod[SLIDING])
    kv_f, d_f = _layer(verifier_cfg, prod[FULL])
    H = int(verifier_cfg.hidden_size)
    ds, df = kv_s * d_s, kv_f * d_f
    per_round = wire.handoff_nbytes(H, ds, df, 0)
    per_position = wire.handoff_nbytes(H, ds, df, 1) - per_round
    first_handoff = wire.handoff_nbytes(H, ds, df, W)
    handoff = {
        "verifier_layers": {"sliding": prod[SLIDING], "full": prod[FULL]},
        "hidden_size": H,
        "kv_dim_sliding": ds,
        "kv_dim_full": df,
        "handoff_bytes_per_round": per_round,
        "handoff_fixed_bytes": wire.HANDOFF_FIXED.size,
        "handoff_x_hat_bytes": 2 * H,
        "handoff_bytes_per_position": per_position,
        "first_handoff_bytes": first_handoff,
        "first_reply_bytes": wire.reply_nbytes(rows, 0, 0, first_handoff),
        "first_reply_positions": W,
        "tree_rows": rows,
        "tree_bytes_per_round": wire.tree_nbytes(rows),
    }

    # ---- head graph ----
    hcfg = head_cfg.get_text_config()
    Hh = int(hcfg.hidden_size)
    own_kv = [i for i, m in enumerate(hcfg.kv_sharing_modes) if m != "reuse"]
    if own_kv:
        raise PlanError(f"head layers {own_kv} compute their own KV; the head graph reads only the verifier's")
    head_inputs = [
        _io("x_hat", (1, 1, 2 * H), note="[e; h], int8 on the wire"),
        _io("k_sliding", (1, kv_s, W, d_s), note="ring, 16-bit in the graph, 8-bit stored"),
        _io("v_sliding", (1, kv_s, W, d_s), note="ring, 16-bit in the graph, 8-bit stored"),
        _io("k_full", (1, kv_f, W, d_f), note="ring, 16-bit in the graph, 8-bit stored"),
        _io("v_full", (1, kv_f, W, d_f), note="ring, 16-bit in the graph, 8-bit stored"),
        _io("mask_sliding", (1, 1, 1, W)),
        _io("mask_full", (1, 1, 1, W)),
        _io("cos_sliding", (1, 1, d_s)),
        _io("sin_sliding", (1, 1, d_s)),
        _io("cos_full", (1, 1, d_f)),
        _io("sin_full", (1, 1, d_f)),
    ]
    head_outputs = [
        _io(
            "logits",
            (1, 1, keep),
            note="over the keep set; compiler checks only: not an output of the "
            "shipped graph (passes/graph_io.py), the runtime reads top_index",
        ),
        _io("h_next", (1, 1, H)),
        _io("top_index", (1, 1, 2), "int64", note="TopK in the graph (passes/topk_outputs.py)"),
    ]
    head_lin = (
        _linear_weights(head.pre_projection, "pre_projection")
        + _linear_weights(head.model.layers, "model.layers.")
        + [("lm_head", keep, Hh)]
        + _linear_weights(head.post_projection, "post_projection")
    )
    head_lin = [(n, o, i) for n, o, i in head_lin]
    head_graph_params = sum(o * i for _, o, i in head_lin)
    head_other = (
        _numel(head.model.layers)
        + _numel(head.model.norm)
        - sum(o * i for n, o, i in head_lin if n.startswith("model.layers."))
    )
    bits = int(recipe.head_qat.weight_bits)
    head_sizes = _sized(head_lin, lambda n: bits, head_other)
    head_lut = keep * H
    head_ring_values = 2 * W * (ds + df)
    head_layer_dims = {SLIDING: d_s, FULL: d_f}
    head_attn_macs = sum(2 * int(hcfg.num_attention_heads) * head_layer_dims[t] * W for t in hcfg.layer_types)
    head_graph = {
        "inputs": head_inputs,
        "outputs": head_outputs,
        # what the head reads and how it scores (tests/test_head_convention.py): h per [handoff].hidden, the query
        # at t + [window].head_query_position_offset, the sliding layers over the last sliding_positions of the
        # ring; its output as the assistant's config says
        "input": {
            "hidden": recipe.handoff.hidden,
            "query_position_offset": int(recipe.window.head_query_position_offset),
            "sliding_positions": min(
                W, head_sliding_positions(int(hcfg.sliding_window), recipe.window.head_sliding_window_inclusive)
            ),
        },
        "output": head_output_config(head_cfg),
        "macs": _macs(
            rows=1,
            linear=head_graph_params,
            lm_head=keep * Hh,
            attention=head_attn_macs,
            lm_head_bytes=math.ceil(keep * Hh * bits / 8) + 4 * keep,
        ),
        "activation_bits": 16,
        "weight_bits": bits,
        "linear_params": head_graph_params,
        "other_params": head_other,
        "weights": head_sizes,
        "lut": {
            "name": "E (verifier input embeddings over the keep set)",
            "rows": keep,
            "cols": H,
            "bits": 8,
            "bytes": head_lut,
            "scale_bytes": 4 * keep,
        },
        "ring_kv": {
            "window": W,
            "values": head_ring_values,
            "bytes_in_graph_16bit": 2 * head_ring_values,
            "bytes_stored_8bit": head_ring_values,
        },
    }

    # ---- SLM graph ----
    L = int(slm_cfg.num_hidden_layers)
    P = int(slm_cfg.hidden_size_per_layer_input or 0)
    types = sorted(set(slm_cfg.layer_types))
    ring = {SLIDING: int(recipe.window.slm_sliding_window), FULL: int(recipe.window.slm_window)}
    modes = slm_cfg.kv_sharing_modes
    kv_layers = [i for i, m in enumerate(modes) if m != "reuse"]
    slm_inputs = [_io("inputs_embeds", (1, slm_rows, slm_cfg.hidden_size), note="host LUT rows")]
    if P:
        slm_inputs.append(_io("per_layer_inputs", (1, slm_rows, L, P), note="host LUT rows"))
    for t in types:
        d = slm_cfg.per_layer_config[slm_cfg.layer_types.index(t)].head_dim
        s = t.removesuffix("_attention")
        slm_inputs += [
            _io(f"cos_{s}", (1, slm_rows, d)),
            _io(f"sin_{s}", (1, slm_rows, d)),
            _io(f"mask_{s}", (1, 1, slm_rows, ring[t] + slm_rows)),
        ]
    slm_outputs = [
        _io(
            "logits",
            (1, slm_rows, keep),
            note="over the keep set, soft-capped; compiler checks only: "
            "not an output of the shipped graph (passes/graph_io.py)",
        )
    ]
    kv_bits = int(recipe.slm_calibration.kv_bits)
    slm_ring_values = 0
    for i in kv_layers:
        t = slm_cfg.layer_types[i]
        kv, d = _layer(slm_cfg, i)
        for kvn in ("k", "v"):
            slm_inputs.append(_io(f"{kvn}_ring_{i}", (1, kv, ring[t], d), note=f"{kv_bits}-bit"))
        slm_outputs += [_io(f"k_new_{i}", (1, kv, slm_rows, d)), _io(f"v_new_{i}", (1, kv, slm_rows, d))]
        slm_ring_values += 2 * kv * ring[t] * d
    cands = recipe.tree.slm_candidates
    slm_outputs += [
        _io("top_index", (1, slm_rows, cands), "int64", note="TopK in the graph (passes/topk_outputs.py)"),
        _io("top_logq", (1, slm_rows, cands), note="log q of top_index: TopK - logsumexp in the graph"),
    ]
    slm_lin = _linear_weights(slm.model.layers, "model.layers.")
    if P:
        slm_lin += _linear_weights(slm.model.per_layer_model_projection, "model.per_layer_model_projection")
    slm_lin.append(("lm_head", keep, int(slm_cfg.hidden_size)))
    slm_other = (
        _numel(slm.model.layers)
        + _numel(slm.model.norm)
        + (_numel(slm.model.per_layer_projection_norm) if P else 0)
        - sum(o * i for n, o, i in slm_lin if n.startswith("model.layers."))
    )
    slm_sizes = bit_map.graph_bytes(slm_lin, slm_qcfg, slm_other)
    emb_bits = _bits_for("model.embed_tokens", slm_map, slm_default)
    luts = {"embed_tokens": {"rows": int(slm_cfg.vocab_size), "cols": int(slm_cfg.hidden_size), "bits": emb_bits}}
    if P:
        luts["embed_tokens_per_layer"] = {
            "rows": int(slm_cfg.vocab_size_per_layer_input),
            "cols": L * P,
            "bits": _bits_for("model.embed_tokens_per_layer", slm_map, slm_default),
        }
    for lut in luts.values():
        lut["bytes"] = math.ceil(lut["rows"] * lut["cols"] * lut["bits"] / 8)
        lut["scale_bytes"] = 4 * lut["rows"]
    slm_hidden = int(slm_cfg.hidden_size)
    slm_attn_row = sum(
        2 * int(slm_cfg.num_attention_heads) * slm_cfg.per_layer_config[i].head_dim * (ring[t] + slm_rows)
        for i, t in enumerate(slm_cfg.layer_types)
    )
    slm_lm_bits = _bits_for("lm_head", slm_map, slm_default)
    slm_lm_bytes = math.ceil(keep * slm_hidden * slm_lm_bits / 8) + 4 * keep
    slm_linear = sum(o * i for _, o, i in slm_lin)
    slm_graph: dict[str, Any] = {
        "inputs": slm_inputs,
        "outputs": slm_outputs,
        "rows": slm_rows,
        "macs": _macs(
            rows=slm_rows,
            linear=slm_linear,
            lm_head=keep * slm_hidden,
            attention=slm_rows * slm_attn_row,
            lm_head_bytes=slm_lm_bytes,
        ),
        "ring": {"sliding": ring[SLIDING], "full": ring[FULL]},
        "activation_bits": int(recipe.slm_calibration.activation_bits),
        "bit_map": {"source": slm_map_source, "map": slm_map, "default_bits": slm_default},
        "linear_params": sum(o * i for _, o, i in slm_lin),
        "other_params": slm_other,
        "weights": slm_sizes,
        "luts": luts,
        "ring_kv": {
            "layers": kv_layers,
            "values": slm_ring_values,
            "bits": kv_bits,
            "bytes": slm_ring_values * kv_bits // 8,
        },
    }

    bit_maps = _bit_maps(slm_lin, slm_other, slm_cfg, slm_qcfg, slm_map_source, head_sizes["total_bytes"], head_lut)
    budget = context_budget({"slm": slm_sizes["total_bytes"], "head": head_sizes["total_bytes"]}, recipe)
    params = {"verifier": _numel(verifier), "head": _numel(head), "slm": _numel(slm)}
    ours = {
        "slm_graph_bytes": slm_sizes["total_bytes"],
        "head_graph_bytes": head_sizes["total_bytes"],
        "head_lut_bytes": head_lut,
        "head_side_bytes": head_sizes["total_bytes"] + head_lut,
        "handoff_bytes_per_round": per_round,
        "handoff_bytes_per_position": per_position,
        "tree_bytes_per_round": handoff["tree_bytes_per_round"],
    }
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
    if bits != 4:
        paper["head_graph_bytes"]["note"] = f"the recipe's head_qat.weight_bits is {bits}, the paper's figure is W4"

    verifier_kv = _verifier_kv(
        verifier_cfg, recipe, max(rows, int(recipe.tree.chain_length) + 1), W, int(hcfg.sliding_window)
    )

    return {
        "recipe": recipe.recipe.name,
        "sources": sources,
        "assumptions": assumptions,
        "round": {
            "keep_set": keep,
            "head_window": W,
            "node_budget": B,
            "tree_rows": rows,
            "slm_rows": slm_rows,
            "chain_length": int(recipe.tree.chain_length),
        },
        "models": {
            "verifier": {
                "params": params["verifier"],
                "hidden_size": H,
                "layers": int(verifier_cfg.num_hidden_layers),
                "vocab_size": int(verifier_cfg.vocab_size),
            },
            "head": {
                "params": params["head"],
                "hidden_size": Hh,
                "layers": int(hcfg.num_hidden_layers),
                "intermediate_size": int(hcfg.intermediate_size),
                "assumed": sources["head"].startswith("ASSUMED"),
            },
            "slm": {
                "params": params["slm"],
                "hidden_size": int(slm_cfg.hidden_size),
                "layers": L,
                "intermediate_size": int(slm_cfg.intermediate_size),
                "kv_shared_layers": int(slm_cfg.num_kv_shared_layers),
            },
        },
        "graphs": {"head": head_graph, "slm": slm_graph},
        "device_bytes": {
            "head_graph": head_sizes["total_bytes"],
            "head_lut": head_lut,
            "head_ring_kv_8bit": head_ring_values,
            "slm_graph": slm_sizes["total_bytes"],
            "slm_luts": sum(v["bytes"] + v["scale_bytes"] for v in luts.values()),
            "slm_ring_kv": slm_graph["ring_kv"]["bytes"],
        },
        "handoff": handoff,
        "verifier": verifier_kv,
        "paper": paper,
        "bit_maps": bit_maps,
        "context_budget": budget,
    }


def _verifier_kv(config, recipe: Recipe, tree_rows: int, window: int, head_sliding_window: int) -> dict:
    """The verifier's KV per session at `KV_CONTEXTS` positions: ``kv_bytes_per_session`` (what the engine holds,
    `hycoc.verifier.kv_cache.kv_bytes_per_session`, the server's reservation) beside ``full_length_bytes`` (every
    layer keeping every position), and how many sessions of each fit in `KV_POOL_BYTES`. Keys of the maps are the
    context lengths as strings (JSON)."""
    import torch
    from hycoc.verifier.kv_cache import DEFAULT_PREFILL_CHUNK, KVLayout, kv_bytes_per_session, retained_positions

    dtype_bytes = torch.finfo(getattr(torch, recipe.verifier.dtype)).bits // 8
    retain = retained_positions(config, window, head_sliding_window)
    layout = KVLayout.from_config(config, dtype_bytes, retain)
    after = {
        str(n): kv_bytes_per_session(
            config,
            n,
            tree_rows=tree_rows,
            handoff_window=window,
            dtype_bytes=dtype_bytes,
            head_sliding_window=head_sliding_window,
        )
        for n in KV_CONTEXTS
    }
    max_prefills = int(recipe.verifier.max_prefills)
    transient = {str(n): layout.prefill_transient_bytes(n, DEFAULT_PREFILL_CHUNK) for n in KV_CONTEXTS}
    prefill_pool = {n: max_prefills * b for n, b in transient.items()}
    before = {str(n): layout.bytes_per_position * n for n in KV_CONTEXTS}
    return {
        "kv_dtype": recipe.verifier.dtype,
        "kv_bytes_per_position_full": layout.full_bytes,
        "kv_bytes_per_position_sliding": layout.sliding_bytes,
        "kv_bytes_per_position_full_length": layout.bytes_per_position,
        "sliding_window": int(config.sliding_window),
        "sliding_retained_positions": retain,
        "tree_rows": tree_rows,
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "kv_bytes_per_session": after,
        "prefill_transient_bytes": transient,
        "max_prefills": max_prefills,
        "prefill_pool_bytes": prefill_pool,
        "snapshot_bytes": {str(n): layout.snapshot_bytes(n) for n in KV_CONTEXTS},
        "full_length_bytes": before,
        "pool_bytes": KV_POOL_BYTES,
        "sessions_per_pool": {
            n: {
                "full_length": KV_POOL_BYTES // before[n],
                "windowed": (KV_POOL_BYTES - prefill_pool[n]) // after[n],
            }
            for n in after
        },
        "note": "per session: full layers every position, sliding layers their retained window + one round's "
        "rows; once per prefilling session (max_prefills, the prefill pool): a chunk's rows and an APPEND's undo "
        "copy of the sliding layers; an APPEND also reserves its full layers' undo copy while it runs; a "
        "conversation snapshot only from spare room, given up when a session needs it (hycoc.verifier.kv_cache); "
        "KV only (weights, activations and the allocator's slack are not counted)",
    }


def _bit_maps(slm_lin, slm_other: int, slm_cfg, in_use: dict, source: str, head_graph: int, head_lut: int) -> dict:
    """The SLM graph's bytes under the map in use, the assumed map and the paper-fit map (`hycoc.passes.bit_map`),
    each beside the paper's 754 MB; the search for maps within 1 % of it; the head side beside the paper's 365 MB."""
    shared = [i for i, m in enumerate(slm_cfg.kv_sharing_modes) if m == "reuse"]
    fit = bit_map.e2b_paper_fit()
    paper = bit_map.PAPER_SLM_GRAPH_BYTES
    rows = []
    for name, qcfg, text in (
        ("in use (" + source + ")", in_use, ""),
        ("assumed", bit_map.E2B_ASSUMED, bit_map.E2B_ASSUMED_TEXT),
        ("paper fit", fit, bit_map.E2B_PAPER_FIT_TEXT),
    ):
        sizes = bit_map.graph_bytes(slm_lin, qcfg, slm_other)
        int2 = sizes["by_bits"].get("int2", {"weights": 0, "bytes": 0})
        rows.append(
            {
                "map": name,
                "slm_graph_bytes": sizes["total_bytes"],
                "paper_bytes": paper,
                # hycoc's QDQ stores 2-bit sources as int4 (the HTP has no int2; passes/qdq/quantize.py)
                "htp_graph_bytes": sizes["total_bytes"] - int2["bytes"] + math.ceil(int2["weights"] / 2),
                "diff_pct": round(100 * (sizes["total_bytes"] - paper) / paper, 2),
                "by_bits": {k: v["bytes"] for k, v in sizes["by_bits"].items()},
                "text": text,
                "module_quant_configs": qcfg.get("module_quant_configs"),
                "num_bits": qcfg.get("num_bits"),
            }
        )
    head_side = head_graph + head_lut
    return {
        "source": source,
        "maps": rows,
        "search": bit_map.search_maps(slm_lin, slm_other, shared),
        "head_side": {
            "head_graph_bytes": head_graph,
            "head_lut_bytes": head_lut,
            "total_bytes": head_side,
            "paper_bytes": bit_map.PAPER_HEAD_SIDE_BYTES,
            "diff_pct": round(100 * (head_side - bit_map.PAPER_HEAD_SIDE_BYTES) / bit_map.PAPER_HEAD_SIDE_BYTES, 2),
            "note": "W4 head graph + 8-bit E table over the keep set; independent of the SLM's map",
        },
    }


def context_budget(graph_bytes: dict[str, int], recipe: Recipe) -> dict:
    """Each drafter graph's planned weight bytes against the recipe target's context limit (the profile's
    ``max_context_bytes``, lowered by ``target.context_size_limit_mb``), before anything is compiled.

    Returns {"profile", "limit_bytes", "graphs": {name: {"bytes", "fits", "shards_needed"}}}: ``shards_needed`` is
    how many layer shards (one context binary each, one EP context group) the graph needs at that limit. The
    compile itself refuses a context over the limit before compiling (`hycoc.targets.htp.compile_shared`,
    ContextTooLargeError naming the bytes)."""
    from hycoc.targets.profiles import UnknownTargetError, profile_for

    t = recipe.target
    try:
        profile = profile_for(int(t.htp_arch), str(t.soc_model), int(t.context_size_limit_mb))
    except UnknownTargetError as e:
        return {"profile": None, "limit_bytes": None, "error": str(e), "graphs": {}}
    limit = profile.max_context_bytes
    graphs = {
        name: {
            "bytes": int(n),
            "fits": limit is None or n <= limit,
            "shards_needed": 1 if limit is None else max(1, math.ceil(n / limit)),
        }
        for name, n in graph_bytes.items()
    }
    return {
        "profile": profile.name,
        "soc_model": profile.soc_model,
        "description": profile.description,
        "limit_bytes": limit,
        "graphs": graphs,
    }


def check_context_budget(budget: dict, recipe: Recipe) -> None:
    """Refuse a plan whose graphs do not fit the target's context limit as the recipe would build them
    (`context_budget`'s answer): the head always, the SLM unless ``[target] slm_shards`` splits it into at least
    the shards it needs ("auto" always does). Raises PlanError naming each graph's bytes, the limit and the fix."""
    if budget.get("error"):
        raise PlanError(budget["error"])
    shards = recipe.target.slm_shards
    over = []
    for name, g in budget["graphs"].items():
        if g["fits"] or (name == "slm" and (shards == "auto" or shards >= g["shards_needed"])):
            continue
        fix = (
            f'[target] slm_shards = "auto" ({g["shards_needed"]} shards)'
            if name == "slm"
            else "a smaller head (weight bits, layers)"
        )
        over.append(f"{name} {g['bytes']:,} bytes ({fix})")
    if over:
        raise PlanError(
            f"over {budget['profile']}'s context limit of {budget['limit_bytes']:,} bytes "
            f"({budget['description']}): {'; '.join(over)}"
        )


def plan_json(plan: dict) -> str:
    return json.dumps(plan, indent=2) + "\n"


__all__ = [
    "PlanError",
    "check_context_budget",
    "real_shape_plan",
    "round_frame_note",
    "plan_json",
    "PAPER",
    "VERIFIER_26B_A4B",
    "SLM_E2B",
    "HEAD_ASSUMED",
]
