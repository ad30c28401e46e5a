"""The SLM Drafter's static tree graph (paper Alg. 3 line 8, §3.4, App. A; docs/design.md "SLM Drafter").

One SLM forward per round runs over R rows (R = 32 in the paper's deployment): the committed tokens without SLM
KV, ending with the root, and the planted tree nodes (Alg. 3 line 7). Row v "attends to the last W committed
positions and to v's ancestors" (line 8). `SlmTreeGraph` is that forward as a static-shape torch module built on
the graph surgery's output (`hycoc.passes.slm.surgery`), ready for `export_slm_graph`.

Rows. R rows in topological order: ``parents[0] == -1`` and ``0 <= parents[j] < j``. Row 0 sits at position
``first_position`` (the first position without SLM KV), row j at ``first_position + depth(j)``.

Ring (§3.4; the MTP head's convention, Alg. 2 line 4). Every non-KV-shared layer i has a ring of W_T columns,
W_T = ``window.slm_window`` for full-attention layers and ``window.slm_sliding_window`` for sliding ones (paper:
1,024 and 512). **Committed position p lives in column p mod W_T.** Before a forward the ring holds the committed
positions [first_position - W_T, first_position) that exist; a column is *live* when its position is
>= ``live_start`` (the request's first position in the ring, so a fresh request masks its stale columns). Keys
are stored rotated (App. A: "keys enter the ring with their rotary embedding applied, so an entry keeps its
absolute position wherever it sits in the ring"), values as transformers' ``v_norm`` leaves them.

Masks (one per layer type, additive, (1, 1, R, W_T + R), columns [ring | rows]): 0 where visible, ``MASK_NEG``
(-1e4, a finite constant sized for a 16-bit quantized input, never -inf) elsewhere. Row j at position q sees
ring column c (position p) iff p is live and, in sliding layers, q - p < sliding_window; it sees row i iff i is
j or an ancestor of j and, in sliding layers, q - q_i < sliding_window -- transformers' own rule
(``masking_utils.sliding_window_overlay``: kv_idx > q_idx - sliding_window), so a window boundary may fall inside
the tree rows. Full-attention layers see the whole live ring: the ring's length is their window (§3.4).

Graph inputs, in `SlmTreeGraph.input_names` order (float32, T = ``sliding`` / ``full``):
``inputs_embeds`` (1, R, H) and ``per_layer_inputs`` (1, R, L, P), from the host LUTs (`EmbeddingLut.lookup`;
per-layer rows reshaped to (L, P), exactly transformers' ``get_per_layer_inputs``); ``cos_T``, ``sin_T``
(1, R, D_T), each row's rotary rows at its position (`RotaryTable.rows`); ``mask_T`` (1, 1, R, W_T + R);
``k_ring_i``, ``v_ring_i`` (1, KV_i, W_T, D_T) for each non-shared layer i.
Outputs: ``logits`` (1, R, |keep set|), soft-capped, over the keep set only (the untied output layer restricted
to the keep-set rows, §3.3), and ``k_new_i``, ``v_new_i`` (1, KV_i, R, D_T) for each non-shared layer: every row's
new key (rotated) and value, so the runtime writes the committed rows into the ring (column p mod W_T).

Shards (docs/compiler.md "Layer-sharded SLM": a graph over one context's budget is split by layers, as ExecuTorch and
Genie ship E2B-class models). ``bounds = (0, b_1, ..., L)`` and ``shard = k`` make the module shard k, layers [b_k,
b_{k+1}). Shard 0 takes the host inputs and projects the per-layer inputs; a later shard takes ``hidden_A`` (1, R, H),
the hidden state entering its first layer A, and ``per_layer_A_B`` (1, R, B - A, P), its layers' projected per-layer
inputs, both outputs of earlier shards (shard 0 outputs every later shard's ``per_layer_A_B``, each shard but the last
its ``hidden_B``). Only the last shard has the final norm, the keep-set output layer and the soft-cap (``logits``).
Each shard takes ``cos_T``/``sin_T``/``mask_T`` for the layer types it has and the rings of its own non-shared
layers, and outputs their ``k_new_i``/``v_new_i``. A KV-shared layer whose producer p sits in an earlier shard
takes ``k_ring_p``, ``v_ring_p`` (host) and ``k_new_p``, ``v_new_p`` (p's shard's outputs). Every name is either a
host feed or an earlier shard's output, so a runtime chains the shards by name (`run_shard_chain`). With
``bounds=None`` the module is the monolithic graph, unchanged.

KV sharing. transformers' KV-shared layers (``num_kv_shared_layers``) read the keys and values their producer
layer (the last non-shared layer of the same type, ``kv_sharing_modes == "store"``) attends over -- here ring +
new rows -- under the same mask; they own no ring.

Reuse. The decoder layers, RMSNorms, MLPs, attention (``eager_attention_forward``) and per-layer-input projection
are transformers' own (``Gemma4TextDecoderLayer``, ``Gemma4TextModel.project_per_layer_inputs``). Two pieces are
ours: `IntegerLinear` (weight = int8 * scale, written in the graph so the exporter sees the integers; transformers'
``apply_srq`` when the checkpoint has activation scales) and `RingCache` (`hycoc.passes.slm.layers`), the stand-in
for transformers' cache whose ``update`` appends the new rows to the ring input (the attention calls
``cache.update`` exactly as with a DynamicCache) and records them as outputs. Rotary cos/sin arrive as inputs
(transformers' layers take them as ``position_embeddings``).
"""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from hycoc.passes.artifacts import IntegerWeight, KeepSetArtifact, OnnxArtifact, SlmIntegerArtifact, SlmIntegerModel
from hycoc.passes.export import compare_with_torch, export_static
from hycoc.passes.pipeline import Pass, PassReport
from hycoc.passes.slm.layers import RingCache, text_stack_class
from torch import nn

