"""The device's drafters behind one interface (runtime/drafters.py) and the one loop of MTP head steps
(hycoc/mtp_chain.py) that the device's MTP Drafter and the server's baselines share. The end-to-end behaviour of
every drafter is tests/test_runtime_e2e.py's; these check the registry against Table 5 and the loop's contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hycoc.runtime import drafters as d
from hycoc.runtime.client import MODES, DeviceRuntime
from hycoc.runtime.transport import BadReply

from hycoc.mtp_chain import HeadStep, head_chain
from hycoc.protocol.messages import RoundReply

# ---- the registry against Table 5 ------------------------------------------------------------------------------


def test_every_configuration_has_one_drafter_and_the_drafter_agrees_with_its_draft_place():
    assert set(d.DRAFTERS) == set(MODES)
    for name, mode in MODES.items():
        cls = d.DRAFTERS[name]
        assert issubclass(cls, d.Drafter)
        assert cls.verified == (mode.draft_place is not None), name  # slm-alone alone runs without a verifier
        assert cls.drafts == (mode.draft_place != "cloud-mtp"), name  # Cloud+MTP: the server drafts
        # a device tree (Alg. 3) for every place but the server's own chain and the verifier-less SLM
        assert issubclass(cls, d.SlmTreeDrafter) == (mode.draft_place in ("device", "server-head")), name


def rounds(**kw):
    base = dict(node_budget=32, specedge_nodes=20, slm_passes=1, specedge_passes=4, depth_cost=0.66, slm_candidates=32)
    return SimpleNamespace(**{**base, **kw})


def device(r):
    rt = DeviceRuntime.__new__(DeviceRuntime)
    rt.bundle, rt.stop_ids = SimpleNamespace(round=r, keep_set=np.arange(10)), {1}
    return rt


@pytest.mark.parametrize(
    "name, passes, budget",
    [
        ("hyco", 1, 32),  # Table 5: HyCo, 1 SLM pass, 32 nodes
        ("hyco-exact", 1, 32),
        ("hyco-2p", 2, 32),  # HyCo-2P: 2 passes
        ("server-head", 1, 32),
        ("specedge", 4, 20),  # SpecEdge-style: the recipe's specedge passes and nodes
        ("specedge-eps", 4, 20),
    ],
)
def test_tree_drafters_build_their_table5_tree(name, passes, budget):
    rt = device(rounds())
    b = rt.builder(MODES[name], 33)
    assert (b.passes, b.budget, b.rows) == (passes, budget, 33)
    with pytest.raises(ValueError, match=f"mode {name} drafts {budget} nodes"):
        rt.builder(MODES[name], budget)  # B + 1 rows needed


def test_the_recipes_slm_passes_reach_the_hyco_drafter_but_not_hyco_2p():
    rt = device(rounds(slm_passes=3))
    assert rt.builder(MODES["hyco"], 33).passes == 3
    assert rt.builder(MODES["hyco-2p"], 33).passes == 2


def test_unknown_modes_and_treeless_drafters_are_refused():
    rt = device(rounds())
    with pytest.raises(ValueError, match="unknown mode 'nope'; choose one of " + ", ".join(MODES) + "$"):
        rt.drafter("nope")
    for name in ("cloud-mtp", "slm-alone"):
        with pytest.raises(ValueError, match="drafts no tree"):
            rt.builder(MODES[name], 33)


def test_cloud_mtp_sends_the_root_alone_and_commits_the_servers_chain():
    drafter = device(rounds()).drafter("cloud-mtp")
    tree = drafter.draft(3, None, 42, 10)
    assert (tree.seq, tree.tokens.tolist(), tree.parents.tolist(), tree.scores) == (3, [42], [-1], None)
    reply = RoundReply(3, np.array([7, 8, 9, 5, 6], np.int32), np.array([1, 2], np.int32), 9, 1.0, False)
    assert drafter.read(3, reply) == [7, 8, 9]  # |P| = 2 path tokens and the bonus, in the server's own rows


def test_the_mtp_drafter_needs_a_handoff():
    rt = device(rounds())
    rt.mtp = SimpleNamespace(reset=lambda: None)
    reply = RoundReply(0, np.zeros(1, np.int32), np.zeros(0, np.int32), 0, 1.0, False)
    with pytest.raises(BadReply, match="round 0: the verifier sent no hand-off"):
        rt.drafter("hyco").chain(1, reply)
    assert rt.drafter("server-head").chain(1, RoundReply(0, reply.samples, reply.path_rows, 0, 1.0, False)) == ([], [])


# ---- the loop of head steps (Alg. 2 lines 7-13) ----------------------------------------------------------------


class Head:
    """A head whose step k returns the queued (best, second) picks and state 10 k; records every call."""

    def __init__(self, picks):
        self.picks, self.calls = list(picks), []

    def step(self, k, runner_up):
        self.calls.append(("step", k, runner_up))
        best, second = self.picks[k - 1]
        return HeadStep((best, second) if runner_up else (best,), 10 * k)

    def feed(self, i, state):
        self.calls.append(("feed", i, state))


def test_head_chain_steps_k_times_feeds_between_steps_and_takes_runner_ups_to_depth_d():
    head = Head([(3, 4), (5, 6), (7, 8)])
    out = head_chain(head.step, head.feed, 3, 2)
    assert (out.chain, out.runner_ups) == ([3, 5, 7], [4, 6])
    # Alg. 2: z = [E[i]; h] between steps (line 12), none after the K-th; runner-ups only for k <= D (line 11)
    assert head.calls == [
        ("step", 1, True),
        ("feed", 3, 10),
        ("step", 2, True),
        ("feed", 5, 20),
        ("step", 3, False),
    ]


def test_head_chain_of_zero_steps_runs_nothing_and_a_missing_runner_up_is_an_error():
    head = Head([])
    assert head_chain(head.step, head.feed, 0, 2).chain == [] and head.calls == []
    with pytest.raises(ValueError, match="head step 1 returned 1 index"):
        head_chain(lambda k, r: HeadStep((1,), None), head.feed, 2, 1)
