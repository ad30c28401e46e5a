"""The SLM's 1-row decode graph: SLM-alone decoding (paper Table 5's SLM-alone baseline) runs one token per forward
instead of the R-row tree graph with R - 1 padding rows (docs/device-runtime.md "slm-alone
decodes on a 1-row graph").

`SlmDecodeGraph` (pass ``slm_decode_graph``) builds `hycoc.passes.slm.graph.SlmTreeGraph` with ``rows = 1``: the
same weights, the same ring inputs (W_T columns, column p mod W_T), 1-row masks (1, 1, 1, W_T + 1), and outputs
``logits`` (1, 1, |keep set|) and ``k_new_i``/``v_new_i`` (1, KV_i, 1, D_T), which the runtime writes into the
rings as the tree path does. The exporter gives it the tree graph's node and tensor names (same modules, same
ops; only the shapes differ).

Quantization: **no calibration of its own**. Every activation tensor gets the tree graph's encoding (scale and
zero point read from the tree's QDQ graph, `activation_encodings`; `hycoc.passes.qdq.quantize.quantize_graph`
``encodings=``), and the integer weights are folded as for the tree graph, so the decode graph is the tree graph's
row 0 on the same quantization grid: ring inputs and KV outputs keep the tree graph's encodings (the runtime
copies ring codes between the two graphs unchanged), the mask, rotary and soft-cap encodings stay fixed. The pass
checks this (`QdqError` when an encoding differs) and measures it: on greedy-step inputs (one token, padding rows
under row 0 as `hycoc.runtime.slm_drafter.SlmDrafter` pads them) it runs both QDQ graphs on onnxruntime's CPU EP
and reports row 0's largest logit and KV differences and top-1 agreement (``row0_vs_tree``).

Top-k tail: `hycoc.passes.topk_outputs.append_topk` with k = 1 and no log q (greedy decoding reads only the best
keep-set index; TopK's ties go to the lower index, the tree graph's rule).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.passes.artifacts import KeepSetArtifact, OnnxArtifact, SlmIntegerArtifact
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.host import MASK_VALUE
from hycoc.recipe import Recipe

#: The decode graph's name in the bundle (role "slm"), and the QDQ artifact kind it is built as.
DECODE_GRAPH = "slm_decode"
DECODE_KIND = "qdq_slm_decode"
#: Candidates per row the decode graph emits: greedy decoding needs the best one.
DECODE_TOP_K = 1
#: Synthetic 1-row samples onnxruntime's calibration run gets (every encoding is given, so they only feed it).
CALIBRATION_SAMPLES = 2
#: Greedy-step inputs on which the decode graph is compared with the tree graph's row 0.
COMPARISON_SAMPLES = 4


def activation_encodings(qdq_model) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Tensor name -> (scale float32, zero point) scalars of every ``QuantizeLinear`` with a per-tensor scale in
    ``qdq_model`` (an onnx.ModelProto): the activation encodings of an onnxruntime QDQ graph, by the float graph's
    tensor names (a graph output by its own name; weights, initializers under a ``DequantizeLinear`` only, are not
    listed)."""
    from onnx import numpy_helper

    g = qdq_model.graph
    small = {t.name: t for t in g.initializer}
    outputs = {o.name for o in g.output}
    # a graph output X is quantized as X_QuantizeLinear_Input -> Q -> DQ -> X: its encoding goes by X
    dq_of = {n.input[0]: n.output[0] for n in g.node if n.op_type == "DequantizeLinear"}
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for n in g.node:
        if n.op_type != "QuantizeLinear" or n.input[1] not in small or len(n.input) < 3 or n.input[2] not in small:
            continue
        scale, zp = numpy_helper.to_array(small[n.input[1]]), numpy_helper.to_array(small[n.input[2]])
        if scale.size == 1:
            dq = dq_of.get(n.output[0])
            name = dq if dq is not None and dq in outputs else n.input[0]
            out[name] = (scale.reshape(()).astype(np.float32), zp.reshape(()))
    return out


