"""``hycoc build`` (compile a recipe into a bundle) and ``hycoc inspect`` (a bundle's manifest, or a recipe's
real-shape plan), with inspect's printers. The compiler is imported inside the command bodies."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from hycoc.cli._common import PENDING, RECIPE_ARG, Device, TargetName, _fail, _need_full, _recipe



def build(
    recipe: Path = RECIPE_ARG,
    target: Optional[TargetName] = typer.Option(
        None, help="compile target: htp-v81 = QNN HTP context binaries, cpu = QDQ ONNX for onnxruntime's CPU EP, "
        "qai-hub = Qualcomm AI Hub compile job (default: the recipe's target.name)", show_default=False),
    out: Optional[Path] = typer.Option(
        None, help="bundle folder to write (written to a temporary folder, renamed when complete) "
        "(default: bundles/<recipe name>-<target>)", show_default=False),
    list_passes: bool = typer.Option(False, "--list-passes", help="print the pass pipeline for the recipe and exit"),
    until: Optional[str] = typer.Option(
        None, metavar="PASS", help="stop after this pass and keep its artifact for inspection", show_default=False),
    cache_dir: Optional[Path] = typer.Option(
        None, help="cache of intermediate artifacts, keyed by content hash (default: .hycoc-cache in the cwd)",
        show_default=False),
    device: Device = typer.Option(
        Device.cpu, help="where the verifier captures and the head's QAT run: cpu (models as saved) or cuda (the "
        "verifier in bfloat16, QAT under bfloat16 autocast, paper Table 4); cached separately per device"),
) -> None:
    """Compile the recipe's MTP head and SLM into a bundle of static, quantized graphs (paper §3.2-3.4)."""
    from rich.console import Console

    from hycoc.models import ModelNotFoundError
    from hycoc.passes.build import BuildError, BuildNotReady, build_bundle, build_pipeline
    from hycoc.passes.calibration import CalibrationError
    from hycoc.passes.export import ExportError
    from hycoc.passes.head_qat import HeadQatError
    from hycoc.passes.keep_set import KeepSetError
    from hycoc.passes.pipeline import PipelineError
    from hycoc.passes.qdq import QdqError
    from hycoc.passes.slm_graph import SlmGraphError
    from hycoc.passes.slm_surgery import SurgeryError
    from hycoc.recipe import RecipeError
    from hycoc.targets.cpu import CpuTargetError
    from hycoc.targets.htp import HtpTargetError
    from hycoc.targets.profiles import UnknownTargetError
    from hycoc.targets.qai_hub import QaiHubDeviceError, QaiHubJobError, QaiHubSetupError
    from hycoc.verifier.loading import DeviceUnavailable

    errors = (BuildError, PipelineError, RecipeError, ModelNotFoundError, KeepSetError, HeadQatError, ExportError,
              SurgeryError, SlmGraphError, CalibrationError, QdqError, CpuTargetError, HtpTargetError,
              UnknownTargetError, QaiHubSetupError, QaiHubJobError, QaiHubDeviceError, DeviceUnavailable)

    config = _recipe("build", recipe)
    _need_full("build")
    name = target.value if target is not None else config.target.name
    cache = cache_dir if cache_dir is not None else Path(".hycoc-cache")
    console = Console(stderr=True)
    if list_passes:
        typer.echo(build_pipeline(config, name, cache_dir=cache, console=console, device=device.value).describe())
        return
    out_dir = out if out is not None else Path("bundles") / f"{config.recipe.name}-{name}"
    try:
        result = build_bundle(config, name, None if until else out_dir, cache, until=until, console=console,
                              device=device.value)
    except BuildNotReady as e:
        number, title = PENDING["build"]
        raise _fail("build", f"not available yet (issue {number}: {title}): {e}", code=2) from None
    except errors as e:  # each names what is wrong and what to do; the CLI says it in one line
        raise _fail("build", "; ".join(line.strip() for line in str(e).splitlines() if line.strip())) from None
    if until is not None:
        typer.echo(f"stopped after {until}; its artifacts are in {result.stopped_at}")
        return
    from rich.table import Table

    manifest = result.manifest
    table = Table(title=f"bundle {result.out_dir} ({manifest.target.name})")
    for column in ("graph", "file", "inputs", "outputs", "weights"):
        table.add_column(column)
    for g in manifest.graphs:
        weights = ", ".join(f"{w.tensors} {dtype}" for dtype, w in g.weight_bits.items())
        table.add_row(g.name, g.file, str(len(g.inputs)), str(len(g.outputs)), weights)
    Console().print(table)
    total = sum(f.bytes for f in manifest.files)
    typer.echo(f"wrote {result.out_dir}: {len(manifest.files)} files, {total / 1e6:.2f} MB, keep set "
               f"{manifest.keep_set_size}")


