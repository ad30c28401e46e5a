"""Device time per graph call when no on-device profile exists: an ESTIMATE from bytes and multiply-accumulates
(docs/design.md "Targets": "its profiles (or a calibrated estimate, labelled as such)").

The model (one call of one static graph on the Hexagon NPU):

    t_call = overhead_ms + bytes / bandwidth + macs / mac_rate

with ``bytes`` the call's weight bytes plus its graph IO at 16 bits per activation (rings, masks, rows), ``macs``
its multiply-accumulates (every linear layer per row, attention over each layer's columns). A round's device time
adds ``host_ms_per_slm_pass`` for the host work around each SLM pass (tree expansion, ring writes, the head's
embedding rows); the bench measures that host work itself where it runs the rounds, so only the paper anchors use
it.

`NPU_PROFILES` names the parameter sets. ``"v81"`` (Snapdragon 8 Elite Gen 5, SM8850) is fitted by `fit_profile`
(non-negative least squares on relative errors) to the paper's own device figures at the Gemma 4 shapes
(`PAPER_ANCHORS`): the SLM's 32-row pass (15.7 ms at 16-bit activations, §2.4), the mobile round with the 86K keep
set and with the full vocabulary (52.9 and 77.9 ms, App. D Table 6), HyCo's 12.1 ms and SpecEdge-style's 42.8 ms of
mobile draft per token (App. G, at their MAT 4.71 and 3.53 from Table 2: per round 57.0 and 151.1 ms). It is then
checked, not fitted, against the other configurations of App. G and public Gemma 4 E2B single-token decode figures
(`CHECK_ANCHORS`: 65.3 ms per step A16W8 on SM8750 and ~81 ms per token W8A16 on SM8850, third-party, full
vocabulary). `anchor_table` prints every anchor's residual. No number here was measured on a phone.

Other Hexagon generations (v68, v73, v75, v79): no public device figure at HyCo's shapes exists to fit them, and
scaling v81's constants by a guessed ratio would be a number nobody measured. `npu_profile` therefore raises
`NotFittedError` ("not fitted for v75 ...") for them, `fit_status` lists every HTP profile's state, and the bench and
`hycoc inspect --device` print that sentence where a number would be. A fit needs per-graph device times on that
generation: `hycoc profile BUNDLE --device NAME` (AI Hub) on a bundle built for it (docs/device-time.md).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

#: Label every estimated number carries (tables, JSON), so it is never mistaken for a measurement.
ESTIMATE_LABEL = "ESTIMATE (bytes + MACs x NPU profile, fitted to the paper's device figures; not measured)"

FULL_VOCAB = 262_144


@dataclass(frozen=True)
class GraphCost:
    """One call of a graph: ``bytes`` moved (weights + 16-bit IO) and ``macs`` multiply-accumulates."""

    bytes: float
    macs: float


@dataclass(frozen=True)
class NpuProfile:
    """A named NPU's cost parameters (module docstring): ``bandwidth_gbps`` GB/s (10**9 bytes), ``tmacs`` int16
    tera-MAC/s, ``overhead_ms`` per graph call, ``host_ms_per_slm_pass`` host work per SLM pass in a round."""

    name: str
    bandwidth_gbps: float
    tmacs: float | None
    overhead_ms: float
    host_ms_per_slm_pass: float
    source: str = ""

    def call_ms(self, cost: GraphCost) -> float:
        """Estimated ms of one call (module docstring's formula). ``tmacs`` None: the anchors do not bound the MAC
        rate (memory-bound at these shapes), and the MAC term is zero."""
        mac_ms = 0.0 if self.tmacs is None else cost.macs / (self.tmacs * 1e9)
        return self.overhead_ms + cost.bytes / (self.bandwidth_gbps * 1e6) + mac_ms


#: The fitted v81 parameters (`fit_profile` on `PAPER_ANCHORS` at recipes/gemma4.toml's shapes; a test refits them).
#: The fit leaves the int16 MAC rate unbound (``tmacs`` None): at the Gemma shapes every anchor is met by the bytes
#: term alone, so the MACs bound it only from below (68.2 GMAC of the 32-row pass within its 15.7 ms: > 5.6 TMAC/s).
NPU_PROFILES: dict[str, NpuProfile] = {
    "v81": NpuProfile(
        "v81",
        bandwidth_gbps=98.24,
        tmacs=None,
        overhead_ms=3.511,
        host_ms_per_slm_pass=22.215,
        source="fit_profile(PAPER_ANCHORS) at recipes/gemma4.toml's real shapes",
    ),
}


class NotFittedError(ValueError):
    """No fitted device-time constants for the asked Hexagon generation; the message says so and how to get some."""


def npu_key(htp_arch: int | str) -> str:
    """`NPU_PROFILES` key of a Hexagon arch: 75 / "75" / "v75" -> "v75"."""
    return f"v{str(htp_arch).lower().removeprefix('v')}"


def npu_profile(htp_arch: int | str) -> NpuProfile:
    """The fitted constants of Hexagon ``htp_arch`` (75, "v75"). Raises NotFittedError for a generation without
    (module docstring): "device-time estimate not fitted for v75 ..."."""
    key = npu_key(htp_arch)
    if key in NPU_PROFILES:
        return NPU_PROFILES[key]
    raise NotFittedError(
        f"device-time estimate not fitted for {key} (fitted: {', '.join(sorted(NPU_PROFILES))}, "
        f"to the paper's SM8850 figures); profile a {key} bundle on a device with `hycoc profile "
        "BUNDLE --device NAME` and pass --device-profile instead"
    )


def fit_status() -> dict[str, str]:
    """Every HTP target profile's arch (``"v75"``) -> "fitted: SOURCE" or "not fitted for vXX" (`npu_profile`)."""
    from hycoc.targets.profiles import PROFILES

    out = {}
    arches = (p.htp_arch for p in PROFILES.values() if p.backend == "htp" and p.htp_arch is not None)  # all have one
    for arch in sorted(arches, reverse=True):
        key = npu_key(arch)
        out[key] = f"fitted: {NPU_PROFILES[key].source}" if key in NPU_PROFILES else f"not fitted for {key}"
    return out


# ---- graph costs --------------------------------------------------------------------------------------------------


def _io_bytes(specs) -> int:
    """Bytes of graph IO at 16 bits per float activation (A16 graphs), integers at their own width."""
    total = 0
    for s in specs:
        n = math.prod(int(d) for d in s["shape"])
        total += n * (8 if "int64" in s["dtype"] else 2)
    return total


def plan_costs(plan: Mapping, *, vocab: int | None = None, decode_columns: int | None = None) -> dict[str, GraphCost]:
    """Real-shape cost of one call of each drafter graph from `hycoc.passes.plan.real_shape_plan`: ``head`` (one
    MTP step), ``slm`` (one B-row tree pass), ``slm_decode`` (one row, SLM alone). ``vocab``: the output layers'
    rows (default the plan's keep set; `FULL_VOCAB` for the full vocabulary), rescaling the lm_head's MACs and
    bytes. ``decode_columns``: attention columns of the decode row (default the SLM's ring + 1)."""
    keep = int(plan["round"]["keep_set"])
    v = keep if vocab is None else int(vocab)
    out = {}
    for name in ("head", "slm"):
        g = plan["graphs"][name]
        m = g["macs"]
        scale = v / keep
        lm_macs = m["lm_head_per_row"] * (scale - 1)
        lm_bytes = m["lm_head_bytes"] * (scale - 1)
        io = _io_bytes(g["inputs"]) + _io_bytes([o for o in g["outputs"] if o["name"] != "logits"])
        out[name] = GraphCost(bytes=g["weights"]["total_bytes"] + lm_bytes + io, macs=m["total"] + m["rows"] * lm_macs)
        if name == "slm":
            rows = m["rows"]
            attn_row = m["attention"] / rows
            if decode_columns is not None:
                ring = plan["graphs"]["slm"]["ring"]
                attn_row *= decode_columns / (ring["full"] + rows)
            out["slm_decode"] = GraphCost(
                bytes=g["weights"]["total_bytes"] + lm_bytes + io / rows, macs=m["linear_per_row"] + lm_macs + attn_row
            )
    return out


def onnx_graph_cost(path: str | os.PathLike) -> GraphCost:
    """Cost of one call of an ONNX graph from the file itself: initializer bytes (external data by its recorded
    length, never read), 16-bit IO bytes, and MACs of every MatMul/Gemm from ONNX shape inference (static shapes:
    output elements x the reduced dimension). Raises ValueError when a MatMul's shapes cannot be inferred."""
    import onnx

    from hycoc.targets.htp import initializer_bytes

    m = onnx.load(str(path), load_external_data=False)
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False)
    g = inferred.graph
    shapes = {}
    for v in [*g.input, *g.output, *g.value_info]:
        dims = [d.dim_value for d in v.type.tensor_type.shape.dim]
        shapes[v.name] = dims
    for t in g.initializer:
        shapes[t.name] = list(t.dims)
    weight = sum(initializer_bytes(t) for t in g.initializer)
    inits = {t.name for t in g.initializer}
    io = 0
    for v in [*g.input, *g.output]:
        if v.name in inits:
            continue
        n = math.prod(shapes.get(v.name) or [0])
        io += n * (8 if v.type.tensor_type.elem_type == onnx.TensorProto.INT64 else 2)
    macs = 0
    for n in g.node:
        if n.op_type not in ("MatMul", "Gemm", "MatMulInteger"):
            continue
        a, out = shapes.get(n.input[0]), shapes.get(n.output[0])
        if not a or not out or 0 in out:
            raise ValueError(f"{Path(path).name}: no static shape for {n.op_type} {n.name or n.output[0]}")
        trans_a = any(x.name == "transA" and x.i for x in n.attribute)
        k = a[-2] if trans_a else a[-1]
        macs += math.prod(out) * k
    return GraphCost(bytes=float(weight + io), macs=float(macs))


