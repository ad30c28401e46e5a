"""The wire protocol's layouts as data: header, message types, each version's fixed parts, limits and frame sizes.

Stdlib only here (the device runtime imports it through `hycoc.protocol.wire`, whose module docstring is the
byte-level truth these tables follow). A protocol version is one `Layout` in `LAYOUTS` (version -> the struct
format and field names of each message's fixed part); the codec (`hycoc.protocol.codec`) and the size functions
below read the layout of a frame's version instead of branching on the version number. A new version is a new
table entry; `SUPPORTED_VERSIONS` is the table's keys.
"""

from __future__ import annotations

import enum
import struct
from collections import namedtuple
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from hycoc import serving_limits
from hycoc.protocol.errors import UnsupportedVersion

if TYPE_CHECKING:
    from hycoc.protocol.messages import Opened

#: 2: REPLY's ``finished`` byte carries the finish reason and APPEND (type 7) continues a finished session.
#: 3: OPEN carries the device's chat contract and OPENED the verifier's stop ids.
#: 4: ROUND may carry each row's tree score (fp16) and REPLY the verified rows (a bitmask).
#: 5: a conversation is its messages re-rendered by the checkpoint's template each turn: APPEND says how much of
#: what the session holds it keeps (keep, keep_crc) and where the new model turn opens (anchor, also in OPEN), and
#: the chat contract names the template's sha256. A version-4 peer would append a turn to a conversation the
#: template does not render, so older versions are refused (`OLD_VERSION_FIX`).
#: 6: REPLY carries the allowance (u16): the rows the session's next ROUND may hold, which the verifier sizes from
#: its load (`hycoc.verifier.allowance`); a ROUND may hold fewer rows than OPENED's tree_rows. A version-5 device
#: would draft whole trees past the allowance, so version 5 is refused.
PROTOCOL_VERSION = 6
#: What an older peer is told (the ``unsupported_version`` message's fix).
OLD_VERSION_FIX = (
    "update hycoc on both sides and rebuild the device bundle with it (`hycoc build RECIPE`): "
    "protocol 6 sizes each round's tree by the verifier's load and re-renders each conversation with the "
    "checkpoint's template (docs/serving.md, sections Tree allowance and Conversations)"
)
MAGIC = b"HYCO"
#: magic, version u16, message type u8, flags u8, payload length u32, payload crc32 u32 (the same in every version).
HEADER = struct.Struct("<4sHBBII")
#: parents travel as int16: row 32767 is the last one that can be a parent, so R <= 32768 (B <= 32767).
MAX_TREE_ROWS = 32768
#: Large enough for a first reply of Gemma 4 26B-A4B (6.3 MB); the value is the serving limits table's
#: (`hycoc/serving_limits.py`); servers may lower it for what they receive.
DEFAULT_MAX_FRAME_BYTES = serving_limits.DEFAULT_MAX_FRAME_BYTES
#: fp16's lowest finite value: ROUND scores below it travel as it (never as -inf).
FP16_SCORE_FLOOR = -65504.0
#: The hand-off block's six dequantization scales, in wire order.
SCALE_NAMES = ("e", "h", "k_sliding", "v_sliding", "k_full", "v_full")


class MessageType(enum.IntEnum):
    """The header's message type byte (module docstring of `hycoc.protocol.wire`)."""

    OPEN = 1
    OPENED = 2
    ROUND = 3
    REPLY = 4
    CLOSE = 5
    ERROR = 6
    APPEND = 7


