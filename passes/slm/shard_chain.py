"""The SLM tree graph's shards as a chain (`passes/slm/graph.py` module docstring, "Shards"): one `SlmTreeGraph` per
shard of the layer bounds, and the torch shards run in order on the monolithic graph's host feeds, each shard's
inputs resolved by name from the earlier shards' outputs or the host feeds (`hycoc.bundle.shard_feeds`, the
resolution the device runtime's `ShardChainRunner` uses too). The build calibrates shard k on its inputs there
(`hycoc.passes.slm.shard_build`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from hycoc.passes.artifacts import SlmIntegerModel
from hycoc.passes.slm.graph import SlmGraphError, SlmTreeGraph, check_bounds, text_config

from hycoc.bundle import ShardFeedMissing, shard_feeds


def shard_graphs(
    slm: SlmIntegerModel, keep_ids: Sequence[int], *, rows: int, ring: Mapping[str, int], bounds: Sequence[int]
) -> list[SlmTreeGraph]:
    """One `SlmTreeGraph` per shard of ``bounds`` (module docstring, "Shards"), in chain order."""
    n = len(check_bounds(bounds, text_config(slm).num_hidden_layers)) - 1
    return [SlmTreeGraph(slm, keep_ids, rows=rows, ring=ring, bounds=bounds, shard=k) for k in range(n)]


def chain_feeds(graph, feeds: Mapping[str, Any], produced: Mapping[str, Any]) -> dict[str, Any]:
    """Inputs of shard ``graph`` by name, from the earlier shards' ``produced`` outputs or the host ``feeds``
    (`hycoc.bundle.shard_feeds`, the resolution the device runtime uses too). Raises SlmGraphError naming an input
    found in neither."""
    try:
        return shard_feeds(str(graph.shard), graph.input_names, feeds, produced)
    except ShardFeedMissing as e:
        raise SlmGraphError(str(e)) from None


def run_shard_chain(
    shards: Sequence[SlmTreeGraph], feeds: Mapping[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """Run the torch shards in order on the monolithic graph's host ``feeds`` (float32 by name). Returns (every
    shard's outputs by name, [each shard's input dict]) -- the latter are the per-shard calibration samples."""
    produced: dict[str, np.ndarray] = {}
    inputs = []
    for g in shards:
        x = chain_feeds(g, feeds, produced)
        inputs.append(x)
        with torch.no_grad():
            outs = g(*[torch.from_numpy(np.ascontiguousarray(x[n], dtype=np.float32)) for n in g.input_names])
        produced.update({n: o.numpy() for n, o in zip(g.output_names, outs)})
    return produced, inputs


__all__ = ["chain_feeds", "run_shard_chain", "shard_graphs"]
