"""Measuring a verifier cost model: ms of every kind of forward the server runs, per (rows, context), on the device
the model is on (docs/benchmarks.md "Benchmark": g projected; `hycoc.bench.cost_model.model` holds the model, its kinds
and its replay).

Used by ``benchmarks/verifier_cost_model.py`` (the 26B-A4B shape on a GPU, or a recipe's verifier) and by
``hycoc bench`` (the recipe's verifier on the device in use, when no cost-model file is given). What is timed is the
engine's own code over a random KV cache of ``context`` positions: `hycoc.verifier.engine.verify_tree` (Alg. 4
lines 1-3; kind ``verify``), one step of `hycoc.verifier.baselines.draft_cloud_chain` (the server-side head: forward,
arg-max, next embedding; kind ``head_step``) and one chunk of `hycoc.verifier.forward.prefill` (kind ``prefill``);
see the script's docstring for the method. `count_forwards` watches a live engine and lists the forwards it ran,
in the cost model's terms, so tests can hold `hycoc.bench.cost_model.model.round_forwards` against the engine.
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from hycoc.bench.cost_model.model import CostModel, CostPoint, sample_quantile


def demo_parents(rows: int, chain_length: int = 4):
    """Parent rows of an R-row tree: root, a chain of min(K, R - 1), the other rows as siblings hung on the root
    and the chain rows in turn (each row's parent is an earlier row). int64 (R,)."""

    parents = np.full(rows, -1, dtype=np.int64)
    chain = min(chain_length, rows - 1)
    for j in range(1, chain + 1):
        parents[j] = j - 1
    for j in range(chain + 1, rows):
        parents[j] = (j - chain - 1) % (chain + 1) if chain else 0
    return parents


def build_random_verifier(config_dict: dict, device: str, dtype: str):
    """transformers ``Gemma4ForCausalLM`` of ``config_dict`` with random weights (the model's own initializer),
    created directly on ``device`` in ``dtype`` (no float32 copy: 26B-A4B in float32 would not fit beside its
    bf16 copy), sdpa attention, eval mode."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig.from_dict(dict(config_dict))
    torch.manual_seed(0)
    with torch.device(device):
        model = Gemma4ForCausalLM._from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return model.eval()


def build_random_head(head_config_dict: dict, backbone_hidden_size: int, device: str, dtype: str):
    """transformers ``Gemma4AssistantForCausalLM`` of ``head_config_dict`` (e.g. `hycoc.passes.plan.HEAD_ASSUMED`,
    ASSUMED until the assistant's config.json is given) reading a verifier of hidden size ``backbone_hidden_size``,
    random weights, created directly on ``device`` in ``dtype``, sdpa attention, eval mode."""
    import copy

    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    d = copy.deepcopy(head_config_dict)
    d["backbone_hidden_size"] = int(backbone_hidden_size)
    config = Gemma4AssistantConfig.from_dict(d)
    torch.manual_seed(1)
    with torch.device(device):
        head = Gemma4AssistantForCausalLM._from_config(config, dtype=getattr(torch, dtype), attn_implementation="sdpa")
    return head.eval()


def measuring_engine(
    model, head=None, *, head_window: int, chain_length: int = 4, head_query_position_offset: int = -1, device="cpu"
):
    """A `hycoc.verifier.engine.VerifierEngine` around ``model`` and ``head`` for measuring them: its
    ``new_cache`` is the session cache the server gives every session (sliding layers keep
    `hycoc.verifier.kv_cache.retained_positions` positions: max(sliding_window - 1, W, the head's window + 1),
    full layers the context). The hand-off scales are placeholders (1.0): no timed forward reads them."""
    from hycoc.verifier.engine import VerifierEngine

    return VerifierEngine(
        model,
        head=head,
        head_window=head_window,
        chain_length=chain_length,
        handoff_scales=(1.0,) * 6,
        head_query_position_offset=head_query_position_offset,
        device=device,
    )


def random_cache(model, context: int, device, new_cache=None):
    """A cache holding ``context`` random positions, as a session's would after ``context`` committed tokens.

    new_cache: a no-argument callable giving an empty session cache (a `measuring_engine`'s ``new_cache``, the
    server's layout: a sliding layer holds only its last ``retain`` positions, `hycoc.verifier.kv_cache`); None: a
    ``DynamicCache`` without config, every layer keeping all positions (sliding layers then cost an upper bound).
    One 1-token forward creates the layers; their keys and values are then replaced by standard-normal
    (1, kv_heads, held, head_dim) tensors in the model's dtype, held = ``context`` (a sliding layer: min(context,
    retain), starting at position context - held). ``cache.get_seq_length()`` is ``context`` either way."""
    import torch
    from transformers import DynamicCache

    from hycoc.verifier.kv_cache import SlidingWindowLayer

    cache = new_cache() if new_cache is not None else DynamicCache()
    with torch.inference_mode():
        model(
            input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        gen = torch.Generator(device=device).manual_seed(context)
        for layer in cache.layers:
            if not (layer.is_initialized and layer.keys.numel()):
                continue  # KV-shared layers store nothing
            b, h, _, d = layer.keys.shape
            held = min(context, layer.retain) if isinstance(layer, SlidingWindowLayer) else context
            layer.keys = torch.randn(b, h, held, d, generator=gen, device=device, dtype=layer.keys.dtype)
            layer.values = torch.randn(b, h, held, d, generator=gen, device=device, dtype=layer.values.dtype)
            if isinstance(layer, SlidingWindowLayer):
                layer.start = context - held
                layer.cumulative_length = context
    return cache


def snapshot_cache(cache) -> list:
    """The state of every layer of ``cache`` (its keys and values tensors, and a sliding layer's ``start`` and
    ``cumulative_length``), for `restore_cache`. The tensors are kept by reference: a forward replaces a layer's
    tensors (``torch.cat``, slices) and does not write into them, so the snapshot stays valid."""
    return [
        (layer, layer.keys, layer.values, getattr(layer, "start", None), getattr(layer, "cumulative_length", None))
        for layer in cache.layers
        if getattr(layer, "is_initialized", False)
    ]


def restore_cache(snapshot: list) -> None:
    """Put every layer back as `snapshot_cache` saw it: undoes a timed forward, a prefill chunk included (after
    one, a sliding layer has trimmed to its window past the old positions, so cropping could not restore it)."""
    for layer, keys, values, start, cumulative in snapshot:
        layer.keys, layer.values = keys, values
        if start is not None:
            layer.start = start
        if cumulative is not None:
            layer.cumulative_length = cumulative


def measure_grid(
    model,
    rows_list,
    contexts,
    *,
    warmup: int,
    repeats: int,
    device,
    chain_length: int = 4,
    log=print,
    head=None,
    prefill_rows=(),
    head_position_offset: int = -1,
    clock: str = "busy",
    wall_log: dict | None = None,
    statistic: str = "median",
    new_cache=None,
) -> list[CostPoint]:
    """Median ms of every forward kind for every (rows, context) of the grid (module docstring). Returns CostPoints:
    ``verify`` at every rows_list x contexts, ``head_step`` (rows 1) at every context when ``head`` (the verifier's
    MTP head, on the same device) is given, ``prefill`` at every prefill_rows x contexts.

    The passes are interleaved: every repetition visits every grid point once (one random cache per context, all
    alive together), so a machine whose load drifts during the run spreads that drift over the whole grid instead
    of biasing the points measured last. log(kind, rows, context, median_ms, times) is called per point at the end.

    Clock: on a GPU, CUDA events (`hycoc.verifier.forward.Timer`). On a CPU, the busy time of the forward: the CPU
    time of this process while it ran (``time.process_time``: every thread of the process, so torch's intra-op
    threads count; nothing else runs in the process meanwhile), which other processes on the machine do not
    stretch the way they stretch wall time; the wall times are kept beside it (``wall_ms`` of the log callback's
    ``times`` when ``clock`` is "wall"). Each point's ``samples_ms`` keeps its repetitions, ``ms`` their
    ``statistic`` ("median", or "pNN": that percentile, `hycoc.bench.cost_model.model.sample_quantile`).
    clock: "busy" (default; on a GPU it means the CUDA events) or "wall". wall_log: a dict that gets
    "kind/rows/context" -> median wall ms of every point. new_cache: the session cache's factory (`random_cache`;
    a `measuring_engine`'s ``new_cache`` measures the layout the server runs), None: full-length caches.
    """
    import torch

    from hycoc.verifier.baselines import draft_cloud_chain
    from hycoc.verifier.engine import producer_layers, verify_tree
    from hycoc.verifier.forward import NormTap, Timer, prefill
    from hycoc.verifier.kv_cache import ChainStart

    dev = torch.device(device)
    vocab = model.config.vocab_size
    rng = np.random.default_rng(0)
    grid = [("verify", rows, t) for t in contexts for rows in rows_list]
    if head is not None:
        grid += [("head_step", 1, t) for t in contexts]
    grid += [("prefill", n, t) for t in contexts for n in prefill_rows]
    parents = {rows: demo_parents(rows, chain_length) for rows in rows_list}
    times: dict[tuple[str, int, int], list[float]] = {key: [] for key in grid}
    walls: dict[tuple[str, int, int], list[float]] = {key: [] for key in grid}
    busy = clock == "busy" and dev.type != "cuda"
    layers = producer_layers(model.config) if head is not None else {}  # read by head steps only
    h = torch.zeros(model.config.hidden_size, device=dev, dtype=model.dtype)  # h_{t-1}: its values cost nothing
    tap = NormTap(model)
    caches = {}
    try:
        caches = {t: random_cache(model, t, dev, new_cache) for t in contexts}
        saved = {t: snapshot_cache(c) for t, c in caches.items()}
        for i in range(warmup + repeats):
            for kind, rows, t in grid:
                tokens = torch.as_tensor(rng.integers(0, vocab, rows), device=dev)
                cpu0 = time.process_time()
                with Timer(dev) as timer:
                    if kind == "verify":
                        verify_tree(model, caches[t], tap, tokens, parents[rows], t, model.dtype)
                    elif kind == "head_step":  # one step of the Cloud+MTP chain, as the engine runs it
                        start = ChainStart(caches[t], layers, int(tokens[0]), h, t)
                        draft_cloud_chain(model, head, start, 1, head_position_offset)
                    else:
                        prefill(model, caches[t], tap, tokens, rows, model.dtype, start=t)
                cpu_ms = (time.process_time() - cpu0) * 1e3
                restore_cache(saved[t])  # every point starts from the same t positions
                if i >= warmup:
                    times[(kind, rows, t)].append(cpu_ms if busy else timer.ms)
                    walls[(kind, rows, t)].append(timer.ms)
    finally:
        tap.remove()
        caches.clear()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    points = []
    for kind, rows, t in grid:
        ms = float(np.percentile(times[(kind, rows, t)], sample_quantile(statistic)))
        log(kind, rows, t, ms, times[(kind, rows, t)])
        points.append(
            CostPoint(
                kind=kind,
                rows=rows,
                context=t,
                ms=max(ms, 1e-6),
                samples_ms=[round(x, 4) for x in times[(kind, rows, t)]],
            )
        )
    if wall_log is not None:
        wall_log.update({f"{k}/{r}/{c}": statistics.median(v) for (k, r, c), v in walls.items()})
    return points


def count_forwards(engine):
    """Watch ``engine`` (`hycoc.verifier.engine.VerifierEngine`): a context manager yielding a list that gets one
    `hycoc.bench.cost_model.model.Forward` per forward of the verifier or its head, in the cost model's terms:
    ``verify`` (a verifier forward whose logits cover every row), ``prefill`` (a verifier forward that keeps the
    last row's logits only, `hycoc.verifier.forward.prefill`), ``head_step`` (a head forward of one query row;
    context = the shared KV positions it reads). rows and context are read from the call's own arguments
    (``input_ids`` / ``inputs_embeds`` width, ``position_ids``, the shared KV length), so the list is what the
    engine did, not what the cost model expects. Forward pre-hooks (`torch.nn.Module.register_forward_pre_hook`);
    removed on exit."""
    import contextlib

    from hycoc.bench.cost_model.model import Forward

    @contextlib.contextmanager
    def watch():
        seen: list[Forward] = []

        def on_verifier(module, args, kwargs):
            ids = kwargs["input_ids"]
            rows = int(ids.shape[-1])
            if kwargs.get("logits_to_keep") == 1:
                seen.append(Forward("prefill", rows, int(kwargs["position_ids"].min())))
            else:
                cache = kwargs["cache"]
                seen.append(Forward("verify", rows, int(cache.get_seq_length())))

        def on_head(module, args, kwargs):
            x = kwargs["inputs_embeds"]
            shared = kwargs["shared_kv_states"]
            context = max(int(k.shape[-2]) for k, _ in shared.values())
            seen.append(Forward("head_step", int(x.shape[1]), context))

        handles = [engine.model.register_forward_pre_hook(on_verifier, with_kwargs=True)]
        if engine.head is not None:
            # the head's inner text model: both the Cloud+MTP call (the head's own forward) and `head_step` reach it
            handles.append(engine.head.model.register_forward_pre_hook(on_head, with_kwargs=True))
        try:
            yield seen
        finally:
            for handle in handles:
                handle.remove()

    return watch()


#: The keys of a Gemma 4 text config whose numbers set a forward's cost (`shape_of`), in the order a cost model's
#: ``shape`` lists them.
SHAPE_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "global_head_dim",
    "num_global_key_value_heads",
    "sliding_window",
    "enable_moe_block",
    "num_experts",
    "top_k_experts",
    "moe_intermediate_size",
    "vocab_size",
    "num_kv_shared_layers",
)


def shape_of(config) -> dict:
    """The numbers of a Gemma 4 text config that set a forward's cost: its `SHAPE_KEYS` that are set, the count of
    full-attention layers and, when the config has one, its ``per_layer_config``."""
    d = config.to_dict()  # plain values (per-layer attributes cannot be read from a heterogeneous config)
    out = {k: d[k] for k in SHAPE_KEYS if d.get(k) is not None}
    out["full_attention_layers"] = sum(lt == "full_attention" for lt in d["layer_types"])
    if d.get("per_layer_config"):
        out["per_layer_config"] = d["per_layer_config"]
    return out


#: Prefill chunk widths a cost model measures by default: 1, a short prompt, the engine's whole chunk.
PREFILL_ROWS = (1, 64, 512)


#: Interleaved repetitions per point of the cost model `hycoc bench` measures: enough that two measurements on
#: one machine give projected Δg within 2 points of each other (benchmarks/cost_model_stability.py measures it).
BENCH_REPEATS = 15
#: The statistic of a busy-time (CPU) point: its 25th percentile. Interference from other processes only adds
#: CPU time (cache and core sharing), so the low quantiles are the least disturbed estimate (Chen & Revels 2016,
#: "Robust benchmarking in noisy environments", argue for the minimum; p25 keeps one outlier from setting it).
#: Measured on the 2-core machine at loads 6 and 12: median moved projected Δg by 8.5 points, p25 by 5.
BUSY_STATISTIC = "p25"


def measure_recipe_verifier(
    recipe,
    rows_list=(1, 5, 33),
    contexts=(64, 128, 256, 512),
    *,
    warmup: int = 2,
    repeats: int = BENCH_REPEATS,
    threads: int | None = None,
    prefill_rows=PREFILL_ROWS,
    device: str | None = None,
    clock: str = "busy",
) -> CostModel:
    """A cost model of ``recipe``'s verifier and MTP head (real weights, its [verifier] dtype; ``device``, default
    its [verifier] device) on this machine: every kind of forward (`measure_grid`; ``clock`` "busy": CPU time of
    the forward on a CPU, its `BUSY_STATISTIC` kept; else the median), over the caches the server's engine makes
    (`measuring_engine`: sliding layers windowed as in every session). meta: clock, statistic, warmup, repeats,
    wall_ms (median wall ms per "kind/rows/context"), the load average before and after, the date."""
    import torch

    from hycoc.models import load_head, load_verifier, set_threads

    device = device or recipe.verifier.device
    set_threads(threads or recipe.verifier.threads)
    model = load_verifier(recipe.model_path("verifier"), dtype=recipe.verifier.dtype, device=device)
    head = load_head(recipe.model_path("head"), dtype=recipe.verifier.dtype, device=device)
    engine = measuring_engine(
        model,
        head,
        head_window=recipe.window.head_window,
        chain_length=recipe.tree.chain_length,
        head_query_position_offset=recipe.window.head_query_position_offset,
        device=device,
    )
    wall: dict = {}
    statistic = BUSY_STATISTIC if clock == "busy" and device == "cpu" else "median"
    load0 = _loadavg()
    t0 = time.perf_counter()
    points = measure_grid(
        model,
        list(rows_list),
        list(contexts),
        warmup=warmup,
        repeats=repeats,
        device=device,
        chain_length=recipe.tree.chain_length,
        log=lambda *a: None,
        head=head,
        prefill_rows=prefill_rows,
        head_position_offset=recipe.window.head_query_position_offset,
        clock=clock,
        wall_log=wall,
        statistic=statistic,
        new_cache=engine.new_cache,
    )
    name = f"{device} ({torch.get_num_threads()} threads)" if device == "cpu" else torch.cuda.get_device_name(0)
    meta = {
        "clock": (
            "CPU time of the forward (process_time)"
            if clock == "busy" and device == "cpu"
            else "wall (CUDA events on a GPU)"
        ),
        "statistic": statistic,
        "warmup": warmup,
        "repeats": repeats,
        "seconds": round(time.perf_counter() - t0, 1),
        "loadavg_before": load0,
        "loadavg_after": _loadavg(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "wall_ms": wall,
        "kv_cache": f"the server's session cache: sliding layers keep {engine.kv_retain} "
        "positions + the forward's rows, full layers the context",
    }
    return CostModel(
        device=name,
        dtype=recipe.verifier.dtype,
        model=str(recipe.models.verifier),
        shape=shape_of(model.config),
        points=points,
        source="measured",
        meta=meta,
    )


def _loadavg() -> str | None:
    """/proc/loadavg's 1, 5 and 15 minute load averages, or None where there is none."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return None
