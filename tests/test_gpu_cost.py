"""The projection's GPU cost line from a model's config (hycoc/bench/capacity/gpu_cost.py): the expected distinct
experts a forward touches (an exact enumeration and a simulation of random top-k routing), the config's counts worked by
hand on a small made-up config, the roofline on a hand-sized GPU, the fit to two rounds recovering known terms, and
the measured batched line of a cost-model file. Fast: numpy only."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from hycoc.bench.capacity.gpu_cost import (
    BF16_WEIGHTS,
    GPU_SPECS,
    Efficiency,
    GpuCostError,
    GpuRoofline,
    GpuSpec,
    ModelShape,
    WeightFormat,
    expected_experts,
    fit_paper,
    gpu_spec,
    roofline_parts,
)

#: A made-up MoE config (Gemma 4 field names, small numbers to work by hand): one sliding and one full layer.
TINY = {
    "text_config": {
        "num_hidden_layers": 2,
        "layer_types": ["sliding_attention", "full_attention"],
        "hidden_size": 8,
        "num_attention_heads": 2,
        "head_dim": 4,
        "num_key_value_heads": 1,
        "global_head_dim": 8,
        "num_global_key_value_heads": 1,
        "attention_k_eq_v": True,
        "sliding_window": 4,
        "intermediate_size": 16,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 6,
        "vocab_size": 10,
    }
}


def test_expected_experts_equals_an_exact_enumeration():
    """E = 4 experts, k = 2, n = 2 rows: the 6 x 6 equally likely pairs of 2-subsets; the union holds 2 experts
    when both rows pick the same pair (6 cases), 4 when disjoint (6), 3 otherwise (24): mean 108 / 36 = 3 =
    4 (1 - (1 - 2/4)^2). And for E = 5, k = 2, n = 3 by enumerating all 10^3 routings."""
    assert float(expected_experts(2, 4, 2)) == pytest.approx(3.0)
    subsets = list(itertools.combinations(range(5), 2))
    mean = np.mean([len(set(a) | set(b) | set(c)) for a, b, c in itertools.product(subsets, repeat=3)])
    assert float(expected_experts(3, 5, 2)) == pytest.approx(mean)
    assert float(expected_experts(1, 128, 8)) == pytest.approx(8.0)  # one row: its k experts
    assert float(expected_experts(10_000, 128, 8)) == pytest.approx(128.0)  # many rows: all of them
    assert float(expected_experts(33, 0, 0)) == 0.0  # a dense model has none


@pytest.mark.parametrize("rows", [1, 5, 33, 132])
def test_expected_experts_matches_simulated_random_top_k(rows):
    """Random routing (each row's top-8 of 128 i.i.d. router logits: a uniformly random 8-subset): the mean
    distinct experts of 3,000 simulated forwards is within 4 standard errors of E (1 - (1 - k/E)^n)."""
    rng = np.random.default_rng(rows)
    e, k, trials = 128, 8, 3000
    logits = rng.random((trials, rows, e))
    top = np.argpartition(logits, -k, axis=-1)[..., -k:]  # each row's top-k experts
    hit = np.zeros((trials, e), bool)
    np.put_along_axis(hit, top.reshape(trials, -1), True, axis=1)
    distinct = hit.sum(axis=1)
    se = distinct.std(ddof=1) / np.sqrt(trials) + 1e-9
    assert abs(distinct.mean() - float(expected_experts(rows, e, k))) < 4 * se + 1e-6


def test_config_counts_worked_by_hand():
    """TINY: attention, sliding 2 x 8 x 2 x 4 (q, o) + 2 x 8 x 1 x 4 (k, v) = 192; full (k = v: no v) 2 x 8 x 2 x 8 +
    8 x 1 x 8 = 320. Dense MLP + router per layer 3 x 8 x 16 + 8 x 4 = 416. An expert 3 x 8 x 6 = 144. LM head 80.
    KV per position: sliding 2 x 1 x 4 x 2 B = 16, full 2 x 1 x 8 x 2 B = 32; at context 10 (window 4) a session
    reads 16 x 4 + 32 x 10 = 384 B; a row's scores 4 x 2 x (4 x 4 + 8 x 10) = 768 FLOPs."""
    s = ModelShape.from_config(TINY, "tiny")
    assert (s.layers, s.experts, s.top_k, s.expert_intermediate, s.intermediate) == (2, 4, 2, 6, 16)
    assert s.attention_params() == 512
    assert s.dense_params() == 832
    assert s.expert_params() == 144
    assert s.head_params() == 80
    assert s.parameters() == 512 + 832 + 2 * 4 * 144 + 80
    assert s.kv_bytes_per_position() == (16.0, 32.0)
    assert float(s.kv_read_bytes(10)) == 384.0
    assert float(s.score_flops_per_row(10)) == 768.0


def test_gemma_reference_shape_matches_the_servers_kv_layout():
    """The 26B-A4B reference shape (passes/plan.py, the project's copy of its config) counts 25.2e9 parameters
    (docs/design.md) and the KV bytes per position verifier/kv_cache.py's layout holds: 204,800 B over the 25
    sliding layers and 20,480 B over the 5 full ones (its docstring's worked example)."""
    from hycoc.passes.plan import VERIFIER_26B_A4B

    s = ModelShape.from_config(VERIFIER_26B_A4B)
    assert s.parameters() / 1e9 == pytest.approx(25.23, abs=0.01)
    assert s.kv_bytes_per_position() == (204_800.0, 20_480.0)
    assert (s.experts, s.top_k) == (128, 8)


def test_dense_configs_and_other_moe_names():
    """enable_moe_block false: a dense model (no expert term); Mixtral-style names (num_local_experts,
    num_experts_per_tok, the experts being the MLP); a missing field and an MoE without top-k are one line."""
    dense = ModelShape.from_config({**TINY["text_config"], "enable_moe_block": False})
    assert not dense.is_moe and dense.dense_params() == 2 * 3 * 8 * 16
    mix = {
        k: v for k, v in TINY["text_config"].items() if k not in ("enable_moe_block", "num_experts", "top_k_experts")
    }
    mix.pop("moe_intermediate_size")
    m = ModelShape.from_config({**mix, "num_local_experts": 4, "num_experts_per_tok": 2})
    assert m.is_moe and m.expert_intermediate == 16 and m.intermediate == 0
    with pytest.raises(GpuCostError, match="field hidden_size is missing"):
        ModelShape.from_config({"num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 4})
    with pytest.raises(GpuCostError, match="4 experts but no top-k"):
        ModelShape.from_config({**TINY["text_config"], "top_k_experts": None})


def test_roofline_worked_by_hand():
    """On a GPU of 1e-3 GB/s (1 byte per ms) and 1e-9 TFLOPS (1 FLOP per ms), 8-bit weights and KV: one row of one
    session at context 0 moves attention 512 B / 1,024 FLOPs -> 1,024 ms; dense 832 B / 1,664 FLOPs -> 1,664;
    experts 2 distinct x 2 layers x 144 = 576 B / 2 x 2 x 144 x 2 = 1,152 FLOPs -> 1,152; LM head 80 / 160 -> 160;
    no KV. Forward = c x 2 layers + sum / eta."""
    gpu = GpuSpec("hand", 1e-3, 1e-9, "test")
    w8 = WeightFormat(8, 8, 8, 8, 8, "8-bit")
    s = ModelShape.from_config(TINY)
    parts = roofline_parts(s, 1, [0], w8, gpu)
    assert parts == pytest.approx({"attention": 1024, "kv": 0, "dense": 1664, "experts": 1152, "lm_head": 160})
    roof = GpuRoofline(s, gpu, w8, Efficiency(eta=0.5, layer_ms=3.0))
    assert roof.forward_ms(1, [0]) == pytest.approx(6.0 + 4000 / 0.5)
    # two sessions at context 10: their KV (384 B each) and scores (1 row each, 768 FLOPs) add max(768, 1536)
    assert roofline_parts(s, 2, [10, 10], w8, gpu)["kv"] == pytest.approx(1536)


def test_fit_recovers_known_terms():
    """Rounds priced by a roofline with eta 0.8 and 0.3 ms per layer, fed to `fit_paper`, give those two back
    (two linear equations, two unknowns); contradictory anchors are one line."""
    from hycoc.passes.plan import HEAD_ASSUMED, VERIFIER_26B_A4B

    v, h = ModelShape.from_config(VERIFIER_26B_A4B), ModelShape.from_config(HEAD_ASSUMED)
    gpu, w = GPU_SPECS["h100"], BF16_WEIGHTS
    truth = GpuRoofline(v, gpu, w, Efficiency(0.8, 0.3), h, BF16_WEIGHTS)
    hyco = truth.forward_ms(33, [300]) + 1.0
    cloud = truth.forward_ms(5, [300]) + 4 * truth.head_step_ms([300]) + 1.0
    got = fit_paper(v, h, gpu, w, tree_rows=33, chain_length=4, hyco_ms=hyco, cloud_ms=cloud, host_ms=1.0, context=300)
    assert got.eta == pytest.approx(0.8) and got.layer_ms == pytest.approx(0.3)
    with pytest.raises(GpuCostError, match="not a cost line"):
        fit_paper(v, h, gpu, w, tree_rows=33, chain_length=4, hyco_ms=50.0, cloud_ms=5.0, host_ms=1.0, context=300)


def test_gpu_table_and_names():
    """Every GPU has a positive bandwidth, FLOPS and a source; an unknown name is one line naming the choices."""
    for spec in GPU_SPECS.values():
        assert spec.bandwidth_gbs > 0 and spec.bf16_tflops > 0 and spec.source
    assert gpu_spec("h200").bandwidth_gbs == 4800.0
    with pytest.raises(GpuCostError, match="--gpu 'a100': one of rtx-pro-6000, h100, h200"):
        gpu_spec("a100")


def test_measured_batched_line_reads_and_refuses():
    """A cost-model file's batched line: linear in rows along a sessions value, linear in sessions between two,
    held beyond the sessions measured, extended with the last slope beyond the rows; a file of another model is
    refused in one line; a file without a batched line falls back to its one-session grid."""
    from hycoc.bench.capacity.cost import LineStepCost, StepCostError, line_step_cost
    from hycoc.bench.cost_model.model import BatchPoint, CostModel, CostPoint

    pts = [
        CostPoint(kind=k, rows=r, context=c, ms=2.0)
        for k, r in (("verify", 1), ("verify", 33), ("head_step", 1))
        for c in (1024, 4096)
    ] + [CostPoint(kind="prefill", rows=r, context=c, ms=r / 10) for r in (1, 512) for c in (1024, 4096)]
    line = [
        BatchPoint(sessions=1, rows=1, ms=10.0),
        BatchPoint(sessions=1, rows=33, ms=14.0),
        BatchPoint(sessions=4, rows=4, ms=12.0),
        BatchPoint(sessions=4, rows=132, ms=20.0),
    ]
    model = CostModel(
        device="NVIDIA H100",
        dtype="bfloat16",
        model="26B-A4B shape",
        shape={"hidden_size": 2816},
        points=pts,
        batch_points=line,
        batch_context=1024,
    )
    assert model.batch_ms(17, 1) == pytest.approx(12.0)  # halfway along the 1-session line
    assert model.batch_ms(65, 1) == pytest.approx(18.0)  # beyond: the last slope, 4 ms per 32 rows
    assert model.batch_ms(68, 4) == pytest.approx(16.0)
    assert model.batch_ms(33, 2.5) == pytest.approx(0.5 * (14.0 + 12.0 + 29 / 128 * 8))  # between the two lines
    assert model.batch_ms(4, 64) == pytest.approx(12.0)  # held beyond the sessions measured
    cost = line_step_cost(model, {"hidden_size": 2816}, 4, tree_rows=33, max_batch_rows=528, path="m.json")
    assert isinstance(cost, LineStepCost) and cost.forward_ms(17, 1, 0) == pytest.approx(12.0)
    assert cost.host_ms(["cloud-mtp", "device"], [5, 33]) == pytest.approx(4 * 2.0 + 2 * 1.0)
    with pytest.raises(StepCostError, match="measured on another model .*hidden_size = 2816.*has 256"):
        line_step_cost(model, {"hidden_size": 256}, 4, tree_rows=33, max_batch_rows=528, path="m.json")
    old = CostModel(device="NVIDIA H100", dtype="bfloat16", model="x", shape={}, points=pts)
    assert not isinstance(line_step_cost(old, None, 4, tree_rows=33, max_batch_rows=528), LineStepCost)
