"""Shared pieces of the ``hycoc`` commands: one-line failures, recipe loading, the auth token, port errors,
the option enums, and the typer help patch. Imports nothing heavy: every command module imports this."""

from __future__ import annotations

from enum import Enum
from pathlib import Path

import typer

from hycoc.table5 import RUN_MODES


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

    # a mark on the function (mypy knows no function attributes) and a patch of typer's method: both as meant
    display_type_rich.hycoc_flags_untyped = True  # type: ignore[attr-defined]
    TyperOption.display_type_rich = display_type_rich  # type: ignore[method-assign]


_flags_show_no_type()


def _usage_names_plain() -> None:
    """typer 0.29 writes a required argument in usage lines in braces (``Usage: hycoc run [OPTIONS] {BUNDLE}``);
    click, POSIX utility syntax and the docs write it plain (``BUNDLE``) and an optional one in brackets. Do so
    by wrapping ``typer.core.TyperArgument._usage_display_name``. Feature-detected: a typer without it is left
    alone (tests/test_cli.py checks the usage line)."""
    from typer.core import TyperArgument

    shown = getattr(TyperArgument, "_usage_display_name", None)
    if shown is None or getattr(shown, "hycoc_plain", False):
        return

    def _usage_display_name(self):
        name = shown(self)
        if self.required and name.startswith("{"):
            name = name[1:].replace("}", "", 1)
        return name

    # a mark on the function (mypy knows no function attributes) and a patch of typer's method: both as meant
    _usage_display_name.hycoc_plain = True  # type: ignore[attr-defined]
    TyperArgument._usage_display_name = _usage_display_name  # type: ignore[method-assign]


_usage_names_plain()


