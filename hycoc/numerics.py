"""Numeric comparisons shared by the compiler's passes, the targets and the benchmarks (numpy only)."""

from __future__ import annotations

import numpy as np


def sqnr_db(ref, x) -> float:
    """Signal-to-quantization-noise ratio of ``x`` against ``ref``, in dB: 10 log10(sum ref^2 / sum (ref - x)^2).

    ``ref`` and ``x``: arrays of one shape (any dtype numpy casts to float64; summed in float64). Returns ``inf``
    when ``x`` equals ``ref`` (no noise, all-zero arrays included) and ``-inf`` when ``ref`` is all zeros and ``x``
    is not. Raises ValueError when the shapes differ. Each bit of a uniform quantizer is worth about 6.02 dB.
    """
    ref, x = np.asarray(ref, np.float64), np.asarray(x, np.float64)
    if ref.shape != x.shape:
        raise ValueError(f"sqnr_db: ref has shape {ref.shape}, x {x.shape}: they must match")
    noise = float(np.sum((ref - x) ** 2))
    if noise == 0:
        return float("inf")
    signal = float(np.sum(ref**2))
    return float("-inf") if signal == 0 else float(10 * np.log10(signal / noise))
