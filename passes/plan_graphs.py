"""The drafter graphs and the wire of a real-shape plan (`hycoc.passes.plan`), from the models built on torch's meta
device: each graph's inputs and outputs (names, shapes and dtypes exactly as `hycoc.passes.head.graph.HeadGraph` and
`hycoc.passes.slm.graph.SlmTreeGraph` declare them), its parameters, weight bytes at the recipe's bit maps, MACs
per call, host LUTs and ring KV; the hand-off and tree bytes of `hycoc.protocol.wire`; the SLM graph under the
assumed and paper-fit bit maps (`hycoc.passes.bit_map`).

Byte conventions as the plan's: an n-bit weight takes n/8 bytes (packed), each quantized output channel one float32
scale; every other graph parameter (norm weights, scalars) is counted at 4 bytes (float32 in the QDQ ONNX).
"""

from __future__ import annotations

import math
from typing import Any

from hycoc.passes import bit_map
from hycoc.passes.plan_models import FULL, SLIDING, HandoffDims, PlanError, layer_shape

from hycoc.host import head_sliding_positions
from hycoc.models import head_output_config
from hycoc.protocol import wire
from hycoc.recipe import Recipe

# ---- counting ---------------------------------------------------------------------------------------------


def bits_for(name: str, modules: dict[str, dict], default_bits: int) -> int:
    """transformers' width for module ``name`` (`hycoc.passes.bit_map.resolve_bits`)."""
    return bit_map.resolve_bits(name, {"num_bits": default_bits, "module_quant_configs": modules})


def linear_weights(module, prefix: str = "") -> list[tuple[str, int, int]]:
    """[(name, out, in)] of every nn.Linear under module."""
    from torch import nn

    return [(prefix + n, m.out_features, m.in_features) for n, m in module.named_modules() if isinstance(m, nn.Linear)]


def sized(linears: list[tuple[str, int, int]], bits_of, other_params: int) -> dict:
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


def numel(module) -> int:
    """Parameters of a torch module (meta tensors count as real ones)."""
    return sum(p.numel() for p in module.parameters())


def macs(*, rows: int, linear: int, lm_head: int, attention: int, lm_head_bytes: int) -> dict:
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


def io_spec(name: str, shape, dtype: str = "float32", note: str = "") -> dict:
    """One graph input or output as the plan lists it: name, shape (ints), dtype and an optional note."""
    d: dict[str, Any] = {"name": name, "shape": [int(s) for s in shape], "dtype": dtype}
    if note:
        d["note"] = note
    return d


# ---- the wire -----------------------------------------------------------------------------------------------


def handoff_plan(dims: HandoffDims, window: int, tree_rows: int) -> dict:
    """The wire's bytes at the plan's shapes (`hycoc.protocol.wire`, the functions the frames are sized with): the
    hand-off per round (fixed part + x_hat = [e; h] at 8 bits, 2H bytes) and per position (K and V of both producer
    layers, int8), the first reply's hand-off of ``window`` positions, and a ROUND of ``tree_rows`` rows (B + 1)."""
    h, ds, df = dims.hidden, dims.kv_dim_sliding, dims.kv_dim_full
    per_round = wire.handoff_nbytes(h, ds, df, 0)
    first_handoff = wire.handoff_nbytes(h, ds, df, window)
    return {
        "verifier_layers": dict(dims.layers),
        "hidden_size": h,
        "kv_dim_sliding": ds,
        "kv_dim_full": df,
        "handoff_bytes_per_round": per_round,
        "handoff_fixed_bytes": wire.HANDOFF_FIXED.size,
        "handoff_x_hat_bytes": 2 * h,
        "handoff_bytes_per_position": wire.handoff_nbytes(h, ds, df, 1) - per_round,
        "first_handoff_bytes": first_handoff,
        "first_reply_bytes": wire.reply_nbytes(tree_rows, 0, 0, first_handoff),
        "first_reply_positions": window,
        "tree_rows": tree_rows,
        "tree_bytes_per_round": wire.tree_nbytes(tree_rows),
    }


# ---- the head graph -------------------------------------------------------------------------------------------


