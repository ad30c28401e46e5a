"""Scored draft trees for the real-shape projection (docs/capacity.md "The real-shape projection"): SYNTHESIZED
trees whose acceptance is FITTED to the paper's Table 2 MAT per configuration, and the phone's drafting per round
at each allowance. No recording at Gemma 4's shapes exists; these trees are a labelled model of one.

A tree (`draw_tree`) is built as Alg. 3 builds it, with the SLM's probabilities drawn instead of computed:

* HyCo (and HyCo exact, HyCo-2P): the root (s = 0), the MTP chain y_1..y_K (s(y_k) = k ln λ) and runner-up
  siblings y'_1..y'_D (s = s(parent) + 2 ln λ); then ``slm_passes`` SLM passes: under every frontier node v, 32
  candidates c with q(c|v) the sorted weights of a stick-breaking (GEM(α)) draw, s(c) = s(v) + ln q + ln λ; the
  head's chain token and runner-up under a planted node are taken to be the SLM's own top candidates there (the
  two drafters agree), so the SLM's alternatives under it are its next ones. A candidate joins when its score
  reaches the B-th highest so far (Alg. 3 line 14); line 16 keeps the B best (ties to the earlier).
* SpecEdge-style: no chain, ``specedge_passes`` SLM passes, each from the nodes the last one added.

Acceptance: ONE number θ per configuration, FITTED (`fit_theta`, bisection) so that the trees' expected MAT equals
Table 2's (`hycoc.bench.capacity.run.PAPER_MAT`). Each edge's own weight w is the score's estimate exp(s(c) - s(v))
(§3.1: λ for a chain edge, λ² for a runner-up, q λ for an SLM candidate). A chain token is accepted, its parent
accepted, with probability min(1, θλ): the chain's per-depth acceptance IS θλ (the paper measured 0.65-0.68 for its
chain, §3.1; the fit says what the MAT asks for). The other children of v:

* exact acceptance (hyco-exact, specedge): the verifier samples ONE token at v, so v's children are exclusive:
  each other child gets θ w, scaled down so that they share at most 1 - P(chain child) (their sum over every child
  v was OFFERED, kept or trimmed: the verifier's distribution does not depend on the trim). The walk descends to
  the child whose interval holds the verifier's uniform, or stops (the bonus);
* ε acceptance (hyco, hyco-2p, specedge-eps): a drafted token passes when the verifier gives it at least ε, so
  siblings pass independently, each with min(1, θ w), and the round commits the deepest path whose every node
  passed (ties to the lowest row, Alg. 1 line 8). ASSUMED: independent passes.

MAT = 1 + the expected depth of the accepted path (`expected_mat`: exact recursion over the tree).

The floor (root + chain, rows <= K + 1): a HyCo round's MAT then follows the chain alone, 1 + sum_{d <= K}
prod_{j <= d} P(y_j | y_{j-1}), from the same fitted trees (`TreePool.floor_mat`).

Drafting to an allowance (`TreePool.trimmed`, the contract in docs/capacity.md): rows = min(allowance, B + 1);
rows <= K + 1: the root and chain[:rows - 1], no SLM pass; otherwise the rows - 1 best-scored nodes (and their
ancestors, ties to the earlier), padded to ``rows`` by repeating the last row.

The phone's drafting per round (`phone_ms`): the paper's App. G mobile draft ms per token x Table 2 MAT per
configuration (`hycoc.bench.capacity.run.device_ms_of`, the device-time estimate's anchors) with an SLM pass; with
none (rows <= K + 1) the head alone: HyCo's 57.0 ms less the server-head configuration's 34.9 ms (its phone runs
the SLM pass only: 9.2 ms/token x MAT 3.79) = 22.1 ms (§3.1: "about 20 ms more per round on the mobile device").
DERIVED from App. G until the device-time estimate gives a per-allowance figure.

Core module: numpy only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


class TreeFitError(ValueError):
    """A fit that cannot reach the asked MAT (one line: the configuration, the MAT and the largest reachable)."""


#: ASSUMED: the concentration of the SLM's candidate probabilities (GEM(α) stick-breaking: the top candidate's
#: weight is Beta(1, α) before sorting; α = 1 puts its mean near one half).
SLM_ALPHA = 1.0


@dataclass(frozen=True)
class TreeModel:
    """How one configuration's trees are drawn and accepted (module docstring): ``chain_length`` K (0: SpecEdge,
    no chain), ``sibling_depth`` D, ``node_budget`` B, ``depth_cost`` λ, ``candidates`` per SLM row, ``passes``
    SLM passes, ``alpha`` the SLM's GEM concentration, ``exact`` the acceptance rule (False: ε)."""

    chain_length: int = 4
    sibling_depth: int = 2
    node_budget: int = 32
    depth_cost: float = 0.66
    candidates: int = 32
    passes: int = 1
    alpha: float = SLM_ALPHA
    exact: bool = False


