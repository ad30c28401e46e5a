"""The device drafts to the allowance (protocol 6: `RoundReply.allowance`, the rows the verifier lets the next tree
hold; runtime/tree_builder.py, runtime/drafters.py, runtime/client.py, runtime/slm_drafter.py `catch_up`).

Alg. 3 with an allowance of R rows: at the floor (R <= 1 + K, the root and the chain) no SLM pass, the root and the
chain's first R - 1 nodes; above it the full tree trimmed to its R - 1 best nodes; padded to R rows; at R = B + 1 the
tree Alg. 3 builds without an allowance. Rounds drafted at the floor leave the SLM ring behind the committed tokens;
the next SLM pass catches up first: in chunks of the graph's rows (each position's KV computed over the same ring as
a drafter that never skipped), or, more than a ring behind, by a cold refill (what a new request's fill holds).

Expected values come from the builder's own rules on hand-built scores (tests/test_runtime_tree.py's units of
L = ln 0.5), from the fake SLM graph whose KV encodes token and position (tests/test_runtime_drafters.py), and, on
the tiny recipe's real QDQ SLM graph, from a second drafter that never skipped.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hycoc.runtime.drafters import RuntimeProtocolError, allowed_rows
from hycoc.runtime.tree_builder import CHAIN, SIBLING, TreeBuilder
from test_runtime_drafters import WF, WS, chain_tree, k_value, ring, slm_drafter
from test_runtime_tree import EOS, KEEP, FakeSlm, L, builder
from test_runtime_trimmed import MAX_NEW, PROMPT, ROWS, PartialVerifier, greedy, runtime

from hycoc.protocol.messages import RoundReply


def same_tree(a, b) -> bool:
    return (
        np.array_equal(a.tokens, b.tokens)
        and np.array_equal(a.parents, b.parents)
        and a.scores.tobytes() == b.scores.tobytes()
        and a.kept == b.kept
        and a.slm_passes == b.slm_passes
    )


# ---- Alg. 3 under an allowance -------------------------------------------------------------------------------------


@pytest.mark.parametrize("passes", [1, 2])
def test_the_full_allowance_builds_the_tree_without_one(passes):
    b = builder(budget=6, rows=8, passes=passes)
    plain = b.build(100, [11, 12], [13], FakeSlm())
    assert same_tree(b.build(100, [11, 12], [13], FakeSlm(), rows=8), plain)
    assert same_tree(b.build(100, [11, 12], [13], FakeSlm(), rows=None), plain)


@pytest.mark.parametrize("rows", [4, 5, 6, 7])
def test_above_the_floor_the_full_tree_keeps_its_rows_minus_one_best_nodes(rows):
    b = builder(budget=6, rows=8)
    full = b.build(100, [11, 12], [13], FakeSlm())
    slm = FakeSlm()
    got = b.build(100, [11, 12], [13], slm, rows=rows)
    assert slm.calls == [[0, 1, 2, 3]] and got.slm_passes == 1  # the same SLM pass as the full tree's
    nodes = full.tree.nodes
    # line 16 with rows - 1 instead of B: highest score first, ties to the earlier node (every child scores below
    # its parent, so the best nodes are ancestor-closed already)
    best = sorted(range(1, len(nodes)), key=lambda i: (-nodes[i].score, i))[: rows - 1]
    assert got.kept == [0, *sorted(best)]
    assert len(got.tokens) == len(got.parents) == len(got.scores) == rows
    assert got.tokens.tolist() == [nodes[i].token for i in got.kept] + [nodes[got.kept[-1]].token] * (
        rows - len(got.kept)
    )


def test_at_the_floor_no_slm_pass_runs_and_the_tree_is_the_root_and_the_chain():
    b = builder(budget=6, rows=8)
    for rows in (1, 2, 3, 4):  # K = 3: the floor is 4 rows
        slm = FakeSlm()
        got = b.build(100, [11, 12, 14], [13, 10], slm, rows=rows)
        assert slm.calls == [] and got.slm_passes == 0
        want = [100, 11, 12, 14][:rows]
        assert got.tokens.tolist() == want and got.parents.tolist() == list(range(-1, rows - 1))
        # lines 3-4's scores: the k-th chain node scores k ln λ
        np.testing.assert_allclose(got.scores, np.float32(L) * np.arange(rows, dtype=np.float32), rtol=1e-6)
        assert [got.tree.nodes[i].source for i in got.kept[1:]] == [CHAIN] * (rows - 1)
    # one row above the floor: the SLM pass runs
    slm = FakeSlm()
    assert b.build(100, [11, 12, 14], [13, 10], slm, rows=5).slm_passes == 1 and slm.calls


def test_a_chain_cut_short_by_an_end_of_turn_token_leaves_rows_to_its_runner_ups():
    b = builder(budget=6, rows=8)
    slm = FakeSlm()
    # chain 11, EOS, 12: planted 11 (L), EOS (2L); runner-ups 13 under the root (2L), 10 under 11 (3L)
    got = b.build(100, [11, EOS, 12], [13, 10], slm, rows=4)
    assert slm.calls == []
    nodes = got.tree.nodes
    assert [(nodes[i].token, nodes[i].source) for i in got.kept] == [
        (100, "root"),
        (11, CHAIN),
        (EOS, CHAIN),
        (13, SIBLING),  # the better of the two runner-ups fills the last row
    ]
    assert got.tokens.tolist() == [100, 11, EOS, 13] and got.parents.tolist() == [-1, 0, 1, 0]


def test_the_floor_respects_the_room_left_in_the_context():
    got = builder(budget=6, rows=8).build(100, [11, 12, 14], [13, 10], None, max_depth=1, rows=3)
    # depth <= 1: chain node 11, then the root's runner-up 13; padded to 3 rows
    assert got.tokens.tolist() == [100, 11, 13] and got.parents.tolist() == [-1, 0, 0]


def test_an_slm_only_tree_has_its_floor_at_the_root():
    b = builder(budget=4, rows=6)
    slm = FakeSlm()
    assert b.build(100, [], [], slm, rows=1).tokens.tolist() == [100] and slm.calls == []
    got = b.build(100, [], [], slm, rows=2)
    assert slm.calls == [[0]] and got.tokens.tolist() == [100, 10]  # the root's best SLM candidate


def test_rows_outside_the_trees_rows_are_refused():
    b = builder(budget=4, rows=6)
    for rows in (0, 7):
        with pytest.raises(ValueError, match=f"a tree holds 1 to 6 rows .*not {rows}"):
            b.build(100, [11], [], None, rows=rows)


# ---- the reply's allowance -----------------------------------------------------------------------------------------


def reply(allowance: int) -> RoundReply:
    return RoundReply(4, np.zeros(1, np.int32), np.zeros(0, np.int32), 0, 1.0, False, allowance=allowance)


def test_the_allowance_bounds_the_next_trees_rows_and_a_bad_one_is_a_protocol_error():
    assert allowed_rows(4, None, 33) == 33  # the first tree: the session's tree rows
    assert allowed_rows(4, reply(0), 33) == 33  # none set
    assert [allowed_rows(4, reply(a), 33) for a in (1, 5, 33)] == [1, 5, 33]
    for bad in (34, -1):
        with pytest.raises(RuntimeProtocolError, match=rf"round 4: .*allowance = {bad} \(RoundReply.allowance\)"):
            allowed_rows(4, reply(bad), 33)


def allowance_verifier(allowance, codec: bool = True) -> PartialVerifier:
    """tests/test_runtime_trimmed.py's `PartialVerifier` (its verifier f) verifying every row, whose reply to round k
    grants ``allowance(k)`` rows; frames pass through the real codec unless ``codec`` is False."""
    as_is = None if codec else (lambda reply: reply)
    return PartialVerifier(lambda tokens, parents: None, tamper=as_is, allowance=allowance)


FLOOR = 4  # the stand-in MTP's chain is 3 tokens: root + chain


def schedule(k: int) -> int:
    """Full trees, then the floor and below for four rounds, then full again."""
    return [ROWS, 2, FLOOR, 1, FLOOR, ROWS, 5, ROWS][min(k, 7)]


@pytest.mark.parametrize("mode", ["hyco", "hyco-2p", "specedge"])
def test_every_tree_holds_its_allowance_and_the_text_is_the_verifiers(mode):
    rt = runtime()  # its spy checks, at every commit, that every ring column holds its committed token's KV
    forwards = rt.forwards  # the SLM forwards of each tree built
    caught = []
    catch_up = rt.slm.catch_up
    rt.slm.catch_up = lambda reserve: caught.append((len(rt.built), catch_up(reserve)))
    verifier = allowance_verifier(schedule)
    res = rt.generate(verifier, PROMPT, mode=mode, max_new_tokens=40)  # rounds past the schedule's last floor
    assert res.tokens == greedy(PROMPT, 40)
    granted = [ROWS] + [schedule(k) for k in range(len(verifier.trees) - 1)]
    assert [len(t.tokens) for t in verifier.trees] == res.sent_rows == granted
    floor = 1 if mode == "specedge" else FLOOR  # SpecEdge's tree has no chain: its floor is the root alone
    for rows, n, built in zip(granted, forwards, rt.built):
        if rows <= floor:
            assert n == 0 and built.slm_passes == 0, rows  # no SLM forward at the floor
        else:
            assert n >= 1 and built.slm_passes >= 1, rows
    # the passes after the floor caught up: the ring holds KV past every token committed at the floor (and the
    # runtime's spy checked, at every commit, that each ring column holds its own committed token's KV)
    last_floor = max(j for j, rows in enumerate(granted) if rows <= floor)
    assert last_floor < len(granted) - 1
    # one catch-up, before the first tree with an SLM pass after a streak at the floor (trees counted before it)
    streak_ends = [j for j in range(1, len(granted)) if granted[j] > floor and granted[j - 1] <= floor]
    assert [j for j, _ in caught] == streak_ends and all(kind != "none" for _, kind in caught)
    assert rt.slm.n_kv >= len(PROMPT) - 1 + sum(a + 1 for a in res.accepted[: last_floor + 1])


def test_a_verifier_that_never_lowers_the_allowance_gets_the_trees_of_one_that_sets_none():
    trees = []
    for allowance in (ROWS, 0):
        rt = runtime()
        verifier = allowance_verifier(lambda k, a=allowance: a, codec=allowance > 0)  # 0: the codec refuses it
        rt.generate(verifier, PROMPT, mode="hyco", max_new_tokens=MAX_NEW)
        trees.append([(t.tokens.tobytes(), t.parents.tobytes(), t.scores.tobytes()) for t in verifier.trees])
    assert trees[0] == trees[1]


@pytest.mark.parametrize("mode, bad", [("hyco", ROWS + 1), ("hyco", -2), ("cloud-mtp", 2)])
def test_an_allowance_outside_the_sessions_rows_stops_the_request(mode, bad):
    rt = runtime()
    verifier = allowance_verifier(lambda k: bad, codec=False)
    if mode == "cloud-mtp":  # the server drafts: a one-row session
        verifier.open = lambda request, o=verifier.open: replace(o(request), tree_rows=1)
    with pytest.raises(RuntimeProtocolError, match=rf"round 0: .*allowance = {bad} \(RoundReply.allowance\)"):
        rt.generate(verifier, PROMPT, mode=mode, max_new_tokens=MAX_NEW)
    assert len(verifier.trees) == 1


# ---- the SLM ring catches up after rounds at the floor (fake graph: KV = token and position) ---------------------


def floor_rounds(slm, tokens_per_round: int, rounds: int, start: int = 10) -> None:
    """``rounds`` rounds at the floor: each commits ``tokens_per_round`` tokens and runs no SLM forward."""
    for r in range(rounds):
        slm.commit([], [(start + r * tokens_per_round + i) % 5 for i in range(tokens_per_round)])


def test_catch_up_runs_the_committed_tokens_in_chunks_then_the_pass_fits_its_tree():
    slm = slm_drafter()  # R = 6 rows, rings of 4 (sliding) and 8 (full)
    slm.start([3, 4, 2])
    slm.expand(chain_tree(2, [1]), [1])
    slm.commit([1], [1, 0])
    floor_rounds(slm, 3, 2)  # the last bonus and 6 more tokens: positions 4..9 without KV, the root at 10
    behind = slm.t - slm.n_kv
    assert behind == 6 and behind + 1 > slm.rows - 3  # more than the pass can carry beside 3 planted rows
    forwards = slm.forwards
    assert slm.catch_up(reserve=3) == "chunks"
    # one chunk of R = 6 rows, in order, then at most R - 3 rows wait (the root included)
    assert slm.forwards - forwards == 1 and slm.t - slm.n_kv + 1 <= slm.rows - 3
    slm.expand(chain_tree(slm.tokens[-1], [1, 2, 3]), [1, 2, 3])  # the root, the prefix and three planted rows fit
    assert slm.forwards - forwards == 2
    for p in range(max(0, slm.n_kv - WS), slm.n_kv):  # every position's KV is its own token's at its own position
        assert ring(slm, 0, p) == k_value(slm.tokens[p], p)
    for p in range(max(0, slm.n_kv - WF), slm.n_kv):
        assert ring(slm, 1, p, 1) == k_value(slm.tokens[p], p, 1, 1)
    assert slm.catch_up(reserve=3) == "none"  # caught up: nothing to run


def test_more_than_a_ring_behind_refills_cold_as_a_new_request_would():
    slm = slm_drafter()
    slm.start([3, 4, 2])
    floor_rounds(slm, 3, 4)  # 12 tokens behind > the 8-column ring
    assert slm.catch_up(reserve=3) == "refill"
    cold = slm_drafter()
    cold.start(slm.tokens)
    cold.prefill(reserve=3)
    assert (slm.live_start, slm.n_kv) == (cold.live_start, cold.n_kv) == (slm.t - WF, cold.n_kv)
    for layer in (0, 1):
        for kv in (0, 1):
            np.testing.assert_array_equal(slm.rings[layer][kv], cold.rings[layer][kv])


# ---- the same on the tiny recipe's real SLM graph ------------------------------------------------------------------


def drive(slm, prompt, continuation, skip, rounds, k, reserve):
    """Rounds of a chain of the next ``k`` committed tokens, every one accepted (so the path's KV comes from the
    tree forward), with the rounds in ``skip`` at the floor (no forward; the next pass catches up first). Returns
    each pass's candidates of the root."""
    slm.start(prompt)
    slm.prefill(reserve=reserve)
    pos, behind, roots = 0, False, []
    for r in range(rounds):
        new = continuation[pos : pos + k + 1]
        if r in skip:
            slm.commit([], new)
            behind = True
        else:
            if behind:
                slm.catch_up(reserve)
                behind = False
            cands = slm.expand(chain_tree(slm.tokens[-1], new[:k]), list(range(1, k + 1)))
            roots.append((np.asarray(cands[0].index).copy(), np.asarray(cands[0].logq).copy()))
            slm.commit(list(range(1, k + 1)), new)
        pos += k + 1
    return roots


