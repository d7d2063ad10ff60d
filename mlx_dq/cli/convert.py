"""Making and publishing output folders: ``convert``, ``distill`` and ``upload``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mlx_dq.cli.estimate import announce, print_estimate
from mlx_dq.cli.group import CALIB_HELP, CONTEXT, calib_arg, is_root
from mlx_dq.errors import MlxDqError
from mlx_dq.safety import WRITE_RULE
from mlx_dq.settings import (
    DTYPES,
    METHODS,
    DistillSettings,
    PlanSettings,
    QuantizeSettings,
)

_Q, _P, _D = QuantizeSettings(), PlanSettings(), DistillSettings()  # the defaults every option below shows


@click.command(context_settings=CONTEXT)
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
@click.option("--calib", multiple=True, default=None, metavar="PATH", help=CALIB_HELP)
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
            keep: tuple[str, ...], keep_outside_budget: bool, calib: tuple[str, ...], rows: int, seq_len: int, seed: int,
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

    calib_spec = calib_arg(calib)
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
    d_settings = _distill_settings(distill, calib_spec, seed, rows=distill_rows, seq_len=distill_seq_len,
                                   steps=distill_steps, lr=distill_lr)
    cost = dict(bpw=bpw, rows=rows, seq_len=seq_len, method=method, distill=d_settings,
                measure_first=measurement is None and plan_path is None,
                measure_kwargs={"rows": rows, "seq_len": seq_len},
                measurement_bytes=Path(measurement).stat().st_size if measurement else None)
    if estimate:
        print_estimate(model_spec, flops, "convert", **cost)
        return
    announce(model_spec, "convert", **cost)
    if upload_repo is not None:
        check_upload_ready(upload_repo)  # before any work: a long conversion must not end in "offline"
    manifest = run_convert(
        model_spec, output, bpw=bpw, plan=plan_path, measurement=measurement,
        mlx_lm_compatible=mlx_lm_compatible, promote_mixed=promote_mixed, frequent_rows=frequent_rows,
        head_option=None if head_option == "budget" else head_option,
        keep=keep, keep_outside_budget=keep_outside_budget, calib=calib_spec, rows=rows, seq_len=seq_len, seed=seed,
        method=method,
        sequential=not no_sequential, clip=not no_clip, force=force, dtype=dtype,
        command=_command_line(ctx), card_ref=upload_repo,
        allow_incomplete=allow_incomplete, allow_other_model=allow_other_model, distill=d_settings,
    )
    if not is_root():  # under mlx.launch only rank 0 reports (and writes)
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


def _command_line(ctx: click.Context) -> str:
    """The ``mlx_dq ...`` command line that is running, shell-quoted."""
    import shlex

    return shlex.join(["mlx_dq", *ctx.find_root().meta.get("mlx_dq.argv", [])])


def _distill_settings(distill: bool, calib: str | tuple[str, ...] | None, seed: int, **given: Any) -> DistillSettings | None:
    """convert's --distill and --distill-* options as settings (None without --distill; its options then refused)."""
    given = {k: v for k, v in given.items() if v is not None}
    if given and not distill:
        raise click.UsageError(", ".join(f"--distill-{k.replace('_', '-')}" for k in given)
                               + " would be ignored without --distill")
    from mlx_dq.conversion.pipeline import distill_settings

    return distill_settings(given or True, QuantizeSettings(calib=calib, seed=seed)) if distill else None


def _convert_notes(output: str, manifest: dict | None = None) -> None:
    """After convert: the distillation's result, what an imported plan could not map, where the head stands."""
    from mlx_dq.formats.common import import_summary
    from mlx_dq.formats.exl2 import head_note
    from mlx_dq.plan.plan import load_plan

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


@click.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True, file_okay=False))
@click.option("-o", "--output", type=click.Path(file_okay=False), required=True,
              help=f"Output model folder. {WRITE_RULE}")
@click.option("--model", "model_spec", default=None,
              help="Source (float) model to distil from [default: the source recorded in FOLDER's manifest].")
@click.option("--calib", multiple=True, default=None, metavar="PATH", help=CALIB_HELP)
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
def distill(folder: str, output: str, model_spec: str | None, calib: tuple[str, ...], rows: int, seq_len: int, steps: int,
            batch_size: int, lr: float, seed: int, temperature: float, train_norms: bool, force: bool) -> None:
    """Distil FOLDER's quantized scales and biases against the source model's logits (codes stay fixed)."""
    from mlx_dq.conversion import distill as dist_mod

    calib_spec = calib_arg(calib)
    try:
        spec = dist_mod.source_spec(Path(folder), model_spec)
        cost = DistillSettings(rows=rows, seq_len=seq_len, steps=steps, batch_size=batch_size).with_options()
    except ValueError:  # the run below says what is wrong with the folder or the settings, in its order
        spec = cost = None
    if spec is not None:
        announce(spec, "distill", cost)
    rec = dist_mod.distill(model_spec, folder, output, calib=calib_spec, rows=rows, seq_len=seq_len, steps=steps,
                           batch_size=batch_size, lr=lr, seed=seed, temperature=temperature,
                           train_norms=train_norms, force=force, say=click.echo)
    click.echo(f"KL on the training rows: {rec['kl_train_before']:.5f} -> {rec['kl_train_after']:.5f} "
               f"({rec['train_seconds']:.0f} s training)")
    click.echo(f"wrote {output}")


@click.command(context_settings=CONTEXT)
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


COMMANDS = (convert, distill, upload)
