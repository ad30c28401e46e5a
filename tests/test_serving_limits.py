"""The server limits' one table (`hycoc.serving_limits.LIMITS`) against every place a user or a caller meets a
limit's default: the recipe's ``[verifier]`` fields, the library server's defaults (`ServerLimits`,
`VerifierServer`, `serve`, `ServerThread`, the wire's frame bound), ``verify-server --help`` / ``serve-ray --help``,
the table in docs/serving.md "Limits" and the comments of recipes/*.toml. Any of them edited by hand to another
value fails here."""

from __future__ import annotations

import dataclasses
import inspect
import re
import tomllib

import annotated_types
import pytest
from paths import ROOT
from typer.testing import CliRunner

from hycoc import serving_limits
from hycoc.serving_limits import LIMITS, SERVER_LIMIT_KNOBS

BOUNDS = ("Ge", "Gt", "Le", "Lt")


def test_recipe_verifier_fields_are_the_tables():
    from hycoc.recipe import Verifier

    for lim in LIMITS:
        field = Verifier.model_fields[lim.knob]
        assert field.default == lim.default and type(field.default) is type(lim.default), lim.knob
        bounds = {name: getattr(m, name.lower()) for m in field.metadata if (name := type(m).__name__) in BOUNDS}
        want = {k: v for k, v in (("Ge", lim.ge), ("Gt", lim.gt), ("Le", lim.le)) if v is not None}
        assert bounds == want, lim.knob
        assert any(isinstance(m, annotated_types.Le) for m in field.metadata)
        assert field.description.endswith(f"(default {lim.shown})"), lim.knob
    v = Verifier()
    assert {lim.knob: getattr(v, lim.knob) for lim in LIMITS} == {lim.knob: lim.default for lim in LIMITS}


def test_the_library_servers_defaults_are_the_tables():
    from hycoc.verifier.server import REFUSAL_KINDS, ServerLimits, ServerSettings, ServerThread, VerifierServer, serve

    from hycoc.protocol import wire

    assert tuple(f.name for f in dataclasses.fields(ServerLimits)) == SERVER_LIMIT_KNOBS
    assert ServerLimits().as_dict() == {k: serving_limits.default(k) for k in SERVER_LIMIT_KNOBS}
    assert wire.DEFAULT_MAX_FRAME_BYTES == wire.Limits().max_frame_bytes == serving_limits.default("max_frame_bytes")
    settings = {f.name: f.default for f in dataclasses.fields(ServerSettings)}
    for knob in ("max_frame_bytes", "max_batch_rows", "max_batch_wait_ms", "max_prefills"):
        assert settings[knob] == serving_limits.default(knob), knob
    for fn in (VerifierServer.__init__, serve, ServerThread.__init__):  # settings reach the server by name only
        assert not {"max_frame_bytes", "max_batch_rows", "max_batch_wait_ms"} & set(inspect.signature(fn).parameters)
    assert REFUSAL_KINDS == tuple(lim.refusal_kind for lim in LIMITS if lim.refusal_kind)
    assert set(REFUSAL_KINDS) == {k.removesuffix("_s") for k in SERVER_LIMIT_KNOBS} - {"retry_after"}


def test_each_refusal_names_an_error_code_the_server_sends():
    from hycoc.verifier.server import errors

    from hycoc.protocol import wire

    def codes(cls):
        return {getattr(cls, "code", None)} | {c for sub in cls.__subclasses__() for c in codes(sub)}

    known = codes(errors.ServerError) | codes(wire.WireError)
    for lim in LIMITS:
        for code in re.findall(r"ERROR `([a-z_]+)`", lim.refusal):
            assert code in known, (lim.knob, code)


@pytest.mark.parametrize("command", ["verify-server", "serve-ray"])
def test_server_help_lists_every_limit_with_the_tables_default(command):
    from hycoc.cli import app

    result = CliRunner().invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for lim in LIMITS:
        assert f"{lim.knob} = {lim.shown} " in text, (command, lim.knob)
    if command == "verify-server":  # the batching options name their defaults and take the recipe's range
        for knob in ("max_batch_rows", "max_batch_wait_ms"):
            lim = serving_limits.BY_KNOB[knob]
            assert f"verifier.{knob}, {lim.shown})" in text, knob
            assert f"{lim.ge}<=x<={lim.le}]" in text, knob


def _docs_limits_table() -> list[str]:
    text = (ROOT / "docs" / "serving.md").read_text()
    section = text.split("\n### Limits\n", 1)[1]
    return [line for line in section.split("\n\n", 2)[1].splitlines() if line.startswith("|")]


def test_docs_serving_limits_table_has_the_tables_rows():
    rows = _docs_limits_table()
    want = serving_limits.docs_rows()
    for row in want:
        assert row in rows, f"docs/serving.md 'Limits' lacks or differs from: {row}"
    knob_cells = [re.findall(r"`([a-z_]+)`", row.split("|")[3]) for row in rows[2:]]
    named = [k for cell in knob_cells for k in cell if k in serving_limits.BY_KNOB]
    assert sorted(named) == sorted(serving_limits.BY_KNOB), "each limit has exactly one row"


def test_recipe_comments_say_the_values_they_sit_beside():
    """A ``knob = value  # 8 MiB ...`` line in recipes/*.toml: the comment's size or time is the value's."""
    checked = 0
    for path in sorted(ROOT.glob("recipes/**/*.toml")):
        verifier = tomllib.loads(path.read_text()).get("verifier", {})
        for line in path.read_text().splitlines():
            m = re.match(r"\s*([a-z_]+)\s*=\s*([^#]+?)\s*#\s*([\d.]+ (?:GiB|MiB|KiB|s|ms))\b", line)
            if m and m.group(1) in serving_limits.BY_KNOB and m.group(1) in verifier:
                lim = dataclasses.replace(serving_limits.BY_KNOB[m.group(1)], default=verifier[m.group(1)])
                assert lim.shown == m.group(3), (path.name, line)
                checked += 1
    assert checked >= 1  # recipes/gemma4.toml's max_frame_bytes
