"""The docs list what the code's own registries hold, so a pass, a target or a probed arch cannot drift away from
them (the pattern of tests/test_docs_commands.py: the reference is the code, never a list written here).

* docs/compiler.md's pass table and the README's pass count: the passes `hycoc.passes.build.build_pipeline` lays
  out for recipes/toy.toml (the quick start's build); docs/design.md's pass table: the same, plus the sharded
  pipeline's pass, each with the class the pipeline runs;
* every ``--target a|b|...`` list in the README and docs/commands.md: `hycoc.passes.target_step.TARGETS` (what ``hycoc
  build --target`` accepts); docs/compiler.md's HTP list and every ``htp-vNN`` any page names:
  `hycoc.targets.profiles.HTP_TARGETS`;
* ``hycoc doctor``'s "HTP targets" row: only the HTP targets of the registry, whatever archs the QNN probe tries
  (`hycoc.targets.qnn_ep.PROBE_ARCHS`);
* the README defines MAT, g and ε where it first uses them.
"""

from __future__ import annotations

import re
import tempfile
from functools import cache

import pytest
from hycoc.passes.build import TARGETS, build_pipeline
from hycoc.targets.profiles import HTP_TARGETS
from hycoc.targets.qnn_ep import PROBE_ARCHS
from paths import ROOT

from hycoc.recipe import load_recipe

README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]


@cache
def pipeline(shards: int = 1) -> list:
    """The passes of `hycoc build recipes/toy.toml --target cpu` (``shards`` != 1: ``[target] slm_shards``)."""
    recipe = load_recipe(ROOT / "recipes" / "toy.toml")
    if shards != 1:
        recipe = recipe.model_copy(update={"target": recipe.target.model_copy(update={"slm_shards": shards})})
    with tempfile.TemporaryDirectory() as cache:  # laying the passes out runs nothing and writes nothing
        return list(build_pipeline(recipe, "cpu", cache_dir=cache).passes)


def table_after(text: str, header: str) -> list[list[str]]:
    """The rows (cells stripped of spaces, backticks and bold) of the Markdown table whose header row starts with
    ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2 :]:
        if not line.startswith("|"):
            break
        rows.append([c.strip().strip("`*").strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]])
    return rows


def target_lists(text: str) -> list[list[str]]:
    """Every ``--target a|b|c`` alternation a page writes (``\\|`` inside a table cell)."""
    return [re.split(r"\\?\|", m) for m in re.findall(r"--target ((?:[a-z0-9-]+\\?\|)+[a-z0-9-]+)", text)]


# ---- passes ------------------------------------------------------------------------------------------------------


def test_compiler_pass_table_lists_every_pass_of_the_pipeline_in_order():
    rows = table_after((DOCS / "compiler.md").read_text(encoding="utf-8"), "| pass | wall / CPU |")
    documented = [r[0] for r in rows if r[0] != "total"]
    assert documented == [p.name for p in pipeline()]


def test_readme_pass_count_is_the_pipelines():
    counts = re.findall(r"\((\d+) passes", README.read_text(encoding="utf-8"))
    assert counts and {int(c) for c in counts} == {len(pipeline())}


def test_design_pass_table_names_every_pass_and_its_class():
    rows = table_after((DOCS / "design.md").read_text(encoding="utf-8"), "| pass | module | does |")
    documented = {r[0].split()[0].strip("`"): r[1] for r in rows}  # "slm_shards (instead of ...)" -> slm_shards
    expected = {}
    for p in [*pipeline(), *pipeline(2)]:
        name = "target_<name>" if p.name.startswith("target_") else p.name
        expected[name] = type(p).__name__
    assert sorted(documented) == sorted(expected)
    wrong = [f"{n}: {documented[n]} vs {cls}" for n, cls in expected.items() if not documented[n].endswith(f":{cls}")]
    assert wrong == []


# ---- targets -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", [README, DOCS / "commands.md"], ids=lambda p: p.name)
def test_every_target_list_is_the_build_commands(page):
    lists = target_lists(page.read_text(encoding="utf-8"))
    assert lists, f"{page.name} writes no --target list"
    assert [sorted(x) for x in lists] == [sorted(TARGETS)] * len(lists)


def test_compiler_md_lists_every_htp_profile():
    text = (DOCS / "compiler.md").read_text(encoding="utf-8")
    sentence = re.search(r"`--target` takes every HTP profile[^)]*\)", text)  # up to the list's closing ")"
    assert sentence is not None
    assert re.findall(r"htp-v\d+", sentence.group(0)) == list(HTP_TARGETS)


def test_every_htp_target_a_page_names_exists():
    named = {(p.name, t) for p in PAGES for t in re.findall(r"htp-v\d+", p.read_text(encoding="utf-8"))}
    assert sorted((page, t) for page, t in named if t not in HTP_TARGETS) == []


def test_the_target_list_checks_find_a_missing_and_an_unknown_target():
    """Negative control: a list without htp-v68 and with htp-v69 is caught by both checks above."""
    text = "| `hycoc build RECIPE --target htp-v81\\|htp-v79\\|htp-v69\\|htp-v73\\|cpu\\|qai-hub` | x |"
    (found,) = target_lists(text)
    assert sorted(found) != sorted(TARGETS)
    assert set(found) - set(TARGETS) == {"htp-v69"} and set(TARGETS) - set(found) == {"htp-v75", "htp-v68"}


# ---- hycoc doctor ------------------------------------------------------------------------------------------------


def test_doctor_names_only_registered_htp_targets_whatever_the_probe_tries():
    from hycoc.runtime.device_identity import DeviceIdentity

    from hycoc.doctor import doctor_rows, htp_targets

    every = {"loads": True, "versions": {}, "archs": {a: {"ok": True} for a in PROBE_ARCHS}}
    every["compilable_archs"] = sorted(PROBE_ARCHS)
    assert htp_targets(every) == (list(HTP_TARGETS), [])
    laptop = DeviceIdentity("linux", "x86_64", "x86_64", None, None, None, "none")
    (row,) = [r for r in doctor_rows(every, versions={}, device=laptop) if r[0] == "HTP targets"]
    named = re.findall(r"htp-v\d+", row[1])
    assert sorted(named) == sorted(HTP_TARGETS) and row[2] == ""  # each registered target once, nothing else
    unregistered = sorted(set(PROBE_ARCHS) - {int(t.removeprefix("htp-v")) for t in HTP_TARGETS})
    assert unregistered, "every probed arch has a target: this test no longer checks what it was written for"
    none = {"loads": True, "versions": {}, "archs": {a: {"ok": a in unregistered} for a in PROBE_ARCHS}}
    none["compilable_archs"] = unregistered
    assert htp_targets(none) == ([], list(HTP_TARGETS))


# ---- the README's symbols ----------------------------------------------------------------------------------------

#: symbol -> a pattern for its use in prose ("Δg" uses g; "e.g." does not).
SYMBOLS = {"MAT": r"\bMAT\b", "g": r"(?<![\w.])Δ?g(?![\w.])", "ε": r"ε"}


@pytest.mark.parametrize("symbol", SYMBOLS)
def test_readme_defines_each_symbol_where_it_first_uses_it(symbol):
    text = README.read_text(encoding="utf-8")
    definition = text.find(f"**{symbol}** ")
    assert definition >= 0, f"the README never defines {symbol} (as **{symbol}** ...)"
    first = re.search(SYMBOLS[symbol], text)
    assert first is not None and first.start() == definition + 2, (
        f"the README uses {symbol} before it defines it: {text[max(0, first.start() - 60) : first.start() + 20]!r}"
    )
