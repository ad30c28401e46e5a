"""Record a toy runtime run against the real verifier, then replay it without a server (docs/device-runtime.md "Host
work per round").

    python benchmarks/runtime_replay.py record bundles/toy-cpu runs/replay-hyco.pkl            # needs the verifier
    python benchmarks/runtime_replay.py replay bundles/toy-cpu runs/replay-hyco.pkl --reps 3   # no server
    python benchmarks/runtime_replay.py replay bundles/toy-cpu runs/replay-hyco.pkl --steps    # + per-step times

``record`` runs `DeviceRuntime.generate` (mode ``hyco`` by default, 4 Spec-Bench questions x 128 tokens, the
bundle's graphs on onnxruntime's CPU EP with one thread) against ``hycoc verify-server`` in a child process
(`hycoc.bench.verifier_process.VerifierProcess`) and keeps, per question, the opened session, every round's tree
(tokens, parents) and the verifier's reply, and the text (a pickle: trusted, local files only; written to a temporary
name and renamed when complete). ``replay`` runs the same requests with a stand-in client that answers each round with
the recorded reply and raises when the runtime's tree differs from the recorded one, checks the texts, and prints
the drafting region's host time per round and the host share (thread CPU time, as
``benchmarks/runtime_host_share.py`` counts it: `hycoc.bench.runtime_timing.CpuClock`), without the verifier's
process on the machine. ``--steps``: also the exclusive CPU time per round of the runtime's main steps
(`hycoc.bench.runtime_timing.StepTimer`).
"""

from __future__ import annotations

import argparse
import pickle
import time
from pathlib import Path

import numpy as np

from hycoc.bench.runtime_timing import CpuClock, StepTimer, TimedSession

REPO = Path(__file__).resolve().parents[1]


class TreeMismatch(AssertionError):
    """The replayed runtime built a tree that differs from the recorded one."""


class Recorder:
    """A verifier client that passes every call through and keeps the opened session, trees and replies."""

    def __init__(self, inner):
        self.inner, self.log = inner, {"opened": None, "rounds": []}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def open(self, request):
        self.log["opened"] = self.inner.open(request)
        return self.log["opened"]

    def round(self, tree):
        reply = self.inner.round(tree)
        self.log["rounds"].append((np.array(tree.tokens), np.array(tree.parents), reply))
        return reply


