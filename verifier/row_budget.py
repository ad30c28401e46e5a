"""Budgeted verification rows: which rows of the trees sharing one batched forward the verifier checks.

Why. A batched forward's cost grows with its rows once it is past the point where rows are free (on this CPU from
the first row; on an H200 past its bf16 ridge point, ~206 rows), while most of a draft tree's expected acceptance
sits in few rows: each node's tree score s(v) (Alg. 3 lines 6, 13: s(child) = s(parent) + log q + ln λ, the
chain's nodes s(parent) + ln λ) is about the log of the chance that the verifier accepts the path to it (§3.1:
chain acceptance ~0.66 per depth), so exp(s(v)) is the tokens row v is expected to add. SpecEdge, vLLM and SGLang
verify each request's draft as sent; hycoc, when several sessions' rounds share a forward, keeps the rows that
buy the most expected tokens per millisecond of forward.

The rule (`allocate`), for one step's trees (each as its scores, or None for a tree sent without scores: a
protocol-3 client, a cloud-mtp round drafted on the server, which are kept whole):

1. Every scored tree keeps its ``min_rows`` best rows (the root and its first chain token at least: the root
   carries the bonus token, the first chain token is the likeliest accepted one). Padding rows (a repeat of the
   row before it, Alg. 3 line 17) are worth nothing.
2. The other rows of all trees are ranked by s(v), highest first (ties: the lower row of the same tree first, so
   a parent, whose row is lower and score no lower, always precedes its child: every prefix of the ranking is an
   ancestor-closed subtree of each tree, as Alg. 4's acceptance needs).
3. The step keeps the prefix that maximizes expected committed tokens per forward millisecond,
   (sessions + sum of exp(s) over kept non-root rows) / cost(rows), cost from the `RowCost` line; never fewer than
   ``free_rows`` rows in all (a forward of one full tree, or the cost line's flat part, is never trimmed: one
   session alone is verified as sent).

Acceptance then runs on each tree's kept rows exactly as on a smaller tree (`hycoc.verifier.engine.Session`
``restrict_round``): which rows are kept depends on the drafts' scores only, never on the verifier's samples, so
exact acceptance stays lossless and the ε rule keeps its meaning. The reply names the verified rows
(`hycoc.protocol.messages.RoundReply.verified`), so the device walks only those.

Core module: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hycoc.serving_limits import TREE_BUDGETS  # the one list, torch-free: verify-server checks it first

#: Rows every scored tree keeps: the root and its first chain token.
DEFAULT_MIN_ROWS = 2


class RowCostError(ValueError):
    """A row-cost line that cannot be used (fewer than two points, rows not increasing, a negative or non-finite
    millisecond). The message names the point and the fix."""


@dataclass(frozen=True)
class RowCost:
    """Milliseconds of one batched verification forward as a function of its rows: a piecewise-linear line
    through measured points (rows increasing, ms >= 0), held flat below the first point and extended with the last
    segment's slope (clamped >= 0) beyond the last.

    points: ((rows, ms), ...), at least two. source: where they came from (measured here, the recipe), for
    /healthz and the loadtest's report.
    """

    points: tuple[tuple[int, float], ...]
    source: str = ""

    def __post_init__(self):
        if len(self.points) < 2:
            raise RowCostError(
                f"row cost needs at least two (rows, ms) points, got {list(self.points)}: give "
                "verifier.row_cost as [[rows, ms], [rows, ms], ...] or leave it empty to measure"
            )
        rows = [int(r) for r, _ in self.points]
        for (r, ms), prev in zip(self.points, [None, *rows[:-1]]):
            if not (math.isfinite(float(ms)) and float(ms) >= 0):
                raise RowCostError(f"row cost point ({r}, {ms}): ms must be finite and >= 0")
            if int(r) < 1 or (prev is not None and int(r) <= prev):
                raise RowCostError(f"row cost point ({r}, {ms}): rows must be >= 1 and increasing")

    def ms(self, rows) -> np.ndarray:
        """Forward milliseconds for ``rows`` (int or int array); float64 array of the same shape."""
        r = np.asarray([p[0] for p in self.points], np.float64)
        m = np.asarray([p[1] for p in self.points], np.float64)
        x = np.asarray(rows, np.float64)
        out = np.interp(x, r, m)
        slope = max(0.0, (m[-1] - m[-2]) / (r[-1] - r[-2]))
        return np.where(x > r[-1], m[-1] + slope * (x - r[-1]), out)

    def flat_rows(self, tolerance: float = 0.05) -> int:
        """Rows up to which a forward costs no more than (1 + tolerance) x the first point's: the line's flat part
        (a GPU below its ridge point; on a CPU the first point's rows)."""
        first = self.points[0][1]
        flat = self.points[0][0]
        for r, m in self.points[1:]:
            if m > first * (1 + tolerance):
                break
            flat = r
        return int(flat)


def monotone_scores(scores, parents) -> np.ndarray:
    """Scores made non-increasing from parent to child, s'(v) = min(s(v), s'(parent)) (float64 (R,)): what the
    wire guarantees already (``bad_scores``); applied again so a ranking by score is always ancestor-closed."""
    s = np.asarray(scores, np.float64).copy()
    p = np.asarray(parents, np.int64)
    for j in range(1, len(s)):
        if s[j] > s[p[j]]:
            s[j] = s[p[j]]
    return s


def row_values(scores: np.ndarray, tokens: np.ndarray, parents: np.ndarray) -> np.ndarray:
    """Expected tokens each row adds if verified: exp(s(v)) for rows 1.., 0 for the root (its bonus is counted per
    session) and for padding rows (a row equal to the one before it in token and parent). float64 (R,)."""
    s = np.asarray(scores, np.float64)
    v = np.exp(np.minimum(s, 0.0))
    v[0] = 0.0
    tokens, parents = np.asarray(tokens), np.asarray(parents)
    if len(v) > 1:
        dup = np.zeros(len(v), bool)
        dup[1:] = (tokens[1:] == tokens[:-1]) & (parents[1:] == parents[:-1])
        v[dup] = 0.0
    return v


@dataclass(frozen=True)
class Allocation:
    """What `allocate` chose for one step. kept: per tree, the kept row indices (int64, increasing, row 0 first)
    or None (the whole tree). rows_before / rows_after: the step's rows as sent / kept. expected_tokens: sessions
    + sum of exp(s) over kept non-root rows of scored trees (unscored trees count 1 each). trimmed: rows left
    out."""

    kept: list
    rows_before: int
    rows_after: int
    expected_tokens: float
    sessions: int = 0

    @property
    def trimmed(self) -> int:
        return self.rows_before - self.rows_after


def allocate(
    trees: list[tuple[np.ndarray | None, np.ndarray, np.ndarray]],
    cost: RowCost,
    *,
    free_rows: int,
    min_rows: int = DEFAULT_MIN_ROWS,
    extra_ms: float = 0.0,
    value_scale: float = 1.0,
) -> Allocation:
    """The rows of one step (module docstring's rule).

    trees: per session (scores float (R,) or None, tokens int (R,), parents int (R,)), a valid tree each
    (parents[0] == -1, parents[j] < j) whose scores never rise from parent to child (the wire checks it:
    ``bad_scores``). cost: the forward's `RowCost`. free_rows: rows a step may keep without trimming (>= 1).
    min_rows: rows every scored tree keeps (>= 1; 2 = root and first chain token). extra_ms: the step's
    milliseconds outside the forward (per-session host work: p~, acceptance, compaction, hand-off), added to
    cost(rows). value_scale: accepted tokens per expected token (`BudgetState`), multiplying every exp(s).
    Returns an `Allocation` (its expected tokens scaled too). Raises ValueError for min_rows < 1 or free_rows < 1.
    """
    if min_rows < 1:
        raise ValueError(f"min_rows = {min_rows}: must be >= 1 (the root is always verified)")
    if free_rows < 1:
        raise ValueError(f"free_rows = {free_rows}: must be >= 1")
    total = sum(len(t) for _, t, _ in trees)
    n = len(trees)
    fixed_rows, fixed_value = 0, float(n)
    forced: list[np.ndarray] = []
    cand_value, cand_tree, cand_row, cand_score = [], [], [], []
    for i, (scores, tokens, parents) in enumerate(trees):
        if scores is None:
            fixed_rows += len(tokens)
            forced.append(np.arange(len(tokens)))
            continue
        scores = monotone_scores(scores, parents)
        values = row_values(scores, tokens, parents) * float(value_scale)
        scores = np.where((values == 0) & (np.arange(len(scores)) > 0), -np.inf, scores)  # padding ranks last
        # rank within the tree: score descending, then row ascending (a parent before its child)
        order = np.lexsort((np.arange(len(scores)), -scores))
        order = np.concatenate([[0], order[order != 0]])
        k = min(min_rows, len(order))
        forced.append(np.sort(order[:k]))
        fixed_rows += k
        fixed_value += float(values[order[:k]].sum())
        rest = order[k:]
        cand_value.append(values[rest])
        cand_tree.append(np.full(len(rest), i))
        cand_row.append(rest)
        cand_score.append(scores[rest])
    if total <= free_rows or not cand_row:
        return Allocation([None] * n, total, total, fixed_value + sum(float(v.sum()) for v in cand_value), n)
    value = np.concatenate(cand_value)
    tree_of = np.concatenate(cand_tree)
    row_of = np.concatenate(cand_row)
    score = np.concatenate(cand_score)
    # global ranking: score descending, then tree, then row (keeps each tree's own order)
    order = np.lexsort((row_of, tree_of, -score))
    gain = np.concatenate([[0.0], np.cumsum(value[order])])
    rows = fixed_rows + np.arange(len(order) + 1)
    ratio = (fixed_value + gain) / np.maximum(cost.ms(rows) + float(extra_ms), 1e-9)
    best = int(np.argmax(ratio))  # first maximum: fewest rows for the best ratio
    best = max(best, min(len(order), free_rows - fixed_rows))  # never below the free rows
    chosen = order[:best]
    kept: list = []
    for i in range(n):
        extra = row_of[chosen[tree_of[chosen] == i]]
        rows_i = np.union1d(forced[i], extra).astype(np.int64)
        kept.append(None if len(rows_i) == len(trees[i][1]) else rows_i)
    after = fixed_rows + best
    return Allocation(kept, total, after, fixed_value + float(gain[best]), n)


class BudgetState:
    """What a budgeted server learns from the steps it runs, so the rule's two numbers are its own:

    overhead_ms: the step's milliseconds outside the forward per session (exponential moving average of
    (step ms - forward ms) / sessions; 0 before the first step), so a row is weighed against the whole step's
    cost, not the forward's alone. value_scale: tokens accepted per token expected (EMA of the ratio of the
    sums over each step's scored sessions; 1 before), so scores that over- or under-state acceptance are
    corrected (exp(s) is an estimate, §3.1). Clamped to [0.05, 2]. ``weight``: the EMA's weight of a new step.
    """

    def __init__(self, weight: float = 0.1):
        if not 0 < weight <= 1:
            raise ValueError(f"weight = {weight}: must lie in (0, 1]")
        self.weight = float(weight)
        self.overhead_ms = 0.0
        self.value_scale = 1.0
        self.steps = 0

    def observe(
        self, step_ms: float, forward_ms: float, sessions: int, accepted: float | None, expected: float | None
    ) -> None:
        """One batched step: its total and forward milliseconds, its sessions, and over its scored sessions the
        path tokens accepted (committed minus bonus) and the kept rows' expected tokens (None: not known)."""
        if sessions < 1:
            return
        w = self.weight if self.steps else 1.0
        self.overhead_ms += w * (max(0.0, step_ms - forward_ms) / sessions - self.overhead_ms)
        if accepted is not None and expected:
            ratio = min(2.0, max(0.05, accepted / expected))
            self.value_scale += w * (ratio - self.value_scale)
        self.steps += 1


@dataclass
class RowBudget:
    """A batch-level row budget (`allocate`'s arguments): cost, the forward's `RowCost`; free_rows, rows a forward
    keeps without trimming; min_rows, rows each scored tree keeps; state, what the steps so far taught it
    (`BudgetState`: host ms per session, accepted per expected token), updated by every budgeted step
    (`observe_step`);
    learn=False keeps it at its priors (tests). The server's batched step (`hycoc.verifier.batch.verify_batch`) and
    `hycoc capacity`'s simulated one (hycoc/bench/capacity/simulation.py) both choose and learn through it."""

    cost: RowCost
    free_rows: int
    min_rows: int = DEFAULT_MIN_ROWS
    state: BudgetState = field(default_factory=BudgetState)
    learn: bool = True

    def choose(self, trees: list) -> Allocation:
        """`allocate` of one step's ``trees`` with this budget's cost, free and minimum rows, and what the state
        learned: the step's host ms outside the forward (``overhead_ms`` per tree) and ``value_scale``."""
        return allocate(
            trees,
            self.cost,
            free_rows=self.free_rows,
            min_rows=self.min_rows,
            extra_ms=self.state.overhead_ms * len(trees),
            value_scale=self.state.value_scale,
        )

    def observe_step(
        self, step_ms: float, forward_ms: float, sessions: int, accepted: float | None, expected_tokens: float
    ) -> None:
        """Teach the state one budgeted step (`BudgetState.observe`): its whole and forward ms, its sessions, the
        path tokens accepted over its scored sessions (None: not known) and the `Allocation`'s expected tokens,
        which `choose` scaled by value_scale (so they are compared unscaled, as the scores' own)."""
        self.state.observe(
            step_ms, forward_ms, sessions, accepted, (expected_tokens - sessions) / self.state.value_scale
        )


def is_ancestor_closed(parents: np.ndarray, rows: np.ndarray) -> bool:
    """Whether ``rows`` (indices into a tree with ``parents``) contain row 0 and every kept row's parent."""
    keep = np.zeros(len(parents), bool)
    keep[np.asarray(rows, np.int64)] = True
    if not keep[0]:
        return False
    p = np.asarray(parents, np.int64)
    idx = np.nonzero(keep)[0]
    idx = idx[idx > 0]
    return bool(keep[p[idx]].all())


__all__ = [
    "DEFAULT_MIN_ROWS",
    "TREE_BUDGETS",
    "Allocation",
    "BudgetState",
    "RowBudget",
    "RowCost",
    "RowCostError",
    "allocate",
    "is_ancestor_closed",
    "monotone_scores",
    "row_values",
]
