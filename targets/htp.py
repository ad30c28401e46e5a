"""The ``htp-*`` targets: QDQ ONNX → EPContext ONNX + QNN HTP context binary, via onnxruntime-qnn
(docs/design.md "Targets").

What :func:`compile_context` does, in order, before the EP sees the model (steps 1-3: `hycoc.targets.htp_checks`):

1. static shapes: every graph input needs fixed dims (the QNN EP does not take dynamic shapes);
2. capability check against the :class:`~hycoc.targets.profiles.TargetProfile`: 16-bit activations on a profile
   with ``supports_16bit_ops=False``, 4-bit weights on one without int4, op types outside
   ``supported_op_types`` → :class:`~hycoc.targets.htp_checks.CapabilityError` (a compile-time refusal, never a
   silent precision change);
3. host-only patterns (``profile.host_only``): an embedding lookup (Gather on a constant table indexed by an
   integer graph input) is refused with :class:`HostOnlyError` naming the nodes — hycoc keeps embeddings as host
   LUTs (docs/design.md "SLM Drafter");
4. static-graph check (:func:`hycoc.targets.static_shape_check.check_static_graph`): data-dependent KV slicing
   (a Slice/Gather whose starts/indices come from a graph input) or a fused attention op (ONNX ``Attention``,
   ``com.microsoft`` ``MultiHeadAttention``/``GroupQueryAttention``...) → ``StaticGraphError`` listing the nodes;
5. size planner (:func:`plan_context_size`): weight bytes vs ``profile.max_context_bytes`` →
   :class:`ContextTooLargeError`;

then compiles in a child process with ``ep.context_enable=1``, ``ep.context_embed_mode=0`` (separate ``.bin``) and
``session.disable_cpu_ep_fallback=1``. When the EP would leave nodes to the CPU, onnxruntime only says
"This session contains graph nodes that are assigned to the default CPU EP, but fallback to CPU EP has been
explicitly disabled by the user." without naming them; hycoc then opens a diagnostic session with fallback allowed,
``offload_graph_io_quantization=0`` and ``session.record_ep_graph_assignment_info=1``
(``InferenceSession.get_provider_graph_assignment_info()``) and raises :class:`FallbackError` listing every node
the CPU EP got, with the EP's reason from its log where it gave one ("Unsupported nodes in QNN EP: { name, type }",
"QNN.backendValidateOpConfig() failed for node `X` of type `Y` with error code N").
After compiling, the arch and SoC the HTP backend wrote into the binary are read back and must match the profile
(:class:`ArchMismatchError`): QNN silently compiles for a generic v68 when it does not know the arch, and
``soc_model`` wins over ``htp_arch``.

Weight sharing (``ep.share_ep_contexts``), observed with onnxruntime-qnn 2.7.0 / QNN 2.51 on x86:
- all graphs of a group go into one ``.bin`` named after the *first* graph's context model; every EPContext model
  of the group points at it (``ep_cache_context``) and says ``main_context=1``;
- the ``.bin`` is written only when the session carrying ``ep.stop_share_ep_contexts=1`` is created; without it no
  ``.bin`` appears at all, and the leftover shared state made the next compile in the same process fail
  ("Failed to pre-register input ... error code: 7003") and the process abort at exit — hence one child process
  per group;
- weights are stored once: two graphs over the same 512×512 int8 weight gave one 352,256-byte ``.bin`` against
  2 × 319,488 bytes unshared;
- the x86 HTP simulator cannot load a weight-shared binary ("contextCreateFromBinary failed.
  QNN_COMMON_ERROR_NOT_SUPPORTED", for v73, v79 and v81 alike), so :func:`run_compiled` checks need an unshared
  compile of the same graphs (``CompiledGraph.simulator_runnable``).

Sources: onnxruntime-qnn ``docs/execution_providers/QNN-ExecutionProvider.md`` (provider options, context binary
cache, weight sharing), onnxruntime ``EP-Context-Design`` (``ep.*`` session config keys).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from hycoc.targets.htp_checks import (
    QDQ_OPS,
    HostOnlyError,
    HtpTargetError,
    NodeIssue,
    PlacementError,
    check_capabilities,
    find_host_only_nodes,
    load_model,
)
from hycoc.targets.profiles import PROFILES, TargetProfile

_FALLBACK_MSG = "fallback to CPU EP has been explicitly disabled"
_UNSUPPORTED_RE = re.compile(r"Unsupported nodes in QNN EP: \{ name: (.*?), type: (\w+) \}")
_VALIDATE_RE = re.compile(r"failed for node `(.*?)` of type `(\w+)` with error code (\d+)")


class FallbackError(PlacementError):
    """The QNN EP would leave these nodes to the CPU EP (compiled with CPU fallback disabled)."""


class ContextTooLargeError(HtpTargetError):
    """A context (one graph or a weight-sharing group) is bigger than the profile's ``max_context_bytes``."""


