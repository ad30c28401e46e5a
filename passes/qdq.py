"""QDQ insertion for the HTP: A16 activations, bit-exact per-channel integer weights, fixed encodings, SQNR report
(docs/design.md "Numerics by construction"; paper App. A Table 3).

`quantize_graph` turns an exported static float graph into a QDQ graph with onnxruntime's QNN helpers
(``qnn_preprocess_model``, ``get_qnn_qdq_config``, ``quantize``), in this order:

1. integer weights: the SLM graph writes every weight as ``Cast(int8 initializer) -> Mul(scale (out, 1))``
   (``IntegerLinear``), usually followed by ``Transpose`` into the MatMul. `fold_integer_weights` replaces each
   pattern by one float initializer (q * scale in float32, exactly what the graph computed, transposed when the
   Transpose is folded too) and records the integers and scales (`IntegerWeightSpec`). The head's QAT output gives
   them as arrays instead (`weights_from_arrays`, which checks that the graph's float weight is q * scale bit for
   bit). Each becomes a per-channel ``init_overrides`` entry with the source's own scale per channel, zero point
   0, int8 (8-bit source) or int4 (2- and 4-bit sources: HTP has no int2; the integers are unchanged), and the
   channel axis -- ``get_qnn_qdq_config(per_channel=True)`` only touches Conv, so MatMul weights need the axis.
2. activations: uint16 (A16) with ranges from `hycoc.passes.calibration.activation_ranges` (SLM: 99.9th
   percentile x 1.2 of |x|), given as ``rmin``/``rmax`` overrides.
3. fixed encodings, whatever the calibration saw:
   - masks ``mask_*``: [-1e4, 0] (scale 1e4/65535, zero point 65535: both ends exact); a sample holding -inf or a
     min-float stand-in is refused (`CalibrationError`);
   - the (scores + mask) sums: a fixed floor ``-SCORE_FLOOR`` (masked scores clip there; exp(-100) is 0 in the
     softmax), so the huge mask does not set the scores' scale (targets/htp.py's measured lesson);
   - rotary ``cos_*``/``sin_*``: [-1, 1];
   - the logit soft-cap's Tanh output: QNN's fixed 16-bit encoding (scale 1/32768, zero point 32768), which
     ``get_qnn_qdq_config`` sets; `check_fixed_encodings` verifies it;
   - every Softmax output (and its data-movement copies): [0, 1], scale 1/65535, zero point 0 (`softmax_overrides`),
     also where the encodings are copied from another graph. A calibrated range clips the rows that exceed it (a
     row whose mass sits on one column reaches 1), and a Softmax encoding other than [0, 1] is what
     onnxruntime-qnn's own quantizer stopped emitting for the HTP (microsoft/onnxruntime-qnn PR #558);
   - the ring: ``k_ring_i``, ``k_new_i`` and their Concat get one range, the union of both calibrated ranges,
     so input and output KV share scale and zero point and the runtime copies KV bytes without requantizing.
4. HTP rewrite: ``Reciprocal(x)`` -> ``Div(1, x)`` (`reciprocal_to_div`: the v81 simulator's uint16 Reciprocal
   was wrong on one RMSNorm's range).
5. checks on the saved QDQ graph: every weight's DequantizeLinear holds the source integers, scales, zero point 0
   and axis exactly (`verify_weights`, raises `QdqError`), and the fixed encodings hold (`check_fixed_encodings`).

KV encoding the graph expects (``qdq_io_encodings``): each ``k_ring_i``/``v_ring_i`` input and ``k_new_i``/
``v_new_i`` output is uint16 with one (scale, zero point): real = scale * (code - zero_point). The runtime keeps
the ring as these codes, and writes a committed row by copying the output's codes into column p mod W_T. With
``slm_calibration.kv_bits = 8`` the runtime may keep the ring 8-bit on the wire and in memory, as uint8 codes of
the same range (`kv_wire_encoding`: scale * 65535/255, zero point rescaled); it then requantizes on the way in and out
(the graph itself stays 16-bit; onnxruntime-qnn's ``offload_graph_io_quantization`` quantizes float graph IO on
the CPU).

`sqnr_report` runs the float and the QDQ graph on the CPU EP with every decoder layer's output added as a graph
output (on copies) and reports the SQNR (dB) per graph output and per layer, and the top-1 agreement of logits.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.passes.calibration import (
    MASK_MAX,
    MASK_MIN,
    ROTARY_MAX,
    ROTARY_MIN,
    CalibrationError,
    activation_ranges,
    check_samples,
    is_mask_input,
    is_rotary_input,
    list_reader,
)
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.numerics import sqnr_db  # re-exported: benchmarks/real_shape_head.py imports it from here
from hycoc.recipe import Recipe

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


@dataclass
class IntegerWeightSpec:
    """One integer weight as the QDQ graph must hold it: initializer ``name`` (float, = q * scale broadcast on
    ``axis``), ``q`` int8 in the initializer's layout, ``scale`` float32 (channels,), ``bits`` of the source."""

    name: str
    q: np.ndarray
    scale: np.ndarray
    axis: int
    bits: int

    @property
    def qdq_bits(self) -> int:
        return 8 if self.bits > 4 else 4

    def dequantized(self) -> np.ndarray:
        shape = [1] * self.q.ndim
        shape[self.axis] = -1
        return self.q.astype(np.float32) * self.scale.reshape(shape)


