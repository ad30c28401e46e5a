"""The ``hycoc`` command line: help, argument and recipe checks, the not-yet-available commands, doctor, generate."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import typer
from conftest import cli_in_fresh_interpreter, modules_loaded_by_import
from paths import GEMMA4, ROOT, TOY
from typer.testing import CliRunner

from hycoc.cli import BENCH_CONFIGS, app
from hycoc.table5 import RUN_MODES

runner = CliRunner()

COMMANDS = ["build", "run", "verify-server", "bench", "inspect", "doctor", "generate"]


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args])


def test_help_lists_every_command():
    result = invoke("--help")
    assert result.exit_code == 0
    for command in COMMANDS:
        assert command in result.stdout


def test_help_lists_each_command_on_one_uncut_line_at_80_columns():
    """`hycoc --help` gives each command its short help whole (click cuts a docstring's first sentence with "...")."""
    result = runner.invoke(app, ["--help"], terminal_width=80)
    lines = result.stdout.split("Commands:\n", 1)[1].splitlines()
    assert set(COMMANDS) <= {line.split()[0] for line in lines}
    assert all(len(line) <= 80 and not line.endswith("...") and line.endswith(".") for line in lines), lines


@pytest.mark.parametrize(
    "command, usage",
    [
        ("run", "Usage: hycoc run [OPTIONS] BUNDLE"),
        ("inspect", "Usage: hycoc inspect [OPTIONS] BUNDLE|RECIPE"),
        ("build", "Usage: hycoc build [OPTIONS] RECIPE"),
    ],
)
def test_usage_lines_write_required_arguments_plain(command, usage):
    result = invoke(command, "--help")
    assert result.stdout.splitlines()[0] == usage  # typer 0.29 alone writes {BUNDLE}


def test_version_prints_the_installed_package_version():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"hycoc {version('hycoc')}"


@pytest.mark.parametrize(
    "module,banned",
    [
        ("hycoc.cli", ("torch", "transformers")),
        ("hycoc.cli.__main__", ("torch", "transformers")),
        ("hycoc.cli._common", ("torch", "transformers", "aiohttp")),
        ("hycoc.cli.run", ("torch", "transformers", "aiohttp")),  # the device-runtime install has neither
        ("hycoc.cli.build", ("torch", "transformers")),
        ("hycoc.cli.serve", ("torch", "transformers", "aiohttp", "ray")),
        ("hycoc.cli.bench", ("torch", "transformers")),
        ("hycoc.cli.tools", ("torch", "transformers")),
    ],
)
def test_importing_a_cli_module_loads_neither_torch_nor_transformers(module, banned):
    assert modules_loaded_by_import(module, banned) == []


def test_help_lists_the_commands_in_the_readme_order():
    import re

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    documented = list(dict.fromkeys(re.findall(r"^\| `hycoc ([a-z][a-z-]*)", readme, flags=re.M)))
    listed = re.findall(r"^  ([a-z][a-z-]*)  ", runner.invoke(app, ["--help"], terminal_width=200).stdout, flags=re.M)
    assert listed == documented
    assert len(listed) == 14  # hycoc cache (issue 38) the fourteenth


@pytest.mark.parametrize(
    "command,options",
    [
        ("build", ["--target", "--out", "--list-passes", "--until", "--cache-dir"]),
        (
            "run",
            [
                "--server",
                "--prompt",
                "--prompt-file",
                "--max-new-tokens",
                "--mode",
                "--backend",
                "--seed",
                "--json",
                "--raw",
                "--auth-token",
            ],
        ),
        ("verify-server", ["--host", "--port", "--device", "--auth-token"]),
        ("bench", ["--dataset", "--limit", "--configs", "--link", "--runs", "--out", "--resume"]),
        ("inspect", ["--json"]),
        ("generate", ["--dataset", "--question-id", "--prompt", "--max-new-tokens", "--seed", "--temperature"]),
    ],
)
def test_each_command_documents_its_options(command, options):
    result = runner.invoke(app, [command, "--help"], terminal_width=200)
    assert result.exit_code == 0
    for option in options:
        assert option in result.stdout, option


def test_run_on_a_folder_that_is_not_a_bundle_exits_1_naming_the_manifest():
    from conftest import free_port

    result = invoke("run", ROOT, "--server", f"ws://127.0.0.1:{free_port()}", "--prompt", "hi", "--backend", "cpu")
    assert result.exit_code == 1
    assert result.stderr.startswith("hycoc run: ") and "manifest.json" in result.stderr
    assert result.stdout == ""


def test_inspect_recipe_emits_the_real_shape_plan_without_checkpoints():
    # the real-shape plan (docs/real-shapes.md) needs no weights; the hand-off and tree sizes of the paper's deployment
    # (tests/test_plan.py)
    result = invoke("inspect", GEMMA4, "--json")
    assert result.exit_code == 0, result.stderr
    import json

    plan = json.loads(result.stdout)
    assert plan["handoff"]["handoff_bytes_per_round"] == 44 + 5632
    assert plan["handoff"]["handoff_bytes_per_position"] == 6144
    assert plan["handoff"]["tree_bytes_per_round"] == 287  # 16 + 7 + 33 * (4 + 2 + 2)


def test_build_without_the_models_exits_1_in_one_line(tmp_path):
    # gemma4.toml names hub ids; with no checkpoint on disk the build stops before any pass runs
    result = invoke("build", GEMMA4, "--target", "cpu", "--cache-dir", tmp_path / "c", "--out", tmp_path / "b")
    assert result.exit_code == 1 and result.stdout == ""
    assert (
        result.stderr.startswith("hycoc build: the tokenizer model is not on this machine: ")
        and result.stderr.count("\n") == 1
    )  # the chat files are read first, before any model
    assert "hf download google/gemma-4-26B-A4B-it --local-dir DIR" in result.stderr
    assert not (tmp_path / "c").exists() and not (tmp_path / "b").exists()


def test_inspect_refuses_a_folder_that_is_no_bundle():
    result = invoke("inspect", ROOT)
    assert result.exit_code == 1
    assert result.stderr.strip() == (
        f"hycoc inspect: bundle {ROOT}: not a bundle (no manifest.json); build one with `hycoc build RECIPE --out DIR`"
    )
    assert result.stdout == ""


def test_bench_with_a_bundle_folder_that_is_not_a_bundle_exits_1(tmp_path):
    result = invoke(
        "bench",
        TOY,
        "--limit",
        "3",
        "--link",
        "45:50",
        "--configs",
        "hyco,cloud-mtp",
        "--bundle",
        tmp_path,
        "--out",
        tmp_path / "out",
    )
    assert (result.exit_code, result.stderr.strip()) == (
        1,
        f"hycoc bench: --bundle {tmp_path}: no manifest.json there; build one with hycoc build",
    )


def test_bench_refuses_unknown_configs_and_links():
    result = invoke("bench", TOY, "--configs", "hyco,hyco-3p")
    assert result.exit_code == 2
    assert result.stderr.strip() == f"hycoc bench: --configs: unknown hyco-3p; allowed: {', '.join(BENCH_CONFIGS)}"
    result = invoke("bench", TOY, "--link", "wifi")
    assert result.exit_code == 2
    assert result.stderr.strip() == "hycoc bench: --link 'wifi': allowed: lte, 5g, none or RTT_MS:MBPS such as 45:50"


def test_bench_names_a_missing_dataset(tmp_path):
    result = invoke("bench", TOY, "--dataset", tmp_path / "none.jsonl")
    assert result.exit_code == 1
    assert result.stderr.strip() == f"hycoc bench: {tmp_path / 'none.jsonl'}: dataset file not found"


def test_a_bad_recipe_exits_1_naming_key_file_and_line(tmp_path):
    recipe = tmp_path / "bad.toml"
    recipe.write_text("[tree]\nchain_length = 4\nsibling_depth = 9\n")
    for command in (["build"], ["verify-server"], ["bench"], ["inspect"], ["generate"]):
        result = invoke(*command, recipe)
        assert result.exit_code == 1, command
        assert result.stderr.splitlines()[0] == f"hycoc {command[0]}: bad recipe"
        assert result.stderr.splitlines()[1].startswith(f"{recipe}:3: tree.sibling_depth = 9: ")


def test_a_missing_recipe_exits_1():
    result = invoke("build", "nope.toml")
    assert result.exit_code == 1
    assert "nope.toml: recipe file not found" in result.stderr


def test_run_checks_its_arguments(tmp_path):
    def err(*args):
        result = invoke("run", *args)
        assert result.exit_code == 2
        return result.stderr.strip()

    assert err(tmp_path, "--server", "ws://h:1") == "hycoc run: give exactly one of --prompt and --prompt-file"
    assert err(tmp_path, "--server", "ws://h:1", "--prompt", "a", "--prompt-file", "f") == (
        "hycoc run: give exactly one of --prompt and --prompt-file"
    )
    no_file = invoke("run", tmp_path, "--server", "ws://h:1", "--prompt-file", tmp_path / "f")
    assert (no_file.exit_code, no_file.stderr.strip()) == (
        1,
        f"hycoc run: --prompt-file {tmp_path / 'f'}: no such file",
    )
    assert err(tmp_path, "--server", "ws://h:1", "--prompt", "") == (
        "hycoc run: --prompt is empty: give the text to answer (or --prompt-file FILE)"
    )
    assert err(tmp_path, "--server", "ws://h:1", "--prompt", " \n") == (
        "hycoc run: --prompt is empty: give the text to answer (or --prompt-file FILE)"
    )
    missing = invoke("run", tmp_path / "b", "--server", "ws://h:1", "--prompt", "a")
    assert missing.exit_code == 1 and missing.stderr.startswith(f"hycoc run: bundle {tmp_path / 'b'}: no such folder")
    assert err(tmp_path, "--server", "http://h:1", "--prompt", "a") == (
        "hycoc run: --server 'http://h:1': expected ws://HOST:PORT"
    )
    assert err(tmp_path, "--server", "ws://h:1", "--prompt", "a", "--mode", "fast").endswith(
        "Error: Invalid value for '--mode': 'fast' is not one of " + ", ".join(repr(m) for m in RUN_MODES) + "."
    )  # the option, the bad value and the allowed values; no pydantic "Value error," in between


def test_run_reports_a_bad_command_line_before_a_missing_bundle_or_file(tmp_path):
    """A usage error (exit 2, docs/commands.md) comes before what the filesystem says (exit 1)."""
    wrong_url = "hycoc run: --server 'http://127.0.0.1:8765': expected ws://HOST:PORT"
    for args in (
        ("--prompt", "hi"),
        ("--prompt-file", tmp_path / "no-such-file"),
    ):
        result = invoke("run", tmp_path / "no-bundle", "--server", "http://127.0.0.1:8765", *args)
        assert (result.exit_code, result.stderr.strip()) == (2, wrong_url)
    result = invoke("run", tmp_path / "no-bundle", "--prompt", "hi")
    assert (result.exit_code, result.stderr.strip()) == (
        2,
        "hycoc run: --server ws://HOST:PORT is required (except with --mode slm-alone)",
    )


@pytest.mark.parametrize(
    "url, problem",
    [
        ("ws://127.0.0.1:99999", "port 99999 is out of range 1-65535"),
        ("ws://127.0.0.1:abc", "port 'abc' is not a number"),
        ("ws://127.0.0.1:0", "port 0 is out of range 1-65535"),
        ("ws://:8765", "no host"),
        ("ws://[::1:8765", "the host is not a valid address"),
    ],
)
def test_run_refuses_a_server_url_it_cannot_connect_to_in_one_line(tmp_path, url, problem):
    """A port out of range or not a number used to surface as a 71-line traceback from urllib inside the WebSocket
    client's connect (``ValueError: Port out of range 0-65535``): now one line naming the URL, what is wrong and
    the form to give, exit 2 (a value of the wrong form, docs/commands.md "Exit codes"), before the bundle is
    looked at (``hycoc loadtest --server`` says the same)."""
    for command in (("run", tmp_path / "no-bundle", "--prompt", "hi"), ("loadtest", TOY)):
        result = invoke(*command, "--server", url)
        assert result.exit_code == 2, result.stderr
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
        fix = "expected ws://HOST:PORT with a port in 1-65535"
        assert result.stderr.startswith(f"hycoc {command[0]}: --server {url!r}: {problem}: {fix}")


def test_ws_url_problem_accepts_what_a_client_can_connect_to():
    from hycoc.ports import ws_url_problem

    for url in ("ws://127.0.0.1:8765", "wss://verifier.example:443/", "ws://[::1]:8765", "ws://localhost"):
        assert ws_url_problem(url) is None, url
    assert ws_url_problem("http://h:1") == "expected ws://HOST:PORT"


def test_run_on_the_htp_simulator_says_it_is_an_emulator_on_the_cpu(tmp_path):
    """--backend htp on an x86 host runs the QNN HTP simulator: one line says it is slow and not device time; a
    device (a Snapdragon SoC, ARM64 Python) or the cpu backend gets no such line. It comes after the bundle
    loader's checks, so a refused bundle gets its one-line error alone (tests/test_devices.py too)."""
    from hycoc.runtime.device_identity import DeviceIdentity

    from hycoc.run_options import simulator_note

    x86 = DeviceIdentity(os="linux", machine="x86_64", python_machine="x86_64")
    phone = DeviceIdentity(os="android", machine="arm64", python_machine="arm64", soc_model="SM8750", htp_arch=79)
    note = simulator_note("htp", x86)
    assert "QNN HTP simulator" in note and "functional emulator on the CPU" in note and "not device time" in note
    assert simulator_note("cpu", x86) is None and simulator_note("htp", phone) is None
    result = invoke("run", tmp_path, "--server", "ws://h:1", "--prompt", "a", "--backend", "htp")
    assert result.exit_code == 1  # no manifest: the loader's one-line error alone (the note comes after its checks)
    assert len(result.stderr.strip().splitlines()) == 1 and "HTP simulator" not in result.stderr
    result = invoke("run", tmp_path, "--server", "ws://h:1", "--prompt", "a", "--backend", "cpu")
    assert "HTP simulator" not in result.stderr


@pytest.mark.parametrize(
    "args, option, value",
    [
        (["build", str(TOY), "--target", "foo"], "--target", "foo"),
        (["bench", str(TOY), "--format", "xml"], "--format", "xml"),
    ],
)
def test_a_bad_choice_names_the_option_the_value_and_the_choices(args, option, value):
    result = invoke(*args)
    assert result.exit_code == 2
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"Error: Invalid value for '{option}': '{value}' is not one of '"), last
    assert "Value error" not in result.stderr


