"""Re-create the toy model family from scratch: ``python -m hycoc.toy.train [--out recipes/toy/models]``.

Stages (each saves its result, so a later stage can be rerun alone with ``--stages``):

1. ``tokenizer``: byte-level BPE, 4,096 ids (`hycoc.toy.tokenizer`), on the corpus of `hycoc.toy.corpus`.
2. ``verifier``: Gemma4ForCausalLM (`configs.verifier_config`), next-token loss on packed conversations.
3. ``selfgen``: the verifier answers training prompts with the toy recipe's sampling (T=1, top-k 64, top-p 0.95);
   these answers are what the drafters must predict at inference, so the head and the SLM learn on them.
4. ``head``: Gemma4AssistantForCausalLM trained on the verifier's own states -- input embedding of the root, last
   hidden state before the final norm, shared KV of the last sliding and last full layer -- unrolled K=4 steps as it
   drafts (next input = [e(token); head's projected state], query position fixed at t-1, W-column windows),
   KL to the verifier's distribution at every step.
5. ``slm``: Gemma4ForCausalLM with per-layer inputs and KV sharing, distilled from the verifier (KL), then
   fake-quantized fine-tuning at its bit map and saved in transformers' pre-quantized Gemma format.
6. ``eval``: the numbers of docs/toy-family.md's table (`hycoc.toy.evaluate`).
7. ``conversations``: the toy recipe's conversation files (`hycoc.toy.conversations`): the verifier answers
   training prompts (keep-set counts and calibration prompts) and held-out prompts (validation), written to
   ``recipes/toy/data/``.

Only this trainer reads outside the repository: its corpus is the Python 3.11 documentation sources of Debian's
``python3.11-doc`` package (``apt-get install -y python3.11-doc``) and the interpreter's standard library.
`hycoc build` and `hycoc bench` read the files this trainer wrote into the repository and nothing else.

Deterministic for a seed on one machine (CPU, fixed thread count, fixed step counts).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from hycoc.mtp import FULL, SLIDING, head_step, window_mask
from hycoc.toy import configs
from hycoc.toy.chat_files import conversation_text, prompt_text, write_tokenizer_folder
from hycoc.toy.corpus import build_corpus
from hycoc.toy.generation import sample_answers

DEFAULT_OUT = Path(__file__).resolve().parents[2] / "recipes" / "toy" / "models"
SEQ_LEN = 512
HEAD_WINDOW = 256  # the toy recipe's W (paper: 1,024)
K = 4


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ----------------------------------------------------------------------------------------------- data
def pack_sequences(token_lists: list[list[int]], seq_len: int, seed: int) -> torch.Tensor:
    """Concatenate shuffled token lists and cut into rows of seq_len. Returns int64 (N, seq_len)."""
    order = list(range(len(token_lists)))
    random.Random(seed).shuffle(order)
    flat = [t for i in order for t in token_lists[i]]
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.long).view(n, seq_len)


def encode_corpus(tok, convs) -> list[list[int]]:
    return [tok.encode(conversation_text(c.user, c.model), add_special_tokens=False).ids for c in convs]


class Schedule:
    """Linear warm-up then cosine decay to 10% over `total` steps."""

    def __init__(self, opt, lr: float, warmup: int, total: int):
        self.opt, self.lr, self.warmup, self.total = opt, lr, warmup, max(total, warmup + 1)

    def step(self, i: int) -> None:
        if i < self.warmup:
            f = (i + 1) / self.warmup
        else:
            p = min(1.0, (i - self.warmup) / (self.total - self.warmup))
            f = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))
        for g in self.opt.param_groups:
            g["lr"] = self.lr * f


def update(loss: torch.Tensor, model, opt) -> float:
    """One optimizer step on ``loss`` (a scalar): backward, gradients clipped to norm 1.0, step, gradients cleared.
    Returns the loss as a float."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item()


def run_steps(step_fn, total: int, lr: float, opt, warmup: int, name: str):
    """Run step_fn(i) for a fixed number of steps (deterministic), logging loss and an ETA."""
    sched = Schedule(opt, lr, warmup, total)
    t0 = time.time()
    losses = []
    for i in range(total):
        sched.step(i)
        losses.append(step_fn(i))
        if i + 1 == 3:
            per = (time.time() - t0) / 3
            log(f"{name}: {per:.2f} s/step, {total} steps, ETA {per * total / 60:.1f} min")
        if (i + 1) % 50 == 0 or i + 1 == total:
            log(
                f"{name}: step {i + 1}/{total} loss {sum(losses[-50:]) / len(losses[-50:]):.4f} "
                f"({(time.time() - t0) / 60:.1f} min)"
            )
    return losses