def _wrap_help_at_spaces() -> None:
    """click wraps help text with a ``textwrap.TextWrapper`` that breaks at hyphens, so at 80 columns a default or
    an option name is cut in two ("specedge-" / "eps", "--auth-" / "token-file"). Wrap at spaces only, by giving
    click's wrapper (``_textwrap.TextWrapper``, imported by ``formatting.wrap_text`` at each call) the setting
    ``break_on_hyphens=False`` (Python docs, textwrap.TextWrapper.break_on_hyphens), in the click typer 0.29
    ships as ``typer._click`` and in click itself. Feature-detected: a module that is not there is left alone."""
    import importlib

    for name in ("typer._click._textwrap", "click._textwrap"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        base = module.TextWrapper
        if getattr(base, "hycoc_spaces_only", False):
            continue

        # a subclass of click's class found at run time (mypy takes only static base classes), put back into the
        # module imported by name (a ModuleType to mypy, without the attribute)
        class TextWrapper(base):  # type: ignore[valid-type, misc]
            hycoc_spaces_only = True

            def __init__(self, *args, **kwargs):
                kwargs["break_on_hyphens"] = False
                super().__init__(*args, **kwargs)

        module.TextWrapper = TextWrapper  # type: ignore[attr-defined]


_wrap_help_at_spaces()


#: Repository root of an editable install.
REPO_ROOT = Path(__file__).resolve().parents[2]
#: Spec-Bench's questions, shipped in the repository (benchmarks/data/NOTICE.md).
DEFAULT_DATASET = REPO_ROOT / "benchmarks" / "data" / "spec_bench_question.jsonl"


#: The one pip command that installs Ray Serve (``hycoc serve-ray``) beside every other extra (README "Extras"):
#: ``.[serve]`` added on its own to an environment with ``.[hub]`` upgrades protobuf past qai-hub's cap.
SERVE_INSTALL = 'pip install -e ".[full,dev,qnn,hub,serve]"'


#: Commands that may not be available in this install: command -> what they need.
PENDING = {
    "build": "The compiler: hycoc build RECIPE --target htp-v81|htp-v79|htp-v75|htp-v73|cpu|qai-hub",
    "bench": "hycoc bench: the paper's Table 2 on real prompts",
}


def _target_names() -> dict[str, str]:
    from hycoc.targets.profiles import HTP_TARGETS  # dataclasses only: cheap to import

    return {n.replace("-", "_"): n for n in (*HTP_TARGETS, "cpu", "qai-hub")}


#: ``hycoc build --target``: every HTP profile (`hycoc.targets.profiles.HTP_TARGETS`), cpu and qai-hub. Members
#: made from that list (mypy reads only literal members: name them as values, ``TargetName("cpu")``).
TargetName = Enum("TargetName", _target_names(), type=str)  # type: ignore[misc]


def utf8_stdio(streams=None, windows: bool | None = None) -> None:
    """On Windows, make stdout and stderr write UTF-8 (``errors="backslashreplace"``): a console or a redirect there
    defaults to the ANSI code page (cp1252 ...), so non-Latin text or ``--json`` output would raise
    UnicodeEncodeError (Python docs, ``sys.stdout``: "On Windows ... the console uses utf-8 ... non-character devices
    such as disk files and pipes use the system locale encoding"; ``io.TextIOWrapper.reconfigure``). Elsewhere, and
    for streams without ``reconfigure`` (a test runner's), nothing changes. ``windows``: default ``os.name == "nt"``."""
    import os
    import sys

    if not (os.name == "nt" if windows is None else windows):
        return
    for stream in streams if streams is not None else (sys.stdout, sys.stderr):
        if getattr(stream, "encoding", "utf-8").lower().replace("-", "") != "utf8" and hasattr(stream, "reconfigure"):
            stream.reconfigure(encoding="utf-8", errors="backslashreplace")


#: `hycoc run --mode` (`hycoc.table5.RUN_MODES`): members hyco, hyco_exact, hyco_2p, specedge, server_head, slm_alone.
#: Made from that tuple (mypy reads only literal members: name them as values, ``RunMode("slm-alone")``).
RunMode = Enum("RunMode", {m.replace("-", "_"): m for m in RUN_MODES}, type=str)  # type: ignore[misc]


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


AUTH_TOKEN_HELP = (
    "prefer the HYCOC_AUTH_TOKEN environment variable or --auth-token-file: a token given as "
    "--auth-token is visible to every local user (ps, /proc/PID/cmdline)"
)


def _auth_token(command: str, ctx: typer.Context, token: str | None, token_file: Path | None) -> str | None:
    """The auth token from --auth-token-file, HYCOC_AUTH_TOKEN or --auth-token (in that order of preference).

    A token typed as --auth-token gets a warning on stderr (docs/serving.md "Limits": /proc/PID/cmdline shows it to
    every local user). Raises typer.Exit (code 2) for an empty token, an unreadable or empty file, or both a file and
    a command-line token."""
    source = ctx.get_parameter_source("auth_token")  # typer's own click: compare by name, not identity
    on_command_line = token is not None and getattr(source, "name", None) == "COMMANDLINE"
    if token_file is not None:
        if on_command_line:
            raise _fail(command, "give one of --auth-token and --auth-token-file", code=2)
        try:
            token = token_file.read_text(encoding="utf-8").strip()
        except (OSError, UnicodeDecodeError) as e:
            raise _fail(command, f"--auth-token-file {token_file}: cannot read it ({e})") from None
        if not token:
            raise _fail(command, f"--auth-token-file {token_file}: the file is empty")
        return token
    if token == "":
        raise _fail(command, "--auth-token is empty: give a token, or leave the option out", code=2)
    if on_command_line:
        typer.echo(
            f"hycoc {command}: warning: --auth-token on the command line is visible to every local user "
            "(ps, /proc/PID/cmdline); set HYCOC_AUTH_TOKEN or use --auth-token-file FILE instead",
            err=True,
        )
    return token


def _fail(command: str, message: str, code: int = 1) -> typer.Exit:
    typer.echo(f"hycoc {command}: {message}", err=True)
    return typer.Exit(code)


def _port_error(host: str, port: int, e: OSError, busy_hint: str) -> str:
    """One line for an address a server cannot bind (`hycoc.verifier.server.check_port`): the port and
    ``busy_hint`` when it is taken, else the address and what to give instead."""
    import errno

    if e.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {host}:{port}: {e.strerror} ({busy_hint}): pass --port N, or --port 0 for any free port"
        )
    return (
        f"cannot listen on {host}:{port}: {e.strerror or e}: pass --host with an address of this machine "
        "(127.0.0.1, or 0.0.0.0 for every interface)"
    )


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
        raise _fail(
            command,
            f"needs {' and '.join(missing)} (the compiler/verifier install): "
            "pip install torch==2.13.0 && pip install -e '.[full]'",
        )


def _pending(command: str, key: str | None = None) -> typer.Exit:
    title = PENDING[key or command]
    return _fail(command, f"not available yet ({title})", code=2)


def _recipe(command: str, path: Path):
    from hycoc.recipe import RecipeError, load_recipe

    try:
        return load_recipe(path)
    except RecipeError as e:
        raise _fail(command, f"bad recipe\n{e}") from None


RECIPE_ARG = typer.Argument(
    ..., metavar="RECIPE", help="recipe TOML file (e.g. recipes/toy.toml, recipes/gemma4.toml)", show_default=False
)
