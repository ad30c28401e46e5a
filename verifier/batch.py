"""Cross-session batched tree verification: the rounds of n sessions in ONE model forward (issue 14).

Every session keeps its own ``DynamicCache`` (the engine's layout, `hycoc.verifier.engine`); a batched round
stacks them for one forward and hands each session its new rows back:

    begin_round   per session (validation, the rows that fit, cloud-mtp's head chain from the session's h)
    batch_forward one forward: batch dimension = session, R_max rows each, a (n, 1, R_max, L_max + R_max) mask
    finish_round  per session, unchanged: p~ and sampling from the session's own generator, acceptance,
                  compaction, commit, hand-off (server-head's chain: per session, after it)

KV layout -- what the neighbours do and what hycoc chose. transformers' continuous batching
(``generation/continuous_batching/cache.py``) keeps one paged pool per attention type (blocks of ``block_size``
positions, read/write indices per request) and runs a flat ragged batch (all requests' tokens concatenated,
``cu_seq_lens``); vLLM's paged attention does the same with block tables; SGLang keeps a token-level pool
(``req_to_token``) behind a radix tree and verifies EAGLE trees with a custom mask in its attention kernels. All of
them need attention kernels that read through an index (paged/varlen flash attention), which transformers' Gemma 4
only gets with its continuous-batching path -- not with explicit 4-D tree masks, and not with the KV-shared
"store" layers and the positional compaction the engine relies on. hycoc therefore keeps the per-session
``DynamicCache`` (compaction, the hand-off's KV rows and the head's shared KV read it as before) and builds, per
batched forward, a right-padded batch cache: session b's [0, t_b) at columns [0, t_b) of a (n, kv_heads, L_max,
head_dim) tensor per layer that stores KV (KV-shared layers store nothing), the forward writes the R_max new rows
in place at columns [L_max, L_max + R_max) (`_SlotLayer`, preallocated: no concatenation of the stack), and each
session's first R_b of them are appended to its own cache. The mask is block-diagonal by construction (each batch entry is one session):
row j of session b sees columns [0, t_b), its ancestors and itself among the new rows (sliding layers: within
the window); padding rows see only themselves, padding columns nobody. Position ids are t_b + depth(j).

What it costs: per batched round a copy of every batched session's active KV into the padded stack, and the
append of its new rows to its own cache (a concatenation, as the single-session forward's): O(sum_b t_b) bytes
moved per round, plus attention over L_max columns for every session (padding columns are masked, not skipped). A paged
layout would avoid both; for the toy and for CPU serving that copy is small beside the forward (benchmarks/
batched_verify.py prints it). n == 1 takes exactly the single-session path (`Session.verify`'s forward).

Numerics: a session's rows in a batch see exactly the keys they see alone, but BLAS sums in another order, so
logits differ by float32 rounding (max |diff| measured in tests/test_batched_verify.py, ~1e-6 on soft-capped logits);
samples come from each session's own generator (R_b uniforms per round, never for padding rows, whatever the
batch order), so T = 0 text and seeded samples equal the session run alone.

Not thread-safe (like the engine): one call at a time per engine.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from hycoc.protocol.messages import RoundReply

from .engine import PendingRound, Session, VerifierEngine, verify_tree
from .tree import ancestor_matrix, tree_depths


@dataclass
class BatchStats:
    """What one `verify_batch` call did: rows and sessions in its forward (0 when no round needed one),
    forward_ms (the forward, incl. stacking the caches and appending the new rows back), total_ms (the call up to
    its last reply)."""

    rows: int = 0
    sessions: int = 0
    forward_ms: float = 0.0
    total_ms: float = 0.0


def batch_masks(t: torch.Tensor, pos: torch.Tensor, visible_rows: torch.Tensor, rows: torch.Tensor, length: int,
                sliding_window: int | None, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The per-session tree masks of one batched forward (Alg. 4 line 2, one block per session).

    t: int64 (n,), cached positions per session. pos: int64 (n, R), each row's position (t_b + depth). visible_rows:
    bool (n, R, R), the ancestor-or-self matrix of each session's tree, padded (padding rows see themselves only).
    rows: int64 (n,), each session's real row count R_b. length: L_max, the padded cache length (>= max t).
    Returns {"full_attention", "sliding_attention"}: (n, 1, R, L_max + R) additive masks of ``dtype`` (0 visible,
    finfo.min not): a real row sees columns [0, t_b) (key position = column) and its visible new rows (key position
    = their pos); sliding layers also need q - p < sliding_window. For one session (n = 1, L_max = t) this equals
    `hycoc.verifier.tree.additive_masks`.
    """
    device = pos.device
    n, r = pos.shape
    col = torch.arange(length, device=device)
    real = torch.arange(r, device=device)[None, :] < rows[:, None]                        # (n, R)
    cached = (col[None, None, :] < t[:, None, None]) & real[:, :, None]                  # (n, R, L)
    visible = torch.cat([cached, visible_rows], dim=-1)                                   # (n, R, L + R)
    key_pos = torch.cat([col[None, :].expand(n, length), pos], dim=-1)                    # (n, L + R)
    in_window = visible
    if sliding_window is not None:
        in_window = visible & (pos[:, :, None] - key_pos[:, None, :] < sliding_window)
    neg = torch.finfo(dtype).min

    def to_additive(ok: torch.Tensor) -> torch.Tensor:
        return torch.where(ok, 0.0, neg).to(dtype)[:, None]

    return {"full_attention": to_additive(visible), "sliding_attention": to_additive(in_window)}


