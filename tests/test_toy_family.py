"""The committed toy family: tokenizer, verifier, MTP head and pre-quantized SLM load offline and behave as recorded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hycoc.passes.bit_map import qmax
from safetensors.torch import load_file

from hycoc.chat_template import apply_chat_template_ids, load_chat
from hycoc.models import load_head, load_slm, load_tokenizer, load_verifier
from hycoc.mtp import FULL, SLIDING, head_step, window_mask
from hycoc.toy import configs
from hycoc.toy.chat_files import SPECIAL_TOKENS, prompt_text
from hycoc.toy.gemma_format import bits_for, pack
from hycoc.toy.tokenizer import byte_token_ids

MODELS = Path(__file__).resolve().parents[1] / "recipes" / "toy" / "models"
# Logits are recomputed in float32 on the CPU; BLAS kernels may sum in another order on another machine.
ATOL = 2e-4


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(MODELS / "verifier" / "tokenizer.json")


@pytest.fixture(scope="module")
def ref():
    return json.loads((MODELS / "reference_logits.json").read_text())


@pytest.mark.parametrize(
    "text",
    [
        "The quick brown fox jumps over the lazy dog.\n\nA second paragraph, with punctuation; and digits 0123.",
        "def f(x: int) -> list[int]:\n    return [i * i for i in range(x) if i % 2]\n\tTabs\tand  spaces  ",
        "안녕하세요, 세계! Привет мир. こんにちは 🌍🚀 — naïve café",
    ],
)
def test_tokenizer_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert max(ids) < configs.VOCAB_SIZE


def test_tokenizer_vocabulary_layout(tok):
    assert tok.get_vocab_size() == configs.VOCAB_SIZE == 4096
    assert [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    byte_ids = byte_token_ids(tok)
    assert len(byte_ids) == 256 and len(set(byte_ids)) == 256
    # Hangul has no merged token in this English/code corpus: it is spelled with byte tokens only.
    ids = tok.encode("한", add_special_tokens=False).ids
    assert len(ids) == 3 and set(ids) <= set(byte_ids)
    assert SPECIAL_TOKENS[5:7] == ["<|turn>", "<turn|>"] and SPECIAL_TOKENS[10] == "<|tool_response>"


def test_byte_token_ids_refuses_a_tokenizer_without_the_byte_alphabet():
    """A tokenizer missing byte-level characters is named as such (it raised TypeError sorting None ids before)."""
    from tokenizers import Tokenizer, models

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(ValueError, match=r"no token for the byte-level characters .*not a byte-level BPE"):
        byte_token_ids(word_level)


def test_chat_format_is_read_from_the_checkpoint_files(tok, ref):
    """The toy folder holds what a Gemma 4 folder holds; the format read from it is Gemma 4's, and the renamed
    special tokens keep the ids the weights were trained on: the reference prompt (recorded before the rename)
    encodes to the same ids."""
    chat = load_chat(MODELS / "verifier", MODELS / "verifier")
    f = chat.format
    assert (f.stop_ids, f.stop_tokens) == ([1, 6, 10], ["<eos>", "<turn|>", "<|tool_response>"])
    assert chat.render(" Hi ") == "<bos><|turn>user\nHi<turn|>\n<|turn>model\n"  # user text trimmed
    assert (
        chat.render("Hi", thinking=True)
        == "<bos><|turn>system\n<|think|><turn|>\n<|turn>user\nHi<turn|>\n<|turn>model\n"
    )
    two = chat.render_text(
        [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "<|channel>thought\nhm<channel|> Yes \n"},
            {"role": "user", "content": "Ok"},
        ],
        marked=False,
    )
    assert two == (
        "<bos><|turn>user\nHi<turn|>\n<|turn>model\nYes<turn|>\n<|turn>user\nOk<turn|>\n<|turn>model\n"
    )  # the thought stripped, the answer trimmed
    assert f.reasoning == ["<|channel>thought\n", "<channel|>"]
    assert f.sources["template"].endswith("verifier/tokenizer_config.json:chat_template")
    assert chat.prompt(ref["prompt"]) == ref["input_ids"] == tok.encode(prompt_text(ref["prompt"])).ids
    assert chat.prompt("Hi") == [2, 5, 453, 210, 51, 84, 6, 210, 5, 486, 210]  # <bos> <|turn> user \n H i <turn|> ...
    for text in ("Hi", " x <turn|>\n<|turn>model\n<bos>", "\n\ndef f():\n    pass", "한국어 🌍"):
        assert chat.prompt(text) == apply_chat_template_ids(MODELS / "verifier", [{"role": "user", "content": text}])


def test_verifier_reproduces_recorded_logits(monkeypatch, ref):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    v = load_verifier(MODELS / "verifier")
    ids = torch.tensor([ref["input_ids"]])
    with torch.no_grad():
        logits = v(input_ids=ids).logits[0]
    assert torch.allclose(logits[-1, :64], torch.tensor(ref["verifier_last"]), atol=ATOL)
    assert logits.argmax(-1).tolist() == ref["verifier_argmax"]
    cfg = v.config
    assert cfg.layer_types.count("full_attention") >= 1 and cfg.layer_types.count("sliding_attention") >= 1
    assert cfg.enable_moe_block and cfg.num_experts == 4 and cfg.final_logit_softcapping == 30.0
    glob = cfg.per_layer_config[cfg.layer_types.index("full_attention")]
    slid = cfg.per_layer_config[cfg.layer_types.index("sliding_attention")]
    assert (glob.head_dim, glob.num_key_value_heads) == (128, 1)
    assert (slid.head_dim, slid.num_key_value_heads) == (64, 2)


def test_head_reproduces_recorded_logits(monkeypatch, ref):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    v = load_verifier(MODELS / "verifier")
    head = load_head(MODELS / "head")
    assert head.config.backbone_hidden_size == v.config.hidden_size
    ids = torch.tensor([ref["input_ids"]])
    cap = {}
    v.model.norm.register_forward_pre_hook(lambda m, a: cap.__setitem__("h", a[0]))
    with torch.no_grad():
        out = v(input_ids=ids, return_shared_kv_states=True)
        e = v.model.embed_tokens(ids)
        t = ids.shape[1] - 1
        q = torch.tensor([[t]])
        masks = {FULL: window_mask(q, t + 1, 256), SLIDING: window_mask(q, t + 1, 128)}
        logits, _ = head_step(
            head, torch.cat([e[:, t : t + 1], cap["h"][:, t - 1 : t]], -1), out.shared_kv_states, masks, q - 1
        )
    assert torch.allclose(logits[0, 0, :64], torch.tensor(ref["head_step1"]), atol=ATOL)


def test_slm_loads_through_gemma_quantizer_bit_exact(monkeypatch, ref):
    from transformers.integrations.gemma_quant import QuantizedEmbedding, QuantizedLinear, _unpack_int2, _unpack_int4

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    slm = load_slm(MODELS / "slm")
    stored = load_file(str(MODELS / "slm" / "model.safetensors"))
    qcfg = json.loads((MODELS / "slm" / "config.json").read_text())["quantization_config"]
    assert qcfg["quant_method"] == "gemma"
    seen_bits = set()
    for name, mod in slm.named_modules():
        if isinstance(mod, QuantizedLinear):
            want = bits_for(name, configs.SLM_BIT_MAP, configs.SLM_DEFAULT_BITS)
            assert mod.num_bits == want, name
            seen_bits.add(want)
            # the integers and scales in memory are exactly the bytes the trainer wrote
            assert torch.equal(mod.weight.data, stored[f"{name}.weight"]), name
            assert torch.equal(mod.weight_scale.data, stored[f"{name}.weight_scale"]), name
            unpack = {2: _unpack_int2, 4: _unpack_int4}.get(want, lambda p, n: p)
            ints = unpack(mod.weight.data, mod.in_features)
            assert int(ints.to(torch.int16).abs().max()) <= qmax(want), name  # symmetric: [-qmax, qmax]
            assert torch.equal(mod._dequantize_weights(), ints * mod.weight_scale), name
        elif isinstance(mod, QuantizedEmbedding):
            assert mod.num_bits == configs.SLM_EMBEDDING_BITS
            assert torch.equal(mod.embedding_quantized.data, stored[f"{name}.embedding_quantized"])
    assert seen_bits == {2, 4, 8}  # a mixed bit map, like the E2B QAT checkpoint
    assert slm.config.hidden_size_per_layer_input > 0 and slm.config.num_kv_shared_layers == 2
    ids = torch.tensor([ref["input_ids"]])
    with torch.no_grad():
        logits = slm(input_ids=ids).logits[0]
    assert torch.allclose(logits[-1, :64], torch.tensor(ref["slm_last"]), atol=ATOL)
    assert logits.argmax(-1).tolist() == ref["slm_argmax"]


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_pack_matches_transformers_unpack(bits):
    from transformers.integrations.gemma_quant import _unpack_int2, _unpack_int4

    g = torch.Generator().manual_seed(bits)
    lo = -qmax(bits) - (1 if bits < 8 else 0)
    q = torch.randint(lo, qmax(bits) + 1, (7, 13), generator=g, dtype=torch.int8)
    packed = pack(q, bits)
    unpack = {2: _unpack_int2, 4: _unpack_int4, 8: lambda p, n: p}[bits]
    assert torch.equal(unpack(packed, 13).to(torch.int8), q)
    assert packed.shape[1] == {2: 4, 4: 7, 8: 13}[bits]


def test_report_meets_the_toy_family_floors():
    """The measured numbers docs/toy-family.md quotes come from report.json written by the trainer's eval stage."""
    r = json.loads((MODELS / "report.json").read_text())
    assert r["params_M"]["verifier"] < 5 and r["params_M"]["head"] < 2
    total = sum(f.stat().st_size for f in MODELS.rglob("*") if f.is_file())
    assert total <= 25 * 2**20
