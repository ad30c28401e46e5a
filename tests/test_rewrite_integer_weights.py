"""Integer weight rule (passes/rewrite/integer_weights.py) and its driver (passes/qdq/weights.py:
fold_integer_weights): graphs that must match (with and without the Transpose, the scale on either side of the
Mul, a Mul read twice), graphs that must not (float q, q or scale from an input, a scale per column, a Cast to
float16, a weight that is a graph output), the folded float32 weight bit for bit q * scale, onnxruntime before
and after equal, and the integers and scales the driver records."""

from __future__ import annotations

import re

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
from hycoc.passes.qdq.weights import fold_integer_weights
from hycoc.passes.rewrite.integer_weights import FoldedWeight, rules
from onnxscript.rewriter import pattern

RNG = np.random.default_rng(0)
Q = RNG.integers(-8, 8, (4, 3)).astype(np.int8)  # int4 values: (out 4, in 3)
SCALE = RNG.uniform(0.01, 0.1, (4, 1)).astype(np.float32)


def declare(name: str, array: np.ndarray) -> str:
    """An initializer in the ONNX text format (https://onnx.ai/onnx/repo-docs/Syntax.html)."""
    kind = {"int8": "int8", "float32": "float"}[str(array.dtype)]
    values = ", ".join(repr(v.item()) for v in array.ravel())
    return f"{kind}[{', '.join(map(str, array.shape))}] {name} = {{{values}}}"


def graph(body: str, *, q=Q, scale=SCALE, x: str = "float[2, 3] x", y: str = "float[2, 4] y", **more) -> ir.Model:
    """``body`` (ONNX text) over initializers ``wq`` (int8 unless ``q`` says otherwise) and ``ws``, plus ``more``;
    each ``<a>q`` / ``<a>s`` is renamed ``<a>.q`` / ``<a>.scale`` afterwards, as passes/slm/graph.py names them
    (the text format has no dots in names)."""
    inits = {"wq": q, "ws": scale, **more}
    declared = ", ".join(declare(name, a) for name, a in inits.items() if a is not None)
    model = ir.from_onnx_text(
        f"""
        < ir_version: 10, opset_import: ["" : 20] >
        g ({x}) => ({y})
        <{declared}>
        {{
            {body}
        }}
        """
    )
    for name, value in list(model.graph.initializers.items()):
        value.name = f"{name[:-1]}.{'q' if name.endswith('q') else 'scale'}"
    return model


def run(model: ir.Model, x: np.ndarray) -> list[np.ndarray]:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x})


