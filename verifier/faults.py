"""Faults injected on purpose, for soak runs only (docs/serving.md "Soak and fuzz").

``HYCOC_INJECT_FAULTS="append_chunk=0.05"`` in a verifier's environment makes that share of APPEND prefill chunks
fail before their forward with `InjectedFault` (ERROR ``injected_fault``), so a soak exercises the all-or-nothing
undo of `hycoc.verifier.prefill_job.PrefillJob` under load (the client retries the APPEND; its answer must equal an
unfailed run's). Unset (always, outside a soak): nothing is ever injected. Read once per process.
"""

from __future__ import annotations

import os
import random
from functools import cache

from .errors import InjectedFault

#: The environment variable, and the fault points it may name.
ENV = "HYCOC_INJECT_FAULTS"
POINTS = ("append_chunk",)


@cache
def _rates() -> dict[str, float]:
    rates = {}
    for part in filter(None, os.environ.get(ENV, "").split(",")):
        name, _, value = part.partition("=")
        if name.strip() not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name.strip()!r}; known: {', '.join(POINTS)}")
        rates[name.strip()] = float(value)
    return rates


_rng = random.Random(0)


def maybe_fail(point: str) -> None:
    """Raise `InjectedFault` at ``point`` with the probability ``HYCOC_INJECT_FAULTS`` gives it (never when unset)."""
    rate = _rates().get(point, 0.0)
    if rate > 0 and _rng.random() < rate:
        raise InjectedFault(f"fault injected at {point} ({ENV}); retry the request")
