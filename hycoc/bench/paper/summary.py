"""
The summary of a `hycoc bench` run (paper §4, App. G; docs/benchmarks.md): the records of `hycoc.bench.paper.runner`
turned into the paper's metrics per configuration, as the typed `ConfigSummary` that ``results.json`` holds
(``dataclasses.asdict``; the types are `hycoc.bench.paper.summary_schema`'s). The statistics (pairing, BCa intervals,
p-values, Holm) are `hycoc.bench.paper.stats`; the tables `hycoc.bench.paper.report_tables`; the plots
`hycoc.bench.paper.plots`. Core module: numpy and scipy, no torch.

Record (one dict per request; times in milliseconds unless the name says seconds)::

    config            "hyco" | "hyco-exact" | "hyco-2p" | "specedge" | "specedge-eps" | "server-head"
                      | "cloud-mtp" | "slm-alone"
    run, question_id  int; a request is identified by (config, run, question_id)
    category          str (Spec-Bench category)
    tokens            output tokens, bonus tokens included
    rounds            verification rounds (slm-alone: one per token, no verifier)
    accepted          [int] |P| per round (tokens committed per round = accepted + 1)
    prefill_ms        verifier prefill ms (0 for slm-alone)
    server_busy_ms    float | None, CPU ms the verifier process used during the request (every thread: the
                      forwards and the work around them; `hycoc.bench.verifier_process.process_cpu_ms`); absent in old
                      records
    server_ms         [float] verifier ms per round (empty for slm-alone)
    rows              [int] rows of the verifier forward per round (B + 1 = 33 for device trees, 1 + K for cloud-mtp)
    context           [int] root position (context length) per round
    seconds           delivery time in seconds: request start to last token, link delays included
    first_token_ms    float | None;  draft_ms, slm_prefill_ms: device ms
    finished          bool; finish_reason "stop" (an end-of-turn token) | "max_new_tokens" (the output cap) |
                      "length" (the context is full) (`hycoc.protocol.messages.FINISH_REASONS`); absent in old records
    bytes_up, bytes_down   [int] frame bytes per round
    draft_calls, prefill_calls  {graph: int} graph calls inside draft_ms / slm_prefill_ms; draft_graph_ms,
                      slm_prefill_graph_ms: those calls' ms (the rest is host work); absent in old records
    bonus_outside_keep     int, bonus tokens outside the drafters' keep set
    verifier_logprob  float | None, the verifier's mean log-prob per output token of the answer: its own
                      likelihood of the text, which repetition raises (docs/benchmarks.md); never the quality
                      figure alone
    reference_match   bool | None, containment proxy (`hycoc.bench.paper.quality.reference_match`) where there is a
                      reference
    quality           {key: value} the answer's text metrics (`hycoc.bench.paper.quality.answer_metrics` and
                      `reference_metrics`: compression_ratio, repeated_4gram_share, distinct_1/2, longest_run,
                      rouge_l, chrf, bleu, final_number_match; None where undefined); absent in old records

Definitions (App. G; "pooled" = numerators and denominators summed over requests before dividing; with several
runs the pooled ratio is taken per run and the runs' ratios are averaged, as App. G does):

* g [ms / output token] = sum over requests of (prefill_ms + sum server_ms) / sum tokens. Verifier time on the
  hardware that ran it, prefill included. None for slm-alone (no verifier).
* g busy [ms / output token] = sum server_busy_ms / sum tokens: the verifier's busy time (its process's CPU time
  over each request, prefill included), which other processes on the machine do not stretch the way they stretch
  the wall-clock g; None when any request lacks it. Δg busy is its paired Δ, as Δg below.
* g_rounds [ms / output token] = sum server_ms / sum tokens: measured g over rounds only (prefill excluded), the
  figure to hold against g projected.
* g projected [ms / output token] = sum over every forward the server ran of cost_model.predict / sum tokens: the
  request replayed through a cost model measured on another device (`hycoc.bench.cost_model.model.request_forwards`):
  the prefill chunks, each round's verification forward, and the server-side head steps of cloud-mtp (K before each
  verification) and server-head (K after it). Prefill included, as in g, when the cost model has prefill points
  (``g_projected_includes_prefill``; a schema 1 file has none). None without a cost model and for slm-alone.
  g_projected_parts splits it by kind of forward (verify, head_step, prefill), ms per output token.
* server ms per round p50 = median over rounds of server_ms (measured; prefill excluded); its projected twin is the
  median over rounds of the round's projected forwards (verification + head steps), the figure the paper quotes
  per round (§3.1: 21.7 ms HyCo, 26.8 ms Cloud+MTP, `hycoc.bench.cost_model.model.PAPER_ROUND_MS`).
* Δg [%] = 100 * (g / g_baseline - 1), paired: computed on the requests of the configuration and of the baseline
  (cloud-mtp) matched by (question_id, run) -- or by question_id alone where the baseline ran that question in
  one run only -- each side pooled over the matched requests. Its 95% CI is a paired bootstrap over questions:
  resample question ids with replacement (the same ids for both sides), pooled ratio each time, BCa
  interval (`hycoc.bench.paper.stats.bootstrap_ci`). Negative is better (less verifier time per token than the
  baseline).
* MAT [tokens / round] = sum tokens / sum rounds (mean accepted tokens per verification round, bonus included).
* verifier forwards per token = sum rounds / sum tokens (prefill forward not counted). None for slm-alone.
* rows per forward = mean rows over rounds; mean context = mean root position over rounds.
* tok/s = sum tokens / sum seconds (delivery speed, link delays included).
* draft ms per token = sum draft_ms / sum tokens (device drafting time, waits and SLM prefill excluded).
* first token p50/p90 [ms] = median / 90th percentile (linear interpolation) over requests.
* bytes up/down per round = sum frame bytes / number of rounds with a frame.
* bonus outside keep share = sum bonus_outside_keep / sum rounds (one bonus token per round).

Quality (per configuration; means per category): every metric of `hycoc.bench.paper.quality.METRICS` (repetition of the
text itself, and ROUGE-L / chrF / BLEU / final-number exact match where Spec-Bench has references), its mean over
answers and its paired difference vs the baseline (mean over matched requests of config - baseline, paired
BCa bootstrap 95% CI over questions, as for Δg) with a one-sided p-value that the configuration is worse (sign-flip
permutation test, `hycoc.bench.paper.stats.paired_p_value`). A configuration is flagged for a metric when that p-value
survives Holm's correction over every (configuration, metric) test of the run (`flag_quality`): where no
configuration differs from the baseline, a run flags anything at most 5% of the time
(`hycoc.bench.paper.stats.FLAG_ALPHA`). The verifier's mean log-prob is kept under its own label (what it measures is
`hycoc.bench.paper.summary_schema.LOGPROB_NOTE`), and the reference-match rate over answers that have a reference.
No judge runs here.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from hycoc.bench.paper.quality import METRICS, metric_value
from hycoc.bench.paper.stats import (
    DEFAULT_BASELINE,
    FLAG_ALPHA,
    Record,
    _num,
    _seed_for,
    holm,
    mean,
    pair_records,
    paired_mean_difference,
    paired_p_value,
    paired_ratio_delta,
    pooled,
    table5_order,
)
from hycoc.bench.paper.summary_schema import CategorySummary, ConfigSummary, MetricQuality, QualitySummary
from hycoc.numerics import percentile
from hycoc.table5 import NO_VERIFIER

# ---- record arithmetic ---------------------------------------------------------------------------------------


def _tokens(r: Record) -> float:
    return float(r.get("tokens") or 0)


def _rounds(r: Record) -> float:
    return float(r.get("rounds") or 0)


def _server_cost(r: Record) -> float:
    """prefill_ms + sum server_ms: the verifier's time for one request (App. G)."""
    return float(r.get("prefill_ms") or 0.0) + float(sum(r.get("server_ms") or ()))


