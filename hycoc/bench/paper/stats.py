"""The statistics of `hycoc bench` (paper §4, App. G; docs/benchmarks.md): pairing a configuration's requests with
the baseline's, App. G pooling, paired bootstrap intervals, paired p-values and Holm's step-down correction.

`hycoc.bench.paper.runner` produces one *record* per request (its keys and units: `hycoc.bench.paper.summary`);
`hycoc.bench.paper.summary` builds the run's summary from them with the functions here;
`hycoc.bench.paper.report_tables` prints it and `hycoc.bench.paper.plots` draws it. Core module: numpy and scipy, no
torch.

Methods (each from scipy, the reference implementation):

* Intervals: `bootstrap_ci`, scipy.stats.bootstrap with ``method="BCa"`` (bias-corrected and accelerated; Efron
  1987) and ``paired=True``: the resampling unit is the question, the same question ids for the configuration and
  the baseline. At 10-20 questions BCa covers better than the percentile interval (scipy docs, "bootstrap").
  Where BCa is undefined (every resample gives the same value, or fewer than 2 questions) the interval is the
  percentile one, [x, x] for degenerate data, or None. One documented exception: `paired_ratio_delta` with
  ``cost_draws`` (the projected Δg whose cost model carries its own repeated timings) pairs resample b with cost
  draw b, which scipy's bootstrap cannot do; it uses the percentile interval of that joint resampling.
* p-values: `paired_p_value`, the one-sided sign-flip permutation test of the paired mean difference (under "no
  difference" each question's configuration and baseline answers are exchangeable, so the sign of its difference
  is a coin): scipy.stats.permutation_test's ``permutation_type="samples"`` test, vectorised in
  `sign_flip_p_value` (a test compares the two). Exact when the 2^n sign patterns fit in the resamples, else
  Monte Carlo with (k + 1) / (R + 1), which stays valid.
* Family-wise error: `holm` (Holm 1979, "A simple sequentially rejective multiple test procedure"): the quality
  flags of a run test every (configuration, metric) pair at once and flag those whose Holm-adjusted p-value is
  below `FLAG_ALPHA`, so the chance that a run flags anything where nothing differs is at most `FLAG_ALPHA`.
"""

from __future__ import annotations

import math
import warnings
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from hycoc.table5 import TABLE5_ORDER

#: Table 5 order of the configurations (`hycoc.table5`); configurations not listed follow, sorted by name.
DEFAULT_BASELINE = "cloud-mtp"
#: Family-wise error rate of the quality flags (Holm over a run's metrics and configurations).
FLAG_ALPHA = 0.05
#: Resamples of the sign-flip permutation test (exact below 2^12 questions' sign patterns); the smallest
#: p-value it can give is 1 / (PERMUTATIONS + 1), below Holm's FLAG_ALPHA / m for m up to 250 tests.
PERMUTATIONS = 4999
#: How the flags and intervals are made, as the table footers name it.
FLAG_METHOD = (
    f"flags: one-sided sign-flip permutation test per metric, Holm-corrected over every configuration "
    f"x metric of the run (family-wise error {FLAG_ALPHA:.0%}); intervals: paired BCa bootstrap over "
    f"questions"
)

Record = Mapping[str, Any]


# ---- small helpers ------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """A finite Python float, or None (None, NaN, inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _seed_for(seed: int, *names: str) -> int:
    """A deterministic per-(config, metric, category) seed, independent of dict order."""
    return (seed * 1_000_003 + zlib.crc32("\x1f".join(names).encode())) % (2**32)


def table5_order(names: Iterable[str]) -> list[str]:
    """``names`` in `TABLE5_ORDER`, the others after them sorted by name."""
    names = set(names)
    return [n for n in TABLE5_ORDER if n in names] + sorted(names - set(TABLE5_ORDER))


_order = table5_order  # the name the bench modules import