# ------------------------------------------------------------------------------------------ verifier
class PreNormCapture:
    """Forward pre-hook on the verifier's final norm: captures the last hidden state BEFORE the norm.

    transformers ties ``hidden_states[-1]`` to the post-norm ``last_hidden_state``; the paper's hand-off uses the
    pre-norm state (App. A), so the head is trained on that tensor.
    """

    def __init__(self, model):
        self.value = None
        self.handle = model.model.norm.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.value = args[0]


def verifier_states(verifier, capture: PreNormCapture, ids: torch.Tensor):
    """One no-grad verifier pass. Returns (logits (B,L,V), h pre-norm (B,L,H), shared_kv {type: (k, v)}, e (B,L,H))."""
    with torch.no_grad():
        out = verifier(input_ids=ids, return_shared_kv_states=True, use_cache=False)
        e = verifier.model.embed_tokens(ids)
    return out.logits.float(), capture.value, out.shared_kv_states, e


def train_verifier(data: torch.Tensor, steps: int, seed: int, batch: int = 16):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    model = Gemma4ForCausalLM(configs.verifier_config())
    model.train()
    log(f"verifier: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, {data.numel() / 1e6:.2f} M tokens")
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(data), generator=g)

    def step(i):
        idx = perm[(torch.arange(batch) + i * batch) % len(data)]
        x = data[idx]
        return update(model(input_ids=x, labels=x).loss, model, opt)

    run_steps(step, steps, 2e-3, opt, 100, "verifier")
    return model.eval()


# --------------------------------------------------------------------------------------------- selfgen
#: The selfgen stage's sampling (T=1, top-k 64, top-p 0.95), also `hycoc.toy.evaluate`'s.
SELFGEN_SAMPLING = {"temperature": 1.0, "top_k": 64, "top_p": 0.95}


def self_generate(verifier, tok, convs, n_prompts: int, max_new: int, seed: int, batch: int = 48):
    """The verifier's own answers (T=1, top-k 64, top-p 0.95) to the first n_prompts user turns.

    Returns a list of full token lists (prompt + answer). Left-padded batched generation with transformers.
    """
    torch.manual_seed(seed)
    rng = random.Random(seed)
    chosen = rng.sample(convs, min(n_prompts, len(convs)))
    out = []
    t0 = time.time()
    for b in range(0, len(chosen), batch):
        prompts = [tok.encode(prompt_text(c.user), add_special_tokens=False).ids[-200:] for c in chosen[b : b + batch]]
        answers = sample_answers(verifier, prompts, max_new, pad=0, stops=(1, 6), **SELFGEN_SAMPLING)
        out += [p + ans for p, ans in zip(prompts, answers)]
        log(f"selfgen: {len(out)}/{len(chosen)} answers ({time.time() - t0:.0f} s)")
    return out


# ------------------------------------------------------------------------------------------------ head
def head_masks(L: int, n: int, device="cpu"):
    """Masks of n anchor queries t = 1..n over L keys: full layer [t-W, t), sliding [t-min(W, w_s), t)."""
    t = torch.arange(1, n + 1, device=device)[None]
    w_s = min(HEAD_WINDOW, configs.SLIDING_WINDOW)
    return {FULL: window_mask(t, L, HEAD_WINDOW), SLIDING: window_mask(t, L, w_s)}


def head_unroll(head, ids, h, kv, e, masks, k_steps: int = K):
    """Unrolled K-step drafting for every anchor t in 1..L-K of each row (paper Alg. 2 lines 7-12).

    Step k's input is [e(x_{t+k-1}); z] with z = h_{t-1} at k=1, else the head's previous projected state; the
    query position is fixed at t-1. The token fed at step k >= 2 is the sequence's own token, which equals the
    drafted top-1 exactly on the chains that are still alive at inference. Returns a list of K logits tensors
    (B, n, V), entry k-1 predicting the token at position t+k.
    """
    B, L = ids.shape
    n = L - k_steps
    pos = (torch.arange(1, n + 1) - 1)[None].expand(B, n)
    z = h[:, 0:n]  # h_{t-1} for t = 1..n
    outs = []
    for k in range(1, k_steps + 1):
        x_hat = torch.cat([e[:, k : n + k], z], dim=-1)  # e(x_{t+k-1}) for t = 1..n
        logits, z = head_step(head, x_hat, kv, masks, pos)
        outs.append(logits)
    return outs


