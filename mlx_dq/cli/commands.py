"""The ``mlx_dq`` command line: thin click commands over the Python API."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click
import mlx.core as mx

from mlx_dq.errors import InputError, MlxDqError
from mlx_dq.names import MANIFEST_NAME, MANIFEST_SCHEMA
from mlx_dq.safety import WRITE_RULE
from mlx_dq.settings import (
    DTYPES,
    IMPORTANCE_MODES,
    METHODS,
    DistillSettings,
    MeasureSettings,
    PlanSettings,
    QuantizeSettings,
)

_M, _Q, _P = MeasureSettings(), QuantizeSettings(), PlanSettings()  # the defaults every option below shows
_D = DistillSettings()

CONTEXT = {"help_option_names": ["-h", "--help"]}


def _parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of the mlx-lm model a config describes, from shapes only (no weights are computed)."""
    from mlx.utils import tree_flatten

    from mlx_dq.model.sources import build_model

    try:
        model = build_model(config)
    except MlxDqError:  # an architecture mlx-lm lacks: the count is unknown, not an error here
        return None
    return sum(v.size for _, v in tree_flatten(model.parameters()))


class _Main(click.Group):
    """The command group; run as a program it first preloads OpenBLAS on Linux and records its arguments."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from mlx_dq.runtime.openblas import maybe_reexec

        maybe_reexec()
        return super().__call__(*args, **kwargs)

    def make_context(self, info_name: str | None, args: list[str], parent: click.Context | None = None,
                     **extra: Any) -> click.Context:
        argv = list(args)
        ctx = super().make_context(info_name, args, parent=parent, **extra)
        ctx.meta["mlx_dq.argv"] = argv  # the exact command, for model cards
        return ctx

    def invoke(self, ctx: click.Context) -> Any:
        """Run the command: the one place where an error becomes one ``Error: <message>`` line and exit status 1.

        An :class:`~mlx_dq.errors.MlxDqError` (a user's mistake, a damaged file) prints its message. An OSError is
        the system refusing a path the user gave (missing, permission denied, disk full): it prints as one line
        naming the file, as no command can say more. Anything else is a bug and keeps its traceback."""
        from mlx_dq.runtime.threads import env_workers

        try:
            env_workers()  # a bad MLX_DQ_THREADS fails now, not when the first layer's work is handed out
            return super().invoke(ctx)
        except MlxDqError as e:
            raise click.ClickException(_rank_tag(str(e))) from None
        except OSError as e:
            raise click.ClickException(_rank_tag(_os_error_line(e))) from None


def _os_error_line(e: OSError) -> str:
    """An OSError as one line that names its file(s): ``out/model.safetensors: No space left on device``."""
    if e.filename is None or not e.strerror:
        return str(e)
    return f"{e.filename}" + (f" -> {e.filename2}" if e.filename2 else "") + f": {e.strerror}"


def _command_line(ctx: click.Context) -> str:
    """The ``mlx_dq ...`` command line that is running, shell-quoted."""
    import shlex

    return shlex.join(["mlx_dq", *ctx.find_root().meta.get("mlx_dq.argv", [])])


@click.group(name="mlx_dq", cls=_Main, context_settings=CONTEXT)
@click.version_option(package_name="mlx-dq", prog_name="mlx_dq")
@click.pass_context
def main(ctx: click.Context) -> None:
    """mlx-dq: measurement-driven mixed-precision quantization for MLX."""
    from mlx_dq.safety import cli_messages

    ctx.with_resource(cli_messages())  # messages name options as typed here (--force), not as arguments


@main.command(context_settings=CONTEXT)
@click.argument("model")
def info(model: str) -> None:
    """Describe MODEL (HF folder, hub id, .gguf file or smollm2-135m) without loading its weights."""
    from mlx_dq.model.sources import resolve

    src = resolve(model)
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
              help="Evaluation text: a name (pydoc, shakespeare, dialog) or a .txt/.jsonl file or folder [default: pydoc].")
@click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Number of token rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for choosing the rows.")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1), help="Rows per forward pass.")
def perplexity(model_spec: str, text_path: str | None, rows: int, seq_len: int, seed: int, batch_size: int) -> None:
    """Load a model in float32 and print its perplexity on evaluation text."""
    from mlx_dq.data import calib
    from mlx_dq.evaluation import metrics as evaluate
    from mlx_dq.model.sources import load_model

    try:
        texts, source = calib.resolve_eval_texts(text_path)
    except MlxDqError as e:
        raise click.BadParameter(str(e), param_hint="--text") from None
    t0 = time.perf_counter()
    model, tokenizer, _ = load_model(model_spec, dtype=mx.float32)
    t1 = time.perf_counter()
    tokens = calib.sample_rows(tokenizer, texts, rows, seq_len, seed)
    ppl = evaluate.perplexity(model, tokens, batch_size=batch_size, progress=True)
    t2 = time.perf_counter()
    click.echo(f"text: {source} [digest {calib.text_digest(texts)}], {rows} rows x {seq_len} tokens, seed {seed}")
    click.echo(f"load {t1 - t0:.1f} s, evaluate {t2 - t1:.1f} s (float32)")
    click.echo(f"perplexity: {ppl:.4f}")


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@click.option("--calib", type=click.Path(), default=None,
              help="Calibration .txt/.jsonl file or folder [default: the bundled calibration text].")
@click.option("--rows", default=_M.rows, show_default=True, type=click.IntRange(min=1), help="Calibration rows.")
@click.option("--seq-len", default=_M.seq_len, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=_M.seed, show_default=True, type=int, help="Seed for choosing the rows.")
@click.option("--grid", default=_M.grid, help="Option grid: a built-in name (default, fast) or a JSON file.")
@click.option("--importance", type=click.Choice(IMPORTANCE_MODES), default=_M.importance, show_default=True,
              help="How errors are made comparable across tensors (kl needs the whole model in memory).")
@click.option("--method", type=click.Choice(METHODS), default=_M.method, show_default=True,
              help="Quantizer whose errors are measured: gptq (error compensation, what convert does by default) "
                   "or rtn (rounding; about 3x faster).")
@click.option("--clip/--no-clip", default=_M.clip,
              help="Measure with the clip candidates in the scale search [default: off; convert clips either way].")
@click.option("--kl-scale/--no-kl-scale", default=_M.kl_scale, show_default=True,
              help="Scale importance to KL divergence (a few perturbed copies carried to the logits) and measure "
                   "the head's options end to end.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help=f"Measurement JSON to write (its resume state beside it, OUTPUT.state.safetensors). {WRITE_RULE}")
@click.option("--no-resume", is_flag=True, help="Start over even if OUTPUT holds an unfinished measurement.")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), default=None,
              help="Also write the measurement's figures (PNG) into this folder.")
@click.option("--force", is_flag=True,
              help="Start over and replace OUTPUT when it is a measurement made with other settings (implies "
                   "--no-resume); a file that is not a measurement is never replaced.")
@click.option("--sample-rows", default=_M.sample_rows, show_default=True, type=click.IntRange(min=0),
              help="Measure each linear layer's options on this many random output rows (0: all rows).")
@click.option("--estimate", is_flag=True, help="Print the predicted time, peak memory and disk, and exit.")
@click.option("--flops", type=float, default=None, help="With --estimate: this float32 FLOP/s instead of timing one.")
def measure(model_spec: str, calib: str | None, rows: int, seq_len: int, seed: int, grid: str | None,
            importance: str, method: str, clip: bool | None, kl_scale: bool, output: str, no_resume: bool,
            plot_dir: str | None, force: bool = False, sample_rows: int = 0, estimate: bool = False,
            flops: float | None = None) -> None:
    """Measure every tensor's error under each quantization option, one decoder layer at a time."""
    from mlx_dq.measure.stream import measure as run_measure

    cost = dict(rows=rows, seq_len=seq_len, grid=grid, method=method, kl_scale=kl_scale and importance == "residual",
                sample_rows=sample_rows, clip=bool(clip))
    if estimate:
        _print_estimate(model_spec, flops, "measure", **cost)
        return
    t0 = time.perf_counter()
    _announce(model_spec, "measure", **cost)
    _check_measure_outputs(output, plot_dir, [("calibration text", calib), ("grid", grid),
                                              ("model", _source_path(model_spec))])
    m = run_measure(model_spec, calib=calib, rows=rows, seq_len=seq_len, seed=seed, grid=grid,
                    out_path=output, resume=not (no_resume or force), importance=importance, clip=clip,
                    method=method, kl_scale=kl_scale, sample_rows=sample_rows)
    if not _is_root():  # under mlx.launch only rank 0 reports (and writes)
        return
    n_opts = sum(len(t.options) for t in m.tensors.values())
    click.echo(f"measured {len(m.tensors)} tensors x options = {n_opts} in {time.perf_counter() - t0:.1f} s "
               f"({rows} rows x {seq_len} tokens)")
    n_imp = (m.extra.get("importance") or {}).get("rows", rows)
    click.echo(f"base perplexity on the first {n_imp} calibration rows: {m.base_perplexity:.4f}")
    click.echo(f"wrote {output}")
    if plot_dir:
        _write_plots(m, plot_dir, (2.5, 3.5, 4.5), 4.0, None)


def _source_path(model_spec: str | None) -> Any:
    """Where a model spec's files are (its folder or file), or None when it cannot be found (the run says why)."""
    if model_spec is None:
        return None
    if Path(model_spec).exists():
        return model_spec
    from mlx_dq.model.sources import resolve

    try:
        return resolve(model_spec).path
    except (ValueError, OSError):
        return None


def _is_measurement(path: Any) -> bool:
    """Whether ``path`` holds an mlx-dq measurement (an earlier one may be resumed or replaced)."""
    from mlx_dq.formats import json_kind

    return json_kind(path) in ("mlx_dq", "mlx_dq.measurement")


def _check_measure_outputs(output: str, plot_dir: str | None, inputs: list) -> None:
    """Refuse measure's outputs (the file, its resume state, the figures) where they would replace an input or a
    file mlx-dq did not write, before any work."""
    from mlx_dq.safety import guard_output_file

    guard_output_file(output, "-o/--output", inputs=inputs, kind="a measurement", is_kind=_is_measurement)
    guard_output_file(str(output) + ".state.safetensors", "-o/--output's resume state", inputs=inputs,
                      kind="a measurement's resume state", is_kind=_is_measure_state)
    if plot_dir is not None:
        from mlx_dq.evaluation.plots import guard_figures

        guard_figures(plot_dir, [*inputs, ("measurement", output)])


def _is_measure_state(path: Any) -> bool:
    """Whether ``path`` is a resume state that measure wrote (safetensors whose metadata records its settings)."""
    import json

    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(min(n, 1 << 24)))
        return "settings" in (header.get("__metadata__") or {})
    except (OSError, ValueError, AttributeError):
        return False


