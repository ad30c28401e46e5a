"""`ServerSettings`: how a `hycoc.verifier.server.VerifierServer` serves (tree rows, auth, frame bound, batching, row
budget, allowance, prefills), checked once when made, before anything starts. The recipe's ``[verifier]`` table
holds each (`hycoc.run_options.server_options`); the server limits proper are `ServerLimits`."""

from __future__ import annotations

import math
from dataclasses import dataclass

from hycoc import serving_limits
from hycoc.protocol import wire

from ..allowance import ALLOWANCE_MODES
from ..row_budget import DEFAULT_MIN_ROWS, TREE_BUDGETS
from .memory import DEFAULT_MEMORY_RELEASE_S
from .worker import BATCHING_MODES, DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_WAIT_MS, DEFAULT_MAX_PREFILLS


@dataclass(frozen=True)
class ServerSettings:
    """How the server serves; made once, checked when made (``__post_init__``: ValueError naming the setting, its
    value and what it must be: each out of its range, a mode that is not one of its allowed values; "auto" row
    budgets and allowances need batched mode).

    tree_rows: rows of every ROUND of ``device`` and ``server-head`` sessions, B + 1 (recipe: tree.node_budget + 1);
        ``cloud-mtp`` sessions send the root alone (1 row). Sent in OPENED.
    auth_token: shared secret clients must present (None: open server). Never empty.
    max_frame_bytes: largest frame, header included, in bytes (recipe: verifier.max_frame_bytes); incoming frames
        are further bounded by `open_frame_bytes` (package docstring "Frame size").
    model_name: what /healthz reports as the model (recipe: models.verifier as written).
    batching: "batched" (default): rounds of sessions ready together run in one forward and prefills run chunk
        by chunk between them (`hycoc.verifier.scheduler`); "serial": one engine call at a time, in arrival order.
        Recipe: verifier.batching.
    max_batch_rows: most tree rows per batched forward (>= 1; recipe verifier.max_batch_rows).
    max_batch_wait_ms: how long a round waits for others to join its forward, in ms (>= 0; recipe
        verifier.max_batch_wait_ms); it never waits when every open session has a round queued.
    tree_budget: "fixed" (default): every tree verified as sent; "auto": when several rounds share a batched
        forward, the rows verified are chosen across them by the trees' scores (`hycoc.verifier.row_budget`;
        batched mode only). Recipe: verifier.tree_budget.
    min_rows_per_session: rows each scored tree keeps under "auto" (>= 1; default 2: root and first chain token).
    allowance: "fixed" (default): every reply lets the next round hold the whole tree (tree_rows); "auto": each
        reply's allowance is sized from the load (`hycoc.verifier.allowance.AllowanceRule`, sharing the row
        budget's learned state when tree_budget is "auto"; batched mode only). Recipe: verifier.allowance.
    allowance_target_ms: the step-latency target the allowance keeps a forward under, in ms (None or 0: none).
        Recipe: verifier.allowance_target_ms.
    allowance_floor: the fewest rows an allowance grants (0, the default: K + 1, the root and the MTP chain).
        Recipe: verifier.allowance_floor.
    memory_release_s: seconds between two releases of the C allocator's free pages to the OS on the worker
        (`hycoc.verifier.server.memory`: RSS stays flat under fuzzing); 0 turns them off.
    max_prefills: most sessions prefilling at once (batched; serial runs one); the KV budget reserves a
        prefilling session's transient (`VerifierEngine.prefill_transient_bytes`) once per such slot at start
        (recipe verifier.max_prefills). ValueError when max_kv_bytes cannot hold that pool.
    """

    tree_rows: int
    auth_token: str | None = None
    max_frame_bytes: int = wire.DEFAULT_MAX_FRAME_BYTES
    model_name: str = "verifier"
    batching: str = "batched"
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_batch_wait_ms: float = DEFAULT_MAX_BATCH_WAIT_MS
    tree_budget: str = "fixed"
    min_rows_per_session: int = DEFAULT_MIN_ROWS
    allowance: str = "fixed"
    allowance_target_ms: float | None = None
    allowance_floor: int = 0
    max_prefills: int = DEFAULT_MAX_PREFILLS
    memory_release_s: float = DEFAULT_MEMORY_RELEASE_S

    def __post_init__(self) -> None:
        self._check()
        # an allowance target of 0 means none, as None does
        object.__setattr__(self, "allowance_target_ms", float(self.allowance_target_ms or 0) or None)
        object.__setattr__(self, "tree_rows", int(self.tree_rows))
        object.__setattr__(self, "max_frame_bytes", int(self.max_frame_bytes))
        object.__setattr__(self, "max_batch_wait_ms", float(self.max_batch_wait_ms))
        object.__setattr__(self, "memory_release_s", float(self.memory_release_s))

    def _check(self) -> None:
        if not 1 <= self.tree_rows <= wire.MAX_TREE_ROWS:
            raise ValueError(f"tree_rows = {self.tree_rows}: must lie in [1, {wire.MAX_TREE_ROWS}] (B + 1)")
        if self.auth_token is not None and not self.auth_token:
            raise ValueError("auth_token is empty: give a non-empty token, or None for an open server")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching = {self.batching!r}: must be one of {BATCHING_MODES}")
        for key, value, allowed, what in (
            ("tree_budget", self.tree_budget, TREE_BUDGETS, "allocates rows across a batched forward"),
            ("allowance", self.allowance, ALLOWANCE_MODES, "sizes trees by the load of batched forwards"),
        ):
            if value not in allowed:
                raise ValueError(f"{key} = {value!r}: must be one of {allowed}")
            if value == "auto" and self.batching != "batched":
                raise ValueError(f"{key} = 'auto' {what}: it needs batching = 'batched', not {self.batching!r}")
        if not (isinstance(self.allowance_floor, int) and 0 <= self.allowance_floor <= self.tree_rows):
            raise ValueError(
                f"allowance_floor = {self.allowance_floor!r}: must be an integer in [0, {self.tree_rows}] (0: K + 1, "
                "the root and the MTP chain; at most tree_rows, B + 1)"
            )
        if self.allowance_target_ms is not None and not (
            isinstance(self.allowance_target_ms, (int, float)) and 0 <= self.allowance_target_ms < math.inf
        ):
            raise ValueError(
                f"allowance_target_ms = {self.allowance_target_ms!r}: must be a number of ms >= 0 (0: none)"
            )
        if not (isinstance(self.min_rows_per_session, int) and self.min_rows_per_session >= 1):
            raise ValueError(f"min_rows_per_session = {self.min_rows_per_session!r}: must be an integer >= 1")
        if not (isinstance(self.max_batch_rows, int) and self.max_batch_rows >= 1):
            raise ValueError(f"max_batch_rows = {self.max_batch_rows!r}: must be an integer >= 1")
        wait = serving_limits.BY_KNOB["max_batch_wait_ms"]  # the range the recipe and the CLI accept
        low, high = wait.ge or 0, wait.le
        if not (isinstance(self.max_batch_wait_ms, (int, float)) and low <= self.max_batch_wait_ms <= high):
            raise ValueError(f"max_batch_wait_ms = {self.max_batch_wait_ms!r}: must lie in [{low}, {high}] ms")
        if not (isinstance(self.max_prefills, int) and self.max_prefills >= 1):
            raise ValueError(f"max_prefills = {self.max_prefills!r}: must be an integer >= 1")
        if self.max_frame_bytes < wire.HEADER.size:
            raise ValueError(
                f"max_frame_bytes = {self.max_frame_bytes}: must hold at least the {wire.HEADER.size}-byte header"
            )


__all__ = ["ServerSettings"]
