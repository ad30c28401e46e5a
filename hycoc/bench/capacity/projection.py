"""`hycoc capacity`'s real-shape projection (docs/capacity.md "The real-shape projection"): a recipe whose verifier
is not on this machine (recipes/gemma4.toml), simulated with what the server does (batched, budgeted, the allowance)
on a cost line from the verifier's own config, with scored trees fitted to the paper's MAT, over LTE and 5G and
drafting x0.7 / x1.3. Every input is a labelled model or assumption; none is measured here.

The pieces: the cost line (`hycoc.bench.capacity.cost.roofline_step_cost` from the verifier's and head's
config.json, or a ``--cost-model`` file's measured batched line, `hycoc.bench.capacity.cost.line_step_cost`); the
trees (`hycoc.bench.capacity.trees`: one `TreePool` per device-drafted configuration, θ fitted to Table 2's MAT); the
devices (`hycoc.bench.capacity.simulation.TreeRequest`: drafting to the allowance, the phone's ms at each row count,
ROUND bytes 23 + 8 R); cloud-mtp devices send the root alone (`hycoc.bench.capacity.simulation.SyntheticRequest` at its
MAT). `run_projection` prints the table and the assumptions and writes OUT/capacity.json; `allowance_sweep` is the check
the docs show: every device drafting a FIXED number of rows, floor to B + 1.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hycoc.bench.capacity.requests import CapacityError, SyntheticRequest, TreeRequest, Workload
from hycoc.bench.capacity.run import (
    GEMMA4_FRAMES,
    PAPER_MAT,
    SERVER_DRAFT_FRAMES,
    device_ms_of,
    place_of,
    search_devices,
    stamp,
    write_plot,
)
from hycoc.bench.capacity.simulation import MODES, SimConfig
from hycoc.bench.capacity.trees import TreeModel, TreePool, chain_only_acceptance, phone_ms, tree_pool
from hycoc.table5 import configuration

#: The projection's batching modes by default: what a GPU deployment would run (serial is simulable too).
PROJECTION_MODES = ("batched", "budgeted", "allowance")
#: The projection's request shape (assumed): Spec-Bench-like prompts and answers.
PROMPT_TOKENS, OUTPUT_TOKENS = 128, 512
#: The cost line's anchor context (ASSUMED: a mid-answer position of the projection's requests).
LINE_CONTEXT = 384
#: Trees drawn per configuration (the fit's sample; seeded).
POOL_TREES = 400
#: The rows of each variant (configuration, mode): HyCo in every mode (batched, budgeted, the allowance), HyCo
#: exact with the allowance, SpecEdge batched (its phone time does not shrink with rows: the allowance would only
#: trim its trees), Cloud+MTP batched (its rounds are the root alone: no budget trims and no allowance sizes them).
FULL_ROWS = (
    ("hyco", "batched"),
    ("hyco", "budgeted"),
    ("hyco", "allowance"),
    ("hyco-exact", "allowance"),
    ("specedge", "batched"),
    ("cloud-mtp", "batched"),
)
#: The drafting-time variants: the allowance against Cloud+MTP as the phone gets faster or slower.
DRAFTING_ROWS = (("hyco", "allowance"), ("cloud-mtp", "batched"))
#: Variants: (label, link preset, drafting scale, rows).
VARIANTS = (
    ("LTE", "lte", 1.0, FULL_ROWS),
    ("5G", "5g", 1.0, FULL_ROWS),
    ("LTE, drafting x0.7", "lte", 0.7, DRAFTING_ROWS),
    ("LTE, drafting x1.3", "lte", 1.3, DRAFTING_ROWS),
)


def tree_model(cfg, config: str) -> TreeModel:
    """The recipe's [tree] keys as a `TreeModel` for ``config`` (Table 5: its chain, passes and acceptance)."""
    c, t = configuration(config), cfg.tree
    chain = t.chain_length if c.chain == "device" else 0
    passes = {"slm": t.slm_passes, "two": 2, "specedge": t.specedge_passes}.get(c.passes, 1)
    return TreeModel(
        chain_length=chain,
        sibling_depth=t.sibling_depth if chain else 0,
        node_budget=t.specedge_nodes if c.passes == "specedge" else t.node_budget,
        depth_cost=t.depth_cost,
        candidates=t.slm_candidates,
        passes=passes,
        exact=c.acceptance == "exact",
    )


