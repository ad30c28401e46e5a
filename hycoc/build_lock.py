"""One `hycoc build` at a time per build cache and per bundle folder, and what an interrupted build kept.

A second build into the same cache or bundle folder while one runs would redo the same passes beside it and race
it for the bundle's rename; it is refused at once with the folder and the fix. The locks are advisory file locks
(`filelock.FileLock`, flock(2) on POSIX: the kernel drops them when the holder exits, killed or not), one per
folder, named by the hash of the folder's resolved path in a per-user folder of the system's temporary directory
(`lock_file`): a build that fails at once leaves nothing in the user's folders, and no lock file is ever deleted
(deleting one another process has opened would let two builds hold "the" lock).

An interrupted build (Ctrl-C) keeps every pass that finished: the pipeline renames a pass's cache entry into place
only when complete (`hycoc.passes.pipeline`), so the next build of the same recipe reuses them; `interrupted_note`
says how many, where, and that the bundle folder is left as it was. No torch: importing it costs nothing.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path


class BuildLocked(RuntimeError):
    """Another `hycoc build` holds the cache or the bundle folder this build would write."""


def lock_file(folder: str | Path) -> Path:
    """The lock file of ``folder``: ``<tmp>/hycoc-build-locks-<uid>/<sha256 of its resolved path>[:16].lock``, the
    same for every spelling of the folder (relative, through a symlink)."""
    key = hashlib.sha256(str(Path(folder).resolve()).encode()).hexdigest()[:16]
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"hycoc-build-locks-{uid}" / f"{key}.lock"


@contextmanager
def build_lock(cache_dir: str | Path, out_dir: str | Path | None = None) -> Iterator[None]:
    """Hold the build locks (`lock_file`) of ``cache_dir`` and ``out_dir`` (None: a ``--until`` build that writes
    no bundle) for the ``with`` block. Raises BuildLocked at once (no waiting) when another build holds one,
    naming the folder and the fix."""
    from filelock import FileLock, Timeout

    folders = [("build cache", "--cache-dir", Path(cache_dir))]
    if out_dir is not None:
        folders.append(("bundle folder", "--out", Path(out_dir)))
    with ExitStack() as stack:
        for what, option, folder in folders:
            path = lock_file(folder)
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            try:
                stack.enter_context(FileLock(path, timeout=0, is_singleton=False))
            except Timeout:
                raise BuildLocked(
                    f"the {what} {folder} is in use by another hycoc build: wait for it to finish, "
                    f"or give this build another {option}"
                ) from None
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
    return (
        f"interrupted: {done} pass{'es' if done != 1 else ''} finished in this build and {total} in all are kept "
        f"in {cache_dir}; rerun the same command and they are reused{bundle}"
    )


__all__ = ["BuildLocked", "build_lock", "complete_entries", "interrupted_note", "lock_file"]
