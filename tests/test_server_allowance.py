"""The tree allowance over the wire (protocol 6; docs/serving.md "Tree allowance"): every reply grants the next round
its rows, a round over its allowance is refused with the session unchanged, and a loaded batched server shrinks
the allowance with the real `AllowanceRule`."""

from __future__ import annotations

import math
import threading
from collections import Counter

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import ServerError, VerifierClient
from hycoc.verifier import VerifierEngine
from hycoc.verifier.errors import OverAllowance
from hycoc.verifier.row_budget import RowCost
from hycoc.verifier.server import ServerThread
from tiny_models import tiny_head, tiny_verifier

from hycoc.protocol.messages import DraftTree, OpenRequest, Sampling

torch.set_num_threads(1)
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
ROWS = 7  # B + 1 of these tests' sessions
K = 4  # the engine's chain length: the allowance's floor is K + 1 = 5


@pytest.fixture(scope="module")
def models():
    model = tiny_verifier()
    return model, tiny_head(model)


def make_engine(models) -> VerifierEngine:
    return VerifierEngine(
        models[0],
        head=models[1],
        keep_set=np.arange(3, 250),
        head_window=6,
        handoff_scales=SCALES,
        eos_token_ids=set(),
        max_context=256,
        chain_length=K,
    )


def chain(root: int, rows: int, seq: int) -> DraftTree:
    """A chain of ``rows`` rows under ``root``, scored d ln 0.5 at depth d (so every rank is worth 0.5^d)."""
    tokens = np.array([root] + [10 + seq * 7 + j for j in range(1, rows)], np.int32)
    return DraftTree(seq, tokens, np.arange(-1, rows - 1, dtype=np.int32), np.arange(rows) * np.float32(math.log(0.5)))


def request(i: int = 0, **kw) -> OpenRequest:
    return OpenRequest(
        prompt_ids=np.arange(20 + i, 30 + i, dtype=np.int32),
        sampling=Sampling(0.0, 64, 1.0),
        seed=i,
        max_new_tokens=200,
        **kw,
    )


class FixedRule:
    """A stand-in for `AllowanceRule` that always grants ``rows`` (to drive the protocol path at one session)."""

    def __init__(self, rows: int):
        self.rows = rows

    def grant(self, sessions=None) -> int:
        return self.rows

    def observe_tree(self, *args) -> None:
        pass

    def observe_step(self, *args, **kwargs) -> None:
        pass

    def observe_drafting(self, *args) -> None:
        pass

    def observe_away(self, *args) -> None:
        pass


def metrics(srv) -> dict[str, float]:
    text = srv.server.metrics.exposition()
    return {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line[:1] != "#"}


def test_a_round_over_its_allowance_is_refused_and_the_session_goes_on(models):
    """A reply granting 3 rows: a 7-row round gets over_allowance and changes nothing (the 3-row round after it
    gets the reply a fresh session gets for the same rounds); a repeated round gets the same bytes; /metrics counts
    the granted allowances and the rows the device did not draft."""
    engine = make_engine(models)
    with ServerThread(
        engine, tree_rows=ROWS, batching="batched", allowance="auto", row_cost=RowCost(((1, 1.0), (2, 2.0)))
    ) as srv:
        srv.server.worker.set_allowance(FixedRule(3))
        replies = {}
        for name, refuse in (("refused first", True), ("reference", False)):
            with VerifierClient(srv.url, timeout_s=60) as c:
                opened = c.open(request())
                assert opened.tree_rows == ROWS
                first = c.round(chain(29, ROWS, 0))  # the first round may hold the whole tree
                assert first.allowance == 3
                root = int(first.bonus)
                if refuse:
                    with pytest.raises(ServerError) as info:
                        c.round(chain(root, ROWS, 1))
                    assert info.value.code == "over_allowance"
                    assert "7 rows; the last reply allowed at most 3" in info.value.server_message
                second = c.round(chain(root, 3, 1))
                assert second.allowance == 3
                replies[name] = (first, second)
        for a, b in zip(replies["refused first"], replies["reference"]):
            np.testing.assert_array_equal(a.samples, b.samples)
            assert (a.bonus, a.allowance, a.path_rows.tolist()) == (b.bonus, b.allowance, b.path_rows.tolist())
        got = metrics(srv)
        assert got["hycoc_allowance_rows_count"] == 4 and got["hycoc_allowance_rows_sum"] == 12
        assert got["hycoc_rows_not_drafted_total"] == 2 * (ROWS - 3)  # each session's 3-row round
        assert got['hycoc_errors_total{kind="over_allowance"}'] == 1
    engine.close()


