"""Top-k in the drafter graphs (docs/device-runtime.md "Host work per round"): passes/topk_outputs.py,
runtime/candidates.py, and the runtime reading the graphs' top-k instead of ranking a keep-set-wide row on the host."""

from __future__ import annotations

import numpy as np
import pytest
from hycoc.runtime.candidates import Candidates, log_softmax, logits_candidates, top_k_indices


def _stable_top_k(x, k):
    return np.argsort(-x, axis=-1, kind="stable")[:, :k]


def test_host_top_k_breaks_ties_to_the_lower_index():
    # hand-worked: values 3 at indices 1, 2, 4, 6; k = 3 takes 1, 2, 4 (lower indices first among the tied 3s)
    assert top_k_indices(np.array([[1, 3, 3, 2, 3, 0, 3]], np.float32), 3).tolist() == [[1, 2, 4]]
    assert top_k_indices(np.array([[5, 5, 1]], np.float32), 2).tolist() == [[0, 1]]
    rng = np.random.default_rng(0)
    x = rng.integers(0, 6, (7, 50)).astype(np.float32)  # many ties, across the k-th value too
    for k in (1, 5, 17, 50, 80):
        np.testing.assert_array_equal(top_k_indices(x, k), _stable_top_k(x, k))
    with pytest.raises(ValueError, match="k >= 1"):
        top_k_indices(x, 0)


def test_logits_candidates_are_log_softmax_at_the_top_indices():
    logits = np.array([[0.0, 2.0, 1.0, 2.0]], np.float32)
    (c,) = logits_candidates(logits, 2)
    assert c.index.tolist() == [1, 3]
    lse = np.log(1 + 2 * np.exp(2) + np.exp(1))
    np.testing.assert_allclose(c.logq, [2 - lse, 2 - lse], rtol=0, atol=1e-12)
    assert c.head(1).index.tolist() == [1] and len(c) == 2


