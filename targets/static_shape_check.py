"""Static-graph check: no data-dependent KV slicing, no fused attention op (docs/design.md
"Numerics by construction", "MTP head (the Drafter)": ring KV with an additive mask input, static shapes).

One job: find, in an ONNX model, the two constructs the HTP graphs must not contain, and refuse them with
`StaticGraphError` (node names, op types, why, and the fix):

* **data-dependent slicing of KV**: a ``Slice`` (starts/ends/axes/steps), ``Gather``, ``GatherElements`` or
  ``GatherND`` (indices), or a ``ScatterND`` / ``ScatterElements`` (indices: a KV-cache write at a position) whose
  data is an activation (computed from the graph inputs) and whose index operand is computed from a graph input's
  *values* -- e.g. ``k[:, :, pos - W : pos]`` or transformers' ``StaticCache`` ``index_copy_(cache_position)``.
  A Gather on a constant table indexed by an input (an embedding lookup) is not a KV slice and is left to the HTP
  target's host-only check (`hycoc.targets.htp_checks.find_host_only_nodes`); a Slice whose starts come from
  ``Shape`` of a static-shape tensor is static and is not matched.
* **fused attention ops**: ONNX ``Attention`` (opset 23) and onnxruntime's ``com.microsoft`` attention contrib ops
  (``Attention``, ``MultiHeadAttention``, ``GroupQueryAttention``, ``PackedMultiHeadAttention``,
  ``SparseAttention``, ...): the QNN EP does not place them on the HTP as one static op, and their KV/past-length
  inputs are what the static mask form replaces.

The fix, in both cases, is the static mask form hycoc's own graphs use (``passes/head/graph.py``,
``passes/slm/graph.py``): the K/V ring arrives as a fixed-shape graph input (W columns), which positions are
visible is an additive mask input (0 or the finite ``-1e4``), and attention is ``MatMul -> Add(mask) -> Softmax ->
MatMul``; export at opset 21, where torch's ``scaled_dot_product_attention`` decomposes into those ops.

"Computed from a graph input's values" is tracked forward through the graph (subgraphs included): a graph input
that is not an initializer is a source, constants are not, ``Shape``/``Size`` depend on their input's shape only
(static when the shape is known or all graph inputs are static), every other op depends on all its inputs.
Built on onnx-ir (the same IR the onnxscript rewriter passes here use); no rewriting is attempted.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass

import onnx_ir as ir

#: Fused attention ops: (domain, op_type). Domain "" is the default ONNX domain ("ai.onnx").
FUSED_ATTENTION = frozenset(
    {
        ("", "Attention"),
        *(
            ("com.microsoft", op)
            for op in (
                "Attention",
                "MultiHeadAttention",
                "GroupQueryAttention",
                "PackedAttention",
                "PackedMultiHeadAttention",
                "DecoderMaskedMultiHeadAttention",
                "DecoderMaskedSelfAttention",
                "SparseAttention",
                "PagedAttention",
                "LongformerAttention",
                "QAttention",
                "QOrderedAttention",
                "QOrderedLongformerAttention",
            )
        ),
    }
)
#: Index-taking ops of the default domain -> positions of their index operands.
INDEXED_OPS = {
    "Slice": (1, 2, 3, 4),
    "Gather": (1,),
    "GatherElements": (1,),
    "GatherND": (1,),
    "ScatterND": (1,),
    "ScatterElements": (1,),
}
_SHAPE_ONLY = {"Shape", "Size"}

FIX = (
    "Fix: use the static mask form -- feed the K/V ring as a fixed-shape graph input, say which columns are "
    "visible with the additive mask input (0 or the finite -1e4), and compute attention as MatMul -> Add(mask) "
    "-> Softmax -> MatMul (as passes/head/graph.py and passes/slm/graph.py do); export at opset 21, where torch's "
    "scaled_dot_product_attention decomposes into those ops, and keep positions on the host."
)


@dataclass(frozen=True)
class StaticGraphFinding:
    """One node the static-graph check refuses: its name, op type, domain ("" = ONNX) and why."""

    name: str
    op_type: str
    domain: str
    reason: str

    def __str__(self) -> str:
        op = self.op_type if self.domain in ("", "ai.onnx") else f"{self.domain}::{self.op_type}"
        return f"{self.name or '<unnamed>'} ({op}): {self.reason}"


class StaticGraphError(ValueError):
    """A graph with data-dependent KV slicing or a fused attention op. ``.nodes`` lists them
    (:class:`StaticGraphFinding`); the message names every node, its op type and the fix."""

    def __init__(self, message: str, nodes: Iterable[StaticGraphFinding]):
        self.nodes = list(nodes)
        lines = "\n".join(f"  - {n}" for n in self.nodes)
        super().__init__(f"{message}\n{lines}\n{FIX}" if lines else message)


def _as_ir(model) -> ir.Model:
    """An onnx_ir.Model from an onnx_ir.Model, an onnx.ModelProto or a path (external data not read)."""
    if isinstance(model, ir.Model):
        return model
    if isinstance(model, (str, os.PathLike)):
        import onnx

        model = onnx.load(str(model), load_external_data=False)
    return ir.serde.deserialize_model(model)


def _static_shape(value: ir.Value) -> bool:
    shape = value.shape
    return shape is not None and all(isinstance(d, int) for d in shape)


def find_static_graph_faults(model) -> list[StaticGraphFinding]:
    """The nodes of ``model`` (onnx_ir.Model, onnx.ModelProto or path to a .onnx file) that do data-dependent
    slicing of an activation (KV) or are fused attention ops, in graph order, subgraphs included.
    See the module docstring for what matches. Never raises on a well-formed model; an empty list = clean."""
    model = _as_ir(model)
    graph = model.graph
    sources: dict[ir.Value, frozenset[str]] = {}
    for v in graph.inputs:
        if v.const_value is None:
            sources[v] = frozenset([v.name or ""])
    all_static = all(_static_shape(v) for v in graph.inputs)
    found: list[StaticGraphFinding] = []

    def of(value: ir.Value | None) -> frozenset[str]:
        if value is None or value.const_value is not None:
            return frozenset()
        return sources.get(value, frozenset())

    def scan(g: ir.Graph, inherited: frozenset[str]) -> None:
        for v in g.inputs:  # a subgraph's own inputs (loop counters, scan slices): its node's sources
            if v not in sources and v.const_value is None:
                sources[v] = inherited
        for node in g:
            domain = "" if node.domain in ("", "ai.onnx") else node.domain
            if (domain, node.op_type) in FUSED_ATTENTION:
                found.append(
                    StaticGraphFinding(
                        node.name or "",
                        node.op_type,
                        domain,
                        "fused attention op; the HTP graph needs the static mask form "
                        "(MatMul/Add(mask)/Softmax/MatMul)",
                    )
                )
            if domain == "" and node.op_type in _SHAPE_ONLY and node.inputs and node.inputs[0] is not None:
                x = node.inputs[0]
                dep = frozenset() if (_static_shape(x) or all_static) else of(x)
            else:
                dep = frozenset().union(*(of(v) for v in node.inputs))
            subgraphs = [a.value for a in node.attributes.values() if a.type == ir.AttributeType.GRAPH]
            subgraphs += [s for a in node.attributes.values() if a.type == ir.AttributeType.GRAPHS for s in a.value]
            for sub in subgraphs:
                scan(sub, dep)
                dep = dep.union(*(of(o) for o in sub.outputs))
            for out in node.outputs:
                sources[out] = dep
            if domain == "" and node.op_type in INDEXED_OPS and node.inputs and node.inputs[0] is not None:
                data = of(node.inputs[0])
                index = [
                    (i, of(node.inputs[i]))
                    for i in INDEXED_OPS[node.op_type]
                    if i < len(node.inputs) and node.inputs[i] is not None and of(node.inputs[i])
                ]
                if data and index:
                    by = sorted(set().union(*(s for _, s in index)))
                    names = ", ".join(f"'{n}'" for n in by)
                    operand = "starts/ends" if node.op_type == "Slice" else "indices"
                    what = "write into" if node.op_type.startswith("Scatter") else "slice of"
                    found.append(
                        StaticGraphFinding(
                            node.name or "",
                            node.op_type,
                            domain,
                            f"data-dependent {what} an activation (KV): its {operand} come from graph input(s) {names}",
                        )
                    )

    scan(graph, frozenset())
    return found


def check_static_graph(model, *, what: str = "graph") -> None:
    """Refuse ``model`` (onnx_ir.Model, onnx.ModelProto or path) when `find_static_graph_faults` finds anything.

    ``what``: how the message names the graph (e.g. the file name). Raises StaticGraphError listing every node
    (name, op type, why) and the fix; returns None for a clean graph."""
    found = find_static_graph_faults(model)
    if found:
        raise StaticGraphError(
            f"{what}: {len(found)} node(s) are not static-graph attention (data-dependent KV "
            f"slicing or a fused attention op); the HTP target needs static shapes and the "
            f"static mask form",
            found,
        )


__all__ = [
    "FIX",
    "FUSED_ATTENTION",
    "INDEXED_OPS",
    "StaticGraphError",
    "StaticGraphFinding",
    "check_static_graph",
    "find_static_graph_faults",
]
