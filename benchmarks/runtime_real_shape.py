"""The device runtime's host work per HyCo round at the paper's shapes (docs/device-runtime.md "Host work per round").

    python benchmarks/runtime_real_shape.py                      # 60 rounds after 5 warm-up rounds, 3 variants
    python benchmarks/runtime_real_shape.py --rounds 200 --variant graph-topk --json runs/runtime-real-shape.json

Variants (``--variant``): ``host-topk`` -- the graphs emit logits only and the host ranks the keep set;
``graph-topk`` -- the graphs also emit their top-k (`hycoc.passes.topk_outputs`) and the runtime fetches only
those; ``graph-topk-iobinding`` -- the same through onnxruntime IOBindings (`GraphRunner` ``io_binding``).

Runs the round loop of `hycoc.runtime.client.DeviceRuntime` in mode ``hyco`` -- hand-off ingest and K head calls
(`MtpDrafter`, Alg. 2), one SLM forward and the tree (`TreeBuilder` + `SlmDrafter.expand`, Alg. 3), the reply walk
and the commit (`SlmDrafter.commit`, Alg. 1 line 10) -- at the paper's shapes:

- keep set |V| = 86,089 sorted distinct ids drawn from Gemma's 262,144 (seed 0), W = 1,024, K = 4, D = 2, B = 32
  (32 SLM rows, 33 tree rows), 32 SLM candidates per row, λ = 0.66 (Table 5);
- hand-off of Gemma 4 26B-A4B (docs/design.md "Reference shapes"): x̂ = 5,632 int8 values, K/V rows of the last sliding
  layer (8 x 256) and the last full layer (2 x 512) per position; the head's rings (1, 8, 1,024, 256) and
  (1, 2, 1,024, 512);
- the E2B SLM (`hycoc.passes.plan.SLM_E2B`): 35 layers, 15 with a ring (the last 20 share KV), sliding rings
  (1, 1, 512, 256), full rings (1, 1, 1,024, 512), hidden 1,536, per-layer inputs 35 x 256, its LUT widths (token
  table 4-bit, per-layer table 2-bit, `hycoc.passes.plan.SLM_ASSUMED_BIT_MAP`).

The graphs are IO-exact STAND-INS: onnxruntime sessions (CPU EP, one thread) of generated ONNX graphs with the
real graphs' input and output names, shapes and dtypes, whose outputs are fixed random constants (copied out by
an Identity node); inputs are bound but unread. Their calls go through the runtime's own `GraphRunner`. The
stand-in's ``InferenceSession`` time (onnxruntime's binding of the inputs, the output copies, the Identity copies)
is reported on its own line and counted apart from the host work; a real graph's compute is not modelled.
Replies are synthetic: each round accepts a random path of 0-5 tree nodes (seeded) plus a bonus, and the hand-off
carries that many new positions of random int8 K/V rows; making them is not timed.

LUT rows and the head's E table: the LUTs have the real widths but 4,096 rows (token ids are looked up modulo the
row count; a lookup's cost depends on the rows it reads, not the table's height), so the check fits in memory.

Host time is split by step, as exclusive time of the runtime functions that do each step (a function's time
minus that of the timed functions it calls):

    ingest       MtpDrafter.ingest (dequantize + validate the hand-off, ring column writes)
    masks        HeadRingMask.update (head), TreeRingMask.update (SLM) (ring_masks / tree_ring_mask before
                 the masks were kept in place, runtime/tree_mask.py)
    rotary+LUT   RotaryTable.rows / RotaryBlock.rows, EmbeddingLut.lookup, SlmDrafter.feeds / MtpDrafter.feeds
                 assembly
    ring writes  SlmDrafter._write
    top-k        the head's top-2, the SLM rows' candidates (read from the graph, or log-softmax + 32 best of the
                 logits on the host) and their scoring (TreeBuilder.slm_pass)
    tree         TreeBuilder.build / plant / trim / rows_of, SlmDrafter.expand's row layout, walk_reply
    commit       SlmDrafter.commit
    io copies    GraphRunner.run around the session call (dtype/shape checks, quantize/dequantize)
    ORT call     the stand-in sessions' run (reported, not counted)

One core: numpy's thread pools and onnxruntime's intra-op pool are limited to one thread, and times are this
thread's CPU time by default (``--clock wall`` for elapsed time), so other jobs sharing the machine do not inflate
them.
"""

