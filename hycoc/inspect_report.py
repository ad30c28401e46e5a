"""What `hycoc inspect` prints: a recipe's real-shape plan (`recipe_report`, `render_plan`) and a bundle's manifest
(`render_manifest`), as rich tables that fit the console they are printed on.

Width: `inspect_console` lays out at the terminal's width (at least 80 columns), or when stdout is redirected at
``COLUMNS`` if set, else 120, where a line of text is not wrapped (`hycoc.bench.tables.report_console`, the bench
tables' rule). Every table is made by
`_table`: identifier and number columns never wrap nor cut (a graph name, a shape such as 1x8x1024x256), free-text
columns (sources, notes, rules) wrap at spaces and take the room that is left (rich docs, "Tables": ``no_wrap``,
``overflow``, ``ratio``). Core module: rich and the planner are imported inside the functions.
"""

from __future__ import annotations

from typing import Any


def inspect_console(console: Any = None):
    """The given rich Console, else `hycoc.bench.tables.report_console`'s: as wide as the terminal (at least 80),
    or when stdout is redirected ``COLUMNS`` if set, else 120, and then with no line of text wrapped."""
    from hycoc.bench.tables import report_console

    return report_console(console)


#: The narrowest a free-text column is laid out at before a table is split into parts.
TEXT_MIN_WIDTH = 24


def _print_table(
    console: Any,
    title: str,
    headers: list[str],
    rows: list[list[str]],
    right: tuple[str, ...] = (),
    text: tuple[str, ...] = (),
    keys: int = 1,
) -> None:
    """Print a table of plain-string ``rows`` (no markup) that fits ``console.width``.

    Columns named in ``text`` hold free text: they wrap at spaces (a long word folded) and take the width that is
    left, down to `TEXT_MIN_WIDTH`. Every other column is as wide as its widest cell and never wraps nor cuts (a
    graph name, 1x8x1024x256); its header is wrapped at spaces to that width
    (`hycoc.bench.tables.column_width`). When the columns do not fit even so, the table is split into parts of
    the same rows, the first ``keys`` columns leading each, titled " (i/n)" (`hycoc.bench.tables.fit_columns`'
    rule). ``right``: columns justified right. Width accounting: `hycoc.bench.tables.table_width` (rich's
    default box, padding 1)."""
    import textwrap

    from rich.table import Table
    from rich.text import Text

    from hycoc.bench.tables import balanced_parts, column_width, table_width

    cells = [[r[i] for r in rows] for i in range(len(headers))]
    need = [
        min(column_width(h, c), TEXT_MIN_WIDTH) if h in text else column_width(h, c) for h, c in zip(headers, cells)
    ]
    lead = list(range(keys))
    parts = [list(range(keys, len(headers)))]
    if table_width(need) > console.width and len(headers) > keys + 1:
        parts, current = [], []
        for i in range(keys, len(headers)):
            if current and table_width([need[j] for j in lead + current + [i]]) > console.width:
                parts.append(current)
                current = []
            current.append(i)
        parts.append(current)
        if len(parts) > 1:
            parts = (
                balanced_parts(
                    list(range(keys, len(headers))),
                    len(parts),
                    lambda cols: table_width([need[j] for j in lead + cols]),
                )
                or parts
            )
    for n, part in enumerate(parts, start=1):
        table = Table(title=Text(title if len(parts) == 1 else f"{title} ({n}/{len(parts)})"))
        for i in lead + part:
            h = headers[i]
            if h in text:
                table.add_column(Text(h), justify="right" if h in right else "left", overflow="fold")
            else:
                wrapped = "\n".join(textwrap.wrap(h, need[i], break_long_words=False, break_on_hyphens=False))
                table.add_column(Text(wrapped), justify="right" if h in right else "left", no_wrap=True)
        for r in rows:
            table.add_row(*(Text(r[i]) for i in lead + part))
        console.print(table)


