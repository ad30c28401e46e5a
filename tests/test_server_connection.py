"""The transport-independent session loop every front door shares (`VerifierServer.serve_connection`, fed by a
`Channel`; ``hycoc verify-server`` over aiohttp, ``hycoc serve-ray`` over Starlette), on a scripted in-memory
channel: the handshake timeout runs until an OPEN (not just the first frame), the idle timeout frees the KV before
the client hears why, a CLOSE frees the session and closes with 1000. Plus the port check both commands run before
loading a model, and the flags' help (no type after a flag)."""

from __future__ import annotations

import asyncio
import errno
import re
import socket
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hycoc.verifier import VerifierEngine
from hycoc.verifier.server import Connection, ServerLimits, VerifierServer
from tiny_models import tiny_verifier
from typer.testing import CliRunner

from hycoc.chat import ids_crc32
from hycoc.ports import check_port
from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, Close, DraftTree, ErrorReply, Opened, OpenRequest, RoundReply, Sampling

torch.set_num_threads(1)
RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"


class ScriptedChannel:
    """A `Channel` whose client sends ``script`` (bytes, str, or None for "the client closes") as fast as the
    server reads, then stays silent; it records what the server sent and the close code."""

    def __init__(self, *script):
        self.script, self.sent, self.closed = list(script), [], None

    async def receive(self, timeout):
        if self.script:
            return self.script.pop(0)
        await asyncio.sleep(3600 if timeout is None else timeout)
        raise TimeoutError

    async def send(self, frame):
        self.sent.append(wire.decode(frame))

    async def close(self, code):
        self.closed = code


@pytest.fixture(scope="module")
def engine():
    eng = VerifierEngine(tiny_verifier(), head_window=6, handoff_scales=(0.1,) * 6, max_context=64)
    yield eng
    eng.close()


def serve(engine, channel, **limits) -> tuple[VerifierServer, float]:
    """Run one connection to its end on a fresh server; returns the server and the seconds it took."""
    server = VerifierServer(engine, tree_rows=5, limits=ServerLimits(**limits))

    async def main():
        await server.start_engine()
        try:
            t0 = time.monotonic()
            await server.serve_connection(Connection(header_token=None, peer="10.0.0.9"), channel)
            return time.monotonic() - t0
        finally:
            await server.stop()

    return server, asyncio.run(main())


def open_frame() -> bytes:
    return wire.encode(
        OpenRequest(prompt_ids=np.arange(3, 13, dtype=np.int32), sampling=Sampling(0.0, 64, 0.95), max_new_tokens=8)
    )


def test_the_handshake_timeout_runs_until_an_open_not_just_the_first_frame(engine):
    # A text message is answered and does not end the handshake: the connection is closed 0.4 s after it began.
    channel = ScriptedChannel("hello")
    server, took = serve(engine, channel, handshake_timeout_s=0.4)
    assert [(m.code, m.message) for m in channel.sent] == [
        ("unexpected_message", "a text WebSocket message: the wire protocol uses binary frames only"),
        ("handshake_timeout", "no OPEN within handshake_timeout_s = 0.4 s of connecting"),
    ]
    assert channel.closed == 1008 and took > 0.35  # not before the 0.4 s timeout (no upper bound: a loaded machine)
    assert server.metrics.refusals["handshake_timeout"] == 1
    assert server.metrics.errors == {"unexpected_message": 1, "handshake_timeout": 1}


def test_an_idle_session_is_freed_before_the_client_hears_why(engine):
    channel = ScriptedChannel(open_frame())
    server, took = serve(engine, channel, handshake_timeout_s=0.2, idle_timeout_s=0.5)
    opened, error = channel.sent
    assert isinstance(opened, Opened) and opened.session_id == 1
    assert isinstance(error, ErrorReply) and error.code == "idle_timeout"
    assert error.message == "no frame for idle_timeout_s = 0.5 s: the session's KV was freed; open a new session"
    assert channel.closed == 1008 and took > 0.5  # the OPEN ended the handshake timeout (0.2 s)
    assert (server.metrics.refusals["idle_timeout"], server.metrics.refusals["handshake_timeout"]) == (1, 0)
    assert (server.sessions, server.metrics.sessions_active, server.metrics.kv_bytes_reserved) == ({}, 0, 0)


