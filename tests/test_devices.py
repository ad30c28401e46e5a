"""Targets by device (targets/profiles.py DEVICES, passes/build.py recipe_for_target), the runtime's device check
(runtime/device_identity.py, runtime/device_bundle.py check_device_identity), device time per generation
(hycoc/device_time.py npu_profile), UTF-8 stdio on Windows (hycoc/cli/_common.py utf8_stdio) and the CI's wheel
resolve (.ci/resolve_wheels.py).

What nobody here wrote is the reference: the arch and SoC QNN itself writes into each context binary, pip's own
failures, Python's own codecs.
"""

from __future__ import annotations

import importlib.util
import io
import json
import shutil
import subprocess
import sys
import typing

import pytest
from conftest import cli_in_fresh_interpreter
from hycoc.targets.profiles import (
    DEVICES,
    HTP_TARGETS,
    PROFILES,
    UnknownTargetError,
    device_for_soc,
    profile_for,
    resolve_device,
)
from hycoc.targets.qnn_ep import qnn_installed
from paths import GEMMA4, ROOT
from typer.testing import CliRunner

needs_qnn = pytest.mark.skipif(
    not qnn_installed(), reason="onnxruntime-qnn is not importable (pip install -e '.[qnn]')"
)


# ---- the device table ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, arch, soc",
    [
        ("Snapdragon 8 Gen 2", 73, "SM8550"),
        ("Galaxy S23 Ultra", 73, "SM8550"),
        ("snapdragon 8 gen 3", 75, "SM8650"),
        ("Samsung Galaxy S24 Ultra", 75, "SM8650"),
        ("SM8650", 75, "SM8650"),
        ("Snapdragon 8 Elite", 79, "SM8750"),
        ("Galaxy S25", 79, "SM8750"),
        ("Snapdragon 8 Elite Gen 5", 81, "SM8850"),
        ("Galaxy S26 Ultra", 81, "SM8850"),
        ("Snapdragon X Elite", 73, "SC8380XP"),
        ("X1E78100", 73, "SC8380XP"),
    ],
)
def test_a_device_name_or_alias_resolves_to_its_arch_and_soc(name, arch, soc):
    d = resolve_device(name)
    p = d.profile()
    assert (d.htp_arch, d.soc_model, p.htp_arch, p.soc_model) == (arch, soc, arch, soc)
    assert p.name == f"htp-v{arch}" and p.provider_options()["htp_arch"] == str(arch)
    assert profile_for(arch, soc).soc_id == d.soc_id  # a recipe's [target] of that device finds it too


def test_an_unknown_device_lists_the_known_ones_and_every_entry_states_its_source():
    with pytest.raises(UnknownTargetError) as e:
        resolve_device("Nokia 3310")
    for d in DEVICES:
        assert d.name in str(e.value)
        assert d.source and PROFILES[f"htp-v{d.htp_arch}"].source
    # "8 Elite" and "8 Elite Gen 5" are two devices: no prefix match
    assert resolve_device("8 Elite").htp_arch == 79 and resolve_device("8 Elite Gen 5").htp_arch == 81
    assert device_for_soc("X1E80100").soc_model == "SC8380XP"  # the Linux kernel's part number of the X Elite


def test_the_recipe_accepts_exactly_the_build_targets():
    """One list of targets: the recipe's [target] name choices are the compiler's (passes/build.py TARGETS)."""
    from hycoc.passes.build import TARGETS

    from hycoc.recipe import Target

    assert set(typing.get_args(Target.model_fields["name"].annotation)) == set(TARGETS)
    assert {f"htp-v{d.htp_arch}" for d in DEVICES} <= set(HTP_TARGETS)


@needs_qnn
def test_qnn_compiles_every_device_entry_and_writes_its_arch_and_soc():
    """A trivial 16-bit graph compiled per device entry (arch + SoC id) and per profile: the binary QNN writes says
    that SoC and arch (QNN silently compiles an unknown arch for v68, and soc_model wins over htp_arch)."""
    from hycoc.targets.qnn_ep import run_worker

    jobs = [{"htp_arch": d.htp_arch, "soc_id": d.soc_id, "key": d.name} for d in DEVICES]
    jobs += [{"htp_arch": p.htp_arch, "soc_id": p.soc_id, "key": n} for n, p in PROFILES.items() if p.backend == "htp"]
    res, log = run_worker({"op": "probe", "archs": jobs}, timeout_s=600)
    assert res.get("ok"), log[-2000:]
    for d in DEVICES:
        got = res["archs"][d.name]
        assert got["ok"] and got["target"]["arch"] == d.htp_arch and got["target"]["soc_type"] == d.soc_model, got
    for n in HTP_TARGETS:
        got, p = res["archs"][n], PROFILES[n]
        assert got["target"]["arch"] == p.htp_arch and got["target"]["soc_type"] == p.soc_model
        assert got["target"]["memory_alloc_limit_mib"] * 1024 * 1024 == p.max_context_bytes  # the profile's limit


