"""The SLM tree graph sharded by layers (passes/slm/graph.py "Shards", passes/slm/shards.py; docs/compiler.md
"Layer-sharded SLM").

The shards chained by name on the tiny SLM (4 layers: producers 0 (sliding) and 1 (full), KV-shared consumers 2
and 3) must give the monolithic graph's logits and new K/V on the same weights and inputs, to float32 rounding,
for splits where the consumers' producers sit in an earlier shard (measured: bit-exact). (The exported shards
against torch on onnxruntime's CPU EP: tests/test_slm_shard_bundle.py, through the build.) The shard plan
chooser balances weight bytes and refuses what cannot fit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hycoc.passes.slm.graph import SlmGraphError, SlmTreeGraph, example_feeds
from hycoc.passes.slm.shard_chain import run_shard_chain, shard_graphs
from hycoc.passes.slm.shards import ShardPlanError, layer_weight_bytes, plan_shards
from hycoc.passes.slm.surgery import operate
from test_slm_graph import KEEP, RING, ROWS
from test_slm_surgery import make_tiny_slm

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def slm(tmp_path_factory):
    return operate(make_tiny_slm(tmp_path_factory.mktemp("slm") / "slm", embedding_bits=4))[0]


@pytest.fixture(scope="module")
def mono(slm):
    return SlmTreeGraph(slm, KEEP, rows=ROWS, ring=RING)


def _run(graph, feeds):
    with torch.no_grad():
        out = graph(*[torch.from_numpy(feeds[n]) for n in graph.input_names])
    return {n: o.numpy() for n, o in zip(graph.output_names, out)}


@pytest.mark.parametrize("bounds", [(0, 2, 4), (0, 1, 3, 4), (0, 3, 4)], ids=lambda b: "-".join(map(str, b)))
def test_chained_shards_equal_the_monolithic_graph(slm, mono, bounds):
    shards = shard_graphs(slm, KEEP, rows=ROWS, ring=RING, bounds=bounds)
    # every consumer's producer sits in an earlier shard for these splits: shard inputs carry its ring + new KV
    assert any(g.borrowed for g in shards)
    if bounds == (0, 2, 4):
        assert shards[1].borrowed == [0, 1]
        assert shards[1].input_names == [
            "hidden_2",
            "per_layer_2_4",
            "cos_full",
            "sin_full",
            "mask_full",
            "cos_sliding",
            "sin_sliding",
            "mask_sliding",
            "k_ring_0",
            "v_ring_0",
            "k_new_0",
            "v_new_0",
            "k_ring_1",
            "v_ring_1",
            "k_new_1",
            "v_new_1",
        ]
        assert shards[0].output_names == ["hidden_2", "per_layer_2_4", "k_new_0", "v_new_0", "k_new_1", "v_new_1"]
        assert shards[1].output_names == ["logits"]
    for seed in (0, 1):
        feeds = example_feeds(mono, slm, seed)
        want = _run(mono, feeds)
        got, _ = run_shard_chain(shards, feeds)
        for name in mono.output_names:
            assert got[name].shape == want[name].shape
            assert np.array_equal(got[name], want[name]), name  # bit-exact: the same ops on the same floats

    # the weights are split, not copied: the shards' parameters add up to the monolithic graph's
    def count(g):
        return sum(t.numel() for t in [*g.parameters(), *g.buffers()])

    assert sum(count(g) for g in shards) == count(mono)


def test_unsharded_graph_is_the_monolithic_one(slm, mono):
    g = SlmTreeGraph(slm, KEEP, rows=ROWS, ring=RING, bounds=(0, 4))
    assert g.input_names == mono.input_names and g.output_names == mono.output_names
    assert mono.input_names[:2] == ["inputs_embeds", "per_layer_inputs"] and mono.borrowed == []
    assert list(mono.host_shapes) == mono.input_names
    feeds = example_feeds(mono, slm)
    a, b = _run(g, feeds), _run(mono, feeds)
    assert all(np.array_equal(a[n], b[n]) for n in mono.output_names)


def test_bad_bounds_are_refused(slm):
    for bounds in [(0, 4, 4), (1, 4), (0, 2, 5), (0,)]:
        with pytest.raises(SlmGraphError, match="rise strictly from 0 to the layer count 4"):
            SlmTreeGraph(slm, KEEP, rows=ROWS, ring=RING, bounds=bounds)
    with pytest.raises(SlmGraphError, match="shard 2 outside"):
        SlmTreeGraph(slm, KEEP, rows=ROWS, ring=RING, bounds=(0, 2, 4), shard=2)


def test_plan_balances_weight_bytes_and_refuses_what_cannot_fit():
    layers = [10, 10, 10, 10, 10, 10]
    p = plan_shards(layers, budget=100, shards=2, first_extra=20, last_extra=40)
    # totals 20+60+40 = 120; best 2-way split: [0,4) = 60, [4,6) = 60
    assert p.bounds == (0, 4, 6) and p.shard_bytes == (60, 60) and p.fits
    auto = plan_shards(layers, budget=50, shards="auto", first_extra=20, last_extra=40)
    assert auto.shards == 3 and max(auto.shard_bytes) == 50 and sum(auto.shard_bytes) == 120 and auto.fits
    assert plan_shards(layers, budget=500, shards="auto").bounds == (0, 6)
    assert plan_shards(layers, budget=10, shards=1).bounds == (0, 6)  # fixed count: planned, not fitted
    assert not plan_shards(layers, budget=10, shards=1).fits
    with pytest.raises(ShardPlanError, match="layer 5 alone needs 50 bytes"):
        plan_shards(layers, budget=45, shards="auto", last_extra=40)
    with pytest.raises(ShardPlanError, match="slm_shards = 7"):
        plan_shards(layers, budget=100, shards=7)


def test_layer_weight_bytes_count_int4_as_half_bytes(slm):
    per_layer, first, last = layer_weight_bytes(slm, len(KEEP))
    assert len(per_layer) == 4 and all(b > 0 for b in per_layer)
    head = slm.weights["lm_head"]
    assert last >= len(KEEP) * head.q.shape[1] + 4 * len(KEEP)  # int8 rows + float32 scales
    w = slm.weights["model.layers.0.mlp.gate_proj"]
    assert w.bits == 4
