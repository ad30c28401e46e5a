"""Timers of the device runtime's host work, shared by the runtime benchmarks (benchmarks/runtime_real_shape.py,
benchmarks/runtime_host_share.py, benchmarks/runtime_replay.py; docs/device-runtime.md "Host work per round").

`StepTimer` wraps runtime functions and keeps each step's EXCLUSIVE time (a wrapped call's time minus that of the
wrapped functions it calls); `instrument` wraps the runtime's functions by step (`STEPS`); `TimedSession` puts an
onnxruntime session's own time apart ("ORT call") and counts the bytes handed to it. `CpuClock` keeps this thread's
CPU time (``time.thread_time``) in the drafting region and in the graphs' sessions inside it. Each one patches the
runtime's classes in this process: use them in a benchmark process, never in a server.
"""

from __future__ import annotations

import time
from collections import defaultdict

import numpy as np

#: The host steps of a round, in report order (benchmarks/runtime_real_shape.py's module docstring).
STEPS = ("ingest", "masks", "rotary+LUT", "ring writes", "top-k", "tree", "commit", "io copies")


class StepTimer:
    """Exclusive wall time per step of wrapped functions: a wrapped call's time minus its wrapped callees'."""

    def __init__(self, clock=time.perf_counter):
        self.seconds: dict[str, float] = defaultdict(float)
        self.bytes: dict[str, int] = defaultdict(int)  # graph IO bytes by kind (`TimedSession.run`)
        self._stack: list[float] = []
        self.enabled = True
        self.clock = clock

    def wrap(self, owner, attr: str, step: str) -> None:
        """Replace ``owner.attr`` (a class's method or a module's function) by a timed wrapper."""
        orig = getattr(owner, attr)
        if isinstance(orig, staticmethod):
            orig = orig.__func__
        timer = self

        def timed(*args, **kwargs):
            start = timer.clock()
            timer._stack.append(0.0)
            try:
                return orig(*args, **kwargs)
            finally:
                elapsed = timer.clock() - start
                inner = timer._stack.pop()
                if timer.enabled:
                    timer.seconds[step] += elapsed - inner
                if timer._stack:
                    timer._stack[-1] += elapsed

        timed.__wrapped__ = orig  # type: ignore[attr-defined]  # as functools.wraps marks it (mypy: no such attribute)
        setattr(owner, attr, timed)

    def reset(self) -> None:
        self.seconds.clear()
        self.bytes.clear()


def instrument(timer: StepTimer) -> None:
    """Wrap the runtime's functions by step (module docstring). Module-level names are wrapped where they are
    looked up (the drafter modules import them by name)."""
    from hycoc import host
    from hycoc.runtime import graphs, mtp_drafter, slm_drafter, tree_builder, tree_mask

    timer.wrap(mtp_drafter.MtpDrafter, "ingest", "ingest")
    timer.wrap(mtp_drafter.MtpDrafter, "feeds", "rotary+LUT")
    timer.wrap(mtp_drafter.MtpDrafter, "draft", "tree")
    timer.wrap(slm_drafter.SlmDrafter, "feeds", "rotary+LUT")
    timer.wrap(slm_drafter.SlmDrafter, "_forward", "tree")
    timer.wrap(slm_drafter.SlmDrafter, "expand", "tree")
    timer.wrap(slm_drafter.SlmDrafter, "_write", "ring writes")
    timer.wrap(slm_drafter.SlmDrafter, "commit", "commit")
    timer.wrap(host.EmbeddingLut, "lookup", "rotary+LUT")
    timer.wrap(host.RotaryTable, "rows", "rotary+LUT")
    if hasattr(host, "RotaryBlock"):
        timer.wrap(host.RotaryBlock, "rows", "rotary+LUT")
    for module, names in ((mtp_drafter, ("ring_masks",)), (slm_drafter, ("tree_ring_mask", "tree_depths"))):
        for name in names:
            if hasattr(module, name):
                timer.wrap(module, name, "masks")
    timer.wrap(tree_mask.TreeRingMask, "update", "masks")
    if hasattr(tree_mask, "HeadRingMask"):
        timer.wrap(tree_mask.HeadRingMask, "update", "masks")
    for module, name in (
        (mtp_drafter, "top2"),
        (slm_drafter, "logits_candidates"),
        (slm_drafter, "graph_candidates"),
        (slm_drafter, "graph_candidate_rows"),
        (tree_builder, "logq_candidates"),
    ):
        if hasattr(module, name):
            timer.wrap(module, name, "top-k")
    timer.wrap(tree_builder.TreeBuilder, "slm_pass", "top-k")
    timer.wrap(tree_builder.TreeBuilder, "build", "tree")
    timer.wrap(tree_builder, "walk_reply", "tree")
    timer.wrap(graphs.GraphRunner, "run", "io copies")


