"""The verifier server's limits (docs/design.md "Limits"; the table in docs/serving.md "Limits"): every limit refuses
with its code and counts in hycoc_refusals_total{kind}. Small limits (fractions of a second, a few connections) on the
tiny models.
"""

from __future__ import annotations

import socket
import struct
import time
import zlib
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import AuthRefused, ServerError, ServerUnreachable, VerifierClient
from hycoc.verifier import VerifierEngine
from hycoc.verifier.kv_cache import held_bytes, storage_bytes
from hycoc.verifier.server import ServerLimits, ServerThread, open_frame_bytes
from tiny_models import tiny_verifier
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from hycoc.protocol import wire
from hycoc.protocol.messages import DraftTree, ErrorReply, OpenRequest, Sampling

torch.set_num_threads(1)
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
ROWS = 7
MAX_CONTEXT = 128
TOKEN = "s3cret"
QUICK = dict(handshake_timeout_s=0.5, frame_timeout_s=0.5, idle_timeout_s=0.6, retry_after_s=2.0)


#: Prompt positions per prefill forward: smaller than max_context, so the KV reservation's prefill peak (retain + a
#: chunk's rows on the sliding layers) differs from max_context and from a round's rows.
CHUNK = 8


@pytest.fixture(scope="module")
def engine():
    eng = VerifierEngine(
        tiny_verifier(), head_window=6, handoff_scales=SCALES, max_context=MAX_CONTEXT, prefill_chunk=CHUNK
    )
    yield eng
    eng.close()


@contextmanager
def serving(engine, **limits):
    with ServerThread(engine, tree_rows=ROWS, auth_token=TOKEN, limits=ServerLimits(**limits)) as srv:
        yield srv


def request(n=10, max_new=200, token=TOKEN) -> OpenRequest:
    return OpenRequest(
        prompt_ids=np.arange(20, 20 + n, dtype=np.int32),
        sampling=Sampling(0.0, 64, 0.95),
        max_new_tokens=max_new,
        auth_token=token,
    )


def refusals(srv) -> dict:
    return dict(srv.server.metrics.refusals)


