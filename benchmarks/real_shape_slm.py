"""The E2B SLM Drafter at real shape through every pass of the compiler, random weights (docs/real-shapes.md "The E2B
SLM at real shape").

    python benchmarks/real_shape_slm.py                                  # E2B: 35 layers, |V| 86,089, B 32, W 1,024
    python benchmarks/real_shape_slm.py --layers 5 --out runs/real-shape-slm-5.json     # real widths, 5 layers
    python benchmarks/real_shape_slm.py --skip-compile --max-qdq-gib 11

Steps, each timed, with its peak memory and the bytes it wrote (the head's equivalent is
`benchmarks/real_shape_head.py`; both measure through `hycoc.bench.real_shape.harness`):

1. ``checkpoint``: random integer weights written straight into transformers' pre-quantized Gemma format
   (``quant_method: gemma``: packed int2/int4/int8 + per-channel float32 ``weight_scale``, embeddings as
   ``embedding_quantized`` + per-row ``embedding_scale``; `hycoc.toy.gemma_format.pack`) at the bit map of
   ``--bit-map`` (`hycoc.passes.bit_map`: ``assumed`` = E2B_ASSUMED, ``paper-fit`` = e2b_paper_fit). The model is
   never materialized in float (5.1 G parameters would be 20 GB): the module names and shapes come from
   ``Gemma4ForCausalLM`` on torch's meta device, each tensor is drawn, packed and written per safetensors shard
   (about 1 GB each, with transformers' ``model.safetensors.index.json``). Integers are uniform in the width's
   range, scales sqrt(3) / (qmax sqrt(in)) so each weight has RMS 1/sqrt(in). Shapes: ``hycoc.passes.plan.SLM_E2B``
   with the output layer untied (the keep-set rows are cut from it, App. A); ``--layers N`` keeps the first N
   layers of the E2B pattern (KV sharing scaled: the last 20/35 of them share).
2. ``surgery``: `hycoc.passes.slm.surgery.operate` (transformers loads the checkpoint; every weight becomes an
   `IntegerWeight` checked bit-exact against transformers' own dequantization; the embedding tables become host
   LUTs). Details: bytes per width, LUT bytes.
3. ``host_luts``: the per-layer-embedding and token LUTs stay on the host: looked up for 32 rows, and (after
   export) no Gather on a constant table in the device graph (`hycoc.targets.htp_checks.find_host_only_nodes`).
4. ``graph``: `hycoc.passes.slm.graph.SlmTreeGraph` with B = 32 rows, rings 1,024 (full) / 512 (sliding) and a
   SYNTHETIC keep set of ``--keep-set`` sorted ids (uniform, fixed seed): the output layer keeps those rows only.
5. ``export``: `export_slm_graph` (torch.onnx dynamo, RMSNorms decomposed, external data, checker, onnxruntime CPU
   vs torch on one input). Graph bytes on disk; whether the external data file is over 2 GB (protobuf's limit).
6. ``qdq``: `hycoc.passes.qdq.quantize.quantize_graph` (bit-exact integer weights, A16 activations at the recipe's
   ``slm_calibration`` percentile x range scale on ``--samples`` synthetic inputs, fixed encodings, SQNR on the
   CPU EP). Refused up front, with the estimate in the message, when its estimated peak (the float fold of every
   weight, about 3 x 4 bytes per weight, + the model) exceeds ``--max-qdq-gib``.
7. ``budget_refusal``: the compile with the context limit lowered to one byte below the graph's weight bytes must
   be refused BEFORE compiling (``ContextTooLargeError`` naming the size, no files written).
8. ``compile`` / ``sim``: `hycoc.targets.htp.compile_context` for htp-v81 with CPU fallback disabled; one run on
   the HTP simulator against the same QDQ graph on the CPU EP (SQNR of logits and the new KV).

Memory: ``peak_rss_gib`` (VmHWM, reset per step) and ``peak_tree_rss_gib`` (this process + children, sampled with
psutil); ``cpu_seconds``: CPU time of the step (this process + its children, psutil), the figure to quote on a loaded
machine (`hycoc.bench.real_shape.harness.Steps`).
``--toy-dims`` (tests only): the same chain at toy widths; the report says ``"real_shapes": false``.
Prints a table and writes JSON to ``--out`` (default runs/real-shape-slm.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from hycoc.bench.real_shape.harness import (
    Steps,
    add_run_options,
    check_parser,
    cpu_run,
    du,
    initializer_bits,
    onnx_files,
    report_end,
    run_and_report,
    sqnr_rounded,
    step_cells,
    synthetic_keep_set,
)
from hycoc.bench.real_shape.random_checkpoint import slm_config, write_random_checkpoint
from hycoc.bench.real_shape.shards import (
    TWO_GB,
    compile_slm,
    qdq_peak_estimate_gib,
    refused_row,
    run_sharded,
    top1_agreement,
)
from hycoc.doctor import package_versions

REPO = Path(__file__).resolve().parents[1]

# ---- the check -------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring)."""
    p = check_parser(__doc__)
    p.add_argument("--layers", type=int, default=None, help="first N layers of E2B (default all 35)")
    p.add_argument("--keep-set", type=int, default=86_089, help="keep-set size (default 86,089)")
    p.add_argument("--rows", type=int, default=32, help="tree rows B (default 32)")
    p.add_argument("--ring", type=int, default=1024, help="full-attention ring W (default 1,024)")
    p.add_argument("--sliding-ring", type=int, default=512, help="sliding-layer ring (default 512)")
    p.add_argument(
        "--bit-map",
        choices=("assumed", "paper-fit"),
        default="assumed",
        help="hycoc.passes.bit_map map for the random checkpoint (default assumed)",
    )
    p.add_argument("--samples", type=int, default=4, help="calibration inputs (default 4)")
    p.add_argument(
        "--max-qdq-gib",
        type=float,
        default=11.0,
        help="refuse the QDQ step when its estimated peak exceeds this (default 11 GiB)",
    )
    p.add_argument(
        "--shards",
        default="1",
        help="layer shards: 1 = the monolithic graph (default), N, or auto (fewest that fit the "
        "profile's context budget); each shard is exported, quantized, compiled and simulated "
        "on its own and the chain's end-to-end SQNR reported",
    )
    p.add_argument(
        "--bounds", default=None, help="shard bounds instead of the plan's, e.g. 0,4,6 (shard k = layers [b_k, b_k+1))"
    )
    p.add_argument("--skip-compile", action="store_true", help="stop after QDQ and the budget refusal")
    p.add_argument("--compile-timeout", type=float, default=2400.0, help="seconds for the HTP compile")
    p.add_argument("--seed", type=int, default=0)
    add_run_options(p, REPO / "runs" / "real-shape-slm.json", "toy widths")
    return p.parse_args(argv)


