"""The device's own drafting time per round, without and with the SLM pass, as it reports it in each OPEN.

The verifier's allowance rule (`hycoc.verifier.allowance`) weighs a tree's rows against what drafting them costs
the phone: at or below K + 1 rows the device drafts the MTP chain alone (no SLM pass), above it the SLM pass runs.
The device measures both here (wall milliseconds of each round's drafting, the first SLM-only tree of a request
left out) and sends the moving averages in every OPEN (protocol 6's ``draft_ms_floor`` / ``draft_ms_tree``;
0 until a round of that kind was drafted).

numpy-free, stdlib only (the device runtime).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hycoc.protocol.messages import MAX_DRAFT_MS


@dataclass
class DraftingTimes:
    """Moving averages (weight ``weight`` per round, the first round of a kind taken as is) of the drafting ms per
    round of trees of at most ``chain_rows`` rows (``floor_ms``: no SLM pass) and of larger trees (``tree_ms``);
    0.0 until one was seen. chain_rows: K + 1. Values are clamped to [0, MAX_DRAFT_MS] (what an OPEN may carry).

    Hand-worked: chain_rows 5, weight 0.5; observe(5, 2.0), observe(5, 4.0), observe(33, 10.0) -> floor_ms 3.0,
    tree_ms 10.0.
    """

    chain_rows: int
    weight: float = 0.1
    floor_ms: float = 0.0
    tree_ms: float = 0.0

    def observe(self, rows: int, ms: float) -> None:
        """One round's drafting: a tree of ``rows`` rows that took ``ms`` milliseconds (not finite: ignored)."""
        if not math.isfinite(ms):
            return
        ms = min(max(0.0, float(ms)), MAX_DRAFT_MS)
        name = "floor_ms" if rows <= self.chain_rows else "tree_ms"
        old = getattr(self, name)
        setattr(self, name, ms if old == 0.0 else old + self.weight * (ms - old))


__all__ = ["DraftingTimes"]
