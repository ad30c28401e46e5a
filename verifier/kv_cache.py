"""The verifier's per-session KV cache: what the model needs, addressed by position (docs/design.md "Serving
many devices"; docs/verifier-kv.md: sliding-window layers keep their window plus the round's tree rows, global layers
the context).

Built on transformers' own hybrid cache: ``DynamicCache(config=...)`` dispatches each layer by its type
(``get_layer_types_and_kwargs``: ``full_attention`` -> ``DynamicLayer``, ``sliding_attention`` ->
``DynamicSlidingWindowLayer``, KV-shared "reuse" layers -> ``DummyLayer``, which stores nothing). `session_cache`
keeps that dispatch and replaces each sliding layer by a `SlidingWindowLayer`, a ``DynamicSlidingWindowLayer``
that differs in two ways the verifier needs (paper Alg. 4 line 13 and line 14):

- It trims lazily, at the start of the next ``update``, not right after appending: a round appends R tree rows,
  `hycoc.verifier.kv_surgery.compact_kv` then keeps the root and the accepted path by position and drops the rejected
  rows, and only the next forward drops what fell out of the window. transformers' layer keeps ``sliding_window - 1``
  storage rows after every update, so its rows after a tree forward would be the tree's (rejected ones included)
  instead of the committed positions; its ``activate_past_recording`` mode defers the trim to ``crop``, which can
  only cut a suffix, not keep a path.
- It keeps ``retain`` committed positions, not ``sliding_window - 1``: the hand-off carries the last W positions of
  the last sliding layer (Alg. 4 line 14: rows [a, t'), a >= t' - W), the server head reads the W-window and the
  Cloud+MTP head its own sliding window (`retained_positions`).

A layer's column c holds position ``start + c`` (``start`` is 0 for full layers); `kv_positions` and the engine's
compaction, crop and hand-off read through it. Between two forwards a sliding layer holds at most
``retain + R`` positions (R: the last round's rows); a full layer holds [0, t).

`kv_bytes_per_session` is the one formula for what a session holds at its largest between prefills (the server's
per-session KV reservation, ``max_kv_bytes``); `KVLayout.prefill_transient_bytes` what a session holds more while it
prefills (a chunk's rows and the undo copy of its sliding layers: reserved once per concurrently prefilling session,
``max_prefills``), `KVLayout.snapshot_bytes` a conversation's `WindowSnapshot`. ``hycoc inspect RECIPE`` prints all
three, and tests check them against the tensors' own bytes (`held_storage_bytes`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicSlidingWindowLayer

SLIDING = "sliding_attention"
FULL = "full_attention"
#: Positions one prefill forward adds by default (`hycoc.verifier.engine.VerifierEngine`'s ``prefill_chunk``): the
#: prefill peak of `kv_bytes_per_session`, the bench's cost-model replay and ``hycoc inspect``'s plan read it here.
DEFAULT_PREFILL_CHUNK = 512


@dataclass(frozen=True)
class ChainStart:
    """Where the next round's K-chain starts (on the server: `hycoc.verifier.baselines`; on the device: the hand-off,
    `hycoc.verifier.kv_surgery.pack_handoff`): the session's KV ``cache`` (the head reads the layers ``layers`` names by
    kind, `hycoc.mtp.FULL` / `hycoc.mtp.SLIDING` -> cache layer index), the ``root`` token at position ``t``
    (committed positions are [0, t)) and ``h``, the verifier's hidden state (H,) of position t - 1 that the head
    reads beside the root's embedding (Alg. 2 line 7)."""

    cache: DynamicCache
    layers: dict[str, int]
    root: int
    h: torch.Tensor
    t: int


