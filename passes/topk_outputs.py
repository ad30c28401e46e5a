"""Top-k outputs on a drafter graph: its best keep-set indices (and log-probabilities) leave the graph instead of a
vocabulary-wide row (docs/device-runtime.md "Host work per round"; paper §3.3 names the output layers "and their top-k
search" as a large share of the device round; shared/FIELD-NOTES.md: "QNN HTP has a TopK op, so the drafters can emit
candidates, not vocabulary-wide logits").

`append_topk` adds to a graph whose output ``logits`` is (1, R, |V|):

    top_index  int64 (1, R, k)   TopK(logits, k, axis=-1, largest=1, sorted=1) indices
    top_logq   float (1, R, k)   TopK values - logsumexp(logits) over the row: log q of those indices  (with_logq)

TopK (ONNX spec, opset >= 11): "Given two equivalent values, this operator uses the indices along the axis as a
tiebreaker. That is, the element with the lower index will appear first" -- the rule of the host's
`hycoc.runtime.candidates.top_k_indices` and of Alg. 2 line 10 ("first among equals"). The log-sum-exp is written
as max + Log(ReduceSum(Exp(x - max))), the stable form, with ops every backend has (ReduceMax, Sub, Exp, ReduceSum,
Log, Add). ``logits`` stays an output of the QDQ graph, which the compiler's checks (SQNR, top-1) read; the target
step ships the graph without it (`hycoc.passes.graph_io`: a compiled graph writes every output on every call), so the
row is neither computed into an output buffer nor copied out on the device.

`htp_tie_order` (HTP targets): the HTP's TopK puts the higher index first among equal values; the rewrite makes the
compiled graph's order the CPU EP's (lower index first).

The new nodes run in float on the dequantized logits (they come after the QDQ pass): the same values the host
would have ranked, so the indices are the host path's exactly and log q differs from its float64 log-softmax by
float32 rounding.
"""

from __future__ import annotations

import numpy as np

#: Output names the runtime looks for.
TOP_INDEX, TOP_LOGQ = "top_index", "top_logq"


class TopKError(ValueError):
    """The graph has no ``logits`` output of rank 3, already has top-k outputs, or k is out of range."""


