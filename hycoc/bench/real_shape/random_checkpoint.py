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

    from hycoc.passes.bit_map import resolve_bits, validate

    qcfg = validate(quant_config)
    path.mkdir(parents=True, exist_ok=True)
    meta = meta_model(cfg)
    rng = np.random.default_rng(seed)
    owned: set[str] = set()
    shards = _ShardWriter(path, shard_bytes)
    by_bits: dict[str, dict[str, int]] = {}
    embeddings: dict[str, dict[str, int]] = {}
    for name, module in meta.named_modules():
        if isinstance(module, torch.nn.Linear):
            bits = resolve_bits(name, qcfg)
            nbytes = _random_linear(shards, rng, name, module, bits)
            e = by_bits.setdefault(str(bits), {"modules": 0, "values": 0, "bytes": 0})
            e["modules"] += 1
            e["values"] += module.out_features * module.in_features
            e["bytes"] += nbytes
            owned.add(name)
        elif isinstance(module, torch.nn.Embedding):
            bits = resolve_bits(name, qcfg)
            nbytes = _random_embedding(shards, rng, name, module, bits)
            embeddings[name] = {
                "rows": module.num_embeddings,
                "cols": module.embedding_dim,
                "bits": bits,
                "bytes": nbytes,
            }
            owned.add(name)
    for key, t in meta.state_dict().items():
        if key.rsplit(".", 1)[0] in owned:
            continue
        shards.put(key, torch.ones(tuple(t.shape), dtype=torch.float32))
    shards.flush()
    files = shards.files
    index: dict[str, Any] = {
        "metadata": {"total_size": int(sum((path / f).stat().st_size for f, _ in files))},
        "weight_map": {k: f for f, keys in files for k in keys},
    }
    _write_json(path / "model.safetensors.index.json", index)
    _write_json(path / "config.json", dict(cfg, quantization_config=qcfg, architectures=["Gemma4ForCausalLM"]))
    return {
        "tensors": len(index["weight_map"]),
        "files": len(files),
        "bytes": du(path),
        "by_bits": by_bits,
        "embeddings": embeddings,
    }


class _ShardWriter:
    """Tensors put in order into ``model-XXXXX.safetensors`` files under ``path``: a file is flushed when the next
    tensor would take it past ``shard_bytes`` (a tensor larger than that gets a file of its own), each written to a
    temporary name and renamed. ``files``: [(file name, [tensor names])] in order."""

    def __init__(self, path: Path, shard_bytes: int):
        self.path, self.shard_bytes = path, shard_bytes
        self.tensors: dict[str, Any] = {}
        self.size = 0
        self.files: list[tuple[str, list[str]]] = []

    def put(self, name: str, t) -> None:
        nbytes = t.numel() * t.element_size()
        if self.size and self.size + nbytes > self.shard_bytes:
            self.flush()
        self.tensors[name] = t.contiguous()
        self.size += nbytes

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.tensors:
            return
        name = f"model-{len(self.files) + 1:05d}.safetensors"
        tmp = self.path / (name + ".tmp")
        save_file(self.tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, self.path / name)
        self.files.append((name, list(self.tensors)))
        self.tensors, self.size = {}, 0


def _random_linear(shards: _ShardWriter, rng: np.random.Generator, name: str, module, bits: int) -> int:
    """A Linear's random integers at ``bits`` (packed), per-channel scales (RMS 1/sqrt(in), module docstring, each
    row's drawn in [0.8, 1.2] of that) and zero activation scales put into ``shards``; returns its weight bytes
    (packed integers + float32 scales)."""
    import torch

    from hycoc.toy.gemma_format import pack, qmax

    qm = qmax(bits)
    q = torch.from_numpy(rng.integers(-qm, qm + 1, size=(module.out_features, module.in_features), dtype=np.int8))
    scale = torch.full((module.out_features, 1), math.sqrt(3) / (qm * math.sqrt(module.in_features)))
    scale *= torch.from_numpy(rng.uniform(0.8, 1.2, (module.out_features, 1)).astype(np.float32))
    packed = pack(q, bits)
    del q
    shards.put(f"{name}.weight", packed)
    shards.put(f"{name}.weight_scale", scale.float())
    shards.put(f"{name}.input_activation_scale", torch.tensor(0.0))
    shards.put(f"{name}.output_activation_scale", torch.tensor(0.0))
    return packed.numel() * packed.element_size() + 4 * module.out_features


def _random_embedding(shards: _ShardWriter, rng: np.random.Generator, name: str, module, bits: int) -> int:
    """An Embedding's random integers at ``bits`` (packed, drawn 16,384 rows at a time) and per-row scales put into
    ``shards``; returns its bytes (packed integers + float32 scales)."""
    import torch

    from hycoc.toy.gemma_format import pack, qmax

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
    shards.put(f"{name}.embedding_quantized", packed)
    shards.put(f"{name}.embedding_scale", scale.float())
    return packed.numel() * packed.element_size() + 4 * rows


def _write_json(path: Path, data: Any) -> None:
    """``data`` as indented JSON at ``path``, written to ``path.tmp`` and renamed."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
