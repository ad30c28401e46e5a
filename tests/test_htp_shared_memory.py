"""The opt-in HTP shared-memory rings (docs/device-runtime.md "Host work per round": the QNN EP's
shared-memory allocator where the platform offers it, so the ring is not copied per call): `load_runtime(...,
htp_shared_memory=True)` refuses a non-htp backend and, where the QNN EP has no allocator (the x86 HTP simulator: no
libcdsprpc.so), stops with SharedMemoryUnavailable before opening anything; a buffer handed out as an OrtValue is bound
once and read in place by every later run."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from hycoc.runtime.client import load_runtime
from hycoc.runtime.graphs import GraphRunner, RunnerSettings, input_buffer
from hycoc.targets import qnn_ep
from onnx import TensorProto, helper

from hycoc.bundle import GraphEntry, GraphIOMismatch, TensorSpec


def test_shared_memory_needs_the_htp_backend(tmp_path):
    with pytest.raises(ValueError, match="needs backend 'htp', not 'cpu'"):
        load_runtime(tmp_path / "no-bundle", "cpu", htp_shared_memory=True)


@pytest.mark.qnn
@pytest.mark.skipif(not qnn_ep.qnn_installed(), reason="onnxruntime-qnn is not installed")
def test_a_platform_without_the_allocator_is_told_what_a_device_needs(tmp_path):
    try:
        qnn_ep.htp_shared_memory_info()
    except qnn_ep.SharedMemoryUnavailable:
        pass
    else:
        pytest.skip("this platform has the HTP shared-memory allocator (a Snapdragon device)")
    with pytest.raises(qnn_ep.SharedMemoryUnavailable, match=r"libcdsprpc\.so.*Run without htp_shared_memory"):
        load_runtime(tmp_path / "no-bundle", "htp", htp_shared_memory=True)  # before the bundle is opened


def add_runner(io_binding: bool) -> GraphRunner:
    """y = ring + x, (1, 4) float32, on the CPU EP, as a `GraphRunner`."""
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [1, 4]) for n in ("ring", "x", "y")]
    model = helper.make_model(
        helper.make_graph([helper.make_node("Add", ["ring", "x"], ["y"])], "g", io[:2], io[2:]),
        opset_imports=[helper.make_opsetid("", 17)],
    )
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    spec = [TensorSpec(name=n, shape=[1, 4], dtype="float32") for n in ("ring", "x", "y")]
    entry = GraphEntry(name="head", role="head", file="head.onnx", inputs=spec[:2], outputs=spec[2:])
    return GraphRunner.from_session(entry, session, settings=RunnerSettings(io_binding=io_binding))


def test_input_buffers_are_host_zeros_without_shared_memory():
    runner = add_runner(io_binding=False)
    ring = input_buffer(runner, "ring")
    assert ring.dtype == np.float32 and ring.shape == (1, 4) and not ring.any()
    with pytest.raises(GraphIOMismatch, match="no float32 or encoded input nope"):
        runner.input_buffer("nope")


def test_a_buffer_held_as_an_ortvalue_is_bound_once_as_that_ortvalue():
    runner = add_runner(io_binding=True)
    ring = np.zeros((1, 4), np.float32)
    backing = np.zeros((1, 4), np.float32)  # stands in for the RPCMem behind the OrtValue: the graph must
    value = ort.OrtValue.ortvalue_from_numpy(backing)  # read it, not a copy of ``ring``
    runner._shared[id(ring)] = (value, ring)
    x = np.ones((1, 4), np.float32)
    assert runner.run({"ring": ring, "x": x})["y"].tolist() == [[1, 1, 1, 1]]
    backing[0] = [1, 2, 3, 4]  # written in place: seen by the next run without re-binding
    assert runner.run({"ring": ring, "x": x})["y"].tolist() == [[2, 3, 4, 5]]
    ring[0] = 9  # the numpy array itself is not what is bound
    assert runner.run({"ring": ring, "x": x})["y"].tolist() == [[2, 3, 4, 5]]