def _logits_model(rows, vocab):
    from onnx import TensorProto, helper

    g = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["logits"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, vocab])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, rows, vocab])],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_graph_top_k_equals_numpy_top_k_with_lower_index_ties():
    import onnx
    import onnxruntime as ort
    from hycoc.passes.topk_outputs import TopKError, append_topk

    model = append_topk(_logits_model(6, 40), 8, with_logq=True)
    onnx.checker.check_model(model)
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 3, (1, 6, 40)).astype(np.float32)  # ties everywhere
    x[0, 5] = rng.standard_normal(40).astype(np.float32) * 4
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    assert got["top_index"].dtype == np.int64 and got["top_index"].shape == (1, 6, 8)
    np.testing.assert_array_equal(got["top_index"][0], _stable_top_k(x[0], 8))
    want = np.take_along_axis(log_softmax(x[0]), got["top_index"][0], -1)
    np.testing.assert_allclose(got["top_logq"][0], want, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(got["logits"], x)  # the logits stay an output for the checks

    head = append_topk(_logits_model(1, 40), 2, with_logq=False)
    assert [o.name for o in head.graph.output] == ["logits", "top_index"]
    with pytest.raises(TopKError, match="already has top-k"):
        append_topk(head, 2, with_logq=False)
    with pytest.raises(TopKError, match="outside"):
        append_topk(_logits_model(1, 40), 41, with_logq=False)
    with pytest.raises(TopKError, match="no output 'scores'"):
        append_topk(_logits_model(1, 40), 2, with_logq=False, logits="scores")


# ---- the bundle's graphs: the new path (graph top-k) against the old one (host top-k of the logits) -------------


def _check_runner(tiny_pipeline, name):
    """A runner of graph ``name``'s checks copy (the QDQ graph with its ``logits`` output, kept by the target step
    beside the shipped graph), fetching everything but the top-k: the host top-k path."""
    import onnxruntime as ort
    from hycoc.passes.bundle_io import graph_io_from_onnx
    from hycoc.runtime.graphs import GraphRunner

    from hycoc.bundle import GraphEntry

    files = tiny_pipeline.first.artifacts["target_files"]
    path = files.payload / files.index()[name]["check_source"]
    io = graph_io_from_onnx(path)
    entry = GraphEntry(
        name=name, role="slm" if name.startswith("slm") else name, file=path.name, inputs=io.inputs, outputs=io.outputs
    )
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    return GraphRunner.from_session(
        entry, session, outputs=[t.name for t in io.outputs if not t.name.startswith("top_")]
    )


def _runners(tiny_bundle, tiny_pipeline):
    from hycoc.runtime.device_bundle import open_bundle
    from hycoc.runtime.graphs import GraphRunner, RunnerSettings, runtime_outputs

    bundle = open_bundle(tiny_bundle.bundle, "cpu")
    m = bundle.manifest
    out = {}
    for name in ("head", "slm"):
        names = [t.name for t in m.graph(name).outputs]
        # the shipped graph outputs only what the runtime reads: no keep-set-wide logits beside the top-k
        assert "top_index" in names and "logits" not in names and runtime_outputs(m.graph(name)) == names
        out[name] = (
            GraphRunner(bundle.path, m, name, "cpu", runtime_outputs(m.graph(name)), RunnerSettings(threads=1)),
            _check_runner(tiny_pipeline, name),
        )
    return bundle, out


def test_shipped_graphs_have_no_keep_set_wide_output(tiny_bundle):
    """Every graph of the tiny bundle: no output as wide as the keep set (its top-k instead); the checks copy the
    target step keeps still has the logits."""
    from hycoc.bundle import load_manifest

    m = load_manifest(tiny_bundle.bundle)
    keep = m.keep_set_size
    for g in m.graphs:
        # h_next is the hidden size wide (64 in the tiny recipe, by chance the keep set's size too)
        wide = [t.name for t in g.outputs if t.shape and t.shape[-1] == keep and t.name != "h_next"]
        assert not wide, f"graph {g.name} outputs {wide} ({keep} wide)"
        assert "top_index" in {t.name for t in g.outputs}


def test_trees_from_graph_top_k_equal_the_host_path_on_the_tiny_bundle(tiny_bundle, tiny_pipeline):
    from hycoc.runtime.client import DeviceRuntime
    from lockstep import hyco_rounds

    bundle, runners = _runners(tiny_bundle, tiny_pipeline)
    new = DeviceRuntime(bundle, runners["head"][0], runners["slm"][0])
    old = DeviceRuntime(bundle, runners["head"][1], runners["slm"][1])
    prompt = bundle.tokenizer.encode("How do I read a file line by line in Python?").ids
    hidden = runners["head"][0].shape("x_hat")[-1] // 2
    kv = {s: int(np.prod(runners["head"][0].shape(f"k_{s}")[1::2])) for s in ("sliding", "full")}
    trees = 0
    for (d_new, b_new), (d_old, b_old) in hyco_rounds([new, old], prompt, 6, np.random.default_rng(3), hidden, kv):
        assert (d_new.chain, d_new.runner_ups) == (d_old.chain, d_old.runner_ups)  # the head's top-2
        np.testing.assert_array_equal(b_new.tokens, b_old.tokens)
        np.testing.assert_array_equal(b_new.parents, b_old.parents)
        scores_new = [n.score for n in b_new.tree.nodes]
        np.testing.assert_allclose(scores_new, [n.score for n in b_old.tree.nodes], rtol=0, atol=1e-5)
        trees += sum(n.source == "slm" for n in b_new.tree.nodes) > 0  # trees with SLM candidates in them
    assert trees == 6 and new.slm.tokens == old.slm.tokens


def test_old_bundle_without_top_k_outputs_is_refused(tiny_bundle, tmp_path):
    import shutil

    from hycoc.runtime.device_bundle import open_bundle

    from hycoc.bundle import Manifest, ManifestInvalid

    copy = tmp_path / "old"
    shutil.copytree(tiny_bundle.bundle, copy)
    m = Manifest.model_validate_json((copy / "manifest.json").read_text())
    graphs = [
        g.model_copy(update={"outputs": [o for o in g.outputs if not o.name.startswith("top_")]}) for g in m.graphs
    ]  # what an older hycoc wrote: logits only
    m = m.model_copy(update={"graphs": graphs})
    (copy / "manifest.json").write_text(m.model_copy(update={"digest": m.content_digest()}).to_json())
    with pytest.raises(ManifestInvalid, match="no top_index output .*rebuild it"):
        open_bundle(copy, "cpu")


def test_candidates_head_keeps_order():
    c = Candidates(np.array([4, 1, 7]), np.array([-0.1, -0.2, -0.2]))
    assert c.head(2).index.tolist() == [4, 1] and c.head(5).logq.tolist() == [-0.1, -0.2, -0.2]


def test_io_binding_runs_equal_the_plain_runs_on_the_tiny_bundle(tiny_bundle):
    from hycoc.runtime.client import MODES, load_runtime

    plain = load_runtime(tiny_bundle.bundle, "cpu", threads=1)
    bound = load_runtime(tiny_bundle.bundle, "cpu", threads=1, io_binding=True)
    assert bound.slm.runner._binding is not None and plain.slm.runner._binding is None
    prompt = plain.bundle.tokenizer.encode("Explain list comprehensions with an example, please.").ids
    for rt in (plain, bound):
        rt.slm.start(prompt)
        rt.slm.prefill(reserve=6)
    for _ in range(4):  # SpecEdge-style trees: several forwards kept until the commit
        built = [
            rt.builder(MODES["specedge"], plain.bundle.round.node_budget + 1).build(
                rt.slm.tokens[-1], [], [], rt.slm.expand
            )
            for rt in (plain, bound)
        ]
        np.testing.assert_array_equal(built[0].tokens, built[1].tokens)
        np.testing.assert_array_equal(built[0].parents, built[1].parents)
        assert built[0].slm_passes >= 2
        path = [j for j in range(1, 4) if built[0].parents[j] == j - 1]
        new = [int(built[0].tokens[j]) for j in path] + [int(plain.bundle.keep_set[7])]
        for rt, b in zip((plain, bound), built):
            rt.slm.commit([b.row_node[j] for j in path], new)
    for i in plain.slm.kv_layers:  # the rings hold the same committed KV, bit for bit
        for a, b in zip(plain.slm.rings[i], bound.slm.rings[i]):
            np.testing.assert_array_equal(a, b)
    assert bound.slm.runner.calls == plain.slm.runner.calls > 4


# ---- top-k order among equal values on the HTP ------------------------------------------------------------------


def _tie_rows(rows, vocab, seed=0):
    """float32 (1, rows, vocab) on a 1/8 grid in [-4, 4] (exact in fp16 and in uint16 codes of scale 1/8192): each
    row has runs of equal values at the top, across the k-th place, or is all one value."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.uniform(-3, 3, (rows, vocab)) * 8) / 8
    for r in range(rows):
        if r % 3 == 0:
            x[r, rng.choice(vocab, 5, replace=False)] = 3.5
        elif r % 3 == 1:
            x[r, rng.choice(vocab, vocab // 2, replace=False)] = 2.0  # many equal values at the k-th place
        else:
            x[r] = 1.25
    return x[None].astype(np.float32)


def test_htp_tie_order_puts_the_higher_index_first_where_topk_puts_the_lower():
    """The HTP rewrite on the CPU EP: reversed along the axis, ties come out higher index first (the HTP's own rule,
    measured on the simulator), so on the HTP the rewritten graph gives ONNX TopK's lower-index-first order. Rows
    without ties and log q are unchanged."""
    import onnxruntime as ort
    from hycoc.passes.topk_outputs import append_topk, htp_tie_order

    x = _tie_rows(6, 40)
    x[0, 5] = np.arange(40, dtype=np.float32)[::-1] / 8  # a row without ties
    plain = append_topk(_logits_model(6, 40), 8, with_logq=True)
    ordered = append_topk(_logits_model(6, 40), 8, with_logq=True)
    assert htp_tie_order(ordered) == 1
    assert [n.op_type for n in ordered.graph.node].count("Slice") == 1

    def run(m):
        session = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        return dict(zip(["top_index", "top_logq"], session.run(["top_index", "top_logq"], {"x": x})))

    a, b = run(plain), run(ordered)
    np.testing.assert_array_equal(a["top_index"][0], _stable_top_k(x[0], 8))
    higher_first = np.stack([39 - _stable_top_k(row[::-1][None], 8)[0] for row in x[0]])
    np.testing.assert_array_equal(b["top_index"][0], higher_first)
    np.testing.assert_array_equal(b["top_index"][0, 5], a["top_index"][0, 5])
    np.testing.assert_allclose(b["top_logq"], a["top_logq"], rtol=0, atol=1e-6)
    assert not np.array_equal(a["top_index"], b["top_index"])  # the ties are there


@pytest.mark.qnn
@pytest.mark.skipif(
    not __import__("hycoc.targets.qnn_ep", fromlist=["qnn_installed"]).qnn_installed(),
    reason="onnxruntime-qnn is not importable: install the qnn extra for the HTP simulator",
)
def test_htp_top_k_order_among_equal_values_equals_the_cpu_ep_on_the_simulator(tmp_path):
    """The graph tail compiled for htp-v81 with `htp_tie_order` (as the htp target ships it) gives, on the x86 HTP
    simulator, the CPU EP's top-k of the plain graph index for index, on rows full of ties (values exact in fp16).
    Without the rewrite the HTP gives the higher index first (``benchmarks/htp_graph_io.py ties``: 30 of 32 rows
    differed)."""
    import onnx
    import onnxruntime as ort
    from hycoc.passes.topk_outputs import append_topk, htp_tie_order
    from hycoc.targets.htp import HtpSession, compile_context
    from hycoc.targets.profiles import get_profile

    x = _tie_rows(6, 64)
    model = append_topk(_logits_model(6, 64), 8, with_logq=False)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        ["top_index"], {"x": x}
    )[0]
    htp_tie_order(model)
    onnx.save(model, str(tmp_path / "tail.onnx"))
    cg = compile_context(tmp_path / "tail.onnx", tmp_path / "c", get_profile("htp-v81"), graph_name="tail")
    got = HtpSession(cg.ctx_model).run({"x": x})["top_index"]
    np.testing.assert_array_equal(got, want)
