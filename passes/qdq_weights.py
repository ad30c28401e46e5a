"""The integer weights of hycoc's QDQ graphs, bit-exact (`hycoc.passes.qdq`, its module docstring steps 1 and 5):
`fold_integer_weights` turns the SLM graph's ``Cast(int8) -> Mul(scale)`` patterns into float initializers and
records the integers (`IntegerWeightSpec`), `weights_from_arrays` takes them as arrays (the head's QAT output),
`weight_overrides` gives onnxruntime each one's per-channel encoding, and `verify_weights` checks that the saved QDQ
graph holds the source integers, scales, zero point and axis exactly.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from hycoc.passes.qdq_encodings import QdqError, initializer_arrays


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


def _axis(node) -> int:
    return next((a.i for a in node.attribute if a.name == "axis"), 1)


def verify_weights(model, specs: Sequence[IntegerWeightSpec]) -> int:
    """Check that each spec's weight reaches the graph as DequantizeLinear(source integers, source scales, zero
    point 0, its channel axis), bit-exact. Returns how many were checked; raises QdqError naming the first that
    differs."""
    import onnx

    arrays = initializer_arrays(model)
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
