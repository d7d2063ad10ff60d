"""dashq quantizer records (``format: dashq-packed-linear``) and our record form of the same facts.

A dashq record states the technique (bits, group size, symmetric, error
compensation, optimal shrinkage, weighted quantization, MoE Hessian scope,
calibration samples), every packed module, and a ``results`` block
(perplexity, sizes, quantization time, lm-eval-style task scores). Our record
form (``schema: mlx_dq.record``) holds the same facts under our names:
:func:`from_dashq` and :func:`to_dashq` convert losslessly both ways (fields
neither names are carried in ``extra``), and :func:`record_from_manifest`
states an mlx-dq output the same way, so results compare side by side.
"""

from __future__ import annotations

import math
from typing import Any, Mapping

from mlx_dq.errors import InputError

FORM = "dashq"
RECORD_SCHEMA = "mlx_dq.record"

# dashq name -> our name, per section
PARAMS = {"bits": "bits", "group_size": "group_size", "symmetric": "symmetric",
          "use_error_compensation": "error_compensation", "use_optimal_shrinkage": "optimal_shrinkage",
          "use_weighted_quantization": "weighted_quantization", "moe_hessian_scope": "moe_hessian_scope",
          "n_samples": "calibration_samples", "scale_zero_dtype": "scale_dtype",
          "low_memory_optimization": "low_memory"}
MODULE = {"nbits": "bits", "group_size": "group_size", "in_features": "in_features",
          "out_features": "out_features", "num_groups": "num_groups", "quant_in_features": "quant_in_features",
          "packing": "packing", "linear_dtype": "compute_dtype", "scale_zero_dtype": "scale_dtype",
          "runtime_backend": "runtime"}
RESULTS = {"Method": "method", "Model": "model", "PPL": "perplexity", "ModelSizeGB": "model_size_gb",
           "OriginalSizeGB": "original_size_gb", "QuantTime": "quantization_seconds", "Params": "params_text",
           "zeroshot_avg": "zeroshot_average"}  # seed 004: mean of its tasks but gsm8k_cot, mmlu
TOP = {"base_model": "base_model", "format": "format", "format_version": "format_version", "method": "method",
       "model_class": "model_class"}


def is_form(data: Any) -> bool:
    """Whether a parsed JSON document is a dashq record."""
    return (isinstance(data, dict) and isinstance(data.get("quantized_modules"), dict)
            and isinstance(data.get("params"), dict) and "format" in data and "method" in data)


def _rename(d: Mapping, table: Mapping[str, str]) -> tuple[dict, dict]:
    known = {table[k]: v for k, v in d.items() if k in table}
    return known, {k: v for k, v in d.items() if k not in table}


def _unrename(d: Mapping, table: Mapping[str, str], extra: Mapping) -> dict:
    back = {v: k for k, v in table.items()}
    out = {back.get(k, k): v for k, v in d.items()}  # our extra facts keep our names
    out.update(extra)
    return out


def from_dashq(data: Mapping) -> dict:
    """A dashq record in our record form (every field kept; unknown ones under ``extra``)."""
    if not is_form(data):
        raise InputError("not a dashq record (needs format, method, params and quantized_modules)")
    top, top_extra = _rename({k: v for k, v in data.items() if k not in ("params", "quantized_modules", "results")},
                             TOP)
    technique, t_extra = _rename(data.get("params") or {}, PARAMS)
    modules, m_extra = {}, {}
    for name, rec in (data.get("quantized_modules") or {}).items():
        modules[name], ex = _rename(rec, MODULE)
        if ex:
            m_extra[name] = ex
    results: dict = {}
    r_extra: dict = {}
    tasks: dict = {}
    has_results = "results" in data
    for k, v in (data.get("results") or {}).items():
        if k in RESULTS:
            results[RESULTS[k]] = v
        elif isinstance(v, (int, float)) and not isinstance(v, bool):
            tasks[k] = v
        else:
            r_extra[k] = v
    if has_results:
        results["tasks"] = tasks
    return {"schema": RECORD_SCHEMA, **top, "technique": technique, "modules": modules,
            "results": results if has_results else None,
            "extra": {"top": top_extra, "technique": t_extra, "modules": m_extra, "results": r_extra}}


