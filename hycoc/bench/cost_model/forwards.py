"""The forwards the verifier runs for a round, in the cost model's terms (`hycoc.bench.cost_model.model`, which
re-exports everything here and replays a whole bench record with `request_forwards`): `Forward` (kind, rows, context),
`round_forwards` for one round of a draft place, `prefill_forwards` for a prefill's chunks.

What a draft place runs on the server is asked of its `hycoc.verifier.draft_place.DraftPlace`, not branched on its
name: a place whose server drafts the chain before verification (Cloud+MTP: ``server_chain_before``) runs its head
steps before the verify forward, one that drafts the next chain after it (server-head: ``server_chain_after``) runs
them after, and a device-drafted place (``needs_head`` false) runs none. The places are imported when a round is
replayed (`hycoc.verifier` loads torch): this module, like the cost model, imports without torch.
"""

from __future__ import annotations

from typing import NamedTuple

from hycoc.table5 import CONFIGURATIONS

#: Prompt positions per prefill forward: `hycoc.verifier.engine.VerifierEngine`'s ``prefill_chunk`` default, which
#: `hycoc verify-server` uses (one value: `hycoc.verifier.kv_cache.DEFAULT_PREFILL_CHUNK`).
PREFILL_CHUNK = 512

#: bench configuration (Table 5) -> the draft place its sessions use (`hycoc.table5`), those with a verifier (a
#: draft place: `Configuration.verifier`).
DRAFT_PLACE_OF = {c.name: c.draft_place for c in CONFIGURATIONS if c.draft_place is not None}


class CostModelError(ValueError):
    """A cost model file that cannot be used (missing, not JSON, a bad or missing field, an incomplete grid), or a
    prediction asked outside what the model can answer. The message names the file and field and how to fix it."""


class Forward(NamedTuple):
    """One forward the server runs: ``kind`` (`hycoc.bench.cost_model.model.KINDS`), ``rows`` and ``context`` as
    `hycoc.bench.cost_model.model`'s docstring defines them per kind."""

    kind: str
    rows: int
    context: int


def round_place(name: str):
    """The `hycoc.verifier.draft_place.DraftPlace` of wire name ``name``; CostModelError for an unknown one."""
    from hycoc.protocol.messages import DRAFT_PLACES
    from hycoc.verifier.draft_place import PLACES

    if name not in PLACES:
        raise CostModelError(f"draft_place = {name!r}: one of {', '.join(DRAFT_PLACES)}")
    return PLACES[name]


def round_forwards(
    draft_place: str, rows: int, context: int, *, head_steps: int = 0, head_context: int = 0
) -> list[Forward]:
    """The forwards of one round (Alg. 4; Table 5's server-side baselines), in the order the engine runs them.

    draft_place: "device" (HyCo, SpecEdge: verification only), "cloud-mtp" (``head_steps`` head steps reading
    ``context`` positions, then verification of root + chain: rows = head_steps + 1) or "server-head"
    (verification, then ``head_steps`` head steps reading ``head_context`` = min(W, t') positions). rows, context:
    the verification forward's R and t. Raises CostModelError for an unknown place, rows < 1, negative counts, or
    a cloud-mtp round whose rows are not head_steps + 1.
    Example: round_forwards("cloud-mtp", 5, 300, head_steps=4) is four Forward("head_step", 1, 300), then
    Forward("verify", 5, 300).
    """
    if rows < 1 or context < 0 or head_steps < 0 or head_context < 0:
        raise CostModelError(
            f"round rows = {rows}, context = {context}, head_steps = {head_steps}, head_context = "
            f"{head_context}: need rows >= 1 and the rest >= 0"
        )
    place = round_place(draft_place)
    verify = Forward("verify", int(rows), int(context))
    if not place.needs_head:
        if head_steps:
            raise CostModelError(
                f"a device-drafted round runs no head step on the server, got head_steps = {head_steps}"
            )
        return [verify]
    if place.server_chain_before:  # the root alone is sent: the server's chain is verified with it
        if rows != place.forward_rows(1, head_steps):
            raise CostModelError(
                f"a {draft_place} round verifies the root and its {head_steps}-token chain: rows must "
                f"be {head_steps + 1}, got {rows}"
            )
        return [Forward("head_step", 1, int(context))] * head_steps + [verify]
    return [verify] + [Forward("head_step", 1, int(head_context))] * head_steps


def prefill_forwards(start: int, stop: int, chunk: int = PREFILL_CHUNK) -> list[Forward]:
    """The prefill chunks that fill positions [start, stop) (`hycoc.verifier.forward.prefill`): Forward("prefill",
    n, t) for t = start, start + chunk, ... with n = min(chunk, stop - t). Empty when stop <= start. Raises
    CostModelError for chunk < 1 or start < 0."""
    if chunk < 1 or start < 0:
        raise CostModelError(f"prefill start = {start}, chunk = {chunk}: need start >= 0 and chunk >= 1")
    return [Forward("prefill", min(chunk, stop - t), t) for t in range(start, stop, chunk)]


__all__ = [
    "DRAFT_PLACE_OF",
    "PREFILL_CHUNK",
    "CostModelError",
    "Forward",
    "prefill_forwards",
    "round_forwards",
    "round_place",
]
