"""Frequent-token rows: a lookup table stored two widths finer on the rows of the tokens text uses most.

An embedding row is read once per occurrence of its token, and as a tied head its
logit matters about as often as the token is predicted, so the few thousand tokens
that make up most text carry most of a large vocabulary's damage. On Gemma-3-270M
(262,144 rows) the 5,165 tokens of the calibration text are 70% of a Shakespeare
sample's tokens; rounding their rows at 5 bits in its 3.5 bpw model (table at 3 bits)
took the KL there from 0.497 to 0.372 (at 4 bits: 0.430), for 0.025 bits per weight.

Such a table becomes a :class:`RowSplitEmbedding`: two quantized tables (``hot``:
the listed rows at the stepped-up option; ``cold``: the others at the planned one)
and the sorted ids of the hot rows. The candidates are the calibration text's
tokens (:func:`hot_counts`); :mod:`mlx_dq.plans` keeps the rows that repay their
bits (:func:`rows_worth_it`) and takes those bits from the rest of the plan, so the
bits-per-weight target still holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .options import VALID_BITS, QuantOption, Segment
from .quant import QuantizedTensor

HOT_CAP = 0.125  # at most this share of a table's rows is stored finer
HOT_STEPS = 2  # widths up (VALID_BITS order) for the hot rows
ID_BITS = 32  # each hot row's id is stored as int32


def stepped_up(option: QuantOption, steps: int = HOT_STEPS) -> QuantOption | None:
    """``option`` with every segment ``steps`` widths up, at most 8 bits (shares and group sizes kept);
    None when that changes nothing (8 or 16 bits) or would merge two segments."""
    if option.keep16:
        return None
    up = [VALID_BITS[min(len(VALID_BITS) - 1, VALID_BITS.index(s.bits) + steps)] for s in option.segments]
    if len(set(up)) < len(up) or up == [s.bits for s in option.segments]:
        return None
    return QuantOption(tuple(Segment(b, s.group_size, s.prop) for b, s in zip(up, option.segments)))


def _picked(tokens: np.ndarray | mx.array, vocab: int, limit: int) -> tuple[np.ndarray, np.ndarray, int]:
    """The ids occurring in ``tokens`` (at most ``limit``: the most frequent, ties lower ids first), their counts,
    and the number of tokens."""
    flat = np.asarray(tokens).astype(np.int64).ravel()
    counts = np.bincount(flat[(flat >= 0) & (flat < vocab)], minlength=vocab)
    seen = np.nonzero(counts)[0]
    if seen.size > limit:
        seen = seen[np.argsort(-counts[seen], kind="stable")[:limit]]
    return seen, counts[seen], int(flat.size)


def hot_ids(tokens: np.ndarray | mx.array, vocab: int, cap: float = HOT_CAP, limit: int | None = None) -> np.ndarray:
    """The sorted ids (int32) occurring in ``tokens``; when more than ``limit`` (default ``cap * vocab``), the most
    frequent ones (ties: lower ids first)."""
    return np.sort(_picked(tokens, vocab, int(cap * vocab) if limit is None else limit)[0]).astype(np.int32)


@dataclass(frozen=True)
class HotRows:
    """A table's candidate rows: how often each one's token occurs (most frequent first) among ``total`` tokens."""

    counts: np.ndarray
    total: int


def hot_counts(tokens: np.ndarray | mx.array, vocab: int, cap: float = HOT_CAP) -> HotRows:
    """The counts of the ids :func:`hot_ids` picks from ``tokens``, most frequent first."""
    _, counts, total = _picked(tokens, vocab, int(cap * vocab))
    return HotRows(np.sort(counts)[::-1], total)


def rows_worth_it(hot: HotRows, gain: float, price: float, row_bits: float) -> int:
    """How many of the most frequent rows repay their bits: a row's share of the table's damage gain
    (``gain``: damage at the planned option less damage at the finer one; a row's share is its token's
    share of the text) above ``price`` (damage per bit at the plan's budget) x ``row_bits``."""
    if hot.total <= 0 or gain <= 0:
        return 0
    return int(np.count_nonzero(hot.counts / hot.total * gain > price * row_bits))


def extra_bits(option: QuantOption, n_hot: int, shape: tuple[int, int]) -> int:
    """Bits that storing ``n_hot`` rows of a ``[rows, dims]`` table at :func:`stepped_up` ``option`` adds: both
    parts (each with its own permutation when mixed) and the ids, less the one table."""
    up = stepped_up(option)
    if up is None or n_hot == 0:
        return 0
    rows, dims = (int(d) for d in shape)
    return (up.storage_bits((n_hot, dims)) + option.storage_bits((rows - n_hot, dims))
            - option.storage_bits((rows, dims)) + n_hot * ID_BITS)


@dataclass
class RowSplitCodes:
    """The hot rows of a split table as quantized: their sorted ids and codes (the cold rows are the caller's)."""

    ids: np.ndarray
    hot: QuantizedTensor


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
        """The whole table in id order, from float parts (after :func:`mlx_dq.evaluate.dequantize_model`)."""
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
