"""``hycoc run``: the device runtime against a verifier server. Imports neither torch nor aiohttp (the
device-runtime install has neither); the runtime is imported inside the command body."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import typer

from hycoc.cli._common import AUTH_TOKEN_HELP, Backend, RunMode, _auth_token, _bundle_backend, _fail
from hycoc.runtime.result import JSON_KEYS  # standard library only: the keys the --json object has

#: What ends each answer on stdout in a --chat conversation without --json: an empty line after the answer, as
#: `transformers chat` prints one after each reply (transformers/cli/chat.py); a one-shot run's answer ends with
#: its newline alone. With --json stdout holds one JSON object per line and nothing else.
TURN_END = "\n"


def run(
    ctx: typer.Context,
    bundle: Path = typer.Argument(
        ..., metavar="BUNDLE", help="bundle folder made by `hycoc build`", show_default=False
    ),
    server: str | None = typer.Option(
        None,
        metavar="URL",
        help="verifier address, ws://HOST:PORT (not needed for --mode slm-alone)",
        show_default=False,
    ),
    prompt: str | None = typer.Option(None, help="user message (wrapped in the chat template)", show_default=False),
    prompt_file: Path | None = typer.Option(None, help="read the user message from this file", show_default=False),
    max_new_tokens: int | None = typer.Option(
        None, min=1, help="output cap in tokens (default: the bundle's sampling.max_new_tokens)", show_default=False
    ),
    mode: RunMode = typer.Option(
        RunMode("hyco"),
        help="drafting and acceptance: hyco (epsilon), hyco-exact, hyco-2p (two SLM passes), "
        "specedge (SLM-only tree), server-head, slm-alone (paper Table 5)",
    ),
    backend: Backend | None = typer.Option(
        None,
        help="htp = QNN EP context binaries (on x86: the QNN HTP simulator, slow, not device time; a note says "
        "so), cpu = CPU EP (default: the bundle's target)",
        show_default=False,
    ),
    seed: int | None = typer.Option(None, min=0, help="sampling seed (default: the bundle's)", show_default=False),
    temperature: float | None = typer.Option(
        None, min=0.0, help="verifier sampling temperature, 0 = greedy (default: the bundle's)", show_default=False
    ),
    epsilon: float | None = typer.Option(
        None,
        min=0.0,
        max=1.0,
        help="epsilon of epsilon-threshold acceptance (default: the bundle's)",
        show_default=False,
    ),
    json_out: bool = typer.Option(
        False,
        "--json",
        help="stdout holds JSON lines only, one object per answer (its text and metrics), for jq and scripts; "
        "the answer text then streams to stderr when stderr is a terminal, else it is not streamed",
    ),
    raw: bool = typer.Option(False, "--raw", help="send the prompt as is, without the chat template"),
    chat: bool = typer.Option(
        False,
        "--chat",
        help="a conversation on one session: after the first answer, every line on stdin is the "
        "next user turn (the verifier keeps the KV, the SLM ring continues); an empty line or end of input ends "
        "it. Without --prompt / --prompt-file the first turn is read from stdin too. On stdout each answer ends "
        "with an empty line (with --json: one JSON line per answer, no empty line)",
    ),
    thinking: bool = typer.Option(
        False,
        "--thinking",
        help="let the model think first (the chat template's enable_thinking); the thought "
        "streams to stderr, apart from the answer on stdout",
    ),
    threads: int | None = typer.Option(
        None,
        min=0,
        help="CPU intra-op threads per graph session (cpu backend; "
        "default 1, no spinning; 0 = onnxruntime's default pool)",
        show_default=False,
    ),
    htp_performance_mode: str | None = typer.Option(
        None,
        metavar="MODE",
        help="htp: the QNN HTP performance mode (burst, sustained_high_performance, high_performance, balanced, "
        "default, low_balanced, high_power_saver, power_saver, low_power_saver, extreme_power_saver; default burst, "
        "as Qualcomm's Genie runs)",
        show_default=False,
    ),
    htp_context_priority: str | None = typer.Option(
        None,
        metavar="PRIORITY",
        help="htp: the QNN context priority (low, normal, normal_high, high; default normal)",
        show_default=False,
    ),
    htp_finalization: str | None = typer.Option(
        None,
        metavar="0-3",
        help="htp: the QNN graph finalization optimization mode (0-3; default the bundle's target profile; a "
        "bundle's graphs were finalized at build, so it affects only graphs the EP prepares itself)",
        show_default=False,
    ),
    htp_rpc_latency_us: int | None = typer.Option(
        None,
        metavar="US",
        help="htp: the QNN RPC control latency in microseconds (0 = not set; default 100, as Genie's configs)",
        show_default=False,
    ),
    auth_token: str | None = typer.Option(
        None, envvar="HYCOC_AUTH_TOKEN", help=f"token the server requires; {AUTH_TOKEN_HELP}", show_default=False
    ),
    auth_token_file: Path | None = typer.Option(
        None, help="read the token the server requires from this file (one line)", show_default=False
    ),
    timeout: float = typer.Option(120.0, min=1.0, help="seconds to wait for the server's answers"),
) -> None:
    """Device runtime: draft hybrid trees against a verifier server and stream the answer (Alg. 1-3).

    The text streams to stdout as it is committed; a one-line summary goes to stderr. --json: stdout has one JSON
    object per answer and nothing else ({keys}); the text streams to stderr if that is a terminal, else not at all.
    """
    from hycoc.run_options import (
        AnswerPrinter,
        RunOptionError,
        check_run_options,
        htp_settings,
        run_error,
        simulator_note,
        summary_line,
    )

    try:
        check_run_options(
            bundle=bundle,
            server=server,
            prompt=prompt,
            prompt_file=prompt_file,
            chat=chat,
            raw=raw,
            slm_alone=mode == RunMode("slm-alone"),
        )
    except RunOptionError as e:
        raise _fail("run", str(e), code=e.code) from None
    import json
    from dataclasses import replace

    from hycoc.bundle import BundleError
    from hycoc.runtime.client import RuntimeProtocolError, load_runtime
    from hycoc.runtime.graphs import GraphRunError
    from hycoc.runtime.mtp_drafter import HandoffError
    from hycoc.runtime.transport import TransportError, VerifierClient
    from hycoc.targets.qnn_ep import QnnUnavailableError

    def ask() -> str | None:
        """The next user turn from stdin; None at an empty line or the end of input."""
        sys.stderr.write("> ")
        sys.stderr.flush()
        line = sys.stdin.readline()
        return line.rstrip("\n") if line.strip() else None

    text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8") if prompt_file else None
    if text is None and (text := ask()) is None:
        raise _fail("run", "no user message on stdin")
    backend_name = _bundle_backend(bundle, backend)
    try:
        htp = htp_settings(
            backend_name,
            performance_mode=htp_performance_mode,
            context_priority=htp_context_priority,
            finalization=htp_finalization,
            rpc_latency_us=htp_rpc_latency_us,
        )
    except RunOptionError as e:
        raise _fail("run", str(e), code=e.code) from None
    try:
        rt = load_runtime(bundle, backend_name, threads=threads, htp=htp)
    except (BundleError, GraphRunError, QnnUnavailableError, ValueError) as e:
        raise _fail("run", str(e)) from None
    if backend_name == "htp":  # after the bundle loader's checks: a refused bundle gets its one line alone
        from hycoc.runtime.device_identity import detect_device

        try:
            note = simulator_note(backend_name, detect_device())
        except ValueError:  # a bad HYCOC_DEVICE: the bundle loader names it
            note = None
        if note:
            typer.echo(f"hycoc run: {note}", err=True)
    from hycoc.chat import AnswerStream, ChatFormatError, ChatMismatch, Conversation

    tok, chat_format = rt.bundle.tokenizer, rt.bundle.chat
    conversation = rendered = None
    try:
        if raw:
            ids = tok.encode(text, add_special_tokens=False).ids
        else:  # the whole conversation, rendered by the checkpoint's template every turn (docs/serving.md)
            conversation = Conversation(chat_format, thinking)
            rendered = conversation.ask(text)
            ids = rendered.ids
    except ChatFormatError as e:
        raise _fail("run", f"bundle {bundle}: {e}") from None
    if not ids:
        raise _fail("run", "the prompt encodes to no tokens")
    r = rt.bundle.round
    sampling = r.sampling if temperature is None else replace(r.sampling, temperature=temperature)
    auth_token = _auth_token("run", ctx, auth_token, auth_token_file)
    client: VerifierClient | None = None
    if mode != RunMode("slm-alone") and server is not None:  # check_run_options: only slm-alone has no --server
        client = VerifierClient(server, auth_token, timeout_s=timeout)

    # --json: stdout carries JSON lines alone; the text streams to a terminal's stderr or nowhere
    text_out = sys.stdout if not json_out else sys.stderr if sys.stderr.isatty() else io.StringIO()
    printer = AnswerPrinter(out=text_out)
    answer = AnswerStream(chat_format)

    def turn(first: bool, text: str | None = None):
        """One turn: the request (first) or the next user turn on the same session (the whole conversation
        re-rendered: the APPEND keeps what both sides hold of it); prints its metrics."""
        nonlocal answer, rendered
        answer = AnswerStream(chat_format)

        def on_tokens(new):
            return printer.show(answer.push(new))

        try:
            if first:
                res = rt.generate(
                    client,
                    ids,
                    mode=mode.value,
                    max_new_tokens=max_new_tokens,
                    seed=seed,
                    sampling=sampling,
                    epsilon=epsilon,
                    on_tokens=on_tokens,
                    keep_open=chat,
                    anchor=rendered.anchor if rendered is not None else 0,
                )
            else:
                if conversation is None or text is None:  # never: --chat refuses --raw; turn(False, text) has text
                    raise RuntimeError("a next turn needs the conversation of --chat and its text")
                rendered = conversation.ask(text)
                res = rt.next_turn(
                    client, rendered.ids, anchor=rendered.anchor, max_new_tokens=max_new_tokens, on_tokens=on_tokens
                )
            printer.show(answer.flush())
            if conversation is not None and rendered is not None:  # rendered: by the conversation, each turn
                conversation.answered(rendered, res.tokens)
        except (
            TransportError,
            HandoffError,
            RuntimeProtocolError,
            GraphRunError,
            BundleError,
            ChatMismatch,
            ChatFormatError,
        ) as e:
            if printer.streamed:
                text_out.write("\n")
                text_out.flush()
            if client is not None:
                client.close()
            raise _fail("run", run_error(str(e))) from None
        text_out.write("\n")
        text_out.flush()
        m = res.to_json()
        if json_out:
            sys.stdout.write(json.dumps(m) + "\n")
        elif chat:
            sys.stdout.write(TURN_END)
        sys.stdout.flush()
        typer.echo(summary_line(mode.value, m, res.prefill_ms, res.finish_reason), err=True)
        return res

    n = 1
    if chat:  # every turn labelled on stderr, the first too; the answers on stdout stay plain text
        typer.echo(f"-- turn {n} --", err=True)
    turn(True)
    while chat and (text := ask()) is not None:
        n += 1
        typer.echo(f"-- turn {n} --", err=True)
        turn(False, text)
    if chat and client is not None:  # --chat has a verifier (check_run_options)
        client.close()


# --help lists the --json keys from the code that writes the object (`hycoc.runtime.result.RequestResult.to_json`).
run.__doc__ = (run.__doc__ or "").replace("{keys}", ", ".join(JSON_KEYS))