def to_dashq(record: Mapping) -> dict:
    """Our record form as a dashq record (the inverse of :func:`from_dashq`)."""
    extra = record.get("extra") or {}
    out = _unrename({k: record[k] for k in TOP.values() if k in record}, TOP, extra.get("top") or {})
    out["params"] = _unrename(record.get("technique") or {}, PARAMS, extra.get("technique") or {})
    out["quantized_modules"] = {
        name: _unrename(rec, MODULE, (extra.get("modules") or {}).get(name) or {})
        for name, rec in (record.get("modules") or {}).items()}
    res = record.get("results")
    if res is not None:
        flat = {k: v for k, v in res.items() if k != "tasks"}
        block = _unrename(flat, RESULTS, extra.get("results") or {})
        block.update(res.get("tasks") or {})
        out["results"] = dict(sorted(block.items()))
    return out


def describe(data: Mapping) -> str:
    """A summary of a dashq record: technique, modules, results."""
    rec = from_dashq(data)
    res = rec.get("results") or {}
    lines = [f"dashq record: {rec.get('method')} on {rec.get('base_model')} ({rec.get('format')} "
             f"v{rec.get('format_version')}), {len(rec['modules'])} packed modules",
             "technique: " + ", ".join(f"{k}={v}" for k, v in rec["technique"].items())]
    for k in ("perplexity", "model_size_gb", "original_size_gb", "quantization_seconds", "zeroshot_average"):
        if k in res:
            lines.append(f"{k:22s} {res[k]}")
    for k, v in (res.get("tasks") or {}).items():
        lines.append(f"  task {k}: {v:.2f}")
    return "\n".join(lines)


def record_from_manifest(manifest: Mapping) -> dict:
    """An mlx-dq output (its manifest, with a ``results`` block if evaluated) in our record form.

    Technique flags follow the conversion settings: GPTQ error compensation, clip search
    (our optimal shrinkage), activation-weighted scales, per-expert Gram matrices for banks.
    """
    prov = manifest.get("provenance") or {}
    st = prov.get("settings") or {}
    qc = manifest.get("quantization_config") or {}
    gptq = st.get("method", "gptq") == "gptq"
    calib = prov.get("calibration") or {}
    technique = {"bits": qc.get("bits"), "group_size": qc.get("group_size"), "symmetric": False,
                 "error_compensation": gptq, "optimal_shrinkage": bool(st.get("clip", True)),
                 "weighted_quantization": gptq, "moe_hessian_scope": "per_expert",
                 "calibration_samples": calib.get("rows"), "scale_dtype": st.get("dtype", "float16"),
                 "low_memory": True, "mixed_precision": True, "sequential": st.get("sequential")}
    modules = {}
    for name, r in (manifest.get("modules") or {}).items():
        pk = r.get("packing") or {}
        if r["option"] == "16bit":
            continue
        modules[name] = {"bits": pk.get("bits"), "group_size": pk.get("group_size"),
                         "in_features": r["shape"][-1], "out_features": int(math.prod(r["shape"][:-1])),
                         "num_groups": (pk.get("num_groups") or 0) * pk.get("num_rows", 0),
                         "quant_in_features": r["shape"][-1], "packing": f"mlx_{pk.get('kind')}_u32",
                         "compute_dtype": pk.get("compute_dtype"), "scale_dtype": pk.get("scale_dtype"),
                         "runtime": "mlx", "option": r["option"]}
    res = manifest.get("results")
    results = None
    if res:
        results = {"method": "mlx_dq", "model": (prov.get("source") or {}).get("spec"),
                   "perplexity": res.get("perplexity"),
                   "model_size_gb": None if res.get("model_size_bytes") is None else res["model_size_bytes"] / 1e9,
                   "original_size_gb": None if res.get("original_size_bytes") is None
                   else res["original_size_bytes"] / 1e9,
                   "quantization_seconds": res.get("quantization_seconds", prov.get("quantization_seconds")),
                   "kl_divergence": res.get("kl_divergence"), "bits_per_weight": res.get("bits_per_weight"),
                   "tasks": dict(res.get("tasks") or {})}
        if res.get("zeroshot_average") is not None:  # which tasks count as zero-shot is the evaluator's call
            results["zeroshot_average"] = res["zeroshot_average"]
    return {"schema": RECORD_SCHEMA, "base_model": (prov.get("source") or {}).get("spec"),
            "format": "mlx-affine", "format_version": manifest.get("schema_version"), "method": "mlx_dq",
            "model_class": (prov.get("source") or {}).get("model_type"), "technique": technique,
            "modules": modules, "results": results, "extra": {}}
