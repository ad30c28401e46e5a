"""Throughput of the verifier behind Ray Serve with 1 and 2 replicas, beside a plain `hycoc verify-server`
(docs/serving.md "Scale out with Ray Serve").

For each server (``hycoc serve-ray RECIPE --replicas N`` and ``hycoc verify-server RECIPE``) started in turn on
loopback, ``hycoc loadtest RECIPE --sessions S --duration D --server URL`` drives S simulated devices; the table has
its committed tok/s and p90 round latency, and the CPU seconds each server-side process group spent during the run
(``/proc/PID/stat`` utime + stime: the replicas, Ray Serve's proxy, its controller, raylet + GCS; or the plain
server), so the cost per token can be read apart from the machine's load (the load average is printed beside).

    python benchmarks/ray_serve_scaling.py recipes/toy.toml --sessions 16 --duration 20 --repeats 2

Needs the serve extra (installed with the other extras in one command:
``pip install -e ".[full,dev,qnn,hub,serve]"``) and the loadtest trace (``hycoc loadtest`` records it once).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """utime + stime of a live process, seconds (0 for a process that is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / TICK


def pgrep(pattern: str) -> list[int]:
    out = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    return [int(p) for p in out]


def start(cmd: list[str], log: Path, env: dict) -> subprocess.Popen:
    """Start a server command, return once it printed its 'listening on' line (raises RuntimeError after 10 min)."""
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    for _ in range(600):
        if "listening on" in log.read_text():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start; see {log}")


def measure(label: str, cmd: list[str], port: int, args, env: dict, work: Path) -> dict:
    proc = start(cmd + ["--port", str(port)], work / f"{label}.log", env)
    try:
        time.sleep(2)
        if "serve-ray" in cmd:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=30) as r:
                health = json.load(r)
            groups = {
                "replicas": [r["pid"] for r in health["replicas"]],
                "proxy": pgrep("ray::ProxyActor"),
                "controller": pgrep("ray::ServeController"),
                "raylet+gcs": pgrep("raylet") + pgrep("gcs_server"),
            }
        else:
            groups = {"server": [proc.pid]}
        before = {g: sum(map(cpu_s, pids)) for g, pids in groups.items()}
        load0 = os.getloadavg()[0]
        out = work / label
        subprocess.run(
            [
                "hycoc",
                "loadtest",
                args.recipe,
                "--sessions",
                str(args.sessions),
                "--duration",
                str(args.duration),
                "--server",
                f"ws://127.0.0.1:{port}",
                "--out",
                str(out),
            ],
            check=True,
            capture_output=True,
            text=True,
            env=env,
        )
        spent = {g: sum(map(cpu_s, pids)) - before[g] for g, pids in groups.items()}
        run = json.loads((out / "results.json").read_text())["runs"][0]
        return {
            "label": label,
            "tok_per_s": run["tok_per_s"],
            "tokens": run["committed_tokens"],
            "p90_ms": run["latency_ms"]["p90"],
            "errors": run["errors_total"],
            "cpu_s": spent,
            "load": (load0, os.getloadavg()[0]),
        }
    finally:
        proc.send_signal(2)
        proc.wait(180)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of (2 replicas, 1 replica), interleaved")
    ap.add_argument("--port", type=int, default=8790)
    args = ap.parse_args()
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    work = Path(tempfile.mkdtemp(prefix="hycoc-ray-scaling-"))
    plan = [
        (f"ray x{n}", ["hycoc", "serve-ray", args.recipe, "--replicas", str(n)])
        for _ in range(args.repeats)
        for n in (2, 1)
    ] + [("verify-server", ["hycoc", "verify-server", args.recipe])]
    rows = []
    for i, (label, cmd) in enumerate(plan):
        print(f"[{i + 1}/{len(plan)}] {label} ...", file=sys.stderr, flush=True)
        rows.append(measure(f"{label.replace(' ', '')}-{i}", cmd, args.port + (i % 2), args, env, work))
        rows[-1]["label"] = label
    print(
        f"\n{args.sessions} sessions, {args.duration:g} s per run (hycoc loadtest); CPU s per process group "
        "during the run; ms/tok = CPU ms per committed token"
    )
    print("| server | tok/s | p90 ms | errors | CPU s (ms/tok) by group | load avg |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        groups = ", ".join(f"{g} {s:.1f} ({1000 * s / max(r['tokens'], 1):.1f})" for g, s in r["cpu_s"].items())
        print(
            f"| {r['label']} | {r['tok_per_s']:.1f} | {r['p90_ms']:.0f} | {r['errors']} | {groups} | "
            f"{r['load'][0]:.1f} -> {r['load'][1]:.1f} |"
        )
    print(f"\nlogs and loadtest results in {work}")


if __name__ == "__main__":
    main()
