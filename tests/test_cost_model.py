"""Verifier cost model (hycoc.bench.cost_model.model) and its measuring script (benchmarks/verifier_cost_model.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from bench_scripts import load_script
from conftest import modules_loaded_by_import
from paths import ROOT as REPO

from hycoc.bench.cost_model.model import (
    PAPER_ROUND_MS,
    PREFILL_CHUNK,
    CostModel,
    CostModelError,
    CostPoint,
    Forward,
    load_cost_model,
    prefill_forwards,
    projected_g,
    projected_server_ms,
    request_forwards,
    round_forwards,
)

SCRIPT = REPO / "benchmarks" / "verifier_cost_model.py"

# A hand-built grid: rows {1, 5, 33} x contexts {100, 200}.
#   rows 1:  10 at t=100, 12 at t=200   (slope 0.02 ms/position)
#   rows 5:  14 at t=100, 18 at t=200   (slope 0.04)
#   rows 33: 30 at t=100, 26 at t=200   (slope -0.04: noise; clamped to 0 above the grid)
GRID = {(1, 100): 10.0, (1, 200): 12.0, (5, 100): 14.0, (5, 200): 18.0, (33, 100): 30.0, (33, 200): 26.0}


def make(points=GRID, **kw) -> CostModel:
    base = dict(
        device="test device",
        dtype="float32",
        model="hand-built",
        points=[CostPoint(rows=r, context=c, ms=ms) for (r, c), ms in points.items()],
    )
    return CostModel(**{**base, **kw})


def test_grid_points_are_exact():
    cm = make()
    for (r, c), ms in GRID.items():
        assert cm.predict(r, c) == pytest.approx(ms, abs=1e-12)
    assert list(cm.rows_grid) == [1, 5, 33] and list(cm.context_grid) == [100, 200]


def test_bilinear_inside_the_grid():
    cm = make()
    assert cm.predict(1, 150) == pytest.approx(11.0)  # linear in context
    assert cm.predict(3, 100) == pytest.approx(12.0)  # linear in rows: halfway 10 -> 14
    assert cm.predict(3, 150) == pytest.approx(13.5)  # centre of the cell: mean of 10, 12, 14, 18
    assert cm.predict(19, 125) == pytest.approx(0.5 * 15.0 + 0.5 * 29.0)  # rows 5..33 halfway, t quarter way


def test_inside_the_grid_it_is_scipys_linear_grid_interpolation():
    """`interpolate` (behind `CostModel.predict` and `predict_tables`) against scipy's RegularGridInterpolator
    (method "linear": bilinear on a rectilinear grid) at random points of a random 4 x 5 grid."""
    interpolate = pytest.importorskip("scipy.interpolate")
    import numpy as np

    from hycoc.bench.cost_model.model import interpolate as ours

    rng = np.random.default_rng(0)
    rows, ctxs = np.array([1, 3, 17, 33]), np.array([0, 64, 100, 512, 4096])
    ms = rng.uniform(1, 50, size=(len(rows), len(ctxs)))
    cm = make({(int(r), int(c)): float(ms[i, j]) for i, r in enumerate(rows) for j, c in enumerate(ctxs)})
    ref = interpolate.RegularGridInterpolator((rows.astype(float), ctxs.astype(float)), ms, method="linear")
    r = rng.integers(1, 34, size=50)
    c = rng.uniform(0, 4096, size=50)
    want = ref(np.stack([r, c], axis=1))
    assert [cm.predict(int(a), float(b)) for a, b in zip(r, c)] == pytest.approx(want, rel=1e-12)
    assert ours(rows, ctxs, np.stack([ms, 2 * ms]), r, c) == pytest.approx(np.stack([want, 2 * want]), rel=1e-12)


def test_context_extrapolation_rule():
    cm = make()
    assert cm.predict(1, 400) == pytest.approx(12.0 + 0.02 * 200)  # linear above, last two contexts' slope
    assert cm.predict(5, 1200) == pytest.approx(18.0 + 0.04 * 1000)
    assert cm.predict(33, 10_000) == pytest.approx(26.0)  # negative slope clamped: never below t=200
    assert cm.predict(1, 0) == pytest.approx(10.0)  # held below the smallest context
    assert cm.predict(3, 300) == pytest.approx(0.5 * 14.0 + 0.5 * 22.0)  # rows interpolation of the two lines
    single = make({(1, 64): 5.0, (33, 64): 9.0})  # one context: flat in t
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
    assert path.stat().st_mode & 0o777 == 0o644  # like the bench's other outputs; mkstemp alone makes 0600
    back = load_cost_model(path)
    assert back.source == "file"
    assert back == cm.model_copy(update={"source": "file"})
    assert back.predict(19, 125) == cm.predict(19, 125)


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d.pop("points"), r"field points is missing"),
        (lambda d: d.pop("device"), r"field device is missing"),
        (lambda d: d["points"][1].pop("ms"), r"field points\[1\]\.ms is missing"),
        (lambda d: d["points"][0].update(ms=-3.0), r"field points\[0\]\.ms: .*greater than 0"),
        (lambda d: d["points"][0].update(rows="many"), r"field points\[0\]\.rows"),
        (lambda d: d.update(speed=1), r"field speed is not a cost model field"),
        (lambda d: d.update(schema_version=3), r"schema_version = 3, this hycoc reads 1 and 2"),
        (lambda d: d["points"][0].update(kind="lm_head"), r"field points\[0\]\.kind"),
        (lambda d: d["points"].pop(), r"grid is incomplete"),
    ],
)
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
    assert modules_loaded_by_import("hycoc.bench.cost_model.model", ("torch",)) == []


def test_gpu_script_skips_cleanly_without_cuda(tmp_path):
    out = tmp_path / "never.json"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1"}
    res = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cuda", "--out", str(out)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert "skipped" in res.stdout and "CUDA" in res.stdout and len(res.stdout.strip().splitlines()) == 1
    assert not out.exists()


def test_measure_grid_on_a_tiny_random_verifier():
    """The GPU mode's code path (random weights, random KV cache, verify_tree) on the toy shape, on the CPU."""
    torch = pytest.importorskip("torch")
    from hycoc.bench.cost_model.measure import demo_parents

    vcm = _cost_script()
    model, head = _tiny_random()  # the random-weight mode's verifier and head
    assert list(demo_parents(8)) == [-1, 0, 1, 2, 3, 0, 1, 2]
    points = vcm.measure_grid(
        model, [1, 5], [8, 24], warmup=0, repeats=1, device="cpu", log=lambda *a: None, prefill_rows=[1, 4], head=head
    )
    cm = CostModel(device="cpu", dtype="float32", model="tiny", points=points)
    assert {(p.kind, p.rows, p.context) for p in points} == {
        ("verify", 1, 8),
        ("verify", 5, 8),
        ("verify", 1, 24),
        ("verify", 5, 24),
        ("head_step", 1, 8),
        ("head_step", 1, 24),
        ("prefill", 1, 8),
        ("prefill", 4, 8),
        ("prefill", 1, 24),
        ("prefill", 4, 24),
    }
    assert all(p.ms > 0 for p in points)
    assert cm.predict(3, 16) > 0 and cm.predict(2, 16, "prefill") > 0 and cm.predict(1, 16, "head_step") > 0
    table = vcm.round_table(cm, chain_length=4)  # rows 5 is the largest measured here: HyCo's column uses it
    assert [c.header for c in table.columns][:3] == ["context", "HyCo (5 rows)", "Cloud+MTP (4 steps + 5 rows)"]
    assert table.row_count == 3  # contexts 8, 24 and the paper's row
    assert torch.get_num_threads() >= 1


