"""The verifier model and its MTP head as the engine serves them (`VerifierModel`): the settings a round reads
(hand-off window and scales, which h, the head's query offset and sliding window, the keep set), the KV geometry the
server's Opened reply and its KV budget read (`hycoc.verifier.kv_cache.KVLayout`, `kv_bytes_per_session`), and the
final-norm tap (`hycoc.verifier.forward.NormTap`). `hycoc.verifier.engine.VerifierEngine` is this plus the sessions
(paper Algorithm 4).
"""

from __future__ import annotations

import torch

from hycoc.host import head_sliding_positions
from hycoc.host import producer_layers as host_producer_layers
from hycoc.mtp import FULL, SLIDING

from .errors import BadRequest
from .forward import NormTap
from .kv_cache import DEFAULT_PREFILL_CHUNK, KVLayout, kv_bytes_per_session, retained_positions, session_cache

HIDDEN_CHOICES = ("pre_norm", "post_norm")


def producer_layers(config) -> dict[str, int]:
    """`hycoc.host.producer_layers` with the engine's error: raises BadRequest if the model lacks one of the two
    attention types."""
    try:
        return host_producer_layers(config)
    except ValueError as err:
        raise BadRequest(str(err)) from None


class VerifierModel:
    """The verifier model (and optionally its MTP head) as an engine serves it: its settings, its KV geometry and
    what a session of it holds (`hycoc.verifier.engine.VerifierEngine` adds the sessions).

    model: transformers ``Gemma4ForCausalLM`` (eval mode; its dtype and device are used as they are).
    head: ``Gemma4AssistantForCausalLM`` for the ``cloud-mtp`` and ``server-head`` baselines, else None.
    keep_set: int64 (|V|,) token ids the server head may propose (None: full vocabulary).
    head_window: W, positions of hand-off windows and of the server head's window (paper: 1,024).
    chain_length: K of the server-side chains (paper: 4).
    handoff_scales: 6 fixed int8 scales (e, h, k_sliding, v_sliding, k_full, v_full) of the hand-off.
    hidden: "pre_norm" (paper, Alg. 4 line 3) or "post_norm" (transformers' MTP generator) -- which h the
        hand-off and the server-side heads read. head_query_position_offset: the head's query position is the
        root position plus this (paper Alg. 2 line 6: -1; transformers' generator: 0).
        head_sliding_window_inclusive: the server head's sliding layer reads the last sliding_window + 1 positions
        (transformers' masks) instead of sliding_window (`hycoc.host.head_sliding_positions`; recipe ``[window]``).
    eos_token_ids: committing any of them finishes the request. chat_format: the checkpoint's
        `hycoc.chat.ChatFormat` (the server checks each OPEN's chat contract against it; None: unchecked).
        max_context: positions the verifier holds
        (default: config.max_position_embeddings). prefill_chunk: prompt positions per prefill forward.
    device: where token tensors are created (the model's device).

    Attributes for the server's Opened reply: max_context, vocab_size, hidden_size, kv_dim_sliding, kv_dim_full.
    KV: kv_retain, the committed positions a sliding layer keeps (`hycoc.verifier.kv_cache.retained_positions`);
    kv_layout, its `KVLayout`; kv_bytes_per_position, bytes of K and V one position would hold over all layers
    that store KV if every layer kept every position (the layout before sliding windows). `session_kv_bytes` is
    what the server's KV budget reserves per session, `prefill_transient_bytes` per prefilling session and
    `snapshot_bytes` per conversation snapshot; `kv_bytes_held` measures what the open sessions hold.
    """

    def __init__(
        self,
        model,
        *,
        head=None,
        keep_set: torch.Tensor | None = None,
        head_window: int,
        chain_length: int = 4,
        handoff_scales: tuple[float, ...],
        hidden: str = "pre_norm",
        head_query_position_offset: int = -1,
        eos_token_ids=(),
        max_context: int | None = None,
        device: torch.device | str = "cpu",
        prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
        chat_format=None,
        head_sliding_window_inclusive: bool = False,
    ):
        if hidden not in HIDDEN_CHOICES:
            raise BadRequest(f"hidden must be one of {HIDDEN_CHOICES}, got {hidden!r}")
        if len(handoff_scales) != 6 or any(s <= 0 for s in handoff_scales):
            raise BadRequest(f"handoff_scales needs 6 positive floats (e, h, k_s, v_s, k_f, v_f), got {handoff_scales}")
        if head_window < 1 or chain_length < 0 or prefill_chunk < 1:
            raise BadRequest("head_window and prefill_chunk must be >= 1, chain_length >= 0")
        self.model = model.eval()
        self.head = head.eval() if head is not None else None
        self.device = torch.device(device)
        self.keep_set = None if keep_set is None else torch.as_tensor(keep_set, dtype=torch.long, device=self.device)
        self.head_window = int(head_window)
        self.chain_length = int(chain_length)
        self.handoff_scales = tuple(float(s) for s in handoff_scales)
        self.hidden = hidden
        self.head_query_position_offset = int(head_query_position_offset)
        self.eos_token_ids = frozenset(int(e) for e in eos_token_ids)
        self.chat_format = chat_format
        self.prefill_chunk = int(prefill_chunk)
        cfg = model.config
        self.max_context = int(max_context or cfg.max_position_embeddings)
        self.vocab_size = int(cfg.vocab_size)
        self.hidden_size = int(cfg.hidden_size)
        self.dtype = model.dtype
        self.layers = producer_layers(cfg)
        attn = model.model.layers
        self.kv_dim_sliding = int(attn[self.layers[SLIDING]].self_attn.k_proj.out_features)
        self.kv_dim_full = int(attn[self.layers[FULL]].self_attn.k_proj.out_features)
        # K and V of every layer that stores its own KV (KV-shared layers store nothing), in the model's dtype.
        stored = [
            layer.self_attn.k_proj.out_features for layer, mode in zip(attn, cfg.kv_sharing_modes) if mode != "reuse"
        ]
        self.kv_bytes_per_position = 2 * int(sum(stored)) * torch.finfo(self.dtype).bits // 8
        self._head_sliding_window = None
        self.head_sliding: int | None = None
        if self.head is not None:
            self._head_sliding_window = self.head.config.get_text_config().sliding_window
            self.head_sliding = head_sliding_positions(self._head_sliding_window, head_sliding_window_inclusive)
        self.kv_retain = retained_positions(cfg, self.head_window, self._head_sliding_window)
        self.kv_layout = KVLayout.from_config(cfg, torch.finfo(self.dtype).bits // 8, self.kv_retain)
        self.tap = NormTap(model)

    def new_cache(self):
        """An empty session cache (`hycoc.verifier.kv_cache.session_cache`)."""
        return session_cache(self.model.config, self.kv_retain)

    def session_kv_bytes(self, positions: int, tree_rows: int) -> int:
        """KV bytes a session holds at its largest between prefills when its positions (committed plus a round's
        rows) reach ``positions`` and a round adds at most ``tree_rows`` rows
        (`hycoc.verifier.kv_cache.kv_bytes_per_session` for this engine's model, dtype, W and head); Cloud+MTP's
        root + K-chain is counted too. A prefill's chunk rows are `prefill_transient_bytes`, a conversation's
        snapshot `snapshot_bytes`."""
        return kv_bytes_per_session(
            self.model.config,
            int(positions),
            tree_rows=max(int(tree_rows), self.chain_length + 1),
            handoff_window=self.head_window,
            dtype_bytes=torch.finfo(self.dtype).bits // 8,
            head_sliding_window=self._head_sliding_window,
        )

    def prefill_transient_bytes(self) -> int:
        """KV bytes one prefilling session holds beyond `session_kv_bytes` and an APPEND's full-layer copy
        (`hycoc.verifier.kv_cache.KVLayout.prefill_transient_bytes` at this engine's max_context and chunk)."""
        return self.kv_layout.prefill_transient_bytes(self.max_context, self.prefill_chunk)

    def snapshot_bytes(self, anchor: int) -> int:
        """KV bytes of the conversation snapshot taken at position ``anchor`` (`KVLayout.snapshot_bytes`)."""
        return self.kv_layout.snapshot_bytes(anchor)

    def close(self) -> None:
        """Remove the engine's hook from the model."""
        self.tap.remove()
