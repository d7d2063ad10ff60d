"""Human-readable reports of a converted model: the per-layer bit map and the accounting."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlx_dq.conversion.writer import MANIFEST_NAME, check_manifest, read_manifest
from mlx_dq.errors import InputError, IntegrityError
from mlx_dq.names import split_layer

_SHADES = " .:-=+*#%@"


def _recorded_files(files: Any, path: Path) -> dict[str, int] | None:
    """The manifest's ``files`` list (``[{"name", "bytes", ...}]``) as name -> size."""
    if not isinstance(files, list):
        raise IntegrityError.at(path, "'files' must be a list of {name, bytes} records")
    out: dict[str, int] = {}
    for i, f in enumerate(files):
        name = f.get("name") if isinstance(f, dict) else None
        size = f.get("bytes") if isinstance(f, dict) else None
        if not isinstance(name, str) or not name or isinstance(size, bool) or not isinstance(size, int) or size < 0:
            raise IntegrityError.at(path, f"files[{i}] must be a record with a file name and a byte count, got {f!r}")
        out[name] = size
    return out


def check_folder(folder: str | Path, manifest: dict) -> list[str]:
    """Problems of an output folder against its manifest: missing or resized files, config.json disagreeing.

    Returns nothing when the folder is whole: every file the manifest lists exists
    with its recorded size (older manifests: the weight files config and index
    name), and config.json quantizes exactly the modules the manifest records, as
    it records them.
    """
    from mlx_dq.quant.options import QuantOption

    folder = Path(folder)
    path = folder / MANIFEST_NAME
    check_manifest(manifest, path)
    problems: list[str] = []
    index = folder / "model.safetensors.index.json"
    if index.exists():
        try:
            shards = sorted({str(v) for v in json.loads(index.read_text())["weight_map"].values()})
        except (ValueError, KeyError, TypeError, AttributeError):
            shards = []
            problems.append("model.safetensors.index.json is not a valid index")
    else:
        shards = ["model.safetensors"]
    files = _recorded_files(manifest["files"], path) if "files" in manifest else None
    if files is not None:
        for name, size in sorted(files.items()):
            f = folder / name
            if "/" in name or "\\" in name or name.startswith("."):
                problems.append(f"the manifest lists a file outside the folder: {name!r}")
            elif not f.is_file():
                problems.append(f"{name} is missing")
            elif f.stat().st_size != size:
                problems.append(f"{name} has size {f.stat().st_size:,} bytes, the manifest records {size:,}")
        problems += [f"weight file {s} is not recorded in the manifest" for s in shards if s not in files]
    problems += [f"{s} is missing" for s in shards if not (folder / s).is_file() and not (files is not None and s in files)]
    problems += _header_problems(folder, sorted(set(shards) | {n for n in files or {} if n.endswith(".safetensors")}))
    on_disk = manifest.get("accounting", {}).get("weights_on_disk_bytes")
    if on_disk is not None and all((folder / s).is_file() for s in shards):
        total = sum((folder / s).stat().st_size for s in shards)
        if total != on_disk:
            problems.append(f"the weight files hold {total:,} bytes, the manifest records {on_disk:,}")
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError("not an object")
    except (OSError, ValueError) as e:
        return problems + [f"config.json cannot be read ({e})"]
    quant = config.get("quantization") if isinstance(config.get("quantization"), dict) else {}
    quant = {k: v for k, v in quant.items() if isinstance(v, dict)}
    mixed = ((config.get("mlx_dq") or {}) if isinstance(config.get("mlx_dq"), dict) else {}).get("mixed") or {}
    if not isinstance(mixed, dict):
        mixed = {}
    modules = manifest["modules"]
    for name, rec in sorted(modules.items()):
        opt = QuantOption.parse(rec["option"])
        if opt.keep16:
            if name in quant or name in mixed:
                problems.append(f"config.json quantizes {name}, which the manifest records as 16-bit")
        elif opt.is_mixed:
            if not isinstance(mixed.get(name), dict) or mixed[name].get("option") != opt.desc:
                problems.append(f"config.json does not list {name} as the mixed layer {opt.desc} of the manifest")
        else:
            seg = opt.segments[0]
            want = {"group_size": seg.group_size, "bits": seg.bits, "mode": "affine"}
            if quant.get(name) != want:
                problems.append(f"config.json quantizes {name} as {quant.get(name)}, the manifest records {want}")
    for name in sorted(set(quant) | set(mixed)):
        if name not in modules:
            problems.append(f"config.json quantizes {name}, which the manifest does not record")
    return problems


