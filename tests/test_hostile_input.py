"""Hostile input stays cheap (issue 38 item 4): every malformed field gets its documented ERROR code, never
``internal_error`` or a logged traceback."""

from __future__ import annotations

import json

import pytest
from gemma4_fixture import write_tokenizer_folder

from hycoc.chat import ChatMismatch
from hycoc.chat_template import load_chat_format

#: Chat contracts an unauthenticated client may send in OPEN: out-of-range numbers and deep nesting among them.
HOSTILE_CONTRACTS = [
    '{"stop_ids": [1e999], "template_sha256": "x"}',  # int(inf): OverflowError before the fix
    '{"stop_ids": [-1e999], "template_sha256": "x"}',
    '{"stop_ids": [NaN], "template_sha256": "x"}',
    "[" * 2000,  # json's RecursionError before the fix
    '{"stop_ids": ' + "[" * 2000 + "]" * 2000 + ', "template_sha256": "x"}',
    '{"stop_ids": [' + "9" * 5000 + '], "template_sha256": "x"}',  # past int()'s digit limit
    '{"stop_ids": 5, "template_sha256": "x"}',
    '{"stop_ids": [[1]], "template_sha256": "x"}',
    "[]",
    "null",
]


@pytest.fixture(scope="module")
def chat_format(tmp_path_factory):
    return load_chat_format(write_tokenizer_folder(tmp_path_factory.mktemp("gemma4")))


@pytest.mark.parametrize("contract", HOSTILE_CONTRACTS, ids=range(len(HOSTILE_CONTRACTS)))
def test_a_hostile_chat_contract_is_a_chat_mismatch(chat_format, contract):
    with pytest.raises(ChatMismatch, match="the device's chat contract is not this hycoc's"):
        chat_format.check_contract(contract)
    json.loads(chat_format.contract())  # the format itself is intact


# ---- the in-session frame bound ------------------------------------------------------------------------------------

MAX_CONTEXT = 128
ROWS = 7


@pytest.fixture(scope="module")
def engine():
    import torch
    from hycoc.verifier import VerifierEngine
    from tiny_models import tiny_verifier

    torch.set_num_threads(1)
    eng = VerifierEngine(
        tiny_verifier(), head_window=6, handoff_scales=(0.1, 0.1, 0.05, 0.05, 0.05, 0.05), max_context=MAX_CONTEXT
    )
    yield eng
    eng.close()


def raw_frame(mtype, payload: bytes, length: int | None = None) -> bytes:
    """A frame with a right crc; ``length``: the payload length its header announces (default: the real one)."""
    import zlib

    from hycoc.protocol import wire

    n = len(payload) if length is None else length
    return wire.HEADER.pack(wire.MAGIC, wire.PROTOCOL_VERSION, mtype, 0, n, zlib.crc32(payload)) + payload


def test_in_session_frames_are_bounded_by_the_largest_open(engine):
    """Inside a session the bound is the documented one (docs/serving.md "Limits": incoming frames are at most the
    largest OPEN, `open_frame_bytes`), not max_frame_bytes (8 MiB): one byte over gets frame_too_large, whether the
    header announces it or the frame is longer than its header says. Before the fix these got length_mismatch /
    truncated (the session's limits were 8 MiB)."""
    import numpy as np
    from hycoc.verifier.server import ServerThread, open_frame_bytes
    from websockets.sync.client import connect

    from hycoc.protocol import wire
    from hycoc.protocol.messages import ErrorReply, Opened, OpenRequest, Sampling

    bound = open_frame_bytes(MAX_CONTEXT)
    assert bound == 131_644  # 16 + 50 + 4 x 127 + 65,535 + 65,535: the largest OPEN (protocol 6)
    with ServerThread(engine, tree_rows=ROWS) as srv:
        assert srv.server.in_frame_bytes == bound
        ws = connect(srv.url, compression=None, proxy=None, legacy=True, max_size=2**24)
        req = OpenRequest(prompt_ids=np.arange(3, 13, dtype=np.int32), sampling=Sampling(0.0, 64, 0.95))
        ws.send(wire.encode(req))
        assert isinstance(wire.decode(ws.recv(timeout=30)), Opened)
        over = raw_frame(wire.MessageType.ROUND, bytes(bound + 1 - wire.HEADER.size))
        lying = raw_frame(wire.MessageType.ROUND, bytes(bound + 1 - wire.HEADER.size), length=30)
        at_bound = raw_frame(wire.MessageType.ROUND, bytes(bound - wire.HEADER.size))
        codes = []
        for frame in (over, lying, at_bound):
            ws.send(frame)
            err = wire.decode(ws.recv(timeout=30))
            assert isinstance(err, ErrorReply)
            codes.append(err.code)
        assert codes == ["frame_too_large", "frame_too_large", "wrong_row_count"]
        ws.send(over)
        assert f"ROUND frame of {bound + 1} bytes: this receiver accepts at most max_frame_bytes = {bound}" in (
            wire.decode(ws.recv(timeout=30)).message
        )
        ws.close()


