"""QDQ insertion (passes/qdq/quantize.py, passes/calibration.py; docs/design.md "Numerics by construction"; paper App. A
"Activation calibration", "QDQ insertion").

The tiny SLM of test_slm_surgery (int2/int4/int8 weights, per-layer inputs, KV-shared layers, soft-capped logits)
is exported as the static tree graph and quantized A16 with onnxruntime's QNN helpers. Checked on the QDQ graph:
every weight's DequantizeLinear holds the checkpoint's integers and scales bit for bit; masks, rotary rows and the
soft-cap's Tanh have their fixed encodings; ring inputs share their new-KV outputs' encodings; a mask holding -inf
or a min-float stand-in is refused; SQNR against float stays above a floor measured here.
"""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from hycoc.passes.calibration import CalibrationError, check_fixed_inputs, check_samples
from hycoc.passes.qdq.encodings import (
    SOFTMAX_SCALE,
    TANH_SCALE,
    TANH_ZERO_POINT,
    QdqError,
    check_fixed_encodings,
    kv_wire_encoding,
)
from hycoc.passes.qdq.quantize import QdqQuantize, quantize_graph, slm_calibration_samples
from hycoc.passes.qdq.sqnr import sqnr_table
from hycoc.passes.qdq.weights import verify_weights, weights_from_arrays
from hycoc.passes.slm.graph import FULL, SLIDING, SlmTreeGraph, export_slm_graph
from hycoc.passes.slm.surgery import operate
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh
from rich.console import Console
from test_slm_surgery import VOCAB, make_tiny_slm

torch.set_num_threads(1)

RING = {FULL: 12, SLIDING: 5}
ROWS = 9
KEEP = np.sort(np.random.default_rng(1).choice(VOCAB, 40, replace=False))
# Measured on this graph (8 samples, seed 0): logits 34.9 dB, decoder layers 34.8-40.4 dB, top-1 98.6%.
SQNR_FLOOR_DB = 30.0
TOP1_FLOOR = 0.9


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("qdq")
    slm = operate(make_tiny_slm(d / "slm", embedding_bits=4))[0]
    graph = SlmTreeGraph(slm, KEEP, rows=ROWS, ring=RING)
    samples = slm_calibration_samples(graph, slm, 8, seed=0)
    export_slm_graph(graph, [torch.from_numpy(samples[0][n]) for n in graph.input_names], d / "slm.onnx")
    result = quantize_graph(d / "slm.onnx", samples, d / "qdq", percentile=99.9, range_scale=1.2)
    return {
        "slm": slm,
        "graph": graph,
        "samples": samples,
        "float": d / "slm.onnx",
        "result": result,
        "qdq": onnx.load(str(result.path)),
    }


def test_weights_are_bit_exact(tiny):
    slm, qdq = tiny["slm"], tiny["qdq"]
    arrays = {t.name: t for t in qdq.graph.initializer}
    assert len(tiny["result"].weights) == len(slm.weights)
    for name, w in slm.weights.items():
        q, scale = (w.q[KEEP], w.scale[KEEP]) if name == "lm_head" else (w.q, w.scale)
        dq = next(
            n for n in qdq.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == f"{name}.weight_t_quantized"
        )
        ints = arrays[dq.input[0]]
        assert ints.data_type == (T.INT8 if w.bits == 8 else T.INT4), name  # 2- and 4-bit sources: int4
        np.testing.assert_array_equal(nh.to_array(ints).astype(np.int8), q.T)
        got = nh.to_array(arrays[dq.input[1]]).astype(np.float32)
        np.testing.assert_array_equal(got.view(np.uint32), scale.reshape(-1).view(np.uint32))
        assert not nh.to_array(arrays[dq.input[2]]).any()
        assert next(a.i for a in dq.attribute if a.name == "axis") == 1  # output channels of the (in, out) weight
    # a scale off by one ulp is caught
    tampered = onnx.ModelProto()
    tampered.CopyFrom(qdq)
    spec = tiny["result"].weights[3]
    t = next(t for t in tampered.graph.initializer if t.name == f"{spec.name}_scale")
    s = nh.to_array(t).copy()
    s[0] = np.nextafter(s[0], np.float32(1))
    t.CopyFrom(nh.from_array(s, t.name))
    with pytest.raises(QdqError, match=f"{spec.name}.*scales differ"):
        verify_weights(tampered, tiny["result"].weights)


