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
    extra_provider_options: dict[str, str] = field(default_factory=dict)

    def provider_options(self) -> dict[str, str]:
        """QNN EP provider options for this profile (strings, as the EP wants them). Raises ValueError for cpu."""
        if self.backend != "htp":
            raise ValueError(f"profile {self.name!r} is a {self.backend} target; it has no QNN provider options")
        opts = {"backend_type": "htp", "htp_arch": str(self.htp_arch),
                "htp_graph_finalization_optimization_mode": self.finalization_mode}
        if self.soc_id is not None:
            opts["soc_model"] = str(self.soc_id)
        opts.update(self.extra_provider_options)
        return opts

    def with_limit(self, max_context_bytes: int) -> TargetProfile:
        """A copy with a smaller (never larger) context limit, e.g. the recipe's ``context_size_limit_mb``."""
        cur = self.max_context_bytes
        return replace(self, max_context_bytes=max_context_bytes if cur is None else min(cur, max_context_bytes))


_SOC_NOTE = ("QNN SoC model number (ExecuTorch qc_schema.py QcomChipset); checked against the soc_type the "
             "QNN 2.51 HTP backend writes into the context binary")

PROFILES: dict[str, TargetProfile] = {p.name: p for p in (
    TargetProfile(
        name="htp-v81", backend="htp", htp_arch=81, soc_model="SM8850", soc_id=87, soc_id_note=_SOC_NOTE,
        max_context_bytes=3584 * MIB, supports_16bit_ops=True, host_only=("embedding_lookup",),
        description="Snapdragon 8 Elite Gen 5 (SM8850), Hexagon HTP v81 — the paper's phone"),
    TargetProfile(
        name="htp-v79", backend="htp", htp_arch=79, soc_model="SM8750", soc_id=69, soc_id_note=_SOC_NOTE,
        max_context_bytes=3584 * MIB, host_only=("embedding_lookup",),
        description="Snapdragon 8 Elite (SM8750), Hexagon HTP v79"),
    TargetProfile(
        name="htp-v75", backend="htp", htp_arch=75, soc_model="SM8650", soc_id=57, soc_id_note=_SOC_NOTE,
        max_context_bytes=3584 * MIB, host_only=("embedding_lookup",),
        description="Snapdragon 8 Gen 3 (SM8650), Hexagon HTP v75"),
    TargetProfile(
        name="htp-v73", backend="htp", htp_arch=73, soc_model="SM8550", soc_id=43, soc_id_note=_SOC_NOTE,
        max_context_bytes=3584 * MIB, host_only=("embedding_lookup",),
        description="Snapdragon 8 Gen 2 (SM8550), Hexagon HTP v73"),
    TargetProfile(
        name="htp-v68", backend="htp", htp_arch=68, soc_model="SM8350", soc_id=30, soc_id_note=_SOC_NOTE,
        max_context_bytes=2048 * MIB, supports_16bit_ops=False, supports_int4_weights=False,
        host_only=("embedding_lookup",),
        description="Snapdragon 888 (SM8350), Hexagon HTP v68 — 8-bit activations only in hycoc"),
    TargetProfile(
        name="cpu", backend="cpu", supports_16bit_ops=True,
        description="onnxruntime CPU EP running the QDQ ONNX graphs"),
)}


def get_profile(name: str) -> TargetProfile:
    """The profile called ``name``. Raises UnknownTargetError listing the known names."""
    try:
        return PROFILES[name]
    except KeyError:
        raise UnknownTargetError(f"unknown target {name!r} (known: {', '.join(sorted(PROFILES))})") from None


def profile_for(htp_arch: int, soc_model: str, context_size_limit_mb: int | None = None) -> TargetProfile:
    """The HTP profile for a recipe's ``[target]`` (arch + SoC part name), limited by its context size in MB.

    Raises UnknownTargetError when no profile has that arch and SoC (the message lists the known pairs).
    """
    for p in PROFILES.values():
        if p.backend == "htp" and p.htp_arch == htp_arch and (p.soc_model or "").upper() == soc_model.upper():
            return p if context_size_limit_mb is None else p.with_limit(context_size_limit_mb * 1000 * 1000)
    known = ", ".join(f"v{p.htp_arch}/{p.soc_model}" for p in PROFILES.values() if p.backend == "htp")
    raise UnknownTargetError(f"no HTP profile for htp_arch={htp_arch} soc_model={soc_model!r} (known: {known})")