def _stored_layers(engine: VerifierEngine) -> list[int]:
    """Indices of the layers that keep their own KV in a cache (every layer but the KV-shared "reuse" ones)."""
    modes = getattr(engine.model.config, "kv_sharing_modes", None) or [None] * engine.model.config.num_hidden_layers
    return [i for i, mode in enumerate(modes) if mode != "reuse"]


def _layer_kv(cache: DynamicCache, i: int, t: int):
    """Keys, values (1, kv_heads, t, head_dim) of layer i's first t positions, or None if it holds none."""
    if i >= len(cache.layers) or t == 0:
        return None
    layer = cache.layers[i]
    if not (layer.is_initialized and layer.keys.numel()):
        return None
    return layer.keys[..., :t, :], layer.values[..., :t, :]


@torch.inference_mode()
def batch_forward(engine: VerifierEngine, caches: list[DynamicCache], ts: list[int], tokens: list[np.ndarray],
                  parents: list[np.ndarray]) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Alg. 4 lines 1-3 for n sessions in one forward (module docstring: the layout and its cost).

    caches: each session's cache holding exactly its ts[b] positions. tokens, parents: each session's tree rows
    (int (R_b,), valid trees). Appends each session's R_b new rows' KV to its own cache (as `verify_tree` does).
    Returns per session (float32 logits (R_b, V), pre-norm rows (R_b, H), post-norm rows (R_b, H)).
    """
    model, dev = engine.model, engine.device
    n = len(caches)
    counts = [len(x) for x in tokens]
    r_max, length = max(counts), max(ts)
    ids = torch.zeros(n, r_max, dtype=torch.long)
    pos = torch.zeros(n, r_max, dtype=torch.long)
    visible = torch.eye(r_max, dtype=torch.bool).repeat(n, 1, 1)      # padding rows: themselves only
    for b in range(n):
        rb = counts[b]
        ids[b, :rb] = torch.as_tensor(tokens[b])
        pos[b, :] = ts[b]
        pos[b, :rb] += torch.as_tensor(tree_depths(parents[b]))
        visible[b, :rb, :rb] = torch.as_tensor(ancestor_matrix(parents[b]))
    ids, pos, visible = ids.to(dev), pos.to(dev), visible.to(dev)
    t = torch.as_tensor(ts, device=dev)
    masks = batch_masks(t, pos, visible, torch.as_tensor(counts, device=dev), length,
                        model.config.sliding_window, engine.dtype)

    # The padded batch cache: session b's [0, t_b) at columns [0, t_b) of each stored layer, the R_max new rows
    # written in place at [L_max, L_max + R_max) by the forward (`_SlotLayer`).
    stored = set(_stored_layers(engine))
    batch_cache = DynamicCache()
    for i in range(model.config.num_hidden_layers):
        parts = [_layer_kv(c, i, tb) for c, tb in zip(caches, ts)] if i in stored else [None] * n
        shape = next((p[0].shape for p in parts if p is not None), None)
        if shape is None:
            batch_cache.layers.append(DynamicLayer())   # KV-shared, or nothing cached yet (all t_b == 0)
            continue
        k = torch.zeros((n, shape[1], length + r_max, shape[3]), dtype=engine.dtype, device=dev)
        v = torch.zeros_like(k)
        for b, p in enumerate(parts):
            if p is not None:
                k[b, :, :ts[b]], v[b, :, :ts[b]] = p[0][0], p[1][0]
        batch_cache.layers.append(_SlotLayer(k, v, length))
    out = model(input_ids=ids, position_ids=pos, attention_mask=masks, cache=batch_cache, use_cache=True)

    # Each session's new rows back into its own cache (storage positions t_b .. t_b + R_b - 1).
    for i, layer in enumerate(batch_cache.layers):
        if i not in stored or not (layer.is_initialized and layer.keys.numel()):
            continue
        start = layer.length if isinstance(layer, _SlotLayer) else 0
        for b, cache in enumerate(caches):
            _append(cache, i, layer.keys[b:b + 1, :, start:start + counts[b]],
                    layer.values[b:b + 1, :, start:start + counts[b]], ts[b])
    logits, pre, post = out.logits.float(), engine.tap.pre, engine.tap.post
    return [(logits[b, :counts[b]], pre[b, :counts[b]], post[b, :counts[b]]) for b in range(n)]


class _SlotLayer(DynamicLayer):
    """A batch-cache layer over preallocated (n, kv_heads, L + R, head_dim) keys and values whose first L columns
    hold the sessions' KV: `update` writes the forward's R new rows at [L, L + R) in place and returns the whole
    tensors (a ``DynamicLayer`` would concatenate, copying the stacked KV once more)."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, length: int):
        super().__init__()
        self.keys, self.values, self.length = keys, values, length
        self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

    def update(self, key_states, value_states, *args, **kwargs):
        r = key_states.shape[-2]
        if self.length + r != self.keys.shape[-2]:
            raise ValueError(f"batch cache slot holds {self.keys.shape[-2] - self.length} new rows, the forward "
                             f"wrote {r}")
        self.keys[..., self.length:, :] = key_states
        self.values[..., self.length:, :] = value_states
        return self.keys, self.values


