"""The bench's quality flags control the family-wise error (hycoc/bench/paper/stats.py: Holm over a run's configurations
x metrics, one-sided sign-flip p-values; intervals from scipy's BCa bootstrap), checked by simulation: where nothing
differs, fewer than 5% of runs flag anything; a real degradation is flagged."""

from __future__ import annotations

import numpy as np
import pytest
from test_quality import record

from hycoc.bench.paper.summary import summarize

QUESTIONS = 12
CONFIGS = ("hyco", "specedge", "server-head")


def _answer(rng: np.random.Generator, difficulty: float, shift: float = 0.0) -> dict:
    """One answer's quality metrics, correlated as real ones are: a latent repetitiveness drives the zlib ratio,
    distinct-n, the repeated 4-gram share and the longest run; ``shift`` makes the answer more repetitive."""
    z = 0.6 * difficulty + rng.normal() + shift
    return {
        "compression_ratio": 0.5 - 0.05 * z + 0.02 * rng.normal(),
        "distinct_1": 0.6 - 0.06 * z + 0.03 * rng.normal(),
        "distinct_2": 0.9 - 0.05 * z + 0.03 * rng.normal(),
        "repeated_4gram_share": float(np.clip(0.2 + 0.08 * z + 0.05 * rng.normal(), 0.0, 1.0)),
        "longest_run": float(rng.poisson(np.exp(0.3 * z + 0.7)) + 1),
    }


def _run(rng: np.random.Generator, shift: dict[str, float] | None = None) -> list[dict]:
    """One bench run's records: the baseline and CONFIGS on QUESTIONS questions, answers drawn from one law
    (plus ``shift`` per configuration)."""
    shift = shift or {}
    records = []
    for q in range(QUESTIONS):
        difficulty = rng.normal()
        for config in ("cloud-mtp", *CONFIGS):
            records.append(record(config, q, quality=_answer(rng, difficulty, shift.get(config, 0.0))))
    return records


def _flagged(summary: dict) -> list[tuple[str, str]]:
    return [(name, key) for name, s in summary.items() for key in s["quality"]["worse_than_baseline"]]


def test_with_no_true_difference_fewer_than_5_percent_of_runs_flag_anything():
    """100 simulated runs of 3 configurations x 5 metrics (15 tests each) where every configuration's answers
    follow the baseline's law. The flags do not depend on the intervals (bootstrap=0 keeps this fast). On these
    runs the bench before Holm (a metric flagged when its own 95% CI excludes 0, bootstrap=200) flagged 38 of 100;
    without Holm's correction the p-values alone flag 33."""
    rng = np.random.default_rng(20261202)
    runs = 100
    flagged = sum(bool(_flagged(summarize(_run(rng), bootstrap=0))) for _ in range(runs))
    assert flagged / runs < 0.05, f"{flagged} of {runs} runs flagged a metric where nothing differs"


def test_a_real_degradation_is_flagged():
    """hyco's answers two latent standard deviations more repetitive (a per-question difference of 1.4 sd):
    flagged (on the zlib ratio and its kin) in most of 10 runs; the configurations that do not differ are
    flagged in at most 2 runs (the 5% family-wise error over the true nulls allows 0.5 of 10 on average; 3 or
    more has probability 1.2%)."""
    rng = np.random.default_rng(7)
    runs = [_flagged(summarize(_run(rng, {"hyco": 2.0}), bootstrap=0)) for _ in range(10)]
    assert sum(any(name == "hyco" for name, _ in f) for f in runs) >= 8
    assert sum(any(name != "hyco" for name, _ in f) for f in runs) <= 2


def test_holm_adjusts_as_the_step_down_definition():
    """Holm 1979 by hand: sorted p (0.005, 0.01, 0.03, 0.04) x (4, 3, 2, 1) = (0.02, 0.03, 0.06, 0.04), made
    monotone: (0.02, 0.03, 0.06, 0.06)."""
    from hycoc.bench.paper.stats import holm

    adjusted, rejected = holm([0.01, 0.04, 0.03, 0.005], alpha=0.05)
    assert adjusted == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert rejected == [True, False, False, True]
    assert holm([]) == ([], [])


def test_the_paired_interval_is_scipys_bca_over_questions():
    """paired_mean_difference's CI is scipy.stats.bootstrap's BCa interval of the mean per-question difference
    (one pair per question here), same resamples and seed."""
    from scipy.stats import bootstrap

    from hycoc.bench.paper.stats import paired_mean_difference

    rng = np.random.default_rng(3)
    a, b = rng.normal(size=15), rng.normal(size=15)
    pairs = [({"question_id": q, "v": a[q]}, {"question_id": q, "v": b[q]}) for q in range(15)]
    point, ci = paired_mean_difference(pairs, lambda r: r["v"], bootstrap=999, seed=5)
    ref = bootstrap((a - b,), np.mean, n_resamples=999, method="BCa", random_state=np.random.default_rng(5))
    assert point == pytest.approx(float(np.mean(a - b)))
    assert ci == pytest.approx([ref.confidence_interval.low, ref.confidence_interval.high], rel=1e-6)


def test_the_p_value_is_the_exact_sign_flip_test():
    """8 questions: every 2^8 sign pattern enumerated; differences (1, 2, ..., 8), all on the worse side: only
    the observed pattern reaches the observed sum, p = 1/256; one difference of -1 instead of +1: the patterns
    with a sum >= 34 of 36 are those flipping nothing or flipping the 1 alone, p = 2/256."""
    from hycoc.bench.paper.stats import paired_p_value

    def pairs(diffs):
        return [({"question_id": q, "v": d}, {"question_id": q, "v": 0.0}) for q, d in enumerate(diffs)]

    assert paired_p_value(pairs(range(1, 9)), lambda r: r["v"]) == pytest.approx(1 / 256)
    assert paired_p_value(pairs([-1, *range(2, 9)]), lambda r: r["v"]) == pytest.approx(2 / 256)
    assert paired_p_value(pairs(range(1, 9)), lambda r: r["v"], worse_sign=-1.0) == pytest.approx(1.0)


@pytest.mark.parametrize("n", [3, 7, 10])
def test_the_sign_flip_test_is_scipys_permutation_test(n):
    """sign_flip_p_value (exact below 2^n <= resamples) against scipy.stats.permutation_test's exact paired
    test on the same differences."""
    from scipy.stats import permutation_test

    from hycoc.bench.paper.stats import sign_flip_p_value

    rng = np.random.default_rng(n)
    for d in (rng.normal(0.3, 1.0, size=n), np.round(rng.normal(size=n)), np.ones(n)):
        ref = permutation_test(
            (d,),
            lambda x, axis=-1: x.sum(axis=axis),
            permutation_type="samples",
            vectorized=True,
            n_resamples=10_000,
            alternative="greater",
        )
        assert sign_flip_p_value(d) == pytest.approx(ref.pvalue)
