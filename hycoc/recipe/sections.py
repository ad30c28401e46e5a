"""The tables of a recipe (`hycoc.recipe`): one strict pydantic model per ``[section]``, with the paper's defaults.

Each section is a `Section`: ``extra="forbid"`` and strict types, so an unknown key, a wrong type (``"4"`` for ``4``,
``1`` for ``true``) or an out-of-range value is an error, never a warning and never a silent coercion. Every field
carries the paper's default and a one-line description with its unit; the paper is "HyCo: Hybrid Drafting for
Cost-Efficient Mobile-Cloud Speculative Decoding" (App. C Algorithms 1-4 and Table 5 for the round, Table 4 for the
head's QAT, Table 3 and App. A for the integer formats). A validator that finds two fields in disagreement raises
`hycoc.recipe.errors.CrossFieldError`; the whole recipe that holds these tables is `hycoc.recipe.document.Recipe`.

This module holds the base `Section`, the value formats and the tables of the model and the round; the tables of
where it runs and how it is measured (``[target]``, ``[verifier]``, ``[bench]``, ``[tune]``) are
`hycoc.recipe.deployment`'s.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, NamedTuple

import annotated_types
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    model_validator,
)
from pydantic.config import JsonDict

from hycoc.protocol import messages
from hycoc.recipe.errors import CrossFieldError, Problem, RecipeError


class Bound(NamedTuple):
    """An order constraint between two fields of one section: ``key`` stays at or below ``limit`` (``strict``: below).
    ``problem`` says why, with ``{limit}`` standing for ``"table.limit = value"``."""

    key: str
    limit: str
    problem: str
    strict: bool = False


class Section(BaseModel):
    """Base of every recipe table: unknown keys are errors, types are strict, defaults are validated too.

    ``table`` is the section's TOML table name; ``bounds`` its order constraints (`Bound`), checked after its fields:
    a value past its limit raises `CrossFieldError` on ``key``, whose allowed range is derived from the field (its
    type and lower bound) and the limit's value, e.g. ``"an integer in [0, tree.chain_length = 4]"``."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, validate_default=True)
    table: ClassVar[str] = ""
    bounds: ClassVar[tuple[Bound, ...]] = ()

    @model_validator(mode="after")
    def _within_bounds(self) -> Section:
        for b in self.bounds:
            value, limit = getattr(self, b.key), getattr(self, b.limit)
            if value > limit or (b.strict and value == limit):
                named = f"{self.table}.{b.limit} = {limit}"
                info = type(self).model_fields[b.key]
                low = next((m for m in info.metadata if isinstance(m, (annotated_types.Ge, annotated_types.Gt))), None)
                kind = "an integer" if info.annotation is int else "a number"
                if low is None:  # no lower bound on the field: the limit alone
                    allowed = f"{kind} {'below' if b.strict else 'at most'} {named}"
                else:
                    opening = "(" if isinstance(low, annotated_types.Gt) else "["
                    lowest = low.gt if isinstance(low, annotated_types.Gt) else low.ge
                    allowed = f"{kind} in {opening}{lowest:g}, {named}{')' if b.strict else ']'}"
                raise CrossFieldError(b.key, value, b.problem.format(limit=named), allowed)
        return self


def _allowed(text: str) -> JsonDict:
    """Field extra that spells out the allowed values where the type and bounds do not say it all."""
    return {"allowed": text}


# ---- value formats ------------------------------------------------------------------------------------------

_RANGE = re.compile(r"^U\+([0-9A-Fa-f]{4,6})-U\+([0-9A-Fa-f]{4,6})$")
_LINK = re.compile(r"^(lte|5g|none|\d+(\.\d+)?:\d+(\.\d+)?)$")


