"""The verifier engine on tiny random Gemma 4 models (paper Alg. 4, Table 5 baselines).

References are computed independently of the engine: plain transformers forwards with transformers' own causal
and sliding-window masks, a fresh prefill of the committed sequence, transformers' MTP candidate generator.
Logit tolerance: float32 throughout; the tree forward and a causal forward of the same context agree to 1e-4
absolute on soft-capped logits of magnitude <= 30 (observed ~1e-6: only summation order differs).
"""

import copy
from collections import Counter

import hycoc.verifier.engine as engine_mod
import numpy as np
import pytest
import torch
from hycoc.passes.plan import VERIFIER_26B_A4B
from hycoc.verifier import (
    BadRequest,
    ContextOverflow,
    RootMismatch,
    SequenceError,
    SessionFinished,
    TreeError,
    VerifierEngine,
)
from hycoc.verifier.engine import verify_tree
from hycoc.verifier.kv_cache import first_position
from hycoc.verifier.sampling import sampling_probs
from scipy.stats import chisquare
from tiny_models import SLIDING_WINDOW, tiny_head, tiny_verifier
from transformers import DynamicCache, Gemma4ForCausalLM, Gemma4TextConfig, GenerationConfig
from transformers.generation.candidate_generator import SinglePositionMultiTokenCandidateGenerator

from hycoc.mtp import head_step, window_mask
from hycoc.protocol.messages import Sampling

torch.set_num_threads(1)
LOGIT_ATOL = 1e-4
KV_ATOL = 1e-5
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)


@pytest.fixture(scope="module")
def verifier():
    return tiny_verifier(sharpen=3.0)  # peaky p~: oracle trees get tokens accepted


@pytest.fixture(scope="module")
def head(verifier):
    return tiny_head(verifier)


def make_engine(model, **kw):
    args = dict(head_window=6, handoff_scales=SCALES, eos_token_ids=set())
    args.update(kw)
    return VerifierEngine(model, **args)


@torch.inference_mode()
def causal_logits(model, ids) -> torch.Tensor:
    """(len(ids), V) logits of a plain transformers forward (its own causal and sliding masks, no cache)."""
    return model(input_ids=torch.tensor([list(ids)])).logits[0].float()


@torch.inference_mode()
def fresh_cache(model, ids) -> DynamicCache:
    cache = DynamicCache()
    model(input_ids=torch.tensor([list(ids)]), cache=cache, use_cache=True)
    return cache


@torch.inference_mode()
def pre_norm_hidden(model, ids) -> torch.Tensor:
    """The last decoder layer's output (the final norm's input) at every position, by a hook of the test's own."""
    got = {}
    handle = model.model.layers[-1].register_forward_hook(lambda m, a, out: got.setdefault("h", out))
    try:
        out = model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True)
    finally:
        handle.remove()
    return got["h"][0], out.hidden_states[-1][0]


def oracle_tree(model, tokens, width=2, depth=3):
    """A tree from the verifier's own greedy predictions: the top-`width` children of the root, then of the first
    child, and so on down `depth` levels (a chain with siblings at every level)."""
    tokens = list(tokens)
    tree_tokens, parents = [tokens[-1]], [-1]
    parent = 0
    for _ in range(depth):
        top = causal_logits(model, tokens)[-1].topk(width).indices.tolist()
        first = len(tree_tokens)
        for tok in top:
            tree_tokens.append(tok)
            parents.append(parent)
        parent = first
        tokens.append(top[0])
    return tree_tokens, parents


def assert_cache_equals_fresh(model, session):
    """The session's cache holds the positions [start, t) of a fresh full-length prefill: start = 0 in full
    layers, sliding layers at least their retained window (`hycoc.verifier.kv_cache.SlidingWindowLayer`)."""
    ref = fresh_cache(model, session.tokens[:-1])
    t = session.t
    assert t == len(session.tokens) - 1
    for mine, theirs in zip(session.cache.layers, ref.layers):
        start = first_position(mine)
        assert start + mine.keys.shape[-2] == t and mine.keys.shape[-2] >= min(t, getattr(mine, "retain", t))
        torch.testing.assert_close(mine.keys, theirs.keys[..., start:, :], atol=KV_ATOL, rtol=0)
        torch.testing.assert_close(mine.values, theirs.values[..., start:, :], atol=KV_ATOL, rtol=0)


