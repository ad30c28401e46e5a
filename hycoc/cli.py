"""The ``hycoc`` command line (typer). Commands are thin: they check their arguments and the recipe, then call
library functions. torch and transformers are imported inside command bodies only, so ``hycoc --help`` is fast
and the device-runtime install (no torch) can run ``hycoc run``.

Exit codes: 0 done; 1 bad input (recipe, dataset, missing model); 2 bad usage or a command that is not
available yet (its message names the issue that brings it).
"""

from __future__ import annotations

import sys
import time
from enum import Enum
from pathlib import Path
from typing import Optional

import typer


def _flags_show_no_type() -> None:
    """typer 0.29 prints a ``<bool>`` type after every flag in --help (``--help`` itself included), as if a flag took a
    value; a ``--x/--no-x`` pair gets it too. Print nothing there, as click's plain help does, by wrapping
    ``typer.core.TyperOption.display_type_rich`` (the type column of typer's rich help). Feature-detected: a typer
    without that method is left alone; options with their own metavar keep it."""
    from typer.core import TyperOption

    shown = getattr(TyperOption, "display_type_rich", None)
    if shown is None or getattr(shown, "hycoc_flags_untyped", False):
        return

    def display_type_rich(self, ctx):
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    display_type_rich.hycoc_flags_untyped = True
    TyperOption.display_type_rich = display_type_rich


_flags_show_no_type()

app = typer.Typer(
    name="hycoc",
    help="HyCo hybrid drafting: compile drafters into bundles, run the device runtime, serve the verifier.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    # click's plain help: it wraps every paragraph and default to the terminal's width (rich's panels cut long
    # defaults and paths with "…" at 80 columns); https://typer.tiangolo.com/tutorial/commands/help/#rich-markdown-and-markup
    rich_markup_mode=None,
)

def _print_version(value: bool) -> None:
    """``hycoc --version``: the installed package's version (importlib.metadata), then exit 0."""
    if value:
        from importlib.metadata import version

        typer.echo(f"hycoc {version('hycoc')}")
        raise typer.Exit()


@app.callback()
def _root(version: bool = typer.Option(False, "--version", callback=_print_version, is_eager=True,
                                       help="print hycoc's version and exit")) -> None:
    """HyCo hybrid drafting: compile drafters into bundles, run the device runtime, serve the verifier."""


#: Repository root of an editable install.
REPO_ROOT = Path(__file__).resolve().parents[1]
#: Spec-Bench's questions, shipped in the repository (benchmarks/data/NOTICE.md).
DEFAULT_DATASET = REPO_ROOT / "benchmarks" / "data" / "spec_bench_question.jsonl"

#: Commands that later issues fill in: command -> (issue number, title).
PENDING = {
    "build": (4, "The compiler: hycoc build RECIPE --target htp-v81|cpu|qai-hub"),
    "bench": (6, "hycoc bench: the paper's Table 2 on real prompts"),
}

#: Configurations of `hycoc bench` (paper Table 5).
BENCH_CONFIGS = ("cloud-mtp", "specedge", "specedge-eps", "hyco", "hyco-2p", "hyco-exact", "server-head", "slm-alone")


class TargetName(str, Enum):
    htp_v81 = "htp-v81"
    cpu = "cpu"
    qai_hub = "qai-hub"


class RunMode(str, Enum):
    hyco = "hyco"
    hyco_exact = "hyco-exact"
    hyco_2p = "hyco-2p"
    specedge = "specedge"
    server_head = "server-head"
    slm_alone = "slm-alone"


class Backend(str, Enum):
    htp = "htp"
    cpu = "cpu"


class TableFormat(str, Enum):
    table = "table"
    markdown = "markdown"
    csv = "csv"


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


AUTH_TOKEN_HELP = ("prefer the HYCOC_AUTH_TOKEN environment variable or --auth-token-file: a token given as "
                   "--auth-token is visible to every local user (ps, /proc/PID/cmdline)")


def _auth_token(command: str, ctx: typer.Context, token: str | None, token_file: Path | None) -> str | None:
    """The auth token from --auth-token-file, HYCOC_AUTH_TOKEN or --auth-token (in that order of preference).

    A token typed as --auth-token gets a warning on stderr (issue 12 fault 10: /proc/PID/cmdline shows it to every
    local user). Raises typer.Exit (code 2) for an empty token, an unreadable or empty file, or both a file and
    a command-line token."""
    source = ctx.get_parameter_source("auth_token")  # typer's own click: compare by name, not identity
    on_command_line = token is not None and getattr(source, "name", None) == "COMMANDLINE"
    if token_file is not None:
        if on_command_line:
            raise _fail(command, "give one of --auth-token and --auth-token-file", code=2)
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise _fail(command, f"--auth-token-file {token_file}: cannot read it ({e})", code=2) from None
        if not token:
            raise _fail(command, f"--auth-token-file {token_file}: the file is empty", code=2)
        return token
    if token == "":
        raise _fail(command, "--auth-token is empty: give a token, or leave the option out", code=2)
    if on_command_line:
        typer.echo(f"hycoc {command}: warning: --auth-token on the command line is visible to every local user "
                   "(ps, /proc/PID/cmdline); set HYCOC_AUTH_TOKEN or use --auth-token-file FILE instead", err=True)
    return token


def _fail(command: str, message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"hycoc {command}: {message}", err=True)
    return typer.Exit(code)


def _port_error(host: str, port: int, e: OSError, busy_hint: str) -> str:
    """One line for an address a server cannot bind (`hycoc.verifier.server.check_port`): the port and
    ``busy_hint`` when it is taken, else the address and what to give instead."""
    import errno

    if e.errno == errno.EADDRINUSE:
        return (f"cannot listen on {host}:{port}: {e.strerror} ({busy_hint}): pass --port N, or --port 0 for any free "
                "port")
    return (f"cannot listen on {host}:{port}: {e.strerror or e}: pass --host with an address of this machine "
            "(127.0.0.1, or 0.0.0.0 for every interface)")


def _bundle_backend(bundle: Path, backend) -> str:
    """``--backend`` if given, else the backend the bundle was built for (its manifest's target)."""
    if backend is not None:
        return backend.value
    import json

    try:
        return json.loads((Path(bundle) / "manifest.json").read_text(encoding="utf-8"))["target"]["backend"]
    except (OSError, ValueError, KeyError, TypeError):
        return "cpu"  # the bundle loader then names what is wrong with the manifest


def _need_full(command: str) -> None:
    """Exit 1 with the install step when torch/transformers (the ``full`` extra) are missing."""
    import importlib.util

    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise _fail(command, f"needs {' and '.join(missing)} (the compiler/verifier install): "
                    "pip install torch==2.13.0 && pip install -e '.[full]'")


def _pending(command: str, key: str | None = None) -> typer.Exit:
    number, title = PENDING[key or command]
    return _fail(command, f"not available yet (issue {number}: {title})", code=2)


def _recipe(command: str, path: Path):
    from hycoc.recipe import RecipeError, load_recipe

    try:
        return load_recipe(path)
    except RecipeError as e:
        raise _fail(command, f"bad recipe\n{e}") from None


RECIPE_ARG = typer.Argument(..., help="recipe TOML file (e.g. recipes/toy.toml, recipes/gemma4.toml)",
                            show_default=False)


@app.command()
def build(
    recipe: Path = RECIPE_ARG,
    target: Optional[TargetName] = typer.Option(
        None, help="compile target: htp-v81 = QNN HTP context binaries, cpu = QDQ ONNX for onnxruntime's CPU EP, "
        "qai-hub = Qualcomm AI Hub compile job (default: the recipe's target.name)", show_default=False),
    out: Optional[Path] = typer.Option(
        None, help="bundle folder to write (written to a temporary folder, renamed when complete) "
        "(default: bundles/<recipe name>-<target>)", show_default=False),
    list_passes: bool = typer.Option(False, "--list-passes", help="print the pass pipeline for the recipe and exit"),
    until: Optional[str] = typer.Option(
        None, metavar="PASS", help="stop after this pass and keep its artifact for inspection", show_default=False),
    cache_dir: Optional[Path] = typer.Option(
        None, help="cache of intermediate artifacts, keyed by content hash (default: .hycoc-cache in the cwd)",
        show_default=False),
    device: Device = typer.Option(
        Device.cpu, help="where the verifier captures and the head's QAT run: cpu (models as saved) or cuda (the "
        "verifier in bfloat16, QAT under bfloat16 autocast, paper Table 4); cached separately per device"),
) -> None:
    """Compile the recipe's MTP head and SLM into a bundle of static, quantized graphs (paper §3.2-3.4)."""
    from rich.console import Console

    from hycoc.models import ModelNotFoundError
    from hycoc.passes.build import BuildError, BuildNotReady, build_bundle, build_pipeline
    from hycoc.passes.calibration import CalibrationError
    from hycoc.passes.export import ExportError
    from hycoc.passes.head_qat import HeadQatError
    from hycoc.passes.keep_set import KeepSetError
    from hycoc.passes.pipeline import PipelineError
    from hycoc.passes.qdq import QdqError
    from hycoc.passes.slm_graph import SlmGraphError
    from hycoc.passes.slm_surgery import SurgeryError
    from hycoc.recipe import RecipeError
    from hycoc.targets.cpu import CpuTargetError
    from hycoc.targets.htp import HtpTargetError
    from hycoc.targets.profiles import UnknownTargetError
    from hycoc.targets.qai_hub import QaiHubDeviceError, QaiHubJobError, QaiHubSetupError
    from hycoc.verifier.loading import DeviceUnavailable

    errors = (BuildError, PipelineError, RecipeError, ModelNotFoundError, KeepSetError, HeadQatError, ExportError,
              SurgeryError, SlmGraphError, CalibrationError, QdqError, CpuTargetError, HtpTargetError,
              UnknownTargetError, QaiHubSetupError, QaiHubJobError, QaiHubDeviceError, DeviceUnavailable)

    config = _recipe("build", recipe)
    _need_full("build")
    name = target.value if target is not None else config.target.name
    cache = cache_dir if cache_dir is not None else Path(".hycoc-cache")
    console = Console(stderr=True)
    if list_passes:
        typer.echo(build_pipeline(config, name, cache_dir=cache, console=console, device=device.value).describe())
        return
    out_dir = out if out is not None else Path("bundles") / f"{config.recipe.name}-{name}"
    try:
        result = build_bundle(config, name, None if until else out_dir, cache, until=until, console=console,
                              device=device.value)
    except BuildNotReady as e:
        number, title = PENDING["build"]
        raise _fail("build", f"not available yet (issue {number}: {title}): {e}", code=2) from None
    except errors as e:  # each names what is wrong and what to do; the CLI says it in one line
        raise _fail("build", "; ".join(line.strip() for line in str(e).splitlines() if line.strip())) from None
    if until is not None:
        typer.echo(f"stopped after {until}; its artifacts are in {result.stopped_at}")
        return
    from rich.table import Table

    manifest = result.manifest
    table = Table(title=f"bundle {result.out_dir} ({manifest.target.name})")
    for column in ("graph", "file", "inputs", "outputs", "weights"):
        table.add_column(column)
    for g in manifest.graphs:
        weights = ", ".join(f"{w.tensors} {dtype}" for dtype, w in g.weight_bits.items())
        table.add_row(g.name, g.file, str(len(g.inputs)), str(len(g.outputs)), weights)
    Console().print(table)
    total = sum(f.bytes for f in manifest.files)
    typer.echo(f"wrote {result.out_dir}: {len(manifest.files)} files, {total / 1e6:.2f} MB, keep set "
               f"{manifest.keep_set_size}")


