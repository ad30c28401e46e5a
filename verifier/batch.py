"""Cross-session batched tree verification: the rounds of n sessions in ONE model forward whose cost follows each
session's own length.

Every session keeps its own cache (`hycoc.verifier.kv_cache`, the engine's layout); a batched round runs

    begin_round   per session (validation, the rows that fit, cloud-mtp's head chain from the session's h)
    batch_forward one forward over the sessions' rows laid end to end (a ragged batch)
    finish_round  per session, unchanged: p~ and sampling from the session's own generator, acceptance,
                  compaction, commit, hand-off (server-head's chain: per session, after it)

Layout -- what the neighbours do and what hycoc chose. transformers' continuous batching (``paged_attention`` docs,
``generation/continuous_batching``) lays every request's new tokens end to end, Q (1, sum q_b, heads, d) with
``cu_seq_lens_q`` / ``cu_seq_lens_k``, and calls flash attention's varlen kernel over a paged pool; vLLM does the
same with block tables (``flash_attn_varlen_func`` with ``seqused_k``), SGLang over a token-level pool and, for EAGLE
trees, FlashInfer's batch prefill with a custom mask. None pads a request to the longest one. The varlen kernels
take causal or sliding-window masks only, not the tree masks of Alg. 4 line 2, so hycoc takes their ragged layout
and keeps the attention per session:

- The forward's rows are every session's tree rows end to end: input_ids and position_ids (1, N), N = sum R_b (no
  padding rows). Embeddings, projections, norms, the MoE block, the rotary tables and the LM head work row by row,
  so they run once over all N rows, as in the single-session forward.
- Attention (the ``hycoc_ragged`` function registered in transformers' ``AttentionInterface``, used only inside
  `batch_forward`) splits the queries by session and calls transformers' own ``sdpa_attention_forward`` for each
  over that session's keys only -- its cached positions and its new rows, with its own tree mask (the single-session
  mask, `hycoc.verifier.tree.additive_masks`). A session's attention costs what it costs alone.
- KV: `_RaggedCache.update` hands each session's new rows to its own cache layer (``DynamicLayer`` /
  `SlidingWindowLayer` ``update``, exactly the single-session call), so nothing is stacked, copied into a padded
  tensor or copied back; the transient memory of a round is its own rows' activations.

What it costs: one Python-level attention call per session and layer (n x layers calls; a masked varlen kernel
such as FlashInfer's custom-mask prefill would fuse them on a GPU) plus what every session pays alone for its
cache update. n == 1 takes exactly the single-session path (`Session.verify`'s forward).

Numerics: a session's attention sees exactly its keys alone, with the same mask and the same kernel; the
row-wise matrix products run with N rows instead of R_b, which BLAS may sum in another order, so float32 logits
differ by rounding (max |diff| ~1e-5 on soft-capped logits, tests/test_batched_verify.py). Samples come from each
session's own generator (R_b uniforms per round, whatever the batch order), so T = 0 text and seeded samples equal
the session run alone. bfloat16 on the CPU: the batched logits equal the alone-run's bit for bit (torch's CPU bf16
matrix products accumulate each row alone; tests/test_kv_cache.py). On a GPU, cuBLAS picks its kernels (split-K)
by the row count, so bf16 logits may differ by bf16 rounding and a near-tie could flip a T = 0 token: there the
guarantee is float32 only, not measured here (no GPU).

Not thread-safe (like the engine): one call at a time per engine.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hycoc.protocol.messages import RoundReply

from .engine import PendingRound, Session, VerifierEngine, verify_tree
from .kv_cache import window_start
from .row_budget import RowBudget
from .tree import additive_masks, ancestor_matrix, tree_depths

RAGGED_ATTENTION = "hycoc_ragged"


@dataclass
class BatchStats:
    """What one `verify_batch` call did: rows and sessions in its forward (0 when no round needed one),
    forward_ms (the forward, incl. appending each session's new rows to its cache), total_ms (the call up to its
    last reply). rows_sent: the forward's rows before a row budget chose (== rows without one); rows_kept: per
    session in the forward, its rows verified; expected_tokens: with a row budget over several rounds, the kept
    rows' expected committed tokens (`hycoc.verifier.row_budget.Allocation`), else None."""

    rows: int = 0
    sessions: int = 0
    forward_ms: float = 0.0
    total_ms: float = 0.0
    rows_sent: int = 0
    rows_kept: list = field(default_factory=list)
    expected_tokens: float | None = None