def next_round_logits(engine, session, tokens, parents):
    """Logits a round would compute for a tree, on a copy of the session's cache."""
    cache = copy.deepcopy(session.cache)
    logits, _, _ = verify_tree(
        engine.model, cache, engine.tap, torch.tensor(tokens), np.array(parents), session.t, engine.dtype
    )
    return logits


# ---------------------------------------------------------------------------------------- tree forward


@pytest.mark.parametrize("prompt_len", [12, 3])
def test_tree_forward_equals_each_path_run_causally(verifier, prompt_len):
    # Window 8. A chain of 10 tree rows with siblings: for deep rows the window boundary falls inside the tree rows
    # (row at depth 9 sees neither the root nor depth 1); for shallow rows it falls in the committed prefix.
    engine = make_engine(verifier)
    prompt = list(range(20, 20 + prompt_len))
    session = engine.open(prompt)
    _, t = session.prefill()
    parents = [-1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 0, 1, 3, 8, 9, 9]
    tokens = [prompt[-1]] + [int(x) for x in np.random.default_rng(1).integers(3, 300, len(parents) - 1)]
    logits = next_round_logits(engine, session, tokens, parents)
    assert logits.shape == (len(parents), verifier.config.vocab_size)
    for j in range(len(parents)):
        path, r = [], j
        while r >= 0:
            path.append(tokens[r])
            r = parents[r]
        ref = causal_logits(verifier, prompt[:-1] + path[::-1])[-1]
        torch.testing.assert_close(logits[j], ref, atol=LOGIT_ATOL, rtol=0)
    # Sanity: the sliding window matters here (the same row under a window of 100 differs).
    wide = tiny_verifier(sharpen=3.0, sliding_window=100)
    wide_ref = causal_logits(wide, prompt[:-1] + tokens[:10])[-1]
    assert (wide_ref - logits[9]).abs().max() > 1e-2


def test_eager_attention_gives_the_same_tree_logits(verifier):
    eager = tiny_verifier(sharpen=3.0, attn="eager")
    prompt, parents = list(range(30, 42)), [-1, 0, 0, 1, 2, 3]
    tokens = [prompt[-1], 5, 6, 7, 8, 9]
    out = []
    for model in (verifier, eager):
        engine = make_engine(model)
        session = engine.open(prompt)
        session.prefill()
        out.append(next_round_logits(engine, session, tokens, parents))
        engine.close()
    torch.testing.assert_close(out[0], out[1], atol=LOGIT_ATOL, rtol=0)


def test_chunked_prefill_equals_a_plain_forward(verifier):
    engine = make_engine(verifier, prefill_chunk=5)  # 11 positions: chunks of 5, 5, 1; the window is 8
    session = engine.open(list(range(60, 72)))
    assert session.prefill()[1] == 11
    assert_cache_equals_fresh(verifier, session)
    assert session.prefill()[1] == 11  # a second call changes nothing


# ---------------------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("acceptance", ["exact", "epsilon"])
def test_after_compaction_the_cache_and_next_logits_equal_a_fresh_prefill(verifier, acceptance):
    engine = make_engine(verifier)
    session = engine.open(list(range(40, 50)), seed=5, acceptance=acceptance, epsilon=0.02)
    session.prefill()
    for seq in range(4):
        tokens, parents = oracle_tree(verifier, session.tokens)
        reply = session.verify(tokens, parents, seq)
        assert session.output[-1] == reply.bonus
        assert_cache_equals_fresh(verifier, session)
    assert sum(session.accepted) > 0, "the oracle trees should get tokens accepted"
    tokens, parents = oracle_tree(verifier, session.tokens)
    logits = next_round_logits(engine, session, tokens, parents)
    torch.testing.assert_close(logits[0], causal_logits(verifier, session.tokens)[-1], atol=LOGIT_ATOL, rtol=0)


