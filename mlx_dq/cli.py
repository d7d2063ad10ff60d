"""The ``mlx_dq`` command line: thin click commands over the Python API."""

from __future__ import annotations

import time
from typing import Any

import click
import mlx.core as mx

CONTEXT = {"help_option_names": ["-h", "--help"]}


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


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@click.option("--calib", type=click.Path(), default=None,
              help="Calibration .txt/.jsonl file or folder [default: the bundled calibration text].")
@click.option("--rows", default=16, show_default=True, type=click.IntRange(min=1), help="Calibration rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for choosing the rows.")
@click.option("--grid", default=None, help="Option grid: a built-in name (default, fast) or a JSON file.")
@click.option("--importance", type=click.Choice(["residual", "kl", "none"]), default="residual", show_default=True,
              help="How errors are made comparable across tensors (kl needs the whole model in memory).")
@click.option("--method", type=click.Choice(["gptq", "rtn"]), default="gptq", show_default=True,
              help="Quantizer whose errors are measured: gptq (error compensation, what convert does by default) "
                   "or rtn (rounding; about 3x faster).")
@click.option("--clip/--no-clip", default=None,
              help="Measure with the per-group clip search [default: on with gptq, off with rtn].")
@click.option("--kl-scale/--no-kl-scale", default=True, show_default=True,
              help="Scale importance to KL divergence (a few perturbed copies carried to the logits) and measure "
                   "the head's options end to end.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True, help="Measurement JSON to write.")
@click.option("--no-resume", is_flag=True, help="Start over even if OUTPUT holds an unfinished measurement.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Also write the measurement's figures (PNG) into this folder.")
def measure(model_spec: str, calib: str | None, rows: int, seq_len: int, seed: int, grid: str | None,
            importance: str, method: str, clip: bool | None, kl_scale: bool, output: str, no_resume: bool,
            plot_dir: str | None) -> None:
    """Measure every tensor's error under each quantization option, one decoder layer at a time."""
    from mlx_dq.measure import measure as run_measure

    t0 = time.perf_counter()
    try:
        m = run_measure(model_spec, calib=calib, rows=rows, seq_len=seq_len, seed=seed, grid=grid,
                        out_path=output, resume=not no_resume, importance=importance, clip=clip,
                        method=method, kl_scale=kl_scale)
    except (ValueError, OSError) as e:
        raise click.ClickException(_rank_tag(str(e))) from None
    if not _is_root():  # under mlx.launch only rank 0 reports (and writes)
        return
    n_opts = sum(len(t.options) for t in m.tensors.values())
    click.echo(f"measured {len(m.tensors)} tensors x options = {n_opts} in {time.perf_counter() - t0:.1f} s "
               f"({rows} rows x {seq_len} tokens)")
    click.echo(f"base perplexity on the calibration rows: {m.base_perplexity:.4f}")
    click.echo(f"wrote {output}")
    if plot_dir:
        _write_plots(m, plot_dir, (2.5, 3.5, 4.5), 4.0, None)


def _write_plots(m: Any, out_dir: str, targets: tuple[float, ...], heatmap_at: float | str,
                 quality: str | None) -> None:
    """Write a measurement's figures as PNGs into ``out_dir`` and list them."""
    try:
        from mlx_dq import plots
    except ImportError as e:
        raise click.ClickException(f"plotting needs matplotlib ({e}): pip install 'mlx-dq[notebook]'") from None
    try:
        paths = plots.save_figures(m, out_dir, targets=targets, heatmap_at=heatmap_at, quality_csv=quality)
    except ValueError as e:
        raise click.ClickException(f"plotting failed: {e}") from None
    for path in paths:
        click.echo(f"wrote {path}")


@main.command(context_settings=CONTEXT)
@click.argument("measurement", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True, help="Folder for the PNG figures.")
@click.option("--targets", default="2.5,3.5,4.5", show_default=True,
              help="Comma-separated bits-per-weight targets for the optimizer's bit maps.")
@click.option("--heatmap-at", default="4.0", show_default=True,
              help="Error heat map at this bpw (nearest option per tensor) or at an option such as 1.0:4b_64g.")
@click.option("--quality", type=click.Path(dir_okay=False), default=None,
              help="Quality benchmark CSV (benchmarks/results/quality.csv) for the KL-vs-bpw figure.")
def plot(measurement: str, output: str, targets: str, heatmap_at: str, quality: str | None) -> None:
    """Draw MEASUREMENT's figures as PNGs: error vs bpw, error heat map, bit maps, and KL vs bpw from --quality."""
    from mlx_dq.measurement import load_measurement

    try:
        bpws = tuple(float(t) for t in targets.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {targets!r}", param_hint="--targets") from None
    try:
        at: float | str = float(heatmap_at)
    except ValueError:
        at = heatmap_at
    try:
        m = load_measurement(measurement)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    _write_plots(m, output, bpws, at, quality)


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


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@click.option("--bpw", type=float, default=None, help="Bits-per-weight target (all quantizable tensors by default).")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True, help="Output model folder.")
@click.option("--measurement", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Reuse a measurement (mlx-dq's or ExLlamaV2's) instead of measuring.")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Apply this plan as is (skips measuring and optimizing).")
@click.option("--mlx-lm-compatible", is_flag=True, help="Whole-tensor options only: loads in stock mlx-lm.")
@click.option("--promote-mixed", is_flag=True,
              help="Store mixed tensors (natural channel order) losslessly as uniform ones: stock-loadable, larger.")
@click.option("--head-option", default="budget", show_default=True,
              help="Option for embedding/head outside the budget, or 'budget' to plan them with the rest.")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Tensor name or glob kept in 16-bit (repeatable).")
@click.option("--calib", type=click.Path(exists=True), default=None, help="Calibration .txt/.jsonl file or folder.")
@click.option("--rows", default=32, show_default=True, type=click.IntRange(min=1), help="Calibration rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for the calibration rows.")
@click.option("--method", type=click.Choice(["gptq", "rtn"]), default="gptq", show_default=True,
              help="GPTQ error compensation, or round-to-nearest with clip search.")
@click.option("--no-sequential", is_flag=True, help="Feed each layer the unquantized model's activations.")
@click.option("--no-clip", is_flag=True, help="Turn the per-group clip search off.")
@click.option("--force", is_flag=True, help="Replace an existing output folder.")
def convert(model_spec: str, bpw: float | None, output: str, measurement: str | None, plan_path: str | None,
            mlx_lm_compatible: bool, promote_mixed: bool, head_option: str, keep: tuple[str, ...], calib: str | None, rows: int,
            seq_len: int, seed: int, method: str, no_sequential: bool, no_clip: bool, force: bool) -> None:
    """Quantize a model to a bits-per-weight target and write an MLX folder that mlx-lm loads."""
    from mlx_dq.convert import convert as run_convert

    if bpw is None and plan_path is None:
        raise click.UsageError("give --bpw (a target) or --plan (a plan file)")
    try:
        manifest = run_convert(
            model_spec, output, bpw=bpw, plan=plan_path, measurement=measurement,
            mlx_lm_compatible=mlx_lm_compatible, promote_mixed=promote_mixed,
            head_option=None if head_option == "budget" else head_option,
            keep=keep, calib=calib, rows=rows, seq_len=seq_len, seed=seed, method=method,
            sequential=not no_sequential, clip=not no_clip, force=force,
            measure_kwargs={"rows": rows, "seq_len": seq_len},
        )
    except (ValueError, FileExistsError, OSError) as e:
        raise click.ClickException(_rank_tag(str(e))) from None
    if not _is_root():  # under mlx.launch only rank 0 reports (and writes)
        return
    acc = manifest["accounting"]
    click.echo(f"wrote {output}: {acc['average_bits']:.4f} bpw planned tensors, {acc['average_bits_all']:.4f} bpw "
               f"all quantizable tensors, {acc['weights_on_disk_bytes'] / 2**20:.1f} MiB of weights, "
               f"{manifest['provenance']['quantization_seconds']:.0f} s")
    click.echo(f"load with: {manifest['loading']}")


@main.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("--width", default=5, show_default=True, type=click.IntRange(min=3), help="Characters per cell.")
def inspect(folder: str, width: int) -> None:
    """Print the per-layer bit map and the accounting of a converted model FOLDER."""
    from mlx_dq.report import bit_map, read_manifest

    try:
        manifest = read_manifest(folder)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    click.echo(bit_map(manifest, width=width))


@main.command(name="eval", context_settings=CONTEXT)
@click.argument("model")
@click.option("--base", default=None,
              help="Unquantized model to compare with [default: the source recorded in MODEL's mlx_dq.json].")
@click.option("--text", "text_path", type=click.Path(), default=None,
              help="Evaluation .txt/.jsonl file or folder [default: the bundled evaluation text].")
@click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Number of token rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for choosing the rows.")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1), help="Rows per forward pass.")
@click.option("--speed/--no-speed", default=True, show_default=True, help="Time a short generation (tokens/s).")
@click.option("--write/--no-write", default=True, show_default=True,
              help="Add a results block to MODEL's mlx_dq.json when it has one.")
def eval_(model: str, base: str | None, text_path: str | None, rows: int, seq_len: int, seed: int,
          batch_size: int, speed: bool, write: bool) -> None:
    """Evaluate MODEL (an output folder or a source): perplexity, KL divergence and top-1 vs BASE, size, speed."""
    from mlx_dq import calib, evaluate
    from mlx_dq.sources import load_model

    try:
        texts = calib.load_texts(text_path) if text_path else calib.default_eval_texts()
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--text") from None
    try:
        q, tokenizer, _, folder = evaluate.load_for_eval(model)
        base = base or (evaluate.manifest_base(folder) if folder is not None else None)
        base_model = load_model(base, dtype=mx.float32)[0] if base else None
        tokens = calib.sample_rows(tokenizer, texts, rows, seq_len, seed)
    except (ValueError, OSError) as e:
        raise click.ClickException(str(e)) from None
    t0 = time.perf_counter()
    result = evaluate.evaluate_model(q, tokens, base=base_model, batch_size=batch_size, folder=folder,
                                     tokenizer=tokenizer if speed else None, progress=True)
    source = text_path or "default evaluation text (pydoc_data.topics)"
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
    if write and folder is not None and evaluate.read_manifest(folder) is not None:
        block = evaluate.results_block(result, base_model, evaluate.read_manifest(folder))
        click.echo(f"results written to {evaluate.write_results(folder, block)}")


def _rank_tag(message: str) -> str:
    """``message`` naming this rank when several ranks run under ``mlx.launch``."""
    from mlx_dq.distributed import tag

    return tag(message)


def _is_root() -> bool:
    """True unless this process is a rank other than 0 under ``mlx.launch``."""
    from mlx_dq.distributed import is_root

    return is_root()
