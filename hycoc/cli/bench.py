"""``hycoc bench`` (paper Table 2), ``hycoc tune-epsilon``, ``hycoc loadtest`` and ``hycoc profile`` (AI Hub
device profiles for bench). The bench library is imported inside the command bodies."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated

import typer

from hycoc.cli._common import (
    DEFAULT_DATASET,
    RECIPE_ARG,
    REPO_ROOT,
    Backend,
    TableFormat,
    _bundle_backend,
    _fail,
    _need_full,
    _recipe,
)
from hycoc.cli.options import unset
from hycoc.serving_limits import SERVER_MODES
from hycoc.table5 import TABLE5_ORDER, WITH_VERIFIER

#: Configurations of `hycoc bench` (paper Table 5, `hycoc.table5`).
BENCH_CONFIGS = TABLE5_ORDER


#: Options bench and tune-epsilon share (typer's Annotated form, as huggingface_hub's cli/_cli_utils.py does).
BundleOption = Annotated[
    Path | None,
    typer.Option(
        help="device bundle (default: bundles/<recipe name>-cpu, built first when missing)", show_default=False
    ),
]
BackendOption = Annotated[
    Backend | None,
    typer.Option(help="device backend of the bundle's graphs (default: the bundle's target)", show_default=False),
]
CostModelOption = Annotated[
    Path | None,
    typer.Option(
        help="cost-model JSON for g projected (benchmarks/verifier_cost_model.py); default: measured here",
        show_default=False,
    ),
]


#: bench's own long options (`hycoc.cli.options`), in the order of its parameters.
Dataset = Annotated[
    str | None,
    unset(
        "spec-bench, long-summary (long documents filling the verifier's context, in the paper's "
        "2-shot summarization prompt), or a path: a Spec-Bench question JSONL or an InfiniteBench "
        "longbook_sum_eng.jsonl (the paper's first 50 in HELMET's order) (default: the recipe's bench.dataset, else "
        "spec-bench)"
    ),
]
Limit = Annotated[int | None, unset("use the first N questions (default: all 480)", min=1)]
MaxPromptTokens = Annotated[
    int | None,
    unset(
        "long documents: cut each document at a line end so its prompt has at most N tokens, as "
        "the paper cut the novels to 32K (default: uncut; a prompt the verifier cannot hold is refused at OPEN "
        "with context_overflow)",
        min=16,
    ),
]
BenchConfigs = Annotated[
    str,
    unset(
        "comma-separated configurations (paper Table 5) "
        f"(default: all {len(BENCH_CONFIGS)}: {', '.join(BENCH_CONFIGS)})"
    ),
]
Link = Annotated[
    str | None,
    unset(
        "link model per frame: lte, 5g, none or RTT_MS:MBPS (round trip ms : megabit/s) "
        "(default: the recipe's bench.link)"
    ),
]
Runs = Annotated[int | None, unset("repetitions per configuration (default: the recipe's)", min=1)]
BenchMaxNewTokens = Annotated[
    int | None, unset("output cap per request (default: the recipe's bench.output_cap)", min=1)
]
Turns = Annotated[
    int,
    typer.Option(
        min=1,
        max=2,
        help="2: questions with a second turn (MT-bench) continue on the same session with the "
        "configuration's own first answer in the conversation, as the paper's SB-480 (KV kept; per-turn table of "
        "prefill ms saved, g, MAT); 1: first turns only",
    ),
]
Thinking = Annotated[
    bool,
    typer.Option(
        "--thinking",
        help="prompts with the chat template's thinking switch on; quality scores the final "
        'answer, not the thought (default off, as the recipe runs: docs/recipes.md "Chat format")',
    ),
]
DeviceProfile = Annotated[
    Path | None,
    unset(
        "device_profile.json from `hycoc profile`: phone draft ms per round and delivery tok/s per "
        "configuration from its profiled graph times (default: the labelled estimate, hycoc/device_time.py)"
    ),
]
RemeasureCostModel = Annotated[
    bool,
    typer.Option(
        "--remeasure-cost-model",
        help="measure the cost model again even when OUT/cost_model.json exists "
        "(--resume reuses it, so the summary stays as it was)",
    ),
]
Format = Annotated[
    TableFormat,
    typer.Option(
        "--format",
        help="how the results are printed: table (fit to the terminal's width, or "
        "COLUMNS, 120 when redirected), markdown or csv",
    ),
]


def bench(
    recipe: Path = RECIPE_ARG,
    dataset: Dataset = None,
    limit: Limit = None,
    max_prompt_tokens: MaxPromptTokens = None,
    configs: BenchConfigs = ",".join(BENCH_CONFIGS),
    link: Link = None,
    runs: Runs = None,
    out: Path = typer.Option(Path("runs/bench"), help="folder for records.jsonl, results.json and plots"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted run in --out"),
    bundle: BundleOption = None,
    backend: BackendOption = None,
    cost_model: CostModelOption = None,
    max_new_tokens: BenchMaxNewTokens = None,
    turns: Turns = 2,
    thinking: Thinking = False,
    device_profile: DeviceProfile = None,
    remeasure_cost_model: RemeasureCostModel = False,
    table_format: Format = TableFormat.table,
) -> None:
    """Benchmark every configuration on the same prompts, verifier and seed (paper Table 2, App. G).

    The verifier runs as a separate `hycoc verify-server` process on loopback; the device runtime runs here and
    talks to it through the wire protocol. Writes OUT/records.jsonl (one line per finished request; --resume
    continues), OUT/results.json (summary + records) and PNG plots, and prints the table.
    """
    from hycoc.bench.inputs import OptionError, check_link_option, parse_configs

    cfg = _recipe("bench", recipe)
    try:
        chosen = parse_configs(configs, BENCH_CONFIGS)
        if link is not None:
            check_link_option(link)
    except OptionError as e:
        raise _fail("bench", str(e), code=2) from None
    if cost_model is not None and not cost_model.is_file():
        raise _fail("bench", f"--cost-model {cost_model}: no such file")
    if device_profile is not None:
        from hycoc.bench.paper.device_profile import DeviceProfileError, load_device_costs

        try:
            load_device_costs(device_profile)  # a bad file fails before anything runs
        except DeviceProfileError as e:
            raise _fail("bench", str(e)) from None
    _need_full("bench")
    from hycoc.bench.paper.runner import BenchPlan, JobSettings, run_bench
    from hycoc.chat import ChatFormatError

    questions, dataset_name, bundle_dir = _bench_questions(cfg, recipe, bundle, dataset, max_prompt_tokens)
    plan = BenchPlan(
        questions=questions[:limit] if limit else questions,
        configs=chosen,
        runs=runs or cfg.bench.runs,
        link=link or cfg.bench.link,
        output_cap=max_new_tokens or cfg.bench.output_cap,
        out=out,
        turns=turns,
        thinking=thinking,
        dataset=dataset_name,
    )
    own = {
        "device_profile_path": device_profile,
        "remeasure_cost_model": remeasure_cost_model,
        "fmt": table_format.value,
    }
    job = JobSettings(bundle_dir, _bundle_backend(bundle_dir, backend), resume, cost_model)
    _paper_job("bench", run_bench, cfg, recipe, plan, job, (ChatFormatError,), own)


def _paper_job(command: str, entry, cfg, recipe: Path, plan, job, errors, own=None) -> None:
    """``entry`` (`hycoc.bench.paper.runner.run_bench`, `hycoc.bench.paper.tune_epsilon.run_tune`) on ``plan`` where
    and as ``job`` (`hycoc.bench.paper.runner.JobSettings`) says; ``own``: the entry point's own keyword arguments.
    Ctrl-C exits 130; a bench, bundle, transport or cost-model error, or one of ``errors``, exits 1 in one line."""
    from hycoc.bench.cost_model.model import CostModelError
    from hycoc.bench.paper.records import BenchError
    from hycoc.bundle import BundleError
    from hycoc.runtime.transport import TransportError

    try:
        entry(cfg, recipe, plan, job, **(own or {}))
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (*errors, BenchError, BundleError, TransportError, CostModelError) as e:
        raise _fail(command, str(e)) from None


def _say(line: str) -> None:
    """A note on stderr, wrapped at the terminal's width (one unwrapped line when redirected)."""
    from hycoc.progress import stderr_console

    stderr_console().print(line, markup=False, highlight=False)


