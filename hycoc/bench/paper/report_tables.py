"""The bench's result tables (`hycoc bench`, `hycoc tune-epsilon`; docs/benchmarks.md): the main table (g, Δg, MAT,
delivery), the answer-quality table with its flags, the per-round and per-category tables, each built from a
summary (`hycoc.bench.paper.summary.summarize`, the dicts ``results.json`` holds) as a `hycoc.bench.tables.TextTable`
and printed by `hycoc.bench.tables.print_tables`. Core module: rich is imported inside the functions that print.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hycoc.bench.paper.quality import METRIC_BY_KEY, METRICS
from hycoc.bench.paper.stats import DEFAULT_BASELINE, FLAG_METHOD, _num
from hycoc.bench.paper.stats import table5_order as _order
from hycoc.bench.paper.summary_schema import LOGPROB_NOTE

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


def main_table(
    summary: Mapping[str, Mapping[str, Any]],
    *,
    title: str = "hycoc bench",
    baseline: str = DEFAULT_BASELINE,
    caption: str | None = None,
):
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
    legend = (
        f"g: measured verifier ms per output token incl. prefill (App. G, pooled). g busy: the verifier "
        f"process's CPU ms per token over the same requests (other processes do not stretch it). "
        f"g proj.: cost-model ms per token over every server forward (prefill, verification, server-side "
        f"head steps). Δg: paired vs {baseline}, 95% CI by paired BCa bootstrap over questions (Δg proj.: "
        f"percentile, and over the "
        f"cost model's repeated timings); lower is better. Answer quality, and the metrics worse than "
        f"{baseline}: the answer quality table."
    )
    if caption:
        legend += " " + caption
    has_busy = any(_num(summary[n].get("g_busy_ms_per_token")) is not None for n in names)
    headers = ["config", "n", "g ms/tok", "g proj. ms/tok", "Δg % [95% CI]"]
    if has_busy:
        headers += ["g busy ms/tok", "Δg busy % [95% CI]"]
    if has_dproj:
        headers.append("Δg proj. % [95% CI]")
    headers += ["MAT", "fwd/tok", "tok/s", "draft ms/tok", "1st tok p50 ms", "B up/down per round", "outside keep %"]
    rows = []
    for n in names:
        s = summary[n]
        delta = (
            "ref"
            if n == baseline and _num(s.get("g_ms_per_token")) is not None
            else _fmt_delta(s.get("delta_g_pct"), s.get("delta_g_ci95"))
        )
        up, down = s.get("bytes_up_per_round"), s.get("bytes_down_per_round")
        row = [
            n,
            str(s.get("requests", "")),
            _fmt(s.get("g_ms_per_token")),
            _fmt(s.get("g_projected_ms_per_token")) if has_proj else "–",
            delta,
        ]
        if has_busy:
            row += [
                _fmt(s.get("g_busy_ms_per_token")),
                "ref"
                if n == baseline and _num(s.get("g_busy_ms_per_token")) is not None
                else _fmt_delta(s.get("delta_g_busy_pct"), s.get("delta_g_busy_ci95")),
            ]
        if has_dproj:
            row.append(
                "ref"
                if n == baseline and _num(s.get("g_projected_ms_per_token")) is not None
                else _fmt_delta(s.get("delta_g_projected_pct"), s.get("delta_g_projected_ci95"))
            )
        share = s.get("bonus_outside_keep_share")
        row += [
            _fmt(s.get("mat")),
            _fmt(s.get("verifier_forwards_per_token"), ".3f"),
            _fmt(s.get("tok_per_s"), ".1f"),
            _fmt(s.get("draft_ms_per_token"), ".1f"),
            _fmt(s.get("first_token_ms_p50"), ".0f"),
            "–" if _num(up) is None and _num(down) is None else f"{_fmt(up, ',.0f')} / {_fmt(down, ',.0f')}",
            _fmt(None if (pct := _num(share)) is None else 100.0 * pct, ".1f"),
        ]
        rows.append(row)
    return TextTable(title=title, headers=headers, rows=rows, caption=legend)


def render_table(
    summary: Mapping[str, Mapping[str, Any]], console: Any, *, fmt: str = "table", **table_options: Any
) -> None:
    """Print `main_table` on a rich Console (``fmt``: `hycoc.bench.tables.FORMATS`; "table" splits it to the
    console's width, configuration names and CI cells whole). ``table_options``: `main_table`'s keywords (title,
    baseline, caption), its defaults where left out; an unknown one raises TypeError."""
    _print_one(main_table(summary, **table_options), console, fmt)


def _print_one(table: Any, console: Any, fmt: str) -> None:
    """Print one `hycoc.bench.tables.TextTable` (the ``render_*`` functions' common end)."""
    from hycoc.bench.tables import print_tables

    print_tables([table], console, fmt)


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


def quality_table(
    summary: Mapping[str, Mapping[str, Any]], *, baseline: str = DEFAULT_BASELINE, title: str = "answer quality"
):
    """The quality table (`hycoc.bench.tables.TextTable`): one row per configuration, one column per
    `hycoc.bench.paper.quality.METRICS` metric that any configuration has (``mean (Δ vs baseline)``, a metric flagged
    worse marked ``!``: its one-sided p-value survives Holm's correction over the run,
    `hycoc.bench.paper.stats.FLAG_METHOD`, which the caption names), the verifier's mean log-prob under its own label
    (`LOGPROB_NOTE`), and the flag column of `main_table`."""
    from hycoc.bench.tables import TextTable

    names = _order(summary)
    present = [
        m
        for m in METRICS
        if any(
            _num((((summary[n].get("quality") or {}).get("metrics") or {}).get(m.key) or {}).get("mean")) is not None
            for n in names
        )
    ]
    tests = max([int((summary[n].get("quality") or {}).get("flag_tests") or 0) for n in names] or [0])
    caption = (
        f"mean over answers (paired Δ vs {baseline}); ! = worse than {baseline}: {FLAG_METHOD} "
        f"({tests} tests). "
        "zlib ratio, distinct-n: lower = more repetitive; rep. 4-gram: share of words inside a repeated word "
        "4-gram; longest run: most identical tokens in a row; ROUGE-L (summarization), chrF/BLEU "
        f"(translation), final-number EM (math) against Spec-Bench's references. verifier log-prob: "
        f"{LOGPROB_NOTE}."
    )
    headers = (
        ["config"]
        + [m.label + (" ↑" if m.better == "higher" else " ↓") for m in present]
        + ["verifier log-prob (Δ)", f"worse than {baseline}"]
    )
    rows = []
    for n in names:
        s = summary[n]
        q = s.get("quality") or {}
        row = [n]
        for m in present:
            cell = _quality_cell(s, m.key, n == baseline)
            row.append(cell + ("!" if ((q.get("metrics") or {}).get(m.key) or {}).get("worse_than_baseline") else ""))
        lp, lpd = q.get("verifier_logprob"), q.get("verifier_logprob_delta")
        row.append(_fmt(lp, ".3f") + ("" if n == baseline or (delta := _num(lpd)) is None else f" ({delta:+.3f})"))
        row.append(_quality_flags(s))
        rows.append(row)
    return TextTable(title=title, headers=headers, rows=rows, caption=caption)


def render_quality(
    summary: Mapping[str, Mapping[str, Any]], console: Any, *, fmt: str = "table", **table_options: Any
) -> None:
    """Print `quality_table` (``fmt`` as `render_table`; ``table_options``: its keywords, baseline and title)."""
    _print_one(quality_table(summary, **table_options), console, fmt)


def rounds_table(summary: Mapping[str, Mapping[str, Any]]):
    """Server ms per round (median over rounds) as a `hycoc.bench.tables.TextTable`: measured here, projected
    through the cost model (verification + the server-side head steps of that round), and the paper's figure for
    the same draft place (§3.1, `hycoc.bench.cost_model.model.PAPER_ROUND_MS`: 21.7 ms with the head on the device,
    26.8 ms with it on the server), with g projected split by kind of forward (ms per output token). None
    without a projection."""
    from hycoc.bench.cost_model.model import DRAFT_PLACE_OF, PAPER_ROUND_MS
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
        rows.append(
            [
                name,
                _fmt(s.get("server_ms_per_round_p50")),
                _fmt(s.get("server_ms_per_round_projected_p50")),
                f"{paper:.1f}",
                *(_fmt(parts.get(k)) for k in ("verify", "head_step", "prefill")),
            ]
        )
    return TextTable(
        title="server ms per round (median) and g projected by forward",
        headers=[
            "config",
            "measured ms",
            "projected ms",
            "paper ms",
            "g proj. verify",
            "g proj. head steps",
            "g proj. prefill",
        ],
        rows=rows,
        caption="projected: verification + server-side head steps of each round, through the cost model; paper: "
        "§3.1, one RTX PRO 6000 (HyCo 21.7 ms: verification only; Cloud+MTP 26.8 ms: K head steps + "
        "verification). g proj. parts in ms per output token.",
    )


def render_rounds(summary: Mapping[str, Mapping[str, Any]], console: Any = None, fmt: str = "table") -> None:
    """Print `rounds_table` (``fmt`` as `render_table`); prints nothing without a projection."""
    from rich.console import Console

    table = rounds_table(summary)
    if table is not None:
        _print_one(table, console or Console(), fmt)


def categories_table(
    summary: Mapping[str, Mapping[str, Any]],
    *,
    baseline: str = DEFAULT_BASELINE,
    title: str = "per category: MAT · Δg %",
):
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
            d = (
                "ref"
                if n == baseline and _num(pc.get("g_ms_per_token")) is not None
                else (f"{float(pc['delta_g_pct']):+.1f}%" if _num(pc.get("delta_g_pct")) is not None else "–")
            )
            row.append(f"{_fmt(pc.get('mat'))} · {d}")
        rows.append(row)
    return TextTable(
        title=title,
        headers=["category", *names],
        rows=rows,
        caption=f"MAT tokens/round · Δg % paired vs {baseline} (lower is better)",
    )


def render_categories(
    summary: Mapping[str, Mapping[str, Any]], console: Any, *, fmt: str = "table", **table_options: Any
) -> None:
    """Print `categories_table` (``fmt`` as `render_table`; ``table_options``: its keywords, baseline and title)."""
    _print_one(categories_table(summary, **table_options), console, fmt)
