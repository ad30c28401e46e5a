"""RMSNorm decomposition: every RMSNorm of an exported graph in the HTP's elementwise form (docs/design.md
"The pass pipeline", after QAT for the head and after graph surgery for the SLM).

Two layers, as onnx-ir and onnxscript split them:

* `RmsNormDecompositionPass`, an onnx-ir in-place pass: infers shapes, applies the rule sets of
  `hycoc.passes.rewrite.rms_norm` (the rules, their conditions and the emitted form are documented there), removes
  the nodes left unused, and fails loudly (`RmsNormDecompositionError`) when it rewrote nothing while ``require_match``
  is set, or when an ``RMSNormalization`` op is left in the graph; the message gives each candidate's failed condition
  (from onnxscript's `MatchingTracer`), so a surgery never silently does nothing.
* `RmsNormDecomposition`, the pipeline pass: ONNX artifact of one kind (``"onnx_head"``, ``"onnx_slm"``) in, the
  same kind out, reporting how many norms it rewrote, how many it reshaped from rank 4 and the eps values read.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import onnx_ir as ir
from hycoc.passes.artifacts import OnnxArtifact
from hycoc.passes.pipeline import Pass, PassReport
from hycoc.passes.rewrite.rms_norm import RULE_SETS, TAG
from onnx_ir.passes.common import RemoveUnusedNodesPass, ShapeInferencePass
from onnxscript.rewriter import pattern

from hycoc.recipe import Recipe


class RmsNormDecompositionError(RuntimeError):
    """The decomposition matched nothing where it was required, or left an RMSNormalization op behind."""


def _tagged(model: ir.Model) -> dict[ir.Node, dict[str, Any]]:
    return {
        node: json.loads(node.metadata_props[TAG])
        for node in ir.traversal.RecursiveGraphIterator(model.graph)
        if TAG in node.metadata_props
    }


def explain(model: ir.Model) -> list[str]:
    """Why each RMSNorm-shaped candidate in ``model`` was not rewritten: one line per failed condition, naming the
    rule and the node the match was rooted at. Does not change the model (it traces a copy)."""
    model = model.clone()
    ShapeInferencePass()(model)
    lines = []
    for rule_set in RULE_SETS:
        tracer = pattern.MatchingTracer()
        rule_set.apply_to_model(model, tracer=tracer)
        for rule, matches in tracer.best_matches_map.items():
            for info in matches:
                if info.status == pattern.MatchStatus.CONDITION_FAILED:
                    where = info.root_node.name or info.root_node.op_type
                    lines.append(f"{rule.name} at node '{where}': {info.match_result.reason}")
    return sorted(set(lines))


class RmsNormDecompositionPass(ir.passes.InPlacePass):
    """Rewrite every RMSNorm of the model in place (module docstring). After the call, ``rewritten`` lists one
    dict per rewrite: rule, eps, rank, reshaped."""

    def __init__(self, require_match: bool = True):
        super().__init__()
        self.require_match = require_match
        self.rewritten: list[dict[str, Any]] = []

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        ShapeInferencePass()(model)  # the rules read x's dtype, rank and last dimension
        before = set(_tagged(model))
        count = sum(rule_set.apply_to_model(model) for rule_set in RULE_SETS)
        RemoveUnusedNodesPass()(model)
        self.rewritten = [info for node, info in _tagged(model).items() if node not in before]
        leftover = [
            n.name or n.op_type
            for n in ir.traversal.RecursiveGraphIterator(model.graph)
            if n.op_type == "RMSNormalization" and n.domain == ""
        ]
        if leftover:
            raise RmsNormDecompositionError(
                f"{len(leftover)} RMSNormalization op(s) left in the graph ({', '.join(leftover)}): "
                + ("; ".join(explain(model)) or "no rule explains why")
            )
        if count == 0 and self.require_match:
            reasons = explain(model)
            raise RmsNormDecompositionError(
                "RMSNorm decomposition is required but matched nothing in the graph: "
                + (
                    "; ".join(reasons)
                    if reasons
                    else "no RMSNorm-shaped subgraph found "
                    "(Pow(x, 2) -> ReduceMean -> Add eps -> ..., or an RMSNormalization op)"
                )
            )
        return ir.passes.PassResult(model, modified=count > 0)


class RmsNormDecomposition(Pass):
    """The pipeline pass over one ONNX artifact kind; reads no recipe table (the pipeline built for a recipe
    includes it or not). ``require_match``: fail when the graph has no RMSNorm to rewrite."""

    version = 1

    def __init__(self, kind: str = "onnx_head", *, require_match: bool = True):
        self.kind = kind
        self.require_match = require_match
        self.name = f"rmsnorm_decomposition_{kind.removeprefix('onnx_')}"
        self.consumes = {kind: OnnxArtifact}
        self.produces = {kind: OnnxArtifact}

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        return {"kind": self.kind, "require_match": self.require_match}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, OnnxArtifact], PassReport]:
        model = inputs[self.kind].payload.clone()  # structure copied, weights shared: the input stays intact
        ir_pass = RmsNormDecompositionPass(self.require_match)
        ir_pass(model)
        done = ir_pass.rewritten
        reshaped = sum(1 for r in done if r["reshaped"])
        eps = sorted({r["eps"] for r in done})
        report = PassReport(
            f"rewrote {len(done)} RMSNorms ({reshaped} reshaped from rank 4 to rank 3), eps "
            + ", ".join(f"{e:.3g}" for e in eps),
            {
                "rewritten": len(done),
                "reshaped": reshaped,
                "eps": eps,
                "by_rule": dict(Counter(r["rule"] for r in done)),
            },
        )
        return {self.kind: OnnxArtifact(self.kind, model)}, report
