"""One source per request default (issue 39 item 3): T, top-k, top-p, ε, the acceptance mode, the draft place,
max_new_tokens and the seed are named once, in `hycoc.protocol.messages` (``DEFAULT_*``), and the wire message
(`OpenRequest`), the recipe's ``[sampling]`` and ``[acceptance]`` tables and `VerifierEngine.open` take theirs from
there. Each test compares the three homes with the one source, by identity where the default is an object."""

from __future__ import annotations

import dataclasses
import inspect

import numpy as np

from hycoc.protocol import messages
from hycoc.protocol.messages import (
    DEFAULT_ACCEPTANCE,
    DEFAULT_DRAFT_PLACE,
    DEFAULT_EPSILON,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_SAMPLING,
    DEFAULT_SEED,
    OpenRequest,
    Sampling,
)
from hycoc.recipe import Recipe

#: OpenRequest's field -> the one default it must carry.
WIRE = {
    "sampling": DEFAULT_SAMPLING,
    "seed": DEFAULT_SEED,
    "acceptance": DEFAULT_ACCEPTANCE,
    "epsilon": DEFAULT_EPSILON,
    "draft_place": DEFAULT_DRAFT_PLACE,
    "max_new_tokens": DEFAULT_MAX_NEW_TOKENS,
}


def test_the_wire_message_defaults_are_the_protocol_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(OpenRequest)}
    for name, default in WIRE.items():
        assert fields[name] is default, name
    assert OpenRequest(prompt_ids=np.zeros(1, np.int32)).sampling is DEFAULT_SAMPLING


def test_the_engine_defaults_are_the_wire_message_defaults():
    from hycoc.verifier.engine import VerifierEngine

    params = inspect.signature(VerifierEngine.open).parameters
    for name, default in WIRE.items():
        assert params[name].default is default, name


def test_the_recipe_defaults_are_the_wire_message_defaults():
    recipe = Recipe()
    s, a = recipe.sampling, recipe.acceptance
    assert s.distribution == DEFAULT_SAMPLING and type(s.distribution) is Sampling
    for name in ("temperature", "top_k", "top_p"):
        assert getattr(s, name) is getattr(DEFAULT_SAMPLING, name), name
    assert s.max_new_tokens is DEFAULT_MAX_NEW_TOKENS and s.seed is DEFAULT_SEED
    assert a.epsilon is DEFAULT_EPSILON and a.mode is DEFAULT_ACCEPTANCE


def test_the_paper_values_and_one_sampling_class():
    # App. C: T = 1, top-k 64, top-p 0.95, ε = 0.005; 1,024 new tokens on SB
    assert DEFAULT_SAMPLING == Sampling(1.0, 64, 0.95)
    assert (DEFAULT_EPSILON, DEFAULT_MAX_NEW_TOKENS, DEFAULT_SEED) == (0.005, 1024, 0)
    assert DEFAULT_ACCEPTANCE in messages.ACCEPTANCE_MODES and DEFAULT_DRAFT_PLACE in messages.DRAFT_PLACES
    # the recipe's table hands out the protocol's class, with the table's values
    table = Recipe().sampling.model_copy(update={"temperature": 0.0, "top_k": 8})
    assert table.distribution == Sampling(0.0, 8, DEFAULT_SAMPLING.top_p)