@pytest.fixture(scope="module")
def tiny_slms(tiny_bundle):
    from hycoc.runtime.client import load_runtime

    return [load_runtime(tiny_bundle.bundle, "cpu", threads=1) for _ in range(3)]


def test_on_the_real_graph_a_drafter_that_skipped_catches_up_to_one_that_never_did(tiny_slms):
    a, b, cold = tiny_slms
    r = a.bundle.round
    k, reserve = r.chain_length, r.chain_length + r.sibling_depth
    keep = [int(x) for x in a.bundle.keep_set if int(x) not in a.stop_ids]
    prompt = [keep[1], *keep[5:12]]
    rng = np.random.default_rng(0)
    continuation = [keep[i] for i in rng.integers(0, len(keep), 200)]
    rounds = 14
    # skipped for fewer tokens than the ring holds: chunks, so the KV must match the drafter that never skipped
    skip = set(range(2, 2 + (a.slm.window - 1) // (k + 1)))
    ra = drive(a.slm, prompt, continuation, set(), rounds, k, reserve)
    rb = drive(b.slm, prompt, continuation, skip, rounds, k, reserve)
    assert a.slm.tokens == b.slm.tokens and a.slm.n_kv == b.slm.n_kv and a.slm.live_start == b.slm.live_start
    # Each position's K/V row is the same function of the same inputs in both (its token, its position, the ring
    # positions it attends to); only where its keys sit in the forward differs (ring columns vs the forward's own
    # rows), which can move the attention's float sums by an ulp, and the graph's 16-bit output encoding by at
    # most one step. Measured on this build: every code equal.
    exact = 0
    total = 0
    for i in a.slm.kv_layers:
        w = a.slm.ring_len[a.slm.layer_types[i]]
        cols = [p % w for p in range(max(a.slm.live_start, a.slm.n_kv - w), a.slm.n_kv)]
        for j, name in enumerate((f"k_new_{i}", f"v_new_{i}")):
            scale = next(o.encoding.scale for o in a.bundle.manifest.graph("slm").outputs if o.name == name)
            steps = np.abs(a.slm.rings[i][j][0][:, cols].astype(np.float64) - b.slm.rings[i][j][0][:, cols]) / scale
            assert steps.max() <= 1 + 1e-6, (name, steps.max())
            exact += int((steps == 0).sum())
            total += steps.size
    print(f"\nreal SLM graph, caught up vs never skipped: {exact} of {total} ring codes equal")
    if exact == total:  # equal rings and the same live range: the next pass's feeds, so its outputs, are equal
        assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(ra[-3:], rb[-3:]))
    assert b.slm.forwards < a.slm.forwards  # the skipped rounds' passes were not run, only their catch-up chunks
    # skipped for more tokens than the ring holds: the cold refill holds what a new request on those ids holds
    skip = set(range(2, 2 + a.slm.window // (k + 1) + 2))
    drive(b.slm, prompt, continuation, skip, max(skip) + 1, k, reserve)
    assert b.slm.t - b.slm.n_kv > b.slm.window and b.slm.catch_up(reserve) == "refill"
    cold.slm.start(b.slm.tokens)
    cold.slm.prefill(reserve=reserve)
    assert (b.slm.live_start, b.slm.n_kv) == (cold.slm.live_start, cold.slm.n_kv)
    for i in b.slm.kv_layers:
        for j in (0, 1):
            np.testing.assert_array_equal(b.slm.rings[i][j], cold.slm.rings[i][j])


def test_the_builder_refuses_an_allowance_below_the_root():
    with pytest.raises(ValueError, match="not 0"):
        TreeBuilder(ln_lambda=L, budget=4, rows=5, candidates=2, passes=1, keep_set=KEEP).build(1, [], [], None, rows=0)