def _is_plan(path: str) -> bool:
    """Whether ``path`` holds a valid mlx_dq plan (an earlier plan may be replaced)."""
    from mlx_dq.plan.optimize import load_plan

    try:
        load_plan(path)
        return True
    except ValueError:
        return False


def _check_optimize_outputs(measurement: str, output: str, mlx_config: str | None,
                            exl2_report: str | None = None, model_spec: str | None = None) -> None:
    """Refuse outputs that would overwrite an input (the measurement, the model's folder), each other, a file
    mlx-dq did not write as that kind, or cannot be written."""
    from mlx_dq.formats import json_kind
    from mlx_dq.safety import csv_with_header, guard_output_file

    inputs = [("measurement", measurement), ("model", _source_path(model_spec))]
    guard_output_file(output, "-o/--output", inputs=inputs, kind="a plan", is_kind=_is_plan)
    if mlx_config is not None:
        guard_output_file(mlx_config, "--mlx-config", inputs=inputs, others=[("-o/--output", output)],
                          kind="an MLX config", is_kind=lambda p: json_kind(p) == "mlx_kept16")
    if exl2_report is not None:
        guard_output_file(exl2_report, "--exl2-report", inputs=inputs,
                          others=[("-o/--output", output), ("--mlx-config", mlx_config)],
                          kind="an EXL2 report", is_kind=csv_with_header("tensor"))


