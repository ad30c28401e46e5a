"""Head export pass: the QAT head as a static ONNX graph plus the host tables the device needs (paper Alg. 2,
App. A Table 3; docs/design.md "Numerics by construction").

``quantized_head`` + ``torch_verifier`` -> ``onnx_head`` + ``head_host``:

* ``onnx_head``: `HeadGraph.from_quantized` (one query over a W-column ring, W = ``window.head_window``) exported
  at static shapes with `export_static` (dynamo exporter, RMSNorms decomposed, weights as external data, ONNX
  checker), then run on onnxruntime's CPU EP against the torch graph on verifier captures (`compare_with_torch`):
  the report gives the max absolute error per output and the top-1 agreement of the keep-set logits.
* ``head_host``: what the runtime computes on the host (no torch there): ``embedding_q.npy`` int8 [|V|, H] and
  ``embedding_scale.npy`` float32 [|V|, 1] (E, Alg. 2 line 12: the verifier's scaled input embeddings over the
  keep set, per-row int8), ``rotary_<type>_inv_freq.npy`` float32 [d/2] and ``rotary_<type>_scaling.npy`` float32
  [] per layer type (Alg. 2 line 6, `RotaryTable.rows`), ``keep_set.npy`` int64 [|V|] (row i of the logits
  scores token keep_set[i], line 11).

The comparison inputs are real: the verifier's states over a sequence of keep-set tokens, one query per sample
at roots t spread over the sequence, the ring partly filled (t < W) and, when the sequence is long enough, full.
"""

from __future__ import annotations

import hashlib
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch
from hycoc.passes.artifacts import Artifact, OnnxArtifact, QuantizedHeadArtifact, TokenizerArtifact, TorchModelArtifact
from hycoc.passes.calibration_answers import CalibrationAnswersArtifact
from hycoc.passes.head.graph import INPUT_NAMES, OUTPUT_NAMES, HeadGraph, embedding_table, ring_masks, rotary_rows
from hycoc.passes.head.graph import rotary_tables as head_rotary_tables
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.host import head_sliding_positions
from hycoc.mtp import FULL, SLIDING
from hycoc.recipe import Recipe

#: Queries the ONNX graph is compared on (each one graph call).
COMPARE_SAMPLES = 4


@dataclass
class HostTablesArtifact(Artifact):
    """Host-side arrays of a drafter (payload: file stem -> numpy array), e.g. kind ``"head_host"``. Saved as one
    ``<stem>.npy`` each; hashed over the sorted stems with each array's dtype, shape and bytes."""

    type_name: ClassVar[str] = "host_tables"

    def save(self, folder: Path) -> None:
        for stem, array in self.payload.items():
            np.save(folder / f"{stem}.npy", np.ascontiguousarray(array), allow_pickle=False)

    @classmethod
    def load(cls, kind: str, folder: Path) -> HostTablesArtifact:
        return cls(kind, {p.stem: np.load(p, allow_pickle=False) for p in sorted(folder.glob("*.npy"))})

    def _compute_hash(self) -> str:
        h = hashlib.sha256()
        for stem in sorted(self.payload):
            a = np.ascontiguousarray(self.payload[stem])
            h.update(f"{stem}\0{a.dtype.str}\0{list(a.shape)}\0".encode())
            h.update(a.tobytes())
        return h.hexdigest()


def host_tables(verifier, head_config, keep_set) -> dict[str, np.ndarray]:
    """The ``head_host`` arrays (module docstring)."""
    q, scale = embedding_table(verifier, keep_set)
    out = {
        "embedding_q": q.numpy(),
        "embedding_scale": scale.numpy().astype(np.float32),
        "keep_set": np.asarray(keep_set, dtype=np.int64),
    }
    for kind, table in head_rotary_tables(head_config).items():
        name = "sliding" if kind == SLIDING else "full"
        out[f"rotary_{name}_inv_freq"] = table.inv_freq.astype(np.float32)
        out[f"rotary_{name}_scaling"] = np.asarray(table.attention_scaling, dtype=np.float32)
    return out


