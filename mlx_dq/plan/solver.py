"""Optimizer: pick one option per tensor to meet a bits-per-weight target with the least damage.

The problem is a multiple-choice knapsack. Every decoder tensor (or jointly
measured module) is one item whose choices are its measured options, each with
exact MLX storage bits (codes, scales, biases, permutation) and a predicted
damage ``importance * err ** err_power``.

Why ``err ** 2``: ``err`` is a relative Frobenius error of the tensor's output,
so ``err ** 2`` is the relative energy of the noise that tensor adds; noise from
different tensors is close to independent, so energies add and the sum tracks
the output noise of the whole model. ``importance`` (from the measurer; 1.0
for ExLlamaV2 files) converts a tensor's relative noise into model-level damage.
ExLlamaV2 likewise sums a power of per-module errors; ``err_power`` changes it.

Solver: the LP relaxation of the knapsack (equal to the Lagrangian dual) is
solved exactly by walking the lower convex hull of every item's (bits, damage)
points in order of damage decrease per bit; its value is a lower bound on any
plan. The integer plan from that walk is then improved with the budget left:
greedy fill-in upgrades by damage decrease per bit, then exchanges (one item,
or a pair of items, changed at once) while any move lowers damage within the
budget. The plan reports objective, lower bound and gap.

Scopes: decoder tensors share the budget; embedding and head (tied: one tensor)
get ``head_option`` outside it, like ExLlamaV2's ``head_bits``; tensors kept in
16-bit count 16 bits per weight in the budget.

Embedding and head in the budget: their damage is measured end to end on the
calibration text, the decoder's is predicted from residual importance; on text
of other domains the decoder's real damage runs above its prediction while the
embedding/head's does not, and on text like the calibration's the frequent-token
rows cut the embedding's real damage well below its measurement. Their damage
therefore counts ``head_damage_weight`` (default :data:`HEAD_DAMAGE_WEIGHT`) of
the decoder's (docs/pipeline.md, "The head").
"""

from __future__ import annotations

import inspect
import math
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from mlx_dq.errors import InputError
from mlx_dq.measure.records import Measurement, OptionRecord, TensorRecord
from mlx_dq.names import in_head_scope
from mlx_dq.plan.keeprules import key_matches, part_of
from mlx_dq.plan.plan import Plan, PlanEntry
from mlx_dq.quant.options import QuantOption

DEFAULT_HEAD_OPTION = "1.0:6b_64g"
HEAD_DAMAGE_WEIGHT = 0.5


# --------------------------------------------------------------------------- problem
@dataclass
class Item:
    """One knapsack item: a tensor or a jointly measured module, with its choices' bits and damage."""

    key: str
    members: list[str]
    numel: int
    bits: np.ndarray
    damage: np.ndarray
    choices: list  # OptionRecord | JointOption | None (16-bit)
    errs: list


@dataclass
class Problem:
    """The knapsack: items sharing ``budget`` bits over ``numel`` weights, plus entries fixed outside it."""

    items: list[Item]
    fixed: list[PlanEntry]
    kept: list[str]
    numel: int
    budget: int
    target: float
    settings: dict


def _head_scope(m: Measurement, t: TensorRecord) -> bool:
    return in_head_scope(t.role, t.key, m.tied)



