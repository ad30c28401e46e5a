"""Device time when no on-device profile exists (hycoc/device_time.py) and its pricing of bench rounds
(hycoc/bench/paper/device_profile.py). The fit against the paper's anchors at the Gemma 4 shapes is in
tests/test_plan.py (it reuses that module's plan)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hycoc import device_time as dt
from hycoc.bench.paper import device_profile as dp


def _matmul_graph(path, rows: int = 32, k: int = 16, n: int = 24):
    import onnx
    from hycoc.targets.float_graph import float_model
    from onnx import helper as h
    from onnx import numpy_helper as nh

    w = np.ones((k, n), np.int8)
    inits = [
        nh.from_array(w, "w"),
        nh.from_array(np.array(0.01, np.float32), "ws"),
        nh.from_array(np.array(0, np.int8), "wz"),
    ]
    nodes = [h.make_node("DequantizeLinear", ["w", "ws", "wz"], ["wd"]), h.make_node("MatMul", ["x", "wd"], ["y"])]
    onnx.save(float_model(nodes, "g", ("x", [1, rows, k]), ("y", [1, rows, n]), inits), str(path))
    return path


def test_onnx_graph_cost_counts_matmul_macs_weights_and_16bit_io(tmp_path):
    c = dt.onnx_graph_cost(_matmul_graph(tmp_path / "g.onnx"))
    assert c.macs == 32 * 16 * 24
    assert c.bytes == 16 * 24 + 4 + 1 + 2 * (32 * 16 + 32 * 24)  # int8 weight, its scale and zero point, A16 IO


def test_call_ms_is_overhead_plus_bytes_over_bandwidth_plus_macs_over_rate():
    p = dt.NpuProfile("x", bandwidth_gbps=100.0, tmacs=10.0, overhead_ms=0.5, host_ms_per_slm_pass=0.0)
    assert p.call_ms(dt.GraphCost(bytes=1e9, macs=2e12)) == pytest.approx(0.5 + 10.0 + 200.0)
    assert dt.NPU_PROFILES["v81"].tmacs is None  # the anchors do not bound the MAC rate (tests/test_plan.py)
    assert dt.NPU_PROFILES["v81"].call_ms(dt.GraphCost(1e9, 1e15)) == pytest.approx(3.511 + 1e9 / 98.24e6)


def _record(
    config, rounds, tokens, draft_ms, graph_ms, calls, seconds, prefill_calls=None, fill_ms=0.0, fill_graph_ms=0.0
):
    return {
        "config": config,
        "rounds": rounds,
        "tokens": tokens,
        "draft_ms": draft_ms,
        "draft_graph_ms": graph_ms,
        "draft_calls": calls,
        "seconds": seconds,
        "prefill_calls": prefill_calls or {},
        "slm_prefill_ms": fill_ms,
        "slm_prefill_graph_ms": fill_graph_ms,
    }


def test_project_records_prices_the_calls_each_round_ran():
    costs = {"head": 5.0, "slm": 16.0, "slm_decode": 12.0}
    records = [
        # hyco: 10 rounds, K=4 head steps in 9 of them + 10 SLM passes; 300 ms on this CPU of which 250 in graphs
        _record("hyco", 10, 40, 300.0, 250.0, {"head": 36, "slm": 10}, 2.0, {"slm": 3}, 90.0, 80.0),
        _record("slm-alone", 20, 20, 400.0, 380.0, {"slm_decode": 20}, 0.5, {"slm": 3}, 90.0, 80.0),
        {"config": "old", "rounds": 1, "tokens": 1, "draft_ms": 1.0, "seconds": 1.0},  # no draft_calls: skipped
    ]
    p = dp.project_records(records, costs)
    assert set(p) == {"hyco", "slm-alone"}
    h = p["hyco"]
    phone = 36 * 5.0 + 10 * 16.0 + (300.0 - 250.0)  # 390 ms over 10 rounds
    assert h["phone_draft_ms_per_round"] == 39.0 and h["phone_draft_ms_per_token"] == round(phone / 40, 3)
    assert h["host_ms_per_round"] == 5.0 and h["cpu_draft_ms_per_round"] == 30.0
    assert h["calls_per_round"] == {"head": 3.6, "slm": 1.0}
    seconds = 2.0 - 0.300 + phone / 1000 - 0.090 + (3 * 16.0 + 10.0) / 1000
    assert h["phone_tok_per_s"] == round(40 / seconds, 3) and h["cpu_tok_per_s"] == 20.0
    s = p["slm-alone"]
    assert s["phone_draft_ms_per_round"] == 12.0 + 1.0  # one decode call + 1 ms host per token


def test_a_sharded_slm_prices_as_the_sum_of_its_shards():
    assert dp.call_ms("slm", {"slm.s0": 4.0, "slm.s1": 6.0, "head": 1.0}) == 10.0
    with pytest.raises(dp.DeviceProfileError, match="no device time for graph slm_decode"):
        dp.call_ms("slm_decode", {"slm": 1.0})


def test_summarize_profile_without_a_list_uses_the_single_estimate():
    s = dp.summarize_profile(
        {
            "execution_summary": {"estimated_inference_time": 12_345, "estimated_inference_peak_memory": 7},
            "execution_detail": [],
        }
    )
    assert (s["execute_ms_median"], s["execute_ms_p90"], s["runs"], s["peak_memory_bytes"]) == (12.345, 12.345, 1, 7)
    with pytest.raises(dp.DeviceProfileError, match="no inference time"):
        dp.summarize_profile({"execution_summary": {}})


def test_load_device_costs_reads_medians_and_refuses_other_files(tmp_path):
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"device": "Samsung Galaxy S26 (Family)", "graphs": {"slm": {"execute_ms_median": 9.5}}}))
    assert dp.load_device_costs(f) == (
        {"slm": 9.5},
        "profiled on Samsung Galaxy S26 (Family) (AI Hub, median execute time per call)",
    )
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(dp.DeviceProfileError, match="not a device_profile.json"):
        dp.load_device_costs(tmp_path / "bad.json")


def test_the_bundle_records_each_graphs_bytes_and_macs(tiny_bundle):
    """report.json's graph_costs (written at build time from the QDQ graphs) equal the cost read from the cpu
    bundle's own graph files, and the estimate prices every graph of the bundle."""
    costs = dt.bundle_graph_costs(tiny_bundle.bundle)
    manifest = json.loads((tiny_bundle.bundle / "manifest.json").read_text())
    for g in manifest["graphs"]:
        assert costs[g["name"]] == dt.onnx_graph_cost(tiny_bundle.bundle / g["file"])
        assert costs[g["name"]].macs > 0
    est, label = dp.estimated_device_costs(tiny_bundle.bundle)
    assert label.startswith("ESTIMATE") and set(est) == {"head", "slm", "slm_decode"}
    assert all(v > dt.NPU_PROFILES["v81"].overhead_ms for v in est.values())


