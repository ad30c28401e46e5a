"""Build the verifier engine and its server settings from a recipe (docs/design.md "Programs"; docs/serving.md).

Everything the engine takes comes from one place in the recipe:

    model, dtype              [models].verifier, [verifier].dtype       (hycoc.models.load_verifier)
    MTP head                  [models].head                             (cloud-mtp and server-head baselines, Table 5)
    stop ids, chat format     [models].verifier generation_config.json eos_token_id, [models].tokenizer's chat
                              template (hycoc.chat_template.chat_from_recipe, as `hycoc generate`): the engine
                              stops on them and the server checks each OPEN's chat contract against them
    W                         [window].head_window                      (hand-off window, server head's window)
    K                         [tree].chain_length                       (server-side chains)
    hand-off scales, h        [handoff].scale_*, [handoff].hidden       (Alg. 4 line 14)
    head query position       [window].head_query_position_offset       (Alg. 2 line 6)
    head's sliding positions  [window].head_sliding_window_inclusive    (server-head; hycoc.host.head_sliding_positions)
    max context               [verifier].max_context (0 = the model's own max_position_embeddings)
    device                    [verifier].device unless overridden

Sampling is per session (each OPEN carries temperature, top-k, top-p, seed); the recipe's ``[sampling]`` are the
device's defaults, not the server's. The keep set of ``server-head`` sessions is made by the compiler (the `keep_set`
pass, docs/design.md "The pass pipeline") and is not built yet: engines come without one unless the caller passes it,
and the server then answers ``server-head`` OPENs with the ``no_keep_set`` error.
"""

from __future__ import annotations

from hycoc.chat_template import chat_from_recipe
from hycoc.keep_set import load_keep_set  # the one reader of --keep-set files (torch-free; re-exported here)
from hycoc.models import load_head, load_verifier, model_dir
from hycoc.recipe import Recipe
from hycoc.serving_limits import BATCHING_MODES, server_modes

from .engine import VerifierEngine


class DeviceUnavailable(RuntimeError):
    """The recipe or the command line asks for a torch device this machine does not have."""