def _unmeasured_note(m: Any, plan: Any) -> str:
    """What an unfinished measurement leaves out, and the whole model's bpw when every unmeasured tensor stays 16-bit."""
    import math

    from mlx_dq.conversion.resolve import model_shapes
    from mlx_dq.model.sources import resolve

    n = (m.model or {}).get("num_layers")
    done = (m.last_module_idx if m.last_module_idx is not None else -1) + 1
    note = (f"the measurement is unfinished: {done} of {n if n is not None else '?'} layers measured; tensors "
            "not measured (later layers, embedding, head) are not in the plan and stay 16-bit")
    try:
        shapes = model_shapes(resolve(str(m.model["spec"])).config)
    except (KeyError, TypeError, ValueError, OSError):
        return note + "; the model cannot be found to count them: the figures cover the measured tensors only"
    planned = {e.key for e in plan.tensors}
    rest = [k for k in shapes if k not in planned and k not in m.tied]
    numel = sum(e.numel for e in plan.tensors)
    bits = sum(e.bits for e in plan.tensors) + sum(16 * math.prod(shapes[k]) for k in rest)
    numel += sum(math.prod(shapes[k]) for k in rest)
    return note + f"; whole model: {bits / numel:.4f} bpw ({len(rest)} tensors not measured)"


def _write_plots(m: Any, out_dir: str, targets: tuple[float, ...], heatmap_at: float | str,
                 quality: str | None) -> None:
    """Write a measurement's figures as PNGs into ``out_dir`` and list them."""
    try:
        from mlx_dq.evaluation import plots
    except ImportError as e:
        raise click.ClickException(f"plotting needs matplotlib, a dependency of mlx-dq ({e}): pip install matplotlib") from None
    try:
        paths = plots.save_figures(m, out_dir, targets=targets, heatmap_at=heatmap_at, quality_csv=quality)
    except MlxDqError as e:
        raise click.ClickException(f"plotting failed: {e}") from None
    for path in paths:
        click.echo(f"wrote {path}")


