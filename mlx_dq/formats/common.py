"""What every foreign-format reader shares: name mapping to mlx-lm paths and plans from per-tensor widths.

Other tools name tensors their own way (``model.layers.3.moe.w1``,
``layers.0.mlp.down_proj.weight``); a plan for an mlx-lm model needs mlx-lm's
module paths. :func:`map_names` tries, per foreign name, the architecture's
rename rules and the usual prefix differences, and lists every name it cannot
place with the reason, so nothing is dropped silently.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

from mlx_dq.errors import InputError
from mlx_dq.quant.options import VALID_BITS, VALID_GROUPS, QuantOption

# per architecture: (regex on the foreign name, replacement) tried before the generic candidates
RENAMES: dict[str, list[tuple[str, str]]] = {
    "lfm2_moe": [
        (r"\.moe\.w1$", ".feed_forward.switch_mlp.gate_proj"),
        (r"\.moe\.w2$", ".feed_forward.switch_mlp.down_proj"),
        (r"\.moe\.w3$", ".feed_forward.switch_mlp.up_proj"),
        (r"\.feed_forward\.w1$", ".feed_forward.gate_proj"),
        (r"\.feed_forward\.w2$", ".feed_forward.down_proj"),
        (r"\.feed_forward\.w3$", ".feed_forward.up_proj"),
        (r"\.self_attn\.o_proj$", ".self_attn.out_proj"),
    ],
    "lfm2": [
        (r"\.feed_forward\.w1$", ".feed_forward.gate_proj"),
        (r"\.feed_forward\.w2$", ".feed_forward.down_proj"),
        (r"\.feed_forward\.w3$", ".feed_forward.up_proj"),
        (r"\.self_attn\.o_proj$", ".self_attn.out_proj"),
    ],
}
# why a name has no counterpart, when we know
KNOWN_GAPS: list[tuple[str, str]] = [
    (r"\.moe\.sw[123]$", "shared-expert projection: mlx-lm's lfm2_moe has no shared expert"),
    (r"(^|\.)lm_head$", "tied to the embedding in this model (the embedding's setting is the head's)"),
]


def strip_weight(name: str) -> str:
    """A parameter name without its ``.weight`` suffix (the module path)."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def _candidates(name: str, model_type: str | None) -> list[str]:
    base = strip_weight(name)
    renamed = base
    for pat, rep in RENAMES.get(model_type or "", []):
        renamed = re.sub(pat, rep, renamed)
    out = []
    for n in dict.fromkeys([renamed, base]):
        out += [n, "model." + n, n.removeprefix("model."), n.replace("language_model.", ""),
                "model." + n.replace("model.language_model.", "")]
    return list(dict.fromkeys(out))


def map_names(
    names: Sequence[str], modules: Mapping[str, Sequence[int]], model_type: str | None = None
) -> tuple[dict[str, str], dict[str, str]]:
    """Map foreign tensor names to the model's module paths.

    Returns ``(mapped, unmapped)``: foreign name -> our path, and foreign name -> why it has none.
    """
    mapped: dict[str, str] = {}
    unmapped: dict[str, str] = {}
    taken: dict[str, str] = {}
    for name in names:
        hit = next((c for c in _candidates(name, model_type) if c in modules), None)
        if hit is None:
            why = next((r for p, r in KNOWN_GAPS if re.search(p, strip_weight(name))), None)
            unmapped[name] = why or f"no module of this {model_type or 'model'} has this name"
        elif hit in taken:
            unmapped[name] = f"maps to {hit!r}, already taken by {taken[hit]!r}"
        else:
            mapped[name] = hit
            taken[hit] = name
    return mapped, unmapped


def storable_option(bits: int | None, group_size: int | None, in_features: int) -> tuple[QuantOption, str | None]:
    """The MLX option for a foreign (bits, group size), and a note when MLX cannot store it as is.

    ``bits`` None or >= 16 means kept 16-bit. Widths MLX lacks round up (7 -> 8, never down:
    no silent quality loss); a group size that MLX lacks or that does not divide the
    input dimension becomes the largest valid one that does.
    """
    if bits is None or bits >= 16:
        return QuantOption.fp16(), None
    b = min((v for v in VALID_BITS if v >= bits), default=max(VALID_BITS))
    fitting = [g for g in VALID_GROUPS if in_features % g == 0]
    if not fitting:
        return QuantOption.fp16(), f"no MLX group size divides {in_features} inputs: kept 16-bit"
    g = group_size if group_size in fitting else max([v for v in fitting if group_size is None or v <= group_size]
                                                     or fitting)
    note = None
    if (b, g) != (bits, group_size):
        note = f"{bits}-bit g{group_size} not storable in MLX here: stored as {b}-bit g{g}"
    return QuantOption.uniform(b, g), note


