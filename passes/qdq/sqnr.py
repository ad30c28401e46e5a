"""How far a QDQ graph is from its float graph (`hycoc.passes.qdq.quantize`): `sqnr_report` runs both on the CPU EP with
every decoder layer's output (`layer_outputs`) added as a graph output (on copies) and reports the SQNR (dB) per
graph output and per layer, and the top-1 agreement of the logits; `sqnr_table` prints it, `write_sqnr_json` saves
it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hycoc.numerics import sqnr_db


def layer_outputs(model) -> dict[str, str]:
    """``model.layers.i`` (the SLM graph) or ``layers.i`` (the head graph) -> the tensor its last node writes (from
    the exporter's ``name_scopes`` metadata)."""
    import ast

    last: dict[str, str] = {}
    for n in model.graph.node:
        if n.op_type == "Constant" or not n.output:
            continue
        meta = {p.key: p.value for p in n.metadata_props}
        scopes = meta.get("pkg.torch.onnx.name_scopes")
        if not scopes:
            continue
        try:
            parts = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            continue
        layer = next(
            (
                p
                for p in parts
                if (p.count(".") == 2 and p.startswith("model.layers."))
                or (p.count(".") == 1 and p.startswith("layers."))
            ),
            None,
        )
        if layer is not None:
            last[layer] = n.output[0]
    return dict(sorted(last.items(), key=lambda kv: int(kv[0].rsplit(".", 1)[1])))


def _dq_name(model, tensor: str) -> str:
    """The dequantized copy of ``tensor`` in a QDQ graph (what its consumers read), or ``tensor`` itself."""
    q = next((n for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] == tensor), None)
    if q is None:
        return tensor
    dq = next((n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] == q.output[0]), None)
    return dq.output[0] if dq is not None else tensor


def sqnr_report(
    float_path: str | Path,
    qdq_path: str | Path,
    samples: Sequence[Mapping[str, np.ndarray]],
    *,
    layers: Mapping[str, str] | None = None,
    logits: str | None = "logits",
) -> dict[str, Any]:
    """SQNR (dB, over all samples) of every graph output and of each ``layers`` tensor (label -> float tensor
    name), QDQ vs float on the CPU EP, and the top-1 agreement of ``logits`` rows. JSON-ready (``sqnr.json``)."""
    import onnx
    from hycoc.passes.calibration import run_with_tensors

    fm = onnx.load(str(float_path), load_external_data=False)
    qm = onnx.load(str(qdq_path), load_external_data=False)
    outputs = [o.name for o in fm.graph.output]
    layers = dict(layers or {})
    qnames = {label: _dq_name(qm, t) for label, t in layers.items()}
    f_runs = run_with_tensors(float_path, outputs + list(layers.values()), samples)
    q_runs = run_with_tensors(qdq_path, outputs + list(qnames.values()), samples)

    def cat(runs, name):
        return np.concatenate([r[name].reshape(-1) for r in runs])

    report: dict[str, Any] = {
        "samples": len(samples),
        "outputs": {o: round(sqnr_db(cat(f_runs, o), cat(q_runs, o)), 3) for o in outputs},
        "layers": {label: round(sqnr_db(cat(f_runs, t), cat(q_runs, qnames[label])), 3) for label, t in layers.items()},
    }
    if logits is not None and logits in outputs:
        agree = [
            np.mean(
                f[logits].reshape(-1, f[logits].shape[-1]).argmax(-1)
                == q[logits].reshape(-1, q[logits].shape[-1]).argmax(-1)
            )
            for f, q in zip(f_runs, q_runs)
        ]
        report["top1_agreement"] = round(float(np.mean(agree)), 6)
    return report


def sqnr_table(report: Mapping[str, Any]):
    """A rich Table of an `sqnr_report`."""
    from rich.table import Table

    table = Table(title=f"QDQ vs float SQNR ({report['samples']} samples)")
    table.add_column("tensor")
    table.add_column("SQNR dB", justify="right")
    for kind in ("layers", "outputs"):
        for name, value in report[kind].items():
            table.add_row(name, f"{value:.1f}")
    if "top1_agreement" in report:
        table.add_row("top-1 agreement (logits)", f"{report['top1_agreement']:.1%}")
    return table


def write_sqnr_json(report: Mapping[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=1), encoding="utf-8")
