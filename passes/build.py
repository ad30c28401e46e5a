"""`hycoc build`: the whole compiler as one pipeline, and the bundle it writes (docs/design.md "The pass pipeline",
"Bundle", "Targets").

`build_pipeline(recipe, target)` assembles, in order (inputs: ``tokenizer``, ``torch_verifier``, ``torch_head``
from the recipe's ``[models]``, loaded by `build_inputs`):

    keep_set -> calibration_answers -> head_qat -> head_export -> qdq_head -> slm_surgery -> slm_tree_graph
             -> qdq_slm -> slm_decode_graph -> target_<name>

``slm_decode_graph`` is the SLM's 1-row decode graph for SLM-alone decoding (`hycoc.passes.slm.decode`), the bundle's
graph ``slm_decode`` (role "slm"); on htp targets it shares one context binary with ``slm`` (`SHARED_CONTEXTS`,
``target.share_weights``).

With ``[target] slm_shards`` != 1 the SLM is split by layers: ``slm_surgery -> slm_shards -> target_<name>``
(`hycoc.passes.slm.shard_build`: per-shard export and QDQ calibrated on the float chain), the bundle's graphs
``slm.s0``, ``slm.s1``, ... (on htp one context binary per shard), chained by the runtime
(`hycoc.runtime.graphs.ShardChainRunner`); no ``slm_decode`` graph then.

``calibration_answers`` has the verifier answer the calibration prompts once, in batches; the head QAT, the head's
QDQ calibration and the SLM's read its answers (App. A: both calibrations use the same prompts and greedy answers).

``qdq_head`` is `hycoc.passes.qdq.quantize.QdqQuantize("onnx_head", "qdq_head")` once that pass takes the head; until
then `hycoc.passes.head.export.HeadQdq` (`head_qdq_pass`).

The target step (`hycoc.passes.target_step.TargetPass`) turns the QDQ graphs into what the bundle holds: ``cpu``
the QDQ ONNX itself, ``htp-v81`` (and every ``htp-vNN`` of `hycoc.targets.profiles.HTP_TARGETS`) EPContext models +
QNN context binaries (CPU fallback disabled, size planner on, the recipe's ``[target]`` profile; `recipe_for_target`
points ``[target]`` at another arch or a named device), ``qai-hub`` QNN DLCs compiled on Qualcomm AI Hub and linked
into one weight-shared context binary, wrapped as EPContext models like htp-v81's (the manifest's ``target.hub``
keeps the job ids, device and QAIRT version). Before any of that each graph takes its shipped form
(`hycoc.passes.target_step.ship_file`: no ``logits`` output beside the graph's own top-k; with ``[target]
quantized_io`` the KV rings as uint16 inputs and the new KV rows as uint16 outputs; on HTP targets TopK's order among
equal values made the CPU EP's); the QDQ graph with every output stays beside it (``check_source``) for the checks.
Its output is cached like any pass.

`build_bundle` runs the pipeline and writes the bundle (`hycoc.passes.bundle_write.write_bundle`, a temporary folder
renamed when complete): tokenizer.json, keep_set.npy, the host LUTs, rotary tables, the graphs, and report.json
(every pass's numbers: QAT agreement, SQNR, export errors).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hycoc.passes.artifacts import Artifact, TokenizerArtifact, TorchModelArtifact
from hycoc.passes.bundle_write import write_bundle
from hycoc.passes.pipeline import Pass, Pipeline, PipelineResult, check_until
from hycoc.passes.target_step import TARGETS, BuildError, TargetFilesArtifact, TargetPass
from hycoc.targets.profiles import HTP_TARGETS, DeviceEntry, device_target_conflict, get_profile
from rich.console import Console

from hycoc.chat_template import chat_from_recipe
from hycoc.recipe import Recipe


class BuildNotReady(BuildError):
    """A pass the bundle needs is not implemented yet (the message names it)."""


def check_recipe_capabilities(recipe: Recipe, profile, device: DeviceEntry | None = None) -> None:
    """Refuse, before any pass runs, a recipe whose graphs need what ``profile`` cannot do (docs/compiler.md
    "Targets by device"): 16-bit activations (the head's graphs are always A16, `hycoc.passes.head.export`; the
    SLM's when ``slm_calibration.activation_bits`` = 16) on a profile with ``supports_16bit_ops`` False, and 4-bit
    weight storage (``head_qat.weight_bits`` 4, or 2 stored as int4) on one without ``supports_int4_weights``.
    The compile step checks each graph again (`hycoc.targets.htp_checks.check_capabilities`); this check only fails
    earlier. Raises BuildError naming the profile, the recipe fields and a target that can."""
    what = f"{profile.name} ({device.name if device else profile.description.split(' — ')[0]})"
    needs = []
    if not profile.supports_16bit_ops:
        a16 = ["the head's graphs (always A16)"]
        if recipe.slm_calibration.activation_bits == 16:
            a16.append("slm_calibration.activation_bits = 16")
        needs.append(f"16-bit activations ({', '.join(a16)})")
    if not profile.supports_int4_weights and recipe.head_qat.weight_bits in (2, 4):
        needs.append(f"4-bit weights (head_qat.weight_bits = {recipe.head_qat.weight_bits})")
    if needs:
        able = [n for n in HTP_TARGETS if get_profile(n).supports_16bit_ops and get_profile(n).supports_int4_weights]
        raise BuildError(
            f"{what} cannot run this recipe's graphs: they need {' and '.join(needs)}, which the "
            f"profile does not allow (targets/profiles.py); build for {' / '.join(able)} instead"
        )


def recipe_for_target(recipe: Recipe, target: str | None, device: DeviceEntry | None = None) -> tuple[Recipe, str]:
    """The recipe with ``[target]`` pointed at ``target`` (a `TARGETS` name) and/or a named ``device``
    (`hycoc.targets.profiles.resolve_device`), and the target name to build (docs/compiler.md "Targets by device").

    ``htp-vNN``: ``target.name`` and ``htp_arch`` become that arch's; ``soc_model`` becomes the profile's unless the
    recipe already names a SoC of that arch (an X Elite recipe keeps SC8380XP). ``device``: the device's arch and
    SoC (``target`` None or its ``htp-vNN``). ``context_size_limit_mb`` stays the recipe's (the profile's own limit
    still caps it). Nothing else changes, so every pass before the target step keeps its cache entry.
    Raises BuildError when ``target`` and ``device`` disagree or ``device`` is given with a non-HTP target, or the
    changed ``[target]`` does not validate.
    """
    name = target if target is not None else (f"htp-v{device.htp_arch}" if device else recipe.target.name)
    if name.startswith("htp-v") and name in TARGETS:
        check_recipe_capabilities(recipe, get_profile(name), device)
    conflict = device_target_conflict(device, name) if device is not None else None
    if conflict is not None:
        raise BuildError(conflict)
    if not name.startswith("htp-v"):
        return recipe, name
    if name not in TARGETS:
        raise BuildError(f"unknown target {name!r} (known: {', '.join(TARGETS)})")
    arch = get_profile(name).htp_arch
    soc: str | None  # None (a profile without a SoC) fails the [target] validation below
    if device is not None:
        soc = device.soc_model
    elif recipe.target.htp_arch == arch:
        soc = recipe.target.soc_model
    else:
        soc = get_profile(name).soc_model
    t = recipe.target
    if (t.name, t.htp_arch, t.soc_model) == (name, arch, soc):
        return recipe, name
    fields = {**t.model_dump(), "name": name, "htp_arch": arch, "soc_model": soc}
    try:
        target_table = type(t).model_validate(fields)
    except ValueError as e:  # pydantic's ValidationError
        raise BuildError(f"[target] for {name} ({soc}) does not validate: {e}") from None
    return recipe.model_copy(update={"target": target_table}), name


# ---- the pipeline ----------------------------------------------------------------------------------------------


def head_qdq_pass(seed: int = 0) -> Pass:
    """The head's QDQ pass: `hycoc.passes.qdq.quantize.QdqQuantize("onnx_head", "qdq_head")` once it takes the head,
    until then `hycoc.passes.head.export.HeadQdq` (the same `quantize_graph` with the QAT integers)."""
    from hycoc.passes.head.export import HeadQdq
    from hycoc.passes.qdq.quantize import QdqQuantize

    try:
        shared = QdqQuantize("onnx_head", "qdq_head", seed=seed)
    except ValueError:
        return HeadQdq(seed=seed)
    # taken only when the pipeline before it makes everything it reads
    made = {
        "tokenizer",
        "torch_verifier",
        "torch_head",
        "keep_set",
        "calibration_answers",
        "quantized_head",
        "onnx_head",
        "head_host",
    }
    return shared if set(shared.consumes) <= made else HeadQdq(seed=seed)


def build_pipeline(
    recipe: Recipe,
    target: str,
    *,
    cache_dir: str | Path,
    console: Console | None = None,
    seed: int = 0,
    device: str = "cpu",
    use_cache: bool = True,
) -> Pipeline:
    """The pipeline of `hycoc build` for ``target`` (module docstring); ``device``: where its torch-model passes run,
    ``use_cache`` False: no cache entry is read (`Pipeline`). Raises BuildError for an unknown target."""
    from hycoc.passes.calibration_answers import CalibrationAnswersPass
    from hycoc.passes.head.export import HeadExport
    from hycoc.passes.head.qat import HeadQatPass
    from hycoc.passes.keep_set import KeepSetPass
    from hycoc.passes.qdq.quantize import QdqQuantize
    from hycoc.passes.slm.decode import DECODE_GRAPH, DECODE_KIND, SlmDecodeGraph
    from hycoc.passes.slm.graph import SlmTreeGraphExport
    from hycoc.passes.slm.surgery import SlmGraphSurgery

    if target not in TARGETS:
        raise BuildError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")
    passes: list[Pass] = [
        KeepSetPass(),
        CalibrationAnswersPass(),
        HeadQatPass(seed=seed),
        HeadExport(seed=seed),
        head_qdq_pass(seed),
    ]
    graphs = {"head": "qdq_head"}
    if recipe.target.slm_shards != 1:  # the SLM split by layers (`hycoc.passes.slm.shard_build`)
        from hycoc.passes.slm.shard_build import KIND, SlmShardsPass

        passes += [SlmGraphSurgery(), SlmShardsPass(seed=seed, work_dir=Path(cache_dir) / "work")]
        passes.append(TargetPass(target, graphs | {"slm": KIND}, Path(cache_dir) / "work"))
        return Pipeline(passes, cache_dir, console=console, device=device, use_cache=use_cache)
    passes += [
        SlmGraphSurgery(),
        SlmTreeGraphExport(),
        QdqQuantize("onnx_slm", "qdq_slm", seed=seed),
        SlmDecodeGraph(seed=seed),
    ]
    graphs |= {"slm": "qdq_slm", DECODE_GRAPH: DECODE_KIND}
    passes.append(TargetPass(target, graphs, Path(cache_dir) / "work"))
    return Pipeline(passes, cache_dir, console=console, device=device, use_cache=use_cache)


#: The verifier's dtype when the build runs it on a GPU: bf16, as the paper serves it (App. A: the verifier and the
#: head's QAT in bf16; `hycoc.passes.head.qat.qat_autocast` keeps float32 master weights under bf16 autocast).
GPU_VERIFIER_DTYPE = "bfloat16"


def build_inputs(recipe: Recipe, device: str = "cpu") -> dict[str, Artifact]:
    """The pipeline's outside inputs from ``[models]``: tokenizer, verifier and head (local folders).

    device: "cpu" (the default: models as saved, float32 for the toy) or an accelerator ("cuda"): the verifier is
    moved there in `GPU_VERIFIER_DTYPE` (its content hash is then the bf16 weights', so every pass reading it gets
    a new key); the head stays on the CPU as saved and the passes move what they train (`hycoc.passes.head.qat`).
    Raises ModelNotFoundError naming the recipe key when one is missing, HeadConfigError
    (`hycoc.models.check_head_config`) for a head with ordered embeddings, DeviceUnavailable (from
    `hycoc.verifier.loading.check_device`) when CUDA is asked for and torch sees none."""

    def where(value: str) -> str:
        path = recipe.resolve_path(value)
        return str(path) if path is not None else value

    from hycoc.models import check_head_folder, quiet_transformers

    quiet_transformers()
    models = recipe.models
    check_head_folder(where(models.head))  # an output hycoc cannot compile is refused before any loading
    if device != "cpu":
        from hycoc.verifier.loading import check_device

        check_device(device)  # before loading anything
    verifier = TorchModelArtifact.from_pretrained(where(models.verifier), "torch_verifier")
    if device != "cpu":
        import torch

        verifier = TorchModelArtifact(
            "torch_verifier", verifier.payload.to(device=device, dtype=getattr(torch, GPU_VERIFIER_DTYPE))
        )
    return {
        "tokenizer": TokenizerArtifact.from_file(where(models.tokenizer)),
        "torch_verifier": verifier,
        "torch_head": TorchModelArtifact.from_pretrained(where(models.head), "torch_head"),
    }


# ---- the bundle ------------------------------------------------------------------------------------------------


@dataclass
class BuildResult:
    """What `build_bundle` did: the pipeline result, the bundle folder (None after ``until``) and its manifest."""

    pipeline: PipelineResult
    out_dir: Path | None
    manifest: Any = None
    stopped_at: Path | None = None  # the cache entry of the ``until`` pass
    pruned: list = field(default_factory=list)  # cache entries the size cap removed (`hycoc.passes.cache.CacheEntry`)


@dataclass(frozen=True)
class BuildSettings:
    """How a build runs (`run_pipeline`, `build_bundle`; `hycoc build`'s options).

    ``until``: stop after that pass (no bundle); ``console``: where progress goes (None: stderr); ``seed``: seeds
    torch in the passes that train or sample; ``device``: where the torch-model passes run ("cpu", "cuda", ...);
    ``use_cache`` False (``--no-cache``): every pass runs and replaces its entry; ``cache_max_bytes``: after a
    build, prune the cache to that total (None: not pruned)."""

    until: str | None = None
    console: Console | None = None
    seed: int = 0
    device: str = "cpu"
    use_cache: bool = True
    cache_max_bytes: int | None = None


def run_pipeline(
    recipe: Recipe, target: str, cache_dir: str | Path, settings: BuildSettings = BuildSettings()
) -> PipelineResult:
    """Run `build_pipeline` on `build_inputs` (up to ``settings.until``; torch-model passes on ``settings.device``;
    ``settings.use_cache`` False: every pass runs). The target's files are then read from the pipeline's cache
    entry, and the pass's work folder is removed."""
    recipe, target = recipe_for_target(recipe, target)  # an htp-vNN target: [target] at that arch
    if target == "qai-hub":
        from hycoc.targets.qai_hub import check_setup

        check_setup()  # fail at once, not after QAT
    chat_from_recipe(recipe)  # the chat template and stop ids the bundle will carry: refused before any model loads
    pipeline = build_pipeline(
        recipe,
        target,
        cache_dir=cache_dir,
        console=settings.console,
        seed=settings.seed,
        device=settings.device,
        use_cache=settings.use_cache,
    )
    check_until(settings.until, [p.name for p in pipeline.passes])  # before loading any model
    result = pipeline.run(recipe, build_inputs(recipe, settings.device), until=settings.until)
    if "target_files" in result.artifacts:
        entry = result.reports[-1].location
        if entry is None:  # the pipeline sets every report's cache entry
            raise BuildError(f"the {result.reports[-1].pass_name} pass's report names no cache entry")
        result.artifacts["target_files"] = TargetFilesArtifact("target_files", entry / "target_files")
    shutil.rmtree(Path(cache_dir) / "work", ignore_errors=True)
    return result


def build_bundle(
    recipe: Recipe,
    target: str,
    out_dir: str | Path | None,
    cache_dir: str | Path,
    settings: BuildSettings = BuildSettings(),
) -> BuildResult:
    """Run the pipeline (`run_pipeline`, torch-model passes on ``settings.device``) and write the bundle to
    ``out_dir`` (module docstring). Third-party warnings and prints go to
    ``CACHE_DIR/logs/build-<recipe>-<target>.log`` (`hycoc.quiet.third_party_output`; one line at the end says where).

    ``settings`` (`BuildSettings`): ``until``: stop after that pass and write no bundle (`BuildResult.stopped_at` is
    its cache entry). ``use_cache`` False (``--no-cache``): every pass runs and replaces its entry.
    ``cache_max_bytes``: after the build, the cache is pruned to that total, least recently used entries first,
    this build's never
    (`hycoc.passes.cache.prune`; None: not pruned; the CLI's default is `hycoc.passes.cache.DEFAULT_MAX_BYTES`);
    `BuildResult.pruned` lists what went.
    One build at a time per cache and bundle folder (`hycoc.build_lock.build_lock`): another build holding either
    raises BuildLocked at once. Ctrl-C (KeyboardInterrupt) prints what the build kept (`interrupted_note`: the
    finished passes stay cached for the next build) and propagates.
    Raises BuildNotReady when a pass the bundle needs is not implemented yet, BuildError for a bad target or a
    missing ``out_dir`` (BuildLocked for a held cache or bundle folder), UnknownPassError (a PipelineError) for an
    unknown ``until``, and whatever a pass raises (RecipeError, ModelNotFoundError, CapabilityError, FallbackError,
    ContextTooLargeError, QaiHubSetupError, ...).
    """
    if target not in TARGETS:
        raise BuildError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")
    if out_dir is None and settings.until is None:
        raise BuildError("--out DIR is required for a full build")
    from hycoc.build_lock import BuildLocked, build_lock, interrupted_note

    started = time.time()
    bundle_dir = None if settings.until is not None else out_dir
    try:
        with build_lock(cache_dir, bundle_dir):
            result = _build_locked(recipe, target, out_dir, cache_dir, settings)
            if settings.cache_max_bytes is not None:
                from hycoc.passes.cache import prune

                keep = [r.location for r in result.pipeline.reports if r.location is not None]
                result.pruned = prune(cache_dir, max_bytes=settings.cache_max_bytes, keep=keep)
            return result
    except BuildLocked as e:
        raise BuildError(str(e)) from None
    except KeyboardInterrupt:
        from hycoc.progress import stderr_console  # redirected: the note stays one line

        console = settings.console or stderr_console()
        console.print(f"[yellow]{interrupted_note(cache_dir, bundle_dir, started)}[/]")
        raise


def _build_locked(recipe: Recipe, target: str, out_dir, cache_dir, settings: BuildSettings) -> BuildResult:
    """`build_bundle`'s work, its locks held."""
    recipe, target = recipe_for_target(recipe, target)  # an htp-vNN target: [target] at that arch
    import torch.onnx  # noqa: F401  (imported before the log context: its own loggers then go to the log too)

    from hycoc.quiet import third_party_output

    # torch.onnx's progress prints, torchvision/transformers warnings, onnxruntime's quantizer advice: to a log
    log = Path(cache_dir) / "logs" / f"build-{recipe.recipe.name}-{target}.log"
    with third_party_output(log, console=settings.console):
        result = run_pipeline(recipe, target, cache_dir, settings)
        if settings.until is not None:
            return BuildResult(result, None, stopped_at=result.reports[-1].location)
        manifest = write_bundle(result, recipe, target, out_dir)
    return BuildResult(result, Path(out_dir).absolute(), manifest)
