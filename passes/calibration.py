"""Activation calibration of a static ONNX graph (paper App. A: 1.2 x the 99.9th percentile; docs/design.md "Numerics by
construction"; recipe ``[slm_calibration]``, ``[head_qat].input_range_percentile``).

`ListCalibrationReader` feeds a list of input dicts (numpy, by graph input name) to onnxruntime's quantizer
(a ``CalibrationDataReader``), after checking each dict against the graph's inputs (names, shapes) and the fixed
input ranges (`check_fixed_inputs`: an additive mask must hold finite values in [`MASK_MIN`, 0], never -inf or a
min-float stand-in, which would wreck the 16-bit mask's scale).

`activation_ranges` runs the float graph on onnxruntime's CPU EP with every float tensor as an extra output and
turns the values into ranges: r = percentile(|x|, ``percentile``) x ``range_scale`` (SLM: 99.9 x 1.2; the head's
fixed input ranges: 99.99 x 1.0), then (rmin, rmax) = (max(min x, -r), min(max x, r)) widened to hold 0 (an
asymmetric uint16 encoding needs 0 inside its range). The quantizer receives them as ``rmin``/``rmax`` overrides,
so its own MinMax calibration never decides a range that this module measured. All values of a tensor over all
inputs are kept in memory for an exact percentile: fine for the tiny and toy graphs; a full-size SLM needs a
histogram (not done yet).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

#: The additive mask's fixed range: 0 (visible) and -1e4 (hidden, `hycoc.passes.slm.graph.MASK_NEG`), both exact
#: in the 16-bit encoding; the graph must never see -inf or a min-float stand-in.
MASK_MIN, MASK_MAX = -1e4, 0.0
#: Rotary cos/sin rows lie in [-1, 1] (Gemma's attention_scaling is 1).
ROTARY_MIN, ROTARY_MAX = -1.0, 1.0


class CalibrationError(ValueError):
    """Calibration inputs the graph cannot be calibrated on: a missing input, a wrong shape, a mask value outside
    [-1e4, 0] (-inf, -3.4e38, ...) or a rotary row outside [-1, 1]. The message names the input and sample."""


def is_mask_input(name: str) -> bool:
    return name.startswith("mask")


def is_rotary_input(name: str) -> bool:
    return name.startswith(("cos_", "sin_"))


def check_fixed_inputs(sample: Mapping[str, np.ndarray], index: int = 0) -> None:
    """Raise CalibrationError when a mask input leaves [MASK_MIN, MASK_MAX] or holds a non-finite value, or a
    rotary input leaves [-1, 1]. ``index``: the sample's number, for the message."""
    for name, x in sample.items():
        if is_mask_input(name):
            bad = ~np.isfinite(x) | (x < MASK_MIN) | (x > MASK_MAX)
            if bad.any():
                raise CalibrationError(
                    f"calibration sample {index}: input '{name}' holds {int(bad.sum())} values outside the fixed mask "
                    f"range [{MASK_MIN:g}, {MASK_MAX:g}] (e.g. {x[bad].flat[0]!r}); hidden columns must be the finite "
                    f"constant {MASK_MIN:g}, never -inf or a min-float stand-in, which would wreck the 16-bit mask "
                    f'encoding (docs/design.md "Numerics by construction")'
                )
        elif is_rotary_input(name):
            if not np.isfinite(x).all() or np.abs(x).max(initial=0.0) > ROTARY_MAX:
                raise CalibrationError(
                    f"calibration sample {index}: rotary input '{name}' leaves the fixed range "
                    f"[{ROTARY_MIN:g}, {ROTARY_MAX:g}] (max |x| {np.abs(x).max():g})"
                )


def _graph_inputs(model_path: str | Path) -> dict[str, tuple[int, ...]]:
    import onnx

    g = onnx.load(str(model_path), load_external_data=False).graph
    inits = {t.name for t in g.initializer}
    return {i.name: tuple(d.dim_value for d in i.type.tensor_type.shape.dim) for i in g.input if i.name not in inits}


