"""Option grids: the candidate quantization options measured for each tensor role.

A grid is a JSON file ``{"description": "...", "roles": {role: [desc, ...]}}``
with EXL2-style option descriptions (see :mod:`mlx_dq.options`). Built-in
grids ship inside the package (``mlx_dq/configs/<name>.json``; the repository's
top-level ``configs/`` holds the same files for users to copy and edit).
Roles a grid leaves out take its ``"default"`` list, or the built-in default
grid's list for that role. Keeping a tensor in 16-bit is decided by the
optimizer, so ``16bit`` is not a grid entry.
"""

from __future__ import annotations

import json
import re
from importlib import resources
from pathlib import Path

from .options import QuantOption

ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "embed_head", "expert_in", "expert_out", "default")
DEFAULT_GRID = "default"

_ATTN_IN = {"q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "query_key_value", "wqkv", "c_attn", "wq", "wk", "wv"}
_ATTN_OUT = {"o_proj", "out_proj", "dense", "wo"}
_MLP_IN = {"gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "c_fc", "dense_h_to_4h"}
_MLP_OUT = {"down_proj", "w2", "fc2", "dense_4h_to_h"}
_EMBED_HEAD = {"embed_tokens", "lm_head", "wte", "tok_embeddings", "token_embd", "embeddings", "output"}
_EXPERT = re.compile(r"(^|\.)(switch_mlp|experts)(\.|$)")


def role_of(name: str) -> str:
    """Role of a parameter path such as ``model.layers.3.self_attn.q_proj(.weight)``.

    Expert banks (``switch_mlp.*``, ``experts.*``) map to ``expert_in`` /
    ``expert_out``; unknown layers map to ``"default"``.
    """
    parts = [p for p in name.split(".") if p]
    if parts and parts[-1] in ("weight", "scales", "biases"):
        parts = parts[:-1]
    if not parts:
        raise ValueError(f"empty parameter path: {name!r}")
    leaf = parts[-1].lower()
    parents = {p.lower() for p in parts[:-1]}
    if _EXPERT.search(".".join(parts[:-1]).lower()):
        return "expert_out" if leaf in _MLP_OUT else "expert_in"
    if leaf in _EMBED_HEAD and (leaf != "output" or len(parts) == 1):
        return "embed_head"
    if leaf == "c_proj":  # GPT-2 style: c_proj ends both attention and MLP
        return "mlp_out" if parents & {"mlp", "ffn", "feed_forward"} else "attn_out"
    if leaf in _ATTN_IN:
        return "attn_in"
    if leaf in _ATTN_OUT:
        return "mlp_out" if leaf == "dense" and parents & {"mlp", "ffn"} else "attn_out"
    if leaf in _MLP_IN:
        return "mlp_in"
    if leaf in _MLP_OUT:
        return "mlp_out"
    return "default"


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
            raise ValueError(f"option grid file not found: {path}")
        source, text = str(path), path.read_text()
    else:
        res = resources.files("mlx_dq") / "configs" / f"{text_name}.json"
        if not res.is_file():
            raise ValueError(f"unknown option grid {text_name!r}; built-in grids: {', '.join(grid_names())}")
        source, text = f"built-in grid {text_name!r}", res.read_text()
    try:
        return json.loads(text), source
    except json.JSONDecodeError as e:
        raise ValueError(f"option grid {source} is not valid JSON: {e}") from e


def parse_grid(data: dict, source: str = "grid") -> dict[str, list[QuantOption]]:
    """Validate a grid's JSON object and parse its roles (only the roles it lists)."""
    if not isinstance(data, dict) or not isinstance(data.get("roles"), dict):
        raise ValueError(f"option grid {source} must be a JSON object with a 'roles' object")
    extra = set(data) - {"roles", "description"}
    if extra:
        raise ValueError(f"option grid {source}: unknown top-level keys {sorted(extra)}")
    out: dict[str, list[QuantOption]] = {}
    for role, descs in data["roles"].items():
        if role not in ROLES:
            raise ValueError(f"option grid {source}: unknown role {role!r}; valid roles: {', '.join(ROLES)}")
        if not isinstance(descs, list) or not descs:
            raise ValueError(f"option grid {source}: role {role!r} needs a non-empty list of option descriptions")
        opts = []
        for i, desc in enumerate(descs):
            try:
                opt = QuantOption.parse(desc)
            except ValueError as e:
                raise ValueError(f"option grid {source}: role {role!r} entry {i} ({desc!r}): {e}") from e
            if opt.keep16:
                raise ValueError(
                    f"option grid {source}: role {role!r} entry {i}: 16-bit is chosen by the optimizer, not listed"
                )
            if opt in opts:
                raise ValueError(f"option grid {source}: role {role!r} lists {opt.desc} twice")
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


def options_for(grid: dict[str, list[QuantOption]], name: str, in_features: int) -> list[QuantOption]:
    """The grid's options for parameter ``name`` that fit a tensor with ``in_features`` inputs."""
    return [o for o in grid[role_of(name)] if o.fits(in_features)]
