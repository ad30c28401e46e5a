"""Frame codec: round trips, exact byte counts, and one test per validation failure (code + named field)."""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import replace

import numpy as np
import pytest

from hycoc.chat import ids_crc32
from hycoc.protocol import wire
from hycoc.protocol.messages import (
    AppendTurn,
    Close,
    DraftTree,
    ErrorReply,
    HandOff,
    Opened,
    OpenRequest,
    RoundReply,
    Sampling,
)

VOCAB = 1000
# Gemma 4 26B-A4B: hidden 2816; last sliding layer 8 KV heads x 256; last full-attention layer 2 KV heads x 512.
GEMMA_H, GEMMA_DS, GEMMA_DF = 2816, 8 * 256, 2 * 512
# A small verifier for the hand-off tests.
H, DS, DF = 4, 6, 2
# Each verifier's hand-off sizes as the fields of the same names in Opened and Limits.
SIZES = dict(hidden_size=H, kv_dim_sliding=DS, kv_dim_full=DF)
GEMMA_SIZES = dict(hidden_size=GEMMA_H, kv_dim_sliding=GEMMA_DS, kv_dim_full=GEMMA_DF)
SCALES = (0.5, 0.25, 0.125, 1.0, 2.0, 0.0625)
rng = np.random.default_rng(0)


# ------------------------------------------------------------------------------------------------ builders


def chain_tree(rows: int, seq: int = 0) -> DraftTree:
    tokens = rng.integers(0, VOCAB, rows).astype(np.int32)
    parents = np.arange(-1, rows - 1, dtype=np.int32)
    return DraftTree(seq, tokens, parents)


def handoff(t_prime: int, a: int, bonus: int, h=H, ds=DS, df=DF) -> HandOff:
    n = t_prime - a

    def i8(*shape):
        return rng.integers(-128, 128, shape, dtype=np.int8)

    return HandOff(t_prime, a, bonus, i8(2 * h), i8(n, ds), i8(n, ds), i8(n, df), i8(n, df), SCALES)


def reply(rows: int = 5, path=(1, 3), with_handoff: bool = True, chain=(), n_positions: int = 3) -> RoundReply:
    samples = rng.integers(0, VOCAB, rows).astype(np.int32)
    bonus = int(samples[path[-1] if path else 0])
    t_prime = 10 + 1 + len(path)
    ho = handoff(t_prime, t_prime - n_positions, bonus) if with_handoff else None
    return RoundReply(
        seq=7,
        samples=samples,
        path_rows=np.array(path, np.int32),
        bonus=bonus,
        server_ms=21.5,
        finished=False,
        handoff=ho,
        chain=np.array(chain, np.int32),
        allowance=rows,
    )


def open_request(**kw) -> OpenRequest:
    args = dict(
        prompt_ids=np.array([2, 10, 999, 0], np.int32),
        sampling=Sampling(0.5, 64, 0.75),
        seed=2**63 + 5,
        acceptance="epsilon",
        epsilon=0.25,
        draft_place="device",
        max_new_tokens=256,
    )
    args.update(kw)
    return OpenRequest(**args)


OPENED = Opened(
    session_id=2**40 + 3,
    t=3,
    prefill_ms=12.5,
    max_context=4096,
    tree_rows=33,
    vocab_size=VOCAB,
    **SIZES,
    stop_ids=(1, 106, 50),
)
LIMITS = wire.Limits(vocab_size=VOCAB, tree_rows=5, max_context=4096, **SIZES)


def frame(
    mtype: int,
    payload: bytes,
    *,
    version: int = wire.PROTOCOL_VERSION,
    flags: int = 0,
    magic: bytes = wire.MAGIC,
    length: int | None = None,
) -> bytes:
    """A raw frame, bypassing encode's validation."""
    length = len(payload) if length is None else length
    return wire.HEADER.pack(magic, version, mtype, flags, length, zlib.crc32(payload)) + payload


def patch(data: bytes, offset: int, fmt: str, *values) -> bytes:
    """Overwrite payload bytes at ``offset`` and fix the header crc, so only the field itself is wrong."""
    buf = bytearray(data)
    struct.pack_into("<" + fmt, buf, wire.HEADER.size + offset, *values)
    return refresh_crc(buf)


def refresh_crc(buf) -> bytes:
    buf = bytearray(buf)
    struct.pack_into("<I", buf, 12, zlib.crc32(buf[wire.HEADER.size :]))
    return bytes(buf)


def raw_tree(
    tokens, parents, seq: int = 0, *, version: int = wire.PROTOCOL_VERSION, scores=None, has_scores: int | None = None
) -> bytes:
    """A ROUND frame written by hand (u32 seq, u16 R, u8 has_scores; then tokens, parents, fp16 scores: the layout of
    versions 4 and 5; ``version`` only goes into the header)."""
    tokens, parents = np.asarray(tokens, "<i4"), np.asarray(parents, "<i2")
    fixed = struct.pack("<IHB", seq, len(tokens), (scores is not None) if has_scores is None else has_scores)
    tail = b"" if scores is None else np.asarray(scores, "<f2").tobytes()
    return frame(wire.MessageType.ROUND, fixed + tokens.tobytes() + parents.tobytes() + tail, version=version)


def fails(code: str, data: bytes, limits: wire.Limits | None = None, *needles: str) -> wire.WireError:
    with pytest.raises(wire.WireError) as info:
        wire.decode(data, limits)
    err = info.value
    assert err.code == code, err
    assert type(err) is wire.ERROR_CLASSES[code]
    for needle in needles:
        assert needle in err.message, (needle, err.message)
    return err


# Payload offsets of the fields patched below (the module docstring's tables, summed by hand).
OPEN_AT = dict(
    temperature=0,
    top_k=4,
    top_p=8,
    seed=12,
    epsilon=20,
    acceptance=24,
    draft_place=25,
    auth_len=26,
    chat_len=28,
    max_new_tokens=30,
    n_prompt=34,
    anchor=38,
    draft_ms_floor=42,
    draft_ms_tree=46,
    prompt=50,
)
APPEND_AT = dict(max_new_tokens=0, keep=4, keep_crc=8, anchor=12, n_tokens=16, tokens=20)
REPLY_AT = dict(
    seq=0,
    bonus=4,
    server_ms=8,
    finished=12,
    has_handoff=13,
    rows=14,
    n_path=16,
    n_chain=18,
    has_verified=20,
    allowance=21,
    samples=23,
)


def handoff_at(m: RoundReply) -> int:
    """Payload offset of the hand-off block (after its 12 bytes of sizes)."""
    mask = 0 if m.verified is None else (m.samples.size + 7) // 8
    return REPLY_AT["samples"] + 4 * m.samples.size + 2 * m.path_rows.size + 4 * m.chain.size + mask + 12


# ------------------------------------------------------------------------------------------------ round trips


def assert_same_array(got: np.ndarray, want: np.ndarray, dtype) -> None:
    assert got.dtype == dtype and got.shape == np.shape(want)
    assert got.tobytes() == np.asarray(want, dtype).tobytes()