def test_many_rounds_past_the_sliding_window_stay_equal_to_a_fresh_prefill(verifier):
    engine = make_engine(verifier)
    session = engine.open([7, 8, 9], seed=11, acceptance="epsilon", epsilon=0.01, max_new_tokens=500)
    session.prefill()
    seq = 0
    while session.t < 4 * SLIDING_WINDOW:
        tokens, parents = oracle_tree(verifier, session.tokens, width=2, depth=4)
        session.verify(tokens, parents, seq)
        seq += 1
        if seq % 4 == 0:
            assert_cache_equals_fresh(verifier, session)
    assert_cache_equals_fresh(verifier, session)
    assert session.rounds == seq and len(session.tokens) == 3 + sum(session.accepted) + seq
    tokens, parents = oracle_tree(verifier, session.tokens)
    logits = next_round_logits(engine, session, tokens, parents)
    ref = causal_logits(verifier, session.tokens)
    torch.testing.assert_close(logits[0], ref[-1], atol=LOGIT_ATOL, rtol=0)


# ---------------------------------------------------------------------------------------- acceptance


def test_exact_acceptance_is_lossless(verifier):
    """The wiring of exact tree verification through the engine (sessions, seeds, tree rows, the bonus token): the
    first two committed tokens stay in p~'s support and follow direct sampling from p~ (chi-square) on 2 x 80
    sessions. The statistics themselves (the engine's sampling and acceptance at the power to see a 5-point bias)
    are `test_the_first_token_test_has_the_power_to_see_a_5_point_bias`; at this size the test still fails a
    wiring that commits the likeliest token every time (asserted at the end)."""
    sampling = Sampling(temperature=1.0, top_k=4, top_p=0.9)
    prompt = [50, 61, 72]
    p1 = sampling_probs(causal_logits(verifier, prompt)[-1:], sampling)[0]
    support1 = p1.nonzero().flatten().tolist()
    p2 = {x: sampling_probs(causal_logits(verifier, prompt + [x])[-1:], sampling)[0] for x in support1}
    expected = {(x, y): float(p1[x] * p2[x][y]) for x in support1 for y in p2[x].nonzero().flatten().tolist()}
    outside = [tok for tok in range(3, 300) if all(p2[x][tok] == 0 for x in support1) and p1[tok] == 0][:3]

    def tree_with_sample(root, seq):  # every first-level candidate, and two children under the likeliest
        if seq == 0:
            top = max(support1, key=lambda x: float(p1[x]))
            below = p2[top].topk(2).indices.tolist()
            tokens = [root] + support1 + below
            parents = [-1] + [0] * len(support1) + [1 + support1.index(top)] * 2
            return tokens, parents
        return [root] + outside[:2], [-1, 0, 0]

    def tree_without_sample(root, seq):  # only tokens p~ never samples
        return [root] + outside, [-1, 0, 0, 1]

    engine = make_engine(verifier)
    n = 80  # ~1 s per tree shape (400 took ~4 s each: the statistics' own test has the power, not this one)
    firsts = Counter()  # the first committed token of both tree shapes, pooled: its marginal must be p1
    for build in (tree_with_sample, tree_without_sample):
        counts = Counter()
        for seed in range(n):
            session = engine.open(prompt, sampling=sampling, seed=seed, acceptance="exact")
            session.prefill()
            seq = 0
            while len(session.output) < 2:
                session.verify(*build(session.root, seq), seq)
                seq += 1
            counts[tuple(session.output[:2])] += 1
            firsts[session.output[0]] += 1
        assert set(counts) <= set(expected), "committed a pair outside p~'s support"
        stat = pooled_chisquare(counts, expected, n)
        assert stat.pvalue > 1e-3, (build.__name__, stat, counts)
    # the first token's marginal over both shapes (2n draws, |support1| - 1 degrees of freedom): more power against
    # a bias of the first token than the pairs' test (`first_token_power` gives the power of each)
    obs = np.array([firsts[x] for x in support1], dtype=float)
    stat = chisquare(obs, np.array([float(p1[x]) for x in support1]) * 2 * n)
    assert sum(firsts.values()) == obs.sum() == 2 * n and stat.pvalue > 1e-3, (stat, firsts)
    # what this size can see: a wiring that commits the likeliest first token every time fails the same test
    greedy = np.array([2 * n if x == max(support1, key=lambda t: float(p1[t])) else 0 for x in support1], float)
    assert chisquare(greedy, np.array([float(p1[x]) for x in support1]) * 2 * n).pvalue < 1e-3


