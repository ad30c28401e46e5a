"""`VerifierServer`'s settings are refused before anything starts (`hycoc.verifier.server.app.check_server_settings`):
each out of its range, or an "auto" mode without batching."""

from __future__ import annotations

import pytest

pytest.importorskip("aiohttp")

from hycoc.verifier.server.app import check_server_settings

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
    check_server_settings(**GOOD)
    check_server_settings(**GOOD | {"tree_budget": "auto", "allowance": "auto", "allowance_floor": 33})


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
        check_server_settings(**GOOD | change)
