"""CI check: hycoc's device-runtime install resolves to binary wheels on the device platforms (docs/windows-on-
snapdragon.md), with pip's own resolver, without installing anything.

    python .ci/resolve_wheels.py            # from the repository root, in the CI's virtual environment

Each platform is one ``pip install --dry-run --ignore-installed --target TMP --only-binary=:all: --platform ...
--python-version ... --report FILE`` (pip docs, "pip install": ``--dry-run``, ``--report``; ``--platform`` needs
``--target`` or ``--dry-run`` with ``--ignore-installed``), both run at once:

The requirements are read from pyproject.toml (``[project] dependencies`` plus an extra), not ``.`` itself, so pip
resolves without building hycoc (a build environment costs more time than the resolve).

- ``win_arm64``, Python 3.12, dependencies + ``qnn``: numpy + onnxruntime + onnxruntime-qnn (QnnHtp.dll, the
  NPU). Python 3.11 does not resolve there: PyYAML (tokenizers -> huggingface-hub -> pyyaml) ships win_arm64 wheels for
  cp312 and newer only.
- ``manylinux aarch64`` (tags 2_28, 2_17 = 2014), Python 3.11, dependencies: the CPU EP only; onnxruntime-qnn has
  no Linux aarch64 wheel, which the check reports rather than requires.

Outcome per platform: ``ok`` (resolved; the wheels of the runtime's own packages printed), ``unresolvable`` (pip
says no set of binary wheels satisfies the install: CI fails), or ``skipped`` (the registry did not answer: a
connection error, a timeout, a 5xx, or the whole check past `DEADLINE_S`; printed loudly, CI goes on). A registry
hiccup therefore never fails CI, and a real packaging break does. Exit status: 1 when any platform is
``unresolvable`` or resolved to a wrong wheel, else 0.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Seconds the whole check may take (both resolves run at once; each took ~10-12 s here).
DEADLINE_S = 60

#: (label, pyproject extra or None, python version, pip --platform tags, packages whose wheel is printed and must
#: be binary for the platform).
PLATFORMS = (
    ("win_arm64", "qnn", "3.12", ("win_arm64",), ("onnxruntime", "onnxruntime-qnn", "numpy", "tokenizers")),
    (
        "manylinux aarch64",
        None,
        "3.11",
        ("manylinux_2_28_aarch64", "manylinux_2_17_aarch64", "manylinux2014_aarch64"),
        ("onnxruntime", "numpy", "tokenizers"),
    ),
)


def requirements(pyproject: Path, extra: str | None) -> list[str]:
    """The runtime install's requirement strings: ``[project] dependencies`` plus ``extra``'s, from pyproject.toml."""
    import tomllib

    project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
    return [*project["dependencies"], *(project["optional-dependencies"][extra] if extra else [])]


#: Lines pip prints when the registry, not the packages, is the problem (urllib3 / pip network errors).
NETWORK_MARKERS = re.compile(
    r"NewConnectionError|ConnectTimeoutError|ReadTimeoutError|Read timed out|Max retries exceeded|"
    r"Temporary failure in name resolution|Name or service not known|Connection refused|Connection reset|"
    r"Network is unreachable|ProxyError|SSLError|Could not fetch URL|HTTP error 5\d\d|\b50[234]\b.*(Server|Gateway)|"
    r"connection broken by",
    re.IGNORECASE,
)
#: Lines pip prints when no set of distributions satisfies the requirements.
RESOLUTION_MARKERS = re.compile(r"ResolutionImpossible|No matching distribution found|conflicting dependencies")


def classify(returncode: int, output: str) -> str:
    """``ok``, ``skipped`` (the registry did not answer: any `NETWORK_MARKERS` line) or ``unresolvable`` (pip
    failed without a network error: `RESOLUTION_MARKERS`, or any other failure) for one pip run."""
    if returncode == 0:
        return "ok"
    if NETWORK_MARKERS.search(output):
        return "skipped"
    return "unresolvable"


def pip_command(
    requirements: list[str], python_version: str, platforms: tuple[str, ...], target: str, report: str
) -> list[str]:
    """The ``pip install --dry-run`` command of one platform (module docstring); short network timeouts so a
    registry that hangs is reported as skipped inside `DEADLINE_S`. ``--retries 1``, never 0: pip names a
    connection error only in its "Retrying ... after connection broken by" warning; with no retry a refused
    connection reads as "(from versions: none)", as a package without wheels does."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--dry-run",
        "--ignore-installed",
        "--target",
        target,
        "--only-binary=:all:",
        "--python-version",
        python_version,
        "--report",
        report,
        "--quiet",
        "--timeout",
        "15",
        "--retries",
        "1",
        "--disable-pip-version-check",
    ]
    for p in platforms:
        cmd += ["--platform", p]
    return cmd + list(requirements)


