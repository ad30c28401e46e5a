"""The device's round loop (runtime/client.py, paper Alg. 1) against a verifier that verifies only part of each tree
(protocol version 4: the ROUND carries the rows' scores, the REPLY names the verified rows, an ancestor-closed subset).

No model: the SLM Drafter is the real one on the fake graph of tests/test_runtime_drafters.py (its K rows encode
token and position, so the ring's content can be checked exactly), the MTP Drafter a stand-in that drafts the
verifier's own continuation (so the verifier's sample at a chain row is the next chain row's token, and a trimmed
chain row always matches its parent's sample: the walk must still not enter it), and the verifier a deterministic
stand-in: ŷ_v = f(context through v) on verified rows, unverified rows echo their own tokens. Whatever is trimmed,
the device must commit exactly f's greedy continuation, commit only verified path nodes to the SLM ring, and refuse
a reply whose verified rows are inconsistent.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
from hycoc.runtime.client import DeviceRuntime, RuntimeProtocolError
from hycoc.runtime.draft_context import DraftContext
from hycoc.runtime.tree_builder import TreeBuilder, walk_reply
from test_runtime_drafters import WF, WS, V, k_value, ring, slm_drafter

from hycoc.protocol import wire
from hycoc.protocol.messages import DraftTree, Opened, RoundReply, commit_cut

ROWS = 7  # B + 1 rows per tree (B = 6: the 3-chain, 2 siblings and SLM candidates)
PROMPT = [1, 3, 2, 4]
MAX_NEW = 14
STOP = 99  # never drafted (the keep set is 0..4): requests end at max_new_tokens


def f(ctx) -> int:
    """The stand-in verifier's greedy next token after ``ctx``."""
    return (2 * ctx[-1] + len(ctx)) % V


def greedy(prompt, n):
    ctx = list(prompt)
    for _ in range(n):
        ctx.append(f(ctx))
    return ctx[len(prompt) :]


def depths(parents) -> np.ndarray:
    d = np.zeros(len(parents), np.int64)
    for j in range(1, len(parents)):
        d[j] = d[parents[j]] + 1
    return d


def first_child_chain(parents) -> list[int]:
    """Rows of the chain that follows each row's lowest child from the root (the MTP chain, rows 1, 2, 3, when
    the tree has one: it is planted first)."""
    chain, v = [], 0
    while True:
        kids = [c for c in range(1, len(parents)) if parents[c] == v]
        if not kids:
            return chain
        v = kids[0]
        chain.append(v)


def keep_depth(d):
    return lambda tokens, parents: depths(parents) <= d


def cut_chain_after(d):
    """The chain's rows deeper than d (and everything below them) not verified; siblings kept."""

    def policy(tokens, parents):
        kept = np.ones(len(parents), bool)
        for row in first_child_chain(parents)[d:]:
            kept[row] = False
        for j in range(1, len(parents)):  # below a row left out: left out (ancestor-closed)
            kept[j] &= kept[parents[j]]
        return kept

    return policy


class PerfectMtp:
    """The MTP Drafter's stand-in: the chain is f's continuation of the committed tokens (the SLM's), the
    runner-ups the next token ids."""

    runner = SimpleNamespace()

    def __init__(self, slm):
        self.slm, self.ingested = slm, 0

    def reset(self):
        pass

    def ingest(self, handoff):
        self.ingested += 1

    def draft(self):
        ctx = list(self.slm.tokens)
        chain = []
        for _ in range(3):
            chain.append(f(ctx))
            ctx.append(chain[-1])
        return SimpleNamespace(chain=chain, runner_ups=[(c + 1) % V for c in chain[:2]])