def test_doctor_reports_versions():
    import torch
    import transformers

    result = runner.invoke(app, ["doctor"], terminal_width=200)
    assert result.exit_code == 0
    lines = {
        line.split("│")[1].strip(): line.split("│")[2].strip()
        for line in result.stdout.splitlines()
        if line.count("│") == 3
    }
    assert lines["torch"] == torch.__version__
    assert lines["transformers"] == transformers.__version__
    assert lines["python"] == sys.version.split()[0]
    for name in ("onnx", "onnxruntime", "onnxruntime-qnn"):
        assert lines[name]  # a version or "not installed"


def test_generate_refuses_prompt_with_question_id():
    result = invoke("generate", TOY, "--prompt", "hi", "--question-id", "81")
    assert result.exit_code == 2
    assert result.stderr.strip() == "hycoc generate: give at most one of --prompt and --question-id"
    result = invoke("generate", TOY, "--prompt", "")
    assert (result.exit_code, result.stderr.strip()) == (
        2,
        "hycoc generate: --prompt is empty: give the text to answer (or --question-id N)",
    )


# ---- exit codes (docs/commands.md "Exit codes": 2 the command line is wrong, 1 what it names is missing or bad) ---


@pytest.mark.parametrize(
    "args",
    [
        ["build", "{missing}.toml"],
        ["inspect", "{missing}"],
        ["inspect", "{missing}.toml"],
        ["run", "{missing}", "--server", "ws://127.0.0.1:1", "--prompt", "hi"],
        ["profile", "{missing}"],
        ["bench", "{missing}.toml"],
        ["verify-server", "{missing}.toml"],
        ["generate", "{missing}.toml"],
    ],
)
def test_a_path_that_does_not_exist_exits_1_in_every_command(tmp_path, args):
    missing = str(tmp_path / "nothing-here")
    result = invoke(*[a.format(missing=missing) for a in args])
    assert result.exit_code == 1, (args, result.stderr)
    assert result.stderr.startswith(f"hycoc {args[0]}: ") and missing in result.stderr


