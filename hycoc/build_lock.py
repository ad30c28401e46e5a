"""One `hycoc build` at a time per build cache and per bundle folder, and what an interrupted build kept.

A second build into the same cache or bundle folder while one runs would redo the same passes beside it and race
it for the bundle's rename; it is refused at once with the folder and the fix. The locks are advisory file locks
(`filelock.FileLock`, flock(2) on POSIX: the kernel drops them when the holder exits, killed or not) on
``CACHE/.hycoc-build.lock`` and ``.<bundle>.hycoc-build.lock`` beside the bundle folder.

An interrupted build (Ctrl-C) keeps every pass that finished: the pipeline renames a pass's cache entry into place
only when complete (`hycoc.passes.pipeline`), so the next build of the same recipe reuses them; `interrupted_note`
says how many, where, and that the bundle folder is left as it was. No torch: importing it costs nothing.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

LOCK_NAME = ".hycoc-build.lock"


class BuildLocked(RuntimeError):
    """Another `hycoc build` holds the cache or the bundle folder this build would write."""


def _lock_paths(cache_dir: Path, out_dir: Path | None) -> list[tuple[str, Path, Path]]:
    """(what, folder, lock file) for the cache and, when given, the bundle folder."""
    paths = [("build cache", cache_dir, cache_dir / LOCK_NAME)]
    if out_dir is not None:
        paths.append(("bundle folder", out_dir, out_dir.parent / f".{out_dir.name}{LOCK_NAME}"))
    return paths


@contextmanager
def build_lock(cache_dir: str | Path, out_dir: str | Path | None = None) -> Iterator[None]:
    """Hold the build locks of ``cache_dir`` and ``out_dir`` (None: a ``--until`` build that writes no bundle)
    for the ``with`` block, creating the folders the lock files live in. Raises BuildLocked at once (no waiting)
    when another build holds one, naming the folder, the lock file and the fix."""
    from filelock import FileLock, Timeout

    with ExitStack() as stack:
        for what, folder, lock_file in _lock_paths(Path(cache_dir), None if out_dir is None else Path(out_dir)):
            lock_file.parent.mkdir(parents=True, exist_ok=True)
            lock = FileLock(lock_file, timeout=0, is_singleton=False)
            try:
                stack.enter_context(lock)
            except Timeout:
                option = "--cache-dir" if what == "build cache" else "--out"
                raise BuildLocked(f"the {what} {folder} is in use by another hycoc build (lock {lock_file}): "
                                  f"wait for it to finish, or give this build another {option}") from None
        yield


def complete_entries(cache_dir: str | Path, since: float = 0.0) -> int:
    """Complete pass entries (``CACHE/<pass>/<key>/meta.json``, `hycoc.passes.pipeline`) written at or after
    ``since`` (seconds since the epoch; 0: all of them)."""
    return sum(1 for meta in Path(cache_dir).glob("*/*/meta.json") if meta.stat().st_mtime >= since)


def interrupted_note(cache_dir: str | Path, out_dir: str | Path | None, started: float) -> str:
    """What an interrupted build kept, in one line: the passes it finished (cache entries since ``started``,
    `time.time()` at its start), the cache's total, and that the bundle folder is left as it was."""
    done, total = complete_entries(cache_dir, started), complete_entries(cache_dir)
    bundle = "" if out_dir is None else f"; the bundle folder {out_dir} is left as it was"
    return (f"interrupted: {done} pass{'es' if done != 1 else ''} finished in this build and {total} in all are kept "
            f"in {cache_dir}; rerun the same command and they are reused{bundle}")


__all__ = ["BuildLocked", "LOCK_NAME", "build_lock", "complete_entries", "interrupted_note"]
