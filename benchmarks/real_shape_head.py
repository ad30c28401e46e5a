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
   Its size is what matters for the shapes. `hycoc.passes.head_qat.restrict_output_layer` unties the output layer.
3. ``w4_clip_search``: every drafting Linear W4 per-channel symmetric with the per-channel MSE clip search
   (`quantize_head` -> `search_clip`, the recipe's 9 ratios 1.0 .. 0.6), then `export_head` (integers + scales)
   and `dequantized_head` (the float model the graph is exported from, exactly as `HeadExport` does). The QAT
   TRAINING steps are skipped: with random weights there is no teacher worth distilling, and a step's cost is a
   GPU matter (Table 4: bf16 autocast on CUDA); the integers written are the PTQ ones.
4. ``export``: `hycoc.passes.head_graph.HeadGraph` (one query over the W-column ring, additive masks, rotary rows
   as inputs) through `hycoc.passes.export.export_static` (torch.onnx dynamo exporter, RMSNorms decomposed,
   external data, ONNX checker), then `compare_with_torch` on one query (onnxruntime CPU EP vs torch).
5. ``qdq``: `hycoc.passes.qdq.quantize_graph` with the QAT integers as bit-exact int4 weights
   (`hycoc.passes.head_export.head_weight_arrays`, as `HeadQdq` does), A16 activations at the head's 99.99th
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

Memory: each step's ``peak_rss_gib`` is this process's own high-water mark (VmHWM, reset before the step through
``/proc/self/clear_refs``); ``peak_tree_rss_gib`` samples this process plus its children (the QNN compile runs in
a child process) every 0.2 s. ``output_bytes`` is what the step wrote to disk (or holds, for in-memory steps).

``--toy-dims`` (tests only) runs the same chain at toy widths; the report says ``"real_shapes": false``.

Prints a table and writes the same as JSON to ``--out`` (default runs/real-shape-head.json); work files go to
``--work`` (default: a temporary folder, removed at the end unless ``--keep-work``).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import json
import os
import platform
import shutil
import sys
import tempfile
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GIB = 1024**3
VOCAB = 262_144
PERCENTILE_DEFAULT = 99.99


# ---- measuring ---------------------------------------------------------------------------------------------


def _proc_kib(path: str, field: str) -> int:
    """``field`` (kB) of a /proc file such as /proc/self/status or /proc/meminfo; 0 when unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _status_kib(field: str, pid: int | str = "self") -> int:
    return _proc_kib(f"/proc/{pid}/status", field)


def _children(pid: int) -> list[int]:
    """Every descendant of ``pid`` (scan of /proc/*/stat)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
            parent[int(d)] = int(stat[stat.rfind(")") + 2 :].split()[1])
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        todo += kids
    return out


class _Sampler(threading.Thread):
    """Polls RSS of this process + its descendants; ``peak`` in KiB."""

    def __init__(self, every: float = 0.2):
        super().__init__(daemon=True)
        self.every, self.peak, self.peak_children = every, 0, 0
        self._stop_evt = threading.Event()

    def run(self):
        me = os.getpid()
        while not self._stop_evt.is_set():
            kids = sum(_status_kib("VmRSS", c) for c in _children(me))
            self.peak_children = max(self.peak_children, kids)
            self.peak = max(self.peak, _status_kib("VmRSS") + kids)
            self._stop_evt.wait(self.every)

    def stop(self):
        self._stop_evt.set()
        self.join()


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _du(*paths: Path) -> int:
    total = 0
    for p in paths:
        p = Path(p)
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


class Steps:
    """Runs named steps, recording seconds, peak memory, output bytes, status and details."""

    def __init__(self, console=None):
        self.rows: list[dict[str, Any]] = []
        self.console = console

    def run(self, name: str, fn, *, what: str = ""):
        """``fn()`` -> (result, output_bytes, details dict). Returns the result, or None when it raised (the
        step is recorded as failed with the error)."""
        gc.collect()
        reset = _reset_hwm()
        sampler = _Sampler()
        sampler.start()
        rss0 = _status_kib("VmRSS")
        t0 = time.perf_counter()
        row: dict[str, Any] = {"step": name, "what": what}
        result = None
        try:
            result, nbytes, details = fn()
            row.update(status="ok", output_bytes=int(nbytes), details=details)
        except BaseException as e:  # a failed step is a measured result; KeyboardInterrupt re-raised
            if isinstance(e, KeyboardInterrupt):
                raise
            row.update(
                status="failed",
                output_bytes=0,
                error=f"{type(e).__name__}: {e}"[:4000],
                details={"traceback": traceback.format_exc()[-3000:]},
            )
        finally:
            row["seconds"] = round(time.perf_counter() - t0, 2)
            sampler.stop()
            hwm = _status_kib("VmHWM")
            row["peak_rss_gib"] = round(hwm / 1024**2, 3)
            row["peak_rss_exact"] = reset  # False: VmHWM could not be reset, the value is the process's to date
            row["peak_tree_rss_gib"] = round(max(sampler.peak, hwm) / 1024**2, 3)
            row["peak_children_rss_gib"] = round(sampler.peak_children / 1024**2, 3)
            row["rss_before_gib"] = round(rss0 / 1024**2, 3)
            row["rss_after_gib"] = round(_status_kib("VmRSS") / 1024**2, 3)
            self.rows.append(row)
            if self.console is not None:
                mark = "ok" if row["status"] == "ok" else f"FAILED: {row.get('error', '')[:300]}"
                self.console.print(
                    f"[{row['seconds']:8.1f} s  peak {row['peak_tree_rss_gib']:6.2f} GiB] {name}: {mark}"
                )
        return result


# ---- the model -------------------------------------------------------------------------------------------------


#: ``--toy-dims`` (tests only): the same structure at toy widths, so the whole chain runs in seconds. NOT real shapes.
TOY_DIMS = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "num_global_key_value_heads": 1,
    "global_head_dim": 64,
    "vocab_size": 4096,
}
TOY_BACKBONE = 96


def head_config(layers: int | None, toy_dims: bool = False):
    """The ASSUMED real-shape head config (`hycoc.passes.plan.HEAD_ASSUMED`), cut to the first ``layers``.

    transformers' Gemma 4 config forces the last layer to full attention, so ``layers`` 1 gives [full] and 2 gives
    [sliding, full]. ``toy_dims``: `TOY_DIMS` widths (tests only)."""
    from hycoc.passes.plan import HEAD_ASSUMED
    from transformers import Gemma4AssistantConfig

    d = copy.deepcopy(HEAD_ASSUMED)
    text = d["text_config"]
    if toy_dims:
        text.update(TOY_DIMS)
        d["backbone_hidden_size"] = TOY_BACKBONE
    n = len(text["layer_types"]) if layers is None else int(layers)
    if not 1 <= n <= len(text["layer_types"]):
        raise ValueError(f"--layers {n}: the assumed head has {len(text['layer_types'])} layers")
    text["layer_types"] = text["layer_types"][: n - 1] + [text["layer_types"][-1]]
    text["num_hidden_layers"] = n
    text["num_kv_shared_layers"] = n
    return Gemma4AssistantConfig.from_dict(d), text


def synthetic_keep_set(size: int, vocab: int = VOCAB, seed: int = 0) -> np.ndarray:
    """``size`` sorted distinct ids out of [0, vocab) (no corpus: module docstring)."""
    if not 1 <= size <= vocab:
        raise ValueError(f"--keep-set {size}: must lie in [1, {vocab}]")
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(vocab, size=size, replace=False)).astype(np.int64)


def synthetic_feeds(config, text: dict, window: int, count: int, seed: int) -> list[dict[str, np.ndarray]]:
    """``count`` head graph inputs (INPUT_NAMES) from random-but-plausible values (module docstring)."""
    from hycoc.passes.head_graph import INPUT_NAMES, ring_masks, rotary_rows

    from hycoc.mtp import FULL, SLIDING

    H = int(config.backbone_hidden_size)
    kv_s, d_s = int(text["num_key_value_heads"]), int(text["head_dim"])
    kv_f, d_f = int(text["num_global_key_value_heads"]), int(text["global_head_dim"])
    sliding_window = int(text["sliding_window"])
    # rotary rows from the 4-layer config: `rotary_rows` needs both layer types in the config (with --layers 1 the
    # head is [full] only); the rows depend only on the rope parameters and head dims, which are the same
    rotary_config = config
    if len(set(text["layer_types"])) < 2:
        rotary_config = head_config(None, int(text["hidden_size"]) == TOY_DIMS["hidden_size"])[0]
    rng = np.random.default_rng(seed)
    outliers = rng.choice(H, size=max(1, H // 512), replace=False)
    out = []
    for i in range(count):
        # ring fill from a quarter ring to a full, wrapped ring
        fill = window // 4 + (i * (window - window // 4)) // max(1, count - 1) if count > 1 else window
        t = fill if fill < window else window + 37 + i
        masks = ring_masks(t, 0, window, sliding_window)
        rot = rotary_rows(rotary_config, t - 1)
        e = rng.standard_normal(H).astype(np.float32)
        h = 2.0 * rng.standard_normal(H).astype(np.float32)
        h[outliers] *= 40.0
        x_hat = np.concatenate([e, h])[None, None]
        values = {
            "x_hat": x_hat,
            "k_sliding": rng.standard_normal((1, kv_s, window, d_s), dtype=np.float32),
            "v_sliding": rng.standard_normal((1, kv_s, window, d_s), dtype=np.float32),
            "k_full": rng.standard_normal((1, kv_f, window, d_f), dtype=np.float32),
            "v_full": rng.standard_normal((1, kv_f, window, d_f), dtype=np.float32),
            "mask_sliding": masks[SLIDING],
            "mask_full": masks[FULL],
            "cos_sliding": rot[SLIDING][0].numpy(),
            "sin_sliding": rot[SLIDING][1].numpy(),
            "cos_full": rot[FULL][0].numpy(),
            "sin_full": rot[FULL][1].numpy(),
        }
        out.append({n: np.ascontiguousarray(values[n], dtype=np.float32) for n in INPUT_NAMES})
    return out


def _block_class():
    import torch
    from torch import nn

    class AttentionBlock(nn.Module):
        """Pre-projection + one decoder layer of the head reading the W-column ring of one layer kind (the head
        graph cut to its first layer of that kind): inputs x_hat, k, v, mask, cos, sin; output ``h_block``."""

        def __init__(self, graph, index: int):
            super().__init__()
            self.pre_projection = graph.pre_projection
            self.layer = graph.layers[index]
            self.kind = graph.layer_types[index]
            self.requires_grad_(False)

        def forward(self, x_hat, k, v, mask, cos, sin):
            x = self.pre_projection(x_hat)
            return self.layer(
                x, None, shared_kv_states={self.kind: (k, v)}, position_embeddings=(cos, sin), attention_mask=mask
            )

    return AttentionBlock, torch


def block_feeds(feeds: list[dict[str, np.ndarray]], suffix: str) -> list[dict[str, np.ndarray]]:
    return [
        {
            "x_hat": f["x_hat"],
            "k": f[f"k_{suffix}"],
            "v": f[f"v_{suffix}"],
            "mask": f[f"mask_{suffix}"],
            "cos": f[f"cos_{suffix}"],
            "sin": f[f"sin_{suffix}"],
        }
        for f in feeds
    ]


BLOCK_INPUTS = ("x_hat", "k", "v", "mask", "cos", "sin")


# ---- helpers --------------------------------------------------------------------------------------------------


def _onnx_files(path: Path) -> list[Path]:
    return [p for p in path.parent.iterdir() if p.name.startswith(path.name)]


def _qdq_bitmap(path: Path) -> dict[str, Any]:
    """Initializer dtype -> {tensors, values, bytes} of a saved ONNX file (no external data read)."""
    import onnx
    from hycoc.targets.htp import _initializer_bytes  # noqa: PLC2701 - the size planner's byte count

    model = onnx.load(str(path), load_external_data=False)
    out: dict[str, dict[str, int]] = {}
    for t in model.graph.initializer:
        name = onnx.TensorProto.DataType.Name(t.data_type)
        e = out.setdefault(name, {"tensors": 0, "values": 0, "bytes": 0})
        e["tensors"] += 1
        e["values"] += int(np.prod(t.dims)) if len(t.dims) else 1
        e["bytes"] += _initializer_bytes(t)
    return out


def _sqnr(ref: np.ndarray, x: np.ndarray) -> float:
    from hycoc.passes.qdq import sqnr_db

    v = sqnr_db(ref, x)
    return round(v, 2) if np.isfinite(v) else v


def _cpu_run(path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    so = ort.SessionOptions()
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, {i.name: feed[i.name] for i in s.get_inputs()})))


def _sub_head(qhead, prefixes: tuple[str, ...]):
    """The QuantizedHead restricted to the linears under ``prefixes`` (for a block's `head_weight_arrays`)."""
    keep = [n for n in qhead.qweight if n.startswith(prefixes)]
    return dataclasses.replace(
        qhead, qweight={n: qhead.qweight[n] for n in keep}, scale={n: qhead.scale[n] for n in keep}
    )


class _WorkerTimeout:
    """Routes `hycoc.targets.qnn_ep.run_worker` calls through a shorter timeout (compile_context uses 3600 s)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __enter__(self):
        import hycoc.targets.qnn_ep as qnn_ep

        self._orig = qnn_ep.run_worker
        orig, seconds = self._orig, self.seconds
        qnn_ep.run_worker = lambda job, timeout_s=3600: orig(job, timeout_s=min(timeout_s, seconds))
        return self

    def __exit__(self, *exc):
        import hycoc.targets.qnn_ep as qnn_ep

        qnn_ep.run_worker = self._orig
        return False


# ---- the check ---------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
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
    p.add_argument("--out", default=str(REPO / "runs" / "real-shape-head.json"))
    p.add_argument("--work", default=None, help="work folder (default: temporary, removed at the end)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument(
        "--toy-dims",
        action="store_true",
        help="tests only: the same chain at toy widths (hidden 64, vocab 4,096); NOT real shapes",
    )
    return p.parse_args(argv)


def main(argv=None) -> dict[str, Any]:
    """Run the check; returns the report (also written to ``--out``)."""
    args = parse_args(argv)
    from rich.console import Console

    console = Console(stderr=True, quiet=args.quiet)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    qat = recipe.head_qat
    percentile = float(qat.input_range_percentile)
    blocks = [b.strip() for b in args.blocks.split(",") if b.strip() and b.strip() != "none"]
    bad = [b for b in blocks if b not in ("sliding", "full")]
    if bad:
        raise SystemExit(f"--blocks: unknown kind(s) {bad} (sliding, full)")

    work_tmp = None
    if args.work:
        work = Path(args.work)
        if work.exists():
            shutil.rmtree(work)
        work.mkdir(parents=True)
    else:
        work_tmp = tempfile.mkdtemp(prefix="hycoc-real-shape-head-")
        work = Path(work_tmp)

    steps = Steps(console)
    state: dict[str, Any] = {}
    started = datetime.now(UTC).isoformat(timespec="seconds")
    t_all = time.perf_counter()

    # 1. the head at real shapes, random weights
    def build():
        from transformers import Gemma4AssistantForCausalLM

        torch.manual_seed(args.seed)
        config, text_dict = head_config(args.layers, args.toy_dims)
        state["text"] = text_dict
        config._attn_implementation = "eager"
        head = Gemma4AssistantForCausalLM(config).float().eval()
        head.requires_grad_(False)
        n = sum(p.numel() for p in head.parameters())
        text = config.get_text_config()
        return (
            head,
            4 * n,
            {
                "params": n,
                "layers": int(text.num_hidden_layers),
                "layer_types": list(text.layer_types),
                "hidden": int(text.hidden_size),
                "intermediate": int(text.intermediate_size),
                "backbone_hidden": int(config.backbone_hidden_size),
                "vocab": int(text.vocab_size),
                "config": "ASSUMED (hycoc.passes.plan.HEAD_ASSUMED), random weights",
            },
        )

    head = steps.run("build_head", build, what="Gemma4AssistantForCausalLM, assumed real-shape config, random init")

    # 2. keep set + restricted output layer
    def restrict():
        from hycoc.passes.head_qat import restrict_output_layer

        keep = synthetic_keep_set(args.keep_set, int(head.config.get_text_config().vocab_size), args.seed)
        restricted = restrict_output_layer(head, keep)
        restricted.requires_grad_(False)
        w = restricted.lm_head.weight
        return (
            (keep, restricted),
            keep.nbytes + w.numel() * 4,
            {
                "keep_set": int(len(keep)),
                "source": "synthetic: sorted uniform sample of ids, no corpus",
                "lm_head": list(w.shape),
            },
        )

    got = steps.run("keep_set_restrict", restrict, what="synthetic keep set; untied lm_head over its rows")
    if got is not None:
        keep, restricted = got
        del head
        head = None

    # 3. W4 per-channel symmetric with the clip search (no QAT training: random weights)
    def quantize():
        from hycoc.passes.head_qat import clip_ratios, dequantized_head, export_head, quantize_head

        ratios = clip_ratios(qat)
        student, chosen = quantize_head(restricted, qat.weight_bits, ratios)
        qhead = export_head(student, keep, {})
        del student
        rebuilt = dequantized_head(qhead)
        ratio_all = torch.cat(list(chosen.values()))
        weights = sum(q.numel() for q in qhead.qweight.values())
        per_layer = {n: round(float(r.mean()), 4) for n, r in chosen.items()}
        return (
            (qhead, rebuilt),
            weights * qhead.bits // 8 + 4 * sum(s.numel() for s in qhead.scale.values()),
            {
                "bits": qhead.bits,
                "ratios": [round(r, 4) for r in ratios],
                "linears": len(qhead.qweight),
                "weights": int(weights),
                "packed_weight_bytes": int(weights * qhead.bits // 8),
                "scale_bytes": int(4 * sum(s.numel() for s in qhead.scale.values())),
                "clip_ratio_mean": round(float(ratio_all.mean()), 4),
                "clip_ratio_below_max": round(float((ratio_all < qat.clip_search_max).float().mean()), 4),
                "clip_ratio_mean_per_linear": per_layer,
                "qat_training": "skipped (random weights; PTQ integers from the clip search are exported)",
            },
        )

    if got is not None:
        got = steps.run(
            "w4_clip_search",
            quantize,
            what=f"quantize_head W{qat.weight_bits} per-channel, clip search; export_head; dequantized_head",
        )
        if got is not None:
            qhead, rebuilt = got
            del restricted

    from hycoc.passes.head_graph import INPUT_NAMES, OUTPUT_NAMES, HeadGraph

    feeds: list[dict[str, np.ndarray]] = []
    float_path = work / "float" / "head.onnx"

    # 4. static ring graph -> ONNX
    def export():
        from hycoc.passes.export import compare_with_torch, export_static

        graph = HeadGraph(rebuilt).eval()
        feeds.extend(synthetic_feeds(rebuilt.config, state["text"], args.window, args.samples, args.seed + 1))
        example = [torch.from_numpy(feeds[-1][n]) for n in INPUT_NAMES]
        _, report = export_static(graph, example, float_path, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES)
        compare_with_torch(
            float_path, graph, example, input_names=INPUT_NAMES, output_names=OUTPUT_NAMES, report=report
        )
        numbers = report.numbers()
        numbers["path"] = str(float_path.relative_to(work))
        numbers["input_shapes"] = {n: list(feeds[0][n].shape) for n in INPUT_NAMES}
        return graph, _du(*_onnx_files(float_path)), numbers

    graph = None
    if got is not None:
        graph = steps.run(
            "export",
            export,
            what="HeadGraph -> export_static (dynamo, RMSNorm decomposed, external data, checker) + ORT CPU vs torch",
        )

    # 5. QDQ
    qdq_dir = work / "qdq"

    def qdq():
        import onnx
        from hycoc.passes.head_export import head_weight_arrays
        from hycoc.passes.qdq import quantize_graph

        t0 = time.perf_counter()
        arrays = head_weight_arrays(onnx.load(str(float_path)), qhead)
        match_s = time.perf_counter() - t0
        result = quantize_graph(float_path, feeds, qdq_dir, percentile=percentile, weight_arrays=arrays)
        t1 = time.perf_counter()
        onnx.checker.check_model(str(result.path), full_check=True)
        check_s = time.perf_counter() - t1
        qdq_files = _onnx_files(result.path)
        numbers = result.numbers()
        numbers.pop("io_encodings", None)
        numbers.update(
            samples=len(feeds),
            percentile=percentile,
            weight_match_seconds=round(match_s, 2),
            checker="ok",
            checker_seconds=round(check_s, 2),
            qdq_files={p.name: p.stat().st_size for p in qdq_files},
            initializers=_qdq_bitmap(result.path),
            float_side_files_bytes=_du(*_onnx_files(result.float_path))
            + _du(*_onnx_files(qdq_dir / "model_folded.onnx")),
        )
        return result, _du(*qdq_files), numbers

    qres = None
    if graph is not None:
        qres = steps.run(
            "qdq",
            qdq,
            what="quantize_graph: W4 bit-exact QAT integers, A16, fixed encodings; ONNX checker on the QDQ file",
        )

    # 6. attention blocks: export, QDQ, compile, simulator
    from hycoc.targets.profiles import PROFILES

    from hycoc.mtp import FULL, SLIDING

    profile = PROFILES["htp-v81"]
    compiled_full = None
    if graph is not None:
        AttentionBlock, _ = _block_class()
        kinds = {"sliding": SLIDING, "full": FULL}
        for suffix in blocks:
            if kinds[suffix] not in graph.layer_types:
                steps.rows.append(
                    {
                        "step": f"block_{suffix}_export",
                        "status": "skipped",
                        "seconds": 0,
                        "output_bytes": 0,
                        "what": f"no {suffix} layer in the first {args.layers} layers",
                    }
                )
                continue
            index = graph.layer_types.index(kinds[suffix])
            bdir = work / f"block_{suffix}"
            bpath = bdir / "float" / "block.onnx"
            bfeeds = block_feeds(feeds, suffix)
            holder: dict[str, Any] = {}

            def bexport(index=index, bpath=bpath, bfeeds=bfeeds, holder=holder):
                from hycoc.passes.export import compare_with_torch, export_static

                block = AttentionBlock(graph, index).eval()
                example = [torch.from_numpy(bfeeds[-1][n]) for n in BLOCK_INPUTS]
                _, report = export_static(block, example, bpath, input_names=BLOCK_INPUTS, output_names=("h_block",))
                compare_with_torch(
                    bpath,
                    block,
                    example,
                    input_names=BLOCK_INPUTS,
                    output_names=("h_block",),
                    logits=None,
                    report=report,
                )
                holder["block"] = block
                n = report.numbers()
                n["layer_index"] = index
                n["input_shapes"] = {k: list(bfeeds[0][k].shape) for k in BLOCK_INPUTS}
                return True, _du(*_onnx_files(bpath)), n

            if not steps.run(
                f"block_{suffix}_export",
                bexport,
                what=f"pre_projection + layer {index} ({suffix}) over the {args.window}-column ring",
            ):
                continue

            def bqdq(index=index, bpath=bpath, bfeeds=bfeeds, bdir=bdir, holder=holder):
                import onnx
                from hycoc.passes.head_export import head_weight_arrays
                from hycoc.passes.qdq import quantize_graph

                sub = _sub_head(qhead, ("pre_projection", f"model.layers.{index}."))
                arrays = head_weight_arrays(onnx.load(str(bpath)), sub)
                result = quantize_graph(bpath, bfeeds, bdir / "qdq", percentile=percentile, weight_arrays=arrays)
                onnx.checker.check_model(str(result.path), full_check=True)
                holder["qdq"] = result
                n = result.numbers()
                n.pop("io_encodings", None)
                n["initializers"] = _qdq_bitmap(result.path)
                return True, _du(*_onnx_files(result.path)), n

            if not steps.run(f"block_{suffix}_qdq", bqdq, what="quantize_graph on the block (its W4 integers)"):
                continue
            if args.skip_compile:
                continue

            def bcompile(suffix=suffix, bdir=bdir, holder=holder):
                from hycoc.targets.htp import compile_context

                cg = compile_context(holder["qdq"].path, bdir / "htp", profile, graph_name=f"head_block_{suffix}")
                holder["compiled"] = cg
                return (
                    True,
                    cg.binary_bytes + cg.ctx_model.stat().st_size,
                    {
                        "profile": profile.name,
                        "htp_arch": cg.htp_arch,
                        "soc_type": cg.soc_type,
                        "qnn_sdk": cg.qnn_sdk,
                        "binary_bytes": cg.binary_bytes,
                        "weight_bytes": cg.weight_bytes,
                        "compile_seconds": round(cg.compile_seconds, 2),
                        "cpu_fallback": "disabled",
                    },
                )

            if not steps.run(
                f"block_{suffix}_compile", bcompile, what=f"compile_context {profile.name}, CPU fallback disabled"
            ):
                continue

            def bsim(bfeeds=bfeeds, holder=holder, bpath=bpath):
                from hycoc.targets.htp import HtpSession

                feed = bfeeds[0]
                t0 = time.perf_counter()
                sess = HtpSession(holder["compiled"].ctx_model, profile)
                load_s = time.perf_counter() - t0
                t1 = time.perf_counter()
                got_htp = sess.run(feed)["h_block"]
                run_s = time.perf_counter() - t1
                cpu = _cpu_run(holder["qdq"].path, feed)["h_block"]
                flt = _cpu_run(bpath, feed)["h_block"]
                return (
                    True,
                    0,
                    {
                        "sample": 0,
                        "load_seconds": round(load_s, 2),
                        "run_seconds": round(run_s, 2),
                        "sqnr_htp_vs_cpu_qdq_db": _sqnr(cpu, got_htp),
                        "sqnr_htp_vs_float_db": _sqnr(flt, got_htp),
                        "sqnr_cpu_qdq_vs_float_db": _sqnr(flt, cpu),
                        "max_abs_htp_vs_cpu_qdq": float(np.max(np.abs(cpu - got_htp))),
                    },
                )

            steps.run(f"block_{suffix}_sim", bsim, what="HTP simulator vs QDQ on the CPU EP (one query)")
            holder.pop("block", None)

        # 7. the whole head graph
        if qres is not None and not args.skip_compile and not args.no_full_compile:

            def fcompile():
                from hycoc.targets.htp import compile_context

                with _WorkerTimeout(args.full_compile_timeout):
                    cg = compile_context(qres.path, work / "htp", profile, graph_name="head")
                return (
                    cg,
                    cg.binary_bytes + cg.ctx_model.stat().st_size,
                    {
                        "profile": profile.name,
                        "htp_arch": cg.htp_arch,
                        "soc_type": cg.soc_type,
                        "binary_bytes": cg.binary_bytes,
                        "weight_bytes": cg.weight_bytes,
                        "compile_seconds": round(cg.compile_seconds, 2),
                        "cpu_fallback": "disabled",
                        "timeout_s": args.full_compile_timeout,
                    },
                )

            compiled_full = steps.run(
                "full_compile", fcompile, what=f"whole QDQ head graph -> {profile.name} context binary"
            )
            if compiled_full is not None and not args.no_full_sim:

                def fsim():
                    from hycoc.targets.htp import HtpSession

                    feed = feeds[0]
                    t0 = time.perf_counter()
                    sess = HtpSession(compiled_full.ctx_model, profile)
                    load_s = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    got_htp = sess.run(feed)
                    run_s = time.perf_counter() - t1
                    cpu = _cpu_run(qres.path, feed)
                    flt = _cpu_run(qres.float_path, feed)
                    out = {"load_seconds": round(load_s, 2), "run_seconds": round(run_s, 2)}
                    for name in OUTPUT_NAMES:
                        out[f"sqnr_htp_vs_cpu_qdq_db.{name}"] = _sqnr(cpu[name], got_htp[name])
                        out[f"sqnr_htp_vs_float_db.{name}"] = _sqnr(flt[name], got_htp[name])
                    out["top1_htp_eq_cpu_qdq"] = bool(np.argmax(cpu["logits"]) == np.argmax(got_htp["logits"]))
                    return True, 0, out

                steps.run("full_sim", fsim, what="whole head graph on the HTP simulator vs CPU EP (one query)")

    total_s = time.perf_counter() - t_all
    report = {
        "what": "real-shape MTP head build check: random weights, synthetic keep set and calibration",
        "started": started,
        "total_seconds": round(total_s, 1),
        "args": {k: v for k, v in vars(args).items()},
        "shapes": _shapes(args, state.get("text")),
        "assumptions": [
            "head config ASSUMED (hycoc.passes.plan.HEAD_ASSUMED) until the assistant's config.json is given",
            "random weights (transformers' initializer): timing and memory are the real shapes', numerics are not",
            "keep set synthetic: sorted uniform sample of ids out of 262,144, no corpus read",
            "QAT training steps skipped: the W4 integers are the clip-search PTQ ones (same shapes, same export)",
            "calibration inputs synthetic (no verifier): e ~ N(0,1), h ~ N(0,2) with outlier channels x40, "
            "K/V ~ N(0,1), ring_masks for fills W/4..wrapped, rotary_rows at t-1",
        ],
        "machine": {
            "host": platform.node(),
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "mem_total_gib": round(_meminfo_kib("MemTotal") / 1024**2, 1),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
        },
        "versions": _versions(),
        "steps": steps.rows,
        "peak_rss_gib": max((r.get("peak_tree_rss_gib", 0) for r in steps.rows), default=0),
        "failed": [r["step"] for r in steps.rows if r.get("status") == "failed"],
    }
    report["needs"] = _needs(report)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=_json_default), encoding="utf-8")
    os.replace(tmp, out)
    if not args.quiet:
        print_table(report)
    if work_tmp is not None and not args.keep_work:
        shutil.rmtree(work_tmp, ignore_errors=True)
    return report


def _shapes(args, text: dict | None) -> dict[str, Any]:
    from hycoc.passes.plan import HEAD_ASSUMED

    t = text or HEAD_ASSUMED["text_config"]
    backbone = TOY_BACKBONE if args.toy_dims else int(HEAD_ASSUMED["backbone_hidden_size"])
    return {
        "real_shapes": not args.toy_dims,
        "keep_set": args.keep_set,
        "window": args.window,
        "layers": int(t["num_hidden_layers"]) if text else (args.layers or 4),
        "layer_types": t["layer_types"],
        "head_hidden": t["hidden_size"],
        "intermediate": t["intermediate_size"],
        "query_heads": t["num_attention_heads"],
        "vocab": t["vocab_size"],
        "backbone_hidden": backbone,
        "x_hat": 2 * backbone,
        "kv_sliding": [t["num_key_value_heads"], t["head_dim"]],
        "kv_full": [t["num_global_key_value_heads"], t["global_head_dim"]],
    }


def _meminfo_kib(field: str) -> int:
    return _proc_kib("/proc/meminfo", field)


def _versions() -> dict[str, str]:
    out = {}
    for mod in ("torch", "transformers", "onnx", "onnxscript", "onnx_ir", "onnxruntime"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 -- a version is a label: a missing or broken package prints ?
            out[mod] = "?"
    try:
        from importlib.metadata import version

        out["onnxruntime-qnn"] = version("onnxruntime-qnn")
    except Exception:  # noqa: BLE001 -- a version is a label: a missing package prints ?
        out["onnxruntime-qnn"] = "?"
    return out


def _needs(report: dict) -> dict[str, Any]:
    """The machine the measured steps need: the largest peak (RSS of the tree) and the slowest step."""
    rows = [r for r in report["steps"] if r.get("status") == "ok"]
    if not rows:
        return {}
    peak = max(rows, key=lambda r: r.get("peak_tree_rss_gib", 0))
    slow = max(rows, key=lambda r: r.get("seconds", 0))
    return {
        "peak_step": peak["step"],
        "peak_rss_gib": peak["peak_tree_rss_gib"],
        "ram_gib_recommended": round(peak["peak_tree_rss_gib"] * 1.25 + 1, 1),
        "slowest_step": slow["step"],
        "slowest_seconds": slow["seconds"],
    }


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    return str(o)


def _human(n: int | float) -> str:
    n = float(n or 0)
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def print_table(report: dict) -> None:
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
            note = f"bin {_human(d.get('binary_bytes', 0))}, {d.get('soc_type')} v{d.get('htp_arch')}"
        elif r["step"].endswith("_sim"):
            note = ", ".join(f"{k.replace('sqnr_', '')} {v}" for k, v in d.items() if k.startswith("sqnr"))
        if r.get("status") == "failed":
            note = (r.get("error") or "")[:160]
        elif r.get("status") == "skipped":
            note = r.get("what", "")
        table.add_row(
            r["step"],
            r.get("status", ""),
            f"{r.get('seconds', 0):.1f}",
            f"{r.get('peak_rss_gib', 0):.2f}",
            f"{r.get('peak_tree_rss_gib', 0):.2f}",
            _human(r.get("output_bytes", 0)),
            note,
        )
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
