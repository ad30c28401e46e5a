"""Architectures of the toy family: the same transformers classes as the paper's deployment, scaled down.

Per model: transformers class; toy shape; real counterpart.

* verifier: Gemma4ForCausalLM; 4 layers (3 sliding w=128, 1 full), hidden 256, MoE 4 experts top-2 + dense MLP,
  global layer 1 KV head x 128 (k=v, 25% rotary, theta 1e6) vs sliding 2 x 64; Gemma 4 26B-A4B.
* head: Gemma4AssistantForCausalLM; 2 KV-shared layers (sliding + full), hidden 128, backbone 256; 26B-A4B assistant.
* slm: Gemma4ForCausalLM, pre-quantized; 4 layers (2 KV-shared, double-wide MLP), hidden 128, per-layer inputs
  16/layer; Gemma 4 E2B QAT mobile.
"""

from __future__ import annotations

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
#: The verifier's attention geometry, which the head shares: it reads the verifier's KV (sliding layers 2 KV heads
#: x 64, the global layer 1 x 128 with k = v).
_VERIFIER_ATTENTION = dict(
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    global_head_dim=128,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
)


def verifier_config():
    """Gemma4TextConfig of the toy verifier (26B-A4B-like: sliding + global layers, MoE + dense MLP)."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        **_COMMON,
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


def head_config():
    """Gemma4AssistantConfig of the toy MTP head; its attention shapes match the verifier's KV exactly."""
    from transformers import Gemma4AssistantConfig, Gemma4TextConfig

    text = Gemma4TextConfig(
        **_COMMON,
        **_VERIFIER_ATTENTION,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=2,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
        tie_word_embeddings=True,
    )
    return Gemma4AssistantConfig(text_config=text, backbone_hidden_size=256, tie_word_embeddings=True)


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
        head_dim=64,
        global_head_dim=128,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=VOCAB_SIZE,
        tie_word_embeddings=False,
    )
    return Gemma4TextConfig(**(fields | overrides))


#: The SLM's bit map in transformers' GemmaQuantizationConfig form (regex -> options, first match wins): the assumed
#: E2B QAT checkpoint's linear layers (`hycoc.passes.bit_map.E2B_ASSUMED_MODULES` less its embedding entries): 8-bit
#: attention and output layer, 4-bit MLPs, 2-bit per-layer projections.
SLM_BIT_MAP = {k: v for k, v in E2B_ASSUMED_MODULES.items() if not k.startswith("embed_tokens")}
SLM_DEFAULT_BITS = E2B_ASSUMED_DEFAULT_BITS
#: Embedding tables (token and per-layer) are quantized 8-bit per row (LUTs on the host, paper App. A).
SLM_EMBEDDING_BITS = 8