# ---- retargeting a recipe ------------------------------------------------------------------------------------------


def test_recipe_for_target_changes_the_target_table_only():
    from hycoc.passes.build import BuildError, recipe_for_target

    from hycoc.recipe import load_recipe

    toy = load_recipe(ROOT / "recipes" / "toy.toml")
    r, name = recipe_for_target(toy, "htp-v75")
    assert (name, r.target.name, r.target.htp_arch, r.target.soc_model) == ("htp-v75", "htp-v75", 75, "SM8650")
    r, name = recipe_for_target(toy, None, resolve_device("Snapdragon X Elite"))
    assert (name, r.target.htp_arch, r.target.soc_model) == ("htp-v73", 73, "SC8380XP")
    # every table but [target] dumps as before: the passes before the target step keep their cache keys
    for section in type(toy).model_fields:
        if section != "target":
            assert getattr(r, section).model_dump(mode="json") == getattr(toy, section).model_dump(mode="json")
    assert r.target.context_size_limit_mb == toy.target.context_size_limit_mb
    with pytest.raises(
        BuildError,
        match=r"--device 'Snapdragon 8 Gen 3' is Hexagon v75 \(SM8650\) and --target is "
        "htp-v81",
    ):
        recipe_for_target(toy, "htp-v81", resolve_device("Galaxy S24"))
    with pytest.raises(BuildError, match=r"htp-v68 .* need 16-bit activations .* and 4-bit weights"):
        recipe_for_target(toy, "htp-v68")  # refused before any pass, not after the QAT


def test_cli_build_refuses_an_unknown_device_and_a_disagreeing_target_in_one_line_before_importing_torch(tmp_path):
    """An unknown --device and a --device that contradicts --target are usage errors (exit 2, docs/commands.md
    "Exit codes"; they exited 1, after 6-7 s of imports), named in one line before torch or the compiler is
    imported. Run in a fresh interpreter, so "not imported" is what the command did."""
    toy, out = str(ROOT / "recipes" / "toy.toml"), str(tmp_path / "b")
    cases = [
        [toy, "--device", "Nokia 3310", "--out", out],
        [toy, "--device", "Galaxy S25", "--target", "htp-v75", "--out", out],
        [toy, "--device", "Snapdragon 8 Elite", "--target", "cpu", "--out", out],
    ]
    results, loaded = cli_in_fresh_interpreter("build", cases, ("torch", "transformers", "hycoc.passes.build"))
    assert loaded == []
    (unknown_code, unknown), (v75_code, v75), (cpu_code, cpu) = results
    assert unknown_code == v75_code == cpu_code == 2
    assert all(err.count("\n") == 1 for err in (unknown, v75, cpu))
    assert unknown.startswith("hycoc build: --device: unknown device 'Nokia 3310' (known: ")
    assert "Snapdragon X Elite" in unknown and "X1E80100" in unknown
    assert v75 == (
        "hycoc build: --device 'Snapdragon 8 Elite' is Hexagon v79 (SM8750) and --target is htp-v75: drop --target, "
        "or pass --target htp-v79\n"
    )
    assert "and --target is cpu: drop --target, or pass --target htp-v79" in cpu
    assert not (tmp_path / "b").exists()


def test_cli_build_until_an_unknown_pass_is_a_usage_error(tmp_path):
    """``--until nope`` names the pipeline's passes in one line and exits 2 (it exited 1), before any model loads."""
    pytest.importorskip("torch")
    from hycoc.cli import app

    toy = str(ROOT / "recipes" / "toy.toml")
    r = CliRunner().invoke(app, ["build", toy, "--until", "nope", "--cache-dir", str(tmp_path / "c")])
    assert r.exit_code == 2, r.stderr
    assert r.stderr.startswith("hycoc build: --until nope: no such pass; passes: keep_set, calibration_answers, ")
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "c" / "keep_set").exists()


