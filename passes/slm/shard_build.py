"""The SLM tree graph as layer shards through export and QDQ: the pass ``slm_shards`` (docs/compiler.md "Layer-sharded
SLM"; docs/real-shapes.md).

With ``[target] slm_shards`` set (N, or ``"auto"``: the fewest shards whose weights fit the target profile's
context budget, `hycoc.passes.slm.shards.plan_shards`), this pass stands where ``slm_tree_graph`` and ``qdq_slm``
stand in the unsharded build: it splits the SLM into N shards of contiguous layers (`hycoc.passes.slm.graph`
"Shards"), exports each (`export_slm_graph`), quantizes each with `hycoc.passes.qdq.quantize.quantize_graph` on **the
float chain's tensors**: the build's calibration inputs (`QdqQuantize`'s, real or synthetic) are run through
the torch shards in order (`run_shard_chain`), and shard k calibrates on its inputs there (host feeds and the
earlier shards' float outputs), and adds the top-k outputs to the last shard (`append_topk`). The target step
then packages (cpu) or compiles (htp) each shard into a graph of its own, ``slm.s0``, ``slm.s1``, ...: on htp one
context binary per shard, each checked against the budget before compiling (`hycoc.targets.htp.compile_shared`'s
size planner); the runtime chains them (`hycoc.runtime.graphs.ShardChainRunner`).

Why one binary per shard and not one weight-shared binary holding every shard: a context binary is one context,
and the budget is per context (`max_context_bytes`: what one context may allocate); a weight-shared binary of all
shards holds all their weights in one context, so it is as large as the monolithic graph's and the split gains
nothing; weight sharing pays when graphs share weights (the tree graph and its 1-row decode graph,
`SHARED_CONTEXTS`; Genie's prompt-processor/token-generator pairs per part), and the x86 HTP simulator cannot load a
weight-shared binary at all. Qualcomm's own multi-part LLM exports (qai-hub-models' Llama/Gemma "parts", Genie's
``ctx-bins`` list) ship one context binary per part the same way.

Artifact ``qdq_slm_shards`` (`ShardedOnnxArtifact`): a folder with one QDQ ONNX per shard
(``slm.sK/slm.sK.onnx`` + external data) and ``shards.json`` (bounds and graph names, in chain order).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

from hycoc.passes.artifacts import Artifact, FolderArtifact, KeepSetArtifact, SlmIntegerArtifact
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.recipe import Recipe

#: The graph the shards replace in the bundle; shard k is named ``slm.sK`` (`hycoc.bundle.shard_graph_name`).
GRAPH = "slm"
KIND = "qdq_slm_shards"


class ShardedOnnxArtifact(FolderArtifact):
    """kind ``qdq_slm_shards``: a folder (payload: its Path) with one QDQ ONNX per shard and ``shards.json``:
    {"bounds": [0, b_1, ..., L], "graphs": [{"name": "slm.s0", "model": "slm.s0/slm.s0.onnx"}, ...]}.
    Saved by copying the folder; hashed over its files (`hash_folder`)."""

    type_name: ClassVar[str] = "sharded_onnx"
    INDEX: ClassVar[str] = "shards.json"

    def models(self) -> list[tuple[str, Path]]:
        """[(graph name, QDQ ONNX path)] in chain order."""
        return [(g["name"], Path(self.payload) / g["model"]) for g in self.index()["graphs"]]


def resolve_bounds(slm, keep_size: int, recipe: Recipe) -> tuple[tuple[int, ...], dict[str, Any]]:
    """The shard bounds for ``recipe.target.slm_shards`` on the recipe target's context budget
    (`plan_shards`); returns (bounds, numbers). Raises ShardPlanError (no split fits / a bad count)."""
    from hycoc.passes.slm.shards import layer_weight_bytes, plan_shards
    from hycoc.targets.profiles import UnknownTargetError, profile_for

    t = recipe.target
    try:
        budget = profile_for(int(t.htp_arch), str(t.soc_model), int(t.context_size_limit_mb)).max_context_bytes
    except UnknownTargetError:
        budget = None
    per_layer, first, last = layer_weight_bytes(slm, keep_size)
    plan = plan_shards(per_layer, budget=budget, shards=t.slm_shards, first_extra=first, last_extra=last)
    return plan.bounds, {
        "bounds": list(plan.bounds),
        "estimated_shard_bytes": list(plan.shard_bytes),
        "budget_bytes": budget,
        "fits": plan.fits,
        "slm_shards": t.slm_shards,
    }


class SlmShardsPass(Pass):
    """``slm_integer`` + ``keep_set`` (+ the calibration inputs of `QdqQuantize`) -> ``qdq_slm_shards`` (module
    docstring). Reads ``[target]`` (``slm_shards``, the budget), ``[window]``, ``[tree]``, ``[slm_calibration]``."""

    name = "slm_shards"
    version = 2  # v2: Softmax outputs encoded [0, 1] (`hycoc.passes.qdq.encodings.softmax_overrides`)
    section = "target"
    produces = {KIND: ShardedOnnxArtifact}

    def __init__(self, *, seed: int = 0, calibration: str = "real", work_dir: Path | None = None):
        from hycoc.passes.qdq.quantize import QdqQuantize

        self.qdq = QdqQuantize(seed=seed, calibration=calibration)  # its calibration inputs and their source
        self.consumes = {k: v for k, v in self.qdq.consumes.items() if k != "onnx_slm"}
        self.consumes |= {"slm_integer": SlmIntegerArtifact, "keep_set": KeepSetArtifact}
        self.also_reads = tuple(dict.fromkeys(("window", "tree", "slm_calibration", *self.qdq.also_reads)))
        self.seed, self.calibration, self.work_dir = seed, calibration, work_dir

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        # slm_shards is in the [target] dump only when != 1 (hycoc.recipe.Target._dump); named here as well
        return {"seed": self.seed, "calibration": self.calibration, "slm_shards": recipe.target.slm_shards}

    def files_read(self, recipe: Recipe) -> dict[str, Path]:
        return self.qdq.files_read(recipe)  # its calibration reads what QdqQuantize's does

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Artifact], PassReport]:
        import numpy as np
        import onnx
        import torch
        from hycoc.passes.qdq.encodings import require_a16
        from hycoc.passes.qdq.quantize import quantize_graph
        from hycoc.passes.slm.graph import FULL, SLIDING, SlmTreeGraph, export_slm_graph
        from hycoc.passes.slm.shard_chain import run_shard_chain
        from hycoc.passes.topk_outputs import append_topk

        from hycoc.bundle import shard_graph_name

        cal = recipe.slm_calibration
        require_a16(cal.activation_bits)
        start = time.perf_counter()
        slm, keep = inputs["slm_integer"].payload, inputs["keep_set"].payload
        bounds, numbers = resolve_bounds(slm, len(keep), recipe)
        rows = recipe.tree.node_budget
        ring = {FULL: recipe.window.slm_window, SLIDING: recipe.window.slm_sliding_window}
        graph = SlmTreeGraph(slm, keep, rows=rows, ring=ring)  # the calibration drives the whole model
        samples, _, source = self.qdq._samples(graph, slm, keep, inputs, recipe)
        del graph
        shards = [SlmTreeGraph(slm, keep, rows=rows, ring=ring, bounds=bounds, shard=k) for k in range(len(bounds) - 1)]
        per_shard: list[list[dict]] = [[] for _ in shards]
        for sample in samples:  # the float chain's tensors
            _, x = run_shard_chain(shards, sample)
            for k, xk in enumerate(x):
                per_shard[k].append(xk)
        if self.work_dir is not None:
            Path(self.work_dir).mkdir(parents=True, exist_ok=True)
        out = Path(tempfile.mkdtemp(prefix="slm-shards-", dir=self.work_dir))
        index: dict[str, list] = {"bounds": list(bounds), "graphs": []}
        numbers |= {"shards": [], "calibration_inputs": source, "samples": len(samples)}
        with tempfile.TemporaryDirectory(prefix="hycoc-slm-shards-") as tmp:
            for k, g in enumerate(shards):
                name = shard_graph_name(GRAPH, k)
                src = Path(tmp) / name / "float.onnx"
                example = [torch.from_numpy(np.ascontiguousarray(per_shard[k][0][n])) for n in g.input_names]
                _, export = export_slm_graph(g, example, src)
                result = quantize_graph(
                    src, per_shard[k], Path(tmp) / name / "qdq", percentile=cal.percentile, range_scale=cal.range_scale
                )
                model = onnx.load(str(result.path))
                if g.last:
                    model = append_topk(model, recipe.tree.slm_candidates, with_logq=True)
                dest = out / name / f"{name}.onnx"
                dest.parent.mkdir(parents=True)
                onnx.save(model, str(dest), save_as_external_data=True, location=f"{name}.onnx.data")
                index["graphs"].append({"name": name, "model": f"{name}/{name}.onnx"})
                sq = result.sqnr["outputs"]
                numbers["shards"].append(
                    {
                        "name": name,
                        "layers": list(g.layer_range),
                        "borrowed": g.borrowed,
                        "export_max_error": max(export.max_abs_error.values()),
                        "sqnr_outputs": sq,
                        "weight_bits": result.numbers()["weight_bits"],
                    }
                )
        (out / ShardedOnnxArtifact.INDEX).write_text(json.dumps(index, indent=1), encoding="utf-8")
        logits = numbers["shards"][-1]["sqnr_outputs"].get("logits", float("nan"))
        summary = (
            f"{len(shards)} shards, layers {bounds}; estimated bytes "
            f"{', '.join(f'{b / 1e6:.2f} MB' for b in numbers['estimated_shard_bytes'])}; last shard's "
            f"SQNR logits {logits:.1f} dB on {len(samples)} {self.calibration} samples through the float chain; "
            f"{time.perf_counter() - start:.1f} s"
        )
        return {KIND: ShardedOnnxArtifact(KIND, out)}, PassReport(summary, numbers)


__all__ = ["GRAPH", "KIND", "ShardedOnnxArtifact", "SlmShardsPass", "resolve_bounds"]
