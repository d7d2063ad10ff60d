"""Cholesky factor and triangular inverse of a large symmetric matrix in place, one block of columns at a time.

Why: GPTQ factorises the Gram matrix of a tensor's inputs; at Llama-3-8B's 14,336-channel ``down_proj`` input
each ``k x k`` float32 matrix is 822 MB (3.3 GB at 70B's 28,672). MLX's ``cholesky`` and ``tri_inv`` each return a
new ``k x k`` array, so factorising a copy held three of them at once; here the copy is overwritten by its factor
and then by the factor's inverse, with only ``block``-wide panels and row chunks beside it. The diagonal blocks
go through numpy's LAPACK (small), the panel and trailing updates are MLX matmuls on the default device.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

BLOCK = 512  # columns factorised at a time: small diagonal blocks, large matmuls for the trailing updates
WHOLE = 2048  # a matrix up to this size is one block (16 MiB): the per-block steps cost more than they save
LEAF = 64  # the triangular inverse's recursion ends in blocks this small
CHUNK_FLOATS = 1 << 24  # a trailing update's row chunk: at most this many float32 (64 MiB) at a time


def rows_per_chunk(width: int) -> int:
    """Rows of a ``width``-wide float32 matrix per chunk of at most :data:`CHUNK_FLOATS` values (at least one):
    the step by which the Hessian code reads and writes ``k x k`` matrices without a ``k x k`` temporary."""
    return max(1, CHUNK_FLOATS // max(width, 1))


def _small_cholesky(block: np.ndarray) -> np.ndarray | None:
    """Lower Cholesky factor of one diagonal block (its lower triangle read), or None when not positive definite.

    Why numpy's LAPACK: for a 512 x 512 block MLX's CPU ``cholesky`` and ``tri_inv`` took 0.2 s each here,
    numpy's 0.015 s and 0.05 s; the blocks are a small part of the work (the panels' matmuls are MLX's)."""
    low = np.tril(block)
    try:
        d = np.linalg.cholesky(low + np.tril(low, -1).T)
    except np.linalg.LinAlgError:
        return None
    return d if np.isfinite(d).all() and np.all(np.diagonal(d) > 0) else None


def _small_lower_inverse(low: np.ndarray) -> np.ndarray:
    """Inverse of one lower triangular diagonal block, lower triangular (see :func:`_small_cholesky`).

    Recursive halves, ``inv([[A, 0], [C, B]]) = [[inv(A), 0], [-inv(B) C inv(A), inv(B)]]``, down to
    :data:`LEAF`-sized blocks: a general inverse (LU) of the whole block did three times the work."""
    low = np.tril(low).astype(np.float32, copy=False)
    n = low.shape[0]
    if n <= LEAF:
        return np.tril(np.linalg.inv(low)).astype(np.float32)
    h = n // 2
    out = np.zeros((n, n), dtype=np.float32)
    out[:h, :h] = inv_a = _small_lower_inverse(low[:h, :h])
    out[h:, h:] = inv_b = _small_lower_inverse(low[h:, h:])
    out[h:, :h] = -(inv_b @ (low[h:, :h] @ inv_a))
    return out


def _block(k: int, block: int) -> int:
    return block or (k if k <= WHOLE else BLOCK)


def cholesky_in_place(m: mx.array, block: int = 0) -> int:
    """Overwrite the evaluated float32 ``[k, k]`` MLX array ``m`` (symmetric, only its lower triangle read), which
    nothing else may hold, with its lower Cholesky factor ``L`` (``m = L L^T``), zeros above the diagonal.

    Returns the columns factorised: ``k``, or fewer when a pivot is not finite or not positive (``m`` is then
    partly overwritten; :func:`unfactor_in_place` multiplies it back). MLX reads ``m``'s slices at evaluation
    (each step is evaluated at once); numpy writes the results through a view of the same buffer."""
    a = np.asarray(m)
    k = a.shape[0]
    block = _block(k, block)
    for j0 in range(0, k, block):
        j1 = min(j0 + block, k)
        d = _small_cholesky(a[j0:j1, j0:j1])
        if d is None:
            return j0
        a[j0:j1, j0:j1] = d
        a[j0:j1, j1:] = 0.0
        if j1 == k:
            break
        # panel: L21 = A21 L11^-T (the small inverse and a matmul: 3x faster than MLX's solve_triangular here)
        panel = mx.contiguous(m[j1:, j0:j1]) @ mx.array(_small_lower_inverse(d)).T
        mx.eval(panel)
        a[j1:, j0:j1] = np.asarray(panel)
        step = rows_per_chunk(k - j1)
        for i0 in range(j1, k, step):  # trailing update of the lower triangle: A22 -= L21 L21^T, a row chunk at a time
            i1 = min(i0 + step, k)
            upd = m[i0:i1, j1:i1] - panel[i0 - j1:i1 - j1] @ panel[:i1 - j1].T
            mx.eval(upd)
            a[i0:i1, j1:i1] = np.asarray(upd)
            del upd
    return k


