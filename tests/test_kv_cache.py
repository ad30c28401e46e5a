"""The verifier's windowed KV (`hycoc.verifier.kv_cache`): what a session holds, byte for byte, against the formula
the server reserves with; outputs equal to the full-length cache's; batched rounds in bfloat16.

Tiny random Gemma 4 models (tests/tiny_models.py): sliding window 8, two sliding and two full layers of 512 B per
position each in float32; the MTP head's window 8, so sliding layers keep 9 positions (`retained_positions`).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from hycoc.verifier import VerifierEngine
from hycoc.verifier.batch import batch_forward, verify_batch
from hycoc.verifier.engine import verify_tree
from hycoc.verifier.kv_cache import SlidingWindowLayer, first_position, held_bytes, storage_bytes
from tiny_models import oracle_tree, tiny_head, tiny_verifier  # oracle_tree: the verifier's own top-k chain tree
from transformers import DynamicCache

from hycoc.protocol.messages import Sampling

torch.set_num_threads(1)
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
KEEP = np.arange(3, 250)


@pytest.fixture(scope="module")
def models():
    model = tiny_verifier(sharpen=3.0)
    return model, tiny_head(model)


def make_engine(models, **kw) -> VerifierEngine:
    args = dict(
        head=models[1],
        keep_set=KEEP,
        head_window=6,
        handoff_scales=SCALES,
        eos_token_ids=set(),
        max_context=200,
        prefill_chunk=5,
    )
    args.update(kw)
    return VerifierEngine(models[0], **args)


def test_held_bytes_are_the_formula_after_prefill_and_after_every_round(models):
    """A 40-token prompt prefilled in chunks of 5, then 8 rounds of 7-row trees: after the prefill the cache holds
    exactly session_bytes(t, 0) (full layers t positions, sliding layers the 9 retained); after a round full layers
    hold t' and sliding layers min(t, 9) + 1 + |P|, and the memory kept alive never passes the round's peak
    session_kv_bytes(t + R, R), nor the server's reservation for the request."""
    engine = make_engine(models)
    layout = engine.kv_layout
    assert (layout.full_bytes, layout.sliding_bytes, layout.retain) == (512, 512, 9)
    prompt, max_new, rows = list(range(20, 60)), 60, 7
    reserved = engine.session_kv_bytes(min(engine.max_context, len(prompt) + max_new + rows), rows)
    assert reserved == 512 * 107 + 512 * (9 + rows)  # full layers the context, sliding ones the window + a round
    # reserved apart: a prefilling session's window + a chunk of 5 (the prefill pool), a snapshot's window
    assert (engine.prefill_transient_bytes(), engine.snapshot_bytes(30), engine.snapshot_bytes(4)) == (
        512 * (9 + 5),
        512 * 9,
        512 * 4,
    )
    session = engine.open(prompt, Sampling(0.0, 64, 0.95), max_new_tokens=max_new, acceptance="exact")
    _, t = session.prefill()
    assert t == 39 and held_bytes(session.cache) == layout.session_bytes(39, 0) == 512 * 39 + 512 * 9
    assert storage_bytes(session.cache) == held_bytes(session.cache)  # the prefill's trim frees the rest
    accepted = 0
    for seq in range(8):
        tokens, parents = oracle_tree(models[0], session.tokens)
        assert len(tokens) == rows
        t = session.t
        reply = session.verify(tokens, parents, seq)
        path = len(reply.path_rows)
        accepted += path
        sliding = min(t, layout.retain) + 1 + path
        assert held_bytes(session.cache) == 512 * session.t + 512 * sliding
        for layer in session.cache.layers:
            held = layer.keys.shape[-2]
            assert first_position(layer) + held == session.t
            assert held == (sliding if isinstance(layer, SlidingWindowLayer) else session.t)
        assert storage_bytes(session.cache) <= engine.session_kv_bytes(t + rows, rows) <= reserved
    assert accepted >= 8  # paths were accepted: compaction ran past the window


def _outputs(engine, draft_place, tree_model):
    """A 22-token prompt, rounds until its 10-token turn finishes, then an appended 6-token turn (KV kept: the cache
    is cropped to the committed positions and prefilled on) and 4 more rounds. Returns (committed, replies)."""
    session = engine.open(
        list(range(30, 52)), Sampling(0.0, 64, 0.95), max_new_tokens=10, acceptance="exact", draft_place=draft_place
    )
    session.prefill()
    replies = []

    def rounds(n):
        for seq in range(n):
            if session.finished:
                return
            tree = (
                (np.array([session.root]), np.array([-1]))
                if draft_place == "cloud-mtp"
                else oracle_tree(tree_model, session.tokens)
            )
            replies.append(session.verify(*tree, seq))

    rounds(20)
    assert session.finished
    session.append(list(range(60, 66)), max_new_tokens=20, keep=len(session.tokens))  # the whole conversation kept
    rounds(4)
    return session.tokens, replies