def inspect(
    target: Path = typer.Argument(..., metavar="BUNDLE|RECIPE", help="a bundle folder, or a recipe TOML (real-shape plan, no weights needed)",
                                  show_default=False),
    json_out: bool = typer.Option(False, "--json", help="emit JSON instead of tables"),
) -> None:
    """Print a bundle's manifest, or a recipe's graphs, sizes and hand-off bytes on real shapes."""
    if target.suffix == ".toml":
        config = _recipe("inspect", target)
        from hycoc.passes.plan import PlanError, plan_json, real_shape_plan

        from hycoc.chat_template import chat_summary
        from hycoc.device_time import plan_estimate

        try:
            plan = real_shape_plan(config)
        except PlanError as e:
            raise _fail("inspect", str(e)) from None
        plan["chat"] = chat_summary(config)
        plan["device_time_estimate"] = plan_estimate(plan)
        if json_out:
            typer.echo(plan_json(plan), nl=False)
            return
        _print_plan(plan)
        _print_chat(plan["chat"])
        _print_device_estimate(plan["device_time_estimate"])
        return
    if not target.is_dir():
        raise _fail("inspect", f"{target}: neither a bundle folder nor a recipe .toml", code=2)
    from hycoc.bundle import BundleError, load_manifest

    try:
        manifest = load_manifest(target, verify=True)
    except BundleError as e:
        raise _fail("inspect", str(e)) from None
    if json_out:
        typer.echo(manifest.to_json(), nl=False)
        return
    _print_manifest(manifest)


def _print_device_estimate(est: dict) -> None:
    """`hycoc inspect RECIPE`: the device-time estimate per graph call and each anchor's residual."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    p = est["npu_profile"]
    mac = "unbound by the anchors (memory-bound)" if p["tmacs"] is None else f"{p['tmacs']:.2f} TMAC/s"
    graphs = Table(title=f"device time per graph call at the real shape: {est['label']}; NPU profile {p['name']}: "
                         f"{p['bandwidth_gbps']:.1f} GB/s, int16 MACs {mac}, {p['overhead_ms']:.2f} ms per call, "
                         f"{p['host_ms_per_slm_pass']:.1f} ms host per SLM pass")
    for col in ("graph", "MB per call", "GMAC per call", "estimated ms"):
        graphs.add_column(col, justify="left" if col == "graph" else "right")
    for g, v in est["graphs"].items():
        graphs.add_row(g, f"{v['bytes'] / 1e6:.1f}", f"{v['macs'] / 1e9:.2f}", f"{v['estimate_ms']:.2f}")
    console.print(graphs)
    anchors = Table(title="the estimate against device figures (fit: fitted to; check: not fitted)")
    for col in ("anchor", "kind", "figure ms", "estimate ms", "residual ms", "residual %", "source"):
        anchors.add_column(col, justify="left" if col in ("anchor", "kind", "source") else "right")
    for a in est["anchors"]:
        anchors.add_row(escape(a["anchor"]), a["kind"], f"{a['figure_ms']:.1f}", f"{a['estimate_ms']:.1f}",
                        f"{a['residual_ms']:+.1f}", f"{a['residual_pct']:+.1f}", escape(a["source"]))
    console.print(anchors)


def _print_chat(chat: dict) -> None:
    """The chat section of `hycoc inspect RECIPE` (`hycoc.chat_template.chat_summary`)."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    if not chat["available"]:
        console.print(f"chat format: not read ({escape(chat['why'])}); it will read:")
        for what, where in chat["reads"].items():
            console.print(f"  {what}: {escape(where)}")
        return
    console.print(f"chat format ({escape(chat['sources']['template'])}): the prompt for 'Hello' is "
                  f"{escape(repr(chat['prompt']))}, {len(chat['prompt_ids'])} tokens; a next turn opens with "
                  f"{escape(repr(chat['next_turn']))}")
    stops = Table(title=f"stop tokens ({escape(chat['sources']['stop_ids'])})")
    for col in ("id", "token"):
        stops.add_column(col)
    for s in chat["stop"]:
        stops.add_row(str(s["id"]), escape(s["token"]))
    console.print(stops)
    thinking = (f"thinking: --thinking renders {escape(repr(chat['thinking_prompt']))}" if chat["thinking"]
                else "thinking: the template has no switch (enable_thinking renders the same)")
    reasoning = (f"reasoning channel {escape(repr(chat['reasoning'][0]))} ... {escape(repr(chat['reasoning'][1]))} "
                 f"({escape(chat['sources']['reasoning'])})" if chat["reasoning"] else "no reasoning channel")
    console.print(f"{thinking}; {reasoning}; default off (README \"Chat format\")")


