"""The device's drafters behind one interface (runtime/drafters.py) and the one loop of MTP head steps
(hycoc/mtp_chain.py) that the device's MTP Drafter and the server's baselines share. The end-to-end behaviour of
every drafter is tests/test_runtime_e2e.py's; these check the registry against Table 5 and the loop's contract."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from hycoc.runtime import drafters as d
from hycoc.runtime.client import MODES, DeviceRuntime
from hycoc.runtime.draft_context import DraftContext
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


def device(mtp=None, **round_constants):
    """A runtime whose drafters get stand-ins (`DraftContext.make_dummy`: Table 5's round constants unless given,
    B = 32, 20 SpecEdge nodes, 1 SLM pass, 4 SpecEdge passes, λ = 0.66, 32 candidates; keep set 0..9; stop id 1)."""
    drafting = DraftContext.make_dummy(mtp=mtp, **round_constants)
    return DeviceRuntime(SimpleNamespace(round=drafting.round), drafting=drafting)


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
    rt = device()
    b = rt.builder(MODES[name], 33)
    assert (b.passes, b.budget, b.rows) == (passes, budget, 33)
    with pytest.raises(ValueError, match=f"mode {name} drafts {budget} nodes"):
        rt.builder(MODES[name], budget)  # B + 1 rows needed


def test_the_recipes_slm_passes_reach_the_hyco_drafter_but_not_hyco_2p():
    rt = device(slm_passes=3)
    assert rt.builder(MODES["hyco"], 33).passes == 3
    assert rt.builder(MODES["hyco-2p"], 33).passes == 2


def test_unknown_modes_and_treeless_drafters_are_refused():
    rt = device()
    with pytest.raises(ValueError, match="unknown mode 'nope'; choose one of " + ", ".join(MODES) + "$"):
        rt.drafter("nope")
    for name in ("cloud-mtp", "slm-alone"):
        with pytest.raises(ValueError, match="drafts no tree"):
            rt.builder(MODES[name], 33)


def test_cloud_mtp_sends_the_root_alone_and_commits_the_servers_chain():
    drafter = device().drafter("cloud-mtp")
    tree = drafter.draft(3, None, 42, 10)
    assert (tree.seq, tree.tokens.tolist(), tree.parents.tolist(), tree.scores) == (3, [42], [-1], None)
    reply = RoundReply(3, np.array([7, 8, 9, 5, 6], np.int32), np.array([1, 2], np.int32), 9, 1.0, False)
    assert drafter.read(3, reply) == [7, 8, 9]  # |P| = 2 path tokens and the bonus, in the server's own rows


def test_the_mtp_drafter_needs_a_handoff():
    rt = device(mtp=SimpleNamespace(reset=lambda: None))
    reply = RoundReply(0, np.zeros(1, np.int32), np.zeros(0, np.int32), 0, 1.0, False)
    with pytest.raises(BadReply, match="round 0: the verifier sent no hand-off"):
        rt.drafter("hyco").chain(1, reply)
    assert rt.drafter("server-head").chain(1, RoundReply(0, reply.samples, reply.path_rows, 0, 1.0, False)) == ([], [])


# ---- what a drafter gets: the context, not the runtime ---------------------------------------------------------


def test_a_drafter_gets_the_runtimes_one_context_and_keeps_its_tree_state_to_itself():
    rt = device()
    a, b = rt.drafter("hyco"), rt.drafter("specedge")
    assert a.context is b.context is rt.drafting and not hasattr(a, "device")
    a.begin(33)
    b.begin(21)
    assert (a.tree_builder.budget, b.tree_builder.budget) == (32, 20) and a.built is b.built is None
    with pytest.raises(RuntimeError, match="before begin"):
        rt.drafter("hyco").draft(0, None, 5, 10)  # a new request's drafter: no builder of the last one's


def test_make_dummy_fills_table5_and_the_tree_builder_factory_uses_the_contexts_constants():
    ctx = DraftContext.make_dummy(keep_set=[3, 4, 9], stop_ids=[9], node_budget=6, max_new_tokens=7)
    r = ctx.round
    assert (r.chain_length, r.sibling_depth, r.node_budget, r.depth_cost, r.slm_candidates) == (4, 2, 6, 0.66, 32)
    assert (r.slm_passes, r.specedge_passes, r.specedge_nodes, r.max_new_tokens) == (1, 4, 20, 7)
    assert ctx.mtp is None and ctx.slm is None and ctx.stop_ids == frozenset({9})
    b = ctx.tree_builder(budget=5, passes=2, rows=8)
    assert (b.budget, b.passes, b.rows, b.candidates, b.stop_ids) == (5, 2, 8, 32, frozenset({9}))
    assert b.ln_lambda == np.log(0.66) and b.keep_set.tolist() == [3, 4, 9]


def test_a_runtime_takes_graph_runners_or_a_context_not_both():
    ctx = DraftContext.make_dummy()
    with pytest.raises(TypeError, match="or drafting=DraftContext"):
        DeviceRuntime(SimpleNamespace(round=ctx.round))
    with pytest.raises(TypeError, match="or drafting=DraftContext"):
        DeviceRuntime(SimpleNamespace(round=ctx.round), object(), object(), drafting=ctx)


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
