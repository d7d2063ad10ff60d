"""Human-readable reports of a converted model: the per-layer bit map and the accounting."""

from __future__ import annotations

import json
import re
from pathlib import Path

MANIFEST_NAME = "mlx_dq.json"
_LAYER = re.compile(r"^(.*?\.layers\.)(\d+)\.(.+)$")
_SHADES = " .:-=+*#%@"


def read_manifest(folder: str | Path) -> dict:
    """The manifest ``mlx_dq.json`` of an output folder (ValueError when missing, corrupt or foreign)."""
    path = Path(folder) / MANIFEST_NAME
    if not path.exists():
        raise ValueError(f"{folder} has no {MANIFEST_NAME}: not an mlx-dq output folder")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict) or data.get("schema") != "mlx_dq.manifest" or "modules" not in data:
        raise ValueError(f"{path} is not an mlx-dq manifest")
    return data


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
        m = _LAYER.match(name)
        if m:
            rows.setdefault(int(m.group(2)), {})[_short(m.group(3))] = rec
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
