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
    assert note.getvalue() == ("third-party messages (warnings of torch, transformers, onnxruntime, ...): 4 lines in "
                               f"{log}\n")
    assert sys.stdout is sys.__stdout__ or not hasattr(sys.stdout, "log")


def test_a_quiet_run_leaves_no_log(tmp_path):
    note = io.StringIO()
    with third_party_output(tmp_path / "b.log", console=Console(file=note)):
        pass
    assert not (tmp_path / "b.log").exists() and note.getvalue() == ""
