"""What the machine's scheduler gave the load test's client and its verify-servers during a run (`SchedSampler`):
the check of `hycoc capacity --validate` (`hycoc.bench.capacity.run`) reads the machine's load from it.

Linux only (/proc/PID/task/TID/schedstat); elsewhere nothing is sampled.
"""

from __future__ import annotations

import os
import time


class SchedSampler:
    """What the machine's scheduler gave this process (the load test's client) and its child processes (the
    verify-servers) during a run: every ``interval_s`` a daemon thread reads each thread's /proc/PID/task/TID/
    schedstat (ns on a CPU, ns runnable but waiting for one, timeslices; Linux's sched-stats, documented in the
    kernel's Documentation/scheduler/sched-stats.rst). Over a run's window (`contention`): the busiest server
    thread's slowdown (on-CPU + waiting) / on-CPU -- how much longer a CPU ms of the verifier took than on an idle
    machine -- and the mean wait per timeslice of the server's and the client's main threads (the delay before a
    thread woken by a frame or a timer runs). These are the machine's load during the run, not a fit to it:
    with them the simulation knows how busy the shared CPU was. Where /proc has no schedstat, nothing is sampled
    and `contention` returns None."""

    def __init__(self, interval_s: float = 0.1, pids: list[int] | None = None):
        import threading

        self.pids = list(pids) if pids else None  # the servers' pids, when they are not this one's children
        self.samples: list[tuple[float, dict]] = []
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True, name="sched-sampler")

    @staticmethod
    def _children(pid: int) -> list[int]:
        out = []
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                    out += [int(x) for x in f.read().split()]
            except OSError:
                pass
        return out

    @staticmethod
    def thread_stats(pid: int) -> dict:
        """{(pid, tid): (ns on a CPU, ns runnable but waiting, timeslices)} of every thread of ``pid`` now
        (/proc/PID/task/TID/schedstat); {} where there is none."""
        got: dict[tuple[int, int], tuple[int, ...]] = {}
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
        except OSError:
            return got
        for tid in tasks:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat", encoding="ascii") as f:
                    run, wait, slices = (int(x) for x in f.read().split()[:3])
                got[(pid, int(tid))] = (run, wait, slices)
            except (OSError, ValueError):
                pass
        return got

    def _run(self) -> None:
        me = os.getpid()
        while not self._stop.is_set():
            try:
                snap = self.thread_stats(me)
                for child in self.pids if self.pids is not None else self._children(me):
                    snap.update(self.thread_stats(child))
            except OSError:
                return
            if not snap:
                return
            self.samples.append((time.time(), snap))
            self._stop.wait(self._interval)

    def __enter__(self) -> SchedSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=2)

    def contention(self, t0: float, t1: float) -> dict | None:
        """Over [t0, t1] (epoch seconds), each thread from its first to its last sample in the window (a server
        that starts or exits inside it counts over the part it lived in): {"slowdown": busiest server thread's
        (run + wait) / run, "server_wake_ms":
        the busiest server's main thread's wait per timeslice, "client_wake_ms": this process's main thread's,
        "intervals": [[slowdown, CPU ns], ...] of that thread per sampling interval it ran > 1 ms in};
        None without two samples in the window or any server thread running in it."""
        inside = [snap for t, snap in self.samples if t0 <= t <= t1]
        if len(inside) < 2:
            return None
        first: dict = {}  # each thread's first and last sample in the window: a server that starts or
        last: dict = {}  # exits inside it is counted over the part of the window it lived in
        for snap in inside:
            for k, v in snap.items():
                first.setdefault(k, v)
                last[k] = v
        delta = {k: tuple(y - x for x, y in zip(first[k], last[k])) for k in last}
        me = os.getpid()
        servers = {k: v for k, v in delta.items() if k[0] != me and v[0] > 0}
        if not servers:
            return None
        (pid, _), (run, wait, _) = max(servers.items(), key=lambda kv: kv[1][0])
        if self.pids is not None and len(self.pids) > 1:  # several replicas: every replica's busiest thread
            each = [
                max((v for k, v in servers.items() if k[0] == p), key=lambda v: v[0], default=None) for p in self.pids
            ]
            busiest = [b for b in each if b]
            run, wait = sum(b[0] for b in busiest), sum(b[1] for b in busiest)

        def wake(key) -> float:
            d = delta.get(key)
            return d[1] / d[2] / 1e6 if d and d[2] > 0 else 0.0

        key = max(servers, key=lambda k: servers[k][0])
        per = []  # that thread's slowdown in each sampling interval it ran, with its CPU ns
        for x, y in zip(inside, inside[1:]):
            if key in x and key in y:
                r, w = y[key][0] - x[key][0], y[key][1] - x[key][1]
                if r > 1e6:
                    per.append(((r + w) / r, r))
        return {
            "worker_cpu_ms": servers[key][0] / 1e6,
            "slowdown": (run + wait) / run,
            "server_wake_ms": wake((pid, pid)),
            "client_wake_ms": wake((me, me)),
            "intervals": [[round(a, 3), int(b)] for a, b in per],
        }


__all__ = ["SchedSampler"]