def _bits_of(q: np.ndarray) -> int:
    return 4 if q.size and q.min() >= -8 and q.max() <= 7 else 8


def fold_integer_weights(model) -> tuple[Any, list[IntegerWeightSpec]]:
    """Replace each ``Cast(int8 init) -> Mul(scale init) [-> Transpose]`` by one float initializer (module
    docstring, step 1). Works on an onnx.ModelProto (external data loaded) in place; returns it and the specs."""
    import onnx
    from onnx import numpy_helper

    g = model.graph
    inits = {t.name: t for t in g.initializer}
    consumers: dict[str, list] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
    specs, drop, new_inits = [], [], []
    for cast in list(g.node):
        if cast.op_type != "Cast" or cast.input[0] not in inits:
            continue
        t = inits[cast.input[0]]
        if t.data_type != onnx.TensorProto.INT8:
            continue
        users = consumers.get(cast.output[0], [])
        if len(users) != 1 or users[0].op_type != "Mul":
            continue
        mul = users[0]
        other = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
        if other not in inits:
            continue
        q = numpy_helper.to_array(t)
        s = numpy_helper.to_array(inits[other]).astype(np.float32)
        if q.ndim != 2 or s.shape not in ((q.shape[0], 1), (q.shape[0],)):
            continue
        w = q.astype(np.float32) * s.reshape(-1, 1)
        out, axis, nodes = mul.output[0], 0, [cast, mul]
        after = consumers.get(mul.output[0], [])
        perm = next((list(a.ints) for a in after[0].attribute if a.name == "perm"), None) if len(after) == 1 else None
        if len(after) == 1 and after[0].op_type == "Transpose" and perm == [1, 0]:
            w, q, axis, out = w.T, q.T, 1, after[0].output[0]
            nodes.append(after[0])
        base = cast.input[0].removesuffix(".q")
        name = f"{base}.weight" if axis == 0 else f"{base}.weight_t"
        new_inits.append(numpy_helper.from_array(np.ascontiguousarray(w), name))
        for n in g.node:
            n.input[:] = [name if i == out else i for i in n.input]
        drop += nodes
        specs.append(IntegerWeightSpec(name, np.ascontiguousarray(q), s.reshape(-1), axis, _bits_of(q)))
    dropped = {id(n) for n in drop}
    keep = [n for n in g.node if id(n) not in dropped]
    del g.node[:]
    g.node.extend(keep)
    used = {i for n in g.node for i in n.input}
    remaining = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(remaining + new_inits)
    return model, specs


