"""The hand-off's fixed int8 scales, measured on the verifier's own answers (paper Alg. 4 line 14: "at 8 bits with
fixed scales"; recipe ``[handoff]``).

H carries [e(b); h] and the last sliding and last full-attention layers' K/V rows as int8 with one fixed scale per
tensor kind. `measure_handoff_scales` runs the verifier greedily on calibration prompts (the head QAT's prompt
source, `hycoc.passes.head.prompts.prompt_sources`, chat-formatted), takes every position of prompt + answer, and sets
each scale to the ``percentile`` of |x| over those values divided by 127 (values beyond it saturate). Keys arrive
rotated, as the engine sends them. `hycoc calibrate-handoff RECIPE` prints the ``[handoff]`` lines to paste.
"""

from __future__ import annotations

import numpy as np

KINDS = ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full")


def measure_handoff_scales(
    recipe,
    *,
    prompts: int = 16,
    max_new_tokens: int = 256,
    percentile: float = 99.99,
    seed: int = 0,
    sample_cap: int = 2_000_000,
) -> dict[str, float]:
    """``{kind: scale}`` for the six hand-off tensors (module docstring). Raises ModelNotFoundError (missing
    verifier / tokenizer), HeadQatError (bad prompt source), ValueError for a percentile outside (0, 100]."""
    import torch
    from hycoc.passes.head.captures import greedy_answer
    from hycoc.passes.head.prompts import prompt_sources
    from hycoc.verifier.engine import producer_layers
    from hycoc.verifier.forward import NormTap
    from transformers import DynamicCache

    from hycoc.chat_template import chat_from_recipe
    from hycoc.models import load_verifier, set_threads

    if not 0 < percentile <= 100:
        raise ValueError(f"percentile {percentile}: must be in (0, 100]")
    set_threads(recipe.verifier.threads)
    chat = chat_from_recipe(recipe)  # the checkpoint's template and stop ids, before the weights
    model = load_verifier(recipe.model_path("verifier"), dtype=recipe.verifier.dtype, device=recipe.verifier.device)
    texts = prompt_sources(recipe)[0][:prompts]
    stops = chat.stop_ids
    layers = producer_layers(model.config)
    values: dict[str, list[np.ndarray]] = {k: [] for k in KINDS}
    tap = NormTap(model)
    try:
        for text in texts:
            ids = chat.prompt(text)
            seq = ids + greedy_answer(model, ids, max_new_tokens, stops)
            x = torch.tensor([seq], device=model.device)
            cache = DynamicCache()  # no config: every layer keeps every position (the scales see all of them)
            with torch.inference_mode():
                model(input_ids=x, cache=cache, use_cache=True)
            with torch.inference_mode():
                e = model.model.embed_tokens(x)
            values["embedding"].append(e.float().abs().flatten().cpu().numpy())
            values["hidden"].append(tap.pre.float().abs().flatten().cpu().numpy())
            for kind, short in (("sliding_attention", "sliding"), ("full_attention", "full")):
                layer = cache.layers[layers[kind]]
                values[f"k_{short}"].append(layer.keys.float().abs().flatten().cpu().numpy())
                values[f"v_{short}"].append(layer.values.float().abs().flatten().cpu().numpy())
    finally:
        tap.remove()
    rng = np.random.default_rng(seed)
    scales = {}
    for kind, parts in values.items():
        v = np.concatenate(parts)
        if len(v) > sample_cap:
            v = rng.choice(v, sample_cap, replace=False)
        scales[kind] = float(np.percentile(v, percentile) / 127) or 1e-6
    return scales


def toml_lines(scales: dict[str, float], percentile: float, prompts: int) -> str:
    """The ``[handoff]`` scale lines for a recipe, with a comment saying how they were measured."""
    lines = [
        f"# [handoff] scales measured by `hycoc calibrate-handoff`: {percentile}th percentile of |x| / 127 over "
        f"the verifier's own answers to {prompts} calibration prompts (replace the scale_* keys with these)"
    ]
    lines += [f"scale_{k} = {scales[k]:.6g}" for k in KINDS]
    return "\n".join(lines)
