"""`hycoc build` on a tiny recipe (passes/build.py, passes/head/export.py, targets/qai_hub.py).

The recipe is written to tmp_path and points at tiny random models saved there: the verifier and head of
tests/tiny_models.py, a 300-id word tokenizer, and a tiny SLM in the pre-quantized Gemma format (the shape of
tests/test_slm_surgery.py's, with the verifier's 300-id vocabulary). QAT runs 2 steps on 2 prompts.
"""

from __future__ import annotations

import io
import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gemma4_fixture import write_generation_config
from hycoc.passes import build as b
from hycoc.passes.head.export import HeadExport, HostTablesArtifact
from hycoc.targets import qai_hub
from rich.console import Console
from test_head_qat import word_tokenizer_folder
from test_slm_surgery import make_tiny_slm
from tiny_models import tiny_head, tiny_verifier

from hycoc.recipe import load_recipe

torch.set_num_threads(1)

RECIPE = """
[recipe]
name = "tiny"
[models]
verifier = "verifier"
head = "head"
slm = "slm"
tokenizer = "tokenizer"
[keep_set]
size = 64
corpus = "corpus.jsonl"
corpus_conversations = 8
always_bytes = false
forced_ranges = []
[tree]
chain_length = 2
sibling_depth = 1
node_budget = 4
slm_candidates = 4
specedge_nodes = 4
[window]
head_window = 16
slm_window = 16
slm_sliding_window = 8
head_query_position_offset = -1      # the toy's conventions (recipes/toy.toml): its seeded SQNR floors and the
head_sliding_window_inclusive = false   # hand-off scales below were measured with them
[head_qat]
steps = 2
warmup_steps = 1
lr = 1e-4
calibration_prompts = 2
eval_prompts = 2
calibration_max_new_tokens = 12
eval_max_new_tokens = 12
max_seq_len = 32
calibration_data = "prompts.jsonl"
[slm_calibration]
prompts = 4
[handoff]
hidden = "pre_norm"
scale_embedding = 0.01
scale_hidden = 0.02
scale_k_sliding = 0.03
scale_v_sliding = 0.03
scale_k_full = 0.03
scale_v_full = 0.03
[target]
name = "cpu"
share_weights = false  # test_runtime_e2e runs this recipe's htp bundle on the x86 simulator (no shared binaries)
[verifier]
device = "cpu"
dtype = "float32"
threads = 1
"""


def make_slm(path):
    """The tiny SLM of tests/test_slm_surgery.py with the verifier's 300-id vocabulary."""
    make_tiny_slm(path, vocab_size=300)


@pytest.fixture(scope="module")
def recipe_path(tmp_path_factory):
    return write_tiny_recipe(tmp_path_factory.mktemp("tiny_recipe"))


def write_tiny_recipe(root):
    """The tiny recipe and its random models under ``root``; returns the recipe's path."""
    verifier = tiny_verifier()
    verifier.save_pretrained(root / "verifier")
    tiny_head(verifier).save_pretrained(root / "head")
    make_slm(root / "slm")
    # a checkpoint's tokenizer folder: the word tokenizer with the toy's Gemma 4 names and chat template; the
    # verifier's generation_config.json lists <eos> and <turn|> (ids 1 and 6, as the tests' tiny models were tuned)
    word_tokenizer_folder(root / "tokenizer")
    write_generation_config(root / "verifier", [1, 6])
    rng = np.random.default_rng(0)

    def words(n):
        return " ".join(f"w{i}" for i in rng.integers(0, 120, n))

    corpus = [
        {"messages": [{"role": "user", "content": words(4)}, {"role": "assistant", "content": words(12)}]}
        for _ in range(8)
    ]
    (root / "corpus.jsonl").write_text("\n".join(json.dumps(c) for c in corpus) + "\n")
    (root / "prompts.jsonl").write_text("\n".join(json.dumps({"prompt": words(5)}) for _ in range(6)) + "\n")
    (root / "recipe.toml").write_text(RECIPE)
    return root / "recipe.toml"


def quiet() -> Console:
    return Console(file=io.StringIO(), width=200)


