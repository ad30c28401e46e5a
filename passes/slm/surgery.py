"""SLM graph surgery (paper App. A, Table 3; docs/design.md "SLM Drafter").

The SLM Drafter's checkpoint (Gemma 4 E2B's mobile QAT release; the toy family's SLM) is stored in transformers'
pre-quantized Gemma format: every linear layer packed int2/int4/int8 with a per-output-channel float32
``weight_scale`` and the bit width given by the checkpoint's ``module_quant_configs`` (``hycoc/toy/gemma_format.py``
writes it, ``transformers/integrations/gemma_quant.py`` reads it). The paper keeps the checkpoint's bit allocation
and the weights' integers and scales bit-exact, "rewrites each low-bit weight as an integer one with an explicit
encoding of its bit width", keeps the embedding tables on the CPU as lookup tables and computes the rotary tables
on the host. This pass does exactly that, reading the checkpoint through transformers (`hycoc.models.load_slm`):

* every ``QuantizedLinear`` -> `IntegerWeight`: int8 values in the bit width's range (unpacked from the packed
  storage), its float32 (out, 1) scales unchanged, its bit width, and its SRQ activation scales. Each one is
  checked on the spot: ``q * scale`` must equal transformers' own ``_dequantize_weights()`` bit for bit, else
  `SurgeryError`;
* the token and per-layer embedding tables (``QuantizedEmbedding``) -> `EmbeddingLut`: their packed bytes and
  per-row scales unchanged (8/4/2-bit as stored), looked up on the host (``EmbeddingLut.lookup``);
* the rotary embedding of each layer type -> `RotaryTable` (transformers' ``inv_freq`` and scaling): the host
  computes cos/sin rows at each row's absolute position (``RotaryTable.rows``);
* every remaining tensor (RMSNorm scales, ``layer_scalar``) -> float32 by its state-dict name.

A linear layer left in floating point (``modules_to_not_convert``) or a float embedding table breaks the
contract and raises `SurgeryError`, naming the module: the surgery never silently keeps a float weight.
RMSNorm decomposition runs on the exported graph (`hycoc.passes.rmsnorm_decomposition`), the keep-set output
layer and the ring KV are built by `hycoc.passes.slm.graph`.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.passes.artifacts import (
    EmbeddingLut,
    IntegerWeight,
    RotaryTable,
    SlmIntegerArtifact,
    SlmIntegerModel,
    unpack_signed,
)
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.bundle import sha256_file
from hycoc.recipe import Recipe

#: LUT names, by the transformers module they come from.
LUT_MODULES = {"embed_tokens": "model.embed_tokens", "embed_tokens_per_layer": "model.embed_tokens_per_layer"}
MB = 1e6


class SurgeryError(ValueError):
    """The checkpoint cannot be converted bit-exactly: a float linear layer or embedding, a bit width outside
    2/4/8, integers outside their range, or a dequantization that differs from transformers'. Names the module."""


# ---- one module at a time ------------------------------------------------------------------------------------


def integer_weight(name: str, module) -> IntegerWeight:
    """A transformers ``QuantizedLinear`` -> `IntegerWeight`, verified against its own dequantization.

    Raises SurgeryError when the bit width is not 2/4/8, the module has a bias (Gemma's have none; a bias would
    need its own encoding), a value is outside the width's range, or q * scale differs from
    ``module._dequantize_weights()`` in any bit.
    """
    import torch

    bits = int(module.num_bits)
    if bits not in (2, 4, 8):
        raise SurgeryError(f"{name}: {bits}-bit weights; the Gemma format stores 2, 4 or 8 bits")
    if module.bias is not None:
        raise SurgeryError(f"{name}: has a bias; the SLM surgery expects Gemma's bias-free linear layers")
    q = unpack_signed(module.weight.detach().cpu().numpy(), bits, module.in_features)
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if q.shape != (module.out_features, module.in_features) or q.min() < lo or q.max() > hi:
        raise SurgeryError(
            f"{name}: unpacked integers of shape {q.shape} in [{q.min()}, {q.max()}], expected "
            f"({module.out_features}, {module.in_features}) in [{lo}, {hi}]"
        )
    scale = module.weight_scale.detach().cpu().numpy().astype(np.float32, copy=True)
    ours = torch.from_numpy(q).to(torch.float32) * torch.from_numpy(scale)
    if not torch.equal(ours, module._dequantize_weights(torch.float32)):
        raise SurgeryError(f"{name}: integers * scales differ from transformers' dequantized weight")
    return IntegerWeight(
        q=q,
        scale=scale,
        bits=bits,
        input_scale=float(module.input_activation_scale.detach()),
        output_scale=float(module.output_activation_scale.detach()),
    )