def _busy_cost(r: Record) -> float:
    """server_busy_ms: the verifier process's CPU ms over the request."""
    return float(r.get("server_busy_ms") or 0.0)


def _rounds_cost(r: Record) -> float:
    return float(sum(r.get("server_ms") or ()))


def _reference_rate(recs: Sequence[Record]) -> tuple[float | None, int]:
    v = [bool(r["reference_match"]) for r in recs if r.get("reference_match") is not None]
    return (_num(sum(v) / len(v)) if v else None), len(v)


def _logprob(r: Record) -> Any:
    return r.get("verifier_logprob")


def _ref_match(r: Record) -> float | None:
    return None if r.get("reference_match") is None else float(bool(r["reference_match"]))


class _Projection:
    """A record's forwards (`hycoc.bench.cost_model.model.request_forwards`) through ``cost_model``: ``total(r)`` ms of
    every forward, ``parts(r)`` {kind: ms}, ``rounds(r)`` [ms per round]. Predictions are cached per forward."""

    server: dict[str, Any]  # request_forwards' keyword arguments (ints, prefill a bool)
    _ms: dict[Any, float]  # Forward -> ms

    def __init__(self, cost_model: Any, server: dict[str, int] | None):
        self.model, self.server, self._ms = cost_model, dict(server or {}), {}
        # a model without prefill points (schema 1, or a hand-made stand-in) projects the rounds alone
        self.prefill = "prefill" in getattr(cost_model, "kinds", ("prefill",))
        self.server.setdefault("prefill", self.prefill)

    def _cost(self, f) -> float:
        if f not in self._ms:
            self._ms[f] = float(self.model.predict(f.rows, f.context, f.kind))
        return self._ms[f]

    def groups(self, r: Record):
        from hycoc.bench.cost_model.model import request_forwards

        return request_forwards(r, **self.server)

    def total(self, r: Record) -> float:
        return float(sum(self._cost(f) for g in self.groups(r) for f in g))

    def parts(self, r: Record) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for g in self.groups(r):
            for f in g:
                out[f.kind] += self._cost(f)
        return out

    def rounds(self, r: Record) -> list[float]:
        return [float(sum(self._cost(f) for f in g)) for g in self.groups(r)[1:]]

    def draws(
        self, records: Sequence[Record], n: int = 200, seed: int = 0, block: int = 4096
    ) -> dict[int, np.ndarray] | None:
        """id(record) -> float64 (n,): the record's `total` under n resampled grids of the cost model
        (`hycoc.bench.cost_model.model.bootstrap_tables`, its points' repeated timings). None when the model keeps no
        samples (an older file, a stand-in without points) or n < 1."""
        from hycoc.bench.cost_model.model import bootstrap_tables, predict_tables

        if n < 1 or not getattr(self.model, "points", None):
            return None
        tables = bootstrap_tables(self.model, n, seed)
        if tables is None:
            return None
        forwards, owner = [], []
        for k, r in enumerate(records):
            for g in self.groups(r):
                forwards += g
                owner += [k] * len(g)
        totals = np.zeros((n, len(records)))
        owner_a = np.asarray(owner, dtype=np.int64)
        for a in range(0, len(forwards), block):  # (n, block, grid) intermediates stay small
            ms = predict_tables(self.model, tables, forwards[a : a + block])
            for d in range(n):
                totals[d] += np.bincount(owner_a[a : a + block], weights=ms[d], minlength=len(records))
        return {id(r): totals[:, k] for k, r in enumerate(records)}


