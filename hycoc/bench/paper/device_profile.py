"""Device time in the bench: on-device profiles from Qualcomm AI Hub (`hycoc profile`), or the labelled estimate
(`hycoc.device_time`), priced onto the rounds the bench actually ran (docs/design.md "Targets"; docs/device-time.md).

`profile_bundle` submits, per graph of an htp or qai-hub bundle, one AI Hub inference job with ``profile=True``
(qai-hub 0.56: ``submit_inference_job(model, device, inputs, profile=True, options)``; ``submit_profile_job`` is
deprecated) on the bundle's own context binary (a qai-hub bundle's: the link job's model already on AI Hub; an
htp-v81 bundle's: uploaded once; ``--qnn_options context_enable_graphs=NAME`` picks the graph, NAME the EPContext
node's ``partition_name``), downloads each profile (``job.download_profile()``) and
writes ``device_profile.json`` (`PROFILE_FILE`):

    {"kind": "profile", "device": NAME, "bundle": PATH, "graphs": {GRAPH: {"job": ID, "execute_ms_median",
     "execute_ms_p90", "runs", "peak_memory_bytes", "top_ops": [{"type", "ms", "share"}]}}}

Inputs (`profile_inputs`): the bundle keeps no calibration samples, so each input is drawn inside the range its
calibrated encoding in the manifest covers (fixed seed): a mask half visible (0) and half hidden (-1e4, the fixed
mask range), rotary rows as cos/sin of random angles, integer inputs 0. A static integer graph's NPU time does not
depend on the values it reads.

`project_records` prices each bench record: per request, the graph calls its rounds ran (``draft_calls``, counted
by the runtime) times each graph's device ms, plus the host work measured here (``draft_ms - draft_graph_ms``);
the SLM's request-start fill likewise. It reports, per configuration, the phone's draft ms per round and per token
and the delivery tok/s with the CPU's drafting time replaced by the phone's (server, link and waits as measured).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

PROFILE_FILE = "device_profile.json"


class DeviceProfileError(RuntimeError):
    """A bundle that cannot be profiled (a cpu bundle), a failed job, or an unreadable profile file."""


# ---- inputs --------------------------------------------------------------------------------------------------------


def _encoded_range(enc) -> tuple[float, float]:
    lo = {"uint8": 0, "uint16": 0, "int8": -128, "int16": -32768, "uint4": 0, "int4": -8}.get(enc.dtype, 0)
    hi = {"uint8": 255, "uint16": 65535, "int8": 127, "int16": 32767, "uint4": 15, "int4": 7}.get(enc.dtype, 255)
    return enc.scale * (lo - enc.zero_point), enc.scale * (hi - enc.zero_point)


def profile_inputs(entry, seed: int = 0) -> dict[str, np.ndarray]:
    """One input set for graph ``entry`` (`hycoc.bundle.GraphEntry`) at its declared shapes and dtypes (module
    docstring)."""
    rs = np.random.RandomState(seed)
    out = {}
    for spec in entry.inputs:
        shape, dtype = tuple(spec.shape), np.dtype(spec.dtype)
        if dtype.kind in "iu":
            out[spec.name] = np.zeros(shape, dtype)
        elif spec.name.startswith("mask"):
            m = np.zeros(shape, np.float32)
            m[..., shape[-1] // 2 :] = -1e4
            out[spec.name] = m
        elif spec.name.startswith(("cos", "sin")):
            angle = rs.uniform(0, 2 * np.pi, shape)
            out[spec.name] = (np.cos(angle) if spec.name.startswith("cos") else np.sin(angle)).astype(np.float32)
        elif spec.encoding is not None:
            lo, hi = _encoded_range(spec.encoding)
            out[spec.name] = rs.uniform(lo, hi, shape).astype(np.float32)
        else:
            out[spec.name] = rs.standard_normal(shape).astype(np.float32)
    return out


# ---- profiling on AI Hub -------------------------------------------------------------------------------------------


def summarize_profile(profile: Mapping[str, Any], top: int = 5) -> dict:
    """The summary of one ``InferenceJob.download_profile()`` dict: execute ms median / p90 over the profiled runs
    (``all_inference_times``, µs; ``estimated_inference_time`` when AI Hub gives no list), runs, peak memory (bytes,
    ``estimated_inference_peak_memory``), and the ``top`` op types by summed layer ``execution_time`` (µs -> ms, share
    of the layers' total). Raises DeviceProfileError when the profile has no execution time."""
    s = profile.get("execution_summary") or {}
    times = [t for t in (s.get("all_inference_times") or []) if t]
    if not times and s.get("estimated_inference_time"):
        times = [s["estimated_inference_time"]]
    if not times:
        raise DeviceProfileError("the AI Hub profile has no inference time (execution_summary is empty)")
    ms = sorted(t / 1000.0 for t in times)
    p90 = ms[min(len(ms) - 1, int(round(0.9 * (len(ms) - 1))))]
    by_type: dict[str, float] = {}
    for layer in profile.get("execution_detail") or []:
        if "execution_time" in layer:
            by_type[layer.get("type") or "?"] = by_type.get(layer.get("type") or "?", 0.0) + layer["execution_time"]
    total = sum(by_type.values()) or 1.0
    ops = sorted(by_type.items(), key=lambda kv: -kv[1])[:top]
    peak = s.get("estimated_inference_peak_memory")
    return {
        "execute_ms_median": round(statistics.median(ms), 4),
        "execute_ms_p90": round(p90, 4),
        "runs": len(ms),
        "peak_memory_bytes": int(peak) if isinstance(peak, (int, float)) else None,
        "top_ops": [{"type": t, "ms": round(us / 1000.0, 4), "share": round(us / total, 4)} for t, us in ops],
    }


def _partition_name(ctx_model: Path) -> str:
    import onnx

    m = onnx.load(str(ctx_model), load_external_data=False)
    for n in m.graph.node:
        if n.op_type == "EPContext":
            for a in n.attribute:
                if a.name == "partition_name":
                    return onnx.helper.get_attribute_value(a).decode()
    raise DeviceProfileError(f"{ctx_model.name}: no EPContext node with a partition_name")


def _hub_model(hub: Any, manifest, binary: Path) -> Any:
    """The AI Hub model of a bundle's context binary: for a qai-hub bundle the link job's own target model
    (``hub.get_job(link_job).get_target_model()``, nothing uploaded again), else ``hub.upload_model(binary)``."""
    info = getattr(manifest.target, "hub", None)
    if info is not None:
        model = hub.get_job(info.link_job).get_target_model()
        if model is not None:
            return model
    return hub.upload_model(str(binary))


def profile_bundle(
    bundle_dir: str | os.PathLike,
    device: str,
    *,
    hub: Any = None,
    out: str | os.PathLike | None = None,
    graphs: Sequence[str] | None = None,
    on_job=None,
) -> dict:
    """Profile every graph of an htp / qai-hub bundle on AI Hub ``device`` and write ``out`` (default
    ``BUNDLE/device_profile.json``) atomically; returns its dict (module docstring). ``hub``: the qai_hub module or
    a ``qai_hub.Client`` (`hycoc.targets.qai_hub.check_setup` when None, so a missing token fails before any
    upload). ``on_job(graph, job_id)`` is told of each job. Raises QaiHubSetupError, QaiHubDeviceError,
    DeviceProfileError (cpu bundle, failed job, empty profile)."""
    from hycoc.bundle import load_manifest
    from hycoc.targets.qai_hub import check_setup, hub_device, resolve_device

    bundle_dir = Path(bundle_dir)
    manifest = load_manifest(bundle_dir)
    if manifest.target.backend != "htp":
        raise DeviceProfileError(
            f"{bundle_dir}: built for target {manifest.target.name}, which has no context binaries to profile: "
            "profile needs an htp-* or qai-hub bundle; build one with `hycoc build RECIPE --target htp-v81` "
            "(or --device NAME, or --target qai-hub)"
        )
    hub = check_setup() if hub is None else hub
    dev = resolve_device(hub, device, manifest.target.htp_arch)
    uploaded: dict[str, Any] = {}
    result: dict[str, Any] = {
        "kind": "profile",
        "device": dev.name,
        "device_validated": dev.validated,
        "bundle": str(bundle_dir),
        "source": "AI Hub inference jobs with profile=True",
        "graphs": {},
    }
    for entry in manifest.graphs:
        if graphs is not None and entry.name not in graphs:
            continue
        if entry.context_binary is None:
            raise DeviceProfileError(f"graph {entry.name} has no context binary")
        if entry.context_binary not in uploaded:
            uploaded[entry.context_binary] = _hub_model(hub, manifest, bundle_dir / entry.context_binary)
        name = _partition_name(bundle_dir / entry.file)
        inputs = {k: [v] for k, v in profile_inputs(entry).items()}
        job = hub.submit_inference_job(
            uploaded[entry.context_binary],
            device=hub_device(dev.name),
            inputs=inputs,
            name=f"hycoc-profile-{entry.name}",
            profile=True,
            options=f"--qnn_options context_enable_graphs={name}",
        )
        if on_job:
            on_job(entry.name, str(job.job_id))
        status = job.wait()
        if not status.success:
            raise DeviceProfileError(
                f"AI Hub inference job {job.job_id} (graph {entry.name}) failed: "
                f"{getattr(status, 'message', None) or status.code}"
            )
        summary = summarize_profile(job.download_profile())
        result["graphs"][entry.name] = {"job": str(job.job_id), **summary}
    target = Path(out) if out is not None else bundle_dir / PROFILE_FILE
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.")
    os.chmod(tmp, 0o644)  # mkstemp makes 0600
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    os.replace(tmp, target)
    return result


# ---- device ms per graph call: profile or estimate -----------------------------------------------------------------


def load_device_costs(path: str | os.PathLike) -> tuple[dict[str, float], str]:
    """(graph -> device ms per call, label) from a ``device_profile.json``; the median execute time. Raises
    DeviceProfileError naming the file when it is not one."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        costs = {g: float(v["execute_ms_median"]) for g, v in data["graphs"].items()}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise DeviceProfileError(
            f"--device-profile {path}: not a device_profile.json written by `hycoc profile` ({e})"
        ) from None
    return costs, f"profiled on {data.get('device', '?')} (AI Hub, median execute time per call)"


def estimated_device_costs(bundle_dir: str | os.PathLike, npu: int | str | None = None) -> tuple[dict[str, float], str]:
    """(graph -> estimated device ms per call, label) from the bundle's own bytes and MACs and the NPU profile of
    ``npu`` (a Hexagon arch: 81, "v81"; default: the bundle's target arch, v81 — the paper's phone — for a cpu
    bundle). Raises DeviceProfileError "device-time estimate not fitted for vXX ..." for an arch without fitted
    constants (`hycoc.device_time.npu_profile`)."""
    from hycoc.device_time import ESTIMATE_LABEL, NotFittedError, bundle_graph_costs, npu_profile

    if npu is None:
        target = json.loads((Path(bundle_dir) / "manifest.json").read_text(encoding="utf-8")).get("target") or {}
        npu = target.get("htp_arch") or 81
    try:
        profile = npu_profile(npu)
    except NotFittedError as e:
        raise DeviceProfileError(str(e)) from None
    return (
        {g: profile.call_ms(c) for g, c in bundle_graph_costs(bundle_dir).items()},
        f"{ESTIMATE_LABEL}, NPU profile {profile.name}",
    )


def call_ms(name: str, costs: Mapping[str, float]) -> float:
    """Device ms of one call of runtime graph ``name``: its own entry, or the sum of its layer shards
    (``slm`` -> ``slm.s0`` + ``slm.s1`` + ...). Raises DeviceProfileError when neither is priced."""
    if name in costs:
        return costs[name]
    shards = [v for k, v in costs.items() if k.startswith(name + ".s")]
    if shards:
        return sum(shards)
    raise DeviceProfileError(f"no device time for graph {name} (priced: {', '.join(sorted(costs))})")


def project_records(records: Sequence[Mapping], costs: Mapping[str, float]) -> dict[str, dict]:
    """Per configuration: the phone's draft ms per round and per token, host ms per round (measured here), and the
    delivery tok/s with the CPU's drafting and SLM fill replaced by the phone's (module docstring). Records without
    ``draft_calls`` (older benches) are skipped."""
    per: dict[str, dict] = {}
    for r in records:
        if "draft_calls" not in r:
            continue
        d = per.setdefault(
            r["config"],
            {
                "rounds": 0,
                "tokens": 0,
                "phone_draft_ms": 0.0,
                "host_ms": 0.0,
                "cpu_draft_ms": 0.0,
                "phone_seconds": 0.0,
                "cpu_seconds": 0.0,
                "calls": {},
            },
        )
        graph_ms = sum(n * call_ms(g, costs) for g, n in r["draft_calls"].items())
        host = max(0.0, float(r["draft_ms"]) - float(r.get("draft_graph_ms") or 0.0))
        fill = sum(n * call_ms(g, costs) for g, n in (r.get("prefill_calls") or {}).items())
        fill += max(0.0, float(r.get("slm_prefill_ms") or 0.0) - float(r.get("slm_prefill_graph_ms") or 0.0))
        phone_draft = graph_ms + host
        d["rounds"] += int(r["rounds"])
        d["tokens"] += int(r["tokens"])
        d["phone_draft_ms"] += phone_draft
        d["host_ms"] += host
        d["cpu_draft_ms"] += float(r["draft_ms"])
        d["cpu_seconds"] += float(r["seconds"])
        d["phone_seconds"] += (
            float(r["seconds"])
            - float(r["draft_ms"]) / 1000
            + phone_draft / 1000
            - float(r.get("slm_prefill_ms") or 0.0) / 1000
            + fill / 1000
        )
        for g, n in r["draft_calls"].items():
            d["calls"][g] = d["calls"].get(g, 0) + int(n)
    out = {}
    for config, d in per.items():
        rounds, tokens = max(d["rounds"], 1), max(d["tokens"], 1)
        out[config] = {
            "rounds": d["rounds"],
            "tokens": d["tokens"],
            "calls_per_round": {g: round(n / rounds, 3) for g, n in sorted(d["calls"].items())},
            "phone_draft_ms_per_round": round(d["phone_draft_ms"] / rounds, 3),
            "phone_draft_ms_per_token": round(d["phone_draft_ms"] / tokens, 3),
            "host_ms_per_round": round(d["host_ms"] / rounds, 3),
            "cpu_draft_ms_per_round": round(d["cpu_draft_ms"] / rounds, 3),
            "phone_tok_per_s": round(d["tokens"] / d["phone_seconds"], 3) if d["phone_seconds"] > 0 else None,
            "cpu_tok_per_s": round(d["tokens"] / d["cpu_seconds"], 3) if d["cpu_seconds"] > 0 else None,
        }
    return out


def bundle_allowance_rounds(
    bundle_dir: str | os.PathLike, costs: Mapping[str, float], host_ms_per_slm_pass: float = 0.0
) -> list[dict]:
    """The phone's drafting ms of one HyCo round at each allowance (1 .. B + 1 rows) for a bundle:
    `hycoc.device_time.allowance_round_ms` with the bundle's round constants (K, D, B, ``slm_passes``), its SLM tree
    graph's rows, and ``costs`` (graph -> device ms per call: `load_device_costs` or `estimated_device_costs`; a
    sharded SLM's shards summed, `call_ms`). host_ms_per_slm_pass: host work per SLM pass (the fitted estimate's
    `hycoc.device_time.NpuProfile.host_ms_per_slm_pass`, or 0 for graph time alone). Raises DeviceProfileError when a
    graph is not priced."""
    from hycoc.bundle import load_manifest
    from hycoc.device_time import allowance_round_ms

    m = load_manifest(Path(bundle_dir))
    r = m.round
    slm_rows = int(next(t.shape[1] for t in m.chain_entry("slm").inputs if t.name == "inputs_embeds"))
    return allowance_round_ms(
        call_ms("head", costs),
        call_ms("slm", costs),
        chain_length=r.chain_length,
        sibling_depth=r.sibling_depth,
        tree_rows=r.node_budget + 1,
        slm_rows=slm_rows,
        slm_passes=r.slm_passes,
        host_ms_per_slm_pass=host_ms_per_slm_pass,
    )


def profile_table(result: Mapping[str, Any]):
    """`profile_bundle`'s result as a `hycoc.bench.tables.TextTable`: per graph its AI Hub job, median and p90
    execute ms, runs, peak MB and its three costliest op types."""
    from hycoc.bench.tables import TextTable

    rows = []
    for g, v in result["graphs"].items():
        ops = ", ".join(f"{o['type']} {o['ms']:.2f}" for o in v["top_ops"][:3])
        peak = "-" if v["peak_memory_bytes"] is None else f"{v['peak_memory_bytes'] / 1e6:.1f}"
        rows.append(
            [g, v["job"], f"{v['execute_ms_median']:.3f}", f"{v['execute_ms_p90']:.3f}", str(v["runs"]), peak, ops]
        )
    return TextTable(
        title=f"device profile on {result['device']} (AI Hub)",
        headers=["graph", "job", "execute ms median", "p90", "runs", "peak MB", "top ops (ms)"],
        rows=rows,
        justify=["left", "left", "right", "right", "right", "right", "left"],
    )


def device_table(projection: Mapping[str, dict], label: str):
    """The per-configuration device-time table (`project_records`) as a `hycoc.bench.tables.TextTable`, titled with
    where the graph costs came from; configurations in the main table's order (paper Table 5)."""
    from hycoc.bench.paper.stats import table5_order as _order
    from hycoc.bench.tables import TextTable

    def num(x):
        return "–" if x is None else f"{x:.1f}"

    rows = []
    for config in _order(projection):
        p = projection[config]
        rows.append(
            [
                config,
                ", ".join(f"{g} {n:g}" for g, n in p["calls_per_round"].items()),
                num(p["phone_draft_ms_per_round"]),
                num(p["phone_draft_ms_per_token"]),
                num(p["host_ms_per_round"]),
                num(p["cpu_draft_ms_per_round"]),
                num(p["phone_tok_per_s"]),
                num(p["cpu_tok_per_s"]),
            ]
        )
    return TextTable(
        title=f"device time per round: graph costs {label}; host work as measured on this CPU",
        headers=[
            "config",
            "calls / round",
            "phone draft ms / round",
            "phone draft ms / token",
            "host ms / round",
            "CPU draft ms / round",
            "phone tok/s",
            "CPU tok/s",
        ],
        rows=rows,
        justify=["left", "left"] + ["right"] * 6,
    )


def render_device_table(projection: Mapping[str, dict], label: str, console, fmt: str = "table") -> None:
    """Print `device_table` on a rich Console (``fmt``: `hycoc.bench.tables.FORMATS`; "table" splits it to the
    console's width, configuration names whole)."""
    from hycoc.bench.tables import print_tables

    print_tables([device_table(projection, label)], console, fmt)
