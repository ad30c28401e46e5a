"""`hycoc capacity`'s simulator (hycoc/bench/capacity/simulation.py) against results derived by hand or in closed form,
the row budget it shares with the server, and its bad-input errors. Deterministic and fast: no model, no server."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, replace

import numpy as np
import pytest
from hycoc.verifier import row_budget
from hycoc.verifier.row_budget import BudgetState, RowCost

from hycoc.bench.capacity import simulation as cap
from hycoc.bench.capacity.cost import StepCost, StepCostError, model_step_cost
from hycoc.bench.capacity.requests import CapacityError, SimRound, SyntheticRequest, TraceRequest, TreeRequest, Workload
from hycoc.bench.capacity.run import search_devices, trace_workload
from hycoc.bench.capacity.simulation import SimConfig, cpu_slowdown, simulate, summarize
from hycoc.bench.capacity.trees import TreeModel, TreePool, phone_ms, tree_pool
from hycoc.bench.loadtest.trace import RequestTrace, RoundTrace, Trace


@dataclass
class FixedCost(StepCost):
    """A step of ``a + b x sessions + c x rows`` ms, prefill ``prefill`` ms per job."""

    a: float = 10.0
    b: float = 0.0
    c: float = 0.0
    prefill: float = 0.0
    line: RowCost | None = None

    def forward_ms(self, rows, sessions, context):
        return self.a + self.b * sessions + self.c * rows

    def host_ms(self, places, rows):
        return 0.0

    def prefill_ms(self, positions, context):
        return self.prefill if positions else 0.0

    def row_cost(self):
        return self.line or super().row_cost()


def synthetic(mat: int, device_ms: float, *, exponential: bool = False, output: int = 10**9) -> Workload:
    return Workload(
        lambda i, k: SyntheticRequest(
            8, output, mat, 33, device_ms, "device", np.random.default_rng([7, i, k]), exponential
        )
    )


def test_one_device_fixed_times_is_exact():
    """One device drafting D ms, a verifier step of S ms, MAT m: round k ends at k (D + S); every latency is S;
    no round starts after the run (D + (k - 1)(D + S) < T); tok/s over the window after the first round is
    m x (rounds - 1) / (T - (D + S))."""
    d, s, m, t = 30.0, 20.0, 3, 2.01  # no round ends at the run's end (no float tie)
    cfg = SimConfig(mode="serial", devices=1, duration_s=t)
    res = simulate(synthetic(m, d), cfg, FixedCost(a=s))
    stats = res.stats
    k = 0
    while (d + k * (d + s)) / 1e3 < t:
        k += 1
    assert len(stats.rounds) == k
    assert all(math.isclose(r.latency_ms, s, abs_tol=1e-9) for r in stats.rounds)
    assert [round(r.t_done * 1e3, 6) for r in stats.rounds] == [round((j + 1) * (d + s), 6) for j in range(k)]
    row = summarize("serial", cfg, res)
    done = [j for j in range(2, k + 1) if j * (d + s) / 1e3 <= t]
    assert row["tok_per_s"] == pytest.approx(m * len(done) / (t - (d + s) / 1e3))
    assert row["busy_share"] == pytest.approx(k * s / 1e3 / t)


def test_mdl_queue_matches_closed_form():
    """Many devices with exponential drafting (nearly Poisson arrivals) against a serial verifier of constant
    service S: the mean queue wait is M/D/1's Pollaczek-Khinchine value rho S / (2 (1 - rho)) (Kleinrock,
    Queueing Systems I, eq. 5.73), within 8%. 400 devices: the finite-source effect is under 1%."""
    s, rho, n = 10.0, 0.6, 400
    z = n * s / rho  # per-device mean drafting ms: arrival rate n / z = rho / s
    cfg = SimConfig(mode="serial", devices=n, duration_s=400.0)
    res = simulate(synthetic(1, z, exponential=True), cfg, FixedCost(a=s))
    waits = np.asarray(res.server_ms) - s
    expected = rho * s / (2 * (1 - rho))
    assert len(waits) > 15_000
    assert waits.mean() == pytest.approx(expected, rel=0.08)


def test_batched_step_takes_every_waiting_round():
    """Four devices with the same fixed drafting reach a batched verifier together: one forward of 4 trees (every
    open session has a round queued, so no batch wait), each round's latency the one step's S."""
    cfg = SimConfig(mode="batched", devices=4, duration_s=1.0)
    res = simulate(synthetic(2, 40.0), cfg, FixedCost(a=15.0))
    assert res.round_sessions / res.forwards == pytest.approx(4.0)
    assert {round(r.latency_ms, 9) for r in res.stats.rounds} == {15.0}


def _tree_trace() -> Trace:
    """Two recorded requests whose 9-row trees carry scores: a chain of 4 and side rows of low score."""
    parents = (-1, 0, 1, 2, 3, 0, 1, 5, 6)
    scores = (0.0, -0.2, -0.5, -0.9, -1.4, -2.5, -3.0, -3.5, -4.0)
    rounds = tuple(
        RoundTrace(
            tuple(range(10 + 10 * k, 19 + 10 * k)),
            parents,
            25.0,
            25.0,
            scores,
            (1, 2, 3, 4),
            tuple(range(100 + 5 * k, 105 + 5 * k)),
        )
        for k in range(6)
    )
    req = RequestTrace("hyco", 1, (5, 6, 7), 0.0, 1, 1.0, 0, "exact", 1.0, "device", 30, rounds, 30, "length")
    return Trace("k", (1,), (req,), {"bundle_manifest_sha256": "abc", "recipe_sha256": "r"})


def test_budget_is_the_servers_function_and_first_step_matches_it():
    """The simulator forms steps with the server's own objects, not copies: verifier/row_budget.py's `RowBudget`
    (its ``choose`` calls `allocate`) and verifier/batch_policy.py's `batch_ready` / `take_rounds`, which
    verifier/scheduler.py's `BatchScheduler` runs too; and its first budgeted forward keeps exactly the rows
    `allocate` keeps for those trees with the server's priors."""
    from hycoc.verifier import batch_policy, scheduler

    assert cap.RowBudget is row_budget.RowBudget
    assert cap.take_rounds is batch_policy.take_rounds is scheduler.take_rounds
    assert cap.batch_ready is batch_policy.batch_ready is scheduler.batch_ready
    trace = _tree_trace()
    line = RowCost(((2, 10.0), (9, 20.0), (18, 40.0)), source="test")
    cost = FixedCost(a=10.0, c=1.0, line=line)
    cfg = SimConfig(mode="budgeted", devices=2, duration_s=0.5, tree_rows=9)
    res = simulate(trace_workload([list(trace.requests)] * 2), cfg, cost)
    rt = trace.requests[0].rounds[0]
    tree = (np.asarray(rt.scores), np.asarray(rt.tokens), np.asarray(rt.parents))
    want = row_budget.allocate(
        [tree, tree],
        line,
        free_rows=max(9, line.flat_rows()),
        min_rows=2,
        extra_ms=BudgetState().overhead_ms * 2,
        value_scale=1.0,
    )
    first = res.stats.rounds[:2]
    assert want.trimmed > 0
    assert sum(r.rows for r in first) == 18  # rows as sent
    # committed per round: the recorded path cut at the first row the budget left out, plus the bonus
    kept = [set(k.tolist()) if k is not None else set(range(9)) for k in want.kept]
    for r, keep in zip(first, kept):
        path = [row for row in rt.path_rows]
        cut = next((i for i, row in enumerate(path) if row not in keep), len(path))
        assert r.committed == cut + 1


