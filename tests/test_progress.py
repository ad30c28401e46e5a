"""Progress of long steps (hycoc/progress.py): plain timestamped lines in a log, bars on a terminal, and a pass's
steps shown inside the pass manager's own display (rich allows one live display per console)."""

from __future__ import annotations

import io
import re

from rich.console import Console

from hycoc import progress
from hycoc.passes.artifacts import KeepSetArtifact
from hycoc.passes.pipeline import Pass, PassReport, Pipeline
from hycoc.recipe import Recipe


class Counting(Pass):
    """A pass that reports a 3-unit step, like the QAT loop."""

    name = "counting"
    section = "keep_set"
    produces = {"keep_set": KeepSetArtifact}

    def run(self, inputs, recipe):
        with progress.step("units", total=3) as s:
            for i in range(3):
                s.advance(note=f"loss {i}.5")
        import numpy as np

        return {"keep_set": KeepSetArtifact("keep_set", np.arange(3))}, PassReport("3 units")


def test_plain_lines_in_a_log(monkeypatch, tmp_path):
    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)  # every advance prints
    out = io.StringIO()
    Pipeline([Counting()], tmp_path, console=Console(file=out, width=200)).run(Recipe())
    lines = [re.sub(r"^\[hycoc \d\d:\d\d:\d\d\] ", "", x) for x in out.getvalue().splitlines() if x.startswith("[hycoc")]
    assert lines[0] == "[1/1] counting: started"
    assert lines[1] == "counting: units: started (3 to do)"
    assert re.fullmatch(r"counting: units 1/3, elapsed [\d.]+ s, ETA [\d.]+ s loss 0\.5", lines[2])
    assert re.fullmatch(r"counting: units 3/3, elapsed [\d.]+ s loss 2\.5", lines[4])
    assert re.fullmatch(r"counting: units: done 3/3 in [\d.]+ s \(loss 2\.5\)", lines[5])
    assert re.fullmatch(r"\[1/1\] counting: ran, [\d.]+ s \(CPU [\d.]+ s\): 3 units", lines[6])
    assert "hycoc build: passes" in out.getvalue()  # the summary table


def test_steps_join_the_pipeline_display_on_a_terminal(tmp_path):
    out = io.StringIO()
    c = Console(file=out, force_terminal=True, width=120)
    result = Pipeline([Counting()], tmp_path, console=c).run(Recipe())  # a nested Progress would raise LiveError
    assert result.reports[0].summary == "3 units"
    assert "[hycoc" not in out.getvalue()  # no plain lines on a terminal
    # outside a pipeline a step draws its own bar
    with progress.step("alone", total=2, c=c) as s:
        s.advance(2)
    assert s.done == 2


def test_a_step_that_counts_nothing_says_done_without_a_zero():
    out = io.StringIO()
    with progress.step("hand-offs", c=Console(file=out, width=200)):
        pass
    last = re.sub(r"^\[hycoc \d\d:\d\d:\d\d\] ", "", out.getvalue().splitlines()[-1])
    assert re.fullmatch(r"hand-offs: done in [\d.]+ s", last), last
