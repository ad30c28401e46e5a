"""Bundles: the folder `hycoc build` writes and the device runtime loads (docs/design.md "Bundle").

A bundle is a folder with ``manifest.json`` and the files it lists: graphs (QDQ ONNX for the cpu target,
EPContext ONNX + QNN context binaries for htp targets), the keep set, host LUTs, rotary tables, the tokenizer
and build reports. The manifest holds everything the runtime needs to check before it opens a session: the
schema version, the recipe (name and content hash), the target (HTP arch, SoC, onnxruntime / onnxruntime-qnn /
QNN SDK versions), the round constants (K, D, B, W, λ, ε, sampling; Alg. 1-4), the hand-off's integer width
and six scales, every file's size and sha256, and every graph's inputs and outputs with shapes, dtypes and
quantization encodings.

This module is core: stdlib, pydantic, the manifest's constants (`hycoc.bundle_constants`: the round constants,
whose ranges are the recipe's, integer widths, hand-off scales, host constants) and the chat format; no torch, no
onnx, because the phone's runtime imports it. The build side that reads ONNX graphs is ``passes/bundle_io.py``.

Writing (`hycoc.bundle_writer.BundleWriter`): files go into a hidden temporary sibling of the output folder,
``manifest.json`` is written last and the folder renamed into place, so the output folder is either the old bundle,
or absent, or complete.

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
from collections.abc import Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_serializer, model_validator

from hycoc.bundle_constants import HandoffInfo, HostInfo, ManifestModel, Quantization, RoundConstants
from hycoc.chat import ChatFormat

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


class RecipeRef(ManifestModel):
    """The recipe a bundle was built from."""

    name: str = Field(min_length=1, description="recipe.name")
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="Recipe.content_hash(): sha256 of its canonical JSON")


class HubInfo(ManifestModel):
    """How Qualcomm AI Hub made a ``--target qai-hub`` bundle (`hycoc.targets.qai_hub`): the device as AI Hub names
    it, whether ``get_devices`` confirmed it, the job ids, the QAIRT version AI Hub reported for the linked context
    binary, and each graph's name inside that binary."""

    device: str = Field(min_length=1, description='AI Hub device name, e.g. "Samsung Galaxy S26 (Family)"')
    device_validated: bool = Field(description="False when AI Hub's device list could not be read at build time")
    compile_jobs: dict[str, str] = Field(description="graph -> AI Hub compile job id (QDQ ONNX -> QNN DLC)")
    link_job: str = Field(min_length=1, description="AI Hub link job id (DLCs -> one weight-shared context binary)")
    qairt: str | None = Field(None, description="QAIRT SDK version of the linked context binary, as AI Hub reports it")
    graph_names: dict[str, str] = Field(default_factory=dict, description="graph -> its QNN graph name in the binary")


class TargetInfo(ManifestModel):
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


class FileEntry(ManifestModel):
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


class Encoding(ManifestModel):
    """A per-tensor linear quantization: real = scale x (q - zero_point), q of ``dtype`` (``bits`` wide)."""

    scale: float = Field(gt=0)
    zero_point: int
    dtype: str = Field(description="integer dtype of q: int4, uint4, int8, uint8, int16, uint16")
    bits: int = Field(ge=2, le=32)


class TensorSpec(ManifestModel):
    """A graph input or output: static shape, numpy dtype name, and its encoding where the graph quantizes it."""

    name: str = Field(min_length=1)
    shape: list[int]
    dtype: str
    encoding: Encoding | None = None


class WeightCount(ManifestModel):
    """Quantized weights of one integer dtype: how many tensors, how many elements."""

    tensors: int = Field(ge=0)
    elements: int = Field(ge=0)


class GraphIO(ManifestModel):
    """What a graph declares: inputs, outputs, weights per integer dtype, node counts per op type."""

    inputs: list[TensorSpec]
    outputs: list[TensorSpec]
    weight_bits: dict[str, WeightCount] = Field(default_factory=dict, description="integer dtype -> weights")
    op_counts: dict[str, int] = Field(default_factory=dict, description="op type -> nodes")


class GraphEntry(ManifestModel):
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


class Manifest(ManifestModel):
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
    """sha256 hex of a file's bytes (`hashlib.file_digest`). Raises OSError (FileNotFoundError, ...) as `open`."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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
        raise ManifestInvalid(f"{where}: {MANIFEST}: {first_error(e)}; {_REBUILD}") from None
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


def first_error(e: ValidationError) -> str:
    """One line for the first pydantic error: dotted location, what is wrong."""
    err = e.errors()[0]
    loc = ""
    for part in err["loc"]:
        loc += f"[{part}]" if isinstance(part, int) else (f".{part}" if loc else str(part))
    if err["type"] == "extra_forbidden":
        return f"unknown key {loc}"
    msg = err["msg"].removeprefix("Value error, ")
    return f"{loc}: {msg}" if loc else msg