def _cost_script():
    """benchmarks/verifier_cost_model.py as a module."""
    return load_script("verifier_cost_model")


def _tiny_random(sliding_window: int | None = None):
    """A 2-layer random verifier of the toy's shape (one sliding, one full layer) and a random head for it."""
    vcm = _cost_script()
    cfg = json.loads((REPO / "recipes" / "toy" / "models" / "verifier" / "config.json").read_text())
    cfg.update(
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        per_layer_config={"1": cfg["per_layer_config"]["3"]},
    )
    if sliding_window is not None:
        cfg["sliding_window"] = sliding_window
    head_cfg = json.loads((REPO / "recipes" / "toy" / "models" / "head" / "config.json").read_text())
    model = vcm.build_random_verifier(cfg, "cpu", "float32")
    return model, vcm.build_random_head(head_cfg, cfg["hidden_size"], "cpu", "float32")


def test_the_cost_measurement_runs_on_the_engines_windowed_session_cache():
    """What is timed is what the server runs: a sliding layer of the measured cache holds the engine's retained
    positions (not the whole context), a full layer the context, and every timed forward is undone to that."""
    pytest.importorskip("torch")
    from hycoc.verifier.engine import verify_tree
    from hycoc.verifier.forward import NormTap
    from hycoc.verifier.kv_cache import SlidingWindowLayer, stores_kv
    from hycoc.verifier.kv_surgery import crop_cache

    from hycoc.bench.cost_model.measure import measure_grid, measuring_engine, random_cache

    model, head = _tiny_random(sliding_window=8)
    engine = measuring_engine(model, head, head_window=6)
    retain = engine.kv_retain
    assert retain == 129 < 200  # the toy head's sliding window (128) + 1
    cache = random_cache(model, 200, "cpu", engine.new_cache)
    layers = [layer for layer in cache.layers if stores_kv(layer)]
    sliding = [layer for layer in layers if isinstance(layer, SlidingWindowLayer)]
    assert sliding and len(sliding) < len(layers)
    assert all((layer.held, layer.start, layer.retain) == (retain, 200 - retain, retain) for layer in sliding)
    assert all(layer.keys.shape[-2] == 200 for layer in layers if layer not in sliding)
    assert cache.get_seq_length() == 200
    tap = NormTap(model)
    try:
        import torch

        verify_tree(model, cache, tap, torch.arange(5), torch.tensor([-1, 0, 1, 0, 3]).numpy(), 200, model.dtype)
        assert [layer.held for layer in sliding] == [retain + 5] * len(sliding)
        crop_cache(cache, 200)
    finally:
        tap.remove()
    assert [layer.held for layer in sliding] == [retain] * len(sliding) and cache.get_seq_length() == 200
    # a prefill chunk trims the sliding layers past the old positions: the measurement restores the cache instead
    from hycoc.verifier.forward import prefill

    from hycoc.bench.cost_model.measure import restore_cache, snapshot_cache

    before = [(layer.held, layer.start) for layer in sliding]
    saved = snapshot_cache(cache)
    tap = NormTap(model)
    try:
        prefill(model, cache, tap, torch.arange(64), 64, model.dtype, start=200)
    finally:
        tap.remove()
    assert [(layer.held, layer.start) for layer in sliding] == [(retain, 264 - retain)] * len(sliding)
    restore_cache(saved)
    assert [(layer.held, layer.start) for layer in sliding] == before and cache.get_seq_length() == 200
    assert all(layer.keys.shape[-2] == 200 for layer in layers if layer not in sliding)
    full = random_cache(model, 200, "cpu")  # without the engine: every layer keeps the whole context
    assert all(layer.keys.shape[-2] == 200 for layer in full.layers if stores_kv(layer))
    points = measure_grid(
        model,
        [1, 5],
        [200],
        warmup=0,
        repeats=2,
        device="cpu",
        log=lambda *a: None,
        head=head,
        prefill_rows=[64],
        new_cache=engine.new_cache,
    )
    assert {(p.kind, p.rows, p.context) for p in points} == {
        ("verify", 1, 200),
        ("verify", 5, 200),
        ("head_step", 1, 200),
        ("prefill", 64, 200),
    }


