"""The checkpoint's chat format as the device runtime and every host command use it (docs/recipes.md "Chat format").

Nothing here knows a model family's markers. A `ChatFormat` is read from a checkpoint by
`hycoc.chat_template.load_chat_format` (the tokenizer folder's own chat template, rendered by transformers' template
machinery, and ``generation_config.json``'s ``eos_token_id``), carried in the device bundle's manifest (``chat``),
and used here without transformers or jinja2: the device renders a turn from the template's own strings around the
user's text and encodes it as transformers' ``apply_chat_template(..., sanitize_control_tokens=True)`` does.

The template is cut into three strings (`TurnPieces`), found by rendering conversations with sentinel messages::

    first     before the first user message            Gemma 4: "<bos><|turn>user\\n"
    user_end  after a user message, up to the answer   Gemma 4: "<turn|>\\n<|turn>model\\n"
    next      after a model answer, up to the next     Gemma 4: "<turn|>\\n<|turn>user\\n"
              user message (the answer's stop token, if it ended on one, is not part of the conversation)

so a conversation's tokens are ``prompt(u1) + answer1 + next_turn(u2) + answer2 + ...``, exactly the template's
rendering of the whole conversation (re-encoded answers aside). One set of pieces per thinking setting
(``default``: the template's own default; ``thinking``: ``enable_thinking=True``).

User text stays text: a control-token string typed by a user (``<turn|>``, ``<bos>``) is spelled with ordinary
tokens, never turned into the control token (transformers' ``mark_control_tokens`` / ``encode_marked_chat``,
``utils/chat_template_utils.py``, reproduced with `tokenizers` only).

numpy-free and torch-free: the device runtime imports this module.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field

#: transformers' private-use markers around a control token found in user text (chat_template_utils.py).
_MARK_START, _MARK_END = "\U000f0000", "\U000f0001"
THINKING_SETTINGS = ("default", "thinking")


class ChatFormatError(ValueError):
    """A checkpoint's chat files cannot give hycoc a chat format; the message names the file and the fix."""


class ChatMismatch(ValueError):
    """The device's chat contract (stop ids, turn strings) differs from the verifier's (wire code
    ``chat_mismatch``); the message names both."""

    code = "chat_mismatch"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class TurnPieces(_Model):
    """The template's strings around user messages for one thinking setting (module docstring)."""

    first: str = Field(description="rendered before the first user message (bos, system turn, user opening)")
    user_end: str = Field(description="after a user message, up to where the model's answer begins")
    next: str = Field(description="after a model answer (its stop token dropped), up to the next user message")


class ChatFormat(_Model):
    """A checkpoint's chat format (module docstring): what the bundle's manifest carries as ``chat``.

    stop_ids / stop_tokens: ``generation_config.json`` ``eos_token_id`` in file order, and their strings.
    control_tokens: the strings sanitized in user text (the tokenizer's special added tokens plus the added tokens
    the template's text contains, as transformers' ``_get_control_tokens``). turns: thinking setting -> pieces.
    reasoning: (open, close) strings of the answer's thought channel (transformers' response template for the
    model type), or None when the checkpoint defines none. template_sha256: sha256 of the template text.
    sources: what each part came from: ``template``, ``stop_ids``, ``reasoning`` -> a file path or a library name.
    """

    stop_ids: list[int] = Field(min_length=1)
    stop_tokens: list[str]
    control_tokens: list[str]
    turns: dict[str, TurnPieces]
    reasoning: list[str] | None = Field(None, min_length=2, max_length=2)
    template_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    sources: dict[str, str]

    @property
    def has_thinking(self) -> bool:
        """Whether the template renders ``enable_thinking=True`` differently from its default."""
        return "thinking" in self.turns

    def pieces(self, thinking: bool = False) -> TurnPieces:
        """The turn pieces of a thinking setting. Raises ChatFormatError when thinking is asked of a template
        that has no thinking switch."""
        if thinking and not self.has_thinking:
            raise ChatFormatError(f"the chat template ({self.sources.get('template', '?')}) renders "
                                  "enable_thinking=True like its default: it has no thinking switch; run without "
                                  "--thinking")
        return self.turns["thinking" if thinking else "default"]

    def contract(self) -> str:
        """What the device and the verifier must agree on, as canonical JSON (the OPEN frame's ``chat``): the stop
        ids (sorted) and every turn piece."""
        body = {"stop_ids": sorted(self.stop_ids),
                "turns": {k: v.model_dump() for k, v in sorted(self.turns.items())}}
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    def check_contract(self, device: str) -> None:
        """Compare a device's `contract` JSON with this (the verifier's) format. Raises ChatMismatch naming what
        differs with both values; ValueError (as ChatMismatch) when it is not valid contract JSON."""
        try:
            theirs = json.loads(device)
            their_stops, their_turns = sorted(int(i) for i in theirs["stop_ids"]), dict(theirs["turns"])
        except (ValueError, KeyError, TypeError) as e:
            raise ChatMismatch(f"the device's chat contract is not valid ({e}); rebuild the bundle with this "
                               "hycoc") from None
        mine = json.loads(self.contract())
        if their_stops != mine["stop_ids"]:
            raise ChatMismatch(f"stop ids differ: the device's bundle stops on {their_stops}, the verifier on "
                               f"{mine['stop_ids']}; build the bundle from the verifier's checkpoint (same "
                               "generation_config.json)")
        for setting in sorted(set(their_turns) | set(mine["turns"])):
            a, b = their_turns.get(setting), mine["turns"].get(setting)
            if a != b:
                raise ChatMismatch(f"turn tokens ({setting}) differ: the device's bundle renders "
                                   f"{json.dumps(a, ensure_ascii=False)}, the verifier "
                                   f"{json.dumps(b, ensure_ascii=False)}; build the bundle from the verifier's "
                                   "tokenizer folder (same chat template)")


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
        encode = (lambda s: _plain(tokenizer, s)) if as_text else (
            lambda s: tokenizer.encode(s, add_special_tokens=False).ids)
        piece_ids = encode("\n" + piece)      # after a newline, as transformers does (no SentencePiece prefix space)
        piece_ids = piece_ids[len(newline):] if piece_ids[:len(newline)] == newline else encode(piece)
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


