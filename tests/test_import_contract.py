"""The order of dependencies holds (docs/design.md "Layout"; pyproject ``[tool.importlinter]``).

Two checks over every module of the five source folders (``hycoc/``, ``passes/``, ``targets/``, ``runtime/``,
``verifier/``), imports inside functions included:

- the layer contract, by import-linter (https://import-linter.readthedocs.io, the ``layers`` and ``forbidden``
  contract types): applications -> compiler -> verifier | device runtime -> targets -> model helpers -> core, and
  the device runtime imports no torch, transformers, compiler or verifier, directly or through another module;
- no import of a private name (``_x``, or a module ``_x``) across packages, by an ``ast`` walk: a package here is
  ``hycoc.<sub>`` for each subpackage (``cli``, ``bench``, ``protocol``, ``recipe``, ``toy``, ``passes``,
  ``targets``, ``runtime``, ``verifier``) and ``hycoc`` itself for the top-level modules.

The four other folders install as subpackages of ``hycoc`` (pyproject ``[tool.setuptools] package-dir``), which
import-linter's graph builder (grimp) cannot follow, so the check runs on a copy of the sources laid out as
installed. Each check is also run on a copy with one import broken by hand, so it is seen to fail.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from paths import ROOT

PYPROJECT = ROOT / "pyproject.toml"


def config() -> dict:
    return tomllib.loads(PYPROJECT.read_text(encoding="utf-8"))


def package_dirs() -> dict[str, Path]:
    """Installed package name -> its source folder, from pyproject's ``package-dir`` (top-level mappings only)."""
    mapping = config()["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in mapping.items() if name.count(".") <= 1}


def stage(dest: Path) -> Path:
    """Copy the sources (``.py`` files) into ``dest`` as they install: ``dest/hycoc/passes/...``. Returns ``dest``."""
    for name, folder in package_dirs().items():
        target = dest.joinpath(*name.split("."))
        shutil.copytree(folder, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    return dest


def lint_imports(staged: Path) -> subprocess.CompletedProcess:
    """import-linter over the staged copy with the repository's contracts (run in ``staged``, so that ``hycoc``
    imports from there, not from the editable install)."""
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(sys.argv[1], no_cache=True))"
    return subprocess.run(
        [sys.executable, "-c", code, str(PYPROJECT)], cwd=staged, capture_output=True, text=True, timeout=120
    )


def module_files(staged: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the staged ``hycoc`` package."""
    out = {}
    for path in sorted((staged / "hycoc").rglob("*.py")):
        parts = list(path.relative_to(staged).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def package_of(module: str, packages: set[str]) -> str:
    """``hycoc.<sub>`` when ``module`` lies in a subpackage of hycoc, else ``hycoc``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) >= 2 and ".".join(parts[:2]) in packages else "hycoc"


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_imports(files: dict[str, Path]) -> list[str]:
    """``importer:line imports module.name`` for each import of a private name or module across packages."""
    packages = {m for m, p in files.items() if p.name == "__init__.py" and m.count(".") == 1}
    found = []
    for module, path in files.items():
        here = package_of(module, packages)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names = [f"{target}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for full in names:
                if not full.startswith("hycoc.") or package_of(full, packages) == here:
                    continue
                inside = full.split(".")[len(package_of(full, packages).split(".")) :]
                if any(private(part) for part in inside):
                    found.append(f"{module}:{node.lineno} imports {full}")
    return found


@pytest.fixture(scope="module")
def staged(tmp_path_factory) -> Path:
    return stage(tmp_path_factory.mktemp("installed"))


def test_every_module_belongs_to_a_layer(staged):
    contract = next(c for c in config()["tool"]["importlinter"]["contracts"] if c["type"] == "layers")
    named = {m.strip() for layer in contract["layers"] for m in layer.replace("|", ":").split(":")}
    orphans = [
        m for m in module_files(staged) if m != "hycoc" and not any(m == n or m.startswith(n + ".") for n in named)
    ]
    assert not orphans, f"no layer of pyproject [tool.importlinter] names {orphans}: add each to one"


def test_imports_follow_the_layers(staged):
    pytest.importorskip("importlinter", reason="the dev extra (pip install -e '.[dev]') installs import-linter")
    result = lint_imports(staged)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_the_layer_check_fails_on_one_import_against_the_order(tmp_path):
    pytest.importorskip("importlinter", reason="the dev extra (pip install -e '.[dev]') installs import-linter")
    staged = stage(tmp_path)
    graphs = staged / "hycoc" / "runtime" / "graphs.py"
    graphs.write_text(graphs.read_text(encoding="utf-8") + "\nfrom hycoc.passes.qdq import quantize  # noqa\n")
    transport = staged / "hycoc" / "runtime" / "transport.py"  # torch at one remove: hycoc.mtp imports it
    transport.write_text(transport.read_text(encoding="utf-8") + "\nfrom hycoc.mtp import FULL  # noqa\n")
    result = lint_imports(staged)
    assert result.returncode != 0
    assert "hycoc.runtime.graphs -> hycoc.passes.qdq.quantize" in result.stdout  # the layers
    assert "hycoc.runtime is not allowed to import torch" in result.stdout  # the device runtime's contract
    assert "hycoc.runtime.transport -> hycoc.mtp" in result.stdout


def test_no_private_name_is_imported_across_packages(staged):
    found = private_imports(module_files(staged))
    assert not found, "private names imported across packages (make the name public where it lives):\n" + "\n".join(
        found
    )


def test_the_private_name_check_finds_one_added_by_hand(tmp_path):
    staged = stage(tmp_path)
    client = staged / "hycoc" / "runtime" / "client.py"
    client.write_text(client.read_text(encoding="utf-8") + "\nfrom ..cli._common import _fail  # noqa\n")
    found = private_imports(module_files(staged))
    assert len(found) == 1 and found[0].startswith("hycoc.runtime.client:"), found
    assert found[0].endswith(" imports hycoc.cli._common._fail")
