"""The head QAT's data (paper App. A): the verifier's greedy answers to the calibration prompts and, over each
prompt + answer, one verifier pass that captures the head's inputs: e (input embedding), h (last hidden state,
before or after the final norm as the hand-off carries it), K/V of the last sliding and last full layer
(`Capture`). The build answers in batches (`hycoc.passes.calibration_answers`) and captures here
(`capture_answers`); `hycoc.passes.head.qat` trains on the captures.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Capture:
    """One calibration sequence and the verifier's states over it (what the hand-off carries, App. A).

    ids: int64 [L] prompt + greedy answer; prompt_len: its prompt's length. e: [1, L, H] the verifier's scaled input
    embeddings; h: [1, L, H] its last hidden state (pre- or post-norm, as ``handoff.hidden``); kv: {SLIDING: (k, v),
    FULL: (k, v)}, each [1, kv_heads, L, head_dim], keys rotated. Tensors in the verifier's dtype and device.
    """

    ids: torch.Tensor
    prompt_len: int
    e: torch.Tensor
    h: torch.Tensor
    kv: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def length(self) -> int:
        return len(self.ids)


@torch.no_grad()
def greedy_answer(verifier, prompt: Sequence[int], max_new_tokens: int, stop_ids: Collection[int]) -> list[int]:
    """The verifier's greedy answer (arg-max, first among equals) to ``prompt``, cut after the first stop id;
    at most ``max_new_tokens`` ids."""
    device = verifier.device
    ids = torch.tensor([list(prompt)], device=device)
    out = verifier.generate(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        pad_token_id=verifier.config.pad_token_id or 0,
        eos_token_id=sorted(stop_ids) or None,
        top_k=None,
        top_p=None,
        temperature=None,
    )
    answer = []
    for token in out[0, ids.shape[1] :].tolist():
        answer.append(token)
        if token in stop_ids:
            break
    return answer


@torch.no_grad()
def verifier_capture(verifier, ids: torch.Tensor, hidden: str = "pre_norm") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """One verifier pass over ids int64 [L] (no output layer). Returns e [1, L, H] (scaled input embedding), h
    [1, L, H] (the final norm's input for ``hidden="pre_norm"``, its output for ``"post_norm"``) and the shared KV
    {SLIDING: (k, v), FULL: (k, v)} of the last sliding and last full layer, each [1, kv_heads, L, head_dim]."""
    tap: dict[str, torch.Tensor] = {}
    handle = verifier.model.norm.register_forward_hook(lambda m, a, o: tap.update(pre=a[0], post=o))
    try:
        x = ids[None].to(verifier.device)
        out = verifier.model(input_ids=x, return_shared_kv_states=True, use_cache=False)
        e = verifier.model.embed_tokens(x)
    finally:
        handle.remove()
    kv = {kind: (k, v) for kind, (k, v) in out.shared_kv_states.items()}
    return e, tap["pre" if hidden == "pre_norm" else "post"], kv


def capture_answers(
    verifier,
    prompts: Sequence[Sequence[int]],
    answers: Sequence[Sequence[int]],
    hidden: str = "pre_norm",
    progress=None,
) -> list[Capture]:
    """Capture the head's inputs over each prompt + its answer (token ids; App. A), one verifier pass each."""
    caps = []
    for prompt, answer in zip(prompts, answers, strict=True):
        ids = torch.tensor(list(prompt) + list(answer), dtype=torch.long)
        e, h, kv = verifier_capture(verifier, ids, hidden)
        caps.append(Capture(ids, len(prompt), e, h, kv))
        if progress is not None:
            progress()
    return caps


def capture_sequences(
    verifier,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    stop_ids: set[int],
    hidden: str = "pre_norm",
    progress=None,
) -> list[Capture]:
    """Answer each prompt (token ids) greedily, one at a time (`greedy_answer`), and capture the head's inputs over
    prompt + answer (App. A). The build answers in batches instead (`hycoc.passes.calibration_answers`)."""
    answers = [greedy_answer(verifier, prompt, max_new_tokens, stop_ids) for prompt in prompts]
    return capture_answers(verifier, prompts, answers, hidden, progress)
