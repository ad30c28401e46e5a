"""RMSNorm rule (passes/rewrite/rms_norm.py) and its driver (passes/rmsnorm_decomposition.py): graphs that must
match (rank 3 and 4, a per-head q/k norm whose head dim is not hidden/heads, the opset-23 op, Gemma's folded
scale), graphs that must not (a LayerNorm, a non-constant eps, a reduction over another axis), onnxruntime before
and after within 1e-5, and a real transformers ``Gemma4RMSNorm`` exported with torch's dynamo exporter."""

from __future__ import annotations

import io

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hycoc.passes.artifacts import OnnxArtifact
from hycoc.passes.pipeline import Pipeline
from hycoc.passes.rmsnorm_decomposition import (
    RmsNormDecomposition,
    RmsNormDecompositionError,
    RmsNormDecompositionPass,
    explain,
)
from onnx import TensorProto, helper, numpy_helper
from rich.console import Console

from hycoc.recipe import Recipe

EPS = 1e-6
RNG = np.random.default_rng(0)


class Graph:
    """A few lines of onnx.helper per test graph: ``op`` returns the output name, ``const`` an initializer."""

    def __init__(self):
        self.nodes, self.inits, self.inputs = [], [], []

    def input(self, name, shape):
        self.inputs.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, shape))
        return name

    def const(self, array):
        name = f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(array), name))
        return name

    def op(self, op_type, *inputs, **attrs):
        out = f"{op_type.lower()}{len(self.nodes)}"
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def model(self, output, opset=20) -> ir.Model:
        graph = helper.make_graph(
            self.nodes, "g", self.inputs, [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)], self.inits
        )
        proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
        return ir.from_proto(proto)

    def mean_square(self, x, axes=(-1,), opset=20):
        square = self.op("Pow", x, self.const(np.float32(2.0)))
        if opset >= 18:
            return self.op("ReduceMean", square, self.const(np.array(axes, dtype=np.int64)), keepdims=1)
        return self.op("ReduceMean", square, axes=list(axes), keepdims=1)


def weight(dim):
    return RNG.standard_normal(dim).astype(np.float32)


def run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


# ---- graphs that must match ---------------------------------------------------------------------------------


def reciprocal_rank3():
    """Sqrt -> Reciprocal -> Mul x, scale on the right: the onnxscript fusion's form."""
    g = Graph()
    x = g.input("x", [2, 5, 32])
    var = g.op("Add", g.mean_square(x), g.const(np.float32(EPS)))
    normed = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", var)))
    return g.model(g.op("Mul", normed, g.const(weight(32)))), {"x": [2, 5, 32]}


def div_one_plus_w_rank3():
    """Div(x, Sqrt), eps and scale on the left, scale written as 1 + w (Gemma 2/3's convention)."""
    g = Graph()
    x = g.input("x", [1, 7, 24])
    var = g.op("Add", g.const(np.float32(EPS)), g.mean_square(x))
    normed = g.op("Div", x, g.op("Sqrt", var))
    scale = g.op("Add", g.const(np.float32(1.0)), g.const(weight(24)))
    return g.model(g.op("Mul", scale, normed)), {"x": [1, 7, 24]}


def per_head_rank4():
    """A q-norm after the head split: hidden 48, 4 heads of head_dim 16 (not 48 / 4 = 12); Gemma 4's Pow(-0.5)."""
    g = Graph()
    x = g.input("x", [1, 5, 48])
    q = g.op(
        "Reshape",
        g.op("MatMul", x, g.const(RNG.standard_normal((48, 64)).astype(np.float32))),
        g.const(np.array([1, 5, 4, 16], dtype=np.int64)),
    )
    var = g.op("Add", g.mean_square(q), g.const(np.float32(EPS)))
    normed = g.op("Mul", q, g.op("Pow", var, g.const(np.float32(-0.5))))
    return g.model(g.op("Mul", normed, g.const(weight(16)))), {"x": [1, 5, 48]}


def per_head_rank4_dynamic():
    """The same norm on [batch, seq, 4, 16] with symbolic batch and seq: the shape back comes from Shape(x)."""
    g = Graph()
    q = g.input("q", ["batch", "seq", 4, 16])
    var = g.op("Add", g.mean_square(q), g.const(np.float32(EPS)))
    normed = g.op("Mul", g.op("Pow", var, g.const(np.float32(-0.5))), q)
    return g.model(g.op("Mul", g.const(weight(16)), normed)), {"q": [2, 3, 4, 16]}


def rms_op_rank4():
    """The ONNX RMSNormalization op (opset 23) on a rank-4 input."""
    g = Graph()
    x = g.input("x", [1, 4, 5, 16])
    return g.model(g.op("RMSNormalization", x, g.const(weight(16)), axis=-1, epsilon=1e-5), opset=23), {
        "x": [1, 4, 5, 16]
    }


