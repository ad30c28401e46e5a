"""`hycoc bench` end to end on the tiny recipe (hycoc/bench/paper/runner.py): a real `hycoc verify-server` child
process, the device runtime in this process, records appended per request, --resume, results.json and plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_bench import quiet_console, run_on_bundle, save_flat_cost_model
from typer.testing import CliRunner

from hycoc.bench.datasets import load_spec_bench
from hycoc.bench.paper.records import BenchError, read_records
from hycoc.bench.paper.runner import BenchPlan, run_bench
from hycoc.cli import DEFAULT_DATASET, app

TOY = Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"  # not the working directory's

CONFIGS = ["cloud-mtp", "specedge", "hyco", "hyco-exact", "slm-alone"]


@pytest.fixture(scope="module")
def built(tiny_bundle):
    recipe, path, root = tiny_bundle.recipe, tiny_bundle.path, tiny_bundle.root
    save_flat_cost_model(root / "cost.json", {1: 10.0, 5: 10.0, 33: 11.0})
    return recipe, path, root


@pytest.mark.slow
def test_bench_runs_every_config_and_resumes(built, tmp_path):
    recipe, path, root = built
    questions = [q for q in load_spec_bench(DEFAULT_DATASET) if q.category in ("math_reasoning", "translation")][:2]
    plan = BenchPlan(questions=questions, configs=CONFIGS, runs=1, link="lte", output_cap=6, out=tmp_path / "out")
    console = quiet_console()
    first = BenchPlan(**{**plan.__dict__, "configs": CONFIGS[:2]})
    run_on_bundle(run_bench, recipe, path, root, first, cost_model_path=root / "cost.json", console=console)
    assert len(read_records(plan.out / "records.jsonl")) == 4
    with pytest.raises(BenchError, match="pass --resume"):
        run_on_bundle(run_bench, recipe, path, root, plan, console=console)
    results = run_on_bundle(run_bench, recipe, path, root, plan, resume=True, console=console)  # measures
    assert len(read_records(plan.out / "records.jsonl")) == 10
    # a resume with nothing left reuses OUT/cost_model.json: results.json's summary stays as it was
    model_text = (plan.out / "cost_model.json").read_text(encoding="utf-8")
    before = json.loads((plan.out / "results.json").read_text(encoding="utf-8"))["summary"]
    again = run_on_bundle(run_bench, recipe, path, root, plan, resume=True, console=console)
    assert (plan.out / "cost_model.json").read_text(encoding="utf-8") == model_text
    assert json.loads((plan.out / "results.json").read_text(encoding="utf-8"))["summary"] == before
    assert "reused from" in again["meta"]["cost_model"]
    assert results["summary"]["hyco"]["delta_g_projected_ci_covers_cost_model"] is True
    assert all(r["finish_reason"] in ("stop", "max_new_tokens", "length") for r in again["records"])
    records = results["records"]
    assert len(records) == 10 and sorted({r["config"] for r in records}) == sorted(CONFIGS)
    saved = json.loads((plan.out / "results.json").read_text())
    assert saved["summary"] == json.loads(json.dumps(results["summary"]))
    for rec in records:
        assert 1 <= rec["tokens"] <= 6 and rec["verifier_logprob"] is not None and rec["verifier_logprob"] < 0
        if rec["config"] == "slm-alone":
            assert rec["server_ms"] == [] and rec["prefill_ms"] == 0
        else:
            assert len(rec["server_ms"]) == rec["rounds"] and rec["link_ms"] > 0
            # the link is counted: 58 ms round trip per frame pair (open + every round) at least
            assert rec["seconds"] * 1000 >= 58 * (rec["rounds"] + 1)
        if rec["config"] in ("specedge", "hyco", "hyco-exact"):
            assert set(rec["rows"]) == {5}  # B + 1 rows of the tiny recipe
        q = rec["quality"]  # hycoc.bench.paper.quality: repetition of every answer, reference metrics by category
        assert q["words"] >= 0 and q["longest_run"] >= 1 and q["rouge_l"] is None
        assert rec["category"] == "translation"  # the first two of the two categories are translations
        assert 0 <= q["chrf"] <= 100 and 0 <= q["bleu"] <= 100 and q["final_number_match"] is None
    s = results["summary"]
    for config in CONFIGS:
        assert s[config]["requests"] == 2
        assert s[config]["quality"]["metrics"]["longest_run"]["n"] == 2
        assert s[config]["quality"]["metrics"]["chrf"]["n"] == 2
    assert s["cloud-mtp"]["quality"]["metrics"]["longest_run"]["delta"] == 0.0
    cloud = [r for r in records if r["config"] == "cloud-mtp"]
    g = sum(r["prefill_ms"] + sum(r["server_ms"]) for r in cloud) / sum(r["tokens"] for r in cloud)
    assert s["cloud-mtp"]["g_ms_per_token"] == pytest.approx(g)
    assert s["cloud-mtp"]["delta_g_pct"] == pytest.approx(0.0)
    assert s["slm-alone"]["g_ms_per_token"] is None
    assert (plan.out / "mat_vs_g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hyco-exact" in console.file.getvalue()
    # device time: no --device-profile, so the labelled estimate prices the graph calls each round ran
    dtime = results["device_time"]
    assert dtime["estimated"] and dtime["source"].startswith("ESTIMATE") and set(dtime["configs"]) == set(CONFIGS)
    assert "no --device-profile given" in console.file.getvalue()
    K = recipe.tree.chain_length
    for rec in records:
        calls = rec["draft_calls"]
        if rec["config"] == "cloud-mtp":
            assert calls == {} and rec["draft_ms"] == 0
        elif rec["config"] == "slm-alone":
            assert calls == {"slm_decode": rec["tokens"]}
        else:  # one MTP draft of K steps after every round but the last (device chain)
            assert calls.get("head", 0) == (K * (rec["rounds"] - 1) if rec["config"].startswith("hyco") else 0)
            assert calls["slm"] >= rec["rounds"]
        assert 0 <= rec["draft_graph_ms"] <= rec["draft_ms"] + 1e-6


def test_cli_bench_checks_its_arguments(tmp_path):
    result = CliRunner().invoke(app, ["bench", str(TOY), "--configs", "hyco,fast"])
    assert result.exit_code == 2 and "--configs: unknown fast" in result.stderr
    result = CliRunner().invoke(app, ["bench", str(TOY), "--cost-model", str(tmp_path / "nope.json")])
    assert result.exit_code == 1 and "no such file" in result.stderr
    result = CliRunner().invoke(app, ["bench", str(TOY), "--link", "50:0"])
    assert result.exit_code == 2 and "--link '50:0': allowed" in result.stderr


def test_calibrate_handoff_prints_six_scales_for_the_recipe(built):
    from hycoc.passes.handoff_scales import KINDS

    _, path, _ = built
    result = CliRunner().invoke(app, ["calibrate-handoff", str(path), "--prompts", "2", "--max-new-tokens", "4"])
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert lines[0].startswith("# [handoff] scales measured by `hycoc calibrate-handoff`")
    values = dict(line.split(" = ") for line in lines[1:])
    assert list(values) == [f"scale_{k}" for k in KINDS] and all(float(v) > 0 for v in values.values())


def test_resume_refuses_records_made_with_other_settings(built, tmp_path):
    recipe, path, root = built
    questions = load_spec_bench(DEFAULT_DATASET)[:1]
    plan = BenchPlan(questions=questions, configs=["slm-alone"], runs=1, link="none", output_cap=4, out=tmp_path / "o")
    run_on_bundle(run_bench, recipe, path, root, plan, cost_model_path=root / "cost.json")
    other = BenchPlan(**{**plan.__dict__, "output_cap": 8, "link": "lte"})
    with pytest.raises(BenchError, match="output_cap: 4 there, 8 now, link: 'none' there, 'lte' now"):
        run_on_bundle(run_bench, recipe, path, root, other, resume=True)


def test_a_request_run_takes_the_plans_records_link_and_cap(tmp_path):
    """`RequestRun.for_plan`: records in OUT/records.jsonl, the plan's link and output cap; the rest as given;
    frozen."""
    import dataclasses

    from hycoc.bench.paper.request_loop import RequestRun

    plan = BenchPlan(questions=[], configs=["hyco"], runs=1, link="5g", output_cap=7, out=tmp_path)
    run = RequestRun.for_plan(plan, Path("r.toml"), Path("b"), {1: [5, 6]}, sampling=None, seed=3, turns=2)
    assert (run.recipe_path, run.bundle_dir, run.records_path) == (
        Path("r.toml"),
        Path("b"),
        tmp_path / "records.jsonl",
    )
    assert (run.prompts, run.link, run.output_cap, run.seed, run.turns) == ({1: [5, 6]}, "5g", 7, 3, 2)
    assert run.anchors == {} and run.thinking is False  # no anchors: every OPEN anchors at 0
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 4  # type: ignore[misc]


def test_settings_json_keys_come_in_their_written_order(tmp_path):
    """A bench's and a sweep's settings.json (`comparable_settings`): the same hashes and sampling keys, in the order
    the files have always had (written out here by hand), with each one's own keys where they stood."""
    import hashlib
    from types import SimpleNamespace

    from hycoc.bench.paper.runner import run_settings
    from hycoc.bench.paper.tune_epsilon import Tolerance, TunePlan, tune_settings

    (tmp_path / "manifest.json").write_text("{}")
    recipe = SimpleNamespace(
        content_hash=lambda: "abc", sampling=SimpleNamespace(temperature=0.5, top_k=64, top_p=0.95, seed=7)
    )
    bench = BenchPlan(questions=[], configs=[], runs=1, link="lte", output_cap=9, out=tmp_path, turns=2)
    tune = TunePlan([], [0.1], "hyco", 5, 1.0, Tolerance(), tmp_path, link="none")
    common = {"recipe_sha256": "abc", "bundle_manifest_sha256": hashlib.sha256(b"{}").hexdigest(), "backend": "cpu"}
    assert list(run_settings(recipe, bench, tmp_path, "cpu").items()) == [
        *common.items(),
        ("output_cap", 9),
        ("link", "lte"),
        ("temperature", 0.5),
        ("top_k", 64),
        ("top_p", 0.95),
        ("seed", 7),
        ("turns", 2),
        ("thinking", False),
    ]
    assert list(tune_settings(recipe, tune, tmp_path, "cpu").items()) == [
        *common.items(),
        ("output_cap", 5),
        ("temperature", 1.0),  # the sweep's own temperature, not the recipe's
        ("top_k", 64),
        ("top_p", 0.95),
        ("seed", 7),
        ("mode", "hyco"),
        ("link", "none"),
    ]


