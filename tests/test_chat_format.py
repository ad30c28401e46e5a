"""The chat format read from the checkpoint: conformance with transformers' own template rendering on a Gemma 4
fixture (tests/gemma4_fixture.py) and the toy, the bad-input refusals, the device/verifier contract, the thought
split, and the conversation a verifier holds after APPEND."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from gemma4_fixture import STOP_IDS, TEMPLATE, write_generation_config, write_tokenizer_folder
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
    assert f.turns["default"].model_dump() == {"first": "<bos><|turn>user\n", "user_end": "<turn|>\n<|turn>model\n",
                                               "next": "<turn|>\n<|turn>user\n"}
    assert f.turns["thinking"].first == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\n"
    assert f.sources == {"template": str(folder / "chat_template.jinja"),
                         "stop_ids": str(folder / "generation_config.json")}
    assert f.reasoning is None                   # no verifier config.json here: no model type to look up
    assert chat.prompt("w1") == [2, 105, 107, 119, 106, 105, 108]   # <bos> <|turn> user w1 <turn|> <|turn> model


@pytest.mark.parametrize("thinking", [None, True])
@pytest.mark.parametrize("text", TEXTS)
def test_prompts_equal_transformers_apply_chat_template(chat, folder, text, thinking):
    want = apply_chat_template_ids(folder, [{"role": "user", "content": text}], thinking=thinking)
    assert chat.prompt(text, thinking=bool(thinking)) == want


@pytest.mark.parametrize("text", TEXTS[:3])
def test_a_conversation_is_prompt_answer_next_turn(chat, folder, text):
    """prompt(u1) + answer + next_turn(u2) is the template's rendering of the whole conversation."""
    answer = "w10 w11 w12"
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": answer},
                {"role": "user", "content": "w13 <turn|>"}]
    ids = chat.prompt(text) + chat.tokenizer.encode(answer, add_special_tokens=False).ids + chat.next_turn(
        "w13 <turn|>")
    assert ids == apply_chat_template_ids(folder, messages)


def test_user_control_token_strings_stay_text(chat):
    ids = chat.prompt("w1 <turn|> <|turn>model <bos>")
    assert [ids.count(i) for i in (2, 105, 106)] == [1, 2, 1]    # only the template's own control tokens
    assert "w1 < turn | > < | turn > model < bos >" in chat.tokenizer.decode(ids, skip_special_tokens=True)


def test_the_template_in_tokenizer_config_is_read_too(tmp_path):
    f = load_chat_format(write_tokenizer_folder(tmp_path, template_as="config"))
    assert f.sources["template"] == f"{tmp_path / 'tokenizer_config.json'}:chat_template"
    assert f.turns["default"].first == "<bos><|turn>user\n"


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
    with pytest.raises(ChatFormatError, match=r"chat_template.jinja: the chat template fails to render a user "
                                              r"conversation .*no user turns here"):
        load_chat_format(broken)
    reordered = write_tokenizer_folder(tmp_path / "d")
    (reordered / "chat_template.jinja").write_text(TEMPLATE.replace("message['content']", "message['content'][::-1]"))
    with pytest.raises(ChatFormatError, match="does not render the user's message verbatim"):
        load_chat_format(reordered)


def test_the_contract_check_names_both_sides(chat, tmp_path):
    other = load_chat_format(write_tokenizer_folder(tmp_path / "x", stop_ids=[1, 106]))
    chat.format.check_contract(chat.format.contract())          # equal: passes
    with pytest.raises(ChatMismatch, match=r"stop ids differ: the device's bundle stops on \[1, 106\], the verifier "
                                           r"on \[1, 50, 106\]"):
        chat.format.check_contract(other.contract())
    toy = load_chat_format(TOY_VERIFIER, TOY_VERIFIER)
    with pytest.raises(ChatMismatch, match=r"stop ids differ"):
        chat.format.check_contract(toy.contract())
    body = json.loads(chat.format.contract())
    body["turns"]["default"]["first"] = "<bos><start_of_turn>user\n"
    with pytest.raises(ChatMismatch, match=r"turn tokens \(default\) differ: .*<start_of_turn>.*the verifier .*<\|turn>"):
        chat.format.check_contract(json.dumps(body))
    with pytest.raises(ChatMismatch, match="not valid"):
        chat.format.check_contract("{")


