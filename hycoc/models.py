"""Load the three models of a recipe: verifier, MTP head, SLM (and the tokenizer), from local folders.

Model hubs are not reachable from build machines, so every loader takes a local path (or an offline HF cache
entry) and says exactly what is missing and how to provide it. torch/transformers are imported lazily so the
device runtime can import hycoc without them.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path


class ModelNotFoundError(FileNotFoundError):
    """A recipe names a model that is not on this machine. The message says which and how to provide it."""


def require_model_dir(path: str | Path, role: str) -> Path:
    """``path`` as a Path when it holds a config.json (a model folder); raises ModelNotFoundError naming ``role``
    (verifier, head, slm) and how to provide the folder."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise ModelNotFoundError(
            f"{role} model not found at '{p}': no config.json there. Download it on a machine with hub access "
            f"(`hf download <id> --local-dir {p}`) and copy the folder here, or point the recipe's "
            f"[models].{role} at a local folder."
        )
    return p


def model_dir(recipe, role: str) -> Path:
    """The local folder (or file) of a recipe's ``[models].<role>`` (`hycoc.recipe.Recipe.model_path`). Raises
    ModelNotFoundError naming the model, the recipe key and how to provide it (a hub id must be downloaded; a path
    must exist)."""
    from hycoc.recipe import RecipeError

    try:
        return recipe.model_path(role)
    except RecipeError as e:
        raise ModelNotFoundError(f"the {role} model is not on this machine: {e}") from None


#: (resolved path, mtime_ns, size) -> tokenizers.Tokenizer: each tokenizer.json is parsed once per process.
_TOKENIZERS: dict[tuple[str, int, int], object] = {}
#: path -> seconds its one parse took (`tokenizer_load_seconds`).
_TOKENIZER_SECONDS: dict[str, float] = {}


class HeadConfigError(ValueError):
    """An MTP head whose config.json asks for an output hycoc does not compile. The message names the field and
    the fix, in one line."""


def head_output_config(config) -> dict:
    """How the MTP head turns its last state into logits, read from the ASSISTANT's config (never the verifier's).

    config: transformers' ``Gemma4AssistantConfig`` or its config.json as a dict. Fields, as transformers 5.24
    names them: ``use_ordered_embeddings``, ``num_centroids``, ``centroid_intermediate_top_k`` (top level;
    ``Gemma4AssistantMaskedEmbedder``: logits only for the tokens of the top-k centroids, the rest masked) and
    ``text_config.final_logit_softcapping``. ``Gemma4AssistantForCausalLM.forward`` applies no final-logit
    soft-cap whatever the text config says, so ``softcap_applied`` is always False (hycoc's head graph, server
    chains and transformers' MTP generator agree: tests/test_head_convention.py). Returns a JSON-ready dict of
    those fields (transformers' defaults where the file omits one) and ``softcap_applied``.
    """
    from transformers import Gemma4AssistantConfig

    if isinstance(config, dict):
        import copy

        config = Gemma4AssistantConfig.from_dict(copy.deepcopy(config))
    text = config.get_text_config()
    return {
        "use_ordered_embeddings": bool(config.use_ordered_embeddings),
        "num_centroids": int(config.num_centroids),
        "centroid_intermediate_top_k": int(config.centroid_intermediate_top_k),
        "final_logit_softcapping": getattr(text, "final_logit_softcapping", None),
        "softcap_applied": False,
    }


def check_head_config(config, where: str) -> dict:
    """`head_output_config`, refusing a head the device compiler cannot reproduce. Raises HeadConfigError when
    ``use_ordered_embeddings`` is true: the head graph scores the keep set with the dense output layer, which
    differs from the centroid-masked logits transformers computes whenever the best token lies outside the top
    ``centroid_intermediate_top_k`` centroids. ``where``: the config's path, for the message."""
    out = head_output_config(config)
    if out["use_ordered_embeddings"]:
        raise HeadConfigError(
            f"models.head: {where} sets use_ordered_embeddings = true (num_centroids {out['num_centroids']}, "
            f"centroid_intermediate_top_k {out['centroid_intermediate_top_k']}): hycoc compiles the head's dense "
            f"output layer over the keep set, not the centroid-masked one; use a head without ordered embeddings, "
            f"or set use_ordered_embeddings to false in that config.json to draft with the dense layer"
        )
    return out


