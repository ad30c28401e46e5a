"""KL-based 4-bit QAT of the MTP head (paper §3.2, App. A Table 4; docs/design.md "Table 4: the head's 4-bit QAT").

    restrict_output_layer    the head with an untied output layer over the keep set (§3.3, App. A;
                             `hycoc.passes.head.quantize`)
    capture_answers          over each calibration prompt + the verifier's greedy answer, one verifier pass captures
                             the head's inputs: e (input embedding), h (last hidden state, before the final norm as
                             the hand-off carries it), K/V of the last sliding and last full layer (App. A;
                             `hycoc.passes.head.captures`)
    search_clip              per-output-channel MSE clip-ratio search (Table 4 "Weight clipping", ratio 1.0-0.6;
                             `hycoc.passes.head.quantize`, which says how the head is quantized)
    quantize_head            every Linear fake-quantized at its scale with a straight-through estimator (`QuantLinear`)
    unroll                   the K drafting steps (Alg. 2 lines 7-12) at every response anchor of a sequence
    train_qat                KL to the full-precision head on response tokens; AdamW beta (0.9, 0.95), no weight
                             decay, grad-norm clip 1.0, lr 1e-5, 50 warm-up steps, cosine, 100 steps, batch 1
                             sequence, 2 accumulation steps (Table 4); norms and embeddings frozen
    export_head              the trained integers and per-channel scales (`QuantizedHead`), bit-exact what the QDQ
                             export must use: weight == qweight * scale in float32, exactly as trained

This module holds the unroll, the agreement, the training loop and `HeadQatPass`; the work around them is split by
job: `hycoc.passes.head.quantize` (the integer format, the clip search, the export), `hycoc.passes.head.captures`
(the verifier's answers and states), `hycoc.passes.head.prompts` (where the prompts come from) and
`hycoc.passes.head.errors` (`HeadQatError`); import each name from its home.

The unroll (as `hycoc.toy.train.head_unroll`, which trained the head): for root position t (the root token x_t
sits at t, its KV does not exist yet), step k = 1..K reads [e(x_{t+k-1}); z] with z = h_{t-1} at k = 1 and the
head's own projected state after, queries at the fixed rotary position t + ``window.head_query_position_offset``
(paper: t - 1, Alg. 2 line 6), and sees the full layer's KV over [t - W, t) and the sliding layer's over
[t - min(W, S), t) (Alg. 2 line 5; S the positions the head's sliding layers read,
`hycoc.host.head_sliding_positions`). The tokens fed at k >= 2 are the verifier's greedy answer, which
is what the chain drafts whenever it is right, embedded by the verifier's float embedding (the device reads the
8-bit table E instead, Alg. 2 line 12; its rounding, at most half a row's step, is not trained on). Anchors are
the response positions t in [prompt_len, L - K], so every predicted token t + 1 .. t + K is a response token
("KL on response tokens", Table 4).

Top-1 agreement (the numbers of §3.2): on the held-out prompts, answered the same way, both heads run this unroll
on the same tokens, each with its own state z; depth k's agreement is the share of anchors whose arg-max over the
keep set (first among equals) is the same for the quantized and the full-precision head.

Precision: float32 master weights; on a CUDA device the forward runs under bfloat16 autocast (Table 4,
`qat_autocast`), on a CPU in float32. Everything runs on the verifier's device (`hycoc build --device cuda` puts the
verifier on the GPU in bfloat16, `hycoc.passes.build.build_inputs`; the teacher head is moved there in its saved
dtype and the student trains there).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from hycoc.passes.artifacts import KeepSetArtifact, QuantizedHeadArtifact, TorchModelArtifact
from hycoc.passes.calibration_answers import CalibrationAnswersArtifact
from hycoc.passes.head.captures import Capture, capture_answers
from hycoc.passes.head.errors import HeadQatError
from hycoc.passes.head.quantize import clip_ratios, export_head, percentile_abs, quantize_head, restrict_output_layer
from hycoc.passes.pipeline import Pass, PassReport
from torch import nn

from hycoc.host import head_sliding_positions
from hycoc.mtp import FULL, SLIDING, head_step, window_mask
from hycoc.recipe import HeadQat, Recipe

# ---- the unrolled drafting steps ----------------------------------------------------------------------------


@dataclass
class Unroll:
    """The K-step setting of one sequence (module docstring): anchors t int64 [n] (root positions, response
    only), masks {SLIDING, FULL} float [1, 1, n, L] (finite -1e4 outside the window), pos int64 [1, n]
    (the query's rotary position), k_steps K."""

    anchors: torch.Tensor
    masks: dict[str, torch.Tensor]
    pos: torch.Tensor
    k_steps: int


def plan_unroll(cap: Capture, k_steps: int, window: int, sliding_window: int, position_offset: int) -> Unroll | None:
    """Anchors t in [max(prompt_len, 1), L - K] with their masks and positions, None when there are none."""
    L = cap.length
    first, last = max(cap.prompt_len, 1), L - k_steps
    if last < first:
        return None
    device = cap.e.device
    t = torch.arange(first, last + 1, device=device)[None]
    masks = {FULL: window_mask(t, L, window), SLIDING: window_mask(t, L, min(window, sliding_window))}
    return Unroll(t[0], masks, t + position_offset, k_steps)


def unroll(head, cap: Capture, plan: Unroll, dtype=torch.float32) -> list[torch.Tensor]:
    """Alg. 2 lines 7-12 at every anchor of ``plan`` at once: K logits tensors [1, n, |V|] (entry k-1 scores the
    token at t + k) from inputs [e(x_{t+k-1}); z], z = h_{t-1} then the head's own projected state."""
    t = plan.anchors
    kv = {kind: (k.to(dtype), v.to(dtype)) for kind, (k, v) in cap.kv.items()}
    masks = {kind: m.to(dtype) for kind, m in plan.masks.items()}
    z = cap.h[:, t - 1].to(dtype)
    outs = []
    for k in range(plan.k_steps):
        x_hat = torch.cat([cap.e[:, t + k].to(dtype), z], dim=-1)
        logits, z = head_step(head, x_hat, kv, masks, plan.pos)
        outs.append(logits)
    return outs


def kl_to_teacher(student: Sequence[torch.Tensor], teacher: Sequence[torch.Tensor]) -> torch.Tensor:
    """Mean over depths and anchors of KL(teacher || student) over the keep set (Table 4 "Loss: KL")."""
    total: torch.Tensor | float = 0.0
    for s, t in zip(student, teacher):
        log_t = F.log_softmax(t.float(), -1)
        total = total + (log_t.exp() * (log_t - F.log_softmax(s.float(), -1))).sum(-1).mean()
    if not isinstance(total, torch.Tensor):
        raise HeadQatError("the KL loss needs at least one depth of logits, got none")
    return total / len(student)


@torch.no_grad()
def top1_agreement(student, teacher, plans: Sequence[tuple[Capture, Unroll]]) -> tuple[list[float], int]:
    """Per depth 1..K: the share of anchors where the two heads' keep-set arg-max agree (module docstring).
    Returns (shares, anchors counted)."""
    hits, n = None, 0
    for cap, plan in plans:
        s_out, t_out = unroll(student, cap, plan), unroll(teacher, cap, plan)
        h = torch.stack([(s.argmax(-1) == t.argmax(-1)).sum() for s, t in zip(s_out, t_out)]).cpu()
        hits = h if hits is None else hits + h
        n += len(plan.anchors)
    if hits is None or not n:
        raise HeadQatError("no response anchors to measure agreement on: every answer is shorter than K tokens")
    return [round(float(x) / n, 6) for x in hits], n


@torch.no_grad()
def evaluate_students(
    students: dict[str, nn.Module], teacher, plans: Sequence[tuple[Capture, Unroll]], progress=None
) -> tuple[dict[str, list[float]], dict[str, float], int]:
    """`top1_agreement` and `mean_kl` of every student against ``teacher`` with one teacher unroll per sequence
    (the teacher's outputs are the same for all students). Returns ({name: per-depth shares}, {name: KL}, anchors);
    each value equals what the two functions return for that student alone. ``progress()``: after each sequence."""
    hits = {name: torch.zeros(plans[0][1].k_steps if plans else 0, dtype=torch.long) for name in students}
    kl = dict.fromkeys(students, 0.0)
    n = 0
    for cap, plan in plans:
        t_out = unroll(teacher, cap, plan)
        t_top = [t.argmax(-1) for t in t_out]
        for name, student in students.items():
            s_out = unroll(student, cap, plan)
            hits[name] += torch.stack([(s.argmax(-1) == t).sum() for s, t in zip(s_out, t_top)]).cpu()
            kl[name] += float(kl_to_teacher(s_out, t_out)) * len(plan.anchors)
        n += len(plan.anchors)
        if progress is not None:
            progress()
    if not n:
        raise HeadQatError("no response anchors to measure agreement on: every answer is shorter than K tokens")
    return (
        {name: [round(float(x) / n, 6) for x in h] for name, h in hits.items()},
        {name: v / n for name, v in kl.items()},
        n,
    )


@torch.no_grad()
def mean_kl(student, teacher, plans: Sequence[tuple[Capture, Unroll]]) -> float:
    """`kl_to_teacher` averaged over every anchor of ``plans`` (anchor-weighted), float."""
    total, n = 0.0, 0
    for cap, plan in plans:
        total += float(kl_to_teacher(unroll(student, cap, plan), unroll(teacher, cap, plan))) * len(plan.anchors)
        n += len(plan.anchors)
    return total / max(n, 1)


# ---- training -----------------------------------------------------------------------------------------------


def lr_factor(step: int, config: HeadQat) -> float:
    """Multiplier of ``lr`` at optimizer step ``step`` (0-based): linear warm-up (step + 1) / warmup_steps, then
    ``schedule`` over the remaining steps (cosine and linear decay to 0 at step ``steps``, constant 1)."""
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    p = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
    if config.schedule == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * p))
    if config.schedule == "linear":
        return 1.0 - p
    return 1.0


