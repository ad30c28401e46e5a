"""The device's request loop (paper Alg. 1; App. C; App. G metric definitions) and its modes (Table 5).

`DeviceRuntime` holds a bundle and what its drafters use (`hycoc.runtime.draft_context.DraftContext`: the MTP
Drafter and the SLM Drafter over the bundle's two graph sessions, the round constants, the tree builder factory);
`DeviceRuntime.generate` runs one request against a verifier (`hycoc.runtime.transport.VerifierClient`):

1. request start: the SLM ring is filled with the prompt's last W tokens and the first tree is drafted by the
   SLM alone while the server prefills (the OPEN request runs in a worker thread meanwhile);
2. each round sends the tree with its rows' scores s(v) (Alg. 3), walks the reply to the deepest matching path
   through the rows the verifier verified (a loaded verifier may verify an ancestor-closed part of the tree,
   ``RoundReply.verified``; ties to the lowest row; the path must agree with the verifier's ``path_rows``),
   commits it plus the bonus token (cut after an end-of-turn token and at the output cap, as the verifier does),
   moves the SLM rows of the path behind the root's (path nodes only: a row left unverified never reaches the
   ring), streams the new text;
3. the reply's hand-off feeds the MTP Drafter (Alg. 2), whose chain and runner-ups seed the next tree (Alg. 3),
   of at most the reply's allowance of rows (protocol 6: the verifier's bound from its load, checked on arrival,
   `hycoc.runtime.drafters.allowed_rows`); at the floor (the root and the chain) the tree runs no SLM pass.

What a mode drafts is its `hycoc.runtime.drafters.Drafter` (`hycoc.runtime.drafters.DRAFTERS`, one class per Table 5
drafter); the loop here is the same for all of them.

Modes (Table 5; constants from the bundle's round section):

==============  ===========  ==========  =====================================  =============================
mode            draft place  acceptance  tree                                   SLM forwards per round
==============  ===========  ==========  =====================================  =============================
hyco            device       epsilon     K-chain + D siblings + SLM, B nodes    1
hyco-exact      device       exact       same                                   1
hyco-2p         device       epsilon     same, second SLM pass                  2
specedge        device       exact       SLM only, ``specedge_nodes``           ``specedge_passes`` (4)
specedge-eps    device       epsilon     same                                   same
server-head     server-head  exact       server head's chain (reply) + SLM      1
cloud-mtp       cloud-mtp    exact       root only (the server drafts)          0
slm-alone       (none)       --          greedy SLM decoding on the device      1 per token
==============  ===========  ==========  =====================================  =============================
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
from hycoc.runtime.draft_context import DraftContext
from hycoc.runtime.drafters import Drafter, RuntimeProtocolError, SlmTreeDrafter, allowed_rows, drafter_class
from hycoc.runtime.drafting_times import DraftingTimes
from hycoc.runtime.htp_session import HtpSessionSettings
from hycoc.runtime.mtp_drafter import MtpDrafter
from hycoc.runtime.result import RequestResult
from hycoc.runtime.slm_drafter import SlmDrafter
from hycoc.runtime.tree_builder import TreeBuilder

from hycoc.chat import ChatMismatch, common_prefix, ids_crc32
from hycoc.protocol.messages import AppendTurn, OpenRequest, Sampling, commit_cut
from hycoc.table5 import BY_NAME, RUN_MODES, Configuration

#: One configuration of Table 5 as the device runs it (`hycoc.table5`, the one list of them).
Mode = Configuration
#: name -> `Mode`, every Table 5 configuration (`hycoc.table5.BY_NAME`).
MODES = BY_NAME


class TextStream:
    """Incremental detokenization: `push` returns the new text since the last call, holding back a trailing
    partial UTF-8 character (byte tokens decode to U+FFFD until complete); `flush` returns what is held back at
    the end of a request (a real trailing U+FFFD included), so the pieces always add up to `text`."""

    def __init__(self, tokenizer):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)

    def push(self, ids) -> str:
        self.ids.extend(int(i) for i in ids)
        text = self.text()
        stable = text.rstrip("\ufffd")
        delta = stable[len(self.sent) :] if stable.startswith(self.sent) else ""
        self.sent = stable if stable.startswith(self.sent) else self.sent
        return delta

    def flush(self) -> str:
        """The text not yet returned by `push`: the end of the request, where nothing more can complete it."""
        text = self.text()
        delta = text[len(self.sent) :] if text.startswith(self.sent) else ""
        self.sent = text if text.startswith(self.sent) else self.sent
        return delta


class DeviceRuntime:
    """A bundle loaded for drafting (module docstring).

    bundle: `hycoc.runtime.device_bundle.DeviceBundle` (the runtime reads its round constants' request defaults,
    tokenizer, chat contract and keep index); head / slm: graph runners (`GraphRunner`); slm_decode: the runner of
    the bundle's 1-row ``slm_decode`` graph, which slm-alone then decodes with (None: a bundle without it decodes on
    the tree graph, one token per R-row forward). drafting: instead of the runners, a ready
    `hycoc.runtime.draft_context.DraftContext` (stand-in drafters in tests: `DraftContext.make_dummy`). Raises
    TypeError for both or neither.
    """

    def __init__(self, bundle, head=None, slm=None, slm_decode=None, *, drafting: DraftContext | None = None):
        both_or_neither = "DeviceRuntime takes the head and slm graph runners, or drafting=DraftContext, not both"
        if drafting is None:
            if head is None or slm is None:
                raise TypeError(both_or_neither)
            drafting = DraftContext.load(bundle, head, slm, slm_decode)
        elif any(x is not None for x in (head, slm, slm_decode)):
            raise TypeError(both_or_neither)
        self.bundle = bundle
        #: what the drafters use (one per runtime, shared by the drafter of each request)
        self.drafting = drafting
        #: (committed conversation tokens, mode) after generate(..., keep_open=True); None otherwise.
        self._conversation: tuple[list[int], str] | None = None
        #: this device's measured drafting ms per round, without and with the SLM pass (sent in every OPEN)
        self.drafting_ms = DraftingTimes(chain_rows=drafting.round.chain_length + 1)

    @property
    def mtp(self) -> MtpDrafter:
        """The MTP Drafter (Alg. 2) the drafters share (`DraftContext.mtp`)."""
        return self.drafting.mtp

    @property
    def slm(self) -> SlmDrafter:
        """The SLM Drafter (its ring follows the conversation) the drafters share (`DraftContext.slm`)."""
        return self.drafting.slm

    @property
    def stop_ids(self) -> frozenset[int]:
        """The ids that end a model turn (the bundle's chat stop ids, `DraftContext.stop_ids`)."""
        return self.drafting.stop_ids

    def graph_meter(self) -> dict[str, tuple[int, float]]:
        """(calls, wall seconds) so far of each graph runner: ``head``, ``slm`` and ``slm_decode`` when loaded."""
        runners = {"head": self.mtp.runner, "slm": self.slm.runner}
        decoder = getattr(self.slm, "decoder", None)
        if decoder is not None:
            runners["slm_decode"] = decoder.runner
        return {k: (int(getattr(r, "calls", 0)), float(getattr(r, "seconds", 0.0))) for k, r in runners.items()}

    def _metered(self, res: RequestResult, before: dict[str, tuple[int, float]], kind: str) -> None:
        """Add the graph calls and seconds since ``before`` to ``res``'s ``kind`` ("draft" / "prefill") counters."""
        calls = getattr(res, f"{kind}_calls")
        graph_s = 0.0
        for name, (n, sec) in self.graph_meter().items():
            n0, s0 = before.get(name, (0, 0.0))
            if n > n0:
                calls[name] = calls.get(name, 0) + n - n0
            graph_s += sec - s0
        setattr(res, f"{kind}_graph_s", getattr(res, f"{kind}_graph_s") + graph_s)

    def drafter(self, mode: str) -> Drafter:
        """A new drafter of configuration ``mode`` (`hycoc.runtime.drafters.DRAFTERS`) over this runtime's graphs.
        Raises ValueError for a name outside `MODES`."""
        return drafter_class(mode, tuple(MODES))(self.drafting, MODES[mode])

    def builder(self, mode: Mode, tree_rows: int) -> TreeBuilder:
        """The tree builder of ``mode`` for trees of ``tree_rows`` rows (the verifier's B + 1). Raises ValueError
        when its node budget does not fit them, or the mode drafts no tree on the device."""
        drafter = self.drafter(mode.name)
        if not isinstance(drafter, SlmTreeDrafter):
            raise ValueError(f"mode {mode.name} drafts no tree on the device")
        return drafter.builder(tree_rows)

    def open_request(
        self,
        prompt_ids,
        mode: Mode,
        *,
        max_new_tokens: int,
        seed: int,
        sampling: Sampling,
        epsilon: float,
        anchor: int = 0,
    ) -> OpenRequest:
        """The OPEN of a request (anchor: the prompt's `hycoc.chat.Rendered.anchor`, 0 for raw ids). Raises
        ValueError for a mode without a verifier (slm-alone)."""
        if mode.acceptance is None or mode.draft_place is None:
            raise ValueError(f"mode {mode.name} drafts without a verifier: it opens no session")
        return OpenRequest(
            prompt_ids=np.asarray(prompt_ids, np.int32),
            sampling=sampling,
            seed=seed,
            acceptance=mode.acceptance,
            epsilon=epsilon if mode.acceptance == "epsilon" else 1.0,
            draft_place=mode.draft_place,
            max_new_tokens=max_new_tokens,
            chat=self.bundle.chat.format.contract(),
            anchor=int(anchor),
            draft_ms_floor=self.drafting_ms.floor_ms,
            draft_ms_tree=self.drafting_ms.tree_ms,
        )

    def generate(
        self,
        client,
        prompt_ids,
        *,
        mode: str = "hyco",
        max_new_tokens: int | None = None,
        seed: int | None = None,
        sampling: Sampling | None = None,
        epsilon: float | None = None,
        on_text: Callable[[str], None] | None = None,
        keep_open: bool = False,
        on_tokens: Callable[[list[int]], None] | None = None,
        anchor: int = 0,
    ) -> RequestResult:
        """Run one request (Alg. 1 each round) and return its `RequestResult`.

        anchor: the prompt's model-turn opening (`hycoc.chat.Rendered.anchor`) when the prompt is a rendered
        conversation that may continue (`next_turn`); 0 for raw ids.
        client: an unopened `VerifierClient` (None for ``slm-alone``); it is closed at the end unless
        ``keep_open`` (then `next_turn` continues the conversation on it, and the caller closes it). on_text:
        called with each new piece of text as it is committed; on_tokens: with each round's committed ids (for a
        caller that splits the thought from the answer, `hycoc.chat.AnswerStream`). Raises TransportError subclasses
        (server unreachable, auth refused, connection dropped, protocol mismatch), HandoffError, RuntimeProtocolError;
        text already passed to ``on_text`` stays delivered.
        """
        return self._request(
            client,
            [int(x) for x in prompt_ids],
            None,
            mode,
            max_new_tokens,
            seed,
            sampling,
            epsilon,
            on_text,
            keep_open,
            on_tokens,
            anchor,
        )

    def next_turn(
        self,
        client,
        conversation_ids,
        *,
        anchor: int = 0,
        max_new_tokens: int | None = None,
        on_text: Callable[[str], None] | None = None,
        keep_open: bool = True,
        on_tokens: Callable[[list[int]], None] | None = None,
    ) -> RequestResult:
        """The next turn of a conversation (paper §4.1, MT-bench's second turns) on the session `generate(...,
        keep_open=True)` opened, as the template renders the whole conversation (docs/serving.md "Conversations").

        conversation_ids: the whole conversation re-rendered with its new user message
        (`hycoc.chat.Chat.conversation` / `hycoc.chat.Conversation.ask`); anchor: its `hycoc.chat.Rendered.anchor`.
        The runtime keeps the longest prefix these share with the ids it holds (prompt + committed output, at
        least 1, at most all but the last), rolls its SLM ring back to it (`SlmDrafter.rollback`) and sends an
        APPEND with that ``keep``, the kept ids' crc32 and the rest; the verifier rolls back the same way and
        checks the crc. The MTP Drafter starts again from the turn's first hand-off (W positions). The mode,
        sampling, seed and epsilon stay the session's. Returns the turn's `RequestResult` (prefill_ms: the append's
        prefill; ``kept``: the kept ids). Raises ValueError without an open conversation, and what `generate`
        raises.
        """
        if self._conversation is None or client is None or client.opened is None:
            raise ValueError("no open conversation: call generate(..., keep_open=True) first, with a server mode")
        held, mode = self._conversation
        ids = [int(x) for x in conversation_ids]
        if len(ids) < 2:
            raise ValueError("the conversation's rendering needs at least 2 ids (a kept one and the next root)")
        keep = max(1, min(common_prefix(held, ids), len(ids) - 1))
        turn = AppendTurn(
            np.asarray(ids[keep:], np.int32), 0, keep, ids_crc32(held[:keep]), int(anchor) if int(anchor) >= keep else 0
        )
        self.drafter(mode).rollback(keep)
        return self._request(client, ids, turn, mode, max_new_tokens, None, None, None, on_text, keep_open, on_tokens)

    def _request(
        self,
        client,
        prompt: list[int],
        appended: AppendTurn | None,
        mode: str,
        max_new_tokens,
        seed,
        sampling,
        epsilon,
        on_text,
        keep_open: bool,
        on_tokens=None,
        anchor: int = 0,
    ) -> RequestResult:
        drafter = self.drafter(mode)
        r = self.bundle.round
        max_new = r.max_new_tokens if max_new_tokens is None else int(max_new_tokens)
        seed = r.seed if seed is None else int(seed)
        sampling = sampling or Sampling(r.temperature, r.top_k, r.top_p)  # works on a bare round too (tests)
        epsilon = r.epsilon if epsilon is None else float(epsilon)
        res = RequestResult(mode=mode)
        if appended is not None:
            res.kept = appended.keep
        stream = TextStream(self.bundle.tokenizer)
        start = time.perf_counter()
        link0 = getattr(client, "link_s", 0.0)  # the client's link time is counted per connection

        def emit(new: list[int]) -> None:
            if new and res.first_token_s is None:
                res.first_token_s = time.perf_counter() - start
                res.first_token_link_s = getattr(client, "link_s", 0.0) - link0
            res.tokens.extend(new)
            if on_tokens is not None:
                on_tokens(new)
            piece = stream.push(new)
            if piece and on_text is not None:
                on_text(piece)

        self._conversation = None
        if not drafter.verified:
            self._slm_alone(drafter, prompt, max_new, res, emit)
        else:
            try:
                self._verified(client, prompt, drafter, max_new, seed, sampling, epsilon, res, emit, appended, anchor)
            except BaseException:
                client.close()
                raise
            finally:
                res.link_s = getattr(client, "link_s", 0.0) - link0
            if keep_open:
                self._conversation = (prompt + res.tokens, mode)
            else:
                client.close()
        res.seconds = time.perf_counter() - start
        res.text = stream.text()
        tail = stream.flush()
        if tail and on_text is not None:
            on_text(tail)
        return res

    # ---- the modes ---------------------------------------------------------------------------------------------

    def _slm_alone(self, drafter: Drafter, prompt, max_new, res: RequestResult, emit) -> None:
        """The loop of a drafter without a verifier (slm-alone): one drafted token a step, committed as drafted."""
        drafter.start(prompt)
        t0, meter = time.perf_counter(), self.graph_meter()
        drafter.prefill()
        res.slm_prefill_s = time.perf_counter() - t0
        self._metered(res, meter, "prefill")
        while len(res.tokens) < max_new:
            t0, meter = time.perf_counter(), self.graph_meter()
            token = int(drafter.draft(res.rounds, None, res.tokens[-1] if res.tokens else prompt[-1], 1).tokens[0])
            drafter.accept([token])
            res.draft_s += time.perf_counter() - t0
            self._metered(res, meter, "draft")
            res.rounds += 1
            res.accepted.append(0)
            emit([token])
            if token in self.stop_ids:
                res.finish_reason = "stop"
                break
        res.finished = True
        res.finish_reason = res.finish_reason or "max_new_tokens"

    def _verified(
        self,
        client,
        prompt,
        drafter: Drafter,
        max_new,
        seed,
        sampling,
        epsilon,
        res: RequestResult,
        emit,
        appended: AppendTurn | None = None,
        anchor: int = 0,
    ) -> None:
        drafter.reset()
        with ThreadPoolExecutor(1, thread_name_prefix="hycoc-open") as pool:
            if appended is None:  # a new session: the server prefills the prompt
                request = self.open_request(
                    prompt,
                    drafter.mode,
                    max_new_tokens=max_new,
                    seed=seed,
                    sampling=sampling,
                    epsilon=epsilon,
                    anchor=anchor,
                )
                opened_f = pool.submit(client.open, request)
            else:  # the next turn: the server rolls back and prefills the rest
                opened_f = pool.submit(client.append, replace(appended, max_new_tokens=max_new))
            if drafter.uses_slm:  # the SLM ring fills while the server prefills (App. C)
                drafter.start(prompt, None if appended is None else appended.keep)
                t0, meter = time.perf_counter(), self.graph_meter()
                drafter.prefill()
                res.slm_prefill_s = time.perf_counter() - t0
                self._metered(res, meter, "prefill")
            opened = opened_f.result()
        if set(opened.stop_ids) != self.stop_ids:  # a verifier that did not check the OPEN's chat contract
            raise ChatMismatch(
                f"stop ids differ: this bundle stops on {sorted(self.stop_ids)}, the verifier on "
                f"{sorted(opened.stop_ids)}; build the bundle from the verifier's checkpoint"
            )
        res.prefill_ms = opened.prefill_ms

        def room() -> tuple[int, int]:
            """(tokens left under max_new_tokens, tokens left in the verifier's context: prompt and output
            together hold opened.max_context positions)."""
            return max_new - len(res.tokens), opened.max_context - len(prompt) - len(res.tokens)

        def draft(seq: int, reply, root: int):
            """The drafter's next tree, its time and graph calls counted when the device drafts it."""
            if not drafter.drafts:
                return drafter.draft(seq, reply, root, min(room()))
            t0, meter = time.perf_counter(), self.graph_meter()
            tree = drafter.draft(seq, reply, root, min(room()))  # the first: SLM alone, trimmed to the room
            res.draft_s += time.perf_counter() - t0
            if seq > 0:  # the first tree is SLM-only while the server prefills (App. C): not a round's drafting
                self.drafting_ms.observe(len(tree.tokens), 1e3 * (time.perf_counter() - t0))
            self._metered(res, meter, "draft")
            return tree

        drafter.begin(opened.tree_rows)
        root = prompt[-1]
        seq = 0
        tree = draft(seq, None, root)
        while True:
            res.context.append(len(prompt) - 1 + len(res.tokens))
            res.sent_rows.append(len(tree.tokens))
            reply = client.round(tree)
            allowed_rows(seq, reply, opened.tree_rows)  # on arrival, whatever drafts next (RuntimeProtocolError)
            verified = reply.verified
            # rows of the verifier's forward: those it verified (cloud-mtp: root + its chain)
            res.rows.append(len(reply.samples) if verified is None else int(np.count_nonzero(verified)))
            res.server_ms.append(reply.server_ms)
            res.round_bytes.append(client.round_bytes[-1])
            res.rounds += 1
            new = drafter.read(seq, reply)  # path + bonus (RuntimeProtocolError when they contradict the tree)
            keep_index = self.bundle.keep_index
            if reply.bonus >= len(keep_index) or keep_index[reply.bonus] < 0:
                res.bonus_outside_keep += 1
            new, reason = commit_cut(new, self.stop_ids, *room())
            res.accepted.append(len(new) - 1)
            drafter.accept(new)
            emit(new)
            if reply.finished or reason is not None:
                res.finished, res.finish_reason = True, reply.finish_reason or reason
                return
            root = new[-1]
            seq += 1
            tree = draft(seq, reply, root)


def load_runtime(
    bundle_dir,
    backend: str = "cpu",
    *,
    threads: int | None = None,
    io_binding: bool = False,
    htp_shared_memory: bool = False,
    htp: HtpSessionSettings | None = None,
) -> DeviceRuntime:
    """Open a bundle (hash- and target-checked, `open_bundle`) and its graphs on ``backend`` (head, slm, and
    slm_decode when the bundle has it: slm-alone's 1-row graph). io_binding: run
    the graphs through onnxruntime IOBindings (`GraphRunner`): rings bound once, outputs in preallocated buffers
    (the SLM's: one set per forward a round keeps until its commit, at most ``specedge_passes``).
    htp_shared_memory: the drafters' rings in the QNN EP's HTP shared memory (RPCMem), bound once through
    IOBindings, so no call copies them (`GraphRunner` ``shared_memory``); htp backend only (ValueError otherwise),
    and only where the platform has the allocator (a Snapdragon device's libcdsprpc.so): SharedMemoryUnavailable
    (`hycoc.targets.qnn_ep`) on the x86 HTP simulator, before the bundle is opened. htp: the QNN session settings of
    every graph (`hycoc.runtime.htp_session.HtpSessionSettings`; None = its defaults: burst, normal priority, 100 µs
    RPC latency); htp backend only (ValueError for settings given with another backend)."""
    from hycoc.runtime.device_bundle import open_bundle
    from hycoc.runtime.graphs import GraphRunner, RunnerSettings, code_outputs, open_graph, runtime_outputs

    if htp_shared_memory:
        if backend != "htp":
            raise ValueError(
                f"htp_shared_memory is the QNN EP's HTP allocator: it needs backend 'htp', not "
                f"{backend!r} (drop htp_shared_memory, or load the htp bundle)"
            )
        from hycoc.targets.qnn_ep import htp_shared_memory_info

        htp_shared_memory_info()  # SharedMemoryUnavailable here, with what a device needs
        io_binding = True
    if htp is not None and backend != "htp":
        raise ValueError(f"the QNN session settings are the htp backend's: not with backend {backend!r}")
    bundle = open_bundle(bundle_dir, backend)
    m = bundle.manifest
    sets = max(2, bundle.round.specedge_passes, bundle.round.slm_passes)

    def runner(make, name: str, entry, **options):
        # `make`: GraphRunner, or open_graph for a graph the bundle may hold as layer shards
        settings = RunnerSettings(threads=threads, io_binding=io_binding, htp=htp, **options)
        return make(bundle.path, m, name, backend, runtime_outputs(entry), settings)

    head = runner(GraphRunner, "head", m.graph("head"), shared_memory=htp_shared_memory)
    # open_graph: the SLM as layer shards (slm.s0, slm.s1, ...) runs as one chained graph (ShardChainRunner)
    slm_entry = m.chain_entry("slm")
    slm = runner(
        open_graph, "slm", slm_entry, output_sets=sets, shared_memory=htp_shared_memory, codes=code_outputs(slm_entry)
    )
    decode = None
    if any(g.name == "slm_decode" for g in m.graphs):  # bundles built before the slm_decode graph existed have none
        decode_entry = m.graph("slm_decode")
        decode = runner(GraphRunner, "slm_decode", decode_entry, codes=code_outputs(decode_entry))
    return DeviceRuntime(bundle, head, slm, decode)


__all__ = ["MODES", "RUN_MODES", "DeviceRuntime", "Mode", "RequestResult", "RuntimeProtocolError", "load_runtime"]
