"""Loading mlx-dq output folders.

A folder with only whole-tensor options is a stock mlx-lm model: ``mlx_lm.load``
reads it as is. A folder with mixed-proportion tensors lists them under
``mlx_dq.mixed`` in config.json (embeddings with frequent-token rows under
``mlx_dq.row_split``); :func:`mixed_model_classes` wraps mlx-lm's own model class
so that those modules are mlx-dq layers before mlx-lm loads the weights. The
folder's model file uses it (``trust_remote_code``), and :func:`load` uses it
directly, without any flag.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_dq.errors import InputError, IntegrityError
from mlx_dq.layers.mixed import empty_mixed_layer
from mlx_dq.layers.rowsplit import empty_split_layer

# bytes per element of the safetensors dtypes MLX reads
SAFETENSORS_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                          "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit


def install_mixed_layers(model: nn.Module, mixed: dict[str, dict]) -> nn.Module:
    """Swap the modules named in ``mixed`` (path -> {"option": desc, ...}) for empty mixed layers to load into."""
    modules = dict(model.named_modules())
    for path, spec in mixed.items():
        if path not in modules:
            raise IntegrityError(f"config lists a mixed layer {path!r} that the model does not have")
        model.update_modules(tree_unflatten([(path, empty_mixed_layer(modules[path], spec["option"]))]))
    return model


def install_row_splits(model: nn.Module, splits: dict[str, dict]) -> nn.Module:
    """Swap the embeddings named in ``splits`` (path -> {"rows": hot rows}) for empty row-split tables to load into."""
    modules = dict(model.named_modules())
    for path, spec in splits.items():
        if path not in modules:
            raise IntegrityError(f"config lists a row-split table {path!r} that the model does not have")
        model.update_modules(tree_unflatten([(path, empty_split_layer(modules[path], int(spec["rows"])))]))
    return model


def mixed_model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's ``(Model, ModelArgs)`` for ``config``, with Model building the mlx-dq mixed layers and row-split
    tables listed in it (splits first: their parts may be mixed layers)."""
    from mlx_lm.utils import _get_classes

    base, args_cls = _get_classes({k: v for k, v in config.items() if k != "model_file"})
    mixed = (config.get("mlx_dq") or {}).get("mixed") or {}
    splits = (config.get("mlx_dq") or {}).get("row_split") or {}

    class Model(base):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any):
            super().__init__(args)
            install_row_splits(self, splits)
            install_mixed_layers(self, mixed)

    Model.__name__ = Model.__qualname__ = base.__name__
    return Model, args_cls


def _read_header(path: Path) -> tuple[dict, int]:
    """A safetensors file's header (parsed) and the size of its data part; IntegrityError when unreadable."""
    try:
        with open(path, "rb") as fh:
            size = path.stat().st_size
            n = int.from_bytes(fh.read(8), "little") if size >= 8 else -1
            if n < 2 or n > min(size - 8, MAX_HEADER_BYTES):
                raise IntegrityError(f"{path}: damaged safetensors file (header length {n} does not fit in its "
                                     f"{size:,} bytes)")
            raw = fh.read(n)
    except OSError as e:
        raise IntegrityError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path}: damaged safetensors header (not JSON: {e})") from None
    if not isinstance(header, dict):
        raise IntegrityError(f"{path}: damaged safetensors header (not a JSON object)")
    return header, size - 8 - n


def _entry_problem(name: str, entry: Any, data_bytes: int) -> str | None:
    """What is wrong with one tensor's header entry (None when it is consistent and inside the data)."""
    if not isinstance(entry, dict) or entry.get("dtype") not in SAFETENSORS_ITEM_BYTES:
        return f"tensor {name!r} has no known dtype"
    shape, offsets = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        return f"tensor {name!r} has a bad shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"tensor {name!r} has data offsets {offsets!r} outside the {data_bytes:,} data bytes"
    if offsets[1] - offsets[0] != math.prod(shape) * SAFETENSORS_ITEM_BYTES[entry["dtype"]]:
        return f"tensor {name!r} of shape {shape} and dtype {entry['dtype']} does not fill its data offsets"
    return None


def check_safetensors(path: str | Path) -> None:
    """IntegrityError naming ``path`` unless its header parses, every dtype is known and every tensor's bytes
    lie inside the file: a cheap check (the header only) that catches truncation and header damage before
    MLX reads the file (which fails with a bare RuntimeError, or worse, later)."""
    path = Path(path)
    header, data_bytes = _read_header(path)
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise IntegrityError(f"{path}: damaged safetensors header (__metadata__ is not an object of strings)")
    for name, entry in header.items():
        problem = _entry_problem(name, entry, data_bytes)
        if problem:
            raise IntegrityError(f"{path}: damaged safetensors header ({problem})")


def _looks_like_repo_id(spec: str) -> bool:
    """True for ``USER/NAME`` (a hub repo id), not for paths such as ``./x`` or ``/a/b``."""
    import re

    return bool(re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$", spec)) and ".." not in spec


def load(path: str | Path, lazy: bool = False) -> tuple[nn.Module, Any]:
    """Load an mlx-dq output folder or hub repo id (mixed or not) as ``(model, tokenizer)`` without trust_remote_code."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(path)
    if not path.exists() and _looks_like_repo_id(str(path)):  # a hub repo id, as mlx_lm.load accepts
        from huggingface_hub import snapshot_download
        from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

        try:
            path = Path(snapshot_download(str(path), allow_patterns=DEFAULT_ALLOW_PATTERNS))
        except Exception as e:  # offline, unknown repo: one clear error
            detail = (str(e).strip().splitlines() or [""])[0]
            raise InputError(f"{path} is not a local folder and cannot be fetched from the hub "
                             f"({type(e).__name__}: {detail})") from None
    if not (path / "config.json").exists():
        raise InputError(f"{path} is not a model folder (no config.json)")
    _check_config(path / "config.json")
    files = sorted(path.glob("model*.safetensors"))  # what mlx-lm's load_model reads
    if not files:
        raise IntegrityError(f"{path} has no model*.safetensors weight files")
    for f in files:
        check_safetensors(f)
    try:
        model, config = load_model(path, lazy=lazy, model_config={"model_file": None},
                                   get_model_classes=mixed_model_classes)
    except RuntimeError as e:  # MLX reading a damaged file the header check let through
        raise IntegrityError(f"cannot read the weights of {path} ({', '.join(f.name for f in files)}): "
                             f"{_one_line(e)}") from None
    except (KeyError, TypeError, AttributeError, IndexError, ZeroDivisionError) as e:  # an edited config.json
        raise IntegrityError(f"{path / 'config.json'} does not describe a model mlx-lm can build "
                             f"({type(e).__name__}: {_one_line(e)})") from None
    except ValueError as e:  # e.g. weights that do not match the config (missing, extra or reshaped tensors)
        raise IntegrityError(f"{path} does not load: {_one_line(e)}") from None
    try:
        tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    except Exception as e:  # noqa: BLE001  (tokenizers and transformers raise bare Exception on a damaged file)
        raise IntegrityError(f"cannot load the tokenizer of {path} ({type(e).__name__}: {_one_line(e)})") from None
    return model, tokenizer


def _one_line(e: BaseException, limit: int = 300) -> str:
    """An exception's message as one line of at most ``limit`` characters."""
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_config(path: Path) -> None:
    """IntegrityError unless config.json is a JSON object (mlx-lm would fail on anything else with a traceback)."""
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise IntegrityError(f"{path} cannot be read as JSON: {_one_line(e)}") from None
    if not isinstance(config, dict):
        raise IntegrityError(f"{path} is not a JSON object")
