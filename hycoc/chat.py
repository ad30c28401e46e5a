"""The checkpoint's chat format and a conversation's token ids, as the device runtime and every host command use
them (docs/recipes.md "Chat format", docs/serving.md "Conversations").

Nothing here knows a model family's markers. A `ChatFormat` is read from a checkpoint by
`hycoc.chat_template.load_chat_format` (the tokenizer folder's own chat template and special tokens, and
``generation_config.json``'s ``eos_token_id``), carried whole in the device bundle's manifest (``chat``), and used
here with jinja2 alone (no torch, no transformers).

The conversation rule. A conversation is its messages. Every turn, the side that owns the conversation renders
ALL of it with the checkpoint's template (`render_template`: jinja2's immutable sandbox set up as transformers'
``render_jinja_template``), encodes it as ``apply_chat_template(..., sanitize_control_tokens=True)`` does
(`encode_marked`), keeps the longest common prefix with the ids it already holds and prefills the rest
(`common_prefix`; on the wire: APPEND's ``keep``). The template is never cut into pieces with user text spliced
between, so what a real template does to history -- Gemma 4's large form renders an empty thought channel in the
generation prompt but not in a model turn of history, strips earlier thoughts (``strip_thinking``) and trims
user text and answers -- holds by construction.

User text stays text: a control-token string typed in a user (or system) message is spelled with ordinary tokens,
never turned into the control token (transformers' ``mark_control_tokens`` / ``encode_marked_chat``,
``utils/chat_template_utils.py``, reproduced with `tokenizers` only). The model's answer is held as the model's
ids: `Chat.answer_text` decodes it run by run, marks every control-token string inside the runs of ordinary ids
(what the model *wrote*, e.g. ``<``, ``|turn``, ``>`` spelling ``<|turn>``) as user text is marked, and leaves
each control id the model *emitted* (its thought channel's ``<|channel>`` ... ``<channel|>``) as its bare string,
so the template still sees, keeps or strips a real channel. An assistant message's content is therefore already
marked and `mark_messages` leaves it as it is; give history from elsewhere through `mark_answer` (all of it as
text). The ids equal transformers' ``apply_chat_template(..., sanitize_control_tokens=True)`` with the model's
control ids spliced back in place (tests/test_answer_ids.py); a model can no longer forge a turn by echoing
``<turn|>\n<|turn>system`` in text.

numpy-free and torch-free: the device runtime imports this module.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

#: transformers' private-use markers around a control token found in user text (chat_template_utils.py).
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"
#: Message roles whose strings a user writes (marked by `mark_messages`); an assistant's content comes marked
#: already (`Chat.answer_text`, `mark_answer`).
USER_ROLES = ("user", "system", "developer")


class ChatFormatError(ValueError):
    """A checkpoint's chat files cannot give hycoc a chat format; the message names the file and the fix."""


