"""Cross-session batched verification (docs/serving.md "Many devices: batched verification"): a session's output must
not depend on who else is in its batch.

References are each session run alone with `Session.verify` (the single-session path) on a second engine over the
same weights. Batched runs go through `hycoc.verifier.batch.verify_batch` with sessions of every mode (hyco: epsilon
acceptance, hyco-exact / specedge: exact acceptance on device trees, cloud-mtp, server-head), mixed prompt lengths
(one-token prompts at t = 0, prompts past the sliding window), joining and leaving mid-run, in shuffled batch order.
At T = 0 every committed token must be equal; at T > 0 every sample (seeded per session) must be equal. The int8
hand-off may differ in the last bit where a batched KV value (float32 sums in another order, ~1e-6) lies on a
rounding boundary; its positions and every other field must be equal.
"""

from __future__ import annotations

import asyncio
import copy
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import VerifierClient
from hycoc.verifier import SequenceError, VerifierEngine
from hycoc.verifier.batch import BatchStats, batch_forward, verify_batch
from hycoc.verifier.engine import verify_tree
from hycoc.verifier.server import ServerThread
from tiny_models import VOCAB, oracle_tree, tiny_head, tiny_verifier

from hycoc.protocol.messages import DraftTree, OpenRequest, Sampling

torch.set_num_threads(1)
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
LOGIT_ATOL = 1e-4  # float32 soft-capped logits (|x| <= 30); measured max |diff| ~1e-5
KV_ATOL = 1e-5
KEEP = np.arange(3, 250)


@pytest.fixture(scope="module")
def models():
    model = tiny_verifier(sharpen=3.0)  # peaky p~: oracle trees get tokens accepted
    return model, tiny_head(model)


def make_engine(models, **kw) -> VerifierEngine:
    args = dict(
        head=models[1], keep_set=KEEP, head_window=6, handoff_scales=SCALES, eos_token_ids=set(), max_context=128
    )
    args.update(kw)
    return VerifierEngine(models[0], **args)


def random_tree(tokens, rows=9):
    """A deterministic tree of `rows` rows whose tokens and shape depend only on the committed tokens."""
    rng = np.random.default_rng(sum((i + 1) * t for i, t in enumerate(tokens)) % (2**32))
    parents = np.array([-1] + [int(rng.integers(0, j)) for j in range(1, rows)])
    return np.concatenate([[tokens[-1]], rng.integers(3, VOCAB, rows - 1)]), parents


#: (mode, open kwargs, tree maker): the configurations of hycoc.bench.paper.runner, as the verifier sees them.
MODES = {
    "hyco": (dict(acceptance="epsilon", epsilon=0.02), "oracle"),
    "hyco-exact": (dict(acceptance="exact"), "oracle"),
    "specedge": (dict(acceptance="exact"), "random"),
    "cloud-mtp": (dict(draft_place="cloud-mtp", acceptance="exact"), "root"),
    "server-head": (dict(draft_place="server-head", acceptance="exact"), "oracle"),
}
#: (mode, prompt length, first step it joins, rounds): one-token prompt (t = 0), prompts past the window (8).
PLAN = [
    ("hyco", 1, 0, 5),
    ("hyco-exact", 17, 0, 3),
    ("specedge", 5, 1, 5),
    ("cloud-mtp", 11, 0, 4),
    ("server-head", 23, 2, 3),
    ("hyco", 9, 3, 3),
]


def open_session(engine, i, mode, prompt_len, temperature):
    kwargs, _ = MODES[mode]
    sampling = Sampling(temperature, 64, 0.95)
    session = engine.open(
        list(range(20 + 7 * i, 20 + 7 * i + prompt_len)), sampling, seed=100 + i, max_new_tokens=60, **kwargs
    )
    session.prefill()
    return session


_TREES: dict = {}


def tree_for(model, mode, tokens):
    """The tree a session of `mode` sends after `tokens` (memoized: the alone-run and the batched run of a session
    commit the same tokens, so they send the same trees)."""
    kind = MODES[mode][1]
    if kind == "root":
        return np.array([tokens[-1]]), np.array([-1])
    key = (kind, tuple(tokens))
    if key not in _TREES:
        _TREES[key] = oracle_tree(model, tokens, depth=2) if kind == "oracle" else random_tree(tokens)
    return _TREES[key]


