"""Progress of long steps (hycoc/progress.py): plain timestamped lines in a log, bars on a terminal, and a pass's
steps shown inside the pass manager's own display (rich allows one live display per console)."""

from __future__ import annotations

import io
import re
import sys

from hycoc.passes.artifacts import KeepSetArtifact
from hycoc.passes.pipeline import Pass, PassReport, Pipeline
from rich.console import Console

from hycoc import progress
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
    lines = [
        re.sub(r"^\[hycoc \d\d:\d\d:\d\d\] ", "", x) for x in out.getvalue().splitlines() if x.startswith("[hycoc")
    ]
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


def test_the_pass_table_and_long_progress_lines_fit_80_columns():
    from hycoc.passes.pipeline import PassReport, summary_table

    reports = []
    for i, name in enumerate(("calibration_answers", "qdq_slm")):
        r = PassReport(
            "A16 W4/8 QDQ: 449 Q / 545 DQ, 34 weights bit-exact; SQNR logits 39.1 dB, worst layer 33.0 "
            "dB, top-1 99.0% on 235 real calibration samples; ring fills 0-256 of 256 columns"
        )
        r.pass_name, r.seconds, r.cpu_seconds, r.cached = name, 1009.72 * (i + 1), 283.6, bool(i)
        reports.append(r)
    out = io.StringIO()
    c = Console(file=out, width=80)
    c.print(summary_table(reports))
    progress.plain_line(
        "[2/10] calibration_answers: ran, 92.6 s (CPU 73.3 s): 60 + 60 greedy answers (25,291 "
        "tokens, <= 256 / 256) in 92.6 s, 273 tokens/s",
        c,
    )
    lines = out.getvalue().splitlines()
    assert max(map(len, lines)) <= 80
    assert sum("qdq_slm" in ln for ln in lines) == 2  # its table row and its result line
    assert any(ln.startswith(" 2 qdq_slm: A16 W4/8 QDQ") for ln in lines)
    assert lines[-1].startswith(" " * 17) and "tokens/s" in lines[-1]  # the wrapped progress line, indented


def test_the_progress_bars_fit_80_columns_without_cutting_the_description_or_counts():
    from rich.progress import Progress

    c = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    p = Progress(*progress.bar_columns(), console=c)
    p.add_task("[3/10] calibration_answers", total=None)
    description = "  calibration_answers: verifier answers to the calibration prompts loss 0.123"
    p.update(p.add_task(description, total=60), advance=12)
    c.print(p.make_tasks_table(p.tasks))
    out = c.file.getvalue()
    assert "…" not in out and max(map(len, out.splitlines())) <= 80
    assert "12/60" in out and "ETA" in out and "0:00:00" in out
    words = " ".join(out.split())
    assert "calibration_answers: verifier answers" in words and "prompts loss 0.123" in words


def test_a_step_counted_in_seconds_says_so_in_every_line(monkeypatch):
    """`hycoc loadtest --duration 5` counts seconds: "started (5 s to do)", not "(5 to do)"."""
    monkeypatch.setattr(progress, "LINE_EVERY", 0.0)
    out = io.StringIO()
    with progress.step("serial: 4 sessions", total=5, c=Console(file=out, width=200), unit="s") as s:
        s.advance(2)
        s.advance(3)
    lines = [re.sub(r"^\[hycoc \d\d:\d\d:\d\d\] ", "", x) for x in out.getvalue().splitlines()]
    assert lines[0] == "serial: 4 sessions: started (5 s to do)"
    assert re.fullmatch(r"serial: 4 sessions 2/5 s, elapsed [\d.]+ s, ETA [\d.]+ s", lines[1]), lines[1]
    assert re.fullmatch(r"serial: 4 sessions: done 5/5 s in [\d.]+ s", lines[-1]), lines[-1]


def test_log_lines_on_a_redirected_stderr_are_not_wrapped(monkeypatch, tmp_path):
    """``hycoc build ... 2> build.err``: rich wraps a non-terminal console at 80 columns by default, which split
    "third-party messages ...: N lines in PATH" so grep for PATH failed; the stderr console keeps each line whole."""
    import logging

    from hycoc.quiet import third_party_output

    err = io.StringIO()  # not a terminal
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.delenv("COLUMNS", raising=False)
    c = progress.stderr_console()
    assert not c.is_terminal and c.width == 80  # rich's default width when redirected
    log = tmp_path / ("a-folder-name-long-enough-to-pass-80-columns-" * 2) / "build-toy-cpu.log"
    with third_party_output(log, console=c):
        logging.getLogger("somebody.else").warning("a third-party warning")
    progress.plain_line("calibration_answers: verifier greedy answers, decoding steps " + "x" * 80, c)
    lines = err.getvalue().splitlines()
    assert len(lines) == 2, lines
    assert lines[0].startswith("third-party messages") and lines[0].endswith(f"1 lines in {log}")
    assert lines[1].endswith("decoding steps " + "x" * 80)
