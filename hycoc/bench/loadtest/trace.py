"""Recorded device rounds for `hycoc loadtest` (docs/serving.md "Load test: `hycoc loadtest`"): what a phone sent,
and when.

A load test of the verifier needs many devices but must not spend the machine's CPU on drafting (the client would
then compete with the server it measures). So the real device runtime (`hycoc.runtime.client.DeviceRuntime`, paper
Alg. 1-3) runs ONCE per configuration on a few Spec-Bench prompts against an in-process verifier, and every round is
recorded: the tree the device sent (tokens, parent rows) and the device's own time before sending it. Thousands of
simulated devices then replay those rounds (`hycoc.bench.loadtest.run`) with almost no client CPU.

What a round records (`RoundTrace`):

* ``tokens``: int32 (R,), the draft tree's rows as sent (row 0 the root x_{t+1}; docs/design.md "Wire protocol");
* ``parents``: int16-range ints (R,), parents[0] = -1, 0 <= parents[j] < j;
* ``scores``: floats (R,), each row's tree score s(v) of Alg. 3 as the device sent it (protocol version 4; the
  root's 0, no row above its parent), or None when the tree went without (a cloud-mtp root);
* ``device_ms``: the device's own time between the previous answer arriving and this tree leaving: commit, MTP
  Drafter on the hand-off, SLM pass(es), tree build (Alg. 1 lines 3-7), measured as the CPU time of the thread
  that drafts (``time.thread_time``; the graphs run on it with one onnxruntime thread), so a recording on a busy
  machine still gives the time a phone that has its cores to itself would take. Round 0's tree is drafted while
  the server prefills, so its time is the wall time the drafting outlasted the prefill (usually 0);
* ``device_wall_ms``: the same interval in wall-clock time (slower than ``device_ms`` when the recording
  machine was loaded).

Replaying a tree in another session: the tree's rows below the root depend on the recorded context only through
their token values, and the wire checks only the structure (parents point to earlier rows, ids inside the
vocabulary, row count), so `patch_root` replaces row 0 with the replaying session's actual root (the verifier
checks tokens[0] == root, `hycoc.verifier.errors.RootMismatch`) and the tree stays valid. Replayed against a server
of the same recipe with the same seed, a session commits exactly what the recording committed (the verifier is
deterministic per session); against any other it still exercises the same shapes and timing.

Storage: one JSON file per (recipe, bundle, configs, prompts, output cap), named by a hash of those
(`trace_key`), written atomically (temporary name + rename). numpy + stdlib only.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from hycoc.protocol.messages import MAX_DRAFT_MS, DraftTree, OpenRequest, RoundReply, Sampling

#: Bumped when the file layout or a field's meaning changes; an older file is re-recorded, never misread.
#: 2: device_ms is the drafting thread's CPU time (was wall time), device_wall_ms added.
#: 3: each round records the rows' scores (protocol version 4's ROUND), which a budgeted verifier ranks rows by.
#: 4: each round records what it committed (path rows, tokens), so a replay can follow the text by position.
#: 5: each round records head_ms, the MTP Drafter's share of device_ms (a replay under a small allowance skips the
#: SLM pass and waits that long only).
TRACE_SCHEMA = 5


class TraceError(ValueError):
    """A trace file that cannot be used (missing, not JSON, another schema, a bad field). The message names the
    file and field and says to delete it (it is re-recorded)."""


@dataclass(frozen=True)
class RoundTrace:
    """One recorded round (module docstring). tokens: row ids, len R >= 1; parents: len R, parents[0] == -1;
    device_ms: the device's time before sending it (drafting thread CPU), milliseconds >= 0; device_wall_ms: the
    same in wall-clock milliseconds; scores: len R, the rows' scores s(v) as sent, or None (none sent);
    path_rows: the reply's accepted path rows (root excluded); committed: the tokens the round committed (the path's
    tokens and the bonus, before any cut; cloud-mtp: the reply's first |P| + 1 samples); head_ms: the part of
    device_ms the MTP Drafter took (hand-off ingest and its K head steps, drafting thread CPU ms; 0 when none ran or
    it was not recorded): what a round drafted without the SLM pass costs the device (the allowance's floor)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    device_ms: float
    device_wall_ms: float = 0.0
    scores: tuple[float, ...] | None = None
    path_rows: tuple[int, ...] = ()
    committed: tuple[int, ...] = ()
    head_ms: float = 0.0

    def score_array(self) -> np.ndarray | None:
        """The scores as the DraftTree that replays this round carries them: float32 (R,), or None."""
        return None if self.scores is None else np.asarray(self.scores, np.float32)


@dataclass(frozen=True)
class RequestTrace:
    """One recorded request: the OPEN's fields, the rounds in order, and what the recording committed.

    config: the `hycoc.runtime.client.MODES` name it ran as. prompt: token ids (the chat-formatted Spec-Bench
    turn). temperature / top_k / top_p / seed / acceptance / epsilon / draft_place / max_new_tokens: the OPEN's
    fields (`hycoc.protocol.messages.OpenRequest`). question_id: the Spec-Bench row. committed: output tokens the
    recording committed (a replay on the same server commits the same). finish_reason: the recording's.
    """

    config: str
    question_id: int
    prompt: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    acceptance: str
    epsilon: float
    draft_place: str
    max_new_tokens: int
    rounds: tuple[RoundTrace, ...]
    committed: int = 0
    finish_reason: str | None = None

    def open_request(self) -> OpenRequest:
        """The OPEN frame's message that replays this request."""
        return OpenRequest(
            prompt_ids=np.asarray(self.prompt, np.int32),
            sampling=Sampling(self.temperature, self.top_k, self.top_p),
            seed=self.seed,
            acceptance=self.acceptance,
            epsilon=self.epsilon,
            draft_place=self.draft_place,
            max_new_tokens=self.max_new_tokens,
            draft_ms_floor=self.drafting_ms()[0],
            draft_ms_tree=self.drafting_ms()[1],
        )

    def drafting_ms(self) -> tuple[float, float]:
        """What a replaying device reports in its OPEN (protocol 6): the recorded drafting ms per round without
        the SLM pass (the mean head_ms) and with it (the mean device_ms), over the rounds after the first (the
        first tree is SLM-only while the server prefills); 0.0 where none was recorded (cloud-mtp: both 0)."""
        later = [rt for rt in self.rounds[1:] if len(rt.tokens) > 1]
        heads = [rt.head_ms for rt in later if rt.head_ms > 0]
        floor = float(np.mean(heads)) if heads else 0.0
        tree = float(np.mean([rt.device_ms for rt in later])) if later else 0.0
        return min(floor, MAX_DRAFT_MS), min(tree, MAX_DRAFT_MS)


@dataclass(frozen=True)
class Trace:
    """Recorded requests of one recipe and bundle.

    key: `trace_key` of what was recorded. stop_ids: ids that end a turn (the device's commit rule,
    `hycoc.protocol.messages.commit_cut`). requests: every recorded request, configurations in the order asked.
    meta: free-form provenance (recipe, bundle, date, machine).
    """

    key: str
    stop_ids: tuple[int, ...]
    requests: tuple[RequestTrace, ...]
    meta: dict = field(default_factory=dict)

    def for_config(self, config: str) -> list[RequestTrace]:
        """The requests recorded for ``config``; raises TraceError when there are none."""
        out = [r for r in self.requests if r.config == config]
        if not out:
            have = sorted({r.config for r in self.requests})
            raise TraceError(
                f"the trace {self.key} has no requests of config {config!r} (it has {', '.join(have)});"
                " record it with that config in --configs"
            )
        return out


def patch_root(tokens, root: int) -> np.ndarray:
    """A recorded tree's tokens with row 0 replaced by ``root`` (the replaying session's last committed token).

    tokens: int (R,), R >= 1. Returns a new int32 (R,) array; the input is not changed. Parents stay as recorded,
    so every wire check on the tree's structure holds as it did when recorded (module docstring)."""
    out = np.array(tokens, dtype=np.int32, copy=True)
    if out.ndim != 1 or len(out) == 0:
        raise ValueError(f"tokens: expected a non-empty 1-D array of token ids, got shape {out.shape}")
    out[0] = int(root)
    return out


def tree_at(req: RequestTrace, produced: list[int], seq: int = 0):
    """The recorded tree a replaying device sends after committing ``produced`` (output tokens so far), found by
    position rather than by round, so a replay whose rounds commit fewer tokens than the recording's (a budgeted
    verifier that trimmed the tree) still sends a tree drafted for its text.

    The recording's rounds cover the output end to end: round k starts at output position s_k and committed
    ``committed_k``. At position q = len(produced), s_k <= q < s_k+1, with d = q - s_k tokens of round k already
    committed, the tree is round k's own (d = 0) or its sub-tree under the path row at depth d, re-rooted there:
    those rows, parents renumbered, scores minus the new root's, padded back to R rows by repeating the last row
    (Alg. 3 line 17's padding) -- what the recorded device had drafted below that point, a smaller tree than a
    device drafting afresh would send (so the replay understates a trimmed session's next round). cloud-mtp trees
    (the root alone) are position-free.

    Returns (RoundTrace of round k, tokens int32 (R,) with row 0 still the recorded token, parents int32 (R,),
    scores float32 (R,) or None), or None when the recording is exhausted (q >= its output) or ``produced`` left
    the recorded text (a replay at T > 0 whose samples differ: the trees then do not fit the text). Rounds made
    without their commits recorded (``committed`` empty: hand-made traces) replay by round: the ``seq``-th."""
    if any(not rt.committed for rt in req.rounds):
        if seq >= len(req.rounds):
            return None
        rt = req.rounds[seq]
        return rt, np.asarray(rt.tokens, np.int32), np.asarray(rt.parents, np.int32), rt.score_array()
    start = 0
    for rt in req.rounds:
        n = len(rt.committed)
        if start + n > len(produced):
            d = len(produced) - start
            if list(rt.committed[:d]) != list(produced[start:]):
                return None
            tokens = np.asarray(rt.tokens, np.int32)
            parents = np.asarray(rt.parents, np.int64)
            scores = rt.score_array()
            if d == 0 or len(tokens) == 1:
                return rt, tokens, parents.astype(np.int32), scores
            node = rt.path_rows[d - 1]
            inside = np.zeros(len(tokens), bool)
            inside[node] = True
            for j in range(node + 1, len(tokens)):
                inside[j] = inside[parents[j]]
            rows = np.nonzero(inside)[0]
            index = np.full(len(tokens), -1, np.int64)
            index[rows] = np.arange(len(rows))
            sub_parents = np.where(rows == node, -1, index[parents[rows]])
            pad = len(tokens) - len(rows)
            sub_tokens = np.concatenate([tokens[rows], np.repeat(tokens[rows[-1:]], pad)])
            sub_parents = np.concatenate([sub_parents, np.repeat(sub_parents[-1:], pad)]).astype(np.int32)
            if len(rows) == 1:  # a leaf: the root alone, padding repeats the root as its own child
                sub_parents[1:] = 0
            sub_scores = None
            if scores is not None:
                base = scores[rows] - scores[node]
                sub_scores = np.concatenate([base, np.repeat(base[-1:], pad)]).astype(np.float32)
                if len(rows) == 1:  # the padding rows are no drafts: scored as never accepted
                    sub_scores[1:] = -20.0
            return rt, sub_tokens, sub_parents, sub_scores
        if list(rt.committed) != list(produced[start : start + n]):
            return None
        start += n
    return None


def trim_to_allowance(tokens: np.ndarray, parents: np.ndarray, scores: np.ndarray | None, rows: int):
    """A recorded tree as a device under an allowance of ``rows`` rows drafts it (Alg. 3 line 16 with rows - 1
    nodes in place of B): the root and the rows - 1 best-scored rows (scores made non-increasing from parent to
    child, ties to the earlier row, so the kept rows are ancestor-closed), in their recorded order, parents
    renumbered. Trees of at most ``rows`` rows come back as they are; trees without scores are cut to their first
    ``rows`` rows (Alg. 3's insertion order makes them ancestor-closed). Returns (tokens int32, parents int32,
    scores float32 or None), each of min(R, rows) rows.

    Hand-worked: tokens [5, 6, 7, 8], parents [-1, 0, 0, 1], scores [0, -0.4, -1.0, -0.9], rows 3 -> rows 0, 1, 3
    (scores 0, -0.4, -0.9): tokens [5, 6, 8], parents [-1, 0, 1]."""
    tokens = np.asarray(tokens, np.int32)
    parents = np.asarray(parents, np.int64)
    if rows >= len(tokens):
        return tokens, parents.astype(np.int32), scores
    if scores is None:
        keep = np.arange(rows)
    else:
        s = np.asarray(scores, np.float64).copy()
        for j in range(1, len(s)):
            s[j] = min(s[j], s[parents[j]])
        order = np.lexsort((np.arange(1, len(s)), -s[1:])) + 1  # non-root rows, best first, ties to the earlier
        keep = np.sort(np.concatenate([[0], order[: rows - 1]]))
    index = np.full(len(tokens), -1, np.int64)
    index[keep] = np.arange(len(keep))
    new_parents = np.where(parents[keep] < 0, -1, index[np.maximum(parents[keep], 0)])
    kept_scores = None if scores is None else np.asarray(scores, np.float32)[keep]
    return tokens[keep], new_parents.astype(np.int32), kept_scores


def trace_key(
    recipe_hash: str, bundle_hash: str, configs, question_ids, output_cap: int, temperature: float | None = None
) -> str:
    """16 hex digits of sha256 over what a recording depends on: the recipe's content hash, the bundle manifest's
    sha256, the configurations, the Spec-Bench question ids, the output cap (tokens) and the sampling temperature
    when it is not the recipe's (None)."""
    parts = [TRACE_SCHEMA, recipe_hash, bundle_hash, list(configs), [int(q) for q in question_ids], int(output_cap)]
    if temperature is not None:
        parts.append(float(temperature))
    text = json.dumps(parts)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as JSON to ``path`` atomically (temporary name in the same folder, then rename), creating
    the folder. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"schema": TRACE_SCHEMA, **asdict(trace)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, separators=(",", ":")), encoding="utf-8")
    os.replace(tmp, path)
    return path