def test_the_engine_checks_the_allowance_before_touching_the_session(models):
    engine = make_engine(models)
    s = engine.open(np.arange(20, 30), Sampling(0.0, 64, 1.0), max_new_tokens=50)
    s.prefill()
    s.tree_rows, s.allowance = ROWS, 2
    t, tokens, rounds = s.t, list(s.tokens), s.rounds
    tree = chain(s.root, 3, 0)
    with pytest.raises(OverAllowance, match="3 rows; the last reply allowed at most 2"):
        s.verify(tree.tokens, tree.parents, 0)
    assert (s.t, s.tokens, s.rounds) == (t, tokens, rounds)
    reply = s.grant(s.verify(tree.tokens[:2], tree.parents[:2], 0))  # no rule: the whole tree
    assert reply.allowance == ROWS == s.allowance
    cloud = engine.open(np.arange(20, 30), Sampling(0.0, 64, 1.0), draft_place="cloud-mtp", max_new_tokens=50)
    cloud.prefill()
    cloud.tree_rows = cloud.place.tree_rows(ROWS)
    assert cloud.tree_rows == 1 and cloud.grant(cloud.verify([cloud.root], [-1], 0)).allowance == 1
    engine.close()


def _client(url, i, barrier, record, failures):
    try:
        with VerifierClient(url, timeout_s=60) as c:
            c.open(request(i, draft_ms_floor=2.0, draft_ms_tree=9.0))
            root, allowance = 20 + i + 9, ROWS
            barrier.wait(30)
            for seq in range(6):
                reply = c.round(chain(root, allowance, seq))
                record.append((i, reply.allowance))
                root, allowance = int(reply.bonus), reply.allowance
    except Exception as e:  # noqa: BLE001 -- reported by the test
        failures.append(e)


def test_a_loaded_server_grants_the_floor_when_rows_cost_more_than_they_add(models):
    """Four sessions sharing each forward on a cost line that rises from the first row (1 ms per row) with trees
    whose rank r is worth 0.5^r: sessions x (1 + V(r)) / (sessions x r ms) falls with r, so the real rule grants
    the floor, K + 1 = 5 rows, from the first batched step on; the clients then send 5-row trees. Every 4th grant
    goes to the tree class (the whole tree, 7 rows) while that class has under 16 rounds (the yield's
    exploration): 24 grants under load, so 6 of them."""
    engine = make_engine(models)
    cost = RowCost(((1, 1.0), (100, 100.0)))
    with ServerThread(
        engine, tree_rows=ROWS, batching="batched", max_batch_wait_ms=500.0, allowance="auto", row_cost=cost
    ) as srv:
        record, failures, barrier = [], [], threading.Barrier(4)
        threads = [threading.Thread(target=_client, args=(srv.url, i, barrier, record, failures)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not failures, failures
        health = srv.server.health()["batching"]
        assert health["allowance"] == "auto" and health["allowance_floor"] == K + 1
        state = srv.server.worker.allowance.state
        assert (state.draft_floor_ms, state.draft_tree_ms) == (2.0, 9.0)  # the OPENs' reports
        assert state.aways == 4 * 5  # every round after a REPLY: rounds 2-6 of each session
        assert health["allowance_link_ms"] == round(state.link_ms, 3) >= 0
        # the chain class learned from every floor round, the tree class from the first rounds and the explored ones
        assert health["allowance_yield_rounds"] == {"chain": state.rounds[0], "tree": state.rounds[1]}
        assert sum(health["allowance_yield_rounds"].values()) == 24  # every verified round taught its class
        got = metrics(srv)
    engine.close()
    assert len(record) == 24
    # every step held 4 sessions (they wait for each other): 4 x 7 > 7 free rows; the tree class has 4 + at most 5
    # rounds (< 16), so grants 4, 8, ..., 24 explore it
    assert Counter(a for _, a in record) == {K + 1: 18, ROWS: 6}
    sent = [a for i in range(4) for a in [a for j, a in record if j == i][:-1]]  # rounds 2-6 of each session
    assert got["hycoc_rows_not_drafted_total"] == sum(ROWS - a for a in sent)
