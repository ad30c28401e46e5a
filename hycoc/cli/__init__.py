"""The ``hycoc`` command line (typer). Commands are thin: they check their arguments and the recipe, then call
library functions. torch and transformers are imported inside command bodies only, so ``hycoc --help`` is fast
and the device-runtime install (no torch) can run ``hycoc run``.

One module per command group, each command an undecorated function registered here, in the README's order
(the layout of huggingface_hub's ``cli/hf.py`` and transformers' ``cli/transformers.py``):

- ``_common``: shared helpers (one-line failures, recipe loading, the auth token, port errors, option enums);
- ``build``: build, inspect;
- ``cache``: cache (the build cache's entries, pruning);
- ``run``: run (imports neither torch nor aiohttp);
- ``serve``: verify-server, serve-ray;
- ``bench``: bench, tune-epsilon, loadtest, profile;
- ``capacity``: capacity (the simulator of many devices against one verifier);
- ``tools``: generate, calibrate-handoff, doctor.

What a command checks, computes and prints lives in library modules the tests call directly: ``hycoc.inspect_report``
(inspect's and build's tables), ``hycoc.bench.inputs`` (bench's bundle, questions and option checks),
``hycoc.bench.paper.tune_epsilon.validation_questions``, ``hycoc.run_options`` (run's checks and summary line),
``hycoc.generate`` (generate), ``hycoc.doctor`` (doctor), ``hycoc.verifier.loading`` (the servers' keep set, model
checks and options).

Exit codes: 0 done; 1 bad input (recipe, dataset, missing model); 2 bad usage or a command that is not
available yet (its message says what is missing).
"""

from __future__ import annotations

import typer

from hycoc.cli import bench, build, cache, capacity, run, serve, tools
from hycoc.cli._common import DEFAULT_DATASET, REPO_ROOT, _auth_token, utf8_stdio  # noqa: F401  (imported from hycoc.cli)
from hycoc.cli.bench import BENCH_CONFIGS, LOADTEST_BATCHING, LOADTEST_CONFIGS  # noqa: F401  (imported from hycoc.cli)
from hycoc.doctor import package_versions  # noqa: F401  (imported from hycoc.cli)


class _Commands(typer.core.TyperGroup):
    """hycoc's command group: a bad option value reads like the other usage errors.

    typer 0.29 checks choices through pydantic, whose ValueError text starts with "Value error, "
    (``Invalid value for '--mode': Value error, 'fast' is not one of ...``); the prefix is dropped so the line
    names the option, the bad value and the allowed values only."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except typer.BadParameter as e:
            e.message = e.message.removeprefix("Value error, ")
            raise


app = typer.Typer(
    name="hycoc",
    cls=_Commands,
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
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="print hycoc's version and exit"
    ),
) -> None:
    """HyCo hybrid drafting: compile drafters into bundles, run the device runtime, serve the verifier."""
    utf8_stdio()  # Windows: UTF-8 stdout/stderr for every command (no-op elsewhere)


# The README's commands table, in its order; each name is the command's name on the command line.
# short_help: the line `hycoc --help` lists (click cuts the docstring's first sentence at 45 characters with "...").
app.command("generate", short_help="Answer one question with the verifier alone.")(tools.generate)
app.command("doctor", short_help="Package versions and whether the QNN EP loads.")(tools.doctor)
app.command("build", short_help="Compile a recipe's drafters into a bundle.")(build.build)
app.command("verify-server", short_help="Serve the verifier over WebSocket.")(serve.verify_server)
app.command("serve-ray", short_help="Serve the verifier on N Ray Serve replicas.")(serve.serve_ray)
app.command("loadtest", short_help="Load-test a verifier with simulated devices.")(bench.loadtest)
app.command("capacity", short_help="Devices per verifier GPU, simulated and checked.")(capacity.capacity)
app.command("run", short_help="The device runtime: answer a prompt.")(run.run)
app.command("bench", short_help="Benchmark the Table 5 configurations.")(bench.bench)
app.command("profile", short_help="Profile a bundle's graphs on a phone (AI Hub).")(bench.profile)
app.command("tune-epsilon", short_help="Choose epsilon of epsilon-threshold acceptance.")(bench.tune_epsilon)
app.command("calibrate-handoff", short_help="Measure the hand-off's int8 scales.")(tools.calibrate_handoff)
app.command("inspect", short_help="A bundle's manifest or a recipe's plan.")(build.inspect)
app.command("cache", short_help="List or prune the build cache.")(cache.cache)
