"""Keep-set pass (paper §3.3, App. A) on a hand-made tokenizer and corpus, where every id is known.

Vocabulary (267 ids): 0-2 the special tokens <pad> <bos> <eot>; 3-258 the byte tokens <0x00>..<0xFF>;
259 the, 260 sat, 261 mat, 262 안녕 (Hangul: forced), 263 dog, 264 cat, 265 on, 266 <unk> (not special).
Assistant turns of the corpus count: the 3, sat 2, dog 2, cat 2, on 1, mat 1, 안녕 1 (12 tokens); the user turns
("mat on ...") must not count.
"""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
from hycoc.passes.artifacts import KeepSetArtifact, TokenizerArtifact
from hycoc.passes.keep_set import (
    KeepSetError,
    KeepSetPass,
    byte_token_ids,
    forced_range_ids,
    read_corpus,
    select_keep_set,
)
from hycoc.passes.pipeline import Pipeline
from rich.console import Console
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from hycoc.recipe import KeepSet, Recipe

SPECIALS = ["<pad>", "<bos>", "<eot>"]
WORDS = ["the", "sat", "mat", "안녕", "dog", "cat", "on", "<unk>"]
ALWAYS = list(range(259)) + [262]  # specials, bytes, the Hangul word

CONVERSATIONS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "mat on mat on"},
            {"role": "assistant", "content": "the cat sat on the mat"},
        ]
    },
    {"user": "mat mat mat", "model": "the dog sat"},
    {
        "messages": [
            {"role": "user", "content": "on"},
            {"role": "model", "content": [{"type": "text", "text": "dog cat 안녕"}]},
        ]
    },
    {"user": "never read", "model": "cat cat cat cat cat cat"},  # beyond corpus_conversations = 3
]


def tokenizer() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()
    tok.add_special_tokens(SPECIALS)
    return tok


def write_corpus(tmp_path, lines=CONVERSATIONS):
    path = tmp_path / "corpus.jsonl"
    path.write_text("\n".join(json.dumps(c, ensure_ascii=False) for c in lines) + "\n", encoding="utf-8")
    return path


def config(size: int, **kw) -> KeepSet:
    return KeepSet(size=size, corpus_conversations=3, forced_ranges=["U+AC00-U+D7A3"], **kw)


def select(tmp_path, size: int, **kw) -> KeepSetArtifact:
    turns, read = read_corpus(write_corpus(tmp_path), 3)
    return select_keep_set(tokenizer(), turns, config(size, **kw), conversations=read, corpus="c")


def test_classes():
    tok = tokenizer()
    assert byte_token_ids(tok) == list(range(3, 259))
    assert forced_range_ids(tok, [(0xAC00, 0xD7A3)]) == [262]
    assert forced_range_ids(tok, []) == []


def test_corpus_reads_only_assistant_turns_of_the_first_n_conversations(tmp_path):
    turns, read = read_corpus(write_corpus(tmp_path), 3)
    assert (turns, read) == (["the cat sat on the mat", "the dog sat", "dog cat 안녕"], 3)


def test_exact_ids_with_frequency_ties_by_lower_id(tmp_path):
    keep = select(tmp_path, 263)
    # Three free slots: the (3), then sat, dog, cat tie at 2 -> sat (260) and dog (263); cat (264) is left out.
    assert keep.payload.dtype == np.int64
    assert keep.payload.tolist() == ALWAYS[:259] + [259, 260, 262, 263]
    s = keep.stats
    assert (s.size, s.special, s.byte, s.forced, s.frequent, s.frequent_unseen) == (263, 3, 256, 1, 3, 0)
    assert (s.conversations, s.assistant_tokens, s.covered_tokens) == (3, 12, 8)
    assert s.coverage == pytest.approx(8 / 12)


def test_unseen_ids_fill_by_lowest_id(tmp_path):
    keep = select(tmp_path, 267)
    assert keep.payload.tolist() == list(range(267))
    assert (keep.stats.frequent, keep.stats.frequent_unseen, keep.stats.coverage) == (7, 1, 1.0)


def test_classes_can_be_switched_off(tmp_path):
    keep = select(tmp_path, 4, always_special=False, always_bytes=False)
    assert keep.payload.tolist() == [259, 260, 262, 263]  # 안녕 forced, then the, sat, dog
    assert (keep.stats.special, keep.stats.byte, keep.stats.forced, keep.stats.frequent) == (0, 0, 1, 3)


