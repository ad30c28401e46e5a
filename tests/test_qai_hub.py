"""The ``qai-hub`` target and `hycoc profile` against the installed qai-hub 0.56.0 client, offline
(targets/qai_hub.py, hycoc/bench/paper/device_profile.py).

Every call hycoc makes is checked against the client's real signatures (`hub_canned.RecordingClient`), and the
whole job flow -- compile to QNN DLC, link, download, EPContext wrapping, profiling inference jobs, the failure of
each job -- runs through the client's own job and model objects with its REST layer replaced by canned protobuf
replies (`hub_canned.CannedHub`). Nothing here reaches the live AI Hub service.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytestmark = pytest.mark.hub
qai_hub = pytest.importorskip("qai_hub", reason="install the hub extra: pip install -e '.[hub]'")

# E402 below: after the importorskip above, so a run without qai-hub skips the module instead of failing
from hub_canned import QAIRT, S25, CannedHub, RecordingClient  # noqa: E402
from hycoc.targets import qai_hub as target  # noqa: E402


def test_the_pinned_client_is_installed():
    from importlib.metadata import version

    assert version("qai-hub") == "0.56.0"


def _qdq_graph(folder: Path, name: str, rows: int, *, extra_file: bool = False) -> Path:
    """A tiny QDQ graph (x [rows, 16] -> MatMul int8 weight -> y) saved with external data as NAME.onnx +
    NAME.onnx.data, AI Hub's folder form."""
    import onnx
    from hycoc.targets.qdq_matmul import qdq_matmul

    w = np.random.RandomState(rows).randint(-127, 128, (16, 16)).astype(np.int8)
    m = qdq_matmul(w, rows, name, w_scale=0.01)
    d = folder / name
    d.mkdir(parents=True)
    path = d / f"{name}.onnx"
    onnx.save(m, str(path), save_as_external_data=True, location=f"{name}.onnx.data", size_threshold=0)
    if extra_file:
        (d / "notes.txt").write_text("not for upload")
    return path


@pytest.fixture
def graphs(tmp_path):
    return [
        (_qdq_graph(tmp_path / "qdq", "head", 1), "head"),
        (_qdq_graph(tmp_path / "qdq", "slm", 32, extra_file=True), "slm"),
        (_qdq_graph(tmp_path / "qdq", "slm_decode", 1), "slm_decode"),
    ]


