"""Tensor error metering: a quantized weight's relative output error against its inputs' Gram matrix.

The error of an option is ``||X(Wq-W)^T||_F / ||X W^T||_F`` on the captured inputs, computed exactly from the Gram
matrix ``X^T X`` (or from token counts for a lookup table), block by block of output rows for large tensors.
"""

from __future__ import annotations

import math
import zlib

import mlx.core as mx
import numpy as np

from mlx_dq.quant.affine import exact_sums, relative_error
from mlx_dq.quant.dispatch import block_budget, row_blocks


def lookup_error(w: mx.array, wq: mx.array, counts: np.ndarray) -> float:
    """Relative error of embedding lookups weighted by how often each token occurs."""
    c = mx.array(counts.astype(np.float32))[:, None]
    w32 = w.astype(mx.float32)
    d = wq.astype(mx.float32) - w32
    num, den = exact_sums(c * d * d, c * w32 * w32)
    return math.sqrt(num / den)


def _evaluated(a: mx.array) -> mx.array:
    """``a`` evaluated by MLX before numpy reads it, so profiles count the work as MLX's, not numpy's."""
    mx.eval(a)
    return a


def output_energies(w: mx.array, gram: mx.array) -> np.ndarray:
    """Each output row's energy ``w_i G w_i^T`` of a 2-D weight (float64), by blocks of rows: no temporary the size
    of a 151,936-row head."""
    g32 = gram.astype(mx.float32)
    return np.concatenate([np.asarray(_evaluated(((wb @ g32) * wb).sum(1)), dtype=np.float64)
                           for wb in (w[sl].astype(mx.float32) for sl in row_blocks(w.shape) or [slice(None)])])


def sampled_row_count(shape: tuple[int, ...], gram_ndim: int, n: int, must: int = 0) -> int | None:
    """How many output rows :func:`output_row_sample` measures a weight of ``shape`` on (``n`` plus ``must`` rows
    taken beyond them); None when it does not sample (every row is measured)."""
    if n <= 0 or len(shape) != 2 or gram_ndim != 2 or int(shape[0]) <= n + must:
        return None
    return n + must


