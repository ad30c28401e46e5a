"""The head's integer format (paper App. A Table 4, docs/design.md "Table 4: the head's 4-bit QAT"): the untied keep-set
output layer, the per-channel MSE clip search, fake-quantized Linear layers for the QAT (`hycoc.passes.head.qat`),
and the export of the trained integers and scales.

    restrict_output_layer    the head with an untied output layer over the keep set (§3.3, App. A)
    search_clip              per-output-channel MSE clip-ratio search (Table 4 "Weight clipping", ratio 1.0-0.6)
    quantize_head            every Linear fake-quantized at its scale with a straight-through estimator (`QuantLinear`)
    export_head              the trained integers and per-channel scales (`QuantizedHead`), bit-exact what the QDQ
                             export must use: weight == qweight * scale in float32, exactly as trained
    dequantized_head         the float model that computes what the exported integers compute

Quantization: symmetric, per output channel, zero point 0: q = clamp(round(w / s), -qmax, qmax), qmax = 2**(b-1) - 1
(7 at 4 bits, so q lies in [-7, 7], inside int4's [-8, 7]); s = ratio * max|w_row| / qmax with the ratio of the
search. The scales are fixed after the search (Table 4: search, then fake-quantize); the float32 master weights
train under them. Biases: Gemma has none, and a Linear with one is refused.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from hycoc.passes.artifacts import QuantizedHead
from hycoc.passes.bit_map import qmax
from hycoc.passes.head.errors import HeadQatError
from torch import nn

from hycoc.recipe import HeadQat

if TYPE_CHECKING:  # transformers is imported where a model is made
    from transformers import Gemma4AssistantForCausalLM

# ---- quantization -------------------------------------------------------------------------------------------


def clip_ratios(config: HeadQat) -> list[float]:
    """The ``clip_search_points`` ratios evenly spaced from ``clip_search_max`` down to ``clip_search_min``."""
    hi, lo, n = config.clip_search_max, config.clip_search_min, config.clip_search_points
    return [hi] if n == 1 else [hi - i * (hi - lo) / (n - 1) for i in range(n)]


def search_clip(w: torch.Tensor, bits: int, ratios: Sequence[float]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-output-channel MSE clip search (Table 4): for each row of ``w`` [out, in], the ratio r of ``ratios``
    whose scale s = r * max|row| / qmax gives the lowest sum of (clamp(round(row / s)) * s - row)**2; ties go to
    the earlier ratio. Returns (q int8 [out, in], scale float32 [out, 1], ratio float32 [out]).

    The same rule as `hycoc.toy.gemma_format.quantize_per_channel`, which quantized the toy SLM.
    """
    w = w.detach().float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-8)
    m = qmax(bits)
    best: list[torch.Tensor] | None = None
    for r in ratios:
        s = amax * r / m
        q = torch.clamp(torch.round(w / s), -m, m)
        err = ((q * s - w) ** 2).sum(dim=1, keepdim=True)
        ratio = torch.full_like(err, float(r))
        if best is None:
            best = [q, s, err, ratio]
            continue
        better = err < best[2]
        best = [torch.where(better, new, old) for new, old in zip((q, s, err, ratio), best)]
    if best is None:
        raise HeadQatError("the clip search needs at least one clip ratio (head_qat.clip_search_points >= 1)")
    q, s, _, ratio = best
    return q.to(torch.int8), s.float(), ratio[:, 0]


class FakeQuantSTE(torch.autograd.Function):
    """w -> clamp(round(w / s), -m, m) * s, with the straight-through estimator (Bengio et al., 2013): the
    gradient passes to w unchanged, clipped entries included. w float32 [out, in], s float32 [out, 1]."""

    @staticmethod
    def forward(ctx, w, scale, m):
        return torch.clamp(torch.round(w / scale), -m, m) * scale

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class QuantLinear(nn.Module):
    """A bias-free Linear computing with its fake-quantized weight (Table 4: "every linear layer").

    ``weight``: float32 master weight [out, in] (trainable); ``scale``: float32 [out, 1] buffer, fixed by the clip
    search; ``bits``: the integer width. ``integers()`` is the int8 tensor the export writes: ``integers() *
    scale`` equals the weight the forward uses, bit for bit.
    """

    scale: torch.Tensor  # a buffer (register_buffer)

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bits: int):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().clone())
        self.register_buffer("scale", scale.detach().float().clone())
        self.bits = bits
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]

    def quantized_weight(self) -> torch.Tensor:
        return FakeQuantSTE.apply(self.weight, self.scale, qmax(self.bits))

    def integers(self) -> torch.Tensor:
        m = qmax(self.bits)
        return torch.clamp(torch.round(self.weight.detach() / self.scale), -m, m).to(torch.int8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized_weight())


