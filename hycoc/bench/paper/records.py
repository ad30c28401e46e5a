"""What a bench writes (`hycoc.bench.paper.runner`): one record per request (`record_of`; the keys and units are
`hycoc.bench.paper.summary`'s), appended to ``OUT/records.jsonl`` and read back (`read_records`), the output folder made
ready for a run or a ``--resume`` (`open_out`, ``settings.json``), files written whole (`atomic_write`), and
`BenchError`, what the bench raises when it cannot start or go on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hycoc.bench.datasets import Question

RECORDS = "records.jsonl"
SETTINGS = "settings.json"
RESULTS = "results.json"


class BenchError(RuntimeError):
    """The bench cannot start or go on: the server did not start, the bundle does not match the recipe, ...
    The message says what to do."""


def record_of(
    config: str,
    run: int,
    q: Question,
    prompt_tokens: int,
    res,
    virtual_link: bool,
    turn: int = 1,
    chat=None,
    server_busy_ms: float | None = None,
) -> dict:
    """One request as a `hycoc.bench.paper.summary` record (its module docstring lists the keys and units); ``turn``:
    1 for a question's first turn, 2 for its second (same session, `run_requests`). chat: the bundle's
    `hycoc.chat.Chat`: ``text`` is then the final answer, without the reasoning channel (kept as ``thought``), so
    quality scores what the user reads. server_busy_ms: CPU ms the verifier process used while the request ran
    (`process_cpu_ms`), None when unknown."""
    from hycoc.bench.paper.quality import reference_match

    thought, text = None, res.text
    if chat is not None:
        thought, answer = chat.split_thought(list(res.tokens))
        text = chat.tokenizer.decode(answer, skip_special_tokens=True) if thought is not None else res.text
    link = res.link_s if virtual_link else 0.0
    first_link = res.first_token_link_s if virtual_link else 0.0
    return {
        "config": config,
        "run": run,
        "question_id": q.question_id,
        "category": q.category,
        "turn": turn,
        "prompt_tokens": prompt_tokens,
        "tokens": len(res.tokens),
        "rounds": res.rounds,
        "accepted": list(res.accepted),
        "prefill_ms": float(res.prefill_ms),
        "server_ms": [float(x) for x in res.server_ms],
        "rows": list(res.rows),
        "context": list(res.context),
        "seconds": res.seconds + link,
        "first_token_ms": None if res.first_token_s is None else 1000 * (res.first_token_s + first_link),
        "draft_ms": 1000 * res.draft_s,
        "slm_prefill_ms": 1000 * res.slm_prefill_s,
        "bytes_up": [u for u, _ in res.round_bytes],
        "bytes_down": [d for _, d in res.round_bytes],
        "bonus_outside_keep": res.bonus_outside_keep,
        "link_ms": 1000 * res.link_s,
        "text": text,
        "thought": thought,
        "draft_calls": dict(res.draft_calls),
        "draft_graph_ms": 1000 * res.draft_graph_s,
        "prefill_calls": dict(res.prefill_calls),
        "slm_prefill_graph_ms": 1000 * res.prefill_graph_s,
        "output_ids": list(res.tokens),
        "finished": res.finished,
        "finish_reason": res.finish_reason,
        "verifier_logprob": None,
        "reference_match": reference_match(q.category, text, q.reference),
        "server_busy_ms": server_busy_ms,
    }


def read_records(path: Path) -> list[dict]:
    """The records of ``records.jsonl`` (a torn last line from an interrupted write is dropped)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def atomic_write(path: Path, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` through a temporary name in the same folder and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def open_out(out: Path, settings: dict, resume: bool) -> set[tuple[str, int, int]]:
    """Make the output folder ready: refuse an existing ``records.jsonl`` without ``resume``, and with it refuse
    records made with other ``settings`` (`run_settings`); write ``settings.json``. Returns the (config, run,
    question_id) of the requests already recorded. Raises BenchError saying which flag or setting to change."""
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / RECORDS
    if records_path.exists() and not resume:
        raise BenchError(f"{records_path} exists: pass --resume to continue that run, or choose another --out")
    settings_path = out / SETTINGS
    if records_path.exists() and settings_path.is_file():
        saved = json.loads(settings_path.read_text(encoding="utf-8"))
        changed = [k for k in settings if saved.get(k) != settings[k]]
        if changed:
            raise BenchError(
                f"--resume: {out} was run with other settings ("
                + ", ".join(f"{k}: {saved.get(k)!r} there, {settings[k]!r} now" for k in changed)
                + "); use the same ones, or another --out"
            )
    atomic_write(settings_path, json.dumps(settings, indent=1))
    return {(r["config"], r["run"], r["question_id"]) for r in read_records(records_path)}
