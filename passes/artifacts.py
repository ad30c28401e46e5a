"""Artifacts: the typed values that flow between compiler passes (docs/design.md "The pass pipeline").

An artifact is a dataclass with a ``kind`` (the role it plays in a pipeline: ``"tokenizer"``, ``"keep_set"``,
``"onnx_head"``, ...), a ``payload`` (the value itself), a ``save(folder)`` / ``load(kind, folder)`` pair that the
pipeline's cache uses, and a ``content_hash()`` (sha256 hex) that keys every downstream pass's cache entry.
One class may serve several kinds: an `OnnxArtifact` is the head's graph as ``"onnx_head"`` and the SLM's as
``"onnx_slm"``. The SLM after graph surgery is an `SlmIntegerArtifact` (``"slm_integer"``: integer weights, host
LUTs, rotary tables; passes/slm/surgery.py).

Contract of every class (tests rely on it): ``load(kind, folder)`` after ``save(folder)`` gives an artifact
with the same ``content_hash()``; the hash depends only on the content, not on where or when it was made.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from hycoc.host import EmbeddingLut, RotaryTable, unpack_signed  # noqa: F401  (re-exported)


def hash_folder(folder: Path) -> str:
    """sha256 (hex) over every file under ``folder``: relative paths in sorted order, each with its bytes."""
    h = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(path.relative_to(folder).as_posix().encode() + b"\0")
        with path.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class Artifact:
    """Base of every artifact. Subclasses set ``type_name``, give ``payload`` a type and implement the three
    methods. ``save`` writes only inside ``folder`` (which exists and is empty)."""

    type_name: ClassVar[str] = "artifact"

    kind: str
    payload: Any
    _hash: str | None = field(default=None, init=False, repr=False, compare=False)

    def save(self, folder: Path) -> None:
        raise NotImplementedError

    @classmethod
    def load(cls, kind: str, folder: Path) -> Artifact:
        raise NotImplementedError

    def _compute_hash(self) -> str:
        raise NotImplementedError

    def content_hash(self) -> str:
        """sha256 hex of the content (computed once, then remembered: treat the payload as immutable)."""
        if self._hash is None:
            self._hash = self._compute_hash()
        return self._hash


@dataclass
class FolderArtifact(Artifact):
    """An artifact that is a folder (payload: its Path) with a JSON index file ``INDEX`` naming what it holds.
    Saved by copying the folder; hashed over its files (`hash_folder`). Subclasses set ``type_name`` and ``INDEX``."""

    INDEX: ClassVar[str] = "index.json"

    def index(self) -> dict[str, Any]:
        """The folder's ``INDEX`` file, parsed. Raises OSError / ValueError when it is missing or not JSON."""
        return json.loads((Path(self.payload) / self.INDEX).read_text(encoding="utf-8"))

    def save(self, folder: Path) -> None:
        shutil.copytree(self.payload, folder, dirs_exist_ok=True)

    @classmethod
    def load(cls, kind: str, folder: Path) -> FolderArtifact:
        return cls(kind, Path(folder))

    def _compute_hash(self) -> str:
        return hash_folder(Path(self.payload))


@dataclass
class TokenizerArtifact(Artifact):
    """A `tokenizers.Tokenizer` (payload). Saved as ``tokenizer.json``; hashed over its JSON serialization."""

    type_name: ClassVar[str] = "tokenizer"

    @classmethod
    def from_file(cls, path: str | Path, kind: str = "tokenizer") -> TokenizerArtifact:
        """Read a ``tokenizer.json`` (or a folder holding one). Raises ModelNotFoundError when it is missing."""
        from hycoc.models import load_tokenizer

        return cls(kind, load_tokenizer(path))

    def save(self, folder: Path) -> None:
        (folder / "tokenizer.json").write_text(self.payload.to_str(), encoding="utf-8")

    @classmethod
    def load(cls, kind: str, folder: Path) -> TokenizerArtifact:
        from hycoc.models import load_tokenizer

        return cls(kind, load_tokenizer(folder / "tokenizer.json"))

    def _compute_hash(self) -> str:
        return hashlib.sha256(self.payload.to_str().encode()).hexdigest()