@pytest.fixture(scope="module")
def arch_bundles(tiny_pipeline, tmp_path_factory):
    """The tiny recipe built from the session's cached pipeline (only the target step runs) for each device:
    {device name: bundle folder}. ~35 s per device on 2 busy cores (3 context binaries each)."""
    if not qnn_installed():
        pytest.skip("onnxruntime-qnn is not importable (pip install -e '.[qnn]')")
    from hycoc.passes import build as b
    from rich.console import Console

    p, root, out = tiny_pipeline, tmp_path_factory.mktemp("arch_bundles"), {}
    for device in ("Snapdragon 8 Elite Gen 5", "Snapdragon 8 Elite", "Snapdragon 8 Gen 3", "Snapdragon X Elite"):
        recipe, name = b.recipe_for_target(p.recipe, None, resolve_device(device))
        out[device] = root / f"{name}-{recipe.target.soc_model}"
        b.build_bundle(recipe, name, out[device], p.cache, b.BuildSettings(console=Console(file=io.StringIO())))
    return out


def test_each_arch_builds_the_tiny_bundle_and_its_binaries_say_that_arch(arch_bundles):
    """v81, v79, v75 and v73 (as the X Elite, SoC SC8380XP): every context binary reads back as the device's arch
    and SoC (what QNN wrote), the manifest says the same, and one graph runs on the simulator for each."""
    import numpy as np
    from hycoc.targets.htp import run_compiled
    from hycoc.targets.qnn_ep import read_binary_target

    from hycoc.bench.paper.device_profile import profile_inputs
    from hycoc.bundle import load_manifest

    for device, out in arch_bundles.items():
        d = resolve_device(device)
        m = load_manifest(out)
        assert (m.target.name, m.target.htp_arch, m.target.soc_model, m.target.soc_id) == (
            f"htp-v{d.htp_arch}",
            d.htp_arch,
            d.soc_model,
            d.soc_id,
        )
        binaries = {g.context_binary for g in m.graphs}
        assert binaries and None not in binaries
        for binary in binaries:
            t = read_binary_target(out / binary)
            assert (t.arch, t.soc_type) == (d.htp_arch, d.soc_model), (device, binary)
        head = m.graph("head")
        got = run_compiled(out / head.file, profile_inputs(head), d.profile())
        assert got["top_index"].shape == tuple(next(o.shape for o in head.outputs if o.name == "top_index"))
        assert np.all((got["top_index"] >= 0) & (got["top_index"] < m.keep_set_size))


# ---- the runtime's device check ------------------------------------------------------------------------------------


def _htp_manifest(tiny_bundle, arch: int = 81, soc: str = "SM8850"):
    from hycoc.bundle import load_manifest

    m = load_manifest(tiny_bundle.bundle)
    return m.model_copy(
        update={
            "target": m.target.model_copy(
                update={"name": f"htp-v{arch}", "backend": "htp", "htp_arch": arch, "soc_model": soc, "qnn_sdk": None}
            )
        }
    )


def test_detect_device_reads_the_os_and_honours_HYCOC_DEVICE(tmp_path):
    from hycoc.runtime.device_identity import detect_device

    name = "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU"
    win = detect_device({}, system="Windows", machine="ARM64", py_machine="win-arm64", processor_name=name)
    assert (win.soc_model, win.htp_arch, win.emulated, win.simulator) == ("SC8380XP", 73, False, False)
    x64 = detect_device({}, system="Windows", machine="ARM64", py_machine="win-amd64", processor_name=name)
    assert x64.emulated and x64.python_machine == "x86_64"
    (tmp_path / "sys/devices/soc0").mkdir(parents=True)
    (tmp_path / "sys/devices/soc0/machine").write_text("SM8650\n")
    phone = detect_device(
        {"ANDROID_ROOT": "/system"}, system="Linux", machine="aarch64", py_machine="linux-aarch64", linux_root=tmp_path
    )
    assert (phone.os, phone.soc_model, phone.htp_arch, phone.source) == (
        "android",
        "SM8650",
        75,
        "/sys/devices/soc0/machine",
    )
    (tmp_path / "sys/devices/soc0/machine").unlink()
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/compatible").write_bytes(b"qcom,x1e80100-crd\0qcom,x1e80100\0")
    laptop = detect_device({}, system="Linux", machine="aarch64", py_machine="linux-aarch64", linux_root=tmp_path)
    assert (laptop.soc_model, laptop.htp_arch) == ("SC8380XP", 73)
    pretend = detect_device({"HYCOC_DEVICE": "Galaxy S23"}, system="Linux", machine="x86_64", py_machine="x86_64")
    assert (pretend.htp_arch, pretend.soc_model, pretend.simulator) == (73, "SM8550", True)
    with pytest.raises(UnknownTargetError, match="unknown device 'Pixel 9'"):
        detect_device({"HYCOC_DEVICE": "Pixel 9"})


