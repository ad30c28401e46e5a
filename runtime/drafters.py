"""The device's drafters, one class per Table 5 drafter behind one interface (paper Alg. 1 lines 2-4, Algs. 2-3).

`DeviceRuntime` (`hycoc.runtime.client`) runs the round loop (Alg. 1) and asks a `Drafter` for each tree; what
differs between the configurations of Table 5 is the drafter, picked by the configuration's name in `DRAFTERS`:

======================  ======================  ======================================================
drafter                 configurations          tree (Alg. 3 over ...)
======================  ======================  ======================================================
`MtpChainDrafter`       hyco, hyco-exact        the device's MTP chain + runner-ups (Alg. 2), then
                                                ``[tree] slm_passes`` SLM passes, B nodes
`MtpChainTwoPass`       hyco-2p                 same, two SLM passes (Alg. 3 line 15)
`ServerChainDrafter`    server-head             the chain the verifier's head sent in the reply, SLM
`SpecEdgeDrafter`       specedge, specedge-eps  no chain: ``specedge_passes`` SLM passes,
                                                ``specedge_nodes`` nodes
`CloudMtpDrafter`       cloud-mtp               the root alone: the server drafts its K-chain itself
`SlmAloneDrafter`       slm-alone               no tree, no verifier: greedy SLM decoding, a token a step
======================  ======================  ======================================================

The shape follows vLLM's speculative proposers (one class per method, ``propose()`` behind one interface) and
transformers' ``CandidateGenerator`` (``get_candidates`` / ``update_candidate_strategy``): `Drafter.draft` gives the
next tree, `Drafter.read` reads the verifier's reply against it, `Drafter.accept` takes the committed tokens, and
`Drafter.reset` / `Drafter.start` / `Drafter.prefill` / `Drafter.rollback` are the request's and the conversation's
state hooks. A drafter gets what it uses, not the runtime: a `hycoc.runtime.draft_context.DraftContext` (the MTP
Drafter, the SLM Drafter, the bundle's round constants, the keep set, the stop ids and the tree builder factory),
one per `DeviceRuntime`, shared by every drafter the runtime makes (one per request). What a drafter drafts from is
its own: the tree builder, the last tree (`SlmTreeDrafter.built`), its path's SLM nodes and the rounds drafted without
an SLM pass; the SLM expansion of a tree is `SlmTreeDrafter.build_tree`
(`hycoc.runtime.tree_builder.TreeBuilder.build` with the SLM Drafter's ``expand``).

Acceptance and draft place are the configuration's (`hycoc.runtime.client.Mode`), sent in the OPEN; a drafter
does not repeat them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, ClassVar

import numpy as np
from hycoc.runtime.transport import BadReply
from hycoc.runtime.tree_builder import BuiltTree, TreeBuilder, check_verified, walk_reply

from hycoc.protocol.messages import DraftTree, RoundReply

if TYPE_CHECKING:
    from hycoc.runtime.client import Mode
    from hycoc.runtime.draft_context import DraftContext


class RuntimeProtocolError(RuntimeError):
    """The verifier's reply contradicts the tree it answers (e.g. its path does not follow its samples)."""


def allowed_rows(seq: int, reply: RoundReply | None, tree_rows: int) -> int:
    """The rows the tree after ``reply`` (the reply to round ``seq``; None before the first) may hold: the reply's
    ``allowance`` (protocol 6, the verifier's load-based bound, root included), ``tree_rows`` (the session's
    `hycoc.protocol.messages.Opened.tree_rows`) when none is set (0) or before the first reply. Raises
    RuntimeProtocolError naming the field for an allowance outside [1, tree_rows]."""
    allowance = 0 if reply is None else int(reply.allowance)
    if allowance == 0:
        return int(tree_rows)
    if not 1 <= allowance <= tree_rows:
        raise RuntimeProtocolError(
            f"round {seq}: the verifier's reply sets allowance = {allowance} (RoundReply.allowance), outside "
            f"[1, {tree_rows}]: a tree holds at least its root and at most the session's tree rows"
        )
    return allowance