def _build(
    m: Measurement,
    target_bpw: float,
    head_option: str | QuantOption | None,
    keep: Sequence[str],
    keep_most_sensitive: int | Mapping[str, int] | None,
    parts: Mapping[str, Sequence[str]] | None,
    mlx_lm_compatible: bool,
    err_power: float,
    keep_outside_budget: bool,
    head_damage_weight: float,
) -> Problem:
    """Turn a measurement and the user's rules into knapsack items plus fixed entries."""
    if not isinstance(target_bpw, (int, float)) or not math.isfinite(target_bpw) or target_bpw <= 0:
        raise InputError(f"target bpw must be a positive number, got {target_bpw!r}")
    if not isinstance(head_damage_weight, (int, float)) or not math.isfinite(head_damage_weight) \
            or head_damage_weight <= 0:
        raise InputError(f"head damage weight must be a positive number, got {head_damage_weight!r}")
    head_opt = QuantOption.parse(head_option) if isinstance(head_option, str) else head_option
    if mlx_lm_compatible and head_opt is not None and head_opt.is_mixed:
        raise InputError(f"head option {head_opt.desc} is mixed; --mlx-lm-compatible needs a whole-tensor option")
    items, fixed = _items(m, head_opt, keep, mlx_lm_compatible, err_power, head_damage_weight)
    kept = {e.key for e in fixed if e.scope == "kept"}
    keep_keys = _keep_keys(m, items, fixed, keep, keep_most_sensitive, parts, target_bpw, err_power)
    kept |= _apply_keeps(m, items, fixed, keep_keys, keep_outside_budget)
    numel_budget = sum(it.numel for it in items)
    budget = int(math.floor(target_bpw * numel_budget + 1e-6))  # tolerate float rounding of target x weights
    settings = {
        "head_option": None if head_opt is None else head_opt.desc, "keep": list(keep),
        "keep_most_sensitive": keep_most_sensitive,
        "parts": None if parts is None else {k: list(v) for k, v in parts.items()},
        "mlx_lm_compatible": mlx_lm_compatible, "err_power": err_power,
        "keep_outside_budget": keep_outside_budget, "head_damage_weight": float(head_damage_weight),
    }
    return Problem(items, fixed, sorted(kept), numel_budget, budget, float(target_bpw), settings)


def _head_entry(t: TensorRecord, head_opt: QuantOption, keep: Sequence[str]) -> PlanEntry:
    """The fixed entry of an embedding or head outside the budget: ``head_opt``, or 16-bit when ``keep`` names it."""
    opt = QuantOption.fp16() if key_matches(t.key, keep) else head_opt
    if not opt.fits(t.shape[-1]):
        raise InputError(f"head option {opt.desc} does not fit {t.key!r} with {t.shape[-1]} inputs")
    rec = t.find(opt)
    scope = "kept" if opt.keep16 else "head"
    return PlanEntry(t.key, opt.desc, opt.storage_bits(t.shape), list(t.shape), t.numel,
                     rec.err if rec else (0.0 if opt.keep16 else None), scope)


def _items(m: Measurement, head_opt: QuantOption | None, keep: Sequence[str], mlx_lm_compatible: bool,
           err_power: float, head_damage_weight: float) -> tuple[list[Item], list[PlanEntry]]:
    """One knapsack item per measured tensor and per jointly measured module, and the head's fixed entries."""
    fixed: list[PlanEntry] = []
    items: list[Item] = []

    def allowed(opt: QuantOption) -> bool:
        return not (mlx_lm_compatible and opt.is_mixed)

    grouped = m.grouped_keys()
    tied_alias = {k for k in m.tied if k in m.tensors and m.tied[k] in m.tensors}
    for t in m.tensors.values():
        if t.key in grouped or t.key in tied_alias:
            continue
        head = _head_scope(m, t)
        if head and head_opt is not None:
            fixed.append(_head_entry(t, head_opt, keep))
            continue
        weight = head_damage_weight if head else 1.0
        recs = [r for r in t.options if allowed(r.option)]
        if not recs:
            raise InputError(f"tensor {t.key!r} has no usable option"
                             + (" (only mixed options were measured)" if mlx_lm_compatible else ""))
        items.append(Item(
            t.key, [t.key], t.numel, np.array([r.total_bits for r in recs], dtype=np.int64),
            weight * np.array([option_damage(r.err, t.importance, r.damage, err_power) for r in recs]), recs,
            [r.err for r in recs],
        ))
    for g in m.groups.values():
        opts = [o for o in g.options if all(allowed(r.option) for r in o.members.values())]
        if not opts:
            raise InputError(f"module {g.key!r} has no usable joint option"
                             + (" (every one has a mixed member)" if mlx_lm_compatible else ""))
        items.append(Item(
            g.key, list(g.members), sum(m.tensors[k].numel for k in g.members),
            np.array([o.total_bits for o in opts], dtype=np.int64),
            np.array([option_damage(o.err, g.importance, None, err_power) for o in opts]), opts, [o.err for o in opts],
        ))
    return items, fixed