def tcp(srv) -> socket.socket:
    host, port = srv.url.removeprefix("ws://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """(whether the server closed the socket within ``seconds``, bytes it sent before)."""
    sock.settimeout(seconds)
    got = b""
    try:
        while chunk := sock.recv(65536):
            got += chunk
        return True, got
    except TimeoutError:
        return False, got
    except ConnectionResetError:
        return True, got


def upgrade(sock: socket.socket) -> None:
    sock.sendall(
        b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head


def ws_frame_header(length: int) -> bytes:
    """A client's binary WebSocket frame header announcing ``length`` payload bytes (masked, 64-bit length)."""
    return bytes([0x82, 0x80 | 127]) + struct.pack(">Q", length) + b"\x00\x00\x00\x00"


def wait_for(condition, seconds: float = 30.0, what: str = "the condition") -> None:
    """Poll ``condition()`` every 10 ms until it holds; fail after ``seconds`` (a deadline a loaded machine does not
    reach: the events themselves take milliseconds)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.01)


def metric(srv, series: str) -> float:
    from urllib.request import urlopen

    text = urlopen(srv.http_url + "/metrics", timeout=10).read().decode()
    return float(next(line.rsplit(" ", 1)[1] for line in text.splitlines() if line.startswith(series + " ")))


def largest_open(max_context: int, auth: str | None = None) -> OpenRequest:
    """The largest OPEN a client can send a verifier of ``max_context`` positions: a prompt of max_context - 1 ids,
    a 65,535-byte auth token and a 65,535-byte chat contract (both u16-counted, utf-8)."""
    chat = '{"pad":"x' + "é" * 32762 + '"}'  # 9 + 2 x 32,762 + 2 bytes
    auth = auth or "k" * 65535
    assert len(chat.encode("utf-8")) == 65535 == len(auth.encode("utf-8"))
    return OpenRequest(
        prompt_ids=np.arange(max_context - 1, dtype=np.int32) % 60 + 3, max_new_tokens=1, auth_token=auth, chat=chat
    )


@pytest.mark.parametrize("max_context", [2, 128, 4096])
def test_incoming_frames_are_bounded_by_the_largest_open_the_codec_writes(max_context):
    """open_frame_bytes is the length of the largest OPEN as `wire.encode` writes it (the codec is the reference,
    not a constant); an OPEN one prompt id longer is refused by the codec itself (context_overflow), and the largest
    APPEND (keep 1, max_context - 2 ids) and a CLOSE are smaller."""
    from hycoc.protocol.messages import AppendTurn, Close

    biggest = wire.encode(largest_open(max_context))
    assert len(biggest) == open_frame_bytes(max_context)
    assert wire.decode(biggest, wire.Limits(max_context=max_context, max_frame_bytes=len(biggest))).anchor == 0
    with pytest.raises(wire.FrameTooLarge):
        wire.decode(biggest, wire.Limits(max_context=max_context, max_frame_bytes=len(biggest) - 1))
    longer = largest_open(max_context + 1)
    with pytest.raises(wire.ContextOverflow):
        wire.validate(longer, wire.Limits(max_context=max_context))
    turn = AppendTurn(np.full(max_context - 2, 3, np.int32), 1, keep=1) if max_context > 2 else None
    if turn is not None:
        wire.validate(turn, wire.Limits(max_context=max_context))  # the largest APPEND that passes
        assert len(wire.encode(turn)) < len(biggest)
    assert len(wire.encode(Close(1))) < len(biggest)


def test_limits_are_checked_and_the_frame_bound_counts_the_chat_contract():
    with pytest.raises(ValueError, match="ServerLimits.max_sessions = 0"):
        ServerLimits(max_sessions=0)
    # 16 header + 42 fixed + 127 ids + 65,535 auth + 65,535 chat: the bound of issue 30 (36-byte OPEN, no contract)
    # was 16 + 36 + 508 + 65,535 = 66,095 bytes, which refused the largest valid OPEN as frame_too_large
    assert open_frame_bytes(128) == 16 + 50 + 4 * 127 + 65535 + 65535 == 131644


def test_the_largest_open_reaches_the_engine_and_one_byte_more_is_frame_too_large(engine):
    """End to end: a server whose auth token is 65,535 bytes long reads the largest OPEN (OPENED), and refuses the
    same frame with one byte more of payload from its header (frame_too_large naming the bound)."""
    req = largest_open(MAX_CONTEXT)
    data = wire.encode(req)
    with ServerThread(engine, tree_rows=ROWS, auth_token=req.auth_token, limits=ServerLimits(**QUICK)) as srv:
        ws = connect(srv.url, compression=None, proxy=None, legacy=True, max_size=2**24)
        ws.send(data)
        opened = wire.decode(ws.recv(timeout=30))
        assert not isinstance(opened, ErrorReply), opened  # issue 30: frame_too_large here
        assert opened.t == MAX_CONTEXT - 2
        ws.close()
        assert srv.server.in_frame_bytes == len(data) == open_frame_bytes(MAX_CONTEXT)
        payload = data[wire.HEADER.size :] + b"\0"
        over = (
            wire.HEADER.pack(
                wire.MAGIC, wire.PROTOCOL_VERSION, wire.MessageType.OPEN, 0, len(payload), zlib.crc32(payload)
            )
            + payload
        )
        ws = connect(srv.url, compression=None, proxy=None, legacy=True, max_size=2**24)
        ws.send(over)
        err = wire.decode(ws.recv(timeout=30))
        assert isinstance(err, ErrorReply) and err.code == "frame_too_large"
        assert (
            f"OPEN frame of {len(data) + 1} bytes: this receiver accepts at most max_frame_bytes = {len(data)}"
            in err.message
        )
        ws.close()


def test_silent_tcp_and_trickled_headers_are_closed_after_the_handshake_timeout(engine):
    with serving(engine, **QUICK) as srv:
        silent, trickle = tcp(srv), tcp(srv)
        t0 = time.monotonic()
        for byte in b"GET / HTTP/1.1\r\nHost: x\r\n":
            try:
                trickle.sendall(bytes([byte]))
            except OSError:
                break
            time.sleep(0.05)
        # a generous wait (a loaded machine cannot break it): without the timeout neither socket would ever close
        assert closed_within(silent, 30)[0] and closed_within(trickle, 30)[0]
        assert time.monotonic() - t0 > 0.45  # not before handshake_timeout_s = 0.5 s
        assert refusals(srv)["handshake_timeout"] == 2
        assert metric(srv, 'hycoc_refusals_total{kind="handshake_timeout"}') == 2


def test_an_upgraded_socket_without_open_gets_error_handshake_timeout(engine):
    with serving(engine, **QUICK) as srv:
        ws = connect(srv.url, compression=None, proxy=None, legacy=True)
        msg = wire.decode(ws.recv(timeout=5))
        assert isinstance(msg, ErrorReply) and msg.code == "handshake_timeout"
        ws.close()


def test_a_partial_frame_is_dropped_after_the_frame_timeout(engine):
    with serving(engine, **{**QUICK, "handshake_timeout_s": 30.0}) as srv:
        sock = tcp(srv)
        upgrade(sock)
        sock.sendall(ws_frame_header(1000) + b"x" * 999)  # all but the last byte
        t0 = time.monotonic()
        closed, got = closed_within(sock, 30)  # generous: without the frame timeout it would never close
        assert closed and time.monotonic() - t0 > 0.4
        assert b"frame_timeout" in got  # the ERROR frame came first
        assert refusals(srv)["frame_timeout"] == 1


def test_an_announced_16_mb_frame_is_cut_at_twice_the_largest_open(engine):
    with serving(engine, **{**QUICK, "handshake_timeout_s": 30.0, "frame_timeout_s": 30.0}) as srv:
        sock = tcp(srv)
        upgrade(sock)
        sock.sendall(ws_frame_header(16 * 2**20) + b"x" * 4096)
        closed, _ = closed_within(sock, 5)  # aiohttp refuses it at once (close 1009)
        assert closed and srv.server.in_frame_bytes == open_frame_bytes(MAX_CONTEXT) < 16 * 2**20 // 2


def test_an_idle_session_is_freed_and_told_why(engine):
    with serving(engine, **QUICK) as srv:
        client = VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10)
        opened = client.open(request())
        # 217 positions capped at max_context; sliding layers at their window plus a round's 7 rows: 512 B x 128 +
        # 512 B x (7 + 7); beside it the prefill pool: 1 prefilling session x 512 B x (7 + a chunk of 8)
        pool = 512 * (7 + 8)
        assert engine.session_kv_bytes(MAX_CONTEXT, ROWS) == 72_704 and engine.prefill_transient_bytes() == pool
        assert srv.server.metrics.kv_bytes_reserved == 72_704 + pool == 80_384
        cache = srv.server.sessions[opened.session_id].cache  # 9 prefilled positions; sliding layers keep 7 of them
        assert held_bytes(cache) == storage_bytes(cache) == engine.kv_layout.session_bytes(9, 0) == 512 * (9 + 7)
        t0 = time.monotonic()
        wait_for(lambda: not srv.server.sessions, what="the idle session's release")
        assert time.monotonic() - t0 > 0.5  # not before idle_timeout_s = 0.6 s (the OPEN's reply came first)
        wait_for(lambda: srv.server.metrics.kv_bytes_reserved == pool, what="the idle session's KV release")
        with pytest.raises(ServerError) as info:
            client.round(DraftTree(0, np.full(ROWS, 29, np.int32), np.arange(-1, ROWS - 1, dtype=np.int32)))
        assert info.value.code == "idle_timeout" and opened.session_id == 1
        assert refusals(srv)["idle_timeout"] == 1


def test_connections_over_the_limit_get_503_with_retry_after(engine):
    with serving(engine, **{**QUICK, "handshake_timeout_s": 30.0, "max_connections": 3}) as srv:
        held = [tcp(srv) for _ in range(3)]
        wait_for(lambda: srv.server.metrics.connections_active == 3, what="the server's accepting 3 connections")
        probe = tcp(srv)
        probe.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        closed, got = closed_within(probe, 5)
        assert closed and got.startswith(b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 2\r\n")
        assert refusals(srv)["max_connections"] == 1 and srv.server.metrics.connections_active == 3
        with pytest.raises(ServerUnreachable, match="connection limit .HTTP 503.; retry after 2 s"):
            VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10).open(request())
        for s in held:
            s.close()


def test_sessions_over_the_limit_get_too_many_sessions(engine):
    with serving(engine, **{**QUICK, "idle_timeout_s": 30.0, "max_sessions": 1}) as srv:
        first = VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10)
        first.open(request())
        with pytest.raises(ServerError) as info:
            VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10).open(request())
        assert info.value.code == "too_many_sessions"
        assert "1 sessions are open, max_sessions = 1; retry after 2 s" in str(info.value)
        first.close()
        wait_for(lambda: not srv.server.sessions, what="the closed session's release")
        VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10).open(request())  # room again
        assert refusals(srv)["max_sessions"] == 1


def test_the_kv_budget_refuses_an_open_that_would_pass_it(engine):
    # 2 full + 2 sliding layers x (32 K + 32 V) x 4 B: 512 B per position each; sliding layers keep 7 positions
    # (window 8 - 1) + the round's 7 rows; the prefill pool: 1 session x 512 B x (7 + a chunk of 8) = 7,680 B
    layout = engine.kv_layout
    assert (layout.full_bytes, layout.sliding_bytes, layout.retain, engine.kv_bytes_per_position) == (512, 512, 7, 1024)
    assert engine.prefill_chunk == CHUNK == 8
    with serving(engine, **{**QUICK, "idle_timeout_s": 30.0, "max_kv_bytes": 130_000}) as srv:
        assert srv.server.metrics.kv_bytes_reserved == 7_680
        a = VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10)
        a.open(request())  # min(10 + 200 + 7, max_context 128): 512 x 128 + 512 x 14 = 72,704 B
        with pytest.raises(ServerError) as info:
            VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10).open(request())
        assert info.value.code == "kv_budget_exhausted"
        assert "needs 72704 KV bytes (128 positions), 80384 of max_kv_bytes = 130000" in str(info.value)
        VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10).open(request(max_new=50))  # 67: 512 x (67 + 14) fits
        assert srv.server.metrics.kv_bytes_reserved == 7_680 + 72_704 + 41_472 == 512 * (15 + 128 + 14 + 67 + 14)
        assert refusals(srv)["max_kv_bytes"] == 1


def test_auth_failures_are_rate_limited_per_peer(engine):
    with serving(engine, **{**QUICK, "auth_failures_per_minute": 3}) as srv:
        for _ in range(3):
            with pytest.raises(AuthRefused):
                VerifierClient(srv.url, auth_token="wrong", timeout_s=10).open(request(token="wrong"))
        with pytest.raises(InvalidStatus) as info:  # the 4th is refused at the upgrade, before any token
            connect(srv.url, compression=None, proxy=None, legacy=True)
        assert info.value.response.status_code == 429
        assert 55 <= int(info.value.response.headers["Retry-After"]) <= 60
        with pytest.raises(AuthRefused, match="HTTP 429"):  # even with the right token, until the minute passes
            VerifierClient(srv.url, auth_token=TOKEN, timeout_s=10).open(request())
        assert refusals(srv)["auth_failures_per_minute"] == 2
        assert srv.server.metrics.errors["auth_refused"] == 3
