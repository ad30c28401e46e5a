"""A protocol fuzzer for the verifier server (issue 38 item 4; docs/serving.md "Soak and fuzz"): malformed frames of
every kind, before OPEN and inside a session, each with the ERROR codes the protocol documents for it.

Every case is one frame built from a valid one with one field broken (numbers out of range, NaN and inf, wrong
sizes and counts, bad utf-8, hostile chat-contract JSON with out-of-range numbers and 2,000 nested ``[``), or a
valid frame with random bytes flipped (``mutated``: any documented code, or a normal answer). `fuzz` drives
``connections`` concurrent WebSockets against a server for a number of frames or seconds and counts, per case,
the codes it got; a code outside the case's documented set, ``internal_error``, a dropped connection that the
case did not ask for, or no answer within `ANSWER_TIMEOUT_S` is a finding (`FuzzStats.findings`).

`benchmarks/protocol_fuzz.py` is the command line (a child ``hycoc verify-server``, RSS per phase, tracemalloc
with ``--in-process``); ``tests/test_hostile_input.py`` runs a few hundred frames against the tiny engine.
"""

from __future__ import annotations

import asyncio
import random
import struct
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hycoc.protocol import wire
from hycoc.protocol.layout import LAYOUTS, PROTOCOL_VERSION, FixedPart, MessageType
from hycoc.protocol.messages import (
    AppendTurn,
    Close,
    DraftTree,
    ErrorReply,
    Opened,
    OpenRequest,
    RoundReply,
    Sampling,
)

#: Seconds to wait for an answer to one frame (the server answers a malformed frame without the engine).
ANSWER_TIMEOUT_S = 60.0
#: What a case may get besides ERROR codes: a normal answer (OPENED, REPLY) or the server closing the socket.
ANSWERED, CLOSED = "answered", "closed"

#: Every code the server documents (wire, engine, server), so a mutated frame's answer can be checked.
WIRE_CODES = frozenset(
    "bad_magic unsupported_version unknown_message_type bad_flags frame_too_large truncated length_mismatch "
    "crc_mismatch bad_enum bad_text bad_shape not_finite out_of_range bad_temperature bad_top_k bad_top_p "
    "bad_epsilon token_out_of_vocab wrong_row_count bad_parent bad_path bad_scores bonus_mismatch "
    "handoff_size_mismatch bad_handoff_range context_overflow config_mismatch".split()
)
ENGINE_CODES = frozenset(
    "bad_request bad_tree bad_root bad_seq context_overflow conversation_mismatch finished not_prefilled".split()
)
SERVER_CODES = frozenset(
    "not_opened already_open unexpected_message bad_session_id no_keep_set too_many_sessions kv_budget_exhausted "
    "chat_mismatch".split()
)
ANY_CODE = WIRE_CODES | ENGINE_CODES | SERVER_CODES


@dataclass(frozen=True)
class Target:
    """What the fuzzer knows of the server (from /healthz and an OPENED): vocabulary, context, tree rows and the
    incoming frame bound."""

    vocab_size: int
    max_context: int
    tree_rows: int
    in_frame_bytes: int


@dataclass(frozen=True)
class Case:
    """One fuzz frame: ``name``, ``phase`` ("bare": before OPEN, "session": an open, unfinished session,
    "finished": a session whose turn finished), ``frame`` (bytes, or str for a text message) and ``allowed``: the
    documented outcomes (ERROR codes, `ANSWERED`, `CLOSED`)."""

    name: str
    phase: str
    frame: bytes | str
    allowed: frozenset


@dataclass
class FuzzStats:
    """Counts of a fuzz run: frames sent, outcomes per case name, findings (case, outcome, detail), and
    connections opened and dropped by the server."""

    frames: int = 0
    outcomes: dict[str, Counter] = field(default_factory=dict)
    findings: list[tuple[str, str, str]] = field(default_factory=list)
    connections: int = 0
    sessions: int = 0

    def record(self, case: Case, outcome: str, detail: str = "") -> None:
        """Count ``outcome`` for ``case``; a finding when it is not in ``case.allowed`` or is internal_error."""
        self.frames += 1
        self.outcomes.setdefault(case.name, Counter())[outcome] += 1
        if outcome not in case.allowed or outcome == "internal_error":
            self.findings.append((case.name, outcome, detail[:200]))

    def codes(self) -> Counter:
        """Outcomes over every case."""
        total: Counter = Counter()
        for c in self.outcomes.values():
            total.update(c)
        return total


