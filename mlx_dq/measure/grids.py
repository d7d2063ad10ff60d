"""Option grids: the candidate quantization options measured for each tensor role.

A grid is a JSON file ``{"description": "...", "roles": {role: [desc, ...]}}``
with EXL2-style option descriptions (see :mod:`mlx_dq.quant.options`). Built-in
grids ship inside the package (``mlx_dq/configs/<name>.json``; the repository's
top-level ``configs/`` holds the same files for users to copy and edit).
Roles a grid leaves out take its ``"default"`` list, or the built-in default
grid's list for that role. Keeping a tensor in 16-bit is decided by the
optimizer, so ``16bit`` is not a grid entry.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from mlx_dq.errors import InputError
from mlx_dq.names import ROLES
from mlx_dq.quant.options import QuantOption

DEFAULT_GRID = "default"


def grid_names() -> list[str]:
    """Names of the grids shipped with the package."""
    folder = resources.files("mlx_dq") / "configs"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def _read(path_or_name: str | Path) -> tuple[dict, str]:
    """The parsed JSON of a grid given by file path or built-in name, and where it came from."""
    text_name = str(path_or_name)
    is_path = isinstance(path_or_name, Path) or text_name.endswith(".json") or "/" in text_name or "\\" in text_name
    if is_path:
        path = Path(path_or_name)
        if not path.is_file():
            raise InputError(f"option grid file not found: {path}")
        source, text = str(path), path.read_text()
    else:
        res = resources.files("mlx_dq") / "configs" / f"{text_name}.json"
        if not res.is_file():
            raise InputError(f"unknown option grid {text_name!r}; built-in grids: {', '.join(grid_names())}")
        source, text = f"built-in grid {text_name!r}", res.read_text()
    try:
        return json.loads(text), source
    except json.JSONDecodeError as e:
        raise InputError(f"option grid {source} is not valid JSON: {e}") from e


def parse_grid(data: dict, source: str = "grid") -> dict[str, list[QuantOption]]:
    """Validate a grid's JSON object and parse its roles (only the roles it lists)."""
    if not isinstance(data, dict) or not isinstance(data.get("roles"), dict):
        raise InputError(f"option grid {source} must be a JSON object with a 'roles' object")
    extra = set(data) - {"roles", "description"}
    if extra:
        raise InputError(f"option grid {source}: unknown top-level keys {sorted(extra)}")
    out: dict[str, list[QuantOption]] = {}
    for role, descs in data["roles"].items():
        if role not in ROLES:
            raise InputError(f"option grid {source}: unknown role {role!r}; valid roles: {', '.join(ROLES)}")
        if not isinstance(descs, list) or not descs:
            raise InputError(f"option grid {source}: role {role!r} needs a non-empty list of option descriptions")
        opts = []
        for i, desc in enumerate(descs):
            try:
                opt = QuantOption.parse(desc)
            except ValueError as e:
                raise InputError(f"option grid {source}: role {role!r} entry {i} ({desc!r}): {e}") from e
            if opt.keep16:
                raise InputError(
                    f"option grid {source}: role {role!r} entry {i}: 16-bit is chosen by the optimizer, not listed"
                )
            if opt in opts:
                raise InputError(f"option grid {source}: role {role!r} lists {opt.desc} twice")
            opts.append(opt)
        out[role] = sorted(opts, key=lambda o: (o.nominal_bpw(), o.desc))
    return out


def load_grid(path_or_name: str | Path | None = None) -> dict[str, list[QuantOption]]:
    """Load an option grid (built-in name or JSON path; default: the built-in default grid).

    Returns every role in :data:`ROLES`, options sorted by nominal bits per
    weight; roles the file leaves out come from its ``default`` list, else from
    the built-in default grid.
    """
    data, source = _read(DEFAULT_GRID if path_or_name is None else path_or_name)
    grid = parse_grid(data, source)
    builtin = None
    for role in ROLES:
        if role in grid:
            continue
        if "default" in grid:
            grid[role] = list(grid["default"])
            continue
        if builtin is None:
            builtin = parse_grid(*_read(DEFAULT_GRID))
        grid[role] = list(builtin[role])
    return {role: grid[role] for role in ROLES}
