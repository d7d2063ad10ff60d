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

from pathlib import Path
from typing import Any

import mlx.nn as nn

from .mixed import empty_mixed_layer
from .rowsplit import empty_split_layer


def _set_module(root: nn.Module, path: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``path`` (list indices allowed) by ``new``."""
    *parents, last = path.split(".")
    mod: Any = root
    for p in parents:
        mod = mod[int(p)] if isinstance(mod, list) else getattr(mod, p)
    if isinstance(mod, list):
        mod[int(last)] = new
    else:
        setattr(mod, last, new)


def install_mixed_layers(model: nn.Module, mixed: dict[str, dict]) -> nn.Module:
    """Swap the modules named in ``mixed`` (path -> {"option": desc, ...}) for empty mixed layers to load into."""
    modules = dict(model.named_modules())
    for path, spec in mixed.items():
        if path not in modules:
            raise ValueError(f"config lists a mixed layer {path!r} that the model does not have")
        _set_module(model, path, empty_mixed_layer(modules[path], spec["option"]))
    return model


def install_row_splits(model: nn.Module, splits: dict[str, dict]) -> nn.Module:
    """Swap the embeddings named in ``splits`` (path -> {"rows": hot rows}) for empty row-split tables to load into."""
    modules = dict(model.named_modules())
    for path, spec in splits.items():
        if path not in modules:
            raise ValueError(f"config lists a row-split table {path!r} that the model does not have")
        _set_module(model, path, empty_split_layer(modules[path], int(spec["rows"])))
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
            raise ValueError(f"{path} is not a local folder and cannot be fetched from the hub "
                             f"({type(e).__name__}: {detail})") from None
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a model folder (no config.json)")
    model, config = load_model(path, lazy=lazy, model_config={"model_file": None},
                               get_model_classes=mixed_model_classes)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer
