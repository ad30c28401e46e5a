"""QDQ insertion for the HTP: A16 activations, bit-exact per-channel integer weights, fixed encodings, SQNR report
(docs/design.md "Numerics by construction"; paper App. A Table 3).

`quantize_graph` turns an exported static float graph into a QDQ graph with onnxruntime's QNN helpers
(``qnn_preprocess_model``, ``get_qnn_qdq_config``, ``quantize``), in this order:

1. integer weights: the SLM graph writes every weight as ``Cast(int8 initializer) -> Mul(scale (out, 1))``
   (``IntegerLinear``), usually followed by ``Transpose`` into the MatMul. `fold_integer_weights` (the rewrite
   rule `hycoc.passes.rewrite.integer_weights`) replaces each pattern by one float initializer (q * scale in
   float32, exactly what the graph computed, transposed when the Transpose is folded too) and records the integers
   and scales (`IntegerWeightSpec`). The head's QAT output gives them as arrays instead (`weights_from_arrays`,
   which checks that the graph's float weight is q * scale bit for bit). Each becomes a per-channel
   ``init_overrides`` entry with the source's own scale per channel, zero point 0, int8 (8-bit source) or int4 (2-
   and 4-bit sources: HTP has no int2; the integers are unchanged), and the channel axis --
   ``get_qnn_qdq_config(per_channel=True)`` only touches Conv, so MatMul weights need the axis.
2. activations: uint16 (A16) with ranges from `hycoc.passes.calibration.activation_ranges` (SLM: 99.9th
   percentile x 1.2 of |x|), given as ``rmin``/``rmax`` overrides.
3. fixed encodings, whatever the calibration saw:
   - masks ``mask_*``: [-1e4, 0] (scale 1e4/65535, zero point 65535: both ends exact); a sample holding -inf or a
     min-float stand-in is refused (`CalibrationError`);
   - the (scores + mask) sums: a fixed floor ``-SCORE_FLOOR`` (masked scores clip there; exp(-100) is 0 in the
     softmax), so the huge mask does not set the scores' scale (targets/htp.py's measured lesson);
   - rotary ``cos_*``/``sin_*``: [-1, 1];
   - the logit soft-cap's Tanh output: QNN's fixed 16-bit encoding (scale 1/32768, zero point 32768), which
     ``get_qnn_qdq_config`` sets; `check_fixed_encodings` verifies it;
   - every Softmax output (and its data-movement copies): [0, 1], scale 1/65535, zero point 0 (`softmax_overrides`),
     also where the encodings are copied from another graph. A calibrated range clips the rows that exceed it (a
     row whose mass sits on one column reaches 1), and a Softmax encoding other than [0, 1] is what
     onnxruntime-qnn's own quantizer stopped emitting for the HTP (microsoft/onnxruntime-qnn PR #558);
   - the ring: ``k_ring_i``, ``k_new_i`` and their Concat get one range, the union of both calibrated ranges,
     so input and output KV share scale and zero point and the runtime copies KV bytes without requantizing.
4. HTP rewrite: ``Reciprocal(x)`` -> ``Div(1, x)`` (`reciprocal_to_div`, the rule
   `hycoc.passes.rewrite.reciprocal_to_div`: the v81 simulator's uint16 Reciprocal was wrong on one RMSNorm's range).
5. checks on the saved QDQ graph: every weight's DequantizeLinear holds the source integers, scales, zero point 0
   and axis exactly (`verify_weights`, raises `QdqError`), and the fixed encodings hold (`check_fixed_encodings`).

KV encoding the graph expects (``qdq_io_encodings``): each ``k_ring_i``/``v_ring_i`` input and ``k_new_i``/
``v_new_i`` output is uint16 with one (scale, zero point): real = scale * (code - zero_point). The runtime keeps
the ring as these codes, and writes a committed row by copying the output's codes into column p mod W_T. With
``slm_calibration.kv_bits = 8`` the runtime may keep the ring 8-bit on the wire and in memory, as uint8 codes of
the same range (`kv_wire_encoding`: scale * 65535/255, zero point rescaled); it then requantizes on the way in and out
(the graph itself stays 16-bit; onnxruntime-qnn's ``offload_graph_io_quantization`` quantizes float graph IO on
the CPU).

`sqnr_report` runs the float and the QDQ graph on the CPU EP with every decoder layer's output added as a graph
output (on copies) and reports the SQNR (dB) per graph output and per layer, and the top-1 agreement of logits.

This module runs the step (`quantize_graph`) and the pipeline pass (`QdqQuantize`); the work is split by job:
`hycoc.passes.qdq.weights` (step 1 and the weights' check), `hycoc.passes.qdq.encodings` (steps 2-3, the encodings'
checks and `QdqError`) and `hycoc.passes.qdq.sqnr` (the SQNR report). Steps 1 and 4 change the float graph as an
onnx-ir model, with onnxscript rewrite rules (passes/rewrite/); onnxruntime's tools read and write the files in
between.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.passes.calibration import (
    CalibrationError,
    activation_ranges,
    check_samples,
    list_reader,
)
from hycoc.passes.pipeline import Pass, PassReport
from hycoc.passes.qdq.encodings import (
    check_fixed_encodings,
    fixed_overrides,
    qdq_io_encodings,
    require_a16,
    softmax_outputs,
    softmax_overrides,
)
from hycoc.passes.qdq.sqnr import layer_outputs, sqnr_report
from hycoc.passes.qdq.weights import (
    IntegerWeightSpec,
    fold_integer_weights,
    verify_weights,
    weight_overrides,
    weights_from_arrays,
)
from hycoc.passes.rewrite.reciprocal_to_div import reciprocal_to_div

from hycoc.recipe import Recipe

# ---- the whole step ------------------------------------------------------------------------------------------


@dataclass
class QdqResult:
    """What `quantize_graph` made: the QDQ graph at ``path`` (external data beside it), the float graph it
    quantized (weights folded, preprocessed) at ``float_path``, and the numbers."""

    path: Path
    float_path: Path
    weights: list[IntegerWeightSpec]
    encodings: dict[str, dict[str, Any]]
    fixed: dict[str, Any]
    ops: dict[str, int]
    seconds: float
    reciprocals_rewritten: int = 0
    sqnr: dict[str, Any] = field(default_factory=dict)
    #: Softmax outputs whose calibrated range was not [0, 1] before the fixed encoding replaced it: name -> [lo, hi]
    softmax_calibrated: dict[str, list[float]] = field(default_factory=dict)

    def numbers(self) -> dict[str, Any]:
        bits = Counter(s.qdq_bits for s in self.weights)
        return {
            "seconds": round(self.seconds, 3),
            "ops": self.ops,
            "quantize_linear": self.ops.get("QuantizeLinear", 0),
            "dequantize_linear": self.ops.get("DequantizeLinear", 0),
            "weights_bit_exact": len(self.weights),
            "weight_bits": {str(k): v for k, v in sorted(bits.items())},
            "reciprocals_rewritten": self.reciprocals_rewritten,
            "io_encodings": self.encodings,
            "softmax_fixed_0_1": len(self.fixed.get("softmax", {})),
            "softmax_calibrated_not_0_1": self.softmax_calibrated,
            "sqnr": self.sqnr,
        }


def quantize_graph(
    model_path: str | Path,
    samples: Sequence[Mapping[str, np.ndarray]],
    out_dir: str | Path,
    *,
    percentile: float,
    range_scale: float = 1.0,
    weight_arrays: Mapping[str, tuple[np.ndarray, np.ndarray, int]] | None = None,
    report_sqnr: bool = True,
    htp_rewrites: bool = True,
    encodings: Mapping[str, tuple[np.ndarray, np.ndarray]] | None = None,
) -> QdqResult:
    """Quantize the float graph at ``model_path`` (module docstring) into ``out_dir/model_qdq.onnx``.

    samples: calibration input dicts (numpy, by graph input name). weight_arrays: integer weights given as arrays
    (head QAT output), by float initializer name; without them the Cast(int8) -> Mul(scale) patterns are folded.
    htp_rewrites: rewrite Reciprocal as Div first (`reciprocal_to_div`). encodings: activation tensor name ->
    (scale float32, zero point uint16) scalars to give those tensors instead of calibrated ranges (steps 2-3
    skipped; another graph's, `hycoc.passes.slm.decode.activation_encodings`); ``samples`` then only feed
    onnxruntime's calibration run. Raises CalibrationError (bad samples, e.g. a mask holding -inf) or QdqError
    (a check failed).
    """
    import onnx
    import onnx_ir as ir
    from onnxruntime.quantization import QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    start = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model = ir.from_proto(onnx.load(str(model_path)))
    specs = weights_from_arrays(model, weight_arrays) if weight_arrays else fold_integer_weights(model)
    reciprocals = reciprocal_to_div(model) if htp_rewrites else 0
    folded, float_path = out_dir / "model_folded.onnx", out_dir / "model_float.onnx"
    proto = ir.to_proto(model)
    del model  # the folded weights: one copy in memory, the proto's
    onnx.save(proto, str(folded), save_as_external_data=True, location=folded.name + ".data")
    del proto
    if not qnn_preprocess_model(
        str(folded), str(float_path), save_as_external_data=True, external_data_location=float_path.name + ".data"
    ):
        shutil.copy(folded, float_path)  # its external data stays in folded's data file, beside it
    feeds = check_samples(float_path, samples)
    fmodel = onnx.load(str(float_path), load_external_data=False)
    softmax_calibrated: dict[str, list[float]] = {}
    if encodings is None:
        ranges = activation_ranges(float_path, feeds, percentile=percentile, range_scale=range_scale)
        overrides = fixed_overrides(fmodel, ranges)
        # what calibration alone would have given the Softmax outputs that are not [0, 1] (reported, then fixed)
        softmax_calibrated = {
            t: [float(ranges[t][0]), float(ranges[t][1])]
            for t in softmax_outputs(fmodel)
            if t in ranges and (float(ranges[t][0]), float(ranges[t][1])) != (0.0, 1.0)
        }
    else:
        overrides = {
            name: [{"scale": np.array(s, np.float32), "zero_point": np.array(zp)}]
            for name, (s, zp) in encodings.items()
        }
    overrides.update(softmax_overrides(fmodel))  # fixed whatever was calibrated or copied
    overrides.update(weight_overrides(specs))
    config = get_qnn_qdq_config(
        str(float_path),
        list_reader(feeds),
        activation_type=QuantType.QUInt16,
        weight_type=QuantType.QInt8,
        init_overrides=overrides,
    )
    config.use_external_data_format = True
    # quantize data-movement ops (Unsqueeze, Reshape, ...) on graph inputs too: left in float they would not run
    # on the HTP, and the rotary inputs' fixed encoding would sit after them instead of on the input
    config.extra_options["ForceQuantizeNoInputCheck"] = True
    path = out_dir / "model_qdq.onnx"
    quantize(str(float_path), str(path), config)
    qmodel = onnx.load(str(path))
    verify_weights(qmodel, specs)
    fixed = check_fixed_encodings(qmodel)
    ops = dict(sorted(Counter(n.op_type for n in qmodel.graph.node).items()))
    result = QdqResult(
        path,
        float_path,
        specs,
        qdq_io_encodings(qmodel),
        fixed,
        ops,
        time.perf_counter() - start,
        reciprocals_rewritten=reciprocals,
        softmax_calibrated=softmax_calibrated,
    )
    if report_sqnr:
        result.sqnr = sqnr_report(float_path, path, feeds, layers=layer_outputs(fmodel))
    return result


__all__ = [
    "QdqResult",
    "quantize_graph",
    "QdqQuantize",
    "slm_calibration_samples",
]


# ---- the pipeline pass ---------------------------------------------------------------------------------------


def slm_calibration_samples(graph, slm, count: int, seed: int = 0) -> list[dict[str, np.ndarray]]:
    """``count`` input dicts for the SLM tree graph: random trees and tokens through the host LUTs and rotary
    tables, ring fills from a single live column to a full wrapped ring (targets/htp.py's lesson: calibrate small
    fills too), ring K/V drawn like normed keys/values (RMS 1). Stand-in for the verifier's greedy answers to
    ``slm_calibration.prompts`` prompts, which are not wired in yet."""
    from hycoc.passes.slm.graph import host_inputs

    rng = np.random.default_rng(seed)
    r, ring = graph.rows, max(graph.ring.values())
    out = []
    for i in range(count):
        parents = [-1] + [int(rng.integers(max(0, j - 3), j)) for j in range(1, r)]
        first = ring + 3 + int(rng.integers(0, ring))
        fill = 1 + (i * ring) // max(1, count - 1) if count > 1 else ring  # live columns, 1 .. ring
        live_start = max(0, first - min(fill, ring))
        rings = {}
        for layer in graph.all_kv_layers:  # the whole chain's rings (any shard: host feeds)
            shape = graph.host_shapes[f"k_ring_{layer}"]
            rings[layer] = (
                rng.standard_normal(shape).astype(np.float32),
                rng.standard_normal(shape).astype(np.float32),
            )
        tokens = rng.integers(0, graph.config.vocab_size, r)
        out.append(host_inputs(graph, slm, tokens, parents, first, live_start, rings))
    return out


class QdqQuantize(Pass):
    """The QDQ pass of one graph kind: ``QdqQuantize("onnx_slm", "qdq_slm")`` (module docstring).

    Only the SLM is wired: it consumes ``onnx_slm`` + ``slm_integer`` + ``keep_set`` + ``torch_verifier`` +
    ``tokenizer`` + ``calibration_answers`` and reads ``[slm_calibration]`` (percentile x range_scale; ``prompts``
    calibration prompts, `hycoc.passes.slm.calibration.SAMPLES_PER_PROMPT` graph calls kept from each),
    ``[window]``, ``[tree]`` and, for the answer cap, ``[head_qat]``. The QDQ graph then gets the
    outputs ``top_index`` / ``top_logq`` of its ``tree.slm_candidates`` best tokens per row
    (`hycoc.passes.topk_outputs.append_topk`), which the device runtime reads instead of the logits. Calibration inputs
    (``calibration="real"``, the build's): the verifier's greedy answers to the calibration prompts driven
    through the device runtime's SLM drafter and tree builder on the float torch graph
    (`hycoc.passes.slm.calibration`); the held-out SQNR report uses ``max(2, prompts // 4)`` other prompts.
    ``calibration="synthetic"``: `slm_calibration_samples` (``prompts`` random samples, held-out ``prompts // 4``),
    for unit tests without a verifier; it consumes neither the verifier nor the tokenizer. The head
    (``onnx_head`` + ``quantized_head``, ranges at ``head_qat.input_range_percentile``, integers via
    `weights_from_arrays`) is refused until its graph and calibration captures land. ``seed``: the prompt order
    (toy corpus), runner-up tokens and accepted-length offsets, or the synthetic samples' RNG.
    """

    version = 5  # v3: the graph also emits its top-k candidates (passes/topk_outputs.py); v4: calibration_answers;
    # v5: every Softmax output encoded [0, 1]
    section = "slm_calibration"

    def __init__(
        self, kind_in: str = "onnx_slm", kind_out: str = "qdq_slm", *, seed: int = 0, calibration: str = "real"
    ):
        from hycoc.passes.artifacts import (
            KeepSetArtifact,
            OnnxArtifact,
            SlmIntegerArtifact,
            TokenizerArtifact,
            TorchModelArtifact,
        )

        if kind_in != "onnx_slm":
            raise ValueError(
                f"QdqQuantize({kind_in!r}): only 'onnx_slm' is wired; the head's QDQ pass needs its "
                f"calibration captures (passes/head/qat.py) and is not done yet"
            )
        if calibration not in ("real", "synthetic"):
            raise ValueError(f"QdqQuantize(calibration={calibration!r}): choose 'real' or 'synthetic'")
        self.name = f"qdq_{kind_in.removeprefix('onnx_')}"
        self.kind_out, self.seed, self.calibration = kind_out, seed, calibration
        self.consumes = {kind_in: OnnxArtifact, "slm_integer": SlmIntegerArtifact, "keep_set": KeepSetArtifact}
        self.also_reads = ("window", "tree")
        if calibration == "real":
            from hycoc.passes.calibration_answers import CalibrationAnswersArtifact

            self.consumes |= {
                "torch_verifier": TorchModelArtifact,
                "tokenizer": TokenizerArtifact,
                "calibration_answers": CalibrationAnswersArtifact,
            }
            self.also_reads = ("window", "tree", "head_qat")
        self.produces = {kind_out: OnnxArtifact}

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        # real calibration: the prompts and answers arrive as the calibration_answers artifact (hash in the key)
        return {"seed": self.seed, "kind_out": self.kind_out, "calibration": self.calibration}

    def files_read(self, recipe: Recipe) -> dict[str, Path]:
        # real calibration: the verifier engine stops on the chat format's stop ids (slm_calibration)
        if self.calibration != "real":
            return {}
        from hycoc.chat_template import recipe_chat_files

        return recipe_chat_files(recipe)

    def _samples(self, graph, slm, keep, inputs, recipe):
        cal = recipe.slm_calibration
        if self.calibration == "synthetic":
            return (
                slm_calibration_samples(graph, slm, cal.prompts, self.seed),
                slm_calibration_samples(graph, slm, max(2, cal.prompts // 4), self.seed + 1),
                {"source": "synthetic (random trees, tokens and rings)"},
            )
        from hycoc.passes.slm.calibration import real_calibration

        real, held, numbers = real_calibration(
            graph,
            slm,
            keep,
            inputs["torch_verifier"].payload,
            inputs["tokenizer"].payload,
            recipe,
            self.seed,
            answers=inputs["calibration_answers"].payload,
        )
        if not real.samples or not held.samples:
            raise CalibrationError("the calibration prompts gave no SLM graph calls to calibrate on")
        return real.samples, held.samples, numbers

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Any], PassReport]:
        import onnx
        import onnx_ir as ir
        from hycoc.passes.artifacts import OnnxArtifact
        from hycoc.passes.slm.graph import FULL, SLIDING, SlmTreeGraph
        from hycoc.passes.topk_outputs import append_topk

        cal = recipe.slm_calibration
        require_a16(cal.activation_bits)
        slm = inputs["slm_integer"].payload
        keep = inputs["keep_set"].payload
        ring = {FULL: recipe.window.slm_window, SLIDING: recipe.window.slm_sliding_window}
        graph = SlmTreeGraph(slm, keep, rows=recipe.tree.node_budget, ring=ring)
        samples, held_out, source = self._samples(graph, slm, keep, inputs, recipe)
        with tempfile.TemporaryDirectory(prefix="hycoc-qdq-") as tmp:
            src = Path(tmp) / "float" / "model.onnx"
            src.parent.mkdir()
            ir.save(inputs["onnx_slm"].payload, src, external_data="model.onnx.data")
            result = quantize_graph(
                src, samples, Path(tmp) / "qdq", percentile=cal.percentile, range_scale=cal.range_scale
            )
            # held-out inputs (other prompts): the calibration inputs flatter the ranges
            fmodel = onnx.load(str(result.float_path), load_external_data=False)
            held = sqnr_report(result.float_path, result.path, held_out, layers=layer_outputs(fmodel))
            qmodel = append_topk(onnx.load(str(result.path)), recipe.tree.slm_candidates, with_logq=True)
            model = ir.serde.deserialize_model(qmodel)  # weights read into memory
        numbers = result.numbers() | {
            "top_k_outputs": recipe.tree.slm_candidates,
            "samples": len(samples),
            "percentile": cal.percentile,
            "range_scale": cal.range_scale,
            "kv_bits_on_wire": cal.kv_bits,
            "calibration_inputs": source,
            "sqnr_held_out": held,
        }
        s = result.sqnr
        worst = min(s["layers"].values()) if s["layers"] else float("nan")
        fills = source.get("calibration", {}).get("coverage", {})
        fill = f"; ring fills {fills['min']}-{fills['max']} of {fills['ring']} columns" if "min" in fills else ""
        summary = (
            f"A16 W{'/'.join(numbers['weight_bits'])} QDQ: {numbers['quantize_linear']} Q / "
            f"{numbers['dequantize_linear']} DQ, {len(result.weights)} weights bit-exact; SQNR logits "
            f"{s['outputs']['logits']:.1f} dB, worst layer {worst:.1f} dB, top-1 {s['top1_agreement']:.1%} "
            f"on {len(samples)} {self.calibration} calibration samples{fill} (held-out: logits "
            f"{held['outputs']['logits']:.1f} dB, top-1 {held['top1_agreement']:.1%})"
        )
        return {self.kind_out: OnnxArtifact(self.kind_out, model)}, PassReport(summary, numbers)