def test_fixed_encodings(tiny):
    enc, fixed = tiny["result"].encodings, tiny["result"].fixed
    for name in ("mask_full", "mask_sliding"):
        e = enc[name]
        assert e["dtype"] == "uint16" and e["zero_point"] == 65535
        assert e["scale"] * 65535 == pytest.approx(1e4, rel=1e-6)  # [-1e4, 0], both ends exact
    for name in ("cos_full", "sin_full", "cos_sliding", "sin_sliding"):
        e = enc[name]
        assert e["zero_point"] == 32768 and e["scale"] == pytest.approx(2 / 65535, rel=1e-6)  # [-1, 1]
    assert fixed["tanh"] and all(e["scale"] == TANH_SCALE and e["zero_point"] == TANH_ZERO_POINT for e in fixed["tanh"])


def softmax_encodings(model) -> list[tuple[str, float, int, int]]:
    """(Softmax output, scale, zero point, ONNX element type) of the QuantizeLinear reading each Softmax output of
    an onnx.ModelProto; a Softmax whose output no QuantizeLinear reads appears with scale nan."""
    inits = {t.name: t for t in model.graph.initializer}
    outs = [n.output[0] for n in model.graph.node if n.op_type == "Softmax"]
    found = {}
    for n in model.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] in outs:
            zp = inits[n.input[2]]
            found[n.input[0]] = (float(nh.to_array(inits[n.input[1]])), int(nh.to_array(zp)), zp.data_type)
    return [(o, *found.get(o, (float("nan"), -1, 0))) for o in outs]


def assert_softmax_fixed(model, where: str) -> int:
    """Every Softmax output of ``model`` is quantized uint16 [0, 1]: scale float32(1/65535), zero point 0."""
    got = softmax_encodings(model)
    wrong = [
        (o, s * (65535 - 0), zp)
        for o, s, zp, t in got
        if not (np.float32(s) == SOFTMAX_SCALE and zp == 0 and t == T.UINT16)
    ]
    assert not wrong, f"{where}: {len(wrong)} of {len(got)} Softmax outputs are not [0, 1]: {wrong[:3]}"
    return len(got)


def test_softmax_outputs_get_the_fixed_0_1_encoding(tiny):
    """Calibration saw rows whose largest probability stays under 1 (a calibrated range would clip); every Softmax
    output is [0, 1] anyway, and a tampered scale is caught by the graph check."""
    from hycoc.passes.calibration import activation_ranges

    qdq = tiny["qdq"]
    assert assert_softmax_fixed(qdq, "tiny SLM") == 4  # one per decoder layer
    assert len(tiny["result"].fixed["softmax"]) == 4
    # what calibration alone would have given one of them: a range that is not [0, 1]
    fmodel = onnx.load(str(tiny["result"].float_path), load_external_data=False)
    name = next(n.output[0] for n in fmodel.graph.node if n.op_type == "Softmax")
    lo, hi = activation_ranges(tiny["result"].float_path, tiny["samples"], percentile=99.9)[name]
    assert lo == 0.0 and hi != 1.0
    tampered = onnx.ModelProto()
    tampered.CopyFrom(qdq)
    q = next(n for n in tampered.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == name)
    t = next(t for t in tampered.graph.initializer if t.name == q.input[1])
    t.CopyFrom(nh.from_array(np.array(hi / 65535, np.float32), t.name))
    with pytest.raises(QdqError, match="Softmax output .* not the fixed"):
        check_fixed_encodings(tampered)


def test_every_softmax_output_of_the_built_bundle_is_0_1(tiny_pipeline):
    """The tiny pipeline's graphs as the target step ships them and as the decode pass copies encodings: head, SLM
    tree and SLM decode graph, every Softmax output uint16 [0, 1]."""
    import onnx_ir as ir

    counts = {}
    for kind in ("qdq_head", "qdq_slm", "qdq_slm_decode"):
        model = ir.serde.serialize_model(tiny_pipeline.first.artifacts[kind].payload)
        counts[kind] = assert_softmax_fixed(model, kind)
    assert counts == {"qdq_head": 2, "qdq_slm": 4, "qdq_slm_decode": 4}


