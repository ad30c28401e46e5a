"""One verification round in steps apart from the session that holds its state (`hycoc.verifier.engine.Session`):
the checks of a round's tree (`check_round_tree`), the forward over it (`verify_tree`, Alg. 4 lines 1-3), the round
between `Session.begin_round` and `Session.finish_round` (`PendingRound`), the choice of the accepted path
(`accept`, lines 5-12), and the check of the rows a batch-level row budget keeps (`ancestor_closed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers import DynamicCache

from hycoc.protocol.messages import Sampling

from .acceptance import select_exact, select_path
from .draft_place import DraftPlace
from .errors import OverAllowance, RootMismatch, TreeError
from .forward import NormTap
from .kv_cache import window_start
from .sampling import sample_rows, sampling_probs
from .tree import additive_masks, ancestor_matrix, tree_depths, validate_tree


@torch.inference_mode()
def verify_tree(
    model, cache: DynamicCache, tap: NormTap, tokens: torch.Tensor, parents: np.ndarray, t: int, dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Alg. 4 lines 1-3: one forward over the R tree rows after the t cached positions.

    tokens: int64 (R,) on the model's device; parents: int (R,), a valid tree. Row j takes position
    t + depth(j) and attends to [0, t), its ancestor rows and itself (sliding layers: within their window).
    Appends the R rows' KV to every cache layer (positions t .. t+R-1 in storage order). Returns float32 logits
    (R, V) (soft-capped, as transformers computes them) and the final norm's input and output rows, each (R, H).
    """
    device = tokens.device
    pos = torch.as_tensor(t + tree_depths(parents), device=device)
    visible = torch.as_tensor(ancestor_matrix(parents), device=device)
    masks = additive_masks(pos, visible, t, model.config.sliding_window, dtype, window_start(cache, t))
    out = model(input_ids=tokens[None], position_ids=pos[None], attention_mask=masks, cache=cache, use_cache=True)
    return out.logits[0].float(), tap.pre[0], tap.post[0]


@dataclass
class PendingRound:
    """A round between `Session.begin_round` and `Session.finish_round` (what the forward and the finish need).

    sent_tokens, sent_parents: int64 (R,), the tree as sent (the retry record). tokens, parents: the rows to
    verify (the rows that fit the context, renumbered; for cloud-mtp root + K-chain). kept: the sent rows kept
    (None: all). t: cached positions before the round. rng_state: the session generator's state before it.
    started: time.perf_counter() at `begin_round` (server_ms of a batched round counts from here).
    """

    seq: int
    sent_tokens: np.ndarray
    sent_parents: np.ndarray
    tokens: np.ndarray
    parents: np.ndarray
    kept: np.ndarray | None
    t: int
    rng_state: torch.Tensor
    started: float


def check_round_tree(
    tokens: np.ndarray,
    parents: np.ndarray,
    seq: int,
    vocab_size: int,
    place: DraftPlace,
    allowance: int,
    root: int,
    t: int,
) -> None:
    """Refuse a round's tree (int64 (R,) tokens and parents) before anything changes: not a valid tree of ids in
    [0, vocab_size) (`validate_tree`, TreeError), more than the root from a ``place`` whose device sends the root
    alone (TreeError), more rows than the last reply's ``allowance`` (OverAllowance; 0: not checked), a root that is
    not the session's ``root`` at position ``t`` (RootMismatch). ``seq`` names the round in the message."""
    validate_tree(tokens, parents, vocab_size)
    if not place.device_rows and len(tokens) != 1:
        raise TreeError(f"{place.name} rounds carry only the root, got {len(tokens)} rows")
    if allowance and len(tokens) > allowance:
        raise OverAllowance(
            f"round {seq} has {len(tokens)} rows; the last reply allowed at most {allowance} (its "
            "allowance): draft at most that many rows, root included, and send the round again"
        )
    if tokens[0] != root:
        raise RootMismatch(f"tree root {tokens[0]} is not the session's root {root} at position {t}")


def accept(
    tokens: np.ndarray,
    parents: np.ndarray,
    logits: torch.Tensor,
    sampling: Sampling,
    generator: torch.Generator,
    mode: str,
    epsilon: float,
) -> tuple[int, np.ndarray, np.ndarray]:
    """Alg. 4 lines 5-12 after the forward: p~ per row and y^_j ~ p~(.|j) from ``generator`` (the session's), then
    v*, the accepted path and the samples rewritten along it (``mode`` "exact": `select_exact`; else the
    ``epsilon`` threshold, `select_path`). tokens, parents: int (R,); logits: float32 (R, V). Returns (v*, path rows
    int64 (|P|,) from the root's child to v*, samples int64 (R,)); the bonus token is samples[v*]."""
    probs = sampling_probs(logits, sampling)
    drawn = sample_rows(probs, generator)
    if mode == "exact":
        return select_exact(tokens, parents, drawn)
    return select_path(tokens, parents, drawn, probs, epsilon)


def ancestor_closed(rows: np.ndarray, parents: np.ndarray) -> bool:
    """Whether ``rows`` (sorted, unique, int64) are a sub-tree of the tree ``parents`` (int (R,)) that a round can
    verify alone: non-empty, row 0 (the root) first, every row < R, every other row after its parent and its parent
    among ``rows``."""
    return not (
        len(rows) == 0
        or rows[0] != 0
        or rows[-1] >= len(parents)
        or not (rows[1:] > parents[rows[1:]]).all()
        or not np.isin(parents[rows[1:]], rows).all()
    )
