"""Path selection (Alg. 4 lines 6-12): the paper's epsilon rule on hand-built trees, exact acceptance, and the
rewritten samples leading the device's walk (Alg. 1 line 8) to v*."""

import numpy as np
import pytest
import torch
from hycoc.verifier.acceptance import descend, select_exact, select_path
from hycoc.verifier.tree import path_to

V = 10


def probs_from(rows: dict[int, dict[int, float]], n_rows: int) -> torch.Tensor:
    """p~ per row from {row: {token: prob}}; rows not given are one-hot on token 9 (never drafted here)."""
    p = torch.zeros(n_rows, V)
    p[:, 9] = 1.0
    for r, dist in rows.items():
        p[r] = 0.0
        for tok, val in dist.items():
            p[r, tok] = val
    return p


def test_deepest_ok_path_wins_over_a_shallower_hit():
    # 0 -> 1 (token 1, hit) ; 0 -> 2 (token 2, ok by epsilon) -> 3 (token 3, ok by epsilon)
    tokens, parents = [0, 1, 2, 3], [-1, 0, 0, 2]
    samples = [1, 9, 5, 9]
    probs = probs_from({0: {1: 0.5, 2: 0.3, 5: 0.2}, 2: {3: 0.1, 5: 0.9}}, 4)
    v, path, rewritten = select_path(tokens, parents, samples, probs, epsilon=0.05)
    assert v == 3 and path.tolist() == [2, 3]
    assert rewritten.tolist() == [2, 9, 3, 9]  # y^_0 <- 2, y^_2 <- 3; bonus = y^_3
    assert descend(tokens, parents, rewritten) == 3
    # With a higher threshold the edge 2 -> 3 (p~ = 0.1) is not ok: the hit at depth 1 (row 1) wins over row 2.
    v, path, _ = select_path(tokens, parents, samples, probs, epsilon=0.2)
    assert v == 1 and path.tolist() == [1]


def test_equal_depth_prefers_more_hits_then_higher_product():
    # Three depth-2 paths: 1->4 (two hits), 2->5 (one hit, large product), 3->6 (no hits, largest product).
    tokens, parents = [0, 1, 2, 3, 4, 5, 6], [-1, 0, 0, 0, 1, 2, 3]
    probs = probs_from(
        {0: {1: 0.1, 2: 0.2, 3: 0.7}, 1: {4: 0.1, 8: 0.9}, 2: {5: 0.9, 8: 0.1}, 3: {6: 0.95, 8: 0.05}}, 7
    )
    samples = [1, 4, 8, 8, 9, 9, 9]
    v, path, _ = select_path(tokens, parents, samples, probs, epsilon=0.05)
    assert v == 4 and path.tolist() == [1, 4]
    # One hit on each of 1->4 and 2->5 (none at the root): the higher product, 0.2 * 0.9 against 0.1 * 0.1, wins.
    samples = [8, 4, 5, 8, 9, 9, 9]
    v, _, rewritten = select_path(tokens, parents, samples, probs, epsilon=0.05)
    assert v == 5 and descend(tokens, parents, rewritten) == 5
    # No hits at all (sample 8 at the root): the highest product 0.7 * 0.95 wins.
    samples = [8, 8, 8, 8, 9, 9, 9]
    v, _, rewritten = select_path(tokens, parents, samples, probs, epsilon=0.05)
    assert v == 6 and rewritten[0] == 3 and rewritten[3] == 6


def test_equal_everything_goes_to_the_lowest_row():
    tokens, parents = [0, 1, 2], [-1, 0, 0]
    probs = probs_from({0: {1: 0.5, 2: 0.5}}, 3)
    v, _, _ = select_path(tokens, parents, [7, 9, 9], probs, epsilon=0.1)
    assert v == 1


def test_nothing_ok_gives_the_root_and_the_sample_as_bonus():
    tokens, parents = [0, 1, 2], [-1, 0, 1]
    probs = probs_from({0: {1: 0.001, 5: 0.999}}, 3)
    v, path, rewritten = select_path(tokens, parents, [5, 2, 9], probs, epsilon=0.005)
    assert v == 0 and path.tolist() == [] and rewritten[0] == 5


def test_an_ok_path_needs_every_edge_ok():
    # 0 -> 1 fails (p~ 0.001, no hit), so its child 2 (p~ 0.9) is not in A.
    tokens, parents = [0, 1, 2], [-1, 0, 1]
    probs = probs_from({0: {1: 0.001, 5: 0.999}, 1: {2: 0.9, 3: 0.1}}, 3)
    v, _, _ = select_path(tokens, parents, [5, 2, 9], probs, epsilon=0.005)
    assert v == 0


def test_duplicate_padding_rows_are_never_chosen():
    # Alg. 3 pads by repeating the last row: rows 2, 3 duplicate row 1's token under the same parent.
    tokens, parents = [0, 4, 4, 4], [-1, 0, 0, 0]
    probs = probs_from({0: {4: 1.0}}, 4)
    for eps in (0.005, 1.0):
        v, path, _ = select_path(tokens, parents, [4, 9, 9, 9], probs, epsilon=eps)
        assert v == 1 and path.tolist() == [1]
    assert select_exact(tokens, parents, [4, 9, 9, 9])[0] == 1


def test_epsilon_one_is_exact_and_rewrites_lead_to_v_star_on_random_trees():
    rng = np.random.default_rng(0)
    for _ in range(300):
        rows = int(rng.integers(1, 12))
        parents = [-1] + [int(rng.integers(0, j)) for j in range(1, rows)]
        tokens = rng.integers(0, 4, rows)  # a small vocabulary makes hits and duplicates frequent
        logits = torch.as_tensor(rng.normal(size=(rows, 4)) * 2, dtype=torch.float32)
        probs = torch.softmax(logits, -1)
        probs[rng.random(rows) < 0.2] = torch.eye(4)[0]  # some one-hot rows
        samples = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(int(rng.integers(1e6))))[:, 0]
        v_exact, path_exact, _ = select_exact(tokens, parents, samples)
        v_one, path_one, rewritten_one = select_path(tokens, parents, samples, probs, epsilon=1.0)
        assert (v_one, path_one.tolist()) == (v_exact, path_exact.tolist())
        assert rewritten_one.tolist() == samples.tolist()  # exact needs no rewriting
        for eps in (0.01, 0.2):
            v, path, rewritten = select_path(tokens, parents, samples, probs, epsilon=eps)
            assert descend(tokens, parents, rewritten) == v
            assert path.tolist() == path_to(parents, v)
            assert len(path) >= len(path_exact)  # epsilon only adds accepted nodes
            for c in path:  # every accepted edge is a hit or has p~ >= epsilon
                par = parents[c]
                assert tokens[c] == samples[par] or probs[par, tokens[c]] >= eps


def test_epsilon_out_of_range_raises():
    with pytest.raises(ValueError):
        select_path([0], [-1], [0], torch.ones(1, 1), epsilon=0.0)