def _bench_questions(cfg, recipe: Path, bundle: Path | None, dataset: str | None, max_prompt_tokens: int | None):
    """`hycoc.bench.inputs.bench_questions`, its errors as one line (exit 1)."""
    from hycoc.bench.datasets import DatasetError
    from hycoc.bench.inputs import BenchInputError, bench_questions

    try:
        return bench_questions(cfg, recipe, bundle, dataset, max_prompt_tokens, REPO_ROOT, DEFAULT_DATASET, say=_say)
    except (BenchInputError, DatasetError) as e:
        raise _fail("bench", str(e)) from None


def _bench_bundle(command: str, cfg, recipe: Path, bundle: Path | None) -> Path:
    """`hycoc.bench.inputs.bench_bundle`: ``--bundle``, else bundles/<recipe name>-cpu, built there first when it
    has no manifest; a bad ``--bundle`` as one line (exit 1)."""
    from hycoc.bench.inputs import BenchInputError, bench_bundle

    try:
        return bench_bundle(cfg, recipe, bundle, REPO_ROOT, command=command, say=_say)
    except BenchInputError as e:
        raise _fail(command, str(e)) from None


class TuneMode(str, Enum):
    hyco = "hyco"
    specedge_eps = "specedge-eps"


def tune_epsilon(
    recipe: Path = RECIPE_ARG,
    validation_data: Path | None = typer.Option(
        None, help="held-out conversations JSONL (default: the recipe's tune.validation_data)", show_default=False
    ),
    prompts: int | None = typer.Option(
        None, min=1, help="validation prompts (default: the recipe's tune.prompts)", show_default=False
    ),
    epsilons: str | None = typer.Option(
        None,
        help="comma-separated thresholds in (0, 1) (default: the recipe's tune.epsilons); exact (1) always runs",
        show_default=False,
    ),
    mode: TuneMode | None = typer.Option(
        None, help="configuration swept (default: the recipe's tune.mode)", show_default=False
    ),
    temperature: float | None = typer.Option(
        None, min=0.0, help="sampling temperature (default: the recipe's sampling.temperature)", show_default=False
    ),
    max_new_tokens: int | None = typer.Option(
        None, min=1, help="output cap per request (default: the recipe's tune.max_new_tokens)", show_default=False
    ),
    out: Path = typer.Option(Path("runs/tune-epsilon"), help="folder for records.jsonl and tune.json"),
    resume: bool = typer.Option(False, "--resume", help="continue an interrupted sweep in --out"),
    bundle: BundleOption = None,
    backend: BackendOption = None,
    cost_model: CostModelOption = None,
) -> None:
    """Choose epsilon of epsilon-threshold acceptance on a validation set (paper §3, App. D), guarded by quality.

    Runs every threshold and exact acceptance on the same held-out prompts and seeds (verifier in its own process,
    as hycoc bench), then reports per epsilon: MAT, projected g and the answers' text metrics paired against exact.
    Rule: an epsilon is admissible when, against exact, the mean zlib compressed/raw ratio falls by at most
    tune.max_compression_drop, the share of words in repeated 4-grams rises by at most tune.max_repetition_rise and
    distinct-2 falls by at most tune.max_distinct2_drop (exact always is); the choice is the admissible epsilon with
    the lowest projected g, a g within tune.g_tie_pct % of it counting as a tie won by the larger epsilon.
    Writes OUT/records.jsonl and OUT/tune.json and prints the line to put in the recipe's acceptance table.
    """
    from hycoc.bench.datasets import DatasetError

    cfg = _recipe("tune-epsilon", recipe)
    from hycoc.bench.inputs import OptionError, parse_epsilons

    try:
        eps_list = parse_epsilons(epsilons) if epsilons is not None else list(cfg.tune.epsilons)
    except OptionError as e:
        raise _fail("tune-epsilon", str(e), code=2) from None
    if cost_model is not None and not cost_model.is_file():
        raise _fail("tune-epsilon", f"--cost-model {cost_model}: no such file")
    from hycoc.bench.paper.runner import JobSettings
    from hycoc.bench.paper.tune_epsilon import Tolerance, TuneError, TunePlan, run_tune, validation_questions

    try:
        questions = validation_questions(cfg, recipe, validation_data, prompts, DEFAULT_DATASET)
    except (TuneError, DatasetError) as e:
        raise _fail("tune-epsilon", str(e)) from None
    _need_full("tune-epsilon")
    bundle_dir = _bench_bundle("tune-epsilon", cfg, recipe, bundle)
    plan = TunePlan(
        questions=questions,
        epsilons=eps_list,
        mode=(mode.value if mode else cfg.tune.mode),
        output_cap=max_new_tokens or cfg.tune.max_new_tokens,
        temperature=cfg.sampling.temperature if temperature is None else temperature,
        tolerance=Tolerance.from_recipe(cfg.tune),
        out=out,
    )
    job = JobSettings(bundle_dir, _bundle_backend(bundle_dir, backend), resume, cost_model)
    _paper_job("tune-epsilon", run_tune, cfg, recipe, plan, job, (TuneError,))