@pytest.mark.parametrize("command", ["build", "inspect", "run", "bench", "verify-server", "loadtest", "generate"])
def test_typers_own_usage_errors_exit_2(command):
    result = invoke(command, "--no-such-option")
    assert result.exit_code == 2 and "No such option" in result.output


def test_generate_names_an_unknown_question(tmp_path):
    data = tmp_path / "q.jsonl"
    data.write_text('{"question_id": 1, "category": "qa", "turns": ["Why?"]}\n')
    result = invoke("generate", TOY, "--dataset", data, "--question-id", "7")
    assert result.exit_code == 1
    assert result.stderr.strip() == "hycoc generate: no question with id 7; ids run from 1 to 1"


def test_generate_names_a_missing_model(tmp_path):
    recipe = tmp_path / "r.toml"
    recipe.write_text('[models]\ntokenizer = "missing/tokenizer.json"\n[verifier]\ndevice = "cpu"\n')
    result = invoke("generate", recipe, "--prompt", "hi")
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"hycoc generate: the tokenizer model is not on this machine: {recipe}: "
        "models.tokenizer = 'missing/tokenizer.json': "
        f"{tmp_path / 'missing/tokenizer.json'} does not exist"
    )
    (tmp_path / "missing").mkdir()
    (tmp_path / "missing/tokenizer.json").write_text("{}")
    result = invoke("generate", recipe, "--prompt", "hi")  # a tokenizer folder without a chat template
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"hycoc generate: {tmp_path / 'missing'}: no chat template (neither "
        'chat_template.jinja nor a "chat_template" in tokenizer_config.json)'
    )
    from gemma4_fixture import write_tokenizer_folder

    write_tokenizer_folder(tmp_path / "missing")
    result = invoke("generate", recipe, "--prompt", "hi")  # the verifier is a hub id in the defaults
    assert result.exit_code == 1
    assert result.stderr.startswith(
        f"hycoc generate: {recipe}: models.verifier = 'google/gemma-4-26B-A4B-it' is a hub id, not a local path"
    )


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory):
    """A random tiny verifier (tests/tiny_models.py) and the 300-id Gemma 4 fixture tokenizer (its chat template,
    Gemma 4's stop ids in the verifier's generation_config.json), saved as a recipe would name them."""
    from gemma4_fixture import STOP_IDS, write_generation_config, write_tokenizer_folder
    from tiny_models import tiny_verifier

    folder = tmp_path_factory.mktemp("family")
    write_tokenizer_folder(folder / "tokenizer", 300)
    tiny_verifier(vocab_size=300).save_pretrained(folder / "verifier")
    write_generation_config(folder / "verifier", STOP_IDS)
    recipe = folder / "tiny.toml"
    recipe.write_text(
        '[models]\nverifier = "verifier"\ntokenizer = "tokenizer"\n'
        '[verifier]\ndevice = "cpu"\ndtype = "float32"\n[sampling]\nmax_new_tokens = 6\n'
    )
    return recipe


