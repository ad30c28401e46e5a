"""`hycoc build` while another build runs, and Ctrl-C in a build (hycoc/build_lock.py, passes/build.py:build_bundle):
a second build into the same cache or bundle folder is refused at once naming the folder and the fix; an
interrupted build exits 130 and says what it kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from paths import TOY
from typer.testing import CliRunner

from hycoc.build_lock import BuildLocked, build_lock, complete_entries, interrupted_note, lock_file
from hycoc.cli import app


def hold_lock_in_another_process(lock_file: Path):
    """A child process holding ``lock_file`` (filelock, as a running build does) until its stdin closes."""
    code = textwrap.dedent(f"""
        import sys
        from filelock import FileLock
        with FileLock({str(lock_file)!r}):
            print("held", flush=True)
            sys.stdin.read()
        """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_a_second_build_on_the_same_cache_or_bundle_folder_is_refused(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "bundles" / "toy-cpu"
    with build_lock(cache, out):
        assert not cache.exists() and not out.parent.exists()  # nothing in the user's folders
        assert lock_file(cache) == lock_file(tmp_path / "bundles" / ".." / "cache")  # one lock per folder
        with pytest.raises(
            BuildLocked, match=rf"the build cache {cache} is in use by another hycoc build: .*--cache-dir"
        ):
            with build_lock(cache, tmp_path / "elsewhere"):
                pass
        with pytest.raises(BuildLocked, match=rf"the bundle folder {out} is in use .*another --out"):
            with build_lock(tmp_path / "other-cache", out):
                pass
    with build_lock(cache, out):  # released when the first build ends
        pass


def test_the_cli_refuses_a_build_while_another_process_builds(tmp_path):
    cache = tmp_path / "cache"
    lock_file(cache).parent.mkdir(parents=True, exist_ok=True)
    holder = hold_lock_in_another_process(lock_file(cache))
    try:
        result = CliRunner().invoke(
            app, ["build", str(TOY), "--target", "cpu", "--cache-dir", str(cache), "--out", str(tmp_path / "b")]
        )
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert result.exit_code == 1, result.output
    assert result.stderr.startswith(f"hycoc build: the build cache {cache} is in use by another hycoc build")
    assert not (tmp_path / "b").exists()


def test_ctrl_c_in_a_build_exits_130_and_says_what_it_kept(tmp_path, monkeypatch):
    """Two passes finish (their cache entries complete), the third is interrupted."""
    from hycoc.passes import build as b

    cache, out = tmp_path / "cache", tmp_path / "bundle"
    old = cache / "slm_export" / "k0"
    old.mkdir(parents=True)
    (old / "meta.json").write_text("{}")
    os.utime(old / "meta.json", (0, 0))  # from an earlier build

    def interrupted(recipe, target, cache_dir, settings):
        for name in ("keep_set", "head_qat"):
            entry = Path(cache_dir) / name / "k1"
            entry.mkdir(parents=True)
            (entry / "meta.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(b, "run_pipeline", interrupted)
    result = CliRunner().invoke(
        app, ["build", str(TOY), "--target", "cpu", "--cache-dir", str(cache), "--out", str(out)]
    )
    assert result.exit_code == 130
    said = " ".join(result.stderr.split())
    assert f"interrupted: 2 passes finished in this build and 3 in all are kept in {cache}" in said
    assert f"the bundle folder {out} is left as it was" in said and not out.exists()
    with build_lock(cache, out):  # the interrupted build let its locks go
        pass


def test_complete_entries_count_only_entries_with_their_meta(tmp_path):
    (tmp_path / "p" / "a").mkdir(parents=True)
    (tmp_path / "p" / "a" / "meta.json").write_text("{}")
    (tmp_path / "p" / ".tmp-b-x").mkdir()  # a pass killed mid-write: not an entry
    assert complete_entries(tmp_path) == 1
    assert interrupted_note(tmp_path, None, 0.0).startswith("interrupted: 1 pass finished")
