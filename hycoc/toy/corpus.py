"""Training conversations for the toy family, built from real prose and code found on the build machine.

Sources (both under the PSF License 2.0, see docs/toy-family.md):

* English prose: the reStructuredText sources of the Python 3.11 documentation, Debian package
  ``python3.11-doc`` (``/usr/share/doc/python3.11/html/_sources``). Each section becomes one conversation:
  the user asks about the section title, the model answers with the section text.
* Python source: the standard library of the running interpreter. Each top-level ``def``/``class`` becomes one
  conversation: the user asks for that function or class, the model answers with its code.

Everything is deterministic: files are read in sorted order, and a conversation goes to the held-out split
when the sha256 of its text falls in the lowest ``heldout_fraction`` of the hash range.
"""

from __future__ import annotations

import hashlib
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

DOCS_DIR = Path("/usr/share/doc/python3.11/html/_sources")
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")
_DEF = re.compile(r"^(def|class|async def) (\w+)")

_PROSE_ASKS = [
    "Explain {t}.",
    "What is {t}?",
    "Tell me about {t}.",
    "Describe {t} in detail.",
    "Can you give an overview of {t}?",
    "Write a short guide to {t}.",
]
_CODE_ASKS = [
    "Write the Python {kind} `{name}` from the `{mod}` module.",
    "Show me how `{mod}.{name}` is implemented.",
    "Implement `{name}` ({kind}) as in Python's `{mod}`.",
]


@dataclass(frozen=True)
class Conversation:
    """One single-turn conversation. source: "docs" or "code"; user/model: the two turns' text."""

    source: str
    user: str
    model: str

    @property
    def heldout_key(self) -> float:
        h = hashlib.sha256((self.user + "\x00" + self.model).encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64


def _pick(options: list[str], key: str) -> str:
    return options[int(hashlib.md5(key.encode()).hexdigest(), 16) % len(options)]


def _clean_rst(text: str) -> str:
    text = re.sub(
        r"^\.\. (index|highlight|module|currentmodule|sectionauthor|moduleauthor|versionadded|"
        r"versionchanged|deprecated|testsetup|testcleanup|_[^:]*):.*$",
        "",
        text,
        flags=re.M,
    )
    text = re.sub(r":(\w+):`~?([^`<]*?)(\s*<[^>]*>)?`", r"`\2`", text)  # :func:`x` -> `x`
    text = re.sub(r"\n{3,}", "\n\n", text)
    return text.strip()


def docs_conversations(docs_dir: Path = DOCS_DIR, max_chars: int = 6000) -> list[Conversation]:
    """Sections of the Python docs' reST sources as conversations (title -> section text, <= max_chars).

    Raises FileNotFoundError with the install step when the docs are missing.
    """
    if not docs_dir.is_dir():
        raise FileNotFoundError(
            f"{docs_dir} is missing: install Debian's python3.11-doc (`apt-get install -y python3.11-doc`)"
        )
    out = []
    for path in sorted(docs_dir.rglob("*.txt")):
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        sections: list[tuple[str, list[str]]] = []
        for i, line in enumerate(lines):
            if _UNDERLINE.match(line) and i > 0 and lines[i - 1].strip() and not _UNDERLINE.match(lines[i - 1]):
                if sections:
                    sections[-1][1].pop()  # the title line belongs to the new section
                sections.append((lines[i - 1].strip(), []))
            elif sections:
                sections[-1][1].append(line)
        for title, body in sections:
            text = _clean_rst("\n".join(body))
            title = re.sub(r"[:`*]", "", title).strip()
            if len(text) < 200 or not title:
                continue
            ask = _pick(_PROSE_ASKS, path.name + title).format(t=title)
            out.append(Conversation("docs", ask, text[:max_chars]))
    return out


def code_conversations(stdlib: Path | None = None, max_chars: int = 6000) -> list[Conversation]:
    """Top-level functions and classes of the standard library (no tests, no idlelib) as conversations."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(stdlib.rglob("*.py")):
        rel = path.relative_to(stdlib)
        if any(p in ("test", "tests", "idlelib", "site-packages", "lib2to3", "turtledemo") for p in rel.parts):
            continue
        mod = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        starts = [i for i, line in enumerate(lines) if _DEF.match(line)]
        for j, s in enumerate(starts):
            end = starts[j + 1] if j + 1 < len(starts) else len(lines)
            block = lines[s:end]
            while block and (not block[-1].strip() or not block[-1].startswith((" ", "\t"))):
                if block[-1].startswith((" ", "\t")) or len(block) == 1:
                    break
                block.pop()
            code = "\n".join(block).rstrip()
            if len(code) < 120:
                continue
            m = _DEF.match(lines[s])
            if m is None:  # never: starts are the lines _DEF matches
                continue
            kind = "class" if m.group(1) == "class" else "function"
            ask = _pick(_CODE_ASKS, mod + m.group(2)).format(kind=kind, name=m.group(2), mod=mod)
            out.append(Conversation("code", ask, code[:max_chars]))
    return out


def build_corpus(heldout_fraction: float = 0.03) -> tuple[list[Conversation], list[Conversation]]:
    """(train, heldout) conversations from both sources, in a fixed order."""
    convs = docs_conversations() + code_conversations()
    train = [c for c in convs if c.heldout_key >= heldout_fraction]
    held = [c for c in convs if c.heldout_key < heldout_fraction]
    return train, held