def test_the_bench_cost_model_measures_with_the_engines_cache(monkeypatch):
    """`measure_recipe_verifier` (what hycoc bench measures) hands `measure_grid` the engine's ``new_cache``."""
    pytest.importorskip("torch")
    import hycoc.models
    from hycoc.bench.cost_model import measure as cost_measure
    from hycoc.recipe import load_recipe

    model, head = _tiny_random()
    monkeypatch.setattr(hycoc.models, "load_verifier", lambda *a, **k: model)
    monkeypatch.setattr(hycoc.models, "load_head", lambda *a, **k: head)
    seen = {}

    def grid(model, rows_list, contexts, **kw):
        seen.update(kw)
        return [CostPoint(rows=r, context=c, ms=1.0) for r in rows_list for c in contexts]

    monkeypatch.setattr(cost_measure, "measure_grid", grid)
    recipe = load_recipe(REPO / "recipes" / "toy.toml")
    cm = cost_measure.measure_recipe_verifier(recipe, rows_list=(1, 5), contexts=(64,), threads=1)
    made = seen["new_cache"]()
    assert made.__class__.__name__ == "DynamicCache" and any(
        type(layer).__name__ == "SlidingWindowLayer" for layer in made.layers
    )
    assert seen["new_cache"].__self__.head_window == recipe.window.head_window
    assert "sliding layers keep" in cm.meta["kv_cache"]


