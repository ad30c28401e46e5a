"""The wire during long work (verifier/server/channels.py, session_loop.py, worker.py) on the tiny models, with a
prefill held on a gate (the engine's `PrefillJob.step` waits until the test opens it), so "long" is as long as the
test wants and nothing depends on timing:

- a WebSocket ping is answered while the prefill runs, and a client whose keepalive times out in 0.3 s keeps its
  connection through a 1 s prefill;
- an APPEND reserves its KV before its prefill runs, so an OPEN arriving meanwhile is checked against the grown
  total, and ``kv_bytes_reserved <= max_kv_bytes`` (the ledger checks it at every reservation, tests/test_admission.py;
  here its peak); every failed APPEND gives its growth back;
- once the server stops, frames get ERROR shutting_down, and a queued prefill never reaches the engine.
"""

from __future__ import annotations

import asyncio
import threading
import time
from contextlib import contextmanager

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import ServerError, VerifierClient
from hycoc.verifier import VerifierEngine
from hycoc.verifier import engine as engine_module
from hycoc.verifier.server import Connection, ServerLimits, ServerThread, VerifierServer
from tiny_models import tiny_verifier
from websockets.sync.client import connect

from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, DraftTree, ErrorReply, Opened, OpenRequest, Sampling

torch.set_num_threads(1)
ROWS = 7
PER_POSITION = 1024  # the tiny verifier: 4 layers x (32 K + 32 V) x 4 B


@pytest.fixture(scope="module")
def engine():
    eng = VerifierEngine(tiny_verifier(), head_window=6, handoff_scales=(0.1,) * 6, max_context=128)
    assert eng.kv_bytes_per_position == PER_POSITION
    yield eng
    eng.close()


class Gate:
    """Holds every prefill chunk until `release` (open at first); records the threads that ran chunks."""

    def __init__(self):
        self.open, self.entered, self.threads = threading.Event(), threading.Event(), []
        self.open.set()

    def hold(self) -> None:
        self.open.clear()
        self.entered.clear()

    def release(self) -> None:
        self.open.set()


@pytest.fixture
def gate(monkeypatch):
    g, step = Gate(), engine_module.PrefillJob.step

    def held_step(job):
        g.threads.append(threading.current_thread().name)
        g.entered.set()
        assert g.open.wait(30), "the test never released the prefill"
        return step(job)

    monkeypatch.setattr(engine_module.PrefillJob, "step", held_step)
    return g


