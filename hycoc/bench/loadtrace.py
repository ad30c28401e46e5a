"""Recorded device rounds for `hycoc loadtest` (issue 14, "A load test"): what a phone sent, and when.

A load test of the verifier needs many devices but must not spend the machine's CPU on drafting (the client would
then compete with the server it measures). So the real device runtime (`hycoc.runtime.client.DeviceRuntime`, paper
Alg. 1-3) runs ONCE per configuration on a few Spec-Bench prompts against an in-process verifier, and every round is
recorded: the tree the device sent (tokens, parent rows) and the device's own time before sending it. Thousands of
simulated devices then replay those rounds (`hycoc.bench.loadtest`) with almost no client CPU.

What a round records (`RoundTrace`):

* ``tokens``: int32 (R,), the draft tree's rows as sent (row 0 the root x_{t+1}; DESIGN.md "Wire protocol");
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from hycoc.protocol.messages import DraftTree, OpenRequest, RoundReply, Sampling

#: Bumped when the file layout or a field's meaning changes; an older file is re-recorded, never misread.
#: 2: device_ms is the drafting thread's CPU time (was wall time), device_wall_ms added.
#: 3: each round records the rows' scores (protocol version 4's ROUND), which a budgeted verifier ranks rows by.
TRACE_SCHEMA = 3


class TraceError(ValueError):
    """A trace file that cannot be used (missing, not JSON, another schema, a bad field). The message names the
    file and field and says to delete it (it is re-recorded)."""


@dataclass(frozen=True)
class RoundTrace:
    """One recorded round (module docstring). tokens: row ids, len R >= 1; parents: len R, parents[0] == -1;
    device_ms: the device's time before sending it (drafting thread CPU), milliseconds >= 0; device_wall_ms: the
    same in wall-clock milliseconds; scores: len R, the rows' scores s(v) as sent, or None (none sent)."""

    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    device_ms: float
    device_wall_ms: float = 0.0
    scores: tuple[float, ...] | None = None

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
        return OpenRequest(prompt_ids=np.asarray(self.prompt, np.int32),
                           sampling=Sampling(self.temperature, self.top_k, self.top_p), seed=self.seed,
                           acceptance=self.acceptance, epsilon=self.epsilon, draft_place=self.draft_place,
                           max_new_tokens=self.max_new_tokens)


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
            raise TraceError(f"the trace {self.key} has no requests of config {config!r} (it has {', '.join(have)});"
                             " record it with that config in --configs")
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


def trace_key(recipe_hash: str, bundle_hash: str, configs, question_ids, output_cap: int) -> str:
    """16 hex digits of sha256 over what a recording depends on: the recipe's content hash, the bundle manifest's
    sha256, the configurations, the Spec-Bench question ids and the output cap (tokens)."""
    text = json.dumps([TRACE_SCHEMA, recipe_hash, bundle_hash, list(configs), [int(q) for q in question_ids],
                       int(output_cap)])
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
        raise TraceError(f"{path}: schema {data.get('schema') if isinstance(data, dict) else None!r}, this hycoc "
                         f"reads {TRACE_SCHEMA}; delete it to re-record")
    try:
        requests = []
        for i, r in enumerate(data["requests"]):
            rounds = tuple(RoundTrace(tuple(int(x) for x in rt["tokens"]), tuple(int(x) for x in rt["parents"]),
                                      float(rt["device_ms"]), float(rt["device_wall_ms"]),
                                      None if rt["scores"] is None else tuple(float(x) for x in rt["scores"]))
                           for rt in r["rounds"])
            for j, rt in enumerate(rounds):
                if (len(rt.tokens) != len(rt.parents) or not rt.tokens or rt.parents[0] != -1 or rt.device_ms < 0
                        or (rt.scores is not None and len(rt.scores) != len(rt.tokens))):
                    raise TraceError(f"{path}: requests[{i}].rounds[{j}]: tokens, parents and scores (when recorded) "
                                     "must have one entry per row, parents[0] = -1 and device_ms >= 0; delete the "
                                     "file to re-record")
            requests.append(RequestTrace(**{**r, "prompt": tuple(int(x) for x in r["prompt"]), "rounds": rounds}))
        return Trace(key=str(data["key"]), stop_ids=tuple(int(x) for x in data["stop_ids"]),
                     requests=tuple(requests), meta=dict(data.get("meta") or {}))
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, TraceError):
            raise
        raise TraceError(f"{path}: a field is missing or malformed ({type(e).__name__}: {e}); delete it to "
                         "re-record") from None