@dataclass
class KeepSetStats:
    """What the keep-set pass chose (paper §3.3, App. A). Counts are distinct ids added by each class, in the
    order specials -> bytes -> forced ranges -> frequency, so they sum to ``size``.

    ``frequent_unseen``: ids of the frequency class that never occur in the corpus (filled by lowest id when the
    corpus has fewer distinct tokens than the free slots). ``coverage`` = ``covered_tokens / assistant_tokens``:
    the share of assistant-turn tokens of the counted corpus whose id is kept.
    """

    size: int
    vocab_size: int
    special: int
    byte: int
    forced: int
    frequent: int
    frequent_unseen: int
    conversations: int
    assistant_tokens: int
    covered_tokens: int
    corpus: str

    @property
    def coverage(self) -> float:
        return self.covered_tokens / self.assistant_tokens


@dataclass
class KeepSetArtifact(Artifact):
    """The keep set: payload is a sorted, duplicate-free int64 array of token ids, shape [size]; ``stats`` says
    where they came from. Saved as ``keep_set.npy`` + ``stats.json``; hashed over the ids only, so a corpus edit
    that picks the same ids does not rerun the passes after it."""

    type_name: ClassVar[str] = "keep_set"

    stats: KeepSetStats | None = None

    def save(self, folder: Path) -> None:
        np.save(folder / "keep_set.npy", np.ascontiguousarray(self.payload, dtype=np.int64), allow_pickle=False)
        if self.stats is not None:
            (folder / "stats.json").write_text(json.dumps(asdict(self.stats), indent=1), encoding="utf-8")

    @classmethod
    def load(cls, kind: str, folder: Path) -> KeepSetArtifact:
        ids = np.load(folder / "keep_set.npy", allow_pickle=False)
        stats_path = folder / "stats.json"
        stats = KeepSetStats(**json.loads(stats_path.read_text(encoding="utf-8"))) if stats_path.exists() else None
        return cls(kind, ids, stats)

    def _compute_hash(self) -> str:
        ids = np.ascontiguousarray(self.payload, dtype="<i8")
        return hashlib.sha256(f"int64{list(ids.shape)}".encode() + ids.tobytes()).hexdigest()


@dataclass
class OnnxArtifact(Artifact):
    """An ONNX graph as an `onnx_ir.Model` (payload). Saved as ``model.onnx`` with its weights in
    ``model.onnx.data`` (external data, so graphs over the 2 GB protobuf limit save too); hashed over exactly
    those two files, written to a temporary folder when the artifact was made in memory."""

    type_name: ClassVar[str] = "onnx"

    MODEL_FILE: ClassVar[str] = "model.onnx"
    DATA_FILE: ClassVar[str] = "model.onnx.data"

    def save(self, folder: Path) -> None:
        import onnx_ir as ir

        ir.save(self.payload, folder / self.MODEL_FILE, external_data=self.DATA_FILE)
        self._hash = hash_folder(folder)

    @classmethod
    def load(cls, kind: str, folder: Path) -> OnnxArtifact:
        import onnx_ir as ir

        artifact = cls(kind, ir.load(folder / cls.MODEL_FILE))
        artifact._hash = hash_folder(folder)
        return artifact

    def _compute_hash(self) -> str:
        with tempfile.TemporaryDirectory(prefix="hycoc-onnx-hash-") as tmp:
            folder = Path(tmp)
            import onnx_ir as ir

            ir.save(self.payload, folder / self.MODEL_FILE, external_data=self.DATA_FILE)
            return hash_folder(folder)


# ---- torch models and the quantized MTP head (added with passes/head/qat.py) ----------------------------------

#: Config keys that say where or how a model was loaded, not what it computes; left out of the content hash so
#: that ``load(save(m))`` hashes like ``m`` (``save_pretrained`` adds ``architectures`` and ``dtype``).
_VOLATILE_CONFIG_KEYS = frozenset(
    {
        "_name_or_path",
        "architectures",
        "dtype",
        "torch_dtype",
        "transformers_version",
        "_commit_hash",
        "_attn_implementation_autoset",
    }
)


