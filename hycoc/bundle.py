"""Bundles: the folder `hycoc build` writes and the device runtime loads (docs/design.md "Bundle").

A bundle is a folder with ``manifest.json`` and the files it lists: graphs (QDQ ONNX for the cpu target,
EPContext ONNX + QNN context binaries for htp targets), the keep set, host LUTs, rotary tables, the tokenizer
and build reports. The manifest holds everything the runtime needs to check before it opens a session: the
schema version, the recipe (name and content hash), the target (HTP arch, SoC, onnxruntime / onnxruntime-qnn /
QNN SDK versions), the round constants (K, D, B, W, λ, ε, sampling; Alg. 1-4), the hand-off's integer width
and six scales, every file's size and sha256, and every graph's inputs and outputs with shapes, dtypes and
quantization encodings.

This module is core: stdlib, pydantic, the recipe's tables (`hycoc.recipe.sections`, whose ranges the round
constants take) and the protocol's messages (numpy); no torch, no onnx, because the phone's runtime imports it.
The build side that reads ONNX graphs is ``passes/bundle_io.py``.

Writing (`BundleWriter`): files go into a hidden temporary sibling of the output folder
(``.NAME.partial-XXXX``); `BundleWriter.commit` hashes them, writes ``manifest.json`` last and renames the
folder into place. An exception before `commit` (or `abort`) removes the temporary folder, so the output folder
is either the old bundle, or absent, or complete. A process killed outright can leave a ``.NAME.partial-*``
sibling behind (never the bundle itself); delete it by hand.

Loading (`load_manifest`): every refusal is a `BundleError` subclass with a one-line message naming the bundle,
the file or key, both values where two disagree, and what to do. The manifest covers itself: ``digest`` is the
sha256 of its canonical JSON (every other key), so an edited value (``round.chain_length``, a hand-off scale, the
recipe hash) is refused like an edited file. It catches edits and corruption, not a forger who recomputes it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Literal, cast, get_args

import annotated_types
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_serializer, model_validator

from hycoc.chat import ChatFormat
from hycoc.protocol.messages import Sampling
from hycoc.recipe import sections as recipe_sections

#: 2: the manifest carries ``digest``, the sha256 of its own canonical content (docs/design.md "Bundle": an edited
#: manifest value is refused like an edited file).
#: 3: ``chat`` carries the chat template whole (the device renders every conversation with it, protocol 5) instead
#: of turn strings cut from it.
SCHEMA_VERSION = 3
MANIFEST = "manifest.json"

#: Suffixes of files a graph loader would open; one of these in the folder but not in the manifest is refused.
GRAPH_SUFFIXES = (".onnx", ".bin", ".data", ".onnx_data")

FileRole = Literal["graph", "context_binary", "external_data", "lut", "keep_set", "tokenizer", "rotary", "report"]
GraphRole = Literal["head", "slm"]

_REBUILD = "rebuild the bundle with `hycoc build`"


# ---- errors -------------------------------------------------------------------------------------------------


class BundleError(Exception):
    """A bundle that cannot be written or loaded. ``str(err)`` is one line: the cause and what to do."""


class BundleNotFound(BundleError):
    """No such folder, or a folder without ``manifest.json``."""


class BundleExists(BundleError):
    """`BundleWriter` was pointed at an existing folder without ``overwrite=True``."""


class ManifestInvalid(BundleError):
    """``manifest.json`` is not JSON, has an unknown key, a missing key or a value of the wrong type."""


class SchemaVersionMismatch(BundleError):
    """The manifest's schema version is not the one this hycoc reads."""


class FileMissing(BundleError):
    """A file the manifest lists is not in the bundle."""


class FileSizeMismatch(BundleError):
    """A listed file has another size than the manifest says."""


class HashMismatch(BundleError):
    """A listed file's sha256 differs from the manifest's."""


class UnlistedFile(BundleError):
    """A graph-like file (``GRAPH_SUFFIXES``) lies in the bundle but the manifest does not list it."""


class TargetMismatch(BundleError):
    """The bundle was built for another target (backend, HTP arch, SoC, QNN SDK, KV bit width) than the device's."""


class GraphIOMismatch(BundleError):
    """A graph's inputs or outputs as onnxruntime reports them differ from the manifest's."""


# ---- the manifest -------------------------------------------------------------------------------------------


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RecipeRef(_Model):
    """The recipe a bundle was built from."""

    name: str = Field(min_length=1, description="recipe.name")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Recipe.content_hash(): sha256 of its canonical JSON")


