"""Resume state of a measurement: the hidden states after its last finished layer, next to the measurement file.

One process writes ``<file>.state.safetensors`` (arrays ``hidden`` and ``carried.<k>``), replaced after each layer.
With several ranks each writes ``<file>.state.rank<r>of<n>.layer<i>.safetensors`` (its batches as ``hidden.<batch>``
and ``carried.<k>``), and a layer counts as done once every rank has its file. Both layouts record the layer and the
settings digest as metadata and are written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_dq.runtime import distributed as dist
from mlx_dq.runtime.distributed import LocalRows


def state_path(out: Path, layer: int | None = None) -> Path:
    """The resume state next to the measurement file ``out``: one process's (``layer`` None), else this rank's
    after ``layer``."""
    if layer is None:
        return out.with_name(out.name + ".state.safetensors")
    return out.with_name(f"{out.name}.state.rank{dist.rank()}of{dist.size()}.layer{layer}.safetensors")


def save_state(out: Path, layer: int, hidden: Any, settings: str, carried: dict[int, mx.array] | None = None) -> None:
    """Write this process's state after ``layer`` atomically: ``hidden`` (an array, or this rank's
    :class:`~mlx_dq.runtime.distributed.LocalRows` when distributed) and the ``carried`` copies."""
    copies = {f"carried.{k}": v for k, v in (carried or {}).items()}
    if dist.active():
        sp, arrays = state_path(out, layer), {**hidden.arrays(), **copies}
    else:
        sp, arrays = state_path(out), {"hidden": hidden, **copies}
    sp.parent.mkdir(parents=True, exist_ok=True)
    tmp = sp.with_name(sp.name.removesuffix(".safetensors") + ".tmp.safetensors")
    mx.save_safetensors(str(tmp), arrays, metadata={"layer": str(layer), "settings": settings})
    os.replace(tmp, sp)


def load_state(out: Path, settings: str, layer: int | None = None,
               batches: list[slice] | None = None) -> tuple[Any, int, dict[int, mx.array]] | None:
    """This process's state as ``(hidden, layer, carried)``, or None when missing or from other ``settings``.

    Distributed: this rank's state after ``layer``, its hidden states over ``batches``; one process: the one file,
    with the layer it records."""
    sp = state_path(out, layer if dist.active() else None)
    if not sp.exists():
        return None
    arrays, meta = mx.load(str(sp), return_metadata=True)
    if meta.get("settings") != settings:
        return None
    carried = {int(k.split(".", 1)[1]): v for k, v in arrays.items() if k.startswith("carried.")}
    if dist.active():
        parts = {int(k.split(".", 1)[1]): v for k, v in arrays.items() if k.startswith("hidden.")}
        return LocalRows(parts, batches), layer, carried
    return arrays["hidden"], int(meta["layer"]), carried


def drop_states(out: Path, before: int | None = None) -> None:
    """Delete this rank's states of layers before ``before`` (all when None)."""
    prefix = f"{out.name}.state.rank{dist.rank()}of{dist.size()}.layer"
    for p in out.parent.glob(prefix + "*.safetensors"):
        tail = p.name[len(prefix):].split(".")[0]
        if tail.isdigit() and (before is None or int(tail) < before):
            p.unlink(missing_ok=True)
