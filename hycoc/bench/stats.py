"""Statistics, terminal tables, results.json summary and plots of `hycoc bench` (paper §4, App. G; docs/benchmarks.md).

`hycoc.bench.runner` runs the requests and produces one *record* per request; this module turns the records into the
paper's metrics. Core module: numpy only at import time (rich and matplotlib are imported inside the functions
that draw), no torch.

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
                      forwards and the work around them; `hycoc.bench.runner.process_cpu_ms`); absent in old records
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
    reference_match   bool | None, containment proxy (`hycoc.bench.quality.reference_match`) where there is a reference
    quality           {key: value} the answer's text metrics (`hycoc.bench.quality.answer_metrics` and
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
  request replayed through a cost model measured on another device (`hycoc.bench.cost_model.request_forwards`):
  the prefill chunks, each round's verification forward, and the server-side head steps of cloud-mtp (K before each
  verification) and server-head (K after it). Prefill included, as in g, when the cost model has prefill points
  (``g_projected_includes_prefill``; a schema 1 file has none). None without a cost model and for slm-alone. g_projected_parts splits it by kind of forward (verify, head_step, prefill), ms per output token.
* server ms per round p50 = median over rounds of server_ms (measured; prefill excluded); its projected twin is the
  median over rounds of the round's projected forwards (verification + head steps), the figure the paper quotes
  per round (§3.1: 21.7 ms HyCo, 26.8 ms Cloud+MTP, `hycoc.bench.cost_model.PAPER_ROUND_MS`).
* Δg [%] = 100 * (g / g_baseline - 1), paired: computed on the requests of the configuration and of the baseline
  (cloud-mtp) matched by (question_id, run) -- or by question_id alone where the baseline ran that question in
  one run only -- each side pooled over the matched requests. Its 95% CI is a paired bootstrap over questions:
  resample question ids with replacement (the same ids for both sides), pooled ratio each time, 2.5/97.5
  percentiles. Negative is better (less verifier time per token than the baseline).
* MAT [tokens / round] = sum tokens / sum rounds (mean accepted tokens per verification round, bonus included).
* verifier forwards per token = sum rounds / sum tokens (prefill forward not counted). None for slm-alone.
* rows per forward = mean rows over rounds; mean context = mean root position over rounds.
* tok/s = sum tokens / sum seconds (delivery speed, link delays included).
* draft ms per token = sum draft_ms / sum tokens (device drafting time, waits and SLM prefill excluded).
* first token p50/p90 [ms] = median / 90th percentile (linear interpolation) over requests.
* bytes up/down per round = sum frame bytes / number of rounds with a frame.
* bonus outside keep share = sum bonus_outside_keep / sum rounds (one bonus token per round).

Quality (per configuration; means per category): every metric of `hycoc.bench.quality.METRICS` (repetition of the
text itself, and ROUGE-L / chrF / BLEU / final-number exact match where Spec-Bench has references), its mean over
answers and its paired difference vs the baseline (mean over matched requests of config - baseline, paired
bootstrap 95% CI over questions, as for Δg); a configuration is flagged for a metric when that whole CI lies on
the metric's worse side (`quality_metrics`). The verifier's mean log-prob is kept under its own label (what it
measures is `LOGPROB_NOTE`), and the reference-match rate over answers that have a reference. No judge runs here.
"""

from __future__ import annotations

import math
import os
import tempfile
import zlib
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from hycoc.bench.quality import METRIC_BY_KEY, METRICS, metric_value, reference_match

#: Table 5 order of the configurations; configurations not listed follow, sorted by name.
TABLE5_ORDER = ("cloud-mtp", "specedge", "specedge-eps", "hyco", "hyco-2p", "hyco-exact", "server-head", "slm-alone")
#: Configurations without a verifier: no g, no forwards, no bytes.
NO_VERIFIER = frozenset({"slm-alone"})
DEFAULT_BASELINE = "cloud-mtp"

Record = Mapping[str, Any]


# ---- small helpers ------------------------------------------------------------------------------------------


