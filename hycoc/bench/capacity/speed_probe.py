"""The machine's CPU speed now, against when the step cost was profiled: a fixed verifier workload timed on demand.

`hycoc capacity --validate` compares its simulation with load tests run minutes after the step cost was timed
(`hycoc.bench.capacity.measure.measure_step_cost`). On this 2-vCPU KVM machine the same fixed torch workload takes
10-20% more CPU time from one half-minute to the next with nothing else running (/proc/stat shows no steal time:
the guest cannot see it), so a profile timed once is off by that much for a run made later, whatever the
simulation does. A `SpeedProbe` is the yardstick: the same recorded rounds of one recorded request, replayed on a
fresh session of the recipe's own verifier (`hycoc.verifier.batch.verify_batch` and the reply's `wire.encode`, as
the server's worker runs them), their mean CPU ms per step (`time.thread_time`, the calling thread's on-CPU time).
The profile times it between its passes (``meta["probe_ms"]``); `--validate` times it before and after every
measured run, and the run's steps are simulated at (run's probe / profile's probe) times the profile's CPU ms
(`hycoc.bench.capacity.simulation.SimConfig.cpu_scale`). The workload is fixed (same prompt, same trees, same
acceptance, the same contexts), so only the machine's speed moves it.

Vidur (MLSys 2024) profiles once on a dedicated GPU, where this term is 1; here it is measured, not assumed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # imported where the sampler process starts
    import subprocess

#: Recorded rounds replayed per probe repeat (the first ones of the request), and repeats per `SpeedProbe.measure`:
#: ~3 x 24 steps of the toy's 33-row rounds, ~1.2 s on a 2-core CPU.
PROBE_ROUNDS = 24
PROBE_REPEATS = 3


class SpeedProbe:
    """A fixed verifier workload (module docstring).

    engine: a `hycoc.verifier.engine.VerifierEngine` (the caller's: its threads set, its EOS ids cleared for
    scratch sessions). request: a recorded `hycoc.bench.loadtest.trace.RequestTrace` of a device-drafted
    configuration (its first ``rounds`` rounds are replayed). Raises ValueError when the request has no rounds."""

    def __init__(self, engine, request, *, rounds: int = PROBE_ROUNDS, repeats: int = PROBE_REPEATS):
        if not request.rounds:
            raise ValueError("the speed probe's request has no recorded rounds: record one with rounds (loadtest)")
        self.engine, self.request = engine, request
        self.rounds, self.repeats = max(1, rounds), max(1, repeats)

    def _one(self, pause_ms: float = 0.0, on_step=None) -> list[float]:
        """One replay: open, prefill, the first rounds (each committing what it accepted), close; CPU ms each.
        pause_ms: a sleep before each round (a device drafting while the worker idles); on_step: called with each
        step's CPU ms as it ends."""
        from hycoc.bench.capacity.requests import TraceRequest
        from hycoc.bench.loadtest.trace import patch_root
        from hycoc.protocol import wire
        from hycoc.protocol.messages import Sampling
        from hycoc.verifier.batch import BatchStats, verify_batch

        req = self.request
        s = self.engine.open(
            np.asarray(req.prompt),
            Sampling(req.temperature, req.top_k, req.top_p),
            seed=req.seed,
            acceptance=req.acceptance,
            epsilon=req.epsilon,
            draft_place=req.draft_place,
            max_new_tokens=10**6,
        )
        s.tree_rows = s.place.tree_rows(max(len(rt.tokens) for rt in req.rounds))  # what a server's OPENED says
        try:
            s.prefill()
            replay, out = TraceRequest(req), []
            for seq in range(self.rounds):
                rnd = replay.next_round()
                if rnd is None:
                    break
                toks = patch_root(rnd.tree[1], s.root).astype(np.int64)
                rounds = [(s, toks, np.asarray(rnd.tree[2], np.int64), seq, None)]
                if pause_ms > 0:
                    time.sleep(pause_ms / 1e3)
                c0 = time.thread_time()
                reply = verify_batch(self.engine, rounds, BatchStats(), None)[0]
                if isinstance(reply, BaseException):
                    raise RuntimeError(f"the speed probe's round {seq} failed: {reply}")
                wire.encode(s.grant(reply), version=s.wire_version)  # the whole tree granted, as a server would
                out.append((time.thread_time() - c0) * 1e3)
                if on_step is not None:
                    on_step(out[-1])
                replay.commit([int(toks[j]) for j in reply.path_rows] + [int(reply.bonus)])
            return out
        finally:
            s.close()

    def measure(self, pause_ms: float = 0.0) -> float:
        """Mean CPU ms per step of the fixed workload, now (``repeats`` replays; the first step of each replay
        left out: it warms the fresh session's caches). pause_ms: an idle pause before each step (`_one`)."""
        each = [ms for _ in range(self.repeats) for ms in self._one(pause_ms)[1:]]
        return float(np.mean(each)) if each else float("nan")


