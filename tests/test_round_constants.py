"""The bundle's round constants are derived from the recipe (issue 39 item 3): every device-visible recipe key
reaches `hycoc.bundle_constants.RoundConstants` under its name with the recipe's type and range, the build fills them
from the recipe by that mapping, and a manifest written before the derivation still loads with the same bytes."""

from __future__ import annotations

import json

import pytest
from hycoc.passes.bundle_io import round_constants
from paths import ROOT
from pydantic import ValidationError

from hycoc.bundle_constants import ROUND_SOURCES, ROUND_TABLES, RoundConstants
from hycoc.recipe import Recipe, load_recipe

#: The recipe keys the device reads each round (Alg. 1-4, Table 5): the contract this file holds the bundle to.
DEVICE_VISIBLE = {
    "tree": {
        "chain_length",
        "sibling_depth",
        "node_budget",
        "depth_cost",
        "slm_candidates",
        "slm_passes",
        "specedge_passes",
        "specedge_nodes",
    },
    "window": {"head_window", "slm_window", "slm_sliding_window", "head_query_position_offset"},
    "acceptance": {"epsilon", "mode"},
    "sampling": {"temperature", "top_k", "top_p", "max_new_tokens", "seed"},
}

#: The toy recipe's round constants as the bundle carried them before they were derived (bundles/toy-cpu).
TOY_ROUND = (
    '{"chain_length":4,"sibling_depth":2,"node_budget":32,"head_window":256,"slm_window":256,'
    '"slm_sliding_window":128,"head_query_position_offset":-1,"depth_cost":0.66,"epsilon":1.0,'
    '"acceptance_mode":"epsilon","slm_candidates":32,"slm_passes":1,"specedge_passes":4,"specedge_nodes":32,'
    '"temperature":0.5,"top_k":64,"top_p":0.95,"max_new_tokens":256,"seed":0}'
)


def test_every_device_visible_recipe_key_reaches_the_bundle():
    reached: dict[str, set[str]] = {}
    for key in ROUND_SOURCES.values():
        section, name = key.split(".")
        reached.setdefault(section, set()).add(name)
    assert reached == DEVICE_VISIBLE
    assert set(ROUND_TABLES) == set(DEVICE_VISIBLE)
    for section, table in ROUND_TABLES.items():
        assert type(getattr(Recipe(), section)) is table, section


def test_each_round_constant_has_its_recipe_keys_type_and_range():
    for name, key in ROUND_SOURCES.items():
        section, field = key.split(".")
        ours, theirs = RoundConstants.model_fields[name], ROUND_TABLES[section].model_fields[field]
        assert name == (field if field != "mode" else "acceptance_mode")
        assert ours.annotation == theirs.annotation, name
        assert ours.metadata == theirs.metadata, name
        assert ours.description == theirs.description, name
        assert ours.is_required(), name  # a manifest names every constant


def test_the_bundle_refuses_what_the_recipe_refuses():
    # node_budget: le=1024 in the recipe and, derived, in the bundle (they disagreed before)
    good = json.loads(TOY_ROUND)
    with pytest.raises(ValidationError, match="node_budget"):
        RoundConstants.model_validate({**good, "node_budget": 1025})
    with pytest.raises(ValidationError, match="chain_length"):
        RoundConstants.model_validate({**good, "chain_length": 17})
    assert RoundConstants.model_validate({**good, "node_budget": 1024}).node_budget == 1024


@pytest.mark.parametrize("path", ["recipes/toy.toml", "recipes/gemma4.toml"])
def test_the_build_fills_every_constant_from_its_recipe_key(path):
    recipe = load_recipe(ROOT / path)
    rc = round_constants(recipe)
    for name, key in ROUND_SOURCES.items():
        section, field = key.split(".")
        assert getattr(rc, name) == getattr(getattr(recipe, section), field), name
    assert rc.sampling == recipe.sampling.distribution


def test_the_toy_round_constants_are_byte_identical_and_an_old_manifest_loads():
    assert round_constants(load_recipe(ROOT / "recipes/toy.toml")).model_dump_json() == TOY_ROUND
    assert RoundConstants.model_validate_json(TOY_ROUND).model_dump_json() == TOY_ROUND
    manifest = ROOT / "bundles/toy-cpu/manifest.json"
    if manifest.exists():  # built by `hycoc build recipes/toy.toml --target cpu` (not in git)
        from hycoc.bundle import load_manifest

        loaded = load_manifest(manifest.parent)
        assert loaded.round.model_dump_json() == TOY_ROUND