class PartialVerifier:
    """A `VerifierClient` stand-in that verifies the rows ``policy(tokens, parents)`` picks (bool (R,), or None
    for every row). Frames pass through the real codec unless ``tamper`` rewrites the reply first. Its reply to
    round k grants ``allowance(k)`` rows (None: the whole tree, 0 once the request is finished)."""

    def __init__(self, policy, tamper=None, allowance=None):
        self.policy, self.tamper, self.allowance = policy, tamper, allowance
        self.round_bytes, self.link_s, self.opened = [], 0.0, None
        self.trees, self.replies, self.echo_matches = [], [], 0

    def open(self, request):
        self.ctx, self.max_new, self.produced = [int(x) for x in request.prompt_ids], request.max_new_tokens, 0
        self.opened = Opened(1, len(self.ctx) - 1, 1.0, 1000, ROWS, V, 1, 1, 1, stop_ids=(STOP,))
        return self.opened

    def round(self, tree):
        tree = wire.decode(wire.encode(tree), wire.Limits(tree_rows=ROWS, vocab_size=V))  # fp16 scores, checked
        tokens, parents = tree.tokens, tree.parents
        rows = len(tokens)
        verified = self.policy(tokens, parents)
        on = np.ones(rows, bool) if verified is None else verified
        samples = tokens.copy()  # rows left out echo their own tokens
        for v in range(rows):
            if on[v]:
                up, a = [], v
                while a > 0:
                    up.append(int(tokens[a]))
                    a = int(parents[a])
                samples[v] = f(self.ctx + up[::-1])
        path, v = [], 0  # the walk, written out again: verified rows only
        while True:
            kids = [c for c in range(1, rows) if parents[c] == v and on[c] and tokens[c] == samples[v]]
            if not kids:
                break
            v = kids[0]
            path.append(v)
        self.echo_matches += sum(
            1 for c in range(1, rows) if not on[c] and on[parents[c]] and tokens[c] == samples[parents[c]]
        )
        new, reason = commit_cut(
            [int(tokens[j]) for j in path] + [int(samples[v])], {STOP}, self.max_new - self.produced, 10**6
        )
        if self.allowance is not None:
            allowance = self.allowance(len(self.trees))
        else:  # protocol 6: the whole tree, as an unloaded server
            allowance = 0 if reason is not None else ROWS
        reply = RoundReply(
            tree.seq,
            samples,
            np.array(path, np.int32),
            int(samples[v]),
            1.0,
            reason is not None,
            finish_reason=reason,
            verified=verified,
            allowance=allowance,
        )
        if self.tamper is not None:
            reply = self.tamper(reply)
        else:
            reply = wire.decode(wire.encode(reply), wire.Limits(tree_rows=ROWS, vocab_size=V))
        self.produced += len(new)
        self.ctx += new
        self.trees.append(tree)
        self.replies.append(reply)
        self.round_bytes.append((0, 0))
        return replace(reply, handoff=SimpleNamespace())  # the stand-in MTP Drafter ignores it

    def close(self):
        pass


def runtime():
    """A DeviceRuntime of stand-ins (module docstring), its drafters given them through `DraftContext.make_dummy`,
    with a spy on the SLM ring's commits (``rt.commits``) and on the trees the drafters build (``rt.built``, and
    ``rt.forwards``: the SLM forwards each build ran)."""
    slm = slm_drafter()
    commits, built, forwards = [], [], []

    class SpyBuilder(TreeBuilder):
        """The tree builder, recording each tree it builds and the SLM forwards building it ran."""

        def build(self, *args, **kw):
            before = slm.forwards
            tree = super().build(*args, **kw)
            built.append(tree)
            forwards.append(slm.forwards - before)
            return tree

    drafting = DraftContext.make_dummy(
        mtp=PerfectMtp(slm),
        slm=slm,
        keep_set=np.arange(V),
        stop_ids={STOP},
        builder_class=SpyBuilder,
        node_budget=ROWS - 1,
        specedge_nodes=ROWS - 1,
        slm_passes=1,
        specedge_passes=4,
        depth_cost=0.66,
        slm_candidates=2,
        max_new_tokens=MAX_NEW,
        seed=0,
        temperature=0.0,
        top_k=1,
        top_p=1.0,
        epsilon=1.0,
        chain_length=3,
        sibling_depth=2,
    )
    bundle = SimpleNamespace(
        round=drafting.round,
        keep_set=np.arange(V),
        keep_index=np.arange(V),
        tokenizer=SimpleNamespace(decode=lambda ids, **kw: " ".join(map(str, ids))),
        chat=SimpleNamespace(format=SimpleNamespace(contract=lambda: None)),
    )
    rt = DeviceRuntime(bundle, drafting=drafting)
    rt.commits, rt.built, rt.forwards = commits, built, forwards
    commit = slm.commit

    def spy_commit(path_nodes, new):
        moved = commit(path_nodes, new)
        commits.append(list(path_nodes))
        for p in range(max(0, slm.n_kv - WS), slm.n_kv):  # every ring column holds its committed token's KV
            assert ring(slm, 0, p) == k_value(slm.tokens[p], p), (p, slm.tokens)
        for p in range(max(0, slm.n_kv - WF), slm.n_kv):
            assert ring(slm, 1, p, 1) == k_value(slm.tokens[p], p, 1, 1), (p, slm.tokens)
        return moved

    slm.commit = spy_commit
    return rt