def recipe_report(config, device=None) -> dict:
    """`hycoc inspect RECIPE --json`'s object: the real-shape plan (`hycoc.passes.plan.real_shape_plan`) with its
    "chat" (`hycoc.chat_template.chat_summary`) and "device_time_estimate" (`hycoc.device_time.plan_estimate`, for
    the target's Hexagon arch: "not fitted for vXX" where it has no constants).

    ``device``: a `hycoc.targets.profiles.DeviceEntry` (``hycoc inspect RECIPE --device NAME``): the plan is made for
    that device's arch, SoC and context limit (`hycoc.passes.build.recipe_for_target`), and graphs over its limit are
    refused (`hycoc.passes.plan_budgets.check_context_budget`). Raises `hycoc.passes.plan.PlanError` (a missing or wrong
    model folder, named before any shape is compared; a graph over the device's limit, with the sizes) and
    `hycoc.passes.build.BuildError` (a recipe the device cannot run: 16-bit activations on v68)."""
    from hycoc.chat_template import chat_summary
    from hycoc.device_time import plan_estimate
    from hycoc.passes.plan import real_shape_plan
    from hycoc.passes.plan_budgets import check_context_budget

    if device is not None:
        from hycoc.passes.build import recipe_for_target

        config, _ = recipe_for_target(config, None, device)
    plan = real_shape_plan(config)
    if device is not None:
        plan["context_budget"]["device"] = device.name
        check_context_budget(plan["context_budget"], config)
    plan["chat"] = chat_summary(config)
    plan["device_time_estimate"] = plan_estimate(plan, config.target.htp_arch, sibling_depth=config.tree.sibling_depth)
    return plan


def render_recipe_report(plan: dict, console: Any = None) -> None:
    """Print `recipe_report`'s object: the plan (`render_plan`), the chat format (`render_chat`) and the
    device-time estimate (`render_device_estimate`) on ``console`` (default: `inspect_console`)."""
    console = inspect_console(console)
    render_plan(plan, console)
    render_chat(plan["chat"], console)
    render_device_estimate(plan["device_time_estimate"], console)


def render_device_estimate(est: dict, console: Any = None) -> None:
    """`hycoc inspect RECIPE`: the device-time estimate per graph call and each anchor's residual."""
    from rich.markup import escape

    console = inspect_console(console)
    p = est["npu_profile"]
    if p is None:
        console.print(f"device time per graph call: {escape(est['not_fitted'])}")
        return
    mac = "unbound by the anchors (memory-bound)" if p["tmacs"] is None else f"{p['tmacs']:.2f} TMAC/s"
    cols = ["graph", "MB per call", "GMAC per call", "estimated ms"]
    console.print(
        f"device time per graph call at the real shape: {escape(est['label'])}; NPU profile "
        f"{escape(p['name'])}: {p['bandwidth_gbps']:.1f} GB/s, int16 MACs {mac}, {p['overhead_ms']:.2f} ms "
        f"per call, {p['host_ms_per_slm_pass']:.1f} ms host per SLM pass"
    )
    _print_table(
        console,
        "device time per graph call",
        cols,
        [
            [g, f"{v['bytes'] / 1e6:.1f}", f"{v['macs'] / 1e9:.2f}", f"{v['estimate_ms']:.2f}"]
            for g, v in est["graphs"].items()
        ],
        right=tuple(cols[1:]),
    )
    cols = ["anchor", "kind", "figure ms", "estimate ms", "residual ms", "residual %", "source"]
    _print_table(
        console,
        "the estimate against device figures (fit: fitted to; check: not fitted)",
        cols,
        [
            [
                a["anchor"],
                a["kind"],
                f"{a['figure_ms']:.1f}",
                f"{a['estimate_ms']:.1f}",
                f"{a['residual_ms']:+.1f}",
                f"{a['residual_pct']:+.1f}",
                a["source"],
            ]
            for a in est["anchors"]
        ],
        right=tuple(cols[2:6]),
        text=("anchor", "source"),
    )
    render_allowance_rounds(est.get("allowance_rounds") or [], console)


def allowance_ranges(rounds: list[dict]) -> list[dict]:
    """`hycoc.device_time.allowance_round_ms`'s rows grouped into runs of consecutive allowances with the same
    calls and ms: ``{"from", "to", "head_calls", "slm_calls", "ms", "deferred_slm_ms_max"}`` each, in order."""
    out: list[dict] = []
    for r in rounds:
        same = ("head_calls", "slm_calls", "ms", "deferred_slm_ms_max")
        if out and all(out[-1][k] == r[k] for k in same) and out[-1]["to"] == r["allowance"] - 1:
            out[-1]["to"] = r["allowance"]
        else:
            out.append({"from": r["allowance"], "to": r["allowance"], **{k: r[k] for k in same}})
    return out


