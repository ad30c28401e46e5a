"""Long-document summarization prompts (hycoc/bench/datasets.py, paper App. D): an InfiniteBench
``longbook_sum_eng``-schema file read with the paper's selection (HELMET's seed-42 order, 2-shot prompt), checked on
a small synthetic file of that schema with hand-worked order, demonstrations and prompt text; file:line errors; the
cut to a token budget; the toy file the repository ships fills the toy verifier's 4,096 positions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from paths import ROOT
from typer.testing import CliRunner

from hycoc.bench.datasets import (
    LONG_SUMMARY,
    DatasetError,
    fit_context,
    helmet_order,
    load_bench_dataset,
    load_long_summary,
    read_long_documents,
)
from hycoc.chat_template import load_chat
from hycoc.cli import app

INSTRUCTION = (
    "You are given a book and you are tasked to summarize it. Write a summary of about 1000 to 1200 "
    "words. Only write about the plot and characters of the story. Do not discuss the themes or "
    "background of the book. Do not provide any analysis or commentary.\n\n"
)


def infbench_file(tmp_path, rows=5) -> Path:
    path = tmp_path / "longbook_sum_eng.jsonl"
    path.write_text(
        "".join(
            json.dumps(
                {
                    "id": 10 + i,
                    "context": f"Book {i} line one.\nBook {i} line two.\n",
                    "input": "",
                    "answer": [f" Summary {i}. "],
                    "options": [],
                }
            )
            + "\n"
            for i in range(rows)
        ),
        encoding="utf-8",
    )
    return path


def test_the_papers_selection_and_2_shot_prompt_on_a_small_file(tmp_path):
    # datasets' shuffle(seed=42) of 5 rows is [4, 2, 3, 1, 0]; of the 4 rows other than row 4: [3, 2, 1, 0]
    assert helmet_order(5) == [4, 2, 3, 1, 0] and helmet_order(4) == [3, 2, 1, 0]
    qs = load_long_summary(infbench_file(tmp_path), count=3)
    assert [q.question_id for q in qs] == [14, 12, 13]
    assert qs[0].category == "long-summary" and qs[0].reference == (" Summary 4. ",)
    # row 4's demonstrations: the other rows' order 3, 2 -> rows 3 and 2 (ids 13, 12), summaries stripped
    assert qs[0].turns == (
        INSTRUCTION + "For example:\n\n[story text]\nSummary: Summary 3.\n\n[story text]\n"
        "Summary: Summary 2.\n\nNow, read the following story:\n\nBook 4 line one.\nBook 4 line "
        "two.\n\n\nNow summarize the book.\n\nSummary:",
    )
    assert len(load_long_summary(infbench_file(tmp_path), count=50)) == 5  # the first 50: all 5


def test_documents_are_cut_at_a_line_end_to_fit_the_budget(tmp_path):
    docs = read_long_documents(infbench_file(tmp_path))

    # a stand-in tokenizer: one token per word
    def words(text):
        return len(text.split())

    full = words(load_long_summary(infbench_file(tmp_path), count=1)[0].turns[0])
    assert fit_context(docs, 4, words, full) == docs[4].context  # fits whole
    # each line is 4 words: one word less drops the second line, five drop both, nine leave no room for the rest
    assert fit_context(docs, 4, words, full - 1) == "Book 4 line one."
    assert fit_context(docs, 4, words, full - 4) == "Book 4 line one."
    assert fit_context(docs, 4, words, full - 5) == ""
    with pytest.raises(DatasetError, match=r"longbook_sum_eng.jsonl:5: the prompt without its document"):
        fit_context(docs, 4, words, full - 9)
    cut = load_long_summary(infbench_file(tmp_path), count=1, prompt_tokens=words, max_prompt_tokens=full - 1)
    assert words(cut[0].turns[0]) == full - 4 and "line two" not in cut[0].turns[0]


@pytest.mark.parametrize(
    "line, problem",
    [
        ("not json", "not JSON"),
        ('["a"]', "expected a JSON object"),
        ('{"id": "x", "context": "c", "answer": ["a"]}', "id must be an integer"),
        ('{"id": 1, "context": " ", "answer": ["a"]}', "context must be a non-empty string"),
        ('{"id": 1, "context": "c", "answer": []}', "answer must be a non-empty list"),
        ('{"id": 10, "context": "c", "answer": ["a"]}', "id 10 repeats line 1"),
    ],
)
def test_a_malformed_row_names_file_and_line(tmp_path, line, problem):
    path = infbench_file(tmp_path, rows=3)
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:1] + [line] + lines[1:]) + "\n")
    with pytest.raises(DatasetError, match=f"longbook_sum_eng.jsonl:2: {problem}"):
        read_long_documents(path)


def test_too_few_rows_or_no_file(tmp_path):
    with pytest.raises(DatasetError, match="2 document.s.; the 2-shot prompt needs at least 3"):
        read_long_documents(infbench_file(tmp_path, rows=2))
    with pytest.raises(DatasetError, match="dataset file not found"):
        read_long_documents(tmp_path / "none.jsonl")


def test_the_shipped_toy_documents_fill_the_toy_verifiers_context():
    chat = load_chat(ROOT / "recipes" / "toy" / "models" / "verifier", ROOT / "recipes" / "toy" / "models" / "verifier")
    qs = load_bench_dataset("long-summary")
    assert len(qs) == 20 and len({q.question_id for q in qs}) == 20
    lengths = [len(chat.prompt(q.turns[0])) for q in qs]
    # 3.5-3.8K toy tokens: ~15x the drafters' 256-token windows; room left for the 256-token cap and a 33-row tree
    assert 3500 <= min(lengths) and max(lengths) <= 3700 and max(lengths) + 256 + 33 <= 4096
    assert LONG_SUMMARY.name == "long_summary_toy.jsonl"
    notice = (ROOT / "benchmarks" / "data" / "NOTICE.md").read_text()
    assert "long_summary_toy.jsonl" in notice and "PSF License" in notice
    assert hashlib.sha256(LONG_SUMMARY.read_bytes()).hexdigest() in notice


def test_bench_datasets_by_name_or_path(tmp_path):
    assert len(load_bench_dataset("spec-bench")) == 480
    assert [q.question_id for q in load_bench_dataset(infbench_file(tmp_path))] == [14, 12, 13, 11, 10]
    spec = tmp_path / "spec.jsonl"
    spec.write_text('{"question_id": 1, "category": "qa", "turns": ["hi"]}\n')
    assert load_bench_dataset(spec)[0].turns == ("hi",)
    result = CliRunner().invoke(app, ["bench", str(ROOT / "recipes" / "toy.toml"), "--dataset", "long-sumary"])
    assert result.exit_code != 0
    assert "--dataset long-sumary: not a built-in dataset (spec-bench, long-summary) and no such file" in result.output


def test_the_long_document_row_from_records():
    from io import StringIO

    from rich.console import Console

    from hycoc.bench.paper.long_context import long_context_rows, render_long_context

    def rec(config, prompt, prefill, rounds, down, slm, first):
        return {
            "config": config,
            "prompt_tokens": prompt,
            "prefill_ms": prefill,
            "server_ms": rounds,
            "bytes_down": down,
            "slm_prefill_ms": slm,
            "first_token_ms": first,
            "finished": True,
        }

    records = [
        rec("cloud-mtp", 3600, 300.0, [50.0, 50.0], [56, 60], 0.0, 400.0),
        rec("cloud-mtp", 3700, 500.0, [100.0], [56], 0.0, 600.0),
        rec("hyco", 3600, 300.0, [20.0, 20.0, 20.0], [131_810, 900], 180.0, 350.0),
        rec("hyco", 3700, 500.0, [40.0], [131_810], 190.0, 550.0),
    ]
    summary = {
        "cloud-mtp": {"delta_g_pct": 0.0, "delta_g_ci95": [0.0, 0.0], "mat": 2.5},
        "hyco": {"delta_g_pct": -20.0, "delta_g_ci95": [-25.0, -15.0], "mat": 3.5},
    }
    rows = long_context_rows(records, summary, slm_window=256)
    assert rows["cloud-mtp"]["prefill_share_of_g"] == pytest.approx(800 / 1000)
    assert rows["hyco"]["prefill_share_of_g"] == pytest.approx(800 / 900)
    assert (rows["hyco"]["first_reply_bytes_p50"], rows["cloud-mtp"]["first_reply_bytes_p50"]) == (131_810, 56)
    assert (rows["hyco"]["slm_prefill_ms_p50"], rows["hyco"]["slm_prefill_positions"]) == (185.0, 256)
    assert rows["cloud-mtp"]["slm_prefill_ms_p50"] is None and rows["hyco"]["prompt_tokens_p50"] == 3650
    assert rows["hyco"]["first_token_ms_p50"] == 450 and rows["hyco"]["delta_g_ci95"] == [-25.0, -15.0]
    console = Console(file=StringIO(), width=200)
    render_long_context(rows, console)
    text = console.file.getvalue()
    assert "ref" in text and "-20.0 [-25.0, -15.0]" in text and "131,810" in text and "185.0 (256)" in text
    narrow = Console(file=StringIO(), width=80)
    render_long_context(rows, narrow)
    lines = narrow.file.getvalue().splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in narrow.file.getvalue()
    assert sum("│ cloud-mtp " in ln for ln in lines) >= 2  # split, the configuration leading every part