# ---- anchors and the fit -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Anchor:
    """A device figure: ``calls`` graph name -> calls (``@262k``: at the full vocabulary; ``slm_decode@8k``: decode
    over an 8K context), ``slm_passes`` the host term's count, ``ms`` the figure, ``source`` where it is from."""

    name: str
    ms: float
    calls: tuple[tuple[str, int], ...]
    slm_passes: int
    source: str


PAPER_ANCHORS = (
    Anchor("SLM 32-row pass, A16", 15.7, (("slm", 1),), 0, "§2.4: 15.7 ms (38-41 ms at fp16)"),
    Anchor("mobile round, 86K keep set", 52.9, (("head", 4), ("slm", 1)), 1, "App. D Table 6, Device column"),
    Anchor("mobile round, full vocabulary", 77.9, (("head@262k", 4), ("slm@262k", 1)), 1, "App. D Table 6"),
    Anchor(
        "HyCo draft per round (12.1 ms/token x MAT 4.71)",
        12.1 * 4.71,
        (("head", 4), ("slm", 1)),
        1,
        "App. G + Table 2 (SB-480)",
    ),
    Anchor(
        "SpecEdge-style per round (42.8 ms/token x MAT 3.53)",
        42.8 * 3.53,
        (("slm", 4),),
        4,
        "App. G + Table 2 (SB-480)",
    ),
)

