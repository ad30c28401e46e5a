"""The MTP Drafter on the device (paper Alg. 2, MtpDraft; §3.4).

State (line 2): per verifier layer type (last sliding, last full-attention) a ring of W K/V columns, float32
``[1, kv_heads, W, head_dim]`` as the head graph takes them, and the live positions [ℓ, t0).

`MtpDrafter.ingest` takes one reply's hand-off H = (t, a, x̂, R) (line 1):

- line 3: ``a != t0`` means a new request: the ring is cleared and ℓ = a;
- line 4: the row of position p (a <= p < t) goes to column p mod W, int8 x the hand-off's fixed scale (the graph's
  float input here; a quantized input is re-encoded by `hycoc.runtime.graphs.GraphRunner`); t0 = t;
- line 5: ℓ = max(ℓ, t - W) and every column outside [ℓ, t) masked (`hycoc.host.ring_masks`; the sliding layer
  sees only the last min(W, its sliding window) positions, as the head was trained);
- line 6: the query's rotary rows fixed at position t - 1 (``head_query_position_offset``); keys arrive rotated.

`MtpDrafter.draft` is lines 7-13: z = x̂; K calls of the head graph over the ring (which it does not extend);
i, i' = the largest and second-largest logit, first among equals (the graph's ``top_index`` output where it has
one, `top2` of its ``logits`` otherwise); y_k = V[i], y'_k = V[i'] for k <= D;
z = [E[i]; h]. A hand-off with NaN/inf, a non-positive scale, or rows whose sizes do not match the graph is
rejected with `HandoffError` before anything is written; drafting before any hand-off raises `NoHandoff`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hycoc.host import FULL, SLIDING, ring_masks
from hycoc.protocol.messages import HandOff


class HandoffError(ValueError):
    """A hand-off the MTP Drafter refuses (sizes, NaN/inf, a position range that does not fit the ring)."""


class NoHandoff(RuntimeError):
    """The MTP Drafter was asked to draft before it received a hand-off (the first tree is SLM-only)."""


def top2(logits: np.ndarray) -> tuple[int, int]:
    """Indices of the largest and second-largest entry of a 1-D array, first among equals (Alg. 2 line 10):
    ties go to the lower index, so [3, 5, 5] gives (1, 2) and [5, 5, 1] gives (0, 1)."""
    x = np.asarray(logits, dtype=np.float64).reshape(-1)
    i = int(np.argmax(x))  # numpy: first occurrence of the maximum
    rest = x.copy()
    rest[i] = -np.inf
    return i, int(np.argmax(rest))


@dataclass
class MtpDraft:
    """One MtpDraft result: the chain y_{1:K} and runner-ups y'_{1:D} as token ids (Alg. 2 line 13), and the
    keep-set indices they came from."""

    chain: list[int]
    runner_ups: list[int]
    chain_index: list[int]
    runner_up_index: list[int]


class MtpDrafter:
    """Alg. 2 (module docstring) around a head graph runner.

    runner: a `hycoc.runtime.graphs.GraphRunner` (or anything with ``run(feeds) -> {"logits" or "top_index",
    "h_next"}`` and ``shape(name)``) for the head graph; bundle: the `hycoc.runtime.device_bundle.DeviceBundle` (keep set, E
    table, head rotary tables, hand-off scales, round constants K, D, W).
    """

    def __init__(self, runner, bundle):
        self.runner, self.bundle = runner, bundle
        r = bundle.round
        self.K, self.D, self.W = r.chain_length, r.sibling_depth, r.head_window
        self.offset = r.head_query_position_offset
        self.sliding_window = bundle.host.head.sliding_window
        self.hidden = runner.shape("x_hat")[-1] // 2
        self.ring = {}
        for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
            shape = runner.shape(f"k_{short}")
            if shape[2] != self.W:
                raise HandoffError(f"head graph ring k_{short} has {shape[2]} columns, the bundle's W is {self.W}")
            self.ring[kind] = (np.zeros(shape, np.float32), np.zeros(shape, np.float32))
        self.t0: int | None = None          # root position of the last hand-off (line 4)
        self.live: int | None = None        # ℓ (lines 3, 5)
        self.x_hat: np.ndarray | None = None

    def reset(self) -> None:
        """Forget the ring (the next hand-off starts a request)."""
        self.t0 = self.live = self.x_hat = None
        for k, v in self.ring.values():
            k[:] = 0
            v[:] = 0

    def ingest(self, h: HandOff) -> None:
        """Alg. 2 lines 1-5 for one hand-off (module docstring). Raises HandoffError (nothing written then)."""
        scales = np.asarray(h.scales, dtype=np.float64)
        if len(scales) != 6 or not np.all(np.isfinite(scales)) or np.any(scales <= 0):
            raise HandoffError(f"hand-off scales {h.scales}: need 6 finite positive values")
        if h.x_hat.shape != (2 * self.hidden,):
            raise HandoffError(f"hand-off x_hat has {h.x_hat.shape[0] if h.x_hat.ndim else 0} values, the head graph "
                               f"takes 2 x {self.hidden}")
        n = h.t_prime - h.a
        if h.a < 0 or n < 0 or n > self.W:
            raise HandoffError(f"hand-off positions [{h.a}, {h.t_prime}) do not fit a {self.W}-column ring")
        rows = {}
        for kind, short, ks, vs in ((SLIDING, "sliding", scales[2], scales[3]), (FULL, "full", scales[4], scales[5])):
            _, kv, _, d = self.ring[kind][0].shape
            k, v = getattr(h, f"k_{short}"), getattr(h, f"v_{short}")
            if k.shape != (n, kv * d) or v.shape != (n, kv * d):
                raise HandoffError(f"hand-off {short} rows are {k.shape}/{v.shape}, expected ({n}, {kv * d}) "
                                   f"({kv} KV heads x {d})")
            rows[kind] = (k.astype(np.float32) * np.float32(ks), v.astype(np.float32) * np.float32(vs))
            if not (np.all(np.isfinite(rows[kind][0])) and np.all(np.isfinite(rows[kind][1]))):
                raise HandoffError(f"hand-off {short} rows hold NaN or inf")
        x_hat = np.concatenate([h.x_hat[:self.hidden].astype(np.float32) * np.float32(scales[0]),
                                h.x_hat[self.hidden:].astype(np.float32) * np.float32(scales[1])])
        if not np.all(np.isfinite(x_hat)):
            raise HandoffError("hand-off x_hat holds NaN or inf")
        if self.t0 is None or h.a != self.t0:          # line 3: a new request
            self.reset()
            self.live = h.a
        cols = np.arange(h.a, h.t_prime) % self.W      # line 4
        for kind, (k_rows, v_rows) in rows.items():
            k_ring, v_ring = self.ring[kind]
            _, kv, _, d = k_ring.shape
            k_ring[0][:, cols, :] = k_rows.reshape(n, kv, d).transpose(1, 0, 2)
            v_ring[0][:, cols, :] = v_rows.reshape(n, kv, d).transpose(1, 0, 2)
        self.t0 = h.t_prime
        self.live = max(self.live, h.t_prime - self.W)  # line 5
        self.x_hat = x_hat

    def feeds(self, z: np.ndarray) -> dict[str, np.ndarray]:
        """The head graph's inputs for query z (float32 (2H,)) at the current ring (lines 5-6, 9)."""
        t = self.t0
        masks = ring_masks(t, self.live, self.W, self.sliding_window)
        q = t + self.offset
        out = {"x_hat": z.reshape(1, 1, -1).astype(np.float32)}
        for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
            out[f"k_{short}"], out[f"v_{short}"] = self.ring[kind]
            out[f"mask_{short}"] = masks[kind]
            cos, sin = self.bundle.head_rotary[kind].rows(np.asarray([[q]]))
            out[f"cos_{short}"], out[f"sin_{short}"] = cos, sin
        return out

    def draft(self, steps: int | None = None, siblings: int | None = None) -> MtpDraft:
        """Alg. 2 lines 7-13 (module docstring). steps: K (default the bundle's), siblings: D. Raises NoHandoff."""
        if self.x_hat is None:
            raise NoHandoff("the MTP Drafter has no hand-off yet: the first tree of a request is SLM-only")
        K = self.K if steps is None else steps
        D = self.D if siblings is None else siblings
        keep = self.bundle.keep_set
        z = self.x_hat
        feeds = self.feeds(z)       # ring, masks and rotary rows stay fixed over the K steps (lines 6, 9)
        out = MtpDraft([], [], [], [])
        for k in range(1, K + 1):
            feeds["x_hat"] = z.reshape(1, 1, -1).astype(np.float32)
            res = self.runner.run(feeds)
            # the graph's own top-2 (ONNX TopK: ties to the lower index) when it emits one, else the host's
            i, i2 = (int(x) for x in res["top_index"].reshape(-1)[:2]) if "top_index" in res else top2(res["logits"])
            out.chain.append(int(keep[i]))
            out.chain_index.append(i)
            if k <= D:
                out.runner_ups.append(int(keep[i2]))
                out.runner_up_index.append(i2)
            z = np.concatenate([self.bundle.embed_keep(i), res["h_next"].reshape(-1)])
        return out