class Drafter(ABC):
    """One Table 5 drafter on the device (module docstring), made per request by `DeviceRuntime.drafter`.

    context: what the drafter uses (`hycoc.runtime.draft_context.DraftContext`: the MTP and SLM Drafters, the round
    constants, the keep set, the stop ids, the tree builder factory); mode: its configuration
    (`hycoc.runtime.client.Mode`; ``name`` appears in errors).

    A verified request calls, in order: `reset`; `start` and `prefill` (when `uses_slm`, while the verifier prefills);
    `begin` with the verifier's tree rows; then per round `draft` (the first with ``reply=None``), the verifier's
    reply, `read`, the commit cut, `accept`. A next turn calls `rollback` first. slm-alone (`verified` False) calls
    `start`, `prefill`, then `draft` and `accept` per token.
    """

    #: False: the drafter decodes alone, with no verifier (slm-alone)
    verified: ClassVar[bool] = True
    #: the SLM Drafter's ring follows the conversation: filled at the request's start, committed each round, rolled
    #: back for a next turn
    uses_slm: ClassVar[bool] = True
    #: the device drafts its trees (False: the server drafts, and the device's drafting time is not counted)
    drafts: ClassVar[bool] = True

    def __init__(self, context: DraftContext, mode: Mode):
        self.context, self.mode = context, mode
        self.tree_rows = 0  # the session's tree rows (`begin`)

    # ---- the request's state hooks -----------------------------------------------------------------------------

    def reset(self) -> None:  # noqa: B027  (an optional hook: a no-op unless a drafter needs it)
        """A new request or turn starts (before its OPEN / APPEND): forget per-request drafting state."""

    def start(self, prompt: list[int], keep: int | None = None) -> None:
        """Alg. 1's request start: the SLM ring takes the prompt (a next turn's: the ids after the ``keep`` it was
        rolled back to). No-op without the SLM."""
        if not self.uses_slm:
            return
        slm = self.context.slm
        if keep is None:
            slm.start(prompt)
        else:  # the ring was rolled back to keep (`DeviceRuntime.next_turn`)
            slm.commit([], prompt[keep:])

    def prefill(self) -> None:
        """Fill the SLM Drafter's cache with the prompt's last W tokens (App. C), reserving the rows the chain and
        siblings plant. No-op without the SLM."""
        if self.uses_slm:
            r = self.context.round
            self.context.slm.prefill(reserve=r.chain_length + r.sibling_depth)

    def rollback(self, keep: int) -> None:
        """A next turn keeps the first ``keep`` held ids: the SLM ring rolls back to them
        (`hycoc.runtime.slm_drafter.SlmDrafter.rollback`). No-op without the SLM."""
        if self.uses_slm:
            self.context.slm.rollback(keep)

    def begin(self, tree_rows: int) -> None:
        """The verifier took the session and verifies trees of ``tree_rows`` rows (its B + 1; each reply's allowance
        may bound the next tree below it, `allowed_rows`). Raises ValueError when this drafter's trees do not
        fit."""
        self.tree_rows = int(tree_rows)

    # ---- a round -----------------------------------------------------------------------------------------------

    @abstractmethod
    def draft(self, seq: int, reply: RoundReply | None, root: int, room: int) -> DraftTree:
        """Alg. 1 lines 3-4: the tree of round ``seq`` under ``root`` (x_{t+1}), from the last round's ``reply``
        (None for a request's first tree, drafted while the server prefills), at most ``room`` nodes deep (the
        tokens left under max_new_tokens and the context) and at most the reply's allowance of rows
        (`allowed_rows`). Raises BadReply when the reply lacks what the drafter needs (a hand-off, for the MTP
        chain), RuntimeProtocolError for an allowance out of range."""

    @abstractmethod
    def read(self, seq: int, reply: RoundReply) -> list[int]:
        """Alg. 1 lines 8-9: the tokens ``reply`` commits for the tree of round ``seq`` (the path's tokens, then the
        bonus), before the stop / max-new-tokens / context cut. Raises RuntimeProtocolError when the reply
        contradicts the tree."""

    def accept(self, new: list[int]) -> None:  # noqa: B027  (an optional hook)
        """Alg. 1 line 10: ``new`` (the round's committed tokens after the cut) is committed; a drafter moves its
        state past them."""


