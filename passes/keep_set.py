"""Keep-set pass: the restricted output vocabulary of both drafters (paper §3.3, App. A).

The keep set always holds the special tokens, the 256 byte tokens (which spell any string) and every token whose
text contains a code point of the recipe's forced Unicode ranges (the paper: all 4,678 Hangul tokens); the rest
of ``keep_set.size`` are the tokens most frequent in the assistant turns of the recipe's corpus (the paper: 20,000
UltraChat train conversations, 86,089 tokens in all). Frequency ties go to the lower id, so the set is a pure
function of tokenizer, corpus and recipe.

Classes, as counted here:

* special: the tokenizer's added tokens flagged ``special`` (Gemma 4's ``<bos>``, ``<|turn>``, ...);
* byte: the 256 byte-fallback tokens ``<0x00>``..``<0xFF>`` (SentencePiece-style, Gemma) or, failing that, the
  256 characters of the byte-level alphabet (GPT-2 style, the toy tokenizer);
* forced: ids whose single-token decoded text contains a code point inside ``keep_set.forced_ranges`` (a token
  holding only part of a UTF-8 sequence decodes to U+FFFD and is not forced);
* frequent: the remaining ids by count in the assistant turns, each turn encoded alone without special tokens.
  When the corpus has fewer distinct tokens than free slots, unseen ids fill the rest by lowest id
  (``KeepSetStats.frequent_unseen`` says how many).

Corpus: ``keep_set.corpus``, a JSONL file, one conversation a line, either
``{"messages": [{"role": "user", "content": ...}, {"role": "assistant", "content": ...}, ...]}`` (role
``assistant`` or ``model``; content a string or a list of ``{"type": "text", "text": ...}`` parts) or
``{"user": ..., "model": ...}`` (or ``"assistant"``); the first ``keep_set.corpus_conversations`` lines are read.
The corpus is a file the recipe names (the toy recipe: ``recipes/toy/data/conversations.jsonl``, the toy verifier's
answers to training prompts, made by ``python -m hycoc.toy.train --stages conversations``); the pass reads nothing
else, and an empty ``keep_set.corpus`` is an error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from hycoc.passes.artifacts import KeepSetArtifact, KeepSetStats, TokenizerArtifact
from hycoc.passes.pipeline import Pass, PassReport

from hycoc.bundle import sha256_file
from hycoc.jsonl import iter_jsonl
from hycoc.recipe import KeepSet, Recipe

_ENCODE_CHUNK = 1024  # turns per encode_batch call, to bound memory


class KeepSetError(ValueError):
    """A keep set that cannot be built: size too small for the always-kept classes or above the vocabulary, an
    empty or malformed corpus, a tokenizer without byte tokens. The message names the recipe key involved."""


# ---- corpus -------------------------------------------------------------------------------------------------


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(p["text"] for p in content if p.get("type") == "text" and isinstance(p.get("text"), str))
    raise KeepSetError(f"{where}: message content must be a string or a list of text parts, got {content!r:.60}")


def assistant_turns(conversation: Any, where: str) -> list[str]:
    """The assistant (model) turns of one JSONL conversation in either accepted form (module docstring)."""
    if not isinstance(conversation, dict):
        raise KeepSetError(f"{where}: a conversation must be a JSON object")
    if "messages" in conversation:
        messages = conversation["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise KeepSetError(f'{where}: \'messages\' must be a list of {{"role", "content"}} objects')
        return [_text(m.get("content", ""), where) for m in messages if m.get("role") in ("assistant", "model")]
    for key in ("model", "assistant"):
        if key in conversation:
            return [_text(conversation[key], where)]
    raise KeepSetError(f"{where}: no 'messages', 'model' or 'assistant' field; keys: {sorted(conversation)}")


def read_corpus(path: Path, conversations: int) -> tuple[list[str], int]:
    """Assistant turns of the first ``conversations`` conversations of a JSONL file -> (turns, conversations read).

    Raises KeepSetError on a missing file or a line that is not a conversation (naming file and line).
    """
    if not path.is_file():
        raise KeepSetError(f"keep_set.corpus: {path} does not exist")
    turns: list[str] = []
    read = 0
    for where, _, conversation in iter_jsonl(path, KeepSetError, limit=conversations):
        turns.extend(assistant_turns(conversation, where))
        read += 1
    return turns, read


# ---- token classes ------------------------------------------------------------------------------------------


def special_token_ids(tok) -> list[int]:
    """Sorted ids of the added tokens flagged special. tok: a `tokenizers.Tokenizer`."""
    return sorted(i for i, added in tok.get_added_tokens_decoder().items() if added.special)


def byte_token_ids(tok) -> list[int]:
    """Sorted ids of the 256 byte tokens: ``<0x00>``..``<0xFF>`` if all exist, else the byte-level alphabet.

    Raises KeepSetError when the tokenizer has neither (set ``keep_set.always_bytes = false`` for it).
    """
    from tokenizers import pre_tokenizers

    vocab = tok.get_vocab(with_added_tokens=True)
    for candidates in ([f"<0x{b:02X}>" for b in range(256)], pre_tokenizers.ByteLevel.alphabet()):
        ids = [vocab.get(t) for t in candidates]
        if all(i is not None for i in ids):
            return sorted(ids)
    raise KeepSetError(
        "keep_set.always_bytes = true, but the tokenizer has neither the 256 byte-fallback tokens "
        "<0x00>..<0xFF> nor the 256 byte-level alphabet tokens"
    )


def forced_range_ids(tok, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """Sorted ids whose single-token decoded text has a code point in one of the inclusive ``ranges``."""
    if not ranges:
        return []
    texts = tok.decode_batch(
        [[i] for i in range(tok.get_vocab_size(with_added_tokens=True))], skip_special_tokens=False
    )
    return [i for i, text in enumerate(texts) if any(lo <= ord(ch) <= hi for ch in text for lo, hi in ranges)]


def count_tokens(tok, turns: Iterable[str]) -> np.ndarray:
    """Occurrences of every id in the turns, each encoded alone without special tokens. int64 [vocab_size]."""
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    counts = np.zeros(vocab_size, dtype=np.int64)
    turns = list(turns)
    for start in range(0, len(turns), _ENCODE_CHUNK):
        for encoding in tok.encode_batch(turns[start : start + _ENCODE_CHUNK], add_special_tokens=False):
            counts += np.bincount(np.asarray(encoding.ids, dtype=np.int64), minlength=vocab_size)
    return counts


# ---- the selection ------------------------------------------------------------------------------------------


def select_keep_set(tok, turns: Sequence[str], config: KeepSet, *, conversations: int, corpus: str) -> KeepSetArtifact:
    """Build the keep set (module docstring) from a tokenizer, assistant turns and the ``[keep_set]`` table.

    ``conversations`` and ``corpus`` (a name for reports) are recorded in the stats. Returns a `KeepSetArtifact`
    whose payload is a sorted int64 array of ``config.size`` ids. Raises KeepSetError when the size exceeds the
    vocabulary or is smaller than the always-kept classes, or when the turns hold no tokens.
    """
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    if config.size > vocab_size:
        raise KeepSetError(f"keep_set.size = {config.size} exceeds the tokenizer's vocabulary of {vocab_size} ids")
    counts = count_tokens(tok, turns)
    total = int(counts.sum())
    if total == 0:
        raise KeepSetError(
            f"keep_set.corpus: {corpus} has no assistant tokens ({conversations} conversations, "
            f"{len(turns)} assistant turns read)"
        )

    kept = np.zeros(vocab_size, dtype=bool)
    added: dict[str, int] = {}
    classes = [
        ("special", special_token_ids(tok) if config.always_special else []),
        ("byte", byte_token_ids(tok) if config.always_bytes else []),
        ("forced", forced_range_ids(tok, config.code_point_ranges())),
    ]
    for name, class_ids in classes:
        new = np.asarray(class_ids, dtype=np.int64)
        new = new[~kept[new]]
        kept[new] = True
        added[name] = len(new)
    always = int(kept.sum())
    if always > config.size:
        raise KeepSetError(
            f"keep_set.size = {config.size} is smaller than the {always} always-kept tokens "
            f"({added['special']} special + {added['byte']} byte + {added['forced']} forced-range)"
        )

    # Most frequent first, ties by lower id (lexsort: last key is the primary one).
    order = np.lexsort((np.arange(vocab_size), -counts))
    order = order[~kept[order]][: config.size - always]
    kept[order] = True
    ids = np.flatnonzero(kept).astype(np.int64)
    stats = KeepSetStats(
        size=len(ids),
        vocab_size=vocab_size,
        special=added["special"],
        byte=added["byte"],
        forced=added["forced"],
        frequent=len(order),
        frequent_unseen=int((counts[order] == 0).sum()),
        conversations=conversations,
        assistant_tokens=total,
        covered_tokens=int(counts[ids].sum()),
        corpus=corpus,
    )
    return KeepSetArtifact("keep_set", ids, stats)


def corpus_path(recipe: Recipe) -> Path:
    """The recipe's ``keep_set.corpus`` as a path. Raises KeepSetError when it is empty or missing."""
    path = recipe.resolve_path(recipe.keep_set.corpus)
    if path is None:
        raise KeepSetError(
            "keep_set.corpus is empty: give a JSONL file of conversations whose assistant turns the "
            "keep set counts (the paper: 20,000 UltraChat 200k train_sft conversations; the toy "
            "recipe ships toy/data/conversations.jsonl)"
        )
    if not path.is_file():
        raise KeepSetError(f"keep_set.corpus: {path} does not exist")
    return path


