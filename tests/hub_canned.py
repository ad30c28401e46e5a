"""Qualcomm AI Hub offline: the installed qai-hub client with its REST layer replaced by canned replies.

The client's ``Client`` methods call module functions of ``qai_hub.public_rest_api`` (``api.create_compile_job``,
``api.get_job``, ``api.download_model``, ...) through ``Client._api_call`` -- the lowest layer above ``requests``
that speaks in the service's own protobuf messages (``qai_hub.public_api_pb2``). `CannedHub` puts functions with the
same signatures there and answers with protobuf messages of the shapes the service sends: every job object, status
check, model download and profile the flow sees is the client's own code on those messages. The replies are written
here, not recorded from the live service (nothing here has reached it).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import qai_hub.public_api_pb2 as pb
import qai_hub.public_rest_api as rest
from qai_hub.client import Client, ClientConfig

#: The REST functions the flow reaches (each replaced, signature checked against the real one).
REST_FUNCTIONS = (
    "get_device_list",
    "create_and_upload_model",
    "create_compile_job",
    "create_link_job",
    "create_inference_job",
    "get_job",
    "get_model",
    "download_model",
    "create_and_upload_dataset",
    "get_job_results",
)

S26 = pb.Device(
    name="Samsung Galaxy S26 (Family)",
    os="16",
    attributes=[
        "chipset:qualcomm-snapdragon-8-elite-gen5",
        "hexagon:v81",
        "framework:qnn",
        "framework:onnx",
        "os:android",
        "format:phone",
    ],
)
S25 = pb.Device(
    name="Samsung Galaxy S25 (Family)",
    os="15",
    attributes=["chipset:qualcomm-snapdragon-8-elite", "hexagon:v79", "framework:qnn", "os:android"],
)

QAIRT = "2.41.0.251128"


class CannedHub:
    """A fake AI Hub service state behind the real client (module docstring).

    ``fail``: job kind ("compile", "link", "inference") -> failure reason, to make that kind of job end FAILED.
    ``calls``: (function, kwargs) of every REST call; ``jobs``: job id -> ``pb.Job``; ``binary``: bytes a linked
    model downloads as. ``client``: a ``qai_hub.Client`` on a dummy config whose calls land here.
    """

    def __init__(
        self,
        monkeypatch,
        *,
        fail: dict[str, str] | None = None,
        binary: bytes = b"QNNCTXBIN",
        devices=(S26, S25),
        profile_us=(5210, 5190, 5300, 5250, 6100),
        graph_names: str | None = None,
    ):
        self.fail = dict(fail or {})
        self.binary, self.devices, self.profile_us = binary, list(devices), list(profile_us)
        self.graph_names = graph_names
        self.calls: list[tuple[str, dict]] = []
        self.jobs: dict[str, pb.Job] = {}
        self.models: dict[str, pb.Model] = {}
        self.uploads: dict[str, str] = {}  # model id -> uploaded path
        self.datasets: dict[str, str] = {}
        self._n = 0
        for name in REST_FUNCTIONS:
            real = getattr(rest, name)
            fake = getattr(self, name)
            # the fake takes what the real one takes (same parameter names), so a client call that fits one fits both
            assert list(inspect.signature(real).parameters) == list(inspect.signature(fake).parameters), name
            monkeypatch.setattr(rest, name, fake)
        self.client = Client(
            config=ClientConfig(
                api_url="https://aihub.invalid", web_url="https://aihub.invalid", api_token="canned", verbose=False
            )
        )

    # ---- helpers ----
    def _id(self, prefix: str) -> str:
        self._n += 1
        return f"{prefix}{self._n:06d}"

    def _log(self, function: str, **kw) -> None:
        self.calls.append((function, kw))

    def _target(self, kind: str, inputs: list[str]) -> pb.Model:
        mid = self._id("m")
        meta = pb.ModelMetadata()
        model_type = pb.MODEL_TYPE_QNN_DLC if kind == "compile" else pb.MODEL_TYPE_QNN_CONTEXT_BINARY
        if kind == "link":
            names = self.graph_names
            if names is None:
                names = ",".join(self.models[m].name for m in inputs)
            meta.entries[pb.MODEL_METADATA_KEY_QNN_MODEL_GRAPH_NAMES] = names
            meta.entries[pb.MODEL_METADATA_KEY_QNN_CONTEXT_BIN_HEXAGON_VERSION] = "v81"
        meta.entries[pb.MODEL_METADATA_KEY_QAIRT_SDK_VERSION] = QAIRT
        name = inputs[0] if kind == "compile" else "linked"
        m = pb.Model(model_id=mid, name=name, model_type=model_type, metadata=meta, file_upload_complete=True)
        self.models[mid] = m
        return m

    # ---- the REST functions (same signatures as qai_hub.public_rest_api's) ----
    def get_device_list(self, config, name="", os="", attributes=None, select=False):
        self._log("get_device_list", name=name)
        return pb.DeviceList(devices=[d for d in self.devices if not name or d.name == name])

    def create_and_upload_model(
        self,
        config,
        path,
        model_type,
        name=None,
        project_id=None,
        verbose=None,
        is_directory=False,
        use_acceleration=True,
        logger=None,
    ):
        mid = self._id("m")
        self._log("create_and_upload_model", path=path, model_type=model_type, name=name, is_directory=is_directory)
        self.uploads[mid] = path
        self.models[mid] = pb.Model(model_id=mid, name=name or "", model_type=model_type)
        return pb.CreateUpdateResponse(id=mid, status="OK")

    def _job(self, kind: str, job, id_field: str, state_key: str, inputs: list[str]) -> pb.CreateUpdateResponse:
        jid = self._id("j")
        setattr(job, id_field, jid)
        failed = kind in self.fail
        job.job_state = pb.JOB_STATE_FAILED if failed else pb.JOB_STATE_DONE
        if failed:
            job.failure_reason = self.fail[kind]
        elif kind in ("compile", "link"):
            job.target_model.CopyFrom(self._target(kind, inputs))
        self.jobs[jid] = pb.Job(**{state_key: job})
        return pb.CreateUpdateResponse(id=jid, status="OK")

    def create_compile_job(self, config, compile_job_pb, project_id=None):
        self._log(
            "create_compile_job",
            options=compile_job_pb.options,
            name=compile_job_pb.name,
            model=compile_job_pb.model.model_id,
            devices=[d.name for d in compile_job_pb.devices.devices],
        )
        job = pb.CompileJob()
        job.CopyFrom(compile_job_pb)
        job.device.CopyFrom(compile_job_pb.devices.devices[0])
        stem = Path(self.uploads[compile_job_pb.model.model_id]).name
        for opt in compile_job_pb.options.split("--"):
            if opt.startswith("qnn_graph_name"):
                stem = opt.split()[1]
        return self._job("compile", job, "compile_job_id", "compile_job", [stem])

    def create_link_job(self, config, link_job_pb, project_id=None):
        ids = [m.model_id for m in link_job_pb.models.models]
        self._log("create_link_job", models=ids, device=link_job_pb.device.name, options=link_job_pb.options)
        job = pb.LinkJob()
        job.CopyFrom(link_job_pb)
        return self._job("link", job, "link_job_id", "link_job", ids)

    def create_inference_job(self, config, inference_job_pb, project_id=None):
        self._log(
            "create_inference_job",
            options=inference_job_pb.options,
            model=inference_job_pb.model.model_id,
            profile=inference_job_pb.is_profiling_on,
            dataset=inference_job_pb.dataset.dataset_id,
            device=inference_job_pb.device.name,
        )
        job = pb.InferenceJob()
        job.CopyFrom(inference_job_pb)
        return self._job("inference", job, "inference_job_id", "inference_job", [])

    def get_job(self, config, job_id):
        return self.jobs[job_id]

    def get_model(self, config, model_id):
        return self.models[model_id]

    def download_model(self, config, model_id, file_path, verbose=None, extract_model=False, use_acceleration=True):
        self._log("download_model", model_id=model_id, file_path=file_path)
        Path(file_path).write_bytes(self.binary)
        return file_path

    def create_and_upload_dataset(
        self, config, path, name, permanent=False, project_id=None, verbose=None, use_acceleration=True, logger=None
    ):
        did = self._id("d")
        import h5py
        from qai_hub.util.dataset_entries_converters import h5_to_dataset_entries

        with h5py.File(path, "r") as f:  # the client's own h5 layout, read back by the client's own reader
            self.datasets[did] = {k: [a.shape for a in v] for k, v in h5_to_dataset_entries(f).items()}
        self._log("create_and_upload_dataset", name=name)
        return pb.CreateUpdateResponse(id=did, status="OK")

    def get_job_results(self, config, job_id):
        self._log("get_job_results", job_id=job_id)
        layers = [
            pb.LayerDetail(name=f"l{i}", layer_type_name=t, compute_unit=pb.COMPUTE_UNIT_NPU, execution_time=us)
            for i, (t, us) in enumerate(
                [
                    ("MatMul", 3000),
                    ("Softmax", 900),
                    ("MatMul", 700),
                    ("ElementWiseAdd", 300),
                    ("TopK", 250),
                    ("Gather", 50),
                ]
            )
        ]
        detail = pb.ProfileDetail(
            major_version=1,
            minor_version=2,
            execution_time=self.profile_us[0],
            after_execution_peak_memory=48_000_000,
            layer_details=layers,
            all_execution_times=self.profile_us,
        )
        return pb.JobResult(inference_job_result=pb.InferenceJobResult(inference_job_id=job_id, detail=detail))


class RecordingClient:
    """A ``qai_hub.Client`` wrapper that records every call hycoc makes on it and checks it against the installed
    ``Client`` method's real signature (``inspect.signature(...).bind``, TypeError on a mismatch), then forwards it."""

    def __init__(self, inner):
        self._inner = inner
        self.recorded: list[tuple[str, tuple, dict]] = []

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            inspect.signature(getattr(Client, name)).bind(self._inner, *args, **kwargs)
            self.recorded.append((name, args, kwargs))
            return fn(*args, **kwargs)

        return call

    def __getattr__(self, name):
        return self._wrap(name, getattr(self._inner, name))