def kl_loss(student_logits, teacher_logits):
    """KL(teacher || student) per token, teacher at temperature 1. Shapes (..., V)."""
    t = F.log_softmax(teacher_logits, -1)
    s = F.log_softmax(student_logits.float(), -1)
    return (t.exp() * (t - s)).sum(-1).mean()


def train_head(verifier, data: torch.Tensor, steps: int, seed: int, batch: int = 8, seq: int = 384):
    from transformers import Gemma4AssistantForCausalLM

    torch.manual_seed(seed)
    head = Gemma4AssistantForCausalLM(configs.head_config())
    head.train()
    log(f"head: {sum(p.numel() for p in head.parameters()) / 1e6:.2f} M params")
    cap = PreNormCapture(verifier)
    opt = torch.optim.AdamW(head.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.0)
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + 1))
    masks = head_masks(seq, seq - K)

    def step(i):
        x = data[perm[(torch.arange(batch) + i * batch) % len(data)]][:, :seq]
        logits, h, kv, e = verifier_states(verifier, cap, x)
        outs = head_unroll(head, x, h, kv, e, masks)
        n = seq - K
        return update(sum(kl_loss(o, logits[:, k : n + k]) for k, o in enumerate(outs, start=1)) / K, head, opt)

    run_steps(step, steps, 2e-3, opt, 50, "head")
    cap.handle.remove()
    return head.eval()


# ------------------------------------------------------------------------------------------------- slm
class FakeQuant(torch.autograd.Function):
    """Per-channel symmetric fake quantization with a straight-through estimator (Bengio et al., 2013)."""

    @staticmethod
    def forward(ctx, w, bits):
        from hycoc.passes.bit_map import qmax

        s = w.detach().abs().amax(1, keepdim=True).clamp_min(1e-8) / qmax(bits)
        return torch.clamp(torch.round(w / s), -qmax(bits), qmax(bits)) * s

    @staticmethod
    def backward(ctx, g):
        return g, None


def fake_quantize_linears(model, bit_map, default_bits):
    """Wrap every Linear's forward so it computes with fake-quantized weights at its bit width."""
    from hycoc.toy.gemma_format import bits_for

    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear):
            bits = bits_for(name, bit_map, default_bits)
            forward = (lambda m, b: lambda x: F.linear(x, FakeQuant.apply(m.weight, b), m.bias))(mod, bits)
            # the instance's own forward (nn.Module.__call__ calls self.forward), as torch's Module declares forward
            # a Callable attribute; Linear's is a method, which mypy refuses to reassign
            mod.forward = forward  # type: ignore[method-assign]


