"""Two-turn conversations on the verifier engine: what keeping the KV across turns saves (docs/benchmarks.md
"Benchmark": both MT-bench turns; paper §4.1).

    python benchmarks/two_turn_prefill.py recipes/toy.toml --limit 10

For the first N MT-bench questions (both turns), runs the Cloud+MTP configuration (Table 5 row 1: the server
drafts, no device needed) directly on `hycoc.verifier.VerifierEngine`, no network: turn 1 from the question, then
turn 2 on the same session (`Session.continue_with`: the whole conversation -- first question, the session's own
first answer, second question -- re-rendered by the template, the KV of what the session holds of it kept, the
rest prefilled; docs/serving.md "Conversations"). Beside each append,
the same conversation is prefilled cold on a fresh session (the baseline: what a server without turn reuse
pays). Prints per question and pooled per turn: prefill ms (append vs cold), prefill ms saved, g (verifier ms per
output token, prefill included; App. G) and MAT (committed tokens per round, bonus included).
"""

from __future__ import annotations

import argparse

import numpy as np
from engine_setup import add_engine_args, open_cloud_mtp, run_rounds, setup_engine


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(ap, limit_help="first N two-turn questions", cap_help="per turn (default: the recipe's)")
    args = ap.parse_args(argv)

    from rich.console import Console
    from rich.table import Table

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.chat import Conversation

    setup = setup_engine(args)
    engine, cap = setup.engine, setup.cap

    table = Table(title=f"two turns, Cloud+MTP on {args.recipe.name}: KV kept across turns vs a cold prefill")
    for col in ("qid", "turn", "prompt", "tokens", "MAT", "prefill ms", "cold prefill ms", "saved ms", "g ms/tok"):
        table.add_column(col, justify="right")
    pooled = {t: dict(tokens=0, rounds=0, server=0.0, prefill=0.0, cold=0.0, n=0) for t in (1, 2)}
    questions = [q for q in load_spec_bench(args.dataset) if len(q.turns) > 1][: args.limit]
    for q in questions:
        conv = Conversation(setup.chat)
        first = conv.ask(q.turns[0])
        ids = np.array(first.ids, dtype=np.int32)
        sess = open_cloud_mtp(setup, ids, anchor=first.anchor)
        prefill_ms, _ = sess.prefill()
        run_rounds(sess)
        n1, r1, s1 = len(sess.output), sess.rounds, sum(sess.server_ms)
        conv.answered(first, sess.tokens[len(ids) :])
        second = conv.ask(q.turns[1])
        append_ms, _ = sess.continue_with(second.ids, cap, anchor=second.anchor)
        conversation = list(sess.tokens)
        run_rounds(sess)
        cold = engine.open(conversation, sampling=setup.sampling, draft_place="cloud-mtp", max_new_tokens=1)
        cold_ms, _ = cold.prefill()
        cold.close()
        n2, r2, s2 = len(sess.tokens) - len(conversation), sess.rounds - r1, sum(sess.server_ms) - s1
        sess.close()
        for t, prompt, pre, cold_t, n, r, srv in (
            (1, len(ids), prefill_ms, None, n1, r1, s1),
            (2, len(conversation), append_ms, cold_ms, n2, r2, s2),
        ):
            p = pooled[t]
            p["tokens"] += n
            p["rounds"] += r
            p["server"] += srv
            p["prefill"] += pre
            p["cold"] += cold_t or 0.0
            p["n"] += 1
            table.add_row(
                str(q.question_id),
                str(t),
                str(prompt),
                str(n),
                f"{n / max(r, 1):.2f}",
                f"{pre:.1f}",
                "" if cold_t is None else f"{cold_t:.1f}",
                "" if cold_t is None else f"{cold_t - pre:.1f}",
                f"{(srv + pre) / max(n, 1):.2f}",
            )
    for t, p in pooled.items():
        saved = f"{(p['cold'] - p['prefill']) / p['n']:.1f}" if t == 2 else ""
        cold = f"{p['cold'] / p['n']:.1f}" if t == 2 else ""
        table.add_row(
            "all",
            str(t),
            "",
            str(p["tokens"]),
            f"{p['tokens'] / max(p['rounds'], 1):.2f}",
            f"{p['prefill'] / p['n']:.1f}",
            cold,
            saved,
            f"{(p['server'] + p['prefill']) / max(p['tokens'], 1):.2f}",
        )
    Console(width=140).print(table)
    p2 = pooled[2]
    g_reuse = (p2["server"] + p2["prefill"]) / max(p2["tokens"], 1)
    g_cold = (p2["server"] + p2["cold"]) / max(p2["tokens"], 1)
    print(
        f"second turns: g {g_reuse:.2f} ms/token with the KV kept vs {g_cold:.2f} with a cold prefill "
        f"({100 * (g_reuse - g_cold) / g_cold:+.1f}%)"
    )


if __name__ == "__main__":
    main()
