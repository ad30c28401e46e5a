"""Writing a bundle atomically (`BundleWriter`; the format is `hycoc.bundle`, docs/design.md "Bundle").

Files go into a hidden temporary sibling of the output folder (``.NAME.partial-XXXX``); `BundleWriter.commit`
hashes them, writes ``manifest.json`` last and renames the folder into place. An exception before `commit` (or
`abort`) removes the temporary folder, so the output folder is either the old bundle, or absent, or complete. A
process killed outright can leave a ``.NAME.partial-*`` sibling behind (never the bundle itself); delete it by hand.

Core module: stdlib and pydantic, like `hycoc.bundle`.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path
from typing import get_args

from pydantic import ValidationError

from hycoc.bundle import (
    MANIFEST,
    SCHEMA_VERSION,
    BundleError,
    BundleExists,
    FileEntry,
    FileRole,
    GraphEntry,
    GraphIO,
    GraphRole,
    Manifest,
    ManifestInvalid,
    RecipeRef,
    TargetInfo,
    check_rel_path,
    first_error,
    sha256_file,
)
from hycoc.bundle_constants import HandoffInfo, HostInfo, Quantization, RoundConstants
from hycoc.chat import ChatFormat


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
            raise ManifestInvalid(f"bundle {self.out_dir}: cannot write the manifest: {first_error(e)}") from None
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
