"""Measuring a verifier cost model: ms of one tree-verification forward per (rows, context) on the device the model
is on (issues 6 and 7; `hycoc.bench.cost_model` holds the model and its projection).

Used by ``benchmarks/verifier_cost_model.py`` (the 26B-A4B shape on a GPU, or a recipe's verifier) and by
``hycoc bench`` (the recipe's verifier on the device in use, when no cost-model file is given). What is timed is
the engine's own `hycoc.verifier.engine.verify_tree` (Alg. 4 lines 1-3) over a random KV cache of ``context``
positions; see the script's docstring for the method.
"""

from __future__ import annotations

import statistics

from hycoc.bench.cost_model import CostModel, CostPoint


def demo_parents(rows: int, chain_length: int = 4):
    """Parent rows of an R-row tree: root, a chain of min(K, R - 1), the other rows as siblings hung on the root
    and the chain rows in turn (each row's parent is an earlier row). int64 (R,)."""
    import numpy as np

    parents = np.full(rows, -1, dtype=np.int64)
    chain = min(chain_length, rows - 1)
    for j in range(1, chain + 1):
        parents[j] = j - 1
    for j in range(chain + 1, rows):
        parents[j] = (j - chain - 1) % (chain + 1) if chain else 0
    return parents


def build_random_verifier(config_dict: dict, device: str, dtype: str):
    """transformers ``Gemma4ForCausalLM`` of ``config_dict`` with random weights (the model's own initializer),
    created directly on ``device`` in ``dtype`` (no float32 copy: 26B-A4B in float32 would not fit beside its
    bf16 copy), sdpa attention, eval mode."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig.from_dict(dict(config_dict))
    torch.manual_seed(0)
    with torch.device(device):
        model = Gemma4ForCausalLM._from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def random_cache(model, context: int, device):
    """A ``DynamicCache`` (no config: every layer keeps all positions, as the engine's) holding ``context`` random
    positions in every layer that stores KV. One 1-token forward creates the layers; their keys and values are then
    replaced by standard-normal (1, kv_heads, context, head_dim) tensors in the model's dtype."""
    import torch
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.inference_mode():
        model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
              position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), cache=cache, use_cache=True,
              logits_to_keep=1)
        gen = torch.Generator(device=device).manual_seed(context)
        for layer in cache.layers:
            if not (layer.is_initialized and layer.keys.numel()):
                continue  # KV-shared layers store nothing
            b, h, _, d = layer.keys.shape
            layer.keys = torch.randn(b, h, context, d, generator=gen, device=device, dtype=layer.keys.dtype)
            layer.values = torch.randn(b, h, context, d, generator=gen, device=device, dtype=layer.values.dtype)
    return cache


def measure_grid(model, rows_list, contexts, *, warmup: int, repeats: int, device, chain_length: int = 4,
                 log=print) -> list[CostPoint]:
    """Median ms of `verify_tree` for every (rows, context) of the grid (module docstring). Returns CostPoints in
    (context, rows) order.

    The passes are interleaved: every repetition visits every grid point once (one random cache per context, all
    alive together), so a machine whose load drifts during the run spreads that drift over the whole grid instead
    of biasing the points measured last. log(rows, context, median_ms, times) is called per point at the end.
    """
    import numpy as np
    import torch

    from hycoc.verifier.engine import NormTap, _Timer, crop_cache, verify_tree

    dev = torch.device(device)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    grid = [(t, rows) for t in contexts for rows in rows_list]
    parents = {rows: demo_parents(rows, chain_length) for rows in rows_list}
    times: dict[tuple[int, int], list[float]] = {key: [] for key in grid}
    tap = NormTap(model)
    caches = {}
    try:
        caches = {t: random_cache(model, t, dev) for t in contexts}
        for i in range(warmup + repeats):
            for t, rows in grid:
                tokens = torch.as_tensor(rng.integers(0, vocab, rows), device=dev)
                with _Timer(dev) as timer:
                    verify_tree(model, caches[t], tap, tokens, parents[rows], t, model.dtype)
                crop_cache(caches[t], t)
                if i >= warmup:
                    times[(t, rows)].append(timer.ms)
    finally:
        tap.remove()
        caches.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    points = []
    for t, rows in grid:
        ms = statistics.median(times[(t, rows)])
        log(rows, t, ms, times[(t, rows)])
        points.append(CostPoint(rows=rows, context=t, ms=ms))
    return points


def shape_of(config) -> dict:
    """The numbers of a Gemma 4 text config that set a forward's cost."""
    keys = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "global_head_dim", "num_global_key_value_heads", "sliding_window", "enable_moe_block",
            "num_experts", "top_k_experts", "moe_intermediate_size", "vocab_size", "num_kv_shared_layers")
    d = config.to_dict()  # plain values (per-layer attributes cannot be read from a heterogeneous config)
    out = {k: d[k] for k in keys if d.get(k) is not None}
    out["full_attention_layers"] = sum(lt == "full_attention" for lt in d["layer_types"])
    if d.get("per_layer_config"):
        out["per_layer_config"] = d["per_layer_config"]
    return out


def measure_recipe_verifier(recipe, rows_list=(1, 5, 33), contexts=(64, 128, 256, 512), *, warmup: int = 2,
                            repeats: int = 7, threads: int | None = None) -> CostModel:
    """A cost model of ``recipe``'s verifier (real weights, its [verifier] device and dtype) on this machine."""
    import torch

    from hycoc.models import load_verifier, set_threads

    set_threads(threads or recipe.verifier.threads)
    model = load_verifier(recipe.model_path("verifier"), dtype=recipe.verifier.dtype, device=recipe.verifier.device)
    points = measure_grid(model, list(rows_list), list(contexts), warmup=warmup, repeats=repeats,
                          device=recipe.verifier.device, chain_length=recipe.tree.chain_length,
                          log=lambda *a: None)
    name = f"{recipe.verifier.device} ({torch.get_num_threads()} threads)"
    return CostModel(device=name, dtype=recipe.verifier.dtype, model=str(recipe.models.verifier),
                     shape=shape_of(model.config), points=points, source="measured")
