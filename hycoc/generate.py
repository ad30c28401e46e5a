"""`hycoc generate`: one answer from the verifier alone (transformers ``generate``), streamed as it is decoded.

`sampling_kwargs` maps the recipe's sampling to ``generate``'s arguments (p~ of the paper's Alg. 4 line 5:
temperature, top-k, top-p; greedy below `hycoc.verifier.sampling.GREEDY_BELOW`, as the verifier). `TextStream` is
the streamer: the answer to one stream (stdout), the thought (the reasoning channel) to another (stderr),
`hycoc.chat.AnswerStream` splitting them. `generate_answer` runs it all and returns the counts for the summary
line (`summary_line`). torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TextIO


def sampling_kwargs(temperature: float, top_k: int, top_p: float) -> dict:
    """``model.generate`` keyword arguments: sampling with ``temperature``, ``top_k`` and ``top_p`` (transformers
    docs, GenerationConfig), or greedy (``do_sample=False``) when temperature < GREEDY_BELOW (1e-4), as the
    verifier treats it (`hycoc.verifier.sampling`)."""
    from hycoc.verifier.sampling import GREEDY_BELOW

    if temperature >= GREEDY_BELOW:
        return dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    return dict(do_sample=False)


class TextStream:
    """A ``model.generate`` streamer that writes the answer to ``out`` and its thought to ``err`` as tokens arrive.

    transformers calls ``put`` first with the prompt ids (skipped), then with each new token, and ``end`` once
    (transformers docs, "Streamers"). chat: `hycoc.chat.Chat` (its format splits thought from answer)."""

    def __init__(self, chat, out: TextIO | None = None, err: TextIO | None = None):
        from hycoc.chat import AnswerStream

        self.stream, self.prompt_seen = AnswerStream(chat), False
        self.out, self.err = out or sys.stdout, err or sys.stderr

    def _show(self, pieces: tuple[str, str]) -> None:
        thought, text = pieces
        if thought:
            self.err.write(thought)
            self.err.flush()
        if text:
            self.out.write(text)
            self.out.flush()

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self._show(self.stream.push(value.reshape(-1).tolist()))

    def end(self) -> None:
        self._show(self.stream.flush())
        self.out.write("\n")
        self.out.flush()


@dataclass
class Generated:
    """What `generate_answer` made: new tokens, prompt tokens, wall seconds of ``generate``."""

    tokens: int
    prompt_tokens: int
    seconds: float


def summary_line(g: Generated) -> str:
    """``[N tokens in S s, R tok/s; prompt P tokens]``, the line `hycoc generate` ends with on stderr."""
    return (
        f"[{g.tokens} tokens in {g.seconds:.2f} s, {g.tokens / g.seconds:.1f} tok/s; prompt {g.prompt_tokens} tokens]"
    )


def generate_answer(
    cfg,
    prompt: str,
    *,
    max_new_tokens: int | None = None,
    seed: int | None = None,
    temperature: float | None = None,
    thinking: bool = False,
    out: TextIO | None = None,
    err: TextIO | None = None,
    say=None,
) -> Generated:
    """Answer ``prompt`` (the user message, wrapped in the checkpoint's chat template with ``thinking``) with the
    recipe's verifier alone, streaming the answer to ``out`` and the thought to ``err`` (`TextStream`).

    The recipe's sampling (``[sampling]``: temperature, top-k, top-p, seed, max_new_tokens) unless given; stops at
    the checkpoint's stop ids. ``say(line)`` gets the "[question] ..." line before decoding (default: to ``err``).
    Raises RecipeError, ModelNotFoundError or ChatFormatError before any decoding (each names the fix)."""
    import torch

    from hycoc.chat_template import chat_from_recipe
    from hycoc.models import load_verifier, set_threads

    err = err or sys.stderr
    say = say or (lambda line: print(line, file=err))
    set_threads(cfg.verifier.threads)
    sampling = cfg.sampling
    temperature = sampling.temperature if temperature is None else temperature
    chat = chat_from_recipe(cfg)  # the checkpoint's template and stop ids, before the weights
    prompt_ids = chat.prompt(prompt, thinking)
    model = load_verifier(cfg.model_path("verifier"), dtype=cfg.verifier.dtype, device=cfg.verifier.device)
    say(f"[question] {prompt}")
    torch.manual_seed(sampling.seed if seed is None else seed)
    ids = torch.tensor([prompt_ids], device=cfg.verifier.device)  # (1, T)
    stops = list(chat.format.stop_ids)
    start = time.perf_counter()
    with torch.inference_mode():
        result = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens or sampling.max_new_tokens,
            eos_token_id=stops,
            pad_token_id=stops[0],
            streamer=TextStream(chat, out, err),
            **sampling_kwargs(temperature, sampling.top_k, sampling.top_p),
        )
    return Generated(
        tokens=result.shape[1] - ids.shape[1], prompt_tokens=ids.shape[1], seconds=time.perf_counter() - start
    )


__all__ = ["Generated", "TextStream", "generate_answer", "sampling_kwargs", "summary_line"]