class SlidingWindowLayer(DynamicSlidingWindowLayer):
    """A sliding-window cache layer compactable by position (module docstring).

    sliding_window: the attention window (a query at q sees keys p with q - p < sliding_window). retain: committed
    positions kept before a forward's new rows (>= sliding_window - 1, so the first new row sees its whole window).
    keys, values: (batch, kv_heads, held, head_dim); column c is position ``start + c``.
    """

    keys: torch.Tensor
    values: torch.Tensor

    def __init__(self, sliding_window: int, retain: int):
        super().__init__(sliding_window)
        if retain < sliding_window - 1:
            raise ValueError(
                f"retain = {retain} is below sliding_window - 1 = {sliding_window - 1}: the first "
                "new row would lose keys of its window"
            )
        self.retain = int(retain)
        self.start = 0

    @property
    def held(self) -> int:
        """Positions stored now."""
        return self.keys.shape[-2] if self.is_initialized and self.keys.dim() == 4 else 0

    def _drop_before(self, position: int, copy: bool) -> None:
        cut = position - self.start
        if cut > 0:
            self.keys, self.values = self.keys[..., cut:, :], self.values[..., cut:, :]
            if copy:  # free the dropped rows' memory now (a slice keeps its whole storage alive)
                self.keys, self.values = self.keys.clone(), self.values.clone()
            self.start = position

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Drop what lies before the window of the new rows (keep the last ``retain`` positions), then append.
        Returns the kept positions and the new rows, (batch, kv_heads, min(t, retain) + n, head_dim) each."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self._drop_before(self.start + self.held - self.retain, copy=False)
        self.keys = torch.cat([self.keys, key_states], dim=-2)
        self.values = torch.cat([self.values, value_states], dim=-2)
        self.cumulative_length = self.start + self.held
        return self.keys, self.values

    def trim(self) -> None:
        """Keep only the last ``retain`` positions now, freeing the rest (after a prefill chunk)."""
        if self.held > self.retain:
            self._drop_before(self.start + self.held - self.retain, copy=True)

    def get_seq_length(self) -> int:
        return self.start + self.held

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return min(self.held, self.retain) + query_length, self.start + max(0, self.held - self.retain)

    def reset(self) -> None:
        super().reset()
        self.start = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("crop by position with hycoc.verifier.kv_surgery.crop_cache")


@dataclass
class WindowSnapshot:
    """The sliding layers' KV at one position of a conversation (docs/serving.md "Conversations").

    position: the cache held exactly [0, position) when it was taken. layers: per sliding layer index, (keys,
    values, start): clones of what the layer held then, (batch, kv_heads, held, head_dim) each, column c at
    position start + c (its last ``retain`` positions). Taken at the model turn's opening (OPEN's / APPEND's
    ``anchor``); a later APPEND that rolls the conversation back to a point at or after ``position`` but before
    what the sliding layers still hold restores it (`restore_snapshot`) and re-prefills from ``position`` instead
    of from 0. Its bytes are `KVLayout.session_bytes`' ``snapshot`` share.
    """

    position: int
    layers: dict[int, tuple[torch.Tensor, torch.Tensor, int]]

    @property
    def nbytes(self) -> int:
        return sum(2 * k.numel() * k.element_size() for k, _, _ in self.layers.values())


def take_snapshot(cache: DynamicCache, position: int) -> WindowSnapshot:
    """A `WindowSnapshot` of every sliding layer of a cache that holds exactly [0, position) (trimmed to its
    window first)."""
    trim_windows(cache)
    layers = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, SlidingWindowLayer) and stores_kv(layer):
            layers[i] = (layer.keys.clone(), layer.values.clone(), layer.start)
    return WindowSnapshot(int(position), layers)


def snapshot_inside(cache: DynamicCache, position: int) -> WindowSnapshot:
    """The `WindowSnapshot` at ``position`` of a cache whose sliding layers hold a forward's rows past it (not yet
    trimmed: `hycoc.verifier.forward.prefill`'s ``after_forward``): each layer's last ``retain`` positions before
    ``position``, sliced out and cloned. Equal to `take_snapshot` of the cache as it was at ``position``, without
    ending a forward there. Raises ValueError when a layer no longer holds what is needed."""
    layers = {}
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, SlidingWindowLayer) and stores_kv(layer):
            lo = max(layer.start, position - layer.retain)
            if position > layer.start + layer.held:
                raise ValueError(f"snapshot at {position}: the layer holds positions up to {layer.start + layer.held}")
            a, b = lo - layer.start, position - layer.start
            layers[i] = (layer.keys[..., a:b, :].clone(), layer.values[..., a:b, :].clone(), lo)
    return WindowSnapshot(int(position), layers)


def restore_snapshot(cache: DynamicCache, snap: WindowSnapshot) -> None:
    """Put a `WindowSnapshot`'s sliding layers back (each then holds what it held at ``snap.position``). The
    snapshot's tensors are shared, not copied: every later forward replaces a layer's tensors (``torch.cat``), so
    the snapshot itself is never written."""
    for i, (k, v, start) in snap.layers.items():
        layer = cache.layers[i]
        layer.keys, layer.values, layer.start = k, v, start
        layer.cumulative_length = start + k.shape[-2]


def sliding_start(cache: DynamicCache) -> int:
    """The first position every sliding layer still holds (0 when none has dropped any, or there is none)."""
    return max([layer.start for layer in cache.layers if isinstance(layer, SlidingWindowLayer)], default=0)