def wheels(report: dict) -> dict[str, str]:
    """Package name (lower case, ``-``) -> the file name pip picked, from a ``--report`` JSON."""
    out = {}
    for item in report.get("install", []):
        name = item["metadata"]["name"].lower().replace("_", "-")
        out[name] = item.get("download_info", {}).get("url", "").rsplit("/", 1)[-1]
    return out


def check_wheels(picked: dict[str, str], wanted: tuple[str, ...], platforms: tuple[str, ...]) -> list[str]:
    """Problems with the picked wheels: a wanted package missing, or its wheel neither for one of ``platforms`` nor
    pure Python (``none-any``)."""
    problems = []
    arch = platforms[0].rsplit("_", 1)[-1] if platforms[0].startswith("manylinux") else platforms[0]
    for name in wanted:
        f = picked.get(name)
        if f is None:
            problems.append(f"{name}: not in the resolved set")
        elif not f.endswith(".whl") or not (arch in f or f.endswith("-none-any.whl")):
            problems.append(f"{name}: {f} is not a {platforms[0]} wheel")
    return problems


def main(root: Path = Path(".")) -> int:
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hycoc-resolve-") as tmp:
        runs = []
        for i, (label, req, py, plats, wanted) in enumerate(PLATFORMS):
            report = str(Path(tmp) / f"report-{i}.json")
            cmd = pip_command(
                requirements(root / "pyproject.toml", req), py, plats, str(Path(tmp) / f"target-{i}"), report
            )
            proc = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            runs.append((label, req, py, plats, wanted, report, proc))
        failed = False
        for label, req, py, plats, wanted, report, proc in runs:
            left = max(1.0, DEADLINE_S - (time.monotonic() - start))
            try:
                output, _ = proc.communicate(timeout=left)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                print(f"resolve {label}: SKIPPED: pip did not finish within {DEADLINE_S} s (slow registry)")
                continue
            state = classify(proc.returncode, output)
            what = f"resolve {label} (Python {py}, hycoc{f'[{req}]' if req else ''}'s requirements, binary wheels only)"
            if state == "skipped":
                line = next((ln for ln in output.splitlines() if NETWORK_MARKERS.search(ln)), "")
                print(f"{what}: SKIPPED: the registry did not answer ({line.strip()[:160]})")
                continue
            if state == "unresolvable":
                failed = True
                print(f"{what}: FAILED: pip found no set of wheels:")
                print("\n".join(["  " + ln for ln in output.splitlines() if "is ignored" not in ln][-15:]))
                continue
            picked = wheels(json.loads(Path(report).read_text(encoding="utf-8")))
            problems = check_wheels(picked, wanted, plats)
            if problems:
                failed = True
                print(f"{what}: FAILED: {'; '.join(problems)}")
                continue
            print(f"{what}: ok, {len(picked)} packages: " + ", ".join(picked[n] for n in wanted))
    print(f"resolve: {time.monotonic() - start:.1f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
