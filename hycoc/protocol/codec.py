"""The frame codec: `encode` a message of `hycoc.protocol.messages` into one frame, `decode` a frame back.

Every payload is written and read through the `hycoc.protocol.layout.Layout` of the frame's version (the fixed
parts as data, `LAYOUTS`), so a version is a table entry, not a branch here. `encode` validates first
(`hycoc.protocol.checks.validate`, without limits) and `decode` validates last (against the receiver's `Limits`).
The byte layout is the module docstring of `hycoc.protocol.wire`. numpy + stdlib only.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from hycoc.protocol.checks import check_handoff_sizes, check_rows, validate
from hycoc.protocol.errors import (
    BadEnum,
    BadFlags,
    BadHandoffRange,
    BadMagic,
    BadShape,
    BadText,
    ContextOverflow,
    CrcMismatch,
    FrameTooLarge,
    LengthMismatch,
    Truncated,
    UnknownMessageType,
    UnsupportedVersion,
    error_reply,
)
from hycoc.protocol.layout import (
    FP16_SCORE_FLOOR,
    HEADER,
    LEGACY_ERROR_LAYOUTS,
    MAGIC,
    OLD_VERSION_FIX,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    FixedPart,
    Layout,
    Limits,
    MessageType,
    layout_of,
)
from hycoc.protocol.messages import (
    ACCEPTANCE_MODES,
    DRAFT_PLACES,
    FINISH_REASONS,
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

# --------------------------------------------------------------------------------------------------- encode


def _pack_open(m: OpenRequest, layout: Layout) -> bytes:
    prompt = np.asarray(m.prompt_ids).astype("<i4")
    auth = b"" if m.auth_token is None else m.auth_token.encode("utf-8")
    chat = b"" if m.chat is None else m.chat.encode("utf-8")
    fixed = layout.fixed[MessageType.OPEN].pack_from(
        m,
        m.sampling,
        acceptance=ACCEPTANCE_MODES.index(m.acceptance),
        draft_place=DRAFT_PLACES.index(m.draft_place),
        auth_len=len(auth),
        chat_len=len(chat),
        n_prompt=prompt.size,
    )
    return fixed + prompt.tobytes() + auth + chat


def _pack_opened(m: Opened, layout: Layout) -> bytes:
    stops = np.asarray(m.stop_ids).astype("<i4")
    fixed = layout.fixed[MessageType.OPENED].pack_from(m, n_stops=stops.size)
    return fixed + stops.tobytes()


def _pack_tree(m: DraftTree, layout: Layout) -> bytes:
    tokens = np.asarray(m.tokens).astype("<i4")
    parents = np.asarray(m.parents).astype("<i2")
    scores = b""
    if m.scores is not None:  # clamp first: below -65,504 fp16 would round to -inf
        scores = np.maximum(np.asarray(m.scores, np.float32), np.float32(FP16_SCORE_FLOOR)).astype("<f2").tobytes()
    fixed = layout.fixed[MessageType.ROUND].pack_from(m, rows=tokens.size, has_scores=m.scores is not None)
    return fixed + tokens.tobytes() + parents.tobytes() + scores


def _pack_handoff(h: HandOff, layout: Layout) -> bytes:
    blocks = (h.x_hat, h.k_sliding, h.v_sliding, h.k_full, h.v_full)
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in blocks)
    sizes = layout.handoff_sizes.pack(
        hidden_size=h.x_hat.size // 2, kv_dim_sliding=h.k_sliding.shape[1], kv_dim_full=h.k_full.shape[1]
    )
    fixed = layout.handoff_fixed.struct.pack(h.t_prime, h.a, h.bonus, h.n_positions, *h.scales, zlib.crc32(body))
    return sizes + fixed + body


def _pack_reply(m: RoundReply, layout: Layout) -> bytes:
    samples = np.asarray(m.samples).astype("<i4")
    path = np.asarray(m.path_rows).astype("<i2")
    chain = np.asarray(m.chain).astype("<i4")
    fixed = layout.fixed[MessageType.REPLY].pack_from(
        m,
        finished=_finish_code(m),
        has_handoff=m.handoff is not None,
        rows=samples.size,
        n_path=path.size,
        n_chain=chain.size,
        has_verified=m.verified is not None,
    )
    mask = b""
    if m.verified is not None:  # row j at byte j // 8, bit j % 8, LSB first; pad bits 0
        mask = np.packbits(np.asarray(m.verified, np.bool_), bitorder="little").tobytes()
    handoff = b"" if m.handoff is None else _pack_handoff(m.handoff, layout)
    return fixed + samples.tobytes() + path.tobytes() + chain.tobytes() + mask + handoff


def _pack_close(m: Close, layout: Layout) -> bytes:
    return layout.fixed[MessageType.CLOSE].pack_from(m)


def _pack_error_payload(m: ErrorReply, fixed: FixedPart) -> bytes:
    code, message = m.code.encode("ascii"), m.message.encode("utf-8")
    return fixed.pack(code_len=len(code), message_len=len(message)) + code + message


def _pack_error(m: ErrorReply, layout: Layout) -> bytes:
    return _pack_error_payload(m, layout.fixed[MessageType.ERROR])


def _pack_append(m: AppendTurn, layout: Layout) -> bytes:
    tokens = np.asarray(m.tokens).astype("<i4")
    fixed = layout.fixed[MessageType.APPEND].pack_from(m, n_tokens=tokens.size)
    return fixed + tokens.tobytes()


_PACKERS: dict[type, tuple[MessageType, Callable[[Any, Layout], bytes]]] = {
    OpenRequest: (MessageType.OPEN, _pack_open),
    Opened: (MessageType.OPENED, _pack_opened),
    DraftTree: (MessageType.ROUND, _pack_tree),
    RoundReply: (MessageType.REPLY, _pack_reply),
    Close: (MessageType.CLOSE, _pack_close),
    ErrorReply: (MessageType.ERROR, _pack_error),
    AppendTurn: (MessageType.APPEND, _pack_append),
}


def _frame(mtype: MessageType, payload: bytes, version: int) -> bytes:
    if len(payload) > 2**32 - 1:
        raise FrameTooLarge(f"{mtype.name} payload of {len(payload)} bytes: at most 4 GiB - 1 (u32 length)")
    return HEADER.pack(MAGIC, version, mtype, 0, len(payload), zlib.crc32(payload)) + payload


def encode(msg, version: int = PROTOCOL_VERSION) -> bytes:
    """One frame for ``msg`` in protocol ``version`` (one of SUPPORTED_VERSIONS, else UnsupportedVersion).
    Validates it first (without limits), so a sender's bug raises the same WireError the receiver would, before
    anything is sent. Scores travel as float16, clamped at FP16_SCORE_FLOOR."""
    layout = layout_of(version)
    validate(msg)
    mtype, pack = _PACKERS[type(msg)]
    return _frame(mtype, pack(msg, layout), layout.version)


def encode_error(reply: ErrorReply, version: int = PROTOCOL_VERSION) -> bytes:
    """The ERROR frame of ``reply`` in protocol ``version``: one of SUPPORTED_VERSIONS, or of
    LEGACY_ERROR_VERSIONS (that version's ERROR layout, `LEGACY_ERROR_LAYOUTS`, for a peer to read its refusal)."""
    legacy = LEGACY_ERROR_LAYOUTS.get(version)
    if legacy is None:
        return encode(reply, version=version)
    validate(reply)
    return _frame(MessageType.ERROR, _pack_error_payload(reply, legacy), version)


def error_frame(exc: BaseException, version: int = PROTOCOL_VERSION) -> bytes:
    """An ERROR frame answering ``exc``, in protocol ``version`` (the session's: `frame_version` of its OPEN, or
    an older peer's own version of `LEGACY_ERROR_VERSIONS`, so that it can read its refusal and the fix); never
    raises for an exception (messages over 65,535 bytes are cut)."""
    return encode_error(error_reply(exc), version)


# --------------------------------------------------------------------------------------------------- decode


class FrameHeader(NamedTuple):
    """The 16-byte header of a frame, checked (`decode_header`)."""

    type: MessageType
    flags: int
    payload_nbytes: int
    crc32: int
    version: int = PROTOCOL_VERSION


def decode_header(data, limits: Limits | None = None) -> FrameHeader:
    """Parse and check the 16-byte header at the start of ``data`` (a stream reader can call it before reading
    the payload). Raises Truncated, BadMagic, UnsupportedVersion (a version outside SUPPORTED_VERSIONS),
    UnknownMessageType, BadFlags, FrameTooLarge (the header's length, or the bytes given when more, over
    ``limits.max_frame_bytes``)."""
    limits = limits or Limits()
    if len(data) < HEADER.size:
        raise Truncated(f"frame has {len(data)} bytes: the header alone is {HEADER.size}")
    magic, version, mtype, flags, length, crc = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise BadMagic(f"frame starts with {bytes(magic)!r}: every frame starts with {MAGIC!r}")
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"frame speaks protocol version {version}: this side speaks version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; {OLD_VERSION_FIX}"
        )
    try:
        mtype = MessageType(mtype)
    except ValueError:
        allowed = ", ".join(f"{t.value} ({t.name})" for t in MessageType)
        raise UnknownMessageType(f"message type = {mtype}: must be one of {allowed}") from None
    if flags:
        raise BadFlags(f"header flags = {flags:#04x}: protocol version {version} defines none, must be 0")
    size = max(HEADER.size + length, len(data))  # what the header announces or what arrived, the larger
    if size > limits.max_frame_bytes:
        raise FrameTooLarge(
            f"{mtype.name} frame of {size} bytes: this receiver accepts at most "
            f"max_frame_bytes = {limits.max_frame_bytes}"
        )
    return FrameHeader(mtype, flags, length, crc, version)


