"""Every byte a session holds is reserved (issue 38 item 3; docs/serving.md "Metrics, admission and long work"):
the KV held by every session (caches, conversation snapshots, an APPEND's undo copy: `VerifierEngine.kv_bytes_held`)
sampled after every forward of the model never passes the server's KV ledger, through OPENs prefilling at once,
APPENDs of all three rollback kinds (crop, snapshot, full re-prefill), an APPEND whose chunk fails and snapshots given
up for room. Before issue 38 a full re-prefill's undo copy was counted as 0 bytes (held 1.37-1.74x the reservation).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import ServerError, VerifierClient
from hycoc.verifier import VerifierEngine
from hycoc.verifier.errors import InjectedFault
from hycoc.verifier.server import ServerThread
from tiny_models import tiny_verifier

from hycoc.chat import ids_crc32
from hycoc.protocol.messages import AppendTurn, DraftTree, OpenRequest, Sampling

ROWS = 5  # B + 1
CHUNK = 4  # prefill positions per forward: a 30-id prompt takes 8 chunks, so OPENs prefill side by side
MAX_CONTEXT = 128


@pytest.fixture(scope="module")
def engine():
    torch.set_num_threads(1)
    eng = VerifierEngine(
        tiny_verifier(), head_window=6, handoff_scales=(0.1,) * 6, max_context=MAX_CONTEXT, prefill_chunk=CHUNK
    )
    yield eng
    eng.close()


class Sampler:
    """A forward hook on the model: after every forward (prefill chunks, batched rounds), the KV every session
    holds and the ledger's reserved bytes, read under the ledger's lock (as the server's own sample)."""

    def __init__(self, engine, server):
        self.engine, self.budget, self.samples = engine, server.admission.kv, []
        self.handle = engine.model.register_forward_hook(self)

    def __call__(self, module, args, out) -> None:
        with self.budget.lock:
            self.samples.append((self.engine.kv_bytes_held(), self.budget.reserved))

    def remove(self) -> None:
        self.handle.remove()


def chain(root: int, seq: int, rng) -> DraftTree:
    tokens = np.asarray([root] + [int(x) for x in rng.integers(3, 290, ROWS - 1)], np.int32)
    return DraftTree(seq, tokens, np.arange(-1, ROWS - 1, dtype=np.int32))


def answer(client: VerifierClient, held: list[int], rng, max_new: int = 12) -> list[int]:
    """Rounds (random chains: about one token each) until the turn finishes; returns the held ids after it (the
    turn's output cut at ``max_new``, as the verifier cuts it)."""
    seq, out = 0, []
    while True:
        tree = chain((held + out)[-1], seq, rng)
        reply = client.round(tree)
        out += [int(tree.tokens[r]) for r in reply.path_rows] + [int(reply.bonus)]
        seq += 1
        if reply.finished:
            return held + out[:max_new]


def conversation(url: str, k: int, kinds: list, failures: list) -> None:
    """One device: OPEN (30 ids, the model turn opening at 20), then three APPENDs that roll back by snapshot
    (keep 21: the 12-token answer moved the sliding layers past it), crop (keep all but the last held id) and full
    (keep 3, before the snapshot, then 40 new ids: the old cache stays whole beside the new one until the last
    chunk). An APPEND whose chunk failed (`InjectedFault`) is sent again."""
    rng = np.random.default_rng(k)
    prompt = [int(x) for x in rng.integers(3, 290, 30)]
    with VerifierClient(url, timeout_s=120) as client:
        client.open(
            OpenRequest(
                prompt_ids=np.asarray(prompt, np.int32),
                sampling=Sampling(0.0, 64, 0.95),
                max_new_tokens=12,
                anchor=20,
            )
        )
        held = answer(client, prompt, rng)
        for step in ("snapshot", "crop", "full"):
            keep = {"snapshot": 21, "crop": len(held) - 1, "full": 3}[step]
            # a full re-prefill renders the whole conversation again: as long as the one held
            turn = [int(x) for x in rng.integers(3, 290, 40 if step == "full" else 6)]
            crc = ids_crc32(held[:keep])
            msg = AppendTurn(np.asarray(turn, np.int32), 12, keep=keep, keep_crc=crc, anchor=keep + 2)
            for _ in range(5):
                try:
                    client.append(msg)
                    break
                except ServerError as e:  # the failed chunk changed nothing: the same APPEND again
                    assert e.code == "injected_fault"
                    failures.append(k)
            kinds.append((k, step))
            held = answer(client, held[:keep] + turn, rng)


def test_held_kv_never_passes_the_reservation(engine, monkeypatch):
    import hycoc.verifier.faults as faults

    calls = {"n": 0}

    def fail_some(point: str) -> None:  # three APPEND chunks fail, as HYCOC_INJECT_FAULTS makes them
        calls["n"] += 1
        if calls["n"] in (2, 9, 23):
            raise InjectedFault(f"injected at {point}")

    monkeypatch.setattr(faults, "maybe_fail", fail_some)
    with ServerThread(engine, tree_rows=ROWS) as srv:
        server = srv.server
        assert server.prefill_pool.nbytes == engine.prefill_transient_bytes() == 512 * (7 + CHUNK)
        sampler = Sampler(engine, server)
        kinds, failures = [], []
        try:
            threads = [threading.Thread(target=conversation, args=(srv.url, k, kinds, failures)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(300)
        finally:
            sampler.remove()
        assert len(kinds) == 12 and len(failures) == 3  # every APPEND ran, three after a failed chunk
        appends = server.metrics.appends
        assert (appends["crop"], appends["snapshot"], appends["full"]) == (4, 4, 4)
        over = [(h, r) for h, r in sampler.samples if h > r]
        assert len(sampler.samples) > 100 and over == []
        assert max(h / r for h, r in sampler.samples) > 0.3  # the bound is not vacuous
        assert server.metrics.prefills_active_peak == 1  # four OPENs queued at once; never more than max_prefills
        assert server.metrics.kv_held_over_reserved == 0
        assert server.metrics.errors["injected_fault"] == len(failures)
    assert server.admission.kv.reserved == 0  # the pool went with the server; every session gave its bytes back


def test_a_snapshot_is_given_up_when_a_session_needs_its_room(engine):
    """A budget with room for one session and its snapshot: a second OPEN gets the room of the first session's
    snapshot (dropped, counted in hycoc_snapshots_evicted_total), and that session's next turn re-prefills in full.
    Held KV stays within the reservation throughout."""
    pool = engine.prefill_transient_bytes()
    base = engine.session_kv_bytes(30 + 12 + ROWS, ROWS)
    snap = engine.snapshot_bytes(20)
    assert (base, snap) == (512 * 47 + 512 * (7 + ROWS), 512 * 7)
    with ServerThread(engine, tree_rows=ROWS) as srv:
        budget = srv.server.admission.kv
        budget.capacity = pool + 2 * base + snap  # room for two sessions and one snapshot
        sampler = Sampler(engine, srv.server)
        try:
            rng = np.random.default_rng(0)
            prompt = [int(x) for x in rng.integers(3, 290, 30)]
            req = OpenRequest(
                prompt_ids=np.asarray(prompt, np.int32), sampling=Sampling(0.0, 64, 0.95), max_new_tokens=12, anchor=20
            )
            with VerifierClient(srv.url, timeout_s=60) as a, VerifierClient(srv.url, timeout_s=60) as b:
                a.open(req)
                assert budget.reserved == pool + base + snap and budget.spare_bytes == snap
                held = answer(a, prompt, rng)
                b.open(req)  # its own snapshot does not fit beside a's: taken by no one
                assert budget.reserved == pool + 2 * base + snap and budget.evicted == 0
                c = VerifierClient(srv.url, timeout_s=60)
                with pytest.raises(ServerError) as info:
                    c.open(req)  # no room even without snapshots
                assert info.value.code == "kv_budget_exhausted" and budget.evicted == 0
                c.close()
                b.close()
                while budget.reserved != pool + base + snap:  # b's bytes come back once the worker freed them
                    threading.Event().wait(0.01)
                with VerifierClient(srv.url, timeout_s=60) as d:
                    d.open(replace_anchor(req, 0))  # needs a's snapshot's room: a's snapshot is given up
                    assert budget.evicted == 1 and budget.spare_bytes == 0
                while budget.reserved != pool + base:  # d's bytes back: room for a's undo copy
                    threading.Event().wait(0.01)
                a.append(AppendTurn(np.asarray([5, 6, 7], np.int32), 4, keep=21, keep_crc=ids_crc32(held[:21])))
                live = [s for s in srv.server.sessions.values() if s.appends]
                assert [p.kind for p in live[0].appends] == ["full"]  # no snapshot left to restore
        finally:
            sampler.remove()
        assert sampler.samples and all(h <= r for h, r in sampler.samples)
        assert "hycoc_snapshots_evicted_total 1.0" in srv.server.metrics.exposition()


def replace_anchor(req: OpenRequest, anchor: int) -> OpenRequest:
    from dataclasses import replace

    return replace(req, anchor=anchor, max_new_tokens=12 + 7)  # a prompt and cap the budget has room for
