"""The next turn of a conversation (protocol 5's APPEND; paper §4.1, MT-bench's second turns): check it, decide how
the KV rolls back (`plan_append`: crop, the sliding-window snapshot, or a full re-prefill) and prefill the new ids as
a `PrefillJob` that is all or nothing (`append_job`). docs/serving.md "Conversations" and docs/design.md
"Conversations" say what a caller sees; `hycoc.verifier.engine.Session.plan_append`, ``append``, ``append_job`` and
``continue_with`` are the methods that call these.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from hycoc.chat import ids_crc32

from .errors import BadRequest, ContextOverflow, ConversationMismatch, SessionFinished
from .kv_cache import SlidingWindowLayer, WindowSnapshot, restore_snapshot, sliding_start, stores_kv
from .kv_surgery import crop_cache
from .prefill_job import AppendPlan, CacheCheckpoint, PrefillJob

if TYPE_CHECKING:
    from .engine import Session


def kv_held(session: Session) -> int:
    """Positions [0, n) whose KV the session's cache holds for its committed ids (a finished round may hold KV of
    path rows after a cut EOS, and the bonus token has none yet)."""
    return min(len(session.tokens), session.t)


def plan_append(session: Session, turn_ids, keep: int, keep_crc: int | None = None) -> AppendPlan:
    """Check an APPEND and decide its rollback (`AppendPlan`) without changing anything.

    turn_ids: int (T,), T >= 1, the conversation's rendering after the ``keep`` held ids it keeps (the
    device's `hycoc.chat.common_prefix` of what both hold and the whole conversation re-rendered; the last id
    is the next root). keep_crc: crc32 of the held ids [0, keep) (`hycoc.chat.ids_crc32`), or None (not
    checked: a caller on this side of the wire). The rollback start is ``keep`` -- at most the positions with
    KV, and at least one id is prefilled so the new root has its h -- if the sliding layers still hold its
    window (kind "crop"); else the snapshot's position when it lies at or before it ("snapshot"); else 0
    ("full": the whole conversation again). Raises SessionFinished (closed, or the turn has not finished),
    ConversationMismatch (keep past the held ids, or another crc), BadRequest (empty turn, an id outside the
    vocabulary), ContextOverflow (no room for one output token).
    """
    turn = np.asarray(turn_ids, dtype=np.int64).reshape(-1)
    eng = session.engine
    if session.cache is None or session.prefill_ms is None:
        raise SessionFinished("this session is closed (or was never prefilled): open a new one")
    if not session.finished:
        raise SessionFinished(
            "the current turn has not finished: send rounds until a reply says finished, then append the next turn"
        )
    if len(turn) == 0:
        raise BadRequest("the appended turn is empty; it needs at least the next root token")
    if turn.min() < 0 or turn.max() >= eng.vocab_size:
        raise BadRequest(f"appended token ids must be in [0, {eng.vocab_size})")
    keep = int(keep)
    if not 1 <= keep <= len(session.tokens):
        raise ConversationMismatch(
            f"APPEND keeps {keep} ids but the session holds {len(session.tokens)} (prompt "
            "and committed output); the device and the verifier disagree about the "
            "conversation: open a new session"
        )
    if keep_crc is not None and ids_crc32(session.tokens[:keep]) != int(keep_crc):
        raise ConversationMismatch(
            f"the kept {keep} ids differ from the session's (crc32 "
            f"{ids_crc32(session.tokens[:keep]):#010x} here, {int(keep_crc):#010x} sent); "
            "the device and the verifier disagree about the conversation: open a new "
            "session"
        )
    conversation = np.concatenate([np.asarray(session.tokens[:keep], np.int64), turn])
    if len(conversation) >= eng.max_context:
        raise ContextOverflow(
            f"the conversation ({len(conversation)} tokens with the new turn) leaves no room "
            f"for output in the verifier's context of {eng.max_context} positions"
        )
    start = min(keep, kv_held(session), len(conversation) - 2)
    retain = eng.kv_retain
    if sliding_start(session.cache) <= max(0, start - retain):
        kind = "crop"
    elif session.snapshot is not None and session.snapshot.position <= start:
        kind, start = "snapshot", session.snapshot.position
    else:
        kind, start = "full", 0
    return AppendPlan(keep=keep, start=start, kind=kind, conversation=conversation, reprefilled=keep - start)


def append_job(
    session: Session, turn_ids, max_new_tokens: int, *, keep: int, keep_crc: int | None = None, anchor: int = 0
) -> PrefillJob:
    """`hycoc.verifier.engine.Session.append` as a `PrefillJob`: every check (`plan_append`, the output cap, the
    anchor) runs here, before any state changes; the turn is committed to the session when the job's last chunk has
    run, and a chunk that fails puts the cache, the snapshot and every field back."""
    eng = session.engine
    plan = plan_append(session, turn_ids, keep, keep_crc)
    if max_new_tokens < 1:
        raise BadRequest(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    n = len(plan.conversation)
    if anchor and not plan.keep <= anchor < n:
        raise BadRequest(f"anchor {anchor} lies outside the new turn's positions [{plan.keep}, {n})")
    old_cache, old_snapshot = session.cache, session.snapshot
    if plan.kind == "full":
        checkpoint = None
        cache = session.cache = eng.new_cache()
    else:
        cache = session.cache
        assert cache is not None  # a session that takes an APPEND holds its cache
        checkpoint = CacheCheckpoint(cache, plan.start)
        if plan.kind == "snapshot":
            assert session.snapshot is not None  # plan_append chose "snapshot" because one is held
            restore_snapshot(cache, plan_snapshot := session.snapshot)
            for layer in cache.layers:  # full layers back to the snapshot's position
                if stores_kv(layer) and not isinstance(layer, SlidingWindowLayer):
                    layer.keys = layer.keys[..., : plan_snapshot.position, :]
                    layer.values = layer.values[..., : plan_snapshot.position, :]
        else:
            crop_cache(cache, plan.start)
    ids = torch.as_tensor(plan.conversation[plan.start : -1], device=eng.device)
    new_snapshot: list[WindowSnapshot] = []
    # what undoes the APPEND, held until its last chunk ran (then dropped at once: the server gives its
    # reservation back right after) and counted in the session's KV meanwhile (`Session.kv_tensors`)
    undo = {"checkpoint": checkpoint, "cache": old_cache, "snapshot": old_snapshot}
    session.undo = (checkpoint, old_cache if plan.kind == "full" else None, old_snapshot)

    def done(last, ms: float) -> tuple[float, int]:
        session.tokens = [int(x) for x in plan.conversation]
        session.t = len(session.tokens) - 1
        session._h = last[0 if eng.hidden == "pre_norm" else 1]
        session.turn_start, session.max_new_tokens = len(session.tokens), int(max_new_tokens)
        session.finished, session.finish_reason, session._last = False, None, None
        if new_snapshot:
            session.snapshot = new_snapshot[-1]
        session.turns_prefill_ms.append(ms)
        session.appends.append(plan)
        session.undo = None
        undo.clear()
        return ms, session.t

    def abort() -> None:
        if checkpoint is not None and undo:  # not after done(): it cleared the undo record
            checkpoint.restore()
        if undo:
            session.cache, session.snapshot = old_cache, old_snapshot
        session.undo = None
        undo.clear()

    return PrefillJob(
        eng,
        cache,
        ids,
        plan.start,
        done,
        snapshot_at=anchor or None,
        on_snapshot=new_snapshot.append,
        abort=abort,
        kind="append",
    )