def check_samples(model_path: str | Path, samples: Sequence[Mapping[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """The samples as float32 dicts of exactly the graph's inputs, checked (names, static shapes, fixed ranges).
    Raises CalibrationError."""
    if not samples:
        raise CalibrationError("no calibration samples")
    want = _graph_inputs(model_path)
    out = []
    for index, sample in enumerate(samples):
        missing = sorted(set(want) - set(sample))
        if missing:
            raise CalibrationError(f"calibration sample {index} lacks graph inputs {missing}")
        feed = {name: np.ascontiguousarray(sample[name], dtype=np.float32) for name in want}
        for name, shape in want.items():
            if feed[name].shape != shape:
                raise CalibrationError(
                    f"calibration sample {index}: input '{name}' has shape {feed[name].shape}, the graph takes {shape}"
                )
        check_fixed_inputs(feed, index)
        out.append(feed)
    return out


def list_reader(samples: Iterable[Mapping[str, np.ndarray]]):
    """An onnxruntime ``CalibrationDataReader`` over ``samples`` (already checked, see `check_samples`)."""
    from onnxruntime.quantization import CalibrationDataReader

    class ListCalibrationReader(CalibrationDataReader):
        def __init__(self, items):
            self.items = list(items)
            self.rewind()

        def get_next(self):
            return next(self._it, None)

        def rewind(self):
            self._it = iter(self.items)

    return ListCalibrationReader(samples)


def float_tensors(model) -> list[str]:
    """Names of every float node output of ``model`` (an onnx.ModelProto, shapes inferred), graph outputs first."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    types = {v.name: v.type.tensor_type.elem_type for v in (*inferred.graph.value_info, *inferred.graph.output)}
    names = [o.name for o in model.graph.output]
    for n in model.graph.node:
        for o in n.output:
            if o and o not in names and types.get(o) == onnx.TensorProto.FLOAT and n.op_type != "Constant":
                names.append(o)
    return names


def run_with_tensors(
    model_path: str | Path, tensors: Sequence[str], samples: Sequence[Mapping[str, np.ndarray]]
) -> list[dict[str, np.ndarray]]:
    """Run the graph on the CPU EP with ``tensors`` added as graph outputs (on a copy); one dict per sample.

    The copy is the graph's protobuf only (external data not loaded), written beside ``model_path`` so its external
    data references resolve, and removed afterwards: a graph whose weights exceed protobuf's 2 GB limit never
    passes through one serialized message (the E2B SLM at real shape, docs/real-shapes.md)."""
    import os
    import tempfile

    import onnx
    import onnxruntime as ort

    model_path = Path(model_path)
    model = onnx.load(str(model_path), load_external_data=False)
    have = {o.name for o in model.graph.output}
    for name in tensors:
        if name not in have:
            model.graph.output.append(onnx.ValueInfoProto(name=name))
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL  # tensors keep their names
    so.intra_op_num_threads = 1
    fd, copy = tempfile.mkstemp(prefix=".outputs-", suffix=".onnx", dir=model_path.parent)
    os.close(fd)
    try:
        onnx.save(model, copy)
        session = ort.InferenceSession(copy, so, providers=["CPUExecutionProvider"])
    finally:
        os.unlink(copy)
    names = list(tensors)
    return [dict(zip(names, session.run(names, dict(s)))) for s in samples]


def range_of(values: Sequence[np.ndarray], percentile: float, range_scale: float) -> tuple[float, float]:
    """(rmin, rmax) of one tensor over all samples (module docstring)."""
    x = np.concatenate([np.asarray(v, dtype=np.float32).reshape(-1) for v in values])
    r = float(np.percentile(np.abs(x), percentile)) * range_scale
    lo, hi = max(float(x.min()), -r), min(float(x.max()), r)
    return min(lo, 0.0), max(hi, 0.0)


def activation_ranges(
    model_path: str | Path, samples: Sequence[Mapping[str, np.ndarray]], *, percentile: float, range_scale: float = 1.0
) -> dict[str, tuple[float, float]]:
    """Tensor name -> (rmin, rmax) for every graph input and float node output of the graph at ``model_path``."""
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    names = float_tensors(model)
    runs = run_with_tensors(model_path, names, samples)
    ranges = {name: range_of([s[name] for s in samples], percentile, range_scale) for name in samples[0]}
    for name in names:
        ranges[name] = range_of([r[name] for r in runs], percentile, range_scale)
    return ranges
