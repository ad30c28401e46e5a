"""The SLM's static tree graph (passes/slm/graph.py; Alg. 3 line 8, §3.4) against transformers.

Reference: for every tree row, transformers' pre-quantized SLM runs the full sequence "committed tokens + the
row's root-to-node path" with its own causal (and sliding-window) masks, the path rows additionally limited to
the ring's window of committed positions (that is the ring: the last W_T committed positions). The ring's K/V
are that forward's cache entries, placed at column p mod W_T, with garbage in the columns that hold no live
position. The graph's keep-set logits must equal the reference's within 1e-4 and its new K/V rows the
reference's cache entries, for a partly filled ring, a full one and one that wrapped around, with the sliding
window's boundary inside the tree rows. The exported ONNX must match torch on onnxruntime's CPU EP.
"""

from __future__ import annotations

import io

import numpy as np
import onnx_ir as ir
import pytest
import torch
from hycoc.passes.artifacts import KeepSetArtifact
from hycoc.passes.export import compare_with_torch
from hycoc.passes.pipeline import Pipeline
from hycoc.passes.slm.graph import (
    FULL,
    MASK_NEG,
    SLIDING,
    SlmGraphError,
    SlmTreeGraph,
    SlmTreeGraphExport,
    ancestor_matrix,
    export_slm_graph,
    host_inputs,
    ring_positions,
    tree_depths,
    tree_ring_mask,
)
from hycoc.passes.slm.surgery import SlmGraphSurgery, operate
from rich.console import Console
from test_slm_surgery import SLIDING_WINDOW, VOCAB, make_tiny_slm
from transformers import DynamicCache

from hycoc.models import load_slm

torch.set_num_threads(1)

RING = {FULL: 12, SLIDING: 5}
# Rows 0-6 a chain (depths 0..6), row 7 under row 1, row 8 under row 5. With a sliding window of 5, rows at
# depth >= 5 no longer see the first rows of their own path: the window's boundary falls inside the tree.
PARENTS = [-1, 0, 1, 2, 3, 4, 5, 1, 5]
ROWS = len(PARENTS)
KEEP = np.sort(np.random.default_rng(1).choice(VOCAB, 40, replace=False))
# first_position: 6 = ring partly filled, 12 = full ring exactly (no wrap), 19 = wrapped around.
CASES = {"partial": 6, "full": 12, "wrap": 19}


@pytest.fixture(scope="module")
def slm(tmp_path_factory):
    path = make_tiny_slm(tmp_path_factory.mktemp("slm") / "slm", embedding_bits=4)
    return path, load_slm(path), operate(path)[0]


@pytest.fixture(scope="module")
def graph(slm):
    return SlmTreeGraph(slm[2], KEEP, rows=ROWS, ring=RING)


def reference(model, committed, tokens, first):
    """transformers on every row's path -> (logits (R, V), {layer: (k, v) (R, KV, D)}, {layer: (k, v) of the
    committed positions (KV, first, D)})."""
    anc = ancestor_matrix(PARENTS)
    types = model.config.layer_types
    kv_layers = [i for i, m in enumerate(model.config.kv_sharing_modes) if m != "reuse"]
    logits, new, prefix = [], {i: ([], []) for i in kv_layers}, {}
    for j in range(ROWS):
        ids = list(committed[:first]) + [int(tokens[i]) for i in np.flatnonzero(anc[j])]
        pos = np.arange(len(ids))
        masks = {}
        for t in set(types):
            ok = pos[None, :] <= pos[:, None]
            if t == SLIDING:
                ok &= pos[:, None] - pos[None, :] < SLIDING_WINDOW
            ok[np.ix_(pos >= first, pos < first - RING[t])] = False  # path rows: the ring's window only
            masks[t] = torch.from_numpy(np.where(ok, 0.0, torch.finfo(torch.float32).min).astype(np.float32))[
                None, None
            ]
        with torch.no_grad():
            out = model(
                input_ids=torch.tensor([ids]),
                attention_mask=masks,
                position_ids=torch.from_numpy(pos)[None],
                cache=DynamicCache(),
                use_cache=True,
            )
        logits.append(out.logits[0, -1])
        for i in kv_layers:
            layer = out.cache.layers[i]
            new[i][0].append(layer.keys[0, :, -1])
            new[i][1].append(layer.values[0, :, -1])
            prefix[i] = (layer.keys[0, :, :first], layer.values[0, :, :first])
    return (torch.stack(logits), {i: (torch.stack(k, 1), torch.stack(v, 1)) for i, (k, v) in new.items()}, prefix)