def parse_code_point_range(text: str) -> tuple[int, int]:
    """``"U+AC00-U+D7A3"`` -> ``(0xAC00, 0xD7A3)``, both ends inclusive. Raises ValueError on any other form,
    on an end above U+10FFFF and on a range whose start exceeds its end."""
    m = _RANGE.match(text)
    if m is None:
        raise ValueError(f'{text!r} is not a code point range like "U+AC00-U+D7A3"')
    lo, hi = int(m[1], 16), int(m[2], 16)
    if hi > 0x10FFFF:
        raise ValueError(f"{text!r} ends above U+10FFFF")
    if lo > hi:
        raise ValueError(f"{text!r} starts after it ends")
    return lo, hi


def _check_range(text: str) -> str:
    parse_code_point_range(text)
    return text


def check_link(text: str) -> str:
    """Return ``text`` if it names a link model ("lte", "5g", "none" or "RTT_MS:MBPS"), else raise ValueError."""
    if _LINK.match(text) is None:
        raise ValueError(f"{text!r} is not a link model")
    return text


def _list_to_tuple(value: Any) -> Any:
    # TOML arrays arrive as lists; strict mode would refuse them for a fixed-length tuple.
    return tuple(value) if isinstance(value, list) else value


_Beta = Annotated[float, Field(ge=0, lt=1)]
CodePointRange = Annotated[str, AfterValidator(_check_range)]
Link = Annotated[str, AfterValidator(check_link)]

#: The Hangul blocks the paper forces into the keep set (App. A: "all 4,678 Hangul tokens"): Hangul Jamo,
#: Hangul Compatibility Jamo, Hangul Syllables.
HANGUL_RANGES = ["U+1100-U+11FF", "U+3130-U+318F", "U+AC00-U+D7A3"]


# ---- sections -----------------------------------------------------------------------------------------------


class RecipeInfo(Section):
    """``[recipe]``: what this recipe is."""

    name: str = Field("hyco", min_length=1, description="short name of the recipe, used in bundle and run names")
    description: str = Field("", description="one line on what the recipe deploys")


class Models(Section):
    """``[models]``: the four artifacts, each a local path (relative to the recipe's folder) or a hub id."""

    verifier: str = Field(
        "google/gemma-4-26B-A4B-it",
        min_length=1,
        description="the verifier LLM (paper: Gemma 4 26B-A4B-it), a folder with config.json + safetensors or a hub id",
    )
    head: str = Field(
        "google/gemma-4-26B-A4B-it-assistant",
        min_length=1,
        description="the verifier's MTP head, the assistant model (paper: 420M parameters, BF16 release)",
    )
    slm: str = Field(
        "google/gemma-4-E2B-it-qat-mobile-transformers",
        min_length=1,
        description="the SLM drafter, pre-quantized Gemma checkpoint with 2/4/8-bit weights (paper: Gemma 4 E2B-it)",
    )
    tokenizer: str = Field(
        "google/gemma-4-26B-A4B-it",
        min_length=1,
        description="tokenizer shared by all three models: a tokenizer.json, a folder holding one, or a hub id",
    )
    head_config_assumed: bool = Field(
        False,
        description="true while the head's config is assumed (real-shape planning without its config.json); "
        "reports mark every number derived from it as assumed",
    )


class KeepSet(Section):
    """``[keep_set]``: the restricted output vocabulary of both drafters (§3.3, App. A)."""

    size: int = Field(
        86089, ge=1, le=1_048_576, description="tokens in the keep set, always-kept classes included (paper: 86,089)"
    )
    corpus: str = Field(
        "", description="JSONL of conversations whose assistant turns are counted (path; empty = none given)"
    )
    corpus_conversations: int = Field(
        20000,
        ge=1,
        le=10_000_000,
        description="conversations of the corpus read for token counts (paper: 20,000 UC-tr)",
    )
    always_special: bool = Field(True, description="keep every special token regardless of frequency (paper: 24)")
    always_bytes: bool = Field(True, description="keep the 256 byte tokens, which spell any string")
    forced_ranges: list[CodePointRange] = Field(
        default_factory=lambda: list(HANGUL_RANGES),
        description="Unicode ranges whose tokens are always kept, 'U+XXXX-U+YYYY' inclusive (paper: the Hangul blocks)",
        json_schema_extra=_allowed('strings like "U+AC00-U+D7A3" (4-6 hex digits, start <= end <= U+10FFFF)'),
    )

    def code_point_ranges(self) -> list[tuple[int, int]]:
        """The forced ranges as inclusive ``(first, last)`` code points."""
        return [parse_code_point_range(r) for r in self.forced_ranges]

    @model_validator(mode="after")
    def _room_for_bytes(self) -> KeepSet:
        if self.always_bytes and self.size < 256:
            raise CrossFieldError(
                "size",
                self.size,
                "too small to hold the 256 byte tokens (always_bytes = true)",
                "an integer >= 256 while keep_set.always_bytes is true",
            )
        return self


