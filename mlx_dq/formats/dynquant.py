"""dynquant checkpoint manifests (``schema: dynquant_checkpoint_v2``): read as plans, write from ours.

A dynquant manifest lists, per module, the bit width a sensitivity allocator
chose (``quantization_config.modules`` and ``layers``: bits, group size,
packing layout), the weight files, byte accounting, tied weights and expert
banks. Importing it gives each mapped mlx-lm module that width at that group
size (MLX affine, asymmetric like dynquant's ``has_offsets``), so a model can be
converted to the same per-tensor widths. :data:`FIELD_TABLE` says where each of
its fields lives in our manifest.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.formats.common import plan_from_widths
from mlx_dq.names import MANIFEST_SCHEMA
from mlx_dq.quant.options import QuantOption

FORM = "dynquant"
SCHEMA = "dynquant_checkpoint_v2"

# 002 field path -> (status, our manifest path or why not applicable); "*" is any module name
FIELD_TABLE: dict[str, tuple[str, str]] = {
    "schema": ("covered", "schema"),
    "dynquant_core": ("renamed", "mlx_dq"),
    "quantization_config.quant_method": ("covered", "quantization_config.quant_method"),
    "quantization_config.checkpoint_format": ("covered", "quantization_config.checkpoint_format"),
    "quantization_config.schema_version": ("renamed", "schema_version"),
    "quantization_config.version": ("renamed", "mlx_dq"),
    "quantization_config.group_size": ("covered", "quantization_config.group_size"),
    "quantization_config.symmetric": ("covered", "quantization_config.symmetric"),
    "quantization_config.lm_head_quantized": ("covered", "quantization_config.lm_head_quantized"),
    "quantization_config.modules_to_not_convert": ("covered", "quantization_config.modules_to_not_convert"),
    "quantization_config.modules.*.bits": ("renamed", "modules.*.packing.bits"),
    "quantization_config.modules.*.out_features": ("renamed", "modules.*.shape"),
    "files": ("covered", "files"),
    "accounting.packed_nbytes": ("renamed", "accounting.packed_bytes"),
    "accounting.dense_nbytes": ("renamed", "accounting.unquantized_bytes"),
    "accounting.total_nbytes": ("renamed", "accounting.array_bytes"),
    "accounting.quantized_elements": ("covered", "accounting.quantized_elements"),
    "accounting.average_bits": ("renamed", "accounting.average_bits_quantized"),
    "tied.lm_head": ("covered", "tied.lm_head"),
    "expert_banks": ("covered", "expert_banks"),
    "provenance.dynquant_core": ("renamed", "mlx_dq"),
    "provenance.model": ("renamed", "provenance.source.spec"),
    "provenance.stats": ("not applicable", "null in the file: no activation statistics are named"),
    "provenance.allocator": ("covered", "provenance.allocator"),
    "provenance.widths_from": ("renamed", "provenance.measurement"),
    "provenance.predicted_nbytes": ("renamed", "accounting.predicted_bytes"),
    "layers.*.bits": ("renamed", "modules.*.packing.bits"),
    "layers.*.group_size": ("renamed", "modules.*.packing.group_size"),
    "layers.*.in_features": ("renamed", "modules.*.packing.in_features"),
    "layers.*.logical_shape": ("renamed", "modules.*.shape"),
    "layers.*.num_rows": ("renamed", "modules.*.packing.num_rows"),
    "layers.*.num_groups": ("renamed", "modules.*.packing.num_groups"),
    "layers.*.words_per_group": ("renamed", "modules.*.packing.words_per_group"),
    "layers.*.row_offset": ("not applicable", "every module is its own tensor in the safetensors files (offset 0)"),
    "layers.*.layout": ("renamed", "modules.*.packing.kind"),
    "layers.*.symmetric": ("renamed", "modules.*.packing.symmetric"),
    "layers.*.has_offsets": ("renamed", "modules.*.packing.has_offsets"),
    "layers.*.compute_dtype": ("renamed", "modules.*.packing.compute_dtype"),
    "layers.*.nbytes": ("renamed", "modules.*.bytes"),
    "layers.*.bits_per_weight": ("renamed", "modules.*.bpw"),
    "layers.*.clipped_fraction": ("renamed", "modules.*.clip.clipped_fraction"),
    "layers.*.clip_improvement": ("renamed", "modules.*.clip.clip_improvement"),
}


def is_form(data: Any) -> bool:
    """Whether a parsed JSON document is a dynquant checkpoint manifest."""
    return isinstance(data, dict) and str(data.get("schema", "")).startswith("dynquant_checkpoint")


def widths(data: Mapping) -> dict[str, tuple[int | None, int | None]]:
    """Module name -> (bits, group size) of a dynquant manifest; modules not converted -> (None, None)."""
    qc = data.get("quantization_config") or {}
    layers = data.get("layers") or {}
    mods = qc.get("modules") or {}
    if not layers and not mods:
        raise InputError("dynquant manifest lists no modules (no 'layers' and no quantization_config.modules)")
    out: dict[str, tuple[int | None, int | None]] = {}
    for name in list(layers) + [m for m in mods if m not in layers]:
        rec = layers.get(name) or mods.get(name) or {}
        bits = rec.get("bits", mods.get(name, {}).get("bits"))
        gs = rec.get("group_size", qc.get("group_size"))
        if not isinstance(bits, int) or not isinstance(gs, int):
            raise InputError(f"dynquant manifest: module {name!r} has no integer bits/group_size")
        out[name] = (bits, gs)
    for name in qc.get("modules_to_not_convert") or []:
        out[name] = (None, None)
    return out


def to_plan(data: Mapping, modules: Mapping[str, Sequence[int]], model_type: str | None, path: str | None = None):
    """A plan for a model (module path -> shape) with the manifest's per-module widths where MLX stores them."""
    if not is_form(data):
        raise InputError(f"{path or 'document'}: not a dynquant manifest")
    return plan_from_widths(widths(data), modules, model_type, fmt=FORM, path=path)