def rings_from(graph, prefix, first, rng):
    """Ring inputs: committed position p at column p mod W_T; columns without a position hold garbage."""
    rings = {}
    for i in graph.kv_layers:
        w = graph.ring[graph.layer_types[i]]
        k, v = (
            rng.standard_normal((1, *prefix[i][0].shape[:1], w, prefix[i][0].shape[-1])).astype(np.float32) * 5
            for _ in range(2)
        )
        for p in range(max(0, first - w), first):
            k[0, :, p % w], v[0, :, p % w] = prefix[i][0][:, p].numpy(), prefix[i][1][:, p].numpy()
        rings[i] = (k, v)
    return rings


def case_inputs(graph, slm, first, seed=0):
    rng = np.random.default_rng(seed)
    committed = rng.integers(0, VOCAB, first)
    tokens = rng.integers(0, VOCAB, ROWS)
    logits, new, prefix = reference(slm[1], committed, tokens, first)
    feeds = host_inputs(graph, slm[2], tokens, PARENTS, first, 0, rings_from(graph, prefix, first, rng))
    return [torch.from_numpy(feeds[n]) for n in graph.input_names], logits, new


@pytest.mark.parametrize("case", CASES)
def test_tree_logits_and_new_kv_equal_transformers(graph, slm, case):
    inputs, want_logits, want_new = case_inputs(graph, slm, CASES[case])
    with torch.no_grad():
        out = dict(zip(graph.output_names, graph(*inputs)))
    assert out["logits"].shape == (1, ROWS, len(KEEP))
    torch.testing.assert_close(out["logits"][0], want_logits[:, KEEP], atol=1e-4, rtol=0)
    assert graph.kv_layers == [0, 1]  # layers 2 and 3 are KV-shared: they read layers 0 and 1 (ring + new rows)
    for i, (k, v) in want_new.items():
        torch.testing.assert_close(out[f"k_new_{i}"][0], k, atol=1e-5, rtol=0)
        torch.testing.assert_close(out[f"v_new_{i}"][0], v, atol=1e-5, rtol=0)


def test_activation_scales_of_the_checkpoint_are_applied(slm, tmp_path):
    """A checkpoint with calibrated SRQ activation scales: the graph rounds where transformers does."""
    import shutil

    from safetensors.torch import load_file, save_file

    path = tmp_path / "srq"
    shutil.copytree(slm[0], path)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.mlp.down_proj.input_activation_scale"] = torch.tensor(0.05)
    tensors["model.layers.1.self_attn.o_proj.output_activation_scale"] = torch.tensor(0.02)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    srq = (path, load_slm(path), operate(path)[0])
    assert srq[2].weights["model.layers.0.mlp.down_proj"].input_scale == pytest.approx(0.05)
    graph = SlmTreeGraph(srq[2], KEEP, rows=ROWS, ring=RING)
    inputs, want_logits, _ = case_inputs(graph, srq, CASES["full"])
    _, unrounded, _ = case_inputs(SlmTreeGraph(slm[2], KEEP, rows=ROWS, ring=RING), slm, CASES["full"])
    assert (want_logits - unrounded).abs().max() > 1e-3  # the rounding matters
    with torch.no_grad():
        torch.testing.assert_close(graph(*inputs)[0][0], want_logits[:, KEEP], atol=1e-4, rtol=0)


