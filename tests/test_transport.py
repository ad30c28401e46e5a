"""The device's transport (runtime/transport.py) against scripted WebSocket peers: no torch, no verifier.

A `FakeVerifier` answers frames the way a test tells it to (canned OPENED / REPLY frames, an error frame, another
protocol version, a dropped connection, silence, an HTTP 401), so every failure path of `VerifierClient` is hit
with the exact bytes that cause it. The real server is exercised in test_server.py.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import zlib
from dataclasses import replace

import numpy as np
import pytest
from conftest import modules_loaded_by_import
from hycoc.runtime.transport import (
    LINK_PRESETS,
    AuthRefused,
    BadReply,
    ConnectionDropped,
    LinkModel,
    ProtocolMismatch,
    RequestTimeout,
    ServerError,
    ServerUnreachable,
    VerifierClient,
    parse_link,
)
from websockets.datastructures import Headers
from websockets.sync.server import serve

from hycoc.chat import ids_crc32
from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, DraftTree, ErrorReply, HandOff, Opened, OpenRequest, RoundReply

OPENED = Opened(
    session_id=7,
    t=4,
    prefill_ms=1.5,
    max_context=64,
    tree_rows=3,
    vocab_size=100,
    hidden_size=4,
    kv_dim_sliding=2,
    kv_dim_full=2,
)
PROMPT = np.array([5, 6, 7, 8, 9], dtype=np.int32)
TREE = DraftTree(seq=0, tokens=np.array([9, 10, 11], np.int32), parents=np.array([-1, 0, 1], np.int32))


def handoff(t_prime: int, a: int, bonus: int) -> HandOff:
    n = t_prime - a
    return HandOff(
        t_prime=t_prime,
        a=a,
        bonus=bonus,
        x_hat=np.arange(8, dtype=np.int8),
        k_sliding=np.ones((n, 2), np.int8),
        v_sliding=np.full((n, 2), 2, np.int8),
        k_full=np.full((n, 2), 3, np.int8),
        v_full=np.full((n, 2), 4, np.int8),
        scales=(0.1, 0.1, 0.05, 0.05, 0.05, 0.05),
    )


#: Round 0 accepts row 1 (token 10); the bonus 12 is sampled at row 1; hand-off rows [0, 6) (first round: from 0).
REPLY = RoundReply(
    seq=0,
    samples=np.array([10, 12, 13], np.int32),
    path_rows=np.array([1], np.int32),
    bonus=12,
    server_ms=2.25,
    handoff=handoff(6, 0, 12),
    allowance=3,
)


class FakeVerifier:
    """A scripted peer: ``answer(frame) -> bytes | None`` for each received frame (None: close the connection;
    the string "silent": never answer). Records the frames and the upgrade's headers."""

    def __init__(self, answer=None, process_request=None):
        self.answer = answer or self.protocol
        self.frames: list[bytes] = []
        self.headers: list[Headers] = []
        self._server = serve(self._handle, "127.0.0.1", 0, compression=None, process_request=process_request)
        self.url = f"ws://127.0.0.1:{self._server.socket.getsockname()[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @staticmethod
    def protocol(frame: bytes) -> bytes:
        msg = wire.decode(frame)
        return wire.encode(OPENED if isinstance(msg, OpenRequest) else REPLY)

    def _handle(self, ws) -> None:
        self.headers.append(ws.request.headers)
        for frame in ws:
            self.frames.append(frame)
            out = self.answer(frame)
            if out is None:
                return  # the handler returning closes the connection
            if out == "silent":
                continue
            ws.send(out)

    def __enter__(self) -> FakeVerifier:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._thread.join(5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------------------------------------ link model


def test_link_presets_and_parsing():
    assert LINK_PRESETS["lte"] == LinkModel(rtt_ms=58.0, mbps=20.0)
    assert LINK_PRESETS["5g"] == LinkModel(rtt_ms=40.0, mbps=50.0)
    assert parse_link("lte") is LINK_PRESETS["lte"] and parse_link("5g") is LINK_PRESETS["5g"]
    assert parse_link("none") is None
    assert parse_link("45:50") == LinkModel(45.0, 50.0)
    assert parse_link("12.5:0.5") == LinkModel(12.5, 0.5)
    # 220 B (a B = 32 tree) on LTE: 29 ms + 220 * 8 / 20e6 s = 29.088 ms.
    assert LINK_PRESETS["lte"].one_way_s(220) == pytest.approx(0.029088, abs=1e-12)
    for bad in ("wifi", "45", "45:0", "-1:5", "45:50:1", "", "LTE"):
        with pytest.raises(ValueError, match="allowed: lte, 5g, none or RTT_MS:MBPS"):
            parse_link(bad)
    with pytest.raises(ValueError):
        LinkModel(rtt_ms=10, mbps=0)


def test_link_model_sleeps_half_the_rtt_plus_serialization_each_way():
    link = LinkModel(rtt_ms=40.0, mbps=8.0)  # 8 Mbit/s: 1 us per byte
    sleeps: list[float] = []
    request = OpenRequest(prompt_ids=PROMPT, auth_token="tok")
    with FakeVerifier() as peer, VerifierClient(peer.url, auth_token="tok", link=link, sleep=sleeps.append) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
        reply = c.round(TREE)
    up_open = len(wire.encode(request))  # 16 + 50 + 4 * 5 + 3 = 89
    assert up_open == wire.open_nbytes(len(PROMPT), len("tok"))
    down_open = 16 + 42 + 4 * len(OPENED.stop_ids)
    up_round = wire.tree_nbytes(3, scores=False)  # 23 + 6 * 3 = 41 (TREE has no scores)
    down_round = wire.reply_nbytes(3, 1, 0, wire.handoff_nbytes(4, 2, 2, 6))  # 39 + 14 + 12 + 44 + 8 + 48
    assert (up_open, down_open, up_round, down_round) == (89, 62, 41, 165)
    assert sleeps == pytest.approx([0.020 + n * 1e-6 for n in (up_open, down_open, up_round, down_round)], abs=1e-12)
    assert c.link_s == pytest.approx(sum(sleeps))
    assert (c.last_up, c.last_down) == (up_round, down_round)
    assert c.round_bytes == [(up_round, down_round)]
    assert c.bytes_up == up_open + up_round + 24 and c.bytes_down == down_open + down_round  # + CLOSE (16 + 8)
    assert reply.bonus == 12 and reply.handoff.n_positions == 6


def test_no_link_means_no_sleep():
    sleeps: list[float] = []
    with FakeVerifier() as peer, VerifierClient(peer.url, sleep=sleeps.append) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
        c.round(TREE)
    assert sleeps == [] and c.link_s == 0.0


# ------------------------------------------------------------------------------------------------ protocol


def test_open_round_close_frames_and_auth_travel_as_specified():
    with FakeVerifier() as peer:
        with VerifierClient(peer.url, auth_token="s3cret") as c:
            opened = c.open(OpenRequest(prompt_ids=PROMPT, seed=3))
            reply = c.round(TREE)
        assert opened == OPENED
        np.testing.assert_array_equal(reply.samples, REPLY.samples)
        np.testing.assert_array_equal(reply.handoff.k_full, REPLY.handoff.k_full)
        assert peer.headers[0]["Authorization"] == "Bearer s3cret"
        # the CLOSE frame is sent as the client exits; the peer's thread records it a moment later
        deadline = time.monotonic() + 5
        while len(peer.frames) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        sent = [wire.decode(f) for f in peer.frames]
        assert [type(m).__name__ for m in sent] == ["OpenRequest", "DraftTree", "Close"]
        assert sent[0].auth_token == "s3cret" and sent[0].seed == 3
        assert sent[2].session_id == 7


def test_rounds_travel_in_version_6_with_scores_and_verified_rows():
    kept = np.array([True, True, False])  # the verifier verified rows 0 and 1 (row 2 trimmed)

    def answer(frame):
        msg = wire.decode(frame)
        if isinstance(msg, OpenRequest):
            return wire.encode(OPENED)
        return wire.encode(replace(REPLY, samples=np.array([10, 12, 11], np.int32), verified=kept))

    scored = replace(TREE, scores=np.array([0.0, -0.5, -1.25], np.float32))
    with FakeVerifier(answer) as peer, VerifierClient(peer.url) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
        reply = c.round(scored)
        assert c.last_up == wire.tree_nbytes(3) == 23 + 8 * 3
        assert c.last_down == wire.reply_nbytes(3, 1, 0, wire.handoff_nbytes(4, 2, 2, 6), verified=True) == 166
    assert [wire.frame_version(f) for f in peer.frames[:2]] == [6, 6]
    sent = wire.decode(peer.frames[1])
    assert sent.scores.tolist() == [0.0, -0.5, -1.25]
    assert reply.verified.tolist() == [True, True, False]


def test_an_appended_turn_travels_with_keep_crc_and_anchor():
    """After a finished reply the client sends APPEND (u32 max_new_tokens, keep, keep_crc, anchor, T; i32[T], built
    here with struct) and takes the OPENED; a conversation_mismatch ERROR is a ServerError and the session stays."""
    finished = replace(REPLY, finished=True, finish_reason="stop")
    held = [*PROMPT.tolist(), 10, 12]  # the prompt, then round 0's path token and bonus
    keep, turn, anchor = 6, np.array([30, 31, 32], np.int32), 7
    crc = zlib.crc32(np.array(held[:keep], "<i4").tobytes())

    def answer(frame):
        msg = wire.decode(frame)
        if isinstance(msg, OpenRequest):
            return wire.encode(OPENED)
        if isinstance(msg, DraftTree):
            return wire.encode(finished)
        if msg.keep_crc != crc:
            return wire.encode(ErrorReply("conversation_mismatch", "the kept 6 ids differ from the session's"))
        return wire.encode(replace(OPENED, t=keep + len(turn) - 1, prefill_ms=0.5))

    with FakeVerifier(answer) as peer, VerifierClient(peer.url) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
        assert c.round(TREE).finished
        with pytest.raises(ServerError) as e:
            c.append(AppendTurn(turn, 16, keep, crc ^ 1, anchor))
        assert e.value.code == "conversation_mismatch" and c.opened == OPENED
        opened = c.append(AppendTurn(turn, 16, keep, ids_crc32(held[:keep]), anchor))
        assert (opened.session_id, opened.t, opened.prefill_ms) == (OPENED.session_id, 8, 0.5)
        assert c.last_up == wire.append_nbytes(3) == 16 + 20 + 12
    want = struct.pack("<IIIII", 16, keep, crc, anchor, 3) + struct.pack("<3i", 30, 31, 32)
    assert peer.frames[3] == struct.pack("<4sHBBII", b"HYCO", 6, 7, 0, len(want), zlib.crc32(want)) + want


def test_no_token_sends_no_header():
    with FakeVerifier() as peer, VerifierClient(peer.url) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
    assert "Authorization" not in peer.headers[0]
    assert wire.decode(peer.frames[0]).auth_token is None


# ------------------------------------------------------------------------------------------------ failures


def test_unreachable_server():
    port = free_port()
    with pytest.raises(ServerUnreachable) as e:
        VerifierClient(f"ws://127.0.0.1:{port}", timeout_s=5).open(OpenRequest(prompt_ids=PROMPT))
    assert str(e.value).startswith(f"cannot reach the verifier at ws://127.0.0.1:{port}: ")
    assert str(e.value).endswith("; is a verifier running there? start one with `hycoc verify-server RECIPE --port N`")
    assert "\n" not in str(e.value)
    with pytest.raises(ServerUnreachable, match="is not a WebSocket URL"):
        VerifierClient("http://127.0.0.1:1").connect()


def test_http_status_refusals():
    def deny(connection, request):
        return connection.respond(401, "no\n")

    def missing(connection, request):
        return connection.respond(404, "no\n")

    with FakeVerifier(process_request=deny) as peer:
        with pytest.raises(AuthRefused, match=r"refused the connection \(HTTP 401\)"):
            VerifierClient(peer.url).connect()
    with FakeVerifier(process_request=missing) as peer:
        with pytest.raises(ServerUnreachable, match="answered HTTP 404, not a WebSocket"):
            VerifierClient(peer.url).connect()


@pytest.mark.parametrize("code", ["auth_required", "auth_refused"])
def test_auth_error_frames_become_auth_refused(code):
    def answer(frame):
        return wire.encode(ErrorReply(code, "the auth token does not match"))

    with FakeVerifier(answer) as peer:
        c = VerifierClient(peer.url, auth_token="wrong")
        with pytest.raises(AuthRefused) as e:
            c.open(OpenRequest(prompt_ids=PROMPT))
    assert str(e.value) == f"the verifier at {peer.url} refused the session: {code}: the auth token does not match"
    assert c.opened is None


def test_server_error_frame_keeps_its_code_and_the_session():
    def answer(frame):
        msg = wire.decode(frame)
        if isinstance(msg, OpenRequest):
            return wire.encode(OPENED)
        if msg.seq == 0:
            return wire.encode(
                ErrorReply("bad_parent", "DraftTree.parents[2] = 5: row 2's parent must be an earlier row, in [0, 2)")
            )
        return wire.encode(
            RoundReply(
                seq=1,
                samples=np.array([9, 1, 2], np.int32),
                path_rows=np.zeros(0, np.int32),
                bonus=9,
                server_ms=1.0,
                allowance=3,
            )
        )

    with FakeVerifier(answer) as peer, VerifierClient(peer.url) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
        with pytest.raises(ServerError) as e:
            c.round(TREE)
        assert e.value.code == "bad_parent"
        assert str(e.value) == (
            "the verifier refused the round 0: bad_parent: DraftTree.parents[2] = 5: row 2's "
            "parent must be an earlier row, in [0, 2)"
        )
        assert c.round(DraftTree(1, TREE.tokens, TREE.parents)).bonus == 9  # the connection still serves


def test_protocol_version_mismatch():
    def header(version: int):
        def answer(frame):
            payload = wire.encode(OPENED)[16:]
            return struct.pack("<4sHBBII", b"HYCO", version, 2, 0, len(payload), zlib.crc32(payload)) + payload

        return answer

    # a newer server, and an old one (version 5: OPENED's layout is the same, the header says 5)
    for version in (7, 5):
        with FakeVerifier(header(version)) as peer:
            with pytest.raises(ProtocolMismatch) as e:
                VerifierClient(peer.url).open(OpenRequest(prompt_ids=PROMPT))
        assert str(e.value) == (
            f"the verifier at {peer.url} speaks another protocol: frame speaks protocol version "
            f"{version}: this side speaks version(s) 6; {wire.OLD_VERSION_FIX}"
        )
    # a server that refuses this client's version says so in an ERROR frame: its message is passed on
    told = f"frame speaks protocol version 5: this side speaks version(s) 6; {wire.OLD_VERSION_FIX}"
    with FakeVerifier(lambda frame: wire.encode(ErrorReply("unsupported_version", told))) as peer:
        with pytest.raises(ProtocolMismatch) as e:
            VerifierClient(peer.url).open(OpenRequest(prompt_ids=PROMPT))
    assert str(e.value) == f"the verifier at {peer.url} speaks another protocol: {told}"


def test_connection_dropped_mid_request():
    def drop_rounds(frame):
        return None if isinstance(wire.decode(frame), DraftTree) else wire.encode(OPENED)

    with FakeVerifier(drop_rounds) as peer:
        c = VerifierClient(peer.url)
        c.open(OpenRequest(prompt_ids=PROMPT))
        with pytest.raises(ConnectionDropped, match=rf"the connection to {peer.url} closed during the round 0 "):
            c.round(TREE)
    assert c.opened is None


def test_timeout_waiting_for_an_answer():
    with FakeVerifier(lambda frame: "silent") as peer:
        c = VerifierClient(peer.url, timeout_s=0.3)
        with pytest.raises(RequestTimeout, match=rf"no answer to the open request from {peer.url} within 0.3 s"):
            c.open(OpenRequest(prompt_ids=PROMPT))


def round_reply(seq: int, samples: list[int]) -> RoundReply:
    """A REPLY to round ``seq`` with these samples, no path, bonus 9, allowance 3."""
    return RoundReply(seq, np.array(samples, np.int32), np.zeros(0, np.int32), 9, 1.0, allowance=3)


@pytest.mark.parametrize(
    "reply,match",
    [
        (round_reply(5, [9, 1, 2]), "answered round 5 to round 0"),
        (round_reply(0, [9, 1, 200]), r"invalid: token_out_of_vocab: RoundReply.samples\[2\] = 200"),
        (round_reply(0, [9, 1, 2, 3]), "invalid: wrong_row_count"),
        (OPENED, "answered the round 0 with Opened, expected RoundReply"),
    ],
)
def test_replies_are_validated_against_the_session(reply, match):
    def answer(frame):
        return wire.encode(OPENED if isinstance(wire.decode(frame), OpenRequest) else reply)

    with FakeVerifier(answer) as peer, VerifierClient(peer.url) as c:
        c.open(OpenRequest(prompt_ids=PROMPT))
        with pytest.raises(BadReply, match=match):
            c.round(TREE)


def test_the_transport_imports_no_torch_aiohttp_or_verifier():
    banned = ("torch", "transformers", "aiohttp", "hycoc.verifier", "hycoc.recipe", "pydantic")
    assert modules_loaded_by_import("hycoc.runtime.transport", banned) == []
