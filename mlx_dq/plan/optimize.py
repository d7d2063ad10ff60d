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
"""

from __future__ import annotations

import fnmatch
import heapq
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from mlx_dq.errors import InputError
from mlx_dq.measure.records import (
    Measurement,
    OptionRecord,
    TensorRecord,
    write_json_atomic,
)
from mlx_dq.names import default_bits_group, in_head_scope, split_layer
from mlx_dq.quant.options import QuantOption

PLAN_FORMAT = "mlx_dq.plan"
PLAN_VERSION = 1
DEFAULT_HEAD_OPTION = "1.0:6b_64g"
KEEP_RULE = "the N most sensitive tensors of each part stay 16-bit"


# --------------------------------------------------------------------------- plan
@dataclass
class PlanEntry:
    """The option chosen for one tensor."""

    key: str
    option: str
    bits: int
    shape: list[int]
    numel: int
    err: float | None = None
    scope: str = "budget"  # "budget", "head" or "kept"
    group: str | None = None
    exl2_desc: str | None = None


@dataclass
class Plan:
    """One option per tensor plus the accounting that justifies it.

    ``achieved_bpw``, ``objective`` (predicted damage), ``lower_bound`` and ``gap``
    cover the budget scope (decoder tensors, kept ones included); ``total_bpw``
    counts every tensor, head and embedding too. ``multiplier`` is the LP's
    damage-per-bit price at the budget (the Lagrange multiplier).
    """

    target_bpw: float
    achieved_bpw: float
    objective: float
    lower_bound: float | None
    gap: float | None
    budget_bits: int
    used_bits: int
    numel: int
    total_bpw: float
    tensors: list[PlanEntry] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    method: str = "lagrangian+exchange"
    settings: dict = field(default_factory=dict)
    source: dict = field(default_factory=dict)
    wall_s: float = 0.0
    multiplier: float | None = None

    def entry(self, key: str) -> PlanEntry:
        """The entry of tensor ``key``."""
        for e in self.tensors:
            if e.key == key:
                return e
        raise KeyError(f"no tensor {key!r} in the plan")

    def to_json(self) -> dict:
        """The plan as a JSON-ready dict."""
        return {"format": PLAN_FORMAT, "version": PLAN_VERSION, **asdict(self)}


def save_plan(plan: Plan, path: str | Path) -> None:
    """Write a plan as JSON, atomically."""
    write_json_atomic(plan.to_json(), path)


def load_plan(path: str | Path) -> Plan:
    """Read and validate a plan written by :func:`save_plan` (ValueError naming the file otherwise)."""
    path = str(path)
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such plan file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a JSON plan ({e})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read the plan ({e.strerror or e})") from None
    if not isinstance(data, dict) or data.get("format") != PLAN_FORMAT:
        raise InputError(f"{path}: not an {PLAN_FORMAT} file")
    if data.get("version") != PLAN_VERSION:
        raise InputError(f"{path}: unsupported plan version {data.get('version')!r}")
    data = {k: v for k, v in data.items() if k not in ("format", "version")}
    try:
        entries = [PlanEntry(**e) for e in data.pop("tensors")]
        plan = Plan(**data, tensors=entries)
    except (KeyError, TypeError) as e:
        raise InputError(f"{path}: malformed plan: {e}") from None
    try:
        _validate_plan(plan)
    except ValueError as e:
        raise InputError(f"{path}: {e}") from None
    return plan


def _validate_plan(plan: Plan) -> None:
    """ValueError unless every entry of ``plan`` is a well-formed, self-consistent tensor choice."""
    from mlx_dq.safety import finite_number

    for name in ("target_bpw", "achieved_bpw", "total_bpw", "objective"):
        finite_number(getattr(plan, name), name, minimum=0.0)
    for name in ("lower_bound", "gap", "multiplier"):
        if getattr(plan, name) is not None:
            finite_number(getattr(plan, name), name)
    for name in ("budget_bits", "used_bits", "numel"):
        v = getattr(plan, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise InputError(f"{name} must be a non-negative integer, got {v!r}")
    if not isinstance(plan.tensors, list) or not plan.tensors:
        raise InputError("the plan lists no tensors")
    if not isinstance(plan.source, dict) or not isinstance(plan.settings, dict) or not isinstance(plan.kept, list):
        raise InputError("malformed plan: 'source' and 'settings' must be objects, 'kept' a list")
    seen = set()
    for e in plan.tensors:
        if not isinstance(e.key, str) or not e.key:
            raise InputError(f"a tensor key must be a non-empty string, got {e.key!r}")
        if e.key in seen:
            raise InputError(f"tensor {e.key!r} is listed twice")
        seen.add(e.key)
        where = f"tensor {e.key!r}"
        if not isinstance(e.option, str):
            raise InputError(f"{where}: option must be a string, got {e.option!r}")
        try:
            QuantOption.parse(e.option)
        except (ValueError, TypeError, AttributeError) as err:
            raise InputError(f"{where}: {err}") from None
        if (not isinstance(e.shape, list) or len(e.shape) < 2
                or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in e.shape)):
            raise InputError(f"{where}: shape must be a list of positive integers, got {e.shape!r}")
        if isinstance(e.numel, bool) or e.numel != math.prod(e.shape):
            raise InputError(f"{where}: numel {e.numel!r} does not match shape {e.shape}")
        if isinstance(e.bits, bool) or not isinstance(e.bits, int) or e.bits < 0:
            raise InputError(f"{where}: bits must be a non-negative integer, got {e.bits!r}")
        if e.err is not None:
            finite_number(e.err, f"{where}: err", minimum=0.0)
        if e.scope not in ("budget", "head", "kept"):
            raise InputError(f"{where}: scope must be budget, head or kept, got {e.scope!r}")


# --------------------------------------------------------------------------- problem
@dataclass
class _Item:
    key: str
    members: list[str]
    numel: int
    bits: np.ndarray
    damage: np.ndarray
    choices: list  # OptionRecord | JointOption | None (16-bit)
    errs: list


@dataclass
class _Problem:
    items: list[_Item]
    fixed: list[PlanEntry]
    kept: list[str]
    numel: int
    budget: int
    target: float
    settings: dict


def _match(key: str, patterns: Sequence[str]) -> bool:
    names = (key, key + ".weight")
    return any(n == p or fnmatch.fnmatchcase(n, p) for p in patterns for n in names)


def default_part(key: str) -> str:
    """The part of a tensor for the keep-most-sensitive rule.

    ``backbone`` for decoder layers (``...layers.N.``), else its first path component.
    """
    if (found := split_layer(key, containers=None)) is not None and found[2]:
        return "backbone"
    return key.split(".", 1)[0]


def _part_of(key: str, parts: Mapping[str, Sequence[str]] | None) -> str | None:
    if parts is None:
        return default_part(key)
    for name, pats in parts.items():
        if _match(key, pats):
            return name
    return None


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
    keep_outside_budget: bool = False,
) -> _Problem:
    """Turn a measurement and the user's rules into knapsack items plus fixed entries."""
    if not isinstance(target_bpw, (int, float)) or not math.isfinite(target_bpw) or target_bpw <= 0:
        raise InputError(f"target bpw must be a positive number, got {target_bpw!r}")
    head_opt = QuantOption.parse(head_option) if isinstance(head_option, str) else head_option
    if mlx_lm_compatible and head_opt is not None and head_opt.is_mixed:
        raise InputError(f"head option {head_opt.desc} is mixed; --mlx-lm-compatible needs a whole-tensor option")
    fixed: list[PlanEntry] = []
    kept: set[str] = set()
    items: list[_Item] = []

    def allowed(opt: QuantOption) -> bool:
        return not (mlx_lm_compatible and opt.is_mixed)

    grouped = m.grouped_keys()
    tied_alias = {k for k in m.tied if k in m.tensors and m.tied[k] in m.tensors}
    for t in m.tensors.values():
        if t.key in grouped or t.key in tied_alias:
            continue
        if head_opt is not None and _head_scope(m, t):
            opt = QuantOption.fp16() if _match(t.key, keep) else head_opt
            if not opt.fits(t.shape[-1]):
                raise InputError(f"head option {opt.desc} does not fit {t.key!r} with {t.shape[-1]} inputs")
            rec = t.find(opt)
            scope = "kept" if opt.keep16 else "head"
            if opt.keep16:
                kept.add(t.key)
            fixed.append(PlanEntry(t.key, opt.desc, opt.storage_bits(t.shape), list(t.shape), t.numel,
                                   rec.err if rec else (0.0 if opt.keep16 else None), scope))
            continue
        recs = [r for r in t.options if allowed(r.option)]
        if not recs:
            raise InputError(f"tensor {t.key!r} has no usable option"
                             + (" (only mixed options were measured)" if mlx_lm_compatible else ""))
        items.append(_Item(
            t.key, [t.key], t.numel, np.array([r.total_bits for r in recs], dtype=np.int64),
            np.array([option_damage(r.err, t.importance, r.damage, err_power) for r in recs]), recs,
            [r.err for r in recs],
        ))
    for g in m.groups.values():
        opts = [o for o in g.options if all(allowed(r.option) for r in o.members.values())]
        if not opts:
            raise InputError(f"module {g.key!r} has no usable joint option"
                             + (" (every one has a mixed member)" if mlx_lm_compatible else ""))
        items.append(_Item(
            g.key, list(g.members), sum(m.tensors[k].numel for k in g.members),
            np.array([o.total_bits for o in opts], dtype=np.int64),
            np.array([option_damage(o.err, g.importance, None, err_power) for o in opts]), opts, [o.err for o in opts],
        ))

    # explicit keep list, then the keep-most-sensitive rule per part
    numel_budget = sum(it.numel for it in items)
    all_keys = [k for it in items for k in it.members] + [e.key for e in fixed]
    for pat in keep:
        if not any(_match(k, [pat]) for k in all_keys):
            raise InputError(f"keep pattern {pat!r} matches no tensor of the measurement")
    ref_sens = {it.key: _sensitivity(it, target_bpw) for it in items}
    keep_keys = {k for it in items for k in it.members if _match(k, keep)}
    if keep_most_sensitive:
        per_part: dict[str, list[tuple[float, str]]] = {}
        for it in items:
            for k in it.members:
                p = _part_of(k, parts)
                if p is not None:
                    own = _member_sensitivity(it, k, m, target_bpw, err_power)
                    per_part.setdefault(p, []).append((ref_sens[it.key], own, k))
        rule = keep_most_sensitive
        for p, lst in per_part.items():
            n = rule if isinstance(rule, int) else int(rule.get(p, 0))
            lst.sort(key=lambda sk: (-sk[0], -sk[1], sk[2]))  # ties (members of one joint item): own damage
            keep_keys.update(k for _, _, k in lst[: max(n, 0)])
    for it in items:
        for k in it.members:
            if k in keep_keys:
                _keep_member(it, m.tensors[k], outside=keep_outside_budget)
                kept.add(k)
    if keep_outside_budget:  # kept tensors leave the budget: whole ones become fixed entries
        for it in [it for it in items if len(it.members) == 1 and it.choices == [None]]:
            t = m.tensors[it.key]
            fixed.append(PlanEntry(t.key, "16bit", 16 * t.numel, list(t.shape), t.numel, 0.0, "kept"))
            items.remove(it)
        numel_budget = sum(it.numel for it in items)
    budget = int(math.floor(target_bpw * numel_budget + 1e-6))  # tolerate float rounding of target x weights
    settings = {
        "head_option": None if head_opt is None else head_opt.desc, "keep": list(keep),
        "keep_most_sensitive": keep_most_sensitive,
        "parts": None if parts is None else {k: list(v) for k, v in parts.items()},
        "mlx_lm_compatible": mlx_lm_compatible, "err_power": err_power,
        "keep_outside_budget": keep_outside_budget,
    }
    return _Problem(items, fixed, sorted(kept), numel_budget, budget, float(target_bpw), settings)