# ---- frames -------------------------------------------------------------------------------------------------------


def raw(mtype: int, payload: bytes, *, version: int = wire.PROTOCOL_VERSION, magic: bytes = wire.MAGIC,
        flags: int = 0, length: int | None = None, crc: int | None = None) -> bytes:  # fmt: skip
    """A frame with any header fields (default: the right length and crc of ``payload``)."""
    n = len(payload) if length is None else length
    c = zlib.crc32(payload) if crc is None else crc
    return wire.HEADER.pack(magic, version, mtype, flags, n, c) + payload


def refill(frame: bytes) -> bytes:
    """``frame`` with its header's length and crc made right for its (edited) payload."""
    payload = frame[wire.HEADER.size :]
    magic, version, mtype, flags, _, _ = wire.HEADER.unpack_from(frame)
    return raw(mtype, payload, version=version, magic=magic, flags=flags)


def valid_open(rng: random.Random, t: Target, max_new_tokens: int = 8, **kw) -> OpenRequest:
    """A small valid OPEN (greedy, a prompt of 4-12 ids)."""
    n = rng.randint(4, 12)
    prompt = np.asarray([rng.randrange(3, t.vocab_size) for _ in range(n)], np.int32)
    return OpenRequest(prompt_ids=prompt, sampling=Sampling(0.0, 64, 0.95), max_new_tokens=max_new_tokens, **kw)


def chain(t: Target, root: int, seq: int, rng: random.Random) -> DraftTree:
    """A valid ROUND: a chain of ``t.tree_rows`` rows from ``root`` (random ids), scores falling by 0.5 a row."""
    tokens = np.asarray([root] + [rng.randrange(3, t.vocab_size) for _ in range(t.tree_rows - 1)], np.int32)
    parents = np.arange(-1, t.tree_rows - 1, dtype=np.int16)
    scores = -0.5 * np.arange(t.tree_rows, dtype=np.float32)
    return DraftTree(seq, tokens, parents, scores)


def _open_field(rng: random.Random, t: Target, offset: int, fmt: str, value) -> bytes:
    """A valid OPEN frame with the fixed-part field at ``offset`` (bytes into the payload) overwritten."""
    frame = bytearray(wire.encode(valid_open(rng, t)))
    struct.pack_into(fmt, frame, wire.HEADER.size + offset, value)
    return refill(bytes(frame))


def _field_places(part: FixedPart) -> dict[str, tuple[int, str]]:
    """Each field of a fixed part (`hycoc.protocol.layout.FixedPart`) as (byte offset into the payload, its
    little-endian struct format), from the part's own format: one type code per field, no padding ("<")."""
    places, offset = {}, 0
    for name, code in zip(part.fields, part.format.removeprefix("<"), strict=True):
        places[name] = (offset, "<" + code)
        offset += struct.calcsize("<" + code)
    return places


#: OPEN's fixed part in the version `wire.encode` writes (`hycoc.protocol.layout.LAYOUTS`): field -> (offset, format).
_OPEN_FIELDS = _field_places(LAYOUTS[PROTOCOL_VERSION].fixed[MessageType.OPEN])
NAN, INF = float("nan"), float("inf")
#: Hostile chat contracts: every one is chat_mismatch (or answered where the server has no chat format to check).
HOSTILE_CHATS = (
    '{"stop_ids": [1e999], "template_sha256": "x"}',
    '{"stop_ids": [-1e999], "template_sha256": "x"}',
    '{"stop_ids": [NaN], "template_sha256": "x"}',
    "[" * 2000,
    '{"stop_ids": ' + "[" * 2000 + "]" * 2000 + ', "template_sha256": "x"}',
    '{"stop_ids": [' + "9" * 5000 + '], "template_sha256": "x"}',
    '{"stop_ids": "abc", "template_sha256": 5}',
    "null",
)


