"""Batched vs serial verification rounds on the engine, in-process (docs/serving.md "Many devices: batched
verification"): rows per forward, ms, tok/s.

    python benchmarks/batched_verify.py recipes/toy.toml --sessions 1,4,16 --rounds 12

n sessions (Spec-Bench first turns, mixed prompt lengths, the recipe's sampling and epsilon, ``device`` drafting:
every round packs a hand-off) each send one 33-row tree per step, all at once -- what a server sees when n devices
answer together. ``serial`` verifies them one after another (`Session.verify`, the server before batched verification);
``batched`` verifies them in one forward (`hycoc.verifier.batch.verify_batch`). A step's time is the round latency
every device sees when they all send together; tok/s = committed tokens / the steps' time. Both modes commit the
same tokens (the same seeds), which the script checks.

Trees (built outside the timed region, the same for both modes): the verifier's own top-8 at the root and three
random tokens under each (B + 1 = 33 rows), so about one draft token is accepted per round (MAT ~2, the toy's).

Also prints the single-session round broken into its steps (forward, p~, sampling, acceptance, compaction,
hand-off), wall and CPU ms. Timings on a loaded machine are noisy: the CPU columns (time.process_time) are the ones
to compare then.

    python benchmarks/batched_verify.py recipes/toy.toml --mixed-lengths

One long session (a prompt of ``--long-tokens``, default 3,900: near the toy's 4,096-position context) and 15 short
ones (Spec-Bench first turns) each send 33-row trees. ``batched``: all 16 rounds in one `verify_batch`;
``separate``: the long one alone, then the 15 short ones batched. The two alternate round by round on twin sessions
(same prompts and seeds: the script checks they commit the same tokens); the medians are compared. A batched round
whose cost follows each session's own length costs about the separate pair (ratio ~1); padding every session to the
longest cache costs ~16 long rounds. Last line: ``mixed-lengths: batched X ms vs separate Y ms, ratio R``.

    python benchmarks/batched_verify.py recipes/toy.toml --long-prefill

15 short sessions send rounds through the server's `hycoc.verifier.scheduler.BatchScheduler` (one worker thread, as
`hycoc verify-server`), without and then with a long prompt (``--long-tokens``) prefilling beside them in chunks of
the engine's prefill_chunk; prints p50 / p90 of the short sessions' round latency (submit -> reply) in both runs and
the long request's time to OPENED (prefill done) and to its first round's reply (its first committed token), also
with the long request alone.
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


def memo_trees(model, torch):
    """tree(i, session): `trees_for` session i's committed tokens, seeded by i and its length, each computed once per
    (i, length, last 8 tokens)."""
    memo: dict = {}

    def tree(i, session):
        key = (i, len(session.tokens), tuple(session.tokens[-8:]))
        if key not in memo:
            memo[key] = trees_for(model, torch, session.tokens, rng_seed=1000 * i + len(session.tokens))
        return memo[key]

    return tree


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--dataset", type=Path, default=SPEC_BENCH, help="default: %(default)s")
    ap.add_argument("--sessions", default="1,4,16", help="comma-separated session counts (default %(default)s)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds per session (default %(default)s)")
    ap.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: the recipe's verifier.threads, else 1)"
    )
    ap.add_argument(
        "--mixed-lengths",
        action="store_true",
        help="one long + 15 short sessions: one batched round vs the long alone + the short batched (module docstring)",
    )
    ap.add_argument(
        "--long-prefill",
        action="store_true",
        help="15 short sessions' round latency with and without "
        "a long prefill beside them, and the long request's time to first token",
    )
    ap.add_argument(
        "--long-tokens", type=int, default=3900, help="prompt tokens of the long session (default %(default)s)"
    )
    ap.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="prompt positions per prefill forward (default: the engine's, 512)",
    )
    return ap.parse_args(argv)


def _engine(args):
    """(recipe, verifier engine on the CPU, sampling, chat template) of ``args.recipe``, torch on ``--threads`` (else
    the recipe's verifier.threads, else 1)."""
    import torch
    from hycoc.verifier.loading import engine_from_recipe

    from hycoc.chat_template import chat_from_recipe
    from hycoc.protocol.messages import Sampling
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    torch.set_num_threads(args.threads or recipe.verifier.threads or 1)
    chat = chat_from_recipe(recipe)
    engine = engine_from_recipe(recipe, "cpu")
    s = recipe.sampling
    return recipe, engine, Sampling(s.temperature, s.top_k, s.top_p), chat


def run_rounds(engine, recipe, sampling, prompts, tree, n: int, mode: str, rounds: int, progress) -> dict:
    """``rounds`` rounds of ``n`` sessions (prompts[0..n)), each round's trees verified one session at a time
    (``mode`` "serial") or in one batched forward ("batched"); returns rows per forward, step ms (wall, CPU, p90),
    forward ms (batched), tok/s (wall, CPU), MAT and each session's output tokens."""
    from hycoc.verifier.batch import BatchStats, verify_batch

    sessions = [_open(engine, recipe, sampling, prompts[i], i) for i in range(n)]
    wall = cpu = forward_ms = 0.0
    forwards = rows = 0
    steps = []
    for seq in range(rounds):
        batch = [(sess, *tree(i, sess), seq) for i, sess in enumerate(sessions)]  # untimed
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
    return dict(
        rows=rows / forwards,
        step_ms=1e3 * wall / rounds,
        step_cpu_ms=1e3 * cpu / rounds,
        p90_ms=float(np.percentile(steps, 90)),
        forward_ms=forward_ms / rounds,
        tok_s=tokens / wall,
        tok_cpu_s=tokens / cpu,
        mat=tokens / (n * rounds),
        outputs=outputs,
    )


def print_rounds_table(results: dict, counts: list[int], title: str) -> None:
    """The serial vs batched table: one row per (session count, mode) of ``results`` (`run_rounds`'s dicts)."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in (
        "sessions",
        "mode",
        "rows/forward",
        "step ms (wall)",
        "of it forward",
        "step ms (CPU)",
        "p90 step ms",
        "MAT",
        "tok/s (wall)",
        "tok/s (CPU)",
        "speed-up (CPU)",
    ):
        table.add_column(col, justify="right")
    for n in counts:
        base = results[n, "serial"]["tok_cpu_s"]
        for mode in ("serial", "batched"):
            r = results[n, mode]
            table.add_row(
                str(n),
                mode,
                f"{r['rows']:.0f}",
                f"{r['step_ms']:.1f}",
                f"{r['forward_ms']:.1f}" if mode == "batched" else "",
                f"{r['step_cpu_ms']:.1f}",
                f"{r['p90_ms']:.1f}",
                f"{r['mat']:.2f}",
                f"{r['tok_s']:.0f}",
                f"{r['tok_cpu_s']:.0f}",
                f"{r['tok_cpu_s'] / base:.2f}x",
            )
    Console().print(table)


def main(argv=None) -> None:
    """Run the comparison the options ask for (module docstring) and print its tables."""
    args = parse_args(argv)
    if args.mixed_lengths or args.long_prefill:
        return long_context(args)

    import torch

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.progress import step

    recipe, engine, sampling, chat = _engine(args)
    counts = [int(x) for x in args.sessions.split(",")]
    questions = load_spec_bench(args.dataset)[: max(counts)]
    prompts = [np.array(chat.prompt(q.turns[0]), dtype=np.int64) for q in questions]
    tree = memo_trees(engine.model, torch)

    results = {}
    with step("batched vs serial rounds", total=2 * len(counts) * args.rounds) as progress:
        for n in counts:
            for mode in ("serial", "batched"):
                results[n, mode] = run_rounds(engine, recipe, sampling, prompts, tree, n, mode, args.rounds, progress)
            assert results[n, "serial"]["outputs"] == results[n, "batched"]["outputs"], (
                f"{n} sessions: batched output differs from serial"
            )
    title = (
        f"Verification rounds on {args.recipe.name}: {args.rounds} rounds x n sessions, 33-row "
        f"trees, {torch.get_num_threads()} thread(s)"
    )
    print_rounds_table(results, counts, title)
    print_round_steps(engine, prompts[0], sampling, recipe, tree, args.rounds)


def print_round_steps(engine, prompt, sampling, recipe, tree, rounds: int) -> None:
    """One session's round split into the steps of Alg. 4, ms wall and CPU per step (mean over ``rounds``)."""
    import torch
    from hycoc.verifier.acceptance import select_exact, select_path
    from hycoc.verifier.engine import verify_tree
    from hycoc.verifier.kv_surgery import compact_kv, pack_handoff
    from hycoc.verifier.sampling import sample_rows, sampling_probs
    from rich.console import Console
    from rich.table import Table

    sess = _device_session(engine, recipe, sampling, prompt, seed=0)
    sess.prefill()
    names = (
        "forward",
        "p~ (sampling_probs)",
        "sample_rows",
        "acceptance",
        "compact_kv",
        "pack_handoff",
        "whole round (Session.verify)",
    )
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
        logits, pre, _ = timed(
            "forward", verify_tree, engine.model, sess.cache, engine.tap, ids, parents, t, engine.dtype
        )
        probs = timed("p~ (sampling_probs)", sampling_probs, logits, sess.sampling)
        gen = torch.Generator().manual_seed(seq)
        samples = timed("sample_rows", sample_rows, probs, gen)
        if sess.acceptance == "exact":
            v, path, samples = timed("acceptance", select_exact, tokens, parents, samples)
        else:
            v, path, samples = timed("acceptance", select_path, tokens, parents, samples, probs, sess.epsilon)
        timed("compact_kv", compact_kv, sess.cache, t, path)
        timed(
            "pack_handoff",
            pack_handoff,
            engine.model,
            sess.cache,
            engine.layers,
            int(samples[v]),
            pre[v],
            t,
            t + 1 + len(path),
            engine.head_window,
            seq == 0,
            engine.handoff_scales,
        )
        from hycoc.verifier.kv_surgery import crop_cache

        crop_cache(sess.cache, t)  # undo, then the real round
        timed("whole round (Session.verify)", sess.verify, tokens, parents, seq)
    table = Table(title=f"One session's round, by step (mean of {rounds} rounds, 33-row trees)")
    for col in ("step", "ms (wall)", "ms (CPU)"):
        table.add_column(col, justify="right")
    for name in names:
        table.add_row(name, f"{1e3 * wall[name] / rounds:.2f}", f"{1e3 * cpu[name] / rounds:.2f}")
    Console().print(table)
    sess.close()


def _median(xs) -> float:
    return float(np.median(xs))


def _setup(args):
    """(recipe, engine, sampling, long prompt ids (--long-tokens), 15 short prompt ids) for the long-context modes."""
    from hycoc.bench.datasets import load_spec_bench

    recipe, engine, sampling, chat = _engine(args)
    if args.prefill_chunk:
        engine.prefill_chunk = int(args.prefill_chunk)
    questions = load_spec_bench(args.dataset)
    short = [np.array(chat.prompt(q.turns[0]), dtype=np.int64) for q in questions[:15]]
    text = "\n\n".join(turn for q in questions for turn in q.turns)
    long = np.array(chat.prompt(text), dtype=np.int64)
    if len(long) < args.long_tokens:
        raise SystemExit(f"--long-tokens {args.long_tokens}: the dataset gives only {len(long)} tokens")
    if args.long_tokens + 64 > engine.max_context:
        raise SystemExit(
            f"--long-tokens {args.long_tokens} leaves < 64 positions of the verifier's context {engine.max_context}"
        )
    long = np.concatenate([long[: args.long_tokens - 1], long[-1:]])  # keep the template's last token as the root
    return recipe, engine, sampling, long, short


def long_context(args) -> None:
    """The --mixed-lengths and --long-prefill modes (module docstring)."""
    import torch

    recipe, engine, sampling, long, short = _setup(args)
    load = open("/proc/loadavg").read().split()[:3] if Path("/proc/loadavg").exists() else ["?"] * 3
    print(
        f"{args.recipe.name}: long prompt {len(long)} tokens, 15 short prompts {min(map(len, short))}-"
        f"{max(map(len, short))} tokens, 33-row trees, {torch.get_num_threads()} thread(s), load average "
        f"{' '.join(load)}"
    )
    if args.long_prefill:
        long_prefill(args, recipe, engine, sampling, long, short)
    if args.mixed_lengths:
        mixed_lengths(args, recipe, engine, sampling, long, short)


def _open(engine, recipe, sampling, prompt, i):
    sess = _device_session(engine, recipe, sampling, prompt, seed=recipe.sampling.seed + i)
    sess.prefill()
    return sess


def _device_session(engine, recipe, sampling, prompt, seed: int, max_new_tokens: int = 10_000):
    """A new session on ``prompt`` (not prefilled): device drafting, the recipe's acceptance."""
    return engine.open(
        prompt,
        sampling,
        seed=seed,
        acceptance=recipe.acceptance.mode,
        epsilon=recipe.acceptance.epsilon,
        draft_place="device",
        max_new_tokens=max_new_tokens,
    )


def mixed_lengths(args, recipe, engine, sampling, long, short) -> None:
    import torch
    from hycoc.verifier.batch import verify_batch

    prompts = [long] + short
    twins = [[_open(engine, recipe, sampling, p, i) for i, p in enumerate(prompts)] for _ in range(2)]
    tree = memo_trees(engine.model, torch)

    def check(results):
        bad = [r for r in results if isinstance(r, BaseException)]
        assert not bad, bad

    batched, separate, long_alone = [], [], []
    for seq in range(args.rounds):
        rounds = [[(sess, *tree(i, sess), seq) for i, sess in enumerate(group)] for group in twins]  # untimed
        t0 = time.perf_counter()
        check(verify_batch(engine, rounds[0]))
        t1 = time.perf_counter()
        check(verify_batch(engine, rounds[1][:1]))
        t2 = time.perf_counter()
        check(verify_batch(engine, rounds[1][1:]))
        t3 = time.perf_counter()
        batched.append((t1 - t0) * 1e3)
        separate.append((t3 - t1) * 1e3)
        long_alone.append((t2 - t1) * 1e3)
    assert [s.output for s in twins[0]] == [s.output for s in twins[1]], "batched output differs from separate"
    print(
        f"median of {args.rounds} rounds: long session alone {_median(long_alone):.1f} ms, 15 short batched "
        f"{_median(separate) - _median(long_alone):.1f} ms (t = {twins[0][0].t} and "
        f"{min(s.t for s in twins[0][1:])}-{max(s.t for s in twins[0][1:])})"
    )
    b, sep = _median(batched), _median(separate)
    print(f"mixed-lengths: batched {b:.1f} ms vs separate {sep:.1f} ms, ratio {b / sep:.2f}")


def long_prefill(args, recipe, engine, sampling, long, short) -> None:
    import asyncio
    from concurrent.futures import ThreadPoolExecutor

    from hycoc.verifier.scheduler import BatchScheduler

    from hycoc.protocol.messages import DraftTree

    rng = np.random.default_rng(0)
    vocab = engine.vocab_size

    def random_tree(root):
        """33 rows: the root, 8 children, 3 under each (random tokens: the latency, not the acceptance, counts)."""
        parents = [-1] + [0] * 8 + [c for c in range(1, 9) for _ in range(3)]
        return DraftTree(
            0, np.array([root] + rng.integers(3, vocab, 32).tolist(), np.int32), np.array(parents, np.int32)
        )

    async def scenario(with_short: bool, with_long: bool):
        worker = ThreadPoolExecutor(max_workers=1)
        loop = asyncio.get_running_loop()

        def run(fn, *a):
            return loop.run_in_executor(worker, fn, *a)

        sessions = [await run(_open, engine, recipe, sampling, p, i) for i, p in enumerate(short)] if with_short else []
        sched = BatchScheduler(
            run,
            max_batch_rows=recipe.verifier.max_batch_rows,
            max_batch_wait_ms=recipe.verifier.max_batch_wait_ms,
            open_sessions=lambda: len(sessions) + int(with_long),
            on_step=lambda r: None,
            chain_length=engine.chain_length,
            prefill_budget=engine.prefill_chunk,
        )
        sched.start()
        latencies, times = [], {}

        async def short_client(sess):
            for seq in range(args.rounds):
                tree = random_tree(sess.root)
                t0 = time.perf_counter()
                await sched.round(sess, DraftTree(seq, tree.tokens, tree.parents))
                latencies.append((time.perf_counter() - t0) * 1e3)

        async def long_client():
            sess = _device_session(engine, recipe, sampling, long, seed=7, max_new_tokens=64)
            t0 = time.perf_counter()
            await sched.prefill(sess.prefill_job)
            times["opened"] = (time.perf_counter() - t0) * 1e3
            tree = random_tree(sess.root)
            await sched.round(sess, tree)
            times["first_token"] = (time.perf_counter() - t0) * 1e3
            sess.close()

        jobs = [short_client(s) for s in sessions] + ([long_client()] if with_long else [])
        await asyncio.gather(*jobs)
        await sched.stop()
        worker.shutdown()
        for sess in sessions:
            sess.close()
        return latencies, times

    from rich.console import Console
    from rich.table import Table

    quiet, _ = asyncio.run(scenario(True, False))
    busy, times = asyncio.run(scenario(True, True))
    _, alone = asyncio.run(scenario(False, True))
    table = Table(
        title=f"15 short sessions x {args.rounds} rounds of 33 rows, with and without a {len(long)}-token "
        f"prefill beside them (chunks of {engine.prefill_chunk})"
    )
    for col in ("run", "short rounds p50 ms", "short rounds p90 ms", "long: OPENED ms", "long: first token ms"):
        table.add_column(col, justify="right")
    table.add_row("15 short alone", f"{np.percentile(quiet, 50):.1f}", f"{np.percentile(quiet, 90):.1f}", "", "")
    table.add_row(
        "15 short + long prefill",
        f"{np.percentile(busy, 50):.1f}",
        f"{np.percentile(busy, 90):.1f}",
        f"{times['opened']:.0f}",
        f"{times['first_token']:.0f}",
    )
    table.add_row("long alone", "", "", f"{alone['opened']:.0f}", f"{alone['first_token']:.0f}")
    Console(width=140).print(table)
    print(
        f"long-prefill: short rounds p50 {np.percentile(quiet, 50):.1f} -> {np.percentile(busy, 50):.1f} ms, p90 "
        f"{np.percentile(quiet, 90):.1f} -> {np.percentile(busy, 90):.1f} ms; long time to first token "
        f"{times['first_token']:.0f} ms beside them vs {alone['first_token']:.0f} ms alone"
    )


if __name__ == "__main__":
    main()