class KeepSetPass(Pass):
    """tokenizer -> keep_set, reading ``[keep_set]`` (module docstring)."""

    name = "keep_set"
    section = "keep_set"
    consumes = {"tokenizer": TokenizerArtifact}
    produces = {"keep_set": KeepSetArtifact}

    def key_material(self, recipe: Recipe) -> dict[str, Any]:
        # The corpus is read from outside the pipeline: its bytes enter the key.
        return {"corpus_sha256": sha256_file(corpus_path(recipe))}

    def run(self, inputs: dict[str, Any], recipe: Recipe) -> tuple[dict[str, KeepSetArtifact], PassReport]:
        config = recipe.keep_set
        path = corpus_path(recipe)
        turns, read = read_corpus(path, config.corpus_conversations)
        keep = select_keep_set(inputs["tokenizer"].payload, turns, config, conversations=read, corpus=str(path))
        s = keep.stats
        assert s is not None
        report = PassReport(
            f"kept {s.size} ids, {s.coverage:.1%} of assistant tokens covered",
            {
                "size": s.size,
                "special": s.special,
                "byte": s.byte,
                "forced": s.forced,
                "frequent": s.frequent,
                "frequent_unseen": s.frequent_unseen,
                "conversations": s.conversations,
                "assistant_tokens": s.assistant_tokens,
                "coverage": round(s.coverage, 6),
            },
        )
        return {"keep_set": keep}, report
