"""Conversations as the checkpoint's template renders them (docs/serving.md "Conversations"): the ids every turn
holds equal transformers' ``apply_chat_template`` on the whole conversation, with templates that behave as Gemma 4's
two real ones (tests/chat_templates.py); the verifier rolls its KV back to the common prefix (cropping, from the
sliding-window snapshot, or from 0), its next logits equal a cold prefill, and an APPEND is all or nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from chat_templates import LARGE, LARGE_THINK_NL, SMALL
from gemma4_fixture import STOP_IDS, write_tokenizer_folder

from hycoc.chat import Conversation, common_prefix, ids_crc32
from hycoc.chat_template import apply_chat_template_ids, load_chat
from hycoc.protocol.messages import Sampling

USERS = [" w1 w2 ", "w3\n", "w4 <turn|> <|turn>model w5 <bos>"]
#: answers as decoded text: a thought, trailing whitespace, a plain one
ANSWERS = ["<|channel>thought\nw6 w7<channel|>w8 w9", "w10 w11 \n", "w12"]


def _folder(tmp_path_factory, name, template):
    folder = write_tokenizer_folder(tmp_path_factory.mktemp(name))
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


@pytest.fixture(
    scope="module", params=[("large", LARGE), ("large-think-nl", LARGE_THINK_NL), ("small", SMALL)], ids=lambda p: p[0]
)
def templated(request, tmp_path_factory):
    folder = _folder(tmp_path_factory, request.param[0], request.param[1])
    return request.param[0], folder, load_chat(folder)


@pytest.mark.parametrize("turns", [2, 3])
@pytest.mark.parametrize("thinking", [False, True])
def test_whole_conversations_equal_transformers_apply_chat_template(templated, turns, thinking):
    name, folder, chat = templated
    messages = []
    for i in range(turns):
        messages.append({"role": "user", "content": USERS[i]})
        got = chat.conversation(messages, thinking)
        want = apply_chat_template_ids(folder, messages, thinking=True if thinking else None)
        if name == "small" and any("<|channel>" in m["content"] for m in messages if m["role"] == "assistant"):
            # a kept thought: transformers marks the model's own control tokens too and spells them as text;
            # hycoc keeps them as the model wrote them (hycoc/chat.py): the two differ exactly there
            assert got.ids != want and 100 in got.ids
        else:
            assert got.ids == want
            bare = apply_chat_template_ids(
                folder, messages, thinking=True if thinking else None, add_generation_prompt=False
            )
            assert got.anchor == min(common_prefix(got.ids, bare), len(got.ids) - 1)
        messages.append({"role": "assistant", "content": ANSWERS[i]})


def test_the_large_forms_behaviours_hold(tmp_path_factory):
    """On the toy's byte-level tokenizer (which decodes text exactly) with the large form's template."""
    from pathlib import Path

    from chat_templates import with_template

    toy = Path(__file__).resolve().parents[1] / "recipes" / "toy" / "models" / "verifier"
    chat = load_chat(with_template(toy, tmp_path_factory.mktemp("toy-large"), LARGE))
    tok = chat.tokenizer
    first = chat.conversation([{"role": "user", "content": "w1"}])
    assert tok.decode(first.ids, skip_special_tokens=False).endswith("<|turn>model\n<|channel>thought\n<channel|>")
    # the empty channel is in the prompt, not in history: the anchor is the model turn's opening
    assert tok.decode(first.ids[first.anchor :], skip_special_tokens=False) == (
        "<|turn>model\n<|channel>thought\n<channel|>"
    )
    two = chat.conversation(
        [
            {"role": "user", "content": "w1"},
            {"role": "assistant", "content": ANSWERS[0]},
            {"role": "user", "content": "w2"},
        ],
        thinking=True,
    )
    text = tok.decode(two.ids, skip_special_tokens=False)
    assert "w6" not in text and "<|channel>" not in text and "w8 w9<turn|>" in text  # thought stripped
    assert "<|turn>user\nw1<turn|>" in text
    assert text.startswith("<bos><|turn>system\n<|think|><turn|>\n")


# ---- the verifier's side -----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from hycoc.verifier.engine import VerifierEngine
    from tiny_models import tiny_verifier

    torch.set_num_threads(1)
    return VerifierEngine(
        tiny_verifier(), head_window=16, handoff_scales=(0.01,) * 6, eos_token_ids=STOP_IDS, prefill_chunk=8
    )


@pytest.fixture(scope="module")
def large_chat(tmp_path_factory):
    return load_chat(_folder(tmp_path_factory, "large-engine", LARGE))


def _answer(session, n):
    """Greedy rounds of the root alone until the turn finishes (cut at n tokens)."""
    seq = 0
    while not session.finished:
        session.verify(np.array([session.root]), np.array([-1]), seq)
        seq += 1
    return session.tokens[session.turn_start :]


def _next_logits(engine, session):
    """The root's logits over the session's cache (a copy: the forward appends the root's KV)."""
    import copy

    with torch.no_grad():
        return engine.model(
            torch.tensor([session.tokens[-1:]]),
            cache=copy.deepcopy(session.cache),
            position_ids=torch.tensor([[len(session.tokens) - 1]]),
        ).logits[0, -1]


def _cold_logits(engine, ids):
    with torch.no_grad():
        return engine.model(torch.tensor([ids])).logits[0, -1]


def _converse(engine, chat, users, answer_len, thinking=False):
    """A conversation over the engine as a device would hold it: returns (session, plans, ok) where ok checks,
    after every APPEND, that the held ids equal the template's rendering and the next logits a cold prefill."""
    conv = Conversation(chat, thinking)
    rendered = conv.ask(users[0])
    session = engine.open(rendered.ids, Sampling(temperature=0.0), max_new_tokens=answer_len, anchor=rendered.anchor)
    session.prefill()
    checks = []
    for user in users[1:]:
        output = _answer(session, answer_len)
        conv.answered(rendered, output)
        assert conv.held == session.tokens
        rendered = conv.ask(user)
        keep = max(1, min(common_prefix(conv.held, rendered.ids), len(rendered.ids) - 1))
        session.append(
            rendered.ids[keep:],
            answer_len,
            keep=keep,
            keep_crc=ids_crc32(conv.held[:keep]),
            anchor=rendered.anchor if rendered.anchor >= keep else 0,
        )
        checks.append(
            session.tokens == rendered.ids
            and torch.allclose(_next_logits(engine, session), _cold_logits(engine, rendered.ids), atol=1e-4)
        )
    return session, checks


@pytest.mark.parametrize("answer_len", [5, 30])
def test_three_turns_hold_the_rendering_and_a_cold_prefills_logits(engine, large_chat, answer_len):
    """5-token answers: the sliding layers still hold the window (crop); 30 > retain 16: the snapshot at the model
    turn's opening is restored and only what follows it is prefilled again."""
    session, checks = _converse(engine, large_chat, ["w1 w2", "w3", "w4 w5"], answer_len)
    assert checks == [True, True]
    kinds = [p.kind for p in session.appends]
    # 5-token answers: the first APPEND crops; by the second the sliding layers (retain 16) have moved past the
    # rollback point's window, so the snapshot at the model turn's opening serves
    assert kinds == (["crop", "snapshot"] if answer_len == 5 else ["snapshot", "snapshot"])
    for p in session.appends:  # re-prefilled: from the rollback point to what was kept (the bound)
        assert p.reprefilled == p.keep - p.start <= 3 + answer_len


def test_append_refuses_a_conversation_the_session_does_not_hold(engine, large_chat):
    from hycoc.verifier.errors import ConversationMismatch

    session, _ = _converse(engine, large_chat, ["w1"], 4)
    _answer(session, 4)
    before = (list(session.tokens), session.t)
    with pytest.raises(ConversationMismatch, match="crc32"):
        session.append([120, 121], 4, keep=5, keep_crc=ids_crc32(session.tokens[:5]) ^ 1)
    with pytest.raises(ConversationMismatch, match="holds"):
        session.append([120, 121], 4, keep=len(session.tokens) + 1)
    assert (session.tokens, session.t) == before and session.finished


@pytest.mark.parametrize("fail_at", [1, 2])
def test_an_append_that_fails_in_a_chunk_leaves_the_session_as_it_was(engine, large_chat, monkeypatch, fail_at):
    import hycoc.verifier.forward as eng_mod  # PrefillJob's chunks call forward.prefill

    def run(fail):
        session, _ = _converse(engine, large_chat, ["w1 w2"], 30)
        _answer(session, 30)
        conv_ids = large_chat.conversation(
            [
                {"role": "user", "content": "w1 w2"},
                {"role": "assistant", "content": large_chat.answer_text(session.tokens[session.turn_start :])},
                {"role": "user", "content": "w3 " * 12},
            ]
        ).ids
        keep = common_prefix(session.tokens, conv_ids)
        state = (
            list(session.tokens),
            session.t,
            [(c.keys.clone(), c.values.clone()) for c in session.cache.layers if c.is_initialized and c.keys.numel()],
            session.snapshot,
        )
        if fail:
            real, calls = eng_mod.prefill, []

            def flaky(*a, **k):
                calls.append(1)
                if len(calls) == fail_at:
                    raise RuntimeError("injected")
                return real(*a, **k)

            monkeypatch.setattr(eng_mod, "prefill", flaky)
            with pytest.raises(RuntimeError, match="injected"):
                session.append(conv_ids[keep:], 6, keep=keep)
            monkeypatch.setattr(eng_mod, "prefill", real)
            after = [(c.keys, c.values) for c in session.cache.layers if c.is_initialized and c.keys.numel()]
            assert (session.tokens, session.t, session.snapshot) == (state[0], state[1], state[3])
            assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(after, state[2]))
            assert session.finished
        session.append(conv_ids[keep:], 6, keep=keep)
        return _answer(session, 6)

    assert run(fail=True) == run(fail=False)