def reciprocal_to_div(model) -> int:
    """Rewrite every ``Reciprocal(x)`` as ``Div(1, x)`` (equal in float32), in place; returns the count.

    Why: measured with onnxruntime-qnn 2.7.0 / QNN 2.51 on the x86 HTP v81 simulator, the uint16 Reciprocal of an
    RMSNorm over small values (input range [0, 0.45], output [0, 13.7]; the tiny SLM's per-layer projection norm)
    came out at 5 dB SQNR against the same QDQ graph on the CPU EP, and the logits at 8.8 dB; as Div the logits
    reach 23 dB and the KV outputs 32-45 dB. The other RMSNorms' Reciprocals were exact (90 dB) -- the failure
    depends on the range. The RMSNorm decomposition (passes/rmsnorm_decomposition.py) is the better home.
    """
    from onnx import helper, numpy_helper

    g = model.graph
    count = 0
    for index, n in enumerate(list(g.node)):
        if n.op_type != "Reciprocal":
            continue
        one = f"{n.output[0]}_one"
        g.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), one))
        g.node[index].CopyFrom(helper.make_node("Div", [one, n.input[0]], list(n.output), name=n.name))
        count += 1
    return count


def weights_from_arrays(model, arrays: Mapping[str, tuple[np.ndarray, np.ndarray, int]]) -> list[IntegerWeightSpec]:
    """Specs for float weight initializers given as (q int8 [out, in], scale float32 [out, 1] or [out], bits), by
    initializer name (the head's QAT output). The initializer must equal q * scale (axis 0) or its transpose
    (axis 1) bit for bit; QdqError otherwise."""
    from onnx import numpy_helper

    inits = {t.name: t for t in model.graph.initializer}
    specs = []
    for name, (q, s, bits) in arrays.items():
        if name not in inits:
            raise QdqError(f"no initializer '{name}' in the graph for the given integer weight")
        w = numpy_helper.to_array(inits[name])
        q, s = np.asarray(q, dtype=np.int8), np.asarray(s, dtype=np.float32).reshape(-1)
        want = q.astype(np.float32) * s[:, None]
        if w.shape == want.shape and np.array_equal(w.view(np.uint32), want.view(np.uint32)):
            specs.append(IntegerWeightSpec(name, q, s, 0, bits))
        elif w.shape == want.T.shape and np.array_equal(
            w.view(np.uint32), np.ascontiguousarray(want.T).view(np.uint32)
        ):
            specs.append(IntegerWeightSpec(name, np.ascontiguousarray(q.T), s, 1, bits))
        else:
            raise QdqError(
                f"initializer '{name}' {w.shape} is not q * scale {want.shape} (or its transpose) bit for "
                f"bit: the graph was not exported from these integers"
            )
    return specs


def weight_overrides(specs: Sequence[IntegerWeightSpec]) -> dict[str, list[dict[str, Any]]]:
    """``init_overrides`` entries: per channel the source's scale, zero point 0, int8/int4, the channel axis."""
    from onnxruntime.quantization import QuantType

    out = {}
    for spec in specs:
        qtype = QuantType.QInt8 if spec.qdq_bits == 8 else QuantType.QInt4
        zp = np.int8(0)
        out[spec.name] = [
            {"axis": spec.axis, "quant_type": qtype, "scale": np.float32(s), "zero_point": zp} for s in spec.scale
        ]
    return out


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


# ---- checks on the QDQ graph ------------------------------------------------------------------------------------