def head_io(dims: HandoffDims, window: int, keep: int) -> tuple[list[dict], list[dict]]:
    """The head graph's inputs and outputs (`hycoc.passes.head.graph.HeadGraph`'s names): x_hat (1, 1, 2H), the
    W-position rings of both producer layers (1, kv heads, W, head dim), their masks (1, 1, 1, W) and rotary rows
    (1, 1, head dim); logits over the keep set (a compiler check only), h_next (1, 1, H) and its top-2 ids."""
    w, kv_s, d_s, kv_f, d_f = window, dims.kv_sliding, dims.dim_sliding, dims.kv_full, dims.dim_full
    ring = "ring, 16-bit in the graph, 8-bit stored"
    inputs = [
        io_spec("x_hat", (1, 1, 2 * dims.hidden), note="[e; h], int8 on the wire"),
        io_spec("k_sliding", (1, kv_s, w, d_s), note=ring),
        io_spec("v_sliding", (1, kv_s, w, d_s), note=ring),
        io_spec("k_full", (1, kv_f, w, d_f), note=ring),
        io_spec("v_full", (1, kv_f, w, d_f), note=ring),
        io_spec("mask_sliding", (1, 1, 1, w)),
        io_spec("mask_full", (1, 1, 1, w)),
        io_spec("cos_sliding", (1, 1, d_s)),
        io_spec("sin_sliding", (1, 1, d_s)),
        io_spec("cos_full", (1, 1, d_f)),
        io_spec("sin_full", (1, 1, d_f)),
    ]
    outputs = [
        io_spec(
            "logits",
            (1, 1, keep),
            note="over the keep set; compiler checks only: not an output of the "
            "shipped graph (passes/graph_io.py), the runtime reads top_index",
        ),
        io_spec("h_next", (1, 1, dims.hidden)),
        io_spec("top_index", (1, 1, 2), "int64", note="TopK in the graph (passes/topk_outputs.py)"),
    ]
    return inputs, outputs


def head_graph_plan(recipe: Recipe, head_cfg, head, dims: HandoffDims, keep: int) -> dict:
    """The head graph's plan: IO (`head_io`), what it reads and how it scores, MACs per call, weights at
    ``head_qat.weight_bits``, its E table (keep set x H, 8-bit) and its ring KV. ``head``: the assistant model on
    the meta device. PlanError when a head layer computes its own KV (the graph reads only the verifier's)."""
    w = int(recipe.window.head_window)
    hcfg = head_cfg.get_text_config()
    hidden = int(hcfg.hidden_size)
    own_kv = [i for i, m in enumerate(hcfg.kv_sharing_modes) if m != "reuse"]
    if own_kv:
        raise PlanError(f"head layers {own_kv} compute their own KV; the head graph reads only the verifier's")
    inputs, outputs = head_io(dims, w, keep)
    lin = (
        linear_weights(head.pre_projection, "pre_projection")
        + linear_weights(head.model.layers, "model.layers.")
        + [("lm_head", keep, hidden)]
        + linear_weights(head.post_projection, "post_projection")
    )
    linear = sum(o * i for _, o, i in lin)
    other = (
        numel(head.model.layers)
        + numel(head.model.norm)
        - sum(o * i for n, o, i in lin if n.startswith("model.layers."))
    )
    bits = int(recipe.head_qat.weight_bits)
    ring_values = 2 * w * (dims.kv_dim_sliding + dims.kv_dim_full)
    layer_dims = {SLIDING: dims.dim_sliding, FULL: dims.dim_full}
    attention = sum(2 * int(hcfg.num_attention_heads) * layer_dims[t] * w for t in hcfg.layer_types)
    return {
        "inputs": inputs,
        "outputs": outputs,
        # what the head reads and how it scores (tests/test_head_convention.py): h per [handoff].hidden, the query
        # at t + [window].head_query_position_offset, the sliding layers over the last sliding_positions of the
        # ring; its output as the assistant's config says
        "input": {
            "hidden": recipe.handoff.hidden,
            "query_position_offset": int(recipe.window.head_query_position_offset),
            "sliding_positions": min(
                w, head_sliding_positions(int(hcfg.sliding_window), recipe.window.head_sliding_window_inclusive)
            ),
        },
        "output": head_output_config(head_cfg),
        "macs": macs(
            rows=1,
            linear=linear,
            lm_head=keep * hidden,
            attention=attention,
            lm_head_bytes=math.ceil(keep * hidden * bits / 8) + 4 * keep,
        ),
        "activation_bits": 16,
        "weight_bits": bits,
        "linear_params": linear,
        "other_params": other,
        "weights": sized(lin, lambda n: bits, other),
        "lut": {
            "name": "E (verifier input embeddings over the keep set)",
            "rows": keep,
            "cols": dims.hidden,
            "bits": 8,
            "bytes": keep * dims.hidden,
            "scale_bytes": 4 * keep,
        },
        "ring_kv": {
            "window": w,
            "values": ring_values,
            "bytes_in_graph_16bit": 2 * ring_values,
            "bytes_stored_8bit": ring_values,
        },
    }


