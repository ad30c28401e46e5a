"""The phone's drafting ms per HyCo round at each allowance (hycoc/device_time.py `allowance_round_ms`, the plan's
and a bundle's; `hycoc inspect RECIPE`'s table): K head steps always, an SLM pass (and its host term) only above the
floor K + 1, and at most (K + 1) / (R - K - D) SLM calls deferred per floor round to the next pass's catch-up.
Expected values from the rule and the graphs' own estimated call ms."""

from __future__ import annotations

import json

import pytest
from paths import ROOT
from typer.testing import CliRunner

from hycoc import device_time as dt
from hycoc.bench.paper import device_profile as dp
from hycoc.cli import app
from hycoc.inspect_plan import allowance_ranges


def test_the_floor_costs_the_head_steps_and_above_it_one_slm_pass_more():
    rounds = dt.allowance_round_ms(
        2.0, 10.0, chain_length=4, sibling_depth=2, tree_rows=33, slm_rows=32, slm_passes=1, host_ms_per_slm_pass=5.0
    )
    assert [r["allowance"] for r in rounds] == list(range(1, 34))
    for r in rounds:
        floor = r["allowance"] <= 5
        assert r["head_calls"] == 4 and r["slm_calls"] == (0 if floor else 1)
        assert r["ms"] == pytest.approx(4 * 2.0 + (0 if floor else 10.0 + 5.0))
        # a floor round commits at most K + 1 = 5 tokens; the catch-up runs them R - K - D = 26 rows a call
        assert r["deferred_slm_ms_max"] == pytest.approx(5 / 26 * 10.0 if floor else 0.0, abs=1e-3)
    two = dt.allowance_round_ms(2.0, 10.0, chain_length=4, sibling_depth=2, tree_rows=33, slm_rows=32, slm_passes=2)
    assert two[-1]["slm_calls"] == 2 and two[-1]["ms"] == pytest.approx(8.0 + 20.0)
    with pytest.raises(ValueError, match="slm_rows > K \\+ D"):
        dt.allowance_round_ms(1.0, 1.0, chain_length=4, sibling_depth=2, tree_rows=33, slm_rows=6)
    assert allowance_ranges(rounds) == [
        {"from": 1, "to": 5, "head_calls": 4, "slm_calls": 0, "ms": 8.0, "deferred_slm_ms_max": 1.923},
        {"from": 6, "to": 33, "head_calls": 4, "slm_calls": 1, "ms": 23.0, "deferred_slm_ms_max": 0.0},
    ]


@pytest.mark.parametrize("recipe", ["gemma4", "toy"])
def test_inspect_prints_the_round_at_each_allowance_from_the_graphs_estimates(recipe):
    result = CliRunner().invoke(app, ["inspect", str(ROOT / "recipes" / f"{recipe}.toml"), "--json"])
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)
    est, r = plan["device_time_estimate"], plan["round"]
    head, slm = est["graphs"]["head"]["estimate_ms"], est["graphs"]["slm"]["estimate_ms"]
    host, k = est["npu_profile"]["host_ms_per_slm_pass"], r["chain_length"]
    rounds = est["allowance_rounds"]
    assert len(rounds) == r["tree_rows"]
    for row in rounds:
        want = k * head + (slm + host if row["allowance"] > k + 1 else 0.0)
        assert row["ms"] == pytest.approx(want, abs=0.01)  # the per-call estimates are rounded to 3 decimals
    text = CliRunner().invoke(app, ["inspect", str(ROOT / "recipes" / f"{recipe}.toml")]).stdout
    assert "HyCo's phone ms per round at each allowance" in text
    assert f"1-{k + 1}" in text and f"{k + 2}-{r['tree_rows']}" in text


def test_a_bundles_rounds_price_its_own_graphs(tiny_bundle):
    costs = {"head": 1.5, "slm": 4.0, "slm_decode": 9.0}
    manifest = json.loads((tiny_bundle.bundle / "manifest.json").read_text())
    r = manifest["round"]
    rounds = dp.bundle_allowance_rounds(tiny_bundle.bundle, costs)
    assert len(rounds) == r["node_budget"] + 1
    k = r["chain_length"]
    for row in rounds:
        assert row["ms"] == pytest.approx(k * 1.5 + (4.0 * r["slm_passes"] if row["allowance"] > k + 1 else 0.0))
    with pytest.raises(dp.DeviceProfileError, match="no device time for graph head"):
        dp.bundle_allowance_rounds(tiny_bundle.bundle, {"slm": 1.0})
