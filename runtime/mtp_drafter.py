"""The MTP Drafter on the device (paper Alg. 2, MtpDraft; §3.4).

State (line 2): per verifier layer type (last sliding, last full-attention) a ring of W K/V columns, float32
``[1, kv_heads, W, head_dim]`` as the head graph takes them, and the live positions [ℓ, t0).

`MtpDrafter.ingest` takes one reply's hand-off H = (t, a, x̂, R) (line 1):

- line 3: ``a != t0`` means a new request: the ring is cleared and ℓ = a;
- line 4: the row of position p (a <= p < t) goes to column p mod W, int8 x the hand-off's fixed scale (the graph's
  float input; a graph built with quantized IO takes the ring as uint16 codes, and the row is quantized with the
  ring's encoding once, here, instead of the whole ring at every call); t0 = t;
- line 5: ℓ = max(ℓ, t - W) and every column outside [ℓ, t) masked (`hycoc.host.ring_masks`, kept in place by
  `hycoc.runtime.tree_mask.HeadRingMask`; the sliding layer sees only the last min(W, its sliding window)
  positions, as the head was trained);
- line 6: the query's rotary rows fixed at position t + ``head_query_position_offset`` (the paper: t - 1; Gemma 4's
  head as transformers feeds it: t); keys arrive rotated.

`MtpDrafter.draft` is lines 7-13 (the loop: `hycoc.mtp_chain.head_chain`, shared with the server's baselines):
z = x̂; K calls of the head graph over the ring (which it does not extend);
i, i' = the largest and second-largest logit, first among equals (the graph's ``top_index`` output where it has
one, `top2` of its ``logits`` otherwise); y_k = V[i], y'_k = V[i'] for k <= D;
z = [E[i]; h]. A hand-off with NaN/inf, a non-positive scale, or rows whose sizes do not match the graph is
rejected with `HandoffError` before anything is written; drafting before any hand-off raises `NoHandoff`.
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass

import numpy as np
from hycoc.runtime.graphs import input_buffer, input_encoding, quantize, zero_code
from hycoc.runtime.tree_mask import HeadRingMask

from hycoc.host import DENSE_LUT_BYTES, FULL, SLIDING, RotaryBlock, ring_runs
from hycoc.mtp_chain import HeadStep, head_chain, top2
from hycoc.protocol.messages import HandOff


class HandoffError(ValueError):
    """A hand-off the MTP Drafter refuses (sizes, NaN/inf, a position range that does not fit the ring)."""


class NoHandoff(RuntimeError):
    """The MTP Drafter was asked to draft before it received a hand-off (the first tree is SLM-only)."""


_INT_BOUND: dict[np.dtype, float] = {}  # integer dtype -> its largest magnitude, as a float32 value
_F32_OVERFLOW = 2.0**128 - 2.0**103  # the smallest real that float32 rounds to inf


class _Dequantized:
    """A hand-off tensor and its scale: float32(raw) x float32(scale), checked for NaN/inf before it is written.
    Integer rows (the wire's int8) cannot hold NaN: their products are all finite when the dtype's largest
    magnitude times the scale is (rounding is monotonic), a check of one number; they are then multiplied straight
    into their destination. Float rows are dequantized here and checked value by value."""

    def __init__(self, raw: np.ndarray, scale: float):
        self.raw, self.scale = raw, np.float32(scale)
        self.integer = raw.dtype.kind in "iu"
        self.value: np.ndarray = raw if self.integer else raw.astype(np.float32) * self.scale  # float rows only

    def finite(self) -> bool:
        if self.integer:
            bound = _INT_BOUND.get(self.raw.dtype)
            if bound is None:
                info = np.iinfo(self.raw.dtype)
                bound = _INT_BOUND[self.raw.dtype] = float(np.float32(max(-int(info.min), int(info.max))))
            # two float32 values multiply exactly in float64; float32 rounds the product to inf from 2^128 - 2^103
            # (half an ulp above the largest float32) up
            return bound * float(self.scale) < _F32_OVERFLOW
        return bool(np.all(np.isfinite(self.value)))

    def into(self, out: np.ndarray, view=lambda a: a, encoding=None) -> None:
        """Write ``view`` of the dequantized values into ``out`` (the same float32 products either way); into a ring
        of the graph's codes (``encoding``, quantized IO) as those products quantized with it."""
        if encoding is not None:
            tmp = np.empty(out.shape, np.float32)
            self.into(tmp, view)
            out[...] = quantize(tmp, encoding)
        elif self.integer:
            np.multiply(view(self.raw), self.scale, out=out, dtype=np.float32)
        else:
            out[...] = view(self.value)


@dataclass
class MtpDraft:
    """One MtpDraft result: the chain y_{1:K} and runner-ups y'_{1:D} as token ids (Alg. 2 line 13), and the
    keep-set indices they came from."""

    chain: list[int]
    runner_ups: list[int]
    chain_index: list[int]
    runner_up_index: list[int]


def _thread_cpu(method):
    """Add the calling thread's CPU milliseconds spent in ``method`` to ``self.cpu_ms`` (the MTP Drafter's share of
    a round's drafting time, which a load test's replay needs when the SLM pass is skipped)."""

    @functools.wraps(method)
    def timed(self, *args, **kwargs):
        start = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.cpu_ms += 1e3 * (time.thread_time() - start)

    return timed


class MtpDrafter:
    """Alg. 2 (module docstring) around a head graph runner.

    runner: a `hycoc.runtime.graphs.GraphRunner` (or anything with ``run(feeds) -> {"logits" or "top_index",
    "h_next"}`` and ``shape(name)``) for the head graph; bundle: the `hycoc.runtime.device_bundle.DeviceBundle` (keep
    set, E table, head rotary tables, hand-off scales, round constants K, D, W). ``cpu_ms``: the calling thread's
    CPU milliseconds spent in `ingest` and `draft` so far (float, never reset).
    """

    def __init__(self, runner, bundle):
        self.runner, self.bundle = runner, bundle
        r = bundle.round
        self.K, self.D, self.W = r.chain_length, r.sibling_depth, r.head_window
        self.offset = r.head_query_position_offset
        self.sliding_window = bundle.host.head.sliding_window
        self.hidden = runner.shape("x_hat")[-1] // 2
        self._query = np.zeros((1, 1, 2 * self.hidden), np.float32)  # the head's x_hat input, one buffer
        self._keep = [int(x) for x in np.asarray(bundle.keep_set).reshape(-1)]  # index -> token id, as ints
        # E[i] of every keep-set index as one float32 table (`bundle.embed_keep` row by row, so bit for bit its
        # values) when it takes at most DENSE_LUT_BYTES; else each step dequantizes its row
        fits = len(self._keep) * self.hidden * 4 <= DENSE_LUT_BYTES
        self._embed = (
            np.stack([bundle.embed_keep(i) for i in range(len(self._keep))]).astype(np.float32, copy=False)
            if fits
            else None
        )
        self._masks = HeadRingMask(self.W, self.sliding_window)
        self._rotary = {kind: RotaryBlock(bundle.head_rotary[kind]) for kind in (SLIDING, FULL)}
        self.ring, self.ring_encodings = {}, {}
        for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
            shape = runner.shape(f"k_{short}")
            if shape[2] != self.W:
                raise HandoffError(f"head graph ring k_{short} has {shape[2]} columns, the bundle's W is {self.W}")
            self.ring[kind] = (input_buffer(runner, f"k_{short}"), input_buffer(runner, f"v_{short}"))
            # rings kept as the graph's integer codes (quantized IO): their encodings, else None
            self.ring_encodings[kind] = (input_encoding(runner, f"k_{short}"), input_encoding(runner, f"v_{short}"))
        self.t0: int | None = None  # root position of the last hand-off (line 4)
        self.live: int | None = None  # ℓ (lines 3, 5)
        self.x_hat: np.ndarray | None = None
        self.cpu_ms = 0.0

    def reset(self) -> None:
        """Forget the ring (the next hand-off starts a request)."""
        self.t0 = self.live = self.x_hat = None
        self._masks.reset()
        for kind, (k, v) in self.ring.items():
            k_enc, v_enc = self.ring_encodings[kind]
            k[:] = zero_code(k_enc)
            v[:] = zero_code(v_enc)

    @_thread_cpu
    def ingest(self, h: HandOff) -> None:
        """Alg. 2 lines 1-5 for one hand-off (module docstring). Raises HandoffError (nothing written then)."""
        try:
            scales = [float(x) for x in h.scales]
        except (TypeError, ValueError):
            scales = []
        if len(scales) != 6 or not all(math.isfinite(x) and x > 0 for x in scales):
            raise HandoffError(f"hand-off scales {h.scales}: need 6 finite positive values")
        if h.x_hat.shape != (2 * self.hidden,):
            raise HandoffError(
                f"hand-off x_hat has {h.x_hat.shape[0] if h.x_hat.ndim else 0} values, the head graph "
                f"takes 2 x {self.hidden}"
            )
        n = h.t_prime - h.a
        if h.a < 0 or n < 0 or n > self.W:
            raise HandoffError(f"hand-off positions [{h.a}, {h.t_prime}) do not fit a {self.W}-column ring")
        # every tensor dequantized (int8 x its fixed scale) and checked before anything is written
        rows = {}
        for kind, short, ks, vs in ((SLIDING, "sliding", scales[2], scales[3]), (FULL, "full", scales[4], scales[5])):
            _, kv, _, d = self.ring[kind][0].shape
            k, v = getattr(h, f"k_{short}"), getattr(h, f"v_{short}")
            if k.shape != (n, kv * d) or v.shape != (n, kv * d):
                raise HandoffError(
                    f"hand-off {short} rows are {k.shape}/{v.shape}, expected ({n}, {kv * d}) ({kv} KV heads x {d})"
                )
            rows[kind] = (_Dequantized(k, ks), _Dequantized(v, vs))
            if not (rows[kind][0].finite() and rows[kind][1].finite()):
                raise HandoffError(f"hand-off {short} rows hold NaN or inf")
        e, hh = _Dequantized(h.x_hat[: self.hidden], scales[0]), _Dequantized(h.x_hat[self.hidden :], scales[1])
        if not (e.finite() and hh.finite()):
            raise HandoffError("hand-off x_hat holds NaN or inf")
        if self.t0 is None or h.a != self.t0:  # line 3: a new request
            self.reset()
            self.live = h.a
        runs = ring_runs(h.a, n, self.W)  # line 4: column p mod W, as one or two slices
        for kind, (k_rows, v_rows) in rows.items():
            k_ring, v_ring = self.ring[kind]
            _, kv, _, d = k_ring.shape
            for ring, x, enc in (
                (k_ring, k_rows, self.ring_encodings[kind][0]),
                (v_ring, v_rows, self.ring_encodings[kind][1]),
            ):
                for cols, src in runs:  # (n, kv x d) rows -> [kv, n, d] columns
                    x.into(ring[0, :, cols], lambda a, src=src: a.reshape(n, kv, d)[src].transpose(1, 0, 2), enc)
        x_hat = np.empty(2 * self.hidden, np.float32)
        e.into(x_hat[: self.hidden])
        hh.into(x_hat[self.hidden :])
        self.t0 = h.t_prime
        self.live = max(self.live, h.t_prime - self.W)  # line 5
        self.x_hat = x_hat

    def feeds(self, z: np.ndarray) -> dict[str, np.ndarray]:
        """The head graph's inputs for query z (float32 (2H,)) at the current ring (lines 5-6, 9). ``x_hat`` and
        the rings are the drafter's own buffers (valid until the next call). Raises NoHandoff before the first."""
        if self.t0 is None or self.live is None:
            raise NoHandoff("the head's inputs come from a hand-off: ingest one first (the first tree is SLM-only)")
        t = self.t0
        masks = self._masks.update(t, self.live)  # in place: only the columns the last hand-off changed
        q = t + self.offset
        self._query[0, 0] = z
        out = {"x_hat": self._query}
        for kind, short in ((SLIDING, "sliding"), (FULL, "full")):
            out[f"k_{short}"], out[f"v_{short}"] = self.ring[kind]
            out[f"mask_{short}"] = masks[kind]
            if q >= 0:
                cos, sin = self._rotary[kind].rows(q, 1)
                cos, sin = cos[None], sin[None]
            else:
                cos, sin = self.bundle.head_rotary[kind].rows(np.asarray([[q]]))
            out[f"cos_{short}"], out[f"sin_{short}"] = cos, sin
        return out

    @_thread_cpu
    def draft(self, steps: int | None = None, siblings: int | None = None) -> MtpDraft:
        """Alg. 2 lines 7-13 (module docstring). steps: K (default the bundle's), siblings: D. Raises NoHandoff."""
        if self.x_hat is None:
            raise NoHandoff("the MTP Drafter has no hand-off yet: the first tree of a request is SLM-only")
        K = self.K if steps is None else steps
        D = self.D if siblings is None else siblings
        keep = self._keep
        feeds = self.feeds(self.x_hat)  # ring, masks and rotary rows stay fixed over the K steps (lines 6, 9)
        z = feeds["x_hat"][0, 0]  # the query buffer, rewritten in place each step: z = [E[i]; h]
        again = getattr(self.runner, "run_again", None)  # steps 2..K: the same buffers, updated in place

        def step(k: int, runner_up: bool) -> HeadStep:
            res = self.runner.run(feeds) if k == 1 or again is None else again()
            # the graph's own top-2 (ONNX TopK: ties to the lower index) when it emits one, else the host's
            top = res["top_index"].ravel().tolist()[:2] if "top_index" in res else top2(res["logits"])
            return HeadStep(tuple(top), res)

        def feed(i: int, res) -> None:
            z[: self.hidden] = self.bundle.embed_keep(i) if self._embed is None else self._embed[i]
            z[self.hidden :] = res["h_next"].reshape(-1)

        picks = head_chain(step, feed, K, D)  # lines 7-12 (`hycoc.mtp_chain.head_chain`)
        return MtpDraft(
            [keep[i] for i in picks.chain], [keep[i] for i in picks.runner_ups], picks.chain, picks.runner_ups
        )
