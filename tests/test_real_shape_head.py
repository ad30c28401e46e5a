"""benchmarks/real_shape_head.py (the head's real-shape build check, docs/compiler.md and docs/real-shapes.md) at a tiny
size: the whole chain runs, the JSON report has its keys, and the QDQ model it writes passes the ONNX checker.

The tiny run uses ``--toy-dims`` (hidden 64, vocab 4,096): at the real widths one layer alone is ~43M weights and
the chain takes minutes, not seconds. The real-shape numbers come from running the script itself (runs/).
"""

from __future__ import annotations

import json

import pytest
from bench_scripts import load_script

pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")


@pytest.fixture(scope="module")
def tiny_report(tmp_path_factory):
    real_shape_head = load_script("real_shape_head")
    tmp = tmp_path_factory.mktemp("real-shape-head")
    out, work = tmp / "report.json", tmp / "work"
    report = real_shape_head.main(
        "--keep-set 512 --window 16 --layers 1 --skip-compile --toy-dims --samples 2 --blocks none".split()
        + ["--out", str(out), "--work", str(work), "--keep-work", "--quiet"]
    )
    return report, out, work


def test_report_keys(tiny_report):
    report, out, _ = tiny_report
    on_disk = json.loads(out.read_text())
    assert on_disk["steps"] == json.loads(json.dumps(report["steps"], default=str))
    for key in (
        "what",
        "total_seconds",
        "args",
        "shapes",
        "assumptions",
        "machine",
        "versions",
        "steps",
        "peak_rss_gib",
        "failed",
        "needs",
    ):
        assert key in on_disk, key
    assert on_disk["failed"] == []
    steps = {r["step"]: r for r in on_disk["steps"]}
    for name in ("build_head", "keep_set_restrict", "w4_clip_search", "export", "qdq"):
        assert steps[name]["status"] == "ok", (name, steps[name].get("error"))
        for key in ("seconds", "peak_rss_gib", "peak_tree_rss_gib", "output_bytes"):
            assert key in steps[name], (name, key)
        assert steps[name]["peak_rss_gib"] > 0
    assert not any(name.endswith(("_compile", "_sim")) for name in steps)  # --skip-compile
    assert on_disk["shapes"]["keep_set"] == 512 and on_disk["shapes"]["window"] == 16
    assert on_disk["shapes"]["real_shapes"] is False  # --toy-dims says so
    qdq = steps["qdq"]["details"]
    assert qdq["weight_bits"] == {"4": qdq["weights_bit_exact"]} and qdq["weights_bit_exact"] > 0
    assert qdq["checker"] == "ok"
    assert steps["export"]["details"]["rms_norms"] > 0
    assert steps["w4_clip_search"]["details"]["bits"] == 4


def test_qdq_model_passes_checker(tiny_report):
    import onnx

    _, _, work = tiny_report
    path = work / "qdq" / "model_qdq.onnx"
    assert path.exists()
    onnx.checker.check_model(str(path), full_check=True)
    model = onnx.load(str(path), load_external_data=False)
    assert [i.name for i in model.graph.input][:2] == ["x_hat", "k_sliding"]
    dims = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    assert dims["mask_full"] == [1, 1, 1, 16]
    assert [d.dim_value for d in model.graph.output[0].type.tensor_type.shape.dim] == [1, 1, 512]
    int4 = [t for t in model.graph.initializer if t.data_type == onnx.TensorProto.INT4]
    assert int4, "W4 weights are int4 initializers"