def pooled_chisquare(counts: Counter, expected: dict, n: int):
    """Chi-square of observed ``counts`` (outcome -> count, n draws) against ``expected`` probabilities (outcome ->
    p), cells with expected counts below 5 pooled into one (the chi-square approximation needs it)."""
    keys = sorted(expected)
    obs = np.array([counts[k] for k in keys], dtype=float)
    exp = np.array([expected[k] for k in keys]) * n
    small = exp < 5
    if small.any():
        obs = np.append(obs[~small], obs[small].sum())
        exp = np.append(exp[~small], exp[small].sum())
    return chisquare(obs, exp * obs.sum() / exp.sum())


def first_token_power(p, n: int, bias: float = 0.05, alpha: float = 1e-3) -> float:
    """Power of the chi-square goodness-of-fit test (df = len(p) - 1, level alpha) on n draws against the worst
    `bias`-point bias of one token's mass (the others rescaled to keep the sum): the noncentrality of moving token
    a by d is n d^2 / (p_a (1 - p_a)) (Cohen 1988, §7.2: n sum (q - p)^2 / p), smallest at the p_a nearest 1/2."""
    from scipy.stats import chi2, ncx2

    p = np.asarray(p, dtype=np.float64)
    lam = min(n * bias**2 / (pa * (1 - pa)) for pa in p if 0 < pa < 1)
    return float(ncx2.sf(chi2.isf(alpha, len(p) - 1), len(p) - 1, lam))


def test_the_first_token_test_has_the_power_to_see_a_5_point_bias(verifier):
    """Exact acceptance's first committed token ~ p1, on N = 6000 rounds of the engine's own sampling and
    acceptance (`hycoc.verifier.sampling.sample_rows` from a seeded generator, then `select_exact` and
    `select_path` at epsilon = 1, Alg. 4 lines 5-12) over the p~ rows of the tree `test_exact_acceptance_is_lossless`
    drafts. At N = 6000 the chi-square test detects a 5-point bias of any first token's mass with power ~1 (asserted
    >= 0.8 below); the end-to-end test's 2 x 80 pooled first tokens have less power (`first_token_power(p1, 160)`),
    its pairs' test less still: it checks the wiring, this one the statistics."""
    from hycoc.verifier.acceptance import select_exact, select_path
    from hycoc.verifier.sampling import sample_rows

    sampling = Sampling(temperature=1.0, top_k=4, top_p=0.9)
    prompt = [50, 61, 72]
    p1 = sampling_probs(causal_logits(verifier, prompt)[-1:], sampling)[0]
    support1 = p1.nonzero().flatten().tolist()
    top = max(support1, key=lambda x: float(p1[x]))
    p_top = sampling_probs(causal_logits(verifier, prompt + [top])[-1:], sampling)[0]
    below = p_top.topk(2).indices.tolist()
    tokens = np.array([prompt[-1]] + support1 + below)
    parents = np.array([-1] + [0] * len(support1) + [1 + support1.index(top)] * 2)
    contexts = [prompt] + [prompt + [x] for x in support1] + [prompt + [top, y] for y in below]
    probs = torch.cat([sampling_probs(causal_logits(verifier, c)[-1:], sampling) for c in contexts])  # (R, V)
    p = [float(p1[x]) for x in support1]
    big_n = 6000
    assert first_token_power(p, big_n) >= 0.8 and first_token_power(p, 2 * 80) < 0.8  # what each test can see
    gen = torch.Generator().manual_seed(0)
    exact, path_eps1 = Counter(), Counter()
    for _ in range(big_n):
        samples = sample_rows(probs, gen).numpy()
        v, path, _ = select_exact(tokens, parents, samples)
        exact[int(tokens[path[0]]) if len(path) else int(samples[v])] += 1
        v1, path1, rewritten = select_path(tokens, parents, samples, probs, 1.0)
        path_eps1[int(tokens[path1[0]]) if len(path1) else int(rewritten[v1])] += 1
    assert path_eps1 == exact and set(exact) <= set(support1)
    stat = chisquare([exact[x] for x in support1], np.array(p) * big_n)
    assert stat.pvalue > 1e-3, (stat, exact)
    # and a sampler 5 points off on the hardest token (mass nearest 1/2) fails the same test at this N
    a = int(np.argmin([abs(x - 0.5) for x in p]))
    q = np.array(p) * (1 - 0.05 / (1 - p[a]))  # the others give up 5 points in proportion
    q[a] = p[a] + 0.05
    assert q.sum() == pytest.approx(1.0)
    biased = np.random.default_rng(0).multinomial(big_n, q)
    assert chisquare(biased, np.array(p) * big_n).pvalue < 1e-3