def render_allowance_rounds(rounds: list[dict], console: Any = None) -> None:
    """`hycoc inspect RECIPE`: HyCo's phone ms per round at each allowance (the rows the verifier lets the next
    tree hold), as runs of allowances with the same cost (`allowance_ranges`). Prints nothing without rows."""
    if not rounds:
        return
    console = inspect_console(console)
    cols = ["allowance (rows)", "head steps", "SLM passes", "phone ms / round", "deferred SLM ms / round, at most"]
    rows = []
    for g in allowance_ranges(rounds):
        span = str(g["from"]) if g["from"] == g["to"] else f"{g['from']}-{g['to']}"
        deferred = f"{g['deferred_slm_ms_max']:.2f}" if g["slm_calls"] == 0 else "-"
        rows.append([span, str(g["head_calls"]), str(g["slm_calls"]), f"{g['ms']:.2f}", deferred])
    _print_table(
        console,
        "HyCo's phone ms per round at each allowance (estimate; at the floor, root + chain, no SLM pass: its "
        "committed tokens get their SLM KV in the next pass's catch-up, the deferred column)",
        cols,
        rows,
        right=tuple(cols[1:]),
    )


def render_chat(chat: dict, console: Any = None) -> None:
    """The chat section of `hycoc inspect RECIPE` (`hycoc.chat_template.chat_summary`)."""
    from rich.markup import escape

    console = inspect_console(console)
    if not chat["available"]:
        state = "refused" if chat.get("refused") else "not read"
        console.print(f"chat format: {state} ({escape(chat['why'])}); it will read:")
        for what, where in chat["reads"].items():
            console.print(f"  {what}: {escape(where)}")
        return
    console.print(
        f"chat format ({escape(chat['sources']['template'])}): the prompt for 'Hello' is "
        f"{escape(repr(chat['prompt']))}, {len(chat['prompt_ids'])} tokens; a second turn renders the "
        f"whole conversation: {escape(repr(chat['second_turn']))}"
    )
    _print_table(
        console,
        f"stop tokens ({chat['sources']['stop_ids']})",
        ["id", "token"],
        [[str(s["id"]), s["token"]] for s in chat["stop"]],
    )
    thinking = (
        f"thinking: --thinking renders {escape(repr(chat['thinking_prompt']))}"
        if chat["thinking"]
        else "thinking: the template has no switch (enable_thinking renders the same)"
    )
    reasoning = (
        f"reasoning channel {escape(repr(chat['reasoning'][0]))} ... {escape(repr(chat['reasoning'][1]))} "
        f"({escape(chat['sources']['reasoning'])})"
        if chat["reasoning"]
        else "no reasoning channel"
    )
    console.print(f'{thinking}; {reasoning}; default off (docs/recipes.md "Chat format")')


def render_verifier_kv(console: Any, kv: dict) -> None:
    """The plan's verifier KV table: bytes per session and sessions per pool, full-length vs windowed layout."""
    pool = kv["pool_bytes"] / 1e9
    cols = [
        "context",
        "full-length GB",
        f"full-length sessions / {pool:g} GB",
        "windowed GB",
        f"windowed sessions / {pool:g} GB",
    ]
    rows = []
    for n, after in kv["kv_bytes_per_session"].items():
        fit = kv["sessions_per_pool"][n]
        rows.append(
            [
                f"{int(n):,}",
                f"{kv['full_length_bytes'][n] / 1e9:.3f}",
                f"{fit['full_length']:,}",
                f"{after / 1e9:.3f}",
                f"{fit['windowed']:,}",
            ]
        )
    _print_table(
        console,
        f"verifier KV per session ({kv['kv_dtype']}; sliding layers keep "
        f"{kv['sliding_retained_positions']:,} positions + {kv['tree_rows']} tree rows, full layers the context; "
        "every byte is reserved: below)",
        cols,
        rows,
        right=tuple(cols),
    )
    if "prefill_transient_bytes" in kv:
        _print_table(
            console,
            "verifier KV reserved besides the sessions' (the prefill pool: once per session prefilling at once, "
            f"max_prefills = {kv['max_prefills']}; a {kv['prefill_chunk']:,}-position chunk's rows and an APPEND's "
            "undo copy of its sliding layers; a conversation snapshot: from spare room only, given up when a "
            "session needs it, then that conversation's next turn re-prefills)",
            ["context", "per prefilling session GB", "prefill pool GB", "snapshot GB"],
            [
                [
                    f"{int(n):,}",
                    f"{kv['prefill_transient_bytes'][n] / 1e9:.3f}",
                    f"{kv['prefill_pool_bytes'][n] / 1e9:.3f}",
                    f"{kv['snapshot_bytes'][n] / 1e9:.3f}",
                ]
                for n in kv["kv_bytes_per_session"]
            ],
            right=("context", "per prefilling session GB", "prefill pool GB", "snapshot GB"),
        )


