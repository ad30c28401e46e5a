"""The E2B SLM build check's ``--shards`` path (benchmarks/real_shape_slm.py; docs/real-shapes.md "The E2B SLM at real
shape"), and the helpers it shares with the whole-graph path.

``--shards N|auto`` / ``--bounds``: the SLM graph split by layers (`hycoc.passes.slm.shards.plan_shards` on the
target profile's context budget, or the bounds given), each shard through steps 4-8 of the whole graph in chain
order -- ``graph.sK`` (the torch shard and the float chain on the calibration samples), ``export.sK``, ``qdq.sK``
(calibrated on the float chain), ``compile.sK``, ``sim.sK`` (fed by the simulator chain, against the CPU EP chain
of the QDQ shards) -- then ``budget_refusal`` on the largest shard and ``chain`` end to end (`run_sharded`).

``c`` in every step is the script's ``Check``: ``args`` (its CLI), ``steps`` (`hycoc.bench.real_shape.harness.Steps`),
``work``, ``cal`` (the recipe's ``[slm_calibration]``), ``profile`` (`hycoc.targets.profiles.TargetProfile`),
``state["slm"]`` (the surgery's result), ``keep_n``, ``vocab`` and ``say``. Each step returns (result, output
bytes, details) for `Steps.run`, as the script's own steps do.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import numpy as np

from hycoc.bench.real_shape.harness import (
    GIB,
    cpu_run,
    du,
    onnx_files,
    qnn_worker_timeout,
    sqnr_rounded,
    synthetic_keep_set,
)

#: protobuf's limit on one serialized model: a graph over it must keep its weights as external data.
TWO_GB = 2**31


def qdq_peak_estimate_gib(linear_values: int, lut_bytes: int) -> float:
    """Estimated peak of `quantize_graph` on the whole graph: the float32 fold of every weight held about three
    times (folded model, preprocessed copy, quantizer's copy + the CPU EP session of the calibration), plus the
    int8 graph and the host LUTs. A planning figure, not a measurement."""
    return (3 * 4 * linear_values + linear_values + lut_bytes) / GIB


def refused_row(name: str, estimate: float, limit: float, note: str = "", details: dict | None = None) -> dict:
    """The report row of a QDQ step refused up front: its estimated peak is over ``--max-qdq-gib``."""
    row = {
        "step": name,
        "status": "refused",
        "seconds": 0,
        "output_bytes": 0,
        "peak_rss_gib": 0,
        "peak_tree_rss_gib": 0,
        "what": f"estimated peak {estimate:.1f} GiB > --max-qdq-gib {limit}{note}",
    }
    return row if details is None else {**row, "details": details}


def compile_slm(c, qdq_path: Path, name: str):
    """`compile_context` of ``qdq_path`` for the profile (CPU fallback disabled) within ``--compile-timeout``."""
    from hycoc.targets.htp import compile_context

    with qnn_worker_timeout(c.args.compile_timeout):
        return compile_context(qdq_path, c.work / "htp", c.profile, graph_name=name)


def top1_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Share of rows whose argmax over the last axis agrees."""
    a, b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
    return float(np.mean(a.argmax(-1) == b.argmax(-1)))


# ---- --shards -----------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Shards:
    """The sharded path's state: the shard bounds, the keep set and rings, the host's calibration feeds, and what
    each chain (float, QDQ on the CPU EP, HTP simulator) has produced so far (output name -> array; the float chain
    per sample), plus the QDQ file of each shard done."""

    bounds: tuple[int, ...]
    keep: np.ndarray
    ring: dict[str, int]
    host_samples: list[dict[str, np.ndarray]] | None = None
    produced_float: list[dict[str, np.ndarray]] = dataclasses.field(default_factory=list)
    produced_sim: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    produced_cpu: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    qdq_paths: list[Path] = dataclasses.field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.bounds) - 1


