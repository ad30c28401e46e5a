"""The verifier's forwards besides a round's tree (paper Alg. 4 line 3's h tap, chunked causal prefill) and their
timer. `prefill` uses the same explicit masks as the tree rounds (a chain is a tree), so prefill and rounds share one
mask convention (`hycoc.verifier.tree.additive_masks`).
"""

from __future__ import annotations

import time

import torch
from transformers import DynamicCache

from .kv_cache import trim_windows, window_start
from .tree import additive_masks


class NormTap:
    """Keeps the input (pre-norm) and output (post-norm) of ``model.model.norm`` from the last forward.

    A forward hook on the final RMSNorm: its input is the residual stream after the last decoder layer, the
    paper's h (Alg. 4 line 3). pre, post: (1, N, H) in the model's dtype.
    """

    def __init__(self, model):
        self.pre: torch.Tensor  # set by the hook at each forward, read after one
        self.post: torch.Tensor
        self._handle = model.model.norm.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        self.pre, self.post = args[0], output

    def remove(self) -> None:
        self._handle.remove()


class Timer:
    """Milliseconds of a block: CUDA events on a CUDA device (synchronized at exit), perf_counter otherwise."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ms = 0.0

    def __enter__(self):
        if self.cuda:
            self._start, self._end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.ms = float(self._start.elapsed_time(self._end))
        else:
            self.ms = (time.perf_counter() - self._t0) * 1e3
        return False


@torch.inference_mode()
def prefill(
    model, cache: DynamicCache, tap: NormTap, ids: torch.Tensor, chunk: int, dtype, start: int = 0, after_forward=None
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Fill the cache with ``ids`` (int64 (T,), positions start .. start+T-1) in causal chunks of ``chunk``
    positions, after the ``start`` positions the cache holds (0: a new request; > 0: a turn appended to a kept
    conversation, `Session.append`).

    Each chunk uses the same explicit masks as the tree rounds (a chain is a tree), so prefill and rounds share
    one mask convention; after each chunk the sliding layers drop what fell out of their window. after_forward:
    called as ``after_forward(cache, t, n)`` after the forward of the chunk of positions [t, t + n), before that
    trim (the sliding layers then still hold the window before t and the whole chunk: a `PrefillJob` takes its
    snapshot there). Returns the final norm's (pre, post) rows of the last position, each (H,), or None if T == 0.
    """
    t, n_total = start, start + len(ids)
    while t < n_total:
        n = min(chunk, n_total - t)
        pos = torch.arange(t, t + n, device=ids.device)
        causal = torch.ones(n, n, dtype=torch.bool, device=ids.device).tril()
        masks = additive_masks(pos, causal, t, model.config.sliding_window, dtype, window_start(cache, t))
        model(
            input_ids=ids[None, t - start : t - start + n],
            position_ids=pos[None],
            attention_mask=masks,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        if after_forward is not None:
            after_forward(cache, t, n)
        trim_windows(cache)  # sliding layers back to their retained window: a long prompt never holds more
        t += n
    if n_total == 0:
        return None
    return tap.pre[0, -1], tap.post[0, -1]
