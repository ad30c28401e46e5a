"""hycoc.bench.paper.stats: App. G metrics on hand-built records, paired bootstrap, cost-model projection, tables,
plots, reference matching on Spec-Bench's real reference formats."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from hycoc.bench.paper.plots import write_plots
from hycoc.bench.paper.quality import reference_match
from hycoc.bench.paper.report_tables import render_categories, render_table
from hycoc.bench.paper.summary import summarize


def rec(
    config,
    qid,
    *,
    tokens,
    server,
    prefill,
    rows,
    context,
    category="math",
    run=0,
    seconds=1.0,
    first=100.0,
    draft=10.0,
    up=None,
    down=None,
    outside=0,
    lp=None,
    match=None,
    rounds=None,
):
    return {
        "config": config,
        "run": run,
        "question_id": qid,
        "category": category,
        "prompt_tokens": 50,
        "tokens": tokens,
        "rounds": len(server) if rounds is None else rounds,
        "accepted": [1] * len(server),
        "prefill_ms": prefill,
        "server_ms": list(server),
        "rows": list(rows),
        "context": list(context),
        "seconds": seconds,
        "first_token_ms": first,
        "draft_ms": draft,
        "slm_prefill_ms": 5.0,
        "bytes_up": up if up is not None else [2000] * len(server),
        "bytes_down": down if down is not None else [100] * len(server),
        "bonus_outside_keep": outside,
        "link_ms": 0.0,
        "text": "",
        "finished": True,
        "verifier_logprob": lp,
        "reference_match": match,
    }


def records():
    """cloud-mtp: g = (20+20 + 10+50) / (10+30) = 2.5; hyco: g = (20+10 + 10+30) / 40 = 1.75 -> Δg = -30 %."""
    return [
        rec(
            "cloud-mtp",
            1,
            tokens=10,
            server=[5] * 4,
            prefill=20,
            rows=[5] * 4,
            context=[10, 13, 16, 19],
            category="math",
            lp=-1.5,
            match=False,
        ),
        rec(
            "cloud-mtp",
            2,
            tokens=30,
            server=[5] * 10,
            prefill=10,
            rows=[5] * 10,
            context=list(range(100, 110)),
            category="rag",
            lp=-1.5,
        ),
        rec(
            "hyco",
            1,
            tokens=10,
            server=[5, 5],
            prefill=20,
            rows=[33, 33],
            context=[10, 20],
            category="math",
            seconds=1.0,
            first=100.0,
            draft=50.0,
            up=[2000, 2000],
            outside=1,
            lp=-1.0,
            match=True,
        ),
        rec(
            "hyco",
            2,
            tokens=30,
            server=[6] * 5,
            prefill=10,
            rows=[33] * 5,
            context=[100, 110, 120, 130, 140],
            category="rag",
            seconds=3.0,
            first=300.0,
            draft=150.0,
            up=[1000] * 5,
            lp=-1.2,
        ),
        rec(
            "slm-alone", 1, tokens=10, server=[], prefill=0, rows=[], context=[], up=[], down=[], seconds=2.0, rounds=10
        ),
    ]


def test_app_g_metrics_exact():
    s = summarize(records(), bootstrap=200)
    h, c = s["hyco"], s["cloud-mtp"]
    assert list(s) == ["cloud-mtp", "hyco", "slm-alone"]  # Table 5 order
    assert c["g_ms_per_token"] == pytest.approx(2.5)
    assert h["g_ms_per_token"] == pytest.approx(1.75)
    assert h["g_rounds_ms_per_token"] == pytest.approx(40 / 40)
    assert h["delta_g_pct"] == pytest.approx(-30.0)
    lo, hi = h["delta_g_ci95"]
    assert lo <= -30.0 <= hi
    assert c["delta_g_pct"] == pytest.approx(0.0)
    assert h["mat"] == pytest.approx(40 / 7) and c["mat"] == pytest.approx(40 / 14)
    assert h["verifier_forwards_per_token"] == pytest.approx(7 / 40)
    assert h["rows_per_forward"] == pytest.approx(33.0)
    assert h["mean_context"] == pytest.approx((10 + 20 + 600) / 7)
    assert h["tok_per_s"] == pytest.approx(10.0)
    assert h["draft_ms_per_token"] == pytest.approx(5.0)
    assert h["first_token_ms_p50"] == pytest.approx(200.0)
    assert h["first_token_ms_p90"] == pytest.approx(280.0)
    assert h["bytes_up_per_round"] == pytest.approx(9000 / 7)
    assert h["bytes_down_per_round"] == pytest.approx(100.0)
    assert h["bonus_outside_keep_share"] == pytest.approx(1 / 7)
    assert h["requests"] == 2 and h["delta_pairs"] == 2 and h["delta_questions"] == 2
    assert h["g_projected_ms_per_token"] is None and h["delta_g_projected_pct"] is None
    # per category, paired within the category: math (30/10)/(40/10) - 1, rag (40/30)/(60/30) - 1
    assert h["per_category"]["math"]["delta_g_pct"] == pytest.approx(-25.0)
    assert h["per_category"]["rag"]["delta_g_pct"] == pytest.approx(100 * (2 / 3 - 1))
    assert h["per_category"]["math"]["mat"] == pytest.approx(5.0)
    assert h["per_category"]["math"]["verifier_logprob_delta"] == pytest.approx(0.5)
    assert h["per_category"]["math"]["reference_match_rate"] == 1.0
    assert c["per_category"]["math"]["reference_match_rate"] == 0.0
    # quality: mean -1.1, paired delta mean(0.5, 0.3) = 0.4
    q = h["quality"]
    assert q["verifier_logprob"] == pytest.approx(-1.1)
    assert q["verifier_logprob_delta"] == pytest.approx(0.4)
    assert q["verifier_logprob_delta_ci95"][0] <= 0.4 <= q["verifier_logprob_delta_ci95"][1]
    assert q["reference_match_rate"] == 1.0 and q["reference_match_n"] == 1 and q["reference_match_delta"] == 1.0
    # no verifier
    a = s["slm-alone"]
    assert a["g_ms_per_token"] is None and a["verifier_forwards_per_token"] is None and a["delta_g_pct"] is None
    assert a["mat"] == pytest.approx(1.0) and a["tok_per_s"] == pytest.approx(5.0)
    json.dumps(s, allow_nan=False)  # results.json-ready


def test_runs_are_pooled_then_averaged_and_paired_by_run():
    rs = [
        rec("cloud-mtp", q, tokens=10, server=[10], prefill=0, rows=[5], context=[0], run=k)
        for q in (1, 2)
        for k in (0, 1)
    ]
    rs += [
        rec("hyco", q, tokens=10, server=[5 if k == 0 else 15], prefill=0, rows=[33], context=[0], run=k)
        for q in (1, 2)
        for k in (0, 1)
    ]
    h = summarize(rs, bootstrap=0)["hyco"]
    assert h["g_runs"] == pytest.approx([0.5, 1.5]) and h["g_ms_per_token"] == pytest.approx(1.0)
    assert h["delta_g_pct"] == pytest.approx(0.0) and h["delta_g_ci95"] is None and h["delta_pairs"] == 4


def test_bootstrap_ci_degenerate_when_every_question_has_the_same_ratio():
    rs = []
    for q in range(12):
        server = [float(q + 1)] * (q % 3 + 1)
        rs.append(
            rec(
                "cloud-mtp",
                q,
                tokens=5 + q,
                server=server,
                prefill=2.0 * q,
                rows=[5] * len(server),
                context=[0] * len(server),
            )
        )
        rs.append(
            rec(
                "specedge",
                q,
                tokens=5 + q,
                server=[0.8 * x for x in server],
                prefill=1.6 * q,
                rows=[33] * len(server),
                context=[0] * len(server),
            )
        )
    s = summarize(rs, bootstrap=300, seed=3)["specedge"]
    assert s["delta_g_pct"] == pytest.approx(-20.0)
    assert s["delta_g_ci95"] == pytest.approx([-20.0, -20.0])
    assert summarize(rs, bootstrap=300, seed=3)["specedge"]["delta_g_ci95"] == s["delta_g_ci95"]  # seeded


class FakeCost:
    def predict(self, rows: int, context: int, kind: str = "verify") -> float:
        if rows > 33 and kind != "prefill":
            raise ValueError(f"rows = {rows} outside the grid")
        return {"verify": rows + context / 10, "head_step": 0.5 + context / 100, "prefill": rows / 10}[kind]


def test_cost_model_projection_counts_every_server_forward():
    """docs/benchmarks.md "Benchmark" (the forwards replayed): the prefill chunks ([0, first root): 10 and 100
    positions, one chunk each) and cloud-mtp's K = 4 head steps per round (at the round's context) are projected beside
    the verification forwards."""
    s = summarize(records(), cost_model=FakeCost(), bootstrap=50)
    h, c = s["hyco"], s["cloud-mtp"]
    prefill = 10 / 10 + 100 / 10
    hyco_ms = (33 + 1) + (33 + 2) + 5 * 33 + (10 + 11 + 12 + 13 + 14) + prefill  # 294 + 11
    cloud_verify = 4 * 5 + (1 + 1.3 + 1.6 + 1.9) + 10 * 5 + sum(range(100, 110)) / 10
    cloud_heads = 4 * (4 * 0.5 + (10 + 13 + 16 + 19) / 100) + 4 * (10 * 0.5 + sum(range(100, 110)) / 100)
    cloud_ms = cloud_verify + cloud_heads + prefill
    assert h["g_projected_ms_per_token"] == pytest.approx(hyco_ms / 40)
    assert c["g_projected_ms_per_token"] == pytest.approx(cloud_ms / 40)
    assert c["g_projected_parts"] == pytest.approx(
        {"verify": cloud_verify / 40, "head_step": cloud_heads / 40, "prefill": prefill / 40}
    )
    assert h["delta_g_projected_pct"] == pytest.approx(100 * (hyco_ms / cloud_ms - 1))
    assert s["slm-alone"]["g_projected_ms_per_token"] is None
    bad = records() + [rec("server-head", 1, tokens=5, server=[1], prefill=0, rows=[64], context=[0])]
    sh = summarize(bad, cost_model=FakeCost(), bootstrap=0, server={"chain_length": 4, "head_window": 256})[
        "server-head"
    ]
    assert sh["g_projected_ms_per_token"] is None and "outside the grid" in sh["g_projected_error"]
    assert sh["g_ms_per_token"] == pytest.approx(0.2)


def test_missing_baseline_gives_null_deltas(tmp_path):
    s = summarize([r for r in records() if r["config"] != "cloud-mtp"], cost_model=FakeCost(), bootstrap=50)
    h = s["hyco"]
    assert h["g_ms_per_token"] == pytest.approx(1.75)
    for k in ("delta_g_pct", "delta_g_ci95", "delta_g_projected_pct", "delta_pairs"):
        assert h[k] is None
    assert h["quality"]["verifier_logprob_delta"] is None
    assert h["per_category"]["math"]["delta_g_pct"] is None
    console = Console(file=io.StringIO(), width=250)
    render_table(s, console, title="t")
    render_categories(s, console)
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in write_plots(s, tmp_path))


def test_tables_and_plots(tmp_path):
    s = summarize(records(), cost_model=FakeCost(), bootstrap=50)
    buf = io.StringIO()
    console = Console(file=buf, width=250)
    render_table(s, console, title="bench")
    render_categories(s, console)
    out = buf.getvalue()
    assert out.index("cloud-mtp") < out.index("hyco") < out.index("slm-alone")
    assert "-30.0" in out and "ref" in out and "every server forward" in out and "-25.0%" in out
    paths = write_plots(s, tmp_path / "plots")
    assert [p.name for p in paths] == ["mat_vs_g.png", "category_delta_g.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 1000
        assert p.stat().st_mode & 0o777 == 0o644  # as results.json; mkstemp alone makes 0600
    assert sorted(x.name for x in (tmp_path / "plots").iterdir()) == ["category_delta_g.png", "mat_vs_g.png"]


GSM = [
    "He pays 400*.5=$<<400*.5=200>>200 more for tickets than supplies\nThat means the tickets cost "
    "400+200=$<<400+200=600>>600\nSo it cost 600+400=$<<600+400=1000>>1000 in total.\n#### 1000"
]


@pytest.mark.parametrize(
    "category,text,reference,expected",
    [
        ("math_reasoning", "So the total is $1,000.", GSM, True),
        ("math_reasoning", "The answer is 1000", GSM, True),
        ("math_reasoning", "The answer is 10000.", GSM, False),
        ("math_reasoning", "It costs 21000 or 1000.5 dollars, or -1000", GSM, False),
        ("math_reasoning", "Pages 1-1000 of the answer", GSM, True),
        ("math_reasoning", "no numbers", ["... #### 17"], False),
        ("math", "The area of the triangle is 3.", ["Area is 3", "5pi"], True),
        ("math", "The area is 4.5 square units", ["Area is 3", "5pi"], False),
        ("math", "There are 19 integers in the solution set.", ["19 integers (-14, ..., 4)", "9 integers"], True),
        ("math", "x ranges over 4 values", ["19 integers (-14, ..., 4)", "9 integers"], False),
        ("math", "So f(2) equals 0.", ["f(2) = 0", "x = 2"], True),
        (
            "math",
            "The probability is 35/36.",
            ["36 (all cases) - 0 (sum equals 1) - 1 (sum equals 2) = 35, so the probability is 35/36", "100%"],
            True,
        ),
        (
            "math",
            "The probability is 1/36.",
            ["36 (all cases) - 0 - 1 = 35, so the probability is 35/36", "100%"],
            False,
        ),
        ("math", "About 19% of students.", ["19%", "0%"], True),
        ("rag", "It was written by george   harrison in 1968.", [["James Ray", "George Harrison"]], True),
        ("rag", "Supporting UNICEF's global programing worldwide.", [["UNICEF 's global programing"]], True),
        ("rag", "The number 1623 is not it.", [["623", "480", "602"]], False),
        ("rag", "It was Paul McCartney.", [["James Ray", "George Harrison"]], False),
        ("qa", "Paris.", ["paris"], True),
        ("qa", "anything", None, None),
        ("translation", "Pawnbrokers shine", ["Pawnbrokers shine in Singapore as middle class feel the pinch"], None),
        ("writing", "text", None, None),
    ],
)
def test_reference_match(category, text, reference, expected):
    assert reference_match(category, text, reference) is expected


def test_results_json_follows_the_typed_summary():
    """summarize's dicts are ConfigSummary (and its nested dataclasses) field for field: the schema results.json
    follows is declared once."""
    import dataclasses

    from hycoc.bench.paper.summary_schema import CategorySummary, ConfigSummary, MetricQuality, QualitySummary

    def names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    s = summarize(records(), bootstrap=0)
    for entry in s.values():
        assert list(entry) == names(ConfigSummary)
        assert list(entry["quality"]) == names(QualitySummary)
        assert all(list(m) == names(MetricQuality) for m in entry["quality"]["metrics"].values())
        assert all(list(c) == names(CategorySummary) for c in entry["per_category"].values())
    json.dumps(s)