def tree_feeds(decode_feeds: dict[str, np.ndarray], shapes: dict[str, tuple[int, ...]]) -> dict[str, np.ndarray]:
    """The R-row tree graph's inputs whose row 0 is ``decode_feeds``' one row (a greedy step as the runtime pads
    it): rows 1.. repeat row 0's token at the next position and see only the ring and themselves, so row 0 sees
    exactly what the decode row sees. shapes: the tree graph's input shapes by name."""
    out = {}
    for name, x in decode_feeds.items():
        want = shapes[name]
        if name.startswith("mask_"):
            r, w = want[2], want[3] - want[2]
            m = np.full(want, MASK_VALUE, np.float32)
            m[..., :w] = x[..., 0:1, :w]
            m[0, 0, np.arange(r), w + np.arange(r)] = 0.0
            out[name] = m
        elif name.startswith(("k_ring_", "v_ring_")):
            out[name] = x
        else:  # (1, 1, ...) row inputs: repeat along rows
            out[name] = np.repeat(x, want[1], axis=1)
    return out


def compare_with_tree(
    decode_path: str | Path, tree_path: str | Path, samples: list[dict[str, np.ndarray]]
) -> dict[str, Any]:
    """Run the decode QDQ graph and the tree QDQ graph (onnxruntime CPU EP) on ``samples`` (decode inputs, the
    tree's built by `tree_feeds`) and compare the decode row with the tree's row 0: largest |difference| of the
    logits and of each KV output, and the share of samples whose arg-max (first among equals) agrees."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    dec = ort.InferenceSession(str(decode_path), so, providers=["CPUExecutionProvider"])
    tree = ort.InferenceSession(str(tree_path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in dec.get_outputs() if o.name == "logits" or o.name.startswith(("k_new_", "v_new_"))]
    shapes = {i.name: tuple(i.shape) for i in tree.get_inputs()}
    worst = dict.fromkeys(names, 0.0)
    agree = 0
    for s in samples:
        a = dict(zip(names, dec.run(names, s)))
        b = dict(zip(names, tree.run(names, tree_feeds(s, shapes))))
        for n in names:
            row0 = b[n][:, 0:1] if n == "logits" else b[n][:, :, 0:1]
            worst[n] = max(worst[n], float(np.max(np.abs(a[n] - row0))))
        agree += int(np.argmax(a["logits"][0, 0]) == np.argmax(b["logits"][0, 0]))
    return {
        "samples": len(samples),
        "max_abs_diff": {n: worst[n] for n in names},
        "top1_agreement": agree / max(1, len(samples)),
        "bit_exact": all(v == 0.0 for v in worst.values()),
    }


class SlmDecodeGraph(Pass):
    """``slm_integer`` + ``keep_set`` + ``qdq_slm`` -> ``qdq_slm_decode``: the 1-row decode graph, exported, QDQ'd
    with the tree graph's encodings and given its top-1 tail (module docstring).

    Reads ``[window]`` (ring lengths, as the tree graph) and ``[slm_calibration]`` (``activation_bits``: A16
    only). Raises QdqError when an encoding of the decode graph differs from the tree graph's, ExportError from
    the export, SlmGraphError from the graph."""

    name = "slm_decode_graph"
    version = 2  # v2: Softmax outputs encoded [0, 1] even where copied (`hycoc.passes.qdq.encodings.softmax_overrides`)
    section = "window"
    also_reads = ("slm_calibration",)
    consumes = {"slm_integer": SlmIntegerArtifact, "keep_set": KeepSetArtifact, "qdq_slm": OnnxArtifact}
    produces = {DECODE_KIND: OnnxArtifact}

    def __init__(self, seed: int = 0):
        self.seed = seed

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        return {"seed": self.seed, "rows": 1, "top_k": DECODE_TOP_K}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, OnnxArtifact], PassReport]:
        import onnx
        import onnx_ir as ir
        from hycoc.passes.qdq.encodings import QdqError
        from hycoc.passes.qdq.quantize import quantize_graph, slm_calibration_samples
        from hycoc.passes.slm.graph import FULL, SLIDING, SlmTreeGraph, example_inputs, export_slm_graph
        from hycoc.passes.topk_outputs import append_topk

        if recipe.slm_calibration.activation_bits != 16:
            raise QdqError(
                f"slm_calibration.activation_bits = {recipe.slm_calibration.activation_bits}: only "
                "16-bit (A16) activations are implemented"
            )
        slm = inputs["slm_integer"].payload
        ring = {FULL: recipe.window.slm_window, SLIDING: recipe.window.slm_sliding_window}
        graph = SlmTreeGraph(slm, inputs["keep_set"].payload, rows=1, ring=ring)
        with tempfile.TemporaryDirectory(prefix="hycoc-slm-decode-") as tmp_dir:
            tmp = Path(tmp_dir)
            tree_path = tmp / "tree" / "slm.onnx"
            tree_path.parent.mkdir()
            ir.save(inputs["qdq_slm"].payload, tree_path, external_data="slm.onnx.data")
            encodings = activation_encodings(onnx.load(str(tree_path)))
            (tmp / "float").mkdir()
            _, export = export_slm_graph(graph, example_inputs(graph, slm), tmp / "float" / "slm_decode.onnx")
            samples = slm_calibration_samples(graph, slm, CALIBRATION_SAMPLES, self.seed)
            result = quantize_graph(
                tmp / "float" / "slm_decode.onnx",
                samples,
                tmp / "qdq",
                percentile=recipe.slm_calibration.percentile,
                range_scale=recipe.slm_calibration.range_scale,
                encodings=encodings,
            )
            qmodel = onnx.load(str(result.path))
            got = activation_encodings(qmodel)
            differ = sorted(
                k for k in got if k not in encodings or (got[k][0], got[k][1]) != (encodings[k][0], encodings[k][1])
            )
            if differ:
                raise QdqError(
                    f"the decode graph's encodings of {len(differ)} tensors differ from the tree graph's "
                    f"(first: {differ[:3]}); both graphs must come from the same SlmTreeGraph export"
                )
            compare = compare_with_tree(
                result.path, tree_path, slm_calibration_samples(graph, slm, COMPARISON_SAMPLES, self.seed + 1)
            )
            qmodel = append_topk(qmodel, DECODE_TOP_K, with_logq=False)
            model = ir.serde.deserialize_model(qmodel)  # weights read into memory
        numbers = result.numbers() | {
            "rows": 1,
            "ring": ring,
            "top_k_outputs": DECODE_TOP_K,
            "encodings_from_tree": len(got),
            "export": export.numbers(),
            "row0_vs_tree": compare,
        }
        logits_diff = compare["max_abs_diff"]["logits"]
        summary = (
            f"1 row, {len(got)} activation encodings from the tree graph, {len(result.weights)} weights "
            f"bit-exact, top-{DECODE_TOP_K}; vs the tree graph's row 0 on {compare['samples']} greedy steps: "
            f"{'bit-exact' if compare['bit_exact'] else f'max logit diff {logits_diff:.2e}'}, top-1 "
            f"{compare['top1_agreement']:.0%}; SQNR logits {result.sqnr['outputs']['logits']:.1f} dB"
        )
        return {DECODE_KIND: OnnxArtifact(DECODE_KIND, model)}, PassReport(summary, numbers)


__all__ = [
    "CALIBRATION_SAMPLES",
    "COMPARISON_SAMPLES",
    "DECODE_GRAPH",
    "DECODE_KIND",
    "DECODE_TOP_K",
    "SlmDecodeGraph",
    "activation_encodings",
    "compare_with_tree",
    "tree_feeds",
]
