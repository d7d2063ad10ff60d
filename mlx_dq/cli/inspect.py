"""Looking at models and output folders: ``info``, ``inspect`` and ``verify``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from mlx_dq.cli.group import CONTEXT
from mlx_dq.errors import MlxDqError


@click.command(context_settings=CONTEXT)
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


def _parameter_count(config: dict[str, Any]) -> int | None:
    """Parameters of the mlx-lm model a config describes, from shapes only (no weights are computed)."""
    from mlx.utils import tree_flatten

    from mlx_dq.model.sources import build_model

    try:
        model = build_model(config)
    except MlxDqError:  # an architecture mlx-lm lacks: the count is unknown, not an error here
        return None
    return sum(v.size for _, v in tree_flatten(model.parameters()))


@click.command(context_settings=CONTEXT)
@click.argument("folder", type=click.Path(exists=True))
@click.option("--width", default=5, show_default=True, type=click.IntRange(min=3), help="Characters per cell.")
def inspect(folder: str, width: int) -> None:
    """Print the per-layer bit map and the accounting of a converted model FOLDER, after checking it is whole,
    or summarize a file: plan, manifest, measurement, dynquant manifest, MLX config with kept_16bit or dashq record.

    The folder check is quick: files present with their recorded sizes, weight headers, config.json; it
    does not read the weights (`mlx_dq verify` compares every weight file with its recorded sha256)."""
    from mlx_dq.conversion.report import bit_map, check_folder
    from mlx_dq.conversion.writer import read_manifest

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


@click.command(context_settings=CONTEXT)
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


COMMANDS = (info, inspect, verify)
