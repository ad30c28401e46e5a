"""Measure the toy family: the numbers of the table in docs/toy-family.md.

* verifier held-out perplexity (corpus conversations never trained on);
* on the verifier's own sampled answers to held-out prompts (what it generates at inference), at anchors
  inside the answers: the head's cumulative top-1 agreement with the verifier's greedy chain at depths 1-4, and
  the head's expected chain MAT 1 + sum_k prod_{j<=k} p~(y_j) under the recipe's sampling p~ (T, top-k, top-p);
* the SLM's top-1 agreement with the verifier at the same positions (the pre-quantized checkpoint);
* the fixed int8 hand-off scales (99.99th percentile of |x| / 127 per tensor) for recipes/toy.toml;
* reference logits for a fixed input, which tests compare against after loading the committed weights.

Writes ``report.json`` and ``reference_logits.json`` next to the models and prints a table.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
import torch.nn.functional as F

from hycoc.mtp import FULL, SLIDING, head_step, window_mask
from hycoc.toy.chat_files import prompt_text

REFERENCE_PROMPT = "What is a list comprehension?"


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """p~ of paper Alg. 4 line 5 over the last dim: temperature, top-k, top-p nucleus, renormalized."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    vals, idx = torch.topk(logits.float() / temperature, top_k, dim=-1)
    p = F.softmax(vals, -1)
    keep = (p.cumsum(-1) - p) < top_p  # smallest prefix whose mass reaches top_p
    p = torch.where(keep, p, 0.0)
    p = p / p.sum(-1, keepdim=True)
    return torch.zeros_like(logits, dtype=torch.float).scatter(-1, idx, p)


def _states(verifier, ids):
    cap: dict[str, torch.Tensor] = {}
    hnd = verifier.model.norm.register_forward_pre_hook(lambda m, a: cap.__setitem__("h", a[0]))
    with torch.no_grad():
        out = verifier(input_ids=ids, return_shared_kv_states=True, use_cache=False)
        e = verifier.model.embed_tokens(ids)
    hnd.remove()
    return out.logits.float(), cap["h"], out.shared_kv_states, e


def head_chain(head, h, kv, e_root, embed, anchors, window: int, sliding_window: int, k_steps: int = 4):
    """Greedy K-step chain of the head for each anchor root position t (one sequence, batch 1).

    Returns int64 (n_anchors, K). Inputs follow Alg. 2: [e(root); h_{t-1}], then [e(y_k); h'_k].
    """
    t = torch.tensor(anchors)[None]
    L = kv[FULL][0].shape[2]
    masks = {FULL: window_mask(t, L, window), SLIDING: window_mask(t, L, min(window, sliding_window))}
    pos = t - 1
    z = h[:, t[0] - 1]
    x = e_root
    ys = []
    with torch.no_grad():
        for _ in range(k_steps):
            logits, z = head_step(head, torch.cat([x, z], -1), kv, masks, pos)
            y = logits.argmax(-1)
            ys.append(y[0])
            x = embed(y)
    return torch.stack(ys, -1)


def evaluate_family(
    models_dir: Path,
    held,
    selfgen_seed: int,
    n_prompts: int = 48,
    max_new: int = 256,
    anchors_per_seq: int = 8,
    window: int = 256,
) -> dict:
    """The toy family's numbers (module docstring) for the models under ``models_dir`` (verifier/, head/, slm/),
    measured on the held-out conversations ``held``: writes ``report.json`` and ``reference_logits.json`` there,
    prints the table and returns the report. ``selfgen_seed`` seeds the verifier's sampled answers and the anchors;
    ``n_prompts`` answers of at most ``max_new`` tokens, ``anchors_per_seq`` anchors in each, the head's window W."""
    from hycoc.models import load_head, load_slm, load_tokenizer, load_verifier
    from hycoc.toy.train import log

    models_dir = Path(models_dir)
    tok = load_tokenizer(models_dir / "verifier" / "tokenizer.json")
    verifier = load_verifier(models_dir / "verifier")
    head = load_head(models_dir / "head")
    slm = load_slm(models_dir / "slm")
    report: dict = {
        "params_M": {
            "verifier": round(sum(p.numel() for p in verifier.parameters()) / 1e6, 3),
            "head": round(sum(p.numel() for p in head.parameters()) / 1e6, 3),
        }
    }

    # 1. held-out perplexity on corpus conversations
    report["verifier_heldout_ppl"], report["heldout_tokens"] = heldout_perplexity(verifier, tok, held)
    log(f"eval: verifier held-out perplexity {report['verifier_heldout_ppl']} over {report['heldout_tokens']} tokens")

    # 2. the verifier's own sampled answers to held-out prompts
    torch.manual_seed(selfgen_seed)
    rng = random.Random(selfgen_seed)
    seqs = sample_answers(verifier, tok, held, rng, n_prompts, max_new)
    report.update(measure_answers(verifier, head, slm, seqs, rng, anchors_per_seq, window))
    log(f"eval: {json.dumps(report)}")

    # 3. reference logits for a fixed input (tests reload the committed weights and compare)
    ref = reference_logits(verifier, head, slm, tok, window)
    (models_dir / "reference_logits.json").write_text(json.dumps(ref))
    (models_dir / "report.json").write_text(json.dumps(report, indent=2))
    _print_table(report)
    return report


