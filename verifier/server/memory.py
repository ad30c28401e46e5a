"""Giving memory back: cyclic garbage collected and the C allocator's free pages returned to the OS, periodically
(docs/serving.md "Soak and fuzz").

A 10-minute soak (16 chat devices with cancels, disconnects and failed APPEND chunks, and the fuzzer) grew the toy
server's RSS 6-9 MB a minute for 5 minutes and then dropped it 40 MB at once: garbage in reference cycles (an
exception's traceback and the frames it holds, with their tensors and buffers) waits for a full collection, and with
the ~400,000 objects torch and transformers leave tracked, Python runs one only after ~100,000 more have survived
(and it then takes ~0.7 s). `freeze_startup_objects` moves everything the load created to the permanent generation
(``gc.freeze``), after which full collections are cheap and happen on their own; `release_memory` runs one (when
frozen) before the trim.

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
import gc
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


def freeze_startup_objects() -> int:
    """Collect, then move every object tracked now (the model, its modules, the libraries') to the permanent
    generation (``gc.freeze``), so later collections look at what the serving created only. For a process that
    serves (``hycoc verify-server``); returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def release_memory() -> tuple[int, int]:
    """A full garbage collection (only once `freeze_startup_objects` ran: a collection over the model's objects
    takes ~0.7 s), then ``malloc_trim(0)`` where glibc has it; returns (RSS before, RSS after) in bytes."""
    before = rss_bytes()
    if gc.get_freeze_count():
        gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
    return before, rss_bytes()
