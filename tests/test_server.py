"""The verifier server (verifier/server.py) end to end: a tiny engine served in-process on an ephemeral port, the
device's `VerifierClient` and raw WebSocket frames on the other side (docs/serving.md; the frames of docs/design.md
"Wire protocol").

References are the engine itself, called directly on a second, identical copy of the tiny models (same seed, same
weights), so the server's replies must match bit for bit: same sampled tokens, same path, same int8 hand-off.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import urllib.request
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import AuthRefused, ServerError, VerifierClient
from hycoc.verifier import VerifierEngine
from hycoc.verifier.loading import DeviceUnavailable, engine_from_recipe, server_options
from hycoc.verifier.row_budget import RowCost
from hycoc.verifier.server import METRICS_CONTENT_TYPE, ServerLimits, ServerThread
from hycoc.verifier.server.session_loop import open_engine_session
from paths import ROOT
from test_server_metrics import FAMILIES
from tiny_models import VOCAB, tiny_head, tiny_verifier
from tiny_models import oracle_tree as tiny_oracle_tree
from typer.testing import CliRunner
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from hycoc.chat import ids_crc32
from hycoc.cli import app
from hycoc.models import ModelNotFoundError
from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, Close, DraftTree, ErrorReply, Opened, OpenRequest, RoundReply, Sampling
from hycoc.recipe import load_recipe

torch.set_num_threads(1)
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
W = 6
ROWS = 7  # B + 1: oracle trees of width 2 and depth 3
MAX_CONTEXT = 128
MAX_FRAME = 4096
TOKEN = "s3cret"


def make_engine(model, head) -> VerifierEngine:
    return VerifierEngine(
        model, head=head, head_window=W, handoff_scales=SCALES, eos_token_ids=set(), max_context=MAX_CONTEXT
    )


@pytest.fixture(scope="module")
def models():
    model = tiny_verifier(sharpen=3.0)  # peaky p~: oracle trees get tokens accepted
    return model, tiny_head(model)


@pytest.fixture(scope="module")
def reference():
    """The engine on a second copy of the same weights, called directly."""
    model = tiny_verifier(sharpen=3.0)
    engine = make_engine(model, tiny_head(model))
    yield engine
    engine.close()


@pytest.fixture
def server(models):
    """A fresh server (fresh metrics) with an auth token; one at a time shares the module's models."""
    engine = make_engine(*models)
    with ServerThread(
        engine, tree_rows=ROWS, auth_token=TOKEN, max_frame_bytes=MAX_FRAME, model_name="tiny-gemma4"
    ) as srv:
        yield srv
    engine.close()


def oracle_tree(model, tokens):
    """`tiny_models.oracle_tree` as the wire's int32 arrays."""
    return tiny_oracle_tree(model, tokens, dtype=np.int32)


def open_request(prompt, **kw) -> OpenRequest:
    args = dict(
        prompt_ids=np.asarray(prompt, np.int32),
        sampling=Sampling(1.0, 64, 0.95),
        seed=5,
        acceptance="epsilon",
        epsilon=0.02,
        max_new_tokens=200,
    )
    args.update(kw)
    return OpenRequest(**args)


def reference_session(reference, req: OpenRequest):
    session = open_engine_session(reference, req)  # the server's own mapping of an OPEN onto the engine
    session.prefill()
    return session


def assert_same_reply(got: RoundReply, want: RoundReply):
    assert got.seq == want.seq and got.bonus == want.bonus and got.finished == want.finished
    np.testing.assert_array_equal(got.samples, want.samples)
    np.testing.assert_array_equal(got.path_rows, want.path_rows)
    np.testing.assert_array_equal(got.chain, want.chain)
    assert got.server_ms > 0  # timings differ between the two
    assert (got.handoff is None) == (want.handoff is None)
    if want.handoff is not None:
        g, w = got.handoff, want.handoff
        assert (g.t_prime, g.a, g.bonus) == (w.t_prime, w.a, w.bonus)
        for name in ("x_hat", "k_sliding", "v_sliding", "k_full", "v_full"):
            np.testing.assert_array_equal(getattr(g, name), getattr(w, name), err_msg=name)
        assert g.scales == pytest.approx(w.scales, rel=1e-7)


def committed(tokens: np.ndarray, reply: RoundReply) -> list[int]:
    """What the device commits from a reply (Alg. 1 line 9): the accepted path's tokens, then the bonus."""
    return [int(tokens[r]) for r in reply.path_rows] + [int(reply.bonus)]


class Alongside:
    """A well-behaved session next to the faulty ones: each `step` runs its next round on the server and on the
    reference engine and asserts they agree."""

    def __init__(self, url, reference, prompt=range(20, 30), seed=5):
        self.req = open_request(list(prompt), seed=seed)
        self.client = VerifierClient(url, auth_token=TOKEN, timeout_s=30)
        self.opened = self.client.open(self.req)
        self.ref = reference_session(reference, self.req)
        self.model, self.seq, self.output = reference.model, 0, []

    def step(self):
        tokens, parents = oracle_tree(self.model, self.ref.tokens)
        got = self.client.round(DraftTree(self.seq, tokens, parents))
        assert_same_reply(got, self.ref.verify(tokens, parents, self.seq))
        self.output += committed(tokens, got)
        assert self.output == self.ref.output
        self.seq += 1
        return got


