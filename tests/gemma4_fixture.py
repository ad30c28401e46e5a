"""A conformance fixture for Gemma 4's chat format, built from public facts (no Gemma 4 tokenizer is reachable here).

Public: ids 0-4 (<pad> <eos> <bos> <unk> <mask>), 50 <|tool_response>, 105 <|turn>, 106 <turn|>, the stop ids
generation_config.json lists ([1, 106, 50], as transformers 5.24 writes for gemma4 GGUF), the turn format
``<bos><|turn>user\\n{text}<turn|>\\n<|turn>model\\n`` and the reasoning channel ``<|channel>thought\\n ... <channel|>``
(transformers' serving parser for gemma4). Assumed (marked ASSUMED_IDS): where <|channel>, <channel|>, <|think|>,
<|tool_call>, <tool_call|>, <tool_response|> sit; the other ids below 107 are reserved ``<unusedN>`` added tokens (not
flagged special, so the keep set's special class holds the 14 named ones). Text is a word-level vocabulary (role words,
then w0, w1, ...), so tiny models can use it.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, pre_tokenizers
from tokenizers import models as tok_models

PUBLIC_IDS = {
    0: "<pad>",
    1: "<eos>",
    2: "<bos>",
    3: "<unk>",
    4: "<mask>",
    50: "<|tool_response>",
    105: "<|turn>",
    106: "<turn|>",
}
ASSUMED_IDS = {
    48: "<|tool_call>",
    49: "<tool_call|>",
    51: "<tool_response|>",
    98: "<|think|>",
    100: "<|channel>",
    101: "<channel|>",
}
STOP_IDS = [1, 106, 50]
N_SPECIAL = 107
ROLE_WORDS = ["user", "model", "system", "thought"]
#: Punctuation and words a control-token string typed as text is spelled with (never the control token itself).
TEXT_PIECES = ["<", ">", "|", "turn", "bos", "eos", "think"]

#: Gemma 4's form; given as chat_template.jinja (the file transformers prefers over tokenizer_config.json).
TEMPLATE = (
    "{{- bos_token -}}"
    "{%- set ns = namespace(system=none) -%}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set ns.system = messages[0]['content'] -%}{%- set messages = messages[1:] -%}"
    "{%- endif -%}"
    "{%- set thinking = enable_thinking is defined and enable_thinking -%}"
    "{%- if thinking or ns.system is not none -%}"
    "{{- '<|turn>system\\n' -}}{%- if thinking -%}{{- '<|think|>' -}}{%- endif -%}"
    "{%- if ns.system is not none -%}{{- ns.system -}}{%- endif -%}{{- '<turn|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{- '<|turn>' + role + '\\n' + message['content'] + '<turn|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}{%- endif -%}"
)


def special_tokens() -> list[str]:
    """The 107 special tokens in id order."""
    named = PUBLIC_IDS | ASSUMED_IDS
    return [named.get(i, f"<unused{i}>") for i in range(N_SPECIAL)]


def gemma4_tokenizer(vocab_size: int = 300) -> Tokenizer:
    """A word-level tokenizer with Gemma 4's special tokens at Gemma 4's ids, then `ROLE_WORDS`, `TEXT_PIECES`, then
    w0, w1, ... (punctuation split off, so ``<turn|>`` typed as text is ``< turn | >``)."""
    specials = special_tokens()
    words = specials + ROLE_WORDS + TEXT_PIECES
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    named = set(PUBLIC_IDS.values()) | set(ASSUMED_IDS.values())
    tok.add_special_tokens([t for t in specials if t in named])
    tok.add_tokens([AddedToken(t, special=False) for t in specials if t not in named])  # reserved, not special
    return tok


def write_tokenizer_folder(
    folder: str | Path, vocab_size: int = 300, *, template_as: str = "jinja", stop_ids=None
) -> Path:
    """Write the fixture into ``folder``: tokenizer.json, tokenizer_config.json, the template (``template_as``
    "jinja": chat_template.jinja; "config": tokenizer_config.json "chat_template"; None: no template) and
    generation_config.json (``stop_ids``, default `STOP_IDS`; False: none). Returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    gemma4_tokenizer(vocab_size).save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "GemmaTokenizer",
        "bos_token": "<bos>",
        "eos_token": "<eos>",
        "pad_token": "<pad>",
        "unk_token": "<unk>",
    }
    if template_as == "config":
        config["chat_template"] = TEMPLATE
    elif template_as == "jinja":
        (folder / "chat_template.jinja").write_text(TEMPLATE, encoding="utf-8")
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    if stop_ids is not False:
        write_generation_config(folder, STOP_IDS if stop_ids is None else stop_ids)
    return folder


def write_generation_config(folder: str | Path, stop_ids) -> None:
    """Set ``eos_token_id`` in ``folder``/generation_config.json (created if absent)."""
    path = Path(folder) / "generation_config.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    data["eos_token_id"] = list(stop_ids)
    path.write_text(json.dumps(data, indent=2), encoding="utf-8")