def check_head_folder(path: str | Path) -> dict | None:
    """`check_head_config` of ``path``/config.json (``path`` a head folder or its config.json); None when there
    is no such file (the loader then names what is missing). Raises HeadConfigError, or ModelNotFoundError for
    a config.json that is not JSON."""
    import json

    p = Path(path)
    cfg = p / "config.json" if p.is_dir() else p
    if not cfg.is_file() or cfg.suffix != ".json":
        return None
    try:
        return check_head_config(json.loads(cfg.read_text()), str(cfg))
    except (OSError, json.JSONDecodeError) as e:
        raise ModelNotFoundError(f"head config {cfg} cannot be read: {e}") from None


def load_tokenizer(path: str | Path):
    """A `tokenizers.Tokenizer` from ``tokenizer.json`` (a file, or a folder holding one), parsed once per process
    and file version (keyed by path, mtime and size): a real Gemma 4 tokenizer.json (262,144 ids) takes 1-2 s and
    ~290 MiB to parse, and a build reads it from many passes. Callers share the object: do not change its
    truncation, padding or other settings (``hycoc.chat.encode_text`` sets and restores ``encode_special_tokens``).

    Raises ModelNotFoundError if there is none.
    """
    import time

    from tokenizers import Tokenizer

    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ModelNotFoundError(f"tokenizer not found at '{p}': point [models].tokenizer at a tokenizer.json")
    st = p.stat()
    key = (str(p.resolve()), st.st_mtime_ns, st.st_size)
    tok = _TOKENIZERS.get(key)
    if tok is None:
        t0 = time.perf_counter()
        tok = _TOKENIZERS[key] = Tokenizer.from_file(str(p))
        _TOKENIZER_SECONDS[key[0]] = _TOKENIZER_SECONDS.get(key[0], 0.0) + time.perf_counter() - t0
    return tok


def tokenizer_load_seconds() -> dict[str, float]:
    """{tokenizer.json path: seconds spent parsing it in this process} (what build and server start report)."""
    return dict(_TOKENIZER_SECONDS)


def quiet_transformers() -> None:
    """No per-tensor "Loading weights" progress bars: hycoc prints its own progress."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def set_threads(threads: int) -> None:
    """Set torch's CPU thread count when `threads` > 0 (recipe ``[verifier].threads``); 0 keeps torch's default."""
    if threads > 0:
        import torch

        torch.set_num_threads(threads)


def load_verifier(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """The verifier, a transformers ``Gemma4ForCausalLM`` in eval mode (sdpa attention)."""
    import torch
    from transformers import Gemma4ForCausalLM

    p = require_model_dir(path, "verifier")
    quiet_transformers()
    model = Gemma4ForCausalLM.from_pretrained(p, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval()


def load_head(path: str | Path, *, dtype: str = "float32", device: str = "cpu"):
    """The MTP head, a transformers ``Gemma4AssistantForCausalLM`` in eval mode."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    p = require_model_dir(path, "head")
    quiet_transformers()
    model = Gemma4AssistantForCausalLM.from_pretrained(p, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.to(device).eval()


def load_slm(path: str | Path, *, device: str = "cpu"):
    """The SLM, a pre-quantized ``Gemma4ForCausalLM`` read through transformers' Gemma quantizer.

    The checkpoint's ``quantization_config`` (quant_method "gemma") makes transformers replace every Linear with
    ``QuantizedLinear`` (packed int2/int4/int8 + per-channel scales) before loading the weights.
    """
    from transformers import Gemma4ForCausalLM

    p = require_model_dir(path, "slm")
    quiet_transformers()
    model = Gemma4ForCausalLM.from_pretrained(p, attn_implementation="sdpa")
    return model.to(device).eval()


def cut_at_stop(row: Sequence[int], stops: Collection[int]) -> list[int]:
    """``row`` up to and including its first id in ``stops`` (all of it when none is)."""
    out = []
    for token in row:
        out.append(token)
        if token in stops:
            break
    return out


def generate_answers(
    model, prompts: Sequence[Sequence[int]], max_new_tokens: int, *, pad: int, stops: Collection[int], **generate
) -> list[list[int]]:
    """One transformers ``generate`` call over ``prompts`` (non-empty token id lists), each right-aligned after
    ``pad`` ids under an attention mask (0 over the padding), on ``model.device``; ``generate``: the call's other
    arguments (``do_sample``, temperature, top_k, top_p, eos_token_id, streamer, ...). Returns each prompt's at most
    ``max_new_tokens`` new ids, cut after the first id in ``stops`` (`cut_at_stop`)."""
    import torch

    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + list(p) for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, pad_token_id=pad, **generate
        )
    return [cut_at_stop(row, stops) for row in out[:, width:].tolist()]