def test_cli_profile_without_a_token_and_bench_with_a_bad_profile_fail_in_one_line(tmp_path, monkeypatch):
    from pathlib import Path

    from typer.testing import CliRunner

    from hycoc.cli import app

    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    r = CliRunner().invoke(app, ["profile", str(tmp_path)])  # not a bundle: said before any token lookup
    assert r.exit_code == 1 and r.stderr.startswith(f"hycoc profile: bundle {tmp_path}: not a bundle (no manifest")
    htp = SimpleNamespace(target=SimpleNamespace(backend="htp", name="htp-v81", htp_arch=81), graphs=[])
    monkeypatch.setattr("hycoc.bundle.load_manifest", lambda path: htp)  # an htp bundle: then the token
    r = CliRunner().invoke(app, ["profile", str(tmp_path)])
    assert r.exit_code == 1
    assert r.stderr.startswith("hycoc profile: target qai-hub: ") and "qai-hub configure --api_token" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    monkeypatch.undo()
    (tmp_path / "bad.json").write_text("[]")
    toy = Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"
    r = CliRunner().invoke(app, ["bench", str(toy), "--device-profile", str(tmp_path / "bad.json")])
    assert r.exit_code == 1 and "not a device_profile.json written by `hycoc profile`" in r.stderr


def test_cli_profile_refuses_a_cpu_bundle_before_asking_for_a_token(tiny_bundle, tmp_path, monkeypatch):
    """A bundle built for the cpu target has no context binaries: `hycoc profile` says so in one line naming the
    target and the fix, and never looks for an AI Hub token (it used to ask for one first)."""
    from hycoc.targets import qai_hub
    from typer.testing import CliRunner

    from hycoc.bundle import load_manifest
    from hycoc.cli import app

    def no_token_lookup(*args, **kwargs):
        raise AssertionError("the AI Hub token was looked up for a cpu bundle")

    monkeypatch.setattr(qai_hub, "check_setup", no_token_lookup)
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.qai_hub/client.ini
    target = load_manifest(tiny_bundle.bundle).target.name
    assert target == "cpu"
    r = CliRunner().invoke(app, ["profile", str(tiny_bundle.bundle)])
    assert r.exit_code == 1, r.output
    assert r.stderr.count("\n") == 1 and "token" not in r.stderr
    assert r.stderr.startswith(f"hycoc profile: {tiny_bundle.bundle}: built for target {target}, ")
    assert "profile needs an htp-* or qai-hub bundle" in r.stderr and "--target htp-v81" in r.stderr