def heldout_perplexity(verifier, tok, held) -> tuple[float, int]:
    """The verifier's perplexity on the held-out conversations (packed into `hycoc.toy.train.SEQ_LEN`-token rows,
    8 rows a forward): exp of the mean next-token negative log-likelihood, rounded to 3 decimals, and the tokens
    it is over."""
    from hycoc.toy.train import SEQ_LEN, encode_corpus, pack_sequences

    rows = pack_sequences(encode_corpus(tok, held), SEQ_LEN, 0)
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(rows), 8):
            x = rows[b : b + 8]
            lp = F.log_softmax(verifier(input_ids=x, use_cache=False).logits.float(), -1)
            nll -= lp[:, :-1].gather(-1, x[:, 1:, None]).sum().item()
            count += x[:, 1:].numel()
    return round(float(torch.exp(torch.tensor(nll / count))), 3), count


def sample_answers(verifier, tok, held, rng: random.Random, n_prompts: int, max_new: int) -> list:
    """The verifier's own sampled answers (T 1.0, top-k 64, top-p 0.95, at most ``max_new`` tokens; torch's global
    generator) to ``n_prompts`` held-out user turns drawn with ``rng``: [(prompt tokens, prompt + answer ids)]."""
    from hycoc.toy.train import SELFGEN_SAMPLING

    prompts = [c.user for c in rng.sample(held, min(n_prompts, len(held)))]
    seqs = []
    for p in prompts:
        ids = torch.tensor([tok.encode(prompt_text(p), add_special_tokens=False).ids])
        with torch.no_grad():
            g = verifier.generate(
                input_ids=ids, do_sample=True, max_new_tokens=max_new, pad_token_id=0, **SELFGEN_SAMPLING
            )
        seqs.append((ids.shape[1], g[0]))
    return seqs


#: Temperatures of the head's expected chain MAT (top-k 64, top-p 0.95 each).
MAT_TEMPERATURES = (1.0, 0.7, 0.5)


def expected_chain_mat(p: torch.Tensor) -> float:
    """Expected tokens a round commits from a chain whose k-th token the verifier accepts with probability p[k]
    (each given the ones before): 1 + sum_k prod_{j<=k} p[j] (the bonus token, then each accepted prefix)."""
    return 1 + torch.cumprod(p, 0).sum().item()


def measure_answers(verifier, head, slm, seqs, rng: random.Random, anchors_per_seq: int, window: int) -> dict:
    """The numbers measured on the verifier's answers ``seqs`` (`sample_answers`; those with fewer than 8 answer
    tokens skipped): at up to ``anchors_per_seq`` anchors per answer drawn with ``rng``, the head's greedy K = 4
    chain (`head_chain`) against the verifier's greedy tokens after it (cumulative top-1 agreement per depth) and
    its expected chain MAT at each of `MAT_TEMPERATURES`; the SLM's top-1 agreement with the verifier on every
    answer position; the int8 hand-off scales of e, h and the producer layers' K and V (`handoff_scales`)."""
    sw = verifier.config.sliding_window
    agree = torch.zeros(4)
    mat: dict[float, list[float]] = {T: [] for T in MAT_TEMPERATURES}
    slm_hits, slm_n, n_anchor = 0, 0, 0
    absmax: dict[str, list[torch.Tensor]] = {k: [] for k in ("e", "h", "k_sliding", "v_sliding", "k_full", "v_full")}
    for plen, s in seqs:
        L = len(s)
        if L - plen < 8:
            continue
        ids = s[None]
        logits, h, kv, e = _states(verifier, ids)
        for name, x in (
            ("e", e),
            ("h", h),
            ("k_sliding", kv[SLIDING][0]),
            ("v_sliding", kv[SLIDING][1]),
            ("k_full", kv[FULL][0]),
            ("v_full", kv[FULL][1]),
        ):
            absmax[name].append(x.abs().flatten().float())
        with torch.no_grad():
            sl = slm(input_ids=ids, use_cache=False).logits.float()
        slm_hits += (sl[0, plen:].argmax(-1) == logits[0, plen:].argmax(-1)).sum().item()
        slm_n += L - plen
        cand = list(range(plen, L - 1))
        anchors = sorted(rng.sample(cand, min(anchors_per_seq, len(cand))))
        chain = head_chain(head, h, kv, e[:, anchors], verifier.model.embed_tokens, anchors, window, sw)
        for i, lg in enumerate(chain_logits(verifier, s, anchors, chain)):
            hit = (lg.argmax(-1) == chain[i]).float()
            agree += torch.cumprod(hit, 0)
            for T in MAT_TEMPERATURES:
                mat[T].append(expected_chain_mat(sampling_probs(lg, T, 64, 0.95).gather(-1, chain[i][:, None])[:, 0]))
            n_anchor += 1
    return {
        "anchors": n_anchor,
        "head_greedy_agreement_cumulative": [round(x, 4) for x in (agree / n_anchor).tolist()],
        "head_expected_chain_mat": {str(T): round(sum(v) / len(v), 4) for T, v in mat.items()},
        "slm_top1_agreement": round(slm_hits / slm_n, 4),
        "handoff_scales": handoff_scales(absmax),
    }