def describe(data: Mapping) -> str:
    """A summary of a dynquant manifest: widths, accounting, tied weights, expert banks."""
    w = widths(data)
    acc = data.get("accounting") or {}
    qc = data.get("quantization_config") or {}
    count = Counter(f"{b}-bit g{g}" if b else "16-bit" for b, g in w.values())
    lines = [f"dynquant manifest ({data.get('schema')}, dynquant {data.get('dynquant_core')}): {len(w)} modules, "
             f"{qc.get('quant_method')}/{qc.get('checkpoint_format')}, symmetric={qc.get('symmetric')}, "
             f"lm_head_quantized={qc.get('lm_head_quantized')}"]
    lines += [f"  {n:5d} x {k}" for k, n in count.most_common()]
    for k in ("packed_nbytes", "dense_nbytes", "total_nbytes", "quantized_elements", "average_bits"):
        if k in acc:
            lines.append(f"{k:22s} {acc[k]:,}" if isinstance(acc[k], int) else f"{k:22s} {acc[k]}")
    lines.append(f"tied: {data.get('tied')}; expert banks: {len(data.get('expert_banks') or [])}; "
                 f"allocator: {(data.get('provenance') or {}).get('allocator')}")
    return "\n".join(lines)


def _layer(opt: QuantOption, shape: Sequence[int], dtype: str, nbytes: int | None, clip: Mapping | None) -> dict:
    from mlx_dq.formats.facts import packing_facts

    pk = packing_facts(opt, shape, dtype)
    rec = {"bits": pk["bits"], "group_size": pk.get("group_size"), "in_features": pk["in_features"],
           "logical_shape": list(shape), "num_rows": pk["num_rows"], "num_groups": pk.get("num_groups"),
           "words_per_group": pk.get("words_per_group"), "row_offset": 0,
           "layout": "linear" if pk["kind"] == "affine" else pk["kind"], "symmetric": False,
           "has_offsets": True, "compute_dtype": dtype,
           "nbytes": nbytes if nbytes is not None else opt.storage_bits(shape) // 8,
           "bits_per_weight": opt.bpw(shape)}
    if opt.is_mixed:
        rec["segments"] = pk["segments"]  # dynquant has no mixed layout: the widths are listed here
    rec.update({k: (clip or {}).get(k) for k in ("clipped_fraction", "clip_improvement") if clip and k in clip})
    return rec


