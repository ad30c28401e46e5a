"""The product reads only what ships in the repository (docs/toy-family.md: the build and the bench need nothing else):
no ../shared, no /usr/share/doc.

* the source: no product file names a path beside the repository or the Debian docs (only the toy trainer,
  ``python -m hycoc.toy.train``, reads the docs: its corpus);
* the toy recipe's inputs: the keep-set pass, the calibration prompts and the benchmark's questions, run on the
  real toy recipe with the toy-corpus module made unimportable, open nothing outside the repository, the
  interpreter's environment and the temp folder (audit hooks record every open and directory listing);
* a whole build (the tiny recipe, every pass to the bundle) likewise, with the recipe's own folder allowed.
"""

from __future__ import annotations

import re
import sys

import pytest
from opened_files import allowed_roots, outside, recording
from paths import ROOT

PRODUCT = ["hycoc", "passes", "runtime", "verifier", "targets", "recipes", "benchmarks", ".ci"]
TRAINER = {ROOT / "hycoc/toy/corpus.py", ROOT / "hycoc/toy/train.py"}
OUTSIDE = re.compile(r"\.\./shared|\"shared\"\s*/\s*\"data\"|/usr/share/doc|parents\[2\]\s*/\s*\"shared\"")


def test_no_product_file_names_a_path_outside_the_repository():
    files = [
        p
        for d in PRODUCT
        for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix in (".py", ".toml", ".sh", "") and "__pycache__" not in p.parts
    ]
    assert len(files) > 50
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for p in files
        if p not in TRAINER
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
        if OUTSIDE.search(line)
    ]
    assert hits == []
    # the trainer is the one place that names the docs, and it says how to install them
    assert "apt-get install -y python3.11-doc" in (ROOT / "hycoc/toy/train.py").read_text()


@pytest.fixture
def no_toy_corpus(monkeypatch):
    """hycoc.toy.corpus unimportable: anything that reaches for the docs corpus fails loudly."""
    monkeypatch.setitem(sys.modules, "hycoc.toy.corpus", None)
    with pytest.raises(ImportError):
        import hycoc.toy.corpus  # noqa: F401  (the import itself must fail)


def test_toy_recipe_inputs_come_from_the_repository(no_toy_corpus):
    from hycoc.passes.artifacts import TokenizerArtifact
    from hycoc.passes.calibration_answers import select_prompts
    from hycoc.passes.keep_set import KeepSetPass

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.models import load_tokenizer
    from hycoc.recipe import load_recipe

    recipe = load_recipe(ROOT / "recipes/toy.toml")
    with recording() as opened:
        tokenizer = load_tokenizer(recipe.model_source("tokenizer"))
        step = KeepSetPass()
        step.key_material(recipe)
        outputs, report = step.run({"tokenizer": TokenizerArtifact("tokenizer", tokenizer)}, recipe)
        train, evals, source = select_prompts(recipe, tokenizer)
        questions = load_spec_bench(recipe.resolve_path(recipe.bench.dataset))
    assert outside(opened, allowed_roots()) == []
    corpus = ROOT / "recipes/toy/data/conversations.jsonl"
    assert str(corpus) in opened and str(ROOT / "benchmarks/data/spec_bench_question.jsonl") in opened
    assert not any(p.startswith("/usr/share/doc") for p in opened)
    # the keep set counts the first keep_set.corpus_conversations lines; the prompts come from the lines after
    stats = outputs["keep_set"].stats
    assert stats.corpus == str(corpus) and stats.conversations == recipe.keep_set.corpus_conversations
    assert source == f"{corpus} after line {recipe.keep_set.corpus_conversations}"
    assert len(train) == recipe.head_qat.calibration_prompts and len(evals) == recipe.head_qat.eval_prompts
    assert len(questions) == 480


@pytest.mark.slow
def test_a_whole_build_reads_only_the_repository_and_the_recipe_folder(tmp_path, no_toy_corpus):
    import io

    from hycoc.passes.build import BuildSettings, build_bundle
    from rich.console import Console
    from test_build import write_tiny_recipe

    from hycoc.recipe import load_recipe

    recipe_path = write_tiny_recipe(tmp_path / "recipe")
    with recording() as opened:
        build_bundle(
            load_recipe(recipe_path),
            "cpu",
            tmp_path / "bundle",
            cache_dir=tmp_path / "cache",
            settings=BuildSettings(console=Console(file=io.StringIO())),
        )
    assert (tmp_path / "bundle" / "manifest.json").is_file()
    assert outside(opened, allowed_roots(tmp_path)) == []
    assert any(p.endswith("corpus.jsonl") for p in opened)  # the recipe's own keep-set corpus was read
