"""One streaming measurement's state, and what its stages share: the grid's options and the option work's split
over ranks."""

from __future__ import annotations

import platform
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_dq.errors import InputError
from mlx_dq.measure.meter import sampled_row_count
from mlx_dq.measure.records import Measurement
from mlx_dq.measure.tensor import fitting_options, reference_option
from mlx_dq.model.runner import LayerRunner
from mlx_dq.names import role_of
from mlx_dq.quant.dispatch import option_batches
from mlx_dq.quant.options import QuantOption
from mlx_dq.runtime import distributed as dist
from mlx_dq.settings import MeasureSettings


@dataclass
class MeasureRun:
    """The state of one streaming measurement: settings, the runner, the carried activations and the record."""

    s: MeasureSettings
    source: Any
    runner: LayerRunner
    tokens: mx.array
    grid_map: dict
    m: Measurement
    digest: str
    out: Path | None
    progress: bool
    clip: bool
    kl_scale: bool
    n_imp: int
    hidden: Any = None
    start_layer: int = 0
    carried: dict = field(default_factory=dict)  # layer -> importance rows' hidden states with that layer quantized
    sample_layers: set = field(default_factory=set)
    embed_lookup: dict = field(default_factory=dict)
    embed_importance: float = 0.0
    lookup_weight: dict = field(default_factory=dict)  # lookup table -> KL per squared lookup error, end to end
    t_start: float = 0.0
    rates: dict = field(default_factory=dict)  # option -> [seconds, weights] measured so far on every rank


def grid_options(grid: dict[str, list[QuantOption]], role: str, key: str) -> list[QuantOption]:
    """The grid's options for ``role`` (a copy); an input error naming the tensor ``key`` when the grid has none."""
    if role not in grid:
        raise InputError(f"{key}: the grid has no options for role {role!r} (roles: {sorted(grid)})")
    return list(grid[role])


def package_versions() -> dict[str, str]:
    """The versions of Python, mlx, mlx-lm and mlx-dq a measurement records."""
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm", "mlx-dq"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def share_options(run: MeasureRun, mods: dict[str, nn.Module],
                  passes: dict[str, list[list[QuantOption]]] | None = None) -> dict[tuple[str, str], int]:
    """The rank that measures each (tensor, option) of ``mods``, in one process's option order, balanced by cost;
    {} with one rank.

    Each rank gets whole quantizer passes: ``passes`` gives a tensor's options as one process quantizes them
    together (:func:`~mlx_dq.quant.dispatch.option_batches`), by default as in a decoder layer
    (:func:`layer_passes`). Why: a pass split over ranks is made in full on each, its work done twice.
    The cost of an option is its seconds per weight measured on the earlier
    layers (every rank holds the same table) times the tensor's size; until each
    option has been timed once, a rough model (:func:`~mlx_dq.runtime.distributed.option_cost`).
    Any split gives the same measurement: only the time depends on it.
    """
    if not dist.active():
        return {}
    fitting = {p: fitting_options(grid_options(run.grid_map, role_of(p), p), int(mod.weight.shape[-1]))
               for p, mod in mods.items()}
    units = [(p, batch) for p, mod in mods.items()
             for batch in (passes[p] if passes is not None and p in passes else layer_passes(run, mod, fitting[p]))]
    if all(o.desc in run.rates for _, batch in units for o in batch):
        costs = [sum(mods[p].weight.size * run.rates[o.desc][0] / run.rates[o.desc][1] for o in batch)
                 for p, batch in units]
    else:
        costs = [sum(dist.option_cost(tuple(mods[p].weight.shape), run.s.method, run.clip, o.keep16) for o in batch)
                 for p, batch in units]
    rank_of = {(p, o.desc): r for (p, batch), r in zip(units, dist.split_by_cost(costs)) for o in batch}
    return {(p, o.desc): rank_of[(p, o.desc)] for p in mods for o in fitting[p]}


def layer_passes(run: MeasureRun, mod: nn.Module, options: list[QuantOption]) -> list[list[QuantOption]]:
    """A decoder tensor's fitting ``options`` as the passes one process quantizes them in
    (:func:`~mlx_dq.measure.tensor.measure_tensor`): the reference option alone (kept: every row), then the others
    batched on the rows they are measured on (``sample_rows`` of a 2-D weight)."""
    shape = tuple(int(d) for d in mod.weight.shape)
    ref = reference_option(options, shape[-1]).desc
    rows = sampled_row_count(shape, 2, run.s.sample_rows) or shape[0]  # a decoder tensor's Gram is 2-D
    shared = len(shape) == 2 or run.s.expert_mode == "shared"  # one Gram for every expert of a bank
    rest = [o for o in options if o.desc != ref]
    return [[o] for o in options if o.desc == ref] + option_batches(rest, (rows,) + shape[1:], run.s.quantizer(),
                                                                     shared=shared)


def owned_options(owner: dict[tuple[str, str], int], path: str) -> set[str] | None:
    """The option descriptions of ``path`` this rank measures (None: one rank measures every option)."""
    return {d for (p, d), r in owner.items() if p == path and r == dist.rank()} if owner else None


def learn_rates(run: MeasureRun, mods: dict[str, nn.Module], timings: dict[str, dict[str, float]]) -> None:
    """Add every rank's option timings of this layer to ``run.rates`` (the same table on every rank)."""
    if not dist.active():
        return
    for part in dist.gather_objects(timings):
        for path, per in sorted(part.items()):
            for desc, sec in sorted(per.items()):
                acc = run.rates.setdefault(desc, [0.0, 0])
                acc[0] += sec
                acc[1] += int(mods[path].weight.size)


def sample_owner(run: MeasureRun, i: int) -> int:
    """The rank that carries sampled layer ``i``'s perturbed copy to the logits (the samples in turn over ranks)."""
    return sorted(run.sample_layers).index(i) % dist.size()