def open_probe(recipe, request) -> SpeedProbe:
    """A `SpeedProbe` on its own engine of ``recipe``'s verifier (`hycoc.verifier.loading.engine_from_recipe`,
    cpu, the recipe's threads); close it with ``probe.engine.close()``."""
    from hycoc.models import set_threads
    from hycoc.verifier.loading import engine_from_recipe

    set_threads(recipe.verifier.threads)
    engine = engine_from_recipe(recipe, device="cpu")
    engine.eos_token_ids = frozenset()
    probe = SpeedProbe(engine, request)
    probe.measure()  # a warm-up: the first replay on a fresh engine costs more
    return probe


#: Seconds between a `SpeedSampler`'s probe steps: a ~15 ms step every 0.25 s, ~6% of one core.
SAMPLE_INTERVAL_S = 0.25


def _sample_main(recipe_path: str, trace_path: str, config: str, question_id: int, out: str, interval_s: float):
    """The sampler process: the probe's steps, one every ``interval_s``, until stopped or its parent process ends;
    each as a line "epoch_s cpu_ms" appended to ``out`` (flushed)."""
    from hycoc.bench.loadtest.trace import load_trace
    from hycoc.recipe import load_recipe

    trace = load_trace(trace_path)
    req = next(r for r in trace.requests if r.config == config and r.question_id == question_id)
    probe = open_probe(load_recipe(recipe_path), req)
    import os

    parent = os.getppid()
    with open(out, "a", encoding="utf-8") as f:

        def write(ms: float) -> None:
            f.write(f"{time.time():.4f} {ms:.4f}\n")
            f.flush()

        while os.getppid() == parent:  # the caller gone (its process ended without stopping us): stop
            probe._one(interval_s * 1e3, write)


class SpeedSampler:
    """The speed probe's steps sampled through a stretch of time by a separate process (``python -m
    hycoc.bench.capacity.speed_probe``: no GIL shared with the caller), one step every ``interval_s``
    (`SAMPLE_INTERVAL_S`), each written with its time: `mean_between` then gives the machine's speed over any window (a
    profile, a load-test run) as the mean CPU ms of the probe's steps inside it. Steps follow an idle pause, so they are
    cold steps (the idle factor's kind) in every window alike. Use as a context manager; raises RuntimeError when the
    process dies before its first sample."""

    proc: subprocess.Popen | None

    def __init__(self, recipe_path, trace_path, request, out: Path, *, interval_s: float = SAMPLE_INTERVAL_S):
        self.args = (str(recipe_path), str(trace_path), request.config, int(request.question_id), str(out))
        self.out, self.interval_s, self.proc = Path(out), interval_s, None

    def __enter__(self) -> SpeedSampler:
        import subprocess
        import sys

        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text("", encoding="utf-8")
        self.proc = proc = subprocess.Popen(
            [sys.executable, "-m", "hycoc.bench.capacity.speed_probe", *map(str, self.args), str(self.interval_s)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
        )
        deadline = time.time() + 120.0
        while not self.samples():
            if proc.poll() is not None or time.time() > deadline:
                self.__exit__(None, None, None)
                raise RuntimeError(
                    "the speed sampler process gave no sample (hycoc.bench.capacity.speed_probe); report this"
                )
            time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except Exception:  # noqa: BLE001 -- a sampler that will not stop is killed, never left behind
                self.proc.kill()
                self.proc.wait()
            self.proc = None

    def samples(self) -> list[tuple[float, float]]:
        """(epoch s, CPU ms) of every probe step so far."""
        try:
            lines = self.out.read_text(encoding="utf-8").splitlines()
        except OSError:
            return []
        out = []
        for line in lines:
            parts = line.split()
            if len(parts) == 2:
                out.append((float(parts[0]), float(parts[1])))
        return out

    def mean_between(self, t0: float, t1: float, least: int = 10) -> float | None:
        """Mean CPU ms of the probe steps that ended in [t0, t1] (epoch s); None with fewer than ``least``."""
        got = [ms for t, ms in self.samples() if t0 <= t <= t1]
        return float(np.mean(got)) if len(got) >= least else None


__all__ = ["PROBE_REPEATS", "PROBE_ROUNDS", "SAMPLE_INTERVAL_S", "SpeedProbe", "SpeedSampler", "open_probe"]


if __name__ == "__main__":  # the sampler process (SpeedSampler): RECIPE TRACE CONFIG QUESTION_ID OUT INTERVAL_S
    import sys

    _sample_main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], float(sys.argv[6]))
