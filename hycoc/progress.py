"""Progress of long steps on stderr: a rich bar on a terminal, plain lines in a log.

Every step of a build or benchmark that can take more than a few seconds (verifier answers, QAT steps,
calibration drives, compiles) reports through `step`: on a terminal it shows a ``rich`` progress bar with elapsed
time and ETA (transient: the pass's summary line replaces it); when stderr is not a terminal (a CI log, ``2>
build.log``) it prints plain lines ``[hycoc HH:MM:SS] PASS: STEP done/total, elapsed E s, ETA R s``: one when the
step starts, then at most one every `LINE_EVERY` seconds, and one when it ends, so a log of a first run says where
the time went.

The pass manager (`hycoc.passes.pipeline.Pipeline`) names the running pass with `current_pass`; a step outside a
pass is labelled by its own description only. torch-free and numpy-free (the device runtime may use it).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from rich.console import Console

if TYPE_CHECKING:  # imported where a display starts (live_progress)
    from rich.progress import Progress

#: Seconds between two plain progress lines of one step (non-terminal stderr).
LINE_EVERY = 10.0

_pass_name: contextvars.ContextVar[str | None] = contextvars.ContextVar("hycoc_pass", default=None)
_pass_console: contextvars.ContextVar[Console | None] = contextvars.ContextVar("hycoc_console", default=None)
_pass_live: contextvars.ContextVar[Progress | None] = contextvars.ContextVar("hycoc_live", default=None)
_console: Console | None = None


def stderr_console() -> Console:
    """A rich Console on stderr for hycoc's log and error lines: on a terminal it wraps at the terminal's width;
    redirected (``2> build.log``, a pipe) it does not wrap at all (rich ``soft_wrap``; rich would otherwise break
    every line at 80 columns), so a line such as ``third-party messages ...: 42 lines in /path/build.log`` stays one
    line that grep finds. Tables keep their own layout (rich docs, "Console API": soft_wrap)."""
    c = Console(stderr=True)
    c.soft_wrap = not c.is_terminal
    return c


def console() -> Console:
    """The console progress writes to: the running pass's (`current_pass`), else `stderr_console`."""
    global _console
    c = _pass_console.get()
    if c is not None:
        return c
    if _console is None:
        _console = stderr_console()
    return _console


def plain_line(text: str, c: Console | None = None) -> None:
    """One timestamped progress line (``[hycoc HH:MM:SS] text``) on the progress console, no markup; a line wider
    than the console is wrapped at spaces, its continuation indented under the text, unless the console does not
    wrap (``soft_wrap``: `stderr_console` redirected), where it stays one line."""
    import textwrap

    c = c or console()
    prefix = f"[hycoc {time.strftime('%H:%M:%S')}] "
    if c.soft_wrap:
        c.print(prefix + text, markup=False, highlight=False, soft_wrap=True)
        return
    wrapped = textwrap.fill(
        text,
        width=max(40, c.width),
        initial_indent=prefix,
        subsequent_indent=" " * len(prefix),
        break_long_words=False,
        break_on_hyphens=False,
    )
    c.print(wrapped, markup=False, highlight=False, soft_wrap=True)


#: Characters of the bar itself: narrow, so an 80-column terminal keeps room for the step's description.
BAR_WIDTH = 12