from hycoc import host
from hycoc.recipe import Recipe

#: Additive mask value for hidden columns: finite, sized for a 16-bit quantized mask (same as hycoc.mtp).
MASK_NEG = host.MASK_VALUE
SLIDING = "sliding_attention"
FULL = "full_attention"


class SlmGraphError(ValueError):
    """The tree graph cannot be built or fed as asked: a keep-set id outside the vocabulary, a tree whose rows
    are not topologically ordered, a layer type without a ring length, inputs of the wrong shape, a surgery
    output missing (or adding) a tensor."""


def short(layer_type: str) -> str:
    """``sliding_attention`` -> ``sliding``: the suffix of the graph's input names."""
    return layer_type.removesuffix("_attention")


def text_config(slm: SlmIntegerModel):
    """The surgery's config as a transformers ``Gemma4TextConfig`` with eager attention (plain MatMul/Softmax)."""
    from transformers import Gemma4TextConfig

    config = Gemma4TextConfig.from_dict({k: v for k, v in slm.config.items() if k != "quantization_config"})
    config._attn_implementation = "eager"
    return config


# ---- host side: masks and inputs (numpy only; the device runtime does the same) --------------------------------


def _host(fn):
    """``fn`` of `hycoc.host` raising SlmGraphError (this module's error) instead of TreeShapeError."""

    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except host.TreeShapeError as e:
            raise SlmGraphError(str(e)) from None

    wrapped.__doc__, wrapped.__name__ = fn.__doc__, fn.__name__
    return wrapped


#: `hycoc.host`'s tree helpers (shared with the device runtime), raising SlmGraphError.
tree_depths = _host(host.tree_depths)
ancestor_matrix = _host(host.ancestor_matrix)
ring_positions = host.ring_positions
tree_ring_mask = _host(host.tree_ring_mask)


# ---- the module ------------------------------------------------------------------------------------------------


