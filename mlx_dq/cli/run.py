"""Running a model: ``generate``, ``eval`` and ``perplexity``."""

from __future__ import annotations

import time
from typing import Callable

import click
import mlx.core as mx

from mlx_dq.cli.group import CONTEXT
from mlx_dq.data.eval_texts import EVAL_TEXTS
from mlx_dq.errors import InputError, MlxDqError

_EVALUATION_ROWS = (
    click.option("--text", "text_path", type=click.Path(), default=None,
                 help=f"Evaluation text: a name ({', '.join(EVAL_TEXTS)}) or a .txt/.jsonl file or folder "
                      "[default: pydoc]."),
    click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Number of token rows."),
    click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row."),
    click.option("--seed", default=0, show_default=True, type=int, help="Seed for choosing the rows."),
    click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1),
                 help="Rows per forward pass."),
)


def _evaluation_rows(f: Callable) -> Callable:
    """The evaluation text and rows options, the same for ``eval`` and ``perplexity`` (in this order)."""
    for option in reversed(_EVALUATION_ROWS):
        f = option(f)
    return f


def _evaluation_texts(text_path: str | None) -> tuple[list[str], str]:
    """The texts ``--text`` names and their description; a name or file that is not one is a bad --text."""
    from mlx_dq.data import calib

    try:
        return calib.resolve_eval_texts(text_path)
    except MlxDqError as e:
        raise click.BadParameter(str(e), param_hint="--text") from None


@click.command(context_settings=CONTEXT)
@click.option("--model", "model_dir", type=click.Path(exists=True, file_okay=False), required=True,
              help="An mlx-dq output folder (mixed or not).")
@click.option("--prompt", "-p", required=True, help="Prompt text ('-' reads it from standard input).")
@click.option("--max-tokens", "-m", default=100, show_default=True, type=click.IntRange(min=1),
              help="Most tokens to generate.")
@click.option("--temp", default=0.0, show_default=True, type=click.FloatRange(min=0.0), help="Sampling temperature.")
@click.option("--top-p", default=0.0, show_default=True, type=click.FloatRange(0.0, 1.0), help="Nucleus sampling.")
@click.option("--seed", default=None, type=int, help="Random seed for sampling.")
@click.option("--chat/--no-chat", default=True, show_default=True,
              help="Wrap the prompt in the tokenizer's chat template when it has one.")
def generate(model_dir: str, prompt: str, max_tokens: int, temp: float, top_p: float, seed: int | None,
             chat: bool) -> None:
    """Generate text with an mlx-dq folder through mlx_dq.load: no code from the folder is ever run.

    A thin wrapper over mlx-lm's generate; unlike mlx_lm.generate --trust-remote-code
    it never imports the file config.json's model_file names.
    """
    import mlx_lm
    from mlx_lm.sample_utils import make_sampler

    from mlx_dq.layers.kv_cache import generation_cache
    from mlx_dq.layers.mixed import memory_note
    from mlx_dq.loader import load

    if prompt == "-":
        prompt = _stdin_text()
    try:
        model, tokenizer = load(model_dir)
    except (MlxDqError, OSError) as e:
        raise click.ClickException(f"cannot load {model_dir}: {e}") from None
    if note := memory_note(model):  # on the CPU: what the mixed layers' float32 cache costs, how to avoid it
        click.echo(note, err=True)
    if seed is not None:
        mx.random.seed(seed)
    if chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    elif not prompt:  # mlx-lm cannot start from no tokens at all
        raise InputError("the prompt is empty: give some text with --prompt (or use the chat template, --chat)")
    mlx_lm.generate(model, tokenizer, prompt, verbose=True, max_tokens=max_tokens,
                    sampler=make_sampler(temp=temp, top_p=top_p), prompt_cache=generation_cache(model))


def _stdin_text() -> str:
    """Standard input as UTF-8 text; InputError naming the first byte that is not (binary input)."""
    import sys

    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--prompt -: standard input is not UTF-8 text (byte {e.start} cannot be decoded)") from None


@click.command(name="eval", context_settings=CONTEXT)
@click.argument("model")
@click.option("--base", default=None,
              help="Unquantized model to compare with [default: the source recorded in MODEL's mlx_dq.json].")