@dataclass
class DrawnTree:
    """One drawn tree, B + 1 rows in insertion order (padding rows repeat the last one): ``parents`` int (R,),
    ``scores`` s(v) float (R,), ``weight`` w(v) float (R,) (0 at the root and on padding), ``other`` the sum of w
    over every non-chain child the row's parent was offered, float (R,), ``chain`` int (K,) the chain's rows,
    ``real`` the rows before padding, ``depth_cost`` λ."""

    parents: np.ndarray
    scores: np.ndarray
    weight: np.ndarray
    other: np.ndarray
    chain: np.ndarray
    real: int
    depth_cost: float

    def accept(self, theta: float, exact: bool) -> np.ndarray:
        """P(row accepted | parent accepted) at ``theta`` under the rule (module docstring); 1 at the root, 0 on
        padding. float64 (R,)."""
        chain_p = min(1.0, theta * self.depth_cost)
        p = np.minimum(1.0, theta * self.weight)
        is_chain = np.zeros(len(p), bool)
        is_chain[self.chain] = True
        if exact:
            has_chain = np.zeros(len(p), bool)
            has_chain[self.parents[self.chain]] = True
            room = np.where(has_chain[np.maximum(self.parents, 0)], 1.0 - chain_p, 1.0)
            p = theta * self.weight * np.minimum(1.0, room / np.maximum(theta * self.other, 1e-300))
        p[is_chain] = chain_p
        p[0] = 1.0
        p[self.real :] = 0.0
        return p


def _gem(rng: np.random.Generator, n: int, alpha: float) -> np.ndarray:
    """The n largest weights of a GEM(alpha) stick-breaking draw, sorted descending (float64 (n,))."""
    beta = rng.beta(1.0, alpha, size=4 * n)
    rest = np.concatenate([[1.0], np.cumprod(1.0 - beta)[:-1]])
    return np.sort(beta * rest)[::-1][:n]


def _planted(m: TreeModel, lam: float) -> tuple[list, list, list]:
    """Alg. 3 lines 1-6: the root, the chain and the runner-ups as (parents, scores, weights)."""
    par, score, w = [-1], [0.0], [0.0]
    for k in range(m.chain_length):  # chain y_1..y_K
        par.append(k)
        score.append((k + 1) * lam)
        w.append(m.depth_cost)
    for k in range(min(m.sibling_depth, m.chain_length)):  # runner-ups y'_k under y_{k-1}
        par.append(k)
        score.append(k * lam + 2 * lam)
        w.append(m.depth_cost**2)
    return par, score, w


def draw_tree(rng: np.random.Generator, m: TreeModel) -> DrawnTree:
    """One tree of configuration ``m`` (module docstring), B + 1 rows."""
    lam = math.log(m.depth_cost)
    par, score, w = _planted(m, lam)
    other = {
        v: sum(wj for j, (pj, wj) in enumerate(zip(par, w)) if pj == v and j > m.chain_length) for v in range(len(par))
    }
    frontier = list(range(len(par)))
    for _ in range(max(1, m.passes)):
        cand_p, cand_s, cand_w = [], [], []
        for v in sorted(frontier, key=lambda x: (-score[x], x)):
            planted = sum(1 for pj in par[1:] if pj == v)
            q = _gem(rng, m.candidates + planted, m.alpha)[planted:]
            cw = q * m.depth_cost
            other[v] = other.get(v, 0.0) + float(cw.sum())
            cand_p += [v] * len(q)
            cand_s += list(score[v] + np.log(q) + lam)
            cand_w += list(cw)
        pool = sorted(score[1:] + cand_s, reverse=True)
        cut = pool[m.node_budget - 1] if len(pool) >= m.node_budget else -math.inf
        frontier = []
        for p, s, wj in zip(cand_p, cand_s, cand_w):
            if s >= cut:  # Alg. 3 line 14
                par.append(p)
                score.append(s)
                w.append(wj)
                frontier.append(len(par) - 1)
        if not frontier:
            break
    order = sorted(range(1, len(par)), key=lambda j: (-score[j], j))[: m.node_budget]  # line 16
    keep = np.sort(np.concatenate([[0], np.asarray(order, np.int64)]))
    index = np.full(len(par), -1, np.int64)
    index[keep] = np.arange(len(keep))
    real = len(keep)
    parents = [-1] + [int(index[par[j]]) for j in keep[1:]]
    pad = m.node_budget + 1 - real  # Alg. 3 line 17: padded to B + 1 by repeating the last row
    keep = np.concatenate([keep, [keep[-1]] * pad]).astype(np.int64)
    parents += [parents[-1]] * pad
    return DrawnTree(
        parents=np.asarray(parents, np.int64),
        scores=np.array([score[j] for j in keep], np.float64),
        weight=np.array([w[j] for j in keep], np.float64),
        other=np.array([0.0] + [other.get(par[j], 0.0) for j in keep[1:]], np.float64),
        chain=np.array([index[j] for j in range(1, m.chain_length + 1)], np.int64),
        real=real,
        depth_cost=m.depth_cost,
    )


