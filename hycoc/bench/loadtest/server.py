"""The verifier side of `hycoc loadtest` (`hycoc.bench.loadtest.run`): `ServerProcess` starts ``hycoc verify-server
RECIPE --port 0`` in its own process (so client and server never share a GIL), passes ``--batching MODE`` when that
server has the option (`server_batching_support`), and waits for its ``/healthz``; `server_mode` reads the mode a
server reports there; `scrape_metrics` reads ``/metrics`` before and after each run so the report can take rows per
forward from the server's histograms where it has them.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from hycoc.bench.verifier_process import VerifierProcess
from hycoc.serving_limits import SERVER_MODES


class LoadTestError(RuntimeError):
    """The load test cannot start or go on (the server did not start, a mode it does not have, ...). The message
    says what to do."""


def server_batching_support() -> bool:
    """Whether this hycoc's ``verify-server`` has the options of every `MODE_ARGS` mode (``--batching``,
    ``--tree-budget``): its ``--help`` names them."""
    out = subprocess.run(
        [sys.executable, "-m", "hycoc.cli", "verify-server", "--help"],
        capture_output=True,
        text=True,
        env=dict(os.environ, COLUMNS="200"),
        timeout=120,
    )
    return all(arg in out.stdout for args in MODE_ARGS.values() for arg in args if arg.startswith("--"))


#: `hycoc verify-server` arguments of each load-test mode (`hycoc.serving_limits.SERVER_MODES`, the one list).
MODE_ARGS = {mode: list(args) for mode, args in SERVER_MODES.items()}


class ServerProcess(VerifierProcess):
    """``hycoc verify-server RECIPE --host 127.0.0.1 --port 0 [--batching MODE] [--keep-set F]`` in a child
    process (`hycoc.bench.verifier_process.VerifierProcess`), ready once it printed its URL and ``GET /healthz``
    answered status ok. ``url``: ``ws://HOST:PORT``; ``health``: that /healthz document.

    batching: a `MODE_ARGS` mode, passed as its arguments when not None (the caller checks
    `server_batching_support`). Raises
    LoadTestError with the server's stderr when it exits or is not healthy within ``timeout_s``."""

    def __init__(
        self, recipe_path: Path, *, batching: str | None = None, keep_set: Path | None = None, timeout_s: float = 300.0
    ):
        super().__init__(
            recipe_path,
            keep_set,
            timeout_s,
            extra_args=MODE_ARGS[batching] if batching is not None else [],
            error=LoadTestError,
        )
        self.health: dict = {}
        while True:
            try:
                self.health = healthz(self.url)
                if self.health.get("status") == "ok":
                    break
            except OSError:
                pass
            if time.monotonic() > self.deadline or self.proc.poll() is not None:
                self.stop()
                raise LoadTestError(f"the verifier at {self.url} did not answer /healthz: {self.stderr_tail()}")
            time.sleep(0.2)


def server_mode(health: dict) -> str:
    """The load-test mode a server reports in /healthz (``"batching": {"mode": ..., "tree_budget": ...,
    "allowance": ...}``): "allowance" for a batched server with the allowance auto, "budgeted" for one with
    tree_budget auto, else its mode; "serial" for a server without that field (servers before cross-session
    batching verified one session per forward)."""
    batching = health.get("batching")
    if not isinstance(batching, dict):
        return "serial"
    mode = str(batching.get("mode", "serial"))
    if mode == "batched" and batching.get("allowance") == "auto":
        return "allowance"
    return "budgeted" if mode == "batched" and batching.get("tree_budget") == "auto" else mode


def _http(url: str) -> str:
    return "http" + url.removeprefix("ws")


def healthz(url: str, timeout_s: float = 5.0) -> dict:
    """The server's ``GET /healthz`` JSON (url: ``ws://HOST:PORT``). Raises OSError when it does not answer."""
    with urllib.request.urlopen(_http(url) + "/healthz", timeout=timeout_s) as r:
        return json.loads(r.read().decode("utf-8"))


def check_server(url: str, timeout_s: float = 5.0) -> dict:
    """`healthz` of a running server given as ``--server``, or LoadTestError naming the URL and the fix when
    nothing answers (checked before anything is recorded or replayed)."""
    try:
        return healthz(url, timeout_s)
    except (OSError, ValueError) as e:
        raise LoadTestError(
            f"--server {url}: no hycoc verify-server answered {_http(url)}/healthz ({e}): start one "
            "(hycoc verify-server RECIPE) or leave --server out to start one per mode"
        ) from None


def scrape_metrics(url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The unlabelled samples of the server's ``GET /metrics`` (Prometheus text format 0.0.4): name -> value, e.g.
    ``hycoc_rounds_total``, ``hycoc_batch_rows_sum``, ``hycoc_batch_rows_count``. Labelled samples
    (``name{...}``) are left out. Returns {} when the server does not answer."""
    try:
        with urllib.request.urlopen(_http(url) + "/metrics", timeout=timeout_s) as r:
            text = r.read().decode("utf-8")
    except OSError:
        return {}
    return parse_metrics(text)


def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text exposition: name -> float (NaN for ``NaN``). Comments, blank lines
    and labelled samples are skipped."""
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        parts = line.split()
        if len(parts) >= 2:
            try:
                out[parts[0]] = float(parts[1])
            except ValueError:
                continue
    return out


__all__ = [
    "MODE_ARGS",
    "LoadTestError",
    "ServerProcess",
    "check_server",
    "healthz",
    "parse_metrics",
    "scrape_metrics",
    "server_batching_support",
    "server_mode",
]