def test_slowdown_and_replicas():
    """cpu_slowdown is max(1, load / cores); two replicas split sessions (the fewest open first)."""
    assert cpu_slowdown(0.5, 2) == 1.0 and cpu_slowdown(5.0, 2) == 2.5
    cfg = SimConfig(mode="serial", devices=4, duration_s=1.0, replicas=2)
    res = simulate(synthetic(1, 50.0), cfg, FixedCost(a=20.0))
    assert res.busy_s[0] == pytest.approx(res.busy_s[1], rel=0.05)


def test_unreachable_target_is_one_line():
    cfg = SimConfig(mode="serial", devices=1, duration_s=1.0)
    with pytest.raises(CapacityError, match=r"--p90-ms 5: .* misses it with one device .* raise --p90-ms"):
        search_devices(lambda n: synthetic(1, 20.0), cfg, FixedCost(a=10.0), 5.0, label="hyco (serial)")
    n, row, tried = search_devices(lambda n: synthetic(1, 90.0), cfg, FixedCost(a=10.0), 15.0, max_devices=64)
    assert row["server_p90_ms"] <= 15.0 and n >= 1
    assert any(r["server_p90_ms"] > 15.0 for r in tried)


def test_cost_model_of_another_shape_is_refused():
    from hycoc.bench.cost_model.model import CostModel, CostPoint

    model = CostModel(
        device="cpu",
        dtype="float32",
        model="other",
        shape={"hidden_size": 512, "num_hidden_layers": 4},
        points=[CostPoint(rows=r, context=c, ms=1.0 + r / 10) for r in (1, 33) for c in (64, 128)],
    )
    with pytest.raises(
        StepCostError,
        match=r"--cost-model m.json: measured on another model .*hidden_size = 512.*"
        r"the recipe's verifier has 256",
    ):
        model_step_cost(model, {"hidden_size": 256, "num_hidden_layers": 4}, 4, path="m.json")
    ok = model_step_cost(model, {"hidden_size": 512}, 4, path="m.json")
    assert ok.forward_ms(33, 1, 64) == pytest.approx(model.predict(33, 64))
    assert ok.forward_ms(66, 2, 64) == pytest.approx(2 * model.predict(33, 64))  # a CPU line: linear beyond


