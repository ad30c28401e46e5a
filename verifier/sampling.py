"""The verifier's sampling distribution p~ and seeded per-row sampling (paper Alg. 4 line 5).

p~(. | j) is the softmax of row j's logits divided by the temperature, over its top-k largest entries (k = 64 in
the paper), cut to the top-p nucleus (p = 0.95) and renormalized. Temperature 0 is greedy: p~ is one-hot on the
arg-max, and so is every temperature below ``GREEDY_BELOW`` = 1e-4 (logits / T would overflow float32 near
T = 1e-37, and any T below 1e-4 already puts all of float32's mass on the arg-max for the soft-capped logits of
Gemma, whose gaps are >= ~1e-3 between distinct values). The top-k softmax and the nucleus's cumulative sum run in
float64, so a row whose nucleus mass lands within float32 rounding (~1e-7) of top_p is cut exactly. Ties are broken
toward the lowest token id everywhere (top-k membership, nucleus order, greedy arg-max), so p~ is a deterministic
function of the logits.

Samples are drawn by inverse CDF from uniforms of a per-session CPU ``torch.Generator``: the same seed gives the
same samples whatever device the logits live on.
"""

from __future__ import annotations

import numpy as np
import torch

from hycoc.protocol.messages import Sampling

#: Temperatures below this are greedy (module docstring); the device's own drafting is greedy at any temperature.
GREEDY_BELOW = 1e-4


def sampling_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """p~ per row (Alg. 4 line 5).

    logits: float (R, V), the verifier's (soft-capped) output logits. sampling: temperature >= 0, top_k >= 1,
    top_p in (0, 1]; 0 <= temperature < GREEDY_BELOW is greedy. Returns float32 (R, V), each row summing to 1,
    zero outside the kept tokens (top-k softmax and nucleus cut computed in float64).
    Raises ValueError for an out-of-range temperature, top_k or top_p.
    """
    if sampling.temperature < 0 or sampling.top_k < 1 or not 0.0 < sampling.top_p <= 1.0:
        raise ValueError(f"invalid sampling parameters {sampling}: need temperature >= 0, top_k >= 1, 0 < top_p <= 1")
    logits = logits.float()
    rows, vocab = logits.shape
    if sampling.temperature < GREEDY_BELOW:
        # Greedy: all mass on the arg-max; torch.argmax returns the first (lowest-id) maximum.
        probs = torch.zeros_like(logits)
        probs[torch.arange(rows, device=logits.device), logits.argmax(-1)] = 1.0
        return probs
    k = min(sampling.top_k, vocab)
    top_logits, top_ids = top_k_stable(logits, k)  # (R, k); ties go to the lowest id
    top_probs = torch.softmax(top_logits.double() / sampling.temperature, dim=-1)  # float64: see module docstring
    if sampling.top_p < 1.0:
        # Nucleus: the smallest prefix whose mass reaches top_p, i.e. keep i while the mass before i is < top_p.
        mass_before = torch.cumsum(top_probs, dim=-1) - top_probs
        top_probs = torch.where(mass_before < sampling.top_p, top_probs, 0.0)
        top_probs = top_probs / top_probs.sum(-1, keepdim=True)
    probs = torch.zeros_like(logits)
    probs.scatter_(1, top_ids, top_probs.float())
    return probs


def top_k_stable(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest entries of each row in stable descending order (equal values in ascending id order):
    exactly ``torch.sort(logits, descending=True, stable=True)`` cut to its first k columns, without sorting whole
    rows (a full stable sort of 33 x 4,096 logits took 11 ms of CPU, this ~1.5 ms; docs/serving.md "Many devices:
    batched verification").

    logits: float (R, V), no NaN; 1 <= k <= V. Returns (values (R, k), ids int64 (R, k)). The k-th largest value
    per row comes from ``numpy.partition`` (CPU) or ``torch.topk``; the set is every entry above it plus the
    lowest-id entries equal to it, and only those k are sorted (stably, from ascending ids).
    """
    rows, vocab = logits.shape
    if logits.device.type == "cpu":  # numpy's introselect finds the k-th largest ~4x faster than torch.topk here
        kth = torch.from_numpy(np.partition(logits.numpy(), vocab - k, axis=-1)[:, vocab - k : vocab - k + 1])
    else:
        kth = torch.topk(logits, k, dim=-1, sorted=True).values[
            :, -1:
        ]  # (R, 1); topk's order among ties is unspecified
    above = logits > kth
    tied = logits == kth
    need = k - above.sum(-1, keepdim=True)  # tied entries to take, lowest ids first
    if int(tied.sum()) == rows:  # the usual case: each row's k-th value is unique, so need == 1 everywhere
        take = above | tied
    else:
        take = above | (tied & (torch.cumsum(tied, dim=-1) <= need))
    ids = take.nonzero()[:, 1].view(rows, k)  # row-major: ascending ids per row
    values = logits.gather(1, ids)
    order = torch.sort(values, dim=-1, descending=True, stable=True).indices
    return values.gather(1, order), ids.gather(1, order)


def sample_rows(probs: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One sample per row, y^_j ~ p~(. | j) (Alg. 4 line 5).

    probs: float (R, V), rows summing to 1. generator: a CPU ``torch.Generator`` (the session's); it draws R
    uniforms. Returns int64 (R,) on probs' device. A token of zero probability is never drawn.
    """
    rows = probs.shape[0]
    u = torch.rand(rows, generator=generator, dtype=torch.float64).to(probs.device)
    cdf = torch.cumsum(probs.double(), dim=-1)  # (R, V)
    # First id whose CDF exceeds u * total; zero-mass ids repeat the previous CDF value and are skipped.
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u * total can round up to the total: fall back to the last id with mass.
    last_nonzero = (probs.shape[1] - 1) - torch.argmax((probs.flip(-1) > 0).int(), dim=-1)
    return torch.minimum(idx, last_nonzero)