class Raw:
    """A raw WebSocket connection for hand-made frames."""

    def __init__(self, url, token: str | None = TOKEN, header: str | None = None):
        headers = {"Authorization": header} if header else None
        self.ws = connect(url, additional_headers=headers, compression=None, proxy=None, max_size=2**24, legacy=True)
        self.token = token

    def send(self, frame: bytes, timeout: float = 30) -> bytes:
        self.ws.send(frame)
        return self.ws.recv(timeout=timeout)

    def open(self, prompt, **kw) -> Opened:
        kw.setdefault("auth_token", self.token)
        msg = wire.decode(self.send(wire.encode(open_request(prompt, **kw))))
        assert isinstance(msg, Opened), msg
        return msg

    def error(self, frame: bytes) -> ErrorReply:
        msg = wire.decode(self.send(frame))
        assert isinstance(msg, ErrorReply), msg
        return msg

    def close(self):
        self.ws.close()


def frame(mtype: int, payload: bytes, version: int = wire.PROTOCOL_VERSION, crc: int | None = None) -> bytes:
    """A frame with any header (the codec's `encode` refuses to write bad ones)."""
    crc = zlib.crc32(payload) if crc is None else crc
    return struct.pack("<4sHBBII", b"HYCO", version, mtype, 0, len(payload), crc) + payload


def round_frame(seq, tokens, parents, version: int = wire.PROTOCOL_VERSION, **kw) -> bytes:
    """A ROUND frame of any tokens and parents, valid or not: u32 seq, u16 R (from version 4 on: u8 has_scores = 0),
    i32[R] tokens, i16[R] parents."""
    tokens, parents = np.asarray(tokens, "<i4"), np.asarray(parents, "<i2")
    fixed = struct.pack("<IH", seq, tokens.size) if version <= 3 else struct.pack("<IHB", seq, tokens.size, 0)
    return frame(wire.MessageType.ROUND, fixed + tokens.tobytes() + parents.tobytes(), version=version, **kw)


def http_get(url: str):
    with urllib.request.urlopen(url, timeout=30) as r:
        return r.headers.get("Content-Type"), r.read().decode()


def parse_metrics(text: str) -> tuple[dict[str, float], dict[str, str]]:
    """Prometheus text: ({series: value}, {family: type}); series names keep their labels."""
    values, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            types[name] = kind
        elif line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            values[series] = float(value)
    return values, types


