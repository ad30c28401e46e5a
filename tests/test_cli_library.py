"""The library functions the CLI commands are thin layers over (doctor rows, the server's keep set and options,
the run and bench option checks), called directly."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
from paths import ROOT, TOY
from rich.console import Console

# ---- hycoc doctor ------------------------------------------------------------------------------------------------


def test_doctor_says_which_compiling_archs_the_builder_refuses():
    """A device whose arch compiles here but whose profile the builder refuses for every recipe's head (A16 graphs):
    its row says so, exactly where `check_recipe_capabilities` refuses the toy recipe (the builder's own check)."""
    from hycoc.targets.profiles import DEVICES, HTP_TARGETS, get_profile

    from hycoc.doctor import device_rows
    from hycoc.recipe import load_recipe
    from passes.build import BuildError, check_recipe_capabilities

    recipe = load_recipe(ROOT / "recipes" / "toy.toml")
    rows = [
        r for r in device_rows({"compilable_archs": sorted({d.htp_arch for d in DEVICES})}) if r[0] != "this device"
    ]
    seen = 0
    for d, (_, text, _) in zip(DEVICES, rows, strict=True):
        name = f"htp-v{d.htp_arch}"
        if name not in HTP_TARGETS:
            continue
        try:
            check_recipe_capabilities(recipe, get_profile(name), d)
            refused = False
        except BuildError:
            refused = True
        assert ("no recipe's head builds" in text) == refused, (d.name, text)
        seen += refused
    assert seen >= 1  # htp-v68 (Snapdragon 888) is one


def test_doctor_lists_the_targets_and_device_names_the_builder_takes():
    """The "HTP targets" row sets apart each target the builder refuses for every recipe (htp-v68 was listed as a
    target like the others), exactly where `check_recipe_capabilities` refuses the toy recipe; each device row
    names every alias `resolve_device` takes (only "X Elite" was shown for the X Elite, while X1E80100 and
    X1E78100 work too)."""
    from hycoc.targets.profiles import DEVICES, HTP_TARGETS, get_profile, resolve_device

    from hycoc.doctor import device_rows, doctor_rows
    from hycoc.recipe import load_recipe
    from passes.build import BuildError, check_recipe_capabilities

    recipe = load_recipe(ROOT / "recipes" / "toy.toml")
    every = {"compilable_archs": [get_profile(t).htp_arch for t in HTP_TARGETS]}
    (item, text, style), *_ = [
        r for r in doctor_rows({"loads": True, "versions": {}, **every}, {}) if r[0] == "HTP targets"
    ]
    builds, _, refusals = text.partition("; ")
    for t in HTP_TARGETS:
        try:
            check_recipe_capabilities(recipe, get_profile(t))
            refused = False
        except BuildError:
            refused = True
        assert (t in builds.split(", ")) != refused and (
            f"{t} compiles, but no recipe's head builds" in refusals
        ) == refused
    assert "htp-v68 compiles, but no recipe's head builds for it: no 16-bit activations" in refusals
    assert (item, style) == ("HTP targets", "")
    rows = {r[0]: r[1] for r in device_rows(every) if r[0] != "this device"}
    for d in DEVICES:
        also = rows[f"--device {d.name}"].rsplit("(also: ", 1)[1].rstrip(")").split(", ")
        assert also == list(d.aliases) and all(resolve_device(a) == d for a in also)
    assert {"X1E80100", "X1E78100", "SC8380XP"} <= set(
        rows["--device Snapdragon X Elite"].split("(also: ")[1][:-1].split(", ")
    )


def test_doctor_rows_from_versions_and_the_qnn_status():
    from hycoc.doctor import doctor_rows, render_doctor

    status = {
        "loads": True,
        "versions": {"qnn_sdk": "2.51.0"},
        "archs": {81: {"ok": True}, 68: {"ok": False}},
        "compilable_archs": [81],
    }
    from hycoc.runtime.device_identity import DeviceIdentity
    from hycoc.targets.profiles import DEVICES

    laptop = DeviceIdentity("windows", "arm64", "x86_64", "SC8380XP", 73, "Snapdragon X Elite", "registry")
    rows = doctor_rows(status, versions={"python": "3.11.7", "torch": "not installed"}, device=laptop)
    assert rows[:4] == [
        ("python", "3.11.7", ""),
        ("torch", "not installed", "yellow"),
        ("QNN EP loads", "yes (QNN SDK 2.51.0)", ""),
        ("HTP targets", "htp-v81 (fail: htp-v68)", "red"),
    ]
    assert rows[4][0] == "this device" and rows[4][2] == "red" and "x64 Python under emulation" in rows[4][1]
    assert [r[0] for r in rows[5:]] == [f"--device {d.name}" for d in DEVICES]
    assert rows[5][1].startswith("htp-v81 SM8850; compiles here; device time fitted")
    assert rows[6][1].startswith("htp-v79 SM8750; not compiled here; device time not fitted") and rows[6][2]
    none = doctor_rows({"loads": False, "error": "libQnnHtp.so not found"}, versions={}, device=laptop)
    assert none[:2] == [
        ("QNN EP loads", "no: libQnnHtp.so not found", "yellow"),
        ("HTP targets", "none (no QNN EP)", "yellow"),
    ]
    console = Console(file=io.StringIO(), width=80)
    render_doctor(rows, console)
    assert "htp-v81 (fail: htp-v68)" in console.file.getvalue() and "hycoc doctor" in console.file.getvalue()


def test_package_versions_names_every_package_without_importing_it():
    from hycoc.doctor import PACKAGES, package_versions

    got = package_versions()
    assert list(got) == ["python", *PACKAGES] and got["numpy"] == np.__version__


# ---- verify-server / serve-ray -----------------------------------------------------------------------------------


def test_serve_ray_without_ray_gives_the_one_command_install(monkeypatch):
    """README "Extras": `.[serve]` installed on its own pushes protobuf past qai-hub's cap, so the hint is the
    one-command install of every extra, the same string the README recommends."""
    import importlib.util

    from typer.testing import CliRunner

    from hycoc.cli import app
    from hycoc.cli._common import REPO_ROOT, SERVE_INSTALL

    assert f"`{SERVE_INSTALL}`" in (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    res = CliRunner().invoke(app, ["serve-ray", str(REPO_ROOT / "recipes" / "toy.toml")])
    assert res.exit_code == 1
    assert SERVE_INSTALL in res.output and "'.[serve]'" not in res.output


def test_no_hint_installs_the_serve_extra_on_its_own():
    """Every `[serve]` install hint in code, tests, benchmarks and docs is the one-command install."""
    from hycoc.cli._common import REPO_ROOT

    alone = ("install -e '.[serve]'", 'install -e ".[serve]"', "install -e '.\\\\[serve]'")
    found = [
        f"{path.relative_to(REPO_ROOT)}: {hint}"
        for folder in ("hycoc", "passes", "runtime", "targets", "verifier", "tests", "benchmarks", "docs")
        for path in (REPO_ROOT / folder).rglob("*")
        if path.suffix in (".py", ".md") and path.is_file() and path != Path(__file__).resolve()
        for hint in alone
        if hint in path.read_text(encoding="utf-8")
    ]
    assert found == []


def test_load_keep_set_reads_int_ids_and_names_a_bad_file(tmp_path):
    from hycoc.keep_set import load_keep_set

    good = tmp_path / "keep_set.npy"
    np.save(good, np.array([3, 1, 7], dtype=np.int32))
    ids = load_keep_set(good)
    assert ids.dtype == np.int64 and ids.tolist() == [3, 1, 7]
    np.save(tmp_path / "floats.npy", np.zeros(3))
    with pytest.raises(ValueError) as e:
        load_keep_set(tmp_path / "floats.npy")
    assert str(e.value) == (
        f"--keep-set {tmp_path / 'floats.npy'}: expected a non-empty 1-D array of int token "
        "ids, got shape (3,) dtype float64"
    )
    (tmp_path / "text.npy").write_text("not numpy")
    with pytest.raises(
        ValueError, match=r"not a \.npy array file; give a bundle's keep_set\.npy: `hycoc build RECIPE`"
    ):
        load_keep_set(tmp_path / "text.npy")


def test_a_missing_keep_set_is_named_as_missing_with_the_command_that_writes_it(tmp_path):
    """A path that does not exist is not "not a .npy array file" (what numpy's FileNotFoundError used to become):
    the one line says the file does not exist, names --keep-set and how to make one; a bundle folder given instead
    of its file points at the file in it. The verifier's loader is this same function (one message everywhere)."""
    from hycoc.keep_set import KEEP_SET_FILE, load_keep_set

    missing = tmp_path / "bundles" / "toy-cpu" / KEEP_SET_FILE
    with pytest.raises(ValueError) as e:
        load_keep_set(missing)
    message = str(e.value)
    assert message.startswith(f"--keep-set {missing}: no such file; ") and "\n" not in message
    assert "`hycoc build RECIPE` writes bundles/<recipe name>-<target>/keep_set.npy" in message
    assert "not a .npy" not in message
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    with pytest.raises(ValueError, match=r"is a folder, not a keep_set\.npy file; give a bundle's keep_set\.npy"):
        load_keep_set(bundle)
    np.save(bundle / KEEP_SET_FILE, np.arange(3))
    with pytest.raises(ValueError, match=rf"is a folder.*give the one in it, --keep-set {bundle / KEEP_SET_FILE}$"):
        load_keep_set(bundle)
    pytest.importorskip("torch")
    from hycoc.verifier import loading

    assert loading.load_keep_set is load_keep_set


def test_keep_set_ids_outside_the_vocabulary_are_named():
    pytest.importorskip("torch")
    from hycoc.verifier.loading import check_keep_set_vocab

    good, ids = "keep_set.npy", np.array([3, 1, 7], np.int64)
    check_keep_set_vocab(ids, 8, good)
    with pytest.raises(ValueError, match="token id 7 is outside the verifier's vocabulary of 7"):
        check_keep_set_vocab(ids, 7, good)


def test_server_options_take_the_command_line_over_the_recipe():
    pytest.importorskip("torch")
    from hycoc.verifier.loading import check_batching, server_options

    from hycoc.recipe import load_recipe

    recipe = load_recipe(TOY)
    base = server_options(recipe)
    assert (base["batching"], base["max_batch_rows"]) == (recipe.verifier.batching, recipe.verifier.max_batch_rows)
    over = server_options(recipe, batching="serial", max_batch_rows=7, max_batch_wait_ms=0.5)
    assert (over["batching"], over["max_batch_rows"], over["max_batch_wait_ms"]) == ("serial", 7, 0.5)
    skip = ("batching", "max_batch_rows", "max_batch_wait_ms", "limits", "tree_budget", "allowance")
    assert {k: v for k, v in over.items() if k not in skip} == {k: v for k, v in base.items() if k not in skip}
    # the recipe's row budget and allowance (auto) have no shared forward under serial: they turn off; asked for,
    # each is an error
    assert (base["tree_budget"], over["tree_budget"]) == ("auto", "fixed")
    assert (base["allowance"], over["allowance"]) == ("auto", "fixed")
    with pytest.raises(ValueError, match="--allowance auto sizes trees by the load of batched forwards"):
        server_options(recipe, batching="serial", allowance="auto")
    assert server_options(recipe, tree_budget="fixed")["tree_budget"] == "fixed"
    with pytest.raises(ValueError, match="--tree-budget auto allocates rows across a batched forward"):
        server_options(recipe, batching="serial", tree_budget="auto")
    with pytest.raises(ValueError, match=r"--tree-budget 'some': allowed: fixed, auto"):
        server_options(recipe, tree_budget="some")
    with pytest.raises(ValueError, match=r"--batching 'fast': allowed: batched, serial"):
        check_batching("fast")


# ---- bench and tune-epsilon options ------------------------------------------------------------------------------


def test_configs_come_back_in_table_5_order_and_unknown_ones_are_named():
    from hycoc.bench.inputs import OptionError, parse_configs
    from hycoc.cli import BENCH_CONFIGS

    assert parse_configs("hyco-exact,cloud-mtp,hyco", BENCH_CONFIGS) == ["cloud-mtp", "hyco", "hyco-exact"]
    with pytest.raises(OptionError) as e:
        parse_configs("hyco,fast,slow", BENCH_CONFIGS)
    assert str(e.value) == f"--configs: unknown fast, slow; allowed: {', '.join(BENCH_CONFIGS)}"


@pytest.mark.parametrize(
    "link, ok",
    [("lte", True), ("5g", True), ("none", True), ("45:50", True), ("50:0", False), ("fast", False), ("45", False)],
)
def test_link_option_accepts_what_the_recipe_accepts(link, ok):
    from hycoc.bench.inputs import OptionError, check_link_option

    if ok:
        assert check_link_option(link) == link
    else:
        with pytest.raises(OptionError, match=r"allowed: lte, 5g, none or RTT_MS:MBPS such as 45:50"):
            check_link_option(link)


def test_epsilons_parse_to_floats_inside_the_open_interval():
    from hycoc.bench.inputs import OptionError, parse_epsilons

    assert parse_epsilons("0.005, 0.02,0.1") == [0.005, 0.02, 0.1]
    for bad in ("", "0.1,1", "0", "a,b", ",,"):
        with pytest.raises(OptionError, match=r"allowed: comma-separated numbers in \(0, 1\)"):
            parse_epsilons(bad)


# ---- hycoc run ---------------------------------------------------------------------------------------------------


def test_run_options_are_checked_in_the_order_a_user_fixes_them(tmp_path):
    from conftest import free_port

    from hycoc.run_options import RunOptionError, check_run_options

    server = f"ws://127.0.0.1:{free_port()}"  # never connected: the options fail first

    def fails(**kw):
        args = (
            dict(bundle=tmp_path, server=server, prompt="hi", prompt_file=None, chat=False, raw=False, slm_alone=False)
            | kw
        )
        with pytest.raises(RunOptionError) as e:
            check_run_options(**args)
        return e.value.code, str(e.value)

    assert fails(prompt=None) == (2, "give exactly one of --prompt and --prompt-file")
    assert fails(prompt_file=tmp_path / "p.txt") == (2, "give exactly one of --prompt and --prompt-file")
    assert fails(chat=True, raw=True)[1].startswith("--chat needs a verifier and the chat template")
    assert fails(prompt=None, prompt_file=tmp_path / "p.txt") == (
        1,
        f"--prompt-file {tmp_path / 'p.txt'}: no such file",
    )
    assert fails(prompt="  ") == (2, "--prompt is empty: give the text to answer (or --prompt-file FILE)")
    assert fails(bundle=tmp_path / "b") == (
        1,
        f"bundle {tmp_path / 'b'}: no such folder (make one with `hycoc build RECIPE --target cpu --out DIR`)",
    )
    assert fails(server=None) == (2, "--server ws://HOST:PORT is required (except with --mode slm-alone)")
    assert fails(server="http://x:1") == (2, "--server 'http://x:1': expected ws://HOST:PORT")
    check_run_options(
        bundle=tmp_path, server=None, prompt="hi", prompt_file=None, chat=False, raw=False, slm_alone=True
    )  # slm-alone needs no server
    check_run_options(
        bundle=tmp_path, server="wss://h:1", prompt=None, prompt_file=None, chat=True, raw=False, slm_alone=False
    )  # --chat reads the first turn


def test_the_run_summary_line():
    from hycoc.run_options import summary_line

    m = {
        "tokens": 12,
        "rounds": 3,
        "mat": 4.0,
        "tok_per_s": 10.04,
        "draft_ms_per_token": 2.25,
        "server_ms_per_token": 5.0,
        "first_token_ms": 123,
    }
    assert summary_line("hyco", m, 45.67, "stop") == (
        "[hyco: 12 tokens, 3 rounds, MAT 4.00, 10.0 tok/s, draft 2.2 "
        "ms/token, server 5.0 ms/token, first token 123 ms, prefill "
        "45.7 ms, stop]"
    )


def test_the_answer_goes_to_stdout_and_the_thought_to_stderr_dimmed_on_a_terminal():
    from hycoc.run_options import AnswerPrinter, run_error

    class Tty(io.StringIO):
        def isatty(self):
            return True

    out, err = io.StringIO(), Tty()
    p = AnswerPrinter(out, err)
    p.show(("let me think", ""))
    assert not p.streamed and out.getvalue() == "" and err.getvalue() == "\x1b[2mlet me think\x1b[0m"
    p.show(("", "The answer"))
    assert p.streamed and out.getvalue() == "The answer"
    plain = io.StringIO()
    AnswerPrinter(io.StringIO(), plain).show(("thought", ""))
    assert plain.getvalue() == "thought"  # not a terminal: no escape codes
    assert run_error("server said auth_required") == (
        "server said auth_required (hycoc run: set HYCOC_AUTH_TOKEN or pass --auth-token-file FILE)"
    )
    assert run_error("connection closed") == "connection closed"