def _arrays(model) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def _axis(node) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def verify_weights(model, specs: Sequence[IntegerWeightSpec]) -> int:
    """Check that each spec's weight reaches the graph as DequantizeLinear(source integers, source scales, zero
    point 0, its channel axis), bit-exact. Returns how many were checked; raises QdqError naming the first that
    differs."""
    import onnx

    arrays = _arrays(model)
    dq_by_init = {}
    for n in model.graph.node:
        if n.op_type == "DequantizeLinear" and n.input[0] in arrays:
            dq_by_init[n.input[0]] = n
    types = {t.name: t.data_type for t in model.graph.initializer}
    for spec in specs:
        node = dq_by_init.get(f"{spec.name}_quantized")
        if node is None:
            raise QdqError(f"weight '{spec.name}' has no DequantizeLinear of its integers in the QDQ graph")
        q, scale = arrays[node.input[0]], arrays[node.input[1]]
        zp = arrays[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros(1, np.int8)
        want_type = onnx.TensorProto.INT8 if spec.qdq_bits == 8 else onnx.TensorProto.INT4
        problems = []
        if types[node.input[0]] != want_type:
            problems.append(
                f"integer type {onnx.TensorProto.DataType.Name(types[node.input[0]])}, expected "
                f"{onnx.TensorProto.DataType.Name(want_type)}"
            )
        if q.shape != spec.q.shape or not np.array_equal(q.astype(np.int8), spec.q):
            problems.append("integers differ from the source")
        if scale.shape != spec.scale.shape or not np.array_equal(
            scale.astype(np.float32).view(np.uint32), spec.scale.view(np.uint32)
        ):
            problems.append("scales differ from the source")
        if np.any(zp != 0):
            problems.append("zero point is not 0")
        if _axis(node) != spec.axis:
            problems.append(f"axis {_axis(node)}, expected {spec.axis}")
        if problems:
            raise QdqError(f"weight '{spec.name}': {'; '.join(problems)} (bit-exact weights are required)")
    return len(specs)


def _encoding(arrays, node) -> dict[str, Any]:
    scale = arrays[node.input[1]]
    zp = arrays[node.input[2]] if len(node.input) > 2 and node.input[2] else np.zeros((), np.uint8)
    return {"scale": float(scale), "zero_point": int(zp), "dtype": str(zp.dtype)}


def qdq_io_encodings(model) -> dict[str, dict[str, Any]]:
    """Graph input/output name -> {scale, zero_point, dtype} of its uint16 encoding (the Q node reading an input,
    the DQ node writing an output); the bundle manifest lists these."""
    arrays = _arrays(model)
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
    arrays = _arrays(model)
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
    arrays = _arrays(model)
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


# ---- SQNR ----------------------------------------------------------------------------------------------------


def layer_outputs(model) -> dict[str, str]:
    """``model.layers.i`` (the SLM graph) or ``layers.i`` (the head graph) -> the tensor its last node writes (from
    the exporter's ``name_scopes`` metadata)."""
    import ast

    last: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "Constant" or not n.output:
            continue
        meta = {p.key: p.value for p in n.metadata_props}
        scopes = meta.get("pkg.torch.onnx.name_scopes")
        if not scopes:
            continue
        try:
            parts = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            continue
        layer = next(
            (
                p
                for p in parts
                if (p.count(".") == 2 and p.startswith("model.layers."))
                or (p.count(".") == 1 and p.startswith("layers."))
            ),
            None,
        )
        if layer is not None:
            last[layer] = n.output[0]
    return dict(sorted(last.items(), key=lambda kv: int(kv[0].rsplit(".", 1)[1])))


def _dq_name(model, tensor: str) -> str:
    """The dequantized copy of ``tensor`` in a QDQ graph (what its consumers read), or ``tensor`` itself."""
    q = next((n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor), None)
    if q is None:
        return tensor
    dq = next((n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]), None)
    return dq.output[0] if dq is not None else tensor


def sqnr_report(
    float_path: str | Path,
    qdq_path: str | Path,
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    layers: Mapping[str, str] | None = None,
    logits: str | None = "logits",
) -> dict[str, Any]:
    """SQNR (dB, over all samples) of every graph output and of each ``layers`` tensor (label -> float tensor
    name), QDQ vs float on the CPU EP, and the top-1 agreement of ``logits`` rows. JSON-ready (``sqnr.json``)."""
    import onnx
    from hycoc.passes.calibration import run_with_tensors

    fm = onnx.load(str(float_path), load_external_data=False)
    qm = onnx.load(str(qdq_path), load_external_data=False)
    outputs = [o.name for o in fm.graph.output]
    layers = dict(layers or {})
    qnames = {label: _dq_name(qm, t) for label, t in layers.items()}
    f_runs = run_with_tensors(float_path, outputs + list(layers.values()), samples)
    q_runs = run_with_tensors(qdq_path, outputs + list(qnames.values()), samples)

    def cat(runs, name):
        return np.concatenate([r[name].reshape(-1) for r in runs])

    report: dict[str, Any] = {
        "samples": len(samples),
        "outputs": {o: round(sqnr_db(cat(f_runs, o), cat(q_runs, o)), 3) for o in outputs},
        "layers": {label: round(sqnr_db(cat(f_runs, t), cat(q_runs, qnames[label])), 3) for label, t in layers.items()},
    }
    if logits in outputs:
        agree = [
            np.mean(
                f[logits].reshape(-1, f[logits].shape[-1]).argmax(-1)
                == q[logits].reshape(-1, q[logits].shape[-1]).argmax(-1)
            )
            for f, q in zip(f_runs, q_runs)
        ]
        report["top1_agreement"] = round(float(np.mean(agree)), 6)
    return report


