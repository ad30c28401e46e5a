"""Static-shape ONNX export of a drafter graph and its numeric check (docs/design.md "Numerics by construction").

`export_static` runs torch's dynamo exporter (``torch.onnx.export(..., dynamo=True)``) on fixed example inputs --
every shape static, no ``dynamic_shapes`` -- optionally rewrites each RMSNorm into the HTP's elementwise form
(`hycoc.passes.rmsnorm_decomposition`), saves the graph with its weights as external data (no 2 GB protobuf
limit) and runs the ONNX checker on the saved file. Before saving, `hycoc.targets.static_shape_check` refuses a
graph with data-dependent KV slicing or a fused attention op. `compare_with_torch` runs the saved graph on onnxruntime's
CPU EP and measures it against the torch module on the same inputs (max absolute error per output, top-1
agreement of a logits output). Both are used by the SLM's tree graph (`hycoc.passes.slm.graph`); the head's graph
can use them the same way.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: opset of exported graphs: 16-bit Q/DQ for the HTP needs >= 21 (shared/FIELD-NOTES.md, QNN EP).
OPSET = 21


class ExportError(RuntimeError):
    """The exporter failed, the checker rejected the graph, or onnxruntime could not run it."""


@dataclass
class ExportReport:
    """What one export did. ``seconds``: torch export + rewrite + save + check (wall). ``ops``: op type -> count
    in the saved graph. ``int8_initializers``: integer weights kept as int8 initializers (not folded to float).
    ``model_bytes`` / ``data_bytes``: the ``.onnx`` file and its external data. ``rms_norms``: RMSNorms rewritten.
    ``max_abs_error``: output name -> max |onnxruntime - torch|; ``top1_agreement``: share of logits rows whose
    argmax agrees (both filled by `compare_with_torch`)."""

    path: Path
    seconds: float
    opset: int
    ops: dict[str, int]
    int8_initializers: int
    model_bytes: int
    data_bytes: int
    rms_norms: int = 0
    rms_norms_reshaped: int = 0
    max_abs_error: dict[str, float] = field(default_factory=dict)
    top1_agreement: float | None = None

    def numbers(self) -> dict[str, Any]:
        """JSON values for a `PassReport`."""
        return {
            "seconds": round(self.seconds, 3),
            "opset": self.opset,
            "nodes": sum(self.ops.values()),
            "ops": self.ops,
            "int8_initializers": self.int8_initializers,
            "model_bytes": self.model_bytes,
            "data_bytes": self.data_bytes,
            "rms_norms": self.rms_norms,
            "rms_norms_reshaped": self.rms_norms_reshaped,
            "max_abs_error": self.max_abs_error,
            "top1_agreement": self.top1_agreement,
        }


def _keeps_integer_weight(node) -> bool | None:
    """onnxscript's ``should_fold`` hook: never fold a node that reads an int8 constant (an integer weight)."""
    import onnx_ir as ir

    for value in node.inputs:
        if value is not None and value.const_value is not None and value.const_value.dtype == ir.DataType.INT8:
            return False
    return None


