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
                  passes: dict[str, list[list[QuantOption]]] | None = None,
                  layer: int | None = None) -> dict[tuple[str, str], int]:
    """The rank that measures each (tensor, option) of ``mods``, in one process's option order, balanced by cost;
    {} with one rank.

    Each rank gets whole quantizer passes: ``passes`` gives a tensor's options as one process quantizes them
    together (:func:`~mlx_dq.quant.dispatch.option_batches`), by default as in a decoder layer
    (:func:`layer_passes`). Why: a pass split over ranks is made in full on each, its work done twice.
    The cost of an option is its seconds per weight measured on the earlier
    layers (every rank holds the same table) times the tensor's size; until each
    option has been timed once, a rough model (:func:`~mlx_dq.runtime.distributed.option_cost`).
    ``layer`` (a decoder layer's options): the split also counts, once timed on earlier layers, the residual
    importance a tensor's reference option brings to its rank and the carried copies each rank runs through the
    layer anyway (:func:`carried_loads`). Why: without them one rank did most of the importance reruns and
    the other waited for it in every layer.
    Any split gives the same measurement: only the time depends on it.
    """
    if not dist.active():
        return {}
    fitting = {p: fitting_options(grid_options(run.grid_map, role_of(p), p), int(mod.weight.shape[-1]))
               for p, mod in mods.items()}
    units = [(p, batch) for p, mod in mods.items()
             for batch in (passes[p] if passes is not None and p in passes else layer_passes(run, mod, fitting[p]))]
    start = None
    if all(o.desc in run.rates for _, batch in units for o in batch):
        costs = [sum(mods[p].weight.size * _rate(run, o.desc) for o in batch) for p, batch in units]
        if layer is not None:
            for k, (p, batch) in enumerate(units):
                if importance_option(run, p, fitting[p], int(mods[p].weight.shape[-1])) in {o.desc for o in batch}:
                    costs[k] += mods[p].weight.size * _rate(run, importance_key(p))
            start = carried_loads(run, layer)
    else:
        costs = [sum(dist.option_cost(tuple(mods[p].weight.shape), run.s.method, run.clip, o.keep16) for o in batch)
                 for p, batch in units]
    rank_of = {(p, o.desc): r for (p, batch), r in zip(units, dist.split_by_cost(costs, start=start)) for o in batch}
    return {(p, o.desc): rank_of[(p, o.desc)] for p in mods for o in fitting[p]}


def _rate(run: MeasureRun, key: str) -> float:
    """Seconds per unit of ``run.rates[key]`` (0 until timed)."""
    sec, n = run.rates.get(key, (0.0, 0))
    return sec / n if n else 0.0


def importance_key(path: str) -> str:
    """The ``run.rates`` key of a tensor's residual importance rerun (per role: what it reruns depends on it)."""
    return f"importance {role_of(path)}"


def importance_option(run: MeasureRun, path: str, fitting: list[QuantOption], in_features: int) -> str | None:
    """The option whose rank computes ``path``'s residual importance: its reference option, or its first fitting
    option when the reference is not in the grid (:func:`~mlx_dq.measure.stream._measure_options`'s rule)."""
    if run.s.importance != "residual" or not fitting:
        return None
    ref = reference_option(grid_options(run.grid_map, role_of(path), path), in_features).desc
    return ref if any(o.desc == ref for o in fitting) else fitting[0].desc


CARRIED_KEY = "carried copy"  # run.rates: seconds per carried copy and layer


def carried_copies(run: MeasureRun, layer: int) -> list[int]:
    """How many carried copies each rank runs through decoder ``layer`` (lookup tables' on rank 0, each sampled
    earlier layer's on :func:`sample_owner`); the same on every rank."""
    counts = [0] * dist.size()
    if not run.kl_scale:
        return counts
    counts[0] += len(run.m.extra["importance"]["kl_scale"].get("lookups", {}))
    for j in run.sample_layers:
        if j < layer:
            counts[sample_owner(run, j)] += 1
    return counts


def carried_loads(run: MeasureRun, layer: int) -> list[float]:
    """Seconds each rank spends carrying copies through decoder ``layer`` (by the rate timed on earlier layers)."""
    return [n * _rate(run, CARRIED_KEY) for n in carried_copies(run, layer)]


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


def learn_rates(run: MeasureRun, mods: dict[str, nn.Module], timings: dict[str, dict[str, float]],
                carried: tuple[float, int] = (0.0, 0)) -> None:
    """Add every rank's option timings of this layer (and importance reruns: :func:`importance_key`) to
    ``run.rates``, per weight, and its ``carried`` (seconds, copies) run through the layer, per copy (the same table on
    every rank)."""
    if not dist.active():
        return
    for part, (sec_c, n_c) in dist.gather_objects((timings, carried)):
        for path, per in sorted(part.items()):
            for desc, sec in sorted(per.items()):
                acc = run.rates.setdefault(desc, [0.0, 0])
                acc[0] += sec
                acc[1] += int(mods[path].weight.size)
        if n_c:
            acc = run.rates.setdefault(CARRIED_KEY, [0.0, 0])
            acc[0] += sec_c
            acc[1] += n_c


def sample_owner(run: MeasureRun, i: int) -> int:
    """The rank that carries sampled layer ``i``'s perturbed copy to the logits (the samples in turn over ranks)."""
    return sorted(run.sample_layers).index(i) % dist.size()
