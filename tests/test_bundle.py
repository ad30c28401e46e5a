"""Bundles (hycoc/bundle.py, passes/bundle_io.py, `hycoc inspect BUNDLE`): write, load back, atomicity, every
refusal, graph IO read from a tiny QDQ ONNX graph, and no torch/onnx in the runtime's import."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import modules_loaded_by_import
from hycoc.passes.bundle_io import graph_io_from_onnx, manifest_sections
from hycoc.targets.profiles import get_profile
from onnx import TensorProto, helper, numpy_helper
from paths import TOY
from typer.testing import CliRunner

from hycoc.bundle import (
    SCHEMA_VERSION,
    BundleExists,
    BundleNotFound,
    FileMissing,
    FileSizeMismatch,
    GraphIO,
    GraphIOMismatch,
    HashMismatch,
    Manifest,
    ManifestInvalid,
    SchemaVersionMismatch,
    TargetMismatch,
    UnlistedFile,
    check_graph_io,
    check_target,
    load_manifest,
)
from hycoc.bundle_writer import BundleWriter
from hycoc.cli import app
from hycoc.recipe import load_recipe

VERSIONS = {"onnxruntime": "1.23.2", "onnxruntime-qnn": "2.7.0", "qnn_sdk": "2.51.0"}


def qdq_graph(path: Path) -> Path:
    """y = DQ(Q(DQ(Q(x)) @ DQ(W_int8) + DQ(b_uint8))): x float [1, 4] quantized uint8 (scale 0.1, zp 128) on the
    way in, y float [1, 3] from an int16 DequantizeLinear (scale 0.25, zp 0) on the way out."""
    init = [
        numpy_helper.from_array(np.array(0.1, np.float32), "x_scale"),
        numpy_helper.from_array(np.array(128, np.uint8), "x_zp"),
        numpy_helper.from_array(np.arange(12, dtype=np.int8).reshape(4, 3), "w_q"),
        numpy_helper.from_array(np.array(0.02, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "w_zp"),
        numpy_helper.from_array(np.array([1, 2, 3], np.uint8), "b_q"),
        numpy_helper.from_array(np.array(0.5, np.float32), "b_scale"),
        numpy_helper.from_array(np.array(0, np.uint8), "b_zp"),
        numpy_helper.from_array(np.array(0.25, np.float32), "y_scale"),
        numpy_helper.from_array(np.array(0, np.int16), "y_zp"),
    ]
    nodes = [
        helper.make_node("QuantizeLinear", ["x", "x_scale", "x_zp"], ["x_q"], name="q_x"),
        helper.make_node("DequantizeLinear", ["x_q", "x_scale", "x_zp"], ["x_dq"], name="dq_x"),
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zp"], ["w"], name="dq_w"),
        helper.make_node("DequantizeLinear", ["b_q", "b_scale", "b_zp"], ["b"], name="dq_b"),
        helper.make_node("MatMul", ["x_dq", "w"], ["xw"], name="matmul"),
        helper.make_node("Add", ["xw", "b"], ["y_f"], name="add"),
        helper.make_node("QuantizeLinear", ["y_f", "y_scale", "y_zp"], ["y_q"], name="q_y"),
        helper.make_node("DequantizeLinear", ["y_q", "y_scale", "y_zp"], ["y"], name="dq_y"),
    ]
    graph = helper.make_graph(
        nodes,
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        init,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


@pytest.fixture(scope="module")
def head_onnx(tmp_path_factory) -> Path:
    return qdq_graph(tmp_path_factory.mktemp("graphs") / "head.onnx")


@pytest.fixture(scope="module")
def sections():
    return manifest_sections(load_recipe(TOY), get_profile("htp-v81"), keep_set_size=300, versions=VERSIONS)


SLM_IO = GraphIO(
    inputs=[{"name": "tokens", "shape": [1, 33], "dtype": "int32"}],
    outputs=[
        {
            "name": "logits",
            "shape": [1, 33, 300],
            "dtype": "float32",
            "encoding": {"scale": 0.125, "zero_point": 0, "dtype": "uint16", "bits": 16},
        }
    ],
    weight_bits={"int4": {"tensors": 7, "elements": 7000}},
    op_counts={"EPContext": 1},
)


def write_bundle(out: Path, head_onnx: Path, sections: dict, **kw) -> Manifest:
    with BundleWriter(out, **kw) as w:
        w.add_file(b'{"model": "toy"}', "tokenizer.json", "tokenizer")
        w.add_file(np.arange(300, dtype=np.int32).tobytes(), "keep_set.bin", "keep_set")
        w.add_file(b"\x01" * 2000, "luts/embedding.i8", "lut")
        w.add_file(b"\x02" * 64, "rotary/head.f32", "rotary")
        w.add_graph("head", "head", head_onnx, "head.onnx", io=graph_io_from_onnx(head_onnx))
        w.add_file(b"\x03" * 1_500_000, "slm_ctx_qnn.bin", "context_binary")
        w.add_graph("slm", "slm", b"fake EPContext model", "slm_ctx.onnx", io=SLM_IO, context_binary="slm_ctx_qnn.bin")
        return w.commit(**sections)


@pytest.fixture
def bundle(tmp_path, head_onnx, sections) -> Path:
    write_bundle(tmp_path / "b", head_onnx, sections)
    return tmp_path / "b"


# ---- graph IO ----------------------------------------------------------------------------------------------


def test_graph_io_from_onnx_reads_shapes_encodings_weights_and_ops(head_onnx):
    io = graph_io_from_onnx(head_onnx)
    (x,), (y,) = io.inputs, io.outputs
    assert (x.name, x.shape, x.dtype) == ("x", [1, 4], "float32")
    assert (x.encoding.scale, x.encoding.zero_point, x.encoding.dtype, x.encoding.bits) == (
        pytest.approx(0.1),
        128,
        "uint8",
        8,
    )
    assert (y.name, y.shape, y.dtype, y.encoding.dtype, y.encoding.bits, y.encoding.scale) == (
        "y",
        [1, 3],
        "float32",
        "int16",
        16,
        0.25,
    )
    assert {k: (v.tensors, v.elements) for k, v in io.weight_bits.items()} == {"int8": (1, 12), "uint8": (1, 3)}
    assert io.op_counts == {"Add": 1, "DequantizeLinear": 4, "MatMul": 1, "QuantizeLinear": 2}


def test_graph_io_refuses_a_dynamic_dim(tmp_path):
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 4])],
    )
    onnx.save(helper.make_model(graph), str(tmp_path / "dyn.onnx"))
    with pytest.raises(ValueError, match="dyn.onnx: x has a dynamic dim 0 \\(batch\\)"):
        graph_io_from_onnx(tmp_path / "dyn.onnx")


# ---- writing and loading -----------------------------------------------------------------------------------


def test_a_written_bundle_loads_back_equal(tmp_path, head_onnx, sections):
    written = write_bundle(tmp_path / "b", head_onnx, sections)
    loaded = load_manifest(tmp_path / "b")
    assert loaded == written
    assert loaded.schema_version == SCHEMA_VERSION
    assert json.loads((tmp_path / "b/manifest.json").read_text())["schema_version"] == SCHEMA_VERSION
    head = loaded.file("head.onnx")
    assert (head.role, head.bytes, head.sha256) == (
        "graph",
        head_onnx.stat().st_size,
        hashlib.sha256(head_onnx.read_bytes()).hexdigest(),
    )
    assert [f.path for f in loaded.files] == sorted(f.path for f in loaded.files)
    assert loaded.graph("slm").context_binary == "slm_ctx_qnn.bin"
    assert loaded.graph("head").inputs[0].encoding.zero_point == 128
    assert (loaded.target.htp_arch, loaded.target.soc_model, loaded.target.soc_id, loaded.target.qnn_sdk) == (
        81,
        "SM8850",
        87,
        "2.51.0",
    )
    recipe = load_recipe(TOY)
    assert loaded.recipe.sha256 == recipe.content_hash()
    assert loaded.round.chain_length == recipe.tree.chain_length
    assert loaded.handoff.scale_hidden == recipe.handoff.scale_hidden
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]  # no temporary folders left


def test_an_exception_before_commit_leaves_no_half_bundle(tmp_path):
    with pytest.raises(RuntimeError, match="interrupted"):
        with BundleWriter(tmp_path / "b") as w:
            w.add_file(b"x", "tokenizer.json", "tokenizer")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []


def test_commit_refuses_a_graph_whose_context_binary_was_not_added(tmp_path, sections):
    with pytest.raises(ManifestInvalid, match="graphs\\[slm\\].context_binary = 'slm.bin' is not listed"):
        with BundleWriter(tmp_path / "b") as w:
            w.add_graph("slm", "slm", b"m", "slm.onnx", io=SLM_IO, context_binary="slm.bin")
            w.commit(**sections)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("rel", ["../x", "/abs", "a/../b", "manifest.json", ""])
def test_add_file_refuses_paths_outside_the_bundle(tmp_path, rel):
    with BundleWriter(tmp_path / "b") as w, pytest.raises(ValueError, match="not a relative path inside"):
        w.add_file(b"x", rel, "report")


def test_an_existing_bundle_is_refused_unless_overwrite_then_replaced(bundle, head_onnx, sections):
    with pytest.raises(BundleExists, match="already exists"):
        BundleWriter(bundle)
    (bundle / "old.txt").write_text("from the old bundle")
    write_bundle(bundle, head_onnx, sections, overwrite=True)
    assert not (bundle / "old.txt").exists()
    load_manifest(bundle)
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["b"]


def test_overwrite_keeps_the_old_bundle_when_the_new_one_fails(bundle):
    before = load_manifest(bundle)
    with pytest.raises(RuntimeError):
        with BundleWriter(bundle, overwrite=True) as w:
            w.add_file(b"x", "tokenizer.json", "tokenizer")
            raise RuntimeError("pass failed")
    assert load_manifest(bundle) == before
    assert sorted(p.name for p in bundle.parent.iterdir()) == ["b"]


# ---- refusals ----------------------------------------------------------------------------------------------


def edit_manifest(bundle: Path, change, redigest: bool = True) -> None:
    """Edit manifest.json; ``redigest`` recomputes its digest so that the edit itself is what gets checked."""
    data = json.loads((bundle / "manifest.json").read_text())
    change(data)
    if redigest and "digest" in data:
        body = {k: v for k, v in data.items() if k != "digest"}
        data["digest"] = hashlib.sha256(
            json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
        ).hexdigest()
    (bundle / "manifest.json").write_text(json.dumps(data))


@pytest.mark.parametrize(
    "change",
    [
        lambda d: d["round"].update(chain_length=d["round"]["chain_length"] + 1),
        lambda d: d["handoff"].update(scale_hidden=d["handoff"]["scale_hidden"] * 2),
        lambda d: d["recipe"].update(sha256="0" * 64),
    ],
)
def test_an_edited_manifest_value_is_refused_by_its_digest(bundle, change):
    digest = load_manifest(bundle).digest
    edit_manifest(bundle, change, redigest=False)
    with pytest.raises(ManifestInvalid) as e:
        load_manifest(bundle, verify=False)
    assert "manifest.json was edited after the build: its content has sha256 " in str(e.value)
    assert f"its digest says {digest}; rebuild the bundle with `hycoc build`" in str(e.value)


def test_the_digest_is_the_sha256_of_the_canonical_manifest(bundle):
    data = json.loads((bundle / "manifest.json").read_text())
    body = json.dumps(
        {k: v for k, v in data.items() if k != "digest"}, sort_keys=True, separators=(",", ":"), ensure_ascii=False
    )
    assert data["digest"] == hashlib.sha256(body.encode()).hexdigest() == load_manifest(bundle).content_digest()


def test_a_tampered_file_is_refused_naming_both_hashes(bundle):
    listed = load_manifest(bundle).file("luts/embedding.i8").sha256
    (bundle / "luts/embedding.i8").write_bytes(b"\x02" * 2000)
    actual = hashlib.sha256(b"\x02" * 2000).hexdigest()
    with pytest.raises(HashMismatch) as e:
        load_manifest(bundle)
    assert str(e.value) == (
        f"bundle {bundle}: luts/embedding.i8 has sha256 {actual}, manifest.json says {listed}; "
        "the file is corrupt or replaced: rebuild the bundle with `hycoc build`"
    )
    assert load_manifest(bundle, verify=False).file("luts/embedding.i8").sha256 == listed


def test_a_truncated_file_is_refused_naming_both_sizes(bundle):
    (bundle / "slm_ctx_qnn.bin").write_bytes(b"\x03" * 10)
    with pytest.raises(FileSizeMismatch, match="slm_ctx_qnn.bin is 10 bytes, manifest.json says 1500000"):
        load_manifest(bundle)


def test_a_missing_file_is_refused(bundle):
    (bundle / "rotary/head.f32").unlink()
    with pytest.raises(FileMissing, match=r"rotary/head.f32 \(rotary\) is listed in manifest.json but missing"):
        load_manifest(bundle)


@pytest.mark.parametrize("name", ["extra.onnx", "sub/old_ctx_qnn.bin"])
def test_an_unlisted_graph_file_is_refused(bundle, name):
    (bundle / name).parent.mkdir(exist_ok=True)
    (bundle / name).write_bytes(b"stale")
    with pytest.raises(UnlistedFile, match=f"{name} is not listed in manifest.json"):
        load_manifest(bundle)


@pytest.mark.parametrize("version,hint", [(4, "; upgrade hycoc on this device, or rebuild"), (2, "; rebuild")])
def test_another_schema_version_is_refused_naming_both(bundle, version, hint):
    edit_manifest(bundle, lambda d: d.update(schema_version=version, field_of_the_future=1))
    with pytest.raises(SchemaVersionMismatch) as e:
        load_manifest(bundle)
    assert f"manifest schema version {version}, this hycoc reads version {SCHEMA_VERSION}{hint}" in str(e.value)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d.update(colour="red"), "unknown key colour"),
        (lambda d: d["graphs"][0]["inputs"][0].update(layout="nchw"), "unknown key graphs[0].inputs[0].layout"),
        (lambda d: d["round"].update(chain_length="4"), "round.chain_length: Input should be a valid integer"),
        (
            lambda d: d["files"][0].update(path="../tokenizer.json"),
            "files[0].path: '../tokenizer.json' is not a relative",
        ),
        (lambda d: d.pop("handoff"), "handoff: Field required"),
    ],
)
def test_a_bad_manifest_is_refused_naming_the_key(bundle, change, message):
    edit_manifest(bundle, change)
    with pytest.raises(ManifestInvalid) as e:
        load_manifest(bundle)
    assert message in str(e.value) and str(e.value).endswith("rebuild the bundle with `hycoc build`")
    assert "\n" not in str(e.value)


def test_no_folder_no_manifest_and_bad_json_are_refused(tmp_path):
    with pytest.raises(BundleNotFound, match="no such folder"):
        load_manifest(tmp_path / "none")
    with pytest.raises(BundleNotFound, match=r"not a bundle \(no manifest.json\)"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{")
    with pytest.raises(ManifestInvalid, match="manifest.json is not readable JSON"):
        load_manifest(tmp_path)


def test_check_target_and_graph_io_name_both_values(bundle):
    m = load_manifest(bundle)
    check_target(m, backend="htp", htp_arch=81, soc_model="sm8850", qnn_sdk="2.51.0", kv_bits=m.quantization.kv_bits)
    with pytest.raises(TargetMismatch, match="bundle built for HTP arch 81, this device has 79"):
        check_target(m, backend="htp", htp_arch=79)
    with pytest.raises(TargetMismatch, match="bundle built for KV bit width 8, this device has 16"):
        check_target(m, backend="htp", kv_bits=16)
    check_graph_io(m.graph("head"), [("x", [1, 4], "float32")], [("y", [1, 3], "float32")])
    with pytest.raises(
        GraphIOMismatch,
        match=r"graph head: input x is \[1, 4\] float32 in the manifest, "
        r"\[1, 8\] float32 in the model",
    ):
        check_graph_io(m.graph("head"), [("x", [1, 8], "float32")], [("y", [1, 3], "float32")])


# ---- hycoc inspect -----------------------------------------------------------------------------------------


def test_inspect_prints_files_graphs_round_and_handoff(bundle):
    result = CliRunner().invoke(app, ["inspect", str(bundle)], terminal_width=200)
    assert result.exit_code == 0, result.output
    out = result.stdout
    recipe = load_recipe(TOY)
    for text in (
        "target htp-v81",
        "HTP v81 SM8850 (soc id 87)",
        "QNN SDK 2.51.0",
        "keep set 300 tokens",
        "slm_ctx_qnn.bin",
        "context_binary",
        "1.500",
        "graph head (head): head.onnx",
        "graph slm (slm): slm_ctx.onnx -> slm_ctx_qnn.bin",
        "uint8 scale 0.1 zp 128",
        "int16 scale 0.25 zp 0",
        "int8: 1 tensors / 12 weights",
        "int4: 7 tensors / 7,000 weights",
        "MatMul 1",
        "QuantizeLinear 2",
        "K (chain_length)",
        "hand-off: int8",
        f"{recipe.handoff.scale_hidden:.6g}",
    ):
        assert text in out, text


def test_inspect_of_a_bundle_fits_80_columns_redirected(bundle):
    """Tables fit COLUMNS (80) without an ellipsis; one-line messages are not wrapped when redirected (issue 39: a
    sentence split at the width is worse than a long line in a file)."""
    result = CliRunner().invoke(app, ["inspect", str(bundle)], terminal_width=200, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    table = [line for line in lines if line[:1] in "┏┃┡│└╇┗━"]
    assert table and max(map(len, table)) <= 80 and "…" not in result.stdout
    assert lines[0].startswith("bundle of recipe toy") and lines[0].endswith(")")  # the first line whole
    cells = {c.strip() for line in lines for c in line.split("│")}
    for text in (
        "slm_ctx_qnn.bin",
        "head_query_position_offset",
        "head weight bits / SLM activation bits / KV bits",
        "uint8 scale 0.1 zp 128",
        "k_sliding",
        "v_full",
    ):
        assert text in cells, text


def test_inspect_json_round_trips(bundle):
    result = CliRunner().invoke(app, ["inspect", str(bundle), "--json"])
    assert result.exit_code == 0, result.output
    assert Manifest.model_validate_json(result.stdout) == load_manifest(bundle)


def test_inspect_a_corrupt_bundle_exits_1_with_the_reason(bundle):
    (bundle / "tokenizer.json").write_text("{}")
    result = CliRunner().invoke(app, ["inspect", str(bundle)])
    assert result.exit_code == 1
    assert result.stderr.startswith(f"hycoc inspect: bundle {bundle}: tokenizer.json is 2 bytes, manifest.json says")
    assert result.stdout == ""


def test_the_runtime_side_imports_neither_torch_nor_onnx():
    # hycoc.recipe is not banned: the bundle takes its round constants' ranges from the recipe's tables
    # (hycoc.recipe.sections), and importing a module of the package runs the package's __init__ (the public face)
    assert modules_loaded_by_import("hycoc.bundle", ("torch", "onnx", "onnxruntime", "transformers")) == []


def test_shard_feeds_resolve_every_shard_input_from_the_chains_host_inputs_and_earlier_outputs():
    """`shard_feeds` (the one resolution behind the runtime's ShardChainRunner and the build's run_shard_chain):
    given exactly the host inputs `chain_io` names, every shard's inputs come from them or an earlier shard."""
    from hycoc.bundle import GraphEntry, ShardFeedMissing, TensorSpec, chain_io, shard_feeds

    def spec(name):
        return TensorSpec(name=name, shape=[1, 4], dtype="float32")

    def entry(name, inputs, outputs):
        return GraphEntry(
            name=name,
            role="slm",
            file=f"{name}.bin",
            inputs=[spec(n) for n in inputs],
            outputs=[spec(n) for n in outputs],
        )

    chain = [
        entry("slm.s0", ["inputs_embeds", "mask_full"], ["hidden_2", "per_layer_2_4", "k_new_0"]),
        entry("slm.s1", ["hidden_2", "per_layer_2_4", "mask_full"], ["logits", "k_new_2"]),
    ]
    host_inputs, _ = chain_io(chain)
    feeds = {t.name: f"host:{t.name}" for t in host_inputs}
    assert sorted(feeds) == ["inputs_embeds", "mask_full"]
    made: dict[str, str] = {}
    for g in chain:
        x = shard_feeds(g.name, [t.name for t in g.inputs], feeds, made)
        assert list(x) == [t.name for t in g.inputs]
        made.update({t.name: f"{g.name}:{t.name}" for t in g.outputs})
    assert x == {"hidden_2": "slm.s0:hidden_2", "per_layer_2_4": "slm.s0:per_layer_2_4", "mask_full": "host:mask_full"}
    with pytest.raises(ShardFeedMissing, match="shard slm.s1: input hidden_2 is neither a host feed nor an earlier"):
        shard_feeds("slm.s1", ["hidden_2"], feeds, {})