def unfactor_in_place(m: mx.array, done: int) -> None:
    """Undo a :func:`cholesky_in_place` that stopped after ``done`` columns: its lower triangle is the original
    matrix's again, to float rounding (``A22 = S + L21 L21^T``, ``A21 = L21 L11^T``, ``A11 = L11 L11^T``; the
    last bottom-up, so each row chunk reads rows not yet rewritten). Why: a consumed Gram matrix has no copy
    to rebuild from when it needs more damping."""
    a = np.asarray(m)
    k = a.shape[0]
    if done == 0:
        return
    step = rows_per_chunk(k)
    for i0 in range(done, k, step):  # every L21 row is read here, so A21 is written only after this loop
        i1 = min(i0 + step, k)
        upd = m[i0:i1, done:i1] + m[i0:i1, :done] @ m[done:i1, :done].T
        mx.eval(upd)
        a[i0:i1, done:i1] = np.asarray(upd)
    for i0 in range(done, k, step):
        i1 = min(i0 + step, k)
        x = m[i0:i1, :done] @ m[:done, :done].T
        mx.eval(x)
        a[i0:i1, :done] = np.asarray(x)
    for i1 in range(done, 0, -step):
        i0 = max(i1 - step, 0)
        x = m[i0:i1, :i1] @ m[:i1, :i1].T
        mx.eval(x)
        a[i0:i1, :i1] = np.asarray(x)


def permute_in_place(a: np.ndarray, perm: np.ndarray) -> None:
    """``a[:] = a[perm][:, perm]`` for a ``[k, k]`` array: rows moved along the permutation's cycles (one row
    aside at a time), then each chunk of rows' columns reordered (no ``k x k`` temporary)."""
    k = a.shape[0]
    seen = np.zeros(k, dtype=bool)
    for i in range(k):
        if seen[i] or perm[i] == i:
            continue
        tmp, j = a[i].copy(), i
        while True:
            seen[j] = True
            nxt = int(perm[j])
            if nxt == i:
                a[j] = tmp
                break
            a[j] = a[nxt]
            j = nxt
    step = rows_per_chunk(k)
    for i0 in range(0, k, step):  # np.take, not fancy indexing: 8x faster here
        a[i0:i0 + step] = np.take(a[i0:i0 + step], perm, axis=1)


def lower_inverse_in_place(m: mx.array, block: int = 0) -> None:
    """Overwrite the evaluated lower triangular float32 ``[k, k]`` MLX array ``m`` (zeros above the diagonal, held
    by nothing else) with its inverse, by blocks of columns from the last: ``X21 = -inv(L22) L21 inv(L11)`` uses the
    already inverted trailing block."""
    a = np.asarray(m)
    k = a.shape[0]
    block = _block(k, block)
    for j0 in reversed(range(0, k, block)):
        j1 = min(j0 + block, k)
        dinv = _small_lower_inverse(a[j0:j1, j0:j1])
        if j1 < k:
            l21, dinv_mx = mx.contiguous(m[j1:, j0:j1]), mx.array(dinv)
            mx.eval(l21)
            step = rows_per_chunk(k - j1)
            for i0 in range(j1, k, step):  # rows of inv(L22) are lower triangular: columns j1..i1 only
                i1 = min(i0 + step, k)
                x = -((m[i0:i1, j1:i1] @ l21[:i1 - j1]) @ dinv_mx)
                mx.eval(x)
                a[i0:i1, j0:j1] = np.asarray(x)
                del x
        a[j0:j1, j0:j1] = dinv


def reverse_in_place(a: np.ndarray, rows: int = 0) -> None:
    """``a[:] = a[::-1, ::-1]`` for a ``[k, k]`` array, swapping mirrored row chunks (no ``k x k`` temporary)."""
    k = a.shape[0]
    half = k // 2
    step = rows or rows_per_chunk(k)
    for i0 in range(0, half, step):
        i1 = min(i0 + step, half)
        top = a[i0:i1].copy()
        a[i0:i1] = a[k - i1:k - i0][::-1, ::-1]
        a[k - i1:k - i0] = top[::-1, ::-1]
    if k % 2:
        a[half] = a[half][::-1].copy()
