"""Which rows of a draft tree a round verifies: the rows that fit the context, a sub-tree's parents renumbered, and a
sub-tree's reply widened to the rows as sent (paper Alg. 4 on a trimmed tree; docs/serving.md "Budgeted
verification rows")."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hycoc.protocol.messages import RoundReply

from .tree import tree_depths


def fitting_rows(parents: np.ndarray, room: int) -> np.ndarray:
    """Rows of a tree that can still commit a token: depth <= room, where room >= 1 is the number of tokens the
    context has left (a path to depth d commits d tokens before its bonus). Rows deeper than that would sit at a
    position >= max_context. Returns the kept row indices (increasing; row 0 always; closed under ancestors, as
    depth grows along every path). Hand-worked: a depth-5 chain at t = 9 of max_context 14 has room
    14 - 10 = 4 and keeps rows 0..4."""
    return np.nonzero(tree_depths(parents) <= room)[0]


def remap_parents(parents: np.ndarray, kept: np.ndarray) -> np.ndarray:
    """Parents of the sub-tree made of rows ``kept`` (increasing, closed under ancestors), renumbered."""
    index = np.full(len(parents), -1, dtype=np.int64)
    index[kept] = np.arange(len(kept))
    sub = parents[kept]
    return np.where(sub < 0, -1, index[np.maximum(sub, 0)])


def widen_reply(reply: RoundReply, tokens: np.ndarray, kept: np.ndarray) -> RoundReply:
    """A sub-tree's reply in the rows of the whole tree: samples of the rows left out echo their own tokens,
    path rows are renumbered, and ``verified`` (bool (R,)) marks the kept rows, so the device walks only those
    (`hycoc.runtime.tree_builder.walk_reply`)."""
    samples = tokens.astype(np.int32).copy()
    samples[kept] = reply.samples
    verified = np.zeros(len(tokens), bool)
    verified[kept] = True
    return replace(reply, samples=samples, path_rows=kept[reply.path_rows].astype(np.int32), verified=verified)
