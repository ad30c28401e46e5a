"""The verifier engine: prefill, then one round per draft tree (paper Algorithm 4, §3.5, App. B, Table 5).

The model is transformers' ``Gemma4ForCausalLM``, called with explicit 4-D tree masks (a dict, which
``Gemma4TextModel`` takes as is) and explicit position ids; nothing of Gemma is re-implemented. A round reads as
its algorithm lines:

    verify_tree    (lines 1-3)   one forward over the R = B + 1 rows, row j at position t + depth(j)
    sampling_probs (line 5)      p~ per row; sample_rows draws y^_j from the session's seeded generator
    select_path    (lines 6-12)  exact or epsilon-threshold acceptance, v*, bonus b
    compact_kv     (line 13)     keep [0, t) + root + path at positions t .. t + |P|, drop the other rows
    pack_handoff   (line 14)     H = (t', a, [e(b); h_v*], KV rows [a, t') of two layers), int8, fixed scales

The cache is `hycoc.verifier.kv_cache.session_cache`: transformers' hybrid ``DynamicCache(config=...)`` whose
sliding layers keep their window (plus the round's rows) and stay compactable by position, and whose global layers
keep the context. A layer's column c holds position ``start + c``; the masks cover exactly the keys each layer type
returns (`additive_masks`' ``sliding_start``). The sliding layers keep enough positions
(`hycoc.verifier.kv_cache.retained_positions`) that the hand-off and the server-side heads read what they read
from a full-length cache.

h, "the last hidden state before the final norm" (Alg. 4 line 3): transformers' ``hidden_states[-1]`` is NOT that
tensor -- ``capture_outputs(tie_last_hidden_states=True)`` overwrites it with the post-norm ``last_hidden_state``.
`NormTap` therefore hooks ``model.model.norm`` and keeps its input (pre-norm, ``hidden="pre_norm"``, the paper's
choice) and its output (post-norm, ``hidden="post_norm"``, what transformers' own MTP generator feeds the head).

Server-side baselines (Table 5): ``cloud-mtp`` drafts a K-chain with the head itself each round (`draft_cloud_chain`)
and verifies root + chain exactly; ``server-head`` runs the head over the keep set and a W window after each round
(`draft_server_chain`) and returns that chain instead of a hand-off.

Batched verification (docs/serving.md "Many devices: batched verification", `hycoc.verifier.batch`) runs the same
round in three parts per session: `Session.begin_round` (checks, the rows that fit, cloud-mtp's chain), one forward
shared by several sessions, then `Session.finish_round` (lines 5-14 and the commit, unchanged); `Session.verify` is
those three for one session. Prefills run as `PrefillJob` chunks so a scheduler can interleave them with rounds.

The model's settings, KV geometry and per-session KV bytes are `hycoc.verifier.model.VerifierModel` (the engine's
base); how an APPEND checks the next turn and rolls the KV back is `hycoc.verifier.append`.

Not thread-safe: run one call at a time per engine (one worker thread for all its sessions).
"""

from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache

from hycoc.chat import common_prefix
from hycoc.protocol.messages import (
    ACCEPTANCE_MODES,
    DEFAULT_ACCEPTANCE,
    DEFAULT_DRAFT_PLACE,
    DEFAULT_EPSILON,
    DEFAULT_MAX_NEW_TOKENS,
    DEFAULT_SAMPLING,
    DEFAULT_SEED,
    DRAFT_PLACES,
    RoundReply,
    Sampling,
    commit_cut,
)
from hycoc.protocol.wire import PROTOCOL_VERSION

from . import append as append_turn
from .baselines import draft_cloud_chain, draft_server_chain
from .draft_place import PLACES, DraftPlace

if TYPE_CHECKING:
    from .allowance import AllowanceRule