class ChatMismatch(ValueError):
    """The device's chat contract (stop ids, template) differs from the verifier's (wire code ``chat_mismatch``);
    the message names both."""

    code = "chat_mismatch"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class ChatFormat(_Model):
    """A checkpoint's chat format (module docstring): what the bundle's manifest carries as ``chat``.

    template: the chat template's text (jinja). specials: the special-token strings the template sees
    (``bos_token`` ...: tokenizer_config.json). has_thinking: whether ``enable_thinking=True`` renders a first turn
    differently from the template's default. stop_ids / stop_tokens: ``generation_config.json`` ``eos_token_id`` in
    file order, and their strings. control_tokens: the strings sanitized in user text (the tokenizer's special
    added tokens plus the added tokens the template's text contains, as transformers' ``_get_control_tokens``).
    reasoning: (open, close) strings of the answer's thought channel (transformers' response template for the model
    type), or None. template_sha256: sha256 of ``template``. sources: what each part came from (``template``,
    ``stop_ids``, ``reasoning`` -> a file path or a library name). files: sha256 of every file the format was read
    from, by ``ROLE/FILE`` (``"tokenizer/chat_template.jinja"``, `hycoc.chat_template.CHAT_FILES`), so a file that
    changes between the build and the server is named (`check_contract`); {} in a bundle of an older hycoc.
    """

    template: str = Field(min_length=1)
    specials: dict[str, str]
    has_thinking: bool
    stop_ids: list[int] = Field(min_length=1)
    stop_tokens: list[str]
    control_tokens: list[str]
    reasoning: list[str] | None = Field(None, min_length=2, max_length=2)
    template_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    sources: dict[str, str]
    files: dict[str, str] = Field(default_factory=dict)

    def check_thinking(self, thinking: bool) -> None:
        """Raise ChatFormatError when thinking is asked of a template that has no thinking switch."""
        if thinking and not self.has_thinking:
            raise ChatFormatError(
                f"the chat template ({self.sources.get('template', '?')}) renders "
                "enable_thinking=True like its default: it has no thinking switch; run without "
                "--thinking"
            )

    def contract(self) -> str:
        """What the device and the verifier must agree on, as canonical JSON (the OPEN frame's ``chat``): the stop
        ids (sorted), the template's sha256 (both sides render the same template) and, when known, the sha256 of
        each file the format was read from (``files``)."""
        body: dict[str, object] = {"stop_ids": sorted(self.stop_ids), "template_sha256": self.template_sha256}
        if self.files:
            body["files"] = dict(self.files)
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def check_contract(self, device: str) -> None:
        """Compare a device's `contract` JSON with this (the verifier's) format. Raises ChatMismatch naming what
        differs with both values, or that the contract is of an older hycoc (turn strings instead of the template).
        Hostile JSON is a ChatMismatch too, never another exception: a number out of range (``[1e999]``: int() of
        inf raises OverflowError) or nesting past Python's recursion limit (json raises RecursionError)."""
        try:
            theirs = json.loads(device)
            their_stops = sorted(int(i) for i in theirs["stop_ids"])
            their_template = str(theirs["template_sha256"])
        except (ValueError, KeyError, TypeError, OverflowError, RecursionError) as e:
            raise ChatMismatch(
                f"the device's chat contract is not this hycoc's ({e}: a bundle built before "
                "conversations were re-rendered by the template); rebuild the bundle with this "
                "hycoc (`hycoc build RECIPE`)"
            ) from None
        if their_stops != sorted(self.stop_ids):
            raise ChatMismatch(
                f"stop ids differ: the device's bundle stops on {their_stops}, the verifier on "
                f"{sorted(self.stop_ids)}; build the bundle from the verifier's checkpoint (same "
                "generation_config.json)"
            )
        if their_template != self.template_sha256:
            raise ChatMismatch(
                f"chat templates differ: the device's bundle renders with template sha256 "
                f"{their_template[:12]}..., the verifier with {self.template_sha256[:12]}... "
                f"({self.sources.get('template', '?')}); build the bundle from the verifier's "
                "tokenizer folder (same chat template)"
            )
        self._check_files(theirs.get("files") if isinstance(theirs, dict) else None)

    def _check_files(self, theirs) -> None:
        """Raise ChatMismatch naming the first file (``ROLE/FILE``) whose sha256 differs between the device's
        contract and this format, among those both name; a contract without ``files`` (an older bundle) passes."""
        if theirs is None or not self.files:
            return
        if not isinstance(theirs, dict) or not all(isinstance(v, str) for v in theirs.values()):
            raise ChatMismatch(
                "the device's chat contract's files are not a map of file to sha256; rebuild the bundle with "
                "this hycoc (`hycoc build RECIPE`)"
            )
        for label in sorted(set(theirs) & set(self.files)):
            if theirs[label] != self.files[label]:
                role, _, name = label.partition("/")
                raise ChatMismatch(
                    f"{name} of [models].{role} changed since the device's bundle was built (sha256 "
                    f"{str(theirs[label])[:12]}... in the bundle, {self.files[label][:12]}... here): rebuild the "
                    "bundle from these files (`hycoc build RECIPE`) or give the server the files the bundle was "
                    "built from"
                )


# ---- encoding, as transformers' apply_chat_template(..., sanitize_control_tokens=True) ----------------------------


