"""The ``qai-hub`` target: QDQ ONNX -> QNN DLC on Qualcomm AI Hub -> one linked, weight-shared context binary,
wrapped as EPContext models (docs/design.md "Targets"; docs/device-time.md).

The flow, on AI Hub's current API (qai-hub 0.56 client; AI Hub release notes of 2026-09-14 removed
``--target_runtime qnn_context_binary``, which this module never sends):

1. ``resolve_device``: the recipe's ``[target] hub_device`` (a phone as AI Hub names it, default
   "Samsung Galaxy S26 (Family)", SM8850 / Hexagon v81) checked against ``hub.get_devices(name=...)``: unknown names
   fail with the list AI Hub offers; a device whose ``hexagon:vNN`` attribute is not ``[target] htp_arch`` fails too.
   When AI Hub cannot be reached the check is skipped and said so (``HubDevice.validated`` False).
2. ``compile_dlc`` per graph: ``hub.submit_compile_job(model=FOLDER, device, name, options)`` with `compile_options`:
   ``--target_runtime qnn_dlc --compute_unit npu --qnn_graph_name NAME`` (NPU only: no CPU fallback, as the
   htp-v81 target's ``session.disable_cpu_ep_fallback=1``), plus ``--quantize_io`` only where the QDQ graph's IO is
   already integer (the runtime feeds exactly the dtypes the manifest lists; float IO stays float). FOLDER holds
   ``NAME.onnx`` + ``NAME.onnx.data`` (AI Hub's ONNX-with-external-data upload form).
3. ``link_context``: ``hub.submit_link_job(dlc_models, device, name)`` joins the DLCs (SLM tree + decode graphs and
   the head) into one context binary; AI Hub shares weights across linked graphs by name and content.
   The linked model's metadata (``QNN_CONTEXT_BIN_GRAPH_NAMES``, ``QNN_CONTEXT_BIN_HEXAGON_VERSION``,
   ``QAIRT_SDK_VERSION``) is checked: every graph present, the arch the recipe asked for.
4. ``write_epcontext``: each graph becomes an EPContext ONNX model (one ``com.microsoft`` EPContext node,
   ``main_context=1``, ``embed_mode=0``, ``ep_cache_context`` = the downloaded ``.bin``, ``partition_name`` = the
   graph's name in the binary, ``source="QNNExecutionProvider"``), with the QDQ graph's inputs and outputs -- the
   same attributes onnxruntime-qnn writes for the ``htp-v81`` target (checked in tests against an EP-written one),
   so ``hycoc run --backend htp`` opens the bundle the same way.

Profiles (`hycoc.bench.paper.device_profile`) go through ``hub.submit_inference_job(model, device, inputs, profile=True,
options="--qnn_options context_enable_graphs=NAME")`` and ``job.download_profile()`` (``submit_profile_job`` is
deprecated in the 0.56 client).

Setup: without the ``qai-hub`` package, or without an API token (``~/.qai_hub/client.ini``, written by ``qai-hub
configure``, the ini ``QAIHUB_CLIENT_INI`` names, or ``QAI_HUB_API_TOKEN``), `check_setup` fails at once with the exact
steps (`QaiHubSetupError`), before anything is uploaded. Every job that ends FAILED, or succeeds without a model, raises
`QaiHubJobError` naming the job id and AI Hub's failure reason.

Tested offline only: the tests import the installed qai-hub 0.56.0 client, check each call here against its
signatures, and run this flow through the client's own job objects with its REST layer
(``qai_hub.public_rest_api``) replaced by canned protobuf responses. Nothing here has run against the live AI Hub
service from this machine (no network, no token).
"""

from __future__ import annotations

import importlib
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: AI Hub's name for the paper's phone family (SM8850, Hexagon v81): the default of ``[target] hub_device``.
DEFAULT_HUB_DEVICE = "Samsung Galaxy S26 (Family)"

SETUP_STEPS = ("pip install qai-hub", "qai-hub configure --api_token TOKEN")

#: Options of every compile job (see the module docstring); ``--qnn_graph_name`` and ``--quantize_io`` are per graph.
COMPILE_OPTIONS = "--target_runtime qnn_dlc --compute_unit npu"


class QaiHubSetupError(RuntimeError):
    """qai-hub is not installed or not configured; the message gives the exact setup steps."""


class QaiHubJobError(RuntimeError):
    """An AI Hub job failed or gave no model; the message names the job and AI Hub's reason."""


class QaiHubDeviceError(ValueError):
    """``[target] hub_device`` names no AI Hub device, or one with another Hexagon arch than ``[target] htp_arch``."""


