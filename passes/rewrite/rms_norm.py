"""RMSNorm -> the elementwise form the Qualcomm HTP runs well (docs/design.md "The pass pipeline"; paper App. A: RMS
normalization decomposed into standard operators).

RMSNorm over the last axis: ``y = x / sqrt(mean(x², axis=-1) + eps) * scale``
(ONNX ``RMSNormalization``, opset 23: https://onnx.ai/onnx/operators/onnx__RMSNormalization.html).

Matched, in an exported graph (check the graph, not the torch module):

* the ``RMSNormalization`` op, normalizing the last axis only (``axis`` = -1 or rank-1), ``stash_type`` equal to
  the input's dtype, epsilon from its attribute (default 1e-5);
* the decomposed form ``Pow(x, 2) -> ReduceMean(last axis, keepdims) -> Add eps`` followed by one of
  ``Pow(·, -0.5)`` then ``Mul x`` (transformers 5.24 ``Gemma4RMSNorm``, exported by torch's dynamo exporter),
  ``Sqrt -> Reciprocal -> Mul x`` (the onnxscript fusion's form), ``Div(1, Sqrt) -> Mul x`` or ``Div(x, Sqrt)``,
  with or without a learned ``Mul scale`` after it. Operand order of Add and Mul does not matter.

Gemma's scale: ``Gemma4RMSNorm`` multiplies by ``weight`` itself (its checkpoints store the folded value; Gemma 2/3
multiplied by ``1 + weight``), and ``with_scale=False`` (the v-norm) has no scale Mul at all. A scale written as
``Add(1, w)`` of two constants is folded into one initializer here.

Emitted: ``x * Reciprocal(Sqrt(ReduceMean(x * x) + eps)) * scale`` with ``eps`` the graph's own constant, and, when
``x`` has rank 4 or more (per-head q/k norms: [B, S, H, head_dim]), ``Reshape(x, [0, -1, D])`` before and a Reshape
back to x's shape after, because the HTP is reported to compute rank-4 RMSNorm wrongly without an error
(shared/FIELD-NOTES.md, HTP pitfalls). The output squares with ``Mul(x, x)``, which no pattern here matches, so a
rewritten norm is never rewritten again. The last node of each rewrite carries ``metadata_props[TAG]`` (JSON: rule,
eps, rank, reshaped) for the pass's report.

`check` fails, with the reason tied to the value at fault, when: eps is not a constant scalar; the scale is not a
constant (an initializer or Constant) or does not broadcast over the last axis only; x's rank or last dimension is
unknown where the rewrite needs them; the reduction is not over the last axis with keepdims; x is mean-centred
(``x = a - mean(a)``: a LayerNorm, not an RMSNorm).

Rules are applied as two rule sets, `WITH_SCALE` then `WITHOUT_SCALE`: the rewriter visits nodes in graph order
and the unscaled pattern's last node comes before the scale Mul, so applying both at once would leave every scale
outside the rewrite. A norm whose scale is not a constant is still rewritten by the second set (its Mul stays).
Style: onnxscript ``rewriter/rules/fusion/_rms_normalization.py``.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import _ir_utils, pattern
from onnxscript.rewriter.pattern import MatchResult

#: metadata key on the last node of every rewrite (JSON).
TAG = "hycoc.rewrite.rms_norm"
FLOAT_TYPES = frozenset([ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.DOUBLE])
#: How the decomposed pattern inverts the root mean square.
FORMS = ("pow", "reciprocal", "div_one", "div")


def _constant(value: ir.Value | None) -> np.ndarray | None:
    """The value's constant contents, folding ``Add(c1, c2)`` of two constants (Gemma's ``1 + w``); else None."""
    if value is None:
        return None
    array = _ir_utils.get_numpy_value(value)
    if array is not None:
        return array
    producer = value.producer()
    if producer is not None and producer.op_type == "Add" and producer.domain == "" and len(producer.inputs) == 2:
        a, b = (_ir_utils.get_numpy_value(v) for v in producer.inputs)
        if a is not None and b is not None:
            return (a + b).astype(a.dtype)
    return None


def _mean_centred(x: ir.Value) -> bool:
    """True when x = Sub(a, ReduceMean(a)): the input of a LayerNorm's variance."""
    sub = x.producer()
    if sub is None or sub.op_type != "Sub" or len(sub.inputs) != 2 or sub.inputs[1] is None:
        return False
    mean = sub.inputs[1].producer()
    return mean is not None and mean.op_type == "ReduceMean" and mean.inputs[0] is sub.inputs[0]


