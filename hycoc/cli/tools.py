"""``hycoc generate`` (the verifier alone), ``hycoc calibrate-handoff`` (the hand-off's int8 scales) and
``hycoc doctor`` (package versions, the QNN EP). torch and transformers are imported inside the bodies."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Optional

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
    from hycoc.recipe import RecipeError
    from hycoc.verifier.handoff_scales import measure_handoff_scales, toml_lines

    try:
        scales = measure_handoff_scales(cfg, prompts=prompts, max_new_tokens=max_new_tokens, percentile=percentile)
    except (RecipeError, ModelNotFoundError, ValueError) as e:
        raise _fail("calibrate-handoff", str(e)) from None
    typer.echo(toml_lines(scales, percentile, prompts))


def doctor() -> None:
    """Report package versions, whether the QNN EP loads, and which HTP archs it compiles for."""
    from hycoc.doctor import doctor_rows, render_doctor

    render_doctor(doctor_rows())  # the QNN EP check loads the plugin and compiles a trivial graph (child process)


class _TextStream:
    """A `model.generate` streamer that prints the answer to stdout and its thought (the reasoning channel) to stderr
    as tokens arrive (`hycoc.chat.AnswerStream`).

    transformers calls ``put`` first with the prompt ids (skipped), then with each new token, and ``end`` once.
    """

    def __init__(self, chat):
        from hycoc.chat import AnswerStream

        self.stream, self.prompt_seen = AnswerStream(chat), False

    @staticmethod
    def _show(pieces: tuple[str, str]) -> None:
        thought, text = pieces
        if thought:
            sys.stderr.write(thought)
            sys.stderr.flush()
        if text:
            sys.stdout.write(text)
            sys.stdout.flush()

    def put(self, value) -> None:
        if not self.prompt_seen:
            self.prompt_seen = True
            return
        self._show(self.stream.push(value.reshape(-1).tolist()))

    def end(self) -> None:
        self._show(self.stream.flush())
        sys.stdout.write("\n")
        sys.stdout.flush()


def generate(
    recipe: Path = RECIPE_ARG,
    dataset: Optional[Path] = typer.Option(
        None, help="Spec-Bench question JSONL (default: benchmarks/data/spec_bench_question.jsonl in the "
        "repository)", show_default=False),
    question_id: Optional[int] = typer.Option(
        None, help="Spec-Bench question_id whose first turn is the prompt (default: 81 unless --prompt)",
        show_default=False),
    prompt: Optional[str] = typer.Option(None, help="user message instead of a dataset question", show_default=False),
    max_new_tokens: Optional[int] = typer.Option(
        None, min=1, help="output cap in tokens (default: the recipe's sampling.max_new_tokens)", show_default=False),
    seed: Optional[int] = typer.Option(None, min=0, help="torch seed (default: the recipe's sampling.seed)",
                                       show_default=False),
    temperature: Optional[float] = typer.Option(
        None, min=0.0, help="sampling temperature, 0 = greedy (default: the recipe's sampling.temperature)",
        show_default=False),
    thinking: bool = typer.Option(
        False, "--thinking", help="let the model think first (the chat template's enable_thinking); the thought "
        "goes to stderr"),
) -> None:
    """Answer one question with the verifier alone (transformers generate, the recipe's sampling), streaming text.

    The question is wrapped in the chat template; top-k and top-p come from the recipe's sampling table.
    """
    from hycoc.bench.datasets import DatasetError, find_question, load_spec_bench

    if prompt is not None and question_id is not None:
        raise _fail("generate", "give at most one of --prompt and --question-id", code=2)
    cfg = _recipe("generate", recipe)
    _need_full("generate")
    if prompt is None:
        try:
            prompt = find_question(load_spec_bench(dataset or DEFAULT_DATASET), 81 if question_id is None else question_id).turns[0]
        except DatasetError as e:
            raise _fail("generate", str(e)) from None

    import torch

    from hycoc.chat import ChatFormatError
    from hycoc.chat_template import chat_from_recipe
    from hycoc.models import ModelNotFoundError, load_verifier, set_threads

    set_threads(cfg.verifier.threads)
    sampling = cfg.sampling
    temperature = sampling.temperature if temperature is None else temperature
    from hycoc.recipe import RecipeError

    try:
        chat = chat_from_recipe(cfg)      # the checkpoint's template and stop ids, before the weights
        prompt_ids = chat.prompt(prompt, thinking)
        model = load_verifier(cfg.model_path("verifier"), dtype=cfg.verifier.dtype, device=cfg.verifier.device)
    except (RecipeError, ModelNotFoundError, ChatFormatError) as e:
        raise _fail("generate", str(e)) from None

    typer.echo(f"[question] {prompt}", err=True)
    torch.manual_seed(sampling.seed if seed is None else seed)
    ids = torch.tensor([prompt_ids], device=cfg.verifier.device)  # (1, T)
    stops = list(chat.format.stop_ids)
    start = time.perf_counter()
    # p~ of Alg. 4 line 5 (temperature, top-k, top-p); below GREEDY_BELOW (1e-4) greedy, as the verifier.
    from hycoc.verifier.sampling import GREEDY_BELOW

    knobs = dict(do_sample=True, temperature=temperature, top_k=sampling.top_k, top_p=sampling.top_p) \
        if temperature >= GREEDY_BELOW else dict(do_sample=False)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens or sampling.max_new_tokens,
            eos_token_id=stops, pad_token_id=stops[0], streamer=_TextStream(chat), **knobs,
        )
    seconds = time.perf_counter() - start
    new = out.shape[1] - ids.shape[1]
    typer.echo(f"[{new} tokens in {seconds:.2f} s, {new / seconds:.1f} tok/s; prompt {ids.shape[1]} tokens]",
               err=True)