CONTRACT = '{"stop_ids":[1,50,106],"template_sha256":"' + "ab" * 32 + '"}'


@pytest.mark.parametrize("auth", [None, "s3cret", "clé-🔑"])
@pytest.mark.parametrize("chat", [None, CONTRACT])
@pytest.mark.parametrize("anchor", [0, 3])
def test_open_round_trip(auth, chat, anchor):
    m = open_request(auth_token=auth, chat=chat, anchor=anchor)
    data = wire.encode(m)
    n_auth, n_chat = len((auth or "").encode()), len((chat or "").encode())
    assert len(data) == 16 + 50 + 4 * 4 + n_auth + n_chat == wire.open_nbytes(4, n_auth, n_chat)
    got = wire.decode(data, wire.Limits(vocab_size=VOCAB, max_context=16))
    assert_same_array(got.prompt_ids, m.prompt_ids, np.int32)
    assert got.sampling == m.sampling  # values exact in float32
    assert (
        got.seed,
        got.acceptance,
        got.epsilon,
        got.draft_place,
        got.max_new_tokens,
        got.auth_token,
        got.chat,
        got.anchor,
    ) == (m.seed, m.acceptance, m.epsilon, m.draft_place, m.max_new_tokens, auth, chat, anchor)


def test_open_byte_layout_is_exact():
    """OPEN built field by field with struct (module docstring: 50 B fixed part, then i32[T], auth, chat)."""
    m = replace(open_request(auth_token="clé", chat=CONTRACT, anchor=2), draft_ms_floor=19.5, draft_ms_tree=57.75)
    auth, chat = "clé".encode(), CONTRACT.encode()
    fixed = (
        struct.pack("<f", 0.5)
        + struct.pack("<I", 64)
        + struct.pack("<f", 0.75)
        + struct.pack("<Q", 2**63 + 5)
        + struct.pack("<f", 0.25)
        + bytes([1, 0])
        + struct.pack("<HH", len(auth), len(chat))
        + struct.pack("<III", 256, 4, 2)
        + struct.pack("<ff", 19.5, 57.75)
    )  # max_new_tokens, T, anchor, the device's drafting ms per round without / with the SLM pass
    assert len(fixed) == 50
    payload = fixed + struct.pack("<4i", 2, 10, 999, 0) + auth + chat
    assert wire.encode(m) == frame(wire.MessageType.OPEN, payload)
    got = wire.decode(frame(wire.MessageType.OPEN, payload))
    assert (got.anchor, got.draft_ms_floor, got.draft_ms_tree) == (2, 19.5, 57.75)


@pytest.mark.parametrize("field", ["draft_ms_floor", "draft_ms_tree"])
@pytest.mark.parametrize("value, code", [(-1.0, "out_of_range"), (60_001.0, "out_of_range"), (math.inf, "not_finite")])
def test_open_drafting_ms_out_of_range(field, value, code):
    data = patch(wire.encode(open_request()), OPEN_AT[field], "f", value)
    fails(code, data, None, f"OpenRequest.{field}")


@pytest.mark.parametrize("acceptance", ["exact", "epsilon"])
@pytest.mark.parametrize("place", ["device", "server-head", "cloud-mtp"])
def test_open_enums_round_trip(acceptance, place):
    m = open_request(acceptance=acceptance, draft_place=place, sampling=Sampling(0.0, 1, 1.0), epsilon=1.0)
    got = wire.decode(wire.encode(m))
    assert (got.acceptance, got.draft_place, got.sampling) == (acceptance, place, Sampling(0.0, 1, 1.0))


def test_float_fields_travel_as_float32():
    got = wire.decode(wire.encode(open_request(epsilon=0.005)))
    assert got.epsilon == float(np.float32(0.005))


def test_opened_round_trip():
    data = wire.encode(OPENED)
    assert len(data) == 16 + 42 + 4 * 3  # three stop ids
    assert wire.decode(data) == OPENED


def test_opened_stop_ids_checked():
    with pytest.raises(wire.OutOfRange, match="stop_ids has 0 ids"):
        wire.encode(replace(OPENED, stop_ids=()))
    with pytest.raises(wire.TokenOutOfVocab, match="Opened.stop_ids"):
        wire.validate(replace(OPENED, stop_ids=(1, VOCAB)), wire.Limits(vocab_size=VOCAB))


def test_round_round_trip():
    m = DraftTree(
        seq=4_000_000_000, tokens=np.array([5, 7, 7, 999, 0], np.int32), parents=np.array([-1, 0, 0, 1, 3], np.int32)
    )
    got = wire.decode(wire.encode(m), LIMITS)
    assert got.seq == m.seq
    assert_same_array(got.tokens, m.tokens, np.int32)
    assert_same_array(got.parents, m.parents, np.int32)


def test_round_at_the_int16_parent_limit():
    m = chain_tree(wire.MAX_TREE_ROWS)
    got = wire.decode(wire.encode(m))
    assert got.parents[-1] == 32766
    assert_same_array(got.parents, m.parents, np.int32)


@pytest.mark.parametrize("with_handoff", [True, False])
@pytest.mark.parametrize("path", [(), (1,), (1, 3, 4)])
def test_reply_round_trip(with_handoff, path):
    m = reply(path=path, with_handoff=with_handoff, chain=(3, 4, 999, 0))
    got = wire.decode(wire.encode(m), LIMITS)
    assert (got.seq, got.bonus, got.server_ms, got.finished) == (m.seq, m.bonus, m.server_ms, m.finished)
    assert_same_array(got.samples, m.samples, np.int32)
    assert_same_array(got.path_rows, m.path_rows, np.int32)
    assert_same_array(got.chain, m.chain, np.int32)
    if not with_handoff:
        assert got.handoff is None
        return
    h, g = m.handoff, got.handoff
    assert (g.t_prime, g.a, g.bonus, g.scales, g.n_positions) == (h.t_prime, h.a, h.bonus, h.scales, 3)
    for name in ("x_hat", "k_sliding", "v_sliding", "k_full", "v_full"):
        assert_same_array(getattr(g, name), getattr(h, name), np.int8)


def test_reply_finished_and_empty_handoff_window():
    m = reply(n_positions=0)
    m = RoundReply(m.seq, m.samples, m.path_rows, m.bonus, 0.0, True, m.handoff, m.chain)
    got = wire.decode(wire.encode(m), LIMITS)
    assert got.finished and got.handoff.k_full.shape == (0, DF) and got.handoff.k_sliding.shape == (0, DS)


def test_close_and_error_round_trip():
    assert wire.decode(wire.encode(Close(2**64 - 1))) == Close(2**64 - 1)
    e = ErrorReply("bad_parent", "DraftTree.parents[3] = 5: in [0, 3) — fix the tree")
    assert wire.decode(wire.encode(e)) == e