@dataclass
class TrainResult:
    """losses: mean loss of each optimizer step (over its accumulated sequences); seconds_per_step."""

    losses: list[float]
    seconds_per_step: float


def qat_autocast(device: torch.device):
    """The precision context of the QAT forwards (paper App. A Table 4: bf16 mixed precision): on a CUDA device
    ``torch.autocast("cuda", dtype=torch.bfloat16)`` over float32 master weights (matmuls in bf16, the KL in float32:
    `kl_to_teacher` casts to float), on any other device a no-op context (float32 throughout: the CPU path, whose
    results tests hold bit-identical)."""
    if torch.device(device).type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


#: Bytes of teacher logits `train_qat` keeps between the steps that revisit a sequence (toy: 60 sequences x ~250
#: anchors x K x 1,024 keep-set logits ~ 60 MB; the paper's 86,089-wide head does not fit and recomputes).
TEACHER_CACHE_BYTES = 1 << 30


def train_qat(
    student,
    teacher,
    plans: Sequence[tuple[Capture, Unroll]],
    config: HeadQat,
    on_step=None,
    cache_bytes: int = TEACHER_CACHE_BYTES,
) -> TrainResult:
    """Table 4's loop: ``steps`` AdamW steps of ``grad_accum`` sequences each (batch 1 sequence, taken in order,
    cycling), loss `kl_to_teacher`, gradient-norm clip, `lr_factor` schedule. Trains ``student``'s QuantLinear
    weights in place. ``on_step(step, loss)`` is called after each step (progress).

    The teacher is frozen, so its unroll of a sequence is the same every time the loop comes back to it: up to
    ``cache_bytes`` of those logits are kept and reused (the same tensors, so the result is bit-identical)."""
    params = [p for p in student.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay)
    autocast = qat_autocast(params[0].device)
    targets: dict[int, list[torch.Tensor]] = {}
    kept = 0
    losses = []
    start = time.perf_counter()
    for step in range(config.steps):
        for group in opt.param_groups:
            group["lr"] = config.lr * lr_factor(step, config)
        total = 0.0
        for micro in range(config.grad_accum):
            index = (step * config.grad_accum + micro) % len(plans)
            cap, plan = plans[index]
            target = targets.get(index)
            if target is None:
                with torch.no_grad(), autocast:
                    target = unroll(teacher, cap, plan)
                size = sum(t.numel() * t.element_size() for t in target)
                if kept + size <= cache_bytes:
                    targets[index], kept = target, kept + size
            with autocast:
                loss = kl_to_teacher(unroll(student, cap, plan), target)
            (loss / config.grad_accum).backward()
            total += loss.item() / config.grad_accum
        torch.nn.utils.clip_grad_norm_(params, config.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
        if on_step is not None:
            on_step(step, total)
    seconds = (time.perf_counter() - start) / max(1, config.steps)
    return TrainResult(losses, seconds)


# ---- the pass -----------------------------------------------------------------------------------------------


def _head_sliding_window(head) -> int:
    return int(head.config.get_text_config().sliding_window)


def _plans(
    caps: Sequence[Capture], k_steps: int, window: int, sliding_window: int, offset: int
) -> list[tuple[Capture, Unroll]]:
    plans = [(c, plan_unroll(c, k_steps, window, sliding_window, offset)) for c in caps]
    return [(c, p) for c, p in plans if p is not None]


def _stats(caps: Sequence[Capture], plans) -> dict[str, int]:
    return {
        "sequences": len(caps),
        "prompt_tokens": sum(c.prompt_len for c in caps),
        "response_tokens": sum(c.length - c.prompt_len for c in caps),
        "anchors": sum(len(p.anchors) for _, p in plans),
    }


class HeadQatPass(Pass):
    """torch_verifier + torch_head + keep_set + calibration_answers -> quantized_head, reading ``[head_qat]``
    (Table 4) and ``[window]`` (W, query offset), ``[tree]`` (K), ``[handoff]`` (pre/post-norm h). The first
    ``calibration_prompts`` training and ``eval_prompts`` evaluation answers of `hycoc.passes.calibration_answers`,
    cut at ``calibration_max_new_tokens`` / ``eval_max_new_tokens``, are the data. Module docstring for the method
    and its numbers; progress goes through `hycoc.progress`.

    ``seed``: seeds torch.
    """

    name = "head_qat"
    section = "head_qat"
    also_reads = ("window", "tree", "handoff")
    consumes = {
        "torch_verifier": TorchModelArtifact,
        "torch_head": TorchModelArtifact,
        "keep_set": KeepSetArtifact,
        "calibration_answers": CalibrationAnswersArtifact,
    }
    produces = {"quantized_head": QuantizedHeadArtifact}
    version = 2  # v2: prompts and greedy answers from the calibration_answers pass; one teacher pass per evaluation

    def __init__(self, *, seed: int = 0):
        self.seed = seed

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        # The prompts and answers arrive as the calibration_answers artifact (its hash keys this pass).
        return {"seed": self.seed}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, QuantizedHeadArtifact], PassReport]:
        from hycoc.progress import step

        config = recipe.head_qat
        torch.manual_seed(self.seed)
        verifier = inputs["torch_verifier"].payload  # eval mode by the artifact's contract; never modified
        keep = torch.as_tensor(inputs["keep_set"].payload, dtype=torch.long)
        device = verifier.device
        teacher = restrict_output_layer(inputs["torch_head"].payload, keep).to(device)
        k_steps, window = recipe.tree.chain_length, recipe.window.head_window
        offset = recipe.window.head_query_position_offset
        sw = head_sliding_positions(_head_sliding_window(teacher), recipe.window.head_sliding_window_inclusive)

        answers = inputs["calibration_answers"].payload
        source = answers.source
        train_ids, train_answers = answers.take("train", config.calibration_prompts, config.calibration_max_new_tokens)
        eval_ids, eval_answers = answers.take("eval", config.eval_prompts, config.eval_max_new_tokens)

        t0 = time.perf_counter()
        with step("verifier captures", total=len(train_ids) + len(eval_ids)) as s:
            train_caps = capture_answers(verifier, train_ids, train_answers, recipe.handoff.hidden, s.advance)
            eval_caps = capture_answers(verifier, eval_ids, eval_answers, recipe.handoff.hidden, s.advance)
        capture_s = time.perf_counter() - t0
        train_plans = _plans(train_caps, k_steps, window, sw, offset)
        eval_plans = _plans(eval_caps, k_steps, window, sw, offset)
        if not train_plans:
            raise HeadQatError(
                "no calibration answer is longer than tree.chain_length tokens: raise "
                "head_qat.calibration_max_new_tokens"
            )

        ratios = clip_ratios(config)
        label = f"w{config.weight_bits}"
        ptq8, _ = quantize_head(teacher, 8, ratios)
        student, chosen = quantize_head(teacher, config.weight_bits, ratios)
        with step("PTQ agreement (W8, W4) on the evaluation answers", total=len(eval_plans)) as s:
            agreement, eval_kl, n_eval = evaluate_students(
                {"w8_ptq": ptq8, f"{label}_ptq": student}, teacher, eval_plans, s.advance
            )
        del ptq8
        kl = {"eval_ptq": eval_kl[f"{label}_ptq"]}

        with step("QAT steps", total=config.steps) as s:
            result = train_qat(student, teacher, train_plans, config, lambda i, loss: s.advance(note=f"KL {loss:.4f}"))
        with step("QAT agreement on the evaluation answers", total=len(eval_plans)) as s:
            after, after_kl, _ = evaluate_students({f"{label}_qat": student}, teacher, eval_plans, s.advance)
        agreement.update(after)
        kl["eval_qat"] = after_kl[f"{label}_qat"]

        ranges = self._input_ranges(teacher, train_plans, config.input_range_percentile)
        head = export_head(student, keep, ranges)
        ratio_all = torch.cat(list(chosen.values()))
        tail = min(10, len(result.losses))
        numbers = {
            "bits": config.weight_bits,
            "steps": config.steps,
            "k": k_steps,
            "window": window,
            "prompt_source": source,
            "calibration": _stats(train_caps, train_plans),
            "eval": {**_stats(eval_caps, eval_plans), "anchors_measured": n_eval},
            "agreement": agreement,
            "agreement_mean": {k: round(sum(v) / len(v), 6) for k, v in agreement.items()},
            "kl": {k: round(v, 6) for k, v in kl.items()},
            "loss_first": round(sum(result.losses[:tail]) / tail, 6) if tail else None,
            "loss_last": round(sum(result.losses[-tail:]) / tail, 6) if tail else None,
            "seconds_per_step": round(result.seconds_per_step, 4),
            "capture_seconds": round(capture_s, 2),
            "linears": len(head.qweight),
            "weights": sum(q.numel() for q in head.qweight.values()),
            "weight_bytes_packed": sum(q.numel() for q in head.qweight.values()) * config.weight_bits // 8,
            "clip_ratio_mean": round(float(ratio_all.mean()), 4),
            "clip_ratio_below_max": round(float((ratio_all < config.clip_search_max).float().mean()), 4),
            "input_ranges": ranges,
        }
        d1 = {k: v[0] for k, v in agreement.items()}
        summary = (
            f"{label.upper()} top-1 agreement d1 {d1[f'{label}_ptq']:.1%} (PTQ) -> {d1[f'{label}_qat']:.1%} "
            f"(QAT, {config.steps} steps, {result.seconds_per_step:.2f} s/step); W8 PTQ {d1['w8_ptq']:.1%}"
        )
        return {"quantized_head": QuantizedHeadArtifact("quantized_head", head)}, PassReport(summary, numbers)

    @staticmethod
    @torch.no_grad()
    def _input_ranges(teacher, plans, percentile: float) -> dict[str, float]:
        """Fixed graph input ranges (App. A: the 99.99th percentiles of the captures): |e|, |h| (the verifier's),
        |h_head| (the head's own projected states, the second half of x_hat from step 2 on), and the four KV
        tensors, over every position of the calibration sequences (h_head: at their response anchors)."""
        parts: dict[str, list[torch.Tensor]] = {
            k: [] for k in ("e", "h", "h_head", "k_sliding", "v_sliding", "k_full", "v_full")
        }
        for cap, plan in plans:
            parts["e"].append(cap.e)
            parts["h"].append(cap.h)
            for kind, name in ((SLIDING, "sliding"), (FULL, "full")):
                parts[f"k_{name}"].append(cap.kv[kind][0])
                parts[f"v_{name}"].append(cap.kv[kind][1])
            t = plan.anchors
            z = cap.h[:, t - 1].float()
            kv = {kind: (k.float(), v.float()) for kind, (k, v) in cap.kv.items()}
            for k in range(plan.k_steps - 1):  # states fed back at steps 2..K
                _, z = head_step(teacher, torch.cat([cap.e[:, t + k].float(), z], -1), kv, plan.masks, plan.pos)
                parts["h_head"].append(z)
        return {k: round(percentile_abs(v, percentile), 6) for k, v in parts.items() if v}