class IntegerLinear(nn.Module):
    """A linear layer whose weight is written in the graph as int8 values times per-channel float32 scales.

    q: int8 (out, in) buffer, values within the checkpoint's bit width; scale: float32 (out, 1). Forward:
    ``F.linear(x, q.float() * scale)``, bit-identical to transformers' ``QuantizedLinear`` (which dequantizes the
    same way), with its SRQ rounding (``apply_srq``, 8-bit) on the input/output when the checkpoint gives a
    nonzero activation scale. ``rows`` keeps only those output channels (the keep-set output layer).
    """

    q: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, weight: IntegerWeight, rows: np.ndarray | None = None):
        super().__init__()
        q, scale = weight.q, weight.scale
        if rows is not None:
            q, scale = q[rows], scale[rows]
        self.register_buffer("q", torch.from_numpy(np.ascontiguousarray(q, dtype=np.int8)))
        self.register_buffer("scale", torch.from_numpy(np.ascontiguousarray(scale, dtype=np.float32)))
        self.bits = weight.bits
        self.in_features, self.out_features = int(q.shape[1]), int(q.shape[0])
        self.srq = {"input": weight.input_scale, "output": weight.output_scale}
        for where, value in self.srq.items():
            if value:
                self.register_buffer(f"{where}_scale", torch.tensor(value, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from transformers.integrations.gemma_quant import apply_srq

        if self.srq["input"]:
            x = apply_srq(x, self.input_scale)
        y = nn.functional.linear(x, self.q.to(x.dtype) * self.scale.to(x.dtype))
        if self.srq["output"]:
            y = apply_srq(y, self.output_scale)
        return y

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}"


def _assign(root: nn.Module, name: str, value: np.ndarray) -> None:
    """Set parameter or buffer ``name`` (dotted, relative to root) to ``value``; SlmGraphError if it has none."""
    path, _, attr = name.rpartition(".")
    module = root.get_submodule(path) if path else root
    tensor = torch.from_numpy(np.ascontiguousarray(value, dtype=np.float32))
    if attr in module._parameters:
        module._parameters[attr] = nn.Parameter(tensor, requires_grad=False)
    elif attr in module._buffers:
        module._buffers[attr] = tensor
    else:
        raise SlmGraphError(f"the surgery output has tensor '{name}', which the SLM graph does not have")


class SlmTreeGraph(nn.Module):
    """The SLM's static tree graph (module docstring): ``forward(*inputs)`` in `input_names` order returns
    ``(logits, k_new_i, v_new_i, ...)`` in `output_names` order.

    slm: the surgery output. keep_ids: sorted int64 token ids of the keep set (the output layer's rows, in this
    order). rows: R. ring: layer type -> ring length W_T. Raises SlmGraphError for a keep-set id outside the
    vocabulary, a ring length < 1, or a surgery output that does not fill every parameter of the graph.
    """

    input_names: list[str]
    input_shapes: dict[str, tuple[int, ...]]
    output_names: list[str]
    output_shapes: dict[str, tuple[int, ...]]

    def __init__(
        self,
        slm: SlmIntegerModel,
        keep_ids: Sequence[int] | np.ndarray,
        *,
        rows: int,
        ring: Mapping[str, int],
        bounds: Sequence[int] | None = None,
        shard: int = 0,
    ):
        super().__init__()
        self.config = text_config(slm)
        self._lay_out(keep_ids, rows, ring, bounds, shard)
        self._load(slm)
        self._declare_io()
        self._declare_host_feeds()

    def _lay_out(
        self,
        keep_ids: Sequence[int] | np.ndarray,
        rows: int,
        ring: Mapping[str, int],
        bounds: Sequence[int] | None,
        shard: int,
    ) -> None:
        """The shard's layers, the keep set, the rows and rings, the KV layers it owns and borrows (constructor's
        arguments; raises SlmGraphError as the class says)."""
        config = self.config
        n_layers = config.num_hidden_layers
        self.bounds = check_bounds(bounds, n_layers)
        if not 0 <= shard < len(self.bounds) - 1:
            raise SlmGraphError(f"shard {shard} outside [0, {len(self.bounds) - 1}) for bounds {self.bounds}")
        self.shard = int(shard)
        a, b = self.bounds[shard], self.bounds[shard + 1]
        self.layer_range = (a, b)
        self.first, self.last = a == 0, b == n_layers
        keep = np.asarray(keep_ids, dtype=np.int64)
        if keep.ndim != 1 or len(keep) == 0 or keep.min() < 0 or keep.max() >= config.vocab_size:
            raise SlmGraphError(f"keep set ids must be a non-empty list in [0, {config.vocab_size})")
        self.keep_ids = keep
        self.rows = int(rows)
        self.layer_types = list(config.layer_types)
        self.types = sorted(set(self.layer_types))
        missing = [t for t in self.types if ring.get(t, 0) < 1]
        if missing:
            raise SlmGraphError(f"no ring length for layer types {missing}")
        self.ring = {t: int(ring[t]) for t in self.types}
        modes = config.kv_sharing_modes
        self.kv_layers = [i for i in range(a, b) if modes[i] != "reuse"]
        self.sliding_window = {t: (config.sliding_window if t == SLIDING else None) for t in self.types}
        # producers in earlier shards whose ring + new KV a shared layer of this shard reads
        producer = {self.layer_types[i]: i for i, m in enumerate(modes) if m == "store"}
        self.borrowed = sorted(
            {producer[self.layer_types[i]] for i in range(a, b) if modes[i] == "reuse"} - set(range(a, b))
        )
        self.shard_types = sorted({self.layer_types[i] for i in range(a, b)})

    def _load(self, slm: SlmIntegerModel) -> None:
        """transformers' decoder layers of this shard (and the norm, per-layer projection and keep-set output layer
        where it has them) with the surgery's integer weights and float tensors; raises SlmGraphError when the
        surgery output lacks a weight or leaves a tensor unfilled."""
        from transformers.models.gemma4.modeling_gemma4 import Gemma4RMSNorm, Gemma4TextDecoderLayer

        config = self.config
        a, b = self.layer_range
        stack = text_stack_class()()
        stack.config = config
        with torch.device("meta"):
            stack.layers = nn.ModuleList(
                Gemma4TextDecoderLayer(config, i) if a <= i < b else nn.Identity()
                for i in range(config.num_hidden_layers)
            )
            if self.last:
                stack.norm = Gemma4RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ple = int(config.hidden_size_per_layer_input or 0)
        stack.hidden_size_per_layer_input = self.ple
        if self.ple and self.first:
            with torch.device("meta"):
                stack.per_layer_projection_norm = Gemma4RMSNorm(self.ple, eps=config.rms_norm_eps)
            stack.per_layer_model_projection = IntegerLinear(slm.weights["model.per_layer_model_projection"])
            stack.per_layer_input_scale = 2.0**-0.5  # as Gemma4TextModel.__init__
            stack.per_layer_model_projection_scale = config.hidden_size**-0.5
        self.model = stack
        for name, module in list(self.model.named_modules()):
            if isinstance(module, nn.Linear):
                full = f"model.{name}"
                if full not in slm.weights:
                    raise SlmGraphError(f"the surgery output has no integer weight for '{full}'")
                self.model.set_submodule(name, IntegerLinear(slm.weights[full]))
        for name, value in slm.floats.items():
            if self._owns(name):
                _assign(self, name, value)
        self.lm_head = IntegerLinear(slm.weights["lm_head"], rows=self.keep_ids) if self.last else None
        self.softcap = config.final_logit_softcapping
        empty = [n for n, t in [*self.named_parameters(), *self.named_buffers()] if t.is_meta]
        if empty:
            raise SlmGraphError(f"the surgery output does not fill {', '.join(empty)}")
        self.eval()

    def _declare_io(self) -> None:
        """`input_names` / `input_shapes` and `output_names` / `output_shapes` of this shard (module docstring)."""
        config, (a, b) = self.config, self.layer_range
        self.input_names, self.input_shapes = [], {}
        self.output_names, self.output_shapes = [], {}
        h, r = config.hidden_size, self.rows
        if self.first:
            self._add_input("inputs_embeds", (1, r, h))
            if self.ple:
                self._add_input("per_layer_inputs", (1, r, config.num_hidden_layers, self.ple))
        else:
            self._add_input(f"hidden_{a}", (1, r, h))
            if self.ple:
                self._add_input(per_layer_name(a, b), (1, r, b - a, self.ple))
        for t in self.shard_types:
            for name, shape in self._type_inputs(t).items():
                self._add_input(name, shape)
        if self.last:
            self._add_output("logits", (1, r, len(self.keep_ids)))
        else:
            self._add_output(f"hidden_{b}", (1, r, h))
            if self.ple and self.first:
                for lo, hi in zip(self.bounds[1:-1], self.bounds[2:]):
                    self._add_output(per_layer_name(lo, hi), (1, r, hi - lo, self.ple))
        for i in self.kv_layers:
            for kv in ("k", "v"):
                self._add_input(f"{kv}_ring_{i}", self._ring_shape(i))
            for kv in ("k", "v"):
                self._add_output(f"{kv}_new_{i}", self._kv_shape(i, r))
        for p in self.borrowed:
            for kind, shape in (("ring", self._ring_shape(p)), ("new", self._kv_shape(p, r))):
                for kv in ("k", "v"):
                    self._add_input(f"{kv}_{kind}_{p}", shape)

    def _declare_host_feeds(self) -> None:
        """``all_kv_layers`` and ``host_shapes``: the host's feeds of the whole chain, the monolithic graph's inputs
        (`host_inputs`)."""
        config, r = self.config, self.rows
        self.all_kv_layers = [i for i, m in enumerate(config.kv_sharing_modes) if m != "reuse"]
        self.host_shapes: dict[str, tuple[int, ...]] = {"inputs_embeds": (1, r, config.hidden_size)}
        if self.ple:
            self.host_shapes["per_layer_inputs"] = (1, r, config.num_hidden_layers, self.ple)
        for t in self.types:
            self.host_shapes |= self._type_inputs(t)
        for i in self.all_kv_layers:
            for kv in ("k", "v"):
                self.host_shapes[f"{kv}_ring_{i}"] = self._ring_shape(i)

    def _type_inputs(self, t: str) -> dict[str, tuple[int, ...]]:
        """The inputs of layer type ``t``: ``cos_T``, ``sin_T`` (1, R, D_T) and ``mask_T`` (1, 1, R, W_T + R)."""
        r, d = self.rows, self.config.per_layer_config[self.layer_types.index(t)].head_dim
        return {
            f"cos_{short(t)}": (1, r, d),
            f"sin_{short(t)}": (1, r, d),
            f"mask_{short(t)}": (1, 1, r, self.ring[t] + r),
        }

    def _ring_shape(self, layer: int) -> tuple[int, ...]:
        return self._kv_shape(layer, self.ring[self.layer_types[layer]])

    def _kv_shape(self, layer: int, width: int) -> tuple[int, ...]:
        lc = self.config.per_layer_config[layer]
        return (1, lc.num_key_value_heads, width, lc.head_dim)

    def _owns(self, name: str) -> bool:
        """Whether float tensor ``name`` of the surgery output belongs to this shard (all do when unsharded)."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and len(parts) > 2 and parts[2].isdigit():
            return self.layer_range[0] <= int(parts[2]) < self.layer_range[1]
        if parts[:2] == ["model", "norm"]:
            return self.last
        if parts[:2] == ["model", "per_layer_projection_norm"]:
            return self.first
        return True

    def _add_input(self, name: str, shape: tuple[int, ...]) -> None:
        self.input_names.append(name)
        self.input_shapes[name] = shape

    def _add_output(self, name: str, shape: tuple[int, ...]) -> None:
        self.output_names.append(name)
        self.output_shapes[name] = shape

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        x = dict(zip(self.input_names, inputs, strict=True))
        a, b = self.layer_range
        if self.first:
            h = x["inputs_embeds"]
            # Gemma's per-layer inputs: the host's LUT rows + a projection of the input embeddings (in the graph).
            ple = self.model.project_per_layer_inputs(h, x["per_layer_inputs"]) if self.ple else None
            offset = 0
        else:
            h = x[f"hidden_{a}"]
            ple = x[per_layer_name(a, b)] if self.ple else None
            offset = a
        cache = RingCache({i: (x[f"k_ring_{i}"], x[f"v_ring_{i}"]) for i in self.kv_layers})
        shared: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # producer layer type -> (ring + new) K, V
        for p in self.borrowed:  # producers in earlier shards
            shared[self.layer_types[p]] = (
                torch.cat([x[f"k_ring_{p}"], x[f"k_new_{p}"]], dim=2),
                torch.cat([x[f"v_ring_{p}"], x[f"v_new_{p}"]], dim=2),
            )
        for i in range(a, b):
            t = short(self.layer_types[i])
            h = self.model.layers[i](
                h,
                ple[:, :, i - offset, :] if ple is not None else None,
                shared_kv_states=shared,
                position_embeddings=(x[f"cos_{t}"], x[f"sin_{t}"]),
                attention_mask=x[f"mask_{t}"],
                cache=cache,
            )
        if self.lm_head is not None:  # the last shard (self.last)
            h = self.model.norm(h)
            logits = self.lm_head(h)
            if self.softcap is not None:  # as Gemma4ForCausalLM.forward
                logits = torch.tanh(logits / self.softcap) * self.softcap
            outputs = [logits]
        else:
            outputs = [h]
            if ple is not None and self.first:
                outputs += [ple[:, :, lo:hi, :] for lo, hi in zip(self.bounds[1:-1], self.bounds[2:])]
        for i in self.kv_layers:
            outputs += list(cache.new[i])
        return tuple(outputs)


def per_layer_name(a: int, b: int) -> str:
    """Name of the projected per-layer inputs of layers [a, b) passed from shard 0 to the shard holding them."""
    return f"per_layer_{a}_{b}"


def check_bounds(bounds: Sequence[int] | None, layers: int) -> tuple[int, ...]:
    """``bounds`` (shard k = layers [bounds[k], bounds[k+1])) as a tuple; None -> (0, layers). Raises SlmGraphError
    unless they start at 0, end at ``layers`` and strictly increase."""
    if bounds is None:
        return (0, int(layers))
    out = tuple(int(x) for x in bounds)
    if len(out) < 2 or out[0] != 0 or out[-1] != layers or any(x >= y for x, y in zip(out, out[1:])):
        raise SlmGraphError(
            f"shard bounds {list(out)} must rise strictly from 0 to the layer count {layers}, "
            f"e.g. [0, {layers // 2 or 1}, {layers}]"
        )
    return out


def host_inputs(
    graph: SlmTreeGraph,
    slm: SlmIntegerModel,
    tokens: Sequence[int] | np.ndarray,
    parents: Sequence[int],
    first_position: int,
    live_start: int,
    rings: Mapping[int, tuple[np.ndarray, np.ndarray]],
) -> dict[str, np.ndarray]:
    """The graph's inputs for one forward, as the host assembles them (module docstring), by input name: the
    monolithic graph's inputs (``graph.host_shapes``), also for a shard (the whole chain's host feeds).

    tokens, parents: R ids and parent rows. rings: non-shared layer -> (k, v) float32 (1, KV, W_T, D) in the
    column convention. Raises SlmGraphError when R differs from the graph's rows or a ring is missing.
    """
    tokens = np.asarray(tokens, dtype=np.int64)
    if len(tokens) != graph.rows or len(parents) != graph.rows:
        raise SlmGraphError(f"the graph has {graph.rows} rows, got {len(tokens)} tokens and {len(parents)} parents")
    positions = first_position + tree_depths(parents)
    out = {"inputs_embeds": slm.luts["embed_tokens"].lookup(tokens)[None]}
    if graph.ple:
        rows = slm.luts["embed_tokens_per_layer"].lookup(tokens)
        out["per_layer_inputs"] = rows.reshape(1, graph.rows, graph.config.num_hidden_layers, graph.ple)
    for t in graph.types:
        cos, sin = slm.rotary[t].rows(positions)
        out[f"cos_{short(t)}"], out[f"sin_{short(t)}"] = cos[None], sin[None]
        out[f"mask_{short(t)}"] = tree_ring_mask(
            parents, first_position, live_start, graph.ring[t], graph.sliding_window[t]
        )
    for i in graph.all_kv_layers:
        if i not in rings:
            raise SlmGraphError(f"no ring for layer {i}")
        out[f"k_ring_{i}"], out[f"v_ring_{i}"] = rings[i]
    for name, shape in graph.host_shapes.items():
        if out[name].shape != shape:
            raise SlmGraphError(f"input {name} has shape {out[name].shape}, the graph takes {shape}")
    return {name: np.ascontiguousarray(out[name], dtype=np.float32) for name in graph.host_shapes}


def example_feeds(graph: SlmTreeGraph, slm: SlmIntegerModel, seed: int = 0) -> dict[str, np.ndarray]:
    """Host feeds (`host_inputs`) for export and its numeric check: a random tree (a committed chain then
    branches), random token ids, LUT rows, rotary rows at positions past a full ring, and ring K/V drawn like
    normed keys/values (RMS 1). ``graph`` may be any shard: the feeds are the whole chain's."""
    rng = np.random.default_rng(seed)
    r = graph.rows
    parents = [-1] + [int(rng.integers(max(0, j - 3), j)) for j in range(1, r)]
    first_position = max(graph.ring.values()) + 3  # the ring has wrapped
    rings = {}
    for i in graph.all_kv_layers:
        shape = graph.host_shapes[f"k_ring_{i}"]
        rings[i] = (rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32))
    tokens = rng.integers(0, graph.config.vocab_size, r)
    return host_inputs(graph, slm, tokens, parents, first_position, 0, rings)


