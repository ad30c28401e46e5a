"""Binary frames between the device runtime and the verifier (docs/design.md "Wire protocol"; this docstring is the byte-level truth).

numpy + stdlib only: the device runtime imports this module on the phone. `encode` turns a message of
`hycoc.protocol.messages` into one frame, `decode` turns a frame back into a message and validates every field against
what the receiver knows (`Limits`). A malformed frame raises a `WireError` subclass whose ``code`` is stable;
the receiver answers it with `error_frame(exc)`.

Frame = 16-byte header + payload, every integer and float little-endian::

    offset size  field
    0      4     magic b"HYCO"
    4      2     protocol version, u16 (PROTOCOL_VERSION = 5, the only one accepted: SUPPORTED_VERSIONS)
    6      1     message type, u8 (MessageType)
    7      1     flags, u8: reserved, must be 0 (the crc does not cover the header, so no meaning rides here)
    8      4     payload length in bytes, u32
    12     4     crc32 (zlib) of the payload, u32

Versions. A receiver accepts every version of SUPPORTED_VERSIONS (5 only: version 5 changed what a conversation
is, so an older peer is refused at its first frame with ``unsupported_version`` naming the fix); a session speaks
the version of its OPEN frame and its peer answers every frame of it in that version (`frame_version` reads it,
`encode(msg, version=v)` writes it).

Payloads (R = tree rows = B + 1, P = accepted path length, K = chain length, T = prompt length)::

    OPEN    42 B: f32 temperature, u32 top_k, f32 top_p, u64 seed, f32 epsilon, u8 acceptance (index into
            ACCEPTANCE_MODES), u8 draft_place (index into DRAFT_PLACES), u16 auth_len, u16 chat_len,
            u32 max_new_tokens, u32 T, u32 anchor (the prompt's model-turn opening, < T; 0 = none); then i32[T]
            prompt_ids; then auth_len bytes of utf-8 auth token (auth_len 0 = no token); then chat_len bytes of the
            device's chat contract, utf-8 JSON (chat_len 0 = none). Total frame: `open_nbytes`.
    OPENED  42 B: u64 session_id, u32 t, f32 prefill_ms, u32 max_context, u32 tree_rows, u32 vocab_size,
            u32 hidden_size, u32 kv_dim_sliding, u32 kv_dim_full, u16 S; then i32[S] stop_ids (S >= 1).
    ROUND   7 B: u32 seq, u16 R, u8 has_scores (0/1); then i32[R] tokens, i16[R] parents; then, when
            has_scores, f16[R] scores (each row's tree score s(v) of Alg. 3, natural log; scores[0] == 0, every
            row <= its parent; the sender clamps below -65,504, fp16's lowest finite value).
            Total frame: `tree_nbytes(R)` = 23 + 8 R bytes with scores (287 B at B = 32; SpecEdge: ~135 KB per
            round), 23 + 6 R without.
    REPLY   21 B: u32 seq, i32 bonus, f32 server_ms, u8 finished (0 = no, else 1 + index into FINISH_REASONS:
            1 stop, 2 max_new_tokens, 3 length), u8 has_handoff (0/1), u16 R, u16 P, u16 K, u8 has_verified
            (0/1); then i32[R] samples, i16[P] path_rows, i32[K] chain; then, when has_verified, the verified rows
            as a bitmask of ceil(R / 8) bytes (row j at byte j // 8, bit j % 8, least significant bit first; the
            pad bits after row R - 1 are 0); then, when has_handoff, 12 B of sizes (u32 hidden_size,
            u32 kv_dim_sliding, u32 kv_dim_full) and the hand-off block below. No mask: every row was verified.
            Total frame: `reply_nbytes(R, P, K, handoff, verified=...)` = 37 + 4 R + 2 P + 4 K
            (+ ceil(R / 8) with the mask, + hand-off); 169 B at R = 33, P = 0, no hand-off, 174 B with the mask.
    CLOSE   8 B: u64 session_id.
    APPEND  20 B: u32 max_new_tokens, u32 keep, u32 keep_crc, u32 anchor, u32 T; then i32[T] tokens (after a
            finished reply: the whole conversation re-rendered by the template keeps its first ``keep`` ids of
            what the session holds, crc32 ``keep_crc`` of them as <i4, and continues with ``tokens``; ``anchor``
            in [keep, keep + T) or 0). Total frame: `append_nbytes`.
    ERROR   3 B: u8 code_len, u16 message_len; then the code (ascii, [a-z][a-z0-9_]*), the message (utf-8).

Hand-off block (Alg. 4 line 14), n = t' - a positions, H hidden size, d_s / d_f the kv_dim (kv_heads * head_dim)
of the last sliding / last full-attention layer::

    44 B fixed part, struct "<IIIIffffffI": t_prime, a, bonus, n_positions, scale_e, scale_h, scale_k_sliding,
         scale_v_sliding, scale_k_full, scale_v_full, crc32 of the int8 body
    int8 body: x_hat (2H) = [e(b); h_{v*}], then k_sliding, v_sliding (n, d_s) and k_full, v_full (n, d_f),
         each row-major

`handoff_nbytes` gives 44 + 2H + 2n (d_s + d_f) bytes: for Gemma 4 26B-A4B (H = 2816, d_s = 8 * 256,
d_f = 2 * 512) 44 + 5,632 B per round + 6,144 B per position, 6,297,132 B for a first reply of W = 1,024 rows.

Limits: parents are int16, so a tree has at most MAX_TREE_ROWS = 32,768 rows (B <= 32,767); R, P and K are u16.

Errors (``WireError.code``, one class each; `encode` runs the same checks without limits):
bad_magic, unsupported_version (names the frame's version and the versions supported), unknown_message_type,
bad_flags, frame_too_large (from the header, before the payload is read), truncated, length_mismatch (frame vs
header, or a count vs the payload), crc_mismatch (payload, or the hand-off body), bad_enum (acceptance,
draft_place, 0/1 flags), bad_text (utf-8, auth token, error code), bad_shape (arrays given to `encode`; a verified
mask's pad bits set), not_finite (every float), out_of_range (and its subclasses bad_temperature (< 0),
bad_top_k (< 1), bad_top_p / bad_epsilon (outside (0, 1])), token_out_of_vocab (names the row and id),
wrong_row_count (expected vs got), bad_parent (parents[0] != -1 or not 0 <= parents[j] < j, which also excludes
cycles; names the row), bad_path (path rows not increasing in [1, R); with a verified mask: row 0 or a path row
not verified), bad_scores (a ROUND's scores[0] != 0, or a row scoring above its parent; names the row),
bonus_mismatch (bonus != samples at the path's end, or != the hand-off's bonus), handoff_size_mismatch,
bad_handoff_range (a > t', n_positions != t' - a), context_overflow (prompt >= max_context: no room for output;
t', n_positions > max_context), config_mismatch (OPENED vs what the device was built for). Anything else becomes
``internal_error``.
"""