def _print_verifier_kv(console, kv: dict) -> None:
    """The plan's verifier KV table: bytes per session and sessions per pool, full-length vs windowed layout."""
    from rich.table import Table

    table = Table(title=f"verifier KV per session ({kv['kv_dtype']}; sliding layers keep "
                        f"{kv['sliding_retained_positions']:,} positions + {kv['tree_rows']} tree rows, full layers "
                        f"the context)")
    pool = kv["pool_bytes"] / 1e9
    for col in ("context", "full-length GB", f"full-length sessions / {pool:g} GB", "windowed GB",
                f"windowed sessions / {pool:g} GB"):
        table.add_column(col, justify="right")
    for n, after in kv["kv_bytes_per_session"].items():
        fit = kv["sessions_per_pool"][n]
        table.add_row(f"{int(n):,}", f"{kv['full_length_bytes'][n] / 1e9:.3f}", f"{fit['full_length']:,}",
                      f"{after / 1e9:.3f}", f"{fit['windowed']:,}")
    console.print(table)


def _print_plan(plan: dict) -> None:
    """`hycoc inspect RECIPE` tables: sources and assumptions, graph IO, sizes vs the paper, hand-off bytes."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    r = plan["round"]
    console.print(f"real-shape plan of recipe {plan['recipe']} (no weights read): keep set {r['keep_set']:,}, "
                  f"W {r['head_window']:,}, B {r['node_budget']} ({r['tree_rows']} tree rows, SLM graph "
                  f"{r['slm_rows']} rows)")
    models = Table(title="models")
    for col in ("role", "parameters", "hidden", "layers", "config from"):
        models.add_column(col, justify="right" if col in ("parameters", "hidden", "layers") else "left")
    for role, m in plan["models"].items():
        models.add_row(role, f"{m['params']:,}", str(m["hidden_size"]), str(m["layers"]), escape(plan["sources"][role]))
    console.print(models)
    for name, g in plan["graphs"].items():
        io = Table(title=f"{name} graph: inputs and outputs")
        for col in ("", "name", "shape", "dtype", "note"):
            io.add_column(col)
        for kind in ("inputs", "outputs"):
            for s in g[kind]:
                io.add_row(kind[:-4], s["name"], "x".join(map(str, s["shape"])),
                           s["dtype"], escape(s.get("note", "")))
        console.print(io)
        w = g["weights"]
        bits = ", ".join(f"{k}: {v['tensors']} tensors / {v['weights']:,} weights / {v['bytes'] / 1e6:.1f} MB"
                         for k, v in w["by_bits"].items())
        console.print(f"  weights: {bits}; scales {w['scale_bytes'] / 1e6:.2f} MB, other "
                      f"{w['other_param_bytes'] / 1e6:.2f} MB; total {w['total_bytes'] / 1e6:.1f} MB")
    device = Table(title="device bytes")
    device.add_column("item")
    device.add_column("MB", justify="right")
    for key, value in plan["device_bytes"].items():
        device.add_row(key, f"{value / 1e6:.2f}")
    console.print(device)
    h = plan["handoff"]
    wire_t = Table(title=f"wire (verifier layers {h['verifier_layers']['sliding']} sliding / "
                         f"{h['verifier_layers']['full']} full, kv dims {h['kv_dim_sliding']} / {h['kv_dim_full']})")
    wire_t.add_column("item")
    wire_t.add_column("bytes", justify="right")
    for key in ("handoff_bytes_per_round", "handoff_bytes_per_position", "first_handoff_bytes", "first_reply_bytes",
                "tree_bytes_per_round"):
        wire_t.add_row(key, f"{h[key]:,}")
    console.print(wire_t)
    _print_verifier_kv(console, plan["verifier"])
    paper = Table(title="plan vs paper")
    for col in ("quantity", "paper", "plan", "difference", "%", "paper source"):
        paper.add_column(col, justify="left" if col in ("quantity", "paper source") else "right")
    for key, p in plan["paper"].items():
        paper.add_row(key, f"{p['paper']:,}", f"{p['plan']:,}", f"{p['diff']:+,}", f"{p['diff_pct']:+.2f}",
                      escape(p["source"] + (f" ({p['note']})" if "note" in p else "")))
    console.print(paper)
    bm = plan.get("bit_maps")
    if bm:
        maps = Table(title=f"SLM bit map (in use: {bm['source']}) vs the paper's 754 MB graph")
        for col in ("map", "SLM graph MB", "paper MB", "%", "int2 / int4 / int8 MB", "as compiled MB", "rules"):
            maps.add_column(col, justify="left" if col in ("map", "rules") else "right")
        for r in bm["maps"]:
            b = r["by_bits"]
            maps.add_row(escape(r["map"]), f"{r['slm_graph_bytes'] / 1e6:.1f}", f"{r['paper_bytes'] / 1e6:.0f}",
                         f"{r['diff_pct']:+.2f}", " / ".join(f"{b.get(k, 0) / 1e6:.1f}" for k in ("int2", "int4", "int8")),
                         f"{r['htp_graph_bytes'] / 1e6:.1f}", escape(r["text"]))
        hs = bm["head_side"]
        maps.add_row("head side (graph + E)", f"{hs['total_bytes'] / 1e6:.1f}", f"{hs['paper_bytes'] / 1e6:.0f}",
                     f"{hs['diff_pct']:+.2f}", "", "", escape(hs["note"]))
        console.print(maps)
        s = bm["search"]
        console.print(f"  {s['maps_within']} of {s['maps_tried']} group-wise maps land within "
                      f"{100 * s['tolerance']:.0f} % of {s['target_bytes'] / 1e6:.0f} MB: the size alone does not fix "
                      "the map; a checkpoint's own quantization_config replaces the assumed one. 'as compiled': "
                      "2-bit weights stored as int4 in the QDQ graph (the HTP has no int2)")
    budget = plan.get("context_budget") or {}
    if budget.get("graphs"):
        console.print(f"context budget ({budget['profile']}, {budget['limit_bytes']:,} bytes): " + ", ".join(
            f"{n} {g['bytes'] / 1e6:.1f} MB {'fits' if g['fits'] else 'OVER: ' + str(g['shards_needed']) + ' shards'}"
            for n, g in budget["graphs"].items()))
    if plan["assumptions"]:
        console.print("assumed:")
        for a in plan["assumptions"]:
            console.print(f"  - {escape(a)}")


def _print_manifest(manifest) -> None:
    """`hycoc inspect BUNDLE` tables: summary, files, graphs (IO with encodings, weights, ops), round, hand-off."""
    from rich.console import Console
    from rich.table import Table

    console = Console(width=max(Console().width, 120))
    t = manifest.target
    where = f"HTP v{t.htp_arch} {t.soc_model} (soc id {t.soc_id})" if t.backend == "htp" else "onnxruntime CPU EP"
    tools = ", ".join(f"{k} {v}" for k, v in (("onnxruntime", t.onnxruntime), ("onnxruntime-qnn", t.onnxruntime_qnn),
                                              ("QNN SDK", t.qnn_sdk)) if v)
    total = sum(f.bytes for f in manifest.files)
    console.print(f"bundle of recipe {manifest.recipe.name} (sha256 {manifest.recipe.sha256[:12]}), target {t.name}: "
                  f"{where}")
    console.print(f"built with {tools or 'tool versions unknown'}")
    console.print(f"schema {manifest.schema_version}, created {manifest.created_at}, {len(manifest.files)} files, "
                  f"{total / 1e6:.3f} MB, keep set {manifest.keep_set_size} tokens")
    c = manifest.chat
    if c is None:
        console.print("chat: none recorded (built before the chat format was; `hycoc run` refuses it: rebuild)")
    else:
        from rich.markup import escape

        stops = ", ".join(f"{i} {t}" for i, t in zip(c.stop_ids, c.stop_tokens))
        turns = c.turns["default"]
        console.print(escape(f"chat: stop ids {stops}; turns: first {turns.first!r}, user_end {turns.user_end!r}, "
                             f"next {turns.next!r}; thinking {'yes' if c.has_thinking else 'no'}; template sha256 "
                             f"{c.template_sha256[:12]}"))

    files = Table(title="files")
    for col in ("path", "role", "MB", "sha256"):
        files.add_column(col, justify="right" if col == "MB" else "left")
    for f in manifest.files:
        files.add_row(f.path, f.role, f"{f.bytes / 1e6:.3f}", f.sha256[:16])
    console.print(files)

    for g in manifest.graphs:
        io = Table(title=f"graph {g.name} ({g.role}): {g.file}"
                   + (f" -> {g.context_binary}" if g.context_binary else ""))
        for col in ("", "name", "shape", "dtype", "encoding"):
            io.add_column(col)
        for kind, specs in (("in", g.inputs), ("out", g.outputs)):
            for s in specs:
                e = s.encoding
                enc = f"{e.dtype} scale {e.scale:.6g} zp {e.zero_point}" if e else "-"
                io.add_row(kind, s.name, "x".join(map(str, s.shape)) or "scalar", s.dtype, enc)
        console.print(io)
        bits = ", ".join(f"{k}: {w.tensors} tensors / {w.elements:,} weights" for k, w in g.weight_bits.items())
        console.print(f"  weights: {bits or 'none quantized'}")
        console.print("  ops: " + ", ".join(f"{k} {n}" for k, n in g.op_counts.items()))

    r = manifest.round
    rounds = Table(title="round constants")
    rounds.add_column("constant")
    rounds.add_column("value", justify="right")
    for name, value in (("K (chain_length)", r.chain_length), ("D (sibling_depth)", r.sibling_depth),
                        ("B (node_budget)", r.node_budget), ("W (head_window)", r.head_window),
                        ("slm_window", r.slm_window), ("slm_sliding_window", r.slm_sliding_window),
                        ("head_query_position_offset", r.head_query_position_offset),
                        ("lambda (depth_cost)", r.depth_cost), ("epsilon", r.epsilon),
                        ("acceptance", r.acceptance_mode), ("slm_candidates", r.slm_candidates),
                        ("slm_passes", r.slm_passes), ("specedge passes / nodes", f"{r.specedge_passes} / "
                                                                                  f"{r.specedge_nodes}"),
                        ("temperature", r.temperature), ("top_k", r.top_k), ("top_p", r.top_p),
                        ("max_new_tokens", r.max_new_tokens), ("seed", r.seed)):
        rounds.add_row(name, str(value))
    q = manifest.quantization
    rounds.add_row("head weight bits / SLM activation bits / KV bits",
                   f"{q.head_weight_bits} / {q.slm_activation_bits} / {q.kv_bits}")
    console.print(rounds)

    h = manifest.handoff
    hand = Table(title=f"hand-off: int{h.bits} ({h.hidden})")
    hand.add_column("scale")
    hand.add_column("value", justify="right")
    for name in ("embedding", "hidden", "k_sliding", "v_sliding", "k_full", "v_full"):
        hand.add_row(name, f"{getattr(h, 'scale_' + name):.6g}")
    console.print(hand)