class HubInfo(_Model):
    """How Qualcomm AI Hub made a ``--target qai-hub`` bundle (`hycoc.targets.qai_hub`): the device as AI Hub names
    it, whether ``get_devices`` confirmed it, the job ids, the QAIRT version AI Hub reported for the linked context
    binary, and each graph's name inside that binary."""

    device: str = Field(min_length=1, description='AI Hub device name, e.g. "Samsung Galaxy S26 (Family)"')
    device_validated: bool = Field(description="False when AI Hub's device list could not be read at build time")
    compile_jobs: dict[str, str] = Field(description="graph -> AI Hub compile job id (QDQ ONNX -> QNN DLC)")
    link_job: str = Field(min_length=1, description="AI Hub link job id (DLCs -> one weight-shared context binary)")
    qairt: str | None = Field(None, description="QAIRT SDK version of the linked context binary, as AI Hub reports it")
    graph_names: dict[str, str] = Field(default_factory=dict, description="graph -> its QNN graph name in the binary")


class TargetInfo(_Model):
    """What the bundle was compiled for, and the tool versions that compiled it (None where not known).

    ``hub``: present only in bundles AI Hub compiled (``--target qai-hub``); absent from the JSON otherwise, so
    manifests of other targets read as before."""

    name: str = Field(min_length=1, description="target profile name: htp-v81, cpu, ...")
    backend: Literal["htp", "cpu"]
    htp_arch: int | None = Field(None, description="Hexagon HTP arch (81 for htp-v81); None for cpu")
    soc_model: str | None = Field(None, description="SoC part name, e.g. SM8850; None for cpu")
    soc_id: int | None = Field(None, description="QNN's numeric SoC model (the EP's soc_model option), e.g. 87")
    onnxruntime: str | None = None
    onnxruntime_qnn: str | None = None
    qnn_sdk: str | None = Field(None, description="QNN / QAIRT SDK version the context binaries were made with")
    hub: HubInfo | None = Field(None, description="AI Hub jobs and device (qai-hub bundles only)")

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        data = handler(self)
        if self.hub is None:
            data.pop("hub", None)
        return data


#: The recipe's tables that hold round constants, by ``[section]`` name (`hycoc.recipe.document.Recipe`'s fields).
ROUND_TABLES: dict[str, type[BaseModel]] = {
    "tree": recipe_sections.Tree,
    "window": recipe_sections.Window,
    "acceptance": recipe_sections.Acceptance,
    "sampling": recipe_sections.Sampling,
}

_BOUNDS = (
    ("gt", annotated_types.Gt),
    ("ge", annotated_types.Ge),
    ("lt", annotated_types.Lt),
    ("le", annotated_types.Le),
)


def _from_recipe(key: str) -> Any:
    """The field of a round constant read from the recipe key ``key`` (``"tree.chain_length"``): that key's range
    and description (`ROUND_TABLES`), no default (a manifest names every constant); the key itself is the field's
    ``recipe`` JSON-schema extra, which `ROUND_SOURCES` reads back. Raises TypeError for a constraint other than a
    bound, so a new kind of range cannot be dropped on the way."""
    section, name = key.split(".")
    source = ROUND_TABLES[section].model_fields[name]
    bounds = {}
    for meta in source.metadata:
        kind = next((k for k, cls in _BOUNDS if isinstance(meta, cls)), None)
        if kind is None:
            raise TypeError(f"recipe key {key}: constraint {meta!r} has no round-constant counterpart")
        bounds[kind] = getattr(meta, kind)
    return Field(description=source.description, json_schema_extra={"recipe": key}, **bounds)


