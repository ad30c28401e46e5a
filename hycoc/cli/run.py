"""``hycoc run``: the device runtime against a verifier server. The command checks its options
(`hycoc.run_options`) and hands the run to `hycoc.run_app.run_device`. Imports neither torch nor aiohttp (the
device-runtime install has neither); the runtime is imported inside the command body."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hycoc.cli._common import AUTH_TOKEN_HELP, Backend, RunMode, _auth_token, _bundle_backend, _fail
from hycoc.cli.options import unset
from hycoc.runtime.result import JSON_KEYS  # standard library only: the keys the --json object has

#: run's long options, each declared once (`hycoc.cli.options`); the command's parameters name them in order.
Server = Annotated[
    str | None, unset("verifier address, ws://HOST:PORT (not needed for --mode slm-alone)", metavar="URL")
]
Prompt = Annotated[str | None, unset("user message (wrapped in the chat template)")]
PromptFile = Annotated[Path | None, unset("read the user message from this file")]
MaxNewTokens = Annotated[
    int | None, unset("output cap in tokens (default: the bundle's sampling.max_new_tokens)", min=1)
]
Mode = Annotated[
    RunMode,
    typer.Option(
        help="drafting and acceptance: hyco (epsilon), hyco-exact, hyco-2p (two SLM passes), "
        "specedge (SLM-only tree), server-head, slm-alone (paper Table 5)",
    ),
]
BackendOption = Annotated[
    Backend | None,
    unset(
        "htp = QNN EP context binaries (on x86: the QNN HTP simulator, slow, not device time; a note says "
        "so), cpu = CPU EP (default: the bundle's target)"
    ),
]
Seed = Annotated[int | None, unset("sampling seed (default: the bundle's)", min=0)]
Temperature = Annotated[
    float | None, unset("verifier sampling temperature, 0 = greedy (default: the bundle's)", min=0.0)
]
Epsilon = Annotated[
    float | None, unset("epsilon of epsilon-threshold acceptance (default: the bundle's)", min=0.0, max=1.0)
]
JsonOut = Annotated[
    bool,
    typer.Option(
        "--json",
        help="stdout holds JSON lines only, one object per answer (its text and metrics), for jq and scripts; "
        "the answer text then streams to stderr when stderr is a terminal, else it is not streamed",
    ),
]
Raw = Annotated[bool, typer.Option("--raw", help="send the prompt as is, without the chat template")]
Chat = Annotated[
    bool,
    typer.Option(
        "--chat",
        help="a conversation on one session: after the first answer, every line on stdin is the "
        "next user turn (the verifier keeps the KV, the SLM ring continues); an empty line or end of input ends "
        "it. Without --prompt / --prompt-file the first turn is read from stdin too. On stdout each answer ends "
        "with an empty line (with --json: one JSON line per answer, no empty line)",
    ),
]
Thinking = Annotated[
    bool,
    typer.Option(
        "--thinking",
        help="let the model think first (the chat template's enable_thinking); the thought "
        "streams to stderr, apart from the answer on stdout",
    ),
]
Threads = Annotated[
    int | None,
    unset(
        "CPU intra-op threads per graph session (cpu backend; default 1, no spinning; 0 = onnxruntime's default pool)",
        min=0,
    ),
]
HtpPerformanceMode = Annotated[
    str | None,
    unset(
        "htp: the QNN HTP performance mode (burst, sustained_high_performance, high_performance, balanced, "
        "default, low_balanced, high_power_saver, power_saver, low_power_saver, extreme_power_saver; default burst, "
        "as Qualcomm's Genie runs)",
        metavar="MODE",
    ),
]
HtpContextPriority = Annotated[
    str | None,
    unset("htp: the QNN context priority (low, normal, normal_high, high; default normal)", metavar="PRIORITY"),
]
HtpFinalization = Annotated[
    str | None,
    unset(
        "htp: the QNN graph finalization optimization mode (0-3; default the bundle's target profile; a "
        "bundle's graphs were finalized at build, so it affects only graphs the EP prepares itself)",
        metavar="0-3",
    ),
]
HtpRpcLatencyUs = Annotated[
    int | None,
    unset(
        "htp: the QNN RPC control latency in microseconds (0 = not set; default 100, as Genie's configs)", metavar="US"
    ),
]
AuthToken = Annotated[str | None, unset(f"token the server requires; {AUTH_TOKEN_HELP}", envvar="HYCOC_AUTH_TOKEN")]
AuthTokenFile = Annotated[Path | None, unset("read the token the server requires from this file (one line)")]


def run(
    ctx: typer.Context,
    bundle: Path = typer.Argument(
        ..., metavar="BUNDLE", help="bundle folder made by `hycoc build`", show_default=False
    ),
    server: Server = None,
    prompt: Prompt = None,
    prompt_file: PromptFile = None,
    max_new_tokens: MaxNewTokens = None,
    mode: Mode = RunMode("hyco"),
    backend: BackendOption = None,
    seed: Seed = None,
    temperature: Temperature = None,
    epsilon: Epsilon = None,
    json_out: JsonOut = False,
    raw: Raw = False,
    chat: Chat = False,
    thinking: Thinking = False,
    threads: Threads = None,
    htp_performance_mode: HtpPerformanceMode = None,
    htp_context_priority: HtpContextPriority = None,
    htp_finalization: HtpFinalization = None,
    htp_rpc_latency_us: HtpRpcLatencyUs = None,
    auth_token: AuthToken = None,
    auth_token_file: AuthTokenFile = None,
    timeout: float = typer.Option(120.0, min=1.0, help="seconds to wait for the server's answers"),
) -> None:
    """Device runtime: draft hybrid trees against a verifier server and stream the answer (Alg. 1-3).

    The text streams to stdout as it is committed; a one-line summary goes to stderr. --json: stdout has one JSON
    object per answer and nothing else ({keys}); the text streams to stderr if that is a terminal, else not at all.
    """
    from hycoc.run_app import RunFailed, RunPlan, ask_user, run_device
    from hycoc.run_options import RunOptionError, check_run_options, htp_settings

    slm_alone = mode == RunMode("slm-alone")
    try:  # every usage error before the filesystem; the first turn from stdin before the QNN settings' checks
        check_run_options(
            bundle=bundle,
            server=server,
            prompt=prompt,
            prompt_file=prompt_file,
            chat=chat,
            raw=raw,
            slm_alone=slm_alone,
        )
        text = prompt if prompt is not None else prompt_file.read_text(encoding="utf-8") if prompt_file else None
        if text is None and (text := ask_user()) is None:
            raise RunOptionError("no user message on stdin", code=1)
        backend_name = _bundle_backend(bundle, backend)
        htp = htp_settings(
            backend_name,
            performance_mode=htp_performance_mode,
            context_priority=htp_context_priority,
            finalization=htp_finalization,
            rpc_latency_us=htp_rpc_latency_us,
        )
    except RunOptionError as e:
        raise _fail("run", str(e), code=e.code) from None
    plan = RunPlan(
        bundle=bundle,
        backend=backend_name,
        threads=threads,
        htp=htp,
        text=text,
        raw=raw,
        thinking=thinking,
        mode=mode.value,
        server=server,
        timeout_s=timeout,
        max_new_tokens=max_new_tokens,
        seed=seed,
        temperature=temperature,
        epsilon=epsilon,
        json_out=json_out,
        chat=chat,
    )
    try:
        run_device(plan, auth_token=lambda: _auth_token("run", ctx, auth_token, auth_token_file))
    except RunFailed as e:
        raise _fail("run", str(e), code=e.code) from None


# --help lists the --json keys from the code that writes the object (`hycoc.runtime.result.RequestResult.to_json`).
run.__doc__ = (run.__doc__ or "").replace("{keys}", ", ".join(JSON_KEYS))