def retained_positions(config, handoff_window: int, head_sliding_window: int | None = None) -> int:
    """Committed positions a sliding layer keeps: max(sliding_window - 1, W, head_sliding_window + 1).

    sliding_window - 1: the oldest key the next forward's first row attends to. W: the hand-off's and the server
    head's window. head_sliding_window + 1: what ``Gemma4AssistantForCausalLM`` reads of the shared sliding KV when
    it builds its own masks (transformers 5.24 ``create_attention_masks``: a bidirectional window over the keys,
    flipped, sees the last sliding_window + 1 of them; measured on the tiny head: the last 9 keys of window 8 give
    the logits of all keys to 1e-5, the last 8 do not). None: no head reads the verifier's KV on the server."""
    head = int(head_sliding_window) + 1 if head_sliding_window else 0
    return max(int(config.sliding_window) - 1, int(handoff_window), head)


def session_cache(config, retain: int) -> DynamicCache:
    """A new session's cache: transformers' per-layer-type dispatch of ``DynamicCache(config=config)`` with each
    sliding layer replaced by a `SlidingWindowLayer` keeping ``retain`` positions."""
    cache = DynamicCache(config=config)
    for i, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            cache.layers[i] = SlidingWindowLayer(layer.sliding_window, retain)
    return cache


def first_position(layer) -> int:
    """The position of a layer's column 0 (0 for a layer that keeps every position)."""
    return getattr(layer, "start", 0)


def stores_kv(layer) -> bool:
    """Whether a cache layer holds any KV (KV-shared and untouched layers hold none)."""
    return bool(layer.is_initialized and layer.keys is not None and layer.keys.dim() == 4 and layer.keys.numel())


