"""``hycoc build`` (compile a recipe into a bundle) and ``hycoc inspect`` (a bundle's manifest, or a recipe's
real-shape plan), with inspect's printers. The compiler is imported inside the command bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from hycoc.cli._common import PENDING, RECIPE_ARG, TargetName, _fail, _need_full, _recipe
from hycoc.cli.options import unset

#: ``--device`` values that name where the build's torch passes run rather than a phone or laptop.
COMPUTE_DEVICES = ("cpu", "cuda")


def _target_device(command: str, device: str | None):
    """``--device NAME`` resolved through `hycoc.targets.profiles.resolve_device` (None for none, cpu or cuda);
    an unknown name exits 2 (a usage error: docs/commands.md "Exit codes") listing the known ones."""
    from hycoc.targets.profiles import UnknownTargetError, resolve_device

    if device is None or device in COMPUTE_DEVICES:
        return None
    try:
        return resolve_device(device)
    except UnknownTargetError as e:
        raise _fail(command, f"--device: {e}", code=2) from None


def _cache_cap(text: str) -> int | None:
    """``--cache-max-size`` as bytes (None for ``none``); a bad size exits 2."""
    from hycoc.passes.cache import CacheError, parse_size

    if text.strip().lower() == "none":
        return None
    try:
        return parse_size(text)
    except CacheError as e:
        raise _fail("build", f"--cache-max-size: {e}", code=2) from None


def _build_errors() -> tuple[type[Exception], ...]:
    """The errors `hycoc build` reports in one line (each names what is wrong and what to do)."""
    from hycoc.models import HeadConfigError, ModelNotFoundError
    from hycoc.passes.build import BuildError
    from hycoc.passes.calibration import CalibrationError
    from hycoc.passes.export import ExportError
    from hycoc.passes.head.errors import HeadQatError
    from hycoc.passes.keep_set import KeepSetError
    from hycoc.passes.pipeline import PipelineError
    from hycoc.passes.qdq.encodings import QdqError
    from hycoc.passes.slm.graph import SlmGraphError
    from hycoc.passes.slm.surgery import SurgeryError
    from hycoc.recipe import RecipeError
    from hycoc.targets.cpu import CpuTargetError
    from hycoc.targets.htp import HtpTargetError
    from hycoc.targets.profiles import UnknownTargetError
    from hycoc.targets.qai_hub import QaiHubDeviceError, QaiHubJobError, QaiHubSetupError
    from hycoc.verifier.loading import DeviceUnavailable

    return (
        BuildError,
        PipelineError,
        RecipeError,
        ModelNotFoundError,
        HeadConfigError,
        KeepSetError,
        HeadQatError,
        ExportError,
        SurgeryError,
        SlmGraphError,
        CalibrationError,
        QdqError,
        CpuTargetError,
        HtpTargetError,
        UnknownTargetError,
        QaiHubSetupError,
        QaiHubJobError,
        QaiHubDeviceError,
        DeviceUnavailable,
    )


#: build's long options (`hycoc.cli.options`), in the order of its parameters.
Target = Annotated[
    TargetName | None,
    unset(
        "compile target: htp-v81|htp-v79|htp-v75|htp-v73|htp-v68 = QNN HTP context binaries for that "
        "Hexagon arch, cpu = QDQ ONNX for onnxruntime's CPU EP, qai-hub = Qualcomm AI Hub compile job (default: "
        "the recipe's target.name, or the --device's arch)"
    ),
]
Out = Annotated[
    Path | None,
    unset(
        "bundle folder to write (written to a temporary folder, renamed when complete) "
        "(default: bundles/<recipe name>-<target>)"
    ),
]
Until = Annotated[str | None, unset("stop after this pass and keep its artifact for inspection", metavar="PASS")]
CacheDir = Annotated[
    Path | None, unset("cache of intermediate artifacts, keyed by content hash (default: .hycoc-cache in the cwd)")
]
NoCache = Annotated[
    bool,
    typer.Option("--no-cache", help="run every pass, reading no cache entry (the new outputs replace the entries)"),
]
CacheMaxSize = Annotated[
    str,
    typer.Option(
        metavar="SIZE",
        envvar="HYCOC_CACHE_MAX_SIZE",
        help="after the build, remove the least recently used cache entries until the cache holds at most SIZE "
        "(20GB, 500MB; this build's entries are always kept; none: never prune)",
    ),
]
BuildDevice = Annotated[
    str,
    typer.Option(
        metavar="cpu|cuda|NAME",
        help="cpu or cuda: where the verifier captures and the head's QAT run: cpu "
        "(models as saved) or cuda (the verifier in bfloat16, QAT under bfloat16 autocast, paper Table 4; cached "
        'separately per device). Any other value names the phone or laptop to build for ("Snapdragon 8 Elite", '
        '"Galaxy S24 Ultra", "Snapdragon X Elite"; list: hycoc doctor): its Hexagon arch, SoC and limits '
        "(targets/profiles.py DEVICES), torch passes on cpu",
    ),
]


def build(
    recipe: Path = RECIPE_ARG,
    target: Target = None,
    out: Out = None,
    list_passes: bool = typer.Option(False, "--list-passes", help="print the pass pipeline for the recipe and exit"),
    until: Until = None,
    cache_dir: CacheDir = None,
    no_cache: NoCache = False,
    cache_max_size: CacheMaxSize = "20GB",
    device: BuildDevice = "cpu",
) -> None:
    """Compile the recipe's MTP head and SLM into a bundle of static, quantized graphs (paper §3.2-3.4)."""
    config = _recipe("build", recipe)
    max_bytes = _cache_cap(cache_max_size)
    named = _target_device("build", device)
    compute = "cpu" if named is not None else device
    if named is not None and target is not None:  # a contradiction is a usage error, named before any import
        from hycoc.targets.profiles import device_target_conflict

        conflict = device_target_conflict(named, target.value)
        if conflict is not None:
            raise _fail("build", conflict, code=2)
    _need_full("build")
    from hycoc.passes.build import (
        BuildError,
        BuildNotReady,
        BuildSettings,
        build_bundle,
        build_pipeline,
        recipe_for_target,
    )
    from hycoc.passes.pipeline import UnknownPassError
    from hycoc.progress import stderr_console

    errors = _build_errors()
    try:
        config, name = recipe_for_target(config, target.value if target is not None else None, named)
    except BuildError as e:
        raise _fail("build", str(e)) from None
    cache = cache_dir if cache_dir is not None else Path(".hycoc-cache")
    console = stderr_console()  # redirected: one unwrapped line per message (grep finds the log path)
    if list_passes:
        typer.echo(build_pipeline(config, name, cache_dir=cache, console=console, device=compute).describe())
        return
    out_dir = out if out is not None else Path("bundles") / f"{config.recipe.name}-{name}"
    try:
        result = build_bundle(
            config,
            name,
            None if until else out_dir,
            cache,
            BuildSettings(
                until=until, console=console, device=compute, use_cache=not no_cache, cache_max_bytes=max_bytes
            ),
        )
    except KeyboardInterrupt:  # build_bundle said what it kept
        raise typer.Exit(130) from None
    except BuildNotReady as e:
        title = PENDING["build"]
        raise _fail("build", f"not available yet ({title}): {e}", code=2) from None
    except UnknownPassError as e:  # --until names no pass: a usage error
        raise _fail("build", str(e), code=2) from None
    except errors as e:  # each names what is wrong and what to do; the CLI says it in one line
        raise _fail("build", "; ".join(line.strip() for line in str(e).splitlines() if line.strip())) from None
    if result.pruned:
        from hycoc.passes.cache import format_size

        freed = format_size(sum(e.bytes for e in result.pruned))
        n = len(result.pruned)
        typer.echo(f"cache {cache}: pruned {n} entr{'y' if n == 1 else 'ies'} ({freed}) to --cache-max-size", err=True)
    if until is not None:
        typer.echo(f"stopped after {until}; its artifacts are in {result.stopped_at}")
        return
    from hycoc.inspect_report import render_built_bundle
    from hycoc.models import tokenizer_load_seconds

    render_built_bundle(result)
    for path, seconds in tokenizer_load_seconds().items():  # parsed once per process (hycoc.models)
        typer.echo(f"tokenizer {path}: parsed once, {seconds:.2f} s", err=True)