# ---- quality and its flags -----------------------------------------------------------------------------------


def quality_metrics(
    recs: Sequence[Record], pairs: Sequence[tuple[Record, Record]], *, bootstrap: int = 1000, seed: int = 0
) -> dict[str, MetricQuality]:
    """Per `hycoc.bench.paper.quality.METRICS` key, a `MetricQuality` without its flag: the mean over the answers of
    ``recs`` that have the metric (``record["quality"][key]``), `hycoc.bench.paper.stats.paired_mean_difference` over
    ``pairs`` (config - baseline, BCa 95% CI over questions) and the one-sided p-value that the configuration is
    worse (`hycoc.bench.paper.stats.paired_p_value`; None without a pair). `flag_quality` sets the flags over a whole
    run (Holm); a single configuration's p-values alone flag nothing."""
    out: dict[str, MetricQuality] = {}
    for m in METRICS:

        def value(r: Record, k: str = m.key) -> float | None:
            return metric_value(r.get("quality"), k)

        vals = [value(r) for r in recs]
        d, ci = paired_mean_difference(pairs, value, bootstrap=bootstrap, seed=_seed_for(seed, m.key))
        p = paired_p_value(pairs, value, worse_sign=m.worse(1.0), seed=_seed_for(seed, m.key, "p"))
        out[m.key] = MetricQuality(
            mean=mean(vals), n=sum(v is not None for v in vals), delta=d, delta_ci95=ci, p_worse=p
        )
    return out