def test_decoded_arrays_do_not_alias_the_frame():
    buf = bytearray(wire.encode(reply()))
    got = wire.decode(buf, LIMITS)
    samples, x_hat = got.samples.copy(), got.handoff.x_hat.copy()
    buf[wire.HEADER.size :] = bytes(len(buf) - wire.HEADER.size)
    assert_same_array(got.samples, samples, np.int32)
    assert_same_array(got.handoff.x_hat, x_hat, np.int8)


# ------------------------------------------------------------------------------------------------ byte counts


def test_header_and_handoff_fixed_sizes():
    assert wire.HEADER.size == 16
    assert wire.HANDOFF_FIXED.size == 44 and wire.HANDOFF_FIXED.format == "<IIIIffffffI"


def test_round_bytes_at_b32():
    # 16 header + 7 (seq, rows, has_scores) + 33 * 4 + 33 * 2, + 33 * 2 fp16 scores when sent
    assert wire.tree_nbytes(33, scores=False) == 221 == len(wire.encode(chain_tree(33)))
    assert wire.tree_nbytes(33) == 287 == 16 + 7 + 132 + 66 + 66
    assert len(wire.encode(scored(chain_tree(33)))) == 287
    assert len(wire.encode(chain_tree(1))) == 29 == wire.tree_nbytes(1, scores=False)


def test_gemma4_handoff_bytes():
    per_round = wire.handoff_nbytes(GEMMA_H, GEMMA_DS, GEMMA_DF, 0)
    assert per_round == 44 + 5632
    assert wire.handoff_nbytes(GEMMA_H, GEMMA_DS, GEMMA_DF, 1) - per_round == 6144
    assert wire.handoff_nbytes(GEMMA_H, GEMMA_DS, GEMMA_DF, 4) == 44 + 5632 + 4 * 6144 == 30_252
    assert wire.handoff_nbytes(GEMMA_H, GEMMA_DS, GEMMA_DF, 1024) == 6_297_132  # first reply, W = 1024


def test_gemma4_first_reply_frame():
    samples = np.arange(33, dtype=np.int32)
    ho = handoff(t_prime=2000, a=2000 - 1024, bonus=0, h=GEMMA_H, ds=GEMMA_DS, df=GEMMA_DF)
    m = RoundReply(0, samples, np.zeros(0, np.int32), 0, 850.0, handoff=ho, allowance=33)
    data = wire.encode(m)
    ho_bytes = wire.handoff_nbytes(GEMMA_H, GEMMA_DS, GEMMA_DF, 1024)
    assert len(data) == wire.reply_nbytes(33, 0, 0, ho_bytes) == 16 + 23 + 132 + 12 + 6_297_132
    limits = wire.Limits(vocab_size=262_144, tree_rows=33, max_context=262_144, **GEMMA_SIZES)
    got = wire.decode(data, limits)
    assert_same_array(got.handoff.v_full, ho.v_full, np.int8)


def test_handoff_block_layout_is_exact():
    m = reply(path=(1, 2))
    data = wire.encode(m)
    h = m.handoff
    start = wire.HEADER.size + handoff_at(m)
    assert struct.unpack_from("<III", data, start - 12) == (H, DS, DF)
    body = b"".join(a.tobytes() for a in (h.x_hat, h.k_sliding, h.v_sliding, h.k_full, h.v_full))
    fixed = struct.pack("<IIIIffffffI", h.t_prime, h.a, h.bonus, 3, *SCALES, zlib.crc32(body))
    assert data[start:] == fixed + body
    assert len(data) == wire.reply_nbytes(5, 2, 0, wire.handoff_nbytes(H, DS, DF, 3))


def test_reply_bytes_without_handoff():
    m = reply(rows=33, path=(1, 2, 3), with_handoff=False, chain=(1, 2, 3, 4))
    assert len(wire.encode(m)) == wire.reply_nbytes(33, 3, 4) == 16 + 23 + 132 + 6 + 16
    kept = np.ones(33, bool)
    kept[20:] = False  # 33 rows: a mask of 5 bytes
    m = replace(m, verified=kept)
    assert len(wire.encode(m)) == wire.reply_nbytes(33, 3, 4, verified=True) == 16 + 23 + 132 + 6 + 16 + 5
    assert (wire.reply_nbytes(33, 0), wire.reply_nbytes(33, 0, verified=True)) == (171, 176)


# ------------------------------------------------------------------------------------------------ header checks


def test_bad_magic():
    fails("bad_magic", frame(wire.MessageType.CLOSE, bytes(8), magic=b"HTTP"), None, "b'HTTP'", "b'HYCO'")


def test_unsupported_version_names_the_supported_one_and_the_fix():
    assert wire.PROTOCOL_VERSION == 6  # the REPLY's allowance (5: conversations re-rendered by the template)
    assert wire.SUPPORTED_VERSIONS == (6,)
    for other in (0, 2, 3, 4, 5, 7, 65535):
        data = frame(wire.MessageType.CLOSE, bytes(8), version=other)
        err = fails(
            "unsupported_version",
            data,
            None,
            f"frame speaks protocol version {other}: ",
            "this side speaks version(s) 6; ",
        )
        assert err.message.endswith(wire.OLD_VERSION_FIX)
        with pytest.raises(wire.UnsupportedVersion, match="version\\(s\\) 6"):
            wire.frame_version(data)
    assert "hycoc build RECIPE" in wire.OLD_VERSION_FIX  # the fix names the command that rebuilds a bundle
    for other in (2, 3, 4, 5):
        with pytest.raises(wire.UnsupportedVersion) as info:
            wire.encode(Close(1), version=other)
        assert info.value.message == (
            f"protocol version {other}: this side speaks version(s) 6; " + wire.OLD_VERSION_FIX
        )
        with pytest.raises(wire.UnsupportedVersion):
            wire.tree_nbytes(33, version=other)
        with pytest.raises(wire.UnsupportedVersion):
            wire.reply_nbytes(33, 0, version=other)
        if other in wire.LEGACY_ERROR_VERSIONS:  # an old peer's refusal: ERROR's payload under its own header
            old = wire.error_frame(wire.BadScores("x"), version=other)
            now = wire.error_frame(wire.BadScores("x"))
            assert struct.unpack_from("<H", old, 4) == (other,) and old[:4] == now[:4] and old[6:] == now[6:]
        else:
            with pytest.raises(wire.UnsupportedVersion):
                wire.error_frame(wire.BadScores("x"), version=other)


@pytest.mark.parametrize("mtype", [0, 8, 255])
def test_unknown_message_type(mtype):
    fails("unknown_message_type", frame(mtype, bytes(8)), None, f"message type = {mtype}", "7 (APPEND)")


def test_bad_flags():
    fails("bad_flags", frame(wire.MessageType.CLOSE, bytes(8), flags=1), None, "flags", "must be 0")


