"""The tables of where a recipe runs and how it is measured (`hycoc.recipe`): ``[target]`` (the compile target of
`hycoc build`), ``[verifier]`` (how `hycoc verify-server` runs the verifier, its limits from
`hycoc.serving_limits.LIMITS`), ``[bench]`` (`hycoc bench`'s defaults) and ``[tune]`` (`hycoc tune-epsilon`). Each is
a strict `hycoc.recipe.sections.Section` with the paper's defaults, as the tables of the model and the round in
`hycoc.recipe.sections` are.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_serializer, model_validator

from hycoc import serving_limits
from hycoc.recipe.errors import CrossFieldError
from hycoc.recipe.sections import Link, Section, _allowed


class Target(Section):
    """``[target]``: the compile target of `hycoc build` (docs/design.md "Targets")."""

    name: Literal["htp-v81", "htp-v79", "htp-v75", "htp-v73", "htp-v68", "cpu", "qai-hub"] = Field(
        "htp-v81",
        description="htp-vNN = QNN HTP context binaries for Hexagon vNN (targets/profiles.py); cpu = QDQ "
        "ONNX; qai-hub = AI Hub compile job",
    )
    htp_arch: Literal[68, 69, 73, 75, 79, 81] = Field(81, description="Hexagon HTP architecture version")
    soc_model: str = Field("SM8850", min_length=1, description="SoC of the phone (paper: SM8850, Galaxy S26 Ultra)")
    context_size_limit_mb: int = Field(
        3500, ge=1, le=1_048_576, description="largest QNN context binary the phone loads, in MB"
    )
    disable_cpu_fallback: bool = Field(True, description="fail the compile if any node would fall back to the CPU")
    share_weights: bool = Field(
        True,
        description="htp: the SLM's tree and decode graphs in one weight-shared context "
        "binary (the x86 HTP simulator cannot load one: false to run a bundle there)",
    )
    hub_device: str = Field(
        "Samsung Galaxy S26 (Family)",
        min_length=1,
        description="qai-hub: the phone as Qualcomm AI Hub names it (`qai-hub list-devices`); the default is the "
        "SM8850 (Hexagon v81) family, checked against AI Hub's device list when it can be reached",
    )
    slm_shards: int | Literal["auto"] = Field(
        1,
        description="the SLM tree graph split by layers into this many shards, one context binary "
        'each, chained by the runtime (1 = one graph; "auto" = the fewest whose weights fit context_size_limit_mb)',
    )
    quantized_io: bool = Field(
        False,
        description="the graphs take their KV rings (and give their new KV rows) as "
        "uint16 codes of the manifest's encodings instead of float32, so the host hands over "
        "integers and no ring is quantized per call",
    )

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """The table as dumped (cache keys, recipe hash), without ``slm_shards`` at its default of 1,
        ``hub_device`` at its default nor ``quantized_io`` at false: a recipe that sets none of them keeps the keys
        it had before the knobs existed; any other value is dumped and keyed."""
        data = handler(self)
        if self.slm_shards == 1:
            data.pop("slm_shards", None)
        if self.hub_device == type(self).model_fields["hub_device"].default:
            data.pop("hub_device", None)  # likewise: only the qai-hub target reads it
        if not self.quantized_io:  # the same for the quantized IO knob at its default
            data.pop("quantized_io", None)
        return data

    @model_validator(mode="after")
    def _shard_count(self) -> Target:
        v = self.slm_shards
        if v != "auto" and (isinstance(v, bool) or not 1 <= v <= 1024):
            raise CrossFieldError("slm_shards", v, "is not a shard count", 'a count in [1, 1024] or "auto"')
        return self

    @model_validator(mode="after")
    def _arch_matches_name(self) -> Target:
        if self.name.startswith("htp-v") and self.htp_arch != int(self.name.removeprefix("htp-v")):
            arch = self.name.removeprefix("htp-v")
            raise CrossFieldError(
                "htp_arch",
                self.htp_arch,
                f'disagrees with target.name = "{self.name}"',
                f'{arch} while target.name is "{self.name}"',
            )
        return self


def _limit(knob: str) -> Any:
    """The ``[verifier]`` field of server limit ``knob``: default, range and description from
    `hycoc.serving_limits.LIMITS`, the one table of them."""
    lim = serving_limits.BY_KNOB[knob]
    return Field(lim.default, ge=lim.ge, gt=lim.gt, le=lim.le, description=f"{lim.description} (default {lim.shown})")


class Verifier(Section):
    """``[verifier]``: how `hycoc verify-server` (and `hycoc generate`) run the verifier."""

    device: Literal["cpu", "cuda"] = Field("cuda", description="torch device of the verifier (paper: one GPU)")
    dtype: Literal["float32", "bfloat16"] = Field("bfloat16", description="weight and activation dtype")
    max_context: int = Field(
        0, ge=0, le=16_777_216, description="longest prompt + output in tokens (0 = the model's own limit)"
    )
    threads: int = Field(
        0,
        ge=0,
        le=1024,
        description="torch CPU threads for the verifier (0 = torch's default); small "
        "models run fastest on 1, as thread start-up costs more than their matrix products",
    )
    host: str = Field("127.0.0.1", min_length=1, description="address the server listens on")
    port: int = Field(8765, ge=1, le=65535, description="TCP port the server listens on")
    # Server limits (docs/design.md "Limits"; the table in docs/serving.md "Limits"): defaults, ranges and
    # descriptions are `hycoc.serving_limits.LIMITS`' (each refusal has an error code and a /metrics counter).
    max_frame_bytes: int = _limit("max_frame_bytes")
    handshake_timeout_s: float = _limit("handshake_timeout_s")
    frame_timeout_s: float = _limit("frame_timeout_s")
    idle_timeout_s: float = _limit("idle_timeout_s")
    max_connections: int = _limit("max_connections")
    max_sessions: int = _limit("max_sessions")
    max_kv_bytes: int = _limit("max_kv_bytes")
    auth_failures_per_minute: int = _limit("auth_failures_per_minute")
    retry_after_s: float = _limit("retry_after_s")
    # Cross-session batching (docs/serving.md "Many devices: batched verification"; hycoc.verifier.scheduler): rounds of
    # sessions ready together share a forward.
    batching: Literal["batched", "serial"] = Field(
        "batched",
        description="batched: rounds of sessions ready at the same time are verified in one forward and "
        "prompts are prefilled chunk by chunk between them; serial: one engine call at a time (the server before "
        "batching)",
    )
    max_batch_rows: int = _limit("max_batch_rows")
    max_batch_wait_ms: float = _limit("max_batch_wait_ms")
    max_prefills: int = _limit("max_prefills")
    # Budgeted verification rows (hycoc.verifier.row_budget): which rows of the trees sharing a forward are checked.
    tree_budget: Literal["fixed", "auto"] = Field(
        "auto",
        description="auto: when several sessions' rounds share a batched forward, the rows verified are "
        "chosen across them by the trees' scores (the most expected accepted tokens per forward millisecond; one "
        "tree alone is never trimmed; needs batching = batched, and serial turns it off); fixed: every tree "
        "verified as sent",
    )
    min_rows_per_session: int = Field(
        2,
        ge=1,
        le=32_768,
        description="rows each tree keeps under tree_budget = auto (2 = the root and the first chain token)",
    )
    # The tree allowance (hycoc.verifier.allowance; docs/serving.md "Tree allowance"): each REPLY says how many rows
    # the session's next ROUND may hold, sized from the verifier's load.
    allowance: Literal["fixed", "auto"] = Field(
        "auto",
        description="auto: each reply allows the session's next tree the rows that maximise committed tokens per "
        "verifier millisecond at the current load (the whole tree at low load, down to the MTP chain plus the root "
        "under load; the device drafts no more; needs batching = batched, and serial turns it off); fixed: every "
        "reply allows the whole tree (B + 1 rows)",
    )
    allowance_target_ms: float = Field(
        0.0,
        ge=0,
        le=60_000,
        description="step-latency target of allowance = auto in ms: only allowances whose batched forward fits it "
        "are chosen, the floor when none does (0 = no target: tokens per verifier ms alone)",
    )
    allowance_floor: int = Field(
        0,
        ge=0,
        le=32_768,
        description="the fewest rows, root included, allowance = auto grants (0 = K + 1: the root and the MTP "
        "chain, so a HyCo round at its floor costs the verifier no more than a Cloud+MTP round)",
    )
    row_cost: list[Annotated[list[Annotated[float, Field(ge=0)]], Field(min_length=2, max_length=2)]] = Field(
        default_factory=list,
        description="the batched forward's cost for tree_budget = auto as [[rows, ms], ...] "
        "(rows increasing, >= 2 points); empty = measured by the server when it starts",
        json_schema_extra=_allowed("[[rows, ms], ...] such as [[32, 14.0], [528, 70.0]], or [] to measure"),
    )


class Bench(Section):
    """``[bench]``: `hycoc bench` defaults (§4, App. G)."""

    dataset: str = Field("", description="Spec-Bench question JSONL (path; empty = the CLI's default)")
    output_cap: int = Field(1024, ge=1, le=1_048_576, description="new tokens per request, in tokens (paper: 1,024)")
    link: Link = Field(
        "lte",
        description="link model per frame: lte, 5g, none, or 'RTT_MS:MBPS' (round trip ms : megabit/s)",
        json_schema_extra=_allowed('"lte", "5g", "none" or "RTT_MS:MBPS" such as "45:50"'),
    )
    runs: int = Field(
        1, ge=1, le=100, description="repetitions of every configuration (paper: 3 for HyCo, SpecEdge-eps)"
    )


_Epsilon = Annotated[float, Field(gt=0, lt=1)]


class Tune(Section):
    """``[tune]``: `hycoc tune-epsilon`, which chooses ε on a validation set as the paper did on UC-val (§3,
    App. D), with quality guards measured against exact acceptance (docs/benchmarks.md "Choosing ε"; the rule is in
    `hycoc.bench.paper.tune_epsilon.choose_epsilon`)."""

    validation_data: str = Field(
        "",
        description='JSONL of held-out conversations, one a line ({"messages": [user, assistant]}): the '
        "first user turn is the prompt; must be disjoint from Spec-Bench and from keep_set.corpus (path; empty = "
        "none, tune-epsilon then asks for it)",
    )
    prompts: int = Field(
        60, ge=1, le=100_000, description="validation prompts swept, the file's first ones (paper: 60 UC-val)"
    )
    max_new_tokens: int = Field(
        512, ge=1, le=1_048_576, description="output cap per validation request, in tokens (paper: 512)"
    )
    epsilons: list[_Epsilon] = Field(
        default_factory=lambda: [0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5],
        min_length=1,
        max_length=64,
        description="thresholds swept, each in (0, 1); exact acceptance (epsilon = 1) is always run as the reference",
        json_schema_extra=_allowed("a non-empty list of numbers, each in (0, 1)"),
    )
    mode: Literal["hyco", "specedge-eps"] = Field(
        "hyco", description="the configuration swept; its exact counterpart (hyco-exact, specedge) is the reference"
    )
    max_compression_drop: float = Field(
        0.03, ge=0, le=1, description="largest allowed fall of the mean zlib compressed/raw ratio vs exact (paired)"
    )
    max_repetition_rise: float = Field(
        0.05, ge=0, le=1, description="largest allowed rise of the mean share of words in repeated 4-grams vs exact"
    )
    max_distinct2_drop: float = Field(
        0.05,
        ge=0,
        le=1,
        description="largest allowed fall of the mean distinct-2 (distinct / all word bigrams) vs exact",
    )
    g_tie_pct: float = Field(
        2.0,
        ge=0,
        le=100,
        description="projected g within this % of the lowest counts as a tie, won by the "
        "larger epsilon (paper App. D: ~2% validation variation)",
    )


__all__ = ["Bench", "Target", "Tune", "Verifier"]
