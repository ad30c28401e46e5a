"""hycoc.bench.tables and the bench's result tables: split to the console's width with whole configuration names and
CI cells, Markdown and CSV; the projection's interval over the cost model's own repetitions; the cost model an
earlier bench measured reused by --resume; every command's --help at 80 columns."""

from __future__ import annotations

import csv
import io
import json
import re

import numpy as np
import pytest
from rich.console import Console
from typer.testing import CliRunner

from hycoc.bench.cost_model.model import CostModel, CostPoint, Forward, bootstrap_tables, predict_tables
from hycoc.bench.paper.report_tables import categories_table, main_table, quality_table, render_table
from hycoc.bench.paper.summary import summarize
from hycoc.bench.tables import TextTable, console_width, fit_columns, print_tables, table_width, to_csv

CONFIGS = ("cloud-mtp", "specedge", "specedge-eps", "hyco", "hyco-2p", "hyco-exact", "server-head")


def rec(config, qid, *, tokens, server, rows, context, category, prefill=10.0):
    return {
        "config": config,
        "run": 0,
        "question_id": qid,
        "category": category,
        "turn": 1,
        "prompt_tokens": 40,
        "tokens": tokens,
        "rounds": len(server),
        "accepted": [1] * len(server),
        "prefill_ms": prefill,
        "server_ms": list(server),
        "rows": list(rows),
        "context": list(context),
        "seconds": 1.5,
        "first_token_ms": 123.0,
        "draft_ms": 40.0,
        "slm_prefill_ms": 5.0,
        "bytes_up": [12345] * len(server),
        "bytes_down": [678] * len(server),
        "bonus_outside_keep": 0,
        "link_ms": 0.0,
        "text": "",
        "finished": True,
        "finish_reason": "length",
        "verifier_logprob": -1.25,
        "reference_match": None,
    }


def fixed_records(configs=CONFIGS, questions=12):
    """Every configuration on 12 questions in 4 categories; per-question costs vary so every Δg has a real CI."""
    out = []
    for k, name in enumerate(configs):
        for q in range(questions):
            rounds = 3 + (q * 7 + k) % 5
            rows = 5 if name == "cloud-mtp" else 33
            server = [10.0 + ((q * 13 + k * 5) % 11) for _ in range(rounds)]
            out.append(
                rec(
                    name,
                    q,
                    tokens=4 * rounds + q % 3,
                    server=server,
                    rows=[rows] * rounds,
                    context=[50 + 9 * i for i in range(rounds)],
                    category=("writing", "math_reasoning", "translation", "summarization")[q % 4],
                )
            )
    return out


def model(samples: bool = True, noise: float = 0.0) -> CostModel:
    rng = np.random.default_rng(5)
    pts = []
    for kind, rows_list in (("verify", (1, 5, 33)), ("head_step", (1,)), ("prefill", (1, 64, 512))):
        for rows in rows_list:
            for ctx in (64, 128, 512):
                ms = 2.0 + 0.3 * rows + ctx / 100 + (kind == "head_step")
                x = ms * (1 + noise * rng.standard_normal(9)) if noise else np.full(9, ms)
                pts.append(
                    CostPoint(
                        kind=kind,
                        rows=rows,
                        context=ctx,
                        ms=float(np.median(x)),
                        samples_ms=[float(v) for v in x] if samples else None,
                    )
                )
    return CostModel(device="cpu (1 threads)", dtype="float32", model="toy", points=pts)


def lines_of(console: Console) -> list[str]:
    return console.file.getvalue().splitlines()