def ring_from_sequence(k: torch.Tensor, v: torch.Tensor, t: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The W-column ring at root t from full-sequence K/V [1, kv, L, d] (Alg. 2 line 4: position p goes to
    column p mod W; positions [max(0, t - W), t) are written, other columns stay zero and are masked)."""
    ring_k = torch.zeros(*k.shape[:2], window, k.shape[-1], dtype=torch.float32)
    ring_v = torch.zeros_like(ring_k)
    for p in range(max(0, t - window), t):
        ring_k[:, :, p % window] = k[:, :, p].float()
        ring_v[:, :, p % window] = v[:, :, p].float()
    return ring_k, ring_v


def graph_inputs(
    cap: tuple[torch.Tensor, torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]],
    t: int,
    window: int,
    sliding_window: int,
    config,
) -> list[torch.Tensor]:
    """The graph's inputs (`INPUT_NAMES` order) for one query at root t of a verifier capture (e, h, kv):
    x_hat = [e(x_t); h_{t-1}] (Alg. 2 line 7), rings and masks of [0, t), rotary rows at t - 1."""
    e, h, kv = cap
    x_hat = torch.cat([e[:, t : t + 1], h[:, t - 1 : t]], dim=-1).float()
    masks = {k: torch.from_numpy(m) for k, m in ring_masks(t, 0, window, sliding_window).items()}
    rot = rotary_rows(config, t - 1)
    rings = {kind: ring_from_sequence(*kv[kind], t, window) for kind in (SLIDING, FULL)}
    return [x_hat, *rings[SLIDING], *rings[FULL], masks[SLIDING], masks[FULL], *rot[SLIDING], *rot[FULL]]


def comparison_inputs(
    verifier, graph_config, keep_set, window: int, sliding_window: int, samples: int = COMPARE_SAMPLES, seed: int = 0
) -> list[list[torch.Tensor]]:
    """``samples`` query inputs from one verifier pass over random keep-set tokens (length W + 2: the last roots
    see a full ring, the first a partly filled one)."""
    from hycoc.passes.head.captures import verifier_capture

    rng = np.random.default_rng(seed)
    length = window + 2
    ids = torch.as_tensor(rng.choice(np.asarray(keep_set), length), dtype=torch.long)
    e, h, kv = verifier_capture(verifier, ids)
    # the graph runs on the CPU: bring the capture there (a GPU build's verifier is on its device, in bf16)
    cap = (e.cpu(), h.cpu(), {kind: (k.cpu(), v.cpu()) for kind, (k, v) in kv.items()})
    roots = np.unique(np.linspace(1, length - 1, samples).round().astype(int))
    return [graph_inputs(cap, int(t), window, sliding_window, graph_config) for t in roots]


class HeadExport(Pass):
    """quantized_head + torch_verifier -> onnx_head + head_host, reading ``[window]`` (W). Module docstring."""

    name = "head_export"
    section = "window"
    consumes = {"quantized_head": QuantizedHeadArtifact, "torch_verifier": TorchModelArtifact}
    produces = {"onnx_head": OnnxArtifact, "head_host": HostTablesArtifact}

    def __init__(self, *, seed: int = 0, samples: int = COMPARE_SAMPLES):
        self.seed, self.samples = seed, samples

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        return {"seed": self.seed, "samples": self.samples}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Artifact], PassReport]:
        from hycoc.passes.export import ExportError, compare_with_torch, export_static
        from hycoc.passes.head.quantize import dequantized_head

        quantized = inputs["quantized_head"].payload
        verifier = inputs["torch_verifier"].payload
        rebuilt = dequantized_head(quantized)
        graph = HeadGraph(rebuilt).eval()  # == HeadGraph.from_quantized(quantized), without rebuilding twice
        window = recipe.window.head_window
        sliding_window = head_sliding_positions(
            int(rebuilt.config.get_text_config().sliding_window), recipe.window.head_sliding_window_inclusive
        )
        samples = comparison_inputs(
            verifier, rebuilt.config, quantized.keep_set, window, sliding_window, self.samples, self.seed
        )
        with tempfile.TemporaryDirectory(prefix="hycoc-head-export-") as tmp:
            path = Path(tmp) / "head.onnx"
            model, report = export_static(graph, samples[0], path, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES)
            errors: dict[str, float] = {}
            agree = []
            for sample in samples:
                err, top1 = compare_with_torch(path, graph, sample, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES)
                errors = {k: max(errors.get(k, 0.0), v) for k, v in err.items()}
                if top1 is None:  # None only for a graph without a logits output
                    raise ExportError(f"the head graph's outputs {OUTPUT_NAMES} have no logits to compare")
                agree.append(top1)
        report.max_abs_error, report.top1_agreement = errors, float(np.mean(agree))
        host = host_tables(verifier, rebuilt.config, quantized.keep_set)
        numbers = report.numbers() | {
            "samples": len(samples),
            "window": window,
            "keep_set_size": int(len(quantized.keep_set)),
            "embedding_bytes": int(host["embedding_q"].nbytes + host["embedding_scale"].nbytes),
            "input_shapes": {n: list(x.shape) for n, x in zip(INPUT_NAMES, samples[0])},
        }
        numbers.pop("seconds")
        summary = (
            f"static head graph W={window}, {sum(report.ops.values())} nodes, {report.rms_norms} RMSNorms "
            f"decomposed; ORT CPU vs torch on {len(samples)} queries: max |err| logits "
            f"{errors['logits']:.2e}, top-1 {report.top1_agreement:.0%}; E {host['embedding_q'].shape} int8"
        )
        return (
            {"onnx_head": OnnxArtifact("onnx_head", model), "head_host": HostTablesArtifact("head_host", host)},
            PassReport(summary, numbers),
        )


# ---- the head's QDQ graph ------------------------------------------------------------------------------------


#: Calibration queries of the head's QDQ step (roots over one verifier pass of W + 2 keep-set tokens).
CALIBRATION_SAMPLES = 16


def head_weight_arrays(model, quantized) -> dict[str, tuple[np.ndarray, np.ndarray, int]]:
    """Float weight initializer name -> (q, scale, bits) for every QAT linear of ``quantized`` (an onnx
    ModelProto of its exported graph). The exporter renames and may transpose weights, so each is found by value:
    the one initializer equal to q * scale or its transpose, bit for bit. Raises ValueError when a weight has no
    such initializer or more than one."""
    from onnx import numpy_helper

    inits = {
        t.name: numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == 1 and len(t.dims) == 2
    }  # float32 matrices
    out = {}
    for name, q in quantized.qweight.items():
        w = (q.float() * quantized.scale[name]).numpy()
        hits = [
            n
            for n, a in inits.items()
            if (a.shape == w.shape and np.array_equal(a, w)) or (a.shape == w.T.shape and np.array_equal(a, w.T))
        ]
        if len(hits) != 1:
            raise ValueError(
                f"head weight '{name}': {len(hits)} initializers of the exported graph equal its "
                f"q * scale (expected exactly one)"
            )
        out[hits[0]] = (q.numpy(), quantized.scale[name].numpy(), quantized.bits)
    return out


class HeadQdq(Pass):
    """onnx_head + quantized_head + torch_verifier -> qdq_head: the head's graph with A16 activations and its QAT
    integers as bit-exact per-channel int4 weights (`hycoc.passes.qdq.quantize.quantize_graph`, weights via
    `head_weight_arrays`), reading ``[head_qat]`` (``input_range_percentile``) and ``[window]``.

    Calibration (v2): the head graph's feeds as the device runtime makes them from real hand-offs
    (`hycoc.passes.head.calibration.real_head_calibration`: the verifier engine follows the build's greedy
    calibration answers (`hycoc.passes.calibration_answers`), the runtime's `MtpDrafter` ingests every hand-off
    and drafts K steps over the float head graph); ranges at the ``input_range_percentile`` percentile, x 1. SQNR
    and top-1 against the float graph are reported on those and on held-out prompts' feeds. Fallback, only when no
    tokenizer is given (unit tests of the pass alone): `CALIBRATION_SAMPLES` first-step queries from one verifier pass
    over keep-set tokens (`comparison_inputs`), held-out with another seed. The QDQ graph then gets the output
    ``top_index`` (its two best keep-set indices, `hycoc.passes.topk_outputs.append_topk`), which the device runtime
    reads.
    """

    name = "qdq_head"
    version = 6  # v2: calibrated on the runtime's feeds from real hand-offs (head_calibration); v3: top_index output;
    # v4: prompts and answers from the calibration_answers pass; v5: skip-ahead rounds between drafts; v6: Softmax
    # outputs encoded [0, 1] (`hycoc.passes.qdq.encodings.softmax_overrides`)
    section = "head_qat"
    also_reads = ("window", "tree", "handoff")
    consumes = {
        "onnx_head": OnnxArtifact,
        "quantized_head": QuantizedHeadArtifact,
        "torch_verifier": TorchModelArtifact,
        "tokenizer": TokenizerArtifact,
        "calibration_answers": CalibrationAnswersArtifact,
    }
    produces = {"qdq_head": OnnxArtifact}

    def __init__(self, *, seed: int = 0, samples: int = CALIBRATION_SAMPLES):
        self.seed, self.samples = seed, samples

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        from hycoc.passes.head import calibration as hc

        # the prompts and answers arrive as the calibration_answers artifact (its hash is in the key)
        return {
            "seed": self.seed,
            "samples": self.samples,
            "calibration": [hc.CALIBRATION_PROMPTS, hc.HELD_OUT_PROMPTS, hc.DRAFTS_PER_PROMPT],
        }

    def files_read(self, recipe: Recipe) -> dict[str, Path]:
        # the verifier engine of the calibration stops on the chat format's stop ids
        from hycoc.chat_template import recipe_chat_files

        return recipe_chat_files(recipe)

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, Artifact], PassReport]:
        import onnx
        import onnx_ir as ir
        from hycoc.passes.head.quantize import dequantized_head
        from hycoc.passes.qdq.quantize import quantize_graph
        from hycoc.passes.qdq.sqnr import layer_outputs, sqnr_report
        from hycoc.passes.topk_outputs import append_topk

        quantized = inputs["quantized_head"].payload
        verifier = inputs["torch_verifier"].payload
        config = dequantized_head(quantized).config
        window = recipe.window.head_window
        sliding_window = head_sliding_positions(
            int(config.get_text_config().sliding_window), recipe.window.head_sliding_window_inclusive
        )

        def feeds(seed):
            return [
                {n: x.numpy() for n, x in zip(INPUT_NAMES, s)}
                for s in comparison_inputs(
                    verifier, config, quantized.keep_set, window, sliding_window, self.samples, seed
                )
            ]

        tokenizer = inputs.get("tokenizer")
        if tokenizer is not None:
            from hycoc.passes.head.calibration import real_head_calibration

            shapes = {v.name: tuple(int(d) for d in v.shape) for v in inputs["onnx_head"].payload.graph.inputs}
            answers = inputs.get("calibration_answers")
            cal, held_cal, calibration = real_head_calibration(
                verifier,
                quantized,
                shapes,
                tokenizer.payload,
                recipe,
                self.seed,
                answers=answers.payload if answers else None,
            )
            samples, held_out = cal.samples, held_cal.samples
        else:  # unit tests of the pass without a tokenizer: keep-set queries of one verifier pass
            samples, held_out = feeds(self.seed + 100), feeds(self.seed + 101)
            calibration = {"source": "keep-set queries (fallback)"}
        with tempfile.TemporaryDirectory(prefix="hycoc-head-qdq-") as tmp:
            src = Path(tmp) / "float" / "model.onnx"
            src.parent.mkdir()
            ir.save(inputs["onnx_head"].payload, src, external_data="model.onnx.data")
            arrays = head_weight_arrays(onnx.load(str(src)), quantized)
            result = quantize_graph(
                src, samples, Path(tmp) / "qdq", percentile=recipe.head_qat.input_range_percentile, weight_arrays=arrays
            )
            fmodel = onnx.load(str(result.float_path), load_external_data=False)
            held = sqnr_report(result.float_path, result.path, held_out, layers=layer_outputs(fmodel))
            # the runtime reads the graph's top-2 (Alg. 2 line 10), not its logits
            model = ir.serde.deserialize_model(append_topk(onnx.load(str(result.path)), 2, with_logq=False))
        numbers = result.numbers() | {
            "top_k_outputs": 2,
            "samples": len(samples),
            "held_out_samples": len(held_out),
            "sqnr_held_out": held,
            "calibration_inputs": calibration,
            "percentile": recipe.head_qat.input_range_percentile,
        }
        s = result.sqnr
        summary = (
            f"A16 W{quantized.bits} QDQ: {numbers['quantize_linear']} Q / {numbers['dequantize_linear']} DQ, "
            f"{len(result.weights)} weights bit-exact; SQNR logits {s['outputs']['logits']:.1f} dB, top-1 "
            f"{s['top1_agreement']:.0%} on {len(samples)} calibration queries (held-out "
            f"{len(held_out)}: {held['outputs']['logits']:.1f} dB, top-1 {held['top1_agreement']:.0%})"
        )
        return {"qdq_head": OnnxArtifact("qdq_head", model)}, PassReport(summary, numbers)