def example_inputs(graph: SlmTreeGraph, slm: SlmIntegerModel, seed: int = 0) -> list[torch.Tensor]:
    """Inputs for export and its numeric check (`example_feeds`) as torch tensors in ``graph.input_names`` order;
    the monolithic graph only (a shard's inputs come from `run_shard_chain`)."""
    feeds = example_feeds(graph, slm, seed)
    return [torch.from_numpy(feeds[n]) for n in graph.input_names]


def export_slm_graph(
    module: SlmTreeGraph, example: Sequence[torch.Tensor], path: str | Path, *, decompose_rms_norm: bool = True
):
    """Export the tree graph at its static shapes to ``path`` (external data beside it), check it, rewrite its
    RMSNorms (`hycoc.passes.rmsnorm_decomposition`) and compare onnxruntime's CPU EP with torch on ``example``.

    Returns (onnx_ir.Model, `ExportReport` with max errors per output and top-1 agreement of the logits, None for a
    shard without them).
    Raises ExportError (export, checker, onnxruntime) or RmsNormDecompositionError.
    """
    model, report = export_static(
        module,
        example,
        path,
        input_names=module.input_names,
        output_names=module.output_names,
        decompose_rms_norm=decompose_rms_norm,
    )
    compare_with_torch(
        path,
        module,
        example,
        input_names=module.input_names,
        output_names=module.output_names,
        logits="logits" if "logits" in module.output_names else None,
        report=report,
    )
    return model, report


