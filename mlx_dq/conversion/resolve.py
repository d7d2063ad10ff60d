"""The plan a conversion applies: given as is, read from a file, or optimized from a measurement.

A measurement or plan given by the user must have been made for the model
being converted (fingerprint, tensor names and shapes) and a measurement must
be complete, unless told otherwise; what could not be checked becomes a note
in the manifest.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection

from mlx_dq.errors import InputError
from mlx_dq.formats import load_plan_any
from mlx_dq.formats.common import model_modules
from mlx_dq.formats.exl2 import complete_head
from mlx_dq.measure import stream as measure_mod
from mlx_dq.measure.records import Measurement, load_measurement, measurement_complete
from mlx_dq.measure.tensor import fitting_options
from mlx_dq.model.capture import quantizable_modules
from mlx_dq.model.sources import build_model
from mlx_dq.plan.plan import Plan, PlanEntry
from mlx_dq.plan.solver import optimize, option_damage
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.rowsplit import (
    HotRows,
    extra_bits,
    hot_counts,
    hot_ids,
    rows_worth_it,
    stepped_up,
)
from mlx_dq.settings import PlanSettings


@dataclass(frozen=True)
class InputChecks:
    """What the checks of a given measurement or plan let through: an unfinished measurement
    (``allow_incomplete``), a measurement or plan made for another model of the same tensor names and shapes
    (``allow_other_model``)."""

    allow_incomplete: bool = False
    allow_other_model: bool = False


def resolve_plan(
    source: Any,
    settings: PlanSettings,
    *,
    plan: Plan | str | Path | dict | None,
    measurement: Measurement | str | Path | None,
    measurement_path: Path | None,
    measure_kwargs: dict,
    progress: bool,
    checks: InputChecks = InputChecks(),
    notes: list[str] | None = None,
    hot_rows: dict[str, HotRows] | None = None,
) -> tuple[Plan, Measurement | None]:
    """The plan to apply: given as is, or optimized from a given or freshly measured measurement.

    ``settings`` give the bpw target, head option, kept tensors and stock-loadable options.
    A given measurement or plan must have been made for ``source`` (fingerprint
    and shapes; see :func:`check_belongs_to`) and a measurement
    must be complete, unless ``checks`` say otherwise; what the
    checks could not check goes into ``notes``. ``hot_rows`` (lookup table ->
    frequent-token rows available) plans those rows finer (:func:`with_row_splits`).
    """
    notes, s = [] if notes is None else notes, settings
    if isinstance(plan, dict):
        return plan_from_options(plan, source), None
    if plan is not None:
        if isinstance(plan, (str, Path)):  # ours, or a foreign file mapped onto this model (mlx_dq.formats)
            p = load_plan_any(plan, source)
        else:
            p = plan
        notes += check_plan_input(p, plan, source, checks.allow_other_model)
        return p, None
    if s.bpw is None:
        raise InputError("give a bits-per-weight target (bpw) or a plan")
    if measurement is None:
        if not s.keep:  # a kept tensor counts 16 bits in the budget: then only the optimizer knows the range
            check_target_in_grid(source, s.bpw, measure_kwargs.get("grid"), s.mlx_lm_compatible, s.head_option)
        m = measure_mod.measure(source, out_path=measurement_path, progress=progress, **measure_kwargs)
    else:
        m = load_measurement(measurement) if isinstance(measurement, (str, Path)) else measurement
        notes += check_measurement_input(m, measurement, source, checks.allow_incomplete, checks.allow_other_model)

    def plan_for(target: float) -> Plan:
        got = optimize(m, target, head_option=s.head_option, keep=tuple(s.keep), mlx_lm_compatible=s.mlx_lm_compatible,
                       keep_outside_budget=s.keep_outside_budget)
        complete_head(got, model_modules(source), s.head_option)  # an EXL2 measurement has no embedding/head
        return got

    p = plan_for(s.bpw)
    if hot_rows and not s.mlx_lm_compatible:
        p = with_row_splits(p, hot_rows, plan_for, notes, m)
    return p, m


def row_splits(p: Plan, hot_rows: dict[str, HotRows], m: Measurement | None = None) -> dict[str, dict]:
    """The tables of ``p`` stored with frequent-token rows: in the bpw budget, listed in ``hot_rows``, with an
    option that steps up (:func:`mlx_dq.quant.rowsplit.stepped_up`); path -> hot option, rows, extra bits.

    With the measurement ``m`` and the plan's damage-per-bit price, only the rows that repay their bits
    (:func:`mlx_dq.quant.rowsplit.rows_worth_it`, from the table's measured damage at both options); else every row.
    """
    # the damage the optimizer saw (plans from before the head weight counted the table's damage whole)
    out, power, weight = {}, float(p.settings.get("err_power", 2.0)), float(p.settings.get("head_damage_weight", 1.0))
    for e in p.tensors:
        hot = hot_rows.get(e.key)
        if hot is None or e.scope != "budget" or not hot.counts.size:
            continue
        opt = QuantOption.parse(e.option)
        up = stepped_up(opt)
        if up is None or not up.fits(e.shape[-1]):
            continue
        n, rec = int(hot.counts.size), (m.tensors.get(e.key) if m is not None else None)
        if rec is not None and p.multiplier:
            gain = weight * (_damage_at(rec, opt, power) - _damage_at(rec, up, power))
            n = rows_worth_it(hot, gain, p.multiplier, extra_bits(opt, n, tuple(e.shape)) / n)
        if n:
            out[e.key] = {"option": up.desc, "rows": n, "extra_bits": extra_bits(opt, n, tuple(e.shape))}
    return out


COLD_ROWS_NOTE_BPW = 3.5  # a lookup table's rows below this (mlx-lm's 3-bit g64) get a note at conversion


def cold_rows_notes(p: Plan, tables: Collection[str]) -> list[str]:
    """A line for each lookup table (path in ``tables``) whose rows outside the frequent-token ones are planned
    below :data:`COLD_ROWS_NOTE_BPW`: text that uses other tokens (another language or script) loses more than
    the calibration text measured, and the user should know how to avoid it."""
    out = []
    for e in p.tensors:
        opt = QuantOption.parse(e.option) if e.key in tables else None
        if opt is None or opt.nominal_bpw() >= COLD_ROWS_NOTE_BPW:
            continue
        rows, hot = int(e.shape[0]), int((p.settings.get("row_split") or {}).get(e.key, {}).get("rows", 0))
        which = f"{rows - hot:,} of its {rows:,} rows (all but the {hot:,} frequent tokens')" if hot else \
            f"all {rows:,} rows"
        out.append(f"{e.key}: {which} are stored at {opt.nominal_bpw():.2f} bpw ({e.option}); text in another "
                   "language or script will lose more than measured: add such text with '--calib bundled --calib "
                   "FILE', or raise --bpw")
    return out


def _damage_at(rec: Any, option: QuantOption, err_power: float = 2.0) -> float:
    """The damage the optimizer sees for ``option`` of tensor record ``rec``; an option not measured: the measured
    one of most bits up to its bits (a lower damage estimate for the planned option, a higher one for finer)."""
    below = [o for o in rec.options if o.option.nominal_bpw() <= option.nominal_bpw() + 1e-9] or rec.options
    o = next((o for o in rec.options if o.option.desc == option.desc),
             max(below, key=lambda o: o.option.nominal_bpw()))
    return option_damage(o.err, rec.importance, o.damage, err_power)


def with_row_splits(p: Plan, hot_rows: dict[str, HotRows], plan_for: Callable[[float], Plan],
                    notes: list[str], m: Measurement | None = None) -> Plan:
    """``p``'s target met with frequent-token rows: replanned on a smaller budget until the rows' extra bits fit.

    The rows' bits come out of the budget; which rows repay them is judged from ``m`` (:func:`row_splits`). The
    plan records them in ``settings["row_split"]`` and its used bits and averages include them.
    """
    plan = p
    for _ in range(4):
        splits = row_splits(plan, hot_rows, m)
        extra = sum(v["extra_bits"] for v in splits.values())
        if not splits or plan.used_bits + extra <= p.budget_bits:
            break
        try:  # a budget that leaves the rows' bits free (the table's option, and so its rows' bits, may change)
            plan = plan_for((p.budget_bits - extra) / p.numel)
        except ValueError as e:  # no room for the rows below the target: plan without them
            notes.append(f"frequent-token rows left out: {e}")
            return p
    else:
        notes.append("frequent-token rows left out: their bits did not fit the target")
        return p
    if not splits:
        return plan
    total_numel = sum(e.numel for e in plan.tensors)
    plan.used_bits += extra
    plan.achieved_bpw = plan.used_bits / plan.numel
    plan.total_bpw += extra / total_numel if total_numel else 0.0
    plan.target_bpw, plan.budget_bits = p.target_bpw, p.budget_bits
    plan.settings = {**plan.settings, "row_split": splits}
    return plan


def plan_from_options(options: dict[str, str], source: Any) -> Plan:
    """A plan from a hand-written mapping of module path -> option description (a fixed recipe)."""
    mods = quantizable_modules(build_model(source.config))
    entries, used, numel = [], 0, 0
    for key, desc in options.items():
        if key not in mods:
            raise InputError(f"the recipe names a tensor the model does not have: {key!r}")
        opt = QuantOption.parse(desc)
        shape = [int(d) for d in mods[key].weight.shape]
        bits = opt.storage_bits(shape)
        entries.append(PlanEntry(key=key, option=opt.desc, bits=bits, shape=shape, numel=math.prod(shape)))
        used, numel = used + bits, numel + math.prod(shape)
    bpw = used / numel if numel else 0.0
    return Plan(target_bpw=bpw, achieved_bpw=bpw, objective=0.0, lower_bound=None, gap=None, budget_bits=used,
                used_bits=used, numel=numel, total_bpw=bpw, tensors=entries, method="recipe")


# --------------------------------------------------------------------------- inputs that belong to a model
def embedding_tables(config: dict) -> dict[str, int]:
    """Path -> rows of every embedding (lookup table) of the model ``config`` describes (no weights)."""
    import mlx.nn as nn

    return {p: int(m.weight.shape[0]) for p, m in quantizable_modules(build_model(config)).items()
            if isinstance(m, nn.Embedding)}


def available_hot_rows(config: dict, ids: Any) -> dict[str, HotRows]:
    """Embedding path -> its candidate frequent-token rows in the token ``ids`` (:func:`mlx_dq.quant.rowsplit.hot_counts`)."""
    return {p: hot_counts(ids, vocab) for p, vocab in embedding_tables(config).items()}


def planned_row_splits(p: Plan, tokens: Any) -> dict[str, tuple[Any, QuantOption]]:
    """What the quantizer needs for ``p``'s frequent-token rows: table -> (hot ids from the calibration text's
    ``tokens``, at most the rows planned; hot option)."""
    out = {}
    for path, spec in (p.settings.get("row_split") or {}).items():
        vocab = p.entry(path).shape[0]
        ids = hot_ids(tokens, vocab, limit=int(spec["rows"]))  # another calibration than the plan's: the most frequent
        if ids.size:
            out[path] = (ids, QuantOption.parse(spec["option"]))
    return out


def grid_bpw_range(source: Any, grid: Any = None, mlx_lm_compatible: bool = False,
                   head_option: str | None = None) -> tuple[float, float]:
    """The least and most bits per weight a plan from ``grid``'s options can reach on ``source``'s budget tensors
    (each at its cheapest or dearest fitting option; 16-bit when none fits), from the shapes alone."""
    from mlx_dq.measure.grids import load_grid
    from mlx_dq.names import in_head_scope, role_of

    grid_map = grid if isinstance(grid, dict) else load_grid(grid)
    lo = hi = numel = 0
    for key, shape in model_shapes(source.config).items():
        role = role_of(key)
        if head_option is not None and in_head_scope(role, key):
            continue
        opts = [o for o in fitting_options(grid_map.get(role, []), shape[-1])
                if not (mlx_lm_compatible and o.is_mixed)] or [QuantOption.fp16()]
        bits = [o.storage_bits(shape) for o in opts]
        lo, hi, numel = lo + min(bits), hi + max(bits), numel + math.prod(shape)
    return lo / max(numel, 1), hi / max(numel, 1)


def check_target_in_grid(source: Any, bpw: float, grid: Any = None, mlx_lm_compatible: bool = False,
                         head_option: str | None = None) -> None:
    """InputError before measuring when ``bpw`` is outside what ``grid``'s options can reach on ``source``: the
    optimizer would refuse it only after the measurement."""
    lo, hi = grid_bpw_range(source, grid, mlx_lm_compatible, head_option)
    if not lo - 1e-9 <= bpw <= hi + 1e-9:
        raise InputError(f"target {bpw:g} bpw is outside what the option grid ({grid or 'default'}) can reach on "
                         f"{source.spec}: {lo:.4f} to {hi:.4f} bpw"
                         + (" (mlx-lm compatible options only)" if mlx_lm_compatible else ""))


def model_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Module path -> weight shape of every quantizable tensor of the model ``config`` describes (no weights)."""
    return {p: tuple(int(d) for d in m.weight.shape) for p, m in quantizable_modules(build_model(config)).items()}