def render_plan(plan: dict, console: Any = None) -> None:
    """`hycoc inspect RECIPE` tables: sources and assumptions, graph IO, sizes vs the paper, hand-off bytes."""
    from rich.markup import escape

    console = inspect_console(console)
    r = plan["round"]
    console.print(
        f"real-shape plan of recipe {escape(plan['recipe'])} (no weights read): keep set "
        f"{r['keep_set']:,}, W {r['head_window']:,}, B {r['node_budget']} ({r['tree_rows']} tree rows, SLM "
        f"graph {r['slm_rows']} rows)"
    )
    _print_table(
        console,
        "models",
        ["role", "parameters", "hidden", "layers", "config from"],
        [
            [role, f"{m['params']:,}", str(m["hidden_size"]), str(m["layers"]), plan["sources"][role]]
            for role, m in plan["models"].items()
        ],
        right=("parameters", "hidden", "layers"),
        text=("config from",),
    )
    for name, g in plan["graphs"].items():
        _print_table(
            console,
            f"{name} graph: inputs and outputs",
            ["", "name", "shape", "dtype", "note"],
            [
                [kind[:-4], s["name"], "x".join(map(str, s["shape"])), s["dtype"], s.get("note", "")]
                for kind in ("inputs", "outputs")
                for s in g[kind]
            ],
            text=("note",),
        )
        w = g["weights"]
        bits = ", ".join(
            f"{k}: {v['tensors']} tensors / {v['weights']:,} weights / {v['bytes'] / 1e6:.1f} MB"
            for k, v in w["by_bits"].items()
        )
        console.print(
            f"  weights: {bits}; scales {w['scale_bytes'] / 1e6:.2f} MB, other "
            f"{w['other_param_bytes'] / 1e6:.2f} MB; total {w['total_bytes'] / 1e6:.1f} MB"
        )
        if "output" in g:  # the head: its input convention and output, from the recipe and its own config
            i, o = g["input"], g["output"]
            cap = o["final_logit_softcapping"]
            console.print(
                f"  input: h {i['hidden']}, query position t{i['query_position_offset']:+d}, sliding layers "
                f"over the last {i['sliding_positions']:,} positions"
            )
            console.print(
                f"  output: dense keep-set logits, no soft-cap (config: "
                f"{cap if cap is not None else 'none'}; transformers applies none), ordered embeddings "
                f"{str(o['use_ordered_embeddings']).lower()}"
            )
    _print_table(
        console,
        "device bytes",
        ["item", "MB"],
        [[key, f"{value / 1e6:.2f}"] for key, value in plan["device_bytes"].items()],
        right=("MB",),
    )
    h = plan["handoff"]
    _print_table(
        console,
        f"wire (verifier layers {h['verifier_layers']['sliding']} sliding / {h['verifier_layers']['full']} "
        f"full, kv dims {h['kv_dim_sliding']} / {h['kv_dim_full']})",
        ["item", "bytes"],
        [
            [key, f"{h[key]:,}"]
            for key in (
                "handoff_bytes_per_round",
                "handoff_bytes_per_position",
                "first_handoff_bytes",
                "first_reply_bytes",
                "tree_bytes_per_round",
            )
        ],
        right=("bytes",),
    )
    render_verifier_kv(console, plan["verifier"])
    cols = ["quantity", "paper", "plan", "difference", "%", "paper source"]
    _print_table(
        console,
        "plan vs paper",
        cols,
        [
            [
                key,
                f"{p['paper']:,}",
                f"{p['plan']:,}",
                f"{p['diff']:+,}",
                f"{p['diff_pct']:+.2f}",
                p["source"] + (f" ({p['note']})" if "note" in p else ""),
            ]
            for key, p in plan["paper"].items()
        ],
        right=tuple(cols[1:5]),
        text=("paper source",),
    )
    bm = plan.get("bit_maps")
    if bm:
        cols = ["map", "SLM graph MB", "paper MB", "%", "int2 / int4 / int8 MB", "as compiled MB", "rules"]
        rows = []
        for r in bm["maps"]:
            b = r["by_bits"]
            rows.append(
                [
                    r["map"],
                    f"{r['slm_graph_bytes'] / 1e6:.1f}",
                    f"{r['paper_bytes'] / 1e6:.0f}",
                    f"{r['diff_pct']:+.2f}",
                    " / ".join(f"{b.get(k, 0) / 1e6:.1f}" for k in ("int2", "int4", "int8")),
                    f"{r['htp_graph_bytes'] / 1e6:.1f}",
                    r["text"],
                ]
            )
        hs = bm["head_side"]
        rows.append(
            [
                "head side (graph + E)",
                f"{hs['total_bytes'] / 1e6:.1f}",
                f"{hs['paper_bytes'] / 1e6:.0f}",
                f"{hs['diff_pct']:+.2f}",
                "",
                "",
                hs["note"],
            ]
        )
        _print_table(
            console,
            f"SLM bit map (in use: {bm['source']}) vs the paper's 754 MB graph",
            cols,
            rows,
            right=tuple(cols[1:6]),
            text=("map", "rules"),
        )
        s = bm["search"]
        console.print(
            f"  {s['maps_within']} of {s['maps_tried']} group-wise maps land within "
            f"{100 * s['tolerance']:.0f} % of {s['target_bytes'] / 1e6:.0f} MB: the size alone does not fix "
            "the map; a checkpoint's own quantization_config replaces the assumed one. 'as compiled': "
            "2-bit weights stored as int4 in the QDQ graph (the HTP has no int2)"
        )
    budget = plan.get("context_budget") or {}
    if budget.get("graphs"):
        where = f"{budget['device']}, " if budget.get("device") else ""
        console.print(
            f"context budget ({where}{budget['profile']} {budget.get('soc_model') or ''}, "
            f"{budget['limit_bytes']:,} bytes): "
            + ", ".join(
                f"{n} {g['bytes'] / 1e6:.1f} MB " + ("fits" if g["fits"] else f"OVER: {g['shards_needed']} shards")
                for n, g in budget["graphs"].items()
            )
        )
    if plan["assumptions"]:
        console.print("assumed:")
        for a in plan["assumptions"]:
            console.print(f"  - {escape(a)}")


