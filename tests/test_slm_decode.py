"""The SLM's 1-row decode graph (passes/slm/decode.py) and slm-alone decoding on it (runtime/slm_decode.py), on the
session's tiny bundle (tests/conftest.py `tiny_bundle`): the graph in the bundle, its encodings equal to the tree
graph's, and slm-alone's greedy text equal to the tree graph's one token per R-row forward."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from hycoc.passes.slm.decode import activation_encodings, tree_feeds

from hycoc.host import MASK_VALUE

PROMPTS = [
    "w1 w2 w3",
    "w5 w9 w17 w33 w2 w8",
    "w100 w7",
    " ".join(["w3"] * 40 + ["w4"]),
]  # longer than the tree graph's rows: prefill, then decode


def test_decode_graph_is_in_the_bundle_with_the_tree_graphs_io(tiny_bundle):
    from hycoc.bundle import load_manifest

    m = load_manifest(tiny_bundle.bundle)
    tree, dec = m.graph("slm"), m.graph("slm_decode")
    assert dec.role == "slm"
    ins = {t.name: t for t in dec.inputs}
    tree_ins = {t.name: t for t in tree.inputs}
    assert list(ins) == list(tree_ins)  # same inputs, same order
    rows = tree_ins["inputs_embeds"].shape[1]
    assert rows == tiny_bundle.recipe.tree.node_budget and ins["inputs_embeds"].shape[1] == 1
    for name, spec in ins.items():
        if name.startswith(("k_ring_", "v_ring_")):  # the rings: one shape and one encoding for both graphs
            assert spec.shape == tree_ins[name].shape and spec.encoding == tree_ins[name].encoding
        elif name.startswith("mask_"):
            w = tree_ins[name].shape[-1] - rows
            assert spec.shape == [1, 1, 1, w + 1] and spec.encoding == tree_ins[name].encoding
    outs = {t.name: t for t in dec.outputs}
    assert outs["top_index"].shape == [1, 1, 1] and "top_logq" not in outs
    for name, spec in outs.items():
        if name.startswith(("k_new_", "v_new_")):
            assert spec.encoding == next(t for t in tree.outputs if t.name == name).encoding


def test_decode_pass_reuses_every_tree_encoding_and_matches_row_0(tiny_pipeline):
    report = next(r for r in tiny_pipeline.first.reports if r.pass_name == "slm_decode_graph")
    n = report.numbers
    tree_qdq = tiny_pipeline.first.artifacts["qdq_slm"].payload
    import onnx_ir as ir

    tree_encodings = activation_encodings(ir.serde.serialize_model(tree_qdq))
    assert n["encodings_from_tree"] == len(tree_encodings) > 100
    cmp = n["row0_vs_tree"]
    assert cmp["samples"] == 4 and cmp["top1_agreement"] == 1.0
    # the KV of the decode row is the tree graph's row 0 to within one step of its encoding (measured: equal)
    enc = n["io_encodings"]
    assert all(v <= 1.01 * enc[k]["scale"] for k, v in cmp["max_abs_diff"].items() if k != "logits")
    assert n["top_k_outputs"] == 1 and n["rows"] == 1


def test_activation_encodings_key_a_graph_output_by_its_own_name():
    from onnx import TensorProto, helper, numpy_helper

    inits = [
        numpy_helper.from_array(np.array(0.5, np.float32), "s"),
        numpy_helper.from_array(np.array(7, np.uint16), "z"),
    ]
    nodes = [
        helper.make_node("Relu", ["x"], ["y_QuantizeLinear_Input"]),
        helper.make_node("QuantizeLinear", ["y_QuantizeLinear_Input", "s", "z"], ["q"]),
        helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"]),
        helper.make_node("QuantizeLinear", ["x", "s", "z"], ["qx"]),
    ]
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
        inits,
    )
    enc = activation_encodings(helper.make_model(g))
    assert sorted(enc) == ["x", "y"]
    assert float(enc["y"][0]) == 0.5 and int(enc["y"][1]) == 7 and enc["y"][1].dtype == np.uint16


def test_tree_feeds_give_row_0_the_decode_rows_view():
    w, r = 5, 3
    dec = {
        "inputs_embeds": np.arange(4, dtype=np.float32).reshape(1, 1, 4),
        "mask_full": np.array([[[[0, 0, MASK_VALUE, 0, 0, 0]]]], np.float32),
        "k_ring_0": np.ones((1, 2, w, 4), np.float32),
    }
    shapes = {"inputs_embeds": (1, r, 4), "mask_full": (1, 1, r, w + r), "k_ring_0": (1, 2, w, 4)}
    out = tree_feeds(dec, shapes)
    assert out["inputs_embeds"].shape == (1, r, 4) and (out["inputs_embeds"][0] == dec["inputs_embeds"][0, 0]).all()
    assert out["k_ring_0"] is dec["k_ring_0"]
    m = out["mask_full"][0, 0]
    assert m[0].tolist() == [0, 0, MASK_VALUE, 0, 0, 0, MASK_VALUE, MASK_VALUE]  # ring as decoded, then itself
    assert [m[j, w + j] for j in range(r)] == [0, 0, 0] and m[1, w] == MASK_VALUE


def test_slm_alone_on_the_decode_graph_gives_the_tree_graphs_text(tiny_bundle):
    from hycoc.runtime.client import DeviceRuntime, load_runtime

    rt = load_runtime(tiny_bundle.bundle, "cpu", threads=1)
    tree_only = DeviceRuntime(rt.bundle, rt.mtp.runner, rt.slm.runner)  # today's path: R rows per token
    assert rt.slm.decoder is not None and tree_only.slm.decoder is None
    tok = rt.bundle.tokenizer
    for prompt in PROMPTS:
        ids = tok.encode(prompt).ids
        before = tree_only.slm.forwards
        want = tree_only.generate(None, ids, mode="slm-alone", max_new_tokens=24)
        tree_calls, dec_calls = rt.slm.forwards, rt.slm.decoder.forwards
        got = rt.generate(None, ids, mode="slm-alone", max_new_tokens=24)
        assert got.tokens == want.tokens and got.text == want.text and len(got.tokens) >= 2
        # every token decoded in one 1-row forward but the first when the prompt left rows without KV after the
        # prefill (the tree graph runs them with r); the prefill's R-row forwards are the same
        decoded = rt.slm.decoder.forwards - dec_calls
        assert decoded in (len(got.tokens) - 1, len(got.tokens))
        assert (tree_only.slm.forwards - before) - (rt.slm.forwards - tree_calls) == decoded
        assert rt.slm.n_kv == tree_only.slm.n_kv and rt.slm.tokens == tree_only.slm.tokens
        # the rings after the request: the same codes but in rare columns (the CPU EP's 1-row and R-row matrix
        # products round differently in float; one flipped 16-bit code upstream moves a position's K/V. Measured
        # on these prompts: 1 column of 16 in 2 of 4 requests, at most 188 of the encoding's 65,535 steps)
        for i, (k, v) in rt.slm.rings.items():
            for kv, mine, theirs in (("k", k, tree_only.slm.rings[i][0]), ("v", v, tree_only.slm.rings[i][1])):
                step = rt.slm.decoder.runner.outputs[f"{kv}_new_{i}"].encoding.scale
                diff = np.abs(mine - theirs)
                assert diff.max() <= 655 * step and np.mean(diff.max(axis=(0, 1, 3)) > 0) <= 1 / 8  # columns


def test_decode_step_needs_every_position_before_the_root_in_the_ring(tiny_bundle):
    from hycoc.runtime.client import load_runtime

    rt = load_runtime(tiny_bundle.bundle, "cpu", threads=1)
    slm = rt.slm
    slm.start(rt.bundle.tokenizer.encode("w1 w2 w3").ids)  # n_kv 0 < t: the prompt has no SLM KV yet
    with pytest.raises(ValueError, match="run the committed rows without KV through the tree graph first"):
        slm.decoder.step(slm)


def test_a_bundle_without_the_decode_graph_still_decodes_on_the_tree_graph(tiny_bundle, tmp_path):
    from hycoc.runtime.client import load_runtime

    from hycoc.bundle import Manifest

    copy = tmp_path / "old"
    shutil.copytree(tiny_bundle.bundle, copy)
    m = Manifest.model_validate_json((copy / "manifest.json").read_text())
    dropped = {f.path for f in m.files if f.path.startswith("slm_decode")}
    assert dropped  # the graph and its weights
    for p in dropped:
        (copy / p).unlink()
    m = m.model_copy(
        update={
            "graphs": [g for g in m.graphs if g.name != "slm_decode"],
            "files": [f for f in m.files if f.path not in dropped],
        }
    )
    (copy / "manifest.json").write_text(m.model_copy(update={"digest": m.content_digest()}).to_json())
    old = load_runtime(copy, "cpu", threads=1)
    assert old.slm.decoder is None
    new = load_runtime(tiny_bundle.bundle, "cpu", threads=1)
    ids = old.bundle.tokenizer.encode(PROMPTS[1]).ids
    a = old.generate(None, ids, mode="slm-alone", max_new_tokens=8)
    b = new.generate(None, ids, mode="slm-alone", max_new_tokens=8)
    assert a.tokens == b.tokens and len(a.tokens) == 8
    assert old.slm.forwards == new.slm.forwards + 7 and new.slm.decoder.forwards == 7  # 8 tree forwards vs 1


def test_decode_masks_in_place_equal_tree_ring_mask_across_requests(tiny_bundle):
    from hycoc.runtime.client import load_runtime

    from hycoc.host import tree_ring_mask

    rt = load_runtime(tiny_bundle.bundle, "cpu", threads=1)
    slm, dec = rt.slm, rt.slm.decoder
    feeds_of, checked = dec.feeds, []

    def feeds(drafter):
        out = feeds_of(drafter)
        for lt in drafter.types:
            sw = drafter.sliding_window if lt == "sliding_attention" else None
            want = tree_ring_mask([-1], drafter.t, drafter.live_start, drafter.ring_len[lt], sw)
            assert np.array_equal(out[f"mask_{lt.removesuffix('_attention')}"], want)
        checked.append(drafter.t)
        return out

    dec.feeds = feeds
    for prompt in (PROMPTS[3], PROMPTS[0], PROMPTS[3]):  # long, short (t goes back), long again
        rt.generate(None, rt.bundle.tokenizer.encode(prompt).ids, mode="slm-alone", max_new_tokens=20)
    assert len(checked) >= 30 and min(checked) < 8 and max(checked) > 2 * max(slm.ring_len.values())


def test_context_groups_put_the_decode_graph_with_the_tree_graph():
    from hycoc.passes.target_step import _context_groups

    assert _context_groups(["head", "slm", "slm_decode"], True) == [["slm", "slm_decode"], ["head"]]
    assert _context_groups(["head", "slm", "slm_decode"], False) == [["head"], ["slm"], ["slm_decode"]]
    assert _context_groups(["head", "slm"], True) == [["head"], ["slm"]]  # an older pipeline: nothing to share


@pytest.mark.qnn
def test_htp_bundle_holds_one_shared_binary_for_both_slm_graphs(tiny_pipeline, tmp_path):
    """target.share_weights: slm and slm_decode compiled into one weight-shared context binary, which the bundle
    lists once and both graphs name; smaller than the two unshared binaries."""
    from hycoc.passes import build as b
    from hycoc.passes.pipeline import PipelineResult
    from hycoc.targets.qnn_ep import versions

    if versions().get("onnxruntime-qnn") is None:
        pytest.skip("onnxruntime-qnn is not installed")
    recipe = tiny_pipeline.recipe
    recipe = recipe.model_copy(update={"target": recipe.target.model_copy(update={"share_weights": True})})
    first = tiny_pipeline.first
    kinds = {"slm": "qdq_slm", "slm_decode": "qdq_slm_decode"}
    step = b.TargetPass("htp-v81", kinds, tmp_path / "work")
    outputs, report = step.run({k: first.artifacts[k] for k in kinds.values()}, recipe)
    graphs = report.numbers["graphs"]
    assert graphs["slm"]["shared_with"] == ["slm_decode"] and graphs["slm_decode"]["shared_with"] == ["slm"]
    assert graphs["slm_decode"]["binary_bytes"] == 0  # counted once
    manifest = b.write_bundle(
        PipelineResult(first.artifacts | outputs, first.reports + [report]), recipe, "htp-v81", tmp_path / "bundle"
    )
    slm, dec = manifest.graph("slm"), manifest.graph("slm_decode")
    assert slm.context_binary == dec.context_binary
    binaries = [f for f in manifest.files if f.role == "context_binary"]
    assert [f.path for f in binaries] == [slm.context_binary]  # one file, listed once
    shared = binaries[0].bytes
    unshared = b.TargetPass("htp-v81", {"slm": "qdq_slm", "slm_decode": "qdq_slm_decode"}, tmp_path / "work2")
    plain, rep2 = unshared.run(
        {k: first.artifacts[k] for k in ("qdq_slm", "qdq_slm_decode")},
        recipe.model_copy(update={"target": recipe.target.model_copy(update={"share_weights": False})}),
    )
    two = rep2.numbers["graphs"]["slm"]["binary_bytes"] + rep2.numbers["graphs"]["slm_decode"]["binary_bytes"]
    print(
        f"tiny: shared {shared:,} B vs unshared {two:,} B (slm alone {rep2.numbers['graphs']['slm']['binary_bytes']:,})"
    )
    assert shared < two
    # On an x86 host the shared binary cannot load (the HTP simulator segfaults on one): refused first, naming the fix.
    import platform

    from hycoc.runtime.graphs import GraphRunError, GraphRunner

    if platform.machine().lower() not in ("x86_64", "amd64"):
        return
    with pytest.raises(
        GraphRunError,
        match=r"weight-shared with slm_decode, which the x86 HTP simulator cannot "
        r"load: rebuild the bundle with \[target\] share_weights = false",
    ):
        GraphRunner(tmp_path / "bundle", manifest, "slm", "htp")