def _keep_keys(m: Measurement, items: list[Item], fixed: list[PlanEntry], keep: Sequence[str],
               keep_most_sensitive: int | Mapping[str, int] | None, parts: Mapping[str, Sequence[str]] | None,
               target_bpw: float, err_power: float) -> set[str]:
    """The budget tensors to keep 16-bit: those ``keep`` names, then the most sensitive of each part."""
    all_keys = [k for it in items for k in it.members] + [e.key for e in fixed]
    for pat in keep:
        if not any(key_matches(k, [pat]) for k in all_keys):
            raise InputError(f"keep pattern {pat!r} matches no tensor of the measurement")
    keep_keys = {k for it in items for k in it.members if key_matches(k, keep)}
    if keep_most_sensitive:
        keep_keys.update(_most_sensitive(m, items, keep_most_sensitive, parts, target_bpw, err_power))
    return keep_keys


def _most_sensitive(m: Measurement, items: list[Item], rule: int | Mapping[str, int],
                    parts: Mapping[str, Sequence[str]] | None, target_bpw: float, err_power: float) -> list[str]:
    """The N most sensitive tensors of each part (N from ``rule``), by their item's damage near the target."""
    ref_sens = {it.key: _sensitivity(it, target_bpw) for it in items}
    per_part: dict[str, list[tuple[float, float, str]]] = {}
    for it in items:
        for k in it.members:
            p = part_of(k, parts)
            if p is not None:
                own = _member_sensitivity(it, k, m, target_bpw, err_power)
                per_part.setdefault(p, []).append((ref_sens[it.key], own, k))
    out: list[str] = []
    for p, lst in per_part.items():
        n = rule if isinstance(rule, int) else int(rule.get(p, 0))
        lst.sort(key=lambda sk: (-sk[0], -sk[1], sk[2]))  # ties (members of one joint item): own damage
        out.extend(k for _, _, k in lst[: max(n, 0)])
    return out


def _apply_keeps(m: Measurement, items: list[Item], fixed: list[PlanEntry], keep_keys: set[str],
                 outside: bool) -> set[str]:
    """Make the ``keep_keys`` members 16-bit (``outside``: out of the budget, whole ones as fixed entries)."""
    kept: set[str] = set()
    for it in items:
        for k in it.members:
            if k in keep_keys:
                _keep_member(it, m.tensors[k], outside=outside)
                kept.add(k)
    if outside:  # kept tensors leave the budget: whole ones become fixed entries
        for it in [it for it in items if len(it.members) == 1 and it.choices == [None]]:
            t = m.tensors[it.key]
            fixed.append(PlanEntry(t.key, "16bit", 16 * t.numel, list(t.shape), t.numel, 0.0, "kept"))
            items.remove(it)
    return kept


def option_damage(err: float | None, importance: float, damage: float | None = None, err_power: float = 2.0) -> float:
    """The damage the optimizer counts for one measured option: ``damage`` where it was measured end to end (the
    head), else ``importance * err ** err_power`` (0 without an error: a joint option's members)."""
    if damage is not None:
        return float(damage)
    return 0.0 if err is None else importance * float(err) ** err_power


def _sensitivity(it: Item, target: float) -> float:
    """Damage at the choice nearest the target bpw: how much this item suffers at this budget."""
    bpw = it.bits / it.numel
    return float(it.damage[int(np.argmin(np.abs(bpw - target)))])


def _member_sensitivity(it: Item, key: str, m: Measurement, target: float, err_power: float = 2.0) -> float:
    """A member's own measured damage near the target, to order tensors whose items tie.

    A whole tensor: its item's damage. A joint member: its own error where one was measured,
    else how much the module's error grows between the options where this member is widest
    and those where it is narrowest (measured joint errors, no guess).
    """
    if len(it.members) == 1:
        return _sensitivity(it, target)
    t = m.tensors[key]
    own = [r for r in t.options if r.err is not None]
    if own:
        r = min(own, key=lambda r: abs(r.bpw - target))
        return option_damage(r.err, t.importance, r.damage, err_power)
    rows = [(c.members[key].total_bits, float(d)) for c, d in zip(it.choices, it.damage)
            if getattr(c, "members", None) and c.members.get(key) is not None]
    if len(rows) < 2:
        return 0.0
    lo, hi = min(b for b, _ in rows), max(b for b, _ in rows)
    at_lo = [d for b, d in rows if b == lo]
    at_hi = [d for b, d in rows if b == hi]
    return float(np.mean(at_lo) - np.mean(at_hi))