def test_turn_summary_hand_worked():
    from hycoc.bench.paper.turns import turn_summary

    recs = [
        {"config": "hyco", "turn": 1, "tokens": 10, "rounds": 4, "prefill_ms": 20.0, "server_ms": [5.0] * 4},
        {
            "config": "hyco",
            "turn": 2,
            "tokens": 6,
            "rounds": 2,
            "prefill_ms": 4.0,
            "server_ms": [6.0, 6.0],
            "prefill_ms_cold": 30.0,
        },
        {
            "config": "hyco",
            "turn": 2,
            "tokens": 4,
            "rounds": 2,
            "prefill_ms": 6.0,
            "server_ms": [5.0, 5.0],
            "prefill_ms_cold": 40.0,
        },
        {"config": "slm-alone", "turn": 1, "tokens": 5, "rounds": 5, "prefill_ms": 0.0, "server_ms": []},
    ]
    assert turn_summary(recs) == {
        "hyco": {
            "1": {"requests": 1, "prefill_ms": 20.0, "prefill_ms_saved": None, "g_ms_per_token": 4.0, "mat": 2.5},
            "2": {"requests": 2, "prefill_ms": 5.0, "prefill_ms_saved": 30.0, "g_ms_per_token": 3.2, "mat": 2.5},
        }
    }