# ---- the SLM graph --------------------------------------------------------------------------------------------


def slm_rings(recipe: Recipe) -> dict[str, int]:
    """Ring positions of the SLM graph per layer type: ``[window] slm_sliding_window`` and ``slm_window``."""
    return {SLIDING: int(recipe.window.slm_sliding_window), FULL: int(recipe.window.slm_window)}


def slm_io(slm_cfg, ring: dict[str, int], rows: int, keep: int, kv_bits: int, candidates: int):
    """The SLM tree graph's inputs and outputs (`hycoc.passes.slm.graph.SlmTreeGraph`'s names) and its ring's
    values: the host LUT rows (1, rows, hidden) and per-layer rows (1, rows, L, P) when P > 0, rotary rows and masks
    (1, 1, rows, ring + rows) per layer type, a K and a V ring (1, kv heads, ring, head dim) per layer with its own
    KV; out: keep-set logits (a compiler check only), the new K/V rows (1, kv heads, rows, head dim) and the top
    ``candidates`` ids and log q per row. Returns (inputs, outputs, ring values: K and V of every ring)."""
    n_layers = int(slm_cfg.num_hidden_layers)
    per_layer = int(slm_cfg.hidden_size_per_layer_input or 0)
    inputs = [io_spec("inputs_embeds", (1, rows, slm_cfg.hidden_size), note="host LUT rows")]
    if per_layer:
        inputs.append(io_spec("per_layer_inputs", (1, rows, n_layers, per_layer), note="host LUT rows"))
    for t in sorted(set(slm_cfg.layer_types)):
        d = slm_cfg.per_layer_config[slm_cfg.layer_types.index(t)].head_dim
        s = t.removesuffix("_attention")
        inputs += [
            io_spec(f"cos_{s}", (1, rows, d)),
            io_spec(f"sin_{s}", (1, rows, d)),
            io_spec(f"mask_{s}", (1, 1, rows, ring[t] + rows)),
        ]
    outputs = [
        io_spec(
            "logits",
            (1, rows, keep),
            note="over the keep set, soft-capped; compiler checks only: "
            "not an output of the shipped graph (passes/graph_io.py)",
        )
    ]
    ring_values = 0
    for i in kv_ring_layers(slm_cfg):
        t = slm_cfg.layer_types[i]
        kv, d = layer_shape(slm_cfg, i)
        for kvn in ("k", "v"):
            inputs.append(io_spec(f"{kvn}_ring_{i}", (1, kv, ring[t], d), note=f"{kv_bits}-bit"))
        outputs += [io_spec(f"k_new_{i}", (1, kv, rows, d)), io_spec(f"v_new_{i}", (1, kv, rows, d))]
        ring_values += 2 * kv * ring[t] * d
    outputs += [
        io_spec("top_index", (1, rows, candidates), "int64", note="TopK in the graph (passes/topk_outputs.py)"),
        io_spec("top_logq", (1, rows, candidates), note="log q of top_index: TopK - logsumexp in the graph"),
    ]
    return inputs, outputs, ring_values


def kv_ring_layers(slm_cfg) -> list[int]:
    """The SLM's layers with a KV ring of their own (the others reuse a producer's KV)."""
    return [i for i, m in enumerate(slm_cfg.kv_sharing_modes) if m != "reuse"]


