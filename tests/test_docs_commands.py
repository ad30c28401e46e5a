"""The docs name only commands and options that exist, and document every command.

Every `hycoc COMMAND ... --option` the docs write (an inline code span or a line of a code block that starts with
``hycoc COMMAND``; in docs/commands.md and the README's command table also the first cell of each row) names a
command of the app and an option that the command's ``--help`` lists. Every command `hycoc --help` lists has a row
in docs/commands.md. The reference is the CLI itself (click's parameters and typer's ``--help`` text), never a list
written here. The README table's command names against the app: tests/test_bench_tables.py."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest
import typer.main
from paths import ROOT
from typer.testing import CliRunner

from hycoc.cli import app

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
OPTION = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
SPAN = re.compile(r"`(hycoc [^`]+)`")
ROW_COMMAND = re.compile(r"^\| `hycoc ([a-z][a-z-]*)", re.M)


@cache
def cli() -> dict[str, tuple[set[str], str]]:
    """Per command: every option name click accepts (primary and secondary, --help included) and its --help text."""
    group = typer.main.get_command(app)
    out = {}
    for name, command in group.commands.items():
        names = {"--help"}
        for param in command.params:
            names.update(o for o in (*param.opts, *param.secondary_opts) if o.startswith("--"))
        result = CliRunner().invoke(app, [name, "--help"], terminal_width=200, env={"COLUMNS": "200"})
        assert result.exit_code == 0, (name, result.output)
        out[name] = (names, result.stdout)
    return out


def invocations(text: str) -> list[str]:
    """The `hycoc ...` command lines a Markdown page writes: inline code spans, code-block lines (a trailing
    backslash continues a line; a `#` comment ends it), split at `&&` and `;`."""
    found = []
    fenced = False
    pending = ""
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced, pending = not fenced, ""
            continue
        if fenced:
            code = pending + re.sub(r"\s#\s.*$", "", line).strip()
            if code.endswith("\\"):
                pending = code[:-1] + " "
                continue
            pending = ""
            found.extend(code.split("&&"))
        else:
            found.extend(SPAN.findall(line))
    parts = [p.strip() for chunk in found for p in chunk.split(";")]
    return [p for p in parts if p.startswith("hycoc ")]


def table_rows(text: str) -> list[str]:
    """The first cell of every command-table row (`| `hycoc X ...` | ...`), with its escaped `\\|` kept inside."""
    return [re.split(r"(?<!\\)\|", line)[1].strip(" `") for line in text.splitlines() if ROW_COMMAND.match(line)]


def references(page: Path) -> list[tuple[str, str, str]]:
    """(command, option, where) for every option a page writes after `hycoc COMMAND`; option "" for a bare command."""
    text = page.read_text(encoding="utf-8")
    lines = invocations(text)
    if page.name in ("README.md", "commands.md"):
        lines += table_rows(text)
    refs = []
    for line in lines:
        words = line.split()
        if len(words) < 2 or not re.fullmatch(r"[a-z][a-z-]*", words[1]):
            continue  # `hycoc --help`, `hycoc --version` (the app's own options), `hycoc COMMAND --help`
        command = words[1]
        refs.append((command, "", line))
        refs.extend((command, option, line) for option in OPTION.findall(line))
    return list(dict.fromkeys(refs))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_and_option_the_docs_name_exists_in_its_help(page):
    known = cli()
    wrong = []
    for command, option, where in references(page):
        if command not in known:
            wrong.append(f"no command {command!r}: {where}")
        elif option and (option not in known[command][0] or option not in known[command][1]):
            wrong.append(f"hycoc {command} has no {option} in its --help: {where}")
    assert wrong == [], "\n".join(wrong)


def test_the_reference_pages_are_read():
    """The pages the check above relies on most hold command lines, so a change to their Markdown cannot make the
    check vacuous."""
    commands_md = references(ROOT / "docs" / "commands.md")
    readme = references(ROOT / "README.md")
    assert len({c for c, _, _ in commands_md}) >= 13 and sum(bool(o) for _, o, _ in commands_md) >= 40
    assert ("loadtest", "--batching") in {(c, o) for c, o, _ in commands_md}
    assert {"build", "bench", "run", "verify-server"} <= {c for c, _, _ in readme}


def test_every_command_of_the_app_has_a_row_in_docs_commands():
    listed = CliRunner().invoke(app, ["--help"], terminal_width=200).stdout
    app_commands = re.findall(r"^  ([a-z][a-z-]*)  ", listed, flags=re.M)
    documented = set(ROW_COMMAND.findall((ROOT / "docs" / "commands.md").read_text(encoding="utf-8")))
    assert len(app_commands) >= 13
    assert sorted(set(app_commands) - documented) == []
    assert sorted(documented - set(app_commands)) == []


def test_the_check_finds_a_misspelt_option_and_an_unknown_command(tmp_path):
    """Negative control: a page with a wrong option name and a wrong command fails the check."""
    page = tmp_path / "commands.md"
    page.write_text(
        "| `hycoc loadtest RECIPE [--batching serial] [--sesions 4]` | x | works |\n"
        "```\nhycoc bench recipes/toy.toml \\\n    --limt 2   # a comment --not-an-option\n```\n"
        "Run `hycoc serve-rays RECIPE`.\n",
        encoding="utf-8",
    )
    known = cli()
    refs = references(page)
    bad = {(c, o) for c, o, _ in refs if c not in known or (o and o not in known[c][0])}
    assert bad == {("loadtest", "--sesions"), ("bench", "--limt"), ("serve-rays", "")}
