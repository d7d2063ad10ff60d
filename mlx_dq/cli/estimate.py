"""A run's predicted cost: ``--estimate`` prints it, and every measure, convert and distill announces it first."""

from __future__ import annotations

from typing import Any

import click

from mlx_dq.cli.group import is_root
from mlx_dq.settings import DistillSettings


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


def print_estimate(model_spec: str, flops: float | None, what: str, distill: DistillSettings | None = None,
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


def announce(model_spec: str, what: str, distill: DistillSettings | None = None, **kw: Any) -> None:
    """Say on stderr, before any work, how long the run should take and how much memory it needs (one line).

    A model that cannot be found or read stops here with the run's own one-line error (so a missing hub model
    is not fetched twice); a setting the estimate cannot price is left to the run, which says what is wrong."""
    if not is_root():
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
