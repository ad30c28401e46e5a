"""Record every file a block of code opens (Python audit events), to prove what a command reads.

`recording()` yields a list that collects the absolute paths of ``open`` and ``os.listdir``/``os.scandir`` events
raised while the block runs (PEP 578 audit hooks: every ``open()``, ``io.open``, ``os.open`` and the
directory listings ``Path.iterdir``/``rglob`` use). `outside(paths, roots)` lists the ones under none of ``roots``.
A hook cannot be removed once added, so one hook is installed on first use and records only inside a block.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

_active: list[list[str]] = []
_installed = False
_EVENTS = {"open", "os.listdir", "os.scandir"}


def _hook(event: str, args: tuple) -> None:
    if not _active or event not in _EVENTS or not args:
        return
    path = args[0]
    if isinstance(path, int) or path is None:
        return
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    try:
        _active[-1].append(os.path.abspath(os.fspath(path)))
    except TypeError:
        return


@contextlib.contextmanager
def recording() -> Iterator[list[str]]:
    """Collect the paths opened or listed inside the block (module docstring)."""
    global _installed
    if not _installed:
        sys.addaudithook(_hook)
        _installed = True
    seen: list[str] = []
    _active.append(seen)
    try:
        yield seen
    finally:
        _active.pop()


def allowed_roots(*extra: str | Path) -> list[Path]:
    """The repository, the interpreter and its environment (stdlib, venv site-packages), the temp folder, the
    kernel's pseudo-files, the system's identity files (/etc, /usr/lib/os-release: read by platform probes of the
    libraries), and ``extra`` (for example a test's own tmp_path)."""
    repo = Path(__file__).resolve().parents[1]
    roots = {
        repo,
        Path(sys.prefix),
        Path(sys.base_prefix),
        Path(sys.exec_prefix),
        Path(tempfile.gettempdir()),
        Path("/proc"),
        Path("/sys"),
        Path("/dev"),
        Path("/etc"),
        Path("/usr/lib/os-release"),
        *(Path(x) for x in extra),
    }
    return sorted(r.resolve() for r in roots)


def outside(paths: Iterable[str], roots: Iterable[Path]) -> list[str]:
    """The paths under none of ``roots`` (resolved), sorted and without repeats."""
    roots = list(roots)
    bad = set()
    for p in paths:
        rp = Path(p).resolve()
        if not any(rp == r or r in rp.parents for r in roots):
            bad.add(str(rp))
    return sorted(bad)