def train_slm(verifier, data: torch.Tensor, steps: int, qat_steps: int, seed: int, batch: int = 16):
    from transformers import Gemma4ForCausalLM

    torch.manual_seed(seed)
    slm = Gemma4ForCausalLM(configs.slm_config())
    slm.train()
    log(f"slm: {sum(p.numel() for p in slm.parameters()) / 1e6:.2f} M params")
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed + 2))

    def make_step(opt):
        def step(i):
            x = data[perm[(torch.arange(batch) + i * batch) % len(data)]]
            with torch.no_grad():
                t = verifier(input_ids=x, use_cache=False).logits.float()
            return update(kl_loss(slm(input_ids=x, use_cache=False).logits, t), slm, opt)

        return step

    opt = torch.optim.AdamW(slm.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.05)
    run_steps(make_step(opt), steps, 3e-3, opt, 100, "slm")
    fake_quantize_linears(slm, configs.SLM_BIT_MAP, configs.SLM_DEFAULT_BITS)
    opt = torch.optim.AdamW(slm.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    run_steps(make_step(opt), qat_steps, 3e-4, opt, 10, "slm-qat")
    return slm.eval()


# ------------------------------------------------------------------------------------------------ main
def save_float(model, path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the family (default: %(default)s)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/hycoc-toy-work"), help="scratch folder for caches")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (fix it for reproducibility)")
    ap.add_argument("--stages", default="tokenizer,verifier,selfgen,head,slm,eval,conversations")
    ap.add_argument(
        "--data-out",
        type=Path,
        default=None,
        help="folder of the conversation files (default: recipes/toy/data in the repository)",
    )
    # Fixed step counts keep a rerun bit-identical; on 2 cores they take about 33 / 16 / 11 / 3 minutes.
    ap.add_argument("--verifier-steps", type=int, default=500, help="batches of 16 x 512 tokens")
    ap.add_argument("--head-steps", type=int, default=600, help="batches of 8 x 384 tokens, K=4 unrolled")
    ap.add_argument("--slm-steps", type=int, default=320, help="distillation batches of 16 x 512 tokens")
    ap.add_argument("--slm-qat-steps", type=int, default=80, help="fake-quantized distillation batches")
    ap.add_argument("--selfgen-prompts", type=int, default=1536)
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    stages = set(args.stages.split(","))
    out, work = args.out, args.work
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)

    from hycoc.toy.corpus import DOCS_DIR

    if not DOCS_DIR.is_dir():
        raise SystemExit(
            f"hycoc.toy.train: the toy corpus needs {DOCS_DIR}: install Debian's python3.11-doc "
            "(`apt-get install -y python3.11-doc`). Only this trainer needs it: hycoc build and "
            "hycoc bench read the files it wrote into recipes/toy/."
        )
    train, held = build_corpus()
    log(f"corpus: {len(train)} train / {len(held)} held-out conversations")
    from hycoc.models import load_tokenizer, load_verifier

    if "tokenizer" in stages:
        from hycoc.toy.tokenizer import train_tokenizer

        tok = train_tokenizer((conversation_text(c.user, c.model) for c in train), configs.VOCAB_SIZE)
        write_tokenizer_folder(tok, out / "verifier", configs.verifier_config().max_position_embeddings)
        log(f"tokenizer: {tok.get_vocab_size()} ids")
    tok = load_tokenizer(out / "verifier" / "tokenizer.json")

    corpus_data = pack_sequences(encode_corpus(tok, train), SEQ_LEN, args.seed)
    if "verifier" in stages:
        v = train_verifier(corpus_data, args.verifier_steps, args.seed)
        save_float(v, out / "verifier")
    verifier = load_verifier(out / "verifier")
    verifier.requires_grad_(False)

    sg_path = work / "selfgen.json"
    if "selfgen" in stages:
        sg = self_generate(verifier, tok, train, args.selfgen_prompts, 320, args.seed)
        sg_path.write_text(json.dumps(sg))
    selfgen = json.loads(sg_path.read_text()) if sg_path.exists() else []
    # Drafter data: the verifier's own answers (what it generates at inference) mixed 1:1 with corpus rows.
    sg_rows = pack_sequences(selfgen, SEQ_LEN, args.seed) if selfgen else corpus_data[:0]
    n = min(len(sg_rows), len(corpus_data))
    drafter_data = torch.cat([sg_rows, corpus_data[: max(n, 256)]])
    log(f"drafter data: {len(sg_rows)} self-generated + {max(n, 256)} corpus rows of {SEQ_LEN}")

    if "head" in stages:
        head = train_head(verifier, drafter_data, args.head_steps, args.seed)
        save_float(head, out / "head")
    if "slm" in stages:
        from hycoc.toy.gemma_format import save_prequantized

        slm = train_slm(verifier, drafter_data, args.slm_steps, args.slm_qat_steps, args.seed)
        save_prequantized(slm, out / "slm", configs.SLM_BIT_MAP, configs.SLM_DEFAULT_BITS, configs.SLM_EMBEDDING_BITS)
        log("slm: saved in the pre-quantized Gemma format")
    if "eval" in stages:
        from hycoc.toy.evaluate import evaluate_family

        evaluate_family(out, held, selfgen_seed=args.seed + 7)
    if "conversations" in stages:
        from hycoc.chat_template import load_chat
        from hycoc.toy.conversations import DATA_DIR, make_conversation_files

        chat = load_chat(out / "verifier", out / "verifier")  # the files written above, as every command reads them
        sizes = make_conversation_files(verifier, chat, train, held, args.seed, args.data_out or DATA_DIR, log=log)
        log("conversations: " + ", ".join(f"{name} {size / 1e6:.2f} MB" for name, size in sizes.items()))


if __name__ == "__main__":
    main()
