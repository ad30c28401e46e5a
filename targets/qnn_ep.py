"""The onnxruntime QNN execution provider (package ``onnxruntime-qnn``, a plugin EP): registration, devices,
versions, and which HTP archs this install can compile for.

API used (onnxruntime 1.32 + onnxruntime-qnn 2.7.0, QNN 2.51; onnxruntime-qnn's
``docs/execution_providers/QNN-ExecutionProvider.md``):

- ``onnxruntime.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())``
  once per process (a second call raises; :func:`ensure_registered` guards it);
- ``onnxruntime.get_ep_devices()`` → the ``OrtEpDevice`` whose ``ep_name == "QNNExecutionProvider"`` (on this x86
  host: one device, type CPU, vendor Intel — the HTP backend then runs graphs on its x86 HTP simulator);
- ``SessionOptions.add_provider_for_devices(devices, {"backend_type": "htp", "htp_arch": "81", "soc_model": "87",
  ...})``; session config entries (``ep.context_enable``, ``session.disable_cpu_ep_fallback``, ...) via
  ``SessionOptions.add_session_config_entry``.
- ``onnxruntime_qnn.__version__`` and ``onnxruntime_qnn.build_and_package_info.qnn_version`` (the QAIRT/QNN SDK
  the EP was built with); EPContext nodes also carry it as ``ep_sdk_version``.

Compiles run in a child process (``targets/_qnn_worker.py``): QNN keeps process-wide state (shared EP contexts)
and can abort the process on some failures, which must not take the caller (a build, pytest) down with it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

EP_NAME = "QNNExecutionProvider"
#: HTP archs the probe tries (QNN ``QnnHtpDevice_Arch_t`` values known to QNN 2.51).
PROBE_ARCHS = (68, 69, 73, 75, 79, 81)

_lock = threading.Lock()
_registered = False
_status_cache: dict | None = None

_TARGET_RE = re.compile(rb"soc_type=([A-Za-z0-9_]+);arch=(\d+)")
_LIMIT_RE = re.compile(rb"memory_alloc_limit=(\d+)")


class QnnUnavailableError(RuntimeError):
    """onnxruntime-qnn is not installed or its EP library does not load; the message says which and what to do."""


def qnn_installed() -> bool:
    """Whether ``onnxruntime_qnn`` can be imported (nothing is registered)."""
    try:
        import onnxruntime_qnn  # noqa: F401  (only whether it imports)
    except ImportError:
        return False
    return True


def ensure_registered() -> list:
    """Register the QNN plugin EP with onnxruntime once per process and return its ``OrtEpDevice`` list.

    Raises QnnUnavailableError when the package is missing, the library does not load, or no device is listed.
    """
    global _registered
    try:
        import onnxruntime as ort
        import onnxruntime_qnn as qnn
    except ImportError as e:
        raise QnnUnavailableError(
            f"onnxruntime-qnn is not installed ({e}); install it with: pip install -e '.[qnn]'"
        ) from None
    with _lock:
        if not _registered:
            if not any(d.ep_name == EP_NAME for d in ort.get_ep_devices()):
                try:
                    ort.register_execution_provider_library(EP_NAME, qnn.get_library_path())
                except Exception as e:  # noqa: BLE001 - onnxruntime raises its own types
                    raise QnnUnavailableError(
                        f"the QNN EP library {qnn.get_library_path()} did not load: {e}"
                    ) from None
            _registered = True
    devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise QnnUnavailableError("onnxruntime lists no QNNExecutionProvider device after registering the library")
    return devices


def versions() -> dict[str, str | None]:
    """``{"onnxruntime": ..., "onnxruntime-qnn": ..., "qnn_sdk": ...}``; None for what is not installed."""
    out: dict[str, str | None] = {"onnxruntime": None, "onnxruntime-qnn": None, "qnn_sdk": None}
    try:
        import onnxruntime as ort

        out["onnxruntime"] = ort.__version__
    except ImportError:
        pass
    try:
        import onnxruntime_qnn as qnn

        out["onnxruntime-qnn"] = qnn.__version__
        out["qnn_sdk"] = getattr(qnn.build_and_package_info, "qnn_version", None)
    except ImportError:
        pass
    return out


def devices() -> list[dict]:
    """The QNN EP devices onnxruntime lists, as plain dicts (type, vendor, EP metadata)."""
    return [
        {
            "ep_name": d.ep_name,
            "ep_vendor": d.ep_vendor,
            "device_type": str(d.device.type).split(".")[-1],
            "device_vendor": d.device.vendor,
            "ep_metadata": dict(d.ep_metadata),
        }
        for d in ensure_registered()
    ]


def session_options(
    provider_options: dict[str, str], config: dict[str, str] | None = None, log_severity: int | None = None
):
    """An ``onnxruntime.SessionOptions`` with the QNN EP added for its devices, plus session config entries."""
    import onnxruntime as ort

    devs = ensure_registered()
    so = ort.SessionOptions()
    if log_severity is not None:
        so.log_severity_level = log_severity
    for k, v in (config or {}).items():
        so.add_session_config_entry(k, str(v))
    so.add_provider_for_devices(devs, dict(provider_options))
    return so


class SharedMemoryUnavailable(QnnUnavailableError):
    """The QNN EP on this platform has no HTP shared-memory allocator (`htp_shared_memory_info`)."""


def htp_shared_memory_info():
    """The ``OrtMemoryInfo`` of the QNN EP's HTP shared-memory allocator ("QnnHtpShared", host-accessible: numpy
    reads and writes it in place, the HTP reads it without a copy), for ``OrtValue.ortvalue_from_shape_and_type(...,
    memory_info=...)``; sessions that bind such values need the provider option
    ``enable_htp_shared_memory_allocator=1`` (onnxruntime-qnn ``docs/execution_providers/QNN-ExecutionProvider.md``).

    The allocator is RPCMem, from ``libcdsprpc.so`` (``.dll`` on Windows), the FastRPC library a Snapdragon device's
    vendor image ships: on an x86 host (the HTP simulator) the EP lists no host-accessible memory and a session with
    the option fails to create. Raises SharedMemoryUnavailable then (and QnnUnavailableError without the EP).
    """
    import onnxruntime as ort

    for device in ensure_registered():
        info = device.memory_info(ort.OrtDeviceMemoryType.HOST_ACCESSIBLE)
        if info is not None:
            return info
    raise SharedMemoryUnavailable(
        "the QNN EP here has no HTP shared-memory allocator (no host-accessible memory: libcdsprpc.so, the FastRPC "
        "library of a Snapdragon device, is not on this platform; the x86 HTP simulator has none). Run without "
        "htp_shared_memory (the graphs then read the host's buffers through a copy), or on a Snapdragon Android/"
        "Windows device whose libcdsprpc.so (.dll) the QNN EP can load"
    )


@dataclass(frozen=True)
class BinaryTarget:
    """What the HTP backend wrote into a context binary's config: SoC name, arch, memory limit (MiB)."""

    soc_type: str
    arch: int
    memory_alloc_limit_mib: int | None


