"""A bundle opened for the device runtime (docs/design.md "Bundle").

`open_bundle` reads ``manifest.json``, verifies every file's size and sha256 and the schema version
(`hycoc.bundle.load_manifest`), checks the manifest's target against the device (`check_device`: the QNN SDK,
and the Hexagon arch and SoC the OS reports, `hycoc.runtime.device_identity`), and loads the
host side: tokenizer, keep set, the head's 8-bit E table, the SLM's embedding LUTs and both drafters' rotary
tables. Graph sessions are opened separately (`hycoc.runtime.graphs.GraphRunner`), after these checks pass.

numpy + tokenizers + onnxruntime only: this module ships to the phone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hycoc.runtime.device_identity import ENV_DEVICE, DeviceIdentity, detect_device

from hycoc.bundle import BundleError, HostInfo, Manifest, ManifestInvalid, TargetMismatch, check_target, load_manifest
from hycoc.chat import Chat
from hycoc.host import FULL, SLIDING, EmbeddingLut, RotaryTable
from hycoc.models import load_tokenizer

BACKENDS = ("htp", "cpu")


@dataclass
class DeviceBundle:
    """What the runtime holds of a bundle besides its graph sessions.

    path: the bundle folder. manifest: its validated manifest (``round`` = the round constants K, D, B, W, λ,
    ε, sampling). host: the manifest's host section. tokenizer: a ``tokenizers.Tokenizer``. keep_set: int64
    (|V|,) sorted token ids (drafter output index i -> token ``keep_set[i]``). keep_index: int64 (vocab,) token id
    -> keep-set index, -1 outside. chat: the checkpoint's chat format with this tokenizer (`hycoc.chat.Chat`:
    turns, stop ids, thought split). head_embedding: (q int8 (|V|, H), scale float32 (|V|, 1)), the E table of
    Alg. 2 line 12. head_rotary / slm_rotary: layer type -> `RotaryTable`. slm_luts: name -> `EmbeddingLut`.
    """

    path: Path
    manifest: Manifest
    host: HostInfo
    tokenizer: object
    keep_set: np.ndarray
    keep_index: np.ndarray
    head_embedding: tuple[np.ndarray, np.ndarray]
    head_rotary: dict[str, RotaryTable]
    slm_rotary: dict[str, RotaryTable]
    slm_luts: dict[str, EmbeddingLut]
    chat: Chat

    @property
    def round(self):
        return self.manifest.round

    def embed_keep(self, index: int) -> np.ndarray:
        """E[index] dequantized: float32 (H,) (Alg. 2 line 12)."""
        q, scale = self.head_embedding
        return q[index].astype(np.float32) * scale[index, 0]

    def stop_token_ids(self) -> set[int]:
        """Ids that end a model turn: the checkpoint's ``eos_token_id`` as the manifest's ``chat`` records it."""
        return set(self.chat.stop_ids)


def _npy(folder: Path, rel: str) -> np.ndarray:
    return np.load(folder / rel, allow_pickle=False)


def local_qnn() -> dict[str, str | None]:
    """What the local onnxruntime-qnn reports: ``onnxruntime-qnn`` and ``qnn_sdk`` versions (None if absent)."""
    from hycoc.targets.qnn_ep import versions

    return versions()


def sdk_release(version: str) -> tuple[int, ...]:
    """``"v2.51.0.260929181845"`` (a context binary's) and ``"2.51.0"`` (onnxruntime-qnn's) -> (2, 51, 0)."""
    parts = version.strip().lstrip("vV").split(".")
    return tuple(int(p) for p in parts[:3] if p.isdigit())


def check_device_identity(manifest: Manifest, device: DeviceIdentity) -> None:
    """Refuse an htp bundle the detected ``device`` cannot run (docs/device-runtime.md "Which device the runtime
    sees"): x64 Python under emulation on an ARM64 host (its onnxruntime-qnn is the x64 wheel: the HTP simulator,
    not the NPU), and a bundle built for another Hexagon arch or SoC than the device's. Nothing is checked where
    the device's SoC is unknown, as on an x86 host (the simulator runs every arch) unless ``HYCOC_DEVICE`` names
    one.
    Raises TargetMismatch in one line naming both sides and the fix."""
    if device.emulated:
        raise TargetMismatch(
            f"this Python is built for {device.python_machine} and runs under emulation on an "
            f"{device.machine} {device.os} host: its onnxruntime-qnn is the x64 wheel (HTP simulator, "
            "no NPU); install Python for ARM64 (python.org: Windows installer (ARM64), 3.12 or newer) "
            "and reinstall hycoc in it (docs/windows-on-snapdragon.md)"
        )
    if device.htp_arch is None:
        return
    t = manifest.target
    built = f"Hexagon v{t.htp_arch} ({t.soc_model})"
    here = f"Hexagon v{device.htp_arch} ({device.soc_model}, {device.name}; from {device.source})"
    if t.htp_arch != device.htp_arch or (t.soc_model or "").upper() != (device.soc_model or "").upper():
        raise TargetMismatch(
            f"bundle built for {built}, this device is {here}: rebuild it with `hycoc build RECIPE "
            f'--device "{device.name}" --out DIR`'
        )


def check_device(
    manifest: Manifest,
    backend: str,
    *,
    qnn: dict[str, str | None] | None = None,
    htp_arch: int | None = None,
    soc_model: str | None = None,
    device: DeviceIdentity | None = None,
) -> None:
    """Refuse a bundle this device cannot run, before any session is created (docs/design.md "Bundle").

    backend: ``htp`` (QNN EP context binaries) or ``cpu`` (QDQ ONNX on onnxruntime's CPU EP). For htp, the
    bundle's QNN SDK must equal the local onnxruntime-qnn's (``qnn``: `local_qnn` output, read when None);
    htp_arch / soc_model: the device's, when known (None on the x86 simulator, which runs any arch). ``device``:
    the detected device (`hycoc.runtime.device_identity.detect_device`, read when None), checked by
    `check_device_identity` first. SDK versions are compared by release (major.minor.patch; the binary adds a
    build stamp).
    Raises TargetMismatch naming the field, the bundle's value and the device's, or ValueError for a bad backend.
    """
    if backend not in BACKENDS:
        raise ValueError(f"--backend {backend!r}: choose one of {', '.join(BACKENDS)}")
    if manifest.target.backend != backend:
        raise TargetMismatch(
            f"bundle built for target backend {manifest.target.backend} ({manifest.target.name}), "
            f"asked to run on {backend}: pass --backend {manifest.target.backend}, or build a "
            "bundle with " + ("--target cpu" if backend == "cpu" else "--device NAME (or --target htp-vNN)")
        )
    if backend == "htp":
        if device is None:
            from hycoc.targets.profiles import UnknownTargetError

            try:
                device = detect_device()
            except UnknownTargetError as e:  # HYCOC_DEVICE names no known device
                raise TargetMismatch(f"{ENV_DEVICE}: {e}") from None
        check_device_identity(manifest, device)
        qnn = local_qnn() if qnn is None else qnn
        if manifest.target.backend == "htp" and qnn.get("onnxruntime-qnn") is None:
            raise TargetMismatch(
                "bundle built for the QNN HTP backend, and onnxruntime-qnn is not installed here; "
                "install it (pip install -e '.[qnn]') or build a bundle with --target cpu"
            )
        check_target(manifest, backend="htp", htp_arch=htp_arch, soc_model=soc_model)
        built, here = manifest.target.qnn_sdk, qnn.get("qnn_sdk")
        if built and here and sdk_release(built) != sdk_release(here):
            raise TargetMismatch(
                f"bundle built for QNN SDK {built}, this device has {here}; rebuild it with "
                "`hycoc build RECIPE --target ...` for this device"
            )
    else:
        check_target(manifest, backend="cpu")


def open_bundle(
    path: str | os.PathLike,
    backend: str = "cpu",
    *,
    verify: bool = True,
    qnn: dict[str, str | None] | None = None,
    device: DeviceIdentity | None = None,
) -> DeviceBundle:
    """Open a bundle folder for ``backend`` (module docstring); ``device``: the device to check an htp bundle
    against (default: `hycoc.runtime.device_identity.detect_device`, which honours ``HYCOC_DEVICE``).

    Raises a ``hycoc.bundle.BundleError`` subclass: BundleNotFound, SchemaVersionMismatch, FileMissing,
    HashMismatch, ... (from `load_manifest`), TargetMismatch (`check_device`), ManifestInvalid when the manifest
    has no host section (a bundle from an older hycoc), a graph the runtime needs is missing, or a graph lacks the
    top-k outputs (``top_index``, and ``top_logq`` for the SLM) an older hycoc did not write.
    """

    folder = Path(path)
    manifest = load_manifest(folder, verify=verify)
    check_device(manifest, backend, qnn=qnn, device=device)
    if manifest.host is None:
        raise ManifestInvalid(
            f"bundle {folder}: its manifest has no host section (built by an older hycoc); "
            "rebuild it with `hycoc build RECIPE --target ... --out DIR`"
        )
    names = {g.name for g in manifest.graphs}
    missing = {n for n in ("head", "slm") if n not in names and not any(x.startswith(f"{n}.s") for x in names)}
    if missing:
        raise ManifestInvalid(f"bundle {folder}: no {', '.join(sorted(missing))} graph; rebuild it with hycoc build")
    for name, wanted in (("head", {"top_index"}), ("slm", {"top_index", "top_logq"})):
        missing = wanted - {t.name for t in manifest.chain_entry(name).outputs}  # layer shards: the chain's
        if missing:  # graphs emit their own top-k (passes/topk_outputs.py); no keep-set-wide row is ranked here
            raise ManifestInvalid(
                f"bundle {folder}: its {name} graph has no {', '.join(sorted(missing))} output "
                "(built by an older hycoc); rebuild it with `hycoc build RECIPE --target ... "
                "--out DIR`"
            )
    keep = _npy(folder, "keep_set.npy").astype(np.int64)
    if len(keep) != manifest.keep_set_size:
        raise ManifestInvalid(
            f"bundle {folder}: keep_set.npy has {len(keep)} ids, the manifest says {manifest.keep_set_size}"
        )
    if manifest.chat is None:
        raise ManifestInvalid(
            f"bundle {folder}: its manifest has no chat section (built before the checkpoint's chat "
            "format was recorded: stop ids, chat template); rebuild it with `hycoc build RECIPE "
            "--target ... --out DIR`"
        )
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    vocab = max(int(tokenizer.get_vocab_size()), int(keep.max()) + 1)
    keep_index = np.full(vocab, -1, dtype=np.int64)
    keep_index[keep] = np.arange(len(keep))
    head_rotary = {}
    for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
        inv = _npy(folder, f"rotary/head_{short}_inv_freq.npy").astype(np.float32)
        head_rotary[kind] = RotaryTable(
            inv, float(_npy(folder, f"rotary/head_{short}_scaling.npy").reshape(-1)[0]), 2 * len(inv)
        )
    host = manifest.host
    slm_rotary = {}
    for kind in sorted(set(host.slm.layer_types)):
        inv = _npy(folder, f"rotary/slm_{kind}_inv_freq.npy").astype(np.float32)
        slm_rotary[kind] = RotaryTable(
            inv, float(_npy(folder, f"rotary/slm_{kind}_scaling.npy").reshape(-1)[0]), 2 * len(inv)
        )
    luts = {}
    for name, info in host.slm.luts.items():
        luts[name] = EmbeddingLut(
            packed=_npy(folder, f"luts/slm_{name}_packed.npy"),
            scale=_npy(folder, f"luts/slm_{name}_scale.npy").astype(np.float32),
            bits=info.bits,
            dim=info.dim,
            embed_scale=info.embed_scale,
        )
    q = _npy(folder, "luts/head_embedding_q.npy")
    scale = _npy(folder, "luts/head_embedding_scale.npy").astype(np.float32)
    if q.shape[0] != len(keep) or scale.shape != (len(keep), 1):
        raise ManifestInvalid(
            f"bundle {folder}: the head's E table is {list(q.shape)} with scales "
            f"{list(scale.shape)}, expected {len(keep)} rows; rebuild the bundle"
        )
    return DeviceBundle(
        path=folder,
        manifest=manifest,
        host=host,
        tokenizer=tokenizer,
        keep_set=keep,
        keep_index=keep_index,
        head_embedding=(q, scale),
        head_rotary=head_rotary,
        slm_rotary=slm_rotary,
        slm_luts=luts,
        chat=Chat(manifest.chat, tokenizer),
    )


__all__ = [
    "BACKENDS",
    "BundleError",
    "DeviceBundle",
    "check_device",
    "check_device_identity",
    "local_qnn",
    "open_bundle",
]