# ---- Alg. 3 trees: the SLM expansion of a chain ------------------------------------------------------------------


class SlmTreeDrafter(Drafter):
    """The SLM expansion (Alg. 3): a chain and runner-ups planted under the root (`chain`), then SLM passes and the
    trim to the node budget. Subclasses say where the chain comes from and how many passes / nodes a tree has."""

    def __init__(self, context: DraftContext, mode: Mode):
        super().__init__(context, mode)
        self.tree_builder: TreeBuilder | None = None
        self.built: BuiltTree | None = None
        self._path_nodes: list[int] = []
        #: rounds since the last SLM pass whose trees ran none (drafted at the allowance's floor): the committed
        #: tokens they added lack SLM KV until the next pass catches up (`SlmDrafter.catch_up`)
        self.slm_skipped = 0

    def passes(self) -> int:
        """SLM passes per tree (Alg. 3 lines 7-15): the bundle's ``[tree] slm_passes``."""
        return self.context.round.slm_passes

    def budget(self) -> int:
        """Draft nodes per tree, root excluded (B): the bundle's ``[tree] node_budget``."""
        return self.context.round.node_budget

    def chain(self, seq: int, reply: RoundReply) -> tuple[list[int], list[int]]:
        """(chain y_{1:K}, runner-ups y'_{1:D}) as token ids for round ``seq``'s tree from the last reply; none by
        default (the tree is the SLM's alone)."""
        return [], []

    def builder(self, tree_rows: int) -> TreeBuilder:
        """The tree builder of this drafter for trees of ``tree_rows`` rows (the verifier's B + 1). Raises
        ValueError when the node budget does not fit them."""
        budget = self.budget()
        if budget + 1 > tree_rows:
            raise ValueError(
                f"mode {self.mode.name} drafts {budget} nodes, the verifier takes {tree_rows} rows per tree "
                "(node_budget + 1); use matching recipes for the bundle and the server"
            )
        return self.context.tree_builder(budget, self.passes(), tree_rows)

    def begin(self, tree_rows: int) -> None:
        super().begin(tree_rows)
        self.tree_builder = self.builder(tree_rows)

    def draft(self, seq: int, reply: RoundReply | None, root: int, room: int) -> DraftTree:
        """Alg. 1 lines 3-4 (`Drafter.draft`). A tree of rows at the floor (the root and the chain, no SLM pass:
        `hycoc.runtime.tree_builder.TreeBuilder.at_floor`) leaves the SLM out, so its committed tokens wait
        without SLM KV; the next tree with an SLM pass first catches them up (`SlmDrafter.catch_up`, reserving the
        rows the chain and runner-ups plant)."""
        builder = self.tree_builder
        if builder is None:
            raise RuntimeError("Drafter.draft before begin: the verifier's tree rows are not known yet")
        rows = allowed_rows(seq - 1, reply, self.tree_rows)
        # the first tree: the SLM alone while the server prefills (App. C); the root is the SLM's last token
        chain, runner_ups = ([], []) if reply is None else self.chain(seq, reply)
        if builder.at_floor(rows, len(chain)):
            self.slm_skipped += 1
        elif self.slm_skipped and builder.passes > 0:
            r = self.context.round
            self.context.slm.catch_up(reserve=r.chain_length + r.sibling_depth)
            self.slm_skipped = 0
        self.built = self.build_tree(builder, chain, runner_ups, room, rows)
        return DraftTree(seq, self.built.tokens, self.built.parents, self.built.scores)

    def build_tree(
        self, builder: TreeBuilder, chain: list[int], runner_ups: list[int], max_depth: int | None, rows: int
    ) -> BuiltTree:
        """Alg. 3 over ``chain`` / ``runner_ups`` under the SLM's last token (the root), at most ``max_depth`` nodes
        deep and ``rows`` rows (the allowance), with the SLM Drafter's expansion when ``builder`` runs SLM passes
        at ``rows`` rows (none at the floor, `hycoc.runtime.tree_builder.TreeBuilder.at_floor`)."""
        slm = self.context.slm
        expand = slm.expand if builder.passes > 0 and not builder.at_floor(rows, len(chain)) else None
        return builder.build(slm.tokens[-1], chain, runner_ups, expand, max_depth=max_depth, rows=rows)

    def read(self, seq: int, reply: RoundReply) -> list[int]:
        """Walk ``reply`` through the rows it verified (`hycoc.runtime.tree_builder.walk_reply`; ties to the lowest
        row), check it against the verifier's own path and bonus, and remember the path's SLM nodes for
        `accept`."""
        built = self.built
        if built is None:
            raise RuntimeError("Drafter.read before draft")
        tokens, parents, verified = built.tokens, built.parents, reply.verified
        if verified is not None:
            try:
                check_verified(parents, verified, reply.path_rows)
            except ValueError as e:
                raise RuntimeProtocolError(f"round {seq}: the verifier's reply is inconsistent: {e}") from None
        path = walk_reply(tokens, parents, reply.samples, verified)
        if path != [int(x) for x in reply.path_rows]:
            raise RuntimeProtocolError(
                f"round {seq}: the verifier's path rows {reply.path_rows.tolist()} do "
                f"not follow its samples (walk gives {path})"
            )
        if reply.samples[path[-1] if path else 0] != reply.bonus:
            raise RuntimeProtocolError(f"round {seq}: bonus {reply.bonus} is not the sample at the path's end")
        self._path_nodes = [built.row_node[j] for j in path]
        return [int(tokens[j]) for j in path] + [int(reply.bonus)]

    def accept(self, new: list[int]) -> None:
        """Alg. 1 line 10: the SLM rows of the committed path move behind the root's (path nodes only: a row left
        unverified never reaches the ring); a stop id that ends the turn gets no SLM KV (a next turn's rendering
        decides its fate)."""
        nodes = self._path_nodes
        self.context.slm.commit(nodes[: len(new) - 1] if new[-1] in self.context.stop_ids else nodes, new)


