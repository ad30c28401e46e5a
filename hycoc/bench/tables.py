"""Result tables that fit a terminal: one table of strings, printed as rich tables split to the console's width,
as Markdown, or as CSV (`hycoc bench --format table|markdown|csv`).

A `TextTable` is a title, column headers, rows of already formatted cells and a caption. `fit_columns` splits a
table that is wider than the console into narrower tables of the same rows: the key columns (the configuration
name, or a category) lead every part, and the other columns are packed in order, as many as fit. A cell is never
wrapped nor cut (a configuration name, "-41.8 [-44.5, -39.3]"): a column is as wide as its widest cell, and its
header wraps at spaces. Markdown and CSV print every column in one table: they are for files and pasting, where
width does not matter.

Width accounting follows rich's ``Table`` with its default box and padding (rich docs, "Tables"): a column takes
its width + 2 (one space of padding each side) + 1 for its left rule, and the table 1 more for its right rule.

Core module: rich is imported inside `print_tables` only.
"""

from __future__ import annotations

import csv
import io
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

#: The output formats of `print_tables`.
FORMATS = ("table", "markdown", "csv")
#: The narrowest console the tables are laid out for, and the width used when stdout is not a terminal and
#: ``COLUMNS`` is not set.
MIN_WIDTH, REDIRECTED_WIDTH = 80, 120


@dataclass
class TextTable:
    """A table of formatted cells.

    title: printed above (a part of a split table gets " (i/n)"). headers: one per column. rows: lists of str,
    len(headers) each. justify: "left" | "right" per column (default: key columns left, the rest right).
    keys: how many leading columns identify a row (repeated in every part of a split table). caption: printed
    under the table (the last part of a split one)."""

    title: str
    headers: list[str]
    rows: list[list[str]]
    caption: str | None = None
    keys: int = 1
    justify: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.justify:
            self.justify = ["left"] * self.keys + ["right"] * (len(self.headers) - self.keys)
        bad = [i for i, r in enumerate(self.rows) if len(r) != len(self.headers)]
        if bad or len(self.justify) != len(self.headers) or not 0 < self.keys <= len(self.headers):
            raise ValueError(
                f"table {self.title!r}: {len(self.headers)} headers, {len(self.justify)} justify, "
                f"keys {self.keys}; rows {bad[:3]} have another length"
            )


def column_width(header: str, cells: Sequence[str]) -> int:
    """Characters a column needs: its widest cell, its header's longest word, and up to 10 of the header (so a
    short header is not broken into one word a line)."""
    words = header.split() or [""]
    return max([len(c) for c in cells] + [max(len(w) for w in words), min(len(header), 10)])


def table_width(widths: Sequence[int]) -> int:
    """Characters of a rich table (default box, padding 1) whose columns are ``widths`` wide."""
    return sum(widths) + 3 * len(widths) + 1


def fit_columns(table: TextTable, width: int) -> list[TextTable]:
    """``table`` as one or more tables no wider than ``width`` characters (`table_width`), each with the key
    columns first and the remaining columns in order. A column too wide even beside the keys alone gets a part
    of its own (wider than ``width``: a cell is never cut). Titles get " (i/n)" when split; the caption goes to
    the last part."""
    widths = [column_width(h, [r[i] for r in table.rows]) for i, h in enumerate(table.headers)]
    keys = list(range(table.keys))
    parts: list[list[int]] = []
    current: list[int] = []
    for i in range(table.keys, len(table.headers)):
        if current and table_width([widths[j] for j in keys + current + [i]]) > width:
            parts.append(current)
            current = []
        current.append(i)
    if current or not parts:
        parts.append(current)
    if len(parts) == 1:
        return [table]
    parts = (
        balanced_parts(
            list(range(table.keys, len(table.headers))),
            len(parts),
            lambda cols: table_width([widths[j] for j in keys + cols]),
        )
        or parts
    )
    out = []
    for n, cols in enumerate(parts, start=1):
        idx = keys + cols
        out.append(
            replace(
                table,
                title=f"{table.title} ({n}/{len(parts)})",
                headers=[table.headers[i] for i in idx],
                rows=[[r[i] for i in idx] for r in table.rows],
                justify=[table.justify[i] for i in idx],
                caption=table.caption if n == len(parts) else None,
            )
        )
    return out