def test_list_passes_describes_the_chain(recipe_path, tmp_path):
    pipe = b.build_pipeline(load_recipe(recipe_path), "cpu", cache_dir=tmp_path, console=quiet())
    text = pipe.describe()
    names = [p.name for p in pipe.passes]
    assert names[:4] == ["keep_set", "calibration_answers", "head_qat", "head_export"]
    assert names[4] == "qdq_head" and names[-5:] == [
        "slm_surgery",
        "slm_tree_graph",
        "qdq_slm",
        "slm_decode_graph",
        "target_cpu",
    ]
    assert (
        "2. calibration_answers (v1): reads [head_qat], [slm_calibration], [window], [keep_set]; consumes "
        "torch_verifier, tokenizer; produces calibration_answers" in text
    )
    assert (
        "4. head_export (v1): reads [window]; consumes quantized_head, torch_verifier; produces onnx_head, "
        "head_host" in text
    )
    assert text.splitlines()[-1].endswith("produces target_files")
    with pytest.raises(b.BuildError, match="unknown target 'gpu'"):
        b.build_pipeline(load_recipe(recipe_path), "gpu", cache_dir=tmp_path)


def test_until_keep_set_stops_with_the_artifact(recipe_path, tmp_path):
    result = b.build_bundle(
        load_recipe(recipe_path), "cpu", None, tmp_path / "cache", b.BuildSettings(until="keep_set", console=quiet())
    )
    assert [r.pass_name for r in result.pipeline.reports] == ["keep_set"]
    assert result.out_dir is None and (result.stopped_at / "keep_set" / "keep_set.npy").is_file()
    assert len(np.load(result.stopped_at / "keep_set" / "keep_set.npy")) == 64


class Run:
    def __init__(self, pipeline):
        self.pipeline = pipeline


@pytest.fixture(scope="module")
def built(tiny_pipeline):
    """The whole pipeline (target_cpu last), run twice on one cache (the second must be all cache hits): conftest's
    session-wide run of the tiny recipe."""
    assert not (tiny_pipeline.cache / "work").exists()
    return tiny_pipeline.recipe, Run(tiny_pipeline.first), Run(tiny_pipeline.second)


def test_pipeline_runs_to_the_target_and_caches(built):
    _, first, second = built
    names = [r.pass_name for r in first.pipeline.reports]
    assert names[-1] == "target_cpu" and "head_export" in names and "qdq_slm" in names
    assert not any(r.cached for r in first.pipeline.reports)
    assert all(r.cached for r in second.pipeline.reports)
    assert (
        second.pipeline.artifacts["target_files"].content_hash()
        == first.pipeline.artifacts["target_files"].content_hash()
    )
    for r in first.pipeline.reports:
        print(f"{r.pass_name:16s} {r.seconds:7.2f} s  {r.summary}")


def test_head_export_matches_torch_and_writes_host_tables(built):
    recipe, first, _ = built
    report = next(r for r in first.pipeline.reports if r.pass_name == "head_export")
    n = report.numbers
    assert n["top1_agreement"] == 1.0 and n["max_abs_error"]["logits"] < 1e-3
    assert n["input_shapes"]["k_sliding"] == [1, 2, 16, 16] and n["input_shapes"]["k_full"] == [1, 1, 16, 32]
    host = first.pipeline.artifacts["head_host"]
    assert isinstance(host, HostTablesArtifact)
    keep = first.pipeline.artifacts["keep_set"].payload
    t = host.payload
    assert t["keep_set"].tolist() == keep.tolist() and t["embedding_q"].shape == (64, 64)
    assert t["embedding_q"].dtype == np.int8 and t["embedding_scale"].shape == (64, 1)
    assert {"rotary_sliding_inv_freq", "rotary_full_inv_freq", "rotary_sliding_scaling", "rotary_full_scaling"} <= set(
        t
    )
    # E dequantizes to the verifier's scaled input embeddings within half a step per row
    verifier = first.pipeline.artifacts["torch_verifier"].payload
    with torch.no_grad():
        e = verifier.model.embed_tokens(torch.as_tensor(keep)).numpy()
    assert np.all(np.abs(t["embedding_q"] * t["embedding_scale"] - e) <= t["embedding_scale"] / 2 + 1e-6)
    onnx_head = first.pipeline.artifacts["onnx_head"].payload
    assert [v.name for v in onnx_head.graph.inputs][:2] == ["x_hat", "k_sliding"]
    assert HeadExport().produces.keys() == {"onnx_head", "head_host"}


