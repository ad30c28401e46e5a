"""`hycoc doctor`: what is installed and whether the QNN EP compiles for the HTP, as rows of a table.

`package_versions` reads installed versions without importing anything (importlib.metadata); `doctor_rows` adds the
QNN EP's status (`hycoc.targets.qnn_ep.qnn_status`: loads the plugin EP and compiles a trivial 16-bit graph per HTP
arch in a child process); `render_doctor` prints them as a rich table. torch-free.
"""

from __future__ import annotations

import sys
from typing import Any

#: Packages whose versions `hycoc doctor` reports, in its order.
PACKAGES = ("hycoc", "numpy", "torch", "transformers", "tokenizers", "onnx", "onnxscript", "onnx-ir", "onnxruntime",
            "onnxruntime-qnn")


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


def doctor_rows(status: dict | None = None, versions: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
    """(item, value, style) rows of `hycoc doctor`: every `package_versions` entry ("yellow" when not installed),
    then "QNN EP loads" and "HTP archs" from ``status`` (default: `hycoc.targets.qnn_ep.qnn_status()`: keys
    loads, versions, archs {arch: {"ok"}}, compilable_archs, error). style: "" (plain), "yellow" (missing) or "red"
    (an arch that fails, or none compiles)."""
    rows = [(name, ver, "yellow" if ver == "not installed" else "")
            for name, ver in (versions if versions is not None else package_versions()).items()]
    if status is None:
        from hycoc.targets.qnn_ep import qnn_status

        status = qnn_status()
    if status["loads"]:
        sdk = status["versions"].get("qnn_sdk")
        rows.append(("QNN EP loads", f"yes (QNN SDK {sdk})" if sdk else "yes", ""))
        archs = status.get("archs") or {}
        ok = [f"v{a}" for a in status.get("compilable_archs", [])]
        bad = [f"v{a}" for a, r in archs.items() if not r["ok"]]
        text = (", ".join(ok) or "none") + (f" (fail: {', '.join(bad)})" if bad else "")
        rows.append(("HTP archs", text, "red" if bad or not ok else ""))
    else:
        rows.append(("QNN EP loads", f"no: {status['error']}", "yellow"))
        rows.append(("HTP archs", "none (no QNN EP)", "yellow"))
    return rows


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


__all__ = ["PACKAGES", "doctor_rows", "package_versions", "render_doctor"]
