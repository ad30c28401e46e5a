"""One conversation of the device runtime on one verifier session (``hycoc run``, one-shot or ``--chat``): the
first user message as ids, raw or the checkpoint's chat template rendering the conversation (`hycoc.chat.Conversation`),
then one request per turn: the first an OPEN (`DeviceRuntime.generate`, Alg. 1 each round), each later one an
APPEND of the whole conversation re-rendered on the same session (`DeviceRuntime.next_turn`; docs/serving.md). Each
turn's committed ids are split into the thought and the answer as they come (`hycoc.chat.AnswerStream`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from hycoc.runtime.client import DeviceRuntime, RuntimeProtocolError
from hycoc.runtime.graphs import GraphRunError
from hycoc.runtime.mtp_drafter import HandoffError
from hycoc.runtime.result import RequestResult
from hycoc.runtime.transport import TransportError, VerifierClient

from hycoc.bundle import BundleError
from hycoc.chat import AnswerStream, ChatFormatError, ChatMismatch, Conversation, Rendered
from hycoc.protocol.messages import Sampling

#: What a turn raises when the server, the link, the bundle's graphs or the chat format fail (each message one line).
TURN_ERRORS: tuple[type[Exception], ...] = (
    TransportError,
    HandoffError,
    RuntimeProtocolError,
    GraphRunError,
    BundleError,
    ChatMismatch,
    ChatFormatError,
)


@dataclass(frozen=True)
class TurnSettings:
    """What every request of the conversation asks for (`DeviceRuntime.generate`'s arguments): mode, a Table 5
    run mode; max_new_tokens, the output cap in tokens (None: the bundle's); seed (None: the bundle's); sampling,
    the verifier's sampling settings; epsilon of epsilon-threshold acceptance (None: the bundle's); keep_open:
    the session stays open after the first answer for the next turns (``--chat``)."""

    mode: str
    max_new_tokens: int | None
    seed: int | None
    sampling: Sampling
    epsilon: float | None
    keep_open: bool


class ChatSession:
    """The turns of one conversation with ``runtime`` (a loaded `DeviceRuntime`). `start` encodes the first user
    message; `turn` answers it, then each next message, on one verifier session."""

    def __init__(self, runtime: DeviceRuntime, settings: TurnSettings):
        self.runtime, self.settings = runtime, settings
        self.conversation: Conversation | None = None
        self.rendered: Rendered | None = None
        self.ids: list[int] = []
        self.turns = 0

    def start(self, text: str, *, raw: bool, thinking: bool) -> list[int]:
        """The first user message as ids: ``text`` tokenized as is (``raw``), else the whole conversation rendered
        by the checkpoint's template with ``thinking`` as its enable_thinking. Raises ChatFormatError (a bundle
        whose chat format cannot render it, thinking asked of a template without it)."""
        if raw:
            self.ids = self.runtime.bundle.tokenizer.encode(text, add_special_tokens=False).ids
        else:
            self.conversation = Conversation(self.runtime.bundle.chat, thinking)
            self.rendered = self.conversation.ask(text)
            self.ids = self.rendered.ids
        return self.ids

    def turn(
        self, client: VerifierClient | None, show: Callable[[tuple[str, str]], None], text: str | None = None
    ) -> RequestResult:
        """One turn on ``client`` (None for slm-alone): the first answers the `start` message (``text`` unused),
        each later one the next user message ``text`` (the conversation re-rendered: the APPEND keeps what both
        sides hold of it). ``show`` gets each (thought, answer) text piece as it is committed, the last one
        flushed. Raises one of `TURN_ERRORS`; ValueError for a later turn of a raw conversation."""
        answer = AnswerStream(self.runtime.bundle.chat)

        def on_tokens(new: list[int]) -> None:
            show(answer.push(new))

        s = self.settings
        if self.turns == 0:
            res = self.runtime.generate(
                client,
                self.ids,
                mode=s.mode,
                max_new_tokens=s.max_new_tokens,
                seed=s.seed,
                sampling=s.sampling,
                epsilon=s.epsilon,
                on_tokens=on_tokens,
                keep_open=s.keep_open,
                anchor=self.rendered.anchor if self.rendered is not None else 0,
            )
        else:
            if self.conversation is None or text is None:
                raise ValueError("a next turn needs the chat template (not raw ids) and the user's message")
            self.rendered = rendered = self.conversation.ask(text)
            res = self.runtime.next_turn(
                client, rendered.ids, anchor=rendered.anchor, max_new_tokens=s.max_new_tokens, on_tokens=on_tokens
            )
        show(answer.flush())
        if self.conversation is not None and self.rendered is not None:
            self.conversation.answered(self.rendered, res.tokens)
        self.turns += 1
        return res


__all__ = ["TURN_ERRORS", "ChatSession", "TurnSettings"]
