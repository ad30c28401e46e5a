"""The shipped graphs' IO (passes/graph_io.py): check outputs dropped, and ``[target] quantized_io`` (KV rings as
uint16 graph inputs, new KV rows as uint16 outputs) on the tiny pipeline, against the float-IO bundle on the CPU EP:
the same trees and the same ring contents, code for code."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from hycoc.passes.graph_io import GraphIoError, drop_check_outputs, quantize_kv_io, ship_graph
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh


def _kv_graph():
    """k_ring_0 (1, 1, 4, 2) float -> Q -> DQ -> Concat with new rows -> ... -> k_new_0 through Q -> DQ (also read
    inside the graph), plus logits and top_index outputs."""
    s, zp = nh.from_array(np.array(0.01, np.float32), "s"), nh.from_array(np.array(30000, np.uint16), "zp")
    nodes = [
        h.make_node("QuantizeLinear", ["k_ring_0", "s", "zp"], ["ring_q"]),
        h.make_node("DequantizeLinear", ["ring_q", "s", "zp"], ["ring_dq"]),
        h.make_node("Relu", ["x"], ["new"]),
        h.make_node("QuantizeLinear", ["new", "s", "zp"], ["new_q"]),
        h.make_node("DequantizeLinear", ["new_q", "s", "zp"], ["k_new_0"]),
        h.make_node("Concat", ["ring_dq", "k_new_0"], ["kv"], axis=2),
        h.make_node("ReduceSum", ["kv"], ["logits"], keepdims=1),
        h.make_node("ArgMax", ["logits"], ["top_index"], keepdims=1),
    ]
    g = h.make_graph(
        nodes,
        "kv",
        [
            h.make_tensor_value_info("k_ring_0", T.FLOAT, [1, 1, 4, 2]),
            h.make_tensor_value_info("x", T.FLOAT, [1, 1, 1, 2]),
        ],
        [
            h.make_tensor_value_info("logits", T.FLOAT, [1, 1, 1, 1]),
            h.make_tensor_value_info("top_index", T.INT64, [1, 1, 1, 1]),
            h.make_tensor_value_info("k_new_0", T.FLOAT, [1, 1, 1, 2]),
        ],
        [s, zp],
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    m.ir_version = 10
    return m


def test_ship_graph_drops_logits_and_makes_kv_io_integer():
    import onnxruntime as ort
    from hycoc.runtime.graphs import quantize

    model = _kv_graph()
    rng = np.random.default_rng(0)
    ring = (rng.standard_normal((1, 1, 4, 2)) * 0.3).astype(np.float32)
    x = rng.standard_normal((1, 1, 1, 2)).astype(np.float32)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"k_ring_0": ring, "x": x}
    )
    shipped = ship_graph(model, quantized_io=True)
    assert shipped.dropped == ["logits"] and shipped.integer_inputs == {"k_ring_0": "uint16"}
    assert shipped.integer_outputs == {"k_new_0": "uint16"}
    onnx.checker.check_model(model)
    assert [o.name for o in model.graph.output] == ["top_index", "k_new_0"]
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    from hycoc.bundle import Encoding

    enc = Encoding(scale=0.01, zero_point=30000, dtype="uint16", bits=16)
    top, new = sess.run(None, {"k_ring_0": quantize(ring, enc), "x": x})
    np.testing.assert_array_equal(top, ref[1])  # the same graph values
    np.testing.assert_array_equal(new, quantize(ref[2], enc))  # codes of the float output, exactly
    assert drop_check_outputs(_kv_graph()) == ["logits"]
    no_topk = _kv_graph()
    del no_topk.graph.output[1]
    assert drop_check_outputs(no_topk) == []  # logits is all the graph has: kept


def test_kv_io_without_a_quantize_node_is_refused():
    model = _kv_graph()
    q = model.graph.node[0]
    q.op_type, q.input[:] = "Relu", ["k_ring_0"]
    del model.graph.node[1]
    model.graph.node[3].input[0] = "ring_q"
    with pytest.raises(GraphIoError, match="input k_ring_0: read by \\['Relu'\\]"):
        quantize_kv_io(model)


# ---- the tiny pipeline with quantized IO ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized(tiny_pipeline, tiny_bundle, tmp_path_factory):
    """The tiny pipeline's QDQ graphs through the cpu target step with ``quantized_io = true``, written as a bundle
    (every pass before it is the session's cache)."""
    from hycoc.passes import build as b
    from hycoc.passes.pipeline import PipelineResult

    p = tiny_pipeline
    recipe = p.recipe.model_copy(update={"target": p.recipe.target.model_copy(update={"quantized_io": True})})
    root = tmp_path_factory.mktemp("quantized_io")
    graphs = {"head": "qdq_head", "slm": "qdq_slm", "slm_decode": "qdq_slm_decode"}
    step = b.TargetPass("cpu", graphs, root / "work")
    outputs, report = step.run({k: p.first.artifacts[k] for k in graphs.values()}, recipe)
    result = PipelineResult(p.first.artifacts | outputs, p.first.reports + [report])
    manifest = b.write_bundle(result, recipe, "cpu", root / "bundle")
    return {"bundle": root / "bundle", "manifest": manifest, "report": report, "float": tiny_bundle.bundle}


def test_quantized_io_manifest_declares_uint16_rings_with_the_float_bundles_encodings(quantized):
    from hycoc.bundle import load_manifest

    m, f = quantized["manifest"], load_manifest(quantized["float"])
    for g in m.graphs:
        fg = f.graph(g.name)
        want = {t.name: t.encoding for t in fg.inputs + fg.outputs}
        kv = [t for t in g.inputs + g.outputs if t.name.startswith(("k_", "v_"))]
        assert kv and all(t.dtype == "uint16" and t.encoding == want[t.name] for t in kv), g.name
        assert all(t.dtype == "float32" for t in g.inputs if not t.name.startswith(("k_", "v_")))
    n = quantized["report"].numbers["graphs"]
    rings = sum(t.name.startswith(("k_ring_", "v_ring_")) for t in m.graph("slm").inputs)
    assert rings > 0
    for name in ("slm", "slm_decode"):
        assert n[name]["io"] == {"dropped_outputs": ["logits"], "integer_inputs": rings, "integer_outputs": rings}
    assert n["head"]["io"] == {"dropped_outputs": ["logits"], "integer_inputs": 4, "integer_outputs": 0}


def test_quantized_io_drafts_the_float_bundles_trees_and_rings_code_for_code(quantized):
    """Hand-offs, hybrid trees, commits and greedy decode steps on both bundles (CPU EP): the same trees, and every
    ring of the quantized bundle holds the codes of the float bundle's ring."""
    from hycoc.runtime.client import load_runtime
    from hycoc.runtime.graphs import quantize
    from lockstep import hyco_rounds

    rts = [load_runtime(quantized["float"], "cpu", threads=1), load_runtime(quantized["bundle"], "cpu", threads=1)]
    fl, qu = rts
    assert qu.slm.rings[qu.slm.kv_layers[0]][0].dtype == np.uint16 and fl.slm.rings[0][0].dtype == np.float32
    prompt = fl.bundle.tokenizer.encode("How do I read a file line by line in Python?").ids
    kv = {s: int(np.prod(fl.mtp.runner.shape(f"k_{s}")[1::2])) for s in ("sliding", "full")}
    for (d0, b0), (d1, b1) in hyco_rounds(rts, prompt, 4, np.random.default_rng(3), fl.mtp.hidden, kv):
        assert (d0.chain, d0.runner_ups) == (d1.chain, d1.runner_ups)
        np.testing.assert_array_equal(b0.tokens, b1.tokens)
        np.testing.assert_array_equal(b0.parents, b1.parents)
    assert fl.slm.greedy_next() == qu.slm.greedy_next()  # the 1-row decode graph's step too
    for i in fl.slm.kv_layers:
        for x, (codes, enc) in zip(fl.slm.rings[i], zip(qu.slm.rings[i], qu.slm.ring_encodings[i])):
            np.testing.assert_array_equal(codes, quantize(x, enc))
    for kind in fl.mtp.ring:
        for x, codes, enc in zip(fl.mtp.ring[kind], qu.mtp.ring[kind], qu.mtp.ring_encodings[kind]):
            np.testing.assert_array_equal(codes, quantize(x, enc))
