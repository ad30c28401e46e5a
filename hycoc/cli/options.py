"""Option settings the command modules share: each command declares its long options once at module level, in
typer's Annotated form (typer docs, "Arguments with Annotated"; as huggingface_hub's cli/_cli_utils.py does), so
the command's function reads as the list of its parameters. Imports nothing heavy."""

from __future__ import annotations

from typing import Any

import typer


def unset(help: str, *param_decls: str, **settings: Any) -> Any:
    """An option whose default, None, stands for a value found elsewhere (the recipe's, the bundle's, all of a
    list): ``help`` says which in words, so --help shows no default (``show_default=False``). For typer's
    Annotated form: the parameter's ``= None`` gives the default. ``param_decls``: the option's names when they
    are not the parameter's (``"--json"``); ``settings``: any other `typer.Option` keyword (``min``, ``metavar``)."""
    return typer.Option(*param_decls, help=help, show_default=False, **settings)


def limit_option(knob: str, what: str) -> Any:
    """An `unset` option for the server limit ``knob`` (`hycoc.serving_limits.LIMITS`, the recipe's ``[verifier]``
    key): its range (``min`` / ``max`` from the limit's ge / le) and its default in the help are the limit's own, so
    the command line accepts what the recipe accepts. ``what``: the help's words before the default. Raises KeyError
    for a knob that is not a limit."""
    from hycoc import serving_limits

    limit = serving_limits.BY_KNOB[knob]
    return unset(
        f"{what} (default: the recipe's verifier.{knob}, {limit.shown})",
        min=limit.ge if limit.gt is None else None,
        max=limit.le,
    )


__all__ = ["limit_option", "unset"]
