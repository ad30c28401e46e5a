"""Read a checkpoint's chat format from its files (host side: transformers renders the template).

What is read, in order (a real Gemma 4 folder and the toy's hold the same files):

    template     <tokenizer folder>/chat_template.jinja, else tokenizer_config.json "chat_template" (a string, or a
                 list of {name, template} whose "default" is taken), as transformers' tokenizer loading does
    specials     tokenizer_config.json bos_token / eos_token / pad_token / unk_token (what the template sees)
    stop ids     <verifier folder>/generation_config.json "eos_token_id" (an int or a list), else the tokenizer
                 folder's generation_config.json
    reasoning    tokenizer_config.json "response_template" fields.reasoning_content {open, close}, else
                 transformers' response template for the verifier's model type (``cli/serving/utils.py``)
    files        the sha256 of each of those files (`CHAT_FILES`, present ones): the bundle records them, the
                 server names one that changed since (`hycoc.chat.ChatFormat.check_contract`), and the pass cache
                 keys of the passes that read the chat format hash the same files (`recipe_chat_files`)

The template is checked at load, before any model: it must render a first user turn (default and, when it has
one, the thinking switch) and a two-turn conversation whose rendering keeps the first turn's history as the first
turn rendered it (`check_history`), or a conversation could keep nothing of its KV from one turn to the next.
Every refusal is a `ChatFormatError` naming the file and the fix, raised before any model is loaded. The template
travels whole in the bundle; both sides render conversations with `hycoc.chat.render_template` (jinja2's sandbox as
transformers sets it up) and the tests compare it with transformers' own ``apply_chat_template``.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath

from hycoc.chat import (
    Chat,
    ChatFormat,
    ChatFormatError,
    common_prefix,
    render_template,
    template_digest,
    template_literals,
)
from hycoc.models import load_tokenizer

_SENTINELS = ("hycocsentineluserone", "hycocsentinelanswerone", "hycocsentinelusertwo")
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


def tokenizer_folder(path: str | Path) -> Path:
    """The folder of a ``[models].tokenizer`` path: the path itself, or the folder of a ``tokenizer.json`` file."""
    p = Path(path)
    return p.parent if p.is_file() else p


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ChatFormatError(f"{path}: not readable JSON ({e}); restore the checkpoint's file") from None
    if not isinstance(data, dict):
        raise ChatFormatError(f"{path}: expected a JSON object; restore the checkpoint's file")
    return data


def _config(folder: Path) -> dict:
    path = folder / "tokenizer_config.json"
    return _json(path) if path.is_file() else {}


def read_template(folder: Path) -> tuple[str, str]:
    """(template text, the file it came from) of a tokenizer folder. Raises ChatFormatError when none is given."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    config_path = folder / "tokenizer_config.json"
    template = _config(folder).get("chat_template")
    if isinstance(template, list):  # transformers: a list of named templates, "default" used
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ChatFormatError(
            f'{folder}: no chat template (neither chat_template.jinja nor a "chat_template" in '
            f"{config_path.name}); copy the checkpoint's tokenizer files into this folder, or "
            "give the template as chat_template.jinja"
        )
    return template, f"{config_path}:chat_template"


def special_tokens(folder: Path) -> dict[str, str]:
    """The special-token strings the template sees (``bos_token`` ...), from tokenizer_config.json."""
    out = {}
    for key, value in _config(folder).items():
        if key in _SPECIAL_KEYS:
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                out[key] = value
    return out


def read_stop_ids(verifier: Path | None, folder: Path) -> tuple[list[int], str]:
    """(``eos_token_id`` as a list, the file) from the verifier's generation_config.json, else the tokenizer
    folder's. Raises ChatFormatError when neither has one."""
    looked = []
    for base in ([verifier] if verifier is not None else []) + [folder]:
        path = base / "generation_config.json"
        if str(path) in looked:
            continue
        looked.append(str(path))
        if not path.is_file():
            continue
        eos = _json(path).get("eos_token_id")
        if eos is None:
            raise ChatFormatError(
                f"{path}: no eos_token_id; add the checkpoint's stop ids, e.g. "
                '"eos_token_id": [1, 106, 50] for Gemma 4'
            )
        ids = [eos] if isinstance(eos, int) else eos
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
            raise ChatFormatError(f"{path}: eos_token_id = {eos!r}; expected a token id or a list of them")
        return list(ids), str(path)
    raise ChatFormatError(
        f"no generation_config.json with eos_token_id at {' or '.join(looked)}; copy the "
        "checkpoint's generation_config.json (it lists the stop ids)"
    )