def embedding_lut(name: str, module) -> EmbeddingLut:
    """A transformers ``QuantizedEmbedding`` -> `EmbeddingLut` (its storage and scales copied unchanged).

    Raises SurgeryError for a float table (``quantize_embeddings`` off) or a width other than 2/4/8.
    """
    if not hasattr(module, "embedding_quantized"):
        raise SurgeryError(
            f"{name}: a float embedding table ({type(module).__name__}); the SLM's LUTs keep the "
            "checkpoint's quantized rows (set quantize_embeddings in its quantization_config)"
        )
    bits = int(module.num_bits)
    if bits not in (2, 4, 8):
        raise SurgeryError(f"{name}: {bits}-bit embedding rows; the Gemma format stores 2, 4 or 8 bits")
    return EmbeddingLut(
        packed=module.embedding_quantized.detach().cpu().numpy().copy(),
        scale=module.embedding_scale.detach().cpu().numpy().astype(np.float32, copy=True),
        bits=bits,
        dim=int(module.embedding_dim),
        embed_scale=float(module.scalar_embed_scale),
    )


def rotary_tables(model) -> dict[str, RotaryTable]:
    """Layer type -> `RotaryTable` from the model's ``rotary_emb`` (``<type>_inv_freq`` and
    ``<type>_attention_scaling``) and the layer type's head dim."""
    rotary = model.model.rotary_emb
    config = model.config
    out = {}
    for layer_type in sorted(set(config.layer_types)):
        inv_freq = getattr(rotary, f"{layer_type}_inv_freq").detach().cpu().numpy().astype(np.float32)
        layer = config.layer_types.index(layer_type)
        out[layer_type] = RotaryTable(
            inv_freq=inv_freq,
            attention_scaling=float(getattr(rotary, f"{layer_type}_attention_scaling")),
            head_dim=int(config.per_layer_config[layer].head_dim),
        )
    return out


# ---- the whole model -----------------------------------------------------------------------------------------


def slm_surgery(model, source: dict[str, Any] | None = None) -> SlmIntegerModel:
    """A pre-quantized ``Gemma4ForCausalLM`` (loaded by `hycoc.models.load_slm`) -> `SlmIntegerModel`.

    Walks the modules in order; raises SurgeryError at the first plain ``nn.Linear`` / float embedding, or at a
    quantized module that does not convert bit-exactly (see `integer_weight`).
    """
    import torch
    from transformers.integrations.gemma_quant import QuantizedEmbedding, QuantizedLinear

    weights: dict[str, IntegerWeight] = {}
    luts: dict[str, EmbeddingLut] = {}
    owned: set[str] = set()
    lut_names = {module: lut for lut, module in LUT_MODULES.items()}
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear):
            weights[name] = integer_weight(name, module)
        elif isinstance(module, (QuantizedEmbedding, torch.nn.Embedding)):
            if name not in lut_names:
                raise SurgeryError(
                    f"{name}: an embedding the SLM graph does not know (expected {', '.join(LUT_MODULES.values())})"
                )
            luts[lut_names[name]] = embedding_lut(name, module)
        elif isinstance(module, torch.nn.Linear):
            raise SurgeryError(
                f"{name}: a floating-point nn.Linear; every SLM weight must come from the checkpoint "
                "as integers (is it listed in the quantization_config's modules_to_not_convert?)"
            )
        else:
            continue
        owned.add(name)
    if "lm_head" not in weights:
        raise SurgeryError(
            "lm_head: no quantized output layer (a tied output layer is not supported: the keep-set "
            "output layer is untied from the embedding table, App. A)"
        )
    if "embed_tokens" not in luts:
        raise SurgeryError("model.embed_tokens: no token embedding table")
    floats = {}
    for key, tensor in model.state_dict().items():
        if key.rsplit(".", 1)[0] in owned:
            continue
        floats[key] = tensor.detach().cpu().to(torch.float32).numpy().copy()
    # through JSON, as the artifact stores it (integer dict keys such as id2label's become strings)
    config = json.loads(json.dumps(model.config.to_dict()))
    return SlmIntegerModel(
        config=config, weights=weights, luts=luts, floats=floats, rotary=rotary_tables(model), source=dict(source or {})
    )