class MtpChainDrafter(SlmTreeDrafter):
    """HyCo's hybrid tree (hyco, hyco-exact): the device's MTP Drafter (Alg. 2) drafts the chain and runner-ups from
    each reply's hand-off, the SLM expands them (Alg. 3)."""

    def reset(self) -> None:
        """Forget the MTP Drafter's ring (`hycoc.runtime.mtp_drafter.MtpDrafter.reset`)."""
        self.context.mtp.reset()

    def chain(self, seq: int, reply: RoundReply) -> tuple[list[int], list[int]]:
        """Alg. 2 on the reply's hand-off. Raises BadReply without one, HandoffError for a bad one."""
        if reply.handoff is None:
            raise BadReply(f"round {seq - 1}: the verifier sent no hand-off to a device-drafting session")
        self.context.mtp.ingest(reply.handoff)
        d = self.context.mtp.draft()
        return d.chain, d.runner_ups


class MtpChainTwoPass(MtpChainDrafter):
    """HyCo-2P (hyco-2p): `MtpChainDrafter` with a second SLM pass over the nodes the first added (Alg. 3 line 15)."""

    def passes(self) -> int:
        return 2


class ServerChainDrafter(SlmTreeDrafter):
    """The server-head variant (server-head): the verifier's full-precision head drafts the chain on the server
    (`hycoc.verifier.baselines.draft_server_chain`) and sends it in the reply; the device plants it without
    runner-ups and expands it with the SLM."""

    def chain(self, seq: int, reply: RoundReply) -> tuple[list[int], list[int]]:
        return [int(x) for x in reply.chain], []


