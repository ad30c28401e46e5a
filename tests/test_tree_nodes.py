"""DraftTreeNodes' bookkeeping (docs/device-runtime.md "Host work per round"): `add_many` equals `add` one node at a
time, and ``children`` lists each node's children's tokens as ``edges`` holds them."""

from __future__ import annotations

import numpy as np
from hycoc.runtime.tree_builder import DraftTreeNodes


def test_add_many_equals_add_one_at_a_time():
    rng = np.random.default_rng(3)
    one, many = DraftTreeNodes(), DraftTreeNodes()
    for t in (one, many):
        t.add(7, -1, 0.0, "root")
        t.add(11, 0, -0.5, "chain")
    parents = rng.integers(0, 2, 6)
    tokens, scores = rng.integers(0, 4096, 6), rng.normal(size=6)
    added = [one.add(tok, p, s, "slm") for tok, p, s in zip(tokens, parents, scores)]
    assert many.add_many(tokens.tolist(), parents.tolist(), scores.tolist(), "slm") == added == list(range(2, 8))
    assert many.nodes == one.nodes and many.edges == one.edges and many.children == one.children
    assert many.nodes[5].depth == many.nodes[int(parents[3])].depth + 1
    assert sorted((p, tok) for p, toks in many.children.items() for tok in toks) == sorted(many.edges)
    assert many.children[0][0] == 11