def test_bench_second_turns_continue_the_session(built, tmp_path, monkeypatch):
    """A second turn is an APPEND on the first turn's session; the cold prefill it is compared with is a new
    session's OPEN of the whole conversation with the SLM ring filled meanwhile (hyco-exact uses the SLM), as
    `DeviceRuntime.generate` opens one, so both prefills compete with the same device work."""
    from hycoc.runtime.slm_drafter import SlmDrafter

    recipe, path, root = built
    started: list[int] = []  # the lengths of the prompts the SLM ring started on (a new request each)
    real_start = SlmDrafter.start
    monkeypatch.setattr(
        SlmDrafter, "start", lambda self, ids, *a, **k: (started.append(len(ids)), real_start(self, ids, *a, **k))[1]
    )
    questions = [q for q in load_spec_bench(DEFAULT_DATASET) if len(q.turns) == 2][:1]
    plan = BenchPlan(
        questions=questions,
        configs=["hyco-exact", "slm-alone"],
        runs=1,
        link="none",
        output_cap=6,
        out=tmp_path / "two",
        turns=2,
    )
    results = run_on_bundle(run_bench, recipe, path, root, plan, cost_model_path=root / "cost.json")
    recs = {(r["config"], r["turn"]): r for r in results["records"]}
    assert sorted(recs) == [("hyco-exact", 1), ("hyco-exact", 2), ("slm-alone", 1)]
    first, second = recs["hyco-exact", 1], recs["hyco-exact", 2]
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["tokens"]  # + the second question
    assert second["prefill_ms_cold"] > 0 and 1 <= second["tokens"] <= 6
    t = results["turns"]["hyco-exact"]
    assert t["2"]["prefill_ms_saved"] == pytest.approx(second["prefill_ms_cold"] - second["prefill_ms"])
    assert t["1"]["mat"] == pytest.approx(first["tokens"] / first["rounds"])
    # turn 1 and slm-alone each start the ring on their prompt; the cold OPEN on the whole conversation
    assert sorted(started) == sorted(
        [first["prompt_tokens"], recs["slm-alone", 1]["prompt_tokens"], second["prompt_tokens"]]
    )