def bare_cases(rng: random.Random, t: Target) -> list[Case]:
    """Frames before OPEN: the header's every field, sizes, crc, OPEN's every field, the chat contract."""
    ok = wire.encode(valid_open(rng, t))
    pay = ok[wire.HEADER.size :]
    big = t.in_frame_bytes
    f = frozenset
    cases = [
        Case("random_bytes", "bare", bytes(rng.randrange(256) for _ in range(rng.randint(0, 40))),
             f({"truncated", "bad_magic", "unsupported_version", "unknown_message_type", "bad_flags",
                "frame_too_large"})),
        Case("bad_magic", "bare", raw(1, pay, magic=b"HTTP"), f({"bad_magic"})),
        Case("old_version", "bare", raw(1, pay, version=rng.choice([1, 2, 3, 4])), f({"unsupported_version"})),
        Case("future_version", "bare", raw(1, pay, version=rng.randint(6, 65535)), f({"unsupported_version"})),
        Case("unknown_type", "bare", raw(rng.choice([0, 8, 99, 255]), pay), f({"unknown_message_type"})),
        Case("bad_flags", "bare", raw(1, pay, flags=rng.randint(1, 255)), f({"bad_flags"})),
        Case("announced_too_large", "bare", raw(1, pay, length=big), f({"frame_too_large"})),
        Case("announced_u32_max", "bare", raw(1, pay, length=2**32 - 1), f({"frame_too_large"})),
        Case("one_byte_over", "bare", raw(1, pay + bytes(big + 1 - len(ok))), f({"frame_too_large"})),
        Case("truncated", "bare", raw(1, pay, length=len(pay) + 7), f({"truncated"})),
        Case("trailing_bytes", "bare", raw(1, pay, length=len(pay) - 3), f({"length_mismatch"})),
        Case("bad_crc", "bare", raw(1, pay, crc=zlib.crc32(pay) ^ 1), f({"crc_mismatch"})),
        Case("header_only", "bare", ok[: rng.randint(0, wire.HEADER.size - 1)], f({"truncated"})),
        Case("round_before_open", "bare", wire.encode(chain(t, 5, 0, rng)), f({"not_opened"})),
        Case("append_before_open", "bare", wire.encode(AppendTurn(np.asarray([5, 6], np.int32), 4, keep=1)),
             f({"not_opened"})),
        Case("reply_from_client", "bare",
             wire.encode(RoundReply(0, np.full(1, 5, np.int32), np.zeros(0, np.int16), 5, 1.0, allowance=1)),
             f({"unexpected_message"})),
        Case("opened_from_client", "bare",
             wire.encode(Opened(1, 3, 1.0, 64, 1, t.vocab_size, 8, 8, 8, (1,))), f({"unexpected_message"})),
        Case("error_from_client", "bare", wire.encode(ErrorReply("x", "y")), f({"unexpected_message"})),
        Case("text_message", "bare", "HYCO" * rng.randint(1, 50), f({"unexpected_message"})),
    ]  # fmt: skip
    fields = [
        ("temperature", NAN, {"not_finite"}), ("temperature", INF, {"not_finite"}),
        ("temperature", -1.0, {"bad_temperature"}), ("top_k", 0, {"bad_top_k"}),
        ("top_p", 0.0, {"bad_top_p"}), ("top_p", 1.5, {"bad_top_p"}), ("top_p", NAN, {"not_finite"}),
        ("epsilon", 0.0, {"bad_epsilon"}), ("epsilon", 2.0, {"bad_epsilon"}), ("epsilon", -INF, {"not_finite"}),
        ("acceptance", rng.randint(2, 255), {"bad_enum"}), ("draft_place", rng.randint(3, 255), {"bad_enum"}),
        ("max_new_tokens", 0, {"out_of_range"}), ("n_prompt", 0, {"out_of_range", "length_mismatch"}),
        ("n_prompt", 2**32 - 1, {"length_mismatch", "context_overflow"}),
        ("auth_len", 65535, {"length_mismatch"}), ("chat_len", 9, {"length_mismatch"}),
        ("anchor", 2**32 - 1, {"out_of_range", "bad_request"}),
        ("draft_ms_floor", -1.0, {"out_of_range"}), ("draft_ms_tree", 1e9, {"out_of_range"}),
        ("draft_ms_tree", NAN, {"not_finite"}),
    ]  # fmt: skip
    for name, value, allowed in fields:
        off, fmt = _OPEN_FIELDS[name]
        cases.append(Case(f"open_{name}={value}", "bare", _open_field(rng, t, off, fmt, value), f(allowed)))
    prompt_oov = valid_open(rng, t)
    prompt_oov.prompt_ids[rng.randrange(len(prompt_oov.prompt_ids))] = rng.choice([t.vocab_size, 2**31 - 1, -1])
    cases.append(Case("open_token_out_of_vocab", "bare", _unchecked(prompt_oov), f({"token_out_of_vocab"})))
    long = valid_open(rng, t)
    long = OpenRequest(prompt_ids=np.full(t.max_context, 5, np.int32), sampling=long.sampling)
    cases.append(Case("open_prompt_over_context", "bare", wire.encode(long), f({"context_overflow"})))
    cases.append(Case("open_bad_utf8_auth", "bare", _bad_utf8(rng, t, "auth_token"), f({"bad_text"})))
    cases.append(Case("open_bad_utf8_chat", "bare", _bad_utf8(rng, t, "chat"), f({"bad_text"})))
    for i, chat in enumerate(HOSTILE_CHATS):
        frame = wire.encode(valid_open(rng, t, chat=chat))
        cases.append(Case(f"open_hostile_chat_{i}", "bare", frame, f({"chat_mismatch", ANSWERED})))
    return cases