@pytest.mark.parametrize("width", [80, 120])
def test_main_table_fits_the_width_with_whole_names_and_ci_cells(width):
    s = summarize(fixed_records(), cost_model=model(), bootstrap=200, server={"chain_length": 4, "head_window": 64})
    console = Console(file=io.StringIO(), width=width)
    render_table(s, console, title="hycoc bench: 12 questions")
    text = lines_of(console)
    assert max(map(len, text)) <= width
    for name in CONFIGS:  # every name whole, at the start of its row in every part
        assert sum(1 for ln in text if re.match(rf"[│┃] {re.escape(name)} +[│┃]", ln)) >= 2, name
    cis = [
        f"{s[n]['delta_g_pct']:+.1f} [{s[n]['delta_g_ci95'][0]:+.1f}, {s[n]['delta_g_ci95'][1]:+.1f}]"
        for n in CONFIGS[1:]
    ]
    assert all(sum(ci in ln for ln in text) == 1 for ci in cis), cis  # each CI cell on one line, unwrapped
    assert sum(ln.count("[95% CI]") for ln in text) >= 2  # Δg and Δg proj. headers
    assert any("(1/" in ln for ln in text)  # split: the parts are numbered


def test_categories_and_quality_tables_split_by_configuration_at_120_columns():
    s = summarize(fixed_records(), bootstrap=50)
    console = Console(file=io.StringIO(), width=120)
    print_tables([categories_table(s), quality_table(s)], console)
    text = lines_of(console)
    assert max(map(len, text)) <= 120
    joined = "\n".join(text)
    for name in CONFIGS:
        assert re.search(rf"\b{re.escape(name)}\b", joined.replace("hyco-exact", "§") if name == "hyco" else joined), (
            name
        )
    assert "hyco-exact" in joined and "summarization" in joined


def test_fit_columns_packs_columns_after_the_keys_in_order():
    t = TextTable("t", ["config", "a", "b", "c"], [["hyco-exact", "1" * 20, "2" * 20, "3" * 20]], caption="legend")
    assert table_width([10, 20, 20, 20]) == 70 + 13
    parts = fit_columns(t, 80)  # 10 + 20 + 20 + 3 * 3 + 1 = 60 fits, a third 20-wide column does not
    assert [p.headers for p in parts] == [["config", "a", "b"], ["config", "c"]]
    assert [p.title for p in parts] == ["t (1/2)", "t (2/2)"] and [p.caption for p in parts] == [None, "legend"]
    assert fit_columns(t, 200) == [t]


def test_markdown_and_csv_carry_every_column_unsplit():
    s = summarize(fixed_records(), cost_model=model(), bootstrap=50, server={"chain_length": 4, "head_window": 64})
    table = main_table(s)
    rows = list(csv.reader(io.StringIO(to_csv(table))))
    assert rows[0] == [f"# {table.title}"] and rows[1] == table.headers and len(rows) == 2 + len(CONFIGS)
    assert rows[2 + CONFIGS.index("hyco-exact")][0] == "hyco-exact"
    assert rows[2 + CONFIGS.index("hyco")][table.headers.index("g ms/tok")] == f"{s['hyco']['g_ms_per_token']:.2f}"
    console = Console(file=io.StringIO(), width=80)
    print_tables([table], console, "markdown")
    md = lines_of(console)
    assert md[2].startswith("| config | n | g ms/tok |") and md[3].startswith("| :--- | ---: |")
    assert sum(ln.startswith("| hyco-exact |") for ln in md) == 1
    with pytest.raises(ValueError, match="one of table, markdown, csv"):
        print_tables([table], console, "html")


def test_console_width_honours_columns_when_redirected():
    assert console_width(False, None, {"COLUMNS": "150"}) == 150
    assert console_width(False, None, {}) == 120
    assert console_width(False, None, {"COLUMNS": "40"}) == 80
    assert console_width(True, 96, {"COLUMNS": "150"}) == 96


def test_redirected_report_lines_are_not_wrapped_and_tables_still_fit(monkeypatch, capsys):
    """Redirected (stdout is not a terminal under pytest), the bench's and inspect's console lays tables out at
    ``COLUMNS`` or 120 but prints a line of text whole: a note such as "bundle ... was built from another version
    of recipe 'toy'; its round constants are the bundle's ..." used to break at column 120, so grep missed it."""
    from hycoc.bench.paper.runner import make_console
    from hycoc.inspect_tables import inspect_console

    monkeypatch.delenv("COLUMNS", raising=False)
    note = "note: " + " ".join(f"word{i}" for i in range(60))  # ~ 400 columns
    for make in (make_console, inspect_console):  # both `hycoc.bench.tables.report_console`
        console = make()
        assert console.width == 120 and console.soft_wrap
        console.print(note)
        console.print(f"[yellow]{note}[/]")
        wide = TextTable("t", ["config", "text"], [["hyco", " ".join(["x"] * 150)]])
        print_tables([wide], console)
        out = capsys.readouterr().out.splitlines()
        assert out[:2] == [note, note]
        assert all(len(line) <= 120 for line in out[2:]) and len(out) > 5  # the table wrapped its cell, within 120