def _num(x: Any) -> float | None:
    """A finite Python float, or None (None, NaN, inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def _div(a: float, b: float) -> float | None:
    return _num(a / b) if b else None


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


def _seed_for(seed: int, *names: str) -> int:
    """A deterministic per-(config, metric, category) seed, independent of dict order."""
    return (seed * 1_000_003 + zlib.crc32("\x1f".join(names).encode())) % (2**32)


def _order(names: Iterable[str]) -> list[str]:
    names = set(names)
    return [n for n in TABLE5_ORDER if n in names] + sorted(names - set(TABLE5_ORDER))


def _pooled(recs: Sequence[Record], num: Callable[[Record], float], den: Callable[[Record], float]) -> float | None:
    """App. G pooling: sum(num) / sum(den) per run, then the mean over runs with a non-zero denominator."""
    by_run: dict[Any, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for r in recs:
        acc = by_run[r.get("run", 0)]
        acc[0] += num(r)
        acc[1] += den(r)
    ratios = [n / d for n, d in by_run.values() if d]
    return _num(float(np.mean(ratios))) if ratios else None


def _percentile(values: Iterable[Any], q: float) -> float | None:
    v = [float(x) for x in values if _num(x) is not None]
    return _num(float(np.percentile(v, q))) if v else None


def _mean(values: Iterable[Any]) -> float | None:
    v = [float(x) for x in values if _num(x) is not None]
    return _num(float(np.mean(v))) if v else None


def _has_verifier(name: str, recs: Sequence[Record]) -> bool:
    return name not in NO_VERIFIER


# ---- pairing and the paired bootstrap ---------------------------------------------------------------------


def pair_records(recs: Sequence[Record], base: Sequence[Record]) -> list[tuple[Record, Record]]:
    """Match each request of a configuration with the baseline's request on the same question.

    Key (question_id, turn, run) (turn 1 where a record has none; a second turn pairs with the baseline's second
    turn); where the baseline has no request in that run but ran the question's turn in exactly one run,
    that request is used (the paper's Cloud+ ran once, HyCo three times). Unmatched requests are left out.
    """
    by_key = {(b.get("question_id"), b.get("turn", 1), b.get("run", 0)): b for b in base}
    by_q: dict[Any, list[Record]] = defaultdict(list)
    for b in base:
        by_q[(b.get("question_id"), b.get("turn", 1))].append(b)
    pairs = []
    for r in recs:
        q = (r.get("question_id"), r.get("turn", 1))
        b = by_key.get((*q, r.get("run", 0)))
        if b is None and len(by_q.get(q, ())) == 1:
            b = by_q[q][0]
        if b is not None:
            pairs.append((r, b))
    return pairs


def _per_question(pairs: Sequence[tuple[Record, Record]], fns: Sequence[Callable[[Record, Record], float]]
                  ) -> np.ndarray:
    """(questions, len(fns)) sums of fn(record, baseline record) over each question's matched pairs."""
    rows: dict[Any, np.ndarray] = {}
    for r, b in pairs:
        acc = rows.setdefault(r.get("question_id"), np.zeros(len(fns)))
        acc += [f(r, b) for f in fns]
    return np.array(list(rows.values()), dtype=np.float64).reshape(len(rows), len(fns))


def _bootstrap_counts(questions: int, bootstrap: int, seed: int) -> np.ndarray | None:
    """(bootstrap, questions) how often each question is drawn in each resample with replacement."""
    if bootstrap <= 0 or questions == 0:
        return None
    rng = np.random.default_rng(seed)
    counts = np.zeros((bootstrap, questions))
    idx = rng.integers(0, questions, size=(bootstrap, questions))
    np.add.at(counts, (np.arange(bootstrap)[:, None], idx), 1.0)
    return counts


def _bootstrap_sums(table: np.ndarray, bootstrap: int, seed: int) -> np.ndarray | None:
    """(bootstrap, columns) column sums over questions resampled with replacement (same ids for every column)."""
    counts = _bootstrap_counts(len(table), bootstrap, seed)
    return None if counts is None else counts @ table


def _ci(samples: np.ndarray) -> list[float] | None:
    samples = samples[np.isfinite(samples)]
    if samples.size == 0:
        return None
    lo, hi = np.percentile(samples, [2.5, 97.5])
    return [float(lo), float(hi)]


def paired_ratio_delta(pairs: Sequence[tuple[Record, Record]], cost: Callable[[Record], float],
                       tokens: Callable[[Record], float] = _tokens, *, bootstrap: int = 1000, seed: int = 0,
                       cost_draws: Callable[[Record], np.ndarray] | None = None
                       ) -> tuple[float | None, list[float] | None]:
    """Δ% = 100 * ((Σ cost / Σ tokens) / (Σ cost_b / Σ tokens_b) - 1) over matched pairs, with a paired
    bootstrap 95% CI over questions (None where the point estimate is undefined or bootstrap == 0).

    cost_draws: record -> float64 (M,) its cost under M draws of an uncertain cost (`_Projection.draws`: the cost
    model's resampled grids). Resample b then uses draw b mod M for both sides, so the interval covers the choice
    of questions and the cost's own uncertainty together."""
    if not pairs:
        return None, None
    fns = [lambda r, b: cost(r), lambda r, b: tokens(r), lambda r, b: cost(b), lambda r, b: tokens(b)]
    t = _per_question(pairs, fns)

    def delta(s: np.ndarray) -> np.ndarray:
        with np.errstate(divide="ignore", invalid="ignore"):
            return 100.0 * ((s[..., 0] / s[..., 1]) / (s[..., 2] / s[..., 3]) - 1.0)

    point = _num(float(delta(t.sum(axis=0))))
    if point is None:
        return None, None
    counts = _bootstrap_counts(len(t), bootstrap, seed)
    if counts is None:
        return point, None
    sums = counts @ t
    if cost_draws is not None:
        per_q: dict[Any, np.ndarray] = {}
        for r, b in pairs:   # the question order of _per_question
            d = np.stack([np.asarray(cost_draws(r), np.float64), np.asarray(cost_draws(b), np.float64)], axis=-1)
            per_q[r.get("question_id")] = per_q.get(r.get("question_id"), 0.0) + d
        draws = np.stack(list(per_q.values()), axis=1)                  # (M, questions, 2)
        m = draws[np.arange(bootstrap) % draws.shape[0]]               # (bootstrap, questions, 2)
        sums[:, 0] = np.einsum("bq,bq->b", counts, m[..., 0])
        sums[:, 2] = np.einsum("bq,bq->b", counts, m[..., 1])
    return point, _ci(delta(sums))


def paired_mean_difference(pairs: Sequence[tuple[Record, Record]], value: Callable[[Record], Any], *,
                           bootstrap: int = 1000, seed: int = 0) -> tuple[float | None, list[float] | None]:
    """Mean over matched pairs of value(config) - value(baseline) (pairs where either is None are left out),
    with a paired bootstrap 95% CI over questions."""
    pairs = [(r, b) for r, b in pairs if _num(value(r)) is not None and _num(value(b)) is not None]
    if not pairs:
        return None, None
    t = _per_question(pairs, [lambda r, b: float(value(r)) - float(value(b)), lambda r, b: 1.0])
    point = _num(float(t[:, 0].sum() / t[:, 1].sum()))
    sums = _bootstrap_sums(t, bootstrap, seed)
    return point, (None if sums is None else _ci(sums[:, 0] / sums[:, 1]))


# ---- summary ------------------------------------------------------------------------------------------------


class _Projection:
    """A record's forwards (`hycoc.bench.cost_model.request_forwards`) through ``cost_model``: ``total(r)`` ms of
    every forward, ``parts(r)`` {kind: ms}, ``rounds(r)`` [ms per round]. Predictions are cached per forward."""

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
        from hycoc.bench.cost_model import request_forwards

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

    def draws(self, records: Sequence[Record], n: int = 200, seed: int = 0, block: int = 4096
              ) -> dict[int, np.ndarray] | None:
        """id(record) -> float64 (n,): the record's `total` under n resampled grids of the cost model
        (`hycoc.bench.cost_model.bootstrap_tables`, its points' repeated timings). None when the model keeps no
        samples (an older file, a stand-in without points) or n < 1."""
        from hycoc.bench.cost_model import bootstrap_tables, predict_tables

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
        for a in range(0, len(forwards), block):   # (n, block, grid) intermediates stay small
            ms = predict_tables(self.model, tables, forwards[a:a + block])
            for d in range(n):
                totals[d] += np.bincount(owner_a[a:a + block], weights=ms[d], minlength=len(records))
        return {id(r): totals[:, k] for k, r in enumerate(records)}


def _reference_rate(recs: Sequence[Record]) -> tuple[float | None, int]:
    v = [bool(r["reference_match"]) for r in recs if r.get("reference_match") is not None]
    return (_num(sum(v) / len(v)) if v else None), len(v)


#: What the verifier's mean log-prob of an answer measures (docs/benchmarks.md, "Benchmark"): repetition raises it, so
#: it is reported under this label and never as the quality figure on its own.
LOGPROB_NOTE = "the verifier's own likelihood of the answer (repetitive text scores higher); not a quality measure"


def quality_metrics(recs: Sequence[Record], pairs: Sequence[tuple[Record, Record]], *, bootstrap: int = 1000,
                    seed: int = 0) -> dict[str, dict[str, Any]]:
    """Per `hycoc.bench.quality.METRICS` key: ``{mean, n, delta, delta_ci95, worse_than_baseline}``.

    mean: over the answers of ``recs`` that have the metric (``record["quality"][key]``, bools as 0/1), n of them.
    delta, delta_ci95: `paired_mean_difference` over ``pairs`` (config - baseline), paired bootstrap 95% CI over
    questions. worse_than_baseline: True when the whole CI lies on the metric's worse side (below 0 for a metric
    where higher is better, above 0 where lower is better), i.e. worse beyond its CI; False otherwise (no CI
    included)."""
    out: dict[str, dict[str, Any]] = {}
    for m in METRICS:
        value = lambda r, k=m.key: metric_value(r.get("quality"), k)  # noqa: E731
        vals = [value(r) for r in recs]
        d, ci = paired_mean_difference(pairs, value, bootstrap=bootstrap, seed=_seed_for(seed, m.key))
        out[m.key] = {"mean": _mean(vals), "n": sum(v is not None for v in vals), "delta": d, "delta_ci95": ci,
                      "worse_than_baseline": bool(ci) and m.worse(ci[0]) > 0 and m.worse(ci[1]) > 0}
    return out


def summarize(records: Iterable[Record], *, baseline: str = DEFAULT_BASELINE, cost_model: Any = None,
              bootstrap: int = 1000, seed: int = 0, server: dict[str, int] | None = None) -> dict[str, dict[str, Any]]:
    """The summary of a bench run: configuration name -> metrics (definitions and units in the module docstring).

    records: per-request records (module docstring). baseline: the configuration Δ figures are paired against
    (cloud-mtp); absent -> every delta field is None. cost_model: an object with ``predict(rows, context, kind) ->
    ms`` (`hycoc.bench.cost_model.CostModel`) or None; a prediction error (rows outside its grid, a kind it lacks)
    leaves the projected fields None and puts the message in ``g_projected_error``. server: keyword arguments of
    `hycoc.bench.cost_model.request_forwards` (``chain_length``, ``head_window``: the recipe's K and W, which the
    server-head replay needs). bootstrap: resamples for the CIs (0: no CI).
    seed: bootstrap seed (each configuration/metric/category gets its own stream derived from it).

    Keys per configuration (None where undefined):
      requests, runs, unfinished, finish_reasons {reason: requests}, tokens, rounds;
      g_ms_per_token, g_runs (per-run g), g_busy_ms_per_token, g_busy_runs, delta_g_busy_pct,
      delta_g_busy_ci95 (busy time, None without server_busy_ms), g_rounds_ms_per_token, g_projected_ms_per_token (every server forward,
      prefill included where the model has prefill points: g_projected_includes_prefill), g_projected_parts
      {verify, head_step, prefill: ms per output token}, g_projected_error;
      server_ms_per_round_p50, server_ms_per_round_projected_p50 (verification + head steps);
      delta_g_pct, delta_g_ci95 [lo, hi], delta_g_projected_pct, delta_g_projected_ci95 (over questions and,
      where the cost model keeps its repeated timings, its own uncertainty: delta_g_projected_ci_covers_cost_model),
      delta_pairs,
      delta_questions (matched requests / questions behind the Δ figures);
      mat, verifier_forwards_per_token, rows_per_forward, mean_context, tok_per_s, draft_ms_per_token,
      first_token_ms_p50, first_token_ms_p90, bytes_up_per_round, bytes_down_per_round, bonus_outside_keep_share;
      per_category {category: {requests, mat, g_ms_per_token, delta_g_pct, delta_g_ci95, verifier_logprob,
      verifier_logprob_delta, reference_match_rate, quality {metric key: mean}}};
      quality {metrics (`quality_metrics`), worse_than_baseline [metric keys flagged], verifier_logprob,
      verifier_logprob_delta, verifier_logprob_delta_ci95, verifier_logprob_is (`LOGPROB_NOTE`),
      reference_match_rate, reference_match_n, reference_match_delta, pairs}.
    Every value is a plain int/float/str/list/dict/None, ready for json.dumps.
    """
    groups: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        groups[str(r["config"])].append(r)
    base = groups.get(baseline) or []
    proj = _Projection(cost_model, server) if cost_model is not None else None
    projected = proj.total if proj is not None else None

    out: dict[str, dict[str, Any]] = {}
    for name in _order(groups):
        recs = groups[name]
        verifier = _has_verifier(name, recs)
        s: dict[str, Any] = {"requests": len(recs), "runs": len({r.get("run", 0) for r in recs}),
                             "unfinished": sum(1 for r in recs if r.get("finished") is False),
                             "finish_reasons": dict(sorted(Counter(str(r["finish_reason"]) for r in recs
                                                                   if r.get("finish_reason")).items())),
                             "tokens": int(sum(_tokens(r) for r in recs)),
                             "rounds": int(sum(_rounds(r) for r in recs))}

        # verifier cost
        s["g_ms_per_token"] = _pooled(recs, _server_cost, _tokens) if verifier else None
        runs = sorted({r.get("run", 0) for r in recs})
        s["g_runs"] = ([_pooled([r for r in recs if r.get("run", 0) == k], _server_cost, _tokens) for k in runs]
                       if verifier else None)
        s["g_rounds_ms_per_token"] = _pooled(recs, _rounds_cost, _tokens) if verifier else None
        busy_known = verifier and all(_num(r.get("server_busy_ms")) is not None for r in recs)
        s["g_busy_ms_per_token"] = _pooled(recs, _busy_cost, _tokens) if busy_known else None
        s["g_busy_runs"] = ([_pooled([r for r in recs if r.get("run", 0) == k], _busy_cost, _tokens) for k in runs]
                            if busy_known else None)
        s["g_projected_ms_per_token"], s["g_projected_parts"], s["g_projected_error"] = None, None, None
        s["g_projected_includes_prefill"] = proj.prefill if verifier and proj is not None else None
        round_ms = [float(x) for r in recs for x in (r.get("server_ms") or ())]
        s["server_ms_per_round_p50"] = float(np.median(round_ms)) if verifier and round_ms else None
        s["server_ms_per_round_projected_p50"] = None
        proj_ok = False
        if verifier and proj is not None:
            try:
                s["g_projected_ms_per_token"] = _pooled(recs, projected, _tokens)
                parts = [proj.parts(r) for r in recs]
                tokens = sum(_tokens(r) for r in recs)
                s["g_projected_parts"] = {k: (sum(p.get(k, 0.0) for p in parts) / tokens if tokens else None)
                                          for k in ("verify", "head_step", "prefill")}
                per_round = [x for r in recs for x in proj.rounds(r)]
                s["server_ms_per_round_projected_p50"] = float(np.median(per_round)) if per_round else None
                if base:
                    for b in base:
                        projected(b)  # the baseline must be projectable too before pairing on it
                proj_ok = True
            except Exception as e:  # noqa: BLE001 -- a cost model outside its grid must not lose a finished run
                s["g_projected_error"] = f"{type(e).__name__}: {e}"

        # Δg vs the baseline, paired by question
        base_ok = bool(base) and verifier and _has_verifier(baseline, base)
        pairs = pair_records(recs, base) if base_ok else []
        s["delta_g_pct"], s["delta_g_ci95"] = paired_ratio_delta(
            pairs, _server_cost, bootstrap=bootstrap, seed=_seed_for(seed, name, "g"))
        cost_draws = None
        if proj_ok and pairs and bootstrap > 0:
            draws = proj.draws(list({id(x): x for p in pairs for x in p}.values()), seed=seed)
            cost_draws = None if draws is None else (lambda r, d=draws: d[id(r)])
        s["delta_g_projected_pct"], s["delta_g_projected_ci95"] = (paired_ratio_delta(
            pairs, projected, bootstrap=bootstrap, seed=_seed_for(seed, name, "g_projected"), cost_draws=cost_draws)
            if proj_ok and projected is not None else (None, None))
        s["delta_g_projected_ci_covers_cost_model"] = cost_draws is not None if proj_ok else None
        busy_pairs = [(r, b) for r, b in pairs if _num(r.get("server_busy_ms")) is not None
                      and _num(b.get("server_busy_ms")) is not None]
        s["delta_g_busy_pct"], s["delta_g_busy_ci95"] = (paired_ratio_delta(
            busy_pairs, _busy_cost, bootstrap=bootstrap, seed=_seed_for(seed, name, "g_busy"))
            if busy_known and busy_pairs and len(busy_pairs) == len(pairs) else (None, None))
        s["delta_pairs"] = len(pairs) if base_ok else None
        s["delta_questions"] = len({r.get("question_id") for r, _ in pairs}) if base_ok else None

        # acceptance and forwards
        s["mat"] = _pooled(recs, _tokens, _rounds)
        s["verifier_forwards_per_token"] = _pooled(recs, _rounds, _tokens) if verifier else None
        rows_n = lambda r: float(len(r.get("rows") or ()))  # noqa: E731
        ctx_n = lambda r: float(len(r.get("context") or ()))  # noqa: E731
        s["rows_per_forward"] = _pooled(recs, lambda r: float(sum(r.get("rows") or ())), rows_n) if verifier else None
        s["mean_context"] = _pooled(recs, lambda r: float(sum(r.get("context") or ())), ctx_n) if verifier else None

        # delivery and device
        s["tok_per_s"] = _pooled(recs, _tokens, lambda r: float(r.get("seconds") or 0.0))
        s["draft_ms_per_token"] = _pooled(recs, lambda r: float(r.get("draft_ms") or 0.0), _tokens)
        s["first_token_ms_p50"] = _percentile((r.get("first_token_ms") for r in recs), 50)
        s["first_token_ms_p90"] = _percentile((r.get("first_token_ms") for r in recs), 90)
        for side in ("up", "down"):
            key = f"bytes_{side}"
            s[f"bytes_{side}_per_round"] = (_pooled(recs, lambda r, k=key: float(sum(r.get(k) or ())),
                                                    lambda r, k=key: float(len(r.get(k) or ())))
                                            if verifier else None)
        s["bonus_outside_keep_share"] = (_pooled(recs, lambda r: float(r.get("bonus_outside_keep") or 0), _rounds)
                                         if verifier else None)

        # quality: the text metrics of hycoc.bench.quality, paired vs the baseline; the verifier's own log-prob
        lp = lambda r: r.get("verifier_logprob")  # noqa: E731
        rm = lambda r: None if r.get("reference_match") is None else float(bool(r["reference_match"]))  # noqa: E731
        qpairs = pair_records(recs, base) if base else []
        lp_d, lp_ci = paired_mean_difference(qpairs, lp, bootstrap=bootstrap, seed=_seed_for(seed, name, "lp"))
        rate, n_ref = _reference_rate(recs)
        metrics = quality_metrics(recs, qpairs, bootstrap=bootstrap, seed=_seed_for(seed, name, "quality"))
        s["quality"] = {"metrics": metrics,
                        "worse_than_baseline": [k for k, v in metrics.items() if v["worse_than_baseline"]],
                        "verifier_logprob": _mean(lp(r) for r in recs),
                        "verifier_logprob_delta": lp_d, "verifier_logprob_delta_ci95": lp_ci,
                        "verifier_logprob_is": LOGPROB_NOTE,
                        "reference_match_rate": rate, "reference_match_n": n_ref,
                        "reference_match_delta": paired_mean_difference(qpairs, rm, bootstrap=0)[0],
                        "pairs": len(qpairs) if base else None}

        # per category
        cats: dict[str, dict[str, Any]] = {}
        for cat in sorted({str(r.get("category")) for r in recs}):
            crecs = [r for r in recs if str(r.get("category")) == cat]
            cpairs = [(r, b) for r, b in pairs if str(r.get("category")) == cat]
            cq = [(r, b) for r, b in qpairs if str(r.get("category")) == cat]
            d, ci = paired_ratio_delta(cpairs, _server_cost, bootstrap=bootstrap,
                                       seed=_seed_for(seed, name, "g", cat))
            cats[cat] = {"requests": len(crecs), "mat": _pooled(crecs, _tokens, _rounds),
                         "g_ms_per_token": _pooled(crecs, _server_cost, _tokens) if verifier else None,
                         "delta_g_pct": d, "delta_g_ci95": ci,
                         "verifier_logprob": _mean(lp(r) for r in crecs),
                         "verifier_logprob_delta": paired_mean_difference(cq, lp, bootstrap=0)[0],
                         "reference_match_rate": _reference_rate(crecs)[0],
                         "quality": {m.key: _mean(metric_value(r.get("quality"), m.key) for r in crecs)
                                     for m in METRICS}}
        s["per_category"] = cats
        out[name] = s
    return out


# ---- terminal tables --------------------------------------------------------------------------------------
# Each table is built as a `hycoc.bench.tables.TextTable` (formatted strings) and printed by
# `hycoc.bench.tables.print_tables`: split to the console's width, or as Markdown / CSV (``fmt``).


def _fmt(x: Any, spec: str = ".2f", dash: str = "–") -> str:
    return dash if _num(x) is None else format(float(x), spec)


def _fmt_delta(d: Any, ci: Any) -> str:
    if _num(d) is None:
        return "–"
    text = f"{float(d):+.1f}"
    if ci:
        text += f" [{float(ci[0]):+.1f}, {float(ci[1]):+.1f}]"
    return text


def main_table(summary: Mapping[str, Mapping[str, Any]], *, title: str = "hycoc bench",
               baseline: str = DEFAULT_BASELINE, caption: str | None = None):
    """The main table as a `hycoc.bench.tables.TextTable` (one row per configuration, Table 5 order).

    Columns: n (requests), g (measured verifier ms per output token, prefill included), g proj. (cost-model ms per
    token over every server forward, prefill included), Δg % [95% CI] vs the baseline (and Δg proj. % [95% CI]
    when present), MAT, verifier forwards per token, delivery tok/s, device draft ms per token, first-token p50 ms,
    bytes up/down per round and the share of bonus tokens outside the keep set. Answer quality (the zlib ratio and
    the other metrics, and the flag of those worse than the baseline) is in `quality_table` alone, printed after
    this one. A `caption` (e.g. the cost model's device) is appended to the legend."""
    from hycoc.bench.tables import TextTable

    names = _order(summary)
    has_proj = any(_num(summary[n].get("g_projected_ms_per_token")) is not None for n in names)
    has_dproj = any(_num(summary[n].get("delta_g_projected_pct")) is not None for n in names)
    legend = (f"g: measured verifier ms per output token incl. prefill (App. G, pooled). g busy: the verifier "
              f"process's CPU ms per token over the same requests (other processes do not stretch it). "
              f"g proj.: cost-model ms per token over every server forward (prefill, verification, server-side "
              f"head steps). Δg: paired vs {baseline}, 95% CI by bootstrap over questions (Δg proj.: and over the "
              f"cost model's repeated timings); lower is better. Answer quality, and the metrics worse than "
              f"{baseline}: the answer quality table.")
    if caption:
        legend += " " + caption
    has_busy = any(_num(summary[n].get("g_busy_ms_per_token")) is not None for n in names)
    headers = ["config", "n", "g ms/tok", "g proj. ms/tok", "Δg % [95% CI]"]
    if has_busy:
        headers += ["g busy ms/tok", "Δg busy % [95% CI]"]
    if has_dproj:
        headers.append("Δg proj. % [95% CI]")
    headers += ["MAT", "fwd/tok", "tok/s", "draft ms/tok", "1st tok p50 ms", "B up/down per round",
                "outside keep %"]
    rows = []
    for n in names:
        s = summary[n]
        delta = "ref" if n == baseline and _num(s.get("g_ms_per_token")) is not None else \
            _fmt_delta(s.get("delta_g_pct"), s.get("delta_g_ci95"))
        up, down = s.get("bytes_up_per_round"), s.get("bytes_down_per_round")
        row = [n, str(s.get("requests", "")), _fmt(s.get("g_ms_per_token")),
               _fmt(s.get("g_projected_ms_per_token")) if has_proj else "–", delta]
        if has_busy:
            row += [_fmt(s.get("g_busy_ms_per_token")),
                    "ref" if n == baseline and _num(s.get("g_busy_ms_per_token")) is not None else
                    _fmt_delta(s.get("delta_g_busy_pct"), s.get("delta_g_busy_ci95"))]
        if has_dproj:
            row.append("ref" if n == baseline and _num(s.get("g_projected_ms_per_token")) is not None else
                       _fmt_delta(s.get("delta_g_projected_pct"), s.get("delta_g_projected_ci95")))
        share = s.get("bonus_outside_keep_share")
        row += [_fmt(s.get("mat")), _fmt(s.get("verifier_forwards_per_token"), ".3f"), _fmt(s.get("tok_per_s"), ".1f"),
                _fmt(s.get("draft_ms_per_token"), ".1f"), _fmt(s.get("first_token_ms_p50"), ".0f"),
                "–" if _num(up) is None and _num(down) is None else f"{_fmt(up, ',.0f')} / {_fmt(down, ',.0f')}",
                _fmt(None if _num(share) is None else 100.0 * float(share), ".1f")]
        rows.append(row)
    return TextTable(title=title, headers=headers, rows=rows, caption=legend)


def render_table(summary: Mapping[str, Mapping[str, Any]], console: Any, *, title: str = "hycoc bench",
                 baseline: str = DEFAULT_BASELINE, caption: str | None = None, fmt: str = "table") -> None:
    """Print `main_table` on a rich Console (``fmt``: `hycoc.bench.tables.FORMATS`; "table" splits it to the
    console's width, configuration names and CI cells whole)."""
    from hycoc.bench.tables import print_tables

    print_tables([main_table(summary, title=title, baseline=baseline, caption=caption)], console, fmt)


def _quality_cell(s: Mapping[str, Any], key: str, is_baseline: bool) -> str:
    """``mean (Δ)`` of one quality metric of a summary entry; the baseline shows its mean only."""
    m = ((s.get("quality") or {}).get("metrics") or {}).get(key) or {}
    mean = _fmt(m.get("mean"), METRIC_BY_KEY[key].fmt)
    if is_baseline or _num(m.get("delta")) is None:
        return mean
    return f"{mean} ({float(m['delta']):+{METRIC_BY_KEY[key].fmt}})"


def _quality_flags(s: Mapping[str, Any]) -> str:
    keys = (s.get("quality") or {}).get("worse_than_baseline") or []
    return ", ".join(METRIC_BY_KEY[k].label for k in keys if k in METRIC_BY_KEY) or "–"


def quality_table(summary: Mapping[str, Mapping[str, Any]], *, baseline: str = DEFAULT_BASELINE,
                  title: str = "answer quality"):
    """The quality table (`hycoc.bench.tables.TextTable`): one row per configuration, one column per
    `hycoc.bench.quality.METRICS` metric that any configuration has (``mean (Δ vs baseline)``, a metric worse
    beyond its CI marked ``!``), the verifier's mean log-prob under its own label (`LOGPROB_NOTE`), and the flag
    column of `main_table`."""
    from hycoc.bench.tables import TextTable

    names = _order(summary)
    present = [m for m in METRICS if any(_num((((summary[n].get("quality") or {}).get("metrics") or {})
                                                .get(m.key) or {}).get("mean")) is not None for n in names)]
    caption = (f"mean over answers (paired Δ vs {baseline}); ! = worse than {baseline} beyond the paired 95% CI. "
               "zlib ratio, distinct-n: lower = more repetitive; rep. 4-gram: share of words inside a repeated word "
               "4-gram; longest run: most identical tokens in a row; ROUGE-L (summarization), chrF/BLEU "
               f"(translation), final-number EM (math) against Spec-Bench's references. verifier log-prob: "
               f"{LOGPROB_NOTE}.")
    headers = (["config"] + [m.label + (" ↑" if m.better == "higher" else " ↓") for m in present]
               + ["verifier log-prob (Δ)", f"worse than {baseline}"])
    rows = []
    for n in names:
        s = summary[n]
        q = s.get("quality") or {}
        row = [n]
        for m in present:
            cell = _quality_cell(s, m.key, n == baseline)
            row.append(cell + ("!" if ((q.get("metrics") or {}).get(m.key) or {}).get("worse_than_baseline") else ""))
        lp, lpd = q.get("verifier_logprob"), q.get("verifier_logprob_delta")
        row.append(_fmt(lp, ".3f") + ("" if n == baseline or _num(lpd) is None else f" ({float(lpd):+.3f})"))
        row.append(_quality_flags(s))
        rows.append(row)
    return TextTable(title=title, headers=headers, rows=rows, caption=caption)


def render_quality(summary: Mapping[str, Mapping[str, Any]], console: Any, *, baseline: str = DEFAULT_BASELINE,
                   title: str = "answer quality", fmt: str = "table") -> None:
    """Print `quality_table` (``fmt`` as `render_table`)."""
    from hycoc.bench.tables import print_tables

    print_tables([quality_table(summary, baseline=baseline, title=title)], console, fmt)


def rounds_table(summary: Mapping[str, Mapping[str, Any]]):
    """Server ms per round (median over rounds) as a `hycoc.bench.tables.TextTable`: measured here, projected
    through the cost model (verification + the server-side head steps of that round), and the paper's figure for
    the same draft place (§3.1, `hycoc.bench.cost_model.PAPER_ROUND_MS`: 21.7 ms with the head on the device,
    26.8 ms with it on the server), with g projected split by kind of forward (ms per output token). None
    without a projection."""
    from hycoc.bench.cost_model import DRAFT_PLACE_OF, PAPER_ROUND_MS
    from hycoc.bench.tables import TextTable

    names = [n for n in _order(summary) if summary[n].get("server_ms_per_round_projected_p50") is not None]
    if not names:
        return None
    rows = []
    for name in names:
        s = summary[name]
        place = DRAFT_PLACE_OF.get(name, "device")
        paper = PAPER_ROUND_MS["hyco"] if place == "device" else PAPER_ROUND_MS["cloud-mtp"]
        parts = s.get("g_projected_parts") or {}
        rows.append([name, _fmt(s.get("server_ms_per_round_p50")), _fmt(s.get("server_ms_per_round_projected_p50")),
                     f"{paper:.1f}", *(_fmt(parts.get(k)) for k in ("verify", "head_step", "prefill"))])
    return TextTable(
        title="server ms per round (median) and g projected by forward",
        headers=["config", "measured ms", "projected ms", "paper ms", "g proj. verify", "g proj. head steps",
                 "g proj. prefill"], rows=rows,
        caption="projected: verification + server-side head steps of each round, through the cost model; paper: "
                "§3.1, one RTX PRO 6000 (HyCo 21.7 ms: verification only; Cloud+MTP 26.8 ms: K head steps + "
                "verification). g proj. parts in ms per output token.")


def render_rounds(summary: Mapping[str, Mapping[str, Any]], console: Any = None, fmt: str = "table") -> None:
    """Print `rounds_table` (``fmt`` as `render_table`); prints nothing without a projection."""
    from rich.console import Console

    from hycoc.bench.tables import print_tables

    table = rounds_table(summary)
    if table is not None:
        print_tables([table], console or Console(), fmt)


def categories_table(summary: Mapping[str, Mapping[str, Any]], *, baseline: str = DEFAULT_BASELINE,
                     title: str = "per category: MAT · Δg %"):
    """The per-category table (`hycoc.bench.tables.TextTable`, key column: the category): one column per
    configuration with its MAT and its paired Δg % vs the baseline on that category's questions ("ref" for the
    baseline itself); split by configurations when it does not fit."""
    from hycoc.bench.tables import TextTable

    names = _order(summary)
    cats = sorted({c for n in names for c in (summary[n].get("per_category") or {})})
    rows = []
    for c in cats:
        row = [c]
        for n in names:
            pc = (summary[n].get("per_category") or {}).get(c)
            if not pc:
                row.append("")
                continue
            d = "ref" if n == baseline and _num(pc.get("g_ms_per_token")) is not None else \
                (f"{float(pc['delta_g_pct']):+.1f}%" if _num(pc.get("delta_g_pct")) is not None else "–")
            row.append(f"{_fmt(pc.get('mat'))} · {d}")
        rows.append(row)
    return TextTable(title=title, headers=["category", *names], rows=rows,
                     caption=f"MAT tokens/round · Δg % paired vs {baseline} (lower is better)")


def render_categories(summary: Mapping[str, Mapping[str, Any]], console: Any, *,
                      baseline: str = DEFAULT_BASELINE, title: str = "per category: MAT · Δg %",
                      fmt: str = "table") -> None:
    """Print `categories_table` (``fmt`` as `render_table`)."""
    from hycoc.bench.tables import print_tables

    print_tables([categories_table(summary, baseline=baseline, title=title)], console, fmt)


# ---- plots --------------------------------------------------------------------------------------------------


def _save(fig: Any, path: Path) -> Path:
    """Write a figure atomically: temporary name in the same folder, then rename."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        fig.savefig(tmp, format="png", dpi=120, bbox_inches="tight")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def _label_offsets(points: Sequence[tuple[float, float]], xspan: float, yspan: float, step: float = 11.0
                   ) -> list[tuple[float, float]]:
    """Offsets (points of type, x and y) for one label per point so that labels of points close together (within 6%
    of the y span, and within 20% of the x span, as a label runs to the right of its point) stack one above the
    other instead of overlapping: the k-th close neighbour's label goes k lines higher."""
    out: list[tuple[float, float]] = []
    for i, (x, y) in enumerate(points):
        near = sum(1 for (x2, y2) in points[:i]
                   if abs(x - x2) <= 0.2 * (xspan or 1.0) and abs(y - y2) <= 0.06 * (yspan or 1.0))
        out.append((6.0, 4.0 + step * near))
    return out


def write_plots(summary: Mapping[str, Mapping[str, Any]], out_dir: str | Path, *,
                baseline: str = DEFAULT_BASELINE) -> list[Path]:
    """Write ``mat_vs_g.png`` and ``category_delta_g.png`` into out_dir (created if needed); returns the two paths.

    mat_vs_g.png: MAT vs g, one colour per configuration (named in the legend and beside its point; labels of
    points close together are stacked, `_label_offsets`): filled circle = g measured incl. prefill, hollow square =
    g projected over every server forward, a dotted line joining the two. category_delta_g.png: grouped bars of
    paired Δg % per category per configuration, each with its 95% CI as an error bar and its value written on it.
    Uses matplotlib's Agg canvas, no pyplot state; each file is written to a temporary name and renamed."""
    from matplotlib.figure import Figure

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    names = _order(summary)

    fig = Figure(figsize=(7.5, 5.5))
    ax = fig.add_subplot()
    shown = []
    for i, n in enumerate(names):
        s = summary[n]
        mat, g, gp = _num(s.get("mat")), _num(s.get("g_ms_per_token")), _num(s.get("g_projected_ms_per_token"))
        if mat is None or (g is None and gp is None):
            continue
        color = f"C{i % 10}"
        if g is not None:
            ax.scatter([g], [mat], color=color, marker="o", s=50, zorder=3, label=n)
        if gp is not None:
            ax.scatter([gp], [mat], facecolors="none", edgecolors=color, marker="s", s=50, zorder=3,
                       label=None if g is not None else n)
            if g is not None:
                ax.plot([g, gp], [mat, mat], color=color, lw=0.8, ls=":")
        shown.append((n, g if g is not None else gp, mat, color))
    if shown:
        xs = [x for _, x, _, _ in shown] + [_num(summary[n].get("g_projected_ms_per_token")) or x
                                            for n, x, _, _ in shown]
        ys = [y for _, _, y, _ in shown]
        offsets = _label_offsets([(x, y) for _, x, y, _ in shown], max(xs) - min(xs), max(ys) - min(ys))
        for (n, x, y, color), off in zip(shown, offsets):
            ax.annotate(n, (x, y), textcoords="offset points", xytext=off, fontsize=8, color=color,
                        bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.8})
    else:
        ax.text(0.5, 0.5, "no configuration with a verifier", ha="center", va="center", transform=ax.transAxes)
    ax.scatter([], [], color="gray", marker="o", label="g measured (incl. prefill)")
    ax.scatter([], [], facecolors="none", edgecolors="gray", marker="s", label="g projected (every server forward)")
    ax.legend(loc="best", fontsize=7)
    ax.margins(x=0.15, y=0.15)
    ax.set_xlabel("g: verifier ms per output token (lower is better)")
    ax.set_ylabel("MAT: tokens per verification round")
    ax.set_title("MAT vs g per configuration")
    ax.grid(True, alpha=0.3)
    paths = [_save(fig, out / "mat_vs_g.png")]

    cfgs = [n for n in names if n != baseline
            and any(_num(pc.get("delta_g_pct")) is not None for pc in (summary[n].get("per_category") or {}).values())]
    cats = sorted({c for n in cfgs for c in summary[n]["per_category"]})
    fig = Figure(figsize=(max(7.0, 1.1 * len(cats) * max(1, len(cfgs)) ** 0.5 + 3), 5.5))
    ax = fig.add_subplot()
    if cfgs and cats:
        width = 0.8 / len(cfgs)
        x = np.arange(len(cats))
        for j, n in enumerate(cfgs):
            pcs = summary[n]["per_category"]
            vals = [_num((pcs.get(c) or {}).get("delta_g_pct")) for c in cats]
            cis = [(pcs.get(c) or {}).get("delta_g_ci95") for c in cats]
            lo = [v - ci[0] if v is not None and ci else 0.0 for v, ci in zip(vals, cis)]
            hi = [ci[1] - v if v is not None and ci else 0.0 for v, ci in zip(vals, cis)]
            bars = ax.bar(x + (j - (len(cfgs) - 1) / 2) * width, [np.nan if v is None else v for v in vals], width,
                          label=n, color=f"C{names.index(n) % 10}", yerr=[lo, hi], capsize=2,
                          error_kw={"elinewidth": 0.8, "ecolor": "black"})
            ax.bar_label(bars, labels=["" if v is None else f"{v:+.0f}" for v in vals], fontsize=6, padding=2)
        ax.set_xticks(x)
        ax.set_xticklabels(cats, rotation=30, ha="right")
        ax.axhline(0.0, color="black", lw=0.8)
        ax.legend(fontsize=7)
    else:
        ax.text(0.5, 0.5, f"no paired Δg (baseline {baseline} absent?)", ha="center", va="center",
                transform=ax.transAxes)
    ax.set_ylabel(f"Δg % vs {baseline} (lower is better)")
    ax.set_title(f"Paired Δg per category (value on each bar; error bar: 95% CI over the category's questions)")
    ax.grid(True, axis="y", alpha=0.3)
    paths.append(_save(fig, out / "category_delta_g.png"))
    return paths