@main.command(context_settings=CONTEXT)
@click.argument("measurement", type=click.Path(exists=True, dir_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help=f"Folder for the PNG figures (earlier mlx-dq figures there are replaced). {WRITE_RULE}")
@click.option("--targets", default="2.5,3.5,4.5", show_default=True,
              help="Comma-separated bits-per-weight targets for the optimizer's bit maps.")
@click.option("--heatmap-at", default="4.0", show_default=True,
              help="Error heat map at this bpw (nearest option per tensor) or at an option such as 1.0:4b_64g.")
@click.option("--quality", type=click.Path(dir_okay=False), default=None,
              help="Quality benchmark CSV (benchmarks/results/quality.csv) for the KL-vs-bpw figure.")
def plot(measurement: str, output: str, targets: str, heatmap_at: str, quality: str | None) -> None:
    """Draw MEASUREMENT's figures as PNGs: error vs bpw, error heat map, bit maps, and KL vs bpw from --quality."""
    from mlx_dq.measure.records import load_measurement

    try:
        bpws = tuple(float(t) for t in targets.split(",") if t.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {targets!r}", param_hint="--targets") from None
    try:
        at: float | str = float(heatmap_at)
    except ValueError:
        at = heatmap_at
    try:
        from mlx_dq.evaluation.plots import guard_figures

        guard_figures(output, [("measurement", measurement), ("quality CSV", quality)])
        m = load_measurement(measurement)
    except ImportError as e:
        raise click.ClickException(f"plotting needs matplotlib, a dependency of mlx-dq ({e}): pip install matplotlib") from None
    _write_plots(m, output, bpws, at, quality)


@main.command(context_settings=CONTEXT)
@click.argument("measurement", type=click.Path(exists=True, dir_okay=False))
@click.option("--bpw", type=float, required=True, help="Bits-per-weight target for the decoder tensors.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="plan.json", show_default=True,
              help=f"Where to write the plan (JSON); an earlier plan there is replaced. {WRITE_RULE}")
@click.option("--mlx-lm-compatible", is_flag=True, help="Allow only whole-tensor options (stock mlx-lm loads them).")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Tensor name or glob kept in 16-bit (repeatable).")
@click.option("--keep-most-sensitive", multiple=True, metavar="N|PART=N",
              help="Keep the N most sensitive tensors of each part in 16-bit: one N for every part, or PART=N per "
                   "part (repeatable); ties within a jointly measured module go by each tensor's measured damage.")
@click.option("--part", "parts", multiple=True, metavar="NAME=PATTERN[,PATTERN]",
              help="Define a part for --keep-most-sensitive by name patterns (repeatable; tensors of no part are "
                   "never kept by the rule) [default: backbone = decoder layers, else the first name component].")
@click.option("--keep-outside-budget", is_flag=True,
              help="Kept 16-bit tensors do not count against the bpw target (they still count in 'all tensors').")
@click.option("--head-option", default="1.0:6b_64g", show_default=True,
              help="Option for embedding and head, outside the budget ('budget': plan them with the rest).")
@click.option("--model", "model_spec", default=None,
              help="Model (spec, folder or config.json) whose embedding/head a measurement lacks (ExLlamaV2 "
                   "files): they get --head-option (16-bit with 'budget') and the printed bpw is the whole model's.")
@click.option("--exl2-map", type=click.Choice(["storage", "layout", "uniform"]), default="storage", show_default=True,
              help="How ExLlamaV2 options map to MLX: nearest storage cost, EXL2's own group sizes, or one "
                   "whole-tensor width per option (stock-loadable plans with --mlx-lm-compatible).")
@click.option("--exl2-report", type=click.Path(dir_okay=False), default=None,
              help="Write a CSV of every planned tensor's EXL2 option and bpw beside its MLX option and bpw.")
@click.option("--mlx-config", type=click.Path(dir_okay=False), default=None,
              help="Also write the plan as an MLX config (bits, group_size, mode, kept_16bit, tensors).")
@click.option("--force", is_flag=True, hidden=True,
              help="No effect (kept for older scripts): only files mlx-dq wrote of the same kind are replaced.")
@click.option("--allow-incomplete", is_flag=True,
              help="Plan from an unfinished measurement (unmeasured tensors stay 16-bit).")
def optimize(measurement: str, bpw: float, output: str, mlx_lm_compatible: bool, keep: tuple[str, ...],
             keep_most_sensitive: tuple[str, ...], parts: tuple[str, ...], keep_outside_budget: bool,
             head_option: str, model_spec: str | None, exl2_map: str, exl2_report: str | None,
             mlx_config: str | None, force: bool, allow_incomplete: bool) -> None:
    """Choose one option per tensor of MEASUREMENT for a bits-per-weight target with the least predicted damage."""
    from mlx_dq.formats import exl2
    from mlx_dq.measure import records as meas
    from mlx_dq.plan import keeprules
    from mlx_dq.plan import optimize as opt

    head = None if head_option == "budget" else head_option
    _check_optimize_outputs(measurement, output, mlx_config, exl2_report, model_spec)
    part_map = keeprules.parse_parts(parts)
    counts = keeprules.parse_keep_counts(keep_most_sensitive)
    keeprules.check_parts(counts, part_map)
    _not_another_form(measurement)
    m = meas.load_measurement(measurement, exl2_map=exl2_map)
    if not meas.measurement_complete(m) and not allow_incomplete:
        raise InputError(
            f"the measurement {measurement} is unfinished (measured up to layer {m.last_module_idx}): resume "
            "it by running the same measure command again, or pass --allow-incomplete"
        )
    plan = opt.optimize(m, bpw, head_option=head, keep=keep, keep_most_sensitive=counts, parts=part_map,
                        mlx_lm_compatible=mlx_lm_compatible, keep_outside_budget=keep_outside_budget)
    measured_heads = any(exl2.is_head(k) for k in m.tensors)
    if model_spec and not measured_heads:
        from mlx_dq.formats.common import modules_for

        exl2.complete_head(plan, modules_for(model_spec)[0], head)
    notes = [] if meas.measurement_complete(m) else [_unmeasured_note(m, plan)]
    if mlx_config:
        meas.write_json_atomic(opt.plan_to_mlx_config(plan), mlx_config)
    try:
        opt.save_plan(plan, output)
    except OSError:
        if mlx_config:
            Path(mlx_config).unlink(missing_ok=True)
        raise
    for note in notes:
        click.echo(f"note: {note}")
    click.echo(f"target {plan.target_bpw:g} bpw: achieved {plan.achieved_bpw:.4f} bpw "
               f"({plan.used_bits:,} of {plan.budget_bits:,} bits), all tensors {plan.total_bpw:.4f} bpw")
    note = exl2.head_note(plan, measured_heads)
    if note:
        click.echo(note)
    if m.source_format.startswith("exl2"):
        rows = exl2.mapping_report(m, plan)
        click.echo(exl2.mapping_summary(rows) + f" (--exl2-map {exl2_map})")
        if exl2_report:
            _write_csv(rows, exl2_report)
            click.echo(f"per-tensor EXL2 vs MLX bpw written to {exl2_report}")
    click.echo(f"objective {plan.objective:.6g}  lower bound {plan.lower_bound:.6g}  gap {plan.gap:.3g} "
               f"({100 * plan.gap / max(plan.objective, 1e-300):.3f}%)  kept 16-bit: {len(plan.kept)}")
    click.echo(f"plan written to {output} ({plan.wall_s:.2f} s)")


@main.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@click.option("--bpw", type=float, default=_P.bpw, help="Bits-per-weight target (all quantizable tensors by default).")
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help=f"Output model folder. {WRITE_RULE}")
@click.option("--measurement", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Reuse a measurement (mlx-dq's or ExLlamaV2's) instead of measuring.")
@click.option("--plan", "plan_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Apply this plan as is (skips measuring and optimizing): an mlx_dq plan, a dynquant manifest "
                   "or an MLX config with kept_16bit (names mapped onto the model; unmapped ones listed).")
@click.option("--mlx-lm-compatible", is_flag=True, help="Whole-tensor options only: loads in stock mlx-lm.")
@click.option("--frequent-rows/--no-frequent-rows", default=_P.frequent_rows, show_default=True,
              help="Store an embedding's rows of the calibration text's tokens two widths finer, their bits taken "
                   "from the rest of the budget (off: one option per embedding).")
@click.option("--promote-mixed", is_flag=True,
              help="Store mixed tensors (natural channel order) losslessly as uniform ones: stock-loadable, larger.")
@click.option("--head-option", default="budget", show_default=True,
              help="Option for embedding/head outside the budget, or 'budget' to plan them with the rest.")
@click.option("--keep", multiple=True, metavar="PATTERN", help="Tensor name or glob kept in 16-bit (repeatable).")
@click.option("--keep-outside-budget", is_flag=True, help="Kept 16-bit tensors do not count against --bpw.")
@click.option("--calib", type=click.Path(exists=True), default=_Q.calib, help="Calibration .txt/.jsonl file or folder.")
@click.option("--rows", default=_Q.rows, show_default=True, type=click.IntRange(min=1), help="Calibration rows.")
@click.option("--seq-len", default=_Q.seq_len, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=_Q.seed, show_default=True, type=int, help="Seed for the calibration rows.")
@click.option("--method", type=click.Choice(METHODS), default=_Q.method, show_default=True,
              help="GPTQ error compensation, or round-to-nearest with clip search.")
@click.option("--no-sequential", is_flag=True, help="Feed each layer the unquantized model's activations.")
@click.option("--no-clip", is_flag=True, help="Turn the per-group clip search off.")
@click.option("--force", is_flag=True,
              help="Replace an existing output folder: only an earlier mlx-dq output holding nothing but its own "
                   "files, never one holding an input.")
@click.option("--dtype", type=click.Choice(DTYPES), default=_Q.dtype, show_default=True,
              help="Dtype of scales, biases and 16-bit tensors (auto: the source's; bfloat16 needs --method rtn).")
@click.option("--upload-repo", default=None, metavar="USER/NAME",
              help="Upload the finished folder to this Hugging Face repo (network and token checked first).")
@click.option("--allow-incomplete", is_flag=True,
              help="Use an unfinished --measurement (unmeasured tensors stay 16-bit).")
@click.option("--allow-other-model", is_flag=True,
              help="Use a --measurement or --plan made for another model with the same tensor names and shapes.")
@click.option("--distill", is_flag=True,
              help="Then distil the quantized scales and biases against the source's logits (codes fixed) "
                   "before the folder is published; calibration text and seed as for quantizing.")
@click.option("--distill-rows", type=click.IntRange(min=1), default=None,
              help=f"With --distill: calibration rows [default: {_D.rows}].")
@click.option("--distill-seq-len", type=click.IntRange(min=3), default=None,
              help=f"With --distill: tokens per row [default: {_D.seq_len}].")
@click.option("--distill-steps", type=click.IntRange(min=1), default=None,
              help=f"With --distill: optimizer steps [default: {_D.steps}].")
@click.option("--distill-lr", type=click.FloatRange(min=0, min_open=True), default=None,
              help=f"With --distill: Adam learning rate, relative to each scale [default: {_D.lr:g}].")
@click.option("--estimate", is_flag=True, help="Print the predicted time, peak memory and disk, and exit.")
@click.option("--flops", type=float, default=None, help="With --estimate: this float32 FLOP/s instead of timing one.")
@click.pass_context
def convert(ctx: click.Context, model_spec: str, bpw: float | None, output: str, measurement: str | None,
            plan_path: str | None, mlx_lm_compatible: bool, frequent_rows: bool, promote_mixed: bool,
            head_option: str,
            keep: tuple[str, ...], keep_outside_budget: bool, calib: str | None, rows: int, seq_len: int, seed: int,
            method: str, no_sequential: bool, no_clip: bool, force: bool, dtype: str, upload_repo: str | None,
            allow_incomplete: bool, allow_other_model: bool, distill: bool = False, distill_rows: int | None = None,
            distill_seq_len: int | None = None, distill_steps: int | None = None, distill_lr: float | None = None,
            estimate: bool = False, flops: float | None = None) -> None:
    """Quantize a model to a bits-per-weight target and write an MLX folder that mlx-lm loads.

    The folder is built in a hidden sibling, .OUTPUT.partial-PID, and renamed
    into place when complete; a run that is killed leaves that folder behind,
    and the next convert into the same parent folder removes it.
    """
    from mlx_dq.conversion.hub import check_upload_ready
    from mlx_dq.conversion.pipeline import convert as run_convert
    from mlx_dq.quant.options import QuantOption
    from mlx_dq.safety import check_bpw

    if bpw is None and plan_path is None:
        raise click.UsageError("give --bpw (a target) or --plan (a plan file)")
    if plan_path is not None:
        given = [flag for flag, on in (("--bpw", bpw is not None), ("--measurement", measurement is not None),
                                       ("--keep", bool(keep)), ("--mlx-lm-compatible", mlx_lm_compatible),
                                       ("--no-frequent-rows", not frequent_rows),
                                       ("--head-option", head_option != "budget"),
                                       ("--keep-outside-budget", keep_outside_budget)) if on]
        if given:
            raise click.UsageError(f"--plan is applied as is: {', '.join(given)} would be ignored; "
                                   "give either --plan or a target (--bpw) with its planning options")
    if bpw is not None:
        try:
            check_bpw(bpw)
        except MlxDqError as e:
            raise click.BadParameter(str(e), param_hint="--bpw") from None
    if head_option != "budget":
        try:
            QuantOption.parse(head_option)
        except MlxDqError as e:
            raise click.BadParameter(str(e), param_hint="--head-option") from None
    d_settings = _distill_settings(distill, calib, seed, rows=distill_rows, seq_len=distill_seq_len,
                                   steps=distill_steps, lr=distill_lr)
    cost = dict(bpw=bpw, rows=rows, seq_len=seq_len, method=method, distill=d_settings,
                measure_first=measurement is None and plan_path is None,
                measure_kwargs={"rows": rows, "seq_len": seq_len},
                measurement_bytes=Path(measurement).stat().st_size if measurement else None)
    if estimate:
        _print_estimate(model_spec, flops, "convert", **cost)
        return
    _announce(model_spec, "convert", **cost)
    if upload_repo is not None:
        check_upload_ready(upload_repo)  # before any work: a long conversion must not end in "offline"
    manifest = run_convert(
        model_spec, output, bpw=bpw, plan=plan_path, measurement=measurement,
        mlx_lm_compatible=mlx_lm_compatible, promote_mixed=promote_mixed, frequent_rows=frequent_rows,
        head_option=None if head_option == "budget" else head_option,
        keep=keep, keep_outside_budget=keep_outside_budget, calib=calib, rows=rows, seq_len=seq_len, seed=seed,
        method=method,
        sequential=not no_sequential, clip=not no_clip, force=force, dtype=dtype,
        command=_command_line(ctx), card_ref=upload_repo,
        allow_incomplete=allow_incomplete, allow_other_model=allow_other_model, distill=d_settings,
    )
    if not _is_root():  # under mlx.launch only rank 0 reports (and writes)
        return
    acc = manifest["accounting"]
    for note in manifest["provenance"].get("checks", []):
        click.echo(f"note: {note}")
    planned = f"{acc['average_bits']:.4f}" if acc["average_bits"] is not None else "no"
    click.echo(f"wrote {output}: {acc['average_bits_all']:.4f} bpw whole model (all quantizable tensors), "
               f"{planned} bpw planned budget tensors, {acc['weights_on_disk_bytes'] / 2**20:.1f} MiB of weights, "
               f"{manifest['provenance']['quantization_seconds']:.0f} s")
    _convert_notes(output, manifest)
    click.echo(f"load with: {manifest['loading']}")
    if upload_repo is not None:
        _upload(output, upload_repo, private=False, after_convert=True)


def _distill_settings(distill: bool, calib: str | None, seed: int, **given: Any) -> DistillSettings | None:
    """convert's --distill and --distill-* options as settings (None without --distill; its options then refused)."""
    given = {k: v for k, v in given.items() if v is not None}
    if given and not distill:
        raise click.UsageError(", ".join(f"--distill-{k.replace('_', '-')}" for k in given)
                               + " would be ignored without --distill")
    from mlx_dq.conversion.pipeline import distill_settings

    return distill_settings(given or True, QuantizeSettings(calib=calib, seed=seed)) if distill else None


@main.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True))
@click.option("--width", default=5, show_default=True, type=click.IntRange(min=3), help="Characters per cell.")
def inspect(folder: str, width: int) -> None:
    """Print the per-layer bit map and the accounting of a converted model FOLDER, after checking it is whole,
    or summarize a file: plan, manifest, measurement, dynquant manifest, MLX config with kept_16bit or dashq record.

    The folder check is quick: files present with their recorded sizes, weight headers, config.json; it
    does not read the weights (`mlx_dq verify` compares every weight file with its recorded sha256)."""
    from mlx_dq.conversion.report import bit_map, check_folder, read_manifest

    if not Path(folder).is_dir():
        from mlx_dq.conversion.report import describe

        click.echo(describe(folder))
        return
    manifest = read_manifest(folder)
    problems = check_folder(folder, manifest)
    if problems:
        raise click.ClickException(f"{folder} does not match its manifest: " + "; ".join(problems[:5])
                                   + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    click.echo(bit_map(manifest, width=width))
    click.echo("checked: files and sizes, weight headers, config.json (not the weights' sha256: "
               f"`mlx_dq verify {folder}` checks those)")


@main.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help=f"Output model folder. {WRITE_RULE}")
@click.option("--model", "model_spec", default=None,
              help="Source (float) model to distil from [default: the source recorded in FOLDER's manifest].")
