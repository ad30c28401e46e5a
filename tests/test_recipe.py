"""Recipes: the shipped files load with the paper's values; every kind of bad input gets its own error that names
the key, the file, the line, the bad value and what is allowed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from hycoc.recipe import HANGUL_RANGES, Recipe, RecipeError, load_recipe, parse_code_point_range

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def write(tmp_path: Path, text: str, name: str = "r.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str) -> tuple[RecipeError, Path]:
    path = write(tmp_path, text)
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return info.value, path


# ---- the shipped recipes ----------------------------------------------------------------------------------------


def test_gemma4_recipe_is_the_papers_deployment():
    r = load_recipe(RECIPES / "gemma4.toml")
    assert r.recipe.name == "gemma4"
    assert r.models.verifier == "google/gemma-4-26B-A4B-it"
    assert r.models.head == "google/gemma-4-26B-A4B-it-assistant"
    assert r.models.slm == "google/gemma-4-E2B-it-qat-mobile-transformers"
    assert r.models.head_config_assumed is True
    # App. C / Table 5 "HyCo" row
    assert (r.tree.chain_length, r.tree.sibling_depth, r.tree.node_budget) == (4, 2, 32)
    assert (r.tree.depth_cost, r.tree.slm_candidates, r.tree.slm_passes) == (0.66, 32, 1)
    assert (r.tree.specedge_passes, r.tree.specedge_nodes) == (4, 32)
    assert (r.window.head_window, r.window.slm_window, r.window.slm_sliding_window) == (1024, 1024, 512)
    # the head's input as transformers' Gemma 4 MTP generator feeds it (tests/test_head_convention.py), not App. A
    assert r.window.head_query_position_offset == 0
    assert r.keep_set.size == 86089
    assert r.keep_set.corpus_conversations == 20000
    assert r.keep_set.code_point_ranges() == [(0x1100, 0x11FF), (0x3130, 0x318F), (0xAC00, 0xD7A3)]
    assert (r.acceptance.mode, r.acceptance.epsilon, r.acceptance.effective_epsilon) == ("epsilon", 0.005, 0.005)
    assert (r.sampling.temperature, r.sampling.top_k, r.sampling.top_p) == (1.0, 64, 0.95)
    assert r.sampling.max_new_tokens == 1024
    # Table 4
    q = r.head_qat
    assert (q.weight_bits, q.steps, q.lr, q.warmup_steps, q.schedule) == (4, 100, 1e-5, 50, "cosine")
    assert (q.grad_accum, q.grad_clip, q.betas, q.weight_decay) == (2, 1.0, (0.9, 0.95), 0.0)
    assert (q.clip_search_max, q.clip_search_min) == (1.0, 0.6)
    assert (q.calibration_prompts, q.calibration_max_new_tokens, q.eval_prompts, q.eval_max_new_tokens) == (
        60,
        1024,
        60,
        512,
    )
    assert (q.max_seq_len, q.input_range_percentile) == (2048, 99.99)
    # App. A
    c = r.slm_calibration
    assert (c.prompts, c.percentile, c.range_scale, c.activation_bits, c.kv_bits) == (60, 99.9, 1.2, 16, 8)
    assert (r.handoff.bits, r.handoff.hidden) == (8, "post_norm")
    assert (r.target.name, r.target.htp_arch, r.target.soc_model) == ("htp-v81", 81, "SM8850")
    assert (r.verifier.device, r.verifier.dtype, r.verifier.max_frame_bytes) == ("cuda", "bfloat16", 8 * 2**20)


def test_gemma4_recipe_equals_the_schema_defaults():
    """Every default of the schema is the paper's: the paper's recipe differs only in names and bench data."""
    r = load_recipe(RECIPES / "gemma4.toml").model_dump()
    d = Recipe().model_dump()
    for section, key in [
        ("recipe", "name"),
        ("recipe", "description"),
        ("models", "head_config_assumed"),
        ("bench", "dataset"),
    ]:
        r[section].pop(key)
        d[section].pop(key)
    assert r == d


def test_toy_recipe_scales_only_the_sizes():
    toy = load_recipe(RECIPES / "toy.toml")
    paper = load_recipe(RECIPES / "gemma4.toml")
    assert toy.keep_set.size == 1024
    assert (toy.keep_set.corpus, toy.keep_set.corpus_conversations) == ("toy/data/conversations.jsonl", 2000)
    assert (toy.window.head_window, toy.window.slm_window, toy.window.slm_sliding_window) == (256, 256, 128)
    assert toy.sampling.max_new_tokens == 256
    # the toy head was trained on the paper's convention (pre-norm h, query at t - 1) and keeps it
    assert (toy.handoff.hidden, toy.window.head_query_position_offset) == ("pre_norm", -1)
    assert (toy.verifier.device, toy.verifier.dtype) == ("cpu", "float32")
    # the trainer's calibration (recipes/toy/models/report.json)
    report = json.loads((RECIPES / "toy" / "models" / "report.json").read_text())["handoff_scales"]
    assert toy.handoff.scales() == {
        "embedding": report["e"],
        "hidden": report["h"],
        **{k: report[k] for k in ("k_sliding", "v_sliding", "k_full", "v_full")},
    }
    assert toy.tree == paper.tree
    # the target as the paper's, except that the toy's htp bundle runs on the x86 simulator (no shared binaries)
    assert (toy.target.share_weights, paper.target.share_weights) == (False, True)
    assert toy.target.model_copy(update={"share_weights": True}) == paper.target
    # Table 4 as the paper, the answer caps scaled to the toy's 256-token output cap
    assert (toy.head_qat.calibration_max_new_tokens, toy.head_qat.eval_max_new_tokens) == (256, 256)
    assert (
        toy.head_qat.model_copy(update={"calibration_max_new_tokens": 1024, "eval_max_new_tokens": 512})
        == paper.head_qat
    )
    # the SLM's calibration as the paper's: 60 prompts, the head QAT's greedy answers
    assert toy.slm_calibration == paper.slm_calibration
    # T = 0.5 on the toy, stated in the recipe with the MAT at both temperatures; top-k/top-p as the paper
    assert (toy.sampling.temperature, toy.sampling.top_k, toy.sampling.top_p) == (0.5, 64, 0.95)
    assert (paper.sampling.temperature, paper.sampling.top_k, paper.sampling.top_p) == (1.0, 64, 0.95)


def test_toy_model_paths_resolve_against_the_recipe_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    toy = load_recipe(RECIPES / "toy.toml")
    assert toy.source_path == RECIPES / "toy.toml"
    for role, rel in [
        ("verifier", "toy/models/verifier"),
        ("head", "toy/models/head"),
        ("slm", "toy/models/slm"),
        ("tokenizer", "toy/models/verifier"),
    ]:
        assert toy.is_hub_id(role) is False
        assert toy.model_source(role) == RECIPES / rel
    assert toy.resolve_path(toy.bench.dataset) == RECIPES.parent / "benchmarks/data/spec_bench_question.jsonl"


def test_relative_paths_follow_a_moved_recipe(tmp_path, monkeypatch):
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    shutil.copy(RECIPES / "toy.toml", folder / "toy.toml")
    (folder / "toy/models/verifier").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    r = load_recipe("elsewhere/toy.toml")
    assert r.source_path == folder / "toy.toml"
    assert r.model_path("verifier") == folder / "toy/models/verifier"
    with pytest.raises(RecipeError) as info:
        r.model_path("head")
    assert info.value.key == "models.head"
    assert str(folder / "toy/models/head") in str(info.value) and "does not exist" in str(info.value)


def test_hub_ids_and_local_folders(tmp_path):
    r = load_recipe(RECIPES / "gemma4.toml")
    assert r.is_hub_id("verifier") and r.model_source("verifier") == "google/gemma-4-26B-A4B-it"
    with pytest.raises(RecipeError) as info:
        r.model_path("slm")
    assert info.value.key == "models.slm"
    assert "hub id" in str(info.value) and "hf download" in str(info.value)
    (tmp_path / "google/gemma-4-26B-A4B-it").mkdir(parents=True)  # a folder of that name wins over the hub id
    local = load_recipe(write(tmp_path, '[models]\nverifier = "google/gemma-4-26B-A4B-it"\n'))
    assert local.is_hub_id("verifier") is False
    assert local.model_path("verifier") == tmp_path / "google/gemma-4-26B-A4B-it"
    forced = load_recipe(write(tmp_path, '[models]\nverifier = "./owner/name"\n', "f.toml"))
    assert forced.is_hub_id("verifier") is False


def test_content_hash_is_canonical(tmp_path):
    a = load_recipe(write(tmp_path, "[tree]\nnode_budget = 32\nchain_length = 4\n", "a.toml"))
    b = load_recipe(write(tmp_path, "[tree]\nchain_length = 4   # K\nnode_budget = 32\n", "b.toml"))
    c = load_recipe(write(tmp_path, "[tree]\nnode_budget = 31\n", "c.toml"))
    assert a.content_hash() == b.content_hash() == Recipe().content_hash()
    assert len(a.content_hash()) == 64
    assert c.content_hash() != a.content_hash()


def test_handoff_scales_must_be_set_before_use():
    with pytest.raises(RecipeError) as info:
        load_recipe(RECIPES / "gemma4.toml").handoff.scales()
    assert [p.key for p in info.value.problems] == [
        "handoff.scale_embedding",
        "handoff.scale_hidden",
        "handoff.scale_k_sliding",
        "handoff.scale_v_sliding",
        "handoff.scale_k_full",
        "handoff.scale_v_full",
    ]


def test_exact_mode_means_epsilon_one(tmp_path):
    r = load_recipe(write(tmp_path, '[acceptance]\nmode = "exact"\nepsilon = 0.005\n'))
    assert r.acceptance.effective_epsilon == 1.0


def test_integers_are_accepted_for_floats(tmp_path):
    r = load_recipe(write(tmp_path, "[sampling]\ntemperature = 0\n[head_qat]\nlr = 1\n"))
    assert r.sampling.temperature == 0.0 and isinstance(r.sampling.temperature, float)
    assert r.head_qat.lr == 1.0


def test_code_point_range_parser():
    assert [parse_code_point_range(r) for r in HANGUL_RANGES] == [(4352, 4607), (12592, 12687), (44032, 55203)]
    assert parse_code_point_range("U+1F600-U+1F64F") == (0x1F600, 0x1F64F)


# ---- errors ------------------------------------------------------------------------------------------------------

# (recipe text, dotted key, line, substrings the message must hold besides "FILE:LINE")
BAD = {
    "unknown key": (
        "[tree]\nchain_length = 4\nnode_budgett = 32\n",
        "tree.node_budgett",
        3,
        [
            "unknown key tree.node_budgett",
            "allowed keys of [tree]: chain_length, sibling_depth, node_budget, "
            "depth_cost, slm_candidates, slm_passes, specedge_passes, specedge_nodes",
        ],
    ),
    "unknown table": (
        "[tree]\nchain_length = 4\n\n[trees]\nx = 1\n",
        "trees",
        4,
        ["unknown table trees", "allowed tables of the recipe: recipe, models, keep_set, tree,"],
    ),
    "string for int": (
        '[tree]\nchain_length = "4"\n',
        "tree.chain_length",
        2,
        ['tree.chain_length = "4"', "valid integer", "allowed: an integer >= 1 and <= 16"],
    ),
    "float for int": (
        "[tree]\n\nnode_budget = 32.0\n",
        "tree.node_budget",
        3,
        ["tree.node_budget = 32.0", "valid integer", "allowed: an integer >= 1 and <= 1024"],
    ),
    "node budget beyond the wire and graphs": (
        "[tree]\nnode_budget = 40000\n",
        "tree.node_budget",
        2,
        ["tree.node_budget = 40000", "allowed: an integer >= 1 and <= 1024"],
    ),
    "node budget 1e20": (
        "[tree]\nnode_budget = 100000000000000000000.0\n",
        "tree.node_budget",
        2,
        ["tree.node_budget = 1e+20", "allowed: an integer >= 1 and <= 1024"],
    ),
    "max_new_tokens beyond u32": (
        "[sampling]\nmax_new_tokens = 5000000000\n",
        "sampling.max_new_tokens",
        2,
        ["sampling.max_new_tokens = 5000000000", "<= 1048576"],
    ),
    "server limit": (
        "[verifier]\nmax_sessions = 0\n",
        "verifier.max_sessions",
        2,
        ["verifier.max_sessions = 0", "allowed: an integer >= 1 and <= 65536"],
    ),
    "int for bool": (
        "[keep_set]\nalways_bytes = 1\n",
        "keep_set.always_bytes",
        2,
        ["keep_set.always_bytes = 1", "allowed: true or false"],
    ),
    "out of range": (
        "[recipe]\nname = 'x'\n[tree]\ndepth_cost = 1.5\n",
        "tree.depth_cost",
        4,
        ["tree.depth_cost = 1.5", "less than 1", "allowed: a number > 0 and < 1"],
    ),
    "epsilon zero": (
        "[acceptance]\nepsilon = 0.0\n",
        "acceptance.epsilon",
        2,
        ["acceptance.epsilon = 0.0", "allowed: a number > 0 and <= 1"],
    ),
    "not in the list": (
        '[acceptance]\nmode = "greedy"\n',
        "acceptance.mode",
        2,
        ['acceptance.mode = "greedy"', 'allowed: one of "epsilon", "exact"'],
    ),
    "bits": (
        "[head_qat]\nweight_bits = 3\n",
        "head_qat.weight_bits",
        2,
        ["head_qat.weight_bits = 3", "allowed: one of 2, 4, 8"],
    ),
    "bad forced range": (
        '[keep_set]\nforced_ranges = [\n  "U+1100-U+11FF",\n  "U+3130-318F",\n]\n',
        "keep_set.forced_ranges[1]",
        4,
        ['keep_set.forced_ranges[1] = "U+3130-318F"', 'allowed: strings like "U+AC00-U+D7A3"'],
    ),
    "reversed forced range": (
        '[keep_set]\nforced_ranges = ["U+D7A3-U+AC00"]\n',
        "keep_set.forced_ranges[0]",
        2,
        ["starts after it ends"],
    ),
    "beta out of range": (
        "[head_qat]\nbetas = [0.9, 1.5]\n",
        "head_qat.betas[1]",
        2,
        ["head_qat.betas[1] = 1.5", "allowed: two numbers, each in [0, 1)"],
    ),
    "bad link": (
        '[bench]\nlink = "wifi"\n',
        "bench.link",
        2,
        ['bench.link = "wifi"', '"lte", "5g", "none" or "RTT_MS:MBPS"'],
    ),
    "section not a table": ("tree = 5\n", "tree", 1, ["tree = 5 must be a table [tree]"]),
    "negative scale": (
        "[handoff]\nscale_hidden = -1.0\n",
        "handoff.scale_hidden",
        2,
        ["handoff.scale_hidden = -1.0", "allowed: a number > 0 (or leave the key out)"],
    ),
    "siblings deeper than the chain": (
        "[tree]\nchain_length = 2\nsibling_depth = 3\n",
        "tree.sibling_depth",
        3,
        [
            "tree.sibling_depth = 3: siblings can only be planted beside chain tokens, and tree.chain_length = 2",
            "allowed: an integer in [0, tree.chain_length = 2]",
        ],
    ),
    "sliding ring longer than the ring": (
        "[window]\nslm_window = 256\nslm_sliding_window = 512\n",
        "window.slm_sliding_window",
        3,
        ["window.slm_sliding_window = 512", "allowed: an integer in [1, window.slm_window = 256]"],
    ),
    "clip search reversed": (
        "[head_qat]\nclip_search_min = 0.9\nclip_search_max = 0.8\n",
        "head_qat.clip_search_min",
        2,
        ["head_qat.clip_search_min = 0.9: must be below head_qat.clip_search_max = 0.8"],
    ),
    "warm-up longer than training": (
        "[head_qat]\nsteps = 10\n",
        "head_qat.warmup_steps",
        None,
        ["head_qat.warmup_steps = 50: exceeds head_qat.steps = 10"],
    ),
    "candidates beyond the keep set": (
        "[keep_set]\nsize = 300\n[tree]\nslm_candidates = 301\n",
        "tree.slm_candidates",
        4,
        ["tree.slm_candidates = 301: exceeds keep_set.size = 300"],
    ),
    "keep set too small for bytes": (
        "[keep_set]\nsize = 100\n[tree]\nslm_candidates = 8\n",
        "keep_set.size",
        2,
        ["keep_set.size = 100: too small to hold the 256 byte tokens"],
    ),
    "arch disagrees with target": (
        '[target]\nname = "htp-v81"\nhtp_arch = 79\n',
        "target.htp_arch",
        3,
        ['target.htp_arch = 79: disagrees with target.name = "htp-v81"'],
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_each_bad_input_names_key_file_line_value_and_allowed(tmp_path, case):
    text, key, line, parts = BAD[case]
    err, path = error_of(tmp_path, text)
    assert err.key == key
    assert err.line == line
    message = str(err)
    assert message.startswith(f"{path}:{line}: " if line else f"{path}: ")
    for part in parts:
        assert part in message, (part, message)


def test_every_problem_is_reported_at_once(tmp_path):
    err, path = error_of(tmp_path, "[sampling]\ntop_k = 0\ntop_p = 2\n")
    assert [(p.key, p.line) for p in err.problems] == [("sampling.top_k", 2), ("sampling.top_p", 3)]
    assert str(err).splitlines()[1].startswith(f"{path}:3: sampling.top_p = 2")


def test_dotted_keys_are_found_at_the_top_level(tmp_path):
    err, path = error_of(tmp_path, "# comment\ntree.chain_length = 0\n")
    assert (err.key, err.line) == ("tree.chain_length", 2)


def test_missing_file(tmp_path):
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "nope.toml")
    assert str(info.value) == f"{tmp_path / 'nope.toml'}: recipe file not found"
    assert info.value.key is None


def test_toml_syntax_error_names_the_line(tmp_path):
    err, path = error_of(tmp_path, "[tree]\nchain_length = 4\nnode_budget = = 32\n")
    assert err.line == 3
    assert str(err).startswith(f"{path}:3: TOML syntax error: ")


def test_repeated_key_is_a_syntax_error(tmp_path):
    err, path = error_of(tmp_path, "[tree]\nchain_length = 4\nchain_length = 5\n")
    assert err.line == 3 and "TOML syntax error" in str(err)


@pytest.mark.parametrize("text", ["", "# nothing but a comment\n", "\n\n"])
def test_an_empty_recipe_is_refused_naming_a_starting_point(tmp_path, text):
    err, path = error_of(tmp_path, text)
    assert str(err) == (
        f"{path}: the recipe is empty: a recipe names at least its [models] (verifier, head, slm, "
        "tokenizer); start from a copy of recipes/toy.toml or recipes/gemma4.toml"
    )


def test_every_numeric_knob_has_an_upper_bound():
    """Every int / float key of every table is bounded above (hycoc/recipe/sections.py: every key with its allowed
    range, docs/recipes.md), so no value can outgrow the wire, the graphs or memory; Literal / bool / str keys are
    bounded by their type."""
    import annotated_types

    from hycoc.recipe import Recipe

    unbounded = []
    for table, section in Recipe.model_fields.items():
        for key, field in section.annotation.model_fields.items():
            if field.annotation in (int, float):
                if not any(isinstance(m, (annotated_types.Le, annotated_types.Lt)) for m in field.metadata):
                    unbounded.append(f"{table}.{key}")
    assert unbounded == []


def test_an_order_bound_without_a_lower_bound_names_the_limit_alone():
    """`Section.bounds` derives the allowed range from the field: with no ge/gt on it, only the limit is named."""
    from typing import ClassVar

    from pydantic import Field

    from hycoc.recipe.errors import CrossFieldError
    from hycoc.recipe.sections import Bound, Section

    class Pair(Section):
        table: ClassVar[str] = "pair"
        bounds = (Bound("a", "b", "exceeds {limit}"), Bound("c", "b", "reaches {limit}", strict=True))
        a: int = Field(0)
        b: int = Field(3, ge=1)
        c: float = Field(0.0)

    for kw, key, allowed in [
        ({"a": 5}, "a", "an integer at most pair.b = 3"),
        ({"c": 3.0}, "c", "a number below pair.b = 3"),
    ]:
        with pytest.raises(ValueError) as e:
            Pair(**kw)
        err = e.value.errors()[0]["ctx"]["error"]
        assert isinstance(err, CrossFieldError) and (err.key, err.allowed) == (key, allowed)