def sqnr_table(report: Mapping[str, Any]):
    """A rich Table of an `sqnr_report`."""
    from rich.table import Table

    table = Table(title=f"QDQ vs float SQNR ({report['samples']} samples)")
    table.add_column("tensor")
    table.add_column("SQNR dB", justify="right")
    for kind in ("layers", "outputs"):
        for name, value in report[kind].items():
            table.add_row(name, f"{value:.1f}")
    if "top1_agreement" in report:
        table.add_row("top-1 agreement (logits)", f"{report['top1_agreement']:.1%}")
    return table


# ---- the whole step ------------------------------------------------------------------------------------------


@dataclass
class QdqResult:
    """What `quantize_graph` made: the QDQ graph at ``path`` (external data beside it), the float graph it
    quantized (weights folded, preprocessed) at ``float_path``, and the numbers."""

    path: Path
    float_path: Path
    weights: list[IntegerWeightSpec]
    encodings: dict[str, dict[str, Any]]
    fixed: dict[str, Any]
    ops: dict[str, int]
    seconds: float
    reciprocals_rewritten: int = 0
    sqnr: dict[str, Any] = field(default_factory=dict)
    #: Softmax outputs whose calibrated range was not [0, 1] before the fixed encoding replaced it: name -> [lo, hi]
    softmax_calibrated: dict[str, list[float]] = field(default_factory=dict)

    def numbers(self) -> dict[str, Any]:
        bits = Counter(s.qdq_bits for s in self.weights)
        return {
            "seconds": round(self.seconds, 3),
            "ops": self.ops,
            "quantize_linear": self.ops.get("QuantizeLinear", 0),
            "dequantize_linear": self.ops.get("DequantizeLinear", 0),
            "weights_bit_exact": len(self.weights),
            "weight_bits": {str(k): v for k, v in sorted(bits.items())},
            "reciprocals_rewritten": self.reciprocals_rewritten,
            "io_encodings": self.encodings,
            "softmax_fixed_0_1": len(self.fixed.get("softmax", {})),
            "softmax_calibrated_not_0_1": self.softmax_calibrated,
            "sqnr": self.sqnr,
        }