def render_manifest(manifest, console: Any = None) -> None:
    """`hycoc inspect BUNDLE` tables: summary, files, graphs (IO with encodings, weights, ops), round, hand-off."""
    from rich.markup import escape

    console = inspect_console(console)
    t = manifest.target
    where = f"HTP v{t.htp_arch} {t.soc_model} (soc id {t.soc_id})" if t.backend == "htp" else "onnxruntime CPU EP"
    tools = ", ".join(
        f"{k} {v}"
        for k, v in (("onnxruntime", t.onnxruntime), ("onnxruntime-qnn", t.onnxruntime_qnn), ("QNN SDK", t.qnn_sdk))
        if v
    )
    total = sum(f.bytes for f in manifest.files)
    console.print(
        escape(
            f"bundle of recipe {manifest.recipe.name} (sha256 {manifest.recipe.sha256[:12]}), target {t.name}: {where}"
        )
    )
    console.print(f"built with {tools or 'tool versions unknown'}")
    console.print(
        f"schema {manifest.schema_version}, created {manifest.created_at}, {len(manifest.files)} files, "
        f"{total / 1e6:.3f} MB, keep set {manifest.keep_set_size} tokens"
    )
    c = manifest.chat
    if c is None:
        console.print("chat: none recorded (built before the chat format was; `hycoc run` refuses it: rebuild)")
    else:
        stops = ", ".join(f"{i} {t}" for i, t in zip(c.stop_ids, c.stop_tokens))
        console.print(
            escape(
                f"chat: stop ids {stops}; template {c.sources.get('template', '?')} "
                f"({len(c.template)} characters, sha256 {c.template_sha256[:12]}); thinking "
                f"{'yes' if c.has_thinking else 'no'}"
            )
        )
    _print_table(
        console,
        "files",
        ["path", "role", "MB", "sha256"],
        [[f.path, f.role, f"{f.bytes / 1e6:.3f}", f.sha256[:16]] for f in manifest.files],
        right=("MB",),
    )
    for g in manifest.graphs:
        rows = []
        for kind, specs in (("in", g.inputs), ("out", g.outputs)):
            for s in specs:
                e = s.encoding
                rows.append(
                    [
                        kind,
                        s.name,
                        "x".join(map(str, s.shape)) or "scalar",
                        s.dtype,
                        f"{e.dtype} scale {e.scale:.6g} zp {e.zero_point}" if e else "-",
                    ]
                )
        _print_table(
            console,
            f"graph {g.name} ({g.role}): {g.file}" + (f" -> {g.context_binary}" if g.context_binary else ""),
            ["", "name", "shape", "dtype", "encoding"],
            rows,
            text=("encoding",),
        )
        bits = ", ".join(f"{k}: {w.tensors} tensors / {w.elements:,} weights" for k, w in g.weight_bits.items())
        console.print(f"  weights: {bits or 'none quantized'}")
        console.print("  ops: " + ", ".join(f"{k} {n}" for k, n in g.op_counts.items()))

    r = manifest.round
    q = manifest.quantization
    constants = (
        ("K (chain_length)", r.chain_length),
        ("D (sibling_depth)", r.sibling_depth),
        ("B (node_budget)", r.node_budget),
        ("W (head_window)", r.head_window),
        ("slm_window", r.slm_window),
        ("slm_sliding_window", r.slm_sliding_window),
        ("head_query_position_offset", r.head_query_position_offset),
        ("lambda (depth_cost)", r.depth_cost),
        ("epsilon", r.epsilon),
        ("acceptance", r.acceptance_mode),
        ("slm_candidates", r.slm_candidates),
        ("slm_passes", r.slm_passes),
        ("specedge passes / nodes", f"{r.specedge_passes} / {r.specedge_nodes}"),
        ("temperature", r.temperature),
        ("top_k", r.top_k),
        ("top_p", r.top_p),
        ("max_new_tokens", r.max_new_tokens),
        ("seed", r.seed),
        (
            "head weight bits / SLM activation bits / KV bits",
            f"{q.head_weight_bits} / {q.slm_activation_bits} / {q.kv_bits}",
        ),
    )
    _print_table(
        console, "round constants", ["constant", "value"], [[n, str(v)] for n, v in constants], right=("value",)
    )
    h = manifest.handoff
    _print_table(
        console,
        f"hand-off: int{h.bits} ({h.hidden})",
        ["scale", "value"],
        [
            [n, f"{getattr(h, 'scale_' + n):.6g}"]
            for n in ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full")
        ],
        right=("value",),
    )