def render(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    thinking: bool | None,
    specials: dict[str, str],
    source: str,
) -> str:
    """The template's rendering of ``messages`` (`hycoc.chat.render_template`); ``thinking`` None leaves
    ``enable_thinking`` unset (the template's default). Raises ChatFormatError naming ``source`` on a failure."""
    return render_template(
        template,
        messages,
        add_generation_prompt=add_generation_prompt,
        thinking=thinking,
        specials=specials,
        source=source,
    )


def check_history(template: str, specials: dict[str, str], thinking: bool | None, source: str) -> None:
    """Check that a template can keep a conversation's KV from one turn to the next: the rendering of a first user
    turn without the generation prompt must begin the rendering of (user, model, user) with it. Raises
    ChatFormatError naming ``source`` when it does not (every turn would then re-prefill the whole conversation)."""
    u1, a1, u2 = _SENTINELS
    first = render(
        template,
        [{"role": "user", "content": u1}],
        add_generation_prompt=False,
        thinking=thinking,
        specials=specials,
        source=source,
    )
    two = render(
        template,
        [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}],
        add_generation_prompt=True,
        thinking=thinking,
        specials=specials,
        source=source,
    )
    if u1 not in first:
        raise ChatFormatError(
            f"{source}: the chat template does not render the user's message; give the checkpoint's own template"
        )
    if not two.startswith(first):
        kept = common_prefix(first, two)
        raise ChatFormatError(
            f"{source}: the chat template renders the first user turn differently once a model "
            f"turn follows (the renderings part at character {kept}: {first[kept : kept + 40]!r} vs "
            f"{two[kept : kept + 40]!r}), so a conversation cannot keep its KV across turns; give a "
            "template whose history renders earlier turns as it rendered them"
        )


def _control_tokens(tokenizer, template: str) -> list[str]:
    """transformers' ``_get_control_tokens`` without ``chat_control_tokens``: special added tokens, plus added
    tokens the template's literal strings contain (whitespace tokens aside; ``_get_template_literal_text``)."""
    out = []
    literals = template_literals(template)
    for _, tok in sorted(tokenizer.get_added_tokens_decoder().items()):
        if tok.special or (tok.content in literals and not tok.content.isspace()):
            out.append(tok.content)
    return out


def _reasoning(folder: Path, model_type: str | None) -> tuple[list[str] | None, str | None]:
    fields = (_config(folder).get("response_template") or {}).get("fields", {})
    channel = fields.get("reasoning_content") if isinstance(fields, dict) else None
    if isinstance(channel, dict) and isinstance(channel.get("open"), str) and isinstance(channel.get("close"), str):
        return [channel["open"], channel["close"]], f"{folder / 'tokenizer_config.json'}:response_template"
    if model_type is None:
        return None, None
    try:  # transformers' built-in response templates (the serving CLI's parser), by model type
        import transformers
        from transformers.cli.serving.utils import _RESPONSE_TEMPLATE_FALLBACKS
    except Exception:  # noqa: BLE001 -- a transformers without that table (or whose CLI fails to import): no fallback
        return None, None
    for name in (model_type, model_type.removesuffix("_text")):
        for types, tmpl in _RESPONSE_TEMPLATE_FALLBACKS.items():
            channel = tmpl.get("fields", {}).get("reasoning_content") if name in types else None
            if channel and isinstance(channel.get("open"), str) and isinstance(channel.get("close"), str):
                return (
                    [channel["open"], channel["close"]],
                    f"transformers {transformers.__version__} response template for {name!r}",
                )
    return None, None


