"""What `hycoc inspect` prints: a recipe's real-shape plan (`recipe_report`, `render_recipe_report`: its tables in
`hycoc.inspect_plan`) and a bundle's manifest (`render_manifest`), and what `hycoc build` prints once the bundle is
written (`render_built_bundle`); as rich tables that fit the console they are printed on (`hycoc.inspect_tables`).
Core module: rich and the planner are imported inside the functions.
"""

from __future__ import annotations

from typing import Any

from hycoc.inspect_plan import render_chat, render_device_estimate, render_plan
from hycoc.inspect_tables import inspect_console, print_table


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


def render_manifest(manifest, console: Any = None) -> None:
    """`hycoc inspect BUNDLE` tables: summary, files, graphs (IO with encodings, weights, ops), round, hand-off."""
    console = inspect_console(console)
    render_manifest_summary(console, manifest)
    print_table(
        console,
        "files",
        ["path", "role", "MB", "sha256"],
        [[f.path, f.role, f"{f.bytes / 1e6:.3f}", f.sha256[:16]] for f in manifest.files],
        right=("MB",),
    )
    for g in manifest.graphs:
        render_graph_entry(console, g)
    print_table(
        console,
        "round constants",
        ["constant", "value"],
        [[n, str(v)] for n, v in round_constants(manifest)],
        right=("value",),
    )
    h = manifest.handoff
    print_table(
        console,
        f"hand-off: int{h.bits} ({h.hidden})",
        ["scale", "value"],
        [
            [n, f"{getattr(h, 'scale_' + n):.6g}"]
            for n in ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full")
        ],
        right=("value",),
    )


def render_manifest_summary(console: Any, manifest) -> None:
    """The lines above the bundle's tables: the recipe and target, the tools that built it, schema, time, files,
    MB and keep set, and its chat format."""
    from rich.markup import escape

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


def tensor_rows(g) -> list[list[str]]:
    """A manifest graph's inputs then outputs as table rows: in/out, name, shape ("AxBxC", "scalar" for none),
    dtype, and the encoding (integer dtype, scale, zero point) or "-"."""
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
    return rows


def render_graph_entry(console: Any, g) -> None:
    """One graph of the manifest: its IO table (`tensor_rows`), its quantized weights and its op counts."""
    print_table(
        console,
        f"graph {g.name} ({g.role}): {g.file}" + (f" -> {g.context_binary}" if g.context_binary else ""),
        ["", "name", "shape", "dtype", "encoding"],
        tensor_rows(g),
        text=("encoding",),
    )
    bits = ", ".join(f"{k}: {w.tensors} tensors / {w.elements:,} weights" for k, w in g.weight_bits.items())
    console.print(f"  weights: {bits or 'none quantized'}")
    console.print("  ops: " + ", ".join(f"{k} {n}" for k, n in g.op_counts.items()))


def round_constants(manifest) -> tuple[tuple[str, Any], ...]:
    """The manifest's round constants (Alg. 1-4, Table 5) and integer widths as (label, value) pairs, the label
    with the paper's letter where it has one ("K (chain_length)")."""
    r = manifest.round
    q = manifest.quantization
    return (
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


def render_built_bundle(result, console: Any = None) -> None:
    """What `hycoc build` prints once the bundle is written: one row per graph (file, inputs, outputs, quantized
    weights by dtype) and a line with the files, MB and keep set. ``result``: `hycoc.passes.build.BuildResult`
    (``out_dir``, ``manifest``). console: default `inspect_console`."""
    console = inspect_console(console)
    manifest = result.manifest
    print_table(
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
    "recipe_report",
    "render_built_bundle",
    "render_manifest",
    "render_recipe_report",
    "round_constants",
    "tensor_rows",
]