def test_predict_tables_equals_predict_on_every_kind_inside_and_outside_the_grid():
    m = model()
    forwards = [
        Forward(k, r, c)
        for k, rs in (("verify", (1, 3, 5, 20, 33)), ("head_step", (1,)), ("prefill", (1, 7, 64, 300, 512)))
        for r in rs
        for c in (0, 64, 100, 128, 400, 512, 900)
    ]
    got = predict_tables(m, bootstrap_tables(m, 3), forwards)
    want = [m.predict(f.rows, f.context, f.kind) for f in forwards]
    assert got.shape == (3, len(forwards))
    np.testing.assert_allclose(got, np.tile(want, (3, 1)), rtol=1e-12)  # samples all equal: every draw = medians
    assert bootstrap_tables(model(samples=False), 3) is None
    noisy = model(noise=0.3)
    shuffled = noisy.model_copy(update={"points": noisy.points[::-1]})  # a saved file sorts its points
    for kind, grid in bootstrap_tables(noisy, 5).items():
        np.testing.assert_array_equal(grid, bootstrap_tables(shuffled, 5)[kind])


def test_projected_interval_covers_the_cost_models_uncertainty():
    recs = fixed_records(("cloud-mtp", "hyco"))
    server = {"chain_length": 4, "head_window": 64}
    exact = summarize(recs, cost_model=model(), bootstrap=400, server=server)["hyco"]
    noisy = summarize(recs, cost_model=model(noise=0.3), bootstrap=400, server=server)["hyco"]
    bare = summarize(recs, cost_model=model(noise=0.3, samples=False), bootstrap=400, server=server)["hyco"]
    assert noisy["delta_g_projected_ci_covers_cost_model"] is True
    assert bare["delta_g_projected_ci_covers_cost_model"] is False
    assert bare["delta_g_projected_pct"] == noisy["delta_g_projected_pct"]  # same medians, same point

    def width(s):
        return s["delta_g_projected_ci95"][1] - s["delta_g_projected_ci95"][0]

    assert width(noisy) > 1.5 * width(bare)
    # no spread: questions only; the joint resampling's percentile interval and the BCa one of the questions
    # alone (hycoc.bench.paper.stats.paired_ratio_delta) then agree up to the two methods' bootstrap noise
    assert width(exact) == pytest.approx(
        width(summarize(recs, cost_model=model(samples=False), bootstrap=400, server=server)["hyco"]), rel=0.1
    )


def test_resume_reuses_the_saved_cost_model_and_the_summary_is_unchanged(tmp_path, monkeypatch):
    import sys
    import types

    from hycoc.bench.paper import runner

    measured = model(noise=0.2)
    calls = []
    fake = types.SimpleNamespace(measure_recipe_verifier=lambda recipe, contexts: calls.append(contexts) or measured)
    monkeypatch.setitem(sys.modules, "hycoc.bench.cost_model.measure", fake)  # no torch: the measurement is faked
    recs = fixed_records(("cloud-mtp", "hyco", "hyco-exact"))
    server = {"chain_length": 4, "head_window": 64}
    console = Console(file=io.StringIO())
    first, note1 = runner.cost_model_for(None, recs, None, tmp_path, console)
    again, note2 = runner.cost_model_for(None, recs, None, tmp_path, console)
    assert len(calls) == 1 and "reused from" in note2 and "--remeasure-cost-model" in note2
    a = json.dumps(summarize(recs, cost_model=first, server=server), sort_keys=True)
    b = json.dumps(summarize(recs, cost_model=again, server=server), sort_keys=True)
    assert a == b
    runner.cost_model_for(None, recs, None, tmp_path, console, remeasure=True)
    assert len(calls) == 2