def _stable_config(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _stable_config(v) for k, v in value.items() if k not in _VOLATILE_CONFIG_KEYS}
    if isinstance(value, (list, tuple)):
        return [_stable_config(v) for v in value]
    return value


def hash_tensors(h: Any, tensors: dict[str, Any]) -> None:
    """Feed ``tensors`` (name -> torch.Tensor) into the hashlib object ``h``: sorted names, each with its dtype,
    shape and raw bytes (bfloat16 included: hashed through a uint8 view)."""
    import torch

    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{list(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())


@dataclass
class TorchModelArtifact(Artifact):
    """A float transformers model (payload, eval mode): the verifier as ``"torch_verifier"``
    (``Gemma4ForCausalLM``), its MTP head as ``"torch_head"`` (``Gemma4AssistantForCausalLM``).

    Saved with ``save_pretrained`` (config.json + safetensors); loaded with the class named in the config's
    ``architectures`` (dtype as saved, sdpa attention). Hashed over the class name, the config without the keys
    that only record provenance (`_VOLATILE_CONFIG_KEYS`) and every state-dict tensor (name, dtype, shape, bytes).
    """

    type_name: ClassVar[str] = "torch_model"

    @classmethod
    def from_pretrained(cls, path: str | Path, kind: str) -> TorchModelArtifact:
        """Load a local model folder as artifact ``kind``. Raises ModelNotFoundError when there is no
        config.json, ValueError when its ``architectures`` names no transformers class."""
        from hycoc.models import require_model_dir

        folder = require_model_dir(path, kind.removeprefix("torch_"))
        return cls.load(kind, folder)

    def save(self, folder: Path) -> None:
        self.payload.save_pretrained(folder, safe_serialization=True)

    @classmethod
    def load(cls, kind: str, folder: Path) -> TorchModelArtifact:
        import transformers

        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
        names = config.get("architectures") or []
        model_cls = getattr(transformers, names[0], None) if names else None
        if model_cls is None:
            raise ValueError(f"{folder}/config.json: architectures = {names!r} names no transformers model class")
        model = model_cls.from_pretrained(folder, dtype="auto", attn_implementation="sdpa")
        return cls(kind, model.eval())

    def _compute_hash(self) -> str:
        h = hashlib.sha256(type(self.payload).__name__.encode() + b"\0")
        h.update(json.dumps(_stable_config(self.payload.config.to_dict()), sort_keys=True).encode() + b"\0")
        hash_tensors(h, self.payload.state_dict())
        return h.hexdigest()


@dataclass
class QuantizedHead:
    """The MTP head after QAT (paper App. A Table 4), exactly what the static graph and its QDQ export use.

    ``config``: the head's ``Gemma4AssistantConfig.to_dict()``. ``keep_set``: int64 [|V|] token ids; row i of the
    output layer scores ``keep_set[i]``. ``bits``: weight width of every linear layer. ``qweight`` / ``scale``:
    per linear layer (module name, e.g. ``"model.layers.0.self_attn.q_proj"``, ``"lm_head"`` = the untied output
    layer over the keep set) an int8 tensor [out, in] holding integers in [-(2**(bits-1) - 1), 2**(bits-1) - 1]
    and a float32 per-output-channel scale [out, 1]; the weight is exactly ``qweight.float() * scale``.
    ``floats``: every other parameter and persistent buffer the graph reads (norm weights, ``layer_scalar``), float32,
    by state-dict name. ``input_ranges``: the fixed graph input ranges, the ``head_qat.input_range_percentile``
    percentile of |x| over the calibration captures, by input (``"e"``, ``"h"``, ``"h_head"``, ``"k_sliding"``, ...).
    """

    config: dict[str, Any]
    keep_set: Any
    bits: int
    qweight: dict[str, Any]
    scale: dict[str, Any]
    floats: dict[str, Any]
    input_ranges: dict[str, float]


@dataclass
class QuantizedHeadArtifact(Artifact):
    """A `QuantizedHead` (payload). Saved as ``head.safetensors`` (``<linear>.qweight`` int8, ``<linear>.scale``
    float32, ``float.<name>`` float32, ``keep_set`` int64) + ``head.json`` (config, bits, input ranges);
    hashed over the tensors (names, dtypes, shapes, bytes) and the canonical JSON of the rest."""

    type_name: ClassVar[str] = "quantized_head"

    TENSORS_FILE: ClassVar[str] = "head.safetensors"
    META_FILE: ClassVar[str] = "head.json"

    def _tensors(self) -> dict[str, Any]:
        import torch

        q: QuantizedHead = self.payload
        out = {"keep_set": torch.as_tensor(np.asarray(q.keep_set, dtype=np.int64))}
        for name in q.qweight:
            out[f"{name}.qweight"] = q.qweight[name]
            out[f"{name}.scale"] = q.scale[name]
        out.update({f"float.{k}": v for k, v in q.floats.items()})
        return out

    def _meta(self) -> dict[str, Any]:
        q: QuantizedHead = self.payload
        return {
            "config": _stable_config(q.config),
            "bits": q.bits,
            "linears": sorted(q.qweight),
            "input_ranges": q.input_ranges,
        }

    def save(self, folder: Path) -> None:
        from safetensors.torch import save_file

        save_file(
            {k: v.contiguous() for k, v in self._tensors().items()},
            str(folder / self.TENSORS_FILE),
            metadata={"format": "pt"},
        )
        (folder / self.META_FILE).write_text(json.dumps(self._meta(), indent=1, sort_keys=True), encoding="utf-8")

    @classmethod
    def load(cls, kind: str, folder: Path) -> QuantizedHeadArtifact:
        from safetensors.torch import load_file

        tensors = load_file(str(folder / cls.TENSORS_FILE))
        meta = json.loads((folder / cls.META_FILE).read_text(encoding="utf-8"))
        head = QuantizedHead(
            config=meta["config"],
            keep_set=tensors["keep_set"].numpy(),
            bits=meta["bits"],
            qweight={n: tensors[f"{n}.qweight"] for n in meta["linears"]},
            scale={n: tensors[f"{n}.scale"] for n in meta["linears"]},
            floats={k.removeprefix("float."): v for k, v in tensors.items() if k.startswith("float.")},
            input_ranges=meta["input_ranges"],
        )
        return cls(kind, head)

    def _compute_hash(self) -> str:
        h = hashlib.sha256(json.dumps(self._meta(), sort_keys=True).encode() + b"\0")
        hash_tensors(h, self._tensors())
        return h.hexdigest()


# ---- the SLM after graph surgery (passes/slm/surgery.py; paper App. A) --------------------------------------


@dataclass
class IntegerWeight:
    """One linear layer's weight as the checkpoint stores it, unpacked: W = q * scale, bit-exact.

    ``q``: int8 (out, in), every value in the bit width's range [-2**(bits-1), 2**(bits-1) - 1] (int2 values sit
    in an int8 container, one per byte). ``scale``: float32 (out, 1), one per output channel (symmetric, no zero
    point). ``bits``: 2, 4 or 8, the width the checkpoint's bit map gives the module. ``input_scale`` /
    ``output_scale``: the checkpoint's static-range activation scales (SRQ, 8-bit rounding); 0.0 = uncalibrated,
    as transformers reads it (``apply_srq`` is then a no-op).
    """

    q: np.ndarray
    scale: np.ndarray
    bits: int
    input_scale: float = 0.0
    output_scale: float = 0.0

    def dequantize(self) -> np.ndarray:
        """float32 (out, in): q * scale, the weight transformers' QuantizedLinear computes with."""
        return self.q.astype(np.float32) * self.scale


@dataclass
class SlmIntegerModel:
    """The SLM after graph surgery (App. A): explicit integer weights, host LUTs, host rotary tables, config.

    ``config``: the transformers ``Gemma4TextConfig`` as a dict (its ``quantization_config`` included).
    ``weights``: module name (``model.layers.0.self_attn.q_proj``, ``lm_head``) -> `IntegerWeight`.
    ``luts``: ``"embed_tokens"`` and, with per-layer inputs, ``"embed_tokens_per_layer"`` -> `EmbeddingLut`.
    ``floats``: every other tensor of the checkpoint (RMSNorm scales, ``layer_scalar``) by state-dict name,
    float32. ``rotary``: layer type -> `RotaryTable`. ``source``: where it came from (sha256 of the checkpoint files).
    """

    config: dict[str, Any]
    weights: dict[str, IntegerWeight]
    luts: dict[str, EmbeddingLut]
    floats: dict[str, np.ndarray]
    rotary: dict[str, RotaryTable]
    source: dict[str, Any] = field(default_factory=dict)

    def bit_map(self) -> dict[str, int]:
        """Module name -> bit width of every integer weight, in checkpoint order."""
        return {name: w.bits for name, w in self.weights.items()}


@dataclass
class SlmIntegerArtifact(Artifact):
    """kind ``"slm_integer"``: an `SlmIntegerModel` (payload). Saved as ``tensors.safetensors`` (every array,
    under ``weights/<name>/q|scale``, ``luts/<name>/packed|scale``, ``floats/<name>``, ``rotary/<type>/inv_freq``)
    and ``meta.json`` (config, bits, SRQ scales, LUT and rotary constants, source); hashed over those two files."""

    type_name: ClassVar[str] = "slm_integer"

    TENSORS: ClassVar[str] = "tensors.safetensors"
    META: ClassVar[str] = "meta.json"

    def save(self, folder: Path) -> None:
        from safetensors.numpy import save_file

        m: SlmIntegerModel = self.payload
        tensors: dict[str, np.ndarray] = {}
        meta: dict[str, Any] = {
            "config": m.config,
            "source": m.source,
            "weights": {},
            "luts": {},
            "rotary": {},
            "floats": list(m.floats),
        }
        for name, w in m.weights.items():
            tensors[f"weights/{name}/q"], tensors[f"weights/{name}/scale"] = w.q, w.scale
            meta["weights"][name] = {"bits": w.bits, "input_scale": w.input_scale, "output_scale": w.output_scale}
        for name, lut in m.luts.items():
            tensors[f"luts/{name}/packed"], tensors[f"luts/{name}/scale"] = lut.packed, lut.scale
            meta["luts"][name] = {"bits": lut.bits, "dim": lut.dim, "embed_scale": lut.embed_scale}
        for name, value in m.floats.items():
            tensors[f"floats/{name}"] = value
        for layer_type, rot in m.rotary.items():
            tensors[f"rotary/{layer_type}/inv_freq"] = rot.inv_freq
            meta["rotary"][layer_type] = {"attention_scaling": rot.attention_scaling, "head_dim": rot.head_dim}
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(folder / self.TENSORS))
        # insertion order kept (checkpoint order of the weights); the same payload always writes the same bytes
        (folder / self.META).write_text(json.dumps(meta, indent=1), encoding="utf-8")
        self._hash = hash_folder(folder)

    @classmethod
    def load(cls, kind: str, folder: Path) -> SlmIntegerArtifact:
        from safetensors.numpy import load_file

        t = load_file(str(folder / cls.TENSORS))
        meta = json.loads((folder / cls.META).read_text(encoding="utf-8"))
        weights = {
            name: IntegerWeight(t[f"weights/{name}/q"], t[f"weights/{name}/scale"], **info)
            for name, info in meta["weights"].items()
        }
        luts = {
            name: EmbeddingLut(t[f"luts/{name}/packed"], t[f"luts/{name}/scale"], **info)
            for name, info in meta["luts"].items()
        }
        floats = {name: t[f"floats/{name}"] for name in meta["floats"]}
        rotary = {lt: RotaryTable(t[f"rotary/{lt}/inv_freq"], **info) for lt, info in meta["rotary"].items()}
        artifact = cls(kind, SlmIntegerModel(meta["config"], weights, luts, floats, rotary, meta["source"]))
        artifact._hash = hash_folder(folder)
        return artifact

    def _compute_hash(self) -> str:
        with tempfile.TemporaryDirectory(prefix="hycoc-slm-hash-") as tmp:
            self.save(Path(tmp))
            assert self._hash is not None
            return self._hash
