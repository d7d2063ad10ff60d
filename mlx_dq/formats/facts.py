"""Facts our manifest records beyond accounting: weight files, layout of every packed tensor, provenance.

They mirror what other checkpoint manifests state (a dynquant manifest's
``files``, per-layer ``num_groups``/``words_per_group``/``has_offsets``,
``quant_method``...), under names whose meaning matches theirs, so a reader
of either finds the same fact under the same word (see :mod:`.dynquant`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Sequence

from mlx_dq.formats.common import file_digest
from mlx_dq.quant.options import QuantOption

QUANT_METHOD = "mlx_dq"


def _words(group_size: int, bits: int) -> int | float:
    """uint32 words one group's codes take (a whole number for every MLX group size and width but 3/5/6 at g32)."""
    w = group_size * bits / 32
    return int(w) if w == int(w) else w


def packing_facts(opt: QuantOption, shape: Sequence[int], dtype: str) -> dict:
    """How one tensor is packed: MLX affine codes in uint32 words, one scale and one bias per group.

    ``bits`` is the code width (the widest segment's for mixed options), ``num_groups`` groups per
    row, ``words_per_group`` uint32 words per group (fractional when a group does not fill words),
    ``num_rows`` rows (experts x outputs for a bank).
    """
    in_features = int(shape[-1])
    num_rows = int(math.prod(shape[:-1]))
    if opt.keep16:
        return {"kind": "dense", "bits": 16, "in_features": in_features, "num_rows": num_rows,
                "compute_dtype": dtype}
    segs = []
    for seg, cols in zip(opt.segments, opt.split(in_features)):
        segs.append({"bits": seg.bits, "group_size": seg.group_size, "in_features": int(cols),
                     "num_groups": int(cols) // seg.group_size, "words_per_group": _words(seg.group_size, seg.bits)})
    first = segs[0]
    out = {"kind": "affine_mixed" if opt.is_mixed else "affine", "bits": first["bits"],
           "group_size": first["group_size"], "in_features": in_features, "num_rows": num_rows,
           "num_groups": sum(s["num_groups"] for s in segs), "words_per_group": first["words_per_group"],
           "symmetric": False, "has_offsets": True, "scale_dtype": dtype, "compute_dtype": dtype,
           "permuted": opt.is_mixed}
    if opt.is_mixed:
        out["segments"] = segs
    return out


def add_facts(manifest: dict, folder: Path, files: Sequence[Path], plan: Any, measurement_path: Any,
              measurement: Any) -> dict:
    """Add the files list, the quantization_config block and provenance facts to ``manifest`` (in place)."""
    mods = manifest["modules"]
    quant = {k: r for k, r in mods.items() if r["option"] != "16bit"}
    widths = {}
    for r in quant.values():
        key = (r["packing"]["bits"], r["packing"]["group_size"])
        widths[key] = widths.get(key, 0) + r["numel"]
    bits, gs = max(widths, key=widths.get) if widths else (None, None)
    heads = [k for k in mods if k.endswith("lm_head")] or list(manifest.get("tied", {}).values())
    manifest["files"] = [{"name": Path(f).name, "bytes": Path(f).stat().st_size, "sha256": file_digest(f)}
                         for f in sorted(files)]
    manifest["quantization_config"] = {
        "quant_method": QUANT_METHOD,
        "checkpoint_format": "mlx-affine+mixed" if manifest.get("mixed_modules") else "mlx-affine",
        "group_size": gs, "bits": bits, "symmetric": False,
        "lm_head_quantized": bool(heads) and all(k in quant for k in heads),
        "modules_to_not_convert": sorted(k for k in mods if k not in quant),
    }
    acc = manifest["accounting"]
    acc["unquantized_bytes"] = int(acc["kept16_bytes"] + acc["other_bytes"])
    q_numel = sum(r["numel"] for r in quant.values())
    acc["average_bits_quantized"] = (sum(r["storage_bits"] for r in quant.values()) / q_numel) if q_numel else None
    prov = manifest["provenance"]
    prov["allocator"] = f"mlx_dq.optimize ({plan.method})" if not plan.method.startswith("imported:") \
        else f"{plan.method} (widths taken from a file)"
    if measurement_path is not None:
        prov["measurement"] = {"path": str(measurement_path), "sha256": file_digest(measurement_path),
                               "source_format": getattr(measurement, "source_format", None)}
    elif measurement is not None:
        prov["measurement"] = {"path": "measurement.json", "sha256": file_digest(folder / "measurement.json"),
                               "source_format": getattr(measurement, "source_format", None)}
    else:
        prov["measurement"] = None
    if plan.source.get("format"):
        prov["widths_from"] = {k: plan.source.get(k) for k in ("format", "path", "digest")}
    return manifest