def restrict_output_layer(head, keep_set) -> nn.Module:
    """A float32 copy of ``head`` (``Gemma4AssistantForCausalLM``) whose ``lm_head`` is untied from the embedding
    and holds only the keep-set rows: row i scores token ``keep_set[i]`` (§3.3, App. A "output layer untied and
    restricted to the keep set"). keep_set: int ids [|V|]. `hycoc.mtp.head_step` on the copy returns logits
    [.., |V|]. The copy has no ordered-embedding output (``masked_embedding``): the drafter scores the whole keep
    set densely; a head with ordered embeddings is refused before the build (`hycoc.models.check_head_config`)."""
    ids = torch.as_tensor(keep_set, dtype=torch.long)
    out = copy.deepcopy(head).float().eval()
    out.masked_embedding = None
    out.config.use_ordered_embeddings = False
    weight = out.lm_head.weight.detach()[ids.to(out.lm_head.weight.device)].clone()
    out.lm_head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device)
    out.lm_head.weight = nn.Parameter(weight)
    return out


def drafting_linears(head) -> list[str]:
    """Names of the Linear layers the drafting path computes with (all of them but the unused ordered-embedding
    centroids), in module order. Raises HeadQatError for a Linear with a bias."""
    names = []
    for name, module in head.named_modules():
        if isinstance(module, (nn.Linear, QuantLinear)) and not name.startswith("masked_embedding"):
            if getattr(module, "bias", None) is not None:
                raise HeadQatError(f"head layer {name} has a bias; the integer export covers bias-free Linear layers")
            names.append(name)
    return names


def quantize_head(head, bits: int, ratios: Sequence[float]) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A copy of ``head`` (output layer already restricted) with every drafting Linear replaced by a `QuantLinear`
    at ``bits``, scales from `search_clip`. Only the QuantLinear weights require grad (norms, embeddings frozen).
    Returns (quantized head, chosen clip ratio per layer: float32 [out])."""
    out = copy.deepcopy(head).float().eval()
    out.requires_grad_(False)
    chosen = {}
    for name in drafting_linears(out):
        parent_name, _, attr = name.rpartition(".")
        parent = out.get_submodule(parent_name) if parent_name else out
        linear = getattr(parent, attr)
        _, scale, ratio = search_clip(linear.weight, bits, ratios)
        setattr(parent, attr, QuantLinear(linear.weight, scale, bits))
        chosen[name] = ratio
    return out, chosen


# ---- export -------------------------------------------------------------------------------------------------


def percentile_abs(tensors: Sequence[torch.Tensor], percentile: float) -> float:
    """The ``percentile`` of |x| over all entries of ``tensors``: the value of rank ceil(p/100 * n) (1-based) in
    ascending order, exact (no sampling)."""
    x = torch.cat([t.detach().float().abs().reshape(-1).cpu() for t in tensors])
    rank = min(len(x), max(1, math.ceil(percentile / 100 * len(x))))
    return float(torch.kthvalue(x, rank).values)


def export_head(student, keep_set, input_ranges: dict[str, float]) -> QuantizedHead:
    """The integers and scales of every `QuantLinear` of ``student`` plus the float tensors the graph reads
    (norm weights, ``layer_scalar``; not the embedding table, which the head never reads: its inputs arrive
    embedded). Each ``qweight * scale`` equals the weight the student computes with, bit for bit."""
    qweight, scale, bits = {}, {}, set()
    for name, module in student.named_modules():
        if isinstance(module, QuantLinear):
            qweight[name], scale[name] = module.integers().cpu(), module.scale.detach().float().cpu().clone()
            bits.add(module.bits)
    if len(bits) != 1:
        raise HeadQatError(f"the head's linear layers have mixed widths {sorted(bits)}; expected one weight_bits")
    skip = tuple(f"{n}." for n in qweight) + ("model.embed_tokens.", "masked_embedding.")
    floats = {
        name: t.detach().float().cpu().clone() for name, t in student.state_dict().items() if not name.startswith(skip)
    }
    config = student.config.to_dict()
    return QuantizedHead(
        config=config,
        keep_set=torch.as_tensor(keep_set, dtype=torch.long).cpu().numpy(),
        bits=bits.pop(),
        qweight=qweight,
        scale=scale,
        floats=floats,
        input_ranges=input_ranges,
    )


def dequantized_head(head: QuantizedHead) -> Gemma4AssistantForCausalLM:
    """A float32 ``Gemma4AssistantForCausalLM`` (eval, sdpa) computing exactly what the QAT head computed: every
    drafting Linear holds ``qweight * scale``, ``lm_head`` has |V| rows over ``head.keep_set``. Its token embedding
    table is left at its initialization (the head never reads it). Raises HeadQatError when a tensor of the
    artifact has no place in the model."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    config = Gemma4AssistantConfig.from_dict(head.config)
    config._attn_implementation = "sdpa"
    config.get_text_config()._attn_implementation = "sdpa"
    model = Gemma4AssistantForCausalLM(config).float().eval()
    hidden = model.lm_head.in_features
    model.lm_head = nn.Linear(hidden, len(head.keep_set), bias=False)
    state = dict(head.floats)
    for name in head.qweight:
        state[f"{name}.weight"] = head.qweight[name].float() * head.scale[name]
    result = model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise HeadQatError(f"the quantized head holds tensors the model has no place for: {result.unexpected_keys}")
    missing = [k for k in result.missing_keys if not k.startswith(("model.embed_tokens.", "masked_embedding."))]
    if missing:
        raise HeadQatError(f"the quantized head lacks tensors the model needs: {missing}")
    return model
