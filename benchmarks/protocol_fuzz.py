"""Fuzz a verifier server's wire protocol in phases and watch its memory (issue 38 item 4; docs/serving.md "Soak
and fuzz").

    python benchmarks/protocol_fuzz.py recipes/toy.toml --phases 4 --phase-s 60
    python benchmarks/protocol_fuzz.py recipes/toy.toml --server ws://127.0.0.1:8765 --phases 2
    python benchmarks/protocol_fuzz.py recipes/toy.toml --in-process --tracemalloc --phases 4

Each phase runs `hycoc.bench.loadtest.protocol_fuzz.fuzz` (malformed frames of every kind, before OPEN and inside
sessions) for ``--phase-s`` seconds, then prints the frames sent, the codes received, findings (a code outside a case's
documented set, ``internal_error``, a connection failure) and the server's RSS (``/proc/PID/status`` VmRSS of the
child ``hycoc verify-server``, or of this process with ``--in-process``). ``--tracemalloc`` (in-process only) takes a
tracemalloc snapshot after each phase and prints the 10 largest growths since the first phase, by line: what grows
Python's heap under fuzzing; RSS growing while they stay flat is native memory (the allocator).
Exit status 1 when there was a finding or the server is not healthy at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from hycoc.bench.loadtest.protocol_fuzz import FuzzStats, error_counts, fuzz, target_of
from hycoc.bench.loadtest.run import ServerProcess, healthz


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (10^6 B), from /proc/PID/status."""
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise OSError(f"no VmRSS for pid {pid}")


def _in_process(recipe_path: Path):
    """A `ServerThread` serving the recipe's verifier in this process (its options as ``verify-server``'s)."""
    from hycoc.verifier.loading import engine_from_recipe, server_options
    from hycoc.verifier.server import ServerThread

    from hycoc.recipe.loading import load_recipe

    recipe = load_recipe(recipe_path)
    return ServerThread(engine_from_recipe(recipe), **server_options(recipe)).start()


def _top_growth(first, snap, n: int = 10) -> list[str]:
    return [str(s) for s in snap.compare_to(first, "lineno")[:n]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--server", help="fuzz this running server (ws://HOST:PORT) instead of starting one")
    ap.add_argument("--pid", type=int, help="with --server: the server's process id, for its RSS")
    ap.add_argument("--in-process", action="store_true", help="serve in this process (for --tracemalloc)")
    ap.add_argument("--tracemalloc", action="store_true", help="print the heap's growth per phase (in-process)")
    ap.add_argument("--phases", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=60.0)
    ap.add_argument("--connections", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--big-share", type=float, default=0.0, help="share of frames replaced by 64 KiB-295 KB ones")
    args = ap.parse_args()
    if args.tracemalloc and not args.in_process:
        ap.error("--tracemalloc needs --in-process (it reads this process's heap)")
    proc = thread = None
    if args.server:
        url, pid = args.server, args.pid
    elif args.in_process:
        thread = _in_process(args.recipe)
        if args.tracemalloc:  # after loading (tracing every import and the model's load takes minutes)
            import tracemalloc

            tracemalloc.start(10)
        url, pid = thread.url, None
        import os

        pid = os.getpid()
    else:
        proc = ServerProcess(args.recipe)
        url, pid = proc.url, proc.proc.pid
    try:
        health = healthz(url)
        target = target_of(health, int(health["tree_rows"]))
        stats = FuzzStats()
        first = None
        print(f"fuzzing {url}: {target}", flush=True)
        for phase in range(args.phases):
            t0 = time.monotonic()
            asyncio.run(fuzz(url, target, seconds=args.phase_s, connections=args.connections,
                             seed=args.seed * 100 + phase, stats=stats, big_share=args.big_share))  # fmt: skip
            rss = f"{rss_mb(pid):.1f} MB" if pid is not None else "-"
            print(f"phase {phase + 1}: {time.monotonic() - t0:.0f} s, frames {stats.frames}, connections "
                  f"{stats.connections}, sessions {stats.sessions}, findings {len(stats.findings)}, RSS {rss}",
                  flush=True)  # fmt: skip
            if args.tracemalloc:
                import gc
                import tracemalloc

                gc.collect()
                snap = tracemalloc.take_snapshot()
                if first is None:
                    first = snap
                else:
                    print("  heap growth since phase 1:\n    " + "\n    ".join(_top_growth(first, snap)))
        print("codes:", dict(stats.codes().most_common()))
        for finding in stats.findings[:20]:
            print("FINDING", finding)
        healthy = healthz(url).get("status") == "ok"
        internal = error_counts(url).get("internal_error", 0.0)
        print(f"server healthy after: {healthy}; internal_error answers: {internal:g}")
        return 0 if healthy and not stats.findings else 1
    finally:
        if proc is not None:
            proc.stop()
        if thread is not None:
            thread.stop()


if __name__ == "__main__":
    sys.exit(main())