def load_chat_format(tokenizer_path: str | Path, verifier_path: str | Path | None = None) -> ChatFormat:
    """The `ChatFormat` of a checkpoint (module docstring). tokenizer_path: the tokenizer folder or its
    tokenizer.json; verifier_path: the verifier's folder (its generation_config.json and config.json model_type)
    or None. Raises ChatFormatError (file and fix) for a missing template, a template that fails to render or
    cannot be cut into turns, no stop ids, a stop id outside the vocabulary."""
    folder = tokenizer_folder(tokenizer_path)
    tok_file = folder / "tokenizer.json"
    if not tok_file.is_file():
        raise ChatFormatError(
            f"{folder}: no tokenizer.json; point [models].tokenizer at the checkpoint's tokenizer folder"
        )
    verifier = Path(verifier_path) if verifier_path is not None else None
    template, source = read_template(folder)
    specials = special_tokens(folder)
    probe = [{"role": "user", "content": _SENTINELS[0]}]
    default = render(template, probe, add_generation_prompt=True, thinking=None, specials=specials, source=source)
    thinking = render(template, probe, add_generation_prompt=True, thinking=True, specials=specials, source=source)
    has_thinking = thinking != default
    check_history(template, specials, None, source)
    if has_thinking:
        check_history(template, specials, True, source)
    stop_ids, stop_source = read_stop_ids(verifier, folder)
    tokenizer = load_tokenizer(tok_file)
    stop_tokens = []
    for i in stop_ids:
        s = tokenizer.id_to_token(i)
        if s is None:
            raise ChatFormatError(
                f"{stop_source}: eos_token_id {i} is not in the tokenizer's vocabulary "
                f"({tokenizer.get_vocab_size()} ids, {tok_file}); use the checkpoint's own files"
            )
        stop_tokens.append(s)
    model_type = None
    if verifier is not None and (verifier / "config.json").is_file():
        model_type = _json(verifier / "config.json").get("model_type")
    reasoning, reasoning_source = _reasoning(folder, model_type)
    sources = {"template": source, "stop_ids": stop_source}
    if reasoning_source is not None:
        sources["reasoning"] = reasoning_source
    return ChatFormat(
        template=template,
        specials=specials,
        has_thinking=has_thinking,
        stop_ids=stop_ids,
        stop_tokens=stop_tokens,
        control_tokens=_control_tokens(tokenizer, template),
        reasoning=reasoning,
        template_sha256=template_digest(template),
        sources=sources,
        files=files_sha256(chat_files(folder, verifier)),
    )


#: Every file `load_chat_format` may read, by the folder it reads it from ("tokenizer": the tokenizer folder,
#: "verifier": the verifier's folder), in the module docstring's order. The pass cache keys of the passes that read
#: the chat format hash them (`chat_files`; `hycoc.passes.pipeline.Pass.files_read`).
CHAT_FILES = (
    ("tokenizer", "chat_template.jinja"),
    ("tokenizer", "tokenizer_config.json"),
    ("tokenizer", "tokenizer.json"),
    ("tokenizer", "generation_config.json"),
    ("verifier", "generation_config.json"),
    ("verifier", "config.json"),
)


def chat_files(tokenizer_path: str | Path, verifier_path: str | Path | None = None) -> dict[str, Path]:
    """``"ROLE/FILE"`` -> path of every `CHAT_FILES` entry `load_chat_format` may read for these folders, present
    or not (a file that appears, e.g. a chat_template.jinja beside tokenizer_config.json, changes what is read).
    The verifier's entries only when ``verifier_path`` is given."""
    folders = {"tokenizer": tokenizer_folder(tokenizer_path)}
    if verifier_path is not None:
        folders["verifier"] = Path(verifier_path)
    return {f"{role}/{name}": folders[role] / name for role, name in CHAT_FILES if role in folders}


#: (path, size, mtime_ns) -> sha256: each file is hashed once per process while it is unchanged.
_FILE_SHA256: dict[tuple[str, int, int], str] = {}


def files_sha256(files: dict[str, Path]) -> dict[str, str]:
    """label -> sha256 hex of each file of ``files`` that exists (what `ChatFormat.files` holds)."""
    import hashlib

    out = {}
    for label, path in files.items():
        try:
            st = Path(path).stat()
        except OSError:
            continue
        mark = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if mark not in _FILE_SHA256:
            _FILE_SHA256[mark] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        out[label] = _FILE_SHA256[mark]
    return out