class Chat:
    """A `ChatFormat` with its tokenizer: the token ids of turns, the stop ids and the thought split.

    fmt: the checkpoint's `ChatFormat`. tokenizer: the ``tokenizers.Tokenizer`` of the same checkpoint.
    """

    def __init__(self, fmt: ChatFormat, tokenizer):
        self.format, self.tokenizer = fmt, tokenizer
        self.stop_ids = frozenset(int(i) for i in fmt.stop_ids)
        self._reasoning_ids = None
        if fmt.reasoning is not None:
            opening, closing = fmt.reasoning
            self._reasoning_ids = (tokenizer.encode(opening, add_special_tokens=False).ids,
                                   tokenizer.encode(closing, add_special_tokens=False).ids)

    def _encode(self, before: str, user_text: str, after: str) -> list[int]:
        marked = mark_control_tokens(user_text, self.format.control_tokens)
        return encode_marked(self.tokenizer, before + marked + after, self.format.control_tokens)

    def prompt(self, user_text: str, thinking: bool = False) -> list[int]:
        """Token ids of a conversation's first user turn, up to where the model's answer begins (the template's
        rendering with ``add_generation_prompt=True``). Raises ChatFormatError for --thinking without a switch."""
        p = self.format.pieces(thinking)
        return self._encode(p.first, user_text, p.user_end)

    def next_turn(self, user_text: str, thinking: bool = False) -> list[int]:
        """Token ids that follow a committed answer (its stop token dropped: `conversation_tokens`) with the next
        user message, up to where the next answer begins: the template's close of a model turn, the user turn and
        the generation prompt. What the APPEND frame carries."""
        p = self.format.pieces(thinking)
        return self._encode(p.next, user_text, p.user_end)

    def conversation_tokens(self, tokens: list[int]) -> list[int]:
        """A finished turn's tokens as the conversation keeps them: a trailing stop id is dropped (the template
        closes the model turn itself, in `next_turn`; a Gemma answer may stop on ``<eos>`` mid-conversation)."""
        return tokens[:-1] if tokens and tokens[-1] in self.stop_ids else list(tokens)

    def split_thought(self, answer_ids: list[int]) -> tuple[str | None, list[int]]:
        """(thought text or None, the final answer's ids) of an answer that may open with the reasoning channel
        (``reasoning`` open ... close). An answer cut inside its thought has an empty final answer."""
        if self._reasoning_ids is None:
            return None, list(answer_ids)
        opening, closing = self._reasoning_ids
        if list(answer_ids[:len(opening)]) != opening:
            return None, list(answer_ids)
        rest = list(answer_ids[len(opening):])
        for i in range(len(rest) - len(closing) + 1):
            if rest[i:i + len(closing)] == closing:
                return self.tokenizer.decode(rest[:i]), rest[i + len(closing):]
        return self.tokenizer.decode(rest), []

    def render(self, user_text: str, thinking: bool = False) -> str:
        """The first turn's string as the template renders it (control tokens as their strings), for display."""
        p = self.format.pieces(thinking)
        return p.first + user_text + p.user_end


class AnswerStream:
    """Incremental detokenization of an answer that may open with the reasoning channel: `push` takes the newly
    committed ids and returns (new thought text, new answer text), holding back a trailing partial UTF-8 character
    and an unfinished channel opening; `flush` returns what is held at the end. The thought never reaches the
    answer text (`Chat.split_thought`)."""

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
            out.append(stable[len(sent):] if stable.startswith(sent) else "")
            if stable.startswith(sent):
                self.sent[k] = stable
        return out[0], out[1]

    def push(self, ids) -> tuple[str, str]:
        self.ids.extend(int(i) for i in ids)
        opening = self.chat._reasoning_ids[0] if self.chat._reasoning_ids else []
        if len(self.ids) < len(opening) and self.ids == opening[:len(self.ids)]:
            return "", ""                              # maybe the channel's opening: wait for the rest
        return self._deltas(hold=True)

    def flush(self) -> tuple[str, str]:
        return self._deltas(hold=False)


def template_digest(template: str) -> str:
    """sha256 hex of a chat template's text."""
    return hashlib.sha256(template.encode("utf-8")).hexdigest()


__all__ = ["THINKING_SETTINGS", "AnswerStream", "Chat", "ChatFormat", "ChatFormatError", "ChatMismatch", "TurnPieces",
           "encode_marked", "encode_text", "mark_control_tokens", "template_digest"]