def balanced_parts(cols: list[int], k: int, cost) -> list[list[int]] | None:
    """``cols`` cut in order into ``k`` non-empty parts whose widest ``cost`` is smallest (the linear partition
    problem, dynamic programming over cut points; ties keep earlier parts fuller), so a split table does not end
    in one lone column. None when there are fewer columns than parts."""
    n = len(cols)
    if n < k:
        return None
    best: dict[tuple[int, int], tuple[int, list[list[int]]]] = {}

    def solve(start: int, parts: int) -> tuple[int, list[list[int]]]:
        if (start, parts) in best:
            return best[(start, parts)]
        if parts == 1:
            out = (cost(cols[start:]), [cols[start:]])
        else:
            out = None
            for stop in range(n - parts + 1, start, -1):  # the fullest first part first: ties keep it
                rest_cost, rest = solve(stop, parts - 1)
                c = max(cost(cols[start:stop]), rest_cost)
                if out is None or c < out[0]:
                    out = (c, [cols[start:stop]] + rest)
        if out is None:  # never: solve is asked only for parts that each get a column (start + parts <= n)
            raise ValueError(f"{n - start} columns cannot make {parts} non-empty parts")
        best[(start, parts)] = out
        return out

    return solve(0, k)[1]


def console_width(is_terminal: bool, terminal_width: int | None = None, environ=None) -> int:
    """The width to lay tables out at: the terminal's (at least `MIN_WIDTH`); when output is redirected,
    ``COLUMNS`` if it is set to a number, else `REDIRECTED_WIDTH`."""
    environ = os.environ if environ is None else environ
    if is_terminal and terminal_width:
        return max(MIN_WIDTH, int(terminal_width))
    try:
        return max(MIN_WIDTH, int(environ.get("COLUMNS", "")))
    except ValueError:
        return REDIRECTED_WIDTH


def report_console(console: Any = None):
    """The given rich Console, else one on stdout for a report's tables and lines: tables laid out at
    `console_width` (the terminal's width, at least 80; redirected: ``COLUMNS`` if set, else 120), and, when
    stdout is redirected, a line of text never wrapped (rich ``soft_wrap``, as `hycoc.progress.stderr_console`
    does on stderr), so ``hycoc bench ... > run.log`` keeps each note on one line that grep finds. Tables keep
    their own layout (rich docs, "Console API": soft_wrap)."""
    if console is not None:
        return console
    from rich.console import Console

    probe = Console()
    console = Console(width=console_width(probe.is_terminal, probe.width))
    console.soft_wrap = not probe.is_terminal
    return console


def to_markdown(table: TextTable) -> str:
    """GitHub-flavoured Markdown: ``**title**``, the pipe table (``|`` in cells escaped), the caption."""

    def row(cells):
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    rule = "| " + " | ".join("---:" if j == "right" else ":---" for j in table.justify) + " |"
    lines = [f"**{table.title}**", "", row(table.headers), rule, *(row(r) for r in table.rows)]
    if table.caption:
        lines += ["", table.caption]
    return "\n".join(lines) + "\n"


def to_csv(table: TextTable) -> str:
    """RFC 4180 CSV (Python's csv module): a ``# title`` line, the header row, the rows."""
    buf = io.StringIO()
    buf.write(f"# {table.title}\n")
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.headers)
    writer.writerows(table.rows)
    return buf.getvalue()


def print_tables(tables: Sequence[TextTable], console: Any, fmt: str = "table") -> None:
    """Print ``tables`` on a rich Console in ``fmt`` (`FORMATS`): "table" splits each to ``console.width``
    (`fit_columns`) and prints rich tables whose cells never wrap; "markdown" and "csv" print plain text, every
    column in one table (a blank line between tables). Raises ValueError for another format."""
    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    if fmt != "table":
        text = "\n".join(to_markdown(t) if fmt == "markdown" else to_csv(t) for t in tables)
        console.print(text, markup=False, highlight=False, soft_wrap=True, end="")
        return
    from rich.table import Table
    from rich.text import Text

    for whole in tables:
        for t in fit_columns(whole, console.width):
            rt = Table(title=Text(t.title))  # the caption follows at the console's width, not the table's
            for i, (h, j) in enumerate(zip(t.headers, t.justify)):
                w = column_width(h, [r[i] for r in t.rows])
                rt.add_column(
                    Text(h), justify="right" if j == "right" else "left", width=w, style="bold" if i < t.keys else None
                )  # header wraps, cells fit
            for r in t.rows:
                rt.add_row(*(Text(c, no_wrap=True) for c in r))
            console.print(rt)
            if t.caption:
                console.print(Text(t.caption))


__all__ = [
    "FORMATS",
    "MIN_WIDTH",
    "REDIRECTED_WIDTH",
    "TextTable",
    "column_width",
    "console_width",
    "fit_columns",
    "print_tables",
    "table_width",
    "to_csv",
    "to_markdown",
]
