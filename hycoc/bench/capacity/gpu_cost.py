"""The verifier's forward on a GPU, from the model's own config: a roofline of the bytes and FLOPs one batched
forward moves, with the mixture-of-experts weights a forward of n rows touches (docs/capacity.md "The real-shape
projection").

Why. The projection used to price a forward as flat up to a dense model's ridge point (206 rows on an H200) and
linear beyond. A mixture-of-experts verifier (Gemma 4 26B-A4B: 128 experts, top 8 per token) reads the weights
of every expert ANY of its rows routes to, so its bytes grow with the rows long before any compute ridge: one row
reads 8 experts per layer, a 33-row tree ~113 of 128.

The expected distinct experts of one layer (`expected_experts`). Each row routes to k of the E experts; with a
router whose choices are exchangeable across experts (no expert favoured: a random router, and the assumption
for a trained one), a row's k-subset contains a given expert with probability k/E. Rows are routed independently,
so the chance that none of n rows picks that expert is (1 - k/E)^n, and by linearity of expectation over the E
experts

    E[distinct experts] = E x (1 - (1 - k/E)^n).

(n = 1: k; n -> infinity: E.) tests/test_gpu_cost.py checks it against an exact enumeration and a direct
simulation of random top-k draws. A trained router concentrates tokens on fewer experts, so for it this is an upper
bound on the experts read.

The forward (`GpuRoofline.forward_ms`): each part of the model is a kernel bound by its bytes or its FLOPs,
whichever takes longer on the GPU (the roofline, Williams et al. 2009); the parts add up; an efficiency and a fixed
cost per transformer layer turn peak numbers into milliseconds:

    ms = c x layers + (1 / eta) x sum over parts of max(bytes / bandwidth, flops / bf16 FLOPS)

parts: attention projections, the session's KV read (each session reads its own cached positions once per
forward: sliding layers their window, full layers the context; attention scores 4 x heads x head_dim FLOPs per row
and position), the dense MLP and router, the experts (distinct experts x expert bytes, 2 x k x expert parameters
FLOPs per row), the LM head (vocabulary x hidden). Every count comes from the config.json fields of the recipe's
verifier (`ModelShape.from_config`): ``num_hidden_layers``, ``layer_types``, ``hidden_size``,
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``global_head_dim``,
``num_global_key_value_heads``, ``attention_k_eq_v``, ``sliding_window``, ``intermediate_size``,
``enable_moe_block``, ``num_experts`` (or ``num_local_experts``), ``top_k_experts`` (or ``num_experts_per_tok``),
``moe_intermediate_size``, ``vocab_size``. A config without experts is a dense model: its line has no expert term.

Weights are read at the serving format's bits (`WeightFormat`): the paper's (App. B) AWQ 4-bit attention
projections and experts (Marlin kernels), 16-bit dense MLP and router; the LM head at 16 bits (ASSUMED: AWQ leaves
it unquantized). The KV cache at 16 bits.

The fit (`fit_paper`): eta and c are the two unknowns of two measured rounds on the paper's GPU (§3.1, one RTX PRO
6000, median round): a HyCo round, one (B + 1)-row verification = 21.7 ms, and a Cloud+MTP round, K head steps
then a (K + 1)-row verification = 26.8 ms, each minus the host ms of one session (assumed) and at an assumed
context. Both rounds are linear in (c, 1/eta), so the fit is the exact solution of a 2 x 2 system (a layer of the
head counts as a layer). At recipes/gemma4.toml's shapes it gives eta ~1.04 (the bytes at peak bandwidth, within
the routing assumption's margin) and c ~0.45 ms per layer (~13 ms per 30-layer forward: kernel latencies and
launches, which the paper's engine's CUDA graphs do not remove): the paper's rounds are mostly fixed cost, and a
batch of rows mostly adds bytes. Another GPU (`GPU_SPECS`) keeps eta and c (ASSUMED) and changes the bandwidth and
FLOPS.

Core module: numpy only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class GpuCostError(ValueError):
    """A config or a fit this cost line cannot use; one line naming the field or the anchor and the fix."""


# ---- GPUs -----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuSpec:
    """One GPU's peak numbers: ``bandwidth_gbs`` memory bandwidth, GB/s (10**9 bytes); ``bf16_tflops`` dense BF16
    tensor-core TFLOPS (no 2:4 sparsity); ``source`` where they are from."""

    name: str
    bandwidth_gbs: float
    bf16_tflops: float
    source: str


#: The GPUs the projection knows (``--gpu``). The paper's is the default.
GPU_SPECS: dict[str, GpuSpec] = {
    "rtx-pro-6000": GpuSpec(
        "NVIDIA RTX PRO 6000 Blackwell",
        1792.0,
        500.0,
        "NVIDIA RTX PRO 6000 Blackwell product page: 96 GB GDDR7, 512-bit bus at 28 Gbps = 1,792 GB/s; "
        "4,000 AI TOPS (FP4, 2:4 sparse) = 500 TFLOPS dense BF16 (sparse / 2, FP4 -> FP8 -> BF16 / 2 each)",
    ),
    "h100": GpuSpec(
        "NVIDIA H100 SXM5 80GB",
        3350.0,
        989.4,
        "NVIDIA H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3; BF16 Tensor Core 1,979 TFLOPS with sparsity "
        "(989.4 dense)",
    ),
    "h200": GpuSpec(
        "NVIDIA H200 SXM 141GB",
        4800.0,
        989.4,
        "NVIDIA H200 Tensor Core GPU datasheet: 4.8 TB/s HBM3e; BF16 Tensor Core 1,979 TFLOPS with sparsity "
        "(989.4 dense)",
    ),
}
#: The paper's GPU (§4.1, App. B: one RTX PRO 6000), whose measured rounds anchor the fit.
DEFAULT_GPU = "rtx-pro-6000"


def gpu_spec(name: str) -> GpuSpec:
    """`GPU_SPECS`[name]; raises GpuCostError naming the choices."""
    if name not in GPU_SPECS:
        raise GpuCostError(f"--gpu {name!r}: one of {', '.join(GPU_SPECS)}")
    return GPU_SPECS[name]


# ---- the model's shape ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightFormat:
    """Bits per stored weight of each part, and per cached KV value. AWQ's 4 bits carry a 16-bit scale and a 4-bit
    zero point per group of 128 weights: 4 + 20/128 bits."""

    attention_bits: float
    expert_bits: float
    dense_bits: float
    head_bits: float
    kv_bits: float
    label: str


#: The paper's serving (App. B): "Attention projections run as 4-bit integer Marlin and the experts ... through
#: the fused Marlin kernel, while the dense MLP and the router stay in 16 bits"; LM head 16 bits (ASSUMED).
PAPER_WEIGHTS = WeightFormat(
    4 + 20 / 128,
    4 + 20 / 128,
    16.0,
    16.0,
    16.0,
    "paper App. B: AWQ 4-bit (group 128) attention and experts, 16-bit dense MLP and router; LM head 16-bit "
    "(ASSUMED); KV 16-bit",
)
#: hycoc's reference verifier (transformers, bfloat16 everywhere).
BF16_WEIGHTS = WeightFormat(16.0, 16.0, 16.0, 16.0, 16.0, "bfloat16 weights and KV")


def _first(d: dict, *keys, default=None):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a decoder's config that set a forward's bytes and FLOPs (`from_config`). Per layer:
    ``sliding`` (a tuple of bools: the layer is a sliding-window layer). Attention: ``heads`` query heads;
    sliding layers ``kv_heads`` x ``head_dim``, full layers ``global_kv_heads`` x ``global_head_dim``, full layers
    without a value projection when ``k_eq_v``. ``intermediate``: the dense gated MLP (0: none); ``experts``,
    ``top_k``, ``expert_intermediate``: the MoE block (experts 0: a dense model)."""

    name: str
    hidden: int
    sliding: tuple[bool, ...]
    heads: int
    kv_heads: int
    head_dim: int
    global_kv_heads: int
    global_head_dim: int
    k_eq_v: bool
    window: int
    intermediate: int
    experts: int
    top_k: int
    expert_intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: dict, name: str = "") -> ModelShape:
        """From a config.json dict (its ``text_config`` when there is one). Raises GpuCostError naming a missing
        field, or an MoE config without its top-k or expert size."""
        d = config.get("text_config") or config
        need = ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
        missing = [k for k in need if d.get(k) is None]
        if missing:
            raise GpuCostError(f"verifier config {name or ''}: field {missing[0]} is missing; give the model's config")
        layers = int(d["num_hidden_layers"])
        types = list(d.get("layer_types") or ["full_attention"] * layers)[:layers]
        hidden, heads = int(d["hidden_size"]), int(d["num_attention_heads"])
        head_dim = int(_first(d, "head_dim", default=hidden // heads))
        kv = int(_first(d, "num_key_value_heads", default=heads))
        experts = int(_first(d, "num_experts", "num_local_experts", "n_routed_experts", default=0) or 0)
        top_k = int(_first(d, "top_k_experts", "num_experts_per_tok", default=0) or 0)
        gemma_style = d.get("enable_moe_block") is not None
        if gemma_style and not d.get("enable_moe_block"):
            experts = 0
        dense = int(d.get("intermediate_size") or 0)
        expert_i = int(_first(d, "moe_intermediate_size", default=0) or 0)
        if experts and not gemma_style and not expert_i:  # Mixtral-style: the experts are the MLP
            expert_i, dense = dense, 0
        if experts and (top_k < 1 or expert_i < 1):
            raise GpuCostError(
                f"verifier config {name}: {experts} experts but no top-k (top_k_experts / num_experts_per_tok) or "
                "expert size (moe_intermediate_size)"
            )
        return cls(
            name=name,
            hidden=hidden,
            sliding=tuple(t == "sliding_attention" for t in types),
            heads=heads,
            kv_heads=kv,
            head_dim=head_dim,
            global_kv_heads=int(_first(d, "num_global_key_value_heads", default=kv)),
            global_head_dim=int(_first(d, "global_head_dim", default=head_dim)),
            k_eq_v=bool(d.get("attention_k_eq_v", False)),
            window=int(_first(d, "sliding_window", default=0) or 0),
            intermediate=dense,
            experts=experts,
            top_k=top_k,
            expert_intermediate=expert_i,
            vocab=int(d["vocab_size"]),
        )

    @property
    def layers(self) -> int:
        return len(self.sliding)

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    def attention_params(self) -> int:
        """Attention projection weights of all layers (q, k, v, o; no v on full layers with k_eq_v)."""
        total = 0
        for s in self.sliding:
            kvh, d = (self.kv_heads, self.head_dim) if s else (self.global_kv_heads, self.global_head_dim)
            kv_mats = 1 if (self.k_eq_v and not s) else 2
            total += 2 * self.hidden * self.heads * d + kv_mats * self.hidden * kvh * d
        return total

    def dense_params(self) -> int:
        """Dense gated MLP (gate, up, down) and router weights of all layers."""
        return self.layers * (3 * self.hidden * self.intermediate + self.hidden * self.experts)

    def expert_params(self) -> int:
        """One expert's weights (gate, up, down): 3 x hidden x expert intermediate."""
        return 3 * self.hidden * self.expert_intermediate

    def head_params(self) -> int:
        """The LM head (vocabulary x hidden; tied or not, a forward reads it once)."""
        return self.vocab * self.hidden

    def parameters(self) -> int:
        """All weights: attention, dense MLP and router, every expert, the embedding / LM head."""
        return (
            self.attention_params()
            + self.dense_params()
            + self.layers * self.experts * self.expert_params()
            + self.head_params()
        )

    def kv_bytes_per_position(self, kv_bits: float = 16.0) -> tuple[float, float]:
        """(sliding layers, full layers) KV bytes one cached position holds, summed over those layers (keys and
        values both cached, as `hycoc.verifier.kv_cache` holds them)."""
        b = kv_bits / 8
        sl = sum(2 * self.kv_heads * self.head_dim * b for s in self.sliding if s)
        fu = sum(2 * self.global_kv_heads * self.global_head_dim * b for s in self.sliding if not s)
        return float(sl), float(fu)

    def kv_read_bytes(self, context, kv_bits: float = 16.0):
        """KV bytes one session's forward reads at ``context`` cached positions (a number or an array of them):
        sliding layers their window (min(context, sliding_window)), full layers every position."""
        sl, fu = self.kv_bytes_per_position(kv_bits)
        c = np.asarray(context, np.float64)
        reach = np.minimum(c, float(self.window)) if self.window else c
        return sl * reach + fu * c

    def score_flops_per_row(self, context):
        """Attention-score FLOPs of one row over ``context`` positions (a number or an array), all layers (QK^T and
        AV: 4 x heads x head_dim per position; sliding layers over their window)."""
        n_sl = sum(self.sliding)
        c = np.asarray(context, np.float64)
        reach = np.minimum(c, float(self.window)) if self.window else c
        return 4.0 * self.heads * (n_sl * self.head_dim * reach + (self.layers - n_sl) * self.global_head_dim * c)


def expected_experts(rows, experts: int, top_k: int) -> np.ndarray:
    """Expected distinct experts one layer's forward of ``rows`` rows reads, E x (1 - (1 - k/E)^n) (module
    docstring); float64 of rows' shape. ``experts`` 0: a dense model, 0."""
    n = np.asarray(rows, np.float64)
    if experts <= 0:
        return np.zeros_like(n)
    return experts * (1.0 - (1.0 - top_k / experts) ** n)


# ---- the roofline ---------------------------------------------------------------------------------------------------


def _bound_ms(nbytes: float, flops: float, gpu: GpuSpec) -> float:
    """One part's roofline time, ms: max(bytes / bandwidth, FLOPs / FLOPS)."""
    return max(nbytes / (gpu.bandwidth_gbs * 1e6), flops / (gpu.bf16_tflops * 1e9))


def roofline_parts(shape: ModelShape, rows: int, contexts, weights: WeightFormat, gpu: GpuSpec) -> dict[str, float]:
    """Peak-rate ms of each part of one forward of ``rows`` rows (all sessions together) whose sessions sit at
    ``contexts`` (one cached-position count per session; rows are spread evenly over them for the score FLOPs):
    attention projections, kv (the sessions' KV reads and scores), dense (MLP and router), experts, lm_head."""
    n = float(rows)
    ctx = np.atleast_1d(np.asarray(contexts, np.float64))
    per_row = n / len(ctx)
    kv_bytes = float(np.sum(shape.kv_read_bytes(ctx, weights.kv_bits)))
    kv_flops = float(per_row * np.sum(shape.score_flops_per_row(ctx)))
    attn = shape.attention_params()
    dense = shape.dense_params()
    e_bytes = float(expected_experts(n, shape.experts, shape.top_k)) * shape.layers * shape.expert_params()
    e_flops = 2.0 * n * shape.top_k * shape.expert_params() * shape.layers
    head = shape.head_params()
    return {
        "attention": _bound_ms(attn * weights.attention_bits / 8, 2.0 * n * attn, gpu),
        "kv": _bound_ms(kv_bytes, kv_flops, gpu),
        "dense": _bound_ms(dense * weights.dense_bits / 8, 2.0 * n * dense, gpu),
        "experts": _bound_ms(e_bytes * weights.expert_bits / 8, e_flops, gpu),
        "lm_head": _bound_ms(head * weights.head_bits / 8, 2.0 * n * head, gpu),
    }


@dataclass(frozen=True)
class Efficiency:
    """The roofline's two fitted terms (`fit_paper`): ``eta`` the share of peak rates reached (ms = peak ms /
    eta), ``layer_ms`` fixed ms per transformer layer of a forward; ``how``: the fit, in words."""

    eta: float
    layer_ms: float
    how: str = ""


@dataclass(frozen=True)
class GpuRoofline:
    """Forward milliseconds of a verifier (and its MTP head) on one GPU (module docstring)."""

    shape: ModelShape
    gpu: GpuSpec
    weights: WeightFormat
    efficiency: Efficiency
    head: ModelShape | None = None
    head_weights: WeightFormat = BF16_WEIGHTS

    def forward_ms(self, rows: int, contexts) -> float:
        """One verification forward of ``rows`` rows over sessions at ``contexts`` (module docstring), ms."""
        parts = roofline_parts(self.shape, rows, contexts, self.weights, self.gpu)
        return self.efficiency.layer_ms * self.shape.layers + sum(parts.values()) / self.efficiency.eta

    def head_step_ms(self, contexts) -> float:
        """One batched step of the server's MTP head: one query row per session at ``contexts``. The head's own
        weights (all its layers, no experts) and, per session, the verifier KV it reads (a sliding and a full
        layer's: the head's layers are KV-shared), ms. 0 without a head shape."""
        if self.head is None:
            return 0.0
        ctx = np.atleast_1d(np.asarray(contexts, np.float64))
        h = self.head
        parts = roofline_parts(h, len(ctx), [0.0], self.head_weights, self.gpu)
        sl, fu = self.shape.kv_bytes_per_position(self.head_weights.kv_bits)
        per_sl, per_fu = sl / max(1, sum(self.shape.sliding)), fu / max(1, self.shape.layers - sum(self.shape.sliding))
        reach = np.minimum(ctx, self.shape.window) if self.shape.window else ctx
        kv = float(np.sum(per_sl * reach + per_fu * ctx))
        parts["kv"] = _bound_ms(kv, float(np.sum(h.score_flops_per_row(ctx))), self.gpu)
        return self.efficiency.layer_ms * h.layers + sum(parts.values()) / self.efficiency.eta


def fit_paper(
    shape: ModelShape,
    head: ModelShape,
    gpu: GpuSpec,
    weights: WeightFormat,
    *,
    tree_rows: int,
    chain_length: int,
    hyco_ms: float,
    cloud_ms: float,
    host_ms: float,
    context: int,
) -> Efficiency:
    """eta and the per-layer ms that make a one-session HyCo round (one ``tree_rows``-row verification) cost
    ``hyco_ms`` and a Cloud+MTP round (``chain_length`` head steps + a (K + 1)-row verification) ``cloud_ms``, each
    less ``host_ms``, at ``context`` cached positions on ``gpu`` (module docstring). Both are linear in (c, 1/eta):

        L_v c + P_v(R) x = hyco - host;  (L_v + K L_h) c + (P_v(K + 1) + K P_h) x = cloud - host

    with P the peak-rate ms (`roofline_parts` summed) and x = 1/eta. Raises GpuCostError when the solution has a
    negative layer cost or a non-positive 1/eta (the anchors contradict the shapes)."""
    unit = GpuRoofline(shape, gpu, weights, Efficiency(1.0, 0.0), head)
    p_tree = unit.forward_ms(tree_rows, [context])
    p_chain = unit.forward_ms(chain_length + 1, [context])
    p_head = unit.head_step_ms([context])
    a = np.array([[shape.layers, p_tree], [shape.layers + chain_length * head.layers, p_chain + chain_length * p_head]])
    b = np.array([hyco_ms - host_ms, cloud_ms - host_ms])
    c, x = np.linalg.solve(a, b)
    if c < 0 or x <= 0:
        raise GpuCostError(
            f"the paper's rounds ({hyco_ms} / {cloud_ms} ms) fit a per-layer cost {c:.3f} ms and 1/eta {x:.3f} on "
            f"{gpu.name}: not a cost line; check the verifier and head configs"
        )
    how = (
        f"solved exactly from the paper's one-session rounds on its GPU (§3.1: HyCo {hyco_ms} ms = one "
        f"{tree_rows}-row verification; Cloud+MTP {cloud_ms} ms = {chain_length} head steps + a "
        f"{chain_length + 1}-row verification; each less {host_ms:g} ms host, at context {context}): "
        f"{shape.layers} layers x c + {p_tree:.2f} ms x 1/eta and "
        f"{shape.layers + chain_length * head.layers} layers x c + "
        f"{p_chain + chain_length * p_head:.2f} ms x 1/eta -> c = {c:.3f} ms per layer, eta = {1 / x:.3f}"
    )
    return Efficiency(eta=float(1 / x), layer_ms=float(c), how=how)


def describe_line(roof: GpuRoofline, contexts=(512,)) -> list[str]:
    """The cost line in words: the GPU and its source, the weights, the experts formula's numbers at 1, 5 and 33
    rows, the fit, and the forward ms at a few rows."""
    s, e = roof.shape, roof.efficiency
    out = [
        f"GPU: {roof.gpu.name}, {roof.gpu.bandwidth_gbs:,.0f} GB/s, {roof.gpu.bf16_tflops:,.1f} dense BF16 TFLOPS "
        f"({roof.gpu.source})",
        f"weights: {roof.weights.label}; {s.parameters() / 1e9:.2f}e9 parameters ({s.name})",
    ]
    if s.is_moe:
        got = ", ".join(f"{n} rows {float(expected_experts(n, s.experts, s.top_k)):.1f}" for n in (1, 5, 33, 132, 528))
        out.append(
            f"MoE: {s.experts} experts, top {s.top_k}, expert {s.expert_params() / 1e6:.2f}M parameters x "
            f"{s.layers} layers; expected distinct experts per layer E(1 - (1 - k/E)^n): {got}"
        )
    else:
        out.append("dense model: no expert term")
    out.append(f"efficiency: {e.how}" if e.how else f"efficiency: eta {e.eta:.3f}, {e.layer_ms:.3f} ms per layer")
    ms = ", ".join(f"{n} rows {roof.forward_ms(n, list(contexts) * max(1, n // 33)):.1f}" for n in (1, 5, 33, 132, 528))
    out.append(f"forward ms (sessions = rows // 33, context {contexts[0]}): {ms}")
    return out


__all__ = [
    "BF16_WEIGHTS",
    "DEFAULT_GPU",
    "GPU_SPECS",
    "PAPER_WEIGHTS",
    "Efficiency",
    "GpuCostError",
    "GpuRoofline",
    "GpuSpec",
    "ModelShape",
    "WeightFormat",
    "describe_line",
    "expected_experts",
    "fit_paper",
    "gpu_spec",
    "roofline_parts",
]