def test_build_bundle_cpu_end_to_end(tiny_pipeline, tmp_path):
    """`build_bundle --target cpu`: the manifest lists every file with its sha256 and each graph's IO; the head's
    QDQ graph in the bundle agrees with the torch head graph (top-1) on the CPU EP; a rebuild is all cache hits.
    Written from the session's pipeline cache (`tiny_pipeline`: the passes ran there once; a cold build through
    the command is `test_cli_list_passes_until_and_full_build`)."""
    import onnxruntime as ort
    from hycoc.passes.head.graph import INPUT_NAMES, HeadGraph
    from hycoc.passes.head.quantize import dequantized_head

    from hycoc.bundle import load_manifest, sha256_file

    recipe = tiny_pipeline.recipe
    out, cache = tmp_path / "bundle", tiny_pipeline.cache
    result = b.build_bundle(recipe, "cpu", out, cache, b.BuildSettings(console=quiet()))
    manifest = result.manifest
    assert load_manifest(out).to_json() == manifest.to_json()
    on_disk = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert on_disk == sorted([f.path for f in manifest.files] + ["manifest.json"])
    assert all(sha256_file(out / f.path) == f.sha256 for f in manifest.files)
    assert {g.name for g in manifest.graphs} == {"head", "slm", "slm_decode"} and manifest.keep_set_size == 64
    head = manifest.graph("head")
    shapes = {t.name: t.shape for t in head.inputs}
    assert shapes["x_hat"] == [1, 1, 128] and shapes["k_sliding"] == [1, 2, 16, 16]
    outs = {t.name: t.shape for t in head.outputs}
    assert shapes["mask_full"] == [1, 1, 1, 16] and outs == {"h_next": [1, 1, 64], "top_index": [1, 1, 2]}
    assert head.weight_bits["int4"].tensors == 13  # every QAT linear at 4 bits
    enc = {t.name: t.encoding for t in head.inputs}
    assert enc["mask_full"] is not None and enc["x_hat"] is not None

    quantized = result.pipeline.artifacts["quantized_head"].payload
    verifier = result.pipeline.artifacts["torch_verifier"].payload
    rebuilt = dequantized_head(quantized)
    graph = HeadGraph(rebuilt).eval()
    # the shipped head has no logits output (its top-2 instead): the target step's checks copy has them
    files = result.pipeline.artifacts["target_files"]
    session = ort.InferenceSession(
        str(files.payload / files.index()["head"]["check_source"]), providers=["CPUExecutionProvider"]
    )
    shipped = ort.InferenceSession(str(out / head.file), providers=["CPUExecutionProvider"])
    # held-out queries as the device feeds them: real hand-offs through the runtime's MTP Drafter
    from hycoc.passes.head.calibration import real_head_calibration

    shapes = {t.name: tuple(t.shape) for t in head.inputs}
    _, held, _ = real_head_calibration(
        verifier, quantized, shapes, result.pipeline.artifacts["tokenizer"].payload, recipe, seed=7
    )
    agree = []
    for feeds in held.samples[:16]:
        got = session.run(["logits"], {n: feeds[n] for n in INPUT_NAMES})[0]
        top2 = shipped.run(["top_index"], {n: feeds[n] for n in INPUT_NAMES})[0]
        assert top2[0, 0, 0] == got.reshape(-1).argmax()  # the shipped graph's best = the checks copy's
        with torch.no_grad():
            want = graph(*[torch.from_numpy(feeds[n]) for n in INPUT_NAMES])[0].numpy()
        agree.append(got.argmax(-1) == want.argmax(-1))
    print(f"head QDQ (CPU EP) vs torch: top-1 {np.mean(agree):.0%} on {len(agree)} held-out device queries")
    # measured 14 of 14 on fresh seeded builds (the same each time): at most one query may flip
    assert len(agree) >= 4 and np.mean(agree) >= (len(agree) - 1) / len(agree)
    report = json.loads((out / "report.json").read_text())
    assert [p["pass_name"] for p in report["passes"]] == [p.pass_name for p in result.pipeline.reports]
    assert set(report["qat_agreement"]) == {"w8_ptq", "w4_ptq", "w4_qat"}
    print(f"report.json head SQNR logits {report['sqnr']['head']['calibration']['outputs']['logits']:.2f} dB")
    assert report["sqnr"]["head"]["calibration"]["outputs"]["logits"] > 39.5  # measured 41.80 dB (seeded build)
    assert "logits" in report["sqnr"]["slm"]["held_out"]["outputs"]
    for r in result.pipeline.reports:
        print(f"{r.pass_name:16s} {r.seconds:7.2f} s  {r.summary}")

    again = b.build_bundle(recipe, "cpu", out, cache, b.BuildSettings(console=quiet()))
    assert all(r.cached for r in again.pipeline.reports)
    assert [f.sha256 for f in again.manifest.files if f.path != "report.json"] == [
        f.sha256 for f in manifest.files if f.path != "report.json"
    ]


