"""The errors of a recipe (`hycoc.recipe`): `RecipeError`, the one exception `load_recipe` raises, made of one
`Problem` per thing wrong, and `CrossFieldError`, which a section's validator raises when two of its fields disagree
(`hycoc.recipe.loading` turns it into a `Problem` naming the field to blame).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class RecipeError(ValueError):
    """A recipe that cannot be used. ``problems`` lists each one; ``str(err)`` is one line per problem.

    Each problem names the dotted key (``tree.sibling_depth``), the file and line (when found), the bad value
    and the allowed values or range.
    """

    def __init__(self, problems: list[Problem]):
        self.problems = problems
        super().__init__("\n".join(p.message for p in problems))

    @property
    def key(self) -> str | None:
        """Dotted key of the first problem (None for file-level problems such as a missing file)."""
        return self.problems[0].key

    @property
    def line(self) -> int | None:
        """1-based line of the first problem in the recipe file, None when unknown."""
        return self.problems[0].line


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe: dotted ``key``, 1-based ``line`` (None if unknown), full ``message``."""

    key: str | None
    line: int | None
    message: str


class CrossFieldError(ValueError):
    """Raised inside validators when two fields disagree; ``key`` is the field to blame, relative to the model
    that raises it (``"sibling_depth"`` in `Tree`, ``"tree.slm_candidates"`` in `Recipe`)."""

    def __init__(self, key: str, value: Any, problem: str, allowed: str):
        self.key, self.value, self.problem, self.allowed = key, value, problem, allowed
        super().__init__(problem)
