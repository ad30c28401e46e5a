"""Typed messages exchanged between the device runtime and the verifier (docs/design.md "Wire protocol").

These dataclasses are the in-memory form; `hycoc.protocol.wire` turns them into binary frames and back, and
validates every field on arrival. numpy only: the device runtime imports this module on the phone.

Positions count from 0 (paper App. C): committed tokens sit at positions [0, t), the tree root
x_{t+1} at position t.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

import numpy as np

#: Acceptance modes a session can ask for (paper Table 5 "Acceptance" column).
#: ``exact`` is lossless (Alg. 4 with epsilon = 1); ``epsilon`` is epsilon-threshold acceptance (§3.5).
ACCEPTANCE_MODES = ("exact", "epsilon")

#: Who drafts the chain each round (paper Table 5 "Place" column).
#: ``device``: the device sends whole trees (HyCo, SpecEdge-style);
#: ``server-head``: the server runs the BF16 head over the keep set and W window after each round and returns
#: its chain in the reply (no siblings), the device adds SLM alternatives;
#: ``cloud-mtp``: the server drafts a K-chain with the full-precision head over the whole prefix and full
#: vocabulary and verifies it itself; the device sends only the root each round.
DRAFT_PLACES = ("device", "server-head", "cloud-mtp")

#: Why a request finished (RoundReply.finish_reason): ``stop`` an end-of-turn / EOS token was committed,
#: ``max_new_tokens`` the request's output cap was reached, ``length`` the verifier's context is full (prompt and
#: output together hold max_context positions). The text committed so far is the answer in every case.
FINISH_REASONS = ("stop", "max_new_tokens", "length")


def commit_cut(new: list[int], stop_ids, new_room: int, context_room: int) -> tuple[list[int], str | None]:
    """The commit rule of a round (Alg. 1 line 9 / Alg. 4 with the request's limits): cut ``new`` (path tokens,
    then the bonus) after its first stop token, then at ``new_room`` (tokens left under max_new_tokens), then at
    ``context_room`` (positions left under max_context). Returns (tokens committed, finish reason or None), the
    reason being "stop", "max_new_tokens" or "length" (`hycoc.protocol.messages.FINISH_REASONS`), the first that
    applies.

    Hand-worked: commit_cut([7, 1, 9], {1}, 10, 10) == ([7, 1], "stop");
    commit_cut([7, 8, 9], set(), 2, 10) == ([7, 8], "max_new_tokens"); commit_cut([7, 8, 9], set(), 5, 3) ==
    ([7, 8, 9], "length").
    """
    reason = None
    for i, tok in enumerate(new):
        if tok in stop_ids:
            new, reason = new[: i + 1], "stop"
            break
    for room, why in ((new_room, "max_new_tokens"), (context_room, "length")):
        if len(new) > room or (len(new) == room and reason is None):
            new, reason = new[:room], why
    return new, reason


@dataclass(frozen=True)
class Sampling:
    """The verifier's sampling distribution p~ (Alg. 4 line 5): temperature, then top-k, then top-p.

    temperature: >= 0 (0 means greedy: p~ puts all mass on the arg-max, ties to the lowest id).
    top_k: number of largest logits kept, >= 1. top_p: nucleus mass in (0, 1].
    """

    temperature: float = 1.0
    top_k: int = 64
    top_p: float = 0.95


# The request defaults, one place each (paper App. C: T = 1, top-k 64, top-p 0.95, epsilon = 0.005, 1,024 new tokens
# on SB): `OpenRequest`'s fields, the recipe's ``[sampling]`` and ``[acceptance]`` tables
# (`hycoc.recipe.sections.Sampling`, `hycoc.recipe.sections.Acceptance`) and `hycoc.verifier.engine.VerifierEngine.open`
# all take theirs from these names (tests/test_defaults_identity.py).

#: The sampling distribution p~ a request gets when it names none.
DEFAULT_SAMPLING: Final = Sampling()
#: The acceptance mode a request gets when it names none (one of ACCEPTANCE_MODES).
DEFAULT_ACCEPTANCE: Final = "epsilon"
#: The epsilon of epsilon-threshold acceptance a request gets when it names none (§3.5).
DEFAULT_EPSILON: Final = 0.005
#: Who drafts when a request says nothing (one of DRAFT_PLACES).
DEFAULT_DRAFT_PLACE: Final = "device"
#: The output cap of a request that names none, in tokens.
DEFAULT_MAX_NEW_TOKENS: Final = 1024
#: The sampling seed of a request that names none.
DEFAULT_SEED: Final = 0


@dataclass(frozen=True)
class OpenRequest:
    """Start a request: the verifier prefills ``prompt_ids[:-1]``; ``prompt_ids[-1]`` is the first tree's root.

    prompt_ids: int32, shape (T,), T >= 1, every id < vocabulary size.
    epsilon: threshold of epsilon-threshold acceptance in (0, 1]; 1.0 reduces to exact (App. C).
    acceptance: one of ACCEPTANCE_MODES. draft_place: one of DRAFT_PLACES.
    max_new_tokens: output cap; the verifier reports ``finished`` once it is reached or an EOS is committed.
    auth_token: the server's shared secret when it runs with ``--auth-token``, else None (never empty).
    chat: the device bundle's chat contract (`hycoc.chat.ChatFormat.contract`: stop ids and the template's sha256,
    canonical JSON); the verifier refuses the OPEN with ``chat_mismatch`` when its own differs. None: not checked
    (raw ids). anchor: the position where the prompt's model turn opens (`hycoc.chat.Rendered.anchor`), in
    [0, T); the verifier snapshots its sliding-window KV there, so a later APPEND that rolls the conversation back
    to at least it re-prefills only what follows (docs/serving.md "Conversations"); 0: no snapshot.
    draft_ms_floor, draft_ms_tree: the device's drafting milliseconds per round at the allowance's floor (the MTP
    chain alone, no SLM pass) and with the SLM pass (protocol 6), measured or estimated by the device, in
    [0, MAX_DRAFT_MS]; 0: unknown. The verifier's allowance rule weighs a tree's rows against them
    (`hycoc.verifier.allowance`).
    """

    prompt_ids: np.ndarray
    sampling: Sampling = DEFAULT_SAMPLING
    seed: int = DEFAULT_SEED
    acceptance: str = DEFAULT_ACCEPTANCE
    epsilon: float = DEFAULT_EPSILON
    draft_place: str = DEFAULT_DRAFT_PLACE
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    auth_token: str | None = None
    chat: str | None = None
    anchor: int = 0
    draft_ms_floor: float = 0.0
    draft_ms_tree: float = 0.0


#: The largest drafting time per round an OPEN may report (ms): a minute.
MAX_DRAFT_MS = 60_000.0


@dataclass(frozen=True)
class Opened:
    """Reply to OpenRequest once the prefill is done.

    session_id: server-assigned id. t: position of the first root (= len(prompt) - 1).
    prefill_ms: verifier time of the prefill in milliseconds. max_context: positions the verifier can hold.
    tree_rows: rows every DraftTree of this session must have (B + 1; 1 for ``cloud-mtp``).
    vocab_size, hidden_size, kv_dim_sliding, kv_dim_full: the verifier's sizes, so the device can check every
    hand-off's lengths (kv_dim = kv_heads * head_dim of the last sliding / last full-attention layer).
    stop_ids: the ids that end the verifier's model turn (its checkpoint's ``eos_token_id``), at least one.
    """

    session_id: int
    t: int
    prefill_ms: float
    max_context: int
    tree_rows: int
    vocab_size: int
    hidden_size: int
    kv_dim_sliding: int
    kv_dim_full: int
    stop_ids: tuple[int, ...] = (1,)


@dataclass(frozen=True)
class DraftTree:
    """One round's hybrid draft tree (Alg. 3 line 17), rows in insertion order.

    seq: round sequence number, 0 for the first round of a request, +1 each round.
    tokens: int32, shape (R,), R = B + 1 rows; row 0 is the root x_{t+1}.
    parents: int32, shape (R,); parents[0] == -1, 0 <= parents[j] < j for j >= 1. Padding repeats the last row
    (same token and parent), which the verifier treats as a duplicate sibling of that row.
    scores: float32, shape (R,), or None (not sent): each row's tree score s(v) of Alg. 3, natural log, about the
    log of the row's chance of acceptance: scores[0] == 0 (the root), and every row scores at most its parent
    (s(child) = s(parent) + ln q + ln λ, Alg. 3 lines 4, 6, 13). Padding rows repeat the last row's score. The
    verifier may spend its rows on the best-scoring ancestor-closed subtree (`RoundReply.verified`). The wire
    carries them as float16 (`hycoc.protocol.wire`).
    """

    seq: int
    tokens: np.ndarray
    parents: np.ndarray
    scores: np.ndarray | None = None


@dataclass(frozen=True)
class HandOff:
    """The MTP Drafter's inputs for the next round (Alg. 4 line 14), all at 8 bits with fixed scales.

    t_prime: position of the new root b (= t + 1 + |P|). a: first position whose KV rows are carried,
    a = max(t, t' - W), or max(0, t' - W) in a request's first round. bonus: the new root token b.
    x_hat: int8, shape (2 * H,): [e(b); h_{v*}], h the verifier's last state at v* as `[handoff] hidden` says
    (post_norm: after the final norm, as Gemma 4's assistant expects; pre_norm: before it, the paper's App. A).
    k_sliding, v_sliding: int8, shape (t' - a, kv_heads_sliding * head_dim_sliding): last sliding-window layer.
    k_full, v_full: int8, shape (t' - a, kv_heads_full * head_dim_full): last full-attention layer.
    Keys arrive with their rotary embedding applied. Dequantize as ``int8 * scale``.
    scales: (e, h, k_sliding, v_sliding, k_full, v_full), the recipe's fixed per-tensor scales.
    """

    t_prime: int
    a: int
    bonus: int
    x_hat: np.ndarray
    k_sliding: np.ndarray
    v_sliding: np.ndarray
    k_full: np.ndarray
    v_full: np.ndarray
    scales: tuple[float, float, float, float, float, float]

    @property
    def n_positions(self) -> int:
        return int(self.t_prime - self.a)


@dataclass(frozen=True)
class RoundReply:
    """The verifier's answer to one DraftTree (Alg. 4 line 15).

    seq: echoes DraftTree.seq. samples: int32, shape (R,), y^_j per row, rewritten along the chosen path
    (Alg. 4 line 11) so that walking "child == sample" from the root ends at v*.
    path_rows: int32, shape (|P|,), tree rows of the accepted path below the root, root excluded.
    bonus: token b sampled at v*. handoff: the head's inputs, or None when the session's draft place is not
    ``device``. chain: int32, shape (K,), the server head's chain for the next round (``server-head`` only),
    else empty. server_ms: verifier time of this round in milliseconds (forward + sampling + compaction +
    hand-off packing). finished: True once EOS is committed, max_new_tokens is reached or the context is full;
    finish_reason: then one of FINISH_REASONS, else None.
    verified: bool, shape (R,), over the rows as sent, or None (every row verified): True for the rows the
    verifier verified, an ancestor-closed subset (every verified row's parent verified) that holds row 0. A row
    not verified is never on the path, and its sample echoes its own token (so "child == sample" alone could
    walk into it: the device walks verified rows only, `hycoc.runtime.tree_builder.walk_reply`). The wire carries
    it as a bitmask (`hycoc.protocol.wire`).
    allowance: the rows (root included) the session's next DraftTree may hold, set by the verifier from its load
    (protocol 6; `hycoc.verifier.allowance`): in [1, Opened.tree_rows]; 0 in memory only, meaning no allowance
    was set (every row up to tree_rows allowed). The device drafts at most this many rows (docs/serving.md
    "Tree allowance").
    """

    seq: int
    samples: np.ndarray
    path_rows: np.ndarray
    bonus: int
    server_ms: float
    finished: bool = False
    handoff: HandOff | None = None
    chain: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    finish_reason: str | None = None
    verified: np.ndarray | None = None
    allowance: int = 0


@dataclass(frozen=True)
class AppendTurn:
    """Continue a finished turn with the next one on the same session (paper §4.1: MT-bench's second turns),
    as the template renders the whole conversation (docs/serving.md "Conversations").

    The device renders the conversation (every message, its new user message last) and keeps the longest prefix
    it shares with the ids the session holds (prompt + committed output): ``keep`` ids. The verifier rolls its
    KV back to those ``keep`` positions and prefills the rest. keep: int >= 1, at most the ids held.
    keep_crc: crc32 of the kept ids (`hycoc.chat.ids_crc32`), so both sides check they hold the same
    conversation (``conversation_mismatch`` otherwise). tokens: int32 (T,), T >= 1, the rendering after the kept
    prefix; its last id is the next tree's root. anchor: the new model turn's opening position
    (`hycoc.chat.Rendered.anchor`), in [keep, keep + T), or 0 (no snapshot). Sent only after a reply that said
    ``finished``. max_new_tokens: the new turn's output cap. Answered with `Opened` (same session_id; t = the new
    root's position; prefill_ms = this prefill only).
    """

    tokens: np.ndarray
    max_new_tokens: int = 1024
    keep: int = 1
    keep_crc: int = 0
    anchor: int = 0


@dataclass(frozen=True)
class Close:
    """End a session; the verifier frees its KV."""

    session_id: int = 0


@dataclass(frozen=True)
class ErrorReply:
    """An error frame. code: a stable machine-readable kind (e.g. ``bad_parent``); message: what and how to fix."""

    code: str
    message: str
