"""Shared fixtures: the tiny recipe of tests/test_build.py built once per test session into a cpu bundle; and the
run's closing summary of what did not run (skipped tests by marker and reason, deselected tests by marker)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from collections import Counter
from types import SimpleNamespace

import pytest


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS's pick for port 0, `hycoc.ports.check_port`): tests never name a fixed
    port, so a verify-server on the README's 8765 (or another suite) cannot break them."""
    from hycoc.ports import check_port

    return check_port(host, 0)


def modules_loaded_by_import(module: str, watched) -> list[str]:
    """The names of ``watched`` (module names) in ``sys.modules`` after ``import module`` in a fresh interpreter,
    sorted: what importing it loads, whatever this test process imported before."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(m for m in {tuple(watched)!r} if m in sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.splitlines()[-1])


_FRESH_CLI = """
import json, sys
from typer.testing import CliRunner
from hycoc.cli import app
command, cases, watched = json.loads(sys.argv[1])
out = [CliRunner().invoke(app, [command, *args]) for args in cases]
print(json.dumps({"results": [(r.exit_code, r.stderr) for r in out],
                  "loaded": sorted(m for m in watched if m in sys.modules)}))
"""


def cli_in_fresh_interpreter(command: str, cases: list[list[str]], watched) -> tuple[list[list], list[str]]:
    """``hycoc COMMAND *case`` for each case, through typer's CliRunner in one fresh interpreter (so "not imported"
    is what the commands did): ([exit code, stderr] per case, the names of ``watched`` loaded after the last)."""
    arg = json.dumps([command, cases, list(watched)])
    done = subprocess.run([sys.executable, "-c", _FRESH_CLI, arg], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    return got["results"], got["loaded"]


#: The markers pyproject.toml registers for what a test costs or needs.
COST_MARKERS = ("slow", "qnn", "hub", "serve")


def _skip_reason(report) -> str:
    """The reason of a skip report (a test's or a module's at import), without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def not_run_lines(skipped, deselected) -> list[str]:
    """The closing summary's lines: skipped reports grouped by (cost markers, reason), most first, and deselected
    items counted by cost marker. A module skipped at import (pytest.importorskip) counts once."""
    lines = []
    if skipped:
        groups = Counter()
        for rep in skipped:
            if isinstance(rep, pytest.CollectReport):  # the module skipped at import: its marks unread
                label = "module"
            else:
                label = ",".join(m for m in COST_MARKERS if m in rep.keywords) or "-"
            groups[(label, _skip_reason(rep))] += 1
        lines.append(f"{len(skipped)} skipped (a module skipped at import counts once):")
        lines += [f"  {n:4d}  [{marks}] {reason}" for (marks, reason), n in groups.most_common()]
    if deselected:
        marks = Counter(m for item in deselected for m in COST_MARKERS if item.get_closest_marker(m) is not None)
        lines.append(
            f"{len(deselected)} deselected: "
            + (", ".join(f"{marks[m]} {m}" for m in COST_MARKERS if marks[m]) or "by -k or -m")
        )
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """After every run: what did not run and why (pytest's own -rs lists each skip; this counts them)."""
    lines = not_run_lines(terminalreporter.stats.get("skipped", []), terminalreporter.stats.get("deselected", []))
    if lines:
        terminalreporter.section("not run", sep="-")
        for line in lines:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    """The tiny recipe's whole pipeline (target_cpu last) run twice on one cache, once per test session:
    SimpleNamespace(recipe, path (recipe.toml), root, cache, first, second), first and second the two
    `PipelineResult`s (first: every pass ran; second: all cache hits). Built once, shared by tests/test_build.py
    and `tiny_bundle` (each full build of the tiny recipe costs ~30 s of the suite)."""
    from hycoc.passes import build as b
    from rich.console import Console
    from test_build import write_tiny_recipe

    from hycoc.recipe import load_recipe

    root = tmp_path_factory.mktemp("tiny_bundle")
    path = write_tiny_recipe(root)
    recipe = load_recipe(path)
    first = b.run_pipeline(recipe, "cpu", root / "cache", b.BuildSettings(console=Console(file=io.StringIO())))
    second = b.run_pipeline(recipe, "cpu", root / "cache", b.BuildSettings(console=Console(file=io.StringIO())))
    return SimpleNamespace(recipe=recipe, path=path, root=root, cache=root / "cache", first=first, second=second)


@pytest.fixture(scope="session")
def tiny_bundle(tiny_pipeline):
    """SimpleNamespace(recipe, path (recipe.toml), root, bundle (cpu bundle folder), cache (pipeline cache)): the
    bundle written from `tiny_pipeline`'s cache (every pass a cache hit)."""
    from hycoc.passes import build as b
    from rich.console import Console

    p = tiny_pipeline
    b.build_bundle(p.recipe, "cpu", p.root / "bundle", p.cache, b.BuildSettings(console=Console(file=io.StringIO())))
    return SimpleNamespace(recipe=p.recipe, path=p.path, root=p.root, bundle=p.root / "bundle", cache=p.cache)