@dataclass(frozen=True)
class Drafting:
    """The phone's drafting per round of one configuration: ``full`` ms with its SLM pass(es), ``head`` ms of the MTP
    chain alone (rows <= K + 1), ``deferred`` ms of SLM catch-up each floor round leaves for the next pass (at most;
    `hycoc.device_time.allowance_round_ms`), ``source`` in words."""

    full: float
    head: float
    deferred: float
    source: str


def drafting(cfg, configs, *, plan: dict | None = None) -> dict[str, Drafting]:
    """Per device-drafted configuration, its `Drafting`. Configurations with a device chain (hyco, hyco-exact,
    hyco-2p): the device-time estimate at the recipe's real shapes (`hycoc.device_time.plan_allowance_rounds` on
    `hycoc.passes.plan.real_shape_plan`: K head steps always, the SLM pass(es) and their host work above K + 1;
    an ESTIMATE fitted to the paper's device figures). SpecEdge (no chain): the paper's App. G figure (ms/token x
    MAT, `device_ms_of`) at every row count: trimming its tree saves no pass."""
    from hycoc.device_time import ESTIMATE_LABEL, npu_profile, plan_allowance_rounds

    out: dict[str, Drafting] = {}
    for config in configs:
        c = configuration(config)
        if place_of(config).needs_head:  # the server drafts (part of) its tree: not the phone's estimate
            continue
        if c.chain != "device":
            ms = device_ms_of(config)
            out[config] = Drafting(ms, ms, 0.0, "paper App. G ms/token x Table 2 MAT (no chain: every row count)")
            continue
        if plan is None:
            from hycoc.passes.plan import real_shape_plan

            plan = real_shape_plan(cfg)
        rounds = plan_allowance_rounds(
            plan, npu_profile(cfg.target.htp_arch), cfg.tree.sibling_depth, tree_model(cfg, config).passes
        )
        k = cfg.tree.chain_length
        floor, top = rounds[k], rounds[-1]
        out[config] = Drafting(
            top["ms"],
            floor["ms"],
            floor["deferred_slm_ms_max"],
            f"hycoc/device_time.py allowance_round_ms: {ESTIMATE_LABEL}",
        )
    return out


def pools(cfg, configs, *, trees: int = POOL_TREES, seed: int = 0) -> dict[str, TreePool]:
    """A fitted `TreePool` per configuration of ``configs`` whose device drafts the whole tree (its place needs no
    server head: cloud-mtp and server-head have none)."""
    out = {}
    for config in configs:
        if not place_of(config).needs_head:
            out[config] = tree_pool(tree_model(cfg, config), PAPER_MAT[config], trees=trees, seed=seed, label=config)
    return out


def projection_workload(
    config: str,
    pool: TreePool | None,
    draft: Drafting | None,
    *,
    device_scale: float = 1.0,
    rows: int | None = None,
    seed: int = 0,
) -> Workload:
    """The devices of ``config``: a `TreeRequest` per request drafting to the allowance (``rows``: a FIXED row
    count instead, the allowance sweep), its phone ms x ``device_scale`` per ``draft`` (`drafting`); cloud-mtp: the
    root alone at Table 2's MAT."""
    place = place_of(config).name
    if pool is None:
        mat = PAPER_MAT[config]
        return Workload(
            lambda i, k: SyntheticRequest(
                PROMPT_TOKENS, OUTPUT_TOKENS, mat, 1, 0.0, place, np.random.default_rng([seed, i, k])
            ),
            f"paper MAT {mat}",
        )
    if draft is None:
        raise CapacityError(f"{config}: a device-drafted workload needs its drafting ms (`drafting`), got none")
    full, head, deferred = (x * device_scale for x in (draft.full, draft.head, draft.deferred))
    k = pool.model.chain_length
    ceiling = rows or pool.model.node_budget + 1
    return Workload(
        lambda i, j: TreeRequest(
            PROMPT_TOKENS,
            OUTPUT_TOKENS,
            pool,
            ceiling,
            lambda r: phone_ms(full, head, r, k),
            place,
            np.random.default_rng([seed, i, j]),
            floor=k + 1 if k else 0,
            deferred_ms=deferred,
        ),
        f"fitted trees (MAT {pool.target_mat}), drafting {full:.1f} / {head:.1f} ms",
    )


