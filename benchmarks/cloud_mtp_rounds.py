"""Cloud+MTP on the verifier engine: MAT, server ms per round and g on Spec-Bench first turns.

    python benchmarks/cloud_mtp_rounds.py recipes/toy.toml --limit 10

Runs the paper's Cloud+MTP baseline (Table 5 row 1: the head on the server, full precision, whole prefix, full
vocabulary, K-chain, exact acceptance) directly on `hycoc.verifier.VerifierEngine` -- no network -- and prints
per-request and pooled numbers (App. G definitions: MAT counts the bonus token; g = server ms including prefill
per output token). Also runs the verifier alone (one token per forward) as the no-speculation reference.
"""

from __future__ import annotations

import argparse

import numpy as np
from engine_setup import add_engine_args, open_cloud_mtp, run_rounds, setup_engine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, limit_help="first N questions", cap_help="default: the recipe's")
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from hycoc.bench.datasets import load_spec_bench

    setup = setup_engine(args)
    table = Table(title=f"Cloud+MTP on {args.recipe.name}, {args.limit} Spec-Bench first turns")
    for col in ("qid", "category", "prompt", "tokens", "rounds", "MAT", "prefill ms", "ms/round", "g ms/tok"):
        table.add_column(col, justify="right")
    pooled = dict(tokens=0, rounds=0, server=0.0, prefill=0.0)
    for q in load_spec_bench(args.dataset)[: args.limit]:
        ids = np.array(setup.chat.prompt(q.turns[0]), dtype=np.int32)
        sess = open_cloud_mtp(setup, ids)
        prefill_ms, _ = sess.prefill()
        run_rounds(sess)
        n = len(sess.output)
        server = sum(sess.server_ms) if isinstance(sess.server_ms, list) else sess.server_ms
        pooled["tokens"] += n
        pooled["rounds"] += sess.rounds
        pooled["server"] += server
        pooled["prefill"] += prefill_ms
        table.add_row(
            str(q.question_id),
            q.category,
            str(len(ids)),
            str(n),
            str(sess.rounds),
            f"{n / max(sess.rounds, 1):.2f}",
            f"{prefill_ms:.1f}",
            f"{server / max(sess.rounds, 1):.1f}",
            f"{(server + prefill_ms) / max(n, 1):.2f}",
        )
        sess.close()
    p = pooled
    table.add_row(
        "all",
        "",
        "",
        str(p["tokens"]),
        str(p["rounds"]),
        f"{p['tokens'] / p['rounds']:.2f}",
        f"{p['prefill']:.0f}",
        f"{p['server'] / p['rounds']:.1f}",
        f"{(p['server'] + p['prefill']) / p['tokens']:.2f}",
    )
    Console().print(table)


if __name__ == "__main__":
    main()
