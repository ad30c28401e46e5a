"""The head's QDQ calibration from real hand-offs (passes/head/calibration.py, passes/head/export.py `HeadQdq`).

The tiny recipe of tests/test_build.py is built up to ``head_export`` once (2 QAT steps); the tests drive its
verifier engine and the runtime's `MtpDrafter` over the float head graph and run the QDQ pass."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from hycoc.passes import build as b
from hycoc.passes.calibration_answers import select_prompts
from hycoc.passes.head import calibration as hc
from hycoc.runtime.mtp_drafter import MtpDrafter
from rich.console import Console
from test_build import write_tiny_recipe

from hycoc.host import FULL, SLIDING, ring_masks
from hycoc.protocol.messages import Sampling
from hycoc.recipe import load_recipe

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    recipe_path = write_tiny_recipe(tmp_path_factory.mktemp("tiny_recipe"))
    recipe = load_recipe(recipe_path)
    result = b.run_pipeline(
        recipe,
        "cpu",
        tmp_path_factory.mktemp("cache"),
        b.BuildSettings(until="head_export", console=Console(file=io.StringIO())),
    )
    return recipe, result.artifacts


def parts(recipe, artifacts):
    """(engine, graph, shapes, bundle, tokenizer) for the tiny build."""
    from hycoc.passes.head.graph import HeadGraph, embedding_table, rotary_tables
    from hycoc.passes.head.quantize import dequantized_head
    from hycoc.verifier.engine import VerifierEngine

    from hycoc.chat_template import chat_from_recipe

    verifier = artifacts["torch_verifier"].payload
    quantized = artifacts["quantized_head"].payload
    tokenizer = artifacts["tokenizer"].payload
    rebuilt = dequantized_head(quantized)
    q, scale = embedding_table(verifier, quantized.keep_set)
    bundle = hc.runtime_bundle(
        recipe,
        quantized.keep_set,
        (q.numpy(), scale.numpy()),
        rotary_tables(rebuilt.config),
        rebuilt.config.get_text_config().sliding_window,
    )
    shapes = {v.name: tuple(v.shape) for v in artifacts["onnx_head"].payload.graph.inputs}
    engine = VerifierEngine(
        verifier,
        head_window=recipe.window.head_window,
        chain_length=recipe.tree.chain_length,
        handoff_scales=hc.handoff_scales(recipe),
        hidden=recipe.handoff.hidden,
        eos_token_ids=chat_from_recipe(recipe).stop_ids,
    )
    return engine, HeadGraph(rebuilt).eval(), shapes, bundle, tokenizer


def test_recorded_feeds_are_the_runtime_feeds_of_real_handoffs(tiny):
    recipe, artifacts = tiny
    engine, graph, shapes, bundle, tokenizer = parts(recipe, artifacts)
    W, K = recipe.window.head_window, recipe.tree.chain_length
    sw = bundle.host.head.sliding_window
    cal, _, _ = select_prompts(recipe, tokenizer)
    runner = hc.TorchHeadRunner(graph, shapes)
    drafter = MtpDrafter(runner, bundle)
    # a prompt plus its answer long enough to wrap the W-column ring
    prompt = cal[0] + cal[1] + cal[2]
    session = engine.open(
        prompt, Sampling(temperature=0.0, top_k=1, top_p=1.0), acceptance="exact", max_new_tokens=W + 4
    )
    session.prefill()
    try:
        seq, wrapped = 0, False
        while not session.finished and seq < W + 4:
            h = session.verify([session.root], [-1], seq).handoff
            seq += 1
            if h is None:
                break
            assert h.a == (max(0, h.t_prime - W) if seq == 1 else h.t_prime - 1)
            drafter.ingest(h)
            n0 = len(runner.records)
            want = {k: np.array(v, copy=True) for k, v in drafter.feeds(drafter.x_hat).items()}
            drafter.draft()
            assert len(runner.records) == n0 + K
            got = runner.records[n0]
            assert got.keys() == want.keys()
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=name)
            # x_hat: the dequantized hand-off; masks: ring_masks of the live range [max(0, t' - W), t')
            s = np.asarray(h.scales, np.float32)
            H = len(h.x_hat) // 2
            x = np.concatenate([h.x_hat[:H] * s[0], h.x_hat[H:] * s[1]]).astype(np.float32)
            np.testing.assert_array_equal(got["x_hat"].reshape(-1), x)
            masks = ring_masks(h.t_prime, max(0, h.t_prime - W), W, sw)
            np.testing.assert_array_equal(got["mask_sliding"], masks[SLIDING])
            np.testing.assert_array_equal(got["mask_full"], masks[FULL])
            # the ring columns p mod W hold the hand-off's rows
            for short, ks, vs in (("sliding", s[2], s[3]), ("full", s[4], s[5])):
                _, kv, _, d = got[f"k_{short}"].shape
                for p in range(h.a, h.t_prime):
                    col = p % W
                    np.testing.assert_array_equal(
                        got[f"k_{short}"][0, :, col], (getattr(h, f"k_{short}")[p - h.a] * ks).reshape(kv, d)
                    )
                    np.testing.assert_array_equal(
                        got[f"v_{short}"][0, :, col], (getattr(h, f"v_{short}")[p - h.a] * vs).reshape(kv, d)
                    )
            # later steps query [E[i]; h_next]: the embedding half is a row of E
            i = int(np.argmax(graph(*[torch.from_numpy(got[n]) for n in runner.input_names])[0].numpy()))
            np.testing.assert_array_equal(runner.records[n0 + 1]["x_hat"].reshape(-1)[:H], bundle.embed_keep(i))
            wrapped |= h.t_prime > W
        assert seq > 2 and wrapped
    finally:
        session.close()
        engine.close()


def test_record_requests_drafts_on_the_chosen_rounds(tiny):
    recipe, artifacts = tiny
    engine, graph, shapes, bundle, tokenizer = parts(recipe, artifacts)
    cal, held, source = select_prompts(recipe, tokenizer)
    # 6 prompts in the source: 4 for the SLM's calibration (the most any reader takes), the next 2 evaluate
    assert source.endswith("prompts.jsonl") and (len(cal), len(held)) == (4, 2)
    answers = artifacts["calibration_answers"].payload.take("train", 2, 8)[1]
    try:
        out = hc.record_requests(engine, graph, shapes, bundle, cal[:2], cap=8, answers=answers, per_prompt=3)
        root_only = hc.record_requests(engine, graph, shapes, bundle, cal[:2], cap=8, per_prompt=3)
    finally:
        engine.close()
    K = recipe.tree.chain_length
    st, ro = out.stats, root_only.stats
    # exact acceptance at T = 0 follows the greedy answer: same tokens, fewer rounds with chains
    assert st["answer_tokens"] == ro["answer_tokens"] == sum(len(a) for a in answers)
    assert st["rounds"] < ro["rounds"] == ro["answer_tokens"]
    assert 2 <= st["drafts"] <= 6 and st["samples"] == st["drafts"] * K == len(out.samples)
    assert ro["drafts"] == 6 and ro["samples"] == 6 * K
    assert hc.draft_rounds(12, 0.0, 4) == {0, 3, 6, 9} and hc.draft_rounds(3, 0.5, 8) == {0, 1, 2}


def test_qdq_pass_calibrates_on_real_handoffs(tiny, monkeypatch):
    from hycoc.passes.head.export import HeadQdq

    from hycoc import progress

    recipe, artifacts = tiny
    step = HeadQdq()
    assert step.version == 6 and {"tokenizer", "calibration_answers"} <= set(step.consumes)
    inputs = {k: artifacts[k] for k in step.consumes}
    log = Console(file=io.StringIO(), width=200)  # not a terminal: the plain progress lines of a log
    with monkeypatch.context() as m, progress.current_pass("qdq_head", log):
        m.setattr(progress, "LINE_EVERY", 0.0)  # every advance prints its line
        _, report = step.run(inputs, recipe)
    # a count and ETA after every request, not one line after all the calibration prompts
    lines = [x for x in log.file.getvalue().splitlines() if "hand-offs through the MTP Drafter: requests" in x]
    total = int(lines[0].rsplit("(", 1)[1].split()[0])
    counts = [int(x.split("requests ")[1].split("/")[0]) for x in lines if "requests 1/" in x or ", ETA " in x]
    assert counts[:2] == [1, 2] and total > 2
    n = report.numbers
    cal = n["calibration_inputs"]
    assert cal["source"].endswith("prompts.jsonl") and cal["calibration"]["samples"] == n["samples"] > 0
    assert cal["held_out"]["samples"] == n["held_out_samples"] > 0
    print(
        f"head QDQ SQNR logits: calibration {n['sqnr']['outputs']['logits']:.2f} dB, held-out "
        f"{n['sqnr_held_out']['outputs']['logits']:.2f} dB"
    )
    # measured 41.80 dB (calibration) and 32.05 dB (held-out) on the seeded tiny models; floors 2 dB under
    assert n["sqnr"]["outputs"]["logits"] > 39.5 and n["sqnr_held_out"]["outputs"]["logits"] > 30.0
    # the fallback (no tokenizer: unit tests only) still runs
    _, old = step.run({k: v for k, v in inputs.items() if k != "tokenizer"}, recipe)
    assert old.numbers["calibration_inputs"]["source"].startswith("keep-set")
    print(f"real hand-offs: {report.summary}\nfallback: {old.summary}")


def test_skip_ahead_reaches_the_same_ring_in_fewer_rounds(tiny):
    """Far from a draft target, one round commits a long stretch of the answer; the request still follows the greedy
    answer, the ring holds the same rows (int8 hand-off rows computed in other forwards: within one step of the
    fixed scale) and the draft sees the same live columns."""
    from hycoc.passes.head.captures import greedy_answer

    recipe, artifacts = tiny
    engine, graph, shapes, bundle, tokenizer = parts(recipe, artifacts)
    verifier = artifacts["torch_verifier"].payload
    prompt = select_prompts(recipe, tokenizer)[0][0]
    answer = greedy_answer(verifier, prompt, 30, set())  # no stop: 30 tokens
    K, W = recipe.tree.chain_length, recipe.window.head_window
    drives, rings = [], []
    try:
        for skip in (True, False):
            runner = hc.TorchHeadRunner(graph, shapes)
            drafter = MtpDrafter(runner, bundle)
            drives.append(
                hc.drive_request(engine, drafter, prompt, 30, answer if skip else None, targets=[24], chain_length=K)
            )
            rings.append(runner.records[0])
    finally:
        engine.close()
    skip, plain = drives
    assert skip.answer_tokens == plain.answer_tokens == 30 and skip.drafts == plain.drafts == 1
    assert skip.rounds == 6 and plain.rounds == 30  # an 18-token stretch, then chains of 0..K near the target
    a, b = rings
    live_a, live_b = (int((r["mask_full"] == 0).sum()) for r in rings)
    print(f"rounds {skip.rounds} vs {plain.rounds}; live columns {live_a} vs {live_b}")
    assert live_a == live_b == W  # the prompt and 24+ answer tokens wrap the 16-column ring either way
    s = np.asarray(hc.handoff_scales(recipe), np.float32)
    for name, scale in (("k_full", s[4]), ("v_full", s[5])):
        cols = [c for c in range(W) if a["mask_full"].reshape(-1)[c] == 0 and b["mask_full"].reshape(-1)[c] == 0]
        assert len(cols) >= W // 2
        np.testing.assert_allclose(a[name][0, :, cols], b[name][0, :, cols], atol=1.01 * scale)
