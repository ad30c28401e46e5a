"""A real-shape build check of the MTP head that fits this machine (docs/compiler.md, docs/real-shapes.md).

    python benchmarks/real_shape_head.py                           # full size: |V| 86,089, W 1,024, 4 layers
    python benchmarks/real_shape_head.py --keep-set 4096 --window 128 --layers 2
    python benchmarks/real_shape_head.py --skip-compile --out runs/real-shape-head.json

Builds the Gemma 4 26B-A4B assistant (MTP) head at its REAL shapes with RANDOM weights and sends it through the
project's own head passes, timing each step and measuring its peak memory:

1. ``build_head``: ``Gemma4AssistantForCausalLM`` from the ASSUMED head config of `hycoc.passes.plan`
   (``HEAD_ASSUMED``: 4 KV-shared layers, 3 sliding + 1 full, hidden 1,024, MLP 8,192, 16 query heads over the
   verifier's 8 x 256 sliding and 2 x 512 full KV, vocab 262,144, backbone hidden 2,816 -> x_hat 5,632), random
   init (transformers' own initializer). ``--layers N`` keeps N layers: the first N - 1 of that pattern and the
   full-attention last one (transformers' Gemma 4 config forces the last layer to full attention anyway).
2. ``keep_set_restrict``: a SYNTHETIC keep set -- N sorted distinct ids drawn uniformly from [0, 262,144) with a
   fixed seed; no corpus is read (the real one counts 20,000 UltraChat conversations, `hycoc.passes.keep_set`).
   Its size is what matters for the shapes. `hycoc.passes.head.quantize.restrict_output_layer` unties the output layer.
3. ``w4_clip_search``: every drafting Linear W4 per-channel symmetric with the per-channel MSE clip search
   (`quantize_head` -> `search_clip`, the recipe's 9 ratios 1.0 .. 0.6), then `export_head` (integers + scales)
   and `dequantized_head` (the float model the graph is exported from, exactly as `HeadExport` does). The QAT
   TRAINING steps are skipped: with random weights there is no teacher worth distilling, and a step's cost is a
   GPU matter (Table 4: bf16 autocast on CUDA); the integers written are the PTQ ones.
4. ``export``: `hycoc.passes.head.graph.HeadGraph` (one query over the W-column ring, additive masks, rotary rows
   as inputs) through `hycoc.passes.export.export_static` (torch.onnx dynamo exporter, RMSNorms decomposed,
   external data, ONNX checker), then `compare_with_torch` on one query (onnxruntime CPU EP vs torch).
5. ``qdq``: `hycoc.passes.qdq.quantize.quantize_graph` with the QAT integers as bit-exact int4 weights
   (`hycoc.passes.head.export.head_weight_arrays`, as `HeadQdq` does), A16 activations at the head's 99.99th
   percentile ranges, fixed mask/rotary encodings. Calibration inputs are SYNTHETIC but plausible (no verifier):
   x_hat = [e; h] with e ~ N(0, 1) and h ~ N(0, 2) plus a few large outlier channels (Gemma's residual stream),
   keys/values ~ N(0, 1) (k_norm/v_norm outputs), ring masks from `hycoc.host.ring_masks` for ring fills from a
   quarter ring to a full wrapped ring, rotary rows from `rotary_rows` at t - 1. Then the ONNX checker on the QDQ
   file, its size on disk and its weight bit map.
6. ``block_<kind>_*``: one real-shape attention block per layer kind -- pre-projection + the head's first layer
   of that kind (sliding: 16 x 256 queries over the 8 x 256 ring; full: 16 x 512 over the 2 x 512 ring), each
   reading the W-column ring with its mask -- exported, QDQ'd the same way (its own integers), compiled with
   `hycoc.targets.htp.compile_context` for htp-v81 with CPU fallback disabled, and run once on the HTP simulator
   against the same QDQ graph on the CPU EP (SQNR) and against the float graph.
7. ``full_compile`` / ``full_sim``: the whole QDQ head graph compiled the same way (``--full-compile-timeout``)
   and, when that worked, run once on the simulator against the CPU EP.

Memory and CPU (`hycoc.bench.real_shape.harness.Steps`): each step's ``peak_rss_gib`` is this process's own high-water
mark (VmHWM, reset before the step through ``/proc/self/clear_refs``); ``peak_tree_rss_gib`` samples this process plus
its children (the QNN compile runs in a child process) every 0.2 s with psutil; ``cpu_seconds`` is the CPU time of this
process and its children over the step, the figure to quote on a loaded machine. ``output_bytes`` is what the step
wrote to disk (or holds, for in-memory steps).

``--toy-dims`` (tests only) runs the same chain at toy widths; the report says ``"real_shapes": false``.

Prints a table and writes the same as JSON to ``--out`` (default runs/real-shape-head.json); work files go to
``--work`` (default: a temporary folder, removed at the end unless ``--keep-work``).
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
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
    compiled_details,
    cpu_run,
    du,
    htp_simulate,
    human_bytes,
    initializer_bits,
    onnx_files,
    qnn_worker_timeout,
    report_end,
    run_and_report,
    sqnr_rounded,
    step_cells,
    synthetic_keep_set,
)
from hycoc.bench.real_shape.head_shapes import (
    BLOCK_INPUTS,
    attention_block_class,
    block_feeds,
    head_config,
    report_shapes,
    sub_head,
    synthetic_feeds,
)
from hycoc.doctor import package_versions

REPO = Path(__file__).resolve().parents[1]


# ---- the check ---------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring)."""
    p = check_parser(__doc__)
    p.add_argument("--keep-set", type=int, default=86_089, help="keep-set size |V| (default 86,089)")
    p.add_argument("--window", type=int, default=1024, help="ring columns W (default 1,024)")
    p.add_argument(
        "--layers",
        type=int,
        default=None,
        help="N layers of the assumed head: N - 1 sliding + the full one (default all 4)",
    )
    p.add_argument("--skip-compile", action="store_true", help="stop after the QDQ step (no HTP compile)")
    p.add_argument(
        "--blocks",
        default="sliding,full",
        help="attention blocks to export, QDQ and compile: comma list of sliding, full, or none (default both)",
    )
    p.add_argument("--no-full-compile", action="store_true", help="compile only the attention block(s)")
    p.add_argument(
        "--full-compile-timeout",
        type=float,
        default=1800.0,
        help="seconds for the whole head graph's HTP compile (default 1800)",
    )
    p.add_argument("--no-full-sim", action="store_true", help="skip running the compiled whole head graph")
    p.add_argument("--samples", type=int, default=4, help="calibration inputs (default 4)")
    p.add_argument(
        "--recipe",
        default=str(REPO / "recipes" / "gemma4.toml"),
        help="recipe whose [head_qat] gives bits, clip search and percentile",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    add_run_options(p, REPO / "runs" / "real-shape-head.json", "the same chain at toy widths (hidden 64, vocab 4,096)")
    return p.parse_args(argv)


@dataclasses.dataclass
class Check:
    """One run of the check: its arguments and recipe numbers, the step recorder, the work folder, and what each
    step hands the next (None until the step that makes it succeeded; dropped once no later step needs it)."""

    args: argparse.Namespace
    steps: Steps
    work: Path
    qat: Any  # the recipe's [head_qat] section
    percentile: float
    blocks: list[str]
    text: dict | None = None  # the head's text config as a dict (build_head)
    head: Any = None
    keep: np.ndarray | None = None
    restricted: Any = None
    qhead: Any = None
    rebuilt: Any = None
    graph: Any = None
    feeds: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    qres: Any = None

    @property
    def float_path(self) -> Path:
        return self.work / "float" / "head.onnx"


def start(args: argparse.Namespace, console) -> Check:
    """The run's `Check`: recipe read, ``--blocks`` checked, work folder made (emptied when given)."""
    from hycoc.recipe import load_recipe

    qat = load_recipe(args.recipe).head_qat
    blocks = [b.strip() for b in args.blocks.split(",") if b.strip() and b.strip() != "none"]
    bad = [b for b in blocks if b not in ("sliding", "full")]
    if bad:
        raise SystemExit(f"--blocks: unknown kind(s) {bad} (sliding, full)")
    if args.work:
        work = Path(args.work)
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
    else:
        work = Path(tempfile.mkdtemp(prefix="hycoc-real-shape-head-"))
    return Check(args, Steps(console), work, qat, float(qat.input_range_percentile), blocks)


# ---- the steps: each returns (result, output bytes, details) for `Steps.run` --------------------------------------


def build_head(c: Check):
    """1. The head at real shapes, random weights."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    torch.manual_seed(c.args.seed)
    config, c.text = head_config(c.args.layers, c.args.toy_dims)
    config._attn_implementation = "eager"
    head = Gemma4AssistantForCausalLM(config).float().eval()
    head.requires_grad_(False)
    n = sum(p.numel() for p in head.parameters())
    text = config.get_text_config()
    details = {
        "params": n,
        "layers": int(text.num_hidden_layers),
        "layer_types": list(text.layer_types),
        "hidden": int(text.hidden_size),
        "intermediate": int(text.intermediate_size),
        "backbone_hidden": int(config.backbone_hidden_size),
        "vocab": int(text.vocab_size),
        "config": "ASSUMED (hycoc.passes.plan.HEAD_ASSUMED), random weights",
    }
    return head, 4 * n, details


def restrict(c: Check):
    """2. Keep set + the untied output layer restricted to it."""
    from hycoc.passes.head.quantize import restrict_output_layer

    keep = synthetic_keep_set(c.args.keep_set, int(c.head.config.get_text_config().vocab_size), c.args.seed)
    restricted = restrict_output_layer(c.head, keep)
    restricted.requires_grad_(False)
    w = restricted.lm_head.weight
    details = {"keep_set": int(len(keep)), "source": "synthetic: sorted uniform sample of ids, no corpus"}
    return (keep, restricted), keep.nbytes + w.numel() * 4, {**details, "lm_head": list(w.shape)}


def quantize(c: Check):
    """3. W4 per-channel symmetric with the clip search (no QAT training: random weights)."""
    import torch
    from hycoc.passes.head.quantize import clip_ratios, dequantized_head, export_head, quantize_head

    ratios = clip_ratios(c.qat)
    student, chosen = quantize_head(c.restricted, c.qat.weight_bits, ratios)
    qhead = export_head(student, c.keep, {})
    del student
    rebuilt = dequantized_head(qhead)
    ratio_all = torch.cat(list(chosen.values()))
    weights = sum(q.numel() for q in qhead.qweight.values())
    scale_bytes = 4 * sum(s.numel() for s in qhead.scale.values())
    details = {
        "bits": qhead.bits,
        "ratios": [round(r, 4) for r in ratios],
        "linears": len(qhead.qweight),
        "weights": int(weights),
        "packed_weight_bytes": int(weights * qhead.bits // 8),
        "scale_bytes": int(scale_bytes),
        "clip_ratio_mean": round(float(ratio_all.mean()), 4),
        "clip_ratio_below_max": round(float((ratio_all < c.qat.clip_search_max).float().mean()), 4),
        "clip_ratio_mean_per_linear": {n: round(float(r.mean()), 4) for n, r in chosen.items()},
        "qat_training": "skipped (random weights; PTQ integers from the clip search are exported)",
    }
    return (qhead, rebuilt), weights * qhead.bits // 8 + scale_bytes, details


def export(c: Check):
    """4. The static ring graph -> ONNX, then onnxruntime CPU vs torch on one query."""
    import torch
    from hycoc.passes.export import compare_with_torch, export_static
    from hycoc.passes.head.graph import INPUT_NAMES, OUTPUT_NAMES, HeadGraph

    a = c.args
    graph = HeadGraph(c.rebuilt).eval()
    c.feeds.extend(synthetic_feeds(c.rebuilt.config, c.text, a.window, a.samples, a.seed + 1))
    example = [torch.from_numpy(c.feeds[-1][n]) for n in INPUT_NAMES]
    names = dict(input_names=INPUT_NAMES, output_names=OUTPUT_NAMES)
    _, report = export_static(graph, example, c.float_path, **names)
    compare_with_torch(c.float_path, graph, example, **names, report=report)
    numbers = report.numbers()
    numbers["path"] = str(c.float_path.relative_to(c.work))
    numbers["input_shapes"] = {n: list(c.feeds[0][n].shape) for n in INPUT_NAMES}
    return graph, du(*onnx_files(c.float_path)), numbers


def qdq(c: Check):
    """5. QDQ with the QAT integers bit-exact, then the ONNX checker on the QDQ file."""
    import onnx
    from hycoc.passes.head.export import head_weight_arrays
    from hycoc.passes.qdq.quantize import quantize_graph

    qdq_dir = c.work / "qdq"
    t0 = time.perf_counter()
    arrays = head_weight_arrays(onnx.load(str(c.float_path)), c.qhead)
    match_s = time.perf_counter() - t0
    result = quantize_graph(c.float_path, c.feeds, qdq_dir, percentile=c.percentile, weight_arrays=arrays)
    t1 = time.perf_counter()
    onnx.checker.check_model(str(result.path), full_check=True)
    check_s = time.perf_counter() - t1
    qdq_files = onnx_files(result.path)
    numbers = result.numbers()
    numbers.pop("io_encodings", None)
    numbers.update(
        samples=len(c.feeds),
        percentile=c.percentile,
        weight_match_seconds=round(match_s, 2),
        checker="ok",
        checker_seconds=round(check_s, 2),
        qdq_files={p.name: p.stat().st_size for p in qdq_files},
        initializers=initializer_bits(result.path),
        float_side_files_bytes=du(*onnx_files(result.float_path)) + du(*onnx_files(qdq_dir / "model_folded.onnx")),
    )
    return result, du(*qdq_files), numbers


def block_chain(c: Check, suffix: str, AttentionBlock, profile) -> None:
    """6. One attention block of kind ``suffix``: export, QDQ, compile and simulate, each a step; stops at the first
    failed one (a block whose kind is not among the kept layers is recorded as skipped)."""
    import torch

    from hycoc.mtp import FULL, SLIDING

    kind = {"sliding": SLIDING, "full": FULL}[suffix]
    if kind not in c.graph.layer_types:
        c.steps.skip(f"block_{suffix}_export", f"no {suffix} layer in the first {c.args.layers} layers")
        return
    index = c.graph.layer_types.index(kind)
    bdir = c.work / f"block_{suffix}"
    bpath = bdir / "float" / "block.onnx"
    bfeeds = block_feeds(c.feeds, suffix)
    holder: dict[str, Any] = {}

    def bexport():
        from hycoc.passes.export import compare_with_torch, export_static

        block = AttentionBlock(c.graph, index).eval()
        example = [torch.from_numpy(bfeeds[-1][n]) for n in BLOCK_INPUTS]
        names = dict(input_names=BLOCK_INPUTS, output_names=("h_block",))
        _, report = export_static(block, example, bpath, **names)
        compare_with_torch(bpath, block, example, **names, logits=None, report=report)
        holder["block"] = block
        n = report.numbers()
        n["layer_index"] = index
        n["input_shapes"] = {k: list(bfeeds[0][k].shape) for k in BLOCK_INPUTS}
        return True, du(*onnx_files(bpath)), n

    def bqdq():
        import onnx
        from hycoc.passes.head.export import head_weight_arrays
        from hycoc.passes.qdq.quantize import quantize_graph

        sub = sub_head(c.qhead, ("pre_projection", f"model.layers.{index}."))
        arrays = head_weight_arrays(onnx.load(str(bpath)), sub)
        result = quantize_graph(bpath, bfeeds, bdir / "qdq", percentile=c.percentile, weight_arrays=arrays)
        onnx.checker.check_model(str(result.path), full_check=True)
        holder["qdq"] = result
        n = result.numbers()
        n.pop("io_encodings", None)
        n["initializers"] = initializer_bits(result.path)
        return True, du(*onnx_files(result.path)), n

    def bcompile():
        from hycoc.targets.htp import compile_context

        cg = compile_context(holder["qdq"].path, bdir / "htp", profile, graph_name=f"head_block_{suffix}")
        holder["compiled"] = cg
        return True, cg.binary_bytes + cg.ctx_model.stat().st_size, compiled_details(cg, profile, qnn_sdk=cg.qnn_sdk)

    def bsim():
        feed = bfeeds[0]
        out, times = htp_simulate(holder["compiled"].ctx_model, profile, feed)
        got_htp = out["h_block"]
        cpu = cpu_run(holder["qdq"].path, feed)["h_block"]
        flt = cpu_run(bpath, feed)["h_block"]
        return (
            True,
            0,
            {
                "sample": 0,
                **times,
                "sqnr_htp_vs_cpu_qdq_db": sqnr_rounded(cpu, got_htp),
                "sqnr_htp_vs_float_db": sqnr_rounded(flt, got_htp),
                "sqnr_cpu_qdq_vs_float_db": sqnr_rounded(flt, cpu),
                "max_abs_htp_vs_cpu_qdq": float(np.max(np.abs(cpu - got_htp))),
            },
        )

    what = f"pre_projection + layer {index} ({suffix}) over the {c.args.window}-column ring"
    if not c.steps.run(f"block_{suffix}_export", bexport, what=what):
        return
    if not c.steps.run(f"block_{suffix}_qdq", bqdq, what="quantize_graph on the block (its W4 integers)"):
        return
    if c.args.skip_compile:
        return
    what = f"compile_context {profile.name}, CPU fallback disabled"
    if c.steps.run(f"block_{suffix}_compile", bcompile, what=what):
        c.steps.run(f"block_{suffix}_sim", bsim, what="HTP simulator vs QDQ on the CPU EP (one query)")
    holder.pop("block", None)


def full_chain(c: Check, profile) -> None:
    """7. The whole QDQ head graph compiled (within ``--full-compile-timeout``) and, unless ``--no-full-sim``, run
    once on the simulator against the CPU EP."""
    from hycoc.passes.head.graph import OUTPUT_NAMES

    def fcompile():
        from hycoc.targets.htp import compile_context

        with qnn_worker_timeout(c.args.full_compile_timeout):
            cg = compile_context(c.qres.path, c.work / "htp", profile, graph_name="head")
        size = cg.binary_bytes + cg.ctx_model.stat().st_size
        return cg, size, compiled_details(cg, profile, timeout_s=c.args.full_compile_timeout)

    compiled = c.steps.run("full_compile", fcompile, what=f"whole QDQ head graph -> {profile.name} context binary")
    if compiled is None or c.args.no_full_sim:
        return

    def fsim():
        feed = c.feeds[0]
        got_htp, out = htp_simulate(compiled.ctx_model, profile, feed)
        cpu = cpu_run(c.qres.path, feed)
        flt = cpu_run(c.qres.float_path, feed)
        for name in OUTPUT_NAMES:
            out[f"sqnr_htp_vs_cpu_qdq_db.{name}"] = sqnr_rounded(cpu[name], got_htp[name])
            out[f"sqnr_htp_vs_float_db.{name}"] = sqnr_rounded(flt[name], got_htp[name])
        out["top1_htp_eq_cpu_qdq"] = bool(np.argmax(cpu["logits"]) == np.argmax(got_htp["logits"]))
        return True, 0, out

    c.steps.run("full_sim", fsim, what="whole head graph on the HTP simulator vs CPU EP (one query)")


def run_chain(c: Check) -> None:
    """Steps 1-7 in order; a step runs only when the one it needs succeeded, and what no later step needs is
    dropped as soon as possible (the head's float weights are the largest)."""
    from hycoc.targets.profiles import PROFILES

    steps, qat = c.steps, c.qat
    what = "Gemma4AssistantForCausalLM, assumed real-shape config, random init"
    c.head = steps.run("build_head", lambda: build_head(c), what=what)
    got = steps.run("keep_set_restrict", lambda: restrict(c), what="synthetic keep set; untied lm_head over its rows")
    if got is None:
        return
    (c.keep, c.restricted), c.head = got, None
    what = f"quantize_head W{qat.weight_bits} per-channel, clip search; export_head; dequantized_head"
    got = steps.run("w4_clip_search", lambda: quantize(c), what=what)
    if got is None:
        return
    (c.qhead, c.rebuilt), c.restricted = got, None
    what = "HeadGraph -> export_static (dynamo, RMSNorm decomposed, external data, checker) + ORT CPU vs torch"
    c.graph = steps.run("export", lambda: export(c), what=what)
    if c.graph is None:
        return
    what = "quantize_graph: W4 bit-exact QAT integers, A16, fixed encodings; ONNX checker on the QDQ file"
    c.qres = steps.run("qdq", lambda: qdq(c), what=what)
    profile = PROFILES["htp-v81"]
    AttentionBlock = attention_block_class()
    for suffix in c.blocks:
        block_chain(c, suffix, AttentionBlock, profile)
    if c.qres is not None and not c.args.skip_compile and not c.args.no_full_compile:
        full_chain(c, profile)


def report_of(c: Check, started: str, total_s: float) -> dict[str, Any]:
    """The JSON report (module docstring)."""
    import torch

    return {
        "what": "real-shape MTP head build check: random weights, synthetic keep set and calibration",
        "started": started,
        "total_seconds": round(total_s, 1),
        "args": dict(vars(c.args)),
        "shapes": report_shapes(c.args, c.text),
        "assumptions": [
            "head config ASSUMED (hycoc.passes.plan.HEAD_ASSUMED) until the assistant's config.json is given",
            "random weights (transformers' initializer): timing and memory are the real shapes', numerics are not",
            "keep set synthetic: sorted uniform sample of ids out of 262,144, no corpus read",
            "QAT training steps skipped: the W4 integers are the clip-search PTQ ones (same shapes, same export)",
            "calibration inputs synthetic (no verifier): e ~ N(0,1), h ~ N(0,2) with outlier channels x40, "
            "K/V ~ N(0,1), ring_masks for fills W/4..wrapped, rotary_rows at t-1",
        ],
        **report_end(c.steps, package_versions(), torch=torch.__version__, torch_threads=torch.get_num_threads()),
    }


def main(argv=None) -> dict[str, Any]:
    """Run the check; returns the report (also written to ``--out``)."""
    args = parse_args(argv)
    import torch
    from rich.console import Console

    if args.threads:
        torch.set_num_threads(args.threads)
    c = start(args, Console(stderr=True, quiet=args.quiet))
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t_all = time.perf_counter()
    return run_and_report(
        args, c.work, lambda: run_chain(c), lambda: report_of(c, started, time.perf_counter() - t_all), print_table
    )


def print_table(report: dict) -> None:
    """The summary table (one row per step) on stdout, then what the run needs of a machine."""
    from rich.console import Console
    from rich.table import Table

    s = report["shapes"]
    table = Table(
        title=f"real-shape MTP head: |V| {s['keep_set']:,}, W {s['window']:,}, {s['layers']} layers "
        f"(random weights) -- {report['total_seconds']:.0f} s total"
    )
    for col, just in (
        ("step", "left"),
        ("status", "left"),
        ("seconds", "right"),
        ("peak RSS GiB", "right"),
        ("tree peak GiB", "right"),
        ("output", "right"),
        ("notes", "left"),
    ):
        table.add_column(col, justify=just)
    for r in report["steps"]:
        d = r.get("details") or {}
        note = ""
        if r["step"] == "build_head":
            note = f"{d.get('params', 0) / 1e6:.1f}M params"
        elif r["step"] == "w4_clip_search":
            note = (
                f"{d.get('linears')} linears, {d.get('weights', 0) / 1e6:.1f}M weights, mean clip "
                f"{d.get('clip_ratio_mean')}"
            )
        elif r["step"] == "export" or r["step"].endswith("_export"):
            err = d.get("max_abs_error") or {}
            note = f"{d.get('nodes')} nodes, {d.get('rms_norms')} RMSNorm; ORT-torch max|err| " + ", ".join(
                f"{k} {v:.1e}" for k, v in err.items()
            )
        elif r["step"] == "qdq" or r["step"].endswith("_qdq"):
            sq = (d.get("sqnr") or {}).get("outputs", {})
            note = f"bits {d.get('weight_bits')}, {d.get('quantize_linear')} Q; SQNR " + ", ".join(
                f"{k} {v:.1f} dB" for k, v in sq.items()
            )
        elif r["step"].endswith("_compile"):
            note = f"bin {human_bytes(d.get('binary_bytes', 0))}, {d.get('soc_type')} v{d.get('htp_arch')}"
        elif r["step"].endswith("_sim"):
            note = ", ".join(f"{k.replace('sqnr_', '')} {v}" for k, v in d.items() if k.startswith("sqnr"))
        if r.get("status") == "skipped":
            note = r.get("what", "")
        table.add_row(*step_cells(r, note, cpu=False))
    console = Console(width=max(160, Console().width))
    console.print(table)
    if report.get("needs"):
        n = report["needs"]
        console.print(
            f"peak {n['peak_rss_gib']:.2f} GiB in {n['peak_step']} -> about {n['ram_gib_recommended']} "
            f"GiB RAM recommended; slowest step {n['slowest_step']} ({n['slowest_seconds']:.0f} s)"
        )


if __name__ == "__main__":
    rep = main()
    sys.exit(1 if rep["failed"] else 0)
