"""mypy over hycoc as it installs (pyproject [tool.mypy] says what and how strictly).

The installed package maps folders by pyproject's [tool.setuptools].package-dir (``hycoc.runtime`` is ``runtime/``,
``hycoc.verifier`` is ``verifier/``, ...), which mypy cannot follow: run on the repository, it would check
``runtime/client.py`` as a module ``runtime.client`` and not find ``hycoc.runtime.client`` behind the editable
install's import hook. So this builds that layout as a tree of symlinks in a temporary folder, read from
package-dir (no second copy of the mapping), and runs mypy there with the repository's pyproject and cache.
Paths in its messages are the package's (``hycoc/runtime/client.py`` is ``runtime/client.py``).

Usage: ``python .ci/typecheck.py [mypy arguments]``; exits with mypy's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_tree(dest: Path) -> None:
    """Symlink each package of package-dir at its dotted name's path under ``dest`` (nested packages that live inside
    their parent's folder come with it)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["package-dir"]
    for name in sorted(mapping, key=lambda n: n.count(".")):
        target = dest.joinpath(*name.split("."))
        if target.exists():  # inside a parent that is already linked (hycoc.passes.rewrite in passes/)
            continue
        source = ROOT / mapping[name]
        if "." not in name:  # the top package: a real folder, so its subpackages from elsewhere can sit beside
            target.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(source, target_is_directory=True)


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="hycoc-mypy-") as tmp:
        package_tree(Path(tmp))
        cmd = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml")]
        cmd += ["--cache-dir", str(ROOT / ".mypy_cache"), *argv]
        return subprocess.run(cmd, cwd=tmp, env={**os.environ, "MYPYPATH": ""}).returncode


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
