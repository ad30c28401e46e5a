"""What `hycoc bench`, `hycoc tune-epsilon` and `hycoc loadtest` run on, found before anything starts: the device
bundle (built first when the default one is missing) and the bench's questions (a built-in dataset or a file, long
documents cut to a prompt budget). Each failure is a `BenchInputError` (or the dataset's own
`hycoc.bench.datasets.DatasetError`) whose message names the option or file and the fix; the commands print it on
one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable


class BenchInputError(ValueError):
    """A bench input (``--bundle``, ``--dataset``) that cannot be used; the message names it and the fix."""


def display_path(path: Path, cwd: Path | None = None) -> str:
    """``path`` relative to ``cwd`` (default: the working directory) when it lies under it, else as given: the
    form a user would type (``bundles/toy-cpu``, not ``/home/u/hycoc/bundles/toy-cpu``)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to((cwd or Path.cwd()).resolve()))
    except ValueError:
        return str(path)


def bench_bundle(cfg, recipe: Path, bundle: Path | None, repo_root: Path, *, command: str = "bench",
                 say: Callable[[str], Any] = print, build: Callable | None = None) -> Path:
    """The bundle a bench-like command runs: ``bundle`` (``--bundle``) if given, which must hold a manifest.json;
    else ``bundles/<recipe name>-cpu`` under ``repo_root`` (`hycoc.bench.runner.default_bundle_dir`), built
    there first with `hycoc.passes.build.build_bundle` (cache ``repo_root/.hycoc-cache``) when it has no manifest,
    ``say`` telling the user in one short line. ``build``: the builder (tests pass a fake). Raises
    `BenchInputError` for a ``--bundle`` without a manifest."""
    from hycoc.bench.runner import default_bundle_dir

    bundle_dir = bundle or default_bundle_dir(cfg, repo_root)
    if (bundle_dir / "manifest.json").is_file():
        return bundle_dir
    if bundle is not None:
        what = "no manifest.json there" if bundle.is_dir() else "no such folder"
        raise BenchInputError(f"--bundle {bundle}: {what}; build one with hycoc build")
    say(f"hycoc {command}: no bundle yet; building {display_path(bundle_dir)} (hycoc build, target cpu)")
    if build is None:
        from hycoc.passes.build import build_bundle as build
    build(cfg, "cpu", bundle_dir, repo_root / ".hycoc-cache")
    return bundle_dir


def bench_questions(cfg, recipe: Path, bundle: Path | None, dataset: str | None, max_prompt_tokens: int | None,
                    repo_root: Path, default_dataset: Path, *, say: Callable[[str], Any] = print,
                    build: Callable | None = None):
    """``hycoc bench``'s questions: (questions, the dataset's name for the table, the bundle folder). The dataset is
    ``dataset`` (``--dataset``: a built-in name or a path), else the recipe's bench.dataset, else
    ``default_dataset`` (`hycoc.bench.datasets.load_bench_dataset`); with ``max_prompt_tokens`` long documents are
    cut to fit, counted with the bundle's chat format (`hycoc.chat.Chat.prompt`). Every file error comes before
    a bundle is (maybe) built (`bench_bundle`). Raises `BenchInputError` (a mistyped dataset name) and
    `hycoc.bench.datasets.DatasetError` (a bad dataset file)."""
    from hycoc.bench.datasets import BUILTIN_DATASETS, is_long_summary_file, load_bench_dataset

    spec = dataset or cfg.resolve_path(cfg.bench.dataset) or default_dataset
    path = BUILTIN_DATASETS.get(str(spec), Path(spec))
    long_doc = is_long_summary_file(path)
    if (dataset is not None and dataset not in BUILTIN_DATASETS and not Path(dataset).exists()
            and not Path(dataset).suffix and "/" not in dataset):          # a mistyped name, not a path
        raise BenchInputError(f"--dataset {dataset}: not a built-in dataset ({', '.join(BUILTIN_DATASETS)}) and no "
                              "such file")
    questions = load_bench_dataset(path)
    bundle_dir = bench_bundle(cfg, recipe, bundle, repo_root, command="bench", say=say, build=build)
    if long_doc and max_prompt_tokens is not None:
        from hycoc.runtime.device_bundle import open_bundle

        chat = open_bundle(bundle_dir, "cpu", verify=False).chat      # the bundle's own chat format
        questions = load_bench_dataset(path, prompt_tokens=lambda text: len(chat.prompt(text)),
                                       max_prompt_tokens=max_prompt_tokens)
    name = str(dataset) if dataset in BUILTIN_DATASETS else ("long-document" if long_doc else "Spec-Bench")
    return questions, name, bundle_dir


__all__ = ["BenchInputError", "bench_bundle", "bench_questions", "display_path"]