def _opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def append_topk(model, k: int, *, with_logq: bool, logits: str = "logits"):
    """Add the top-k outputs (module docstring) to ``model`` (onnx.ModelProto, opset >= 18), in place; returns it.

    k: 1 <= k <= |V| (the logits' last dimension). with_logq: also ``top_logq`` (the SLM's candidates need log q;
    the head's top-2 needs only indices). Raises TopKError naming what is wrong."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    outs = {o.name: o for o in g.output}
    if logits not in outs:
        raise TopKError(f"the graph has no output '{logits}' to take the top-k of (outputs: {sorted(outs)})")
    if TOP_INDEX in outs or TOP_LOGQ in outs:
        raise TopKError("the graph already has top-k outputs")
    dims = [d.dim_value for d in outs[logits].type.tensor_type.shape.dim]
    if len(dims) != 3 or min(dims) < 1:
        raise TopKError(f"output '{logits}' has shape {dims}; append_topk needs a static (1, R, |V|)")
    if not 1 <= k <= dims[-1]:
        raise TopKError(f"k = {k} is outside [1, {dims[-1]}] (the keep set's size)")
    if _opset(model) < 18:
        raise TopKError(f"opset {_opset(model)}: append_topk writes ReduceMax/ReduceSum with axes inputs (opset 18)")
    p = "topk_"
    g.initializer.append(numpy_helper.from_array(np.array([k], np.int64), f"{p}k"))
    nodes = [
        helper.make_node(
            "TopK", [logits, f"{p}k"], [f"{p}values", TOP_INDEX], name=f"{p}TopK", axis=-1, largest=1, sorted=1
        )
    ]
    new_outputs = [helper.make_tensor_value_info(TOP_INDEX, TensorProto.INT64, [dims[0], dims[1], k])]
    if with_logq:
        g.initializer.append(numpy_helper.from_array(np.array([-1], np.int64), f"{p}axes"))
        nodes += [
            helper.make_node("ReduceMax", [logits, f"{p}axes"], [f"{p}max"], name=f"{p}ReduceMax", keepdims=1),
            helper.make_node("Sub", [logits, f"{p}max"], [f"{p}shifted"], name=f"{p}Shift"),
            helper.make_node("Exp", [f"{p}shifted"], [f"{p}exp"], name=f"{p}Exp"),
            helper.make_node("ReduceSum", [f"{p}exp", f"{p}axes"], [f"{p}sum"], name=f"{p}ReduceSum", keepdims=1),
            helper.make_node("Log", [f"{p}sum"], [f"{p}log_sum"], name=f"{p}Log"),
            helper.make_node("Add", [f"{p}max", f"{p}log_sum"], [f"{p}lse"], name=f"{p}LogSumExp"),
            helper.make_node("Sub", [f"{p}values", f"{p}lse"], [TOP_LOGQ], name=f"{p}LogQ"),
        ]
        new_outputs.append(helper.make_tensor_value_info(TOP_LOGQ, TensorProto.FLOAT, [dims[0], dims[1], k]))
    g.node.extend(nodes)
    g.output.extend(new_outputs)
    return model


def _last_dim(model, name: str) -> int | None:
    import onnx

    for v in list(model.graph.value_info) + list(model.graph.output) + list(model.graph.input):
        if v.name == name:
            dims = v.type.tensor_type.shape.dim
            return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    inferred = onnx.shape_inference.infer_shapes(model)
    for v in inferred.graph.value_info:
        if v.name == name:
            dims = v.type.tensor_type.shape.dim
            return dims[-1].dim_value if dims and dims[-1].HasField("dim_value") else None
    return None


def htp_tie_order(model) -> int:
    """Make each TopK over the last axis give the lower index first among equal values on the QNN HTP, as ONNX
    TopK (and the CPU EP) does; in place, returns the TopK nodes rewritten.

    Measured on the x86 HTP v81 simulator (onnxruntime-qnn 2.7.0 / QNN 2.51, ``benchmarks/htp_graph_io.py ties``):
    the HTP's TopK puts the **higher** index first among equals, in the 16-bit tail and in fp16 alike (a row of
    512 equal values gave 511, 510, ..., 504; the CPU EP 0, 1, ..., 7), and at a tie across the k-th place it keeps
    the higher indices. So the HTP graph ranks the row reversed along the axis (``Slice`` with step -1) and maps
    each index i' back to V - 1 - i': among equals the lower original index then comes first, and the set at the
    k-th place is the CPU EP's. Values that are distinct in float32 but equal after the HTP's fp16 rounding stay
    ties the CPU EP does not see (no reordering can restore what fp16 lost). For HTP targets only: on the CPU EP
    this rewrite would give the higher index first."""
    from onnx import helper, numpy_helper

    g = model.graph
    count = 0
    nodes = []
    for n in g.node:
        axis = next((a.i for a in n.attribute if a.name == "axis"), -1)
        v = _last_dim(model, n.input[0]) if n.op_type == "TopK" and axis == -1 else None
        if v is None:
            nodes.append(n)
            continue
        p = f"{n.name or 'topk'}_tie_"
        g.initializer.extend(
            [
                numpy_helper.from_array(np.array([-1], np.int64), f"{p}starts"),
                numpy_helper.from_array(np.array([np.iinfo(np.int64).min], np.int64), f"{p}ends"),
                numpy_helper.from_array(np.array([-1], np.int64), f"{p}axes"),
                numpy_helper.from_array(np.array([-1], np.int64), f"{p}steps"),
                numpy_helper.from_array(np.array(v - 1, np.int64), f"{p}last"),
            ]
        )
        reversed_ = helper.make_node(
            "Slice",
            [n.input[0], f"{p}starts", f"{p}ends", f"{p}axes", f"{p}steps"],
            [f"{p}reversed"],
            name=f"{p}Reverse",
        )
        out_index = n.output[1]
        topk = helper.make_node("TopK", [f"{p}reversed", n.input[1]], [n.output[0], f"{p}index"], name=n.name)
        topk.attribute.extend(n.attribute)
        back = helper.make_node("Sub", [f"{p}last", f"{p}index"], [out_index], name=f"{p}IndexBack")
        nodes += [reversed_, topk, back]
        count += 1
    del g.node[:]
    g.node.extend(nodes)
    return count


__all__ = ["TOP_INDEX", "TOP_LOGQ", "TopKError", "append_topk", "htp_tie_order"]
