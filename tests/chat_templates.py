"""Chat templates written here with the behaviours of Gemma 4's two real templates (their public copies are read,
never copied: see docs/recipes.md "Chat format"), for tests that must see what the real files do.

LARGE (gemma-4-26B-A4B-it, 31B-it): with thinking off the generation prompt ends with an empty thought channel
``<|channel>thought\\n<channel|>`` that a model turn in history does not have; an earlier model turn's thought
channel is stripped and the answer trimmed; user and system text is trimmed; thinking on opens a system turn with
``<|think|>`` (LARGE_THINK_NL: ``<|think|>\\n``, as later public copies write it). SMALL (E2B, E4B): no empty
channel, thoughts kept in history, ``<|think|>\\n``, user text trimmed.
"""

from __future__ import annotations

_STRIP = (
    "{%- macro visible(text) -%}"
    "{%- set acc = namespace(out='') -%}"
    "{%- for piece in text.split('<channel|>') -%}"
    "{%- if '<|channel>' in piece -%}{%- set acc.out = acc.out ~ piece.split('<|channel>')[0] -%}"
    "{%- else -%}{%- set acc.out = acc.out ~ piece -%}{%- endif -%}"
    "{%- endfor -%}"
    "{{- acc.out | trim -}}"
    "{%- endmacro -%}"
)


def _template(*, think: str, strip: bool, empty_channel: bool) -> str:
    model_text = "visible(m['content'])" if strip else "m['content'] | trim"
    return (
        (_STRIP if strip else "") + "{{- bos_token -}}"
        "{%- set on = enable_thinking is defined and enable_thinking -%}"
        "{%- set rest = messages -%}"
        "{%- if on or (messages and messages[0]['role'] == 'system') -%}"
        "{{- '<|turn>system\\n' -}}{%- if on -%}{{- '" + think + "' -}}{%- endif -%}"
        "{%- if messages and messages[0]['role'] == 'system' -%}{{- messages[0]['content'] | trim -}}"
        "{%- set rest = messages[1:] -%}{%- endif -%}"
        "{{- '<turn|>\\n' -}}"
        "{%- endif -%}"
        "{%- for m in rest -%}"
        "{%- if m['role'] == 'assistant' -%}{{- '<|turn>model\\n' + " + model_text + " -}}"
        "{%- else -%}{{- '<|turn>' + m['role'] + '\\n' + (m['content'] | trim) -}}{%- endif -%}"
        "{{- '<turn|>\\n' -}}"
        "{%- endfor -%}"
        "{%- if add_generation_prompt -%}{{- '<|turn>model\\n' -}}"
        + ("{%- if not on -%}{{- '<|channel>thought\\n<channel|>' -}}{%- endif -%}" if empty_channel else "")
        + "{%- endif -%}"
    )


LARGE = _template(think="<|think|>", strip=True, empty_channel=True)
LARGE_THINK_NL = _template(think="<|think|>\\n", strip=True, empty_channel=True)
SMALL = _template(think="<|think|>\\n", strip=False, empty_channel=False)
#: name -> template, for parametrized tests.
TEMPLATES = {"large": LARGE, "large-think-nl": LARGE_THINK_NL, "small": SMALL}


def with_template(src_folder, dst_folder, template: str):
    """A copy of a tokenizer folder (tokenizer.json, tokenizer_config.json, generation_config.json, config.json
    when present) whose chat template is ``template`` (as chat_template.jinja, which transformers prefers)."""
    import shutil
    from pathlib import Path

    src, dst = Path(src_folder), Path(dst_folder)
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "config.json"):
        if (src / name).is_file():
            shutil.copy(src / name, dst / name)
    (dst / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dst