@dataclasses.dataclass
class Check:
    """One run of the check: arguments, the recipe's calibration section, target profile, config, the step recorder,
    the work folder, and ``state`` (what a step hands the next: slm, graph, keep, example, feed, bounds)."""

    args: argparse.Namespace
    steps: Steps
    work: Path
    cfg: dict[str, Any]
    qcfg: dict[str, Any]
    cal: Any  # the recipe's [slm_calibration] section
    profile: Any  # hycoc.targets.profiles.TargetProfile
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def vocab(self) -> int:
        return int(self.cfg["vocab_size"])

    @property
    def keep_n(self) -> int:
        return min(self.args.keep_set, self.vocab)

    @property
    def export_path(self) -> Path:
        return self.work / "export" / "slm.onnx"

    def say(self, text: str) -> None:
        """A progress line (none with ``--quiet``)."""
        if not self.args.quiet:
            from hycoc import progress

            progress.plain_line(text)


def start(args: argparse.Namespace) -> Check:
    """The run's `Check`: work folder, recipe, profile, the (cut) E2B config and its bit map."""
    from hycoc.passes import bit_map
    from hycoc.targets.profiles import get_profile
    from rich.console import Console

    from hycoc.recipe import load_recipe

    if args.work:
        work = Path(args.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="hycoc-real-shape-slm-"))
    recipe = load_recipe(REPO / "recipes" / "gemma4.toml")
    qcfg = bit_map.E2B_ASSUMED if args.bit_map == "assumed" else bit_map.e2b_paper_fit()
    steps = Steps(None if args.quiet else Console(stderr=True))
    cfg = slm_config(args.layers, args.toy_dims)
    return Check(args, steps, work, cfg, qcfg, recipe.slm_calibration, get_profile("htp-v81"))