class HtpCompileError(HtpTargetError):
    """The EP failed to compile for another reason (e.g. "Failed to finalize QNN graph"); the message carries the
    EP's error and the error lines of its log."""


class ArchMismatchError(HtpCompileError):
    """The context binary was compiled for another arch/SoC than the profile asked for."""


# -------------------------------------------------------------------------------------------------- context size


def initializer_bytes(t) -> int:
    """Bytes of one initializer's data (an ``onnx.TensorProto``; external data: its recorded length, or the
    dtype × shape, int4 packed two to a byte)."""
    import onnx

    if t.data_location == onnx.TensorProto.EXTERNAL:
        ext = {e.key: e.value for e in t.external_data}
        if "length" in ext:
            return int(ext["length"])
    if t.raw_data:
        return len(t.raw_data)
    n = int(np.prod(t.dims)) if len(t.dims) else 1
    bits = {onnx.TensorProto.INT4: 4, onnx.TensorProto.UINT4: 4}.get(t.data_type)
    if bits:
        return (n * bits + 7) // 8
    return n * onnx.helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


@dataclass(frozen=True)
class SizePlan:
    """The size planner's answer for one context: weight bytes (shared names counted once) vs the limit."""

    graphs: tuple[str, ...]
    weight_bytes: int
    max_context_bytes: int | None
    largest: tuple[tuple[str, int], ...]

    @property
    def fits(self) -> bool:
        return self.max_context_bytes is None or self.weight_bytes <= self.max_context_bytes


def plan_context_size(models: Sequence[str | os.PathLike], profile: TargetProfile) -> SizePlan:
    """Weight bytes of the graphs that will share one context binary, against ``profile.max_context_bytes``.

    Initializers with the same name across the graphs count once (QNN weight sharing shares by tensor name).
    Raw initializer bytes are a lower bound of the binary (measured: a 262,144-byte int8 weight gave a
    319,488-byte binary). Reads no external data. Returns a :class:`SizePlan`; never raises on size.
    """
    sizes: dict[str, int] = {}
    for m in models:
        for t in load_model(m).graph.initializer:
            sizes.setdefault(t.name, initializer_bytes(t))
    largest = tuple(sorted(sizes.items(), key=lambda kv: -kv[1])[:5])
    return SizePlan(tuple(str(m) for m in models), sum(sizes.values()), profile.max_context_bytes, largest)


def _check_size(plan: SizePlan, profile: TargetProfile) -> None:
    if not plan.fits:
        top = ", ".join(f"{n} {b / 1e6:.1f} MB" for n, b in plan.largest)
        raise ContextTooLargeError(
            f"context of {len(plan.graphs)} graph(s) needs {plan.weight_bytes:,} bytes of weights, more than "
            f"{profile.name}'s limit of {plan.max_context_bytes:,} bytes; largest: {top}. Split the graphs "
            f"across several contexts or quantize the weights harder."
        )


# ----------------------------------------------------------------------------------------------------- compiling


@dataclass
class CompiledGraph:
    """One compiled graph: an EPContext ONNX model and the QNN context binary it points at.

    ``binary_bytes`` is the ``.bin`` size; a weight-sharing group has one ``.bin`` for all its graphs.
    ``inputs``/``outputs``: ``[{"name", "shape", "dtype"}]`` of the EPContext model.
    """

    name: str
    profile: str
    ctx_model: Path
    context_binary: Path
    binary_bytes: int
    weight_bytes: int
    htp_arch: int | None
    soc_type: str | None
    qnn_sdk: str | None
    compile_seconds: float
    inputs: list[dict] = field(default_factory=list)
    outputs: list[dict] = field(default_factory=list)
    shared_with: tuple[str, ...] = ()
    siblings: list[CompiledGraph] = field(default_factory=list)

    @property
    def simulator_runnable(self) -> bool:
        """False for weight-shared binaries: the x86 HTP simulator refuses them (QNN_COMMON_ERROR_NOT_SUPPORTED)."""
        return not self.shared_with