def check_device(device: str) -> None:
    """Raise DeviceUnavailable when ``device`` is "cuda" and torch sees no CUDA device."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceUnavailable(
            "device 'cuda' requested, but torch sees no CUDA device on this machine "
            f'(torch {torch.__version__}); use --device cpu or set [verifier].device = "cpu"'
        )


def engine_from_recipe(recipe: Recipe, device: str | None = None, *, keep_set=None) -> VerifierEngine:
    """The verifier engine a recipe describes, with its MTP head loaded (see the module docstring for the keys).

    device: "cpu" or "cuda" (None: the recipe's ``[verifier].device``). keep_set: int token ids the server head may
    propose (None: no keep set yet; ``server-head`` sessions are then refused by the server).

    Raises ModelNotFoundError (verifier, head or tokenizer missing; the message names it and how to provide it),
    ChatFormatError (no chat template, no stop ids: raised before any model is loaded), RecipeError (a
    ``[handoff].scale_*`` not set), DeviceUnavailable (cuda without CUDA).
    """
    device = device or recipe.verifier.device
    check_device(device)
    scales = recipe.handoff.scales()  # raises RecipeError naming every unset scale
    verifier_dir, head_dir = model_dir(recipe, "verifier"), model_dir(recipe, "head")
    chat = chat_from_recipe(recipe)  # before any weights: a bad tokenizer folder fails fast

    dtype = recipe.verifier.dtype
    model = load_verifier(verifier_dir, dtype=dtype, device=device)
    head = load_head(head_dir, dtype=dtype, device=device)
    return VerifierEngine(
        model,
        head=head,
        keep_set=keep_set,
        head_window=recipe.window.head_window,
        chain_length=recipe.tree.chain_length,
        handoff_scales=tuple(scales[k] for k in ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full")),
        hidden=recipe.handoff.hidden,
        head_query_position_offset=recipe.window.head_query_position_offset,
        head_sliding_window_inclusive=recipe.window.head_sliding_window_inclusive,
        eos_token_ids=chat.stop_ids,
        chat_format=chat.format,
        max_context=recipe.verifier.max_context or None,
        device=device,
    )


def check_batching(mode: str) -> str:
    """``mode`` if it is one of `BATCHING_MODES` (`hycoc.serving_limits.BATCHING_MODES`, the one list), else
    ValueError naming ``--batching`` and the allowed values."""
    if mode not in BATCHING_MODES:
        raise ValueError(f"--batching {mode!r}: allowed: {', '.join(BATCHING_MODES)}")
    return mode


def check_keep_set_vocab(ids, vocab_size: int, path) -> None:
    """ValueError naming ``--keep-set PATH`` when a token id of ``ids`` lies outside a vocabulary of
    ``vocab_size`` (a keep set built for another tokenizer)."""
    top = int(max(ids))
    if top >= vocab_size:
        raise ValueError(
            f"--keep-set {path}: token id {top} is outside the verifier's vocabulary of {vocab_size}: "
            "was the keep set built for another tokenizer?"
        )


def verifier_vocab_size(recipe: Recipe) -> int:
    """The verifier's vocabulary size from its checkpoint's config.json, read without loading weights
    (transformers ``AutoConfig``; a multimodal checkpoint's text config, as the engine's model has). Raises
    ModelNotFoundError for a missing folder."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir(recipe, "verifier")))
    return int(config.get_text_config().vocab_size)


def check_keep_set(path, recipe: Recipe):
    """The keep set at ``path`` (`load_keep_set`) with its ids checked against the verifier's vocabulary
    (`check_keep_set_vocab`, `verifier_vocab_size`), before any model loads or port binds. Returns the ids.
    Raises ValueError naming ``--keep-set PATH`` and the fix, ModelNotFoundError."""
    ids = load_keep_set(path)
    check_keep_set_vocab(ids, verifier_vocab_size(recipe), path)
    return ids


def check_recipe_models(recipe: Recipe) -> None:
    """What a server loads, checked before any weights: the verifier, head and tokenizer folders
    (`hycoc.models.model_dir`) and the checkpoint's chat template and stop ids (`chat_from_recipe`). Raises
    ModelNotFoundError or ChatFormatError, each naming the folder or file and the fix."""
    for role in ("verifier", "head", "tokenizer"):
        model_dir(recipe, role)
    chat_from_recipe(recipe)


def server_options(
    recipe: Recipe,
    *,
    batching: str | None = None,
    max_batch_rows: int | None = None,
    max_batch_wait_ms: float | None = None,
    tree_budget: str | None = None,
    allowance: str | None = None,
) -> dict:
    """Keyword arguments of `hycoc.verifier.server.serve` / `VerifierServer` that come from the recipe:
    ``tree_rows`` = B + 1 ([tree].node_budget + 1; the device pads smaller trees to it), ``max_frame_bytes``
    ([verifier].max_frame_bytes), ``model_name`` ([models].verifier as written), ``limits`` (the server limits
    of [verifier], `hycoc.verifier.server.ServerLimits`), the batching keys ``batching``, ``max_batch_rows``,
    ``max_batch_wait_ms``, ``max_prefills`` and the row budget's ``tree_budget``, ``row_cost`` (`row_cost_of`),
    ``min_rows_per_session`` and the tree allowance's ``allowance``, ``allowance_target_ms``, ``allowance_floor``
    ([verifier] keys of the same names). The keyword arguments, when not None, replace them (the command-line
    options of the same names). Serial verification has no shared forward for a budget or an allowance to act on:
    the recipe's tree_budget and allowance then become "fixed", and "auto" asked with it is a ValueError
    (`hycoc.serving_limits.server_modes`, which ``hycoc verify-server`` runs before importing torch). Raises
    ValueError for a bad --batching / --tree-budget / --allowance, RecipeError for a bad verifier.row_cost."""
    options = _recipe_server_options(recipe)
    options |= server_modes(
        (options["batching"], options["tree_budget"], options["allowance"]),
        batching=batching,
        tree_budget=tree_budget,
        allowance=allowance,
    )
    for key, value in (("max_batch_rows", max_batch_rows), ("max_batch_wait_ms", max_batch_wait_ms)):
        if value is not None:
            options[key] = value
    return options


def _recipe_server_options(recipe: Recipe) -> dict:
    from hycoc.verifier.server import ServerLimits

    return {
        "tree_rows": recipe.tree.node_budget + 1,
        "max_frame_bytes": recipe.verifier.max_frame_bytes,
        "model_name": recipe.models.verifier,
        "limits": ServerLimits.from_recipe(recipe.verifier),
        "batching": recipe.verifier.batching,
        "max_batch_rows": recipe.verifier.max_batch_rows,
        "max_batch_wait_ms": recipe.verifier.max_batch_wait_ms,
        "max_prefills": recipe.verifier.max_prefills,
        "tree_budget": recipe.verifier.tree_budget,
        "row_cost": row_cost_of(recipe),
        "min_rows_per_session": recipe.verifier.min_rows_per_session,
        "allowance": recipe.verifier.allowance,
        "allowance_target_ms": recipe.verifier.allowance_target_ms or None,
        "allowance_floor": recipe.verifier.allowance_floor,
    }


def row_cost_of(recipe: Recipe):
    """[verifier].row_cost as a `hycoc.verifier.row_budget.RowCost`, or None when empty (the server measures it).
    Raises RecipeError naming the key when its points cannot make a cost line."""
    from hycoc.verifier.row_budget import RowCost, RowCostError

    from hycoc.recipe import Problem, RecipeError

    points = recipe.verifier.row_cost
    if not points:
        return None
    try:
        return RowCost(tuple((int(r), float(ms)) for r, ms in points), source="recipe verifier.row_cost")
    except RowCostError as e:
        raise RecipeError([Problem("verifier.row_cost", None, f"verifier.row_cost: {e}")]) from None