def setup_message(missing: str) -> str:
    """The one message for a missing package or token (``missing`` says which)."""
    return (
        f"target qai-hub: {missing}. Set it up with `{SETUP_STEPS[0]}` and `{SETUP_STEPS[1]}` (the token is "
        f"on https://app.aihub.qualcomm.com under Account -> Settings -> API Token), or build with "
        f"--target htp-v81"
    )


def check_setup(
    *,
    import_module: Callable[[str], Any] = importlib.import_module,
    environ: Mapping[str, str] | None = None,
    home: str | Path | None = None,
) -> Any:
    """What the jobs are submitted through, once qai-hub is importable and a token is configured: with
    ``QAI_HUB_API_TOKEN`` set, a ``qai_hub.Client(config=qai_hub.ClientConfig(api_token=...))`` (the 0.56 client
    itself reads no token from the environment, only an ini file); else the ``qai_hub`` module, whose default client
    reads ``~/.qai_hub/client.ini`` (written by ``qai-hub configure``) or the ini that ``QAIHUB_CLIENT_INI`` names.
    Raises QaiHubSetupError (no package, or no token in any of these)."""
    environ = os.environ if environ is None else environ
    try:
        hub = import_module("qai_hub")
    except ImportError:
        raise QaiHubSetupError(setup_message("the qai-hub package is not installed")) from None
    token = environ.get("QAI_HUB_API_TOKEN")
    if token:
        return hub.Client(config=hub.ClientConfig(api_token=token))
    config = Path(
        environ.get("QAIHUB_CLIENT_INI") or Path(home if home is not None else Path.home()) / ".qai_hub" / "client.ini"
    )
    if not config.is_file():
        raise QaiHubSetupError(setup_message(f"no API token is configured (no {config}, no QAI_HUB_API_TOKEN)"))
    return hub


def qnn_graph_name(graph: str) -> str:
    """The graph's name inside the context binary: ``graph`` with every character outside [A-Za-z0-9_] as ``_``
    (QNN graph names are C identifiers; ``slm.s0`` -> ``slm_s0``)."""
    return re.sub(r"[^A-Za-z0-9_]", "_", graph)


# ---- the device -------------------------------------------------------------------------------------------------


def hub_device(name: str) -> Any:
    """``qai_hub.Device(name)``: the device a job is submitted for (AI Hub selects the phone by exact name)."""
    import qai_hub

    return qai_hub.Device(name)


@dataclass(frozen=True)
class HubDevice:
    """The AI Hub device jobs run on: its name as AI Hub spells it, its attributes, and whether ``get_devices``
    confirmed it (False when AI Hub could not be reached; the jobs then fail on AI Hub's side if it is wrong)."""

    name: str
    attributes: tuple[str, ...] = ()
    validated: bool = False

    @property
    def hexagon_arch(self) -> int | None:
        """The ``hexagon:vNN`` attribute as NN (81 for SM8850), None when AI Hub lists none."""
        for a in self.attributes:
            m = re.fullmatch(r"hexagon:v(\d+)", a)
            if m:
                return int(m.group(1))
        return None


def _offline(e: Exception) -> bool:
    """True for the errors of an unreachable AI Hub: the client's InternalError ("Could not connect to ...",
    "... is unavailable right now"), a requests connection/timeout error, an OSError."""
    import requests

    return (
        isinstance(e, (OSError, requests.exceptions.ConnectionError, requests.exceptions.Timeout))
        or type(e).__name__ == "InternalError"
    )


def resolve_device(hub: Any, name: str, htp_arch: int | None = None) -> HubDevice:
    """``name`` checked against ``hub.get_devices(name=name)`` (`HubDevice`). Raises QaiHubDeviceError when AI Hub
    lists no such device (the message names the devices it has) or its Hexagon arch is not ``htp_arch``; a
    connection failure skips the check (``validated=False``)."""
    try:
        found = hub.get_devices(name=name)
    except Exception as e:
        if _offline(e):
            return HubDevice(name, (), validated=False)
        raise
    if not found:
        try:
            names = sorted({d.name for d in hub.get_devices()})
        except Exception as e:
            if not _offline(e):
                raise
            names = []
        hint = f"; AI Hub lists: {', '.join(names[:12])}{' ...' if len(names) > 12 else ''}" if names else ""
        raise QaiHubDeviceError(
            f"target.hub_device = {name!r} is not an AI Hub device{hint} (`qai-hub list-devices` shows them all)"
        )
    dev = HubDevice(found[0].name, tuple(found[0].attributes), validated=True)
    if htp_arch is not None and dev.hexagon_arch is not None and dev.hexagon_arch != htp_arch:
        raise QaiHubDeviceError(
            f"target.hub_device = {name!r} has Hexagon v{dev.hexagon_arch}, the recipe's "
            f"target.htp_arch is {htp_arch}: pick a v{htp_arch} phone or change htp_arch"
        )
    return dev


