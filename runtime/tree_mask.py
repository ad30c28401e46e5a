"""The SLM tree graph's ring + ancestor masks kept in preallocated buffers and updated in place (issue 16: "no
per-round allocation or copy that grows with W").

`hycoc.host.tree_ring_mask` builds the (1, 1, R, W_i + R) additive mask of one layer type from scratch, O(R x W_i)
per forward. Between two forwards of a request only a few ring columns change: the ring's column c holds the
committed position p = c mod W_i in [first_position - W_i, first_position) (`hycoc.host.ring_positions`), so when
the first row moves from F0 to F1 only the columns of positions [min(F0, F1), max(F0, F1)) get a new occupant.
`TreeRingMask.update` rewrites those columns, the cells a sliding layer's window hides (at most depth + 1 of the
oldest columns per row: O(R^2)) and the R x R tree block, and rebuilds the buffer only when the request restarts
(a new ``live_start``) or the first row jumps by W_i or more. The result equals `tree_ring_mask` bit for bit
(tests/test_tree_mask.py checks it over random rounds, commits, ring wraps and restarts).

numpy only: this module ships to the phone.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hycoc.host import MASK_VALUE, TreeShapeError, ancestor_matrix, ring_positions, tree_depths

_HIDDEN = np.float32(MASK_VALUE)


class TreeRingMask:
    """One layer type's mask buffer, float32 (1, 1, rows, ring + rows), columns [ring | rows] as
    `hycoc.host.tree_ring_mask` lays them out.

    rows: R, the graph's rows. ring: W_i, the layer type's ring columns. sliding_window: transformers'
    ``sliding_window`` for sliding layers, None for full attention. ``buffer`` is the array `update` returns, the
    same object every time (bind it once); it is valid until the next `update`. Raises ValueError for rows or
    ring < 1 or a sliding window < 1.
    """

    def __init__(self, rows: int, ring: int, sliding_window: int | None):
        if rows < 1 or ring < 1:
            raise ValueError(f"a tree ring mask needs rows >= 1 and ring >= 1, got rows {rows} and ring {ring}")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 (or None for full attention), got {sliding_window}")
        self.rows, self.ring, self.sliding_window = int(rows), int(ring), sliding_window
        self.buffer = np.empty((1, 1, self.rows, self.ring + self.rows), np.float32)
        self._base = np.empty(self.ring, np.float32)       # ring columns' value before the window (same per row)
        self._first: int | None = None                     # first_position and live_start of the last update
        self._live: int | None = None
        self._window_cols: np.ndarray | None = None        # the ring columns the window hid cells of
        self.full_rebuilds = 0                             # updates that rewrote every ring column

    def reset(self) -> None:
        """Forget the last update (the next one rewrites the whole buffer): a request restart."""
        self._first = self._live = self._window_cols = None

    def update(self, parents: Sequence[int], first_position: int, live_start: int, *,
               depths: np.ndarray | None = None, ancestors: np.ndarray | None = None) -> np.ndarray:
        """The buffer holding ``tree_ring_mask(parents, first_position, live_start, ring, sliding_window)``
        (module docstring). parents: R parent rows (-1 first). depths / ancestors: `tree_depths` /
        `ancestor_matrix` of ``parents`` when the caller has them (not re-validated then). Raises TreeShapeError
        as `tree_ring_mask` (live_start after first_position, rows that are not a tree, a wrong row count)."""
        if live_start > first_position:
            raise TreeShapeError(f"live_start {live_start} is after the first row's position {first_position}")
        d = tree_depths(parents) if depths is None else depths
        if len(d) != self.rows:
            raise TreeShapeError(f"{len(d)} rows given, the mask has {self.rows}")
        anc = ancestor_matrix(parents) if ancestors is None else ancestors
        m = self.buffer[0, 0]
        ring = self.ring
        live = max(int(live_start), 0)
        first = int(first_position)
        if self._first is None or live != self._live or abs(first - self._first) >= ring:
            self._base[:] = np.where(ring_positions(first, ring) >= live, np.float32(0.0), _HIDDEN)
            m[:, :ring] = self._base
            self.full_rebuilds += 1
        else:
            if self._window_cols is not None:                  # undo the last window: back to the columns' base
                m[:, self._window_cols] = self._base[self._window_cols]
            if first != self._first:                           # columns whose position changed
                lo, hi = min(first, self._first), max(first, self._first)
                moved = np.arange(lo, hi, dtype=np.int64)
                cols = moved % ring
                held = moved if first > self._first else moved - ring    # the position each column holds now
                self._base[cols] = np.where(held >= live, np.float32(0.0), _HIDDEN)
                m[:, cols] = self._base[cols]
        self._first, self._live, self._window_cols = first, live, None
        if self.sliding_window is None:
            m[:, ring:] = np.where(anc, np.float32(0.0), _HIDDEN)
            return self.buffer
        sw = int(self.sliding_window)
        # ring: row j (position first + d_j) sees p > first + d_j - sw; the ring's oldest position is first - ring,
        # so its oldest n_j = d_j + ring - sw + 1 columns (at most ring) are hidden: (first + k) mod ring, k < n_j
        n = d + (ring - sw + 1)
        most = min(int(d.max()) + ring - sw + 1, ring)
        if most > 0:
            k = np.arange(most)
            cols = (first + k) % ring
            m[:, cols] = np.where(k[None, :] < n[:, None], _HIDDEN, self._base[cols][None, :])
            self._window_cols = cols
        m[:, ring:] = np.where(anc & (d[:, None] - d[None, :] < sw), np.float32(0.0), _HIDDEN)
        return self.buffer


__all__ = ["TreeRingMask"]