# ---- the steps: each returns (result, output bytes, details) for `Steps.run` --------------------------------------


def checkpoint(c: Check):
    """1. Random integers in transformers' pre-quantized Gemma format."""
    info = write_random_checkpoint(c.cfg, c.qcfg, c.work / "checkpoint", seed=c.args.seed)
    return True, info["bytes"], info


def surgery(c: Check):
    """2. `slm.surgery.operate`: integer weights checked bit-exact, embeddings to host LUTs."""
    from hycoc.passes.slm.surgery import operate

    slm, numbers = operate(c.work / "checkpoint")
    c.state["slm"] = slm
    return slm, numbers["after_bytes"], numbers


def host_luts(c: Check):
    """3. The token and per-layer embedding LUTs looked up on the host for B rows."""
    tokens = np.random.default_rng(c.args.seed).integers(0, c.vocab, c.args.rows)
    out = {}
    for name, lut in c.state["slm"].luts.items():
        t0 = time.perf_counter()
        rows = lut.lookup(tokens)
        out[name] = {
            "rows": int(lut.packed.shape[0]),
            "cols": int(lut.dim),
            "bits": int(lut.bits),
            "bytes": int(lut.packed.nbytes + lut.scale.nbytes),
            "lookup_shape": list(rows.shape),
            "lookup_ms": round(1000 * (time.perf_counter() - t0), 3),
        }
    return True, 0, {"luts": out, "total_bytes": sum(v["bytes"] for v in out.values())}


def tree_graph(c: Check):
    """4. `SlmTreeGraph` with B rows over the rings and the keep-set output layer."""
    from hycoc.passes.slm.graph import FULL, SLIDING, SlmTreeGraph, example_inputs

    a, slm = c.args, c.state["slm"]
    keep = synthetic_keep_set(c.keep_n, c.vocab, a.seed)
    graph = SlmTreeGraph(slm, keep, rows=a.rows, ring={FULL: a.ring, SLIDING: a.sliding_ring})
    c.state["graph"], c.state["keep"] = graph, keep
    c.state["example"] = example_inputs(graph, slm, a.seed)
    # the full-vocabulary output layer is not needed past here (the graph holds its keep-set rows): 0.4 GB
    head = slm.weights.pop("lm_head")
    details = {
        "rows": graph.rows,
        "ring": graph.ring,
        "kv_layers": graph.kv_layers,
        "keep_set": len(keep),
        "output_layer_rows_before": int(head.q.shape[0]),
        "output_layer_rows_after": int(graph.lm_head.q.shape[0]),
        "inputs": {n: list(s) for n, s in graph.input_shapes.items()},
    }
    return graph, 0, details


def export(c: Check):
    """5. `export_slm_graph`, then the host-only nodes left in the device graph."""
    import onnx
    from hycoc.passes.slm.graph import export_slm_graph
    from hycoc.targets.htp import find_host_only_nodes

    _, rep = export_slm_graph(c.state["graph"], c.state["example"], c.export_path)
    m = onnx.load(str(c.export_path), load_external_data=False)
    host = find_host_only_nodes(m, c.profile)
    d = rep.numbers()
    d.update(
        model_bytes=rep.model_bytes,
        data_bytes=rep.data_bytes,
        over_2gb=rep.data_bytes > TWO_GB,
        host_only_nodes=[str(n) for n in host],
        initializer_bits=initializer_bits(c.export_path),
    )
    return True, du(*onnx_files(c.export_path)), d


