"""Host share of the device runtime's drafting time on a real bundle (docs/device-runtime.md "Host work per round":
the target is a host share of drafting time <= 10% on the toy bundle).

    python benchmarks/runtime_host_share.py bundles/toy-cpu                       # 4 questions x 128 tokens
    python benchmarks/runtime_host_share.py bundles/toy-cpu --questions 8 --json runs/host-share.json

Runs `DeviceRuntime.generate` (mode ``hyco`` by default, the recipe's sampling and seed) on the first Spec-Bench
questions against the recipe's verifier in a child process (`hycoc.bench.verifier_process.VerifierProcess`: ``hycoc
verify-server`` on loopback, as ``hycoc bench`` runs it, so the verifier never competes with the runtime for this
process), the bundle's graphs on onnxruntime's CPU EP with one intra-op thread, and splits the drafting time
(``draft_s``: the MTP Drafter, the tree and the SLM forwards of every round; the SLM's request-start fill excluded) into
the time inside ``InferenceSession.run`` of the two graphs and the rest, the host share. Two variants of the same
bundle, interleaved per question:

    graph top-k   the runtime as shipped: the graphs' ``top_index`` / ``top_logq`` outputs, no logits fetched
    host top-k    the same graphs asked for ``logits`` instead; the host ranks the keep set
                  (`hycoc.runtime.candidates.logits_candidates`)

Wall time, so run it on an idle machine; the baseline before top-k moved into the graphs (23%: 0.96 s in
``InferenceSession.run`` of 1.25 s of drafting, 4 questions x 128 tokens, one thread) was measured the same way.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from hycoc.bench.runtime_timing import CpuClock

REPO = Path(__file__).resolve().parents[1]


def runtimes(bundle_dir: Path, cpu: CpuClock):
    """{variant: DeviceRuntime} over one opened bundle (module docstring), sessions timed by ``cpu``."""
    from hycoc.runtime.client import DeviceRuntime
    from hycoc.runtime.device_bundle import open_bundle
    from hycoc.runtime.graphs import GraphRunner, RunnerSettings, runtime_outputs

    bundle = open_bundle(bundle_dir, "cpu")
    m = bundle.manifest
    out = {}
    for variant in ("graph top-k", "host top-k"):
        runners = []
        for name in ("head", "slm"):
            names = [t.name for t in m.graph(name).outputs]
            wanted = (
                runtime_outputs(m.graph(name))
                if variant == "graph top-k"
                else [n for n in names if not n.startswith("top_")]
            )
            runner = GraphRunner(bundle.path, m, name, "cpu", wanted, RunnerSettings(threads=1))
            runner.session = cpu.session(runner.session)
            runners.append(runner)
        out[variant] = DeviceRuntime(bundle, *runners)
    return out


class PrefillClock:
    """Graph time spent in the SLM's request-start fill (called by the client outside ``draft_s``): wraps
    `SlmDrafter.prefill` and `SlmDrafter.expand` so that fills made inside a round's expand stay in drafting."""

    def __init__(self):
        from hycoc.runtime.slm_drafter import SlmDrafter

        self.seconds, self._inside_expand = 0.0, 0
        prefill, expand = SlmDrafter.prefill, SlmDrafter.expand
        clock = self

        def timed_prefill(slm, *args, **kwargs):
            before = slm.runner.seconds
            try:
                return prefill(slm, *args, **kwargs)
            finally:
                if not clock._inside_expand:
                    clock.seconds += slm.runner.seconds - before

        def timed_expand(slm, *args, **kwargs):
            clock._inside_expand += 1
            try:
                return expand(slm, *args, **kwargs)
            finally:
                clock._inside_expand -= 1

        SlmDrafter.prefill, SlmDrafter.expand = timed_prefill, timed_expand


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("bundle", type=Path, help="a cpu bundle (hycoc build RECIPE --target cpu)")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "toy.toml", help="the bundle's recipe")
    ap.add_argument("--questions", type=int, default=4, help="first Spec-Bench questions (default 4)")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request (default 128)")
    ap.add_argument("--mode", default="hyco", help="runtime mode (default hyco)")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)

    from hycoc.runtime import transport

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.bench.verifier_process import VerifierProcess
    from hycoc.cli import DEFAULT_DATASET
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    cpu = CpuClock()
    rts = runtimes(args.bundle, cpu)
    clock = PrefillClock()
    first = next(iter(rts.values()))
    questions = load_spec_bench(recipe.resolve_path(recipe.bench.dataset) or DEFAULT_DATASET)[: args.questions]
    totals = {
        v: {"draft_s": 0.0, "graph_s": 0.0, "draft_cpu_s": 0.0, "graph_cpu_s": 0.0, "tokens": 0, "rounds": 0}
        for v in rts
    }
    texts = {v: [] for v in rts}
    with VerifierProcess(args.recipe, args.bundle / "keep_set.npy") as srv:
        for q in questions:
            ids = first.bundle.chat.prompt(q.turns[0])
            for variant, rt in rts.items():
                graph_before = rt.mtp.runner.seconds + rt.slm.runner.seconds
                prefill_before = clock.seconds
                cpu_before = (cpu.draft_s, cpu.graph_s)
                start = time.perf_counter()
                res = rt.generate(transport.VerifierClient(srv.url), ids, mode=args.mode, max_new_tokens=args.tokens)
                wall = time.perf_counter() - start
                graph = rt.mtp.runner.seconds + rt.slm.runner.seconds - graph_before - (clock.seconds - prefill_before)
                t = totals[variant]
                t["draft_s"] += res.draft_s
                t["graph_s"] += graph
                t["draft_cpu_s"] += cpu.draft_s - cpu_before[0]
                t["graph_cpu_s"] += cpu.graph_s - cpu_before[1]
                t["tokens"] += len(res.tokens)
                t["rounds"] += res.rounds
                texts[variant].append(res.tokens)
                print(
                    f"q{q.question_id} {variant:12s} tokens {len(res.tokens):4d} rounds {res.rounds:3d} "
                    f"draft {1000 * res.draft_s:7.1f} ms (graphs {1000 * graph:7.1f} ms), request {wall:.2f} s"
                )
    results = {}
    for variant, t in totals.items():
        host = t["draft_s"] - t["graph_s"]
        host_cpu = t["draft_cpu_s"] - t["graph_cpu_s"]
        results[variant] = {
            **{k: round(v, 4) if isinstance(v, float) else v for k, v in t.items()},
            "host_s": round(host, 4),
            "host_share": round(host / t["draft_s"], 4),
            "host_cpu_s": round(host_cpu, 4),
            "host_share_cpu": round(host_cpu / t["draft_cpu_s"], 4),
            "host_cpu_ms_per_round": round(1000 * host_cpu / max(t["rounds"], 1), 3),
            "draft_ms_per_token": round(1000 * t["draft_s"] / max(t["tokens"], 1), 3),
            "host_ms_per_round": round(1000 * host / max(t["rounds"], 1), 3),
        }
    same = texts["graph top-k"] == texts["host top-k"]
    print(
        "| variant | drafting s (wall / CPU) | in InferenceSession.run s (wall / CPU) | host share (wall / CPU) | "
        "host ms per round (wall / CPU) | draft ms / token |"
    )
    print("|---|---|---|---|---|---|")
    for variant, r in results.items():
        print(
            f"| {variant} | {r['draft_s']:.3f} / {r['draft_cpu_s']:.3f} | {r['graph_s']:.3f} / {r['graph_cpu_s']:.3f} "
            f"| {100 * r['host_share']:.1f}% / {100 * r['host_share_cpu']:.1f}% | {r['host_ms_per_round']:.2f} / "
            f"{r['host_cpu_ms_per_round']:.2f} | {r['draft_ms_per_token']:.2f} |"
        )
    print(f"same tokens in both variants: {same}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(
            json.dumps(
                {
                    "results": results,
                    "same_tokens": same,
                    "questions": len(questions),
                    "tokens": args.tokens,
                    "mode": args.mode,
                },
                indent=1,
            ),
            encoding="utf-8",
        )
        tmp.replace(args.json)
    return 0 if np.isfinite(list(results.values())[0]["host_share"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