# ---- every forward the server runs (docs/benchmarks.md "Benchmark": g projected) ---------------------------------

# The hand-built grid again, with head steps (rows 1) and prefill chunks (rows 1 and 512) at t = 100, 200:
#   head_step: 2 at t=100, 3 at t=200;  prefill rows 1: 10, 12;  prefill rows 512: 60, 70.
KINDED = (
    [CostPoint(rows=r, context=c, ms=ms) for (r, c), ms in GRID.items()]
    + [
        CostPoint(kind="head_step", rows=1, context=100, ms=2.0),
        CostPoint(kind="head_step", rows=1, context=200, ms=3.0),
    ]
    + [
        CostPoint(kind="prefill", rows=r, context=c, ms=ms)
        for (r, c), ms in {(1, 100): 10.0, (1, 200): 12.0, (512, 100): 60.0, (512, 200): 70.0}.items()
    ]
)


def make_kinded() -> CostModel:
    return CostModel(device="test device", dtype="float32", model="hand-built", points=KINDED)


def test_each_kind_has_its_own_grid():
    cm = make_kinded()
    assert cm.kinds == ("verify", "head_step", "prefill")
    assert cm.predict(1, 150, "head_step") == pytest.approx(2.5)
    assert cm.predict(1, 400, "head_step") == pytest.approx(3.0 + 0.01 * 200)  # slope of the last two contexts
    assert cm.predict(1, 150) == pytest.approx(11.0)  # verify is the default kind
    assert cm.predict(256, 100, "prefill") == pytest.approx(10.0 + 255 / 511 * 50.0)
    with pytest.raises(CostModelError, match=r"rows = 2 is outside the cost model's measured head_step rows \[1, 1\]"):
        cm.predict(2, 100, "head_step")
    with pytest.raises(CostModelError, match=r"has no head_step points.*remeasure"):
        make().predict(1, 100, "head_step")
    with pytest.raises(CostModelError, match=r"kind = 'lm_head'"):
        cm.predict(1, 100, "lm_head")
    with pytest.raises(ValueError, match=r"the prefill grid is incomplete.*rows=512, context=200"):
        CostModel(device="d", dtype="f", model="m", points=KINDED[:-1])


