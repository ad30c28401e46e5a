"""The target step of `hycoc build` (`TargetPass`): the QDQ graphs turned into what the bundle holds, for one of
`TARGETS` (docs/design.md "Targets").

``cpu``: the QDQ ONNX itself (`hycoc.targets.cpu.package_cpu`); ``htp-vNN`` (every profile of
`hycoc.targets.profiles.HTP_TARGETS`): EPContext models + QNN context binaries (`hycoc.targets.htp.compile_shared`,
CPU fallback disabled, the recipe's ``[target]`` profile; the graphs of a `SHARED_CONTEXTS` group in one
weight-shared binary with ``target.share_weights``); ``qai-hub``: QNN DLCs compiled on Qualcomm AI Hub and linked
into one weight-shared context binary (`hycoc.targets.qai_hub`). Before any of that each graph takes its shipped
form (`ship_file`); the QDQ graph with every output stays beside it (``check_source``) for the checks. The step's
output is a `TargetFilesArtifact`, cached like any pass.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from hycoc.passes.artifacts import Artifact, FolderArtifact, OnnxArtifact
from hycoc.passes.pipeline import Pass, PassReport
from hycoc.targets.profiles import HTP_TARGETS

from hycoc.recipe import Recipe

#: What `hycoc build --target` takes: every HTP profile, the CPU EP and Qualcomm AI Hub.
TARGETS = (*HTP_TARGETS, "cpu", "qai-hub")


class BuildError(RuntimeError):
    """A build that cannot go on: an unknown target, a missing artifact. The message says what to do."""


# ---- the target step --------------------------------------------------------------------------------------------


@dataclass
class TargetFilesArtifact(FolderArtifact):
    """kind ``"target_files"``: a folder (payload: its Path) holding what the target made for each graph, plus
    ``graphs.json``: graph name -> {"model": file, "context_binary": file or null, "extra": [files]}.
    Saved by copying the folder; hashed over its files (`hash_folder`)."""

    type_name: ClassVar[str] = "target_files"
    INDEX: ClassVar[str] = "graphs.json"


#: Graphs compiled into one weight-shared QNN context binary on htp targets (``target.share_weights``): the SLM's
#: decode graph holds the tree graph's weights under the same names (`hycoc.passes.slm.decode`).
SHARED_CONTEXTS = (("slm", "slm_decode"),)


def ship_file(path: Path, checks: Path, *, quantized_io: bool, htp: bool) -> dict[str, Any]:
    """Keep the QDQ graph at ``path`` as ``checks`` (same folder, same external data) and write its shipped form
    (`hycoc.passes.graph_io.ship_graph`) at ``path``; for an HTP target (``htp``) its TopK nodes also get the
    CPU EP's order among equal values (`hycoc.passes.topk_outputs.htp_tie_order`). Returns what changed."""
    import onnx
    from hycoc.passes.graph_io import ship_graph
    from hycoc.passes.topk_outputs import htp_tie_order

    shutil.copy2(path, checks)
    model = onnx.load(str(path), load_external_data=False)
    changed = ship_graph(model, quantized_io=quantized_io).numbers()
    if htp:
        changed["topk_tie_order"] = htp_tie_order(model)
    tmp = path.with_name(path.name + ".tmp")
    onnx.save(model, str(tmp))
    tmp.replace(path)
    return changed


def _context_groups(graphs: list[str], share: bool) -> list[list[str]]:
    """``graphs`` split into compile groups: each `SHARED_CONTEXTS` group present (with ``share``), the rest alone."""
    groups = [[g for g in group if g in graphs] for group in SHARED_CONTEXTS] if share else []
    groups = [g for g in groups if len(g) > 1]
    taken = {g for group in groups for g in group}
    return groups + [[g] for g in graphs if g not in taken]


