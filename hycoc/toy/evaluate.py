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
    cap = {}
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
    from hycoc.models import load_head, load_slm, load_tokenizer, load_verifier
    from hycoc.toy.train import SELFGEN_SAMPLING, SEQ_LEN, encode_corpus, log, pack_sequences

    models_dir = Path(models_dir)
    tok = load_tokenizer(models_dir / "verifier" / "tokenizer.json")
    verifier = load_verifier(models_dir / "verifier")
    head = load_head(models_dir / "head")
    slm = load_slm(models_dir / "slm")
    sw = verifier.config.sliding_window
    report: dict = {
        "params_M": {
            "verifier": round(sum(p.numel() for p in verifier.parameters()) / 1e6, 3),
            "head": round(sum(p.numel() for p in head.parameters()) / 1e6, 3),
        }
    }

    # 1. held-out perplexity on corpus conversations
    rows = pack_sequences(encode_corpus(tok, held), SEQ_LEN, 0)
    nll, count = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(rows), 8):
            x = rows[b : b + 8]
            lp = F.log_softmax(verifier(input_ids=x, use_cache=False).logits.float(), -1)
            nll -= lp[:, :-1].gather(-1, x[:, 1:, None]).sum().item()
            count += x[:, 1:].numel()
    report["verifier_heldout_ppl"] = round(float(torch.exp(torch.tensor(nll / count))), 3)
    report["heldout_tokens"] = count
    log(f"eval: verifier held-out perplexity {report['verifier_heldout_ppl']} over {count} tokens")

    # 2. the verifier's own sampled answers to held-out prompts
    torch.manual_seed(selfgen_seed)
    rng = random.Random(selfgen_seed)
    prompts = [c.user for c in rng.sample(held, min(n_prompts, len(held)))]
    seqs = []
    for p in prompts:
        ids = torch.tensor([tok.encode(prompt_text(p), add_special_tokens=False).ids])
        with torch.no_grad():
            g = verifier.generate(
                input_ids=ids, do_sample=True, max_new_tokens=max_new, pad_token_id=0, **SELFGEN_SAMPLING
            )
        seqs.append((ids.shape[1], g[0]))
    temps = (1.0, 0.7, 0.5)
    agree = torch.zeros(4)
    mat = {T: [] for T in temps}
    slm_hits, slm_n, n_anchor = 0, 0, 0
    absmax = {k: [] for k in ("e", "h", "k_sliding", "v_sliding", "k_full", "v_full")}
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
        e_root = e[:, anchors]
        chain = head_chain(head, h, kv, e_root, verifier.model.embed_tokens, anchors, window, sw)
        # one teacher-forced verifier pass per anchor over prefix + root + head chain (right-padded, causal)
        rows_ = [torch.cat([s[: t + 1], chain[i]]) for i, t in enumerate(anchors)]
        width = max(len(r) for r in rows_)
        batch = torch.stack([F.pad(r, (0, width - len(r))) for r in rows_])
        with torch.no_grad():
            vl = verifier(input_ids=batch, use_cache=False).logits.float()
        for i, t in enumerate(anchors):
            lg = vl[i, t : t + 4]  # predicts chain[i, 0..3]
            hit = (lg.argmax(-1) == chain[i]).float()
            agree += torch.cumprod(hit, 0)
            for T in temps:
                p = sampling_probs(lg, T, 64, 0.95).gather(-1, chain[i][:, None])[:, 0]
                mat[T].append(1 + torch.cumprod(p, 0).sum().item())
            n_anchor += 1
    report["anchors"] = n_anchor
    report["head_greedy_agreement_cumulative"] = [round(x, 4) for x in (agree / n_anchor).tolist()]
    report["head_expected_chain_mat"] = {str(T): round(sum(v) / len(v), 4) for T, v in mat.items()}
    report["slm_top1_agreement"] = round(slm_hits / slm_n, 4)
    scales = {}
    for k, v in absmax.items():
        x = torch.cat(v)
        q = torch.quantile(x[torch.randperm(len(x))[:1_000_000]], 0.9999).item()
        scales[k] = round(q / 127, 6)
    report["handoff_scales"] = scales
    log(f"eval: {json.dumps(report)}")

    # 3. reference logits for a fixed input (tests reload the committed weights and compare)
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
    ref = {
        "prompt": REFERENCE_PROMPT,
        "input_ids": ids[0].tolist(),
        "verifier_last": logits[0, -1, :64].tolist(),
        "verifier_argmax": logits[0].argmax(-1).tolist(),
        "head_step1": hl[0, 0, :64].tolist(),
        "slm_last": sl[0, -1, :64].tolist(),
        "slm_argmax": sl[0].argmax(-1).tolist(),
    }
    (models_dir / "reference_logits.json").write_text(json.dumps(ref))
    (models_dir / "report.json").write_text(json.dumps(report, indent=2))
    _print_table(report)
    return report


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