class Tree(Section):
    """``[tree]``: the hybrid draft tree (Alg. 2-3, App. C, Table 5)."""

    chain_length: int = Field(4, ge=1, le=16, description="K, the MTP head's chain length in tokens per round")
    sibling_depth: int = Field(
        2, ge=0, le=16, description="D, runner-up siblings are planted at chain depths 1..D (0 = none; Alg. 2 line 11)"
    )
    node_budget: int = Field(
        32, ge=1, le=1024, description="B, draft nodes kept after the trim; the verifier sees B+1 rows"
    )
    depth_cost: float = Field(
        0.66, gt=0, lt=1, description="lambda; every tree edge adds ln(lambda) to a node's score (Alg. 3)"
    )
    slm_candidates: int = Field(32, ge=1, le=1024, description="SLM candidates per expanded row (Alg. 3 line 12)")
    slm_passes: Literal[1, 2] = Field(1, description="SLM forwards per round: 1 = HyCo, 2 = HyCo-2P (Alg. 3 line 15)")
    specedge_passes: int = Field(
        4, ge=1, le=16, description="sequential SLM passes of the SLM-only SpecEdge-style tree (Table 5)"
    )
    specedge_nodes: int = Field(32, ge=1, le=1024, description="draft nodes of the SpecEdge-style tree (Table 5)")

    table: ClassVar[str] = "tree"
    bounds = (Bound("sibling_depth", "chain_length", "siblings can only be planted beside chain tokens, and {limit}"),)


class Window(Section):
    """``[window]``: the drafters' context windows (§3.4, Alg. 2)."""

    head_window: int = Field(1024, ge=1, le=65536, description="W, verifier KV positions the MTP head reads, in tokens")
    slm_window: int = Field(1024, ge=1, le=65536, description="committed positions in the SLM's ring KV, in tokens")
    slm_sliding_window: int = Field(
        512, ge=1, le=65536, description="ring length of the SLM's sliding-window layers, in tokens (paper: W/2 = 512)"
    )
    head_query_position_offset: Literal[-1, 0] = Field(
        0,
        description="the head's query rotary position relative to the root position t: 0 = t as transformers' "
        "SinglePositionMultiTokenCandidateGenerator feeds Gemma 4's released head (tests/test_head_convention.py); "
        "-1 = t-1 as the paper fixes (Alg. 2 line 6; the toy head is trained so)",
    )

    head_sliding_window_inclusive: bool = Field(
        True,
        description="the head's sliding layers read the last sliding_window + 1 committed positions, as transformers' "
        "Gemma4AssistantForCausalLM masks its shared KV (|q - kv| <= sliding_window; tests/test_head_convention.py); "
        "false: the last sliding_window (the toy head's training). At most W either way",
    )

    table: ClassVar[str] = "window"
    bounds = (
        Bound(
            "slm_sliding_window", "slm_window", "the sliding layers' ring cannot be longer than the SLM ring ({limit})"
        ),
    )