@click.option("--calib", type=click.Path(exists=True), default=None,
              help="Calibration .txt/.jsonl file or folder [default: the bundled calibration text].")
@click.option("--rows", default=_D.rows, show_default=True, type=click.IntRange(min=1), help="Calibration rows.")
@click.option("--seq-len", default=_D.seq_len, show_default=True, type=click.IntRange(min=3), help="Tokens per row.")
@click.option("--steps", default=_D.steps, show_default=True, type=click.IntRange(min=1), help="Optimizer steps.")
@click.option("--batch-size", default=_D.batch_size, show_default=True, type=click.IntRange(min=1),
              help="Rows per step (at most --rows).")
@click.option("--lr", default=_D.lr, show_default=True, type=click.FloatRange(min=0, min_open=True),
              help="Adam learning rate, relative to each scale (cosine decay to a tenth).")
@click.option("--seed", default=_D.seed, show_default=True, type=int, help="Seed for the rows and their order.")
@click.option("--temperature", default=_D.temperature, show_default=True,
              type=click.FloatRange(min=0, min_open=True), help="Softmax temperature of the KL loss.")
@click.option("--train-norms", is_flag=True, help="Also train the norm weights.")
@click.option("--force", is_flag=True,
              help="Replace an existing output folder: only an earlier mlx-dq output holding nothing but its own "
                   "files, never one holding an input.")
