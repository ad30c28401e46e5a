"""The pass manager of `hycoc build` (docs/design.md "The pass pipeline").

A `Pass` is a small class that names the recipe table it reads (``section``), the artifact kinds it consumes and
produces (each with its `Artifact` class), and a ``run(inputs, recipe)`` that returns its outputs and a
`PassReport` of what it did, in numbers. A `Pipeline` is an ordered list of passes:

* ``validate`` checks the chain before anything runs: every consumed kind is given as input or produced by an
  earlier pass, with the class the consumer expects; pass names are unique; sections exist in the recipe.
* ``run`` runs the passes in order and caches each pass's outputs under ``cache_dir/<pass>/<key>``, where the key
  is the sha256 of the pass's name and version, the canonical JSON of the recipe tables it reads, its own
  parameters and outside inputs (`Pass.key_material`, e.g. a corpus file's hash), the sha256 of every file it
  reads from a model or tokenizer folder (`Pass.files_read`: the chat template, tokenizer_config.json,
  generation_config.json, config.json, tokenizer.json; absent ones as absent), the content hashes of the
  artifacts it consumes, the versions of the libraries that shape artifacts (`KEYED_PACKAGES`: torch,
  transformers, tokenizers, jinja2, onnx, onnxruntime, ...; those installed) and the environment that changes
  numbers (`environment`: Python's version, the machine, torch's CPU kernels, `KEYED_ENVIRONMENT` variables that
  are set). A rebuild after a recipe or folder edit reruns only the passes whose key changed, and a pass whose
  inputs come out bit-identical stays cached after it.
* Outputs are written to ``cache_dir/<pass>/.tmp-<key>-*`` and renamed to ``<key>`` when complete: a pass that
  raises (or a build that is killed) leaves no half entry, only a ``.tmp-`` folder a later run ignores (and
  `hycoc.passes.cache.prune` removes). An entry is loaded whole or not at all: its ``meta.json`` (written last)
  must name this pass, version, library versions and environment, and every output must load and match its
  recorded content hash; anything else (another library version's entry, a truncated or edited file) is
  removed and the pass runs again. ``use_cache=False`` (``hycoc build --no-cache``) reads no entry and replaces
  the entries it writes. A hit touches the entry's ``meta.json`` (its mtime is when it was last used, what
  `hycoc.passes.cache.prune` evicts by).
* ``device``: where the passes that run a torch model (those consuming ``torch_verifier`` or ``torch_head``,
  `TORCH_INPUTS`) run it ("cpu", the default, or "cuda": `hycoc.passes.build.build_inputs` places the verifier).
  A device other than "cpu" enters those passes' keys; the default adds nothing, so CPU keys stay as they were.
* ``run(until=NAME)`` stops after that pass; its artifacts stay in its cache entry (``PassReport.location``).
* Progress is shown with ``rich`` on a terminal and as plain timestamped lines in a log (`hycoc.progress`: each
  pass's start and end, and the steps inside a pass), and the run ends with a table of every pass's report, time
  and cache hit (`summary_table`).

Olive's engine (``olive/engine``) is the counter-example this avoids: there passes declare no input or output
types, state travels in a free-form dict, and the cache key ignores tool versions (shared/FIELD-NOTES.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from types import MappingProxyType
from typing import Any

from hycoc.passes.artifacts import Artifact
from rich.console import Console
from rich.table import Table

from hycoc.bundle import sha256_file
from hycoc.progress import current_pass, live_progress, plain_line, stderr_console
from hycoc.recipe import Recipe

#: Packages whose versions enter every cache key: a new exporter, optimizer or runtime can change an artifact.
KEYED_PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "jinja2",  # renders the chat template into the calibration prompts
    "safetensors",
    "numpy",
    "onnx",
    "onnxscript",
    "onnx-ir",
    "onnxruntime",
    "onnxruntime-qnn",
)
#: Environment variables that change the numbers a pass makes, when set: the vector kernels torch dispatches to,
#: oneDNN's and MKL's floating-point modes, TF32 and cuBLAS's reduction order on a GPU. Their values enter every key.
KEYED_ENVIRONMENT = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "MKL_CBWR",
    "NVIDIA_TF32_OVERRIDE",
    "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE",
    "CUBLAS_WORKSPACE_CONFIG",
)


class PipelineError(ValueError):
    """A pipeline that cannot run as built (a broken chain, an unknown pass or section), or a pass that broke
    its contract (returned other kinds than it declared). The message names the pass and the kind."""


class UnknownPassError(PipelineError):
    """``until`` (``hycoc build --until PASS``) names no pass of the pipeline: a usage error (exit 2). The message
    names the pass and lists the pipeline's."""