def read_binary_target(path: str | os.PathLike, scan_bytes: int = 64 * 1024 * 1024) -> BinaryTarget | None:
    """Read the ``soc_type=...;arch=NN`` the QNN HTP backend records in a context binary (first ``scan_bytes``).

    This is an undocumented text field inside QNN's binary (seen with QNN 2.51): None when it is not found.
    """
    tail = b""
    with open(path, "rb") as f:
        read = 0
        while read < scan_bytes:
            chunk = f.read(4 * 1024 * 1024)
            if not chunk:
                break
            buf = tail + chunk
            m = _TARGET_RE.search(buf)
            if m:
                lim = _LIMIT_RE.search(buf)
                return BinaryTarget(m.group(1).decode(), int(m.group(2)), int(lim.group(1)) if lim else None)
            tail = buf[-256:]
            read += len(chunk)
    return None


def run_worker(job: dict, timeout_s: float = 3600) -> tuple[dict, str]:
    """Run one job in ``python -m hycoc.targets._qnn_worker`` and return (result dict, the child's stderr).

    The child writes its result as JSON to a file; a child that dies without one yields
    ``{"ok": False, "error": "...", "crashed": True}``.
    """
    with tempfile.TemporaryDirectory(prefix="hycoc-qnn-") as tmp:
        job_path, res_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        env = dict(os.environ)
        proc = subprocess.run(
            [sys.executable, "-m", "hycoc.targets._qnn_worker", str(job_path), str(res_path)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
        if res_path.exists():
            return json.loads(res_path.read_text()), proc.stderr
        return (
            {"ok": False, "crashed": True, "error": f"QNN worker exited with code {proc.returncode} and no result"},
            proc.stderr,
        )


def probe_archs(archs: tuple[int, ...] = PROBE_ARCHS) -> dict[int, dict]:
    """Compile a trivial uint16-activation QDQ MatMul for each arch (child process) and read back the binary's arch.

    Returns ``{arch: {"ok": bool, "soc_type": str|None, "compiled_arch": int|None, "memory_alloc_limit_mib":
    int|None, "seconds": float, "error": str|None}}``. An arch counts as compilable only when the binary says
    that arch (QNN silently compiles unknown archs for a generic v68).
    """
    from hycoc.targets.profiles import PROFILES

    soc_ids = {p.htp_arch: p.soc_id for p in PROFILES.values() if p.backend == "htp"}
    jobs = [{"htp_arch": a, "soc_id": soc_ids.get(a)} for a in archs]
    res, err = run_worker({"op": "probe", "archs": jobs}, timeout_s=600)
    out: dict[int, dict] = {}
    for a in archs:
        r = (res.get("archs") or {}).get(str(a)) or {"ok": False, "error": res.get("error") or err[-500:]}
        tgt = r.get("target") or {}
        ok = bool(r.get("ok")) and tgt.get("arch") == a
        out[a] = {
            "ok": ok,
            "soc_type": tgt.get("soc_type"),
            "compiled_arch": tgt.get("arch"),
            "memory_alloc_limit_mib": tgt.get("memory_alloc_limit_mib"),
            "seconds": r.get("seconds"),
            "error": r.get("error") if not ok else None,
        }
    return out


def qnn_status(*, refresh: bool = False, probe: bool = True) -> dict:
    """What this install of the QNN EP can do; cached per process (``refresh=True`` re-probes).

    Returns a dict: ``installed``, ``loads`` (bool), ``error`` (why not, or None), ``versions`` (onnxruntime,
    onnxruntime-qnn, qnn_sdk), ``devices``, and with ``probe=True`` ``archs`` (see :func:`probe_archs`) and
    ``compilable_archs`` (sorted list of arch numbers whose trivial compile produced a binary of that arch).
    """
    global _status_cache
    if _status_cache is not None and not refresh and (not probe or "archs" in _status_cache):
        return _status_cache
    st: dict = {"installed": qnn_installed(), "loads": False, "error": None, "versions": versions(), "devices": []}
    if not st["installed"]:
        st["error"] = "onnxruntime-qnn is not installed (pip install -e '.[qnn]')"
        _status_cache = st
        return st
    try:
        st["devices"] = devices()
        st["loads"] = True
    except QnnUnavailableError as e:
        st["error"] = str(e)
    if probe and st["loads"]:
        try:
            st["archs"] = probe_archs()
        except Exception as e:  # noqa: BLE001 - a broken probe is reported, not raised
            st["archs"] = {}
            st["error"] = f"arch probe failed: {e}"
        st["compilable_archs"] = sorted(a for a, r in st["archs"].items() if r["ok"])
    _status_cache = st
    return st
