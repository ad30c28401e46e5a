"""Reciprocal rule (passes/rewrite/reciprocal_to_div.py): graphs that must match (a Reciprocal inside the graph and
one that is a graph output), one that must not (float16), the Div written as the ModelProto loop wrote it (the
Reciprocal's node and output names, ``<output>_one`` = 1.0 float32, no metadata), and onnxruntime before and after
within 1 ulp."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
from hycoc.passes.rewrite.reciprocal_to_div import reciprocal_to_div, rule
from onnxscript.rewriter import pattern

RNG = np.random.default_rng(0)


def rms_like() -> ir.Model:
    """x * Reciprocal(Sqrt(mean(x²) + eps)), the RMSNorm rule's output, and a second Reciprocal as graph output."""
    model = ir.from_onnx_text(
        """
        < ir_version: 10, opset_import: ["" : 20] >
        g (float[2, 8] x) => (float[2, 8] y, float[2, 8] r)
        <float eps = {1e-6}, int64[1] axes = {-1}>
        {
            sq = Mul(x, x)
            mean = ReduceMean<keepdims=1>(sq, axes)
            var = Add(mean, eps)
            rms = Sqrt(var)
            inv = Reciprocal(rms)
            y = Mul(x, inv)
            r = Reciprocal(x)
        }
        """
    )
    for i, node in enumerate(model.graph):
        node.name = f"n{i}"
    model.graph.node(4).metadata_props["pkg.torch.onnx.name_scopes"] = "['', 'norm']"
    return model


def run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def test_every_reciprocal_becomes_div_one_and_keeps_the_numbers():
    model = rms_like()
    x = (RNG.standard_normal((2, 8)) + 3.0).astype(np.float32)
    before = run(model, x)

    assert reciprocal_to_div(model) == 2

    divs = [n for n in model.graph if n.op_type == "Div"]
    assert "Reciprocal" not in [n.op_type for n in model.graph] and len(divs) == 2
    assert [(d.name, d.outputs[0].name) for d in divs] == [("n4", "inv"), ("n6", "r")]
    for div in divs:
        one = div.inputs[0]
        assert one.name == f"{div.outputs[0].name}_one" and one.is_initializer()
        assert one.const_value.numpy().dtype == np.float32 and one.const_value.numpy() == 1.0
        assert dict(div.metadata_props) == {}  # no rule tag, no copied torch metadata
    assert [o.name for o in model.graph.outputs] == ["y", "r"]
    for got, want in zip(run(model, x), before):  # onnxruntime's CPU Reciprocal is not always correctly rounded
        np.testing.assert_array_max_ulp(got, want, maxulp=1)


def test_a_rewritten_graph_is_not_rewritten_again():
    model = rms_like()
    reciprocal_to_div(model)
    assert reciprocal_to_div(model) == 0


def test_a_float16_reciprocal_is_left_and_says_why():
    model = ir.from_onnx_text(
        """
        < ir_version: 10, opset_import: ["" : 20] >
        g (float16[4] x) => (float16[4] y)
        {
            y = Reciprocal(x)
        }
        """
    )
    tracer = pattern.MatchingTracer()
    rule.apply_to_model(model, tracer=tracer)
    [info] = tracer.best_matches_map[rule]
    assert info.status == pattern.MatchStatus.CONDITION_FAILED
    assert info.match_result.reason == "x has dtype FLOAT16, not FLOAT: the constant 1 is float32"
    assert reciprocal_to_div(model) == 0 and [n.op_type for n in model.graph] == ["Reciprocal"]