def test_compile_link_and_wrap_through_the_real_client(monkeypatch, tmp_path, graphs):
    import onnx

    hub = CannedHub(monkeypatch)
    client = RecordingClient(hub.client)
    dev = target.resolve_device(client, "Samsung Galaxy S26 (Family)", 81)
    assert dev.validated and dev.hexagon_arch == 81
    jobs = []
    linked = target.compile_and_link(
        client, graphs, tmp_path / "out", dev, htp_arch=81, on_job=lambda kind, j: jobs.append((kind, j))
    )

    compiles = [kw for name, kw in hub.calls if name == "create_compile_job"]
    assert [c["options"] for c in compiles] == [
        f"--target_runtime qnn_dlc --compute_unit npu --qnn_graph_name {g}" for g in ("head", "slm", "slm_decode")
    ]
    assert all(c["devices"] == ["Samsung Galaxy S26 (Family)"] for c in compiles)
    assert not any("qnn_context_binary" in str(kw) for _, kw in hub.calls)
    # each QDQ graph goes up as a folder of exactly NAME.onnx + NAME.onnx.data (slm's stray file left behind)
    uploads = [kw for name, kw in hub.calls if name == "create_and_upload_model"]
    assert all(u["is_directory"] for u in uploads) and len(uploads) == 3
    link = next(kw for name, kw in hub.calls if name == "create_link_job")
    dlc_ids = [hub.jobs[j].compile_job.target_model.model_id for kind, j in jobs if kind == "compile"]
    assert link["models"] == dlc_ids and link["device"] == "Samsung Galaxy S26 (Family)"
    assert [k for k, _ in jobs] == ["compile", "compile", "compile", "link"]

    assert linked.context_binary.read_bytes() == b"QNNCTXBIN"
    assert linked.qairt == QAIRT and linked.hexagon_arch == 81
    info = linked.manifest_info()
    assert info == {
        "device": "Samsung Galaxy S26 (Family)",
        "device_validated": True,
        "compile_jobs": {g: j for (kind, j), (_, g) in zip(jobs, graphs)},
        "link_job": jobs[-1][1],
        "qairt": QAIRT,
        "graph_names": {"head": "head", "slm": "slm", "slm_decode": "slm_decode"},
    }
    from hycoc.bundle import HubInfo

    HubInfo(**info)  # the manifest section takes it as it is
    for qdq, g in graphs:
        ctx = onnx.load(str(linked.ctx_models[g]))
        src = onnx.load(str(qdq), load_external_data=False)
        assert [n.op_type for n in ctx.graph.node] == ["EPContext"]
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ctx.graph.node[0].attribute}
        assert attrs == {
            "main_context": 1,
            "ep_cache_context": b"hub_context.bin",
            "embed_mode": 0,
            "source": b"QNNExecutionProvider",
            "partition_name": g.encode(),
            "max_size": 0,
            "is_multi_soc_ep_context": 0,
            "ep_sdk_version": QAIRT.encode(),
        }
        assert list(ctx.graph.input) == list(src.graph.input) and list(ctx.graph.output) == list(src.graph.output)
    # every call hycoc made on the client bound to the installed client's own signature (RecordingClient)
    assert [name for name, _, _ in client.recorded] == (
        ["get_devices", "submit_compile_job", "submit_compile_job", "submit_compile_job", "submit_link_job"]
    )
    inspect.signature(qai_hub.Device).bind("Samsung Galaxy S26 (Family)")
    # the job and model methods hycoc calls, against the installed classes
    for cls, method in (
        (qai_hub.CompileJob, "wait"),
        (qai_hub.CompileJob, "get_target_model"),
        (qai_hub.LinkJob, "wait"),
        (qai_hub.LinkJob, "get_target_model"),
        (qai_hub.InferenceJob, "wait"),
        (qai_hub.InferenceJob, "download_profile"),
    ):
        inspect.signature(getattr(cls, method)).bind(None)
    inspect.signature(qai_hub.Model.download).bind(None, "x.bin")
    assert hasattr(qai_hub.ModelMetadataKey, "QNN_CONTEXT_BIN_GRAPH_NAMES")


@pytest.mark.parametrize("kind", ["compile", "link"])
def test_a_failed_job_raises_naming_the_job_and_the_reason(monkeypatch, tmp_path, graphs, kind):
    hub = CannedHub(monkeypatch, fail={kind: "QNN converter: unsupported op"})
    dev = target.resolve_device(hub.client, "Samsung Galaxy S26 (Family)", 81)
    with pytest.raises(target.QaiHubJobError) as e:
        target.compile_and_link(hub.client, graphs, tmp_path / "out", dev)
    job = next(j for j, pb in hub.jobs.items() if pb.WhichOneof("job") == f"{kind}_job")
    what = "compile (graph 'head')" if kind == "compile" else "link"
    assert str(e.value) == f"AI Hub {what} job {job} failed: QNN converter: unsupported op"
    assert not (tmp_path / "out" / "hub_context.bin").exists()


def test_a_linked_binary_without_a_graph_is_refused(monkeypatch, tmp_path, graphs):
    hub = CannedHub(monkeypatch, graph_names="head,slm")
    dev = target.resolve_device(hub.client, "Samsung Galaxy S26 (Family)", 81)
    with pytest.raises(target.QaiHubJobError, match=r"has graphs \['head', 'slm'\], not \['slm_decode'\]"):
        target.compile_and_link(hub.client, graphs, tmp_path / "out", dev)


def test_device_names_are_checked_against_ai_hubs_list(monkeypatch):
    import requests

    hub = CannedHub(monkeypatch)
    with pytest.raises(target.QaiHubDeviceError) as e:
        target.resolve_device(hub.client, "Snapdragon 8 Elite Gen 5", 81)
    assert str(e.value) == (
        "target.hub_device = 'Snapdragon 8 Elite Gen 5' is not an AI Hub device; AI Hub lists: "
        "Samsung Galaxy S25 (Family), Samsung Galaxy S26 (Family) (`qai-hub list-devices` "
        "shows them all)"
    )
    with pytest.raises(target.QaiHubDeviceError, match="has Hexagon v79, the recipe's target.htp_arch is 81"):
        target.resolve_device(hub.client, S25.name, 81)

    def offline(*a, **k):
        raise requests.exceptions.ConnectionError("no route to host")

    monkeypatch.setattr(qai_hub.public_rest_api, "get_device_list", offline)
    dev = target.resolve_device(hub.client, "Samsung Galaxy S26 (Family)", 81)
    assert dev == target.HubDevice("Samsung Galaxy S26 (Family)", (), validated=False)