CHECK_ANCHORS = (
    Anchor("HyCo-2P per round (18.2 x 5.27)", 18.2 * 5.27, (("head", 4), ("slm", 2)), 2, "App. G + Table 2"),
    Anchor("HyCo exact per round (14.7 x 3.84)", 14.7 * 3.84, (("head", 4), ("slm", 1)), 1, "App. G + Table 2"),
    Anchor("server head per round (9.2 x 3.79)", 9.2 * 3.79, (("slm", 1),), 1, "App. G + Table 2"),
    Anchor("SLM alone, 8K context, full vocab, per token", 36.8, (("slm_decode@262k@8k", 1),), 0, "App. G"),
    Anchor(
        "Gemma 4 E2B decode A16W8, SM8750 (v79)",
        65.3,
        (("e2b_w8@262k", 1),),
        0,
        "public third-party figure; another NPU generation than the v81 profile",
    ),
    Anchor(
        "Gemma 4 E2B decode W8A16, SM8850", 81.0, (("e2b_w8@262k", 1),), 0, "public third-party figure (~12.4 tok/s)"
    ),
)


def anchor_costs(plan: Mapping) -> dict[str, GraphCost]:
    """Every cost an anchor names (`Anchor.calls`), at the plan's real shapes."""
    keep = plan_costs(plan)
    full = plan_costs(plan, vocab=FULL_VOCAB)
    full8k = plan_costs(plan, vocab=FULL_VOCAB, decode_columns=8192)
    costs = dict(keep)
    costs.update({f"{k}@262k": v for k, v in full.items()})
    costs["slm_decode@262k@8k"] = full8k["slm_decode"]
    # the whole E2B at 8-bit weights (the public figures): one byte per linear weight, full-vocabulary output layer
    slm = plan["graphs"]["slm"]["macs"]
    w8 = slm["linear_per_row"] - slm["lm_head_per_row"] + FULL_VOCAB * int(plan["models"]["slm"]["hidden_size"])
    costs["e2b_w8@262k"] = GraphCost(bytes=float(w8), macs=float(w8 + slm["attention"] / slm["rows"]))
    return costs


