"""MLX affine storage arithmetic, in one place (design.md section 2): the per-group scale/bias rule, codes from
weights and stored scales/biases, dequantization, rounding to the stored dtype, and MLX's packed uint32 layout.

Every quantizer and meter goes through these functions, so the value a search scores, the value GPTQ feeds back
and the value ``mx.dequantize`` returns come from one formula. The functions take MLX arrays, or numpy arrays
where a caller works in numpy (GPTQ's column loop, the bit-exact references); where callers need different but
equally exact forms (rounding by dtype conversion or by float32 arithmetic, how zero-scale groups are treated),
the form is a parameter.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

EPS = 1e-7  # MLX's lower bound on a group's scale
_ROUNDER = 12582912.0  # 1.5 * 2**23: x + this - this rounds float32 x to an integer, ties to even
ZERO_SCALES = ("zero", "ignore", "divide")
ROUNDINGS = ("round", "shift")
_NP_KINDS = {"float16": "float16", "float32": "float32", "bfloat16": "bfloat16"}


# --------------------------------------------------------------------------
# scales, biases and codes
# --------------------------------------------------------------------------
def affine_params(wmin: mx.array, wmax: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """MLX's per-group float32 (scale, bias) for the range ``[wmin, wmax]``.

    The larger-magnitude edge is made exactly representable and becomes the
    bias, so about half the scales are negative (as in ``mx.quantize``).
    """
    n_bins = float((1 << bits) - 1)
    mask = mx.abs(wmin) > mx.abs(wmax)
    scale = mx.maximum((wmax - wmin) / n_bins, EPS)
    scale = mx.where(mask, scale, -scale)
    edge = mx.where(mask, wmin, wmax)
    q0 = mx.round(edge / scale)
    nonzero = q0 != 0
    scale = mx.where(nonzero, edge / mx.where(nonzero, q0, 1.0), scale)
    bias = mx.where(nonzero, edge, 0.0)
    return scale, bias


def clipped_rint(x: mx.array, n_bins: float | mx.array) -> mx.array:
    """``clip(round(x), 0, n_bins)`` (round half to even), bit-identical and cheaper on the CPU.

    Adding and subtracting 1.5 * 2**23 rounds any ``|x| < 2**22`` to the nearest
    integer (ties to even) in float32 arithmetic; larger magnitudes keep their
    sign and lie beyond the clip range, so the clipped result is the same for
    every input (infinities and NaN included).
    """
    return mx.clip((x + _ROUNDER) - _ROUNDER, 0.0, n_bins)


def codes(w, scales, biases, q_max, *, zero_scales: str = "zero", rounding: str = "round",
          out: np.ndarray | None = None, raw: np.ndarray | None = None):
    """Nearest codes of ``w`` for ``scales``/``biases`` broadcast against it, clipped to ``[0, q_max]`` (float32).

    ``zero_scales``: ``"zero"`` divides by 1 where a scale is 0 and makes those codes 0 (``mx.quantize``'s
    rule); ``"ignore"`` divides by 1 there and leaves the codes (the caller masks them, or does not need
    them); ``"divide"`` divides by the scale as it is (the caller knows no scale is 0, or passes a safe one).
    ``rounding``: ``"round"`` (``mx.round``, numpy's ``rint``, then clip) or ``"shift"`` (MLX only,
    :func:`clipped_rint`: the same values, cheaper). MLX arrays give an MLX result; numpy arrays a float32 numpy
    result, written into ``out`` (and the rounded, unclipped values into ``raw``) when given.
    """
    if zero_scales not in ZERO_SCALES or rounding not in ROUNDINGS:
        raise ValueError(f"zero_scales must be one of {ZERO_SCALES} and rounding one of {ROUNDINGS}")
    if isinstance(w, mx.array):
        s, b = scales.astype(mx.float32), biases.astype(mx.float32)
        x = (w - b) / (s if zero_scales == "divide" else mx.where(s == 0, 1.0, s))
        q = clipped_rint(x, q_max) if rounding == "shift" else mx.clip(mx.round(x), 0, q_max)
        return mx.where(s == 0, 0.0, q) if zero_scales == "zero" else q
    s, b = np.asarray(scales, dtype=np.float32), np.asarray(biases, dtype=np.float32)
    zero = None if zero_scales == "divide" else s == 0
    safe = s if zero is None else np.where(zero, np.float32(1.0), s)
    r = np.rint(np.divide(np.subtract(w, b, out=raw), safe, out=raw), out=raw)
    q = np.minimum(np.maximum(r, 0.0, out=out), q_max, out=out)  # np.clip's values, without its dispatch
    if zero_scales == "zero":
        q = np.where(zero, 0.0, q) if out is None else q
        if out is not None:
            np.copyto(q, 0.0, where=np.broadcast_to(zero, q.shape))
    return q.astype(np.float32, copy=False)


# --------------------------------------------------------------------------
# dequantization and rounding to the stored dtype
# --------------------------------------------------------------------------
def _np_kind(dtype) -> str:
    """``"float16"``, ``"bfloat16"`` or ``"float32"`` for a numpy dtype, an MLX dtype or one of those names."""
    if isinstance(dtype, mx.Dtype):
        return str(dtype).rsplit(".", 1)[-1]
    return _NP_KINDS[dtype] if isinstance(dtype, str) else np.dtype(dtype).name


def bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def round_to(x, dtype, *, scratch: tuple[np.ndarray, np.ndarray] | None = None):
    """Round float32 ``x`` to the nearest ``dtype`` value (ties to even), kept as float32.

    MLX arrays: in float32 arithmetic (Veltkamp's split ``c - (c - x)``, ``c = x (2^k + 1)``, keeps the leading
    bits; it fuses under compile and costs about half a conversion; float16 subnormals included, no overflow
    handling). Numpy arrays: by conversion, or with ``scratch`` (two float32 arrays of ``x``'s shape) float16 by
    the same split, in place, for ``|x|`` in float16's normal range or ``x`` a multiple of its subnormal step
    2^-24 (true of every ``scale * code`` and every float32 sum of two float16 values).
    """
    if isinstance(x, mx.array):
        if dtype == mx.float32:
            return x
        if dtype == mx.bfloat16:
            c = x * 65537.0  # Veltkamp split keeps 8 significant bits
            return c - (c - x)
        c = x * 8193.0  # 11 significant bits
        normal = c - (c - x)
        subnormal = (x + 0.75) - 0.75  # float32 spacing at 0.75 is 2**-24, float16's subnormal step
        return mx.where(mx.abs(x) < 6.103515625e-05, subnormal, normal)
    kind = _np_kind(dtype)
    if kind == "float32":
        return x
    if kind == "bfloat16":
        return bf16_round(x)
    if scratch is None:
        return x.astype(np.float16).astype(np.float32)
    tmp, tmp2 = scratch
    np.multiply(x, np.float32(2**13 + 1), out=tmp)
    np.subtract(tmp, x, out=tmp2)
    return np.subtract(tmp, tmp2, out=x)


def dequantize(q, scales, biases, dtype, *, out: np.ndarray | None = None,
               scratch: tuple[np.ndarray, np.ndarray] | None = None):
    """``round(round(scale * q) + bias)`` in ``dtype``, as float32: what ``mx.dequantize`` returns on MLX's CPU
    backend for codes ``q`` and stored ``scales``/``biases`` (broadcast against ``q``).

    ``dtype`` float32 gives the unrounded ``scale * q + bias``. MLX arrays give an MLX result; numpy arrays a
    float32 numpy result (``scale * q`` itself is exact in float32), written into ``out`` when given, rounded as
    :func:`round_to` does with ``scratch``.
    """
    if isinstance(q, mx.array):
        return round_to(round_to(scales * q, dtype) + biases, dtype)
    s, b = np.asarray(scales, dtype=np.float32), np.asarray(biases, dtype=np.float32)
    prod = round_to(np.multiply(s, q, out=out), dtype, scratch=scratch)
    return round_to(np.add(prod, b, out=out), dtype, scratch=scratch)


# --------------------------------------------------------------------------
# MLX's packed layout
# --------------------------------------------------------------------------
def pack_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Pack integer codes ``[..., k]`` into MLX's uint32 words ``[..., k*bits/32]``.

    Each row is one little-endian bit stream (code ``j`` at bits ``j*bits ...``),
    so 3-, 5- and 6-bit codes cross word boundaries, exactly as ``mx.quantize``.
    """
    q = np.asarray(q)
    k = q.shape[-1]
    if k % 32:
        raise ValueError(f"number of codes per row must be a multiple of 32, got {k}")
    if q.size and int(q.max()) >= (1 << bits):
        raise ValueError(f"codes do not fit in {bits} bits (max {int(q.max())})")
    lead = q.shape[:-1]
    per_chunk = 8 // math.gcd(bits, 8)  # fewest codes filling whole bytes
    chunks = q.reshape(-1, k // per_chunk, per_chunk).astype(np.uint64)
    value = np.zeros(chunks.shape[:-1], dtype=np.uint64)
    for j in range(per_chunk):
        value |= chunks[..., j] << np.uint64(j * bits)
    nbytes = per_chunk * bits // 8
    stream = value.astype("<u8").view(np.uint8).reshape(value.shape + (8,))[..., :nbytes]
    return np.ascontiguousarray(stream).reshape(-1, k * bits // 8).view("<u4").astype(np.uint32).reshape(*lead, k * bits // 32)


def pack_codes_mx(q: mx.array | np.ndarray, bits: int) -> mx.array:
    """:func:`pack_codes` as MLX array operations on the default device (the same words).

    Every 32 codes fill ``bits`` whole words; word ``i`` of a run is the sum of the codes overlapping its 32
    bits, each shifted into place (a code crossing a word boundary lands in both, split by the shifts)."""
    q = mx.array(q) if isinstance(q, np.ndarray) else q
    k = int(q.shape[-1])
    if k % 32:
        raise ValueError(f"number of codes per row must be a multiple of 32, got {k}")
    lead = tuple(int(d) for d in q.shape[:-1])
    c = q.astype(mx.uint32).reshape(*lead, k // 32, 32)
    words = []
    for i in range(bits):
        word = None
        for j in range(32):
            shift = j * bits - 32 * i  # where code j starts, relative to word i
            if shift >= 32 or shift + bits <= 0:
                continue
            part = c[..., j] << shift if shift >= 0 else c[..., j] >> -shift
            word = part if word is None else word + part
        words.append(word)
    return mx.stack(words, axis=-1).reshape(*lead, k * bits // 32)


def unpack_codes(packed: np.ndarray | mx.array, bits: int, k: int) -> np.ndarray:
    """Unpack MLX's uint32 words ``[..., k*bits/32]`` into ``k`` integer codes per row."""
    p = np.ascontiguousarray(np.asarray(packed, dtype=np.uint32))
    if p.shape[-1] * 32 != k * bits:
        raise ValueError(f"{p.shape[-1]} words per row do not hold {k} codes of {bits} bits")
    lead = p.shape[:-1]
    bitstream = np.unpackbits(p.astype("<u4").view(np.uint8), axis=-1, bitorder="little")
    weights = (1 << np.arange(bits)).astype(np.uint16)
    return (bitstream.reshape(*lead, k, bits).astype(np.uint16) @ weights).astype(np.uint16)


def pack_part(codes: mx.array, scales: mx.array, biases: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """MLX's stored triple from integer codes ``[..., k]`` and per-group ``scales``/``biases`` ``[..., k/g]``."""
    return pack_codes_mx(codes, bits), scales, biases


def _to_numpy(a: np.ndarray | mx.array) -> tuple[np.ndarray, str]:
    """A numpy copy of ``a`` and the name of its storage dtype (bfloat16 becomes float32)."""
    if isinstance(a, mx.array):
        if a.dtype == mx.bfloat16:
            return np.array(a.astype(mx.float32)), "bfloat16"
        a = np.array(a)
    return a, str(a.dtype)


def dequantize_ref(
    packed: np.ndarray | mx.array,
    scales: np.ndarray | mx.array,
    biases: np.ndarray | mx.array,
    bits: int,
    group_size: int,
) -> np.ndarray:
    """Numpy twin of ``mx.dequantize`` on the CPU: ``round(round(scale*q) + bias)`` in the scales' dtype.

    Bit-exact with MLX's CPU backend for float16, bfloat16 (returned as float32
    holding bfloat16 values) and float32 scales.
    """
    s, kind = _to_numpy(scales)
    b, _ = _to_numpy(biases)
    k = s.shape[-1] * group_size
    q = unpack_codes(packed, bits, k).astype(np.float32)
    values = dequantize(q, np.repeat(s, group_size, axis=-1), np.repeat(b, group_size, axis=-1), kind)
    return values if kind == "bfloat16" else values.astype(s.dtype)