def recipe_chat_files(recipe) -> dict[str, Path]:
    """`chat_files` of the folders `chat_from_recipe` reads for ``recipe`` (the verifier's when it is a folder
    here); {} when the tokenizer folder is not on this machine (the pass that reads it fails with that error)."""
    from hycoc.models import ModelNotFoundError, model_dir

    try:
        folder = model_dir(recipe, "tokenizer")
    except ModelNotFoundError:
        return {}
    try:
        verifier = model_dir(recipe, "verifier")
    except ModelNotFoundError:
        verifier = None
    return chat_files(folder, verifier if verifier is not None and Path(verifier).is_dir() else None)


def load_chat(tokenizer_path: str | Path, verifier_path: str | Path | None = None) -> Chat:
    """`load_chat_format` with the folder's ``tokenizers.Tokenizer``: a ready `hycoc.chat.Chat`."""
    fmt = load_chat_format(tokenizer_path, verifier_path)
    return Chat(fmt, load_tokenizer(tokenizer_folder(tokenizer_path) / "tokenizer.json"))


def chat_from_recipe(recipe) -> Chat:
    """The `Chat` of a recipe's ``[models].tokenizer`` folder, with the stop ids of ``[models].verifier`` when its
    folder is here. Raises ModelNotFoundError (tokenizer not on this machine) or ChatFormatError."""
    from hycoc.models import ModelNotFoundError, model_dir

    folder = model_dir(recipe, "tokenizer")
    try:
        verifier = model_dir(recipe, "verifier")
    except ModelNotFoundError:
        verifier = None
    return load_chat(folder, verifier if verifier is not None and Path(verifier).is_dir() else None)


#: Per ``ChatFormat.sources`` key: the recipe's ``[models]`` folders it is read from, in the order
#: `load_chat_format` looks (the template and reasoning channel from the tokenizer folder; the stop ids from the
#: verifier's folder, else the tokenizer's), so a file both folders hold is named by the role it was read for.
_SOURCE_ROLES = {"template": ("tokenizer", "verifier"), "reasoning": ("tokenizer", "verifier")}
_SOURCE_ROLES_DEFAULT = ("verifier", "tokenizer")


def _is_machine_path(text: str) -> bool:
    return PurePosixPath(text).is_absolute() or PureWindowsPath(text).is_absolute()


def portable_source(source: str, folders: list[tuple[str, Path]]) -> str:
    """``source`` (a `ChatFormat.sources` value: a file path, optionally with a ``:json_key`` suffix, or a library
    name) without this machine's folders, for a bundle that is copied to another machine (docs/design.md "Bundle").

    folders: (label, folder) pairs tried in order, e.g. ``("[models].tokenizer", Path("/.../verifier"))``. A file
    inside one of them becomes ``"FILE of LABEL"`` (FILE relative to that folder, posix separators, the ``:key``
    suffix kept: ``"tokenizer_config.json:chat_template of [models].tokenizer"``); any other absolute path its file
    name; anything else (a relative path, ``"transformers 5.24.0 response template for 'gemma4'"``) unchanged."""
    path, sep, key = source.rpartition(":")
    if not (sep and path and key.isidentifier() and _is_machine_path(path)):
        path, key = source, ""
    if not _is_machine_path(path):
        return source
    suffix = f":{key}" if key else ""
    for label, folder in folders:
        try:
            rel = Path(path).resolve().relative_to(Path(folder).resolve())
        except ValueError:
            continue
        return f"{rel.as_posix()}{suffix} of {label}"
    return f"{PureWindowsPath(path).name}{suffix}"  # PureWindowsPath splits at / and at backslashes


