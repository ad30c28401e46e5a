"""``hycoc cache``: the build cache's entries with their sizes and ages, and pruning them by age or total size
(`hycoc.passes.cache`; docs/compiler.md "The build cache"). No torch."""

from __future__ import annotations

import time
from enum import Enum
from pathlib import Path

import typer

from hycoc.cli._common import _fail


class CacheAction(str, Enum):
    list = "list"
    prune = "prune"


def cache(
    action: CacheAction = typer.Argument(
        CacheAction.list,
        help="list: every entry with its size and age; prune: remove a killed build's leftovers, the entries last "
        "used longer ago than --older-than, then the least recently used until the cache holds --max-size",
    ),
    cache_dir: Path = typer.Option(
        Path(".hycoc-cache"), help="the build cache (hycoc build --cache-dir; relative to the cwd)"
    ),
    older_than: str | None = typer.Option(
        None, metavar="AGE", help="prune: entries last used more than AGE ago (30d, 12h, 90m)", show_default=False
    ),
    max_size: str | None = typer.Option(
        None,
        metavar="SIZE",
        help="prune: the total to keep the cache under (20GB, 500MB, 1.5GiB) (default: hycoc build's cap, 20GB, "
        "when --older-than is not given either)",
        show_default=False,
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="prune: print what would be removed, remove nothing"),
) -> None:
    """List the build cache's entries (pass, key, size, age), or prune them by age or total size."""
    from hycoc.passes.cache import DEFAULT_MAX_BYTES, CacheError, entries, parse_age, parse_size

    if action is CacheAction.list:
        if older_than is not None or max_size is not None or dry_run:
            raise _fail("cache", "--older-than, --max-size and --dry-run go with `hycoc cache prune`", code=2)
        _print_entries(entries(cache_dir), cache_dir)
        return
    try:
        age = parse_age(older_than) if older_than is not None else None
        size = parse_size(max_size) if max_size is not None else None
    except CacheError as e:
        raise _fail("cache", str(e), code=2) from None
    if age is None and size is None:
        size = DEFAULT_MAX_BYTES
    _prune(cache_dir, size, age, dry_run)


def _entries(n: int) -> str:
    return f"{n} entry" if n == 1 else f"{n} entries"


def _print_entries(found, cache_dir: Path) -> None:
    from hycoc.passes.cache import DEFAULT_MAX_BYTES, format_age, format_size

    if not found:
        typer.echo(f"{cache_dir}: no cache entries")
        return
    now = time.time()
    typer.echo(f"{'pass':<22} {'key':<12} {'size':>10} {'made':>8} {'used':>8}")
    for e in found:
        state = "" if e.complete else "  (incomplete: a build that did not finish)"
        typer.echo(
            f"{e.pass_name:<22} {e.key[:12]:<12} {format_size(e.bytes):>10} {format_age(now - e.created):>8} "
            f"{format_age(now - e.used):>8}{state}"
        )
    total = sum(e.bytes for e in found)
    typer.echo(
        f"{_entries(len(found))}, {format_size(total)} in {cache_dir} (hycoc build keeps it under "
        f"{format_size(DEFAULT_MAX_BYTES)}: --cache-max-size)"
    )


def _prune(cache_dir: Path, size: int | None, age: float | None, dry_run: bool) -> None:
    from hycoc.build_lock import BuildLocked, build_lock
    from hycoc.passes.cache import entries, format_size, prune

    try:
        with build_lock(cache_dir):
            removed = prune(cache_dir, max_bytes=size, older_than_s=age, dry_run=dry_run)
    except BuildLocked as e:
        raise _fail("cache", str(e)) from None
    verb = "would remove" if dry_run else "removed"
    for entry in removed:  # not `e`: the except clause above unbinds that name
        typer.echo(f"{verb} {entry.pass_name}/{entry.key[:12]} ({format_size(entry.bytes)})")
    left = sum(e.bytes for e in entries(cache_dir)) - (sum(e.bytes for e in removed) if dry_run else 0)
    typer.echo(
        f"{verb} {_entries(len(removed))}, {format_size(sum(e.bytes for e in removed))}; "
        f"{format_size(left)} left in {cache_dir}"
    )