def option_damage(err: float | None, importance: float, damage: float | None = None, err_power: float = 2.0) -> float:
    """The damage the optimizer counts for one measured option: ``damage`` where it was measured end to end (the
    head), else ``importance * err ** err_power`` (0 without an error: a joint option's members)."""
    if damage is not None:
        return float(damage)
    return 0.0 if err is None else importance * float(err) ** err_power


def _sensitivity(it: _Item, target: float) -> float:
    """Damage at the choice nearest the target bpw: how much this item suffers at this budget."""
    bpw = it.bits / it.numel
    return float(it.damage[int(np.argmin(np.abs(bpw - target)))])


def _member_sensitivity(it: _Item, key: str, m: Measurement, target: float, err_power: float = 2.0) -> float:
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


def _keep_member(it: _Item, t: TensorRecord, outside: bool = False) -> None:
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


def _range_error(p: _Problem, lo: int, hi: int, what: str) -> InputError:
    return InputError(
        f"target {p.target:g} bpw is {what}: achievable range for this measurement is "
        f"{lo / p.numel:.4f} to {hi / p.numel:.4f} bpw"
        + (" (mlx-lm compatible options only)" if p.settings.get("mlx_lm_compatible") else "")
    )


def _check_range(p: _Problem) -> None:
    if not p.items:
        raise InputError("the measurement has no tensor to plan inside the budget")
    lo = sum(int(it.bits.min()) for it in p.items)
    hi = sum(int(it.bits.max()) for it in p.items)
    if p.budget < lo:
        raise _range_error(p, lo, hi, "below the smallest achievable size")
    if p.target * p.numel > hi + 1e-6 * p.numel:
        raise _range_error(p, lo, hi, "above the largest achievable size")