class RmsNormToElementwise(pattern.RewriteRuleClassBase):
    """One variant of the rule: ``form`` is ``"op"`` (the RMSNormalization op) or one of `FORMS`; ``scaled``
    says whether a learned ``Mul scale`` ends the decomposed pattern (always True for the op)."""

    def __init__(self, name: str, form: str, scaled: bool):
        super().__init__(name)
        self._form, self._scaled = form, scaled
        self._folded = 0

    def pattern(self, op, x, eps, scale):
        if self._form == "op":
            return op.RMSNormalization(x, scale, _outputs=["normed"])
        mean = op.ReduceMean(op.Pow(x, 2.0), _allow_other_inputs=True, _outputs=["mean"])
        var = op.Add(mean, eps)
        if self._form == "pow":
            normed = op.Mul(x, op.Pow(var, -0.5))
        elif self._form == "reciprocal":
            normed = op.Mul(x, op.Reciprocal(op.Sqrt(var)))
        elif self._form == "div_one":
            normed = op.Mul(x, op.Div(1.0, op.Sqrt(var)))
        else:
            normed = op.Div(x, op.Sqrt(var))
        return op.Mul(normed, scale) if self._scaled else normed

    # onnxscript's RewriteRuleClassBase.check is (op, *args, **kwargs); a rule's check names the pattern's values, as
    # onnxscript's rule classes do (it calls check(context, **bindings))
    def check(self, context, x, eps=None, scale=None, mean=None, normed=None, **_) -> MatchResult:  # type: ignore[override]
        result = pattern.MatchResult()
        self._opset = context.model.opset_imports.get("", 18)  # ReduceMean takes axes as an input from 18 on
        if x.dtype not in FLOAT_TYPES:
            return result.fail(f"x has dtype {x.dtype}, not a float type", x)
        rank = x.shape.rank() if x.shape is not None else None
        if rank is None:
            return result.fail("the rank of x is unknown", x)
        if self._form == "op":
            node = normed.producer()
            axis = node.attributes.get_int("axis", -1)
            if axis not in (-1, rank - 1):
                return result.fail(f"RMSNormalization normalizes axes {axis}..{rank - 1}, not the last axis only", node)
            stash = node.attributes.get_int("stash_type", ir.DataType.FLOAT.value)
            if stash != x.dtype.value:
                return result.fail(f"stash_type {ir.DataType(stash)} differs from x's dtype {x.dtype}", node)
            self._eps = node.attributes.get_float("epsilon", 1e-5)
        else:
            reason = self._check_reduction(mean.producer(), rank)
            if reason:
                return result.fail(reason, mean)
            eps_value = _ir_utils.get_singleton_value(eps)
            if not isinstance(eps_value, float):
                return result.fail("eps is not a constant float scalar", eps)
            if _mean_centred(x):
                return result.fail("x is mean-centred (x = a - mean(a)): a LayerNorm, not an RMSNorm", x)
            self._eps = eps_value
        dim = x.shape[-1]
        if rank >= 4 and not isinstance(dim, int):
            return result.fail(f"x has rank {rank} and a symbolic last dimension {dim}: cannot reshape to rank 3", x)
        self._scale = None
        if self._scaled:
            value = _constant(scale)
            if value is None:
                return result.fail("scale is not an initializer or constant", scale)
            if value.dtype.kind != "f":
                return result.fail(f"scale has dtype {value.dtype}, not a float type", scale)
            if value.size not in (1, dim) or any(d != 1 for d in value.shape[:-1]):
                return result.fail(
                    f"scale of shape {list(value.shape)} does not broadcast over the last axis ({dim}) only", scale
                )
            self._scale = value
        return result

    @staticmethod
    def _check_reduction(node: ir.Node, rank: int) -> str | None:
        """Why the ReduceMean is not a mean over the last axis with keepdims (None when it is)."""
        if node.attributes.get_int("keepdims", 1) != 1:
            return "ReduceMean drops the reduced axis (keepdims = 0)"
        if len(node.inputs) > 1 and node.inputs[1] is not None:
            value = _ir_utils.get_numpy_value(node.inputs[1])
            if value is None:
                return "ReduceMean's axes are not a constant"
            axes = [int(a) for a in np.ravel(value)]
        else:
            given = node.attributes.get_ints("axes", None)
            axes = list(given) if given is not None else list(range(rank))
        if [a % rank for a in axes] != [rank - 1]:
            return f"ReduceMean reduces axes {axes}, not the last axis only"
        return None

    def rewrite(self, op, x, scale=None, **_):
        rank, dim = x.shape.rank(), x.shape[-1]
        reshaped = rank >= 4
        h = op.Reshape(x, op.Constant(value=ir.tensor(np.array([0, -1, dim], dtype=np.int64)))) if reshaped else x
        square = op.Mul(h, h)
        axes = ir.tensor(np.array([-1], dtype=np.int64))
        mean = (
            op.ReduceMean(square, op.Constant(value=axes), keepdims=1)
            if self._opset >= 18
            else op.ReduceMean(square, axes=[-1], keepdims=1)
        )
        eps = op.Constant(value=ir.tensor(np.array(self._eps, dtype=x.dtype.numpy())))
        y = op.Mul(h, op.Reciprocal(op.Sqrt(op.Add(mean, eps))))
        if self._scale is not None:
            if scale.const_value is not None and scale.shape is not None and len(scale.shape) <= 1:
                scale_value = scale  # already a [D] (or scalar) constant: keep the original weight
            else:
                self._folded += 1  # a fresh name: the rewriter skips an initializer whose name exists
                scale_value = op.initializer(
                    ir.tensor(self._scale.reshape(-1)), name=f"{scale.name}.rms_scale.{self._folded}"
                )
            y = op.Mul(y, scale_value)
        if reshaped:
            static = all(isinstance(d, int) for d in x.shape)
            shape = op.Constant(value=ir.tensor(np.array(list(x.shape), dtype=np.int64))) if static else op.Shape(x)
            y = op.Reshape(y, shape)
        y.producer().metadata_props[TAG] = json.dumps(
            {"rule": self.name, "eps": self._eps, "rank": rank, "reshaped": reshaped}
        )
        return y

    def setup(self):
        self._folded = 0  # scales folded into new initializers in this graph