class TargetPass(Pass):
    """qdq_head + qdq_slm -> target_files for one target (module docstring), reading ``[target]``.

    ``work_dir``: where the made files wait until the pipeline copies them into its cache (under the cache
    folder, so a finished build leaves nothing in /tmp)."""

    section = "target"

    def __init__(self, target: str, graphs: dict[str, str], work_dir: Path):
        if target not in TARGETS:
            raise BuildError(f"unknown target {target!r} (known: {', '.join(TARGETS)})")
        from hycoc.passes.slm.shard_build import KIND as SHARDS
        from hycoc.passes.slm.shard_build import ShardedOnnxArtifact

        self.target, self.graphs, self.work_dir = target, dict(graphs), Path(work_dir)
        self.name = f"target_{target.replace('-', '_')}"
        # the SLM as layer shards: one artifact, one graph (and on htp one context binary) per shard
        self.consumes = {kind: ShardedOnnxArtifact if kind == SHARDS else OnnxArtifact for kind in self.graphs.values()}
        self.produces = {"target_files": TargetFilesArtifact}

    version = 2  # v2: shipped graphs without check outputs, optional quantized KV IO (`hycoc.passes.graph_io`)

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        return {"target": self.target, "graphs": self.graphs}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Artifact], PassReport]:
        self.work_dir.mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix=f"{self.name}-", dir=self.work_dir))
        numbers: dict[str, Any] = {"target": self.target, "graphs": {}}
        start = time.perf_counter()
        qdq_paths = stage_qdq_graphs(self.graphs, inputs, out / "qdq")
        # the shipped graphs' IO (`hycoc.passes.graph_io`): the QDQ graph as the passes made it stays beside the
        # shipped one as NAME.checks.onnx (same weights file) for the compiler's checks
        checks = {}
        for graph, path in qdq_paths.items():
            checks[graph] = path.with_name(f"{path.stem}.checks.onnx")
            numbers["graphs"].setdefault(graph, {})["io"] = ship_file(
                path, checks[graph], quantized_io=recipe.target.quantized_io, htp=self.target != "cpu"
            )
        if self.target == "cpu":
            index = package_cpu_graphs(qdq_paths, out / "graphs", numbers["graphs"])
        elif self.target in HTP_TARGETS:
            index = compile_htp_graphs(self.target, recipe, qdq_paths, out / "graphs", numbers["graphs"])
        else:
            index = compile_hub_graphs(recipe, qdq_paths, out / "graphs", numbers["graphs"])
        # the QDQ sources stay beside the compiled graphs: graph_io_from_onnx reads encodings from the shipped one,
        # the checks read the one with every output
        for graph in index:
            index[graph]["qdq_source"] = qdq_paths[graph].relative_to(out).as_posix()
            index[graph]["check_source"] = checks[graph].relative_to(out).as_posix()
        (out / TargetFilesArtifact.INDEX).write_text(json.dumps(index, indent=1, sort_keys=True), encoding="utf-8")
        seconds = time.perf_counter() - start
        sizes = ", ".join(
            f"{g} {sum(v for k, v in n.items() if k.endswith('bytes')) / 1e6:.2f} MB"
            for g, n in numbers["graphs"].items()
        )
        summary = f"{self.target}: {len(index)} graphs ({sizes}) in {seconds:.1f} s"
        return {"target_files": TargetFilesArtifact("target_files", out)}, PassReport(summary, numbers)


def stage_qdq_graphs(graphs: dict[str, str], inputs: dict[str, Any], src: Path) -> dict[str, Path]:
    """Save each graph's QDQ model (``graphs``: graph name -> the artifact kind in ``inputs``) under ``src``, one
    folder per graph (``src/NAME/NAME.onnx`` with its weights in ``NAME.onnx.data``: graphs share no folder); a
    sharded SLM (`hycoc.passes.slm.shard_build`) as its shards ``slm.s0``, ``slm.s1``, ... copied as they are.
    Returns graph name -> its ONNX file, in ``graphs``' order."""
    import onnx_ir as ir

    qdq_paths = {}
    for graph, kind in graphs.items():
        if hasattr(inputs[kind], "models"):  # layer shards (`hycoc.passes.slm.shard_build`): slm.s0, ...
            for name, model in inputs[kind].models():
                shutil.copytree(model.parent, src / name)
                qdq_paths[name] = src / name / model.name
            continue
        path = src / graph / f"{graph}.onnx"  # data file named after the graph: graphs share one folder
        path.parent.mkdir(parents=True)
        ir.save(inputs[kind].payload, path, external_data=f"{graph}.onnx.data")
        qdq_paths[graph] = path
    return qdq_paths


