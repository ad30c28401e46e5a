"""Target profiles: what a compile target can do, as data (docs/design.md "Targets").

Code paths never hard-code an arch, a SoC id or a size limit; they read a :class:`TargetProfile`.

Where the numbers come from
---------------------------
- ``htp_arch``: the Hexagon HTP generation (QNN ``QnnHtpDevice_Arch_t``: 68, 69, 73, 75, 79, 81).
- ``soc_id``: the number the onnxruntime QNN EP wants in its ``soc_model`` provider option (QNN's SoC model
  number, ``QcomChipset`` in ExecuTorch's ``backends/qualcomm/serialization/qc_schema.py``: SM8350 = 30,
  SM8450 = 36, SM8550 = 43, SM8650 = 57, SM8750 = 69, SM8850 = 87). Checked here with onnxruntime-qnn 2.7.0
  (QNN 2.51): the HTP backend writes its target into the context binary's config string, and
  ``soc_model=87`` gives ``soc_type=SM8850;arch=81``, ``soc_model=30`` gives ``soc_type=SM8350;arch=68``.
  Pitfall seen there: ``soc_model`` wins over ``htp_arch`` (``htp_arch=81, soc_model=30`` silently compiles for
  v68), and an ``htp_arch`` QNN does not know (e.g. 85) silently compiles for a generic v68. ``targets.htp``
  therefore reads the arch back from every binary it writes.
- ``max_context_bytes``: the HTP backend's own ``memory_alloc_limit`` (MiB) in the same config string:
  3584 MiB for v73, v75, v79 and v81, 2048 MiB for v68 and v69 (QNN 2.51). FIELD-NOTES: "one context ≈ 3.5–4 GB
  at most on current phones".
- ``supports_16bit_ops``: a declared capability of the profile. The v68 profile says False (FIELD-NOTES: "older
  HTP archs reject 16-bit ops"); note that QNN 2.51's v68 *compiler* accepted a uint16 MatMul here, so the
  refusal is the profile's policy, checked by hycoc before compiling (a capability error, never a silent
  precision change).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

MIB = 1024 * 1024


class UnknownTargetError(ValueError):
    """A target name, arch or SoC that no profile describes; the message lists the known ones."""


@dataclass(frozen=True)
class TargetProfile:
    """One compile target.

    Attributes:
        name: profile name as recipes and the CLI spell it (``"htp-v81"``, ``"cpu"``).
        backend: ``"htp"`` (QNN HTP context binaries via onnxruntime-qnn) or ``"cpu"`` (QDQ ONNX, CPU EP).
        htp_arch: Hexagon HTP arch number (None for cpu).
        soc_model: SoC part name (``"SM8850"``), as the recipe's ``target.soc_model`` spells it.
        soc_id: QNN's numeric SoC model for the EP's ``soc_model`` option; None when unknown (then the EP gets
            only ``htp_arch`` and ``soc_id_note`` says why).
        soc_id_note: where ``soc_id`` comes from, or why it is unknown.
        max_context_bytes: largest context binary (bytes) the device loads; the size planner refuses bigger.
        supports_16bit_ops: whether uint16/int16 activations (A16) may be compiled for this target.
        supports_int4_weights: whether 4-bit weights may be compiled for this target.
        supported_op_types: optional allow-list of ONNX op types (Q/DQ always allowed); None = ask the EP.
        host_only: graph patterns hycoc keeps on the host by design and refuses in a device graph
            (``"embedding_lookup"``: a Gather on a constant table indexed by an integer graph input; embeddings
            are host LUTs, docs/design.md "SLM Drafter").
        finalization_mode: QNN ``htp_graph_finalization_optimization_mode`` ("0".."3"; 3 = slowest, best).
        description: one line for tables.
        source: where the profile's arch, SoC id and limits come from (public documents, or read back here).
    """

    name: str
    backend: str
    htp_arch: int | None = None
    soc_model: str | None = None
    soc_id: int | None = None
    soc_id_note: str = ""
    max_context_bytes: int | None = None
    supports_16bit_ops: bool = True
    supports_int4_weights: bool = True
    supported_op_types: frozenset[str] | None = None
    host_only: tuple[str, ...] = ()
    finalization_mode: str = "0"
    description: str = ""
    source: str = ""
    extra_provider_options: dict[str, str] = field(default_factory=dict)

    def provider_options(self) -> dict[str, str]:
        """QNN EP provider options for this profile (strings, as the EP wants them). Raises ValueError for cpu."""
        if self.backend != "htp":
            raise ValueError(f"profile {self.name!r} is a {self.backend} target; it has no QNN provider options")
        opts = {
            "backend_type": "htp",
            "htp_arch": str(self.htp_arch),
            "htp_graph_finalization_optimization_mode": self.finalization_mode,
        }
        if self.soc_id is not None:
            opts["soc_model"] = str(self.soc_id)
        opts.update(self.extra_provider_options)
        return opts

    def with_limit(self, max_context_bytes: int) -> TargetProfile:
        """A copy with a smaller (never larger) context limit, e.g. the recipe's ``context_size_limit_mb``."""
        cur = self.max_context_bytes
        return replace(self, max_context_bytes=max_context_bytes if cur is None else min(cur, max_context_bytes))


