"""The MTP head as the static graph the device runs (paper Alg. 2, §3.4, App. A Table 3).

One call of `HeadGraph` is Alg. 2 line 9: one query over a W-column ring of the verifier's KV, for each of the two
KV-shared layer types, with everything that varies from round to round an input:

    x_hat        float [1, 1, 2H]              [e; h] (line 7) or [E[i]; h'] (line 12), H the verifier's hidden size
    k_sliding    float [1, kv_s, W, d_s]       the ring of the verifier's last sliding layer, keys rotated (line 6)
    v_sliding    float [1, kv_s, W, d_s]
    k_full       float [1, kv_f, W, d_f]       the ring of its last full-attention layer, keys rotated
    v_full       float [1, kv_f, W, d_f]
    mask_sliding float [1, 1, 1, W]            additive: 0 on live columns, `MASK_VALUE` elsewhere (line 5)
    mask_full    float [1, 1, 1, W]
    cos_sliding, sin_sliding  float [1, 1, d_s]   the query's rotary rows at position t + offset (line 6: t - 1;
                                                   Gemma 4's head: t, ``window.head_query_position_offset``)
    cos_full,    sin_full     float [1, 1, d_f]   (`rotary_rows`; full layers: Gemma 4's proportional partial rotary)

and two outputs: ``logits`` float [1, 1, |V|] over the keep set (the untied output layer restricted to keep-set rows;
arg-max i maps back to token ``keep_set[i]``, line 11) and ``h_next`` float [1, 1, H] (line 12).

Nothing of Gemma is re-implemented: the graph calls the head's own transformers modules (pre-projection, decoder
layers, final norm, output layer, post-projection). transformers' decoder layers take the rotary (cos, sin) pair
as an argument (``position_embeddings``) and KV-shared layers read K/V from ``shared_kv_states``, so the rotary rows
and the rings are plain inputs. Attention runs transformers' eager path (matmul, additive mask, softmax, matmul:
the static mask form the export wants, no fused op). The mask constant is finite (-1e4, as
`hycoc.mtp.window_mask`): a 16-bit quantized mask input holds it and 0 exactly, where -inf or a min-float stand-in
would wreck its scale (docs/design.md "Numerics by construction").

Host side (what the device runtime computes, shown here in torch/numpy for the compiler and the tests):
`rotary_rows` / `rotary_tables` (line 6), `ring_masks` (lines 2-5: column c holds position p with p mod W = c),
`embedding_table` (E, the 8-bit table of the verifier's input embeddings over the keep set, line 12).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from torch import nn

from hycoc.host import MASK_VALUE, RotaryTable, ring_masks  # noqa: F401  (ring_masks re-exported)
from hycoc.mtp import FULL, SLIDING

#: The graph's inputs and outputs in call order (names for the ONNX export and the bundle manifest).
INPUT_NAMES = (
    "x_hat",
    "k_sliding",
    "v_sliding",
    "k_full",
    "v_full",
    "mask_sliding",
    "mask_full",
    "cos_sliding",
    "sin_sliding",
    "cos_full",
    "sin_full",
)
OUTPUT_NAMES = ("logits", "h_next")


class HeadGraph(nn.Module):
    """Alg. 2 line 9 as a static module (module docstring for inputs and outputs).

    head: a ``Gemma4AssistantForCausalLM`` whose ``lm_head`` already holds the keep-set rows in keep-set order
    (`hycoc.passes.head.quantize.restrict_output_layer`, or `hycoc.passes.head.quantize.dequantized_head` for the QAT
    integers); it is copied (float32, eval, eager attention), never modified. Raises ValueError when a decoder
    layer of the head computes its own KV: the graph only reads the verifier's.
    """

    def __init__(self, head):
        super().__init__()
        head = copy.deepcopy(head).float().eval()
        text = head.config.get_text_config()
        own_kv = [i for i, mode in enumerate(text.kv_sharing_modes) if mode != "reuse"]
        if own_kv:
            raise ValueError(f"head layers {own_kv} compute their own KV; the head graph reads only the verifier's")
        for layer in head.model.layers:  # eager: explicit matmul/softmax over the additive mask input
            layer.self_attn.config._attn_implementation = "eager"
        self.pre_projection = head.pre_projection
        self.layers = head.model.layers
        self.norm = head.model.norm
        self.lm_head = head.lm_head
        self.post_projection = head.post_projection
        self.layer_types = list(text.layer_types)
        self.requires_grad_(False)

    @classmethod
    def from_quantized(cls, head) -> HeadGraph:
        """The graph of a QAT head (`hycoc.passes.artifacts.QuantizedHead`): every Linear holds integer * scale."""
        from hycoc.passes.head.quantize import dequantized_head

        return cls(dequantized_head(head))

    def forward(
        self,
        x_hat,
        k_sliding,
        v_sliding,
        k_full,
        v_full,
        mask_sliding,
        mask_full,
        cos_sliding,
        sin_sliding,
        cos_full,
        sin_full,
    ):
        kv = {SLIDING: (k_sliding, v_sliding), FULL: (k_full, v_full)}
        masks = {SLIDING: mask_sliding, FULL: mask_full}
        rotary = {SLIDING: (cos_sliding, sin_sliding), FULL: (cos_full, sin_full)}
        x = self.pre_projection(x_hat)  # [1, 1, Hh]
        for layer, kind in zip(self.layers, self.layer_types):
            x = layer(x, None, shared_kv_states=kv, position_embeddings=rotary[kind], attention_mask=masks[kind])
        x = self.norm(x)
        return self.lm_head(x), self.post_projection(x)


# ---- host side ----------------------------------------------------------------------------------------------


def _text_config(config):
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def rotary_rows(config, position: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{SLIDING: (cos, sin), FULL: (cos, sin)}, each float32 [1, 1, head_dim of that layer type], of the query at
    ``position`` (Alg. 2 line 6: t - 1; t + ``window.head_query_position_offset`` in hycoc), computed by transformers'
    ``Gemma4TextRotaryEmbedding`` for the head's config (``Gemma4AssistantConfig`` or its text config): default rotary
    on sliding layers, Gemma 4's proportional partial rotary on full layers (zero frequencies on the unrotated
    dims: cos 1, sin 0)."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    rotary = Gemma4TextRotaryEmbedding(_text_config(config))
    x = torch.zeros(1, dtype=torch.float32)
    pos = torch.tensor([[position]], dtype=torch.long)
    return {kind: rotary(x, pos, kind) for kind in (SLIDING, FULL)}


def rotary_tables(config) -> dict[str, RotaryTable]:
    """{SLIDING: table, FULL: table}: what the runtime needs to make `rotary_rows` for any position without torch
    (`hycoc.passes.artifacts.RotaryTable.rows`: emb = concat(p * inv_freq, p * inv_freq) in float32, cos =
    cos(emb) * scaling, sin = sin(emb) * scaling), from transformers' ``Gemma4TextRotaryEmbedding``."""
    from transformers.models.gemma4.modeling_gemma4 import Gemma4TextRotaryEmbedding

    rotary = Gemma4TextRotaryEmbedding(_text_config(config))
    out = {}
    for kind in (SLIDING, FULL):
        inv_freq = getattr(rotary, f"{kind}_inv_freq").numpy().astype(np.float32)
        out[kind] = RotaryTable(inv_freq, float(getattr(rotary, f"{kind}_attention_scaling")), 2 * len(inv_freq))
    return out


@torch.no_grad()
def embedding_table(verifier, keep_set) -> tuple[torch.Tensor, torch.Tensor]:
    """E (Alg. 2 line 12, App. A Table 3 "8-bit LUT"): the verifier's scaled input embeddings e(x) of the keep-set
    tokens, per-row symmetric int8: (q int8 [|V|, H] in [-127, 127], scale float32 [|V|, 1]); row i embeds
    ``keep_set[i]`` and dequantizes as ``q[i] * scale[i]``. scale = max|row| / 127 (1 for an all-zero row)."""
    ids = torch.as_tensor(keep_set, dtype=torch.long, device=verifier.device)
    rows = verifier.model.embed_tokens(ids).float()
    amax = rows.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
    q = torch.clamp(torch.round(rows / scale), -127, 127).to(torch.int8)
    return q.cpu(), scale.cpu()