def chain_logits(verifier, s: torch.Tensor, anchors: list[int], chain: torch.Tensor) -> list[torch.Tensor]:
    """The verifier's float logits that predict each anchor's chain: one teacher-forced pass per anchor over
    prefix + root + head chain (right-padded, causal, one batch), the K = 4 rows from the root's. Per anchor
    (K, V)."""
    rows_ = [torch.cat([s[: t + 1], chain[i]]) for i, t in enumerate(anchors)]
    width = max(len(r) for r in rows_)
    batch = torch.stack([F.pad(r, (0, width - len(r))) for r in rows_])
    with torch.no_grad():
        vl = verifier(input_ids=batch, use_cache=False).logits.float()
    return [vl[i, t : t + 4] for i, t in enumerate(anchors)]  # predicts chain[i, 0..3]


def handoff_scales(absmax: dict[str, list[torch.Tensor]]) -> dict[str, float]:
    """The fixed int8 hand-off scale of each tensor from its |x| values: the 99.99th percentile over at most
    10**6 of them (a random subset, torch's global generator) / 127, rounded to 6 decimals."""
    scales = {}
    for k, v in absmax.items():
        x = torch.cat(v)
        q = torch.quantile(x[torch.randperm(len(x))[:1_000_000]], 0.9999).item()
        scales[k] = round(q / 127, 6)
    return scales


def reference_logits(verifier, head, slm, tok, window: int) -> dict:
    """Logits of the three models for `REFERENCE_PROMPT` (tests reload the committed weights and compare): the
    verifier's first 64 of the last position and its argmax per position, the head's first step (first 64) at
    the last position, the SLM's likewise."""
    sw = verifier.config.sliding_window
    ids = torch.tensor([tok.encode(prompt_text(REFERENCE_PROMPT), add_special_tokens=False).ids])
    logits, h, kv, e = _states(verifier, ids)
    t = ids.shape[1] - 1
    with torch.no_grad():
        hl, _ = head_step(
            head,
            torch.cat([e[:, t : t + 1], h[:, t - 1 : t]], -1),
            kv,
            {
                FULL: window_mask(torch.tensor([[t]]), t + 1, window),
                SLIDING: window_mask(torch.tensor([[t]]), t + 1, min(window, sw)),
            },
            torch.tensor([[t - 1]]),
        )
        sl = slm(input_ids=ids, use_cache=False).logits.float()
    return {
        "prompt": REFERENCE_PROMPT,
        "input_ids": ids[0].tolist(),
        "verifier_last": logits[0, -1, :64].tolist(),
        "verifier_argmax": logits[0].argmax(-1).tolist(),
        "head_step1": hl[0, 0, :64].tolist(),
        "slm_last": sl[0, -1, :64].tolist(),
        "slm_argmax": sl[0].argmax(-1).tolist(),
    }


def _print_table(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title="toy family")
    t.add_column("metric")
    t.add_column("value")
    t.add_row("verifier held-out perplexity", str(r["verifier_heldout_ppl"]))
    t.add_row("head greedy agreement d1..d4 (cumulative)", " / ".join(map(str, r["head_greedy_agreement_cumulative"])))
    for T, v in r["head_expected_chain_mat"].items():
        t.add_row(f"head expected chain MAT, T={T}, top-k 64, top-p 0.95", str(v))
    t.add_row("SLM top-1 agreement with verifier", str(r["slm_top1_agreement"]))
    Console().print(t)
