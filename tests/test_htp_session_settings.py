"""The device's QNN HTP session settings (runtime/htp_session.py; docs/device-runtime.md "QNN session settings"):
performance mode, context priority, graph finalization mode and RPC latency, each a `hycoc run` option, checked
before anything loads, and merged into the QNN EP's provider options of every graph the runtime opens
(`hycoc.runtime.graph_sessions.htp_provider_options`). No NPU here: a ``qnn`` test loads a small EPContext graph on
onnxruntime-qnn's x86 HTP simulator under every setting."""

from __future__ import annotations

import numpy as np
import pytest
from hycoc.runtime import graph_sessions, graphs
from hycoc.runtime.client import load_runtime
from hycoc.runtime.htp_session import (
    HTP_FINALIZATION_MODES,
    HTP_PERFORMANCE_MODES,
    QNN_CONTEXT_PRIORITIES,
    HtpSessionSettings,
    HtpSettingError,
)
from hycoc.targets.profiles import get_profile
from hycoc.targets.qnn_ep import qnn_installed
from typer.testing import CliRunner

from hycoc.bundle import load_manifest
from hycoc.cli import app
from hycoc.run_options import RunOptionError, htp_settings


def htp_manifest(tiny_bundle):
    """The tiny cpu bundle's manifest as if built for htp-v81 (SM8850)."""
    m = load_manifest(tiny_bundle.bundle)
    target = m.target.model_copy(update={"name": "htp-v81", "backend": "htp", "htp_arch": 81, "soc_model": "SM8850"})
    return m.model_copy(update={"target": target})


def test_the_defaults_are_genies_and_every_value_reaches_the_provider_options():
    assert HtpSessionSettings().provider_options() == {
        "htp_performance_mode": "burst",
        "qnn_context_priority": "normal",
        "rpc_control_latency": "100",
    }
    s = HtpSessionSettings("sustained_high_performance", "high", "3", 0)
    assert s.provider_options() == {
        "htp_performance_mode": "sustained_high_performance",
        "qnn_context_priority": "high",
        "htp_graph_finalization_optimization_mode": "3",
    }  # latency 0: not set
    for mode in HTP_PERFORMANCE_MODES:
        assert HtpSessionSettings(performance_mode=mode).provider_options()["htp_performance_mode"] == mode
    for priority in QNN_CONTEXT_PRIORITIES:
        assert HtpSessionSettings(context_priority=priority).provider_options()["qnn_context_priority"] == priority


@pytest.mark.parametrize(
    "kw, field",
    [
        ({"performance_mode": "turbo"}, "performance_mode"),
        ({"context_priority": "urgent"}, "context_priority"),
        ({"finalization_mode": "4"}, "finalization_mode"),
        ({"rpc_control_latency_us": -1}, "rpc_control_latency_us"),
        ({"rpc_control_latency_us": 2**32}, "rpc_control_latency_us"),
        ({"rpc_control_latency_us": True}, "rpc_control_latency_us"),
    ],
)
def test_a_value_outside_its_choices_is_refused_naming_the_field(kw, field):
    with pytest.raises(HtpSettingError, match=f"^HTP {field} ") as e:
        HtpSessionSettings(**kw)
    assert e.value.field == field


def test_the_settings_join_the_target_profiles_options(tiny_bundle):
    m = htp_manifest(tiny_bundle)
    profile = get_profile("htp-v81").provider_options()
    default = graph_sessions.htp_provider_options(m)
    assert default == {**profile, **HtpSessionSettings().provider_options()}
    assert default["htp_graph_finalization_optimization_mode"] == profile["htp_graph_finalization_optimization_mode"]
    mine = graph_sessions.htp_provider_options(m, HtpSessionSettings("balanced", "low", "2", 0), shared_memory=True)
    assert mine == {
        **profile,
        "htp_performance_mode": "balanced",
        "qnn_context_priority": "low",
        "htp_graph_finalization_optimization_mode": "2",
        "enable_htp_shared_memory_allocator": "1",
    }
    with pytest.raises(graph_sessions.TargetMismatch, match="names no HTP arch"):
        graph_sessions.htp_provider_options(load_manifest(tiny_bundle.bundle))


def test_every_graph_the_runtime_opens_gets_the_settings(tiny_bundle, monkeypatch):
    """`load_runtime` -> `GraphRunner` -> the session's provider options, for each graph (captured where the QNN EP
    would be asked; the session is not made)."""
    from hycoc.runtime import device_bundle
    from hycoc.targets import qnn_ep

    seen = []

    def capture(provider_options, config=None, log_severity=None):
        seen.append(dict(provider_options))
        raise RuntimeError("captured")

    bundle = device_bundle.open_bundle(tiny_bundle.bundle, "cpu")
    htp_bundle = type(bundle).__new__(type(bundle))
    htp_bundle.__dict__.update(bundle.__dict__, manifest=htp_manifest(tiny_bundle))
    monkeypatch.setattr(device_bundle, "open_bundle", lambda path, backend: htp_bundle)
    monkeypatch.setattr(qnn_ep, "session_options", capture)
    monkeypatch.setattr(graphs, "_refuse_shared_binary_on_simulator", lambda manifest, entry: None)
    settings = HtpSessionSettings("high_performance", "normal_high", None, 250)
    with pytest.raises(graphs.GraphRunError, match="graph head .* did not load on the htp backend: captured"):
        load_runtime(tiny_bundle.bundle, "htp", htp=settings)
    assert seen and seen[0]["htp_performance_mode"] == "high_performance"
    assert (seen[0]["qnn_context_priority"], seen[0]["rpc_control_latency"]) == ("normal_high", "250")
    with pytest.raises(ValueError, match="htp backend's: not with backend 'cpu'"):
        load_runtime(tiny_bundle.bundle, "cpu", htp=settings)