# --------------------------------------------------------------------------- solver
def _prune(it: _Item) -> np.ndarray:
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


def _lp_walk(p: _Problem, pruned: list[np.ndarray]) -> tuple[list[int], float, float]:
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


def _moves(p: _Problem, pruned: list[np.ndarray], pos: list[int]) -> tuple[np.ndarray, ...]:
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


def _fill_in(p: _Problem, pruned: list[np.ndarray], pos: list[int], used: int) -> int:
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


def _exchange(p: _Problem, pruned: list[np.ndarray], pos: list[int], used: int, tol: float, rounds: int) -> int:
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


def _pareto_dp(p: _Problem, pruned: list[np.ndarray], max_states: int) -> tuple[list[int], float] | None:
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


def _entries(p: _Problem, m: Measurement, choice: list[int]) -> list[PlanEntry]:
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


def _make_plan(p: _Problem, m: Measurement, choice: list[int], bound: float | None, method: str, t0: float) -> Plan:
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
    exchange_rounds: int = 500,
    exact_states: int = 2000,
) -> Plan:
    """Plan one option per tensor: least predicted damage with stored bits <= target_bpw x weights.

    ``head_option`` fixes embedding/head outside the budget (None: they join it);
    ``keep`` lists names or glob patterns kept 16-bit; ``keep_most_sensitive`` keeps
    the N most sensitive tensors of each part (an int for every part, or part -> N,
    parts given by ``parts`` as part -> patterns or by :func:`default_part`);
    ``mlx_lm_compatible`` allows whole-tensor options only; ``keep_outside_budget`` leaves kept
    tensors out of the bpw budget (they still count in ``total_bpw``). When the exact Pareto
    dynamic program stays under ``exact_states`` states it replaces the heuristic
    (gap 0).
    """
    t0 = time.perf_counter()
    p = _build(measurement, target_bpw, head_option, keep, keep_most_sensitive, parts, mlx_lm_compatible, err_power,
               keep_outside_budget)
    _check_range(p)
    pruned = [_prune(it) for it in p.items]
    pos, bound, lam = _lp_walk(p, pruned)
    used = sum(int(it.bits[idx[j]]) for it, idx, j in zip(p.items, pruned, pos))
    used = _fill_in(p, pruned, pos, used)
    scale = max(bound, 1e-300)
    used = _exchange(p, pruned, pos, used, 1e-12 * scale, exchange_rounds)
    method = "lagrangian+exchange"
    exact = _pareto_dp(p, pruned, exact_states) if exact_states > 0 else None
    if exact is not None:
        pos, bound = exact[0], exact[1]
        method = "exact-pareto-dp"
    choice = [int(idx[j]) for idx, j in zip(pruned, pos)]
    plan = _make_plan(p, measurement, choice, bound, method, t0)
    plan.multiplier = lam
    if plan.used_bits > p.budget:  # the solver never does this; guard the invariant
        raise RuntimeError("internal error: plan exceeds the budget")
    if bound is not None and plan.objective < bound - 1e-9 * max(abs(bound), 1e-300):
        raise RuntimeError("internal error: objective below the lower bound")
    return plan