def test_frame_too_large_is_refused_from_the_header_alone():
    header = frame(wire.MessageType.ROUND, b"", length=10_000_000)  # no payload follows
    err = fails("frame_too_large", header, wire.Limits(max_frame_bytes=4096), "10000016", "max_frame_bytes = 4096")
    assert "ROUND" in err.message
    with pytest.raises(wire.FrameTooLarge):
        wire.decode_header(header[:16], wire.Limits(max_frame_bytes=4096))


def test_truncated_header():
    fails("truncated", wire.encode(Close(1))[:10], None, "10 bytes", "16")


def test_truncated_payload():
    data = wire.encode(chain_tree(33))
    fails("truncated", data[:-5], None, "ROUND", "216 bytes", "221")


def test_trailing_bytes_are_a_length_mismatch():
    fails("length_mismatch", wire.encode(Close(1)) + b"\0", None, "25 bytes", "24")


def test_count_larger_than_payload_is_a_length_mismatch():
    data = patch(wire.encode(chain_tree(5)), 4, "H", 6)  # says 6 rows, carries 5
    fails("length_mismatch", data, None, "parents")


def test_payload_with_extra_bytes_is_a_length_mismatch():
    data = refresh_crc(wire.encode(Close(1)) + b"\0\0")
    data = bytearray(data)
    struct.pack_into("<I", data, 8, 10)
    fails("length_mismatch", refresh_crc(data), None, "CLOSE", "2 bytes after")


def test_crc_mismatch():
    data = bytearray(wire.encode(chain_tree(33)))
    data[30] ^= 0x01
    fails("crc_mismatch", bytes(data), None, "ROUND payload crc32")


# ------------------------------------------------------------------------------------------------ ROUND checks


def test_token_outside_vocabulary_names_row_and_id():
    fails(
        "token_out_of_vocab",
        raw_tree([1, 2, 1000], [-1, 0, 1]),
        wire.Limits(vocab_size=VOCAB),
        "tokens[2] = 1000",
        "[0, 1000)",
    )


def test_negative_token_id():
    fails("token_out_of_vocab", raw_tree([1, -3], [-1, 0]), None, "tokens[1] = -3")


def test_wrong_row_count_names_expected_and_got():
    fails("wrong_row_count", wire.encode(chain_tree(6)), LIMITS, "6 rows", "at most 5")


def test_a_tree_under_an_allowance_may_hold_fewer_rows_than_tree_rows():
    """Protocol 6: a ROUND drafted under a smaller allowance has fewer rows than OPENED's tree_rows (B + 1); the
    wire takes any 1 <= R <= tree_rows (the session's allowance is the verifier's check: over_allowance)."""
    for rows in (1, 2, 4):
        got = wire.decode(wire.encode(chain_tree(rows)), LIMITS)
        assert len(got.tokens) == rows


def test_reply_allowance_round_trip_and_offset():
    m = replace(reply(rows=5, path=(1,), with_handoff=False), allowance=3)
    data = wire.encode(m)
    assert struct.unpack_from("<H", data, wire.HEADER.size + REPLY_AT["allowance"]) == (3,)
    assert wire.decode(data, LIMITS).allowance == 3
    assert wire.decode(wire.encode(replace(m, allowance=5)), LIMITS).allowance == 5
    fails("out_of_range", wire.encode(replace(m, allowance=6)), LIMITS, "allowance = 6", "[1, 5]")
    with pytest.raises(wire.OutOfRange, match="allowance = 0"):  # below the root: refused by encode too
        wire.encode(replace(m, allowance=0))
    finished = replace(m, allowance=0, finished=True, finish_reason="stop")
    assert wire.decode(wire.encode(finished), LIMITS).allowance == 0  # a finished reply grants nothing


def test_empty_tree():
    fails("wrong_row_count", raw_tree([], []), None, "0 rows")


def test_root_parent_must_be_minus_one():
    fails("bad_parent", raw_tree([1, 2], [0, 0]), None, "parents[0] = 0", "-1")


@pytest.mark.parametrize(
    "parents, row",
    [
        ([-1, 0, 2], 2),  # self loop
        ([-1, 0, 3, 1], 2),  # later row
        ([-1, 2, 1], 1),  # cycle 1 -> 2 -> 1
        ([-1, 0, -1], 2),  # a second root
        ([-1, 0, -7], 2),
    ],
)
def test_parent_out_of_range_or_not_earlier(parents, row):
    fails(
        "bad_parent", raw_tree([1] * len(parents), parents), None, f"parents[{row}] = {parents[row]}", f"in [0, {row})"
    )


def test_encode_refuses_what_decode_refuses():
    with pytest.raises(wire.BadParent):
        wire.encode(DraftTree(0, np.array([1, 2], np.int32), np.array([-1, 1], np.int32)))
    with pytest.raises(wire.WrongRowCount):
        wire.encode(chain_tree(wire.MAX_TREE_ROWS + 1))
    with pytest.raises(wire.TokenOutOfVocab):
        wire.encode(DraftTree(0, np.array([2**31], np.int64), np.array([-1], np.int32)))
    with pytest.raises(wire.BadShape):
        wire.encode(DraftTree(0, np.array([1.0]), np.array([-1], np.int32)))


# ------------------------------------------------------------------------------------------------ OPEN checks


def open_frame(**kw) -> bytes:
    return wire.encode(open_request(**kw))


@pytest.mark.parametrize(
    "field, value", [("temperature", float("nan")), ("top_p", float("inf")), ("epsilon", float("-inf"))]
)
def test_open_non_finite(field, value):
    fails("not_finite", patch(open_frame(), OPEN_AT[field], "f", value), None, field, "finite")


@pytest.mark.parametrize(
    "field, fmt, value, code, needle",
    [
        ("temperature", "f", -0.5, "bad_temperature", ">= 0"),
        ("top_k", "I", 0, "bad_top_k", ">= 1"),
        ("top_p", "f", 0.0, "bad_top_p", "(0, 1]"),
        ("top_p", "f", 1.5, "bad_top_p", "(0, 1]"),
        ("epsilon", "f", 0.0, "bad_epsilon", "(0, 1]"),
        ("epsilon", "f", 2.0, "bad_epsilon", "(0, 1]"),
        ("acceptance", "B", 2, "bad_enum", "0 (exact), 1 (epsilon)"),
        ("draft_place", "B", 9, "bad_enum", "2 (cloud-mtp)"),
        ("max_new_tokens", "I", 0, "out_of_range", "[1, "),
    ],
)
def test_open_field_out_of_range(field, fmt, value, code, needle):
    fails(code, patch(open_frame(), OPEN_AT[field], fmt, value), None, field, needle)


def test_open_prompt_longer_than_context():
    fails("context_overflow", open_frame(), wire.Limits(max_context=3), "4 tokens", "max_context = 3")


def test_open_prompt_filling_the_context_leaves_no_room():
    fails("context_overflow", open_frame(), wire.Limits(max_context=4), "4 tokens", "at most 3 tokens")
    assert wire.decode(open_frame(), wire.Limits(max_context=5)).prompt_ids.size == 4