def test_a_v81_bundle_on_a_v73_device_is_refused_in_one_line(tiny_bundle):
    from hycoc.runtime.device_bundle import check_device_identity
    from hycoc.runtime.device_identity import DeviceIdentity

    from hycoc.bundle import TargetMismatch

    m = _htp_manifest(tiny_bundle)
    phone = DeviceIdentity("android", "arm64", "arm64", "SM8550", 73, "Snapdragon 8 Gen 2", "test")
    with pytest.raises(TargetMismatch) as e:
        check_device_identity(m, phone)
    msg = str(e.value)
    assert "\n" not in msg and "Hexagon v81 (SM8850)" in msg and "Hexagon v73 (SM8550" in msg
    assert '--device "Snapdragon 8 Gen 2"' in msg
    # same arch, another SoC (an 8 Gen 2 bundle on an X Elite): refused too
    with pytest.raises(TargetMismatch, match=r"Hexagon v73 \(SM8550\), this device is Hexagon v73 \(SC8380XP"):
        check_device_identity(
            _htp_manifest(tiny_bundle, 73, "SM8550"),
            DeviceIdentity("windows", "arm64", "arm64", "SC8380XP", 73, "Snapdragon X Elite", "t"),
        )
    with pytest.raises(TargetMismatch, match="runs under emulation on an arm64 windows host.*Python for ARM64"):
        check_device_identity(m, DeviceIdentity("windows", "arm64", "x86_64", "SC8380XP", 73, "Snapdragon X Elite", ""))
    check_device_identity(m, DeviceIdentity("linux", "x86_64", "x86_64"))  # the simulator runs any arch
    check_device_identity(m, DeviceIdentity("linux", "arm64", "arm64", source="unknown"))  # SoC unknown: not checked
    check_device_identity(m, DeviceIdentity("android", "arm64", "arm64", "SM8850", 81, "Snapdragon 8 Elite Gen 5", ""))


def test_open_bundle_refuses_a_v81_bundle_when_told_it_runs_on_a_v73_before_any_graph(arch_bundles, monkeypatch):
    """The seam: HYCOC_DEVICE="Snapdragon 8 Gen 2" (a v73) and a real htp-v81 bundle: `hycoc run` fails with the
    one-line error before any graph session is created (onnxruntime.InferenceSession is never called)."""
    import onnxruntime

    from hycoc.cli import app

    out = arch_bundles["Snapdragon 8 Elite Gen 5"]
    sessions = []
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda *a, **k: sessions.append(a))
    monkeypatch.setenv("HYCOC_DEVICE", "Snapdragon 8 Gen 2")
    r = CliRunner().invoke(app, ["run", str(out), "--mode", "slm-alone", "--prompt", "w1", "--backend", "htp"])
    assert r.exit_code == 1, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and not sessions
    assert "bundle built for Hexagon v81 (SM8850), this device is Hexagon v73 (SM8550, Snapdragon 8 Gen 2" in r.stderr


def test_run_on_the_simulator_notes_it_once_the_bundle_is_accepted(arch_bundles, monkeypatch):
    """On an x86 host a real htp-v81 bundle runs on the QNN HTP simulator: the run works and its first stderr line
    is `simulator_note`'s (the same bundle refused for a v73 gets no note: the test above)."""
    from hycoc.runtime.device_identity import detect_device

    from hycoc.cli import app
    from hycoc.run_options import simulator_note

    monkeypatch.delenv("HYCOC_DEVICE", raising=False)
    if not detect_device().simulator:
        pytest.skip("not an x86 host: the HTP backend is the device's NPU here")
    out = arch_bundles["Snapdragon 8 Elite Gen 5"]
    args = ["run", str(out), "--mode", "slm-alone", "--prompt", "w1", "--backend", "htp", "--max-new-tokens", "2"]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    assert r.stderr.splitlines()[0] == f"hycoc run: {simulator_note('htp', detect_device())}"