def op_types(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def apply(model: ir.Model) -> tuple[int, list[FoldedWeight]]:
    folded: list[FoldedWeight] = []
    return rules(folded).apply_to_model(model), folded


# ---- graphs that must match ---------------------------------------------------------------------------------

MATCHING = {
    # IntegerLinear as exported: Cast -> Mul -> Transpose into the MatMul (passes/slm/graph.py)
    "transposed": ("t = Cast<to=1>(wq)\n w = Mul(t, ws)\n wt = Transpose<perm=[1, 0]>(w)\n y = MatMul(x, wt)", 1),
    "scale_first": ("t = Cast<to=1>(wq)\n w = Mul(ws, t)\n wt = Transpose<perm=[1, 0]>(w)\n y = MatMul(x, wt)", 1),
    # no Transpose: the weight is read as (out, in), here by Gemm(transB=1)
    "plain": ("t = Cast<to=1>(wq)\n w = Mul(t, ws)\n y = Gemm<transB=1>(x, w)", 0),
}


@pytest.mark.parametrize("case", MATCHING)
def test_folds_to_one_initializer_bit_for_bit(case):
    body, axis = MATCHING[case]
    model = graph(body)
    x = RNG.standard_normal((2, 3)).astype(np.float32)
    before = run(model, x)[0]

    count, folded = apply(model)

    assert count == 1 and op_types(model) == (["MatMul"] if axis else ["Gemm"])
    [fold] = folded
    assert (fold.name, fold.axis) == ("w.weight_t" if axis else "w.weight", axis)
    want = Q.astype(np.float32) * SCALE
    want = want.T if axis else want
    weight = model.graph.initializers[fold.name]
    assert weight is fold.value and model.graph.node(0).inputs[1] is weight
    got = weight.const_value.numpy()
    assert got.shape == want.shape and np.array_equal(got.view(np.uint32), want.view(np.uint32))
    np.testing.assert_array_equal(fold.q, Q.T if axis else Q)
    np.testing.assert_array_equal(fold.scale.view(np.uint32), SCALE.reshape(-1).view(np.uint32))
    np.testing.assert_array_equal(run(model, x)[0], before)


def test_a_mul_read_twice_is_folded_without_its_transpose():
    model = graph(
        "t = Cast<to=1>(wq)\n w = Mul(t, ws)\n wt = Transpose<perm=[1, 0]>(w)\n a = MatMul(x, wt)\n"
        " b = Gemm<transB=1>(x, w)\n y = Add(a, b)"
    )
    count, folded = apply(model)
    assert count == 1 and [(f.name, f.axis) for f in folded] == [("w.weight", 0)]
    assert op_types(model) == ["Transpose", "MatMul", "Gemm", "Add"]


def test_the_driver_drops_what_it_folded_and_records_the_bits():
    model = graph(
        "t = Cast<to=1>(wq)\n w = Mul(t, ws)\n wt = Transpose<perm=[1, 0]>(w)\n a = MatMul(x, wt)\n"
        " u = Cast<to=1>(vq)\n v = Mul(vs, u)\n y = Gemm<transB=1>(a, v)",
        y="float[2, 2] y",
        vq=np.array([[100, -3, 5, 7], [1, 2, 3, 4]], np.int8),
        vs=np.ones((2, 1), np.float32),
    )
    specs = fold_integer_weights(model)
    assert [(s.name, s.axis, s.bits, s.qdq_bits) for s in specs] == [("w.weight_t", 1, 4, 4), ("v.weight", 0, 8, 8)]
    assert list(model.graph.initializers) == ["w.weight_t", "v.weight"]  # q and scales dropped, folds in graph order
    for spec in specs:
        np.testing.assert_array_equal(spec.dequantized(), model.graph.initializers[spec.name].const_value.numpy())


def test_folded_graph_is_not_folded_again():
    model = graph(MATCHING["transposed"][0])
    apply(model)
    assert apply(model) == (0, [])


# ---- graphs that must not match -----------------------------------------------------------------------------

FOLD = "t = Cast<to=1>(wq)\n w = Mul(t, ws)\n wt = Transpose<perm=[1, 0]>(w)\n y = MatMul(x, wt)"
NOT_MATCHING = {
    "float_q": (graph(FOLD, q=Q.astype(np.float32)), "q has dtype FLOAT, not INT8"),
    "q_from_an_input": (
        graph(FOLD.replace("wq", "qi"), x="float[2, 3] x, int8[4, 3] qi", q=None),
        "q is not an initializer",
    ),
    "scale_from_an_input": (
        graph(FOLD.replace("ws", "si"), x="float[2, 3] x, float[4, 1] si", scale=None),
        "scale is not an initializer",
    ),
    # (4,) broadcasts over q's columns: the graph would not compute q * scale per row
    "scale_per_column": (graph(FOLD, scale=SCALE.reshape(-1)), r"scale of shape \[4\] is not \(4, 1\), one per row"),
    "cast_to_float16": (graph(FOLD.replace("to=1", "to=10")), "the Cast is to FLOAT16, not FLOAT"),
    "weight_is_an_output": (
        graph("t = Cast<to=1>(wq)\n w = Mul(t, ws)\n y = Transpose<perm=[1, 0]>(w)", y="float[3, 4] y"),
        "the weight is a graph output",
    ),
}


@pytest.mark.parametrize("case", NOT_MATCHING)
def test_does_not_match_and_says_why(case):
    model, reason = NOT_MATCHING[case]
    ops = op_types(model)
    tracer = pattern.MatchingTracer()
    rules([]).apply_to_model(model, tracer=tracer)
    failed = [
        info.match_result.reason
        for matches in tracer.best_matches_map.values()
        for info in matches
        if info.status == pattern.MatchStatus.CONDITION_FAILED
    ]
    assert any(re.search(reason, r) for r in failed), failed
    assert apply(model) == (0, []) and op_types(model) == ops


def test_a_cast_read_elsewhere_is_left_alone():
    model = graph("t = Cast<to=1>(wq)\n w = Mul(t, ws)\n s = ReduceSum<keepdims=0>(t)\n y = Mul(w, s)")
    ops = op_types(model)
    assert apply(model) == (0, []) and op_types(model) == ops
