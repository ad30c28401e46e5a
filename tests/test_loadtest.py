"""`hycoc loadtest` (docs/serving.md "Load test: `hycoc loadtest`"): recorded rounds replayed by many asyncio devices
against a tiny verifier served in-process (`ServerThread`), the statistics on known inputs, the projection,
results.json.

The recording is made here the way `record_trace` makes it, with the device's `VerifierClient` wrapped in a
`RecordingClient`, but the trees come from a fixed filler instead of the drafters (no bundle needed). Replayed on a
second server with the same weights, a session must commit exactly what the recording committed, round by round.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from hycoc.runtime.transport import VerifierClient
from hycoc.verifier import VerifierEngine
from hycoc.verifier.server import ServerThread
from tiny_models import VOCAB, tiny_head, tiny_verifier

from hycoc.bench.cost_model.model import CostModel, CostPoint
from hycoc.bench.loadtest.plan import LoadTestRun
from hycoc.bench.loadtest.report import (
    GPU_FLAT_ROWS,
    RUN_KEYS,
    percentile,
    project,
    results_document,
    summarize_run,
    write_results,
)
from hycoc.bench.loadtest.run import (
    LoadTestError,
    RoundSample,
    RunStats,
    arrival_delays,
    committed_tokens,
    parse_metrics,
    replay_request,
    run_loadtest,
    run_sessions,
)
from hycoc.bench.loadtest.trace import (
    RecordingClient,
    RequestTrace,
    RoundTrace,
    Trace,
    TraceError,
    load_trace,
    patch_root,
    request_trace,
    save_trace,
    trace_key,
)
from hycoc.protocol import wire
from hycoc.protocol.messages import DraftTree, OpenRequest, Sampling

torch.set_num_threads(1)
ROWS = 7
PARENTS = np.array([-1, 0, 0, 1, 1, 2, 3], np.int32)
#: the rows' scores s(v) the recording device sends (Alg. 3: each row below its parent; exact in fp16)
SCORES = np.array([0.0, -0.5, -1.0, -1.25, -2.0, -2.5, -3.0], np.float32)
MAX_NEW = 10


def make_engine() -> VerifierEngine:
    model = tiny_verifier(sharpen=3.0)
    return VerifierEngine(
        model,
        head=tiny_head(model),
        head_window=6,
        handoff_scales=(0.1, 0.1, 0.05, 0.05, 0.05, 0.05),
        eos_token_ids=set(),
        max_context=128,
    )


@pytest.fixture(scope="module")
def engine():
    eng = make_engine()
    yield eng
    eng.close()


#: Batching modes the tests' servers run (`hycoc.verifier.server.ServerSettings.batching`); serial is the default here.
MODES = ("serial", "batched")


def serve(engine, mode: str = "serial"):
    return ServerThread(engine, tree_rows=ROWS, batching=mode)


@pytest.fixture(scope="module")
def recorded(engine):
    """Two requests recorded through a RecordingClient (fixed filler trees, rooted at the real root), each with the
    tokens it committed per round."""
    rng = np.random.default_rng(0)
    out = []
    with serve(engine) as srv:
        for i in range(2):
            fill = rng.integers(3, VOCAB, ROWS - 1).astype(np.int32)
            req = OpenRequest(
                prompt_ids=np.arange(20 + i, 32 + i, dtype=np.int32),
                sampling=Sampling(1.0, 64, 0.95),
                seed=7 + i,
                acceptance="exact",
                epsilon=1.0,
                max_new_tokens=MAX_NEW,
            )
            client = RecordingClient(VerifierClient(srv.url))
            opened = client.open(req)
            root, produced, per_round, reason = int(req.prompt_ids[-1]), 0, [], None
            while reason is None:
                tokens = np.concatenate([[root], fill]).astype(np.int32)
                reply = client.round(DraftTree(len(per_round), tokens, PARENTS, SCORES))
                new, reason = committed_tokens(
                    tokens, reply, (), MAX_NEW - produced, opened.max_context - len(req.prompt_ids) - produced, False
                )
                reason = reason or reply.finish_reason
                per_round.append(len(new))
                produced += len(new)
                root = new[-1]
            client.close()
            out.append((request_trace("hyco", 81 + i, req, client.rounds, produced, reason), per_round))
    return out


def test_trace_round_trip_and_bad_files(tmp_path, recorded):
    trace = Trace(
        key=trace_key("r" * 64, "b" * 64, ["hyco"], [81, 82], MAX_NEW),
        stop_ids=(1, 6),
        requests=tuple(r for r, _ in recorded),
        meta={"recipe": "tiny"},
    )
    path = save_trace(trace, tmp_path / "t" / "trace.json")
    assert load_trace(path) == trace
    assert [p.name for p in path.parent.iterdir()] == ["trace.json"]  # no temporary file left
    assert len(trace.key) == 16 and trace.key != trace_key("r" * 64, "b" * 64, ["hyco"], [81, 82], MAX_NEW + 1)
    first = trace.requests[0]
    assert first.rounds[0].tokens[0] == first.prompt[-1] and first.rounds[0].parents == tuple(PARENTS)
    assert all(r.scores == (0.0, -0.5, -1.0, -1.25, -2.0, -2.5, -3.0) for r in first.rounds)  # as sent
    assert json.loads(path.read_text())["requests"][0]["rounds"][0]["scores"] == SCORES.tolist()
    assert all(r.device_ms >= 0 for r in first.rounds) and first.committed == MAX_NEW
    # rounds after the first: the drafting thread's CPU time, never more than the wall time between the rounds
    assert all(r.device_wall_ms + 0.5 >= r.device_ms for r in first.rounds[1:])
    with pytest.raises(TraceError, match="has no requests of config 'specedge'"):
        trace.for_config("specedge")
    data = json.loads(path.read_text())
    data["requests"][0]["rounds"][1]["parents"] = [0] * ROWS
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"requests\[0\]\.rounds\[1\]: .*parents\[0\] = -1"):
        load_trace(path)
    data["requests"][0]["rounds"][1]["parents"] = PARENTS.tolist()
    data["requests"][0]["rounds"][1]["scores"] = [0.0] * (ROWS - 1)
    path.write_text(json.dumps(data))
    with pytest.raises(TraceError, match=r"requests\[0\]\.rounds\[1\]: tokens, parents and scores"):
        load_trace(path)
    for schema in (2, 4, 99):  # a trace recorded before the rounds carried head_ms is re-recorded, never misread
        path.write_text(json.dumps({**data, "schema": schema}))
        with pytest.raises(TraceError, match=f"schema {schema}, this hycoc reads 5; delete it to re-record"):
            load_trace(path)


def test_replay_sends_the_recorded_scores(engine, recorded, monkeypatch):
    """The replayed ROUND frames carry the scores the recording device sent (a budgeted verifier ranks rows by
    them); a round recorded without scores is replayed without."""
    req = recorded[0][0]
    bare = replace(req, rounds=(replace(req.rounds[0], scores=None), *req.rounds[1:]))
    encode, trees = wire.encode, []

    def spy(msg, *args, **kw):
        frame = encode(msg, *args, **kw)
        if isinstance(msg, DraftTree):
            trees.append(wire.decode(frame))
        return frame

    monkeypatch.setattr(wire, "encode", spy)
    with serve(engine) as srv:

        async def go():
            t0 = asyncio.get_running_loop().time()
            await replay_request(srv.url, bare, (), RunStats(), t0, t0 + 60, device_ms=0.0)

        asyncio.run(go())
    assert len(trees) == len(req.rounds) and trees[0].scores is None
    for tree in trees[1:]:
        assert tree.scores.tolist() == SCORES.tolist()


def test_speed_probe_replays_a_fixed_workload(engine, recorded):
    """`SpeedProbe` replays the first rounds of one recorded request on a fresh session and closes it: one CPU ms
    per round; a request without rounds is refused."""
    from hycoc.bench.capacity.speed_probe import SpeedProbe

    req, per_round = recorded[0]
    n = min(3, len(per_round))
    probe = SpeedProbe(engine, req, rounds=n, repeats=2)
    times = probe._one()
    assert len(times) == n and all(t > 0 for t in times)
    ms = probe.measure()
    assert math.isfinite(ms) and ms > 0
    empty = replace(req, rounds=())
    with pytest.raises(ValueError, match="the speed probe's request has no recorded rounds"):
        SpeedProbe(engine, empty)


def test_patch_root_keeps_the_tree_valid():
    tokens = np.array([5, 9, 11, 12, 13, 14, 15], np.int32)
    patched = patch_root(tokens, 250)
    assert patched.tolist() == [250, 9, 11, 12, 13, 14, 15] and tokens[0] == 5  # a copy
    limits = wire.Limits(vocab_size=VOCAB, tree_rows=ROWS)
    back = wire.decode(wire.encode(DraftTree(3, patched, PARENTS)), limits)
    assert back.tokens.tolist() == patched.tolist() and back.parents.tolist() == PARENTS.tolist()
    with pytest.raises(ValueError, match="non-empty 1-D"):
        patch_root([], 1)


def test_replay_commits_what_the_recording_committed(engine, recorded):
    """Same weights, same seed, same trees (root patched to the replay's own root): the same tokens per round."""
    for req, per_round in recorded:
        stats = RunStats()
        with serve(engine) as srv:

            async def go():
                t0 = asyncio.get_running_loop().time()
                await replay_request(srv.url, req, (), stats, t0, t0 + 60, device_ms=0.0)

            asyncio.run(go())
        assert [r.committed for r in stats.rounds] == per_round
        assert (stats.requests_finished, stats.requests_truncated, dict(stats.errors)) == (1, 0, {})
        assert [r.rows for r in stats.rounds] == [ROWS] * len(per_round)
        assert [r.context for r in stats.rounds] == list(len(req.prompt) - 1 + np.cumsum([0] + per_round[:-1]))


@pytest.mark.parametrize("mode", MODES)
def test_short_load_test_commits_tokens_without_errors(engine, recorded, mode):
    reqs = [r for r, _ in recorded]
    with serve(engine, mode) as srv:
        stats = run_sessions(srv.url, [reqs] * 3, (), 2.0, device_ms=5.0)
        committed = sum(r.committed for r in stats.rounds)
        assert committed > 0 and dict(stats.errors) == {}
        assert committed == srv.server.metrics.tokens_committed  # the server counted every token the client did
        assert len(stats.rounds) == srv.server.metrics.rounds
        assert len(stats.opens_ms) >= 3 and stats.requests_truncated == 0  # replays end as recorded, or at the end


def test_server_error_codes_are_counted(engine, recorded):
    req = recorded[0][0]
    bad = RoundTrace(tokens=(0, VOCAB + 5, 3, 3, 3, 3, 3), parents=tuple(PARENTS), device_ms=0.0)
    broken = RequestTrace(**{**req.__dict__, "rounds": (bad,)})
    with serve(engine) as srv:
        stats = run_sessions(srv.url, [[broken]], (), 1.0, device_ms=0.0)
        assert set(stats.errors) == {"token_out_of_vocab"} and stats.errors["token_out_of_vocab"] >= 1
        assert (
            stats.rounds == [] and srv.server.metrics.errors["token_out_of_vocab"] == stats.errors["token_out_of_vocab"]
        )


def test_percentiles_and_arrivals():
    values = list(range(1, 101))
    assert (percentile(values, 50), percentile(values, 90), percentile(values, 99)) == pytest.approx(
        (50.5, 90.1, 99.01), abs=1e-12
    )
    assert percentile([7.0], 99) == 7.0 and math.isnan(percentile([], 50))
    assert arrival_delays(3, None).tolist() == [0.0, 0.0, 0.0]
    d = arrival_delays(2000, 50.0, seed=1)
    assert d[0] == 0.0 and np.all(np.diff(d) >= 0) and np.mean(np.diff(d)) == pytest.approx(1 / 50, rel=0.05)


def test_summary_counts_the_window_and_the_server_histograms():
    stats = RunStats(
        rounds=[
            RoundSample(0.5, 10.0, 4.0, 3, 33, 100),
            RoundSample(1.0, 20.0, 6.0, 5, 33, 104),
            RoundSample(1.9, 30.0, 8.0, 2, 33, 110),
            RoundSample(2.1, 99.0, 9.0, 7, 33, 112),
        ],
        opens_ms=[50.0, 70.0],
        errors=Counter({"bad_root": 2}),
        requests_finished=1,
        client_cpu_s=0.5,
        wall_s=2.5,
        first_round_s={0: 0.5, 1: 1.0, 2: 0.5},
        device_waits_ms=[(10.0, 12.0), (20.0, 30.0)],
    )
    before = parse_metrics(
        "# HELP x\nhycoc_batch_rows_sum 100\nhycoc_batch_rows_count 4\nhycoc_rounds_total 9\n"
        'hycoc_errors_total{kind="bad_root"} 1\n'
    )
    after = parse_metrics(
        "hycoc_batch_rows_sum 298\nhycoc_batch_rows_count 7\nhycoc_rounds_total 13\n"
        "hycoc_batch_sessions_sum 6\nhycoc_batch_sessions_count 3\nhycoc_server_ms_total 42.5\n"
        "hycoc_tokens_committed_total 17\n"
    )
    row = summarize_run("batched", 4, 2.0, stats, before, after, (1.0, 1.0, 1.0))
    assert set(row) == set(RUN_KEYS)
    # 4 devices, 3 with a first round: no end of the ramp, the whole run is the window; 2.1 s is past it
    assert (row["rounds"], row["committed_tokens"], row["tok_per_s"], row["steady"]) == (3, 10, 5.0, False)
    assert row["device_wait_ms"] == {"asked": 15.0, "slept": 21.0} and row["tok_per_s_whole"] == 5.0
    assert row["devices_served"] == 3
    steady = summarize_run("batched", 3, 2.0, stats)  # ramp ends at 1.0 s: only the round at 1.9 s counts
    assert (steady["ramp_s"], steady["steady"], steady["rounds"], steady["tok_per_s"]) == (1.0, True, 1, 2.0)
    assert steady["latency_ms"]["p50"] == 30.0 and steady["tok_per_s_whole"] == 5.0
    assert row["reply_ms_per_token"] == pytest.approx(18.0 / 10) and row["mat"] == pytest.approx(10 / 3)
    assert row["verifier_ms_per_token"] == pytest.approx(42.5 / 17)  # the server's worker time per token
    assert summarize_run("serial", 4, 2.0, stats)["verifier_ms_per_token"] == pytest.approx(1.8)  # no /metrics

    assert row["latency_ms"]["p50"] == 20.0 and row["latency_ms"]["max"] == 30.0
    assert row["rows_per_forward"] == pytest.approx(198 / 3) and row["sessions_per_forward"] == 2.0
    assert row["queue_wait_ms"] is None and row["server_rounds"] == 4 and row["server_tokens"] == 17
    assert (row["errors"], row["errors_total"], row["client_cpu_pct"]) == ({"bad_root": 2}, 2, 20.0)
    assert row["open_ms_p50"] == 60.0 and row["context_mean"] == pytest.approx(314 / 3)


def test_projection_flat_gpu_and_cost_model():
    serial = {"rows_per_tree": 33.0, "rows_per_forward": None, "sessions_per_forward": None, "context_mean": 100}
    assert project(serial)["trees_per_forward"] == 1.0 and project(serial)["speedup"] == 1.0
    batched = dict(serial, rows_per_forward=528.0, sessions_per_forward=16.0)
    p = project(batched)
    assert p["speedup"] == pytest.approx(16 / (528 / GPU_FLAT_ROWS)) and "assumed GPU" in p["basis"]
    assert project(dict(serial, rows_per_forward=132.0))["speedup"] == pytest.approx(4.0)  # under the flat rows
    cost = CostModel(
        device="gpu",
        dtype="bfloat16",
        model="m",
        points=[
            CostPoint(rows=r, context=c, ms=ms)
            for r, c, ms in ((33, 0, 10.0), (33, 200, 12.0), (528, 0, 20.0), (528, 200, 30.0))
        ],
    )
    assert project(batched, cost)["speedup"] == pytest.approx(11.0 * 16 / 25.0)  # context 100: 11 ms vs 25 ms
    gone = project(dict(batched, rows_per_forward=1056.0, sessions_per_forward=32.0), cost)
    assert gone["speedup"] is None and "rows = 1056 is outside" in gone["basis"]
    assert project({"rows_per_tree": None}) is None


def test_run_loadtest_writes_results_and_plot(tmp_path, engine, recorded):
    trace = Trace(key="k", stop_ids=(), requests=tuple(r for r, _ in recorded))
    with serve(engine) as srv:
        with pytest.raises(
            LoadTestError,
            match="asked for batching 'batched', but the verify-server reports "
            "'serial' in /healthz; use --batching serial",
        ):
            run_loadtest(trace, LoadTestRun(["hyco"], [2], ["batched"], 1.0, tmp_path, server=srv.url, warmup_s=0.0))
        probed: list[float] = []  # when the probe ran (epoch s); it returns how many times it has run

        def probe() -> float:
            probed.append(time.time())
            return float(len(probed))

        doc = run_loadtest(
            trace,
            LoadTestRun(["hyco"], [2], None, 1.0, tmp_path, server=srv.url, device_ms=5.0, warmup_s=0.0),
            meta={"recipe": "tiny"},
            probe=probe,
        )
    saved = json.loads((tmp_path / "results.json").read_text())
    # the probe ran twice right before the run's window and twice right after it, never inside
    (window,) = saved["meta"]["run_windows"]
    assert saved["runs"][0].pop("speed_probe_ms") == [1.0, 2.0, 3.0, 4.0] and len(probed) == 4
    assert max(probed[:2]) <= window["epoch_s"][0] and min(probed[2:]) >= window["epoch_s"][1]
    doc["runs"][0].pop("speed_probe_ms")
    assert saved == doc and saved["schema"] == 1 and saved["meta"]["recipe"] == "tiny"
    (row,) = saved["runs"]
    assert set(row) == set(RUN_KEYS) and (row["mode"], row["sessions"], row["errors_total"]) == ("serial", 2, 0)
    assert row["committed_tokens"] > 0 and saved["meta"]["servers"]["serial"]["mode"] == "serial"
    if row["rows_per_forward"] is not None:  # a server with the batch histograms: serial forwards hold one tree
        assert row["rows_per_forward"] == ROWS and row["sessions_per_forward"] == 1.0
    assert row["projection"]["trees_per_forward"] == 1.0
    assert (tmp_path / "latency_vs_sessions.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latency_vs_sessions.png", "results.json"]
    nan = results_document([{"x": math.nan, "y": [1.0, math.inf]}], {})
    assert nan["runs"] == [{"x": None, "y": [1.0, None]}]
    write_results(tmp_path / "r.json", nan)
    assert json.loads((tmp_path / "r.json").read_text())["runs"][0]["x"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--sessions", "4,0"], "--sessions '4,0': give comma-separated positive integers such as 1,4,16,64"),
        (["--configs", "hyco,slm-alone"], "--configs: unknown or without a verifier: slm-alone; allowed: cloud-mtp,"),
        (["--batching", "fast"], "--batching 'fast': allowed: serial, batched, budgeted, allowance (comma-separated)"),
        (
            ["--batching", "batched:slm-alone"],
            "--batching 'batched:slm-alone': allowed: serial, batched, budgeted, allowance (comma-separated), each "
            "optionally as MODE:CONFIG with CONFIG one of cloud-mtp,",
        ),
        (
            ["--batching", "serial,batched", "--server", "ws://127.0.0.1:1"],
            "--batching 'serial,batched' with --server: a running server has one mode",
        ),
    ],
)
def test_loadtest_command_names_a_bad_option(args, message):
    from typer.testing import CliRunner

    from hycoc.cli import app

    result = CliRunner().invoke(
        app, ["loadtest", str(Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"), *args]
    )
    assert result.exit_code == 2 and result.stderr.startswith(f"hycoc loadtest: {message}"), result.stderr


def test_tree_at_follows_the_text_by_position():
    """Two recorded rounds: round 0's tree (root 5; chain 10 -> 11 -> 12, sibling 20 under the root, leaf 13 under
    11) committed 10, 11 + bonus 13; round 1 (root 13) committed 14 + bonus 15. A replay that committed 10 alone is
    at depth 1 of round 0: it gets the sub-tree under row 1 (rows 1, 2, 3, 5), re-rooted, scores re-based,
    padded to 6 rows; one that committed 10, 11 gets row 2's sub-tree (rows 2, 3, 5); after round 0's three
    tokens, round 1's own tree; off the recorded text: None; past its end: None."""
    from hycoc.bench.loadtest.trace import tree_at

    r0 = RoundTrace(
        tokens=(5, 10, 11, 12, 20, 13),
        parents=(-1, 0, 1, 2, 0, 2),
        device_ms=1.0,
        scores=(0.0, -0.4, -0.8, -1.2, -0.9, -1.5),
        path_rows=(1, 2),
        committed=(10, 11, 13),
    )
    r1 = RoundTrace(
        tokens=(13, 14, 16, 17, 18, 19),
        parents=(-1, 0, 1, 2, 3, 4),
        device_ms=2.0,
        scores=(0.0, -0.1, -0.2, -0.3, -0.4, -0.5),
        path_rows=(1,),
        committed=(14, 15),
    )
    req = RequestTrace(
        config="hyco",
        question_id=1,
        prompt=(1, 5),
        temperature=0.0,
        top_k=1,
        top_p=1.0,
        seed=0,
        acceptance="exact",
        epsilon=0.02,
        draft_place="device",
        max_new_tokens=8,
        rounds=(r0, r1),
    )
    rt, t, p, s = tree_at(req, [])
    assert rt is r0 and t.tolist() == list(r0.tokens) and p.tolist() == list(r0.parents)
    rt, t, p, s = tree_at(req, [10])
    assert rt is r0 and t.tolist() == [10, 11, 12, 13, 13, 13] and p.tolist() == [-1, 0, 1, 1, 1, 1]
    assert s.tolist() == pytest.approx([0.0, -0.4, -0.8, -1.1, -1.1, -1.1])
    rt, t, p, s = tree_at(req, [10, 11])
    assert t.tolist() == [11, 12, 13, 13, 13, 13] and p.tolist() == [-1, 0, 0, 0, 0, 0]
    rt, t, p, s = tree_at(req, [10, 11, 13])
    assert rt is r1 and t.tolist() == list(r1.tokens)
    rt, t, p, s = tree_at(req, [10, 11, 13, 14])
    assert t.tolist() == [14, 16, 17, 18, 19, 19] and p.tolist() == [-1, 0, 1, 2, 3, 3]
    assert tree_at(req, [10, 12]) is None and tree_at(req, [10, 11, 13, 14, 15]) is None
    # every tree it returns is a valid wire tree (parents before children, one root) with non-rising scores
    for produced in ([], [10], [10, 11], [10, 11, 13], [10, 11, 13, 14]):
        _, t, p, s = tree_at(req, produced)
        frame = wire.encode(DraftTree(0, t, p, s))
        assert wire.decode(frame).tokens.tolist() == t.tolist()


def test_the_load_table_fits_80_columns_with_every_mode_in_full():
    """The summary and the budget projection split to the console's width: no line over 80 columns, mode names
    never cut (they were "batch…" / "budge…" at 120 columns)."""
    import io

    from rich.console import Console

    from hycoc.bench.loadtest.report import render_budget_projection, render_table

    st = RunStats()
    st.first_round_s = {0: 0.1}
    st.rounds = [RoundSample(1.0 + i / 10, 20.0 + i, 5.0, 3, 33, 40) for i in range(10)]
    rows = []
    for mode in ("serial", "batched", "budgeted"):
        r = summarize_run(mode, 1, 2.0, st)
        r["projection"] = project(r)
        rows.append(r)
    proj = [
        {
            "sessions": 16,
            "trees_per_forward": 16,
            "rows_fixed": 528.0,
            "rows_budgeted": 206.0,
            "expected_fixed": 61.0,
            "expected_budgeted": 56.4,
            "trimmed_share": 1.0,
            "gain": 2.37,
        }
    ]
    for width in (80, 120):
        buf = io.StringIO()
        console = Console(file=buf, width=width)
        render_table(rows, console, "hycoc loadtest: hyco, 2 s per run")
        render_budget_projection(proj, console, "budgeted rows on an assumed GPU (a projection)")
        text = buf.getvalue()
        assert max(len(line) for line in text.splitlines()) <= width, text
        assert "…" not in text and all(m in text for m in ("serial", "batched", "budgeted")), text
        assert text.count("budgeted") >= 2 and "2.37x" in text


def test_the_run_summary_is_two_lines_under_80_columns():
    from hycoc.bench.loadtest.run import run_summary_lines

    st = RunStats()
    st.first_round_s = {i: 0.4 for i in range(64)}
    st.rounds = [RoundSample(1.0 + i / 100, 1234.0, 5.0, 3, 33, 40) for i in range(99)]
    st.device_waits_ms = [(10.0, 11.5)] * 5
    st.client_cpu_s, st.wall_s = 0.18, 1.0
    row = summarize_run("budgeted", 64, 2.0, st)
    text = run_summary_lines("budgeted", 64, row, (1.84, 1.8, 1.7, 2.41, 2.0, 1.9))
    lines = text.splitlines()
    assert len(lines) == 2 and max(len(line) for line in lines) <= 80, lines
    assert lines[0].startswith("  budgeted 64 sessions: ") and "p90 1234 ms" in lines[0]
    assert lines[1] == "    ramp 0.4 s (64/64 served), client CPU 18%, waits 10/12 ms, load 1.8->2.4"


def test_loadtest_names_a_server_that_is_down_before_recording(monkeypatch):
    """--server pointing at a port nobody listens on: refused at once with the URL and the fix, nothing recorded."""
    from conftest import free_port
    from typer.testing import CliRunner

    from hycoc.bench.loadtest import trace as loadtrace
    from hycoc.cli import app

    def never(*args, **kw):
        raise AssertionError("recorded before checking the server")

    monkeypatch.setattr(loadtrace, "record_trace", never)
    url = f"ws://127.0.0.1:{free_port()}"
    result = CliRunner().invoke(
        app,
        [
            "loadtest",
            str(Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"),
            "--server",
            url,
            "--batching",
            "serial",
        ],
    )
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(
        f"hycoc loadtest: --server {url}: no hycoc verify-server answered {url.replace('ws', 'http', 1)}/healthz"
    )


def test_speed_sampler_reads_its_samples_by_window(tmp_path):
    """`SpeedSampler.mean_between` averages the CPU ms of the probe steps whose time falls in the window (ends
    included), and says None with fewer than ``least``; a half-written last line is skipped. No process is
    started here: the file is what the sampler process writes ("epoch_s cpu_ms" per line)."""
    from hycoc.bench.capacity.speed_probe import SpeedSampler

    out = tmp_path / "speed.txt"
    out.write_text("".join(f"{100 + t} {10 + t % 3}\n" for t in range(30)) + "130", encoding="utf-8")
    req = RequestTrace("hyco", 1, (1,), 0.0, 0, 1.0, 0, "exact", 1.0, "device", 8, ())
    s = SpeedSampler("recipe.toml", "trace.json", req, out)
    assert len(s.samples()) == 30  # the last line, its CPU ms not yet written, is left out
    # t = 100..109: ms 10, 11, 12, 10, 11, 12, 10, 11, 12, 10 -> mean 10.9
    assert s.mean_between(100, 109) == pytest.approx(10.9)
    assert s.mean_between(100, 105) is None and s.mean_between(100, 105, least=6) == pytest.approx(11.0)


def test_split_mode_reads_a_baseline_entry():
    from hycoc.bench.loadtest.run import split_mode

    assert split_mode("batched") == ("batched", None)
    assert split_mode("batched:cloud-mtp") == ("batched", "cloud-mtp")
    assert split_mode(None) == (None, None)
