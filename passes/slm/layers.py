"""The torch pieces of the SLM's tree graph that are ours (`hycoc.passes.slm.graph`, "Reuse"): `IntegerLinear`
(weight = int8 * scale, written in the graph so the exporter sees the integers), `RingCache` (the stand-in for
transformers' cache that appends the new rows to the ring input and records them as outputs) and the holder of the
decoder under transformers' attribute names (`text_stack_class`).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from hycoc.passes.artifacts import IntegerWeight
from torch import nn


class IntegerLinear(nn.Module):
    """A linear layer whose weight is written in the graph as int8 values times per-channel float32 scales.

    q: int8 (out, in) buffer, values within the checkpoint's bit width; scale: float32 (out, 1). Forward:
    ``F.linear(x, q.float() * scale)``, bit-identical to transformers' ``QuantizedLinear`` (which dequantizes the
    same way), with its SRQ rounding (``apply_srq``, 8-bit) on the input/output when the checkpoint gives a
    nonzero activation scale. ``rows`` keeps only those output channels (the keep-set output layer).
    """

    def __init__(self, weight: IntegerWeight, rows: np.ndarray | None = None):
        super().__init__()
        q, scale = weight.q, weight.scale
        if rows is not None:
            q, scale = q[rows], scale[rows]
        self.register_buffer("q", torch.from_numpy(np.ascontiguousarray(q, dtype=np.int8)))
        self.register_buffer("scale", torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)))
        self.bits = weight.bits
        self.in_features, self.out_features = int(q.shape[1]), int(q.shape[0])
        self.srq = {"input": weight.input_scale, "output": weight.output_scale}
        for where, value in self.srq.items():
            if value:
                self.register_buffer(f"{where}_scale", torch.tensor(value, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.gemma_quant import apply_srq

        if self.srq["input"]:
            x = apply_srq(x, self.input_scale)
        y = nn.functional.linear(x, self.q.to(x.dtype) * self.scale.to(x.dtype))
        if self.srq["output"]:
            y = apply_srq(y, self.output_scale)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


class RingCache:
    """The cache object transformers' attention writes to, for one forward: ``update`` returns ring + new rows
    (ring columns first, the mask's column order) and keeps the new rows for the graph's outputs. rings: layer index
    -> (k, v) ring inputs, (1, KV, W_T, D)."""

    def __init__(self, rings: Mapping[int, tuple[torch.Tensor, torch.Tensor]]):
        self.rings = rings
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        self.new[layer_idx] = (key_states, value_states)
        k_ring, v_ring = self.rings[layer_idx]
        return torch.cat([k_ring, key_states], dim=2), torch.cat([v_ring, value_states], dim=2)


def text_stack_class():
    """The module class holding an SLM graph's decoder (transformers imported on the call)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextModel

    class _TextStack(nn.Module):
        """Holds the decoder under transformers' attribute names (``model.layers.0...``) and borrows
        ``Gemma4TextModel.project_per_layer_inputs``, which only reads these attributes."""

        project_per_layer_inputs = Gemma4TextModel.project_per_layer_inputs

    return _TextStack


__all__ = ["IntegerLinear", "RingCache", "text_stack_class"]