def _commands():
    """Every command registered on the app (so a new command is checked too), by its command-line name."""
    from hycoc.cli import app

    return [c.name for c in app.registered_commands]


def test_the_help_check_covers_every_command_of_the_readme_table():
    """The commands the help checks run over are the README's command table's, read from the README."""
    import re
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    table = re.findall(r"^\| `hycoc ([a-z-]+)[ `]", readme, flags=re.M)
    assert len(table) >= 13 and "capacity" in table
    assert sorted(_commands()) == sorted(set(table))


@pytest.mark.parametrize("command", _commands())
def test_help_fits_80_columns_with_defaults_whole(command):
    import re

    import typer.main

    from hycoc.cli import app

    result = CliRunner().invoke(app, [command, "--help"], terminal_width=80, env={"COLUMNS": "80"})
    assert result.exit_code == 0
    lines = result.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in result.stdout
    # wrapped at spaces only: no option name nor default cut at a hyphen ("--auth-" / "token-file")
    assert not [line for line in lines if re.search(r"[A-Za-z]-$", line)], result.stdout
    assert result.stdout.startswith(f"Usage: hycoc {command} [OPTIONS]")
    # every option with a default shows it: typer's "[default: X]" or the help's own "(default: ...)"
    click_command = typer.main.get_command(app).commands[command]
    flat = " ".join(result.stdout.split())
    for p in click_command.params:
        if p.param_type_name == "option" and not p.is_flag and p.default is not None:
            record = " ".join(
                p.get_help_record(click_command.make_context(command, ["--help"], resilient_parsing=True))[1].split()
            )
            assert "default" in record and record[-40:] in flat, (command, p.name, record)
    if command == "bench":
        assert "[default: runs/bench]" in result.stdout and "--format" in result.stdout
        assert "--remeasure-cost-model" in result.stdout
        assert (
            "(default: all 8: cloud-mtp, specedge, specedge-eps, hyco, hyco-2p, hyco-exact, server-head, "
            "slm-alone)" in flat
        )


def test_labels_of_close_points_stack_instead_of_overlapping():
    from hycoc.bench.paper.plots import _label_offsets

    # hyco and hyco-exact a hair apart, specedge far away: the second close label goes one line up
    assert _label_offsets([(4.0, 3.1), (4.01, 3.1), (9.0, 1.0)], 5.0, 2.1) == [(6.0, 4.0), (6.0, 15.0), (6.0, 4.0)]


def test_a_percentile_statistic_is_what_the_draws_resample():
    from hycoc.bench.cost_model.model import CostModelError, sample_quantile

    assert (sample_quantile("median"), sample_quantile("p25"), sample_quantile("p0")) == (50.0, 25.0, 0.0)
    with pytest.raises(CostModelError, match="'median' or 'pNN'"):
        sample_quantile("mean")
    m = model(noise=0.3)
    low = m.model_copy(update={"meta": {"statistic": "p0"}})  # p0: the minimum of a resample
    draws = bootstrap_tables(low, 50)["verify"]
    floor = np.array(
        [
            [min(p.samples_ms) for p in sorted(m.points, key=lambda p: p.context) if p.kind == "verify" and p.rows == r]
            for r in (1, 5, 33)
        ]
    )
    assert (draws >= floor - 1e-12).all() and (draws.min(axis=0) == floor).all()


def test_g_busy_pools_the_verifier_process_cpu_time_and_pairs_it():
    recs = fixed_records(("cloud-mtp", "hyco"))
    for r in recs:  # busy = 60% of the wall time for cloud-mtp, 30% for hyco
        r["server_busy_ms"] = (0.6 if r["config"] == "cloud-mtp" else 0.3) * (r["prefill_ms"] + sum(r["server_ms"]))
    s = summarize(recs, bootstrap=100)
    c, h = s["cloud-mtp"], s["hyco"]
    assert c["g_busy_ms_per_token"] == pytest.approx(0.6 * c["g_ms_per_token"])
    assert h["g_busy_ms_per_token"] == pytest.approx(0.3 * h["g_ms_per_token"])
    want = 100 * (h["g_busy_ms_per_token"] / c["g_busy_ms_per_token"] - 1)
    assert h["delta_g_busy_pct"] == pytest.approx(want) and h["delta_g_busy_ci95"][0] <= want
    console = Console(file=io.StringIO(), width=120)
    render_table(s, console)
    assert "g busy" in console.file.getvalue() and "Δg busy % [95% CI]" in console.file.getvalue()
    del recs[0]["server_busy_ms"]  # an older record: no busy figure rather than a partial one
    assert summarize(recs, bootstrap=0)["cloud-mtp"]["g_busy_ms_per_token"] is None