def test_epsilon_one_commits_exactly_what_exact_commits(verifier):
    engine = make_engine(verifier)
    runs = {}
    for acceptance, eps in (("exact", 1.0), ("epsilon", 1.0)):
        session = engine.open(list(range(60, 70)), seed=123, acceptance=acceptance, epsilon=eps)
        session.prefill()
        replies = []
        for seq in range(5):
            reply = session.verify(*oracle_tree(verifier, session.tokens), seq)
            replies.append((reply.samples.tolist(), reply.path_rows.tolist(), reply.bonus))
        runs[acceptance] = (session.tokens, replies)
    assert runs["exact"] == runs["epsilon"]
    # And a small epsilon accepts at least as much on the same first tree and seed.
    session = engine.open(list(range(60, 70)), seed=123, acceptance="epsilon", epsilon=0.01)
    session.prefill()
    reply = session.verify(*oracle_tree(verifier, session.tokens), 0)
    assert len(reply.path_rows) >= len(runs["exact"][1][0][1])


def test_reply_samples_walk_to_the_committed_path(verifier):
    """Alg. 1 line 8 on the reply: from the root, step to the child equal to the sample; it ends at v*."""
    from hycoc.verifier.acceptance import descend

    engine = make_engine(verifier)
    session = engine.open(list(range(60, 70)), seed=9, acceptance="epsilon", epsilon=0.005)
    session.prefill()
    for seq in range(4):
        tokens, parents = oracle_tree(verifier, session.tokens, width=3)
        before = len(session.tokens)
        reply = session.verify(tokens, parents, seq)
        end = descend(tokens, parents, reply.samples)
        walked = []
        while end > 0:
            walked.append(end)
            end = parents[end]
        assert walked[::-1] == reply.path_rows.tolist()
        assert session.tokens[before:] == [tokens[r] for r in reply.path_rows] + [reply.bonus]


# ---------------------------------------------------------------------------------------- hand-off


def test_handoff_positions_sizes_and_values(verifier):
    engine = make_engine(verifier, head_window=6, hidden="pre_norm")
    prompt = list(range(80, 92))
    session = engine.open(prompt, seed=3, acceptance="epsilon", epsilon=0.01)
    _, t = session.prefill()
    assert t == 11
    for seq in range(3):
        t = session.t
        reply = session.verify(*oracle_tree(verifier, session.tokens), seq)
        h = reply.handoff
        t_prime = t + 1 + len(reply.path_rows)
        assert h.t_prime == t_prime == session.t and h.bonus == reply.bonus
        assert h.a == (max(0, t_prime - 6) if seq == 0 else max(t, t_prime - 6))
        n = t_prime - h.a
        assert h.n_positions == n and (seq == 0 or n == 1 + len(reply.path_rows))
        assert h.x_hat.shape == (2 * 64,) and h.x_hat.dtype == np.int8
        assert h.k_sliding.shape == h.v_sliding.shape == (n, engine.kv_dim_sliding) == (n, 2 * 16)
        assert h.k_full.shape == h.v_full.shape == (n, engine.kv_dim_full) == (n, 1 * 32)
        assert h.scales == SCALES
        # Values against a fresh prefill: last sliding layer = 2, last full layer = 3 (layer_types of the fixture).
        committed = session.tokens[:-1]
        ref = fresh_cache(verifier, committed)
        for layer, k_q, v_q, ks, vs in (
            (2, h.k_sliding, h.v_sliding, SCALES[2], SCALES[3]),
            (3, h.k_full, h.v_full, SCALES[4], SCALES[5]),
        ):
            k = ref.layers[layer].keys[0, :, h.a : t_prime].transpose(0, 1).reshape(n, -1)
            v = ref.layers[layer].values[0, :, h.a : t_prime].transpose(0, 1).reshape(n, -1)
            assert_int8(k_q, k, ks)
            assert_int8(v_q, v, vs)
        pre, post = pre_norm_hidden(verifier, committed)
        e = verifier.model.embed_tokens(torch.tensor([reply.bonus]))[0].detach()
        assert_int8(h.x_hat[:64], e, SCALES[0])
        assert_int8(h.x_hat[64:], pre[-1], SCALES[1])
        # transformers' hidden_states[-1] is the post-norm tensor, not h (see the engine's docstring).
        assert (pre[-1] - post[-1]).abs().max() > 0.1