def distill(folder: str, output: str, model_spec: str | None, calib: str | None, rows: int, seq_len: int, steps: int,
            batch_size: int, lr: float, seed: int, temperature: float, train_norms: bool, force: bool) -> None:
    """Distil FOLDER's quantized scales and biases against the source model's logits (codes stay fixed)."""
    from mlx_dq.conversion import distill as dist_mod

    try:
        spec = dist_mod.source_spec(Path(folder), model_spec)
        cost = DistillSettings(rows=rows, seq_len=seq_len, steps=steps, batch_size=batch_size).with_options()
    except ValueError:  # the run below says what is wrong with the folder or the settings, in its order
        spec = cost = None
    if spec is not None:
        _announce(spec, "distill", cost)
    rec = dist_mod.distill(model_spec, folder, output, calib=calib, rows=rows, seq_len=seq_len, steps=steps,
                           batch_size=batch_size, lr=lr, seed=seed, temperature=temperature,
                           train_norms=train_norms, force=force, say=click.echo)
    click.echo(f"KL on the training rows: {rec['kl_train_before']:.5f} -> {rec['kl_train_after']:.5f} "
               f"({rec['train_seconds']:.0f} s training)")
    click.echo(f"wrote {output}")


@main.command(name="eval", context_settings=CONTEXT)
@click.argument("model")
@click.option("--base", default=None,
              help="Unquantized model to compare with [default: the source recorded in MODEL's mlx_dq.json].")
@click.option("--text", "text_path", type=click.Path(), default=None,
              help="Evaluation text: a name (pydoc, shakespeare, dialog) or a .txt/.jsonl file or folder [default: pydoc].")
@click.option("--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Number of token rows.")
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2), help="Tokens per row.")
@click.option("--seed", default=0, show_default=True, type=int, help="Seed for choosing the rows.")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(min=1), help="Rows per forward pass.")
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

    try:
        texts, source = calib.resolve_eval_texts(text_path)
    except MlxDqError as e:
        raise click.BadParameter(str(e), param_hint="--text") from None
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


def _write_csv(rows: list[dict], path: str) -> None:
    """Rows of dicts as a CSV file (header from the first row)."""
    import csv

    from mlx_dq.safety import write_text_atomic

    def write(fh: Any) -> None:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["tensor"], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)

    write_text_atomic(write, path)


def _convert_notes(output: str, manifest: dict | None = None) -> None:
    """After convert: the distillation's result, what an imported plan could not map, where the head stands."""
    from mlx_dq.formats.common import import_summary
    from mlx_dq.formats.exl2 import head_note
    from mlx_dq.plan.optimize import load_plan

    drec = (manifest or {}).get("provenance", {}).get("distill")
    if drec:
        click.echo(f"distilled: KL on its {drec['settings']['rows']} x {drec['settings']['seq_len']} training tokens "
                   f"{drec['kl_train_before']:.5f} -> {drec['kl_train_after']:.5f} ({drec['seconds']:.0f} s)")
    try:
        plan = load_plan(Path(output) / "plan.json")
    except ValueError:
        return
    if plan.method.startswith("imported:"):
        for line in import_summary(plan):
            click.echo(line)
    note = head_note(plan, True)
    if note:
        click.echo(note)


