"""Where the tests find the repository's own files: the checkout's root and the recipes the tests run."""

from __future__ import annotations

from pathlib import Path

#: The repository's root (the folder holding pyproject.toml).
ROOT = Path(__file__).resolve().parents[1]
#: The embedded default: the toy family's recipe.
TOY = ROOT / "recipes" / "toy.toml"
#: The real-shape recipe (Gemma 4 26B-A4B with its head and E2B).
GEMMA4 = ROOT / "recipes" / "gemma4.toml"