def test_quantized_io_adds_quantize_io(tmp_path):
    import onnx
    from onnx import TensorProto as T
    from onnx import helper as h

    g = h.make_graph(
        [h.make_node("Identity", ["x"], ["y"])],
        "g",
        [h.make_tensor_value_info("x", T.UINT16, [4])],
        [h.make_tensor_value_info("y", T.UINT16, [4])],
    )
    p = tmp_path / "q.onnx"
    onnx.save(h.make_model(g), str(p))
    assert target._quantized_io(p)
    assert target.compile_options("slm.s0", quantize_io=True) == (
        "--target_runtime qnn_dlc --compute_unit npu --qnn_graph_name slm_s0 --quantize_io"
    )


def test_without_a_token_nothing_is_uploaded(monkeypatch, tmp_path):
    from hycoc.passes import build as b

    from hycoc.recipe import load_recipe

    hub = CannedHub(monkeypatch)
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    recipe = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "toy.toml")
    with pytest.raises(target.QaiHubSetupError, match="no API token is configured"):
        b.run_pipeline(recipe, "qai-hub", tmp_path / "cache")
    assert hub.calls == []


def test_profile_flow_through_inference_jobs(monkeypatch, tmp_path):
    """`profile_bundle` on a two-graph htp bundle (manifest stubbed; EPContext models written by the target): one
    upload of the shared context binary, one profiling inference job per graph with its graph selected, the
    profile summarized; then a failed inference job."""
    import json

    from hycoc.bench.paper import device_profile as dp
    from hycoc.bundle import Encoding, GraphEntry, TensorSpec

    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "ctx.bin").write_bytes(b"QNNCTXBIN")
    q = _qdq_graph(tmp_path / "qdq", "slm", 32)
    target.write_epcontext(q, bundle / "slm_ctx.onnx", "ctx.bin", "slm")
    target.write_epcontext(q, bundle / "slm_decode_ctx.onnx", "ctx.bin", "slm_decode")
    enc = Encoding(scale=1 / 32768, zero_point=32768, dtype="uint16", bits=16)
    entries = [
        GraphEntry(
            name=n,
            role="slm",
            file=f"{n}_ctx.onnx",
            context_binary="ctx.bin",
            inputs=[
                TensorSpec(name="x", shape=[32, 16], dtype="float32", encoding=enc),
                TensorSpec(name="mask_full", shape=[1, 1, 32, 8], dtype="float32"),
            ],
            outputs=[TensorSpec(name="y", shape=[32, 16], dtype="float32")],
        )
        for n in ("slm", "slm_decode")
    ]
    manifest = SimpleNamespace(target=SimpleNamespace(backend="htp", name="htp-v81", htp_arch=81), graphs=entries)
    monkeypatch.setattr("hycoc.bundle.load_manifest", lambda path: manifest)
    hub = CannedHub(monkeypatch)
    client = RecordingClient(hub.client)
    result = dp.profile_bundle(bundle, "Samsung Galaxy S26 (Family)", hub=client)

    uploads = [kw for name, kw in hub.calls if name == "create_and_upload_model"]
    assert len(uploads) == 1 and uploads[0]["path"].endswith("ctx.bin")
    inf = [kw for name, kw in hub.calls if name == "create_inference_job"]
    assert [i["options"] for i in inf] == [
        "--qnn_options context_enable_graphs=slm",
        "--qnn_options context_enable_graphs=slm_decode",
    ]
    assert all(i["profile"] and i["dataset"] for i in inf)
    assert list(hub.datasets.values()) == [{"x": [(32, 16)], "mask_full": [(1, 1, 32, 8)]}] * 2
    g = result["graphs"]["slm"]
    assert g["execute_ms_median"] == 5.25 and g["execute_ms_p90"] == 6.1 and g["runs"] == 5
    assert g["peak_memory_bytes"] == 48_000_000
    assert g["top_ops"][0] == {"type": "MatMul", "ms": 3.7, "share": round(3700 / 5200, 4)}
    assert json.loads((bundle / dp.PROFILE_FILE).read_text())["graphs"]["slm_decode"]["execute_ms_median"] == 5.25
    table = dp.profile_table(result)  # what `hycoc profile` prints, split to the terminal's width
    assert table.rows[0][:7] == ["slm", table.rows[0][1], "5.250", "6.100", "5", "48.0", table.rows[0][6]]
    assert table.rows[0][6].startswith("MatMul 3.70")
    assert [name for name, _, _ in client.recorded] == [
        "get_devices",
        "upload_model",
        "submit_inference_job",
        "submit_inference_job",
    ]

    hub = CannedHub(monkeypatch, fail={"inference": "device timed out"})
    with pytest.raises(
        dp.DeviceProfileError,
        match=r"AI Hub inference job j\d+ \(graph slm\) failed: device timed "
        r"out",
    ):
        dp.profile_bundle(bundle, "Samsung Galaxy S26 (Family)", hub=hub.client)

    # a qai-hub bundle: the link job's model on AI Hub is profiled, nothing is uploaded again
    hub = CannedHub(monkeypatch)
    dev = target.resolve_device(hub.client, "Samsung Galaxy S26 (Family)", 81)
    graphs = [(_qdq_graph(tmp_path / "q2", g, 32), g) for g in ("slm", "slm_decode")]
    linked = target.compile_and_link(hub.client, graphs, tmp_path / "linked", dev)
    manifest.target.hub = SimpleNamespace(link_job=linked.link_job)
    before = sum(name == "create_and_upload_model" for name, _ in hub.calls)
    dp.profile_bundle(bundle, "Samsung Galaxy S26 (Family)", hub=hub.client)
    assert sum(name == "create_and_upload_model" for name, _ in hub.calls) == before
    linked_model = hub.jobs[linked.link_job].link_job.target_model.model_id
    assert [kw["model"] for name, kw in hub.calls if name == "create_inference_job"] == [linked_model] * 2


