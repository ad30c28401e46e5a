"""Random E2B SLM checkpoints for the real-shape build check (benchmarks/real_shape_slm.py step 1, docs/real-shapes.md
"The E2B SLM at real shape") and its tests: E2B's text config cut to N layers (`slm_config`) and random integer
weights written straight into transformers' pre-quantized Gemma format (`write_random_checkpoint`).

The format: ``quant_method: gemma``, packed int2/int4/int8 + per-channel float32 ``weight_scale``, embeddings as
``embedding_quantized`` + per-row ``embedding_scale`` (`hycoc.toy.gemma_format.pack`), at the widths of a bit map
(`hycoc.passes.bit_map`). The model is never materialized in float (E2B's 5.1 G parameters would be 20 GB): the
module names and shapes come from ``Gemma4ForCausalLM`` on torch's meta device, and each tensor is drawn, packed and
written per safetensors shard (about 1 GB each, with transformers' ``model.safetensors.index.json``). Integers are
uniform in the width's range, scales sqrt(3) / (qmax sqrt(in)) so each weight has RMS 1/sqrt(in).
"""

from __future__ import annotations

import copy
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from hycoc.bench.real_shape.harness import du

#: ``--toy-dims`` (tests only): E2B's structure at toy widths. NOT real shapes.
TOY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "global_head_dim": 64,
    "vocab_size": 4096,
    "vocab_size_per_layer_input": 4096,
    "hidden_size_per_layer_input": 16,
}


def slm_config(layers: int | None, toy_dims: bool = False) -> dict[str, Any]:
    """E2B's text config (`hycoc.passes.plan.SLM_E2B`), output layer untied, cut to the first ``layers`` layers
    (KV sharing scaled to 20/35 of them, at least the last producer of each type kept). Raises ValueError for a
    layer count outside [2, 35]."""
    from hycoc.passes.plan import SLM_E2B

    d = copy.deepcopy(SLM_E2B)
    d["tie_word_embeddings"] = False
    if toy_dims:
        d.update(TOY_DIMS)
    n = len(d["layer_types"]) if layers is None else int(layers)
    if not 2 <= n <= len(d["layer_types"]):
        raise ValueError(f"--layers {n}: must lie in [2, {len(d['layer_types'])}]")
    if n < len(d["layer_types"]):
        types = d["layer_types"][:n]
        if "full_attention" not in types:
            types[-1] = "full_attention"
        d["layer_types"] = types
        d["num_hidden_layers"] = n
        shared = (n * d["num_kv_shared_layers"]) // 35
        # the shared layers need a producer of each type among the non-shared ones
        while shared and {*d["layer_types"][: n - shared]} != {*types}:
            shared -= 1
        d["num_kv_shared_layers"] = shared
    return d


