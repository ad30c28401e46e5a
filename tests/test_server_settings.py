"""`VerifierServer`'s settings are refused before anything starts (`hycoc.verifier.server.ServerSettings`):
each out of its range, or an "auto" mode without batching."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")

from hycoc.verifier.server import ServerSettings

from hycoc.protocol import wire

GOOD = dict(
    tree_rows=33,  # B = 32 nodes + the root
    auth_token=None,
    max_frame_bytes=wire.DEFAULT_MAX_FRAME_BYTES,
    batching="batched",
    max_batch_rows=256,
    max_batch_wait_ms=2.0,
    tree_budget="fixed",
    min_rows_per_session=2,
    allowance="fixed",
    allowance_target_ms=None,
    allowance_floor=0,
    max_prefills=1,
)


def test_the_defaults_pass():
    ServerSettings(**GOOD)
    ServerSettings(**GOOD | {"tree_budget": "auto", "allowance": "auto", "allowance_floor": 33})


@pytest.mark.parametrize(
    "change,message",
    [
        ({"tree_rows": 0}, r"tree_rows = 0: must lie in \[1, "),
        ({"auth_token": ""}, "auth_token is empty"),
        ({"batching": "eager"}, "batching = 'eager': must be one of"),
        ({"tree_budget": "auto", "batching": "serial"}, "tree_budget = 'auto' .* needs batching = 'batched'"),
        ({"allowance": "auto", "batching": "serial"}, "allowance = 'auto' .* needs batching = 'batched'"),
        ({"allowance_floor": 34}, r"allowance_floor = 34: must be an integer in \[0, 33\]"),  # above tree_rows
        ({"allowance_floor": 2.0}, "allowance_floor = 2.0"),  # not an integer
        ({"allowance_target_ms": -1}, "allowance_target_ms = -1"),
        ({"min_rows_per_session": 0}, "min_rows_per_session = 0"),
        ({"max_batch_rows": 0}, "max_batch_rows = 0"),
        ({"max_batch_wait_ms": 10_001}, r"max_batch_wait_ms = 10001: must lie in \[0, 10000\]"),
        ({"max_prefills": 0}, "max_prefills = 0"),
        ({"max_frame_bytes": wire.HEADER.size - 1}, f"at least the {wire.HEADER.size}-byte header"),
    ],
)
def test_each_setting_out_of_range_is_named(change, message):
    with pytest.raises(ValueError, match=message):
        ServerSettings(**GOOD | change)


def test_an_allowance_target_of_zero_means_none():
    assert ServerSettings(**GOOD | {"allowance_target_ms": 0}).allowance_target_ms is None
    assert ServerSettings(**GOOD | {"allowance_target_ms": 25}).allowance_target_ms == 25.0


def test_the_server_takes_settings_or_keywords_not_both():
    from hycoc.verifier.server import VerifierServer

    with pytest.raises(TypeError, match=r"not both: \['tree_rows'\]"):
        VerifierServer(None, ServerSettings(tree_rows=5), tree_rows=5)  # refused before the engine is read
    with pytest.raises(TypeError, match="tree_rowz"):
        VerifierServer(None, tree_rowz=5)