_SOC_NOTE = (
    "QNN SoC model number (ExecuTorch qc_schema.py QcomChipset); checked against the soc_type the "
    "QNN 2.51 HTP backend writes into the context binary"
)
_LIMIT_SOURCE = (
    "memory_alloc_limit the QNN 2.51 HTP backend writes into a context binary for this arch (read back here)"
)


def _htp_profile(arch: int, soc_model: str, soc_id: int, chip: str, **fields) -> TargetProfile:
    """The profile ``htp-v{arch}`` of a Hexagon HTP generation: its SoC (part name, QNN's number, the chip's
    marketing name for the description), a 3,584 MiB context limit, the embedding lookup kept on the host, and the
    sources of its numbers; ``fields`` override any of it."""
    return TargetProfile(
        **{
            "name": f"htp-v{arch}",
            "backend": "htp",
            "htp_arch": arch,
            "soc_model": soc_model,
            "soc_id": soc_id,
            "soc_id_note": _SOC_NOTE,
            "max_context_bytes": 3584 * MIB,
            "host_only": ("embedding_lookup",),
            "description": f"{chip} ({soc_model}), Hexagon HTP v{arch}",
            "source": f"arch/SoC: QNN HTP backend's supported-SoC table ({soc_model} = V{arch}); soc_id: "
            f"{_SOC_NOTE}; limit: {_LIMIT_SOURCE}",
            **fields,
        }
    )


PROFILES: dict[str, TargetProfile] = {
    p.name: p
    for p in (
        _htp_profile(
            81,
            "SM8850",
            87,
            "Snapdragon 8 Elite Gen 5",
            description="Snapdragon 8 Elite Gen 5 (SM8850), Hexagon HTP v81 — the paper's phone",
            source=f"arch/SoC: paper (Galaxy S26 Ultra, SM8850); soc_id: {_SOC_NOTE}; limit: {_LIMIT_SOURCE}",
        ),
        _htp_profile(79, "SM8750", 69, "Snapdragon 8 Elite"),
        _htp_profile(75, "SM8650", 57, "Snapdragon 8 Gen 3"),
        _htp_profile(73, "SM8550", 43, "Snapdragon 8 Gen 2"),
        _htp_profile(
            68,
            "SM8350",
            30,
            "Snapdragon 888",
            max_context_bytes=2048 * MIB,
            supports_16bit_ops=False,
            supports_int4_weights=False,
            description="Snapdragon 888 (SM8350), Hexagon HTP v68 — 8-bit activations only in hycoc",
            source=f"arch/SoC: QNN HTP backend's supported-SoC table (SM8350 = V68); soc_id: {_SOC_NOTE}; "
            f"limit: {_LIMIT_SOURCE}; no 16-bit activations / int4 weights: FIELD-NOTES (older archs reject "
            "16-bit ops), hycoc's policy",
        ),
        TargetProfile(
            name="cpu",
            backend="cpu",
            supports_16bit_ops=True,
            description="onnxruntime CPU EP running the QDQ ONNX graphs",
            source="onnxruntime CPU EP: runs any QDQ ONNX graph; no context limit",
        ),
    )
}

#: The HTP profile names, newest arch first (``hycoc build --target``).
HTP_TARGETS: tuple[str, ...] = tuple(
    n for n, p in sorted(PROFILES.items(), key=lambda kv: -(kv[1].htp_arch or 0)) if p.backend == "htp"
)


def recipe_refusal(profile: TargetProfile) -> str:
    """What keeps every recipe off ``profile``, as words ("no 16-bit activations"), or "" when recipes build for
    it: the MTP head's graphs are always A16 (`hycoc.passes.head.export`), so a profile without
    ``supports_16bit_ops`` refuses them all before any pass (`hycoc.passes.build.check_recipe_capabilities`).
    ``hycoc doctor`` says so beside each target and device it lists."""
    return "" if profile.supports_16bit_ops else "no 16-bit activations"