from .errors import (
    BadRequest,
    ContextOverflow,
    NotPrefilled,
    SequenceError,
    SessionFinished,
)
from .forward import Timer
from .kv_cache import ChainStart, WindowSnapshot, cache_tensors, held_storage_bytes, snapshot_tensors
from .kv_surgery import compact_kv, crop_cache, pack_handoff
from .model import VerifierModel
from .model import producer_layers as producer_layers  # re-exported: callers import it from here
from .prefill_job import AppendPlan, PrefillJob
from .round_steps import PendingRound, accept, ancestor_closed, check_round_tree, verify_tree
from .tree_rows import fitting_rows, remap_parents, widen_reply

# -------------------------------------------------------------------------------------------- engine, session


class VerifierEngine(VerifierModel):
    """One verifier model (and optionally its MTP head) serving many sessions: a `VerifierModel` (its arguments and
    attributes: model, head, keep set, W, K, hand-off scales, which h, EOS ids, chat format, max_context, prefill
    chunk, device; the KV geometry and `session_kv_bytes`) that opens `Session`s and measures the KV they hold
    (`kv_bytes_held`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._sessions: dict[int, weakref.ref] = {}  # every session opened and not yet garbage, by id
        self._sessions_lock = threading.Lock()  # open() runs on the event loop, kv_bytes_held() on the worker

    def live_sessions(self) -> list[Session]:
        """The sessions opened on this engine that still exist (closed ones included until they are garbage)."""
        with self._sessions_lock:
            alive = {k: r() for k, r in self._sessions.items()}
            for k in [k for k, s in alive.items() if s is None]:
                del self._sessions[k]
        return [s for s in alive.values() if s is not None]

    def kv_bytes_held(self) -> int:
        """Bytes of KV memory every session of this engine keeps alive now: caches, conversation snapshots and
        an APPEND's undo copy (`Session.kv_tensors`), each storage counted once. What the server's
        ``hycoc_kv_bytes_held`` reports and its KV reservation must cover."""
        return held_storage_bytes([x for s in self.live_sessions() for x in s.kv_tensors()])

    def open(
        self,
        prompt_ids,
        sampling: Sampling = DEFAULT_SAMPLING,
        seed: int = DEFAULT_SEED,
        acceptance: str = DEFAULT_ACCEPTANCE,
        epsilon: float = DEFAULT_EPSILON,
        draft_place: str = DEFAULT_DRAFT_PLACE,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        anchor: int = 0,
    ) -> Session:
        """A new request (nothing runs yet: call ``Session.prefill``). anchor: where the prompt's model turn opens
        (`hycoc.chat.Rendered.anchor`; 0: none). Raises BadRequest for an invalid field, ContextOverflow if the
        prompt leaves no room for one output token (len(prompt) >= max_context: every token, prompt or output,
        holds one of the verifier's max_context positions)."""
        prompt = np.asarray(prompt_ids, dtype=np.int64).reshape(-1)
        if len(prompt) == 0:
            raise BadRequest("prompt_ids is empty; it needs at least the first root token")
        if prompt.min() < 0 or prompt.max() >= self.vocab_size:
            raise BadRequest(f"prompt token ids must be in [0, {self.vocab_size})")
        if len(prompt) >= self.max_context:
            raise ContextOverflow(
                f"prompt of {len(prompt)} tokens leaves no room for output in the verifier's "
                f"context of {self.max_context} positions; shorten it to at most "
                f"{self.max_context - 1} tokens"
            )
        if acceptance not in ACCEPTANCE_MODES:
            raise BadRequest(f"acceptance must be one of {ACCEPTANCE_MODES}, got {acceptance!r}")
        if draft_place not in DRAFT_PLACES:
            raise BadRequest(f"draft_place must be one of {DRAFT_PLACES}, got {draft_place!r}")
        if not 0.0 < epsilon <= 1.0:
            raise BadRequest(f"epsilon must be in (0, 1], got {epsilon}")
        if sampling.temperature < 0 or sampling.top_k < 1 or not 0.0 < sampling.top_p <= 1.0:
            raise BadRequest(f"invalid sampling {sampling}: need temperature >= 0, top_k >= 1, 0 < top_p <= 1")
        if max_new_tokens < 1:
            raise BadRequest(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if PLACES[draft_place].needs_head and self.head is None:
            raise BadRequest(f"draft_place {draft_place!r} needs the verifier's MTP head, and none is loaded")
        if not 0 <= int(anchor) < len(prompt):
            raise BadRequest(f"anchor must be in [0, {len(prompt)}) (a prompt position), got {anchor}")
        session = Session(
            self,
            prompt,
            sampling,
            int(seed),
            acceptance,
            float(epsilon),
            draft_place,
            int(max_new_tokens),
            anchor=int(anchor),
        )
        with self._sessions_lock:
            self._sessions[id(session)] = weakref.ref(session)
        return session


@dataclass
class _Retry:
    seq: int
    tokens: np.ndarray
    parents: np.ndarray
    reply: RoundReply


@dataclass
class Session:
    """One request's state: the KV cache of [0, t), the committed tokens and the seeded sampler.

    tokens: prompt + committed output; its last entry is the next root x_{t+1}, at position t (len == t + 1
    until the request finishes: the final round's output is then cut after the EOS / at max_new_tokens / at
    max_context). anchor: where the prompt's model turn opens (OPEN's ``anchor``; 0: none): the prefill snapshots
    the sliding layers there (``snapshot``), so a later APPEND can roll back to it without re-prefilling from 0.
    accepted: tokens committed per round minus one, i.e. |P| after that cut (MAT = mean(accepted) + 1 = committed tokens
    / rounds). rounds: completed rounds. server_ms: per round. finish_reason: one of FINISH_REASONS once finished.
    wire_version: the protocol version its replies are encoded in (the server sets its client's OPEN version;
    docs/design.md "Wire protocol"). tree_rows: the most rows a round may hold (OPENED's; 0: not checked, an
    engine used without a server). allowance: the rows the next round may hold, the last reply's grant (`grant`;
    the server resets it to tree_rows at OPEN and APPEND; 0: not checked).
    """

    engine: VerifierEngine = field(repr=False)
    prompt: np.ndarray = field(repr=False)
    sampling: Sampling
    seed: int
    acceptance: str
    epsilon: float
    draft_place: str
    max_new_tokens: int
    tokens: list[int] = field(default_factory=list)
    t: int = 0
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    server_ms: list[float] = field(default_factory=list)
    prefill_ms: float | None = None
    finished: bool = False
    finish_reason: str | None = None
    wire_version: int = PROTOCOL_VERSION
    anchor: int = 0
    tree_rows: int = 0
    allowance: int = 0

    def __post_init__(self):
        self.tokens = [int(x) for x in self.prompt]
        self.turn_start = len(self.tokens)  # where the current turn's output begins
        self.turns_prefill_ms: list[float] = []  # prefill ms of each appended turn (`append`)
        self.appends: list[AppendPlan] = []  # how each APPEND rolled the conversation back
        self.snapshot: WindowSnapshot | None = None  # sliding layers at the last model turn's opening
        self.undo: tuple | None = None  # what an APPEND in flight keeps to undo itself (`kv_tensors`)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.cache: DynamicCache | None = None
        self._h: torch.Tensor | None = None  # h of position t - 1 (pre- or post-norm per engine.hidden)
        self._last: _Retry | None = None

    @property
    def place(self) -> DraftPlace:
        """The session's draft place (`hycoc.verifier.draft_place`): what its rounds hold and what follows them."""
        return PLACES[self.draft_place]

    def grant(self, reply: RoundReply, rule: AllowanceRule | None = None) -> RoundReply:
        """The reply of the round just finished with the next round's allowance (protocol 6: the rows it may hold,
        in [1, tree_rows], `DraftPlace.allowance` with the server's ``rule``, None for the whole tree; a finished
        reply grants 0), recorded here so the next round is checked against it (`OverAllowance`) and in the retry
        record so a resent round gets the same reply. A session without tree_rows (an engine used without a server)
        grants as many rows as the round just verified held."""
        limit = self.tree_rows or (len(self._last.tokens) if self._last is not None else 1)
        allowance = 0 if reply.finished else self.place.allowance(rule, limit)
        self.allowance = allowance
        reply = replace(reply, allowance=allowance)
        if self._last is not None and self._last.seq == reply.seq:
            self._last.reply = reply
        return reply

    @property
    def output(self) -> list[int]:
        """Committed tokens after the prompt."""
        return self.tokens[len(self.prompt) :]

    @property
    def root(self) -> int:
        return self.tokens[-1]

    def prefill(self) -> tuple[float, int]:
        """Prefill prompt[:-1] (positions [0, t)); the last prompt token is the first root at position t.

        Returns (prefill_ms, t). Idempotent: a second call returns the first result.
        """
        if self.prefill_ms is not None:
            return self.prefill_ms, self.t
        return self.prefill_job().run()

    def prefill_job(self) -> PrefillJob:
        """The prefill of `prefill` as a `PrefillJob` a scheduler can run one chunk at a time between other
        sessions' rounds (its chunks are exactly `prefill`'s, with one boundary at ``anchor`` where the sliding
        layers are snapshotted). Raises SessionFinished if already prefilled."""
        if self.prefill_ms is not None or self.cache is not None:
            raise SessionFinished("this session is already prefilled (or being prefilled)")
        eng = self.engine
        self.cache = eng.new_cache()
        ids = torch.as_tensor(self.prompt[:-1], device=eng.device)

        def done(last, ms: float) -> tuple[float, int]:
            self.t = len(ids)
            self._h = None if last is None else last[0 if eng.hidden == "pre_norm" else 1]
            self.prefill_ms = ms
            return self.prefill_ms, self.t

        def keep(snap: WindowSnapshot) -> None:
            self.snapshot = snap

        def abort() -> None:  # a failed prefill holds nothing: the session may be prefilled again
            self.cache, self.snapshot = None, None

        anchor = self.anchor if 0 < self.anchor <= len(ids) else None
        return PrefillJob(eng, self.cache, ids, 0, done, snapshot_at=anchor, on_snapshot=keep, abort=abort)

    def kv_tensors(self) -> list[torch.Tensor]:
        """Every KV tensor the session keeps alive: its cache's, its snapshot's and, while an APPEND runs, the
        undo copy's (the checkpoint, the old cache of a full re-prefill, the old snapshot). The worker thread reads
        them between its own steps."""
        out = cache_tensors(self.cache) + snapshot_tensors(self.snapshot)
        undo = self.undo
        if undo is not None:
            checkpoint, old_cache, old_snapshot = undo
            out += (checkpoint.tensors() if checkpoint is not None else []) + cache_tensors(old_cache)
            out += snapshot_tensors(old_snapshot)
        return out

    # ---------------------------------------------------------------------------------- the next turn (APPEND)

    def kv_held(self) -> int:
        """Positions [0, n) whose KV the cache holds for the committed ids (`hycoc.verifier.append.kv_held`)."""
        return append_turn.kv_held(self)

    def plan_append(self, turn_ids, keep: int, keep_crc: int | None = None) -> AppendPlan:
        """Check an APPEND and decide its rollback without changing anything (`hycoc.verifier.append.plan_append`:
        its arguments, the rollback kinds and what it raises)."""
        return append_turn.plan_append(self, turn_ids, keep, keep_crc)

    def append(
        self, turn_ids, max_new_tokens: int, *, keep: int, keep_crc: int | None = None, anchor: int = 0
    ) -> tuple[float, int]:
        """Continue the conversation with its next turn (paper §4.1, MT-bench's second turns) as the template
        renders the whole conversation (docs/serving.md "Conversations"): keep the first ``keep`` held ids,
        roll the KV back (`plan_append`), prefill the rest of ``turn_ids`` but its last id, which becomes the next
        root. anchor: where the new model turn opens (in [keep, keep + T) or 0): the sliding layers are snapshotted
        there. max_new_tokens: the new turn's output cap. Rounds count seq from 0 again (the first hand-off
        carries the W-window, like a new request's). All or nothing: a failure in any chunk leaves the session
        exactly as it was. Returns (prefill_ms of this append, t). Raises what `plan_append` raises, BadRequest
        for max_new_tokens < 1 or an anchor outside the turn."""
        return self.append_job(turn_ids, max_new_tokens, keep=keep, keep_crc=keep_crc, anchor=anchor).run()

    def continue_with(self, conversation_ids, max_new_tokens: int, anchor: int = 0) -> tuple[float, int]:
        """`append` from the whole conversation's ids (`hycoc.chat.Chat.conversation`): keeps their common
        prefix with the held ids (for callers on the verifier's side of the wire: ``hycoc generate``, tests)."""
        ids = [int(x) for x in conversation_ids]
        keep = max(1, min(common_prefix(self.tokens, ids), len(ids) - 1))
        return self.append(ids[keep:], max_new_tokens, keep=keep, anchor=anchor if anchor >= keep else 0)

    def append_job(
        self, turn_ids, max_new_tokens: int, *, keep: int, keep_crc: int | None = None, anchor: int = 0
    ) -> PrefillJob:
        """`append` as a `PrefillJob` (`hycoc.verifier.append.append_job`: every check runs before any state
        changes; a chunk that fails puts the cache, the snapshot and every field back)."""
        return append_turn.append_job(self, turn_ids, max_new_tokens, keep=keep, keep_crc=keep_crc, anchor=anchor)

    def close(self) -> None:
        """Free the KV cache and the conversation snapshot."""
        self.cache, self.snapshot, self.undo = None, None, None
        self.finished = True

    # ------------------------------------------------------------------------------------------------ a round

    def verify(self, tokens, parents, seq: int) -> RoundReply:
        """Alg. 4, entire: verify one draft tree and commit its accepted path and bonus token.

        tokens, parents: int (R,), row 0 the root x_{t+1} (must equal the session's root), parents[0] == -1,
        0 <= parents[j] < j; ``cloud-mtp`` sessions send the root alone (R == 1) and the engine drafts and
        verifies root + K-chain itself (the reply's rows then refer to that chain: committed tokens are
        samples[:|P| + 1]). seq: 0 in the first round, +1 each round; resending the last seq with the same tree
        returns the same reply (idempotent retry).

        Context limit: prompt and output together hold at most max_context positions, so with n = max_context -
        len(tokens) tokens of room, rows deeper than n are left out of the forward (`fitting_rows`; their reply
        samples echo their own tokens) and the commit is cut at n.

        Raises (before any state changes): NotPrefilled, SessionFinished, SequenceError, TreeError, RootMismatch.
        On finishing the committed output is cut after the first EOS / at max_new_tokens / at the context, and
        the reply says ``finished`` with ``finish_reason`` "stop" / "max_new_tokens" / "length"; no hand-off or
        chain is sent. ``accepted`` records the path tokens committed after that cut.
        """
        eng = self.engine
        with Timer(eng.device) as timer:
            pending = self.begin_round(tokens, parents, seq)
            if isinstance(pending, RoundReply):
                return pending  # idempotent retry
            try:
                ids = torch.as_tensor(pending.tokens, device=eng.device)
                rows = verify_tree(eng.model, self.cache, eng.tap, ids, pending.parents, pending.t, eng.dtype)
                reply = self.finish_round(pending, *rows, timed=False)
            except BaseException:
                self.abort_round(pending)
                raise
        return self._stamp(reply, timer.ms)

    def begin_round(self, tokens, parents, seq: int) -> RoundReply | PendingRound:
        """The part of `verify` before the forward (batched verification runs it per session, `hycoc.verifier.batch`).

        Returns the last reply for an idempotent retry, else a `PendingRound`: the rows to verify (the rows that fit
        the context; for ``cloud-mtp`` the root and the head's K-chain, drafted here from the session's h) and what
        `finish_round` needs. Raises, with the session unchanged, what `verify` raises. After it the caller must
        append the rows' KV to ``self.cache`` (a forward) and call `finish_round`, or call `abort_round`.
        """
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        parents = np.asarray(parents, dtype=np.int64).reshape(-1)
        last = self._last
        if last is not None and seq == last.seq:
            if np.array_equal(tokens, last.tokens) and np.array_equal(parents, last.parents):
                return last.reply
            raise SequenceError(f"round {seq} was already verified with a different tree; send round {seq + 1}")
        if self.prefill_ms is None:
            raise NotPrefilled("call prefill before the first round")
        if self.finished:
            raise SessionFinished(
                "this turn has finished (EOS, max_new_tokens, the context or closed); append the "
                "next turn or open a new session"
            )
        expected = 0 if last is None else last.seq + 1
        if seq != expected:
            raise SequenceError(f"round seq {seq} out of order; expected {expected}")
        eng, place = self.engine, self.place
        check_round_tree(tokens, parents, seq, eng.vocab_size, place, self.allowance, self.root, self.t)
        # Rows deeper than the room left would commit tokens past the context: they are not verified (their
        # samples echo their own tokens), and the path stays among the rows that fit (see `fitting_rows`).
        kept = fitting_rows(parents, eng.max_context - len(self.tokens))
        pending = PendingRound(
            seq=seq,
            sent_tokens=tokens,
            sent_parents=parents,
            tokens=tokens,
            parents=parents,
            kept=None,
            t=self.t,
            rng_state=self.generator.get_state(),
            started=time.perf_counter(),
        )
        if len(kept) != len(tokens):
            pending.tokens, pending.parents, pending.kept = tokens[kept], remap_parents(parents, kept), kept
        if place.server_chain_before:
            t = self.t
            room = min(eng.chain_length, eng.max_context - 1 - t)
            chain = (
                draft_cloud_chain(
                    eng.model,
                    eng.head,
                    ChainStart(self.cache, eng.layers, self.root, self._h, t),
                    room,
                    eng.head_query_position_offset,
                )
                if self._h is not None
                else []
            )
            pending.tokens = np.asarray([self.root] + chain, dtype=np.int64)
            pending.parents = np.arange(-1, len(chain), dtype=np.int64)
        return pending

    def restrict_round(self, pending: PendingRound, rows) -> None:
        """Verify only ``rows`` of a begun round (a batch-level row budget, `hycoc.verifier.row_budget`).

        rows: int indices into ``pending.tokens`` (the rows `begin_round` chose), containing row 0 and closed
        under ancestors. The round then runs exactly as if the device had sent that smaller tree (Alg. 4 on the
        sub-tree: acceptance stays lossless, the ε rule unchanged); its reply is widened to the rows as sent and
        says which were verified (`widen_reply`). Not for cloud-mtp rounds (their rows are the server's own
        chain). Raises ValueError for rows that are not an ancestor-closed subset with the root.
        """
        rows = np.unique(np.asarray(rows, dtype=np.int64))
        if len(rows) == len(pending.tokens):
            return
        if not self.place.trimmable:
            raise ValueError(
                f"restrict_round: a {self.draft_place} round's rows are the server's own chain; keep it whole"
            )
        if not ancestor_closed(rows, pending.parents):
            raise ValueError(
                f"restrict_round: rows {rows.tolist()} are not an ancestor-closed subset of the "
                f"round's {len(pending.tokens)} rows containing row 0"
            )
        sent = pending.kept if pending.kept is not None else np.arange(len(pending.sent_tokens))
        pending.kept = sent[rows]
        pending.tokens = pending.sent_tokens[pending.kept]
        pending.parents = remap_parents(pending.sent_parents, pending.kept)

    def abort_round(self, pending: PendingRound) -> None:
        """Undo a begun round: cut the cache back to its t positions and restore the sampler (compaction keeps
        [0, t) intact, so this restores the session exactly)."""
        if self.cache is not None:
            crop_cache(self.cache, pending.t)
        self.generator.set_state(pending.rng_state)

    def finish_round(
        self,
        pending: PendingRound,
        logits: torch.Tensor,
        h_pre: torch.Tensor,
        h_post: torch.Tensor,
        *,
        timed: bool = True,
    ) -> RoundReply:
        """Alg. 4 lines 5-14 after the forward, and the commit: the cache holds [0, t) then the R rows' KV.

        logits: float32 (R, V); h_pre, h_post: (R, H), the final norm's input and output rows (`verify_tree`'s
        return, or one session's slice of a batched forward). Returns the reply; with ``timed`` its server_ms is
        the milliseconds since `begin_round` (else 0, for the caller to stamp). On an exception the caller calls
        `abort_round`.
        """
        reply, commit = self._round(pending.tokens, pending.parents, pending.seq, logits, h_pre, h_post)
        if pending.kept is not None:
            reply = widen_reply(reply, pending.sent_tokens, pending.kept)
        new, t_prime, h, n_accepted = commit
        self.tokens.extend(new)
        self.t, self._h, self.finished, self.finish_reason = t_prime, h, reply.finished, reply.finish_reason
        self.rounds += 1
        self.accepted.append(n_accepted)
        self._last = _Retry(pending.seq, pending.sent_tokens, pending.sent_parents, reply)
        if timed:
            return self._stamp(reply, (time.perf_counter() - pending.started) * 1e3)
        return reply

    def _stamp(self, reply: RoundReply, ms: float) -> RoundReply:
        """Set the finished round's server_ms (in the reply, the retry record and ``server_ms``)."""
        reply = replace(reply, server_ms=ms)
        self.server_ms.append(ms)
        if self._last is not None:  # always: set by the round this stamps
            self._last.reply = reply
        return reply

    def _round(
        self,
        tokens: np.ndarray,
        parents: np.ndarray,
        seq: int,
        logits: torch.Tensor,
        h_pre: torch.Tensor,
        h_post: torch.Tensor,
    ):
        """The work of one round after its forward (lines 5-14); changes only the cache (which `abort_round`
        restores on failure).

        Returns (reply with server_ms unset, (new committed tokens, t', h of v*, |P|)).
        """
        eng, t = self.engine, self.t
        h_rows = h_pre if eng.hidden == "pre_norm" else h_post
        # Lines 5-12: p~ per row, y^_j ~ p~(.|j) from the session's generator; v*, samples rewritten along the path.
        mode = self.place.acceptance(self.acceptance)
        v_star, path, samples = accept(tokens, parents, logits, self.sampling, self.generator, mode, self.epsilon)
        bonus = int(samples[v_star])  # b = y^_v*
        # Line 13: keep the root and the path at t .. t + |P|.
        compact_kv(self.cache, t, path)
        t_prime = t + 1 + len(path)

        # Commit the path and b (Alg. 1 line 9), cut after an EOS and at max_new_tokens.
        new, reason = commit_cut(
            [int(x) for x in tokens[path]] + [bonus],
            eng.eos_token_ids,
            self.max_new_tokens - (len(self.tokens) - self.turn_start),
            eng.max_context - len(self.tokens),
        )
        finished = reason is not None

        h = h_rows[v_star]
        handoff, chain = None, np.zeros(0, np.int32)
        if not finished and self.place.hand_off:
            # Line 14: the hand-off for the device's MTP Drafter.
            start = ChainStart(self.cache, eng.layers, bonus, h, t_prime)
            handoff = pack_handoff(eng.model, start, t, eng.head_window, seq == 0, eng.handoff_scales)
        elif not finished and self.place.server_chain_after:
            room = min(eng.chain_length, eng.max_context - 1 - t_prime)
            chain = np.asarray(
                draft_server_chain(
                    eng.model,
                    eng.head,
                    ChainStart(self.cache, eng.layers, bonus, h, t_prime),
                    room,
                    eng.head_window,
                    eng.keep_set,
                    eng.head_query_position_offset,
                    eng.head_sliding,
                ),
                dtype=np.int32,
            )
        reply = RoundReply(
            seq=seq,
            samples=samples.astype(np.int32),
            path_rows=path.astype(np.int32),
            bonus=bonus,
            server_ms=0.0,
            finished=finished,
            handoff=handoff,
            chain=chain,
            finish_reason=reason,
        )
        return reply, (new, t_prime, h, len(new) - 1)