def _keep_member(it: Item, t: TensorRecord, outside: bool = False) -> None:
    """Make member ``t`` of item ``it`` 16-bit: its bits become 16/weight (0 in the budget when ``outside``);
    whole tensors lose all damage."""
    full = 0 if outside else 16 * t.numel
    if len(it.members) == 1:
        it.bits = np.array([full], dtype=np.int64)
        it.damage = np.array([0.0])
        it.choices = [None]
        it.errs = [0.0]
        return
    # a member of a joint option: swap its bits for 16-bit ones, keep the (conservative) joint damage
    it.bits = np.array([b - c.members[t.key].total_bits + full for b, c in zip(it.bits, it.choices)], dtype=np.int64)
    if outside:
        it.numel -= t.numel
    it.choices = [_JointKept(c, t.key) for c in it.choices]


@dataclass
class _JointKept:
    """A joint option with some members replaced by 16-bit."""

    base: Any
    kept_key: str

    @property
    def members(self) -> dict:
        mem = dict(self.base.members)
        mem[self.kept_key] = None
        return mem

    @property
    def err(self) -> float:
        return self.base.err


def range_error(p: Problem, lo: int, hi: int, what: str) -> InputError:
    return InputError(
        f"target {p.target:g} bpw is {what}: achievable range for this measurement is "
        f"{lo / p.numel:.4f} to {hi / p.numel:.4f} bpw"
        + (" (mlx-lm compatible options only)" if p.settings.get("mlx_lm_compatible") else "")
    )


def check_range(p: Problem) -> None:
    if not p.items:
        raise InputError("the measurement has no tensor to plan inside the budget")
    lo = sum(int(it.bits.min()) for it in p.items)
    hi = sum(int(it.bits.max()) for it in p.items)
    if p.budget < lo:
        raise range_error(p, lo, hi, "below the smallest achievable size")
    if p.target * p.numel > hi + 1e-6 * p.numel:
        raise range_error(p, lo, hi, "above the largest achievable size")


# --------------------------------------------------------------------------- solver
def _prune(it: Item) -> np.ndarray:
    """Indices of non-dominated choices, cheapest first (damage strictly falls as bits rise)."""
    order = np.lexsort((it.damage, it.bits))
    keep, best = [], math.inf
    for j in order:
        if it.damage[j] < best:
            keep.append(int(j))
            best = it.damage[j]
    return np.array(keep, dtype=np.int64)


def _hull(bits: np.ndarray, dmg: np.ndarray) -> list[int]:
    """Lower convex hull (positions into pruned arrays) of points sorted by bits with falling damage."""
    h: list[int] = []
    for j in range(len(bits)):
        while len(h) >= 2:
            a, b = h[-2], h[-1]
            # drop b if it lies on or above the segment a -> j
            if (dmg[b] - dmg[a]) * (bits[j] - bits[a]) >= (dmg[j] - dmg[a]) * (bits[b] - bits[a]):
                h.pop()
            else:
                break
        h.append(j)
    return h