def test_profile_inputs_stay_inside_the_calibrated_encodings():
    from hycoc.bench.paper.device_profile import profile_inputs
    from hycoc.bundle import Encoding, GraphEntry, TensorSpec

    enc = Encoding(scale=0.001, zero_point=32768, dtype="uint16", bits=16)
    entry = GraphEntry(
        name="slm",
        role="slm",
        file="f",
        inputs=[
            TensorSpec(name="k_ring_0", shape=[1, 1, 64, 8], dtype="float32", encoding=enc),
            TensorSpec(name="mask_sliding", shape=[1, 1, 4, 64], dtype="float32"),
            TensorSpec(name="cos_sliding", shape=[1, 4, 8], dtype="float32"),
            TensorSpec(name="ids", shape=[4], dtype="int64"),
        ],
        outputs=[],
    )
    x = profile_inputs(entry)
    assert -32.768 <= x["k_ring_0"].min() and x["k_ring_0"].max() <= 32.767 and x["k_ring_0"].std() > 10
    assert set(np.unique(x["mask_sliding"])) == {0.0, -1e4} and (x["mask_sliding"][..., :32] == 0).all()
    assert np.abs(x["cos_sliding"]).max() <= 1 and x["ids"].dtype == np.int64 and not x["ids"].any()


needs_qnn = pytest.mark.skipif(
    not __import__("hycoc.targets.qnn_ep", fromlist=["x"]).qnn_installed(),
    reason="onnxruntime-qnn not installed (qnn extra)",
)


