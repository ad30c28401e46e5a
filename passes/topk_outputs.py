"""Top-k outputs on a drafter graph: its best keep-set indices (and log-probabilities) leave the graph instead of a
vocabulary-wide row (issue 16; paper §3.3 names the output layers "and their top-k search" as a large share of the
device round; shared/FIELD-NOTES.md: "QNN HTP has a TopK op, so the drafters can emit candidates, not
vocabulary-wide logits").

`append_topk` adds to a graph whose output ``logits`` is (1, R, |V|):

    top_index  int64 (1, R, k)   TopK(logits, k, axis=-1, largest=1, sorted=1) indices
    top_logq   float (1, R, k)   TopK values - logsumexp(logits) over the row: log q of those indices  (with_logq)

TopK (ONNX spec, opset >= 11): "Given two equivalent values, this operator uses the indices along the axis as a
tiebreaker. That is, the element with the lower index will appear first" -- the rule of the host's
`hycoc.runtime.candidates.top_k_indices` and of Alg. 2 line 10 ("first among equals"). The log-sum-exp is written
as max + Log(ReduceSum(Exp(x - max))), the stable form, with ops every backend has (ReduceMax, Sub, Exp, ReduceSum,
Log, Add). ``logits`` stays an output: the compiler's checks (SQNR, top-1) read it; the device runtime asks
onnxruntime only for the outputs it reads (`hycoc.runtime.graphs.runtime_outputs`), so the row is not copied out.

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
    nodes = [helper.make_node("TopK", [logits, f"{p}k"], [f"{p}values", TOP_INDEX], name=f"{p}TopK", axis=-1,
                              largest=1, sorted=1)]
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


__all__ = ["TOP_INDEX", "TOP_LOGQ", "TopKError", "append_topk"]