def frame_version(data, limits: Limits | None = None) -> int:
    """The protocol version of the frame at the start of ``data``, from its header alone (the payload is not
    read). Raises what `decode_header` raises: Truncated, BadMagic, UnsupportedVersion, UnknownMessageType,
    BadFlags, FrameTooLarge."""
    return decode_header(data, limits).version


class _Reader:
    """Reads one payload front to back; running out raises LengthMismatch naming the field."""

    def __init__(self, payload: memoryview, what: str):
        self.buf, self.pos, self.what = payload, 0, what

    def take(self, n: int, field: str) -> memoryview:
        left = len(self.buf) - self.pos
        if n > left:
            raise LengthMismatch(
                f"{self.what} payload ends inside {field}: it needs {n} bytes at offset {self.pos}, {left} are left"
            )
        self.pos += n
        return self.buf[self.pos - n : self.pos]

    def fields(self, part: FixedPart, field: str) -> Any:
        return part.unpack(self.take(part.size, field))

    def array(self, wire_dtype: str, count: int, field: str, dtype=np.int32) -> np.ndarray:
        raw = self.take(count * np.dtype(wire_dtype).itemsize, field)
        return np.frombuffer(raw, wire_dtype).astype(dtype)  # a copy: never aliases the caller's buffer

    def text(self, n: int, field: str) -> str:
        try:
            return bytes(self.take(n, field)).decode("utf-8")
        except UnicodeDecodeError as e:
            raise BadText(f"{self.what} {field} is not valid utf-8 ({e.reason} at byte {e.start})") from None

    def end(self) -> None:
        if self.pos != len(self.buf):
            raise LengthMismatch(
                f"{self.what} payload has {len(self.buf) - self.pos} bytes after its last field "
                f"(ends at offset {self.pos} of {len(self.buf)})"
            )