def test_open_prompt_token_outside_vocabulary():
    fails("token_out_of_vocab", open_frame(), wire.Limits(vocab_size=999), "prompt_ids[2] = 999", "[0, 999)")


def test_open_empty_prompt():
    data = bytearray(open_frame(prompt_ids=np.array([5], np.int32))[:-4])  # drop the one prompt id
    struct.pack_into("<I", data, 8, len(data) - wire.HEADER.size)
    fails("out_of_range", patch(refresh_crc(data), OPEN_AT["n_prompt"], "I", 0), None, "prompt_ids is empty")
    with pytest.raises(wire.OutOfRange):
        wire.encode(open_request(prompt_ids=np.zeros(0, np.int32)))


def test_open_auth_token_not_utf8():
    data = open_frame(auth_token="ab")
    data = refresh_crc(data[:-2] + b"\xff\xfe")
    fails("bad_text", data, None, "auth_token", "utf-8")


def test_encode_refuses_empty_auth_token():
    with pytest.raises(wire.BadText):
        wire.encode(open_request(auth_token=""))


# ------------------------------------------------------------------------------------------------ OPENED checks


def test_opened_config_mismatch():
    fails("config_mismatch", wire.encode(OPENED), wire.Limits(hidden_size=2816), "hidden_size = 4", "2816")


def test_opened_nan_prefill():
    fails("not_finite", patch(wire.encode(OPENED), 12, "f", float("nan")), None, "prefill_ms")


def test_limits_from_opened():
    lim = wire.Limits.from_opened(OPENED)
    assert (lim.vocab_size, lim.tree_rows, lim.max_context, lim.hidden_size, lim.kv_dim_sliding, lim.kv_dim_full) == (
        VOCAB,
        33,
        4096,
        H,
        DS,
        DF,
    )


# ------------------------------------------------------------------------------------------------ REPLY checks


def test_reply_server_ms_nan():
    fails("not_finite", patch(wire.encode(reply()), REPLY_AT["server_ms"], "f", float("nan")), LIMITS, "server_ms")


def test_reply_negative_server_ms():
    data = patch(wire.encode(reply()), REPLY_AT["server_ms"], "f", -1.0)
    fails("out_of_range", data, LIMITS, "server_ms", ">= 0")


def test_reply_finished_byte_beyond_the_finish_reasons():
    fails("bad_enum", patch(wire.encode(reply()), REPLY_AT["finished"], "B", 4), LIMITS, "finished", "2 (length)")


@pytest.mark.parametrize("code, reason", [(0, None), (1, "stop"), (2, "max_new_tokens"), (3, "length")])
def test_reply_finish_reason_round_trip(code, reason):
    m = replace(reply(with_handoff=False), finished=reason is not None, finish_reason=reason)
    data = wire.encode(m)
    assert data[wire.HEADER.size + REPLY_AT["finished"]] == code
    got = wire.decode(data, LIMITS)
    assert (got.finished, got.finish_reason) == (reason is not None, reason)


def test_reply_finish_reason_without_finished_is_refused():
    with pytest.raises(wire.WireError, match="finish_reason"):
        wire.encode(replace(reply(), finish_reason="length"))


def test_reply_wrong_sample_rows():
    fails("wrong_row_count", wire.encode(reply(rows=6)), LIMITS, "6 rows", "at most 5")


def test_reply_sample_outside_vocabulary():
    data = patch(wire.encode(reply(path=(1,))), REPLY_AT["samples"] + 4 * 3, "i", VOCAB + 5)
    fails("token_out_of_vocab", data, LIMITS, f"samples[3] = {VOCAB + 5}")


@pytest.mark.parametrize("path, index", [((0,), 0), ((2, 2), 1), ((3, 1), 1), ((5,), 0)])
def test_reply_bad_path_rows(path, index):
    m = reply(path=(1, 2)[: len(path)], with_handoff=False)
    data = wire.encode(m)
    at = REPLY_AT["samples"] + 4 * 5
    for i, row in enumerate(path):
        data = patch(data, at + 2 * i, "h", row)
    # keep bonus == samples[end] so only the path is wrong
    end = path[-1] if 0 < path[-1] < 5 else 0
    data = patch(data, REPLY_AT["bonus"], "i", int(m.samples[end]))
    fails("bad_path", data, LIMITS, f"path_rows[{index}] = {path[index]}", "[1, 5)")


def test_reply_bonus_must_be_the_sample_at_the_endpoint():
    m = reply(path=(1, 3))
    data = patch(wire.encode(m), REPLY_AT["bonus"], "i", (m.bonus + 1) % VOCAB)
    fails("bonus_mismatch", data, LIMITS, "RoundReply.bonus", "samples[3]")


def test_handoff_bonus_must_be_the_reply_bonus():
    m = reply()
    data = patch(wire.encode(m), handoff_at(m) + 8, "I", (m.bonus + 1) % VOCAB)
    fails("bonus_mismatch", data, LIMITS, "HandOff.bonus")


@pytest.mark.parametrize("index, name", [(0, "e"), (3, "v_sliding"), (5, "v_full")])
def test_handoff_scale_not_finite(index, name):
    m = reply()
    fails(
        "not_finite",
        patch(wire.encode(m), handoff_at(m) + 16 + 4 * index, "f", float("inf")),
        LIMITS,
        f"scales[{name}]",
    )


def test_handoff_scale_not_positive():
    m = reply()
    fails("out_of_range", patch(wire.encode(m), handoff_at(m) + 20, "f", 0.0), LIMITS, "scales[h]", "> 0")


@pytest.mark.parametrize(
    "name, limit",
    [("hidden_size", "hidden_size"), ("kv_dim_sliding", "kv_dim_sliding"), ("kv_dim_full", "kv_dim_full")],
)
def test_handoff_sizes_must_match_limits(name, limit):
    kw = dict(hidden_size=H, kv_dim_sliding=DS, kv_dim_full=DF)
    kw[limit] += 1
    lim = wire.Limits(vocab_size=VOCAB, tree_rows=5, **kw)
    fails("handoff_size_mismatch", wire.encode(reply()), lim, name, f"must be {kw[limit]}")


def test_handoff_positions_beyond_context():
    fails(
        "context_overflow",
        wire.encode(reply(n_positions=3)),
        wire.Limits(max_context=2),
        "n_positions = 3",
        "max_context = 2",
    )


def test_handoff_a_after_t_prime():
    m = reply()
    fails(
        "bad_handoff_range",
        patch(wire.encode(m), handoff_at(m) + 4, "I", m.handoff.t_prime + 1),
        LIMITS,
        "HandOff.a",
        "a <= t_prime",
    )


def test_handoff_n_positions_disagrees_with_t_prime_minus_a():
    m = reply()
    fails(
        "bad_handoff_range",
        patch(wire.encode(m), handoff_at(m) + 12, "I", 2),
        LIMITS,
        "n_positions = 2",
        "t_prime - a = 3",
    )