def test_generate_streams_an_answer_from_the_verifier(tiny_family):
    first = invoke("generate", tiny_family, "--prompt", "w1 w2", "--seed", "3")
    assert first.exit_code == 0, first.output
    stats = first.stderr.splitlines()[-1]  # after transformers' weight-loading progress bar
    assert stats.startswith("[6 tokens in ") and stats.endswith("prompt 8 tokens]")  # <bos><|turn>user w1 w2 ...
    assert first.stdout.endswith("\n") and first.stdout.strip()
    again = invoke("generate", tiny_family, "--prompt", "w1 w2", "--seed", "3")
    assert again.stdout == first.stdout  # seeded sampling
    greedy = invoke("generate", tiny_family, "--prompt", "w1 w2", "--temperature", "0", "--max-new-tokens", "3")
    # the random verifier's greedy first token is one of Gemma 4's stop ids: generate stops on the checkpoint's list
    assert greedy.exit_code == 0 and greedy.stderr.splitlines()[-1].startswith("[1 tokens in ")


def test_generate_answer_is_the_library_call_behind_the_command(tiny_family):
    import io

    from hycoc.generate import Generated, generate_answer, sampling_kwargs, summary_line
    from hycoc.recipe import load_recipe

    out, err, said = io.StringIO(), io.StringIO(), []
    done = generate_answer(load_recipe(tiny_family), "w1 w2", seed=3, out=out, err=err, say=said.append)
    assert (done.tokens, done.prompt_tokens) == (6, 8) and said == ["[question] w1 w2"]
    cli = invoke("generate", tiny_family, "--prompt", "w1 w2", "--seed", "3")
    assert out.getvalue() == cli.stdout  # the same seeded answer
    assert sampling_kwargs(0.0, 64, 0.95) == {"do_sample": False}
    assert sampling_kwargs(0.7, 64, 0.95) == {"do_sample": True, "temperature": 0.7, "top_k": 64, "top_p": 0.95}
    assert (
        summary_line(Generated(tokens=6, prompt_tokens=8, seconds=2.0)) == "[6 tokens in 2.00 s, 3.0 tok/s; "
        "prompt 8 tokens]"
    )