# ---- compile, link ----------------------------------------------------------------------------------------------


def _quantized_io(qdq_model: Path) -> bool:
    """True when any graph input or output of the QDQ model is an integer tensor (quantized IO)."""
    import onnx

    m = onnx.load(str(qdq_model), load_external_data=False)
    ints = {onnx.TensorProto.UINT8, onnx.TensorProto.INT8, onnx.TensorProto.UINT16, onnx.TensorProto.INT16}
    return any(v.type.tensor_type.elem_type in ints for v in [*m.graph.input, *m.graph.output])


def compile_options(graph: str, *, quantize_io: bool) -> str:
    """The compile job's options for ``graph`` (module docstring, step 2)."""
    return f"{COMPILE_OPTIONS} --qnn_graph_name {qnn_graph_name(graph)}" + (" --quantize_io" if quantize_io else "")


def _finished_model(job: Any, what: str) -> Any:
    """The job's target model after it finished; QaiHubJobError naming the job when it failed or gave none."""
    status = job.wait()
    model = job.get_target_model() if status.success else None
    if model is None:
        reason = getattr(status, "message", None) or getattr(status, "code", status)
        raise QaiHubJobError(f"AI Hub {what} job {job.job_id} failed: {reason}")
    return model


def upload_folder(qdq_model: Path, staging: Path) -> Path:
    """A folder holding only ``qdq_model`` and its external data (``*.data``), as AI Hub uploads ONNX with external
    weights; ``staging`` is where it is made (the model's own folder when it already holds nothing else)."""
    folder = qdq_model.parent
    extra = [p for p in folder.iterdir() if p != qdq_model and not p.name.endswith(".data")]
    if not extra:
        return folder
    out = staging / qdq_model.stem
    out.mkdir(parents=True, exist_ok=True)
    for p in folder.iterdir():
        if p == qdq_model or p.name.endswith(".data"):
            shutil.copy2(p, out / p.name)
    return out


def compile_dlc(hub: Any, qdq_model: str | os.PathLike, device: HubDevice, *, graph: str, staging: Path) -> Any:
    """Submit one compile job (module docstring, step 2) and wait; returns ``(job, dlc_model)``. Raises
    QaiHubJobError."""
    qdq_model = Path(qdq_model)
    job = hub.submit_compile_job(
        model=str(upload_folder(qdq_model, staging)),
        device=hub_device(device.name),
        name=f"hycoc-{graph}",
        options=compile_options(graph, quantize_io=_quantized_io(qdq_model)),
    )
    return job, _finished_model(job, f"compile (graph {graph!r})")


@dataclass
class HubLinked:
    """What `compile_and_link` made: one context binary for all graphs, an EPContext model per graph.

    ``ctx_models``: graph name -> EPContext ONNX path; ``context_binary``: the linked ``.bin``; ``compile_jobs``:
    graph -> compile job id; ``link_job``: the link job id; ``qairt``: the QAIRT SDK version AI Hub reports for the
    binary (None when it reports none); ``graph_names``: graph -> its name inside the binary."""

    ctx_models: dict[str, Path]
    context_binary: Path
    device: HubDevice
    compile_jobs: dict[str, str]
    link_job: str
    qairt: str | None = None
    hexagon_arch: int | None = None
    graph_names: dict[str, str] = field(default_factory=dict)

    def manifest_info(self) -> dict:
        """The manifest's ``target.hub`` section (`hycoc.bundle.HubInfo` fields)."""
        return {
            "device": self.device.name,
            "device_validated": self.device.validated,
            "compile_jobs": dict(self.compile_jobs),
            "link_job": self.link_job,
            "qairt": self.qairt,
            "graph_names": dict(self.graph_names),
        }


def _metadata(model: Any, key: str) -> str | None:
    """One entry of an AI Hub model's metadata by ``qai_hub.ModelMetadataKey`` member name, None if absent."""
    import qai_hub

    try:
        return model.metadata.get(getattr(qai_hub.ModelMetadataKey, key))
    except Exception:  # noqa: BLE001 - the service may not report metadata for every model
        return None