def _append(cache: DynamicCache, i: int, keys: torch.Tensor, values: torch.Tensor, t: int) -> None:
    """Append rows to layer i of a session's cache (which holds t positions there; creates the layer if empty)."""
    if i < len(cache.layers) and cache.layers[i].is_initialized:
        layer = cache.layers[i]
        layer.keys = torch.cat([layer.keys[..., :t, :], keys], dim=-2)
        layer.values = torch.cat([layer.values[..., :t, :], values], dim=-2)
    else:
        cache.update(keys.contiguous(), values.contiguous(), i)


def verify_batch(engine: VerifierEngine, rounds: list[tuple[Session, object, object, int]],
                 stats: BatchStats | None = None) -> list[RoundReply | BaseException]:
    """One round for each of several sessions, their forwards batched into one (Alg. 4 for each session).

    rounds: (session, tokens, parents, seq) per session, each session at most once (as `Session.verify`'s
    arguments). Returns, in order, each round's reply or the exception its session raised: a session's bad round
    (`hycoc.verifier.errors`) is answered alone and never enters the forward; a failure of the shared forward is
    every batched session's (each session restored as `Session.verify` restores it). Each reply's server_ms counts
    from the call's start to its own reply (the shared forward included: what its round cost in worker time);
    stats.total_ms is the last reply's (the whole call when no round ran). stats: filled if given.

    Raises ValueError when a session appears twice.
    """
    if len({id(s) for s, *_ in rounds}) != len(rounds):
        raise ValueError("verify_batch got the same session twice: one round per session per batch")
    stats = stats if stats is not None else BatchStats()
    start = time.perf_counter()
    results: list[RoundReply | BaseException | None] = [None] * len(rounds)
    pending: list[tuple[int, Session, PendingRound]] = []
    for k, (session, tokens, parents, seq) in enumerate(rounds):
        try:
            got = session.begin_round(tokens, parents, seq)
        except Exception as e:  # noqa: BLE001 -- that session's error, the others go on
            results[k] = e
            continue
        if isinstance(got, RoundReply):
            results[k] = got      # idempotent retry
        else:
            pending.append((k, session, got))
    if pending:
        f0 = time.perf_counter()
        try:
            if len(pending) == 1:   # one session: exactly the single-session forward
                _, session, p = pending[0]
                ids = torch.as_tensor(p.tokens, device=engine.device)
                rows = [verify_tree(engine.model, session.cache, engine.tap, ids, p.parents, p.t, engine.dtype)]
            else:
                rows = batch_forward(engine, [s.cache for _, s, _ in pending], [p.t for *_, p in pending],
                                     [p.tokens for *_, p in pending], [p.parents for *_, p in pending])
        except Exception as e:  # noqa: BLE001 -- the shared forward failed: every batched session gets it
            for k, session, p in pending:
                session.abort_round(p)
                results[k] = e
            pending, rows = [], []
        stats.forward_ms = (time.perf_counter() - f0) * 1e3
        stats.rows = sum(len(p.tokens) for *_, p in pending)
        stats.sessions = len(pending)
        for (k, session, p), row in zip(pending, rows):
            try:
                reply = session.finish_round(p, *row, timed=False)
            except Exception as e:  # noqa: BLE001 -- that session's failure only
                session.abort_round(p)
                results[k] = e
                continue
            stats.total_ms = (time.perf_counter() - start) * 1e3
            results[k] = session._stamp(reply, stats.total_ms)
    if not stats.sessions:
        stats.total_ms = (time.perf_counter() - start) * 1e3
    return results
