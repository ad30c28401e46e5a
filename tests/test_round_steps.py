"""A verification round's pure steps (`hycoc.verifier.round_steps`) on trees small enough to work by hand;
tests/test_verifier_engine.py runs whole rounds on the toy verifier."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hycoc.verifier.draft_place import PLACES
from hycoc.verifier.errors import OverAllowance, RootMismatch, TreeError
from hycoc.verifier.round_steps import accept, ancestor_closed, check_round_tree

from hycoc.protocol.messages import Sampling

#      0
#     / \
#    1   2
#    |
#    3
#    |
#    4
PARENTS = np.array([-1, 0, 0, 1, 3])


@pytest.mark.parametrize(
    "rows,closed",
    [
        ([0], True),  # the root alone
        ([0, 1, 3], True),  # a chain from the root
        ([0, 2], True),
        ([0, 3], False),  # 3 without its parent 1
        ([1, 3], False),  # no root
        ([0, 1, 5], False),  # row 5 is past the tree's 5 rows
        ([], False),
    ],
)
def test_ancestor_closed_by_hand(rows, closed):
    assert ancestor_closed(np.array(rows, dtype=np.int64), PARENTS) is closed


def greedy_logits(argmax: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(argmax), vocab)
    logits[torch.arange(len(argmax)), torch.tensor(argmax)] = 5.0
    return logits


@pytest.mark.parametrize("mode", ["exact", "epsilon"])
def test_accept_follows_the_greedy_samples_down_the_tree(mode):
    # tree: root 5 -> 7 -> 9; greedy samples per row: 7 after the root, 9 after row 1, 3 after row 2
    tokens, parents = np.array([5, 7, 9]), np.array([-1, 0, 1])
    greedy = Sampling(0.0, 1, 1.0)
    v_star, path, samples = accept(
        tokens, parents, greedy_logits([7, 9, 3]), greedy, torch.Generator().manual_seed(0), mode, 1.0
    )
    # 7 matches row 1, 9 matches row 2, nothing below row 2: v* = 2, path rows 1 and 2, bonus = row 2's sample 3
    assert (v_star, path.tolist(), samples.tolist(), int(samples[v_star])) == (2, [1, 2], [7, 9, 3], 3)


def test_accept_takes_the_sibling_the_sample_names():
    # root 5 with children 6 (row 1) and 7 (row 2); the root's sample is 7: row 2 is accepted, its sample 4 the bonus
    tokens, parents = np.array([5, 6, 7]), np.array([-1, 0, 0])
    v_star, path, samples = accept(
        tokens, parents, greedy_logits([7, 1, 4]), Sampling(0.0, 1, 1.0), torch.Generator(), "exact", 1.0
    )
    assert (v_star, path.tolist(), int(samples[v_star])) == (2, [2], 4)


def test_check_round_tree_refuses_before_anything_changes():
    tokens, parents = np.array([5, 7, 9], dtype=np.int64), np.array([-1, 0, 1], dtype=np.int64)
    device = PLACES["device"]
    check_round_tree(tokens, parents, 0, 10, device, 0, 5, 3)  # allowance 0: not checked
    check_round_tree(tokens, parents, 0, 10, device, 3, 5, 3)  # 3 rows within an allowance of 3
    with pytest.raises(OverAllowance, match="round 4 has 3 rows; the last reply allowed at most 2"):
        check_round_tree(tokens, parents, 4, 10, device, 2, 5, 3)
    with pytest.raises(RootMismatch, match="tree root 5 is not the session's root 6 at position 3"):
        check_round_tree(tokens, parents, 0, 10, device, 0, 6, 3)
    with pytest.raises(TreeError):
        check_round_tree(tokens, parents, 0, 8, device, 0, 5, 3)  # id 9 is outside a vocabulary of 8
    root_only = next(p for p in PLACES.values() if not p.device_rows)
    with pytest.raises(TreeError, match="carry only the root, got 3 rows"):
        check_round_tree(tokens, parents, 0, 10, root_only, 0, 5, 3)
