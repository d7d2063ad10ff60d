"""MLX affine configs with a ``kept_16bit`` list (``bits``, ``group_size``, ``mode``, ``tensors``, ``scan``).

Such a config quantizes every tensor at its default (or its own ``tensors``
entry) and keeps the listed parameters 16-bit; ``scan`` records the rule that
chose them ("the N most sensitive tensors of each part stay 16-bit", N per part
as ``keep_<part>``). ``mlx_dq optimize --part ... --keep-most-sensitive PART=N``
reproduces such a scan from a measurement; :func:`to_plan` applies a config to a model.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.formats.common import plan_from_widths, strip_weight
from mlx_dq.names import MANIFEST_SCHEMA

FORM = "mlx_kept16"


def is_form(data: Any) -> bool:
    """Whether a parsed JSON document is an MLX affine config with a kept_16bit list."""
    return (isinstance(data, dict) and isinstance(data.get("kept_16bit"), list) and "bits" in data
            and "group_size" in data)


def widths(data: Mapping) -> dict[str, tuple[int | None, int | None]]:
    """Parameter name -> (bits, group size) for the named tensors; kept ones -> (None, None)."""
    if data.get("mode", "affine") != "affine":
        raise InputError(f"MLX config mode {data.get('mode')!r}: only affine is supported")
    out: dict[str, tuple[int | None, int | None]] = {}
    for name, rec in (data.get("tensors") or {}).items():
        if not isinstance(rec, Mapping):
            raise InputError(f"MLX config: tensor {name!r} entry is not an object")
        out[name] = (int(rec.get("bits", data["bits"])), int(rec.get("group_size", data["group_size"])))
    for name in data["kept_16bit"]:
        out[name] = (None, None)
    return out


def to_plan(data: Mapping, modules: Mapping[str, Sequence[int]], model_type: str | None, path: str | None = None):
    """A plan for a model: kept names 16-bit, named tensors their bits, every other module the default."""
    if not is_form(data):
        raise InputError(f"{path or 'document'}: not an MLX config with kept_16bit")
    return plan_from_widths(widths(data), modules, model_type, fmt=FORM, path=path,
                            default=(int(data["bits"]), int(data["group_size"])))


def describe(data: Mapping) -> str:
    """A summary: defaults, kept names per part, the scan rule."""
    parts = Counter(strip_weight(k).split(".", 1)[0] for k in data["kept_16bit"])
    lines = [f"MLX affine config: default {data['bits']}-bit g{data['group_size']} ({data.get('mode', 'affine')}), "
             f"{len(data.get('tensors') or {})} tensors listed, {len(data['kept_16bit'])} kept 16-bit"]
    lines += [f"  kept in {p}.*: {n}" for p, n in parts.most_common()]
    if data.get("scan"):
        lines.append(f"scan: {data['scan']}")
    return "\n".join(lines)


def from_ours(doc: Mapping) -> dict:
    """Our plan or manifest in this form (the plan's keep rule, if any, as ``scan``)."""
    from mlx_dq.plan.plan import Plan, PlanEntry, plan_to_mlx_config

    if doc.get("format") == "mlx_dq.plan":
        entries = [PlanEntry(**e) for e in doc["tensors"]]
        plan = Plan(**{k: v for k, v in doc.items() if k not in ("format", "version", "tensors")}, tensors=entries)
    elif doc.get("schema") == MANIFEST_SCHEMA:
        entries = [PlanEntry(k, r["option"], r["storage_bits"], r["shape"], r["numel"])
                   for k, r in doc["modules"].items()]
        plan = Plan(0.0, 0.0, 0.0, None, None, 0, 0, 0, 0.0, tensors=entries)
    else:
        raise InputError("expected an mlx_dq manifest (mlx_dq.json) or plan")
    return plan_to_mlx_config(plan)
