"""The measuring harness of the build-check benchmarks (benchmarks/real_shape_head.py, benchmarks/real_shape_slm.py).

`Steps` runs named steps and records, per step: wall seconds, CPU seconds of this process and its children (psutil
``Process.cpu_times``: user + system, plus finished children's, plus the live children's at the end), this
process's peak RSS (Linux ``VmHWM``, reset before the step through ``/proc/self/clear_refs``; elsewhere the sampled
peak), and the peak RSS of this process plus all its descendants (psutil ``children(recursive=True)``, sampled every
0.2 s: the QNN compile runs in a child process), the bytes the step wrote, and its status. A failed step is a
measured result (its error and traceback go into the row); KeyboardInterrupt still stops the run.

Around the steps: file sizes (`du`, `onnx_files`, `initializer_bits`), the CPU EP run the simulators are compared
with (`cpu_run`), one run on the HTP simulator (`htp_simulate`) and a compile step's details (`compiled_details`),
SQNR for a report (`sqnr_rounded`), the synthetic keep set both checks draw (`synthetic_keep_set`), a shorter
timeout for the QNN worker (`qnn_worker_timeout`), and the report's common parts (`machine`, `needs`,
`report_end`, `write_report`, `human_bytes`, `step_cells`; package versions come from
`hycoc.doctor.package_versions`) and the run around the steps (`run_and_report`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import shutil
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

GIB = 1024**3
#: How often `RssSampler` polls the process tree, in seconds.
SAMPLE_EVERY_S = 0.2


# ---- process resources ------------------------------------------------------------------------------------------


def cpu_seconds(proc: psutil.Process | None = None) -> float:
    """CPU seconds (user + system) of ``proc`` (default: this process), its finished children that were waited
    for, and its live descendants now (psutil ``cpu_times``); a descendant that exits unwaited is not counted."""
    proc = proc or psutil.Process()
    t = proc.cpu_times()
    total = t.user + t.system + t.children_user + t.children_system
    for child in _descendants(proc):
        with contextlib.suppress(psutil.Error):
            c = child.cpu_times()
            total += c.user + c.system
    return total


def _descendants(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return proc.children(recursive=True)
    except psutil.Error:
        return []


def rss_bytes(proc: psutil.Process | None = None) -> tuple[int, int]:
    """(RSS of ``proc``, summed RSS of its live descendants) in bytes (psutil ``memory_info().rss``)."""
    proc = proc or psutil.Process()
    kids = 0
    for child in _descendants(proc):
        with contextlib.suppress(psutil.Error):
            kids += child.memory_info().rss
    return proc.memory_info().rss, kids


def _status_kib(field: str) -> int | None:
    """``field`` (kB) of /proc/self/status (Linux), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (``VmHWM``, Linux: writing 5 to /proc/self/clear_refs); False where that is
    not possible (the peak then is the process's to date)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int | None:
    """This process's peak RSS since the last `reset_peak_rss` (Linux ``VmHWM``), or None where the OS has none."""
    kib = _status_kib("VmHWM")
    return None if kib is None else kib * 1024


class RssSampler(threading.Thread):
    """Polls the RSS of this process and its descendants every ``every`` seconds until `stop`: ``peak`` (bytes,
    process + descendants at one instant), ``peak_children`` (descendants alone), ``peak_self`` (this process)."""

    def __init__(self, every: float = SAMPLE_EVERY_S):
        super().__init__(daemon=True)
        self.every, self.peak, self.peak_children, self.peak_self = every, 0, 0, 0
        self._stop_evt = threading.Event()
        self._proc = psutil.Process()

    def run(self) -> None:
        while not self._stop_evt.is_set():
            self.sample()
            self._stop_evt.wait(self.every)

    def sample(self) -> None:
        """One poll (also the last one, at `stop`)."""
        me, kids = rss_bytes(self._proc)
        self.peak_self = max(self.peak_self, me)
        self.peak_children = max(self.peak_children, kids)
        self.peak = max(self.peak, me + kids)

    def stop(self) -> None:
        self._stop_evt.set()
        self.join()
        self.sample()


# ---- steps ------------------------------------------------------------------------------------------------------


class Steps:
    """Runs named steps and records each one as a row (module docstring); ``rows`` go into the report.

    A row: ``step``, ``what``, ``status`` (ok / failed; callers append ``skipped`` rows themselves),
    ``output_bytes``, ``details`` (the step's own dict), ``error`` when failed, ``seconds`` (wall), ``cpu_seconds``,
    ``peak_rss_gib`` (this process, exact when ``peak_rss_exact``), ``peak_tree_rss_gib`` (process + descendants),
    ``peak_children_rss_gib``, ``rss_before_gib``, ``rss_after_gib``. ``console``: a rich Console for one progress
    line per step, or None.
    """

    def __init__(self, console=None):
        self.rows: list[dict[str, Any]] = []
        self.console = console

    def run(self, name: str, fn: Callable[[], tuple[Any, int, dict]], *, what: str = "") -> Any:
        """``fn()`` -> (result, output_bytes, details dict). Returns the result, or None when it raised (the
        step is recorded as failed with the error)."""
        gc.collect()
        exact = reset_peak_rss()
        proc = psutil.Process()
        sampler = RssSampler()
        sampler.start()
        rss0 = proc.memory_info().rss
        cpu0 = cpu_seconds(proc)
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
            row["cpu_seconds"] = round(cpu_seconds(proc) - cpu0, 2)
            sampler.stop()
            hwm = peak_rss_bytes()
            own = sampler.peak_self if hwm is None else hwm
            row["peak_rss_gib"] = round(own / GIB, 3)
            row["peak_rss_exact"] = exact and hwm is not None  # False: the process's peak to date, or sampled
            row["peak_tree_rss_gib"] = round(max(sampler.peak, own) / GIB, 3)
            row["peak_children_rss_gib"] = round(sampler.peak_children / GIB, 3)
            row["rss_before_gib"] = round(rss0 / GIB, 3)
            row["rss_after_gib"] = round(proc.memory_info().rss / GIB, 3)
            self.rows.append(row)
            if self.console is not None:
                mark = "ok" if row["status"] == "ok" else f"FAILED: {row.get('error', '')[:300]}"
                self.console.print(
                    f"[{row['seconds']:8.1f} s  peak {row['peak_tree_rss_gib']:6.2f} GiB] {name}: {mark}"
                )
        return result

    def skip(self, name: str, what: str) -> None:
        """Record ``name`` as skipped (not run), saying why in ``what``."""
        self.rows.append({"step": name, "status": "skipped", "seconds": 0, "output_bytes": 0, "what": what})

    @property
    def failed(self) -> list[str]:
        """Names of the failed steps, in order."""
        return [r["step"] for r in self.rows if r.get("status") == "failed"]

    @property
    def peak_rss_gib(self) -> float:
        """The largest ``peak_tree_rss_gib`` over the steps (0 with none)."""
        return max((r.get("peak_tree_rss_gib", 0) for r in self.rows), default=0)


# ---- files and graphs -------------------------------------------------------------------------------------------


def du(*paths: str | os.PathLike) -> int:
    """Bytes on disk of files and folders (recursively); a path that does not exist counts 0."""
    total = 0
    for p in map(Path, paths):
        if p.is_file():
            total += p.stat().st_size
        elif p.is_dir():
            total += sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return total


def onnx_files(path: Path) -> list[Path]:
    """An ONNX file and its external-data files: the files next to ``path`` whose names start with its name."""
    return [p for p in path.parent.iterdir() if p.name.startswith(path.name)]


def initializer_bits(path: Path) -> dict[str, dict[str, int]]:
    """Initializer dtype name -> {tensors, values, bytes} of a saved ONNX file (no external data read; bytes as
    the HTP size planner counts them, `hycoc.targets.htp.initializer_bytes`)."""
    import onnx

    from hycoc.targets.htp import initializer_bytes

    model = onnx.load(str(path), load_external_data=False)
    out: dict[str, dict[str, int]] = {}
    for t in model.graph.initializer:
        name = onnx.TensorProto.DataType.Name(t.data_type)
        e = out.setdefault(name, {"tensors": 0, "values": 0, "bytes": 0})
        e["tensors"] += 1
        e["values"] += int(np.prod(t.dims)) if len(t.dims) else 1
        e["bytes"] += initializer_bytes(t)
    return out


def cpu_run(path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Outputs (name -> array) of the ONNX graph at ``path`` on onnxruntime's CPU EP, fed by name from ``feed``
    (extra entries are ignored)."""
    import onnxruntime as ort

    s = ort.InferenceSession(str(path), ort.SessionOptions(), providers=["CPUExecutionProvider"])
    names = [o.name for o in s.get_outputs()]
    return dict(zip(names, s.run(names, {i.name: feed[i.name] for i in s.get_inputs()})))


def sqnr_rounded(ref: np.ndarray, x: np.ndarray) -> float:
    """`hycoc.numerics.sqnr_db` rounded to 0.01 dB for a report (inf and nan kept as they are)."""
    from hycoc.numerics import sqnr_db

    v = sqnr_db(ref, x)
    return round(v, 2) if np.isfinite(v) else v


@contextlib.contextmanager
def qnn_worker_timeout(seconds: float) -> Iterator[None]:
    """Within the block, every `hycoc.targets.qnn_ep.run_worker` call waits at most ``seconds`` (compile_context
    asks for 3,600 s); the original function is put back on exit."""
    import hycoc.targets.qnn_ep as qnn_ep

    orig = qnn_ep.run_worker
    qnn_ep.run_worker = lambda job, timeout_s=3600: orig(job, timeout_s=min(timeout_s, seconds))
    try:
        yield
    finally:
        qnn_ep.run_worker = orig


def synthetic_keep_set(size: int, vocab: int, seed: int = 0) -> np.ndarray:
    """``size`` sorted distinct token ids drawn uniformly from [0, ``vocab``) with ``seed`` (int64): a stand-in keep
    set whose size, not its ids, is what the build checks measure (no corpus is read). Raises ValueError for a size
    outside [1, vocab]."""
    if not 1 <= size <= vocab:
        raise ValueError(f"--keep-set {size}: must lie in [1, {vocab}]")
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(vocab, size=size, replace=False)).astype(np.int64)


# ---- the report -------------------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """Host, CPUs, Python, total memory (GiB, psutil) and the load average when the run ends."""
    return {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "mem_total_gib": round(psutil.virtual_memory().total / GIB, 1),
        "loadavg": [round(x, 2) for x in psutil.getloadavg()],
    }


def needs(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The machine the measured steps need: the largest tree peak (and RAM to recommend: 1.25 x + 1 GiB) and the
    slowest step; {} when no step succeeded."""
    ok = [r for r in rows if r.get("status") == "ok"]
    if not ok:
        return {}
    peak = max(ok, key=lambda r: r.get("peak_tree_rss_gib", 0))
    slow = max(ok, key=lambda r: r.get("seconds", 0))
    return {
        "peak_step": peak["step"],
        "peak_rss_gib": peak["peak_tree_rss_gib"],
        "ram_gib_recommended": round(peak["peak_tree_rss_gib"] * 1.25 + 1, 1),
        "slowest_step": slow["step"],
        "slowest_seconds": slow["seconds"],
    }


def check_parser(doc: str) -> argparse.ArgumentParser:
    """A build check's argument parser, described by the first paragraph of ``doc`` (the script's docstring), shown
    as written (``RawDescriptionHelpFormatter``)."""
    return argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )


def add_run_options(p: argparse.ArgumentParser, out: Path, toy_help: str) -> None:
    """The options a build check's parser ends with, in this order: ``--out`` (the report JSON, default ``out``),
    ``--work``, ``--keep-work``, ``--quiet`` and ``--toy-dims`` (``toy_help``: the toy widths it runs at)."""
    p.add_argument("--out", default=str(out), help="report JSON (default %(default)s)")
    p.add_argument("--work", default=None, help="work folder (default: temporary, removed unless --keep-work)")
    p.add_argument("--keep-work", action="store_true", help="keep the work folder")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--toy-dims", action="store_true", help=f"tests only: {toy_help}; NOT real shapes")


def report_end(steps: Steps, versions: dict[str, Any], **machine_extra: Any) -> dict[str, Any]:
    """The keys a build check's report ends with, in this order: ``machine`` (`machine`, then ``machine_extra``, e.g.
    torch's thread count), ``versions`` (the caller's `hycoc.doctor.package_versions`), ``steps`` (`Steps.rows`),
    ``peak_rss_gib`` (GiB), ``failed`` (step names) and ``needs`` (`needs`)."""
    return {
        "machine": {**machine(), **machine_extra},
        "versions": versions,
        "steps": steps.rows,
        "peak_rss_gib": steps.peak_rss_gib,
        "failed": steps.failed,
        "needs": needs(steps.rows),
    }


def run_and_report(
    args: Any,
    work: Path,
    chain: Callable[[], None],
    report: Callable[[], dict[str, Any]],
    print_table: Callable[[dict[str, Any]], None],
    release: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """A build check's run: ``chain()`` (the steps), then ``report()`` written to ``args.out`` (`write_report`) and,
    unless ``args.quiet``, printed (``print_table``). Whatever happens, ``release()`` (what the steps still hold)
    runs and the work folder is removed unless it was given (``args.work``) or ``args.keep_work``. Returns the report;
    exceptions other than a failed step's (`Steps.run` records those) propagate."""
    try:
        chain()
        out = report()
        write_report(args.out, out)
        if not args.quiet:
            print_table(out)
    finally:
        if release is not None:
            release()
        if not args.work and not args.keep_work:
            shutil.rmtree(work, ignore_errors=True)
    return out


def step_cells(r: dict[str, Any], note: str, *, cpu: bool) -> list[str]:
    """One `Steps.rows` row as a build check's table cells: step, status, seconds, CPU seconds (when ``cpu``), peak
    RSS GiB, tree peak GiB, output bytes (`human_bytes`), and ``note`` -- a failed step's error (160 characters)."""
    if r.get("status") == "failed":
        note = (r.get("error") or "")[:160]
    return [
        r["step"],
        r.get("status", ""),
        f"{r.get('seconds', 0):.1f}",
        *([f"{r.get('cpu_seconds', 0):.1f}"] if cpu else []),
        f"{r.get('peak_rss_gib', 0):.2f}",
        f"{r.get('peak_tree_rss_gib', 0):.2f}",
        human_bytes(r.get("output_bytes", 0)),
        note,
    ]


def json_default(o):
    """JSON for numpy scalars (as Python numbers), paths and anything else (its str)."""
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    return str(o)


def write_report(path: str | os.PathLike, report: dict) -> Path:
    """Write ``report`` as indented JSON to ``path`` (its folder made), through a temporary file renamed when
    complete; returns the path."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report, indent=1, default=json_default), encoding="utf-8")
    os.replace(tmp, out)
    return out


def human_bytes(n: int | float) -> str:
    """Bytes in decimal units for a table: "512 B", "1.5 KB", ... "2.1 GB"."""
    n = float(n or 0)
    for unit in ("B", "KB", "MB"):
        if n < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def compiled_details(cg, profile, **extra) -> dict[str, Any]:
    """The details of a compile step: ``cg`` a `hycoc.targets.htp.CompiledGraph`, ``profile`` the
    `hycoc.targets.profiles.TargetProfile` it was compiled for, ``extra`` more keys."""
    d = {
        "profile": profile.name,
        "htp_arch": cg.htp_arch,
        "soc_type": cg.soc_type,
        "binary_bytes": cg.binary_bytes,
        "weight_bytes": cg.weight_bytes,
        "compile_seconds": round(cg.compile_seconds, 2),
        "cpu_fallback": "disabled",
    }
    return {**d, **extra}


def htp_simulate(
    ctx_model: Path, profile, feed: dict[str, np.ndarray]
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One run of a compiled graph on the HTP simulator: (outputs, {load_seconds, run_seconds})."""
    from hycoc.targets.htp import HtpSession

    t0 = time.perf_counter()
    sess = HtpSession(ctx_model, profile)
    t1 = time.perf_counter()
    out = sess.run(feed)
    return out, {"load_seconds": round(t1 - t0, 2), "run_seconds": round(time.perf_counter() - t1, 2)}