def flag_quality(summary: dict[str, ConfigSummary], alpha: float = FLAG_ALPHA) -> int:
    """Flag the metrics worse than the baseline over the whole run: Holm's step-down (`hycoc.bench.paper.stats.holm`)
    over every (configuration, metric) p-value of ``summary`` at family-wise error ``alpha``. Sets each
    `MetricQuality`'s p_holm and worse_than_baseline and each `QualitySummary`'s worse_than_baseline and
    flag_tests; returns the family's size."""
    family = [
        (name, key) for name, s in summary.items() for key, m in s.quality.metrics.items() if m.p_worse is not None
    ]
    pvalues = [summary[n].quality.metrics[k].p_worse for n, k in family]
    adjusted, rejected = holm([p for p in pvalues if p is not None], alpha)  # every one: family has a p_worse
    for (name, key), p, flag in zip(family, adjusted, rejected):
        m = summary[name].quality.metrics[key]
        m.p_holm, m.worse_than_baseline = p, flag
    for s in summary.values():
        s.quality.worse_than_baseline = [k for k, m in s.quality.metrics.items() if m.worse_than_baseline]
        s.quality.flag_tests = len(family)
    return len(family)


def _quality(
    recs: Sequence[Record], qpairs: Sequence[tuple[Record, Record]], has_base: bool, *, bootstrap: int, seed: int
) -> QualitySummary:
    lp_d, lp_ci = paired_mean_difference(qpairs, _logprob, bootstrap=bootstrap, seed=_seed_for(seed, "lp"))
    rate, n_ref = _reference_rate(recs)
    return QualitySummary(
        metrics=quality_metrics(recs, qpairs, bootstrap=bootstrap, seed=_seed_for(seed, "quality")),
        verifier_logprob=mean(_logprob(r) for r in recs),
        verifier_logprob_delta=lp_d,
        verifier_logprob_delta_ci95=lp_ci,
        reference_match_rate=rate,
        reference_match_n=n_ref,
        reference_match_delta=paired_mean_difference(qpairs, _ref_match, bootstrap=0)[0],
        pairs=len(qpairs) if has_base else None,
    )


# ---- the summary -----------------------------------------------------------------------------------------------


def _verifier_cost(s: ConfigSummary, recs: Sequence[Record], proj: _Projection | None, base: Sequence[Record]) -> bool:
    """Fill the g fields of ``s``; returns whether the projection covers these records and the baseline's."""
    s.g_ms_per_token = pooled(recs, _server_cost, _tokens)
    runs = sorted({r.get("run", 0) for r in recs})
    s.g_runs = [pooled([r for r in recs if r.get("run", 0) == k], _server_cost, _tokens) for k in runs]
    s.g_rounds_ms_per_token = pooled(recs, _rounds_cost, _tokens)
    if all(_num(r.get("server_busy_ms")) is not None for r in recs):
        s.g_busy_ms_per_token = pooled(recs, _busy_cost, _tokens)
        s.g_busy_runs = [pooled([r for r in recs if r.get("run", 0) == k], _busy_cost, _tokens) for k in runs]
    round_ms = [float(x) for r in recs for x in (r.get("server_ms") or ())]
    s.server_ms_per_round_p50 = float(np.median(round_ms)) if round_ms else None
    if proj is None:
        return False
    s.g_projected_includes_prefill = proj.prefill
    try:
        s.g_projected_ms_per_token = pooled(recs, proj.total, _tokens)
        parts = [proj.parts(r) for r in recs]
        tokens = sum(_tokens(r) for r in recs)
        s.g_projected_parts = {
            k: (sum(p.get(k, 0.0) for p in parts) / tokens if tokens else None)
            for k in ("verify", "head_step", "prefill")
        }
        per_round = [x for r in recs for x in proj.rounds(r)]
        s.server_ms_per_round_projected_p50 = float(np.median(per_round)) if per_round else None
        for b in base:
            proj.total(b)  # the baseline must be projectable too before pairing on it
        return True
    except Exception as e:  # noqa: BLE001 -- a cost model outside its grid must not lose a finished run
        s.g_projected_error = f"{type(e).__name__}: {e}"
        return False


