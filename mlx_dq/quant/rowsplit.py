"""Frequent-token rows: a lookup table stored two widths finer on the rows of the tokens text uses most.

An embedding row is read once per occurrence of its token, and as a tied head its
logit matters about as often as the token is predicted, so the few thousand tokens
that make up most text carry most of a large vocabulary's damage. On Gemma-3-270M
(262,144 rows) the 5,165 tokens of the calibration text are 70% of a Shakespeare
sample's tokens; rounding their rows at 5 bits in its 3.5 bpw model (table at 3 bits)
took the KL there from 0.497 to 0.372 (at 4 bits: 0.430), for 0.025 bits per weight.

Such a table becomes a :class:`~mlx_dq.layers.rowsplit.RowSplitEmbedding`: two quantized tables (``hot``:
the listed rows at the stepped-up option; ``cold``: the others at the planned one)
and the sorted ids of the hot rows. The candidates are the calibration text's
tokens (:func:`hot_counts`); :mod:`mlx_dq.conversion.resolve` keeps the rows that repay their
bits (:func:`rows_worth_it`) and takes those bits from the rest of the plan, so the
bits-per-weight target still holds.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_dq.quant.affine import QuantizedTensor
from mlx_dq.quant.options import VALID_BITS, QuantOption, Segment

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