class _PerSession(list):
    """One tensor per session (keys, values or masks of one layer) where transformers passes a batch tensor."""


def ragged_attention(module, query, key, value, attention_mask, *, spans=None, **kwargs):
    """Attention of a ragged batch (module docstring): query (1, heads, N, d) of the sessions' rows end to end;
    key, value, attention_mask: `_PerSession` lists, session b's (1, kv_heads, L_b + R_b, d) keys and values and its
    (1, 1, R_b, L_b + R_b) additive mask; spans: the (lo, hi) rows of each session. Returns (1, N, heads, d) and
    None, as ``sdpa_attention_forward``. Given plain tensors (a single-session forward) it is
    ``sdpa_attention_forward`` itself."""
    if not isinstance(key, _PerSession):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    outs = [
        sdpa_attention_forward(module, query[:, :, lo:hi], k, v, m, **kwargs)[0]
        for (lo, hi), k, v, m in zip(spans, key, value, attention_mask)
    ]
    return torch.cat(outs, dim=1), None


AttentionInterface.register(RAGGED_ATTENTION, ragged_attention)


class _RaggedCache:
    """The cache argument of a ragged forward: layer i's update gives each session's rows to its own cache and
    returns the per-session keys and values each session's attention reads (`ragged_attention`)."""

    def __init__(self, caches, spans):
        self.caches, self.spans = caches, spans

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = _PerSession(), _PerSession()
        for cache, (lo, hi) in zip(self.caches, self.spans):
            k, v = cache.update(key_states[:, :, lo:hi], value_states[:, :, lo:hi], layer_idx)
            keys.append(k)
            values.append(v)
        return keys, values


@contextmanager
def _attention(model, name: str):
    """Run the model with attention implementation ``name``, restoring its own afterwards."""
    before = model.config._attn_implementation
    model.config._attn_implementation = name
    try:
        yield
    finally:
        model.config._attn_implementation = before