class RecordingClient:
    """A `hycoc.runtime.transport.VerifierClient` that records what the device sends: every `round`'s tree (its
    rows' scores included) and the
    device time before it (module docstring: CPU time of the thread calling `round`, which must be the drafting
    thread, as in `DeviceRuntime.generate`). Everything else is the wrapped client's.

    client: an unopened VerifierClient. After a request, ``request`` is its OpenRequest and ``rounds`` its
    `RoundTrace` list; ``replies`` are the RoundReplies received (to count what was committed)."""

    def __init__(self, client):
        self._client = client
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
        reply = self._client.round(tree)
        self._since, self._cpu_since = time.perf_counter(), time.thread_time()
        scores = None if tree.scores is None else tuple(float(x) for x in np.asarray(tree.scores, np.float32))
        self.rounds.append(RoundTrace(tuple(int(x) for x in tree.tokens), tuple(int(x) for x in tree.parents),
                                      device_ms, wall_ms, scores))
        self.replies.append(reply)
        return reply

    def close(self) -> None:
        self._client.close()


def request_trace(config: str, question_id: int, request: OpenRequest, rounds: list[RoundTrace], committed: int,
                  finish_reason: str | None) -> RequestTrace:
    """A `RequestTrace` from a recorded OPEN and its rounds (`RecordingClient`)."""
    s = request.sampling
    return RequestTrace(config=config, question_id=int(question_id), prompt=tuple(int(x) for x in request.prompt_ids),
                        temperature=float(s.temperature), top_k=int(s.top_k), top_p=float(s.top_p),
                        seed=int(request.seed), acceptance=request.acceptance, epsilon=float(request.epsilon),
                        draft_place=request.draft_place, max_new_tokens=int(request.max_new_tokens),
                        rounds=tuple(rounds), committed=int(committed), finish_reason=finish_reason)


def record_trace(recipe, bundle_dir: Path, configs: list[str], questions, output_cap: int, *, key: str,
                 threads: int = 1, progress=None) -> Trace:
    """Run the real device runtime (`hycoc.runtime.client.load_runtime` on the bundle's cpu graphs) for every
    config and question's first turn against an in-process verifier of ``recipe``
    (`hycoc.verifier.server.ServerThread`), recording every round (`RecordingClient`).

    questions: `hycoc.bench.datasets.Question` list. output_cap: max_new_tokens per request. progress: called
    after each request with a short description (None: silent). Sampling and epsilon are the recipe's, the seed
    the bundle's (as `hycoc bench`). Raises what loading the models or the bundle raises, TransportError."""
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
    sampling = Sampling(recipe.sampling.temperature, recipe.sampling.top_k, recipe.sampling.top_p)
    requests = []
    try:
        with ServerThread(engine, **server_options(recipe)) as srv:
            for config in configs:
                for q in questions:
                    client = RecordingClient(VerifierClient(srv.url, timeout_s=600))
                    prompt = rt.bundle.chat.prompt(q.turns[0])
                    res = rt.generate(client, prompt, mode=config, max_new_tokens=output_cap, sampling=sampling,
                                      epsilon=recipe.acceptance.epsilon)
                    requests.append(request_trace(config, q.question_id, client.request, client.rounds,
                                                  len(res.tokens), res.finish_reason))
                    if progress is not None:
                        progress(f"{config} q{q.question_id}: {res.rounds} rounds, {len(res.tokens)} tokens")
    finally:
        engine.close()
    meta = {"recipe": recipe.recipe.name, "recipe_sha256": recipe.content_hash(),
            "bundle": str(bundle_dir), "bundle_manifest_sha256": sha256_file(Path(bundle_dir) / "manifest.json"),
            "output_cap": int(output_cap), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    return Trace(key=key, stop_ids=tuple(sorted(rt.bundle.stop_token_ids())), requests=tuple(requests), meta=meta)


__all__ = ["TRACE_SCHEMA", "RecordingClient", "RequestTrace", "RoundTrace", "Trace", "TraceError", "load_trace",
           "patch_root", "record_trace", "request_trace", "save_trace", "trace_key"]
