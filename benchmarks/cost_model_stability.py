"""Is the cost model `hycoc bench` measures stable? Measure it N times on this machine and project one bench's
records through each measurement: projected g and Δg per configuration, side by side.

    python benchmarks/cost_model_stability.py runs/bench/results.json --recipe recipes/toy.toml --times 2

Each measurement is `hycoc.bench.cost_model.measure.measure_recipe_verifier` as `hycoc bench` calls it (the recipe's
verifier and MTP head with their real weights, busy CPU time of every forward, ``--repeats`` interleaved
repetitions per point, contexts covering the records'), one after the other in this process. The records are
projected with `hycoc.bench.paper.summary.summarize` (the bench's own replay: prefill chunks, verification, server-side
head steps). Printed: per measurement its seconds and load average, then per configuration projected g (ms per token)
and projected Δg % [95% CI] for every measurement, and the largest move of projected Δg between two measurements.
``--clock wall`` measures wall time instead (what `hycoc bench` did before it timed busy time), for comparison.
The stability target: two measurements move projected Δg by at most 2 points.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, help="a bench's results.json (its records are projected)")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "toy.toml")
    ap.add_argument("--times", type=int, default=2, help="measurements (default %(default)s)")
    ap.add_argument("--repeats", type=int, default=None, help="repetitions per point (default: the bench's)")
    ap.add_argument("--clock", choices=("busy", "wall"), default="busy")
    ap.add_argument("--out", type=Path, default=None, help="folder for the measured cost models (JSON)")
    args = ap.parse_args(argv)

    from hycoc.bench.cost_model.measure import BENCH_REPEATS, measure_recipe_verifier
    from hycoc.bench.paper.runner import server_work
    from hycoc.bench.paper.summary import summarize
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    records = json.loads(args.results.read_text(encoding="utf-8"))["records"]
    longest = max((max(r["context"], default=0) for r in records), default=64)
    contexts = sorted({64, 128, 256, 512, max(64, int(longest))})
    repeats = args.repeats or BENCH_REPEATS
    summaries = []
    for k in range(args.times):
        t0 = time.perf_counter()
        cost = measure_recipe_verifier(recipe, contexts=contexts, repeats=repeats, clock=args.clock)
        if args.out:
            cost.save(args.out / f"cost_model_{k + 1}.json")
        print(
            f"measurement {k + 1}: {time.perf_counter() - t0:.0f} s, {cost.meta['statistic']} of {repeats} "
            f"repetitions, clock {cost.meta['clock']}, load {cost.meta['loadavg_before']} -> "
            f"{cost.meta['loadavg_after']}",
            flush=True,
        )
        summaries.append(summarize(records, cost_model=cost, server=server_work(recipe)))
    names = [n for n in summaries[0] if summaries[0][n].get("g_projected_ms_per_token") is not None]
    print(f"{len(records)} records of {args.results}")
    worst = 0.0
    for n in names:
        cells = []
        for s in summaries:
            e = s[n]
            d, ci = e.get("delta_g_projected_pct"), e.get("delta_g_projected_ci95")
            cell = f"g proj. {e['g_projected_ms_per_token']:.3f}"
            if d is not None and ci:
                cell += f", Δg proj. {d:+.1f} [{ci[0]:+.1f}, {ci[1]:+.1f}]"
            cells.append(cell)
        deltas = [s[n].get("delta_g_projected_pct") for s in summaries]
        move = max(deltas) - min(deltas) if None not in deltas else 0.0
        worst = max(worst, move)
        print(f"  {n:<12} " + " | ".join(cells) + (f"   move {move:.2f} points" if None not in deltas else ""))
    print(f"largest move of projected Δg between measurements: {worst:.2f} points (target <= 2)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
