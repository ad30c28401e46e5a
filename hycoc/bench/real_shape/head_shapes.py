"""The MTP head at real shape for its build check (benchmarks/real_shape_head.py; docs/compiler.md,
docs/real-shapes.md): the ASSUMED Gemma 4 26B-A4B assistant config cut to N layers (`head_config`), synthetic
calibration inputs (`synthetic_feeds`), one attention block per layer kind (`attention_block_class`, `block_feeds`,
`sub_head`) and the report's shapes (`report_shapes`).

Calibration inputs are SYNTHETIC but plausible (no verifier): x_hat = [e; h] with e ~ N(0, 1) and h ~ N(0, 2) plus a
few large outlier channels (x40; Gemma's residual stream), keys/values ~ N(0, 1) (k_norm/v_norm outputs), ring masks
from `hycoc.host.ring_masks` for ring fills from a quarter ring to a full wrapped ring, rotary rows from
`hycoc.passes.head.graph.rotary_rows` at t - 1.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import numpy as np

#: ``--toy-dims`` (tests only): the same structure at toy widths, so the whole chain runs in seconds. NOT real shapes.
TOY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_global_key_value_heads": 1,
    "global_head_dim": 64,
    "vocab_size": 4096,
}
TOY_BACKBONE = 96


def head_config(layers: int | None, toy_dims: bool = False):
    """The ASSUMED real-shape head config (`hycoc.passes.plan.HEAD_ASSUMED`), cut to the first ``layers``.

    transformers' Gemma 4 config forces the last layer to full attention, so ``layers`` 1 gives [full] and 2 gives
    [sliding, full]. ``toy_dims``: `TOY_DIMS` widths (tests only)."""
    from transformers import Gemma4AssistantConfig

    from hycoc.passes.plan import HEAD_ASSUMED

    d = copy.deepcopy(HEAD_ASSUMED)
    text = d["text_config"]
    if toy_dims:
        text.update(TOY_DIMS)
        d["backbone_hidden_size"] = TOY_BACKBONE
    n = len(text["layer_types"]) if layers is None else int(layers)
    if not 1 <= n <= len(text["layer_types"]):
        raise ValueError(f"--layers {n}: the assumed head has {len(text['layer_types'])} layers")
    text["layer_types"] = text["layer_types"][: n - 1] + [text["layer_types"][-1]]
    text["num_hidden_layers"] = n
    text["num_kv_shared_layers"] = n
    return Gemma4AssistantConfig.from_dict(d), text


def synthetic_feeds(config, text: dict, window: int, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``count`` head graph inputs (`hycoc.passes.head.graph.INPUT_NAMES`, float32) from random-but-plausible values
    (module docstring): config, the assistant config; text, its text config as a dict (`head_config`); window, W."""
    from hycoc.mtp import FULL, SLIDING
    from hycoc.passes.head.graph import INPUT_NAMES, ring_masks, rotary_rows

    H = int(config.backbone_hidden_size)
    kv_s, d_s = int(text["num_key_value_heads"]), int(text["head_dim"])
    kv_f, d_f = int(text["num_global_key_value_heads"]), int(text["global_head_dim"])
    sliding_window = int(text["sliding_window"])
    # rotary rows from the 4-layer config: `rotary_rows` needs both layer types in the config (with --layers 1 the
    # head is [full] only); the rows depend only on the rope parameters and head dims, which are the same
    rotary_config = config
    if len(set(text["layer_types"])) < 2:
        rotary_config = head_config(None, int(text["hidden_size"]) == TOY_DIMS["hidden_size"])[0]
    rng = np.random.default_rng(seed)
    outliers = rng.choice(H, size=max(1, H // 512), replace=False)
    out = []
    for i in range(count):
        # ring fill from a quarter ring to a full, wrapped ring
        fill = window // 4 + (i * (window - window // 4)) // max(1, count - 1) if count > 1 else window
        t = fill if fill < window else window + 37 + i
        masks = ring_masks(t, 0, window, sliding_window)
        rot = rotary_rows(rotary_config, t - 1)
        e = rng.standard_normal(H).astype(np.float32)
        h = 2.0 * rng.standard_normal(H).astype(np.float32)
        h[outliers] *= 40.0
        x_hat = np.concatenate([e, h])[None, None]
        values = {
            "x_hat": x_hat,
            "k_sliding": rng.standard_normal((1, kv_s, window, d_s), dtype=np.float32),
            "v_sliding": rng.standard_normal((1, kv_s, window, d_s), dtype=np.float32),
            "k_full": rng.standard_normal((1, kv_f, window, d_f), dtype=np.float32),
            "v_full": rng.standard_normal((1, kv_f, window, d_f), dtype=np.float32),
            "mask_sliding": masks[SLIDING],
            "mask_full": masks[FULL],
            "cos_sliding": rot[SLIDING][0].numpy(),
            "sin_sliding": rot[SLIDING][1].numpy(),
            "cos_full": rot[FULL][0].numpy(),
            "sin_full": rot[FULL][1].numpy(),
        }
        out.append({n: np.ascontiguousarray(values[n], dtype=np.float32) for n in INPUT_NAMES})
    return out


def attention_block_class():
    """The ``AttentionBlock`` module class (torch imported when called): a head's pre-projection and one decoder layer
    over the ring of one layer kind."""
    from torch import nn

    class AttentionBlock(nn.Module):
        """Pre-projection + one decoder layer of the head reading the W-column ring of one layer kind (the head
        graph cut to its first layer of that kind): inputs x_hat, k, v, mask, cos, sin; output ``h_block``."""

        def __init__(self, graph, index: int):
            super().__init__()
            self.pre_projection = graph.pre_projection
            self.layer = graph.layers[index]
            self.kind = graph.layer_types[index]
            self.requires_grad_(False)

        def forward(self, x_hat, k, v, mask, cos, sin):
            x = self.pre_projection(x_hat)
            return self.layer(
                x, None, shared_kv_states={self.kind: (k, v)}, position_embeddings=(cos, sin), attention_mask=mask
            )

    return AttentionBlock


def block_feeds(feeds: list[dict[str, np.ndarray]], suffix: str) -> list[dict[str, np.ndarray]]:
    """The head graph's inputs ``feeds`` as an attention block of kind ``suffix`` (sliding, full) reads them:
    `BLOCK_INPUTS`."""
    return [
        {
            "x_hat": f["x_hat"],
            "k": f[f"k_{suffix}"],
            "v": f[f"v_{suffix}"],
            "mask": f[f"mask_{suffix}"],
            "cos": f[f"cos_{suffix}"],
            "sin": f[f"sin_{suffix}"],
        }
        for f in feeds
    ]


BLOCK_INPUTS = ("x_hat", "k", "v", "mask", "cos", "sin")


def sub_head(qhead, prefixes: tuple[str, ...]):
    """The QuantizedHead restricted to the linears under ``prefixes`` (for a block's `head_weight_arrays`)."""
    keep = [n for n in qhead.qweight if n.startswith(prefixes)]
    return dataclasses.replace(
        qhead, qweight={n: qhead.qweight[n] for n in keep}, scale={n: qhead.scale[n] for n in keep}
    )


def report_shapes(args, text: dict | None) -> dict[str, Any]:
    """The report's ``shapes``: from the built head's text config ``text`` (None: the assumed one, the build having
    failed) and the check's arguments (keep set, window, layers, toy dims)."""
    from hycoc.passes.plan import HEAD_ASSUMED

    t = text or HEAD_ASSUMED["text_config"]
    backbone = TOY_BACKBONE if args.toy_dims else int(HEAD_ASSUMED["backbone_hidden_size"])
    return {
        "real_shapes": not args.toy_dims,
        "keep_set": args.keep_set,
        "window": args.window,
        "layers": int(t["num_hidden_layers"]) if text else (args.layers or 4),
        "layer_types": t["layer_types"],
        "head_hidden": t["hidden_size"],
        "intermediate": t["intermediate_size"],
        "query_heads": t["num_attention_heads"],
        "vocab": t["vocab_size"],
        "backbone_hidden": backbone,
        "x_hat": 2 * backbone,
        "kv_sliding": [t["num_key_value_heads"], t["head_dim"]],
        "kv_full": [t["num_global_key_value_heads"], t["global_head_dim"]],
    }
