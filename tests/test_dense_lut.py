"""EmbeddingLut.dense: the dequantized table a runtime gathers from equals `lookup` bit for bit (docs/device-runtime.md
"Host work per round")."""

from __future__ import annotations

import numpy as np
import pytest

from hycoc.host import EmbeddingLut


def _lut(bits: int, blocks: int, rows: int = 97, dim: int = 48, seed: int = 0) -> EmbeddingLut:
    rng = np.random.default_rng(seed)
    width = dim if bits == 8 else dim * bits // 8
    packed = (
        rng.integers(-128, 128, (rows, width)).astype(np.int8)
        if bits == 8
        else rng.integers(0, 256, (rows, width)).astype(np.uint8)
    )
    scale = rng.uniform(1e-3, 2e-2, (rows, blocks)).astype(np.float32)
    return EmbeddingLut(packed=packed, scale=scale, bits=bits, dim=dim, embed_scale=float(np.sqrt(dim)))


@pytest.mark.parametrize("bits,blocks", [(8, 1), (8, 4), (4, 1), (4, 3), (2, 2)])
def test_dense_rows_equal_lookup_bit_for_bit(bits, blocks):
    lut = _lut(bits, blocks)
    dense = lut.dense()
    assert dense.shape == (97, 48) and dense.dtype == np.float32
    ids = np.random.default_rng(1).integers(0, 97, 40)
    gathered = dense.take(ids.tolist(), axis=0)
    for got, i in zip(gathered, ids):  # one id at a time, as a lookup of its own
        assert np.array_equal(got.view(np.uint32), lut.lookup([int(i)])[0].view(np.uint32))
    assert np.array_equal(gathered.view(np.uint32), lut.lookup(ids).view(np.uint32))
    assert lut.dense() is dense  # computed once


def test_dense_is_none_over_the_byte_budget():
    lut = _lut(8, 1)
    assert lut.dense(max_bytes=97 * 48 * 4 - 1) is None
    assert lut.dense(max_bytes=97 * 48 * 4).shape == (97, 48)