# ---- bytes ----------------------------------------------------------------------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    """config.json and the safetensors files of a checkpoint folder, sorted."""
    return [path / "config.json"] + sorted(path.glob("*.safetensors"))


def checkpoint_tensor_bytes(path: Path) -> dict[str, int]:
    """Bytes of every tensor stored in the checkpoint's safetensors files, by name (read from the headers)."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with file.open("rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, info in header.items():
            if name != "__metadata__":
                start, end = info["data_offsets"]
                out[name] = end - start
    return out


def byte_report(m: SlmIntegerModel, checkpoint: dict[str, int] | None = None) -> dict[str, Any]:
    """Bytes before (checkpoint) and after (surgery) in total and per bit width.

    Per bit width: ``modules``, ``values``, ``checkpoint_bytes`` (packed integers + scales as stored, when the
    checkpoint's tensor sizes are given), ``int8_bytes`` (the surgery's one value per byte + scales) and
    ``packed_bytes`` (values * bits / 8 + scales: what an integer NPU graph holds at that width). ``luts``: host
    LUT bytes, identical before and after. ``floats``: the float32 tensors kept.
    """
    per: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for name, w in m.weights.items():
        row = per[w.bits]
        row["modules"] += 1
        row["values"] += int(w.q.size)
        row["int8_bytes"] += int(w.q.nbytes + w.scale.nbytes)
        row["packed_bytes"] += int(-(-w.q.shape[1] * w.bits // 8) * w.q.shape[0] + w.scale.nbytes)
        if checkpoint is not None:
            row["checkpoint_bytes"] += sum(
                checkpoint.get(f"{name}.{t}", 0)
                for t in ("weight", "weight_scale", "input_activation_scale", "output_activation_scale")
            )
    luts = {name: int(lut.packed.nbytes + lut.scale.nbytes) for name, lut in m.luts.items()}
    floats = sum(int(v.nbytes) for v in m.floats.values())
    rotary = sum(int(r.inv_freq.nbytes) for r in m.rotary.values())
    after = sum(r["int8_bytes"] for r in per.values()) + sum(luts.values()) + floats + rotary
    out: dict[str, Any] = {
        "by_bits": {str(b): dict(per[b]) for b in sorted(per)},
        "luts": luts,
        "floats_bytes": floats,
        "rotary_bytes": rotary,
        "after_bytes": after,
        "npu_weight_bytes": sum(r["packed_bytes"] for r in per.values()),
    }
    if checkpoint is not None:
        out["before_bytes"] = sum(checkpoint.values())
    return out


def operate(path: str | Path) -> tuple[SlmIntegerModel, dict[str, Any]]:
    """Load the checkpoint folder ``path`` through transformers and run the surgery -> (model, byte report)."""
    from hycoc.models import load_slm

    path = Path(path)
    # content only (no absolute path): the same checkpoint anywhere gives the same artifact hash
    source = {"sha256": {p.name: sha256_file(p) for p in checkpoint_files(path)}}
    model = load_slm(path)
    result = slm_surgery(model, source)
    return result, byte_report(result, checkpoint_tensor_bytes(path))


class SlmGraphSurgery(Pass):
    """nothing -> ``slm_integer``, reading ``[models].slm`` (module docstring). The cache key holds the sha256 of
    the checkpoint's config.json and safetensors files, so a replaced checkpoint reruns the pass."""

    name = "slm_surgery"
    section = "models"
    produces = {"slm_integer": SlmIntegerArtifact}

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        path = recipe.model_path("slm")
        return {"checkpoint": {p.name: sha256_file(p) for p in checkpoint_files(path) if p.exists()}}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, SlmIntegerArtifact], PassReport]:
        result, numbers = operate(recipe.model_path("slm"))
        widths = ", ".join(f"{r['modules']} x int{b}" for b, r in numbers["by_bits"].items())
        report = PassReport(
            f"{len(result.weights)} integer weights ({widths}) bit-exact, {len(result.luts)} host LUTs; "
            f"{numbers['before_bytes'] / MB:.2f} MB checkpoint -> {numbers['after_bytes'] / MB:.2f} MB "
            f"(NPU weights at their widths {numbers['npu_weight_bytes'] / MB:.2f} MB)",
            numbers,
        )
        return {"slm_integer": SlmIntegerArtifact("slm_integer", result)}, report