def test_ring_inputs_share_the_new_kv_encodings(tiny):
    enc = tiny["result"].encodings
    for i in tiny["graph"].kv_layers:
        for kv in ("k", "v"):
            assert enc[f"{kv}_ring_{i}"] == enc[f"{kv}_new_{i}"]
            assert enc[f"{kv}_ring_{i}"]["dtype"] == "uint16"
    wire = kv_wire_encoding(enc["k_ring_0"])
    lo16 = -enc["k_ring_0"]["zero_point"] * enc["k_ring_0"]["scale"]
    assert wire["dtype"] == "uint8" and abs(-wire["zero_point"] * wire["scale"] - lo16) <= wire["scale"]


@pytest.mark.parametrize("bad", [-np.inf, -3.4e38, np.nan])
def test_mask_outside_the_fixed_range_is_refused(tiny, tmp_path, bad):
    sample = {k: v.copy() for k, v in tiny["samples"][1].items()}
    sample["mask_full"][0, 0, 2, 3] = bad
    with pytest.raises(CalibrationError, match=r"mask_full.*\[-10000, 0\].*never -inf"):
        check_fixed_inputs(sample, 1)
    with pytest.raises(CalibrationError, match="sample 1: input 'mask_full'"):
        quantize_graph(tiny["float"], [tiny["samples"][0], sample], tmp_path, percentile=99.9)


def test_bad_samples_are_refused(tiny):
    sample = dict(tiny["samples"][0])
    del sample["k_ring_0"]
    with pytest.raises(CalibrationError, match="k_ring_0"):
        check_samples(tiny["float"], [sample])
    sample = {k: v.copy() for k, v in tiny["samples"][0].items()}
    sample["cos_full"] *= 1.5
    with pytest.raises(CalibrationError, match="rotary input 'cos_full'"):
        check_samples(tiny["float"], [sample])


def test_sqnr_report(tiny):
    report = tiny["result"].sqnr
    print("\n" + str(report))
    assert set(report["layers"]) == {f"model.layers.{i}" for i in range(4)}
    assert min(report["layers"].values()) > SQNR_FLOOR_DB
    assert min(report["outputs"].values()) > SQNR_FLOOR_DB
    assert report["top1_agreement"] >= TOP1_FLOOR
    console = Console(file=io.StringIO(), width=120)
    console.print(sqnr_table(report))
    assert "model.layers.3" in console.file.getvalue()


def _matmul_graph(path, w):
    nodes = [h.make_node("MatMul", ["x", "w"], ["y0"]), h.make_node("Tanh", ["y0"], ["y"])]
    g = h.make_graph(
        nodes,
        "mm",
        [h.make_tensor_value_info("x", T.FLOAT, [1, 4, w.shape[0]])],
        [h.make_tensor_value_info("y", T.FLOAT, [1, 4, w.shape[1]])],
        [nh.from_array(w, "w")],
    )
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21)])
    m.ir_version = 10
    onnx.save(m, str(path))


def test_weights_given_as_arrays(tmp_path):
    """The head's path: integers and scales given (QAT output); the graph's float weight must be q * scale."""
    rng = np.random.default_rng(0)
    q = rng.integers(-7, 8, (6, 8)).astype(np.int8)
    s = (rng.random((6, 1)) * 0.1 + 0.01).astype(np.float32)
    _matmul_graph(tmp_path / "mm.onnx", np.ascontiguousarray((q.astype(np.float32) * s).T))
    samples = [{"x": rng.standard_normal((1, 4, 8)).astype(np.float32)} for _ in range(4)]
    res = quantize_graph(
        tmp_path / "mm.onnx", samples, tmp_path / "out", percentile=99.99, weight_arrays={"w": (q, s, 4)}
    )
    assert res.weights[0].axis == 1 and res.numbers()["weight_bits"] == {"4": 1}
    assert res.sqnr["outputs"]["y"] > 30
    with pytest.raises(QdqError, match="not q \\* scale"):
        weights_from_arrays(ir.load(tmp_path / "mm.onnx"), {"w": (q, s * 1.001, 4)})


