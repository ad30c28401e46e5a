"""The MTP Drafter (Alg. 2) and the SLM Drafter's ring and commit (Alg. 3 lines 7-8, Alg. 1 line 10) on fake graphs
whose outputs are worked out by hand (runtime/mtp_drafter.py, runtime/slm_drafter.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hycoc.runtime.mtp_drafter import HandoffError, MtpDrafter, NoHandoff, top2
from hycoc.runtime.slm_drafter import SlmDrafter
from hycoc.runtime.tree_builder import DraftTreeNodes

from hycoc.host import FULL, MASK_VALUE, SLIDING, RotaryTable
from hycoc.protocol.messages import HandOff

H, W, KV, D = 3, 4, 1, 2  # verifier hidden, head ring columns, KV heads, head dim (both layer types)
KEEP = np.array([20, 21, 22, 23])


class FakeHead:
    """The head graph: returns the queued logits; h_next = 7 + call index."""

    def __init__(self, logits):
        self.logits, self.feeds = list(logits), []

    def shape(self, name):
        return {"x_hat": (1, 1, 2 * H)}.get(name, (1, KV, W, D))

    def run(self, feeds):
        self.feeds.append({k: v.copy() for k, v in feeds.items()})
        return {
            "logits": np.asarray(self.logits.pop(0), np.float32).reshape(1, 1, -1),
            "h_next": np.full((1, 1, H), 7.0 + len(self.feeds), np.float32),
        }


def head_bundle():
    rot = RotaryTable(np.array([0.1], np.float32), 1.0, 2)
    e_q = np.arange(len(KEEP) * H, dtype=np.int8).reshape(len(KEEP), H)
    e_scale = np.full((len(KEEP), 1), 0.5, np.float32)
    return SimpleNamespace(
        round=SimpleNamespace(chain_length=3, sibling_depth=2, head_window=W, head_query_position_offset=-1),
        host=SimpleNamespace(head=SimpleNamespace(sliding_window=2)),
        keep_set=KEEP,
        head_rotary={SLIDING: rot, FULL: rot},
        embed_keep=lambda i: e_q[i].astype(np.float32) * e_scale[i, 0],
    )


def handoff(t_prime, a, base=0, scale=1.0):
    n = t_prime - a
    rows = (base + np.arange(a, t_prime, dtype=np.int8)[:, None] * 10 + np.arange(KV * D, dtype=np.int8)).astype(
        np.int8
    )
    return HandOff(
        t_prime=t_prime,
        a=a,
        bonus=5,
        x_hat=np.arange(2 * H, dtype=np.int8),
        k_sliding=rows,
        v_sliding=-rows,
        k_full=rows + 1,
        v_full=rows.reshape(n, KV * D),
        scales=(1, 2, scale, 1, 1, 1),
    )


def test_top2_is_first_among_equals():
    assert top2([3, 5, 5]) == (1, 2)
    assert top2([5, 5, 1]) == (0, 1)
    assert top2([1, 2, 3]) == (2, 1)


def test_ring_wraps_around_and_masks_the_live_range():
    mtp = MtpDrafter(FakeHead([]), head_bundle())
    mtp.ingest(handoff(3, 0, scale=0.5))  # positions 0, 1, 2 -> columns 0, 1, 2
    k = mtp.ring[SLIDING][0][0, 0, :, 0]
    assert k.tolist() == [0.0, 5.0, 10.0, 0.0]  # row p = 10 p (int8) x scale 0.5
    f = mtp.feeds(mtp.x_hat)
    assert (f["mask_full"][0, 0, 0] == 0).tolist() == [True, True, True, False]
    assert (f["mask_sliding"][0, 0, 0] == 0).tolist() == [False, True, True, False]  # last min(W, 2) positions
    assert f["mask_full"][0, 0, 0, 3] == MASK_VALUE
    mtp.ingest(handoff(6, 3))  # same request (a == t0): positions 3, 4, 5 -> cols 3, 0, 1
    assert mtp.ring[FULL][0][0, 0, :, 0].tolist() == [41.0, 51.0, 21.0, 31.0]
    assert mtp.live == 2
    f = mtp.feeds(mtp.x_hat)
    assert (f["mask_full"][0, 0, 0] == 0).all()  # live [2, 6) covers all four columns
    assert (f["mask_sliding"][0, 0, 0] == 0).tolist() == [True, True, False, False]  # positions 4, 5
    cos, _ = RotaryTable(np.array([0.1], np.float32), 1.0, 2).rows(np.array([[5]]))  # query fixed at t - 1
    assert np.array_equal(f["cos_full"], cos)
    mtp.ingest(handoff(2, 0))  # a != t0: a new request clears the ring
    assert mtp.ring[FULL][0][0, 0, :, 0].tolist() == [1.0, 11.0, 0.0, 0.0] and mtp.live == 0
    assert (mtp.feeds(mtp.x_hat)["mask_full"][0, 0, 0] == 0).tolist() == [True, True, False, False]


def test_bad_handoffs_are_refused_before_anything_is_written():
    mtp = MtpDrafter(FakeHead([]), head_bundle())
    with pytest.raises(NoHandoff):
        mtp.draft()
    with pytest.raises(HandoffError, match="do not fit a 4-column ring"):
        mtp.ingest(handoff(6, 0))
    h = handoff(2, 0)
    with pytest.raises(HandoffError, match="sliding rows"):
        mtp.ingest(HandOff(**{**h.__dict__, "k_sliding": h.k_sliding[:1]}))
    with pytest.raises(HandoffError, match="6 finite positive"):
        mtp.ingest(HandOff(**{**h.__dict__, "scales": (1, float("nan"), 1, 1, 1, 1)}))
    with pytest.raises(HandoffError, match="x_hat has 4 values"):
        mtp.ingest(HandOff(**{**h.__dict__, "x_hat": np.zeros(4, np.int8)}))
    # int8 rows are checked by their largest magnitude x scale (127 x 3e36 overflows float32); float rows value by value
    with pytest.raises(HandoffError, match="full rows hold NaN or inf"):
        mtp.ingest(HandOff(**{**h.__dict__, "scales": (1, 2, 1, 1, 3e36, 1)}))
    with pytest.raises(HandoffError, match="x_hat holds NaN or inf"):
        mtp.ingest(HandOff(**{**h.__dict__, "scales": (1, 3e36, 1, 1, 1, 1)}))
    with pytest.raises(HandoffError, match="sliding rows hold NaN or inf"):
        mtp.ingest(HandOff(**{**h.__dict__, "v_sliding": np.where(h.v_sliding == 0, np.nan, h.v_sliding)}))
    assert mtp.t0 is None and not mtp.ring[FULL][0].any()
    mtp.ingest(HandOff(**{**h.__dict__, "scales": (1, 2, 1, 1, 2e36, 1)}))  # 128 x 2e36 still fits float32
    assert mtp.ring[FULL][0].max() == np.float32(h.k_full.max()) * np.float32(2e36)


def test_draft_chain_runner_ups_and_next_input():
    # step 1: a tie between indices 1 and 2 -> y1 = KEEP[1], y1' = KEEP[2] (both planted: different tokens)
    head = FakeHead([[0, 5, 5, 1], [9, 0, 0, 1], [0, 0, 1, 2]])
    mtp = MtpDrafter(head, head_bundle())
    mtp.ingest(handoff(3, 0))
    d = mtp.draft()
    assert d.chain == [21, 20, 23] and d.runner_ups == [22, 23]  # D = 2: no runner-up at depth 3
    assert head.feeds[0]["x_hat"].reshape(-1).tolist() == [0, 1, 2, 6, 8, 10]  # [e x 1; h x 2]
    # step 2 input: [E[1]; h_next of step 1] = [3, 4, 5] x 0.5 and 8.0
    assert head.feeds[1]["x_hat"].reshape(-1).tolist() == [1.5, 2.0, 2.5, 8.0, 8.0, 8.0]
    assert all(np.array_equal(f["k_full"], head.feeds[0]["k_full"]) for f in head.feeds)  # ring not extended


# ---- the SLM Drafter -------------------------------------------------------------------------------------------

R, WS, WF, V = 6, 4, 8, 5  # graph rows, sliding ring, full ring, keep-set size


class FakeLut:
    def lookup(self, ids):
        return np.repeat(np.asarray(ids, np.float32)[..., None], 2, axis=-1)  # embedding = token id


class FakeRotary:
    def rows(self, positions):
        p = np.asarray(positions, np.float32)[..., None]
        return p, np.zeros_like(p)  # cos = position


class FakeSlmGraph:
    """k_new[h, j] = 100 token + position + 1000 h (+ 0.5 in layer 1); v_new = -k_new."""

    def __init__(self):
        self.feeds = []

    def shape(self, name):
        return {
            "inputs_embeds": (1, R, 2),
            "mask_sliding": (1, 1, R, WS + R),
            "mask_full": (1, 1, R, WF + R),
            "k_ring_0": (1, 2, WS, 1),
            "v_ring_0": (1, 2, WS, 1),
            "k_ring_1": (1, 2, WF, 1),
            "v_ring_1": (1, 2, WF, 1),
        }[name]

    def run(self, feeds):
        feeds = {k: v.copy() for k, v in feeds.items()}  # masks and rings are the drafter's buffers, reused
        self.feeds.append(feeds)
        tok = feeds["inputs_embeds"][0, :, 0]
        pos = feeds["cos_full"][0, :, 0]
        out = {"logits": np.zeros((1, R, V), np.float32)}
        out["logits"][0, np.arange(R), tok.astype(int) % V] = 1.0
        for i in (0, 1):
            k = 100 * tok[None, :] + pos[None, :] + 1000 * np.arange(2)[:, None] + 0.5 * i
            out[f"k_new_{i}"] = k[None, :, :, None].astype(np.float32)
            out[f"v_new_{i}"] = -out[f"k_new_{i}"]
        return out


def slm_drafter():
    bundle = SimpleNamespace(
        host=SimpleNamespace(
            slm=SimpleNamespace(layer_types=[SLIDING, FULL], kv_layers=[0, 1], sliding_window=3, per_layer_dim=0)
        ),
        slm_luts={"embed_tokens": FakeLut()},
        slm_rotary={SLIDING: FakeRotary(), FULL: FakeRotary()},
        keep_set=np.arange(V),
    )
    return SlmDrafter(FakeSlmGraph(), bundle)


def ring(slm, layer, position, head=0):
    w = WS if layer == 0 else WF
    return float(slm.rings[layer][0][0, head, position % w, 0])


def k_value(token, position, head=0, layer=0):
    return 100 * token + position + 1000 * head + 0.5 * layer


def chain_tree(root, chain):
    tree = DraftTreeNodes()
    tree.add(root, -1, 0.0, "root")
    for i, tok in enumerate(chain):
        tree.add(tok, i, -1.0 - i, "chain")
    return tree


def test_first_forward_runs_committed_rows_then_root_then_nodes_and_commit_moves_the_path():
    slm = slm_drafter()
    slm.start([3, 4, 2])  # t = 2: positions 0, 1 need SLM KV, root 2 at position 2
    tree = chain_tree(2, [1, 4])
    logq = slm.expand(tree, [1, 2])
    feeds = slm.runner.feeds[-1]
    assert feeds["inputs_embeds"][0, :, 0].tolist() == [3, 4, 2, 1, 4, 4]  # padded by repeating the last
    assert feeds["cos_full"][0, :, 0].tolist() == [0, 1, 2, 3, 4, 4]
    assert set(logq) == {0, 1, 2} and logq[1].index[0] == 1  # row of node 1 (token 1)
    # committed rows are in the ring at once, for every KV head and layer; the root is not yet
    assert [ring(slm, 0, 0, h) for h in (0, 1)] == [k_value(3, 0, 0), k_value(3, 0, 1)]
    assert ring(slm, 1, 1, 1) == k_value(4, 1, 1, 1) and slm.n_kv == 2 and ring(slm, 1, 2) == 0
    # the verifier accepts node 1 (token 1) and sends bonus 0: root and node 1 move to positions 2 and 3
    assert slm.commit([1], [1, 0]) == 1
    assert slm.n_kv == 4 and slm.tokens == [3, 4, 2, 1, 0]
    for h in (0, 1):
        assert ring(slm, 0, 2, h) == k_value(2, 2, h) and ring(slm, 0, 3, h) == k_value(1, 3, h)
        assert ring(slm, 1, 3, h) == k_value(1, 3, h, 1)
        assert slm.rings[1][1][0, h, 3, 0] == -k_value(1, 3, h, 1)  # values too
    # next round: only the bonus (root) lacks KV; it sits at position 4
    slm.expand(chain_tree(0, []), [])
    assert slm.runner.feeds[-1]["cos_full"][0, 0, 0] == 4 and slm.n_kv == 4


def test_commit_of_an_slm_leaf_without_kv_leaves_it_for_the_next_forward_and_the_ring_wraps():
    slm = slm_drafter()
    slm.start([3, 4, 2])
    tree = chain_tree(2, [1])
    leaf = tree.add(4, 1, -5.0, "slm")  # an SLM candidate: never forwarded, no KV
    slm.expand(tree, [1])
    assert slm.commit([1, leaf], [1, 4, 3]) == 1
    assert slm.n_kv == 4 and slm.tokens == [3, 4, 2, 1, 4, 3]
    slm.expand(chain_tree(3, []), [])
    feeds = slm.runner.feeds[-1]
    assert feeds["inputs_embeds"][0, :2, 0].tolist() == [4, 3] and feeds["cos_full"][0, :2, 0].tolist() == [4, 5]
    # the leaf (position 4) is committed at once; in the 4-column sliding ring it overwrites position 0
    assert (
        ring(slm, 0, 4) == k_value(4, 4)
        and ring(slm, 1, 4) == k_value(4, 4, 0, 1)
        and ring(slm, 1, 0) == k_value(3, 0, 0, 1)
    )
    # mask of the root row (position 5) in that forward (the ring then held positions 0..3; position 4 is row 0):
    # sliding window 3 -> ring position 3 only (column 3); full -> positions 0..3 (columns 4..7 hold none yet)
    m_s = feeds["mask_sliding"][0, 0, 1] == 0
    assert m_s.tolist() == [False, False, False, True] + [True, True, False, False, False, False]
    m_f = feeds["mask_full"][0, 0, 1, :WF] == 0
    assert m_f.tolist() == [True] * 4 + [False] * 4


def test_a_round_that_accepts_nothing_moves_only_the_root():
    slm = slm_drafter()
    slm.start([3, 2])
    slm.expand(chain_tree(2, [1, 4]), [1, 2])
    assert slm.commit([], [0]) == 0 and slm.n_kv == 2 and ring(slm, 0, 1) == k_value(2, 1)


def test_long_prompt_fills_the_ring_in_chunks_of_r_rows():
    slm = slm_drafter()
    slm.start(list(range(1, 12)))  # t = 10; the ring holds the last W = 8 positions: 2..9 + root
    assert slm.live_start == 2
    assert slm.prefill(reserve=2) == 1  # 9 rows without KV > R - 2: one chunk of 6 (positions 2..7)
    assert slm.n_kv == 8 and ring(slm, 1, 7) == k_value(8, 7, 0, 1)
    slm.expand(chain_tree(11, []), [])
    assert slm.runner.feeds[-1]["cos_full"][0, :3, 0].tolist() == [8, 9, 10]
    # the chunk's first row sees no ring column (nothing before live_start = 2 is this request's); the next
    # forward's first row (position 8) sees positions 2..7 in columns 2..7
    assert not (slm.runner.feeds[0]["mask_full"][0, 0, 0, :WF] == 0).any()
    first = slm.runner.feeds[1]["mask_full"][0, 0, 0, :WF] == 0
    assert first.tolist() == [False, False, True, True, True, True, True, True]


def test_a_repeated_row_layout_is_served_from_the_kept_arrays():
    from hycoc.host import MASK_VALUE, TreeShapeError, tree_rows

    slm = slm_drafter()
    parents = [-1, 0, 1, 1, 0, 4] + [4] * (slm.rows - 6)
    depths, anc, block, count = slm._rows_of(parents)
    want_d, want_anc = tree_rows(parents)
    assert depths.tolist() == want_d.tolist() and np.array_equal(anc, want_anc) and count == 3
    assert np.array_equal(block, np.where(want_anc, np.float32(0.0), np.float32(MASK_VALUE)))
    again = slm._rows_of(list(parents))  # an equal list: the same arrays, read-only
    assert all(a is b for a, b in zip(again[:3], (depths, anc, block))) and not block.flags.writeable
    with pytest.raises(TreeShapeError):
        slm._rows_of([-1, 2] + [0] * (slm.rows - 2))


# ---- a conversation's rollback (docs/serving.md "Conversations") -------------------------------------------------


def test_rollback_crops_what_follows_the_kept_prefix():
    slm = slm_drafter()
    slm.start([3, 4, 2])
    slm.expand(chain_tree(2, [1, 4]), [1, 2])
    slm.commit([1], [1, 0])  # positions 0..3 have KV, token 0 (position 4) none
    assert slm.rollback(5) == "none" and slm.n_kv == 4  # nothing after the kept ids had KV
    assert slm.rollback(3) == "crop" and (slm.tokens, slm.n_kv) == ([3, 4, 2], 3)
    slm.commit([], [7, 5])  # the re-rendered conversation continues with 7, root 5
    slm.expand(chain_tree(5, []), [])
    feeds = slm.runner.feeds[-1]
    assert feeds["inputs_embeds"][0, :2, 0].tolist() == [7, 5] and feeds["cos_full"][0, :2, 0].tolist() == [3, 4]
    # the first row (position 3) sees positions 0..2 in the full ring, never the dropped position 3
    assert (feeds["mask_full"][0, 0, 0, :WF] == 0).tolist() == [True, True, True] + [False] * (WF - 3)
    assert ring(slm, 0, 3) == k_value(7, 3) and ring(slm, 1, 3) == k_value(7, 3, 0, 1)


def test_rollback_past_a_wrapped_ring_refills_it_cold():
    slm = slm_drafter()
    slm.start(list(range(1, 12)))  # t = 10: the rings hold positions 2..9
    slm.prefill(reserve=2)
    slm.expand(chain_tree(11, []), [])
    slm.commit([], [12])  # n_kv 11: the 4-column sliding ring holds positions 7..10
    assert slm.n_kv == 11
    with pytest.raises(ValueError):
        slm.rollback(0)
    assert slm.rollback(8) == "refill"  # position 8 needs 4..7 in the sliding ring: 4..6 were overwritten
    assert slm.tokens == list(range(1, 9)) and slm.live_start == slm.n_kv == 0
    slm.commit([], [20, 21])
    slm.prefill(reserve=1)
    slm.expand(chain_tree(21, []), [])
    for p in range(max(slm.live_start, slm.n_kv - WS), slm.n_kv):  # what a cold start on these ids holds
        assert ring(slm, 0, p) == k_value(slm.tokens[p], p)
