"""Batched vs serial verification rounds on the engine, in-process (issue 14): rows per forward, ms, tok/s.

    python benchmarks/batched_verify.py recipes/toy.toml --sessions 1,4,16 --rounds 12

n sessions (Spec-Bench first turns, mixed prompt lengths, the recipe's sampling and epsilon, ``device`` drafting:
every round packs a hand-off) each send one 33-row tree per step, all at once -- what a server sees when n devices
answer together. ``serial`` verifies them one after another (`Session.verify`, the server before issue 14);
``batched`` verifies them in one forward (`hycoc.verifier.batch.verify_batch`). A step's time is the round latency
every device sees when they all send together; tok/s = committed tokens / the steps' time. Both modes commit the
same tokens (the same seeds), which the script checks.

Trees (built outside the timed region, the same for both modes): the verifier's own top-8 at the root and three
random tokens under each (B + 1 = 33 rows), so about one draft token is accepted per round (MAT ~2, the toy's).

Also prints the single-session round broken into its steps (forward, p~, sampling, acceptance, compaction,
hand-off), wall and CPU ms. Timings on a loaded machine are noisy: the CPU columns (time.process_time) are the ones
to compare then.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from hycoc.bench.datasets import SPEC_BENCH


def trees_for(model, torch, tokens, rng_seed: int, width: int = 8, below: int = 3):
    """(tokens int64 (33,), parents) for a session whose committed tokens are ``tokens`` (module docstring)."""
    with torch.inference_mode():
        top = model(input_ids=torch.tensor([tokens[-256:]]), logits_to_keep=1).logits[0, -1].topk(width).indices
    rng = np.random.default_rng(rng_seed)
    tree, parents = [tokens[-1]] + top.tolist(), [-1] + [0] * width
    for child in range(1, width + 1):
        tree += rng.integers(3, model.config.vocab_size, below).tolist()
        parents += [child] * below
    return np.array(tree, np.int64), np.array(parents, np.int64)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--dataset", type=Path, default=SPEC_BENCH, help="default: %(default)s")
    ap.add_argument("--sessions", default="1,4,16", help="comma-separated session counts (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per session (default %(default)s)")
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the recipe's "
                    "verifier.threads, else 1)")
    args = ap.parse_args(argv)

    import torch
    from rich.console import Console
    from rich.table import Table

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.chat import format_prompt
    from hycoc.models import load_tokenizer
    from hycoc.progress import step
    from hycoc.protocol.messages import Sampling
    from hycoc.recipe import load_recipe
    from hycoc.verifier.batch import BatchStats, verify_batch
    from hycoc.verifier.loading import engine_from_recipe

    recipe = load_recipe(args.recipe)
    torch.set_num_threads(args.threads or recipe.verifier.threads or 1)
    tok = load_tokenizer(recipe.model_path("tokenizer"))
    engine = engine_from_recipe(recipe, "cpu")
    s = recipe.sampling
    sampling = Sampling(s.temperature, s.top_k, s.top_p)
    counts = [int(x) for x in args.sessions.split(",")]
    questions = load_spec_bench(args.dataset)[: max(counts)]
    prompts = [np.array(format_prompt(tok, q.turns[0]), dtype=np.int64) for q in questions]
    memo: dict = {}

    def tree(i, session):
        key = (i, len(session.tokens), tuple(session.tokens[-8:]))
        if key not in memo:
            memo[key] = trees_for(engine.model, torch, session.tokens, rng_seed=1000 * i + len(session.tokens))
        return memo[key]

    def open_all(n):
        out = []
        for i in range(n):
            sess = engine.open(prompts[i], sampling, seed=s.seed + i, acceptance=recipe.acceptance.mode,
                               epsilon=recipe.acceptance.epsilon, draft_place="device", max_new_tokens=10_000)
            sess.prefill()
            out.append(sess)
        return out

    def run(n, mode, progress):
        sessions = open_all(n)
        wall = cpu = forward_ms = 0.0
        forwards = rows = 0
        steps = []
        for seq in range(args.rounds):
            batch = [(sess, *tree(i, sess), seq) for i, sess in enumerate(sessions)]   # untimed
            w0, c0 = time.perf_counter(), time.process_time()
            if mode == "serial":
                for sess, tokens, parents, q in batch:
                    sess.verify(tokens, parents, q)
                forwards += n
                rows += sum(len(b[1]) for b in batch)
            else:
                stats = BatchStats()
                results = verify_batch(engine, batch, stats)
                assert not any(isinstance(r, BaseException) for r in results), results
                forwards += 1
                rows += stats.rows
                forward_ms += stats.forward_ms
            dw, dc = time.perf_counter() - w0, time.process_time() - c0
            wall, cpu = wall + dw, cpu + dc
            steps.append(dw * 1e3)
            progress.advance()
        tokens = sum(len(sess.output) for sess in sessions)
        outputs = [list(sess.output) for sess in sessions]
        for sess in sessions:
            sess.close()
        return dict(rows=rows / forwards, step_ms=1e3 * wall / args.rounds, step_cpu_ms=1e3 * cpu / args.rounds,
                    p90_ms=float(np.percentile(steps, 90)), forward_ms=forward_ms / args.rounds, tok_s=tokens / wall, tok_cpu_s=tokens / cpu,
                    mat=tokens / (n * args.rounds), outputs=outputs)

    results = {}
    with step("batched vs serial rounds", total=2 * len(counts) * args.rounds) as progress:
        for n in counts:
            for mode in ("serial", "batched"):
                results[n, mode] = run(n, mode, progress)
            assert results[n, "serial"]["outputs"] == results[n, "batched"]["outputs"], \
                f"{n} sessions: batched output differs from serial"

    table = Table(title=f"Verification rounds on {args.recipe.name}: {args.rounds} rounds x n sessions, 33-row "
                  f"trees, {torch.get_num_threads()} thread(s)")
    for col in ("sessions", "mode", "rows/forward", "step ms (wall)", "of it forward", "step ms (CPU)",
                "p90 step ms", "MAT", "tok/s (wall)", "tok/s (CPU)", "speed-up (CPU)"):
        table.add_column(col, justify="right")
    for n in counts:
        base = results[n, "serial"]["tok_cpu_s"]
        for mode in ("serial", "batched"):
            r = results[n, mode]
            table.add_row(str(n), mode, f"{r['rows']:.0f}", f"{r['step_ms']:.1f}",
                          f"{r['forward_ms']:.1f}" if mode == "batched" else "", f"{r['step_cpu_ms']:.1f}",
                          f"{r['p90_ms']:.1f}", f"{r['mat']:.2f}", f"{r['tok_s']:.0f}", f"{r['tok_cpu_s']:.0f}",
                          f"{r['tok_cpu_s'] / base:.2f}x")
    Console().print(table)
    print_round_steps(engine, prompts[0], sampling, recipe, tree, args.rounds)


def print_round_steps(engine, prompt, sampling, recipe, tree, rounds: int) -> None:
    """One session's round split into the steps of Alg. 4, ms wall and CPU per step (mean over ``rounds``)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from hycoc.verifier.acceptance import select_exact, select_path
    from hycoc.verifier.engine import compact_kv, pack_handoff, verify_tree
    from hycoc.verifier.sampling import sample_rows, sampling_probs

    sess = engine.open(prompt, sampling, seed=0, acceptance=recipe.acceptance.mode,
                       epsilon=recipe.acceptance.epsilon, draft_place="device", max_new_tokens=10_000)
    sess.prefill()
    names = ("forward", "p~ (sampling_probs)", "sample_rows", "acceptance", "compact_kv", "pack_handoff",
             "whole round (Session.verify)")
    wall = dict.fromkeys(names, 0.0)
    cpu = dict.fromkeys(names, 0.0)

    def timed(name, fn, *a):
        w0, c0 = time.perf_counter(), time.process_time()
        out = fn(*a)
        wall[name] += time.perf_counter() - w0
        cpu[name] += time.process_time() - c0
        return out

    for seq in range(rounds):
        tokens, parents = tree(0, sess)
        t = sess.t
        ids = torch.as_tensor(tokens)
        logits, pre, _ = timed("forward", verify_tree, engine.model, sess.cache, engine.tap, ids, parents, t,
                               engine.dtype)
        probs = timed("p~ (sampling_probs)", sampling_probs, logits, sess.sampling)
        gen = torch.Generator().manual_seed(seq)
        samples = timed("sample_rows", sample_rows, probs, gen)
        if sess.acceptance == "exact":
            v, path, samples = timed("acceptance", select_exact, tokens, parents, samples)
        else:
            v, path, samples = timed("acceptance", select_path, tokens, parents, samples, probs, sess.epsilon)
        timed("compact_kv", compact_kv, sess.cache, t, path)
        timed("pack_handoff", pack_handoff, engine.model, sess.cache, engine.layers, int(samples[v]), pre[v], t,
              t + 1 + len(path), engine.head_window, seq == 0, engine.handoff_scales)
        from hycoc.verifier.engine import crop_cache
        crop_cache(sess.cache, t)                      # undo, then the real round
        timed("whole round (Session.verify)", sess.verify, tokens, parents, seq)
    table = Table(title=f"One session's round, by step (mean of {rounds} rounds, 33-row trees)")
    for col in ("step", "ms (wall)", "ms (CPU)"):
        table.add_column(col, justify="right")
    for name in names:
        table.add_row(name, f"{1e3 * wall[name] / rounds:.2f}", f"{1e3 * cpu[name] / rounds:.2f}")
    Console().print(table)
    sess.close()


if __name__ == "__main__":
    main()