@pytest.mark.parametrize("draft_place", ["device", "cloud-mtp", "server-head"])
def test_outputs_equal_the_full_length_caches(models, draft_place, monkeypatch):
    """At T = 0 every committed token, chain and hand-off equals the engine's with a full-length ``DynamicCache()``
    (every layer keeping every position, the cache before sliding windows), past the window of 8 and across an
    appended turn."""
    got = _outputs(make_engine(models), draft_place, models[0])
    full = make_engine(models)
    monkeypatch.setattr(full, "new_cache", DynamicCache)
    want = _outputs(full, draft_place, models[0])
    assert got[0] == want[0] and len(got[0]) >= 22 + 10 + 6 + 4  # one token a round at least
    for g, w in zip(got[1], want[1]):
        assert (g.bonus, g.samples.tolist(), g.path_rows.tolist(), g.chain.tolist()) == (
            w.bonus,
            w.samples.tolist(),
            w.path_rows.tolist(),
            w.chain.tolist(),
        )
        if w.handoff is not None:
            assert (g.handoff.t_prime, g.handoff.a) == (w.handoff.t_prime, w.handoff.a)
            for name in ("x_hat", "k_sliding", "v_sliding", "k_full", "v_full"):
                a, b = getattr(g.handoff, name).astype(int), getattr(w.handoff, name).astype(int)
                assert a.shape == b.shape and np.abs(a - b).max(initial=0) <= 1, name


def test_bfloat16_batched_rounds_commit_the_alone_runs_tokens():
    """bfloat16 on the CPU: 6 sessions of 2-60 positions batched in one ragged forward give each session's
    alone-run logits exactly (measured max |diff| 0 over 20 batches; float32: ~4e-5, BLAS blocking), and a T = 0
    run of 6 rounds commits the same tokens batched as alone."""
    model = tiny_verifier(sharpen=3.0).to(torch.bfloat16)
    engine = VerifierEngine(model, head_window=6, handoff_scales=SCALES, max_context=256)
    rng = np.random.default_rng(0)
    sessions = []
    for _ in range(6):
        s = engine.open(list(rng.integers(3, 300, int(rng.integers(2, 60)))), Sampling(0.0, 64, 0.95))
        s.prefill()
        sessions.append(s)
    trees = []
    for s in sessions:
        r = int(rng.integers(1, 10))
        trees.append(
            (
                np.array([s.root] + list(rng.integers(3, 300, r - 1))),
                np.array([-1] + [int(rng.integers(0, j)) for j in range(1, r)]),
            )
        )
    alone = [
        verify_tree(model, copy.deepcopy(s.cache), engine.tap, torch.as_tensor(tk), pa, s.t, engine.dtype)[0]
        for s, (tk, pa) in zip(sessions, trees)
    ]
    batched = batch_forward(
        engine,
        [copy.deepcopy(s.cache) for s in sessions],
        [s.t for s in sessions],
        [t[0] for t in trees],
        [t[1] for t in trees],
    )
    for a, (b, _, _) in zip(alone, batched):
        assert torch.equal(a, b)

    ref = VerifierEngine(model, head_window=6, handoff_scales=SCALES, max_context=256)
    prompts = [list(range(10 + 9 * i, 14 + 11 * i)) for i in range(4)]
    pairs = []
    for p in prompts:
        a, b = (e.open(p, Sampling(0.0, 64, 0.95), max_new_tokens=60, acceptance="exact") for e in (engine, ref))
        a.prefill()
        b.prefill()
        pairs.append((a, b))
    for seq in range(6):
        batch = [(a, *oracle_tree(model, a.tokens), seq) for a, _ in pairs]
        for (_a, b), (_, tk, pa, _), reply in zip(pairs, batch, verify_batch(engine, batch)):
            assert reply.path_rows.tolist() == b.verify(tk, pa, seq).path_rows.tolist()
    assert all(a.output == b.output and len(a.output) >= 6 for a, b in pairs)


def test_the_toy_verifiers_held_bytes_against_its_reservation():
    """The toy recipe's verifier (3 sliding layers of 2 x 64, window 128; 1 full layer of 1 x 128; float32) and its
    head (window 128): sliding layers keep W = 256 positions. A 400-token prompt, then 3 rounds of 33-row trees:
    held bytes are the formula after the prefill and after each round, and never above the server's reservation
    for the request (prompt + 256 output tokens + 33 rows)."""
    from pathlib import Path

    from hycoc.verifier.loading import engine_from_recipe

    from hycoc.recipe import load_recipe

    engine = engine_from_recipe(load_recipe(Path(__file__).parents[1] / "recipes" / "toy.toml"), "cpu")
    layout = engine.kv_layout
    assert (layout.full_bytes, layout.sliding_bytes, layout.retain) == (1024, 3 * 1024, 256)
    rows, prompt = 33, np.random.default_rng(3).integers(10, 4000, 400)
    reserved = engine.session_kv_bytes(len(prompt) + 256 + rows, rows)
    # sliding: the window + a tree; a prefilling session's window + a 512-position chunk and a conversation's
    # 256-position snapshot are reserved apart (the prefill pool, spare room)
    assert reserved == 1024 * 689 + 3 * 1024 * (256 + 33)
    assert (engine.prefill_transient_bytes(), engine.snapshot_bytes(300)) == (3 * 1024 * (256 + 512), 3 * 1024 * 256)
    session = engine.open(prompt, Sampling(0.0, 64, 0.95), max_new_tokens=256, acceptance="exact")
    session.prefill()
    assert held_bytes(session.cache) == storage_bytes(session.cache) == 1024 * 399 + 3 * 1024 * 256
    rng = np.random.default_rng(4)
    for seq in range(3):
        t = session.t
        parents = np.array([-1] + [int(rng.integers(0, j)) for j in range(1, rows)])
        reply = session.verify(np.concatenate([[session.root], rng.integers(10, 4000, rows - 1)]), parents, seq)
        assert held_bytes(session.cache) == 1024 * session.t + 3 * 1024 * (256 + 1 + len(reply.path_rows))
        assert session.t == t + 1 + len(reply.path_rows)
        assert storage_bytes(session.cache) <= engine.session_kv_bytes(t + rows, rows) <= reserved
    engine.close()
