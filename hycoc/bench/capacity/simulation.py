"""`hycoc capacity`: a discrete-event simulation of N devices in closed loop against R verifier replicas
(docs/capacity.md). Built on SimPy (https://simpy.readthedocs.io: processes are generators, ``env.timeout``,
``env.event``); time is in seconds.

Each simulated device loops over requests (`Workload.request`): it opens a session (uplink, a prefill job at the
verifier, downlink), then per round waits its drafting time, sends the tree (uplink: the link's RTT/2 plus the
frame's serialization, `hycoc.runtime.transport.LinkModel.one_way_s`), waits for the verifier and the reply
(downlink), commits and drafts the next tree, until the request is done; then the next request. The verifier of a
replica is one worker that runs steps, as `hycoc.verifier.scheduler.BatchScheduler` forms them:

* serial: one round (or one whole prefill) per step, first come first served (``--batching serial``);
* batched: once a round is queued, wait at most ``max_batch_wait_ms`` from its arrival for more (dispatch at once
  when the rows reach ``max_batch_rows`` or every open session of the replica has a round queued); take the queued
  rounds oldest first up to ``max_batch_rows`` rows (at least one); one forward; then prefill chunks of the queued
  prefills up to ``prefill_chunk`` positions in all (at least one chunk). The waiting and taking rules are the
  scheduler's own functions (`hycoc.verifier.batch_policy.batch_ready`, `take_rounds`), not a copy;
* budgeted: batched, and the rows of a step with more than one round are chosen by the server's own
  `hycoc.verifier.row_budget.RowBudget` (``choose``: `allocate` with what its `BudgetState` learned; ``observe_step``:
  host ms per session and accepted per expected token from the simulated steps, as
  `hycoc.verifier.batch.verify_batch` does);
* allowance: budgeted, with the server's own `hycoc.verifier.allowance.AllowanceRule`, built by the server's own
  constructor (`AllowanceRule.for_server`: floor and chain_rows K + 1, sharing the budget's `BudgetState`) and fed
  what the server feeds it: at each OPEN the drafting ms its device reports without and with the SLM pass
  (`observe_drafting`, `SimRequest.drafting_ms`), at each ROUND the gap since that session's last reply left the
  server (`observe_away`: downlink, the device's work and drafting, uplink, the event loop's frame in), after
  every step the step's sessions and the scored trees it verified; each reply carries the rows the session's next
  tree may hold (`hycoc.verifier.draft_place.DraftPlace.allowance`); the device drafts ``min(allowance, B + 1)``
  rows (`SimRequest.allow`), and its drafting time and ROUND bytes follow the rows.

What differs per draft place (rows a round sends, rows it adds to the forward, whether a budget may trim it,
whether the rule hears from its device) is asked of the server's `hycoc.verifier.draft_place.PLACES` objects, not
branched on names. The devices' side (requests, rounds, frame bytes) is `hycoc.bench.capacity.requests`.

What a step costs comes from a `StepCost` (`hycoc.bench.capacity.cost`: measured on this machine, a cost-model file,
or labelled GPU assumptions). What a round commits is replayed: a recorded round's accepted path, cut where the
row budget left a path row out (then the bonus is the verifier's sample at the last kept path row: at T = 0 the
recorded next token, so the replay stays on the recorded text; `hycoc.bench.loadtest.trace.tree_at` then gives the
sub-tree a replaying device sends next, exactly as `hycoc loadtest` does).

Results per run are a `hycoc.bench.loadtest.run.RunStats`, summarized by the load test's own
`hycoc.bench.loadtest.report.summarize_run` (the same ramp rule and window), so predicted and measured rows compare
field by field.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from hycoc.bench.capacity.requests import CapacityError, FrameBytes, SimRequest, SimRound, Workload
from hycoc.bench.loadtest.run import RoundSample, RunStats
from hycoc.protocol.messages import MAX_DRAFT_MS
from hycoc.serving_limits import DEFAULT_MAX_BATCH_ROWS, DEFAULT_MAX_BATCH_WAIT_MS, SERVER_MODES
from hycoc.verifier.batch_policy import batch_ready, take_rounds
from hycoc.verifier.draft_place import PLACES
from hycoc.verifier.row_budget import DEFAULT_MIN_ROWS, RowBudget, RowCost

if TYPE_CHECKING:  # simpy is imported where a simulation runs
    from simpy.events import Event, ProcessGenerator

    from hycoc.runtime.transport import LinkModel
    from hycoc.verifier.allowance import AllowanceRule


def _sizes_trees(args: tuple[str, ...]) -> bool:
    """Whether a server started with ``args`` (a `SERVER_MODES` entry) sizes each session's next tree
    (``--allowance auto``): its devices then draft to the replies, which recorded trees cannot replay."""
    return any(a == "--allowance" and b == "auto" for a, b in zip(args, args[1:]))


#: Simulated batching modes: the load test's (`hycoc.serving_limits.SERVER_MODES`, the one list); allowance is
#: budgeted plus the verifier's tree allowance (`hycoc.verifier.allowance.AllowanceRule`: each reply sizes the
#: session's next tree from the load).
MODES = tuple(SERVER_MODES)
#: The modes a replay of recorded trees can simulate (and a measured load test compare with): those whose server
#: does not size the next tree (`hycoc.bench.capacity.app.VALIDATE_MODES`).
REPLAY_MODES = tuple(m for m, args in SERVER_MODES.items() if not _sizes_trees(args))
#: ASSUMED: a step counts as cold (the cost's ``idle_factor``) when its worker had waited at least this many ms
#: since its last step ended (a device drafting, a batch wait): the factor is measured after the recorded drafting
#: time (~10 ms for the toy), and a wait of a millisecond or more is taken to cool the caches the same way.
IDLE_GAP_MS = 1.0


# ---- the simulation ----------------------------------------------------------------------------------------------


@dataclass
class SimConfig:
    """One simulated run. mode: `MODES`; devices: N; duration_s: the run (no round starts after it, as the load
    test); replicas: R verifiers (a device's session stays on the replica that opened it; a new session goes to
    the replica with the fewest open sessions, lowest index on a tie: Ray Serve's power-of-two-choices router with
    two replicas); max_batch_rows, max_batch_wait_ms, prefill_chunk: the scheduler's
    (`hycoc.verifier.scheduler.BatchScheduler`); link: a `LinkModel` or None (no delay: loopback); frames: the
    byte counts the link delays; tree_rows / min_rows: the budget's free rows (max(tree_rows, cost line's flat
    rows)) and rows kept per tree; chain_length: K, the rows a cloud-mtp round grows by at the verifier;
    client_ms: time per round inside the round latency, outside the verifier's queue and step, that runs in
    parallel (each device's own frame encode and decode, the socket, the threads' wake-ups), ms, half before the
    send and half after the reply; loop_ms: the server's event-loop work per round (frame in and decode, the
    hand-off to the worker, the reply out: `hycoc.bench.capacity.host.HostOverhead`), ms, SERIALISED on the
    replica's one loop (a SimPy ``Resource`` of capacity 1), half before the round is queued and half after its
    step; gil_share: the share of that loop work that holds the server process's one GIL (Python's global
    interpreter lock, shared by the event loop and the worker thread): loop work that runs while the worker is in a
    step lengthens the step by gil_share x its ms (the worker waits for the lock; 0: none, the loop runs beside
    the worker); wake_ms: the device's delay after its drafting before it sends, ms;
    slowdown: the verifier's CPU ms are stretched by it (machine load: `cpu_slowdown`); slowdown_samples: instead,
    the measured sequence of (slowdown, CPU ns) intervals of the run, each step replayed through it from a seeded
    random point (`_Replica._wall_ms`): the machine's bursts, so the latency tail is the measured one;
    cpu_scale: every step's CPU ms (forward, host work, prefill) x this: the machine's CPU speed in the run against
    the profile's: a `hycoc.bench.capacity.speed_probe.SpeedSampler`'s mean probe step in the run / in the profile (1:
    the profile's speed);
    row_cost / free_rows:
    the budget's line and free rows when known from the server (its /healthz), else the cost's own line;
    allowance_floor / allowance_target_ms: the allowance rule's floor (None: K + 1, the root and the chain) and
    step-latency target in ms (None: none), mode allowance only."""

    mode: str
    devices: int
    duration_s: float
    replicas: int = 1
    max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS
    max_batch_wait_ms: float = DEFAULT_MAX_BATCH_WAIT_MS
    prefill_chunk: int = 512
    link: LinkModel | None = None
    frames: FrameBytes = field(default_factory=FrameBytes)
    tree_rows: int = 33
    min_rows: int = DEFAULT_MIN_ROWS
    chain_length: int = 4
    client_ms: float = 0.0
    loop_ms: float = 0.0
    wake_ms: float = 0.0
    gil_share: float = 0.0
    slowdown: float = 1.0
    slowdown_samples: tuple | None = None
    cpu_scale: float = 1.0
    row_cost: RowCost | None = None
    free_rows: int | None = None
    allowance_floor: int | None = None
    allowance_target_ms: float | None = None
    seed: int = 0

    def __post_init__(self):
        if self.mode not in MODES:
            raise CapacityError(f"mode {self.mode!r}: one of {', '.join(MODES)}")
        if self.devices < 1 or self.replicas < 1:
            raise CapacityError(f"devices = {self.devices}, replicas = {self.replicas}: both must be >= 1")
        if not self.duration_s > 0:
            raise CapacityError(f"duration_s = {self.duration_s}: must be > 0 seconds")
        if not self.cpu_scale > 0:
            raise CapacityError(f"cpu_scale = {self.cpu_scale}: must be > 0 (1: the profile's CPU speed)")


@dataclass
class SimResult:
    """A simulated run: ``stats`` as the load test's client would have measured (`RunStats`), ``busy_s`` per
    replica (seconds its worker ran steps within the run), ``server_ms``: per answered round, arrival at the
    verifier -> reply leaving it, ms (queue + batch wait + step), ``forwards``: steps run, ``rows``: rows
    verified in all, ``trimmed``: rows the budget left out, ``cpu_ms``: the workers' step ms before any
    stretch for machine load (the cost's CPU ms), ``allowances``: per answered round of mode allowance, the
    allowance its reply carried (None for a place whose rounds are the root alone), ``rule``: the first replica's
    allowance rule as the run's window left it, `AllowanceRule.explain` at the run's mean sessions per step (None
    outside mode allowance)."""

    stats: RunStats
    busy_s: list[float]
    server_ms: list[float] = field(default_factory=list)
    forwards: int = 0
    rows: int = 0
    trimmed: int = 0
    round_sessions: int = 0
    cpu_ms: float = 0.0
    allowances: list = field(default_factory=list)
    rule: dict | None = None


@dataclass
class _Job:
    session: _Session
    rnd: SimRound | None
    rows: int
    arrived: float
    done: Event  # value: (committed tokens, server ms)
    prefill_left: int = 0
    context: int = 0

    def sim_round(self) -> SimRound:
        """The round of a ROUND job (a prefill job has none)."""
        if self.rnd is None:
            raise CapacityError("a prefill job among a step's rounds")
        return self.rnd


@dataclass(eq=False)
class _Session:
    replica: int
    request: SimRequest
    context: int
    allowance: int | None = None  # the last reply's (mode allowance)
    replied_at: float | None = None  # when its last round's REPLY left the server (s): the device's away time starts


class _Replica:
    """One verifier: its queues, its event loop, its `RowBudget` (budgeted), its worker process (module docstring)."""

    def __init__(self, env, index: int, cfg: SimConfig, cost, result: SimResult):
        import simpy

        self.env, self.index, self.cfg, self.cost, self.result = env, index, cfg, cost, result
        self.loop = simpy.Resource(env, capacity=1)  # the server's one event loop
        self.rounds: deque[_Job] = deque()
        self.prefills: deque[_Job] = deque()
        self.open_sessions = 0
        self.wake = env.event()
        self.in_step = False  # the worker is running a step (the loop's work then holds it up: gil_share)
        self.last_end = -math.inf  # when the worker's last step ended (s): a later start after IDLE_GAP_MS is cold
        self.held_ms = 0.0  # loop ms that held the GIL during the running step, not yet added to it
        self.budget: RowBudget | None = None  # the server's own budget object: its choice and its learning
        self.rule: AllowanceRule | None = None  # the server's own allowance rule (mode allowance)
        if cfg.mode in ("budgeted", "allowance"):
            line = cfg.row_cost if cfg.row_cost is not None else cost.row_cost()
            free = cfg.free_rows or max(cfg.tree_rows, line.flat_rows())
            self.budget = RowBudget(line, free, cfg.min_rows)
            if cfg.mode == "allowance":
                from hycoc.verifier import allowance

                self.rule = allowance.AllowanceRule.for_server(  # the server's own constructor (app.py's)
                    line,
                    cfg.tree_rows,
                    cfg.chain_length,
                    floor=cfg.allowance_floor or 0,
                    target_ms=cfg.allowance_target_ms,
                    budget=self.budget.state,  # one learned state, as the server shares it
                    free_rows=free,
                )
        self.rng = np.random.default_rng([cfg.seed, index])
        self.stretch = None
        if cfg.slowdown_samples:
            s = np.asarray(cfg.slowdown_samples, np.float64).reshape(-1, 2)
            self.cpu = s[:, 1] / 1e6  # ms of CPU the thread got in each interval
            self.stretch = s[:, 0]
            self.wall = self.cpu * self.stretch  # ms those took on the wall
            self.weights = self.cpu / self.cpu.sum()
        env.process(self.worker())

    def on_loop(self, ms: float) -> ProcessGenerator:
        """``ms`` of the replica's event loop, after the frames queued on it before (FIFO)."""
        if ms > 0:
            with self.loop.request() as turn:
                yield turn
                if self.in_step:  # the worker waits for the GIL while the loop holds it
                    self.held_ms += self.cfg.gil_share * ms
                yield self.env.timeout(ms / 1e3)

    def opened(self, session: _Session) -> None:
        """A session's OPEN was answered: the rule learns the drafting ms its device reported, as the server's
        ``SessionLoop._open`` does (device-drafted places; the OPEN's f32 fields as the server decodes them)."""
        if self.rule is not None and PLACES[session.request.draft_place].device_rows:
            floor, tree = (float(np.float32(min(max(0.0, x), MAX_DRAFT_MS))) for x in session.request.drafting_ms())
            self.rule.observe_drafting(floor, tree)

    def arrived(self, session: _Session, rows: int) -> None:
        """A ROUND of ``rows`` rows was decoded on the event loop: the rule learns the gap since the session's last
        reply left the server, as ``SessionLoop._observe_away`` does (device-drafted places; none after an OPEN)."""
        if session.replied_at is not None and self.rule is not None:
            if PLACES[session.request.draft_place].device_rows:
                self.rule.observe_away(1e3 * (self.env.now - session.replied_at), rows)
        session.replied_at = None

    def submit(self, job: _Job) -> None:
        (self.prefills if job.rnd is None else self.rounds).append(job)
        if not self.wake.triggered:
            self.wake.succeed()

    def _idle(self):
        if self.wake.triggered:
            self.wake = self.env.event()
        return self.wake

    def worker(self) -> ProcessGenerator:
        cfg = self.cfg
        while True:
            if not self.rounds and not self.prefills:
                yield self._idle()
                continue
            if cfg.mode == "serial":
                # one engine call at a time, in arrival order
                first_round = self.rounds[0].arrived if self.rounds else math.inf
                first_prefill = self.prefills[0].arrived if self.prefills else math.inf
                if first_prefill < first_round:
                    job = self.prefills.popleft()
                    ms = self.cost.prefill_ms(job.prefill_left, 0) * cfg.cpu_scale
                    yield from self._run(ms)
                    job.done.succeed(((), ms))
                    continue
                job = self.rounds.popleft()
                yield from self._step([job], [])
                continue
            if self.rounds:
                yield from self._gather()
            batch = self._take()
            prefills = list(self.prefills)
            if batch or prefills:
                yield from self._step(batch, prefills)

    def _gather(self) -> ProcessGenerator:
        cfg = self.cfg
        deadline = self.rounds[0].arrived + cfg.max_batch_wait_ms / 1e3
        while True:
            if batch_ready(self.rounds, cfg.max_batch_rows, self.open_sessions):  # the scheduler's own rule
                return
            left = deadline - self.env.now
            if left <= 0:
                return
            wake = self._idle()
            yield wake | self.env.timeout(left)

    def _take(self) -> list[_Job]:
        batch, self.rounds = take_rounds(self.rounds, self.cfg.max_batch_rows)  # the scheduler's own rule
        return batch

    def _run(self, ms: float) -> ProcessGenerator:
        start = self.env.now
        if start - self.last_end >= IDLE_GAP_MS / 1e3:  # the worker waited for this job: its caches went cold
            ms *= self.cost.idle_factor
        self.result.cpu_ms += ms
        self.in_step, self.held_ms = True, 0.0
        yield self.env.timeout(self._wall_ms(ms) / 1e3)
        while self.held_ms > 0:  # the event loop held the GIL meanwhile: the step is that much longer
            held, self.held_ms = self.held_ms, 0.0
            yield self.env.timeout(held / 1e3)
        self.in_step = False
        self.last_end = self.env.now
        end = min(self.env.now, self.cfg.duration_s)
        self.result.busy_s[self.index] += max(0.0, end - max(start, 0.0)) if start < self.cfg.duration_s else 0.0

    def _allow(self, batch: list[_Job], committed: list[int]) -> None:
        """The allowance rule learns the step (its sessions; the budget's shared state learned its ms) and the
        scored device trees it verified with the tokens each committed, then each round's reply carries its place's
        allowance (`AllowanceRule.grant`, once per reply, as the scheduler's `Session.grant`)."""
        rule = self.rule
        if rule is None:  # mode allowance only: _step asks with a rule
            return
        for j, n in zip(batch, committed):
            place = PLACES[j.session.request.draft_place]
            scores, tokens, parents = j.sim_round().tree
            if place.trimmable and scores is not None:
                rule.observe_tree(scores, tokens, parents, n)
        rule.observe_step(len(batch))
        for j in batch:
            place = PLACES[j.session.request.draft_place]
            j.session.allowance = place.allowance(self.rule, self.cfg.tree_rows)
            self.result.allowances.append(j.session.allowance if place.device_rows else None)

    def _wall_ms(self, ms: float) -> float:
        """Wall ms of ``ms`` CPU ms: x slowdown; with measured intervals, replayed from a random point of the
        measured sequence (chosen in proportion to CPU, so each CPU ms is equally likely to start there) until
        the step's CPU is covered -- a long step averages over the intervals it spans, as it did."""
        if self.stretch is None or ms <= 0:
            return ms * self.cfg.slowdown
        k = int(self.rng.choice(len(self.cpu), p=self.weights))
        need, wall = ms, 0.0
        for _ in range(10 * len(self.cpu)):
            got = self.cpu[k]
            if got >= need:
                return wall + need * self.stretch[k]
            wall += self.wall[k]
            need -= got
            k = (k + 1) % len(self.cpu)
        return wall + need * self.cfg.slowdown

    def _step(self, batch: list[_Job], prefills: list[_Job]) -> ProcessGenerator:
        cfg, cost = self.cfg, self.cost
        results: list[tuple] = []
        ms = 0.0
        if batch:
            kept: list = [None] * len(batch)
            alloc = None
            if self.budget is not None and len(batch) > 1:
                trees = [
                    j.sim_round().tree
                    if PLACES[j.session.request.draft_place].trimmable  # cloud-mtp: kept whole, as the server
                    else (None, np.zeros(j.rows, np.int32), np.arange(-1, j.rows - 1))
                    for j in batch
                ]
                alloc = self.budget.choose(trees)
                kept = alloc.kept
            rows_kept = []
            for j, k in zip(batch, kept):
                r = j.rows if k is None else len(k)
                rows_kept.append(r)
                path = j.sim_round().path
                if k is not None:
                    keep = set(int(x) for x in k)
                    cut = next((i for i, row in enumerate(path) if row not in keep), len(path))
                    path = path[:cut]
                results.append(j.sim_round().committed[: len(path) + 1])
            places = [j.session.request.draft_place for j in batch]
            forward_ms, step_ms = cost.step_ms(places, rows_kept, [j.session.context for j in batch])
            if alloc is not None:  # the budget's own choosing and restricting, on the worker inside the step
                step_ms += cost.budget_step_ms(len(batch))
            spread = cost.spread_factor(self.rng)  # this step's cost / its point's mean, as measured
            spread *= cfg.cpu_scale  # the machine's speed in this run against the profile's (measured)
            forward_ms, step_ms = forward_ms * spread, step_ms * spread
            ms += step_ms
            self.result.forwards += 1
            self.result.rows += sum(rows_kept)
            self.result.round_sessions += len(batch)
            if alloc is not None and self.budget is not None:  # alloc: the budget's choice
                self.result.trimmed += alloc.trimmed
                scored = all(t[0] is not None for t in trees)
                accepted = float(sum(len(c) - 1 for c in results)) if scored else None
                self.budget.observe_step(step_ms, forward_ms, len(batch), accepted, alloc.expected_tokens)
            if self.rule is not None:
                self._allow(batch, [len(c) for c in results])
        done_prefills: list[_Job] = []
        used = 0
        for p in prefills:
            n = min(cfg.prefill_chunk, p.prefill_left)
            if done_prefills or used:
                if used + n > cfg.prefill_chunk:
                    break
            ms += cost.prefill_ms(n, p.context) * cfg.cpu_scale
            p.context += n
            p.prefill_left -= n
            used += n
            if p.prefill_left <= 0:
                done_prefills.append(p)
        start = self.env.now
        yield from self._run(ms)
        for j, committed in zip(batch, results):
            j.done.succeed((committed, 1e3 * (self.env.now - j.arrived)))
        for p in done_prefills:
            self.prefills.remove(p)
            p.done.succeed(((), 1e3 * (self.env.now - p.arrived)))
        del start


def cpu_slowdown(loadavg: float, cores: int) -> float:
    """How much longer a CPU-bound thread takes on a shared machine: max(1, load / cores) (each of ``loadavg``
    runnable threads gets cores / load of a core when there are more of them than cores). The load average
    counts the verifier's own worker, so a quiet machine gives 1."""
    return max(1.0, float(loadavg) / max(1, int(cores)))


def simulate(workload: Workload, cfg: SimConfig, cost, *, progress: Callable[[float], None] | None = None) -> SimResult:
    """Run ``cfg.devices`` simulated devices of ``workload`` against ``cfg.replicas`` verifiers whose steps cost
    what ``cost`` (a `hycoc.bench.capacity.cost.StepCost`) says, for ``cfg.duration_s`` simulated seconds (module
    docstring). Deterministic for a given seed. Returns a `SimResult`. progress: called with the simulated time
    about every simulated second."""
    import simpy

    env = simpy.Environment()
    result = SimResult(RunStats(), [0.0] * cfg.replicas)
    stats = result.stats
    replicas = [_Replica(env, r, cfg, cost, result) for r in range(cfg.replicas)]
    link, frames = cfg.link, cfg.frames

    def one_way(nbytes: int) -> float:
        return 0.0 if link is None else link.one_way_s(nbytes)

    def device(i: int) -> ProcessGenerator:
        k = 0
        while env.now < cfg.duration_s:
            req = workload.requests(i, k)
            k += 1
            replica = min(replicas, key=lambda rp: (rp.open_sessions, rp.index))
            session = _Session(replica.index, req, 0)
            replica.open_sessions += 1
            sent = env.now
            yield env.timeout(one_way(frames.open_fixed + 4 * req.prompt_len))
            yield from replica.on_loop(cfg.loop_ms / 2)
            done = env.event()
            replica.submit(_Job(session, None, 0, env.now, done, prefill_left=max(0, req.prompt_len - 1)))
            yield done
            session.context = max(0, req.prompt_len - 1)
            replica.opened(session)
            yield from replica.on_loop(cfg.loop_ms / 2)
            yield env.timeout(one_way(frames.open_down))
            stats.opens_ms.append(1e3 * (env.now - sent))
            finished = True
            while True:
                rnd = req.next_round()
                if rnd is None:
                    finished = False
                    break
                wait = rnd.device_ms / 1e3
                if env.now + wait >= cfg.duration_s:
                    replica.open_sessions -= 1  # the run is over for this device (the load test's OPENs
                    return  # after this point produce no round either)
                yield env.timeout(wait + cfg.wake_ms / 1e3)
                stats.device_waits_ms.append((rnd.device_ms, rnd.device_ms + cfg.wake_ms))
                sent = env.now
                yield env.timeout(one_way(frames.up(rnd.rows)) + cfg.client_ms / 2e3)
                yield from replica.on_loop(cfg.loop_ms / 2)  # the frame in, decoded, handed to the worker
                replica.arrived(session, rnd.rows)
                done = env.event()
                rows = PLACES[req.draft_place].forward_rows(rnd.rows, cfg.chain_length)
                replica.submit(_Job(session, rnd, rows, env.now, done))
                committed, server_ms = yield done
                yield from replica.on_loop(cfg.loop_ms / 2)  # the result back on the loop, the reply out
                session.replied_at = env.now
                yield env.timeout(one_way(frames.down(rows, len(committed))) + cfg.client_ms / 2e3)
                t = env.now
                stats.rounds.append(
                    RoundSample(t, 1e3 * (t - sent), server_ms, len(committed), rnd.rows, session.context)
                )
                result.server_ms.append(server_ms)
                stats.first_round_s.setdefault(i, t)
                session.context += len(committed)
                req.commit(committed)
                if session.allowance is not None:
                    req.allow(session.allowance)
                if req.finished():
                    break
            replica.open_sessions -= 1
            if finished:
                stats.requests_finished += 1
            else:
                stats.requests_truncated += 1

    procs = [env.process(device(i)) for i in range(cfg.devices)]
    end = cfg.duration_s + 120.0  # rounds in flight at the end complete, as in the load test
    t, rule = 0.0, replicas[0].rule
    while t < end and not all(p.triggered for p in procs):
        t = min(end, t + 1.0)
        if rule is not None and result.rule is None and t >= cfg.duration_s:
            if cfg.duration_s > env.now:
                env.run(until=cfg.duration_s)
            mean = result.round_sessions / result.forwards if result.forwards else None
            result.rule = rule.explain(mean)  # as the window left it, at the run's mean load (not the drain's)
        if t > env.now:
            env.run(until=t)
        if progress is not None and t <= cfg.duration_s:
            progress(t)
    stats.wall_s = cfg.duration_s
    return result


def summarize(mode: str, cfg: SimConfig, result: SimResult) -> dict:
    """One predicted row: `hycoc.bench.loadtest.report.summarize_run` of the simulated client's stats (the load test's
    own columns and window) plus ``busy_share`` (the busiest replica's worker share of the run), ``server_p90_ms``
    (p90 of arrival at the verifier -> reply, ms), ``rows_per_forward`` and ``sessions_per_forward``, and
    ``tok_per_s_per_device``, ``cpu_ms_per_round`` (the steps' CPU ms, before any load stretch, per answered
    round, prefills included), ``rows_sent_per_round``, ``bytes_up_per_round`` (the ROUND frames, `FrameBytes.up`),
    ``device_ms_per_round`` (the drafting before each round), ``allowance`` (mean, p10/p50/p90 of the allowances
    the replies carried to device sessions; None outside mode allowance), ``rule`` (`SimResult.rule`)."""
    from hycoc.bench.loadtest.report import percentile, summarize_run

    row = summarize_run(mode, cfg.devices, cfg.duration_s, result.stats)
    row["busy_share"] = max(result.busy_s) / cfg.duration_s
    row["server_p90_ms"] = percentile(result.server_ms, 90)
    row["rows_per_forward"] = result.rows / result.forwards if result.forwards else None
    row["sessions_per_forward"] = result.round_sessions / result.forwards if result.forwards else None
    row["rows_trimmed"] = result.trimmed
    row["cpu_ms_per_round"] = result.cpu_ms / len(result.stats.rounds) if result.stats.rounds else None
    row["tok_per_s_per_device"] = row["tok_per_s"] / cfg.devices
    row["replicas"] = cfg.replicas
    sent = [r.rows for r in result.stats.rounds]
    drafting = [d for d, _ in result.stats.device_waits_ms]
    row["rows_sent_per_round"] = float(np.mean(sent)) if sent else None
    row["bytes_up_per_round"] = float(np.mean([cfg.frames.up(r) for r in sent])) if sent else None
    row["device_ms_per_round"] = float(np.mean(drafting)) if drafting else None
    given = [a for a in result.allowances if a is not None]
    row["rule"] = result.rule
    row["allowance"] = (
        {"mean": float(np.mean(given)), **{f"p{q}": float(np.percentile(given, q)) for q in (10, 50, 90)}}
        if given
        else None
    )
    return row


__all__ = [
    "IDLE_GAP_MS",
    "MODES",
    "REPLAY_MODES",
    "cpu_slowdown",
    "SimConfig",
    "SimResult",
    "simulate",
    "summarize",
]