def from_ours(doc: Mapping) -> dict:
    """Our manifest (``mlx_dq.json``) or plan in the dynquant_checkpoint_v2 form.

    Mixed-proportion tensors have no dynquant layout: they are written with their widest
    segment's bits, ``layout: affine_mixed`` and the segment list.
    """
    from mlx_dq import __version__

    is_manifest = doc.get("schema") == MANIFEST_SCHEMA
    if is_manifest:
        dtype = (doc.get("provenance") or {}).get("settings", {}).get("dtype", "float16")
        recs = {k: (QuantOption.parse(r["option"]), r["shape"], r.get("bytes"), r.get("clip"))
                for k, r in doc["modules"].items()}
    elif doc.get("format") == "mlx_dq.plan":
        dtype = "float16"
        recs = {e["key"]: (QuantOption.parse(e["option"]), e["shape"], None, None) for e in doc["tensors"]}
    else:
        raise InputError("expected an mlx_dq manifest (mlx_dq.json) or plan")
    layers, mods, not_conv = {}, {}, []
    for k, (opt, shape, nbytes, clip) in sorted(recs.items()):
        if opt.keep16:
            not_conv.append(k)
            continue
        layers[k] = _layer(opt, shape, dtype, nbytes, clip)
        mods[k] = {"bits": layers[k]["bits"], "out_features": int(math.prod(shape[:-1]))}
    gsizes = Counter(r["group_size"] for r in layers.values())
    packed = sum(r["nbytes"] for r in layers.values())
    q_el = sum(math.prod(r["logical_shape"]) for r in layers.values())
    acc = doc.get("accounting") or {}
    prov = doc.get("provenance") or {}
    dense = acc.get("unquantized_bytes")
    if dense is None:
        dense = sum(16 * math.prod(recs[k][1]) // 8 for k in not_conv)
    tied = doc.get("tied") or {}
    heads = [k for k in recs if k.endswith("lm_head")] or list(tied.values())
    meas = prov.get("measurement") or {}
    return {
        "schema": SCHEMA,
        "dynquant_core": None,
        "quantization_config": {
            "quant_method": "mlx_dq", "checkpoint_format": (doc.get("quantization_config") or {}).get(
                "checkpoint_format", "mlx-affine"),
            "schema_version": 1, "version": doc.get("mlx_dq", __version__),
            "group_size": gsizes.most_common(1)[0][0] if gsizes else None, "symmetric": False,
            "lm_head_quantized": bool(heads) and all(h in layers for h in heads),
            "modules_to_not_convert": not_conv, "modules": mods,
        },
        "files": [f["name"] for f in doc.get("files", [])],
        "accounting": {"packed_nbytes": int(packed), "dense_nbytes": int(dense), "total_nbytes": int(packed + dense),
                       "quantized_elements": int(q_el), "average_bits": round(8 * packed / q_el, 6) if q_el else None},
        "tied": tied,
        "expert_banks": sorted(k for k, (_, s, _, _) in recs.items() if len(s) == 3),
        "provenance": {"dynquant_core": None, "model": (prov.get("source") or {}).get("spec"), "stats": None,
                       "allocator": prov.get("allocator", f"mlx_dq.optimize ({doc.get('method', '')})"),
                       "widths_from": meas.get("path"), "predicted_nbytes": acc.get("predicted_bytes")},
        "layers": layers,
        "exported_by": f"mlx_dq {__version__}",
    }