# ---- qai-hub ---------------------------------------------------------------------------------------------------


def test_qai_hub_without_package_or_token_fails_with_the_setup_steps(tmp_path):
    def missing(name):
        raise ImportError(name)

    with pytest.raises(qai_hub.QaiHubSetupError) as e:
        qai_hub.check_setup(import_module=missing, environ={}, home=tmp_path)
    assert str(e.value) == (
        "target qai-hub: the qai-hub package is not installed. Set it up with `pip install qai-hub` and "
        "`qai-hub configure --api_token TOKEN` (the token is on https://app.aihub.qualcomm.com under Account -> "
        "Settings -> API Token), or build with --target htp-v81"
    )
    with pytest.raises(qai_hub.QaiHubSetupError) as e:
        qai_hub.check_setup(import_module=lambda name: object(), environ={}, home=tmp_path)
    assert str(e.value) == (
        f"target qai-hub: no API token is configured (no {tmp_path}/.qai_hub/client.ini, no QAI_HUB_API_TOKEN). "
        "Set it up with `pip install qai-hub` and `qai-hub configure --api_token TOKEN` (the token is on "
        "https://app.aihub.qualcomm.com under Account -> Settings -> API Token), or build with --target htp-v81"
    )
    hub = SimpleNamespace(
        ClientConfig=lambda api_token: ("config", api_token), Client=lambda config: ("client", config)
    )
    # a token in the environment: a client configured with it (the qai-hub client reads no token from there itself)
    assert qai_hub.check_setup(import_module=lambda name: hub, environ={"QAI_HUB_API_TOKEN": "x"}, home=tmp_path) == (
        "client",
        ("config", "x"),
    )
    ini = tmp_path / "elsewhere.ini"
    ini.write_text("[api]\napi_token = x\n")
    assert (
        qai_hub.check_setup(import_module=lambda name: hub, environ={"QAIHUB_CLIENT_INI": str(ini)}, home=tmp_path)
        is hub
    )
    (tmp_path / ".qai_hub").mkdir()
    (tmp_path / ".qai_hub" / "client.ini").write_text("[api]\napi_token = x\n")
    assert qai_hub.check_setup(import_module=lambda name: hub, environ={}, home=tmp_path) is hub


# ---- the command ---------------------------------------------------------------------------------------------


