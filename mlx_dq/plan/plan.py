"""Plans and plan files: one option per tensor with the accounting that justifies it.

A plan is what the optimizer (:mod:`mlx_dq.plan.solver`) chooses and what conversion applies: JSON on disk,
validated on reading, and exportable as a kept-16-bit MLX config.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.names import default_bits_group
from mlx_dq.quant.options import QuantOption
from mlx_dq.safety import write_json_atomic

PLAN_FORMAT = "mlx_dq.plan"
PLAN_VERSION = 1
KEEP_RULE = "the N most sensitive tensors of each part stay 16-bit"


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

    ``achieved_bpw``, ``objective`` (predicted damage, the embedding's and head's counted at
    ``settings["head_damage_weight"]``), ``lower_bound`` and ``gap``
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
