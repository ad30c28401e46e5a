"""The paper bench's entry points (`hycoc.bench.paper.runner.run_bench`, `hycoc.bench.paper.tune_epsilon.run_tune`)
on the tiny recipe's bundle (tests/conftest.py ``tiny_bundle``), with a hand-built cost model and a quiet console:
what tests/test_bench.py and tests/test_tune_epsilon.py share."""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping
from pathlib import Path

from rich.console import Console

from hycoc.bench.cost_model.model import CostModel, CostPoint


def save_flat_cost_model(path: Path, ms_by_rows: Mapping[int, float], contexts=(0, 1000)) -> Path:
    """Save at ``path`` a hand-built cost model ("fake" device, float32, model "tiny"): a forward of r rows costs
    ``ms_by_rows[r]`` ms at every context of the grid ``contexts``. Returns ``path``."""
    points = [CostPoint(rows=r, context=c, ms=ms) for r, ms in ms_by_rows.items() for c in contexts]
    CostModel(device="fake", dtype="float32", model="tiny", shape={}, points=points).save(path)
    return path


def quiet_console() -> Console:
    """A 200-column console writing into a StringIO (read it back with ``console.file.getvalue()``)."""
    return Console(file=io.StringIO(), width=200)


def run_on_bundle(run: Callable[..., dict], recipe, path: Path, root: Path, plan, *, console=None, **kw) -> dict:
    """``run`` (run_bench or run_tune) of ``plan`` for ``recipe`` (read from ``path``) on its bundle
    ``root``/bundle, printing into ``console`` (None: a new `quiet_console`); kw: `JobSettings` fields
    (cost_model_path, resume, ...) and the entry point's own keywords. Returns what ``run`` returns."""
    from dataclasses import fields

    from hycoc.bench.paper.runner import JobSettings

    console = quiet_console() if console is None else console
    settings = {f.name: kw.pop(f.name) for f in fields(JobSettings) if f.name in kw}
    return run(recipe, path, plan, JobSettings(root / "bundle", console=console, **settings), **kw)