def quantize_graph(
    model_path: str | Path,
    samples: Sequence[Mapping[str, np.ndarray]],
    out_dir: str | Path,
    *,
    percentile: float,
    range_scale: float = 1.0,
    weight_arrays: Mapping[str, tuple[np.ndarray, np.ndarray, int]] | None = None,
    report_sqnr: bool = True,
    htp_rewrites: bool = True,
    encodings: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> QdqResult:
    """Quantize the float graph at ``model_path`` (module docstring) into ``out_dir/model_qdq.onnx``.

    samples: calibration input dicts (numpy, by graph input name). weight_arrays: integer weights given as arrays
    (head QAT output), by float initializer name; without them the Cast(int8) -> Mul(scale) patterns are folded.
    htp_rewrites: rewrite Reciprocal as Div first (`reciprocal_to_div`). encodings: activation tensor name ->
    (scale float32, zero point uint16) scalars to give those tensors instead of calibrated ranges (steps 2-3
    skipped; another graph's, `hycoc.passes.slm_decode.activation_encodings`); ``samples`` then only feed
    onnxruntime's calibration run. Raises CalibrationError (bad samples, e.g. a mask holding -inf) or QdqError
    (a check failed).
    """
    import onnx
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = onnx.load(str(model_path))
    if weight_arrays:
        specs = weights_from_arrays(model, weight_arrays)
    else:
        model, specs = fold_integer_weights(model)
    reciprocals = reciprocal_to_div(model) if htp_rewrites else 0
    folded, float_path = out_dir / "model_folded.onnx", out_dir / "model_float.onnx"
    onnx.save(model, str(folded), save_as_external_data=True, location=folded.name + ".data")
    if not qnn_preprocess_model(
        str(folded), str(float_path), save_as_external_data=True, external_data_location=float_path.name + ".data"
    ):
        shutil.copy(folded, float_path)  # its external data stays in folded's data file, beside it
    feeds = check_samples(float_path, samples)
    fmodel = onnx.load(str(float_path), load_external_data=False)
    softmax_calibrated: dict[str, list[float]] = {}
    if encodings is None:
        ranges = activation_ranges(float_path, feeds, percentile=percentile, range_scale=range_scale)
        overrides = fixed_overrides(fmodel, ranges)
        # what calibration alone would have given the Softmax outputs that are not [0, 1] (reported, then fixed)
        softmax_calibrated = {
            t: [float(ranges[t][0]), float(ranges[t][1])]
            for t in softmax_outputs(fmodel)
            if t in ranges and (float(ranges[t][0]), float(ranges[t][1])) != (0.0, 1.0)
        }
    else:
        overrides = {
            name: [{"scale": np.array(s, np.float32), "zero_point": np.array(zp)}]
            for name, (s, zp) in encodings.items()
        }
    overrides.update(softmax_overrides(fmodel))  # fixed whatever was calibrated or copied
    overrides.update(weight_overrides(specs))
    config = get_qnn_qdq_config(
        str(float_path),
        list_reader(feeds),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QInt8,
        init_overrides=overrides,
    )
    config.use_external_data_format = True
    # quantize data-movement ops (Unsqueeze, Reshape, ...) on graph inputs too: left in float they would not run
    # on the HTP, and the rotary inputs' fixed encoding would sit after them instead of on the input
    config.extra_options["ForceQuantizeNoInputCheck"] = True
    path = out_dir / "model_qdq.onnx"
    quantize(str(float_path), str(path), config)
    qmodel = onnx.load(str(path))
    verify_weights(qmodel, specs)
    fixed = check_fixed_encodings(qmodel)
    ops = dict(sorted(Counter(n.op_type for n in qmodel.graph.node).items()))
    result = QdqResult(
        path,
        float_path,
        specs,
        qdq_io_encodings(qmodel),
        fixed,
        ops,
        time.perf_counter() - start,
        reciprocals_rewritten=reciprocals,
        softmax_calibrated=softmax_calibrated,
    )
    if report_sqnr:
        result.sqnr = sqnr_report(float_path, path, feeds, layers=layer_outputs(fmodel))
    return result


def write_sqnr_json(report: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1), encoding="utf-8")


__all__ = [
    "CalibrationError",
    "IntegerWeightSpec",
    "QdqError",
    "QdqResult",
    "check_fixed_encodings",
    "fold_integer_weights",
    "kv_wire_encoding",
    "layer_outputs",
    "qdq_io_encodings",
    "quantize_graph",
    "sqnr_db",
    "sqnr_report",
    "sqnr_table",
    "tensor_encoding",
    "verify_weights",
    "weights_from_arrays",
    "write_sqnr_json",
    "QdqQuantize",
    "slm_calibration_samples",
    "softmax_outputs",
    "softmax_overrides",
    "SOFTMAX_SCALE",
    "SOFTMAX_ZERO_POINT",
]


# ---- the pipeline pass ---------------------------------------------------------------------------------------