def _io(model) -> tuple[list[dict], list[dict]]:
    import onnx

    def desc(v):
        t = v.type.tensor_type
        return {
            "name": v.name,
            "shape": [d.dim_value for d in t.shape.dim],
            "dtype": str(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)),
        }

    return [desc(v) for v in model.graph.input], [desc(v) for v in model.graph.output]


def _log_reasons(log: str) -> dict[str, str]:
    reasons: dict[str, str] = {}
    for name, op in _UNSUPPORTED_RE.findall(log):
        reasons.setdefault(name, f"the QNN EP does not support this {op}")
    for name, _op, code in _VALIDATE_RE.findall(log):
        reasons[name] = f"QNN backend rejected the op config (backendValidateOpConfig error {code})"
    return reasons


def _error_lines(log: str, limit: int = 12) -> str:
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in log.splitlines() if "[E:" in ln or "rror" in ln]
    return "\n".join(lines[-limit:])


def _diagnose_fallback(model_path: Path, profile: TargetProfile, compile_log: str) -> FallbackError:
    from hycoc.targets.qnn_ep import run_worker

    res, log = run_worker(
        {"op": "assign", "model": str(model_path), "provider_options": profile.provider_options()}, timeout_s=3600
    )
    reasons = _log_reasons(compile_log + "\n" + log)
    if not res.get("ok"):
        return FallbackError(
            f"{model_path.name}: some nodes would fall back to the CPU EP and the diagnostic "
            f"session failed too ({res.get('error')}); EP log:\n{_error_lines(log)}",
            [NodeIssue(n, "?", r) for n, r in reasons.items()],
        )
    cpu = [(name, op) for sg in res["assignment"] if sg["ep"] != "QNNExecutionProvider" for name, op in sg["nodes"]]
    issues = []
    for name, op in cpu:
        if name in reasons:
            issues.append(NodeIssue(name, op, reasons[name]))
        elif op in QDQ_OPS:
            issues.append(NodeIssue(name, op, "Q/DQ next to a node that falls back"))
        else:
            issues.append(NodeIssue(name, op, "assigned to the CPU EP"))
    issues.sort(key=lambda i: i.op_type in QDQ_OPS)
    main = [i for i in issues if i.op_type not in QDQ_OPS]
    return FallbackError(
        f"{model_path.name}: {len(main)} node(s) would fall back to the CPU EP on {profile.name} "
        f"({len(issues)} with their Q/DQ); CPU fallback is disabled for HTP targets",
        issues,
    )


def _ctx_paths(out_dir: Path, graph_name: str) -> tuple[Path, Path]:
    """Where the EP puts a graph's EPContext model and (unshared) binary: NAME_ctx.onnx, NAME_ctx_qnn.bin."""
    return out_dir / f"{graph_name}_ctx.onnx", out_dir / f"{graph_name}_ctx_qnn.bin"


def _precheck(model_path: Path, profile: TargetProfile) -> None:
    from hycoc.targets.static_shape_check import check_static_graph

    model = load_model(model_path)
    check_capabilities(model, profile)
    host = find_host_only_nodes(model, profile)
    if host:
        raise HostOnlyError(
            f"{model_path.name}: {len(host)} node(s) belong on the host, not in an HTP graph ({profile.name})", host
        )
    check_static_graph(model, what=f"{model_path.name} ({profile.name})")