def test_size_below_the_always_kept_classes(tmp_path):
    with pytest.raises(
        KeepSetError,
        match=r"keep_set.size = 259 is smaller than the 260 always-kept tokens "
        r"\(3 special \+ 256 byte \+ 1 forced-range\)",
    ):
        select(tmp_path, 259)
    with pytest.raises(KeepSetError, match="keep_set.size = 300 exceeds the tokenizer's vocabulary of 267 ids"):
        select(tmp_path, 300)


def test_empty_and_malformed_corpus(tmp_path):
    path = write_corpus(tmp_path, [{"user": "the", "model": ""}, {"messages": [{"role": "user", "content": "x"}]}])
    turns, read = read_corpus(path, 3)
    with pytest.raises(KeepSetError, match=r"has no assistant tokens \(2 conversations, 1 assistant turns read\)"):
        select_keep_set(tokenizer(), turns, config(263), conversations=read, corpus=str(path))
    path.write_text('{"user": "a", "model": "b"}\n{"user": oops}\n')
    with pytest.raises(KeepSetError, match=r"corpus.jsonl:2: not JSON"):
        read_corpus(path, 3)
    path.write_text('{"prompt": "a"}\n')
    with pytest.raises(KeepSetError, match=r"corpus.jsonl:1: no 'messages', 'model' or 'assistant' field"):
        read_corpus(path, 3)


def recipe_for(corpus: str, size: int = 263) -> Recipe:
    return Recipe.model_validate(
        {"keep_set": {"size": size, "corpus": corpus, "corpus_conversations": 3, "forced_ranges": ["U+AC00-U+D7A3"]}}
    )


def test_pass_in_a_pipeline_reports_and_caches(tmp_path):
    corpus = write_corpus(tmp_path)
    keep_pass = KeepSetPass()
    pipe = Pipeline([keep_pass], tmp_path / "cache", console=Console(file=io.StringIO()))
    tok = TokenizerArtifact("tokenizer", tokenizer())
    result = pipe.run(recipe_for(str(corpus)), {"tokenizer": tok})
    report = result.reports[0]
    assert report.summary == "kept 263 ids, 66.7% of assistant tokens covered"
    assert report.numbers["frequent"] == 3 and report.numbers["coverage"] == pytest.approx(0.666667)
    assert result.artifacts["keep_set"].payload.tolist() == ALWAYS[:259] + [259, 260, 262, 263]

    again = pipe.run(recipe_for(str(corpus)), {"tokenizer": tok})
    assert again.reports[0].cached and again.artifacts["keep_set"].stats.covered_tokens == 8
    # Editing the corpus file (not the recipe) invalidates the entry.
    write_corpus(tmp_path, CONVERSATIONS[:2])
    changed = pipe.run(recipe_for(str(corpus)), {"tokenizer": tok})
    assert not changed.reports[0].cached and changed.artifacts["keep_set"].stats.assistant_tokens == 9


def test_an_empty_or_missing_corpus_is_refused_naming_the_key(tmp_path):
    tok = {"tokenizer": TokenizerArtifact("tokenizer", tokenizer())}
    with pytest.raises(KeepSetError, match=r"^keep_set.corpus is empty: give a JSONL file"):
        KeepSetPass().run(tok, recipe_for("", size=261))
    with pytest.raises(KeepSetError, match=r"^keep_set.corpus: .*none.jsonl does not exist$"):
        KeepSetPass().key_material(recipe_for(str(tmp_path / "none.jsonl"), size=261))


def test_byte_level_tokenizer_of_the_toy_family():
    from hycoc.toy.tokenizer import byte_token_ids as toy_byte_ids
    from hycoc.toy.tokenizer import train_tokenizer

    tok = train_tokenizer(["안녕 안녕 안녕"] * 4, vocab_size=274)  # 12 specials + 256 bytes + 6 merges
    assert byte_token_ids(tok) == toy_byte_ids(tok)
    forced = forced_range_ids(tok, [(0xAC00, 0xD7A3)])
    # Merged tokens holding a whole syllable are forced ("안" + a partial byte included); lone bytes never are.
    assert [tok.decode([i]) for i in forced] == ["안\ufffd", "안녕", " 안녕"]
    assert not set(forced) & set(byte_token_ids(tok))
