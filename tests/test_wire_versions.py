"""Every message type round-trips in every supported protocol version, and each fixed part is the layout that
`hycoc/protocol/wire.py`'s module docstring gives, built here field by field with `struct` (not read from the codec's
tables)."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

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

SCALES = (0.5, 0.25, 0.125, 1.0, 2.0, 0.0625)
i8 = np.int8


def messages() -> dict[str, tuple[object, bytes]]:
    """name -> (message, the fixed part of its payload written from the module docstring's table)."""
    prompt = np.array([2, 10, 999, 0], np.int32)
    open_ = OpenRequest(
        prompt, Sampling(0.5, 64, 0.75), 2**63 + 5, "epsilon", 0.25, "cloud-mtp", 9, "tok", "{}", 2, 19.5, 57.75
    )
    opened = Opened(2**40 + 3, 3, 12.5, 4096, 5, 1000, 4, 6, 2, (1, 106))
    tree = DraftTree(9, np.array([5, 7, 7, 999, 0], np.int32), np.array([-1, 0, 0, 1, 3], np.int32))
    scored = DraftTree(tree.seq, tree.tokens, tree.parents, np.array([0.0, -0.5, -1.0, -2.0, -2.5], np.float32))
    n = 2
    ho = HandOff(
        12,
        10,
        7,
        np.arange(8, dtype=i8),
        *(np.full((n, d), v, i8) for d, v in ((6, 1), (6, -2), (2, 3), (2, -4))),
        SCALES,
    )
    samples = np.array([3, 4, 5, 7, 8], np.int32)
    reply = RoundReply(7, samples, np.array([1, 3], np.int32), 7, 21.5, True, ho, np.array([11], np.int32), "length")
    verified = RoundReply(
        7, samples, np.array([1, 3], np.int32), 7, 1.0, False, None, np.array([], np.int32), None,
        np.array([1, 1, 0, 1, 0], np.bool_), 5,
    )  # fmt: skip
    append = AppendTurn(np.array([5, 6, 7], np.int32), 64, 10, 2**32 - 3, 11)
    return {
        "OPEN": (
            open_,
            struct.pack("<fIfQfBBHHIIIff", 0.5, 64, 0.75, 2**63 + 5, 0.25, 1, 2, 3, 2, 9, 4, 2, 19.5, 57.75),
        ),
        "OPENED": (opened, struct.pack("<QIfIIIIIIH", 2**40 + 3, 3, 12.5, 4096, 5, 1000, 4, 6, 2, 2)),
        "ROUND": (tree, struct.pack("<IHB", 9, 5, 0)),
        "ROUND scored": (scored, struct.pack("<IHB", 9, 5, 1)),
        "REPLY hand-off": (reply, struct.pack("<IifBBHHHBH", 7, 7, 21.5, 3, 1, 5, 2, 1, 0, 0)),  # finished: 0
        "REPLY verified": (verified, struct.pack("<IifBBHHHBH", 7, 7, 1.0, 0, 0, 5, 2, 0, 1, 5)),
        "CLOSE": (Close(2**40 + 3), struct.pack("<Q", 2**40 + 3)),
        "ERROR": (ErrorReply("bad_top_k", "k ✓"), struct.pack("<BH", 9, 5)),
        "APPEND": (append, struct.pack("<IIIII", 64, 10, 2**32 - 3, 11, 3)),
    }


def same(a, b) -> bool:
    """Message equality with arrays compared by dtype-free value (the dataclasses hold numpy arrays)."""
    if type(a) is not type(b):
        return False
    for name in a.__dataclass_fields__:
        x, y = getattr(a, name), getattr(b, name)
        if isinstance(x, HandOff) or isinstance(y, HandOff):
            if not same(x, y):
                return False
        elif isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            if not np.array_equal(np.asarray(x), np.asarray(y)):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("version", wire.SUPPORTED_VERSIONS)
@pytest.mark.parametrize("name", list(messages()))
def test_every_message_round_trips_in_every_supported_version(name, version):
    msg, fixed = messages()[name]
    data = wire.encode(msg, version=version)
    magic, got_version, mtype, flags, length, crc = struct.unpack_from("<4sHBBII", data)
    assert (magic, got_version, flags, length, crc) == (b"HYCO", version, 0, len(data) - 16, zlib.crc32(data[16:]))
    assert wire.MessageType(mtype).name == name.split()[0]
    assert data[16 : 16 + len(fixed)] == fixed
    assert wire.frame_version(data) == version
    assert same(wire.decode(data), msg)


def test_the_layout_table_has_every_message_type_for_every_supported_version():
    assert wire.SUPPORTED_VERSIONS == tuple(sorted(wire.LAYOUTS)) == (wire.PROTOCOL_VERSION,)
    for version, layout in wire.LAYOUTS.items():
        assert layout.version == version
        assert set(layout.fixed) == set(wire.MessageType)
        assert layout.handoff_fixed.struct is wire.HANDOFF_FIXED or version != wire.PROTOCOL_VERSION


def test_hand_off_block_bytes_follow_the_docstring():
    """The REPLY's hand-off: u32 sizes (H, d_s, d_f), then "<IIIIffffffI" and the int8 body, crc32 over the body."""
    msg, _ = messages()["REPLY hand-off"]
    data = wire.encode(msg)
    ho = msg.handoff
    body = b"".join(a.tobytes() for a in (ho.x_hat, ho.k_sliding, ho.v_sliding, ho.k_full, ho.v_full))
    block = struct.pack("<III", 4, 6, 2) + struct.pack("<IIIIffffffI", 12, 10, 7, 2, *SCALES, zlib.crc32(body)) + body
    assert data.endswith(block)
    assert len(data) == wire.reply_nbytes(5, 2, 1, wire.handoff_nbytes(4, 6, 2, 2))


@pytest.mark.parametrize("version", [3, 4])
def test_an_older_peer_gets_its_refusal_in_its_own_version(version):
    """An older peer's ERROR frame: the same payload as version 5's ERROR, under a header of its version."""
    msg, fixed = messages()["ERROR"]
    data = wire.encode_error(msg, version)
    payload = fixed + b"bad_top_k" + "k ✓".encode()
    assert data == struct.pack("<4sHBBII", b"HYCO", version, 6, 0, len(payload), zlib.crc32(payload)) + payload
    with pytest.raises(wire.UnsupportedVersion):
        wire.encode(msg, version=version)
