"""What `hycoc bench`, `hycoc tune-epsilon` and `hycoc loadtest` run on, found before anything starts: the device
bundle (built first when the default one is missing) and the bench's questions (a built-in dataset or a file, long
documents cut to a prompt budget). Each failure is a `BenchInputError` (or the dataset's own
`hycoc.bench.datasets.DatasetError`) whose message names the option or file and the fix; the commands print it on
one line.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any


class BenchInputError(ValueError):
    """A bench input (``--bundle``, ``--dataset``) that cannot be used; the message names it and the fix."""


class OptionError(ValueError):
    """A command-line value outside what the option allows (the commands exit 2, bad usage); the message names the
    option and the allowed values."""


def parse_configs(text: str, allowed: tuple[str, ...]) -> list[str]:
    """``--configs``: comma-separated configuration names, returned in the order of ``allowed`` (paper Table 5).
    Raises `OptionError` naming the unknown ones and every allowed name."""
    chosen = text.split(",")
    unknown = [c for c in chosen if c not in allowed]
    if unknown:
        raise OptionError(f"--configs: unknown {', '.join(unknown)}; allowed: {', '.join(allowed)}")
    return [c for c in allowed if c in chosen]


def check_link_option(link: str) -> str:
    """``--link``: lte, 5g, none or RTT_MS:MBPS, accepted exactly as the recipe's bench.link
    (`hycoc.recipe.check_link`) and parsed as the runtime will (`hycoc.runtime.transport.parse_link`). Returns
    it; raises `OptionError` with the allowed forms."""
    from hycoc.recipe import check_link
    from hycoc.runtime.transport import parse_link

    try:
        check_link(link)
        parse_link(link)
    except ValueError:
        raise OptionError(f"--link {link!r}: allowed: lte, 5g, none or RTT_MS:MBPS such as 45:50") from None
    return link


def parse_epsilons(text: str) -> list[float]:
    """``--epsilons``: comma-separated thresholds, each in (0, 1) (epsilon-threshold acceptance, paper §3; exact
    acceptance, epsilon = 1, always runs beside them). Raises `OptionError` for anything else or an empty list."""
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(0 < e < 1 for e in values):
        raise OptionError(f"--epsilons {text!r}: allowed: comma-separated numbers in (0, 1), such as 0.005,0.02")
    return values


def display_path(path: Path, cwd: Path | None = None) -> str:
    """``path`` relative to ``cwd`` (default: the working directory) when it lies under it, else as given: the
    form a user would type (``bundles/toy-cpu``, not ``/home/u/hycoc/bundles/toy-cpu``)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to((cwd or Path.cwd()).resolve()))
    except ValueError:
        return str(path)


def bench_bundle(
    cfg,
    recipe: Path,
    bundle: Path | None,
    repo_root: Path,
    *,
    command: str = "bench",
    say: Callable[[str], Any] = print,
    build: Callable | None = None,
) -> Path:
    """The bundle a bench-like command runs: ``bundle`` (``--bundle``) if given, which must hold a manifest.json;
    else ``bundles/<recipe name>-cpu`` under ``repo_root`` (`hycoc.bench.paper.runner.default_bundle_dir`), built
    there first with `hycoc.passes.build.build_bundle` (cache ``repo_root/.hycoc-cache``) when it has no manifest,
    ``say`` telling the user in one short line. ``build``: the builder (tests pass a fake). Raises
    `BenchInputError` for a ``--bundle`` without a manifest."""
    from hycoc.bench.paper.runner import default_bundle_dir

    bundle_dir = bundle or default_bundle_dir(cfg, repo_root)
    if (bundle_dir / "manifest.json").is_file():
        return bundle_dir
    if bundle is not None:
        what = "no manifest.json there" if bundle.is_dir() else "no such folder"
        raise BenchInputError(f"--bundle {bundle}: {what}; build one with hycoc build")
    say(f"hycoc {command}: no bundle yet; building {display_path(bundle_dir)} (hycoc build, target cpu)")
    if build is None:
        from hycoc.passes.build import build_bundle

        build = build_bundle
    build(cfg, "cpu", bundle_dir, repo_root / ".hycoc-cache")
    return bundle_dir


def bench_questions(
    cfg,
    recipe: Path,
    bundle: Path | None,
    dataset: str | None,
    max_prompt_tokens: int | None,
    repo_root: Path,
    default_dataset: Path,
    *,
    say: Callable[[str], Any] = print,
    build: Callable | None = None,
):
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
    if (
        dataset is not None
        and dataset not in BUILTIN_DATASETS
        and not Path(dataset).exists()
        and not Path(dataset).suffix
        and "/" not in dataset
    ):  # a mistyped name, not a path
        raise BenchInputError(
            f"--dataset {dataset}: not a built-in dataset ({', '.join(BUILTIN_DATASETS)}) and no such file"
        )
    questions = load_bench_dataset(path)
    bundle_dir = bench_bundle(cfg, recipe, bundle, repo_root, command="bench", say=say, build=build)
    if long_doc and max_prompt_tokens is not None:
        from hycoc.runtime.device_bundle import open_bundle

        chat = open_bundle(bundle_dir, "cpu", verify=False).chat  # the bundle's own chat format
        questions = load_bench_dataset(
            path, prompt_tokens=lambda text: len(chat.prompt(text)), max_prompt_tokens=max_prompt_tokens
        )
    name = str(dataset) if dataset in BUILTIN_DATASETS else ("long-document" if long_doc else "Spec-Bench")
    return questions, name, bundle_dir


__all__ = [
    "BenchInputError",
    "OptionError",
    "bench_bundle",
    "bench_questions",
    "check_link_option",
    "display_path",
    "parse_configs",
    "parse_epsilons",
]