class RoundConstants(_Model):
    """The round's constants (Alg. 1-4, Table 5): the recipe's device-visible keys, named as in the recipe.

    Each field is derived from its recipe key (`_from_recipe`: same range, same description; the type is restated
    for readers and type checkers, and tests/test_round_constants.py holds it to the recipe's), and
    `RoundConstants.from_recipe` fills every field from that key; `ROUND_SOURCES` maps each field to its key."""

    chain_length: int = _from_recipe("tree.chain_length")
    sibling_depth: int = _from_recipe("tree.sibling_depth")
    node_budget: int = _from_recipe("tree.node_budget")
    head_window: int = _from_recipe("window.head_window")
    slm_window: int = _from_recipe("window.slm_window")
    slm_sliding_window: int = _from_recipe("window.slm_sliding_window")
    head_query_position_offset: Literal[-1, 0] = _from_recipe("window.head_query_position_offset")
    depth_cost: float = _from_recipe("tree.depth_cost")
    epsilon: float = _from_recipe("acceptance.epsilon")
    acceptance_mode: Literal["epsilon", "exact"] = _from_recipe("acceptance.mode")
    slm_candidates: int = _from_recipe("tree.slm_candidates")
    slm_passes: Literal[1, 2] = _from_recipe("tree.slm_passes")
    specedge_passes: int = _from_recipe("tree.specedge_passes")
    specedge_nodes: int = _from_recipe("tree.specedge_nodes")
    temperature: float = _from_recipe("sampling.temperature")
    top_k: int = _from_recipe("sampling.top_k")
    top_p: float = _from_recipe("sampling.top_p")
    max_new_tokens: int = _from_recipe("sampling.max_new_tokens")
    seed: int = _from_recipe("sampling.seed")

    @classmethod
    def from_recipe(cls, recipe: Any) -> RoundConstants:
        """The round constants of ``recipe`` (a `hycoc.recipe.Recipe`): each field the value of its recipe key.

        Hand-worked: the default recipe gives chain_length 4 (``tree.chain_length``), acceptance_mode "epsilon"
        (``acceptance.mode``), epsilon 0.005 (``acceptance.epsilon``)."""
        values = {}
        for name, key in ROUND_SOURCES.items():
            section, field = key.split(".")
            values[name] = getattr(getattr(recipe, section), field)
        return cls(**values)

    @property
    def sampling(self) -> Sampling:
        """The protocol's p~ with the bundle's temperature, top-k and top-p (a request's default distribution)."""
        return Sampling(self.temperature, self.top_k, self.top_p)


#: Each round constant's recipe key, ``"section.key"``, in the manifest's field order.
ROUND_SOURCES: dict[str, str] = {
    name: str(cast(dict, info.json_schema_extra)["recipe"]) for name, info in RoundConstants.model_fields.items()
}


class Quantization(_Model):
    """Integer widths the graphs were built with."""

    head_weight_bits: int = Field(ge=2, le=16, description="bits of the head's linear weights")
    slm_activation_bits: int = Field(ge=8, le=16, description="bits of the SLM graph's activations")
    kv_bits: int = Field(ge=8, le=16, description="bits of the SLM's KV ring inputs")


class HandoffInfo(_Model):
    """The hand-off H as it arrives on the wire: ``bits``-wide integers, real value = scale x integer."""

    bits: int = Field(ge=2, le=16)
    hidden: Literal["pre_norm", "post_norm"]
    scale_embedding: float = Field(gt=0)
    scale_hidden: float = Field(gt=0)
    scale_k_sliding: float = Field(gt=0)
    scale_v_sliding: float = Field(gt=0)
    scale_k_full: float = Field(gt=0)
    scale_v_full: float = Field(gt=0)


class LutInfo(_Model):
    """How to read one host embedding LUT (``hycoc.host.EmbeddingLut``): storage width, row width, multiplier."""

    bits: int = Field(description="storage bits per value: 2, 4 or 8")
    dim: int = Field(ge=1, description="values per row")
    embed_scale: float = Field(gt=0, description="Gemma's multiplier applied after dequantization")


class HeadHostInfo(_Model):
    """What the device runtime needs beside the head graph (Alg. 2)."""

    sliding_window: int = Field(ge=1, description="the head's sliding layer reads min(W, this) ring positions")


class SlmHostInfo(_Model):
    """What the device runtime needs beside the SLM tree graph (Alg. 3 line 8)."""

    layer_types: list[str] = Field(description="per decoder layer: sliding_attention or full_attention")
    kv_layers: list[int] = Field(description="layers with a ring (the others share their producer's KV)")
    sliding_window: int = Field(ge=1, description="transformers' sliding_window of the SLM, tokens")
    per_layer_dim: int = Field(ge=0, description="per-layer input width P (0: no per-layer inputs)")
    luts: dict[str, LutInfo] = Field(description="embed_tokens and (with P > 0) embed_tokens_per_layer")


class HostInfo(_Model):
    """The host-side constants of both drafters (model config values the graphs' shapes do not carry)."""

    head: HeadHostInfo
    slm: SlmHostInfo