def test_close_frees_the_session_and_closes_normally(engine):
    channel = ScriptedChannel(open_frame(), wire.encode(Close(0)), b"never read")
    server, _ = serve(engine, channel)
    assert [type(m) for m in channel.sent] == [Opened]  # CLOSE has no reply
    assert channel.closed == 1000 and channel.script == [b"never read"]
    assert (server.metrics.sessions_total, server.metrics.sessions_active, server.metrics.kv_bytes_reserved) == (
        1,
        0,
        0,
    )


def test_a_client_that_closes_ends_the_loop_and_frees_its_session(engine):
    channel = ScriptedChannel(open_frame(), None)
    server, _ = serve(engine, channel)
    assert [type(m) for m in channel.sent] == [Opened] and channel.closed is None  # nothing sent after it left
    assert (server.metrics.sessions_active, server.metrics.kv_bytes_reserved) == (0, 0)


def test_a_wrong_conversation_is_refused_and_the_right_one_appended_on_the_same_session(engine):
    """OPEN (max_new_tokens 1: the first round finishes), ROUND, an APPEND whose keep_crc is not the crc32 of the
    prompt it keeps (ERROR conversation_mismatch, the connection stays), the same APPEND with the right crc (OPENED:
    same session, t = keep + T - 1), CLOSE. The client never reads an answer before sending: the loop alone orders
    them."""
    prompt = np.arange(3, 13, dtype=np.int32)
    turn = np.array([20, 21, 22], np.int32)
    crc = ids_crc32(prompt.tolist())
    assert crc == zlib.crc32(prompt.astype("<i4").tobytes())
    channel = ScriptedChannel(
        wire.encode(OpenRequest(prompt_ids=prompt, sampling=Sampling(0.0, 64, 0.95), max_new_tokens=1, anchor=9)),
        wire.encode(DraftTree(0, np.full(5, 12, np.int32), np.arange(-1, 4, dtype=np.int32))),
        wire.encode(AppendTurn(turn, 4, keep=10, keep_crc=crc ^ 0x80000000, anchor=10)),
        wire.encode(AppendTurn(turn, 4, keep=10, keep_crc=crc, anchor=10)),
        wire.encode(Close(0)),
    )
    server, _ = serve(engine, channel)
    opened, reply, refused, appended = channel.sent
    assert isinstance(opened, Opened) and isinstance(reply, RoundReply) and reply.finished
    assert isinstance(refused, ErrorReply) and refused.code == "conversation_mismatch"
    assert f"{crc:#010x} here, {crc ^ 0x80000000:#010x} sent" in refused.message
    assert isinstance(appended, Opened) and (appended.session_id, appended.t) == (opened.session_id, 10 + 3 - 1)
    assert channel.closed == 1000
    assert server.metrics.errors == {"conversation_mismatch": 1}
    assert sum(server.metrics.appends.values()) == 1
    assert (server.sessions, server.metrics.kv_bytes_reserved) == ({}, 0)


def test_check_port_names_a_busy_port_and_picks_one_for_0():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for reuse in (True, False):
            with pytest.raises(OSError) as e:
                check_port("127.0.0.1", port, reuse_address=reuse)
            assert e.value.errno == errno.EADDRINUSE
    picked = check_port("127.0.0.1", 0)
    assert picked > 0 and check_port("127.0.0.1", picked) == picked  # it is free again once checked


def test_verify_server_names_a_busy_port_before_loading_the_model(monkeypatch):
    from hycoc.verifier import loading

    from hycoc.cli import app

    def load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(loading, "engine_from_recipe", load)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(app, ["verify-server", str(RECIPE), "--port", str(port)])
    assert result.exit_code == 1  # and the monkeypatched loader above was never called
    assert result.stderr.strip() == (
        f"hycoc verify-server: cannot listen on 127.0.0.1:{port}: Address already in "
        "use (another server on this port?): pass --port N, or --port 0 for any free "
        "port"
    )


def test_no_flag_shows_a_type_in_help():
    from hycoc.cli import app

    runner = CliRunner()
    commands = [None] + [c.name or c.callback.__name__.replace("_", "-") for c in app.registered_commands]
    assert {"verify-server", "serve-ray", "run", "build"} <= set(commands)
    for command in commands:
        result = runner.invoke(app, ([command] if command else []) + ["--help"], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (command, result.output)
        assert "--help" in result.output and "Show this message and exit." in result.output
        assert re.search(r"<bool>|BOOLEAN", result.output) is None, (command, result.output)
