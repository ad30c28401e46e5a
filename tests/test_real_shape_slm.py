"""docs/real-shapes.md "The E2B SLM at real shape", at tiny shape: benchmarks/real_shape_slm.py's chain (random
pre-quantized checkpoint -> surgery -> host LUTs -> keep-set tree graph -> export -> QDQ -> budget refusal), the graph
over protobuf's 2 GB limit (the limit lowered so a tiny graph is "over" it), and the bit map (`hycoc.passes.bit_map`):
transformers' own width rule, a checkpoint's quantization_config winning with no code change.

The real-shape numbers come from running the script itself (runs/real-shape-slm*.json).
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script
from paths import ROOT as REPO

pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")

#: The lowered "protobuf limit" of the over-2-GB fault: the tiny graph's weights (~0.4 MB) are far over it.
LOW_LIMIT = 64 * 1024


def _bench():
    return load_script("real_shape_slm")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The benchmark at toy widths, 2 layers, no HTP compile, with onnxruntime refusing any in-memory model over
    `LOW_LIMIT` bytes (as protobuf refuses one over 2 GB): every pass must go through files + external data."""
    import onnxruntime as ort

    bench = _bench()
    tmp = tmp_path_factory.mktemp("real-shape-slm")
    out, work = tmp / "report.json", tmp / "work"
    real_session = ort.InferenceSession
    refused: list[int] = []

    class LimitedSession(real_session):
        def __init__(self, model, *args, **kwargs):
            if isinstance(model, (bytes, bytearray)) and len(model) > LOW_LIMIT:
                refused.append(len(model))
                raise ValueError(f"serialized model of {len(model):,} bytes over the lowered limit {LOW_LIMIT:,}")
            super().__init__(model, *args, **kwargs)

    ort.InferenceSession = LimitedSession
    try:
        report = bench.main(
            "--toy-dims --layers 2 --keep-set 256 --rows 4 --ring 8 --sliding-ring 4 --samples 2 --skip-compile".split()
            + ["--out", str(out), "--work", str(work), "--keep-work", "--quiet"]
        )
    finally:
        ort.InferenceSession = real_session
    return report, out, work, refused


def test_every_step_ran_and_the_report_has_its_numbers(tiny_run):
    report, out, _, refused = tiny_run
    on_disk = json.loads(out.read_text())
    assert on_disk["failed"] == [] and refused == []
    steps = {r["step"]: r for r in on_disk["steps"]}
    assert list(steps) == ["checkpoint", "surgery", "host_luts", "graph", "export", "qdq", "budget_refusal"]
    for name, row in steps.items():
        assert row["status"] == "ok", (name, row.get("error"))
        assert row["peak_rss_gib"] > 0 and row["seconds"] >= 0 and row["cpu_seconds"] >= 0
    assert on_disk["shapes"]["real_shapes"] is False and on_disk["shapes"]["layers"] == 2
    by_bits = steps["checkpoint"]["details"]["by_bits"]
    # the assumed map at 2 layers: q/k/v/o + lm_head + per_layer_model_projection 8-bit, MLPs 4-bit, PLE 2-bit
    assert {b: v["modules"] for b, v in by_bits.items()} == {"8": 2 * 4 + 2, "4": 2 * 3, "2": 2 * 2}


def test_surgery_is_bit_exact_at_the_checkpoint_widths(tiny_run):
    _, out, _, _ = tiny_run
    steps = {r["step"]: r for r in json.loads(out.read_text())["steps"]}
    surgery = steps["surgery"]["details"]["by_bits"]
    checkpoint = steps["checkpoint"]["details"]["by_bits"]
    assert {b: v["modules"] for b, v in surgery.items()} == {b: v["modules"] for b, v in checkpoint.items()}
    for b, v in surgery.items():
        assert v["values"] == checkpoint[b]["values"]
        assert v["checkpoint_bytes"] == checkpoint[b]["bytes"] + 8 * v["modules"]  # + the two SRQ scalars


def test_ple_luts_stay_on_the_host(tiny_run):
    _, out, _, _ = tiny_run
    steps = {r["step"]: r for r in json.loads(out.read_text())["steps"]}
    luts = steps["host_luts"]["details"]["luts"]
    # toy: 4,096 rows; per-layer table 2 layers x 16 = 32 columns at 2 bits -> 8 bytes a row + a float32 scale
    assert luts["embed_tokens_per_layer"] == {
        **luts["embed_tokens_per_layer"],
        "rows": 4096,
        "cols": 32,
        "bits": 2,
        "bytes": 4096 * 8 + 4096 * 4,
        "lookup_shape": [4, 32],
    }
    assert luts["embed_tokens"]["bits"] == 4 and luts["embed_tokens"]["bytes"] == 4096 * 32 + 4096 * 4
    export = steps["export"]["details"]
    assert export["host_only_nodes"] == []
    graph = steps["graph"]["details"]
    assert graph["inputs"]["per_layer_inputs"] == [1, 4, 2, 16]  # the host's LUT rows are a graph input


