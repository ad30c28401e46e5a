"""Child process for QNN EP compiles: ``python -m hycoc.targets._qnn_worker JOB.json RESULT.json``.

Jobs (JSON):
- ``{"op": "compile", "graphs": [{"model": path, "ctx_path": path}], "provider_options": {...},
  "share": bool}`` — one EPContext compile per graph with CPU fallback disabled; with ``share`` all graphs go into
  one context binary (``ep.share_ep_contexts=1`` on each session, ``ep.stop_share_ep_contexts=1`` on the last: the
  shared ``.bin`` is written only then). Result: ``{"ok", "graphs": [{"ok", "seconds", "error"}]}``.
- ``{"op": "assign", "model": path, "provider_options": {...}}`` — a diagnostic session with fallback allowed,
  ``offload_graph_io_quantization=0`` and ``session.record_ep_graph_assignment_info=1``; result lists which EP
  got which nodes: ``{"ok", "assignment": [{"ep", "nodes": [[name, op_type], ...]}]}``.
- ``{"op": "probe", "archs": [{"htp_arch", "soc_id", "key"}]}`` — compile a trivial uint16 QDQ MatMul per entry and
  read the arch and SoC back from the binary; results by ``key`` (default: the arch as a string).

The EP's log goes to this process's stderr; the parent parses it for per-node reasons.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _compile(job: dict) -> dict:
    import onnxruntime as ort
    from hycoc.targets.qnn_ep import session_options

    graphs, share = job["graphs"], bool(job.get("share"))
    out: list[dict[str, object]] = []  # per graph: ok, seconds, error (JSON to the parent)
    for i, g in enumerate(graphs):
        cfg = {
            "ep.context_enable": "1",
            "ep.context_file_path": g["ctx_path"],
            "ep.context_embed_mode": "0",
            "session.disable_cpu_ep_fallback": "1",
        }
        if share:
            cfg["ep.share_ep_contexts"] = "1"
            if i == len(graphs) - 1:
                cfg["ep.stop_share_ep_contexts"] = "1"
        t0 = time.perf_counter()
        try:
            so = session_options(job["provider_options"], cfg)
            sess = ort.InferenceSession(g["model"], sess_options=so)
            del sess
            out.append({"ok": True, "seconds": time.perf_counter() - t0, "error": None})
        except Exception as e:  # noqa: BLE001 - reported to the parent
            out.append({"ok": False, "seconds": time.perf_counter() - t0, "error": str(e)})
            return {"ok": False, "graphs": out, "error": str(e), "failed_index": i}
    return {"ok": True, "graphs": out}


def _assign(job: dict) -> dict:
    import onnxruntime as ort
    from hycoc.targets.qnn_ep import session_options

    opts = dict(job["provider_options"], offload_graph_io_quantization="0")
    so = session_options(opts, {"session.record_ep_graph_assignment_info": "1"})
    sess = ort.InferenceSession(job["model"], sess_options=so)
    return {
        "ok": True,
        "assignment": [
            {"ep": sg.ep_name, "nodes": [[n.name, n.op_type] for n in sg.get_nodes()]}
            for sg in sess.get_provider_graph_assignment_info()
        ],
    }


def _tiny_qdq_model(path: Path) -> None:
    """x[1,8] → Q/DQ (uint16) → MatMul with an int8 weight → Q/DQ (uint16); every HTP arch compiles it."""
    import numpy as np
    import onnx
    from hycoc.targets.qdq_matmul import qdq_matmul

    w = np.random.RandomState(0).randint(-127, 128, (8, 8)).astype(np.int8)
    onnx.save(qdq_matmul(w, 1, "probe", w_scale=0.01, node_names=True), path)


def _probe(job: dict) -> dict:
    import onnxruntime as ort
    from hycoc.targets.qnn_ep import read_binary_target, session_options

    res: dict = {}
    with tempfile.TemporaryDirectory(prefix="hycoc-qnn-probe-") as tmp:
        model = Path(tmp) / "probe.onnx"
        _tiny_qdq_model(model)
        for a in job["archs"]:
            arch, soc = a["htp_arch"], a.get("soc_id")
            key = str(a.get("key", arch))
            d = Path(tmp) / f"probe-{len(res)}"
            d.mkdir()
            opts = {"backend_type": "htp", "htp_arch": str(arch)}
            if soc is not None:
                opts["soc_model"] = str(soc)
            t0 = time.perf_counter()
            try:
                so = session_options(
                    opts,
                    {
                        "ep.context_enable": "1",
                        "ep.context_embed_mode": "0",
                        "ep.context_file_path": str(d / "probe_ctx.onnx"),
                        "session.disable_cpu_ep_fallback": "1",
                    },
                )
                ort.InferenceSession(str(model), sess_options=so)
                bins = sorted(d.glob("*.bin"))
                tgt = read_binary_target(bins[0]) if bins else None
                res[key] = {
                    "ok": bool(bins),
                    "seconds": time.perf_counter() - t0,
                    "target": None if tgt is None else tgt.__dict__,
                    "error": None if bins else "no context binary written",
                }
            except Exception as e:  # noqa: BLE001 - reported
                res[key] = {"ok": False, "seconds": time.perf_counter() - t0, "error": str(e)}
    return {"ok": True, "archs": res}


def main(argv: list[str]) -> int:
    job_path, res_path = Path(argv[1]), Path(argv[2])
    job = json.loads(job_path.read_text())
    try:
        result = {"compile": _compile, "assign": _assign, "probe": _probe}[job["op"]](job)
    except Exception as e:  # noqa: BLE001 - reported to the parent
        result = {"ok": False, "error": str(e), "traceback": traceback.format_exc()}
    res_path.write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
