"""A model's forward on MLX's CPU backend: attention and SwiGLU equal to float rounding, without MLX's slow ``exp``.

Why: MLX's CPU ``exp`` is scalar and large temporaries are fresh, page-faulted buffers, so MLX's fused attention
(which falls back to a plain composition on the CPU) and SwiGLU's sigmoid take most of a small model's decoder
layer time (docs/cost.md#where-the-time-goes). Here the attention scores are made a
block of queries at a time, only up to the last key a causal block can see, SwiGLU goes a block of rows at a
time, and both take their exponential from a compiled polynomial within one ulp of float64's (MLX's own
``exp`` is within 64).

:func:`cpu_forward` swaps them in while the pipeline streams a model on the CPU: forwards only (the
exponential's bit arithmetic has no gradient). Array masks, attention sinks and 16-bit inputs go to MLX's
and mlx-lm's own functions unchanged; on a GPU nothing is swapped (the fused kernels are the fast path there).
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
from mlx_lm.models import activations

QUERY_BLOCK = 128  # queries per block of scores: [heads, 128, keys] floats stay in the cache and the heap
SILU_BLOCK = 2**18  # SwiGLU's values per block: the compiled kernel's temporaries stay in the cache

_LOG2E = 1.4426950408889634
_LN2_HI, _LN2_LO = 0.693359375, -2.12194440e-4  # ln 2 in two parts: n * _LN2_HI is exact for |n| < 2^15
_EXP_COEFFS = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
               5.0000001201e-1)  # Cephes' expf: exp(r) = 1 + r + r^2 * p(r) on |r| <= ln(2) / 2
_EXP_FLOOR = -87.0  # float32's exp turns subnormal just below (at -87.34); the softmax takes anything below as 0


@mx.compile
def exp_nonpositive(x: mx.array) -> mx.array:
    """``exp(x)`` for float32 ``x <= 0`` (a softmax's shifted scores), within one ulp; 0 below ``_EXP_FLOOR``.

    ``exp(x) = 2^n exp(r)`` with ``n = round(x / ln 2)``; ``2^n`` is built from its exponent bits."""
    xc = mx.maximum(x, _EXP_FLOOR)
    n = mx.floor(xc * _LOG2E + 0.5)
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = _EXP_COEFFS[0]
    for c in _EXP_COEFFS[1:]:
        p = p * r + c
    p = p * r * r + r + 1.0
    two_n = mx.view(mx.left_shift(n.astype(mx.int32) + 127, 23), mx.float32)
    return mx.where(x < _EXP_FLOOR, 0.0, p * two_n)


def softmax_rows(s: mx.array) -> mx.array:
    """Softmax over the last axis of float32 ``s`` with :func:`exp_nonpositive` (-inf entries give 0)."""
    e = exp_nonpositive(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def blocked_attention(q: mx.array, k: mx.array, v: mx.array, scale: float, causal: bool,
                      block: int = QUERY_BLOCK) -> mx.array:
    """``softmax(q k^T * scale [+ causal mask]) v`` for ``q`` ``[B, H, L, D]`` and ``k``/``v`` ``[B, KV, S, D]``
    (``H`` a multiple of ``KV``: grouped queries share their key head), a block of queries of one row at a time.

    Causal as MLX's ``mask="causal"``: query ``i`` sees keys up to ``i + S - L``; a block's scores stop there."""
    b_, h, n_q, d = q.shape
    kv, n_k = int(k.shape[1]), int(k.shape[2])
    qs = (q * scale).reshape(b_, kv, h // kv, n_q, d)
    kt = k[:, :, None].swapaxes(-1, -2)  # [B, KV, 1, D, S]
    vv = v[:, :, None]
    off = n_k - n_q
    rows = []
    for b in range(b_):
        parts = []
        for i0 in range(0, n_q, block):
            i1 = min(n_q, i0 + block)
            end = off + i1 if causal else n_k
            s = qs[b, :, :, i0:i1] @ kt[b, :, :, :, :end]
            if causal:
                seen = mx.arange(end)[None] <= mx.arange(off + i0, off + i1)[:, None]
                s = mx.where(seen, s, -mx.inf)
            parts.append((softmax_rows(s) @ vv[b, :, :, :end]).reshape(h, i1 - i0, d))
        rows.append(mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0])
    return mx.stack(rows)


@mx.compile
def _silu_product(gate: mx.array, x: mx.array) -> mx.array:
    """``silu(gate) * x``, the sigmoid from ``t = exp(-|gate|)``: ``1 / (1 + t)`` where ``gate >= 0``, else
    ``t / (1 + t)``."""
    t = exp_nonpositive(-mx.abs(gate))
    return gate * (mx.where(gate >= 0, 1.0, t) / (1.0 + t)) * x


def silu_product(gate: mx.array, x: mx.array, block: int = SILU_BLOCK) -> mx.array:
    """mlx-lm's ``swiglu`` (``silu(gate) * x``) for float32 arrays of one shape, a block of rows at a time."""
    k = int(gate.shape[-1]) if gate.ndim else 1
    g2, x2 = gate.reshape(-1, k), x.reshape(-1, k)
    step = max(1, block // k)
    if step >= g2.shape[0]:
        return _silu_product(gate, x)
    parts = [_silu_product(g2[i : i + step], x2[i : i + step]) for i in range(0, int(g2.shape[0]), step)]
    return mx.concatenate(parts).reshape(gate.shape)


_lock = threading.Lock()
_depth = 0
_original: Any = None  # MLX's attention while swapped
_swapped_swiglu: list[Any] = []  # the mlx-lm modules whose ``swiglu`` name is swapped


def _fast_or_blocked(q: mx.array, k: mx.array, v: mx.array, *, scale: float, mask: Any = None,
                     sinks: Any = None, **kw: Any) -> mx.array:
    """The swapped-in ``mx.fast.scaled_dot_product_attention``: float32 with no mask or a causal one blocked,
    anything else MLX's own."""
    if sinks is None and not kw and (mask is None or (isinstance(mask, str) and mask == "causal")) \
            and q.dtype == k.dtype == v.dtype == mx.float32 and q.ndim == 4 and q.shape[1] % k.shape[1] == 0:
        return blocked_attention(q, k, v, scale, mask == "causal")
    return _original(q, k, v, scale=scale, mask=mask, sinks=sinks, **kw)


def _swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """The swapped-in ``swiglu``: float32 of one shape by :func:`silu_product`, anything else mlx-lm's own."""
    if gate.dtype == x.dtype == mx.float32 and gate.shape == x.shape:
        return silu_product(gate, x)
    return activations.swiglu(gate, x)


def _swap(on: bool) -> None:
    """Swap the attention and every loaded mlx-lm model module's ``swiglu`` in (``on``) or back."""
    global _original
    if on:
        _original = mx.fast.scaled_dot_product_attention
        mx.fast.scaled_dot_product_attention = _fast_or_blocked
        _swapped_swiglu[:] = [m for name, m in list(sys.modules.items()) if name.startswith("mlx_lm.models.")
                              and getattr(m, "swiglu", None) is activations.swiglu and m is not activations]
        for m in _swapped_swiglu:
            m.swiglu = _swiglu
    else:
        mx.fast.scaled_dot_product_attention = _original
        _original = None
        for m in _swapped_swiglu:
            m.swiglu = activations.swiglu
        _swapped_swiglu.clear()


@contextmanager
def cpu_forward() -> Iterator[None]:
    """Within the block, when MLX's default device is the CPU, ``mx.fast.scaled_dot_product_attention`` is
    :func:`blocked_attention` and the ``swiglu`` of mlx-lm's model modules is :func:`silu_product` (the names
    their forwards call); restored on leaving. Nests; forwards only."""
    global _depth
    if mx.default_device().type != mx.DeviceType.cpu:
        yield
        return
    with _lock:
        if _depth == 0:
            _swap(True)
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                _swap(False)
