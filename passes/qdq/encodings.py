"""The fixed encodings of hycoc's QDQ graphs (`hycoc.passes.qdq.quantize`, its module docstring steps 2-3 and 5): the
activation overrides `quantize_graph` hands onnxruntime (every calibrated range, then masks, rotary inputs, the
(scores + mask) sums' floor, ring ties in `fixed_overrides`; every Softmax output at [0, 1] in `softmax_overrides`),
the encodings the saved QDQ graph holds (`qdq_io_encodings`, `tensor_encoding`, the KV wire form
`kv_wire_encoding`) and the check that the fixed ones held (`check_fixed_encodings`). `QdqError` is what a failed
check raises, here and in `hycoc.passes.qdq.weights`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
from hycoc.passes.calibration import (
    MASK_MAX,
    MASK_MIN,
    ROTARY_MAX,
    ROTARY_MIN,
    is_mask_input,
    is_rotary_input,
)

#: Fixed lower end of an attention (scores + mask) sum's encoding: masked scores clip here.
SCORE_FLOOR = 100.0
#: QNN's fixed 16-bit Tanh output encoding (uint16): real = (code - 32768) / 32768.
TANH_SCALE, TANH_ZERO_POINT = 1.0 / 32768.0, 32768
#: The fixed 16-bit Softmax output encoding (uint16): real = code / 65535, exactly [0, 1] whatever calibration saw.
SOFTMAX_SCALE, SOFTMAX_ZERO_POINT = np.float32(1.0 / 65535.0), 0
#: Ops whose output onnxruntime's QDQ quantizer gives their input's encoding.
_SAME_ENCODING_OPS = {"Transpose", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"}


class QdqError(RuntimeError):
    """The QDQ graph is not what hycoc promises: a weight whose DequantizeLinear integers, scales, zero point or
    axis differ from the source, a fixed encoding that did not hold, a ring whose input and output encodings
    differ, a float weight that is not q * scale. The message names the tensor."""


def require_a16(activation_bits: int) -> None:
    """Refuse a recipe's ``slm_calibration.activation_bits`` other than 16: the SLM's graphs are A16 (16-bit
    activations, paper App. A); the recipe also admits 8, which no pass implements. Raises QdqError naming the
    key."""
    if activation_bits != 16:
        raise QdqError(
            f"slm_calibration.activation_bits = {activation_bits}: only 16-bit (A16) activations are implemented"
        )


def initializer_arrays(model) -> dict[str, np.ndarray]:
    """Every initializer of an onnx.ModelProto as a numpy array, by name."""
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _consumers(model) -> dict[str, list]:
    out: dict[str, list] = {}
    for n in model.graph.node:
        for i in n.input:
            out.setdefault(i, []).append(n)
    return out


def _moved(name: str, users: Mapping[str, list]) -> list[str]:
    """``name`` and every tensor made from it by data-movement ops only (`_SAME_ENCODING_OPS`)."""
    out, todo = [], [name]
    while todo:
        t = todo.pop()
        out.append(t)
        todo += [n.output[0] for n in users.get(t, []) if n.op_type in _SAME_ENCODING_OPS and n.input[0] == t]
    return out


def fixed_overrides(model, ranges: Mapping[str, tuple[float, float]]) -> dict[str, list[dict[str, Any]]]:
    """Activation overrides: every calibrated range, then the fixed encodings and the ring ties (module
    docstring, steps 2-3)."""
    ranges = dict(ranges)
    g = model.graph
    inputs = [i.name for i in g.input]
    outputs = [o.name for o in g.output]
    users = _consumers(model)
    producers = {o: n for n in g.node for o in n.output}
    for name in inputs:
        if is_mask_input(name):
            ranges[name] = (MASK_MIN, MASK_MAX)
            for n in users.get(name, []):
                if n.op_type == "Add" and n.output[0] in ranges:
                    ranges[n.output[0]] = (-SCORE_FLOOR, max(ranges[n.output[0]][1], 0.0))
        elif is_rotary_input(name):
            for t in _moved(name, users):  # the input and its Unsqueeze/Reshape copies: one fixed encoding
                ranges[t] = (ROTARY_MIN, ROTARY_MAX)
    for name in inputs:
        if "_ring_" not in name:
            continue
        out = name.replace("_ring_", "_new_")
        if out not in outputs and out not in inputs:
            raise QdqError(f"ring input '{name}' has no matching output '{out}' to tie its encoding to")
        # a layer shard reading an earlier shard's producer takes its new rows as an input (slm_graph "Shards"):
        # ring, new rows and their Concat tied the same way, on this shard's calibration of the same tensors
        tied = [name, out] + [n.output[0] for n in users.get(name, []) if n.op_type == "Concat"]
        # data-movement ops pass their input's encoding through (onnxruntime's QDQ rules): tie the chain back to
        # the op that computes the new rows
        node = producers.get(out)
        while node is not None and node.op_type in _SAME_ENCODING_OPS:
            tied.append(node.input[0])
            node = producers.get(node.input[0])
        lo = min(ranges[t][0] for t in tied if t in ranges)
        hi = max(ranges[t][1] for t in tied if t in ranges)
        for t in tied:
            ranges[t] = (lo, hi)
    return {name: [{"rmin": np.float32(lo), "rmax": np.float32(hi)}] for name, (lo, hi) in ranges.items()}


def softmax_outputs(model) -> list[str]:
    """Every Softmax node's output and the tensors data-movement ops make from it (`_SAME_ENCODING_OPS`), in
    graph order: the tensors `softmax_overrides` fixes."""
    users = _consumers(model)
    out: list[str] = []
    for n in model.graph.node:
        if n.op_type == "Softmax":
            out += [t for t in _moved(n.output[0], users) if t not in out]
    return out


def softmax_overrides(model) -> dict[str, list[dict[str, Any]]]:
    """``init_overrides`` entries giving every `softmax_outputs` tensor the fixed [0, 1] encoding (uint16, scale
    1/65535, zero point 0; module docstring, step 3), whatever any calibrated or copied range said."""
    return {
        name: [{"scale": np.array(SOFTMAX_SCALE, np.float32), "zero_point": np.array(SOFTMAX_ZERO_POINT, np.uint16)}]
        for name in softmax_outputs(model)
    }


def _encoding(arrays, node) -> dict[str, Any]:
    scale = arrays[node.input[1]]
    zp = arrays[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
    return {"scale": float(scale), "zero_point": int(zp), "dtype": str(zp.dtype)}


def qdq_io_encodings(model) -> dict[str, dict[str, Any]]:
    """Graph input/output name -> {scale, zero_point, dtype} of its uint16 encoding (the Q node reading an input,
    the DQ node writing an output); the bundle manifest lists these."""
    arrays = initializer_arrays(model)
    out = {}
    inputs = {i.name for i in model.graph.input}
    outputs = {o.name for o in model.graph.output}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] in inputs and n.input[1] in arrays:
            out[n.input[0]] = _encoding(arrays, n)
        if n.op_type == "DequantizeLinear" and n.output[0] in outputs and n.input[1] in arrays:
            out[n.output[0]] = _encoding(arrays, n)
    return out


def tensor_encoding(model, tensor: str) -> dict[str, Any]:
    """The encoding of the QuantizeLinear that reads ``tensor``; QdqError when there is none."""
    arrays = initializer_arrays(model)
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] == tensor:
            return _encoding(arrays, n)
    raise QdqError(f"tensor '{tensor}' is not quantized in the QDQ graph")


def kv_wire_encoding(encoding: Mapping[str, Any], bits: int = 8) -> dict[str, Any]:
    """The ``bits``-wide unsigned encoding of the same real range as a 16-bit KV ``encoding`` (module docstring)."""
    levels, wire = 65535, (1 << bits) - 1
    lo = -encoding["zero_point"] * encoding["scale"]
    scale = encoding["scale"] * levels / wire
    return {"scale": scale, "zero_point": int(round(-lo / scale)), "dtype": f"uint{bits}"}


def check_fixed_encodings(model) -> dict[str, Any]:
    """Verify the fixed encodings (masks, rotary, Tanh, ring ties) on the QDQ graph; returns them. QdqError."""
    enc = qdq_io_encodings(model)
    found: dict[str, Any] = {"mask": {}, "rotary": {}, "tanh": [], "ring": {}, "softmax": {}}

    def close(a, b):
        return abs(a - b) <= 1e-6 * max(1.0, abs(b))

    for name, e in enc.items():
        if is_mask_input(name):
            lo, hi = -e["zero_point"] * e["scale"], (65535 - e["zero_point"]) * e["scale"]
            if e["zero_point"] != 65535 or not close(lo, MASK_MIN) or hi != 0:
                raise QdqError(f"mask input '{name}' encoding {e} does not span [{MASK_MIN:g}, 0]")
            found["mask"][name] = e
        elif is_rotary_input(name):
            lo, hi = -e["zero_point"] * e["scale"], (65535 - e["zero_point"]) * e["scale"]
            # uint16 over [-1, 1]: scale 2/65535, zero point round(32767.5) = 32768; both ends within one step
            if not (abs(lo - ROTARY_MIN) <= e["scale"] and abs(hi - ROTARY_MAX) <= e["scale"]):
                raise QdqError(f"rotary input '{name}' encoding {e} does not span [-1, 1]")
            found["rotary"][name] = e
        elif "_ring_" in name:
            out = enc.get(name.replace("_ring_", "_new_"))
            if out != e:
                raise QdqError(
                    f"ring input '{name}' encoding {e} differs from output "
                    f"'{name.replace('_ring_', '_new_')}' {out}: the runtime could not copy KV bytes"
                )
            found["ring"][name] = e
    arrays = initializer_arrays(model)
    for n in model.graph.node:
        if n.op_type != "Tanh":
            continue
        q = [m for m in model.graph.node if m.op_type == "QuantizeLinear" and m.input[0] == n.output[0]]
        for m in q:
            e = _encoding(arrays, m)
            if e["dtype"] == "uint16" and (e["zero_point"] != TANH_ZERO_POINT or e["scale"] != TANH_SCALE):
                raise QdqError(f"Tanh '{n.name}' output encoding {e} is not QNN's fixed 16-bit encoding")
            found["tanh"].append(e)
    softmax = {n.output[0] for n in model.graph.node if n.op_type == "Softmax"}
    for n in model.graph.node:
        if n.op_type != "QuantizeLinear" or n.input[0] not in softmax or n.input[1] not in arrays:
            continue
        e = _encoding(arrays, n)
        if e["dtype"] != "uint16" or e["zero_point"] != SOFTMAX_ZERO_POINT or np.float32(e["scale"]) != SOFTMAX_SCALE:
            raise QdqError(
                f"Softmax output '{n.input[0]}' encoding {e} is not the fixed [0, 1] (uint16, scale "
                f"1/65535, zero point 0)"
            )
        found["softmax"][n.input[0]] = e
    missing = sorted(softmax - set(found["softmax"]))
    if missing:
        raise QdqError(f"Softmax output '{missing[0]}' is not quantized: it needs the fixed [0, 1] encoding")
    return found
