"""KL-based 4-bit QAT of the MTP head (paper App. A Table 4) on tiny random models.

What is asserted, and why not more: a random tiny head (hidden 48) at W4 keeps only about half of its keep-set
arg-maxes (W8: ~97%), and the held-out set here has about a hundred anchors, so held-out top-1 agreement after a
few dozen steps moves by a few anchors either way (observed 0.51 -> 0.51..0.55 depending on lr and steps).
The tests therefore assert the numbers that are stable at this scale: W8 PTQ beats W4 PTQ by a wide margin, QAT
lowers the mean KL to the full-precision head on the training sequences by more than a third and does not raise it
on held-out ones, and the export is bit-exact (integers in [-7, 7] within int4's [-8, 7]; integer * scale is the
weight the trained head computed with, and a head rebuilt from the artifact gives identical logits). The learning
rate is 1e-4 instead of Table 4's 1e-5: at 1e-5 a few dozen steps on a random head move the KL too little to
tell from noise.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hycoc.passes.artifacts import KeepSetArtifact, QuantizedHeadArtifact, TokenizerArtifact, TorchModelArtifact
from hycoc.passes.calibration_answers import CalibrationAnswersPass
from hycoc.passes.head import qat as hq
from hycoc.passes.head.captures import capture_sequences
from hycoc.passes.head.errors import HeadQatError
from hycoc.passes.head.graph import HeadGraph, ring_masks, rotary_rows
from hycoc.passes.head.prompts import read_prompts
from hycoc.passes.head.quantize import (
    FakeQuantSTE,
    QuantLinear,
    clip_ratios,
    dequantized_head,
    drafting_linears,
    export_head,
    percentile_abs,
    quantize_head,
    restrict_output_layer,
    search_clip,
)
from hycoc.passes.pipeline import Pipeline
from rich.console import Console
from tiny_models import tiny_head, tiny_verifier
from tokenizers import Tokenizer, pre_tokenizers
from tokenizers import models as tok_models

from hycoc.mtp import head_step
from hycoc.recipe import HeadQat, Recipe
from hycoc.toy.chat_files import SPECIAL_TOKENS, STOP_IDS, write_tokenizer_folder
from hycoc.toy.gemma_format import quantize_per_channel

torch.set_num_threads(1)
K, W, SW = 4, 16, 8


# ---- quantization primitives ----------------------------------------------------------------------------------


def test_clip_ratios_follow_the_recipe():
    assert clip_ratios(HeadQat()) == pytest.approx([1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.65, 0.6])
    assert clip_ratios(HeadQat(clip_search_points=1)) == [1.0]


def test_clip_search_picks_the_ratio_with_the_lowest_mse():
    # Row 0: one outlier 1.0 and 999 values 0.3. At ratio 1 the step is 1/7 and every 0.3 rounds to 2/7 (error
    # 0.0143 each); at ratio 0.7 the step is 0.1, every 0.3 is exact and only the outlier clips to 0.7.
    # Row 1: a uniform grid of multiples of max/7, exact at ratio 1 and at no smaller ratio.
    row0 = torch.full((1000,), 0.3)
    row0[0] = 1.0
    row1 = torch.arange(-7, 8).float().repeat(67)[:1000] / 7 * 2.0
    w = torch.stack([row0, row1])
    ratios = clip_ratios(HeadQat())
    q, scale, chosen = search_clip(w, 4, ratios)

    # Brute force in float64, independent of the implementation.
    errors = np.zeros((2, len(ratios)))
    w64 = w.double().numpy()
    for j, r in enumerate(ratios):
        s = np.abs(w64).max(1, keepdims=True) * r / 7
        errors[:, j] = ((np.clip(np.round(w64 / s), -7, 7) * s - w64) ** 2).sum(1)
    assert chosen.tolist() == pytest.approx([ratios[int(np.argmin(errors[0]))], ratios[int(np.argmin(errors[1]))]])
    assert chosen.tolist() == pytest.approx([0.7, 1.0])
    assert q.dtype == torch.int8 and int(q.abs().max()) <= 7 and scale.dtype == torch.float32
    torch.testing.assert_close(scale[:, 0], torch.tensor([0.1, 2.0 / 7]))
    # The same rule as the toy SLM's quantizer.
    q_ref, s_ref = quantize_per_channel(w, 4, ratios=tuple(ratios))
    assert torch.equal(q, q_ref) and torch.equal(scale, s_ref)


def test_ste_gradient_is_the_identity():
    torch.manual_seed(0)
    w = (torch.randn(6, 10) * 0.5).requires_grad_()
    scale = torch.full((6, 1), 0.05)  # clips most entries at 7 * 0.05
    y = FakeQuantSTE.apply(w, scale, 7)
    assert torch.equal(y, torch.clamp(torch.round(w.detach() / scale), -7, 7) * scale)
    g = torch.randn(6, 10)
    y.backward(g)
    assert torch.equal(w.grad, g)  # clipped entries included

    layer = QuantLinear(w.detach(), scale, 4)
    x = torch.randn(3, 10)
    layer(x).sum().backward()
    assert torch.equal(layer.weight.grad, torch.ones(3, 6).T @ x)  # d/dW of F.linear(x, W), straight through


def test_lr_schedule_warmup_then_cosine():
    c = HeadQat()
    f = [hq.lr_factor(i, c) for i in range(c.steps)]
    assert f[0] == pytest.approx(1 / 50) and f[49] == 1.0 and f[50] == 1.0
    assert f[75] == pytest.approx(0.5) and 0 < f[99] < 0.001
    assert hq.lr_factor(60, HeadQat(schedule="constant")) == 1.0


def test_percentile_is_exact():
    x = torch.arange(1, 10001).float()
    assert percentile_abs([-x[:5000], x[5000:]], 99.99) == 9999.0
    assert percentile_abs([x], 100) == 10000.0


# ---- QAT on a tiny head ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def setup():
    verifier = tiny_verifier()
    head = tiny_head(verifier)
    keep = torch.arange(0, 300, 2)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 300, (6,), generator=g).tolist() for _ in range(20)]
    caps = capture_sequences(verifier, prompts, 30, {1}, "pre_norm")
    plans = [(c, hq.plan_unroll(c, K, W, SW, -1)) for c in caps]
    return verifier, head, keep, plans[:16], plans[16:]


def test_unroll_plan_covers_response_tokens_only(setup):
    _, _, _, train, _ = setup
    cap, plan = train[0]
    assert cap.prompt_len == 6 and cap.length == 36  # 30 greedy tokens, no stop token drawn
    assert plan.anchors.tolist() == list(range(6, 33))  # t + K <= L - 1: every predicted token is in the answer
    assert plan.pos.tolist() == [list(range(5, 32))]  # t - 1 (Alg. 2 line 6)
    # Row of anchor t=20: full layer [4, 20), sliding layer [12, 20).
    row = plan.masks["full_attention"][0, 0, 14]
    assert torch.nonzero(row == 0).flatten().tolist() == list(range(4, 20))
    row = plan.masks["sliding_attention"][0, 0, 14]
    assert torch.nonzero(row == 0).flatten().tolist() == list(range(12, 20))


def test_one_teacher_pass_evaluates_every_student_as_alone(setup):
    """The pass evaluates W8 PTQ, W4 PTQ (and later W4 QAT) against one teacher unroll per sequence: each result
    equals `top1_agreement` and `mean_kl` of that student alone."""
    _, head, keep, _, held = setup
    teacher = restrict_output_layer(head, keep)
    ratios = clip_ratios(HeadQat())
    w8, _ = quantize_head(teacher, 8, ratios)
    w4, _ = quantize_head(teacher, 4, ratios)
    ticks = []
    agreement, kl, n = hq.evaluate_students({"w8": w8, "w4": w4}, teacher, held, lambda: ticks.append(1))
    assert len(ticks) == len(held) == 4
    for name, student in (("w8", w8), ("w4", w4)):
        alone, n_alone = hq.top1_agreement(student, teacher, held)
        assert agreement[name] == alone and n == n_alone
        assert kl[name] == pytest.approx(hq.mean_kl(student, teacher, held), rel=1e-6)
    assert agreement["w8"][0] > agreement["w4"][0] and kl["w8"] < kl["w4"]


def test_teacher_cache_leaves_training_bit_identical(setup):
    """train_qat reuses the frozen teacher's logits when it comes back to a sequence: the same losses and weights,
    bit for bit, as recomputing them (cache_bytes=0)."""
    _, head, keep, train, _ = setup
    config = HeadQat(steps=6, warmup_steps=2, lr=1e-4)
    teacher = restrict_output_layer(head, keep)
    runs = []
    for cache_bytes in (hq.TEACHER_CACHE_BYTES, 0):
        torch.manual_seed(0)
        student, _ = quantize_head(teacher, 4, clip_ratios(config))
        result = hq.train_qat(student, teacher, train[:3], config, cache_bytes=cache_bytes)  # 12 visits of 3
        runs.append((result.losses, {k: v.clone() for k, v in student.state_dict().items()}))
    (losses_a, state_a), (losses_b, state_b) = runs
    assert losses_a == losses_b
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)


def test_qat_lowers_kl_and_exports_bit_exact(setup):
    _, head, keep, train, held = setup
    torch.manual_seed(0)
    config = HeadQat(steps=30, warmup_steps=3, lr=1e-4)
    teacher = restrict_output_layer(head, keep)
    ratios = clip_ratios(config)

    w8, _ = quantize_head(teacher, 8, ratios)
    student, chosen = quantize_head(teacher, 4, ratios)
    agree_w8, n = hq.top1_agreement(w8, teacher, held)
    agree_w4, _ = hq.top1_agreement(student, teacher, held)
    assert n == 4 * 27 and min(agree_w8) > 0.9 and max(agree_w4) < 0.75
    assert set(chosen) == set(drafting_linears(teacher)) and "lm_head" in chosen and len(chosen) == 13

    norms_before = {k: v.clone() for k, v in student.state_dict().items() if "norm" in k}
    scales_before = {k: v.scale.clone() for k, v in student.named_modules() if isinstance(v, QuantLinear)}
    kl_train, kl_held = hq.mean_kl(student, teacher, train), hq.mean_kl(student, teacher, held)
    result = hq.train_qat(student, teacher, train, config)
    assert len(result.losses) == 30 and result.seconds_per_step > 0
    assert hq.mean_kl(student, teacher, train) < 0.67 * kl_train
    assert hq.mean_kl(student, teacher, held) <= kl_held
    after, _ = hq.top1_agreement(student, teacher, held)
    print(f"agreement W8 PTQ {agree_w8}, W4 PTQ {agree_w4}, W4 QAT {after}; {result.seconds_per_step:.3f} s/step")

    # Frozen: norms and the clip search's scales; trained: the weights.
    state = student.state_dict()
    assert all(torch.equal(state[k], v) for k, v in norms_before.items())
    assert all(torch.equal(student.get_submodule(k).scale, v) for k, v in scales_before.items())

    exported = export_head(student, keep, {"e": 1.0})
    assert exported.bits == 4 and set(exported.qweight) == set(chosen)
    for name, q in exported.qweight.items():
        layer = student.get_submodule(name)
        assert q.dtype == torch.int8 and -8 <= int(q.min()) and int(q.max()) <= 7
        assert torch.equal(q.float() * exported.scale[name], layer.quantized_weight().detach())
    assert exported.qweight["lm_head"].shape == (len(keep), 48)
    assert not any(k.startswith("model.embed_tokens") for k in exported.floats)

    # A head rebuilt from the integers computes exactly what the trained head computed.
    rebuilt = dequantized_head(exported)
    cap, plan = held[0]
    with torch.no_grad():
        a = hq.unroll(student, cap, plan)
        b = hq.unroll(rebuilt, cap, plan)
    assert all(torch.equal(x, y) for x, y in zip(a, b))

    # ... and so does the static ring graph built from it (one query at t = 20 over a full ring of W = 16).
    t = 20
    graph = HeadGraph.from_quantized(exported)
    kv = cap.kv
    rings = {
        kind: tuple(x[:, :, t - W : t][:, :, [(c - t) % W for c in range(W)]] for x in pair)
        for kind, pair in kv.items()
    }  # column c holds position p with p mod W == c
    masks = {k: torch.from_numpy(m) for k, m in ring_masks(t, 0, W, SW).items()}
    rot = rotary_rows(rebuilt.config, t - 1)
    x = torch.cat([cap.e[:, t : t + 1], cap.h[:, t - 1 : t]], -1)
    logits, _ = graph(
        x,
        *rings["sliding_attention"],
        *rings["full_attention"],
        masks["sliding_attention"],
        masks["full_attention"],
        *rot["sliding_attention"],
        *rot["full_attention"],
    )
    with torch.no_grad():
        ref, _ = head_step(student, x, rings, masks, torch.tensor([[t - 1]]))
    torch.testing.assert_close(logits, ref, rtol=0, atol=1e-5)


# ---- the pass -------------------------------------------------------------------------------------------------


def word_tokenizer() -> Tokenizer:
    """300 ids for the tiny models: the toy's 12 special tokens with Gemma 4's names (<turn|> = 6, <eos> = 1),
    'user', 'model', then the words w0..w285."""
    words = SPECIAL_TOKENS + ["user", "model"] + [f"w{i}" for i in range(286)]
    tok = Tokenizer(tok_models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok


def word_tokenizer_folder(folder) -> Path:
    """`word_tokenizer` as a checkpoint's tokenizer folder: the toy's chat template and stop ids beside it."""
    write_tokenizer_folder(word_tokenizer(), folder, 64)
    (Path(folder) / "generation_config.json").write_text(json.dumps({"eos_token_id": STOP_IDS}))
    return Path(folder)


def qat_recipe(path, tokenizer_folder) -> Recipe:
    return Recipe.model_validate(
        {
            "models": {"tokenizer": str(tokenizer_folder)},
            "window": {"head_window": W},
            "head_qat": {
                "steps": 6,
                "warmup_steps": 2,
                "lr": 1e-4,
                "calibration_prompts": 3,
                "eval_prompts": 2,
                "calibration_max_new_tokens": 20,
                "eval_max_new_tokens": 20,
                "max_seq_len": 40,
                "calibration_data": str(path),
            },
            "slm_calibration": {"prompts": 2},
        }
    )


def test_pass_in_a_pipeline_reports_and_caches(tmp_path, setup):
    verifier, head, keep, _, _ = setup
    rng = np.random.default_rng(0)
    lines = [{"prompt": " ".join(f"w{i}" for i in rng.integers(0, 286, 5))} for _ in range(4)]
    lines.insert(1, {"messages": [{"role": "user", "content": " ".join(["w1"] * 40)}]})  # too long: skipped
    lines.append({"user": "w7 w8 w9"})
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    inputs = {
        "torch_verifier": TorchModelArtifact("torch_verifier", verifier),
        "torch_head": TorchModelArtifact("torch_head", head),
        "keep_set": KeepSetArtifact("keep_set", keep.numpy()),
        "tokenizer": TokenizerArtifact("tokenizer", word_tokenizer()),
    }
    console = Console(file=io.StringIO())
    pipe = Pipeline([CalibrationAnswersPass(), hq.HeadQatPass()], tmp_path / "cache", console=console)

    folder = word_tokenizer_folder(tmp_path / "tokenizer")
    result = pipe.run(qat_recipe(path, folder), inputs)
    answers, report = result.reports
    assert (answers.numbers["train"], answers.numbers["eval"]) == (3, 2)  # the 40-word prompt is skipped
    assert answers.numbers["train_cap"] == answers.numbers["eval_cap"] == 20
    numbers = report.numbers
    assert numbers["calibration"]["sequences"] == 3
    assert numbers["eval"]["sequences"] == 2 and numbers["calibration"]["prompt_tokens"] == 3 * 11
    assert 3 * K < numbers["calibration"]["response_tokens"] <= 3 * 20  # greedy answers, cut after a stop id
    assert set(numbers["agreement"]) == {"w8_ptq", "w4_ptq", "w4_qat"}
    assert all(len(v) == K and all(0 <= x <= 1 for x in v) for v in numbers["agreement"].values())
    assert numbers["linears"] == 13 and numbers["steps"] == 6 and numbers["seconds_per_step"] > 0
    assert set(numbers["input_ranges"]) == {"e", "h", "h_head", "k_sliding", "v_sliding", "k_full", "v_full"}
    assert report.summary.startswith("W4 top-1 agreement d1 ")
    head_out = result.artifacts["quantized_head"]
    assert isinstance(head_out, QuantizedHeadArtifact) and head_out.payload.keep_set.tolist() == keep.tolist()

    again = pipe.run(qat_recipe(path, folder), inputs)  # cache hit: reloaded from disk with the same content hash
    assert again.reports[0].cached and again.reports[1].cached
    loaded = again.artifacts["quantized_head"].payload
    assert all(torch.equal(loaded.qweight[n], head_out.payload.qweight[n]) for n in loaded.qweight)
    assert loaded.input_ranges == head_out.payload.input_ranges
    rebuilt = dequantized_head(loaded)  # from the saved config, without its provenance keys
    assert rebuilt.lm_head.weight.shape == (len(keep), 48)
    assert torch.equal(rebuilt.lm_head.weight, loaded.qweight["lm_head"].float() * loaded.scale["lm_head"])


def test_spec_bench_prompts_are_refused(tmp_path):
    path = tmp_path / "sb.jsonl"
    path.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["Compose a blog post"]}) + "\n")
    with pytest.raises(HeadQatError, match=r"sb.jsonl:1: this is a Spec-Bench question"):
        read_prompts(path)