def div_one_unscaled_opset17():
    """Div(1, Sqrt) -> Mul, no scale (with_scale=False), ReduceMean with axes as an attribute (opset < 18)."""
    g = Graph()
    x = g.input("x", [3, 8])
    var = g.op("Add", g.mean_square(x, opset=17), g.const(np.float32(EPS)))
    normed = g.op("Mul", g.op("Div", g.const(np.float32(1.0)), g.op("Sqrt", var)), x)
    return g.model(normed, opset=17), {"x": [3, 8]}


def scale_from_an_input():
    """A scale that is a graph input: the scaled rule refuses it, the unscaled one rewrites the norm."""
    g = Graph()
    x = g.input("x", [2, 3, 8])
    s = g.input("s", [8])
    var = g.op("Add", g.mean_square(x), g.const(np.float32(EPS)))
    normed = g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", var)))
    return g.model(g.op("Mul", normed, s)), {"x": [2, 3, 8], "s": [8]}


MATCHING = {
    "reciprocal_rank3": (reciprocal_rank3, ["RmsNormReciprocalScaled"], [False]),
    "div_one_plus_w_rank3": (div_one_plus_w_rank3, ["RmsNormDivScaled"], [False]),
    "per_head_rank4": (per_head_rank4, ["RmsNormPowScaled"], [True]),
    "per_head_rank4_dynamic": (per_head_rank4_dynamic, ["RmsNormPowScaled"], [True]),
    "rms_op_rank4": (rms_op_rank4, ["RmsNormOp"], [True]),
    "div_one_unscaled_opset17": (div_one_unscaled_opset17, ["RmsNormDivOne"], [False]),
    "scale_from_an_input": (scale_from_an_input, ["RmsNormReciprocal"], [False]),
}


