"""Path selection of one verification round: exact and epsilon-threshold acceptance (paper Alg. 4 lines 6-12, §3.5).

Given the tree rows, the verifier's sample y^_v at every row and p~(. | v), a drafted child c of node v is
    hit(c) = [c == y^_v]                         (the verifier sampled it: exact acceptance)
    ok(c)  = hit(c) or p~(c | v) >= epsilon      (epsilon-threshold acceptance)
A is the set of nodes whose whole path from the root is ok; v* maximizes, in order, depth, hits on its path,
the product of p~ along it, then the lowest row. The samples along the path are rewritten (y^_v = c for every
edge (v, c)) so the device's walk (Alg. 1 line 8: from the root, step to the child equal to the sample, ties to
the lowest row) ends at v*, and b = y^_{v*} is the bonus token.

Exact acceptance is that walk on the original samples; it is lossless because every y^_v ~ p~(. | v) and the
drafts do not depend on the samples. epsilon = 1 reduces to it: p~(c | v) >= 1 only when p~(. | v) is one-hot on
c, and then y^_v = c anyway.

Duplicate siblings (same parent, same token: Alg. 3 pads trees by repeating the last row) carry the same context;
only the lowest row of each such group can be on the path (later copies and their subtrees are never chosen),
which is what makes the device's lowest-row walk agree with v*.

Pure numpy on the host: R is 33 rows. Inputs may be numpy arrays or torch tensors.
"""

from __future__ import annotations

import numpy as np
import torch

from .tree import path_to, tree_depths


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def first_copies(tokens, parents) -> np.ndarray:
    """bool (R,): False for a row that repeats an earlier sibling (same parent and token), True otherwise."""
    tokens, parents = _np(tokens), _np(parents)
    seen = set()
    first = np.ones(len(tokens), dtype=bool)
    for j in range(1, len(tokens)):
        key = (int(parents[j]), int(tokens[j]))
        first[j] = key not in seen
        seen.add(key)
    return first


def descend(tokens, parents, samples) -> int:
    """Exact acceptance / the device's walk (Alg. 1 line 8): from the root, repeatedly step to the lowest-row
    child whose token equals the current row's sample; returns the row where it stops (v*)."""
    tokens, parents, samples = _np(tokens), _np(parents), _np(samples)
    v = 0
    while True:
        children = np.nonzero((parents == v) & (tokens == samples[v]))[0]
        if len(children) == 0:
            return v
        v = int(children[0])


def edge_probs(tokens, parents, probs) -> np.ndarray:
    """float64 (R,): p~(c | parent(c)) for every row c (1.0 for the root). probs: (R, V) p~ per row."""
    tokens, parents = _np(tokens), _np(parents)
    out = np.ones(len(tokens), dtype=np.float64)
    if len(tokens) > 1:
        rows = torch.as_tensor(parents[1:], dtype=torch.long)
        cols = torch.as_tensor(tokens[1:], dtype=torch.long)
        if isinstance(probs, torch.Tensor):
            out[1:] = probs[rows.to(probs.device), cols.to(probs.device)].double().cpu().numpy()
        else:
            out[1:] = np.asarray(probs)[parents[1:], tokens[1:]]
    return out


def select_path(tokens, parents, samples, probs, epsilon: float) -> tuple[int, np.ndarray, np.ndarray]:
    """Alg. 4 lines 6-12: choose v*, the accepted path and rewrite the samples along it.

    tokens, parents, samples: int (R,) (samples: y^_j drawn from p~(. | j)). probs: float (R, V), p~ per row.
    epsilon: in (0, 1]; 1 is exact acceptance. Returns (v_star, path_rows int64 (|P|,) from the root's child to
    v* (root excluded), samples_rewritten int64 (R,)); the bonus token is samples_rewritten[v_star].
    """
    if not 0.0 < epsilon <= 1.0:
        raise ValueError(f"epsilon must be in (0, 1], got {epsilon}")
    tokens, parents, samples = _np(tokens).astype(np.int64), _np(parents).astype(np.int64), _np(samples)
    rows = len(tokens)
    p_edge = edge_probs(tokens, parents, probs)
    first = first_copies(tokens, parents)
    depth = tree_depths(parents)

    # Line 6: hit(c) = [c == y^_v]; ok(c) = hit(c) or p~(c|v) >= epsilon.
    hit = np.zeros(rows, dtype=bool)
    hit[1:] = tokens[1:] == samples[parents[1:]]
    ok = hit | (p_edge >= epsilon)
    # Line 7: A = nodes whose path from r is ok at every node (rows are topologically sorted, parents first).
    in_a = np.zeros(rows, dtype=bool)
    in_a[0] = True  # the root stands for line 8's fallback v* = r
    hits = np.zeros(rows, dtype=np.int64)
    prod = np.ones(rows, dtype=np.float64)
    for j in range(1, rows):
        v = parents[j]
        in_a[j] = in_a[v] and ok[j] and first[j]
        hits[j] = hits[v] + hit[j]
        prod[j] = prod[v] * p_edge[j]
    # Lines 8-10: maximize depth, then hits, then the product of p~, then prefer the lowest row.
    v_star = max(np.nonzero(in_a)[0], key=lambda j: (depth[j], hits[j], prod[j], -j))
    path = np.asarray(path_to(parents, int(v_star)), dtype=np.int64)
    # Line 11: y^_v <- c along the path, so the device's walk (Alg. 1 line 8) ends at v*.
    rewritten = samples.astype(np.int64).copy()
    rewritten[parents[path]] = tokens[path]
    return int(v_star), path, rewritten


def select_exact(tokens, parents, samples) -> tuple[int, np.ndarray, np.ndarray]:
    """Exact acceptance: v* = `descend` on the samples (no rewriting needed). Same return as `select_path`."""
    v_star = descend(tokens, parents, samples)
    return v_star, np.asarray(path_to(_np(parents), v_star), dtype=np.int64), _np(samples).astype(np.int64).copy()
