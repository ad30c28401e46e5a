"""The typed summary of a `hycoc bench` run (`hycoc.bench.paper.summary.build_summary`): per configuration a
`ConfigSummary`, with its answers' quality (`QualitySummary`, one `MetricQuality` per metric) and its categories
(`CategorySummary`); ``results.json``'s ``summary`` is these as plain dicts (``dataclasses.asdict``). The keys,
definitions and units are `hycoc.bench.paper.summary`'s module docstring. Core module: no torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from hycoc.bench.paper.stats import FLAG_METHOD

#: What the verifier's mean log-prob of an answer measures (docs/benchmarks.md, "Benchmark"): repetition raises it, so
#: it is reported under this label and never as the quality figure on its own.
LOGPROB_NOTE = "the verifier's own likelihood of the answer (repetitive text scores higher); not a quality measure"


# ---- the typed summary ----------------------------------------------------------------------------------------


@dataclass
class MetricQuality:
    """One quality metric of one configuration (`hycoc.bench.paper.quality.METRICS`).

    mean: over the configuration's answers that have it (bools as 0/1), n of them. delta, delta_ci95: mean paired
    difference config - baseline and its paired BCa 95% CI over questions. p_worse: one-sided p-value that the
    configuration is worse (`hycoc.bench.paper.stats.paired_p_value`); p_holm: that p-value Holm-adjusted over the run's
    family (every configuration x metric with a p-value); worse_than_baseline: p_holm <= FLAG_ALPHA."""

    mean: float | None = None
    n: int = 0
    delta: float | None = None
    delta_ci95: list[float] | None = None
    p_worse: float | None = None
    p_holm: float | None = None
    worse_than_baseline: bool = False


@dataclass
class QualitySummary:
    """A configuration's answer quality: metrics {key: MetricQuality}; worse_than_baseline: the keys flagged;
    flag_method: how (`hycoc.bench.paper.stats.FLAG_METHOD`) and flag_tests: the size of the Holm family; the
    verifier's mean log-prob and its paired Δ (`LOGPROB_NOTE`); the reference-match rate over answers with a
    reference (n of them) and its paired Δ; pairs: matched requests (None without a baseline)."""

    metrics: dict[str, MetricQuality] = field(default_factory=dict)
    worse_than_baseline: list[str] = field(default_factory=list)
    flag_method: str = FLAG_METHOD
    flag_tests: int = 0
    verifier_logprob: float | None = None
    verifier_logprob_delta: float | None = None
    verifier_logprob_delta_ci95: list[float] | None = None
    verifier_logprob_is: str = LOGPROB_NOTE
    reference_match_rate: float | None = None
    reference_match_n: int = 0
    reference_match_delta: float | None = None
    pairs: int | None = None


@dataclass
class CategorySummary:
    """One Spec-Bench category of a configuration: requests, MAT, g, paired Δg % [95% CI] on the category's
    questions, the verifier's mean log-prob and its paired Δ, the reference-match rate, quality {key: mean}."""

    requests: int = 0
    mat: float | None = None
    g_ms_per_token: float | None = None
    delta_g_pct: float | None = None
    delta_g_ci95: list[float] | None = None
    verifier_logprob: float | None = None
    verifier_logprob_delta: float | None = None
    reference_match_rate: float | None = None
    quality: dict[str, float | None] = field(default_factory=dict)


@dataclass
class ConfigSummary:
    """One configuration of a bench run; definitions and units in the module docstring (None where undefined).

    Counts: requests, runs, unfinished, finish_reasons {reason: requests}, tokens, rounds. Verifier cost:
    g_ms_per_token, g_runs (per run), g_rounds_ms_per_token, g_busy_ms_per_token, g_busy_runs (None without
    server_busy_ms), g_projected_ms_per_token (every server forward; prefill included when
    g_projected_includes_prefill), g_projected_parts {verify, head_step, prefill: ms per output token},
    g_projected_error, server_ms_per_round_p50, server_ms_per_round_projected_p50. Paired Δ vs the baseline
    (% with 95% CI): delta_g_*, delta_g_projected_* (delta_g_projected_ci_covers_cost_model: the interval also
    resamples the cost model's timings), delta_g_busy_*; delta_pairs, delta_questions behind them. Acceptance and
    delivery: mat, verifier_forwards_per_token, rows_per_forward, mean_context, tok_per_s, draft_ms_per_token,
    first_token_ms_p50/p90, bytes_up/down_per_round, bonus_outside_keep_share. quality: `QualitySummary`;
    per_category {category: `CategorySummary`}."""

    requests: int = 0
    runs: int = 0
    unfinished: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    rounds: int = 0
    g_ms_per_token: float | None = None
    g_runs: list[float | None] | None = None
    g_rounds_ms_per_token: float | None = None
    g_busy_ms_per_token: float | None = None
    g_busy_runs: list[float | None] | None = None
    g_projected_ms_per_token: float | None = None
    g_projected_parts: dict[str, float | None] | None = None
    g_projected_error: str | None = None
    g_projected_includes_prefill: bool | None = None
    server_ms_per_round_p50: float | None = None
    server_ms_per_round_projected_p50: float | None = None
    delta_g_pct: float | None = None
    delta_g_ci95: list[float] | None = None
    delta_g_projected_pct: float | None = None
    delta_g_projected_ci95: list[float] | None = None
    delta_g_projected_ci_covers_cost_model: bool | None = None
    delta_g_busy_pct: float | None = None
    delta_g_busy_ci95: list[float] | None = None
    delta_pairs: int | None = None
    delta_questions: int | None = None
    mat: float | None = None
    verifier_forwards_per_token: float | None = None
    rows_per_forward: float | None = None
    mean_context: float | None = None
    tok_per_s: float | None = None
    draft_ms_per_token: float | None = None
    first_token_ms_p50: float | None = None
    first_token_ms_p90: float | None = None
    bytes_up_per_round: float | None = None
    bytes_down_per_round: float | None = None
    bonus_outside_keep_share: float | None = None
    quality: QualitySummary = field(default_factory=QualitySummary)
    per_category: dict[str, CategorySummary] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """Plain ints, floats, strs, lists, dicts and None (``dataclasses.asdict``), ready for json.dumps."""
        return asdict(self)


__all__ = ["LOGPROB_NOTE", "CategorySummary", "ConfigSummary", "MetricQuality", "QualitySummary"]