def test_generate_on_the_toy_family_answers_question_81():
    result = invoke("generate", TOY, "--question-id", "81", "--max-new-tokens", "16", "--seed", "0")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip()
    assert "tokens in" in result.stderr


def test_verify_server_refuses_a_bad_keep_set_before_listening(tmp_path):
    """Every mistake in the keep-set file is named before the port is even tried: the test holds the recipe's own port
    (as a verify-server started from the README would) and the refusals are still about the keep set. Its ids are
    checked against the verifier's vocabulary after the port (that needs the checkpoint's config), before the load."""
    import errno
    import socket

    from hycoc.recipe import load_recipe

    cfg = load_recipe(TOY).verifier
    listener = socket.socket()
    try:
        listener.bind((cfg.host, cfg.port))
        listener.listen()
    except OSError as e:  # already held by a real server: the condition this test needs
        assert e.errno == errno.EADDRINUSE, e
    try:
        _refuses_bad_keep_sets(tmp_path)
    finally:
        listener.close()


def _refuses_bad_keep_sets(tmp_path):
    import numpy as np

    not_npy = tmp_path / "keep.txt"
    not_npy.write_text("1 2 3")
    result = invoke("verify-server", TOY, "--keep-set", not_npy)
    assert result.exit_code == 1
    assert result.stderr.startswith(f"hycoc verify-server: --keep-set {not_npy}: not a .npy array file")
    two_d = tmp_path / "keep2d.npy"
    np.save(two_d, np.zeros((2, 2), np.int64))
    result = invoke("verify-server", TOY, "--keep-set", two_d)
    assert result.exit_code == 1
    assert "expected a non-empty 1-D array of int token ids, got shape (2, 2) dtype int64" in result.stderr
    too_big = tmp_path / "keep_big.npy"
    np.save(too_big, np.array([0, 5, 4096], np.int64))
    result = invoke("verify-server", TOY, "--keep-set", too_big, "--port", 0)
    assert result.exit_code == 1
    assert "token id 4096 is outside the verifier's vocabulary of 4096" in result.stderr


