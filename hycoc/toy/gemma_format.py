"""Write a float Gemma 4 model in transformers' pre-quantized Gemma format (``GemmaQuantizationConfig``).

The format (``transformers/integrations/gemma_quant.py``): every converted ``nn.Linear`` stores ``weight`` as
packed signed integers -- int8 as is, int4 two per byte (low nibble first, value + 8), int2 four per byte
(bits [1:0] first, value + 2) -- with a per-output-channel float32 ``weight_scale`` (out, 1) and SRQ activation
scales (0 = uncalibrated). Embeddings (``quantize_embeddings``) store ``embedding_quantized`` with per-row
scales ``embedding_scale`` (rows, 1). ``quantization_config.module_quant_configs`` maps module-name regexes to
bit widths (first match wins).

Weights are quantized per output channel, symmetric: q = clamp(round(w / s), -qmax, qmax), s = max|w| * r / qmax
with qmax = 2**(bits-1) - 1 and r the clip ratio in [0.6, 1.0] that minimizes the channel's squared error.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from hycoc.passes.bit_map import qmax


def quantize_per_channel(w: torch.Tensor, bits: int, ratios=(1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6)):
    """Symmetric per-row quantization of w (out, in) with an MSE clip search. Returns (int8 q, float32 scale
    (out,1))."""
    w = w.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8)
    best_q: torch.Tensor | None = None
    best_s: torch.Tensor | None = None
    best_err: torch.Tensor | None = None
    for r in ratios:
        s = amax * r / qmax(bits)
        q = torch.clamp(torch.round(w / s), -qmax(bits), qmax(bits))
        err = ((q * s - w) ** 2).sum(dim=1, keepdim=True)
        if best_q is None or best_s is None or best_err is None:  # the first ratio (all three are set together)
            best_q, best_s, best_err = q, s, err
        else:
            better = err < best_err
            best_q = torch.where(better, q, best_q)
            best_s = torch.where(better, s, best_s)
            best_err = torch.minimum(err, best_err)
    if best_q is None or best_s is None:
        raise ValueError("quantize_per_channel: the clip search needs at least one ratio, got none")
    return best_q.to(torch.int8), best_s.float()


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack signed integers (rows, n) into transformers' storage: int8 as is, int4/int2 into uint8 (see module doc)."""
    if bits == 8:
        return q.to(torch.int8)
    per = 8 // bits
    n = q.shape[-1]
    pad = (-n) % per
    u = (q.to(torch.int16) + 2 ** (bits - 1)).to(torch.uint8)
    if pad:
        u = torch.nn.functional.pad(u, (0, pad))
    u = u.view(*u.shape[:-1], -1, per)
    out = torch.zeros(u.shape[:-1], dtype=torch.uint8)
    for i in range(per):
        out |= u[..., i] << (bits * i)
    return out


def bits_for(name: str, bit_map: dict[str, dict], default_bits: int) -> int:
    """The bit width transformers will give module `name` (first matching regex of bit_map, else default)."""
    for pattern, opts in bit_map.items():
        if re.search(pattern, name):
            return int(opts.get("num_bits", default_bits))
    return default_bits


def to_gemma_format(model, bit_map: dict[str, dict], default_bits: int, embedding_bits: int):
    """Quantized state dict + quantization_config of a float Gemma4ForCausalLM.

    Returns (state_dict: name -> tensor, quantization_config: dict, dequantized: name -> float weight used for
    evaluation, i.e. what transformers' QuantizedLinear will compute with).
    """
    sd, deq = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            bits = bits_for(name, bit_map, default_bits)
            q, s = quantize_per_channel(module.weight, bits)
            sd[f"{name}.weight"] = pack(q, bits)
            sd[f"{name}.weight_scale"] = s
            sd[f"{name}.input_activation_scale"] = torch.tensor(0.0)
            sd[f"{name}.output_activation_scale"] = torch.tensor(0.0)
            deq[f"{name}.weight"] = q.float() * s
        elif isinstance(module, torch.nn.Embedding):
            q, s = quantize_per_channel(module.weight, embedding_bits, ratios=(1.0,))
            sd[f"{name}.embedding_quantized"] = pack(q, embedding_bits)
            sd[f"{name}.embedding_scale"] = s
            deq[f"{name}.weight"] = q.float() * s
    handled = {n.rsplit(".", 1)[0] for n in deq}
    for name, p in model.state_dict().items():
        if name.rsplit(".", 1)[0] not in handled and name not in sd:
            sd[name] = p.detach().clone()
    qcfg: dict[str, Any] = {
        "quant_method": "gemma",
        "num_bits": default_bits,
        "quantize_embeddings": True,
        "module_quant_configs": {k: dict(v) for k, v in bit_map.items()},
        "modules_to_not_convert": [],
    }
    # Embeddings take their width from module_quant_configs too: put it first so it wins.
    qcfg["module_quant_configs"] = {r"embed_tokens": {"num_bits": embedding_bits}, **qcfg["module_quant_configs"]}
    return sd, qcfg, deq


def save_prequantized(model, path: str | Path, bit_map: dict[str, dict], default_bits: int, embedding_bits: int):
    """Save `model` (float) to `path` in the pre-quantized Gemma format; returns the dequantized weights."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    sd, qcfg, deq = to_gemma_format(model, bit_map, default_bits, embedding_bits)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["quantization_config"] = qcfg
    cfg["architectures"] = [type(model).__name__]
    (path / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return deq
