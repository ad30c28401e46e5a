"""What an HTP graph may hold, checked before the QNN EP sees it (`hycoc.targets.htp.compile_shared`, steps 1-3 of
its module docstring): static input shapes and the profile's capabilities (`check_capabilities`: 16-bit ops, 4-bit
weights, op types; a `CapabilityError` is a compile-time refusal, never a silent precision change), and the
patterns hycoc keeps on the host (`find_host_only_nodes`: embedding lookups, `HostOnlyError`). The base of the HTP
target's errors (`HtpTargetError`) and the node list they carry (`NodeIssue`, `PlacementError`) live here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

from hycoc.targets.profiles import TargetProfile

#: ONNX's quantize / dequantize ops: not counted as unsupported op types, listed after the nodes they sit next to.
QDQ_OPS = {"QuantizeLinear", "DequantizeLinear"}


class HtpTargetError(RuntimeError):
    """Base of the HTP target's errors."""


class CapabilityError(HtpTargetError):
    """The graph needs something the target profile cannot do (16-bit ops, int4, an op type, dynamic shapes)."""


@dataclass(frozen=True)
class NodeIssue:
    """One node that would not run on the HTP: its name, op type and why."""

    name: str
    op_type: str
    reason: str

    def __str__(self) -> str:
        return f"{self.name or '<unnamed>'} ({self.op_type}): {self.reason}"


class PlacementError(HtpTargetError):
    """Nodes that would not be placed on the HTP; ``.nodes`` lists them (:class:`NodeIssue`)."""

    def __init__(self, message: str, nodes: Sequence[NodeIssue]):
        self.nodes = list(nodes)
        lines = "\n".join(f"  - {n}" for n in self.nodes)
        super().__init__(f"{message}\n{lines}" if lines else message)


class HostOnlyError(PlacementError):
    """Nodes that hycoc keeps on the host by design (e.g. embedding lookups) found in a device graph."""


# --------------------------------------------------------------------------------------------- model inspection


def load_model(model_or_path):
    """An ``onnx.ModelProto`` as is, or the one at a path (without its external data)."""
    import onnx

    if isinstance(model_or_path, (str, os.PathLike)):
        return onnx.load(str(model_or_path), load_external_data=False)
    return model_or_path


def _is_16bit(elem_type: int) -> bool:
    import onnx

    return elem_type in (onnx.TensorProto.UINT16, onnx.TensorProto.INT16)


