"""The plan stage's commands: ``optimize``, ``import-plan`` and ``export`` (plans in other tools' forms)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mlx_dq.cli.group import CONTEXT, source_path
from mlx_dq.errors import InputError
from mlx_dq.names import MANIFEST_NAME, MANIFEST_SCHEMA
from mlx_dq.safety import WRITE_RULE


@click.command(context_settings=CONTEXT)
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
    from mlx_dq.plan import keeprules, solver
    from mlx_dq.plan.plan import plan_to_mlx_config, save_plan
    from mlx_dq.safety import write_json_atomic

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
    plan = solver.optimize(m, bpw, head_option=head, keep=keep, keep_most_sensitive=counts, parts=part_map,
                           mlx_lm_compatible=mlx_lm_compatible, keep_outside_budget=keep_outside_budget)
    measured_heads = any(exl2.is_head(k) for k in m.tensors)
    if model_spec and not measured_heads:
        from mlx_dq.formats.common import modules_for

        exl2.complete_head(plan, modules_for(model_spec)[0], head)
    notes = [] if meas.measurement_complete(m) else [_unmeasured_note(m, plan)]
    if mlx_config:
        write_json_atomic(plan_to_mlx_config(plan), mlx_config)
    try:
        save_plan(plan, output)
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


def _is_plan(path: str) -> bool:
    """Whether ``path`` holds a valid mlx_dq plan (an earlier plan may be replaced)."""
    from mlx_dq.plan.plan import load_plan

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

    inputs = [("measurement", measurement), ("model", source_path(model_spec))]
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


def _write_csv(rows: list[dict], path: str) -> None:
    """Rows of dicts as a CSV file (header from the first row)."""
    import csv

    from mlx_dq.safety import write_text_atomic

    def write(fh: Any) -> None:
        w = csv.DictWriter(fh, fieldnames=list(rows[0]) if rows else ["tensor"], lineterminator="\n")
        w.writeheader()
        w.writerows(rows)

    write_text_atomic(write, path)


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


@click.command(name="import-plan", context_settings=CONTEXT)
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
    from mlx_dq.plan.plan import save_plan

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


def _check_plan_output(output: str, file: str, model_spec: str) -> None:
    """Refuse a plan output that is an input (FILE, the model's folder) or an existing file that is not a plan."""
    from mlx_dq.safety import guard_output_file

    model = Path(model_spec).parent if Path(model_spec).is_file() else source_path(model_spec)
    guard_output_file(output, "-o/--output", inputs=[("file", file), ("model", model)], kind="a plan",
                      is_kind=_is_plan)


@click.command(name="export", context_settings=CONTEXT)
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
    from mlx_dq.safety import guard_output_file, write_json_atomic

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
        from mlx_dq.plan.plan import load_plan

        load_plan(path)


def _is_record(path: str) -> bool:
    """Whether ``path`` holds a record written by ``export --to record``."""
    import json

    from mlx_dq.formats.dashq import RECORD_SCHEMA

    try:
        return json.loads(Path(path).read_text(encoding="utf-8")).get("schema") == RECORD_SCHEMA
    except (OSError, ValueError, AttributeError):
        return False


COMMANDS = (optimize, import_plan, export)