def _deltas(
    s: ConfigSummary,
    name: str,
    pairs: list[tuple[Record, Record]],
    proj: _Projection | None,
    proj_ok: bool,
    *,
    bootstrap: int,
    seed: int,
) -> None:
    """Fill the paired Δg fields of ``s`` (measured, projected, busy) from the matched ``pairs``."""
    s.delta_g_pct, s.delta_g_ci95 = paired_ratio_delta(
        pairs, _server_cost, bootstrap=bootstrap, seed=_seed_for(seed, name, "g")
    )
    if proj_ok and proj is not None:
        cost_draws = None
        if pairs and bootstrap > 0:
            draws = proj.draws(list({id(x): x for p in pairs for x in p}.values()), seed=seed)
            cost_draws = None if draws is None else (lambda r, d=draws: d[id(r)])
        s.delta_g_projected_pct, s.delta_g_projected_ci95 = paired_ratio_delta(
            pairs, proj.total, bootstrap=bootstrap, seed=_seed_for(seed, name, "g_projected"), cost_draws=cost_draws
        )
        s.delta_g_projected_ci_covers_cost_model = cost_draws is not None
    busy_pairs = [
        (r, b)
        for r, b in pairs
        if _num(r.get("server_busy_ms")) is not None and _num(b.get("server_busy_ms")) is not None
    ]
    if s.g_busy_ms_per_token is not None and busy_pairs and len(busy_pairs) == len(pairs):
        s.delta_g_busy_pct, s.delta_g_busy_ci95 = paired_ratio_delta(
            busy_pairs, _busy_cost, bootstrap=bootstrap, seed=_seed_for(seed, name, "g_busy")
        )


def _delivery(s: ConfigSummary, recs: Sequence[Record], verifier: bool) -> None:
    """Fill acceptance, forwards, delivery and device fields of ``s``."""
    s.mat = pooled(recs, _tokens, _rounds)
    s.tok_per_s = pooled(recs, _tokens, lambda r: float(r.get("seconds") or 0.0))
    s.draft_ms_per_token = pooled(recs, lambda r: float(r.get("draft_ms") or 0.0), _tokens)
    s.first_token_ms_p50 = percentile((r.get("first_token_ms") for r in recs), 50, empty=None)
    s.first_token_ms_p90 = percentile((r.get("first_token_ms") for r in recs), 90, empty=None)
    if not verifier:
        return
    s.verifier_forwards_per_token = pooled(recs, _rounds, _tokens)
    s.rows_per_forward = pooled(
        recs, lambda r: float(sum(r.get("rows") or ())), lambda r: float(len(r.get("rows") or ()))
    )
    s.mean_context = pooled(
        recs, lambda r: float(sum(r.get("context") or ())), lambda r: float(len(r.get("context") or ()))
    )
    s.bytes_up_per_round = pooled(
        recs, lambda r: float(sum(r.get("bytes_up") or ())), lambda r: float(len(r.get("bytes_up") or ()))
    )
    s.bytes_down_per_round = pooled(
        recs, lambda r: float(sum(r.get("bytes_down") or ())), lambda r: float(len(r.get("bytes_down") or ()))
    )
    s.bonus_outside_keep_share = pooled(recs, lambda r: float(r.get("bonus_outside_keep") or 0), _rounds)


def _categories(
    name: str,
    recs: Sequence[Record],
    pairs: Sequence[tuple[Record, Record]],
    qpairs: Sequence[tuple[Record, Record]],
    verifier: bool,
    *,
    bootstrap: int,
    seed: int,
) -> dict[str, CategorySummary]:
    cats: dict[str, CategorySummary] = {}
    for cat in sorted({str(r.get("category")) for r in recs}):
        crecs = [r for r in recs if str(r.get("category")) == cat]
        cpairs = [(r, b) for r, b in pairs if str(r.get("category")) == cat]
        cq = [(r, b) for r, b in qpairs if str(r.get("category")) == cat]
        d, ci = paired_ratio_delta(cpairs, _server_cost, bootstrap=bootstrap, seed=_seed_for(seed, name, "g", cat))
        cats[cat] = CategorySummary(
            requests=len(crecs),
            mat=pooled(crecs, _tokens, _rounds),
            g_ms_per_token=pooled(crecs, _server_cost, _tokens) if verifier else None,
            delta_g_pct=d,
            delta_g_ci95=ci,
            verifier_logprob=mean(_logprob(r) for r in crecs),
            verifier_logprob_delta=paired_mean_difference(cq, _logprob, bootstrap=0)[0],
            reference_match_rate=_reference_rate(crecs)[0],
            quality={m.key: mean(metric_value(r.get("quality"), m.key) for r in crecs) for m in METRICS},
        )
    return cats


