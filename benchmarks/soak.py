"""A soak of one verifier server: multi-turn chats with faults, and the protocol fuzzer beside them (issue 38 item 5;
docs/serving.md "Soak and fuzz").

    python benchmarks/soak.py recipes/toy.toml --minutes 10 --sessions 16 --out runs/soak
    nice -n 5 python benchmarks/soak.py recipes/toy.toml --minutes 2          # a short try

Starts ``hycoc verify-server RECIPE`` (a child process, ``HYCOC_INJECT_FAULTS="append_chunk=P"`` in its environment:
that share of APPEND prefill chunks fails, `hycoc.verifier.faults`) and runs, for ``--minutes``:

- ``--sessions`` chat devices, each one conversation after another: OPEN with the conversation rendered by the
  checkpoint's template (`hycoc.chat.Conversation`) and the bundle's chat contract, rounds until the turn finishes
  (random chains of B + 1 rows: the verifier's own samples are committed, about one token a round), then the next
  user turn as an APPEND (keep the common prefix, its crc32, the new anchor), 2-4 turns; at random a device cancels
  (CLOSE mid-turn) or disconnects (drops the socket right after sending a ROUND), and an APPEND whose chunk failed
  (ERROR injected_fault) is sent again;
- the protocol fuzzer (`hycoc.bench.loadtest.protocol_fuzz.fuzz`, ``--fuzz-connections``) for the same time.

Every ``--sample-s`` seconds it reads the server's /metrics (tokens, KV held and reserved, the samples of held over
reserved) and RSS (/proc/PID/status). It prints, per minute, tokens served, rounds, APPENDs, errors, the peak of KV
held against reserved and RSS, then the summary: tokens served, errors by code (chat devices; fuzzer), held vs
reserved, RSS flat or not (within 5% from minute 2 to the end), crashes (the server process alive, /healthz ok),
and writes OUT/soak.json. Exit status 1 when the server crashed, answered internal_error, held more KV than it
reserved, or the fuzzer found a fault. Needs bundles/<recipe>-cpu (its chat contract): `hycoc build RECIPE --target
cpu`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hycoc.bench.loadtest.protocol_fuzz import FuzzStats, error_counts, fuzz, target_of
from hycoc.bench.loadtest.run import ServerProcess, committed_tokens, healthz, parse_metrics
from hycoc.chat import Conversation, common_prefix, ids_crc32
from hycoc.protocol import wire
from hycoc.protocol.messages import AppendTurn, Close, DraftTree, ErrorReply, Opened, OpenRequest, Sampling

ANSWER_TIMEOUT_S = 120.0
WORDS = (
    "the cat sat on a mat while rain fell over old hills and a river ran to the sea near town at night "
    "what why how when who tell me about explain write list three reasons short story poem number"
).split()


@dataclass
class ChatStats:
    """What the chat devices did: conversations, turns, rounds, tokens committed, cancels, disconnects, APPENDs
    retried after an injected fault, and ERROR codes (or client-side failures) by name."""

    conversations: int = 0
    turns: int = 0
    rounds: int = 0
    tokens: int = 0
    appends: int = 0
    cancels: int = 0
    disconnects: int = 0
    injected_retries: int = 0
    errors: Counter = field(default_factory=Counter)


def user_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40)))


def chain(root: int, seq: int, rows: int, vocab: int, rng: random.Random) -> DraftTree:
    """A ROUND of ``rows`` rows: a chain from ``root`` of random ids, tree scores falling 0.5 a row."""
    tokens = np.asarray([root] + [rng.randrange(3, vocab) for _ in range(rows - 1)], np.int32)
    return DraftTree(seq, tokens, np.arange(-1, rows - 1, dtype=np.int16), -0.5 * np.arange(rows, dtype=np.float32))


async def ask(ws, frame: bytes):
    await ws.send(frame)
    return wire.decode(await asyncio.wait_for(ws.recv(), ANSWER_TIMEOUT_S), wire.Limits(max_frame_bytes=2**26))


async def answer_turn(ws, opened: Opened, root: int, held: int, max_new: int, rng, stats: ChatStats, faults: dict):
    """Rounds until the turn finishes. Returns the committed ids, or a str: "cancel", "disconnect" or an error
    code (the conversation ends)."""
    out: list[int] = []
    seq, allowance = 0, opened.tree_rows  # protocol 6: each later round holds at most the last reply's allowance
    while True:
        tree = chain(root, seq, allowance, opened.vocab_size, rng)
        if rng.random() < faults["disconnect"]:
            await ws.send(wire.encode(tree))
            ws.transport.abort()  # gone mid-round: the server finishes the round, drops the reply, frees the KV
            stats.disconnects += 1
            return "disconnect"
        if rng.random() < faults["cancel"]:
            await ws.send(wire.encode(Close(opened.session_id)))
            stats.cancels += 1
            return "cancel"
        reply = await ask(ws, wire.encode(tree))
        if isinstance(reply, ErrorReply):
            stats.errors[reply.code] += 1
            return reply.code
        room = opened.max_context - held - len(out)
        new, reason = committed_tokens(tree.tokens, reply, opened.stop_ids, max_new - len(out), room, False)
        out += new
        stats.rounds += 1
        stats.tokens += len(new)
        seq += 1
        if reply.finished or reason is not None:
            return out
        root, allowance = new[-1], reply.allowance or opened.tree_rows


async def conversation(url: str, chat, contract: str, rng: random.Random, stats: ChatStats, faults: dict) -> None:
    """One conversation on its own connection (module docstring)."""
    from websockets.asyncio.client import connect

    async with connect(url, compression=None, max_size=2**26, proxy=None, ping_interval=None) as ws:
        conv = Conversation(chat)
        rendered = conv.ask(user_text(rng))
        max_new = rng.randint(16, 64)
        req = OpenRequest(
            prompt_ids=np.asarray(rendered.ids, np.int32),
            sampling=Sampling(1.0, 64, 0.95),
            seed=rng.randrange(2**31),
            max_new_tokens=max_new,
            chat=contract,
            anchor=rendered.anchor,
        )
        opened = await ask(ws, wire.encode(req))
        if not isinstance(opened, Opened):
            stats.errors[opened.code if isinstance(opened, ErrorReply) else "unexpected"] += 1
            return
        stats.conversations += 1
        for _ in range(rng.randint(2, 4)):
            out = await answer_turn(ws, opened, rendered.ids[-1], len(rendered.ids), max_new, rng, stats, faults)
            if isinstance(out, str):
                return
            stats.turns += 1
            conv.answered(rendered, out)
            rendered = conv.ask(user_text(rng))
            if len(rendered.ids) + 80 >= opened.max_context:
                break
            keep = max(1, min(common_prefix(conv.held, rendered.ids), len(rendered.ids) - 1))
            max_new = rng.randint(16, 64)
            msg = AppendTurn(
                np.asarray(rendered.ids[keep:], np.int32),
                max_new,
                keep,
                ids_crc32(conv.held[:keep]),
                rendered.anchor if rendered.anchor >= keep else 0,
            )
            for _ in range(5):
                got = await ask(ws, wire.encode(msg))
                if not (isinstance(got, ErrorReply) and got.code == "injected_fault"):
                    break
                stats.injected_retries += 1  # the failed chunk changed nothing: the same APPEND again
            if not isinstance(got, Opened):
                stats.errors[got.code if isinstance(got, ErrorReply) else "unexpected"] += 1
                return
            stats.appends += 1
        await ws.send(wire.encode(Close(opened.session_id)))


async def device(url: str, chat, contract: str, seed: int, deadline: float, stats: ChatStats, faults: dict) -> None:
    """One chat device: conversations until ``deadline`` (time.monotonic()); failures are counted, never raised."""
    from websockets.exceptions import ConnectionClosed, InvalidHandshake

    rng = random.Random(seed)
    while time.monotonic() < deadline:
        try:
            await conversation(url, chat, contract, rng, stats, faults)
        except ConnectionClosed:
            stats.errors["connection_closed"] += 1
        except TimeoutError:
            stats.errors["timeout"] += 1
        except (OSError, InvalidHandshake) as e:
            stats.errors[f"unreachable:{type(e).__name__}"] += 1
            await asyncio.sleep(1.0)


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MB (10^6 B), from /proc/PID/status; NaN when the process is gone."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024 / 1e6
    except OSError:
        pass
    return float("nan")


def scrape(url: str, pid: int, t0: float) -> dict:
    """One sample: seconds since ``t0``, the server's RSS and its /metrics' tokens, rounds, KV held and reserved."""
    import urllib.request

    sample = {"t": round(time.monotonic() - t0, 1), "rss_mb": rss_mb(pid)}
    try:
        with urllib.request.urlopen("http" + url.removeprefix("ws") + "/metrics", timeout=30) as r:
            values = parse_metrics(r.read().decode("utf-8"))
    except OSError:
        return {**sample, "scrape_failed": True}
    for key in (
        "hycoc_tokens_committed_total",
        "hycoc_rounds_total",
        "hycoc_sessions_active",
        "hycoc_kv_bytes_held",
        "hycoc_kv_bytes_held_peak",
        "hycoc_kv_bytes_reserved",
        "hycoc_kv_held_over_reserved_total",
    ):
        sample[key] = values.get(key, float("nan"))
    return sample


async def sampler(url: str, pid: int, t0: float, deadline: float, every_s: float, samples: list) -> None:
    loop = asyncio.get_running_loop()
    while time.monotonic() < deadline:
        samples.append(await loop.run_in_executor(None, scrape, url, pid, t0))
        await asyncio.sleep(max(0.0, min(every_s, deadline - time.monotonic())))
    samples.append(await loop.run_in_executor(None, scrape, url, pid, t0))


def per_minute(samples: list[dict]) -> list[dict]:
    """The last sample of each minute (the first sample as minute 0), with the minute's peak of KV held over
    reserved and its tokens and rounds."""
    rows, prev = [], samples[0]
    for m in range(1, int(samples[-1]["t"] // 60) + 2):
        inside = [s for s in samples if (m - 1) * 60 < s["t"] <= m * 60 and not s.get("scrape_failed")]
        if not inside:
            continue
        last = inside[-1]
        rows.append(
            {
                "minute": m,
                "tokens": last["hycoc_tokens_committed_total"] - prev["hycoc_tokens_committed_total"],
                "rounds": last["hycoc_rounds_total"] - prev["hycoc_rounds_total"],
                "sessions": last["hycoc_sessions_active"],
                "held_peak_mb": max(s["hycoc_kv_bytes_held_peak"] for s in inside) / 1e6,
                "reserved_max_mb": max(s["hycoc_kv_bytes_reserved"] for s in inside) / 1e6,
                "held_over_reserved": last["hycoc_kv_held_over_reserved_total"],
                "rss_mb": last["rss_mb"],
            }
        )
        prev = last
    return rows


def rss_flat(rows: list[dict], tolerance: float = 0.05) -> tuple[bool, float]:
    """Whether RSS stays within ``tolerance`` of its minute-2 value from minute 2 to the end; (flat, growth)."""
    rss = [r["rss_mb"] for r in rows if r["minute"] >= 2]
    if not rss:
        return True, 0.0
    growth = (max(rss) - min(rss)) / rss[0]
    return growth <= tolerance, growth


def print_report(rows, chat: ChatStats, fz: FuzzStats, server_errors: dict, summary: dict) -> None:
    print(
        "| minute | tokens | rounds | open sessions | KV held peak MB | KV reserved max MB | held > reserved | RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['minute']} | {r['tokens']:,.0f} | {r['rounds']:,.0f} | {r['sessions']:.0f} | "
            f"{r['held_peak_mb']:.2f} | {r['reserved_max_mb']:.2f} | {r['held_over_reserved']:.0f} | "
            f"{r['rss_mb']:.1f} |"
        )
    print(
        f"chat devices: {chat.conversations} conversations, {chat.turns} turns, {chat.appends} APPENDs, "
        f"{chat.rounds} rounds, {chat.tokens} tokens, {chat.cancels} cancels, {chat.disconnects} disconnects, "
        f"{chat.injected_retries} APPENDs sent again after an injected fault; errors {dict(chat.errors)}"
    )
    print(
        f"fuzzer: {fz.frames} frames on {fz.connections} connections ({fz.sessions} sessions), "
        f"{len(fz.findings)} findings; codes {dict(fz.codes().most_common())}"
    )
    print(f"server ERROR frames by code: {server_errors}")
    print("summary: " + json.dumps(summary))


def run(args) -> int:
    """The soak (module docstring); returns the exit status."""
    from hycoc.bench.loadtest.run import LoadTestError
    from hycoc.chat import ChatFormat
    from hycoc.chat_template import chat_from_recipe
    from hycoc.recipe.loading import load_recipe

    recipe = load_recipe(args.recipe)
    bundle = args.bundle or Path("bundles") / f"{recipe.recipe.name}-cpu"
    if not (bundle / "manifest.json").is_file():
        raise LoadTestError(f"no bundle at {bundle}: build it once with `hycoc build {args.recipe} --target cpu`")
    contract = ChatFormat.model_validate(json.loads((bundle / "manifest.json").read_text())["chat"]).contract()
    chat = chat_from_recipe(recipe)
    os.environ["HYCOC_INJECT_FAULTS"] = f"append_chunk={args.fail_chunks}"
    load_before = os.getloadavg()
    server = ServerProcess(args.recipe)
    try:
        return _drive(args, server, chat, contract, load_before)
    finally:
        server.stop()


def _drive(args, server, chat, contract: str, load_before) -> int:
    url, pid = server.url, server.proc.pid
    health = healthz(url)
    target = target_of(health, int(health["tree_rows"]))
    faults = {"cancel": args.cancel, "disconnect": args.disconnect}
    stats, fz, samples = ChatStats(), FuzzStats(), []
    seconds = 60.0 * args.minutes
    t0 = time.monotonic()
    deadline = t0 + seconds

    async def main() -> None:
        tasks = [
            device(url, chat, contract, args.seed * 1000 + k, deadline, stats, faults) for k in range(args.sessions)
        ]
        if args.fuzz_connections:
            tasks.append(
                fuzz(url, target, seconds=seconds, connections=args.fuzz_connections, seed=args.seed, stats=fz)
            )
        tasks.append(sampler(url, pid, t0, deadline, args.sample_s, samples))
        await asyncio.gather(*tasks)

    asyncio.run(main())
    alive = server.proc.poll() is None
    healthy = alive and healthz(url).get("status") == "ok"
    server_errors = error_counts(url) if alive else {}
    rows = per_minute(samples)
    flat, growth = rss_flat(rows)
    over = max((s.get("hycoc_kv_held_over_reserved_total", 0) for s in samples), default=0)
    summary = {
        "minutes": args.minutes,
        "sessions": args.sessions,
        "fuzz_connections": args.fuzz_connections,
        "tokens_served": samples[-1].get("hycoc_tokens_committed_total"),
        "server_alive": alive,
        "healthy_after": healthy,
        "internal_error": server_errors.get("internal_error", 0),
        "held_over_reserved_samples": over,
        "rss_flat": flat,
        "rss_growth_from_minute_2": round(growth, 4),
        "load_1min_before": round(load_before[0], 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
    }
    print_report(rows, stats, fz, server_errors, summary)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {
            "summary": summary,
            "minutes": rows,
            "samples": samples,
            "chat": stats.__dict__ | {"errors": dict(stats.errors)},
            "fuzz": {"frames": fz.frames, "findings": fz.findings, "codes": dict(fz.codes())},
            "server_errors": server_errors,
        }
        (out / "soak.json").write_text(json.dumps(doc, indent=1, default=str))
    ok = healthy and not summary["internal_error"] and not over and not fz.findings
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("recipe", type=Path)
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--fuzz-connections", type=int, default=2, help="the fuzzer's connections (0: no fuzzer)")
    ap.add_argument("--cancel", type=float, default=0.005, help="chance a device cancels before a round")
    ap.add_argument("--disconnect", type=float, default=0.005, help="chance a device drops its socket mid-round")
    ap.add_argument("--fail-chunks", type=float, default=0.05, help="share of APPEND chunks the server fails")
    ap.add_argument("--sample-s", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bundle", type=Path, help="the device bundle (default bundles/<recipe name>-cpu)")
    ap.add_argument("--out", help="write OUT/soak.json")
    return run(ap.parse_args())


if __name__ == "__main__":
    sys.exit(main())
