"""The ``mlx_dq`` command line: thin click commands over the Python API."""

from __future__ import annotations

import time
from typing import Any

import click
import mlx.core as mx

CONTEXT = {"help_option_names": ["-h", "--help"]}
PENDING = {**CONTEXT, "ignore_unknown_options": True, "allow_extra_args": True}


def _not_available(name: str) -> None:
    """Say on stderr that a command is not available yet and exit with code 2."""
    click.echo(f"mlx_dq {name}: not available yet in this version of mlx-dq.", err=True)
    raise SystemExit(2)


def _parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of the mlx-lm model a config describes, from shapes only (no weights are computed)."""
    from mlx.utils import tree_flatten

    from mlx_dq.sources import build_model

    try:
        model = build_model(config)
    except ValueError:  # an architecture mlx-lm lacks: the count is unknown, not an error here
        return None
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@click.group(name="mlx_dq", context_settings=CONTEXT)
@click.version_option(package_name="mlx-dq", prog_name="mlx_dq")
def main() -> None:
    """mlx-dq: measurement-driven mixed-precision quantization for MLX."""


@main.command(context_settings=CONTEXT)
@click.argument("model")
def info(model: str) -> None:
    """Describe MODEL (HF folder, hub id, .gguf file or smollm2-135m) without loading its weights."""
    from mlx_dq.sources import resolve

    try:
        src = resolve(model)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    count = _parameter_count(src.config)
    click.echo(f"model:        {model}")
    click.echo(f"source:       {src.kind}")
    click.echo(f"architecture: {src.config.get('model_type', 'unknown')}")
    click.echo(f"layers:       {src.num_layers}")
    click.echo(f"parameters:   {count:,}" if count is not None else "parameters:   unknown")


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@click.option("--text", "text_path", type=click.Path(), default=None,
              help="Evaluation .txt/.jsonl file or folder [default: the bundled evaluation text].")
@click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Number of token rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for choosing the rows.")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1), help="Rows per forward pass.")
def perplexity(model_spec: str, text_path: str | None, rows: int, seq_len: int, seed: int, batch_size: int) -> None:
    """Load a model in float32 and print its perplexity on evaluation text."""
    from mlx_dq import calib, evaluate
    from mlx_dq.sources import load_model

    try:
        texts = calib.load_texts(text_path) if text_path else calib.default_eval_texts()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--text") from None
    t0 = time.perf_counter()
    try:
        model, tokenizer, _ = load_model(model_spec, dtype=mx.float32)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    t1 = time.perf_counter()
    try:
        tokens = calib.sample_rows(tokenizer, texts, rows, seq_len, seed)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    ppl = evaluate.perplexity(model, tokens, batch_size=batch_size, progress=True)
    t2 = time.perf_counter()
    source = text_path or "default evaluation text (pydoc_data.topics)"
    click.echo(f"text: {source} [digest {calib.text_digest(texts)}], {rows} rows x {seq_len} tokens, seed {seed}")
    click.echo(f"load {t1 - t0:.1f} s, evaluate {t2 - t1:.1f} s (float32)")
    click.echo(f"perplexity: {ppl:.4f}")


@main.command(context_settings=PENDING)
def measure() -> None:
    """Measure every tensor's error under each quantization option (not available yet)."""
    _not_available("measure")


@main.command(context_settings=CONTEXT)
@click.argument("measurement", type=click.Path(exists=True, dir_okay=False))
@click.option("--bpw", type=float, required=True, help="Bits-per-weight target for the decoder tensors.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="plan.json", show_default=True,
              help="Where to write the plan (JSON).")
@click.option("--mlx-lm-compatible", is_flag=True, help="Allow only whole-tensor options (stock mlx-lm loads them).")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Tensor name or glob kept in 16-bit (repeatable).")
@click.option("--keep-most-sensitive", type=click.IntRange(min=0), default=0,
              help="Keep the N most sensitive tensors of each part in 16-bit.")
@click.option("--head-option", default="1.0:6b_64g", show_default=True,
              help="Option for embedding and head, outside the budget ('budget': plan them with the rest).")
@click.option("--mlx-config", type=click.Path(dir_okay=False), default=None,
              help="Also write the plan as an MLX config (bits, group_size, mode, kept_16bit, tensors).")
def optimize(measurement: str, bpw: float, output: str, mlx_lm_compatible: bool, keep: tuple[str, ...],
             keep_most_sensitive: int, head_option: str, mlx_config: str | None) -> None:
    """Choose one option per tensor of MEASUREMENT for a bits-per-weight target with the least predicted damage."""
    from mlx_dq import measurement as meas
    from mlx_dq import optimize as opt

    try:
        m = meas.load_measurement(measurement)
        plan = opt.optimize(m, bpw, head_option=None if head_option == "budget" else head_option, keep=keep,
                            keep_most_sensitive=keep_most_sensitive or None, mlx_lm_compatible=mlx_lm_compatible)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    opt.save_plan(plan, output)
    if mlx_config:
        meas.write_json_atomic(opt.plan_to_mlx_config(plan), mlx_config)
    click.echo(f"target {plan.target_bpw:g} bpw: achieved {plan.achieved_bpw:.4f} bpw "
               f"({plan.used_bits:,} of {plan.budget_bits:,} bits), all tensors {plan.total_bpw:.4f} bpw")
    click.echo(f"objective {plan.objective:.6g}  lower bound {plan.lower_bound:.6g}  gap {plan.gap:.3g} "
               f"({100 * plan.gap / max(plan.objective, 1e-300):.3f}%)  kept 16-bit: {len(plan.kept)}")
    click.echo(f"plan written to {output} ({plan.wall_s:.2f} s)")


@main.command(context_settings=PENDING)
def convert() -> None:
    """Quantize a model to a bits-per-weight target and write an MLX folder (not available yet)."""
    _not_available("convert")


@main.command(context_settings=PENDING)
def inspect() -> None:
    """Print the per-layer bit map and accounting of a converted model (not available yet)."""
    _not_available("inspect")


@main.command(name="eval", context_settings=PENDING)
def eval_() -> None:
    """Evaluate a converted model: perplexity, KL divergence, size, speed (not available yet)."""
    _not_available("eval")
