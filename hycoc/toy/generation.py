"""Sampled answers of the toy verifier to a batch of prompts, as the trainer's selfgen stage
(`hycoc.toy.train.self_generate`) and the conversation files (`hycoc.toy.conversations.answer_batch`) draw them."""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch


def left_padded(prompts: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, attention mask), both int64 (N, longest prompt): each prompt right-aligned after ``pad`` ids, its mask 0
    over the padding and 1 over the prompt."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def cut_at_stop(row: Sequence[int], stops: Collection[int]) -> list[int]:
    """``row`` up to and including its first id in ``stops`` (all of it when none is)."""
    out = []
    for token in row:
        out.append(token)
        if token in stops:
            break
    return out


def sample_answers(
    verifier, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, pad: int, stops: Collection[int], **sampling
) -> list[list[int]]:
    """One transformers ``generate`` call over the left-padded ``prompts`` (token id lists), sampling
    (``do_sample=True`` and ``sampling``'s generate arguments: temperature, top_k, top_p, eos_token_id, ...), at most
    ``max_new_tokens`` new ids each. Returns each prompt's new ids, cut after the first id in ``stops``."""
    ids, mask = left_padded(prompts, pad)
    with torch.no_grad():
        out = verifier.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            max_new_tokens=max_new_tokens,
            pad_token_id=pad,
            **sampling,
        )
    return [cut_at_stop(row, stops) for row in out[:, ids.shape[1] :].tolist()]