@_evaluation_rows
@click.option("--speed/--no-speed", default=True, show_default=True, help="Time a short generation (tokens/s).")
@click.option("--write/--no-write", default=True, show_default=True,
              help="Add a results block to MODEL's mlx_dq.json and its card when it has one (no other file is "
                   "written).")
def eval_(model: str, base: str | None, text_path: str | None, rows: int, seq_len: int, seed: int,
          batch_size: int, speed: bool, write: bool) -> None:
    """Evaluate MODEL (an output folder or a source): perplexity, KL divergence and top-1 vs BASE, size, speed."""
    from mlx_dq.conversion.writer import read_manifest
    from mlx_dq.data import calib
    from mlx_dq.evaluation import metrics as evaluate
    from mlx_dq.model.sources import load_model

    texts, source = _evaluation_texts(text_path)
    q, tokenizer, _, folder = evaluate.load_for_eval(model)
    base = base or (evaluate.manifest_base(folder) if folder is not None else None)
    base_model = load_model(base, dtype=mx.float32)[0] if base else None
    tokens = calib.sample_rows(tokenizer, texts, rows, seq_len, seed)
    t0 = time.perf_counter()
    result = evaluate.evaluate_model(q, tokens, base=base_model, batch_size=batch_size, folder=folder,
                                     tokenizer=tokenizer if speed else None, progress=True)
    result.update(text=source, text_digest=calib.text_digest(texts), seed=seed, base=base)
    click.echo(f"model: {model}" + (f"  (base: {base})" if base else "  (no base model: KL not computed)"))
    click.echo(f"text: {source} [digest {result['text_digest']}], {rows} rows x {seq_len} tokens, seed {seed}")
    click.echo(f"{result['evaluated_as']}; {time.perf_counter() - t0:.1f} s")
    click.echo(f"bits per weight: {result['bits_per_weight']:.4f} (codes + 16-bit scales/biases, 16-bit others)")
    size_kind = "on disk" if folder is not None else "stored"
    click.echo(f"size {size_kind}: {result['size_bytes'] / 1e6:.2f} MB")
    click.echo(f"perplexity: {result['perplexity']:.4f}")
    if base_model is not None:
        click.echo(f"base perplexity: {result['base_perplexity']:.4f}")
        click.echo(f"KL divergence: {result['kl']:.6f} nats (max {result['kl_max']:.4f})")
        click.echo(f"top-1 agreement: {result['top1']:.4f}")
    click.echo(f"forward: {result['tokens_per_s']:.0f} tokens/s")
    if "generation_tokens_per_s" in result:
        click.echo(f"generation: {result['generation_tokens_per_s']:.1f} tokens/s")
    if write and folder is not None and read_manifest(folder, missing_ok=True) is not None:
        block = evaluate.results_block(result, base_model, read_manifest(folder))
        click.echo(f"results written to {evaluate.write_results(folder, block)}")
        from mlx_dq.conversion.card import update_card

        click.echo(f"model card updated: {update_card(folder, read_manifest(folder))}")


@click.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@_evaluation_rows
def perplexity(model_spec: str, text_path: str | None, rows: int, seq_len: int, seed: int, batch_size: int) -> None:
    """Load a model in float32 and print its perplexity on evaluation text."""
    from mlx_dq.data import calib
    from mlx_dq.evaluation import metrics as evaluate
    from mlx_dq.model.sources import load_model

    texts, source = _evaluation_texts(text_path)
    t0 = time.perf_counter()
    model, tokenizer, _ = load_model(model_spec, dtype=mx.float32)
    t1 = time.perf_counter()
    tokens = calib.sample_rows(tokenizer, texts, rows, seq_len, seed)
    ppl = evaluate.perplexity(model, tokens, batch_size=batch_size, progress=True)
    t2 = time.perf_counter()
    click.echo(f"text: {source} [digest {calib.text_digest(texts)}], {rows} rows x {seq_len} tokens, seed {seed}")
    click.echo(f"load {t1 - t0:.1f} s, evaluate {t2 - t1:.1f} s (float32)")
    click.echo(f"perplexity: {ppl:.4f}")


COMMANDS = (generate, eval_, perplexity)
