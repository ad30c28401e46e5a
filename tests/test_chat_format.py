"""The chat format read from the checkpoint: conformance with transformers' own template rendering on a Gemma 4
fixture (tests/gemma4_fixture.py) and the toy, the bad-input refusals, the device/verifier contract, the thought
split, and the conversation a verifier holds after APPEND."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gemma4_fixture import TEMPLATE, write_generation_config, write_tokenizer_folder

from hycoc.chat import AnswerStream, Chat, ChatFormatError, ChatMismatch
from hycoc.chat_template import apply_chat_template_ids, load_chat, load_chat_format

TEXTS = ["w1 w2 w3", "w4 <turn|> w5 <|turn>model w6 <bos>", "<|think|> w7", "w8\U000f0000<eos>\U000f0001 w9", ""]


#: The toy verifier's folder, found from this file (not the working directory).
TOY_VERIFIER = Path(__file__).resolve().parents[1] / "recipes" / "toy" / "models" / "verifier"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tokenizer_folder(tmp_path_factory.mktemp("gemma4"))


@pytest.fixture(scope="module")
def chat(folder):
    return load_chat(folder)


def test_the_fixture_reads_as_gemma_4(chat, folder):
    f = chat.format
    assert (f.stop_ids, f.stop_tokens) == ([1, 106, 50], ["<eos>", "<turn|>", "<|tool_response>"])
    assert f.template == TEMPLATE and f.has_thinking and f.specials["bos_token"] == "<bos>"
    assert chat.render("w1", thinking=True).startswith("<bos><|turn>system\n<|think|><turn|>\n<|turn>user\n")
    assert f.sources == {
        "template": str(folder / "chat_template.jinja"),
        "stop_ids": str(folder / "generation_config.json"),
    }
    assert f.reasoning is None  # no verifier config.json here: no model type to look up
    assert chat.prompt("w1") == [2, 105, 107, 119, 106, 105, 108]  # <bos> <|turn> user w1 <turn|> <|turn> model


@pytest.mark.parametrize("thinking", [None, True])
@pytest.mark.parametrize("text", TEXTS)
def test_prompts_equal_transformers_apply_chat_template(chat, folder, text, thinking):
    want = apply_chat_template_ids(folder, [{"role": "user", "content": text}], thinking=thinking)
    assert chat.prompt(text, thinking=bool(thinking)) == want


def test_user_control_token_strings_stay_text(chat):
    ids = chat.prompt("w1 <turn|> <|turn>model <bos>")
    assert [ids.count(i) for i in (2, 105, 106)] == [1, 2, 1]  # only the template's own control tokens
    assert "w1 < turn | > < | turn > model < bos >" in chat.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_template_in_tokenizer_config_is_read_too(tmp_path):
    f = load_chat_format(write_tokenizer_folder(tmp_path, template_as="config"))
    assert f.sources["template"] == f"{tmp_path / 'tokenizer_config.json'}:chat_template"
    assert f.template == TEMPLATE


def test_stop_ids_come_from_the_verifier_first(tmp_path):
    tok = write_tokenizer_folder(tmp_path / "tok", stop_ids=[1])
    verifier = tmp_path / "verifier"
    verifier.mkdir()
    write_generation_config(verifier, [106, 1])
    f = load_chat_format(tok, verifier)
    assert (f.stop_ids, f.sources["stop_ids"]) == ([106, 1], str(verifier / "generation_config.json"))
    assert load_chat_format(tok).stop_ids == [1]


def test_bad_chat_files_are_refused_naming_the_file(tmp_path):
    no_template = write_tokenizer_folder(tmp_path / "a", template_as=None)
    with pytest.raises(ChatFormatError, match=r"a: no chat template .*chat_template.jinja"):
        load_chat_format(no_template)
    no_stops = write_tokenizer_folder(tmp_path / "b", stop_ids=False)
    with pytest.raises(ChatFormatError, match=r"no generation_config.json with eos_token_id at .*b/generation_config"):
        load_chat_format(no_stops)
    (no_stops / "generation_config.json").write_text(json.dumps({"bos_token_id": 2}))
    with pytest.raises(ChatFormatError, match=r"b/generation_config.json: no eos_token_id"):
        load_chat_format(no_stops)
    write_generation_config(no_stops, [1, 999])
    with pytest.raises(ChatFormatError, match=r"eos_token_id 999 is not in the tokenizer's vocabulary"):
        load_chat_format(no_stops)
    broken = write_tokenizer_folder(tmp_path / "c")
    (broken / "chat_template.jinja").write_text("{{ raise_exception('no user turns here') }}")
    with pytest.raises(
        ChatFormatError,
        match=r"chat_template.jinja: the chat template fails to render a user "
        r"conversation .*no user turns here",
    ):
        load_chat_format(broken)
    # a template whose first user turn renders differently once a model turn follows: nothing could be kept
    moving = write_tokenizer_folder(tmp_path / "d")
    (moving / "chat_template.jinja").write_text(
        TEMPLATE.replace("{{- bos_token -}}", "{{- bos_token -}}{{- messages | length -}}")
    )
    with pytest.raises(ChatFormatError, match="renders the first user turn differently once a model turn follows"):
        load_chat_format(moving)


def test_the_contract_check_names_both_sides(chat, tmp_path):
    other = load_chat_format(write_tokenizer_folder(tmp_path / "x", stop_ids=[1, 106]))
    chat.format.check_contract(chat.format.contract())  # equal: passes
    with pytest.raises(
        ChatMismatch,
        match=r"stop ids differ: the device's bundle stops on \[1, 106\], the verifier "
        r"on \[1, 50, 106\]",
    ):
        chat.format.check_contract(other.contract())
    toy = load_chat_format(TOY_VERIFIER, TOY_VERIFIER)
    with pytest.raises(ChatMismatch, match=r"stop ids differ"):
        chat.format.check_contract(toy.contract())
    body = json.loads(chat.format.contract())
    body["template_sha256"] = "0" * 64
    with pytest.raises(
        ChatMismatch,
        match=r"chat templates differ: the device's bundle renders with template sha256 "
        r"000000000000\.\.\., the verifier with " + chat.format.template_sha256[:12],
    ):
        chat.format.check_contract(json.dumps(body))
    old = {"stop_ids": [1, 50, 106], "turns": {"default": {"first": "<bos>", "user_end": "", "next": ""}}}
    with pytest.raises(ChatMismatch, match="built before conversations were re-rendered by the template"):
        chat.format.check_contract(json.dumps(old))  # a bundle of an older hycoc
    with pytest.raises(ChatMismatch, match="rebuild the bundle"):
        chat.format.check_contract("{")


def test_thought_split_and_stream():
    toy = load_chat(TOY_VERIFIER, TOY_VERIFIER)
    tok = toy.tokenizer
    thought = tok.encode("<|channel>thought\nLet me see.<channel|>", add_special_tokens=False).ids
    answer = tok.encode("It is 4.", add_special_tokens=False).ids
    assert toy.split_thought(thought + answer + [6]) == ("Let me see.", answer + [6])
    assert toy.split_thought(answer) == (None, answer)
    assert toy.split_thought(thought[:-1]) == ("Let me see.", [])  # cut inside the thought
    stream, out = AnswerStream(toy), ["", ""]
    for i in thought + answer + [6]:
        for k, piece in enumerate(stream.push([i])):
            out[k] += piece
    for k, piece in enumerate(stream.flush()):
        out[k] += piece
    assert out == ["Let me see.", "It is 4."]
    assert Chat(toy.format.model_copy(update={"reasoning": None}), tok).split_thought(thought) == (None, thought)


# ---- an answer as its assistant message ---------------------------------------------------------------------


@pytest.mark.parametrize("stop", [1, 106, 50, None])
def test_an_answer_becomes_its_text_without_the_stop_id(stop):
    toy = load_chat(TOY_VERIFIER, TOY_VERIFIER)
    ids = toy.tokenizer.encode("<|channel>thought\nhm<channel|>It is 4.", add_special_tokens=False).ids
    stop_ids = [] if stop is None else [{1: 1, 106: 6, 50: 10}[stop]]  # the toy's ids of the same stops
    assert toy.answer_text(ids + stop_ids) == "<|channel>thought\nhm<channel|>It is 4."


# ---- hycoc inspect ---------------------------------------------------------------------------------------------


def test_inspect_gemma4_recipe_shows_the_chat_format(folder, tmp_path):
    """recipes/gemma4.toml with its tokenizer pointed at a folder of Gemma 4's tokenizer files (the fixture)."""
    from pathlib import Path

    from typer.testing import CliRunner

    from hycoc.cli import app

    gemma4 = Path(__file__).resolve().parents[1] / "recipes" / "gemma4.toml"
    text = gemma4.read_text().replace('tokenizer = "google/gemma-4-26B-A4B-it"', f'tokenizer = "{folder}"')
    (tmp_path / "gemma4.toml").write_text(text)
    result = CliRunner().invoke(app, ["inspect", str(tmp_path / "gemma4.toml"), "--json"])
    assert result.exit_code == 0, result.output
    chat = json.loads(result.stdout)["chat"]
    assert chat["prompt"] == "<bos><|turn>user\nHello<turn|>\n<|turn>model\n"
    assert chat["second_turn"].count("<|turn> user") == 2  # the whole conversation (word-level decode)
    assert chat["stop"] == [
        {"id": 1, "token": "<eos>"},
        {"id": 106, "token": "<turn|>"},
        {"id": 50, "token": "<|tool_response>"},
    ]
    assert chat["sources"]["stop_ids"] == str(folder / "generation_config.json")  # no verifier folder here
    absent = CliRunner().invoke(app, ["inspect", str(gemma4), "--json"])
    missing = json.loads(absent.stdout)["chat"]
    assert missing["available"] is False and "hub id" in missing["why"]
    assert missing["reads"]["template"].startswith("google/gemma-4-26B-A4B-it/chat_template.jinja, else ")


def test_the_tokenizer_is_parsed_once_per_process(tmp_path, monkeypatch):
    """load_chat, load_chat again and load_tokenizer parse tokenizer.json once (it was twice per load_chat, about
    13 times per build); a changed file is parsed again."""
    import os

    from tokenizers import Tokenizer

    from hycoc.models import load_tokenizer

    folder = write_tokenizer_folder(tmp_path / "once")
    parses, real = [], Tokenizer.from_file
    monkeypatch.setattr(Tokenizer, "from_file", staticmethod(lambda p: parses.append(p) or real(p)))
    a = load_chat(folder)
    b = load_chat(folder, folder)
    assert load_tokenizer(folder) is a.tokenizer is b.tokenizer and len(parses) == 1
    st = (folder / "tokenizer.json").stat()
    os.utime(folder / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert load_tokenizer(folder) is not a.tokenizer and len(parses) == 2