def shard_plan(c):
    """The shard bounds: ``--bounds``, else `plan_shards` on the profile's context budget (``--shards``)."""
    from hycoc.passes.slm.shards import layer_weight_bytes, plan_shards

    args, budget = c.args, c.profile.max_context_bytes
    per_layer, first, last = layer_weight_bytes(c.state["slm"], c.keep_n)
    if args.bounds:
        bounds, source = tuple(int(x) for x in args.bounds.split(",")), "--bounds"
    else:
        shards = args.shards if args.shards == "auto" else int(args.shards)
        plan = plan_shards(per_layer, budget=budget, first_extra=first, last_extra=last, shards=shards)
        bounds, source = plan.bounds, f"plan_shards({args.shards})"
    seg = [
        sum(per_layer[a:b]) + (first if a == 0 else 0) + (last if b == len(per_layer) else 0)
        for a, b in zip(bounds, bounds[1:])
    ]
    details = {
        "bounds": list(bounds),
        "per_layer_bytes": per_layer,
        "first_extra_bytes": first,
        "last_extra_bytes": last,
        "estimated_shard_bytes": seg,
        "budget_bytes": budget,
        "from": source,
    }
    return bounds, 0, details


def shard_graph(c, s: Shards, k: int):
    """``graph.sK``: the torch shard, and the float chain on the calibration samples (shard k's samples are the host
    feeds and the earlier shards' float outputs). Returns ((graph, samples), 0, details)."""
    import torch

    from hycoc.passes.qdq.quantize import slm_calibration_samples
    from hycoc.passes.slm.graph import IntegerLinear, SlmTreeGraph
    from hycoc.passes.slm.shard_chain import chain_feeds

    slm, a = c.state["slm"], c.args
    g = SlmTreeGraph(slm, s.keep, rows=a.rows, ring=s.ring, bounds=s.bounds, shard=k)
    if s.host_samples is None:
        s.host_samples = slm_calibration_samples(g, slm, a.samples, a.seed)
        s.produced_float.extend({} for _ in s.host_samples)
    samples = []
    for host, made in zip(s.host_samples, s.produced_float):
        x = chain_feeds(g, host, made)
        samples.append(x)
        with torch.no_grad():
            outs = g(*[torch.from_numpy(x[nm]) for nm in g.input_names])
        made.update({nm: o.numpy() for nm, o in zip(g.output_names, outs)})
    details = {
        "layers": list(g.layer_range),
        "kv_layers": g.kv_layers,
        "borrowed_producers": g.borrowed,
        "inputs": {nm: list(v) for nm, v in g.input_shapes.items()},
        "outputs": {nm: list(v) for nm, v in g.output_shapes.items()},
        "linear_values": sum(int(m.q.numel()) for m in g.modules() if isinstance(m, IntegerLinear)),
    }
    return (g, samples), 0, details


def shard_export(c, g, samples: list[dict[str, np.ndarray]], path: Path):
    """``export.sK``: `export_slm_graph` of the shard on its first sample, and its host-only nodes."""
    import onnx
    import torch

    from hycoc.passes.slm.graph import export_slm_graph
    from hycoc.targets.htp import find_host_only_nodes

    _, rep = export_slm_graph(g, [torch.from_numpy(samples[0][nm]) for nm in g.input_names], path)
    m = onnx.load(str(path), load_external_data=False)
    d = rep.numbers()
    d.update(
        data_bytes=rep.data_bytes,
        over_2gb=rep.data_bytes > TWO_GB,
        host_only_nodes=[str(x) for x in find_host_only_nodes(m, c.profile)],
    )
    return True, du(*onnx_files(path)), d