def test_trace_of_another_bundle_is_refused(tmp_path):
    from hycoc.bench.capacity.app import check_trace

    (tmp_path / "manifest.json").write_text("{}")

    class Recipe:
        def content_hash(self):
            return "r"

    with pytest.raises(CapacityError, match=r"--trace t.json: recorded with another bundle .*leave --trace out"):
        check_trace(_tree_trace(), Recipe(), tmp_path, "t.json")


def test_results_are_written_whole(tmp_path):
    from hycoc.bench.capacity.app import write_document
    from hycoc.bench.capacity.run import write_plot

    cfg = SimConfig(mode="batched", devices=2, duration_s=1.0)
    row = dict(summarize("batched", cfg, simulate(synthetic(2, 30.0), cfg, FixedCost())), config="hyco")
    write_document(tmp_path, {"sweep": [row], "x": math.nan, "ok": np.bool_(True), "v": np.float64(2.5)})
    write_plot([row], tmp_path / "p90_vs_devices.png", 60.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["capacity.json", "p90_vs_devices.png"]
    doc = json.loads((tmp_path / "capacity.json").read_text())
    assert doc["x"] is None and doc["sweep"][0]["sessions"] == 2 and doc["ok"] is True and doc["v"] == 2.5
    assert (tmp_path / "p90_vs_devices.png").read_bytes()[:4] == b"\x89PNG"


def test_sim_round_replays_the_loadtest_tree():
    """A replayed round is the tree `hycoc loadtest` sends (`tree_at`), its path the recorded one."""
    from hycoc.bench.loadtest.trace import tree_at

    req = _tree_trace().requests[0]
    tr = TraceRequest(req)
    rnd = tr.next_round()
    assert isinstance(rnd, SimRound)
    _, tokens, parents, _ = tree_at(req, [], 0)
    assert np.array_equal(rnd.tree[1], tokens) and rnd.path == (1, 2, 3, 4)
    tr.commit(rnd.committed[:2])  # a trimmed round: two tokens; next the sub-tree under path row 2 (depth 2)
    sub = tr.next_round()
    # rows 2, 3, 4 of the recorded tree (the chain below row 2) re-rooted: the rest of the path is its rows 1, 2
    assert sub.path == (1, 2) and sub.committed == req.rounds[0].committed[2:]
    assert np.array_equal(sub.tree[1][:3], np.asarray(req.rounds[0].tokens)[[2, 3, 4]])


def test_measured_contention_sets_the_tail():
    """Steps stretched x1 or x3 by measured intervals of equal CPU (each longer than a step): each round's latency
    is S or 3 S, half of them each."""
    cfg = SimConfig(mode="serial", devices=1, duration_s=20.0, slowdown_samples=((1.0, 1e9), (3.0, 1e9)))
    res = simulate(synthetic(1, 30.0), cfg, FixedCost(a=10.0))
    lat = np.round([r.latency_ms for r in res.stats.rounds], 6)
    assert set(lat.tolist()) == {10.0, 30.0}
    assert np.mean(lat == 30.0) == pytest.approx(0.5, abs=0.08)


def test_cli_bad_options_are_one_line():
    from typer.testing import CliRunner

    from hycoc.cli import app

    runner = CliRunner()
    got = runner.invoke(app, ["capacity", "recipes/toy.toml", "--batching", "fast"])
    assert got.exit_code == 2 and "--batching 'fast': allowed: serial, batched, budgeted" in got.output
    got = runner.invoke(app, ["capacity", "recipes/gemma4.toml", "--validate"])
    assert got.exit_code == 2 and "--validate runs hycoc loadtest on this machine" in got.output
    got = runner.invoke(app, ["capacity", "recipes/toy.toml", "--configs", "slm-alone"])
    assert got.exit_code == 2 and "unknown or without a verifier: slm-alone" in got.output


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux sched-stats")
def test_sched_sampler_sees_a_busy_child():
    """A child process that spins from before the window's first sample to after its last: the sampler finds its
    thread on-CPU, slowdown >= 1, and per-interval slowdowns. Each wait is for a sample the sampler has taken, not a
    sleep, so a loaded machine only makes it slower."""
    import subprocess
    import sys
    import time

    from hycoc.bench.capacity.run import SchedSampler

    with SchedSampler(interval_s=0.05) as s:
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 60: pass"]
        )
        try:
            t0 = _sample_time(s, lambda snap: _cpu_ns(snap, child.pid) > 0)
            ran = _cpu_ns(s.samples[-1][1], child.pid)
            _sample_time(s, lambda snap: _cpu_ns(snap, child.pid) > ran + 20e6)  # 20 ms more CPU
            got = s.contention(t0, time.time())
        finally:
            child.kill()
            child.wait()
    assert got is not None and got["slowdown"] >= 1.0 and got["worker_cpu_ms"] >= 20.0
    assert got["intervals"] and all(a >= 1.0 for a, _ in got["intervals"])


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="needs Linux sched-stats")
def test_sched_sampler_counts_a_child_that_lives_inside_the_window():
    """The CI failure of stop 34: the window opens before the child exists and closes after it is reaped, so the
    window's first and last samples both lack it. Each thread is counted from its own first to last sample, so the
    child is still found (the old first-vs-last delta returned None)."""
    import subprocess
    import sys
    import time

    from hycoc.bench.capacity.run import SchedSampler

    with SchedSampler(interval_s=0.05) as s:
        t0 = time.time()
        _sample_time(s, lambda snap: True)  # a sample before the child: it lacks it
        child = subprocess.Popen(
            [sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 60: pass"]
        )
        try:
            _sample_time(s, lambda snap: _cpu_ns(snap, child.pid) > 0)
            ran = _cpu_ns(s.samples[-1][1], child.pid)
            _sample_time(s, lambda snap: _cpu_ns(snap, child.pid) > ran + 20e6)
        finally:
            child.kill()
            child.wait()
        gone = time.time()
        _sample_time(s, lambda snap: True, after=gone)  # a sample after it was reaped: it lacks it too
        got = s.contention(t0, time.time())
    window = [snap for t, snap in s.samples if t >= t0]
    assert _cpu_ns(window[0], child.pid) == 0 and _cpu_ns(window[-1], child.pid) == 0
    assert got is not None and got["worker_cpu_ms"] >= 20.0


def _cpu_ns(snap: dict, pid: int) -> int:
    """The CPU ns of ``pid``'s threads in one sampler snapshot (0 where it is absent)."""
    return sum(v[0] for k, v in snap.items() if k[0] == pid)


def _sample_time(sampler, pred, after: float | None = None, timeout_s: float = 30.0) -> float:
    """Wait for the sampler's first new sample (taken after ``after``, default now) whose snapshot meets ``pred``;
    return its time. Fails the test after ``timeout_s``."""
    import time

    since = time.time() if after is None else after
    deadline = since + timeout_s
    while time.time() < deadline:
        for t, snap in list(sampler.samples):
            if t > since and pred(snap):
                return t
        time.sleep(0.01)
    raise AssertionError(f"the sampler took no matching sample in {timeout_s} s")


def test_host_work_from_the_profile_moves_the_one_device_prediction(tmp_path):
    """The per-round host work outside the step is read from the saved profile (`MeasuredStepCost.host`, as
    `cached_step_cost` stores what `measure_host_overhead` measured) and turned into simulation terms by
    `host_terms`: with no run contention, one device's every round latency is the step S plus the loop's, the
    client's and the wire's ms of the FILE (L + C + W), and its rounds come every D + S + L + C + W ms instead of
    D + S (after an OPEN that passes the event loop too). Without the host work (an older profile) the latency is
    S alone."""
    from hycoc.bench.capacity.cost import MeasuredStepCost
    from hycoc.bench.capacity.run import host_terms

    s, d, m, t = 12.0, 30.0, 2, 3.0
    prof = MeasuredStepCost(step=(s, 0.0, 0.0), forward=(s, 0.0, 0.0), prefill=(0.0, 0.0))
    prof.host = {"loop_ms": 0.75, "client_ms": 1.25, "wire_ms": 3.5, "handoff_ms": 0.1, "wall_ms": 5.5}
    path = prof.save(tmp_path / "step-cost.json")
    loaded = MeasuredStepCost.load(path)
    raw = json.loads(path.read_text())["host"]
    extra = raw["loop_ms"] + raw["client_ms"] + raw["wire_ms"]
    assert loaded.overhead().round_ms == pytest.approx(extra)

    def one(cost, **host):
        cfg = SimConfig(mode="serial", devices=1, duration_s=t, **host)
        return cfg, simulate(synthetic(m, d), cfg, cost)

    _, bare = one(MeasuredStepCost(step=(s, 0.0, 0.0), forward=(s, 0.0, 0.0), prefill=(0.0, 0.0)))
    cfg, res = one(loaded, **host_terms(loaded))
    assert {round(r.latency_ms, 9) for r in bare.stats.rounds} == {s}
    assert {round(r.latency_ms, 9) for r in res.stats.rounds} == {round(s + extra, 9)}
    period, opened = d + s + extra, raw["loop_ms"]  # the OPEN passes the event loop too (prefill 0 ms)
    k = 0
    while (opened + d + k * period) / 1e3 < t:  # round k + 1 starts after the OPEN, k periods, one drafting
        k += 1
    assert len(res.stats.rounds) == k
    want = [round(opened + (j + 1) * period, 6) for j in range(k)]
    assert [round(r.t_done * 1e3, 6) for r in res.stats.rounds] == want
    # what --validate compares at one session: latency - the reply's server_ms is the host work, L + C + W
    from hycoc.bench.capacity.run import outside_ms

    assert outside_ms(summarize("serial", cfg, res)) == pytest.approx(extra)
    # an older profile (no host work) and a cost-model file give none
    assert MeasuredStepCost().overhead().round_ms == 0.0 and host_terms(MeasuredStepCost())["loop_ms"] == 0.0


def test_event_loop_work_is_serialised_and_client_work_is_not():
    """N devices that draft in 0 ms against steps of 0 ms, for T: the host work per round is all there is. In
    parallel (client_ms = H): each device completes a round every H, N T / H rounds. On the server's one event loop
    (loop_ms = H, FIFO): the loop does one round's H at a time, so after the N OPENs (H each) the rounds share it,
    (T - N H) / H in all."""
    h, n, t = 5.0, 4, 1.0
    free = simulate(synthetic(1, 0.0), SimConfig(mode="serial", devices=n, duration_s=t, client_ms=h), FixedCost(a=0))
    assert abs(len([r for r in free.stats.rounds if r.t_done <= t]) - n * t * 1e3 / h) <= n
    assert {round(r.latency_ms, 9) for r in free.stats.rounds} == {h}
    loop = simulate(synthetic(1, 0.0), SimConfig(mode="serial", devices=n, duration_s=t, loop_ms=h), FixedCost(a=0))
    assert abs(len([r for r in loop.stats.rounds if r.t_done <= t]) - (t * 1e3 - n * h) / h) <= 1


def test_validation_rows_carry_what_validate_prints():
    """`validation_rows` of a one-session cell (a simulated run standing in for the measured one) has every key
    `validate_here` prints, the one-session host-work check included, and its table renders."""
    from hycoc.bench.capacity.run import outside_ms, validation_rows, validation_table

    cfg = SimConfig(mode="serial", devices=1, duration_s=1.0, client_ms=3.0)
    row = summarize("serial", cfg, simulate(synthetic(2, 30.0), cfg, FixedCost(a=10.0)))
    row["loadavg"] = [1.0, 1.0, 1.0, 1.2, 1.0, 1.0]
    (cell,) = validation_rows([row], [dict(row, slowdown=1.0, cpu_scale=0.85)], 0.2)
    assert cell["measured_outside_ms"] == cell["predicted_outside_ms"] == pytest.approx(outside_ms(row))
    assert cell["measured_outside_ms"] == pytest.approx(3.0) and cell["ok"]
    printed = validation_table([cell], 0.2).rows[0]
    assert "1.0->1.2" in printed[-3] and printed[-2] == "x0.85" and printed[-1] == "yes"


def test_step_spread_sets_the_tail():
    """A step cost whose measured spread is {0.5, 1.5} x its point's mean (mean 1): one device's rounds take 0.5 S
    or 1.5 S, about half each (a seeded draw per step), so p90 is 1.5 S where a mean-cost step gives S; the mean
    step stays S (throughput follows it)."""
    s = 10.0
    cfg = SimConfig(mode="serial", devices=1, duration_s=20.0)
    res = simulate(synthetic(1, 30.0), cfg, FixedCost(a=s, spread=(0.5, 1.5)))
    lat = np.round([r.latency_ms for r in res.stats.rounds], 6)
    assert set(lat.tolist()) == {0.5 * s, 1.5 * s}
    assert np.mean(lat == 1.5 * s) == pytest.approx(0.5, abs=0.08)
    assert summarize("serial", cfg, res)["latency_ms"]["p90"] == pytest.approx(1.5 * s)
    flat = simulate(synthetic(1, 30.0), cfg, FixedCost(a=s))  # no spread measured: every step its mean
    assert {round(r.latency_ms, 6) for r in flat.stats.rounds} == {s}


def test_cpu_scale_multiplies_every_step_and_prefill():
    """``cpu_scale`` (the run's CPU speed against the profile's, `hycoc.bench.capacity.speed_probe`) multiplies each
    step's CPU ms and each prefill's: one device with 10 ms steps, 4 ms prefills and 30 ms drafting answers every round
    in 13 ms at x1.3 (10 ms at x1), and the workers' CPU ms are 1.3 x (10 ms per step + 4 ms per prefill), a whole
    number of prefills (requests of 8 tokens, 2 a round: several)."""
    for scale in (1.0, 1.3):
        cfg = SimConfig(mode="serial", devices=1, duration_s=5.0, cpu_scale=scale)
        res = simulate(synthetic(2, 30.0, output=8), cfg, FixedCost(a=10.0, prefill=4.0))
        assert {round(r.latency_ms, 9) for r in res.stats.rounds} == {round(10.0 * scale, 9)}
        prefills = (res.cpu_ms / scale - 10.0 * res.forwards) / 4.0  # CPU ms = scale x (steps + prefills)
        assert prefills >= 2 and prefills == pytest.approx(round(prefills), abs=1e-6)
    with pytest.raises(CapacityError, match=r"cpu_scale = 0: must be > 0 \(1: the profile's CPU speed\)"):
        SimConfig(mode="serial", devices=1, duration_s=1.0, cpu_scale=0)


def test_a_step_after_an_idle_worker_costs_the_idle_factor():
    """A cost with ``idle_factor`` 1.2: one device drafting 30 ms leaves the worker idle before every step (>=
    IDLE_GAP_MS), so every round takes 12 ms for a 10 ms step; drafting 0 ms, each round arrives as the last step
    (the OPEN's prefill first) ends, so none is cold: every round 10 ms."""
    assert cap.IDLE_GAP_MS < 30.0
    cfg = SimConfig(mode="serial", devices=1, duration_s=2.0)
    idle = simulate(synthetic(2, 30.0), cfg, FixedCost(a=10.0, idle_factor=1.2))
    assert {round(r.latency_ms, 9) for r in idle.stats.rounds} == {12.0}
    busy = simulate(synthetic(2, 0.0), cfg, FixedCost(a=10.0, idle_factor=1.2))
    lat = [round(r.latency_ms, 9) for r in busy.stats.rounds]
    assert set(lat) == {10.0} and len(lat) > 100


def test_budget_work_is_in_the_budgeted_step():
    """A measured ``budget_ms`` per session lengthens a budgeted step of n > 1 rounds by n x budget_ms (the
    budget's choose and restrict_round run on the worker inside the step); a one-round step has no budget work.
    Two devices send at once: their first step is the budget's, 2 x 3 ms longer than without it."""
    trace = _tree_trace()
    line = RowCost(((2, 10.0), (9, 20.0), (18, 40.0)), source="test")
    cfg = SimConfig(mode="budgeted", devices=2, duration_s=0.5, tree_rows=9)
    work = trace_workload([list(trace.requests)] * 2)
    base = simulate(work, cfg, FixedCost(a=10.0, c=1.0, line=line))
    work = trace_workload([list(trace.requests)] * 2)
    more = simulate(work, cfg, FixedCost(a=10.0, c=1.0, line=line, budget_ms=3.0))
    assert more.server_ms[0] - base.server_ms[0] == pytest.approx(2 * 3.0)
    assert more.cpu_ms > base.cpu_ms
    one = SimConfig(mode="budgeted", devices=1, duration_s=0.5, tree_rows=9)
    a = simulate(trace_workload([list(trace.requests)]), one, FixedCost(a=10.0, c=1.0, line=line))
    b = simulate(trace_workload([list(trace.requests)]), one, FixedCost(a=10.0, c=1.0, line=line, budget_ms=3.0))
    assert a.server_ms == b.server_ms


def test_event_loop_work_holds_up_a_running_step_through_the_gil():
    """The server's event loop and its worker thread share one GIL: loop work that runs during a step lengthens
    that step by gil_share x its ms. Device 0 drafts 30 ms, device 1 35 ms; loop work L = 2 ms per round (1 ms in,
    1 ms out); step S = 10 ms. Device 0's frame is in at 31 ms and its step runs from 31; device 1's frame comes in
    on the loop at 35-36 ms, inside that step, so the step ends at 41 + 1 = 42 ms: server_ms 11 with the GIL
    shared, 10 without (gil_share 0: the loop runs beside the worker)."""

    def work(i, k):
        return SyntheticRequest(8, 10**9, 1, 33, 30.0 + 5.0 * i, "device", np.random.default_rng([7, i, k]))

    for share, want in ((1.0, 11.0), (0.0, 10.0), (0.5, 10.5)):
        cfg = SimConfig(mode="serial", devices=2, duration_s=0.2, loop_ms=2.0, gil_share=share)
        res = simulate(Workload(work), cfg, FixedCost(a=10.0))
        assert res.server_ms[0] == pytest.approx(want)


def _pool() -> TreePool:
    """A small fitted pool of HyCo-shaped trees (ε, MAT 4.71)."""
    return tree_pool(TreeModel(), 4.71, trees=40, seed=0)


def _tree_devices(pool, ceiling: int = 33, head_ms: float = 20.0, full_ms: float = 50.0) -> Workload:
    return Workload(
        lambda i, k: TreeRequest(
            8, 10**9, pool, ceiling, lambda r: phone_ms(full_ms, head_ms, r, 4), "device", np.random.default_rng([i, k])
        )
    )


def test_allowance_is_the_servers_rule_and_devices_draft_to_it(monkeypatch):
    """Mode allowance builds the server's own `AllowanceRule` (sharing the budget's `BudgetState`), teaches it every
    step's sessions and every scored tree verified, and each reply's allowance (its place's
    `DraftPlace.allowance`, the rule's `grant`) is what the device drafts next: with the rule pinned at 5 rows, every
    round after a device's first holds 5 rows and is drafted without the SLM pass (the head's 20 ms); one device
    alone gets the ceiling from the real rule."""
    from hycoc.verifier import allowance as allowance_mod

    seen = {"trees": 0, "steps": [], "committed": []}
    real = allowance_mod.AllowanceRule

    class Pinned(real):
        def observe_tree(self, scores, tokens, parents, committed=None):
            seen["trees"] += 1
            seen["committed"].append(committed)
            super().observe_tree(scores, tokens, parents, committed)

        def observe_step(self, sessions, step_ms=None, forward_ms=None):
            seen["steps"].append(sessions)
            super().observe_step(sessions, step_ms, forward_ms)

        def grant(self, sessions=None):
            return 5

    monkeypatch.setattr(allowance_mod, "AllowanceRule", Pinned)
    line = RowCost(((2, 10.0), (33, 20.0), (66, 40.0)), source="test")
    cfg = SimConfig(mode="allowance", devices=3, duration_s=1.0, tree_rows=33, chain_length=4)
    res = simulate(_tree_devices(_pool()), cfg, FixedCost(a=10.0, line=line))
    rounds = res.stats.rounds
    assert [r.rows for r in rounds[:3]] == [33, 33, 33] and {r.rows for r in rounds[3:]} == {5}
    assert {round(d) for d, _ in res.stats.device_waits_ms[3:]} == {20}
    assert seen["trees"] == len(rounds) and sum(seen["steps"]) == len(rounds)
    assert sorted(seen["committed"]) == sorted(r.committed for r in rounds)  # each tree with its round's commit
    assert set(res.allowances) == {5}
    monkeypatch.setattr(allowance_mod, "AllowanceRule", real)
    one = simulate(_tree_devices(_pool()), replace(cfg, devices=1), FixedCost(a=10.0, line=line))
    assert {r.rows for r in one.stats.rounds} == {33} and set(one.allowances) == {33}


def test_allowance_rule_is_built_and_fed_as_the_server_builds_and_feeds_it(monkeypatch):
    """The simulated server builds its rule with the server's own constructor (`AllowanceRule.for_server`, which
    `VerifierServer.allowance_rule` calls: floor and chain_rows K + 1) and feeds it what `SessionLoop` does: at each
    OPEN the drafting ms the device reports without / with the SLM pass (as the OPEN's f32 fields), at each ROUND
    after a session's first the gap since its last reply left the server (downlink, the client's work, the wake-up,
    the drafting, uplink, the event loop's frame in: hand-computed here from the run's own rounds); a cloud-mtp
    session feeds it nothing."""
    from types import SimpleNamespace

    from hycoc.runtime.transport import LINK_PRESETS
    from hycoc.verifier.allowance import AllowanceRule
    from hycoc.verifier.server import ServerSettings, VerifierServer

    from hycoc.bench.capacity.run import GEMMA4_FRAMES

    built, drafting, away = [], [], []
    make = AllowanceRule.for_server.__func__

    def for_server(cls, *a, **k):
        built.append(make(cls, *a, **k))
        return built[-1]

    real_drafting, real_away = AllowanceRule.observe_drafting, AllowanceRule.observe_away

    def observe_drafting(rule, floor_ms, tree_ms):
        drafting.append((floor_ms, tree_ms))
        real_drafting(rule, floor_ms, tree_ms)

    def observe_away(rule, away_ms, rows):
        away.append((away_ms, rows))
        real_away(rule, away_ms, rows)

    monkeypatch.setattr(AllowanceRule, "for_server", classmethod(for_server))
    monkeypatch.setattr(AllowanceRule, "observe_drafting", observe_drafting)
    monkeypatch.setattr(AllowanceRule, "observe_away", observe_away)
    line = RowCost(((2, 10.0), (33, 20.0), (66, 40.0)), source="test")
    link, frames = LINK_PRESETS["lte"], replace(GEMMA4_FRAMES, open_down=64)  # no 6.3 MB first hand-off: rounds at once
    cfg = SimConfig(
        mode="allowance", devices=1, duration_s=2.0, tree_rows=33, chain_length=4, link=link, frames=frames,
        loop_ms=2.0, client_ms=0.4, wake_ms=0.2, allowance_target_ms=60.0,
    )  # fmt: skip
    head_ms, full_ms = 19.3, 57.7  # not exact in f32: the rule hears what the OPEN's f32 fields decode to

    def devices(i, k):
        ms = lambda r: phone_ms(full_ms, head_ms, r, 4)  # noqa: E731
        return TreeRequest(8, 10**9, _pool(), 33, ms, "device", np.random.default_rng([i, k]), floor=5)

    res = simulate(Workload(devices), cfg, FixedCost(a=10.0, line=line))
    settings = ServerSettings(tree_rows=33, allowance="auto", allowance_floor=0, allowance_target_ms=60.0)
    server = SimpleNamespace(settings=settings, row_cost=line, engine=SimpleNamespace(chain_length=4))
    served = VerifierServer.allowance_rule(server)
    assert len(built) == 2 and built[-1] is served
    sim = built[0]
    for rule in (sim, served):
        assert (rule.floor, rule.chain_rows, rule.ceiling, rule.free_rows, rule.target_ms) == (5, 5, 33, 33, 60.0)
    assert drafting == [(float(np.float32(head_ms)), float(np.float32(full_ms)))]
    rounds, waits = res.stats.rounds, res.stats.device_waits_ms
    assert len(away) == len(rounds) - 1 > 5  # every round but the session's first
    for j, (ms, rows) in enumerate(away):
        down = link.one_way_s(frames.down(rounds[j].rows, rounds[j].committed))
        up = link.one_way_s(frames.up(rounds[j + 1].rows))
        gap = 1e3 * (down + up) + waits[j + 1][1] + cfg.client_ms + cfg.loop_ms / 2
        assert rows == rounds[j + 1].rows and ms == pytest.approx(gap, abs=1e-6)
    assert res.rule["drafting_ms"] == list(drafting[0]) and res.rule["link_ms"] > link.rtt_ms
    drafting.clear(), away.clear()
    mixed = Workload(
        lambda i, k: (
            devices(i, k)
            if i == 0
            else SyntheticRequest(8, 10**9, 3.05, 1, 0.0, "cloud-mtp", np.random.default_rng([i, k]))
        )
    )
    res = simulate(mixed, replace(cfg, devices=2), FixedCost(a=10.0, line=line))
    device_rounds = sum(r.rows > 1 for r in res.stats.rounds)
    assert len(drafting) == 1 and len(away) == device_rounds - 1


def test_allowance_shrinks_trees_under_load():
    """With a steep line (every row costs) and many devices, the real rule's allowance falls below the ceiling,
    the devices send fewer rows than 33, and a ROUND's bytes follow its rows (23 + 8 R)."""
    from hycoc.bench.capacity.run import GEMMA4_FRAMES

    line = RowCost(((1, 5.0), (33, 20.0), (330, 200.0)), source="test")
    cfg = SimConfig(mode="allowance", devices=24, duration_s=3.0, tree_rows=33, chain_length=4, frames=GEMMA4_FRAMES)
    res = simulate(_tree_devices(_pool()), cfg, FixedCost(a=5.0, c=0.5, line=line))
    row = summarize("allowance", cfg, res)
    assert row["allowance"]["p50"] < 33 and row["rows_sent_per_round"] < 33
    assert row["bytes_up_per_round"] == pytest.approx(23 + 8 * row["rows_sent_per_round"])


def test_cli_refuses_what_it_cannot_simulate():
    """--batching allowance on a recipe whose recorded trees are replayed (the toy) and an unknown --gpu are one
    line each, exit 2."""
    from typer.testing import CliRunner

    from hycoc.cli import app

    runner = CliRunner()
    got = runner.invoke(app, ["capacity", "recipes/toy.toml", "--batching", "batched,allowance"])
    assert got.exit_code == 2 and "--batching allowance: recipes/toy.toml replays recorded trees" in got.output
    got = runner.invoke(app, ["capacity", "recipes/gemma4.toml", "--gpu", "a100"])
    assert got.exit_code == 2 and "--gpu 'a100': allowed: rtx-pro-6000, h100, h200" in got.output
    got = runner.invoke(app, ["capacity", "recipes/toy.toml", "--validate", "--validate-modes", "allowance"])
    assert got.exit_code == 2 and "allowed: serial, batched, budgeted" in got.output


def test_projection_runs_every_mode_and_lists_its_inputs(tmp_path):
    """A short projection of recipes/gemma4.toml: hyco with the allowance and cloud-mtp over LTE; the table's rows
    carry the allowance, the drafting and the ratios against cloud-mtp; the assumptions name the GPU's source, the
    fitted trees and the device-time estimate per allowance; the fixed-row check runs at the floor over LTE and 5G;
    a cost-model file of another model is refused in one line."""
    from pathlib import Path

    from hycoc.bench.capacity.cost import StepCostError
    from hycoc.bench.capacity.projection import projection_cost, run_projection
    from hycoc.bench.cost_model.model import CostModel, CostPoint
    from hycoc.recipe import load_recipe

    cfg = load_recipe(Path("recipes/gemma4.toml"))
    plan = (("hyco", "allowance"), ("cloud-mtp", "batched"))
    doc = run_projection(
        cfg,
        Path("recipes/gemma4.toml"),
        ["hyco", "cloud-mtp"],
        ["allowance"],
        60.0,
        3.0,
        1,
        None,
        1.0,
        tmp_path,
        gpu="h200",
        variants=(("LTE", "lte", 1.0, plan),),
        sweep_rows=(5,),
    )
    rows = {r["config"]: r for r in doc["capacity"]}
    assert rows["hyco"]["mode"] == "allowance" and rows["hyco"]["allowance"] is not None
    assert rows["cloud-mtp"]["vs_cloud_mtp"] == 1.0 and rows["hyco"]["tok_vs_cloud_mtp"] is not None
    text = "\n".join(doc["assumptions"])
    assert "H200 Tensor Core GPU datasheet" in text and "FITTED" in text and "allowance_round_ms" in text
    assert (tmp_path / "capacity.json").is_file()
    floor = [r for r in doc["fixed_rows_sweep"] if r["fixed_rows"] == 5]
    assert {r["variant"] for r in floor} == {"LTE", "5G"} and all(r["rows_sent_per_round"] == 5 for r in floor)
    toy = CostModel(
        device="NVIDIA H100",
        dtype="bfloat16",
        model="toy",
        shape={"hidden_size": 256},
        points=[CostPoint(kind="verify", rows=r, context=c, ms=1.0) for r in (1, 33) for c in (64, 128)],
    )
    toy.save(tmp_path / "toy.json")
    with pytest.raises(StepCostError, match="measured on another model .*hidden_size = 256.*has 2816"):
        projection_cost(cfg, tmp_path / "toy.json", "h200")
