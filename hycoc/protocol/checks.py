"""Field checks of every wire message (`validate`), run by `encode` before a frame is sent (without limits) and by
`decode` after a frame is read (against the receiver's `Limits`).

Each check raises the `hycoc.protocol.errors` class of the first fault, naming the field, the row where there is
one, and what is allowed (the rules are the module docstring of `hycoc.protocol.wire`). numpy only.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from hycoc.protocol.errors import (
    ERROR_CODE,
    BadEnum,
    BadEpsilon,
    BadHandoffRange,
    BadParent,
    BadPath,
    BadScores,
    BadShape,
    BadTemperature,
    BadText,
    BadTopK,
    BadTopP,
    BonusMismatch,
    ConfigMismatch,
    ContextOverflow,
    HandoffSizeMismatch,
    NotFinite,
    OutOfRange,
    TokenOutOfVocab,
    UnknownMessageType,
    WrongRowCount,
)
from hycoc.protocol.layout import FP16_SCORE_FLOOR, MAX_TREE_ROWS, SCALE_NAMES, Limits
from hycoc.protocol.messages import (
    ACCEPTANCE_MODES,
    DRAFT_PLACES,
    FINISH_REASONS,
    MAX_DRAFT_MS,
    AppendTurn,
    Close,
    DraftTree,
    ErrorReply,
    HandOff,
    Opened,
    OpenRequest,
    RoundReply,
)


def _f32(x, field: str) -> float:
    with np.errstate(over="ignore", invalid="ignore"):
        v = float(np.float32(x))
    if not math.isfinite(v):
        raise NotFinite(f"{field} = {x!r}: must be a finite float32 (no NaN or inf)")
    return v


def _uint(x, field: str, bits: int, lo: int = 0) -> int:
    x = int(x)
    hi = 2**bits - 1
    if not lo <= x <= hi:
        raise OutOfRange(f"{field} = {x}: must lie in [{lo}, {hi}]")
    return x


def _int_array(a, field: str) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != 1 or a.dtype.kind not in "iu":
        raise BadShape(f"{field}: must be a 1-D integer array, got dtype {a.dtype} and shape {a.shape}")
    return a.astype(np.int64, copy=False)


def _int8_array(a, field: str, ndim: int) -> np.ndarray:
    a = np.asarray(a)
    if a.ndim != ndim or a.dtype != np.int8:
        raise BadShape(f"{field}: must be a {ndim}-D int8 array, got dtype {a.dtype} and shape {a.shape}")
    return a


def _check_token(x: int, field: str, vocab_size: int | None) -> None:
    hi = 2**31 if vocab_size is None else vocab_size
    if not 0 <= int(x) < hi:
        raise TokenOutOfVocab(f"{field} = {int(x)}: token ids must lie in [0, {hi})")


def _check_tokens(ids: np.ndarray, field: str, vocab_size: int | None) -> None:
    hi = 2**31 if vocab_size is None else vocab_size
    bad = (ids < 0) | (ids >= hi)
    if bad.any():
        row = int(np.argmax(bad))
        raise TokenOutOfVocab(f"{field}[{row}] = {int(ids[row])}: token ids must lie in [0, {hi})")


def check_rows(rows: int, field: str, limits: Limits) -> None:
    """A tree's row count ``rows`` (ROUND rows, REPLY samples, OPENED tree_rows): 1 to MAX_TREE_ROWS (parents are
    int16), and at most ``limits.tree_rows`` (B + 1 of the session) where known (protocol 6: a tree drafted under
    a smaller allowance has fewer rows); raises WrongRowCount naming ``field``."""
    if not 1 <= rows <= MAX_TREE_ROWS:
        raise WrongRowCount(f"{field} has {rows} rows: a tree has 1 to {MAX_TREE_ROWS} rows (B <= 32767)")
    if limits.tree_rows is not None and rows > limits.tree_rows:
        raise WrongRowCount(f"{field} has {rows} rows, at most {limits.tree_rows} (B + 1 of this session)")


def _check_token_run(ids, field: str, limits: Limits, needs: str, room: str = "") -> np.ndarray:
    """The ids of a prompt or a turn, checked and returned as an int array: at least one (``needs`` says why),
    fewer than the verifier's max_context (``room`` ends that message; ``{most}`` in it: max_context - 1), a u32
    count, each in the vocabulary."""
    tokens = _int_array(ids, field)
    if tokens.size == 0:
        raise OutOfRange(f"{field} is empty: {needs}")
    if limits.max_context is not None and tokens.size >= limits.max_context:
        raise ContextOverflow(
            f"{field} has {tokens.size} tokens: the verifier holds max_context = {limits.max_context} positions"
            + room.format(most=limits.max_context - 1)
        )
    _uint(tokens.size, f"{field} length", 32)
    _check_tokens(tokens, field, limits.vocab_size)
    return tokens


def _check_open(m: OpenRequest, limits: Limits) -> None:
    prompt = _check_token_run(
        m.prompt_ids,
        "OpenRequest.prompt_ids",
        limits,
        "a request needs at least one token (the first root)",
        ", prompt and output together, so a prompt may have at most {most} tokens",
    )
    s = m.sampling
    if _f32(s.temperature, "Sampling.temperature") < 0:
        raise BadTemperature(f"Sampling.temperature = {s.temperature}: must be >= 0 (0 means greedy)")
    if not 1 <= int(s.top_k) <= 2**32 - 1:
        raise BadTopK(f"Sampling.top_k = {s.top_k}: must be >= 1 (u32)")
    if not 0 < _f32(s.top_p, "Sampling.top_p") <= 1:
        raise BadTopP(f"Sampling.top_p = {s.top_p}: must lie in (0, 1]")
    _uint(m.seed, "OpenRequest.seed", 64)
    if m.acceptance not in ACCEPTANCE_MODES:
        raise BadEnum(f"OpenRequest.acceptance = {m.acceptance!r}: must be one of {ACCEPTANCE_MODES}")
    if m.draft_place not in DRAFT_PLACES:
        raise BadEnum(f"OpenRequest.draft_place = {m.draft_place!r}: must be one of {DRAFT_PLACES}")
    if not 0 < _f32(m.epsilon, "OpenRequest.epsilon") <= 1:
        raise BadEpsilon(f"OpenRequest.epsilon = {m.epsilon}: must lie in (0, 1] (1 = exact acceptance)")
    _uint(m.max_new_tokens, "OpenRequest.max_new_tokens", 32, lo=1)
    if m.auth_token is not None:
        if not isinstance(m.auth_token, str) or not 1 <= len(m.auth_token.encode("utf-8")) <= 65535:
            raise BadText("OpenRequest.auth_token: must be None or a non-empty string of at most 65,535 utf-8 bytes")
    if m.chat is not None:
        if not isinstance(m.chat, str) or not 1 <= len(m.chat.encode("utf-8")) <= 65535:
            raise BadText("OpenRequest.chat: must be None or a non-empty string of at most 65,535 utf-8 bytes")
    if not 0 <= int(m.anchor) < max(1, prompt.size):
        raise OutOfRange(
            f"OpenRequest.anchor = {m.anchor}: must lie in [0, T = {prompt.size}) (the prompt's model-turn "
            "opening; 0 = none)"
        )
    for name in ("draft_ms_floor", "draft_ms_tree"):
        value = _f32(getattr(m, name), f"OpenRequest.{name}")
        if not 0 <= value <= MAX_DRAFT_MS:
            raise OutOfRange(
                f"OpenRequest.{name} = {value}: must lie in [0, {MAX_DRAFT_MS:g}] ms (the device's drafting time "
                "per round; 0 = unknown)"
            )


def _check_opened(m: Opened, limits: Limits) -> None:
    _uint(m.session_id, "Opened.session_id", 64)
    max_context = _uint(m.max_context, "Opened.max_context", 32, lo=1)
    if not 0 <= int(m.t) < max_context:
        raise ContextOverflow(f"Opened.t = {m.t}: the first root must sit in [0, max_context = {max_context})")
    if _f32(m.prefill_ms, "Opened.prefill_ms") < 0:
        raise OutOfRange(f"Opened.prefill_ms = {m.prefill_ms}: must be >= 0 (milliseconds)")
    check_rows(int(m.tree_rows), "Opened.tree_rows", Limits())
    stops = tuple(m.stop_ids)
    if not 1 <= len(stops) <= 65535:
        raise OutOfRange(f"Opened.stop_ids has {len(stops)} ids: the verifier stops on 1 to 65,535 ids")
    for i in stops:
        _check_token(int(i), "Opened.stop_ids", limits.vocab_size)
    for name in ("vocab_size", "hidden_size", "kv_dim_sliding", "kv_dim_full", "tree_rows"):
        got = _uint(getattr(m, name), f"Opened.{name}", 32, lo=1)
        want = getattr(limits, name)
        if want is not None and got != want:
            raise ConfigMismatch(f"Opened.{name} = {got}: this device was built for {name} = {want}")


def _check_tree(m: DraftTree, limits: Limits) -> None:
    _uint(m.seq, "DraftTree.seq", 32)
    tokens = _int_array(m.tokens, "DraftTree.tokens")
    parents = _int_array(m.parents, "DraftTree.parents")
    if tokens.size != parents.size:
        raise WrongRowCount(f"DraftTree has {tokens.size} tokens but {parents.size} parents: one each per row")
    check_rows(tokens.size, "DraftTree", limits)
    _check_tokens(tokens, "DraftTree.tokens", limits.vocab_size)
    if parents[0] != -1:
        raise BadParent(f"DraftTree.parents[0] = {int(parents[0])}: row 0 is the root, its parent must be -1")
    # 0 <= parents[j] < j: every row hangs below an earlier one, which also rules out cycles.
    rows = np.arange(parents.size)
    bad = (parents < 0) | (parents >= rows)
    bad[0] = False
    if bad.any():
        j = int(np.argmax(bad))
        raise BadParent(
            f"DraftTree.parents[{j}] = {int(parents[j])}: row {j}'s parent must be an earlier row, in [0, {j})"
        )
    if m.scores is not None:
        _check_scores(m.scores, parents)


def _check_scores(scores, parents: np.ndarray) -> None:
    """DraftTree.scores: float (R,), finite, the root's 0, no row above its parent (Alg. 3: every edge adds
    ln q + ln λ < 0). fp16 rounding is monotone, so scores that pass in float32 pass after the wire's cast."""
    a = np.asarray(scores)
    if a.ndim != 1 or a.dtype.kind != "f" or a.size != parents.size:
        raise BadShape(
            f"DraftTree.scores: must be a 1-D float array of {parents.size} values (one per row), got "
            f"dtype {a.dtype} and shape {a.shape}"
        )
    with np.errstate(over="ignore"):
        a = a.astype(np.float32)
    bad = ~np.isfinite(a)
    if bad.any():
        j = int(np.argmax(bad))
        raise NotFinite(
            f"DraftTree.scores[{j}] = {a[j]}: scores must be finite (the device clamps at {FP16_SCORE_FLOOR:g})"
        )
    if a[0] != 0:
        raise BadScores(f"DraftTree.scores[0] = {a[0]}: the root's score is 0 (Alg. 3 line 2)")
    above = a[1:] > a[parents[1:]]
    if above.any():
        j = int(np.argmax(above)) + 1
        raise BadScores(
            f"DraftTree.scores[{j}] = {a[j]:g} is above its parent row {int(parents[j])}'s "
            f"{a[parents[j]]:g}: a row scores at most its parent (Alg. 3: s(child) = s(parent) + "
            "ln q + ln λ)"
        )