@main.command(name="import-plan", context_settings=CONTEXT)
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--model", "model_spec", required=True, help="Model (spec, folder or config.json) to map the names onto.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default="plan.json", show_default=True,
              help=f"Where to write the plan; an earlier plan there is replaced. {WRITE_RULE}")
@click.option("--force", is_flag=True, hidden=True,
              help="No effect (kept for older scripts): only a plan mlx-dq wrote is replaced.")
def import_plan(file: str, model_spec: str, output: str, force: bool) -> None:
    """Turn FILE (a dynquant manifest or an MLX config with kept_16bit) into an mlx_dq plan for a model."""
    from mlx_dq.formats import detect, dynquant, mlx_kept16
    from mlx_dq.formats.common import import_summary, modules_for, read_json
    from mlx_dq.plan.optimize import save_plan

    _check_plan_output(output, file, model_spec)
    data = read_json(file)
    kind = detect(data)
    mod = {"dynquant": dynquant, "mlx_kept16": mlx_kept16}.get(kind)
    if mod is None:
        raise InputError(f"{file}: a {kind} document, not a dynquant manifest or an MLX config with kept_16bit")
    modules, model_type = modules_for(model_spec)
    plan = mod.to_plan(data, modules, model_type, path=file)
    save_plan(plan, output)
    for line in import_summary(plan):
        click.echo(line)
    click.echo(f"{plan.achieved_bpw:.4f} bpw over {len(plan.tensors)} tensors; plan written to {output}")


@main.command(name="export", context_settings=CONTEXT)
@click.argument("source", type=click.Path(exists=True))
@click.option("--to", "form", type=click.Choice(["dynquant", "mlx-kept16", "dashq", "record"]), required=True,
              help="dynquant manifest, MLX config with kept_16bit, dashq record, or our record form.")
@click.option("-o", "--output", type=click.Path(dir_okay=False), required=True,
              help=f"JSON file to write; an earlier export there is replaced. {WRITE_RULE}")
@click.option("--force", is_flag=True, hidden=True,
              help="No effect (kept for older scripts): only an earlier export is replaced.")
def export(source: str, form: str, output: str, force: bool) -> None:
    """Write SOURCE (an output folder, its mlx_dq.json, or a plan) in another tool's form."""
    from mlx_dq.formats import dashq, dynquant, json_kind, mlx_kept16
    from mlx_dq.formats.common import read_json
    from mlx_dq.measure.records import write_json_atomic
    from mlx_dq.safety import guard_output_file

    path = Path(source) / MANIFEST_NAME if Path(source).is_dir() else Path(source)
    guard_output_file(output, "-o/--output", inputs=[("source", path), ("source", source)],
                      kind="an earlier export (dynquant, MLX config or dashq record)",
                      is_kind=lambda p: json_kind(p) in ("dynquant", "mlx_kept16", "dashq") or _is_record(p))
    doc = read_json(path)
    ours = isinstance(doc, dict) and (doc.get("schema") == MANIFEST_SCHEMA or doc.get("format") == "mlx_dq.plan")
    if not ours:
        raise InputError(f"{path}: not an mlx_dq manifest or plan")
    _check_ours(doc, path)
    if form == "dynquant":
        out = dynquant.from_ours(doc)
    elif form == "mlx-kept16":
        out = mlx_kept16.from_ours(doc)
    else:
        if doc.get("schema") != MANIFEST_SCHEMA:
            raise InputError(f"{path}: the {form} form needs a manifest (an output folder), not a plan")
        out = dashq.record_from_manifest(doc)
        out = dashq.to_dashq(out) if form == "dashq" else out
    write_json_atomic(out, output)
    click.echo(f"wrote {output} ({form})")


def _check_ours(doc: dict, path: Path) -> None:
    """Refuse a damaged manifest or plan, naming what is wrong, before it is turned into another form."""
    if doc.get("schema") == MANIFEST_SCHEMA:
        from mlx_dq.conversion.writer import check_manifest

        check_manifest(doc, path)
    else:
        from mlx_dq.plan.optimize import load_plan

        load_plan(path)


def _is_record(path: str) -> bool:
    """Whether ``path`` holds a record written by ``export --to record``."""
    import json

    from mlx_dq.formats.dashq import RECORD_SCHEMA

    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("schema") == RECORD_SCHEMA
    except (OSError, ValueError, AttributeError):
        return False


def _check_plan_output(output: str, file: str, model_spec: str) -> None:
    """Refuse a plan output that is an input (FILE, the model's folder) or an existing file that is not a plan."""
    from mlx_dq.safety import guard_output_file

    model = Path(model_spec).parent if Path(model_spec).is_file() else _source_path(model_spec)
    guard_output_file(output, "-o/--output", inputs=[("file", file), ("model", model)], kind="a plan",
                      is_kind=_is_plan)


def _not_another_form(path: str) -> None:
    """A one-line error that says what a file is when a measurement was expected but another form came."""
    from mlx_dq.formats import detect
    from mlx_dq.formats.common import read_json

    kind = detect(read_json(path))
    if kind in ("dynquant", "mlx_kept16", "mlx_dq.plan"):
        raise InputError(f"{path} is a {kind} file, not a measurement: apply it with "
                         f"'mlx_dq convert --plan {path}' (or 'mlx_dq import-plan'), view it with 'mlx_dq inspect'")
    if kind in ("dashq", "mlx_dq.manifest"):
        raise InputError(f"{path} is a {kind} file, not a measurement: view it with 'mlx_dq inspect'")


def _upload(folder: str, repo_id: str, private: bool, after_convert: bool = False) -> None:
    """Upload ``folder`` to ``repo_id``, or fail with one line that says the local folder is intact."""
    from mlx_dq.api import upload as api_upload
    from mlx_dq.conversion.hub import HubError

    try:
        url = api_upload(folder, repo_id, private=private)
    except HubError as e:
        later = f"; upload it later with `mlx_dq upload {folder} {repo_id}`" if after_convert else ""
        raise click.ClickException(f"{e} (the local folder {folder} is complete{later})") from None
    click.echo(f"uploaded {folder} to {url}")


