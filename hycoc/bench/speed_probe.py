"""The machine's CPU speed now, against when the step cost was profiled: a fixed verifier workload timed on demand.

`hycoc capacity --validate` compares its simulation with load tests run minutes after the step cost was timed
(`hycoc.bench.capacity_cost.measure_step_cost`). On this 2-vCPU KVM machine the same fixed torch workload takes
10-20% more CPU time from one half-minute to the next with nothing else running (/proc/stat shows no steal time:
the guest cannot see it), so a profile timed once is off by that much for a run made later, whatever the
simulation does. A `SpeedProbe` is the yardstick: the same recorded rounds of one recorded request, replayed on a
fresh session of the recipe's own verifier (`hycoc.verifier.batch.verify_batch` and the reply's `wire.encode`, as
the server's worker runs them), their mean CPU ms per step (`time.thread_time`, the calling thread's on-CPU time).
The profile times it between its passes (``meta["probe_ms"]``); `--validate` times it before and after every
measured run, and the run's steps are simulated at (run's probe / profile's probe) times the profile's CPU ms
(`hycoc.bench.capacity.SimConfig.cpu_scale`). The workload is fixed (same prompt, same trees, same acceptance,
the same contexts), so only the machine's speed moves it.

Vidur (MLSys 2024) profiles once on a dedicated GPU, where this term is 1; here it is measured, not assumed.
"""

from __future__ import annotations

import time

import numpy as np

#: Recorded rounds replayed per probe repeat (the first ones of the request), and repeats per `SpeedProbe.measure`:
#: ~3 x 24 steps of the toy's 33-row rounds, ~1.2 s on a 2-core CPU.
PROBE_ROUNDS = 24
PROBE_REPEATS = 3


class SpeedProbe:
    """A fixed verifier workload (module docstring).

    engine: a `hycoc.verifier.engine.VerifierEngine` (the caller's: its threads set, its EOS ids cleared for
    scratch sessions). request: a recorded `hycoc.bench.loadtrace.RequestTrace` of a device-drafted
    configuration (its first ``rounds`` rounds are replayed). Raises ValueError when the request has no rounds."""

    def __init__(self, engine, request, *, rounds: int = PROBE_ROUNDS, repeats: int = PROBE_REPEATS):
        if not request.rounds:
            raise ValueError("the speed probe's request has no recorded rounds: record one with rounds (loadtest)")
        self.engine, self.request = engine, request
        self.rounds, self.repeats = max(1, rounds), max(1, repeats)

    def _one(self, pause_ms: float = 0.0) -> list[float]:
        """One replay: open, prefill, the first rounds (each committing what it accepted), close; CPU ms each.
        pause_ms: a sleep before each round (a device drafting while the worker idles)."""
        from hycoc.bench.capacity import TraceRequest
        from hycoc.bench.loadtrace import patch_root
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
                wire.encode(reply, version=s.wire_version)
                out.append((time.thread_time() - c0) * 1e3)
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


__all__ = ["PROBE_REPEATS", "PROBE_ROUNDS", "SpeedProbe", "open_probe"]