class TimedSession:
    """An onnxruntime session whose ``run`` / ``run_with_iobinding`` time goes to ``timer.seconds['ORT call']``
    and counts as a callee of the wrapped GraphRunner.run (so it is not in "io copies")."""

    def __init__(self, session, timer: StepTimer):
        self._session, self._timer = session, timer
        # every output's bytes: what a compiled (EPContext) graph writes per call, fetched or not
        size = {"tensor(float)": 4, "tensor(int64)": 8, "tensor(uint16)": 2}
        self._written = sum(int(np.prod(o.shape)) * size[o.type] for o in session.get_outputs())

    def __getattr__(self, name):
        return getattr(self._session, name)

    def _timed(self, fn, *args):
        start = self._timer.clock()
        try:
            return fn(*args)
        finally:
            elapsed = self._timer.clock() - start
            if self._timer.enabled:
                self._timer.seconds["ORT call"] += elapsed
            if self._timer._stack:
                self._timer._stack[-1] += elapsed

    def run(self, names, feeds, *args):
        out = self._timed(self._session.run, names, feeds, *args)
        if self._timer.enabled:  # what the host hands the graph and takes back, by kind
            b = self._timer.bytes
            for x in feeds.values():
                b["in float32" if x.dtype == np.float32 else "in integer"] += x.nbytes
            for y in out:
                b["out float32" if y.dtype == np.float32 else "out integer"] += y.nbytes
            b["out written (all outputs)"] += self._written
        return out

    def run_with_iobinding(self, *args):
        return self._timed(self._session.run_with_iobinding, *args)


class CpuClock:
    """This thread's CPU time (``time.thread_time``) in the drafting region -- `MtpDrafter.ingest`,
    `MtpDrafter.draft`, `SlmTreeDrafter.build_tree` (the client's ``draft_s`` region) -- and in the graphs'
    ``InferenceSession.run`` inside it (onnxruntime with one intra-op thread runs the graph on the calling thread).
    Unlike wall time, other jobs on the machine do not inflate it."""

    def __init__(self):
        from hycoc.runtime.drafters import SlmTreeDrafter
        from hycoc.runtime.mtp_drafter import MtpDrafter

        self.draft_s = self.graph_s = 0.0
        self._depth = 0
        for owner, attr in ((MtpDrafter, "ingest"), (MtpDrafter, "draft"), (SlmTreeDrafter, "build_tree")):
            setattr(owner, attr, self._region(getattr(owner, attr)))

    def _region(self, fn):
        clock = self

        def timed(*args, **kwargs):
            clock._depth += 1
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                clock._depth -= 1
                if not clock._depth:
                    clock.draft_s += time.thread_time() - start

        return timed

    def session(self, session):
        """``session`` with its ``run`` and ``run_with_iobinding`` timed while inside the drafting region."""
        clock = self

        class Timed:
            def __getattr__(self, name):
                return getattr(session, name)

            def _timed(self, fn, *args):
                start = time.thread_time()
                try:
                    return fn(*args)
                finally:
                    if clock._depth:
                        clock.graph_s += time.thread_time() - start

            def run(self, *args):
                return self._timed(session.run, *args)

            def run_with_iobinding(self, *args):
                return self._timed(session.run_with_iobinding, *args)

        return Timed()
