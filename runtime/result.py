"""One request's output and metrics on the device (`RequestResult`), and the keys of its JSON (`JSON_KEYS`: what
``hycoc run --json`` prints, its --help lists them from here). Standard library only, so the CLI can import it
without the runtime's numpy/onnxruntime."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestResult:
    """One request's output and metrics (App. G definitions; `to_json` gives the ``--json`` keys).

    tokens: output token ids (bonus tokens included). rounds: verification rounds. accepted: |P| per round.
    seconds: request start to last token. first_token_s: request start to the first streamed token.
    draft_s: device drafting time in rounds (MTP Drafter + tree + SLM forwards; waits and the SLM's request-start
    fill excluded). slm_prefill_s: that fill. prefill_ms / server_ms: the verifier's times (from its replies).
    round_bytes: (up, down) frame bytes per round. rows: rows the verifier verified per round (its forward's rows:
    the reply's verified rows when it names them, else every row it answered). sent_rows: rows of the tree sent per
    round (at most the last reply's allowance; 1 for cloud-mtp). context: root position per round.
    bonus_outside_keep: bonus tokens outside the keep set. link_s: link-model time of the request (slept, or only
    counted when the client's sleep is a no-op); first_token_link_s: its part before the first token. accepted: tokens
    committed per round minus one (after the stop / cap / context cut), so MAT = tokens / rounds. finish_reason: "stop",
    "max_new_tokens" or "length" (`hycoc.protocol.messages.FINISH_REASONS`). kept: for a next turn, the held ids its
    APPEND kept (the rest of the rendering was prefilled); None otherwise.
    """

    mode: str
    text: str = ""
    tokens: list[int] = field(default_factory=list)
    rounds: int = 0
    accepted: list[int] = field(default_factory=list)
    seconds: float = 0.0
    first_token_s: float | None = None
    draft_s: float = 0.0
    slm_prefill_s: float = 0.0
    prefill_ms: float = 0.0
    kept: int | None = None
    server_ms: list[float] = field(default_factory=list)
    round_bytes: list[tuple[int, int]] = field(default_factory=list)
    rows: list[int] = field(default_factory=list)
    sent_rows: list[int] = field(default_factory=list)
    context: list[int] = field(default_factory=list)
    bonus_outside_keep: int = 0
    link_s: float = 0.0
    first_token_link_s: float = 0.0
    finished: bool = False
    finish_reason: str | None = None
    #: graph calls and graph seconds inside ``draft_s`` / ``slm_prefill_s`` (`DeviceRuntime.graph_meter`): what the
    #: rounds ran, so a device profile can price them (`hycoc.bench.paper.device_profile.project_records`)
    draft_calls: dict[str, int] = field(default_factory=dict)
    draft_graph_s: float = 0.0
    prefill_calls: dict[str, int] = field(default_factory=dict)
    prefill_graph_s: float = 0.0

    @property
    def mat(self) -> float:
        """Mean accepted tokens per round, bonus included (App. G)."""
        return len(self.tokens) / self.rounds if self.rounds else 0.0

    def to_json(self) -> dict:
        n = max(len(self.tokens), 1)
        r = max(len(self.round_bytes), 1)
        return {
            "text": self.text,
            "tokens": len(self.tokens),
            "rounds": self.rounds,
            "mat": round(self.mat, 4),
            "tok_per_s": round(len(self.tokens) / self.seconds, 3) if self.seconds > 0 else 0.0,
            "draft_ms_per_token": round(1000 * self.draft_s / n, 3),
            "server_ms_per_token": round((self.prefill_ms + sum(self.server_ms)) / n, 3),
            "first_token_ms": round(1000 * self.first_token_s, 2) if self.first_token_s is not None else None,
            "bytes_up_per_round": round(sum(u for u, _ in self.round_bytes) / r, 1),
            "bytes_down_per_round": round(sum(d for _, d in self.round_bytes) / r, 1),
            "finish_reason": self.finish_reason,
        }


#: The keys of `RequestResult.to_json`, in order: what ``hycoc run --json`` prints for every request or turn.
JSON_KEYS: tuple[str, ...] = tuple(RequestResult(mode="").to_json())

__all__ = ["JSON_KEYS", "RequestResult"]