def shard_qdq(c, path: Path, samples: list[dict[str, np.ndarray]], tag: str, estimate: float):
    """``qdq.sK``: `quantize_graph` of the shard, calibrated on the float chain; the ONNX checker."""
    import onnx

    from hycoc.passes.qdq.quantize import quantize_graph

    out = c.work / f"qdq-{tag}"
    res = quantize_graph(path, samples, out, percentile=c.cal.percentile, range_scale=c.cal.range_scale)
    onnx.checker.check_model(str(res.path), full_check=True)
    d = res.numbers()
    d.pop("io_encodings", None)
    d.update(checker="ok", estimate_gib=round(estimate, 2), data_bytes=du(*onnx_files(res.path)))
    return res, du(out), d


def shard_budget_refusal(c, s: Shards):
    """``budget_refusal``: the limit lowered one byte below the largest shard's weights must refuse it first."""
    from hycoc.targets.htp import ContextTooLargeError, compile_context, plan_context_size

    plans = [plan_context_size([p], c.profile) for p in s.qdq_paths]
    biggest = max(range(len(plans)), key=lambda i: plans[i].weight_bytes)
    small = c.profile.with_limit(plans[biggest].weight_bytes - 1)
    out = c.work / "refused"
    try:
        compile_context(s.qdq_paths[biggest], out, small, graph_name=f"slm_s{biggest}")
    except ContextTooLargeError as e:
        written = sorted(p.name for p in out.rglob("*") if p.is_file()) if out.exists() else []
        details = {
            "refused": True,
            "shard": biggest,
            "message": str(e)[:600],
            "shard_weight_bytes": [p.weight_bytes for p in plans],
            "files_written": written,
            "limit_bytes": c.profile.max_context_bytes,
            "every_shard_fits": all(p.weight_bytes <= c.profile.max_context_bytes for p in plans),
        }
        return True, 0, details
    raise AssertionError("a shard over the lowered limit was not refused")


def shard_compile(c, qdq_path: Path, tag: str):
    """``compile.sK``: the shard's own context binary."""
    cg = compile_slm(c, qdq_path, f"slm_{tag}")
    details = {
        "binary": cg.context_binary.name,
        "binary_bytes": cg.binary_bytes,
        "weight_bytes": cg.weight_bytes,
        "htp_arch": cg.htp_arch,
        "soc_type": cg.soc_type,
        "cpu_fallback": "disabled",
        "under_budget": cg.binary_bytes <= c.profile.max_context_bytes,
    }
    return cg, cg.binary_bytes + cg.ctx_model.stat().st_size, details


def shard_sim(c, s: Shards, cg, qdq_path: Path):
    """``sim.sK``: the shard on the HTP simulator fed by the simulator chain, against the CPU EP chain of the QDQ
    shards (SQNR per output)."""
    from hycoc.passes.slm.shard_chain import chain_feeds
    from hycoc.targets.htp import HtpSession

    if s.host_samples is None:  # made by shard_graph (graph.s0), which runs first
        raise RuntimeError("sim.sK needs the host samples of graph.s0: run shard_graph first")
    host = s.host_samples[0]
    t0 = time.perf_counter()
    sess = HtpSession(cg.ctx_model, c.profile)
    load_s = time.perf_counter() - t0
    x_sim = chain_feeds(io_names(sess.input_names), host, s.produced_sim)
    t1 = time.perf_counter()
    got = sess.run(x_sim)
    run_s = time.perf_counter() - t1
    cpu = cpu_run(qdq_path, chain_feeds(io_names(sess.input_names), host, s.produced_cpu))
    s.produced_sim.update(got)
    s.produced_cpu.update(cpu)
    out = {"load_seconds": round(load_s, 2), "run_seconds": round(run_s, 2)}
    for name in cpu:
        out[f"sqnr_htp_vs_cpu_qdq_db.{name}"] = sqnr_rounded(cpu[name], got[name])
    return True, 0, out