def build_summary(
    records: Iterable[Record],
    *,
    baseline: str = DEFAULT_BASELINE,
    cost_model: Any = None,
    bootstrap: int = 1000,
    seed: int = 0,
    server: dict[str, int] | None = None,
) -> dict[str, ConfigSummary]:
    """The typed summary of a bench run: configuration name (Table 5 order) -> `ConfigSummary`.

    records: per-request records (module docstring). baseline: the configuration Δ figures are paired against
    (cloud-mtp); absent -> every delta field is None and nothing is flagged. cost_model: an object with
    ``predict(rows, context, kind) -> ms`` (`hycoc.bench.cost_model.model.CostModel`) or None; a prediction error (rows
    outside its grid, a kind it lacks) leaves the projected fields None and puts the message in
    ``g_projected_error``. server: keyword arguments of `hycoc.bench.cost_model.model.request_forwards`
    (``chain_length``, ``head_window``: the recipe's K and W, which the server-head replay needs). bootstrap:
    resamples for the CIs (0: no CI; the quality p-values are computed either way). seed: bootstrap seed (each
    configuration/metric/category gets its own stream derived from it)."""
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[str(r["config"])].append(r)
    base = groups.get(baseline) or []
    proj = _Projection(cost_model, server) if cost_model is not None else None

    out: dict[str, ConfigSummary] = {}
    for name in table5_order(groups):
        recs = groups[name]
        verifier = name not in NO_VERIFIER
        s = ConfigSummary(
            requests=len(recs),
            runs=len({r.get("run", 0) for r in recs}),
            unfinished=sum(1 for r in recs if r.get("finished") is False),
            finish_reasons=dict(
                sorted(Counter(str(r["finish_reason"]) for r in recs if r.get("finish_reason")).items())
            ),
            tokens=int(sum(_tokens(r) for r in recs)),
            rounds=int(sum(_rounds(r) for r in recs)),
        )
        proj_ok = _verifier_cost(s, recs, proj, base) if verifier else False

        # Δg vs the baseline, paired by question
        base_ok = bool(base) and verifier and baseline not in NO_VERIFIER
        pairs = pair_records(recs, base) if base_ok else []
        _deltas(s, name, pairs, proj, proj_ok, bootstrap=bootstrap, seed=seed)
        s.delta_pairs = len(pairs) if base_ok else None
        s.delta_questions = len({r.get("question_id") for r, _ in pairs}) if base_ok else None
        _delivery(s, recs, verifier)

        # quality: the text metrics of hycoc.bench.paper.quality, paired vs the baseline; the verifier's own log-prob
        qpairs = pair_records(recs, base) if base else []
        s.quality = _quality(recs, qpairs, bool(base), bootstrap=bootstrap, seed=_seed_for(seed, name))
        if name == baseline:
            for m in s.quality.metrics.values():
                m.p_worse = None  # the baseline against itself is no test
        s.per_category = _categories(name, recs, pairs, qpairs, verifier, bootstrap=bootstrap, seed=seed)
        out[name] = s
    flag_quality(out)
    return out


def summarize(records: Iterable[Record], **options: Any) -> dict[str, dict[str, Any]]:
    """`build_summary` as plain dicts (`ConfigSummary.to_dict`): what ``results.json``'s ``summary`` holds and
    the tables read. ``options``: `build_summary`'s keywords (baseline, cost_model, bootstrap, seed, server)."""
    return {name: s.to_dict() for name, s in build_summary(records, **options).items()}


__all__ = [
    "build_summary",
    "flag_quality",
    "quality_metrics",
    "summarize",
]
