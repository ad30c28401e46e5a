"""Protocol versions on the verifier server: version 5 is the only one spoken (`wire.SUPPORTED_VERSIONS`); a client
that speaks it gets every answer in it, byte for byte what the codec writes; a version-3 or -4 client, whose frames
are written here by hand in their own layouts, is refused at its first frame with ``unsupported_version`` whose
message names the fix (`wire.OLD_VERSION_FIX`), and a frame in another version inside a session is refused the same
way while the session goes on (docs/design.md "Wire protocol"; `hycoc.verifier.server.session_loop` "Versions").

The server runs the serial path (one session per forward) and the batched one (the scheduler's steps); both reply
encoders take the session's version.
"""

from __future__ import annotations

import struct
from dataclasses import replace

import numpy as np
import pytest
import torch
from hycoc.verifier.server import ServerThread
from test_server import (
    MAX_FRAME,
    ROWS,
    Raw,
    assert_same_reply,
    frame,
    make_engine,
    models,  # noqa: F401  (a pytest fixture, requested by name)
    open_request,
    oracle_tree,
    reference,  # noqa: F401  (a pytest fixture, requested by name)
    reference_session,
    round_frame,
    wait_for,
)

from hycoc.protocol import wire
from hycoc.protocol.messages import Close, DraftTree, ErrorReply, Opened

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


def answer(raw: Raw, frame: bytes, version: int = wire.PROTOCOL_VERSION):
    """Send a frame, decode the answer. A refusal of an older frame comes in that frame's version (an old device
    can read it): its header is checked, then it is decoded as the current version (ERROR's layout is the same)."""
    data = raw.send(frame)
    sent = struct.unpack_from("<H", frame, 4)[0]
    if sent in wire.LEGACY_ERROR_VERSIONS and version == sent:
        current = struct.pack("<H", wire.PROTOCOL_VERSION)
        assert wire.frame_version(bytes(data[:4]) + current + bytes(data[6:])) == wire.PROTOCOL_VERSION
        assert struct.unpack_from("<H", data, 4)[0] == sent
        data = bytes(data[:4]) + current + bytes(data[6:])
    else:
        assert wire.frame_version(data) == version
    return wire.decode(data, wire.Limits(max_frame_bytes=MAX_FRAME)), data


def old_open(prompt, version: int, seed: int = 5) -> bytes:
    """A version-3/4 OPEN written by hand: the 38-byte fixed part of those versions (no anchor: f32 temperature,
    u32 top_k, f32 top_p, u64 seed, f32 epsilon, u8 acceptance, u8 draft_place, u16 auth_len, u16 chat_len,
    u32 max_new_tokens, u32 T), then i32[T]; the same request as `open_request(prompt, seed=seed)`."""
    prompt = np.asarray(prompt, "<i4")
    fixed = struct.pack("<fIfQfBBHHII", 1.0, 64, 0.95, seed, 0.02, 1, 0, 0, 0, 200, prompt.size)
    assert len(fixed) == 38
    return frame(wire.MessageType.OPEN, fixed + prompt.tobytes(), version=version)


def old_append(tokens, version: int) -> bytes:
    """A version-3/4 APPEND written by hand: u32 max_new_tokens, u32 T, i32[T] (no keep, keep_crc, anchor)."""
    tokens = np.asarray(tokens, "<i4")
    return frame(wire.MessageType.APPEND, struct.pack("<II", 16, tokens.size) + tokens.tobytes(), version=version)


def refused_as_old(err: ErrorReply, version: int) -> None:
    assert isinstance(err, ErrorReply) and err.code == "unsupported_version", err
    assert err.message == (
        f"frame speaks protocol version {version}: this side speaks version(s) 6; " + wire.OLD_VERSION_FIX
    )


