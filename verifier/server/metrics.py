"""The verifier server's /metrics: counters kept as plain fields, published through ``prometheus_client``.

As vLLM (``vllm/v1/metrics/``) and SGLang (``srt/metrics/collector.py``) do, the server records what happened in a
plain object (`ServerMetrics`: counts, milliseconds, errors and refusals by kind, three histograms) and a
collector turns it, and the admission ledgers' totals (`hycoc.verifier.server.admission`), into metric families
at each scrape. Every server has its own ``CollectorRegistry`` (many servers run in one process: tests, ``hycoc
bench``); no multiprocess mode (Ray replicas are separate processes already).

The exposition is Prometheus' text format 0.0.4 (`METRICS_CONTENT_TYPE`; prometheus_client >= 0.23 defaults to
1.0.0, and the Ray Serve ingress, `hycoc.verifier.ray_serve.merge_expositions`, merges 0.0.4 text). The
OpenMetrics-only ``_created`` samples of counters and histograms are left out: the 0.0.4 writer would turn each
into an extra gauge family, and a counter's creation time tells a scrape nothing here.

Families (names and labels are the contract; docs/serving.md "Verifier server and wire protocol"):

    hycoc_rounds_total, hycoc_retries_total, hycoc_sessions_total, hycoc_tokens_committed_total,
    hycoc_server_ms_total, hycoc_prefill_ms_total                          counters
    hycoc_errors_total{kind=CODE}         ERROR frames sent, by wire code (a code appears once sent)
    hycoc_refusals_total{kind=LIMIT}      refusals by limit name; every kind of `REFUSAL_KINDS` from the start
    hycoc_sessions_active, hycoc_connections_active, hycoc_kv_bytes_reserved   gauges read from the ledgers
    hycoc_mat, hycoc_g_ms_per_token       gauges derived from the counters (NaN before the first round / token)
    hycoc_batch_rows, hycoc_batch_sessions, hycoc_queue_wait_seconds           histograms
    hycoc_rows_kept_per_session, hycoc_expected_tokens_per_forward             histograms (row budget)
    hycoc_rows_trimmed_total              tree rows a row budget left out of batched forwards (counter)
    hycoc_allowance_rows                  rows granted to the next round by each unfinished reply (histogram;
                                          verifier.allowance)
    hycoc_rows_not_drafted_total          tree rows device-drafted rounds left out under their allowance
                                          (tree_rows - rows sent; counter): rows the device never drafted
    hycoc_appends_total{kind=crop|snapshot|full}   APPENDs by how the conversation rolled back (docs/serving.md
                                          "Conversations"); "full": nothing held could be kept (a template that
                                          renders earlier turns differently, or a rollback before the snapshot)
    hycoc_append_reprefilled_tokens_total positions an APPEND prefilled again that the session held already
    hycoc_kv_bytes_held, hycoc_kv_bytes_held_peak   KV the sessions hold (caches, snapshots, undo copies), sampled
                                          on the worker after each engine call, and its largest sample
    hycoc_kv_held_over_reserved_total     samples where that passed hycoc_kv_bytes_reserved (a bug: must stay 0)
    hycoc_kv_bytes_prefill_pool, hycoc_kv_bytes_snapshots   gauges: the prefill pool's reservation (max_prefills
                                          slots) and the conversation snapshots' (spare room, given up when needed)
    hycoc_snapshots_evicted_total         snapshots given up for a reservation that needed their room
    hycoc_prefills_active                 prefills under way after the last batched step (<= max_prefills)
    hycoc_rss_bytes, hycoc_memory_released_bytes_total   the process's RSS at the last periodic release of the C
                                          allocator's free pages, and what those releases gave back
                                          (`hycoc.verifier.server.memory`)
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..scheduler import StepReport
from .admission import Admission
from .limits import REFUSAL_KINDS

#: Prometheus text exposition format served at /metrics (0.0.4).
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

#: How an APPEND rolls a conversation back (`hycoc.verifier.prefill_job.AppendPlan.kind`); all exposed from the start.
APPEND_KINDS = ("crop", "snapshot", "full")
#: Bucket bounds of the batching histograms (rows per forward, sessions per forward, queue wait in seconds).
ROWS_BUCKETS = (1, 2, 4, 8, 16, 33, 66, 132, 264, 528, 1056, 2112)
SESSIONS_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: Rows a session kept in a forward (1 .. a 33-row tree and beyond), expected tokens per forward (16 sessions x ~3).
KEPT_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33, 48, 66)
EXPECTED_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256)
WAIT_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class ServerMetrics:
    """What one server counted over its lifetime (all sessions, all draft places), and its /metrics exposition.

    Event counters, updated by the server on its event loop: rounds, retries, sessions_total, tokens_committed,
    server_ms, prefill_ms (float ms), errors (Counter: wire code -> ERROR frames), refusals (Counter: limit name ->
    refusals; `refused` adds one). Histograms (prometheus_client ``Histogram``, ``observe(value)``): batch_rows,
    batch_sessions, queue_wait (seconds). Gauges read at each scrape: sessions_active (``live_sessions()``),
    connections_active and kv_bytes_reserved (the `Admission` ledgers).

    MAT = tokens_committed / rounds counts the bonus token (paper App. G, as vLLM / SGLang / Spec-Bench).
    g = (server_ms + prefill_ms) / tokens_committed, the verifier's milliseconds per output token incl. prefill.
    """

    def __init__(self, admission: Admission | None = None, live_sessions: Callable[[], int] = lambda: 0):
        self.rounds = 0
        self.retries = 0
        self.sessions_total = 0
        self.tokens_committed = 0
        self.server_ms = 0.0
        self.prefill_ms = 0.0
        self.errors: Counter = Counter()
        self.refusals: Counter = Counter()
        self.admission = admission
        self._live_sessions = live_sessions
        # Unregistered: `_Collector` publishes them (without their _created samples) in this server's registry.
        self.batch_rows = _histogram(
            "hycoc_batch_rows",
            "tree rows per verification forward (all its sessions' rows, cloud-mtp chains included)",
            ROWS_BUCKETS,
        )
        self.batch_sessions = _histogram("hycoc_batch_sessions", "sessions per verification forward", SESSIONS_BUCKETS)
        self.rows_kept = _histogram(
            "hycoc_rows_kept_per_session",
            "tree rows verified per session and batched forward (after the row budget, when one is on)",
            KEPT_BUCKETS,
        )
        self.expected_tokens = _histogram(
            "hycoc_expected_tokens_per_forward",
            "expected committed tokens of a budgeted forward's kept rows (sessions + sum of exp(tree score))",
            EXPECTED_BUCKETS,
        )
        self.rows_trimmed = 0
        self.rows_not_drafted = 0
        self.allowance = _histogram(
            "hycoc_allowance_rows",
            "rows (root included) each unfinished reply allowed the session's next round (verifier.allowance)",
            KEPT_BUCKETS,
        )
        self.appends: Counter = Counter()  # APPEND kind -> count
        self.append_reprefilled = 0
        self.queue_wait = _histogram(
            "hycoc_queue_wait_seconds",
            "seconds from a round's arrival to the start of its forward's step",
            WAIT_BUCKETS,
        )
        self.kv_bytes_held = 0
        self.kv_bytes_held_peak = 0
        self.prefill_pool_bytes = 0  # set by the server once it reserved the pool
        self.rss_bytes = 0  # at the last memory release
        self.memory_released = 0
        self.kv_held_over_reserved = 0
        self.prefills_active = 0
        self.prefills_active_peak = 0  # the most after any step (<= max_prefills)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))

    def observe_memory_release(self, before: int, after: int) -> None:
        """One periodic release of the allocator's free pages: RSS ``before`` and ``after`` it, in bytes."""
        self.rss_bytes = int(after)
        self.memory_released += max(0, int(before) - int(after))

    def observe_kv_held(self, held: int, reserved: int) -> None:
        """One sample of the KV the sessions hold (``held`` bytes) against the ledger's ``reserved``; a sample
        above it is counted (and logged once: every byte held must be reserved)."""
        self.kv_bytes_held = int(held)
        self.kv_bytes_held_peak = max(self.kv_bytes_held_peak, int(held))
        if held > reserved:
            if not self.kv_held_over_reserved:
                import logging

                logging.getLogger("hycoc.verifier.server").error(
                    "KV held %d B > reserved %d B: a reservation misses some bytes", held, reserved
                )
            self.kv_held_over_reserved += 1

    def observe_step(self, report: StepReport) -> None:
        """One batched scheduler step (`hycoc.verifier.scheduler.StepReport`): its forward's rows, sessions and
        ms, and each round's queue wait."""
        stats = report.stats
        if stats.sessions:
            self.batch_rows.observe(stats.rows)
            self.batch_sessions.observe(stats.sessions)
            self.server_ms += stats.total_ms
            for kept in stats.rows_kept:
                self.rows_kept.observe(kept)
            self.rows_trimmed += max(0, stats.rows_sent - stats.rows)
            if stats.expected_tokens is not None:
                self.expected_tokens.observe(stats.expected_tokens)
        for wait in report.waits:
            self.queue_wait.observe(wait)
        self.prefills_active = report.prefills_active
        self.prefills_active_peak = max(self.prefills_active_peak, report.prefills_active)

    def observe_serial_round(self, server_ms: float, rows: int, wait_s: float) -> None:
        """One serial-mode round: a forward of one session's ``rows`` rows that took ``server_ms`` after waiting
        ``wait_s`` seconds in the queue."""
        self.server_ms += server_ms
        self.queue_wait.observe(wait_s)
        self.batch_sessions.observe(1)
        self.batch_rows.observe(rows)
        self.rows_kept.observe(rows)

    def observe_allowance(self, session, rows_sent: int, granted: int) -> None:
        """One verified round of ``session`` (a `hycoc.verifier.engine.Session`): the rows its device did not draft
        under the allowance it was given (tree_rows - rows_sent, device-drafted places only) and the allowance its
        reply ``granted`` the next round (0: finished, not observed)."""
        if session.place.device_rows and session.tree_rows:
            self.rows_not_drafted += max(0, int(session.tree_rows) - int(rows_sent))
        if granted:
            self.allowance.observe(granted)

    def observe_append(self, plan) -> None:
        """One APPEND done (`hycoc.verifier.prefill_job.AppendPlan`): counted by its kind, and the held positions it
        prefilled again."""
        self.appends[plan.kind] += 1
        self.append_reprefilled += int(plan.reprefilled)

    def refused(self, kind: str) -> None:
        """Count one refusal by the limit ``kind`` (one of REFUSAL_KINDS)."""
        self.refusals[kind] += 1

    @property
    def sessions_active(self) -> int:
        """Sessions open now (prefilled, OPENED sent, not yet ended); each holds a KV cache."""
        return int(self._live_sessions())

    @property
    def connections_active(self) -> int:
        """TCP connections admitted and open now (0 for front doors that own their sockets)."""
        return self.admission.connections.active if self.admission is not None else 0

    @property
    def kv_bytes_reserved(self) -> int:
        """KV bytes reserved by open and opening sessions (the max_kv_bytes ledger)."""
        return self.admission.kv.reserved if self.admission is not None else 0

    def exposition(self) -> str:
        """The Prometheus text exposition (format 0.0.4) of this server's registry."""
        return generate_latest(self.registry).decode("utf-8")


