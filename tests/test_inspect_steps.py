"""`hycoc inspect`'s pure steps (`hycoc.inspect_plan`, `hycoc.inspect_report`) on inputs small enough to work by
hand; tests/test_inspect_report.py and tests/test_plan.py check the whole output."""

from __future__ import annotations

from types import SimpleNamespace

from hycoc.inspect_plan import bit_map_rows, context_budget_line, weights_line
from hycoc.inspect_report import tensor_rows


def test_weights_line_in_mb():
    w = {
        "by_bits": {"int4": {"tensors": 2, "weights": 3_000_000, "bytes": 1_500_000}},
        "scale_bytes": 12_000,
        "other_param_bytes": 4_000,
        "total_bytes": 1_516_000,
    }
    # 1,500,000 B = 1.5 MB; 12,000 B = 0.01 MB at 2 decimals; 4,000 B = 0.00 MB; 1,516,000 B = 1.5 MB at 1 decimal
    assert weights_line(w) == (
        "  weights: int4: 2 tensors / 3,000,000 weights / 1.5 MB; scales 0.01 MB, other 0.00 MB; total 1.5 MB"
    )


def test_context_budget_line_says_fits_or_the_shards():
    budget = {
        "profile": "htp-v75",
        "soc_model": "SM8650",
        "limit_bytes": 2_000_000_000,
        "graphs": {
            "slm": {"bytes": 4_200_000_000, "fits": False, "shards_needed": 3},  # ceil(4.2e9 / 2e9) = 3
            "head": {"bytes": 120_000_000, "fits": True, "shards_needed": 1},
        },
    }
    assert context_budget_line(budget) == (
        "context budget (htp-v75 SM8650, 2,000,000,000 bytes): slm 4200.0 MB OVER: 3 shards, head 120.0 MB fits"
    )
    named = context_budget_line(budget | {"device": "Galaxy S24"})
    assert named.startswith("context budget (Galaxy S24, htp-v75 SM8650, ")


def test_bit_map_rows_end_with_the_head_side():
    bm = {
        "maps": [
            {
                "map": "assumed",
                "slm_graph_bytes": 760_000_000,
                "paper_bytes": 754_000_000,
                "diff_pct": 0.8,  # (760 - 754) / 754 = 0.796 %, rounded by the plan
                "by_bits": {"int2": 100_000_000, "int4": 500_000_000},
                "htp_graph_bytes": 860_000_000,
                "text": "rules",
            }
        ],
        "head_side": {"total_bytes": 365_500_000, "paper_bytes": 365_000_000, "diff_pct": 0.14, "note": "W4"},
    }
    assert bit_map_rows(bm) == [
        # int8 absent: 0.0 MB
        ["assumed", "760.0", "754", "+0.80", "100.0 / 500.0 / 0.0", "860.0", "rules"],
        ["head side (graph + E)", "365.5", "365", "+0.14", "", "", "W4"],
    ]


def test_tensor_rows_show_shape_and_encoding():
    enc = SimpleNamespace(dtype="uint16", scale=0.000123456789, zero_point=32768)
    g = SimpleNamespace(
        inputs=[SimpleNamespace(name="x", shape=[1, 8, 256], dtype="float32", encoding=None)],
        outputs=[SimpleNamespace(name="s", shape=[], dtype="uint16", encoding=enc)],
    )
    # a scalar has no dims; 0.000123456789 at 6 significant digits is 0.000123457
    assert tensor_rows(g) == [
        ["in", "x", "1x8x256", "float32", "-"],
        ["out", "s", "scalar", "uint16", "uint16 scale 0.000123457 zp 32768"],
    ]
