"""hycoc.quiet: third-party warnings, log records and [torch.onnx] prints go to the log file; hycoc's own stay."""

from __future__ import annotations

import io
import logging
import sys
import warnings

from rich.console import Console

from hycoc.quiet import third_party_output


def test_third_party_output_goes_to_the_log_and_one_line_says_where(tmp_path, capsys):
    log = tmp_path / "run" / "bench.log"
    note = io.StringIO()
    with third_party_output(log, console=Console(file=note, width=200)):
        warnings.warn_explicit("torchvision image extension", UserWarning, "/site-packages/torchvision/io.py", 3)
        warnings.warn_explicit("`x` is deprecated", FutureWarning, "/site-packages/transformers/a.py", 9)
        logging.getLogger("onnxruntime.quantization").warning("Please consider to run pre-processing")
        print("[torch.onnx] Obtain model graph ... ✅")
        print("progress line of hycoc")
        logging.getLogger("hycoc.bench").warning("own warning")
    text = log.read_text(encoding="utf-8").splitlines()
    assert "torchvision image extension" in text[0] and "FutureWarning" in text[1]
    assert text[2] == "WARNING onnxruntime.quantization: Please consider to run pre-processing"
    assert text[3] == "[torch.onnx] Obtain model graph ... ✅" and len(text) == 4
    out = capsys.readouterr()
    assert out.out == "progress line of hycoc\n" and "own warning" not in log.read_text(encoding="utf-8")
    assert note.getvalue() == (
        f"third-party messages (warnings of torch, transformers, onnxruntime, ...): 4 lines in {log}\n"
    )
    assert sys.stdout is sys.__stdout__ or not hasattr(sys.stdout, "log")


def test_a_quiet_run_leaves_no_log(tmp_path):
    note = io.StringIO()
    with third_party_output(tmp_path / "b.log", console=Console(file=note)):
        pass
    assert not (tmp_path / "b.log").exists() and note.getvalue() == ""


CHILD = r"""
import sys
from rich.console import Console
from hycoc import progress
from hycoc.passes.artifacts import KeepSetArtifact
from hycoc.passes.pipeline import Pass, PassReport, Pipeline
from hycoc.quiet import third_party_output
from hycoc.recipe import Recipe

class Exporting(Pass):
    '''A pass whose step prints what torch.onnx.export prints, as passes/export.py's passes do.'''
    name, section, produces = "exporting", "keep_set", {"keep_set": KeepSetArtifact}

    def run(self, inputs, recipe):
        import numpy as np
        with progress.step("export", total=1) as s:
            print("[torch.onnx] Obtain model graph for `Head([...]` with `torch.export.export(..., strict=False)`...")
            s.advance()
        print("[torch.onnx] Run decomposition... done")
        return {"keep_set": KeepSetArtifact("keep_set", np.arange(3))}, PassReport("exported")

console = Console(stderr=True)
assert console.is_terminal, "stderr must be the pseudo-terminal"
with third_party_output(sys.argv[1], console=console):
    Pipeline([Exporting()], sys.argv[2], console=console).run(Recipe())
    with progress.step("outside a pass", total=1, c=console) as s:   # a step's own live display
        print("[torch.onnx] Translate the graph into ONNX... done")
        s.advance()
print("stdout after the build")
"""


def test_torch_onnx_lines_go_to_the_log_on_a_real_terminal_too(tmp_path):
    """On a terminal the pass manager's rich Live display wraps sys.stdout in its FileProxy (which prints above the
    display, past the filter): the lines must still reach the log. A pseudo-terminal (Python's pty module) as the
    child's stdout and stderr makes rich see a terminal."""
    import os
    import pty
    import subprocess

    leader, follower = pty.openpty()
    log = tmp_path / "logs" / "build.log"
    env = dict(os.environ, COLUMNS="80", TERM="xterm")
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(log), str(tmp_path / "cache")],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        env=env,
        close_fds=True,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    assert child.wait(timeout=120) == 0, b"".join(chunks).decode(errors="replace")
    os.close(leader)
    seen = b"".join(chunks).decode("utf-8", errors="replace")
    assert "[torch.onnx]" not in seen, seen
    assert "stdout after the build" in seen and "hycoc build: passes" in seen
    assert "".join(f"3 lines in {log}".split()) in "".join(seen.split())  # the line saying where, maybe wrapped
    assert [line.split("]")[0] + "]" for line in log.read_text(encoding="utf-8").splitlines()] == ["[torch.onnx]"] * 3
