"""The ``qai-hub`` target: a Qualcomm AI Hub compile job for each QDQ graph (DESIGN.md "Targets"; issue 4).

The same QDQ ONNX the ``htp-v81`` target compiles locally is uploaded with ``qai_hub.submit_compile_job`` for the
recipe's phone (``[target].soc_model`` -> an AI Hub chipset attribute, `HUB_CHIPSETS`), compiled to a QNN context
binary (``--target_runtime qnn_context_binary``) and downloaded into the bundle.

Without the ``qai-hub`` package, or without an API token (``~/.qai_hub/client.ini``, written by
``qai-hub configure``, or ``QAI_HUB_API_TOKEN``), `check_setup` fails at once with the exact steps to take
(`QaiHubSetupError`), before anything is uploaded. Nothing here has run against AI Hub from this machine (no
network, no token): the job calls follow the qai-hub client's documented API and are untested.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: AI Hub ``chipset:`` attribute per SoC part name (AI Hub's device list names chipsets, not part numbers).
#: Assumed, not checked against AI Hub's device list from here (no network): verify with ``qai-hub list-devices``.
HUB_CHIPSETS = {
    "SM8850": "qualcomm-snapdragon-8-elite-gen5",
    "SM8750": "qualcomm-snapdragon-8-elite",
    "SM8650": "qualcomm-snapdragon-8gen3",
    "SM8550": "qualcomm-snapdragon-8gen2",
}

SETUP_STEPS = ("pip install qai-hub", "qai-hub configure --api_token TOKEN")


class QaiHubSetupError(RuntimeError):
    """qai-hub is not installed or not configured; the message gives the exact setup steps."""


class QaiHubJobError(RuntimeError):
    """An AI Hub compile job failed or gave no model; the message names the job."""


def setup_message(missing: str) -> str:
    """The one message for a missing package or token (``missing`` says which)."""
    return (f"target qai-hub: {missing}. Set it up with `{SETUP_STEPS[0]}` and `{SETUP_STEPS[1]}` (the token is "
            f"on https://app.aihub.qualcomm.com under Account -> Settings -> API Token), or build with "
            f"--target htp-v81")


def check_setup(*, import_module: Callable[[str], Any] = importlib.import_module,
                environ: Mapping[str, str] | None = None, home: str | Path | None = None) -> Any:
    """The ``qai_hub`` module, when it is importable and a token is configured. Raises QaiHubSetupError."""
    environ = os.environ if environ is None else environ
    try:
        hub = import_module("qai_hub")
    except ImportError:
        raise QaiHubSetupError(setup_message("the qai-hub package is not installed")) from None
    config = Path(home if home is not None else Path.home()) / ".qai_hub" / "client.ini"
    if not environ.get("QAI_HUB_API_TOKEN") and not config.is_file():
        raise QaiHubSetupError(setup_message(f"no API token is configured (no {config}, no QAI_HUB_API_TOKEN)"))
    return hub


@dataclass
class HubCompiled:
    """One graph compiled on AI Hub: the downloaded model file and the job id."""

    model: Path
    job_id: str


def compile_on_hub(qdq_model_path: str | os.PathLike, out_dir: str | os.PathLike, target, *, graph_name: str,
                   hub: Any = None) -> HubCompiled:
    """Submit ``qdq_model_path`` for the recipe's ``[target]`` (``soc_model``), wait, download the context binary
    to ``out_dir/GRAPH.bin``. ``hub``: the qai_hub module (`check_setup` when None). Raises QaiHubSetupError,
    QaiHubJobError, or ValueError for a SoC without an AI Hub chipset."""
    hub = check_setup() if hub is None else hub
    chipset = HUB_CHIPSETS.get(target.soc_model.upper())
    if chipset is None:
        raise ValueError(f"target.soc_model = {target.soc_model!r} has no AI Hub chipset here (known: "
                         f"{', '.join(sorted(HUB_CHIPSETS))})")
    device = hub.Device(attributes=f"chipset:{chipset}")
    job = hub.submit_compile_job(model=str(qdq_model_path), device=device, name=f"hycoc-{graph_name}",
                                 options="--target_runtime qnn_context_binary")
    model = job.get_target_model()  # blocks until the job ends; None when it failed
    if model is None:
        status = job.get_status()
        raise QaiHubJobError(f"AI Hub compile job {job.job_id} for graph {graph_name!r} failed: "
                             f"{getattr(status, 'message', status)}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(model.download(str(out / f"{graph_name}.bin")))
    return HubCompiled(path, str(job.job_id))
