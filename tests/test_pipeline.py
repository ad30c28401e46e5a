"""The pass manager: chain validation before anything runs, a content-addressed cache that reruns only what a
recipe edit changed, ``until``, atomic cache entries, and the plan and summary it prints."""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from pathlib import Path

import pytest
from hycoc.passes.artifacts import Artifact
from hycoc.passes.pipeline import Pass, PassReport, Pipeline, PipelineError
from rich.console import Console

from hycoc.recipe import Recipe


@dataclass
class Text(Artifact):
    """A string artifact, saved as text.txt."""

    def save(self, folder: Path) -> None:
        (folder / "text.txt").write_text(self.payload)

    @classmethod
    def load(cls, kind: str, folder: Path) -> Text:
        return cls(kind, (folder / "text.txt").read_text())

    def _compute_hash(self) -> str:
        return hashlib.sha256(self.payload.encode()).hexdigest()


@dataclass
class Other(Artifact):
    """An unrelated class, for type mismatches (never saved)."""


class Counting(Pass):
    """Counts its runs in ``calls``."""

    def __init__(self):
        self.calls = 0

    def run(self, inputs, recipe):
        self.calls += 1
        return self.make(inputs, recipe)


class Source(Counting):
    """Reads [tree]; its output only says whether chain_length > 2."""

    name, section, produces = "source", "tree", {"a": Text}

    def make(self, inputs, recipe):
        text = "long" if recipe.tree.chain_length > 2 else "short"
        return {"a": Text("a", text)}, PassReport(f"made {text}", {"length": len(text)})


class Append(Counting):
    """Reads [window]: a + head_window."""

    name, section, consumes, produces = "append", "window", {"a": Text}, {"b": Text}

    def make(self, inputs, recipe):
        return {"b": Text("b", f"{inputs['a'].payload}/{recipe.window.head_window}")}, PassReport("appended")


def quiet() -> Console:
    return Console(file=io.StringIO(), width=120)


def recipe(**sections) -> Recipe:
    return Recipe.model_validate(sections)


def entries(cache: Path, name: str) -> list[str]:
    folder = cache / name
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


# ---- validation ---------------------------------------------------------------------------------------------


def test_missing_kind_names_the_pass_and_the_kind(tmp_path):
    pipe = Pipeline([Append()], tmp_path, console=quiet())
    with pytest.raises(
        PipelineError,
        match=r"pass 1 'append' consumes 'a', which no earlier pass produces and "
        r"which is not given as input \(available before it: nothing\)",
    ):
        pipe.run(recipe())
    assert not tmp_path.joinpath("append").exists()


def test_given_input_satisfies_the_chain_and_a_wrong_class_does_not(tmp_path):
    pipe = Pipeline([Append()], tmp_path, console=quiet())
    assert pipe.run(recipe(), {"a": Text("a", "x")}).artifacts["b"].payload == "x/1024"
    with pytest.raises(PipelineError, match="'append' consumes 'a' as Text, but the given inputs provide it as Other"):
        Pipeline([Append()], tmp_path, console=quiet()).validate({"a": Other})
    with pytest.raises(PipelineError, match="consumes 'a' as Text, but pass 'other' provide"):
        other = Source()
        other.name, other.produces = "other", {"a": Other}
        Pipeline([other, Append()], tmp_path, console=quiet()).validate({})


def test_order_matters_and_names_are_unique(tmp_path):
    with pytest.raises(PipelineError, match="pass 1 'append' consumes 'a'"):
        Pipeline([Append(), Source()], tmp_path, console=quiet()).validate({})
    with pytest.raises(PipelineError, match="repeated: source"):
        Pipeline([Source(), Source()], tmp_path)


def test_unknown_recipe_table_is_an_error(tmp_path):
    bad = Source()
    bad.section = "trees"
    with pytest.raises(PipelineError, match=r"pass 1 'source' reads recipe table \[trees\], which does not exist"):
        Pipeline([bad], tmp_path, console=quiet()).validate({})


def test_a_pass_returning_other_kinds_breaks_its_contract(tmp_path):
    liar = Source()
    liar.make = lambda inputs, recipe: ({"z": Text("z", "")}, PassReport("lied"))
    with pytest.raises(PipelineError, match=r"pass 'source' returned kinds \['z'\], but declares it produces \['a'\]"):
        Pipeline([liar], tmp_path, console=quiet()).run(recipe())


# ---- cache --------------------------------------------------------------------------------------------------