def meta_model(cfg: dict[str, Any]):
    """``Gemma4ForCausalLM`` of text config ``cfg`` on torch's meta device (module names and shapes, no storage)."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    with torch.device("meta"):
        return Gemma4ForCausalLM(Gemma4TextConfig.from_dict(cfg))


def write_random_checkpoint(
    cfg: dict[str, Any], quant_config: dict[str, Any], path: Path, *, seed: int = 0, shard_bytes: int = 1 << 30
) -> dict[str, Any]:
    """Random integer weights in transformers' pre-quantized Gemma format under ``path`` (module docstring).

    cfg: Gemma 4 text config dict; quant_config: a validated ``quantization_config`` (`hycoc.passes.bit_map`).
    Writes ``config.json`` (with ``quantization_config``), ``model-XXXXX.safetensors`` shards of about
    ``shard_bytes`` and ``model.safetensors.index.json``, each to a temporary name renamed when complete.
    Returns {"tensors", "bytes", "by_bits": {bits: {"modules", "values", "bytes"}}, "embeddings": {...}}.
    """
    import torch
    from safetensors.torch import save_file

    from hycoc.passes.bit_map import resolve_bits, validate
    from hycoc.toy.gemma_format import pack, qmax

    qcfg = validate(quant_config)
    path.mkdir(parents=True, exist_ok=True)
    meta = meta_model(cfg)
    rng = np.random.default_rng(seed)
    owned: set[str] = set()
    shards: list[dict[str, torch.Tensor]] = [{}]
    sizes = [0]
    by_bits: dict[str, dict[str, int]] = {}
    embeddings: dict[str, dict[str, int]] = {}

    def put(name: str, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if sizes[-1] and sizes[-1] + nbytes > shard_bytes:
            flush()
        shards[-1][name] = t.contiguous()
        sizes[-1] += nbytes

    files: list[tuple[str, list[str]]] = []

    def flush() -> None:
        if not shards[-1]:
            return
        name = f"model-{len(files) + 1:05d}.safetensors"
        tmp = path / (name + ".tmp")
        save_file(shards[-1], str(tmp), metadata={"format": "pt"})
        os.replace(tmp, path / name)
        files.append((name, list(shards[-1])))
        shards[-1] = {}
        sizes[-1] = 0

    for name, module in meta.named_modules():
        if isinstance(module, torch.nn.Linear):
            bits = resolve_bits(name, qcfg)
            qm = qmax(bits)
            q = torch.from_numpy(
                rng.integers(-qm, qm + 1, size=(module.out_features, module.in_features), dtype=np.int8)
            )
            scale = torch.full((module.out_features, 1), math.sqrt(3) / (qm * math.sqrt(module.in_features)))
            scale *= torch.from_numpy(rng.uniform(0.8, 1.2, (module.out_features, 1)).astype(np.float32))
            packed = pack(q, bits)
            del q
            put(f"{name}.weight", packed)
            put(f"{name}.weight_scale", scale.float())
            put(f"{name}.input_activation_scale", torch.tensor(0.0))
            put(f"{name}.output_activation_scale", torch.tensor(0.0))
            e = by_bits.setdefault(str(bits), {"modules": 0, "values": 0, "bytes": 0})
            e["modules"] += 1
            e["values"] += module.out_features * module.in_features
            e["bytes"] += packed.numel() * packed.element_size() + 4 * module.out_features
            owned.add(name)
        elif isinstance(module, torch.nn.Embedding):
            bits = resolve_bits(name, qcfg)
            qm = qmax(bits)
            rows, dim = module.num_embeddings, module.embedding_dim
            packed_rows = []
            for start in range(0, rows, 16384):  # in slices: the int8 rows of a 2.3 G-value table = 2.3 GB
                stop = min(rows, start + 16384)
                q = torch.from_numpy(rng.integers(-qm, qm + 1, size=(stop - start, dim), dtype=np.int8))
                packed_rows.append(pack(q, bits))
            packed = torch.cat(packed_rows)
            del packed_rows
            scale = torch.full((rows, 1), math.sqrt(3) / (qm * math.sqrt(dim)))
            put(f"{name}.embedding_quantized", packed)
            put(f"{name}.embedding_scale", scale.float())
            embeddings[name] = {
                "rows": rows,
                "cols": dim,
                "bits": bits,
                "bytes": packed.numel() * packed.element_size() + 4 * rows,
            }
            del packed
            owned.add(name)
    for key, t in meta.state_dict().items():
        if key.rsplit(".", 1)[0] in owned:
            continue
        put(key, torch.ones(tuple(t.shape), dtype=torch.float32))
    flush()
    index: dict[str, Any] = {
        "metadata": {"total_size": int(sum((path / f).stat().st_size for f, _ in files))},
        "weight_map": {k: f for f, keys in files for k in keys},
    }
    tmp = path / "model.safetensors.index.json.tmp"
    tmp.write_text(json.dumps(index, indent=1))
    os.replace(tmp, path / "model.safetensors.index.json")
    config = dict(cfg)
    config["quantization_config"] = qcfg
    config["architectures"] = ["Gemma4ForCausalLM"]
    tmp = path / "config.json.tmp"
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, path / "config.json")
    return {
        "tensors": len(index["weight_map"]),
        "files": len(files),
        "bytes": du(path),
        "by_bits": by_bits,
        "embeddings": embeddings,
    }
