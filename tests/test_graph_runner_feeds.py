"""GraphRunner.run's fast paths (docs/device-runtime.md "Host work per round"): an input array that is the very object
the last run validated is passed on without a new check or conversion (buffers kept and updated in place are read as
they are now), any other array is checked and converted as before; outputs are converted only when the session's type
needs it."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hycoc.runtime.graphs import GraphRunner
from onnx import TensorProto, helper

from hycoc.bundle import GraphEntry, GraphIOMismatch, TensorSpec


def runner(half_output: bool = False) -> GraphRunner:
    """y = ring + x, (1, 4) float32 on the CPU EP; with half_output also y16 = float16(y)."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("ring", "x", "y")]
    nodes = [helper.make_node("Add", ["ring", "x"], ["y"])]
    outputs = io[2:]
    spec = [TensorSpec(name=n, shape=[1, 4], dtype="float32") for n in ("ring", "x", "y")]
    if half_output:
        nodes.append(helper.make_node("Cast", ["y"], ["y16"], to=TensorProto.FLOAT16))
        outputs = outputs + [helper.make_tensor_value_info("y16", TensorProto.FLOAT16, [1, 4])]
        spec.append(TensorSpec(name="y16", shape=[1, 4], dtype="float16"))
    model = helper.make_model(
        helper.make_graph(nodes, "g", io[:2], outputs), opset_imports=[helper.make_opsetid("", 17)]
    )
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return GraphRunner.from_session(
        GraphEntry(name="head", role="head", file="head.onnx", inputs=spec[:2], outputs=spec[2:]), session
    )


def test_a_kept_buffer_is_read_as_it_is_now():
    r = runner()
    ring, x = np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32)
    assert r.run({"ring": ring, "x": x})["y"].tolist() == [[1, 1, 1, 1]]
    ring[0] = [1, 2, 3, 4]  # in place: the same object, its new values
    assert r.run({"ring": ring, "x": x})["y"].tolist() == [[2, 3, 4, 5]]
    wide = np.full((1, 4), 0.5)  # float64: converted on every run, never kept as validated
    assert r.run({"ring": ring, "x": wide})["y"].tolist() == [[1.5, 2.5, 3.5, 4.5]]
    wide[0] = 2.0
    assert r.run({"ring": ring, "x": wide})["y"].tolist() == [[3, 4, 5, 6]]


def test_a_new_array_is_checked_again():
    r = runner()
    ring = np.zeros((1, 4), np.float32)
    r.run({"ring": ring, "x": np.ones((1, 4), np.float32)})
    with pytest.raises(GraphIOMismatch, match=r"input x has shape \[4\], the graph takes \[1, 4\]"):
        r.run({"ring": ring, "x": np.ones(4, np.float32)})
    with pytest.raises(GraphIOMismatch, match="no feed for input x"):
        r.run({"ring": ring})


def test_outputs_are_converted_only_where_their_type_needs_it():
    plain, half = runner(), runner(half_output=True)
    assert plain._outputs_as_is and not half._outputs_as_is
    feeds = {"ring": np.full((1, 4), 0.25, np.float32), "x": np.full((1, 4), 1 / 3, np.float32)}
    out = half.run(feeds)
    assert out["y"].dtype == np.float32 and out["y16"].dtype == np.float32
    assert out["y16"].tolist() == out["y"].astype(np.float16).astype(np.float32).tolist()
    assert plain.run(feeds)["y"].tolist() == out["y"].tolist()


def test_run_again_reads_the_last_runs_buffers_as_they_are_now():
    r = runner()
    with pytest.raises(GraphIOMismatch, match="run_again before any run"):
        r.run_again()
    ring, x = np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32)
    assert r.run({"ring": ring, "x": x})["y"].tolist() == [[1, 1, 1, 1]]
    x[0] = [4, 3, 2, 1]  # the MTP Drafter's query buffer, rewritten in place
    assert r.run_again()["y"].tolist() == [[4, 3, 2, 1]]
    wide = np.full((1, 4), 0.5)  # float64: run_again reads the float32 copy the run made
    r.run({"ring": ring, "x": wide})
    wide[0] = 2.0
    assert r.run_again()["y"].tolist() == [[0.5, 0.5, 0.5, 0.5]]
    assert r.calls == 4
