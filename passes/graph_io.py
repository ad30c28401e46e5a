"""The IO of the graphs a bundle ships: only what the device runtime reads, optionally in the quantized dtype
(docs/design.md "The pass pipeline": "graphs whose IO is what the runtime reads (no vocabulary-wide outputs) ...
quantized IO for the large inputs").

`ship_graph(model, quantized_io=...)` rewrites a QDQ graph (onnx.ModelProto, weights need not be loaded) in place:

1. **check outputs dropped.** A graph that emits its own top-k (``top_index``, `hycoc.passes.topk_outputs`) loses its
   keep-set-wide ``logits`` output (SLM tree graph 1 x 32 x 86,089 at the Gemma shape). The compiler's checks (SQNR,
   top-1, simulator vs CPU EP) read it from the copy the target step keeps beside the shipped graph
   (``check_source`` in the target's index). Why not leave it and not fetch it: an EPContext node computes and
   writes every output it has on every call, whatever the caller fetches. Measured on the x86 HTP simulator
   (onnxruntime-qnn 2.7.0, ``benchmarks/htp_graph_io.py unrequested``: a 4 x 8,192 logits tail with its top-8):
   the EPContext node keeps ``logits`` among its outputs, and onnxruntime's profiler records 131,456 output bytes
   per call with only ``top_index``/``top_logq`` fetched -- the same as with the logits fetched -- against 384
   bytes for the graph without the output (same top-k, bit for bit). At the Gemma shape that is 11.0 MB per SLM
   call (32 x 86,089 float32) the phone writes and, with ``offload_graph_io_quantization``, dequantizes on its CPU.
2. **quantized IO** (``quantized_io``, ``[target] quantized_io``): each KV input (`is_kv_input`: the SLM's
   ``k_ring_i``/``v_ring_i``, a later layer shard's ``k_new_i``/``v_new_i``, the head's ``k_sliding``/``v_sliding``/
   ``k_full``/``v_full``) whose only consumers are per-tensor ``QuantizeLinear`` nodes of one encoding becomes a
   graph input of that encoding's integer dtype (uint16), the QuantizeLinear removed; each KV output
   (``k_new_i``/``v_new_i``) written by a per-tensor ``DequantizeLinear`` becomes that node's integer input (the
   DequantizeLinear stays only for consumers inside the graph). The host then hands the graph integer codes
   (`hycoc.runtime.graphs.GraphRunner`: an integer feed of the input's dtype passes as it is) and copies output codes
   into the rings; onnxruntime-qnn's ``offload_graph_io_quantization`` (on by default) has no float ring left to
   quantize on the CPU per call. The encodings are the manifest's (`hycoc.passes.bundle_io.graph_io_from_onnx` reads
   them from the DequantizeLinear / QuantizeLinear beside each integer IO). On the CPU EP the graph computes the
   same values: the host's `hycoc.runtime.graphs.quantize` is ONNX QuantizeLinear (x / scale, round half to even,
   + zero point, saturate).

Raises GraphIoError when a KV tensor asked to be quantized is not read or written through a per-tensor Q/DQ.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: Outputs the compiler's checks read and the device runtime never does, dropped when the graph emits ``top_index``.
CHECK_OUTPUTS = ("logits",)
_KV = re.compile(r"^[kv]_(ring_\d+|new_\d+|sliding|full)$")
_KV_OUT = re.compile(r"^[kv]_new_\d+$")


class GraphIoError(ValueError):
    """A graph whose IO cannot be rewritten as asked; the message names the tensor."""


def is_kv_input(name: str) -> bool:
    """A KV ring (or another shard's new KV rows) input, by the graphs' naming (module docstring)."""
    return bool(_KV.match(name))


def is_kv_output(name: str) -> bool:
    """A new-KV-rows output ``k_new_i`` / ``v_new_i``."""
    return bool(_KV_OUT.match(name))


@dataclass
class ShippedIo:
    """What `ship_graph` changed: outputs dropped, inputs and outputs made integer (name -> dtype)."""

    dropped: list[str] = field(default_factory=list)
    integer_inputs: dict[str, str] = field(default_factory=dict)
    integer_outputs: dict[str, str] = field(default_factory=dict)

    def numbers(self) -> dict:
        return {
            "dropped_outputs": self.dropped,
            "integer_inputs": len(self.integer_inputs),
            "integer_outputs": len(self.integer_outputs),
        }


def _scalar_qparams(model, node) -> tuple[int, tuple] | None:
    """(zero point element type, (scale bytes, zero point bytes)) of a per-tensor Q/DQ with initializer params."""
    inits = {t.name: t for t in model.graph.initializer}
    if len(node.input) < 3 or node.input[1] not in inits or node.input[2] not in inits:
        return None
    s, zp = inits[node.input[1]], inits[node.input[2]]
    if list(s.dims) not in ([], [1]) or list(zp.dims) not in ([], [1]):
        return None
    return zp.data_type, (s.SerializeToString(), zp.SerializeToString())


def drop_check_outputs(model) -> list[str]:
    """Remove `CHECK_OUTPUTS` from the graph outputs when the graph has ``top_index``; returns the dropped names."""
    names = [o.name for o in model.graph.output]
    if "top_index" not in names:
        return []
    dropped = [n for n in names if n in CHECK_OUTPUTS]
    keep = [o for o in model.graph.output if o.name not in CHECK_OUTPUTS]
    del model.graph.output[:]
    model.graph.output.extend(keep)
    return dropped


def quantize_kv_io(model) -> tuple[dict[str, str], dict[str, str]]:
    """Step 2 of the module docstring, in place; returns ({input: dtype}, {output: dtype}) of the IO made integer."""
    from onnx import helper

    g = model.graph
    consumers: dict[str, list] = {}
    producer = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)
        for o in n.output:
            producer[o] = n
    ins, outs = {}, {}
    drop = set()
    for v in g.input:
        if not is_kv_input(v.name):
            continue
        users = consumers.get(v.name, [])
        params = [_scalar_qparams(model, n) if n.op_type == "QuantizeLinear" else None for n in users]
        found = [p for p in params if p is not None]
        if not users or len(found) != len(params) or len({p[1] for p in found}) != 1:
            raise GraphIoError(
                f"input {v.name}: read by {[n.op_type for n in users]}, not by per-tensor "
                "QuantizeLinear nodes of one encoding; it cannot become an integer input"
            )
        for q in users:
            for n in consumers.get(q.output[0], []):
                n.input[:] = [v.name if i == q.output[0] else i for i in n.input]
            drop.add(id(q))
        v.type.tensor_type.elem_type = found[0][0]
        ins[v.name] = helper.tensor_dtype_to_np_dtype(found[0][0]).name
    for v in g.output:
        if not is_kv_output(v.name):
            continue
        dq = producer.get(v.name)
        p = _scalar_qparams(model, dq) if dq is not None and dq.op_type == "DequantizeLinear" else None
        if dq is None or p is None:
            raise GraphIoError(
                f"output {v.name}: not written by a per-tensor DequantizeLinear; it cannot become an integer output"
            )
        codes, inner = dq.input[0], f"{v.name}_dequantized"
        for n in consumers.get(v.name, []):  # readers inside the graph keep the float rows
            n.input[:] = [inner if i == v.name else i for i in n.input]
        if consumers.get(v.name):
            dq.output[0] = inner
        else:
            drop.add(id(dq))
        for n in g.node:  # the codes take the output's name
            n.input[:] = [v.name if i == codes else i for i in n.input]
            n.output[:] = [v.name if o == codes else o for o in n.output]
        v.type.tensor_type.elem_type = p[0]
        outs[v.name] = helper.tensor_dtype_to_np_dtype(p[0]).name
    keep = [n for n in g.node if id(n) not in drop]
    del g.node[:]
    g.node.extend(keep)
    return ins, outs


def ship_graph(model, *, quantized_io: bool = False) -> ShippedIo:
    """The shipped form of a QDQ graph (module docstring), in place. Raises GraphIoError."""
    out = ShippedIo(dropped=drop_check_outputs(model))
    if quantized_io:
        out.integer_inputs, out.integer_outputs = quantize_kv_io(model)
    return out


__all__ = [
    "CHECK_OUTPUTS",
    "GraphIoError",
    "ShippedIo",
    "drop_check_outputs",
    "is_kv_input",
    "is_kv_output",
    "quantize_kv_io",
    "ship_graph",
]