def bar_columns() -> tuple:
    """The columns of every progress display: spinner, description, bar, done/total, elapsed, ETA.

    Laid out to fit the console (80 columns and up): the bar is `BAR_WIDTH` characters, the counts and times
    are never wrapped nor cut, and the description wraps at spaces onto a second line instead of ending in "…"
    (rich docs, "Progress Display": columns take a ``table_column``; a wrapping column gives up width first)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        SpinnerColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.table import Column

    def whole():
        return Column(no_wrap=True)

    return (
        SpinnerColumn(table_column=whole()),
        TextColumn("{task.description}", table_column=Column(no_wrap=False, overflow="fold")),
        BarColumn(bar_width=BAR_WIDTH, table_column=whole()),
        MofNCompleteColumn(table_column=whole()),
        TimeElapsedColumn(table_column=whole()),
        TextColumn("ETA", table_column=whole()),
        TimeRemainingColumn(table_column=whole()),
    )


@contextlib.contextmanager
def live_progress(c: Console) -> Iterator[Progress]:
    """A transient ``rich.progress.Progress`` on ``c`` with `bar_columns`, yielded while it runs. Once it has
    started (and replaced ``sys.stdout`` with rich's proxy on a terminal), `hycoc.quiet.refilter_stdout` puts the
    third-party filter back outside the proxy, so ``[torch.onnx]`` lines still go to the log."""
    from rich.progress import Progress

    from hycoc.quiet import refilter_stdout

    with Progress(*bar_columns(), console=c, transient=True) as live:
        refilter_stdout()
        yield live


@contextlib.contextmanager
def current_pass(name: str, c: Console | None = None, live: Progress | None = None) -> Iterator[None]:
    """Label the steps reported inside the block with the pass ``name``, send them to ``c`` if given, and show
    them as tasks of ``live`` (a running ``rich.progress.Progress``: rich allows one live display per console)."""
    tokens = (_pass_name.set(name), _pass_console.set(c), _pass_live.set(live))
    try:
        yield
    finally:
        _pass_name.reset(tokens[0])
        _pass_console.reset(tokens[1])
        _pass_live.reset(tokens[2])


def _fmt(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


class Step:
    """A running step: call ``advance(n=1, note=None)`` as work completes; ``note`` replaces the step's trailing
    text (for example the current QAT loss). ``unit``: what one unit of work is, after its counts ("s" for
    seconds; "" for items). Made by `step`."""

    def __init__(self, label: str, total: int | None, c: Console, live, unit: str = ""):
        self.label, self.total, self.console, self._live, self.unit = label, total, c, live, unit
        self.done = 0
        self.note = ""
        self.start = time.perf_counter()
        self._last_line = self.start
        self._task = live.add_task(f"  {label}", total=total) if live is not None else None

    def advance(self, n: int = 1, note: str | None = None) -> None:
        self.done += n
        if note is not None:
            self.note = note
        if self._live is not None:
            description = f"  {self.label} {self.note}".rstrip()
            self._live.update(self._task, advance=n, description=description)
            return
        now = time.perf_counter()
        if now - self._last_line >= LINE_EVERY:
            self._last_line = now
            plain_line(self._status(now), self.console)

    def _status(self, now: float) -> str:
        elapsed = now - self.start
        count = (f"{self.done}/{self.total}" if self.total else f"{self.done}") + self._unit()
        eta = ""
        if self.total and 0 < self.done < self.total:
            eta = f", ETA {_fmt(elapsed / self.done * (self.total - self.done))}"
        note = f" {self.note}" if self.note else ""
        return f"{self.label} {count}, elapsed {_fmt(elapsed)}{eta}{note}"

    def _unit(self) -> str:
        return f" {self.unit}" if self.unit else ""


@contextlib.contextmanager
def step(description: str, total: int | None = None, c: Console | None = None, unit: str = "") -> Iterator[Step]:
    """Report the progress of one step (module docstring). ``total``: units of work, None when unknown; ``unit``:
    their unit, printed after every count (``"s"``: ``started (20 s to do)``, ``3/20 s``); "" for items.

    Yields a `Step`; its plain-line form prints a start line, periodic lines and an end line with the elapsed time.
    """
    c = c or console()
    name = _pass_name.get()
    label = f"{name}: {description}" if name else description
    live = _pass_live.get()
    if live is not None:  # a task of the pass manager's display, removed when the step ends
        s = Step(label, total, c, live, unit)
        try:
            yield s
        finally:
            if s._task is not None:  # always, with a live display (Step.__init__ added it)
                live.remove_task(s._task)
        return
    if c.is_terminal:
        with live_progress(c) as own:
            yield Step(label, total, c, own, unit)
        return
    s = Step(label, total, c, None, unit)
    plain_line(f"{label}: started" + (f" ({total}{s._unit()} to do)" if total else ""), c)
    yield s
    count = f" {s.done}/{total}" if total else (f" {s.done}" if s.done else "")  # a step that counts nothing: no "0"
    count += s._unit() if count else ""
    plain_line(f"{label}: done{count} in {_fmt(time.perf_counter() - s.start)}" + (f" ({s.note})" if s.note else ""), c)


def ticker(s: Step) -> Callable[[], None]:
    """``s.advance`` as a no-argument callback (for functions that take ``progress=``)."""
    return lambda: s.advance()
