"""What device the runtime runs on: the host's CPU architecture, the architecture this Python was built for, and the
Snapdragon SoC with its Hexagon arch (docs/device-runtime.md "Which device the runtime sees").

Where each value comes from, and how far to trust it:

- **The SoC** is read from the operating system, not from the QNN EP: onnxruntime-qnn 2.7.0's ``OrtEpDevice`` lists
  only a device type, a vendor (PCI vendor id) and the EP library's path and version (``ep_metadata``), no arch or
  SoC; the HTP backend queries the SoC inside ``QnnDevice`` and exposes nothing to Python. So:
  Windows: the registry's ``HKLM\\HARDWARE\\DESCRIPTION\\System\\CentralProcessor\\0\\ProcessorNameString`` (the
  firmware's marketing name, e.g. "Snapdragon(R) X Elite - X1E78100 - Qualcomm(R) Oryon(TM) CPU"; reliable for
  the platform, which the device table maps to a SoC and arch). Linux/Android: ``/sys/devices/soc0/machine``
  (Qualcomm's socinfo driver: the part number, "SM8650"), else ``/proc/device-tree/compatible``
  ("qcom,sm8650"). Either may be missing (a container, a kernel without socinfo): the SoC is then unknown and
  the bundle's arch is not checked (QNN then fails at context load with an error code if it does not match).
- **The SoC's Hexagon arch** comes from the device table (`hycoc.targets.profiles.DEVICES`), never from the OS.
- **x64 Python on an ARM64 Windows host** (Windows runs it under emulation): the native machine from
  ``IsWow64Process2`` (Win32 API; its ``pNativeMachine`` is the host's, IMAGE_FILE_MACHINE_ARM64 = 0xAA64, even in
  an emulated x64 process) against ``sysconfig.get_platform()`` (the build of this interpreter: "win-amd64",
  "win-arm64"). ``platform.machine()`` cannot tell: under emulation it reports AMD64.
- **HYCOC_DEVICE** (environment): a device name as ``hycoc build --device`` takes it; when set it replaces the
  detected SoC. It is how a user corrects a detection that failed, and the tests' seam to pretend a device
  (a v73 phone on this x86 machine).

Stdlib only (ctypes, sysconfig, platform): this module ships to the device.
"""

from __future__ import annotations

import os
import platform
import re
import sys
import sysconfig
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ENV_DEVICE = "HYCOC_DEVICE"

#: Win32 IMAGE_FILE_MACHINE_* values (winnt.h) as `IsWow64Process2` returns them.
_MACHINES = {0x8664: "x86_64", 0xAA64: "arm64", 0x014C: "x86", 0x01C4: "arm"}


@dataclass(frozen=True)
class DeviceIdentity:
    """The device the runtime sees.

    os: ``"windows"``, ``"linux"``, ``"android"`` or ``platform.system()`` lower-cased. machine: the host's native
    CPU architecture (``"arm64"``, ``"x86_64"``). python_machine: the architecture this interpreter was built for.
    soc_model / htp_arch / name: the SoC part number, its Hexagon arch and the device table's name (None when not
    known). source: where the SoC came from (a path, the registry value, ``HYCOC_DEVICE``), or why it is unknown.
    """

    os: str
    machine: str
    python_machine: str
    soc_model: str | None = None
    htp_arch: int | None = None
    name: str | None = None
    source: str = ""

    @property
    def emulated(self) -> bool:
        """An x64 (or x86) Python on an ARM64 host: Windows runs it under emulation, and pip gave it x64 wheels
        (onnxruntime-qnn's win_amd64 wheel runs the HTP *simulator*, not the NPU)."""
        return self.machine == "arm64" and self.python_machine in ("x86_64", "x86")

    @property
    def simulator(self) -> bool:
        """An x86 host: onnxruntime-qnn runs HTP context binaries on its x86 HTP simulator, which takes any arch."""
        return self.machine in ("x86_64", "x86")

    def describe(self) -> str:
        """One line: the device, its arch and where they were read."""
        if self.soc_model:
            what = f"{self.name or 'unknown device'} ({self.soc_model}, Hexagon v{self.htp_arch})"
        elif self.simulator:
            what = "an x86 host (the QNN HTP simulator)"
        else:
            what = "an unknown SoC"
        return f"{what}, {self.os} {self.machine}, Python for {self.python_machine} ({self.source})"


def _norm_machine(m: str) -> str:
    m = m.lower()
    return {
        "amd64": "x86_64",
        "x64": "x86_64",
        "aarch64": "arm64",
        "arm64": "arm64",
        "i386": "x86",
        "i686": "x86",
        "win32": "x86",
    }.get(m, m)


def python_machine(plat: str | None = None) -> str:
    """The architecture this interpreter was built for, from ``sysconfig.get_platform()`` (``"win-arm64"`` ->
    ``"arm64"``, ``"win-amd64"`` -> ``"x86_64"``, ``"linux-aarch64"`` -> ``"arm64"``)."""
    plat = sysconfig.get_platform() if plat is None else plat
    return _norm_machine(plat.rsplit("-", 1)[-1] if "-" in plat else plat)


