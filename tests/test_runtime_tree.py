"""Alg. 3 (runtime/tree_builder.py) and Alg. 1 lines 8-9 (walk_reply, commit_cut) on hand-built inputs.

Scores are written in units of L = ln λ with λ = 0.5 (L < 0): doubling is exact in float, so equal scores are
equal bit for bit and tie rules are exercised, not floating-point noise.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hycoc.runtime.tree_builder import CHAIN, SIBLING, SLM, TreeBuilder, walk_reply

from hycoc.protocol.messages import commit_cut

L = math.log(0.5)
KEEP = np.array([10, 11, 12, 13, 14])
EOS = 1


def builder(budget=4, rows=6, candidates=2, passes=1):
    return TreeBuilder(
        ln_lambda=L, budget=budget, rows=rows, candidates=candidates, passes=passes, keep_set=KEEP, stop_ids=[EOS]
    )


# log q per node, in units of L (index = keep-set index; token = KEEP[index])
LOGQ = {
    0: [1, 2, 3, 4, 5],  # root: top-2 = idx 0 (tok 10), idx 1 (tok 11: already a child -> skipped)
    1: [5, 4, 1, 3, 2],  # node 1: idx 2 (tok 12: child) skipped, idx 4 (tok 14) -> s = L + 2L + L = 4L
    2: [0.5, 3, 3, 3, 3],  # node 2: idx 0 -> 3.5L, idx 1 (first of the tied 3L) -> 6L
    3: [3, 3, 3, 0.1, 3],
}  # node 3: idx 3 (tok 13) -> 3.1L, idx 0 -> 6L


class FakeSlm:
    def __init__(self):
        self.calls = []

    def __call__(self, tree, nodes):
        self.calls.append(list(nodes))
        return {v: np.asarray(LOGQ[v]) * L for v in nodes if v in LOGQ}


def test_plant_chain_and_siblings_with_scores():
    tree = builder().plant(100, [11, 12, 14], [13, 10])
    got = [(n.token, n.parent, n.score / L if n.parent >= 0 else 0.0, n.source) for n in tree.nodes]
    assert got == [
        (100, -1, 0.0, "root"),
        (11, 0, 1.0, CHAIN),
        (12, 1, 2.0, CHAIN),
        (14, 2, 3.0, CHAIN),
        (13, 0, 2.0, SIBLING),
        (10, 1, 3.0, SIBLING),
    ]
    # a runner-up equal to the chain token at its depth is not planted (line 6)
    tree = builder().plant(100, [11, 12], [11])
    assert [n.token for n in tree.nodes] == [100, 11, 12]


def test_one_slm_pass_threshold_and_rows():
    slm = FakeSlm()
    built = builder().build(100, [11, 12], [13], slm)
    # F by descending s: root (0), node 1 (L), nodes 2 and 3 (2L, insertion order)
    assert slm.calls == [[0, 1, 2, 3]]
    # scores: tree L, 2L, 2L; candidates (0,10) 2L, (1,14) 4L, (2,10) 3.5L, (2,11) 6L, (3,13) 3.1L, (3,10) 6L
    # theta = 4th highest = 2L -> only (0, 10) joins
    assert [(n.token, n.parent, n.source) for n in built.tree.nodes[4:]] == [(10, 0, SLM)]
    assert built.tokens.tolist() == [100, 11, 12, 13, 10, 10]  # padded to 6 rows by repeating the last
    assert built.parents.tolist() == [-1, 0, 1, 0, 0, 0]
    assert built.row_node == [0, 1, 2, 3, 4] and built.slm_passes == 1


def test_trim_keeps_the_earlier_of_tied_nodes():
    built = builder(budget=3, rows=4).build(100, [11, 12], [13], FakeSlm())
    # nodes 2, 3 and 4 all score 2L: the budget of 3 keeps node 1 (L) and the earlier two
    assert built.kept == [0, 1, 2, 3]
    assert built.tokens.tolist() == [100, 11, 12, 13] and built.parents.tolist() == [-1, 0, 1, 0]


def test_larger_budget_takes_candidates_down_to_theta_and_second_pass_expands_only_new_nodes():
    slm = FakeSlm()
    built = builder(budget=6, rows=8, passes=2).build(100, [11, 12], [13], slm)
    # theta = 6th highest of {L, 2L, 2L, 2L, 4L, 3.5L, 6L, 3.1L, 6L} = 3.5L: (0,10), (2,10), (3,13) join
    added = [(n.token, n.parent, round(n.score / L, 6)) for n in built.tree.nodes[4:]]
    assert added == [(10, 0, 2.0), (10, 2, 3.5), (13, 3, 3.1)]
    # line 15: the second pass runs over the nodes just added, by descending score
    assert slm.calls == [[0, 1, 2, 3], [4, 6, 5]]
    assert built.slm_passes == 2 and built.tokens.tolist() == [100, 11, 12, 13, 10, 10, 13, 13]


def test_chain_stops_at_an_end_of_turn_token_which_is_never_expanded():
    slm = FakeSlm()
    built = builder().build(100, [11, EOS, 12], [13], slm)
    assert [n.token for n in built.tree.nodes[:4]] == [100, 11, EOS, 13]
    assert slm.calls == [[0, 1, 3]]  # node 2 (EOS) is not in F


def test_no_chain_is_an_slm_only_tree_and_no_slm_is_the_planted_chain():
    slm = FakeSlm()
    built = builder(budget=2, rows=3).build(100, [], [], slm)
    assert slm.calls == [[0]] and built.tokens.tolist() == [100, 10, 11]  # root's two best tokens
    built = builder().build(100, [11, 12], [13], None)
    assert built.tokens.tolist() == [100, 11, 12, 13, 13, 13] and built.slm_passes == 0


def test_bad_constants_are_refused():
    with pytest.raises(ValueError, match="ln λ must be < 0"):
        TreeBuilder(ln_lambda=0.1, budget=4, rows=5, candidates=2, passes=1, keep_set=KEEP)
    with pytest.raises(ValueError, match="rows >= budget \\+ 1"):
        TreeBuilder(ln_lambda=L, budget=4, rows=4, candidates=2, passes=1, keep_set=KEEP)


# ---- Alg. 1 line 8: walking the reply ----------------------------------------------------------------------------

TOKENS = [100, 11, 12, 14, 13, 10, 10]
PARENTS = [-1, 0, 1, 2, 0, 0, 0]


def test_walk_accepts_nothing_when_no_child_matches_the_root_sample():
    assert walk_reply(TOKENS, PARENTS, [99, 0, 0, 0, 0, 0, 0]) == []


def test_walk_accepts_the_whole_chain_plus_an_slm_leaf():
    assert walk_reply(TOKENS, PARENTS, [11, 12, 14, 55, 0, 0, 0]) == [1, 2, 3]


def test_walk_ties_go_to_the_lowest_row():
    assert walk_reply(TOKENS, PARENTS, [10, 0, 0, 0, 0, 7, 7]) == [5]  # rows 5 and 6 are the same node


def test_commit_cuts_after_an_end_of_turn_token_and_at_the_cap():
    assert commit_cut([5, EOS, 7], {EOS}, 10, 100) == ([5, EOS], "stop")
    assert commit_cut([5, EOS, 7], {EOS}, 1, 100) == ([5], "max_new_tokens")
    assert commit_cut([5, 6, 7], {EOS}, 10, 100) == ([5, 6, 7], None)
    assert commit_cut([5, 6, 7], {EOS}, 3, 100) == ([5, 6, 7], "max_new_tokens")
    assert commit_cut([5, EOS], {EOS}, 2, 100) == ([5, EOS], "stop")  # the cap and a stop: stop


def test_commit_cuts_at_the_context_room_with_reason_length():
    assert commit_cut([5, 6, 7], {EOS}, 10, 2) == ([5, 6], "length")
    assert commit_cut([5, 6, 7], {EOS}, 10, 3) == ([5, 6, 7], "length")  # exactly full: no next root fits
    assert commit_cut([5, 6, 7], {EOS}, 3, 3) == ([5, 6, 7], "max_new_tokens")  # both at once: the cap first
    assert commit_cut([EOS, 6, 7], {EOS}, 10, 1) == ([EOS], "stop")


def test_trim_keeps_no_node_deeper_than_the_room_left():
    # A chain of 4 with a sibling at depth 1 and a leaf under it: with room for 2 levels only depths 1-2 stay.
    b = TreeBuilder(ln_lambda=math.log(0.66), budget=6, rows=7, candidates=2, passes=0, keep_set=np.arange(64))
    full = b.build(10, [11, 12, 13, 14], [21], None)
    assert [int(x) for x in full.tokens[:6]] == [10, 11, 12, 13, 14, 21]
    cut = b.build(10, [11, 12, 13, 14], [21], None, max_depth=2)
    assert [int(x) for x in cut.tokens] == [10, 11, 12, 21, 21, 21, 21]
    assert [int(x) for x in cut.parents] == [-1, 0, 1, 0, 0, 0, 0]
    root_only = b.build(10, [11, 12, 13, 14], [21], None, max_depth=0)
    assert [int(x) for x in root_only.tokens] == [10] * 7
