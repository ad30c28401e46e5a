"""Protocol versions on the verifier server: a connection speaks the version of its OPEN frame (3 or 4) and gets
every answer in it; a frame in another version is refused with ``unsupported_version`` (docs/design.md "Wire protocol";
`hycoc.verifier.server.session_loop` "Versions").

The server runs the serial path (one session per forward) and the batched one (the scheduler's steps); both reply
encoders take the session's version. A version-3 client here writes its frames by hand with
``wire.encode(msg, version=3)``, as an old device would.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from hycoc.protocol import wire
from hycoc.protocol.messages import Close, DraftTree, ErrorReply, Opened
from hycoc.verifier.server import ServerThread
from test_server import (MAX_FRAME, ROWS, Raw, assert_same_reply, make_engine, models, oracle_tree,  # noqa: F401
                         open_request, reference, reference_session, round_frame, wait_for)

torch.set_num_threads(1)


@pytest.fixture(scope="module", params=["serial", "batched"])
def server(models, request):
    engine = make_engine(*models)
    with ServerThread(engine, tree_rows=ROWS, max_frame_bytes=MAX_FRAME, batching=request.param) as srv:
        yield srv
    engine.close()


def depth_scores(parents) -> np.ndarray:
    """Alg. 3-like scores: ln 0.66 per edge (each row its parent's plus ln λ)."""
    s = np.zeros(len(parents), np.float32)
    for j in range(1, len(parents)):
        s[j] = s[parents[j]] + np.float32(np.log(0.66))
    return s


def answer(raw: Raw, frame: bytes, version: int):
    data = raw.send(frame)
    assert wire.frame_version(data) == version
    return wire.decode(data, wire.Limits(max_frame_bytes=MAX_FRAME)), data


@pytest.mark.parametrize("version", [3, 4])
def test_a_client_gets_every_answer_in_its_open_frames_version(server, reference, version):
    raw = Raw(server.url, token=None)
    req = open_request(range(20, 30), seed=11 + version)
    opened, _ = answer(raw, wire.encode(req, version=version), version)
    assert isinstance(opened, Opened)
    assert server.server.sessions[opened.session_id].wire_version == version   # the engine session carries it
    ref = reference_session(reference, req)
    for seq in range(3):
        tokens, parents = oracle_tree(reference.model, ref.tokens)
        tree = DraftTree(seq, tokens, parents, depth_scores(parents))   # a v3 frame drops the scores
        got, data = answer(raw, wire.encode(tree, version=version), version)
        want = ref.verify(tokens, parents, seq)
        assert_same_reply(got, want)
        assert got.verified is None                                       # nothing trimmed (fixed tree budget)
        assert data == wire.encode(replace(want, server_ms=got.server_ms), version=version)   # byte for byte
        h = want.handoff
        handoff = wire.handoff_nbytes(h.x_hat.size // 2, h.k_sliding.shape[1], h.k_full.shape[1], h.n_positions)
        assert len(data) == wire.reply_nbytes(ROWS, len(want.path_rows), 0, handoff, version=version)
    # a frame in the other version: refused, answered in the session's version, and the session goes on
    other = 7 - version
    tokens, parents = oracle_tree(reference.model, ref.tokens)
    err, _ = answer(raw, wire.encode(DraftTree(3, tokens, parents), version=other), version)
    assert isinstance(err, ErrorReply) and err.code == "unsupported_version"
    assert err.message == (f"frame speaks protocol version {other}: this session opened with version {version}, "
                           "and every frame of a session speaks its OPEN's version")
    got, _ = answer(raw, wire.encode(DraftTree(3, tokens, parents), version=version), version)
    assert_same_reply(got, ref.verify(tokens, parents, 3))
    raw.ws.send(wire.encode(Close(opened.session_id), version=version))
    assert wait_for(lambda: opened.session_id not in server.server.sessions)
    raw.close()


def test_errors_before_an_open_answer_in_the_frames_version(server):
    raw = Raw(server.url, token=None)
    tokens, chain = np.arange(10, 10 + ROWS), np.arange(-1, ROWS - 1)
    err, _ = answer(raw, round_frame(0, tokens, chain, version=3), 3)
    assert err.code == "not_opened"
    err, _ = answer(raw, round_frame(0, tokens, chain, version=2), wire.PROTOCOL_VERSION)   # not one it speaks
    assert err.code == "unsupported_version" and "versions 3, 4" in err.message
    # a refused OPEN (prompt outside the vocabulary) answers in the OPEN's version; a later OPEN may pick another
    err, _ = answer(raw, wire.encode(open_request([10, 10**6]), version=3), 3)
    assert err.code == "token_out_of_vocab"
    opened, _ = answer(raw, wire.encode(open_request(range(20, 30))), 4)
    assert isinstance(opened, Opened)
    raw.close()