def test_rerun_is_a_cache_hit(tmp_path):
    source, append = Source(), Append()
    pipe = Pipeline([source, append], tmp_path, console=quiet())
    first = pipe.run(recipe())
    second = pipe.run(recipe())
    assert (source.calls, append.calls) == (1, 1)
    assert [r.cached for r in first.reports] == [False, False]
    assert [r.cached for r in second.reports] == [True, True]
    assert second.artifacts["b"].payload == "long/1024"
    assert second.reports[0].summary == "made long" and second.reports[0].numbers == {"length": 4}
    assert [r.key for r in first.reports] == [r.key for r in second.reports]
    assert second.reports[1].location == tmp_path / "append" / first.reports[1].key


def test_recipe_edit_reruns_only_the_pass_that_reads_it(tmp_path):
    source, append = Source(), Append()
    pipe = Pipeline([source, append], tmp_path, console=quiet())
    pipe.run(recipe())
    result = pipe.run(recipe(window={"head_window": 512}))
    assert (source.calls, append.calls) == (1, 2)
    assert [r.cached for r in result.reports] == [True, False]
    assert result.artifacts["b"].payload == "long/512"
    # The first recipe's entries are still there: going back is a hit again.
    pipe.run(recipe())
    assert (source.calls, append.calls) == (1, 2)


def test_an_edit_that_yields_the_same_artifact_stops_at_that_pass(tmp_path):
    source, append = Source(), Append()
    pipe = Pipeline([source, append], tmp_path, console=quiet())
    pipe.run(recipe())
    result = pipe.run(recipe(tree={"chain_length": 5}))  # still "long": append's input hash is unchanged
    assert (source.calls, append.calls) == (2, 1)
    assert [r.cached for r in result.reports] == [False, True]
    pipe.run(recipe(tree={"chain_length": 2, "sibling_depth": 2}))  # "short"
    assert (source.calls, append.calls) == (3, 2)


def test_tool_versions_are_part_of_the_key(tmp_path):
    source = Source()
    pipe = Pipeline([source], tmp_path, console=quiet())
    pipe.run(recipe())
    pipe._versions = {**pipe._versions, "onnxruntime-qnn": "0.0.1"}
    assert pipe.run(recipe()).reports[0].cached is False
    assert source.calls == 2


def test_damaged_entry_is_rebuilt(tmp_path):
    source = Source()
    pipe = Pipeline([source], tmp_path, console=quiet())
    key = pipe.run(recipe()).reports[0].key
    (tmp_path / "source" / key / "a" / "text.txt").write_text("tampered")
    result = pipe.run(recipe())
    assert source.calls == 2 and result.artifacts["a"].payload == "long"


# ---- until, atomicity, display ------------------------------------------------------------------------------


def test_until_stops_after_the_named_pass(tmp_path):
    source, append = Source(), Append()
    pipe = Pipeline([source, append], tmp_path, console=quiet())
    result = pipe.run(recipe(), until="source")
    assert (source.calls, append.calls) == (1, 0)
    assert result.stopped_after == "source" and set(result.artifacts) == {"a"}
    assert (result.reports[0].location / "a" / "text.txt").read_text() == "long"
    assert entries(tmp_path, "append") == []
    with pytest.raises(PipelineError, match="--until sauce: no such pass; passes: source, append"):
        pipe.run(recipe(), until="sauce")


def test_a_failing_pass_leaves_no_cache_entry(tmp_path):
    class HalfSaved(Text):
        def save(self, folder):
            (folder / "text.txt").write_text("half")
            raise OSError("disk full")

    source = Source()
    source.produces = {"a": HalfSaved}
    source.make = lambda inputs, recipe: ({"a": HalfSaved("a", "x")}, PassReport("made"))
    pipe = Pipeline([source], tmp_path, console=quiet())
    with pytest.raises(OSError, match="disk full"):
        pipe.run(recipe())
    assert entries(tmp_path, "source") == []

    source.make = lambda inputs, recipe: (_ for _ in ()).throw(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        pipe.run(recipe())
    assert entries(tmp_path, "source") == []


def test_describe_and_summary(tmp_path):
    console = quiet()
    pipe = Pipeline([Source(), Append()], tmp_path, console=console)
    assert pipe.describe() == (
        "1. source (v1): reads [tree]; consumes nothing; produces a\n"
        "2. append (v1): reads [window]; consumes a; produces b"
    )
    pipe.run(recipe())
    pipe.run(recipe())
    out = console.file.getvalue()
    assert "made long" in out and "appended" in out
    assert out.count("│ no") == 2 and out.count("│ yes") == 2