def check_until(until: str | None, names: list[str]) -> None:
    """Raise `UnknownPassError` when ``until`` is given and is not one of the pass ``names``."""
    if until is not None and until not in names:
        raise UnknownPassError(f"--until {until}: no such pass; passes: {', '.join(names)}")


@dataclass
class PassReport:
    """What one pass did, in numbers.

    ``summary`` is one line for the build table ("kept 2048 ids, 97.1% of assistant tokens covered");
    ``numbers`` holds the figures behind it (JSON values). The pipeline fills ``seconds`` (wall time of this run:
    the pass's own time, or the cache load time when ``cached``), ``cpu_seconds`` (this process's CPU time over
    the same span, all threads: on an idle machine cpu / wall is the threads kept busy, on a shared one it shows
    what the pass cost whatever else ran), ``cached``, ``key`` and ``location`` (the cache entry holding the
    outputs).
    """

    summary: str
    numbers: dict[str, Any] = field(default_factory=dict)
    pass_name: str = ""
    seconds: float = 0.0
    cpu_seconds: float = 0.0
    cached: bool = False
    key: str = ""
    location: Path | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "summary": self.summary,
            "numbers": self.numbers,
            "pass_name": self.pass_name,
            "seconds": self.seconds,
            "cpu_seconds": self.cpu_seconds,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PassReport:
        return cls(
            summary=data["summary"],
            numbers=data["numbers"],
            pass_name=data["pass_name"],
            seconds=data["seconds"],
            cpu_seconds=data.get("cpu_seconds", 0.0),
        )


class Pass:
    """One compiler step. Subclasses set the class attributes and implement `run`.

    ``name``: unique within a pipeline; the cache folder and ``--until`` use it. ``version``: bump it whenever the
    pass's code changes what it produces (old cache entries then miss). ``section``: the recipe table it reads
    (``"keep_set"``), None for none; ``also_reads``: further tables whose values it uses. ``consumes`` /
    ``produces``: kind -> `Artifact` class.
    """

    name: str = ""
    version: int = 1
    section: str | None = None
    also_reads: tuple[str, ...] = ()
    consumes: Mapping[str, type[Artifact]] = MappingProxyType({})
    produces: Mapping[str, type[Artifact]] = MappingProxyType({})

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        """JSON values that enter the cache key besides the recipe tables and input hashes: the pass's own
        constructor parameters and anything read from outside the pipeline (e.g. a corpus file's sha256)."""
        return {}

    def files_read(self, recipe: Recipe) -> dict[str, Path]:
        """The files this pass reads from a model or tokenizer folder besides the artifacts it consumes, as label
        (``"tokenizer/chat_template.jinja"``: the folder's role, not this machine's path) -> path; each one's
        sha256 enters the key (a file that is absent, as absent). Default: none."""
        return {}

    def run(self, inputs: dict[str, Artifact], recipe: Recipe) -> tuple[Mapping[str, Artifact], PassReport]:
        """Make the ``produces`` artifacts from the ``consumes`` ones. Must not mutate the inputs."""
        raise NotImplementedError

    def reads(self) -> tuple[str, ...]:
        """Every recipe table this pass reads, ``section`` first."""
        return ((self.section,) if self.section else ()) + tuple(self.also_reads)