def package_cpu_graphs(qdq_paths: dict[str, Path], out: Path, numbers: dict[str, dict]) -> dict[str, dict]:
    """The cpu target: each shipped QDQ graph packaged for onnxruntime's CPU EP under ``out``
    (`hycoc.targets.cpu.package_cpu`). Returns the index entries (model, no context binary, its extra files, paths
    relative to ``out``'s parent); adds each graph's ``bytes`` (model and extra files) to ``numbers``."""
    from hycoc.targets.cpu import package_cpu

    index: dict[str, dict[str, Any]] = {}
    for graph, path in qdq_paths.items():
        g = package_cpu(path, out, graph_name=graph)
        index[graph] = {
            "model": f"graphs/{g.model.name}",
            "context_binary": None,
            "extra": [f"graphs/{p.name}" for p in g.extra_files],
        }
        numbers[graph]["bytes"] = g.bytes + sum(p.stat().st_size for p in g.extra_files)
    return index


def compile_htp_graphs(
    target: str, recipe: Recipe, qdq_paths: dict[str, Path], out: Path, numbers: dict[str, dict]
) -> dict[str, dict]:
    """An htp target: the shipped graphs compiled into EPContext models and QNN context binaries under ``out``
    for the recipe's ``[target]`` profile, one compile per `_context_groups` group (`hycoc.targets.htp.compile_shared`:
    a group's graphs share one binary). Returns the index entries; adds each graph's binary bytes (the group's
    first graph carries the shared binary's, the others 0), weight bytes, compile seconds and sharing partners to
    ``numbers``. Raises BuildError when the recipe allows CPU fallback."""
    from hycoc.targets.htp import compile_shared
    from hycoc.targets.profiles import profile_for

    t = recipe.target
    if not t.disable_cpu_fallback:
        raise BuildError(
            f"target.disable_cpu_fallback = false: {target} bundles are compiled with CPU "
            "fallback disabled (every node on the HTP); set it to true"
        )
    profile = profile_for(t.htp_arch, t.soc_model, t.context_size_limit_mb)
    index: dict[str, dict[str, Any]] = {}
    for group in _context_groups(list(qdq_paths), t.share_weights):
        for cg in compile_shared([(qdq_paths[g], g) for g in group], out, profile):
            index[cg.name] = {
                "model": f"graphs/{cg.ctx_model.name}",
                "context_binary": f"graphs/{cg.context_binary.name}",
                "extra": [],
                "qnn_sdk": cg.qnn_sdk,
            }
            numbers[cg.name].update(
                {
                    "binary_bytes": cg.binary_bytes if cg.name == group[0] else 0,
                    "weight_bytes": cg.weight_bytes,
                    "compile_seconds": round(cg.compile_seconds, 2),
                    "shared_with": list(cg.shared_with),
                }
            )
    return index


def compile_hub_graphs(recipe: Recipe, qdq_paths: dict[str, Path], out: Path, numbers: dict[str, dict]):
    """The qai-hub target: the shipped graphs compiled on Qualcomm AI Hub and linked into one weight-shared context
    binary under ``out`` (`hycoc.targets.qai_hub.compile_and_link`, the device from ``[target] hub_device``).
    Returns the index entries (each with the QAIRT version and the hub's jobs and device for the manifest); adds
    each graph's compile job, link job and binary bytes (the first graph carries the binary's) to ``numbers``."""
    from hycoc.targets.qai_hub import check_setup, compile_and_link, resolve_device

    t = recipe.target
    hub = check_setup()
    device = resolve_device(hub, t.hub_device, t.htp_arch)
    linked = compile_and_link(hub, [(p, g) for g, p in qdq_paths.items()], out, device, htp_arch=t.htp_arch)
    info = linked.manifest_info()
    index: dict[str, dict[str, Any]] = {}
    for graph, ctx in linked.ctx_models.items():
        index[graph] = {
            "model": f"graphs/{ctx.name}",
            "context_binary": f"graphs/{linked.context_binary.name}",
            "extra": [],
            "qnn_sdk": linked.qairt,
            "hub": info,
        }
        numbers.setdefault(graph, {}).update(
            {
                "compile_job": linked.compile_jobs[graph],
                "link_job": linked.link_job,
                "binary_bytes": linked.context_binary.stat().st_size if graph == next(iter(linked.ctx_models)) else 0,
            }
        )
    return index