def slm_linears(slm, slm_cfg, keep: int) -> tuple[list[tuple[str, int, int]], int]:
    """The SLM graph's linear weights [(name, out, in)] (decoder layers, the per-layer input projection when P > 0,
    the keep-set output layer) and its other parameters (norms, scalars). ``slm``: the model on the meta device."""
    per_layer = int(slm_cfg.hidden_size_per_layer_input or 0)
    lin = linear_weights(slm.model.layers, "model.layers.")
    if per_layer:
        lin += linear_weights(slm.model.per_layer_model_projection, "model.per_layer_model_projection")
    lin.append(("lm_head", keep, int(slm_cfg.hidden_size)))
    other = (
        numel(slm.model.layers)
        + numel(slm.model.norm)
        + (numel(slm.model.per_layer_projection_norm) if per_layer else 0)
        - sum(o * i for n, o, i in lin if n.startswith("model.layers."))
    )
    return lin, other


def slm_luts(slm_cfg, modules: dict[str, dict], default_bits: int) -> dict[str, dict]:
    """The SLM's host LUTs at the bit map's widths: ``embed_tokens`` (vocab x hidden) and, when P > 0,
    ``embed_tokens_per_layer`` (per-layer vocab x L P); each with rows, cols, bits, packed ``bytes``
    (ceil(rows x cols x bits / 8)) and ``scale_bytes`` (one float32 per row)."""
    per_layer = int(slm_cfg.hidden_size_per_layer_input or 0)
    luts = {
        "embed_tokens": {
            "rows": int(slm_cfg.vocab_size),
            "cols": int(slm_cfg.hidden_size),
            "bits": bits_for("model.embed_tokens", modules, default_bits),
        }
    }
    if per_layer:
        luts["embed_tokens_per_layer"] = {
            "rows": int(slm_cfg.vocab_size_per_layer_input),
            "cols": int(slm_cfg.num_hidden_layers) * per_layer,
            "bits": bits_for("model.embed_tokens_per_layer", modules, default_bits),
        }
    for lut in luts.values():
        lut["bytes"] = math.ceil(lut["rows"] * lut["cols"] * lut["bits"] / 8)
        lut["scale_bytes"] = 4 * lut["rows"]
    return luts


def slm_graph_plan(recipe: Recipe, slm_cfg, lin, other: int, qcfg: dict, map_source: str, keep: int) -> dict:
    """The SLM tree graph's plan at B rows (the graph's static rows, paper App. A): IO (`slm_io`), MACs per call,
    its rings, weights under the bit map ``qcfg`` (from ``map_source``), host LUTs (`slm_luts`) and ring KV at
    ``slm_calibration.kv_bits``. ``lin``, ``other``: `slm_linears`."""
    rows = int(recipe.tree.node_budget)
    ring = slm_rings(recipe)
    kv_bits = int(recipe.slm_calibration.kv_bits)
    inputs, outputs, ring_values = slm_io(slm_cfg, ring, rows, keep, kv_bits, recipe.tree.slm_candidates)
    modules = dict(qcfg.get("module_quant_configs") or {})
    default_bits = int(qcfg.get("num_bits", 4))
    hidden = int(slm_cfg.hidden_size)
    attention_row = sum(
        2 * int(slm_cfg.num_attention_heads) * slm_cfg.per_layer_config[i].head_dim * (ring[t] + rows)
        for i, t in enumerate(slm_cfg.layer_types)
    )
    lm_bits = bits_for("lm_head", modules, default_bits)
    linear = sum(o * i for _, o, i in lin)
    return {
        "inputs": inputs,
        "outputs": outputs,
        "rows": rows,
        "macs": macs(
            rows=rows,
            linear=linear,
            lm_head=keep * hidden,
            attention=rows * attention_row,
            lm_head_bytes=math.ceil(keep * hidden * lm_bits / 8) + 4 * keep,
        ),
        "ring": {"sliding": ring[SLIDING], "full": ring[FULL]},
        "activation_bits": int(recipe.slm_calibration.activation_bits),
        "bit_map": {"source": map_source, "map": modules, "default_bits": default_bits},
        "linear_params": linear,
        "other_params": other,
        "weights": bit_map.graph_bytes(lin, qcfg, other),
        "luts": slm_luts(slm_cfg, modules, default_bits),
        "ring_kv": {
            "layers": kv_ring_layers(slm_cfg),
            "values": ring_values,
            "bits": kv_bits,
            "bytes": ring_values * kv_bits // 8,
        },
    }


def bit_maps(slm_lin, slm_other: int, slm_cfg, in_use: dict, source: str, head_graph: int, head_lut: int) -> dict:
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
                # hycoc's QDQ stores 2-bit sources as int4 (the HTP has no int2; passes/qdq.py)
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