def _lp_walk(p: Problem, pruned: list[np.ndarray]) -> tuple[list[int], float, float]:
    """Exact LP relaxation: greedy over hull increments. Returns integer choice positions, bound, lambda."""
    incs = []
    for i, (it, idx) in enumerate(zip(p.items, pruned)):
        b, d = it.bits[idx], it.damage[idx]
        h = _hull(b, d)
        for a, c in zip(h, h[1:]):
            db, dd = int(b[c] - b[a]), float(d[a] - d[c])
            incs.append((dd / db, i, c, db, dd))
    incs.sort(key=lambda x: (-x[0], x[1], x[2]))
    pos = [0] * len(p.items)
    used = sum(int(it.bits[idx[0]]) for it, idx in zip(p.items, pruned))
    dmg = sum(float(it.damage[idx[0]]) for it, idx in zip(p.items, pruned))
    for slope, i, c, db, dd in incs:
        if used + db <= p.budget:
            pos[i], used, dmg = c, used + db, dmg - dd
        else:
            return pos, dmg - (p.budget - used) * slope, slope
    return pos, dmg, 0.0


def _moves(p: Problem, pruned: list[np.ndarray], pos: list[int]) -> tuple[np.ndarray, ...]:
    db, dd, item, to = [], [], [], []
    for i, (it, idx) in enumerate(zip(p.items, pruned)):
        b, d = it.bits[idx], it.damage[idx]
        cur = pos[i]
        n = len(idx)
        db.append(b - b[cur])
        dd.append(d - d[cur])
        item.append(np.full(n, i))
        to.append(np.arange(n))
    db, dd, item, to = (np.concatenate(x) for x in (db, dd, item, to))
    mask = to != np.concatenate([np.full(len(idx), pos[i]) for i, idx in enumerate(pruned)])
    return db[mask], dd[mask], item[mask], to[mask]


def _fill_in(p: Problem, pruned: list[np.ndarray], pos: list[int], used: int) -> int:
    """Greedy upgrades with the leftover budget, best damage decrease per bit first."""
    while True:
        db, dd, item, to = _moves(p, pruned, pos)
        ok = (db <= p.budget - used) & (dd < 0)
        if not ok.any():
            return used
        ratio = np.where(db[ok] > 0, -dd[ok] / np.maximum(db[ok], 1), np.inf)
        k = np.flatnonzero(ok)[int(np.argmax(ratio))]
        pos[int(item[k])] = int(to[k])
        used += int(db[k])


def _best_pair(db: np.ndarray, dd: np.ndarray, item: np.ndarray, slack: int) -> tuple[float, int, int]:
    """Best pair of moves on two different items with total bits <= slack (damage change, move a, move b)."""
    n = len(db)
    if n < 2:
        return math.inf, -1, -1
    order = np.argsort(db, kind="stable")
    sdb, sdd, sit = db[order], dd[order], item[order]
    b1 = np.empty(n, dtype=np.int64)
    b2 = np.full(n, -1, dtype=np.int64)
    best1, best2 = -1, -1
    for k in range(n):  # prefix best and best on another item
        if best1 < 0 or sdd[k] < sdd[best1]:
            if best1 >= 0 and sit[best1] != sit[k]:
                best2 = best1  # else best2 already lies on another item than k
            best1 = k
        elif sit[k] != sit[best1] and (best2 < 0 or sdd[k] < sdd[best2]):
            best2 = k
        b1[k], b2[k] = best1, best2
    lim = np.searchsorted(sdb, slack - sdb, side="right") - 1
    valid = lim >= 0
    limc = np.maximum(lim, 0)
    cand = b1[limc]
    same = sit[cand] == sit
    cand = np.where(same, b2[limc], cand)
    valid &= cand >= 0
    total = np.where(valid, sdd + sdd[np.maximum(cand, 0)], np.inf)
    k = int(np.argmin(total))
    if not np.isfinite(total[k]):
        return math.inf, -1, -1
    return float(total[k]), int(order[k]), int(order[cand[k]])


def _exchange(p: Problem, pruned: list[np.ndarray], pos: list[int], used: int, tol: float, rounds: int) -> int:
    """Local search: apply the best single or pair move that lowers damage within budget, until none."""
    for _ in range(rounds):
        db, dd, item, to = _moves(p, pruned, pos)
        slack = p.budget - used
        ok = db <= slack
        single = float(dd[ok].min()) if ok.any() else math.inf
        pair, a, b = _best_pair(db, dd, item, slack)
        if min(single, pair) >= -tol:
            break
        if single <= pair:
            k = np.flatnonzero(ok)[int(np.argmin(dd[ok]))]
            pos[int(item[k])] = int(to[k])
            used += int(db[k])
        else:
            for k in (a, b):
                pos[int(item[k])] = int(to[k])
                used += int(db[k])
        used = _fill_in(p, pruned, pos, used)
    return used


