"""The toy family's tokenizer and chat files, written in the shape of a Gemma 4 checkpoint folder.

A Gemma 4 tokenizer folder holds ``tokenizer.json``, ``tokenizer_config.json`` (special tokens and
``chat_template``) and the model folder's ``generation_config.json`` lists the stop ids. The toy's folder holds the
same files with Gemma 4's special-token names, so every command reads the toy exactly as it reads a real checkpoint
(`hycoc.chat_template`). Ids 0..11 of the toy tokenizer (`SPECIAL_TOKENS`) carry Gemma 4's names; the trained weights
only ever saw ids 1, 2, 5 and 6 (``<eos>``, ``<bos>``, turn open, turn close), whose roles are unchanged.

The template is of Gemma 4's form (docs/recipes.md "Chat format"):
``<bos><|turn>user\\n{text}<turn|>\\n<|turn>model\\n``; roles are plain text after ``<|turn>``; ``enable_thinking``
opens a system turn with ``<|think|>``, as Gemma 4's thinking switch; a system message goes into the same turn.
"""

from __future__ import annotations

import json
from pathlib import Path

#: Special tokens in id order (ids 0..len-1 of the toy tokenizer), named as Gemma 4's.
SPECIAL_TOKENS = [
    "<pad>",
    "<eos>",
    "<bos>",
    "<unk>",
    "<mask>",
    "<|turn>",
    "<turn|>",
    "<|channel>",
    "<channel|>",
    "<|tool_call>",
    "<|tool_response>",
    "<|think|>",
]
#: Stop ids, in Gemma 4's order (<eos>, <turn|>, <|tool_response>: Gemma 4's [1, 106, 50]).
STOP_IDS = [1, 6, 10]

#: The toy's template (docs/recipes.md "Chat format"): Gemma 4's large form (26B-A4B, 31B) in its behaviours on
#: history -- user and system text trimmed, an earlier model turn's thought channel stripped and the answer trimmed,
#: ``<|think|>`` opening a system turn as the thinking switch -- but without the large form's empty thought channel
#: in the thinking-off generation prompt: the toy's weights never saw ``<|channel>`` / ``<channel|>`` (ids 7, 8),
#: and after them its greedy answers to 12 held-out prompts agree with the answers without them on 0 first tokens
#: (11 of 12 degenerate). The empty channel's rollback is tested with a fixture template (tests/chat_templates.py).
CHAT_TEMPLATE = (
    "{%- macro strip_thinking(text) -%}\n"
    "  {%- set ns = namespace(result='') -%}\n"
    "  {%- for part in text.split('<channel|>') -%}\n"
    "    {%- if '<|channel>' in part -%}{%- set ns.result = ns.result + part.split('<|channel>')[0] -%}\n"
    "    {%- else -%}{%- set ns.result = ns.result + part -%}{%- endif -%}\n"
    "  {%- endfor -%}\n"
    "  {{- ns.result | trim -}}\n"
    "{%- endmacro -%}\n"
    "{{- bos_token -}}\n"
    "{%- set ns = namespace(system=none) -%}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "  {%- set ns.system = messages[0]['content'] -%}\n"
    "  {%- set messages = messages[1:] -%}\n"
    "{%- endif -%}\n"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}\n"
    "{%- if thinking or ns.system is not none -%}\n"
    "  {{- '<|turn>system\\n' -}}\n"
    "  {%- if thinking -%}{{- '<|think|>' -}}{%- endif -%}\n"
    "  {%- if ns.system is not none -%}{{- ns.system | trim -}}{%- endif -%}\n"
    "  {{- '<turn|>\\n' -}}\n"
    "{%- endif -%}\n"
    "{%- for message in messages -%}\n"
    "  {%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}\n"
    "  {{- '<|turn>' + role + '\\n' -}}\n"
    "  {%- if role == 'model' -%}{{- strip_thinking(message['content']) -}}\n"
    "  {%- else -%}{{- message['content'] | trim -}}{%- endif -%}\n"
    "  {{- '<turn|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}\n"
)


def _specials() -> dict[str, str]:
    return {k: v for k, v in tokenizer_config(0).items() if k.endswith("_token")}


def prompt_text(user: str) -> str:
    """The template's rendering of one user message up to where the answer begins (training and evaluation
    prompts; the serving commands encode prompts through `hycoc.chat.Chat` instead)."""
    from hycoc.chat_template import render

    return render(
        CHAT_TEMPLATE,
        [{"role": "user", "content": user}],
        add_generation_prompt=True,
        thinking=None,
        specials=_specials(),
        source="hycoc.toy.chat_files.CHAT_TEMPLATE",
    )


def conversation_text(user: str, model: str) -> str:
    """A whole single-turn conversation as the template renders it (training text; the model turn closed)."""
    from hycoc.chat_template import render

    return render(
        CHAT_TEMPLATE,
        [{"role": "user", "content": user}, {"role": "assistant", "content": model}],
        add_generation_prompt=False,
        thinking=None,
        specials=_specials(),
        source="hycoc.toy.chat_files.CHAT_TEMPLATE",
    )


def tokenizer_config(model_max_length: int) -> dict:
    """``tokenizer_config.json`` of the toy tokenizer folder."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
        "model_max_length": int(model_max_length),
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_folder(tokenizer, folder: str | Path, model_max_length: int) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``folder`` (a `tokenizers.Tokenizer`)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n", encoding="utf-8"
    )
