"""Output files written whole, shared by the bench's jobs (the cost model's JSON, the bench's plots): a reader never
sees a half-written file. Standard library only."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def replacing(path: Path) -> Iterator[str]:
    """Write ``path`` atomically: yields a temporary file name in ``path``'s folder (an empty file, mode 0644 like
    the bench's other outputs; mkstemp makes 0600) for the caller to write; when the block ends normally that file
    is renamed to ``path``, and on any exception (KeyboardInterrupt included) it is removed and the exception
    propagates. The folder must exist (FileNotFoundError otherwise)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        os.chmod(tmp, 0o644)
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


__all__ = ["replacing"]