# --------------------------------------------------------------------------- baselines
def _build_from_options(measurement: Measurement, target_bpw: float, kw: dict[str, Any]) -> _Problem:
    """The knapsack problem from :func:`optimize`'s keyword options (for the baselines, which take the same ones)."""
    kw = dict(kw)
    p = _build(measurement, target_bpw, kw.pop("head_option", DEFAULT_HEAD_OPTION), kw.pop("keep", ()),
               kw.pop("keep_most_sensitive", None), kw.pop("parts", None), kw.pop("mlx_lm_compatible", False),
               kw.pop("err_power", 2.0))
    if kw:
        raise TypeError(f"unexpected arguments: {sorted(kw)}")
    return p


def greedy_single_pass(measurement: Measurement, target_bpw: float, **kw: Any) -> Plan:
    """Baseline: a single greedy pass with no backtracking.

    Start from the cheapest options and upgrade by best damage decrease per bit
    until no upgrade fits.
    """
    t0 = time.perf_counter()
    p = _build_from_options(measurement, target_bpw, kw)
    _check_range(p)
    choice = [int(np.argmin(np.where(it.bits == it.bits.min(), it.damage, np.inf))) for it in p.items]
    used = sum(int(it.bits[j]) for it, j in zip(p.items, choice))

    def best_upgrade(i: int) -> tuple[float, int] | None:
        it = p.items[i]
        db = it.bits - it.bits[choice[i]]
        dd = it.damage - it.damage[choice[i]]
        ok = (db > 0) & (dd < 0) & (db <= p.budget - used)
        if not ok.any():
            return None
        r = np.where(ok, -dd / np.maximum(db, 1), -np.inf)
        j = int(np.argmax(r))
        return float(r[j]), j

    heap = []
    for i in range(len(p.items)):
        b = best_upgrade(i)
        if b is not None:
            heapq.heappush(heap, (-b[0], i, b[1], choice[i]))
    while heap:
        _, i, j, frm = heapq.heappop(heap)
        it = p.items[i]
        if frm != choice[i] or it.bits[j] - it.bits[frm] > p.budget - used:
            b = best_upgrade(i)  # stale or no longer fits: re-rank this item
            if b is not None:
                heapq.heappush(heap, (-b[0], i, b[1], choice[i]))
            continue
        used += int(it.bits[j] - it.bits[frm])
        choice[i] = j
        b = best_upgrade(i)
        if b is not None:
            heapq.heappush(heap, (-b[0], i, b[1], choice[i]))
    p.settings["baseline"] = "greedy single pass"
    return _make_plan(p, measurement, choice, None, "greedy-single-pass", t0)