@lru_cache(maxsize=16)
def _patterns(control_tokens: tuple[str, ...]) -> tuple[re.Pattern, re.Pattern]:
    longest_first = sorted(control_tokens, key=len, reverse=True)
    control = re.compile("|".join(map(re.escape, longest_first)) or "(?!)")
    markers = re.compile(f"{_MARK_START}({control.pattern}){_MARK_END}|[{_MARK_START}{_MARK_END}]")
    return control, markers


def mark_control_tokens(text: str, control_tokens) -> str:
    """``text`` with every control-token string wrapped in private-use markers (transformers'
    ``mark_control_tokens``; markers already in the text are dropped first so none can be forged)."""
    control, _ = _patterns(tuple(control_tokens))
    text = text.replace(_MARK_START, "").replace(_MARK_END, "")
    return control.sub(f"{_MARK_START}\\g<0>{_MARK_END}", text)


def _plain(tokenizer, text: str) -> list[int]:
    """``text`` through the tokenizer's pipeline without matching any added token (transformers'
    ``_encode_without_added_tokens``)."""
    if tokenizer.normalizer is not None:
        text = tokenizer.normalizer.normalize_str(text)
    splits = [text]
    if tokenizer.pre_tokenizer is not None:
        splits = [s for s, _ in tokenizer.pre_tokenizer.pre_tokenize_str(text)]
    return [t.id for s in splits for t in tokenizer.model.tokenize(s)]


def encode_marked(tokenizer, chat: str, control_tokens) -> list[int]:
    """Token ids of a rendered chat whose user strings went through `mark_control_tokens`: marked control tokens
    are encoded as plain text, everything else (the template's own control tokens included) normally; a lone
    marker breaks the text (transformers' ``encode_marked_chat``). tokenizer: a ``tokenizers.Tokenizer``.
    Raises ValueError when a marked token cannot be spelled without itself."""
    _, markers = _patterns(tuple(control_tokens))
    pieces = markers.split(chat)
    newline = tokenizer.encode("\n", add_special_tokens=False).ids
    ids = tokenizer.encode(pieces[0], add_special_tokens=False).ids
    for i, piece in enumerate(pieces[1:], start=1):
        if not piece:
            continue
        as_text = i % 2 == 1
        encode = (
            (lambda s: _plain(tokenizer, s))
            if as_text
            else (lambda s: tokenizer.encode(s, add_special_tokens=False).ids)
        )
        piece_ids = encode("\n" + piece)  # after a newline, as transformers does (no SentencePiece prefix space)
        piece_ids = piece_ids[len(newline) :] if piece_ids[: len(newline)] == newline else encode(piece)
        if as_text and tokenizer.token_to_id(piece) in piece_ids:
            raise ValueError(f"cannot sanitize {piece!r}: the tokenizer produces it from plain text")
        ids += piece_ids
    return ids


def encode_text(tokenizer, text: str) -> list[int]:
    """Token ids of ``text`` read as plain text with no template around it: a control-token string inside it is
    spelled with ordinary tokens (tokenizers' ``encode_special_tokens``). tokenizer: a `tokenizers.Tokenizer`."""
    before = tokenizer.encode_special_tokens
    tokenizer.encode_special_tokens = True
    try:
        return tokenizer.encode(text, add_special_tokens=False).ids
    finally:
        tokenizer.encode_special_tokens = before


# ---- rendering, as transformers' render_jinja_template ------------------------------------------------------------