def test_run_help_lists_the_json_keys_the_runtime_writes():
    """`run --help` names every key of the --json object, in order, from the code that writes it (finish_reason was
    missing from a hand-written list)."""
    import re

    from hycoc.runtime.client import RequestResult

    written = RequestResult(mode="hyco", text="a", tokens=[5, 6], rounds=1, seconds=0.5, finish_reason="stop")
    shown = " ".join(invoke("run", "--help").stdout.split())
    listed = re.search(r"one JSON object per answer and nothing else \(([a-z_, ]+)\)", shown).group(1).split(", ")
    assert listed == list(written.to_json()) and "finish_reason" in listed


def test_verify_server_names_a_busy_port_a_bad_host_and_a_missing_keep_set_before_importing_torch(tmp_path):
    """What needs no model is checked before torch is even imported (it used to come after the imports and the
    tokenizer's parse, tens of seconds on a first run): each a one-line refusal, with the fix. Run in a fresh
    interpreter, so "not imported" is what the command did."""
    import errno
    import os
    import socket

    missing = tmp_path / "bundle" / "keep_set.npy"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        cases = [
            [str(TOY), "--port", str(port)],
            [str(TOY), "--host", "192.0.2.1", "--port", "0"],  # TEST-NET-1 (RFC 5737): no machine's own address
            [str(TOY), "--port", "0", "--keep-set", str(missing)],
        ]
        results, loaded = cli_in_fresh_interpreter("verify-server", cases, ("torch", "transformers", "hycoc.verifier"))
    assert loaded == []
    (busy_code, busy_err), (host_code, host_err), (keep_code, keep_err) = results
    assert busy_code == host_code == keep_code == 1
    assert all(err.count("\n") == 1 for err in (busy_err, host_err, keep_err))
    assert busy_err.startswith(
        f"hycoc verify-server: cannot listen on 127.0.0.1:{port}: {os.strerror(errno.EADDRINUSE)}"
    )
    assert busy_err.rstrip().endswith("pass --port N, or --port 0 for any free port")
    assert host_err.startswith(f"hycoc verify-server: cannot listen on 192.0.2.1:0: {os.strerror(errno.EADDRNOTAVAIL)}")
    assert "pass --host with an address of this machine" in host_err
    assert keep_err.startswith(f"hycoc verify-server: --keep-set {missing}: no such file; ")
    assert "`hycoc build RECIPE` writes" in keep_err and "not a .npy" not in keep_err