def test_a_rollback_before_the_snapshot_prefills_from_0(engine, large_chat):
    session, _ = _converse(engine, large_chat, ["w1 w2 w3"], 30)
    _answer(session, 30)
    ids = large_chat.conversation([{"role": "user", "content": "w9"}]).ids  # another first message: keeps <bos>
    session.append(ids[1:], 4, keep=1)
    assert session.appends[-1].kind == "full" and session.tokens == ids
    assert torch.allclose(_next_logits(engine, session), _cold_logits(engine, ids), atol=1e-4)


def test_held_bytes_never_pass_the_reservation(engine, large_chat):
    """Sampled after every forward of the model (a hook, not a polling thread): the cache's tensors, the snapshots
    and an APPEND's undo copy (`Session.kv_tensors`, each storage once) stay within what the server reserves for
    the conversation so far: the session's `session_kv_bytes`, one prefilling session's transient, the snapshots'
    bytes and, while the APPEND runs, its full layers' undo copy (docs/serving.md "Metrics, admission")."""
    from hycoc.verifier.kv_cache import full_positions, held_storage_bytes

    seen, sessions, cap = [], [], [0]

    def hook(module, args, out):
        for s in sessions:
            seen.append((held_storage_bytes(s.kv_tensors()), cap[0]))

    def base(s):
        return engine.session_kv_bytes(len(s.tokens) + s.max_new_tokens + 1, 1)

    handle = engine.model.register_forward_hook(hook)
    transient = engine.prefill_transient_bytes()
    try:
        conv = Conversation(large_chat)
        r = conv.ask("w1 " * 40)
        s = engine.open(r.ids, Sampling(temperature=0.0), max_new_tokens=30, anchor=r.anchor)
        sessions.append(s)
        first = engine.snapshot_bytes(r.anchor)
        cap[0] = engine.session_kv_bytes(len(r.ids) + 30 + 1, 1) + transient + first
        s.prefill()
        conv.answered(r, _answer(s, 30))
        r = conv.ask("w2 " * 20)
        keep = common_prefix(conv.held, r.ids)
        plan = s.plan_append(r.ids[keep:], keep)
        undo = engine.kv_layout.full_bytes * (full_positions(s.cache) - plan.start)
        new_base = engine.session_kv_bytes(len(r.ids) + 30 + 1, 1)
        cap[0] = max(base(s), new_base) + undo + transient + first + engine.snapshot_bytes(r.anchor)
        s.append(r.ids[keep:], 30, keep=keep, anchor=r.anchor)
        _answer(s, 30)
    finally:
        handle.remove()
    assert plan.kind == "snapshot" and undo > 0
    assert len(seen) > 40 and all(n <= c for n, c in seen)
    assert max(n / c for n, c in seen) > 0.5  # the bound is not vacuous


