"""What the device's drafters use (runtime/drafters.py), and nothing else of the runtime.

A `DraftContext` is made once per `hycoc.runtime.client.DeviceRuntime` (`DraftContext.load`, from the bundle and
its graph runners) and handed to every `hycoc.runtime.drafters.Drafter` the runtime makes (one per request), in
place of the runtime itself: the drafters share the MTP Drafter's and the SLM Drafter's rings (a conversation's
state), read the bundle's round constants, and make their tree builders through `DraftContext.tree_builder`. The
round loop, the streaming, the OPEN and the timing stay the runtime's; a drafter's own per-request state (its tree
builder, the last tree, the path's SLM nodes, the rounds drafted without an SLM pass) is the drafter's.

The shape follows vLLM's ``SpecDecodeMetadata`` (vllm/v1/spec_decode/metadata.py): a plain dataclass of exactly what
its users read, with a `DraftContext.make_dummy` constructor that fills what a test does not care about, so tests
build a drafter (or a runtime, ``DeviceRuntime(bundle, drafting=...)``) from stand-ins without faking the runtime.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
from hycoc.runtime.mtp_drafter import MtpDrafter
from hycoc.runtime.slm_drafter import SlmDrafter
from hycoc.runtime.tree_builder import TreeBuilder

if TYPE_CHECKING:
    from hycoc.bundle import RoundConstants

#: `DraftContext.make_dummy`'s round constants: the paper's Table 5 / App. C values (K = 4, D = 2, B = 32, λ = 0.66,
#: 32 SLM candidates, 1 SLM pass; SpecEdge-style: 4 passes, 20 nodes)
DUMMY_ROUND = {
    "chain_length": 4,
    "sibling_depth": 2,
    "node_budget": 32,
    "depth_cost": 0.66,
    "slm_candidates": 32,
    "slm_passes": 1,
    "specedge_passes": 4,
    "specedge_nodes": 20,
}


@dataclass(frozen=True, eq=False)
class DraftContext:
    """What a device drafter uses (module docstring).

    round: the bundle's round constants (`hycoc.bundle.RoundConstants`: K ``chain_length``, D ``sibling_depth``, B
    ``node_budget``, λ ``depth_cost``, ``slm_candidates``, ``slm_passes``, ``specedge_passes``,
    ``specedge_nodes``). mtp: the MTP Drafter (Alg. 2; ``reset``, ``ingest``, ``draft``). slm: the SLM Drafter
    (Alg. 3 lines 7-8, Alg. 1 line 10; ``start``, ``prefill``, ``rollback``, ``catch_up``, ``expand``, ``commit``,
    ``greedy_next``, ``tokens``). keep_set: int64 (|V|,) the drafters' output vocabulary (keep-set index ->
    token id). stop_ids: the ids that end a model turn. builder_class: the class `tree_builder` makes
    (`hycoc.runtime.tree_builder.TreeBuilder`; a test's subclass may record what it builds).
    """

    round: RoundConstants
    mtp: MtpDrafter
    slm: SlmDrafter
    keep_set: np.ndarray
    stop_ids: frozenset[int]
    builder_class: type[TreeBuilder] = TreeBuilder

    @classmethod
    def load(cls, bundle: Any, head: Any, slm: Any, slm_decode: Any = None) -> DraftContext:
        """The context of a loaded bundle (`hycoc.runtime.device_bundle.DeviceBundle`) over its graph runners:
        head (the MTP head graph), slm (the SLM tree graph), slm_decode (the 1-row ``slm_decode`` graph slm-alone
        decodes with, `hycoc.runtime.slm_decode`; None: it decodes on the tree graph). Raises what the SLM decoder's
        check raises when the two SLM graphs disagree."""
        mtp_drafter = MtpDrafter(head, bundle)
        slm_drafter = SlmDrafter(slm, bundle, candidates=bundle.round.slm_candidates)
        if slm_decode is not None:  # slm-alone's 1-row graph (`hycoc.runtime.slm_decode`)
            from hycoc.runtime.slm_decode import SlmDecoder

            slm_drafter.decoder = SlmDecoder(slm_decode)
            slm_drafter.decoder.check(slm_drafter)
        stop_ids = frozenset(bundle.stop_token_ids())
        return cls(bundle.round, mtp_drafter, slm_drafter, bundle.keep_set, stop_ids)

    @classmethod
    def make_dummy(
        cls,
        *,
        mtp: Any = None,
        slm: Any = None,
        keep_set: np.ndarray | Sequence[int] | None = None,
        stop_ids: Iterable[int] = (1,),
        builder_class: type[TreeBuilder] = TreeBuilder,
        **round_constants: Any,
    ) -> DraftContext:
        """A context for tests: the given stand-ins, and for what is left out the paper's round constants
        (`DUMMY_ROUND`, each overridable by keyword: ``node_budget=6``, ...), a keep set of ids 0..9 and stop id 1.
        The MTP and SLM Drafters left out are None: a drafter that reaches them fails there. Round constants the
        runtime reads beyond the drafters' (``max_new_tokens``, ``temperature``, ...) pass through as given."""
        rnd = SimpleNamespace(**{**DUMMY_ROUND, **round_constants})
        keep = np.arange(10) if keep_set is None else np.asarray(keep_set)
        return cls(rnd, mtp, slm, keep, frozenset(int(s) for s in stop_ids), builder_class)  # type: ignore[arg-type]

    def tree_builder(self, budget: int, passes: int, rows: int) -> TreeBuilder:
        """The tree factory of Alg. 3 for a drafter's trees: ``budget`` draft nodes (B, root excluded), ``passes``
        SLM passes, ``rows`` rows per tree (the verifier's B + 1), with the round's λ and SLM candidates, the keep
        set and the stop ids."""
        r = self.round
        return self.builder_class(
            ln_lambda=math.log(r.depth_cost),
            budget=budget,
            rows=rows,
            candidates=r.slm_candidates,
            passes=passes,
            keep_set=self.keep_set,
            stop_ids=self.stop_ids,
        )


__all__ = ["DUMMY_ROUND", "DraftContext"]