@app.command()
def run(
    ctx: typer.Context,
    bundle: Path = typer.Argument(..., help="bundle folder made by `hycoc build`", show_default=False),
    server: Optional[str] = typer.Option(None, metavar="URL", help="verifier address, ws://HOST:PORT (not needed "
                                         "for --mode slm-alone)", show_default=False),
    prompt: Optional[str] = typer.Option(None, help="user message (wrapped in the chat template)", show_default=False),
    prompt_file: Optional[Path] = typer.Option(None, help="read the user message from this file", show_default=False),
    max_new_tokens: Optional[int] = typer.Option(
        None, min=1, help="output cap in tokens (default: the bundle's sampling.max_new_tokens)", show_default=False),
    mode: RunMode = typer.Option(
        RunMode.hyco, help="drafting and acceptance: hyco (epsilon), hyco-exact, hyco-2p (two SLM passes), "
        "specedge (SLM-only tree), server-head, slm-alone (paper Table 5)"),
    backend: Optional[Backend] = typer.Option(
        None, help="htp = QNN EP context binaries (simulator on x86), cpu = CPU EP (default: the bundle's target)",
        show_default=False),
    seed: Optional[int] = typer.Option(None, min=0, help="sampling seed (default: the bundle's)", show_default=False),
    temperature: Optional[float] = typer.Option(
        None, min=0.0, help="verifier sampling temperature, 0 = greedy (default: the bundle's)", show_default=False),
    epsilon: Optional[float] = typer.Option(
        None, min=0.0, max=1.0, help="epsilon of epsilon-threshold acceptance (default: the bundle's)",
        show_default=False),
    json_out: bool = typer.Option(False, "--json", help="print the metrics as one JSON object after the text"),
    raw: bool = typer.Option(False, "--raw", help="send the prompt as is, without the chat template"),
    chat: bool = typer.Option(
        False, "--chat", help="a conversation on one session: after the first answer, every line on stdin is the "
        "next user turn (the verifier keeps the KV, the SLM ring continues); an empty line or end of input ends "
        "it. Without --prompt / --prompt-file the first turn is read from stdin too"),
    thinking: bool = typer.Option(
        False, "--thinking", help="let the model think first (the chat template's enable_thinking); the thought "
        "streams to stderr, apart from the answer on stdout"),
    threads: Optional[int] = typer.Option(None, min=0, help="CPU intra-op threads per graph session (cpu backend; "
                                          "default 1, no spinning; 0 = onnxruntime's default pool)",
                                          show_default=False),
    auth_token: Optional[str] = typer.Option(
        None, envvar="HYCOC_AUTH_TOKEN", help=f"token the server requires; {AUTH_TOKEN_HELP}", show_default=False),
    auth_token_file: Optional[Path] = typer.Option(
        None, help="read the token the server requires from this file (one line)", show_default=False),
    timeout: float = typer.Option(120.0, min=1.0, help="seconds to wait for the server's answers"),
) -> None:
    """Device runtime: draft hybrid trees against a verifier server and stream the answer (Alg. 1-3).

    The text streams to stdout as it is committed; a one-line summary goes to stderr (--json: the metrics as one
    JSON object on stdout after the text: text, tokens, rounds, mat, tok_per_s, draft_ms_per_token,
    server_ms_per_token, first_token_ms, bytes_up_per_round, bytes_down_per_round).
    """
    if (prompt is not None and prompt_file is not None) or (not chat and prompt is None and prompt_file is None):
        raise _fail("run", "give exactly one of --prompt and --prompt-file", code=2)
    if chat and (mode == RunMode.slm_alone or raw):
        raise _fail("run", "--chat needs a verifier and the chat template: not with --mode slm-alone or --raw",
                    code=2)
    if prompt_file is not None and not prompt_file.is_file():
        raise _fail("run", f"--prompt-file {prompt_file}: no such file", code=2)
    if not bundle.is_dir():
        what = "is a file, not a bundle folder" if bundle.exists() else "no such folder"
        raise _fail("run", f"bundle {bundle}: {what} (make one with `hycoc build RECIPE --target cpu --out DIR`)")
    if mode != RunMode.slm_alone and server is None:
        raise _fail("run", "--server ws://HOST:PORT is required (except with --mode slm-alone)", code=2)
    if mode != RunMode.slm_alone and not server.startswith(("ws://", "wss://")):
        raise _fail("run", f"--server {server!r}: expected ws://HOST:PORT", code=2)
    import json

    from hycoc.bundle import BundleError
    from hycoc.protocol.messages import Sampling
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
        raise _fail("run", "no user message on stdin", code=2)
    try:
        rt = load_runtime(bundle, _bundle_backend(bundle, backend), threads=threads)
    except (BundleError, GraphRunError, QnnUnavailableError, ValueError) as e:
        raise _fail("run", str(e)) from None
    from hycoc.chat import AnswerStream, ChatFormatError, ChatMismatch

    tok, chat_format = rt.bundle.tokenizer, rt.bundle.chat
    try:
        ids = tok.encode(text, add_special_tokens=False).ids if raw else chat_format.prompt(text, thinking)
    except ChatFormatError as e:
        raise _fail("run", f"bundle {bundle}: {e}", code=2) from None
    if not ids:
        raise _fail("run", "the prompt encodes to no tokens", code=2)
    r = rt.bundle.round
    sampling = Sampling(r.temperature if temperature is None else temperature, r.top_k, r.top_p)
    auth_token = _auth_token("run", ctx, auth_token, auth_token_file)
    client = None if mode == RunMode.slm_alone else VerifierClient(server, auth_token, timeout_s=timeout)

    streamed = []
    answer = AnswerStream(chat_format)

    def show(pieces: tuple[str, str]) -> None:
        """The thought to stderr (dimmed on a terminal), the answer to stdout."""
        thought, text = pieces
        if thought:
            dim = sys.stderr.isatty()
            sys.stderr.write(("\x1b[2m" if dim else "") + thought + ("\x1b[0m" if dim else ""))
            sys.stderr.flush()
        if text:
            streamed.append(text)
            sys.stdout.write(text)
            sys.stdout.flush()

    def turn(first: bool, text: str | None = None):
        """One turn: the request (first) or the next user turn on the same session; prints its metrics."""
        nonlocal answer
        answer = AnswerStream(chat_format)
        on_tokens = lambda new: show(answer.push(new))  # noqa: E731
        try:
            if first:
                res = rt.generate(client, ids, mode=mode.value, max_new_tokens=max_new_tokens, seed=seed,
                                  sampling=sampling, epsilon=epsilon, on_tokens=on_tokens, keep_open=chat)
            else:
                res = rt.next_turn(client, chat_format.next_turn(text, thinking), max_new_tokens=max_new_tokens,
                                   on_tokens=on_tokens)
            show(answer.flush())
        except (TransportError, HandoffError, RuntimeProtocolError, GraphRunError, BundleError, ChatMismatch) as e:
            if streamed:
                sys.stdout.write("\n")
                sys.stdout.flush()
            if client is not None:
                client.close()
            message = str(e)
            if "auth_required" in message or "auth_refused" in message:
                message += " (hycoc run: set HYCOC_AUTH_TOKEN or pass --auth-token-file FILE)"
            raise _fail("run", message) from None
        sys.stdout.write("\n")
        m = res.to_json()
        if json_out:
            sys.stdout.write(json.dumps(m) + "\n")
        sys.stdout.flush()
        typer.echo(f"[{mode.value}: {m['tokens']} tokens, {m['rounds']} rounds, MAT {m['mat']:.2f}, "
                   f"{m['tok_per_s']:.1f} tok/s, draft {m['draft_ms_per_token']:.1f} ms/token, server "
                   f"{m['server_ms_per_token']:.1f} ms/token, first token {m['first_token_ms']} ms, prefill "
                   f"{res.prefill_ms:.1f} ms, {res.finish_reason}]", err=True)
        return res

    res = turn(True)
    n = 1
    while chat and (text := ask()) is not None:
        n += 1
        typer.echo(f"-- turn {n} --", err=True)      # the answers on stdout stay plain text
        res = turn(False, text)
    if chat:
        client.close()


