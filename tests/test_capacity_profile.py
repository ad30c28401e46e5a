"""`hycoc capacity`'s step-cost profile read from a running verify-server (hycoc/bench/capacity_profile.py): the
per-step CPU it reads from /metrics is what the server's worker thread spent in those steps, timed here
independently around the worker's step function; the in-process grid is moved onto the server's steps; and a step-
cost file of an older format is measured again, not read."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

import numpy as np
import pytest
import torch
from hycoc.verifier import VerifierEngine
from hycoc.verifier import scheduler as sched
from hycoc.verifier.row_budget import RowCost
from hycoc.verifier.server import ServerThread
from tiny_models import VOCAB, tiny_head, tiny_verifier

from hycoc.bench import capacity_cost
from hycoc.bench.capacity_cost import PROFILE_VERSION, MeasuredStepCost, cached_step_cost
from hycoc.bench.capacity_profile import calibrate, profile_server
from hycoc.bench.loadtrace import RequestTrace, RoundTrace

ROWS = 7  # B + 1
SESSIONS = (1, 2, 3)
REPEATS = 3


def _replay(n_requests: int = 3, rounds: int = 12) -> list[RequestTrace]:
    """Hand-made recordings (no commits recorded: replayed by round): 7-row chains of seeded tokens, scored."""
    rng = np.random.default_rng(1)
    parents = (-1, 0, 1, 2, 3, 4, 5)
    scores = tuple(-0.5 * j for j in range(ROWS))
    out = []
    for q in range(n_requests):
        rs = tuple(
            RoundTrace(tuple(int(x) for x in rng.integers(2, VOCAB, ROWS)), parents, 1.0, scores=scores)
            for _ in range(rounds)
        )
        prompt = tuple(int(x) for x in rng.integers(2, VOCAB, 12))
        out.append(RequestTrace("hyco", q, prompt, 0.0, 1, 1.0, q, "exact", 1.0, "device", 200, rs))
    return out


def test_profile_read_from_the_server_is_what_its_worker_spent(monkeypatch):
    """Each step `profile_server` reports (worker CPU ms from hycoc_worker_cpu_seconds_total differences) equals
    the CPU the server's worker thread spent in that step's `_step` call, measured here by a wrapper on the worker
    thread itself (time.thread_time around the call); plain steps verify n whole trees in ONE forward; calibrating
    an in-process grid onto it gives the server's mean at its points, and the grid's other rows by the same factor."""
    torch.set_num_threads(1)
    seen = []  # (sessions in the step's forward, worker CPU ms) of every step with rounds, in order
    inner = sched._step

    def timed(batch, *args):
        c0 = time.thread_time()
        try:
            return inner(batch, *args)
        finally:
            if batch:
                seen.append((len(batch), (time.thread_time() - c0) * 1e3))

    monkeypatch.setattr(sched, "_step", timed)
    model = tiny_verifier(sharpen=3.0)
    engine = VerifierEngine(
        model,
        head=tiny_head(model),
        head_window=6,
        handoff_scales=(0.1, 0.1, 0.05, 0.05, 0.05, 0.05),
        eos_token_ids=set(),
        max_context=512,
    )
    line = RowCost(((7, 1.0), (14, 1.5), (21, 2.0)))
    with ServerThread(
        engine, tree_rows=ROWS, max_batch_wait_ms=2000, tree_budget="auto", row_cost=line, max_batch_rows=ROWS * 4
    ) as srv:
        got = profile_server(srv.url, _replay(), sessions=SESSIONS, repeats=REPEATS)
    engine.close()

    assert got["tree_rows"] == ROWS and got["row_points"] == [(7, 1.0), (14, 1.5), (21, 2.0)]
    by_n: dict = {}
    for n, ms in seen:
        by_n.setdefault(n, []).append(ms)
    for n in SESSIONS:
        kinds = ("plain", "scored") if n > 1 else ("plain",)
        assert len(by_n[n]) == len(kinds) * (REPEATS + 1)  # every step was one forward of all n rounds
        for i, kind in enumerate(kinds):
            want = by_n[n][i * (REPEATS + 1) + 1 : (i + 1) * (REPEATS + 1)]  # after the warm-up
            have = [s["step_ms"] for s in got[kind][n]]
            assert have == pytest.approx(want, rel=0.02, abs=0.05)
        assert {s["rows"] for s in got["plain"][n]} == {n * ROWS}
        assert all(0 < s["forward_ms"] <= s["step_ms"] for s in got["plain"][n])

    # the in-process grid (here: 2 ms per session + 0.1 ms per row) moved onto the server's steps
    local = MeasuredStepCost(
        points=[
            {
                "place": "device",
                "sessions": n,
                "rows": n * r,
                "step_ms": 2.0 * n + 0.1 * n * r,
                "forward_ms": 0.1 * n * r,
            }
            for n in SESSIONS
            for r in (3, ROWS)
        ]
        + [{"place": "cloud-mtp", "sessions": 1, "rows": 5, "step_ms": 10.0, "forward_ms": 0.5}],
        place_ms={"cloud-mtp": 7.5},
        prefill=(1.0, 0.01),
        meta={"threads": 1},
        version=PROFILE_VERSION,
    )
    cal = calibrate(local, got)
    for n in SESSIONS:
        mean = float(np.mean(by_n[n][1 : REPEATS + 1]))  # the worker's own plain steps
        assert cal.step_ms(["device"] * n, [ROWS] * n, [0])[1] == pytest.approx(mean, rel=0.02, abs=0.05)
        f = cal.meta["server"]["factors"][str(n)]
        assert cal.step_ms(["device"] * n, [3] * n, [0])[1] == pytest.approx(f * (2.0 * n + 0.3 * n), rel=1e-9)
    f1 = cal.meta["server"]["factors"]["1"]
    assert cal.prefill[1] == pytest.approx(0.01 * f1)
    # cloud-mtp: its point over the device step of its rows (2 + 0.1 x 5 ms in-process), both x the factor at n = 1
    assert cal.place_ms["cloud-mtp"] == pytest.approx(f1 * (10.0 - 2.5), rel=1e-9)
    assert np.mean(cal.spread) == pytest.approx(1.0)


class _Recipe:
    def content_hash(self) -> str:
        return "ab" * 32


def test_an_older_step_cost_file_is_measured_again(tmp_path, monkeypatch):
    """A cached file without ``version`` (written before the profile came from the server) is measured again and
    replaced; a file of this version is read back as it is."""
    calls = []

    def fake(recipe, **kw):
        calls.append(kw)
        return MeasuredStepCost(step=(9.0, 0.0, 0.0), spread=(1.0,), version=PROFILE_VERSION)

    monkeypatch.setattr(capacity_cost, "measure_step_cost", fake)
    path = tmp_path / f"step-cost-{_Recipe().content_hash()[:16]}.json"
    old = asdict(MeasuredStepCost(step=(5.0, 0.0, 0.0), spread=(0.9, 1.1)))
    old.pop("version")
    path.write_text(json.dumps(old))
    cost = cached_step_cost(_Recipe(), tmp_path)
    assert len(calls) == 1 and cost.step == (9.0, 0.0, 0.0)
    assert json.loads(path.read_text())["version"] == PROFILE_VERSION
    again = cached_step_cost(_Recipe(), tmp_path)
    assert len(calls) == 1 and again.step == (9.0, 0.0, 0.0)
