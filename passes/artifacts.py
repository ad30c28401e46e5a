"""Artifacts: the typed values that flow between compiler passes (DESIGN.md "The pass pipeline").

An artifact is a dataclass with a ``kind`` (the role it plays in a pipeline: ``"tokenizer"``, ``"keep_set"``,
``"onnx_head"``, ...), a ``payload`` (the value itself), a ``save(folder)`` / ``load(kind, folder)`` pair that the
pipeline's cache uses, and a ``content_hash()`` (sha256 hex) that keys every downstream pass's cache entry.
One class may serve several kinds: an `OnnxArtifact` is the head's graph as ``"onnx_head"`` and the SLM's as
``"onnx_slm"``.

Contract of every class (tests rely on it): ``load(kind, folder)`` after ``save(folder)`` gives an artifact
with the same ``content_hash()``; the hash depends only on the content, not on where or when it was made.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np


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
        from tokenizers import Tokenizer

        return cls(kind, Tokenizer.from_file(str(folder / "tokenizer.json")))

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