@lru_cache(maxsize=8)
def _compiled(template: str):
    """The template compiled in jinja2's immutable sandbox with transformers' environment (``trim_blocks``,
    ``lstrip_blocks``, ``loopcontrols``, a ``{% generation %}`` block that renders its body, the ``tojson`` filter
    without HTML escaping, ``raise_exception``, ``strftime_now``; transformers 5.24
    ``_cached_compile_jinja_template``)."""
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # transformers' AssistantTracker, without the tracking
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def render_template(
    template: str,
    messages: list[dict],
    *,
    add_generation_prompt: bool,
    thinking: bool | None = None,
    specials: dict[str, str] | None = None,
    source: str = "the chat template",
) -> str:
    """The template's rendering of ``messages`` (list of {"role", "content"} dicts, strings as given: mark user
    strings first with `mark_messages` to sanitize them). thinking: ``enable_thinking`` (None leaves it unset: the
    template's default). specials: ``bos_token`` ... Raises ChatFormatError naming ``source`` when the template
    fails to render (a jinja2 error or its own ``raise_exception``)."""
    kwargs: dict[str, object] = dict(specials or {})
    if thinking is not None:
        kwargs["enable_thinking"] = thinking
    try:
        return _compiled(template).render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as e:  # noqa: BLE001 -- jinja2's errors and the template's raise_exception: a ChatFormatError
        roles = "/".join(str(m.get("role")) for m in messages)
        raise ChatFormatError(
            f"{source}: the chat template fails to render a {roles} conversation "
            f"({type(e).__name__}: {e}); fix the template or give a working one as "
            "chat_template.jinja"
        ) from None


def template_literals(template: str) -> str:
    """The template's literal strings (its raw text blocks and every string constant) joined with NUL characters,
    as transformers' ``_get_template_literal_text``: the added tokens found in it are control tokens."""
    import jinja2.nodes

    ast = _compiled(template).environment.parse(template)
    literals = {n.data for n in ast.find_all(jinja2.nodes.TemplateData)}
    literals |= {n.value for n in ast.find_all(jinja2.nodes.Const) if isinstance(n.value, str)}
    return "\0".join(sorted(literals))


def mark_messages(messages: list[dict], control_tokens) -> list[dict]:
    """``messages`` with every string of a user-written message (`USER_ROLES`) passed through
    `mark_control_tokens`; an assistant's content is left as it is: `Chat.answer_text` (or `mark_answer`) marked
    it already, keeping the model's own control ids bare (module docstring)."""
    out = []
    for m in messages:
        if m.get("role") in USER_ROLES:
            m = {
                k: (mark_control_tokens(v, control_tokens) if isinstance(v, str) and k != "role" else v)
                for k, v in m.items()
            }
        out.append(dict(m))
    return out


def mark_answer(text: str, control_tokens) -> str:
    """An assistant message's content from plain text (history that did not come from the model's ids): every
    control-token string in it is marked as text, as `mark_control_tokens` marks user text. Use
    `Chat.answer_text` for an answer the model emitted (its control ids stay control ids)."""
    return mark_control_tokens(text, control_tokens)