def expected_mat(tree: DrawnTree, theta: float, exact: bool, rows: np.ndarray | None = None) -> float:
    """The round's expected committed tokens (bonus included) with only ``rows`` kept (ancestor-closed, root first;
    None: all). Exact: 1 + sum over kept non-root rows of the product of P along the row's path. ε: 1 + E[depth of
    the deepest path of passed nodes], by recursion from the leaves: P(deepest below v >= d | v passed) =
    1 - prod over kept children c of (1 - P(c) P(deepest below c >= d - 1 | c passed))."""
    p = tree.accept(theta, exact)
    n = len(p)
    kept = np.zeros(n, bool)
    kept[np.arange(tree.real) if rows is None else np.asarray(rows)] = True
    kept[tree.real :] = False
    if exact:
        reach = np.zeros(n)
        reach[0] = 1.0
        for j in range(1, n):
            reach[j] = reach[tree.parents[j]] * p[j] if kept[j] else 0.0
        return float(1.0 + reach[1:].sum())
    depth = n + 1
    surv = np.zeros((n, depth))  # surv[v, d] = P(deepest below v >= d | v passed)
    surv[:, 0] = 1.0
    miss = np.ones((n, depth))  # running prod over v's children of (1 - P(c) surv[c, d - 1])
    for j in range(n - 1, 0, -1):
        if kept[j]:
            surv[j, 1:] = 1.0 - miss[j, 1:]
            miss[tree.parents[j], 1:] *= 1.0 - p[j] * surv[j, :-1]
    return float(1.0 + (1.0 - miss[0, 1:]).sum())


@dataclass
class TreePool:
    """``trees`` drawn trees of one configuration and its fitted ``theta``; draws rounds from them (`sample`)."""

    model: TreeModel
    trees: list[DrawnTree]
    theta: float
    target_mat: float
    _trims: dict = field(default_factory=dict)

    def mat(self, rows: int | None = None) -> float:
        """Mean expected MAT of the pool's trees drafted to ``rows`` rows (None: B + 1)."""
        r = rows or self.model.node_budget + 1
        ex = self.model.exact
        return float(np.mean([expected_mat(t, self.theta, ex, self.kept_rows(i, r)) for i, t in enumerate(self.trees)]))

    def floor_mat(self) -> float:
        """The MAT at the floor (root + chain): 1 + sum_d (θλ)^d for the fitted θ, averaged over trees."""
        return self.mat(self.model.chain_length + 1)

    def chain_acceptance(self) -> float:
        """The chain's fitted per-depth acceptance, min(1, θλ) (0 without a chain)."""
        return min(1.0, self.theta * self.model.depth_cost) if self.model.chain_length else 0.0

    def _accept(self, i: int) -> np.ndarray:
        """Tree i's P(accept | parent accepted) per row at the fitted θ (cached)."""
        key = ("accept", i)
        if key not in self._trims:
            self._trims[key] = self.trees[i].accept(self.theta, self.model.exact)
        return self._trims[key]

    def kept_rows(self, i: int, rows: int) -> np.ndarray:
        """Tree i's rows kept when the device drafts ``rows`` rows (module docstring), before padding: int64
        indices into the B + 1 rows, increasing, root first."""
        key = (i, rows)
        got = self._trims.get(key)
        if got is None:
            t, m = self.trees[i], self.model
            if rows >= t.real:
                got = np.arange(t.real)
            elif m.chain_length and rows <= m.chain_length + 1:
                got = np.concatenate([[0], t.chain[: rows - 1]])
            else:
                order = sorted(range(1, t.real), key=lambda j: (-t.scores[j], j))[: rows - 1]
                got = np.sort(np.concatenate([[0], np.asarray(order, np.int64)]))
            self._trims[key] = got.astype(np.int64)
        return self._trims[key]

    def sample(self, rng: np.random.Generator, rows: int) -> tuple:
        """One round drafted to ``rows`` rows: ((scores, tokens, parents) padded to ``rows``, the accepted path as
        row indices of that tree (root excluded, root-to-leaf)). Exact: the verifier's walk, one uniform per
        accepted node picking the child whose interval holds it, or stopping; ε: each node passes on its own draw,
        and the path is the deepest passed one (ties to the lowest row)."""
        i = int(rng.integers(len(self.trees)))
        t = self.trees[i]
        keep = self.kept_rows(i, rows)
        n = len(keep)
        remap = np.full(len(t.parents), -1, np.int64)
        remap[keep] = np.arange(n)
        parents = remap[t.parents[keep]]
        parents[0] = -1
        scores = t.scores[keep]
        tokens = keep + 16  # distinct per row: only padding repeats a row
        p = self._accept(i)[keep]
        path = _walk(rng, parents, p) if self.model.exact else _deepest(rng, parents, p)
        if n < rows:
            pad = rows - n
            parents = np.concatenate([parents, [parents[-1]] * pad])
            scores = np.concatenate([scores, [scores[-1]] * pad])
            tokens = np.concatenate([tokens, [tokens[-1]] * pad])
        return (scores, tokens, parents), path


