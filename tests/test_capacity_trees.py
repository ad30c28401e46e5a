"""The projection's synthesized scored trees (hycoc/bench/capacity/trees.py): Alg. 3's shape, the expected MAT of
hand-built trees under both acceptance rules worked by hand, the sampled rounds against the expectation, the fit,
drafting to an allowance and the phone's ms per row count. Fast: numpy only."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hycoc.bench.capacity.trees import (
    DrawnTree,
    TreeModel,
    TreePool,
    chain_only_acceptance,
    draw_tree,
    expected_mat,
    fit_theta,
    phone_ms,
    tree_pool,
)


def _hand_tree() -> DrawnTree:
    """Root, a chain y1 -> y2 (λ = 0.5 each), one SLM candidate s under the root (w 0.2, the root offered 0.2 beyond
    its chain child): rows 0 root, 1 y1, 2 y2, 3 s."""
    return DrawnTree(
        parents=np.array([-1, 0, 1, 0]),
        scores=np.array([0.0, math.log(0.5), 2 * math.log(0.5), math.log(0.2)]),
        weight=np.array([0.0, 0.5, 0.5, 0.2]),
        other=np.array([0.0, 0.2, 0.0, 0.2]),
        chain=np.array([1, 2]),
        real=4,
        depth_cost=0.5,
    )


def test_expected_mat_worked_by_hand():
    """θ = 1. Exact: y1, y2 accepted along the chain with 0.5 each, s shares the root's 1 - 0.5 left with nothing
    else: 0.2; MAT = 1 + 0.5 + 0.25 + 0.2 = 1.95. ε: the deepest passed path: P(depth >= 1) = 1 - 0.5 x 0.8 = 0.6,
    P(depth >= 2) = 0.25: MAT = 1.85. θ = 3: the chain passes always (min(1, 1.5)); exact: s gets the rest, 0:
    MAT 3; ε: depth 2 always: MAT 3. Kept rows root + y1 only: exact 1.5."""
    t = _hand_tree()
    assert expected_mat(t, 1.0, exact=True) == pytest.approx(1.95)
    assert expected_mat(t, 1.0, exact=False) == pytest.approx(1.85)
    assert expected_mat(t, 3.0, exact=True) == pytest.approx(3.0)
    assert expected_mat(t, 3.0, exact=False) == pytest.approx(3.0)
    assert expected_mat(t, 1.0, exact=True, rows=np.array([0, 1])) == pytest.approx(1.5)
    # an exact rule never lets the children of one node add up to more than 1
    big = DrawnTree(t.parents, t.scores, np.array([0, 0.5, 0.5, 0.9]), np.array([0, 0.9, 0, 0.9]), t.chain, 4, 0.5)
    p = big.accept(1.5, exact=True)
    assert p[1] + p[3] == pytest.approx(1.0) and p[1] == pytest.approx(0.75)


def test_drawn_trees_follow_alg3():
    """B + 1 rows; parents earlier; the chain's scores k ln λ; a child never scores above its parent; the root's
    planted children are the chain's first token and a runner-up at 2 ln λ; padding repeats the last row."""
    rng = np.random.default_rng(3)
    m = TreeModel()
    for _ in range(20):
        t = draw_tree(rng, m)
        assert len(t.parents) == m.node_budget + 1 and t.parents[0] == -1
        assert all(t.parents[j] < j for j in range(1, len(t.parents)))
        assert np.allclose(t.scores[t.chain], [k * math.log(0.66) for k in range(1, 5)])
        assert all(t.scores[j] <= t.scores[t.parents[j]] + 1e-12 for j in range(1, t.real))
        assert (t.weight[t.real :] == 0).all()
    spec = draw_tree(rng, TreeModel(chain_length=0, sibling_depth=0, passes=4, exact=True))
    assert len(spec.chain) == 0 and spec.real == 33


@pytest.mark.parametrize("exact", [True, False])
def test_sampled_rounds_match_the_expected_mat(exact):
    """The pool's sampled rounds (the verifier's walk / the deepest passed path) commit, on average over 6,000
    rounds, the expected MAT within 3%, at B + 1 rows and drafted to 9 rows; each path's rows descend the tree."""
    pool = tree_pool(TreeModel(exact=exact), 3.84 if exact else 4.71, trees=60, seed=1)
    rng = np.random.default_rng(2)
    for rows in (33, 9):
        got = []
        for _ in range(6000):
            (scores, tokens, parents), path = pool.sample(rng, rows)
            assert len(tokens) == rows
            assert all(parents[b] == a for a, b in zip((0,) + path, path))
            got.append(len(path) + 1)
        assert np.mean(got) == pytest.approx(pool.mat(rows), rel=0.03)


def test_fit_reaches_the_mat_and_the_floor_follows_the_chain():
    """θ is fitted to the asked MAT; at the floor (root + chain) the MAT is 1 + sum_d (θλ)^d (nothing else is
    drafted); an unreachable MAT is one line."""
    pool = tree_pool(TreeModel(exact=True), 3.84, trees=80, seed=0, label="hyco-exact")
    assert pool.mat() == pytest.approx(3.84, rel=1e-3)
    a = pool.chain_acceptance()
    assert a == pytest.approx(min(1.0, pool.theta * 0.66))
    assert pool.floor_mat() == pytest.approx(1 + a + a**2 + a**3 + a**4)
    assert list(pool.kept_rows(0, 5)) == [0, *pool.trees[0].chain]
    with pytest.raises(ValueError, match="hyco: trees of this shape reach MAT .* below the paper's 9"):
        fit_theta(pool.trees, 9.0, exact=True, label="hyco")


def test_drafting_to_an_allowance():
    """Rows <= K + 1: the root and the chain's first rows - 1 tokens; more: the rows - 1 best-scored nodes (an
    ancestor-closed set, root first); the phone drafts the head alone at or below K + 1 rows, head + SLM above."""
    pool = TreePool(TreeModel(), [draw_tree(np.random.default_rng(5), TreeModel())], 1.0, 4.0)
    t = pool.trees[0]
    assert list(pool.kept_rows(0, 3)) == [0, t.chain[0], t.chain[1]]
    kept = pool.kept_rows(0, 12)
    assert len(kept) == 12 and kept[0] == 0 and all(t.parents[j] in set(kept) for j in kept[1:])
    best = sorted(range(1, t.real), key=lambda j: (-t.scores[j], j))[:11]
    assert sorted(kept[1:]) == sorted(best)
    assert phone_ms(57.0, 22.1, 5, 4) == 22.1 and phone_ms(57.0, 22.1, 6, 4) == 57.0
    assert phone_ms(151.1, 151.1, 5, 0) == 151.1  # no chain: every row count runs the SLM passes


def test_chain_only_acceptance():
    """Cloud+MTP's MAT 3.05 over a 4-token chain: the a with 1 + a + a^2 + a^3 + a^4 = 3.05."""
    a = chain_only_acceptance(3.05, 4)
    assert 1 + a + a**2 + a**3 + a**4 == pytest.approx(3.05, abs=1e-9)
