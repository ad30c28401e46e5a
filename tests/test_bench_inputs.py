"""What bench-like commands run on (hycoc/bench/inputs.py): the bundle (built first when the default one is missing)
and the questions, with one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest
from paths import ROOT, TOY

from hycoc.bench.inputs import BenchInputError, bench_bundle, bench_questions, display_path
from hycoc.recipe import load_recipe

DATASET = ROOT / "benchmarks" / "data" / "spec_bench_question.jsonl"


def test_a_missing_default_bundle_is_built_with_one_short_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg, said, built = load_recipe(TOY), [], []
    got = bench_bundle(cfg, Path("recipes/toy.toml"), None, tmp_path, say=said.append, build=lambda *a: built.append(a))
    assert got == tmp_path / "bundles" / "toy-cpu"
    assert built == [(cfg, "cpu", tmp_path / "bundles" / "toy-cpu", tmp_path / ".hycoc-cache")]
    assert said == ["hycoc bench: no bundle yet; building bundles/toy-cpu (hycoc build, target cpu)"]
    assert len(said[0]) <= 80


def test_an_existing_bundle_is_used_and_a_given_one_must_have_a_manifest(tmp_path):
    cfg = load_recipe(TOY)
    (tmp_path / "bundles" / "toy-cpu").mkdir(parents=True)
    (tmp_path / "bundles" / "toy-cpu" / "manifest.json").write_text("{}")

    def never(*a):
        return pytest.fail("built")

    assert bench_bundle(cfg, TOY, None, tmp_path, say=never, build=never) == tmp_path / "bundles" / "toy-cpu"
    with pytest.raises(BenchInputError) as e:
        bench_bundle(cfg, TOY, tmp_path / "nope", tmp_path, command="tune-epsilon", say=never, build=never)
    assert str(e.value) == f"--bundle {tmp_path / 'nope'}: no such folder; build one with hycoc build"
    with pytest.raises(BenchInputError, match="no manifest.json there"):
        bench_bundle(cfg, TOY, tmp_path, tmp_path, say=never, build=never)


def test_bench_questions_refuse_a_mistyped_dataset_name_before_building(tmp_path):
    cfg = load_recipe(TOY)
    with pytest.raises(BenchInputError) as e:
        bench_questions(
            cfg, TOY, None, "spec-bnech", None, tmp_path, DATASET, say=print, build=lambda *a: pytest.fail("built")
        )
    assert str(e.value).startswith("--dataset spec-bnech: not a built-in dataset (spec-bench, ")


def test_bench_questions_come_from_the_recipe_s_bench_dataset(tmp_path):
    cfg = load_recipe(TOY)  # bench.dataset = "../benchmarks/data/spec_bench_question.jsonl"
    questions, name, bundle_dir = bench_questions(
        cfg, TOY, None, None, None, tmp_path, DATASET, say=lambda _: None, build=lambda *a: None
    )
    assert (len(questions), name, bundle_dir) == (480, "Spec-Bench", tmp_path / "bundles" / "toy-cpu")
    assert questions[0].question_id == 81


def test_display_path_is_relative_under_the_working_directory(tmp_path):
    assert display_path(tmp_path / "a" / "b", cwd=tmp_path) == "a/b"
    assert display_path(Path("/elsewhere/x"), cwd=tmp_path) == "/elsewhere/x"