def test_verify_server_refuses_bad_or_contradictory_modes_before_importing_torch():
    """--batching / --tree-budget / --allowance values outside their lists (`hycoc.serving_limits`, the one source
    the verifier reads too) and "auto" with --batching serial are usage errors (exit 2) named in one line before
    torch, transformers or the verifier are imported (they used to be refused after the verifier loaded, 6.7 s).
    Run in a fresh interpreter, so "not imported" is what the command did."""
    cases = [
        [str(TOY), "--batching", "fast"],
        [str(TOY), "--tree-budget", "maybe"],
        [str(TOY), "--allowance", "always"],
        [str(TOY), "--batching", "serial", "--tree-budget", "auto"],
        [str(TOY), "--batching", "serial", "--allowance", "auto"],
    ]
    results, loaded = cli_in_fresh_interpreter("verify-server", cases, ("torch", "transformers", "hycoc.verifier"))
    assert loaded == []
    errors = [err for code, err in results if code == 2 and err.count("\n") == 1]
    assert errors == [
        "hycoc verify-server: --batching 'fast': allowed: batched, serial\n",
        "hycoc verify-server: --tree-budget 'maybe': allowed: fixed, auto\n",
        "hycoc verify-server: --allowance 'always': allowed: fixed, auto\n",
        "hycoc verify-server: --tree-budget auto allocates rows across a batched forward: use it with --batching "
        'batched (or verifier.batching = "batched")\n',
        "hycoc verify-server: --allowance auto sizes trees by the load of batched forwards: use it with --batching "
        'batched (or verifier.batching = "batched")\n',
    ]


