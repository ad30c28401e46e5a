"""The MTP head (transformers' ``Gemma4AssistantForCausalLM``) called the way HyCo drafts with it.

transformers' own entry point (``Gemma4AssistantForCausalLM.forward``) builds its masks from a 2-D padding mask
and can only place every query over the same keys. HyCo needs each query to see its own window of the
verifier's KV (training many anchors at once, the ring of Alg. 2), so `head_step` calls the head's submodules
(``pre_projection`` -> ``model`` -> ``post_projection`` / ``lm_head``) with explicit 4-D masks. Nothing of
Gemma is re-implemented: the decoder layers, rotary tables and attention are transformers'. The chain of K steps
around `head_step` is `hycoc.mtp_chain.head_chain` (torch-free: the device's MTP Drafter runs it too).

Shapes: N queries, H verifier hidden, Hh head hidden, V vocabulary.
"""

from __future__ import annotations

import torch

#: The KV-sharing keys transformers uses for the verifier's last sliding and last full-attention layer.
SLIDING = "sliding_attention"
FULL = "full_attention"


def window_mask(query_pos: torch.Tensor, kv_len: int, window: int | None, *, dtype=torch.float32) -> torch.Tensor:
    """Additive mask for queries that see KV positions ``[max(0, q - window), q)`` -- strictly before ``q``.

    Paper Alg. 2 line 5: the head reads the live positions [l, t) of the ring, l = max(l, t - W), and never its
    own position (the root has no KV yet). query_pos: int64, shape (B, N), the root position t of each query.
    Returns float (B, 1, N, kv_len) with 0 where visible and a finite large negative (-1e4, sized for a 16-bit
    quantized mask, never -inf) elsewhere.
    """
    kv = torch.arange(kv_len, device=query_pos.device)
    q = query_pos[..., None]
    ok = kv < q
    if window is not None:
        ok &= kv >= q - window
    return torch.where(ok, 0.0, -1e4).to(dtype)[:, None]


def head_step(
    head,
    x_hat: torch.Tensor,
    shared_kv: dict[str, tuple[torch.Tensor, torch.Tensor]],
    masks: dict[str, torch.Tensor],
    position_ids: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One MTP head step (Alg. 2 line 9) for N independent queries.

    x_hat: (B, N, 2H) = [e(x); h], e the verifier's scaled input embedding, h its last hidden state after the final
    norm (``hidden="post_norm"``, as transformers feeds Gemma 4's head) or before it (``"pre_norm"``, the paper's
    App. A), or the head's own projected output state from the previous step (Alg. 2 line 12).
    shared_kv: {SLIDING: (k, v), FULL: (k, v)}, each (B, kv_heads, L, head_dim), keys already rotated.
    masks: {SLIDING: (B, 1, N, L_s), FULL: (B, 1, N, L_f)} additive float masks (see `window_mask`).
    position_ids: int64 (B, N), the query's rotary position: t + ``head_query_position_offset`` (transformers: t,
    the paper: t - 1).
    Returns (logits (B, N, V) over the head's full output layer -- not soft-capped, centroid-masked for a head
    with ordered embeddings, both as transformers' ``Gemma4AssistantForCausalLM`` --, h_next (B, N, H) =
    post_projection output).
    """
    inputs = head.pre_projection(x_hat)
    out = head.model(
        inputs_embeds=inputs,
        attention_mask=masks,
        position_ids=position_ids,
        shared_kv_states=shared_kv,
        use_cache=False,
        # transformers 5.2x: without this flag the KV-shared text model slices rows by `logits_to_keep`
        # and fails for more than one query (FIELD-NOTES, "Verifiers and tree speculation").
        output_hidden_states=True,
    )
    last = out.last_hidden_state
    # As Gemma4AssistantForCausalLM.forward: no soft-cap; the centroid-masked output when the head has ordered
    # embeddings (``use_ordered_embeddings``; `hycoc.passes.head.quantize.restrict_output_layer` drops it), else
    # lm_head.
    masked = getattr(head, "masked_embedding", None)
    logits = masked(last, head.lm_head.weight) if masked is not None else head.lm_head(last)
    return logits, head.post_projection(last)
