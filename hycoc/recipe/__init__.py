"""Recipes: one TOML file holds every knob of a HyCo deployment, loaded into strict, typed config objects.

A recipe is read with ``tomllib`` and validated by pydantic models (`hycoc.recipe.sections`). Each section is one
model with ``extra="forbid"`` and strict types: an unknown key, a wrong type (``"4"`` for ``4``, ``1`` for ``true``)
or an out-of-range value is an error, never a warning and never a silent coercion. Every field carries the paper's
default and a one-line description with its unit; the paper is "HyCo: Hybrid Drafting for Cost-Efficient
Mobile-Cloud Speculative Decoding" (App. C Algorithms 1-4 and Table 5 for the round, Table 4 for the head's QAT,
Table 3 and App. A for the integer formats).

`load_recipe` turns every problem into one `RecipeError` whose message names the dotted key, the file, the line
(found by scanning the TOML text for the key inside its table, best effort), the bad value and what is allowed.

Model paths (``[models]``) are either local paths, resolved against the recipe file's folder, or hub ids such as
``google/gemma-4-26B-A4B-it``: a string that does not start with ``.``, ``/`` or ``~``, does not end in ``.json``,
names nothing on disk and has the form ``owner/name`` is taken as a hub id (write ``./owner/name`` to force a
local path).

This module is the recipe's public face; the work is split by job: `hycoc.recipe.sections` (the tables of the model
and the round, one model per ``[section]``, with their value formats), `hycoc.recipe.deployment` (the tables of
where it runs and how it is measured: ``[target]``, ``[verifier]``, ``[bench]``, ``[tune]``),
`hycoc.recipe.document` (`Recipe`: the whole, the check across tables, model paths and hub ids, the content hash),
`hycoc.recipe.loading` (`load_recipe`, `parse_recipe` and the error messages) and `hycoc.recipe.errors`
(`RecipeError`, `Problem`, `CrossFieldError`).
"""

from __future__ import annotations

from hycoc.recipe.deployment import Bench, Target, Tune, Verifier
from hycoc.recipe.document import Recipe
from hycoc.recipe.errors import CrossFieldError, Problem, RecipeError
from hycoc.recipe.loading import describe_allowed, find_line, load_recipe, parse_recipe
from hycoc.recipe.sections import (
    HANGUL_RANGES,
    Acceptance,
    CodePointRange,
    Handoff,
    HeadQat,
    KeepSet,
    Link,
    Models,
    RecipeInfo,
    Sampling,
    Section,
    SlmCalibration,
    Tree,
    Window,
    check_link,
    parse_code_point_range,
)

__all__ = [
    "HANGUL_RANGES",
    "Acceptance",
    "Bench",
    "CodePointRange",
    "CrossFieldError",
    "Handoff",
    "HeadQat",
    "KeepSet",
    "Link",
    "Models",
    "Problem",
    "Recipe",
    "RecipeError",
    "RecipeInfo",
    "Sampling",
    "Section",
    "SlmCalibration",
    "Target",
    "Tree",
    "Tune",
    "Verifier",
    "Window",
    "check_link",
    "describe_allowed",
    "find_line",
    "load_recipe",
    "parse_code_point_range",
    "parse_recipe",
]