def verifier_configs(cfg) -> tuple[dict, str, dict, str]:
    """(verifier config.json dict, its source, head config dict, its source): the recipe's local folders' own
    config.json, else the project's reference shapes of the hub ids (`hycoc.passes.plan`: VERIFIER_26B_A4B,
    docs/design.md "Reference shapes"; HEAD_ASSUMED, labelled ASSUMED), as `hycoc inspect` plans them."""
    import copy
    import json

    from hycoc.passes.plan import HEAD_ASSUMED, VERIFIER_26B_A4B

    def local(role: str) -> tuple[dict | None, str]:
        spec = getattr(cfg.models, role)
        if cfg.is_hub_id(role):
            return None, f"hub id {spec}"
        path = cfg.resolve_path(spec)
        f = path / "config.json" if path is not None and path.is_dir() else None
        if f is None or not f.is_file():
            raise CapacityError(f"models.{role}: {spec}: no config.json at {path}; give the model's folder")
        return json.loads(f.read_text(encoding="utf-8")), str(f)

    v, vsrc = local("verifier")
    if v is None:
        v, vsrc = VERIFIER_26B_A4B, f"reference shapes of {vsrc} (passes/plan.py VERIFIER_26B_A4B, docs/design.md)"
    h, hsrc = (None, "") if cfg.models.head_config_assumed else local("head")
    if h is None:
        h = copy.deepcopy(HEAD_ASSUMED)
        hsrc = "ASSUMED (passes/plan.py HEAD_ASSUMED: 4 layers, hidden 1,024; 419.7M parameters, the paper's 420M)"
    return v, vsrc, h, hsrc


def projection_cost(cfg, cost_model_path: Path | None, gpu: str):
    """The projection's `hycoc.bench.capacity.cost.StepCost` and a line saying where it is from: a cost-model
    file's (refused, one line, when its shape is not the recipe verifier's: `line_step_cost`) or the roofline of
    the verifier's own config (`verifier_configs`)."""
    from hycoc.bench.capacity.cost import line_step_cost, roofline_step_cost
    from hycoc.bench.cost_model.model import load_cost_model

    rows, batch = cfg.tree.node_budget + 1, cfg.verifier.max_batch_rows
    v, vsrc, h, hsrc = verifier_configs(cfg)
    if cost_model_path is not None:
        from hycoc.bench.capacity.app import compared_shape

        cost = line_step_cost(
            load_cost_model(cost_model_path),
            compared_shape(v.get("text_config") or v),
            cfg.tree.chain_length,
            tree_rows=rows,
            max_batch_rows=batch,
            path=str(cost_model_path),
        )
        return cost, f"GPU cost line MEASURED: {cost_model_path}"
    cost = roofline_step_cost(
        v,
        h,
        gpu=gpu,
        chain_length=cfg.tree.chain_length,
        tree_rows=rows,
        max_batch_rows=batch,
        verifier_source=vsrc,
        head_source=hsrc,
        context=LINE_CONTEXT,
    )
    return cost, "no GPU line measured here (benchmarks/gpu_check.sh's file not given): the MODEL line, labelled"