def test_measure_handoff_scales_is_the_max_over_the_answers_at_percentile_100(built):
    """At percentile 100 every scale is max |x| / 127 over every position of prompt + greedy answer, computed here
    on an independent path: the input of the final norm by a forward hook (not the engine's NormTap), the
    embedding table rows of the ids, the producer layers' K/V from a plain transformers forward."""
    import torch
    from hycoc.passes.handoff_scales import measure_handoff_scales
    from hycoc.passes.head.captures import greedy_answer
    from hycoc.passes.head.prompts import prompt_sources
    from hycoc.verifier.engine import producer_layers
    from transformers import DynamicCache

    from hycoc.chat_template import chat_from_recipe
    from hycoc.models import load_verifier

    recipe, _, _ = built
    got = measure_handoff_scales(recipe, prompts=2, max_new_tokens=4, percentile=100.0)
    chat = chat_from_recipe(recipe)
    model = load_verifier(recipe.model_path("verifier"), dtype=recipe.verifier.dtype, device="cpu")
    layers = producer_layers(model.config)
    want = dict.fromkeys(got, 0.0)
    seen = {}
    hook = model.model.norm.register_forward_hook(lambda m, args, out: seen.__setitem__("pre", args[0]))
    try:
        for text in prompt_sources(recipe)[0][:2]:
            ids = chat.prompt(text)
            seq = ids + greedy_answer(model, ids, 4, chat.stop_ids)
            cache = DynamicCache()
            with torch.inference_mode():
                model(input_ids=torch.tensor([seq]), cache=cache, use_cache=True)
                emb = model.model.embed_tokens(torch.tensor([seq]))
            top = {"embedding": emb, "hidden": seen["pre"]}
            for kind, short in (("sliding_attention", "sliding"), ("full_attention", "full")):
                top[f"k_{short}"] = cache.layers[layers[kind]].keys
                top[f"v_{short}"] = cache.layers[layers[kind]].values
            for k, x in top.items():
                want[k] = max(want[k], float(x.abs().max()) / 127)
    finally:
        hook.remove()
    assert got == pytest.approx(want, rel=1e-6)
    half = measure_handoff_scales(recipe, prompts=2, max_new_tokens=4, percentile=50.0)
    assert all(0 < half[k] < got[k] for k in got)  # the median of |x| is below its maximum