def _enum(index: int, names: tuple[str, ...], field: str) -> str:
    if index >= len(names):
        allowed = ", ".join(f"{i} ({n})" for i, n in enumerate(names))
        raise BadEnum(f"{field} = {index}: must be one of {allowed}")
    return names[index]


def _finish_code(m: RoundReply) -> int:
    """REPLY's finished byte: 0 = not finished, 1 + index of the reason in FINISH_REASONS (a finished reply
    without a reason counts as ``stop``)."""
    if not m.finished:
        return 0
    return 1 + FINISH_REASONS.index(m.finish_reason or "stop")


def _flag(value: int, field: str) -> bool:
    if value > 1:
        raise BadEnum(f"{field} = {value}: must be 0 or 1")
    return bool(value)


def _unpack_open(r: _Reader, limits: Limits, layout: Layout) -> OpenRequest:
    f = r.fields(layout.fixed[MessageType.OPEN], "fixed part")
    prompt = r.array("<i4", f.n_prompt, "prompt_ids")
    auth = r.text(f.auth_len, "auth_token") if f.auth_len else None
    chat = r.text(f.chat_len, "chat") if f.chat_len else None
    return OpenRequest(
        prompt_ids=prompt,
        sampling=Sampling(f.temperature, f.top_k, f.top_p),
        seed=f.seed,
        acceptance=_enum(f.acceptance, ACCEPTANCE_MODES, "OPEN acceptance"),
        epsilon=f.epsilon,
        draft_place=_enum(f.draft_place, DRAFT_PLACES, "OPEN draft_place"),
        max_new_tokens=f.max_new_tokens,
        auth_token=auth,
        chat=chat,
        anchor=f.anchor,
        draft_ms_floor=f.draft_ms_floor,
        draft_ms_tree=f.draft_ms_tree,
    )