@dataclass(frozen=True)
class FixedPart:
    """The fixed part of a payload: a little-endian struct format and the name of each of its fields, in wire order.

    ``pack(**values)`` writes the fields by name (a missing or unknown name raises TypeError: a codec bug, never
    the peer's); ``unpack(raw)`` reads ``size`` bytes into a namedtuple of those names.
    """

    format: str
    fields: tuple[str, ...]
    struct: struct.Struct = field(init=False, repr=False, compare=False)
    record: type = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        st = struct.Struct(self.format)
        if len(st.unpack(bytes(st.size))) != len(self.fields):
            raise ValueError(f"FixedPart {self.format!r} has a different number of fields than {self.fields}")
        object.__setattr__(self, "struct", st)
        object.__setattr__(self, "record", namedtuple("Fixed", self.fields))

    @property
    def size(self) -> int:
        """Bytes of the fixed part."""
        return self.struct.size

    def pack(self, **values) -> bytes:
        """The fixed part's bytes, from one keyword per field."""
        return self.struct.pack(*self.record(**values))

    def pack_from(self, *sources: object, **values) -> bytes:
        """The fixed part's bytes: each field from ``values`` where given (counts, lengths, codes the payload
        derives), else the same-named attribute of the first of ``sources`` that has it (a message's own fields);
        a field in neither raises AttributeError (a codec bug, never the peer's)."""
        for name in self.fields:
            if name not in values:
                owner = next((s for s in sources if hasattr(s, name)), None)
                if owner is None:
                    names = [type(s).__name__ for s in sources]
                    raise AttributeError(f"FixedPart field {name!r}: not given and not an attribute of {names}")
                values[name] = getattr(owner, name)
        return self.pack(**values)

    def unpack(self, raw) -> Any:
        """The fields of ``raw`` (exactly ``size`` bytes) as a namedtuple of `fields` (a class made at run time from
        the table, so typed ``Any``: its attributes are the field names)."""
        record: Any = self.record
        return record._make(self.struct.unpack(raw))


@dataclass(frozen=True)
class Layout:
    """One protocol version: the fixed part of each message type's payload and of the REPLY's hand-off block.

    What follows each fixed part (arrays sized by its counts, texts sized by its lengths) is in the module
    docstring of `hycoc.protocol.wire`.
    """

    version: int
    fixed: Mapping[MessageType, FixedPart]
    handoff_sizes: FixedPart
    handoff_fixed: FixedPart


_ERROR_V3 = FixedPart("<BH", ("code_len", "message_len"))

#: version -> its layout: every version a receiver accepts (a session answers in its OPEN's version).
LAYOUTS: dict[int, Layout] = {
    6: Layout(
        version=6,
        fixed={
            MessageType.OPEN: FixedPart(
                "<fIfQfBBHHIIIff",
                (
                    "temperature",
                    "top_k",
                    "top_p",
                    "seed",
                    "epsilon",
                    "acceptance",
                    "draft_place",
                    "auth_len",
                    "chat_len",
                    "max_new_tokens",
                    "n_prompt",
                    "anchor",
                    "draft_ms_floor",
                    "draft_ms_tree",
                ),
            ),
            MessageType.OPENED: FixedPart(
                "<QIfIIIIIIH",
                (
                    "session_id",
                    "t",
                    "prefill_ms",
                    "max_context",
                    "tree_rows",
                    "vocab_size",
                    "hidden_size",
                    "kv_dim_sliding",
                    "kv_dim_full",
                    "n_stops",
                ),
            ),
            MessageType.ROUND: FixedPart("<IHB", ("seq", "rows", "has_scores")),
            MessageType.REPLY: FixedPart(
                "<IifBBHHHBH",
                (
                    "seq",
                    "bonus",
                    "server_ms",
                    "finished",
                    "has_handoff",
                    "rows",
                    "n_path",
                    "n_chain",
                    "has_verified",
                    "allowance",
                ),
            ),
            MessageType.CLOSE: FixedPart("<Q", ("session_id",)),
            MessageType.ERROR: _ERROR_V3,
            MessageType.APPEND: FixedPart("<IIIII", ("max_new_tokens", "keep", "keep_crc", "anchor", "n_tokens")),
        },
        handoff_sizes=FixedPart("<III", ("hidden_size", "kv_dim_sliding", "kv_dim_full")),
        handoff_fixed=FixedPart(
            "<IIIIffffffI",
            ("t_prime", "a", "bonus", "n_positions", *(f"scale_{n}" for n in SCALE_NAMES), "body_crc"),
        ),
    ),
}
#: Versions a receiver accepts; a session answers in its OPEN's version.
SUPPORTED_VERSIONS = tuple(sorted(LAYOUTS))
#: Older versions whose ERROR payload a current sender can still write: version -> that ERROR's fixed part. An
#: older peer's refusal is answered in its own version (`hycoc.protocol.codec.error_frame`), so it reads the code
#: and `OLD_VERSION_FIX` instead of failing on the header.
LEGACY_ERROR_LAYOUTS: dict[int, FixedPart] = {3: _ERROR_V3, 4: _ERROR_V3, 5: _ERROR_V3}
#: Older versions whose ERROR frame has this version's layout (the keys of `LEGACY_ERROR_LAYOUTS`).
LEGACY_ERROR_VERSIONS = tuple(sorted(LEGACY_ERROR_LAYOUTS))
#: The hand-off block's fixed part (44 B) in the current version.
HANDOFF_FIXED = LAYOUTS[PROTOCOL_VERSION].handoff_fixed.struct