from __future__ import annotations

import enum
import math
import re
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

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

#: 2: REPLY's ``finished`` byte carries the finish reason and APPEND (type 7) continues a finished session.
#: 3: OPEN carries the device's chat contract and OPENED the verifier's stop ids.
#: 4: ROUND may carry each row's tree score (fp16) and REPLY the verified rows (a bitmask).
#: 5: a conversation is its messages re-rendered by the checkpoint's template each turn: APPEND says how much of
#: what the session holds it keeps (keep, keep_crc) and where the new model turn opens (anchor, also in OPEN), and
#: the chat contract names the template's sha256. A version-4 peer would append a turn to a conversation the
#: template does not render, so older versions are refused (`OLD_VERSION_FIX`).
PROTOCOL_VERSION = 5
#: Versions a receiver accepts; a session answers in its OPEN's version.
SUPPORTED_VERSIONS = (5,)
#: Older versions whose ERROR frame has this version's layout: an older peer's refusal is answered in its own
#: version (`error_frame`), so it reads the code and `OLD_VERSION_FIX` instead of failing on the header.
LEGACY_ERROR_VERSIONS = (3, 4)
#: What an older peer is told (the ``unsupported_version`` message's fix).
OLD_VERSION_FIX = (
    "update hycoc on both sides and rebuild the device bundle with it (`hycoc build RECIPE`): "
    "protocol 5 re-renders each conversation with the checkpoint's template (see the section "
    "Conversations of docs/serving.md)"
)
MAGIC = b"HYCO"
HEADER = struct.Struct("<4sHBBII")
#: parents travel as int16: row 32767 is the last one that can be a parent, so R <= 32768 (B <= 32767).
MAX_TREE_ROWS = 32768
#: Large enough for a first reply of Gemma 4 26B-A4B (6.3 MB); servers may lower it for what they receive.
DEFAULT_MAX_FRAME_BYTES = 16 * 2**20

_OPEN = struct.Struct("<fIfQfBBHHIII")
_OPENED = struct.Struct("<QIfIIIIIIH")
_ROUND = struct.Struct("<IHB")
_REPLY = struct.Struct("<IifBBHHHB")
#: fp16's lowest finite value: ROUND scores below it travel as it (never as -inf).
FP16_SCORE_FLOOR = -65504.0
_HANDOFF_SIZES = struct.Struct("<III")
HANDOFF_FIXED = struct.Struct("<IIIIffffffI")
_CLOSE = struct.Struct("<Q")
_APPEND = struct.Struct("<IIIII")
_ERROR = struct.Struct("<BH")

_SCALE_NAMES = ("e", "h", "k_sliding", "v_sliding", "k_full", "v_full")
_ERROR_CODE = re.compile(r"[a-z][a-z0-9_]*")


class MessageType(enum.IntEnum):
    OPEN = 1
    OPENED = 2
    ROUND = 3
    REPLY = 4
    CLOSE = 5
    ERROR = 6
    APPEND = 7


# --------------------------------------------------------------------------------------------------- errors


