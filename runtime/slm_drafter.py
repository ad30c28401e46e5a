"""The SLM Drafter on the device: its ring KV, its tree forwards and the commit of a reply (paper Alg. 3 lines
7-8, Alg. 1 line 10, §3.4, App. A).

State: the committed tokens (position = index; the last one is the root r at position t), and per ring layer i
(``host.slm.kv_layers``) a ring of W_i columns, ``[1, kv_heads, W_i, head_dim]`` (W_i = ``slm_window`` for
full-attention layers, ``slm_sliding_window`` for sliding ones), holding the SLM's K (rotated) and V of committed
positions [live_start, n_kv): **position p lives in column p mod W_i**, the tree graph's convention
(`hycoc.host.tree_ring_mask`).

Request start (Alg. 1, App. C): the ring is filled with the prompt's last W tokens: live_start = n_kv =
max(0, t - W). Committed positions [n_kv, t) still need SLM KV; the first forward of each round runs them as a
chain of rows ending with r (Alg. 3 line 7 "committed tokens without SLM KV, ending with r"), after as many
R-row chunks of committed tokens as needed to leave room for the tree (`prefill`, timed separately: it overlaps
the server's prefill).

`expand(tree, nodes)` is one SLM forward (line 8), returning each node's candidates (`hycoc.runtime.candidates`): rows =
[committed rows without KV, in the first forward of a round] + r + for each node, in the order given, its
not-yet-included ancestors and itself, while they fit the graph's R rows (the rest are left out and reported as not
expanded). Rows are padded to R by repeating the last row (as a child of row 0 when the last row is row 0); padding
rows' outputs are ignored. Committed rows are written into the ring at once; the KV of r and of tree nodes is kept for
the commit. Row j attends to the ring and its ancestor rows (`tree_ring_mask`), so a node's KV equals what a causal
forward over its path would give.

`commit(path_nodes, new_tokens)` is Alg. 1 line 10: r's KV is written at t, then the path's nodes at t + 1, ...
for as long as each has SLM KV from this round; n_kv moves past them; the bonus token and the path's nodes
without KV become the next round's committed rows without KV.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np
from hycoc.runtime.candidates import Candidates, graph_candidate_rows, logits_candidates
from hycoc.runtime.graphs import input_buffer, input_encoding, quantize, zero_code
from hycoc.runtime.tree_builder import DraftTreeNodes
from hycoc.runtime.tree_mask import TreeRingMask

from hycoc.host import MASK_VALUE, RotaryBlock, ring_runs, tree_rows

if TYPE_CHECKING:
    from hycoc.runtime.slm_decode import SlmDecoder


def _short(layer_type: str) -> str:
    return layer_type.removesuffix("_attention")


class SlmDrafter:
    """The SLM Drafter (module docstring) around the SLM tree graph's runner.

    runner: a `hycoc.runtime.graphs.GraphRunner` for the ``slm`` graph (``run``, ``shape``); bundle: the
    `hycoc.runtime.device_bundle.DeviceBundle` (LUTs, rotary tables, host constants, round constants).
    candidates: k, the candidates `expand` returns per node (Alg. 3 line 10: 32), read from the graph's
    ``top_index`` / ``top_logq`` outputs when its runner gives them, else taken from its ``logits`` on the host
    (`hycoc.runtime.candidates`). Attributes: ``forwards`` (graph calls), ``prefill_seconds`` (request-start
    fill time).
    """

    def __init__(self, runner, bundle, candidates: int = 32):
        self.runner, self.bundle = runner, bundle
        self.candidates = int(candidates)
        host = bundle.host.slm
        self.layer_types = list(host.layer_types)
        self.kv_layers = list(host.kv_layers)
        self.sliding_window = host.sliding_window
        self.ple = host.per_layer_dim
        self.rows = runner.shape("inputs_embeds")[1]
        self.types = sorted(set(self.layer_types))
        self.ring_len = {}
        for t in self.types:
            self.ring_len[t] = runner.shape(f"mask_{_short(t)}")[-1] - self.rows
        # each type's mask in one buffer, updated in place per forward (`TreeRingMask`: nothing per forward grows
        # with W)
        self.masks = {
            t: TreeRingMask(self.rows, self.ring_len[t], self.sliding_window if t == "sliding_attention" else None)
            for t in self.types
        }
        self._rotary = {t: RotaryBlock(bundle.slm_rotary[t]) for t in self.types}
        # name -> (LUT, its dense float32 table or None): a small table's rows are one gather per forward
        # (a LUT without `dense`, such as a test's stand-in, is always looked up)
        self._luts = {
            name: (lut, lut.dense() if hasattr(lut, "dense") else None) for name, lut in bundle.slm_luts.items()
        }
        self.rings = {
            i: (input_buffer(runner, f"k_ring_{i}"), input_buffer(runner, f"v_ring_{i}")) for i in self.kv_layers
        }  # HTP shared memory when the runner has it
        # per ring layer (k, v): the encoding of rings kept as the graph's integer codes (quantized IO), else None
        self.ring_encodings = {
            i: (input_encoding(runner, f"k_ring_{i}"), input_encoding(runner, f"v_ring_{i}")) for i in self.kv_layers
        }
        self.window = max(self.ring_len.values())
        self._layouts: dict[tuple, tuple] = {}  # parent list -> `_rows_of`
        # the graph's input names, formatted once: per layer type (type, cos, sin, mask), and the rings' buffers
        self._type_inputs = [(t, f"cos_{_short(t)}", f"sin_{_short(t)}", f"mask_{_short(t)}") for t in self.types]
        self._ring_inputs = {
            name: buf for i in self.kv_layers for name, buf in zip((f"k_ring_{i}", f"v_ring_{i}"), self.rings[i])
        }
        self.tokens: list[int] = []
        self.live_start = self.n_kv = 0
        self.pending: dict[int, tuple[int, int]] = {}  # tree node -> (forward index, row) this round
        self.outputs: list[dict[str, np.ndarray]] = []  # this round's forward outputs
        self.round_forwards = 0
        self.forwards = 0
        self.prefill_seconds = 0.0
        self.decoder: SlmDecoder | None = None  # set when the bundle has the 1-row decode graph

    # ---- request start -----------------------------------------------------------------------------------------

    @property
    def t(self) -> int:
        """Position of the root r (the last committed token)."""
        return len(self.tokens) - 1

    def start(self, prompt_ids: Sequence[int]) -> None:
        """A new request: committed = the prompt (its last token is the first root); the ring will hold the
        prompt's last W positions (W = the longest ring). Raises ValueError for an empty prompt."""
        if len(prompt_ids) == 0:
            raise ValueError("the prompt is empty: it needs at least the first root token")
        self.tokens = [int(x) for x in prompt_ids]
        self.live_start = self.n_kv = max(0, self.t - self.window)
        for i, (k, v) in self.rings.items():
            k_enc, v_enc = self.ring_encodings[i]
            k[:] = zero_code(k_enc)
            v[:] = zero_code(v_enc)
        for mask in self.masks.values():
            mask.reset()
        self._new_round()

    def prefill(self, reserve: int = 8) -> int:
        """Run chunks of up to R committed tokens (never r) until at most max(1, R - reserve) rows, r included,
        remain without KV, leaving ``reserve`` rows for the tree. Returns the number of forwards run (their time
        goes to ``prefill_seconds``)."""
        t0, n = time.perf_counter(), 0
        while self.t - self.n_kv + 1 > max(1, self.rows - reserve):
            rows = list(range(self.n_kv, min(self.n_kv + self.rows, self.t)))
            out = self._forward([self.tokens[p] for p in rows], [-1] + list(range(len(rows) - 1)), self.n_kv)
            self._write(out, range(len(rows)), rows)
            self.n_kv += len(rows)
            n += 1
        self.prefill_seconds += time.perf_counter() - t0
        return n

    def catch_up(self, reserve: int) -> str:
        """Before an SLM pass that follows rounds drafted without one (a tree at the allowance's floor, Alg. 3 line
        7's F grew by every token they committed): give the committed tokens their SLM KV, leaving at most
        max(1, R - ``reserve``) rows, r included, for the pass to run (as `prefill` does at a request's start).

        Up to W tokens behind (W = the longest ring): `prefill`'s chunks of R rows from the first position without
        KV, in order, so every position's KV is computed from its token, its position and the KV of the same
        positions before it as on a drafter that never skipped (equal up to rounding: those keys sit in other
        columns of the forward, ring or chunk rows, than in the tree forward that computed them there). More than W
        behind: the ring is refilled cold from the last W committed positions, as `start`
        fills a new request's (App. C), which costs at most W / (R - reserve) forwards however long the SLM sat
        out. Returns "none" (nothing to run), "chunks" or "refill"; the forwards' time goes to
        ``prefill_seconds``."""
        behind = self.t - self.n_kv
        kind = "chunks"
        if behind > self.window:
            self.start(self.tokens)
            kind = "refill"
        return kind if self.prefill(reserve) or kind == "refill" else "none"

    def _new_round(self) -> None:
        self.pending, self.outputs, self.round_forwards = {}, [], 0

    # ---- one forward -------------------------------------------------------------------------------------------

    def feeds(
        self, tokens: Sequence[int], parents: Sequence[int], first_position: int, real_rows: int | None = None
    ) -> dict[str, np.ndarray]:
        """The graph's inputs for R rows at ``first_position`` (`hycoc.passes.slm.graph.host_inputs`'s rules). The
        masks and rings are the drafter's own buffers (updated in place: valid until the next forward).
        real_rows: rows before the padding (which repeats row real_rows - 1's token): only they are looked up."""
        ids = [int(x) for x in tokens]
        depths, ancestors, block, count = self._rows_of(parents)
        n = len(ids)
        real = n if real_rows is None else max(1, min(int(real_rows), n))
        if real < n:  # the padding repeats row real - 1's LUT row (each row's lookup is its own: equal values)
            ids[real:] = [ids[real - 1]] * (n - real)
        out = {"inputs_embeds": self._embed("embed_tokens", ids)[None]}
        if self.ple:
            rows = self._embed("embed_tokens_per_layer", ids)
            out["per_layer_inputs"] = rows.reshape(1, n, len(self.layer_types), self.ple)
        # rotary rows of positions first .. first + max depth (a tree's depths are 0..max), one per depth
        for t, cos_name, sin_name, mask_name in self._type_inputs:
            cos, sin = self._rotary[t].rows(first_position, count)
            out[cos_name], out[sin_name] = cos[depths][None], sin[depths][None]
            out[mask_name] = self.masks[t].update(
                parents, first_position, self.live_start, depths=depths, ancestors=ancestors, tree_block=block
            )
        out.update(self._ring_inputs)
        return out

    def _rows_of(self, parents: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """(depths int64 (R,), ancestors bool (R, R), the tree rows' mask block float32 (R, R) = where(ancestors,
        0, MASK_VALUE), max depth + 1) of ``parents`` (`hycoc.host.tree_rows`; raises TreeShapeError as it does),
        read-only arrays kept per parent list: a request's forwards repeat a few row layouts (toy, 4 Spec-Bench
        questions: 101 forwards, 8 layouts), which then cost one dict lookup. At most 64 layouts are kept."""
        key = tuple(parents)
        found = self._layouts.get(key)
        if found is None:
            depths, ancestors = tree_rows(parents)
            block = np.where(ancestors, np.float32(0.0), np.float32(MASK_VALUE))  # shared by the layer types
            for a in (depths, ancestors, block):
                a.setflags(write=False)
            if len(self._layouts) >= 64:
                self._layouts.clear()
            found = self._layouts[key] = (depths, ancestors, block, int(depths.max()) + 1)
        return found

    def _embed(self, name: str, ids: list[int]) -> np.ndarray:
        """float32 (len(ids), dim): LUT ``name``'s rows of ``ids``, gathered from its dense table when it has one
        (`hycoc.host.EmbeddingLut.dense`), else looked up in its quantized storage. Raises IndexError for an id
        outside the table."""
        lut, dense = self._luts[name]
        if dense is None:
            return lut.lookup(np.asarray(ids, np.int64))
        if min(ids) < 0 or max(ids) >= len(dense):
            raise IndexError(f"token id outside the LUT's {len(dense)} rows: {min(ids)}..{max(ids)}")
        return dense.take(ids, axis=0)

    def _forward(self, tokens: list[int], parents: list[int], first_position: int) -> dict[str, np.ndarray]:
        tokens, parents = list(tokens), list(parents)
        if len(tokens) > self.rows:
            raise ValueError(f"{len(tokens)} rows do not fit the SLM graph's {self.rows}")
        real = len(tokens)
        pad = self.rows - real  # padding: the last row again (under row 0 if it is row 0)
        if pad > 0:
            tokens += [tokens[-1]] * pad
            parents += [max(parents[-1], 0)] * pad
        out = self.runner.run(self.feeds(tokens, parents, first_position, real))
        self.forwards += 1
        return out

    def _write(self, out: dict[str, np.ndarray], rows: Sequence[int], positions: Sequence[int]) -> None:
        """Copy rows ``rows`` of a forward's new K/V into columns ``positions`` mod W_i of every ring (positions
        distinct and at most W_i of them): codes as they are when the rings hold the graph's codes (quantized IO;
        float rows are quantized with the ring's encoding first). Consecutive positions (the usual case) are one or
        two slice copies per ring (`hycoc.host.ring_runs`), consecutive rows a slice of the output."""
        n = len(rows)
        if n == 0:
            return
        rows, positions = [int(r) for r in rows], [int(p) for p in positions]
        row_sel = (
            slice(rows[0], rows[0] + n) if rows == list(range(rows[0], rows[0] + n)) else np.asarray(rows, np.int64)
        )
        consecutive = positions == list(range(positions[0], positions[0] + n))
        runs = {}
        for i in self.kv_layers:
            ring = self.ring_len[self.layer_types[i]]
            k_ring, v_ring = self.rings[i]
            k_new, v_new = out[f"k_new_{i}"][0][:, row_sel, :], out[f"v_new_{i}"][0][:, row_sel, :]
            if k_new.dtype != k_ring.dtype:  # float rows into a ring of codes (quantized IO)
                k_enc, v_enc = self.ring_encodings[i]
                assert k_enc is not None and v_enc is not None  # a ring of codes has its encodings (__init__)
                k_new, v_new = quantize(k_new, k_enc), quantize(v_new, v_enc)
            if consecutive and n <= ring:
                if ring not in runs:
                    runs[ring] = ring_runs(positions[0], n, ring)
                for cols, src in runs[ring]:
                    k_ring[0, :, cols] = k_new[:, src]
                    v_ring[0, :, cols] = v_new[:, src]
            else:
                cols = np.asarray(positions, np.int64) % ring
                k_ring[0][:, cols, :] = k_new
                v_ring[0][:, cols, :] = v_new

    def expand(self, tree: DraftTreeNodes, nodes: list[int]) -> Mapping[int, Candidates]:
        """One SLM forward for ``nodes`` of ``tree`` (module docstring); returns {node: its `Candidates` (the k =
        ``candidates`` most likely keep-set indices, best first, ties to the lower index, with log q)} for the
        root and the nodes that fit (a `hycoc.runtime.candidates.CandidateRows` from the graph's top-k). The tree's
        node 0 must be the root r (``self.tokens[-1]``)."""
        if tree.nodes[0].token != self.tokens[-1]:
            raise ValueError(f"tree root {tree.nodes[0].token} is not the committed root {self.tokens[-1]}")
        first = self.round_forwards == 0
        prefix = list(range(self.n_kv, self.t)) if first else []
        if len(prefix) + 1 > self.rows:
            self.prefill(reserve=1)
            prefix = list(range(self.n_kv, self.t))
        tokens = [self.tokens[p] for p in prefix] + [self.tokens[-1]]
        parents = list(range(-1, len(tokens) - 1))
        row_of = {0: len(tokens) - 1}  # ancestor-closed: a node joins with its missing ancestors
        tree_nodes = tree.nodes
        for v in nodes:
            if v in row_of:
                continue
            need = [v]  # v and its ancestors up to the first one already in
            a = tree_nodes[v].parent
            while a not in row_of:
                need.append(a)
                a = tree_nodes[a].parent
            need.reverse()  # root side first, as tree.ancestors gives them
            if len(tokens) + len(need) > self.rows:
                continue
            for a in need:
                row_of[a] = len(tokens)
                tokens.append(tree.nodes[a].token)
                parents.append(row_of[tree.nodes[a].parent])
        first_position = self.n_kv if first else self.t
        out = self._forward(tokens, parents, first_position)
        idx = len(self.outputs)
        self.outputs.append(out)
        self.round_forwards += 1
        self._write(out, range(len(prefix)), prefix)  # committed rows: into the ring now
        if first:
            self.n_kv = self.t
        for node, row in row_of.items():
            self.pending.setdefault(node, (idx, row))
        wanted = [(node, row) for node, row in row_of.items() if node == 0 or node in nodes]
        rows = [row for _, row in wanted]
        if "top_index" in out:  # the graph's own top-k (Alg. 3 line 10)
            return graph_candidate_rows(
                out["top_index"], out["top_logq"], [node for node, _ in wanted], rows, self.candidates
            )
        else:
            cands = logits_candidates(out["logits"][0, rows], self.candidates)
        return {node: c for (node, _), c in zip(wanted, cands)}

    def greedy_next(self) -> int:
        """SLM-alone decoding: one forward over the committed rows without KV (ending with r); returns the
        arg-max token of r's row (keep set; first among equals) and leaves r's KV pending for `commit`. When only r
        lacks KV and a ``decoder`` is set, the forward is the 1-row decode graph's, which writes r's KV itself
        (`hycoc.runtime.slm_decode.SlmDecoder.step`)."""
        if self.decoder is not None and self.n_kv == self.t and self.round_forwards == 0:
            return self.decoder.step(self)
        tree = DraftTreeNodes()
        tree.add(self.tokens[-1], -1, 0.0, "root")
        cands = self.expand(tree, [])
        return int(self.bundle.keep_set[int(cands[0].index[0])])

    def rollback(self, keep: int) -> str:
        """Roll the conversation back to its first ``keep`` committed tokens (an APPEND's ``keep``, docs/serving.md
        "Conversations"): positions >= keep leave the ring. When a ring has already overwritten columns of
        positions the rollback point still needs (it wrapped past them: the positions after ``keep`` were more
        than the ring could hold beside them), the ring is refilled cold from the last W kept positions, as
        `start` fills a new request's (the next `prefill` runs them). Returns "none" (nothing after keep had KV),
        "crop" or "refill". Raises ValueError for keep outside [1, committed tokens]."""
        if not 1 <= keep <= len(self.tokens):
            raise ValueError(f"cannot keep {keep} of {len(self.tokens)} committed tokens")
        old = self.n_kv
        self.tokens = self.tokens[:keep]
        self._new_round()
        if old <= keep:
            return "none"
        wrapped = any(old - self.ring_len[t] > max(self.live_start, keep - self.ring_len[t]) for t in self.types)
        if not wrapped:
            self.n_kv = keep
            for mask in self.masks.values():  # positions moved back: the next forward rebuilds the masks
                mask.reset()
            return "crop"
        self.start(self.tokens)
        return "refill"

    # ---- Alg. 1 line 10 ----------------------------------------------------------------------------------------

    def commit(self, path_nodes: Sequence[int], new_tokens: Sequence[int]) -> int:
        """Write r's KV at t and the path's nodes' KV at t + 1, ... while each has one (module docstring); then
        commit ``new_tokens`` (the path's tokens and the bonus, as cut by EOS / the output cap). Returns how many
        path nodes' KV were moved. Without a forward this round (nothing pending) only the tokens are committed."""
        t = self.t
        moved = 0
        if 0 in self.pending and self.n_kv == t:
            writes = [(*self.pending[0], t)]  # (forward index, row, position)
            for d, node in enumerate(path_nodes, start=1):
                if node not in self.pending or d > len(new_tokens):
                    break
                writes.append((*self.pending[node], t + d))
                moved += 1
            for idx in sorted({w[0] for w in writes}):  # one ring copy per forward the rows come from
                mine = [w for w in writes if w[0] == idx]
                self._write(self.outputs[idx], [w[1] for w in mine], [w[2] for w in mine])
            self.n_kv = t + 1 + moved
        self.tokens.extend(int(x) for x in new_tokens)
        self._new_round()
        return moved
