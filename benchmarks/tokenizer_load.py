"""What loading a real-size tokenizer costs, and how often hycoc parses it (issue: "Load the tokenizer once").

    python benchmarks/tokenizer_load.py [--vocab 262144] [--out DIR]

No Gemma 4 tokenizer.json is reachable here, so this writes a synthetic one of Gemma 4's size: a byte-level BPE of
``--vocab`` ids (the 256 byte symbols, then merges of random pairs of earlier tokens), Gemma 4's special tokens as
added tokens, and the toy's chat template in a tokenizer_config.json. It then measures, in this process: one parse
(``tokenizers.Tokenizer.from_file``: seconds and the process's resident memory added, from /proc), and the parses that
`hycoc.chat_template.load_chat` and two `hycoc.models.load_tokenizer` calls after it make (counted by wrapping
``Tokenizer.from_file``): 1 with the per-process cache, where every call parsed the file before (load_chat alone
parsed it twice).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path


def write_synthetic(folder: Path, vocab: int, seed: int = 0) -> Path:
    """A byte-level BPE tokenizer folder of ``vocab`` ids (module docstring). Returns the folder."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    from hycoc.toy.chat_files import CHAT_TEMPLATE

    rng = random.Random(seed)
    alphabet = ByteLevel.alphabet()
    tokens = sorted(alphabet)
    have = set(tokens)
    merges = []
    while len(tokens) < vocab:
        a, b = tokens[rng.randrange(len(tokens))], tokens[rng.randrange(min(len(tokens), 4096))]
        if a + b in have or len(a + b) > 24:
            continue
        have.add(a + b)
        tokens.append(a + b)
        merges.append((a, b))
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>"]
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE})
    )
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [vocab + 1, vocab + 4]}))
    return folder


def _rss() -> int:
    """This process's resident bytes (Linux /proc; 0 elsewhere)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=262_144)
    ap.add_argument("--out", type=Path, default=None, help="where to write the synthetic folder (default: a temp dir)")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer

    from hycoc import models
    from hycoc.chat_template import load_chat

    out = args.out or Path(tempfile.mkdtemp(prefix="hycoc-tok-"))
    t0 = time.perf_counter()
    folder = write_synthetic(out, args.vocab)
    size = (folder / "tokenizer.json").stat().st_size
    print(
        f"synthetic tokenizer.json: {args.vocab:,} ids, {size / 2**20:.1f} MiB, written in "
        f"{time.perf_counter() - t0:.1f} s"
    )
    rss0 = _rss()
    t0 = time.perf_counter()
    Tokenizer.from_file(str(folder / "tokenizer.json"))
    print(f"one parse: {time.perf_counter() - t0:.2f} s, +{(_rss() - rss0) / 2**20:.0f} MiB resident")
    parses = []
    real = Tokenizer.from_file
    Tokenizer.from_file = staticmethod(lambda p: parses.append(p) or real(p))
    try:
        t0 = time.perf_counter()
        load_chat(folder, folder)
        models.load_tokenizer(folder)
        models.load_tokenizer(folder / "tokenizer.json")
        spent = time.perf_counter() - t0
    finally:
        Tokenizer.from_file = real
    print(
        f"load_chat + 2 x load_tokenizer: {len(parses)} parse(s), {spent:.2f} s in all "
        f"(hycoc.models.tokenizer_load_seconds: {models.tokenizer_load_seconds()})"
    )


if __name__ == "__main__":
    main()