def tool_versions() -> dict[str, str]:
    """Installed versions of `KEYED_PACKAGES` (those not installed are left out)."""
    out = {}
    for package in KEYED_PACKAGES:
        try:
            out[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            continue
    return out


def environment() -> dict[str, Any]:
    """What the machine and process add to every key: Python's major.minor, the machine (``x86_64``, ``arm64``),
    the CPU kernels torch dispatches to (``AVX2``, ``AVX512``; absent without torch) and the `KEYED_ENVIRONMENT`
    variables that are set. torch's thread count is not in it (the passes' results do not depend on it)."""
    import platform
    import sys
    from importlib.util import find_spec

    out: dict[str, Any] = {"python": f"{sys.version_info[0]}.{sys.version_info[1]}", "machine": platform.machine()}
    if find_spec("torch") is not None:
        import torch

        out["torch_cpu"] = torch.backends.cpu.get_cpu_capability()
    variables = {name: os.environ[name] for name in KEYED_ENVIRONMENT if name in os.environ}
    if variables:
        out["variables"] = variables
    return out


def file_sha256(path: Path, memo: dict | None = None) -> str | None:
    """sha256 hex of a file's bytes, None when it does not exist. memo: a dict reused across calls, keyed by
    (path, size, mtime_ns), so a file is read once per build."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    mark = (str(path), st.st_size, st.st_mtime_ns)
    if memo is not None and mark in memo:
        return memo[mark]
    digest = sha256_file(path)
    if memo is not None:
        memo[mark] = digest
    return digest


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True)


@dataclass
class PipelineResult:
    """``artifacts``: every artifact by kind after the last pass run (later producers replace earlier ones);
    ``reports``: one per pass run, in order; ``stopped_after``: the ``until`` pass, None for a full run."""

    artifacts: dict[str, Artifact]
    reports: list[PassReport]
    stopped_after: str | None = None


#: Artifact kinds that are torch models: a pass consuming one runs it on the pipeline's ``device``.
TORCH_INPUTS = frozenset({"torch_verifier", "torch_head"})


class Pipeline:
    """An ordered chain of passes with a content-addressed cache (see the module docstring). ``device``: where the
    torch-model passes run ("cpu" default, "cuda"); it keys those passes when it is not "cpu". ``use_cache``:
    False reads no cache entry (every pass runs) and replaces the entries it writes."""

    def __init__(
        self,
        passes: Sequence[Pass],
        cache_dir: str | Path,
        *,
        console: Console | None = None,
        device: str = "cpu",
        use_cache: bool = True,
    ):
        self.passes = list(passes)
        self.device = str(device)
        self.cache_dir = Path(cache_dir)
        self.console = console if console is not None else stderr_console()
        self.use_cache = bool(use_cache)
        self._versions = tool_versions()
        self._environment = environment()
        self._file_memo: dict = {}
        names = [p.name for p in self.passes]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise PipelineError(f"pass names must be unique; repeated: {', '.join(duplicates)}")

    # ---- plan ---------------------------------------------------------------------------------------------

    def validate(self, given: Mapping[str, type[Artifact]]) -> None:
        """Check the chain for inputs of the given kinds and classes, before running anything.

        Raises PipelineError naming the first pass that consumes a kind nobody provides (or provides with another
        class), or that reads a recipe table that does not exist.
        """
        available: dict[str, tuple[type[Artifact], str]] = {k: (cls, "the given inputs") for k, cls in given.items()}
        for index, p in enumerate(self.passes, start=1):
            for table in p.reads():
                if table not in Recipe.model_fields:
                    raise PipelineError(
                        f"pass {index} '{p.name}' reads recipe table [{table}], which does not "
                        f"exist; tables: {', '.join(Recipe.model_fields)}"
                    )
            for kind, wanted in p.consumes.items():
                if kind not in available:
                    have = ", ".join(sorted(available)) or "nothing"
                    raise PipelineError(
                        f"pass {index} '{p.name}' consumes '{kind}', which no earlier pass produces and which is not "
                        f"given as input (available before it: {have})"
                    )
                cls, source = available[kind]
                if not issubclass(cls, wanted):
                    raise PipelineError(
                        f"pass {index} '{p.name}' consumes '{kind}' as {wanted.__name__}, but {source} provide "
                        f"it as {cls.__name__}"
                    )
            for kind, cls in p.produces.items():
                available[kind] = (cls, f"pass '{p.name}'")

    def describe(self) -> str:
        """The plan, one line per pass (for ``hycoc build --list-passes``)."""
        lines = []
        for index, p in enumerate(self.passes, start=1):
            reads = ", ".join(f"[{t}]" for t in p.reads()) or "no recipe table"
            consumes = ", ".join(p.consumes) or "nothing"
            produces = ", ".join(p.produces) or "nothing"
            lines.append(f"{index}. {p.name} (v{p.version}): reads {reads}; consumes {consumes}; produces {produces}")
        return "\n".join(lines)

    def files_key(self, p: Pass, recipe: Recipe) -> dict[str, str | None]:
        """label -> sha256 (None: absent) of every file ``p`` reads from a model or tokenizer folder
        (`Pass.files_read`)."""
        return {label: file_sha256(Path(path), self._file_memo) for label, path in p.files_read(recipe).items()}

    def cache_key(self, p: Pass, inputs: Mapping[str, Artifact], recipe: Recipe) -> str:
        """sha256 hex of everything that determines the pass's outputs (module docstring)."""
        material = {
            "pass": p.name,
            "version": p.version,
            "sections": {t: getattr(recipe, t).model_dump(mode="json") for t in p.reads()},
            "params": p.key_material(recipe),
            "files": self.files_key(p, recipe),
            "inputs": {kind: inputs[kind].content_hash() for kind in sorted(p.consumes)},
            "tools": self._versions,
            "environment": self._environment,
        }
        if self.device != "cpu" and TORCH_INPUTS & set(p.consumes):
            material["device"] = self.device  # absent on the CPU: the default keys are unchanged
        return hashlib.sha256(canonical_json(material).encode()).hexdigest()

    # ---- run ----------------------------------------------------------------------------------------------

    def run(
        self, recipe: Recipe, inputs: Mapping[str, Artifact] | None = None, *, until: str | None = None
    ) -> PipelineResult:
        """Run the passes in order (up to and including ``until``), reusing cached outputs.

        ``inputs``: artifacts given from outside, by kind (e.g. the tokenizer). Raises PipelineError before any
        pass runs when the chain is broken or ``until`` names no pass; a pass's own exception propagates after
        its temporary cache folder is removed.
        """
        given = dict(inputs or {})
        for kind, artifact in given.items():
            if artifact.kind != kind:
                raise PipelineError(f"input '{kind}' holds an artifact of kind '{artifact.kind}'")
        self.validate({k: type(a) for k, a in given.items()})
        names = [p.name for p in self.passes]
        check_until(until, names)
        todo = self.passes[: names.index(until) + 1] if until is not None else self.passes

        artifacts = dict(given)
        reports: list[PassReport] = []
        if self.console.is_terminal:
            with live_progress(self.console) as progress:
                for index, p in enumerate(todo, start=1):
                    task = progress.add_task(f"[{index}/{len(todo)}] {p.name}", total=None)
                    outputs, report = self._run_one(p, artifacts, recipe, progress)
                    artifacts.update(outputs)
                    reports.append(report)
                    how = "cached" if report.cached else f"{report.seconds:.1f} s"
                    # short: the live display's widest description sets every row's width (the summary is in the
                    # table at the end)
                    progress.update(task, completed=1, total=1, description=f"[{index}/{len(todo)}] {p.name}: {how}")
        else:  # a log: one line when a pass starts and one when it ends (hycoc.progress)
            for index, p in enumerate(todo, start=1):
                plain_line(f"[{index}/{len(todo)}] {p.name}: started", self.console)
                outputs, report = self._run_one(p, artifacts, recipe)
                artifacts.update(outputs)
                reports.append(report)
                how = "cached" if report.cached else "ran"
                plain_line(
                    f"[{index}/{len(todo)}] {p.name}: {how}, {report.seconds:.1f} s "
                    f"(CPU {report.cpu_seconds:.1f} s): {report.summary}",
                    self.console,
                )
        self.console.print(summary_table(reports))
        return PipelineResult(artifacts, reports, until)

    def _run_one(
        self, p: Pass, artifacts: Mapping[str, Artifact], recipe: Recipe, live=None
    ) -> tuple[Mapping[str, Artifact], PassReport]:
        outputs: Mapping[str, Artifact]
        inputs = {kind: artifacts[kind] for kind in p.consumes}
        key = self.cache_key(p, inputs, recipe)
        entry = self.cache_dir / p.name / key
        start, cpu = time.perf_counter(), time.process_time()
        cached = self._load(p, entry) if self.use_cache else None
        if cached is None and entry.exists() and self.use_cache:
            shutil.rmtree(entry)  # incomplete, damaged or another library version's: replaced below
        if cached is not None:
            outputs, report = cached
            report.cached = True
            _touch(entry / "meta.json")  # last used: what `hycoc cache prune` evicts by
        else:
            with current_pass(p.name, self.console, live):
                outputs, report = p.run(inputs, recipe)
            self._check_outputs(p, outputs)
            report.pass_name = p.name
            report.seconds = time.perf_counter() - start
            report.cpu_seconds = time.process_time() - cpu
            self._store(p, entry, outputs, report)
        report.seconds = time.perf_counter() - start
        report.cpu_seconds = time.process_time() - cpu
        report.key, report.location = key, entry
        return outputs, report

    def _check_outputs(self, p: Pass, outputs: Mapping[str, Artifact]) -> None:
        if set(outputs) != set(p.produces):
            raise PipelineError(
                f"pass '{p.name}' returned kinds {sorted(outputs)}, but declares it produces {sorted(p.produces)}"
            )
        for kind, artifact in outputs.items():
            if not isinstance(artifact, p.produces[kind]) or artifact.kind != kind:
                raise PipelineError(
                    f"pass '{p.name}' returned a {type(artifact).__name__} of kind "
                    f"'{artifact.kind}' as '{kind}'; it declares {p.produces[kind].__name__}"
                )

    def _meta(self, p: Pass) -> dict[str, Any]:
        """What an entry's meta.json must say for `_load` to read it: this pass and version, the library versions
        and the environment (the key holds them too; an entry copied from elsewhere or of an older formula is
        refused here)."""
        return {"pass": p.name, "version": p.version, "tools": self._versions, "environment": self._environment}

    def _store(self, p: Pass, entry: Path, outputs: Mapping[str, Artifact], report: PassReport) -> None:
        """Write the outputs to a temporary folder beside ``entry`` and rename it to ``entry`` when complete (with
        ``use_cache`` False an existing entry is replaced)."""
        entry.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-", dir=entry.parent))
        try:
            meta = {**self._meta(p), "created": time.time(), "outputs": {}}
            for kind, artifact in outputs.items():
                (tmp / kind).mkdir()
                artifact.save(tmp / kind)
                meta["outputs"][kind] = {"class": type(artifact).__name__, "hash": artifact.content_hash()}
            (tmp / "report.json").write_text(json.dumps(report.to_json(), indent=1), encoding="utf-8")
            # meta.json last: an entry without it is never read.
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1), encoding="utf-8")
            if not self.use_cache and entry.exists():  # --no-cache: the old entry goes, the new one takes its place
                old = Path(tempfile.mkdtemp(prefix=f".tmp-{entry.name}-old-", dir=entry.parent))
                os.replace(entry, old / "entry")
                shutil.rmtree(old, ignore_errors=True)
            try:
                os.rename(tmp, entry)
            except OSError:
                if not (entry / "meta.json").exists():  # not a concurrent build that finished first
                    raise
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def _load(self, p: Pass, entry: Path) -> tuple[dict[str, Artifact], PassReport] | None:
        """The cached outputs and report, all of them or None: None when there is no complete entry, when its
        meta.json names another pass, version, library versions or environment, or when any output fails to load
        or to match its recorded hash (module docstring)."""
        meta_path = entry / "meta.json"
        if not meta_path.exists():
            return None
        try:
            meta = json.loads(meta_path.read_text(encoding="utf-8"))
            if {k: meta.get(k) for k in self._meta(p)} != self._meta(p) or set(meta["outputs"]) != set(p.produces):
                return None
            outputs = {}
            for kind, info in meta["outputs"].items():
                artifact = p.produces[kind].load(kind, entry / kind)
                if artifact.content_hash() != info["hash"]:
                    return None  # edited on disk: rerun the pass
                outputs[kind] = artifact
            report = PassReport.from_json(json.loads((entry / "report.json").read_text(encoding="utf-8")))
        except Exception:  # noqa: BLE001 -- any loader's error (protobuf, safetensors, numpy, torch): rerun the pass
            return None  # damaged on disk: rerun the pass
        return outputs, report