def inspect(
    target: Path = typer.Argument(
        ...,
        metavar="BUNDLE|RECIPE",
        help="a bundle folder, or a recipe TOML (real-shape plan, no weights needed)",
        show_default=False,
    ),
    json_out: bool = typer.Option(False, "--json", help="emit JSON instead of tables"),
    device: str | None = typer.Option(
        None,
        metavar="NAME",
        help='RECIPE only: plan for this phone or laptop ("Snapdragon 8 Gen 3", "Galaxy '
        'S25"): its Hexagon arch, SoC and context limit; graphs over the limit are refused with their sizes '
        "(default: the recipe's [target])",
        show_default=False,
    ),
) -> None:
    """Print a bundle's manifest, or a recipe's graphs, sizes and hand-off bytes on real shapes."""
    if target.suffix == ".toml":
        config = _recipe("inspect", target)
        named = _target_device("inspect", device)
        if device is not None and named is None:
            raise _fail("inspect", f"--device {device!r}: name a phone or laptop (list: hycoc doctor)", code=2)
        from hycoc.inspect_report import recipe_report, render_recipe_report
        from hycoc.passes.build import BuildError
        from hycoc.passes.plan import PlanError, plan_json

        try:
            plan = recipe_report(config, named)
        except (PlanError, BuildError) as e:
            raise _fail("inspect", str(e)) from None
        if json_out:
            typer.echo(plan_json(plan), nl=False)
        else:
            render_recipe_report(plan)
        if plan["chat"].get("refused"):  # the tokenizer folder is here and its chat files are refused
            raise typer.Exit(1)
        return
    if not target.is_dir():
        raise _fail("inspect", f"{target}: neither a bundle folder nor a recipe .toml")
    if device is not None:
        raise _fail("inspect", "--device plans a RECIPE; a bundle's manifest names its own target", code=2)
    from hycoc.bundle import BundleError, load_manifest
    from hycoc.inspect_report import render_manifest

    try:
        manifest = load_manifest(target, verify=True)
    except BundleError as e:
        raise _fail("inspect", str(e)) from None
    if json_out:
        typer.echo(manifest.to_json(), nl=False)
        return
    render_manifest(manifest)
