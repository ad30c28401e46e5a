"""The SLM tree graph's ring + ancestor masks kept in preallocated buffers and updated in place (docs/device-runtime.md
"Host work per round": no per-round allocation or copy that grows with W).

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

from hycoc.host import (
    FULL,
    MASK_VALUE,
    SLIDING,
    TreeShapeError,
    ancestor_matrix,
    ring_masks,
    ring_positions,
    ring_runs,
    tree_depths,
)

_HIDDEN = np.float32(MASK_VALUE)


def _fill_run(mask: np.ndarray, cols: slice, p0: int, p1: int, edge: int) -> None:
    """Write one run of ring columns holding positions [p0, p1): visible (0) where the position is >= ``edge``,
    hidden (``_HIDDEN``) below it."""
    if p0 >= edge:
        mask[cols] = 0.0
    elif p1 <= edge:
        mask[cols] = _HIDDEN
    else:
        mask[cols] = np.where(np.arange(p0, p1) >= edge, np.float32(0.0), _HIDDEN)


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
        self._base = np.empty(self.ring, np.float32)  # ring columns' value before the window (same per row)
        self._first: int | None = None  # first_position and live_start of the last update
        self._live: int | None = None
        self._window: tuple[int, int] | None = None  # (first column's position, count) the window hid in
        self._step_table: np.ndarray | None = None
        self.full_rebuilds = 0  # updates that rewrote every ring column

    def reset(self) -> None:
        """Forget the last update (the next one rewrites the whole buffer): a request restart."""
        self._first = self._live = self._window = None

    def update(
        self,
        parents: Sequence[int],
        first_position: int,
        live_start: int,
        *,
        depths: np.ndarray | None = None,
        ancestors: np.ndarray | None = None,
        tree_block: np.ndarray | None = None,
    ) -> np.ndarray:
        """The buffer holding ``tree_ring_mask(parents, first_position, live_start, ring, sliding_window)``
        (module docstring). parents: R parent rows (-1 first). depths / ancestors: `tree_depths` /
        `ancestor_matrix` of ``parents`` when the caller has them (not re-validated then). tree_block: float32
        (R, R), ``where(ancestors, 0, MASK_VALUE)`` when the caller has it (one forward's layer types share it).
        Raises TreeShapeError as `tree_ring_mask` (live_start after first_position, rows that are not a tree, a
        wrong row count)."""
        if live_start > first_position:
            raise TreeShapeError(f"live_start {live_start} is after the first row's position {first_position}")
        d = tree_depths(parents) if depths is None else depths
        if len(d) != self.rows:
            raise TreeShapeError(f"{len(d)} rows given, the mask has {self.rows}")
        anc = ancestor_matrix(parents) if ancestors is None else ancestors
        m, base = self.buffer[0, 0], self._base
        ring = self.ring
        live = max(int(live_start), 0)
        first = int(first_position)
        if self._first is None or live != self._live or abs(first - self._first) >= ring:
            base[:] = np.where(ring_positions(first, ring) >= live, np.float32(0.0), _HIDDEN)
            m[:, :ring] = base
            self.full_rebuilds += 1
        else:
            if self._window is not None:  # undo the last window: back to the columns' base
                for cols, _ in ring_runs(*self._window, ring):
                    m[:, cols] = base[cols]
            if first != self._first:  # the columns whose position changed
                lo, hi = min(first, self._first), max(first, self._first)
                back = 0 if first > self._first else ring  # they hold positions [lo, hi) or [lo, hi) - ring
                for cols, src in ring_runs(lo, hi - lo, ring):
                    _fill_run(base, cols, lo + src.start - back, lo + src.stop - back, live)
                    m[:, cols] = base[cols]
        self._first, self._live, self._window = first, live, None
        deepest = int(d.max())
        sw = self.sliding_window
        if sw is not None:
            # ring: row j (position first + d_j) sees p > first + d_j - sw; the ring's oldest position is
            # first - ring, so its oldest e_j = d_j + ring - sw + 1 columns (at most ring) are hidden: the columns
            # (first + k) mod ring, k < e_j
            extra = ring - sw + 1
            most = min(deepest + extra, ring)
            if most > 0:
                steps = self._steps(extra)
                e = d + extra
                if extra < 0 or deepest + extra >= len(steps):
                    e = np.minimum(np.maximum(e, 0), len(steps) - 1)
                hidden = steps[e, :most]  # [j, k] = k < e_j
                for cols, src in ring_runs(first, most, ring):
                    m[:, cols] = np.where(hidden[:, src], _HIDDEN, base[cols])
                self._window = (first, most)
        if sw is None or deepest < sw:  # rows see every ancestor: the block is the caller's
            m[:, ring:] = np.where(anc, np.float32(0.0), _HIDDEN) if tree_block is None else tree_block
        else:
            m[:, ring:] = np.where(anc & (d[:, None] - d[None, :] < sw), np.float32(0.0), _HIDDEN)
        return self.buffer

    def _steps(self, extra: int) -> np.ndarray:
        """bool (cap + 1, cap), [e, k] = k < e, cap = the most ring columns a window can hide (`update`)."""
        if self._step_table is None:
            cap = max(1, min(self.rows - 1 + extra, self.ring))
            self._step_table = np.arange(cap)[None, :] < np.arange(cap + 1)[:, None]
        return self._step_table


class HeadRingMask:
    """The MTP head's two ring masks (Alg. 2 line 5, `hycoc.host.ring_masks`: float32 [1, 1, 1, W] for the sliding
    and the full layer) in preallocated buffers updated in place.

    Column c holds position p = c mod W of [t - W, t). When the root moves from t0 to t (0 <= t - t0 < W) only two
    sets of columns change: those of the new positions [t0, t) (now visible, unless before the live start) and, in
    the sliding layer, those of [t0 - S, t - S) that leave its window (S = min(W, sliding_window)); every other
    column keeps its value (its position stays, and the live start only rises as far as t - W, below it). A new
    request (`reset`), another live start than that rule gives, or a jump of W or more rewrites both buffers.
    `update` returns {SLIDING, FULL} -> the buffers, equal to ``ring_masks(t, live_start, W, sliding_window)`` bit
    for bit (tests/test_tree_mask.py). Raises ValueError for window or sliding_window < 1.
    """

    def __init__(self, window: int, sliding_window: int):
        if window < 1 or sliding_window < 1:
            raise ValueError(f"ring masks need window >= 1 and sliding_window >= 1, got {window}, {sliding_window}")
        self.window, self.sliding = int(window), min(int(window), int(sliding_window))
        self.sliding_window = int(sliding_window)
        self.buffers = {
            SLIDING: np.empty((1, 1, 1, self.window), np.float32),
            FULL: np.empty((1, 1, 1, self.window), np.float32),
        }
        self._t: int | None = None
        self._live: int | None = None
        self.full_rebuilds = 0

    def reset(self) -> None:
        """Forget the last update (a new request): the next one rewrites both buffers."""
        self._t = self._live = None

    def update(self, t: int, live_start: int) -> dict[str, np.ndarray]:
        """The masks for root position ``t`` and the request's live start (class docstring)."""
        t, live, w = int(t), int(live_start), self.window
        last = self._t
        if last is None or not 0 <= t - last < w or (live != self._live and live > t - w):
            for kind, mask in ring_masks(t, live, w, self.sliding_window).items():
                self.buffers[kind][...] = mask
            self.full_rebuilds += 1
        elif t != last:
            seen = max(live, t - w, 0)  # the full layer sees [seen, t)
            sliding, full = self.buffers[SLIDING][0, 0, 0], self.buffers[FULL][0, 0, 0]
            lo = max(last - self.sliding, t - w, 0)  # positions leaving the sliding window, still held
            hi = max(t - self.sliding, lo)
            for cols, _ in ring_runs(lo, hi - lo, w) if hi > lo else ():
                sliding[cols] = _HIDDEN
            for cols, src in ring_runs(last, t - last, w):  # the new positions, last .. t - 1
                p0, p1 = last + src.start, last + src.stop
                for mask, edge in ((full, seen), (sliding, max(seen, t - self.sliding))):
                    _fill_run(mask, cols, p0, p1, edge)
        self._t, self._live = t, live
        return self.buffers


__all__ = ["HeadRingMask", "TreeRingMask"]
