"""Shared fixtures: the tiny recipe of tests/test_build.py built once per test session into a cpu bundle."""

from __future__ import annotations

import io
from types import SimpleNamespace

import pytest


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """The tiny recipe's whole pipeline (target_cpu last) run twice on one cache, once per test session:
    SimpleNamespace(recipe, path (recipe.toml), root, cache, first, second), first and second the two
    `PipelineResult`s (first: every pass ran; second: all cache hits). Built once, shared by tests/test_build.py
    and `tiny_bundle` (each full build of the tiny recipe costs ~30 s of the suite)."""
    from rich.console import Console
    from test_build import write_tiny_recipe

    from hycoc.passes import build as b
    from hycoc.recipe import load_recipe

    root = tmp_path_factory.mktemp("tiny_bundle")
    path = write_tiny_recipe(root)
    recipe = load_recipe(path)
    first = b.run_pipeline(recipe, "cpu", root / "cache", console=Console(file=io.StringIO()))
    second = b.run_pipeline(recipe, "cpu", root / "cache", console=Console(file=io.StringIO()))
    return SimpleNamespace(recipe=recipe, path=path, root=root, cache=root / "cache", first=first, second=second)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_pipeline):
    """SimpleNamespace(recipe, path (recipe.toml), root, bundle (cpu bundle folder), cache (pipeline cache)): the
    bundle written from `tiny_pipeline`'s cache (every pass a cache hit)."""
    from rich.console import Console

    from hycoc.passes import build as b

    p = tiny_pipeline
    b.build_bundle(p.recipe, "cpu", p.root / "bundle", p.cache, console=Console(file=io.StringIO()))
    return SimpleNamespace(recipe=p.recipe, path=p.path, root=p.root, bundle=p.root / "bundle", cache=p.cache)
