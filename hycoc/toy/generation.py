"""Sampled answers of the toy verifier to a batch of prompts, as the trainer's selfgen stage
(`hycoc.toy.train.self_generate`) and the conversation files (`hycoc.toy.conversations.answer_batch`) draw them."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from hycoc.models import generate_answers


def sample_answers(
    verifier, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, pad: int, stops: Collection[int], **sampling
) -> list[list[int]]:
    """One transformers ``generate`` call over the left-padded ``prompts`` (token id lists), sampling
    (``do_sample=True`` and ``sampling``'s generate arguments: temperature, top_k, top_p, eos_token_id, ...), at most
    ``max_new_tokens`` new ids each (`hycoc.models.generate_answers`). Returns each prompt's new ids, cut after the
    first id in ``stops``."""
    return generate_answers(verifier, prompts, max_new_tokens, pad=pad, stops=stops, do_sample=True, **sampling)