def file_digest(path: str | Path) -> str:
    """sha256 of a file's bytes (hex)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def read_json(path: str | Path) -> Any:
    """A JSON document, or ValueError naming the file."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a folder, expected a JSON file") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not JSON ({e})") from None


def model_modules(source: Any) -> dict[str, list[int]]:
    """Module path -> weight shape of every quantizable module of a model source (no weights loaded)."""
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import build_model

    return {p: [int(d) for d in m.weight.shape] for p, m in quantizable_modules(build_model(source.config)).items()}


def plan_from_widths(
    widths: Mapping[str, tuple[int | None, int | None]],
    modules: Mapping[str, Sequence[int]],
    model_type: str | None,
    *,
    fmt: str,
    path: str | None = None,
    default: tuple[int, int] | None = None,
) -> Any:
    """A plan that gives each mapped tensor its foreign width (``(bits, group)``; bits None = 16-bit).

    Model modules the foreign file does not name get ``default`` (bits, group) when given,
    else stay 16-bit (listed). The import report (mapped, unmapped, adjusted, unnamed) goes
    into ``plan.source``.
    """
    from mlx_dq.plan.plan import Plan, PlanEntry

    mapped, unmapped = map_names(list(widths), modules, model_type)
    entries, adjusted = [], {}
    for foreign, ours in mapped.items():
        shape = list(modules[ours])
        bits, gs = widths[foreign]
        opt, note = storable_option(bits, gs, shape[-1])
        if note:
            adjusted[ours] = note
        entries.append(PlanEntry(ours, opt.desc, opt.storage_bits(shape), shape, math.prod(shape),
                                 scope="kept" if opt.keep16 else "budget"))
    unnamed = sorted(set(modules) - set(mapped.values()))
    if default is not None:
        for ours in unnamed:
            shape = list(modules[ours])
            opt, note = storable_option(default[0], default[1], shape[-1])
            if note:
                adjusted[ours] = note
            entries.append(PlanEntry(ours, opt.desc, opt.storage_bits(shape), shape, math.prod(shape),
                                     scope="kept" if opt.keep16 else "budget"))
    entries.sort(key=lambda e: e.key)
    used = sum(e.bits for e in entries)
    numel = sum(e.numel for e in entries)
    bpw = used / numel if numel else 0.0
    source = {"format": fmt, "path": path, "digest": file_digest(path) if path else None,
              "model_type": model_type, "mapped": dict(sorted(mapped.items())),
              "unmapped": dict(sorted(unmapped.items())), "adjusted": dict(sorted(adjusted.items())),
              "not_named": [] if default is not None else unnamed}
    return Plan(target_bpw=bpw, achieved_bpw=bpw, objective=0.0, lower_bound=None, gap=None, budget_bits=used,
                used_bits=used, numel=numel, total_bpw=bpw, tensors=entries,
                kept=sorted(e.key for e in entries if e.option == "16bit"), method=f"imported:{fmt}",
                source=source)


def import_summary(plan: Any) -> list[str]:
    """Lines that say what an imported plan took from its file and what it could not."""
    src = plan.source
    lines = [f"imported {len(src['mapped'])} tensors from a {src['format']} file "
             f"({len(src['unmapped'])} unmapped, {len(src['adjusted'])} adjusted, "
             f"{len(src.get('not_named', []))} model tensors it does not name: 16-bit)"]
    by_reason: dict[str, list[str]] = {}
    for k, why in src["unmapped"].items():
        by_reason.setdefault(why, []).append(k)
    for why, keys in by_reason.items():
        lines.append(f"  unmapped ({len(keys)}), {why}: {', '.join(keys)}")
    for k, why in src["adjusted"].items():
        lines.append(f"  adjusted {k}: {why}")
    if src.get("not_named"):
        lines.append(f"  not named, kept 16-bit ({len(src['not_named'])}): {', '.join(src['not_named'])}")
    return lines


def modules_for(spec: str) -> tuple[dict[str, list[int]], str | None]:
    """Module shapes and model type from a model spec or a bare ``config.json`` (file, or folder holding one).

    Only the configuration is read: no weights are needed to know the embedding's and head's shapes.
    """
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import build_model, resolve

    p = Path(spec)
    if p.is_file() and p.suffix == ".json":
        config = read_json(p)
    elif p.is_dir() and (p / "config.json").is_file() and not any(p.glob("*.safetensors")):
        config = read_json(p / "config.json")
    else:
        config = resolve(spec).config
    if not isinstance(config, dict) or "model_type" not in config:
        raise InputError(f"{spec}: no model configuration (config.json with a model_type)")
    mods = quantizable_modules(build_model(config))
    return {k: [int(d) for d in m.weight.shape] for k, m in mods.items()}, config.get("model_type")