@app.command("verify-server")
def verify_server(
    ctx: typer.Context,
    recipe: Path = RECIPE_ARG,
    host: Optional[str] = typer.Option(None, help="listen address (default: the recipe's verifier.host, 127.0.0.1)",
                                       show_default=False),
    port: Optional[int] = typer.Option(
        None, min=0, max=65535, help="TCP port; 0 = any free port, named in the printed URL "
        "(default: the recipe's verifier.port, 8765)", show_default=False),
    device: Optional[Device] = typer.Option(None, help="torch device (default: the recipe's verifier.device)",
                                            show_default=False),
    auth_token: Optional[str] = typer.Option(
        None, envvar="HYCOC_AUTH_TOKEN", help="require this token from clients, in OPEN or as 'Authorization: "
        f"Bearer TOKEN' (default: none, an open server); {AUTH_TOKEN_HELP}", show_default=False),
    auth_token_file: Optional[Path] = typer.Option(
        None, help="read the token clients must present from this file (one line)", show_default=False),
    keep_set: Optional[Path] = typer.Option(
        None, help="keep set for server-head sessions: a .npy of int token ids (the keep-set pass writes "
        "keep_set.npy); without it server-head sessions are refused with error no_keep_set", show_default=False),
    batching: Optional[str] = typer.Option(
        None, metavar="batched|serial", help="batched: rounds of sessions ready together share one forward, prompts "
        "are prefilled chunk by chunk between them; serial: one engine call at a time (default: the recipe's "
        "verifier.batching, batched)", show_default=False),
    max_batch_rows: Optional[int] = typer.Option(
        None, min=1, help="most tree rows per batched forward (default: the recipe's verifier.max_batch_rows, 528 = "
        "16 trees of 33 rows)", show_default=False),
    max_batch_wait_ms: Optional[float] = typer.Option(
        None, min=0.0, max=10_000.0, help="ms a round waits for other sessions' rounds to join its forward "
        "(default: the recipe's verifier.max_batch_wait_ms, 2.0)", show_default=False),
) -> None:
    """Serve the verifier: prefill, one-forward tree verification, acceptance, KV compaction, hand-off (Alg. 4).

    WebSocket sessions at ws://HOST:PORT/, GET /healthz (JSON) and GET /metrics (Prometheus) on the same port.

    Prints one line with the URL once listening; stops on Ctrl-C or SIGTERM.

    Trees have the recipe's tree.node_budget + 1 rows; frames above its verifier.max_frame_bytes (bytes) are refused.
    """
    cfg = _recipe("verify-server", recipe)
    _need_full("verify-server")
    auth_token = _auth_token("verify-server", ctx, auth_token, auth_token_file)
    if batching is not None and batching not in ("batched", "serial"):
        raise _fail("verify-server", f"--batching {batching!r}: allowed: batched, serial", code=2)
    from hycoc.models import ModelNotFoundError, model_dir
    from hycoc.ports import check_port

    ids = None
    if keep_set is not None:
        import numpy as np

        try:
            ids = np.load(keep_set, allow_pickle=False)
        except (OSError, ValueError):
            raise _fail("verify-server", f"--keep-set {keep_set}: not a .npy array file; give the bundle's "
                        "keep_set.npy (written by hycoc build)") from None
        if ids.ndim != 1 or ids.dtype.kind not in "iu" or len(ids) == 0:
            raise _fail("verify-server", f"--keep-set {keep_set}: expected a non-empty 1-D array of int token ids, "
                        f"got shape {ids.shape} dtype {ids.dtype}")
    from hycoc.chat import ChatFormatError
    from hycoc.chat_template import chat_from_recipe

    try:  # the models' folders and chat files, then the port: each named at once, before the model is loaded
        for role in ("verifier", "head", "tokenizer"):
            model_dir(cfg, role)
        chat_from_recipe(cfg)          # the checkpoint's template and stop ids: a bad folder is refused here
    except (ModelNotFoundError, ChatFormatError) as e:
        raise _fail("verify-server", str(e)) from None
    host = host or cfg.verifier.host
    port = cfg.verifier.port if port is None else port
    try:
        check_port(host, port)
    except OSError as e:
        raise _fail("verify-server", _port_error(host, port, e, "another server on this port?")) from None
    from hycoc.models import set_threads
    from hycoc.recipe import RecipeError
    from hycoc.verifier.loading import DeviceUnavailable, engine_from_recipe, server_options
    from hycoc.verifier.server import serve

    set_threads(cfg.verifier.threads)
    try:
        import torch

        engine = engine_from_recipe(cfg, device.value if device is not None else None,
                                    keep_set=None if ids is None else torch.as_tensor(ids, dtype=torch.long))
    except RecipeError as e:
        raise _fail("verify-server", f"bad recipe\n{e}") from None
    except (ModelNotFoundError, DeviceUnavailable, ChatFormatError) as e:
        raise _fail("verify-server", str(e)) from None
    if ids is not None and int(ids.max()) >= engine.vocab_size:
        raise _fail("verify-server", f"--keep-set {keep_set}: token id {int(ids.max())} is outside the verifier's "
                    f"vocabulary of {engine.vocab_size}: was the keep set built for another tokenizer?")

    def listening(url: str) -> None:
        typer.echo(f"hycoc verify-server: listening on {url} (model {cfg.models.verifier}, "
                   f"{engine.device.type}, {options['batching']}, health {url.replace('ws://', 'http://', 1)}/healthz)")
        sys.stdout.flush()

    options = server_options(cfg)
    if batching is not None:
        options["batching"] = batching
    if max_batch_rows is not None:
        options["max_batch_rows"] = max_batch_rows
    if max_batch_wait_ms is not None:
        options["max_batch_wait_ms"] = max_batch_wait_ms
    started = time.monotonic()
    try:
        serve(engine, host, port, auth_token=auth_token, on_listening=listening, **options)
    except OSError as e:
        raise _fail("verify-server", f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    up = time.monotonic() - started
    typer.echo(f"hycoc verify-server: stopped (SIGINT or SIGTERM) after {up:.0f} s; sessions closed")


@app.command("serve-ray")
def serve_ray(
    ctx: typer.Context,
    recipe: Path = RECIPE_ARG,
    replicas: int = typer.Option(2, min=1, help="verifier replicas (each loads the recipe's verifier and takes "
                                 "verifier.threads CPUs, or 1 GPU with --device cuda, from Ray)"),
    host: Optional[str] = typer.Option(None, help="listen address of Ray Serve's proxy (default: the recipe's "
                                       "verifier.host, 127.0.0.1)", show_default=False),
    port: Optional[int] = typer.Option(None, min=0, max=65535, help="TCP port of the proxy; 0 = any free port, "
                                       "named in the printed URL (default: the recipe's verifier.port, 8765)",
                                       show_default=False),
    device: Optional[Device] = typer.Option(None, help="torch device of every replica (default: the recipe's "
                                            "verifier.device)", show_default=False),
    auth_token: Optional[str] = typer.Option(
        None, envvar="HYCOC_AUTH_TOKEN", help="require this token from clients, in OPEN or as 'Authorization: "
        f"Bearer TOKEN' (default: none, an open server); {AUTH_TOKEN_HELP}", show_default=False),
    auth_token_file: Optional[Path] = typer.Option(
        None, help="read the token clients must present from this file (one line)", show_default=False),
    keep_set: Optional[Path] = typer.Option(
        None, help="keep set for server-head sessions (the bundle's keep_set.npy); without it they are refused",
        show_default=False),
    ray_address: Optional[str] = typer.Option(
        None, help="Ray cluster to join ('auto': the one `ray start` began on this node; ray://HOST:10001); "
        "default: start a local Ray instance with one CPU per replica thread", show_default=False),
    log_level: str = typer.Option(
        "WARNING", metavar="DEBUG|INFO|WARNING|ERROR", help="least level of Ray's own log lines on stderr (INFO adds "
        "Serve's per-request access log); Ray's full logs stay under /tmp/ray/session_latest/logs"),
) -> None:
    """Serve the verifier as a Ray Serve deployment: N replicas behind one WebSocket endpoint.

    Same wire protocol, /healthz and /metrics as verify-server, at ws://HOST:PORT/; a session stays on the replica
    that accepted it; new sessions go to the less loaded replica; /healthz and /metrics cover every replica (samples
    labelled replica="ID"). Server limits apply per replica. Needs the serve extra: pip install -e '.\\[serve]'.

    Prints one line with the URL once every replica is up (stdout has hycoc's lines only; Ray's go to stderr);
    stops on Ctrl-C or SIGTERM.
    """
    import importlib.util

    cfg = _recipe("serve-ray", recipe)
    _need_full("serve-ray")
    if importlib.util.find_spec("ray") is None:
        raise _fail("serve-ray", "needs Ray Serve (the serve extra): pip install -e '.[serve]'")
    auth_token = _auth_token("serve-ray", ctx, auth_token, auth_token_file)
    from hycoc.models import ModelNotFoundError
    from hycoc.verifier.loading import DeviceUnavailable, check_device, model_dir, server_options
    from hycoc.ports import check_port
    from hycoc.verifier.ray_serve import RecipeEngine, build_app, check_keep_set, check_log_level, replica_cpus, run

    try:
        log_level = check_log_level(log_level)
    except ValueError as e:
        raise _fail("serve-ray", str(e), code=2) from None

    dev = device.value if device is not None else cfg.verifier.device
    try:  # what each replica will load, checked here once (a replica that fails is retried by Ray)
        check_device(dev)
        for role in ("verifier", "head", "tokenizer"):
            model_dir(cfg, role)
        if keep_set is not None:
            check_keep_set(keep_set)
    except (ModelNotFoundError, DeviceUnavailable, ValueError) as e:
        raise _fail("serve-ray", str(e)) from None
    host = host or cfg.verifier.host
    port = cfg.verifier.port if port is None else port
    try:  # before Ray starts: a busy port would fail only after ~20 s, in a Ray traceback
        port = check_port(host, port, reuse_address=False)  # port 0: the free port picked here, given to Ray
    except OSError as e:
        raise _fail("serve-ray", _port_error(host, port, e, "a verify-server on the default port?")) from None
    options = server_options(cfg) | {"auth_token": auth_token}
    app = build_app(RecipeEngine(str(recipe.resolve()), dev, None if keep_set is None else str(keep_set.resolve())),
                    replicas=replicas, server_kwargs=options, cpus_per_replica=replica_cpus(cfg.verifier.threads),
                    gpus_per_replica=1 if dev == "cuda" else 0, log_level=log_level)
    typer.echo(f"hycoc serve-ray: starting Ray and {replicas} replica(s) of {cfg.models.verifier} "
               "(each loads the verifier; about half a minute)", err=True)

    out = sys.stdout  # run() sends Ray's console output to stderr by making sys.stdout stderr while Ray runs

    def listening(url: str) -> None:
        typer.echo(f"hycoc serve-ray: listening on {url} ({replicas} replicas of {cfg.models.verifier}, {dev}, "
                   f"health {url.replace('ws://', 'http://', 1)}/healthz)", file=out)
        out.flush()

    try:
        run(app, host, port, ray_address=ray_address,
            num_cpus=None if ray_address else replicas * replica_cpus(cfg.verifier.threads),
            log_level=log_level, on_listening=listening)
    except RuntimeError as e:  # a deployment that failed: Serve's message carries the replica's traceback
        raise _fail("serve-ray", f"the deployment failed: {e}") from None


@app.command("calibrate-handoff")
def calibrate_handoff(
    recipe: Path = RECIPE_ARG,
    prompts: int = typer.Option(16, min=1, help="calibration prompts (the head QAT's prompt source)"),
    max_new_tokens: int = typer.Option(256, min=1, help="greedy answer tokens per prompt"),
    percentile: float = typer.Option(99.99, min=50.0, max=100.0, help="percentile of |x| that maps to int8 127"),
) -> None:
    """Measure the hand-off's six fixed int8 scales on the verifier's own answers; prints the scale_* lines.

    Replace the scale_* keys of the recipe's handoff table with them. Needs the recipe's verifier and tokenizer
    (and its head_qat.calibration_data or keep-set corpus for prompts).
    """
    cfg = _recipe("calibrate-handoff", recipe)
    _need_full("calibrate-handoff")
    from hycoc.models import ModelNotFoundError
    from hycoc.recipe import RecipeError
    from hycoc.verifier.handoff_scales import measure_handoff_scales, toml_lines

    try:
        scales = measure_handoff_scales(cfg, prompts=prompts, max_new_tokens=max_new_tokens, percentile=percentile)
    except (RecipeError, ModelNotFoundError, ValueError) as e:
        raise _fail("calibrate-handoff", str(e)) from None
    typer.echo(toml_lines(scales, percentile, prompts))


@app.command()
def bench(
    recipe: Path = RECIPE_ARG,
    dataset: Optional[str] = typer.Option(
        None, help="spec-bench, long-summary (long documents filling the verifier's context, in the paper's "
        "2-shot summarization prompt), or a path: a Spec-Bench question JSONL or an InfiniteBench "
        "longbook_sum_eng.jsonl (the paper's first 50 in HELMET's order) (default: the recipe's bench.dataset, else "
        "spec-bench)", show_default=False),
    limit: Optional[int] = typer.Option(None, min=1, help="use the first N questions (default: all 480)",
                                        show_default=False),
    max_prompt_tokens: Optional[int] = typer.Option(
        None, min=16, help="long documents: cut each document at a line end so its prompt has at most N tokens, as "
        "the paper cut the novels to 32K (default: uncut; a prompt the verifier cannot hold is refused at OPEN "
        "with context_overflow)", show_default=False),
    configs: str = typer.Option(",".join(BENCH_CONFIGS), help="comma-separated configurations (paper Table 5)"),
    link: Optional[str] = typer.Option(
        None, help="link model per frame: lte, 5g, none or RTT_MS:MBPS (round trip ms : megabit/s) "
        "(default: the recipe's bench.link)", show_default=False),
    runs: Optional[int] = typer.Option(None, min=1, help="repetitions per configuration (default: the recipe's)",
                                       show_default=False),
    out: Path = typer.Option(Path("runs/bench"), help="folder for records.jsonl, results.json and plots"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in --out"),
    bundle: Optional[Path] = typer.Option(
        None, help="device bundle (default: bundles/<recipe name>-cpu, built first when missing)", show_default=False),
    backend: Optional[Backend] = typer.Option(
        None, help="device backend of the bundle's graphs (default: the bundle's target)", show_default=False),
    cost_model: Optional[Path] = typer.Option(
        None, help="cost-model JSON for g projected (benchmarks/verifier_cost_model.py); default: measured here",
        show_default=False),
    max_new_tokens: Optional[int] = typer.Option(
        None, min=1, help="output cap per request (default: the recipe's bench.output_cap)", show_default=False),
    turns: int = typer.Option(
        2, min=1, max=2, help="2: questions with a second turn (MT-bench) continue on the same session with the "
        "configuration's own first answer in the conversation, as the paper's SB-480 (KV kept; per-turn table of "
        "prefill ms saved, g, MAT); 1: first turns only"),
    thinking: bool = typer.Option(
        False, "--thinking", help="prompts with the chat template's thinking switch on; quality scores the final "
        "answer, not the thought (default off, as the recipe runs: README \"Chat format\")"),
    device_profile: Optional[Path] = typer.Option(
        None, help="device_profile.json from `hycoc profile`: phone draft ms per round and delivery tok/s per "
        "configuration from its profiled graph times (default: the labelled estimate, hycoc/device_time.py)",
        show_default=False),
    remeasure_cost_model: bool = typer.Option(
        False, "--remeasure-cost-model", help="measure the cost model again even when OUT/cost_model.json exists "
        "(--resume reuses it, so the summary stays as it was)"),
    table_format: TableFormat = typer.Option(
        TableFormat.table, "--format", help="how the results are printed: table (fit to the terminal's width, or "
        "COLUMNS, 120 when redirected), markdown or csv"),
) -> None:
    """Benchmark every configuration on the same prompts, verifier and seed (paper Table 2, App. G).

    The verifier runs as a separate `hycoc verify-server` process on loopback; the device runtime runs here and
    talks to it through the wire protocol. Writes OUT/records.jsonl (one line per finished request; --resume
    continues), OUT/results.json (summary + records) and PNG plots, and prints the table.
    """
    from hycoc.bench.datasets import DatasetError
    from hycoc.recipe import check_link

    cfg = _recipe("bench", recipe)
    unknown = [c for c in configs.split(",") if c not in BENCH_CONFIGS]
    if unknown:
        raise _fail("bench", f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(BENCH_CONFIGS)}", code=2)
    if link is not None:
        from hycoc.runtime.transport import parse_link

        try:  # the recipe's own check, so the CLI and the recipe accept the same strings
            check_link(link)
            parse_link(link)
        except ValueError:
            raise _fail("bench", f"--link {link!r}: allowed: lte, 5g, none or RTT_MS:MBPS such as 45:50",
                        code=2) from None
    if cost_model is not None and not cost_model.is_file():
        raise _fail("bench", f"--cost-model {cost_model}: no such file")
    if device_profile is not None:
        from hycoc.bench.device_profile import DeviceProfileError, load_device_costs

        try:
            load_device_costs(device_profile)   # a bad file fails before anything runs
        except DeviceProfileError as e:
            raise _fail("bench", str(e), code=2) from None
    _need_full("bench")
    from hycoc.bench.runner import BenchError, BenchPlan, run_bench
    from hycoc.bundle import BundleError
    from hycoc.bench.cost_model import CostModelError
    from hycoc.chat import ChatFormatError
    from hycoc.runtime.transport import TransportError

    questions, dataset_name, bundle_dir = _bench_questions(cfg, recipe, bundle, dataset, max_prompt_tokens)
    plan = BenchPlan(questions=questions[:limit] if limit else questions,
                     configs=[c for c in BENCH_CONFIGS if c in configs.split(",")], runs=runs or cfg.bench.runs,
                     link=link or cfg.bench.link, output_cap=max_new_tokens or cfg.bench.output_cap, out=out,
                     turns=turns, thinking=thinking, dataset=dataset_name)
    try:
        run_bench(cfg, recipe, plan, bundle_dir=bundle_dir, backend=_bundle_backend(bundle_dir, backend),
                  resume=resume, cost_model_path=cost_model, device_profile_path=device_profile,
                  remeasure_cost_model=remeasure_cost_model, fmt=table_format.value)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (BenchError, BundleError, TransportError, CostModelError, ChatFormatError) as e:
        raise _fail("bench", str(e)) from None


def _bench_questions(cfg, recipe: Path, bundle: Optional[Path], dataset: Optional[str],
                     max_prompt_tokens: Optional[int]):
    """``hycoc bench``'s questions: (questions, the dataset's name for the table, the bundle folder). The dataset is
    ``--dataset`` (a built-in name or a path), else the recipe's bench.dataset, else spec-bench
    (`hycoc.bench.datasets.load_bench_dataset`); with ``--max-prompt-tokens`` long documents are cut to fit, counted
    with the bundle's chat format (`hycoc.chat.Chat.prompt`)."""
    from hycoc.bench.datasets import BUILTIN_DATASETS, DatasetError, is_long_summary_file, load_bench_dataset

    spec = dataset or cfg.resolve_path(cfg.bench.dataset) or DEFAULT_DATASET
    path = BUILTIN_DATASETS.get(str(spec), Path(spec))
    long_doc = is_long_summary_file(path)
    if (dataset is not None and dataset not in BUILTIN_DATASETS and not Path(dataset).exists()
            and not Path(dataset).suffix and "/" not in dataset):          # a mistyped name, not a path
        raise _fail("bench", f"--dataset {dataset}: not a built-in dataset ({', '.join(BUILTIN_DATASETS)}) and no "
                    "such file")
    try:
        questions = load_bench_dataset(path)          # every file error before a bundle is (maybe) built
        bundle_dir = _bench_bundle("bench", cfg, recipe, bundle)
        if long_doc and max_prompt_tokens is not None:
            from hycoc.runtime.device_bundle import open_bundle

            chat = open_bundle(bundle_dir, "cpu", verify=False).chat      # the bundle's own chat format
            questions = load_bench_dataset(path, prompt_tokens=lambda text: len(chat.prompt(text)),
                                           max_prompt_tokens=max_prompt_tokens)
    except DatasetError as e:
        raise _fail("bench", str(e)) from None
    name = str(dataset) if dataset in BUILTIN_DATASETS else ("long-document" if long_doc else "Spec-Bench")
    return questions, name, bundle_dir


def _bench_bundle(command: str, cfg, recipe: Path, bundle: Optional[Path]) -> Path:
    """``--bundle``, else bundles/<recipe name>-cpu, built there first when it has no manifest."""
    from hycoc.bench.runner import default_bundle_dir

    bundle_dir = bundle or default_bundle_dir(cfg, REPO_ROOT)
    if not (bundle_dir / "manifest.json").is_file():
        if bundle is not None:
            what = "no manifest.json there" if bundle.is_dir() else "no such folder"
            raise _fail(command, f"--bundle {bundle}: {what}; build one with hycoc build")
        typer.echo(f"hycoc {command}: no bundle at {bundle_dir}; building it (hycoc build {recipe} --target cpu)",
                   err=True)
        from hycoc.passes.build import build_bundle

        build_bundle(cfg, "cpu", bundle_dir, REPO_ROOT / ".hycoc-cache")
    return bundle_dir


class TuneMode(str, Enum):
    hyco = "hyco"
    specedge_eps = "specedge-eps"


@app.command("tune-epsilon")
def tune_epsilon(
    recipe: Path = RECIPE_ARG,
    validation_data: Optional[Path] = typer.Option(
        None, help="held-out conversations JSONL (default: the recipe's tune.validation_data)", show_default=False),
    prompts: Optional[int] = typer.Option(None, min=1, help="validation prompts (default: the recipe's tune.prompts)",
                                          show_default=False),
    epsilons: Optional[str] = typer.Option(
        None, help="comma-separated thresholds in (0, 1) (default: the recipe's tune.epsilons); exact (1) always runs",
        show_default=False),
    mode: Optional[TuneMode] = typer.Option(None, help="configuration swept (default: the recipe's tune.mode)",
                                            show_default=False),
    temperature: Optional[float] = typer.Option(
        None, min=0.0, help="sampling temperature (default: the recipe's sampling.temperature)", show_default=False),
    max_new_tokens: Optional[int] = typer.Option(
        None, min=1, help="output cap per request (default: the recipe's tune.max_new_tokens)", show_default=False),
    out: Path = typer.Option(Path("runs/tune-epsilon"), help="folder for records.jsonl and tune.json"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted sweep in --out"),
    bundle: Optional[Path] = typer.Option(
        None, help="device bundle (default: bundles/<recipe name>-cpu, built first when missing)", show_default=False),
    backend: Optional[Backend] = typer.Option(
        None, help="device backend of the bundle's graphs (default: the bundle's target)", show_default=False),
    cost_model: Optional[Path] = typer.Option(
        None, help="cost-model JSON for g projected (benchmarks/verifier_cost_model.py); default: measured here",
        show_default=False),
) -> None:
    """Choose epsilon of epsilon-threshold acceptance on a validation set (paper §3, App. D), guarded by quality.

    Runs every threshold and exact acceptance on the same held-out prompts and seeds (verifier in its own process,
    as hycoc bench), then reports per epsilon: MAT, projected g and the answers' text metrics paired against exact.
    Rule: an epsilon is admissible when, against exact, the mean zlib compressed/raw ratio falls by at most
    tune.max_compression_drop, the share of words in repeated 4-grams rises by at most tune.max_repetition_rise and
    distinct-2 falls by at most tune.max_distinct2_drop (exact always is); the choice is the admissible epsilon with
    the lowest projected g, a g within tune.g_tie_pct % of it counting as a tie won by the larger epsilon.
    Writes OUT/records.jsonl and OUT/tune.json and prints the line to put in the recipe's acceptance table.
    """
    from hycoc.bench.datasets import DatasetError, load_spec_bench

    cfg = _recipe("tune-epsilon", recipe)
    eps_list = list(cfg.tune.epsilons)
    if epsilons is not None:
        try:
            eps_list = [float(x) for x in epsilons.split(",") if x.strip()]
        except ValueError:
            eps_list = []
        if not eps_list or not all(0 < e < 1 for e in eps_list):
            raise _fail("tune-epsilon", f"--epsilons {epsilons!r}: allowed: comma-separated numbers in (0, 1), "
                        "such as 0.005,0.02", code=2)
    path = validation_data or cfg.resolve_path(cfg.tune.validation_data)
    if path is None:
        raise _fail("tune-epsilon", f"{recipe}: tune.validation_data is empty; set it to a JSONL of held-out "
                    "conversations (or pass --validation-data)")
    if cost_model is not None and not cost_model.is_file():
        raise _fail("tune-epsilon", f"--cost-model {cost_model}: no such file")
    bench_path = cfg.resolve_path(cfg.bench.dataset) or DEFAULT_DATASET
    try:
        benchmark_turns = {q.turns[0] for q in load_spec_bench(bench_path)} if bench_path.is_file() else set()
    except DatasetError as e:
        raise _fail("tune-epsilon", str(e)) from None
    from hycoc.bench.tune_epsilon import Tolerance, TuneError, TunePlan, load_validation, run_tune

    try:
        questions = load_validation(path, prompts or cfg.tune.prompts, benchmark_turns=benchmark_turns,
                                    keep_set_corpus=cfg.resolve_path(cfg.keep_set.corpus))
    except TuneError as e:
        raise _fail("tune-epsilon", str(e)) from None
    _need_full("tune-epsilon")
    from hycoc.bench.runner import BenchError
    from hycoc.bundle import BundleError
    from hycoc.bench.cost_model import CostModelError
    from hycoc.runtime.transport import TransportError

    bundle_dir = _bench_bundle("tune-epsilon", cfg, recipe, bundle)
    plan = TunePlan(questions=questions, epsilons=eps_list, mode=(mode.value if mode else cfg.tune.mode),
                    output_cap=max_new_tokens or cfg.tune.max_new_tokens,
                    temperature=cfg.sampling.temperature if temperature is None else temperature,
                    tolerance=Tolerance.from_recipe(cfg.tune), out=out)
    try:
        run_tune(cfg, recipe, plan, bundle_dir=bundle_dir, backend=_bundle_backend(bundle_dir, backend),
                 resume=resume, cost_model_path=cost_model)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (TuneError, BenchError, BundleError, TransportError, CostModelError) as e:
        raise _fail("tune-epsilon", str(e)) from None


@app.command()
def inspect(
    target: Path = typer.Argument(..., help="a bundle folder, or a recipe TOML (real-shape plan, no weights needed)",
                                  show_default=False),
    json_out: bool = typer.Option(False, "--json", help="emit JSON instead of tables"),
) -> None:
    """Print a bundle's manifest, or a recipe's graphs, sizes and hand-off bytes on real shapes."""
    if target.suffix == ".toml":
        config = _recipe("inspect", target)
        from hycoc.passes.plan import PlanError, plan_json, real_shape_plan

        from hycoc.chat_template import chat_summary
        from hycoc.device_time import plan_estimate

        try:
            plan = real_shape_plan(config)
        except PlanError as e:
            raise _fail("inspect", str(e)) from None
        plan["chat"] = chat_summary(config)
        plan["device_time_estimate"] = plan_estimate(plan)
        if json_out:
            typer.echo(plan_json(plan), nl=False)
            return
        _print_plan(plan)
        _print_chat(plan["chat"])
        _print_device_estimate(plan["device_time_estimate"])
        return
    if not target.is_dir():
        raise _fail("inspect", f"{target}: neither a bundle folder nor a recipe .toml", code=2)
    from hycoc.bundle import BundleError, load_manifest

    try:
        manifest = load_manifest(target, verify=True)
    except BundleError as e:
        raise _fail("inspect", str(e)) from None
    if json_out:
        typer.echo(manifest.to_json(), nl=False)
        return
    _print_manifest(manifest)


@app.command()
def profile(
    bundle: Path = typer.Argument(..., help="an htp-v81 or qai-hub bundle folder", show_default=False),
    device: str = typer.Option("Samsung Galaxy S26 (Family)", help="the phone as Qualcomm AI Hub names it "
                               "(`qai-hub list-devices`)"),
    out: Optional[Path] = typer.Option(None, help="where to write the profile (default: BUNDLE/device_profile.json)",
                                       show_default=False),
    graph: Optional[list[str]] = typer.Option(None, help="profile only these graphs (repeatable; default: all)",
                                              show_default=False),
) -> None:
    """Profile each graph of a bundle on a phone through Qualcomm AI Hub (one inference job with profile=True per
    graph) and write device_profile.json for `hycoc bench --device-profile`. Needs the qai-hub package and an API
    token; without them it fails at once, before anything is uploaded."""
    from hycoc.bench.device_profile import DeviceProfileError, profile_bundle
    from hycoc.bundle import BundleError
    from hycoc.targets.qai_hub import QaiHubDeviceError, QaiHubSetupError, check_setup

    if not bundle.is_dir():
        raise _fail("profile", f"{bundle}: not a bundle folder", code=2)
    try:
        hub = check_setup()
        result = profile_bundle(bundle, device, hub=hub, out=out, graphs=graph,
                                on_job=lambda g, j: typer.echo(f"profile: graph {g}: AI Hub inference job {j}"))
    except (QaiHubSetupError, QaiHubDeviceError, DeviceProfileError, BundleError) as e:
        raise _fail("profile", str(e)) from None
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"device profile on {result['device']} (AI Hub)")
    for col in ("graph", "job", "execute ms median", "p90", "runs", "peak MB", "top ops (ms)"):
        t.add_column(col, justify="left" if col in ("graph", "job", "top ops (ms)") else "right")
    for g, v in result["graphs"].items():
        ops = ", ".join(f"{o['type']} {o['ms']:.2f}" for o in v["top_ops"][:3])
        peak = "-" if v["peak_memory_bytes"] is None else f"{v['peak_memory_bytes'] / 1e6:.1f}"
        t.add_row(g, v["job"], f"{v['execute_ms_median']:.3f}", f"{v['execute_ms_p90']:.3f}", str(v["runs"]), peak,
                  ops)
    Console(width=160).print(t)
    typer.echo(f"wrote {out or bundle / 'device_profile.json'}")


def _print_device_estimate(est: dict) -> None:
    """`hycoc inspect RECIPE`: the device-time estimate per graph call and each anchor's residual."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    p = est["npu_profile"]
    mac = "unbound by the anchors (memory-bound)" if p["tmacs"] is None else f"{p['tmacs']:.2f} TMAC/s"
    graphs = Table(title=f"device time per graph call at the real shape: {est['label']}; NPU profile {p['name']}: "
                         f"{p['bandwidth_gbps']:.1f} GB/s, int16 MACs {mac}, {p['overhead_ms']:.2f} ms per call, "
                         f"{p['host_ms_per_slm_pass']:.1f} ms host per SLM pass")
    for col in ("graph", "MB per call", "GMAC per call", "estimated ms"):
        graphs.add_column(col, justify="left" if col == "graph" else "right")
    for g, v in est["graphs"].items():
        graphs.add_row(g, f"{v['bytes'] / 1e6:.1f}", f"{v['macs'] / 1e9:.2f}", f"{v['estimate_ms']:.2f}")
    console.print(graphs)
    anchors = Table(title="the estimate against device figures (fit: fitted to; check: not fitted)")
    for col in ("anchor", "kind", "figure ms", "estimate ms", "residual ms", "residual %", "source"):
        anchors.add_column(col, justify="left" if col in ("anchor", "kind", "source") else "right")
    for a in est["anchors"]:
        anchors.add_row(escape(a["anchor"]), a["kind"], f"{a['figure_ms']:.1f}", f"{a['estimate_ms']:.1f}",
                        f"{a['residual_ms']:+.1f}", f"{a['residual_pct']:+.1f}", escape(a["source"]))
    console.print(anchors)


def _print_chat(chat: dict) -> None:
    """The chat section of `hycoc inspect RECIPE` (`hycoc.chat_template.chat_summary`)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    if not chat["available"]:
        console.print(f"chat format: not read ({escape(chat['why'])}); it will read:")
        for what, where in chat["reads"].items():
            console.print(f"  {what}: {escape(where)}")
        return
    console.print(f"chat format ({escape(chat['sources']['template'])}): the prompt for 'Hello' is "
                  f"{escape(repr(chat['prompt']))}, {len(chat['prompt_ids'])} tokens; a next turn opens with "
                  f"{escape(repr(chat['next_turn']))}")
    stops = Table(title=f"stop tokens ({escape(chat['sources']['stop_ids'])})")
    for col in ("id", "token"):
        stops.add_column(col)
    for s in chat["stop"]:
        stops.add_row(str(s["id"]), escape(s["token"]))
    console.print(stops)
    thinking = (f"thinking: --thinking renders {escape(repr(chat['thinking_prompt']))}" if chat["thinking"]
                else "thinking: the template has no switch (enable_thinking renders the same)")
    reasoning = (f"reasoning channel {escape(repr(chat['reasoning'][0]))} ... {escape(repr(chat['reasoning'][1]))} "
                 f"({escape(chat['sources']['reasoning'])})" if chat["reasoning"] else "no reasoning channel")
    console.print(f"{thinking}; {reasoning}; default off (README \"Chat format\")")


def _print_verifier_kv(console, kv: dict) -> None:
    """The plan's verifier KV table: bytes per session and sessions per pool, full-length vs windowed layout."""
    from rich.table import Table

    table = Table(title=f"verifier KV per session ({kv['kv_dtype']}; sliding layers keep "
                        f"{kv['sliding_retained_positions']:,} positions + {kv['tree_rows']} tree rows, full layers "
                        f"the context)")
    pool = kv["pool_bytes"] / 1e9
    for col in ("context", "full-length GB", f"full-length sessions / {pool:g} GB", "windowed GB",
                f"windowed sessions / {pool:g} GB"):
        table.add_column(col, justify="right")
    for n, after in kv["kv_bytes_per_session"].items():
        fit = kv["sessions_per_pool"][n]
        table.add_row(f"{int(n):,}", f"{kv['full_length_bytes'][n] / 1e9:.3f}", f"{fit['full_length']:,}",
                      f"{after / 1e9:.3f}", f"{fit['windowed']:,}")
    console.print(table)


def _print_plan(plan: dict) -> None:
    """`hycoc inspect RECIPE` tables: sources and assumptions, graph IO, sizes vs the paper, hand-off bytes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    r = plan["round"]
    console.print(f"real-shape plan of recipe {plan['recipe']} (no weights read): keep set {r['keep_set']:,}, "
                  f"W {r['head_window']:,}, B {r['node_budget']} ({r['tree_rows']} tree rows, SLM graph "
                  f"{r['slm_rows']} rows)")
    models = Table(title="models")
    for col in ("role", "parameters", "hidden", "layers", "config from"):
        models.add_column(col, justify="right" if col in ("parameters", "hidden", "layers") else "left")
    for role, m in plan["models"].items():
        models.add_row(role, f"{m['params']:,}", str(m["hidden_size"]), str(m["layers"]), escape(plan["sources"][role]))
    console.print(models)
    for name, g in plan["graphs"].items():
        io = Table(title=f"{name} graph: inputs and outputs")
        for col in ("", "name", "shape", "dtype", "note"):
            io.add_column(col)
        for kind in ("inputs", "outputs"):
            for s in g[kind]:
                io.add_row(kind[:-4], s["name"], "x".join(map(str, s["shape"])),
                           s["dtype"], escape(s.get("note", "")))
        console.print(io)
        w = g["weights"]
        bits = ", ".join(f"{k}: {v['tensors']} tensors / {v['weights']:,} weights / {v['bytes'] / 1e6:.1f} MB"
                         for k, v in w["by_bits"].items())
        console.print(f"  weights: {bits}; scales {w['scale_bytes'] / 1e6:.2f} MB, other "
                      f"{w['other_param_bytes'] / 1e6:.2f} MB; total {w['total_bytes'] / 1e6:.1f} MB")
    device = Table(title="device bytes")
    device.add_column("item")
    device.add_column("MB", justify="right")
    for key, value in plan["device_bytes"].items():
        device.add_row(key, f"{value / 1e6:.2f}")
    console.print(device)
    h = plan["handoff"]
    wire_t = Table(title=f"wire (verifier layers {h['verifier_layers']['sliding']} sliding / "
                         f"{h['verifier_layers']['full']} full, kv dims {h['kv_dim_sliding']} / {h['kv_dim_full']})")
    wire_t.add_column("item")
    wire_t.add_column("bytes", justify="right")
    for key in ("handoff_bytes_per_round", "handoff_bytes_per_position", "first_handoff_bytes", "first_reply_bytes",
                "tree_bytes_per_round"):
        wire_t.add_row(key, f"{h[key]:,}")
    console.print(wire_t)
    _print_verifier_kv(console, plan["verifier"])
    paper = Table(title="plan vs paper")
    for col in ("quantity", "paper", "plan", "difference", "%", "paper source"):
        paper.add_column(col, justify="left" if col in ("quantity", "paper source") else "right")
    for key, p in plan["paper"].items():
        paper.add_row(key, f"{p['paper']:,}", f"{p['plan']:,}", f"{p['diff']:+,}", f"{p['diff_pct']:+.2f}",
                      escape(p["source"] + (f" ({p['note']})" if "note" in p else "")))
    console.print(paper)
    bm = plan.get("bit_maps")
    if bm:
        maps = Table(title=f"SLM bit map (in use: {bm['source']}) vs the paper's 754 MB graph")
        for col in ("map", "SLM graph MB", "paper MB", "%", "int2 / int4 / int8 MB", "as compiled MB", "rules"):
            maps.add_column(col, justify="left" if col in ("map", "rules") else "right")
        for r in bm["maps"]:
            b = r["by_bits"]
            maps.add_row(escape(r["map"]), f"{r['slm_graph_bytes'] / 1e6:.1f}", f"{r['paper_bytes'] / 1e6:.0f}",
                         f"{r['diff_pct']:+.2f}", " / ".join(f"{b.get(k, 0) / 1e6:.1f}" for k in ("int2", "int4", "int8")),
                         f"{r['htp_graph_bytes'] / 1e6:.1f}", escape(r["text"]))
        hs = bm["head_side"]
        maps.add_row("head side (graph + E)", f"{hs['total_bytes'] / 1e6:.1f}", f"{hs['paper_bytes'] / 1e6:.0f}",
                     f"{hs['diff_pct']:+.2f}", "", "", escape(hs["note"]))
        console.print(maps)
        s = bm["search"]
        console.print(f"  {s['maps_within']} of {s['maps_tried']} group-wise maps land within "
                      f"{100 * s['tolerance']:.0f} % of {s['target_bytes'] / 1e6:.0f} MB: the size alone does not fix "
                      "the map; a checkpoint's own quantization_config replaces the assumed one. 'as compiled': "
                      "2-bit weights stored as int4 in the QDQ graph (the HTP has no int2)")
    budget = plan.get("context_budget") or {}
    if budget.get("graphs"):
        console.print(f"context budget ({budget['profile']}, {budget['limit_bytes']:,} bytes): " + ", ".join(
            f"{n} {g['bytes'] / 1e6:.1f} MB {'fits' if g['fits'] else 'OVER: ' + str(g['shards_needed']) + ' shards'}"
            for n, g in budget["graphs"].items()))
    if plan["assumptions"]:
        console.print("assumed:")
        for a in plan["assumptions"]:
            console.print(f"  - {escape(a)}")


def _print_manifest(manifest) -> None:
    """`hycoc inspect BUNDLE` tables: summary, files, graphs (IO with encodings, weights, ops), round, hand-off."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    t = manifest.target
    where = f"HTP v{t.htp_arch} {t.soc_model} (soc id {t.soc_id})" if t.backend == "htp" else "onnxruntime CPU EP"
    tools = ", ".join(f"{k} {v}" for k, v in (("onnxruntime", t.onnxruntime), ("onnxruntime-qnn", t.onnxruntime_qnn),
                                              ("QNN SDK", t.qnn_sdk)) if v)
    total = sum(f.bytes for f in manifest.files)
    console.print(f"bundle of recipe {manifest.recipe.name} (sha256 {manifest.recipe.sha256[:12]}), target {t.name}: "
                  f"{where}")
    console.print(f"built with {tools or 'tool versions unknown'}")
    console.print(f"schema {manifest.schema_version}, created {manifest.created_at}, {len(manifest.files)} files, "
                  f"{total / 1e6:.3f} MB, keep set {manifest.keep_set_size} tokens")
    c = manifest.chat
    if c is None:
        console.print("chat: none recorded (built before the chat format was; `hycoc run` refuses it: rebuild)")
    else:
        from rich.markup import escape

        stops = ", ".join(f"{i} {t}" for i, t in zip(c.stop_ids, c.stop_tokens))
        turns = c.turns["default"]
        console.print(escape(f"chat: stop ids {stops}; turns: first {turns.first!r}, user_end {turns.user_end!r}, "
                             f"next {turns.next!r}; thinking {'yes' if c.has_thinking else 'no'}; template sha256 "
                             f"{c.template_sha256[:12]}"))

    files = Table(title="files")
    for col in ("path", "role", "MB", "sha256"):
        files.add_column(col, justify="right" if col == "MB" else "left")
    for f in manifest.files:
        files.add_row(f.path, f.role, f"{f.bytes / 1e6:.3f}", f.sha256[:16])
    console.print(files)

    for g in manifest.graphs:
        io = Table(title=f"graph {g.name} ({g.role}): {g.file}"
                   + (f" -> {g.context_binary}" if g.context_binary else ""))
        for col in ("", "name", "shape", "dtype", "encoding"):
            io.add_column(col)
        for kind, specs in (("in", g.inputs), ("out", g.outputs)):
            for s in specs:
                e = s.encoding
                enc = f"{e.dtype} scale {e.scale:.6g} zp {e.zero_point}" if e else "-"
                io.add_row(kind, s.name, "x".join(map(str, s.shape)) or "scalar", s.dtype, enc)
        console.print(io)
        bits = ", ".join(f"{k}: {w.tensors} tensors / {w.elements:,} weights" for k, w in g.weight_bits.items())
        console.print(f"  weights: {bits or 'none quantized'}")
        console.print("  ops: " + ", ".join(f"{k} {n}" for k, n in g.op_counts.items()))

    r = manifest.round
    rounds = Table(title="round constants")
    rounds.add_column("constant")
    rounds.add_column("value", justify="right")
    for name, value in (("K (chain_length)", r.chain_length), ("D (sibling_depth)", r.sibling_depth),
                        ("B (node_budget)", r.node_budget), ("W (head_window)", r.head_window),
                        ("slm_window", r.slm_window), ("slm_sliding_window", r.slm_sliding_window),
                        ("head_query_position_offset", r.head_query_position_offset),
                        ("lambda (depth_cost)", r.depth_cost), ("epsilon", r.epsilon),
                        ("acceptance", r.acceptance_mode), ("slm_candidates", r.slm_candidates),
                        ("slm_passes", r.slm_passes), ("specedge passes / nodes", f"{r.specedge_passes} / "
                                                                                  f"{r.specedge_nodes}"),
                        ("temperature", r.temperature), ("top_k", r.top_k), ("top_p", r.top_p),
                        ("max_new_tokens", r.max_new_tokens), ("seed", r.seed)):
        rounds.add_row(name, str(value))
    q = manifest.quantization
    rounds.add_row("head weight bits / SLM activation bits / KV bits",
                   f"{q.head_weight_bits} / {q.slm_activation_bits} / {q.kv_bits}")
    console.print(rounds)

    h = manifest.handoff
    hand = Table(title=f"hand-off: int{h.bits} ({h.hidden})")
    hand.add_column("scale")
    hand.add_column("value", justify="right")
    for name in ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full"):
        hand.add_row(name, f"{getattr(h, 'scale_' + name):.6g}")
    console.print(hand)


def package_versions() -> dict[str, str]:
    """Versions of Python and the packages hycoc uses, "not installed" for those missing (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in ("hycoc", "numpy", "torch", "transformers", "tokenizers", "onnx", "onnxscript", "onnx-ir",
                 "onnxruntime", "onnxruntime-qnn"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


@app.command()
def doctor() -> None:
    """Report package versions, whether the QNN EP loads, and which HTP archs it compiles for."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="hycoc doctor")
    table.add_column("package")
    table.add_column("version")
    for name, ver in package_versions().items():
        table.add_row(name, ver if ver != "not installed" else "[yellow]not installed[/yellow]")

    from hycoc.targets.qnn_ep import qnn_status

    st = qnn_status()  # loads the plugin EP and compiles a trivial 16-bit graph per HTP arch (child process)
    if st["loads"]:
        sdk = st["versions"].get("qnn_sdk")
        table.add_row("QNN EP loads", f"yes (QNN SDK {sdk})" if sdk else "yes")
        archs = st.get("archs") or {}
        ok = [f"v{a}" for a in st.get("compilable_archs", [])]
        bad = [f"v{a}" for a, r in archs.items() if not r["ok"]]
        table.add_row("HTP archs", (", ".join(ok) or "[red]none[/red]") + (f" [red](fail: {', '.join(bad)})[/red]"
                                                                            if bad else ""))
    else:
        table.add_row("QNN EP loads", f"[yellow]no[/yellow]: {st['error']}")
        table.add_row("HTP archs", "[yellow]none (no QNN EP)[/yellow]")
    Console().print(table)


class _TextStream:
    """A `model.generate` streamer that prints the answer to stdout and its thought (the reasoning channel) to stderr
    as tokens arrive (`hycoc.chat.AnswerStream`).

    transformers calls ``put`` first with the prompt ids (skipped), then with each new token, and ``end`` once.
    """

    def __init__(self, chat):
        from hycoc.chat import AnswerStream

        self.stream, self.prompt_seen = AnswerStream(chat), False

    @staticmethod
    def _show(pieces: tuple[str, str]) -> None:
        thought, text = pieces
        if thought:
            sys.stderr.write(thought)
            sys.stderr.flush()
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self._show(self.stream.push(value.reshape(-1).tolist()))

    def end(self) -> None:
        self._show(self.stream.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()


@app.command()
def generate(
    recipe: Path = RECIPE_ARG,
    dataset: Optional[Path] = typer.Option(
        None, help="Spec-Bench question JSONL (default: benchmarks/data/spec_bench_question.jsonl in the "
        "repository)", show_default=False),
    question_id: Optional[int] = typer.Option(
        None, help="Spec-Bench question_id whose first turn is the prompt (default: 81 unless --prompt)",
        show_default=False),
    prompt: Optional[str] = typer.Option(None, help="user message instead of a dataset question", show_default=False),
    max_new_tokens: Optional[int] = typer.Option(
        None, min=1, help="output cap in tokens (default: the recipe's sampling.max_new_tokens)", show_default=False),
    seed: Optional[int] = typer.Option(None, min=0, help="torch seed (default: the recipe's sampling.seed)",
                                       show_default=False),
    temperature: Optional[float] = typer.Option(
        None, min=0.0, help="sampling temperature, 0 = greedy (default: the recipe's sampling.temperature)",
        show_default=False),
    thinking: bool = typer.Option(
        False, "--thinking", help="let the model think first (the chat template's enable_thinking); the thought "
        "goes to stderr"),
) -> None:
    """Answer one question with the verifier alone (transformers generate, the recipe's sampling), streaming text.

    The question is wrapped in the chat template; top-k and top-p come from the recipe's sampling table.
    """
    from hycoc.bench.datasets import DatasetError, find_question, load_spec_bench

    if prompt is not None and question_id is not None:
        raise _fail("generate", "give at most one of --prompt and --question-id", code=2)
    cfg = _recipe("generate", recipe)
    _need_full("generate")
    if prompt is None:
        try:
            prompt = find_question(load_spec_bench(dataset or DEFAULT_DATASET), 81 if question_id is None else question_id).turns[0]
        except DatasetError as e:
            raise _fail("generate", str(e)) from None

    import torch

    from hycoc.chat import ChatFormatError
    from hycoc.chat_template import chat_from_recipe
    from hycoc.models import ModelNotFoundError, load_verifier, set_threads

    set_threads(cfg.verifier.threads)
    sampling = cfg.sampling
    temperature = sampling.temperature if temperature is None else temperature
    from hycoc.recipe import RecipeError

    try:
        chat = chat_from_recipe(cfg)      # the checkpoint's template and stop ids, before the weights
        prompt_ids = chat.prompt(prompt, thinking)
        model = load_verifier(cfg.model_path("verifier"), dtype=cfg.verifier.dtype, device=cfg.verifier.device)
    except (RecipeError, ModelNotFoundError, ChatFormatError) as e:
        raise _fail("generate", str(e)) from None

    typer.echo(f"[question] {prompt}", err=True)
    torch.manual_seed(sampling.seed if seed is None else seed)
    ids = torch.tensor([prompt_ids], device=cfg.verifier.device)  # (1, T)
    stops = list(chat.format.stop_ids)
    start = time.perf_counter()
    # p~ of Alg. 4 line 5 (temperature, top-k, top-p); below GREEDY_BELOW (1e-4) greedy, as the verifier.
    from hycoc.verifier.sampling import GREEDY_BELOW

    knobs = dict(do_sample=True, temperature=temperature, top_k=sampling.top_k, top_p=sampling.top_p) \
        if temperature >= GREEDY_BELOW else dict(do_sample=False)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens or sampling.max_new_tokens,
            eos_token_id=stops, pad_token_id=stops[0], streamer=_TextStream(chat), **knobs,
        )
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    typer.echo(f"[{new} tokens in {seconds:.2f} s, {new / seconds:.1f} tok/s; prompt {ids.shape[1]} tokens]",
               err=True)


#: Configurations `hycoc loadtest` can record and replay (a verifier in every round: not slm-alone).
LOADTEST_CONFIGS = tuple(c for c in BENCH_CONFIGS if c != "slm-alone")
#: `hycoc loadtest --batching` values: serial = one session per forward, batched = sessions' trees in one forward.
LOADTEST_BATCHING = ("serial", "batched")


@app.command()
def loadtest(
    recipe: Path = RECIPE_ARG,
    sessions: str = typer.Option("1,4,16,64", help="comma-separated concurrent session counts, one run each"),
    duration: float = typer.Option(20.0, min=0.5, help="seconds per run (per batching mode and session count)"),
    rate: Optional[float] = typer.Option(
        None, min=0.001, help="session arrivals per second, a seeded Poisson process (open loop); default: all "
        "sessions start at once", show_default=False),
    configs: str = typer.Option("hyco", help="comma-separated configurations (paper Table 5) the devices replay; "
                                "device i replays the i-th modulo their number"),
    server: Optional[str] = typer.Option(
        None, metavar="URL", help="a running verifier, ws://HOST:PORT (default: start `hycoc verify-server RECIPE` "
        "in a child process per --batching mode)", show_default=False),
    batching: Optional[str] = typer.Option(
        None, help="comma-separated batching modes, one server each: serial (one session per forward, the server "
        "the server's old behaviour) and/or batched (sessions' trees verified together); passed to verify-server as --batching "
        "(default: serial; with --server: the mode the server reports in /healthz, checked when given)",
        show_default=False),
    device_ms: Optional[float] = typer.Option(
        None, min=0.0, help="device drafting time between rounds, ms (default: each round's recorded time)",
        show_default=False),
    prompts: int = typer.Option(4, min=1, help="Spec-Bench questions (first turns) recorded per configuration"),
    out: Path = typer.Option(Path("runs/loadtest"), help="folder for results.json and latency_vs_sessions.png"),
    bundle: Optional[Path] = typer.Option(
        None, help="device bundle whose runtime records the rounds (default: bundles/<recipe name>-cpu, built "
        "first when missing)", show_default=False),
    cost_model: Optional[Path] = typer.Option(
        None, help="cost-model JSON for the GPU projection (its rows must cover the batches); default: an "
        "assumed H200-like GPU, flat up to 206 rows per forward", show_default=False),
    max_new_tokens: Optional[int] = typer.Option(
        None, min=1, help="output cap of each recorded request (default: the recipe's bench.output_cap)",
        show_default=False),
) -> None:
    """Load-test a verifier with many simulated devices: total tok/s, verifier ms per token, round latency
    p50/p90/p99, rows per forward and errors per session count.

    The real device runtime first records its rounds on a few Spec-Bench prompts per configuration (cached in
    .hycoc-cache/loadtest/ by recipe, bundle, configurations, prompts and cap); then asyncio devices in this one
    process replay them over the wire protocol, waiting the recorded drafting time between rounds. Writes
    OUT/results.json and OUT/latency_vs_sessions.png and prints the table; the GPU columns are a projection.
    """
    from hycoc.bench.datasets import DatasetError, load_spec_bench

    cfg = _recipe("loadtest", recipe)
    try:
        counts = [int(x) for x in sessions.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise _fail("loadtest", f"--sessions {sessions!r}: give comma-separated positive integers such as 1,4,16,64",
                    code=2)
    chosen = configs.split(",")
    unknown = [c for c in chosen if c not in LOADTEST_CONFIGS]
    if unknown:
        raise _fail("loadtest", f"--configs: unknown or without a verifier: {', '.join(unknown)}; allowed: "
                    f"{', '.join(LOADTEST_CONFIGS)}", code=2)
    modes = batching.split(",") if batching else None
    if modes is not None and any(m not in LOADTEST_BATCHING for m in modes):
        raise _fail("loadtest", f"--batching {batching!r}: allowed: {', '.join(LOADTEST_BATCHING)} (comma-separated)",
                    code=2)
    if server is not None and modes is not None and len(modes) != 1:
        raise _fail("loadtest", f"--batching {batching!r} with --server: a running server has one mode; give that "
                    "one, or leave --server out so each mode gets its own server", code=2)
    if cost_model is not None and not cost_model.is_file():
        raise _fail("loadtest", f"--cost-model {cost_model}: no such file")
    try:
        questions = load_spec_bench(cfg.resolve_path(cfg.bench.dataset) or DEFAULT_DATASET)[:prompts]
    except DatasetError as e:
        raise _fail("loadtest", str(e)) from None
    _need_full("loadtest")
    from hycoc import progress
    from hycoc.bench.cost_model import CostModelError, load_cost_model
    from hycoc.bench.loadtest import LoadTestError, run_loadtest
    from hycoc.bench.loadtrace import TraceError, load_trace, record_trace, save_trace, trace_key
    from hycoc.bundle import BundleError, sha256_file
    from hycoc.runtime.transport import TransportError

    try:
        cost = load_cost_model(cost_model) if cost_model is not None else None
    except CostModelError as e:
        raise _fail("loadtest", str(e)) from None
    bundle_dir = _bench_bundle("loadtest", cfg, recipe, bundle)
    cap = max_new_tokens or cfg.bench.output_cap
    key = trace_key(cfg.content_hash(), sha256_file(bundle_dir / "manifest.json"), chosen,
                    [q.question_id for q in questions], cap)
    trace_path = REPO_ROOT / ".hycoc-cache" / "loadtest" / f"trace-{key}.json"
    try:
        if trace_path.is_file():
            trace = load_trace(trace_path)
            typer.echo(f"hycoc loadtest: recorded rounds from {trace_path}", err=True)
        else:
            with progress.step("recording device rounds", total=len(chosen) * len(questions)) as s:
                trace = record_trace(cfg, bundle_dir, chosen, questions, cap, key=key,
                                     progress=lambda note: s.advance(note=note))
            save_trace(trace, trace_path)
            typer.echo(f"hycoc loadtest: recorded {len(trace.requests)} requests, "
                       f"{sum(len(r.rounds) for r in trace.requests)} rounds -> {trace_path}", err=True)
        run_loadtest(trace, chosen, counts, duration, modes, out, recipe_path=recipe,
                     keep_set=bundle_dir / "keep_set.npy", server_url=server, rate=rate, device_ms=device_ms,
                     cost_model=cost, meta={"recipe": str(recipe), "bundle": str(bundle_dir),
                                            "trace": str(trace_path)})
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (LoadTestError, TraceError, BundleError, TransportError) as e:
        raise _fail("loadtest", str(e)) from None


if __name__ == "__main__":
    app()