def base_config(cfg, link, frames, duration: float, replicas: int, target: float) -> SimConfig:
    """The projection's `SimConfig` for one variant (mode and devices set per run)."""
    v = cfg.verifier
    target_ms = float(getattr(v, "allowance_target_ms", 0.0) or 0.0) or target
    return SimConfig(
        mode="batched",
        devices=1,
        duration_s=duration,
        replicas=replicas,
        link=link,
        frames=frames,
        max_batch_rows=v.max_batch_rows,
        max_batch_wait_ms=v.max_batch_wait_ms,
        tree_rows=cfg.tree.node_budget + 1,
        chain_length=cfg.tree.chain_length,
        allowance_floor=int(getattr(v, "allowance_floor", 0) or 0) or None,
        allowance_target_ms=target_ms,
    )


def capacity_row(make, base: SimConfig, cost, target: float, config: str, mode: str, variant: str):
    """One projection row (`search_devices`): devices at the target and that run's per-device figures; an
    unreachable target is a row with devices None and its one-line reason."""
    label = f"{config} ({mode}, {variant})"
    try:
        n, row, tried = search_devices(make, replace(base, mode=mode), cost, target, label=label)
    except CapacityError as e:
        return {"config": config, "mode": mode, "variant": variant, "devices": None, "note": str(e)}, []
    keys = (
        "tok_per_s_per_device",
        "tok_per_s",
        "server_p90_ms",
        "busy_share",
        "mat",
        "rows_per_forward",
        "sessions_per_forward",
        "rows_sent_per_round",
        "bytes_up_per_round",
        "device_ms_per_round",
        "allowance",
        "rule",
    )
    out = {"config": config, "mode": mode, "variant": variant, "devices": n, **{k: row.get(k) for k in keys}}
    out["round_p90_ms"] = row["latency_ms"]["p90"]
    return out, [dict(r, config=config, variant=variant) for r in tried]


def add_cloud_ratios(rows: list[dict]) -> None:
    """Per row: ``vs_cloud_mtp`` devices / cloud-mtp's in the same variant (cloud-mtp's batched row: its rounds
    are the root alone, so every mode runs them alike) and ``tok_vs_cloud_mtp`` tok/s per device / cloud-mtp's."""
    base = {r["variant"]: r for r in rows if r["config"] == "cloud-mtp" and r["mode"] == "batched"}
    for r in rows:
        b = base.get(r["variant"])
        ok = b is not None and b.get("devices") and r.get("devices") is not None
        r["vs_cloud_mtp"] = r["devices"] / b["devices"] if ok and b is not None else None  # ok: b is not None
        t = b.get("tok_per_s_per_device") if ok and b is not None else None
        r["tok_vs_cloud_mtp"] = r["tok_per_s_per_device"] / t if t else None


def projection_table(rows: list[dict], title: str):
    """The projection's table: per variant, configuration and mode the devices per GPU at the target and what
    each device gets there."""
    from hycoc.bench.loadtest.report import fmt_num as num
    from hycoc.bench.tables import TextTable

    def ratio(x):
        return "n/a" if x is None else f"{x:.2f}x"

    body = [
        [
            r["variant"],
            r["config"],
            r["mode"],
            "unreachable" if r["devices"] is None else str(r["devices"]),
            num(r.get("tok_per_s_per_device")),
            num(r.get("tok_per_s"), 0),
            num(r.get("mat"), 2),
            num(r.get("rows_sent_per_round")),
            "n/a" if not r.get("allowance") else num(r["allowance"]["p50"], 0),
            num(r.get("device_ms_per_round")),
            num(r.get("bytes_up_per_round"), 0),
            num(r.get("server_p90_ms"), 0),
            num(r.get("round_p90_ms"), 0),
            ratio(r.get("vs_cloud_mtp")),
            ratio(r.get("tok_vs_cloud_mtp")),
        ]
        for r in rows
    ]
    headers = [
        "variant",
        "config",
        "mode",
        "devices per GPU",
        "tok/s per device",
        "tok/s all",
        "MAT",
        "rows sent",
        "allowance p50",
        "drafting ms/round",
        "ROUND bytes",
        "verifier p90 ms",
        "round p90 ms (link + verifier)",
        "devices vs cloud-mtp",
        "tok/s/device vs cloud-mtp",
    ]
    return TextTable(title, headers, body, keys=3, justify=["left"] * 3 + ["right"] * 12)


