"""The verifier a bench talks to (`hycoc.bench.paper.runner`): ``hycoc verify-server`` in a child process
(`VerifierProcess`), and the CPU time that process spends while a request runs (`process_cpu_ms`, `busy_since`),
which the records keep as ``server_busy_ms``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from hycoc.bench.paper.records import BenchError


class VerifierProcess:
    """``hycoc verify-server`` in a child process on a free loopback port; ``url`` once listening.

    extra_args: more verify-server options (e.g. ``["--batching", "serial"]``). error: the exception class raised
    (with the server's stderr) when it exits or does not listen within ``timeout_s`` (default BenchError)."""

    def __init__(
        self,
        recipe_path: Path,
        keep_set: Path | None,
        timeout_s: float = 300.0,
        extra_args: Sequence[str] = (),
        error: type[Exception] | None = None,
    ):
        error = error or BenchError
        cmd = [
            sys.executable,
            "-m",
            "hycoc.cli",
            "verify-server",
            str(recipe_path),
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            *extra_args,
        ]
        if keep_set is not None:
            cmd += ["--keep-set", str(keep_set)]
        self._err = tempfile.TemporaryFile(mode="w+")
        self._stderr = ""
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        stdout = self.proc.stdout  # a pipe (stdout=PIPE)
        if stdout is None:
            raise error("the verifier server was started without a pipe for its output")
        url: str | None = None
        deadline = time.monotonic() + timeout_s
        while url is None:
            line = stdout.readline()
            if not line:
                self.stop()
                raise error(f"the verifier server exited before listening: {self.stderr_tail()}")
            if "listening on " in line:
                url = line.split("listening on ", 1)[1].split()[0]
            if time.monotonic() > deadline:
                self.stop()
                raise error(f"the verifier server did not listen within {timeout_s:g} s")
        self.url: str = url
        self.deadline = deadline

    def stderr_tail(self, lines: int = 5) -> str:
        if not self._err.closed:
            self._err.seek(0)
            self._stderr = self._err.read()
        return " | ".join(self._stderr.strip().splitlines()[-lines:]) or "(no output)"

    def stop(self) -> None:
        """Terminate the server (SIGTERM, then SIGKILL after 20 s) and close its stderr file (its text is kept
        for `stderr_tail`)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self._err.closed:
            self.stderr_tail()
            self._err.close()
        if self.proc.stdout is not None and not self.proc.stdout.closed:
            self.proc.stdout.close()

    def __enter__(self) -> VerifierProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


# ---- busy time of the verifier process ----------------------------------------------------------------------


def process_cpu_ms(pid: int) -> float | None:
    """CPU time (user + system, every thread, exited ones included) the process ``pid`` has used, in ms: fields 14
    and 15 of ``/proc/PID/stat`` (proc(5)) over ``SC_CLK_TCK`` (resolution 1 / SC_CLK_TCK s, 10 ms on Linux). None
    where there is no /proc (not Linux) or the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # after "(comm)", which may hold spaces
        return 1000.0 * (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def busy_since(pid: int | None, start: float | None) -> float | None:
    """`process_cpu_ms` of ``pid`` now minus ``start`` (ms), None when either is unknown."""
    now = process_cpu_ms(pid) if pid is not None else None
    return None if now is None or start is None else max(0.0, now - start)