def test_handoff_body_crc():
    m = reply()
    data = bytearray(wire.encode(m))
    data[-1] ^= 0x80
    fails("crc_mismatch", refresh_crc(data), LIMITS, "hand-off body crc32")


def test_handoff_body_short():
    m = reply()
    data = bytearray(wire.encode(m)[:-6])
    struct.pack_into("<I", data, 8, len(data) - 16)
    fails("length_mismatch", refresh_crc(data), LIMITS, "hand-off body")


def test_encode_refuses_mismatched_handoff_arrays():
    m = reply()
    bad = HandOff(
        m.handoff.t_prime,
        m.handoff.a,
        m.bonus,
        m.handoff.x_hat,
        m.handoff.k_sliding[:2],
        m.handoff.v_sliding[:2],
        m.handoff.k_full,
        m.handoff.v_full,
        SCALES,
    )
    with pytest.raises(wire.HandoffSizeMismatch, match="k_sliding has 2 rows"):
        wire.encode(RoundReply(m.seq, m.samples, m.path_rows, m.bonus, 1.0, handoff=bad, allowance=m.allowance))


# ------------------------------------------------------------------------------------------------ error frames


def test_error_frame_carries_code_and_message():
    err = wire.BadParent("DraftTree.parents[3] = 9: must be in [0, 3)")
    got = wire.decode(wire.error_frame(err))
    assert got == ErrorReply("bad_parent", err.message)
    back = wire.error_from_reply(got)
    assert type(back) is wire.BadParent and back.message == err.message


def test_error_frame_for_a_foreign_exception_leaks_nothing():
    got = wire.decode(wire.error_frame(KeyError("/secret/path")))
    assert got.code == "internal_error" and "secret" not in got.message and "KeyError" in got.message


def test_error_frame_cuts_long_messages_and_keeps_unknown_codes():
    got = wire.decode(wire.error_frame(wire.WireError("auth_failed", "é" * 40_000)))
    assert got.code == "auth_failed" and len(got.message.encode()) <= 65535
    back = wire.error_from_reply(got)
    assert type(back) is wire.WireError and back.code == "auth_failed"


def test_error_frame_keeps_the_code_of_a_peer_facing_exception():
    class SequenceError(ValueError):  # the shape of verifier/errors.py's classes
        code = "bad_seq"

    got = wire.decode(wire.error_frame(SequenceError("round 5 after round 3: send round 4")))
    assert got == ErrorReply("bad_seq", "round 5 after round 3: send round 4")


def test_error_frame_bad_utf8():
    data = wire.encode(ErrorReply("bad_enum", "ab"))
    fails("bad_text", refresh_crc(data[:-1] + b"\xc3"), None, "message", "utf-8")


def test_every_code_is_distinct_and_valid():
    codes = [cls.code for cls in wire.ERROR_CLASSES.values()]
    assert len(codes) == len(set(codes))
    for code in codes:
        assert wire.decode(wire.error_frame(wire.ERROR_CLASSES[code]("x"))).code == code


HELD = [2, 10, 999, 0, 17, 5]  # what a session holds: prompt + committed output


def test_append_byte_layout_is_exact_and_round_trips():
    """APPEND built field by field with struct (module docstring: u32 max_new_tokens, keep, keep_crc, anchor, T;
    then i32[T]); keep_crc is zlib's crc32 of the kept ids as <i4 (numpy writes the bytes here, not hycoc)."""
    keep = 4
    crc = zlib.crc32(np.array(HELD[:keep], "<i4").tobytes())
    assert ids_crc32(HELD[:keep]) == crc
    m = AppendTurn(np.array([5, 6, 999], np.int32), max_new_tokens=64, keep=keep, keep_crc=crc, anchor=5)
    payload = struct.pack("<IIIII", 64, keep, crc, 5, 3) + struct.pack("<3i", 5, 6, 999)
    data = wire.encode(m)
    assert data == frame(wire.MessageType.APPEND, payload)
    assert len(data) == 16 + 20 + 4 * 3 == wire.append_nbytes(3) and data[6] == wire.MessageType.APPEND == 7
    got = wire.decode(data, wire.Limits(vocab_size=VOCAB, max_context=16))
    assert (got.max_new_tokens, got.keep, got.keep_crc, got.anchor) == (64, keep, crc, 5)
    assert_same_array(got.tokens, m.tokens, np.int32)


def test_append_keep_crc_spans_the_whole_u32():
    """A crc32 above 2**31 travels unchanged (u32, not i32)."""
    held = next(HELD[:4] + [i] for i in range(1000) if ids_crc32(HELD[:4] + [i]) >= 2**31)
    crc = ids_crc32(held)
    got = wire.decode(wire.encode(AppendTurn(np.array([7], np.int32), 8, len(held), crc)))
    assert got.keep_crc == crc >= 2**31


@pytest.mark.parametrize(
    "tokens, max_new, limits, code",
    [
        ([], 4, None, "out_of_range"),
        ([1, 2, 3], 0, None, "out_of_range"),
        ([1, VOCAB], 4, wire.Limits(vocab_size=VOCAB), "token_out_of_vocab"),
        ([1, 2, 3], 4, wire.Limits(max_context=3), "context_overflow"),
    ],
)
def test_append_refusals(tokens, max_new, limits, code):
    with pytest.raises(wire.WireError) as info:
        wire.validate(AppendTurn(np.array(tokens, np.int32), max_new), limits)
    assert info.value.code == code


@pytest.mark.parametrize(
    "keep, keep_crc, anchor, needle",
    [
        (0, 0, 0, "AppendTurn.keep = 0: must lie in [1, 4294967295]"),
        (-1, 0, 0, "AppendTurn.keep = -1"),
        (2**32, 0, 0, "AppendTurn.keep = 4294967296"),
        (4, -1, 0, "AppendTurn.keep_crc = -1: must lie in [0, 4294967295]"),
        (4, 2**32, 0, "AppendTurn.keep_crc = 4294967296"),
        (4, 0, 3, "AppendTurn.anchor = 3: must lie in [keep, keep + T) = [4, 7) or be 0"),  # before keep
        (4, 0, 7, "AppendTurn.anchor = 7"),  # keep + T: past the turn
        (4, 0, -4, "AppendTurn.anchor = -4"),
    ],
)
def test_append_field_checks(keep, keep_crc, anchor, needle):
    with pytest.raises(wire.OutOfRange) as info:
        wire.encode(AppendTurn(np.array([5, 6, 7], np.int32), 8, keep, keep_crc, anchor))
    assert info.value.code == "out_of_range" and needle in info.value.message


@pytest.mark.parametrize("keep, anchor", [(1, 0), (1, 1), (1, 3), (4, 4), (4, 6), (2**32 - 4, 0)])
def test_append_accepts_the_edges(keep, anchor):
    m = AppendTurn(np.array([5, 6, 7], np.int32), 8, keep, 2**32 - 1, anchor)
    assert (wire.decode(wire.encode(m)).keep, wire.decode(wire.encode(m)).anchor) == (keep, anchor)


