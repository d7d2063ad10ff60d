"""The layer of a split table: frequent-token rows in one quantized part, the others in another.

:mod:`mlx_dq.quant.rowsplit` chooses the rows and quantizes them; :class:`RowSplitEmbedding` looks rows
up (and, as a tied head, computes logits) from both parts.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class _Index:
    """Lookup maps derived from ``hot_ids`` (not parameters): rebuilt when the ids array is replaced."""

    def __init__(self) -> None:
        self.source: mx.array | None = None
        self.is_hot = self.slot = self.position = None


class RowSplitEmbedding(nn.Module):
    """An embedding whose ``hot_ids`` rows live in ``hot`` and the other rows, in id order, in ``cold``.

    ``hot`` and ``cold`` are any embedding layers (quantized, mixed or float);
    calls and ``as_linear`` (the tied head) give what one table would.
    """

    def __init__(self, hot: nn.Module, cold: nn.Module, hot_ids: mx.array):
        super().__init__()
        self.hot, self.cold, self.hot_ids = hot, cold, hot_ids
        self.num_embeddings = int(hot_ids.shape[0]) + _rows(cold)
        self._index = _Index()

    def _maps(self) -> _Index:
        ix = self._index
        if ix.source is not self.hot_ids:
            ids = np.asarray(self.hot_ids).astype(np.int64)
            vocab = self.num_embeddings
            is_hot = np.zeros(vocab, dtype=bool)
            is_hot[ids] = True
            slot = np.empty(vocab, dtype=np.int32)
            slot[ids] = np.arange(ids.size, dtype=np.int32)
            slot[~is_hot] = np.arange(vocab - ids.size, dtype=np.int32)
            ix.is_hot, ix.slot = mx.array(is_hot), mx.array(slot)
            ix.position = mx.array(np.where(is_hot, slot, ids.size + slot).astype(np.int32))
            ix.source = self.hot_ids
        return ix

    def __call__(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` of the table, each from the part that holds it."""
        ix = self._maps()
        hot, slot = ix.is_hot[ids], ix.slot[ids]
        a = self.hot(mx.where(hot, slot, 0))
        b = self.cold(mx.where(hot, 0, slot))
        return mx.where(mx.expand_dims(hot, -1), a, b)

    def table(self) -> mx.array:
        """The whole table in id order, from float parts (after :func:`mlx_dq.evaluation.metrics.dequantize_model`)."""
        return mx.take(mx.concatenate([self.hot.weight, self.cold.weight]), self._maps().position, axis=0)

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ table^T`` in id order: both parts' logits, put back in place."""
        y = mx.concatenate([self.hot.as_linear(x), self.cold.as_linear(x)], axis=-1)
        return mx.take(y, self._maps().position, axis=-1)


def _rows(layer: nn.Module) -> int:
    """Rows of an embedding layer of any storage (float, stock quantized, mlx-dq mixed)."""
    if hasattr(layer, "num_embeddings"):
        return int(layer.num_embeddings)
    return int(layer["scales"].shape[0] if "scales" in layer else layer["weight"].shape[0])


def empty_split_layer(module: nn.Module, rows: int) -> RowSplitEmbedding:
    """A placeholder split of embedding ``module`` with ``rows`` hot rows, for a loader to fill.

    Both parts start as float ``nn.Embedding``; mlx-lm's loader quantizes them from
    config.json's per-module ``quantization`` entries (``<path>.hot``,
    ``<path>.cold``), and mixed parts are swapped in like any mixed layer.
    """
    if not isinstance(module, nn.Embedding):
        raise ValueError(f"row splits apply to embeddings, not {type(module).__name__}")
    vocab, dims = (int(d) for d in module.weight.shape)
    if not 0 < rows < vocab:
        raise ValueError(f"a row split needs between 1 and {vocab - 1} hot rows, got {rows}")
    return RowSplitEmbedding(nn.Embedding(rows, dims), nn.Embedding(vocab - rows, dims), mx.zeros((rows,), mx.int32))
