"""A bench's numbers per configuration and turn (`hycoc.bench.paper.runner`): requests, prefill ms, the prefill a
second turn saves by keeping the session's KV, g and MAT (`turn_summary`), and their table (`turns_table`).
"""

from __future__ import annotations


def turn_summary(records: list[dict]) -> dict:
    """Per configuration and turn: requests, mean prefill ms (the second turn's: the appended tokens only), mean
    prefill ms saved by keeping the KV (cold prefill of the whole conversation minus the append's; second turns),
    g = (prefill + server ms) / committed tokens pooled, MAT = committed tokens / rounds pooled.
    Records without ``turn`` are first turns; slm-alone records (no verifier) are left out."""
    from hycoc.bench.paper.stats import table5_order as _order

    out: dict[str, dict[str, dict]] = {}
    groups = _groups(records)
    rank = {c: i for i, c in enumerate(_order({c for c, _ in groups}))}  # the main table's order
    for (config, turn), rs in sorted(groups.items(), key=lambda kv: (rank[kv[0][0]], kv[0][1])):
        tokens, rounds = sum(r["tokens"] for r in rs), sum(r["rounds"] for r in rs)
        verifier_ms = sum(r["prefill_ms"] + sum(r["server_ms"]) for r in rs)
        saved = [r["prefill_ms_cold"] - r["prefill_ms"] for r in rs if "prefill_ms_cold" in r]
        out.setdefault(config, {})[str(turn)] = {
            "requests": len(rs),
            "prefill_ms": sum(r["prefill_ms"] for r in rs) / len(rs),
            "prefill_ms_saved": sum(saved) / len(saved) if saved else None,
            "g_ms_per_token": verifier_ms / tokens if tokens else None,
            "mat": tokens / rounds if rounds else None,
        }
    return out


def _groups(records: list[dict]) -> dict[tuple[str, int], list[dict]]:
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in records:
        if r["config"] != "slm-alone":
            groups.setdefault((r["config"], r.get("turn", 1)), []).append(r)
    return dict(sorted(groups.items()))


def turns_table(turns: dict):
    """The per-turn table of `turn_summary` as a `hycoc.bench.tables.TextTable` (key columns: config, turn), the
    configurations in the main table's order (paper Table 5, `hycoc.bench.paper.stats.TABLE5_ORDER`), turns in order."""
    from hycoc.bench.tables import TextTable

    def num(x, digits=2):
        return "–" if x is None else f"{x:.{digits}f}"

    from hycoc.bench.paper.stats import table5_order as _order

    rows = [
        [
            config,
            turn,
            str(t["requests"]),
            num(t["prefill_ms"], 1),
            num(t["prefill_ms_saved"], 1),
            num(t["g_ms_per_token"]),
            num(t["mat"]),
        ]
        for config in _order(turns)
        for turn, t in sorted(turns[config].items(), key=lambda kv: int(kv[0]))
    ]
    return TextTable(
        title="per turn (second turns continue the session: KV kept, only the new tokens prefilled)",
        headers=["config", "turn", "requests", "prefill ms", "prefill ms saved", "g ms/tok", "MAT"],
        rows=rows,
        keys=2,
    )


def render_turns(turns: dict, console, fmt: str = "table") -> None:
    """Print `turns_table` (``fmt``: `hycoc.bench.tables.FORMATS`)."""
    from hycoc.bench.tables import print_tables

    print_tables([turns_table(turns)], console, fmt)
