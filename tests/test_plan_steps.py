"""The real-shape plan's pure steps (`hycoc.passes.plan`, `hycoc.passes.plan_graphs`) on shapes small enough to
work by hand; tests/test_plan.py checks the whole plan at Gemma 4's and the toy's shapes."""

from __future__ import annotations

from types import SimpleNamespace

from hycoc.passes.plan import PAPER, paper_comparison, round_shape
from hycoc.passes.plan_graphs import handoff_plan, slm_luts
from hycoc.passes.plan_models import HandoffDims

from hycoc.recipe import load_recipe


def test_handoff_plan_counts_the_wire_bytes_by_hand():
    # H = 4; sliding producer 1 head x 2 dims (2 values per K row), full producer 1 head x 4 dims (4 values)
    dims = HandoffDims(layers={"sliding": 0, "full": 1}, hidden=4, kv_sliding=1, dim_sliding=2, kv_full=1, dim_full=4)
    h = handoff_plan(dims, window=3, tree_rows=2)
    assert (h["kv_dim_sliding"], h["kv_dim_full"]) == (2, 4)
    # per round: 44 B fixed part + x_hat = [e; h] at 8 bits, 2 x 4 = 8 B
    assert (h["handoff_fixed_bytes"], h["handoff_x_hat_bytes"], h["handoff_bytes_per_round"]) == (44, 8, 52)
    # per position: K and V of both layers at 8 bits, 2 x (2 + 4) = 12 B
    assert h["handoff_bytes_per_position"] == 12
    # the first hand-off carries the W = 3 window: 52 + 3 x 12 = 88 B
    assert (h["first_handoff_bytes"], h["first_reply_positions"]) == (88, 3)
    # a ROUND of 2 rows: 16 B header + 7 B fixed + 2 x (4 B id + 2 B parent + 2 B score) = 39 B
    assert (h["tree_rows"], h["tree_bytes_per_round"]) == (2, 39)
    assert h["verifier_layers"] == {"sliding": 0, "full": 1}


def test_slm_luts_pack_each_table_at_its_width():
    config = SimpleNamespace(
        vocab_size=10, hidden_size=6, num_hidden_layers=3, hidden_size_per_layer_input=2, vocab_size_per_layer_input=5
    )
    luts = slm_luts(config, {"embed_tokens_per_layer": {"num_bits": 2}}, 4)
    # token table: 10 rows x 6 values at the default 4 bits = 240 bits = 30 B; one float32 scale per row: 40 B
    assert luts["embed_tokens"] == {"rows": 10, "cols": 6, "bits": 4, "bytes": 30, "scale_bytes": 40}
    # per-layer table: 5 rows x (3 layers x 2) = 30 values at 2 bits = 60 bits -> 8 B (rounded up); scales 20 B
    assert luts["embed_tokens_per_layer"] == {"rows": 5, "cols": 6, "bits": 2, "bytes": 8, "scale_bytes": 20}
    # no per-layer inputs (P = 0): the token table alone
    assert list(slm_luts(SimpleNamespace(**{**vars(config), "hidden_size_per_layer_input": 0}), {}, 8)) == [
        "embed_tokens"
    ]


def test_paper_comparison_is_the_difference_to_each_paper_number():
    ours = {key: value for key, (value, _) in PAPER.items()} | {"tree_bytes_per_round": 287}
    paper = paper_comparison(ours, head_bits=8)
    tree = paper["tree_bytes_per_round"]
    # 287 - 2,200 = -1,913 B; -1,913 / 2,200 = -0.869545... -> -86.95 %
    assert (tree["paper"], tree["plan"], tree["diff"], tree["diff_pct"]) == (2200, 287, -1913, -86.95)
    assert tree["note"].startswith("hycoc's ROUND frame is 16 + 7 + 8 R bytes")
    assert paper["slm_graph_bytes"]["diff"] == 0 and paper["slm_graph_bytes"]["diff_pct"] == 0.0
    # a W8 head is not the paper's W4 figure: said so; at W4 no note
    assert "weight_bits is 8" in paper["head_graph_bytes"]["note"]
    assert "note" not in paper_comparison(ours, head_bits=4)["head_graph_bytes"]


def test_round_shape_is_the_recipes_tree():
    from pathlib import Path

    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "gemma4.toml")
    shape = round_shape(recipe)
    # B nodes + the root on the wire; the SLM graph's static rows are the B nodes
    assert shape["tree_rows"] == shape["node_budget"] + 1 and shape["slm_rows"] == shape["node_budget"]
    assert list(shape) == ["keep_set", "head_window", "node_budget", "tree_rows", "slm_rows", "chain_length"]