class Acceptance(Section):
    """``[acceptance]``: the verifier's acceptance rule (§3.5, Alg. 4 line 6)."""

    epsilon: float = Field(
        messages.DEFAULT_EPSILON,
        gt=0,
        le=1,
        description="accept a drafted child c of v when p~(c|v) >= epsilon; 1 = exact",
    )
    mode: Literal["epsilon", "exact"] = Field(
        messages.DEFAULT_ACCEPTANCE,
        description="'epsilon' = epsilon-threshold acceptance; 'exact' = lossless (epsilon taken as 1)",
    )

    @property
    def effective_epsilon(self) -> float:
        """The threshold the verifier applies: 1.0 under exact acceptance (App. C), else ``epsilon``."""
        return 1.0 if self.mode == "exact" else self.epsilon


class Sampling(Section):
    """``[sampling]``: the verifier's sampling distribution p~ (Alg. 4 line 5) and the output cap.

    The table of a recipe, not a second distribution: its defaults are the protocol's
    (`hycoc.protocol.messages.DEFAULT_SAMPLING`, ``DEFAULT_MAX_NEW_TOKENS``, ``DEFAULT_SEED``) and `distribution`
    is the `hycoc.protocol.messages.Sampling` a request carries."""

    temperature: float = Field(
        messages.DEFAULT_SAMPLING.temperature,
        ge=0,
        le=100,
        description="softmax temperature; 0 = greedy (arg-max, ties to lowest id)",
    )
    top_k: int = Field(
        messages.DEFAULT_SAMPLING.top_k, ge=1, le=1_048_576, description="largest logits kept before the nucleus cut"
    )
    top_p: float = Field(
        messages.DEFAULT_SAMPLING.top_p, gt=0, le=1, description="nucleus mass kept after top-k, then renormalized"
    )
    max_new_tokens: int = Field(
        messages.DEFAULT_MAX_NEW_TOKENS,
        ge=1,
        le=1_048_576,
        description="output cap per request, in tokens (paper: 1,024 on SB)",
    )
    seed: int = Field(
        messages.DEFAULT_SEED,
        ge=0,
        le=2**63 - 1,
        description="seed of the verifier's per-session sampler and of the device runtime",
    )

    @property
    def distribution(self) -> messages.Sampling:
        """The protocol's p~ with this table's temperature, top-k and top-p (what an OPEN carries)."""
        return messages.Sampling(self.temperature, self.top_k, self.top_p)


class HeadQat(Section):
    """``[head_qat]``: KL-based 4-bit QAT of the MTP head (App. A Table 4)."""

    weight_bits: Literal[2, 4, 8] = Field(4, description="bits of every linear weight, output layer included")
    steps: int = Field(100, ge=0, le=1_000_000, description="optimizer steps (0 = post-training quantization only)")
    lr: float = Field(1e-5, gt=0, le=1, description="peak AdamW learning rate")
    warmup_steps: int = Field(50, ge=0, le=1_000_000, description="linear warm-up steps before the schedule")
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="learning-rate decay after warm-up")
    grad_accum: int = Field(2, ge=1, le=1024, description="sequences accumulated per step (batch 1 sequence)")
    grad_clip: float = Field(1.0, gt=0, le=1e6, description="gradient-norm clip")
    betas: Annotated[tuple[_Beta, _Beta], BeforeValidator(_list_to_tuple)] = Field(
        (0.9, 0.95),
        description="AdamW (beta1, beta2)",
        json_schema_extra=_allowed("two numbers, each in [0, 1)"),
    )
    weight_decay: float = Field(0.0, ge=0, le=1, description="AdamW weight decay (paper: none)")
    clip_search_max: float = Field(1.0, gt=0, le=1, description="largest clip ratio of the per-channel MSE search")
    clip_search_min: float = Field(0.6, gt=0, le=1, description="smallest clip ratio of the per-channel MSE search")
    clip_search_points: int = Field(9, ge=1, le=1000, description="clip ratios tried, evenly spaced from max to min")
    calibration_prompts: int = Field(60, ge=1, le=100_000, description="training prompts (paper: 60 UC-tr first turns)")
    calibration_max_new_tokens: int = Field(
        1024, ge=1, le=1_048_576, description="cap on the verifier's greedy answers to training prompts, in tokens"
    )
    eval_prompts: int = Field(
        60, ge=1, le=100_000, description="held-out prompts for top-1 agreement (paper: 60 UC-val)"
    )
    eval_max_new_tokens: int = Field(
        512, ge=1, le=1_048_576, description="cap on the verifier's greedy answers to eval prompts"
    )
    max_seq_len: int = Field(
        2048, ge=2, le=1_048_576, description="longest training sequence, prompt + answer, in tokens"
    )
    input_range_percentile: float = Field(
        99.99, gt=0, le=100, description="percentile of the captured inputs that fixes the head's input ranges"
    )
    calibration_data: str = Field(
        "", description="JSONL of prompts for training and evaluation (path; empty = the keep-set corpus)"
    )

    table: ClassVar[str] = "head_qat"
    bounds = (
        Bound("clip_search_min", "clip_search_max", "must be below {limit}", strict=True),
        Bound("warmup_steps", "steps", "exceeds {limit}"),
        Bound("calibration_max_new_tokens", "max_seq_len", "leaves no room for the prompt in {limit}", strict=True),
        Bound("eval_max_new_tokens", "max_seq_len", "leaves no room for the prompt in {limit}", strict=True),
    )


