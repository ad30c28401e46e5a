"""Tree validation, depths, ancestors and the tree attention masks (Alg. 4 line 2)."""

import numpy as np
import pytest
import torch
from hycoc.verifier.errors import TreeError
from hycoc.verifier.tree import ancestor_matrix, path_to, tree_depths, tree_masks, validate_tree
from transformers.masking_utils import causal_mask_function, sliding_window_causal_mask_function

#      0
#    /   \
#   1     2
#  / \    |
# 3   4   5
#     |
#     6
PARENTS = [-1, 0, 0, 1, 1, 2, 4]


def test_validate_accepts_a_tree_and_names_bad_rows():
    validate_tree([5] * 7, PARENTS, vocab_size=10)
    cases = [
        (([1, 2], [0, 0]), "row 0"),
        (([1, 2, 3], [-1, 0, 2]), "row 2"),  # a row is not its own parent
        (([1, 2, 3], [-1, 2, 0]), "row 1"),  # a later row as parent (would allow cycles)
        (([1, 2, 3], [-1, 0, -1]), "row 2"),
        (([1, 10, 3], [-1, 0, 0]), "row 1"),  # token outside the vocabulary
        (([1, 2], [-1]), "equal length"),
        (([], []), "root"),
    ]
    for (tokens, parents), words in cases:
        with pytest.raises(TreeError, match=words):
            validate_tree(tokens, parents, vocab_size=10)


def test_depths_ancestors_paths():
    assert tree_depths(PARENTS).tolist() == [0, 1, 1, 2, 2, 2, 3]
    anc = ancestor_matrix(PARENTS)
    assert np.nonzero(anc[6])[0].tolist() == [0, 1, 4, 6]
    assert np.nonzero(anc[5])[0].tolist() == [0, 2, 5]
    assert path_to(PARENTS, 6) == [1, 4, 6]
    assert path_to(PARENTS, 0) == []


@pytest.mark.parametrize("t,window", [(0, 3), (5, 3), (5, 100), (2, 2)])
def test_tree_masks_match_transformers_rules(t, window):
    masks = tree_masks(PARENTS, t, window, torch.float32)
    full, sliding = masks["full_attention"], masks["sliding_attention"]
    rows = len(PARENTS)
    assert full.shape == sliding.shape == (1, 1, rows, t + rows)
    depth, anc = tree_depths(PARENTS), ancestor_matrix(PARENTS)
    key_pos = list(range(t)) + [t + d for d in depth]
    causal, swa = causal_mask_function, sliding_window_causal_mask_function(window)
    for j in range(rows):
        q = t + depth[j]
        for k in range(t + rows):
            # A key is a committed position or an ancestor-or-self tree row; positions then follow transformers.
            related = k < t or anc[j, k - t]
            qi, ki = torch.tensor(int(q)), torch.tensor(int(key_pos[k]))
            want_full = related and bool(causal(0, 0, qi, ki))
            want_sliding = related and bool(swa(0, 0, qi, ki))
            assert (full[0, 0, j, k] == 0) == want_full, (j, k)
            assert (sliding[0, 0, j, k] == 0) == want_sliding, (j, k)
    neg = full[full != 0]
    assert torch.isfinite(neg).all() and (neg == torch.finfo(torch.float32).min).all()


def test_sliding_window_boundary_inside_the_tree_rows():
    # A chain of 6 rows after t = 4, window 3: row 5 (position 9) sees positions 7, 8, 9 only, all tree rows.
    masks = tree_masks([-1, 0, 1, 2, 3, 4], 4, 3, torch.float32)
    visible = (masks["sliding_attention"][0, 0, 5] == 0).nonzero().flatten().tolist()
    assert visible == [4 + 3, 4 + 4, 4 + 5]
    assert (masks["full_attention"][0, 0, 5] == 0).all()


def test_mask_dtype():
    masks = tree_masks(PARENTS, 2, 4, torch.bfloat16)
    assert masks["sliding_attention"].dtype == torch.bfloat16
    assert masks["full_attention"].min() == torch.finfo(torch.bfloat16).min
