"""The long-document row of a bench run (paper §4.1 and Table 2's 32K column; App. G): what a long prompt costs on
each side of the link, per configuration.

From the records of `hycoc.bench.paper.runner` (units as there) and the run's summary
(`hycoc.bench.paper.summary.summarize`):

    prompt_tokens_p50      the prompts' median length (verifier tokens, chat template included)
    delta_g_pct, ci95      paired change of g against Cloud+MTP (the summary's), with its bootstrap 95% CI
    mat                    tokens committed per round, bonus included
    first_token_ms_p50     time to first token (prefill on the verifier plus the first round; link counted)
    prefill_share_of_g     the verifier's prefill ms / all its ms (prefill + rounds): how much of g the long prompt is
    first_reply_bytes_p50  bytes of the first round's reply: it carries the hand-off of up to W positions of the
                           head's inputs (§3.4: 6.3 MB at the Gemma shape for W = 1,024; the toy's W is 256)
    slm_prefill_ms_p50     the device SLM Drafter's ring prefill: it runs over the prompt's last ``slm_window``
                           tokens only, whatever the prompt's length (paper §3.4: never more than 1,024)
    slm_prefill_positions  those positions: min(prompt - 1, slm_window)

No torch: pure record arithmetic, as `hycoc.bench.paper.stats`.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np


def _p50(values: list[float]) -> float | None:
    return float(np.median(values)) if values else None


def long_context_rows(records: list[dict], summary: dict[str, dict[str, Any]], slm_window: int) -> dict[str, dict]:
    """Per configuration (summary order), the long-document figures of the module docstring. slm_window: the
    bundle's SLM ring length in positions (the recipe's slm.window)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        groups[str(r["config"])].append(r)
    out = {}
    for name in [c for c in summary if c in groups]:
        recs, s = groups[name], summary[name]
        prefill = sum(float(r.get("prefill_ms") or 0.0) for r in recs)
        rounds = sum(float(x) for r in recs for x in (r.get("server_ms") or ()))
        uses_slm = any(float(r.get("slm_prefill_ms") or 0.0) > 0 for r in recs)
        out[name] = {
            "requests": len(recs),
            "prompt_tokens_p50": _p50([float(r["prompt_tokens"]) for r in recs]),
            "delta_g_pct": s.get("delta_g_pct"),
            "delta_g_ci95": s.get("delta_g_ci95"),
            "mat": s.get("mat"),
            "g_ms_per_token": s.get("g_ms_per_token"),
            "first_token_ms_p50": _p50(
                [float(r["first_token_ms"]) for r in recs if r.get("first_token_ms") is not None]
            ),
            "prefill_share_of_g": prefill / (prefill + rounds) if prefill + rounds > 0 else None,
            "first_reply_bytes_p50": _p50([float(r["bytes_down"][0]) for r in recs if r.get("bytes_down")]),
            "slm_prefill_ms_p50": _p50([float(r["slm_prefill_ms"]) for r in recs]) if uses_slm else None,
            "slm_prefill_positions": (
                min(int(np.median([float(r["prompt_tokens"]) for r in recs])) - 1, slm_window) if uses_slm else None
            ),
            "unfinished_by_length": sum(1 for r in recs if r.get("finished") is False),
        }
    return out


def long_context_table(rows: dict[str, dict], title: str = "long documents", baseline: str = "cloud-mtp"):
    """The rows as a `hycoc.bench.tables.TextTable` (Δg reads "ref" for ``baseline``, the configuration it pairs
    against), configurations in the main table's order (paper Table 5)."""
    from hycoc.bench.paper.stats import table5_order as _order
    from hycoc.bench.tables import TextTable

    def f(v, fmt):
        return "-" if v is None else format(v, fmt)

    out = []
    for name in _order(rows):
        r = rows[name]
        ci = r["delta_g_ci95"]
        dg = (
            "ref"
            if name == baseline
            else "-"
            if r["delta_g_pct"] is None
            else (f"{r['delta_g_pct']:+.1f}" + (f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else ""))
        )
        slm = (
            "-" if r["slm_prefill_ms_p50"] is None else f"{r['slm_prefill_ms_p50']:.1f} ({r['slm_prefill_positions']})"
        )
        share = "-" if r["prefill_share_of_g"] is None else f"{100 * r['prefill_share_of_g']:.1f} %"
        out.append(
            [
                name,
                str(r["requests"]),
                f(r["prompt_tokens_p50"], ".0f"),
                dg,
                f(r["mat"], ".2f"),
                f(r["first_token_ms_p50"], ".0f"),
                share,
                f(r["first_reply_bytes_p50"], ",.0f"),
                slm,
            ]
        )
    return TextTable(
        title=title,
        headers=[
            "config",
            "n",
            "prompt tok",
            "Δg % [95% CI]",
            "MAT",
            "TTFT ms",
            "prefill share of g",
            "first reply B",
            "SLM prefill ms (positions)",
        ],
        rows=out,
    )


def render_long_context(
    rows: dict[str, dict], console, title: str = "long documents", baseline: str = "cloud-mtp", fmt: str = "table"
) -> None:
    """Print `long_context_table` on ``console`` (``fmt``: `hycoc.bench.tables.FORMATS`; "table" splits it to the
    console's width, configuration names whole)."""
    from hycoc.bench.tables import print_tables

    print_tables([long_context_table(rows, title, baseline)], console, fmt)