def compile_and_link(
    hub: Any,
    graphs: Sequence[tuple[str | os.PathLike, str]],
    out_dir: str | os.PathLike,
    device: HubDevice,
    *,
    htp_arch: int | None = None,
    binary_name: str = "hub_context.bin",
    on_job: Callable[[str, str], None] | None = None,
) -> HubLinked:
    """Compile each ``(qdq_model, graph)`` to a DLC, link them all into ``out_dir/binary_name`` and write
    ``out_dir/GRAPH_ctx.onnx`` per graph (module docstring). ``on_job(kind, job_id)`` is told of each job as it is
    submitted. Raises QaiHubJobError when a job fails, or the linked binary lacks a graph or has another arch."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    staging = out / ".hub-upload"
    compile_jobs, dlcs = {}, []
    for path, graph in graphs:
        job, dlc = compile_dlc(hub, path, device, graph=graph, staging=staging)
        compile_jobs[graph] = str(job.job_id)
        if on_job:
            on_job("compile", str(job.job_id))
        dlcs.append(dlc)
    link = hub.submit_link_job(dlcs, device=hub_device(device.name), name=f"hycoc-{binary_name.removesuffix('.bin')}")
    if on_job:
        on_job("link", str(link.job_id))
    linked = _finished_model(link, "link")
    names = {g: qnn_graph_name(g) for _, g in graphs}
    listed = _metadata(linked, "QNN_CONTEXT_BIN_GRAPH_NAMES")
    if listed:
        have = set(re.split(r"[,\s]+", listed.strip()))
        missing = [n for n in names.values() if n not in have]
        if missing:
            raise QaiHubJobError(
                f"AI Hub link job {link.job_id}: the context binary has graphs {sorted(have)}, not {missing}"
            )
    arch = _metadata(linked, "QNN_CONTEXT_BIN_HEXAGON_VERSION")
    arch_n = int(re.sub(r"\D", "", arch)) if arch and re.search(r"\d", arch) else None
    if htp_arch is not None and arch_n is not None and arch_n != htp_arch:
        raise QaiHubJobError(
            f"AI Hub link job {link.job_id}: the context binary is for Hexagon v{arch_n}, the "
            f"recipe asks for v{htp_arch}"
        )
    binary = Path(linked.download(str(out / binary_name)))
    if binary.name != binary_name:
        binary = binary.rename(out / binary_name)
    qairt = _metadata(linked, "QAIRT_SDK_VERSION")
    ctx = {
        g: write_epcontext(Path(p), out / f"{g}_ctx.onnx", binary.name, names[g], sdk_version=qairt) for p, g in graphs
    }
    shutil.rmtree(staging, ignore_errors=True)
    return HubLinked(ctx, binary, device, compile_jobs, str(link.job_id), qairt, arch_n, names)


# ---- EPContext models --------------------------------------------------------------------------------------------


def write_epcontext(
    qdq_model: str | os.PathLike,
    out_path: str | os.PathLike,
    context_binary: str,
    partition_name: str,
    *,
    sdk_version: str | None = None,
) -> Path:
    """An EPContext ONNX model at ``out_path`` for graph ``partition_name`` of ``context_binary`` (a file name beside
    it), with ``qdq_model``'s graph inputs and outputs (names, dtypes, shapes, order), written atomically.

    Node attributes as onnxruntime-qnn 2.7 writes them for the htp-v81 target (onnxruntime ``EP-Context-Design``):
    ``main_context=1``, ``ep_cache_context``, ``embed_mode=0``, ``source="QNNExecutionProvider"``,
    ``partition_name``, ``ep_sdk_version`` (when known), ``max_size=0``, ``is_multi_soc_ep_context=0``."""
    import onnx
    from onnx import helper

    src = onnx.load(str(qdq_model), load_external_data=False)
    inits = {t.name for t in src.graph.initializer}
    inputs = [v for v in src.graph.input if v.name not in inits]
    attrs: dict[str, Any] = dict(  # the EPContext node's attributes (ints and strings)
        main_context=1,
        ep_cache_context=context_binary,
        embed_mode=0,
        source="QNNExecutionProvider",
        partition_name=partition_name,
        max_size=0,
        is_multi_soc_ep_context=0,
    )
    if sdk_version:
        attrs["ep_sdk_version"] = sdk_version
    node = helper.make_node(
        "EPContext",
        [v.name for v in inputs],
        [v.name for v in src.graph.output],
        name=partition_name,
        domain="com.microsoft",
        **attrs,
    )
    graph = helper.make_graph([node], partition_name, list(inputs), list(src.graph.output))
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    )
    model.ir_version = 10
    out_path = Path(out_path)
    tmp = out_path.with_name(out_path.name + ".tmp")
    onnx.save(model, str(tmp))
    os.replace(tmp, out_path)
    return out_path