def kv_positions(layer, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of positions [lo, hi) of one layer, (batch, kv_heads, hi - lo, head_dim) views. Raises
    ValueError if the layer no longer holds position lo (it fell out of a sliding layer's retained window)."""
    s = first_position(layer)
    if lo < s:
        raise ValueError(
            f"position {lo} is no longer held (this layer keeps positions from {s}); a sliding layer "
            f"keeps {getattr(layer, 'retain', 0)} positions"
        )
    return layer.keys[..., lo - s : hi - s, :], layer.values[..., lo - s : hi - s, :]


def window_start(cache: DynamicCache, t: int) -> int:
    """The first position the sliding layers attend over in the next forward after t cached positions (what
    `SlidingWindowLayer.update` keeps: max(start, t - retain)); 0 when the cache has no such layer."""
    for layer in cache.layers:
        if isinstance(layer, SlidingWindowLayer):
            return max(layer.start, t - layer.retain)
    return 0


def trim_windows(cache: DynamicCache) -> None:
    """`SlidingWindowLayer.trim` on every sliding layer."""
    for layer in cache.layers:
        if isinstance(layer, SlidingWindowLayer):
            layer.trim()


def held_bytes(cache: DynamicCache) -> int:
    """Bytes of the keys and values the cache's layers hold (the tensors' own numel x element size)."""
    return sum(2 * layer.keys.numel() * layer.keys.element_size() for layer in cache.layers if stores_kv(layer))


def storage_bytes(cache: DynamicCache) -> int:
    """Bytes of the memory the cache's tensors keep alive (their storages, each counted once): >= `held_bytes`
    when a layer is a slice of a larger tensor."""
    return held_storage_bytes(cache_tensors(cache))


def cache_tensors(cache: DynamicCache | None) -> list[torch.Tensor]:
    """The keys and values of every layer of ``cache`` that stores KV (none for None)."""
    if cache is None:
        return []
    return [x for layer in cache.layers if stores_kv(layer) for x in (layer.keys, layer.values)]


def snapshot_tensors(snap: WindowSnapshot | None) -> list[torch.Tensor]:
    """The keys and values a `WindowSnapshot` holds (none for None)."""
    return [] if snap is None else [x for k, v, _ in snap.layers.values() for x in (k, v)]


def held_storage_bytes(tensors) -> int:
    """Bytes of the memory ``tensors`` keep alive: their storages, each counted once (a snapshot restored into a
    cache shares its storage with it; a cropped layer is a view that keeps its whole storage)."""
    seen: dict[int, int] = {}
    for x in tensors:
        s = x.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def full_positions(cache: DynamicCache) -> int:
    """Positions the cache's full-attention layers hold now (0 without any)."""
    return max([layer.keys.shape[-2] for layer in cache.layers if stores_kv(layer) and not isinstance(
        layer, SlidingWindowLayer)], default=0)  # fmt: skip


@dataclass(frozen=True)
class KVLayout:
    """Bytes per position of a verifier's stored KV by attention type, and the sliding layers' retention.

    full_bytes, sliding_bytes: K + V bytes one position holds over all full-attention / sliding layers that store
    KV (KV-shared layers store none). retain: committed positions a sliding layer keeps (`retained_positions`).
    """

    full_bytes: int
    sliding_bytes: int
    retain: int

    @classmethod
    def from_config(cls, config, dtype_bytes: int, retain: int) -> KVLayout:
        """From a ``Gemma4TextConfig`` (``layer_types``, ``kv_sharing_modes``, ``per_layer_config``: kv heads and
        head dim per layer); dtype_bytes: 4 for float32, 2 for bfloat16."""
        modes = getattr(config, "kv_sharing_modes", None) or [None] * config.num_hidden_layers
        per = {SLIDING: 0, FULL: 0}
        for i, (kind, mode) in enumerate(zip(config.layer_types, modes)):
            if mode == "reuse":
                continue
            lc = config.per_layer_config[i]
            kv = 2 * int(lc.num_key_value_heads) * int(lc.head_dim) * dtype_bytes  # K and V
            per[SLIDING if kind == SLIDING else FULL] += kv
        return cls(full_bytes=per[FULL], sliding_bytes=per[SLIDING], retain=int(retain))

    @property
    def bytes_per_position(self) -> int:
        """Bytes per position if every layer kept every position (the layout before sliding windows)."""
        return self.full_bytes + self.sliding_bytes

    def session_bytes(self, context: int, tree_rows: int, prefill_chunk: int = 0, snapshot: bool = False) -> int:
        """Bytes a session holds at its largest when its positions (committed plus a forward's rows) reach
        ``context``: full layers ``context`` positions; sliding layers min(context, retain + rows) where rows is
        the larger of a round's ``tree_rows`` and ``prefill_chunk`` (0: the server's per-session reservation, whose
        prefill peak is `prefill_transient_bytes`, reserved per prefilling session); with ``snapshot``, one more
        min(context, retain) positions of the sliding layers (`snapshot_bytes` at an anchor past the window)."""
        rows = max(int(tree_rows), int(prefill_chunk))
        window = min(context, self.retain + rows)
        kept = min(context, self.retain) if snapshot else 0
        return self.full_bytes * context + self.sliding_bytes * (window + kept)

    def prefill_transient_bytes(self, max_context: int, prefill_chunk: int) -> int:
        """Bytes a prefilling session holds beyond `session_bytes` (whatever its rows) and an APPEND's full-layer
        copy: its sliding layers' ``retain`` positions plus a chunk's rows while a chunk runs, min(max_context,
        retain + prefill_chunk) positions, which also covers the copy of its sliding layers an APPEND keeps to undo
        itself (at most retain + a round's rows). Reserved once per concurrently prefilling session."""
        return self.sliding_bytes * min(int(max_context), self.retain + int(prefill_chunk))

    def snapshot_bytes(self, anchor: int) -> int:
        """Bytes of the `WindowSnapshot` taken at position ``anchor``: the sliding layers' last min(anchor, retain)
        positions (exactly what `take_snapshot` / `snapshot_inside` clone); 0 without an anchor."""
        return self.sliding_bytes * min(max(int(anchor), 0), self.retain)


def kv_bytes_per_session(
    config,
    context: int,
    *,
    tree_rows: int,
    handoff_window: int,
    dtype_bytes: int,
    head_sliding_window: int | None = None,
    prefill_chunk: int = 0,
    snapshot: bool = False,
) -> int:
    """KV bytes one verifier session holds at ``context`` positions (module docstring; `KVLayout.session_bytes`).

    config: the verifier's ``Gemma4TextConfig``. tree_rows: rows a round adds (B + 1, or K + 1 for Cloud+MTP).
    handoff_window: W. dtype_bytes: the KV dtype's size. head_sliding_window: the MTP head's own sliding window
    when a head reads the verifier's KV on the server. prefill_chunk: positions one prefill forward adds (the
    engine's ``prefill_chunk``; its rows are held until the chunk ends). snapshot: count the sliding-window snapshot
    a conversation keeps (`WindowSnapshot`). Gemma 4 26B-A4B in bfloat16 at 32,768 positions, W 1,024, 33 rows, the
    head's window of 1,024 (retain 1,025), no chunk and no snapshot: 20,480 B x 32,768 (5 global layers) +
    204,800 B x 1,058 (25 sliding layers) = 887,767,040 B; with prefill chunks of 512 and the snapshot: 20,480 B x
    32,768 + 204,800 B x (1,537 + 1,025) = 1,195,786,240 B.
    """
    retain = retained_positions(config, handoff_window, head_sliding_window)
    return KVLayout.from_config(config, dtype_bytes, retain).session_bytes(
        int(context), int(tree_rows), int(prefill_chunk), snapshot
    )