def test_ring_convention_and_masks():
    # position p sits in column p mod W: a wrapped ring of 5 before position 13 holds 8..12 at columns 3,4,0,1,2
    assert ring_positions(13, 5).tolist() == [10, 11, 12, 8, 9]
    assert ring_positions(3, 5).tolist() == [0, 1, 2, -2, -1]  # columns 3, 4 hold no position yet
    m = tree_ring_mask(PARENTS, 13, 0, 5, SLIDING_WINDOW)[0, 0]
    assert m.shape == (ROWS, 5 + ROWS) and set(np.unique(m)) <= {0.0, MASK_NEG} and np.isfinite(m).all()
    visible = m == 0
    depth = tree_depths(PARENTS)
    # row 0 (position 13) sees ring positions 9..12 (13 - p < 5), not 8; row 6 (position 19) sees no ring column
    assert visible[0, :5].tolist() == [True, True, True, False, True]
    assert not visible[6, :5].any()
    # rows: ancestors within the window only (row 6 at depth 6 sees rows of depth 2..6 on its path)
    assert visible[6, 5:].tolist() == [False, False, True, True, True, True, True, False, False]
    assert (visible[:, 5:] <= ancestor_matrix(PARENTS)).all() and depth[6] == 6
    # full attention: no window, only liveness
    full = tree_ring_mask(PARENTS, 13, 10, 5, None)[0, 0] == 0
    assert full[:, :5].tolist() == [[True, True, True, False, False]] * ROWS
    assert (full[:, 5:] == ancestor_matrix(PARENTS)).all()
    with pytest.raises(SlmGraphError):
        tree_ring_mask([-1, 1], 3, 0, 5, None)


def test_bad_inputs_are_refused(slm):
    with pytest.raises(SlmGraphError, match="keep set"):
        SlmTreeGraph(slm[2], [0, VOCAB], rows=ROWS, ring=RING)
    with pytest.raises(SlmGraphError, match="ring length"):
        SlmTreeGraph(slm[2], KEEP, rows=ROWS, ring={FULL: 12})


def test_export_matches_torch_and_transformers(graph, slm, tmp_path):
    inputs, want_logits, _ = case_inputs(graph, slm, CASES["wrap"], seed=3)
    model, report = export_slm_graph(graph, inputs, tmp_path / "slm.onnx")
    assert (tmp_path / "slm.onnx.data").exists() or report.data_bytes == 0
    # 8 norms in each non-shared layer, 6 in a shared one (no k/v norm), the final norm, the per-layer norm
    assert report.rms_norms == 2 * 8 + 2 * 6 + 2 and report.rms_norms_reshaped > 0
    int8 = [v for v in model.graph.initializers.values() if v.const_value.dtype == ir.DataType.INT8]
    assert len(int8) == len(slm[2].weights) == report.int8_initializers  # integer weights stay integers
    assert all(report.max_abs_error[n] < 1e-4 for n in graph.output_names), report.max_abs_error
    assert report.top1_agreement == 1.0
    # ...and onnxruntime against transformers itself on the wrapped ring
    errors, top1 = compare_with_torch(
        tmp_path / "slm.onnx",
        lambda *x: (want_logits[:, KEEP][None],),
        inputs,
        input_names=graph.input_names,
        output_names=["logits"],
    )
    assert errors["logits"] < 1e-4 and top1 == 1.0


def test_pipeline_export_pass(slm, tmp_path):
    from hycoc.recipe import Recipe

    recipe = Recipe.model_validate(
        {
            "models": {"slm": str(slm[0])},
            "tree": {"node_budget": 6},
            "window": {"slm_window": 16, "slm_sliding_window": 8},
        }
    )
    keep = KeepSetArtifact("keep_set", KEEP)
    pipeline = Pipeline(
        [SlmGraphSurgery(), SlmTreeGraphExport()], tmp_path / "cache", console=Console(file=io.StringIO())
    )
    result = pipeline.run(recipe, {"keep_set": keep})
    numbers = result.reports[1].numbers
    assert numbers["rows"] == 6 and numbers["top1_agreement"] == 1.0
    assert max(numbers["max_abs_error"].values()) < 1e-4
    graph_inputs = {v.name: list(v.shape) for v in result.artifacts["onnx_slm"].payload.graph.inputs}
    assert graph_inputs["mask_full"] == [1, 1, 6, 16 + 6] and graph_inputs["k_ring_0"] == [1, 1, 8, 16]