def _walk(rng: np.random.Generator, parents: np.ndarray, p: np.ndarray) -> tuple[int, ...]:
    """Exact acceptance's walk (`TreePool.sample`) over rows whose P(accept | parent) is ``p``."""
    path, node = [], 0
    while True:
        kids = np.nonzero(parents == node)[0]
        kids = kids[kids > 0]
        if not len(kids):
            break
        edges = np.cumsum(p[kids])
        k = int(np.searchsorted(edges, rng.random(), side="right"))
        if k >= len(kids):
            break
        node = int(kids[k])
        path.append(node)
    return tuple(path)


def _deepest(rng: np.random.Generator, parents: np.ndarray, p: np.ndarray) -> tuple[int, ...]:
    """ε acceptance's path (`TreePool.sample`): the deepest row whose path passed, lowest row on a tie."""
    passed = rng.random(len(p)) < p
    passed[0] = True
    depth = np.zeros(len(p), np.int64)
    for j in range(1, len(p)):
        passed[j] = passed[j] and passed[parents[j]]
        depth[j] = depth[parents[j]] + 1
    d = np.where(passed, depth, -1)
    node = int(np.argmax(d))  # first maximum: the lowest row
    path = []
    while node > 0:
        path.append(node)
        node = int(parents[node])
    return tuple(reversed(path))


def fit_theta(trees: list[DrawnTree], target_mat: float, *, exact: bool, label: str = "", hi: float = 64.0) -> float:
    """θ whose mean expected MAT over ``trees`` is ``target_mat`` (bisection to 1e-4 relative: the MAT rises with
    θ). Raises TreeFitError when even θ = ``hi`` falls short."""

    def mat(theta: float) -> float:
        return float(np.mean([expected_mat(t, theta, exact) for t in trees]))

    if mat(hi) < target_mat:
        raise TreeFitError(
            f"{label}: trees of this shape reach MAT {mat(hi):.2f} at most, below the paper's {target_mat}"
        )
    lo, top = 0.0, hi
    while top - lo > 1e-4 * top:
        mid = 0.5 * (lo + top)
        lo, top = (mid, top) if mat(mid) < target_mat else (lo, mid)
    return 0.5 * (lo + top)


def tree_pool(model: TreeModel, target_mat: float, *, trees: int = 400, seed: int = 0, label: str = "") -> TreePool:
    """``trees`` trees of ``model`` (seeded) with θ fitted to ``target_mat`` (`fit_theta`)."""
    rng = np.random.default_rng(seed)
    drawn = [draw_tree(rng, model) for _ in range(trees)]
    return TreePool(model, drawn, fit_theta(drawn, target_mat, exact=model.exact, label=label), target_mat)


def chain_only_acceptance(mat: float, chain_length: int) -> float:
    """The per-depth acceptance a with 1 + a + ... + a^K = ``mat`` (a chain verified alone, each depth accepted
    with the same a: Cloud+MTP's server chain), by bisection in [0, 1]."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if sum(mid**d for d in range(chain_length + 1)) < mat:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def phone_ms(full_ms: float, head_ms: float, rows: int, chain_length: int) -> float:
    """The phone's drafting per round drafted to ``rows`` rows: ``head_ms`` (the MTP chain alone) when rows <=
    K + 1 (no SLM pass), else ``full_ms`` (head + SLM pass: trimming the tree saves no pass)."""
    return float(head_ms) if chain_length and rows <= chain_length + 1 else float(full_ms)


__all__ = [
    "SLM_ALPHA",
    "DrawnTree",
    "TreeFitError",
    "TreeModel",
    "TreePool",
    "chain_only_acceptance",
    "draw_tree",
    "expected_mat",
    "fit_theta",
    "phone_ms",
    "tree_pool",
]
