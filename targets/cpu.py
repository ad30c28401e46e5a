"""The ``cpu`` target: the QDQ ONNX graphs themselves, run by onnxruntime's CPU EP (docs/design.md "Targets").

:func:`package_cpu` checks that a QDQ model loads on the CPU EP and copies it (with its external data file, if any)
into the bundle folder as ``GRAPH.onnx``.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hycoc.bundle import sha256_file


class CpuTargetError(RuntimeError):
    """The model does not load on onnxruntime's CPU EP, or its files are not where it says."""


@dataclass
class CpuGraph:
    """One graph of the cpu target: its path in the bundle, sha256, size in bytes and I/O."""

    name: str
    model: Path
    sha256: str
    bytes: int
    extra_files: list[Path] = field(default_factory=list)
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)


def package_cpu(qdq_model_path: str | os.PathLike, out_dir: str | os.PathLike, *, graph_name: str) -> CpuGraph:
    """Check ``qdq_model_path`` loads on the CPU EP and copy it to ``out_dir/GRAPH.onnx``.

    A model with external data keeps its data file(s) next to it under their recorded names (the ONNX file refers
    to them by relative path). Raises CpuTargetError when the model does not load or a data file is missing.
    """
    import onnx
    import onnxruntime as ort

    src = Path(qdq_model_path)
    try:
        sess = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types
        raise CpuTargetError(f"{src.name} does not load on the onnxruntime CPU EP: {e}") from None
    ins = [{"name": i.name, "shape": list(i.shape), "dtype": i.type} for i in sess.get_inputs()]
    outs = [{"name": o.name, "shape": list(o.shape), "dtype": o.type} for o in sess.get_outputs()]
    del sess

    model = onnx.load(str(src), load_external_data=False)
    data_files = sorted(
        {
            e.value
            for t in model.graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL
            for e in t.external_data
            if e.key == "location"
        }
    )
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dst = out_dir / f"{graph_name}.onnx"
    extra = []
    for rel in data_files:
        s = src.parent / rel
        if not s.exists():
            raise CpuTargetError(f"{src.name} refers to external data {rel!r}, which is not beside it")
        d = out_dir / rel
        d.parent.mkdir(parents=True, exist_ok=True)
        if s.resolve() != d.resolve():
            shutil.copy2(s, d)
        extra.append(d)
    if src.resolve() != dst.resolve():
        shutil.copy2(src, dst)
    return CpuGraph(graph_name, dst, sha256_file(dst), dst.stat().st_size, extra, ins, outs)
