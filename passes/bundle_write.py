"""The bundle a finished `hycoc build` pipeline writes (`write_bundle`, docs/design.md "Bundle"), with
`hycoc.bundle_writer.BundleWriter` (a temporary folder renamed when complete): tokenizer.json, keep_set.npy, the
host LUTs (head E table; SLM token and per-layer embeddings in the checkpoint's packed storage), rotary tables, the
target's graphs and context binaries, and report.json (every pass's numbers: QAT agreement, SQNR, export errors;
paths relative to the recipe, `recipe_relative`).
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.passes.pipeline import PipelineResult

from hycoc.chat_template import bundle_chat_format
from hycoc.recipe import Recipe


def _npy(array: np.ndarray) -> bytes:
    """``array`` as the bytes of a .npy file (C order, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def host_info(head_config: dict, slm, inclusive: bool = True) -> Any:
    """The manifest's ``host`` section from the head's config dict and the SLM surgery output. ``inclusive``: recipe
    ``[window] head_sliding_window_inclusive`` (the head's sliding positions, `hycoc.host.head_sliding_positions`)."""
    from hycoc.passes.slm.graph import text_config

    from hycoc.bundle_constants import HeadHostInfo, HostInfo, LutInfo, SlmHostInfo
    from hycoc.host import head_sliding_positions

    text = head_config.get("text_config") or head_config
    c = text_config(slm)  # transformers' Gemma4TextConfig: kv_sharing_modes is derived, not stored
    return HostInfo(
        head=HeadHostInfo(sliding_window=head_sliding_positions(int(text["sliding_window"]), inclusive)),
        slm=SlmHostInfo(
            layer_types=list(c.layer_types),
            kv_layers=[i for i, m in enumerate(c.kv_sharing_modes) if m != "reuse"],
            sliding_window=int(c.sliding_window),
            per_layer_dim=int(c.hidden_size_per_layer_input or 0),
            luts={
                name: LutInfo(bits=int(lut.bits), dim=int(lut.dim), embed_scale=float(lut.embed_scale))
                for name, lut in slm.luts.items()
            },
        ),
    )


def recipe_relative(value: Any, base_dir: Path) -> Any:
    """``value`` (JSON: dicts, lists, strings, numbers) with every path under the recipe's folder ``base_dir`` written
    relative to it, as the recipe writes it (``"/home/u/hycoc/recipes/toy/data/conversations.jsonl after line 2000"``
    -> ``"toy/data/conversations.jsonl after line 2000"``), so the bundle's report names no folder of the machine
    that built it (docs/design.md "Bundle")."""
    if isinstance(value, dict):
        return {k: recipe_relative(v, base_dir) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [recipe_relative(v, base_dir) for v in value]
    if isinstance(value, str):
        for folder in dict.fromkeys((str(base_dir), str(Path(base_dir).resolve()))):
            value = value.replace(folder.rstrip(os.sep) + os.sep, "")
        return value
    return value


def write_bundle(result: PipelineResult, recipe: Recipe, target: str, out_dir: str | Path):
    """Write the bundle of a finished pipeline run to ``out_dir`` (atomically); returns the manifest."""
    from hycoc.passes.bundle_io import graph_io_from_onnx, manifest_sections
    from hycoc.passes.target_step import BuildError, TargetFilesArtifact
    from hycoc.targets.profiles import get_profile, profile_for

    from hycoc.bundle_writer import BundleWriter
    from hycoc.device_time import onnx_graph_cost

    a = result.artifacts
    keep = np.asarray(a["keep_set"].payload, dtype=np.int64)
    host = a["head_host"].payload
    slm = a["slm_integer"].payload
    files = a["target_files"]
    if not isinstance(files, TargetFilesArtifact):  # run_pipeline's (the target pass's folder in its cache entry)
        raise BuildError(f"target_files is a {type(files).__name__}, not a TargetFilesArtifact: run run_pipeline")
    root, index = Path(files.payload), files.index()
    if target == "cpu":
        profile = get_profile("cpu")
    else:
        t = recipe.target
        profile = profile_for(t.htp_arch, t.soc_model, t.context_size_limit_mb)
    qnn_sdk = next((g.get("qnn_sdk") for g in index.values() if g.get("qnn_sdk")), None)
    hub = next((g["hub"] for g in index.values() if g.get("hub")), None)  # qai-hub: jobs, device, QAIRT
    numbers = {r.pass_name: r.numbers for r in result.reports}
    report: dict[str, Any] = {
        "target": target,
        "qat_agreement": numbers.get("head_qat", {}).get("agreement"),
        "sqnr": {
            g: {
                "calibration": numbers.get(f"qdq_{g}", {}).get("sqnr"),
                "held_out": numbers.get(f"qdq_{g}", {}).get("sqnr_held_out"),
            }
            for g in ("head", "slm")
        },
        "passes": [r.to_json() | {"cached": r.cached} for r in result.reports],
        "graph_costs": {},
    }
    with BundleWriter(out_dir, overwrite=True) as w:
        w.add_file(a["tokenizer"].payload.to_str().encode(), "tokenizer.json", "tokenizer")
        w.add_file(_npy(keep), "keep_set.npy", "keep_set")
        w.add_file(_npy(host["embedding_q"]), "luts/head_embedding_q.npy", "lut")
        w.add_file(_npy(host["embedding_scale"]), "luts/head_embedding_scale.npy", "lut")
        for name, lut in slm.luts.items():
            w.add_file(_npy(lut.packed), f"luts/slm_{name}_packed.npy", "lut")
            w.add_file(_npy(lut.scale), f"luts/slm_{name}_scale.npy", "lut")
        for stem in sorted(host):
            if stem.startswith("rotary_"):
                w.add_file(_npy(host[stem]), f"rotary/head_{stem.removeprefix('rotary_')}.npy", "rotary")
        for layer_type, table in slm.rotary.items():
            w.add_file(_npy(table.inv_freq), f"rotary/slm_{layer_type}_inv_freq.npy", "rotary")
            w.add_file(
                _npy(np.asarray(table.attention_scaling, np.float32)), f"rotary/slm_{layer_type}_scaling.npy", "rotary"
            )
        binaries = set()
        for graph, entry in sorted(index.items()):
            model = root / entry["model"]
            qdq = root / entry["qdq_source"]
            binary = entry.get("context_binary")
            if binary and binary not in binaries:  # a weight-shared binary is one file for its graphs
                w.add_file(root / binary, Path(binary).name, "context_binary")
                binaries.add(binary)
            for extra in entry.get("extra", []):
                w.add_file(root / extra, Path(extra).name, "external_data")
            io_ = graph_io_from_onnx(model, qdq_source=qdq if binary else None)
            cost = onnx_graph_cost(qdq)  # the device-time estimate's inputs (`hycoc.device_time`)
            report["graph_costs"][graph] = {"bytes": int(cost.bytes), "macs": int(cost.macs)}
            if graph != "head" and not graph.startswith("slm"):  # add_graph's own refusal, before the role is typed
                raise ValueError(f"graph role {graph!r}: allowed: head, slm")
            w.add_graph(
                graph,
                "slm" if graph.startswith("slm") else "head",
                model,
                model.name,
                io=io_,
                context_binary=Path(binary).name if binary else None,
            )
        report = recipe_relative(report, recipe.base_dir)  # the passes' inputs as the recipe names them
        w.add_file(json.dumps(report, indent=1).encode(), "report.json", "report")
        return w.commit(
            **manifest_sections(recipe, profile, keep_set_size=len(keep), qnn_sdk=qnn_sdk, hub=hub),
            host=host_info(a["quantized_head"].payload.config, slm, recipe.window.head_sliding_window_inclusive),
            chat=bundle_chat_format(recipe),  # the template whole; its sources without this machine's paths
        )
