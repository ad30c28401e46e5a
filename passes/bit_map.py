"""The SLM's weight bit map: the assumed E2B map, the map that reproduces the paper's sizes, and the checkpoint's own
(docs/real-shapes.md "The bit map"; paper App. A Table 3: "the checkpoint's 2/4/8 bits", "2/4-bit LUT", "754 MB NPU
graph"; §6: "The device stores 365 MB for it alongside the SLM's 754 MB graph").

One place for every SLM bit map hycoc uses at real shape:

* `E2B_ASSUMED`: the map `hycoc inspect` and `benchmarks/real_shape_slm.py` use while the E2B QAT mobile
  checkpoint's own ``quantization_config`` is not here (ASSUMED: attention 8-bit, MLP 4-bit, per-layer input
  gate/projection 2-bit, per-layer model projection 8-bit, output layer 8-bit, default 4-bit; token embedding LUT
  4-bit, per-layer embedding LUT 2-bit).
* `e2b_paper_fit()`: a map that reproduces the paper's 754 MB NPU graph, found by `search_maps`: attention 8-bit,
  MLP and per-layer input gate/projection 2-bit, everything else (output layer over the keep set, per-layer model
  projection) 4-bit: 752.8 MB (-0.16 %). The size alone does not pin the map down: of the 2,187 group-wise maps
  (7 module groups x 2/4/8 bits) 20 land within 1 % of 754 MB; this one has the fewest distinct rules. The paper's
  figure counts 2-bit weights at 2 bits: hycoc's QDQ stores them as int4 (the HTP has no int2), so the same map
  compiles to about 1,149 MB (`hycoc inspect`'s "as compiled" column).
* `checkpoint_quant_config(config_dict)`: a real checkpoint's ``quantization_config`` (top level or under
  ``text_config``); when present it wins over both, with no code change.

Maps are in transformers' ``GemmaQuantizationConfig`` form: ``num_bits`` (default width) and
``module_quant_configs`` (regex -> {"num_bits": n}). `resolve_bits` applies them exactly as
``transformers.integrations.gemma_quant.replace_with_quant_layers`` does: the patterns are joined into one regex
of named alternatives and searched in the module name; the leftmost match wins, ties go to the earlier pattern.

Byte conventions as `hycoc.passes.plan`: MB = 10**6 bytes; an n-bit weight takes n/8 bytes packed, each output
channel one float32 scale, every other graph parameter 4 bytes.
"""

from __future__ import annotations

import copy
import itertools
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

MB = 10**6


def qmax(bits: int) -> int:
    """Largest magnitude of a symmetric signed `bits`-bit integer (int2: 1, int4: 7, int8: 127): the integer
    range [-qmax, qmax] of every symmetric weight format here (the head's QAT, the toy family's checkpoints)."""
    return 2 ** (bits - 1) - 1


#: ASSUMED module map of the E2B QAT mobile checkpoint (its config.json is not here). First listed wins a tie, so
#: ``embed_tokens_per_layer`` precedes ``embed_tokens``.
E2B_ASSUMED_MODULES: dict[str, dict[str, int]] = {
    r"embed_tokens_per_layer": {"num_bits": 2},
    r"embed_tokens": {"num_bits": 4},
    r"self_attn\.(q|k|v|o)_proj": {"num_bits": 8},
    r"lm_head": {"num_bits": 8},
    r"per_layer_projection$|per_layer_input_gate": {"num_bits": 2},
    r"per_layer_model_projection": {"num_bits": 8},
    r"mlp\.(gate|up|down)_proj": {"num_bits": 4},
}
E2B_ASSUMED_DEFAULT_BITS = 4

#: The assumed map as a checkpoint's ``quantization_config`` (transformers' ``GemmaQuantizationConfig`` keys).
E2B_ASSUMED: dict[str, Any] = {
    "quant_method": "gemma",
    "num_bits": E2B_ASSUMED_DEFAULT_BITS,
    "quantize_embeddings": True,
    "module_quant_configs": E2B_ASSUMED_MODULES,
    "modules_to_not_convert": [],
}

#: One line per map, for reports.
E2B_ASSUMED_TEXT = (
    "attention q/k/v/o 8-bit, MLP 4-bit, per-layer input gate/projection 2-bit, per-layer model "
    "projection 8-bit, output layer 8-bit, default 4-bit; token embedding LUT 4-bit, per-layer "
    "embedding LUT 2-bit (paper: '2/4-bit LUT')"
)
E2B_PAPER_FIT_TEXT = (
    "attention q/k/v/o 8-bit, MLP and per-layer input gate/projection 2-bit, per-layer model "
    "projection and output layer 4-bit (default); LUTs as assumed"
)

#: Paper figures this module is checked against (bytes).
PAPER_SLM_GRAPH_BYTES = 754 * MB  # App. A Table 3
PAPER_HEAD_SIDE_BYTES = 365 * MB  # §6: the MTP Drafter's storage (123 MB graph + 242 MB LUT, Table 3)