class SlmCalibration(Section):
    """``[slm_calibration]``: activation calibration of the SLM drafter (App. A)."""

    prompts: int = Field(60, ge=1, le=100_000, description="calibration prompts, answered greedily by the verifier")
    percentile: float = Field(99.9, gt=0, le=100, description="percentile of |activation| that sets a range")
    range_scale: float = Field(
        1.2, gt=0, le=100, description="factor on the percentile; the range is percentile x scale"
    )
    activation_bits: Literal[8, 16] = Field(16, description="bits of activations in the graph")
    kv_bits: Literal[8, 16] = Field(8, description="bits of the SLM's KV ring inputs")


class Handoff(Section):
    """``[handoff]``: the hand-off H the verifier sends each round (§3.1, Alg. 4 line 14, App. A).

    The six scales are fixed int8 scales (real value = scale x integer); they are calibrated per verifier and
    unset (None) until then.
    """

    bits: Literal[8] = Field(8, description="integer width of every hand-off value on the wire (paper: 8)")
    hidden: Literal["pre_norm", "post_norm"] = Field(
        "post_norm",
        description="h is taken after the verifier's final norm ('post_norm': transformers' "
        "hidden_states[-1], what Gemma 4's released head is fed; tests/test_head_convention.py) or before it "
        "('pre_norm', the paper's App. A; the toy head is trained so)",
    )
    scale_embedding: float | None = Field(None, gt=0, description="int8 scale of e(b), the bonus token's embedding")
    scale_hidden: float | None = Field(None, gt=0, description="int8 scale of h, the verifier's last hidden state")
    scale_k_sliding: float | None = Field(None, gt=0, description="int8 scale of K of the last sliding layer")
    scale_v_sliding: float | None = Field(None, gt=0, description="int8 scale of V of the last sliding layer")
    scale_k_full: float | None = Field(None, gt=0, description="int8 scale of K of the last full-attention layer")
    scale_v_full: float | None = Field(None, gt=0, description="int8 scale of V of the last full-attention layer")

    def scales(self) -> dict[str, float]:
        """All six scales by key (``"embedding"``, ``"hidden"``, ``"k_sliding"``, ...).

        Raises RecipeError naming every unset ``handoff.scale_*`` key.
        """
        values = {
            name.removeprefix("scale_"): getattr(self, name)
            for name in type(self).model_fields
            if name.startswith("scale_")
        }
        missing = [f"handoff.scale_{k}" for k, v in values.items() if v is None]
        if missing:
            raise RecipeError(
                [
                    Problem(k, None, f"{k} is not set; the hand-off needs a fixed int8 scale (allowed: a number > 0)")
                    for k in missing
                ]
            )
        return values
