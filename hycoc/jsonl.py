"""JSON Lines reading with file:line errors, shared by every reader of a user-given JSONL file (the bench's
Spec-Bench questions, the keep set's corpus, the ε-tuning validation set).

Format: https://jsonlines.org (one JSON value per line, UTF-8); blank lines are skipped, as the readers always did.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple


class JsonLine(NamedTuple):
    """One parsed line: ``where`` = ``"PATH:LINE"`` for error messages, ``number`` (1-based), the JSON ``value``."""

    where: str
    number: int
    value: Any


def iter_jsonl(path: str | Path, error: type[Exception], *, limit: int | None = None) -> Iterator[JsonLine]:
    """Yield a `JsonLine` for each non-blank line of ``path`` in file order, reading
    lazily (stops after ``limit`` values when given, so a large corpus is read only as far as it is needed).

    Raises ``error(f"{where}: not JSON ({reason})")`` for a line that does not parse. Opening the file is the
    caller's job to check first (each reader names its own recipe field in its missing-file message); an OSError
    or UnicodeDecodeError while reading is raised as ``error(f"{path}: cannot read: ...")``.
    """
    path = Path(path)
    count = 0
    try:
        with path.open(encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if limit is not None and count >= limit:
                    return
                if not line.strip():
                    continue
                where = f"{path}:{number}"
                try:
                    value = json.loads(line)
                except json.JSONDecodeError as e:
                    raise error(f"{where}: not JSON ({e.msg})") from None
                count += 1
                yield JsonLine(where, number, value)
    except (OSError, UnicodeDecodeError) as e:
        raise error(f"{path}: cannot read: {e}") from None