def _describe(model: dict | None) -> str:
    model = model or {}
    spec = model.get("spec") or "an unnamed model"
    kind = model.get("model_type")
    return f"{spec}" + (f" ({kind})" if kind else "")


def check_belongs_to(
    what: str, path: str, recorded: dict | None, shapes: dict[str, tuple[int, ...]] | dict[str, list[int]],
    source: Any, model_shapes_: dict[str, tuple[int, ...]], allow_other_model: bool,
) -> list[str]:
    """Check a measurement or plan (``what`` read from ``path``) was made for ``source``; returns notes to print.

    ``recorded`` is the model record it carries (spec, model_type, fingerprint);
    ``shapes`` its tensors' shapes. A different fingerprint is refused unless
    ``allow_other_model``; names or shapes the model lacks are always refused.
    Tensors of the model that the file does not cover are listed in the notes
    (they stay 16-bit).
    """
    notes: list[str] = []
    fp = (recorded or {}).get("fingerprint")
    if fp:
        mine = source.fingerprint()
        if fp != mine:
            msg = (f"the {what} {path} was made for another model: {_describe(recorded)}, not {source.spec} "
                   f"({source.config.get('model_type')})")
            if not allow_other_model:
                raise InputError(msg + "; pass --allow-other-model to reuse it for a model of the same architecture")
            notes.append(msg + " (allowed by --allow-other-model)")
    else:
        notes.append(f"the {what} {path} carries no model fingerprint (another tool's file?): cannot check "
                     f"it was made for {source.spec}; only names and shapes are checked")
    unknown = sorted(k for k in shapes if k not in model_shapes_)
    if unknown:
        raise InputError(f"the {what} {path} names tensors that {source.spec} does not have: {unknown[:3]}"
                         + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""))
    bad = [(k, tuple(s), model_shapes_[k]) for k, s in shapes.items() if tuple(s) != model_shapes_[k]]
    if bad:
        k, s, m = bad[0]
        raise InputError(f"the {what} {path} does not match {source.spec}: tensor {k!r} has shape {list(s)} there "
                         f"but {list(m)} in the model" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return notes


def check_plan_input(plan: Any, given: Any, source: Any, allow_other_model: bool) -> list[str]:
    """Check a plan read for ``source`` belongs to it (see :func:`check_belongs_to`); returns notes."""
    where = str(given) if isinstance(given, (str, os.PathLike)) else "given"
    recorded = (plan.source or {}).get("model") if isinstance(plan.source, dict) else None
    return check_belongs_to("plan", where, recorded, {e.key: e.shape for e in plan.tensors}, source,
                            model_shapes(source.config), allow_other_model)


def check_measurement_input(m: Any, given: Any, source: Any, allow_incomplete: bool,
                            allow_other_model: bool) -> list[str]:
    """Check a measurement read for ``source``: complete (unless allowed) and made for it; returns notes."""
    where = str(given) if isinstance(given, (str, os.PathLike)) else "given"
    notes = []
    if not measurement_complete(m):
        if not allow_incomplete:
            raise InputError(
                f"the measurement {where} is unfinished (measured up to layer {m.last_module_idx}; embedding "
                "and head not measured): resume it by running the same measure command again, or pass "
                "--allow-incomplete to leave the unmeasured tensors 16-bit"
            )
        notes.append(f"the measurement {where} is unfinished (allowed by --allow-incomplete)")
    notes += check_belongs_to("measurement", where, m.model, {k: t.shape for k, t in m.tensors.items()},
                              source, model_shapes(source.config), allow_other_model)
    return notes