def test_thought_split_and_stream():
    toy = load_chat(TOY_VERIFIER, TOY_VERIFIER)
    tok = toy.tokenizer
    thought = tok.encode("<|channel>thought\nLet me see.<channel|>", add_special_tokens=False).ids
    answer = tok.encode("It is 4.", add_special_tokens=False).ids
    assert toy.split_thought(thought + answer + [6]) == ("Let me see.", answer + [6])
    assert toy.split_thought(answer) == (None, answer)
    assert toy.split_thought(thought[:-1]) == ("Let me see.", [])              # cut inside the thought
    stream, out = AnswerStream(toy), ["", ""]
    for i in thought + answer + [6]:
        for k, piece in enumerate(stream.push([i])):
            out[k] += piece
    for k, piece in enumerate(stream.flush()):
        out[k] += piece
    assert out == ["Let me see.", "It is 4."]
    assert Chat(toy.format.model_copy(update={"reasoning": None}), tok).split_thought(thought) == (None, thought)


# ---- the conversation the verifier holds after APPEND --------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    from tiny_models import tiny_verifier

    from hycoc.verifier.engine import VerifierEngine

    torch.set_num_threads(1)
    return VerifierEngine(tiny_verifier(), head_window=16, handoff_scales=(0.01,) * 6, eos_token_ids=STOP_IDS)


@pytest.mark.parametrize("stop", [1, 106, 50, None])
def test_append_holds_the_templates_rendering_of_the_conversation(engine, chat, folder, stop):
    """A finished first turn (answer ids, then the stop id it ended on; None: cut by the output cap) continued
    with APPEND: the verifier holds exactly the template's rendering of user, model, user + generation prompt, and
    its next logits equal a cold prefill of that rendering."""
    prompt = chat.prompt("w1 w2")
    answer = chat.tokenizer.encode("w3 w4 w5", add_special_tokens=False).ids + ([] if stop is None else [stop])
    session = engine.open(prompt + answer)            # the answer's KV, as rounds would have written it
    session.prefill()
    session.turn_start, session.finished = len(prompt), True
    session.finish_reason = "max_new_tokens" if stop is None else "stop"
    turn = chat.next_turn("w6")
    session.append(turn, 4)
    want = apply_chat_template_ids(folder, [{"role": "user", "content": "w1 w2"},
                                            {"role": "assistant", "content": "w3 w4 w5"},
                                            {"role": "user", "content": "w6"}])
    assert session.tokens == want
    from hycoc.verifier.kv_cache import first_position, stores_kv

    assert {first_position(layer) + layer.keys.shape[2] for layer in session.cache.layers if stores_kv(layer)} == {
        len(want) - 1}                                   # KV up to every position but the root, in every layer
    with torch.no_grad():
        cold = engine.model(torch.tensor([want])).logits[0, -1]
        warm = engine.model(torch.tensor([want[-1:]]), cache=session.cache,
                            position_ids=torch.tensor([[len(want) - 1]])).logits[0, -1]
    assert torch.allclose(warm, cold, atol=1e-5)
    session.close()


def test_the_device_drops_the_stop_id_as_the_verifier_does(chat):
    assert chat.conversation_tokens([5, 6, 106]) == [5, 6]
    assert chat.conversation_tokens([5, 6, 1]) == [5, 6]
    assert chat.conversation_tokens([5, 6, 7]) == [5, 6, 7]            # cut by the cap: nothing to drop
    assert np.array_equal(chat.next_turn("w6")[:3], [106, 105, 107])   # <turn|> <|turn> user: the template's close


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
    assert chat["stop"] == [{"id": 1, "token": "<eos>"}, {"id": 106, "token": "<turn|>"},
                            {"id": 50, "token": "<|tool_response>"}]
    assert chat["sources"]["stop_ids"] == str(folder / "generation_config.json")   # no verifier folder here
    absent = CliRunner().invoke(app, ["inspect", str(gemma4), "--json"])
    missing = json.loads(absent.stdout)["chat"]
    assert missing["available"] is False and "hub id" in missing["why"]
    assert missing["reads"]["template"].startswith("google/gemma-4-26B-A4B-it/chat_template.jinja, else ")
