"""Verifier cost model (hycoc.bench.cost_model) and its measuring script (benchmarks/verifier_cost_model.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hycoc.bench.cost_model import (CostModel, CostModelError, CostPoint, load_cost_model, projected_g,
                              projected_server_ms)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "verifier_cost_model.py"

# A hand-built grid: rows {1, 5, 33} x contexts {100, 200}.
#   rows 1:  10 at t=100, 12 at t=200   (slope 0.02 ms/position)
#   rows 5:  14 at t=100, 18 at t=200   (slope 0.04)
#   rows 33: 30 at t=100, 26 at t=200   (slope -0.04: noise; clamped to 0 above the grid)
GRID = {(1, 100): 10.0, (1, 200): 12.0, (5, 100): 14.0, (5, 200): 18.0, (33, 100): 30.0, (33, 200): 26.0}


def make(points=GRID, **kw) -> CostModel:
    base = dict(device="test device", dtype="float32", model="hand-built",
                points=[CostPoint(rows=r, context=c, ms=ms) for (r, c), ms in points.items()])
    return CostModel(**{**base, **kw})


def test_grid_points_are_exact():
    cm = make()
    for (r, c), ms in GRID.items():
        assert cm.predict(r, c) == pytest.approx(ms, abs=1e-12)
    assert list(cm.rows_grid) == [1, 5, 33] and list(cm.context_grid) == [100, 200]


def test_bilinear_inside_the_grid():
    cm = make()
    assert cm.predict(1, 150) == pytest.approx(11.0)       # linear in context
    assert cm.predict(3, 100) == pytest.approx(12.0)       # linear in rows: halfway 10 -> 14
    assert cm.predict(3, 150) == pytest.approx(13.5)       # centre of the cell: mean of 10, 12, 14, 18
    assert cm.predict(19, 125) == pytest.approx(0.5 * 15.0 + 0.5 * 29.0)  # rows 5..33 halfway, t quarter way


def test_context_extrapolation_rule():
    cm = make()
    assert cm.predict(1, 400) == pytest.approx(12.0 + 0.02 * 200)   # linear above, last two contexts' slope
    assert cm.predict(5, 1200) == pytest.approx(18.0 + 0.04 * 1000)
    assert cm.predict(33, 10_000) == pytest.approx(26.0)           # negative slope clamped: never below t=200
    assert cm.predict(1, 0) == pytest.approx(10.0)                 # held below the smallest context
    assert cm.predict(3, 300) == pytest.approx(0.5 * 14.0 + 0.5 * 22.0)  # rows interpolation of the two lines
    single = make({(1, 64): 5.0, (33, 64): 9.0})                  # one context: flat in t
    assert single.predict(17, 10_000) == pytest.approx(7.0)


def test_rows_outside_the_grid_and_negative_context_are_errors():
    cm = make()
    with pytest.raises(CostModelError, match=r"rows = 65 is outside .*\[1, 33\].*--rows 1,5,33,65"):
        cm.predict(65, 100)
    with pytest.raises(CostModelError, match="context = -1"):
        cm.predict(1, -1)


def test_projected_server_ms_and_g():
    cm = make()
    rounds = [(33, 100), (33, 200), (5, 150)]
    assert projected_server_ms(cm, rounds) == pytest.approx(30.0 + 26.0 + 16.0)
    assert projected_g(cm, rounds, output_tokens=8) == pytest.approx(72.0 / 8)
    assert projected_server_ms(cm, []) == 0.0
    with pytest.raises(CostModelError, match="output_tokens"):
        projected_g(cm, rounds, output_tokens=0)


def test_grid_must_be_complete_and_unique():
    with pytest.raises(ValueError, match=r"grid is incomplete.*rows=5, context=200"):
        make({k: v for k, v in GRID.items() if k != (5, 200)})
    with pytest.raises(ValueError, match="appears twice"):
        CostModel(device="d", dtype="f", model="m", points=[CostPoint(rows=1, context=0, ms=1.0)] * 2)


def test_save_load_round_trip(tmp_path):
    cm = make(shape={"layers": 30}, meta={"repeats": 10})
    path = cm.save(tmp_path / "sub" / "cm.json")
    assert [p.name for p in path.parent.iterdir()] == ["cm.json"]  # no temporary file left behind
    back = load_cost_model(path)
    assert back.source == "file"
    assert back == cm.model_copy(update={"source": "file"})
    assert back.predict(19, 125) == cm.predict(19, 125)


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.pop("points"), r"field points is missing"),
    (lambda d: d.pop("device"), r"field device is missing"),
    (lambda d: d["points"][1].pop("ms"), r"field points\[1\]\.ms is missing"),
    (lambda d: d["points"][0].update(ms=-3.0), r"field points\[0\]\.ms: .*greater than 0"),
    (lambda d: d["points"][0].update(rows="many"), r"field points\[0\]\.rows"),
    (lambda d: d.update(speed=1), r"field speed is not a cost model field"),
    (lambda d: d.update(schema_version=2), r"schema_version = 2, this hycoc reads 1"),
    (lambda d: d["points"].pop(), r"grid is incomplete"),
])
def test_bad_files_name_the_field(tmp_path, mutate, match):
    d = json.loads(make().to_json())
    mutate(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(CostModelError, match=match) as e:
        load_cost_model(path)
    assert str(path) in str(e.value) and "verifier_cost_model.py" in str(e.value)


def test_missing_and_non_json_files(tmp_path):
    with pytest.raises(CostModelError, match=r"no such cost model file.*--device cuda"):
        load_cost_model(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(CostModelError, match=r"not JSON \(line 1"):
        load_cost_model(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("[1, 2]")
    with pytest.raises(CostModelError, match="expected a JSON object"):
        load_cost_model(tmp_path / "y.json")


def test_cost_model_module_does_not_import_torch():
    code = "import sys, hycoc.bench.cost_model; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gpu_script_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "never.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run([sys.executable, str(SCRIPT), "--device", "cuda", "--out", str(out)],
                         capture_output=True, text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    assert "skipped" in res.stdout and "CUDA" in res.stdout and len(res.stdout.strip().splitlines()) == 1
    assert not out.exists()


def test_measure_grid_on_a_tiny_random_verifier():
    """The GPU mode's code path (random weights, random KV cache, verify_tree) on the toy shape, on the CPU."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import verifier_cost_model as vcm
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    cfg = json.loads((REPO / "recipes" / "toy" / "models" / "verifier" / "config.json").read_text())
    cfg.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"], 
               per_layer_config={"1": cfg["per_layer_config"]["3"]})
    model = vcm.build_random_verifier(cfg, "cpu", "float32")
    assert list(vcm.demo_parents(8)) == [-1, 0, 1, 2, 3, 0, 1, 2]
    points = vcm.measure_grid(model, [1, 5], [8, 24], warmup=0, repeats=1, device="cpu", log=lambda *a: None)
    cm = CostModel(device="cpu", dtype="float32", model="tiny", points=points)
    assert {(p.rows, p.context) for p in points} == {(1, 8), (5, 8), (1, 24), (5, 24)}
    assert all(p.ms > 0 for p in points)
    assert cm.predict(3, 16) > 0
    assert torch.get_num_threads() >= 1