def assert_replies_match(got, want):
    assert (got.seq, got.bonus, got.finished, got.finish_reason) == (
        want.seq,
        want.bonus,
        want.finished,
        want.finish_reason,
    )
    np.testing.assert_array_equal(got.samples, want.samples)
    np.testing.assert_array_equal(got.path_rows, want.path_rows)
    np.testing.assert_array_equal(got.chain, want.chain)
    assert (got.handoff is None) == (want.handoff is None)
    if want.handoff is not None:
        g, w = got.handoff, want.handoff
        assert (g.t_prime, g.a, g.bonus) == (w.t_prime, w.a, w.bonus)
        for name in ("x_hat", "k_sliding", "v_sliding", "k_full", "v_full"):
            a, b = getattr(g, name).astype(int), getattr(w, name).astype(int)
            assert a.shape == b.shape and np.abs(a - b).max(initial=0) <= 1, name


# ------------------------------------------------------------------------------------------ the batched forward


def test_a_ragged_batch_gives_each_session_the_logits_and_kv_it_gets_alone(models):
    """Sessions at t = 0, 4, 16 (past the window of 8) with 7, 1 and 4 rows in one forward (their rows end to end,
    attention per session): each session's rows (logits, pre- and post-norm h) and appended KV equal its own
    single-session forward to float32 rounding."""
    engine = make_engine(models)
    sessions = [open_session(engine, i, "hyco", n, 1.0) for i, n in enumerate((1, 5, 17))]
    trees = [oracle_tree(models[0], s.tokens) for s in sessions[:1]] + [
        (np.array([sessions[1].root]), np.array([-1])),
        random_tree(sessions[2].tokens, rows=4),
    ]
    alone_caches = [copy.deepcopy(s.cache) for s in sessions]
    alone = [
        verify_tree(engine.model, c, engine.tap, torch.as_tensor(tk), pa, s.t, engine.dtype)
        for c, s, (tk, pa) in zip(alone_caches, sessions, trees)
    ]
    caches = [copy.deepcopy(s.cache) for s in sessions]
    batched = batch_forward(engine, caches, [s.t for s in sessions], [t[0] for t in trees], [t[1] for t in trees])
    worst = 0.0
    for want, got, mine, theirs, (_tk, _) in zip(alone, batched, caches, alone_caches, trees):
        for w, g in zip(want, got):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=LOGIT_ATOL, rtol=0)
        worst = max(worst, float((got[0] - want[0]).abs().max()))
        for a, b in zip(mine.layers, theirs.layers):
            assert a.keys.shape == b.keys.shape
            torch.testing.assert_close(a.keys, b.keys, atol=KV_ATOL, rtol=0)
            torch.testing.assert_close(a.values, b.values, atol=KV_ATOL, rtol=0)
    assert worst < LOGIT_ATOL  # BLAS may sum in another order (within float32 rounding); bit-exact passes too
    print(f"max |logit diff| batched vs alone: {worst:.2e}")
    engine.close()


# --------------------------------------------------------------------------------------- sessions in batches


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_session_commits_what_it_commits_alone(models, temperature):
    """Six sessions of five modes join at different steps, run different numbers of rounds and leave; each step
    batches the active ones in a shuffled order. Replies and committed tokens equal each session run alone."""
    model = models[0]
    alone_engine, batch_engine = make_engine(models), make_engine(models)
    alone = []
    for i, (mode, n, _, rounds) in enumerate(PLAN):
        s = open_session(alone_engine, i, mode, n, temperature)
        replies = []
        for seq in range(rounds):
            if s.finished:
                break
            replies.append(s.verify(*tree_for(model, mode, s.tokens), seq))
        alone.append((s.output, replies))
    assert sum(len(r.path_rows) for _, replies in alone for r in replies) >= 6  # paths are accepted: compaction runs

    sessions, seqs, rows_seen = {}, {}, []
    order = np.random.default_rng(1)
    for step in range(12):
        for i, (mode, n, start, _) in enumerate(PLAN):
            if start == step:
                sessions[i], seqs[i] = open_session(batch_engine, i, mode, n, temperature), 0
        for i in [i for i in sessions if seqs[i] >= PLAN[i][3] or sessions[i].finished]:
            sessions.pop(i).close()  # leaves mid-run
        active = [i for i in sessions]
        order.shuffle(active)
        if not active:
            continue
        batch = [(sessions[i], *tree_for(model, PLAN[i][0], sessions[i].tokens), seqs[i]) for i in active]
        stats = BatchStats()
        results = verify_batch(batch_engine, batch, stats)
        rows_seen.append(stats.sessions)
        for i, reply in zip(active, results):
            assert not isinstance(reply, BaseException), reply
            assert_replies_match(reply, alone[i][1][seqs[i]])
            seqs[i] += 1
            if seqs[i] == len(alone[i][1]):
                assert sessions[i].output == alone[i][0], PLAN[i]
    assert all(seqs[i] == len(alone[i][1]) for i in seqs) and len(seqs) == len(PLAN)
    assert max(rows_seen) >= 4 and min(rows_seen) >= 1
    alone_engine.close()
    batch_engine.close()