# ---- device time per generation ------------------------------------------------------------------------------------


def test_device_time_is_fitted_for_v81_only_and_says_so_for_the_others(tiny_bundle, tmp_path):
    from hycoc import device_time as dt
    from hycoc.bench.paper import device_profile as dp

    assert dt.npu_profile(81) is dt.NPU_PROFILES["v81"] and dt.npu_profile("v81") is dt.NPU_PROFILES["v81"]
    status = dt.fit_status()
    assert set(status) == {f"v{p.htp_arch}" for p in PROFILES.values() if p.backend == "htp"}
    for arch in (68, 73, 75, 79):
        assert status[f"v{arch}"] == f"not fitted for v{arch}"
        with pytest.raises(dt.NotFittedError, match=f"not fitted for v{arch} "):
            dt.npu_profile(arch)
    assert status["v81"].startswith("fitted: ")
    # a v75 bundle: the bench gets the sentence instead of a number
    bundle = tmp_path / "v75"
    shutil.copytree(tiny_bundle.bundle, bundle)
    manifest = json.loads((bundle / "manifest.json").read_text())
    manifest["target"].update(htp_arch=75, soc_model="SM8650")
    (bundle / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(dp.DeviceProfileError, match="device-time estimate not fitted for v75"):
        dp.estimated_device_costs(bundle)
    from rich.console import Console

    from hycoc.bench.paper.runner import device_time_for

    console = Console(file=io.StringIO(), width=300)
    got = device_time_for([], bundle, None, console)
    assert "configs" not in got and "not fitted for v75" in got["error"]
    assert "device time: not reported (device-time estimate not fitted for v75" in console.file.getvalue()
    assert dp.estimated_device_costs(tiny_bundle.bundle)[1].endswith("NPU profile v81")  # a cpu bundle: v81


def test_inspect_a_recipe_for_a_device_plans_its_limit_and_refuses_what_does_not_fit():
    from hycoc.passes.plan import PlanError

    from hycoc.cli import app
    from hycoc.inspect_report import recipe_report
    from hycoc.recipe import load_recipe

    r = CliRunner().invoke(app, ["inspect", str(GEMMA4), "--device", "Galaxy S24", "--json"])
    assert r.exit_code == 0, r.output
    plan = json.loads(r.stdout)
    budget = plan["context_budget"]
    assert (budget["profile"], budget["soc_model"], budget["device"]) == ("htp-v75", "SM8650", "Snapdragon 8 Gen 3")
    assert budget["limit_bytes"] == min(PROFILES["htp-v75"].max_context_bytes, 3500 * 1000 * 1000)
    assert plan["device_time_estimate"]["npu_profile"] is None
    assert plan["device_time_estimate"]["not_fitted"].startswith("device-time estimate not fitted for v75")
    # the same recipe with a 1,000 MB limit: the SLM graph (> 1 GB at the Gemma shape) is refused with its size
    config = load_recipe(GEMMA4)
    small = config.model_copy(update={"target": config.target.model_copy(update={"context_size_limit_mb": 1000})})
    slm = budget["graphs"]["slm"]["bytes"]
    assert slm > 1000 * 1000 * 1000
    with pytest.raises(
        PlanError,
        match=rf"over htp-v75's context limit of 1,000,000,000 bytes .*slm {slm:,} bytes "
        r'\(\[target\] slm_shards = "auto" \(2 shards\)\)',
    ):
        recipe_report(small, resolve_device("Galaxy S24"))
    r = CliRunner().invoke(app, ["inspect", str(GEMMA4), "--device", "Snapdragon 888"])
    assert r.exit_code == 1 and "htp-v68 (Snapdragon 888) cannot run this recipe's graphs" in r.stderr


# ---- UTF-8 stdio on Windows ----------------------------------------------------------------------------------------


def test_utf8_stdio_makes_a_windows_code_page_stream_write_utf8():
    from hycoc.cli._common import utf8_stdio

    text = "답: 서울 — naïve\n"
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="cp1252", write_through=True)  # a redirected stdout on Windows
    with pytest.raises(UnicodeEncodeError):
        stream.write(text)
    utf8_stdio([stream], windows=False)  # elsewhere: left alone
    assert stream.encoding == "cp1252"
    utf8_stdio([stream], windows=True)
    stream.write(text)
    stream.flush()
    assert raw.getvalue().endswith(text.encode("utf-8"))