@dataclass(frozen=True)
class DeviceEntry:
    """A phone or laptop a user names (``hycoc build --device NAME``), resolved to a SoC and an HTP profile.

    Attributes:
        name: the Snapdragon platform's marketing name (``"Snapdragon 8 Gen 3"``).
        soc_model: the SoC part number QNN uses (``"SM8650"``; the X Elite laptops: ``"SC8380XP"``).
        htp_arch: Hexagon HTP arch; the profile is ``htp-v{htp_arch}``.
        soc_id: QNN's numeric SoC model (the EP's ``soc_model`` option).
        aliases: other names that mean this entry: phones built on it, the part number, the OS's processor name
            fragments (``"X1E"``). Matched case-insensitively, spaces and punctuation ignored.
        source: the public source of the name -> SoC -> arch mapping.
        note: a caveat for users (regional chips, ...), or "".
    """

    name: str
    soc_model: str
    htp_arch: int
    soc_id: int
    aliases: tuple[str, ...]
    source: str
    note: str = ""

    def profile(self) -> TargetProfile:
        """The arch's profile with this entry's SoC (the X Elite is a v73 like the 8 Gen 2, on another SoC)."""
        base = next(p for p in PROFILES.values() if p.backend == "htp" and p.htp_arch == self.htp_arch)
        if (base.soc_model or "").upper() == self.soc_model.upper():
            return base
        return replace(
            base,
            soc_model=self.soc_model,
            soc_id=self.soc_id,
            description=f"{self.name} ({self.soc_model}), Hexagon HTP v{self.htp_arch}",
            source=f"{self.source}; other values as {base.name}: {base.source}",
        )


_QNN_SOCS = (
    "QNN HTP backend's supported-SoC table (SoC -> V arch), ExecuTorch qc_schema.py QcomChipset (SoC id); "
    "checked here: the QNN 2.51 compile writes soc_type={soc};arch={arch} into the binary"
)
_SAMSUNG = (
    "Samsung Newsroom, {phones} launch announcement: {chip} Mobile Platform for Galaxy; the OnePlus and "
    "Xiaomi phones: their makers' specification pages"
)


def _samsung_source(soc: str, arch: int, phones: str, chip: str) -> str:
    """The source of a phone chip's entry: QNN's SoC table for ``soc`` and ``arch``, Samsung's launch of
    ``phones`` for the chip they carry."""
    return _QNN_SOCS.format(soc=soc, arch=arch) + "; " + _SAMSUNG.format(phones=phones, chip=chip)


DEVICES: tuple[DeviceEntry, ...] = (
    DeviceEntry(
        "Snapdragon 8 Elite Gen 5",
        "SM8850",
        81,
        87,
        ("8 Elite Gen 5", "SM8850", "Galaxy S26 Ultra"),
        _QNN_SOCS.format(soc="SM8850", arch=81) + "; Galaxy S26 Ultra: the paper's phone (§4)",
        note="Galaxy S26 / S26+ ship with Exynos 2600 in some regions (no Hexagon NPU): check the chip",
    ),
    DeviceEntry(
        "Snapdragon 8 Elite",
        "SM8750",
        79,
        69,
        (
            "8 Elite",
            "SM8750",
            "Galaxy S25",
            "Galaxy S25+",
            "Galaxy S25 Ultra",
            "Galaxy S25 Edge",
            "OnePlus 13",
            "Xiaomi 15",
        ),
        _samsung_source("SM8750", 79, "Galaxy S25 series (Jan 2025)", "Snapdragon 8 Elite"),
    ),
    DeviceEntry(
        "Snapdragon 8 Gen 3",
        "SM8650",
        75,
        57,
        ("8 Gen 3", "SM8650", "Galaxy S24 Ultra", "Galaxy S24", "Galaxy S24+", "OnePlus 12", "Xiaomi 14"),
        _samsung_source("SM8650", 75, "Galaxy S24 series (Jan 2024)", "Snapdragon 8 Gen 3"),
        note="Galaxy S24 / S24+ have Snapdragon 8 Gen 3 only in the US, Canada, China and Japan (Exynos 2400 "
        "elsewhere, no Hexagon NPU); the S24 Ultra has it everywhere",
    ),
    DeviceEntry(
        "Snapdragon 8 Gen 2",
        "SM8550",
        73,
        43,
        ("8 Gen 2", "SM8550", "Galaxy S23", "Galaxy S23+", "Galaxy S23 Ultra", "OnePlus 11", "Xiaomi 13"),
        _samsung_source("SM8550", 73, "Galaxy S23 series (Feb 2023)", "Snapdragon 8 Gen 2"),
    ),
    DeviceEntry(
        "Snapdragon X Elite",
        "SC8380XP",
        73,
        60,
        ("X Elite", "SC8380XP", "X1E", "X1E80100", "X1E78100"),
        "QNN HTP backend's supported-SoC table (SC8380XP = V73, soc_model 60; Olive's QNN pass example "
        "'dsp_arch:v73;soc_model:60'); checked here: the QNN 2.51 compile writes soc_type=SC8380XP;arch=73; "
        "the Linux kernel names the part X1E80100 (ex-SC8380XP)",
        note="Windows on Snapdragon laptops (Copilot+ PCs): the one device where Python reaches the NPU "
        "(docs/windows-on-snapdragon.md). The X Plus is not listed: its 8-core X1P-42 is another die "
        "(Linux: x1p42100) whose QNN SoC id was not checked here",
    ),
    DeviceEntry(
        "Snapdragon 888",
        "SM8350",
        68,
        30,
        ("888", "SM8350"),
        _QNN_SOCS.format(soc="SM8350", arch=68),
        note="hycoc compiles 8-bit activations only for v68: the toy and Gemma recipes (16-bit) are refused",
    ),
)