@pytest.mark.parametrize("case", MATCHING)
def test_matches_and_keeps_the_numbers(case):
    build, rules, reshaped = MATCHING[case]
    model, shapes = build()
    feeds = {name: RNG.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    before = run(model, feeds)

    ir_pass = RmsNormDecompositionPass()
    ir_pass(model)

    assert [r["rule"] for r in ir_pass.rewritten] == rules
    assert [r["reshaped"] for r in ir_pass.rewritten] == reshaped
    assert ir_pass.rewritten[0]["eps"] == pytest.approx(1e-5 if case == "rms_op_rank4" else EPS)
    ops = op_types(model)
    assert not {"Pow", "Div", "RMSNormalization"} & set(ops)
    assert {"Mul", "ReduceMean", "Add", "Sqrt", "Reciprocal"} <= set(ops)
    to_rank3 = [
        n
        for n in model.graph
        if n.op_type == "Reshape"
        and n.inputs[1].const_value is not None
        and n.inputs[1].const_value.numpy().tolist() == [0, -1, 16]
    ]
    assert len(to_rank3) == int(reshaped[0])
    assert ("Shape" in ops) == (case == "per_head_rank4_dynamic")
    after = run(model, feeds)
    assert after.shape == before.shape
    assert np.abs(after - before).max() < 1e-5


def test_a_scale_from_an_input_is_refused_by_the_scaled_rule():
    model, _ = scale_from_an_input()
    assert "RmsNormReciprocalScaled at node 'mul6': scale is not an initializer or constant" in explain(model)


def test_rewritten_graph_is_not_rewritten_again():
    model, _ = per_head_rank4()
    RmsNormDecompositionPass()(model)
    ops = op_types(model)
    again = RmsNormDecompositionPass(require_match=False)
    again(model)
    assert again.rewritten == [] and op_types(model) == ops
    with pytest.raises(RmsNormDecompositionError, match="required but matched nothing"):
        RmsNormDecompositionPass()(model)


# ---- graphs that must not match -----------------------------------------------------------------------------


def layer_norm():
    """LayerNorm decomposed: the variance of the mean-centred input."""
    g = Graph()
    x = g.input("x", [2, 5, 32])
    centred = g.op("Sub", x, g.op("ReduceMean", x, g.const(np.array([-1], dtype=np.int64)), keepdims=1))
    var = g.op("Add", g.mean_square(centred), g.const(np.float32(EPS)))
    return g.model(g.op("Mul", g.op("Div", centred, g.op("Sqrt", var)), g.const(weight(32))))


def eps_from_an_input():
    g = Graph()
    x = g.input("x", [2, 5, 32])
    var = g.op("Add", g.mean_square(x), g.input("eps", []))
    return g.model(g.op("Mul", g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", var))), g.const(weight(32))))


def mean_over_axis_1():
    g = Graph()
    x = g.input("x", [2, 5, 32])
    var = g.op("Add", g.mean_square(x, axes=(1,)), g.const(np.float32(EPS)))
    return g.model(g.op("Mul", g.op("Mul", x, g.op("Reciprocal", g.op("Sqrt", var))), g.const(weight(32))))


NOT_MATCHING = {
    "layer_norm": (layer_norm, "x is mean-centred (x = a - mean(a)): a LayerNorm, not an RMSNorm"),
    "eps_from_an_input": (eps_from_an_input, "eps is not a constant float scalar"),
    "mean_over_axis_1": (mean_over_axis_1, "ReduceMean reduces axes [1], not the last axis only"),
}


@pytest.mark.parametrize("case", NOT_MATCHING)
def test_does_not_match_and_says_why(case):
    build, reason = NOT_MATCHING[case]
    model = build()
    ops = op_types(model)
    assert any(line.endswith(reason) for line in explain(model))

    optional = RmsNormDecompositionPass(require_match=False)
    optional(model)
    assert optional.rewritten == [] and op_types(model) == ops
    with pytest.raises(
        RmsNormDecompositionError,
        match=r"required but matched nothing in the graph: .*"
        + reason.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[").replace("]", r"\]"),
    ):
        RmsNormDecompositionPass()(model)
    assert op_types(model) == ops


def test_an_rms_op_it_cannot_rewrite_is_an_error():
    g = Graph()
    x = g.input("x", [1, 4, 5, 16])
    model = g.model(g.op("RMSNormalization", x, g.const(weight(5 * 16)), axis=2), opset=23)
    with pytest.raises(
        RmsNormDecompositionError,
        match=r"1 RMSNormalization op\(s\) left in the graph "
        r"\(rmsnormalization0\): .*normalizes axes 2..3",
    ):
        RmsNormDecompositionPass(require_match=False)(model)


# ---- a real Gemma 4 norm, exported ---------------------------------------------------------------------------


def test_exported_gemma4_rms_norms():
    torch = pytest.importorskip("torch")
    from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

    class Norms(torch.nn.Module):
        """Gemma 4 attention's norms: input norm (rank 3), per-head q norm with a scale and v norm without one
        (rank 4; hidden 48, 4 heads of head_dim 16)."""

        def __init__(self):
            super().__init__()
            self.input_norm = Gemma4RMSNorm(48, eps=1e-6)
            self.q_proj = torch.nn.Linear(48, 64, bias=False)
            self.q_norm = Gemma4RMSNorm(16, eps=1e-6)
            self.v_norm = Gemma4RMSNorm(16, eps=1e-6, with_scale=False)

        def forward(self, x):  # x: [1, 5, 48]
            q = self.q_proj(self.input_norm(x)).view(1, 5, 4, 16)
            return self.v_norm(self.q_norm(q))

    torch.manual_seed(0)
    module = Norms().eval()
    with torch.no_grad():
        for norm in (module.input_norm, module.q_norm):
            norm.weight.copy_(torch.randn_like(norm.weight))
    x = torch.randn(1, 5, 48)
    model = torch.onnx.export(module, (x,), dynamo=True, verbose=False).model

    ir_pass = RmsNormDecompositionPass()
    ir_pass(model)
    assert sorted((r["rule"], r["rank"], r["reshaped"]) for r in ir_pass.rewritten) == [
        ("RmsNormPow", 4, True),
        ("RmsNormPowScaled", 3, False),
        ("RmsNormPowScaled", 4, True),
    ]
    assert "Pow" not in op_types(model)
    with torch.no_grad():
        expected = module(x).numpy()
    assert np.abs(run(model, {model.graph.inputs[0].name: x.numpy()}) - expected).max() < 1e-5


def test_pipeline_pass_reports_and_caches(tmp_path):
    model, shapes = per_head_rank4()
    feeds = {"x": RNG.standard_normal(shapes["x"]).astype(np.float32)}
    before = run(model, feeds)
    step = RmsNormDecomposition("onnx_head")
    pipe = Pipeline([step], tmp_path, console=Console(file=io.StringIO()))
    given = {"onnx_head": OnnxArtifact("onnx_head", model)}

    result = pipe.run(Recipe(), given)
    assert step.name == "rmsnorm_decomposition_head"
    assert result.reports[0].summary == "rewrote 1 RMSNorms (1 reshaped from rank 4 to rank 3), eps 1e-06"
    assert result.reports[0].numbers["by_rule"] == {"RmsNormPowScaled": 1}
    assert "Pow" in op_types(model)  # the input artifact is left as it was

    again = pipe.run(Recipe(), given)
    assert again.reports[0].cached
    assert again.artifacts["onnx_head"].content_hash() == result.artifacts["onnx_head"].content_hash()
    saved = again.reports[0].location / "onnx_head" / OnnxArtifact.MODEL_FILE  # weights in model.onnx.data
    session = ort.InferenceSession(str(saved), providers=["CPUExecutionProvider"])
    assert np.abs(session.run(None, feeds)[0] - before).max() < 1e-5