def _unchecked(req: OpenRequest) -> bytes:
    """An OPEN frame with the prompt's ids written as given (`wire.encode` would refuse an id out of range)."""
    good = OpenRequest(prompt_ids=np.full(len(req.prompt_ids), 5, np.int32), sampling=req.sampling,
                       max_new_tokens=req.max_new_tokens)  # fmt: skip
    frame = bytearray(wire.encode(good))
    start = len(frame) - 4 * len(req.prompt_ids)
    frame[start:] = np.asarray(req.prompt_ids, "<i4").tobytes()
    return refill(bytes(frame))


def _bad_utf8(rng: random.Random, t: Target, what: str) -> bytes:
    """An OPEN whose auth token or chat contract is not utf-8 (its last byte a lone continuation byte)."""
    given: dict[str, Any] = {what: "abcd"}  # auth_token or chat
    frame = bytearray(wire.encode(valid_open(rng, t, **given)))
    if what == "auth_token":  # the token lies before the chat (absent here): the last 4 bytes
        frame[-1] = 0xBF
    else:
        frame[-1] = 0xFF
    return refill(bytes(frame))


def big_case(rng: random.Random, t: Target, phase: str) -> Case:
    """A large frame: a ROUND (in a session) or OPEN (before one) header announcing what follows, of a random size
    between 64 KiB and twice the incoming bound (past the bound: frame_too_large; past twice it, the WebSocket layer
    closes the connection). What a fuzzer sending big frames makes the server buffer."""
    size = rng.randrange(64 * 1024, 2 * t.in_frame_bytes + 4096)
    payload = rng.randbytes(size - wire.HEADER.size)
    allowed = {"frame_too_large", CLOSED} if size > t.in_frame_bytes else set(ANY_CODE)
    return Case(f"big_{phase}", phase, raw(3 if phase == "session" else 1, payload), frozenset(allowed))