class BitMapError(ValueError):
    """A bit map that cannot be applied: a width outside 2/4/8, a pattern that is not a valid regex, a
    ``quantization_config`` that is not transformers' Gemma form. Names the field."""


def validate(quant_config: Mapping[str, Any], where: str = "quantization_config") -> dict[str, Any]:
    """A copy of ``quant_config`` checked: ``num_bits`` and every ``module_quant_configs[*].num_bits`` in 2/4/8,
    every pattern a valid regex. Raises BitMapError naming the field."""
    if not isinstance(quant_config, Mapping):
        raise BitMapError(f"{where}: expected a table, got {type(quant_config).__name__}")
    q = copy.deepcopy(dict(quant_config))
    if q.get("quant_method", "gemma") != "gemma":
        raise BitMapError(
            f"{where}.quant_method: {q.get('quant_method')!r}; the SLM surgery reads transformers' "
            "pre-quantized Gemma format (quant_method 'gemma')"
        )
    bits = q.setdefault("num_bits", E2B_ASSUMED_DEFAULT_BITS)
    if bits not in (2, 4, 8):
        raise BitMapError(f"{where}.num_bits: {bits}; use 2, 4 or 8")
    modules = q.setdefault("module_quant_configs", {}) or {}
    for pattern, opts in modules.items():
        try:
            re.compile(pattern)
        except re.error as e:
            raise BitMapError(f"{where}.module_quant_configs[{pattern!r}]: not a regex ({e})") from None
        b = (opts or {}).get("num_bits", bits)
        if b not in (2, 4, 8):
            raise BitMapError(f"{where}.module_quant_configs[{pattern!r}].num_bits: {b}; use 2, 4 or 8")
    return q


def resolve_bits(name: str, quant_config: Mapping[str, Any]) -> int:
    """Bit width transformers gives module ``name`` (e.g. ``model.layers.3.mlp.up_proj``) under ``quant_config``.

    Same rule as ``transformers.integrations.gemma_quant.replace_with_quant_layers``: one regex of named
    alternatives, ``re.search``; the leftmost match wins, a tie goes to the earlier pattern; no match: ``num_bits``.
    """
    default = int(quant_config.get("num_bits", E2B_ASSUMED_DEFAULT_BITS))
    modules = quant_config.get("module_quant_configs") or {}
    if not modules:
        return default
    groups = list(modules.values())
    matcher = re.compile("|".join(f"(?P<g{i}>{p})" for i, p in enumerate(modules)))
    m = matcher.search(name)
    if m is None:
        return default
    for g, v in m.groupdict().items():
        if v is not None:
            return int((groups[int(g[1:])] or {}).get("num_bits", default))
    return default


