"""Giving the C allocator's free memory back to the OS, periodically (docs/serving.md "Soak and fuzz").

Under a protocol fuzzer (thousands of short connections, sessions opened and closed, frames of every size up to the
incoming bound) the server's Python heap stays flat (tracemalloc across phases: < 0.1 MB), but glibc's malloc keeps
the pages that freed tensors and frame buffers leave inside its heaps and arenas (the event loop's and the worker's
threads each have one, and a freed chunk above the mmap threshold raises that threshold, so later buffers of that
size come from the heaps too): RSS creeps up. `release_memory` calls glibc's ``malloc_trim(0)``, which returns every
free page of every arena to the OS (``madvise(MADV_DONTNEED)``), and reports the RSS before and after; the server
runs it on its worker thread every ``memory_release_s`` (`hycoc.verifier.server.VerifierServer`), counted in
``hycoc_memory_released_bytes_total`` with the RSS in ``hycoc_rss_bytes``. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
from functools import cache

#: Seconds between two releases by default (a trim takes ~1 ms on the toy server).
DEFAULT_MEMORY_RELEASE_S = 30.0


def rss_bytes() -> int:
    """This process's resident set size in bytes (/proc/self/statm; 0 where there is none)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@cache
def _malloc_trim():
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return None


def release_memory() -> tuple[int, int]:
    """``malloc_trim(0)`` where glibc has it; returns (RSS before, RSS after) in bytes (equal where nothing ran)."""
    before = rss_bytes()
    trim = _malloc_trim()
    if trim is None:
        return before, before
    trim(0)
    return before, rss_bytes()
