"""Measure a verifier cost model: ms of every forward the server runs per (rows, context) (docs/benchmarks.md
"Benchmark": g projected): the tree verification (kind ``verify``), one step of the server-side MTP head (``head_step``)
and one prefill chunk (``prefill``); see `hycoc.bench.cost_model.model` for the kinds.

    python benchmarks/verifier_cost_model.py --device cuda --out runs/cost-h200.json
    python benchmarks/verifier_cost_model.py --device cpu --recipe recipes/toy.toml --out runs/cost-toy-cpu.json

``--device cuda`` without ``--recipe``: the Gemma 4 26B-A4B verifier shape (`hycoc.passes.plan.VERIFIER_26B_A4B`,
docs/design.md "Reference shapes": 30 layers, hidden 2816, MoE 128 experts top-8, vocab 262,144; 25.2e9 parameters,
50.5 GB in bf16) built by transformers' ``Gemma4ForCausalLM`` with RANDOM weights in ``--dtype`` (bfloat16) on one
GPU. Random weights change no shape and no kernel, so the timing is the real model's -- except MoE routing: a
random router spreads tokens nearly uniformly, so 33 rows x top-8 touch about 112 of the 128 experts per layer
(128 (1 - (127/128)^264)); trained routing is likely more concentrated, so on a weight-bandwidth-bound GPU the
multi-row points are, if anything, an upper bound (not measured against real weights).
``--recipe`` loads the recipe's verifier with its real weights instead (`hycoc.models.load_verifier`); that is the
``--device cpu`` mode for the toy. Without CUDA, ``--device cuda`` prints one line saying why and exits 0.

For every context t in ``--contexts`` the KV cache is filled with random keys and values of the right shape (one
real 1-token forward creates every layer's cache entry, then each layer's keys/values are replaced by
(1, kv_heads, t, head_dim) standard-normal tensors -- the scale of k_norm/v_norm outputs), which costs nothing next
to a real prefill of t tokens. Then, for every rows value R in ``--rows``, the engine's own
`hycoc.verifier.engine.verify_tree` runs one forward over a tree of R rows (root, a chain of up to K = 4, the rest
as siblings; the cost does not depend on the tree's shape, only on R and t), with the engine's explicit 4-D masks,
and `crop_cache` takes the R rows back off. With the MTP head (``--recipe``: its real head; random mode: the ASSUMED
head shape `hycoc.passes.plan.HEAD_ASSUMED`, random weights): one step of `hycoc.verifier.baselines.draft_cloud_chain`
reading the t cached positions (the Cloud+MTP head step; server-head steps read min(W, t) and are replayed through
the same points). For every n in ``--prefill-rows``: one `hycoc.verifier.forward.prefill` chunk of n positions after
the t cached ones (logits of the last row only). Timing: CUDA events on a GPU (synchronized); on the CPU the busy time
of the forward (process CPU time; ``--clock wall``: perf_counter, `hycoc.verifier.forward.Timer`, the clock the
server's server_ms uses); ``--warmup`` untimed passes, then the
median of ``--repeats`` timed passes, each pass visiting every grid point once (interleaved, so load drift on a busy
machine spreads over the whole grid). What is timed is Alg. 4 lines 1-3 (mask build, forward, logits of all R
rows); sampling, acceptance, compaction and the hand-off are not (see `hycoc.bench.cost_model.model`).

``--batch-sessions 1,4,16,64`` also measures the BATCHED line (`hycoc.bench.cost_model.batch_line`): one batched forward
of n sessions (the server's `hycoc.verifier.batch.batch_forward`) whose rows add up to R, for every R in
``--batch-rows`` (default 1..512) with R >= n, each session at ``--batch-context`` cached positions; the file's
``batch_points`` are what `hycoc capacity recipes/gemma4.toml --cost-model FILE` projects with (the MoE experts a batch
touches measured, not modelled). With random weights the router spreads rows nearly uniformly over the experts (as
above).

Writes the cost model JSON atomically (`hycoc.bench.cost_model.model.CostModel.save`) and prints a table per kind, then
the per-round server ms it projects at each context beside the paper's (§3.1, one RTX PRO 6000): a HyCo round (one
33-row verification; paper 21.7 ms) and a Cloud+MTP round (K head steps, then a (K + 1)-row verification; paper
26.8 ms).
Exit codes: 0 done or skipped (no CUDA), 1 bad input (recipe, model missing, out of memory), 2 usage error.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from hycoc.bench.cost_model.measure import (
    PREFILL_ROWS,
    build_random_head,
    build_random_verifier,
    measure_grid,
    measuring_engine,
    shape_of,
)
from hycoc.bench.cost_model.model import (  # numpy + pydantic only
    PAPER_ROUND_MS,
    CostModel,
    CostModelError,
    round_forwards,
)

REPO = Path(__file__).resolve().parents[1]

DEFAULTS = {
    "cuda": dict(contexts="1024,4096,16384", dtype="bfloat16"),
    "cpu": dict(contexts="32,64,128,256", dtype=None),
}


def _ints(text: str, name: str, minimum: int) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SystemExit(_usage(f"{name} {text!r}: give comma-separated integers, e.g. 1,5,33")) from None
    if not vals or vals[0] < minimum:
        raise SystemExit(_usage(f"{name} {text!r}: need at least one value, each >= {minimum}"))
    return vals


def _usage(msg: str) -> int:
    print(f"verifier_cost_model: {msg}", file=sys.stderr)
    return 2


def round_table(cm: CostModel, chain_length: int = 4):
    """A rich Table of the per-round server ms ``cm`` projects at each of its contexts
    (`hycoc.bench.cost_model.model.round_forwards`): a HyCo round (the largest measured rows, B + 1 = 33 by default) and
    a Cloud+MTP round (``chain_length`` head steps + a (K + 1)-row verification), beside the paper's 21.7 / 26.8 ms
    (§3.1). Rounds the model cannot replay (rows outside its grid, no head points) show their error."""
    from rich.table import Table

    rows_hyco = int(cm.rows_grid[-1])
    table = Table(
        title="projected server ms per round (verification + server-side head steps)",
        caption="paper §3.1 (Gemma 4 26B-A4B on one RTX PRO 6000, median round): HyCo "
        f"{PAPER_ROUND_MS['hyco']} ms, Cloud+MTP {PAPER_ROUND_MS['cloud-mtp']} ms",
    )
    for col in (
        "context",
        f"HyCo ({rows_hyco} rows)",
        f"Cloud+MTP ({chain_length} steps + {chain_length + 1} rows)",
        "of which head steps",
        "Cloud+MTP / HyCo",
    ):
        table.add_column(col, justify="right")
    for t in cm.context_grid:
        try:
            hyco = cm.forwards_ms(round_forwards("device", rows_hyco, int(t)))
            cloud = cm.forwards_ms(round_forwards("cloud-mtp", chain_length + 1, int(t), head_steps=chain_length))
            steps = cloud - cm.predict(chain_length + 1, int(t))
            table.add_row(f"{int(t):,}", f"{hyco:.2f}", f"{cloud:.2f}", f"{steps:.2f}", f"{cloud / hyco:.2f}")
        except CostModelError as e:
            table.add_row(f"{int(t):,}", str(e), "", "", "")
    table.add_row(
        "paper",
        f"{PAPER_ROUND_MS['hyco']:.1f}",
        f"{PAPER_ROUND_MS['cloud-mtp']:.1f}",
        "",
        f"{PAPER_ROUND_MS['cloud-mtp'] / PAPER_ROUND_MS['hyco']:.2f}",
    )
    return table


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (module docstring); argparse exits 2 on a malformed one."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), required=True, help="torch device to measure on")
    ap.add_argument(
        "--recipe",
        type=Path,
        default=None,
        help="load this recipe's verifier with its real weights (default: Gemma 4 26B-A4B shape with "
        "random weights; needs --device cuda)",
    )
    ap.add_argument(
        "--out", type=Path, default=None, help="cost model JSON to write (default: runs/cost-model-<device>.json)"
    )
    ap.add_argument("--rows", default="1,5,33", help="tree rows per forward, comma-separated (default %(default)s)")
    ap.add_argument(
        "--prefill-rows",
        default=",".join(map(str, PREFILL_ROWS)),
        help="prefill chunk widths, comma-separated; the largest should be the engine's chunk, 512 "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--no-head",
        action="store_true",
        help="do not time the server-side MTP head step (the cost model then cannot replay cloud-mtp "
        "or server-head rounds)",
    )
    ap.add_argument(
        "--chain-length",
        type=int,
        default=None,
        help="K of the per-round table's Cloud+MTP round (default: the recipe's, else 4)",
    )
    ap.add_argument(
        "--contexts",
        default=None,
        help="cached positions before the forward, comma-separated (default: cuda 1024,4096,16384; cpu 32,64,128,256)",
    )
    ap.add_argument(
        "--dtype",
        default=None,
        choices=("bfloat16", "float16", "float32"),
        help="weights and activations (default: bfloat16 for random weights, else the recipe's verifier.dtype)",
    )
    ap.add_argument(
        "--clock",
        choices=("busy", "wall"),
        default="busy",
        help="CPU: busy = CPU time of the forward (other processes do not stretch it), wall = "
        "perf_counter, the clock of the server's server_ms; a GPU always uses CUDA events "
        "(default %(default)s)",
    )
    ap.add_argument(
        "--batch-sessions",
        default="",
        help="also measure the batched line at these session counts, comma-separated, e.g. 1,4,16,64 (default: none)",
    )
    ap.add_argument(
        "--batch-rows",
        default="1,2,4,8,16,33,64,128,256,512",
        help="rows per batched forward (all sessions together) of the batched line (default %(default)s)",
    )
    ap.add_argument(
        "--batch-context",
        type=int,
        default=1024,
        help="cached positions per session of the batched line (default %(default)s)",
    )
    ap.add_argument("--warmup", type=int, default=3, help="untimed forwards per point (default %(default)s)")
    ap.add_argument(
        "--repeats", type=int, default=10, help="timed forwards per point; the median is kept (default %(default)s)"
    )
    ap.add_argument(
        "--layers",
        type=int,
        default=None,
        help="random-weight mode only: keep the first N of the 30 layers (a smoke test; the JSON says so)",
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch CPU threads (default: the recipe's verifier.threads, else torch's)",
    )
    return ap.parse_args(argv)


class _UsageError(Exception):
    """A usage error found after parsing: `main` prints it (`_usage`) and returns 2."""


@dataclasses.dataclass(frozen=True)
class Grid:
    """What is measured: verify rows, prefill chunk widths and contexts (cached positions), and the batched line's
    session counts (empty: no batched line) and rows per forward; each sorted, distinct."""

    rows: list[int]
    prefill_rows: list[int]
    contexts: list[int]
    batch_sessions: list[int]
    batch_rows: list[int]


def grid_of(args: argparse.Namespace) -> Grid:
    """The measured grid of the command line; raises _UsageError (or SystemExit(2) from `_ints`) naming the option."""
    if args.warmup < 0 or args.repeats < 1:
        raise _UsageError("--warmup must be >= 0 and --repeats >= 1")
    grid = Grid(
        rows=_ints(args.rows, "--rows", 1),
        prefill_rows=_ints(args.prefill_rows, "--prefill-rows", 1),
        contexts=_ints(args.contexts or DEFAULTS[args.device]["contexts"], "--contexts", 1),
        batch_sessions=_ints(args.batch_sessions, "--batch-sessions", 1) if args.batch_sessions else [],
        batch_rows=_ints(args.batch_rows, "--batch-rows", 1),
    )
    if grid.batch_sessions and args.batch_context < 1:
        raise _UsageError(f"--batch-context {args.batch_context}: need >= 1 cached position")
    return grid


def refusal(args: argparse.Namespace, torch) -> int | None:
    """The exit code when this machine or these options cannot measure (0: --device cuda without a CUDA device, said
    on stdout; 2: a combination of options that does not apply), else None."""
    if args.device == "cuda" and not torch.cuda.is_available():
        print(
            f"verifier_cost_model: skipped: --device cuda, but torch {torch.__version__} sees no CUDA device on "
            "this machine; nothing measured, nothing written"
        )
        return 0
    if args.recipe is None and args.device == "cpu":
        return _usage(
            "--device cpu needs --recipe (random Gemma 4 26B-A4B weights take 50.5 GB in bf16 and "
            "minutes per forward on a CPU); e.g. --device cpu --recipe recipes/toy.toml"
        )
    if args.recipe is not None and args.layers is not None:
        return _usage("--layers applies to the random-weight 26B-A4B shape only, not to --recipe")
    return None


@dataclasses.dataclass
class Measured:
    """The verifier measured (torch modules: ``model``, and ``head`` or None without one), its label (``name``),
    dtype, and the round constants of the per-round table: K (``chain_length``), the head's query position offset
    and its window W (positions)."""

    model: Any
    head: Any
    name: str
    dtype: str
    chain_length: int
    offset: int
    head_window: int


def random_verifier(args: argparse.Namespace, meta: dict, console) -> Measured:
    """The Gemma 4 26B-A4B shape with random weights (``--layers``: its first N layers), and the ASSUMED head unless
    ``--no-head``; notes the weights and head in ``meta``. Raises _UsageError for --layers out of range."""
    from hycoc.passes.plan import VERIFIER_26B_A4B

    cfg = dict(VERIFIER_26B_A4B)
    name = "Gemma 4 26B-A4B shape (hycoc.passes.plan.VERIFIER_26B_A4B), random weights"
    if args.layers is not None:
        if not 1 <= args.layers <= cfg["num_hidden_layers"]:
            raise _UsageError(f"--layers {args.layers}: allowed 1..{cfg['num_hidden_layers']}")
        cfg["num_hidden_layers"], cfg["layer_types"] = args.layers, cfg["layer_types"][: args.layers]
        name += f", first {args.layers} of 30 layers only (smoke test, NOT the model's cost)"
    dtype = args.dtype or DEFAULTS["cuda"]["dtype"]
    console.print(f"building {name} in {dtype} on {args.device} ...")
    model = build_random_verifier(cfg, args.device, dtype)
    meta["weights"] = "random (transformers' initializer, seed 0)"
    head = None
    if not args.no_head:
        from hycoc.passes.plan import HEAD_ASSUMED

        head = build_random_head(HEAD_ASSUMED, cfg["hidden_size"], args.device, dtype)
        meta["head"] = "ASSUMED shape (hycoc.passes.plan.HEAD_ASSUMED), random weights"
    # head_window: recipes/gemma4.toml's window.head_window (W), as the server would run it
    return Measured(model, head, name, dtype, args.chain_length or 4, -1, 1024)


def recipe_verifier(args: argparse.Namespace, meta: dict, torch) -> Measured:
    """``--recipe``'s verifier and (unless ``--no-head``) head with their real weights, in ``--dtype`` or the
    recipe's, on the recipe's threads; notes them in ``meta``. Raises RecipeError, ModelNotFoundError, OSError."""
    from hycoc.models import load_verifier
    from hycoc.recipe import load_recipe

    recipe = load_recipe(args.recipe)
    dtype = args.dtype or recipe.verifier.dtype
    threads = args.threads or recipe.verifier.threads
    if threads:
        torch.set_num_threads(threads)
    model = load_verifier(recipe.model_path("verifier"), dtype=dtype, device=args.device)
    head = None
    if not args.no_head:
        from hycoc.models import load_head

        head = load_head(recipe.model_path("head"), dtype=dtype, device=args.device)
        meta["head"] = f"{recipe.models.head}, real weights"
    name = f"{recipe.models.verifier} (recipe {args.recipe}), real weights"
    meta["weights"] = "real"
    meta["recipe"] = str(args.recipe)
    return Measured(
        model,
        head,
        name,
        dtype,
        args.chain_length or recipe.tree.chain_length,
        recipe.window.head_query_position_offset,
        recipe.window.head_window,
    )


def note_model(args: argparse.Namespace, v: Measured, meta: dict, t_start: float, torch) -> str:
    """Note the model's implementations, parameter counts and build seconds in ``meta``; returns the device's name
    (the GPU's, or the CPU's with its thread count)."""
    meta["experts_implementation"] = getattr(v.model.config, "_experts_implementation", None)
    meta["attn_implementation"] = getattr(v.model.config, "_attn_implementation", None)
    meta["parameters"] = sum(p.numel() for p in v.model.parameters())
    if v.head is not None:
        meta["head_parameters"] = sum(p.numel() for p in v.head.parameters())
    meta["build_s"] = round(time.perf_counter() - t_start, 1)
    if args.device == "cuda":
        return torch.cuda.get_device_name(0)
    return f"cpu: {platform.processor() or platform.machine()}, {torch.get_num_threads()} thread(s)"


def measure(args: argparse.Namespace, grid: Grid, v: Measured, meta: dict, console, t_start: float):
    """Time the grid (`measure_grid` on the engine's session cache) and, with ``--batch-sessions``, the batched line
    (`measure_batch_line`), logging each point; notes the cache and the batched line in ``meta``. Returns (points,
    batch_points)."""

    def log(kind, rows, t, ms, times):
        console.print(
            f"  {kind:<9} rows {rows:>3}  context {t:>6}  {ms:9.2f} ms  (min {min(times):.2f}, "
            f"max {max(times):.2f})  [{time.perf_counter() - t_start:.0f} s]"
        )

    engine = measuring_engine(
        v.model,
        v.head,
        head_window=v.head_window,
        chain_length=v.chain_length,
        head_query_position_offset=v.offset,
        device=args.device,
    )
    meta["kv_cache"] = (
        f"the server's session cache (W = {v.head_window}): sliding layers keep "
        f"{engine.kv_retain} positions + the forward's rows, full layers the context"
    )
    points = measure_grid(
        v.model,
        grid.rows,
        grid.contexts,
        warmup=args.warmup,
        repeats=args.repeats,
        device=args.device,
        log=log,
        head=v.head,
        prefill_rows=grid.prefill_rows,
        chain_length=v.chain_length,
        head_position_offset=v.offset,
        clock=args.clock,
        new_cache=engine.new_cache,
    )
    if not grid.batch_sessions:
        return points, []
    from hycoc.bench.cost_model.batch_line import measure_batch_line

    def log_batch(n, r, ms, times):
        console.print(
            f"  batch     sessions {n:>3}  rows {r:>4}  context {args.batch_context:>6}  {ms:9.2f} ms  (min "
            f"{min(times):.2f}, max {max(times):.2f})  [{time.perf_counter() - t_start:.0f} s]"
        )

    batch_points = measure_batch_line(
        engine,
        grid.batch_sessions,
        grid.batch_rows,
        args.batch_context,
        warmup=args.warmup,
        repeats=args.repeats,
        log=log_batch,
    )
    meta["batch_line"] = (
        "hycoc.bench.cost_model.batch_line: one batched forward (verifier/batch.py batch_forward; one session "
        "verify_tree) per (sessions, rows), random caches of batch_context positions, median"
    )
    return points, batch_points


def print_tables(cm: CostModel, repeats: int, caption: str, console) -> None:
    """One table per kind of forward (ms, and ms per row, per rows x context) and, when measured, the batched line
    (ms per rows x sessions); ``caption``: the model, dtype and device."""
    from rich.table import Table

    for kind in cm.kinds:
        table = Table(title=f"{kind} forward, ms (median of {repeats})", caption=caption)
        table.add_column("rows", justify="right")
        for t in cm.contexts_of(kind):
            table.add_column(f"t = {t:,}", justify="right")
        grid = cm.table(kind)
        for i, rows in enumerate(cm.rows_of(kind)):
            table.add_row(str(rows), *(f"{ms:.2f} ({ms / rows:.2f}/row)" for ms in grid[i]))
        console.print(table)
    if cm.batch_points:
        table = Table(title=f"batched forward, ms (median of {repeats}), context {cm.batch_context:,}")
        table.add_column("rows", justify="right")
        ns = sorted({p.sessions for p in cm.batch_points})
        for n in ns:
            table.add_column(f"{n} session(s)", justify="right")
        got = {(p.sessions, p.rows): p.ms for p in cm.batch_points}
        for r in sorted({p.rows for p in cm.batch_points}):
            table.add_row(str(r), *(f"{got[(n, r)]:.2f}" if (n, r) in got else "" for n in ns))
        console.print(table)


def main(argv=None) -> int:
    """Measure and write the cost model (module docstring); returns the exit code."""
    args = parse_args(argv)
    try:
        grid = grid_of(args)
    except _UsageError as e:
        return _usage(str(e))

    import torch

    refused = refusal(args, torch)
    if refused is not None:
        return refused
    from rich.console import Console

    console = Console()
    t_start = time.perf_counter()
    meta = {
        "warmup": args.warmup,
        "repeats": args.repeats,
        "statistic": "median",
        "timed": "hycoc.verifier.engine.verify_tree: 4-D tree masks + one forward + logits of all rows "
        "(Alg. 4 lines 1-3); KV cache filled with random keys/values",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "created": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    try:
        import transformers

        meta["transformers"] = transformers.__version__
        v = random_verifier(args, meta, console) if args.recipe is None else recipe_verifier(args, meta, torch)
        device_name = note_model(args, v, meta, t_start, torch)
        console.print(
            f"{meta['parameters'] / 1e9:.3f}e9 parameters, built in {meta['build_s']} s; measuring verify rows "
            f"{grid.rows}, {'a head step, ' if v.head is not None else ''}prefill rows {grid.prefill_rows} x "
            f"contexts {grid.contexts}, {args.warmup} warm-up + median of {args.repeats}"
        )
        points, batch_points = measure(args, grid, v, meta, console, t_start)
        meta["clock"] = args.clock if args.device == "cpu" else "wall (CUDA events)"
        if args.device == "cuda":
            meta["max_memory_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 1e9, 2)
    except _UsageError as e:
        return _usage(str(e))
    except torch.OutOfMemoryError as e:
        print(
            f"verifier_cost_model: out of memory on {args.device}: {e}; use fewer/shorter --contexts", file=sys.stderr
        )
        return 1
    except (FileNotFoundError, ValueError, OSError) as e:  # RecipeError, ModelNotFoundError are ValueError/OSError
        print(f"verifier_cost_model: {e}", file=sys.stderr)
        return 1

    meta["total_s"] = round(time.perf_counter() - t_start, 1)
    cm = CostModel(
        device=device_name,
        dtype=v.dtype,
        model=v.name,
        shape=shape_of(v.model.config),
        points=points,
        batch_points=batch_points,
        batch_context=args.batch_context if batch_points else 0,
        source="measured",
        meta=meta,
    )
    out = args.out or REPO / "runs" / f"cost-model-{args.device}.json"
    try:
        cm.save(out)
    except (OSError, CostModelError) as e:
        print(f"verifier_cost_model: cannot write {out}: {e}", file=sys.stderr)
        return 1

    print_tables(cm, args.repeats, f"{v.name}; {v.dtype}; {device_name}", console)
    console.print(round_table(cm, v.chain_length))
    console.print(f"wrote {out} in {meta['total_s']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