def session_cases(rng: random.Random, t: Target, root: int, seq: int) -> list[Case]:
    """Frames inside an open session whose next round is ``seq`` with root ``root``: every ROUND field, APPEND
    before the turn finished, OPEN again, CLOSE of another session, the in-session frame bound."""
    f = frozenset
    good = chain(t, root, seq, rng)
    scores = good.scores
    if scores is None:  # never: chain scores every row
        raise ValueError("session_cases needs a scored chain")
    cases = []

    def tree(name: str, allowed, **change) -> None:
        d = dict(seq=good.seq, tokens=good.tokens.copy(), parents=good.parents.copy(), scores=scores.copy())
        d.update(change)
        cases.append(Case(name, "session", _tree_frame(**d), f(allowed)))

    r = t.tree_rows
    tree("round_rows_over", {"wrong_row_count"}, tokens=np.append(good.tokens, good.tokens[-1]),
         parents=np.append(good.parents, good.parents[-1]), scores=np.append(scores, scores[-1]))  # fmt: skip
    bad_parents = good.parents.copy()
    bad_parents[rng.randrange(1, r)] = rng.choice([r, 2**15 - 1, -2])
    tree("round_bad_parent", {"bad_parent"}, parents=bad_parents)
    oov = good.tokens.copy()
    oov[rng.randrange(r)] = rng.choice([t.vocab_size, 2**31 - 1, -5])
    tree("round_token_out_of_vocab", {"token_out_of_vocab"}, tokens=oov)
    s = scores.copy()
    s[0] = 1.0
    tree("round_root_score", {"bad_scores"}, scores=s)
    s = scores.copy()
    s[rng.randrange(1, r)] = rng.choice([NAN, INF])
    tree("round_score_not_finite", {"not_finite", "bad_scores"}, scores=s)
    s = scores.copy()
    s[r - 1] = 5.0
    tree("round_score_above_parent", {"bad_scores"}, scores=s)
    tree("round_future_seq", {"bad_seq"}, seq=seq + rng.randint(2, 2**31))
    wrong_root = good.tokens.copy()
    wrong_root[0] = (root + 1) % t.vocab_size
    tree("round_wrong_root", {"bad_root"}, tokens=wrong_root)
    frame = bytearray(wire.encode(good))
    frame[wire.HEADER.size + 6] = rng.randint(2, 255)  # has_scores
    cases.append(Case("round_has_scores_enum", "session", refill(bytes(frame)), f({"bad_enum"})))
    frame = bytearray(wire.encode(good))
    struct.pack_into("<H", frame, wire.HEADER.size + 4, 65535)  # rows
    cases.append(Case("round_rows_u16_max", "session", refill(bytes(frame)), f({"wrong_row_count"})))
    pay = wire.encode(good)[wire.HEADER.size :]
    big = t.in_frame_bytes
    cases += [
        Case("session_one_byte_over", "session", raw(3, pay + bytes(big + 1 - len(pay) - 16)), f({"frame_too_large"})),
        Case("session_lying_header", "session", raw(3, pay + bytes(big + 1 - len(pay) - 16), length=len(pay)),
             f({"frame_too_large"})),
        Case("append_unfinished", "session", wire.encode(AppendTurn(np.asarray([5, 6], np.int32), 4, keep=1)),
             f({"finished"})),
        Case("open_again", "session", wire.encode(valid_open(rng, t)), f({"already_open"})),
        Case("close_other_session", "session", wire.encode(Close(rng.randint(10**6, 2**63))), f({"bad_session_id"})),
        Case("session_old_version", "session", raw(3, pay, version=4), f({"unsupported_version"})),
        Case("session_text", "session", "x", f({"unexpected_message"})),
    ]  # fmt: skip
    return cases


def _tree_frame(seq, tokens, parents, scores) -> bytes:
    """A ROUND frame with fields written as given (no checks: `wire.encode` would refuse the broken ones)."""
    rows = len(tokens)
    payload = struct.pack("<IHB", seq % 2**32, rows, 1)
    payload += np.asarray(tokens, "<i8").astype("<i4").tobytes() + np.asarray(parents, "<i2").tobytes()
    payload += np.asarray(scores, np.float32).astype("<f2").tobytes()
    return raw(3, payload)


def finished_cases(rng: random.Random, t: Target, held: int, crc: int) -> list[Case]:
    """Frames after a finished turn (the session holds ``held`` ids whose crc32 is ``crc``): APPEND's every
    field."""
    f = frozenset

    def append(name: str, allowed, tokens=(7, 8, 9), max_new=4, keep=None, keep_crc=None, anchor=0) -> None:
        payload = struct.pack("<IIIII", max_new, held if keep is None else keep, crc if keep_crc is None else keep_crc,
                              anchor, len(tokens)) + np.asarray(tokens, "<i8").astype("<i4").tobytes()  # fmt: skip
        cases.append(Case(name, "finished", raw(7, payload), f(allowed)))

    cases: list[Case] = []
    append("append_keep_0", {"conversation_mismatch", "out_of_range"}, keep=0)
    append("append_keep_past_held", {"conversation_mismatch", "context_overflow"}, keep=held + rng.randint(1, 2**31))
    append("append_bad_crc", {"conversation_mismatch"}, keep_crc=crc ^ 0x5A5A)
    append("append_empty", {"out_of_range", "bad_request"}, tokens=())
    append("append_token_out_of_vocab", {"token_out_of_vocab", "bad_request"}, tokens=(5, t.vocab_size, 2**31 - 1))
    append("append_negative_token", {"token_out_of_vocab", "bad_request"}, tokens=(5, -1))
    append("append_max_new_0", {"out_of_range", "bad_request"}, max_new=0)
    append("append_anchor_outside", {"bad_request", "out_of_range"}, anchor=held + 50)
    append("append_over_context", {"context_overflow"}, tokens=(5,) * t.max_context)
    payload = struct.pack("<IIIII", 4, held, crc, 0, 2**32 - 1)
    cases.append(Case("append_count_past_payload", "finished", raw(7, payload), f({"length_mismatch",
                                                                                    "context_overflow"})))  # fmt: skip
    return cases