def test_process_cpu_ms_counts_this_process_busy_time_not_its_sleep():
    import os
    import time

    from hycoc.bench.verifier_process import busy_since, process_cpu_ms

    start = process_cpu_ms(os.getpid())
    time.sleep(0.2)
    slept = busy_since(os.getpid(), start)
    t0 = time.process_time()
    while time.process_time() - t0 < 0.15:
        pass
    spun = busy_since(os.getpid(), start)
    tick = 1000.0 / os.sysconf("SC_CLK_TCK")
    assert slept <= 2 * tick and spun >= 150 - 2 * tick
    assert process_cpu_ms(2**31 - 1) is None and busy_since(None, 1.0) is None


def bench_results(configs=CONFIGS):
    """A results.json's printed parts: summary, per-turn (half the questions have a second turn) and device time."""
    from hycoc.bench.paper.turns import turn_summary

    recs = fixed_records(configs)
    recs += [dict(r, turn=2) for r in recs if r["question_id"] % 2 == 0]
    summary = summarize(recs, cost_model=model(), server={"chain_length": 4, "head_window": 64}, bootstrap=50)
    device = {
        c: {
            "calls_per_round": {"head": 4, "slm": 1},
            "phone_draft_ms_per_round": 50.0,
            "phone_draft_ms_per_token": 12.0,
            "host_ms_per_round": 3.0,
            "cpu_draft_ms_per_round": 40.0,
            "phone_tok_per_s": 30.0,
            "cpu_tok_per_s": None,
        }
        for c in sorted(configs)
    }  # alphabetical on purpose
    return {
        "meta": {"questions": 12, "link": "lte", "cost_model": "cost model: toy"},
        "summary": summary,
        "turns": turn_summary(recs),
        "device_time": {"source": "ESTIMATE", "configs": device},
    }


def test_every_bench_table_fits_80_columns_with_configuration_names_whole():
    from hycoc.bench.paper.runner import print_results

    console = Console(file=io.StringIO(), width=80)
    print_results(bench_results(), console)
    out = console.file.getvalue()
    lines = out.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in out
    device = out[out.index("device time per round") :]
    for name in CONFIGS:
        assert f"│ {name} " in device, name  # the device-time table names every configuration in full
    # one table flags the metrics worse than the baseline: the quality table, not also a part of the main one
    header_cells = [c.strip() for ln in lines if ln.startswith("┃") for c in ln.split("┃")]
    assert header_cells.count("worse than") == 1 and header_cells.count("zlib ratio") <= 1


def test_the_main_table_leaves_answer_quality_to_the_quality_table():
    s = bench_results()["summary"]
    assert not [h for h in main_table(s).headers if "worse than" in h or "zlib" in h]
    assert "worse than cloud-mtp" in quality_table(s).headers


def test_per_turn_and_device_tables_order_configurations_as_the_main_table():
    from hycoc.bench.paper.device_profile import device_table
    from hycoc.bench.paper.turns import turns_table

    results = bench_results()
    main = [r[0] for r in main_table(results["summary"]).rows]
    assert main == list(CONFIGS)
    turns = turns_table(results["turns"])
    assert [(r[0], r[1]) for r in turns.rows] == [(c, t) for c in CONFIGS for t in ("1", "2")]
    assert list(results["turns"]) == list(CONFIGS)  # results.json keeps the same order
    dev = device_table(results["device_time"]["configs"], "ESTIMATE")
    assert [r[0] for r in dev.rows] == main and dev.rows[0][-1] == "–"