def pooled(recs: Sequence[Record], num: Callable[[Record], float], den: Callable[[Record], float]) -> float | None:
    """App. G pooling: sum(num) / sum(den) per run, then the mean over runs with a non-zero denominator."""
    by_run: dict[Any, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in recs:
        acc = by_run[r.get("run", 0)]
        acc[0] += num(r)
        acc[1] += den(r)
    ratios = [n / d for n, d in by_run.values() if d]
    return _num(float(np.mean(ratios))) if ratios else None


def mean(values: Iterable[Any]) -> float | None:
    """The mean of the finite values, None when there are none."""
    v = [float(x) for x in values if _num(x) is not None]
    return _num(float(np.mean(v))) if v else None


# ---- pairing --------------------------------------------------------------------------------------------------


def pair_records(recs: Sequence[Record], base: Sequence[Record]) -> list[tuple[Record, Record]]:
    """Match each request of a configuration with the baseline's request on the same question.

    Key (question_id, turn, run) (turn 1 where a record has none; a second turn pairs with the baseline's second
    turn); where the baseline has no request in that run but ran the question's turn in exactly one run,
    that request is used (the paper's Cloud+ ran once, HyCo three times). Unmatched requests are left out.
    """
    by_key = {(b.get("question_id"), b.get("turn", 1), b.get("run", 0)): b for b in base}
    by_q: dict[Any, list[Record]] = defaultdict(list)
    for rec in base:
        by_q[(rec.get("question_id"), rec.get("turn", 1))].append(rec)
    pairs = []
    for r in recs:
        q = (r.get("question_id"), r.get("turn", 1))
        b = by_key.get((*q, r.get("run", 0)))
        if b is None and len(by_q.get(q, ())) == 1:
            b = by_q[q][0]
        if b is not None:
            pairs.append((r, b))
    return pairs


def _per_question(
    pairs: Sequence[tuple[Record, Record]], fns: Sequence[Callable[[Record, Record], float]]
) -> np.ndarray:
    """(questions, len(fns)) sums of fn(record, baseline record) over each question's matched pairs."""
    rows: dict[Any, np.ndarray] = {}
    for r, b in pairs:
        acc = rows.setdefault(r.get("question_id"), np.zeros(len(fns)))
        acc += [f(r, b) for f in fns]
    return np.array(list(rows.values()), dtype=np.float64).reshape(len(rows), len(fns))


# ---- intervals ------------------------------------------------------------------------------------------------


def bootstrap_ci(
    table: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    resamples: int = 1000,
    seed: int = 0,
    level: float = 0.95,
) -> list[float] | None:
    """Paired BCa bootstrap interval of ``statistic`` over the rows (questions) of ``table``.

    table: float64 (questions, columns), one row per question (e.g. the configuration's and the baseline's sums).
    statistic: (..., questions, columns) -> (...) reduces over the question axis (the second to last), e.g. a
    ratio of column sums. Returns [lo, hi] from scipy.stats.bootstrap (``method="BCa"``, ``paired=True``, the
    columns resampled together, ``resamples`` draws, ``seed``); where BCa is undefined (degenerate data) the
    percentile interval; None for resamples < 1, fewer than 2 questions or no finite resample."""
    from scipy.stats import bootstrap

    if resamples < 1 or len(table) < 2:
        return None
    cols = tuple(np.ascontiguousarray(table[:, j]) for j in range(table.shape[1]))

    def stat(*columns: np.ndarray, axis: int = -1) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return statistic(np.stack([np.moveaxis(c, axis, -1) for c in columns], axis=-1))

    for method in ("BCa", "percentile"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # scipy's DegenerateDataWarning: handled by the fallback below
            res = bootstrap(
                cols,
                stat,
                n_resamples=resamples,
                paired=True,
                vectorized=True,
                method=method,
                confidence_level=level,
                random_state=np.random.default_rng(seed),
            )
        lo, hi = _num(res.confidence_interval.low), _num(res.confidence_interval.high)
        if lo is not None and hi is not None:
            return [lo, hi]
        dist = np.asarray(res.bootstrap_distribution)
        dist = dist[np.isfinite(dist)]
        if dist.size and np.ptp(dist) == 0.0:  # every resample the same value: the interval is that point
            return [float(dist[0]), float(dist[0])]
    return None


def _ratio_delta(s: np.ndarray) -> np.ndarray:
    """Δ% of column sums (cost, tokens, cost_b, tokens_b) over the question axis (-2)."""
    t = s.sum(axis=-2)
    with np.errstate(divide="ignore", invalid="ignore"):
        return 100.0 * ((t[..., 0] / t[..., 1]) / (t[..., 2] / t[..., 3]) - 1.0)


def paired_ratio_delta(
    pairs: Sequence[tuple[Record, Record]],
    cost: Callable[[Record], float],
    tokens: Callable[[Record], float] | None = None,
    *,
    bootstrap: int = 1000,
    seed: int = 0,
    cost_draws: Callable[[Record], np.ndarray] | None = None,
) -> tuple[float | None, list[float] | None]:
    """Δ% = 100 * ((Σ cost / Σ tokens) / (Σ cost_b / Σ tokens_b) - 1) over matched pairs, with a paired
    bootstrap 95% CI over questions (`bootstrap_ci`, BCa; None where the point estimate is undefined or
    bootstrap == 0). tokens: record -> output tokens (default ``record["tokens"]``).

    cost_draws: record -> float64 (M,) its cost under M draws of an uncertain cost (the cost model's resampled
    grids, `hycoc.bench.paper.summary`). Then resample b uses draw b mod M for both sides, so the interval covers the
    choice of questions and the cost's own uncertainty together; that joint resampling is outside scipy's
    bootstrap, and its interval is the percentile one (2.5 / 97.5 %)."""
    if not pairs:
        return None, None
    tokens = tokens or (lambda r: float(r.get("tokens") or 0))
    fns = [lambda r, b: cost(r), lambda r, b: tokens(r), lambda r, b: cost(b), lambda r, b: tokens(b)]
    t = _per_question(pairs, fns)
    point = _num(float(_ratio_delta(t)))
    if point is None:
        return None, None
    if bootstrap <= 0:
        return point, None
    if cost_draws is None:
        return point, bootstrap_ci(t, _ratio_delta, resamples=bootstrap, seed=seed)
    per_q: dict[Any, np.ndarray] = {}
    for r, b in pairs:  # the question order of _per_question
        d = np.stack([np.asarray(cost_draws(r), np.float64), np.asarray(cost_draws(b), np.float64)], axis=-1)
        per_q[r.get("question_id")] = per_q.get(r.get("question_id"), 0.0) + d
    draws = np.stack(list(per_q.values()), axis=1)  # (M, questions, 2)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(t), size=(bootstrap, len(t)))  # questions drawn with replacement
    m = draws[np.arange(bootstrap) % draws.shape[0]]  # (bootstrap, questions, 2)
    rows = np.take_along_axis(m, idx[..., None], axis=1)  # (bootstrap, questions, 2)
    sample = np.stack([rows[..., 0], t[idx, 1], rows[..., 1], t[idx, 3]], axis=-1)
    dist = _ratio_delta(sample)
    dist = dist[np.isfinite(dist)]
    if dist.size == 0:
        return point, None
    lo, hi = np.percentile(dist, [2.5, 97.5])
    return point, [float(lo), float(hi)]


def _mean_diff(s: np.ndarray) -> np.ndarray:
    """Σ differences / Σ pairs over the question axis (-2) of (difference sum, pair count) rows."""
    t = s.sum(axis=-2)
    return t[..., 0] / t[..., 1]


def _difference_table(pairs: Sequence[tuple[Record, Record]], value: Callable[[Record], Any]) -> np.ndarray:
    """(questions, 2): per question the sum of value(config) - value(baseline) over its pairs where both are
    defined, and the number of those pairs."""
    pairs = [(r, b) for r, b in pairs if _num(value(r)) is not None and _num(value(b)) is not None]
    return _per_question(pairs, [lambda r, b: float(value(r)) - float(value(b)), lambda r, b: 1.0])


def paired_mean_difference(
    pairs: Sequence[tuple[Record, Record]], value: Callable[[Record], Any], *, bootstrap: int = 1000, seed: int = 0
) -> tuple[float | None, list[float] | None]:
    """Mean over matched pairs of value(config) - value(baseline) (pairs where either is None are left out),
    with a paired bootstrap 95% CI over questions (`bootstrap_ci`, BCa)."""
    t = _difference_table(pairs, value)
    if not len(t):
        return None, None
    return _num(float(_mean_diff(t))), bootstrap_ci(t, _mean_diff, resamples=bootstrap, seed=seed)


# ---- p-values and the family-wise correction -----------------------------------------------------------------


def sign_flip_p_value(diffs: np.ndarray, *, resamples: int = PERMUTATIONS, seed: int = 0) -> float:
    """One-sided p-value of the sign-flip permutation test that the mean of ``diffs`` is > 0.

    diffs: float64 (n,) one paired difference (or per-question sum) per exchangeable unit. Null: each unit's sign
    is a fair coin. Statistic: sum(diffs). Exact (every one of the 2^n sign patterns, p = share with a sum >= the
    observed one) when 2^n <= resamples; else ``resamples`` random patterns and p = (k + 1) / (resamples + 1),
    k counting those >= the observed sum. The same test as scipy.stats.permutation_test with
    ``permutation_type="samples"``, ``alternative="greater"`` (a test checks the two agree), written out here
    because scipy enumerates the exact patterns in Python, too slow for the bench's hundreds of tests."""
    d = np.asarray(diffs, dtype=np.float64)
    n = len(d)
    observed = d.sum()
    tol = 1e-12 * max(1.0, float(np.abs(d).sum()))  # scipy's relative tolerance for ties of the statistic
    if n == 0:
        return 1.0
    if 2**n <= resamples:
        signs = 1.0 - 2.0 * ((np.arange(2**n)[:, None] >> np.arange(n)) & 1)  # (2^n, n) every pattern
        return float(np.mean(signs @ d >= observed - tol))
    rng = np.random.default_rng(seed)
    signs = rng.choice(np.array([-1.0, 1.0]), size=(resamples, n))
    return float((np.sum(signs @ d >= observed - tol) + 1) / (resamples + 1))


def paired_p_value(
    pairs: Sequence[tuple[Record, Record]],
    value: Callable[[Record], Any],
    *,
    worse_sign: float = 1.0,
    resamples: int = PERMUTATIONS,
    seed: int = 0,
) -> float | None:
    """One-sided p-value that the configuration is worse than the baseline on ``value``.

    The statistic is the paired difference of `paired_mean_difference` summed per question and turned by
    ``worse_sign`` (+1 when a higher value is worse, -1 when lower is worse); the null is "each question's
    answers are exchangeable", tested by flipping the sign of each question's summed difference
    (`sign_flip_p_value`). None without a pair; 1.0 when every difference is 0."""
    t = _difference_table(pairs, value)
    if not len(t):
        return None
    diffs = worse_sign * t[:, 0]
    if not np.any(diffs):
        return 1.0
    return sign_flip_p_value(diffs, resamples=resamples, seed=seed)


def holm(pvalues: Sequence[float], alpha: float = FLAG_ALPHA) -> tuple[list[float], list[bool]]:
    """Holm's step-down correction (Holm 1979): adjusted p-values and which hypotheses are rejected.

    Sort the m p-values ascending, p_(1) <= ... <= p_(m); the adjusted value of the i-th is
    max_{j <= i} min(1, (m - j + 1) p_(j)), and a hypothesis is rejected when its adjusted value is <= alpha
    (equivalently: reject while p_(i) <= alpha / (m - i + 1), stop at the first that is not). Controls the
    family-wise error rate at alpha under any dependence. Returns lists in the input order."""
    p = np.asarray(pvalues, dtype=np.float64)
    m = len(p)
    if m == 0:
        return [], []
    order = np.argsort(p, kind="stable")
    adj_sorted = np.maximum.accumulate(np.minimum(1.0, (m - np.arange(m)) * p[order]))
    adjusted = np.empty(m)
    adjusted[order] = adj_sorted
    return [float(x) for x in adjusted], [bool(x <= alpha) for x in adjusted]
