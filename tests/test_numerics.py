"""`hycoc.numerics`: the one percentile and the one SQNR, each against a reference nobody here wrote (Python's
``statistics.quantiles`` and onnxruntime's quantization debugger)."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest

from hycoc.numerics import percentile, sqnr_db


def test_percentile_is_hyndman_fan_type_7_as_the_standard_library_computes_it():
    rng = np.random.default_rng(0)
    for n in (2, 3, 10, 101):
        data = rng.normal(size=n).tolist()
        # statistics.quantiles(method="inclusive") is type 7: the cut points at 1%, ..., 99%
        cuts = statistics.quantiles(data, n=100, method="inclusive")
        for q in (1, 25, 50, 90, 99):
            assert percentile(data, q) == pytest.approx(cuts[q - 1], rel=1e-12, abs=1e-12)
    assert percentile(range(1, 101), 90) == pytest.approx(90.1)


def test_percentile_leaves_out_what_is_not_a_finite_number_and_says_when_nothing_is_left():
    assert percentile([1.0, None, math.nan, math.inf, 3.0], 50) == 2.0
    assert math.isnan(percentile([], 50)) and percentile([None, math.nan], 50, empty=None) is None
    assert percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        percentile([1.0, 2.0], 101)


def test_sqnr_matches_onnxruntimes_quantization_debugger():
    debug = pytest.importorskip("onnxruntime.quantization.qdq_loss_debug")
    rng = np.random.default_rng(1)
    ref = rng.normal(size=(4, 33)).astype(np.float32)
    for noise in (1e-1, 1e-3):
        x = (ref + noise * rng.normal(size=ref.shape)).astype(np.float32)
        want = debug.compute_signal_to_quantization_noice_ratio(ref.astype(np.float64), x.astype(np.float64))
        assert sqnr_db(ref, x) == pytest.approx(want, rel=1e-9)


def test_sqnr_edges():
    ref = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert sqnr_db(ref, ref) == math.inf
    assert sqnr_db(np.zeros(3), np.ones(3)) == -math.inf
    # noise power 1/100 of the signal's: 20 dB
    assert sqnr_db(np.array([10.0]), np.array([9.0])) == pytest.approx(20.0)
