"""`hycoc.runtime.chat_session.ChatSession`, the turns of ``hycoc run`` (one-shot and ``--chat``), against a runtime
that records its requests: the first turn is one OPEN of the rendered conversation with its anchor, each later one
an APPEND of the whole conversation re-rendered with the answers so far, and the answer's text reaches ``show``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from chat_templates import LARGE
from gemma4_fixture import write_tokenizer_folder
from hycoc.runtime.chat_session import ChatSession, TurnSettings
from hycoc.runtime.result import RequestResult

from hycoc.chat_template import load_chat
from hycoc.protocol.messages import Sampling


class Recorder:
    """A runtime whose every request commits ``answer`` (ids, streamed through on_tokens in one round)."""

    def __init__(self, chat, answer: list[int]):
        self.bundle = SimpleNamespace(chat=chat, tokenizer=chat.tokenizer)
        self.answer, self.calls = answer, []

    def generate(self, client, ids, *, on_tokens, **settings):
        self.calls.append(("open", list(ids), settings))
        on_tokens(self.answer)
        return RequestResult(mode=settings["mode"], tokens=list(self.answer))

    def next_turn(self, client, ids, *, anchor, max_new_tokens, on_tokens):
        self.calls.append(("append", list(ids), {"anchor": anchor, "max_new_tokens": max_new_tokens}))
        on_tokens(self.answer)
        return RequestResult(mode="", tokens=list(self.answer))


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    folder = write_tokenizer_folder(tmp_path_factory.mktemp("tok"))
    (folder / "chat_template.jinja").write_text(LARGE, encoding="utf-8")
    return load_chat(folder)


SETTINGS = TurnSettings("hyco", 8, 3, Sampling(0.0, 64, 0.95), 0.01, keep_open=True)


def test_the_first_turn_opens_the_rendering_and_the_next_appends_the_whole_conversation(chat):
    answer = chat.tokenizer.encode("w5 w6", add_special_tokens=False).ids
    rt = Recorder(chat, answer)
    session = ChatSession(rt, SETTINGS)
    first = chat.conversation([{"role": "user", "content": "w1 w2"}])
    assert session.start("w1 w2", raw=False, thinking=False) == first.ids
    shown = []
    session.turn(None, shown.append)
    kind, ids, settings = rt.calls[0]
    assert (kind, ids) == ("open", first.ids)
    # the OPEN carries every setting, the anchor of the rendering (where the answer's model turn opens) and
    # keep_open, so the session stays for the next turn
    assert settings == {
        "mode": "hyco",
        "max_new_tokens": 8,
        "seed": 3,
        "sampling": SETTINGS.sampling,
        "epsilon": 0.01,
        "keep_open": True,
        "anchor": first.anchor,
    }
    assert "".join(text for _, text in shown) == "w5 w6"  # no thought channel: all of it is answer text
    session.turn(None, shown.append, "w7")
    # the second request: user w1 w2, the model's answer w5 w6, user w7, rendered whole (the APPEND keeps the
    # common prefix with what the verifier holds)
    messages = [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": chat.answer_text(answer)},
        {"role": "user", "content": "w7"},
    ]
    second = chat.conversation(messages)
    assert rt.calls[1] == ("append", second.ids, {"anchor": second.anchor, "max_new_tokens": 8})
    assert session.turns == 2 and session.conversation.held == list(second.ids) + answer


def test_raw_ids_are_the_text_as_tokenized_and_have_no_next_turn(chat):
    rt = Recorder(chat, [5])
    session = ChatSession(rt, SETTINGS)
    ids = session.start("w1 w2", raw=True, thinking=False)
    assert ids == chat.tokenizer.encode("w1 w2", add_special_tokens=False).ids  # no template around it
    session.turn(None, lambda pieces: None)
    assert rt.calls[0][2]["anchor"] == 0  # raw ids cannot continue: no model turn to anchor at
    with pytest.raises(ValueError, match="chat template"):
        session.turn(None, lambda pieces: None, "w3")