def anchor_ms(anchor: Anchor, costs: Mapping[str, GraphCost], profile: NpuProfile) -> float:
    """The profile's estimate of ``anchor`` (ms)."""
    return (
        sum(n * profile.call_ms(costs[g]) for g, n in anchor.calls) + anchor.slm_passes * profile.host_ms_per_slm_pass
    )


def fit_profile(plan: Mapping, anchors=PAPER_ANCHORS, name: str = "v81") -> NpuProfile:
    """Non-negative least squares of (1/bandwidth, 1/MAC rate, overhead, host per pass) on the anchors' relative
    errors (each row divided by its figure) at the plan's shapes. Raises ValueError when the fit is degenerate."""
    import numpy as np
    from scipy.optimize import nnls

    costs = anchor_costs(plan)
    rows, target = [], []
    for a in anchors:
        b = sum(n * costs[g].bytes for g, n in a.calls) / 1e6  # MB -> ms per (GB/s)
        m = sum(n * costs[g].macs for g, n in a.calls) / 1e9  # GMAC -> ms per (TMAC/s)
        c = sum(n for _, n in a.calls)
        rows.append([b / a.ms, m / a.ms, c / a.ms, a.slm_passes / a.ms])
        target.append(1.0)
    x, _ = nnls(np.asarray(rows), np.asarray(target))
    inv_bw, inv_r, over, host = (float(v) for v in x)
    if inv_bw <= 0:
        raise ValueError("fit_profile: the anchors leave the bandwidth unbound")
    return NpuProfile(
        name,
        bandwidth_gbps=1 / inv_bw,
        tmacs=1 / inv_r if inv_r > 0 else None,
        overhead_ms=over,
        host_ms_per_slm_pass=host,
        source=f"fit_profile on {len(anchors)} paper anchors at the plan's real shapes",
    )


def anchor_table(plan: Mapping, profile: NpuProfile) -> list[dict]:
    """Every anchor (fitted and check) with the profile's estimate and the residual (estimate - figure, ms and %)."""
    costs = anchor_costs(plan)
    out = []
    for kind, anchors in (("fit", PAPER_ANCHORS), ("check", CHECK_ANCHORS)):
        for a in anchors:
            est = anchor_ms(a, costs, profile)
            out.append(
                {
                    "anchor": a.name,
                    "kind": kind,
                    "figure_ms": round(a.ms, 2),
                    "estimate_ms": round(est, 2),
                    "residual_ms": round(est - a.ms, 2),
                    "residual_pct": round(100 * (est - a.ms) / a.ms, 1),
                    "source": a.source,
                }
            )
    return out


def estimate_graphs(plan: Mapping, profile: NpuProfile) -> dict[str, dict]:
    """Per drafter graph at the real shape: bytes, MACs and the estimated ms per call (`ESTIMATE_LABEL`)."""
    return {
        g: {"bytes": int(c.bytes), "macs": int(c.macs), "estimate_ms": round(profile.call_ms(c), 3)}
        for g, c in plan_costs(plan).items()
    }


# ---- bundles -----------------------------------------------------------------------------------------------------


def bundle_graph_costs(bundle_dir: str | os.PathLike) -> dict[str, GraphCost]:
    """Cost of one call of each graph of a bundle: from ``report.json``'s ``graph_costs`` (written at build time from
    the QDQ graphs), else from the bundle's own QDQ ONNX files (cpu bundles). Raises ValueError for a graph with
    neither (an older htp bundle: rebuild it)."""
    bundle_dir = Path(bundle_dir)
    manifest = json.loads((bundle_dir / "manifest.json").read_text(encoding="utf-8"))
    report_path = bundle_dir / "report.json"
    recorded: dict[str, dict] = {}
    if report_path.is_file():
        recorded = json.loads(report_path.read_text(encoding="utf-8")).get("graph_costs") or {}
    out = {}
    for g in manifest["graphs"]:
        name = g["name"]
        if name in recorded:
            out[name] = GraphCost(float(recorded[name]["bytes"]), float(recorded[name]["macs"]))
        elif g.get("context_binary") is None:
            out[name] = onnx_graph_cost(bundle_dir / g["file"])
        else:
            raise ValueError(
                f"{bundle_dir}: graph {name} is compiled and report.json records no graph_costs for "
                f"it; rebuild the bundle to estimate its device time"
            )
    return out


