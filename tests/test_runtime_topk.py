"""Top-k in the drafter graphs (issue 16): passes/topk_outputs.py, runtime/candidates.py, and the runtime reading
the graphs' top-k instead of ranking a keep-set-wide row on the host."""

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
    x = rng.integers(0, 6, (7, 50)).astype(np.float32)          # many ties, across the k-th value too
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

    g = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, vocab])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, rows, vocab])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)])


def test_graph_top_k_equals_numpy_top_k_with_lower_index_ties():
    import onnx
    import onnxruntime as ort

    from hycoc.passes.topk_outputs import TopKError, append_topk

    model = append_topk(_logits_model(6, 40), 8, with_logq=True)
    onnx.checker.check_model(model)
    rng = np.random.default_rng(1)
    x = rng.integers(-3, 3, (1, 6, 40)).astype(np.float32)        # ties everywhere
    x[0, 5] = rng.standard_normal(40).astype(np.float32) * 4
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, {"x": x})))
    assert got["top_index"].dtype == np.int64 and got["top_index"].shape == (1, 6, 8)
    np.testing.assert_array_equal(got["top_index"][0], _stable_top_k(x[0], 8))
    want = np.take_along_axis(log_softmax(x[0]), got["top_index"][0], -1)
    np.testing.assert_allclose(got["top_logq"][0], want, rtol=0, atol=2e-6)
    np.testing.assert_array_equal(got["logits"], x)                # the logits stay an output for the checks

    head = append_topk(_logits_model(1, 40), 2, with_logq=False)
    assert [o.name for o in head.graph.output] == ["logits", "top_index"]
    with pytest.raises(TopKError, match="already has top-k"):
        append_topk(head, 2, with_logq=False)
    with pytest.raises(TopKError, match="outside"):
        append_topk(_logits_model(1, 40), 41, with_logq=False)
    with pytest.raises(TopKError, match="no output 'scores'"):
        append_topk(_logits_model(1, 40), 2, with_logq=False, logits="scores")


# ---- the bundle's graphs: the new path (graph top-k) against the old one (host top-k of the logits) -------------


def _runners(tiny_bundle):
    from hycoc.runtime.device_bundle import open_bundle
    from hycoc.runtime.graphs import GraphRunner, runtime_outputs

    bundle = open_bundle(tiny_bundle.bundle, "cpu")
    m = bundle.manifest
    out = {}
    for name in ("head", "slm"):
        names = [t.name for t in m.graph(name).outputs]
        assert "top_index" in names and runtime_outputs(m.graph(name)) == [n for n in names if n != "logits"]
        out[name] = (GraphRunner(bundle.path, m, name, "cpu", 1, outputs=runtime_outputs(m.graph(name))),
                     GraphRunner(bundle.path, m, name, "cpu", 1, outputs=[n for n in names if not n.startswith("top_")]))
    return bundle, out


def test_trees_from_graph_top_k_equal_the_host_path_on_the_tiny_bundle(tiny_bundle):
    from hycoc.protocol.messages import HandOff
    from hycoc.runtime.client import MODES, DeviceRuntime

    bundle, runners = _runners(tiny_bundle)
    new = DeviceRuntime(bundle, runners["head"][0], runners["slm"][0])
    old = DeviceRuntime(bundle, runners["head"][1], runners["slm"][1])
    rng = np.random.default_rng(3)
    prompt = bundle.tokenizer.encode("How do I read a file line by line in Python?").ids
    hidden = runners["head"][0].shape("x_hat")[-1] // 2
    kv = {s: int(np.prod(runners["head"][0].shape(f"k_{s}")[1::2])) for s in ("sliding", "full")}
    trees = 0
    for rt in (new, old):
        rt.slm.start(prompt)
        rt.mtp.reset()
    t = len(prompt) - 1
    a = max(0, t - bundle.round.head_window)
    for _ in range(6):
        r8 = lambda *s: rng.integers(-60, 60, s).astype(np.int8)  # noqa: E731
        h = HandOff(t_prime=t, a=a, bonus=int(prompt[-1]), x_hat=r8(2 * hidden),
                    k_sliding=r8(t - a, kv["sliding"]), v_sliding=r8(t - a, kv["sliding"]), k_full=r8(t - a, kv["full"]),
                    v_full=r8(t - a, kv["full"]), scales=(0.05, 0.05, 0.05, 0.05, 0.05, 0.05))
        built = []
        for rt in (new, old):
            rt.mtp.ingest(h)
            d = rt.mtp.draft()
            built.append((d, rt.builder(MODES["hyco"], bundle.round.node_budget + 1).build(
                rt.slm.tokens[-1], d.chain, d.runner_ups, rt.slm.expand)))
        (d_new, b_new), (d_old, b_old) = built
        assert (d_new.chain, d_new.runner_ups) == (d_old.chain, d_old.runner_ups)     # the head's top-2
        np.testing.assert_array_equal(b_new.tokens, b_old.tokens)
        np.testing.assert_array_equal(b_new.parents, b_old.parents)
        scores_new = [n.score for n in b_new.tree.nodes]
        np.testing.assert_allclose(scores_new, [n.score for n in b_old.tree.nodes], rtol=0, atol=1e-5)
        trees += sum(n.source == "slm" for n in b_new.tree.nodes) > 0      # trees with SLM candidates in them
        path = [j for j in range(1, 3) if b_new.parents[j] == j - 1]      # accept up to 2 chain rows + a bonus
        commit = [int(b_new.tokens[j]) for j in path] + [int(bundle.keep_set[rng.integers(len(bundle.keep_set))])]
        for rt, b in ((new, b_new), (old, b_old)):
            rt.slm.commit([b.row_node[j] for j in path], commit)
        a, t = t, t + len(commit)
    assert trees == 6 and new.slm.tokens == old.slm.tokens


def test_old_bundle_without_top_k_outputs_is_refused(tiny_bundle, tmp_path):
    import shutil

    from hycoc.bundle import Manifest, ManifestInvalid
    from hycoc.runtime.device_bundle import open_bundle

    copy = tmp_path / "old"
    shutil.copytree(tiny_bundle.bundle, copy)
    m = Manifest.model_validate_json((copy / "manifest.json").read_text())
    graphs = [g.model_copy(update={"outputs": [o for o in g.outputs if not o.name.startswith("top_")]})
              for g in m.graphs]                          # what an older hycoc wrote: logits only
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
    for _ in range(4):                       # SpecEdge-style trees: several forwards kept until the commit
        built = [rt.builder(MODES["specedge"], plain.bundle.round.node_budget + 1).build(
            rt.slm.tokens[-1], [], [], rt.slm.expand) for rt in (plain, bound)]
        np.testing.assert_array_equal(built[0].tokens, built[1].tokens)
        np.testing.assert_array_equal(built[0].parents, built[1].parents)
        assert built[0].slm_passes >= 2
        path = [j for j in range(1, 4) if built[0].parents[j] == j - 1]
        new = [int(built[0].tokens[j]) for j in path] + [int(plain.bundle.keep_set[7])]
        for rt, b in zip((plain, bound), built):
            rt.slm.commit([b.row_node[j] for j in path], new)
    for i in plain.slm.kv_layers:             # the rings hold the same committed KV, bit for bit
        for a, b in zip(plain.slm.rings[i], bound.slm.rings[i]):
            np.testing.assert_array_equal(a, b)
    assert bound.slm.runner.calls == plain.slm.runner.calls > 4