def _pareto_dp(p: Problem, pruned: list[np.ndarray], max_states: int) -> tuple[list[int], float] | None:
    """Exact optimum by dynamic programming over the Pareto frontier of (bits, damage).

    Returns None when the frontier grows past ``max_states`` (large models).
    """
    states_b = np.zeros(1, dtype=np.int64)
    states_d = np.zeros(1)
    trail: list[tuple[np.ndarray, np.ndarray]] = []
    rest_min = np.cumsum([int(it.bits[idx].min()) for it, idx in zip(p.items, pruned)][::-1])[::-1]
    for i, (it, idx) in enumerate(zip(p.items, pruned)):
        after = int(rest_min[i + 1]) if i + 1 < len(p.items) else 0
        cb = (states_b[:, None] + it.bits[idx][None, :]).ravel()
        cd = (states_d[:, None] + it.damage[idx][None, :]).ravel()
        src = np.arange(cb.size)
        ok = cb + after <= p.budget
        cb, cd, src = cb[ok], cd[ok], src[ok]
        order = np.lexsort((cd, cb))
        cb, cd, src = cb[order], cd[order], src[order]
        prev_best = np.concatenate([[np.inf], np.minimum.accumulate(cd)[:-1]])
        front = cd < prev_best
        states_b, states_d, src = cb[front], cd[front], src[front]
        if states_b.size > max_states:
            return None
        trail.append((src // len(idx), src % len(idx)))
    k = int(np.argmin(states_d))
    best = float(states_d[k])
    pos = [0] * len(p.items)
    for i in range(len(p.items) - 1, -1, -1):
        parent, choice = trail[i]
        pos[i] = int(choice[k])
        k = int(parent[k])
    return pos, best


def _entries(p: Problem, m: Measurement, choice: list[int]) -> list[PlanEntry]:
    out: list[PlanEntry] = []
    for it, j in zip(p.items, choice):
        c = it.choices[j]
        if c is None:  # kept whole tensor
            t = m.tensors[it.key]
            out.append(PlanEntry(t.key, "16bit", 16 * t.numel, list(t.shape), t.numel, 0.0, "kept"))
        elif isinstance(c, OptionRecord):
            t = m.tensors[it.key]
            out.append(PlanEntry(t.key, c.option.desc, c.total_bits, list(t.shape), t.numel, c.err, "budget",
                                 exl2_desc=c.exl2_desc))
        else:
            for k, r in c.members.items():
                t = m.tensors[k]
                if r is None:
                    out.append(PlanEntry(k, "16bit", 16 * t.numel, list(t.shape), t.numel, 0.0, "kept", it.key))
                else:
                    out.append(PlanEntry(k, r.option.desc, r.total_bits, list(t.shape), t.numel, c.err, "budget",
                                         it.key, r.exl2_desc))
    return out + list(p.fixed)


def make_plan(p: Problem, m: Measurement, choice: list[int], bound: float | None, method: str, t0: float) -> Plan:
    used = sum(int(it.bits[j]) for it, j in zip(p.items, choice))
    obj = float(sum(float(it.damage[j]) for it, j in zip(p.items, choice)))
    entries = _entries(p, m, choice)
    all_bits = sum(e.bits for e in entries)
    all_numel = sum(e.numel for e in entries)
    gap = None if bound is None else max(obj - bound, 0.0)
    return Plan(
        target_bpw=p.target, achieved_bpw=used / p.numel, objective=obj, lower_bound=bound, gap=gap,
        budget_bits=p.budget, used_bits=used, numel=p.numel, total_bpw=all_bits / all_numel, tensors=entries,
        kept=list(p.kept), method=method, settings=p.settings,
        source={"model": m.model, "source_format": m.source_format, "base_perplexity": m.base_perplexity},
        wall_s=time.perf_counter() - t0,
    )


@dataclass(frozen=True)
class SolverEffort:
    """How hard :func:`optimize` searches, apart from what it plans for.

    ``exchange_rounds`` caps the exchange passes after the greedy fill-in; when the exact Pareto dynamic
    program stays under ``exact_states`` states it replaces the heuristic (gap 0; 0 turns it off).
    """

    exchange_rounds: int = 500
    exact_states: int = 2000


def optimize(
    measurement: Measurement,
    target_bpw: float,
    *,
    head_option: str | QuantOption | None = DEFAULT_HEAD_OPTION,
    keep: Sequence[str] = (),
    keep_most_sensitive: int | Mapping[str, int] | None = None,
    parts: Mapping[str, Sequence[str]] | None = None,
    mlx_lm_compatible: bool = False,
    err_power: float = 2.0,
    keep_outside_budget: bool = False,
    head_damage_weight: float = HEAD_DAMAGE_WEIGHT,
    effort: SolverEffort = SolverEffort(),
) -> Plan:
    """Plan one option per tensor: least predicted damage with stored bits <= target_bpw x weights.

    ``head_option`` fixes embedding/head outside the budget (None: they join it);
    ``keep`` lists names or glob patterns kept 16-bit; ``keep_most_sensitive`` keeps
    the N most sensitive tensors of each part (an int for every part, or part -> N,
    parts given by ``parts`` as part -> patterns or by :func:`mlx_dq.plan.keeprules.default_part`);
    ``mlx_lm_compatible`` allows whole-tensor options only; ``keep_outside_budget`` leaves kept
    tensors out of the bpw budget (they still count in ``total_bpw``). ``head_damage_weight``: what an
    embedding's or head's measured damage counts against the decoder's (module docstring). ``effort``: the
    exchange rounds and the exact dynamic program's size (:class:`SolverEffort`).
    """
    t0 = time.perf_counter()
    p = _build(measurement, target_bpw, head_option, keep, keep_most_sensitive, parts, mlx_lm_compatible, err_power,
               keep_outside_budget, head_damage_weight)
    check_range(p)
    pruned = [_prune(it) for it in p.items]
    pos, bound, lam = _lp_walk(p, pruned)
    used = sum(int(it.bits[idx[j]]) for it, idx, j in zip(p.items, pruned, pos))
    used = _fill_in(p, pruned, pos, used)
    scale = max(bound, 1e-300)
    used = _exchange(p, pruned, pos, used, 1e-12 * scale, effort.exchange_rounds)
    method = "lagrangian+exchange"
    exact = _pareto_dp(p, pruned, effort.exact_states) if effort.exact_states > 0 else None
    if exact is not None:
        pos, bound = exact[0], exact[1]
        method = "exact-pareto-dp"
    choice = [int(idx[j]) for idx, j in zip(pruned, pos)]
    plan = make_plan(p, measurement, choice, bound, method, t0)
    plan.multiplier = lam
    if plan.used_bits > p.budget:  # the solver never does this; guard the invariant
        raise RuntimeError("internal error: plan exceeds the budget")
    if bound is not None and plan.objective < bound - 1e-9 * max(abs(bound), 1e-300):
        raise RuntimeError("internal error: objective below the lower bound")
    return plan


def build_problem(measurement: Measurement, target_bpw: float, **kw: Any) -> Problem:
    """The knapsack problem from :func:`optimize`'s keyword options (for planning baselines, which take the same
    ones); TypeError naming any other."""
    unknown = sorted(set(kw) - set(_PROBLEM_KEYWORDS))
    if unknown:
        raise TypeError(f"unexpected arguments: {unknown}")
    defaults = inspect.signature(optimize).parameters  # one place for the defaults: a restated copy went stale once
    return _build(measurement, target_bpw, *(kw.get(k, defaults[k].default) for k in _PROBLEM_KEYWORDS))


# optimize's keywords that shape the problem, in _build's order (``effort`` only says how hard to solve it)
_PROBLEM_KEYWORDS = ("head_option", "keep", "keep_most_sensitive", "parts", "mlx_lm_compatible", "err_power",
                     "keep_outside_budget", "head_damage_weight")

