"""Integer weight -> one float32 initializer, its integers and scales kept for the QDQ step (docs/design.md
"Numerics by construction"; `hycoc.passes.qdq.quantize` step 1; paper App. A: the SLM's weights keep their bits).

The SLM graph writes each weight of an ``IntegerLinear`` (passes/slm/graph.py) as ``q.to(float32) * scale``:
``Cast(q, to=FLOAT) -> Mul(scale)``, usually followed by ``Transpose(perm=[1, 0])`` into the MatMul
(ONNX Cast, Mul, Transpose: https://onnx.ai/onnx/operators/). The rule replaces the two or three nodes by one
initializer ``w = q.astype(float32) * scale`` -- what the graph computed, bit for bit -- transposed (``w.T``) when
the Transpose is folded too, and records the integers and scales (`FoldedWeight`) so that the QDQ graph can give
onnxruntime each weight's own per-channel encoding and `hycoc.passes.qdq.weights.verify_weights` can check them.

Matched: ``Mul(Cast(q), scale)``, Mul's operands in either order, and the same under ``Transpose(perm=[1, 0])``.

`check` fails, with the reason tied to the value at fault, when: q is not an int8 initializer of rank 2; the Cast
is not to float32; scale is not a float32 initializer of shape (out, 1) for q of shape (out, in) (a scale of shape
(out,) would broadcast over q's columns, not its rows); the weight would be a graph output; an initializer already
has the weight's name. The plain variant also refuses a Mul whose one reader is ``Transpose(perm=[1, 0])``: the
transposed variant folds all three. The Cast's and the Mul's outputs may have no other reader (the rewriter leaves
a match alone whose inner values are read elsewhere).

Names: q's name without its ``.q`` suffix, plus ``.weight`` (axis 0: [out, in], channels on rows) or
``.weight_t`` (axis 1: [in, out], the transposed fold). The rewriter names a replacing value after the value it
replaces; `cleanup` gives each folded initializer its own name back once the graph is done.

The rules are applied as one set, `rules`, sharing one list: the folds in graph order. The integers and scales it
reads are dropped by the driver (`hycoc.passes.qdq.weights.fold_integer_weights`) once nothing reads them.
Style: onnxscript ``rewriter/rules/common/_min_max_to_clip.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult

TRANSPOSE = [1, 0]


@dataclass(frozen=True)
class FoldedWeight:
    """One fold: initializer ``name`` (float32, = q * scale broadcast on ``axis``), ``q`` int8 in the initializer's
    layout ([out, in] for axis 0, [in, out] for axis 1), ``scale`` float32 (out,), ``value`` the initializer."""

    name: str
    q: np.ndarray
    scale: np.ndarray
    axis: int
    value: ir.Value


def _reads_transposed(value: ir.Value) -> bool:
    """True when ``value``'s one reader is ``Transpose(perm=[1, 0])``."""
    uses = list(value.uses())
    if len(uses) != 1 or uses[0].node.op_type != "Transpose" or uses[0].node.domain not in ("", "ai.onnx"):
        return False
    perm = uses[0].node.attributes.get_ints("perm", None)
    return perm is not None and list(perm) == TRANSPOSE


class FoldIntegerWeight(pattern.RewriteRuleClassBase):
    """One variant of the rule: ``transposed`` says whether a ``Transpose(perm=[1, 0])`` ends the pattern.
    Every fold is appended to ``folded`` (shared by the variants of one rule set)."""

    def __init__(self, name: str, transposed: bool, folded: list[FoldedWeight]):
        super().__init__(name)
        self._transposed, self._folded = transposed, folded

    def pattern(self, op, q, scale):
        weight = op.Mul(op.Cast(q, _outputs=["ints"]), scale, _outputs=["weight"])
        return op.Transpose(weight, perm=TRANSPOSE, _outputs=["out"]) if self._transposed else weight

    # onnxscript's RewriteRuleClassBase.check is (op, *args, **kwargs); a rule's check names the pattern's values, as
    # onnxscript's rule classes do (it calls check(context, **bindings))
    def check(self, context, q, scale, ints, weight, out=None, **_) -> MatchResult:  # type: ignore[override]
        result = pattern.MatchResult()
        if not q.is_initializer() or q.const_value is None:
            return result.fail("q is not an initializer", q)
        if q.const_value.dtype != ir.DataType.INT8:
            return result.fail(f"q has dtype {q.const_value.dtype}, not INT8", q)
        if len(q.const_value.shape) != 2:
            return result.fail(f"q has rank {len(q.const_value.shape)}, not 2", q)
        to = ints.producer().attributes.get_int("to", None)
        if to != ir.DataType.FLOAT.value:
            return result.fail(f"the Cast is to {ir.DataType(to) if to else to}, not FLOAT", ints)
        rows = q.const_value.shape[0]
        if not scale.is_initializer() or scale.const_value is None:
            return result.fail("scale is not an initializer", scale)
        if scale.const_value.dtype != ir.DataType.FLOAT:
            return result.fail(f"scale has dtype {scale.const_value.dtype}, not FLOAT", scale)
        if tuple(scale.const_value.shape) != (rows, 1):
            return result.fail(f"scale of shape {list(scale.const_value.shape)} is not ({rows}, 1), one per row", scale)
        if not self._transposed and _reads_transposed(weight):
            return result.fail(
                "the Mul's one reader is Transpose(perm=[1, 0]): the transposed variant folds it", weight
            )
        folded = out if self._transposed else weight
        if folded.is_graph_output():
            return result.fail("the weight is a graph output", folded)
        self._name = f"{q.name.removesuffix('.q')}.{'weight_t' if self._transposed else 'weight'}"
        if self._name in context.graph_or_function.initializers or any(f.name == self._name for f in self._folded):
            return result.fail(f"an initializer named '{self._name}' exists already", q)
        return result

    def rewrite(self, op, q, scale, **_):
        ints, s = q.const_value.numpy(), scale.const_value.numpy()
        w = ints.astype(np.float32) * s  # what the graph computes: (out, in) * (out, 1)
        axis = 0
        if self._transposed:
            w, ints, axis = w.T, ints.T, 1
        w = np.ascontiguousarray(w)
        value = op.initializer(ir.tensor(w, name=self._name), name=self._name)
        self._folded.append(FoldedWeight(self._name, np.array(ints, order="C"), np.array(s.reshape(-1)), axis, value))
        return value

    def cleanup(self):
        for fold in self._folded:  # replacing the Mul's (Transpose's) output gave the initializer its name
            fold.value.name = fold.name


def rules(folded: list[FoldedWeight]) -> pattern.RewriteRuleSet:
    """The rule set, its two variants appending their folds to ``folded`` in graph order (Mul's operands in
    either order)."""
    variants = [
        FoldIntegerWeight.rule("FoldIntegerWeightTransposed", True, folded),
        FoldIntegerWeight.rule("FoldIntegerWeight", False, folded),
    ]
    return pattern.RewriteRuleSet(variants, commute=True)