def chain_end_to_end(s: Shards):
    """``chain``: SQNR of the simulator chain vs the CPU EP chain, and of the CPU EP chain vs float (logits, new KV),
    and the top-1 agreement of the two chains' logits."""
    ref, cpu, sim = s.produced_float[0], s.produced_cpu, s.produced_sim
    names = ["logits"] + sorted(x for x in cpu if x.startswith(("k_new_", "v_new_")))
    out: dict[str, Any] = {"bounds": list(s.bounds)}
    for name in names:
        out[f"sqnr_htp_chain_vs_cpu_qdq_chain_db.{name}"] = sqnr_rounded(cpu[name], sim[name])
        out[f"sqnr_cpu_qdq_chain_vs_float_db.{name}"] = sqnr_rounded(ref[name], cpu[name])
    out["top1_htp_chain_eq_cpu_qdq_chain"] = top1_agreement(sim["logits"], cpu["logits"])
    return True, 0, out


def run_sharded(c) -> None:
    """``--shards``: the plan, then per shard k in chain order ``graph.sK``, ``export.sK``, ``qdq.sK``, ``compile.sK``,
    ``sim.sK`` (`shard_graph` .. `shard_sim`); ``budget_refusal`` on the largest shard once all are quantized;
    ``chain`` end to end. Stops at the first step that fails or is refused."""
    from hycoc.passes.slm.graph import FULL, SLIDING

    args, steps = c.args, c.steps
    what = "layer_weight_bytes + plan_shards on the profile's budget"
    bounds = steps.run("shard_plan", lambda: shard_plan(c), what=what)
    if bounds is None:
        return
    c.state["bounds"] = bounds
    keep = synthetic_keep_set(c.keep_n, c.vocab, args.seed)
    s = Shards(bounds, keep, {FULL: args.ring, SLIDING: args.sliding_ring})
    c.say(f"shards: {s.count}, bounds {list(bounds)}")
    lut_bytes = sum(int(v.packed.nbytes) for v in c.state["slm"].luts.values())
    for k in range(s.count):
        tag = f"s{k}"
        c.say(f"shard {k}: layers [{bounds[k]}, {bounds[k + 1]})")
        what = f"SlmTreeGraph shard {k} + the float chain on the samples"
        got = steps.run(f"graph.{tag}", lambda: shard_graph(c, s, k), what=what)
        if got is None:
            return
        g, samples = got
        linear_values = steps.rows[-1]["details"]["linear_values"]
        path = c.work / f"export-{tag}" / f"slm_{tag}.onnx"
        what = f"export_slm_graph shard {k}"
        if steps.run(f"export.{tag}", lambda: shard_export(c, g, samples, path), what=what) is None:
            return
        g = got = None  # the torch shard is not needed past export and calibration
        estimate = qdq_peak_estimate_gib(linear_values, lut_bytes)
        if estimate > args.max_qdq_gib:
            steps.rows.append(refused_row(f"qdq.{tag}", estimate, args.max_qdq_gib))
            return
        what = f"quantize_graph shard {k} (calibrated on the float chain)"
        qres = steps.run(f"qdq.{tag}", lambda: shard_qdq(c, path, samples, tag, estimate), what=what)
        if qres is None:
            return
        s.qdq_paths.append(qres.path)
        if k == s.count - 1:
            what = "limit lowered below the largest shard: refused first"
            steps.run("budget_refusal", lambda: shard_budget_refusal(c, s), what=what)
        if args.skip_compile:
            continue
        what = f"compile_context shard {k}: its own context binary"
        cg = steps.run(f"compile.{tag}", lambda: shard_compile(c, qres.path, tag), what=what)
        if cg is None:
            return
        what = f"shard {k} on the HTP simulator, fed by the simulator chain"
        if steps.run(f"sim.{tag}", lambda: shard_sim(c, s, cg, qres.path), what=what) is None:
            return
    if args.skip_compile:
        return
    what = "end to end: the simulator chain vs the CPU EP chain (and vs float)"
    steps.run("chain", lambda: chain_end_to_end(s), what=what)


def io_names(names):
    """A stand-in graph with ``input_names`` and ``shard`` for `chain_feeds`."""
    from types import SimpleNamespace

    return SimpleNamespace(input_names=list(names), shard="-")