def qdq(c: Check, estimate: float):
    """6. `quantize_graph` on the whole graph (bit-exact integer weights, A16 on synthetic samples), checker."""
    import onnx
    from hycoc.passes.qdq.quantize import quantize_graph, slm_calibration_samples

    graph, slm, cal = c.state["graph"], c.state["slm"], c.cal
    samples = slm_calibration_samples(graph, slm, c.args.samples, c.args.seed)
    res = quantize_graph(c.export_path, samples, c.work / "qdq", percentile=cal.percentile, range_scale=cal.range_scale)
    onnx.checker.check_model(str(res.path), full_check=True)
    d = res.numbers()
    d.pop("io_encodings", None)
    data_bytes = du(*onnx_files(res.path))
    d.update(
        checker="ok",
        estimate_gib=round(estimate, 2),
        initializer_bits=initializer_bits(res.path),
        data_bytes=data_bytes,
        over_2gb=data_bytes > TWO_GB,
    )
    c.state["feed"] = samples[0]
    return res, du(c.work / "qdq"), d


def budget_refusal(c: Check, qdq_path: Path):
    """7. The compile with the context limit one byte below the weights must be refused before compiling."""
    from hycoc.targets.htp import ContextTooLargeError, compile_context, plan_context_size

    plan = plan_context_size([qdq_path], c.profile)
    small = c.profile.with_limit(plan.weight_bytes - 1)
    out = c.work / "refused"
    t0 = time.perf_counter()
    try:
        compile_context(qdq_path, out, small, graph_name="slm")
    except ContextTooLargeError as e:
        written = sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []
        details = {
            "refused": True,
            "message": str(e)[:600],
            "seconds_to_refuse": round(time.perf_counter() - t0, 3),
            "weight_bytes": plan.weight_bytes,
            "limit_bytes": small.max_context_bytes,
            "files_written": written,
            "fits_real_limit": plan.weight_bytes <= c.profile.max_context_bytes,
            "real_limit_bytes": c.profile.max_context_bytes,
        }
        return True, 0, details
    raise AssertionError("a context over the lowered limit was not refused")


def compile_step(c: Check, qdq_path: Path):
    """8. The whole graph's context binary."""
    cg = compile_slm(c, qdq_path, "slm")
    details = {
        "profile": c.profile.name,
        "htp_arch": cg.htp_arch,
        "soc_type": cg.soc_type,
        "qnn_sdk": cg.qnn_sdk,
        "binary_bytes": cg.binary_bytes,
        "weight_bytes": cg.weight_bytes,
        "compile_seconds": round(cg.compile_seconds, 2),
        "cpu_fallback": "disabled",
    }
    return cg, cg.binary_bytes + cg.ctx_model.stat().st_size, details


def simulate(c: Check, cg, qdq_path: Path):
    """8. One input on the HTP simulator against the same QDQ graph on the CPU EP (SQNR per output, top-1)."""
    from hycoc.targets.htp import HtpSession

    feed = c.state["feed"]
    t0 = time.perf_counter()
    sess = HtpSession(cg.ctx_model, c.profile)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    got = sess.run(feed)
    run_s = time.perf_counter() - t1
    cpu = cpu_run(qdq_path, feed)
    out = {"load_seconds": round(load_s, 2), "run_seconds": round(run_s, 2)}
    for name in cpu:
        out[f"sqnr_htp_vs_cpu_qdq_db.{name}"] = sqnr_rounded(cpu[name], got[name])
    out["top1_htp_eq_cpu_qdq"] = top1_agreement(got["logits"], cpu["logits"])
    return True, 0, out


