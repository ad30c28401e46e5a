"""Modules split by job keep their old import path (docs/design.md "Layout"): `hycoc/recipe/__init__.py`,
`hycoc/bench/paper/runner.py` and `passes/qdq/quantize.py` re-export every public name they defined before the split, as
`hycoc/protocol/wire.py` does. The lists below are those modules' own public names read from the last commit before
each split, so a caller's ``from hycoc.recipe import X`` keeps working. Each re-exported object is the one its new
home defines (one definition, not a copy).
"""

from __future__ import annotations

import importlib

import pytest

FACADES = {
    "hycoc.recipe": [
        "Acceptance",
        "Bench",
        "CodePointRange",
        "CrossFieldError",
        "HANGUL_RANGES",
        "Handoff",
        "HeadQat",
        "KeepSet",
        "Link",
        "Models",
        "Problem",
        "Recipe",
        "RecipeError",
        "RecipeInfo",
        "Sampling",
        "Section",
        "SlmCalibration",
        "Target",
        "Tree",
        "Tune",
        "Verifier",
        "Window",
        "check_link",
        "describe_allowed",
        "find_line",
        "load_recipe",
        "parse_code_point_range",
        "parse_recipe",
    ],
    "hycoc.bench.paper.runner": [
        "BenchError",
        "BenchPlan",
        "CONFIGS",
        "COST_MODEL",
        "RECORDS",
        "RESULTS",
        "Request",
        "SETTINGS",
        "VerifierProcess",
        "atomic_write",
        "busy_since",
        "cost_model_for",
        "default_bundle_dir",
        "device_time_for",
        "make_console",
        "open_out",
        "print_results",
        "process_cpu_ms",
        "read_records",
        "record_of",
        "render_turns",
        "requests_of",
        "result_tables",
        "run_bench",
        "run_requests",
        "run_settings",
        "score_answers",
        "score_quality",
        "second_turn",
        "server_work",
        "turn_summary",
        "turns_table",
    ],
    "hycoc.passes.qdq.quantize": [
        "CalibrationError",
        "IntegerWeightSpec",
        "QdqError",
        "QdqQuantize",
        "QdqResult",
        "SCORE_FLOOR",
        "SOFTMAX_SCALE",
        "SOFTMAX_ZERO_POINT",
        "TANH_SCALE",
        "TANH_ZERO_POINT",
        "check_fixed_encodings",
        "fixed_overrides",
        "fold_integer_weights",
        "kv_wire_encoding",
        "layer_outputs",
        "qdq_io_encodings",
        "quantize_graph",
        "reciprocal_to_div",
        "slm_calibration_samples",
        "softmax_outputs",
        "softmax_overrides",
        "sqnr_db",
        "sqnr_report",
        "sqnr_table",
        "tensor_encoding",
        "verify_weights",
        "weight_overrides",
        "weights_from_arrays",
        "write_sqnr_json",
    ],
}


@pytest.mark.parametrize("module", sorted(FACADES))
def test_the_old_import_path_keeps_every_public_name(module):
    if module == "hycoc.passes.qdq.quantize":
        pytest.importorskip("onnx")
    facade = importlib.import_module(module)
    missing = [name for name in FACADES[module] if not hasattr(facade, name)]
    assert not missing, f"{module} no longer provides {missing}: re-export them from their new module"
    for name in FACADES[module]:
        obj = getattr(facade, name)
        home = getattr(obj, "__module__", None)
        if isinstance(home, str) and home.startswith("hycoc.") and hasattr(obj, "__qualname__"):
            assert getattr(importlib.import_module(home), obj.__qualname__) is obj, f"{module}.{name}"
    unlisted = sorted(set(FACADES[module]) - set(facade.__all__))
    assert not unlisted, f"{module}.__all__ lacks {unlisted}"