def _nearest_choice(it: _Item, opt: QuantOption) -> tuple[int, bool]:
    """The item's choice equal to ``opt`` for every member (exact: True), else the one nearest in bpw."""
    def options_of(c: Any) -> list:
        if c is None:
            return [QuantOption.fp16()]
        if isinstance(c, OptionRecord):
            return [c.option]
        return [QuantOption.fp16() if r is None else r.option for r in c.members.values()]

    for j, c in enumerate(it.choices):
        if all(o == opt for o in options_of(c)):
            return j, True
    same_bits = [j for j, c in enumerate(it.choices)
                 if all(not o.is_mixed and o.max_bits == opt.max_bits for o in options_of(c))]
    pool = same_bits or range(len(it.choices))
    want = opt.nominal_bpw()
    return min(pool, key=lambda j: (abs(it.bits[j] / it.numel - want), it.damage[j])), False


def dynamic_quant_threshold(
    measurement: Measurement,
    target_bpw: float,
    low_bits: int = 4,
    high_bits: int = 5,
    *,
    low_group_size: int = 64,
    high_group_size: int = 64,
    **kw: Any,
) -> Plan:
    """Baseline: mlx-lm's dynamic_quant two-level rule on this measurement.

    mlx-lm ranks tensors by sensitivity per million weights (the loss change
    between low and high bits) and puts those above a threshold, found by
    bisection on the bpw, at high bits. Here sensitivity is the measured damage
    difference between the low and high option per million weights, and the
    threshold is set exactly: the most sensitive tensors go high while the plan fits.
    """
    t0 = time.perf_counter()
    p = _build_from_options(measurement, target_bpw, kw)
    lo_opt = QuantOption.uniform(low_bits, low_group_size)
    hi_opt = QuantOption.uniform(high_bits, high_group_size)
    low_x = [_nearest_choice(it, lo_opt) for it in p.items]
    high_x = [_nearest_choice(it, hi_opt) for it in p.items]
    low, high = [j for j, _ in low_x], [j for j, _ in high_x]
    exact = sum(a and b for (_, a), (_, b) in zip(low_x, high_x))
    used = sum(int(it.bits[j]) for it, j in zip(p.items, low))
    top = sum(int(it.bits[j]) for it, j in zip(p.items, high))
    if not used <= p.budget <= top:
        raise _range_error(p, used, max(top, used), f"outside the two-level range of {lo_opt.desc} / {hi_opt.desc}")
    sens = [(float(it.damage[lj] - it.damage[hj]) / (it.numel / 1e6), i)
            for i, (it, lj, hj) in enumerate(zip(p.items, low, high))]
    sens.sort(key=lambda s: (-s[0], s[1]))
    choice = list(low)
    for _, i in sens:
        it = p.items[i]
        extra = int(it.bits[high[i]] - it.bits[low[i]])
        if used + extra > p.budget:
            break
        choice[i] = high[i]
        used += extra
    p.settings["baseline"] = (f"mlx-lm dynamic_quant rule {lo_opt.desc} / {hi_opt.desc} "
                              f"({exact}/{len(p.items)} items had both measured; others use the nearest option)")
    return _make_plan(p, measurement, choice, None, "dynamic-quant-threshold", t0)