def test_a_bad_round_is_answered_alone_and_the_batch_goes_on(models):
    """In one batch: a wrong seq and a wrong root get their own errors and leave their sessions unchanged; the two
    good rounds equal their alone-runs; a retry of an answered round returns its reply without a forward."""
    model = models[0]
    engine, ref_engine = make_engine(models), make_engine(models)
    good = [open_session(engine, i, "hyco", 6 + i, 1.0) for i in range(2)]
    refs = [open_session(ref_engine, i, "hyco", 6 + i, 1.0) for i in range(2)]
    bad_seq, bad_root = open_session(engine, 2, "hyco", 4, 1.0), open_session(engine, 3, "hyco", 4, 1.0)
    trees = [oracle_tree(model, s.tokens) for s in good]
    wrong_root = random_tree(bad_root.tokens)[0].copy()
    wrong_root[0] = (wrong_root[0] + 1) % VOCAB
    batch = [
        (good[0], *trees[0], 0),
        (bad_seq, *random_tree(bad_seq.tokens), 3),
        (bad_root, wrong_root, random_tree(bad_root.tokens)[1], 0),
        (good[1], *trees[1], 0),
    ]
    stats = BatchStats()
    results = verify_batch(engine, batch, stats)
    assert isinstance(results[1], SequenceError) and results[2].code == "bad_root"
    assert (stats.sessions, stats.rows) == (2, len(trees[0][0]) + len(trees[1][0]))
    for got, ref, (tk, pa) in zip((results[0], results[3]), refs, trees):
        assert_replies_match(got, ref.verify(tk, pa, 0))
    for s in (bad_seq, bad_root):  # unchanged: their next correct round equals a fresh session's
        assert (s.rounds, s.t, len(s.cache.layers[0].keys[0, 0])) == (0, 3, 3)
    retry = verify_batch(engine, [(good[0], *trees[0], 0)], stats := BatchStats())
    assert retry[0] is results[0] and stats.sessions == 0
    engine.close()
    ref_engine.close()


def test_a_failed_forward_fails_its_rounds_and_restores_every_session(models, monkeypatch):
    engine = make_engine(models)
    sessions = [open_session(engine, i, "hyco", 5 + i, 1.0) for i in range(3)]
    trees = [random_tree(s.tokens) for s in sessions]
    before = [
        (s.t, s.generator.get_state().clone(), [layer.keys.clone() for layer in s.cache.layers]) for s in sessions
    ]
    real = engine.model.forward
    monkeypatch.setattr(engine.model, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    results = verify_batch(engine, [(s, *t, 0) for s, t in zip(sessions, trees)])
    assert [str(r) for r in results] == ["boom"] * 3
    monkeypatch.setattr(engine.model, "forward", real)
    for s, (t, state, keys) in zip(sessions, before):
        assert s.t == t and s.rounds == 0 and torch.equal(s.generator.get_state(), state)
        for layer, k in zip(s.cache.layers, keys):
            assert torch.equal(layer.keys, k)
    assert all(
        not isinstance(r, BaseException) for r in verify_batch(engine, [(s, *t, 0) for s, t in zip(sessions, trees)])
    )
    engine.close()


def test_a_chunked_prefill_job_equals_the_whole_prefill(models):
    """A PrefillJob run a chunk per step (as the scheduler runs it between rounds) leaves the cache, t and h of
    `Session.prefill`; an empty prompt (one token) finishes in its first step."""
    job_session = make_engine(models, prefill_chunk=4).open(list(range(20, 31)), Sampling(1.0, 64, 0.95), seed=100)
    job = job_session.prefill_job()
    results = [job.step() for _ in range(3)]
    assert results[:2] == [None, None] and results[2] == (job.ms, 10)  # 10 positions in chunks of 4, 4, 2
    whole = make_engine(models).open(list(range(20, 31)), Sampling(1.0, 64, 0.95), seed=100)
    whole.prefill()
    assert (job_session.t, job_session.prefill_ms) == (10, job.ms)
    for a, b in zip(job_session.cache.layers, whole.cache.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=KV_ATOL, rtol=0)
    torch.testing.assert_close(job_session._h, whole._h, atol=KV_ATOL, rtol=0)
    one = make_engine(models).open([7], Sampling(1.0, 64, 0.95)).prefill_job()
    assert one.step() == (0.0, 0)


# --------------------------------------------------------------------------------------------- the server


ROWS = 5  # oracle trees of width 2 and depth 2


def _drive(url, requests, barrier, record, failures, tree_model, lock):
    """One client: open, wait for the others, then rounds of oracle trees until finished or 4 rounds."""
    i, req = requests
    try:
        with VerifierClient(url, timeout_s=60) as c:
            c.open(req)
            tokens = [int(x) for x in req.prompt_ids]
            barrier.wait(30)
            for seq in range(4):
                with lock:
                    tree, parents = tree_for(tree_model, "hyco", tokens)
                reply = c.round(DraftTree(seq, tree.astype(np.int32), parents.astype(np.int32)))
                record[i].append((tree, parents, reply))
                tokens += [int(tree[r]) for r in reply.path_rows] + [int(reply.bonus)]
                if reply.finished:
                    break
    except Exception as e:  # noqa: BLE001 -- reported by the test
        failures.append(e)


def _metric(server, name):
    text = server.server.metrics.exposition()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name)
    }


