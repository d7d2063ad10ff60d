"""Weights swapped in for a measurement and always put back: a whole weight, or some rows of a lookup table."""

from __future__ import annotations

import contextlib
from typing import Iterator

import mlx.core as mx
import mlx.nn as nn
import numpy as np


@contextlib.contextmanager
def weight_as(module: nn.Module, w: mx.array) -> Iterator[mx.array]:
    """``module.weight`` is ``w`` while inside (the original is yielded), then the original again, also on errors."""
    saved = module.weight
    module.weight = w
    try:
        yield saved
    finally:
        module.weight = saved


@contextlib.contextmanager
def rows_swapped(mod: nn.Module, ids: np.ndarray, rows: mx.array) -> Iterator[None]:
    """``mod.weight`` with rows ``ids`` replaced by ``rows`` while inside, then the original again.

    A float32 table is changed in its own buffer (the replaced rows kept aside), not copied: at Llama-3-8B's
    128,256 x 4,096 a copy of the table with the rows changed was 2.1 GB (4.2 GB at 70B's width)."""
    w = mod.weight
    mx.eval(w)
    if w.dtype != mx.float32:
        changed = mx.array(w)
        changed[mx.array(ids)] = rows.astype(w.dtype)
        with weight_as(mod, changed):
            yield
        return
    table = np.asarray(w)  # a writable view of the table's buffer
    saved = table[ids].copy()
    table[ids] = np.asarray(rows.astype(mx.float32))
    try:
        yield
    finally:
        table[ids] = saved
