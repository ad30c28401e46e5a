"""The SLM's candidates per expanded tree node: its k most likely keep-set tokens and their log-probabilities
(paper Alg. 3 lines 10-13: "the 32 most likely tokens c under q(.|v)").

Two sources, one result (`Candidates`, best first, ties to the lower keep-set index):

- `graph_candidates`: the SLM tree graph's own top-k outputs (``top_index`` int64 (1, R, k), ``top_logq`` float32
  (1, R, k): ONNX TopK, which puts the lower index first among equal values, and log-softmax in the graph; built
  by `hycoc.passes.topk_outputs`). Nothing vocabulary-wide leaves the graph, the host reads k values per row.
- `logits_candidates`: the host path for graphs that emit only ``logits`` (the compiler's float torch runners,
  `hycoc.passes.slm.calibration.TorchSlmRunner`): float64 log-softmax of the row, then `top_k_indices`. It costs
  O(|V|) per row: at the paper's 86,089-token keep set that is milliseconds per row (benchmarks/
  runtime_real_shape.py), which is why the bundle's graph does it.

numpy only: this module ships to the phone.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Candidates:
    """One node's candidates: ``index`` int64 (k,) keep-set indices by descending q (ties: lower index first),
    ``logq`` float64 (k,) their log q (natural log, <= 0)."""

    index: np.ndarray
    logq: np.ndarray

    def __len__(self) -> int:
        return len(self.index)

    def head(self, k: int) -> Candidates:
        """The first ``k`` (all when fewer)."""
        return Candidates(self.index[:k], self.logq[:k])


def top_k_indices(x: np.ndarray, k: int) -> np.ndarray:
    """int64 (n, min(k, V)): per row of ``x`` (n, V) the indices of its k largest values, largest first, ties to
    the lower index -- exactly ``np.argsort(-x, kind="stable")[:, :k]``, in O(V) per row (``np.argpartition`` to
    find the k-th value, then only the values above it and the lowest-indexed ones equal to it are sorted).
    Raises ValueError for k < 1 or an x that is not 2-D."""
    x = np.asarray(x)
    if x.ndim != 2 or k < 1:
        raise ValueError(f"top_k_indices needs a 2-D array and k >= 1, got shape {x.shape} and k = {k}")
    n, v = x.shape
    k = min(int(k), v)
    if k == v:
        return np.argsort(-x, axis=-1, kind="stable").astype(np.int64)
    kth = -np.partition(-x, k - 1, axis=-1)[:, k - 1]  # the k-th largest value of each row
    out = np.empty((n, k), np.int64)
    for r in range(n):
        above = np.flatnonzero(x[r] > kth[r])
        tied = np.flatnonzero(x[r] == kth[r])[: k - len(above)]
        sel = np.concatenate([above, tied])
        out[r] = sel[np.lexsort((sel, -x[r, sel]))]  # by value descending, then index ascending
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    """float64 log-softmax over the last axis."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def logq_candidates(logq: np.ndarray, k: int) -> Candidates:
    """Candidates of one row already in log q (float (V,))."""
    lq = np.asarray(logq, dtype=np.float64).reshape(-1)
    index = top_k_indices(lq[None], k)[0]
    return Candidates(index, lq[index])


def logits_candidates(logits: np.ndarray, k: int) -> list[Candidates]:
    """The host path (module docstring): one `Candidates` per row of ``logits`` float (n, V)."""
    logits = np.asarray(logits)
    if logits.shape[0] == 0:
        return []
    lq = log_softmax(logits)
    index = top_k_indices(lq, k)
    return [Candidates(index[r], lq[r, index[r]]) for r in range(len(index))]


class CandidateRows(Mapping):
    """Several nodes' candidates as two arrays, read-only mapping node -> `Candidates` (row views): ``index`` int64
    (n, k) and ``logq`` float64 (n, k), row i for ``nodes[i]``. The tree builder scores all rows at once
    (`hycoc.runtime.tree_builder.TreeBuilder.slm_pass`); a lookup by node gives the same `Candidates` the graph
    path gives one by one."""

    def __init__(self, nodes, index: np.ndarray, logq: np.ndarray):
        self.nodes = [int(v) for v in nodes]
        self.index, self.logq = index, logq
        self.row = {v: i for i, v in enumerate(self.nodes)}

    def __getitem__(self, node: int) -> Candidates:
        i = self.row[node]
        return Candidates(self.index[i], self.logq[i])

    def __contains__(self, node) -> bool:
        return node in self.row

    def __iter__(self):
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)


def graph_candidate_rows(top_index: np.ndarray, top_logq: np.ndarray, nodes, rows, k: int) -> CandidateRows:
    """The graph path (module docstring) for ``nodes`` at graph ``rows``: their first k ``top_index`` /
    ``top_logq`` ((1, R, k_graph) each) entries as one `CandidateRows`. Raises ValueError when the graph emits
    fewer than k."""
    if top_index.shape[-1] < k:
        raise ValueError(
            f"the SLM graph emits its best {top_index.shape[-1]} tokens per row, the tree builder "
            f"wants {k} candidates: rebuild the bundle with this recipe"
        )
    rows = np.asarray(rows, dtype=np.int64)
    # the fancy index makes fresh arrays: int64 indices stay as they are (no second copy)
    return CandidateRows(
        nodes, top_index[0, rows, :k].astype(np.int64, copy=False), top_logq[0, rows, :k].astype(np.float64)
    )


def graph_candidates(top_index: np.ndarray, top_logq: np.ndarray, rows, k: int) -> list[Candidates]:
    """The graph path (module docstring): `Candidates` of ``rows`` from the graph's ``top_index`` / ``top_logq``
    ((1, R, k_graph) each), the first k of each. Raises ValueError when the graph emits fewer than k."""
    found = graph_candidate_rows(top_index, top_logq, range(len(rows)), rows, k)
    return [found[i] for i in range(len(rows))]


__all__ = [
    "CandidateRows",
    "Candidates",
    "graph_candidate_rows",
    "graph_candidates",
    "log_softmax",
    "logits_candidates",
    "logq_candidates",
    "top_k_indices",
]
