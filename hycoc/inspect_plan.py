"""What `hycoc inspect RECIPE` prints: the real-shape plan (`hycoc.passes.plan.real_shape_plan`) as tables
(`render_plan`: models, each graph's IO and weights, device bytes, the wire, the verifier's KV, the plan against the
paper, the SLM's bit maps, the context budget, the assumptions), the chat format (`render_chat`) and the device-time
estimate (`render_device_estimate`). Tables by `hycoc.inspect_tables.print_table`; rich is imported inside the
functions.
"""

from __future__ import annotations

from typing import Any

from hycoc.inspect_tables import inspect_console, print_table


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
    print_table(
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
    print_table(
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
    print_table(
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
    print_table(
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
    print_table(
        console,
        f"verifier KV per session ({kv['kv_dtype']}; sliding layers keep "
        f"{kv['sliding_retained_positions']:,} positions + {kv['tree_rows']} tree rows, full layers the context; "
        "every byte is reserved: below)",
        cols,
        rows,
        right=tuple(cols),
    )
    if "prefill_transient_bytes" in kv:
        print_table(
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
    print_table(
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
        render_graph_plan(console, name, g)
    print_table(
        console,
        "device bytes",
        ["item", "MB"],
        [[key, f"{value / 1e6:.2f}"] for key, value in plan["device_bytes"].items()],
        right=("MB",),
    )
    render_wire(console, plan["handoff"])
    render_verifier_kv(console, plan["verifier"])
    render_paper(console, plan["paper"])
    if plan.get("bit_maps"):
        render_bit_maps(console, plan["bit_maps"])
    budget = plan.get("context_budget") or {}
    if budget.get("graphs"):
        console.print(context_budget_line(budget))
    if plan["assumptions"]:
        console.print("assumed:")
        for a in plan["assumptions"]:
            console.print(f"  - {escape(a)}")


def weights_line(w: dict) -> str:
    """One graph's weights as the plan counts them (``graphs.<name>.weights``): per integer width its tensors,
    weights and MB, then the scales, the other parameters and the total, in MB (10**6 B)."""
    bits = ", ".join(
        f"{k}: {v['tensors']} tensors / {v['weights']:,} weights / {v['bytes'] / 1e6:.1f} MB"
        for k, v in w["by_bits"].items()
    )
    return (
        f"  weights: {bits}; scales {w['scale_bytes'] / 1e6:.2f} MB, other "
        f"{w['other_param_bytes'] / 1e6:.2f} MB; total {w['total_bytes'] / 1e6:.1f} MB"
    )


def render_graph_plan(console: Any, name: str, g: dict) -> None:
    """One drafter graph of the plan: its inputs and outputs, its weights (`weights_line`) and, for the head, the
    input convention and output it is planned with (from the recipe and its own config)."""
    print_table(
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
    console.print(weights_line(g["weights"]))
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


def render_wire(console: Any, h: dict) -> None:
    """The plan's wire bytes (``handoff``): the hand-off per round and per position, the first hand-off and reply,
    a ROUND's tree."""
    print_table(
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


def render_paper(console: Any, paper: dict) -> None:
    """The plan's numbers beside the paper's (``paper``): each with the difference in bytes and %, and its source."""
    cols = ["quantity", "paper", "plan", "difference", "%", "paper source"]
    print_table(
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
            for key, p in paper.items()
        ],
        right=tuple(cols[1:5]),
        text=("paper source",),
    )


def bit_map_rows(bm: dict) -> list[list[str]]:
    """The bit-map table's rows (``bit_maps``): per map the SLM graph's MB beside the paper's, the difference in %,
    MB per integer width (int2 / int4 / int8), MB as compiled (int2 stored as int4) and its rules; last the head
    side (graph + E table) beside the paper's."""
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
    return rows


def render_bit_maps(console: Any, bm: dict) -> None:
    """The SLM's bit maps against the paper's 754 MB graph (`bit_map_rows`) and what the map search found."""
    cols = ["map", "SLM graph MB", "paper MB", "%", "int2 / int4 / int8 MB", "as compiled MB", "rules"]
    print_table(
        console,
        f"SLM bit map (in use: {bm['source']}) vs the paper's 754 MB graph",
        cols,
        bit_map_rows(bm),
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


def context_budget_line(budget: dict) -> str:
    """The context budget in one line (``context_budget`` with graphs): the device when one was named, the
    profile, SoC and limit in bytes, and each graph's MB with "fits" or the shards it needs."""
    where = f"{budget['device']}, " if budget.get("device") else ""
    return (
        f"context budget ({where}{budget['profile']} {budget.get('soc_model') or ''}, "
        f"{budget['limit_bytes']:,} bytes): "
        + ", ".join(
            f"{n} {g['bytes'] / 1e6:.1f} MB " + ("fits" if g["fits"] else f"OVER: {g['shards_needed']} shards")
            for n, g in budget["graphs"].items()
        )
    )
