"""Two device runtimes over the same bundle, driven round by round with the same random hand-offs (the tests of
tests/test_graph_io.py and tests/test_runtime_topk.py compare what two builds of the graphs draft)."""

from __future__ import annotations

import numpy as np


def random_handoff(rng, t: int, a: int, bonus: int, hidden: int, kv: dict[str, int]):
    """A HandOff at position t with the window's n = t - a KV rows: int8 values in [-60, 60) for x_hat (2 * hidden)
    and each KV block (n, kv["sliding"] or kv["full"]), every scale 0.05."""
    from hycoc.protocol.messages import HandOff

    def r8(*s):
        return rng.integers(-60, 60, s).astype(np.int8)

    return HandOff(
        t_prime=t,
        a=a,
        bonus=bonus,
        x_hat=r8(2 * hidden),
        k_sliding=r8(t - a, kv["sliding"]),
        v_sliding=r8(t - a, kv["sliding"]),
        k_full=r8(t - a, kv["full"]),
        v_full=r8(t - a, kv["full"]),
        scales=(0.05,) * 6,
    )


def hyco_rounds(rts, prompt, rounds: int, rng, hidden: int, kv: dict[str, int]):
    """Start every runtime of ``rts`` on ``prompt``, then per round: one random hand-off ingested by each, and yield
    ``[(draft, built tree)]``, one per runtime (the HyCo tree at the bundle's node budget). After the yield the first
    runtime's tree decides the commit (its chain rows 1-2 while they form a chain, plus a random keep-set bonus),
    committed by every runtime on its own tree's nodes."""
    from hycoc.runtime.client import MODES

    bundle = rts[0].bundle
    for rt in rts:
        rt.slm.start(prompt)
        rt.mtp.reset()
    t = len(prompt) - 1
    a = max(0, t - bundle.round.head_window)
    for _ in range(rounds):
        hand = random_handoff(rng, t, a, int(prompt[-1]), hidden, kv)
        built = []
        for rt in rts:
            rt.mtp.ingest(hand)
            d = rt.mtp.draft()
            tree = rt.builder(MODES["hyco"], bundle.round.node_budget + 1).build(
                rt.slm.tokens[-1], d.chain, d.runner_ups, rt.slm.expand
            )
            built.append((d, tree))
        yield built
        first = built[0][1]
        path = [j for j in range(1, 3) if first.parents[j] == j - 1]  # accept up to 2 chain rows + a bonus
        commit = [int(first.tokens[j]) for j in path] + [int(bundle.keep_set[rng.integers(len(bundle.keep_set))])]
        for rt, (_, tree) in zip(rts, built):
            rt.slm.commit([tree.row_node[j] for j in path], commit)
        a, t = t, t + len(commit)
