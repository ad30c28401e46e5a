"""Host-side computations of the drafters' graphs, in numpy only (paper App. A, Alg. 2 lines 2-6, Alg. 3 line 8).

What the device runtime computes around each graph call, and what the compiler uses to feed the same graphs
while it builds and checks them -- one implementation for both, so a bundle's graphs and its runtime agree by
construction. No torch, no transformers: this module ships to the phone (docs/design.md "Layout": runtime/ must not
import torch).

- `EmbeddingLut`: embedding tables kept on the host in the checkpoint's own quantized storage (App. A: "the
  embeddings stay on the CPU as LUTs"), `unpack_signed` for its 2/4/8-bit layouts;
- `RotaryTable`: cos/sin rows at absolute positions (keys enter the rings rotated, queries get rows as inputs);
  `RotaryBlock`: the same rows of consecutive positions from a block computed once;
- `ring_masks`: the MTP head's W-column ring masks (Alg. 2 lines 2-5);
- `tree_depths`, `ancestor_matrix` (`tree_rows`: both), `ring_positions`, `tree_ring_mask`: the SLM tree graph's
  rows and its ring + ancestor mask (Alg. 3 line 8); `ring_runs`: consecutive positions as runs of ring columns.

Masks are additive float32 with a finite hidden value (`MASK_VALUE` = -1e4), sized for a 16-bit quantized mask
input: never -inf, never a min-float stand-in (docs/design.md "Numerics by construction").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: Additive mask value of a hidden column: finite, sized for a 16-bit quantized mask input.
MASK_VALUE = -1e4
#: Largest float32 table `EmbeddingLut.dense` dequantizes once and keeps (bytes): a toy's tables (4096 x 128: 2 MiB)
#: fit, a real vocabulary's (262144 x 1536 floats: 1.5 GiB) stays in its quantized storage.
DENSE_LUT_BYTES = 16 << 20
SLIDING = "sliding_attention"
FULL = "full_attention"


def producer_layers(config) -> dict[str, int]:
    """{SLIDING: i, FULL: j}: the last layer of each attention type that computes its own KV (not KV-shared), of a
    ``Gemma4TextConfig`` (``layer_types``, ``kv_sharing_modes``; torch-free).

    These are the layers whose KV transformers hands to the MTP head (``kv_sharing_modes`` "store") and whose rows
    the hand-off carries (Alg. 4 line 14). The verifier engine, the real-shape plan and the hand-off scales all read
    them here. Raises ValueError if the model lacks one of the two types.
    """
    modes = config.kv_sharing_modes or [None] * len(config.layer_types)
    out = {}
    for kind in (SLIDING, FULL):
        idx = [i for i, (lt, m) in enumerate(zip(config.layer_types, modes)) if lt == kind and m != "reuse"]
        if not idx:
            raise ValueError(f"the verifier has no {kind} layer computing its own KV; the hand-off needs one")
        out[kind] = idx[-1]
    return out


class TreeShapeError(ValueError):
    """Rows that are not a tree in topological order, or a ring/live range that cannot hold them."""


def unpack_signed(packed: np.ndarray, bits: int, width: int) -> np.ndarray:
    """transformers' Gemma storage -> signed int8 values (rows..., width).

    int8: as is. int4: two per byte, low nibble first, stored as value + 8. int2: four per byte, bits [1:0] first,
    stored as value + 2 (``transformers/integrations/gemma_quant.py``). Raises ValueError for another width.
    """
    if bits == 8:
        return np.ascontiguousarray(packed.view(np.int8) if packed.dtype == np.uint8 else packed.astype(np.int8))
    if bits not in (2, 4):
        raise ValueError(f"unsupported bit width {bits}: the Gemma format stores 2, 4 or 8 bits")
    u = packed.astype(np.uint8, copy=False)
    # one gather of a byte's 8 // bits values packed as one 16/32-bit word, viewed back as int8: no shifts
    words = _unpack_table(bits).view(np.uint16 if bits == 4 else np.uint32).reshape(256)
    values = words[u].view(np.int8)
    return values.reshape(*u.shape[:-1], -1)[..., :width]


def _unpack_table(bits: int, _cache: dict[int, np.ndarray] = {}) -> np.ndarray:  # noqa: B006 - a memo
    """int8 (256, 8 // bits): the signed values byte b holds, low bits first (`unpack_signed`'s layout)."""
    if bits not in _cache:
        per = 8 // bits
        b = np.arange(256, dtype=np.uint16)[:, None]
        shifts = (np.arange(per, dtype=np.uint16) * bits)[None, :]
        _cache[bits] = (((b >> shifts) & ((1 << bits) - 1)).astype(np.int16) - (1 << (bits - 1))).astype(np.int8)
    return _cache[bits]


@dataclass
class EmbeddingLut:
    """An embedding table kept on the host as a lookup table, in the checkpoint's own quantized storage.

    ``packed``: the checkpoint's bytes unchanged -- int8 (rows, dim) at 8 bits, uint8 (rows, ceil(dim*bits/8)) at
    4 and 2 bits (`unpack_signed` layout). ``scale``: float32 (rows, blocks), per-row (blocks = 1) or per-block
    dequantization scales. ``embed_scale``: Gemma's architectural multiplier (sqrt(hidden) for the token table,
    sqrt(per-layer dim) for the per-layer table), applied after dequantization as transformers does.
    """

    packed: np.ndarray
    scale: np.ndarray
    bits: int
    dim: int
    embed_scale: float
    _dense: np.ndarray | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def rows(self) -> int:
        return int(self.packed.shape[0])

    def lookup(self, ids) -> np.ndarray:
        """float32 (*ids.shape, dim): the rows of ``ids``, equal to ``QuantizedEmbedding(ids)`` (float32 model).

        Raises IndexError for an id outside [0, rows)."""
        ids = np.asarray(ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.rows):
            raise IndexError(f"token id outside the LUT's {self.rows} rows: {ids.min()}..{ids.max()}")
        q = unpack_signed(self.packed[ids], self.bits, self.dim).astype(np.float32)
        blocks = self.scale.shape[-1]
        scale = self.scale[ids].astype(np.float32, copy=False)[..., None]  # (*ids, blocks, 1): broadcast
        out = q.reshape(*ids.shape, blocks, self.dim // blocks)
        out *= scale
        out *= np.float32(self.embed_scale)
        return out.reshape(*ids.shape, self.dim)

    def dense(self, max_bytes: int = DENSE_LUT_BYTES) -> np.ndarray | None:
        """float32 (rows, dim): `lookup` of every row, dequantized once and kept (row r equals ``lookup([r])`` bit
        for bit: the dequantization is elementwise per row), or None when it would take more than ``max_bytes``
        bytes (the table then stays in its quantized storage, App. A). A runtime gathers rows from it with one
        ``np.take`` instead of a lookup's dozen small numpy operations per forward."""
        if self._dense is None:
            if self.rows * self.dim * 4 > max_bytes:
                return None
            self._dense = self.lookup(np.arange(self.rows, dtype=np.int64))
        return self._dense


@dataclass
class RotaryTable:
    """Rotary embedding of one attention layer type, computed on the host (App. A): the graph takes cos/sin rows.

    ``inv_freq``: float32 (head_dim/2,), transformers' ``<type>_inv_freq`` (zeros for the unrotated part of
    partial/proportional RoPE); ``attention_scaling``: the factor transformers multiplies cos and sin by.
    """

    inv_freq: np.ndarray
    attention_scaling: float
    head_dim: int

    def rows(self, positions) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin), each float32 (*positions.shape, head_dim), for absolute token positions (int, >= 0)."""
        freqs = np.asarray(positions, dtype=np.int64).astype(np.float32)[..., None] * self.inv_freq
        emb = np.concatenate([freqs, freqs], axis=-1)
        scaling = np.float32(self.attention_scaling)
        return (np.cos(emb) * scaling).astype(np.float32), (np.sin(emb) * scaling).astype(np.float32)


class RotaryBlock:
    """`RotaryTable.rows` of consecutive positions served from a block of ``block`` rows computed at once, so a
    drafter's forwards (a few positions after the last) mostly read rows already computed instead of evaluating
    cos/sin each time. numpy's float32 cos/sin give each element the value it has alone (checked by
    tests/test_rotary_block.py against `RotaryTable.rows` row by row), so the rows equal a fresh call's bit for bit.
    Raises ValueError for block < 1.
    """

    def __init__(self, table: RotaryTable, block: int = 256):
        if block < 1:
            raise ValueError(f"a rotary block needs at least 1 row, got {block}")
        self.table, self.block = table, int(block)
        self._start = 0
        self._cos: np.ndarray | None = None
        self._sin: np.ndarray | None = None
        self.computed = 0  # blocks computed so far

    def rows(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        """(cos, sin) float32 (count, head_dim) of positions first .. first + count - 1 (>= 0): views of the block,
        valid for as long as the caller holds them (a new block is a new array). Raises ValueError for count < 1
        or first < 0."""
        if count < 1 or first < 0:
            raise ValueError(f"rotary rows of {count} positions from {first}: need count >= 1 and first >= 0")
        lo = first - self._start
        if self._cos is None or self._sin is None or lo < 0 or lo + count > len(self._cos):  # both set together
            self._start, lo = first, 0
            self._cos, self._sin = self.table.rows(np.arange(first, first + max(self.block, count)))
            self.computed += 1
        return self._cos[lo : lo + count], self._sin[lo : lo + count]


# ---- the MTP head's ring (Alg. 2 lines 2-5) ---------------------------------------------------------------------


def head_sliding_positions(sliding_window: int, inclusive: bool) -> int:
    """Committed positions the MTP head's sliding layers read before its query (at most W of them: `ring_masks`).

    ``sliding_window + 1`` when ``inclusive``: transformers 5.24 ``Gemma4AssistantForCausalLM.create_attention_masks``
    masks the shared sliding KV with a bidirectional window (``abs(q_idx - kv_idx) <= sliding_window``, the keys
    flipped so that index 0 is the last), which keeps the last sliding_window + 1 keys; else ``sliding_window``
    (recipe ``[window] head_sliding_window_inclusive``; the toy head was trained so). sliding_window: the head's
    config (``text_config.sliding_window``)."""
    return int(sliding_window) + (1 if inclusive else 0)


def ring_masks(t: int, live_start: int, window: int, sliding_window: int) -> dict[str, np.ndarray]:
    """Alg. 2 lines 2-5: the additive masks of a W-column ring for root position t (float32 [1, 1, 1, W] each).

    Column c holds position p_c = (t - 1) - ((t - 1 - c) mod W), the latest position before t written there
    (line 4: row p goes to column p mod W). The full layer sees p_c in [max(live_start, t - W), t); the sliding
    layer also needs p_c >= t - min(W, sliding_window) (sliding_window: the positions it reads,
    `head_sliding_positions`). live_start: the first position the ring holds for this
    request (line 3, ``a`` of its first hand-off). Other columns get `MASK_VALUE`. Keys {SLIDING, FULL}.
    """
    c = np.arange(window)
    p = (t - 1) - np.mod(t - 1 - c, window)
    full = (p >= max(live_start, t - window, 0)) & (p < t)
    sliding = full & (p >= t - min(window, sliding_window))
    return {
        kind: np.where(ok, 0.0, MASK_VALUE).astype(np.float32)[None, None, None]
        for kind, ok in ((SLIDING, sliding), (FULL, full))
    }


# ---- the SLM tree graph's rows and masks (Alg. 3 line 8) ------------------------------------------------------


def tree_depths(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """depth(j) of every row (0 for row 0). int64 (R,). Raises TreeShapeError unless parents[0] == -1 and
    0 <= parents[j] < j."""
    p = _parent_list(parents)
    depth = [0] * len(p)
    for j in range(1, len(p)):  # plain ints: the device runs this every forward
        depth[j] = depth[p[j]] + 1
    return np.asarray(depth, dtype=np.int64)


def _parent_list(parents: Sequence[int] | np.ndarray) -> list[int]:
    """``parents`` as a list of ints, validated (`tree_depths`' rules)."""
    p = [int(x) for x in parents] if isinstance(parents, list) else np.asarray(parents, np.int64).reshape(-1).tolist()
    if not p or p[0] != -1:
        raise TreeShapeError("row 0 must have parent -1")
    for j in range(1, len(p)):
        if not 0 <= p[j] < j:
            raise TreeShapeError(f"row {j} has parent {p[j]}: a parent must be an earlier row")
    return p


def tree_rows(parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(`tree_depths`, `ancestor_matrix`) of ``parents`` from one validation and one pass (a forward needs both).
    Raises TreeShapeError as `tree_depths`."""
    p = _parent_list(parents)
    n = len(p)
    if n > 64:
        return tree_depths(p), ancestor_matrix(p)
    depth = [0] * n
    bits = [1] + [0] * (n - 1)
    for j in range(1, n):
        depth[j] = depth[p[j]] + 1
        bits[j] = bits[p[j]] | (1 << j)
    return np.asarray(depth, dtype=np.int64), _bit_rows(bits, n)


def _bit_rows(bits: list[int], n: int) -> np.ndarray:
    """bool (n, n) from n ints whose bit i is column i (n <= 64)."""
    words = np.asarray(bits, dtype="<u8")  # little-endian words: byte b holds bits 8b..8b+7, low bit first
    return np.ascontiguousarray(np.unpackbits(words.view(np.uint8), bitorder="little").reshape(n, 64)[:, :n].view(bool))


def ancestor_matrix(parents: Sequence[int] | np.ndarray) -> np.ndarray:
    """bool (R, R): [j, i] iff row i is row j or one of its ancestors. Raises TreeShapeError as `tree_depths`."""
    p = _parent_list(parents)
    n = len(p)
    if n > 64:
        anc = np.eye(n, dtype=bool)
        for j in range(1, n):
            anc[j] |= anc[p[j]]
        return anc
    bits = [1] + [0] * (n - 1)  # row j's ancestors (and itself) as the set bits of one int
    for j in range(1, n):
        bits[j] = bits[p[j]] | (1 << j)
    return _bit_rows(bits, n)


def ring_positions(first_position: int, ring: int) -> np.ndarray:
    """int64 (ring,): the committed position column c holds, c = p mod ring, p in [first_position - ring,
    first_position) (negative where no such position exists yet)."""
    p = np.arange(first_position - ring, first_position, dtype=np.int64)
    out = np.empty(ring, dtype=np.int64)
    out[p % ring] = p
    return out


def ring_runs(first: int, count: int, ring: int) -> list[tuple[slice, slice]]:
    """Positions [first, first + count) of a ring of ``ring`` columns (position p in column p mod ring) as at most
    two runs of consecutive columns: [(column slice, slice of the count positions)], so a ring write is one or two
    slice copies instead of a gather. Raises ValueError unless 0 <= count <= ring and first >= 0."""
    if not 0 <= count <= ring or first < 0:
        raise ValueError(f"{count} positions from {first} do not fit a ring of {ring} columns")
    start = first % ring
    head = min(count, ring - start)
    runs = [(slice(start, start + head), slice(0, head))] if head else []
    if count > head:
        runs.append((slice(0, count - head), slice(head, count)))
    return runs


def tree_ring_mask(
    parents: Sequence[int],
    first_position: int,
    live_start: int,
    ring: int,
    sliding_window: int | None,
    *,
    depths: np.ndarray | None = None,
    ancestors: np.ndarray | None = None,
) -> np.ndarray:
    """Additive mask float32 (1, 1, R, ring + R) of one layer type of the SLM tree graph, columns [ring | rows].

    Row j sits at position q_j = first_position + depth(j). It sees ring column c (position p, `ring_positions`)
    iff p >= max(live_start, 0) and, in sliding layers, q_j - p < sliding_window; it sees row i iff i is j or an
    ancestor of j and, in sliding layers, q_j - q_i < sliding_window (transformers' ``sliding_window_overlay``:
    kv_idx > q_idx - sliding_window), so a window boundary may fall inside the tree rows.
    live_start: the oldest committed position with a valid ring entry. sliding_window: transformers'
    ``sliding_window`` for sliding layers, None for full attention. Raises TreeShapeError when live_start is after
    first_position or the rows are not a tree. depths / ancestors: `tree_depths` / `ancestor_matrix` of
    ``parents`` when the caller has them already (one forward's masks share them); not re-validated then.
    """
    if live_start > first_position:
        raise TreeShapeError(f"live_start {live_start} is after the first row's position {first_position}")
    q = first_position + (tree_depths(parents) if depths is None else depths)  # (R,) row positions
    p = ring_positions(first_position, ring)  # (ring,) column positions
    ring_ok = np.broadcast_to((p >= max(live_start, 0))[None, :], (len(q), ring))
    rows_ok = ancestor_matrix(parents) if ancestors is None else ancestors
    if sliding_window is not None:
        ring_ok = ring_ok & (q[:, None] - p[None, :] < sliding_window)
        rows_ok = rows_ok & (q[:, None] - q[None, :] < sliding_window)
    visible = np.concatenate([ring_ok, rows_ok], axis=1)
    return np.where(visible, 0.0, MASK_VALUE).astype(np.float32)[None, None]