def mutated(rng: random.Random, frame: bytes, phase: str) -> Case:
    """``frame`` with 1-4 payload bytes replaced, its crc made right 4 times in 5: any documented answer."""
    b = bytearray(frame)
    for _ in range(rng.randint(1, 4)):
        if len(b) > wire.HEADER.size:
            b[rng.randrange(wire.HEADER.size, len(b))] = rng.randrange(256)
    out = refill(bytes(b)) if rng.random() < 0.8 else bytes(b)
    return Case("mutated", phase, out, ANY_CODE | {ANSWERED})


# ---- the driver -----------------------------------------------------------------------------------------------------


async def _ask(ws, frame: bytes | str) -> tuple[str, object]:
    """Send one frame; (outcome, the decoded answer or None): an ERROR's code, `ANSWERED` or `CLOSED`."""
    from websockets.exceptions import ConnectionClosed

    try:
        await ws.send(frame)
        data = await asyncio.wait_for(ws.recv(decode=False), ANSWER_TIMEOUT_S)  # the protocol is binary
    except ConnectionClosed:
        return CLOSED, None
    if isinstance(data, bytes) and len(data) >= wire.HEADER.size:
        _, version, mtype, _, _, _ = wire.HEADER.unpack_from(data)
        if mtype == wire.MessageType.ERROR and version in wire.LEGACY_ERROR_VERSIONS:  # answered in the frame's
            code_len = data[wire.HEADER.size]  # old version: same ERROR layout (u8 code length, u16 message length)
            return data[wire.HEADER.size + 3 : wire.HEADER.size + 3 + code_len].decode(), None
    msg = wire.decode(data, wire.Limits(max_frame_bytes=2**30))
    return (msg.code, msg) if isinstance(msg, ErrorReply) else (ANSWERED, msg)


def _with_big(cases: list[Case], rng: random.Random, t: Target, phase: str, big_share: float) -> list[Case]:
    """``cases`` with each replaced by a `big_case` with probability ``big_share``."""
    return [big_case(rng, t, phase) if rng.random() < big_share else c for c in cases]


async def _connection(
    url: str, t: Target, rng: random.Random, stats: FuzzStats, frames: int, big_share: float = 0.0
) -> None:
    """One connection: a few bare cases, then (most times) a session: its cases, a round to finish the turn, the
    finished cases, CLOSE (or a dropped socket)."""
    from websockets.asyncio.client import connect

    async with connect(url, compression=None, max_size=2**25, proxy=None, ping_interval=None) as ws:
        stats.connections += 1
        for case in _with_big(rng.sample(bare_cases(rng, t), k=min(frames, rng.randint(1, 6))), rng, t, "bare",
                              big_share):  # fmt: skip
            outcome, _ = await _ask(ws, case.frame)
            stats.record(case, outcome)
            if outcome in (CLOSED, ANSWERED):
                return
        if rng.random() < 0.15:
            case = mutated(rng, wire.encode(valid_open(rng, t)), "bare")
            outcome, _ = await _ask(ws, case.frame)
            stats.record(case, outcome)
            return
        open_frame = wire.encode(valid_open(rng, t, max_new_tokens=1))
        open_case = Case("valid_open", "bare", open_frame, frozenset({ANSWERED}))
        outcome, opened = await _ask(ws, open_case.frame)
        stats.record(open_case, outcome, getattr(opened, "message", ""))
        if not isinstance(opened, Opened):
            return
        stats.sessions += 1
        root = int(wire.decode(open_frame).prompt_ids[-1])
        for case in _with_big(rng.sample(session_cases(rng, t, root, 0), k=rng.randint(1, 8)), rng, t, "session",
                              big_share):  # fmt: skip
            outcome, _ = await _ask(ws, case.frame)
            stats.record(case, outcome)
            if outcome == CLOSED:
                return
        if rng.random() < 0.1:  # a client that goes away mid-session
            ws.transport.abort()
            return
        round_frame = wire.encode(chain(t, root, 0, rng))
        round_case = Case("valid_round", "session", round_frame, frozenset({ANSWERED}))
        outcome, reply = await _ask(ws, round_case.frame)
        stats.record(round_case, outcome, getattr(reply, "message", ""))
        if isinstance(reply, RoundReply) and reply.finished:
            held = _held_ids(open_frame, round_frame, reply, opened.stop_ids)
            for case in rng.sample(finished_cases(rng, t, len(held), zlib.crc32(np.asarray(held, "<i4").tobytes())),
                                   k=rng.randint(1, 5)):  # fmt: skip
                outcome, _ = await _ask(ws, case.frame)
                stats.record(case, outcome)
        await ws.send(wire.encode(Close(opened.session_id)))