def test_append_anchor_past_u32_is_out_of_range():
    with pytest.raises(wire.OutOfRange, match="AppendTurn.anchor"):
        wire.encode(AppendTurn(np.array([5, 6], np.int32), 8, 2**32 - 1, 0, 2**32))


def test_append_decode_checks_each_field_and_the_context():
    ok = wire.encode(AppendTurn(np.array([5, 6, 7], np.int32), 8, 4, ids_crc32(HELD[:4]), 4))
    fails("out_of_range", patch(ok, APPEND_AT["keep"], "I", 0), None, "AppendTurn.keep = 0")
    fails("out_of_range", patch(ok, APPEND_AT["max_new_tokens"], "I", 0), None, "AppendTurn.max_new_tokens = 0")
    fails("out_of_range", patch(ok, APPEND_AT["anchor"], "I", 3), None, "AppendTurn.anchor = 3", "[4, 7)")
    fails("out_of_range", patch(ok, APPEND_AT["anchor"], "I", 7), None, "AppendTurn.anchor = 7")
    fails("length_mismatch", patch(ok, APPEND_AT["n_tokens"], "I", 4), None, "APPEND", "tokens")
    # keep + T = 7 positions: a verifier of max_context 7 has no room for output, one of 8 has
    fails("context_overflow", ok, wire.Limits(max_context=7), "keep + T = 7", "max_context = 7")
    assert wire.decode(ok, wire.Limits(max_context=8)).keep == 4


def test_open_anchor_must_lie_in_the_prompt():
    """OPEN's anchor: the prompt's model-turn opening, in [0, T) (T = 4 here)."""
    assert wire.decode(open_frame(anchor=3)).anchor == 3
    for bad in (4, 5, -1):
        with pytest.raises(wire.OutOfRange, match=f"OpenRequest.anchor = {bad}: must lie in \\[0, T = 4\\)"):
            wire.encode(open_request(anchor=bad))
    fails("out_of_range", patch(open_frame(), OPEN_AT["anchor"], "I", 4), None, "OpenRequest.anchor = 4", "[0, T = 4)")
    fails("out_of_range", patch(open_frame(), OPEN_AT["anchor"], "I", 2**32 - 1), None, "OpenRequest.anchor")
    # a one-token prompt has no room for an anchor but 0
    assert wire.decode(open_frame(prompt_ids=np.array([7], np.int32))).anchor == 0
    with pytest.raises(wire.OutOfRange, match="anchor = 1"):
        wire.encode(open_request(prompt_ids=np.array([7], np.int32), anchor=1))


# ------------------------------------------------------------------------------------------------ scores, verified


def scored(tree: DraftTree) -> DraftTree:
    """``tree`` with Alg. 3-like scores: each row its parent's minus 0.25 + 0.5 (j % 3) (root 0)."""
    s = np.zeros(len(tree.tokens), np.float32)
    for j in range(1, len(s)):
        s[j] = s[tree.parents[j]] - 0.25 - 0.5 * (j % 3)
    return replace(tree, scores=s)


TREE5 = DraftTree(
    9,
    np.array([5, 7, 7, 999, 0], np.int32),
    np.array([-1, 0, 0, 1, 3], np.int32),
    np.array([0.0, -0.41, -1.3, -2.0, -70000.0], np.float32),
)


def test_round_scores_round_trip_as_float16():
    got = wire.decode(wire.encode(TREE5), LIMITS)
    assert_same_array(got.tokens, TREE5.tokens, np.int32)
    assert_same_array(got.parents, TREE5.parents, np.int32)
    # exactly the fp16 values (rounded to nearest); below fp16's range the wire clamps at -65504, never -inf
    want = np.array([0.0, np.float16(-0.41), np.float16(-1.3), -2.0, -65504.0], np.float32)
    assert_same_array(got.scores, want, np.float32)
    assert got.scores[1] == np.float32(-0.409912109375)
    data = wire.encode(TREE5)
    assert data[wire.HEADER.size + 6] == 1  # has_scores
    assert data[-10:] == np.array([0.0, -0.41, -1.3, -2.0, -65504.0], "<f2").tobytes()


def test_round_without_scores_and_its_layout():
    bare = replace(TREE5, scores=None)
    got = wire.decode(wire.encode(bare), LIMITS)
    assert got.scores is None and wire.encode(bare)[wire.HEADER.size + 6] == 0
    assert wire.encode(bare) == raw_tree(TREE5.tokens, TREE5.parents, seq=9)  # byte for byte
    assert wire.encode(TREE5) == raw_tree(
        TREE5.tokens, TREE5.parents, seq=9, scores=np.maximum(TREE5.scores, wire.FP16_SCORE_FLOOR)
    )
    assert wire.frame_version(wire.encode(TREE5)) == 6


def test_fp16_rounding_keeps_scores_monotone():
    # child 1e-7 below its parent: equal after the cast, still "<= parent"
    t = DraftTree(
        0, np.array([1, 2, 3], np.int32), np.array([-1, 0, 1], np.int32), np.array([0.0, -1.0, -1.0000001], np.float32)
    )
    got = wire.decode(wire.encode(t))
    assert got.scores.tolist() == [0.0, -1.0, -1.0]


def old_frames() -> dict[str, tuple[int, bytes]]:
    """Frames of version-3, -4 and -5 peers, written by hand in their own layouts (docs of those versions: OPEN's
    fixed part of 38 B without anchor, APPEND's of 8 B (u32 max_new_tokens, u32 T), version 3's ROUND without
    has_scores; version 5's ROUND as version 6's, its REPLY 2 B shorter)."""
    prompt = struct.pack("<4i", 2, 10, 999, 0)
    open4 = struct.pack("<fIfQfBBHHII", 0.5, 64, 0.75, 5, 0.25, 1, 0, 0, 0, 256, 4) + prompt
    append4 = struct.pack("<II", 64, 2) + struct.pack("<2i", 5, 6)
    round3 = struct.pack("<IH", 0, 2) + struct.pack("<2i", 5, 6) + struct.pack("<2h", -1, 0)
    round4 = struct.pack("<IHB", 0, 2, 0) + struct.pack("<2i", 5, 6) + struct.pack("<2h", -1, 0)
    return {
        "OPEN v4": (4, frame(wire.MessageType.OPEN, open4, version=4)),
        "OPEN v3": (3, frame(wire.MessageType.OPEN, open4, version=3)),
        "APPEND v4": (4, frame(wire.MessageType.APPEND, append4, version=4)),
        "ROUND v3": (3, frame(wire.MessageType.ROUND, round3, version=3)),
        "ROUND v4": (4, frame(wire.MessageType.ROUND, round4, version=4)),
        "CLOSE v4": (4, frame(wire.MessageType.CLOSE, struct.pack("<Q", 5), version=4)),
        "ROUND v5": (5, frame(wire.MessageType.ROUND, round4, version=5)),
        "CLOSE v5": (5, frame(wire.MessageType.CLOSE, struct.pack("<Q", 5), version=5)),
    }