def profile(
    bundle: Path = typer.Argument(
        ..., metavar="BUNDLE", help="an htp-v81 or qai-hub bundle folder", show_default=False
    ),
    device: str = typer.Option(
        "Samsung Galaxy S26 (Family)", help="the phone as Qualcomm AI Hub names it (`qai-hub list-devices`)"
    ),
    out: Path | None = typer.Option(
        None, help="where to write the profile (default: BUNDLE/device_profile.json)", show_default=False
    ),
    graph: list[str] | None = typer.Option(
        None, help="profile only these graphs (repeatable; default: all)", show_default=False
    ),
) -> None:
    """Profile each graph of a bundle on a phone through Qualcomm AI Hub (one inference job with profile=True per
    graph) and write device_profile.json for `hycoc bench --device-profile`. Needs the qai-hub package and an API
    token; without them it fails at once, before anything is uploaded."""
    from hycoc.bench.paper.device_profile import DeviceProfileError, profile_bundle
    from hycoc.bundle import BundleError
    from hycoc.targets.qai_hub import QaiHubDeviceError, QaiHubSetupError

    if not bundle.is_dir():
        raise _fail("profile", f"{bundle}: not a bundle folder")
    try:  # profile_bundle refuses a bundle of another target before it looks for the AI Hub token
        result = profile_bundle(
            bundle,
            device,
            out=out,
            graphs=graph,
            on_job=lambda g, j: typer.echo(f"profile: graph {g}: AI Hub inference job {j}"),
        )
    except (QaiHubSetupError, QaiHubDeviceError, DeviceProfileError, BundleError) as e:
        raise _fail("profile", str(e)) from None
    from hycoc.bench.paper.device_profile import profile_table
    from hycoc.bench.paper.runner import make_console
    from hycoc.bench.tables import print_tables

    print_tables([profile_table(result)], make_console())  # the terminal's width; COLUMNS or 120 redirected
    typer.echo(f"wrote {out or bundle / 'device_profile.json'}")