def _touch(path: Path) -> None:
    """Set ``path``'s mtime to now (a read-only cache is left as it is)."""
    try:
        os.utime(path)
    except OSError:
        pass


def summary_table(reports: Sequence[PassReport]):
    """The build summary (a rich renderable that fits 80 columns): a table of one row per pass with its time, CPU
    time and whether it came from the cache, then each pass's report line, numbered as in the table and wrapped
    under its name."""
    from rich.console import Group
    from rich.text import Text

    table = Table(title="hycoc build: passes", show_footer=bool(reports))
    ran = [r for r in reports if not r.cached]
    table.add_column("#", justify="right")
    table.add_column("pass", footer="total")
    table.add_column("time", justify="right", footer=f"{sum(r.seconds for r in reports):.2f} s")
    table.add_column("CPU", justify="right", footer=f"{sum(r.cpu_seconds for r in reports):.1f} s")
    table.add_column("cached", footer=f"{len(reports) - len(ran)} of {len(reports)}")
    for index, r in enumerate(reports, start=1):
        table.add_row(
            str(index), r.pass_name, f"{r.seconds:.2f} s", f"{r.cpu_seconds:.1f} s", "yes" if r.cached else "no"
        )
    lines = [Text(f"{index:>2} {r.pass_name}: {r.summary}") for index, r in enumerate(reports, start=1)]
    return Group(table, *lines)