def test_round_forwards_per_draft_place():
    assert round_forwards("device", 33, 300) == [Forward("verify", 33, 300)]
    assert round_forwards("cloud-mtp", 5, 300, head_steps=4) == [Forward("head_step", 1, 300)] * 4 + [
        Forward("verify", 5, 300)
    ]
    assert (
        round_forwards("server-head", 33, 300, head_steps=4, head_context=256)
        == [Forward("verify", 33, 300)] + [Forward("head_step", 1, 256)] * 4
    )
    with pytest.raises(CostModelError, match="rows must be 5, got 33"):
        round_forwards("cloud-mtp", 33, 300, head_steps=4)
    with pytest.raises(CostModelError, match="runs no head step"):
        round_forwards("device", 33, 300, head_steps=4)
    with pytest.raises(CostModelError, match="draft_place = 'phone'"):
        round_forwards("phone", 33, 300)


def test_prefill_forwards_are_the_engines_chunks():
    assert prefill_forwards(0, 1100) == [
        Forward("prefill", 512, 0),
        Forward("prefill", 512, 512),
        Forward("prefill", 76, 1024),
    ]
    assert prefill_forwards(300, 340, chunk=16) == [
        Forward("prefill", 16, 300),
        Forward("prefill", 16, 316),
        Forward("prefill", 8, 332),
    ]
    assert prefill_forwards(50, 50) == []
    import inspect

    from hycoc.verifier.model import VerifierModel  # the engine's base holds its keyword arguments

    assert inspect.signature(VerifierModel).parameters["prefill_chunk"].default == PREFILL_CHUNK


def test_request_replay_counts_head_steps_and_prefill_exactly():
    """Hand-worked: the same 3 rounds as HyCo (33 rows), Cloud+MTP (5 rows) and server-head (33 rows, K = 4,
    W = 150), after a 100-token prompt prefill (positions [0, 100): one chunk of 100 at t = 0)."""
    cm = make_kinded()
    prefill = 10.0 + 99 / 511 * 50.0  # rows 100 at t = 0: held at t = 100
    ctx = [100, 104, 200]
    hyco = {"config": "hyco", "rows": [33, 33, 33], "context": ctx}
    cloud = {"config": "cloud-mtp", "rows": [5, 5, 5], "context": ctx}
    head = {"config": "server-head", "rows": [33, 33, 33], "context": ctx}
    v33 = [30.0, 30.0 - 4 / 100 * 4.0, 26.0]  # verify rows 33 at t = 100, 104, 200
    v5 = [14.0, 14.0 + 0.04 * 4, 18.0]
    step = [2.0, 2.04, 3.0]  # head step at t = 100, 104, 200
    assert cm.forwards_ms(f for g in request_forwards(hyco) for f in g) == pytest.approx(prefill + sum(v33))
    assert cm.forwards_ms(f for g in request_forwards(cloud) for f in g) == pytest.approx(
        prefill + sum(v5) + 4 * sum(step)
    )
    groups = request_forwards(head, chain_length=4, head_window=150)
    # after round 0 the head reads min(150, 104) = 104 columns, after round 1 min(150, 200) = 150; none after the last
    assert groups[2] == [Forward("verify", 33, 104)] + [Forward("head_step", 1, 150)] * 4
    assert groups[3] == [Forward("verify", 33, 200)]
    assert cm.forwards_ms(f for g in groups for f in g) == pytest.approx(prefill + sum(v33) + 4 * 2.04 + 4 * 2.5)
    assert projected_server_ms(cm, groups[1:]) == pytest.approx(sum(v33) + 4 * 2.04 + 4 * 2.5)
    with pytest.raises(CostModelError, match="needs the recipe's chain_length"):
        request_forwards(head)
    # a second turn prefills only the appended tokens [prefill_start, first root)
    turn2 = {"config": "hyco", "rows": [33], "context": [700], "prefill_start": 600}
    assert request_forwards(turn2)[0] == [Forward("prefill", 100, 600)]
    assert request_forwards(turn2, prefill=False)[0] == []