#: Configurations `hycoc loadtest` can record and replay (a verifier in every round: not slm-alone).
LOADTEST_CONFIGS = WITH_VERIFIER
#: `hycoc loadtest --batching` values (`hycoc.serving_limits.SERVER_MODES`: serial, batched, budgeted, allowance).
LOADTEST_BATCHING = tuple(SERVER_MODES)

#: loadtest's long options (`hycoc.cli.options`), in the order of its parameters.
Rate = Annotated[
    float | None,
    unset(
        "session arrivals per second, a seeded Poisson process (open loop); default: all sessions start at once",
        min=0.001,
    ),
]
LoadTestConfigs = Annotated[
    str,
    typer.Option(
        help="comma-separated configurations (paper Table 5) the devices replay; "
        "device i replays the i-th modulo their number",
    ),
]
Server = Annotated[
    str | None,
    unset(
        "a running verifier, ws://HOST:PORT (default: start `hycoc verify-server RECIPE` "
        "in a child process per --batching mode)",
        metavar="URL",
    ),
]
Batching = Annotated[
    str | None,
    unset(
        "comma-separated modes, one server each: serial (one session per forward), batched (sessions' "
        "trees in one forward, as sent: verify-server --batching batched --tree-budget fixed --allowance fixed), "
        "budgeted (batched, rows chosen across the trees by their scores: --tree-budget auto --allowance fixed), "
        "allowance (budgeted, and each reply sizes the session's next tree from the load: --allowance auto, the "
        "recipe default); MODE:CONFIG runs a server of MODE whose devices replay CONFIG alone (a baseline in the "
        "same run, e.g. batched:cloud-mtp) (default: serial; with --server: the mode it reports in /healthz, "
        "checked when given)"
    ),
]
DeviceMs = Annotated[
    float | None,
    unset("device drafting time between rounds, ms (default: each round's recorded time)", min=0.0),
]
RecordedBundle = Annotated[
    Path | None,
    unset(
        "device bundle whose runtime records the rounds (default: bundles/<recipe name>-cpu, built first when missing)"
    ),
]
GpuCostModel = Annotated[
    Path | None,
    unset(
        "cost-model JSON for the GPU projection (its rows must cover the batches); default: an "
        "assumed H200-like GPU, flat up to 206 rows per forward"
    ),
]
RecordedMaxNewTokens = Annotated[
    int | None, unset("output cap of each recorded request (default: the recipe's bench.output_cap)", min=1)
]
RecordedTemperature = Annotated[
    float | None,
    unset(
        "sampling temperature of the recorded and replayed requests (default: the recipe's; 0 "
        "when --batching has budgeted, whose trimmed rounds commit differently from the recording: only greedy text "
        "stays the recording's, so its trees still fit)",
        min=0.0,
    ),
]


def loadtest(
    recipe: Path = RECIPE_ARG,
    sessions: str = typer.Option("1,4,16,64", help="comma-separated concurrent session counts, one run each"),
    duration: float = typer.Option(20.0, min=0.5, help="seconds per run (per batching mode and session count)"),
    rate: Rate = None,
    configs: LoadTestConfigs = "hyco",
    server: Server = None,
    batching: Batching = None,
    device_ms: DeviceMs = None,
    prompts: int = typer.Option(4, min=1, help="Spec-Bench questions (first turns) recorded per configuration"),
    out: Path = typer.Option(Path("runs/loadtest"), help="folder for results.json and latency_vs_sessions.png"),
    bundle: RecordedBundle = None,
    cost_model: GpuCostModel = None,
    max_new_tokens: RecordedMaxNewTokens = None,
    temperature: RecordedTemperature = None,
) -> None:
    """Load-test a verifier with many simulated devices: total tok/s, verifier ms per token, round latency
    p50/p90/p99, rows per forward and errors per session count.

    The real device runtime first records its rounds on a few Spec-Bench prompts per configuration (cached in
    .hycoc-cache/loadtest/ by recipe, bundle, configurations, prompts and cap); then asyncio devices in this one
    process replay them over the wire protocol, waiting the recorded drafting time between rounds. Writes
    OUT/results.json and OUT/latency_vs_sessions.png and prints the table; the GPU columns are a projection.
    """
    from hycoc.bench.datasets import DatasetError, load_spec_bench
    from hycoc.bench.inputs import OptionError
    from hycoc.bench.loadtest.app import plan_loadtest

    cfg = _recipe("loadtest", recipe)
    try:
        plan = plan_loadtest(
            sessions=sessions,
            configs=configs,
            batching=batching,
            server=server,
            duration_s=duration,
            out=out,
            rate=rate,
            device_ms=device_ms,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
        )
    except OptionError as e:
        raise _fail("loadtest", str(e), code=2) from None
    if cost_model is not None and not cost_model.is_file():
        raise _fail("loadtest", f"--cost-model {cost_model}: no such file")
    try:
        questions = load_spec_bench(cfg.resolve_path(cfg.bench.dataset) or DEFAULT_DATASET)[:prompts]
    except DatasetError as e:
        raise _fail("loadtest", str(e)) from None
    _need_full("loadtest")
    from hycoc.bench.cost_model.model import CostModelError, load_cost_model
    from hycoc.bench.loadtest.app import run_recipe
    from hycoc.bench.loadtest.run import LoadTestError, check_server
    from hycoc.bench.loadtest.trace import TraceError
    from hycoc.bundle import BundleError
    from hycoc.runtime.transport import TransportError

    try:
        cost = load_cost_model(cost_model) if cost_model is not None else None
        if server is not None:  # before recording: a server that is down is named at once
            check_server(server)
    except (CostModelError, LoadTestError) as e:
        raise _fail("loadtest", str(e)) from None
    bundle_dir = _bench_bundle("loadtest", cfg, recipe, bundle)
    try:
        run_recipe(cfg, recipe, bundle_dir, questions, plan, cost, REPO_ROOT)
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    except (LoadTestError, TraceError, BundleError, TransportError) as e:
        raise _fail("loadtest", str(e)) from None