from __future__ import annotations

import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import numpy as np  # noqa: E402

from hycoc.bench.runtime_timing import STEPS, StepTimer, TimedSession, instrument  # noqa: E402
from hycoc.bundle import GraphEntry, TensorSpec  # noqa: E402
from hycoc.host import FULL, SLIDING, EmbeddingLut, RotaryTable  # noqa: E402
from hycoc.protocol.messages import HandOff  # noqa: E402

KEEP, VOCAB, W, K_CHAIN, D_SIB, B, CANDIDATES, LAMBDA = 86_089, 262_144, 1024, 4, 2, 32, 32, 0.66
VERIFIER_HIDDEN = 2816
HEAD_KV = {SLIDING: (8, 256), FULL: (2, 512)}
LUT_ROWS = 4096


# ---- the stand-in bundle and graphs -----------------------------------------------------------------------------


def slm_layout():
    """(layer_types, kv_layers, ring length per type, (kv heads, head dim) per type) of the E2B SLM."""
    from hycoc.passes.plan import SLM_E2B

    types = list(SLM_E2B["layer_types"])
    kv_layers = list(range(SLM_E2B["num_hidden_layers"] - SLM_E2B["num_kv_shared_layers"]))
    ring = {SLIDING: SLM_E2B["sliding_window"], FULL: W}
    dims = {
        SLIDING: (SLM_E2B["num_key_value_heads"], SLM_E2B["head_dim"]),
        FULL: (SLM_E2B["num_key_value_heads"], SLM_E2B["global_head_dim"]),
    }
    return types, kv_layers, ring, dims


#: The stand-in rings' encoding with ``quantized_io`` (uint16, as `hycoc.passes.qdq.quantize` ties ring and new rows).
RING_ENCODING = {"scale": 8.0 / 65535, "zero_point": 32768, "dtype": "uint16", "bits": 16}


def graph_specs(
    top_k_outputs: bool, *, shipped: bool = False, quantized_io: bool = False
) -> dict[str, tuple[list[tuple], list[tuple]]]:
    """name -> (inputs, outputs) as (name, shape, dtype[, encoding]) of the head and SLM graphs at real shape; with
    ``top_k_outputs`` the graphs also emit their best keep-set indices (head: 2; SLM: 32 with log-probabilities);
    ``shipped``: without the keep-set-wide ``logits`` beside them (`hycoc.passes.graph_io`); ``quantized_io``: the
    rings as uint16 inputs and the new KV rows as uint16 outputs (``[target] quantized_io``)."""
    from hycoc.passes.plan import SLM_E2B

    kv_dtype = ("uint16", RING_ENCODING) if quantized_io else ("float32",)

    head_in = [("x_hat", (1, 1, 2 * VERIFIER_HIDDEN), "float32")]
    for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
        kv, d = HEAD_KV[kind]
        head_in += [(f"k_{short}", (1, kv, W, d), *kv_dtype), (f"v_{short}", (1, kv, W, d), *kv_dtype)]
    head_in += [("mask_sliding", (1, 1, 1, W), "float32"), ("mask_full", (1, 1, 1, W), "float32")]
    for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
        d = HEAD_KV[kind][1]
        head_in += [(f"cos_{short}", (1, 1, d), "float32"), (f"sin_{short}", (1, 1, d), "float32")]
    head_out = [("logits", (1, 1, KEEP), "float32"), ("h_next", (1, 1, VERIFIER_HIDDEN), "float32")]
    if top_k_outputs:
        head_out += [("top_index", (1, 1, 2), "int64")]
        if shipped:
            head_out = head_out[1:]

    types, kv_layers, ring, dims = slm_layout()
    h, ple, n_layers = SLM_E2B["hidden_size"], SLM_E2B["hidden_size_per_layer_input"], SLM_E2B["num_hidden_layers"]
    slm_in = [("inputs_embeds", (1, B, h), "float32"), ("per_layer_inputs", (1, B, n_layers, ple), "float32")]
    for kind in sorted(set(types)):
        short = kind.removesuffix("_attention")
        d = dims[kind][1]
        slm_in += [
            (f"cos_{short}", (1, B, d), "float32"),
            (f"sin_{short}", (1, B, d), "float32"),
            (f"mask_{short}", (1, 1, B, ring[kind] + B), "float32"),
        ]
    slm_out = [("logits", (1, B, KEEP), "float32")]
    for i in kv_layers:
        kv, d = dims[types[i]]
        slm_in += [
            (f"k_ring_{i}", (1, kv, ring[types[i]], d), *kv_dtype),
            (f"v_ring_{i}", (1, kv, ring[types[i]], d), *kv_dtype),
        ]
        slm_out += [(f"k_new_{i}", (1, kv, B, d), *kv_dtype), (f"v_new_{i}", (1, kv, B, d), *kv_dtype)]
    if top_k_outputs:
        slm_out += [("top_logq", (1, B, CANDIDATES), "float32"), ("top_index", (1, B, CANDIDATES), "int64")]
        if shipped:
            slm_out = slm_out[1:]
    return {"head": (head_in, head_out), "slm": (slm_in, slm_out)}


