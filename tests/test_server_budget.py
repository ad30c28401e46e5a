"""The row budget on the server (`[verifier] tree_budget = "auto"`): rounds that share a batched forward are
trimmed by their scores, each reply names its verified rows, a protocol-3 client's tree is never trimmed, a
session alone is never trimmed, and /metrics counts what was left out.

Three clients send every round at once; with ``max_batch_wait_ms`` long and all open sessions queued the
scheduler takes them into one forward, deterministically. References: the same session on a second engine sent
only the verified rows (T = 0: every committed token and sample equal).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hycoc.verifier.row_budget import RowCost, is_ancestor_closed
from hycoc.verifier.server import ServerThread
from hycoc.verifier.tree_rows import remap_parents
from test_server import (
    MAX_FRAME,
    Raw,
    http_get,
    make_engine,
    models,  # noqa: F401  (a pytest fixture: requested by name)
    open_request,
    parse_metrics,
    wait_for,
)
from tiny_models import tiny_head, tiny_verifier

from hycoc.protocol import wire
from hycoc.protocol.messages import DraftTree, Opened, Sampling

torch.set_num_threads(1)
ROWS = 9
LN = float(np.log(0.66))
#: Rows cost as much as the forward's fixed part: a step of three 9-row trees is trimmed.
STEEP = RowCost(((1, 1.0), (100, 100.0)), source="test")


@torch.inference_mode()
def scored_tree(model, tokens, rows=ROWS):
    """The verifier's greedy chain of 4 with a runner-up at each level (9 rows), Alg. 3-like scores."""
    tokens = list(tokens)
    tree, parents, scores, parent = [tokens[-1]], [-1], [0.0], 0
    while len(tree) < rows:
        top = model(input_ids=torch.tensor([tokens])).logits[0, -1].topk(2).indices.tolist()
        first = len(tree)
        for i, tok in enumerate(top[: rows - len(tree)]):
            tree.append(tok)
            parents.append(parent)
            scores.append(scores[parent] + (LN if i == 0 else 2 * LN))
        parent = first
        tokens.append(top[0])
    return np.array(tree, np.int32), np.array(parents, np.int32), np.array(scores, np.float32)


def test_rounds_sharing_a_forward_are_trimmed_and_replies_name_their_rows(models):
    engine = make_engine(*models)
    ref_engine = make_engine(*models)
    greedy = dict(sampling=Sampling(0.0, 1, 1.0), acceptance="exact")
    with ServerThread(
        engine,
        tree_rows=ROWS,
        max_frame_bytes=MAX_FRAME,
        batching="batched",
        tree_budget="auto",
        row_cost=STEEP,
        max_batch_wait_ms=5000.0,
    ) as srv:
        health = http_get(srv.http_url + "/healthz")[1]
        assert '"tree_budget": "auto"' in health and '"free_rows": 9' in health
        # "old": a client that sends its trees without scores (as Cloud+MTP and scoreless drafters do)
        prompts = {"a": [20, 21, 22], "b": [30, 31, 32, 33], "old": [40, 41]}
        raws, refs = {}, {}
        for name, prompt in prompts.items():
            raws[name] = Raw(srv.url, token=None)
            req = open_request(prompt, max_new_tokens=40, **greedy)
            opened = wire.decode(raws[name].send(wire.encode(req)))
            assert isinstance(opened, Opened)
            refs[name] = ref_engine.open(
                req.prompt_ids, req.sampling, req.seed, req.acceptance, req.epsilon, req.draft_place, req.max_new_tokens
            )
            refs[name].prefill()
        before = parse_metrics(http_get(srv.http_url + "/metrics")[1])[0]
        trimmed_rounds = 0
        for seq in range(3):
            trees = {n: scored_tree(engine.model, refs[n].tokens) for n in prompts}
            replies = {}

            def send(name):
                t, p, s = trees[name]
                data = raws[name].send(wire.encode(DraftTree(seq, t, p, None if name == "old" else s)))
                assert wire.frame_version(data) == wire.PROTOCOL_VERSION
                replies[name] = wire.decode(data)

            threads = [threading.Thread(target=send, args=(n,)) for n in prompts]
            for th in threads:
                th.start()
            for th in threads:
                th.join(60)
            for name, reply in replies.items():
                t, p, _ = trees[name]
                if name == "old":
                    assert reply.verified is None  # a tree without scores: kept whole
                    kept = np.arange(ROWS)
                else:
                    assert reply.verified is not None and reply.verified.sum() < ROWS
                    kept = np.nonzero(reply.verified)[0]
                    trimmed_rounds += 1
                assert is_ancestor_closed(p, kept) and set(reply.path_rows.tolist()) <= set(kept.tolist())
                want = refs[name].verify(t[kept], remap_parents(p.astype(np.int64), kept), seq)
                assert reply.samples[kept].tolist() == want.samples.tolist() and reply.bonus == want.bonus
                assert kept[want.path_rows].tolist() == reply.path_rows.tolist()
        assert trimmed_rounds == 6
        after, _ = parse_metrics(http_get(srv.http_url + "/metrics")[1])
        trimmed = after["hycoc_rows_trimmed_total"] - before["hycoc_rows_trimmed_total"]
        kept_rows = after["hycoc_rows_kept_per_session_sum"] - before.get("hycoc_rows_kept_per_session_sum", 0)
        assert trimmed > 0 and kept_rows + trimmed == 3 * 3 * ROWS
        assert (
            after["hycoc_expected_tokens_per_forward_count"] - before.get("hycoc_expected_tokens_per_forward_count", 0)
            == 3
        )
        # a session alone in its forward is verified as sent
        for name in ("b", "old"):
            raws[name].close()
        assert wait_for(lambda: len(srv.server.sessions) == 1)
        t, p, s = scored_tree(engine.model, refs["a"].tokens)
        alone = wire.decode(raws["a"].send(wire.encode(DraftTree(3, t, p, s))))
        assert alone.verified is None
        want = refs["a"].verify(t, p, 3)
        assert alone.samples.tolist() == want.samples.tolist()
        raws["a"].close()
    engine.close()
    ref_engine.close()


def test_tree_budget_auto_needs_batching():
    model = tiny_verifier(sharpen=3.0)
    engine = make_engine(model, tiny_head(model))
    with pytest.raises(ValueError, match="needs batching = 'batched'"):
        ServerThread(engine, tree_rows=ROWS, batching="serial", tree_budget="auto", row_cost=STEEP)
    with pytest.raises(ValueError, match="tree_budget = 'some'"):
        ServerThread(engine, tree_rows=ROWS, tree_budget="some")
    engine.close()
