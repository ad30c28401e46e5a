"""What `hycoc run` checks before it loads a bundle, and the line it prints after each answer. Imports neither torch
nor aiohttp (the device-runtime install has neither)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hycoc.ports import ws_url_problem


class RunOptionError(ValueError):
    """Options `hycoc run` cannot start with; ``code`` is the exit status (docs/commands.md "Exit codes": 2, the
    command line is wrong; 1, a file or folder it names is missing or bad)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def check_run_options(
    *,
    bundle: Path,
    server: str | None,
    prompt: str | None,
    prompt_file: Path | None,
    chat: bool,
    raw: bool,
    slm_alone: bool,
) -> None:
    """Raise `RunOptionError` for options that cannot go together or point nowhere, in the order a user fixes
    them, every usage error (code 2, the command line alone) before the filesystem is looked at: exactly one of
    ``prompt`` / ``prompt_file`` (neither is fine with ``chat``: the first turn is read from stdin); a ``prompt``
    given must hold more than white space; ``chat`` needs a verifier and the chat template (not ``slm_alone``, not
    ``raw``); ``server`` a ws:// or wss:// URL with a host and a port in 1-65535 unless ``slm_alone``
    (`hycoc.ports.ws_url_problem`); then ``prompt_file`` must be a file (code 1)
    and ``bundle`` a folder (code 1)."""
    if (prompt is not None and prompt_file is not None) or (not chat and prompt is None and prompt_file is None):
        raise RunOptionError("give exactly one of --prompt and --prompt-file")
    if prompt is not None and not prompt.strip():
        raise RunOptionError("--prompt is empty: give the text to answer (or --prompt-file FILE)")
    if chat and (slm_alone or raw):
        raise RunOptionError("--chat needs a verifier and the chat template: not with --mode slm-alone or --raw")
    if not slm_alone and server is None:
        raise RunOptionError("--server ws://HOST:PORT is required (except with --mode slm-alone)")
    problem = None if slm_alone or server is None else ws_url_problem(server)
    if problem is not None:
        raise RunOptionError(f"--server {server!r}: {problem}")
    if prompt_file is not None and not prompt_file.is_file():
        raise RunOptionError(f"--prompt-file {prompt_file}: no such file", code=1)
    if not bundle.is_dir():
        what = "is a file, not a bundle folder" if bundle.exists() else "no such folder"
        raise RunOptionError(
            f"bundle {bundle}: {what} (make one with `hycoc build RECIPE --target cpu --out DIR`)", code=1
        )


class AnswerPrinter:
    """Where `hycoc run` streams a turn: the thought (the reasoning channel) to ``err``, dimmed (ANSI faint) when
    ``err`` is a terminal, and the answer to ``out``, so stdout holds the answer text alone.
    ``show((thought, text))`` takes one `hycoc.chat.AnswerStream` piece pair; ``streamed`` says whether any answer
    text went out (an error then starts on a fresh line)."""

    def __init__(self, out=None, err=None):
        import sys

        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.streamed = False

    def show(self, pieces: tuple[str, str]) -> None:
        thought, text = pieces
        if thought:
            dim = self.err.isatty()
            self.err.write(("\x1b[2m" if dim else "") + thought + ("\x1b[0m" if dim else ""))
            self.err.flush()
        if text:
            self.streamed = True
            self.out.write(text)
            self.out.flush()


def htp_settings(
    backend: str,
    *,
    performance_mode: str | None = None,
    context_priority: str | None = None,
    finalization: str | None = None,
    rpc_latency_us: int | None = None,
):
    """The QNN session settings of ``hycoc run`` (`hycoc.runtime.htp_session.HtpSessionSettings`; docs/device-runtime.md
    "QNN session settings"): None (the defaults) for an htp run that names none of them and for any cpu run that
    names none; each option given replaces its default. Raises `RunOptionError` (code 2) for a value outside its
    choices (naming the option and the choices) and for an option given with a backend other than htp."""
    from hycoc.runtime.htp_session import HtpSessionSettings, HtpSettingError

    given = {
        "--htp-performance-mode": performance_mode,
        "--htp-context-priority": context_priority,
        "--htp-finalization": finalization,
        "--htp-rpc-latency-us": rpc_latency_us,
    }
    named = [k for k, v in given.items() if v is not None]
    if not named:
        return None
    if backend != "htp":
        raise RunOptionError(f"{', '.join(named)}: QNN session settings apply to --backend htp, not {backend}")
    fields: dict[str, Any] = {  # HtpSessionSettings' keyword arguments (a str or an int each)
        "performance_mode": performance_mode,
        "context_priority": context_priority,
        "finalization_mode": finalization,
        "rpc_control_latency_us": rpc_latency_us,
    }
    option = dict(zip(fields, given))
    try:
        return HtpSessionSettings(**{k: v for k, v in fields.items() if v is not None})
    except HtpSettingError as e:
        raise RunOptionError(f"{option[e.field]} {e.value!r}: {e.detail}") from None


def simulator_note(backend: str, device) -> str | None:
    """The line `hycoc run` prints before an htp run on the QNN HTP simulator, else None: ``device`` is the
    `hycoc.runtime.device_identity.DeviceIdentity` seen; on an x86 host (``device.simulator``) the HTP backend
    runs the context binaries on onnxruntime-qnn's HTP simulator, a functional emulator on the CPU, so the run is
    slow and its timings are not device time (docs/device-runtime.md). An x64 Python on ARM64 is refused by the
    bundle loader instead."""
    if backend != "htp" or not device.simulator:
        return None
    return (
        "note: --backend htp runs on the QNN HTP simulator here (this is an x86 host), a functional emulator on the "
        "CPU: slow, and its timings are not device time (a Snapdragon device runs the same bundle on its NPU)"
    )


def run_error(message: str) -> str:
    """The one line for a failed turn: the error's own message, with the fix for a server that wants a token."""
    if "auth_required" in message or "auth_refused" in message:
        message += " (hycoc run: set HYCOC_AUTH_TOKEN or pass --auth-token-file FILE)"
    return message


def summary_line(mode: str, metrics: dict, prefill_ms: float, finish_reason: str | None) -> str:
    """The one line `hycoc run` prints on stderr after an answer: ``metrics`` is `RunResult.to_json()`'s object
    (tokens, rounds, mat, tok_per_s, draft_ms_per_token, server_ms_per_token, first_token_ms)."""
    m = metrics
    return (
        f"[{mode}: {m['tokens']} tokens, {m['rounds']} rounds, MAT {m['mat']:.2f}, {m['tok_per_s']:.1f} tok/s, "
        f"draft {m['draft_ms_per_token']:.1f} ms/token, server {m['server_ms_per_token']:.1f} ms/token, first "
        f"token {m['first_token_ms']} ms, prefill {prefill_ms:.1f} ms, {finish_reason}]"
    )


__all__ = [
    "AnswerPrinter",
    "RunOptionError",
    "check_run_options",
    "htp_settings",
    "run_error",
    "simulator_note",
    "summary_line",
]