def test_pipeline_pass(tmp_path):
    from hycoc.passes.artifacts import KeepSetArtifact
    from hycoc.passes.pipeline import Pipeline
    from hycoc.passes.slm.graph import SlmTreeGraphExport
    from hycoc.passes.slm.surgery import SlmGraphSurgery

    from hycoc.recipe import Recipe

    path = make_tiny_slm(tmp_path / "slm", embedding_bits=4)
    recipe = Recipe.model_validate(
        {
            "models": {"slm": str(path)},
            "tree": {"node_budget": 6},
            "window": {"slm_window": 16, "slm_sliding_window": 8},
            "slm_calibration": {"prompts": 4},
        }
    )
    # no verifier here: the synthetic fallback (the build's real calibration: tests/test_slm_calibration.py)
    pipeline = Pipeline(
        [SlmGraphSurgery(), SlmTreeGraphExport(), QdqQuantize("onnx_slm", "qdq_slm", calibration="synthetic")],
        tmp_path / "cache",
        console=Console(file=io.StringIO()),
    )
    result = pipeline.run(recipe, {"keep_set": KeepSetArtifact("keep_set", KEEP)})
    report = result.reports[-1]
    assert report.numbers["weights_bit_exact"] == 34 and report.numbers["samples"] == 4
    assert report.numbers["quantize_linear"] > 0 and "top-1" in report.summary
    assert report.numbers["sqnr_held_out"]["samples"] == 2
    ops = {n.op_type for n in result.artifacts["qdq_slm"].payload.graph}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops and "Cast" not in ops
    with pytest.raises(ValueError, match="only 'onnx_slm'"):
        QdqQuantize("onnx_head", "qdq_head")
    with pytest.raises(ValueError, match="'real' or 'synthetic'"):
        QdqQuantize("onnx_slm", "qdq_slm", calibration="random")
    assert {"torch_verifier", "tokenizer"} <= set(QdqQuantize("onnx_slm", "qdq_slm").consumes)


# Measured (onnxruntime-qnn 2.7.0, QNN 2.51, x86 simulator, 4 held-out samples): simulator vs CPU-EP QDQ logits
# 23.0 dB, k/v_new 32.3-45.1 dB; without the Reciprocal -> Div rewrite the logits were 8.8 dB.
HTP_VS_CPU_FLOOR_DB = 20.0


@pytest.mark.qnn
@pytest.mark.skipif(
    not __import__("hycoc.targets.qnn_ep", fromlist=["qnn_installed"]).qnn_installed(),
    reason="onnxruntime-qnn is not importable: install the qnn extra to compile for htp-v81",
)
def test_qdq_slm_compiles_for_v81_and_matches_the_cpu_ep(tiny, tmp_path):
    import onnxruntime as ort
    from hycoc.targets.htp import HtpSession, compile_context
    from hycoc.targets.profiles import get_profile

    from hycoc.numerics import sqnr_db

    cg = compile_context(tiny["result"].path, tmp_path, get_profile("htp-v81"), graph_name="slm")
    assert [n.op_type for n in onnx.load(str(cg.ctx_model)).graph.node] == ["EPContext"]  # no CPU fallback
    htp = HtpSession(cg.ctx_model)
    cpu = ort.InferenceSession(str(tiny["result"].path), providers=["CPUExecutionProvider"])
    held = slm_calibration_samples(tiny["graph"], tiny["slm"], 4, seed=7)
    got = {}
    for name in tiny["graph"].output_names:
        a = np.concatenate([htp.run(s)[name].reshape(-1) for s in held])
        b = np.concatenate([cpu.run([name], s)[0].reshape(-1) for s in held])
        got[name] = sqnr_db(b, a)
    print(f"\nhtp-v81 simulator vs CPU-EP QDQ SQNR (dB): { {k: round(v, 1) for k, v in got.items()} }")
    assert min(got.values()) > HTP_VS_CPU_FLOOR_DB, got


def test_only_a16_activations_are_built():
    from hycoc.passes.qdq.encodings import QdqError, require_a16

    require_a16(16)
    with pytest.raises(QdqError, match=r"slm_calibration.activation_bits = 8: only 16-bit \(A16\)"):
        require_a16(8)
