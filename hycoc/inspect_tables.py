"""The tables `hycoc inspect` prints (`hycoc.inspect_report`, `hycoc.inspect_plan`): rich tables that fit the console
they are printed on.

Width: `inspect_console` lays out at the terminal's width (at least 80 columns), or when stdout is redirected at
``COLUMNS`` if set, else 120, where a line of text is not wrapped (`hycoc.bench.tables.report_console`, the bench
tables' rule). Every table is made by `print_table`: identifier and number columns never wrap nor cut (a graph name,
a shape such as 1x8x1024x256), free-text columns (sources, notes, rules) wrap at spaces and take the room that is
left (rich docs, "Tables": ``no_wrap``, ``overflow``, ``ratio``). rich is imported inside the functions.
"""

from __future__ import annotations

from typing import Any


def inspect_console(console: Any = None):
    """The given rich Console, else `hycoc.bench.tables.report_console`'s: as wide as the terminal (at least 80),
    or when stdout is redirected ``COLUMNS`` if set, else 120, and then with no line of text wrapped."""
    from hycoc.bench.tables import report_console

    return report_console(console)


#: The narrowest a free-text column is laid out at before a table is split into parts.
TEXT_MIN_WIDTH = 24


def print_table(
    console: Any,
    title: str,
    headers: list[str],
    rows: list[list[str]],
    right: tuple[str, ...] = (),
    text: tuple[str, ...] = (),
    keys: int = 1,
) -> None:
    """Print a table of plain-string ``rows`` (no markup) that fits ``console.width``.

    Columns named in ``text`` hold free text: they wrap at spaces (a long word folded) and take the width that is
    left, down to `TEXT_MIN_WIDTH`. Every other column is as wide as its widest cell and never wraps nor cuts (a
    graph name, 1x8x1024x256); its header is wrapped at spaces to that width
    (`hycoc.bench.tables.column_width`). When the columns do not fit even so, the table is split into parts of
    the same rows, the first ``keys`` columns leading each, titled " (i/n)" (`hycoc.bench.tables.fit_columns`'
    rule). ``right``: columns justified right. Width accounting: `hycoc.bench.tables.table_width` (rich's
    default box, padding 1)."""
    import textwrap

    from rich.table import Table
    from rich.text import Text

    from hycoc.bench.tables import balanced_parts, column_width, table_width

    cells = [[r[i] for r in rows] for i in range(len(headers))]
    need = [
        min(column_width(h, c), TEXT_MIN_WIDTH) if h in text else column_width(h, c) for h, c in zip(headers, cells)
    ]
    lead = list(range(keys))
    parts = [list(range(keys, len(headers)))]
    if table_width(need) > console.width and len(headers) > keys + 1:
        current: list[int]
        parts, current = [], []
        for i in range(keys, len(headers)):
            if current and table_width([need[j] for j in lead + current + [i]]) > console.width:
                parts.append(current)
                current = []
            current.append(i)
        parts.append(current)
        if len(parts) > 1:
            parts = (
                balanced_parts(
                    list(range(keys, len(headers))),
                    len(parts),
                    lambda cols: table_width([need[j] for j in lead + cols]),
                )
                or parts
            )
    for n, part in enumerate(parts, start=1):
        table = Table(title=Text(title if len(parts) == 1 else f"{title} ({n}/{len(parts)})"))
        for i in lead + part:
            h = headers[i]
            if h in text:
                table.add_column(Text(h), justify="right" if h in right else "left", overflow="fold")
            else:
                wrapped = "\n".join(textwrap.wrap(h, need[i], break_long_words=False, break_on_hyphens=False))
                table.add_column(Text(wrapped), justify="right" if h in right else "left", no_wrap=True)
        for r in rows:
            table.add_row(*(Text(r[i]) for i in lead + part))
        console.print(table)