def common_prefix(a, b) -> int:
    """Length of the longest common prefix of two sequences (token ids, or strings)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def ids_crc32(ids) -> int:
    """crc32 (zlib) of token ids as little-endian int32: what APPEND's ``keep_crc`` carries for the kept prefix,
    so both sides check that they hold the same conversation."""
    import struct

    return zlib.crc32(struct.pack(f"<{len(ids)}i", *[int(i) for i in ids]))


@dataclass(frozen=True)
class Rendered:
    """A conversation rendered and encoded: ``ids`` (the template's rendering with the generation prompt; its last
    id is the first root of the answer) and ``anchor``, the position where the answer's model turn opens: the
    length of the ids both the rendering without the generation prompt and the one with it begin with, at most
    len(ids) - 1. A later turn's re-rendering keeps at least [0, anchor) with any template that renders history as
    it rendered it before (the verifier snapshots its sliding-window KV there, docs/serving.md "Conversations")."""

    ids: list[int]
    anchor: int


class Chat:
    """A `ChatFormat` with its tokenizer: the token ids of conversations, the stop ids and the thought split.

    fmt: the checkpoint's `ChatFormat`. tokenizer: the ``tokenizers.Tokenizer`` of the same checkpoint.
    """

    def __init__(self, fmt: ChatFormat, tokenizer):
        self.format, self.tokenizer = fmt, tokenizer
        self.stop_ids = frozenset(int(i) for i in fmt.stop_ids)
        control = set(fmt.control_tokens)
        #: id -> string of every added token that is a control token: what the model emits as a control id
        self.control_ids = {
            int(i): t.content for i, t in tokenizer.get_added_tokens_decoder().items() if t.content in control
        }
        self._reasoning_ids = None
        if fmt.reasoning is not None:
            opening, closing = fmt.reasoning
            self._reasoning_ids = (
                tokenizer.encode(opening, add_special_tokens=False).ids,
                tokenizer.encode(closing, add_special_tokens=False).ids,
            )

    def render_text(
        self, messages: list[dict], *, thinking: bool = False, add_generation_prompt: bool = True, marked: bool = True
    ) -> str:
        """The template's rendering of ``messages`` (user strings marked when ``marked``). Raises ChatFormatError
        for thinking without a switch, or a template that fails."""
        self.format.check_thinking(thinking)
        msgs = mark_messages(messages, self.format.control_tokens) if marked else messages
        return render_template(
            self.format.template,
            msgs,
            add_generation_prompt=add_generation_prompt,
            thinking=True if thinking else None,
            specials=self.format.specials,
            source=self.format.sources.get("template", "the chat template"),
        )

    def encode_rendered(self, text: str) -> list[int]:
        """Ids of a rendering made by `render_text` (marked control tokens as text)."""
        return encode_marked(self.tokenizer, text, self.format.control_tokens)

    def conversation(self, messages: list[dict], thinking: bool = False) -> Rendered:
        """The whole conversation ``messages`` (user, assistant, ..., ending with a user message) as the template
        renders it with the generation prompt, encoded as transformers' ``apply_chat_template(...,
        sanitize_control_tokens=True)`` (user strings; module docstring), and its `Rendered.anchor`."""
        ids = self.encode_rendered(self.render_text(messages, thinking=thinking))
        bare = self.encode_rendered(self.render_text(messages, thinking=thinking, add_generation_prompt=False))
        return Rendered(ids=ids, anchor=min(common_prefix(ids, bare), len(ids) - 1))

    def prompt(self, user_text: str, thinking: bool = False) -> list[int]:
        """Token ids of a conversation's first user turn, up to where the model's answer begins (the template's
        rendering of one user message with ``add_generation_prompt=True``). Raises ChatFormatError for --thinking
        without a switch."""
        return self.encode_rendered(self.render_text([{"role": "user", "content": user_text}], thinking=thinking))

    def answer_text(self, output_ids) -> str:
        """An answer as its assistant message's content, held as the model's ids (module docstring): the committed
        ids decoded (a trailing stop id dropped: the template closes the turn), each run of ordinary ids marked
        with `mark_control_tokens` (a control-token string the model wrote with ordinary tokens stays text) and
        each control id (`control_ids`: a thought channel's ``<|channel>`` ...) left as its bare string, for the
        template to keep or strip. output_ids: ints. Returns the marked string `Chat.conversation` renders."""
        ids = [int(i) for i in output_ids]
        if ids and ids[-1] in self.stop_ids:
            ids = ids[:-1]
        pieces = []
        for control, text in self._answer_pieces(ids):
            pieces.append(text if control else mark_control_tokens(text, self.format.control_tokens))
        return "".join(pieces)

    def _answer_pieces(self, ids: list[int]) -> list[tuple[bool, str]]:
        """(is a control id, text) pieces of ``ids`` in order: each control id alone, the ids between them as one
        piece. A run's text is the whole answer's decoding cut at the control ids (prefixes decoded), so the
        pieces join to ``decode(ids)``; a tokenizer whose prefix decodings are not prefixes of it (an unfinished
        UTF-8 character before a control id) gets each run decoded alone."""

        def decode(part):
            return self.tokenizer.decode(part, skip_special_tokens=False)

        cuts = [i for i, t in enumerate(ids) if t in self.control_ids]
        if not cuts:
            return [(False, decode(ids))] if ids else []
        out, start, before = [], 0, ""
        for end in [*cuts, len(ids)]:
            if end > start:
                upto = decode(ids[:end])
                out.append((False, upto[len(before) :] if upto.startswith(before) else decode(ids[start:end])))
            if end < len(ids):
                out.append((True, self.control_ids[ids[end]]))
                before, start = decode(ids[: end + 1]), end + 1
        return out

    def split_thought(self, answer_ids: list[int]) -> tuple[str | None, list[int]]:
        """(thought text or None, the final answer's ids) of an answer that may open with the reasoning channel
        (``reasoning`` open ... close). An answer cut inside its thought has an empty final answer."""
        if self._reasoning_ids is None:
            return None, list(answer_ids)
        opening, closing = self._reasoning_ids
        if list(answer_ids[: len(opening)]) != opening:
            return None, list(answer_ids)
        rest = list(answer_ids[len(opening) :])
        for i in range(len(rest) - len(closing) + 1):
            if rest[i : i + len(closing)] == closing:
                return self.tokenizer.decode(rest[:i]), rest[i + len(closing) :]
        return self.tokenizer.decode(rest), []

    def render(self, user_text: str, thinking: bool = False) -> str:
        """The first turn's string as the template renders it (control tokens as their strings), for display."""
        return self.render_text([{"role": "user", "content": user_text}], thinking=thinking, marked=False)


class Conversation:
    """One conversation's messages and the ids the session holds, for the side that owns it (``hycoc run --chat``,
    the bench's second turns): each turn renders the whole conversation (`Chat.conversation`) and the APPEND keeps
    the common prefix with what is held.

    chat: the checkpoint's `Chat`. thinking: ``enable_thinking`` for every turn. system: an optional system message.
    """

    def __init__(self, chat: Chat, thinking: bool = False, system: str | None = None):
        chat.format.check_thinking(thinking)
        self.chat, self.thinking = chat, thinking
        self.messages: list[dict] = [] if system is None else [{"role": "system", "content": system}]
        self.held: list[int] = []  # ids the session holds: the last rendering's kept part, then the output

    def ask(self, user_text: str) -> Rendered:
        """Add a user message; returns the whole conversation rendered (ids up to the new answer's first root)."""
        self.messages.append({"role": "user", "content": user_text})
        return self.chat.conversation(self.messages, self.thinking)

    def answered(self, rendered: Rendered, output_ids) -> None:
        """Record a finished turn: the session now holds ``rendered.ids`` then the committed ``output_ids``."""
        self.held = list(rendered.ids) + [int(i) for i in output_ids]
        self.messages.append({"role": "assistant", "content": self.chat.answer_text(output_ids)})


class AnswerStream:
    """Incremental detokenization of an answer that may open with the reasoning channel: `push` takes the newly
    committed ids and returns (new thought text, new answer text), holding back a trailing partial UTF-8 character
    and an unfinished channel opening; `flush` returns what is held at the end. The thought never reaches the
    answer text (`Chat.split_thought`)."""

    ids: list[int]

    def __init__(self, chat: Chat):
        self.chat, self.ids, self.sent = chat, [], ["", ""]

    def _texts(self) -> tuple[str, str]:
        thought, answer = self.chat.split_thought(self.ids)
        return thought or "", self.chat.tokenizer.decode(answer, skip_special_tokens=True)

    def _deltas(self, hold: bool) -> tuple[str, str]:
        out = []
        for k, text in enumerate(self._texts()):
            stable = text.rstrip("\ufffd") if hold else text
            sent = self.sent[k]
            out.append(stable[len(sent) :] if stable.startswith(sent) else "")
            if stable.startswith(sent):
                self.sent[k] = stable
        return out[0], out[1]

    def push(self, ids) -> tuple[str, str]:
        self.ids.extend(int(i) for i in ids)
        opening = self.chat._reasoning_ids[0] if self.chat._reasoning_ids else []
        if len(self.ids) < len(opening) and self.ids == opening[: len(self.ids)]:
            return "", ""  # maybe the channel's opening: wait for the rest
        return self._deltas(hold=True)

    def flush(self) -> tuple[str, str]:
        return self._deltas(hold=False)


def template_digest(template: str) -> str:
    """sha256 hex of a chat template's text."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


__all__ = [
    "USER_ROLES",
    "AnswerStream",
    "Chat",
    "ChatFormat",
    "ChatFormatError",
    "ChatMismatch",
    "Conversation",
    "Rendered",
    "common_prefix",
    "encode_marked",
    "encode_text",
    "ids_crc32",
    "mark_answer",
    "mark_control_tokens",
    "mark_messages",
    "render_template",
    "template_digest",
    "template_literals",
]
