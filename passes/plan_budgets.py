"""What a real-shape plan (`hycoc.passes.plan`) holds against limits: the verifier's KV per session and how many
sessions fit a GPU's memory (`verifier_kv`), and each drafter graph's weight bytes against the target's context limit
(`context_budget`, refused by `check_context_budget`)."""

from __future__ import annotations

import math

from hycoc.passes.plan_models import PlanError

from hycoc.recipe import Recipe

#: Context lengths of the verifier KV table (``verifier.kv_bytes_per_session``), positions.
KV_CONTEXTS = (2048, 8192, 32768)
#: The KV memory the table counts sessions in: 80 GB (10**9 B), an H100's / A100's memory.
KV_POOL_BYTES = 80 * 10**9


def verifier_kv(config, recipe: Recipe, tree_rows: int, window: int, head_sliding_window: int) -> dict:
    """The verifier's KV per session at `KV_CONTEXTS` positions: ``kv_bytes_per_session`` (what the engine holds,
    `hycoc.verifier.kv_cache.kv_bytes_per_session`, the server's reservation) beside ``full_length_bytes`` (every
    layer keeping every position), and how many sessions of each fit in `KV_POOL_BYTES`. Keys of the maps are the
    context lengths as strings (JSON)."""
    import torch
    from hycoc.verifier.kv_cache import DEFAULT_PREFILL_CHUNK, KVLayout, kv_bytes_per_session, retained_positions

    dtype_bytes = torch.finfo(getattr(torch, recipe.verifier.dtype)).bits // 8
    retain = retained_positions(config, window, head_sliding_window)
    layout = KVLayout.from_config(config, dtype_bytes, retain)
    after = {
        str(n): kv_bytes_per_session(
            config,
            n,
            tree_rows=tree_rows,
            handoff_window=window,
            dtype_bytes=dtype_bytes,
            head_sliding_window=head_sliding_window,
        )
        for n in KV_CONTEXTS
    }
    max_prefills = int(recipe.verifier.max_prefills)
    transient = {str(n): layout.prefill_transient_bytes(n, DEFAULT_PREFILL_CHUNK) for n in KV_CONTEXTS}
    prefill_pool = {n: max_prefills * b for n, b in transient.items()}
    before = {str(n): layout.bytes_per_position * n for n in KV_CONTEXTS}
    return {
        "kv_dtype": recipe.verifier.dtype,
        "kv_bytes_per_position_full": layout.full_bytes,
        "kv_bytes_per_position_sliding": layout.sliding_bytes,
        "kv_bytes_per_position_full_length": layout.bytes_per_position,
        "sliding_window": int(config.sliding_window),
        "sliding_retained_positions": retain,
        "tree_rows": tree_rows,
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "kv_bytes_per_session": after,
        "prefill_transient_bytes": transient,
        "max_prefills": max_prefills,
        "prefill_pool_bytes": prefill_pool,
        "snapshot_bytes": {str(n): layout.snapshot_bytes(n) for n in KV_CONTEXTS},
        "full_length_bytes": before,
        "pool_bytes": KV_POOL_BYTES,
        "sessions_per_pool": {
            n: {
                "full_length": KV_POOL_BYTES // before[n],
                "windowed": (KV_POOL_BYTES - prefill_pool[n]) // after[n],
            }
            for n in after
        },
        "note": "per session: full layers every position, sliding layers their retained window + one round's "
        "rows; once per prefilling session (max_prefills, the prefill pool): a chunk's rows and an APPEND's undo "
        "copy of the sliding layers; an APPEND also reserves its full layers' undo copy while it runs; a "
        "conversation snapshot only from spare room, given up when a session needs it (hycoc.verifier.kv_cache); "
        "KV only (weights, activations and the allocator's slack are not counted)",
    }


def context_budget(graph_bytes: dict[str, int], recipe: Recipe) -> dict:
    """Each drafter graph's planned weight bytes against the recipe target's context limit (the profile's
    ``max_context_bytes``, lowered by ``target.context_size_limit_mb``), before anything is compiled.

    Returns {"profile", "limit_bytes", "graphs": {name: {"bytes", "fits", "shards_needed"}}}: ``shards_needed`` is
    how many layer shards (one context binary each, one EP context group) the graph needs at that limit. The
    compile itself refuses a context over the limit before compiling (`hycoc.targets.htp.compile_shared`,
    ContextTooLargeError naming the bytes)."""
    from hycoc.targets.profiles import UnknownTargetError, profile_for

    t = recipe.target
    try:
        profile = profile_for(int(t.htp_arch), str(t.soc_model), int(t.context_size_limit_mb))
    except UnknownTargetError as e:
        return {"profile": None, "limit_bytes": None, "error": str(e), "graphs": {}}
    limit = profile.max_context_bytes
    graphs = {
        name: {
            "bytes": int(n),
            "fits": limit is None or n <= limit,
            "shards_needed": 1 if limit is None else max(1, math.ceil(n / limit)),
        }
        for name, n in graph_bytes.items()
    }
    return {
        "profile": profile.name,
        "soc_model": profile.soc_model,
        "description": profile.description,
        "limit_bytes": limit,
        "graphs": graphs,
    }


def check_context_budget(budget: dict, recipe: Recipe) -> None:
    """Refuse a plan whose graphs do not fit the target's context limit as the recipe would build them
    (`context_budget`'s answer): the head always, the SLM unless ``[target] slm_shards`` splits it into at least
    the shards it needs ("auto" always does). Raises PlanError naming each graph's bytes, the limit and the fix."""
    if budget.get("error"):
        raise PlanError(budget["error"])
    shards = recipe.target.slm_shards
    over = []
    for name, g in budget["graphs"].items():
        if g["fits"] or (name == "slm" and (shards == "auto" or shards >= g["shards_needed"])):
            continue
        fix = (
            f'[target] slm_shards = "auto" ({g["shards_needed"]} shards)'
            if name == "slm"
            else "a smaller head (weight bits, layers)"
        )
        over.append(f"{name} {g['bytes']:,} bytes ({fix})")
    if over:
        raise PlanError(
            f"over {budget['profile']}'s context limit of {budget['limit_bytes']:,} bytes "
            f"({budget['description']}): {'; '.join(over)}"
        )