def _weighed(why: dict, i: int) -> str:
    """Candidate i of an `AllowanceRule.explain` in words: its expected tokens and tokens per second of round."""
    rate = why["tokens_per_s"][i]
    return f"{why['tokens'][i]:.2f} tokens per round ({'-' if rate is None else f'{rate:.1f}'} tok/s of round)"


def rule_lines(rows: list[dict], fitted: dict[str, TreePool]) -> list[str]:
    """Per allowance row, what the server's rule weighed at its device count (`AllowanceRule.explain` at the end of
    that run): the load, the link it learned from the gaps, the drafting the devices reported, and the tokens per
    round it expects at the floor and at the rows it granted, beside what the fitted trees commit there."""
    out = []
    for r in rows:
        why, pool = r.get("rule"), fitted.get(r["config"])
        if not why or not why.get("rows") or pool is None:
            continue
        k = why["rows"].index(why["allowance"]) if why["allowance"] in why["rows"] else len(why["rows"]) - 1
        floor, chosen = why["rows"][0], why["rows"][k]
        out.append(
            f"allowance rule, {r['config']} {r['variant']} at {r['devices']} devices: {why['sessions']:.1f} sessions "
            f"per step, link {why['link_ms']:.1f} ms (learned from the gaps), drafting {why['drafting_ms'][0]:.1f} / "
            f"{why['drafting_ms'][1]:.1f} ms (the OPENs' reports), value scale {why['value_scale']:.2f}; it expects "
            f"{_weighed(why, 0)} at {floor} rows and {_weighed(why, k)} at {chosen} -> {why['allowance']} rows; the "
            f"fitted trees commit {pool.mat(floor):.2f} at {floor} rows and {pool.mat(chosen):.2f} at {chosen}"
        )
    return out


def tree_assumptions(fitted: dict[str, TreePool], chain_length: int) -> list[str]:
    """The fitted trees in words: per configuration θ, the chain's per-depth acceptance, the floor's MAT."""
    out = [
        "acceptance: SYNTHESIZED scored trees (hycoc/bench/capacity/trees.py: Alg. 3's shape, the SLM's "
        "probabilities a GEM(1) draw, ASSUMED), FITTED per configuration to paper Table 2 SB-480 MAT by one "
        "acceptance multiplier θ on the scores' own estimate exp(s(c) - s(v))"
    ]
    for name, p in fitted.items():
        chain = (
            f"; chain per-depth acceptance θλ = {p.chain_acceptance():.3f}, floor (root + chain) MAT "
            f"{p.floor_mat():.2f}"
            if p.model.chain_length
            else ""
        )
        rule = "exact" if p.model.exact else "ε: siblings pass independently (ASSUMED)"
        out.append(f"  {name}: MAT {p.target_mat} ({rule}) -> θ = {p.theta:.3f}{chain}")
    cloud = chain_only_acceptance(PAPER_MAT["cloud-mtp"], chain_length)
    out.append(
        f"  cloud-mtp: MAT {PAPER_MAT['cloud-mtp']} (the root alone; its server chain's per-depth acceptance would be "
        f"{cloud:.3f})"
    )
    return out