def render_built_bundle(result, console: Any = None) -> None:
    """What `hycoc build` prints once the bundle is written: one row per graph (file, inputs, outputs, quantized
    weights by dtype) and a line with the files, MB and keep set. ``result``: `hycoc.passes.build.BuildResult`
    (``out_dir``, ``manifest``). console: default `inspect_console`."""
    console = inspect_console(console)
    manifest = result.manifest
    _print_table(
        console,
        f"bundle {result.out_dir} ({manifest.target.name})",
        ["graph", "file", "inputs", "outputs", "weights"],
        [
            [
                g.name,
                g.file,
                str(len(g.inputs)),
                str(len(g.outputs)),
                ", ".join(f"{w.tensors} {dtype}" for dtype, w in g.weight_bits.items()),
            ]
            for g in manifest.graphs
        ],
        right=("inputs", "outputs"),
        text=("weights",),
    )
    total = sum(f.bytes for f in manifest.files)
    console.print(
        f"wrote {result.out_dir}: {len(manifest.files)} files, {total / 1e6:.2f} MB, keep set {manifest.keep_set_size}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )  # one greppable line


__all__ = [
    "inspect_console",
    "render_built_bundle",
    "recipe_report",
    "render_chat",
    "render_device_estimate",
    "render_allowance_rounds",
    "allowance_ranges",
    "render_manifest",
    "render_plan",
    "render_recipe_report",
    "render_verifier_kv",
]