def check_handoff_sizes(hidden_size: int, kv_dim_sliding: int, kv_dim_full: int, limits: Limits) -> None:
    """A hand-off's sizes: each >= 1 and equal to the session's (``limits``) where known; raises
    HandoffSizeMismatch naming the size."""
    sizes = {"hidden_size": hidden_size, "kv_dim_sliding": kv_dim_sliding, "kv_dim_full": kv_dim_full}
    for name, got in sizes.items():
        want = getattr(limits, name)
        if got < 1 or (want is not None and got != want):
            allowed = ">= 1" if want is None else f"{want}, this session's verifier size"
            raise HandoffSizeMismatch(f"HandOff {name} = {got}: must be {allowed}")


def _check_handoff(h: HandOff, limits: Limits, bonus: int) -> None:
    t_prime = _uint(h.t_prime, "HandOff.t_prime", 32)
    a = _uint(h.a, "HandOff.a", 32)
    if a > t_prime:
        raise BadHandoffRange(f"HandOff.a = {a} is after t_prime = {t_prime}: must satisfy a <= t_prime")
    n = t_prime - a
    if limits.max_context is not None and (n > limits.max_context or t_prime > limits.max_context):
        raise ContextOverflow(
            f"HandOff n_positions = {n}, t_prime = {t_prime}: both must be <= max_context = {limits.max_context}"
        )
    if int(h.bonus) != bonus:
        raise BonusMismatch(f"HandOff.bonus = {h.bonus}: must equal RoundReply.bonus = {bonus}")
    x_hat = _int8_array(h.x_hat, "HandOff.x_hat", 1)
    if x_hat.size == 0 or x_hat.size % 2:
        raise BadShape(f"HandOff.x_hat has {x_hat.size} values: must be [e(b); h], 2 * hidden_size")
    dims = {}
    for layer in ("sliding", "full"):
        k = _int8_array(getattr(h, f"k_{layer}"), f"HandOff.k_{layer}", 2)
        v = _int8_array(getattr(h, f"v_{layer}"), f"HandOff.v_{layer}", 2)
        if k.shape != v.shape:
            raise BadShape(f"HandOff.k_{layer} has shape {k.shape}, v_{layer} {v.shape}: they must match")
        if k.shape[0] != n:
            raise HandoffSizeMismatch(f"HandOff.k_{layer} has {k.shape[0]} rows: must be t_prime - a = {n} positions")
        dims[layer] = k.shape[1]
    check_handoff_sizes(x_hat.size // 2, dims["sliding"], dims["full"], limits)
    if len(h.scales) != len(SCALE_NAMES):
        raise BadShape(f"HandOff.scales has {len(h.scales)} values: must be {len(SCALE_NAMES)} {SCALE_NAMES}")
    for name, scale in zip(SCALE_NAMES, h.scales):
        if _f32(scale, f"HandOff.scales[{name}]") <= 0:
            raise OutOfRange(f"HandOff.scales[{name}] = {scale}: must be > 0 (dequantize as int8 * scale)")


def _check_reply(m: RoundReply, limits: Limits) -> None:
    _uint(m.seq, "RoundReply.seq", 32)
    _check_token(m.bonus, "RoundReply.bonus", limits.vocab_size)
    if _f32(m.server_ms, "RoundReply.server_ms") < 0:
        raise OutOfRange(f"RoundReply.server_ms = {m.server_ms}: must be >= 0 (milliseconds)")
    samples = _int_array(m.samples, "RoundReply.samples")
    check_rows(samples.size, "RoundReply.samples", limits)
    _check_tokens(samples, "RoundReply.samples", limits.vocab_size)
    path = _int_array(m.path_rows, "RoundReply.path_rows")
    # The path runs down from the root, so its rows grow (parents come before children) and never hit row 0.
    bad = (path < 1) | (path >= samples.size)
    bad[1:] |= path[1:] <= path[:-1]
    if bad.any():
        i = int(np.argmax(bad))
        raise BadPath(
            f"RoundReply.path_rows[{i}] = {int(path[i])}: path rows must increase and lie in [1, {samples.size})"
        )
    if m.verified is not None:
        verified = np.asarray(m.verified)
        if verified.dtype != np.bool_ or verified.shape != samples.shape:
            raise BadShape(
                f"RoundReply.verified: must be a bool array of {samples.size} values (one per row), got "
                f"dtype {verified.dtype} and shape {verified.shape}"
            )
        if not verified[0]:
            raise BadPath("RoundReply.verified[0] is False: the root (row 0) is always verified")
        off = ~verified[path]
        if off.any():
            i = int(np.argmax(off))
            raise BadPath(
                f"RoundReply.path_rows[{i}] = {int(path[i])} is not a verified row: the path runs through "
                "verified rows only"
            )
    chain = _int_array(m.chain, "RoundReply.chain")
    _uint(chain.size, "RoundReply.chain length", 16)
    _check_tokens(chain, "RoundReply.chain", limits.vocab_size)
    end = int(path[-1]) if path.size else 0
    if int(samples[end]) != int(m.bonus):  # Alg. 4 line 12: b = y^_{v*}
        raise BonusMismatch(
            f"RoundReply.bonus = {m.bonus}: must equal samples[{end}] = {int(samples[end])}, the sample at v*"
        )
    if m.finish_reason is not None and (not m.finished or m.finish_reason not in FINISH_REASONS):
        raise BadEnum(
            f"RoundReply.finish_reason = {m.finish_reason!r}: must be None, or one of "
            f"{', '.join(FINISH_REASONS)} on a finished reply"
        )
    _check_allowance(m, limits)
    if m.handoff is not None:
        _check_handoff(m.handoff, limits, int(m.bonus))


def _check_allowance(m: RoundReply, limits: Limits) -> None:
    """REPLY's allowance (protocol 6): the rows the next ROUND may hold, from the root (1) to the session's tree_rows
    where known; 0 (none) only on a finished reply, which has no next round."""
    allowance = _uint(m.allowance, "RoundReply.allowance", 16)
    if allowance == 0 and not m.finished:
        raise OutOfRange(
            "RoundReply.allowance = 0: an unfinished reply grants the next round at least its root (1 row); the "
            "verifier sets it (hycoc.verifier.allowance)"
        )
    if limits.tree_rows is not None and allowance > limits.tree_rows:
        raise OutOfRange(
            f"RoundReply.allowance = {allowance}: must lie in [1, {limits.tree_rows}] (this session's tree_rows, B + 1)"
        )


def _check_close(m: Close, limits: Limits) -> None:
    _uint(m.session_id, "Close.session_id", 64)


def _check_append(m: AppendTurn, limits: Limits) -> None:
    tokens = _check_token_run(m.tokens, "AppendTurn.tokens", limits, "a turn needs at least one token (the next root)")
    if not 1 <= int(m.max_new_tokens) <= 2**32 - 1:
        raise OutOfRange(f"AppendTurn.max_new_tokens = {m.max_new_tokens}: must be >= 1 (u32)")
    keep = _uint(m.keep, "AppendTurn.keep", 32, lo=1)
    _uint(m.keep_crc, "AppendTurn.keep_crc", 32)
    if limits.max_context is not None and keep + tokens.size >= limits.max_context:
        raise ContextOverflow(
            f"AppendTurn: keep + T = {keep + tokens.size} positions: the verifier holds max_context "
            f"= {limits.max_context}, conversation and output together"
        )
    _uint(m.anchor, "AppendTurn.anchor", 32)
    if int(m.anchor) != 0 and not keep <= int(m.anchor) < keep + tokens.size:
        raise OutOfRange(
            f"AppendTurn.anchor = {m.anchor}: must lie in [keep, keep + T) = [{keep}, "
            f"{keep + tokens.size}) or be 0 (none)"
        )


def _check_error(m: ErrorReply, limits: Limits) -> None:
    if not isinstance(m.code, str) or not ERROR_CODE.fullmatch(m.code) or len(m.code) > 255:
        raise BadText(f"ErrorReply.code = {m.code!r}: must match [a-z][a-z0-9_]* and be at most 255 bytes")
    if not isinstance(m.message, str) or len(m.message.encode("utf-8")) > 65535:
        raise BadText("ErrorReply.message: must be a string of at most 65,535 utf-8 bytes")


_CHECKS: dict[type, Callable[[Any, Limits], None]] = {
    OpenRequest: _check_open,
    Opened: _check_opened,
    DraftTree: _check_tree,
    RoundReply: _check_reply,
    Close: _check_close,
    ErrorReply: _check_error,
    AppendTurn: _check_append,
}


def validate(msg, limits: Limits | None = None) -> None:
    """Check every field of ``msg`` (and against ``limits``); raises the WireError subclass of the first fault."""
    check = _CHECKS.get(type(msg))
    if check is None:
        raise UnknownMessageType(
            f"{type(msg).__name__} is not a wire message: must be one of {[c.__name__ for c in _CHECKS]}"
        )
    check(msg, limits or Limits())
