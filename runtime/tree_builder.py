"""The hybrid draft tree on the device (paper Alg. 3, BuildTree; Table 5 for the SpecEdge-style and HyCo-2P
variants).

Scores are log-weights: the root has s(r) = 0; chain node y_k gets s(u_{k-1}) + ln λ (line 4); a runner-up
sibling y'_k != y_k gets s(u_{k-1}) + 2 ln λ on its edge (line 6); an SLM candidate c under node v gets
s(v) + ln q(c|v) + ln λ (line 13), q the SLM's softmax over the keep set. Since ln λ < 0 and ln q <= 0, a child
always scores below its parent, so the B best nodes are closed under ancestors.

One SLM pass (lines 7-14): F = the root and the nodes planted so far (the committed tokens without SLM KV are
the SLM Drafter's business: `hycoc.runtime.slm_drafter.SlmDrafter.expand` puts them before the root), by
descending s (ties: insertion order); one forward gives q(.|v) for every v in F; for each, its 32 most likely
tokens c become candidates (v, c) unless v already has a child c; θ = the B-th highest s over the tree's nodes
(root excluded) and the candidates (-inf if fewer); every candidate with s >= θ joins the tree. HyCo-2P runs the
pass again with F = the nodes just added (line 15); the SpecEdge-style tree is this builder with no chain and 4
passes (Table 5). Line 16 keeps the B highest-scoring nodes, ties to the earlier one, and their ancestors;
line 17 returns the root and the kept nodes in insertion order as (token, parent row), padded to the verifier's
row count by repeating the last row.

The allowance (protocol 6: `hycoc.protocol.messages.RoundReply.allowance`, the rows the verifier lets the next tree
hold) bounds a tree's rows: ``build(..., rows=R)`` with R = min(allowance, tree rows). R <= 1 + len(chain) (the
floor: the root and the chain) runs no SLM pass (`TreeBuilder.at_floor`): the tree is the root and chain[:R - 1] as
lines 3-4 plant them, runner-ups only where the chain stopped short (an end-of-turn token) and rows are left
(`TreeBuilder.floor_kept`). A tree without a chain (SpecEdge-style) has its floor at the root alone. Above the
floor the tree is built as at full size and line 16 keeps the R - 1 best nodes instead of B. Either way the rows
are padded to R by repeating the last, so a tree has exactly R rows. At R = the verifier's tree rows (the default)
the tree is the one Alg. 3 builds without an allowance, byte for byte.

A node whose token ends the turn (EOS) is never expanded and ends the chain: nothing after it can be committed.

The rows go out with their scores (`BuiltTree.scores`, protocol version 4), so a loaded verifier may verify only
an ancestor-closed part of the tree; its reply names the rows it verified, and `walk_reply` walks those only
(`check_verified` checks the set is one a verifier may send).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
from hycoc.runtime.candidates import CandidateRows, Candidates, logq_candidates
from numpy.typing import ArrayLike

from hycoc.protocol.wire import FP16_SCORE_FLOOR

ROOT, CHAIN, SIBLING, SLM = "root", "chain", "sibling", "slm"


@dataclass(slots=True)
class TreeNode:
    """A draft-tree node: token id, parent node index (-1 for the root), score s, depth, where it came from."""

    token: int
    parent: int
    score: float
    depth: int
    source: str


@dataclass
class DraftTreeNodes:
    """The tree under construction: nodes in insertion order (node 0 is the root)."""

    nodes: list[TreeNode] = field(default_factory=list)
    edges: set[tuple[int, int]] = field(default_factory=set)  # (parent, token) of every node
    children: dict[int, list[int]] = field(default_factory=dict)  # parent -> its children's tokens, in order

    def add(self, token: int, parent: int, score: float, source: str) -> int:
        token, parent = int(token), int(parent)
        depth = 0 if parent < 0 else self.nodes[parent].depth + 1
        self.nodes.append(TreeNode(token, parent, float(score), depth, source))
        self.edges.add((parent, token))
        kids = self.children.get(parent)
        if kids is None:
            self.children[parent] = [token]
        else:
            kids.append(token)
        return len(self.nodes) - 1

    def add_many(self, tokens: list[int], parents: list[int], scores: list[float], source: str) -> list[int]:
        """`add` of each (token, parent, score) in order, parents already in the tree (>= 0), values as Python
        ints / floats (``ndarray.tolist()``); returns the new nodes."""
        nodes, edges, children = self.nodes, self.edges, self.children
        start = len(nodes)
        for token, parent, score in zip(tokens, parents, scores):
            nodes.append(TreeNode(token, parent, score, nodes[parent].depth + 1, source))
            edges.add((parent, token))
            kids = children.get(parent)
            if kids is None:
                children[parent] = [token]
            else:
                kids.append(token)
        return list(range(start, len(nodes)))

    def has_child(self, parent: int, token: int) -> bool:
        return (int(parent), int(token)) in self.edges

    def ancestors(self, node: int) -> list[int]:
        """Ancestors of ``node`` from the root's child down to its parent (root excluded)."""
        out = []
        p = self.nodes[node].parent
        while p > 0:
            out.append(p)
            p = self.nodes[p].parent
        return out[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.nodes[i].token for i in [*self.ancestors(node), node]] if node > 0 else []