def test_run_options_name_the_option_its_choices_and_the_backend():
    assert htp_settings("htp") is None and htp_settings("cpu") is None  # nothing named: the defaults
    assert htp_settings("htp", finalization="3", rpc_latency_us=0) == HtpSessionSettings(
        finalization_mode="3", rpc_control_latency_us=0
    )
    with pytest.raises(RunOptionError, match="^--htp-performance-mode 'turbo': choose one of burst, ") as e:
        htp_settings("htp", performance_mode="turbo")
    assert e.value.code == 2
    with pytest.raises(
        RunOptionError, match="^--htp-finalization '9': choose one of " + ", ".join(HTP_FINALIZATION_MODES)
    ):
        htp_settings("htp", finalization="9")
    with pytest.raises(RunOptionError, match="^--htp-context-priority: QNN session settings apply to --backend htp"):
        htp_settings("cpu", context_priority="high")


def test_hycoc_run_refuses_a_bad_setting_in_one_line_before_loading(tiny_bundle):
    result = CliRunner().invoke(
        app,
        [
            "run",
            str(tiny_bundle.bundle),
            "--server",
            "ws://127.0.0.1:9",
            "--prompt",
            "hi",
            "--htp-context-priority",
            "x",
        ],
    )
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        "hycoc run: --htp-context-priority: QNN session settings apply to --backend htp, not cpu"
    )
    result = CliRunner().invoke(
        app,
        ["run", str(tiny_bundle.bundle), "--backend", "htp", "--server", "ws://127.0.0.1:9", "--prompt", "hi"]
        + ["--htp-performance-mode", "turbo"],
    )
    assert result.exit_code == 2 and "--htp-performance-mode 'turbo': choose one of burst" in result.stderr


# ---- on the x86 HTP simulator -------------------------------------------------------------------------------------


def _qdq_matmul(path):
    """y = x @ W, x (1, 8) and y (1, 4) at uint16, W uint8: the smallest graph the HTP compiles without fallback."""
    import onnx
    from hycoc.targets.qdq_matmul import qdq_matmul

    w = np.arange(32, dtype=np.uint8).reshape(8, 4)
    m = qdq_matmul(w, 1, "g", w_scale=0.01, w_zero=128, x_scale=8 / 65535)
    onnx.save(m, str(path))
    return path


@pytest.mark.qnn
@pytest.mark.skipif(not qnn_installed(), reason="onnxruntime-qnn is not installed")
def test_every_setting_loads_on_the_simulator_and_gives_the_same_output(tmp_path):
    from types import SimpleNamespace

    import onnxruntime as ort
    from hycoc.targets.htp import compile_context
    from hycoc.targets.qnn_ep import session_options

    cg = compile_context(_qdq_matmul(tmp_path / "mm.onnx"), tmp_path / "out", get_profile("htp-v81"), graph_name="mm")
    manifest = SimpleNamespace(target=SimpleNamespace(htp_arch=81, soc_model="SM8850"))
    x = {"x": np.linspace(-1, 1, 8, dtype=np.float32)[None]}

    def run(options):
        so = session_options(options, {"session.disable_cpu_ep_fallback": "1"}, log_severity=3)
        return ort.InferenceSession(str(cg.ctx_model), sess_options=so).run(None, x)[0]

    want = run(get_profile("htp-v81").provider_options())  # the EP's own defaults
    settings = [HtpSessionSettings()]
    settings += [HtpSessionSettings(performance_mode=m) for m in ("sustained_high_performance", "balanced")]
    settings += [HtpSessionSettings(context_priority=p, finalization_mode="3") for p in QNN_CONTEXT_PRIORITIES]
    for s in settings:
        np.testing.assert_array_equal(run(graph_sessions.htp_provider_options(manifest, s)), want)
    # why hycoc checks the values itself: this EP (onnxruntime-qnn 2.7.0) loads an unknown performance mode
    # silently and refuses an unknown priority only at load
    base = get_profile("htp-v81").provider_options()
    np.testing.assert_array_equal(run({**base, "htp_performance_mode": "turbo"}), want)
    with pytest.raises(Exception, match="Invalid Qnn context priority"):
        run({**base, "qnn_context_priority": "urgent"})
