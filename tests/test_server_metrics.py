"""The server's /metrics (verifier/server/metrics.py) read back with prometheus_client's own parser, and its
admission ledgers (verifier/server/admission.py) on hand-worked numbers: a refusal changes nothing and is counted,
every release path returns exactly what was taken."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hycoc.verifier.batch import BatchStats
from hycoc.verifier.prefill_job import AppendPlan
from hycoc.verifier.scheduler import StepReport
from hycoc.verifier.server import (
    REFUSAL_KINDS,
    Admission,
    KvBudgetExhausted,
    ServerLimits,
    ServerMetrics,
    TooManySessions,
)
from hycoc.verifier.server.errors import AuthRateLimited
from prometheus_client.parser import text_string_to_metric_families

FAMILIES = {
    "hycoc_rounds": "counter",
    "hycoc_retries": "counter",
    "hycoc_sessions_active": "gauge",
    "hycoc_sessions": "counter",
    "hycoc_tokens_committed": "counter",
    "hycoc_mat": "gauge",
    "hycoc_server_ms": "counter",
    "hycoc_prefill_ms": "counter",
    "hycoc_g_ms_per_token": "gauge",
    "hycoc_errors": "counter",
    "hycoc_refusals": "counter",
    "hycoc_connections_active": "gauge",
    "hycoc_kv_bytes_reserved": "gauge",
    "hycoc_batch_rows": "histogram",
    "hycoc_batch_sessions": "histogram",
    "hycoc_queue_wait_seconds": "histogram",
    "hycoc_rows_kept_per_session": "histogram",
    "hycoc_expected_tokens_per_forward": "histogram",
    "hycoc_rows_trimmed": "counter",
    "hycoc_rows_not_drafted": "counter",
    "hycoc_allowance_rows": "histogram",
    "hycoc_appends": "counter",
    "hycoc_append_reprefilled_tokens": "counter",
    "hycoc_kv_bytes_held": "gauge",
    "hycoc_kv_bytes_held_peak": "gauge",
    "hycoc_kv_held_over_reserved": "counter",
    "hycoc_kv_bytes_prefill_pool": "gauge",
    "hycoc_kv_bytes_snapshots": "gauge",
    "hycoc_snapshots_evicted": "counter",
    "hycoc_prefills_active": "gauge",
    "hycoc_rss_bytes": "gauge",
    "hycoc_memory_released_bytes": "counter",
}


def parsed(metrics: ServerMetrics) -> dict:
    """{family name: (type, {(sample name, sorted labels): value})} as prometheus_client parses the exposition."""
    out = {}
    for fam in text_string_to_metric_families(metrics.exposition()):
        out[fam.name] = (fam.type, {(s.name, tuple(sorted(s.labels.items()))): s.value for s in fam.samples})
    return out


def test_exposition_parses_with_every_family_and_refusal_kind_and_no_created_series():
    m = ServerMetrics(live_sessions=lambda: 2)
    m.admission = Admission(ServerLimits(max_kv_bytes=10_000), m.refused)
    m.admission.kv.reserve(4096, 4)
    m.rounds, m.tokens_committed, m.server_ms, m.prefill_ms = 4, 10, 30.0, 20.0
    m.errors["bad_seq"] += 2
    m.refused("max_sessions")
    m.observe_step(StepReport(BatchStats(rows=40, sessions=2, total_ms=12.5), waits=[0.0015, 0.03]))
    m.observe_serial_round(7.5, 7, 0.0004)
    fams = parsed(m)
    assert {name: kind for name, (kind, _) in fams.items()} == FAMILIES
    assert not any(name.endswith("_created") for _, samples in fams.values() for name, _ in samples)

    def value(fam, name, **labels):
        return fams[fam][1][(name, tuple(sorted(labels.items())))]

    assert value("hycoc_rounds", "hycoc_rounds_total") == 4
    assert value("hycoc_mat", "hycoc_mat") == 2.5
    assert value("hycoc_g_ms_per_token", "hycoc_g_ms_per_token") == (30.0 + 12.5 + 7.5 + 20.0) / 10
    assert value("hycoc_sessions_active", "hycoc_sessions_active") == 2
    assert value("hycoc_kv_bytes_reserved", "hycoc_kv_bytes_reserved") == 4096
    assert {labels: v for (_, labels), v in fams["hycoc_refusals"][1].items()} == {
        (("kind", k),): (1.0 if k == "max_sessions" else 0.0) for k in REFUSAL_KINDS
    }
    assert fams["hycoc_errors"][1] == {("hycoc_errors_total", (("kind", "bad_seq"),)): 2.0}
    # rows 40 and 7: cumulative buckets (le=33 holds 7, le=66 both), sum and count
    assert value("hycoc_batch_rows", "hycoc_batch_rows_bucket", le="33.0") == 1
    assert value("hycoc_batch_rows", "hycoc_batch_rows_bucket", le="66.0") == 2
    assert value("hycoc_batch_rows", "hycoc_batch_rows_bucket", le="+Inf") == 2
    assert (value("hycoc_batch_rows", "hycoc_batch_rows_sum"), value("hycoc_batch_rows", "hycoc_batch_rows_count")) == (
        47,
        2,
    )
    assert value("hycoc_queue_wait_seconds", "hycoc_queue_wait_seconds_bucket", le="0.0005") == 1
    assert value("hycoc_queue_wait_seconds", "hycoc_queue_wait_seconds_bucket", le="0.002") == 2
    assert value("hycoc_queue_wait_seconds", "hycoc_queue_wait_seconds_sum") == pytest.approx(0.0319)


def plan(kind: str, keep: int, start: int) -> AppendPlan:
    return AppendPlan(keep=keep, start=start, kind=kind, conversation=np.arange(keep + 2), reprefilled=keep - start)


def test_appends_are_counted_by_kind_with_the_positions_prefilled_again():
    """hycoc_appends_total{kind} has every kind (crop, snapshot, full) from the start, at 0; each APPEND done adds 1
    to its kind and its reprefilled positions (keep - start) to hycoc_append_reprefilled_tokens_total."""
    m = ServerMetrics()
    fams = parsed(m)
    assert fams["hycoc_appends"] == (
        "counter",
        {("hycoc_appends_total", (("kind", k),)): 0.0 for k in ("crop", "snapshot", "full")},
    )
    assert fams["hycoc_append_reprefilled_tokens"] == ("counter", {("hycoc_append_reprefilled_tokens_total", ()): 0.0})
    for p in (plan("crop", 40, 39), plan("crop", 40, 40), plan("snapshot", 30, 12), plan("full", 25, 0)):
        m.observe_append(p)
    fams = parsed(m)
    assert {labels: v for (_, labels), v in fams["hycoc_appends"][1].items()} == {
        (("kind", "crop"),): 2,
        (("kind", "snapshot"),): 1,
        (("kind", "full"),): 1,
    }
    assert fams["hycoc_append_reprefilled_tokens"][1] == {
        ("hycoc_append_reprefilled_tokens_total", ()): (40 - 39) + 0 + (30 - 12) + (25 - 0)
    }


def test_each_server_has_its_own_registry_and_nan_before_the_first_round():
    a, b = ServerMetrics(), ServerMetrics()
    a.rounds = 3
    a.batch_rows.observe(5)
    pa, pb = parsed(a), parsed(b)
    assert (
        pa["hycoc_rounds"][1][("hycoc_rounds_total", ())] == 3
        and pb["hycoc_rounds"][1][("hycoc_rounds_total", ())] == 0
    )
    assert pb["hycoc_batch_rows"][1][("hycoc_batch_rows_count", ())] == 0
    assert math.isnan(pb["hycoc_mat"][1][("hycoc_mat", ())]) and math.isnan(
        pb["hycoc_g_ms_per_token"][1][("hycoc_g_ms_per_token", ())]
    )
    assert a.registry is not b.registry


def test_kv_budget_refuses_without_change_and_every_release_returns_what_was_taken():
    refused = []
    adm = Admission(ServerLimits(max_kv_bytes=10_000, max_sessions=2, retry_after_s=3), refused.append)
    kv = adm.kv.reserve(6000, 6)
    with pytest.raises(
        KvBudgetExhausted,
        match=r"this request needs 5000 KV bytes \(5 positions\), 6000 of "
        r"max_kv_bytes = 10000 are reserved; retry after 3 s",
    ):
        adm.kv.reserve(5000, 5)
    assert (adm.kv.reserved, refused) == (6000, ["max_kv_bytes"])
    assert kv.grow(4000, "the next turn needs 4000 more KV bytes") == 4000 and adm.kv.reserved == 10_000
    with pytest.raises(KvBudgetExhausted, match="the next turn needs 1 more KV bytes, 10000 of"):
        kv.grow(1, "the next turn needs 1 more KV bytes")
    assert (kv.nbytes, adm.kv.reserved) == (10_000, 10_000)
    kv.shrink(4000)  # a failed APPEND gives its growth back
    assert (kv.nbytes, adm.kv.reserved) == (6000, 6000)
    kv.release()
    kv.release()  # idempotent: a second end path frees nothing more
    kv.shrink(10)
    assert (kv.nbytes, adm.kv.reserved) == (0, 0)
    assert kv.grow(0, "-") == 0 and kv.grow(-5, "-") == 0


def test_session_slots_and_auth_failures():
    refused = []
    adm = Admission(ServerLimits(max_sessions=2, auth_failures_per_minute=2), refused.append)
    a, b = adm.sessions.acquire(), adm.sessions.acquire()
    with pytest.raises(TooManySessions, match="2 sessions are open, max_sessions = 2; retry after 5 s"):
        adm.sessions.acquire()
    a.release()
    a.release()
    assert adm.sessions.in_use == 1
    adm.sessions.acquire()
    b.release()
    assert adm.sessions.in_use == 1
    adm.auth.record("p")
    adm.auth.check("p")  # one failure: still allowed
    adm.auth.record("p")
    with pytest.raises(
        AuthRateLimited, match="2 refused auth attempts from this address within a minute; retry after 60 s"
    ):
        adm.auth.check("p")
    adm.auth.check("q")  # per peer
    assert refused == ["max_sessions", "auth_failures_per_minute"]


@pytest.mark.serve
def test_the_ray_ingress_merges_two_servers_expositions():
    """`merge_expositions` (verifier/ray_serve.py) over two real expositions: one HELP/TYPE per family, every sample
    labelled by its replica, and prometheus_client parses the result."""
    ray_serve = pytest.importorskip("hycoc.verifier.ray_serve", reason="Ray Serve is not installed")
    a, b = ServerMetrics(), ServerMetrics()
    a.rounds, b.rounds = 3, 5
    b.errors["bad_root"] = 1
    a.batch_rows.observe(7)
    merged = ray_serve.merge_expositions({"r1": a.exposition(), "r2": b.exposition(), "r3": None})
    fams = {f.name: f for f in text_string_to_metric_families(merged)}
    assert merged.count("# TYPE hycoc_rounds_total counter") == 1
    rounds = {s.labels["replica"]: s.value for s in fams["hycoc_rounds"].samples}
    assert rounds == {"r1": 3, "r2": 5}
    assert [(s.labels, s.value) for s in fams["hycoc_errors"].samples] == [({"replica": "r2", "kind": "bad_root"}, 1)]
    count = {
        s.labels["replica"]: s.value for s in fams["hycoc_batch_rows"].samples if s.name == "hycoc_batch_rows_count"
    }
    assert count == {"r1": 1, "r2": 0}
    assert {s.labels["state"]: s.value for s in fams["hycoc_replicas"].samples} == {"up": 2, "unreachable": 1}
    assert len([s for s in fams["hycoc_refusals"].samples]) == 2 * len(REFUSAL_KINDS)


def test_kv_held_is_sampled_against_the_reservation():
    """hycoc_kv_bytes_held (last sample), its peak, and the samples above the ledger (a bug: counted, logged)."""
    m = ServerMetrics()
    m.admission = Admission(ServerLimits(max_kv_bytes=10_000), m.refused)
    spare = m.admission.kv.reserve_spare(1000)
    m.prefill_pool_bytes = 2048
    m.observe_kv_held(3000, 4096)
    m.observe_kv_held(5000, 4096)
    m.observe_kv_held(1000, 4096)
    m.observe_step(StepReport(BatchStats(), prefills_active=1))
    fams = parsed(m)
    got = {name: fams[name][1] for name in ("hycoc_kv_bytes_held", "hycoc_kv_bytes_held_peak",
                                            "hycoc_kv_held_over_reserved", "hycoc_kv_bytes_prefill_pool",
                                            "hycoc_kv_bytes_snapshots", "hycoc_prefills_active")}  # fmt: skip
    assert got == {
        "hycoc_kv_bytes_held": {("hycoc_kv_bytes_held", ()): 1000.0},
        "hycoc_kv_bytes_held_peak": {("hycoc_kv_bytes_held_peak", ()): 5000.0},
        "hycoc_kv_held_over_reserved": {("hycoc_kv_held_over_reserved_total", ()): 1.0},
        "hycoc_kv_bytes_prefill_pool": {("hycoc_kv_bytes_prefill_pool", ()): 2048.0},
        "hycoc_kv_bytes_snapshots": {("hycoc_kv_bytes_snapshots", ()): 1000.0},
        "hycoc_prefills_active": {("hycoc_prefills_active", ()): 1.0},
    }
    assert spare is not None and m.admission.kv.spare_bytes == 1000
