"""Byte-level BPE tokenizer of the toy family (HF ``tokenizers``), with Gemma 4's special and turn tokens.

Ids 0..11 are `hycoc.toy.chat_files.SPECIAL_TOKENS` (Gemma 4's names), then the 256 byte tokens of the byte-level
alphabet (any string, Hangul or emoji included, encodes through them), then the learned merges, up to ``vocab_size``.
"""

from __future__ import annotations

from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from hycoc.toy.chat_files import SPECIAL_TOKENS


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Train the toy tokenizer on `texts`. Returns a Tokenizer whose vocabulary has exactly `vocab_size` ids."""
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"tokenizer has {tok.get_vocab_size()} ids, expected {vocab_size}: corpus too small")
    return tok


def byte_token_ids(tok: Tokenizer) -> list[int]:
    """Ids of the 256 single-byte tokens (sorted), the keep set's always-kept byte class (paper App. A)."""
    ids = {ch: tok.token_to_id(ch) for ch in pre_tokenizers.ByteLevel.alphabet()}
    missing = sorted(ch for ch, i in ids.items() if i is None)
    if missing:
        raise ValueError(f"the tokenizer has no token for the byte-level characters {missing}: not a byte-level BPE")
    return sorted(i for i in ids.values() if i is not None)
