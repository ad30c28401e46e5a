"""Where each round's draft is made (paper Table 5's "Place" column), as one object per place.

What differs between the places on the server lives here instead of in string branches over the engine, the
scheduler, the batch, the session loop and the capacity model (SGLang's ``speculative/ngram_info.py`` puts
verification on the algorithm's own object the same way):

==============  ==========================  =================  ==========================  =====================
place           rows a ROUND holds          rows in a forward  acceptance                  after verification
==============  ==========================  =================  ==========================  =====================
``device``      B + 1 (the device's tree,   as sent            the session's (exact or ε)  the hand-off H for
                at most the allowance)                                                     the device's head
``server-head`` B + 1 (the device's SLM     as sent            the session's               the server head's
                rows over the server's                                                     K-chain (K head
                chain)                                                                     steps)
``cloud-mtp``   1 (the root)                root + K-chain     exact (Table 5)             nothing (the next
                                            (K head steps                                  chain is drafted at
                                            before it)                                     the next round)
==============  ==========================  =================  ==========================  =====================

The allowance (`hycoc.verifier.allowance`) is each place's `DraftPlace.allowance`: a device-drafted tree shrinks
with the verifier's load down to the MTP chain plus the root; a cloud-mtp round is always its root alone (the
server drafts its chain), and the row budget never trims it (`DraftPlace.trimmable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from hycoc.protocol.messages import DRAFT_PLACES


class Allowing(Protocol):
    """What `DraftPlace.allowance` asks of its rule: `hycoc.verifier.allowance.AllowanceRule`'s ``grant`` (one
    reply's rows; the capacity simulation's server asks the same rule)."""

    def grant(self, sessions: float | None = None) -> int: ...


@dataclass(frozen=True)
class DraftPlace:
    """One draft place (module docstring's table).

    name: its wire name (`hycoc.protocol.messages.DRAFT_PLACES`). device_rows: whether the device drafts the ROUND's
    rows (B + 1 of them at most) or sends the root alone. server_chain_before: the server drafts a K-chain under the
    root before the forward (cloud-mtp). server_chain_after: the server drafts the next round's K-chain after
    verification (server-head). hand_off: the reply carries the hand-off H (Alg. 4 line 14). exact_only: verified
    with exact acceptance whatever the session asked (Table 5: Cloud+MTP is lossless).
    """

    name: str
    device_rows: bool
    server_chain_before: bool = False
    server_chain_after: bool = False
    hand_off: bool = False
    exact_only: bool = False

    def tree_rows(self, node_rows: int) -> int:
        """Rows a ROUND of this place may hold at most (OPENED's tree_rows): ``node_rows`` (B + 1) when the device
        drafts, else 1 (the root)."""
        return int(node_rows) if self.device_rows else 1

    def forward_rows(self, sent_rows: int, chain_length: int) -> int:
        """Rows a round adds to a verification forward: the rows sent, plus the server's K-chain for cloud-mtp."""
        return int(sent_rows) + (int(chain_length) if self.server_chain_before else 0)

    def head_steps(self, chain_length: int) -> int:
        """MTP head steps the server runs per round (the cost model's server-side drafting): K for cloud-mtp
        (before the forward) and server-head (after it), 0 for device-drafted trees."""
        return int(chain_length) if (self.server_chain_before or self.server_chain_after) else 0

    @property
    def needs_head(self) -> bool:
        """Whether the server runs the verifier's MTP head for this place (cloud-mtp, server-head)."""
        return self.server_chain_before or self.server_chain_after

    @property
    def trimmable(self) -> bool:
        """Whether a row budget may trim this place's rounds (`hycoc.verifier.row_budget`): the device's scored
        trees yes; a cloud-mtp round's rows are the server's own chain and stay whole."""
        return self.device_rows

    def acceptance(self, requested: str) -> str:
        """The acceptance a round runs with: "exact" for an exact-only place, else the session's ``requested``."""
        return "exact" if self.exact_only else requested

    def allowance(self, rule: Allowing | None, tree_rows: int, sessions: float | None = None) -> int:
        """Rows the session's next ROUND may hold (protocol 6's REPLY allowance), in [1, tree_rows]: the rule's
        (`AllowanceRule.grant`, once per reply) for device-drafted trees, clamped to the session's tree_rows; the
        whole tree without a rule (allowance = "fixed"); 1 (the root) when the device sends the root alone."""
        if not self.device_rows:
            return 1
        if rule is None:
            return int(tree_rows)
        return max(1, min(int(tree_rows), rule.grant(sessions)))


#: The places, by wire name (one per `hycoc.protocol.messages.DRAFT_PLACES` entry, in its order).
PLACES: dict[str, DraftPlace] = {
    "device": DraftPlace("device", device_rows=True, hand_off=True),
    "server-head": DraftPlace("server-head", device_rows=True, server_chain_after=True),
    "cloud-mtp": DraftPlace("cloud-mtp", device_rows=False, server_chain_before=True, exact_only=True),
}
assert tuple(PLACES) == DRAFT_PLACES, "one DraftPlace per wire draft place, in DRAFT_PLACES' order"


def draft_place(name: str) -> DraftPlace:
    """The `DraftPlace` of wire name ``name``; raises ValueError naming the places for an unknown one."""
    try:
        return PLACES[name]
    except KeyError:
        raise ValueError(f"draft_place {name!r}: must be one of {', '.join(DRAFT_PLACES)}") from None


__all__ = ["PLACES", "DraftPlace", "draft_place"]
