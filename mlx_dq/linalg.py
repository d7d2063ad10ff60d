"""Cholesky factor and triangular inverse of a large symmetric matrix in place, one block of columns at a time.

Why: GPTQ factorises the Gram matrix of a tensor's inputs; at Llama-3-8B's 14,336-channel ``down_proj`` input
each ``k x k`` float32 matrix is 822 MB (3.3 GB at 70B's 28,672). MLX's ``cholesky`` and ``tri_inv`` each return a
new ``k x k`` array, so factorising a copy held three of them at once; here the copy is overwritten by its factor
and then by the factor's inverse, with only ``block``-wide panels and row chunks beside it. The diagonal blocks
go through MLX's linear algebra (CPU stream), the panel and trailing updates are MLX matmuls on the default device.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

BLOCK = 512  # columns factorised at a time: small diagonal blocks, large matmuls for the trailing updates
CHUNK_FLOATS = 1 << 24  # a trailing update's row chunk: at most this many float32 (64 MiB) at a time


def _rows_per_chunk(width: int) -> int:
    return max(1, CHUNK_FLOATS // max(width, 1))


def cholesky_in_place(m: mx.array, block: int = 0) -> bool:
    """Overwrite the evaluated float32 ``[k, k]`` MLX array ``m`` (symmetric, lower triangle read), which nothing
    else may hold, with its lower Cholesky factor ``L`` (``m = L L^T``), zeros above the diagonal. Returns False,
    leaving ``m`` partly overwritten, when it is not numerically positive definite (a pivot not finite or not
    positive). MLX reads ``m``'s slices at evaluation (each step is evaluated at once); numpy writes the results
    through a view of the same buffer."""
    a = np.asarray(m)
    k, block = a.shape[0], block or BLOCK
    for j0 in range(0, k, block):
        j1 = min(j0 + block, k)
        d = mx.linalg.cholesky(m[j0:j1, j0:j1], stream=mx.cpu)
        diag = mx.diagonal(d)
        if not (mx.all(mx.isfinite(d)).item() and mx.all(diag > 0).item()):
            return False
        a[j0:j1, j0:j1] = np.tril(np.asarray(d))
        a[j0:j1, j1:] = 0.0
        if j1 == k:
            break
        # panel: L21 = A21 L11^-T (the small inverse and a matmul: 3x faster than MLX's solve_triangular here)
        panel = mx.contiguous(m[j1:, j0:j1]) @ mx.linalg.tri_inv(d, upper=False, stream=mx.cpu).T
        mx.eval(panel)
        a[j1:, j0:j1] = np.asarray(panel)
        step = _rows_per_chunk(k - j1)
        for i0 in range(j1, k, step):  # trailing update of the lower triangle: A22 -= L21 L21^T, a row chunk at a time
            i1 = min(i0 + step, k)
            upd = m[i0:i1, j1:i1] - panel[i0 - j1:i1 - j1] @ panel[:i1 - j1].T
            mx.eval(upd)
            a[i0:i1, j1:i1] = np.asarray(upd)
            del upd
    return True


def lower_inverse_in_place(m: mx.array, block: int = 0) -> None:
    """Overwrite the evaluated lower triangular float32 ``[k, k]`` MLX array ``m`` (zeros above the diagonal, held
    by nothing else) with its inverse, by blocks of columns from the last: ``X21 = -inv(L22) L21 inv(L11)`` uses the
    already inverted trailing block."""
    a = np.asarray(m)
    k, block = a.shape[0], block or BLOCK
    for j0 in reversed(range(0, k, block)):
        j1 = min(j0 + block, k)
        dinv = mx.linalg.tri_inv(m[j0:j1, j0:j1], upper=False, stream=mx.cpu)
        mx.eval(dinv)
        if j1 < k:
            l21 = mx.contiguous(m[j1:, j0:j1])
            mx.eval(l21)
            step = _rows_per_chunk(k - j1)
            for i0 in range(j1, k, step):  # rows of inv(L22) are lower triangular: columns j1..i1 only
                i1 = min(i0 + step, k)
                x = -((m[i0:i1, j1:i1] @ l21[:i1 - j1]) @ dinv)
                mx.eval(x)
                a[i0:i1, j0:j1] = np.asarray(x)
                del x
        a[j0:j1, j0:j1] = np.tril(np.asarray(dinv))


def reverse_in_place(a: np.ndarray, rows: int = 0) -> None:
    """``a[:] = a[::-1, ::-1]`` for a ``[k, k]`` array, swapping mirrored row chunks (no ``k x k`` temporary)."""
    k = a.shape[0]
    half = k // 2
    step = rows or _rows_per_chunk(k)
    for i0 in range(0, half, step):
        i1 = min(i0 + step, half)
        top = a[i0:i1].copy()
        a[i0:i1] = a[k - i1:k - i0][::-1, ::-1]
        a[k - i1:k - i0] = top[::-1, ::-1]
    if k % 2:
        a[half] = a[half][::-1].copy()
