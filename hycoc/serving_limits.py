"""The verifier server's limits and batching knobs as data: the one table that the recipe's ``[verifier]`` section
(`hycoc.recipe.Verifier`), the library server (`hycoc.verifier.server.ServerLimits`, `VerifierServer`'s keywords,
`hycoc.protocol.wire.DEFAULT_MAX_FRAME_BYTES`), ``hycoc verify-server --help`` / ``hycoc serve-ray --help`` and the
table in docs/serving.md "Limits" read (`tests/test_serving_limits.py` compares all of them with this table).

Each `Limit` is one row: its knob (the recipe's ``[verifier]`` key, the `ServerLimits` field or `VerifierServer`
keyword of the same name), its default and unit, the range the recipe accepts, what it bounds, what a client gets
when it is exceeded (the error code) and the /metrics series that counts it (``hycoc_refusals_total{kind=...}``,
kind = the knob without ``_s``). Torch-free and stdlib-only: core, imported by the protocol and the recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30


@dataclass(frozen=True)
class Limit:
    """One limit of the verifier server.

    knob: the recipe's ``[verifier]`` key (and the library's keyword). default: its value in ``unit`` ("s",
    "ms", "bytes", "count", "rows", "per minute"). ge / gt / le: the range the recipe accepts (None: no such
    bound). bounds: what the limit bounds (docs/serving.md's first column). refusal: what a client gets beyond it
    (its error code, or "-"). metric: the /metrics series that counts it ("-": none). description: the recipe
    field's one-line description (`hycoc.recipe`), which also heads the --help line. note: what docs/serving.md adds
    after the default ("" for nothing).
    """

    knob: str
    default: int | float
    unit: str
    le: int | float
    bounds: str
    refusal: str
    metric: str
    description: str
    ge: int | float | None = None
    gt: int | float | None = None
    note: str = ""

    @property
    def refusal_kind(self) -> str | None:
        """The ``kind`` label of ``hycoc_refusals_total`` that counts this limit's refusals (the knob without
        ``_s``), None for a limit not counted there."""
        return self.knob.removesuffix("_s") if self.metric.startswith('`kind="') else None

    @property
    def shown(self) -> str:
        """The default as a person reads it: "10 s", "8 GiB", "256", "10 / minute", "2 ms"."""
        v = self.default
        if self.unit == "bytes":
            for size, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
                if v >= size and v % size == 0:
                    return f"{v // size} {name}"
            return f"{v} bytes"
        if self.unit in ("s", "ms"):
            return f"{v:g} {self.unit}"
        if self.unit == "per minute":
            return f"{v:g} / minute"
        return f"{v:g}"


#: Every limit, in the order of docs/serving.md's table.
LIMITS: tuple[Limit, ...] = (
    Limit(
        "handshake_timeout_s",
        10.0,
        "s",
        gt=0,
        le=3600,
        bounds="TCP connect -> first frame (OPEN)",
        refusal="ERROR `handshake_timeout` (or the TCP connection closed)",
        metric='`kind="handshake_timeout"`',
        description="seconds from TCP connect to a WebSocket's first frame (OPEN); slower connections (silent TCP, "
        "trickled headers) are closed",
    ),
    Limit(
        "frame_timeout_s",
        30.0,
        "s",
        gt=0,
        le=3600,
        bounds="a frame once begun (not applied behind `serve-ray`)",
        refusal="ERROR `frame_timeout`, close",
        metric='`kind="frame_timeout"`',
        description="seconds a frame may take to arrive once its first bytes came",
    ),
    Limit(
        "idle_timeout_s",
        300.0,
        "s",
        gt=0,
        le=86400,
        bounds="idle open session",
        refusal="KV freed, ERROR `idle_timeout`, close",
        metric='`kind="idle_timeout"`',
        description="seconds an open session may go without a frame; then its KV is freed and the client gets "
        "ERROR idle_timeout",
    ),
    Limit(
        "max_connections",
        256,
        "count",
        ge=1,
        le=65536,
        bounds="connections",
        refusal="HTTP 503 + `Retry-After`",
        metric='`kind="max_connections"`, gauge `hycoc_connections_active`',
        description="TCP connections at once (HTTP and WebSocket); more get HTTP 503 with Retry-After",
    ),
    Limit(
        "max_sessions",
        64,
        "count",
        ge=1,
        le=65536,
        bounds="open sessions",
        refusal='ERROR `too_many_sessions` ("retry after N s")',
        metric='`kind="max_sessions"`',
        description="open sessions at once; an OPEN over it gets ERROR too_many_sessions",
    ),
    Limit(
        "max_kv_bytes",
        8 * GIB,
        "bytes",
        ge=1 * MIB,
        le=1 << 50,
        bounds="KV reserved",
        refusal="ERROR `kv_budget_exhausted`",
        metric='`kind="max_kv_bytes"`, gauge `hycoc_kv_bytes_reserved`',
        description="verifier KV bytes all sessions may reserve (prompt + output cap, up to max_context, per "
        "session); an OPEN over it gets ERROR kv_budget_exhausted",
    ),
    Limit(
        "auth_failures_per_minute",
        10,
        "per minute",
        ge=1,
        le=100000,
        bounds="refused auth per peer",
        refusal="HTTP 429 + `Retry-After`, ERROR `auth_rate_limited`",
        metric='`kind="auth_failures_per_minute"`',
        description="refused auth attempts per peer address and minute; more get ERROR auth_rate_limited (HTTP 429 "
        "at the upgrade)",
    ),
    Limit(
        "max_frame_bytes",
        8 * MIB,
        "bytes",
        ge=4 * KIB,
        le=1 * GIB,
        bounds="frame size",
        refusal="ERROR `frame_too_large`",
        metric='`hycoc_errors_total{kind="frame_too_large"}`',
        description="largest accepted wire frame, in bytes; the first hand-off of a 1,024-token window is at most "
        "6.3 MB",
        note="incoming also <= the largest OPEN",
    ),
    Limit(
        "retry_after_s",
        5.0,
        "s",
        gt=0,
        le=3600,
        bounds="retry hint",
        refusal="-",
        metric="-",
        description="the retry hint, in seconds, sent with refusals for max_connections, max_sessions and max_kv_bytes",
    ),
    Limit(
        "max_batch_rows",
        528,
        "rows",
        ge=1,
        le=1_048_576,
        bounds="rows per batched forward",
        refusal="(a round waits for the next forward)",
        metric="histogram `hycoc_batch_rows`",
        description="most tree rows per batched forward (16 trees of 33 rows); a single larger round still runs alone",
    ),
    Limit(
        "max_batch_wait_ms",
        2.0,
        "ms",
        ge=0,
        le=10_000,
        bounds="wait for a batch to fill",
        refusal="-",
        metric="histogram `hycoc_queue_wait_seconds`",
        description="milliseconds a round waits for other sessions' rounds to join its forward (never when every "
        "open session has one queued)",
    ),
    Limit(
        "max_prefills",
        1,
        "count",
        ge=1,
        le=4096,
        bounds="sessions prefilling at once (OPEN, APPEND)",
        refusal="(a prefill waits for one to finish)",
        metric="gauge `hycoc_prefills_active`",
        description="sessions whose prefill (OPEN's prompt, APPEND's turn) is under way at once; the KV budget "
        "reserves a prefilling session's chunk rows and undo copy once per such slot",
    ),
)
#: The ``kind`` labels of ``hycoc_refusals_total`` (`Limit.refusal_kind`), in table order.
REFUSAL_KINDS: tuple[str, ...] = tuple(lim.refusal_kind for lim in LIMITS if lim.refusal_kind)
#: knob -> `Limit`.
BY_KNOB: dict[str, Limit] = {lim.knob: lim for lim in LIMITS}
#: The knobs of `hycoc.verifier.server.ServerLimits` (the timeouts, capacity ledgers and the retry hint).
SERVER_LIMIT_KNOBS: tuple[str, ...] = (
    "handshake_timeout_s",
    "frame_timeout_s",
    "idle_timeout_s",
    "max_connections",
    "max_sessions",
    "max_kv_bytes",
    "auth_failures_per_minute",
    "retry_after_s",
)


def default(knob: str) -> int | float:
    """The default of ``knob`` (a `LIMITS` knob). Raises KeyError naming the knobs for another."""
    try:
        return BY_KNOB[knob].default
    except KeyError:
        raise KeyError(f"no server limit {knob!r}; the limits are {', '.join(BY_KNOB)}") from None


#: The wire's default frame bound (`hycoc.protocol.wire.DEFAULT_MAX_FRAME_BYTES`), for servers and clients.
DEFAULT_MAX_FRAME_BYTES: int = int(default("max_frame_bytes"))
#: The batching defaults (`hycoc.verifier.server.worker`).
DEFAULT_MAX_BATCH_ROWS: int = int(default("max_batch_rows"))
DEFAULT_MAX_BATCH_WAIT_MS: float = float(default("max_batch_wait_ms"))
#: The bound on concurrent prefills (`hycoc.verifier.scheduler.BatchScheduler`).
DEFAULT_MAX_PREFILLS: int = int(default("max_prefills"))


def help_text() -> str:
    """The limits as the server commands' --help ends them: a heading, then one line per limit, "knob = default
    what it bounds" without its parenthesis, under 80 columns (click prints a paragraph that starts with ``\\b`` as
    written, unwrapped)."""
    width = max(len(f"{lim.knob} = {lim.shown}") for lim in LIMITS)
    lines = [f"  {f'{lim.knob} = {lim.shown}':<{width}}  {lim.bounds.split(' (')[0]}" for lim in LIMITS]
    head = "Server limits (the recipe's [verifier] keys, defaults; docs/serving.md):"
    return "\b\n" + head + "\n" + "\n".join(lines)


def docs_rows() -> list[str]:
    """The rows of docs/serving.md's "Limits" table for these limits, as markdown: | bounds | default | `knob` |
    refusal | metric |."""
    rows = []
    for lim in LIMITS:
        shown = f"{lim.shown}; {lim.note}" if lim.note else lim.shown
        rows.append(f"| {lim.bounds} | {shown} | `{lim.knob}` | {lim.refusal} | {lim.metric} |")
    return rows


#: The verification modes (recipe ``verifier.batching``, ``hycoc verify-server --batching``): batched, rounds of
#: sessions ready together share one forward; serial, one engine call at a time.
BATCHING_MODES: tuple[str, ...] = ("batched", "serial")
#: The row budget's modes (recipe ``verifier.tree_budget``, ``--tree-budget``; `hycoc.verifier.row_budget`): fixed
#: verifies every tree as sent, auto allocates a batched forward's rows across its trees by their scores.
TREE_BUDGETS: tuple[str, ...] = ("fixed", "auto")
#: The tree allowance's modes (recipe ``verifier.allowance``, ``--allowance``; `hycoc.verifier.allowance`): fixed
#: grants every session the whole tree (B + 1 rows) each round, auto sizes it from the load.
ALLOWANCE_MODES: tuple[str, ...] = ("fixed", "auto")


def server_modes(
    recipe_modes: tuple[str, str, str],
    *,
    batching: str | None = None,
    tree_budget: str | None = None,
    allowance: str | None = None,
) -> dict[str, str]:
    """The server's ``batching``, ``tree_budget`` and ``allowance`` from the recipe's (``recipe_modes``: its
    ``[verifier]`` batching, tree_budget, allowance) and the command line's (each, when not None, replaces the
    recipe's). Serial verification has no shared forward for a budget or an allowance to act on: the recipe's
    tree_budget and allowance then become "fixed", and "auto" asked for with it is an error.

    The one check of these options: ``hycoc verify-server`` runs it before it imports torch, and
    `hycoc.verifier.loading.server_options` runs it for the library. Raises ValueError naming the option, the
    value and what is allowed (``--batching 'fast': allowed: batched, serial``)."""
    given = {"--batching": batching, "--tree-budget": tree_budget, "--allowance": allowance}
    for (option, value), allowed in zip(given.items(), (BATCHING_MODES, TREE_BUDGETS, ALLOWANCE_MODES)):
        if value is not None and value not in allowed:
            raise ValueError(f"{option} {value!r}: allowed: {', '.join(allowed)}")
    mode = batching if batching is not None else recipe_modes[0]
    if mode != "batched" and tree_budget == "auto":
        raise ValueError(
            "--tree-budget auto allocates rows across a batched forward: use it with --batching "
            'batched (or verifier.batching = "batched")'
        )
    if mode != "batched" and allowance == "auto":
        raise ValueError(
            "--allowance auto sizes trees by the load of batched forwards: use it with --batching batched (or "
            'verifier.batching = "batched")'
        )
    recipe_budget, recipe_allowance = recipe_modes[1:] if mode == "batched" else ("fixed", "fixed")
    return {
        "batching": mode,
        "tree_budget": tree_budget if tree_budget is not None else recipe_budget,
        "allowance": allowance if allowance is not None else recipe_allowance,
    }


__all__ = [
    "ALLOWANCE_MODES",
    "BATCHING_MODES",
    "BY_KNOB",
    "DEFAULT_MAX_BATCH_ROWS",
    "DEFAULT_MAX_BATCH_WAIT_MS",
    "DEFAULT_MAX_FRAME_BYTES",
    "DEFAULT_MAX_PREFILLS",
    "LIMITS",
    "REFUSAL_KINDS",
    "SERVER_LIMIT_KNOBS",
    "TREE_BUDGETS",
    "Limit",
    "default",
    "docs_rows",
    "help_text",
    "server_modes",
]


#: The verifier's batching modes as a load test and `hycoc capacity` name them, with the ``hycoc verify-server``
#: arguments of each: the one list (`hycoc.bench.loadtest.run.MODE_ARGS`, `hycoc loadtest --batching`, `hycoc capacity
#: --batching` derive from it). serial: one session per forward; batched: sessions' trees in one forward, every tree
#: verified as sent; budgeted: batched, rows chosen across the trees by their scores (`hycoc.verifier.row_budget`);
#: allowance: budgeted, and each reply sizes the session's next tree from the load (`hycoc.verifier.allowance`).
SERVER_MODES: dict[str, tuple[str, ...]] = {
    "serial": ("--batching", "serial"),
    "batched": ("--batching", "batched", "--tree-budget", "fixed", "--allowance", "fixed"),
    "budgeted": ("--batching", "batched", "--tree-budget", "auto", "--allowance", "fixed"),
    "allowance": ("--batching", "batched", "--tree-budget", "auto", "--allowance", "auto"),
}
#: Modes whose server trims or sizes trees by their scores: their replays run at temperature 0 (only greedy text
#: stays the recording's, so the recorded trees still fit).
SCORED_MODES = ("budgeted", "allowance")
