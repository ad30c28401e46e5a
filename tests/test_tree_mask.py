"""`hycoc.runtime.tree_mask.TreeRingMask`: the SLM's ring + ancestor mask updated in place equals
`hycoc.host.tree_ring_mask` built from scratch, bit for bit, over random sequences of forwards, commits, ring
wraps and request restarts; in steady state no update rewrites the whole ring (docs/device-runtime.md "Host work per
round"). `ancestor_matrix`'s bit-packed path (up to 64 rows) equals its row-by-row path."""

from __future__ import annotations

import numpy as np
import pytest
from hycoc.runtime.tree_mask import HeadRingMask, TreeRingMask

from hycoc.host import (
    FULL,
    MASK_VALUE,
    SLIDING,
    TreeShapeError,
    ancestor_matrix,
    ring_masks,
    tree_depths,
    tree_ring_mask,
    tree_rows,
)

ROWS = 6


def random_parents(rng, rows: int) -> list[int]:
    """A tree in topological order, its tail padded as the SLM Drafter pads (the last row again)."""
    n = int(rng.integers(1, rows + 1))
    parents = [-1] + [int(rng.integers(0, j)) for j in range(1, n)]
    while len(parents) < rows:
        parents.append(max(parents[-1], 0))
    return parents


@pytest.mark.parametrize("ring,sliding_window", [(8, None), (8, 8), (12, 5), (5, 9), (16, 3)])
def test_updates_equal_fresh_masks_over_rounds_commits_wraps_and_restarts(ring, sliding_window):
    rng = np.random.default_rng(ring * 100 + (sliding_window or 0))
    mask = TreeRingMask(ROWS, ring, sliding_window)
    checked = restarts = 0
    t = live = n_kv = 0
    for step in range(400):
        event = rng.random()
        if step == 0 or event < 0.04:  # a request (re)starts: a prompt of any length
            t = int(rng.integers(0, 4 * ring))
            live = n_kv = max(0, t - ring)
            mask.reset() if rng.random() < 0.5 else None  # the drafter resets; a bare new live_start must do too
            restarts += 1
        elif event < 0.08:  # a long new turn: the first row jumps by more than W
            t += int(rng.integers(ring, 3 * ring))
        # a round: the first forward at n_kv (committed rows without KV first), later ones at t
        for first in [n_kv] + [t] * int(rng.integers(0, 3)):
            parents = random_parents(rng, ROWS)
            if rng.random() < 0.5:  # the caller's depths, ancestors and tree block
                anc = ancestor_matrix(parents)
                got = mask.update(
                    parents,
                    first,
                    live,
                    depths=tree_depths(parents),
                    ancestors=anc,
                    tree_block=np.where(anc, np.float32(0.0), np.float32(MASK_VALUE)),
                )
            else:
                got = mask.update(parents, first, live)
            want = tree_ring_mask(parents, first, live, ring, sliding_window)
            assert got.shape == want.shape and got.tobytes() == want.tobytes(), (step, first, live, parents)
            checked += 1
        moved = int(rng.integers(0, ROWS + 1))  # commit: the path's KV moves, plus the bonus token
        n_kv = t + 1 + moved if rng.random() < 0.8 else n_kv
        t += 1 + moved + int(rng.integers(0, 2))
        n_kv = min(n_kv, t)
    assert checked > 700 and restarts > 5
    assert mask.full_rebuilds < checked / 2  # most updates were incremental


def test_steady_rounds_rewrite_only_the_changed_columns():
    mask = TreeRingMask(ROWS, 64, 64)
    parents = [-1, 0, 1, 1, 3, 3]
    for first in range(100, 700, 3):  # many wraps of the 64-column ring
        mask.update(parents, first, 0)
    assert mask.full_rebuilds == 1  # only the first update wrote every ring column
    mask.update(parents, 900, 0)  # a jump by more than W rebuilds
    assert mask.full_rebuilds == 2
    mask.update(parents, 901, 5)  # so does a new live_start (a request restart)
    assert mask.full_rebuilds == 3


def test_update_returns_one_buffer_and_refuses_what_tree_ring_mask_refuses():
    mask = TreeRingMask(3, 4, None)
    a = mask.update([-1, 0, 0], 10, 0)
    b = mask.update([-1, 0, 1], 11, 0)
    assert a is b is mask.buffer
    with pytest.raises(TreeShapeError, match="live_start 12 is after"):
        mask.update([-1, 0, 0], 11, 12)
    with pytest.raises(TreeShapeError, match="row 2 has parent 2"):
        mask.update([-1, 0, 2], 11, 0)
    with pytest.raises(TreeShapeError, match="4 rows given, the mask has 3"):
        mask.update([-1, 0, 0, 0], 11, 0)
    with pytest.raises(ValueError, match="ring >= 1"):
        TreeRingMask(3, 0, None)


def test_ancestor_matrix_bit_path_equals_the_row_by_row_path():
    rng = np.random.default_rng(3)
    for n in [1, 2, 3, 8, 31, 32, 33, 63, 64] * 20:
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, n)]
        want = np.eye(n, dtype=bool)  # row j = row parent(j) + itself
        for j in range(1, n):
            want[j] |= want[parents[j]]
        got = ancestor_matrix(parents)
        assert got.dtype == bool and got.shape == (n, n) and (got == want).all(), parents
        depths, both = tree_rows(parents)  # one pass for both
        assert (both == want).all() and depths.tolist() == tree_depths(parents).tolist()


@pytest.mark.parametrize("window,sliding_window", [(8, 3), (8, 8), (8, 20), (5, 1)])
def test_head_masks_updated_in_place_equal_ring_masks(window, sliding_window):
    rng = np.random.default_rng(window * 10 + sliding_window)
    masks = HeadRingMask(window, sliding_window)
    checked = 0
    t = live = 0
    for step in range(400):
        if step == 0 or rng.random() < 0.05:  # a new request: the MTP Drafter resets, live = a
            t = int(rng.integers(1, 5 * window))
            live = max(0, t - int(rng.integers(1, window + 1)))
            masks.reset()
        else:  # a reply: t' = t + 1 + |P| (sometimes a jump past W)
            t += int(rng.integers(1, 7)) if rng.random() > 0.03 else int(rng.integers(window, 3 * window))
            live = max(live, t - window)  # Alg. 2 line 5
        got = masks.update(t, live)
        want = ring_masks(t, live, window, sliding_window)
        for kind in (SLIDING, FULL):
            assert got[kind].tobytes() == want[kind].tobytes(), (step, t, live, kind)
        checked += 1
    assert checked == 400 and masks.full_rebuilds < checked / 2  # most updates were incremental