def allowance_round_ms(
    head_ms: float,
    slm_ms: float,
    *,
    chain_length: int,
    sibling_depth: int,
    tree_rows: int,
    slm_rows: int,
    slm_passes: int = 1,
    host_ms_per_slm_pass: float = 0.0,
) -> list[dict]:
    """The phone's drafting ms of one HyCo round at each allowance A = 1 .. ``tree_rows`` (B + 1; protocol 6's
    `hycoc.protocol.messages.RoundReply.allowance`, drafted as `hycoc.runtime.tree_builder.TreeBuilder.build` does):
    K = ``chain_length`` head steps (Alg. 2) always, and, above the floor (A > K + 1), ``slm_passes`` SLM tree passes
    plus ``host_ms_per_slm_pass`` of host work each; at the floor (A <= K + 1) no SLM pass.

    head_ms / slm_ms: ms of one head step / one SLM tree pass (an estimate, `NpuProfile.call_ms`, or a profile's
    median). slm_rows: the SLM tree graph's rows R; sibling_depth: D. A round at the floor leaves its committed
    tokens (at most K + 1) without SLM KV; the next pass runs them first in chunks of up to R - K - D rows
    (`hycoc.runtime.slm_drafter.SlmDrafter.catch_up`), so each floor round defers at most (K + 1) / (R - K - D) SLM
    calls (``deferred_slm_ms_max``: their ms at that bound, paid once the allowance rises; less when fewer tokens
    are accepted, and at most a ring's refill however long the floor lasts). Returns one dict per allowance:
    ``allowance``, ``head_calls``, ``slm_calls``, ``ms`` (round ms, deferred part excluded), ``deferred_slm_ms_max``.
    Raises ValueError for a tree or graph too small for the chain (tree_rows < 1, slm_rows <= K + D)."""
    k, d = int(chain_length), int(sibling_depth)
    if tree_rows < 1 or slm_rows <= k + d:
        raise ValueError(
            f"allowance_round_ms: needs tree_rows >= 1 and slm_rows > K + D ({k} + {d}); got {tree_rows}, {slm_rows}"
        )
    deferred = (k + 1) / (slm_rows - k - d) * slm_ms
    out = []
    for a in range(1, int(tree_rows) + 1):
        slm_calls = int(slm_passes) if a > k + 1 else 0
        ms = k * head_ms + slm_calls * (slm_ms + host_ms_per_slm_pass)
        out.append(
            {
                "allowance": a,
                "head_calls": k,
                "slm_calls": slm_calls,
                "ms": round(ms, 3),
                "deferred_slm_ms_max": round(deferred if slm_calls == 0 else 0.0, 3),
            }
        )
    return out


def plan_allowance_rounds(plan: Mapping, profile: NpuProfile, sibling_depth: int, slm_passes: int = 1) -> list[dict]:
    """`allowance_round_ms` at the plan's real shapes (`hycoc.passes.plan.real_shape_plan`'s ``round``: K, B + 1 tree
    rows, the SLM graph's rows) with ``profile``'s estimated call ms and host term (`ESTIMATE_LABEL`)."""
    r = plan["round"]
    costs = plan_costs(plan)
    return allowance_round_ms(
        profile.call_ms(costs["head"]),
        profile.call_ms(costs["slm"]),
        chain_length=int(r["chain_length"]),
        sibling_depth=int(sibling_depth),
        tree_rows=int(r["tree_rows"]),
        slm_rows=int(r["slm_rows"]),
        slm_passes=slm_passes,
        host_ms_per_slm_pass=profile.host_ms_per_slm_pass,
    )


def plan_estimate(plan: Mapping, npu: int | str = "v81", sibling_depth: int | None = None) -> dict:
    """The plan's ``device_time_estimate`` section (`hycoc inspect RECIPE`): the label, the NPU profile, per graph
    bytes / MACs / estimated ms per call at the real shape, every anchor's residual (`anchor_table`), and, given
    the recipe's ``sibling_depth`` (D), HyCo's round ms at each allowance (``allowance_rounds``:
    `plan_allowance_rounds`; empty without it). ``npu``: the Hexagon arch (81, "v81"); one without fitted constants
    gives ``{"label", "npu_profile": None, "not_fitted": sentence}`` (`npu_profile`)."""
    try:
        profile = npu_profile(npu)
    except NotFittedError as e:
        return {
            "label": ESTIMATE_LABEL,
            "npu_profile": None,
            "not_fitted": str(e),
            "graphs": {},
            "anchors": [],
            "allowance_rounds": [],
        }
    return {
        "label": ESTIMATE_LABEL,
        "npu_profile": asdict(profile),
        "graphs": estimate_graphs(plan, profile),
        "anchors": anchor_table(plan, profile),
        "allowance_rounds": [] if sibling_depth is None else plan_allowance_rounds(plan, profile, sibling_depth),
    }
