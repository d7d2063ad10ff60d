"""What ExLlamaV2 measurements leave out, and how their options map to MLX.

ExLlamaV2 measures decoder linears only: a plan from its file says nothing
about the embedding and the head. :func:`complete_head` adds them from the
model's own shapes, at ``head_option`` or 16-bit, so the bpw printed is the
whole model's. :func:`mapping_report` lists, per tensor, the chosen EXL2
option's own bpw beside the MLX option it was mapped to (EXL2 stores 4-bit
scales and a permutation; MLX 16-bit scale and bias per group).
"""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.quant.options import QuantOption

HEAD_NAMES = ("embed_tokens", "lm_head", "wte", "tok_embeddings", "output")


def is_head(key: str) -> bool:
    """Whether a module path is an embedding or output head."""
    return key.rsplit(".", 1)[-1] in HEAD_NAMES


def complete_head(plan: Any, modules: Mapping[str, Sequence[int]], head_option: str | None) -> list[str]:
    """Add the model's embedding/head (absent from the plan) at ``head_option`` (None: 16-bit), in place.

    Returns the keys added. ``total_bpw`` is recomputed over every tensor; the budget scope
    (``achieved_bpw``) is unchanged. The plan's settings record what was done, for reports.
    """
    from mlx_dq.plan.plan import PlanEntry

    have = {e.key for e in plan.tensors}
    added = []
    for key, shape in modules.items():
        if key in have or not is_head(key):
            continue
        opt = QuantOption.parse(head_option) if head_option else QuantOption.fp16()
        if not opt.fits(int(shape[-1])):
            raise InputError(f"head option {opt.desc} does not fit {key!r} with {shape[-1]} inputs")
        plan.tensors.append(PlanEntry(key, opt.desc, opt.storage_bits(shape), list(shape), math.prod(shape),
                                      None, "kept" if opt.keep16 else "head"))
        added.append(key)
    if added:
        bits = sum(e.bits for e in plan.tensors)
        numel = sum(e.numel for e in plan.tensors)
        plan.total_bpw = bits / numel
        plan.settings["head_not_measured"] = {"added": added, "option": head_option or "16bit"}
    return added


def head_note(plan: Any, measured_heads: bool) -> str | None:
    """One line on where embedding/head stand, when the measurement did not cover them."""
    info = plan.settings.get("head_not_measured")
    if info:
        return (f"embedding/head not in the measurement: {', '.join(info['added'])} at {info['option']} "
                f"(from the model's shapes); whole model {plan.total_bpw:.4f} bpw")
    if not measured_heads:
        return ("embedding/head not in the measurement and no model given (--model): they are NOT counted; "
                f"{plan.total_bpw:.4f} bpw covers the measured decoder tensors only")
    return None


def mapping_report(measurement: Any, plan: Any) -> list[dict]:
    """Per planned tensor from an EXL2 measurement: EXL2 option and bpw, MLX option and bpw, difference."""
    rows = []
    recs: dict[str, Any] = {}
    for t in measurement.tensors.values():
        for r in t.options:
            recs[(t.key, r.option.desc)] = r
    for g in measurement.groups.values():
        for o in g.options:
            for k, r in o.members.items():
                recs.setdefault((k, r.option.desc), r)
    for e in plan.tensors:
        r = recs.get((e.key, e.option))
        if r is None or r.exl2_total_bits is None:
            continue
        exl2_bpw = r.exl2_total_bits / e.numel
        rows.append({"tensor": e.key, "numel": e.numel, "exl2_option": r.exl2_desc, "exl2_bpw": round(exl2_bpw, 4),
                     "mlx_option": e.option, "mlx_bpw": round(e.bits / e.numel, 4),
                     "difference": round(e.bits / e.numel - exl2_bpw, 4)})
    return rows


def mapping_summary(rows: Sequence[Mapping]) -> str:
    """One line: weighted EXL2 vs MLX bpw over the mapped tensors and the largest difference."""
    if not rows:
        return "EXL2 -> MLX mapping: no tensor of this plan came from an EXL2 option"
    worst = max(rows, key=lambda r: abs(r["difference"]))
    n = sum(r["numel"] for r in rows)
    mean_e = sum(r["exl2_bpw"] * r["numel"] for r in rows) / n
    mean_m = sum(r["mlx_bpw"] * r["numel"] for r in rows) / n
    return (f"EXL2 -> MLX mapping over {len(rows)} tensors: EXL2 {mean_e:.4f} bpw, MLX {mean_m:.4f} bpw "
            f"(weighted by size); "
            f"largest difference {worst['difference']:+.4f} bpw at {worst['tensor']} "
            f"({worst['exl2_option']} -> {worst['mlx_option']})")
