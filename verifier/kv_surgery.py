"""KV surgery on a session's cache (paper Alg. 4 lines 13-14): crop a cache to a position, keep a round's accepted
path by position (`compact_kv`), read a layer's rows and pack the device's hand-off at 8 bits with fixed scales.
A layer's column c holds position ``start + c`` (`hycoc.verifier.kv_cache`)."""

from __future__ import annotations

import numpy as np
import torch
from transformers import DynamicCache

from hycoc.mtp import FULL, SLIDING
from hycoc.protocol.messages import HandOff

from .kv_cache import ChainStart, first_position, kv_positions, stores_kv


def quantize_int8(x: torch.Tensor, scale: float) -> np.ndarray:
    """Symmetric int8 with a fixed scale: round-to-nearest (ties to even), clamp to [-127, 127]. Dequantize as
    ``q * scale``."""
    return torch.clamp(torch.round(x.float() / scale), -127, 127).to(torch.int8).cpu().numpy()


def layer_rows(cache: DynamicCache, layer: int, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
    """KV rows of positions [start, stop) of one layer, heads flattened: two (stop - start, kv_heads * head_dim)."""
    k, v = kv_positions(cache.layers[layer], start, stop)  # (1, kv_heads, stop - start, head_dim)

    def flat(x):
        return x[0].transpose(0, 1).reshape(stop - start, -1)

    return flat(k), flat(v)


@torch.inference_mode()
def crop_cache(cache: DynamicCache, length: int) -> None:
    """Drop every position >= length in every layer (undo a forward that did not complete a round). Raises
    ValueError if a sliding layer no longer holds position length - 1 (nothing would be left to crop to)."""
    for layer in cache.layers:
        if stores_kv(layer):
            n = length - first_position(layer)
            if n < 0:
                raise ValueError(
                    f"cannot crop to {length} positions: this layer keeps positions from {first_position(layer)}"
                )
            layer.keys, layer.values = layer.keys[..., :n, :], layer.values[..., :n, :]


@torch.inference_mode()
def compact_kv(cache: DynamicCache, t: int, path_rows: np.ndarray) -> None:
    """Alg. 4 line 13: keep positions [0, t), then the root row and the path rows at t .. t + |P|.

    Each layer holds positions [start, t) followed by the R tree rows (start > 0 in a sliding layer past its
    window). One gather per layer and tensor moves the kept rows (root row 0 and path_rows, which are increasing)
    into place; the rest is cut off. Every layer then holds [start, t + 1 + |P|).
    """
    keep = np.concatenate([[0], path_rows]).astype(np.int64)
    n = len(keep)
    on_device: dict[tuple, torch.Tensor] = {}  # one host-to-device copy of the rows per round and start
    for layer in cache.layers:
        if not stores_kv(layer):
            continue  # KV-shared layers store nothing
        c = t - first_position(layer)  # storage column of position t
        key = (layer.keys.device, c)
        idx = on_device.get(key)
        if idx is None:
            idx = on_device[key] = torch.as_tensor(keep + c, device=layer.keys.device)
        for name in ("keys", "values"):
            x = getattr(layer, name)
            x[..., c : c + n, :] = x.index_select(-2, idx)  # the gather copies first: no overlap hazard
            setattr(layer, name, x[..., : c + n, :])


@torch.inference_mode()
def pack_handoff(model, start: ChainStart, t: int, window: int, first_round: bool, scales) -> HandOff:
    """Alg. 4 line 14: H = (t', a, [e(b); h_v*], R) at 8 bits with fixed scales, for the device's chain from
    ``start``: the bonus b (``start.root``) at t' (``start.t``), h_v* (``start.h``); ``t``: the round's root position.

    a = max(t, t' - W), or max(0, t' - W) in the request's first round (its H carries up to W prompt rows).
    e is the verifier's scaled input embedding; h is the row of v* from `NormTap` (pre- or post-norm per the
    engine's ``hidden``). R: the KV rows [a, t') of the last sliding and last full-attention layer, heads
    flattened, keys rotated as cached. scales: (e, h, k_sliding, v_sliding, k_full, v_full).
    """
    cache, layers, bonus, h, t_prime = start.cache, start.layers, start.root, start.h, start.t
    a = max(0 if first_round else t, t_prime - window)
    e = model.model.embed_tokens(torch.tensor([bonus], device=h.device))[0]
    k_s, v_s = layer_rows(cache, layers[SLIDING], a, t_prime)
    k_f, v_f = layer_rows(cache, layers[FULL], a, t_prime)
    x_hat = np.concatenate([quantize_int8(e, scales[0]), quantize_int8(h, scales[1])])
    return HandOff(
        t_prime=t_prime,
        a=a,
        bonus=int(bonus),
        x_hat=x_hat,
        k_sliding=quantize_int8(k_s, scales[2]),
        v_sliding=quantize_int8(v_s, scales[3]),
        k_full=quantize_int8(k_f, scales[4]),
        v_full=quantize_int8(v_f, scales[5]),
        scales=(
            float(scales[0]),
            float(scales[1]),
            float(scales[2]),
            float(scales[3]),
            float(scales[4]),
            float(scales[5]),
        ),
    )