def test_concurrent_clients_are_batched_and_get_the_serial_servers_replies(models):
    """Four clients at once against a batched server and a serial one: the batched forwards hold more rows than
    one session's (read from /metrics), and every reply equals the serial server's."""
    tree_model, lock = tiny_verifier(sharpen=3.0), threading.Lock()
    requests = [
        (
            i,
            OpenRequest(
                prompt_ids=np.arange(30 + 5 * i, 38 + 7 * i, dtype=np.int32),
                sampling=Sampling(1.0, 64, 0.95),
                seed=i,
                acceptance=("exact", "epsilon")[i % 2],
                epsilon=0.02,
                max_new_tokens=40,
            ),
        )
        for i in range(4)
    ]
    outputs = {}
    for mode in ("batched", "serial"):
        engine = make_engine(models)
        with ServerThread(engine, tree_rows=ROWS, batching=mode, max_batch_wait_ms=200.0) as srv:
            record, failures, barrier = {i: [] for i in range(4)}, [], threading.Barrier(4)
            threads = [
                threading.Thread(target=_drive, args=(srv.url, r, barrier, record, failures, tree_model, lock))
                for r in requests
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not failures, failures
            rows = _metric(srv, "hycoc_batch_rows")
            sessions = _metric(srv, "hycoc_batch_sessions")
            waits = _metric(srv, "hycoc_queue_wait_seconds_count")
        engine.close()
        rounds = sum(len(r) for r in record.values())
        outputs[mode] = record
        if mode == "serial":
            assert rows["hycoc_batch_rows_count"] == rounds and rows["hycoc_batch_rows_sum"] == rounds * ROWS
            assert sessions['hycoc_batch_sessions_bucket{le="1.0"}'] == rounds
        else:
            # fewer forwards than rounds, each holding more than one session's 7 rows on average
            assert rows["hycoc_batch_rows_count"] < rounds and rows["hycoc_batch_rows_sum"] == rounds * ROWS
            assert rows["hycoc_batch_rows_sum"] / rows["hycoc_batch_rows_count"] > ROWS
            assert sessions["hycoc_batch_sessions_sum"] == rounds
            assert sessions['hycoc_batch_sessions_bucket{le="1.0"}'] < rows["hycoc_batch_rows_count"]
        assert waits == {"hycoc_queue_wait_seconds_count": rounds}
    for i in range(4):
        assert len(outputs["batched"][i]) == len(outputs["serial"][i]) > 0
        for (tb, pb, got), (ts, ps, want) in zip(outputs["batched"][i], outputs["serial"][i]):
            np.testing.assert_array_equal(tb, ts)
            np.testing.assert_array_equal(pb, ps)
            assert_replies_match(got, want)


def scheduled(body, **options):
    """``await body(sched)`` with a started `BatchScheduler` (``max_batch_rows=64`` and ``options``) whose steps run
    on one worker thread; the scheduler stopped after, the body's result returned."""
    from hycoc.verifier.scheduler import BatchScheduler

    worker = ThreadPoolExecutor(max_workers=1)

    async def main():
        loop = asyncio.get_running_loop()
        sched = BatchScheduler(lambda fn, *a: loop.run_in_executor(worker, fn, *a), max_batch_rows=64, **options)
        sched.start()
        result = await body(sched)
        await sched.stop()
        return result

    try:
        return asyncio.run(main())
    finally:
        worker.shutdown()


def test_a_long_prefill_runs_chunk_by_chunk_between_rounds(models):
    """The scheduler's steps: a 61-token prompt (15 chunks of 4) queued with another session's round; the round is
    answered in the first step, beside the prompt's first chunk, not after the whole prompt."""
    engine = make_engine(models, prefill_chunk=4)
    ref = make_engine(models, prefill_chunk=4)
    busy = open_session(engine, 0, "hyco", 6, 1.0)
    tree = tree_for(models[0], "hyco", busy.tokens)
    want = open_session(ref, 0, "hyco", 6, 1.0).verify(*tree, 0)
    long = engine.open(list(range(10, 71)), Sampling(1.0, 64, 0.95), seed=3)
    reports, done_at = [], {}

    async def body(sched):
        prefill = asyncio.ensure_future(sched.prefill(long.prefill_job))
        answer = asyncio.ensure_future(sched.round(busy, DraftTree(0, tree[0], tree[1])))
        answer.add_done_callback(lambda _: done_at.setdefault("round", len(reports)))
        prefill.add_done_callback(lambda _: done_at.setdefault("prefill", len(reports)))
        return await answer, await prefill

    (reply, _, committed, verified), (prefill_ms, t) = scheduled(
        body, max_batch_wait_ms=1000.0, open_sessions=lambda: 1, on_step=reports.append
    )
    assert verified and committed == len(reply.path_rows) + 1 and t == 60 and prefill_ms > 0
    assert_replies_match(reply, want)
    assert [(r.stats.sessions, r.prefill_chunks) for r in reports] == [(1, 1)] + [(0, 1)] * 14
    assert done_at == {"round": 1, "prefill": 15}  # answered with the 1st step's report; the prompt with the 15th
    engine.close()
    ref.close()


@pytest.mark.parametrize(
    "vocab, k, ties", [(300, 64, False), (300, 64, True), (50, 1, True), (4096, 64, False), (40, 40, True)]
)
def test_top_k_stable_is_the_full_stable_sorts_first_k(vocab, k, ties):
    """p~'s top-k without a whole-row sort (the per-session host work around a batched forward, docs/serving.md)
    keeps the full stable sort's exact order, ties included (they go to the lowest id, as in every pinned sampling
    test)."""
    from hycoc.verifier.sampling import top_k_stable

    x = torch.randn(33, vocab, generator=torch.Generator().manual_seed(vocab + k))
    if ties:
        x = torch.round(x * 2) / 2  # a handful of distinct values: ties at every k-th boundary
    values, ids = top_k_stable(x, k)
    want_values, want_ids = torch.sort(x, dim=-1, descending=True, stable=True)
    assert torch.equal(values, want_values[:, :k]) and torch.equal(ids, want_ids[:, :k])


def test_short_prefills_share_a_step_up_to_the_prefill_budget(models):
    """Four 5-token prompts (4 positions each) with a budget of 8 positions per step: two prefills per step, in
    arrival order, each session's KV equal to its prefill run alone (64 sessions opening together were prefilled
    one per step before the budget)."""
    from hycoc.verifier.scheduler import BatchScheduler

    engine = make_engine(models, prefill_chunk=4)
    ref = make_engine(models, prefill_chunk=4)
    prompts = [list(range(10 + 7 * i, 15 + 7 * i)) for i in range(4)]
    sessions = [engine.open(p, Sampling(1.0, 64, 0.95), seed=i) for i, p in enumerate(prompts)]
    reports, order = [], []

    async def body(sched):
        futures = [asyncio.ensure_future(sched.prefill(s.prefill_job)) for s in sessions]
        for i, f in enumerate(futures):
            f.add_done_callback(lambda _, i=i: order.append((i, len(reports))))
        return await asyncio.gather(*futures)

    results = scheduled(body, max_batch_wait_ms=0.0, open_sessions=lambda: 4, on_step=reports.append, prefill_budget=8)
    assert [t for _, t in results] == [4, 4, 4, 4]
    assert [r.prefill_chunks for r in reports] == [2, 2]
    assert sorted(order) == [(0, 1), (1, 1), (2, 2), (3, 2)]
    for s, p in zip(sessions, prompts):
        alone = ref.open(p, Sampling(1.0, 64, 0.95), seed=0)
        alone.prefill()
        for got, want in zip(s.cache.layers, alone.cache.layers):
            if want.is_initialized and want.keys.numel():
                torch.testing.assert_close(got.keys, want.keys, rtol=0, atol=0)
    with pytest.raises(ValueError, match="prefill_budget = 0"):
        BatchScheduler(
            None, max_batch_rows=1, max_batch_wait_ms=0, open_sessions=lambda: 1, on_step=print, prefill_budget=0
        )
    engine.close()
    ref.close()
