"""`hycoc run` once its options are checked (`hycoc.run_options`): the bundle loaded, the conversation's turns on one
verifier session (`hycoc.runtime.chat_session.ChatSession`), each answer streamed as it is committed and followed by
its JSON line or its empty line, and the summary line on stderr. Imports neither torch nor aiohttp (the
device-runtime install has neither): the runtime is imported inside `run_device`."""

from __future__ import annotations

import io
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hycoc.runtime.htp_session import HtpSessionSettings

#: What ends each answer on stdout in a --chat conversation without --json: an empty line after the answer, as
#: `transformers chat` prints one after each reply (transformers/cli/chat.py); a one-shot run's answer ends with
#: its newline alone. With --json stdout holds one JSON object per line and nothing else.
TURN_END = "\n"


class RunFailed(RuntimeError):
    """`hycoc run` cannot go on: the message is the one line it prints after ``hycoc run: ``, ``code`` its exit
    status (1: the bundle, the prompt or a turn failed)."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class RunPlan:
    """What `hycoc run` was asked for, checked. bundle: the bundle folder; backend: htp or cpu; threads: CPU intra-op
    threads per graph session (None: the runtime's default); htp: the QNN session settings
    (`hycoc.run_options.htp_settings`, None: the defaults); text: the first user message; raw: send it without
    the chat template; thinking: the template's enable_thinking; mode: a Table 5 run mode; server: the verifier's
    ws:// URL (None for slm-alone); timeout_s: seconds to wait for the server's answers; max_new_tokens, seed,
    temperature, epsilon: the request's settings (None: the bundle's); json_out: stdout holds one JSON line per
    answer; chat: every line on stdin after the first answer is the next user turn."""

    bundle: Path
    backend: str
    threads: int | None
    htp: HtpSessionSettings | None
    text: str
    raw: bool
    thinking: bool
    mode: str
    server: str | None
    timeout_s: float
    max_new_tokens: int | None
    seed: int | None
    temperature: float | None
    epsilon: float | None
    json_out: bool
    chat: bool


def ask_user() -> str | None:
    """The next user turn from stdin, after a ``> `` prompt on stderr; None at an empty line or the end of input."""
    sys.stderr.write("> ")
    sys.stderr.flush()
    line = sys.stdin.readline()
    return line.rstrip("\n") if line.strip() else None


def _say(line: str) -> None:
    """One line on stderr."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _load(plan: RunPlan):
    """The bundle's `DeviceRuntime` on ``plan.backend``, then, for htp, the simulator note (after the bundle
    loader's checks: a refused bundle gets its one line alone). Raises RunFailed."""
    from hycoc.bundle import BundleError
    from hycoc.run_options import simulator_note
    from hycoc.runtime.client import load_runtime
    from hycoc.runtime.graphs import GraphRunError
    from hycoc.targets.qnn_ep import QnnUnavailableError

    try:
        rt = load_runtime(plan.bundle, plan.backend, threads=plan.threads, htp=plan.htp)
    except (BundleError, GraphRunError, QnnUnavailableError, ValueError) as e:
        raise RunFailed(str(e)) from None
    if plan.backend == "htp":
        from hycoc.runtime.device_identity import detect_device

        try:
            note = simulator_note(plan.backend, detect_device())
        except ValueError:  # a bad HYCOC_DEVICE: the bundle loader names it
            note = None
        if note:
            _say(f"hycoc run: {note}")
    return rt


class _Answers:
    """Where each answer goes: its text to stdout, or with --json to a terminal's stderr or nowhere (stdout then
    carries the JSON lines alone), the thought to stderr (`hycoc.run_options.AnswerPrinter`); after each answer its
    newline, its JSON line or (--chat) `TURN_END`, and the summary line on stderr."""

    def __init__(self, plan: RunPlan):
        from hycoc.run_options import AnswerPrinter

        self.plan = plan
        self.text_out = sys.stdout if not plan.json_out else sys.stderr if sys.stderr.isatty() else io.StringIO()
        self.printer = AnswerPrinter(out=self.text_out)

    def failed(self, message: str) -> RunFailed:
        """The error of a failed turn (`hycoc.run_options.run_error`), after ending a streamed answer's line."""
        from hycoc.run_options import run_error

        if self.printer.streamed:
            self.text_out.write("\n")
            self.text_out.flush()
        return RunFailed(run_error(message))

    def done(self, res) -> None:
        from hycoc.run_options import summary_line

        self.text_out.write("\n")
        self.text_out.flush()
        m = res.to_json()
        if self.plan.json_out:
            sys.stdout.write(json.dumps(m) + "\n")
        elif self.plan.chat:
            sys.stdout.write(TURN_END)
        sys.stdout.flush()
        _say(summary_line(self.plan.mode, m, res.prefill_ms, res.finish_reason))


def run_device(plan: RunPlan, auth_token: Callable[[], str | None]) -> None:
    """Answer ``plan.text`` and, with ``plan.chat``, every next line on stdin on the same session (module
    docstring). ``auth_token`` is called once, after the bundle is loaded and the prompt encoded (its warning and
    its errors come after theirs). Raises RunFailed: the bundle refused, the prompt not encodable or no tokens, a
    turn failed (the client closed first)."""
    from hycoc.chat import ChatFormatError
    from hycoc.runtime.chat_session import TURN_ERRORS, ChatSession, TurnSettings
    from hycoc.runtime.transport import VerifierClient

    rt = _load(plan)
    sampling = rt.bundle.round.sampling
    if plan.temperature is not None:
        sampling = replace(sampling, temperature=plan.temperature)
    settings = TurnSettings(plan.mode, plan.max_new_tokens, plan.seed, sampling, plan.epsilon, keep_open=plan.chat)
    session = ChatSession(rt, settings)
    try:  # the whole conversation, rendered by the checkpoint's template every turn (docs/serving.md)
        ids = session.start(plan.text, raw=plan.raw, thinking=plan.thinking)
    except ChatFormatError as e:
        raise RunFailed(f"bundle {plan.bundle}: {e}") from None
    if not ids:
        raise RunFailed("the prompt encodes to no tokens")
    token = auth_token()
    client: VerifierClient | None = None
    if plan.mode != "slm-alone" and plan.server is not None:  # check_run_options: only slm-alone has no --server
        client = VerifierClient(plan.server, token, timeout_s=plan.timeout_s)
    answers = _Answers(plan)
    text: str | None = None
    while True:  # every turn labelled on stderr with --chat, the first too; the answers on stdout stay plain text
        if plan.chat:
            _say(f"-- turn {session.turns + 1} --")
        try:
            res = session.turn(client, answers.printer.show, text)
        except TURN_ERRORS as e:
            failed = answers.failed(str(e))
            if client is not None:
                client.close()
            raise failed from None
        answers.done(res)
        if not plan.chat or (text := ask_user()) is None:
            break
    if plan.chat and client is not None:
        client.close()


__all__ = ["TURN_END", "RunFailed", "RunPlan", "ask_user", "run_device"]