def test_output_layer_is_restricted_to_the_keep_set(tiny_run):
    import onnx

    _, out, work, _ = tiny_run
    steps = {r["step"]: r for r in json.loads(out.read_text())["steps"]}
    assert steps["graph"]["details"]["output_layer_rows_before"] == 4096
    assert steps["graph"]["details"]["output_layer_rows_after"] == 256
    model = onnx.load(str(work / "qdq" / "model_qdq.onnx"), load_external_data=False)
    logits = next(o for o in model.graph.output if o.name == "logits")
    assert [d.dim_value for d in logits.type.tensor_type.shape.dim] == [1, 4, 256]


def test_over_the_protobuf_limit_every_file_keeps_its_weights_outside(tiny_run):
    import onnx

    _, out, work, _ = tiny_run
    steps = {r["step"]: r for r in json.loads(out.read_text())["steps"]}
    assert steps["qdq"]["details"]["checker"] == "ok"
    assert steps["qdq"]["details"]["weights_bit_exact"] == 2 * 7 + 2 * 2 + 1 + 1
    files = [work / "export" / "slm.onnx"] + [
        work / "qdq" / n for n in ("model_folded.onnx", "model_float.onnx", "model_qdq.onnx")
    ]
    for f in files:
        model = onnx.load(str(f), load_external_data=False)
        inline = [
            t.name
            for t in model.graph.initializer
            if t.data_location != onnx.TensorProto.EXTERNAL and len(t.raw_data) >= 4096
        ]
        assert inline == [], (f.name, inline)
        external = sum(
            int({e.key: e.value for e in t.external_data}["length"])
            for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
        )
        assert external > LOW_LIMIT, f.name  # the weights, over the lowered limit, all in the data file
    assert not list((work / "qdq").glob(".outputs-*")), "run_with_tensors leaves no copies behind"


def test_a_context_over_the_budget_is_refused_before_compiling(tiny_run):
    _, out, _, _ = tiny_run
    steps = {r["step"]: r for r in json.loads(out.read_text())["steps"]}
    d = steps["budget_refusal"]["details"]
    assert d["refused"] is True and d["files_written"] == []
    assert d["limit_bytes"] == d["weight_bytes"] - 1
    assert f"needs {d['weight_bytes']:,} bytes of weights" in d["message"]
    assert f"limit of {d['limit_bytes']:,} bytes" in d["message"]


# ---- the bit map ------------------------------------------------------------------------------------------------


def _tiny_text_config(layers: int = 4) -> dict:
    from hycoc.bench.real_shape.random_checkpoint import slm_config

    return slm_config(layers, toy_dims=True)


@pytest.mark.parametrize("which", ["assumed", "paper-fit"])
def test_resolve_bits_is_transformers_rule(which):
    import torch
    from hycoc.passes import bit_map
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig
    from transformers.integrations.gemma_quant import QuantizedEmbedding, QuantizedLinear, replace_with_quant_layers
    from transformers.utils.quantization_config import GemmaQuantizationConfig

    qcfg = bit_map.E2B_ASSUMED if which == "assumed" else bit_map.e2b_paper_fit()
    with torch.device("meta"):
        model = Gemma4ForCausalLM(Gemma4TextConfig.from_dict(_tiny_text_config()))
    replace_with_quant_layers(model, GemmaQuantizationConfig(**{k: v for k, v in qcfg.items() if k != "quant_method"}))
    theirs = {n: m.num_bits for n, m in model.named_modules() if isinstance(m, (QuantizedLinear, QuantizedEmbedding))}
    assert len(theirs) == 4 * 9 + 1 + 1 + 2
    assert {n: bit_map.resolve_bits(n, qcfg) for n in theirs} == theirs
    assert theirs["model.embed_tokens_per_layer"] == 2 and theirs["model.embed_tokens"] == 4
    assert theirs["model.layers.1.mlp.up_proj"] == (4 if which == "assumed" else 2)


