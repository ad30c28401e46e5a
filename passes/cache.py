"""The pass cache on disk: its entries with sizes and ages, and pruning by age or total size (``hycoc cache``,
the cap ``hycoc build`` enforces after a build; docs/compiler.md "The build cache").

Layout (`hycoc.passes.pipeline.Pipeline`): ``CACHE/<pass>/<key>/`` holds one pass's outputs, ``report.json`` and
``meta.json`` (written last: an entry without it is incomplete). meta.json records when the entry was made
(``created``); its mtime is when the entry was last used (the pipeline touches it on every cache hit).
``CACHE/<pass>/.tmp-*`` are the outputs of a pass that did not finish (a killed build); ``CACHE/logs`` holds the
builds' third-party logs and ``CACHE/work`` a target pass's files while it runs (neither is an entry; pruning
leaves them). Nothing here imports torch.
"""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

#: The total size `hycoc build` keeps its cache under after a build when not told otherwise (``--cache-max-size``,
#: ``HYCOC_CACHE_MAX_SIZE``): 20 GB, about two builds of recipes/gemma4.toml's graphs and binaries (assumed:
#: the real build has not run here); the build's own entries are never evicted, whatever their size.
DEFAULT_MAX_BYTES = 20 * 10**9
#: Folders of the cache that are not passes.
NOT_PASSES = ("logs", "work")

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9, "t": 10**12}
_UNITS |= {"tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


class CacheError(ValueError):
    """A size or age that does not parse, or a cache folder that is not one; the message names the value and
    the form expected."""


@dataclass(frozen=True)
class CacheEntry:
    """One cache entry. pass_name / key: its folder's names; path: the folder; bytes: its files' total size;
    created / used: POSIX times it was made and last used (meta.json's ``created`` and mtime; a ``.tmp-``
    folder's mtime for both); complete: False for a ``.tmp-`` folder or one without a meta.json."""

    pass_name: str
    key: str
    path: Path
    bytes: int
    created: float
    used: float
    complete: bool


def folder_bytes(path: Path) -> int:
    """Total size in bytes of the files under ``path`` (links not followed)."""
    total = 0
    for p in Path(path).rglob("*"):
        try:
            if p.is_file() and not p.is_symlink():
                total += p.stat().st_size
        except OSError:
            continue
    return total


def _entry(folder: Path) -> CacheEntry:
    meta = folder / "meta.json"
    complete = not folder.name.startswith(".tmp-") and meta.is_file()
    used = (meta if complete else folder).stat().st_mtime
    created = used
    if complete:
        try:
            created = float(json.loads(meta.read_text(encoding="utf-8")).get("created", used))
        except (OSError, ValueError, TypeError, AttributeError):
            pass
    return CacheEntry(folder.parent.name, folder.name, folder, folder_bytes(folder), created, used, complete)


def entries(cache_dir: str | Path) -> list[CacheEntry]:
    """Every entry of the cache at ``cache_dir``, complete or not, by pass then key ([] when there is no cache)."""
    root = Path(cache_dir)
    if not root.is_dir():
        return []
    out = []
    for pass_dir in sorted(p for p in root.iterdir() if p.is_dir() and p.name not in NOT_PASSES):
        for folder in sorted(p for p in pass_dir.iterdir() if p.is_dir()):
            try:
                out.append(_entry(folder))
            except OSError:  # removed while listed
                continue
    return out


def prune(
    cache_dir: str | Path,
    *,
    max_bytes: int | None = None,
    older_than_s: float | None = None,
    keep: Iterable[str | Path] = (),
    dry_run: bool = False,
    now: float | None = None,
) -> list[CacheEntry]:
    """Remove from the cache at ``cache_dir``: every incomplete entry (a killed build's ``.tmp-`` folder), every
    entry last used more than ``older_than_s`` seconds ago, then the least recently used entries until the total
    is at most ``max_bytes``. Entries whose path is in ``keep`` (the build that just ran) are never removed, so the
    total may stay above ``max_bytes``. The caller holds the cache's build lock (`hycoc.build_lock.build_lock`).
    Returns the entries removed (or that would be, with ``dry_run``), least recently used first."""
    now = time.time() if now is None else now
    kept = {Path(p).resolve() for p in keep}
    listed = sorted(entries(cache_dir), key=lambda e: e.used)
    removable = [e for e in listed if e.path.resolve() not in kept]
    doomed = [e for e in removable if not e.complete]
    if older_than_s is not None:
        doomed += [e for e in removable if e.complete and now - e.used > older_than_s]
    if max_bytes is not None:
        total = sum(e.bytes for e in listed) - sum(e.bytes for e in doomed)
        for e in removable:
            if total <= max_bytes:
                break
            if e not in doomed:
                doomed.append(e)
                total -= e.bytes
    doomed.sort(key=lambda e: e.used)
    if not dry_run:
        for e in doomed:
            shutil.rmtree(e.path, ignore_errors=True)
            if e.path.parent.is_dir() and not any(e.path.parent.iterdir()):
                e.path.parent.rmdir()
    return doomed


def parse_size(text: str) -> int:
    """Bytes of a size written ``20GB``, ``500MB``, ``1.5GiB``, ``123`` (decimal units, ``KiB`` ... binary);
    ``0`` keeps nothing but the running build's entries. Raises CacheError for another form."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise CacheError(f"size {text!r}: write a number with an optional unit, e.g. 20GB, 500MB, 1.5GiB")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_age(text: str) -> float:
    """Seconds of an age written ``30d``, ``12h``, ``90m``, ``45s``, ``2w``. Raises CacheError for another form."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([smhdw])\s*", str(text))
    if m is None:
        raise CacheError(f"age {text!r}: write a number and a unit (s, m, h, d, w), e.g. 30d, 12h")
    return float(m.group(1)) * _AGE_UNITS[m.group(2)]


def format_size(n: int) -> str:
    """``n`` bytes as ``12.3 MB`` (decimal units)."""
    for unit, size in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def format_age(seconds: float) -> str:
    """An age as ``3 d``, ``5 h``, ``12 min`` or ``40 s``."""
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.0f} {unit}"
    return f"{max(0.0, seconds):.0f} s"


__all__ = [
    "DEFAULT_MAX_BYTES",
    "CacheEntry",
    "CacheError",
    "entries",
    "folder_bytes",
    "format_age",
    "format_size",
    "parse_age",
    "parse_size",
    "prune",
]
