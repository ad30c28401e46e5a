"""The integer weights of hycoc's QDQ graphs, bit-exact (`hycoc.passes.qdq.quantize`, its module docstring steps 1 and
5): `fold_integer_weights` turns the SLM graph's ``Cast(int8) -> Mul(scale)`` patterns into float initializers and
records the integers (`IntegerWeightSpec`; the rewrite rule is `hycoc.passes.rewrite.integer_weights`),
`weights_from_arrays` takes them as arrays (the head's QAT output), `weight_overrides` gives onnxruntime each
one's per-channel encoding, and `verify_weights` checks that the saved QDQ graph holds the source integers, scales,
zero point and axis exactly. The first two read and change an onnx-ir model; `verify_weights` reads the
onnx.ModelProto onnxruntime's quantizer wrote.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx_ir as ir
from hycoc.passes.qdq.encodings import QdqError, initializer_arrays
from hycoc.passes.rewrite import integer_weights
from hycoc.passes.rewrite.integer_weights import FoldedWeight


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


def fold_integer_weights(model: ir.Model) -> list[IntegerWeightSpec]:
    """Replace each ``Cast(int8 init) -> Mul(scale init) [-> Transpose]`` of ``model`` by one float initializer (module
    docstring, step 1; the rule: `hycoc.passes.rewrite.integer_weights`), in place, then drop every initializer no
    node reads (the integers and scales folded away, and any other, as the ModelProto loop before it did). Returns
    the specs, in graph order."""
    folded: list[FoldedWeight] = []
    integer_weights.rules(folded).apply_to_model(model)
    graph = model.graph
    for name, value in list(graph.initializers.items()):
        if not value.uses() and not value.is_graph_output():
            graph.initializers.pop(name)
    return [IntegerWeightSpec(f.name, f.q, f.scale, f.axis, _bits_of(f.q)) for f in folded]


def weights_from_arrays(
    model: ir.Model, arrays: Mapping[str, tuple[np.ndarray, np.ndarray, int]]
) -> list[IntegerWeightSpec]:
    """Specs for float weight initializers of ``model`` given as (q int8 [out, in], scale float32 [out, 1] or [out],
    bits), by initializer name (the head's QAT output). The initializer must equal q * scale (axis 0) or its
    transpose (axis 1) bit for bit; QdqError otherwise."""
    inits = model.graph.initializers
    specs = []
    for name, (q, s, bits) in arrays.items():
        tensor = inits[name].const_value if name in inits else None
        if tensor is None:
            raise QdqError(f"no initializer '{name}' in the graph for the given integer weight")
        w = tensor.numpy()
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
