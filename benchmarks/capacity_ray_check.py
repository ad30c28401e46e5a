"""`hycoc capacity --replicas 2` against `hycoc serve-ray --replicas 2` at one load point (docs/capacity.md
"Scale-out").

Starts ``hycoc serve-ray RECIPE --replicas 2 --port 0``, reads the replicas' pids from its /healthz, runs one
`hycoc loadtest` cell against it (``--sessions`` devices, ``--duration`` s, the mode the replicas report) while
sampling the replicas' threads' /proc schedstat (`hycoc.bench.capacity.run.SchedSampler`), then simulates the same
cell with two replicas, the measured contention and the step cost cached by `hycoc capacity` (run that first), and
prints predicted vs measured. Ray's proxy (one more hop per frame, on the same two cores) is not in the model.

    python benchmarks/capacity_ray_check.py recipes/toy.toml --sessions 16 --duration 25

Needs the serve extra (installed with the other extras in one command:
``pip install -e ".[full,dev,qnn,hub,serve]"``), the loadtest trace and the step-cost cache.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("recipe")
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--duration", type=float, default=25.0)
    ap.add_argument("--out", default="runs/capacity-ray")
    args = ap.parse_args()

    from hycoc.bench.capacity.app import trace_for
    from hycoc.bench.capacity.measure import cached_step_cost
    from hycoc.bench.capacity.run import SchedSampler, predicted_for, trace_workload, validation_rows
    from hycoc.bench.datasets import load_spec_bench
    from hycoc.bench.loadtest.plan import LoadTestRun
    from hycoc.bench.loadtest.run import devices_for, run_loadtest
    from hycoc.bench.paper.runner import default_bundle_dir, make_console
    from hycoc.recipe import load_recipe

    cfg = load_recipe(args.recipe)
    console = make_console()
    cost = cached_step_cost(cfg, ROOT / ".hycoc-cache" / "capacity")
    bundle = default_bundle_dir(cfg, ROOT)
    questions = load_spec_bench(
        cfg.resolve_path(cfg.bench.dataset) or ROOT / "benchmarks/data/spec_bench_question.jsonl"
    )[:4]
    trace, _ = trace_for(cfg, bundle, ["hyco"], questions, 0.0, ROOT, console)
    log = Path(args.out) / "serve-ray.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", RAY_USAGE_STATS_ENABLED="0")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hycoc.cli",
            "serve-ray",
            args.recipe,
            "--replicas",
            "2",
            "--port",
            "0",
            "--keep-set",
            str(bundle / "keep_set.npy"),
        ],
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    try:
        url = None
        for _ in range(600):
            m = re.search(r"listening on (ws://\S+)", log.read_text())
            if m:
                url = m.group(1).rstrip("/")
                break
            if proc.poll() is not None:
                break
            time.sleep(1)
        if url is None:
            raise SystemExit(f"serve-ray did not start; see {log}")
        with urllib.request.urlopen("http" + url.removeprefix("ws") + "/healthz", timeout=60) as r:
            health = json.load(r)
        pids = [r["pid"] for r in health["replicas"] if r.get("pid")]
        with SchedSampler(pids=pids) as sampler:
            doc = run_loadtest(
                trace,
                LoadTestRun(["hyco"], [args.sessions], None, args.duration, Path(args.out), server=url),
                console=console,
                meta={"recipe": args.recipe},
            )
    finally:
        proc.send_signal(2)
        try:
            proc.wait(180)
        except subprocess.TimeoutExpired:
            proc.kill()
    (m,) = doc["runs"]
    window = doc["meta"]["run_windows"][0]["epoch_s"]
    contention = sampler.contention(*window)
    p = predicted_for(
        m,
        trace_workload(devices_for(trace, ["hyco"], args.sessions)),
        cost,
        doc["meta"],
        contention=contention,
        replicas=2,
    )
    (row,) = validation_rows([m], [p], 0.2)
    print(
        f"serve-ray 2 replicas, {m['mode']}, {args.sessions} sessions, {args.duration:g} s: tok/s measured "
        f"{row['measured_tok_s']:.1f} predicted {row['predicted_tok_s']:.1f} ({100 * row['tok_err']:+.0f}%); p90 "
        f"measured {row['measured_p90_ms']:.0f} ms predicted {row['predicted_p90_ms']:.0f} ms "
        f"({100 * row['p90_err']:+.0f}%); CPU x{(contention or {}).get('slowdown', float('nan')):.2f}; load "
        f"{m['loadavg'][0]:.1f}->{m['loadavg'][3]:.1f}"
    )


if __name__ == "__main__":
    main()