class SpecEdgeDrafter(SlmTreeDrafter):
    """The SpecEdge-style tree (specedge, specedge-eps): no chain; ``[tree] specedge_passes`` SLM passes grow a tree
    of ``specedge_nodes`` nodes (Table 5)."""

    def passes(self) -> int:
        return self.context.round.specedge_passes

    def budget(self) -> int:
        return self.context.round.specedge_nodes


# ---- no device tree ----------------------------------------------------------------------------------------------


class CloudMtpDrafter(Drafter):
    """Cloud+MTP (cloud-mtp): the device sends the root alone, without scores; the verifier drafts root + K-chain
    with its own head (`hycoc.verifier.baselines.draft_cloud_chain`) and its reply's rows are that chain. No SLM."""

    uses_slm = False
    drafts = False

    def draft(self, seq: int, reply: RoundReply | None, root: int, room: int) -> DraftTree:
        """The root alone (one row, whatever the allowance: the floor of a chain the server drafts). Raises
        RuntimeProtocolError for an allowance out of range."""
        allowed_rows(seq - 1, reply, self.tree_rows or 1)
        return DraftTree(seq, np.asarray([root], np.int32), np.asarray([-1], np.int32), None)

    def read(self, seq: int, reply: RoundReply) -> list[int]:
        """The server's chain: its path rows are rows of root + chain, so the committed tokens are the first
        |P| + 1 samples."""
        return [int(x) for x in reply.samples[: len(reply.path_rows) + 1]]


class SlmAloneDrafter(Drafter):
    """The SLM alone (slm-alone, On-device 8K of Table 5): greedy decoding on the device, no verifier. Each `draft`
    is the one next token (a one-row "tree" that nobody verifies), and `accept` commits it to the ring. Decodes
    with the bundle's 1-row ``slm_decode`` graph when loaded (`hycoc.runtime.slm_decode`)."""

    verified = False

    def prefill(self) -> None:
        self.context.slm.prefill(reserve=1)

    def draft(self, seq: int, reply: RoundReply | None, root: int, room: int) -> DraftTree:
        token = self.context.slm.greedy_next()
        return DraftTree(seq, np.asarray([token], np.int32), np.asarray([-1], np.int32), None)

    def read(self, seq: int, reply: RoundReply) -> list[int]:
        raise RuntimeError("slm-alone has no verifier: nothing replies to its drafts")

    def accept(self, new: list[int]) -> None:
        self.context.slm.commit([], new)


#: Table 5 configuration name -> its drafter (`hycoc.runtime.client.MODES` names the same configurations).
DRAFTERS: dict[str, type[Drafter]] = {
    "hyco": MtpChainDrafter,
    "hyco-exact": MtpChainDrafter,
    "hyco-2p": MtpChainTwoPass,
    "specedge": SpecEdgeDrafter,
    "specedge-eps": SpecEdgeDrafter,
    "server-head": ServerChainDrafter,
    "cloud-mtp": CloudMtpDrafter,
    "slm-alone": SlmAloneDrafter,
}


def drafter_class(name: str, names: Sequence[str] | None = None) -> type[Drafter]:
    """The drafter of configuration ``name``. Raises ValueError naming the choices (``names``, default every
    registered one) for an unknown name."""
    cls = DRAFTERS.get(name)
    if cls is None or (names is not None and name not in names):
        raise ValueError(f"unknown mode {name!r}; choose one of {', '.join(names or DRAFTERS)}")
    return cls


__all__ = [
    "DRAFTERS",
    "CloudMtpDrafter",
    "Drafter",
    "MtpChainDrafter",
    "MtpChainTwoPass",
    "RuntimeProtocolError",
    "ServerChainDrafter",
    "SlmAloneDrafter",
    "SlmTreeDrafter",
    "SpecEdgeDrafter",
    "allowed_rows",
    "drafter_class",
]
