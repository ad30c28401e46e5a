"""Reading a recipe (`hycoc.recipe`): `load_recipe` / `parse_recipe` turn a TOML file into a validated
`hycoc.recipe.document.Recipe`, and every problem into one `hycoc.recipe.errors.RecipeError` whose message names the
dotted key, the file, the line (found by scanning the TOML text for the key inside its table, best effort), the bad
value and what is allowed (`describe_allowed`, from the field's type, bounds and ``allowed`` note).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

import annotated_types
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from hycoc.recipe.document import Recipe
from hycoc.recipe.errors import CrossFieldError, Problem, RecipeError


def load_recipe(path: str | Path) -> Recipe:
    """Read and validate a recipe file. Raises RecipeError on a missing file, a TOML syntax error, an unknown
    key, a wrong type, an out-of-range value or two fields that disagree."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError([Problem(None, None, f"{path}: recipe file not found")]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise RecipeError([Problem(None, None, f"{path}: cannot read the recipe: {e}")]) from None
    return parse_recipe(text, path)


def parse_recipe(text: str, path: str | Path) -> Recipe:
    """Validate recipe ``text``; ``path`` is where it came from (for messages and relative paths)."""
    path = Path(path)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = getattr(e, "lineno", None)
        if line is None:
            m = re.search(r"at line (\d+)", str(e))
            line = int(m[1]) if m else None
        where = f"{path}:{line}" if line else f"{path}"
        raise RecipeError([Problem(None, line, f"{where}: TOML syntax error: {e}")]) from None
    if not data:
        raise RecipeError(
            [
                Problem(
                    None,
                    None,
                    f"{path}: the recipe is empty: a recipe names at least its [models] "
                    "(verifier, head, slm, tokenizer); start from a copy of "
                    "recipes/toy.toml or recipes/gemma4.toml",
                )
            ]
        )
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError([_problem(err, text, path) for err in e.errors()]) from None
    recipe._source_path = path.resolve()
    return recipe


def _problem(err: ErrorDetails, text: str, path: Path) -> Problem:
    """Turn one pydantic error into a Problem naming key, file, line, value and what is allowed."""
    loc = tuple(err["loc"])
    cross = (err.get("ctx") or {}).get("error")
    if isinstance(cross, CrossFieldError):
        loc = loc + tuple(cross.key.split("."))
    key = _dotted(loc)
    line = find_line(text, loc)
    if line is not None and loc and isinstance(loc[-1], int) and isinstance(err.get("input"), str):
        line = _item_line(text, line, err["input"])
    where = f"{path}:{line}" if line else f"{path}"
    kind = err["type"]

    if kind == "extra_forbidden":
        owner = _model_at(loc[:-1])
        allowed = ", ".join(owner.model_fields)
        table = f"[{_dotted(loc[:-1])}]" if len(loc) > 1 else "the recipe"
        what = "key" if len(loc) > 1 else "table"
        return Problem(key, line, f"{where}: unknown {what} {key}; allowed {what}s of {table}: {allowed}")
    if isinstance(cross, CrossFieldError):
        return Problem(key, line, f"{where}: {key} = {_show(cross.value)}: {cross.problem}; allowed: {cross.allowed}")
    if kind == "model_type" and len(loc) == 1:
        return Problem(
            key,
            line,
            f"{where}: {key} = {_show(err['input'])} must be a table [{key}]; "
            f"allowed keys: {', '.join(_model_at(loc).model_fields)}",
        )
    allowed = _allowed_for(loc)
    problem = err["msg"].removeprefix("Value error, ")
    return Problem(key, line, f"{where}: {key} = {_show(err['input'])}: {problem}; allowed: {allowed}")


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _show(value: Any) -> str:
    """A value as it would be written in TOML (strings quoted), for messages."""
    try:
        return json.dumps(value)
    except TypeError:
        return repr(value)


def _model_at(loc: tuple) -> type[BaseModel]:
    """The model class that owns the keys at ``loc`` (``()`` -> Recipe, ``("tree",)`` -> Tree)."""
    model: type[BaseModel] = Recipe
    for part in loc:
        if isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                model = annotation
    return model


def _allowed_for(loc: tuple) -> str:
    names = [p for p in loc if isinstance(p, str)]
    if not names:
        return "see the recipe reference"
    owner = _model_at(tuple(names[:-1]))
    field = owner.model_fields.get(names[-1])
    return describe_allowed(field) if field is not None else "see the recipe reference"


def describe_allowed(field: FieldInfo) -> str:
    """Human text of what a field accepts: its literal values, or its type and bounds."""
    extra = field.json_schema_extra
    if isinstance(extra, dict) and "allowed" in extra:
        return str(extra["allowed"])
    annotation = field.annotation
    args = getattr(annotation, "__args__", ())
    if getattr(annotation, "__origin__", None) is Literal:
        return "one of " + ", ".join(_show(a) for a in args)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), annotation) if optional else annotation
    nouns: dict[object, str] = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    noun = nouns.get(base, str(base))
    bounds = []
    for m in field.metadata:
        if isinstance(m, annotated_types.Gt):
            bounds.append(f"> {m.gt}")
        elif isinstance(m, annotated_types.Ge):
            bounds.append(f">= {m.ge}")
        elif isinstance(m, annotated_types.Lt):
            bounds.append(f"< {m.lt}")
        elif isinstance(m, annotated_types.Le):
            bounds.append(f"<= {m.le}")
        elif isinstance(m, annotated_types.MinLen) and m.min_length > 0:
            noun = f"a non-empty {noun.removeprefix('a ')}"
    text = f"{noun} {' and '.join(bounds)}" if bounds else noun
    return text + " (or leave the key out)" if optional else text


def _item_line(text: str, start: int, item: str) -> int:
    """Line of the array item ``item`` at or after line ``start`` (multi-line arrays), else ``start``."""
    lines = text.splitlines()
    for number in range(start, len(lines) + 1):
        if json.dumps(item) in lines[number - 1] or f"'{item}'" in lines[number - 1]:
            return number
        if "]" in lines[number - 1].split("#")[0]:
            break
    return start


_HEADER = re.compile(r"^\s*\[\[?\s*([^\[\]]+?)\s*\]\]?\s*(#.*)?$")


def _key_name(raw: str) -> str:
    return ".".join(p.strip().strip("\"'") for p in raw.split("."))


def find_line(text: str, loc: tuple) -> int | None:
    """1-based line of the key at ``loc`` (strings: table, key; ints are list indices, ignored) in TOML ``text``.

    Best effort: finds ``[table]`` and then ``key =`` inside it, or a dotted ``table.key =`` at the top level;
    with only a table name, its header line. None when nothing matches (e.g. a key left at its default).
    """
    names = [p for p in loc if isinstance(p, str)]
    if not names:
        return None
    table, key = names[0], (names[1] if len(names) > 1 else None)
    current = ""
    for number, line in enumerate(text.splitlines(), start=1):
        header = _HEADER.match(line)
        if header:
            current = _key_name(header[1])
            if key is None and current == table:
                return number
            continue
        m = re.match(r"^\s*([A-Za-z0-9_\-.\"' ]+?)\s*=", line)
        if m is None:
            continue
        name = _key_name(m[1])
        full = f"{current}.{name}" if current else name
        if key is None and (full == table or full.startswith(table + ".")):
            return number
        if key is not None and full == f"{table}.{key}":
            return number
    return None