POLICIES = {
    "every row (no mask)": lambda tokens, parents: None,
    "every row (mask)": lambda tokens, parents: np.ones(len(parents), bool),
    **{f"depth <= {d}": keep_depth(d) for d in range(4)},
    **{f"chain cut after depth {d}": cut_chain_after(d) for d in range(3)},
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_whatever_is_trimmed_the_device_commits_the_verifiers_text_and_only_verified_path_nodes(name):
    rt, verifier = runtime(), PartialVerifier(POLICIES[name])
    res = rt.generate(verifier, PROMPT, mode="hyco", max_new_tokens=MAX_NEW)
    assert res.tokens == greedy(PROMPT, MAX_NEW) and res.finish_reason == "max_new_tokens"
    assert len(rt.commits) == len(verifier.replies) == res.rounds == len(rt.built)
    for built, tree, reply, nodes in zip(rt.built, verifier.trees, verifier.replies, rt.commits):
        verified = np.ones(ROWS, bool) if reply.verified is None else reply.verified
        assert nodes == [built.row_node[j] for j in reply.path_rows]  # the ring gets the path's nodes only
        assert all(verified[j] for j in reply.path_rows)
        # the scores sent are the tree's, through fp16: the root's 0, no row above its parent
        assert tree.scores[0] == 0 and (tree.scores[1:] <= tree.scores[tree.parents[1:]]).all()
        np.testing.assert_array_equal(tree.scores, built.scores.astype(np.float16).astype(np.float32))
    assert res.rows == [ROWS if r.verified is None else int(r.verified.sum()) for r in verifier.replies]
    trimmed = any(r.verified is not None and not r.verified.all() for r in verifier.replies)
    if name.startswith("chain cut") or name in ("depth <= 0", "depth <= 1", "depth <= 2"):
        assert trimmed and verifier.echo_matches > 0  # a trimmed row matched its parent's sample: not entered
    if name == "depth <= 0":
        assert res.rounds == MAX_NEW and res.accepted == [0] * MAX_NEW  # the root alone: the bonus each round


def test_a_chain_trimmed_after_depth_one_commits_one_path_row_then_the_bonus():
    rt, verifier = runtime(), PartialVerifier(cut_chain_after(1))
    res = rt.generate(verifier, PROMPT, mode="hyco", max_new_tokens=MAX_NEW)
    later = verifier.replies[1]  # round 1 has the MTP chain in rows 1, 2, 3
    tree = verifier.trees[1]
    assert first_child_chain(tree.parents)[:3] == [1, 2, 3]
    assert later.verified[[0, 1]].all() and not later.verified[[2, 3]].any()
    assert later.path_rows.tolist() == [1] and later.bonus == tree.tokens[2]  # row 2's token, as the bonus
    assert rt.commits[1] == [rt.built[1].row_node[1]]
    assert res.accepted[1] == 1


def test_the_walk_never_enters_a_row_left_unverified():
    tokens, parents = [5, 6, 7, 6], [-1, 0, 1, 0]
    samples = [6, 7, 0, 6]  # rows 1 and 3 carry the root's sample 6
    assert walk_reply(tokens, parents, samples) == [1, 2]
    assert walk_reply(tokens, parents, samples, [True, False, False, True]) == [3]
    assert walk_reply(tokens, parents, samples, [True, True, False, False]) == [1]
    assert walk_reply(tokens, parents, samples, [True, False, False, False]) == []


def all_but(rows):
    verified = np.ones(ROWS, bool)
    verified[list(rows)] = False
    return verified


def parent_of_deepest(tree) -> int:
    return int(tree.parents[int(np.argmax(depths(tree.parents)))])


def below(tree, row) -> list[int]:
    """``row`` and every row under it."""
    out = [row]
    for j in range(row + 1, ROWS):
        if tree.parents[j] in out:
            out.append(j)
    return out


@pytest.mark.parametrize(
    "tamper, message",
    [
        (
            lambda r, tree: replace(r, verified=all_but([0])),
            "verified rows leave out row 0: the root is always verified",
        ),
        (
            lambda r, tree: (
                replace(r, verified=all_but([parent_of_deepest(tree)])) if depths(tree.parents).max() > 1 else r
            ),
            "verified rows are not ancestor-closed: row {orphan} is verified, its parent row {parent} is not",
        ),
        (
            lambda r, tree: replace(r, verified=np.ones(ROWS - 1, bool)),
            "verified rows: expected bool (7,), one per row sent, got dtype bool and shape (6,)",
        ),
        (
            lambda r, tree: replace(r, verified=all_but(below(tree, int(r.path_rows[-1])))) if len(r.path_rows) else r,
            "path row {last} is not a verified row",
        ),
    ],
)
def test_an_inconsistent_verified_set_is_refused(tamper, message):
    verifier = PartialVerifier(lambda tokens, parents: None)
    verifier.tamper = lambda reply: tamper(reply, verifier.tree)
    seen = []

    def remember(tree):
        verifier.tree = wire.decode(wire.encode(tree))
        seen.append(verifier.tree)
        return PartialVerifier.round(verifier, tree)

    verifier.round = remember
    with pytest.raises(RuntimeProtocolError) as e:
        runtime().generate(verifier, PROMPT, mode="hyco", max_new_tokens=MAX_NEW)
    tree, reply = seen[-1], verifier.replies[-1]
    parent = parent_of_deepest(tree)
    orphan = min(j for j in range(1, ROWS) if tree.parents[j] == parent)
    last = int(reply.path_rows[-1]) if len(reply.path_rows) else None
    want = message.format(orphan=orphan, parent=parent, last=last)
    assert str(e.value) == f"round {len(seen) - 1}: the verifier's reply is inconsistent: {want}"


def test_built_tree_scores_follow_the_rows_and_padding():
    from hycoc.runtime.tree_builder import DraftTreeNodes
    from test_runtime_tree import FakeSlm, L, builder

    built = builder(budget=4, rows=7).build(100, [11, 12], [13], FakeSlm())
    n = len(built.kept)
    want = [built.tree.nodes[v].score for v in built.kept]
    assert built.scores.dtype == np.float32 and built.scores.shape == (7,)
    np.testing.assert_array_equal(built.scores, np.float32(want + [want[-1]] * (7 - n)))  # padding repeats
    np.testing.assert_allclose(built.scores[:4] / L, [0, 1, 2, 2], rtol=1e-6)  # root, chain, sibling
    # a score of -inf (q underflowed) or below fp16's range travels as the floor, order kept
    tree = DraftTreeNodes()
    tree.add(5, -1, 0.0, "root")
    tree.add(6, 0, -1e6, "slm")
    tree.add(7, 1, -np.inf, "slm")
    scores = builder(budget=2, rows=4).scores_of(tree, [0, 1, 2])
    assert scores.tolist() == [0.0, wire.FP16_SCORE_FLOOR, wire.FP16_SCORE_FLOOR, wire.FP16_SCORE_FLOOR]
    wire.validate(DraftTree(0, np.array([5, 6, 7, 7], np.int32), np.array([-1, 0, 1, 1], np.int32), scores))