def run_chain(c: Check) -> None:
    """Steps 1-8 in order (``--shards``: steps 4-8 per shard, `run_sharded`); each runs only when what it needs
    succeeded."""
    a, steps = c.args, c.steps
    c.say(f"checkpoint: {c.cfg['num_hidden_layers']} layers, hidden {c.cfg['hidden_size']}, bit map {a.bit_map}")
    what = "random integers in transformers' pre-quantized Gemma format"
    if steps.run("checkpoint", lambda: checkpoint(c), what=what) is None:
        return
    c.say("surgery: transformers loads the checkpoint, integers checked bit-exact")
    what = "slm.surgery.operate: bit-exact integer weights, host LUTs"
    slm = steps.run("surgery", lambda: surgery(c), what=what)
    if slm is None:
        return
    what = "token + per-layer embedding LUTs looked up on the host (32 rows)"
    steps.run("host_luts", lambda: host_luts(c), what=what)
    if a.shards != "1" or a.bounds:
        run_sharded(c)
        return
    what = "SlmTreeGraph: B rows over the ring, keep-set output layer"
    graph = steps.run("graph", lambda: tree_graph(c), what=what)
    if graph is None:
        return
    c.say("export: torch.onnx dynamo, RMSNorm decomposition, checker, CPU EP vs torch")
    if steps.run("export", lambda: export(c), what="export_slm_graph (external data, checker, ORT vs torch)") is None:
        return
    linear_values = sum(int(m.q.numel()) for m in graph.modules() if hasattr(m, "q") and hasattr(m, "bits"))
    estimate = qdq_peak_estimate_gib(linear_values, sum(int(v.packed.nbytes) for v in slm.luts.values()))
    if estimate > a.max_qdq_gib:
        note = (
            f" ({linear_values:,} graph weights folded to float32): run it where {estimate * 1.25:.0f} GiB are "
            "free, or shard the graph by layers"
        )
        details = {"estimate_gib": round(estimate, 2), "linear_values": linear_values}
        steps.rows.append(refused_row("qdq", estimate, a.max_qdq_gib, note, details))
        c.say(f"qdq refused: estimated {estimate:.1f} GiB > {a.max_qdq_gib} GiB")
        return
    c.say("qdq: fold integer weights, calibrate A16, quantize, verify bit-exact weights, SQNR")
    what = "quantize_graph: bit-exact integer weights, A16, SQNR on the CPU EP"
    qres = steps.run("qdq", lambda: qdq(c, estimate), what=what)
    if qres is None:
        return
    what = "limit lowered below the weights: refused before compiling"
    steps.run("budget_refusal", lambda: budget_refusal(c, qres.path), what=what)
    if a.skip_compile:
        return
    c.say("compile: htp-v81 context binary, CPU fallback disabled")
    what = f"compile_context {c.profile.name}, CPU fallback disabled"
    cg = steps.run("compile", lambda: compile_step(c, qres.path), what=what)
    if cg is not None:
        what = "HTP simulator vs the QDQ graph on the CPU EP (one input)"
        steps.run("sim", lambda: simulate(c, cg, qres.path), what=what)


def main(argv=None) -> dict[str, Any]:
    """Run the check; returns the report (also written to ``--out``)."""
    args = parse_args(argv)
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t_all = time.perf_counter()
    c = start(args)

    def release() -> None:
        c.state.clear()
        gc.collect()

    return run_and_report(
        args,
        c.work,
        lambda: run_chain(c),
        lambda: report_of(c, started, time.perf_counter() - t_all),
        print_table,
        release,
    )


def report_of(c: Check, started: str, total_s: float) -> dict[str, Any]:
    """The JSON report (module docstring)."""
    import torch

    args, cfg = c.args, c.cfg
    return {
        "what": "real-shape E2B SLM build check: random integer weights, synthetic keep set and calibration",
        "started": started,
        "total_seconds": round(total_s, 1),
        "args": dict(vars(args)),
        "shapes": {
            "real_shapes": not args.toy_dims,
            "layers": cfg["num_hidden_layers"],
            "kv_shared_layers": cfg["num_kv_shared_layers"],
            "hidden": cfg["hidden_size"],
            "intermediate": cfg["intermediate_size"],
            "vocab": cfg["vocab_size"],
            "per_layer_input": cfg["hidden_size_per_layer_input"],
            "keep_set": args.keep_set,
            "rows": args.rows,
            "ring": args.ring,
            "sliding_ring": args.sliding_ring,
            "bit_map": args.bit_map,
        },
        "assumptions": [
            "E2B text config from hycoc.passes.plan.SLM_E2B with the output layer untied (keep-set rows cut from it)",
            f"bit map {args.bit_map} (hycoc/passes/bit_map.py); the QAT checkpoint's own map is not here",
            "random integers: timing, memory and sizes are the real shapes', numerics are not",
            "keep set synthetic (sorted uniform ids); calibration synthetic (random trees, tokens, rings)",
            "graph without the TopK outputs the bundle's SLM graph adds (passes/topk_outputs.py)",
        ],
        **report_end(c.steps, package_versions(), torch_threads=torch.get_num_threads()),
    }


