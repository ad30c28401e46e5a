"""Small numeric helpers shared by the packages, the tests and the benchmarks (numpy only; no torch).

    percentile   the q-th percentile of the finite values (numpy's default linear method), NaN (or ``empty``)
                 when there are none: the bench's and the load test's latency percentiles
    sqnr_db      signal-to-quantization-noise ratio in dB of an approximation against a reference: the QDQ
                 report, the HTP target's and the benchmarks' accuracy checks

One home for each, so a report and the test that checks it compute the same statistic.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import numpy as np


def percentile(values: Iterable[Any], q: float, *, empty: Any = math.nan) -> Any:
    """The q-th percentile (0 <= q <= 100) of the finite values of ``values`` (None, NaN and +-inf are left out),
    by linear interpolation between closest ranks: numpy's default ``method="linear"`` (Hyndman & Fan 1996, type
    7), so of 1..100 p50 = 50.5, p90 = 90.1, p99 = 99.01. Returns a Python float, or ``empty`` (default NaN)
    when no finite value is left. Raises ValueError for q outside [0, 100] (numpy's check)."""
    v = [float(x) for x in values if x is not None and math.isfinite(float(x))]
    return float(np.percentile(np.asarray(v, dtype=np.float64), q)) if v else empty


def sqnr_db(ref: np.ndarray, x: np.ndarray) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref`` in dB: 10 log10(sum ref^2 / sum (ref - x)^2),
    both taken as float64 arrays of one shape (ValueError when the shapes differ). +inf when x equals ref, -inf
    when ref is all zeros and x is not. onnxruntime's quantization debugger computes the same ratio as 20 log10 of
    the norms (``onnxruntime.quantization.qdq_loss_debug.compute_signal_to_quantization_noice_ratio``, which floors
    both norms at float64 eps)."""
    ref, x = np.asarray(ref, dtype=np.float64), np.asarray(x, dtype=np.float64)
    if ref.shape != x.shape:
        raise ValueError(f"sqnr_db: ref has shape {ref.shape}, x {x.shape}: they must match")
    noise = float(np.sum((ref - x) ** 2))
    if noise == 0:
        return math.inf
    signal = float(np.sum(ref**2))
    return -math.inf if signal == 0 else float(10 * np.log10(signal / noise))


__all__ = ["percentile", "sqnr_db"]
