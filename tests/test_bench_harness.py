"""The build checks' measuring harness (`hycoc.bench.real_shape.harness`) and `hycoc.numerics.sqnr_db`: CPU seconds and
memory are checked against work whose size the test fixes (a child that burns a known CPU time, arrays of known
bytes)."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest

from hycoc.bench.real_shape import harness
from hycoc.numerics import sqnr_db

MIB = 2**20

# A child that burns ``sys.argv[1]`` seconds of its own CPU time (not wall time: the machine may be loaded).
BURN = "import sys, time\nend = float(sys.argv[1])\nwhile time.process_time() < end:\n    pass\n"
# A child that holds ``sys.argv[1]`` MiB touched, says so, and waits for its stdin to close.
HOLD = (
    "import sys\nb = bytearray(int(sys.argv[1]) * 2**20)\nb[::4096] = b'x' * len(b[::4096])\n"
    "print('ready', flush=True)\nsys.stdin.read()\n"
)


def test_sqnr_db_by_hand():
    # signal 1 + 1 = 2, noise (1 - 0)^2 = 1: 10 log10 2
    assert sqnr_db(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == pytest.approx(10 * math.log10(2))
    # signal 9 + 16 = 25, noise 0.25: 10 log10 100 = 20 dB
    assert sqnr_db(np.array([3.0, 4.0], np.float32), np.array([3.5, 4.0], np.float16)) == pytest.approx(20.0)
    assert sqnr_db(np.ones(3), np.ones(3)) == math.inf
    assert sqnr_db(np.zeros(3), np.zeros(3)) == math.inf
    assert sqnr_db(np.zeros(3), np.ones(3)) == -math.inf
    with pytest.raises(ValueError, match=r"ref has shape \(3,\), x \(2,\)"):
        sqnr_db(np.ones(3), np.ones(2))


def test_sqnr_rounded_keeps_inf():
    assert harness.sqnr_rounded(np.array([1.0, 1.0]), np.array([1.0, 0.0])) == 3.01
    assert harness.sqnr_rounded(np.ones(2), np.ones(2)) == math.inf


def test_a_step_counts_its_childrens_cpu_seconds():
    steps = harness.Steps()
    burn = 0.4

    def step():
        subprocess.run([sys.executable, "-c", BURN, str(burn)], check=True)
        return "done", 7, {"k": 1}

    assert steps.run("burn", step, what="a child burns CPU") == "done"
    row = steps.rows[0]
    assert (row["step"], row["status"], row["output_bytes"], row["details"]) == ("burn", "ok", 7, {"k": 1})
    assert row["cpu_seconds"] >= 0.9 * burn  # the child's own CPU time, whatever the machine's load
    assert row["seconds"] >= 0 and steps.failed == []


def test_a_step_peak_is_the_memory_it_held():
    steps = harness.Steps()
    held = 256

    def step():
        a = np.ones(held * MIB, np.uint8)  # touched: resident
        return int(a.sum()), a.nbytes, {}

    steps.run("hold", step)
    row = steps.rows[0]
    assert row["peak_rss_gib"] >= row["rss_before_gib"] + 0.95 * held / 1024
    assert row["peak_tree_rss_gib"] >= row["peak_rss_gib"]
    assert steps.peak_rss_gib == row["peak_tree_rss_gib"]


def test_the_sampler_sees_a_childs_memory():
    held = 128
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(held)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        sampler = harness.RssSampler(every=3600)  # polled by hand below, not by its thread
        sampler.sample()
        me, kids = harness.rss_bytes()
        assert kids >= held * MIB and sampler.peak_children >= held * MIB
        assert sampler.peak >= sampler.peak_self + held * MIB
    finally:
        child.stdin.close()
        child.wait(timeout=60)


def test_a_failed_step_is_recorded_and_a_keyboard_interrupt_is_not_swallowed():
    steps = harness.Steps()

    def bad():
        raise ValueError("no such graph")

    assert steps.run("bad", bad) is None
    assert steps.rows[0]["status"] == "failed" and steps.rows[0]["error"] == "ValueError: no such graph"
    assert "Traceback" in steps.rows[0]["details"]["traceback"]
    steps.skip("later", "needs bad")
    assert steps.failed == ["bad"] and steps.rows[1]["status"] == "skipped"

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        steps.run("stop", interrupted)


def test_du_write_report_and_human_bytes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 10)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"y" * 32)
    assert harness.du(tmp_path / "a", tmp_path / "d", tmp_path / "missing") == 42
    out = harness.write_report(tmp_path / "r" / "report.json", {"n": np.int64(3), "x": np.float32(0.5)})
    assert out.read_text() == '{\n "n": 3,\n "x": 0.5\n}' and not (tmp_path / "r" / "report.json.tmp").exists()
    assert [harness.human_bytes(n) for n in (999, 1500, 2_500_000, 2.1e9, 3e12)] == [
        "999 B",
        "1.5 KB",
        "2.5 MB",
        "2.1 GB",
        "3000.0 GB",
    ]


def test_synthetic_keep_set():
    keep = harness.synthetic_keep_set(100, 1000, seed=3)
    assert keep.dtype == np.int64 and len(np.unique(keep)) == 100 and np.all(np.diff(keep) > 0)
    assert 0 <= keep[0] and keep[-1] < 1000
    with pytest.raises(ValueError, match=r"--keep-set 0: must lie in \[1, 1000\]"):
        harness.synthetic_keep_set(0, 1000)


def test_no_benchmark_or_test_edits_sys_path():
    """Benchmarks import installed packages (what they share lives in `hycoc.bench`), and tests load a script by its
    path (tests/bench_scripts.py): no ``sys.path.insert`` / ``append`` / ``extend`` / ``remove`` in either folder."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    found = []
    for folder in ("benchmarks", "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                f = node.func if isinstance(node, ast.Call) else None
                if (
                    isinstance(f, ast.Attribute)
                    and isinstance(f.value, ast.Attribute)
                    and f.value.attr == "path"
                    and isinstance(f.value.value, ast.Name)
                    and f.value.value.id == "sys"
                ):
                    found.append(f"{path.relative_to(root)}:{node.lineno} sys.path.{f.attr}")
    assert found == []