def compile_shared(
    graphs: Sequence[tuple[str | os.PathLike, str]],
    out_dir: str | os.PathLike,
    profile: TargetProfile,
    *,
    share: bool = True,
) -> list[CompiledGraph]:
    """Compile ``[(qdq_model_path, graph_name), ...]`` into EPContext models under ``out_dir``; with ``share``
    (and more than one graph) into one weight-shared context binary.

    Files: ``NAME_ctx.onnx`` per graph and ``FIRST_ctx_qnn.bin`` (shared) or ``NAME_ctx_qnn.bin`` each; existing
    files of the same names are replaced only after the whole compile succeeded.
    Raises CapabilityError, HostOnlyError, StaticGraphError, ContextTooLargeError (before compiling), FallbackError,
    HtpCompileError, ArchMismatchError (after). Compile time is in ``CompiledGraph.compile_seconds``.
    """
    if profile.backend != "htp":
        raise ValueError(f"profile {profile.name!r} is not an HTP target")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = [Path(p).resolve() for p, _ in graphs]
    names = [n for _, n in graphs]
    check_graph_names(names, paths, share)
    for p in paths:
        _precheck(p, profile)
    share = share and len(graphs) > 1
    plans = [plan_context_size(paths, profile)] if share else [plan_context_size([p], profile) for p in paths]
    for plan in plans:
        _check_size(plan, profile)

    staging = out_dir / f".staging-{names[0]}-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        seconds = _run_compile(staging, paths, names, profile, share)
        results = [
            _compiled_graph(
                staging,
                p,
                n,
                profile,
                binary=_ctx_paths(staging, names[0] if share else n)[1],
                weight_bytes=(plans[0] if share else plans[k]).weight_bytes,
                compile_seconds=seconds[k],
                shared_with=tuple(x for x in names if x != n) if share else (),
            )
            for k, (p, n) in enumerate(zip(paths, names))
        ]
        if profile.max_context_bytes is not None:
            for r in results:
                if r.binary_bytes > profile.max_context_bytes:
                    raise ContextTooLargeError(
                        f"{r.context_binary.name} is {r.binary_bytes:,} bytes, over "
                        f"{profile.name}'s limit of {profile.max_context_bytes:,}"
                    )
        # move into place
        for f in staging.iterdir():
            os.replace(f, out_dir / f.name)
        for r in results:
            r.ctx_model = out_dir / r.ctx_model.name
            r.context_binary = out_dir / r.context_binary.name
        return results
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def check_graph_names(names: Sequence[str], paths: Sequence[Path], share: bool) -> None:
    """Raise ValueError unless the graph names are unique and made of ``[A-Za-z0-9_.-]`` (they name the context
    files), and, for a shared context, no model is given twice (QNN fails on that with error 7003)."""
    if len(set(names)) != len(names) or any(not re.fullmatch(r"[A-Za-z0-9_.-]+", n) for n in names):
        raise ValueError(f"graph names must be unique and [A-Za-z0-9_.-]+: {list(names)}")
    if share and len(set(paths)) != len(paths):
        raise ValueError("the same model twice in one shared context fails in QNN (error 7003); give distinct graphs")


def _run_compile(staging: Path, paths: list[Path], names: list[str], profile: TargetProfile, share: bool):
    """Compile the graphs in one child process (`hycoc.targets.qnn_ep.run_worker`: one process per group, see the
    module docstring) into ``staging``. Returns each graph's compile seconds. Raises FallbackError (the nodes the
    CPU EP would get, `_diagnose_fallback`) or HtpCompileError (the EP's error and its log's error lines)."""
    from hycoc.targets.qnn_ep import run_worker

    job = {
        "op": "compile",
        "share": share,
        "provider_options": profile.provider_options(),
        "graphs": [{"model": str(p), "ctx_path": str(_ctx_paths(staging, n)[0])} for p, n in zip(paths, names)],
    }
    res, log = run_worker(job)
    if not res.get("ok"):
        i = res.get("failed_index", 0) or 0
        err = res.get("error", "")
        if _FALLBACK_MSG in err:
            raise _diagnose_fallback(paths[i], profile, log)
        raise HtpCompileError(
            f"{paths[i].name}: QNN EP compile for {profile.name} failed: {err}\nEP log:\n{_error_lines(log)}"
        )
    return [g["seconds"] for g in res["graphs"]]


def binary_target_matches(tgt, profile: TargetProfile) -> bool:
    """Whether the arch and SoC a context binary records (``tgt``: `hycoc.targets.qnn_ep.read_binary_target`'s
    ``arch`` and ``soc_type``, None when unreadable) are the profile's: the arch always, the SoC (case-insensitive)
    when the profile names a QNN SoC id."""
    return not (
        tgt is None
        or tgt.arch != profile.htp_arch
        or (profile.soc_id is not None and tgt.soc_type.upper() != (profile.soc_model or "").upper())
    )


