"""A bundle is relocatable (docs/design.md "Bundle"): built in one folder, moved to another (another machine), it
loads, and none of its files names the folder it was built in, the recipe's folder or the checkpoint folders. The
chat format's ``sources`` (where the template and stop ids were read) name each file by the recipe key of its folder
(`hycoc.chat_template.bundle_chat_format`), report.json the passes' inputs relative to the recipe
(`hycoc.passes.bundle_write.recipe_relative`); bundles that recorded the build path still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from paths import ROOT

from hycoc.bundle import load_manifest
from hycoc.chat_template import bundle_chat_format, chat_from_recipe, portable_source
from hycoc.recipe import load_recipe


def build_paths(recipe) -> list[str]:
    """Every folder of the build machine a bundle could name: the recipe's folder and its models' folders."""
    paths = {str(recipe.base_dir), str(Path(recipe.base_dir).resolve())}
    for role in ("verifier", "head", "slm", "tokenizer"):
        path = recipe.model_path(role)
        paths |= {str(path), str(path.resolve())}
    return sorted(paths)


def moved(bundle: Path, tmp_path: Path) -> tuple[Path, Path]:
    """(where the copy was built, where it lies now): the bundle copied to ``tmp_path/built``, then moved away."""
    built = tmp_path / "built" / "bundle"
    shutil.copytree(bundle, built)
    now = tmp_path / "elsewhere" / "renamed"
    now.parent.mkdir()
    shutil.move(built, now)
    assert not built.exists()
    return built, now


def test_a_moved_bundle_loads_and_names_no_path_of_where_it_was_built(tiny_bundle, tmp_path):
    from hycoc.runtime.device_bundle import open_bundle

    built, now = moved(tiny_bundle.bundle, tmp_path)
    old = [*build_paths(tiny_bundle.recipe), str(tiny_bundle.bundle), str(built)]
    opened = open_bundle(now, "cpu")  # every file's sha256, graph IO, the chat template: all from the new folder
    manifest = load_manifest(now)
    loaded = json.dumps(manifest.model_dump(mode="json")) + json.dumps(opened.chat.format.model_dump(mode="json"))
    assert [p for p in old if p in loaded] == []
    files = sorted(f for f in now.rglob("*") if f.is_file())  # manifest.json, report.json, graphs, tables
    assert len(files) == len(manifest.files) + 1
    assert [(f.name, p) for f in files for p in old if p.encode() in f.read_bytes()] == []
    # what the sources name instead: the file inside the recipe's [models] folder it was read from
    tokenizer = tiny_bundle.recipe.model_path("tokenizer")
    template = (
        "chat_template.jinja"
        if (tokenizer / "chat_template.jinja").is_file()
        else ("tokenizer_config.json:chat_template")
    )
    assert manifest.chat.sources["template"] == f"{template} of [models].tokenizer"
    assert manifest.chat.sources["stop_ids"] == "generation_config.json of [models].verifier"
    # and the template itself travels whole: the same text and sha256 as the checkpoint's
    source = chat_from_recipe(tiny_bundle.recipe).format
    assert (manifest.chat.template, manifest.chat.template_sha256) == (source.template, source.template_sha256)


def test_a_bundle_that_recorded_the_build_path_still_loads(tiny_bundle, tmp_path):
    """Bundles built before the sources were portable name the build machine's files: they load as before (the
    template travels whole in the manifest; nothing opens the named file)."""
    from hycoc.runtime.device_bundle import open_bundle

    _, now = moved(tiny_bundle.bundle, tmp_path)
    m = load_manifest(now)
    absolute = chat_from_recipe(tiny_bundle.recipe).format  # what such a bundle recorded: this machine's paths
    assert any(p in json.dumps(absolute.sources) for p in build_paths(tiny_bundle.recipe))
    m = m.model_copy(update={"chat": absolute})
    (now / "manifest.json").write_text(m.model_copy(update={"digest": m.content_digest()}).to_json())
    assert open_bundle(now, "cpu").chat.format.sources == absolute.sources


def test_the_toy_recipe_names_each_source_by_the_role_it_was_read_for():
    """recipes/toy.toml's tokenizer and verifier are one folder (as a Gemma 4 checkpoint's): the template is named
    by [models].tokenizer, the stop ids by [models].verifier (`hycoc.chat_template.load_chat_format`'s order)."""
    recipe = load_recipe(ROOT / "recipes" / "toy.toml")
    assert recipe.model_path("tokenizer") == recipe.model_path("verifier")
    folder = recipe.model_path("tokenizer")
    template = (
        "chat_template.jinja" if (folder / "chat_template.jinja").is_file() else ("tokenizer_config.json:chat_template")
    )
    sources = bundle_chat_format(recipe).sources
    assert sources["template"] == f"{template} of [models].tokenizer"
    assert sources["stop_ids"] == "generation_config.json of [models].verifier"
    assert not any(p in json.dumps(sources) for p in build_paths(recipe))


@pytest.mark.parametrize(
    "source,expected",
    [
        ("/m/tok/tokenizer_config.json:chat_template", "tokenizer_config.json:chat_template of [models].tokenizer"),
        ("/m/tok/sub/chat_template.jinja", "sub/chat_template.jinja of [models].tokenizer"),
        ("/m/ver/generation_config.json", "generation_config.json of [models].verifier"),
        ("/elsewhere/generation_config.json", "generation_config.json"),
        ("C:\\models\\gemma\\tokenizer_config.json:chat_template", "tokenizer_config.json:chat_template"),
        ("transformers 5.24.0 response template for 'gemma4'", "transformers 5.24.0 response template for 'gemma4'"),
        ("toy/models/verifier/generation_config.json", "toy/models/verifier/generation_config.json"),
    ],
)
def test_portable_source(source, expected):
    folders = [("[models].tokenizer", Path("/m/tok")), ("[models].verifier", Path("/m/ver"))]
    assert portable_source(source, folders) == expected


def test_the_report_names_the_passes_inputs_as_the_recipe_does(tmp_path):
    from hycoc.passes.bundle_write import recipe_relative

    base = tmp_path / "recipes"
    report = {
        "passes": [{"numbers": {"prompts": f"{base}/toy/data/c.jsonl after line 2000", "n": 3}}],
        "x": [f"{base}"],
    }
    assert recipe_relative(report, base) == {
        "passes": [{"numbers": {"prompts": "toy/data/c.jsonl after line 2000", "n": 3}}],
        "x": [str(base)],  # the folder itself is not a path under it
    }
