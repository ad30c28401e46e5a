"""SLM graph surgery (passes/slm/surgery.py, App. A) on tiny pre-quantized checkpoints written with the toy
family's own Gemma-format writer: integers, scales and bit widths bit-exact against the checkpoint's bytes and
against transformers' QuantizedLinear; LUT rows equal QuantizedEmbedding's; rotary rows equal transformers';
the artifact round-trips; float weights are refused; the pipeline pass runs and caches."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hycoc.passes.artifacts import SlmIntegerArtifact, unpack_signed
from hycoc.passes.pipeline import Pipeline
from hycoc.passes.slm.surgery import SlmGraphSurgery, SurgeryError, byte_report, operate, slm_surgery
from rich.console import Console
from safetensors.numpy import load_file
from tiny_models import HEAD_DIMS

from hycoc.models import load_slm
from hycoc.recipe import Recipe
from hycoc.toy.configs import SLM_BIT_MAP, SLM_DEFAULT_BITS
from hycoc.toy.gemma_format import bits_for, pack, save_prequantized

torch.set_num_threads(1)

VOCAB = 96
SLIDING_WINDOW = 5


def tiny_slm_config(sliding_window: int = SLIDING_WINDOW):
    """`hycoc.toy.configs.slm_config` scaled down: 4 layers (2 KV-shared, double-wide MLP), per-layer inputs 8,
    head dims `tiny_models.HEAD_DIMS` (sliding 16 vs global 32, 25% proportional RoPE), untied output layer, soft-cap
    30."""
    from hycoc.toy.configs import slm_config

    return slm_config(
        **HEAD_DIMS,
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=48,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB,
        sliding_window=sliding_window,
        max_position_embeddings=256,
        eos_token_id=1,
    )


def make_tiny_slm(path, *, embedding_bits: int = 8, seed: int = 0, vocab_size: int | None = None):
    """Write a random tiny SLM in the pre-quantized Gemma format (the toy bit map: int8 attention and output
    layer, int4 MLPs, int2 per-layer projections) and return the folder. Weights get a spread that makes the
    logits depend on the context (transformers' init std 0.02 gives near-uniform ones). ``vocab_size``: another
    vocabulary (token and per-layer tables)."""
    from transformers import Gemma4ForCausalLM

    config = tiny_slm_config()
    if vocab_size is not None:
        config.vocab_size = config.vocab_size_per_layer_input = vocab_size
    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3 if "embed" in name or "lm_head" in name else 0.15)
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
    save_prequantized(model, path, SLM_BIT_MAP, SLM_DEFAULT_BITS, embedding_bits)
    return path


@pytest.fixture(scope="module", params=[8, 4, 2], ids=lambda b: f"emb{b}")
def checkpoint(request, tmp_path_factory):
    return make_tiny_slm(tmp_path_factory.mktemp(f"slm{request.param}") / "slm", embedding_bits=request.param)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    model = load_slm(checkpoint)
    result, report = operate(checkpoint)
    return model, result, report, load_file(str(checkpoint / "model.safetensors"))


def test_integers_and_scales_equal_the_checkpoint_bytes(loaded, checkpoint):
    _, result, _, stored = loaded
    seen = set()
    for name, w in result.weights.items():
        assert w.bits == bits_for(name, SLM_BIT_MAP, SLM_DEFAULT_BITS)
        seen.add(w.bits)
        lo, hi = -(1 << (w.bits - 1)), (1 << (w.bits - 1)) - 1
        assert w.q.dtype == np.int8 and lo <= w.q.min() and w.q.max() <= hi
        packed = stored[f"{name}.weight"]
        # our integers, packed the checkpoint's way, are the checkpoint's bytes; and they unpack to ours
        assert np.array_equal(pack(torch.from_numpy(w.q), w.bits).numpy(), packed)
        assert np.array_equal(unpack_signed(packed, w.bits, w.q.shape[1]), w.q)
        scale = stored[f"{name}.weight_scale"]
        assert w.scale.dtype == np.float32 and np.array_equal(w.scale.view(np.int32), scale.view(np.int32))
    assert seen == {2, 4, 8}
    assert set(result.bit_map()) == {n.removesuffix(".weight_scale") for n in stored if n.endswith(".weight_scale")}


def test_integer_weights_compute_as_quantized_linear(loaded):
    from hycoc.passes.slm.graph import IntegerLinear
    from transformers.integrations.gemma_quant import QuantizedLinear

    model, result, _, _ = loaded
    x = torch.randn(3, 5, 128)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert set(linears) == set(result.weights)
    for name, module in linears.items():
        w = result.weights[name]
        assert torch.equal(torch.from_numpy(w.dequantize()), module._dequantize_weights(torch.float32))
        xi = x[..., : module.in_features]
        assert torch.equal(IntegerLinear(w)(xi), module(xi))


def test_lut_rows_equal_quantized_embedding(loaded, checkpoint):
    model, result, _, stored = loaded
    ids = torch.tensor([[0, 5, 95, 5], [17, 2, 64, 33]])
    for lut_name, module in [
        ("embed_tokens", model.model.embed_tokens),
        ("embed_tokens_per_layer", model.model.embed_tokens_per_layer),
    ]:
        lut = result.luts[lut_name]
        assert lut.bits == module.num_bits
        assert np.array_equal(lut.packed, stored[f"model.{lut_name}.embedding_quantized"])  # kept as stored
        assert np.array_equal(lut.scale, stored[f"model.{lut_name}.embedding_scale"])
        got = lut.lookup(ids.numpy())
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, module(ids).detach().numpy())
    with pytest.raises(IndexError):
        result.luts["embed_tokens"].lookup([VOCAB])


def test_rotary_rows_equal_transformers(loaded):
    model, result, _, _ = loaded
    positions = torch.tensor([[0, 1, 7, 255, 1000]])
    x = torch.zeros(1, 5, 32)
    for layer_type, table in result.rotary.items():
        cos, sin = model.model.rotary_emb(x, positions, layer_type)
        got_cos, got_sin = table.rows(positions.numpy())
        assert got_cos.shape == (1, 5, table.head_dim)
        np.testing.assert_allclose(got_cos, cos.numpy(), atol=2e-6, rtol=0)
        np.testing.assert_allclose(got_sin, sin.numpy(), atol=2e-6, rtol=0)


def test_byte_report(loaded, checkpoint):
    _, result, report, stored = loaded
    assert report["before_bytes"] == sum(v.nbytes for v in stored.values())
    by = report["by_bits"]
    assert sorted(by) == ["2", "4", "8"]
    for bits, row in by.items():
        ws = [w for w in result.weights.values() if w.bits == int(bits)]
        assert row["modules"] == len(ws) and row["values"] == sum(w.q.size for w in ws)
        assert row["int8_bytes"] == sum(w.q.size + 4 * w.scale.size for w in ws)
        # the checkpoint holds packed integers + scales + two SRQ scalars per module
        assert row["checkpoint_bytes"] == sum(
            stored[f"{n}.weight"].nbytes + stored[f"{n}.weight_scale"].nbytes + 8
            for n, w in result.weights.items()
            if w.bits == int(bits)
        )
    assert by["8"]["packed_bytes"] == by["8"]["int8_bytes"]
    assert by["2"]["packed_bytes"] < by["4"]["int8_bytes"]
    assert report["after_bytes"] > report["npu_weight_bytes"]


def test_artifact_round_trip(loaded, tmp_path):
    _, result, _, _ = loaded
    artifact = SlmIntegerArtifact("slm_integer", result)
    artifact.save(tmp_path)
    back = SlmIntegerArtifact.load("slm_integer", tmp_path)
    assert back.content_hash() == SlmIntegerArtifact("slm_integer", result).content_hash()
    m = back.payload
    assert m.bit_map() == result.bit_map() and m.config == result.config
    for name, w in result.weights.items():
        assert np.array_equal(m.weights[name].q, w.q) and np.array_equal(m.weights[name].scale, w.scale)
    for name, lut in result.luts.items():
        assert np.array_equal(m.luts[name].packed, lut.packed) and m.luts[name].embed_scale == lut.embed_scale
    assert set(m.floats) == set(result.floats)


def test_float_weights_are_refused(checkpoint):
    model = load_slm(checkpoint)
    q = model.model.layers[1].mlp.up_proj
    model.model.layers[1].mlp.set_submodule("up_proj", torch.nn.Linear(q.in_features, q.out_features, bias=False))
    with pytest.raises(SurgeryError, match=r"model\.layers\.1\.mlp\.up_proj: a floating-point nn\.Linear"):
        slm_surgery(model)


def test_pipeline_pass_runs_and_caches(checkpoint, tmp_path):
    recipe = Recipe.model_validate({"models": {"slm": str(checkpoint)}})
    pipeline = Pipeline([SlmGraphSurgery()], tmp_path / "cache", console=Console(file=io.StringIO()))
    first = pipeline.run(recipe)
    report = first.reports[0]
    assert "bit-exact" in report.summary and report.numbers["by_bits"]["2"]["modules"] == 8
    again = pipeline.run(recipe)
    assert again.reports[0].cached
    assert again.artifacts["slm_integer"].content_hash() == first.artifacts["slm_integer"].content_hash()
    assert byte_report(again.artifacts["slm_integer"].payload)["npu_weight_bytes"] == report.numbers["npu_weight_bytes"]
