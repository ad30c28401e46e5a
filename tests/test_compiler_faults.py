"""Compiler faults the passes must refuse (docs/design.md "Numerics by construction", "The pass pipeline"), each with a
test that fails when the fault slips through. What other test files already cover is not repeated here (see each
section's note).

(a) mask values: -inf / min-float masks are refused before quantization (tests/test_qdq.py covers -inf, -3.4e38
    and NaN in a calibration sample); here: the verifier's own finfo.min masks, a QDQ mask encoding that spans a
    min-float range, and the one -1e4 constant being the same in the head, the SLM and calibration.
(b) sliding window inside the tree rows: tests/test_slm_graph.py compares torch with transformers on all rows and
    the exported graph's logits on one ring case; here: onnxruntime on the exported graph against transformers on
    the rows past the window's boundary (logits and new K/V, three ring cases), with a control showing those rows
    do depend on the boundary.
(c) per-head q/k norms with head_dim != hidden/heads: tests/test_rewrite_rms_norm.py covers the rule; here the
    export path (`export_static`): no RMSNorm reduces a rank-4 input in the saved graph, numbers match torch, and
    a norm left at rank 4 makes the export fail.
(d) a profile without 16-bit ops: tests/test_htp_target.py covers a QDQ A16 graph on htp-v68; here the 16-bit
    tensors that check missed (a DQ of an int16 constant without a zero point, a zero point from a Constant node,
    a Cast to float16) and an 8-bit graph that must pass.
(e) data-dependent KV slicing and fused attention ops (targets/static_shape_check.py): graphs that must be refused
    (hand-built and from torch's exporter), graphs that must not (static Slice/Gather, the project's head graph),
    and the two call sites (`compile_context`, `export_static`).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from hycoc.targets.profiles import get_profile
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

torch.set_num_threads(1)


def _model(nodes, inputs, outputs, inits=(), opset=21, domains=()):
    """An onnx.ModelProto from helper pieces: inputs/outputs as (name, elem_type, shape)."""
    g = h.make_graph(
        nodes,
        "g",
        [h.make_tensor_value_info(*i) for i in inputs],
        [h.make_tensor_value_info(*o) for o in outputs],
        list(inits),
    )
    opsets = [h.make_opsetid("", opset), *(h.make_opsetid(d, 1) for d in domains)]
    return h.make_model(g, opset_imports=opsets, ir_version=10)


# ----------------------------------------------------------------------------------------------- (a) mask values


def test_mask_constant_is_one_finite_value_everywhere():
    """The head graph, the SLM graph and calibration must agree on the hidden-column value: a head mask at -1e9
    would be clipped by a [-1e4, 0] encoding, a calibration range at -1e9 would wreck the 16-bit step."""
    from hycoc.passes.calibration import MASK_MAX, MASK_MIN
    from hycoc.passes.head.graph import MASK_VALUE
    from hycoc.passes.slm.graph import MASK_NEG

    assert MASK_VALUE == MASK_NEG == MASK_MIN == -1e4 and MASK_MAX == 0.0
    step = (MASK_MAX - MASK_MIN) / 65535
    assert step < 0.2  # one uint16 step of the mask encoding stays far below any logit difference that matters


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verifier_style_min_float_mask_is_refused_naming_input_and_fix(dtype):
    """The verifier builds its masks with finfo(dtype).min (verifier/tree.py); feeding such a mask to the drafter's
    calibration must fail, naming the input and the -1e4 fix, not quantize a 3.4e38-wide mask."""
    from hycoc.passes.calibration import CalibrationError, check_fixed_inputs
    from hycoc.verifier.tree import tree_masks

    masks = tree_masks([-1, 0, 1, 1], 6, 3, dtype)
    sample = {
        "mask_sliding": masks["sliding_attention"].float().numpy(),
        "cos_sliding": np.zeros((1, 4, 8), np.float32),
    }
    assert np.isfinite(sample["mask_sliding"]).all()  # finite, yet out of range
    with pytest.raises(
        CalibrationError,
        match=r"sample 2: input 'mask_sliding'.*\[-10000, 0\].*finite constant "
        r"-10000, never -inf or a min-float stand-in",
    ):
        check_fixed_inputs(sample, 2)
    sample["mask_sliding"] = np.maximum(sample["mask_sliding"], -1e4)  # the fix: the finite constant
    check_fixed_inputs(sample, 2)


def _mask_qdq(scale: float) -> onnx.ModelProto:
    """mask_full -> Q/DQ (uint16, zero point 65535, ``scale``) -> Add x -> y."""
    inits = [nh.from_array(np.array(scale, np.float32), "s"), h.make_tensor("z", T.UINT16, [], [65535])]
    nodes = [
        h.make_node("QuantizeLinear", ["mask_full", "s", "z"], ["mq"], name="mask_q"),
        h.make_node("DequantizeLinear", ["mq", "s", "z"], ["mf"], name="mask_dq"),
        h.make_node("Add", ["x", "mf"], ["y"], name="add"),
    ]
    return _model(
        nodes,
        [("mask_full", T.FLOAT, [1, 1, 2, 4]), ("x", T.FLOAT, [1, 1, 2, 4])],
        [("y", T.FLOAT, [1, 1, 2, 4])],
        inits,
    )


def test_qdq_mask_encoding_spanning_min_float_is_refused():
    from hycoc.passes.qdq.encodings import QdqError, check_fixed_encodings

    assert "mask_full" in check_fixed_encodings(_mask_qdq(1e4 / 65535))["mask"]
    with pytest.raises(QdqError, match=r"mask input 'mask_full' encoding .* does not span \[-10000, 0\]"):
        check_fixed_encodings(_mask_qdq(float(np.finfo(np.float32).max) / 65535))


# ---------------------------------------------------------------------------------- (b) sliding window in the tree


@pytest.fixture(scope="module")
def slm_export(tmp_path_factory):
    from hycoc.passes.slm.graph import SlmTreeGraph, export_slm_graph
    from hycoc.passes.slm.surgery import operate
    from test_slm_graph import CASES, KEEP, PARENTS, RING, ROWS, case_inputs
    from test_slm_surgery import make_tiny_slm

    from hycoc.models import load_slm

    d = tmp_path_factory.mktemp("faults_slm")
    path = make_tiny_slm(d / "slm", embedding_bits=4)
    slm = (path, load_slm(path), operate(path)[0])
    graph = SlmTreeGraph(slm[2], KEEP, rows=ROWS, ring=RING)
    cases = {c: case_inputs(graph, slm, CASES[c], seed=5) for c in CASES}
    export_slm_graph(graph, cases["wrap"][0], d / "slm.onnx")
    return {
        "slm": slm,
        "graph": graph,
        "cases": cases,
        "onnx": d / "slm.onnx",
        "parents": PARENTS,
        "keep": KEEP,
        "rows": ROWS,
    }


def test_onnx_rows_past_the_sliding_boundary_equal_transformers(slm_export):
    import onnxruntime as ort
    from hycoc.passes.slm.graph import MASK_NEG, SLIDING, ancestor_matrix, tree_depths
    from test_slm_surgery import SLIDING_WINDOW

    graph, keep = slm_export["graph"], slm_export["keep"]
    past = np.flatnonzero(tree_depths(slm_export["parents"]) >= SLIDING_WINDOW)  # rows that lost their root
    assert len(past) >= 2 and 0 < past.min() < slm_export["rows"] - 1
    sliding_kv = [i for i in graph.kv_layers if graph.layer_types[i] == SLIDING]
    assert sliding_kv
    session = ort.InferenceSession(str(slm_export["onnx"]), providers=["CPUExecutionProvider"])
    for case, (inputs, want_logits, want_new) in slm_export["cases"].items():
        got = dict(
            zip(
                graph.output_names,
                session.run(graph.output_names, {n: t.numpy() for n, t in zip(graph.input_names, inputs)}),
            )
        )
        np.testing.assert_allclose(
            got["logits"][0, past], want_logits[past][:, keep].numpy(), atol=1e-4, rtol=0, err_msg=case
        )
        for i in graph.kv_layers:
            k, v = want_new[i]
            np.testing.assert_allclose(got[f"k_new_{i}"][0][:, past], k[:, past].numpy(), atol=1e-4, err_msg=case)
            np.testing.assert_allclose(got[f"v_new_{i}"][0][:, past], v[:, past].numpy(), atol=1e-4, err_msg=case)
    # control: the same graph fed a sliding mask whose tree part ignores the window (ancestors only) changes
    # exactly the rows past the boundary, so the comparison above does test the boundary
    inputs, _, _ = slm_export["cases"]["partial"]
    feeds = {n: t.numpy().copy() for n, t in zip(graph.input_names, inputs)}
    ring = graph.ring[SLIDING]
    base = session.run(["logits"], feeds)[0][0]
    feeds["mask_sliding"][0, 0, :, ring:] = np.where(ancestor_matrix(slm_export["parents"]), 0.0, MASK_NEG)
    diff = np.abs(session.run(["logits"], feeds)[0][0] - base).max(-1)
    before = np.setdiff1d(np.arange(slm_export["rows"]), past)
    assert diff[before].max() < 1e-6 and diff[past].min() > 1e-3, diff


# ----------------------------------------------------------------------------- (c) per-head norms, odd head dim

HID, HEADS, HEAD_DIM, SEQ = 40, 4, 24, 5  # head_dim 24 != hidden / heads = 10


class PerHeadNorms(torch.nn.Module):
    """Gemma 4 attention's norms around real attention: input norm (rank 3), per-head q and k norms and an
    unscaled v norm on [1, S, H, head_dim] (rank 4), additive mask input, output projection."""

    def __init__(self):
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm

        super().__init__()
        self.input_norm = Gemma4RMSNorm(HID, eps=1e-6)
        self.q_proj = torch.nn.Linear(HID, HEADS * HEAD_DIM, bias=False)
        self.k_proj = torch.nn.Linear(HID, HEADS * HEAD_DIM, bias=False)
        self.v_proj = torch.nn.Linear(HID, HEADS * HEAD_DIM, bias=False)
        self.o_proj = torch.nn.Linear(HEADS * HEAD_DIM, HID, bias=False)
        self.q_norm = Gemma4RMSNorm(HEAD_DIM, eps=1e-6)
        self.k_norm = Gemma4RMSNorm(HEAD_DIM, eps=1e-6)
        self.v_norm = Gemma4RMSNorm(HEAD_DIM, eps=1e-6, with_scale=False)

    def forward(self, x, mask):
        x = self.input_norm(x)
        q, k, v = (
            norm(proj(x).view(1, SEQ, HEADS, HEAD_DIM)).transpose(1, 2)
            for norm, proj in ((self.q_norm, self.q_proj), (self.k_norm, self.k_proj), (self.v_norm, self.v_proj))
        )
        att = torch.softmax(q @ k.transpose(-1, -2) + mask, dim=-1) @ v
        return (self.o_proj(att.transpose(1, 2).reshape(1, SEQ, HEADS * HEAD_DIM)),)


@pytest.fixture(scope="module")
def per_head():
    torch.manual_seed(0)
    module = PerHeadNorms().eval()
    with torch.no_grad():
        for norm in (module.input_norm, module.q_norm, module.k_norm):
            norm.weight.copy_(torch.randn_like(norm.weight))
    mask = torch.where(torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), 0.0, -1e4)[None, None]
    return module, (torch.randn(1, SEQ, HID), mask)


def _reduce_mean_input_ranks(path) -> list[int]:
    model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*model.graph.value_info, *model.graph.input)}
    return [ranks[n.input[0]] for n in model.graph.node if n.op_type == "ReduceMean"]


def test_exported_per_head_norms_are_rank3_and_match_torch(per_head, tmp_path):
    from hycoc.passes.export import compare_with_torch, export_static
    from hycoc.passes.rewrite.rms_norm import rank4_rms_inputs

    module, args = per_head
    names = {"input_names": ["x", "mask"], "output_names": ["y"]}
    raw, _ = export_static(module, args, tmp_path / "raw.onnx", decompose_rms_norm=False, **names)
    assert sorted(r for _, r in rank4_rms_inputs(raw)) == [4, 4, 4]  # q, k, v norms: the detector sees them
    model, report = export_static(module, args, tmp_path / "norms.onnx", **names)
    assert report.rms_norms == 4 and report.rms_norms_reshaped == 3
    assert rank4_rms_inputs(model) == []
    ranks = _reduce_mean_input_ranks(tmp_path / "norms.onnx")
    assert len(ranks) == 4 and set(ranks) == {3}, ranks  # the saved graph, re-inferred from scratch
    errors, _ = compare_with_torch(tmp_path / "norms.onnx", module, args, logits=None, **names)
    assert errors["y"] < 1e-5, errors


def test_export_refuses_a_rank4_norm_the_rules_missed(per_head, tmp_path, monkeypatch):
    """A rule regression (e.g. a new exporter form no rule matches) must stop the export, not ship a rank-4 norm."""
    import hycoc.passes.rmsnorm_decomposition as rd
    from hycoc.passes.export import ExportError, export_static

    # only the scaled rule set: the unscaled v norm (rank 4) is left as Pow -> ReduceMean
    monkeypatch.setattr(rd, "RULE_SETS", (rd.RULE_SETS[0],))
    module, args = per_head
    with pytest.raises(
        ExportError,
        match=r"1 RMSNorm\(s\) still reduce a rank-4 input .*rank 4\).*Fix: extend "
        r"passes/rewrite/rms_norm.py",
    ):
        export_static(module, args, tmp_path / "bad.onnx", input_names=["x", "mask"], output_names=["y"])
    assert not (tmp_path / "bad.onnx").exists()


# ----------------------------------------------------------------------------------- (d) 16-bit on htp-v68


def _dq_matmul(*, w_dtype, zp_from: str | None, extra=()):
    """x [1, 4] @ DequantizeLinear(w) [4, 4] -> y; w of ``w_dtype`` (int8 / int16), its zero point from an
    initializer, a Constant node or absent (``zp_from``)."""
    np_t = {T.INT8: np.int8, T.INT16: np.int16}[w_dtype]
    inits = [nh.from_array(np.arange(16, dtype=np_t).reshape(4, 4), "w"), nh.from_array(np.float32(0.01), "ws")]
    nodes = list(extra)
    dq_in = ["w", "ws"]
    if zp_from == "initializer":
        inits.append(nh.from_array(np.array(0, np_t), "wz"))
        dq_in.append("wz")
    elif zp_from == "constant":
        nodes.append(h.make_node("Constant", [], ["wz"], name="wz_const", value=nh.from_array(np.array(0, np_t))))
        dq_in.append("wz")
    nodes += [
        h.make_node("DequantizeLinear", dq_in, ["wf"], name="w_dq"),
        h.make_node("MatMul", ["x", "wf"], ["y"], name="mm"),
    ]
    return _model(nodes, [("x", T.FLOAT, [1, 4])], [("y", T.FLOAT, [1, 4])], inits)


@pytest.mark.parametrize("zp_from", [None, "constant", "initializer"])
def test_v68_refuses_int16_weights_however_the_zero_point_is_given(zp_from):
    from hycoc.targets.htp_checks import CapabilityError, check_capabilities

    model = _dq_matmul(w_dtype=T.INT16, zp_from=zp_from)
    with pytest.raises(
        CapabilityError,
        match=r"htp-v68 \(HTP v68\) cannot run 16-bit ops.*w_dq "
        r"\(DequantizeLinear\).*Quantize activations to 8 bits",
    ):
        check_capabilities(model, get_profile("htp-v68"))
    check_capabilities(model, get_profile("htp-v81"))  # the same graph is fine where 16-bit ops run


def test_v68_refuses_a_float16_cast_and_accepts_an_8bit_graph(tmp_path):
    from hycoc.targets.htp import compile_context
    from hycoc.targets.htp_checks import CapabilityError, check_capabilities

    check_capabilities(_dq_matmul(w_dtype=T.INT8, zp_from="constant"), get_profile("htp-v68"))
    g = _dq_matmul(w_dtype=T.INT8, zp_from="initializer")
    g.graph.node.extend(
        [
            h.make_node("Cast", ["y"], ["y16"], name="to_half", to=T.FLOAT16),
            h.make_node("Cast", ["y16"], ["y32"], name="back", to=T.FLOAT),
        ]
    )
    g.graph.output[0].name = "y32"
    path = tmp_path / "half.onnx"
    onnx.save(g, str(path))
    with pytest.raises(CapabilityError, match=r"to_half \(Cast\)"):
        compile_context(path, tmp_path / "out", get_profile("htp-v68"), graph_name="half")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


# ------------------------------------------------------------------ (e) data-dependent KV slicing, fused attention

KV = ("k", T.FLOAT, [1, 2, 16, 8])


def _slice_by_position():
    """k [1, 2, 16, 8] -> Q/DQ -> Slice(starts = pos, ends = pos + 4, axis 2): a window read at a position input."""
    inits = [
        nh.from_array(np.array([4], np.int64), "four"),
        nh.from_array(np.array([2], np.int64), "axis2"),
        nh.from_array(np.float32(0.01), "s"),
        h.make_tensor("z", T.UINT8, [], [128]),
    ]
    nodes = [
        h.make_node("QuantizeLinear", ["k", "s", "z"], ["kq"], name="k_q"),
        h.make_node("DequantizeLinear", ["kq", "s", "z"], ["kf"], name="k_dq"),
        h.make_node("Add", ["pos", "four"], ["end"], name="end"),
        h.make_node("Slice", ["kf", "pos", "end", "axis2"], ["y"], name="kv_window"),
    ]
    return _model(nodes, [KV, ("pos", T.INT64, [1])], [("y", T.FLOAT, [1, 2, 4, 8])], inits)


def _gather_and_scatter():
    """k gathered at rows idx (input) and a KV write ScatterND(k, pos, new) at a position input."""
    nodes = [
        h.make_node("Gather", ["k", "idx"], ["g"], name="kv_rows", axis=2),
        h.make_node("ScatterND", ["k", "pos", "new"], ["k2"], name="kv_write"),
    ]
    return _model(
        nodes,
        [KV, ("idx", T.INT64, [3]), ("pos", T.INT64, [1, 1]), ("new", T.FLOAT, [1, 2, 16, 8])],
        [("g", T.FLOAT, [1, 2, 3, 8]), ("k2", T.FLOAT, [1, 2, 16, 8])],
    )


def _fused_attention():
    """Opset-23 Attention, com.microsoft MultiHeadAttention and GroupQueryAttention in one graph."""
    q = ("q", T.FLOAT, [1, 2, 1, 8])
    nodes = [
        h.make_node("Attention", ["q", "k", "k"], ["a"], name="attn23"),
        h.make_node("MultiHeadAttention", ["q3", "k3", "k3"], ["b"], name="mha", domain="com.microsoft", num_heads=2),
        h.make_node(
            "GroupQueryAttention",
            ["q3", "k3", "k3", "", "", "seqlens_k", "total_len"],
            ["c", "pk", "pv"],
            name="gqa",
            domain="com.microsoft",
            num_heads=2,
            kv_num_heads=2,
        ),
    ]
    return _model(
        nodes,
        [
            q,
            KV,
            ("q3", T.FLOAT, [1, 1, 16]),
            ("k3", T.FLOAT, [1, 16, 16]),
            ("seqlens_k", T.INT32, [1]),
            ("total_len", T.INT32, []),
        ],
        [("a", T.FLOAT, None), ("b", T.FLOAT, None), ("c", T.FLOAT, None)],
        opset=23,
        domains=["com.microsoft"],
    )


MUST_MATCH = {
    "slice_at_a_position_input": (_slice_by_position, [("kv_window", "Slice", "'pos'")]),
    "gather_and_scatter_at_inputs": (
        _gather_and_scatter,
        [("kv_rows", "Gather", "'idx'"), ("kv_write", "ScatterND", "'pos'")],
    ),
    "fused_attention_ops": (
        _fused_attention,
        [
            ("attn23", "Attention", "fused"),
            ("mha", "MultiHeadAttention", "fused"),
            ("gqa", "GroupQueryAttention", "fused"),
        ],
    ),
}


@pytest.mark.parametrize("case", MUST_MATCH)
def test_static_check_refuses_listing_nodes_and_fix(case):
    from hycoc.targets.static_shape_check import StaticGraphError, check_static_graph, find_static_graph_faults

    build, want = MUST_MATCH[case]
    model = build()
    found = find_static_graph_faults(model)
    assert [(f.name, f.op_type) for f in found] == [(n, op) for n, op, _ in want]
    assert all(why in f.reason for f, (_, _, why) in zip(found, want))
    with pytest.raises(StaticGraphError, match=r"(?s)g: \d node\(s\) .*Fix: use the static mask form") as e:
        check_static_graph(model, what="g")
    assert [n.name for n in e.value.nodes] == [n for n, _, _ in want]
    for name, op, _ in want:
        assert f"{name} (" in str(e.value) and op in str(e.value)


def _static_slices():
    """Slices and Gathers that are static: constant starts (initializer, Constant node), starts computed from
    Shape of a static-shape input, constant Gather indices, and an embedding lookup (constant table, input ids)."""
    inits = [
        nh.from_array(np.array([4], np.int64), "s4"),
        nh.from_array(np.array([8], np.int64), "e8"),
        nh.from_array(np.array([2], np.int64), "ax"),
        nh.from_array(np.array([0, 3], np.int64), "rows"),
        nh.from_array(np.ones((10, 8), np.float32), "table"),
        nh.from_array(np.array([4], np.int64), "minus"),
    ]
    nodes = [
        h.make_node("Slice", ["k", "s4", "e8", "ax"], ["a"], name="init_starts"),
        h.make_node("Constant", [], ["c0"], name="c0", value=nh.from_array(np.array([0], np.int64))),
        h.make_node("Slice", ["k", "c0", "s4", "ax"], ["b"], name="const_starts"),
        h.make_node("Shape", ["k"], ["shp"], name="shape", start=2, end=3),
        h.make_node("Sub", ["shp", "minus"], ["tail"], name="tail"),
        h.make_node("Slice", ["k", "tail", "shp", "ax"], ["c"], name="shape_starts"),
        h.make_node("Gather", ["k", "rows"], ["d"], name="const_rows", axis=2),
        h.make_node("Gather", ["table", "ids"], ["e"], name="embed", axis=0),
    ]
    return _model(nodes, [KV, ("ids", T.INT64, [3])], [(n, T.FLOAT, None) for n in "abcde"], inits)


def test_static_check_does_not_match_static_slices():
    import onnxruntime as ort
    from hycoc.targets.static_shape_check import check_static_graph, find_static_graph_faults

    model = _static_slices()
    ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])  # a valid graph
    assert find_static_graph_faults(model) == []
    check_static_graph(model)


def test_static_check_passes_the_projects_head_graph(tmp_path):
    """The head graph as the build exports it (static Slices of rotate_half, MatMul/Softmax attention) is clean."""
    from hycoc.passes.export import export_static
    from hycoc.passes.head.graph import INPUT_NAMES, OUTPUT_NAMES, HeadGraph
    from hycoc.passes.head.quantize import restrict_output_layer
    from hycoc.targets.static_shape_check import find_static_graph_faults
    from test_head_graph import export_args
    from tiny_models import tiny_head, tiny_verifier

    head = tiny_head(tiny_verifier())
    graph = HeadGraph(restrict_output_layer(head, torch.arange(0, 300, 3))).eval()
    args = export_args(head)
    model, report = export_static(
        graph, args, tmp_path / "head.onnx", input_names=INPUT_NAMES, output_names=OUTPUT_NAMES
    )  # export_static runs the check itself
    assert report.ops.get("Slice", 0) > 0 and "Softmax" in report.ops
    assert find_static_graph_faults(tmp_path / "head.onnx") == []


def test_static_check_passes_the_projects_slm_graph(slm_export):
    """The SLM tree graph as export_slm_graph saved it (ring + new rows, Concat, static Slices) is clean."""
    from hycoc.targets.static_shape_check import find_static_graph_faults

    ops = {n.op_type for n in onnx.load(str(slm_export["onnx"]), load_external_data=False).graph.node}
    assert {"MatMul", "Softmax", "Concat"} <= ops
    assert find_static_graph_faults(slm_export["onnx"]) == []


def test_compile_context_refuses_before_compiling(tmp_path):
    from hycoc.targets.htp import compile_context
    from hycoc.targets.static_shape_check import StaticGraphError

    path = tmp_path / "kv.onnx"
    onnx.save(_slice_by_position(), str(path))
    with pytest.raises(
        StaticGraphError,
        match=r"kv.onnx \(htp-v81\): 1 node\(s\).*\n  - kv_window \(Slice\): "
        r"data-dependent slice .* graph input\(s\) 'pos'",
    ):
        compile_context(path, tmp_path / "out", get_profile("htp-v81"), graph_name="kv")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


class _IndexSelect(torch.nn.Module):
    def forward(self, k, pos):
        return (k.index_select(2, pos) * 2.0,)


class _Sdpa(torch.nn.Module):
    def forward(self, q, k, v, mask):
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask),)


@pytest.mark.parametrize("case", ["index_select", "sdpa_opset23"])
def test_export_static_refuses_what_torch_exports(case, tmp_path):
    from hycoc.passes.export import export_static
    from hycoc.targets.static_shape_check import StaticGraphError

    if case == "index_select":
        module, args, names, opset = (
            _IndexSelect().eval(),
            (torch.randn(1, 2, 16, 8), torch.tensor([3, 4])),
            ["k", "pos"],
            21,
        )
        want = r"\(Gather\): data-dependent slice .*'pos'"
    else:
        args = (torch.randn(1, 2, 3, 8), torch.randn(1, 2, 16, 8), torch.randn(1, 2, 16, 8), torch.zeros(1, 1, 3, 16))
        module, names, opset, want = _Sdpa().eval(), ["q", "k", "v", "mask"], 23, r"\(Attention\): fused attention op"
    with pytest.raises(StaticGraphError, match=want):
        export_static(
            module,
            args,
            tmp_path / "m.onnx",
            input_names=names,
            output_names=["y"],
            decompose_rms_norm=False,
            opset=opset,
        )
    assert not (tmp_path / "m.onnx").exists()
