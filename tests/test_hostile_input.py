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