def windows_native_machine() -> str | None:
    """The host's native architecture on Windows from ``kernel32.IsWow64Process2`` (Windows 10 1709+); None where
    the call is not available (not Windows, an older Windows)."""
    if sys.platform != "win32":
        return None
    try:
        import ctypes
        from ctypes import wintypes

        kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)
        fn = kernel32.IsWow64Process2
    except (AttributeError, OSError):
        return None
    process, native = wintypes.USHORT(), wintypes.USHORT()
    if not fn(kernel32.GetCurrentProcess(), ctypes.byref(process), ctypes.byref(native)):
        return None
    return _MACHINES.get(native.value, hex(native.value))


def windows_processor_name() -> str | None:
    """``ProcessorNameString`` of CPU 0 from the Windows registry; None off Windows or when it cannot be read."""
    if sys.platform != "win32":
        return None
    try:
        import winreg
    except ImportError:
        return None
    try:
        with winreg.OpenKey(winreg.HKEY_LOCAL_MACHINE, r"HARDWARE\DESCRIPTION\System\CentralProcessor\0") as key:
            return str(winreg.QueryValueEx(key, "ProcessorNameString")[0])
    except OSError:
        return None


def soc_from_processor_name(text: str) -> str | None:
    """The device-table name a Windows processor name means ("Snapdragon(R) X Elite - X1E78100 - Qualcomm(R)
    Oryon(TM) CPU" -> "Snapdragon X Elite"), by the table's aliases; None when none matches."""
    from hycoc.targets.profiles import DEVICES, fold_name

    folded = fold_name(text)
    best = None
    for d in DEVICES:
        for alias in (d.name, *d.aliases):
            f = fold_name(alias)
            if len(f) >= 3 and f in folded and (best is None or len(f) > best[0]):
                best = (len(f), d.name)
    return None if best is None else best[1]


def soc_from_linux(root: str | os.PathLike = "/") -> tuple[str | None, str]:
    """(SoC part number, source) from ``/sys/devices/soc0/machine``, else the first ``qcom,<part>`` of
    ``/proc/device-tree/compatible`` (NUL-separated); (None, why) when neither names one. ``root``: a test's fake
    file-system root."""
    root = Path(root)
    machine = root / "sys/devices/soc0/machine"
    try:
        text = machine.read_text(encoding="ascii", errors="replace").strip()
        if text:
            return text.upper(), "/sys/devices/soc0/machine"
    except OSError:
        pass
    compatible = root / "proc/device-tree/compatible"
    try:
        for entry in compatible.read_bytes().split(b"\0"):
            m = re.fullmatch(rb"qcom,([a-z]+[0-9]+[a-z0-9]*)", entry.strip())
            if m:
                return m.group(1).decode().upper(), "/proc/device-tree/compatible"
    except OSError:
        pass
    return None, "no /sys/devices/soc0/machine nor a qcom entry in /proc/device-tree/compatible"


def detect_device(
    env: Mapping[str, str] | None = None,
    *,
    system: str | None = None,
    machine: str | None = None,
    py_machine: str | None = None,
    processor_name: str | None = None,
    linux_root: str | os.PathLike = "/",
) -> DeviceIdentity:
    """The device this process runs on (module docstring). Every argument overrides what is read from the system
    (tests; ``env`` defaults to ``os.environ``). Raises UnknownTargetError when ``HYCOC_DEVICE`` names no known
    device (the message lists them)."""
    from hycoc.targets.profiles import device_for_soc, resolve_device

    env = os.environ if env is None else env
    system = (system or platform.system()).lower()
    if system == "linux" and ("ANDROID_ROOT" in env or "ANDROID_DATA" in env):
        system = "android"
    if system == "windows":
        native = machine or windows_native_machine() or _norm_machine(platform.machine())
    else:
        native = machine or _norm_machine(platform.machine())
    native = _norm_machine(native)
    py = python_machine(py_machine) if py_machine else python_machine()
    base: dict[str, Any] = {"os": system, "machine": native, "python_machine": py}
    if env.get(ENV_DEVICE):
        d = resolve_device(env[ENV_DEVICE])
        return DeviceIdentity(
            **base, soc_model=d.soc_model, htp_arch=d.htp_arch, name=d.name, source=f"{ENV_DEVICE}={env[ENV_DEVICE]!r}"
        )
    if system == "windows":
        text = processor_name if processor_name is not None else windows_processor_name()
        found = soc_from_processor_name(text) if text else None
        if found is None:
            return DeviceIdentity(**base, source=f"processor name {text!r} names no known Snapdragon")
        d = resolve_device(found)
        return DeviceIdentity(
            **base,
            soc_model=d.soc_model,
            htp_arch=d.htp_arch,
            name=d.name,
            source=f"Windows ProcessorNameString {text!r}",
        )
    if system in ("linux", "android"):
        soc, source = soc_from_linux(linux_root)
        entry = device_for_soc(soc) if soc else None
        if entry is None:
            return DeviceIdentity(
                **base, soc_model=soc, source=source if soc is None else f"{source}: {soc} is in no profile"
            )
        return DeviceIdentity(
            **base, soc_model=entry.soc_model, htp_arch=entry.htp_arch, name=entry.name, source=source
        )
    return DeviceIdentity(**base, source=f"no SoC detection on {system}")


__all__ = [
    "ENV_DEVICE",
    "DeviceIdentity",
    "detect_device",
    "python_machine",
    "soc_from_linux",
    "soc_from_processor_name",
    "windows_native_machine",
    "windows_processor_name",
]
