"""Build side of the bundle manifest: what a graph declares, read from its ONNX file, and the manifest sections
taken from the recipe and the target profile (docs/design.md "Bundle"; the format is ``hycoc/bundle.py``).

`graph_io_from_onnx` reads, without loading weights:

- each graph input and output: name, static shape (a symbolic or missing dim is an error: the device graphs are
  static), numpy dtype name;
- for QDQ graphs, the encoding of each graph input and output from the Q/DQ node next to it: a float input's
  consumer ``QuantizeLinear``, an integer input's consumer ``DequantizeLinear``, a float output's producer
  ``DequantizeLinear``, an integer output's producer ``QuantizeLinear``. Scale and zero point must be per-tensor
  (scalars): the runtime quantizes graph IO with one scale. ``bits`` comes from the zero point's dtype (the ONNX
  default uint8 when it is absent, or ``output_dtype`` of a QuantizeLinear);
- the weight bit map: ``DequantizeLinear`` nodes whose input is an initializer, counted per integer dtype
  (tensors and elements);
- op-type counts of the top-level graph.

For an htp target the bundle's graph is the EPContext model (one ``EPContext`` node); pass the QDQ model it was
compiled from as ``qdq_source`` to take encodings, bit map and op counts from it while names, shapes and dtypes come
from the EPContext model (names must agree).
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

from hycoc.bundle import (
    Encoding,
    GraphIO,
    HandoffInfo,
    HubInfo,
    Quantization,
    RecipeRef,
    RoundConstants,
    TargetInfo,
    TensorSpec,
    WeightCount,
)
from hycoc.recipe import Recipe

_BITS = {"int4": 4, "uint4": 4, "int8": 8, "uint8": 8, "int16": 16, "uint16": 16, "int32": 32, "uint32": 32}


def _dtype_name(elem_type: int) -> str:
    if elem_type == onnx.TensorProto.INT4:
        return "int4"
    if elem_type == onnx.TensorProto.UINT4:
        return "uint4"
    return str(np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem_type)))


class _Graph:
    """Index of one ONNX graph: initializers and Constant outputs, consumers and producers by value name."""

    def __init__(self, model: onnx.ModelProto, base_dir: Path):
        self.model, self.base_dir = model, base_dir
        g = model.graph
        self.init = {t.name: t for t in g.initializer}
        self.const = {
            n.output[0]: n.attribute[0].t
            for n in g.node
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"
        }
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        for n in g.node:
            for i in n.input:
                self.consumers.setdefault(i, []).append(n)
            for o in n.output:
                self.producer[o] = n

    def tensor(self, name: str) -> onnx.TensorProto | None:
        return self.init.get(name) or self.const.get(name)

    def array(self, t: onnx.TensorProto) -> np.ndarray:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            t = onnx.TensorProto.FromString(t.SerializeToString())
            onnx.external_data_helper.load_external_data_for_tensor(t, str(self.base_dir))
        return numpy_helper.to_array(t)

    def encoding(self, node: onnx.NodeProto, value: str) -> Encoding:
        """Per-tensor encoding of a QuantizeLinear / DequantizeLinear node (``value``: the graph IO, for errors)."""
        scale_t = self.tensor(node.input[1])
        if scale_t is None:
            raise ValueError(f"{value}: the scale of {node.op_type} {node.name!r} is not a constant")
        scale = self.array(scale_t)
        zp_t = self.tensor(node.input[2]) if len(node.input) > 2 and node.input[2] else None
        if len(node.input) > 2 and node.input[2] and zp_t is None:
            raise ValueError(f"{value}: the zero point of {node.op_type} {node.name!r} is not a constant")
        if zp_t is not None:
            dtype, zp = _dtype_name(zp_t.data_type), self.array(zp_t)
        else:
            out_dtype = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
            dtype, zp = (_dtype_name(out_dtype) if out_dtype else "uint8"), np.zeros((), np.int64)
        if scale.size != 1 or zp.size != 1:
            raise ValueError(
                f"{value}: {node.op_type} {node.name!r} is per-axis (scale shape {list(scale.shape)}); "
                "graph inputs and outputs need one scale"
            )
        return Encoding(scale=float(scale.reshape(())), zero_point=int(zp.reshape(())), dtype=dtype, bits=_BITS[dtype])


def _spec(v: onnx.ValueInfoProto, where: str) -> tuple[str, list[int], str]:
    t = v.type.tensor_type
    dims = []
    for i, d in enumerate(t.shape.dim):
        if not d.HasField("dim_value"):
            raise ValueError(
                f"{where}: {v.name} has a dynamic dim {i} ({d.dim_param or '?'}); the bundle needs static shapes"
            )
        dims.append(d.dim_value)
    return v.name, dims, _dtype_name(t.elem_type)


def _load(path: str | os.PathLike) -> tuple[onnx.ModelProto, _Graph]:
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    return model, _Graph(model, path.parent)


def graph_io_from_onnx(path: str | os.PathLike, *, qdq_source: str | os.PathLike | None = None) -> GraphIO:
    """Inputs, outputs (with encodings), weight bit map and op counts of the ONNX model at ``path``.

    ``qdq_source``: the QDQ model an EPContext model at ``path`` was compiled from (see the module docstring).
    Raises ValueError on a dynamic dim, a per-axis IO encoding, or IO names that differ from ``qdq_source``'s.
    """
    model, _ = _load(path)
    src_model, g = _load(qdq_source) if qdq_source is not None else (model, _)
    where = Path(path).name

    def encode(name: str, is_input: bool) -> Encoding | None:
        if is_input:
            node = next(
                (
                    n
                    for n in g.consumers.get(name, [])
                    if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.input[0] == name
                ),
                None,
            )
        else:
            node = g.producer.get(name)
            node = node if node is not None and node.op_type in ("QuantizeLinear", "DequantizeLinear") else None
        return None if node is None else g.encoding(node, name)

    sides = []
    for is_input, values, src_values in (
        (True, model.graph.input, src_model.graph.input),
        (False, model.graph.output, src_model.graph.output),
    ):
        values = [v for v in values if v.name not in g.init]  # old IR: initializers listed as inputs
        src_names = [v.name for v in src_values if v.name not in g.init]
        if [v.name for v in values] != src_names:
            kind = "inputs" if is_input else "outputs"
            source = qdq_source if qdq_source is not None else path  # given: a graph's own names match
            raise ValueError(
                f"{where}: {kind} {[v.name for v in values]} differ from {Path(source).name}'s {src_names}"
            )
        specs = []
        for v in values:
            name, shape, dtype = _spec(v, where)
            specs.append(TensorSpec(name=name, shape=shape, dtype=dtype, encoding=encode(name, is_input)))
        sides.append(specs)

    weights: dict[str, list[int]] = {}
    for n in src_model.graph.node:
        t = g.init.get(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if t is not None:
            count = weights.setdefault(_dtype_name(t.data_type), [0, 0])
            count[0] += 1
            count[1] += int(np.prod(t.dims, dtype=np.int64))
    return GraphIO(
        inputs=sides[0],
        outputs=sides[1],
        weight_bits={k: WeightCount(tensors=a, elements=b) for k, (a, b) in sorted(weights.items())},
        op_counts=dict(sorted(Counter(n.op_type for n in src_model.graph.node).items())),
    )


# ---- manifest sections from the recipe and the target -------------------------------------------------------


def recipe_ref(recipe: Recipe) -> RecipeRef:
    return RecipeRef(name=recipe.recipe.name, sha256=recipe.content_hash())


def round_constants(recipe: Recipe) -> RoundConstants:
    """The recipe's tree, window, acceptance and sampling knobs the runtime needs each round
    (`hycoc.bundle.RoundConstants.from_recipe`: every field from the recipe key it is derived from)."""
    return RoundConstants.from_recipe(recipe)


def quantization(recipe: Recipe) -> Quantization:
    return Quantization(
        head_weight_bits=recipe.head_qat.weight_bits,
        slm_activation_bits=recipe.slm_calibration.activation_bits,
        kv_bits=recipe.slm_calibration.kv_bits,
    )


def handoff_info(recipe: Recipe) -> HandoffInfo:
    """The hand-off section; raises RecipeError naming every unset ``handoff.scale_*``."""
    scales = recipe.handoff.scales()
    return HandoffInfo(
        bits=recipe.handoff.bits, hidden=recipe.handoff.hidden, **{f"scale_{k}": float(v) for k, v in scales.items()}
    )


def target_info(
    profile, versions: dict[str, str | None] | None = None, qnn_sdk: str | None = None, hub: dict | None = None
) -> TargetInfo:
    """The target section from a ``TargetProfile``; ``versions`` as ``hycoc.targets.qnn_ep.versions()`` returns
    them (read here when None); ``qnn_sdk``: the SDK the context binaries say (``CompiledGraph.qnn_sdk``), which
    wins over the installed one; ``hub``: the AI Hub section of a qai-hub build (`hycoc.bundle.HubInfo` fields)."""
    if versions is None:
        from hycoc.targets.qnn_ep import versions as installed

        versions = installed()
    htp = profile.backend == "htp"
    return TargetInfo(
        name=profile.name,
        backend=profile.backend,
        htp_arch=profile.htp_arch,
        soc_model=profile.soc_model,
        soc_id=profile.soc_id,
        onnxruntime=versions.get("onnxruntime"),
        onnxruntime_qnn=versions.get("onnxruntime-qnn") if htp else None,
        qnn_sdk=(qnn_sdk or versions.get("qnn_sdk")) if htp else None,
        hub=HubInfo(**hub) if hub else None,
    )


def manifest_sections(
    recipe: Recipe,
    profile,
    *,
    keep_set_size: int,
    versions: dict[str, str | None] | None = None,
    qnn_sdk: str | None = None,
    hub: dict | None = None,
) -> dict:
    """Keyword arguments of ``BundleWriter.commit`` for ``recipe`` on ``profile`` (``hub``: see `target_info`)."""
    return dict(
        recipe=recipe_ref(recipe),
        target=target_info(profile, versions, qnn_sdk, hub),
        round=round_constants(recipe),
        quantization=quantization(recipe),
        keep_set_size=keep_set_size,
        handoff=handoff_info(recipe),
    )
