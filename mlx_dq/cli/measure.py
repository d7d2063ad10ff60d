"""The measure stage's commands: ``measure`` and ``plot``."""

from __future__ import annotations

import time
from typing import Any

import click

from mlx_dq.cli.estimate import announce, print_estimate
from mlx_dq.cli.group import CALIB_HELP, CONTEXT, calib_arg, is_root, source_path
from mlx_dq.data.calib import calib_inputs
from mlx_dq.errors import MlxDqError
from mlx_dq.safety import WRITE_RULE
from mlx_dq.settings import IMPORTANCE_MODES, METHODS, MeasureSettings

_M = MeasureSettings()  # the defaults every option below shows


@click.command(context_settings=CONTEXT)
@click.option("--model", "model_spec", default="smollm2-135m", show_default=True,
              help="HF folder, hub id, .gguf file or smollm2-135m.")
@click.option("--calib", multiple=True, default=None, metavar="PATH", help=CALIB_HELP)
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
def measure(model_spec: str, calib: tuple[str, ...], rows: int, seq_len: int, seed: int, grid: str | None,
            importance: str, method: str, clip: bool | None, kl_scale: bool, output: str, no_resume: bool,
            plot_dir: str | None, force: bool = False, sample_rows: int = 0, estimate: bool = False,
            flops: float | None = None) -> None:
    """Measure every tensor's error under each quantization option, one decoder layer at a time."""
    from mlx_dq.measure.stream import measure as run_measure

    calib_spec = calib_arg(calib)
    cost = dict(rows=rows, seq_len=seq_len, grid=grid, method=method, kl_scale=kl_scale and importance == "residual",
                sample_rows=sample_rows, clip=bool(clip))
    if estimate:
        print_estimate(model_spec, flops, "measure", **cost)
        return
    t0 = time.perf_counter()
    announce(model_spec, "measure", **cost)
    _check_measure_outputs(output, plot_dir, [*calib_inputs(calib_spec), ("grid", grid),
                                              ("model", source_path(model_spec))])
    m = run_measure(model_spec, calib=calib_spec, rows=rows, seq_len=seq_len, seed=seed, grid=grid,
                    out_path=output, resume=not (no_resume or force), importance=importance, clip=clip,
                    method=method, kl_scale=kl_scale, sample_rows=sample_rows)
    if not is_root():  # under mlx.launch only rank 0 reports (and writes)
        return
    n_opts = sum(len(t.options) for t in m.tensors.values())
    click.echo(f"measured {len(m.tensors)} tensors x options = {n_opts} in {time.perf_counter() - t0:.1f} s "
               f"({rows} rows x {seq_len} tokens)")
    n_imp = (m.extra.get("importance") or {}).get("rows", rows)
    click.echo(f"base perplexity on the first {n_imp} calibration rows: {m.base_perplexity:.4f}")
    click.echo(f"wrote {output}")
    if plot_dir:
        _write_plots(m, plot_dir, (2.5, 3.5, 4.5), 4.0, None)


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


def _needs_matplotlib(e: ImportError) -> click.ClickException:
    """The one-line error when matplotlib, which every figure needs, cannot be imported."""
    return click.ClickException(f"plotting needs matplotlib, a dependency of mlx-dq ({e}): pip install matplotlib")


def _write_plots(m: Any, out_dir: str, targets: tuple[float, ...], heatmap_at: float | str,
                 quality: str | None) -> None:
    """Write a measurement's figures as PNGs into ``out_dir`` and list them."""
    try:
        from mlx_dq.evaluation import plots
    except ImportError as e:
        raise _needs_matplotlib(e) from None
    try:
        paths = plots.save_figures(m, out_dir, targets=targets, heatmap_at=heatmap_at, quality_csv=quality)
    except MlxDqError as e:
        raise click.ClickException(f"plotting failed: {e}") from None
    for path in paths:
        click.echo(f"wrote {path}")


@click.command(context_settings=CONTEXT)
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
        raise _needs_matplotlib(e) from None
    _write_plots(m, output, bpws, at, quality)


COMMANDS = (measure, plot)