@pytest.mark.parametrize("name", list(old_frames()))
def test_version_3_4_and_5_frames_are_refused_naming_the_fix(name):
    """An old peer's frame is refused from its header alone (before its payload is read) with unsupported_version,
    whose message names the fix (`wire.OLD_VERSION_FIX`), both by `decode` and by `frame_version`."""
    version, data = old_frames()[name]
    err = fails(
        "unsupported_version",
        data,
        None,
        f"frame speaks protocol version {version}: this side speaks version(s) 6; {wire.OLD_VERSION_FIX}",
    )
    assert (
        err.message
        == f"frame speaks protocol version {version}: this side speaks version(s) 6; " + wire.OLD_VERSION_FIX
    )
    fails("unsupported_version", data[: wire.HEADER.size], None, wire.OLD_VERSION_FIX)  # the header alone suffices
    with pytest.raises(wire.UnsupportedVersion):
        wire.frame_version(data[: wire.HEADER.size])


def test_the_same_payload_under_a_version_6_header_is_read_in_the_version_6_layout():
    """Only the header says which layout a payload has: the v4 OPEN's 38-byte fixed part under a v6 header is read
    as a v6 OPEN (anchor = the first prompt id, the prompt one id short) and refused for its length."""
    _, data = old_frames()["OPEN v4"]
    v6 = refresh_crc(data[:4] + struct.pack("<H", 6) + data[6:])
    fails("length_mismatch", v6, None, "prompt_ids")
    _, data = old_frames()["APPEND v4"]  # 8 + 8 bytes: shorter than v6's 20-byte fixed part
    fails("length_mismatch", refresh_crc(data[:4] + struct.pack("<H", 6) + data[6:]), None, "APPEND", "fixed part")


def test_reply_verified_round_trip_and_mask_layout():
    m = reply(rows=10, path=(1, 3), with_handoff=True)
    kept = np.zeros(10, bool)
    kept[[0, 1, 3, 9]] = True
    m = replace(m, verified=kept)
    limits = replace(LIMITS, tree_rows=10)
    data = wire.encode(m)
    at = wire.HEADER.size + REPLY_AT["samples"] + 4 * 10 + 2 * 2
    assert data[wire.HEADER.size + REPLY_AT["has_verified"]] == 1
    assert data[at : at + 2] == bytes([0b00001011, 0b00000010])  # rows 0, 1, 3 | row 9 (bit 1 of byte 1)
    got = wire.decode(data, limits)
    assert_same_array(got.verified, kept, np.bool_)
    assert_same_array(got.handoff.k_full, m.handoff.k_full, np.int8)  # the hand-off follows the mask
    assert len(data) == wire.reply_nbytes(10, 2, 0, wire.handoff_nbytes(H, DS, DF, 3), verified=True)
    assert wire.decode(wire.encode(replace(m, verified=None)), limits).verified is None


def test_round_scores_errors():
    t, p = [1, 2, 3, 4], [-1, 0, 1, 1]
    fails("bad_enum", raw_tree(t, p, has_scores=2), None, "ROUND has_scores = 2", "0 or 1")
    fails("not_finite", raw_tree(t, p, scores=[0, -1, np.nan, -2]), None, "scores[2]")
    fails("not_finite", raw_tree(t, p, scores=[0, -1, -np.inf, -2]), None, "scores[2]")
    fails("bad_scores", raw_tree(t, p, scores=[-0.5, -1, -2, -2]), None, "scores[0] = -0.5", "root")
    fails("bad_scores", raw_tree(t, p, scores=[0, -1, -2, -0.5]), None, "scores[3] = -0.5", "parent row 1's -1")
    fails("length_mismatch", raw_tree(t, p, scores=[0, -1, -2]), None, "scores")  # one fp16 short
    # encode refuses what decode refuses
    tree = DraftTree(0, np.array(t, np.int32), np.array(p, np.int32))
    for scores, code in (
        ([0, -1, -2], "bad_shape"),
        (np.array([0, -1, -2, -3], np.int32), "bad_shape"),
        (np.array([0, -1, 1, -3], np.float32), "bad_scores"),
        (np.array([0, -1, np.inf, -3], np.float32), "not_finite"),
    ):
        with pytest.raises(wire.WireError) as info:
            wire.encode(replace(tree, scores=np.asarray(scores)))
        assert info.value.code == code


def test_reply_verified_errors():
    m = reply(rows=5, path=(1, 3), with_handoff=False)
    ok = wire.encode(replace(m, verified=np.array([1, 1, 0, 1, 0], bool)))
    flag = wire.HEADER.size + REPLY_AT["has_verified"]
    mask = len(ok) - 1  # no hand-off: the mask is the last byte
    fails("bad_enum", refresh_crc(ok[:flag] + b"\x02" + ok[flag + 1 :]), LIMITS, "has_verified = 2")
    fails("bad_shape", refresh_crc(ok[:mask] + bytes([0b00101011]) + ok[mask + 1 :]), LIMITS, "bit 5", "5 rows")
    fails("bad_path", refresh_crc(ok[:mask] + bytes([0b00001010]) + ok[mask + 1 :]), LIMITS, "verified[0]")
    fails(
        "bad_path",
        refresh_crc(ok[:mask] + bytes([0b00000011]) + ok[mask + 1 :]),
        LIMITS,
        "path_rows[1] = 3 is not a verified row",
    )
    cut = bytearray(ok[:mask])  # the mask cut off, the header's length to match
    struct.pack_into("<I", cut, 8, len(cut) - wire.HEADER.size)
    fails("length_mismatch", refresh_crc(cut), LIMITS, "verified mask")
    for verified, code in (
        (np.array([1, 1, 0, 1], bool), "bad_shape"),
        (np.array([1, 1, 0, 1, 0]), "bad_shape"),
        (np.array([0, 1, 0, 1, 0], bool), "bad_path"),
        (np.array([1, 1, 0, 0, 0], bool), "bad_path"),
    ):
        with pytest.raises(wire.WireError) as info:
            wire.encode(replace(m, verified=verified))
        assert info.value.code == code


def test_frame_version_reads_the_header_only():
    assert wire.frame_version(wire.encode(Close(1))[:16]) == 6  # no payload needed
    assert wire.frame_version(wire.encode(Close(1), version=6)) == 6
    with pytest.raises(wire.Truncated):
        wire.frame_version(b"HYCO")
    with pytest.raises(wire.BadMagic):
        wire.frame_version(frame(wire.MessageType.CLOSE, bytes(8), magic=b"HTTP"))
    with pytest.raises(wire.BadFlags):
        wire.frame_version(frame(wire.MessageType.CLOSE, bytes(8), flags=2))
    assert wire.decode(wire.error_frame(wire.BadScores("x"), version=6)).code == "bad_scores"
    assert wire.frame_version(wire.error_frame(wire.BadScores("x"))) == 6
