"""The GPU path's plumbing, checked on the CPU (docs/real-shapes.md "The GPU path"): no GPU is needed.

* The verifier's round loop creates its tensors on the model's device and copies nothing vocabulary-wide to the host
  (torch's meta device: any host copy of a meta tensor fails, every op's output device is watched with a
  ``TorchDispatchMode``; and a ``TorchFunctionMode`` audit of every host transfer of a real round on the CPU).
* The cost model's replay (`hycoc.bench.cost_model.model.request_forwards`) lists exactly the forwards the engine runs
  (`hycoc.bench.cost_model.measure.count_forwards`), for device drafting, Cloud+MTP and server-head.
* `hycoc build --device`: the CPU cache keys are unchanged, a GPU device keys the torch-model passes, the verifier is
  placed on the device in bf16, QAT runs under bf16 autocast on CUDA; asking for CUDA without one is a clear error.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hycoc.verifier.engine import VerifierEngine, verify_tree
from hycoc.verifier.forward import NormTap, prefill
from hycoc.verifier.kv_surgery import compact_kv
from tiny_models import greedy_session, tiny_head, tiny_verifier
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import DynamicCache

from hycoc.bench.cost_model.measure import count_forwards
from hycoc.bench.cost_model.model import Forward, request_forwards
from hycoc.protocol.messages import Sampling

TOY = Path(__file__).resolve().parents[1] / "recipes" / "toy.toml"  # not the working directory's

torch.set_num_threads(1)
VOCAB = 4096  # wide enough that a logits or probability row stands out from every legitimate copy
SCALES = (0.1, 0.1, 0.05, 0.05, 0.05, 0.05)
K, W, CHUNK = 4, 12, 8


@pytest.fixture(scope="module")
def models():
    verifier = tiny_verifier(sharpen=3.0, vocab_size=VOCAB)
    return verifier, tiny_head(verifier)


def make_engine(verifier, head, **kw):
    keep = torch.arange(0, VOCAB, 3)
    return VerifierEngine(
        verifier,
        head=head,
        keep_set=keep,
        head_window=W,
        chain_length=K,
        handoff_scales=SCALES,
        eos_token_ids=set(),
        prefill_chunk=CHUNK,
        **kw,
    )


PROMPT = np.random.default_rng(0).integers(3, VOCAB, 19)


def device_tree(session) -> tuple[list[int], list[int]]:
    """root + a 3-token chain + a sibling of its first token (5 rows)."""
    rng = np.random.default_rng(session.t)
    tokens = [session.root, *rng.integers(3, VOCAB, 4).tolist()]
    return tokens, [-1, 0, 1, 2, 0]


# ---- the cost model's account of a request against what the engine ran -------------------------------------------


@pytest.mark.parametrize(
    "config, place", [("hyco", "device"), ("cloud-mtp", "cloud-mtp"), ("server-head", "server-head")]
)
def test_replay_lists_exactly_the_forwards_the_engine_runs(models, config, place):
    engine = make_engine(*models)
    session = greedy_session(engine, PROMPT, place, 10)
    record = {"config": config, "rows": [], "context": []}
    with count_forwards(engine) as seen:
        session.prefill()
        seq = 0
        while not session.finished:
            tokens, parents = ([session.root], [-1]) if place == "cloud-mtp" else device_tree(session)
            record["context"].append(session.t)
            reply = session.verify(tokens, parents, seq)
            record["rows"].append(len(reply.samples))
            seq += 1
    engine.close()
    replay = [
        f for group in request_forwards(record, chain_length=K, head_window=W, prefill_chunk=CHUNK) for f in group
    ]
    assert seen == replay
    # the prompt's 18 positions [0, 18) in chunks of 8, 8, 2; head steps where the draft place puts them
    assert seen[:3] == [Forward("prefill", 8, 0), Forward("prefill", 8, 8), Forward("prefill", 2, 16)]
    steps = [f for f in seen if f.kind == "head_step"]
    rounds = len(record["rows"])
    assert len(steps) == {"device": 0, "cloud-mtp": K * rounds, "server-head": K * (rounds - 1)}[place]
    if place == "server-head":
        assert {f.context for f in steps} == {W}  # the W window once t' >= W: here from the first round on


# ---- tensors stay on the model's device ---------------------------------------------------------------------------


class DeviceWatch(TorchDispatchMode):
    """Every aten op of a block: its input and output devices. ``host_to_device``: copies from the CPU onto the
    watched device; ``device_to_host``: ops that take a tensor on the device and give one on the CPU; ``on_host``:
    ops computing on the CPU (factory functions without ``device=`` among them)."""

    def __init__(self, device: str):
        super().__init__()
        self.device, self.host_to_device, self.device_to_host, self.on_host = device, [], [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.device.type for a in tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)}
        outs = {a.device.type for a in tree_leaves(out) if isinstance(a, torch.Tensor)}
        name = str(func)
        if ins == {"cpu"} and outs == {self.device}:
            self.host_to_device.append(name)
        elif self.device in ins and "cpu" in outs:
            self.device_to_host.append(name)
        elif "cpu" in outs and "lift_fresh" not in name:
            self.on_host.append(name)
        return out


def test_round_steps_run_on_the_model_device_with_no_hidden_copies():
    """verify_tree, compact_kv and prefill on a meta-device verifier: no op leaves the device, nothing is computed on
    the host, and the only host-to-device copies are a tree's positions and ancestor matrix (2 per verification,
    Alg. 4 line 2) and the kept rows (1 per compaction, whatever the number of layers)."""
    verifier = tiny_verifier().to("meta", torch.bfloat16)  # the GPU path's dtype
    cache, tap = DynamicCache(), NormTap(verifier)
    ids = torch.zeros(6, dtype=torch.long, device="meta")
    with DeviceWatch("meta") as w:
        prefill(verifier, cache, tap, ids, 6, verifier.dtype)  # one chunk: meta ops run as Python references (slow)
    assert (w.host_to_device, w.device_to_host, w.on_host) == ([], [], [])
    parents = np.array([-1, 0, 1, 0, 3])
    with DeviceWatch("meta") as w:
        logits, pre, post = verify_tree(
            verifier, cache, tap, torch.zeros(5, dtype=torch.long, device="meta"), parents, 6, verifier.dtype
        )
    assert logits.device.type == pre.device.type == "meta" and logits.shape == (5, verifier.config.vocab_size)
    assert len(w.host_to_device) == 2 and w.device_to_host == [] and w.on_host == []
    stored = sum(1 for layer in cache.layers if layer.is_initialized and layer.keys.numel())
    assert stored == 4
    with DeviceWatch("meta") as w:
        compact_kv(cache, 6, np.array([1, 2]))
    assert len(w.host_to_device) == 1 and w.device_to_host == [] and w.on_host == []
    assert {layer.keys.shape[-2] for layer in cache.layers if layer.is_initialized} == {9}
    tap.remove()


class HostTransfers(TorchFunctionMode):
    """Every tensor that leaves torch for the host in a block (``.cpu()``, ``.numpy()``, ``.item()``, ``.tolist()``,
    ``int()``, ``float()``, ``bool()``, index use, numpy conversion): (method, elements)."""

    NAMES = {"cpu", "numpy", "item", "tolist", "__int__", "__float__", "__bool__", "__index__", "__array__"}

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.NAMES and args and isinstance(args[0], torch.Tensor):
            frame = sys._getframe(1)
            while frame is not None and "/torch/" in frame.f_code.co_filename:
                frame = frame.f_back
            where = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}" if frame else "?"
            self.seen.append((name, args[0].numel(), where))
        return func(*args, **(kwargs or {}))


#: Host reads that run only when the tensor is already on the CPU (an explicit ``device.type == "cpu"`` branch; the
#: other branch stays on the device): `hycoc.verifier.sampling.top_k_stable` finds the k-th value with
#: numpy.partition on a CPU tensor and with torch.topk on any other device.
CPU_ONLY = {"sampling.py:top_k_stable"}


@pytest.mark.parametrize("place", ["device", "cloud-mtp", "server-head"])
def test_a_round_copies_nothing_vocabulary_wide_to_the_host(models, place):
    """What a round hands to the host is what the reply carries (samples, path, bonus, chain ids, the hand-off's int8
    rows) and scalars: never a logits or probability row (VOCAB wide)."""
    engine = make_engine(*models)
    session = engine.open(
        PROMPT,
        Sampling(temperature=0.7, top_k=64, top_p=0.95),
        seed=3,
        acceptance="epsilon",
        epsilon=0.05,
        draft_place=place,
        max_new_tokens=50,
    )
    session.prefill()
    with HostTransfers() as audit:
        for seq in range(3):
            tokens, parents = ([session.root], [-1]) if place == "cloud-mtp" else device_tree(session)
            reply = session.verify(tokens, parents, seq)
    engine.close()
    assert not reply.finished and audit.seen
    biggest = max(n for _, n, where in audit.seen if where not in CPU_ONLY)
    # the largest legitimate copy: a first hand-off's KV rows (up to W positions x kv heads x head dim)
    assert biggest <= max(W * 2 * 16, 5 * 3), audit.seen
    assert biggest < VOCAB
    import inspect

    from hycoc.verifier.sampling import top_k_stable

    assert 'logits.device.type == "cpu"' in inspect.getsource(top_k_stable)  # the allow-listed read is CPU-only


# ---- hycoc build --device -----------------------------------------------------------------------------------------


def test_cpu_cache_keys_have_no_device_and_a_gpu_keys_the_torch_passes(tmp_path):
    from hycoc.passes.artifacts import Artifact
    from hycoc.passes.build import build_pipeline
    from hycoc.passes.pipeline import canonical_json

    from hycoc.recipe import load_recipe

    class Fixed(Artifact):
        def _compute_hash(self) -> str:
            return "f" * 64

    recipe = load_recipe(TOY)
    default = build_pipeline(recipe, "cpu", cache_dir=tmp_path)
    cpu = build_pipeline(recipe, "cpu", cache_dir=tmp_path, device="cpu")
    cuda = build_pipeline(recipe, "cpu", cache_dir=tmp_path, device="cuda")
    for a, b, c in zip(default.passes, cpu.passes, cuda.passes):
        inputs = {kind: Fixed(kind, None) for kind in a.consumes}
        key = default.cache_key(a, inputs, recipe)
        # the formula without the device setting: a CPU build's keys hold no "device"
        legacy = {
            "pass": a.name,
            "version": a.version,
            "sections": {t: getattr(recipe, t).model_dump(mode="json") for t in a.reads()},
            "params": a.key_material(recipe),
            "files": default.files_key(a, recipe),
            "inputs": {k: "f" * 64 for k in sorted(a.consumes)},
            "tools": default._versions,
            "environment": default._environment,
        }
        assert key == hashlib.sha256(canonical_json(legacy).encode()).hexdigest()
        assert cpu.cache_key(b, inputs, recipe) == key
        runs_torch = bool({"torch_verifier", "torch_head"} & set(a.consumes))
        assert (cuda.cache_key(c, inputs, recipe) != key) is runs_torch, a.name
    assert {"calibration_answers", "head_qat"} <= {
        p.name for p in cuda.passes if {"torch_verifier", "torch_head"} & set(p.consumes)
    }


def test_build_inputs_place_the_verifier_on_the_device_in_bf16(monkeypatch):
    """The meta device stands in for cuda: the verifier moves there in bf16, the head stays as saved."""
    from hycoc.passes import build

    from hycoc.recipe import load_recipe

    recipe = load_recipe(TOY)
    placed = build.build_inputs(recipe, "meta")
    verifier, head = placed["torch_verifier"].payload, placed["torch_head"].payload
    assert verifier.device.type == "meta" and verifier.dtype == torch.bfloat16
    assert head.device.type == "cpu" and head.dtype == torch.float32
    cpu = build.build_inputs(recipe)
    assert cpu["torch_verifier"].payload.device.type == "cpu"
    assert cpu["torch_verifier"].payload.dtype == torch.float32


def test_qat_runs_under_bf16_autocast_on_cuda_only():
    import contextlib
    import warnings

    from hycoc.passes.head.qat import qat_autocast

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": the object still says what it would do
        ctx = qat_autocast(torch.device("cuda"))
    assert isinstance(ctx, torch.autocast) and ctx.device == "cuda" and ctx.fast_dtype == torch.bfloat16
    assert isinstance(qat_autocast(torch.device("cpu")), contextlib.nullcontext)


def test_cuda_without_a_gpu_is_a_clear_error(monkeypatch, tmp_path):
    from typer.testing import CliRunner

    from hycoc.cli import app

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    result = CliRunner().invoke(
        app,
        [
            "build",
            str(TOY),
            "--target",
            "cpu",
            "--device",
            "cuda",
            "--cache-dir",
            str(tmp_path / "cache"),
            "--until",
            "keep_set",
        ],
    )
    assert result.exit_code == 1, result.output
    assert "torch sees no CUDA device" in result.output and "--device cpu" in result.output
    assert not (tmp_path / "cache").exists()  # refused before any pass ran
    result = CliRunner().invoke(app, ["verify-server", str(TOY), "--device", "cuda", "--port", "0"])
    assert result.exit_code == 1 and "torch sees no CUDA device" in result.output