def test_bench_summary_projects_every_server_forward():
    """summary.summarize through the hand-built model: g projected and its parts, per-round medians beside the
    paper's 21.7 / 26.8 ms."""
    from hycoc.bench.paper.summary import summarize

    common = dict(run=0, question_id=1, category="writing", prompt_tokens=101, prefill_ms=5.0, tokens=6, rounds=2)
    common.update(context=[100, 200], accepted=[2, 1])
    recs = [
        dict(config="cloud-mtp", rows=[5, 5], server_ms=[40.0, 50.0], **common),
        dict(config="hyco", rows=[33, 33], server_ms=[20.0, 30.0], **common),
    ]
    s = summarize(recs, cost_model=make_kinded(), bootstrap=0, server={"chain_length": 4, "head_window": 150})
    prefill = 10.0 + 99 / 511 * 50.0
    cloud_rounds = [14.0 + 4 * 2.0, 18.0 + 4 * 3.0]
    assert s["cloud-mtp"]["g_projected_ms_per_token"] == pytest.approx((prefill + sum(cloud_rounds)) / 6)
    assert s["cloud-mtp"]["g_projected_parts"] == pytest.approx(
        {"verify": 32.0 / 6, "head_step": 20.0 / 6, "prefill": prefill / 6}
    )
    assert s["cloud-mtp"]["server_ms_per_round_projected_p50"] == pytest.approx(sum(cloud_rounds) / 2)
    assert s["cloud-mtp"]["server_ms_per_round_p50"] == pytest.approx(45.0)
    assert s["hyco"]["g_projected_parts"]["head_step"] == 0.0
    assert s["hyco"]["server_ms_per_round_projected_p50"] == pytest.approx(28.0)
    # verification alone charges cloud-mtp 32 of its 52 round ms (hyco's rounds 56 vs 32: +75%); with its head
    # steps counted the rounds are 56 vs 52 (+7.7%), plus the same prefill on both sides
    assert s["hyco"]["delta_g_projected_pct"] == pytest.approx(100 * ((prefill + 56.0) / (prefill + 52.0) - 1))
    assert PAPER_ROUND_MS == {"hyco": 21.7, "cloud-mtp": 26.8}


def test_schema_1_files_still_load_as_verify_points(tmp_path):
    d = json.loads(make().to_json())
    d["schema_version"] = 1
    for p in d["points"]:
        p.pop("kind")
    path = tmp_path / "v1.json"
    path.write_text(json.dumps(d))
    cm = load_cost_model(path)
    assert cm.kinds == ("verify",) and cm.predict(3, 150) == pytest.approx(13.5)


def test_the_batched_line_is_measured_and_read_back(tmp_path):
    """``--batch-sessions``: the batched line (hycoc/bench/cost_model/batch_line.py, the server's batch_forward) lands
    in the file as ``batch_points`` at every (sessions, rows) with rows >= sessions, loads back and is read by
    `CostModel.batch_ms`; rows spread over the sessions as evenly as they go."""
    pytest.importorskip("torch")
    from hycoc.bench.cost_model.batch_line import batch_grid, split_rows

    assert batch_grid([2, 1], [4, 1]) == [(1, 1), (1, 4), (2, 4)]
    assert split_rows(7, 3) == [3, 2, 2] and split_rows(4, 4) == [1, 1, 1, 1]
    out = tmp_path / "line.json"
    args = ["--device", "cpu", "--recipe", "recipes/toy.toml", "--contexts", "8", "--rows", "1,5", "--prefill-rows"]
    args += ["1,4", "--warmup", "0", "--repeats", "1", "--batch-sessions", "1,2", "--batch-rows", "1,4"]
    assert _cost_script().main(args + ["--batch-context", "8", "--out", str(out)]) == 0
    cm = load_cost_model(out)
    assert [(p.sessions, p.rows) for p in cm.batch_points] == [(1, 1), (1, 4), (2, 4)]
    assert cm.batch_context == 8 and all(p.ms > 0 and len(p.samples_ms) == 1 for p in cm.batch_points)
    assert cm.batch_ms(4, 2) == pytest.approx(cm.batch_points[2].ms)