def _histogram(name: str, documentation: str, buckets) -> Histogram:
    """A histogram in no registry (`_Collector` publishes it in the server's, without its _created sample)."""
    return Histogram(name, documentation, buckets=buckets, registry=None)


def _by_kind(name: str, documentation: str, counts) -> CounterMetricFamily:
    """A counter family labelled ``kind``: one series per (kind, count) of ``counts``, in that order."""
    family = CounterMetricFamily(name, documentation, labels=["kind"])
    for kind, n in counts:
        family.add_metric([kind], n)
    return family


class _Collector(Collector):
    """Turns a `ServerMetrics` into metric families at each scrape (prometheus_client's custom-collector API)."""

    def __init__(self, m: ServerMetrics):
        self.m = m

    def collect(self) -> Iterator[Metric]:
        m = self.m
        mat = m.tokens_committed / m.rounds if m.rounds else math.nan
        g = (m.server_ms + m.prefill_ms) / m.tokens_committed if m.tokens_committed else math.nan
        yield CounterMetricFamily(
            "hycoc_rounds_total", "rounds verified (one tree forward each; retries not counted)", value=m.rounds
        )
        yield CounterMetricFamily(
            "hycoc_retries_total", "rounds answered again from the last reply (idempotent retry)", value=m.retries
        )
        yield GaugeMetricFamily(
            "hycoc_sessions_active", "sessions open now (each holds a KV cache)", value=m.sessions_active
        )
        yield CounterMetricFamily(
            "hycoc_sessions_total", "sessions opened (prefill done, OPENED sent)", value=m.sessions_total
        )
        yield CounterMetricFamily(
            "hycoc_tokens_committed_total",
            "output tokens committed, accepted path plus bonus",
            value=m.tokens_committed,
        )
        yield GaugeMetricFamily(
            "hycoc_mat", "mean tokens committed per round, bonus included (NaN before the first round)", value=mat
        )
        yield CounterMetricFamily("hycoc_server_ms_total", "verifier milliseconds spent in rounds", value=m.server_ms)
        yield CounterMetricFamily(
            "hycoc_prefill_ms_total", "verifier milliseconds spent in prefills", value=m.prefill_ms
        )
        yield GaugeMetricFamily(
            "hycoc_g_ms_per_token",
            "verifier milliseconds per committed token, prefill included (NaN before the first token)",
            value=g,
        )
        yield _by_kind("hycoc_errors_total", "ERROR frames sent, by code", sorted(m.errors.items()))
        yield _by_kind(
            "hycoc_refusals_total",
            "connections, sessions or frames refused by a server limit, by limit",
            ((kind, m.refusals[kind]) for kind in REFUSAL_KINDS),
        )
        yield GaugeMetricFamily(
            "hycoc_connections_active", "TCP connections open now (HTTP and WebSocket)", value=m.connections_active
        )
        yield GaugeMetricFamily(
            "hycoc_kv_bytes_reserved",
            "KV bytes reserved by the open sessions (max_kv_bytes budget)",
            value=m.kv_bytes_reserved,
        )
        yield from self._kv_families()
        yield _by_kind(
            "hycoc_appends_total",
            "APPENDs by how the conversation's KV rolled back (crop, snapshot, full re-prefill)",
            ((kind, m.appends[kind]) for kind in APPEND_KINDS),
        )
        yield CounterMetricFamily(
            "hycoc_append_reprefilled_tokens_total",
            "positions APPENDs prefilled again that the session held already",
            value=m.append_reprefilled,
        )
        yield CounterMetricFamily(
            "hycoc_rows_trimmed_total",
            "tree rows a row budget left out of batched forwards (verifier.tree_budget = auto)",
            value=m.rows_trimmed,
        )
        yield CounterMetricFamily(
            "hycoc_rows_not_drafted_total",
            "tree rows device-drafted rounds left out under their allowance (tree_rows - rows sent)",
            value=m.rows_not_drafted,
        )
        yield GaugeMetricFamily(
            "hycoc_prefills_active", "prefills under way after the last batched step (max_prefills)",
            value=m.prefills_active,
        )  # fmt: skip
        for hist in (m.batch_rows, m.batch_sessions, m.queue_wait, m.rows_kept, m.expected_tokens, m.allowance):
            for family in hist.collect():
                family.samples = [s for s in family.samples if not s.name.endswith("_created")]
                yield family

    def _kv_families(self) -> Iterator[Metric]:
        """The KV held against the ledger: held now and at most, over-reserved samples, pool and snapshots."""
        m = self.m
        kv = m.admission.kv if m.admission is not None else None
        yield GaugeMetricFamily(
            "hycoc_kv_bytes_held", "KV bytes the sessions hold (caches, snapshots, undo copies), last sample",
            value=m.kv_bytes_held,
        )  # fmt: skip
        yield GaugeMetricFamily("hycoc_kv_bytes_held_peak", "largest hycoc_kv_bytes_held sample",
                                value=m.kv_bytes_held_peak)  # fmt: skip
        yield CounterMetricFamily(
            "hycoc_kv_held_over_reserved", "samples where the KV held passed the KV reserved (must stay 0)",
            value=m.kv_held_over_reserved,
        )  # fmt: skip
        yield GaugeMetricFamily("hycoc_kv_bytes_prefill_pool", "KV bytes reserved for max_prefills prefilling "
                                "sessions' transient rows", value=m.prefill_pool_bytes)  # fmt: skip
        yield GaugeMetricFamily("hycoc_kv_bytes_snapshots", "KV bytes reserved by conversation snapshots",
                                value=kv.spare_bytes if kv is not None else 0)  # fmt: skip
        yield CounterMetricFamily(
            "hycoc_snapshots_evicted",
            "snapshots given up for a reservation that needed their room",
            value=kv.evicted if kv is not None else 0,
        )
        yield GaugeMetricFamily(
            "hycoc_rss_bytes", "the process's RSS at the last periodic memory release", value=m.rss_bytes
        )
        yield CounterMetricFamily("hycoc_memory_released_bytes", "RSS the periodic releases of the allocator's "
                                  "free pages gave back", value=m.memory_released)  # fmt: skip
