"""onnxruntime sessions of a bundle's graphs (`hycoc.runtime.graphs.GraphRunner` opens them): the cpu backend's
session options (`cpu_session_options`: one intra-op thread per session unless told otherwise, no spinning), the
htp backend's QNN EP provider options (`htp_provider_options`: the manifest target's profile, then the session
settings, then the shared-memory allocator), and the session itself on either (`open_session`).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

from hycoc.runtime.htp_session import HtpSessionSettings

from hycoc.bundle import Manifest, TargetMismatch


@contextlib.contextmanager
def _native_stdout_to_stderr():
    """Silence what native libraries print on file descriptor 1 meanwhile: the QNN HTP libraries print a banner on
    stdout when they load, and stdout carries the answer text (and ``--json``). Their errors reach onnxruntime's
    exceptions and log (stderr), not fd 1."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        os.close(devnull)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


#: Intra-op threads per graph session on the cpu backend when the caller names none (``hycoc run --threads``).
CPU_THREADS = 1


def cpu_session_options(threads: int | None = None):
    """onnxruntime SessionOptions of a drafter graph on the cpu backend: ``threads`` intra-op threads (default
    `CPU_THREADS`; 0 = onnxruntime's own default, one per physical core), one inter-op thread, sequential execution,
    and no spinning (``session.intra_op.allow_spinning = 0``).

    Why: the runtime calls its graphs one at a time from one thread (head steps, SLM forwards, host work between
    them: paper Alg. 1-3), and each of its two or three sessions would otherwise own a pool of one thread per core
    whose workers spin after every run (onnxruntime's default, ``docs/performance/tune-performance/threading``),
    taking the cores the host's tree building and the other sessions need. Measured on the toy bundle (replay of
    recorded rounds, ``benchmarks/runtime_replay.py --threads``): docs/device-runtime.md (the cpu backend's threads)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    n = CPU_THREADS if threads is None else int(threads)
    if n:
        so.intra_op_num_threads = n
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    so.log_severity_level = 3
    return so


def htp_provider_options(
    manifest: Manifest, settings: HtpSessionSettings | None = None, shared_memory: bool = False
) -> dict[str, str]:
    """The QNN EP provider options of a bundle's graph on the htp backend: the manifest target's profile
    (``backend_type``, ``htp_arch``, ``soc_model``, its finalization mode; `hycoc.targets.profiles.profile_for`),
    then ``settings`` (`hycoc.runtime.htp_session.HtpSessionSettings`: performance mode, context priority, RPC
    latency, a finalization mode when set; None = its defaults), then the shared-memory allocator when asked.
    Raises TargetMismatch for a bundle that names no HTP arch / SoC."""
    from hycoc.targets.profiles import profile_for

    t = manifest.target
    if t.htp_arch is None or t.soc_model is None:
        raise TargetMismatch("backend htp needs a bundle built for an HTP target; this one names no HTP arch/SoC")
    options = profile_for(t.htp_arch, t.soc_model, None).provider_options()
    options.update((settings or HtpSessionSettings()).provider_options())
    if shared_memory:  # RPCMem buffers the HTP reads in place (`htp_shared_memory_info`)
        options["enable_htp_shared_memory_allocator"] = "1"
    return options


def open_session(
    path: Path,
    backend: str,
    manifest: Manifest,
    threads: int | None,
    shared_memory: bool = False,
    context_group: bool = False,
    htp: HtpSessionSettings | None = None,
):
    """An onnxruntime InferenceSession of the graph at ``path`` on ``backend``: "cpu", the CPU EP with
    `cpu_session_options`; "htp", the QNN EP with `htp_provider_options` (``htp`` settings, the shared-memory
    allocator when ``shared_memory``), CPU fallback disabled, joining the EP context group when ``context_group``
    (layer shards), the QNN libraries' stdout banner sent to stderr. Raises what onnxruntime raises."""
    import onnxruntime as ort

    if backend == "cpu":
        return ort.InferenceSession(
            str(path), sess_options=cpu_session_options(threads), providers=["CPUExecutionProvider"]
        )
    from hycoc.targets.qnn_ep import session_options

    options = htp_provider_options(manifest, htp, shared_memory)
    with _native_stdout_to_stderr():
        config = {"session.disable_cpu_ep_fallback": "1"}
        if context_group:  # layer shards: one EP context group (`ShardChainRunner`)
            config["ep.share_ep_contexts"] = "1"
        so = session_options(options, config, log_severity=3)
        return ort.InferenceSession(str(path), sess_options=so)
