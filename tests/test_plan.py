"""`hycoc inspect RECIPE`: the real-shape plan (docs/real-shapes.md), with no checkpoint present."""

from __future__ import annotations

import json

import pytest
from hycoc.passes.head.graph import INPUT_NAMES as HEAD_INPUTS
from hycoc.passes.head.graph import OUTPUT_NAMES as HEAD_OUTPUTS
from hycoc.passes.plan import real_shape_plan
from paths import GEMMA4, ROOT, TOY
from typer.testing import CliRunner

from hycoc.cli import app
from hycoc.protocol import wire
from hycoc.recipe import load_recipe

runner = CliRunner()


@pytest.fixture(scope="module")
def gemma4():
    result = runner.invoke(app, ["inspect", str(GEMMA4), "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def toy():
    return real_shape_plan(load_recipe(TOY))


def shapes(specs):
    return {s["name"]: tuple(s["shape"]) for s in specs}


def test_gemma4_handoff_bytes(gemma4):
    h = gemma4["handoff"]
    assert h["handoff_bytes_per_round"] == 44 + 5632
    assert h["handoff_bytes_per_position"] == 6144
    assert (h["hidden_size"], h["kv_dim_sliding"], h["kv_dim_full"]) == (2816, 8 * 256, 2 * 512)
    assert h["verifier_layers"] == {"sliding": 28, "full": 29}
    assert h["first_handoff_bytes"] == 44 + 5632 + 1024 * 6144 == 6_297_132
    assert h["first_reply_bytes"] == wire.reply_nbytes(33, 0, 0, 6_297_132)


def test_gemma4_tree_bytes_at_b32(gemma4):
    assert gemma4["handoff"]["tree_rows"] == 33
    assert gemma4["handoff"]["tree_bytes_per_round"] == 287  # 16 + 7 + 33 * (4 + 2 + 2)
    p = gemma4["paper"]["tree_bytes_per_round"]
    assert (p["paper"], p["plan"], p["diff"]) == (2200, 287, -1913)
    # the note `hycoc inspect` prints names the protocol the wire speaks (it said v4 while /healthz said 6)
    assert "16 + 7 + 8 R bytes" in p["note"] and f"protocol v{wire.PROTOCOL_VERSION})" in p["note"]
    assert 16 + 7 + 8 * 33 == wire.tree_nbytes(33)


def test_gemma4_head_lut_is_keep_set_times_verifier_hidden(gemma4):
    lut = gemma4["graphs"]["head"]["lut"]
    assert lut["bytes"] == 86_089 * 2816 == 242_426_624
    p = gemma4["paper"]["head_lut_bytes"]
    assert p["paper"] == 242_000_000 and p["plan"] == 242_426_624 and abs(p["diff_pct"]) < 0.5


def test_gemma4_head_graph_io(gemma4):
    g = gemma4["graphs"]["head"]
    assert [s["name"] for s in g["inputs"]] == list(HEAD_INPUTS)
    assert [s["name"] for s in g["outputs"]] == [*HEAD_OUTPUTS, "top_index"]  # + the graph's top-2
    io = shapes(g["inputs"]) | shapes(g["outputs"])
    assert io["x_hat"] == (1, 1, 5632)
    assert io["k_sliding"] == io["v_sliding"] == (1, 8, 1024, 256)
    assert io["k_full"] == io["v_full"] == (1, 2, 1024, 512)
    assert io["mask_sliding"] == io["mask_full"] == (1, 1, 1, 1024)
    assert io["cos_full"] == (1, 1, 512) and io["sin_sliding"] == (1, 1, 256)
    assert io["logits"] == (1, 1, 86_089) and io["h_next"] == (1, 1, 2816)
    assert g["ring_kv"]["bytes_stored_8bit"] == 1024 * (2048 + 1024) * 2
    assert g["ring_kv"]["bytes_in_graph_16bit"] == 2 * g["ring_kv"]["bytes_stored_8bit"]
    # W4 on every linear, the keep-set output layer included: within a few % of the paper's 123 MB
    assert list(g["weights"]["by_bits"]) == ["int4"]
    assert abs(gemma4["paper"]["head_graph_bytes"]["diff_pct"]) < 5


def test_gemma4_slm_graph_io(gemma4):
    g = gemma4["graphs"]["slm"]
    io = shapes(g["inputs"]) | shapes(g["outputs"])
    assert io["inputs_embeds"] == (1, 32, 1536)
    assert io["per_layer_inputs"] == (1, 32, 35, 256)
    assert io["mask_sliding"] == (1, 1, 32, 512 + 32) and io["mask_full"] == (1, 1, 32, 1024 + 32)
    assert io["logits"] == (1, 32, 86_089)
    assert io["top_index"] == io["top_logq"] == (1, 32, 32)  # the graph's 32 candidates per row
    assert g["ring_kv"]["layers"] == list(range(15))  # 35 layers, the last 20 KV-shared
    assert io["k_ring_0"] == (1, 1, 512, 256) and io["k_ring_4"] == (1, 1, 1024, 512)
    assert io["v_new_14"] == (1, 1, 32, 512)
    assert "k_ring_15" not in io
    assert g["bit_map"]["source"] == "ASSUMED"


def test_gemma4_plan_marks_what_is_assumed(gemma4):
    assert gemma4["models"]["head"]["assumed"] is True
    assert any(a.startswith("head config ASSUMED") for a in gemma4["assumptions"])
    assert any("bit map ASSUMED" in a for a in gemma4["assumptions"])
    assert set(gemma4["paper"]) == {
        "slm_graph_bytes",
        "head_graph_bytes",
        "head_lut_bytes",
        "head_side_bytes",
        "handoff_bytes_per_round",
        "handoff_bytes_per_position",
        "tree_bytes_per_round",
    }
    for p in gemma4["paper"].values():
        assert p["diff"] == p["plan"] - p["paper"]
    assert gemma4["models"]["head"]["params"] == 419_711_232  # the paper: 420M


def inspect_shows(width: int, texts) -> None:
    """`hycoc inspect` of the Gemma 4 recipe at a terminal ``width`` wide exits 0 and prints each of ``texts``."""
    result = runner.invoke(app, ["inspect", str(GEMMA4)], terminal_width=width)
    assert result.exit_code == 0, result.stderr
    for text in texts:
        assert text in result.stdout, text


def test_inspect_recipe_tables_run():
    texts = (
        "plan vs paper",
        "head_lut_bytes",
        "assumed:",
        "k_ring_14",
        "6,144",
        "ESTIMATE",
        "the estimate against device figures",
        "residual",
        "verifier KV per session",
        "0.888",
        "reserved besides the sessions",
        "0.315",
        "0.210",
        "7.382",
    )
    inspect_shows(160, texts)


def test_gemma4_verifier_kv_per_session(gemma4):
    """26B-A4B in bfloat16: 225,280 B per position at full length (25 sliding layers x 8 x 256 + 5 global x 2 x 512,
    K and V, 2 B); windowed, a session's 25 sliding layers hold 1,025 positions (the head's window of 1,024 + 1) +
    33 tree rows: 0.888 GB at 32K (1.196 GB before issue 38, when each session also reserved a 512-position chunk's
    rows and a 1,025-position snapshot). A prefilling session's window + chunk is reserved once per prefill slot
    (max_prefills 1: the prefill pool), a conversation's snapshot (1,025 positions) from spare room only."""
    kv = gemma4["verifier"]
    assert (kv["kv_bytes_per_position_sliding"], kv["kv_bytes_per_position_full"]) == (204_800, 20_480)
    assert (kv["sliding_retained_positions"], kv["tree_rows"], kv["kv_dtype"]) == (1025, 33, "bfloat16")
    assert (kv["prefill_chunk"], kv["max_prefills"]) == (512, 1)
    assert kv["full_length_bytes"]["32768"] == 225_280 * 32_768 == 7_381_975_040
    assert kv["kv_bytes_per_session"] == {
        "2048": 20_480 * 2048 + 204_800 * (1025 + 33),
        "8192": 20_480 * 8192 + 204_800 * (1025 + 33),
        "32768": 20_480 * 32_768 + 204_800 * (1025 + 33),
    }
    assert kv["kv_bytes_per_session"]["32768"] == 887_767_040 <= 0.95e9
    assert kv["prefill_transient_bytes"]["32768"] == 204_800 * (1025 + 512) == 314_777_600
    assert kv["prefill_pool_bytes"]["32768"] == 314_777_600
    assert kv["snapshot_bytes"] == {"2048": 209_920_000, "8192": 209_920_000, "32768": 204_800 * 1025}
    fit = (80 * 10**9 - 314_777_600) // 887_767_040
    assert kv["sessions_per_pool"]["32768"] == {"full_length": 10, "windowed": fit} and fit == 89


def test_toy_plan_counts_the_real_toy_models(toy):
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

    models = ROOT / "recipes" / "toy" / "models"
    verifier = Gemma4ForCausalLM.from_pretrained(models / "verifier")
    head = Gemma4AssistantForCausalLM.from_pretrained(models / "head")
    assert toy["models"]["verifier"]["params"] == sum(p.numel() for p in verifier.parameters()) == 3_912_592
    assert toy["models"]["head"]["params"] == sum(p.numel() for p in head.parameters()) == 1_213_760
    assert toy["models"]["head"]["assumed"] is False
    assert toy["graphs"]["slm"]["bit_map"]["source"] == "the checkpoint's quantization_config"
    assert toy["handoff"]["handoff_bytes_per_round"] == wire.handoff_nbytes(256, 2 * 64, 128, 0)


def test_toy_plan_kv_per_session_is_what_the_engine_reserves(toy):
    """The plan's verifier.kv_bytes_per_session is the server's reservation: the same function on the engine the
    toy recipe builds (its dtype, W, head and tree rows)."""
    from hycoc.verifier.loading import engine_from_recipe

    from hycoc.recipe import load_recipe

    engine = engine_from_recipe(load_recipe(ROOT / "recipes" / "toy.toml"), "cpu")
    kv = toy["verifier"]
    assert kv["sliding_retained_positions"] == engine.kv_retain == 256  # W = 256 > the window 128 - 1
    for n, got in kv["kv_bytes_per_session"].items():
        assert got == engine.session_kv_bytes(int(n), kv["tree_rows"])
    engine.close()


def test_toy_plan_matches_the_head_graph_the_compiler_builds(toy):
    import torch
    from hycoc.passes.head.graph import HeadGraph
    from transformers import Gemma4AssistantForCausalLM

    head = Gemma4AssistantForCausalLM.from_pretrained(ROOT / "recipes" / "toy" / "models" / "head")
    graph = HeadGraph(head)
    io = shapes(toy["graphs"]["head"]["inputs"])
    out = graph(*(torch.zeros(io[n]) for n in HEAD_INPUTS))
    keep = load_recipe(TOY).keep_set.size
    assert (
        tuple(out[0].shape[:2]) == (1, 1) and tuple(out[1].shape) == shapes(toy["graphs"]["head"]["outputs"])["h_next"]
    )
    assert shapes(toy["graphs"]["head"]["outputs"])["logits"] == (1, 1, keep)


def test_a_head_for_another_verifier_is_refused(tmp_path):
    import shutil

    from hycoc.passes.plan import PlanError

    models = ROOT / "recipes" / "toy" / "models"
    for role in ("verifier", "head", "slm"):
        shutil.copytree(models / role, tmp_path / role, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["backbone_hidden_size"] = 512
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    text = (
        TOY.read_text()
        .replace('"toy/models/verifier"', f'"{tmp_path / "verifier"}"')
        .replace('"toy/models/head"', f'"{tmp_path / "head"}"')
        .replace('"toy/models/slm"', f'"{tmp_path / "slm"}"')
    )
    (tmp_path / "toy.toml").write_text(text)  # the tokenizer is the copied verifier folder's
    with pytest.raises(PlanError, match="backbone_hidden_size 512"):
        real_shape_plan(load_recipe(tmp_path / "toy.toml"))
    result = runner.invoke(app, ["inspect", str(tmp_path / "toy.toml"), "--json"])
    assert result.exit_code == 1 and "backbone_hidden_size 512" in result.stderr


def test_gemma4_bit_maps_beside_the_paper(gemma4):
    """docs/real-shapes.md "The bit map": the assumed map gives 1,215.1 MB, the paper-fit map 752.8 MB (paper 754 MB);
    the head side (W4 graph + 8-bit E table) 362.9 MB (paper 365 MB); the size alone admits 20 group-wise maps
    within 1 %."""
    bm = gemma4["bit_maps"]
    rows = {r["map"]: r for r in bm["maps"]}
    assert bm["source"] == "ASSUMED"
    assert rows["assumed"]["slm_graph_bytes"] == rows["in use (ASSUMED)"]["slm_graph_bytes"] == 1_215_130_404
    assert rows["assumed"]["by_bits"] == {"int2": 6_881_280, "int4": 778_567_680, "int8": 424_392_192}
    fit = rows["paper fit"]
    assert fit["slm_graph_bytes"] == 752_848_932 and fit["diff_pct"] == -0.15
    # attention 8-bit (278.4M weights), MLP + per-layer gate/projection 2-bit, output layer + model projection 4-bit
    assert fit["by_bits"] == {
        "int2": (1_557_135_360 + 27_525_120) // 4,
        "int4": (86_089 * 1536 + 13_762_560) // 2,
        "int8": 278_396_928,
    }
    # compiled, 2-bit weights take 4 bits (no int2 on the HTP): the paper-fit map's context holds 1,149 MB
    assert fit["htp_graph_bytes"] == 752_848_932 + (1_557_135_360 + 27_525_120) // 4 == 1_149_014_052
    assert rows["assumed"]["htp_graph_bytes"] == 1_215_130_404 + 6_881_280
    assert bm["head_side"]["total_bytes"] == 120_517_412 + 242_426_624 == gemma4["paper"]["head_side_bytes"]["plan"]
    assert bm["head_side"]["paper_bytes"] == 365_000_000
    assert bm["search"]["maps_tried"] == 3**7 and bm["search"]["maps_within"] == 20
    assert bm["search"]["closest"][0]["total_bytes"] == 754_421_796
    assert gemma4["context_budget"]["graphs"]["slm"] == {"bytes": 1_215_130_404, "fits": True, "shards_needed": 1}


def test_inspect_shows_the_bit_maps_side_by_side():
    texts = (
        "SLM bit map (in use: ASSUMED)",
        "paper fit",
        "752.8",
        "1215.1",
        "362.9",
        "1149.0",
        "20 of 2187 group-wise maps",
        "context budget (htp-v81",
    )
    inspect_shows(200, texts)


def test_gemma4_plan_counts_the_drafters_macs(gemma4):
    """MACs per call at the real shape (`hycoc.passes.plan_graphs.macs`): the head's one row over its linear layers and
    its 4 layers' attention over the W=1024 ring (3 sliding layers of head dim 256, 1 full of 512, 16 query heads);
    the SLM's 32 rows."""
    head = gemma4["graphs"]["head"]["macs"]
    assert head["lm_head_per_row"] == 86_089 * 1024
    assert head["attention"] == 2 * 16 * 1024 * (3 * 256 + 512)
    assert head["total"] == head["linear_per_row"] + head["attention"]
    slm = gemma4["graphs"]["slm"]["macs"]
    assert slm["rows"] == 32 and slm["lm_head_per_row"] == 86_089 * 1536
    assert slm["total"] == 32 * slm["linear_per_row"] + slm["attention"] == 68_223_942_656


def test_gemma4_device_estimate_is_the_fit_to_the_papers_anchors(gemma4):
    """The shipped v81 profile is `fit_profile` on the paper's anchors at these shapes (refit here), and each
    anchor's residual is what docs/device-runtime.md "On the phone: device time and graph IO" shows."""
    from hycoc.device_time import NPU_PROFILES, fit_profile

    plan = {k: v for k, v in gemma4.items() if k != "device_time_estimate"}
    fit, shipped = fit_profile(plan), NPU_PROFILES["v81"]
    assert fit.tmacs is None and shipped.tmacs is None
    for key in ("bandwidth_gbps", "overhead_ms", "host_ms_per_slm_pass"):
        assert getattr(fit, key) == pytest.approx(getattr(shipped, key), rel=1e-3)
    est = gemma4["device_time_estimate"]
    assert est["label"].startswith("ESTIMATE")
    residual = {a["anchor"]: a["residual_pct"] for a in est["anchors"]}
    assert residual == {
        "SLM 32-row pass, A16": 2.1,
        "mobile round, 86K keep set": 9.1,
        "mobile round, full vocabulary": -17.6,
        "HyCo draft per round (12.1 ms/token x MAT 4.71)": 1.2,
        "SpecEdge-style per round (42.8 ms/token x MAT 3.53)": 1.2,
        "HyCo-2P per round (18.2 x 5.27)": 0.0,
        "HyCo exact per round (14.7 x 3.84)": 2.2,
        "server head per round (9.2 x 3.79)": 9.7,
        "SLM alone, 8K context, full vocab, per token": -49.3,
        "Gemma 4 E2B decode A16W8, SM8750 (v79)": -59.1,
        "Gemma 4 E2B decode W8A16, SM8850": -67.0,
    }
    assert est["graphs"]["slm"]["estimate_ms"] == pytest.approx(16.02, abs=0.01)
