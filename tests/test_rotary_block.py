"""`hycoc.host.RotaryBlock`: rows of consecutive positions from a block computed once equal `RotaryTable.rows`
bit for bit (numpy's float32 cos/sin give each element the value it has alone), across block boundaries, jumps
back and forth and blocks shorter than a request (docs/device-runtime.md "Host work per round")."""

from __future__ import annotations

import numpy as np
import pytest

from hycoc.host import RotaryBlock, RotaryTable


def table(head_dim: int, theta: float, scaling: float = 1.0) -> RotaryTable:
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim)
    return RotaryTable(inv.astype(np.float32), scaling, head_dim)


@pytest.mark.parametrize("head_dim,theta,scaling", [(64, 10_000.0, 1.0), (128, 1_000_000.0, 1.0), (6, 10.0, 0.75)])
def test_block_rows_equal_fresh_rows(head_dim, theta, scaling):
    rot = table(head_dim, theta, scaling)
    block = RotaryBlock(rot, block=16)
    rng = np.random.default_rng(head_dim)
    first, checked = 0, 0
    for _ in range(300):
        first = max(0, first + int(rng.integers(-3, 9)) if rng.random() > 0.03 else int(rng.integers(0, 200_000)))
        count = int(rng.integers(1, 20))  # sometimes longer than the block
        cos, sin = block.rows(first, count)
        want_cos, want_sin = rot.rows(np.arange(first, first + count))
        assert cos.tobytes() == want_cos.tobytes() and sin.tobytes() == want_sin.tobytes(), (first, count)
        one_cos, _ = rot.rows(np.asarray([first + count - 1]))  # a position alone, as the head asks
        assert cos[-1:].tobytes() == one_cos.tobytes()
        checked += 1
    assert checked == 300 and 10 < block.computed < 250  # most calls read a block computed earlier


def test_rows_refuses_what_it_cannot_serve():
    block = RotaryBlock(table(4, 10.0), block=4)
    with pytest.raises(ValueError, match="need count >= 1 and first >= 0"):
        block.rows(-1, 1)
    with pytest.raises(ValueError, match="need count >= 1"):
        block.rows(3, 0)
    with pytest.raises(ValueError, match="at least 1 row"):
        RotaryBlock(table(4, 10.0), block=0)