def wait_for(predicate, timeout_s=20.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


# ---------------------------------------------------------------------------------------------- sessions


def test_an_open_reaches_the_engine_field_by_field():
    """`open_engine_session` (the server's and `reference_session`'s mapping of an OPEN onto `VerifierEngine.open`)
    gives each of the engine's parameters the OPEN field of the same name."""
    calls = []

    class Spy:
        def open(self, *args, **kw):
            calls.append(inspect.signature(VerifierEngine.open).bind(self, *args, **kw).arguments)
            return "session"

    req = open_request(
        [3, 4, 5], seed=9, acceptance="exact", epsilon=0.5, draft_place="server-head", max_new_tokens=7, anchor=1
    )
    assert open_engine_session(Spy(), req) == "session"
    (got,) = calls
    assert set(got) == set(inspect.signature(VerifierEngine.open).parameters)  # every parameter given
    for name, value in got.items():
        if name != "self":
            assert value is getattr(req, name), name


def test_full_session_matches_the_engine(server, reference):
    s = Alongside(server.url, reference)
    assert s.opened == Opened(
        session_id=1,
        t=9,
        prefill_ms=s.opened.prefill_ms,
        max_context=MAX_CONTEXT,
        tree_rows=ROWS,
        vocab_size=VOCAB,
        hidden_size=64,
        kv_dim_sliding=32,
        kv_dim_full=32,
    )
    assert s.opened.prefill_ms > 0
    replies = [s.step() for _ in range(5)]
    assert sum(len(r.path_rows) for r in replies) > 0, "oracle trees should get tokens accepted"
    first = replies[0].handoff  # a = max(0, t' - W) in a request's first round (Alg. 4 line 14)
    assert first.t_prime == 9 + 1 + len(replies[0].path_rows) and first.a == max(0, first.t_prime - W)
    assert replies[-1].handoff.t_prime == 9 + len(s.output)
    live = server.server.sessions[1]
    assert live.tokens == s.ref.tokens  # the server's session holds exactly the reference's sequence
    s.client.close()
    assert wait_for(lambda: not server.server.sessions and live.cache is None)  # freed on the worker, after


def test_cloud_mtp_session_sends_the_root_alone(server, reference):
    req = open_request(range(40, 52), draft_place="cloud-mtp", acceptance="exact", seed=9)
    ref = reference_session(reference, req)
    with VerifierClient(server.url, auth_token=TOKEN) as c:
        opened = c.open(req)
        assert opened.tree_rows == 1
        for seq in range(3):
            root = np.array([ref.root], np.int32)
            got = c.round(DraftTree(seq, root, np.array([-1], np.int32)))
            assert_same_reply(got, ref.verify(root, [-1], seq))
            assert got.handoff is None and got.samples.size == 5  # root + K = 4 chain rows
        with pytest.raises(ServerError) as e:  # a device tree is the wrong row count for this session
            c.round(DraftTree(3, np.array([ref.root, 5], np.int32), np.array([-1, 0], np.int32)))
        assert e.value.code == "wrong_row_count"


def test_server_head_without_a_keep_set_is_refused(server):
    with VerifierClient(server.url, auth_token=TOKEN) as c:
        with pytest.raises(ServerError) as e:
            c.open(open_request(range(10, 20), draft_place="server-head"))
    assert e.value.code == "no_keep_set"
    assert "needs the keep set" in e.value.server_message


def test_concurrent_clients_are_isolated(server, reference):
    """Three sessions drive rounds at the same time from three threads; afterwards each one's trees are replayed on
    the reference engine, one session at a time: every reply must match."""
    rng = np.random.default_rng(0)
    fillers = [rng.integers(3, VOCAB, ROWS - 1).astype(np.int32) for _ in range(3)]
    parents = np.array([-1, 0, 0, 1, 1, 2, 3], np.int32)
    requests = [
        open_request(range(10 * i + 20, 10 * i + 30), seed=i, acceptance=("exact", "epsilon")[i % 2]) for i in range(3)
    ]
    record = {i: [] for i in range(3)}
    failures = []

    def drive(i):
        try:
            with VerifierClient(server.url, auth_token=TOKEN) as c:
                c.open(requests[i])
                root = int(requests[i].prompt_ids[-1])
                for seq in range(4):
                    tokens = np.concatenate([[root], fillers[i]]).astype(np.int32)
                    reply = c.round(DraftTree(seq, tokens, parents))
                    record[i].append((tokens, reply))
                    root = int(reply.bonus)
        except Exception as e:  # noqa: BLE001 -- reported below
            failures.append(e)

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failures, failures
    for i in range(3):
        ref = reference_session(reference, requests[i])
        for seq, (tokens, reply) in enumerate(record[i]):
            assert_same_reply(reply, ref.verify(tokens, parents, seq))
    assert wait_for(lambda: not server.server.sessions)


def test_server_head_session_with_a_keep_set_returns_the_chain(models, reference):
    keep = np.arange(3, 200)
    engine = VerifierEngine(
        models[0],
        head=models[1],
        keep_set=keep,
        head_window=W,
        handoff_scales=SCALES,
        eos_token_ids=set(),
        max_context=MAX_CONTEXT,
    )
    ref_engine = VerifierEngine(
        reference.model,
        head=reference.head,
        keep_set=keep,
        head_window=W,
        handoff_scales=SCALES,
        eos_token_ids=set(),
        max_context=MAX_CONTEXT,
    )
    req = open_request(range(50, 60), draft_place="server-head", acceptance="exact", seed=4)
    try:
        with ServerThread(engine, tree_rows=ROWS) as srv, VerifierClient(srv.url) as c:
            assert c.open(req).tree_rows == ROWS
            ref = reference_session(ref_engine, req)
            for seq in range(3):
                tokens, parents = oracle_tree(reference.model, ref.tokens)
                got = c.round(DraftTree(seq, tokens, parents))
                assert_same_reply(got, ref.verify(tokens, parents, seq))
                assert got.handoff is None and got.chain.size == 4 and set(got.chain.tolist()) <= set(keep.tolist())
    finally:
        engine.close()
        ref_engine.close()


# ---------------------------------------------------------------------------------------------- bad messages


def test_each_bad_round_gets_its_error_and_the_session_alongside_keeps_going(server, reference):
    good = Alongside(server.url, reference)
    good.step()
    victim = Raw(server.url)
    req_b = open_request(range(60, 70), seed=7)
    opened = victim.open(req_b.prompt_ids, seed=7)
    root = int(req_b.prompt_ids[-1])
    tokens = np.array([root, 11, 12, 13, 14, 15, 16])
    chain = np.arange(-1, ROWS - 1)
    cases = [
        ("bad_parent", round_frame(0, tokens, [-1, 0, 1, 5, 3, 4, 5]), "DraftTree.parents[3] = 5"),
        ("bad_parent", round_frame(0, tokens, [-1, 2, 1, 2, 3, 4, 5]), "DraftTree.parents[1] = 2"),  # cycle 1<->2
        ("bad_parent", round_frame(0, tokens, [0, 0, 1, 2, 3, 4, 5]), "DraftTree.parents[0] = 0"),
        (
            "token_out_of_vocab",
            round_frame(0, [root, 11, VOCAB, 13, 14, 15, 16], chain),
            f"DraftTree.tokens[2] = {VOCAB}: token ids must lie in [0, {VOCAB})",
        ),
        (
            "wrong_row_count",
            round_frame(0, [*tokens, 17], [*chain, ROWS - 1]),
            f"has {ROWS + 1} rows, at most {ROWS}",
        ),
        (
            "frame_too_large",
            round_frame(0, np.full(700, 11), np.arange(-1, 699)),
            f"frame of {16 + 7 + 6 * 700} bytes: this receiver accepts at most max_frame_bytes = {MAX_FRAME}",
        ),
        ("unknown_message_type", frame(9, b""), "message type = 9"),
        ("unsupported_version", round_frame(0, tokens, chain, version=1), "frame speaks protocol version 1"),
        ("crc_mismatch", round_frame(0, tokens, chain, crc=1), "its header says 0x00000001"),
        ("unexpected_message", wire.encode(opened), "Opened frames go from the verifier to the device"),
        ("already_open", wire.encode(open_request(range(5), auth_token=TOKEN)), "already holds session 2"),
        ("bad_session_id", wire.encode(Close(session_id=99)), "CLOSE names session 99"),
        ("bad_seq", round_frame(3, tokens, chain), "round seq 3 out of order; expected 0"),
        ("bad_root", round_frame(0, [root + 1, *tokens[1:]], chain), f"is not the session's root {root}"),
    ]
    for code, bad, text in cases:
        err = victim.error(bad)
        assert (err.code, text in err.message) == (code, True), (code, err)
        good.step()
    # The victim's session was never touched: its first valid round equals a fresh reference session's.
    ref_b = reference_session(reference, req_b)
    t2, p2 = oracle_tree(reference.model, ref_b.tokens)
    got = wire.decode(victim.send(round_frame(0, t2, p2)), wire.Limits(vocab_size=VOCAB))
    assert_same_reply(got, ref_b.verify(t2, p2, 0))
    codes = [c for c, _, _ in cases]
    values, _ = parse_metrics(http_get(server.http_url + "/metrics")[1])
    for code in set(codes):
        assert values[f'hycoc_errors_total{{kind="{code}"}}'] == codes.count(code)
    assert values["hycoc_rounds_total"] == len(cases) + 2 and values["hycoc_sessions_active"] == 2
    victim.close()
    good.client.close()


def test_errors_before_open_and_a_text_message(server, reference):
    good = Alongside(server.url, reference)
    raw = Raw(server.url)
    cases = [
        ("not_opened", round_frame(0, [1, 2], [-1, 0]), "ROUND before OPEN"),
        (
            "context_overflow",
            wire.encode(open_request(np.full(MAX_CONTEXT + 1, 3), auth_token=TOKEN)),
            f"has {MAX_CONTEXT + 1} tokens: the verifier holds max_context = {MAX_CONTEXT} positions",
        ),
        (
            "token_out_of_vocab",
            wire.encode(open_request([3, 4, VOCAB + 5], auth_token=TOKEN)),
            f"OpenRequest.prompt_ids[2] = {VOCAB + 5}",
        ),
        (
            "bad_top_p",
            frame(
                wire.MessageType.OPEN,
                wire.encode(open_request([3, 4], auth_token=TOKEN))[16:].replace(
                    struct.pack("<f", 0.95), struct.pack("<f", 1.5), 1
                ),
            ),
            "Sampling.top_p = 1.5",
        ),
    ]
    for code, bad, text in cases:
        err = raw.error(bad)
        assert (err.code, text in err.message) == (code, True), (code, err)
        good.step()
    raw.ws.send("hello")
    err = wire.decode(raw.ws.recv(timeout=30))
    assert err.code == "unexpected_message" and "binary frames only" in err.message
    assert raw.open([3, 4, 5]).tree_rows == ROWS  # the connection still opens a session after all that
    good.step()
    raw.close()
    good.client.close()


def test_a_frame_over_the_websocket_limit_closes_only_its_connection(server, reference):
    good = Alongside(server.url, reference)
    raw = Raw(server.url)
    raw.ws.send(b"\0" * (2 * MAX_FRAME + 1))  # above aiohttp's limit (2 x max_frame_bytes): no frame, code 1009
    with pytest.raises(ConnectionClosed) as e:
        raw.ws.recv(timeout=30)
    assert e.value.rcvd.code == 1009
    good.step()
    good.client.close()


# ---------------------------------------------------------------------------------------------- auth


def test_auth_missing_or_wrong_is_refused_and_closes_the_connection(server, reference):
    good = Alongside(server.url, reference)
    for token, header, code in [
        (None, None, "auth_required"),
        ("wrong", None, "auth_refused"),
        (None, "Bearer wrong", "auth_refused"),
        (TOKEN, "Bearer wrong", "auth_refused"),
        ("wrong", f"Bearer {TOKEN}", "auth_refused"),
        (None, "Basic abc", "auth_refused"),
    ]:
        raw = Raw(server.url, header=header)
        err = raw.error(wire.encode(open_request([3, 4, 5], auth_token=token)))
        assert err.code == code, (token, header)
        with pytest.raises(ConnectionClosed) as e:
            raw.ws.recv(timeout=30)
        assert e.value.rcvd.code == 1008
        good.step()
    for token, header in [(None, f"Bearer {TOKEN}"), (TOKEN, None), (TOKEN, f"Bearer {TOKEN}")]:
        raw = Raw(server.url, token=token, header=header)
        assert raw.open([3, 4, 5]).tree_rows == ROWS
        raw.close()
    with pytest.raises(AuthRefused, match="refused the session: auth_refused: the auth token does not match"):
        VerifierClient(server.url, auth_token="nope").open(open_request([3, 4, 5]))
    with pytest.raises(AuthRefused, match="refused the session: auth_required: "):
        VerifierClient(server.url).open(open_request([3, 4, 5]))
    good.step()
    good.client.close()


# ---------------------------------------------------------------------------------------------- sequence numbers


def test_retry_returns_identical_bytes_and_out_of_order_seqs_are_refused(server, reference):
    req = open_request(range(30, 40), seed=3)
    ref = reference_session(reference, req)
    raw = Raw(server.url)
    raw.open(req.prompt_ids, seed=3)
    t0, p0 = oracle_tree(reference.model, ref.tokens)
    first = raw.send(round_frame(0, t0, p0))
    want0 = ref.verify(t0, p0, 0)
    assert_same_reply(wire.decode(first), want0)
    assert raw.send(round_frame(0, t0, p0)) == first  # the retry: the same bytes
    assert raw.error(round_frame(0, t0[::-1].copy(), p0)).code == "bad_seq"  # same seq, another tree
    assert raw.error(round_frame(2, t0, p0)).message == "round seq 2 out of order; expected 1"
    t1, p1 = oracle_tree(reference.model, ref.tokens)
    second = raw.send(round_frame(1, t1, p1))
    assert_same_reply(wire.decode(second), ref.verify(t1, p1, 1))
    assert raw.send(round_frame(1, t1, p1)) == second
    assert raw.error(round_frame(0, t0, p0)).code == "bad_seq"  # only the last round can be retried
    values, _ = parse_metrics(http_get(server.http_url + "/metrics")[1])
    assert (values["hycoc_rounds_total"], values["hycoc_retries_total"]) == (2, 2)
    assert values['hycoc_errors_total{kind="bad_seq"}'] == 3
    raw.close()


def test_a_finished_session_refuses_rounds_but_still_answers_the_retry(server, reference):
    raw = Raw(server.url)
    raw.open([5, 6, 7], max_new_tokens=1)
    t0, p0 = oracle_tree(reference.model, [5, 6, 7])
    first = raw.send(round_frame(0, t0, p0))
    reply = wire.decode(first)
    assert reply.finished and reply.handoff is None
    err = raw.error(round_frame(1, [reply.bonus] * ROWS, np.arange(-1, ROWS - 1)))
    assert err.code == "finished"
    assert raw.send(round_frame(0, t0, p0)) == first
    raw.close()


# ---------------------------------------------------------------------------------------------- appended turns


def finish_turn(client: VerifierClient, ref, model, max_new: int) -> tuple[list[int], bool]:
    """Oracle rounds (seq from 0: every turn counts its rounds again) until a reply says finished, each checked
    against the reference session. Returns what the device committed (no stop ids here: cut at max_new) and whether
    the last id committed is a bonus (sampled, never run through the model: the verifier holds no KV for it)."""
    out, seq = [], 0
    while True:
        tokens, parents = oracle_tree(model, ref.tokens)
        got = client.round(DraftTree(seq, tokens, parents))
        assert_same_reply(got, ref.verify(tokens, parents, seq))
        new = committed(tokens, got)
        room = max_new - len(out)
        out += new[:room]
        seq += 1
        if got.finished:
            assert (len(out), got.finish_reason) == (max_new, "max_new_tokens")
            return out, room >= len(new)


@pytest.mark.parametrize("batching", ["serial", "batched"])
def test_appends_roll_back_each_way_and_a_wrong_conversation_changes_nothing(models, reference, batching):
    """A conversation of four turns over APPEND (docs/serving.md "Conversations"), the device's view of what the
    session holds (prompt + committed output) giving keep and keep_crc (`hycoc.chat.ids_crc32`):

    - keep 9 after a 12-token answer: the sliding layers (kv_retain positions) moved past position 9, so the
      snapshot at OPEN's anchor 8 serves ("snapshot"; 9 - 8 = 1 position prefilled again);
    - keep = every held id: the last bonus has no KV yet ("crop"; that 1 position prefilled);
    - keep 3, before the second turn's anchor 10: nothing usable ("full"; 3 positions prefilled again).

    Before the first, a wrong keep_crc and a keep past the held ids get ERROR conversation_mismatch and leave the
    session as it was: the correct APPEND after them matches the reference engine's, round for round, bit for bit.
    /metrics counts each kind and the positions prefilled again; the KV reservation follows the conversation."""
    engine = make_engine(*models)
    try:
        with (
            ServerThread(engine, tree_rows=ROWS, auth_token=TOKEN, max_frame_bytes=MAX_FRAME, batching=batching) as srv,
            VerifierClient(srv.url, auth_token=TOKEN, timeout_s=60) as c,
        ):
            req = open_request(range(20, 30), max_new_tokens=12, anchor=8, seed=13)
            opened = c.open(req)
            ref = reference_session(reference, req)
            output, bonus_last = finish_turn(c, ref, reference.model, 12)
            held = list(range(20, 30)) + output
            live = srv.server.sessions[opened.session_id]
            assert live.tokens == held and len(held) == 10 + 12  # finished on max_new_tokens
            assert len(held) - 1 - 9 > reference.kv_retain  # keep 9 lies before the sliding window

            turn = np.arange(40, 46, dtype=np.int32)
            crc = ids_crc32(held[:9])
            with pytest.raises(ServerError) as e:
                c.append(AppendTurn(turn, 6, keep=9, keep_crc=crc ^ 1, anchor=10))
            assert e.value.code == "conversation_mismatch"
            assert f"crc32 {crc:#010x} here, {crc ^ 1:#010x} sent" in e.value.server_message
            with pytest.raises(ServerError) as e:
                c.append(AppendTurn(turn, 6, keep=len(held) + 1, keep_crc=ids_crc32(held), anchor=0))
            assert e.value.code == "conversation_mismatch"
            assert f"keeps {len(held) + 1} ids but the session holds {len(held)}" in e.value.server_message
            assert live.tokens == held and live.finished and live.appends == []
            # the session's KV, the snapshot at OPEN's anchor 8 (spare room) and the prefill pool (one session)
            pool = engine.prefill_transient_bytes()
            reserved = engine.session_kv_bytes(10 + 12 + ROWS, ROWS) + engine.snapshot_bytes(8) + pool
            assert srv.server.metrics.kv_bytes_reserved == reserved

            kinds, snapshot_at, expected = [], 8, []
            first_turn = turn
            for keep, turn, anchor, max_new in (
                (9, first_turn, 10, 6),
                (None, np.array([50, 51], np.int32), 0, 4),
                (3, np.arange(60, 63, dtype=np.int32), 4, 3),
            ):
                keep = len(held) if keep is None else keep
                kv_held = len(held) - bonus_last
                expected.append(
                    ("snapshot", keep - 8)
                    if keep == 9
                    else ("crop", keep - kv_held)
                    if keep == len(held)
                    else ("full", keep)
                )
                got = c.append(AppendTurn(turn, max_new, keep=keep, keep_crc=ids_crc32(held[:keep]), anchor=anchor))
                _, t = ref.append(turn, max_new, keep=keep, keep_crc=ids_crc32(held[:keep]), anchor=anchor)
                conversation = held[:keep] + turn.tolist()
                assert (got.session_id, got.t, t) == (opened.session_id, len(conversation) - 1, len(conversation) - 1)
                assert got.prefill_ms > 0 and live.tokens == conversation
                # the reservation follows the conversation, the turn's cap and one tree; the undo copy it held
                # during the prefill is given back, and a new anchor's snapshot replaces the old one
                snapshot_at = anchor or snapshot_at
                positions = len(conversation) + max_new + ROWS
                assert srv.server.metrics.kv_bytes_reserved == (
                    engine.session_kv_bytes(positions, ROWS) + engine.snapshot_bytes(snapshot_at) + pool
                )
                output, bonus_last = finish_turn(c, ref, reference.model, max_new)
                held = conversation + output
                kinds.append((live.appends[-1].kind, live.appends[-1].reprefilled))
            assert kinds == expected and expected[0] == ("snapshot", 1) and expected[2] == ("full", 3)
            assert [(p.kind, p.reprefilled) for p in ref.appends] == kinds
            values, _ = parse_metrics(http_get(srv.http_url + "/metrics")[1])
            assert {k: v for k, v in values.items() if k.startswith("hycoc_append")} == {
                'hycoc_appends_total{kind="crop"}': 1,
                'hycoc_appends_total{kind="snapshot"}': 1,
                'hycoc_appends_total{kind="full"}': 1,
                "hycoc_append_reprefilled_tokens_total": sum(n for _, n in expected),
            }
            assert values['hycoc_errors_total{kind="conversation_mismatch"}'] == 2
    finally:
        engine.close()


# ---------------------------------------------------------------------------------------------- disconnects


def test_disconnect_mid_round_frees_the_session(server, reference):
    raw = Raw(server.url)
    opened = raw.open(range(30, 60))
    live = server.server.sessions[opened.session_id]
    assert live.cache is not None
    t0, p0 = oracle_tree(reference.model, range(30, 60))
    raw.ws.send(round_frame(0, t0, p0))
    raw.close()  # gone before the reply
    assert wait_for(lambda: not server.server.sessions and live.cache is None)
    values, _ = parse_metrics(http_get(server.http_url + "/metrics")[1])
    assert values["hycoc_sessions_active"] == 0 and values["hycoc_sessions_total"] == 1
    assert values["hycoc_rounds_total"] == 1  # the round in flight completed; its reply was dropped
    good = Alongside(server.url, reference)  # and the server serves the next client
    good.step()
    good.client.close()


# ---------------------------------------------------------------------------------------------- health, metrics


def test_healthz(server):
    content_type, body = http_get(server.http_url + "/healthz")
    assert content_type.startswith("application/json")
    assert json.loads(body) == {
        "status": "ok",
        "model": "tiny-gemma4",
        "protocol_version": 6,
        "protocol_versions": [6],
        "sessions": 0,
        "tree_rows": ROWS,
        "chain_length": 4,
        "max_context": MAX_CONTEXT,
        "vocab_size": VOCAB,
        "max_frame_bytes": MAX_FRAME,
        "auth": True,
        "limits": {
            "handshake_timeout_s": 10.0,
            "frame_timeout_s": 30.0,
            "idle_timeout_s": 300.0,
            "max_connections": 256,
            "max_sessions": 64,
            "max_kv_bytes": 8 << 30,
            "auth_failures_per_minute": 10,
            "retry_after_s": 5.0,
        },
        "batching": {
            "mode": "batched",
            "max_batch_rows": 528,
            "max_batch_wait_ms": 2.0,
            "max_prefills": 1,
            "tree_budget": "fixed",
            "allowance": "fixed",
        },
    }
    with VerifierClient(server.url, auth_token=TOKEN) as c:
        c.open(open_request([3, 4, 5]))
        assert json.loads(http_get(server.http_url + "/healthz")[1])["sessions"] == 1


def test_metrics_count_exactly(server, reference):
    content_type, text = http_get(server.http_url + "/metrics")
    assert content_type == METRICS_CONTENT_TYPE
    values, types = parse_metrics(text)
    # the TYPE lines name a counter by its samples (_total)
    assert types == {f"{name}_total" if kind == "counter" else name: kind for name, kind in FAMILIES.items()}
    assert values["hycoc_rounds_total"] == 0 and np.isnan(values["hycoc_mat"])
    assert {k: v for k, v in values.items() if k.startswith("hycoc_append")} == {  # every kind from the start
        'hycoc_appends_total{kind="crop"}': 0,
        'hycoc_appends_total{kind="snapshot"}': 0,
        'hycoc_appends_total{kind="full"}': 0,
        "hycoc_append_reprefilled_tokens_total": 0,
    }
    assert values['hycoc_batch_rows_bucket{le="+Inf"}'] == 0 and values["hycoc_batch_rows_count"] == 0

    s = Alongside(server.url, reference)
    replies = [s.step() for _ in range(3)]
    with pytest.raises(ServerError):
        s.client.round(DraftTree(7, np.full(ROWS, 3, np.int32), np.arange(-1, ROWS - 1, dtype=np.int32)))
    with pytest.raises(AuthRefused):
        VerifierClient(server.url).open(open_request([3, 4]))
    values, _ = parse_metrics(http_get(server.http_url + "/metrics")[1])
    assert values["hycoc_sessions_active"] == 1
    s.client.close()
    assert wait_for(lambda: parse_metrics(http_get(server.http_url + "/metrics")[1])[0]["hycoc_sessions_active"] == 0)
    values, _ = parse_metrics(http_get(server.http_url + "/metrics")[1])

    tokens = len(s.output)
    assert tokens == sum(len(r.path_rows) + 1 for r in replies)
    server_ms = sum(r.server_ms for r in replies)  # float32 on the wire
    prefill_ms = s.opened.prefill_ms
    assert values["hycoc_rounds_total"] == 3
    assert values["hycoc_retries_total"] == 0
    assert values["hycoc_sessions_total"] == 1
    assert values["hycoc_sessions_active"] == 0
    assert values["hycoc_tokens_committed_total"] == tokens
    assert values["hycoc_mat"] == pytest.approx(tokens / 3, rel=1e-12)
    assert values["hycoc_server_ms_total"] == pytest.approx(server_ms, rel=1e-6)
    assert values["hycoc_prefill_ms_total"] == pytest.approx(prefill_ms, rel=1e-6)
    assert values["hycoc_g_ms_per_token"] == pytest.approx((server_ms + prefill_ms) / tokens, rel=1e-6)
    assert {k: v for k, v in values.items() if k.startswith("hycoc_errors_total")} == {
        'hycoc_errors_total{kind="auth_required"}': 1,
        'hycoc_errors_total{kind="bad_seq"}': 1,
    }
    # One session alone: every forward holds its ROWS rows (buckets are cumulative: le=4 has none, le=8 all).
    assert (values["hycoc_batch_rows_count"], values["hycoc_batch_rows_sum"]) == (3, 3 * ROWS)
    assert (values['hycoc_batch_rows_bucket{le="4.0"}'], values['hycoc_batch_rows_bucket{le="8.0"}']) == (0, 3)
    assert (values["hycoc_batch_sessions_count"], values["hycoc_batch_sessions_sum"]) == (3, 3)
    assert values['hycoc_batch_sessions_bucket{le="1.0"}'] == 3
    assert values["hycoc_queue_wait_seconds_count"] == 3
    assert 0 <= values["hycoc_queue_wait_seconds_sum"] < 3 * 5.0


# ---------------------------------------------------------------------------------------------- loading, CLI


def write_recipe(tmp_path: Path, models_dir: Path | None, *, head: str = "head", device: str = "cpu") -> Path:
    verifier = (models_dir / "verifier") if models_dir else tmp_path / "nowhere"
    text = f"""
[models]
verifier = "{verifier}"
head = "{(models_dir or tmp_path) / head}"
tokenizer = "{ROOT / "recipes" / "toy" / "models" / "verifier"}"
[tree]
chain_length = 3
node_budget = 6
[window]
head_window = 5
head_query_position_offset = 0
[handoff]
hidden = "post_norm"
scale_embedding = 0.1
scale_hidden = 0.2
scale_k_sliding = 0.03
scale_v_sliding = 0.04
scale_k_full = 0.05
scale_v_full = 0.06
[verifier]
device = "{device}"
dtype = "float32"
max_context = 96
max_frame_bytes = 8192
max_batch_rows = 64
max_batch_wait_ms = 0.5
tree_budget = "auto"
row_cost = [[7, 1.5], [64, 4.0]]
"""
    path = tmp_path / "recipe.toml"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def saved_models(tmp_path_factory, models):
    folder = tmp_path_factory.mktemp("tiny")
    models[0].save_pretrained(folder / "verifier")
    models[1].save_pretrained(folder / "head")
    return folder


def test_engine_from_recipe_takes_every_setting_from_the_recipe(tmp_path, saved_models):
    recipe = load_recipe(write_recipe(tmp_path, saved_models))
    engine = engine_from_recipe(recipe, device="cpu")
    assert (
        engine.head_window,
        engine.chain_length,
        engine.handoff_scales,
        engine.hidden,
        engine.head_query_position_offset,
        engine.max_context,
        engine.keep_set,
    ) == (5, 3, (0.1, 0.2, 0.03, 0.04, 0.05, 0.06), "post_norm", 0, 96, None)
    assert engine.eos_token_ids == {1}  # the verifier's generation_config.json (tiny: eos 1) before the tokenizer's
    config = json.loads((ROOT / "recipes" / "toy" / "models" / "verifier" / "tokenizer_config.json").read_text())
    assert engine.chat_format.template == config["chat_template"]  # the recipe's tokenizer folder's template
    assert engine.chat_format.template_sha256 == hashlib.sha256(config["chat_template"].encode()).hexdigest()
    assert engine.head is not None and engine.vocab_size == VOCAB
    assert server_options(recipe) == {
        "tree_rows": 7,
        "max_frame_bytes": 8192,
        "model_name": str(saved_models / "verifier"),
        "limits": ServerLimits(),
        "batching": "batched",
        "max_batch_rows": 64,
        "max_batch_wait_ms": 0.5,
        "max_prefills": 1,
        "tree_budget": "auto",
        "row_cost": RowCost(((7, 1.5), (64, 4.0)), source="recipe verifier.row_cost"),
        "min_rows_per_session": 2,
        "allowance": "auto",
        "allowance_target_ms": None,
        "allowance_floor": 0,
    }
    engine.close()


def test_missing_models_and_devices_are_named(tmp_path, saved_models):
    missing = re.escape(f"models.verifier = '{tmp_path / 'nowhere'}'")
    with pytest.raises(ModelNotFoundError, match=rf"the verifier model is not on this machine: .*{missing}.* does not"):
        engine_from_recipe(load_recipe(write_recipe(tmp_path, None)), device="cpu")
    with pytest.raises(ModelNotFoundError, match="the head model is not on this machine: .*models.head"):
        engine_from_recipe(load_recipe(write_recipe(tmp_path, saved_models, head="no-head")), device="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(DeviceUnavailable, match="device 'cuda' requested, but torch sees no CUDA device"):
            engine_from_recipe(load_recipe(write_recipe(tmp_path, saved_models, device="cuda")))
    result = CliRunner().invoke(app, ["verify-server", str(write_recipe(tmp_path, None))])
    assert result.exit_code == 1
    assert result.stderr.startswith("hycoc verify-server: the verifier model is not on this machine: ")


def test_verify_server_command_serves_until_sigterm(tmp_path, saved_models):
    recipe = write_recipe(tmp_path, saved_models)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hycoc.cli",
            "verify-server",
            str(recipe),
            "--port",
            "0",
            "--auth-token",
            TOKEN,
            "--batching",
            "serial",
            "--max-batch-rows",
            "32",
            "--tree-budget",
            "fixed",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("hycoc verify-server: listening on ws://127.0.0.1:"), (line, proc.stderr.read())
        url = line.split()[4]
        health = json.loads(http_get(url.replace("ws://", "http://") + "/healthz")[1])
        assert (health["tree_rows"], health["max_context"], health["auth"]) == (7, 96, True)
        # the flags override the recipe's batching keys, the others stay the recipe's
        assert health["batching"] == {
            "mode": "serial",
            "max_batch_rows": 32,
            "max_batch_wait_ms": 0.5,
            "max_prefills": 1,
            "tree_budget": "fixed",
            "allowance": "fixed",
        }
        with VerifierClient(url, auth_token=TOKEN) as c:
            opened = c.open(open_request([3, 4, 5, 6]))
            assert (opened.tree_rows, opened.t) == (7, 3)
            reply = c.round(DraftTree(0, np.array([6] * 7, np.int32), np.arange(-1, 6, dtype=np.int32)))
            assert reply.handoff.a == max(0, reply.handoff.t_prime - 5)
            assert reply.handoff.scales == pytest.approx((0.1, 0.2, 0.03, 0.04, 0.05, 0.06))
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
        assert re.fullmatch(
            r"hycoc verify-server: stopped \(SIGINT or SIGTERM\) after \d+ s; sessions closed\n", proc.stdout.read()
        )
        # the load is a progress step on stderr (plain lines, stderr being a pipe: hycoc/progress.py), start and end
        err = " ".join(proc.stderr.read().split())  # a line wider than the console wraps
        loading = re.escape(f"verify-server: loading the verifier {saved_models}") + r".*?"
        assert re.search(rf"\[hycoc \d\d:\d\d:\d\d\] {loading}: started", err), err
        assert re.search(rf"\[hycoc \d\d:\d\d:\d\d\] {loading}: done in \d+(\.\d)? s", err), err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_verify_server_names_a_busy_port(tmp_path, saved_models):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = CliRunner().invoke(
            app, ["verify-server", str(write_recipe(tmp_path, saved_models)), "--port", str(port)]
        )
    assert result.exit_code == 1
    last = result.stderr.splitlines()[-1]  # after transformers' loading progress bars
    assert last.startswith(f"hycoc verify-server: cannot listen on 127.0.0.1:{port}: ") and "in use" in last


def test_verify_server_help_documents_units_and_defaults():
    result = CliRunner().invoke(app, ["verify-server", "--help"], terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0
    for text in (
        "verifier.host, 127.0.0.1",
        "0 = any free port",
        "verifier.port, 8765",
        "verifier.device",
        "Authorization: Bearer TOKEN",
        "max_frame_bytes (bytes)",
        "/healthz",
        "/metrics",
        "verifier.batching, batched",
        "verifier.max_batch_rows, 528",
        "verifier.max_batch_wait_ms, 2 ms)",
    ):
        assert text in " ".join(result.stdout.replace("│", " ").split()), text  # rich wraps inside a box
