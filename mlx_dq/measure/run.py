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
from mlx_dq.measure.records import Measurement
from mlx_dq.measure.tensor import fitting_options
from mlx_dq.model.runner import LayerRunner
from mlx_dq.names import role_of
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


def share_options(run: MeasureRun, mods: dict[str, nn.Module]) -> dict[tuple[str, str], int]:
    """The rank that measures each (tensor, option) of ``mods``, balanced by cost; {} with one rank.

    The cost of an option is its seconds per weight measured on the earlier
    layers (every rank holds the same table) times the tensor's size; until each
    option has been timed once, a rough model (:func:`~mlx_dq.runtime.distributed.option_cost`).
    Any split gives the same measurement: only the time depends on it.
    """
    if not dist.active():
        return {}
    units = [(p, o) for p, mod in mods.items()
             for o in fitting_options(grid_options(run.grid_map, role_of(p), p), int(mod.weight.shape[-1]))]
    if all(o.desc in run.rates for _, o in units):
        costs = [mods[p].weight.size * run.rates[o.desc][0] / run.rates[o.desc][1] for p, o in units]
    else:
        costs = [dist.option_cost(tuple(mods[p].weight.shape), run.s.method, run.clip, o.keep16) for p, o in units]
    return {(p, o.desc): r for (p, o), r in zip(units, dist.split_by_cost(costs))}


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
