"""Binary frames between the device runtime and the verifier (docs/design.md "Wire protocol"; this docstring is the
byte-level truth).

numpy + stdlib only: the device runtime imports this module on the phone. `encode` turns a message of
`hycoc.protocol.messages` into one frame, `decode` turns a frame back into a message and validates every field against
what the receiver knows (`Limits`). A malformed frame raises a `WireError` subclass whose ``code`` is stable;
the receiver answers it with `error_frame(exc)`.

This module is the protocol's public face; the work is split by job: `hycoc.protocol.layout` (versions, header,
each version's fixed parts as a table, `Limits`, frame sizes), `hycoc.protocol.errors` (the error classes),
`hycoc.protocol.checks` (`validate`: every field's rules) and `hycoc.protocol.codec` (`encode`, `decode`).

Frame = 16-byte header + payload, every integer and float little-endian::

    offset size  field
    0      4     magic b"HYCO"
    4      2     protocol version, u16 (PROTOCOL_VERSION = 6, the only one accepted: SUPPORTED_VERSIONS)
    6      1     message type, u8 (MessageType)
    7      1     flags, u8: reserved, must be 0 (the crc does not cover the header, so no meaning rides here)
    8      4     payload length in bytes, u32
    12     4     crc32 (zlib) of the payload, u32

Versions. A receiver accepts every version of SUPPORTED_VERSIONS (6 only: version 6 lets the verifier size each
round's tree (the REPLY's allowance) and version 5 changed what a conversation is, so an older peer is refused at
its first frame with ``unsupported_version`` naming the fix); a session speaks
the version of its OPEN frame and its peer answers every frame of it in that version (`frame_version` reads it,
`encode(msg, version=v)` writes it).

Payloads (R = tree rows = B + 1, P = accepted path length, K = chain length, T = prompt length)::

    OPEN    50 B: f32 temperature, u32 top_k, f32 top_p, u64 seed, f32 epsilon, u8 acceptance (index into
            ACCEPTANCE_MODES), u8 draft_place (index into DRAFT_PLACES), u16 auth_len, u16 chat_len,
            u32 max_new_tokens, u32 T, u32 anchor (the prompt's model-turn opening, < T; 0 = none),
            f32 draft_ms_floor, f32 draft_ms_tree (the device's drafting ms per round without and with the SLM
            pass, in [0, 60,000]; 0 = unknown); then i32[T]
            prompt_ids; then auth_len bytes of utf-8 auth token (auth_len 0 = no token); then chat_len bytes of the
            device's chat contract, utf-8 JSON (chat_len 0 = none). Total frame: `open_nbytes`.
    OPENED  42 B: u64 session_id, u32 t, f32 prefill_ms, u32 max_context, u32 tree_rows, u32 vocab_size,
            u32 hidden_size, u32 kv_dim_sliding, u32 kv_dim_full, u16 S; then i32[S] stop_ids (S >= 1).
    ROUND   7 B: u32 seq, u16 R (1 to OPENED's tree_rows, and at most the last REPLY's allowance), u8 has_scores
            (0/1); then i32[R] tokens, i16[R] parents; then, when
            has_scores, f16[R] scores (each row's tree score s(v) of Alg. 3, natural log; scores[0] == 0, every
            row <= its parent; the sender clamps below -65,504, fp16's lowest finite value).
            Total frame: `tree_nbytes(R)` = 23 + 8 R bytes with scores (287 B at B = 32; SpecEdge: ~135 KB per
            round), 23 + 6 R without.
    REPLY   23 B: u32 seq, i32 bonus, f32 server_ms, u8 finished (0 = no, else 1 + index into FINISH_REASONS:
            1 stop, 2 max_new_tokens, 3 length), u8 has_handoff (0/1), u16 R, u16 P, u16 K, u8 has_verified
            (0/1), u16 allowance (the rows, root included, the session's next ROUND may hold: 1 to OPENED's
            tree_rows; a ROUND over it gets over_allowance; 0 only when finished); then i32[R] samples,
            i16[P] path_rows, i32[K] chain; then, when has_verified, the verified rows as a bitmask of
            ceil(R / 8) bytes (row j at byte j // 8, bit j % 8, least significant bit first; the pad bits after
            row R - 1 are 0); then, when has_handoff, 12 B of sizes (u32 hidden_size,
            u32 kv_dim_sliding, u32 kv_dim_full) and the hand-off block below. No mask: every row was verified.
            Total frame: `reply_nbytes(R, P, K, handoff, verified=...)` = 39 + 4 R + 2 P + 4 K
            (+ ceil(R / 8) with the mask, + hand-off); 171 B at R = 33, P = 0, no hand-off, 176 B with the mask.
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

from hycoc.protocol.checks import validate
from hycoc.protocol.codec import (
    FrameHeader,
    decode,
    decode_header,
    encode,
    encode_error,
    error_frame,
    frame_version,
)
from hycoc.protocol.errors import (
    ERROR_CLASSES,
    BadEnum,
    BadEpsilon,
    BadFlags,
    BadHandoffRange,
    BadMagic,
    BadParent,
    BadPath,
    BadScores,
    BadShape,
    BadTemperature,
    BadText,
    BadTopK,
    BadTopP,
    BonusMismatch,
    ConfigMismatch,
    ContextOverflow,
    CrcMismatch,
    FrameTooLarge,
    HandoffSizeMismatch,
    LengthMismatch,
    NotFinite,
    OutOfRange,
    TokenOutOfVocab,
    Truncated,
    UnknownMessageType,
    UnsupportedVersion,
    WireError,
    WrongRowCount,
    error_from_reply,
    error_reply,
)
from hycoc.protocol.layout import (
    DEFAULT_MAX_FRAME_BYTES,
    FP16_SCORE_FLOOR,
    HANDOFF_FIXED,
    HEADER,
    LAYOUTS,
    LEGACY_ERROR_VERSIONS,
    MAGIC,
    MAX_TREE_ROWS,
    OLD_VERSION_FIX,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    Limits,
    MessageType,
    append_nbytes,
    handoff_nbytes,
    open_nbytes,
    reply_nbytes,
    tree_nbytes,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "ERROR_CLASSES",
    "FP16_SCORE_FLOOR",
    "HANDOFF_FIXED",
    "HEADER",
    "LAYOUTS",
    "LEGACY_ERROR_VERSIONS",
    "MAGIC",
    "MAX_TREE_ROWS",
    "OLD_VERSION_FIX",
    "PROTOCOL_VERSION",
    "SUPPORTED_VERSIONS",
    "BadEnum",
    "BadEpsilon",
    "BadFlags",
    "BadHandoffRange",
    "BadMagic",
    "BadParent",
    "BadPath",
    "BadScores",
    "BadShape",
    "BadTemperature",
    "BadText",
    "BadTopK",
    "BadTopP",
    "BonusMismatch",
    "ConfigMismatch",
    "ContextOverflow",
    "CrcMismatch",
    "FrameHeader",
    "FrameTooLarge",
    "HandoffSizeMismatch",
    "LengthMismatch",
    "Limits",
    "MessageType",
    "NotFinite",
    "OutOfRange",
    "TokenOutOfVocab",
    "Truncated",
    "UnknownMessageType",
    "UnsupportedVersion",
    "WireError",
    "WrongRowCount",
    "append_nbytes",
    "decode",
    "decode_header",
    "encode",
    "encode_error",
    "error_frame",
    "error_from_reply",
    "error_reply",
    "frame_version",
    "handoff_nbytes",
    "open_nbytes",
    "reply_nbytes",
    "tree_nbytes",
    "validate",
]