def fold_name(text: str) -> str:
    """A name as the device table compares names: lower case, letters and digits only ("Galaxy S24+" -> "galaxys24")."""
    return "".join(ch for ch in text.lower() if ch.isalnum())


def known_device_names() -> list[str]:
    """Every device name and alias `resolve_device` takes, in table order."""
    return [n for d in DEVICES for n in (d.name, *d.aliases)]


def resolve_device(name: str) -> DeviceEntry:
    """The `DEVICES` entry called ``name`` (its name or an alias; case, spaces and punctuation ignored; a leading
    "Snapdragon"/"Samsung" may be left out). Raises UnknownTargetError listing the known names."""
    want = fold_name(name)
    for prefix in ("snapdragon", "samsung", "qualcomm"):
        want = want.removeprefix(prefix) if want != prefix else want
    for d in DEVICES:
        for n in (d.name, *d.aliases):
            f = fold_name(n)
            if want in (f, f.removeprefix("snapdragon")):
                return d
    known = "; ".join(f"{d.name} = {', '.join(d.aliases)}" for d in DEVICES)
    raise UnknownTargetError(f"unknown device {name!r} (known: {known})")


def device_target_conflict(device: DeviceEntry, target: str) -> str | None:
    """Why ``hycoc build --device`` ``device`` and ``--target`` ``target`` cannot go together, with the fix, or
    None when ``target`` is the device's own ``htp-v{arch}``: the one rule `hycoc.passes.build.recipe_for_target`
    applies and the command line checks before loading anything (a usage error, exit 2)."""
    own = f"htp-v{device.htp_arch}"
    if target == own:
        return None
    return (
        f"--device {device.name!r} is Hexagon v{device.htp_arch} ({device.soc_model}) and --target is {target}: "
        f"drop --target, or pass --target {own}"
    )


def device_for_soc(soc_model: str) -> DeviceEntry | None:
    """The first `DEVICES` entry on SoC ``soc_model`` (``"SM8650"``; a part-number alias such as ``"X1E80100"``
    counts), None when none is."""
    want = fold_name(soc_model)
    return next((d for d in DEVICES if want == fold_name(d.soc_model)), None) or next(
        (d for d in DEVICES if any(want == fold_name(a) and any(c.isdigit() for c in a) for a in d.aliases)), None
    )


def get_profile(name: str) -> TargetProfile:
    """The profile called ``name``. Raises UnknownTargetError listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownTargetError(f"unknown target {name!r} (known: {', '.join(sorted(PROFILES))})") from None


def profile_for(htp_arch: int, soc_model: str, context_size_limit_mb: int | None = None) -> TargetProfile:
    """The HTP profile for a recipe's ``[target]`` (arch + SoC part name), limited by its context size in MB:
    a profile's own SoC, else a `DEVICES` entry's SoC on that arch (the arch's profile with that SoC).

    Raises UnknownTargetError when neither has that arch and SoC (the message lists the known pairs).
    """
    found = None
    for p in PROFILES.values():
        if p.backend == "htp" and p.htp_arch == htp_arch and (p.soc_model or "").upper() == soc_model.upper():
            found = p
    if found is None:
        d = next((d for d in DEVICES if d.htp_arch == htp_arch and d.soc_model.upper() == soc_model.upper()), None)
        found = d.profile() if d is not None else None
    if found is None:
        pairs = {f"v{p.htp_arch}/{p.soc_model}" for p in PROFILES.values() if p.backend == "htp"}
        pairs |= {f"v{d.htp_arch}/{d.soc_model}" for d in DEVICES}
        raise UnknownTargetError(
            f"no HTP profile for htp_arch={htp_arch} soc_model={soc_model!r} (known: {', '.join(sorted(pairs))})"
        )
    return found if context_size_limit_mb is None else found.with_limit(context_size_limit_mb * 1000 * 1000)
