"""The smallest graph the HTP compiles without CPU fallback: y = x @ W in QDQ form, activations uint16, the weight
8-bit. `hycoc doctor`'s compile probe (``targets/_qnn_worker.py``) compiles it for each arch; tests compile it where
they need a context binary and no model.

    x (rows, n) float -> QuantizeLinear / DequantizeLinear (x_scale, x_zero: uint16) -> MatMul with
    DequantizeLinear(W (n, m) int8 or uint8, w_scale, w_zero) -> QuantizeLinear / DequantizeLinear (the same uint16
    scale and zero point) -> y (rows, m) float

Opset 21, IR version 10 (what onnxruntime-qnn 2.x loads). onnx is imported when called (the `full` extra).
"""

from __future__ import annotations


def qdq_matmul(
    w,
    rows: int,
    name: str,
    *,
    w_scale: float,
    w_zero: int = 0,
    x_scale: float = 1 / 32768,
    x_zero: int = 32768,
    node_names: bool = False,
):
    """The graph above as an ``onnx.ModelProto`` named ``name``: w is the weight (a numpy int8 or uint8 (n, m)
    array, its zero point ``w_zero`` of the same dtype), x has ``rows`` rows. node_names: name the six nodes x_q,
    x_dq, w_dq, matmul, y_q, y_dq (unnamed otherwise)."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.array(x_scale, np.float32), "s"),
        helper.make_tensor("z", TensorProto.UINT16, [], [x_zero]),
        numpy_helper.from_array(w, "w"),
        numpy_helper.from_array(np.array(w_scale, np.float32), "ws"),
        numpy_helper.from_array(np.array(w_zero, w.dtype), "wz"),
    ]
    steps = [
        ("x_q", "QuantizeLinear", ["x", "s", "z"], "xq"),
        ("x_dq", "DequantizeLinear", ["xq", "s", "z"], "xd"),
        ("w_dq", "DequantizeLinear", ["w", "ws", "wz"], "wd"),
        ("matmul", "MatMul", ["xd", "wd"], "y0"),
        ("y_q", "QuantizeLinear", ["y0", "s", "z"], "yq"),
        ("y_dq", "DequantizeLinear", ["yq", "s", "z"], "y"),
    ]
    nodes = [helper.make_node(op, inputs, [out], name=node if node_names else None) for node, op, inputs, out in steps]
    n, m = w.shape
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, n])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, m])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    return model
