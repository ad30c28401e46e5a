"""The suite says what it costs: pyproject registers the markers slow, qnn, hub and serve, and a run ends with what
did not run, by marker and reason (tests/conftest.py `pytest_terminal_summary`)."""

from __future__ import annotations

import tomllib

from paths import ROOT

pytest_plugins = ["pytester"]


def test_pyproject_registers_the_cost_markers():
    from conftest import COST_MARKERS

    options = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert [m.split(":")[0] for m in options["markers"]] == list(COST_MARKERS)
    assert "--strict-markers" in options["addopts"]


def test_a_run_ends_with_the_skips_by_marker_and_reason(pytester):
    pytester.makeconftest((ROOT / "tests" / "conftest.py").read_text())
    pytester.makeini("[pytest]\nmarkers =\n    slow: s\n    qnn: q\n    hub: h\n    serve: v\n")
    pytester.makepyfile(
        test_a="""
        import pytest

        @pytest.mark.qnn
        @pytest.mark.skipif(True, reason="no qnn here")
        def test_one(): pass

        @pytest.mark.qnn
        @pytest.mark.skipif(True, reason="no qnn here")
        def test_two(): pass

        @pytest.mark.slow
        def test_slow(): pass

        def test_plain(): pytest.skip("not today")
        """
    )
    pytester.makepyfile(
        test_b="""
        import pytest
        pytest.importorskip("no_such_module_here", reason="install the x extra")
        """
    )
    result = pytester.runpytest("-m", "not slow", "-p", "no:cacheprovider")
    result.assert_outcomes(skipped=4, deselected=1)
    result.stdout.re_match_lines(
        [
            r".*not run.*",
            r"4 skipped .*",
            r"\s+2\s+\[qnn\] no qnn here",
            r"\s+1\s+\[.*\] .*",
            r"\s+1\s+\[.*\] .*",
            r"1 deselected: 1 slow",
        ]
    )
    assert "[module] install the x extra" in result.stdout.str() and "[-] not today" in result.stdout.str()