def check_capabilities(model, profile: TargetProfile) -> None:
    """Refuse, with :class:`CapabilityError`, a graph the profile cannot run: dynamic input shapes, 16-bit
    tensors on a profile without ``supports_16bit_ops`` (a Q/DQ with a uint16/int16 zero point or
    ``output_dtype``, a DequantizeLinear of a 16-bit constant without a zero point, 16-bit graph inputs,
    float16 initializers or Casts; constants from initializers or Constant nodes alike), 4-bit weights without
    ``supports_int4_weights``, op types outside ``supported_op_types``. The message names every 16-bit
    node or tensor (up to 8) and the fix."""
    import onnx

    model = load_model(model)
    g = model.graph
    dynamic = [
        i.name
        for i in g.input
        if any(not d.HasField("dim_value") or d.dim_value <= 0 for d in i.type.tensor_type.shape.dim)
    ]
    if dynamic:
        raise CapabilityError(
            f"{profile.name}: graph inputs with dynamic shapes: {', '.join(dynamic)} "
            f"(HTP graphs are static; export at fixed shapes)"
        )
    inits = {t.name: t for t in g.initializer}
    if not profile.supports_16bit_ops:
        # dtype of every constant: initializers and Constant nodes' value tensors
        const_type = {name: t.data_type for name, t in inits.items()}
        for n in g.node:
            if n.op_type == "Constant":
                for a in n.attribute:
                    if a.name == "value":
                        const_type[n.output[0]] = a.t.data_type
        fp16 = onnx.TensorProto.FLOAT16
        found = []
        for n in g.node:
            label = f"{n.name or n.output[0]} ({n.op_type})"
            if n.op_type in QDQ_OPS:
                zp16 = len(n.input) > 2 and _is_16bit(const_type.get(n.input[2], 0))
                out16 = any(a.name == "output_dtype" and _is_16bit(a.i) for a in n.attribute)
                x16 = n.op_type == "DequantizeLinear" and _is_16bit(const_type.get(n.input[0], 0))
                if zp16 or out16 or x16:
                    found.append(label)
            elif n.op_type == "Cast" and any(a.name == "to" and (_is_16bit(a.i) or a.i == fp16) for a in n.attribute):
                found.append(label)
        found += [
            f"{i.name} (graph input)"
            for i in g.input
            if _is_16bit(i.type.tensor_type.elem_type) or i.type.tensor_type.elem_type == fp16
        ]
        found += [f"{t.name} (float16 initializer)" for t in g.initializer if t.data_type == fp16]
        if found:
            more = f" and {len(found) - 8} more" if len(found) > 8 else ""
            raise CapabilityError(
                f"{profile.name} (HTP v{profile.htp_arch}) cannot run 16-bit ops, and this graph has {len(found)} "
                f"16-bit tensors or ops: {', '.join(found[:8])}{more}. Quantize activations to 8 bits for this "
                f"target, or compile for a profile with 16-bit support (e.g. htp-v81)."
            )
    if not profile.supports_int4_weights:
        int4 = [t.name for t in g.initializer if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4)]
        if int4:
            raise CapabilityError(f"{profile.name} cannot run 4-bit weights: {', '.join(int4[:8])}")
    if profile.supported_op_types is not None:
        bad = sorted({n.op_type for n in g.node if n.op_type not in profile.supported_op_types | QDQ_OPS})
        if bad:
            raise CapabilityError(f"{profile.name} does not list these op types as supported: {', '.join(bad)}")


_PASS_THROUGH = {"Cast", "Reshape", "Unsqueeze", "Squeeze", "Identity", "Flatten"}


def find_host_only_nodes(model, profile: TargetProfile) -> list[NodeIssue]:
    """Nodes matching the profile's ``host_only`` patterns. ``"embedding_lookup"``: a Gather whose data is a
    constant table (an initializer, or a DequantizeLinear of one) and whose indices come from an integer graph
    input (directly or through Cast/Reshape/(Un)Squeeze/Identity/Flatten)."""
    import onnx

    model = load_model(model)
    g = model.graph
    if "embedding_lookup" not in profile.host_only:
        return []
    inits = {t.name for t in g.initializer}
    producer = {o: n for n in g.node for o in n.output}
    int_types = {
        onnx.TensorProto.INT64,
        onnx.TensorProto.INT32,
        onnx.TensorProto.INT16,
        onnx.TensorProto.UINT16,
        onnx.TensorProto.INT8,
        onnx.TensorProto.UINT8,
        onnx.TensorProto.UINT32,
        onnx.TensorProto.UINT64,
    }
    int_inputs = {i.name for i in g.input if i.type.tensor_type.elem_type in int_types}

    def from_int_input(name: str, depth: int = 0) -> bool:
        if name in int_inputs:
            return True
        p = producer.get(name)
        return bool(p and depth < 8 and p.op_type in _PASS_THROUGH and from_int_input(p.input[0], depth + 1))

    def constant_table(name: str) -> bool:
        if name in inits:
            return True
        p = producer.get(name)
        return bool(p and p.op_type == "DequantizeLinear" and p.input[0] in inits)

    return [
        NodeIssue(
            n.name,
            n.op_type,
            "embedding lookup (constant table indexed by integer graph input "
            f"{n.input[1]!r}): hycoc keeps embeddings on the host as LUTs",
        )
        for n in g.node
        if n.op_type == "Gather" and constant_table(n.input[0]) and from_int_input(n.input[1])
    ]