def _rules(scaled: bool) -> list[pattern.RewriteRule]:
    rules = [
        RmsNormToElementwise.rule(f"RmsNorm{form.title().replace('_', '')}{'Scaled' if scaled else ''}", form, scaled)
        for form in FORMS
    ]
    if scaled:
        rules.insert(0, RmsNormToElementwise.rule("RmsNormOp", "op", True))
    return rules


#: Applied first: the op and every decomposed form ending in a constant scale.
WITH_SCALE = pattern.RewriteRuleSet(_rules(scaled=True), commute=True)
#: Applied second: decomposed forms without a scale (``with_scale=False``, or a scale that is not a constant).
WITHOUT_SCALE = pattern.RewriteRuleSet(_rules(scaled=False), commute=True)
RULE_SETS = (WITH_SCALE, WITHOUT_SCALE)


def _squared(value: ir.Value | None) -> ir.Value | None:
    """x when ``value`` is ``Pow(x, 2)`` or ``Mul(x, x)``, else None."""
    node = value.producer() if value is not None else None
    if node is None or node.domain not in ("", "ai.onnx") or len(node.inputs) != 2:
        return None
    if node.op_type == "Mul" and node.inputs[0] is node.inputs[1]:
        return node.inputs[0]
    if node.op_type == "Pow":
        exponent = _ir_utils.get_singleton_value(node.inputs[1])
        return node.inputs[0] if exponent is not None and float(exponent) == 2.0 else None
    return None


def rank4_rms_inputs(model: ir.Model) -> list[tuple[str, int]]:
    """RMSNorm-shaped reductions of ``model`` whose input has rank 4 or more: ``ReduceMean(Pow(x, 2))`` or
    ``ReduceMean(Mul(x, x))``, and ``RMSNormalization`` ops, as (node name or op type, rank of x).

    After `hycoc.passes.rmsnorm_decomposition.RmsNormDecompositionPass` this must be empty: every per-head q/k norm
    ([B, S, H, head_dim]) is reshaped to rank 3 first (the HTP computes rank-4 RMSNorm wrongly without an error,
    shared/FIELD-NOTES.md). Reads the shapes already in the model (run onnx-ir's ShapeInferencePass first; the
    decomposition pass does); an x of unknown rank is not reported."""
    found = []
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        if node.domain not in ("", "ai.onnx"):
            continue
        x = None
        if node.op_type == "ReduceMean" and node.inputs:
            x = _squared(node.inputs[0])
        elif node.op_type == "RMSNormalization" and node.inputs:
            x = node.inputs[0]
        rank = x.shape.rank() if x is not None and x.shape is not None else None
        if rank is not None and rank >= 4:
            found.append((node.name or node.op_type, rank))
    return found