@dataclass
class BuiltTree:
    """Alg. 3 line 17: ``tokens`` / ``parents`` int32 (rows,), row 0 the root, padded by repeating the last row;
    ``row_node``: tree node index of each unpadded row; ``tree``: every node considered (kept or not);
    ``kept``: kept node indices in insertion order (root first); ``slm_passes``: forwards run; ``scores``: float32
    (rows,), each row's score s(v) (natural log; the root's 0, no row above its parent), padding repeating the
    last row's, clamped below at FP16_SCORE_FLOOR (what the wire can carry; the clamp keeps the order)."""

    tokens: np.ndarray
    parents: np.ndarray
    row_node: list[int]
    tree: DraftTreeNodes
    kept: list[int]
    slm_passes: int
    scores: np.ndarray


#: expand(tree, nodes) -> {node: its candidates} for the nodes it could fit in one SLM forward (in the order
#: given, which is descending score): a `hycoc.runtime.candidates.Candidates` (the SLM Drafter's: the graph's top-k),
#: or log q over the whole keep set, float (|V|,), of which the builder takes the top-k itself.
Expand = Callable[[DraftTreeNodes, list[int]], Mapping[int, "Candidates | np.ndarray"]]


class TreeBuilder:
    """Alg. 3 with its constants (module docstring).

    ln_lambda: ln λ < 0 (Table 5: λ = 0.66). budget: B, nodes kept besides the root. rows: rows of the tree sent
    (the verifier's B + 1; >= budget + 1). candidates: SLM candidates per expanded row (32). passes: SLM forwards
    per tree (1: HyCo, 2: HyCo-2P, 4: SpecEdge-style). keep_set: int64 (|V|,), SLM output index -> token id.
    stop_ids: tokens that are never expanded. Raises ValueError for constants out of range.
    """

    def __init__(
        self,
        *,
        ln_lambda: float,
        budget: int,
        rows: int,
        candidates: int,
        passes: int,
        keep_set: np.ndarray,
        stop_ids: Iterable[int] = (),
    ):
        if not ln_lambda < 0:
            raise ValueError(f"ln λ must be < 0 (0 < λ < 1), got {ln_lambda}")
        if budget < 1 or rows < budget + 1:
            raise ValueError(f"the tree needs rows >= budget + 1, got budget {budget} and rows {rows}")
        if candidates < 1 or passes < 0:
            raise ValueError("candidates must be >= 1 and passes >= 0")
        self.ln_lambda, self.budget, self.rows = float(ln_lambda), int(budget), int(rows)
        self.candidates, self.passes = int(candidates), int(passes)
        self.keep_set = np.asarray(keep_set, dtype=np.int64)
        self.stop_ids = frozenset(int(s) for s in stop_ids)

    # ---- lines 2-6: the root, the chain and the runner-up siblings --------------------------------------------

    def plant(self, root: int, chain: Sequence[int], runner_ups: Sequence[int]) -> DraftTreeNodes:
        """Lines 2-6. The chain stops after an EOS token; runner-ups exist for the planted depths only."""
        tree = DraftTreeNodes()
        tree.add(root, -1, 0.0, ROOT)
        u = [0]
        for y in chain:  # lines 3-4
            if tree.nodes[u[-1]].token in self.stop_ids:
                break
            u.append(tree.add(y, u[-1], tree.nodes[u[-1]].score + self.ln_lambda, CHAIN))
        for k, y2 in enumerate(runner_ups, start=1):  # lines 5-6
            if k >= len(u):
                break
            parent = u[k - 1]
            if y2 != tree.nodes[u[k]].token and tree.nodes[parent].token not in self.stop_ids:
                tree.add(y2, parent, tree.nodes[parent].score + 2 * self.ln_lambda, SIBLING)
        return tree

    # ---- lines 7-14: one SLM pass -------------------------------------------------------------------------------

    def slm_pass(self, tree: DraftTreeNodes, frontier: list[int], expand: Expand) -> list[int]:
        """Lines 7-14 with F = ``frontier``; returns the nodes added (insertion order)."""
        nodes, stop = tree.nodes, self.stop_ids  # line 7: descending s, ties to the earlier
        order = [v for _, v in sorted([(-nodes[v].score, v) for v in frontier if nodes[v].token not in stop])]
        if not order:
            return []
        logq = expand(tree, order)  # line 8
        kids = tree.children  # the children's tokens of each node (read only here)
        if isinstance(logq, CandidateRows):  # every row's candidates at once (same values, same order)
            return self._join(tree, *self._scored_rows(tree, order, logq, kids))
        c_s, c_v, c_tok = [], [], []  # candidates (s, v, token) in C order, as arrays
        for v in order:  # lines 10-13
            if v not in logq:
                continue
            c = logq[v]  # the 32 largest q, ties to the lower index
            if not isinstance(c, Candidates):
                c = logq_candidates(c, self.candidates)
            elif len(c) > self.candidates:
                c = c.head(self.candidates)
            tokens = self.keep_set[c.index]
            s = tree.nodes[v].score + c.logq + self.ln_lambda  # float64, summed in the order of line 13
            if v in kids:  # (v, c) only when v has no child c yet
                mine = kids[v]
                new = tokens != mine[0]
                for tok in mine[1:]:  # a node has few children: a compare each
                    new &= tokens != tok
                tokens, s = tokens[new], s[new]
            c_s.append(s)
            c_tok.append(tokens)
            c_v.append(v)
        if not c_s:
            return self._join(tree, np.zeros(0), None, None)
        return self._join(
            tree,
            np.concatenate(c_s),
            np.repeat(np.asarray(c_v, np.int64), [len(t) for t in c_tok]),
            np.concatenate(c_tok),
        )

    def _scored_rows(
        self, tree: DraftTreeNodes, order: list[int], found: CandidateRows, kids: dict[int, list[int]]
    ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        """Lines 10-13 for every node of ``order`` in ``found`` at once: (s, v, token) of the candidates, in the
        order the one-node-at-a-time loop gives (nodes by ``order``, each row's candidates best first)."""
        present = [v for v in order if v in found]
        if not present:
            return np.zeros(0), None, None
        rows = [found.row[v] for v in present]
        k = self.candidates
        if rows == list(range(len(found.nodes))):
            index, logq = found.index[:, :k], found.logq[:, :k]
        else:
            index, logq = found.index[rows, :k], found.logq[rows, :k]
        tokens = self.keep_set[index]
        node_s = np.array([tree.nodes[v].score for v in present], np.float64)
        s = node_s[:, None] + logq  # float64, summed in the order of line 13:
        s += self.ln_lambda  # (s(v) + ln q) + ln λ
        nodes = np.array(present, np.int64)
        mine = [kids.get(u, ()) for u in present]  # (v, c) only when v has no child c yet
        most = max(len(m) for m in mine)
        if not most:
            return s.ravel(), nodes.repeat(tokens.shape[1]), tokens.ravel()
        taken = np.array([list(m) + [-1] * (most - len(m)) for m in mine], np.int64)  # -1: no token
        row, col = (tokens[:, :, None] != taken[:, None, :]).all(axis=-1).nonzero()  # row-major: C order
        return s[row, col], nodes[row], tokens[row, col]

    def _join(
        self, tree: DraftTreeNodes, cand_s: np.ndarray, cand_v: np.ndarray | None, cand_tok: np.ndarray | None
    ) -> list[int]:
        """Line 14: θ = the B-th highest score over the tree's nodes and the candidates; the candidates with
        s >= θ join the tree in candidate order. Returns the nodes added."""
        if cand_v is None or cand_tok is None or not len(cand_s):
            return []
        scores = np.concatenate([np.array([n.score for n in tree.nodes[1:]], np.float64), cand_s])
        if len(scores) >= self.budget:
            neg = -scores
            neg.partition(self.budget - 1)  # in place on the negated copy (np.partition's values)
            theta = -neg[self.budget - 1]
        else:
            theta = -np.inf
        joined = (cand_s >= theta).nonzero()[0]
        return tree.add_many(cand_tok[joined].tolist(), cand_v[joined].tolist(), cand_s[joined].tolist(), SLM)

    # ---- lines 16-17 -------------------------------------------------------------------------------------------

    def trim(self, tree: DraftTreeNodes, max_depth: int | None = None, keep: int | None = None) -> list[int]:
        """Line 16: the root and the B highest-scoring nodes (ties to the earlier one) with their ancestors,
        in insertion order. max_depth: nodes deeper than this are left out first (the room the verifier's
        context has left: a node at depth d sits at position t + d); None = no limit. keep: nodes kept instead of B
        (a tree under an allowance of keep + 1 rows); None = B."""
        nodes = tree.nodes
        n = self.budget if keep is None else int(keep)
        fits = [i for i in range(1, len(nodes)) if max_depth is None or nodes[i].depth <= max_depth]
        best = [i for _, i in heapq.nsmallest(n, [(-nodes[i].score, i) for i in fits])]  # = sorted[:n]
        kept = set(best)
        for i in best:  # ancestors, up to the first one already kept
            p = nodes[i].parent
            while p > 0 and p not in kept:
                kept.add(p)
                p = nodes[p].parent
        return [0, *sorted(kept)]

    def floor_kept(self, tree: DraftTreeNodes, keep: int, max_depth: int | None = None) -> list[int]:
        """The tree at or below the floor (no SLM pass): the root, then the planted chain's first ``keep`` nodes
        (lines 3-4, depth order); where the chain stopped short of ``keep`` (an end-of-turn token), the runner-up
        siblings fill the rest by line 16's order (highest score, ties to the earlier). Every sibling's parent is a
        chain node, kept by then, so the result is ancestor-closed. max_depth: as `trim`. Returns node indices in
        insertion order, root first."""
        nodes = tree.nodes
        fits = [i for i in range(1, len(nodes)) if max_depth is None or nodes[i].depth <= max_depth]
        chain = [i for i in fits if nodes[i].source == CHAIN][:keep]
        if len(chain) < keep:
            rest = [(-nodes[i].score, i) for i in fits if nodes[i].source == SIBLING]
            chain += [i for _, i in heapq.nsmallest(keep - len(chain), rest)]
        return [0, *sorted(chain)]

    def at_floor(self, rows: int, chain: int) -> bool:
        """Whether a tree of ``rows`` rows over a chain of ``chain`` tokens is at or below the floor (module
        docstring): rows <= 1 + chain, and fewer than the verifier's tree rows (a full-size tree is Alg. 3's
        whatever the chain). Such a tree runs no SLM pass (`floor_kept`)."""
        return rows < self.rows and rows <= 1 + chain

    def rows_of(self, tree: DraftTreeNodes, kept: list[int], rows: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Line 17: (tokens, parents) int32 (rows,), padded by repeating the last row; rows: the tree's rows
        (None: the verifier's tree rows)."""
        rows = self.rows if rows is None else int(rows)
        row = {node: j for j, node in enumerate(kept)}
        tokens = [tree.nodes[n].token for n in kept]
        parents = [-1] + [row[tree.nodes[n].parent] for n in kept[1:]]
        while len(tokens) < rows:
            tokens.append(tokens[-1])
            parents.append(parents[-1])
        return np.asarray(tokens, np.int32), np.asarray(parents, np.int32)

    def scores_of(self, tree: DraftTreeNodes, kept: list[int], rows: int | None = None) -> np.ndarray:
        """The rows' scores s(v), float32 (rows,), aligned with `rows_of` (padding repeats the last row's),
        clamped to [FP16_SCORE_FLOOR, 0]: a score of -inf (q underflowed to 0) travels as the floor. rows: as
        `rows_of`."""
        rows = self.rows if rows is None else int(rows)
        scores = [tree.nodes[n].score for n in kept]
        scores += [scores[-1]] * (rows - len(scores))
        return np.clip(np.asarray(scores, np.float64), FP16_SCORE_FLOOR, 0.0).astype(np.float32)

    def build(
        self,
        root: int,
        chain: Sequence[int],
        runner_ups: Sequence[int],
        expand: Expand | None,
        passes: int | None = None,
        max_depth: int | None = None,
        rows: int | None = None,
    ) -> BuiltTree:
        """Alg. 3, entire. expand: the SLM forward (None or passes == 0: the tree is the planted nodes only).
        max_depth: deepest node sent (the tokens the request has room for; `trim`), None = no limit. rows: the rows
        this tree may hold (the allowance, module docstring), in [1, the verifier's tree rows]; None = those. At
        the floor (`at_floor`) ``expand`` is not called. Raises ValueError for rows out of range."""
        rows = self.rows if rows is None else int(rows)
        if not 1 <= rows <= self.rows:
            raise ValueError(f"a tree holds 1 to {self.rows} rows (the verifier's tree rows), not {rows}")
        keep = min(self.budget, rows - 1)
        passes = self.passes if passes is None else passes
        tree = self.plant(root, chain, runner_ups)
        if self.at_floor(rows, len(chain)):  # the floor: the root and the chain, no SLM pass
            kept = self.floor_kept(tree, keep, max_depth)
            return BuiltTree(*self.rows_of(tree, kept, rows), kept, tree, kept, 0, self.scores_of(tree, kept, rows))
        frontier = list(range(len(tree.nodes)))
        done = 0
        for _ in range(passes if expand is not None else 0):
            assert expand is not None  # for mypy: no passes run without it
            added = self.slm_pass(tree, frontier, expand)
            done += 1
            if not added:
                break
            frontier = added  # line 15: F = the nodes just added
        kept = self.trim(tree, max_depth, keep)
        tokens, parents = self.rows_of(tree, kept, rows)
        return BuiltTree(tokens, parents, kept, tree, kept, done, self.scores_of(tree, kept, rows))


def walk_reply(
    tokens: ArrayLike, parents: ArrayLike, samples: ArrayLike, verified: ArrayLike | None = None
) -> list[int]:
    """Alg. 1 line 8: the deepest path below the root whose every row c with parent v has token c == ŷ_v,
    ties to the lowest row. Returns the path's rows (root excluded), root to leaf; [] when nothing matches.
    Duplicate (padding) rows never win over the first row with the same token and parent.

    verified: bool (R,), the rows the verifier verified (`hycoc.protocol.messages.RoundReply.verified`), or None
    (every row): the walk enters verified rows only. A row left out echoes its own token as its sample, and its
    token may well equal its parent's sample; it was still never verified, so the walk stops at the parent (whose
    sample is then the bonus)."""
    tokens, parents, samples = (np.asarray(a, np.int64) for a in (tokens, parents, samples))
    allowed = np.ones(len(tokens), bool) if verified is None else np.asarray(verified, bool)
    path: list[int] = []
    v = 0
    while True:  # every row has one sampled token, so at most one child (the lowest duplicate row) continues
        kids = np.nonzero((parents == v) & (tokens == samples[v]) & allowed)[0]
        kids = kids[kids > 0]
        if not len(kids):
            return path
        v = int(kids[0])
        path.append(v)


def check_verified(parents: ArrayLike, verified: ArrayLike, path_rows: Sequence[int] | np.ndarray) -> None:
    """Check a reply's verified rows against the tree sent: bool (R,) over its R rows, row 0 verified, every
    verified row's parent verified (ancestor-closed: the verifier verifies a subtree, `RoundReply.verified`), and
    every path row verified. Raises ValueError naming the first fault."""
    parents = np.asarray(parents, np.int64)
    verified = np.asarray(verified)
    if verified.dtype != np.bool_ or verified.shape != parents.shape:
        raise ValueError(
            f"verified rows: expected bool ({len(parents)},), one per row sent, got dtype "
            f"{verified.dtype} and shape {verified.shape}"
        )
    if not verified[0]:
        raise ValueError("verified rows leave out row 0: the root is always verified")
    orphan = verified[1:] & ~verified[np.maximum(parents[1:], 0)]
    if orphan.any():
        j = int(np.argmax(orphan)) + 1
        raise ValueError(
            f"verified rows are not ancestor-closed: row {j} is verified, its parent row {int(parents[j])} is not"
        )
    for row in path_rows:
        if not 0 <= int(row) < len(verified) or not verified[int(row)]:
            raise ValueError(f"path row {int(row)} is not a verified row")
