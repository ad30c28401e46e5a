"""The head's static ring-window graph (paper Alg. 2, §3.4) against `hycoc.mtp.head_step` on tiny random models.

The reference is head_step over the verifier's whole KV with `window_mask` masks (positions in order); the graph
reads a W-column ring (row p in column p mod W) with `ring_masks`. Tolerances, float32 throughout: against
head_step over the SAME ring tensors only the attention kernel differs (sdpa vs eager), 1e-5 absolute; against
head_step over the full-length KV the keys also sit in another order, so softmax and P.V sum in another order:
1e-5 relative + 1e-5 absolute on logits of magnitude ~10 (observed up to ~1.1e-5 absolute).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hycoc.passes.head.captures import verifier_capture
from hycoc.passes.head.graph import (
    INPUT_NAMES,
    MASK_VALUE,
    HeadGraph,
    embedding_table,
    ring_masks,
    rotary_rows,
    rotary_tables,
)
from hycoc.passes.head.quantize import restrict_output_layer
from tiny_models import SLIDING_WINDOW, tiny_head, tiny_verifier

from hycoc.mtp import FULL, SLIDING, head_step, window_mask

torch.set_num_threads(1)
W = 12  # ring columns; > the tiny sliding window (8), so the two layers' masks differ
K = 4
SEQ = 30


@pytest.fixture(scope="module")
def models():
    verifier = tiny_verifier()
    head = tiny_head(verifier)
    keep = torch.sort(torch.randperm(300, generator=torch.Generator().manual_seed(3))[:120]).values
    return verifier, head, keep


@pytest.fixture(scope="module")
def states(models):
    verifier, _, _ = models
    ids = torch.randint(3, 300, (SEQ,), generator=torch.Generator().manual_seed(0))
    return verifier_capture(verifier, ids)


def ring(kv, t: int, live_start: int):
    """Alg. 2 line 4: rows of positions [max(live_start, t - W), t) written to column p mod W (others zero)."""
    out = {}
    for kind, (k, v) in kv.items():
        rk = torch.zeros(1, k.shape[1], W, k.shape[3])
        rv = torch.zeros_like(rk)
        for p in range(max(live_start, t - W), t):
            rk[:, :, p % W], rv[:, :, p % W] = k[:, :, p], v[:, :, p]
        out[kind] = (rk, rv)
    return out


def reference_masks(t: int, live_start: int, length: int):
    """head_step's masks over positions in order: window_mask plus the request's live start (Alg. 2 line 5)."""
    visible = torch.arange(length) >= live_start
    return {
        kind: torch.where(visible, window_mask(torch.tensor([[t]]), length, w), torch.tensor(MASK_VALUE))
        for kind, w in ((FULL, W), (SLIDING, min(W, SLIDING_WINDOW)))
    }


def test_rotary_rows_are_transformers_rows(models):
    _, head, _ = models
    tables = rotary_tables(head.config)
    for position in (0, 7, 1000):
        rows = rotary_rows(head.config, position)
        for kind in (SLIDING, FULL):
            ref = head.model.rotary_emb(torch.zeros(1), torch.tensor([[position]]), kind)
            assert torch.equal(rows[kind][0], ref[0]) and torch.equal(rows[kind][1], ref[1])
            cos, sin = tables[kind].rows(np.array([[position]]))  # the runtime's numpy rows, [1, 1, head_dim]
            np.testing.assert_allclose(cos, ref[0].numpy(), atol=2e-6)
            np.testing.assert_allclose(sin, ref[1].numpy(), atol=2e-6)
    cos, sin = rotary_rows(head.config, 1000)[FULL]
    assert cos.shape == (1, 1, 32) and rotary_rows(head.config, 1000)[SLIDING][0].shape == (1, 1, 16)
    # Full layers: 25% partial rotary -> 4 of 16 frequencies rotate; the other dims keep cos 1, sin 0.
    assert torch.all(cos[..., 4:16] == 1) and torch.all(sin[..., 4:16] == 0) and torch.all(sin[..., :4] != 0)


def test_ring_masks_by_hand():
    def visible(t, a, w=4, sw=2):
        m = ring_masks(t, a, w, sw)
        assert all(x.shape == (1, 1, 1, w) and x.dtype == np.float32 for x in m.values())
        assert all(set(np.unique(x)) <= {0.0, MASK_VALUE} for x in m.values())
        return [list(np.flatnonzero(m[kind][0, 0, 0] == 0)) for kind in (FULL, SLIDING)]

    # t=6, W=4: columns hold positions 4, 5, 2, 3; the sliding layer (window 2) sees 4 and 5 only.
    assert visible(6, 0) == [[0, 1, 2, 3], [0, 1]]
    # Partly filled: t=3 holds positions 0, 1, 2 in columns 0-2; column 3 was never written.
    assert visible(3, 0) == [[0, 1, 2], [1, 2]]
    # A request whose ring starts at position 1 (Alg. 2 line 3): column 0 (position 0) stays masked.
    assert visible(3, 1) == [[1, 2], [1, 2]]
    # Wrapped: t=9 -> positions 8, 5, 6, 7 in columns 0-3; sliding sees 7 and 8.
    assert visible(9, 0) == [[0, 1, 2, 3], [0, 3]]


@pytest.mark.parametrize(
    "t, live_start",
    [(5, 0), (12, 0), (25, 0), (22, 15)],
    ids=["partly-filled", "full", "wrapped", "new-request-live-start"],
)
def test_graph_equals_head_step_over_k_steps(models, states, t, live_start):
    verifier, head, keep = models
    e, h, kv = states
    graph = HeadGraph(restrict_output_layer(head, keep))
    e_q, e_scale = embedding_table(verifier, keep)
    rings = ring(kv, t, live_start)
    masks = {k: torch.from_numpy(m) for k, m in ring_masks(t, live_start, W, SLIDING_WINDOW).items()}
    rot = rotary_rows(head.config, t - 1)  # Alg. 2 line 6: the query's position is fixed at t - 1
    ref_masks = reference_masks(t, live_start, SEQ)
    pos = torch.tensor([[t - 1]])

    x = torch.cat([e[:, t : t + 1], h[:, t - 1 : t]], -1)  # Alg. 2 line 7: [e(x_{t+1}); h_t]
    x_ref = x.clone()
    for _ in range(K):
        logits, h_next = graph(x, *rings[SLIDING], *rings[FULL], masks[SLIDING], masks[FULL], *rot[SLIDING], *rot[FULL])
        assert logits.shape == (1, 1, len(keep)) and h_next.shape == (1, 1, 64)
        with torch.no_grad():
            same_ring, _ = head_step(head, x, rings, masks, pos)
            full, h_ref = head_step(head, x_ref, kv, ref_masks, pos)
        torch.testing.assert_close(logits, same_ring[..., keep], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits, full[..., keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(h_next, h_ref, rtol=1e-5, atol=1e-5)
        i = int(logits[0, 0].argmax())
        # Alg. 2 lines 10-11: the keep-set arg-max maps back to the vocabulary's best kept token.
        assert int(keep[i]) == int(keep[full[0, 0, keep].argmax()])
        e_i = (e_q[i].float() * e_scale[i])[None, None]  # Alg. 2 line 12: z = [E[i]; h]
        x, x_ref = torch.cat([e_i, h_next], -1), torch.cat([e_i, h_ref], -1)


def test_embedding_table_is_per_row_int8(models):
    verifier, _, keep = models
    q, scale = embedding_table(verifier, keep)
    assert q.dtype == torch.int8 and q.shape == (len(keep), 64) and scale.shape == (len(keep), 1)
    assert int(q.abs().amax(1).min()) == 127 and int(q.min()) >= -127
    e = verifier.model.embed_tokens(keep).detach()  # scaled by sqrt(H), as the hand-off's e
    assert torch.all((q.float() * scale - e).abs() <= scale / 2 + 1e-6)


def export_args(head) -> tuple:
    """Example inputs of a tiny head's `HeadGraph` in INPUT_NAMES' order, at position 5: random x_hat (1, 1, 2 *
    hidden 64) and ring K/V (2 sliding KV heads x 16, 1 full x 32, W columns), zero masks, the rotary rows."""
    rot = rotary_rows(head.config, 5)
    return (
        torch.randn(1, 1, 128),
        torch.randn(1, 2, W, 16),
        torch.randn(1, 2, W, 16),
        torch.randn(1, 1, W, 32),
        torch.randn(1, 1, W, 32),
        torch.zeros(1, 1, 1, W),
        torch.zeros(1, 1, 1, W),
        *rot[SLIDING],
        *rot[FULL],
    )


def test_graph_exports_statically_without_fused_attention(models):
    _, head, keep = models
    graph = HeadGraph(restrict_output_layer(head, keep))
    args = export_args(head)
    assert len(args) == len(INPUT_NAMES)
    exported = torch.export.export(graph, args)
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    assert not any("scaled_dot_product" in op or "nonzero" in op for op in ops), sorted(ops)
    assert any("softmax" in op for op in ops)
    got = exported.module()(*args)
    torch.testing.assert_close(got[0], graph(*args)[0], rtol=0, atol=0)


def test_graph_refuses_a_head_that_computes_its_own_kv(models):
    _, head, keep = models
    own = copy.deepcopy(head)
    own.config.text_config.num_kv_shared_layers = 0  # every layer would compute K/V from the head's own input
    with pytest.raises(ValueError, match=r"head layers \[0, 1\] compute their own KV"):
        HeadGraph(restrict_output_layer(own, keep))
