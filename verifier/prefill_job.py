"""A prefill or an appended turn run in chunks (`PrefillJob`), and how an APPEND rolls a conversation back
(`AppendPlan`, `CacheCheckpoint`; docs/serving.md "Conversations")."""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import DynamicCache

from . import faults, forward
from .forward import Timer
from .kv_cache import SlidingWindowLayer, snapshot_inside, stores_kv, take_snapshot

if TYPE_CHECKING:
    from .engine import VerifierEngine


class PrefillJob:
    """A prefill (or an appended turn's) split into chunks of ``engine.prefill_chunk`` positions, so that a
    scheduler can run other sessions' rounds between them (docs/serving.md "Many devices: batched verification": a
    long prompt must not stall them).

    Made by `Session.prefill_job` / `Session.append_job`. `step` runs the next chunk (the same forwards, masks and
    positions as `prefill`'s loop); `done` says whether all ran; the last `step` commits the result to the session
    and returns it, (prefill_ms, t). ``ms`` accumulates the chunks' milliseconds. `run` runs every chunk.
    snapshot_at: a position in [start, start + len(ids)] where the sliding layers are snapshotted (handed to
    ``on_snapshot``): at a chunk's start or end by `hycoc.verifier.kv_cache.take_snapshot`, inside a chunk by
    `hycoc.verifier.kv_cache.snapshot_inside` after its forward (chunks are never split for it), or None. abort:
    called when a chunk raises
    (the session's state is put back as before the job: an APPEND is all or nothing); the job is then failed,
    holds no KV (its cache and the failed chunk's frames are dropped before the error propagates, so a caller can
    give the reservation back at once) and every later `step` raises RuntimeError. kind: "prefill" or "append"
    (an APPEND's chunks are the ``append_chunk`` fault point of `hycoc.verifier.faults`).
    """

    def __init__(
        self,
        engine: VerifierEngine,
        cache: DynamicCache,
        ids: torch.Tensor,
        start: int,
        done,
        snapshot_at: int | None = None,
        on_snapshot=None,
        abort=None,
        kind: str = "prefill",
    ):
        self.engine, self.cache, self.ids, self.start, self.kind = engine, cache, ids, start, kind
        self.next = 0  # ids consumed so far
        self.ms = 0.0
        self.result: tuple[float, int] | None = None
        self.failed = False
        self._done, self._abort = done, abort
        self._snap_at = None if snapshot_at is None else int(snapshot_at) - start
        self._on_snapshot = on_snapshot
        if self._snap_at is not None and not 0 <= self._snap_at <= len(ids):
            raise ValueError(
                f"snapshot_at = {snapshot_at} is outside the prefilled positions [{start}, {start + len(ids)}]"
            )

    @property
    def done(self) -> bool:
        return self.result is not None

    @property
    def remaining(self) -> int:
        """Positions still to prefill."""
        return len(self.ids) - self.next

    def _snapshot_if_due(self) -> None:
        if self._snap_at is not None and self.next == self._snap_at:
            self._on_snapshot(take_snapshot(self.cache, self.start + self.next))
            self._snap_at = None

    def _inside(self, cache: DynamicCache, t: int, n: int) -> None:
        """After a chunk's forward (positions [t, t + n)), before its trim: the snapshot when it is due inside the
        chunk, sliced out of the sliding layers (`snapshot_inside`: no extra forward ends there)."""
        if self._snap_at is not None and t < self.start + self._snap_at < t + n:
            self._on_snapshot(snapshot_inside(cache, self.start + self._snap_at))
            self._snap_at = None

    def step(self) -> tuple[float, int] | None:
        """Run the next chunk; returns (prefill_ms, t) after the last one (also for an empty prompt), else None.
        A chunk that raises aborts the job (class docstring) and the exception propagates."""
        if self.result is not None:
            return self.result
        if self.failed:
            raise RuntimeError("this prefill failed and was rolled back; start a new one")
        eng = self.engine
        try:
            self._snapshot_if_due()
            n = min(eng.prefill_chunk, len(self.ids) - self.next)
            last = None
            if n > 0 and self.kind == "append":
                faults.maybe_fail("append_chunk")
            if n > 0:
                with Timer(eng.device) as timer:
                    last = forward.prefill(
                        eng.model,
                        self.cache,
                        eng.tap,
                        self.ids[self.next : self.next + n],
                        n,
                        eng.dtype,
                        start=self.start + self.next,
                        after_forward=self._inside,
                    )
                self.ms += timer.ms
                self.next += n
                self._last = last
            self._snapshot_if_due()
            if self.next == len(self.ids):
                self.result = self._done(getattr(self, "_last", None), self.ms)
        except BaseException:
            self.failed = True
            if self._abort is not None:
                self._abort()
            self.cache, self._last, self._abort, self._done = None, None, None, None
            traceback.clear_frames(sys.exc_info()[2])  # the failed forward's frames hold the cache and activations
            raise
        return self.result

    def run(self) -> tuple[float, int]:
        """Every remaining chunk; returns (prefill_ms, t)."""
        while (result := self.step()) is None:
            pass
        return result


@dataclass
class AppendPlan:
    """How an APPEND rolls a session's conversation back (docs/serving.md "Conversations"), decided before
    anything changes (`Session.plan_append`).

    keep: the held ids the device keeps (APPEND's ``keep``). start: the position the KV rolls back to, <= keep;
    [start, len(conversation) - 1) is prefilled. kind: "crop" (every layer still holds what position ``start``
    needs: cut there), "snapshot" (the sliding layers restart from the `WindowSnapshot` at ``start``) or "full"
    (nothing usable: the conversation is prefilled from 0). conversation: int64, the held ids' kept prefix then
    the turn. reprefilled: positions prefilled again that the session held already (start..keep).
    """

    keep: int
    start: int
    kind: str
    conversation: np.ndarray
    reprefilled: int


class CacheCheckpoint:
    """What undoes an APPEND's changes to a cache: every sliding layer's tensors (shared: later forwards replace
    them, never write them) and each full layer's positions from ``start`` on, cloned (positions before it are
    never touched: chunks append after them). `restore` puts the cache back exactly."""

    def __init__(self, cache: DynamicCache, start: int):
        self.cache, self.start = cache, int(start)
        self.layers: list[tuple[Any, ...]] = []  # (i, keys, values, start, cumulative) or (i, (k, v) tail, n)
        for i, layer in enumerate(cache.layers):
            if not stores_kv(layer):
                continue
            if isinstance(layer, SlidingWindowLayer):
                self.layers.append((i, layer.keys, layer.values, layer.start, layer.cumulative_length))
            else:
                n = layer.keys.shape[-2]
                tail = (layer.keys[..., self.start :, :].clone(), layer.values[..., self.start :, :].clone())
                self.layers.append((i, tail, n))

    def tensors(self) -> list[torch.Tensor]:
        """The tensors the checkpoint keeps (the sliding layers' and the full layers' cloned tails)."""
        out: list[torch.Tensor] = []
        for entry in self.layers:
            out += list(entry[1:3]) if len(entry) == 5 else list(entry[1])
        return out

    def restore(self) -> None:
        for entry in self.layers:
            layer = self.cache.layers[entry[0]]
            if len(entry) == 5:
                _, layer.keys, layer.values, layer.start, layer.cumulative_length = entry
            else:
                _, (k_tail, v_tail), n = entry
                layer.keys = torch.cat([layer.keys[..., : self.start, :], k_tail], dim=-2)
                layer.values = torch.cat([layer.values[..., : self.start, :], v_tail], dim=-2)
                assert layer.keys.shape[-2] == n
