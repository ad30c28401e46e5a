"""``Reciprocal(x)`` -> ``Div(1, x)`` (the same real number; on onnxruntime's CPU EP within 1 ulp in float32, whose
Reciprocal is not always correctly rounded) for the Qualcomm HTP (docs/design.md "The pass pipeline";
`hycoc.passes.qdq.quantize` step 4). ONNX Reciprocal and Div: https://onnx.ai/onnx/operators/.

Why: measured with onnxruntime-qnn 2.7.0 / QNN 2.51 on the x86 HTP v81 simulator, the uint16 Reciprocal of an
RMSNorm over small values (input range [0, 0.45], output [0, 13.7]; the tiny SLM's per-layer projection norm) came
out at 5 dB SQNR against the same QDQ graph on the CPU EP, and the logits at 8.8 dB; as Div the logits reach 23 dB
and the KV outputs 32-45 dB. The other RMSNorms' Reciprocals were exact (90 dB): the failure depends on the range.
The RMSNorm rule (passes/rewrite/rms_norm.py) emits the Reciprocal and would be the better home; this rule runs
on the float graph just before quantization (`hycoc.passes.qdq.quantize.quantize_graph`, ``htp_rewrites``).

Matched: every ``Reciprocal`` of the default domain. `check` fails when x's dtype is known and is not float32 (the
constant 1 is float32).

Emitted: ``Div(one, x)`` under the Reciprocal's own node name and output name, ``one`` a new float32 scalar
initializer 1.0 named ``<output>_one``. The Div carries no metadata (the rewriter would copy the Reciprocal's and
its own rule tag; `cleanup` clears them), as the ModelProto loop this rule replaced wrote it, so the graphs and
bundles built before stay byte-identical.
Style: onnxscript ``rewriter/rules/common/_min_max_to_clip.py``.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
from onnxscript.rewriter import pattern
from onnxscript.rewriter.pattern import MatchResult


class ReciprocalToDiv(pattern.RewriteRuleClassBase):
    """The rule (module docstring); ``made`` lists the Div nodes it wrote in the graph last rewritten."""

    def pattern(self, op, x):
        return op.Reciprocal(x, _outputs=["inverse"])

    # onnxscript's RewriteRuleClassBase.check is (op, *args, **kwargs); a rule's check names the pattern's values, as
    # onnxscript's rule classes do (it calls check(context, **bindings))
    def check(self, context, x, **_) -> MatchResult:  # type: ignore[override]
        result = pattern.MatchResult()
        if x.dtype is not None and x.dtype != ir.DataType.FLOAT:
            return result.fail(f"x has dtype {x.dtype}, not FLOAT: the constant 1 is float32", x)
        return result

    def rewrite(self, op, x, inverse):
        one = op.initializer(ir.tensor(np.array(1.0, np.float32), name=f"{inverse.name}_one"))
        y = op.Div(one, x)
        y.producer().name = inverse.producer().name
        self.made.append(y.producer())
        return y

    def setup(self):
        self.made: list[ir.Node] = []

    def cleanup(self):
        for node in self.made:
            node.metadata_props.clear()


rule = ReciprocalToDiv.rule()
rules = pattern.RewriteRuleSet([rule])


def reciprocal_to_div(model: ir.Model) -> int:
    """Rewrite every ``Reciprocal(x)`` of ``model`` as ``Div(1, x)`` in place (module docstring); returns how many."""
    return rules.apply_to_model(model)
