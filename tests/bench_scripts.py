"""The benchmark scripts (benchmarks/*.py) as modules, loaded from their files: they are scripts, not a package, and
they import only installed packages (`hycoc.bench.real_shape.harness` for what they share), so no ``sys.path`` entry is
needed."""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


@cache
def load_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` executed once as the module ``benchmarks_<name>`` (registered in ``sys.modules``
    while and after it runs, as an import would, so its dataclasses resolve their own module)."""
    path = BENCHMARKS / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"benchmarks_{name}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"benchmarks/{name}.py: no such script")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[spec.name]
        raise
    return module