def bundle_chat_format(recipe) -> ChatFormat:
    """The `ChatFormat` a bundle records (`chat_from_recipe`'s): the template travels whole in the manifest with
    its sha256, and ``sources`` names each file by the recipe key of its folder (`portable_source`) instead of this
    machine's path, so a bundle copied elsewhere names nothing that exists only where it was built. Raises as
    `chat_from_recipe`."""
    from hycoc.models import ModelNotFoundError, model_dir

    fmt = chat_from_recipe(recipe).format
    found: dict[str, Path] = {"tokenizer": tokenizer_folder(model_dir(recipe, "tokenizer"))}
    try:
        found["verifier"] = Path(model_dir(recipe, "verifier"))
    except ModelNotFoundError:
        pass
    sources = {}
    for key, source in fmt.sources.items():
        roles = _SOURCE_ROLES.get(key, _SOURCE_ROLES_DEFAULT)
        sources[key] = portable_source(source, [(f"[models].{r}", found[r]) for r in roles if r in found])
    return fmt.model_copy(update={"sources": sources})


def sources_to_read(recipe) -> dict[str, str]:
    """What `chat_from_recipe` will read for a recipe whose folders are not here yet (for ``hycoc inspect``)."""
    t, v = recipe.models.tokenizer, recipe.models.verifier
    return {
        "template": f'{t}/chat_template.jinja, else {t}/tokenizer_config.json "chat_template"',
        "stop_ids": f'{v}/generation_config.json "eos_token_id", else {t}/generation_config.json',
        "reasoning": f'{t}/tokenizer_config.json "response_template", else transformers\' response template '
        "for the verifier's model type",
    }


def chat_summary(recipe, user_text: str = "Hello") -> dict:
    """What ``hycoc inspect RECIPE`` shows of the chat format: the first turn rendered for ``user_text`` (control
    tokens as their strings), the stop tokens (id and string), the thinking switch, the reasoning channel and the
    file each came from; when the tokenizer folder is not here (or its files are refused), ``available`` false with
    ``reads`` (what will be read) and ``why``; ``refused`` is true when the files are here but refused (a template
    that fails to render or cannot keep a conversation: ``hycoc inspect`` then exits 1)."""
    from hycoc.models import ModelNotFoundError

    try:
        chat = chat_from_recipe(recipe)
    except ModelNotFoundError as e:
        return {"available": False, "refused": False, "reads": sources_to_read(recipe), "why": str(e)}
    except ChatFormatError as e:
        return {"available": False, "refused": True, "reads": sources_to_read(recipe), "why": str(e)}
    f = chat.format
    turns = chat.conversation(
        [
            {"role": "user", "content": user_text},
            {"role": "assistant", "content": "Hi!"},
            {"role": "user", "content": user_text},
        ]
    )
    return {
        "available": True,
        "prompt": chat.render(user_text),
        "prompt_ids": chat.prompt(user_text),
        "stop": [{"id": i, "token": t} for i, t in zip(f.stop_ids, f.stop_tokens)],
        "thinking": f.has_thinking,
        "thinking_prompt": chat.render(user_text, True) if f.has_thinking else None,
        "reasoning": f.reasoning,
        "sources": f.sources,
        "template_sha256": f.template_sha256,
        "second_turn": chat.tokenizer.decode(turns.ids, skip_special_tokens=False),
    }


def apply_chat_template_ids(
    tokenizer_path: str | Path,
    messages: list[dict],
    *,
    thinking: bool | None = None,
    add_generation_prompt: bool = True,
) -> list[int]:
    """The reference: transformers' own ``apply_chat_template(..., sanitize_control_tokens=True)`` on the folder's
    tokenizer.json, template and special tokens (what the conformance tests compare `hycoc.chat.Chat` with)."""
    from transformers import PreTrainedTokenizerFast

    folder = tokenizer_folder(tokenizer_path)
    template, _ = read_template(folder)
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), chat_template=template, **special_tokens(folder)
    )
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    return list(
        tok.apply_chat_template(
            messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            sanitize_control_tokens=True,
            **kwargs,
        )
    )


__all__ = [
    "CHAT_FILES",
    "apply_chat_template_ids",
    "bundle_chat_format",
    "chat_from_recipe",
    "chat_summary",
    "chat_files",
    "files_sha256",
    "check_history",
    "load_chat",
    "load_chat_format",
    "portable_source",
    "read_stop_ids",
    "read_template",
    "recipe_chat_files",
    "render",
    "sources_to_read",
    "special_tokens",
    "tokenizer_folder",
]
