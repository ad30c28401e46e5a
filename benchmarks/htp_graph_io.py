"""Three questions about a drafter graph on the QNN HTP backend, answered on the x86 HTP simulator with toy
context binaries (onnxruntime-qnn; the simulator is a functional emulator: its times are host work, not device time).

    python benchmarks/htp_graph_io.py unrequested [--vocab 8192 --rows 32 --reps 20]
    python benchmarks/htp_graph_io.py ties [--vocab 512 --rows 32]
    python benchmarks/htp_graph_io.py quantized-io BUNDLE      # a cpu bundle's slm graph, float vs uint16 KV IO

``unrequested``: does an output the caller does not ask for cost anything? The toy is a drafter tail as the build
makes it: ``x`` (1, R, 64) float -> MatMul (64 x V, int8 weights) -> ``logits`` (1, R, V), A16 QDQ
(`hycoc.passes.qdq.quantize.quantize_graph`), then `hycoc.passes.topk_outputs.append_topk` (k = 8, with log q). Two
compiles of it for htp-v81: one that keeps ``logits`` as a graph output (what the bundles shipped), one without it.
It prints the EPContext node's outputs (an EPContext node computes all of them on every call) and the time per call
of (a) the graph with ``logits`` asked only for ``top_index``/``top_logq``, (b) the same asked for ``logits`` too,
(c) the graph without the output; and checks that (a) and (c) give the same top-k.

``ties``: the top-k order among equal values, HTP simulator against the CPU EP. Rows of logits with ties built on
purpose (runs of equal values at the top, ties at the k-th place, a whole row equal) go through the tail in two
forms: 16-bit (``Q -> DQ`` at uint16 then TopK, as the drafter graphs end) and fp16 (the float tail, which the HTP
runs in fp16). Prints, per form, how many rows' ``top_index`` differ from the CPU EP's (ONNX TopK: the lower index
first among equals) and an example.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from hycoc.targets.float_graph import float_model


def _save(model, path: Path) -> Path:
    import onnx

    onnx.save(model, str(path))
    return path


def tail_graph(rows: int, vocab: int, hidden: int, seed: int = 0):
    """Float graph x (1, R, hidden) -> MatMul(W hidden x vocab, int8 x per-channel scale) -> logits (1, R, V)."""
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(seed)
    q = rng.integers(-127, 128, (hidden, vocab)).astype(np.int8)
    s = (rng.random(vocab) * 0.01 + 0.005).astype(np.float32)
    w = q.astype(np.float32) * s[None]
    m = float_model(
        [h.make_node("MatMul", ["x", "w"], ["logits"], name="lm_head")],
        "tail",
        ("x", [1, rows, hidden]),
        ("logits", [1, rows, vocab]),
        [nh.from_array(w, "w")],
    )
    return m, (q.T.copy(), s, 8)


def drop_output(model, name: str):
    import onnx

    m = onnx.ModelProto()
    m.CopyFrom(model)
    keep = [o for o in m.graph.output if o.name != name]
    del m.graph.output[:]
    m.graph.output.extend(keep)
    return m


def _timed(session, names, feeds, reps):
    session.run(names, feeds)
    t0 = time.perf_counter()
    for _ in range(reps):
        out = session.run(names, feeds)
    return (time.perf_counter() - t0) / reps, out


def unrequested(args) -> int:
    import onnx
    import onnxruntime as ort
    from hycoc.passes.qdq.quantize import quantize_graph
    from hycoc.passes.topk_outputs import append_topk
    from hycoc.targets.htp import compile_context
    from hycoc.targets.profiles import get_profile

    tmp = Path(tempfile.mkdtemp(prefix="hycoc-htp-io-"))
    model, weights = tail_graph(args.rows, args.vocab, 64)
    rng = np.random.default_rng(1)
    samples = [{"x": rng.standard_normal((1, args.rows, 64)).astype(np.float32)} for _ in range(4)]
    _save(model, tmp / "tail.onnx")
    # weights given as the integers the MatMul was made of (q (V, 64), scale (V,)): bit-exact per-channel int8
    # Q/DQ, as the drafter graphs' output layers
    res = quantize_graph(
        tmp / "tail.onnx", samples, tmp / "qdq", percentile=99.99, report_sqnr=False, weight_arrays={"w": weights}
    )
    qdq = append_topk(onnx.load(str(res.path)), 8, with_logq=True)
    keep = _save(qdq, tmp / "with_logits.onnx")
    drop = _save(drop_output(qdq, "logits"), tmp / "without_logits.onnx")
    v81 = get_profile("htp-v81")
    a = compile_context(keep, tmp / "a", v81, graph_name="with_logits")
    c = compile_context(drop, tmp / "c", v81, graph_name="without_logits")
    for cg in (a, c):
        m = onnx.load(str(cg.ctx_model), load_external_data=False)
        ep = [n for n in m.graph.node if n.op_type == "EPContext"]
        others = sorted({n.op_type for n in m.graph.node if n.op_type != "EPContext"})
        print(
            f"{cg.name}: EPContext outputs {[list(n.output) for n in ep]}, other nodes {others}, "
            f"binary {cg.binary_bytes:,} B"
        )
    feeds = samples[0]
    want = ["top_index", "top_logq"]
    cpu = ort.InferenceSession(str(keep), providers=["CPUExecutionProvider"])
    ref = cpu.run(want, feeds)
    logits_bytes = args.rows * args.vocab * 4
    print(
        f"rows {args.rows}, vocab {args.vocab}: logits output {logits_bytes:,} B float32 per call; "
        f"load {open('/proc/loadavg').read().split()[0]}"
    )
    runs = {}
    for label, cg, fetch in (
        ("(a) with logits, top-k only fetched", a, want),
        ("(b) with logits, logits fetched too", a, want + ["logits"]),
        ("(c) without logits", c, want),
    ):
        seconds, out, sizes = _profiled(cg.ctx_model, fetch, feeds, args.reps, tmp / f"prof_{cg.name}_{len(fetch)}")
        runs[label] = out
        print(
            f"{label:38s} {seconds * 1e3:9.2f} ms/call (simulator, not device time); EPContext node output "
            f"bytes per call (onnxruntime profiler): {sizes}"
        )
    out_a, out_c = runs["(a) with logits, top-k only fetched"], runs["(c) without logits"]
    same = all(np.array_equal(out_a[n], out_c[n]) for n in want)
    print(
        f"top_index/top_logq (a) == (c): {same}; (c) top_index == CPU EP's on "
        f"{np.mean(out_c['top_index'] == ref[0]):.1%} of entries"
    )
    return 0


def _profiled(ctx_model, fetch, feeds, reps, prefix):
    """(seconds per call, outputs, output bytes the EPContext node wrote per call) with onnxruntime's profiler on."""
    import json

    import onnxruntime as ort
    from hycoc.targets.profiles import get_profile
    from hycoc.targets.qnn_ep import session_options

    so = session_options(get_profile("htp-v81").provider_options(), {"session.disable_cpu_ep_fallback": "1"}, 3)
    so.enable_profiling = True
    so.profile_file_prefix = str(prefix)
    session = ort.InferenceSession(str(ctx_model), sess_options=so)
    seconds, out = _timed(session, fetch, feeds, reps)
    events = json.loads(Path(session.end_profiling()).read_text())
    sizes = sorted(
        {
            int(e["args"]["output_size"])
            for e in events
            if e.get("cat") == "Node" and "output_size" in e.get("args", {}) and e["name"].endswith("kernel_time")
        }
    )
    return seconds, dict(zip(fetch, out)), sizes