class SlmTreeGraphExport(Pass):
    """``slm_integer`` + ``keep_set`` -> ``onnx_slm``: the static tree graph, exported and verified.

    Reads ``[window]`` (ring lengths: ``slm_window`` for full-attention layers, ``slm_sliding_window`` for sliding
    ones) and ``[tree]`` (R = ``node_budget`` rows, the paper's 32). The graph's RMSNorms are already in the HTP's
    elementwise form (``decompose_rms_norm``), so the pipeline needs no separate RMSNorm pass for ``onnx_slm``.
    """

    name = "slm_tree_graph"
    section = "window"
    also_reads = ("tree",)
    consumes = {"slm_integer": SlmIntegerArtifact, "keep_set": KeepSetArtifact}
    produces = {"onnx_slm": OnnxArtifact}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, OnnxArtifact], PassReport]:
        slm: SlmIntegerModel = inputs["slm_integer"].payload
        ring = {FULL: recipe.window.slm_window, SLIDING: recipe.window.slm_sliding_window}
        graph = SlmTreeGraph(slm, inputs["keep_set"].payload, rows=recipe.tree.node_budget, ring=ring)
        example = example_inputs(graph, slm)
        with tempfile.TemporaryDirectory(prefix="hycoc-slm-export-") as tmp:
            model, report = export_slm_graph(graph, example, Path(tmp) / "slm.onnx")
        if graph.lm_head is None:  # the whole graph is its own last shard
            raise SlmGraphError("the SLM tree graph has no output layer (lm_head): it is not the chain's last shard")
        head = slm.weights["lm_head"]
        numbers = report.numbers() | {
            "rows": graph.rows,
            "ring": ring,
            "keep_set": len(graph.keep_ids),
            "output_layer_bytes_before": int(head.q.nbytes + head.scale.nbytes),
            "output_layer_bytes_after": int(graph.lm_head.q.numel() * 1 + graph.lm_head.scale.numel() * 4),
        }
        worst = max(report.max_abs_error.values())
        summary = (
            f"R={graph.rows} rows, rings {ring[FULL]}/{ring[SLIDING]}, {len(graph.keep_ids)} keep-set logits; "
            f"{sum(report.ops.values())} nodes, {report.rms_norms} RMSNorms decomposed; "
            f"ORT CPU vs torch max err {worst:.2e}, top-1 {report.top1_agreement:.1%}; "
            f"export {report.seconds:.1f} s"
        )
        return {"onnx_slm": OnnxArtifact("onnx_slm", model)}, PassReport(summary, numbers)