def print_table(report: dict) -> None:
    """The summary table (one row per step) on stdout."""
    from rich.console import Console
    from rich.table import Table

    s = report["shapes"]
    table = Table(
        title=f"real-shape E2B SLM: {s['layers']} layers, |V| {s['keep_set']:,}, B {s['rows']}, "
        f"W {s['ring']:,}/{s['sliding_ring']}, map {s['bit_map']} -- {report['total_seconds']:.0f} s"
    )
    for col in ("step", "status", "seconds", "CPU s", "peak RSS GiB", "tree peak GiB", "output", "notes"):
        table.add_column(col, justify="left" if col in ("step", "status", "notes") else "right")
    for r in report["steps"]:
        d = r.get("details") or {}
        note = ""
        base = r["step"].split(".")[0]
        if base == "checkpoint":
            note = ", ".join(
                f"int{b}: {v['modules']} x, {v['bytes'] / 1e6:.1f} MB" for b, v in d.get("by_bits", {}).items()
            )
        elif base == "surgery":
            note = f"NPU weights {d.get('npu_weight_bytes', 0) / 1e6:.1f} MB; LUTs " + ", ".join(
                f"{k} {v / 1e6:.1f} MB" for k, v in (d.get("luts") or {}).items()
            )
        elif base == "graph" and "layers" in d:  # a shard
            note = (
                f"layers {d['layers']}, {d.get('linear_values', 0) / 1e6:.0f} M weights, reads producers "
                f"{d.get('borrowed_producers')} of earlier shards"
            )
        elif base == "graph":
            note = f"output layer {d.get('output_layer_rows_before')} -> {d.get('output_layer_rows_after')} rows"
        elif base == "export":
            note = (
                f"{d.get('data_bytes', 0) / 1e6:.1f} MB data, >2GB {d.get('over_2gb')}, host-only nodes "
                f"{len(d.get('host_only_nodes', []))}, top-1 {d.get('top1_agreement')}"
            )
        elif base == "qdq":
            sq = (d.get("sqnr") or {}).get("outputs", {})
            first = "logits" if "logits" in sq else next((k for k in sq if k.startswith("hidden_")), "logits")
            note = (
                f"bits {d.get('weight_bits')}; SQNR {first} {sq.get(first, float('nan')):.1f} dB"
                if r.get("status") == "ok"
                else r.get("what", "")
            )
        elif base == "budget_refusal":
            note = (d.get("message") or "")[:120]
        elif base == "compile":
            note = f"bin {d.get('binary_bytes', 0) / 1e6:.1f} MB, {d.get('soc_type')} v{d.get('htp_arch')}"
        elif base == "sim":
            note = ", ".join(f"{k.split('.')[-1]} {v}" for k, v in d.items() if "logits" in k or "top1" in k)
        elif base == "shard_plan":
            note = f"bounds {d.get('bounds')}, est. bytes {d.get('estimated_shard_bytes')}"
        elif base == "chain":
            note = (
                ", ".join(
                    f"{k.split('_db.')[0].replace('sqnr_', '')} {v}" for k, v in d.items() if k.endswith(".logits")
                )
                + f", top-1 {d.get('top1_htp_chain_eq_cpu_qdq_chain')}"
            )
        table.add_row(*step_cells(r, note, cpu=True))
    Console(width=180).print(table)


if __name__ == "__main__":
    rep = main()
    sys.exit(1 if rep["failed"] else 0)