def _unpack_opened(r: _Reader, limits: Limits, layout: Layout) -> Opened:
    *fixed, n_stops = r.fields(layout.fixed[MessageType.OPENED], "fixed part")
    stops = r.array("<i4", n_stops, "stop_ids")
    # the fixed fields are the ones before stop_ids, in order (the table's OPENED layout); mypy cannot see that
    return Opened(*fixed, stop_ids=tuple(int(i) for i in stops))  # type: ignore[misc]


def _unpack_tree(r: _Reader, limits: Limits, layout: Layout) -> DraftTree:
    f = r.fields(layout.fixed[MessageType.ROUND], "fixed part")
    check_rows(f.rows, "ROUND", limits)  # before reading: the count alone is enough to refuse
    has_scores = _flag(f.has_scores, "ROUND has_scores")
    tokens, parents = r.array("<i4", f.rows, "tokens"), r.array("<i2", f.rows, "parents")
    scores = r.array("<f2", f.rows, "scores", np.float32) if has_scores else None
    return DraftTree(f.seq, tokens, parents, scores)


def _unpack_handoff(r: _Reader, limits: Limits, layout: Layout) -> HandOff:
    hidden, d_s, d_f = r.fields(layout.handoff_sizes, "hand-off sizes")
    check_handoff_sizes(hidden, d_s, d_f, limits)
    t_prime, a, bonus, n, *scales, body_crc = r.fields(layout.handoff_fixed, "hand-off fixed part")
    if a > t_prime:
        raise BadHandoffRange(f"HandOff.a = {a} is after t_prime = {t_prime}: must satisfy a <= t_prime")
    if n != t_prime - a:
        raise BadHandoffRange(f"HandOff n_positions = {n}: must equal t_prime - a = {t_prime - a}")
    if limits.max_context is not None and n > limits.max_context:
        raise ContextOverflow(f"HandOff n_positions = {n}: must be <= max_context = {limits.max_context}")
    body = r.take(2 * hidden + 2 * n * (d_s + d_f), "hand-off body")
    if zlib.crc32(body) != body_crc:
        raise CrcMismatch(f"hand-off body crc32 = {zlib.crc32(body):#010x}: its fixed part says {body_crc:#010x}")
    b = _Reader(body, "hand-off body")
    return HandOff(
        t_prime=t_prime,
        a=a,
        bonus=bonus,
        x_hat=b.array("i1", 2 * hidden, "x_hat", np.int8),
        k_sliding=b.array("i1", n * d_s, "k_sliding", np.int8).reshape(n, d_s),
        v_sliding=b.array("i1", n * d_s, "v_sliding", np.int8).reshape(n, d_s),
        k_full=b.array("i1", n * d_f, "k_full", np.int8).reshape(n, d_f),
        v_full=b.array("i1", n * d_f, "v_full", np.int8).reshape(n, d_f),
        scales=tuple(scales),
    )