def tie_rows(rows: int, vocab: int, k: int, scale: float, seed: int = 0) -> np.ndarray:
    """float32 (1, rows, vocab) logits, each row on the 16-bit grid of ``scale`` (so quantizing keeps the values
    and their ties exactly), with ties placed on purpose: row kinds cycle through (0) a run of equal maxima at
    scattered indices, (1) a tie across the k-th place, (2) a whole row equal, (3) pairs of equal values everywhere,
    (4) values that differ by one 16-bit step but are equal in fp16."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal((rows, vocab)) * 2.0 / scale) * scale
    for r in range(rows):
        kind = r % 5
        if kind == 0:
            idx = rng.choice(vocab, 6, replace=False)
            x[r, idx] = x[r].max() + 5 * scale
        elif kind == 1:
            top = np.sort(x[r])[::-1]
            idx = rng.choice(np.flatnonzero(x[r] < top[k]), 4, replace=False)
            x[r, idx] = top[k - 1]
        elif kind == 2:
            x[r] = 3 * scale * 100
        elif kind == 3:
            x[r, 1::2] = x[r, 0::2][: vocab // 2]
        else:
            base = np.round(6.0 / scale) * scale  # fp16 spacing at 6 is 2^-8 * 4 = 0.0039: several steps
            idx = rng.choice(vocab, 8, replace=False)
            x[r, idx] = base + np.arange(8) * scale
    return x[None].astype(np.float32)


def _tail(rows, vocab, k, quantized: bool, scale: float):
    from hycoc.passes.topk_outputs import append_topk
    from onnx import helper as h
    from onnx import numpy_helper as nh

    nodes, inits = [], []
    if quantized:
        inits = [nh.from_array(np.array(scale, np.float32), "s"), nh.from_array(np.array(32768, np.uint16), "zp")]
        nodes = [
            h.make_node("QuantizeLinear", ["x", "s", "zp"], ["xq"]),
            h.make_node("DequantizeLinear", ["xq", "s", "zp"], ["logits"]),
        ]
    else:
        nodes = [
            h.make_node("Identity", ["x"], ["x1"]),
            h.make_node("Relu", ["x1"], ["x2"]),
            h.make_node("Sub", ["x1", "x2"], ["x3"]),
            h.make_node("Add", ["x2", "x3"], ["logits"]),
        ]
    m = float_model(nodes, "ties", ("x", [1, rows, vocab]), ("logits", [1, rows, vocab]), inits)
    return drop_output(append_topk(m, k, with_logq=False), "logits")


def topk_on_codes(model, scale: float, zero_point: int) -> None:
    """Put a uint16 Q -> DQ pair (``scale``, ``zero_point``) on each TopK's data input and values output, so the QNN
    EP takes the TopK as a quantized node unit (ranked on 16-bit codes, not on fp16 values)."""
    from onnx import helper as h
    from onnx import numpy_helper as nh

    g = model.graph
    g.initializer.extend(
        [nh.from_array(np.array(scale, np.float32), "tq_s"), nh.from_array(np.array(zero_point, np.uint16), "tq_zp")]
    )
    nodes = []
    for n in g.node:
        if n.op_type != "TopK":
            nodes.append(n)
            continue
        x, values = n.input[0], n.output[0]
        nodes += [
            h.make_node("QuantizeLinear", [x, "tq_s", "tq_zp"], [f"{x}_tq"]),
            h.make_node("DequantizeLinear", [f"{x}_tq", "tq_s", "tq_zp"], [f"{x}_tdq"]),
        ]
        n.input[0] = f"{x}_tdq"
        n.output[0] = f"{values}_raw"
        nodes += [
            n,
            h.make_node("QuantizeLinear", [f"{values}_raw", "tq_s", "tq_zp"], [f"{values}_tq"]),
            h.make_node("DequantizeLinear", [f"{values}_tq", "tq_s", "tq_zp"], [values]),
        ]
    del g.node[:]
    g.node.extend(nodes)


def ties(args) -> int:
    import onnxruntime as ort
    from hycoc.passes.topk_outputs import htp_tie_order
    from hycoc.targets.htp import HtpSession, compile_context
    from hycoc.targets.profiles import get_profile

    tmp = Path(tempfile.mkdtemp(prefix="hycoc-htp-ties-"))
    k, scale = args.k, 2.0**-9
    x = tie_rows(args.rows, args.vocab, k, scale)
    forms = [
        ("16-bit (uint16 Q/DQ -> TopK)", True, False, False),
        ("fp16 (float tail)", False, False, False),
        ("16-bit, htp_tie_order", True, True, False),
        ("fp16, htp_tie_order", False, True, False),
        ("16-bit, TopK on uint16 codes", True, False, True),
        ("16-bit, TopK on uint16 codes + htp_tie_order", True, True, True),
    ]
    if args.forms:
        forms = [f for i, f in enumerate(forms) if str(i) in args.forms.split(",")]
    for label, quantized, ordered, codes in forms:
        tag = f"{int(quantized)}{int(ordered)}{int(codes)}"
        model = _tail(args.rows, args.vocab, k, quantized, scale)
        path = _save(model, tmp / f"ties_{tag}.onnx")
        cpu = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(["top_index"], {"x": x})[0]
        if ordered:
            htp_tie_order(model)
        if codes:
            topk_on_codes(model, scale, 32768)
        if ordered or codes:
            path = _save(model, tmp / f"ties_{tag}_htp.onnx")
        cg = compile_context(path, tmp / f"c{tag}", get_profile("htp-v81"), graph_name=f"ties{tag}")
        htp = HtpSession(cg.ctx_model).session.run(["top_index"], {"x": x})[0]
        diff = [r for r in range(args.rows) if not np.array_equal(cpu[0, r], htp[0, r])]
        # the CPU EP's rule (value descending, lower index first among equals) on the values rounded to fp16
        x16 = x[0].astype(np.float16).astype(np.float32)
        rule16 = np.argsort(-x16, axis=-1, kind="stable")[:, :k]
        off16 = [r for r in range(args.rows) if not np.array_equal(rule16[r], htp[0, r])]
        # where the orders differ, are the two values within one fp16 step of each other (a tie fp16 made)?
        gap = [
            abs(float(x[0, r, i]) - float(x[0, r, j])) / float(np.spacing(np.float16(abs(x[0, r, i]))))
            for r in diff
            for i, j in zip(cpu[0, r], htp[0, r])
            if i != j
        ]
        sets = [r for r in diff if set(cpu[0, r]) != set(htp[0, r])]
        print(
            f"{label}: {len(diff)} of {args.rows} rows differ in top-{k} order from the CPU EP "
            f"({len(sets)} in the chosen set); row kinds of those: {sorted(r % 5 for r in diff)}; "
            f"{len(off16)} rows differ from lower-index-first on the fp16-rounded values; largest gap between "
            f"the values at a differing place: {max(gap, default=0):.2f} fp16 steps"
        )
        for r in diff[:2]:
            print(
                f"  row {r} (kind {r % 5}): cpu {cpu[0, r].tolist()} htp {htp[0, r].tolist()} values "
                f"cpu {x[0, r, cpu[0, r]].tolist()} htp {x[0, r, htp[0, r]].tolist()}"
            )
    return 0


def quantized_io(args) -> int:
    """A cpu bundle's ``slm`` QDQ graph compiled for htp-v81 twice, with float32 KV IO and with uint16 KV IO
    (`hycoc.passes.graph_io.quantize_kv_io`), run on the simulator on the same inputs (float rings, and their codes
    by `hycoc.runtime.graphs.quantize`): prints whether the outputs agree code for code."""
    import onnx
    from hycoc.passes.graph_io import ship_graph
    from hycoc.runtime.graphs import dequantize, quantize
    from hycoc.targets.htp import HtpSession, compile_context
    from hycoc.targets.profiles import get_profile

    from hycoc.bundle import load_manifest

    m = load_manifest(args.bundle)
    g = m.graph("slm")
    src = args.bundle / g.file
    tmp = Path(tempfile.mkdtemp(prefix="hycoc-htp-qio-"))
    import shutil

    model = onnx.load(str(src), load_external_data=False)
    for rel in {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}:
        shutil.copy2(args.bundle / rel, tmp / rel)  # the weights beside both copies (relative paths only)
    onnx.save(model, str(tmp / "float_io.onnx"))
    ship_graph(model, quantized_io=True)
    onnx.save(model, str(tmp / "uint16_io.onnx"))
    v81 = get_profile("htp-v81")
    rng = np.random.default_rng(0)
    feeds = {}
    for t in g.inputs:
        if t.name.startswith("mask_"):
            x = np.where(rng.random(t.shape) < 0.5, 0.0, -1e4).astype(np.float32)
        elif t.name.startswith(("cos_", "sin_")):
            x = np.cos(rng.uniform(0, 6.3, t.shape)).astype(np.float32)
        else:
            x = rng.standard_normal(t.shape).astype(np.float32)
        if t.encoding is not None and t.name.startswith(("k_ring_", "v_ring_")):
            x = dequantize(quantize(x, t.encoding), t.encoding)  # a ring holds values of its grid
        feeds[t.name] = x
    enc = {t.name: t.encoding for t in g.inputs + g.outputs}
    outs = {}
    for label in ("float_io", "uint16_io"):
        t0 = time.perf_counter()
        cg = compile_context(tmp / f"{label}.onnx", tmp / label, v81, graph_name=label)
        sess = HtpSession(cg.ctx_model)
        x = {
            n: (quantize(v, enc[n]) if label == "uint16_io" and n.startswith(("k_ring_", "v_ring_")) else v)
            for n, v in feeds.items()
        }
        outs[label] = sess.run(x)
        types = {i.name: i.type for i in sess.session.get_inputs() if "ring" in i.name}
        print(
            f"{label}: compiled and ran in {time.perf_counter() - t0:.1f} s; ring input types "
            f"{sorted(set(types.values()))}"
        )
    a, b = outs["float_io"], outs["uint16_io"]
    for name in sorted(a):
        if name.startswith(("k_new_", "v_new_")):
            same = np.array_equal(quantize(a[name], enc[name]), b[name])
        else:
            same = np.array_equal(a[name], b[name])
        print(
            f"  {name}: {'equal' if same else 'DIFFERENT'}"
            + ("" if same else f" (max |diff| {np.max(np.abs(np.subtract(a[name], b[name], dtype=np.float64))):.3g})")
        )
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=("unrequested", "ties", "quantized-io"))
    ap.add_argument("bundle", type=Path, nargs="?", help="quantized-io: a cpu bundle (its slm graph)")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=None)
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--forms", default="", help="ties: comma-separated form numbers to run (default all)")
    args = ap.parse_args(argv)
    if args.cmd == "unrequested":
        args.vocab = args.vocab or 8192
        return unrequested(args)
    if args.cmd == "quantized-io":
        if args.bundle is None:
            ap.error("quantized-io needs a cpu bundle")
        return quantized_io(args)
    args.vocab = args.vocab or 512
    return ties(args)


if __name__ == "__main__":
    sys.exit(main())