def standin_model(inputs, outputs, seed: int):
    """An ONNX model with these inputs (unread) whose outputs are fixed random constants through Identity.
    Logits are drawn N(0, 3); indices are a random sorted choice of distinct keep-set indices per row with
    log-probabilities sorted descending."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    for name, shape, dtype, *_ in outputs:
        if name == "top_index":
            rows = int(np.prod(shape[:-1]))
            value = np.stack([rng.choice(KEEP, shape[-1], replace=False) for _ in range(rows)]).reshape(shape)
        elif name == "top_logq":
            value = -np.sort(rng.exponential(2.0, shape), axis=-1).astype(np.float32) - 0.5
        elif dtype == "uint16":
            value = rng.integers(20000, 45000, shape)
        else:
            value = (rng.standard_normal(shape) * (3.0 if name == "logits" else 1.0)).astype(np.float32)
        inits.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), f"{name}_const"))
        nodes.append(helper.make_node("Identity", [f"{name}_const"], [name]))
    elem = {"float32": onnx.TensorProto.FLOAT, "int64": onnx.TensorProto.INT64, "uint16": onnx.TensorProto.UINT16}
    graph = helper.make_graph(
        nodes,
        "standin",
        [helper.make_tensor_value_info(n, elem[t], list(s)) for n, s, t, *_ in inputs],
        [helper.make_tensor_value_info(n, elem[t], list(s)) for n, s, t, *_ in outputs],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def standin_runner(name: str, inputs, outputs, timer: StepTimer, seed: int, io_binding: bool = False):
    """A `GraphRunner` over the stand-in session of graph ``name`` (one intra-op thread)."""
    import onnxruntime as ort
    from hycoc.runtime.graphs import GraphRunner, RunnerSettings, code_outputs, runtime_outputs

    from hycoc.bundle import Encoding

    model = standin_model(inputs, outputs, seed)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), sess_options=so, providers=["CPUExecutionProvider"])

    def spec(side):
        return [
            TensorSpec(name=n, shape=list(s), dtype=t, encoding=Encoding(**e[0]) if e else None) for n, s, t, *e in side
        ]

    entry = GraphEntry(name=name, role=name, file=f"{name}.onnx", inputs=spec(inputs), outputs=spec(outputs))
    return GraphRunner.from_session(
        entry,
        TimedSession(session, timer),
        outputs=runtime_outputs(entry),
        settings=RunnerSettings(io_binding=io_binding, output_sets=4, codes=code_outputs(entry)),
    )


class ModuloLut(EmbeddingLut):
    """An `EmbeddingLut` of real width and fewer rows: ids are looked up modulo the row count."""

    def lookup(self, ids) -> np.ndarray:
        return super().lookup(np.asarray(ids, dtype=np.int64) % self.rows)

    def dense(self, max_bytes: int = 0) -> None:
        """None: it stands in for a real vocabulary's table, which stays quantized (`EmbeddingLut.dense`)."""
        return None


