"""SLM-alone decoding on the bundle's 1-row decode graph (docs/device-runtime.md; paper Table 5's SLM-alone baseline).

`SlmDecoder.step(drafter)` is one greedy token: one forward of the ``slm_decode`` graph (`hycoc.passes.slm.decode`:
the SLM tree graph at 1 row, on the tree graph's quantization grid) for the root r at position t, over the
drafter's own rings (`hycoc.runtime.slm_drafter.SlmDrafter`: position p in column p mod W_i, live from
``live_start``). r's new K/V is written into column t mod W_i of every ring at once, as the tree path writes a
committed row, and ``n_kv`` moves to t + 1; the drafter's `commit` then only appends the token (nothing is
pending). The token is the keep-set id of the graph's ``top_index`` (first among equals, the tree path's rule),
or the arg-max of ``logits`` for a logits-only runner.

The step needs every committed position before r in the ring (``n_kv == t``, no forward yet this round): the
request's first token, after `SlmDrafter.prefill`, still comes from the tree graph, which runs the committed rows
without KV (`SlmDrafter.greedy_next` chooses).

numpy only: this module ships to the phone.
"""

from __future__ import annotations

import numpy as np
from hycoc.runtime.tree_mask import TreeRingMask


def _short(layer_type: str) -> str:
    return layer_type.removesuffix("_attention")


class SlmDecoder:
    """The decode graph's runner with the feeds of one greedy step (module docstring).

    runner: a `hycoc.runtime.graphs.GraphRunner` for the ``slm_decode`` graph (``run``, ``shape``); its rings must
    have the tree graph's shapes (the same bundle). Attributes: ``forwards`` (graph calls). Raises ValueError when
    the graph has more than one row or rings of other shapes than the drafter's.
    """

    def __init__(self, runner):
        self.runner = runner
        if runner.shape("inputs_embeds")[1] != 1:
            raise ValueError(
                f"graph {runner.name}: a decode graph has 1 row, this one has {runner.shape('inputs_embeds')[1]}"
            )
        self.forwards = 0
        self._parents = [-1]
        self._one = {
            "depths": np.zeros(1, np.int64),
            "ancestors": np.ones((1, 1), bool),
            "tree_block": np.zeros((1, 1), np.float32),
        }
        self._masks: dict[str, TreeRingMask] = {}  # layer type -> 1-row mask buffer, updated in place
        self._last_t = None

    def check(self, drafter) -> None:
        """ValueError unless the decode graph's ring inputs have ``drafter``'s ring shapes (one bundle)."""
        for i, (k, _) in drafter.rings.items():
            if tuple(self.runner.shape(f"k_ring_{i}")) != k.shape:
                raise ValueError(
                    f"graph {self.runner.name}: ring {i} is {self.runner.shape(f'k_ring_{i}')}, the "
                    f"tree graph's is {list(k.shape)}; rebuild the bundle"
                )

    def feeds(self, drafter) -> dict[str, np.ndarray]:
        """The decode graph's inputs for r (``drafter.tokens[-1]``) at position ``drafter.t``: float32 arrays by
        input name, the rings the drafter's own arrays, the masks (`hycoc.host.tree_ring_mask` of one row) this
        decoder's buffers, updated in place (`hycoc.runtime.tree_mask.TreeRingMask`: valid until the next call)."""
        b, t = drafter.bundle, drafter.t
        token = np.asarray([drafter.tokens[-1]], np.int64)
        out = {"inputs_embeds": b.slm_luts["embed_tokens"].lookup(token)[None]}
        if drafter.ple:
            out["per_layer_inputs"] = (
                b.slm_luts["embed_tokens_per_layer"].lookup(token).reshape(1, 1, len(drafter.layer_types), drafter.ple)
            )
        at = np.asarray([t], np.int64)
        restart = self._last_t is None or t < self._last_t  # a new request: rewrite the masks
        self._last_t = t
        for lt in drafter.types:
            cos, sin = b.slm_rotary[lt].rows(at)
            out[f"cos_{_short(lt)}"], out[f"sin_{_short(lt)}"] = cos[None], sin[None]
            if lt not in self._masks:
                sw = drafter.sliding_window if lt == "sliding_attention" else None
                self._masks[lt] = TreeRingMask(1, drafter.ring_len[lt], sw)
            if restart:
                self._masks[lt].reset()
            out[f"mask_{_short(lt)}"] = self._masks[lt].update(self._parents, t, drafter.live_start, **self._one)
        for i in drafter.kv_layers:
            out[f"k_ring_{i}"], out[f"v_ring_{i}"] = drafter.rings[i]
        return out

    def step(self, drafter) -> int:
        """One greedy token for ``drafter`` (module docstring): returns its token id, r's KV written at t.
        Raises ValueError when the step's precondition (``n_kv == t``) does not hold."""
        t = drafter.t
        if drafter.n_kv != t:
            raise ValueError(
                f"decode step at t = {t} with SLM KV up to {drafter.n_kv}: run the committed rows "
                "without KV through the tree graph first"
            )
        out = self.runner.run(self.feeds(drafter))
        self.forwards += 1
        drafter._write(out, [0], [t])
        drafter.n_kv = t + 1
        if "top_index" in out:
            index = int(out["top_index"][0, 0, 0])
        else:
            index = int(np.argmax(out["logits"][0, 0]))  # first among equals
        return int(drafter.bundle.keep_set[index])


__all__ = ["SlmDecoder"]
