"""The server-side baselines' drafting (Table 5): Cloud+MTP's K-chain by the full-precision head, and the
server-head chain over the keep set and a W window (paper Alg. 2 lines 7-12 run on the server; `hycoc.mtp.head_step`
is the one home of a head step in torch, `hycoc.mtp_chain.head_chain` the one home of the chain of steps, which the
device's MTP Drafter runs too)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import DynamicCache

from hycoc.mtp import FULL, SLIDING, head_step, window_mask
from hycoc.mtp_chain import HeadStep, head_chain

from .kv_cache import ChainStart, first_position, kv_positions


@torch.inference_mode()
def draft_cloud_chain(model, head, start: ChainStart, k: int, position_offset: int) -> list[int]:
    """Cloud+MTP drafting (Table 5): a greedy K-chain by the full-precision head over the full vocabulary.

    As transformers' ``SinglePositionMultiTokenCandidateGenerator``: input [e(root); h_{t-1}], a constant query
    position (t + position_offset; transformers uses offset 0, the paper -1), the head's own forward and masks
    (full layer: every key given; sliding layer: its own window), then [e(y_k); h'_k] fed back. Unlike it, the
    shared KV is exactly committed positions before t -- never a rejected tree row. Returns K token ids.
    """
    cache, layers, t, h = start.cache, start.layers, start.t, start.h
    if t == 0 or k == 0:
        return []
    # [0, t) of the full layer; of the sliding one its retained window [t - retain, t), which holds the head's own
    # sliding window (the head's masks count keys from the end: position invariant)
    shared = _shared_kv(
        head, cache, layers, lambda layer: max(first_position(layer), t - getattr(layer, "retain", t)), t
    )
    pos = torch.tensor([[t + position_offset]], device=h.device)

    def pick(x: torch.Tensor) -> tuple[int, torch.Tensor]:
        out = head(inputs_embeds=x, position_ids=pos, shared_kv_states=shared, use_cache=False)
        return int(out.logits[0, -1].argmax()), out.last_hidden_state[0, -1]  # greedy, first among equals

    return _greedy_chain(model, head, start.root, h, k, pick)


@torch.inference_mode()
def draft_server_chain(
    model,
    head,
    start: ChainStart,
    k: int,
    window: int,
    keep_set: torch.Tensor | None,
    position_offset: int,
    sliding: int | None = None,
) -> list[int]:
    """The server-head variant (Table 5): the head drafts a greedy K-chain for the root at position t as the
    device's Drafter would (Alg. 2) but in full precision: the full-attention layer reads the W-window
    [max(0, t - W), t), the sliding layer the last min(W, sliding) of it (as the device ring and the head's
    training), constant query position t + position_offset, logits restricted to the keep set (first among
    equals).
    keep_set: int64 (|V|,) token ids, or None for the full vocabulary. sliding: the positions the head's sliding
    layers read (`hycoc.host.head_sliding_positions`; None: the head's sliding_window). Returns K token ids."""
    t, h = start.t, start.h
    lo = max(0, t - window)
    shared = _shared_kv(head, start.cache, start.layers, lambda layer: lo, t)
    n = t - lo  # column c holds position lo + c; the query sits just after the last one
    q = torch.tensor([[n]], device=h.device)
    sliding = min(window, head.config.get_text_config().sliding_window if sliding is None else sliding)
    masks = {SLIDING: window_mask(q, n, sliding, dtype=head.dtype), FULL: window_mask(q, n, None, dtype=head.dtype)}
    pos = torch.tensor([[t + position_offset]], device=h.device)

    def pick(x: torch.Tensor) -> tuple[int, torch.Tensor]:
        logits, h_next = head_step(head, x, shared, masks, pos)
        logits = logits[0, 0]
        if keep_set is not None:
            return int(keep_set[int(logits[keep_set].argmax())]), h_next[0, 0]  # Alg. 2 lines 10-11: o over V, y = V[i]
        return int(logits.argmax()), h_next[0, 0]

    return _greedy_chain(model, head, start.root, h, k, pick)


def _shared_kv(head, cache: DynamicCache, layers: dict[str, int], start: Callable[[Any], int], t: int) -> dict:
    """The head's shared KV: for each (kind, cache layer index) of ``layers``, that layer's keys and values of
    positions [start(layer), t), in the head's dtype."""
    shared = {}
    for kind, i in layers.items():
        layer = cache.layers[i]
        keys, values = kv_positions(layer, start(layer), t)
        shared[kind] = (keys.to(head.dtype), values.to(head.dtype))
    return shared


def _greedy_chain(
    model, head, root: int, h: torch.Tensor, k: int, pick: Callable[[torch.Tensor], tuple[int, torch.Tensor]]
) -> list[int]:
    """The K-chain of both baselines (Alg. 2 lines 7-12, `hycoc.mtp_chain.head_chain`, no siblings): the head's
    input starts as [e(root); h]; each step ``pick`` maps it, shaped (1, 1, 2H) in the head's dtype, to the next
    token and the head's hidden state h', and [e(y); h'] is fed back."""

    def embed(y: int, hidden: torch.Tensor) -> torch.Tensor:
        return torch.cat([model.model.embed_tokens(torch.tensor([y], device=h.device))[0], hidden.to(h.dtype)])

    x = embed(root, h)

    def step(_k: int, _runner_up: bool) -> HeadStep:
        y, h_next = pick(x[None, None].to(head.dtype))
        return HeadStep((y,), h_next)

    def feed(y: int, h_next: torch.Tensor) -> None:
        nonlocal x
        x = embed(y, h_next)

    return head_chain(step, feed, k).chain