def standin_bundle():
    """What the drafters read from a `DeviceBundle`, at real shape (module docstring)."""
    from hycoc.passes.plan import SLM_E2B

    rng = np.random.default_rng(0)
    keep = np.sort(rng.choice(VOCAB, KEEP, replace=False)).astype(np.int64)
    keep_index = np.full(VOCAB, -1, np.int64)
    keep_index[keep] = np.arange(KEEP)
    e_q = rng.integers(-127, 128, (LUT_ROWS, VERIFIER_HIDDEN), dtype=np.int8)
    e_scale = rng.uniform(0.001, 0.01, (LUT_ROWS, 1)).astype(np.float32)

    def rotary(d, theta):
        inv = (1.0 / theta ** (np.arange(0, d, 2, dtype=np.float32) / d)).astype(np.float32)
        return RotaryTable(inv, 1.0, d)

    types, kv_layers, _, dims = slm_layout()
    h, ple, n_layers = SLM_E2B["hidden_size"], SLM_E2B["hidden_size_per_layer_input"], SLM_E2B["num_hidden_layers"]
    luts = {
        "embed_tokens": ModuloLut(
            rng.integers(0, 256, (LUT_ROWS, h // 2), dtype=np.uint8),
            rng.uniform(0.01, 0.02, (LUT_ROWS, 1)).astype(np.float32),
            4,
            h,
            math.sqrt(h),
        ),
        "embed_tokens_per_layer": ModuloLut(
            rng.integers(0, 256, (LUT_ROWS, n_layers * ple // 4), dtype=np.uint8),
            rng.uniform(0.01, 0.02, (LUT_ROWS, 1)).astype(np.float32),
            2,
            n_layers * ple,
            math.sqrt(ple),
        ),
    }
    rnd = SimpleNamespace(
        chain_length=K_CHAIN,
        sibling_depth=D_SIB,
        node_budget=B,
        head_window=W,
        head_query_position_offset=-1,
        depth_cost=LAMBDA,
        slm_candidates=CANDIDATES,
        slm_passes=1,
        specedge_passes=4,
        specedge_nodes=B,
    )
    host = SimpleNamespace(
        head=SimpleNamespace(sliding_window=W),
        slm=SimpleNamespace(
            layer_types=types, kv_layers=kv_layers, sliding_window=SLM_E2B["sliding_window"], per_layer_dim=ple, luts={}
        ),
    )
    return SimpleNamespace(
        round=rnd,
        host=host,
        keep_set=keep,
        keep_index=keep_index,
        head_embedding=(e_q, e_scale),
        head_rotary={SLIDING: rotary(HEAD_KV[SLIDING][1], 1e4), FULL: rotary(HEAD_KV[FULL][1], 1e6)},
        slm_rotary={SLIDING: rotary(dims[SLIDING][1], 1e4), FULL: rotary(dims[FULL][1], 1e6)},
        slm_luts=luts,
        embed_keep=lambda i: e_q[i % LUT_ROWS].astype(np.float32) * e_scale[i % LUT_ROWS, 0],
        stop_token_ids=lambda: {1, 106},
    )


def handoff(rng, t_prime: int, a: int) -> HandOff:
    """A synthetic reply's hand-off for positions [a, t_prime) (26B-A4B widths)."""
    n = t_prime - a
    kv = {kind: HEAD_KV[kind][0] * HEAD_KV[kind][1] for kind in HEAD_KV}

    def r8(*s):
        return rng.integers(-127, 128, s, dtype=np.int8)

    return HandOff(
        t_prime=t_prime,
        a=a,
        bonus=int(rng.integers(2, VOCAB)),
        x_hat=r8(2 * VERIFIER_HIDDEN),
        k_sliding=r8(n, kv[SLIDING]),
        v_sliding=r8(n, kv[SLIDING]),
        k_full=r8(n, kv[FULL]),
        v_full=r8(n, kv[FULL]),
        scales=(0.02, 0.05, 0.03, 0.03, 0.03, 0.03),
    )


# ---- the loop ---------------------------------------------------------------------------------------------------


def run(
    rounds: int,
    warmup: int,
    *,
    top_k_outputs: bool,
    seed: int = 0,
    clock: str = "cpu",
    io_binding: bool = False,
    shipped: bool = False,
    quantized_io: bool = False,
) -> dict:
    """Run ``warmup + rounds`` HyCo rounds; returns per-step host ms per round (module docstring). clock:
    ``cpu`` (this thread's CPU time: what one core spends, robust to other jobs on the machine) or ``wall``."""
    from hycoc.runtime.client import MODES, DeviceRuntime
    from hycoc.runtime.tree_builder import walk_reply

    tick = {"cpu": time.thread_time, "wall": time.perf_counter}[clock]
    timer = StepTimer(tick)
    instrument(timer)
    specs = graph_specs(top_k_outputs, shipped=shipped, quantized_io=quantized_io)
    bundle = standin_bundle()
    head = standin_runner("head", *specs["head"], timer, seed=1, io_binding=io_binding)
    slm = standin_runner("slm", *specs["slm"], timer, seed=2, io_binding=io_binding)
    rt = DeviceRuntime(bundle, head, slm)
    builder = rt.builder(MODES["hyco"], B + 1)
    rng = np.random.default_rng(seed)
    prompt = [int(x) for x in rng.integers(2, VOCAB, 1500)]  # longer than W: the rings start full
    rt.slm.start(prompt)
    rt.slm.prefill(reserve=K_CHAIN + D_SIB)
    rt.mtp.reset()
    t = len(prompt) - 1  # root position
    h = handoff(rng, t, t - W)  # the first reply: W positions before r
    per_round = []
    timer.enabled = False
    for r in range(warmup + rounds):
        if r == warmup:
            timer.enabled = True
            timer.reset()
        start = tick()
        ort_before = timer.seconds.get("ORT call", 0.0)
        rt.mtp.ingest(h)
        d = rt.mtp.draft()
        built = builder.build(rt.slm.tokens[-1], d.chain, d.runner_ups, rt.slm.expand)
        drafted = tick() - start
        # the synthetic verifier (not timed): accept `depth` nodes down the lowest rows, then a bonus
        depth = int(rng.integers(0, 6))  # the verifier accepts `depth` nodes of a path
        samples = np.asarray(built.tokens, np.int64).copy()
        v, path = 0, []
        for _ in range(depth):
            kids = [j for j in range(1, len(built.row_node)) if built.parents[j] == v and j not in path]
            if not kids:
                break
            samples[v] = built.tokens[kids[0]]
            v = kids[0]
            path.append(v)
        bonus = int(bundle.keep_set[int(rng.integers(0, KEEP))])
        samples[v] = bonus
        start = tick()
        rows = walk_reply(built.tokens, built.parents, samples)
        new = [int(built.tokens[j]) for j in rows] + [bonus]
        rt.slm.commit([built.row_node[j] for j in rows], new)
        if timer.enabled:
            per_round.append(drafted + tick() - start - (timer.seconds.get("ORT call", 0.0) - ort_before))
        t_prime = t + len(new)
        h = handoff(rng, t_prime, t)  # positions [t, t'): the committed tokens' KV
        t = t_prime
    steps = {s: 1000 * timer.seconds.get(s, 0.0) / rounds for s in STEPS}
    ort_ms = 1000 * timer.seconds.get("ORT call", 0.0) / rounds
    host = 1000 * float(np.mean(per_round))
    io_mb = {k: round(v / rounds / 1e6, 3) for k, v in sorted(timer.bytes.items())} if not io_binding else {}
    return {
        "top_k_outputs": top_k_outputs,
        "io_binding": io_binding,
        "shipped": shipped,
        "quantized_io": quantized_io,
        "clock": clock,
        "rounds": rounds,
        "graph_io_mb_per_round": io_mb,
        "steps_ms": {k: round(v, 3) for k, v in steps.items()},
        "other_ms": round(host - sum(steps.values()), 3),
        "host_ms_per_round": round(host, 3),
        "host_ms_p90": round(1000 * float(np.percentile(per_round, 90)), 3),
        "ort_call_ms_per_round": round(ort_ms, 3),
        "graph_calls_per_round": K_CHAIN + 1,
    }


def table(results: list[dict]) -> str:
    heads = [
        ("graph top-k" if r["top_k_outputs"] else "host top-k (logits out)")
        + (" + IOBinding" if r["io_binding"] else "")
        + (", no logits out" if r.get("shipped") else "")
        + (", uint16 KV IO" if r.get("quantized_io") else "")
        for r in results
    ]
    lines = ["| step (host ms per round) | " + " | ".join(heads) + " |", "|---|" + "---|" * len(results)]
    for s in STEPS:
        lines.append(f"| {s} | " + " | ".join(f"{r['steps_ms'][s]:.2f}" for r in results) + " |")
    lines.append("| other (round loop glue) | " + " | ".join(f"{r['other_ms']:.2f}" for r in results) + " |")
    lines.append("| **host total** | " + " | ".join(f"**{r['host_ms_per_round']:.2f}**" for r in results) + " |")
    lines.append("| host p90 | " + " | ".join(f"{r['host_ms_p90']:.2f}" for r in results) + " |")
    lines.append(
        "| ORT call of the stand-ins (not counted) | "
        + " | ".join(f"{r['ort_call_ms_per_round']:.2f}" for r in results)
        + " |"
    )
    for kind in ("in float32", "in integer", "out float32", "out integer", "out written (all outputs)"):
        lines.append(
            f"| graph IO MB per round, {kind} | "
            + " | ".join(
                f"{r['graph_io_mb_per_round'].get(kind, 0.0):.2f}" if r["graph_io_mb_per_round"] else "(bound)"
                for r in results
            )
            + " |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=60, help="timed HyCo rounds (default 60)")
    ap.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    ap.add_argument(
        "--variant",
        choices=("all", "host-topk", "graph-topk", "graph-topk-iobinding", "shipped", "shipped-quantized-io", "io"),
        default="all",
        help="host-topk: graphs emit logits only (the host takes the top-k); graph-topk: the graphs "
        "emit their top-k too and the runtime reads those; graph-topk-iobinding: and the graphs "
        "run through IOBindings (rings bound once, preallocated outputs); shipped: graph top-k "
        "and no logits output (the bundles' graphs); shipped-quantized-io: and uint16 KV IO "
        "([target] quantized_io); io: graph-topk, shipped and shipped-quantized-io",
    )
    ap.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="cpu: this thread's CPU time (default; other jobs on the machine do not inflate it); wall: elapsed time",
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    variants = {
        "all": ((False, False, False, False), (True, False, False, False), (True, True, False, False)),
        "host-topk": ((False, False, False, False),),
        "graph-topk": ((True, False, False, False),),
        "graph-topk-iobinding": ((True, True, False, False),),
        "shipped": ((True, False, True, False),),
        "shipped-quantized-io": ((True, False, True, True),),
        "io": ((True, False, False, False), (True, False, True, False), (True, False, True, True)),
    }[args.variant]
    results = [
        run(args.rounds, args.warmup, top_k_outputs=v, io_binding=b, clock=args.clock, shipped=sh, quantized_io=q)
        for v, b, sh, q in variants
    ]
    print(f"load average {open('/proc/loadavg').read().split()[0]}")
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(results, indent=1), encoding="utf-8")
        tmp.replace(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