class WireError(Exception):
    """A frame or message that breaks the protocol. ``code`` is stable (it goes into error frames and metrics);
    ``message`` says what was wrong and what is allowed."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class _Kind(WireError):
    code = "wire_error"

    def __init__(self, message: str):
        super().__init__(type(self).code, message)


class BadMagic(_Kind):
    code = "bad_magic"


class UnsupportedVersion(_Kind):
    code = "unsupported_version"


class UnknownMessageType(_Kind):
    code = "unknown_message_type"


class BadFlags(_Kind):
    code = "bad_flags"


class FrameTooLarge(_Kind):
    code = "frame_too_large"


class Truncated(_Kind):
    code = "truncated"


class LengthMismatch(_Kind):
    code = "length_mismatch"


class CrcMismatch(_Kind):
    code = "crc_mismatch"


class BadEnum(_Kind):
    code = "bad_enum"


class BadText(_Kind):
    code = "bad_text"


class BadShape(_Kind):
    code = "bad_shape"


class NotFinite(_Kind):
    code = "not_finite"


class OutOfRange(_Kind):
    code = "out_of_range"


class BadTemperature(OutOfRange):
    code = "bad_temperature"


class BadTopK(OutOfRange):
    code = "bad_top_k"


class BadTopP(OutOfRange):
    code = "bad_top_p"


class BadEpsilon(OutOfRange):
    code = "bad_epsilon"


class TokenOutOfVocab(_Kind):
    code = "token_out_of_vocab"


class WrongRowCount(_Kind):
    code = "wrong_row_count"


class BadParent(_Kind):
    code = "bad_parent"


class BadPath(_Kind):
    code = "bad_path"


class BadScores(_Kind):
    code = "bad_scores"


class BonusMismatch(_Kind):
    code = "bonus_mismatch"


class HandoffSizeMismatch(_Kind):
    code = "handoff_size_mismatch"


class BadHandoffRange(_Kind):
    code = "bad_handoff_range"


class ContextOverflow(_Kind):
    code = "context_overflow"


class ConfigMismatch(_Kind):
    code = "config_mismatch"


def _kinds(cls):
    for sub in cls.__subclasses__():
        yield sub
        yield from _kinds(sub)


#: code -> exception class, for turning a received ErrorReply back into an exception.
ERROR_CLASSES: dict[str, type[_Kind]] = {cls.code: cls for cls in _kinds(_Kind)}


def error_reply(exc: BaseException) -> ErrorReply:
    """The ErrorReply for an exception.

    A WireError, or any exception whose class declares a string ``code`` meant for the peer (the verifier's
    ``VerifierError`` family), keeps its code and its message (``exc.message``, else ``str(exc)``; cut to 65,535
    utf-8 bytes). Anything else becomes ``internal_error`` naming only the exception's type, so no internals
    leak to the peer.
    """
    code = exc.code if isinstance(exc, WireError) else getattr(type(exc), "code", None)
    if isinstance(code, str) and _ERROR_CODE.fullmatch(code) and len(code) <= 255:
        message = getattr(exc, "message", None)
        message = message if isinstance(message, str) else str(exc)
        return ErrorReply(code, message.encode("utf-8")[:65535].decode("utf-8", "ignore"))
    return ErrorReply("internal_error", f"the receiver failed on this message ({type(exc).__name__})")


def error_frame(exc: BaseException, version: int = PROTOCOL_VERSION) -> bytes:
    """An ERROR frame answering ``exc``, in protocol ``version`` (the session's: `frame_version` of its OPEN, or
    an older peer's own version of `LEGACY_ERROR_VERSIONS`, so that it can read its refusal and the fix); never
    raises for an exception (messages over 65,535 bytes are cut)."""
    return encode_error(error_reply(exc), version)


def encode_error(reply: ErrorReply, version: int = PROTOCOL_VERSION) -> bytes:
    """The ERROR frame of ``reply`` in protocol ``version``: one of SUPPORTED_VERSIONS, or of
    LEGACY_ERROR_VERSIONS (the same payload under an older header, for a peer to read its refusal)."""
    if version in LEGACY_ERROR_VERSIONS:
        frame = bytearray(encode(reply))
        struct.pack_into("<H", frame, 4, version)  # ERROR's payload is the same in those versions
        return bytes(frame)
    return encode(reply, version=version)


def error_from_reply(reply: ErrorReply) -> WireError:
    """The exception a received ErrorReply stands for (its class when the code is known, else WireError)."""
    cls = ERROR_CLASSES.get(reply.code)
    return cls(reply.message) if cls is not None else WireError(reply.code, reply.message)


# --------------------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """What the receiver knows; `decode` checks every field it can against it. None leaves a check out.

    max_frame_bytes: header + payload, checked from the header before the payload is read.
    vocab_size: token ids must lie in [0, vocab_size). tree_rows: rows of every ROUND and samples of every
    REPLY (B + 1). max_context: positions the verifier holds (prompt length, t', hand-off rows).
    hidden_size, kv_dim_sliding, kv_dim_full: the hand-off sizes (and, on OPENED, the server's config).
    """

    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    vocab_size: int | None = None
    tree_rows: int | None = None
    max_context: int | None = None
    hidden_size: int | None = None
    kv_dim_sliding: int | None = None
    kv_dim_full: int | None = None

    @classmethod
    def from_opened(cls, opened: Opened, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> Limits:
        """The device's limits for a session's replies, from the server's OPENED."""
        return cls(
            max_frame_bytes=max_frame_bytes,
            vocab_size=opened.vocab_size,
            tree_rows=opened.tree_rows,
            max_context=opened.max_context,
            hidden_size=opened.hidden_size,
            kv_dim_sliding=opened.kv_dim_sliding,
            kv_dim_full=opened.kv_dim_full,
        )


# --------------------------------------------------------------------------------------------------- sizes


def tree_nbytes(rows: int, *, version: int = PROTOCOL_VERSION, scores: bool = True) -> int:
    """Bytes of a ROUND frame with ``rows`` rows: 16 header + 7 fixed + 4 per token id + 2 per parent, + 2 per fp16
    score when ``scores``. The defaults are what the device runtime sends: 287 B at B = 32."""
    _check_version(version)
    return HEADER.size + _ROUND.size + (8 if scores else 6) * rows


def open_nbytes(prompt_len: int, auth_bytes: int = 0, chat_bytes: int = 0) -> int:
    """Bytes of an OPEN frame: 16 header + 42 fixed + 4 per prompt id + the auth token's and the chat contract's
    utf-8 bytes (each at most 65,535)."""
    return HEADER.size + _OPEN.size + 4 * int(prompt_len) + int(auth_bytes) + int(chat_bytes)


def append_nbytes(tokens: int) -> int:
    """Bytes of an APPEND frame: 16 header + 20 fixed + 4 per token id."""
    return HEADER.size + _APPEND.size + 4 * int(tokens)


def handoff_nbytes(hidden_size: int, kv_dim_sliding: int, kv_dim_full: int, n_positions: int) -> int:
    """Bytes of a hand-off block: 44 fixed + 2H for x_hat + K and V of both layers per position."""
    return HANDOFF_FIXED.size + 2 * hidden_size + 2 * n_positions * (kv_dim_sliding + kv_dim_full)


def reply_nbytes(
    rows: int,
    path_len: int,
    chain_len: int = 0,
    handoff: int | None = None,
    *,
    version: int = PROTOCOL_VERSION,
    verified: bool = False,
) -> int:
    """Bytes of a REPLY frame; ``handoff`` is `handoff_nbytes(...)` of its hand-off, or None without one;
    ``verified``: it carries the verified-rows mask (ceil(rows / 8) bytes)."""
    _check_version(version)
    n = HEADER.size + _REPLY.size + 4 * rows + 2 * path_len + 4 * chain_len
    if verified:
        n += (rows + 7) // 8
    return n if handoff is None else n + _HANDOFF_SIZES.size + handoff


def _check_version(version: int) -> int:
    if version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"protocol version {version}: this side speaks version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; {OLD_VERSION_FIX}"
        )
    return int(version)


# --------------------------------------------------------------------------------------------------- checks


def _f32(x, field: str) -> float:
    with np.errstate(over="ignore", invalid="ignore"):
        v = float(np.float32(x))
    if not math.isfinite(v):
        raise NotFinite(f"{field} = {x!r}: must be a finite float32 (no NaN or inf)")
    return v


def _uint(x, field: str, bits: int, lo: int = 0) -> int:
    x = int(x)
    hi = 2**bits - 1
    if not lo <= x <= hi:
        raise OutOfRange(f"{field} = {x}: must lie in [{lo}, {hi}]")
    return x


def _int_array(a, field: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BadShape(f"{field}: must be a 1-D integer array, got dtype {a.dtype} and shape {a.shape}")
    return a.astype(np.int64, copy=False)


def _int8_array(a, field: str, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != ndim or a.dtype != np.int8:
        raise BadShape(f"{field}: must be a {ndim}-D int8 array, got dtype {a.dtype} and shape {a.shape}")
    return a


def _check_token(x: int, field: str, vocab_size: int | None) -> None:
    hi = 2**31 if vocab_size is None else vocab_size
    if not 0 <= int(x) < hi:
        raise TokenOutOfVocab(f"{field} = {int(x)}: token ids must lie in [0, {hi})")


def _check_tokens(ids: np.ndarray, field: str, vocab_size: int | None) -> None:
    hi = 2**31 if vocab_size is None else vocab_size
    bad = (ids < 0) | (ids >= hi)
    if bad.any():
        row = int(np.argmax(bad))
        raise TokenOutOfVocab(f"{field}[{row}] = {int(ids[row])}: token ids must lie in [0, {hi})")


def _check_rows(rows: int, field: str, limits: Limits) -> None:
    if not 1 <= rows <= MAX_TREE_ROWS:
        raise WrongRowCount(f"{field} has {rows} rows: a tree has 1 to {MAX_TREE_ROWS} rows (B <= 32767)")
    if limits.tree_rows is not None and rows != limits.tree_rows:
        raise WrongRowCount(f"{field} has {rows} rows, expected {limits.tree_rows} (B + 1 of this session)")


def _check_open(m: OpenRequest, limits: Limits) -> None:
    prompt = _int_array(m.prompt_ids, "OpenRequest.prompt_ids")
    if prompt.size == 0:
        raise OutOfRange("OpenRequest.prompt_ids is empty: a request needs at least one token (the first root)")
    if limits.max_context is not None and prompt.size >= limits.max_context:
        raise ContextOverflow(
            f"OpenRequest.prompt_ids has {prompt.size} tokens: the verifier holds max_context = "
            f"{limits.max_context} positions, prompt and output together, so a prompt may have at most "
            f"{limits.max_context - 1} tokens"
        )
    _uint(prompt.size, "OpenRequest.prompt_ids length", 32)
    _check_tokens(prompt, "OpenRequest.prompt_ids", limits.vocab_size)
    s = m.sampling
    if _f32(s.temperature, "Sampling.temperature") < 0:
        raise BadTemperature(f"Sampling.temperature = {s.temperature}: must be >= 0 (0 means greedy)")
    if not 1 <= int(s.top_k) <= 2**32 - 1:
        raise BadTopK(f"Sampling.top_k = {s.top_k}: must be >= 1 (u32)")
    if not 0 < _f32(s.top_p, "Sampling.top_p") <= 1:
        raise BadTopP(f"Sampling.top_p = {s.top_p}: must lie in (0, 1]")
    _uint(m.seed, "OpenRequest.seed", 64)
    if m.acceptance not in ACCEPTANCE_MODES:
        raise BadEnum(f"OpenRequest.acceptance = {m.acceptance!r}: must be one of {ACCEPTANCE_MODES}")
    if m.draft_place not in DRAFT_PLACES:
        raise BadEnum(f"OpenRequest.draft_place = {m.draft_place!r}: must be one of {DRAFT_PLACES}")
    if not 0 < _f32(m.epsilon, "OpenRequest.epsilon") <= 1:
        raise BadEpsilon(f"OpenRequest.epsilon = {m.epsilon}: must lie in (0, 1] (1 = exact acceptance)")
    _uint(m.max_new_tokens, "OpenRequest.max_new_tokens", 32, lo=1)
    if m.auth_token is not None:
        if not isinstance(m.auth_token, str) or not 1 <= len(m.auth_token.encode("utf-8")) <= 65535:
            raise BadText("OpenRequest.auth_token: must be None or a non-empty string of at most 65,535 utf-8 bytes")
    if m.chat is not None:
        if not isinstance(m.chat, str) or not 1 <= len(m.chat.encode("utf-8")) <= 65535:
            raise BadText("OpenRequest.chat: must be None or a non-empty string of at most 65,535 utf-8 bytes")
    if not 0 <= int(m.anchor) < max(1, prompt.size):
        raise OutOfRange(
            f"OpenRequest.anchor = {m.anchor}: must lie in [0, T = {prompt.size}) (the prompt's model-turn "
            "opening; 0 = none)"
        )


def _check_opened(m: Opened, limits: Limits) -> None:
    _uint(m.session_id, "Opened.session_id", 64)
    max_context = _uint(m.max_context, "Opened.max_context", 32, lo=1)
    if not 0 <= int(m.t) < max_context:
        raise ContextOverflow(f"Opened.t = {m.t}: the first root must sit in [0, max_context = {max_context})")
    if _f32(m.prefill_ms, "Opened.prefill_ms") < 0:
        raise OutOfRange(f"Opened.prefill_ms = {m.prefill_ms}: must be >= 0 (milliseconds)")
    _check_rows(int(m.tree_rows), "Opened.tree_rows", Limits())
    stops = tuple(m.stop_ids)
    if not 1 <= len(stops) <= 65535:
        raise OutOfRange(f"Opened.stop_ids has {len(stops)} ids: the verifier stops on 1 to 65,535 ids")
    for i in stops:
        _check_token(int(i), "Opened.stop_ids", limits.vocab_size)
    for name in ("vocab_size", "hidden_size", "kv_dim_sliding", "kv_dim_full", "tree_rows"):
        got = _uint(getattr(m, name), f"Opened.{name}", 32, lo=1)
        want = getattr(limits, name)
        if want is not None and got != want:
            raise ConfigMismatch(f"Opened.{name} = {got}: this device was built for {name} = {want}")


def _check_tree(m: DraftTree, limits: Limits) -> None:
    _uint(m.seq, "DraftTree.seq", 32)
    tokens = _int_array(m.tokens, "DraftTree.tokens")
    parents = _int_array(m.parents, "DraftTree.parents")
    if tokens.size != parents.size:
        raise WrongRowCount(f"DraftTree has {tokens.size} tokens but {parents.size} parents: one each per row")
    _check_rows(tokens.size, "DraftTree", limits)
    _check_tokens(tokens, "DraftTree.tokens", limits.vocab_size)
    if parents[0] != -1:
        raise BadParent(f"DraftTree.parents[0] = {int(parents[0])}: row 0 is the root, its parent must be -1")
    # 0 <= parents[j] < j: every row hangs below an earlier one, which also rules out cycles.
    rows = np.arange(parents.size)
    bad = (parents < 0) | (parents >= rows)
    bad[0] = False
    if bad.any():
        j = int(np.argmax(bad))
        raise BadParent(
            f"DraftTree.parents[{j}] = {int(parents[j])}: row {j}'s parent must be an earlier row, in [0, {j})"
        )
    if m.scores is not None:
        _check_scores(m.scores, parents)


def _check_scores(scores, parents: np.ndarray) -> None:
    """DraftTree.scores: float (R,), finite, the root's 0, no row above its parent (Alg. 3: every edge adds
    ln q + ln λ < 0). fp16 rounding is monotone, so scores that pass in float32 pass after the wire's cast."""
    a = np.asarray(scores)
    if a.ndim != 1 or a.dtype.kind != "f" or a.size != parents.size:
        raise BadShape(
            f"DraftTree.scores: must be a 1-D float array of {parents.size} values (one per row), got "
            f"dtype {a.dtype} and shape {a.shape}"
        )
    with np.errstate(over="ignore"):
        a = a.astype(np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        j = int(np.argmax(bad))
        raise NotFinite(
            f"DraftTree.scores[{j}] = {a[j]}: scores must be finite (the device clamps at {FP16_SCORE_FLOOR:g})"
        )
    if a[0] != 0:
        raise BadScores(f"DraftTree.scores[0] = {a[0]}: the root's score is 0 (Alg. 3 line 2)")
    above = a[1:] > a[parents[1:]]
    if above.any():
        j = int(np.argmax(above)) + 1
        raise BadScores(
            f"DraftTree.scores[{j}] = {a[j]:g} is above its parent row {int(parents[j])}'s "
            f"{a[parents[j]]:g}: a row scores at most its parent (Alg. 3: s(child) = s(parent) + "
            "ln q + ln λ)"
        )


def _check_handoff_sizes(hidden_size: int, kv_dim_sliding: int, kv_dim_full: int, limits: Limits) -> None:
    sizes = {"hidden_size": hidden_size, "kv_dim_sliding": kv_dim_sliding, "kv_dim_full": kv_dim_full}
    for name, got in sizes.items():
        want = getattr(limits, name)
        if got < 1 or (want is not None and got != want):
            allowed = ">= 1" if want is None else f"{want}, this session's verifier size"
            raise HandoffSizeMismatch(f"HandOff {name} = {got}: must be {allowed}")


def _check_handoff(h: HandOff, limits: Limits, bonus: int) -> None:
    t_prime = _uint(h.t_prime, "HandOff.t_prime", 32)
    a = _uint(h.a, "HandOff.a", 32)
    if a > t_prime:
        raise BadHandoffRange(f"HandOff.a = {a} is after t_prime = {t_prime}: must satisfy a <= t_prime")
    n = t_prime - a
    if limits.max_context is not None and (n > limits.max_context or t_prime > limits.max_context):
        raise ContextOverflow(
            f"HandOff n_positions = {n}, t_prime = {t_prime}: both must be <= max_context = {limits.max_context}"
        )
    if int(h.bonus) != bonus:
        raise BonusMismatch(f"HandOff.bonus = {h.bonus}: must equal RoundReply.bonus = {bonus}")
    x_hat = _int8_array(h.x_hat, "HandOff.x_hat", 1)
    if x_hat.size == 0 or x_hat.size % 2:
        raise BadShape(f"HandOff.x_hat has {x_hat.size} values: must be [e(b); h], 2 * hidden_size")
    dims = {}
    for layer in ("sliding", "full"):
        k = _int8_array(getattr(h, f"k_{layer}"), f"HandOff.k_{layer}", 2)
        v = _int8_array(getattr(h, f"v_{layer}"), f"HandOff.v_{layer}", 2)
        if k.shape != v.shape:
            raise BadShape(f"HandOff.k_{layer} has shape {k.shape}, v_{layer} {v.shape}: they must match")
        if k.shape[0] != n:
            raise HandoffSizeMismatch(f"HandOff.k_{layer} has {k.shape[0]} rows: must be t_prime - a = {n} positions")
        dims[layer] = k.shape[1]
    _check_handoff_sizes(x_hat.size // 2, dims["sliding"], dims["full"], limits)
    if len(h.scales) != len(_SCALE_NAMES):
        raise BadShape(f"HandOff.scales has {len(h.scales)} values: must be {len(_SCALE_NAMES)} {_SCALE_NAMES}")
    for name, scale in zip(_SCALE_NAMES, h.scales):
        if _f32(scale, f"HandOff.scales[{name}]") <= 0:
            raise OutOfRange(f"HandOff.scales[{name}] = {scale}: must be > 0 (dequantize as int8 * scale)")


def _check_reply(m: RoundReply, limits: Limits) -> None:
    _uint(m.seq, "RoundReply.seq", 32)
    _check_token(m.bonus, "RoundReply.bonus", limits.vocab_size)
    if _f32(m.server_ms, "RoundReply.server_ms") < 0:
        raise OutOfRange(f"RoundReply.server_ms = {m.server_ms}: must be >= 0 (milliseconds)")
    samples = _int_array(m.samples, "RoundReply.samples")
    _check_rows(samples.size, "RoundReply.samples", limits)
    _check_tokens(samples, "RoundReply.samples", limits.vocab_size)
    path = _int_array(m.path_rows, "RoundReply.path_rows")
    # The path runs down from the root, so its rows grow (parents come before children) and never hit row 0.
    bad = (path < 1) | (path >= samples.size)
    bad[1:] |= path[1:] <= path[:-1]
    if bad.any():
        i = int(np.argmax(bad))
        raise BadPath(
            f"RoundReply.path_rows[{i}] = {int(path[i])}: path rows must increase and lie in [1, {samples.size})"
        )
    if m.verified is not None:
        verified = np.asarray(m.verified)
        if verified.dtype != np.bool_ or verified.shape != samples.shape:
            raise BadShape(
                f"RoundReply.verified: must be a bool array of {samples.size} values (one per row), got "
                f"dtype {verified.dtype} and shape {verified.shape}"
            )
        if not verified[0]:
            raise BadPath("RoundReply.verified[0] is False: the root (row 0) is always verified")
        off = ~verified[path]
        if off.any():
            i = int(np.argmax(off))
            raise BadPath(
                f"RoundReply.path_rows[{i}] = {int(path[i])} is not a verified row: the path runs through "
                "verified rows only"
            )
    chain = _int_array(m.chain, "RoundReply.chain")
    _uint(chain.size, "RoundReply.chain length", 16)
    _check_tokens(chain, "RoundReply.chain", limits.vocab_size)
    end = int(path[-1]) if path.size else 0
    if int(samples[end]) != int(m.bonus):  # Alg. 4 line 12: b = y^_{v*}
        raise BonusMismatch(
            f"RoundReply.bonus = {m.bonus}: must equal samples[{end}] = {int(samples[end])}, the sample at v*"
        )
    if m.finish_reason is not None and (not m.finished or m.finish_reason not in FINISH_REASONS):
        raise BadEnum(
            f"RoundReply.finish_reason = {m.finish_reason!r}: must be None, or one of "
            f"{', '.join(FINISH_REASONS)} on a finished reply"
        )
    if m.handoff is not None:
        _check_handoff(m.handoff, limits, int(m.bonus))


def _check_close(m: Close, limits: Limits) -> None:
    _uint(m.session_id, "Close.session_id", 64)


def _check_append(m: AppendTurn, limits: Limits) -> None:
    tokens = _int_array(m.tokens, "AppendTurn.tokens")
    if tokens.size == 0:
        raise OutOfRange("AppendTurn.tokens is empty: a turn needs at least one token (the next root)")
    if limits.max_context is not None and tokens.size >= limits.max_context:
        raise ContextOverflow(
            f"AppendTurn.tokens has {tokens.size} tokens: the verifier holds max_context = "
            f"{limits.max_context} positions"
        )
    _uint(tokens.size, "AppendTurn.tokens length", 32)
    _check_tokens(tokens, "AppendTurn.tokens", limits.vocab_size)
    if not 1 <= int(m.max_new_tokens) <= 2**32 - 1:
        raise OutOfRange(f"AppendTurn.max_new_tokens = {m.max_new_tokens}: must be >= 1 (u32)")
    keep = _uint(m.keep, "AppendTurn.keep", 32, lo=1)
    _uint(m.keep_crc, "AppendTurn.keep_crc", 32)
    if limits.max_context is not None and keep + tokens.size >= limits.max_context:
        raise ContextOverflow(
            f"AppendTurn: keep + T = {keep + tokens.size} positions: the verifier holds max_context "
            f"= {limits.max_context}, conversation and output together"
        )
    _uint(m.anchor, "AppendTurn.anchor", 32)
    if int(m.anchor) != 0 and not keep <= int(m.anchor) < keep + tokens.size:
        raise OutOfRange(
            f"AppendTurn.anchor = {m.anchor}: must lie in [keep, keep + T) = [{keep}, "
            f"{keep + tokens.size}) or be 0 (none)"
        )


def _check_error(m: ErrorReply, limits: Limits) -> None:
    if not isinstance(m.code, str) or not _ERROR_CODE.fullmatch(m.code) or len(m.code) > 255:
        raise BadText(f"ErrorReply.code = {m.code!r}: must match [a-z][a-z0-9_]* and be at most 255 bytes")
    if not isinstance(m.message, str) or len(m.message.encode("utf-8")) > 65535:
        raise BadText("ErrorReply.message: must be a string of at most 65,535 utf-8 bytes")


_CHECKS: dict[type, Callable[[Any, Limits], None]] = {
    OpenRequest: _check_open,
    Opened: _check_opened,
    DraftTree: _check_tree,
    RoundReply: _check_reply,
    Close: _check_close,
    ErrorReply: _check_error,
    AppendTurn: _check_append,
}


def validate(msg, limits: Limits | None = None) -> None:
    """Check every field of ``msg`` (and against ``limits``); raises the WireError subclass of the first fault."""
    check = _CHECKS.get(type(msg))
    if check is None:
        raise UnknownMessageType(
            f"{type(msg).__name__} is not a wire message: must be one of {[c.__name__ for c in _CHECKS]}"
        )
    check(msg, limits or Limits())


# --------------------------------------------------------------------------------------------------- encode


def _pack_open(m: OpenRequest, version: int) -> bytes:
    prompt = np.asarray(m.prompt_ids).astype("<i4")
    auth = b"" if m.auth_token is None else m.auth_token.encode("utf-8")
    chat = b"" if m.chat is None else m.chat.encode("utf-8")
    s = m.sampling
    fixed = _OPEN.pack(
        s.temperature,
        s.top_k,
        s.top_p,
        m.seed,
        m.epsilon,
        ACCEPTANCE_MODES.index(m.acceptance),
        DRAFT_PLACES.index(m.draft_place),
        len(auth),
        len(chat),
        m.max_new_tokens,
        prompt.size,
        m.anchor,
    )
    return fixed + prompt.tobytes() + auth + chat


def _pack_opened(m: Opened, version: int) -> bytes:
    stops = np.asarray(m.stop_ids).astype("<i4")
    return (
        _OPENED.pack(
            m.session_id,
            m.t,
            m.prefill_ms,
            m.max_context,
            m.tree_rows,
            m.vocab_size,
            m.hidden_size,
            m.kv_dim_sliding,
            m.kv_dim_full,
            stops.size,
        )
        + stops.tobytes()
    )


def _pack_tree(m: DraftTree, version: int) -> bytes:
    tokens = np.asarray(m.tokens).astype("<i4")
    parents = np.asarray(m.parents).astype("<i2")
    scores = b""
    if m.scores is not None:  # clamp first: below -65,504 fp16 would round to -inf
        scores = np.maximum(np.asarray(m.scores, np.float32), np.float32(FP16_SCORE_FLOOR)).astype("<f2").tobytes()
    return _ROUND.pack(m.seq, tokens.size, m.scores is not None) + tokens.tobytes() + parents.tobytes() + scores


def _pack_handoff(h: HandOff) -> bytes:
    blocks = (h.x_hat, h.k_sliding, h.v_sliding, h.k_full, h.v_full)
    body = b"".join(np.ascontiguousarray(a).tobytes() for a in blocks)
    sizes = _HANDOFF_SIZES.pack(h.x_hat.size // 2, h.k_sliding.shape[1], h.k_full.shape[1])
    fixed = HANDOFF_FIXED.pack(h.t_prime, h.a, h.bonus, h.n_positions, *h.scales, zlib.crc32(body))
    return sizes + fixed + body


def _pack_reply(m: RoundReply, version: int) -> bytes:
    samples = np.asarray(m.samples).astype("<i4")
    path = np.asarray(m.path_rows).astype("<i2")
    chain = np.asarray(m.chain).astype("<i4")
    head = (m.seq, m.bonus, m.server_ms, _finish_code(m), m.handoff is not None, samples.size, path.size, chain.size)
    mask = b""
    fixed = _REPLY.pack(*head, m.verified is not None)
    if m.verified is not None:  # row j at byte j // 8, bit j % 8, LSB first; pad bits 0
        mask = np.packbits(np.asarray(m.verified, np.bool_), bitorder="little").tobytes()
    handoff = b"" if m.handoff is None else _pack_handoff(m.handoff)
    return fixed + samples.tobytes() + path.tobytes() + chain.tobytes() + mask + handoff


def _pack_close(m: Close, version: int) -> bytes:
    return _CLOSE.pack(m.session_id)


def _pack_error(m: ErrorReply, version: int) -> bytes:
    code, message = m.code.encode("ascii"), m.message.encode("utf-8")
    return _ERROR.pack(len(code), len(message)) + code + message


def _pack_append(m: AppendTurn, version: int) -> bytes:
    tokens = np.asarray(m.tokens).astype("<i4")
    return _APPEND.pack(m.max_new_tokens, m.keep, m.keep_crc, m.anchor, tokens.size) + tokens.tobytes()


_PACKERS: dict[type, tuple[MessageType, Callable[[Any, int], bytes]]] = {
    OpenRequest: (MessageType.OPEN, _pack_open),
    Opened: (MessageType.OPENED, _pack_opened),
    DraftTree: (MessageType.ROUND, _pack_tree),
    RoundReply: (MessageType.REPLY, _pack_reply),
    Close: (MessageType.CLOSE, _pack_close),
    ErrorReply: (MessageType.ERROR, _pack_error),
    AppendTurn: (MessageType.APPEND, _pack_append),
}


def encode(msg, version: int = PROTOCOL_VERSION) -> bytes:
    """One frame for ``msg`` in protocol ``version`` (one of SUPPORTED_VERSIONS, else UnsupportedVersion).
    Validates it first (without limits), so a sender's bug raises the same WireError the receiver would, before
    anything is sent. Scores travel as float16, clamped at FP16_SCORE_FLOOR."""
    version = _check_version(version)
    validate(msg)
    mtype, pack = _PACKERS[type(msg)]
    payload = pack(msg, version)
    if len(payload) > 2**32 - 1:
        raise FrameTooLarge(f"{mtype.name} payload of {len(payload)} bytes: at most 4 GiB - 1 (u32 length)")
    return HEADER.pack(MAGIC, version, mtype, 0, len(payload), zlib.crc32(payload)) + payload


# --------------------------------------------------------------------------------------------------- decode


class FrameHeader(NamedTuple):
    type: MessageType
    flags: int
    payload_nbytes: int
    crc32: int
    version: int = PROTOCOL_VERSION


def decode_header(data, limits: Limits | None = None) -> FrameHeader:
    """Parse and check the 16-byte header at the start of ``data`` (a stream reader can call it before reading
    the payload). Raises Truncated, BadMagic, UnsupportedVersion (a version outside SUPPORTED_VERSIONS),
    UnknownMessageType, BadFlags, FrameTooLarge."""
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
    if HEADER.size + length > limits.max_frame_bytes:
        raise FrameTooLarge(
            f"{mtype.name} frame of {HEADER.size + length} bytes: this receiver accepts at most "
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

    def fields(self, st: struct.Struct, field: str) -> tuple:
        return st.unpack(self.take(st.size, field))

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


def _unpack_open(r: _Reader, limits: Limits, version: int) -> OpenRequest:
    fixed = r.fields(_OPEN, "fixed part")
    temperature, top_k, top_p, seed, epsilon, acceptance, place, auth_len, chat_len, max_new, n, anchor = fixed
    prompt = r.array("<i4", n, "prompt_ids")
    auth = r.text(auth_len, "auth_token") if auth_len else None
    chat = r.text(chat_len, "chat") if chat_len else None
    return OpenRequest(
        prompt_ids=prompt,
        sampling=Sampling(temperature, top_k, top_p),
        seed=seed,
        acceptance=_enum(acceptance, ACCEPTANCE_MODES, "OPEN acceptance"),
        epsilon=epsilon,
        draft_place=_enum(place, DRAFT_PLACES, "OPEN draft_place"),
        max_new_tokens=max_new,
        auth_token=auth,
        chat=chat,
        anchor=anchor,
    )


def _unpack_opened(r: _Reader, limits: Limits, version: int) -> Opened:
    *fixed, n_stops = r.fields(_OPENED, "fixed part")
    stops = r.array("<i4", n_stops, "stop_ids")
    return Opened(*fixed, stop_ids=tuple(int(i) for i in stops))  # type: ignore[misc]  # fixed: the fields before


def _unpack_tree(r: _Reader, limits: Limits, version: int) -> DraftTree:
    seq, rows, has_scores = r.fields(_ROUND, "fixed part")
    _check_rows(rows, "ROUND", limits)  # before reading: the count alone is enough to refuse
    has_scores = _flag(has_scores, "ROUND has_scores")
    tokens, parents = r.array("<i4", rows, "tokens"), r.array("<i2", rows, "parents")
    scores = r.array("<f2", rows, "scores", np.float32) if has_scores else None
    return DraftTree(seq, tokens, parents, scores)


def _unpack_handoff(r: _Reader, limits: Limits) -> HandOff:
    hidden, d_s, d_f = r.fields(_HANDOFF_SIZES, "hand-off sizes")
    _check_handoff_sizes(hidden, d_s, d_f, limits)
    t_prime, a, bonus, n, *scales, body_crc = r.fields(HANDOFF_FIXED, "hand-off fixed part")
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


def _unpack_reply(r: _Reader, limits: Limits, version: int) -> RoundReply:
    *fixed, has_verified = r.fields(_REPLY, "fixed part")
    seq, bonus, server_ms, finished, has_handoff, rows, n_path, n_chain = fixed
    _check_rows(rows, "REPLY samples", limits)
    reason = None if finished == 0 else _enum(finished - 1, FINISH_REASONS, "REPLY finished (minus 1)")
    has_handoff = _flag(has_handoff, "REPLY has_handoff")
    has_verified = _flag(has_verified, "REPLY has_verified")
    samples = r.array("<i4", rows, "samples")
    path = r.array("<i2", n_path, "path_rows")
    chain = r.array("<i4", n_chain, "chain")
    verified = _unpack_mask(r, rows) if has_verified else None
    handoff = _unpack_handoff(r, limits) if has_handoff else None
    return RoundReply(seq, samples, path, bonus, server_ms, reason is not None, handoff, chain, reason, verified)


def _unpack_mask(r: _Reader, rows: int) -> np.ndarray:
    """REPLY's verified rows: ceil(rows / 8) bytes, row j at byte j // 8, bit j % 8 (LSB first), pad bits 0."""
    bits = np.unpackbits(np.frombuffer(r.take((rows + 7) // 8, "verified mask"), np.uint8), bitorder="little")
    if bits[rows:].any():
        raise BadShape(
            f"REPLY verified mask has bit {rows + int(np.argmax(bits[rows:]))} set: the tree has {rows} "
            "rows, the pad bits after the last row must be 0"
        )
    return bits[:rows].astype(np.bool_)


def _unpack_close(r: _Reader, limits: Limits, version: int) -> Close:
    return Close(*r.fields(_CLOSE, "fixed part"))


def _unpack_error(r: _Reader, limits: Limits, version: int) -> ErrorReply:
    code_len, message_len = r.fields(_ERROR, "fixed part")
    return ErrorReply(r.text(code_len, "code"), r.text(message_len, "message"))


def _unpack_append(r: _Reader, limits: Limits, version: int) -> AppendTurn:
    max_new, keep, keep_crc, anchor, n = r.fields(_APPEND, "fixed part")
    return AppendTurn(r.array("<i4", n, "tokens"), max_new, keep, keep_crc, anchor)


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
    msg = _UNPACKERS[header.type](reader, limits, header.version)
    reader.end()
    validate(msg, limits)
    return msg
