"""Build benchmarks/data/long_summary_toy.jsonl: long documents for the toy family's long-document row (paper §4.1,
App. D: ∞Bench En.Sum at 32K tokens), from the corpus the toy family was trained on.

Source: the reStructuredText sources of the Python 3.11 library reference (Debian ``python3.11-doc``, read from
``hycoc.toy.corpus.DOCS_DIR / "library"`` as the toy trainer reads them; PSF License Version 2,
https://docs.python.org/3/license.html), cleaned as the toy corpus is (`hycoc.toy.corpus`). Only this maker reads
the docs; ``hycoc bench`` reads the file it writes. Each of the first ``--documents`` pages (sorted by name) whose
cleaned text is at least ``--min-chars`` long becomes one row in ∞Bench's ``longbook_sum_eng`` schema:

    answer   the reference summary: the page's ``:synopsis:`` line and its opening prose paragraphs (written by the
             documentation's authors as the page's summary)
    context  the rest of the page, cut at a line end so that the row's 2-shot prompt (HELMET's template,
             `hycoc.bench.datasets.long_summary_text`, in the toy chat template) has at most ``--max-prompt-tokens``
             toy tokens: the toy verifier holds 4,096 positions, so 3,700 leave room for the bench's 256-token
             output cap and one 33-row tree

    python benchmarks/make_long_summary.py [--docs DIR] [--out FILE]

Prints each row's prompt length. Deterministic: the same docs and tokenizer give the same file.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from hycoc.bench.datasets import LONG_SUMMARY, LongDocument, fit_context, long_summary_text
from hycoc.chat_template import load_chat
from hycoc.toy.corpus import DOCS_DIR, _clean_rst

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "recipes" / "toy" / "models" / "verifier"  # the toy checkpoint's tokenizer folder
_SYNOPSIS = re.compile(r"^\s*:synopsis:\s*(.+)$", re.M)
_UNDERLINE = re.compile(r"^([=\-~^\"'`#*+])\1{2,}\s*$")


def _prose(paragraph: str) -> bool:
    first = paragraph.lstrip()
    return (
        bool(first)
        and not paragraph[:1].isspace()
        and not first.startswith(("..", "**Source code", ":", "*"))
        and not any(_UNDERLINE.match(line) for line in paragraph.splitlines())
        and len(first) > 80
        and not first.rstrip().endswith("::")
    )  # "For example, this code::" opens a code block


def page_row(path: Path, row_id: int, min_chars: int) -> dict | None:
    """One page as an ∞Bench-schema row, or None when it has no synopsis/opening prose or is too short."""
    raw = path.read_text(encoding="utf-8", errors="replace")
    synopsis = _SYNOPSIS.search(raw)
    text = _clean_rst(raw)
    paragraphs = re.split(r"\n\s*\n", text)
    opening, start = [], None
    for i, para in enumerate(paragraphs):
        if _prose(para):
            opening.append(" ".join(para.split()))
            start = i
            if sum(map(len, opening)) >= 300 or len(opening) == 3:
                break
        elif opening:
            break
    if not opening:
        return None
    context = "\n\n".join(paragraphs[start + 1 :]).strip()
    if len(context) < min_chars:
        return None
    summary = " ".join(([synopsis.group(1).strip().rstrip(".") + "."] if synopsis else []) + opening)
    source = f"library/{path.name.removesuffix('.txt')} (Python 3.11 documentation, PSF License Version 2)"
    return {"id": row_id, "context": context, "input": "", "answer": [summary], "options": [], "source": source}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=Path, default=DOCS_DIR / "library")
    ap.add_argument("--out", type=Path, default=LONG_SUMMARY)
    ap.add_argument("--documents", type=int, default=20)
    ap.add_argument("--min-chars", type=int, default=16000)
    ap.add_argument("--max-prompt-tokens", type=int, default=3700)
    args = ap.parse_args(argv)
    if not args.docs.is_dir():
        sys.exit(f"{args.docs} is missing: install Debian's python3.11-doc (apt-get install -y python3.11-doc)")
    chat = load_chat(TOKENIZER, TOKENIZER)
    rows = []
    for path in sorted(args.docs.glob("*.rst.txt")):
        row = page_row(path, len(rows), args.min_chars)
        if row is not None:
            rows.append(row)
        if len(rows) == args.documents:
            break
    docs = [LongDocument(r["id"], r["context"], tuple(r["answer"])) for r in rows]

    def count(text):
        return len(chat.prompt(text))

    for i, row in enumerate(rows):
        row["context"] = fit_context(docs, i, count, args.max_prompt_tokens)
        n = count(long_summary_text(docs, i, row["context"]))
        print(
            f"{row['id']:3d} {row['source'].split(' ')[0]:32s} prompt {n} tokens, context {len(row['context'])} "
            f"chars, summary {len(row['answer'][0])} chars"
        )
    tmp = args.out.with_name(f".{args.out.name}.tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(rows)} documents")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