def slm_calibration_samples(graph, slm, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` input dicts for the SLM tree graph: random trees and tokens through the host LUTs and rotary
    tables, ring fills from a single live column to a full wrapped ring (targets/htp.py's lesson: calibrate small
    fills too), ring K/V drawn like normed keys/values (RMS 1). Stand-in for the verifier's greedy answers to
    ``slm_calibration.prompts`` prompts, which are not wired in yet."""
    from hycoc.passes.slm_graph import host_inputs

    rng = np.random.default_rng(seed)
    r, ring = graph.rows, max(graph.ring.values())
    out = []
    for i in range(count):
        parents = [-1] + [int(rng.integers(max(0, j - 3), j)) for j in range(1, r)]
        first = ring + 3 + int(rng.integers(0, ring))
        fill = 1 + (i * ring) // max(1, count - 1) if count > 1 else ring  # live columns, 1 .. ring
        live_start = max(0, first - min(fill, ring))
        rings = {}
        for layer in graph.all_kv_layers:  # the whole chain's rings (any shard: host feeds)
            shape = graph.host_shapes[f"k_ring_{layer}"]
            rings[layer] = (
                rng.standard_normal(shape).astype(np.float32),
                rng.standard_normal(shape).astype(np.float32),
            )
        tokens = rng.integers(0, graph.config.vocab_size, r)
        out.append(host_inputs(graph, slm, tokens, parents, first, live_start, rings))
    return out


class QdqQuantize(Pass):
    """The QDQ pass of one graph kind: ``QdqQuantize("onnx_slm", "qdq_slm")`` (module docstring).

    Only the SLM is wired: it consumes ``onnx_slm`` + ``slm_integer`` + ``keep_set`` + ``torch_verifier`` +
    ``tokenizer`` + ``calibration_answers`` and reads ``[slm_calibration]`` (percentile x range_scale; ``prompts``
    calibration prompts, `hycoc.passes.slm_calibration.SAMPLES_PER_PROMPT` graph calls kept from each),
    ``[window]``, ``[tree]`` and, for the answer cap, ``[head_qat]``. The QDQ graph then gets the
    outputs ``top_index`` / ``top_logq`` of its ``tree.slm_candidates`` best tokens per row
    (`hycoc.passes.topk_outputs.append_topk`), which the device runtime reads instead of the logits. Calibration inputs
    (``calibration="real"``, the build's): the verifier's greedy answers to the calibration prompts driven
    through the device runtime's SLM drafter and tree builder on the float torch graph
    (`hycoc.passes.slm_calibration`); the held-out SQNR report uses ``max(2, prompts // 4)`` other prompts.
    ``calibration="synthetic"``: `slm_calibration_samples` (``prompts`` random samples, held-out ``prompts // 4``),
    for unit tests without a verifier; it consumes neither the verifier nor the tokenizer. The head
    (``onnx_head`` + ``quantized_head``, ranges at ``head_qat.input_range_percentile``, integers via
    `weights_from_arrays`) is refused until its graph and calibration captures land. ``seed``: the prompt order
    (toy corpus), runner-up tokens and accepted-length offsets, or the synthetic samples' RNG.
    """

    version = 5  # v3: the graph also emits its top-k candidates (passes/topk_outputs.py); v4: calibration_answers;
    # v5: every Softmax output encoded [0, 1]
    section = "slm_calibration"

    def __init__(
        self, kind_in: str = "onnx_slm", kind_out: str = "qdq_slm", *, seed: int = 0, calibration: str = "real"
    ):
        from hycoc.passes.artifacts import (
            KeepSetArtifact,
            OnnxArtifact,
            SlmIntegerArtifact,
            TokenizerArtifact,
            TorchModelArtifact,
        )

        if kind_in != "onnx_slm":
            raise ValueError(
                f"QdqQuantize({kind_in!r}): only 'onnx_slm' is wired; the head's QDQ pass needs its "
                f"calibration captures (passes/head_qat.py) and is not done yet"
            )
        if calibration not in ("real", "synthetic"):
            raise ValueError(f"QdqQuantize(calibration={calibration!r}): choose 'real' or 'synthetic'")
        self.name = f"qdq_{kind_in.removeprefix('onnx_')}"
        self.kind_out, self.seed, self.calibration = kind_out, seed, calibration
        self.consumes = {kind_in: OnnxArtifact, "slm_integer": SlmIntegerArtifact, "keep_set": KeepSetArtifact}
        self.also_reads = ("window", "tree")
        if calibration == "real":
            from hycoc.passes.calibration_answers import CalibrationAnswersArtifact

            self.consumes |= {
                "torch_verifier": TorchModelArtifact,
                "tokenizer": TokenizerArtifact,
                "calibration_answers": CalibrationAnswersArtifact,
            }
            self.also_reads = ("window", "tree", "head_qat")
        self.produces = {kind_out: OnnxArtifact}

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        # real calibration: the prompts and answers arrive as the calibration_answers artifact (hash in the key)
        return {"seed": self.seed, "kind_out": self.kind_out, "calibration": self.calibration}

    def _samples(self, graph, slm, keep, inputs, recipe):
        cal = recipe.slm_calibration
        if self.calibration == "synthetic":
            return (
                slm_calibration_samples(graph, slm, cal.prompts, self.seed),
                slm_calibration_samples(graph, slm, max(2, cal.prompts // 4), self.seed + 1),
                {"source": "synthetic (random trees, tokens and rings)"},
            )
        from hycoc.passes.slm_calibration import real_calibration

        real, held, numbers = real_calibration(
            graph,
            slm,
            keep,
            inputs["torch_verifier"].payload,
            inputs["tokenizer"].payload,
            recipe,
            self.seed,
            answers=inputs["calibration_answers"].payload,
        )
        if not real.samples or not held.samples:
            raise CalibrationError("the calibration prompts gave no SLM graph calls to calibrate on")
        return real.samples, held.samples, numbers

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Any], PassReport]:
        import onnx
        import onnx_ir as ir
        from hycoc.passes.artifacts import OnnxArtifact
        from hycoc.passes.slm_graph import FULL, SLIDING, SlmTreeGraph
        from hycoc.passes.topk_outputs import append_topk

        cal = recipe.slm_calibration
        if cal.activation_bits != 16:
            raise QdqError(
                f"slm_calibration.activation_bits = {cal.activation_bits}: only 16-bit (A16) activations "
                f"are implemented"
            )
        slm = inputs["slm_integer"].payload
        keep = inputs["keep_set"].payload
        ring = {FULL: recipe.window.slm_window, SLIDING: recipe.window.slm_sliding_window}
        graph = SlmTreeGraph(slm, keep, rows=recipe.tree.node_budget, ring=ring)
        samples, held_out, source = self._samples(graph, slm, keep, inputs, recipe)
        with tempfile.TemporaryDirectory(prefix="hycoc-qdq-") as tmp:
            src = Path(tmp) / "float" / "model.onnx"
            src.parent.mkdir()
            ir.save(inputs["onnx_slm"].payload, src, external_data="model.onnx.data")
            result = quantize_graph(
                src, samples, Path(tmp) / "qdq", percentile=cal.percentile, range_scale=cal.range_scale
            )
            # held-out inputs (other prompts): the calibration inputs flatter the ranges
            fmodel = onnx.load(str(result.float_path), load_external_data=False)
            held = sqnr_report(result.float_path, result.path, held_out, layers=layer_outputs(fmodel))
            qmodel = append_topk(onnx.load(str(result.path)), recipe.tree.slm_candidates, with_logq=True)
            model = ir.serde.deserialize_model(qmodel)  # weights read into memory
        numbers = result.numbers() | {
            "top_k_outputs": recipe.tree.slm_candidates,
            "samples": len(samples),
            "percentile": cal.percentile,
            "range_scale": cal.range_scale,
            "kv_bits_on_wire": cal.kv_bits,
            "calibration_inputs": source,
            "sqnr_held_out": held,
        }
        s = result.sqnr
        worst = min(s["layers"].values()) if s["layers"] else float("nan")
        fills = source.get("calibration", {}).get("coverage", {})
        fill = f"; ring fills {fills['min']}-{fills['max']} of {fills['ring']} columns" if "min" in fills else ""
        summary = (
            f"A16 W{'/'.join(numbers['weight_bits'])} QDQ: {numbers['quantize_linear']} Q / "
            f"{numbers['dequantize_linear']} DQ, {len(result.weights)} weights bit-exact; SQNR logits "
            f"{s['outputs']['logits']:.1f} dB, worst layer {worst:.1f} dB, top-1 {s['top1_agreement']:.1%} "
            f"on {len(samples)} {self.calibration} calibration samples{fill} (held-out: logits "
            f"{held['outputs']['logits']:.1f} dB, top-1 {held['top1_agreement']:.1%})"
        )
        return {self.kind_out: OnnxArtifact(self.kind_out, model)}, PassReport(summary, numbers)
