"""MTP head stepping: the chain of head steps from the hand-off's query (paper Alg. 2 lines 7-13), in one place.

Three drafters run the same loop over different step functions:

- the device's MTP Drafter (`hycoc.runtime.mtp_drafter.MtpDrafter.draft`): the head graph (onnxruntime) over the
  W-column ring, top-2 over the keep set, numpy;
- the server-head baseline (`hycoc.verifier.baselines.draft_server_chain`): the full-precision head
  (`hycoc.mtp.head_step`, torch) over a W window, argmax over the keep set;
- Cloud+MTP (`hycoc.verifier.baselines.draft_cloud_chain`): transformers' own head forward, argmax over the full
  vocabulary.

What they share is the loop: z = x̂; K steps; step k gives the indices of the largest and (for k <= D) the
second-largest output, first among equals (line 10); y_k = V[i], y'_k = V[i'] (line 11, the caller maps an index to
its token); z = [E[i]; h] between steps (line 12, none after the last). The step and feed functions carry what
differs (graph or torch, ring or cache, keep set or full vocabulary), so this module imports neither torch nor
onnxruntime and both the device runtime and the verifier may use it (docs/design.md "Algorithm 2: MtpDraft on the
device").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import numpy as np

#: what one head step hands to the next (the head's output state h; its type is the step function's business)
State = TypeVar("State")


@dataclass
class HeadChain:
    """Alg. 2 line 13 as the steps' picks (`HeadStep.top`): ``chain`` i_1..i_K and ``runner_ups`` i'_1..i'_D (D the
    ``siblings`` asked for, at most K)."""

    chain: list[int] = field(default_factory=list)
    runner_ups: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class HeadStep(Generic[State]):
    """One step's result (Alg. 2 lines 9-10): ``top`` the pick of the largest output and, when the step was asked
    for a runner-up, of the second-largest (first among equals), each as the step numbers them (an index into V, or
    the token id when the step maps it itself); ``state`` the head's output state h."""

    top: tuple[int, ...]
    state: State


def head_chain(
    step: Callable[[int, bool], HeadStep[State]],
    feed: Callable[[int, State], None],
    steps: int,
    siblings: int = 0,
) -> HeadChain:
    """Alg. 2 lines 7-13: ``steps`` (K) head steps, the first on the hand-off's query z = x̂ (line 7, the caller's).

    step(k, runner_up): runs the head on the current query (step k, 1-based; line 9) and returns `HeadStep` whose
    ``top`` holds the best index and, when ``runner_up`` (k <= ``siblings``), the second best (line 10).
    feed(i, h): makes the next query z = [E[i]; h] (line 12); called after every step but the last.
    Returns the `HeadChain` of indices (line 11 maps them to tokens: y_k = V[i_k]). steps <= 0 gives an empty
    chain without calling ``step``. Raises ValueError when a step asked for a runner-up returns one index only.
    """
    out = HeadChain()
    for k in range(1, steps + 1):
        runner_up = k <= siblings
        res = step(k, runner_up)
        out.chain.append(int(res.top[0]))
        if runner_up:
            if len(res.top) < 2:
                raise ValueError(f"head step {k} returned {len(res.top)} index; a runner-up needs the top 2")
            out.runner_ups.append(int(res.top[1]))
        if k < steps:
            feed(int(res.top[0]), res.state)
    return out


def top2(logits) -> tuple[int, int]:
    """Indices of the largest and second-largest entry of a 1-D array, first among equals (Alg. 2 line 10):
    ties go to the lower index, so [3, 5, 5] gives (1, 2) and [5, 5, 1] gives (0, 1)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    i = int(np.argmax(x))  # numpy: first occurrence of the maximum
    rest = x.copy()
    rest[i] = -np.inf
    return i, int(np.argmax(rest))


__all__ = ["HeadChain", "HeadStep", "head_chain", "top2"]
