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
2. Otherwise the allowance is the r in [floor, ceiling] that maximises the committed tokens per millisecond of a
   session's whole round if every one of those sessions sent r rows: (1 + V(r)) / (away(r) + step(r)), with
   step(r) = cost(sessions x r) + overhead x sessions the batched step (the row budget's cost,
   `hycoc.verifier.row_budget.allocate`'s step 3) and away(r) = link + drafting(r) the time the session is away
   between a reply and its next round: the link (and the device's host work), learned from the measured gaps
   (`observe_away`), plus the device's drafting per round, which the device reports in its OPEN (protocol 6:
   without the SLM pass at or below K + 1 rows, with it above; `observe_drafting`). V(r) is the expected tokens
   of a tree's r - 1 best non-root rows, learned from the scored trees sessions send: the mean of exp(s) of each
   rank (rows sorted by score, padding worth 0; §3.1: exp(s(v)) is about the chance the path to v is accepted),
   times what rounds of that size class actually committed per token their scores expected (the yield, below).
   With nothing measured away
   (a device on the same machine) this is the row budget's own tokens per verifier millisecond; with a slow link
   and an SLM pass that costs the phone more than its rows add, the floor wins: a round then costs the device
   less time than the tokens it loses.
3. With a target (``target_ms``, the server's step-latency target in the spirit of `hycoc capacity --p90-ms`),
   only the r whose step fits it are candidates; if none fits, the floor.

The floor is the MTP chain plus the root (K + 1 rows): a HyCo round at its floor holds Cloud+MTP's rows without
its server-side head steps, so it never costs the verifier more than a Cloud+MTP round. Ties go to the fewer rows.

The yield. Scores are estimates (§3.1), and not equally good ones for every tree: under ε acceptance a chain commits
more than its exact-match scores say, and on an exactly matching SLM the tree's rows commit more than the MTP head's
scores give them. So the rule learns, per size class (the chain: rows <= K + 1, drafted without the SLM pass; the
tree: more rows), the tokens its rounds committed beyond the bonus per token the learned rank values predicted for
a tree of that size (`observe_tree` with ``committed``: the ratio of both means, a running mean over a class's
first 1 / yield_weight rounds and an EMA of that weight after: a round's commit varies by several tokens), and
scales V(r) by r's class's yield (the budget's value_scale until that class committed a round). A class the load
never grants is never measured, so under load every ``explore_every``-th grant goes to the other class (the
chain's best r, or the whole tree) while that class has fewer than ``learn_rounds`` rounds, and every
``refresh_every``-th after (`grant`): the price is a few rounds at another size.

Core module: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hycoc.serving_limits import ALLOWANCE_MODES  # the one list, torch-free: verify-server checks it first

from .row_budget import BudgetState, RowCost, monotone_scores, row_values


@dataclass
class AllowanceState:
    """What the rule learned: ``rank_values[i]`` the mean expected tokens of the (i + 1)-th best non-root row of
    the scored trees seen (EMA, float64 (ceiling - 1,); NaN until a tree with that many rows was seen), and
    ``sessions`` the sessions per batched step (EMA; 0 before the first step). ``link_ms``: ms a session is away
    between a reply and its next round beyond its drafting (EMA of `observe_away`'s gaps; 0 before one).
    ``draft_floor_ms`` / ``draft_tree_ms``: the devices' drafting ms per round without / with the SLM pass (EMA of
    what OPENs report; 0: none reported)."""

    rank_values: np.ndarray
    sessions: float = 0.0
    trees: int = 0
    steps: int = 0
    link_ms: float = 0.0
    aways: int = 0
    draft_floor_ms: float = 0.0
    draft_tree_ms: float = 0.0
    #: per size class (0: the chain, rows <= chain_rows; 1: the tree): the mean tokens committed beyond the bonus
    #: per round, the mean tokens the rank values predicted for the trees sent, and the rounds seen (`observe_tree`).
    committed: np.ndarray = field(default_factory=lambda: np.zeros(2))
    expected: np.ndarray = field(default_factory=lambda: np.zeros(2))
    rounds: np.ndarray = field(default_factory=lambda: np.zeros(2, np.int64))
    grants: int = 0


#: The size classes the yield is learned for (`AllowanceState.committed` etc. index them).
CLASSES = ("chain", "tree")


@dataclass
class AllowanceRule:
    """The verifier's allowance rule (module docstring).

    cost: the batched forward's `RowCost` (ms as a function of rows). free_rows: rows a forward holds without
    trimming (>= ceiling on a server: one full tree). floor: the fewest rows granted (K + 1: the root and the MTP
    chain), >= 1. ceiling: the most (B + 1), >= floor. target_ms: a step-latency target in ms (None: none).
    weight: the EMAs' weight of a new observation, in (0, 1]. budget: the row budget's `BudgetState` when the
    server runs one (its learned host ms per session and accepted-per-expected ratio are shared), else the rule's
    own. chain_rows: the rows at or below which the device drafts without the SLM pass (K + 1; 0: the floor).
    yield_weight: the size classes' yields' EMA weight after their running mean (module docstring), in (0, 1].
    learn_rounds, explore_every, refresh_every: the yield's exploration under load (module docstring, `grant`):
    while a class has fewer than learn_rounds rounds, every explore_every-th grant goes to it, and every
    refresh_every-th after (0: never).

    Raises ValueError for a floor below 1, a ceiling below the floor, free_rows < 1, a weight outside (0, 1], a
    target that is not a positive finite number, or explore_every / refresh_every below 0.
    """

    cost: RowCost
    free_rows: int
    floor: int
    ceiling: int
    target_ms: float | None = None
    weight: float = 0.1
    budget: BudgetState = field(default_factory=BudgetState)
    chain_rows: int = 0
    yield_weight: float = 0.01
    learn_rounds: int = 16
    explore_every: int = 4
    refresh_every: int = 256
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
        if not 0 < self.yield_weight <= 1:
            raise ValueError(f"yield_weight = {self.yield_weight}: must lie in (0, 1]")
        if self.target_ms is not None and not (math.isfinite(self.target_ms) and self.target_ms > 0):
            raise ValueError(f"allowance target_ms = {self.target_ms}: must be a positive number of ms, or None")
        if self.explore_every < 0 or self.refresh_every < 0:
            raise ValueError(
                f"explore_every = {self.explore_every}, refresh_every = {self.refresh_every}: must be >= 0 (0: never)"
            )
        self.state = AllowanceState(np.full(max(0, self.ceiling - 1), np.nan))
        self.chain_rows = int(self.chain_rows or self.floor)
        self._memo: tuple[tuple, int] | None = None  # (the state it was computed for, the allowance)

    @classmethod
    def for_server(
        cls,
        cost: RowCost,
        tree_rows: int,
        chain_length: int,
        *,
        floor: int = 0,
        target_ms: float | None = None,
        budget: BudgetState | None = None,
        free_rows: int | None = None,
    ) -> AllowanceRule:
        """The rule a verifier runs (`hycoc.verifier.server.app.VerifierServer.allowance_rule`, and `hycoc
        capacity`'s simulated server through the same call): ceiling ``tree_rows`` (B + 1); floor ``floor``
        (the recipe's allowance_floor; 0: K + 1 = min(tree_rows, ``chain_length`` + 1), the root and the MTP
        chain); chain_rows min(tree_rows, K + 1) (at or below it the device drafts without the SLM pass); free
        rows ``free_rows`` or the row budget's (one full tree or the cost line's flat part, whichever is larger);
        the row budget's learned ``budget`` state shared when one is given (host ms per session, accepted per
        expected token). Raises ValueError as the constructor does."""
        chain_rows = min(int(tree_rows), int(chain_length) + 1)
        rule = cls(
            cost,
            free_rows=int(free_rows or max(int(tree_rows), cost.flat_rows())),
            floor=int(floor or chain_rows),
            ceiling=int(tree_rows),
            target_ms=target_ms,
            chain_rows=chain_rows,
        )
        if budget is not None:
            rule.budget = budget
        return rule

    # ------------------------------------------------------------------------------------------------ learning

    def observe_tree(self, scores, tokens, parents, committed: int | None = None) -> None:
        """One scored tree as a session sent it (scores float (R,), tokens and parents int (R,), R <= ceiling):
        its non-root rows' expected tokens, sorted high to low, update the per-rank means. A tree sent under a
        smaller allowance teaches only the ranks it holds. ``committed``: the tokens its round committed (accepted
        plus the bonus, >= 1; None: not known): its size class's yield learns them against what the rank values
        predict for a tree of its size (module docstring)."""
        values = row_values(monotone_scores(scores, parents), tokens, parents)[1:]
        ranked = np.sort(values)[::-1][: len(self.state.rank_values)]
        known = self.state.rank_values[: len(ranked)]
        w = self.weight
        fresh = np.isnan(known)
        known[fresh] = ranked[fresh]
        known[~fresh] += w * (ranked[~fresh] - known[~fresh])
        self.state.trees += 1
        if committed is not None and committed >= 1:
            c, s = self.size_class(len(tokens)), self.state
            w = max(1.0 / (s.rounds[c] + 1), self.yield_weight)  # the running mean, then an EMA
            s.committed[c] += w * (committed - 1 - s.committed[c])
            s.expected[c] += w * (float(self._rank_sums()[len(tokens) - 1]) - s.expected[c])
            s.rounds[c] += 1

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

    def observe_drafting(self, floor_ms: float, tree_ms: float) -> None:
        """A device's drafting ms per round (its OPEN's report) at the floor (no SLM pass) and with the SLM pass;
        each value 0 (unknown) or not finite is left out, the others averaged over devices (EMA)."""
        for name, value in (("draft_floor_ms", floor_ms), ("draft_tree_ms", tree_ms)):
            if value > 0 and math.isfinite(value):
                old = getattr(self.state, name)
                setattr(self.state, name, value if old == 0 else old + self.weight * (value - old))

    def observe_away(self, away_ms: float, rows: int) -> None:
        """A round of ``rows`` rows arrived ``away_ms`` after its session's previous reply was sent: the link's
        (and the device's host work's) share, the gap minus the drafting that many rows cost, updates ``link_ms``."""
        if not (away_ms >= 0 and math.isfinite(away_ms)):
            return
        sample = max(0.0, float(away_ms) - float(self.drafting_ms(np.asarray([rows]))[0]))
        w = self.weight if self.state.aways else 1.0
        self.state.link_ms += w * (sample - self.state.link_ms)
        self.state.aways += 1

    # ------------------------------------------------------------------------------------------------ the rule

    def size_class(self, rows: int) -> int:
        """The size class of a tree of ``rows`` rows: 0 (the chain, drafted without the SLM pass) at or below
        chain_rows, else 1 (the tree)."""
        return 0 if rows <= self.chain_rows else 1

    def yields(self) -> np.ndarray:
        """Per size class (float64 (2,)): tokens committed beyond the bonus per token the scores expected, as
        learned (module docstring), clamped to [0.05, 10]; the budget's value_scale for a class with no round yet
        (or whose scores expected nothing)."""
        s = self.state
        ok = (s.rounds > 0) & (s.expected > 1e-9)
        ratio = np.clip(s.committed / np.where(ok, s.expected, 1.0), 0.05, 10.0)
        return np.where(ok, ratio, self.budget.value_scale)

    def drafting_ms(self, rows: np.ndarray) -> np.ndarray:
        """The devices' drafting ms per round for trees of ``rows`` rows (int array): the floor's report at or below
        chain_rows (when reported), else the SLM pass's; 0 when nothing was reported."""
        s = self.state
        floor = s.draft_floor_ms if s.draft_floor_ms > 0 else s.draft_tree_ms
        return np.where(np.asarray(rows) <= self.chain_rows, floor, s.draft_tree_ms)

    def expected_tokens(self, rows: np.ndarray) -> np.ndarray:
        """V(r) for each r in ``rows`` (int array, each in [1, ceiling]): the learned expected tokens of a tree's
        r - 1 best non-root rows, times r's size class's yield (`yields`); ranks never seen count the last seen
        rank's value (float64, rows' shape)."""
        r = np.asarray(rows, np.int64)
        return self._rank_sums()[r - 1] * self.yields()[np.where(r <= self.chain_rows, 0, 1)]

    def _rank_sums(self) -> np.ndarray:
        """float64 (ceiling,): [i] the learned rank values' sum over the i best non-root rows (unscaled; ranks
        never seen count the last seen rank's value)."""
        values = self.state.rank_values
        seen = values[~np.isnan(values)]
        filled = np.where(np.isnan(values), seen[-1] if len(seen) else 0.0, values)
        return np.concatenate([[0.0], np.cumsum(filled)])

    def allowance(self, sessions: float | None = None) -> int:
        """Rows the next tree of a session may hold, in [floor, ceiling] (module docstring's rule). sessions: the
        load to size for (rounds per batched step; None: the learned average). Before any tree was seen, the
        ceiling (nothing to rank yet)."""
        n = self.state.sessions if sessions is None else float(sessions)
        s = self.state
        key = (n, s.trees, s.steps, s.aways, s.draft_floor_ms, s.draft_tree_ms, *s.rounds, *self._budget_key())
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1]  # every session of a step is granted at once: one computation per step
        rows = self._best_rows(n)
        self._memo = (key, rows)
        return rows

    def grant(self, sessions: float | None = None) -> int:
        """The rows one reply grants (`hycoc.verifier.draft_place.DraftPlace.allowance` asks once per reply):
        `allowance`, except under load, where every explore_every-th grant goes to the best r of the other size
        class while it has fewer than learn_rounds rounds, and every refresh_every-th after (module docstring: a
        class never granted would never learn its yield). Deterministic: counted in ``state.grants``."""
        rows = self.allowance(sessions)
        n = self.state.sessions if sessions is None else float(sessions)
        if not self._under_load(n):
            return rows
        s = self.state
        s.grants += 1
        other = 1 - self.size_class(rows)
        every = self.explore_every if s.rounds[other] < self.learn_rounds else self.refresh_every
        if every and s.grants % every == 0:
            return self._best_in_class(n, other) or rows
        return rows

    def _under_load(self, n: float) -> bool:
        """Whether ``n`` sessions per step put the rule past its low-load case (module docstring, 1.)."""
        return n > 1 and n * self.ceiling > self.free_rows and self.state.trees > 0

    def _best_in_class(self, n: float, size_class: int) -> int | None:
        """The r a grant explores ``size_class`` with at ``n`` sessions: the chain's best r, or the whole tree (the
        size the tree class's rounds mostly have); None when the class has no r in [floor, ceiling]."""
        if size_class == 1:
            return self.ceiling if self.ceiling > self.chain_rows else None
        rows, _, _, _, ratio = self._candidates(n)
        mine = rows <= self.chain_rows
        if not mine.any():
            return None
        return int(rows[mine][int(np.argmax(ratio[mine]))])

    def _candidates(self, n: float) -> tuple[np.ndarray, ...]:
        """(rows, tokens 1 + V(r), away ms, step ms, ratio) of every candidate r in [floor, ceiling] at ``n``
        sessions per step; a ratio is -inf where the step misses the target."""
        rows = np.arange(self.floor, self.ceiling + 1)
        step_ms = self.cost.ms(n * rows) + self.budget.overhead_ms * n
        away_ms = self.state.link_ms + self.drafting_ms(rows)
        tokens = 1.0 + self.expected_tokens(rows)
        ratio = tokens / np.maximum(away_ms + step_ms, 1e-9)
        if self.target_ms is not None:
            ratio = np.where(step_ms <= self.target_ms, ratio, -np.inf)
        return rows, tokens, away_ms, step_ms, ratio

    def _budget_key(self) -> tuple[float, float]:
        return self.budget.value_scale, self.budget.overhead_ms

    def _best_rows(self, n: float) -> int:
        if not self._under_load(n):
            return self.ceiling
        rows, _, _, _, ratio = self._candidates(n)
        if not np.isfinite(ratio).any():  # no candidate's step fits the target
            return self.floor
        return int(rows[int(np.argmax(ratio))])  # first maximum: the fewest rows for the best ratio

    def explain(self, sessions: float | None = None) -> dict:
        """What the rule weighs at ``sessions`` per step (None: the learned average), for a report (`hycoc
        capacity`'s projection, /healthz-style): the load, the learned link and drafting ms, the value scale,
        and per candidate r its expected tokens 1 + V(r), away ms, step ms and tokens per second of the round
        (None where the step misses the target); ``allowance``: what `allowance` grants there."""
        n = self.state.sessions if sessions is None else float(sessions)
        s = self.state
        out = {
            "sessions": n,
            "link_ms": s.link_ms,
            "drafting_ms": [s.draft_floor_ms, s.draft_tree_ms],
            "value_scale": self.budget.value_scale,
            "yields": dict(zip(CLASSES, (float(x) for x in self.yields()))),
            "yield_rounds": dict(zip(CLASSES, (int(x) for x in s.rounds))),
            "allowance": self.allowance(sessions),
        }
        if s.trees:
            rows, tokens, away, step, ratio = self._candidates(n)
            out["rows"] = [int(r) for r in rows]
            out["tokens"] = [float(x) for x in tokens]
            out["away_ms"] = [float(x) for x in away]
            out["step_ms"] = [float(x) for x in step]
            out["tokens_per_s"] = [float(1e3 * x) if np.isfinite(x) else None for x in ratio]
        return out


__all__ = ["ALLOWANCE_MODES", "CLASSES", "AllowanceRule", "AllowanceState"]