def test_server_modes_are_one_list_for_the_recipe_the_cli_and_the_verifier():
    """The batching, row-budget and allowance modes: `hycoc.serving_limits` holds them; the recipe's fields accept
    exactly them, the verifier's modules re-export the same objects, and `server_modes` resolves the recipe's and
    the command line's as the library's `server_options` does."""
    from typing import get_args

    from hycoc import serving_limits as sl
    from hycoc.recipe.deployment import Verifier

    for field, modes in (
        ("batching", sl.BATCHING_MODES),
        ("tree_budget", sl.TREE_BUDGETS),
        ("allowance", sl.ALLOWANCE_MODES),
    ):
        assert set(get_args(Verifier.model_fields[field].annotation)) == set(modes), field
    assert sl.server_modes(("batched", "auto", "auto")) == {
        "batching": "batched",
        "tree_budget": "auto",
        "allowance": "auto",
    }
    serial = sl.server_modes(("batched", "auto", "auto"), batching="serial")
    assert serial == {"batching": "serial", "tree_budget": "fixed", "allowance": "fixed"}  # serial turns both off
    assert sl.server_modes(("serial", "fixed", "fixed"), batching="batched", allowance="auto")["allowance"] == "auto"
    with pytest.raises(ValueError, match="--allowance auto sizes trees"):
        sl.server_modes(("serial", "auto", "auto"), allowance="auto")  # the recipe's serial, asked for auto
    pytest.importorskip("torch")
    from hycoc.verifier import allowance, loading, row_budget
    from hycoc.verifier.server import worker

    assert row_budget.TREE_BUDGETS is sl.TREE_BUDGETS and allowance.ALLOWANCE_MODES is sl.ALLOWANCE_MODES
    assert loading.BATCHING_MODES is worker.BATCHING_MODES is sl.BATCHING_MODES


# ---- the auth token (docs/serving.md "Limits": best from a file or HYCOC_AUTH_TOKEN; --auth-token warns) -------


def _token_app():
    """A one-command app with run's two auth options, printing the token `_auth_token` settles on."""
    from hycoc.cli import _auth_token

    app = typer.Typer()

    @app.command()
    def main(
        ctx: typer.Context,
        auth_token: str | None = typer.Option(None, envvar="HYCOC_AUTH_TOKEN"),
        auth_token_file: Path | None = typer.Option(None),
    ) -> None:
        typer.echo(f"token={_auth_token('run', ctx, auth_token, auth_token_file)}")

    return app


def test_auth_token_on_the_command_line_is_warned_about(tmp_path):
    runner = CliRunner()
    result = runner.invoke(_token_app(), ["--auth-token", "s3cret"])
    assert result.exit_code == 0 and result.stdout == "token=s3cret\n"
    assert result.stderr == (
        "hycoc run: warning: --auth-token on the command line is visible to every local user "
        "(ps, /proc/PID/cmdline); set HYCOC_AUTH_TOKEN or use --auth-token-file FILE instead\n"
    )
    result = runner.invoke(_token_app(), [], env={"HYCOC_AUTH_TOKEN": "s3cret"})
    assert result.stdout == "token=s3cret\n" and result.stderr == ""  # the environment: no warning
    (tmp_path / "token").write_text("from-file\n")
    result = runner.invoke(_token_app(), ["--auth-token-file", str(tmp_path / "token")])
    assert result.stdout == "token=from-file\n" and result.stderr == ""
    result = runner.invoke(_token_app(), ["--auth-token-file", str(tmp_path / "token"), "--auth-token", "x"])
    assert result.exit_code == 2 and "give one of --auth-token and --auth-token-file" in result.stderr
    (tmp_path / "empty").write_text("\n")
    result = runner.invoke(_token_app(), ["--auth-token-file", str(tmp_path / "empty")])
    assert result.exit_code == 1 and "the file is empty" in result.stderr  # a bad file: bad input


@pytest.mark.parametrize(
    "verifier,expected",
    [
        ("toy/models/verifer", "models.verifier: toy/models/verifer: no such folder"),
        ("toy/models", "models.verifier: toy/models: no config.json in"),
    ],
)
def test_inspect_recipe_names_a_wrong_model_folder_before_comparing_shapes(tmp_path, verifier, expected):
    text = TOY.read_text(encoding="utf-8").replace('verifier = "toy/models/verifier"', f'verifier = "{verifier}"')
    (tmp_path / "toy").symlink_to(ROOT / "recipes" / "toy", target_is_directory=True)  # the relative paths hold
    recipe = tmp_path / "toy.toml"
    recipe.write_text(text, encoding="utf-8")
    result = invoke("inspect", recipe, "--json")
    assert result.exit_code == 1
    assert result.stderr.startswith(f"hycoc inspect: {expected}"), result.stderr
    assert "backbone_hidden_size" not in result.stderr