def load_trace(path: str | Path) -> Trace:
    """Read a trace written by `save_trace`. Raises TraceError naming the file and the bad field."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise TraceError(f"{path}: not a readable JSON trace ({e}); delete it to re-record") from None
    if not isinstance(data, dict) or data.get("schema") != TRACE_SCHEMA:
        raise TraceError(
            f"{path}: schema {data.get('schema') if isinstance(data, dict) else None!r}, this hycoc "
            f"reads {TRACE_SCHEMA}; delete it to re-record"
        )
    try:
        requests = []
        for i, r in enumerate(data["requests"]):
            rounds = tuple(
                RoundTrace(
                    tuple(int(x) for x in rt["tokens"]),
                    tuple(int(x) for x in rt["parents"]),
                    float(rt["device_ms"]),
                    float(rt["device_wall_ms"]),
                    None if rt["scores"] is None else tuple(float(x) for x in rt["scores"]),
                    tuple(int(x) for x in rt["path_rows"]),
                    tuple(int(x) for x in rt["committed"]),
                    float(rt["head_ms"]),
                )
                for rt in r["rounds"]
            )
            for j, rt in enumerate(rounds):
                if (
                    len(rt.tokens) != len(rt.parents)
                    or not rt.tokens
                    or rt.parents[0] != -1
                    or rt.device_ms < 0
                    or (rt.scores is not None and len(rt.scores) != len(rt.tokens))
                ):
                    raise TraceError(
                        f"{path}: requests[{i}].rounds[{j}]: tokens, parents and scores (when recorded) "
                        "must have one entry per row, parents[0] = -1 and device_ms >= 0; delete the "
                        "file to re-record"
                    )
            requests.append(RequestTrace(**{**r, "prompt": tuple(int(x) for x in r["prompt"]), "rounds": rounds}))
        return Trace(
            key=str(data["key"]),
            stop_ids=tuple(int(x) for x in data["stop_ids"]),
            requests=tuple(requests),
            meta=dict(data.get("meta") or {}),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(
            f"{path}: a field is missing or malformed ({type(e).__name__}: {e}); delete it to re-record"
        ) from None


class RecordingClient:
    """A `hycoc.runtime.transport.VerifierClient` that records what the device sends: every `round`'s tree (its
    rows' scores included) and the
    device time before it (module docstring: CPU time of the thread calling `round`, which must be the drafting
    thread, as in `DeviceRuntime.generate`). Everything else is the wrapped client's.

    client: an unopened VerifierClient. head_cpu_ms: a callable giving the MTP Drafter's cumulative CPU ms
    (`hycoc.runtime.mtp_drafter.MtpDrafter.cpu_ms`), whose change over each round is its ``head_ms`` (None: 0).
    After a request, ``request`` is its OpenRequest and ``rounds`` its `RoundTrace` list; ``replies`` are the
    RoundReplies received (to count what was committed)."""

    def __init__(self, client, head_cpu_ms=None):
        self._client = client
        self._head_cpu_ms = head_cpu_ms
        self._head_since = head_cpu_ms() if head_cpu_ms is not None else 0.0
        self.request: OpenRequest | None = None
        self.rounds: list[RoundTrace] = []
        self.replies: list[RoundReply] = []
        self._since = time.perf_counter()
        self._cpu_since: float | None = None

    def __getattr__(self, name):
        return getattr(self._client, name)

    def open(self, request: OpenRequest):
        self.request, self.rounds, self.replies = request, [], []
        opened = self._client.open(request)
        self._since, self._cpu_since = time.perf_counter(), None
        return opened

    def round(self, tree: DraftTree) -> RoundReply:
        wall_ms = 1000.0 * (time.perf_counter() - self._since)
        # round 0: the wall time the first tree's drafting outlasted the OPEN (which ran on another thread)
        device_ms = wall_ms if self._cpu_since is None else 1000.0 * (time.thread_time() - self._cpu_since)
        head_now = self._head_cpu_ms() if self._head_cpu_ms is not None else 0.0
        head_ms, self._head_since = head_now - self._head_since, head_now
        reply = self._client.round(tree)
        self._since, self._cpu_since = time.perf_counter(), time.thread_time()
        scores = None if tree.scores is None else tuple(float(x) for x in np.asarray(tree.scores, np.float32))
        path = tuple(int(x) for x in reply.path_rows)
        if len(tree.tokens) == 1 and len(reply.samples) > 1:  # cloud-mtp: the verifier's own chain
            committed = tuple(int(x) for x in reply.samples[: len(path) + 1])
        else:
            committed = tuple(int(tree.tokens[j]) for j in path) + (int(reply.bonus),)
        self.rounds.append(
            RoundTrace(
                tuple(int(x) for x in tree.tokens),
                tuple(int(x) for x in tree.parents),
                device_ms,
                wall_ms,
                scores,
                path,
                committed,
                head_ms,
            )
        )
        self.replies.append(reply)
        return reply

    def close(self) -> None:
        self._client.close()


def request_trace(
    config: str,
    question_id: int,
    request: OpenRequest,
    rounds: list[RoundTrace],
    committed: int,
    finish_reason: str | None,
) -> RequestTrace:
    """A `RequestTrace` from a recorded OPEN and its rounds (`RecordingClient`)."""
    s = request.sampling
    return RequestTrace(
        config=config,
        question_id=int(question_id),
        prompt=tuple(int(x) for x in request.prompt_ids),
        temperature=float(s.temperature),
        top_k=int(s.top_k),
        top_p=float(s.top_p),
        seed=int(request.seed),
        acceptance=request.acceptance,
        epsilon=float(request.epsilon),
        draft_place=request.draft_place,
        max_new_tokens=int(request.max_new_tokens),
        rounds=tuple(rounds),
        committed=int(committed),
        finish_reason=finish_reason,
    )


def record_trace(
    recipe,
    bundle_dir: Path,
    configs: list[str],
    questions,
    output_cap: int,
    *,
    key: str,
    threads: int = 1,
    progress=None,
    temperature: float | None = None,
) -> Trace:
    """Run the real device runtime (`hycoc.runtime.client.load_runtime` on the bundle's cpu graphs) for every
    config and question's first turn against an in-process verifier of ``recipe``
    (`hycoc.verifier.server.ServerThread`), recording every round (`RecordingClient`).

    questions: `hycoc.bench.datasets.Question` list. output_cap: max_new_tokens per request. progress: called
    after each request with a short description (None: silent). Sampling and epsilon are the recipe's (temperature:
    this one instead, e.g. 0 for a replay that must follow the recorded text), the seed the bundle's (as `hycoc
    bench`). Raises what loading the models or the bundle raises, TransportError."""
    import torch

    from hycoc.bundle import sha256_file
    from hycoc.models import set_threads
    from hycoc.runtime.client import load_runtime
    from hycoc.runtime.transport import VerifierClient
    from hycoc.verifier.loading import engine_from_recipe, server_options
    from hycoc.verifier.server import ServerThread

    set_threads(recipe.verifier.threads)
    keep = np.load(Path(bundle_dir) / "keep_set.npy", allow_pickle=False)
    engine = engine_from_recipe(recipe, keep_set=torch.as_tensor(keep, dtype=torch.long))
    rt = load_runtime(bundle_dir, "cpu", threads=threads)
    sampling = recipe.sampling.distribution
    if temperature is not None:
        sampling = replace(sampling, temperature=float(temperature))
    requests = []
    try:
        # whole trees every round (a recording holds what the device drafts unconstrained; replays trim them)
        with ServerThread(engine, **server_options(recipe, allowance="fixed")) as srv:
            url = srv.url
            if url is None:  # never: entering the block started it listening
                raise RuntimeError("the verifier server thread is not listening")
            for config in configs:
                for q in questions:
                    client = RecordingClient(VerifierClient(url, timeout_s=600), lambda: rt.mtp.cpu_ms)
                    prompt = rt.bundle.chat.prompt(q.turns[0])
                    res = rt.generate(
                        client,
                        prompt,
                        mode=config,
                        max_new_tokens=output_cap,
                        sampling=sampling,
                        epsilon=recipe.acceptance.epsilon,
                    )
                    if client.request is None:  # never: generate opens the session first
                        raise RuntimeError(f"{config} question {q.question_id}: the request opened no session")
                    requests.append(
                        request_trace(
                            config, q.question_id, client.request, client.rounds, len(res.tokens), res.finish_reason
                        )
                    )
                    if progress is not None:
                        progress(f"{config} q{q.question_id}: {res.rounds} rounds, {len(res.tokens)} tokens")
    finally:
        engine.close()
    meta = {
        "recipe": recipe.recipe.name,
        "recipe_sha256": recipe.content_hash(),
        "bundle": str(bundle_dir),
        "bundle_manifest_sha256": sha256_file(Path(bundle_dir) / "manifest.json"),
        "output_cap": int(output_cap),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    return Trace(key=key, stop_ids=tuple(sorted(rt.bundle.stop_token_ids())), requests=tuple(requests), meta=meta)


__all__ = [
    "TRACE_SCHEMA",
    "RecordingClient",
    "RequestTrace",
    "RoundTrace",
    "Trace",
    "TraceError",
    "load_trace",
    "patch_root",
    "record_trace",
    "request_trace",
    "save_trace",
    "trace_key",
    "tree_at",
    "trim_to_allowance",
]