def test_a_version_6_client_gets_every_answer_in_version_6(server, reference):
    raw = Raw(server.url, token=None)
    req = open_request(range(20, 30), seed=11)
    opened, _ = answer(raw, wire.encode(req))
    assert isinstance(opened, Opened)
    assert server.server.sessions[opened.session_id].wire_version == 6  # the engine session carries it
    ref = reference_session(reference, req)
    for seq in range(3):
        tokens, parents = oracle_tree(reference.model, ref.tokens)
        tree = DraftTree(seq, tokens, parents, depth_scores(parents))
        got, data = answer(raw, wire.encode(tree))
        want = ref.verify(tokens, parents, seq)
        assert_same_reply(got, want)
        assert got.verified is None  # nothing trimmed (fixed tree budget)
        assert got.allowance == ROWS  # one session: the whole tree (the reference engine grants nothing)
        assert data == wire.encode(replace(want, server_ms=got.server_ms, allowance=ROWS))  # byte for byte
        h = want.handoff
        handoff = wire.handoff_nbytes(h.x_hat.size // 2, h.k_sliding.shape[1], h.k_full.shape[1], h.n_positions)
        assert len(data) == wire.reply_nbytes(ROWS, len(want.path_rows), 0, handoff)
    # the same round in a version-4 or -5 header (their ROUND layout is version 6's): refused, the session goes on
    tokens, parents = oracle_tree(reference.model, ref.tokens)
    for old in (4, 5):
        err, _ = answer(raw, round_frame(3, tokens, parents, version=old))  # answered in the session's version
        refused_as_old(err, old)
    got, _ = answer(raw, round_frame(3, tokens, parents))
    assert_same_reply(got, ref.verify(tokens, parents, 3))
    raw.ws.send(wire.encode(Close(opened.session_id)))
    assert wait_for(lambda: opened.session_id not in server.server.sessions)
    raw.close()


@pytest.mark.parametrize("version", [3, 4, 5])
def test_a_version_3_or_4_client_is_refused_at_its_open_naming_the_fix(server, version):
    """An old device's OPEN, byte for byte as it writes it, opens nothing: ERROR unsupported_version naming the fix;
    its rounds and appends get the same answer (never not_opened: the header is read first); the connection stays
    usable for a version-5 OPEN."""
    sessions = server.server.metrics.sessions_total
    raw = Raw(server.url, token=None)
    tokens, chain = np.arange(10, 10 + ROWS), np.arange(-1, ROWS - 1)
    for bad in (
        old_open(range(20, 30), version),
        round_frame(0, tokens, chain, version=version),
        old_append([5, 6], version),
    ):
        err, _ = answer(raw, bad, version)  # answered in the old version: the device reads it
        refused_as_old(err, version)
    assert server.server.metrics.sessions_total == sessions and not server.server.sessions
    opened, _ = answer(raw, wire.encode(open_request(range(20, 30))))
    assert isinstance(opened, Opened)
    raw.close()


def test_an_old_client_can_read_its_refusal(server):
    raw = Raw(server.url, token=None)
    data = raw.send(old_open(range(20, 30), 4))
    raw.close()
    assert struct.unpack_from("<H", data, 4) == (4,)  # a header the version-4 device accepts


def test_errors_before_an_open_answer_in_version_6(server):
    raw = Raw(server.url, token=None)
    tokens, chain = np.arange(10, 10 + ROWS), np.arange(-1, ROWS - 1)
    err, _ = answer(raw, round_frame(0, tokens, chain))
    assert err.code == "not_opened"
    err, _ = answer(raw, round_frame(0, tokens, chain, version=2))  # not one it speaks
    refused_as_old(err, 2)
    err, _ = answer(raw, round_frame(0, tokens, chain, version=7))  # nor a newer one
    assert err.code == "unsupported_version" and "protocol version 7: this side speaks version(s) 6" in err.message
    # a refused OPEN (prompt outside the vocabulary) answers in version 6; a later OPEN opens
    err, _ = answer(raw, wire.encode(open_request([10, 10**6])))
    assert err.code == "token_out_of_vocab"
    opened, _ = answer(raw, wire.encode(open_request(range(20, 30))))
    assert isinstance(opened, Opened)
    raw.close()