def test_handoff_window_smaller_than_the_accepted_path(verifier):
    engine = make_engine(verifier, head_window=2)
    session = engine.open(list(range(80, 92)), sampling=Sampling(temperature=0.0), acceptance="exact")
    session.prefill()
    for seq in range(2):
        t = session.t
        reply = session.verify(*oracle_tree(verifier, session.tokens, depth=3), seq)
        assert len(reply.path_rows) == 3  # greedy p~ accepts the whole greedy chain
        assert reply.handoff.a == reply.handoff.t_prime - 2 and reply.handoff.t_prime == t + 4
        assert reply.handoff.k_full.shape == (2, 32)


def test_post_norm_handoff_carries_the_normed_state(verifier):
    engine = make_engine(verifier, hidden="post_norm")
    session = engine.open(list(range(80, 92)), seed=3)
    session.prefill()
    reply = session.verify(*oracle_tree(verifier, session.tokens), 0)
    _, post = pre_norm_hidden(verifier, session.tokens[:-1])
    assert_int8(reply.handoff.x_hat[64:], post[-1], SCALES[1])


def assert_int8(q, ref, scale):
    """q is ref quantized with round-to-nearest and clamp to [-127, 127] (ref from an independent forward:
    allow one step where ref sits within 1e-4 of a rounding boundary)."""
    x = ref.detach().float().reshape(-1).numpy() / scale
    q = q.astype(np.float64).reshape(-1)
    want = np.clip(np.round(x), -127, 127)
    near_tie = np.abs(np.abs(x - np.floor(x)) - 0.5) < 1e-3
    ok = (q == want) | (near_tie & (np.abs(q - want) <= 1))
    assert ok.all(), (q[~ok], x[~ok])
    assert np.abs(x).max() < 127, "pick a scale that does not clamp this test's values"


def test_gemma4_26b_a4b_handoff_sizes_match_design():
    """docs/design.md "Reference shapes": [e; h] = 2 x 2816 = 5,632 values per round; KV 8*256*2 + 2*512*2 = 6,144
    values per position. The published config (`hycoc.passes.plan.VERIFIER_26B_A4B`, the plan's reference shapes) is
    built on the meta device (no weights) to read the engine's layer choice and sizes."""
    config = Gemma4TextConfig.from_dict(VERIFIER_26B_A4B)
    with torch.device("meta"):
        model = Gemma4ForCausalLM(config)
    engine = VerifierEngine(model, head_window=1024, handoff_scales=(1.0,) * 6, device="meta")
    assert engine.layers == {"sliding_attention": 28, "full_attention": 29}
    assert 2 * engine.hidden_size == 5632
    assert (engine.kv_dim_sliding, engine.kv_dim_full) == (8 * 256, 2 * 512)
    assert 2 * (engine.kv_dim_sliding + engine.kv_dim_full) == 6144
    engine.close()


# ---------------------------------------------------------------------------------------- server-side baselines