def test_a_snapshot_inside_a_chunk_equals_one_taken_at_a_chunk_boundary(engine):
    """The anchor inside a prefill chunk: the snapshot is sliced out after the chunk's forward (no forward ends
    there); it equals the one an engine whose chunks end at every position takes at the boundary."""
    from hycoc.verifier.engine import VerifierEngine
    from tiny_models import tiny_verifier

    prompt = list(range(20, 60))  # 39 prefilled positions, chunks of 8: anchor 29 is inside
    inside = engine.open(prompt, Sampling(temperature=0.0), anchor=29)
    inside.prefill()
    one = VerifierEngine(
        tiny_verifier(), head_window=16, handoff_scales=(0.01,) * 6, eos_token_ids=STOP_IDS, prefill_chunk=1
    )
    boundary = one.open(prompt, Sampling(temperature=0.0), anchor=29)
    boundary.prefill()
    a, b = inside.snapshot, boundary.snapshot
    assert a.position == b.position == 29 and a.layers.keys() == b.layers.keys() and a.layers
    for i in a.layers:
        (ka, va, sa), (kb, vb, sb) = a.layers[i], b.layers[i]
        assert sa == sb == 29 - 16 and ka.shape[-2] == 16  # the retained window before the anchor
        assert torch.allclose(ka, kb, atol=1e-5) and torch.allclose(va, vb, atol=1e-5)
    one.close()
