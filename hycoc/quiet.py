"""Third-party chatter into a log file: what torch, torchvision, transformers and onnxruntime print during a build or a
bench is not the user's business, so it goes to a log file under the run or build folder, and one line says where.

`third_party_output(log_path)` is a context manager that, while it is active, sends to ``log_path``:

* Python warnings raised from code outside hycoc (``warnings.showwarning`` replaced inside
  ``warnings.catch_warnings``, Python docs "warnings — Warning control"): torchvision's image-extension
  UserWarning, FutureWarnings and DeprecationWarnings of torch and transformers, ...; a warning raised from hycoc's
  own code is shown as usual;
* records of the standard ``logging`` module at WARNING and above whose logger is not hycoc's (onnxruntime's
  quantizer logs "Please consider to run pre-processing before quantization" through the root logger): a file
  handler on the root logger, which also keeps ``logging.lastResort`` from printing them on stderr;
* lines written to ``sys.stdout`` that start with ``[torch.onnx]`` (the ONNX exporter's ``print`` progress), also
  while a rich progress display runs on a terminal (`refilter_stdout`);
* records of loggers that print through their own handler and do not propagate (torch's), when the library is
  imported before the context is entered (`hycoc.passes.build.build_bundle` imports torch first).

On exit it prints ``third-party messages: N lines in LOG_PATH`` on ``console`` (a rich Console; stderr when None)
when anything was logged; nothing logged, no file (nor folder) is made. Output that C++ libraries write straight to the
file descriptors (below Python) is not caught. torch-free.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

#: Folders whose warnings are hycoc's own (shown as usual).
_OWN = tuple(
    str(Path(__file__).resolve().parents[1] / d) for d in ("hycoc", "passes", "runtime", "verifier", "targets")
)
#: Loggers that print through their own handler instead of propagating to the root (swapped while active).
_OWN_HANDLER_LOGGERS = ("torch",)
#: Prefixes of stdout lines that go to the log.
STDOUT_PREFIXES = ("[torch.onnx]",)


class _Log:
    """The log file, created (with its folder) at the first line written to it, and how many lines went there."""

    file: TextIO | None

    def __init__(self, path: Path):
        self.path, self.file, self.lines = path, None, 0

    def write(self, text: str) -> None:
        if self.file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w", encoding="utf-8")
        self.file.write(text if text.endswith("\n") else text + "\n")
        self.file.flush()
        self.lines += text.rstrip("\n").count("\n") + 1


class _LogHandler(logging.Handler):
    """A logging handler that writes each record's formatted line to a `_Log`."""

    def __init__(self, log: _Log):
        super().__init__(logging.WARNING)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.log.write(self.format(record))
        except Exception:  # noqa: BLE001 -- logging's own contract: a failing handler reports, never raises
            self.handleError(record)


class _StdoutFilter(io.TextIOBase):
    """A stdout that sends whole lines starting with `STDOUT_PREFIXES` to the log and the rest to ``target``."""

    def __init__(self, target, log: _Log):
        self.target, self.log, self._buf = target, log, ""

    def write(self, text: str) -> int:
        self._buf += text
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            if line.lstrip().startswith(STDOUT_PREFIXES):
                self.log.write(line)
            else:
                self.target.write(line + "\n")
        if self._buf and not any(p.startswith(self._buf.lstrip()[: len(p)]) for p in STDOUT_PREFIXES):
            self.target.write(self._buf)  # a partial line that cannot become a logged one (a progress bar)
            self._buf = ""
        return len(text)

    def flush(self) -> None:
        if self._buf:
            self.write("\n")
        self.target.flush()

    def isatty(self) -> bool:
        return self.target.isatty()

    def fileno(self) -> int:
        return self.target.fileno()

    # typeshed declares TextIOBase.encoding a writable attribute; in CPython it is a read-only property, as here
    @property
    def encoding(self):  # type: ignore[override]
        return getattr(self.target, "encoding", "utf-8")


def refilter_stdout() -> None:
    """Keep the filter outermost once a rich Live display has started (`hycoc.progress.live_progress` calls it).

    On a terminal, ``rich.live.Live`` (every ``rich.progress.Progress``) replaces ``sys.stdout`` with a
    ``rich.file_proxy.FileProxy`` around the stdout it found, and that proxy prints each line on the display's
    console above the bars: a filtered stdout inside it is bypassed and the ``[torch.onnx]`` lines land on the
    terminal (rich docs, "Live Display": redirect_stdout). When ``sys.stdout`` is such a proxy around a
    `third_party_output` filter, a filter with the same log is put outside the proxy. Live's exit puts back the
    stdout it found (the inner filter). Anything else is left alone."""
    try:
        from rich.file_proxy import FileProxy
    except ImportError:
        return
    out = sys.stdout
    inner = getattr(out, "rich_proxied_file", None) if isinstance(out, FileProxy) else None
    if isinstance(inner, _StdoutFilter):
        sys.stdout = _StdoutFilter(out, inner.log)


class _ForeignOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.name.startswith("hycoc")


class _OwnOnly(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.name.startswith("hycoc")


@contextlib.contextmanager
def third_party_output(log_path: str | Path, console=None) -> Iterator[Path]:
    """Send third-party warnings, log records and ``[torch.onnx]`` lines to ``log_path`` while active (module
    docstring); yields the path. On exit one line on ``console`` says how many lines went there."""
    log = _Log(Path(log_path))
    root = logging.getLogger()
    handler = _LogHandler(log)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    handler.addFilter(_ForeignOnly())
    shown = warnings.showwarning
    stdout = sys.stdout

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if str(Path(filename).resolve()).startswith(_OWN):
            shown(message, category, filename, lineno, file, line)
        else:
            log.write(warnings.formatwarning(message, category, filename, lineno, line).rstrip("\n"))

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")  # each distinct warning once per place, as Python's default
            warnings.showwarning = showwarning
            handlers: list[logging.Handler] = [handler]
            if not root.handlers:  # hycoc's own records still reach stderr, as logging.lastResort sent them
                own = logging.StreamHandler()
                own.setLevel(logging.WARNING)
                own.addFilter(_OwnOnly())
                handlers.append(own)
            for h in handlers:
                root.addHandler(h)
            # libraries whose logger does not propagate to the root and prints through its own stream handler
            # (torch: "torchvision is not installed. Skipping torchvision::roi_align" from torch.onnx's registry)
            # are swapped to the log while active, when they are imported already (the caller imports them first)
            swapped = {}
            for name, lg in list(logging.Logger.manager.loggerDict.items()):
                top = name.partition(".")[0]
                if (
                    top in _OWN_HANDLER_LOGGERS
                    and top in sys.modules
                    and isinstance(lg, logging.Logger)
                    and not lg.propagate
                    and lg.handlers
                ):
                    swapped[name] = lg.handlers[:]
                    lg.handlers = [handler]
            sys.stdout = _StdoutFilter(stdout, log)
            try:
                yield log.path
            finally:
                sys.stdout.flush()
                sys.stdout = stdout
                for h in handlers:
                    root.removeHandler(h)
                for name, old in swapped.items():
                    logging.getLogger(name).handlers = old
    finally:
        if log.file is not None:
            log.file.close()
        if log.lines:
            from hycoc.progress import stderr_console  # redirected: the line is not wrapped (grep finds the path)

            (console or stderr_console()).print(
                f"third-party messages (warnings of torch, transformers, onnxruntime, ...): {log.lines} lines in "
                f"{log.path}",
                markup=False,
                highlight=False,
            )


__all__ = ["STDOUT_PREFIXES", "refilter_stdout", "third_party_output"]