def test_cloud_mtp_chain_equals_transformers_generator_and_reads_only_committed_rows(verifier, head, monkeypatch):
    engine = make_engine(verifier, head=head, hidden="post_norm", head_query_position_offset=0)
    chains, head_calls = [], []
    real_draft = engine_mod.draft_cloud_chain

    def spy_draft(*args, **kw):
        chain = real_draft(*args, **kw)
        chains.append((args[2].t, chain))  # (t, chain)
        return chain

    real_forward = head.forward

    def spy_forward(*args, **kw):
        head_calls.append({k: (v[0].clone(), v[1].clone()) for k, v in kw["shared_kv_states"].items()})
        return real_forward(*args, **kw)

    monkeypatch.setattr(engine_mod, "draft_cloud_chain", spy_draft)
    monkeypatch.setattr(head, "forward", spy_forward)
    session = engine.open([90, 91, 92, 93, 94], seed=2, draft_place="cloud-mtp", max_new_tokens=200)
    session.prefill()
    history = []
    for seq in range(8):
        history.append(list(session.tokens))
        reply = session.verify([session.root], [-1], seq)
        assert reply.handoff is None and len(reply.samples) == 1 + 4
        committed = reply.samples[: len(reply.path_rows) + 1].tolist()
        assert session.tokens[-len(committed) :] == committed
    assert session.t > SLIDING_WINDOW + 2, "the head's sliding window must bind in later rounds"
    assert any(n < 4 for n in session.accepted), "need partial rejections"

    head.generation_config.num_assistant_tokens = 4
    generator = SinglePositionMultiTokenCandidateGenerator(
        head, verifier.get_input_embeddings(), GenerationConfig(max_length=10_000)
    )
    for (t, chain), tokens in zip(chains, history):
        assert t == len(tokens) - 1
        with torch.inference_mode():
            out = verifier(
                input_ids=torch.tensor([tokens[:-1]]), output_hidden_states=True, return_shared_kv_states=True
            )
        generator.is_main_model_prefill = True
        candidates, _ = generator.get_candidates(torch.tensor([tokens]), {}, out, False, 0)
        assert chain == candidates[0, len(tokens) :].tolist()
    # Every head call read exactly committed positions: the KV of a fresh prefill, never a tree row -- [0, t) of
    # the full layer, the sliding layer's retained window [t - retain, t) (what the head's sliding mask reads).
    calls = iter(head_calls)
    assert engine.kv_retain == SLIDING_WINDOW + 1 < session.t  # the head's window + 1 (kv_cache.retained_positions)
    for (t, chain), tokens in zip(chains, history):
        ref = fresh_cache(verifier, tokens[:-1])
        for _ in chain:
            shared = next(calls)
            for kind, layer in (("sliding_attention", 2), ("full_attention", 3)):
                lo = max(0, t - engine.kv_retain) if kind == "sliding_attention" else 0
                assert shared[kind][0].shape[2] == t - lo
                torch.testing.assert_close(shared[kind][0], ref.layers[layer].keys[..., lo:, :], atol=KV_ATOL, rtol=0)
                torch.testing.assert_close(shared[kind][1], ref.layers[layer].values[..., lo:, :], atol=KV_ATOL, rtol=0)


def test_server_head_chain_uses_the_keep_set_and_window(verifier, head):
    keep = torch.tensor(sorted(np.random.default_rng(4).choice(np.arange(3, 300), 120, replace=False).tolist()))
    # W = 10 > the head's sliding window: the sliding layer must read only its own window of the W columns
    sw = head.config.get_text_config().sliding_window
    assert sw < 10
    engine = make_engine(verifier, head=head, keep_set=keep, head_window=10, head_query_position_offset=-1)
    session = engine.open(list(range(100, 114)), seed=8, draft_place="server-head")
    session.prefill()
    for seq in range(3):
        reply = session.verify(*oracle_tree(verifier, session.tokens), seq)
        assert reply.handoff is None and reply.chain.dtype == np.int32 and len(reply.chain) == 4
        assert set(reply.chain.tolist()) <= set(keep.tolist())
        # Independent reference: the head over the full committed KV with a W-window mask (hycoc.mtp.window_mask),
        # query position t' - 1, logits outside the keep set masked out.
        t_prime, committed = session.t, session.tokens[:-1]
        ref = fresh_cache(verifier, committed)
        pre, _ = pre_norm_hidden(verifier, committed)
        shared = {
            "sliding_attention": (ref.layers[2].keys, ref.layers[2].values),
            "full_attention": (ref.layers[3].keys, ref.layers[3].values),
        }
        masks = {
            "sliding_attention": window_mask(torch.tensor([[t_prime]]), t_prime, sw),
            "full_attention": window_mask(torch.tensor([[t_prime]]), t_prime, 10),
        }
        allowed = torch.full((verifier.config.vocab_size,), float("-inf"))
        allowed[keep] = 0.0
        x = torch.cat([verifier.model.embed_tokens(torch.tensor([session.root]))[0], pre[-1]])
        want = []
        with torch.inference_mode():
            for _ in range(4):
                logits, h_next = head_step(head, x[None, None], shared, masks, torch.tensor([[t_prime - 1]]))
                y = int((logits[0, 0] + allowed).argmax())
                want.append(y)
                x = torch.cat([verifier.model.embed_tokens(torch.tensor([y]))[0], h_next[0, 0]])
        assert reply.chain.tolist() == want


