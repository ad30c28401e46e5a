"""`hycoc inspect RECIPE`'s tables (hycoc/inspect_report.py): they fit the console (80 columns and up; COLUMNS when
redirected, 120 by default) with every name and number whole."""

from __future__ import annotations

import io

import pytest
from paths import GEMMA4
from rich.console import Console


@pytest.fixture(scope="module")
def plan():
    from hycoc.inspect_report import recipe_report
    from hycoc.recipe import load_recipe

    return recipe_report(load_recipe(GEMMA4))


def rendered(plan, width: int) -> str:
    from hycoc.inspect_report import render_recipe_report

    console = Console(width=width, file=io.StringIO())
    render_recipe_report(plan, console)
    return console.file.getvalue()


@pytest.mark.parametrize("width", [80, 120])
def test_the_recipe_plan_fits_the_console_with_names_and_numbers_whole(plan, width):
    out = rendered(plan, width)
    lines = out.splitlines()
    assert max(map(len, lines)) <= width and "…" not in out
    cells = {c.strip() for line in lines for c in line.split("│")}  # every table cell's text on one line
    for g in plan["graphs"].values():
        for s in g["inputs"] + g["outputs"]:
            assert s["name"] in cells and "x".join(map(str, s["shape"])) in cells, s
    for key in (
        "handoff_bytes_per_round",
        "handoff_bytes_per_position",
        "first_handoff_bytes",
        "first_reply_bytes",
        "tree_bytes_per_round",
    ):
        assert key in cells and f"{plan['handoff'][key]:,}" in cells
    for role, m in plan["models"].items():
        assert role in cells and f"{m['params']:,}" in cells
    for p in plan["paper"].values():
        assert f"{p['plan']:,}" in cells and f"{p['diff_pct']:+.2f}" in cells
    for name, v in plan["device_time_estimate"]["graphs"].items():
        assert name in cells and f"{v['estimate_ms']:.2f}" in cells
    for a in plan["device_time_estimate"]["anchors"]:
        assert f"{a['residual_pct']:+.1f}" in cells and f"{a['figure_ms']:.1f}" in cells


def test_a_table_too_wide_for_80_columns_is_split_with_its_key_column_in_every_part(plan):
    out = rendered(plan, 80)
    assert "plan vs paper (1/2)" in out and "plan vs paper (2/2)" in out
    at120 = rendered(plan, 120)
    assert "plan vs paper (1/" not in at120 and "plan vs paper" in at120
    second = out[out.index("plan vs paper (2/2)") :]
    assert all(k in second for k in plan["paper"])  # the quantity names lead the second part too


@pytest.mark.parametrize("environ, width", [({}, 120), ({"COLUMNS": "97"}, 97), ({"COLUMNS": "60"}, 80)])
def test_redirected_inspect_lays_out_at_COLUMNS_else_120(monkeypatch, environ, width):
    """stdout is not a terminal under pytest: the bench tables' rule (`hycoc.bench.tables.console_width`)."""
    from hycoc.inspect_tables import inspect_console

    monkeypatch.delenv("COLUMNS", raising=False)
    for k, v in environ.items():
        monkeypatch.setenv(k, v)
    assert inspect_console().width == width