def _compiled_graph(
    staging: Path,
    model: Path,
    name: str,
    profile: TargetProfile,
    *,
    binary: Path,
    weight_bytes: int,
    compile_seconds: float,
    shared_with: tuple[str, ...],
) -> CompiledGraph:
    """What the EP wrote for graph ``name`` in ``staging``: its EPContext model and ``binary`` (its own or the
    group's), checked for the profile's arch and SoC, with the QNN SDK version and IO the EPContext model records.
    Raises HtpCompileError when a file is missing, ArchMismatchError when the binary is for another target."""
    import onnx
    from hycoc.targets.qnn_ep import read_binary_target

    ctx = _ctx_paths(staging, name)[0]
    if not ctx.exists() or not binary.exists():
        raise HtpCompileError(
            f"{model.name}: the EP wrote no {ctx.name} / {binary.name} (files: "
            f"{sorted(x.name for x in staging.iterdir())})"
        )
    tgt = read_binary_target(binary)
    if tgt is None or not binary_target_matches(tgt, profile):
        got = "unknown" if tgt is None else f"{tgt.soc_type} v{tgt.arch}"
        raise ArchMismatchError(
            f"{model.name}: asked for {profile.soc_model} v{profile.htp_arch}, the context binary says {got}"
        )
    m = onnx.load(str(ctx), load_external_data=False)
    attrs = {
        a.name: onnx.helper.get_attribute_value(a)
        for nd in m.graph.node
        if nd.op_type == "EPContext"
        for a in nd.attribute
    }
    sdk = attrs.get("ep_sdk_version")
    ins, outs = _io(m)
    return CompiledGraph(
        name=name,
        profile=profile.name,
        ctx_model=ctx,
        context_binary=binary,
        binary_bytes=binary.stat().st_size,
        weight_bytes=weight_bytes,
        htp_arch=tgt.arch,
        soc_type=tgt.soc_type,
        qnn_sdk=sdk.decode() if isinstance(sdk, bytes) else sdk,
        compile_seconds=compile_seconds,
        inputs=ins,
        outputs=outs,
        shared_with=shared_with,
    )


def compile_context(
    qdq_model_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    profile: TargetProfile,
    *,
    graph_name: str,
    share_with: Sequence[tuple[str | os.PathLike, str]] | None = None,
) -> CompiledGraph:
    """Compile one QDQ model for an HTP profile into ``out_dir/GRAPH_ctx.onnx`` + ``GRAPH_ctx_qnn.bin``.

    ``share_with``: other ``(qdq_model_path, graph_name)`` pairs to compile into the same weight-shared context
    binary (see the module docstring); they are returned in ``.siblings``. Errors: see :func:`compile_shared`.
    """
    res = compile_shared([(qdq_model_path, graph_name), *(share_with or [])], out_dir, profile, share=bool(share_with))
    res[0].siblings = res[1:]
    return res[0]


# ------------------------------------------------------------------------------------------------------ running


def _profile_for_binary(ctx_model_path: Path) -> TargetProfile | None:
    import onnx
    from hycoc.targets.qnn_ep import read_binary_target

    m = onnx.load(str(ctx_model_path), load_external_data=False)
    for nd in m.graph.node:
        for a in nd.attribute:
            if a.name == "ep_cache_context" and nd.op_type == "EPContext":
                b = ctx_model_path.parent / onnx.helper.get_attribute_value(a).decode()
                tgt = read_binary_target(b) if b.exists() else None
                if tgt is not None:
                    for p in PROFILES.values():
                        if p.backend == "htp" and p.htp_arch == tgt.arch:
                            return p
    return None


class HtpSession:
    """A compiled EPContext model loaded on the QNN HTP backend (on x86: the HTP simulator), CPU fallback off.

    ``profile``: the profile it was compiled for (default: found from the arch recorded in the binary).
    Raises HtpCompileError when the EP cannot load it (e.g. a weight-shared binary on the simulator).
    """

    def __init__(self, ctx_model_path: str | os.PathLike, profile: TargetProfile | None = None):
        import onnxruntime as ort
        from hycoc.targets.qnn_ep import session_options

        self.path = Path(ctx_model_path)
        self.profile = profile or _profile_for_binary(self.path) or PROFILES["htp-v81"]
        so = session_options(self.profile.provider_options(), {"session.disable_cpu_ep_fallback": "1"})
        t0 = time.perf_counter()
        try:
            self.session = ort.InferenceSession(str(self.path), sess_options=so)
        except Exception as e:  # noqa: BLE001 - onnxruntime's own exception types
            raise HtpCompileError(
                f"{self.path.name}: the QNN EP could not load it on {self.profile.name}: {e}"
            ) from None
        self.load_seconds = time.perf_counter() - t0
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]

    def run(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once; ``inputs`` by graph input name. Returns ``{output name: array}``."""
        missing = set(self.input_names) - set(inputs)
        if missing:
            raise ValueError(f"{self.path.name}: missing inputs {sorted(missing)}")
        outs = self.session.run(None, {k: inputs[k] for k in self.input_names})
        return dict(zip(self.output_names, outs))


def run_compiled(
    ctx_model_path: str | os.PathLike, inputs: Mapping[str, np.ndarray], profile: TargetProfile | None = None
) -> dict[str, np.ndarray]:
    """Load a compiled EPContext model on the HTP backend (x86: simulator) and run it once; see :class:`HtpSession`."""
    return HtpSession(ctx_model_path, profile).run(inputs)