@needs_qnn
def test_a_written_epcontext_model_runs_like_the_ep_written_one(tmp_path):
    """`write_epcontext` over a context binary the QNN EP compiled (htp-v81, unshared) loads on the HTP simulator
    and gives the EP-written EPContext model's outputs bit for bit: the wrapper the qai-hub target puts around AI
    Hub's linked binary is the one `hycoc run --backend htp` opens."""
    import onnx
    from hycoc.targets.htp import HtpSession, compile_context
    from hycoc.targets.profiles import get_profile

    q = _qdq_graph(tmp_path / "qdq", "slm", 32)
    cg = compile_context(q, tmp_path / "ep", get_profile("htp-v81"), graph_name="slm")
    ep = onnx.load(str(cg.ctx_model))
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in ep.graph.node[0].attribute}
    ours = target.write_epcontext(
        q,
        tmp_path / "ep" / "ours_ctx.onnx",
        cg.context_binary.name,
        attrs["partition_name"].decode(),
        sdk_version=attrs["ep_sdk_version"].decode(),
    )
    mine = {a.name: onnx.helper.get_attribute_value(a) for a in onnx.load(str(ours)).graph.node[0].attribute}
    assert mine == attrs  # the same attributes the EP writes
    x = {"x": np.random.RandomState(0).uniform(-1, 1, (32, 16)).astype(np.float32)}
    ref = HtpSession(cg.ctx_model).run(x)["y"]
    got = HtpSession(ours).run(x)["y"]
    assert np.array_equal(ref, got) and np.abs(ref).max() > 0


def test_a_qai_hub_build_writes_an_htp_bundle_with_the_jobs_in_its_manifest(
    monkeypatch, tiny_pipeline, tiny_bundle, tmp_path
):
    """The tiny recipe built for qai-hub from the shared pipeline cache (every pass but the target a cache hit),
    through the client `check_setup` makes from QAI_HUB_API_TOKEN (on the canned REST layer): the bundle's graphs
    are EPContext models over one linked binary, the manifest says htp-v81 plus the AI Hub jobs, device and QAIRT,
    and report.json carries each graph's bytes and MACs for the device-time estimate."""
    import io
    import json

    from hycoc.passes import build as b
    from rich.console import Console

    from hycoc.bundle import load_manifest

    hub = CannedHub(monkeypatch)
    monkeypatch.setenv("QAI_HUB_API_TOKEN", "canned")
    p = tiny_pipeline
    b.build_bundle(
        p.recipe, "qai-hub", tmp_path / "bundle", p.cache, b.BuildSettings(console=Console(file=io.StringIO()))
    )
    m = load_manifest(tmp_path / "bundle")
    assert (m.target.name, m.target.backend, m.target.htp_arch) == ("htp-v81", "htp", 81)
    assert m.target.qnn_sdk == QAIRT and m.target.hub.qairt == QAIRT
    assert m.target.hub.device == "Samsung Galaxy S26 (Family)" and m.target.hub.device_validated
    assert sorted(m.target.hub.compile_jobs) == sorted(g.name for g in m.graphs) == ["head", "slm", "slm_decode"]
    assert {g.context_binary for g in m.graphs} == {"hub_context.bin"}
    assert [g.file for g in m.graphs] == ["head_ctx.onnx", "slm_ctx.onnx", "slm_decode_ctx.onnx"]
    assert sum(name == "create_compile_job" for name, _ in hub.calls) == 3
    assert sum(name == "create_link_job" for name, _ in hub.calls) == 1
    costs = json.loads((tmp_path / "bundle" / "report.json").read_text())["graph_costs"]
    assert set(costs) == {"head", "slm", "slm_decode"} and all(c["macs"] > 0 and c["bytes"] > 0 for c in costs.values())
    assert "hub" in json.loads((tmp_path / "bundle" / "manifest.json").read_text())["target"]
    # a cpu bundle's manifest has no hub key at all (other targets' manifests read as before)
    assert "hub" not in json.loads((tiny_bundle.bundle / "manifest.json").read_text())["target"]


def test_hub_device_is_keyed_only_when_it_is_not_the_default():
    """``[target] hub_device`` at its default leaves the recipe hash and cache keys as they were; another phone
    changes them (only the qai-hub target's output depends on it)."""
    from hycoc.recipe import load_recipe

    gemma = load_recipe(Path(__file__).resolve().parents[1] / "recipes" / "gemma4.toml")
    assert gemma.target.hub_device == target.DEFAULT_HUB_DEVICE
    assert "hub_device" not in gemma.target.model_dump()
    other = gemma.model_copy(
        update={"target": gemma.target.model_copy(update={"hub_device": "Samsung Galaxy S25 (Family)"})}
    )
    assert other.target.model_dump()["hub_device"] == "Samsung Galaxy S25 (Family)"
    assert other.content_hash() != gemma.content_hash()