def run_projection(
    cfg,
    recipe_path: Path,
    configs,
    modes,
    target: float,
    duration: float,
    replicas: int,
    cost_model_path: Path | None,
    device_scale: float,
    out: Path,
    *,
    gpu: str,
    variants=VARIANTS,
    sweep_rows=(),
) -> dict:
    """The real-shape projection (module docstring), labelled: prints its table and every assumption, writes
    OUT/capacity.json and OUT/p90_vs_devices.png; returns the document. ``variants``' rows (`FULL_ROWS`,
    `DRAFTING_ROWS`) restricted to ``configs`` and ``modes``; cloud-mtp runs batched whatever ``modes`` say (its
    rounds are the root alone: no budget trims and no allowance sizes them). ``sweep_rows``: also the fixed-rows
    check (`allowance_sweep`) of every device-drafted configuration with a chain, over LTE and 5G."""
    from hycoc.bench.capacity.app import write_document
    from hycoc.bench.paper.runner import make_console
    from hycoc.bench.tables import print_tables
    from hycoc.runtime.transport import LINK_PRESETS

    t0 = time.perf_counter()
    console = make_console()
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise CapacityError(f"--batching {bad[0]!r}: the projection simulates {', '.join(MODES)}")
    cost, measured = projection_cost(cfg, cost_model_path, gpu)
    fitted = pools(cfg, configs)
    drafts = drafting(cfg, configs)
    rows, tried_all = [], []
    for variant, link, scale, plan in variants:
        for config, mode in plan:
            place = place_of(config)
            if config not in configs or (mode not in modes and place.trimmable):  # a root-only round: any mode
                continue
            frames = GEMMA4_FRAMES if place.hand_off else SERVER_DRAFT_FRAMES
            base = base_config(cfg, LINK_PRESETS[link], frames, duration, replicas, target)

            def make(n, c=config, s=scale):
                return projection_workload(c, fitted.get(c), drafts.get(c), device_scale=s * device_scale)

            row, tried = capacity_row(make, base, cost, target, config, mode, variant)
            rows.append(row)
            tried_all += tried
    add_cloud_ratios(rows)
    title = (
        f"PROJECTION, not a measurement: devices per GPU at verifier p90 <= {target:g} ms, {recipe_path} "
        f"({replicas} replica(s); {cost.label})"
    )
    print_tables([projection_table(rows, title)], console)
    assumptions = projection_assumptions(cfg, cost, measured, fitted, drafts, target, modes)
    for a in assumptions:
        console.print(f"  assumed/input: {a}", markup=False)
    for line in rule_lines(rows, fitted) + [r["note"] for r in rows if r.get("note")]:
        console.print(line, markup=False)
    sweep = []
    for variant, link in (("LTE", "lte"), ("5G", "5g")):
        for config, pool in fitted.items() if sweep_rows else ():
            if pool.model.chain_length:
                got = allowance_sweep(
                    cfg, cost, config, pool, drafts[config], sweep_rows, target, duration, LINK_PRESETS[link], variant
                )
                sweep += [dict(r, mode=f"fixed {r['fixed_rows']} rows") for r in got]
    if sweep:
        cloud = [r for r in rows if r["config"] == "cloud-mtp"]
        add_cloud_ratios(sweep + cloud)
        print_tables([projection_table(sweep, f"every device drafting a FIXED row count ({title})")], console)
    wall = time.perf_counter() - t0
    console.print(f"simulated {duration:g} s per run; {wall:.0f} s of wall time", markup=False)
    doc = {
        "schema": 1,
        "recipe": str(recipe_path),
        "kind": "PROJECTION (not a measurement)",
        "cost": cost.describe(),
        "target_p90_ms": target,
        "replicas": replicas,
        "gpu": gpu,
        "assumptions": assumptions,
        "capacity": rows,
        "fixed_rows_sweep": sweep,
        "tried": tried_all,
        "wall_s": round(wall, 1),
        "machine": stamp(),
    }
    path = write_document(out, doc)
    plot = write_plot([r for r in tried_all if r["variant"] == "LTE"], Path(out) / "p90_vs_devices.png", target)
    console.print(f"wrote {path}, {plot}")
    return doc


