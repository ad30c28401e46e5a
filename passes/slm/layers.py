"""Two torch pieces of the SLM's tree graph (`hycoc.passes.slm.graph`, "Reuse"): `RingCache`, the stand-in for
transformers' cache that appends the new rows to the ring input and records them as outputs, and the holder of the
decoder under transformers' attribute names (`text_stack_class`).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


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


__all__ = ["RingCache", "text_stack_class"]