def _unpack_reply(r: _Reader, limits: Limits, layout: Layout) -> RoundReply:
    f = r.fields(layout.fixed[MessageType.REPLY], "fixed part")
    check_rows(f.rows, "REPLY samples", limits)
    reason = None if f.finished == 0 else _enum(f.finished - 1, FINISH_REASONS, "REPLY finished (minus 1)")
    has_handoff = _flag(f.has_handoff, "REPLY has_handoff")
    has_verified = _flag(f.has_verified, "REPLY has_verified")
    samples = r.array("<i4", f.rows, "samples")
    path = r.array("<i2", f.n_path, "path_rows")
    chain = r.array("<i4", f.n_chain, "chain")
    verified = _unpack_mask(r, f.rows) if has_verified else None
    handoff = _unpack_handoff(r, limits, layout) if has_handoff else None
    return RoundReply(
        f.seq, samples, path, f.bonus, f.server_ms, reason is not None, handoff, chain, reason, verified, f.allowance
    )


def _unpack_mask(r: _Reader, rows: int) -> np.ndarray:
    """REPLY's verified rows: ceil(rows / 8) bytes, row j at byte j // 8, bit j % 8 (LSB first), pad bits 0."""
    bits = np.unpackbits(np.frombuffer(r.take((rows + 7) // 8, "verified mask"), np.uint8), bitorder="little")
    if bits[rows:].any():
        raise BadShape(
            f"REPLY verified mask has bit {rows + int(np.argmax(bits[rows:]))} set: the tree has {rows} "
            "rows, the pad bits after the last row must be 0"
        )
    return bits[:rows].astype(np.bool_)


def _unpack_close(r: _Reader, limits: Limits, layout: Layout) -> Close:
    return Close(*r.fields(layout.fixed[MessageType.CLOSE], "fixed part"))


def _unpack_error(r: _Reader, limits: Limits, layout: Layout) -> ErrorReply:
    f = r.fields(layout.fixed[MessageType.ERROR], "fixed part")
    return ErrorReply(r.text(f.code_len, "code"), r.text(f.message_len, "message"))


def _unpack_append(r: _Reader, limits: Limits, layout: Layout) -> AppendTurn:
    f = r.fields(layout.fixed[MessageType.APPEND], "fixed part")
    return AppendTurn(r.array("<i4", f.n_tokens, "tokens"), f.max_new_tokens, f.keep, f.keep_crc, f.anchor)


_UNPACKERS = {
    MessageType.OPEN: _unpack_open,
    MessageType.OPENED: _unpack_opened,
    MessageType.ROUND: _unpack_tree,
    MessageType.REPLY: _unpack_reply,
    MessageType.CLOSE: _unpack_close,
    MessageType.ERROR: _unpack_error,
    MessageType.APPEND: _unpack_append,
}


def decode(data: bytes | bytearray | memoryview, limits: Limits | None = None):
    """The message in one whole frame, every field checked (against ``limits`` where given; None = `Limits()`).

    Order of checks: header (`decode_header`), then Truncated / LengthMismatch of the frame against its header's
    payload length, CrcMismatch, then the payload's fields as it is read (counts before the arrays they size),
    then `validate`. Arrays come back as fresh native int32 / int8 copies (ROUND scores: float32; REPLY verified:
    bool). `frame_version` says which version a frame speaks. The verified mask's ancestor closure needs
    the tree it answers, which only the sender of that tree knows: the device runtime checks it
    (`hycoc.runtime.tree_builder.check_verified`).
    """
    limits = limits or Limits()
    header = decode_header(data, limits)
    end = HEADER.size + header.payload_nbytes
    if len(data) < end:
        raise Truncated(
            f"{header.type.name} frame has {len(data)} bytes: its header announces {end} "
            f"({header.payload_nbytes} of payload)"
        )
    if len(data) > end:
        raise LengthMismatch(
            f"{header.type.name} frame has {len(data)} bytes: its header announces {end}; send one frame per message"
        )
    payload = memoryview(data)[HEADER.size : end]
    crc = zlib.crc32(payload)
    if crc != header.crc32:
        raise CrcMismatch(f"{header.type.name} payload crc32 = {crc:#010x}: its header says {header.crc32:#010x}")
    reader = _Reader(payload, header.type.name)
    msg = _UNPACKERS[header.type](reader, limits, layout_of(header.version))
    reader.end()
    validate(msg, limits)
    return msg