def checkpoint_quant_config(config: Mapping[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` of a checkpoint's config.json (top level, or under ``text_config`` for the
    multimodal release), validated; None when it has none. Raises BitMapError for a malformed one."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not q:
        return None
    return validate(q, "config.json quantization_config")


def slm_quant_config(config: Mapping[str, Any] | None) -> tuple[dict[str, Any], str]:
    """(the SLM's bit map, where it comes from): the checkpoint's own ``quantization_config`` when ``config`` (its
    config.json as a dict) has one, else `E2B_ASSUMED` ("ASSUMED")."""
    q = checkpoint_quant_config(config) if config else None
    if q is not None:
        return q, "the checkpoint's quantization_config"
    return copy.deepcopy(E2B_ASSUMED), "ASSUMED"


def _layer_range(indices: Sequence[int]) -> str:
    """A regex matching ``layers.<i>.`` for exactly the given layer indices."""
    return r"layers\.(" + "|".join(str(i) for i in sorted(indices)) + r")\."


def e2b_paper_fit() -> dict[str, Any]:
    """The map that reproduces the paper's 754 MB SLM graph at E2B's shapes (752.8 MB, -0.16 %), as a
    ``quantization_config``: default 4-bit (output layer, per-layer model projection), attention 8-bit, MLP and
    per-layer input gate/projection 2-bit; LUTs as assumed. Of the `search_maps` candidates within 1 % it is the
    one with the fewest distinct rules (one width per module kind, every layer alike)."""
    modules = {
        r"embed_tokens_per_layer": {"num_bits": 2},
        r"embed_tokens": {"num_bits": 4},
        r"self_attn\.(q|k|v|o)_proj": {"num_bits": 8},
        r"mlp\.(gate|up|down)_proj": {"num_bits": 2},
        r"per_layer_projection$|per_layer_input_gate": {"num_bits": 2},
    }
    return {
        "quant_method": "gemma",
        "num_bits": 4,
        "quantize_embeddings": True,
        "module_quant_configs": modules,
        "modules_to_not_convert": [],
    }


# ---- sizes -----------------------------------------------------------------------------------------------------


def graph_bytes(
    linears: Iterable[tuple[str, int, int]], quant_config: Mapping[str, Any], other_params: int = 0
) -> dict[str, Any]:
    """Weight bytes of an integer graph: ``linears`` [(module name, out, in)] at their widths under
    ``quant_config`` (packed n/8 bytes per weight, rounded up per tensor), + one float32 scale per output channel,
    + 4 bytes per other parameter. Returns {"by_bits": {"int<n>": {tensors, weights, bytes}}, "integer_bytes",
    "scale_bytes", "other_param_bytes", "total_bytes"}."""
    by_bits: dict[str, dict[str, int]] = {}
    int_bytes = scales = 0
    for name, out, inp in linears:
        b = resolve_bits(name, quant_config)
        n = out * inp
        nbytes = math.ceil(n * b / 8)
        e = by_bits.setdefault(f"int{b}", {"tensors": 0, "weights": 0, "bytes": 0})
        e["tensors"] += 1
        e["weights"] += n
        e["bytes"] += nbytes
        int_bytes += nbytes
        scales += 4 * out
    return {
        "by_bits": dict(sorted(by_bits.items())),
        "integer_bytes": int_bytes,
        "scale_bytes": scales,
        "other_param_bytes": 4 * other_params,
        "total_bytes": int_bytes + scales + 4 * other_params,
    }


#: Module groups `search_maps` gives one width each (regex on the module name; ``{shared}`` is the KV-shared
#: layers' ``layers.(i|j|...).`` pattern). A module belongs to the first group that matches.
SEARCH_GROUPS: dict[str, str] = {
    "attention q/o": r"self_attn\.(q|o)_proj",
    "attention k/v": r"self_attn\.(k|v)_proj",
    "MLP, KV-shared layers": r"{shared}mlp\.",
    "MLP, own-KV layers": r"mlp\.",
    "per-layer gate/projection": r"per_layer_projection$|per_layer_input_gate",
    "per-layer model projection": r"per_layer_model_projection",
    "output layer (keep set)": r"lm_head",
}


def search_maps(
    linears: Sequence[tuple[str, int, int]],
    other_params: int,
    shared_layers: Sequence[int],
    *,
    target_bytes: int = PAPER_SLM_GRAPH_BYTES,
    tolerance: float = 0.01,
    widths: Sequence[int] = (2, 4, 8),
) -> dict[str, Any]:
    """Every assignment of ``widths`` to the `SEARCH_GROUPS` of ``linears`` whose `graph_bytes` total lands within
    ``tolerance`` (fraction) of ``target_bytes``.

    Returns {"target_bytes", "tolerance", "maps_tried", "maps_within", "closest": [{"bits": {group: n},
    "total_bytes", "diff_pct"}, ...] (the 10 closest, closest first), "groups": {group: weights}}.
    Raises BitMapError when a linear matches no group (the groups must cover the graph).
    """
    shared = _layer_range(shared_layers) if shared_layers else r"(?!x)x"
    patterns = {g: re.compile(p.replace("{shared}", shared)) for g, p in SEARCH_GROUPS.items()}
    group_of: dict[str, tuple[int, int]] = {}  # group -> (weights, channels)
    for name, out, inp in linears:
        g = next((g for g, p in patterns.items() if p.search(name)), None)
        if g is None:
            raise BitMapError(f"linear {name} is in no search group ({', '.join(SEARCH_GROUPS)})")
        w, c = group_of.get(g, (0, 0))
        group_of[g] = (w + out * inp, c + out)
    fixed = 4 * sum(c for _, c in group_of.values()) + 4 * other_params
    names = list(group_of)
    found = []
    tried = 0
    for bits in itertools.product(widths, repeat=len(names)):
        tried += 1
        total = fixed + sum(math.ceil(group_of[g][0] * b / 8) for g, b in zip(names, bits))
        if abs(total - target_bytes) <= tolerance * target_bytes:
            found.append((abs(total - target_bytes), total, dict(zip(names, bits))))
    found.sort(key=lambda f: f[0])
    return {
        "target_bytes": target_bytes,
        "tolerance": tolerance,
        "maps_tried": tried,
        "maps_within": len(found),
        "groups": {g: w for g, (w, _) in group_of.items()},
        "closest": [
            {"bits": b, "total_bytes": t, "diff_pct": round(100 * (t - target_bytes) / target_bytes, 2)}
            for _, t, b in found[:10]
        ],
    }


__all__ = [
    "BitMapError",
    "E2B_ASSUMED",
    "E2B_ASSUMED_DEFAULT_BITS",
    "E2B_ASSUMED_MODULES",
    "E2B_ASSUMED_TEXT",
    "E2B_PAPER_FIT_TEXT",
    "PAPER_HEAD_SIDE_BYTES",
    "PAPER_SLM_GRAPH_BYTES",
    "SEARCH_GROUPS",
    "checkpoint_quant_config",
    "e2b_paper_fit",
    "graph_bytes",
    "resolve_bits",
    "search_maps",
    "slm_quant_config",
    "validate",
]