def projection_assumptions(cfg, cost, measured: str, fitted, drafts, target: float, modes) -> list[str]:
    """Every input of the projection in words, in the order the docs list them."""
    from hycoc.runtime.transport import LINK_PRESETS

    lte, g5 = LINK_PRESETS["lte"], LINK_PRESETS["5g"]
    k = cfg.tree.chain_length
    split = "; ".join(
        f"{c} {d.full:.1f} ms with its SLM pass"
        + (
            f", {d.head:.1f} ms at or below K + 1 rows (head alone; <= {d.deferred:.1f} ms of SLM catch-up per floor "
            "round paid by the next pass)"
            if d.head != d.full
            else ""
        )
        + f" ({d.source})"
        for c, d in drafts.items()
    )
    v = cfg.verifier
    floor = int(getattr(v, "allowance_floor", 0) or 0) or k + 1
    target_ms = float(getattr(v, "allowance_target_ms", 0.0) or 0.0) or target
    return [
        measured,
        *list(getattr(cost, "assumptions", [])),
        *tree_assumptions(fitted, k),
        f"phone drafting per round: {split}; cloud-mtp drafts nothing",
        f"batching: {', '.join(modes)} as the server runs them (the scheduler's own batch_ready / take_rounds, "
        f"max_batch_rows {v.max_batch_rows}, max_batch_wait_ms {v.max_batch_wait_ms:g}; budgeted: the server's "
        "RowBudget; allowance: budgeted plus the server's AllowanceRule sharing its state, floor "
        f"{floor} rows (K + 1), ceiling {cfg.tree.node_budget + 1}, step target {target_ms:g} ms); cloud-mtp "
        "rounds are the root alone in every mode (simulated batched)",
        f"links: LTE {lte.rtt_ms:g} ms RTT / {lte.mbps:g} Mbit/s, 5G {g5.rtt_ms:g} ms / {g5.mbps:g} Mbit/s "
        "(runtime/transport.py presets)",
        f"requests: {PROMPT_TOKENS}-token prompts, {OUTPUT_TOKENS} output tokens; ROUND {GEMMA4_FRAMES.up_fixed} + "
        f"{GEMMA4_FRAMES.up_per_row} B per row up; REPLY hand-off {GEMMA4_FRAMES.down_fixed:,} B + "
        f"{GEMMA4_FRAMES.down_per_token:,} B per committed token down (docs/serving.md)",
        f"target: the verifier's p90 (arrival -> reply) <= {target:g} ms; the phone's drafting and the link are "
        "outside it and set how often each device sends",
    ]


def allowance_sweep(
    cfg, cost, config: str, pool: TreePool, draft: Drafting, rows_list, target: float, duration: float, link, variant
) -> list[dict]:
    """Every device drafting a FIXED ``rows`` rows (budgeted server, no allowance rule): devices at the target and
    tok/s per device for each row count, the check docs/capacity.md shows for what an allowance rule can reach."""
    base = base_config(cfg, link, GEMMA4_FRAMES, duration, 1, target)
    out = []
    for r in rows_list:

        def make(n, r=r):
            return projection_workload(config, pool, draft, rows=r)

        row, _ = capacity_row(make, base, cost, target, config, "budgeted", variant)
        row["fixed_rows"] = r
        row["phone_ms"] = phone_ms(draft.full, draft.head, r, pool.model.chain_length)
        row["expected_mat"] = pool.mat(r)
        out.append(row)
    return out


__all__ = [
    "LINE_CONTEXT",
    "OUTPUT_TOKENS",
    "PROJECTION_MODES",
    "PROMPT_TOKENS",
    "DRAFTING_ROWS",
    "FULL_ROWS",
    "VARIANTS",
    "add_cloud_ratios",
    "allowance_sweep",
    "base_config",
    "capacity_row",
    "Drafting",
    "drafting",
    "pools",
    "projection_cost",
    "projection_table",
    "projection_workload",
    "rule_lines",
    "run_projection",
    "tree_model",
    "verifier_configs",
]
