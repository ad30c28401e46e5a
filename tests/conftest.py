"""Shared fixtures: the tiny recipe of tests/test_build.py built once per test session into a cpu bundle."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def tiny_bundle(tmp_path_factory):
    """SimpleNamespace(recipe, path (recipe.toml), root, bundle (cpu bundle folder), cache (pipeline cache))."""
    from rich.console import Console
    from test_build import write_tiny_recipe

    from hycoc.passes import build as b
    from hycoc.recipe import load_recipe

    root = tmp_path_factory.mktemp("tiny_bundle")
    path = write_tiny_recipe(root)
    recipe = load_recipe(path)
    b.build_bundle(recipe, "cpu", root / "bundle", root / "cache", console=Console(file=io.StringIO()))
    return SimpleNamespace(recipe=recipe, path=path, root=root, bundle=root / "bundle", cache=root / "cache")