def test_resolve_bits_leftmost_match_wins_as_in_transformers():
    from hycoc.passes.bit_map import resolve_bits

    q = {"num_bits": 4, "module_quant_configs": {r"up_proj": {"num_bits": 2}, r"layers\.1\.": {"num_bits": 8}}}
    assert resolve_bits("model.layers.1.mlp.up_proj", q) == 8  # layers.1. starts earlier in the name
    assert resolve_bits("model.layers.2.mlp.up_proj", q) == 2
    assert resolve_bits("lm_head", q) == 4


def test_bad_bit_maps_name_the_field():
    from hycoc.passes.bit_map import BitMapError, validate

    with pytest.raises(BitMapError, match=r"module_quant_configs\['mlp'\]\.num_bits: 3"):
        validate({"num_bits": 4, "module_quant_configs": {"mlp": {"num_bits": 3}}})
    with pytest.raises(BitMapError, match="quant_method"):
        validate({"quant_method": "awq"})


def test_the_checkpoints_own_quantization_config_wins(tmp_path):
    """A tiny checkpoint with its own map (everything 8-bit, MLP 2-bit): the surgery and the planner follow it."""
    from hycoc.passes.plan import real_shape_plan
    from hycoc.passes.slm.surgery import operate

    from hycoc.bench.real_shape.random_checkpoint import write_random_checkpoint
    from hycoc.recipe import load_recipe

    own = {
        "quant_method": "gemma",
        "num_bits": 8,
        "quantize_embeddings": True,
        "module_quant_configs": {r"mlp\.": {"num_bits": 2}},
        "modules_to_not_convert": [],
    }
    ckpt = tmp_path / "slm"
    write_random_checkpoint(_tiny_text_config(2), own, ckpt)
    slm, numbers = operate(ckpt)
    widths = {n: w.bits for n, w in slm.weights.items()}
    assert {b for n, b in widths.items() if ".mlp." in n} == {2}
    assert {b for n, b in widths.items() if ".mlp." not in n} == {8}
    assert {n: lut.bits for n, lut in slm.luts.items()} == {"embed_tokens": 8, "embed_tokens_per_layer": 8}

    models = REPO / "recipes" / "toy" / "models"
    text = (REPO / "recipes" / "toy.toml").read_text()
    for role in ("verifier", "head"):
        text = text.replace(f'"toy/models/{role}"', f'"{models / role}"')
    text = text.replace('"toy/models/slm"', f'"{ckpt}"')
    (tmp_path / "toy.toml").write_text(text)
    plan = real_shape_plan(load_recipe(tmp_path / "toy.toml"))
    g = plan["graphs"]["slm"]
    assert g["bit_map"]["source"] == "the checkpoint's quantization_config"
    assert g["bit_map"]["default_bits"] == 8
    assert set(g["weights"]["by_bits"]) == {"int2", "int8"}
    assert g["luts"]["embed_tokens_per_layer"]["bits"] == 8
    mlp = sum(v for n, v in ((n, w.q.size) for n, w in slm.weights.items()) if ".mlp." in n)
    assert g["weights"]["by_bits"]["int2"]["weights"] == mlp
    assert plan["bit_maps"]["maps"][0]["map"] == "in use (the checkpoint's quantization_config)"
    assert not any("bit map ASSUMED" in a for a in plan["assumptions"])


def test_context_budget_counts_shards():
    from hycoc.passes.plan_budgets import context_budget

    from hycoc.recipe import load_recipe

    recipe = load_recipe(REPO / "recipes" / "gemma4.toml")
    b = context_budget({"slm": 7_100_000_000, "head": 120_517_412}, recipe)
    assert b["profile"] == "htp-v81" and b["limit_bytes"] == 3_500_000_000
    assert b["graphs"]["slm"] == {"bytes": 7_100_000_000, "fits": False, "shards_needed": 3}
    assert b["graphs"]["head"] == {"bytes": 120_517_412, "fits": True, "shards_needed": 1}


def test_slm_config_keeps_a_producer_of_each_kind():
    bench = _bench()
    full = bench.slm_config(None)
    assert full["num_hidden_layers"] == 35 and full["num_kv_shared_layers"] == 20
    assert full["tie_word_embeddings"] is False
    ten = bench.slm_config(10)
    assert ten["layer_types"][:5] == ["sliding_attention"] * 4 + ["full_attention"]
    assert ten["num_kv_shared_layers"] == 5
    assert bench.slm_config(2)["num_kv_shared_layers"] == 0
    with pytest.raises(ValueError, match="--layers 1"):
        bench.slm_config(1)