def output_row_sample(key: str, w: mx.array, gram: mx.array, n: int,
                      must: np.ndarray | None = None,
                      energy: mx.array | np.ndarray | None = None) -> tuple[mx.array, mx.array] | None:
    """A seeded, stratified sample of ``n`` output rows of a 2-D weight and each row's weight; None when not smaller.

    Rounding, the clip search and GPTQ treat output rows independently (the
    Gram matrix is shared, each row's error is its own), so a weighted sum over
    a subset of rows estimates the whole tensor's squared output error at
    ``n / rows`` of the cost. Plain uniform sampling misses the few rows that
    carry most of the output energy in LLMs (massive-activation channels), so the ``n // 4`` rows of
    largest output energy ``w_i G w_i^T`` are always taken (weight 1) and the
    rest are drawn uniformly (weight ``remaining / drawn``). Seeded by the name.
    The rows ``must`` (e.g. the tokens a tied embedding looks up) are taken as
    well, with weight 1, beyond the ``n``. ``energy``: the rows' output energies when the forward recorded
    them (:attr:`~mlx_dq.model.capture.GramCollector.energies`), else they are multiplied out against the Gram.
    """
    rows = int(w.shape[0])
    must = np.unique(np.asarray(must, dtype=np.int64)) if must is not None else np.empty(0, dtype=np.int64)
    if sampled_row_count(tuple(w.shape), gram.ndim, n, must.size) is None:
        return None
    energy = output_energies(w, gram) if energy is None else np.asarray(energy, dtype=np.float64)
    by_energy = np.argsort(-energy, kind="stable")
    top = np.concatenate([must, by_energy[~np.isin(by_energy, must)][: n // 4]])
    rest = np.setdiff1d(np.arange(rows), top)
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    drawn = rng.choice(rest, size=n + must.size - top.size, replace=False)
    idx = np.concatenate([top, drawn])
    weights = np.concatenate([np.ones(top.size), np.full(drawn.size, rest.size / drawn.size)])
    order = np.argsort(idx)
    return mx.array(idx[order].astype(np.int32)), mx.array(weights[order].astype(np.float32))


class ErrorMeter:
    """``wq -> (err, weight_err)`` with the reference energies computed once, row block by row block.

    ``err`` is the relative output error ``sqrt(tr(D G D^T) / tr(W G W^T))`` when a
    Gram matrix is given (per expert ``[E, in, in]`` for banks: a sum over experts),
    the token-frequency-weighted lookup error for an embedding with ``counts``,
    else the weight error. Same formulas as :func:`mlx_dq.quant.affine.output_error`.
    ``row_weights`` (``[rows]``, 2-D weights with a Gram) weights each output row's sums; ``energy``
    (``[rows]``, 2-D) gives the rows' ``w_i G w_i^T``, so ``tr(W G W^T)`` is not multiplied out again.
    Large tensors are summed over blocks of output rows (:func:`row_blocks`, float32
    per block, the blocks added in double precision), so no temporary is the
    size of the tensor; a tensor of one block is computed exactly as in one piece.
    """

    def __init__(self, w: mx.array, gram: mx.array | None, counts: np.ndarray | None,
                 row_weights: mx.array | None = None, energy: np.ndarray | None = None):
        self.w, self.rw = w, None if row_weights is None else row_weights[:, None]
        self.g = None if gram is None else gram.astype(mx.float32)
        self.c = None if counts is None or gram is not None else mx.array(counts.astype(np.float32))[:, None]
        self.blocks = row_blocks(w.shape, block_budget()) if row_weights is None else None
        self.w32 = w.astype(mx.float32) if self.blocks is None else None
        self.wden = self.oden = 0.0
        known = energy is not None and self.g is not None and w.ndim == 2  # the rows' w_i G w_i^T, given
        for i in range(len(self.blocks or [None])):
            if known:
                (wden,) = exact_sums(self._squares(self._w32(i), None))
            else:
                oden, wden = self._sums(i, self._w32(i))
                self.oden += oden
            self.wden += wden
        if known:
            e = np.asarray(energy, dtype=np.float64)
            self.oden = float(np.sum(e if self.rw is None else e * np.asarray(self.rw[:, 0], dtype=np.float64)))

    def _w32(self, i: int) -> mx.array:
        return self.w32 if self.blocks is None else self.w[..., self.blocks[i], :].astype(mx.float32)

    def _c(self, i: int) -> mx.array:
        return self.c if self.blocks is None else self.c[self.blocks[i]]

    def _squares(self, x: mx.array, g: mx.array | None) -> mx.array:
        """The terms of ``sum(x*x)`` or ``sum((x@g)*x)``, each row weighted by ``row_weights`` when given."""
        sq = x * x if g is None else (x @ g) * x
        return sq if self.rw is None else self.rw * sq

    def _sums(self, i: int, x: mx.array) -> tuple[float, float]:
        """The (output, weight) squared sums of block ``i``'s rows ``x``: against the Gram, the token counts or plain."""
        wsq = self._squares(x, None)
        if self.g is not None:
            return exact_sums(self._squares(x, self.g), wsq)
        if self.c is not None:
            return exact_sums(self._c(i) * x * x, wsq)
        (wsum,) = exact_sums(wsq)
        return wsum, wsum

    def partial(self, i: int, wq: mx.array, known: np.ndarray | None = None) -> tuple[float, float]:
        """The (output, weight) squared-error sums of block ``i`` (``wq``: that block's rows; the whole tensor when one).

        ``known``: the rows' squared output errors as the quantizer computed them against this Gram
        (:attr:`~mlx_dq.quant.affine.QuantizedTensor.out_sq`), so only the weight error is computed here."""
        d = wq.astype(mx.float32) - self._w32(i)
        if known is None or self.g is None:
            return self._sums(i, d)
        (wsum,) = exact_sums(self._squares(d, None))
        rw = None if self.rw is None else np.asarray(self.rw[:, 0], dtype=np.float64)
        osum = float(known.sum()) if rw is None else float((known * rw).sum())
        return osum, wsum

    def result(self, onum: float, wnum: float) -> tuple[float, float]:
        """(err, weight_err) from summed squared errors."""
        den = self.oden if self.g is not None or self.c is not None else self.wden
        return relative_error(onum, den), relative_error(wnum, self.wden)

    def __call__(self, wq: mx.array, known: np.ndarray | None = None) -> tuple[float, float]:
        if self.blocks is None:
            return self.result(*self.partial(0, wq, known))
        onum = wnum = 0.0
        for i, sl in enumerate(self.blocks):
            o, w_ = self.partial(i, wq[..., sl, :], None if known is None else known[..., sl])
            onum, wnum = onum + o, wnum + w_
        return self.result(onum, wnum)


def looked_up_rows(counts: np.ndarray) -> tuple[mx.array, None] | None:
    """The rows of a lookup table that the calibration tokens use, when not all of them: the lookup error is
    theirs alone (a row never looked up has weight 0), so its options are quantized and metered on those rows;
    the weight error is then theirs too."""
    used = np.flatnonzero(counts > 0)
    return (mx.array(used.astype(np.int32)), None) if 0 < used.size < counts.size else None
