"""Loading mlx-dq output folders.

A folder with only whole-tensor options is a stock mlx-lm model: ``mlx_lm.load``
reads it as is. A folder with mixed-proportion tensors lists them under
``mlx_dq.mixed`` in config.json; :func:`mixed_model_classes` wraps mlx-lm's own
model class so that those modules are mlx-dq mixed layers before mlx-lm loads
the weights. The folder's model file uses it (``trust_remote_code``), and
:func:`load` uses it directly, without any flag.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.nn as nn

from .mixed import MixedEmbedding, MixedLinear, MixedSwitchLinear


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
    """Swap the modules named in ``mixed`` (path -> {option, shape, kind, bias}) for empty mixed layers."""
    for path, spec in mixed.items():
        shape, kind, opt = spec["shape"], spec.get("kind", "linear"), spec["option"]
        if kind == "linear":
            new = MixedLinear(shape[1], shape[0], opt, bias=bool(spec.get("bias")))
        elif kind == "embedding":
            new = MixedEmbedding(shape[0], shape[1], opt)
        elif kind == "switch":
            new = MixedSwitchLinear(shape[2], shape[1], shape[0], opt, bias=bool(spec.get("bias")))
        else:
            raise ValueError(f"{path}: unknown mixed layer kind {kind!r}")
        _set_module(model, path, new)
    return model


def mixed_model_classes(config: dict) -> tuple[type, type]:
    """mlx-lm's ``(Model, ModelArgs)`` for ``config``, with Model building mlx-dq mixed layers listed in it."""
    from mlx_lm.utils import _get_classes

    base, args_cls = _get_classes({k: v for k, v in config.items() if k != "model_file"})
    mixed = (config.get("mlx_dq") or {}).get("mixed") or {}

    class Model(base):  # type: ignore[misc, valid-type]
        def __init__(self, args: Any):
            super().__init__(args)
            install_mixed_layers(self, mixed)

    Model.__name__ = Model.__qualname__ = base.__name__
    return Model, args_cls


def load(path: str | Path, lazy: bool = False) -> tuple[nn.Module, Any]:
    """Load an mlx-dq output folder (mixed or not) as ``(model, tokenizer)`` without trust_remote_code."""
    from mlx_lm.utils import load_model, load_tokenizer

    path = Path(path)
    if not (path / "config.json").exists():
        raise ValueError(f"{path} is not a model folder (no config.json)")
    model, config = load_model(path, lazy=lazy, model_config={"model_file": None},
                               get_model_classes=mixed_model_classes)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    return model, tokenizer