@main.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.argument("repo_id", metavar="USER/NAME")
@click.option("--private", is_flag=True, help="Create the repo as private.")
@click.option("--list", "list_only", is_flag=True, help="Only list the files an upload would send.")
def upload(folder: str, repo_id: str, private: bool, list_only: bool) -> None:
    """Upload a converted model FOLDER (weights, config, tokenizer, card, manifest) to the hub repo USER/NAME."""
    from mlx_dq.conversion.hub import check_repo_id, upload_files

    check_repo_id(repo_id)
    files = upload_files(folder)
    if list_only:
        for f in files:
            click.echo(f)
        return
    _upload(folder, repo_id, private)


@main.command(context_settings=CONTEXT)
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

    from mlx_dq.loader import load

    if prompt == "-":
        prompt = _stdin_text()
    try:
        model, tokenizer = load(model_dir)
    except (MlxDqError, OSError) as e:
        raise click.ClickException(f"cannot load {model_dir}: {e}") from None
    if seed is not None:
        mx.random.seed(seed)
    if chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                               tokenize=False)
    elif not prompt:  # mlx-lm cannot start from no tokens at all
        raise InputError("the prompt is empty: give some text with --prompt (or use the chat template, --chat)")
    mlx_lm.generate(model, tokenizer, prompt, verbose=True, max_tokens=max_tokens,
                    sampler=make_sampler(temp=temp, top_p=top_p))


def _stdin_text() -> str:
    """Standard input as UTF-8 text; InputError naming the first byte that is not (binary input)."""
    import sys

    data = sys.stdin.buffer.read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"--prompt -: standard input is not UTF-8 text (byte {e.start} cannot be decoded)") from None


@main.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
def verify(folder: str) -> None:
    """Check FOLDER before trusting it: its model file must be mlx-dq's own shim, byte for byte, and every
    weight file must have the size and sha256 its manifest records (headers and config.json are checked too).

    mlx-lm with --trust-remote-code imports whatever config.json's model_file
    names; run this on a folder from elsewhere first (or use mlx_dq generate /
    mlx_dq.load, which never run folder code).
    """
    from mlx_dq.conversion.report import verify_folder

    lines = verify_folder(folder)
    for line in lines:
        click.echo(line)


def _rank_tag(message: str) -> str:
    """``message`` naming this rank when several ranks run under ``mlx.launch``."""
    from mlx_dq.runtime.distributed import tag

    return tag(message)


def _is_root() -> bool:
    """True unless this process is a rank other than 0 under ``mlx.launch``."""
    from mlx_dq.runtime.distributed import is_root

    return is_root()


def _estimate_parts(source: Any, flops: float | None, what: str, distill: DistillSettings | None = None,
                    **kw: Any) -> list:
    """The predicted cost of ``measure``, ``convert`` or ``distill`` on a resolved ``source``, one Estimate per stage
    (a conversion's distillation after it, at the FLOP/s the conversion timed)."""
    from mlx_dq.conversion.estimate import (
        estimate_convert,
        estimate_distill,
        estimate_measure,
    )

    if what == "measure":
        return [estimate_measure(source, flops=flops, **kw)]
    parts = []
    if what == "convert":
        conv, meas = estimate_convert(source, flops=flops, **kw)
        parts, flops = [p for p in (meas, conv) if p is not None], conv.flops
    if distill is not None:
        parts.append(estimate_distill(source, rows=distill.rows, seq_len=distill.seq_len, steps=distill.steps,
                                      batch_size=distill.batch_size, flops=flops))
    return parts


def _print_estimate(model_spec: str, flops: float | None, what: str, distill: DistillSettings | None = None,
                    **kw: Any) -> None:
    """Print the predicted cost of ``measure`` or ``convert`` (with its distillation) from the model's shapes."""
    from mlx_dq.model.sources import resolve
    from mlx_dq.safety import finite_number

    if flops is not None:  # a rate of zero, below or not a number would print a time of the same kind
        finite_number(flops, "--flops (float32 FLOP/s)", positive=True)
    source = resolve(model_spec)
    parts = _estimate_parts(source, flops, what, distill, **kw)
    for p in parts:
        for line in p.lines():
            click.echo(line)
    if len(parts) > 1:
        click.echo(f"total: about {sum(p.seconds for p in parts) / 60:.1f} min, peak memory about "
                   f"{max(p.peak_bytes for p in parts) / 2**30:.2f} GiB, disk about "
                   f"{sum(p.disk_bytes for p in parts) / 2**20:.1f} MiB")
    if note := _openblas_note(source, parts, what, distill, **kw):
        click.echo(note)


def _announce(model_spec: str, what: str, distill: DistillSettings | None = None, **kw: Any) -> None:
    """Say on stderr, before any work, how long the run should take and how much memory it needs (one line).

    A model that cannot be found or read stops here with the run's own one-line error (so a missing hub model
    is not fetched twice); a setting the estimate cannot price is left to the run, which says what is wrong."""
    if not _is_root():
        return
    from mlx_dq.conversion.estimate import physical_memory, summary_line
    from mlx_dq.model.sources import resolve

    source = resolve(model_spec)
    try:
        parts = _estimate_parts(source, None, what, distill, **kw)
    except Exception:  # noqa: BLE001  (the run that follows says what is wrong, once)
        return
    note = _openblas_note(source, parts, what, distill, **kw)
    click.echo(f"mlx_dq: {summary_line(parts, physical_memory())}" + (f"; {note}" if note else ""), err=True)


def _openblas_note(source: Any, parts: list, what: str, distill: DistillSettings | None = None, **kw: Any) -> str:
    """On Linux without OpenBLAS to preload: what to install and the run's time with it (its matmuls that much
    faster); empty otherwise. Why: without it a first run is predicted, and takes, hours instead of minutes."""
    from mlx_dq.conversion.estimate import format_seconds
    from mlx_dq.runtime import openblas

    if not parts or not openblas.missing():
        return ""
    fast = _estimate_parts(source, parts[0].flops * openblas.SPEEDUP, what, distill, **kw)
    return (f"no OpenBLAS found: `{openblas.INSTALL}` would make it about "
            f"{format_seconds(sum(p.seconds for p in fast))} (float32 matmuls about {openblas.SPEEDUP:g}x faster)")
