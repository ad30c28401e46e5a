"""The SLM as layer shards end to end on the tiny recipe (docs/compiler.md "Layer-sharded SLM"): ``[target] slm_shards =
2`` builds ``slm.s0`` + ``slm.s1`` (passes/slm/shard_build.py, the unsharded build's cache reused up to the surgery: its
keys are unchanged), the runtime chains them (`ShardChainRunner`) behind the `GraphRunner` contract, and SLM-alone
decoding at T = 0 writes the unsharded bundle's text, token for token, on the cpu backend.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from hycoc.passes import build as b
from rich.console import Console

from hycoc.bundle import chain_io
from hycoc.recipe import load_recipe


@pytest.fixture(scope="module")
def sharded(tiny_pipeline):
    p = tiny_pipeline
    text = p.path.read_text()
    assert text.count("[target]\n") == 1
    path = p.root / "recipe-shards.toml"
    path.write_text(text.replace("[target]\n", "[target]\nslm_shards = 2\n"))
    recipe = load_recipe(path)
    out = p.root / "bundle-shards"
    res = b.build_bundle(recipe, "cpu", out, p.cache, b.BuildSettings(console=Console(file=io.StringIO())))
    return res, out


def _runtime(folder, sharded_slm: bool):
    from hycoc.runtime.client import DeviceRuntime
    from hycoc.runtime.device_bundle import open_bundle
    from hycoc.runtime.graphs import GraphRunner, RunnerSettings, ShardChainRunner, open_graph, runtime_outputs

    bundle = open_bundle(folder, "cpu")
    m = bundle.manifest
    head = GraphRunner(bundle.path, m, "head", "cpu", runtime_outputs(m.graph("head")), RunnerSettings(threads=1))
    slm = open_graph(bundle.path, m, "slm", "cpu", runtime_outputs(m.chain_entry("slm")), RunnerSettings(threads=1))
    assert isinstance(slm, ShardChainRunner) is sharded_slm
    return DeviceRuntime(bundle, head, slm)  # no slm_decode runner: both decode on the tree graph


def test_shard_build_reuses_the_cache_and_lists_the_shards(sharded, tiny_bundle):
    res, out = sharded
    ran = {r.pass_name: r.cached for r in res.pipeline.reports}
    assert list(ran)[-3:] == ["slm_surgery", "slm_shards", "target_cpu"]
    assert all(
        ran[n] for n in ("keep_set", "calibration_answers", "head_qat", "head_export", "qdq_head", "slm_surgery")
    ), ran  # same keys as the unsharded build
    m = res.manifest
    assert [g.name for g in m.graphs if g.role == "slm"] == ["slm.s0", "slm.s1"]
    assert [g.name for g in m.graph_chain("slm")] == ["slm.s0", "slm.s1"]
    numbers = next(r.numbers for r in res.pipeline.reports if r.pass_name == "slm_shards")
    assert numbers["bounds"] == [0, 2, 4] and numbers["shards"][1]["borrowed"] == [0, 1]
    # each exported shard on onnxruntime's CPU EP against torch (shard 1 takes hidden_2, per_layer_2_4 and both
    # producers' ring + new KV from the host and shard 0)
    assert all(s["export_max_error"] < 1e-4 for s in numbers["shards"]), numbers["shards"]
    # the chain's IO is the unsharded graph's: same host inputs, same outputs (the shards' order)
    from hycoc.bundle import load_manifest

    mono = load_manifest(tiny_bundle.bundle).graph("slm")
    ins, outs = chain_io(m.graph_chain("slm"))
    assert sorted(t.name for t in ins) == sorted(t.name for t in mono.inputs)
    assert sorted(t.name for t in outs) == sorted(t.name for t in mono.outputs)
    assert {t.name: t.shape for t in ins} == {t.name: t.shape for t in mono.inputs}


def test_every_softmax_output_of_the_shards_is_0_1(sharded):
    """The layer-sharded build quantizes each shard on its own calibration: its Softmax outputs get the fixed
    [0, 1] encoding all the same (tests/test_qdq.py `assert_softmax_fixed`), and no shard ships the logits."""
    import onnx
    from test_qdq import assert_softmax_fixed

    res, out = sharded
    counts = [
        assert_softmax_fixed(onnx.load(str(out / g.file), load_external_data=False), g.name)
        for g in res.manifest.graphs
        if g.role == "slm"
    ]
    assert counts == [2, 2]  # the tiny SLM's 4 layers, 2 per shard
    assert all("logits" not in {t.name for t in g.outputs} for g in res.manifest.graphs)


def test_chained_shards_draft_as_the_unsharded_graph(sharded, tiny_bundle):
    one, two = _runtime(tiny_bundle.bundle, False), _runtime(sharded[1], True)
    d1, d2 = one.slm, two.slm
    rng = np.random.default_rng(0)
    rows = d1.rows
    tokens = [int(x) for x in one.bundle.keep_set[rng.integers(0, len(one.bundle.keep_set), rows)]]
    parents = [-1] + [int(rng.integers(max(0, j - 3), j)) for j in range(1, rows)]
    for d in (d1, d2):
        d.start(tokens[:5])
    a = d1.runner.run(d1.feeds(tokens, parents, 5))
    c = d2.runner.run(d2.feeds(tokens, parents, 5))
    assert set(a) == set(c) and d2.runner.calls == 1
    assert np.array_equal(a["top_index"][..., :4], c["top_index"][..., :4])
    for name in a:
        if name.startswith(("k_new", "v_new", "top_logq")):
            assert np.max(np.abs(a[name] - c[name])) < 0.05, name


def test_slm_alone_text_at_t0_equals_the_unsharded_bundle(sharded, tiny_bundle):
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, 100, 6)]
    got = [
        _runtime(f, s).generate(None, prompt, mode="slm-alone", max_new_tokens=12)
        for f, s in ((tiny_bundle.bundle, False), (sharded[1], True))
    ]
    assert len(got[0].tokens) == 12
    assert got[1].tokens == got[0].tokens and got[1].text == got[0].text


def test_shards_with_quantized_io_decode_the_float_shards_text(sharded, tmp_path):
    """``[target] quantized_io`` on the sharded build (only the target step reruns): every shard takes its rings,
    and shard 1 shard 0's new KV rows, as uint16 codes; SLM-alone decoding through the chain (rows between shards
    passed as codes) writes the float-IO shards' text, token for token, with rings holding their codes exactly."""
    from hycoc.passes.pipeline import PipelineResult
    from hycoc.passes.slm.shard_build import KIND
    from hycoc.runtime.client import load_runtime
    from hycoc.runtime.graphs import quantize

    _, out = sharded
    base = load_recipe(out.parent / "recipe-shards.toml")  # the `sharded` fixture's recipe
    # its artifacts as the cache holds them (every pass a cache hit)
    res = b.run_pipeline(base, "cpu", out.parent / "cache", b.BuildSettings(console=Console(file=io.StringIO())))
    q = base.model_copy(update={"target": base.target.model_copy(update={"quantized_io": True})})
    step = b.TargetPass("cpu", {"head": "qdq_head", "slm": KIND}, tmp_path / "work")
    outputs, _ = step.run({k: res.artifacts[k] for k in ("qdq_head", KIND)}, q)
    result = PipelineResult(res.artifacts | outputs, res.reports)
    m = b.write_bundle(result, q, "cpu", tmp_path / "bundle")
    s1 = m.graph("slm.s1")
    assert {t.dtype for t in s1.inputs if t.name.startswith(("k_", "v_"))} == {"uint16"}
    assert any(t.name.startswith("k_new_") for t in s1.inputs)  # rows from shard 0, as codes
    prompt = [int(x) for x in np.random.default_rng(1).integers(3, 100, 6)]
    rts = [load_runtime(out, "cpu", threads=1), load_runtime(tmp_path / "bundle", "cpu", threads=1)]
    got = [rt.generate(None, prompt, mode="slm-alone", max_new_tokens=12) for rt in rts]
    assert len(got[0].tokens) == 12 and got[1].tokens == got[0].tokens
    fl, qu = rts[0].slm, rts[1].slm
    for i in fl.kv_layers:
        for x, codes, enc in zip(fl.rings[i], qu.rings[i], qu.ring_encodings[i]):
            assert codes.dtype == np.uint16
            np.testing.assert_array_equal(codes, quantize(x, enc))
