"""The whole recipe (`hycoc.recipe`): `Recipe`, its tables (`hycoc.recipe.sections`, `hycoc.recipe.deployment`), the
check across them, where its model paths point and its content hash.

Model paths (``[models]``) are either local paths, resolved against the recipe file's folder, or hub ids such as
``google/gemma-4-26B-A4B-it``: a string that does not start with ``.``, ``/`` or ``~``, does not end in ``.json``,
names nothing on disk and has the form ``owner/name`` is taken as a hub id (write ``./owner/name`` to force a
local path).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from pydantic import Field, PrivateAttr, model_validator

from hycoc.recipe import deployment, sections
from hycoc.recipe.errors import CrossFieldError, Problem, RecipeError

_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class Recipe(sections.Section):
    """A whole recipe. Build it with `load_recipe`; ``source_path`` is the file it came from."""

    recipe: sections.RecipeInfo = Field(default_factory=sections.RecipeInfo, description="[recipe]")
    models: sections.Models = Field(default_factory=sections.Models, description="[models]")
    keep_set: sections.KeepSet = Field(default_factory=sections.KeepSet, description="[keep_set]")
    tree: sections.Tree = Field(default_factory=sections.Tree, description="[tree]")
    window: sections.Window = Field(default_factory=sections.Window, description="[window]")
    acceptance: sections.Acceptance = Field(default_factory=sections.Acceptance, description="[acceptance]")
    sampling: sections.Sampling = Field(default_factory=sections.Sampling, description="[sampling]")
    head_qat: sections.HeadQat = Field(default_factory=sections.HeadQat, description="[head_qat]")
    slm_calibration: sections.SlmCalibration = Field(
        default_factory=sections.SlmCalibration, description="[slm_calibration]"
    )
    handoff: sections.Handoff = Field(default_factory=sections.Handoff, description="[handoff]")
    target: deployment.Target = Field(default_factory=deployment.Target, description="[target]")
    verifier: deployment.Verifier = Field(default_factory=deployment.Verifier, description="[verifier]")
    bench: deployment.Bench = Field(default_factory=deployment.Bench, description="[bench]")
    tune: deployment.Tune = Field(default_factory=deployment.Tune, description="[tune]")

    _source_path: Path | None = PrivateAttr(None)

    @model_validator(mode="after")
    def _across_sections(self) -> Recipe:
        if self.tree.slm_candidates > self.keep_set.size:
            raise CrossFieldError(
                "tree.slm_candidates",
                self.tree.slm_candidates,
                f"exceeds keep_set.size = {self.keep_set.size}",
                f"an integer in [1, keep_set.size = {self.keep_set.size}]",
            )
        return self

    @property
    def source_path(self) -> Path | None:
        """Absolute path of the recipe file, None for a recipe built in memory."""
        return self._source_path

    @property
    def base_dir(self) -> Path:
        """Folder that relative paths in the recipe are resolved against (the recipe's folder, else the cwd)."""
        return self._source_path.parent if self._source_path is not None else Path.cwd()

    def resolve_path(self, value: str) -> Path | None:
        """A path written in the recipe, made absolute against `base_dir`; None for the empty string."""
        if not value:
            return None
        path = Path(value).expanduser()
        return path if path.is_absolute() else (self.base_dir / path).resolve()

    def is_hub_id(self, role: str) -> bool:
        """True when ``[models].<role>`` names a hub repository rather than a local path (see module docstring)."""
        spec = getattr(self.models, role)
        if spec.startswith((".", "/", "~")) or spec.endswith(".json") or (self.base_dir / spec).exists():
            return False
        return _HUB_ID.match(spec) is not None

    def model_path(self, role: str) -> Path:
        """The resolved local path of ``[models].<role>`` (role: verifier, head, slm, tokenizer).

        Raises RecipeError when the entry is a hub id or the path does not exist, saying how to provide it.
        """
        spec = getattr(self.models, role)
        where = f"{self._source_path}" if self._source_path else "recipe"
        if self.is_hub_id(role):
            raise RecipeError(
                [
                    Problem(
                        f"models.{role}",
                        None,
                        (
                            f"{where}: models.{role} = {spec!r} is a hub id, not a local path; download it "
                            f"(hf download {spec} --local-dir DIR) and set models.{role} to DIR"
                        ),
                    )
                ]
            )
        path = self.resolve_path(spec)
        assert path is not None  # min_length=1
        if not path.exists():
            raise RecipeError(
                [
                    Problem(
                        f"models.{role}",
                        None,
                        (
                            f"{where}: models.{role} = {spec!r}: {path} does not exist; "
                            "allowed: an existing local path (relative to the recipe's folder) or a hub id 'owner/name'"
                        ),
                    )
                ]
            )
        return path

    def model_source(self, role: str) -> Path | str:
        """What ``from_pretrained`` takes for ``[models].<role>``: the resolved local Path, or the hub id string.
        Raises RecipeError when that key is empty."""
        value = getattr(self.models, role)
        if self.is_hub_id(role):
            return value
        path = self.resolve_path(value)
        if path is None:
            message = f"models.{role} is empty: give a local folder or a hub id 'owner/name'"
            raise RecipeError([Problem(f"models.{role}", None, message)])
        return path

    def content_hash(self) -> str:
        """sha256 (hex) of the canonical JSON of every field, as written (paths unresolved), for caching."""
        text = json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()
