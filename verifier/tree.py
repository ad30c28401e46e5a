"""Draft-tree structure and the tree attention masks of one verification forward (paper Alg. 4 lines 1-2).

A tree arrives as R = B + 1 rows in insertion order: a parent row per row, ``parents[0] == -1`` for the root
x_{t+1} and ``0 <= parents[j] < j`` otherwise (so the rows are already topologically sorted). Row j sits at
position t + depth(j) and attends to the committed positions [0, t), its ancestor rows and itself.

Masks follow transformers' conventions exactly (``masking_utils``): a query at position q sees key position p in a
full-attention layer iff p <= q (causal), and in a sliding-window layer iff additionally q - p < sliding_window
(``sliding_window_overlay``: kv_idx > q_idx - sliding_window). Tree rows replace "p <= q" by "ancestor or self".
"""

from __future__ import annotations

import numpy as np
import torch

from hycoc import host

from .errors import TreeError


def validate_tree(tokens, parents, vocab_size: int) -> None:
    """Check a tree's rows (the structural rules of Alg. 3 line 17).

    tokens, parents: int sequences of equal length R >= 1. Raises TreeError if the lengths differ, R == 0,
    parents[0] != -1, some parents[j] is not in [0, j) (this also rules out cycles), or a token is outside
    [0, vocab_size).
    """
    tokens = np.asarray(tokens)
    parents = np.asarray(parents)
    if tokens.ndim != 1 or parents.ndim != 1 or len(tokens) != len(parents):
        raise TreeError(f"tokens and parents must be 1-D of equal length, got {tokens.shape} and {parents.shape}")
    if len(tokens) == 0:
        raise TreeError("a tree needs at least the root row")
    if parents[0] != -1:
        raise TreeError(f"row 0 is the root and must have parent -1, got {parents[0]}")
    rows = np.arange(len(parents))
    bad = np.nonzero((parents[1:] < 0) | (parents[1:] >= rows[1:]))[0]
    if len(bad):
        j = int(bad[0]) + 1
        raise TreeError(f"row {j} has parent {parents[j]}: a parent must be an earlier row, 0 <= parent < {j}")
    bad = np.nonzero((tokens < 0) | (tokens >= vocab_size))[0]
    if len(bad):
        j = int(bad[0])
        raise TreeError(f"row {j} has token id {tokens[j]} outside the vocabulary [0, {vocab_size})")


#: depth(j) per row and the [row, ancestor-or-self] matrix: `hycoc.host`'s (shared with the device runtime and the
#: compiler; they raise TreeShapeError on rows that are not a tree, which `validate_tree` rules out first).
tree_depths = host.tree_depths
ancestor_matrix = host.ancestor_matrix


def path_to(parents, row: int) -> list[int]:
    """Rows from the root's child down to ``row`` (root excluded; empty for the root)."""
    path = []
    while row > 0:
        path.append(int(row))
        row = int(parents[row])
    return path[::-1]


def additive_masks(
    query_pos: torch.Tensor,
    visible_rows: torch.Tensor,
    t: int,
    sliding_window: int | None,
    dtype: torch.dtype,
    sliding_start: int = 0,
) -> dict[str, torch.Tensor]:
    """Masks for R new rows written after the t cached positions: keys [0, t) then the R rows.

    query_pos: int64 (R,), each row's position. visible_rows: bool (R, R), which new rows each row sees (the
    ancestor matrix for a tree, lower-triangular for a chunk of a prompt). sliding_start: the first cached
    position the sliding layers return (`hycoc.verifier.kv_cache.window_start`: they keep only their window).
    Returns {"full_attention": (1, 1, R, t + R), "sliding_attention": (1, 1, R, t - sliding_start + R)} of
    ``dtype``, 0 where visible, ``finfo(dtype).min`` (finite) where not. Every cached position p < t is visible to
    a full layer (p < t <= q); a sliding layer also needs q - p < sliding_window, and that rule applies to the
    visible new rows too.
    """
    device = query_pos.device
    key_pos = torch.cat([torch.arange(t, device=device), query_pos])  # (t + R,)
    visible = torch.cat([torch.ones(len(query_pos), t, dtype=torch.bool, device=device), visible_rows], dim=1)
    in_window = visible
    if sliding_window is not None:
        in_window = visible & (query_pos[:, None] - key_pos[None, :] < sliding_window)
    neg = torch.finfo(dtype).min

    def to_additive(ok: torch.Tensor) -> torch.Tensor:
        return torch.where(ok, 0.0, neg).to(dtype)[None, None]

    return {"full_attention": to_additive(visible), "sliding_attention": to_additive(in_window[:, sliding_start:])}


def tree_masks(
    parents, t: int, sliding_window: int | None, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> dict[str, torch.Tensor]:
    """The tree attention masks of Alg. 4 line 2, in the dict form Gemma4TextModel accepts.

    parents: the tree's parent rows (R,). t: committed positions already in the cache. Returns
    {"full_attention", "sliding_attention"}: (1, 1, R, t + R) additive masks (see `additive_masks`); row j is at
    position t + depth(j) and sees [0, t), its ancestors and itself, sliding layers only keys p with
    (t + depth(j)) - p < sliding_window.
    """
    query_pos = torch.as_tensor(t + tree_depths(parents), device=device)
    visible_rows = torch.as_tensor(ancestor_matrix(parents), device=device)
    return additive_masks(query_pos, visible_rows, t, sliding_window, dtype)