# ---- the CI's wheel resolve ----------------------------------------------------------------------------------------


def _ci_module():
    spec = importlib.util.spec_from_file_location("resolve_wheels", ROOT / ".ci" / "resolve_wheels.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_resolve_tells_an_unreachable_registry_from_an_unresolvable_install(tmp_path):
    """pip's own failures, offline: an index on a closed port is a registry that does not answer (skipped, CI goes
    on); an empty local index is a requirement with no wheel (unresolvable, CI fails)."""
    ci = _ci_module()
    base = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--isolated",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(tmp_path / "d"),
    ]
    # --retries 1 as the CI's pip_command: pip names a connection error only in its retry warning (with
    # --retries 0 a refused connection reads as "from versions: none", like a package without wheels)
    assert ci.pip_command(["x"], "3.12", ("win_arm64",), "T", "R")[-6:-4] == ["--retries", "1"]
    down = subprocess.run(
        base
        + ["--index-url", "http://127.0.0.1:9/simple", "--retries", "1", "--timeout", "2", "hycoc-no-such-package"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ci.classify(down.returncode, down.stdout + down.stderr) == "skipped"
    (tmp_path / "empty").mkdir()
    none = subprocess.run(
        base + ["--no-index", "--find-links", str(tmp_path / "empty"), "hycoc-no-such-package"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ci.classify(none.returncode, none.stdout + none.stderr) == "unresolvable"
    assert ci.classify(0, "") == "ok"


def test_ci_resolve_reads_the_runtime_requirements_and_checks_the_wheels():
    ci = _ci_module()
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert (
        ci.requirements(ROOT / "pyproject.toml", "qnn")
        == project["dependencies"] + project["optional-dependencies"]["qnn"]
    )
    picked = {
        "onnxruntime": "onnxruntime-1.32.0-cp312-cp312-win_arm64.whl",
        "rich": "rich-15.0.0-py3-none-any.whl",
        "numpy": "numpy-2.4.6-cp312-cp312-win_amd64.whl",
    }
    problems = ci.check_wheels(picked, ("onnxruntime", "rich", "numpy", "tokenizers"), ("win_arm64",))
    assert problems == [
        "numpy: numpy-2.4.6-cp312-cp312-win_amd64.whl is not a win_arm64 wheel",
        "tokenizers: not in the resolved set",
    ]
    cmd = ci.pip_command(["numpy"], "3.12", ("win_arm64",), "T", "R.json")
    assert cmd[-1] == "numpy" and "--dry-run" in cmd and "--only-binary=:all:" in cmd
    assert cmd[cmd.index("--platform") + 1] == "win_arm64"


# ---- bundle paths that mean the same file on Windows ---------------------------------------------------------------


@pytest.mark.parametrize(
    "path",
    [
        "graphs/head_ctx.onnx",
        "luts/slm_embed_packed.npy",
        "graphs/slm.s0_ctx_qnn.bin",
        "lpt10.bin",
        "console.npy",
        "C:evil.onnx",
        "graphs/a:b.npy",
        "luts/nul.npy",
        "LUTS/Con",
        "aux.tar.gz",
        "graphs/com7.bin",
        "graphs/x.",
        "graphs/x ",
    ],
)
def test_a_bundle_path_is_refused_where_windows_reads_it_differently(path):
    """The reference is Python's own Windows path rules (``pathlib.PureWindowsPath``: drive, reserved device
    names): a path Windows would read as a drive-relative path, a stream or a device is refused; so is a part
    ending in "." or " ", which Windows drops (Win32 docs, "Naming Files, Paths, and Namespaces")."""
    from pathlib import PureWindowsPath

    from hycoc.bundle import check_rel_path

    win = PureWindowsPath(path)
    differs = (
        bool(win.drive)
        or ":" in path
        or any(PureWindowsPath(p).is_reserved() for p in path.split("/"))
        or any(p.endswith((".", " ")) for p in path.split("/"))
    )
    if differs:
        with pytest.raises(ValueError, match="not a relative path inside the bundle"):
            check_rel_path(path)
    else:
        check_rel_path(path)
        assert win.parts == tuple(path.split("/"))  # the same file, folder by folder, on Windows