def wait_until(condition, what: str, seconds: float = 30.0) -> None:
    """Poll ``condition()`` every 10 ms until it holds; fail after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds} s"
        time.sleep(0.01)


def request(n=10, max_new=2) -> OpenRequest:
    return OpenRequest(
        prompt_ids=np.arange(20, 20 + n, dtype=np.int32), sampling=Sampling(0.0, 64, 0.95), max_new_tokens=max_new
    )


@contextmanager
def serving(engine, **limits):
    with ServerThread(engine, tree_rows=ROWS, limits=ServerLimits(**limits)) as srv:
        yield srv


def next_turn(srv, tokens, max_new: int) -> AppendTurn:
    """An APPEND that keeps every id the (only) session holds and continues with ``tokens``."""
    from hycoc.chat import ids_crc32

    held = next(iter(srv.server.sessions.values())).tokens
    return AppendTurn(np.asarray(tokens, np.int32), max_new, len(held), ids_crc32(held))


def finish_turn(client: VerifierClient, root: int = 29) -> None:
    """Rounds of a chain tree (rooted at the session's root, the last committed token) until the turn finishes."""
    seq = 0
    while True:
        tokens = np.full(ROWS, 29, np.int32)
        tokens[0] = root
        reply = client.round(DraftTree(seq, tokens, np.arange(-1, ROWS - 1, dtype=np.int32)))
        seq, root = seq + 1, int(reply.bonus)
        if reply.finished:
            return


def test_pings_are_answered_while_the_engine_prefills(engine, gate):
    with serving(engine, frame_timeout_s=0.5) as srv:
        # websockets' keepalive: a ping every 0.1 s, the connection dropped if a pong takes over 0.3 s
        ws = connect(srv.url, compression=None, proxy=None, ping_interval=0.1, ping_timeout=0.3, legacy=True)
        gate.hold()
        ws.send(wire.encode(request()))
        assert gate.entered.wait(10)  # the prefill is running (and held)
        pong = ws.ping()
        assert pong.wait(5)  # answered while the engine is busy
        assert not gate.open.is_set()  # ... which it still is
        held_until = time.monotonic() + 1.0  # > 3 keepalive timeouts and 2 frame timeouts
        while time.monotonic() < held_until:  # and every ping meanwhile is answered
            assert ws.ping().wait(5)
        gate.release()
        opened = wire.decode(ws.recv(timeout=10))
        assert isinstance(opened, Opened) and opened.t == 9
        assert srv.server.metrics.refusals["frame_timeout"] == 0
        ws.close()


def test_append_reserves_its_kv_before_its_prefill_and_the_budget_holds_under_concurrent_opens(engine, gate):
    first = engine.session_kv_bytes(19, ROWS)  # min(128, 10 + 2 + 7) positions, windowed layers
    grown = engine.session_kv_bytes(128, ROWS)  # 12 committed + 10 + 100 + 7 > 128: capped
    pool = engine.prefill_transient_bytes()  # one prefilling session's window + chunk, reserved at start
    # room for B's OPEN only while A's growth is not counted (A keeps every held id: a crop with no undo copy
    # of its full layers, which hold exactly the held positions)
    budget = pool + grown + first - 1
    with serving(engine, max_kv_bytes=budget, idle_timeout_s=30.0) as srv:
        kv = srv.server.admission.kv  # checks its invariant (reserved <= max_kv_bytes) at every reservation
        a = VerifierClient(srv.url, timeout_s=30)
        a.open(request())
        finish_turn(a)
        assert kv.reserved == pool + first
        gate.hold()
        result = {}
        turn = next_turn(srv, np.arange(30, 40), 100)
        appender = threading.Thread(target=lambda: result.setdefault("opened", a.append(turn)))
        appender.start()
        assert gate.entered.wait(10)  # A's APPEND prefill is running (held) ...
        assert kv.reserved == pool + grown  # ... and its growth is already reserved
        with pytest.raises(ServerError) as info:
            VerifierClient(srv.url, timeout_s=30).open(request())
        assert info.value.code == "kv_budget_exhausted"
        assert f"this request needs {first} KV bytes (19 positions), {pool + grown} of max_kv_bytes = {budget}" in (
            str(info.value)
        )
        gate.release()
        appender.join(30)
        assert isinstance(result["opened"], Opened) and kv.reserved == pool + grown
        a.close()
        deadline = time.monotonic() + 10
        while kv.reserved > pool and time.monotonic() < deadline:
            time.sleep(0.01)
        assert kv.reserved == pool and srv.server.admission.sessions.in_use == 0
        assert kv.peak == pool + grown <= budget  # the most ever reserved: A's growth; B's OPEN never joined it


def test_every_failed_append_gives_its_kv_back(engine, gate):
    first = engine.session_kv_bytes(19, ROWS) + engine.prefill_transient_bytes()  # the session's and the pool
    with serving(engine, idle_timeout_s=30.0) as srv:
        kv = srv.server.admission.kv
        a = VerifierClient(srv.url, timeout_s=30)
        a.open(request())
        with pytest.raises(ServerError) as info:  # the engine refuses: the turn has not finished
            a.append(next_turn(srv, np.arange(30, 40), 100))
        assert info.value.code == "finished" and kv.reserved == first
        finish_turn(a)
        with pytest.raises(ServerError) as info:  # the engine refuses: 12 + 120 tokens overflow 128
            a.append(next_turn(srv, np.arange(1, 121) % 60, 4))
        assert info.value.code == "context_overflow" and kv.reserved == first
        a.close()
        # a client that leaves while its APPEND prefills: the growth and the session's KV both come back
        b = VerifierClient(srv.url, timeout_s=30)
        b.open(request())
        finish_turn(b)
        gate.hold()
        b._ws.send(wire.encode(next_turn(srv, np.arange(30, 40), 100)))
        assert gate.entered.wait(10)
        pool = engine.prefill_transient_bytes()
        assert kv.reserved == engine.session_kv_bytes(128, ROWS) + pool
        connections = srv.server.metrics.connections_active
        b._ws.close()
        wait_until(lambda: srv.server.metrics.connections_active < connections, "the server's seeing B leave")
        gate.release()
        wait_until(lambda: kv.reserved == pool and not srv.server.sessions, "B's KV and session given back")


class Script:
    """A `Channel` whose client sends ``frames`` then waits; records what the server sent and the close code."""

    def __init__(self, *frames):
        self.frames, self.sent, self.closed = list(frames), [], None
        self.all_sent = asyncio.Event()

    async def receive(self, timeout):
        if self.frames:
            return self.frames.pop(0)
        self.all_sent.set()
        await asyncio.sleep(3600)

    async def send(self, frame):
        self.sent.append(wire.decode(frame))

    async def close(self, code):
        self.closed = code


def test_after_stop_frames_get_shutting_down_and_never_reach_the_engine(engine, gate):
    server = VerifierServer(engine, tree_rows=ROWS)
    opened_by = []
    real_open = engine.open

    async def main():
        await server.start_engine()
        gate.hold()
        a, b = Script(wire.encode(request())), Script(wire.encode(request()))
        ta = asyncio.create_task(server.serve_connection(Connection(None), a))
        while not gate.entered.is_set():  # A's prefill runs on the worker (held)
            await asyncio.sleep(0.01)
        tb = asyncio.create_task(server.serve_connection(Connection(None), b))
        # B's OPEN is admitted (its KV reserved) and, in the same step of the event loop, its prefill queued on
        # the worker behind A's
        deadline = time.monotonic() + 30
        while server.admission.kv.reserved < 2 * engine.session_kv_bytes(19, ROWS):
            assert time.monotonic() < deadline, "B's OPEN was never admitted"
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(server.stop())
        while not server.worker.stopping:  # the stop has begun before A's prefill may finish
            await asyncio.sleep(0.01)
        gate.release()
        await stopping
        await asyncio.wait_for(asyncio.gather(ta, tb), 10)
        late = Script(wire.encode(request()))  # a frame after the stop
        engine.open = lambda *args, **kw: opened_by.append(threading.current_thread().name) or real_open(*args, **kw)
        try:
            await asyncio.wait_for(server.serve_connection(Connection(None), late), 10)
        finally:
            del engine.open
        return a, b, late

    a, b, late = asyncio.run(main())
    for script in (a, b, late):
        assert [type(m) for m in script.sent] == [ErrorReply] and script.sent[0].code == "shutting_down"
        assert script.closed == 1008
    assert opened_by == []  # the late OPEN never reached the engine
    assert gate.threads == ["hycoc-verifier_0"]  # one chunk ran, A's, on the worker; B's never started
    assert server.admission.kv.reserved == 0 and server.admission.sessions.in_use == 0