# ---------------------------------------------------------------------------------------- end of request, errors


def test_eos_in_the_path_finishes_and_truncates(verifier):
    prompt = list(range(110, 120))
    greedy = oracle_tree(verifier, prompt, width=1, depth=3)[0][1:]  # the greedy chain the tree will carry
    engine = make_engine(verifier, eos_token_ids={greedy[1]})
    session = engine.open(prompt, sampling=Sampling(temperature=0.0), acceptance="exact")
    session.prefill()
    reply = session.verify(*oracle_tree(verifier, prompt, width=2, depth=3), 0)
    assert reply.finished and reply.handoff is None
    assert session.output == greedy[:2] and session.finished
    with pytest.raises(SessionFinished):
        session.verify([session.root], [-1], 1)


def test_max_new_tokens_finishes(verifier):
    prompt = list(range(110, 120))
    engine = make_engine(verifier)
    session = engine.open(prompt, sampling=Sampling(temperature=0.0), acceptance="exact", max_new_tokens=2)
    session.prefill()
    reply = session.verify(*oracle_tree(verifier, prompt, width=1, depth=3), 0)
    assert reply.finished and len(session.output) == 2 and len(reply.path_rows) == 3


def test_one_token_prompt_starts_at_position_zero(verifier, head):
    engine = make_engine(verifier, head=head)
    session = engine.open([42])
    assert session.prefill()[1] == 0
    reply = session.verify([42, 5, 6], [-1, 0, 0], 0)
    assert reply.handoff.a == 0 and reply.handoff.t_prime == 1 + len(reply.path_rows)
    cloud = engine.open([42], draft_place="cloud-mtp")
    cloud.prefill()
    first = cloud.verify([42], [-1], 0)  # no h_{-1}: the first round verifies the root alone
    assert len(first.samples) == 1 and cloud.t == 1
    second = cloud.verify([cloud.root], [-1], 1)
    assert len(second.samples) == 5


def test_errors_leave_the_session_unchanged(verifier):
    engine = make_engine(verifier, max_context=16)
    prompt = list(range(120, 132))
    session = engine.open(prompt, seed=1)
    with pytest.raises(engine_mod.NotPrefilled):
        session.verify([prompt[-1]], [-1], 0)
    session.prefill()
    root = prompt[-1]
    bad = [
        (([root, 1], [-1, 1], 0), TreeError),
        (([root, 300], [-1, 0], 0), TreeError),
        (([root + 1, 1], [-1, 0], 0), RootMismatch),
        (([root, 1], [-1, 0], 1), SequenceError),
    ]
    gen_state = session.generator.get_state()
    for (tokens, parents, seq), error in bad:
        with pytest.raises(error) as info:
            session.verify(tokens, parents, seq)
        assert info.value.code and str(info.value)
        assert session.t == 11 and all(
            first_position(layer) + layer.keys.shape[2] == 11 for layer in session.cache.layers
        )
        assert torch.equal(session.generator.get_state(), gen_state)
    reply = session.verify([root, 1, 2], [-1, 0, 1], 0)
    assert reply.server_ms > 0 and session.prefill_ms > 0
    assert session.verify([root, 1, 2], [-1, 0, 1], 0) is reply  # idempotent retry
    with pytest.raises(SequenceError):
        session.verify([root, 1, 3], [-1, 0, 1], 0)  # same seq, different tree
    for n in (17, 16):  # 16 = max_context: no room left for one output token
        with pytest.raises(ContextOverflow):
            engine.open(list(range(n)))
    for kwargs in ({"acceptance": "lossy"}, {"draft_place": "cloud-mtp"}, {"epsilon": 0.0}, {"max_new_tokens": 0}):
        with pytest.raises(BadRequest):
            engine.open(prompt, **kwargs)
    with pytest.raises(BadRequest):
        engine.open([])