def _header_problems(folder: Path, names: list[str]) -> list[str]:
    """The damaged headers among the weight files ``names`` of ``folder`` that exist (a cheap read of each header)."""
    from mlx_dq.loader import check_safetensors

    out = []
    for name in names:
        f = folder / name
        if "/" in name or "\\" in name or name.startswith(".") or not f.is_file():
            continue  # reported above
        try:
            check_safetensors(f)
        except IntegrityError as e:
            out.append(str(e))
    return out


def _check_digests(folder: Path, manifest: dict) -> str:
    """IntegrityError naming the first file whose sha256 differs from the manifest's record; else what was checked."""
    from mlx_dq.formats.common import file_digest

    records = [f for f in manifest.get("files") or [] if isinstance(f, dict)]
    checked, unrecorded, total = 0, [], 0
    for rec in records:
        want, f = rec.get("sha256"), folder / str(rec.get("name"))
        if not isinstance(want, str):
            unrecorded.append(str(rec.get("name")))
            continue
        try:
            got = file_digest(f)
        except OSError as e:
            raise IntegrityError(f"cannot read {f}: {e.strerror or e}") from None
        if got != want:
            raise IntegrityError(f"{f} was changed after mlx-dq wrote it: its sha256 is {got[:16]}..., the "
                                 f"manifest records {want[:16]}...; do not use this folder")
        checked, total = checked + 1, total + f.stat().st_size
    if not checked:
        return f"{folder}: the manifest records no checksums (an older mlx-dq): weight files checked by size only"
    note = f" ({len(unrecorded)} without a recorded checksum: {', '.join(unrecorded)})" if unrecorded else ""
    return f"{folder}: {checked} weight file(s), {total:,} bytes, match the sha256 the manifest records{note}"


def verify_folder(folder: str | Path) -> list[str]:
    """Every check of ``mlx_dq verify``: the model file is mlx-dq's shim, the folder matches its manifest (files,
    sizes, headers, config.json) and each weight file's sha256 is the recorded one. Returns what was checked;
    IntegrityError (or InputError for a folder that is not an mlx-dq output) on the first failure."""
    from mlx_dq.conversion.writer import verify_model_file

    folder = Path(folder)
    lines = [verify_model_file(folder)]
    manifest = read_manifest(folder)
    problems = check_folder(folder, manifest)
    if problems:
        raise IntegrityError(f"{folder} does not match its manifest: " + "; ".join(problems[:5])
                             + (f" (and {len(problems) - 5} more)" if len(problems) > 5 else ""))
    lines.append(f"{folder}: every file the manifest lists is present with its size; headers and config.json "
                 "agree with it")
    lines.append(_check_digests(folder, manifest))
    return lines


def _short(name: str) -> str:
    """Column label of a tensor inside a layer: its last path component (experts marked with a prefix)."""
    parts = name.split(".")
    leaf = parts[-1][: -len("_proj")] if parts[-1].endswith("_proj") else parts[-1]
    return ("x." if "switch_mlp" in parts or "experts" in parts else "") + leaf