def test_a_few_hundred_fuzzed_frames_get_their_documented_codes(engine, caplog):
    """`hycoc.bench.loadtest.protocol_fuzz` (benchmarks/protocol_fuzz.py's cases) against the tiny engine: 400 malformed
    or mutated frames before OPEN, inside sessions and after finished turns; every answer is one of its case's
    documented codes, never internal_error, and nothing is logged at ERROR."""
    import asyncio
    import logging

    from hycoc.verifier.server import ServerThread, open_frame_bytes

    from hycoc.bench.loadtest.protocol_fuzz import error_counts, fuzz, target_of
    from hycoc.bench.loadtest.run import healthz

    caplog.set_level(logging.ERROR, logger="hycoc.verifier.server")
    with ServerThread(engine, tree_rows=ROWS) as srv:
        target = target_of(healthz(srv.url), ROWS)
        assert target.in_frame_bytes == open_frame_bytes(MAX_CONTEXT)
        stats = asyncio.run(fuzz(srv.url, target, frames=400, connections=2, seed=3))
        codes = error_counts(srv.url)
        assert healthz(srv.url)["status"] == "ok"
    assert stats.frames >= 400 and stats.findings == []
    assert "internal_error" not in codes and "internal_error" not in stats.codes()
    seen = set(stats.codes()) - {"answered", "closed"}
    assert len(seen) >= 25  # the cases reach most documented codes: header, sizes, fields, session state
    assert {"frame_too_large", "not_finite", "token_out_of_vocab", "bad_parent", "conversation_mismatch"} <= seen
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_freed_allocator_pages_go_back_to_the_os():
    """What grows RSS under fuzzing is the C allocator's free pages, not Python objects (tracemalloc across fuzz
    phases: < 0.1 MB): a freed buffer above the mmap threshold raises it, later buffers of that size come from the
    heap, and freeing every other one leaves pages malloc keeps. `release_memory` (glibc ``malloc_trim(0)``) gives
    them back."""
    from hycoc.verifier.server import memory

    if memory._malloc_trim() is None:
        pytest.skip("no glibc malloc_trim here")
    block = 200 * 1024
    del bytearray(block)[:]  # a freed mmapped block of this size raises glibc's mmap threshold above it
    blocks = [bytearray(block) for _ in range(500)]  # ~100 MB, now from the heap
    for b in blocks:
        b[::4096] = b"x" * len(b[::4096])  # touch every page
    del blocks[::2]  # ~50 MB free, spread between the blocks still held: not at the heap's top
    before, after = memory.release_memory()
    assert before - after > 30e6  # most of the 50 MB freed comes back
    del blocks


def test_the_server_releases_memory_periodically(engine):
    from hycoc.verifier.server import ServerThread

    with ServerThread(engine, tree_rows=ROWS, memory_release_s=0.05) as srv:
        m = srv.server.metrics
        for _ in range(400):
            if m.rss_bytes:
                break
            threading_wait(0.01)
        assert m.rss_bytes > 10e6 and m.memory_released >= 0
        text = m.exposition()
        assert "# TYPE hycoc_rss_bytes gauge" in text and "# TYPE hycoc_memory_released_bytes_total counter" in text


def threading_wait(seconds: float) -> None:
    import threading

    threading.Event().wait(seconds)


def test_a_release_collects_cycles_made_after_the_freeze():
    """In a serving process (`freeze_startup_objects` ran) `release_memory` runs a full collection first: garbage in
    a reference cycle (as an exception, its traceback and frames are) holding a 64 MB buffer is freed by the release,
    not by the rare full collection of a process with the model's objects tracked (the soak's RSS climb)."""
    import gc

    from hycoc.verifier.server import memory

    gc.disable()
    try:
        memory.freeze_startup_objects()
        cycle: list = [bytearray(64 * 10**6)]
        cycle.append(cycle)  # a list that holds itself: only the cycle collector frees it
        cycle[0][::4096] = b"x" * len(cycle[0][::4096])  # touch every page
        del cycle
        before, after = memory.release_memory()
        assert before - after > 50e6
    finally:
        gc.unfreeze()
        gc.enable()