# --------------------------------------------------------------------------- exports
def plan_to_mlx_config(plan: Plan, shapes: Mapping[str, Sequence[int]] | None = None) -> dict:
    """The plan in the kept-16-bit MLX config form (bits, group_size, mode, kept_16bit, tensors with shapes).

    Defaults are the most common (by weights) whole-tensor setting; each
    quantized tensor lists its own bits, group size and shape (mixed tensors
    also their option); kept tensors are listed by parameter name only.
    ``shapes`` fills or overrides shapes by tensor key.
    """
    shapes = shapes or {}
    settings: list[tuple[int, int, int]] = []
    tensors: dict[str, dict] = {}
    kept = []
    for e in plan.tensors:
        name = e.key if e.key.endswith(".weight") else e.key + ".weight"
        shape = list(shapes.get(e.key, e.shape))
        if not shape:
            raise ValueError(f"no shape for tensor {e.key!r}; pass shapes")
        opt = QuantOption.parse(e.option)
        if opt.keep16:
            kept.append(name)
            continue
        seg = opt.segments[0]
        entry = {"bits": seg.bits, "group_size": seg.group_size, "shape": shape}
        if opt.is_mixed:
            entry["option"] = opt.desc
        else:
            settings.append((seg.bits, seg.group_size, math.prod(shape)))
        tensors[name] = entry
    bits, gs = default_bits_group(settings)
    rule = plan.settings.get("keep_most_sensitive")
    scan: dict[str, Any] = {"rule": KEEP_RULE}
    if isinstance(rule, Mapping):
        scan.update({f"keep_{k}": v for k, v in rule.items()})
    elif rule:
        scan["keep_each_part"] = rule
    if plan.settings.get("keep"):
        scan["keep"] = plan.settings["keep"]
    return {"bits": bits, "group_size": gs, "mode": "affine", "scan": scan, "kept_16bit": sorted(kept),
            "tensors": tensors}