class FileEntry(_Model):
    """One file of the bundle: path relative to the bundle folder (posix), size in bytes, sha256 hex, role."""

    path: str
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    role: FileRole

    @field_validator("path")
    @classmethod
    def _relative(cls, value: str) -> str:
        check_rel_path(value)
        return value


class Encoding(_Model):
    """A per-tensor linear quantization: real = scale x (q - zero_point), q of ``dtype`` (``bits`` wide)."""

    scale: float = Field(gt=0)
    zero_point: int
    dtype: str = Field(description="integer dtype of q: int4, uint4, int8, uint8, int16, uint16")
    bits: int = Field(ge=2, le=32)


class TensorSpec(_Model):
    """A graph input or output: static shape, numpy dtype name, and its encoding where the graph quantizes it."""

    name: str = Field(min_length=1)
    shape: list[int]
    dtype: str
    encoding: Encoding | None = None


class WeightCount(_Model):
    """Quantized weights of one integer dtype: how many tensors, how many elements."""

    tensors: int = Field(ge=0)
    elements: int = Field(ge=0)


class GraphIO(_Model):
    """What a graph declares: inputs, outputs, weights per integer dtype, node counts per op type."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    weight_bits: dict[str, WeightCount] = Field(default_factory=dict, description="integer dtype -> weights")
    op_counts: dict[str, int] = Field(default_factory=dict, description="op type -> nodes")


class GraphEntry(_Model):
    """One graph of the bundle: its name, role, ONNX file, (htp) the context binary that file points at, and
    what it declares (`GraphIO`'s fields)."""

    name: str = Field(min_length=1)
    role: GraphRole
    file: str
    context_binary: str | None = None
    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    weight_bits: dict[str, WeightCount] = Field(default_factory=dict, description="integer dtype -> weights")
    op_counts: dict[str, int] = Field(default_factory=dict, description="op type -> nodes")


class Manifest(_Model):
    """The content of ``manifest.json``. Unknown keys are errors (extra="forbid"), types are strict."""

    schema_version: int
    created_at: str = Field(description="UTC time of the commit, ISO 8601")
    recipe: RecipeRef
    target: TargetInfo
    round: RoundConstants
    quantization: Quantization
    keep_set_size: int = Field(ge=1, description="tokens in the drafters' restricted vocabulary")
    handoff: HandoffInfo
    host: HostInfo | None = Field(None, description="host-side constants; needed by `hycoc run`")
    chat: ChatFormat | None = Field(
        None,
        description="the checkpoint's chat format (`hycoc.chat.ChatFormat`): stop "
        "ids, turn strings, reasoning channel; needed by `hycoc run`",
    )
    files: list[FileEntry]
    graphs: list[GraphEntry]
    digest: str = Field(
        pattern=r"^[0-9a-f]{64}$",
        description="sha256 of the canonical JSON of every other key "
        "(`content_digest`): an edit of the manifest itself is refused at load",
    )

    def content_digest(self) -> str:
        """sha256 hex of the manifest's canonical JSON without ``digest``: keys sorted, no whitespace, UTF-8
        (`json_digest` of what `BundleWriter` writes)."""
        return json_digest(self.model_dump(mode="json", exclude={"digest"}))

    @model_validator(mode="after")
    def _consistent(self) -> Manifest:
        roles = {}
        for f in self.files:
            if f.path in roles:
                raise ValueError(f"files: {f.path} is listed twice")
            roles[f.path] = f.role
        names = set()
        for g in self.graphs:
            if g.name in names:
                raise ValueError(f"graphs: the name {g.name!r} is used twice")
            names.add(g.name)
            if roles.get(g.file) != "graph":
                raise ValueError(f"graphs[{g.name}].file = {g.file!r} is not listed in files with role 'graph'")
            if g.context_binary is not None and roles.get(g.context_binary) != "context_binary":
                raise ValueError(
                    f"graphs[{g.name}].context_binary = {g.context_binary!r} is not listed in files "
                    "with role 'context_binary'"
                )
        return self

    def file(self, path: str) -> FileEntry:
        """The entry of ``path``; KeyError when the manifest does not list it."""
        for f in self.files:
            if f.path == path:
                return f
        raise KeyError(path)

    def graph(self, name: str) -> GraphEntry:
        """The graph called ``name``; KeyError naming the graphs there are."""
        for g in self.graphs:
            if g.name == name:
                return g
        raise KeyError(f"no graph {name!r} (graphs: {', '.join(g.name for g in self.graphs)})")

    def graph_chain(self, name: str) -> list[GraphEntry]:
        """The graphs that run as graph ``name``: ``[graph(name)]``, or its layer shards ``NAME.s0``, ``NAME.s1``,
        ... in chain order (`shard_graph_name`; one context binary per shard, docs/compiler.md "Layer-sharded SLM").
        KeyError naming the
        graphs there are when neither exists; ManifestInvalid when the shard numbers have a gap."""
        if any(g.name == name for g in self.graphs):
            return [self.graph(name)]
        pattern = re.compile(re.escape(name) + r"\.s(\d+)")
        shards = sorted((int(m.group(1)), g) for g in self.graphs if (m := pattern.fullmatch(g.name)))
        if not shards:
            raise KeyError(f"no graph {name!r} (graphs: {', '.join(g.name for g in self.graphs)})")
        if [k for k, _ in shards] != list(range(len(shards))):
            raise ManifestInvalid(
                f"graph {name}: shards {[g.name for _, g in shards]} are not numbered 0, 1, ...; {_REBUILD}"
            )
        return [g for _, g in shards]

    def chain_entry(self, name: str) -> GraphEntry:
        """Graph ``name`` as one graph (`chain_io`): its entry, or its shards' chain as a stand-in entry."""
        chain = self.graph_chain(name)
        if len(chain) == 1 and chain[0].name == name:
            return chain[0]
        inputs, outputs = chain_io(chain)
        return GraphEntry(name=name, role=chain[0].role, file=chain[0].file, inputs=inputs, outputs=outputs)

    def to_json(self) -> str:
        """``manifest.json`` text: indented JSON with a trailing newline."""
        return self.model_dump_json(indent=2) + "\n"


#: Names Windows reserves for devices in every folder, with any extension (Win32 docs, "Naming Files, Paths, and
#: Namespaces"): a bundle file called ``nul.npy`` would open the null device there.
_WINDOWS_RESERVED = re.compile(r"(con|prn|aux|nul|com[0-9]|lpt[0-9])(\..*)?", re.IGNORECASE)


def check_rel_path(path: str) -> None:
    """Raise ValueError unless ``path`` is a plain relative posix path inside the bundle (not the manifest) that
    means the same file on Windows: no ``:`` (``C:x`` is drive-relative there, ``a:b`` an NTFS stream), no
    reserved device name, no part ending in a dot or space (Windows drops those)."""
    p = PurePosixPath(path)
    parts = path.split("/")
    if (
        not path
        or p.is_absolute()
        or "\\" in path
        or any(part in ("", ".", "..") for part in parts)
        or path == MANIFEST
        or re.search(r"[\x00-\x1f:*?\"<>|]", path)
        or any(_WINDOWS_RESERVED.fullmatch(part) or part.endswith((".", " ")) for part in parts)
    ):
        raise ValueError(
            f"{path!r} is not a relative path inside the bundle (no '..', no leading '/', no ':' or "
            f"other character Windows forbids, no reserved device name, not {MANIFEST})"
        )


def sha256_file(path: str | os.PathLike) -> str:
    """sha256 hex of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# ---- writing ------------------------------------------------------------------------------------------------


class BundleWriter:
    """Write a bundle atomically. Use it as a context manager::

        with BundleWriter(out_dir, overwrite=True) as w:
            w.add_file(tokenizer_json, "tokenizer.json", "tokenizer")
            w.add_graph("head", "head", head_onnx, "head.onnx", io=graph_io_from_onnx(head_onnx))
            manifest = w.commit(recipe=..., target=..., round=..., quantization=..., keep_set_size=...,
                                handoff=...)

    Leaving the block without `commit` (an exception, Ctrl-C) removes the temporary folder. ``overwrite=True``
    replaces an existing ``out_dir`` at commit: the old folder is renamed aside, the new one renamed in, the old
    one deleted, so ``out_dir`` is never a mix of the two.
    """

    def __init__(self, out_dir: str | os.PathLike, *, overwrite: bool = False):
        self.out_dir = Path(out_dir).absolute()
        self.overwrite = overwrite
        if self.out_dir.exists() and not overwrite:
            raise BundleExists(
                f"{self.out_dir} already exists; choose another --out or pass overwrite=True "
                "(the old bundle is replaced only once the new one is complete)"
            )
        self.out_dir.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.partial-", dir=self.out_dir.parent))
        self._roles: dict[str, FileRole] = {}
        self._graphs: list[tuple[str, GraphRole, str, str | None, GraphIO]] = []
        self._done = False

    def __enter__(self) -> BundleWriter:
        return self

    def __exit__(self, *exc) -> None:
        if not self._done:
            self.abort()

    def abort(self) -> None:
        """Drop everything added so far; ``out_dir`` is left as it was."""
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done = True

    def add_file(self, src: str | os.PathLike | bytes, rel_path: str, role: FileRole) -> Path:
        """Copy file ``src`` (or write ``bytes``) to ``rel_path`` inside the bundle; returns where it lies now."""
        self._check_open()
        check_rel_path(rel_path)
        if role not in get_args(FileRole):
            raise ValueError(f"role {role!r}: allowed: {', '.join(get_args(FileRole))}")
        if rel_path in self._roles:
            raise ValueError(f"{rel_path} was already added to the bundle")
        dst = self.tmp / rel_path
        dst.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(src, (bytes, bytearray, memoryview)):
            dst.write_bytes(bytes(src))
        else:
            shutil.copyfile(src, dst)
        self._roles[rel_path] = role
        return dst

    def add_graph(
        self,
        name: str,
        role: GraphRole,
        src: str | os.PathLike | bytes,
        rel_path: str,
        *,
        io: GraphIO,
        context_binary: str | None = None,
    ) -> Path:
        """Add a graph file (role "graph") and its manifest entry. ``io`` comes from
        ``hycoc.passes.bundle_io.graph_io_from_onnx``; ``context_binary`` is the bundle path of the QNN context
        binary the graph points at (add it with ``add_file(..., role="context_binary")``)."""
        if role not in get_args(GraphRole):
            raise ValueError(f"graph role {role!r}: allowed: {', '.join(get_args(GraphRole))}")
        if any(g[0] == name for g in self._graphs):
            raise ValueError(f"a graph named {name!r} was already added")
        dst = self.add_file(src, rel_path, "graph")
        self._graphs.append((name, role, rel_path, context_binary, io))
        return dst

    def commit(
        self,
        *,
        recipe: RecipeRef,
        target: TargetInfo,
        round: RoundConstants,
        quantization: Quantization,
        keep_set_size: int,
        handoff: HandoffInfo,
        host: HostInfo | None = None,
        chat: ChatFormat | None = None,
    ) -> Manifest:
        """Hash every file, write ``manifest.json`` last and rename the folder to ``out_dir``; returns the manifest.

        Raises ManifestInvalid when the entries disagree (a graph's context binary not added, ...); the temporary
        folder is then removed like on any other error inside the ``with`` block.
        """
        self._check_open()
        files = [
            FileEntry(path=p, bytes=(self.tmp / p).stat().st_size, sha256=sha256_file(self.tmp / p), role=r)
            for p, r in sorted(self._roles.items())
        ]
        graphs = [GraphEntry(name=n, role=r, file=f, context_binary=c, **dict(io)) for n, r, f, c, io in self._graphs]
        try:
            manifest = Manifest(
                schema_version=SCHEMA_VERSION,
                created_at=datetime.now(UTC).isoformat(timespec="seconds"),
                recipe=recipe,
                target=target,
                round=round,
                quantization=quantization,
                keep_set_size=keep_set_size,
                handoff=handoff,
                host=host,
                chat=chat,
                files=files,
                graphs=graphs,
                digest="0" * 64,
            )
        except ValidationError as e:
            raise ManifestInvalid(f"bundle {self.out_dir}: cannot write the manifest: {_first_error(e)}") from None
        manifest = manifest.model_copy(update={"digest": manifest.content_digest()})
        with open(self.tmp / MANIFEST, "w", encoding="utf-8") as f:
            f.write(manifest.to_json())
            f.flush()
            os.fsync(f.fileno())
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it 0700
        old = None
        if self.out_dir.exists():
            if not self.overwrite:
                raise BundleExists(f"{self.out_dir} appeared while the bundle was written; nothing was replaced")
            old = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.old-", dir=self.out_dir.parent))
            os.replace(self.out_dir, old / "bundle")
        try:
            os.replace(self.tmp, self.out_dir)
        except BaseException:
            if old is not None:
                os.replace(old / "bundle", self.out_dir)
                shutil.rmtree(old, ignore_errors=True)
            raise
        self._done = True
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        return manifest

    def _check_open(self) -> None:
        if self._done:
            raise BundleError(f"bundle {self.out_dir}: this writer was already committed or aborted")


# ---- loading ------------------------------------------------------------------------------------------------


def load_manifest(bundle_dir: str | os.PathLike, verify: bool = True) -> Manifest:
    """Read ``bundle_dir/manifest.json``; with ``verify``, also check every listed file's size and sha256 and
    that no unlisted graph-like file (``GRAPH_SUFFIXES``) lies in the folder.

    Raises BundleNotFound, ManifestInvalid, SchemaVersionMismatch, FileMissing, FileSizeMismatch, HashMismatch,
    UnlistedFile (all BundleError), each with a one-line message.
    """
    folder = Path(bundle_dir)
    where = f"bundle {folder}"
    if not folder.is_dir():
        raise BundleNotFound(f"{where}: no such folder; build one with `hycoc build RECIPE --out {folder}`")
    path = folder / MANIFEST
    if not path.is_file():
        raise BundleNotFound(f"{where}: not a bundle (no {MANIFEST}); build one with `hycoc build RECIPE --out DIR`")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ManifestInvalid(f"{where}: {MANIFEST} is not readable JSON ({e}); {_REBUILD}") from None
    if not isinstance(data, dict):
        raise ManifestInvalid(f"{where}: {MANIFEST} is not a JSON object; {_REBUILD}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        newer = isinstance(version, int) and version > SCHEMA_VERSION
        raise SchemaVersionMismatch(
            f"{where}: manifest schema version {version}, this hycoc reads version {SCHEMA_VERSION}; "
            + ("upgrade hycoc on this device, or " if newer else "")
            + _REBUILD
        )
    try:
        manifest = Manifest.model_validate_json(path.read_bytes())
    except ValidationError as e:
        raise ManifestInvalid(f"{where}: {MANIFEST}: {_first_error(e)}; {_REBUILD}") from None
    # the digest of what the file says (not of the model re-dumped: a field added to the schema since the build, with
    # its default, is not in an older bundle's file nor in its digest)
    actual = json_digest({k: v for k, v in data.items() if k != "digest"})
    if actual != manifest.digest:
        raise ManifestInvalid(
            f"{where}: {MANIFEST} was edited after the build: its content has sha256 {actual}, "
            f"its digest says {manifest.digest}; {_REBUILD}"
        )
    if verify:
        verify_files(folder, manifest)
    return manifest


def json_digest(body: dict) -> str:
    """sha256 hex of ``body``'s canonical JSON: keys sorted, no whitespace, UTF-8 (the manifest's ``digest``)."""
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def verify_files(folder: str | os.PathLike, manifest: Manifest) -> None:
    """Check every file of ``manifest`` against ``folder`` (exists, size, sha256) and look for unlisted graphs."""
    folder = Path(folder)
    where = f"bundle {folder}"
    for f in manifest.files:
        p = folder / f.path
        if not p.is_file():
            raise FileMissing(
                f"{where}: {f.path} ({f.role}) is listed in {MANIFEST} but missing; {_REBUILD} "
                "or copy the whole folder again"
            )
        size = p.stat().st_size
        if size != f.bytes:
            raise FileSizeMismatch(
                f"{where}: {f.path} is {size} bytes, {MANIFEST} says {f.bytes}; the file is "
                f"truncated or replaced: {_REBUILD}"
            )
        digest = sha256_file(p)
        if digest != f.sha256:
            raise HashMismatch(
                f"{where}: {f.path} has sha256 {digest}, {MANIFEST} says {f.sha256}; the file is "
                f"corrupt or replaced: {_REBUILD}"
            )
    listed = {f.path for f in manifest.files}
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and p.name.endswith(GRAPH_SUFFIXES) and rel not in listed:
            raise UnlistedFile(f"{where}: {rel} is not listed in {MANIFEST}; remove it, or {_REBUILD}")


def check_target(
    manifest: Manifest,
    *,
    backend: str,
    htp_arch: int | None = None,
    soc_model: str | None = None,
    qnn_sdk: str | None = None,
    kv_bits: int | None = None,
) -> None:
    """Refuse a bundle built for another device (docs/design.md "Bundle"): each value given is compared with the
    manifest's.

    Values left None are not checked (e.g. the QNN SDK when the local onnxruntime-qnn does not report one).
    Raises TargetMismatch naming the field, the bundle's value and the device's.
    """
    t = manifest.target
    pairs = [
        ("target backend", t.backend, backend),
        ("HTP arch", t.htp_arch, htp_arch),
        ("SoC", (t.soc_model or "").upper() or None, soc_model.upper() if soc_model else None),
        ("QNN SDK", t.qnn_sdk, qnn_sdk),
        ("KV bit width", manifest.quantization.kv_bits, kv_bits),
    ]
    for what, built, here in pairs:
        if here is not None and built != here:
            raise TargetMismatch(
                f"bundle built for {what} {built}, this device has {here}; rebuild it with "
                f"`hycoc build RECIPE --target ...` for this device"
            )


#: Name prefixes of the tensors layer shards pass to later shards only (`hycoc.passes.slm.graph` "Shards").
SHARD_PASSING = ("hidden_", "per_layer_")


def shard_graph_name(name: str, shard: int) -> str:
    """The bundle's name of layer shard ``shard`` of graph ``name``: ``NAME.sK`` (`Manifest.graph_chain`)."""
    return f"{name}.s{int(shard)}"


def chain_io(chain: list[GraphEntry]) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """The inputs and outputs of shards run in order as one graph: inputs = every shard input no earlier shard
    outputs (the host's feeds, first use first); outputs = the last shard's, then the earlier shards' except the
    tensors only passed between shards (`SHARD_PASSING`: hidden state, projected per-layer inputs), so every
    shard's new K/V rows are outputs even when a later shard also reads them. Raises ManifestInvalid when two
    shards output the same name."""
    inputs: dict[str, TensorSpec] = {}
    made: set[str] = set()
    for g in chain:
        inputs.update((t.name, t) for t in g.inputs if t.name not in made and t.name not in inputs)
        for t in g.outputs:
            if t.name in made:
                raise ManifestInvalid(f"graph {g.name}: output {t.name} is also an earlier shard's output; {_REBUILD}")
            made.add(t.name)
    rest = [t for g in chain[:-1] for t in g.outputs if not t.name.startswith(SHARD_PASSING)]
    return list(inputs.values()), list(chain[-1].outputs) + rest


class ShardFeedMissing(LookupError):
    """A shard input that is neither a host feed nor an earlier shard's output (`shard_feeds`)."""


def shard_feeds(shard: str, input_names: Iterable[str], feeds: Mapping, produced: Mapping) -> dict:
    """The inputs of shard ``shard`` of a chain (`chain_io`, docs/compiler.md "Layer-sharded SLM"), by name: each
    from the earlier shards' ``produced`` outputs or, failing that, from the host ``feeds`` (a chain's host feeds
    are the inputs no earlier shard outputs, so no name is in both). Values are passed through as they are
    (numpy arrays on the device, arrays or tensors in the build). The one resolution behind the runtime's
    `ShardChainRunner` and the build's `run_shard_chain`. Raises ShardFeedMissing naming the shard and the input
    found in neither."""
    out = {}
    for name in input_names:
        if name in produced:
            out[name] = produced[name]
        elif name in feeds:
            out[name] = feeds[name]
        else:
            raise ShardFeedMissing(f"shard {shard}: input {name} is neither a host feed nor an earlier shard's output")
    return out


def check_graph_io(
    graph: GraphEntry, inputs: list[tuple[str, list[int], str]], outputs: list[tuple[str, list[int], str]]
) -> None:
    """Compare a session's ``[(name, shape, dtype)]`` inputs and outputs with the manifest's graph entry.

    Raises GraphIOMismatch naming the graph, the tensor, the manifest's value and the session's.
    """
    for kind, declared, actual in (("input", graph.inputs, inputs), ("output", graph.outputs, outputs)):
        want = [(t.name, list(t.shape), t.dtype) for t in declared]
        got = [(n, list(s), d) for n, s, d in actual]
        if [w[0] for w in want] != [g[0] for g in got]:
            raise GraphIOMismatch(
                f"graph {graph.name}: {kind}s {[w[0] for w in want]} in the manifest, "
                f"{[g[0] for g in got]} in the model; {_REBUILD}"
            )
        for w, g in zip(want, got):
            if w != g:
                raise GraphIOMismatch(
                    f"graph {graph.name}: {kind} {w[0]} is {w[1]} {w[2]} in the manifest, "
                    f"{g[1]} {g[2]} in the model; {_REBUILD}"
                )


def _first_error(e: ValidationError) -> str:
    """One line for the first pydantic error: dotted location, what is wrong."""
    err = e.errors()[0]
    loc = ""
    for part in err["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    if err["type"] == "extra_forbidden":
        return f"unknown key {loc}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg
