"""``hycoc generate`` (the verifier alone), ``hycoc calibrate-handoff`` (the hand-off's int8 scales) and
``hycoc doctor`` (package versions, the QNN EP). torch and transformers are imported inside the bodies."""

from __future__ import annotations

from pathlib import Path

import typer

from hycoc.cli._common import DEFAULT_DATASET, RECIPE_ARG, _fail, _need_full, _recipe


def calibrate_handoff(
    recipe: Path = RECIPE_ARG,
    prompts: int = typer.Option(16, min=1, help="calibration prompts (the head QAT's prompt source)"),
    max_new_tokens: int = typer.Option(256, min=1, help="greedy answer tokens per prompt"),
    percentile: float = typer.Option(99.99, min=50.0, max=100.0, help="percentile of |x| that maps to int8 127"),
) -> None:
    """Measure the hand-off's six fixed int8 scales on the verifier's own answers; prints the scale_* lines.

    Replace the scale_* keys of the recipe's handoff table with them. Needs the recipe's verifier and tokenizer
    (and its head_qat.calibration_data or keep-set corpus for prompts).
    """
    cfg = _recipe("calibrate-handoff", recipe)
    _need_full("calibrate-handoff")
    from hycoc.models import ModelNotFoundError
    from hycoc.passes.handoff_scales import measure_handoff_scales, toml_lines
    from hycoc.recipe import RecipeError

    try:
        scales = measure_handoff_scales(cfg, prompts=prompts, max_new_tokens=max_new_tokens, percentile=percentile)
    except (RecipeError, ModelNotFoundError, ValueError) as e:
        raise _fail("calibrate-handoff", str(e)) from None
    typer.echo(toml_lines(scales, percentile, prompts))


def doctor() -> None:
    """Report package versions, whether the QNN EP loads, and which HTP archs it compiles for."""
    from hycoc.doctor import doctor_rows, render_doctor

    render_doctor(doctor_rows())  # the QNN EP check loads the plugin and compiles a trivial graph (child process)


def generate(
    recipe: Path = RECIPE_ARG,
    dataset: Path | None = typer.Option(
        None,
        help="Spec-Bench question JSONL (default: benchmarks/data/spec_bench_question.jsonl in the repository)",
        show_default=False,
    ),
    question_id: int | None = typer.Option(
        None,
        help="Spec-Bench question_id whose first turn is the prompt (default: 81 unless --prompt)",
        show_default=False,
    ),
    prompt: str | None = typer.Option(None, help="user message instead of a dataset question", show_default=False),
    max_new_tokens: int | None = typer.Option(
        None, min=1, help="output cap in tokens (default: the recipe's sampling.max_new_tokens)", show_default=False
    ),
    seed: int | None = typer.Option(
        None, min=0, help="torch seed (default: the recipe's sampling.seed)", show_default=False
    ),
    temperature: float | None = typer.Option(
        None,
        min=0.0,
        help="sampling temperature, 0 = greedy (default: the recipe's sampling.temperature)",
        show_default=False,
    ),
    thinking: bool = typer.Option(
        False,
        "--thinking",
        help="let the model think first (the chat template's enable_thinking); the thought goes to stderr",
    ),
) -> None:
    """Answer one question with the verifier alone (transformers generate, the recipe's sampling), streaming text.

    The question is wrapped in the chat template; top-k and top-p come from the recipe's sampling table.
    """
    from hycoc.bench.datasets import DatasetError, find_question, load_spec_bench

    if prompt is not None and question_id is not None:
        raise _fail("generate", "give at most one of --prompt and --question-id", code=2)
    if prompt is not None and not prompt.strip():
        raise _fail("generate", "--prompt is empty: give the text to answer (or --question-id N)", code=2)
    cfg = _recipe("generate", recipe)
    _need_full("generate")
    if prompt is None:
        try:
            prompt = find_question(
                load_spec_bench(dataset or DEFAULT_DATASET), 81 if question_id is None else question_id
            ).turns[0]
        except DatasetError as e:
            raise _fail("generate", str(e)) from None

    from hycoc.chat import ChatFormatError
    from hycoc.generate import generate_answer, summary_line
    from hycoc.models import ModelNotFoundError
    from hycoc.recipe import RecipeError

    try:
        done = generate_answer(
            cfg,
            prompt,
            max_new_tokens=max_new_tokens,
            seed=seed,
            temperature=temperature,
            thinking=thinking,
            say=lambda line: typer.echo(line, err=True),
        )
    except (RecipeError, ModelNotFoundError, ChatFormatError) as e:
        raise _fail("generate", str(e)) from None
    typer.echo(summary_line(done), err=True)
