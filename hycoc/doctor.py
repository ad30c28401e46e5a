"""`hycoc doctor`: what is installed and which ``--target htp-vNN`` the QNN EP compiles here, as rows of a table.

`package_versions` reads installed versions without importing anything (importlib.metadata); `doctor_rows` adds the
QNN EP's status (`hycoc.targets.qnn_ep.qnn_status`: loads the plugin EP and compiles a trivial 16-bit graph per HTP
arch in a child process); `render_doctor` prints them as a rich table. torch-free.
"""

from __future__ import annotations

import sys
from typing import Any

#: Packages whose versions `hycoc doctor` reports, in its order.
PACKAGES = (
    "hycoc",
    "numpy",
    "torch",
    "transformers",
    "tokenizers",
    "onnx",
    "onnxscript",
    "onnx-ir",
    "onnxruntime",
    "onnxruntime-qnn",
    "qai-hub",  # the hub extra (hycoc build --target qai-hub, hycoc profile)
    "ray",  # the serve extra (hycoc serve-ray)
)


def package_versions() -> dict[str, str]:
    """Versions of Python and the packages hycoc uses, "not installed" for those missing (nothing is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": sys.version.split()[0]}
    for name in PACKAGES:
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "not installed"
    return out


def doctor_rows(
    status: dict | None = None, versions: dict[str, str] | None = None, device=None
) -> list[tuple[str, str, str]]:
    """(item, value, style) rows of `hycoc doctor`: every `package_versions` entry ("yellow" when not installed),
    then "QNN EP loads" and "HTP targets" (`htp_targets`) from ``status`` (default:
    `hycoc.targets.qnn_ep.qnn_status()`: keys loads, versions, archs {arch: {"ok"}}, compilable_archs, error),
    "this device" (``device``: a `hycoc.runtime.device_identity.DeviceIdentity`, default detected; red for x64
    Python under emulation on ARM64), and one row per `hycoc.targets.profiles.DEVICES` entry (what ``--device
    NAME`` builds: profile, SoC, whether this install compiles its arch, whether device time is fitted). style: ""
    (plain), "yellow" (missing) or "red" (a target whose arch fails, or none compiles)."""
    rows = [
        (name, ver, "yellow" if ver == "not installed" else "")
        for name, ver in (versions if versions is not None else package_versions()).items()
    ]
    if status is None:
        from hycoc.targets.qnn_ep import qnn_status

        status = qnn_status()
    if status["loads"]:
        sdk = status["versions"].get("qnn_sdk")
        rows.append(("QNN EP loads", f"yes (QNN SDK {sdk})" if sdk else "yes", ""))
        rows.append(targets_row(status))
    else:
        rows.append(("QNN EP loads", f"no: {status['error']}", "yellow"))
        rows.append(("HTP targets", "none (no QNN EP)", "yellow"))
    rows += device_rows(status, device)
    return rows


def htp_targets(status: dict) -> tuple[list[str], list[str]]:
    """(the ``hycoc build --target`` names whose arch compiled here, those whose arch failed), newest arch first,
    from `hycoc.targets.qnn_ep.qnn_status`'s ``archs`` / ``compilable_archs``. Only the targets registry's HTP
    profiles (`hycoc.targets.profiles.HTP_TARGETS`) are named: an arch the probe tries (QNN knows more archs) that
    has no profile is left out, since ``--target`` would refuse it."""
    from hycoc.targets.profiles import HTP_TARGETS, get_profile

    compiled = set(status.get("compilable_archs") or [])
    tried = {int(a) for a in status.get("archs") or {}} | compiled
    ok = [t for t in HTP_TARGETS if get_profile(t).htp_arch in compiled]
    bad = [t for t in HTP_TARGETS if get_profile(t).htp_arch in tried - compiled]
    return ok, bad


def targets_row(status: dict) -> tuple[str, str, str]:
    """The "HTP targets" row: the `htp_targets` that compile here and that recipes build for, then each that
    compiles but that the builder refuses for every recipe, with why (`hycoc.targets.profiles.recipe_refusal`, the
    profile's own fields), then those whose arch failed ("htp-v81, htp-v79; htp-v68 compiles, but no recipe's head
    builds for it: no 16-bit activations"). Red when an arch failed or no target builds."""
    from hycoc.targets.profiles import get_profile, recipe_refusal

    ok, bad = htp_targets(status)
    builds = [t for t in ok if not recipe_refusal(get_profile(t))]
    text = ", ".join(builds) or "none"
    for t in ok:
        if why := recipe_refusal(get_profile(t)):
            text += f"; {t} compiles, but no recipe's head builds for it: {why} (docs/compiler.md)"
    text += f" (fail: {', '.join(bad)})" if bad else ""
    return "HTP targets", text, "red" if bad or not builds else ""


def device_rows(status: dict, device=None) -> list[tuple[str, str, str]]:
    """`doctor_rows`' device part: "this device", then one row per `hycoc.targets.profiles.DEVICES` entry."""
    from hycoc.device_time import NPU_PROFILES, npu_key
    from hycoc.runtime.device_identity import detect_device
    from hycoc.targets.profiles import DEVICES

    rows: list[tuple[str, str, str]] = []
    if device is None:
        try:
            device = detect_device()
        except ValueError as e:  # HYCOC_DEVICE names no known device
            rows.append(("this device", str(e), "red"))
    if device is not None:
        text = device.describe()
        if device.emulated:
            text += ": x64 Python under emulation, install Python for ARM64 (docs/windows-on-snapdragon.md)"
        rows.append(("this device", text, "red" if device.emulated else ""))
    compiles = set(status.get("compilable_archs") or [])
    for d in DEVICES:
        here = "compiles here" if d.htp_arch in compiles else "not compiled here"
        lacks = _lacks(d.htp_arch)
        if lacks:  # the arch compiles, but the head's graphs need what its profile does not allow
            here += f", but {lacks}: no recipe's head builds for it (docs/compiler.md)"
        fitted = "device time fitted" if npu_key(d.htp_arch) in NPU_PROFILES else "device time not fitted"
        aka = ", ".join(d.aliases)  # every name `resolve_device` takes for it: phones, part numbers, the SoC
        rows.append(
            (
                f"--device {d.name}",
                f"htp-v{d.htp_arch} {d.soc_model}; {here}; {fitted}" + (f" (also: {aka})" if aka else ""),
                "" if d.htp_arch in compiles else "yellow",
            )
        )
    return rows


def _lacks(arch: int) -> str:
    """What the ``htp-v{arch}`` profile cannot compile that every recipe's head needs (its graphs are always A16,
    `hycoc.passes.build.check_recipe_capabilities`), as words; "" where it can or there is no such profile."""
    from hycoc.targets.profiles import HTP_TARGETS, get_profile, recipe_refusal

    name = f"htp-v{arch}"
    return recipe_refusal(get_profile(name)) if name in HTP_TARGETS else ""


def render_doctor(rows: list[tuple[str, str, str]], console: Any = None) -> None:
    """Print `doctor_rows` as the "hycoc doctor" table on ``console`` (default: a rich Console on stdout)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    table = Table(title="hycoc doctor")
    table.add_column("package")
    table.add_column("version")
    for item, value, style in rows:
        table.add_row(item, Text(value, style=style or ""))
    (console or Console()).print(table)


__all__ = ["PACKAGES", "doctor_rows", "htp_targets", "package_versions", "render_doctor", "targets_row"]