def layout_of(version: int) -> Layout:
    """The layout of protocol ``version``; raises UnsupportedVersion (naming the supported versions and
    `OLD_VERSION_FIX`) for a version outside SUPPORTED_VERSIONS."""
    layout = LAYOUTS.get(version)
    if layout is None:
        raise UnsupportedVersion(
            f"protocol version {version}: this side speaks version(s) "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))}; {OLD_VERSION_FIX}"
        )
    return layout


# --------------------------------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """What the receiver knows; `decode` checks every field it can against it. None leaves a check out.

    max_frame_bytes: header + payload, checked from the header before the payload is read.
    vocab_size: token ids must lie in [0, vocab_size). tree_rows: the most rows of any ROUND and samples of any
    REPLY of the session (B + 1), and the most a REPLY's allowance may grant. max_context: positions the verifier
    holds (prompt length, t', hand-off rows).
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
        """The device's limits for a session's replies, from the server's OPENED: every limit but
        ``max_frame_bytes`` is the OPENED field of the same name."""
        known = {f.name: getattr(opened, f.name) for f in fields(cls) if f.name != "max_frame_bytes"}
        return cls(max_frame_bytes=max_frame_bytes, **known)


# --------------------------------------------------------------------------------------------------- sizes


def tree_nbytes(rows: int, *, version: int = PROTOCOL_VERSION, scores: bool = True) -> int:
    """Bytes of a ROUND frame with ``rows`` rows: 16 header + 7 fixed + 4 per token id + 2 per parent, + 2 per fp16
    score when ``scores``. The defaults are what the device runtime sends: 287 B at B = 32."""
    fixed = layout_of(version).fixed[MessageType.ROUND]
    return HEADER.size + fixed.size + (8 if scores else 6) * rows


def open_nbytes(prompt_len: int, auth_bytes: int = 0, chat_bytes: int = 0) -> int:
    """Bytes of an OPEN frame: 16 header + 50 fixed + 4 per prompt id + the auth token's and the chat contract's
    utf-8 bytes (each at most 65,535)."""
    fixed = LAYOUTS[PROTOCOL_VERSION].fixed[MessageType.OPEN]
    return HEADER.size + fixed.size + 4 * int(prompt_len) + int(auth_bytes) + int(chat_bytes)


def append_nbytes(tokens: int) -> int:
    """Bytes of an APPEND frame: 16 header + 20 fixed + 4 per token id."""
    return HEADER.size + LAYOUTS[PROTOCOL_VERSION].fixed[MessageType.APPEND].size + 4 * int(tokens)


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
    layout = layout_of(version)
    n = HEADER.size + layout.fixed[MessageType.REPLY].size + 4 * rows + 2 * path_len + 4 * chain_len
    if verified:
        n += (rows + 7) // 8
    return n if handoff is None else n + layout.handoff_sizes.size + handoff
