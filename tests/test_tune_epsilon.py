"""`hycoc tune-epsilon` (hycoc/bench/paper/tune_epsilon.py): the selection rule on a hand-made sweep table, the
validation set's checks, and one small sweep end to end on the tiny recipe (verifier child process, device runtime
here), whose choice is recomputed by hand from its records."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console
from tiny_bench import run_on_bundle, save_flat_cost_model
from typer.testing import CliRunner

from hycoc.bench.paper.quality import answer_metrics
from hycoc.bench.paper.tune_epsilon import (
    SweepRow,
    Tolerance,
    TuneError,
    TunePlan,
    check_row,
    choose_epsilon,
    load_validation,
    run_tune,
)
from hycoc.cli import app
from hycoc.recipe import RecipeError, parse_recipe

TOL = Tolerance(compression_drop=0.03, repetition_rise=0.05, distinct2_drop=0.05, g_tie_pct=2.0)


def row(eps, g, comp=0.0, rep=0.0, d2=0.0):
    return SweepRow(
        epsilon=eps, mat=None, g=g, deltas={"compression_ratio": comp, "repeated_4gram_share": rep, "distinct_2": d2}
    )


def test_choice_on_a_hand_made_sweep():
    rows = [
        row(0.001, 2.00, comp=-0.10),  # cheapest, but its text compresses 0.10 better: loops
        row(0.005, 2.40, rep=+0.06),  # repeated 4-grams up 6 points > 5
        row(0.01, 2.50, comp=-0.02, rep=0.01, d2=-0.01),
        row(0.02, 2.54, comp=-0.03, d2=-0.05),  # at the limits: admissible; 2.54 <= 2.50 * 1.02 ties
        row(0.1, 2.56),  # admissible, 2.4% above the lowest: no tie
        row(1.0, 3.50, comp=None, rep=None, d2=None),
    ]  # exact: the reference, always admissible
    chosen = choose_epsilon(rows, TOL)
    assert chosen.epsilon == 0.02
    assert [r.admissible for r in rows] == [False, False, True, True, True, True]
    assert rows[0].failed == ["compression_ratio -0.100 < -0.030"]
    assert rows[1].failed == ["repeated_4gram_share +0.060 > +0.050"]
    # without the tie allowance the lowest g wins; with every ε failing, exact is chosen
    assert choose_epsilon(rows, Tolerance(0.03, 0.05, 0.05, 0.0)).epsilon == 0.01
    assert choose_epsilon([row(0.01, 1.0, comp=-1), row(1.0, 3.0)], TOL).epsilon == 1.0
    assert check_row(SweepRow(0.01, None, 1.0), TOL) == [
        f"{k}: no paired value" for k in ("compression_ratio", "repeated_4gram_share", "distinct_2")
    ]
    with pytest.raises(TuneError, match="exact-acceptance row"):
        choose_epsilon([row(0.01, 1.0, comp=-1)], TOL)
    from hycoc.bench.paper.tune_epsilon import render_sweep, sweep_table

    table = sweep_table(rows, chosen, TOL)
    assert [r[0] for r in table.rows] == ["0.001", "0.005", "0.01", "0.02", "0.1", "1 (exact)"]
    assert [r[-1] for r in table.rows] == [
        "no: compression_ratio -0.100 < -0.030",
        "no: repeated_4gram_share +0.060 > +0.050",
        "yes",
        "chosen",
        "yes",
        "yes",
    ]
    console = Console(file=io.StringIO(), width=80)
    render_sweep(rows, chosen, TOL, console)
    out = console.file.getvalue()
    assert max(map(len, out.splitlines())) <= 80 and "…" not in out and "1 (exact)" in out


def test_the_rule_recorded_without_docstrings():
    """tune.json records the rule from `choose_epsilon`'s docstring; under python -OO (docstrings stripped) it
    records none instead of failing after the sweep (it raised AttributeError on None.split)."""
    import subprocess
    import sys

    from hycoc.bench.paper.tune_epsilon import _rule_text

    assert _rule_text().startswith("1. An ε is admissible")
    code = "from hycoc.bench.paper.tune_epsilon import _rule_text; print(repr(_rule_text()))"
    run = subprocess.run([sys.executable, "-OO", "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip() == "None"


def test_tune_table_in_the_recipe():
    r = parse_recipe(
        '[tune]\nvalidation_data = "v.jsonl"\nepsilons = [0.01, 0.1]\nmax_compression_drop = 0.1\n', "r.toml"
    )
    assert r.tune.epsilons == [0.01, 0.1] and r.tune.mode == "hyco" and r.tune.prompts == 60
    assert Tolerance.from_recipe(r.tune) == Tolerance(0.1, 0.05, 0.05, 2.0)
    with pytest.raises(RecipeError, match=r"r.toml:2: tune.epsilons\[1\] = 1.0: .*each in \(0, 1\)"):
        parse_recipe("[tune]\nepsilons = [0.5, 1.0]\n", "r.toml")


def conversation(user, answer):
    return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})


def test_validation_set_is_checked(tmp_path):
    path = tmp_path / "val.jsonl"
    path.write_text("\n".join([conversation("w1 w2", "w3"), "", conversation("w4", "w5 w6")]) + "\n")
    qs = load_validation(path, 2)
    assert [(q.question_id, q.turns, q.reference) for q in qs] == [(1, ("w1 w2",), ("w3",)), (3, ("w4",), ("w5 w6",))]
    with pytest.raises(TuneError, match="2 conversations, tune.prompts = 3"):
        load_validation(path, 3)
    with pytest.raises(TuneError, match="is keep_set.corpus"):
        load_validation(path, 1, keep_set_corpus=path)
    with pytest.raises(TuneError, match=r"val.jsonl:3: this prompt is a benchmark question"):
        load_validation(path, 2, benchmark_turns={"w4"})
    bad = tmp_path / "sb.jsonl"
    bad.write_text(json.dumps({"question_id": 81, "category": "writing", "turns": ["x"]}) + "\n")
    with pytest.raises(TuneError, match="sb.jsonl:1: a Spec-Bench question"):
        load_validation(bad, 1)


def test_validation_questions_come_from_the_option_or_the_recipe_and_skip_the_benchmark(tmp_path):
    from pathlib import Path

    from hycoc.bench.paper.tune_epsilon import validation_questions
    from hycoc.recipe import load_recipe

    root = Path(__file__).resolve().parents[1]
    toy, default = root / "recipes" / "toy.toml", root / "benchmarks" / "data" / "spec_bench_question.jsonl"
    cfg = load_recipe(toy)
    own = validation_questions(cfg, toy, None, 2, default)  # tune.validation_data of the recipe
    assert [q.question_id for q in own] == [1, 2] and all(q.category == "validation" for q in own)
    val = tmp_path / "val.jsonl"
    val.write_text(conversation("w1 w2", "w3") + "\n")
    assert [q.turns for q in validation_questions(cfg, toy, val, 1, default)] == [("w1 w2",)]
    first_turn = json.loads(default.read_text(encoding="utf-8").splitlines()[0])["turns"][0]
    val.write_text(conversation(first_turn, "w3") + "\n")
    with pytest.raises(TuneError, match="this prompt is a benchmark question"):
        validation_questions(cfg, toy, val, 1, default)
    empty = cfg.model_copy(update={"tune": cfg.tune.model_copy(update={"validation_data": ""})})
    with pytest.raises(TuneError, match=r"toy.toml: tune.validation_data is empty; set it to a JSONL"):
        validation_questions(empty, toy, None, 1, default)


def test_cli_checks_its_arguments(tiny_bundle):
    result = CliRunner().invoke(app, ["tune-epsilon", str(tiny_bundle.path)])
    assert result.exit_code == 1 and "tune.validation_data is empty" in result.stderr
    result = CliRunner().invoke(app, ["tune-epsilon", str(tiny_bundle.path), "--epsilons", "0.01,1"])
    assert result.exit_code == 2 and "--epsilons '0.01,1': allowed" in result.stderr


def test_sweep_end_to_end_matches_a_hand_computation(tiny_bundle, tmp_path):
    recipe, path, root = tiny_bundle.recipe, tiny_bundle.path, tiny_bundle.root
    val = tmp_path / "val.jsonl"
    val.write_text("\n".join(conversation(f"w{i} w{i + 7} w{i + 3}", f"w{i + 1} w{i + 2}") for i in range(3)) + "\n")
    # every tree of the tiny recipe has B + 1 = 5 rows: 10 ms a forward at any context, so g projected = 10 / MAT
    save_flat_cost_model(tmp_path / "cost.json", {1: 10.0, 5: 10.0})
    tol = Tolerance(compression_drop=0.05, repetition_rise=0.1, distinct2_drop=0.1, g_tie_pct=2.0)
    plan = TunePlan(
        questions=load_validation(val, 3),
        epsilons=[0.5, 0.01],
        mode="hyco",
        output_cap=8,
        temperature=1.0,
        tolerance=tol,
        out=tmp_path / "out",
    )
    result = run_on_bundle(run_tune, recipe, path, root, plan, cost_model_path=tmp_path / "cost.json")
    assert json.loads((plan.out / "tune.json").read_text()) == json.loads(json.dumps(result))
    records = [json.loads(line) for line in (plan.out / "records.jsonl").read_text().splitlines()]
    assert sorted({r["config"] for r in records}) == ["eps=0.01", "eps=0.5", "exact"] and len(records) == 9

    # by hand: g = 10 ms x rounds / tokens; deltas = mean over prompts of (metric at ε - metric at exact)
    by = {(r["config"], r["question_id"]): r for r in records}

    def g(label):
        rs = [r for r in records if r["config"] == label]
        return 10.0 * sum(r["rounds"] for r in rs) / sum(r["tokens"] for r in rs)

    def delta(label, key):
        d = [
            answer_metrics(by[(label, q)]["text"], by[(label, q)]["output_ids"])[key]
            - answer_metrics(by[("exact", q)]["text"], by[("exact", q)]["output_ids"])[key]
            for q in (1, 2, 3)
        ]
        return sum(d) / len(d)

    hand = {}
    for label, eps in (("eps=0.01", 0.01), ("eps=0.5", 0.5), ("exact", 1.0)):
        ok = eps == 1.0 or (
            delta(label, "compression_ratio") >= -0.05
            and delta(label, "repeated_4gram_share") <= 0.1
            and delta(label, "distinct_2") >= -0.1
        )
        hand[eps] = (g(label), ok)
    low = min(gv for gv, ok in hand.values() if ok)
    expected = max(e for e, (gv, ok) in hand.items() if ok and gv <= low * 1.02)
    assert result["chosen_epsilon"] == expected
    rows = {r["epsilon"]: r for r in result["rows"]}
    for eps, (gv, ok) in hand.items():
        assert rows[eps]["g"] == pytest.approx(gv) and rows[eps]["admissible"] is ok
    assert rows[0.01]["deltas"]["compression_ratio"] == pytest.approx(delta("eps=0.01", "compression_ratio"))
    assert result["recipe_line"] == f"epsilon = {expected:g}"