def bit_map(manifest: dict, width: int = 5) -> str:
    """A table of bits per weight, one row per decoder layer and one column per tensor, plus the accounting.

    Each cell shows the tensor's stored bits per weight and a shade character
    (darker = more bits), so fragile layers stand out at a glance; mixed options
    are marked with ``m``.
    """
    rows: dict[int, dict[str, dict]] = {}
    other: dict[str, dict] = {}
    for name, rec in manifest["modules"].items():
        found = split_layer(name)
        if found and found[2]:
            rows.setdefault(found[1], {})[_short(found[2])] = rec
        else:
            other[name] = rec
    cols = sorted({c for r in rows.values() for c in r}, key=lambda c: (c.startswith("x."), c))
    bpws = [r["bpw"] for r in manifest["modules"].values()]
    lo, hi = (min(bpws), max(bpws)) if bpws else (0.0, 1.0)

    def cell(rec: dict | None) -> str:
        if rec is None:
            return " " * width
        shade = _SHADES[int(round((rec["bpw"] - lo) / max(hi - lo, 1e-9) * (len(_SHADES) - 1)))]
        mark = "m" if "/" in rec["option"] else " "
        return f"{rec['bpw']:.{max(width - 4, 1)}f}"[: width - 2].rjust(width - 2) + mark + shade

    lines = ["layer " + " ".join(c[-width:].rjust(width) for c in cols)]
    for i in sorted(rows):
        lines.append(f"{i:5d} " + " ".join(cell(rows[i].get(c)) for c in cols))
    for name, rec in sorted(other.items()):
        lines.append(f"{name}: {rec['option']} ({rec['bpw']:.3f} bpw)")
    acc = manifest.get("accounting", {})
    lines.append("")
    lines.append(f"cells: bits per weight, m = mixed-proportion, shade {_SHADES!r} from {lo:.2f} to {hi:.2f} bpw")
    for key in ("target_bpw", "average_bits", "average_bits_all", "packed_bytes", "kept16_bytes",
                "weights_on_disk_bytes", "quantized_elements", "elements"):
        if key in acc and acc[key] is not None:
            val = acc[key]
            lines.append(f"{key:22s} {val:.4f}" if isinstance(val, float) else f"{key:22s} {val:,}")
    if manifest.get("tied"):
        lines.append(f"tied: {manifest['tied']}")
    if manifest.get("results"):
        lines.append("results: " + json.dumps(manifest["results"]))
    return "\n".join(lines)


def describe(path: str | Path) -> str:
    """A short human-readable account of any file :func:`detect` knows (for ``mlx_dq inspect``)."""
    from mlx_dq.formats import dashq, detect, dynquant, mlx_kept16
    from mlx_dq.formats.common import read_json

    data = read_json(path)
    kind = detect(data)
    if kind == "dynquant":
        return dynquant.describe(data)
    if kind == "mlx_kept16":
        return mlx_kept16.describe(data)
    if kind == "dashq":
        return dashq.describe(data)
    if kind == "mlx_dq.plan":
        return _describe_plan(data)
    if kind in ("exl2_v1", "exl2_v2", "mlx_dq.measurement"):
        from mlx_dq.measure.records import load_measurement

        m = load_measurement(path)
        n_opt = sum(len(t.options) for t in m.tensors.values()) + sum(len(g.options) for g in m.groups.values())
        heads = [k for k, t in m.tensors.items() if t.role in ("embed_head", "embed", "head")]
        return "\n".join([
            f"{kind} measurement: {len(m.tensors)} tensors, {len(m.groups)} joint modules, {n_opt} options, "
            f"{m.numel():,} weights",
            f"embedding/head measured: {', '.join(heads) if heads else 'no (they are not in this file)'}",
        ])
    if kind == "mlx_dq.manifest":
        return bit_map(data)
    raise InputError(f"{path}: not a file mlx_dq knows (plan, manifest, measurement, dynquant manifest, "
                     f"MLX config with kept_16bit or dashq record)")


def _describe_plan(data: dict) -> str:
    from collections import Counter

    opts = Counter(e["option"] for e in data.get("tensors", []))
    lines = [f"mlx_dq plan ({data.get('method')}): {len(data.get('tensors', []))} tensors, "
             f"target {data.get('target_bpw')} bpw, achieved {data.get('achieved_bpw'):.4f}, "
             f"all tensors {data.get('total_bpw'):.4f} bpw, kept 16-bit {len(data.get('kept', []))}"]
    lines += [f"  {n:5d} x {o}" for o, n in opts.most_common()]
    return "\n".join(lines)
