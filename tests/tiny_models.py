"""Tiny random Gemma 4 models for the verifier tests (a few hundred thousand parameters, milliseconds a forward).

The verifier has every feature the engine must handle: sliding and full-attention layers, global layers with a
different head dim and KV-head count (``global_head_dim``, ``num_global_key_value_heads``, ``attention_k_eq_v``),
the MoE block and the final logit soft-cap. The head is a matching ``Gemma4AssistantForCausalLM`` (all its layers
KV-shared, reading the verifier's last sliding and last full-attention layer). Both are the toy family's
(`hycoc.toy.configs`) with smaller widths, vocabulary and window.

``sharpen`` scales the verifier's output layer so that p~ has few tokens of mass (fast chi-square tests).
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import Gemma4AssistantForCausalLM, Gemma4ForCausalLM

from hycoc.toy import configs

VOCAB = 300
HIDDEN = 64
SLIDING_WINDOW = 8
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
#: The tests' head dims: the toy family's 64 / 128 scaled down (global layers twice the sliding ones, as in Gemma 4).
HEAD_DIMS = dict(head_dim=16, global_head_dim=32)


def verifier_config(*, vocab_size: int = VOCAB, sliding_window: int = SLIDING_WINDOW, layer_types=None):
    """`hycoc.toy.configs.verifier_config` scaled down: hidden 64, MLP 128, MoE experts of 32, head dims
    `HEAD_DIMS`, ``layer_types`` (default `LAYER_TYPES`: 2 sliding + 2 full), no per-layer inputs, an untied
    output layer and one stop id (1) for the 300-id fixture tokenizer."""
    layer_types = list(layer_types or LAYER_TYPES)
    return configs.verifier_config(
        **HEAD_DIMS,
        vocab_size=vocab_size,
        vocab_size_per_layer_input=0,
        eos_token_id=1,
        hidden_size=HIDDEN,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=len(layer_types),
        layer_types=layer_types,
        sliding_window=sliding_window,
        tie_word_embeddings=False,
    )


def tiny_verifier(seed: int = 0, *, sharpen: float = 1.0, attn: str = "sdpa", **config_kwargs) -> Gemma4ForCausalLM:
    """A random verifier in float32 eval mode. sharpen > 1 multiplies the output layer (peakier p~)."""
    torch.manual_seed(seed)
    config = verifier_config(**config_kwargs)
    config._attn_implementation = attn
    model = Gemma4ForCausalLM(config).eval()
    with torch.no_grad():
        # transformers' init (std 0.02) gives near-uniform logits; these give a logit std of about 2.4 and
        # outputs that depend on the context (a few tokens carry most of p~'s mass).
        model.model.embed_tokens.weight.normal_(0.0, 0.3)
        model.lm_head.weight.normal_(0.0, 0.3 * sharpen)
    return model


def tiny_head(
    verifier: Gemma4ForCausalLM, seed: int = 1, *, sliding_window: int | None = None, attn: str = "sdpa", **assistant
) -> Gemma4AssistantForCausalLM:
    """A random MTP head matching ``verifier``'s heads, head dims and rotary settings. ``assistant``: more
    ``Gemma4AssistantConfig`` fields (e.g. use_ordered_embeddings, num_centroids, centroid_intermediate_top_k)."""
    torch.manual_seed(seed)
    vc = verifier.config
    config = configs.head_config(
        vc,
        assistant=assistant,
        **HEAD_DIMS,
        hidden_size=48,
        intermediate_size=96,
        sliding_window=sliding_window or vc.sliding_window,
        final_logit_softcapping=None,  # the assistant applies none
    )
    config._attn_implementation = attn
    config.text_config._attn_implementation = attn
    head = Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():
        head.lm_head.weight.normal_(0.0, 0.5)
    return head


@torch.inference_mode()
def oracle_tree(model, tokens, width=2, depth=3, dtype=np.int64):
    """Root = tokens[-1]; the verifier's top-`width` children at each of `depth` levels along its greedy chain.
    Returns (tokens, parents) as ``dtype`` arrays (int32 for a wire `DraftTree`)."""
    tokens = list(tokens)
    tree, parents, parent = [tokens[-1]], [-1], 0
    for _ in range(depth):
        top = model(input_ids=torch.tensor([tokens])).logits[0, -1].topk(width).indices.tolist()
        first = len(tree)
        tree += top
        parents += [parent] * width
        parent = first
        tokens.append(top[0])
    return np.array(tree, dtype), np.array(parents, dtype)


def greedy_session(engine, prompt, draft_place: str, max_new_tokens: int):
    """A session of ``engine`` (a `VerifierEngine`) on ``prompt``, not prefilled: T = 0 (top-1) and exact
    acceptance, so every sample and the committed text are the verifier's argmax."""
    from hycoc.protocol.messages import Sampling

    return engine.open(
        prompt,
        Sampling(temperature=0.0, top_k=1, top_p=1.0),
        acceptance="exact",
        epsilon=1.0,
        draft_place=draft_place,
        max_new_tokens=max_new_tokens,
    )