@torch.inference_mode()
def batch_forward(
    engine: VerifierEngine, caches: list, ts: list[int], tokens: list[np.ndarray], parents: list[np.ndarray]
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Alg. 4 lines 1-3 for n sessions in one forward over their rows end to end (module docstring).

    caches: each session's cache holding exactly its ts[b] positions. tokens, parents: each session's tree rows
    (int (R_b,), valid trees). Appends each session's R_b new rows' KV to its own cache (as `verify_tree` does).
    Returns per session (float32 logits (R_b, V), pre-norm rows (R_b, H), post-norm rows (R_b, H)).
    """
    model, dev = engine.model, engine.device
    counts = [len(x) for x in tokens]
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    ids = torch.as_tensor(np.concatenate(tokens), dtype=torch.long, device=dev)
    pos, masks = [], {"full_attention": _PerSession(), "sliding_attention": _PerSession()}
    for cache, t, pa in zip(caches, ts, parents):
        p = torch.as_tensor(t + tree_depths(pa), device=dev)
        m = additive_masks(
            p,
            torch.as_tensor(ancestor_matrix(pa), device=dev),
            t,
            model.config.sliding_window,
            engine.dtype,
            window_start(cache, t),
        )
        pos.append(p)
        for kind in masks:
            masks[kind].append(m[kind])
    with _attention(model, RAGGED_ATTENTION):
        out = model(
            input_ids=ids[None],
            position_ids=torch.cat(pos)[None],
            attention_mask=masks,
            cache=_RaggedCache(caches, spans),
            use_cache=True,
            spans=spans,
        )
    logits, pre, post = out.logits[0].float(), engine.tap.pre[0], engine.tap.post[0]
    return [(logits[lo:hi], pre[lo:hi], post[lo:hi]) for lo, hi in spans]


def verify_batch(
    engine: VerifierEngine, rounds: list[tuple], stats: BatchStats | None = None, budget: RowBudget | None = None
) -> list[RoundReply | BaseException]:
    """One round for each of several sessions, their forwards batched into one (Alg. 4 for each session).

    rounds: (session, tokens, parents, seq) or (session, tokens, parents, seq, scores) per session, each session
    at most once (as `Session.verify`'s arguments; scores: float (R,) tree scores s(v) or None). budget: when given
    and more than one round shares the forward, the rows verified are chosen across the rounds
    (`hycoc.verifier.row_budget.allocate`; rounds without scores and cloud-mtp rounds are kept whole) and each
    round runs on its kept rows (`Session.restrict_round`). Returns, in order, each round's reply or the exception its
    session raised: a session's bad round (`hycoc.verifier.errors`) is answered alone and never enters the forward;
    a failure of the shared forward is every batched session's (each session restored as `Session.verify` restores
    it). Each reply's server_ms counts from the call's start to its own reply (the shared forward included: what its
    round cost in worker time); stats.total_ms is the last reply's (the whole call when no round ran). stats: filled
    if given.

    Raises ValueError when a session appears twice.
    """
    if len({id(s) for s, *_ in rounds}) != len(rounds):
        raise ValueError("verify_batch got the same session twice: one round per session per batch")
    stats = stats if stats is not None else BatchStats()
    start = time.perf_counter()
    results: list[RoundReply | BaseException | None] = [None] * len(rounds)
    pending: list[tuple[int, Session, PendingRound]] = []
    scores_of: dict[int, object] = {}
    for k, (session, tokens, parents, seq, *rest) in enumerate(rounds):
        scores_of[k] = rest[0] if rest else None
        try:
            got = session.begin_round(tokens, parents, seq)
        except Exception as e:  # noqa: BLE001 -- that session's error, the others go on
            results[k] = e
            continue
        if isinstance(got, RoundReply):
            results[k] = got  # idempotent retry
        else:
            pending.append((k, session, got))
    stats.rows_sent = sum(len(p.tokens) for *_, p in pending)
    all_scored = False
    if budget is not None and len(pending) > 1:
        all_scored = _apply_budget(pending, scores_of, budget, stats)
    stats.rows_kept = [len(p.tokens) for *_, p in pending]
    if pending:
        f0 = time.perf_counter()
        try:
            if len(pending) == 1:  # one session: exactly the single-session forward
                _, session, p = pending[0]
                ids = torch.as_tensor(p.tokens, device=engine.device)
                rows = [verify_tree(engine.model, session.cache, engine.tap, ids, p.parents, p.t, engine.dtype)]
            else:
                rows = batch_forward(
                    engine,
                    [s.cache for _, s, _ in pending],
                    [p.t for *_, p in pending],
                    [p.tokens for *_, p in pending],
                    [p.parents for *_, p in pending],
                )
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
    elif budget is not None and budget.learn and stats.expected_tokens is not None:
        done = [s for (k, s, _) in pending if isinstance(results[k], RoundReply)]
        accepted = float(sum(s.accepted[-1] for s in done)) if all_scored and len(done) == len(pending) else None
        budget.observe_step(stats.total_ms, stats.forward_ms, stats.sessions, accepted, stats.expected_tokens)
    return cast(list[RoundReply | BaseException], results)  # every slot was filled above


def _apply_budget(pending: list, scores_of: dict, budget: RowBudget, stats: BatchStats) -> bool:
    """Choose the rows of a batched forward (`hycoc.verifier.row_budget.allocate`) and restrict each round to its
    kept rows. A round's scores are those of the rows as sent; after `begin_round` left rows out for the context
    they follow those rows (``pending.kept``). Returns whether every round was scored (so the step can teach the
    budget how accepted tokens compare with expected ones)."""
    trees: list[tuple[np.ndarray | None, np.ndarray, np.ndarray]] = []
    for k, session, p in pending:
        scores = scores_of.get(k)
        if scores is None or not session.place.trimmable:
            trees.append((None, p.tokens, p.parents))
            continue
        scores = np.asarray(scores, np.float64).reshape(-1)
        if len(scores) != len(p.sent_tokens) or not np.isfinite(scores).all():
            trees.append((None, p.tokens, p.parents))  # the wire checks this; an engine caller's slip keeps it whole
            continue
        trees.append((scores if p.kept is None else scores[p.kept], p.tokens, p.parents))
    alloc = budget.choose(trees)
    for (_k, session, p), rows in zip(pending, alloc.kept):
        if rows is not None:
            session.restrict_round(p, rows)
    stats.expected_tokens = alloc.expected_tokens
    return all(scores is not None for scores, _, _ in trees)
