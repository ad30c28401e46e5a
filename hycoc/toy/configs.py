"""Architectures of the toy family: the same transformers classes as the paper's deployment, scaled down.

Per model: transformers class; toy shape; real counterpart.

* verifier: Gemma4ForCausalLM; 4 layers (3 sliding w=128, 1 full), hidden 256, MoE 4 experts top-2 + dense MLP,
  global layer 1 KV head x 128 (k=v, 25% rotary, theta 1e6) vs sliding 2 x 64; Gemma 4 26B-A4B.
* head: Gemma4AssistantForCausalLM; 2 KV-shared layers (sliding + full), hidden 128, backbone 256; 26B-A4B assistant.
* slm: Gemma4ForCausalLM, pre-quantized; 4 layers (2 KV-shared, double-wide MLP), hidden 128, per-layer inputs
  16/layer; Gemma 4 E2B QAT mobile.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hycoc.passes.bit_map import E2B_ASSUMED_DEFAULT_BITS, E2B_ASSUMED_MODULES

VOCAB_SIZE = 4096
SLIDING_WINDOW = 128
MAX_POSITIONS = 4096

_COMMON = dict(
    vocab_size=VOCAB_SIZE,
    max_position_embeddings=MAX_POSITIONS,
    sliding_window=SLIDING_WINDOW,
    final_logit_softcapping=30.0,
    rms_norm_eps=1e-6,
    pad_token_id=0,
    eos_token_id=[1, 6, 10],  # <eos>, <turn|>, <|tool_response> (Gemma 4: [1, 106, 50])
    bos_token_id=2,
    hidden_activation="gelu_pytorch_tanh",
)
#: Head dims of every model of the family: sliding layers 64, global layers twice that (Gemma 4: 256 and 512).
_HEAD_DIMS = dict(head_dim=64, global_head_dim=128)
#: The verifier's attention geometry, which the head shares: it reads the verifier's KV (sliding layers 2 KV heads
#: x 64, the global layer 1 x 128 with k = v).
_VERIFIER_ATTENTION = dict(
    _HEAD_DIMS, num_attention_heads=4, num_key_value_heads=2, num_global_key_value_heads=1, attention_k_eq_v=True
)
#: The head's text config fields that are the verifier's (`head_config`): besides the attention geometry it reads
#: the verifier's KV with (window, rotary), it shares the verifier's vocabulary, special ids and context.
HEAD_FROM_VERIFIER = (
    "vocab_size",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
    "max_position_embeddings",
    "sliding_window",
    "rope_parameters",
)


def verifier_config(**overrides):
    """Gemma4TextConfig of the toy verifier (26B-A4B-like: sliding + global layers, MoE + dense MLP).

    overrides: other values of Gemma4TextConfig's fields (the tests' smaller verifier: widths, vocabulary, layers,
    window); none for the toy family.
    """
    from transformers import Gemma4TextConfig

    fields = dict(
        _COMMON,
        **_VERIFIER_ATTENTION,
        hidden_size=256,
        intermediate_size=384,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=64,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=VOCAB_SIZE,
        tie_word_embeddings=True,
    )
    return Gemma4TextConfig(**(fields | overrides))


def head_config(verifier=None, *, assistant: Mapping[str, Any] | None = None, **overrides):
    """Gemma4AssistantConfig of the toy MTP head on ``verifier`` (a Gemma4TextConfig; None: `verifier_config()`).

    Its attention shapes match the verifier's KV exactly: the text config has the verifier's attention geometry,
    takes the `HEAD_FROM_VERIFIER` fields from ``verifier``, and the backbone width is the verifier's hidden size.
    overrides: other values of the text config's fields (the tests' smaller head: widths, head dims as their
    verifier's, window, soft-cap); assistant: other Gemma4AssistantConfig fields (ordered embeddings, centroids).
    Neither for the toy family.
    """
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    verifier = verifier_config() if verifier is None else verifier
    fields = dict(
        _COMMON,
        **_VERIFIER_ATTENTION,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        tie_word_embeddings=True,
    )
    fields |= {name: getattr(verifier, name) for name in HEAD_FROM_VERIFIER}
    text = Gemma4TextConfig(**(fields | overrides))
    return Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=verifier.hidden_size, tie_word_embeddings=True, **(assistant or {})
    )


def slm_config(**overrides):
    """Gemma4TextConfig of the toy SLM (E2B-like: per-layer inputs, KV-shared layers, double-wide MLP).

    Untied output layer, because the pre-quantized format stores the embedding tables and the output layer as
    separate quantized tensors. overrides: other values of Gemma4TextConfig's fields (the tests' scaled-down SLM:
    widths, vocabulary, window); none for the toy family.
    """
    from transformers import Gemma4TextConfig

    fields = dict(
        _COMMON,
        hidden_size=128,
        intermediate_size=320,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        num_attention_heads=2,
        num_key_value_heads=1,
        **_HEAD_DIMS,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB_SIZE,
        tie_word_embeddings=False,
    )
    return Gemma4TextConfig(**(fields | overrides))


#: The SLM's bit map in transformers' GemmaQuantizationConfig form (regex -> options, first match wins): the
#: assumed E2B QAT map's (`hycoc.passes.bit_map.E2B_ASSUMED_MODULES`) linear layers, in its order: 8-bit attention
#: and output layer, 4-bit MLPs, 2-bit per-layer projections. The embedding tables are `SLM_EMBEDDING_BITS`.
SLM_BIT_MAP = {pattern: dict(o) for pattern, o in E2B_ASSUMED_MODULES.items() if not pattern.startswith("embed_tokens")}
SLM_DEFAULT_BITS = E2B_ASSUMED_DEFAULT_BITS
#: Embedding tables (token and per-layer) are quantized 8-bit per row (LUTs on the host, paper App. A).
SLM_EMBEDDING_BITS = 8
