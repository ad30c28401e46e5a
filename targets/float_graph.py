"""Small float ONNX models built node by node (benchmarks/htp_graph_io.py, tests), at the opset and IR version the
compiler exports: opset 21 (16-bit Q/DQ for the HTP needs >= 21, passes/export.py's OPSET) and IR version 10.
onnx is imported inside the function."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

#: ONNX default-domain opset of the models `float_model` builds.
OPSET = 21
#: ONNX IR version of the models `float_model` builds (what onnxruntime's QNN EP reads).
IR_VERSION = 10


def float_model(
    nodes: Sequence[Any],
    name: str,
    x: tuple[str, Sequence[int]],
    y: tuple[str, Sequence[int]],
    initializers: Sequence[Any] = (),
) -> Any:
    """An ``onnx.ModelProto`` (opset `OPSET`, IR `IR_VERSION`) of one float32 input and one float32 output, each
    given as (name, shape); ``nodes`` (``onnx.NodeProto``, in topological order) and ``initializers``
    (``onnx.TensorProto``) make the graph ``name``. Not checked: run ``onnx.checker`` where it matters."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        list(nodes),
        name,
        [helper.make_tensor_value_info(x[0], TensorProto.FLOAT, list(x[1]))],
        [helper.make_tensor_value_info(y[0], TensorProto.FLOAT, list(y[1]))],
        list(initializers),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = IR_VERSION
    return model


__all__ = ["IR_VERSION", "OPSET", "float_model"]