def test_cli_list_passes_until_and_full_build(tiny_pipeline, tmp_path, monkeypatch):
    """The command end to end on the tiny recipe. Its cache starts as a copy of the session's `tiny_pipeline` cache
    without the calibration answers and the head QAT, so those two run (their progress lines are checked) and the
    passes after them are cache hits when the rerun reproduces the same artifacts (a cold build costs ~50 s more)."""
    import shutil

    from typer.testing import CliRunner

    from hycoc.cli import app

    recipe_path = tiny_pipeline.path
    shutil.copytree(tiny_pipeline.cache, tmp_path / "c")
    for rerun in ("calibration_answers", "head_qat"):
        shutil.rmtree(tmp_path / "c" / rerun)
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["build", str(recipe_path), "--list-passes"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.splitlines()[0] == "1. keep_set (v1): reads [keep_set]; consumes tokenizer; produces keep_set"
    assert result.stdout.splitlines()[-1].endswith(
        "target_cpu (v2): reads [target]; consumes " + "qdq_head, qdq_slm, qdq_slm_decode" + "; produces target_files"
    )

    result = runner.invoke(app, ["build", str(recipe_path), "--until", "keep_set", "--cache-dir", "c"])
    assert result.exit_code == 0, result.stderr
    line = result.stdout.strip().splitlines()[-1]
    assert line.startswith("stopped after keep_set; its artifacts are in ")
    assert (tmp_path / "c" / "keep_set").is_dir() and not (tmp_path / "bundles").exists()
    assert not (tmp_path / "c" / "head_qat").exists()  # --until stops before the next pass

    result = runner.invoke(app, ["build", str(recipe_path), "--until", "nope", "--cache-dir", "c"])
    assert result.exit_code == 2  # a usage error (docs/commands.md "Exit codes")
    assert result.stderr.strip().startswith(
        "hycoc build: --until nope: no such pass; passes: keep_set, calibration_answers, head_qat"
    )

    result = runner.invoke(app, ["build", str(recipe_path), "--cache-dir", "c", "--out", "b"])
    assert result.exit_code == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith(f"wrote {tmp_path / 'b'}: ")
    # stderr is not a terminal here: progress comes as plain lines, each pass's start and end and its long steps
    # (a line wider than the console continues on indented lines: joined back here)
    log = re.sub(r"\n {17,}", " ", result.stderr).splitlines()
    assert any(
        re.fullmatch(r"\[hycoc \d\d:\d\d:\d\d\] \[1/10\] keep_set: cached, [\d.]+ s \(CPU [\d.]+ s\): kept 64 ids.*", x)
        for x in log
    )
    assert any(
        re.fullmatch(r"\[hycoc [\d:]+\] \[3/10\] head_qat: ran, [\d.]+ s \(CPU [\d.]+ s\): W4 top-1 agreement.*", x)
        for x in log
    )
    assert any(
        re.fullmatch(r"\[hycoc [\d:]+\] head_qat: QAT steps: done 2/2 in [\d.]+ s \(KL [\d.]+\)", x) for x in log
    )
    # 4 + 2 prompts in one batch each, 12 decoding steps each
    assert any(
        x.endswith("calibration_answers: verifier greedy answers, decoding steps: started (24 to do)") for x in log
    )
    assert any(
        re.search(r"calibration_answers: verifier greedy answers, decoding steps: done 24/24 in", x) for x in log
    )
    assert "keep set 64" in result.stdout and (tmp_path / "b" / "manifest.json").is_file()


def test_cli_qai_hub_without_setup_fails_at_once(recipe_path, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from hycoc.cli import app

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("QAI_HUB_API_TOKEN", raising=False)
    result = CliRunner().invoke(
        app, ["build", str(recipe_path), "--target", "qai-hub", "--cache-dir", str(tmp_path / "c")]
    )
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("hycoc build: target qai-hub: ")
    assert "`pip install qai-hub` and `qai-hub configure --api_token TOKEN`" in result.stderr
    assert not (tmp_path / "c").exists()  # nothing ran


@pytest.mark.qnn
def test_htp_target_compiles_both_graphs_into_a_bundle(built, tmp_path):
    """The htp-v81 target step on both QDQ graphs (CPU fallback disabled): EPContext model + context binary in the
    bundle, IO taken from the EPContext model with encodings from its QDQ source."""
    from hycoc.passes.pipeline import PipelineResult
    from hycoc.targets.qnn_ep import versions

    from hycoc.bundle import load_manifest

    if versions().get("onnxruntime-qnn") is None:
        pytest.skip("onnxruntime-qnn is not installed")
    recipe, first, _ = built
    step = b.TargetPass("htp-v81", {"head": "qdq_head", "slm": "qdq_slm"}, tmp_path / "work")
    outputs, report = step.run({k: first.pipeline.artifacts[k] for k in ("qdq_head", "qdq_slm")}, recipe)
    print(report.summary)
    result = PipelineResult(first.pipeline.artifacts | outputs, first.pipeline.reports + [report])
    manifest = b.write_bundle(result, recipe, "htp-v81", tmp_path / "bundle")
    assert load_manifest(tmp_path / "bundle").target.htp_arch == 81
    assert manifest.graph("head").context_binary and manifest.graph("head").weight_bits["int4"].tensors == 13
    slm = manifest.graph("slm")
    assert slm.context_binary and manifest.file(slm.context_binary).role == "context_binary"
    assert slm.op_counts.get("QuantizeLinear", 0) > 0  # from the QDQ source
    assert any(t.encoding is not None for t in slm.inputs)

    # the compiled graph on the x86 HTP simulator against the QDQ graph on the CPU EP
    import onnxruntime as ort
    from hycoc.passes.qdq.quantize import slm_calibration_samples
    from hycoc.passes.slm.graph import FULL, SLIDING, SlmTreeGraph
    from hycoc.targets.htp import run_compiled

    slm_model = first.pipeline.artifacts["slm_integer"].payload
    graph = SlmTreeGraph(
        slm_model,
        first.pipeline.artifacts["keep_set"].payload,
        rows=recipe.tree.node_budget,
        ring={FULL: recipe.window.slm_window, SLIDING: recipe.window.slm_sliding_window},
    )
    sample = slm_calibration_samples(graph, slm_model, 1, seed=5)[0]
    files = outputs["target_files"]
    qdq = ort.InferenceSession(
        str(files.payload / files.index()["slm"]["check_source"]), providers=["CPUExecutionProvider"]
    )
    want = dict(zip([o.name for o in qdq.get_outputs()], qdq.run(None, sample)))
    got = run_compiled(tmp_path / "bundle" / slm.file, sample)
    from hycoc.numerics import sqnr_db

    assert "logits" not in got and "logits" in want  # shipped without it, checked on the copy
    agree = float(np.mean(got["top_index"][..., 0] == want["logits"].argmax(-1)))
    sqnr = {name: sqnr_db(want[name], got[name]) for name in got if name.startswith(("k_new", "v_new"))}
    print(f"HTP simulator vs CPU EP (QDQ): top-1 {agree:.0%}, SQNR dB {sqnr}")
    # measured on two fresh builds of the tiny recipe (seeded: the same both times; onnxruntime-qnn 2.x, QNN SDK
    # v2.51 simulator): top-1 3 of the 4 rows, SQNR of the new K/V 44.4 / 45.0 / 36.5 / 35.8 dB. Floors: no further
    # row may flip (one would be 2 of 4), and 2.8 dB under the worst K/V output.
    assert agree >= 0.75 and min(sqnr.values()) > 33.0

    from hycoc.passes.head.export import comparison_inputs
    from hycoc.passes.head.graph import INPUT_NAMES
    from hycoc.passes.head.quantize import dequantized_head

    quantized = first.pipeline.artifacts["quantized_head"].payload
    config = dequantized_head(quantized).config
    head = ort.InferenceSession(
        str(files.payload / files.index()["head"]["check_source"]), providers=["CPUExecutionProvider"]
    )
    sample = {
        n: x.numpy()
        for n, x in zip(
            INPUT_NAMES,
            comparison_inputs(
                first.pipeline.artifacts["torch_verifier"].payload, config, quantized.keep_set, 16, 8, 2, seed=3
            )[-1],
        )
    }
    want = dict(zip([o.name for o in head.get_outputs()], head.run(None, sample)))
    got = run_compiled(tmp_path / "bundle" / manifest.graph("head").file, sample)
    sqnr = {name: sqnr_db(want[name], got[name]) for name in got if name != "top_index"}
    print(f"head: HTP simulator vs CPU EP (QDQ): SQNR dB {sqnr}")
    # measured 28.0 dB on two fresh builds (seeded, identical); the floor is 2 dB under it
    assert got["top_index"].ravel()[0] == want["logits"].argmax() and sqnr["h_next"] > 26.0
