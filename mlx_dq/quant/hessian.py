"""GPTQ's Hessian: the damped Gram matrix ``H = X^T X`` reordered to a channel sequence, and the upper Cholesky
factor of its inverse, made in one ``k x k`` buffer (:mod:`mlx_dq.quant.linalg`), reusable by every option of one
weight (:class:`HessianFactor`); :class:`FactoredGram` stands in for a Gram matrix whose buffer became its factor.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_dq.quant import linalg
from mlx_dq.quant.spec import DEFAULT_DAMP

MAX_DAMP_RETRIES = 6


def _damped_diagonal(diag: np.ndarray, damp: float) -> tuple[np.ndarray, np.ndarray]:
    """``diag`` ([B, k] float32) with dead channels (<= 0) set to 1 and ``damp`` times each row's mean added, and
    what was added per row ([B, 1])."""
    out = np.where(diag <= 0, np.float32(1.0), diag).astype(np.float32)
    lam = np.float32(damp) * out.mean(axis=-1, keepdims=True, dtype=np.float32)
    out += lam
    return out, lam


def _reversed_damped(a: np.ndarray, g: np.ndarray, rev: np.ndarray, diag: np.ndarray) -> None:
    """Write ``g[rev][:, rev]`` into ``a`` a chunk of rows at a time (no ``k x k`` temporary), then set its
    diagonal to ``diag`` (the damped one)."""
    step = linalg.rows_per_chunk(g.shape[-1])
    for i0 in range(0, a.shape[0], step):  # np.take, not fancy indexing: 10x faster (8,192 channels: 1.6 -> 0.16 s)
        np.take(np.take(g, rev[i0:i0 + step], axis=0), rev, axis=1, out=a[i0:i0 + step], mode="clip")
    np.einsum("ii->i", a)[:] = diag


def _all_finite(a: np.ndarray) -> bool:
    """Whether every entry of ``a`` (``[..., k, k]``) is finite, checked a chunk of rows at a time: ``np.isfinite``
    of the whole matrix is a ``k x k`` bool array (822 MB at 28,672 channels, which set a Llama-3-70B layer's peak)."""
    step = linalg.rows_per_chunk(a.shape[-1])
    return all(bool(np.isfinite(a[..., i:i + step, :]).all()) for i in range(0, a.shape[-2], step))


def _inverse_cholesky(g: np.ndarray, rev: np.ndarray, diag: np.ndarray, damp_step: float | None = None,
                      into: mx.array | None = None) -> tuple[mx.array, float]:
    """Upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``, each ``[k, k]`` of ``[B, k, k]``) for ``H``
    the Gram ``g`` reordered to ``rev[::-1]`` with the damped diagonal ``diag`` (``[B, k]``, order of ``rev``).

    A matrix that is not numerically positive definite gets ``damp_step`` (default 1% of its mean
    diagonal) more damping, growing tenfold per retry; returns ``U`` and the extra damping used.

    With ``P H P = L L^T`` (``P`` reverses the channels), ``H^-1 = U^T U`` for ``U = P L^-1 P``: the reversed
    ``H`` is built in one MLX-owned ``k x k`` buffer, which :mod:`mlx_dq.quant.linalg` overwrites with ``L``, then
    ``L^-1``, then ``U``: one ``k x k`` array besides the Gram (at 14,336 channels each is 822 MB; MLX's
    ``cholesky`` and ``tri_inv`` held three). ``into``: the Gram's own MLX array (``g`` its view), reordered in
    place and turned into ``U`` (no second ``k x k`` array; a failed attempt is multiplied back, see
    :func:`~mlx_dq.quant.linalg.unfactor_in_place`).
    """
    step = damp_step if damp_step is not None else 0.01 * max(float(diag.mean()), 1e-12)
    extra = 0.0
    buf = into if into is not None else mx.zeros(g.shape, dtype=mx.float32)
    mx.eval(buf)
    a = np.asarray(buf)  # a writable view: the buffer is this function's alone until returned
    if into is not None:
        for b in range(g.shape[0]):
            linalg.permute_in_place(a[b], rev)
    for _ in range(MAX_DAMP_RETRIES):
        ok = True
        for b in range(g.shape[0]):
            mb = buf[b, :, :]  # a view (``buf[b]`` would be a copy)
            mx.eval(mb)  # MLX reads its slices, numpy writes through ``a[b]``
            if into is None:
                _reversed_damped(a[b], g[b], rev, diag[b] + extra)
            else:
                np.einsum("ii->i", a[b])[:] = diag[b] + extra
            done = linalg.cholesky_in_place(mb)
            if done < a.shape[-1]:
                if into is not None:
                    linalg.unfactor_in_place(mb, done)
                ok = False
                break
        if ok:
            for b in range(g.shape[0]):
                mb = buf[b, :, :]
                linalg.lower_inverse_in_place(mb)
                linalg.reverse_in_place(a[b])
            d = np.einsum("bii->bi", a)
            if _all_finite(a) and np.all(d > 0):
                return buf, extra
            if into is not None:
                raise ValueError("the Hessian factor of a consumed Gram matrix is not finite")
        extra = step if extra == 0.0 else extra * 10.0
    raise ValueError(f"Gram matrix is not positive definite even with {extra:g} added damping")


@dataclass(frozen=True)
class HessianFactor:
    """The damped ``H`` factorised for one channel processing sequence; reusable by every option.

    ``sequence``: original input channel processed at each step; ``u_mx`` (``u`` as numpy)
    (``[Bg, k, k]``): upper Cholesky factor of the damped ``H^-1`` in that
    sequence; ``damp`` the relative damping asked for, ``damp_abs`` the
    largest absolute damping added, ``extra_damp`` any more added to reach
    positive definiteness.
    """

    sequence: np.ndarray
    u_mx: mx.array
    damp: float
    damp_abs: float
    extra_damp: float
    added: np.ndarray  # [Bg, k], sequence order: what damping added to each diagonal entry

    @property
    def u(self) -> np.ndarray:
        """``u_mx`` as numpy: a view of MLX's buffer, no second copy."""
        return np.asarray(self.u_mx)


def factor_hessian(gram: np.ndarray | mx.array, sequence: np.ndarray, damp: float = DEFAULT_DAMP,
                   consume: bool = False) -> HessianFactor:
    """Damp ``gram`` (``[k, k]`` or ``[Bg, k, k]``), reorder it to ``sequence`` and factorise its inverse.

    Memory: the Gram is read in place (a numpy view) and the factor is built in one ``k x k`` buffer per
    matrix that ``u`` shares with MLX (see :func:`_inverse_cholesky`). ``consume``: ``gram`` (an evaluated
    float32 MLX array nothing else will read) becomes the factor, in its own buffer.
    """
    if isinstance(gram, FactoredGram):
        raise ValueError("this Gram matrix was consumed by its Hessian factor for another channel sequence")
    if consume and not (isinstance(gram, mx.array) and gram.dtype == mx.float32):
        raise ValueError("only an MLX float32 Gram matrix can be consumed by its factor")
    g = np.asarray(gram, dtype=np.float32)
    g = g[None] if g.ndim == 2 else g
    seq = np.asarray(sequence, dtype=np.int64)
    rev = seq[::-1].copy()
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    before = np.einsum("bii->bi", g)[:, rev].astype(np.float32)
    diag, lam = _damped_diagonal(before, damp)
    into = (gram[None] if gram.ndim == 2 else gram) if consume else None
    upper, extra = _inverse_cholesky(g, rev, diag, into=into)
    added = (diag.astype(np.float64) - before)[:, ::-1]
    return HessianFactor(seq, upper, float(damp), float(lam.max()), extra, added + extra)


@dataclass(frozen=True)
class FactoredGram:
    """What is left of a Gram matrix whose buffer became its Hessian factor (:func:`~mlx_dq.quant.gptq.consume_gram`): its shape and
    undamped diagonal, which is all GPTQ reads once the factor is made. Anything else that needs the Gram itself
    fails loudly (it has no ``astype`` and cannot be multiplied)."""

    shape: tuple[int, ...]  # [1, k, k]: one bank, as GPTQ sees a Gram
    diag: np.ndarray  # [Bg, k] float32
    order: np.ndarray  # the channels by energy (act order), the sequence its factor was made for

    @property
    def ndim(self) -> int:
        return len(self.shape)


def factor_key(damp: float, banks: int, seq: np.ndarray) -> tuple:
    """The key of a :class:`HessianFactor` in a factor cache: damping, number of matrices and channel sequence."""
    return float(damp), banks, np.asarray(seq, dtype=np.int64).tobytes()