class Replayer:
    """A verifier client answering from a recording; raises TreeMismatch when a round's tree differs."""

    def __init__(self, log):
        self.log, self.i, self.opened, self.round_bytes, self.link_s = log, 0, None, [], 0.0

    def open(self, request):
        self.opened = self.log["opened"]
        return self.opened

    def round(self, tree):
        tokens, parents, reply = self.log["rounds"][self.i]
        if not (np.array_equal(tokens, tree.tokens) and np.array_equal(parents, tree.parents)):
            raise TreeMismatch(f"round {self.i}: the tree differs from the recording")
        self.i += 1
        self.round_bytes.append((0, 0))
        return reply

    def close(self):
        pass


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("cmd", choices=("record", "replay"))
    ap.add_argument("bundle", type=Path, help="a cpu bundle")
    ap.add_argument("file", type=Path, help="the recording")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes" / "toy.toml", help="the bundle's recipe")
    ap.add_argument("--questions", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--mode", default="hyco")
    ap.add_argument("--reps", type=int, default=3, help="replays (default 3)")
    ap.add_argument("--steps", action="store_true", help="also per-step exclusive CPU time")
    ap.add_argument(
        "--ort-default",
        action="store_true",
        help="sessions with onnxruntime's default SessionOptions (pool of one thread per core, spinning "
        "on): what the runtime used before `cpu_session_options`",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per graph session (default 1; 0 = onnxruntime's default pool, one "
        "thread per core: `hycoc.runtime.graph_sessions.cpu_session_options`)",
    )
    return ap.parse_args(argv)


def step_timer():
    """A `StepTimer` (thread CPU time) wrapped around the drafting steps of the device runtime (``--steps``)."""
    from hycoc.runtime import drafters, graphs, mtp_drafter, slm_drafter, tree_builder

    timer = StepTimer(time.thread_time)
    for owner, attr in [
        (mtp_drafter.MtpDrafter, "ingest"),
        (mtp_drafter.MtpDrafter, "draft"),
        (slm_drafter.SlmDrafter, "feeds"),
        (slm_drafter.SlmDrafter, "expand"),
        (tree_builder.TreeBuilder, "slm_pass"),
        (tree_builder.TreeBuilder, "build"),
        (graphs.GraphRunner, "run"),
        (drafters.SlmTreeDrafter, "build_tree"),
    ]:
        timer.wrap(owner, attr, f"{owner.__name__}.{attr}")
    return timer


def device_runtime(args: argparse.Namespace, cpu: CpuClock, timer):
    """The bundle (``args.bundle``, cpu) and a `DeviceRuntime` over it whose graph sessions ``cpu`` clocks (and
    ``timer``, when given, as "ORT call"): ``--threads`` intra-op threads, or onnxruntime's defaults with
    ``--ort-default``."""
    from hycoc.runtime.client import DeviceRuntime
    from hycoc.runtime.device_bundle import open_bundle
    from hycoc.runtime.graphs import GraphRunner, RunnerSettings, code_outputs, runtime_outputs

    bundle = open_bundle(args.bundle, "cpu")
    runners = []
    for name in ("head", "slm"):
        entry = bundle.manifest.graph(name)
        runner = GraphRunner(
            bundle.path,
            bundle.manifest,
            name,
            "cpu",
            runtime_outputs(entry),
            RunnerSettings(threads=args.threads, codes=code_outputs(entry)),
        )
        if args.ort_default:
            import onnxruntime as ort

            runner.session = ort.InferenceSession(str(bundle.path / entry.file), providers=["CPUExecutionProvider"])
        runner.session = cpu.session(runner.session)
        if timer is not None:  # the graph's own time as "ORT call", out of GraphRunner.run's
            runner.session = TimedSession(runner.session, timer)
        runners.append(runner)
    return bundle, DeviceRuntime(bundle, *runners)


def record(args: argparse.Namespace, bundle, rt) -> int:
    """Generate ``--questions`` answers against a child verify-server, recording every round, and write the
    recording to ``args.file``."""
    from hycoc.runtime import transport

    from hycoc.bench.datasets import load_spec_bench
    from hycoc.bench.verifier_process import VerifierProcess
    from hycoc.cli import DEFAULT_DATASET
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    questions = load_spec_bench(recipe.resolve_path(recipe.bench.dataset) or DEFAULT_DATASET)[: args.questions]
    logs, texts = [], []
    with VerifierProcess(args.recipe, args.bundle / "keep_set.npy") as srv:
        for q in questions:
            ids = bundle.chat.prompt(q.turns[0])
            rec = Recorder(transport.VerifierClient(srv.url))
            res = rt.generate(rec, ids, mode=args.mode, max_new_tokens=args.tokens)
            logs.append((ids, rec.log))
            texts.append(res.tokens)
    args.file.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.file.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        pickle.dump({"logs": logs, "texts": texts, "mode": args.mode, "tokens": args.tokens}, f)
    tmp.replace(args.file)
    print(
        f"recorded {len(texts)} requests, {sum(len(t) for t in texts)} tokens, "
        f"{sum(len(log['rounds']) for _, log in logs)} rounds -> {args.file}"
    )
    return 0


def replay(args: argparse.Namespace, rt, cpu: CpuClock, timer) -> int:
    """Replay the recording ``--reps`` times, printing each replay's drafting CPU split; raises TreeMismatch when a
    tree or a text differs from the recording."""
    with open(args.file, "rb") as f:
        data = pickle.load(f)  # a recording this script wrote (trusted, local)
    for rep in range(args.reps):
        d0, g0, rounds = cpu.draft_s, cpu.graph_s, 0
        w0, p0 = time.perf_counter(), time.process_time()
        for (ids, log), text in zip(data["logs"], data["texts"]):
            res = rt.generate(Replayer(log), ids, mode=data["mode"], max_new_tokens=data["tokens"])
            if res.tokens != text:
                raise TreeMismatch("the text differs from the recording")
            rounds += res.rounds
        d, g = cpu.draft_s - d0, cpu.graph_s - g0
        wall, proc = time.perf_counter() - w0, time.process_time() - p0
        print(
            f"rep {rep}: drafting {1000 * d:.1f} ms CPU, in InferenceSession.run {1000 * g:.1f} ms, host "
            f"{1000 * (d - g):.1f} ms = {1000 * (d - g) / max(rounds, 1):.3f} ms/round, host share "
            f"{100 * (d - g) / d:.1f}% ({rounds} rounds); whole replay {1000 * wall / max(rounds, 1):.3f} ms/round "
            f"wall, {1000 * proc / max(rounds, 1):.3f} ms/round process CPU (all threads), threads "
            f"{'onnxruntime default options (spinning)' if args.ort_default else args.threads or 'pool, no spin'}"
            f", load {open('/proc/loadavg').read().split()[0]}"
        )
        if timer is not None:
            print(
                "  per round (ms CPU, exclusive): "
                + " ".join(
                    f"{k}={1000 * v / max(rounds, 1):.3f}"
                    for k, v in sorted(timer.seconds.items(), key=lambda kv: -kv[1])
                )
            )
            timer.seconds.clear()
    print("trees and texts identical to the recording")
    return 0


def main(argv=None) -> int:
    """Record or replay (module docstring); returns the exit code."""
    args = parse_args(argv)
    cpu = CpuClock()
    timer = step_timer() if args.steps else None
    bundle, rt = device_runtime(args, cpu, timer)
    if args.cmd == "record":
        return record(args, bundle, rt)
    return replay(args, rt, cpu, timer)


if __name__ == "__main__":
    raise SystemExit(main())