def _held_ids(open_frame: bytes, round_frame: bytes, reply: RoundReply, stop_ids) -> list[int]:
    """The ids a session holds after its first (finishing) round: the prompt, then what the turn committed
    (`hycoc.bench.loadtest.run.committed_tokens`, cut at the OPEN's max_new_tokens)."""
    from hycoc.bench.loadtest.run import committed_tokens

    req, tree = wire.decode(open_frame), wire.decode(round_frame)
    new, _ = committed_tokens(tree.tokens, reply, stop_ids, req.max_new_tokens, 10**9, False)
    return [int(i) for i in req.prompt_ids] + new


async def fuzz(
    url: str,
    target: Target,
    *,
    frames: int | None = None,
    seconds: float | None = None,
    connections: int = 4,
    big_share: float = 0.0,
    seed: int = 0,
    stats: FuzzStats | None = None,
    on_tick: Callable[[FuzzStats], None] | None = None,
) -> FuzzStats:
    """Fuzz the server at ``url`` with ``connections`` concurrent connections until ``frames`` frames were sent or
    ``seconds`` passed (module docstring); ``big_share`` of the frames are `big_case`s instead.
    Returns the `FuzzStats` (``stats`` when given, updated in place)."""
    stats = stats or FuzzStats()
    deadline = None if seconds is None else time.monotonic() + seconds

    def more() -> bool:
        return (frames is None or stats.frames < frames) and (deadline is None or time.monotonic() < deadline)

    async def worker(k: int) -> None:
        rng = random.Random(seed * 1000 + k)
        while more():
            try:
                await _connection(url, target, rng, stats, (frames or 10**9) - stats.frames, big_share)
            except (OSError, TimeoutError) as e:
                stats.findings.append(("connection", type(e).__name__, str(e)[:200]))
                await asyncio.sleep(0.5)
            if on_tick is not None:
                on_tick(stats)

    await asyncio.gather(*(worker(k) for k in range(connections)))
    return stats


def error_counts(url: str, timeout_s: float = 10.0) -> dict[str, float]:
    """``hycoc_errors_total{kind=...}`` of the server at ``url`` (ws:// or http://): code -> ERROR frames sent."""
    import re
    import urllib.request

    http = "http" + url.removeprefix("ws").removeprefix("http")
    with urllib.request.urlopen(http + "/metrics", timeout=timeout_s) as r:
        text = r.read().decode("utf-8")
    found = re.findall(r'^hycoc_errors_total\{kind="([^"]+)"\} (\S+)$', text, re.M)
    return {code: float(v) for code, v in found}


def target_of(health: dict, tree_rows: int) -> Target:
    """A `Target` from a server's /healthz document (vocab_size, max_context, in_frame_bytes) and its B + 1."""
    max_context = int(health["max_context"])
    in_frame = wire.open_nbytes(max(max_context - 1, 1), 65535, 65535)  # the server's `open_frame_bytes`
    return Target(int(health["vocab_size"]), max_context, int(tree_rows), in_frame)