def export_static(
    module,
    example_inputs: Sequence[Any],
    path: str | Path,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    decompose_rms_norm: bool = True,
    opset: int = OPSET,
):
    """Export ``module(*example_inputs)`` at the inputs' static shapes to ``path`` (+ ``path.data``).

    example_inputs: torch tensors, in ``input_names`` order. Returns (onnx_ir.Model in memory, `ExportReport`).
    Raises ExportError when the exporter fails, an RMSNorm over a rank-4 input survives the decomposition
    (`hycoc.passes.rewrite.rms_norm.rank4_rms_inputs`) or the checker rejects the saved graph,
    RmsNormDecompositionError when ``decompose_rms_norm`` is set and the graph has no RMSNorm to rewrite, and
    StaticGraphError (`hycoc.targets.static_shape_check`) when the graph slices KV at data-dependent positions or
    holds a fused attention op (nothing is saved then).
    """
    import onnx
    import onnx_ir as ir
    import torch
    from hycoc.passes.rewrite.rms_norm import rank4_rms_inputs
    from hycoc.passes.rmsnorm_decomposition import RmsNormDecompositionPass
    from hycoc.targets.static_shape_check import check_static_graph
    from onnxscript import optimizer

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            program = torch.onnx.export(
                module,
                tuple(example_inputs),
                dynamo=True,
                input_names=list(input_names),
                output_names=list(output_names),
                opset_version=opset,
                optimize=False,
                external_data=True,
            )
    except Exception as e:  # the exporter raises many types; say which graph failed and keep the cause
        raise ExportError(f"torch.onnx.export (dynamo) failed for {type(module).__name__}: {e}") from e
    if program is None:  # torch returns None only for the TorchScript exporter (dynamo=False)
        raise ExportError(f"torch.onnx.export (dynamo) returned no ONNX program for {type(module).__name__}")
    model = program.model
    # The exporter's own optimize=True folds Cast(int8) * scale into a float weight whenever the weight is small
    # enough (onnxscript's size limits), so a graph's form would depend on its size. The same optimizer runs here
    # with integer weights kept as int8 initializers, whatever their size; the QDQ step re-expresses them.
    optimizer.optimize_ir(model, should_fold=_keeps_integer_weight)
    rewritten: list[dict[str, Any]] = []
    if decompose_rms_norm:
        rms = RmsNormDecompositionPass(require_match=True)
        rms(model)
        rewritten = rms.rewritten
        left = rank4_rms_inputs(model)
        if left:
            raise ExportError(
                f"{type(module).__name__}: {len(left)} RMSNorm(s) still reduce a rank-4 input after the decomposition "
                f"({', '.join(f'{n} (rank {r})' for n, r in left)}); the HTP computes rank-4 RMSNorm wrongly. "
                f"Fix: extend passes/rewrite/rms_norm.py so the norm matches (see "
                f"hycoc.passes.rmsnorm_decomposition.explain), which reshapes x to [B, -1, head_dim] first"
            )
    check_static_graph(model, what=f"{type(module).__name__} exported to {path.name}")
    data = path.with_name(path.name + ".data")
    ir.save(model, path, external_data=data.name)
    try:
        onnx.checker.check_model(str(path), full_check=True)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"ONNX checker rejected {path}: {e}") from e
    seconds = time.perf_counter() - start
    ops = Counter(node.op_type for node in ir.traversal.RecursiveGraphIterator(model.graph))
    int8 = sum(
        1
        for v in model.graph.initializers.values()
        if v.const_value is not None and v.const_value.dtype == ir.DataType.INT8
    )
    report = ExportReport(
        path=path,
        seconds=seconds,
        opset=model.opset_imports.get("", opset),
        ops=dict(sorted(ops.items())),
        int8_initializers=int8,
        model_bytes=path.stat().st_size,
        data_bytes=data.stat().st_size if data.exists() else 0,
        rms_norms=len(rewritten),
        rms_norms_reshaped=sum(1 for r in rewritten if r["reshaped"]),
    )
    return model, report


def compare_with_torch(
    path: str | Path,
    module,
    inputs: Sequence[Any],
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    logits: str | None = "logits",
    report: ExportReport | None = None,
) -> tuple[dict[str, float], float | None]:
    """Run the saved graph on onnxruntime's CPU EP and ``module`` in torch on the same ``inputs``.

    Returns (output name -> max absolute error, top-1 agreement over the rows of output ``logits`` or None), and
    writes both into ``report`` when given. Raises ExportError when onnxruntime cannot load or run the graph.
    """
    import onnxruntime as ort
    import torch

    so = ort.SessionOptions()
    # no constant folding: folded, every Cast(int8) * scale weight would be held as float32 (4 bytes per weight,
    # 8 GB for E2B's graph) besides its int8 initializer; unfolded, each is computed when its MatMul runs
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    try:
        session = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
        got = session.run(list(output_names), {n: t.detach().cpu().numpy() for n, t in zip(input_names, inputs)})
    except Exception as e:  # onnxruntime raises its own exception types
        raise ExportError(f"onnxruntime CPU EP could not run {path}: {e}") from e
    with torch.no_grad():
        want = [t.detach().cpu().numpy() for t in module(*inputs)]
    errors = {
        name: float(np.max(np.abs(g.astype(np.float64) - w.astype(np.float64))))
        for name, g, w in zip(output_names, got, want)
    }
    top1 = None
    if logits is not None:
        index = list(output_names).index(logits)
        g, w = got[index], want[index]
        top1 = float(np.mean(g.reshape(-1, g.shape[-1]).argmax(-1) == w.reshape(-1, w.shape[-1]).argmax(-1)))
    if report is not None:
        report.max_abs_error, report.top1_agreement = errors, top1
    return errors, top1
