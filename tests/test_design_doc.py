"""docs/design.md names real code, and every docs page the code or the docs point to exists.

docs/design.md writes code references as ``path.py:name`` (a module-level function, class or constant) or
``path.py:Class.method``, paths relative to the repository root; its "Where each paper line lives" tables map the
paper's Algorithms 1-4 and Tables 3-5 onto them, so a rename that is not carried into the document fails here.
Parsing only (``ast``), no imports: well under a second.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

import pytest
from paths import ROOT

DESIGN = ROOT / "docs" / "design.md"
REF = re.compile(r"`?((?:[A-Za-z_][\w]*/)+[A-Za-z_]\w*\.py):([A-Za-z_][\w]*(?:\.[A-Za-z_][\w]*)?)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
DOCS_PATH = re.compile(r"(?<![\w/.-])docs/[\w.-]+\.md")  # hycoc's own pages, not a library's docs/a/b.md
SOURCES = ("hycoc", "passes", "runtime", "verifier", "targets", "benchmarks", "tests")


@cache
def names_in(path: Path) -> dict[str, set[str]]:
    """Top-level names of a module -> the names defined in their bodies (methods and attributes of a class)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out[node.name] = set()
        elif isinstance(node, ast.ClassDef):
            members = {n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            members |= {
                n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
            }
            out[node.name] = members
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            out.update({t.id: set() for t in targets if isinstance(t, ast.Name)})
    return out


def design_refs() -> list[tuple[str, str]]:
    return sorted(set(REF.findall(DESIGN.read_text(encoding="utf-8"))))


def test_design_doc_names_many_functions():
    refs = design_refs()
    assert len(refs) >= 100, len(refs)  # the paper-line tables alone name ~100
    text = DESIGN.read_text(encoding="utf-8")
    for heading in (
        "### Algorithm 1",
        "### Algorithm 2",
        "### Algorithm 3",
        "### Algorithm 4",
        "### Table 3",
        "### Table 4",
        "### Table 5",
        "## Wire protocol",
        "## Bundle",
        "## Reference shapes",
        "## The pass pipeline",
        "## Targets",
        "## Limits",
    ):
        assert heading in text, heading


@pytest.mark.parametrize("path,name", design_refs())
def test_every_code_reference_in_design_doc_exists(path, name):
    file = ROOT / path
    assert file.is_file(), f"docs/design.md names {path}, which does not exist"
    top, _, member = name.partition(".")
    defined = names_in(file)
    assert top in defined, f"docs/design.md names {path}:{name}, but {path} defines no {top}"
    if member:
        assert member in defined[top], f"docs/design.md names {path}:{name}, but {top} has no {member}"


def test_every_local_link_in_readme_and_docs_exists():
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in LINK.findall(page.read_text(encoding="utf-8")):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert missing == []


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, every character but letters, digits, ``_``, ``-`` and
    spaces dropped, spaces as ``-`` (github/cmark-gfm's anchor filter; a repeated slug gets ``-1``, ``-2``)."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page's headings make (outside code blocks), repeats numbered as GitHub numbers them."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            s = slug(line.lstrip("#"))
            out.add(f"{s}-{seen[s]}" if s in seen else s)
            seen[s] = seen.get(s, 0) + 1
    return out


def dangling_anchors(page: Path) -> list[str]:
    """The ``[text](page.md#anchor)`` / ``[text](#anchor)`` links of ``page`` whose anchor is no heading there."""
    missing = []
    for target in re.findall(r"\]\(([^)\s]*#[^)\s]*)\)", page.read_text(encoding="utf-8")):
        if "://" in target:
            continue
        name, _, anchor = target.partition("#")
        linked = (page.parent / name) if name else page
        if linked.is_file() and anchor not in anchors(linked):
            missing.append(f"{page.name} -> {target}")
    return missing


def test_every_local_link_anchor_is_a_heading_of_its_page(tmp_path):
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    assert sum(len(re.findall(r"\]\([^)\s]*#", p.read_text(encoding="utf-8"))) for p in pages) >= 20
    assert [m for p in pages for m in dangling_anchors(p)] == []
    # negative control: a link to a heading that is not there, and one to a heading that is
    (tmp_path / "a.md").write_text("# A page\n\n## Choosing ε: `x`\n\n[ok](#choosing-ε-x) [bad](#choosing-epsilon)\n")
    assert dangling_anchors(tmp_path / "a.md") == ["a.md -> #choosing-epsilon"]


CITED = re.compile(r'(?<![\w/.-])(docs/[\w.-]+\.md),? "([^"]+)"')


def headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text(encoding="utf-8").splitlines() if line.startswith("#")]


def test_every_docs_section_cited_in_code_is_a_heading_of_its_page():
    """A `docs/<page>.md "Section"` in a docstring or comment names a heading of that page (its start: headings carry
    their command, "Choosing ε: `hycoc tune-epsilon`"); a quote wrapped over lines is joined first."""
    missing, cited = [], 0
    for f in [f for d in SOURCES for f in sorted((ROOT / d).rglob("*.py"))] + [ROOT / "recipes" / "toy.toml"]:
        text = re.sub(r"\n\s*(?:#:?\s*)?", " ", f.read_text(encoding="utf-8"))
        for page, section in CITED.findall(text):
            if not (ROOT / page).is_file():
                continue  # the test below names the missing page
            cited += 1
            if not any(h.startswith(section) for h in headings(ROOT / page)):
                missing.append(f'{f.relative_to(ROOT)}: {page} "{section}"')
    assert missing == []
    assert cited >= 40, cited


def test_every_docs_page_named_in_code_or_readme_exists():
    missing = []
    files = [ROOT / "README.md"] + [f for d in SOURCES for f in sorted((ROOT / d).rglob("*.py"))]
    for f in files:
        for name in DOCS_PATH.findall(f.read_text(encoding="utf-8")):
            if not (ROOT / name).is_file():
                missing.append(f"{f.relative_to(ROOT)} -> {name}")
    assert missing == []
