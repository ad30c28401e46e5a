"""The tree allowance: how many rows a session's next draft tree may hold, set by the verifier from its load.

Why. The row budget (`hycoc.verifier.row_budget`) trims trees at the server once several sessions share a
forward, but the device has already drafted every row it throws away: its NPU time, its SLM pass and the uplink
bytes. The allowance moves the same decision one round earlier: each REPLY says how many rows (root included) the
session's next ROUND may hold (protocol 6, `hycoc.protocol.messages.RoundReply.allowance`), and the device drafts
no more (below the MTP chain it skips the SLM pass altogether).

The rule (`AllowanceRule.allowance`), for the current load (the sessions whose rounds share a batched forward,
an exponential moving average over steps):

1. Low load: when ``sessions x ceiling`` rows fit the forward's free rows (one full tree, or the cost line's flat
   part), the allowance is the ceiling (B + 1): one session alone always drafts the recipe's whole tree.
2. Otherwise the allowance is the r in [floor, ceiling] that maximises committed tokens per verifier millisecond
   if every one of those sessions sent r rows: sessions x (1 + V(r)) / (cost(sessions x r) + overhead x
   sessions), the row budget's own objective (`hycoc.verifier.row_budget.allocate`'s step 3) with V(r) the
   expected tokens of a tree's r - 1 best non-root rows. V is learned from the scored trees sessions send: the
   mean of exp(s) of each rank (rows sorted by score, padding worth 0; §3.1: exp(s(v)) is about the chance the
   path to v is accepted), times the budget's accepted-per-expected correction (`BudgetState.value_scale`).
3. With a target (``target_ms``, the server's step-latency target in the spirit of `hycoc capacity --p90-ms`),
   only the r whose step fits it are candidates; if none fits, the floor.

The floor is the MTP chain plus the root (K + 1 rows): a HyCo round at its floor holds Cloud+MTP's rows without
its server-side head steps, so it never costs the verifier more than a Cloud+MTP round. Ties go to the fewer rows.

Core module: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .row_budget import BudgetState, RowCost, monotone_scores, row_values

#: Allowance modes (recipe ``verifier.allowance``): "fixed" grants every session the whole tree (B + 1 rows) each
#: round; "auto" sizes it from the load (`AllowanceRule`; needs batching = "batched").
ALLOWANCE_MODES = ("fixed", "auto")


@dataclass
class AllowanceState:
    """What the rule learned: ``rank_values[i]`` the mean expected tokens of the (i + 1)-th best non-root row of
    the scored trees seen (EMA, float64 (ceiling - 1,); NaN until a tree with that many rows was seen), and
    ``sessions`` the sessions per batched step (EMA; 0 before the first step)."""

    rank_values: np.ndarray
    sessions: float = 0.0
    trees: int = 0
    steps: int = 0


@dataclass
class AllowanceRule:
    """The verifier's allowance rule (module docstring).

    cost: the batched forward's `RowCost` (ms as a function of rows). free_rows: rows a forward holds without
    trimming (>= ceiling on a server: one full tree). floor: the fewest rows granted (K + 1: the root and the MTP
    chain), >= 1. ceiling: the most (B + 1), >= floor. target_ms: a step-latency target in ms (None: none).
    weight: the EMAs' weight of a new observation, in (0, 1]. budget: the row budget's `BudgetState` when the
    server runs one (its learned host ms per session and accepted-per-expected ratio are shared), else the rule's
    own.

    Raises ValueError for a floor below 1, a ceiling below the floor, free_rows < 1, a weight outside (0, 1] or a
    target that is not a positive finite number.
    """

    cost: RowCost
    free_rows: int
    floor: int
    ceiling: int
    target_ms: float | None = None
    weight: float = 0.1
    budget: BudgetState = field(default_factory=BudgetState)
    state: AllowanceState = field(init=False)

    def __post_init__(self) -> None:
        if self.floor < 1:
            raise ValueError(f"allowance floor = {self.floor}: must be >= 1 (the root is always sent)")
        if self.ceiling < self.floor:
            raise ValueError(f"allowance ceiling = {self.ceiling} is below its floor {self.floor}")
        if self.free_rows < 1:
            raise ValueError(f"free_rows = {self.free_rows}: must be >= 1")
        if not 0 < self.weight <= 1:
            raise ValueError(f"weight = {self.weight}: must lie in (0, 1]")
        if self.target_ms is not None and not (math.isfinite(self.target_ms) and self.target_ms > 0):
            raise ValueError(f"allowance target_ms = {self.target_ms}: must be a positive number of ms, or None")
        self.state = AllowanceState(np.full(max(0, self.ceiling - 1), np.nan))
        self._memo: tuple[tuple, int] | None = None  # (the state it was computed for, the allowance)

    # ------------------------------------------------------------------------------------------------ learning

    def observe_tree(self, scores, tokens, parents) -> None:
        """One scored tree as a session sent it (scores float (R,), tokens and parents int (R,), R <= ceiling):
        its non-root rows' expected tokens, sorted high to low, update the per-rank means. A tree sent under a
        smaller allowance teaches only the ranks it holds."""
        values = row_values(monotone_scores(scores, parents), tokens, parents)[1:]
        ranked = np.sort(values)[::-1][: len(self.state.rank_values)]
        known = self.state.rank_values[: len(ranked)]
        w = self.weight
        fresh = np.isnan(known)
        known[fresh] = ranked[fresh]
        known[~fresh] += w * (ranked[~fresh] - known[~fresh])
        self.state.trees += 1

    def observe_step(self, sessions: int, step_ms: float | None = None, forward_ms: float | None = None) -> None:
        """One batched step of ``sessions`` rounds (>= 1; others are ignored): the load's moving average. With
        ``step_ms`` and ``forward_ms`` (the step's whole and forward milliseconds) the budget state learns the host
        ms per session outside the forward too: pass them only when no `RowBudget` shares that state (it learns
        from the same step itself)."""
        if sessions < 1:
            return
        if step_ms is not None and forward_ms is not None:
            self.budget.observe(step_ms, forward_ms, sessions, None, None)
        w = self.weight if self.state.steps else 1.0
        self.state.sessions += w * (sessions - self.state.sessions)
        self.state.steps += 1

    # ------------------------------------------------------------------------------------------------ the rule

    def expected_tokens(self, rows: np.ndarray) -> np.ndarray:
        """V(r) for each r in ``rows`` (int array, each in [1, ceiling]): the learned expected tokens of a tree's
        r - 1 best non-root rows, times the budget's value_scale; ranks never seen count the last seen rank's
        value (float64, rows' shape)."""
        values = self.state.rank_values
        seen = values[~np.isnan(values)]
        filled = np.where(np.isnan(values), seen[-1] if len(seen) else 0.0, values)
        cum = np.concatenate([[0.0], np.cumsum(filled)]) * self.budget.value_scale
        return cum[np.asarray(rows, np.int64) - 1]

    def allowance(self, sessions: float | None = None) -> int:
        """Rows the next tree of a session may hold, in [floor, ceiling] (module docstring's rule). sessions: the
        load to size for (rounds per batched step; None: the learned average). Before any tree was seen, the
        ceiling (nothing to rank yet)."""
        n = self.state.sessions if sessions is None else float(sessions)
        key = (n, self.state.trees, self.state.steps, self.budget.value_scale, self.budget.overhead_ms)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]  # every session of a step is granted at once: one computation per step
        rows = self._best_rows(n)
        self._memo = (key, rows)
        return rows

    def _best_rows(self, n: float) -> int:
        if n <= 1 or n * self.ceiling <= self.free_rows or self.state.trees == 0:
            return self.ceiling
        rows = np.arange(self.floor, self.ceiling + 1)
        step_ms = self.cost.ms(n * rows) + self.budget.overhead_ms * n
        ratio = n * (1.0 + self.expected_tokens(rows)) / np.maximum(step_ms, 1e-9)
        if self.target_ms is not None:
            fits = step_ms <= self.target_ms
            if not fits.any():
                return self.floor
            ratio = np.where(fits, ratio, -np.inf)
        return int(rows[int(np.argmax(ratio))])  # first maximum: the fewest rows for the best ratio


__all__ = ["ALLOWANCE_MODES", "AllowanceRule", "AllowanceState"]
