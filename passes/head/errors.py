"""The error of the head's QAT and its data (`hycoc.passes.head.qat`, `hycoc.passes.head.quantize`,
`hycoc.passes.head.prompts`)."""

from __future__ import annotations


class HeadQatError(ValueError):
    """QAT that cannot run: too few calibration or evaluation prompts, a prompt file that is Spec-Bench or
    malformed, a head with a biased Linear, no response anchors. The message names the recipe key involved."""
