"""Quantization math: apply a :class:`~mlx_dq.quant.options.QuantOption` to one weight.

Every segment is stored exactly as MLX affine group quantization stores a
weight (packed uint32 codes, 16-bit scales and biases), so each segment can be
fed to ``mx.quantized_matmul`` / ``mx.dequantize`` as is.

Building blocks, reusable by error-compensating quantizers:

- :func:`affine_params` MLX's per-group scale/bias rule,
- :func:`affine_codes` codes for given stored scales/biases,
- :func:`clip_search` per-group range shrinking ("optimal shrinkage") scored
  by output error (diagonal Gram blocks), input-energy-weighted or plain error,
- :func:`permute_inputs` / :func:`pack_part` act-order and stored triples,
- :func:`pack_codes` / :func:`unpack_codes` / :func:`dequantize_ref` a numpy
  reference of MLX's storage format, bit-exact with the CPU backend;
  :func:`pack_codes_mx` the same packing in MLX, which the quantizers use.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.quant.options import QuantOption, perm_bits

DEFAULT_CLIP_FACTORS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# 2-bit groups gain from shrinking further (measured on SmolLM2 layers: benchmarks/error_table.py)
LOW_BIT_CLIP_FACTORS: tuple[float, ...] = DEFAULT_CLIP_FACTORS + (0.65, 0.6, 0.55, 0.5)
CLIP_METRICS = ("block", "diag")
CLIP_RULES = ("edge", "minmax")  # MLX's edge-exact scale, plain min/max scale
_EPS = 1e-7  # MLX's lower bound on a group's scale


DEQUANT_BLOCK_WEIGHTS = 1 << 24  # weights dequantized at a time (large tensors, by blocks of output rows)


@dataclass
class QuantizedTensor:
    """One weight after quantization with ``option``.

    ``parts`` holds, for every non-empty segment in order, the MLX triple
    ``(packed uint32 [..., out, k*bits/32], scales [..., out, k/g], biases)``;
    ``widths`` the number of input channels of each; ``perm`` the input-channel
    order (mixed options only: column ``j`` of the concatenated segments is
    original input channel ``perm[j]``); ``fp`` the weight itself for kept
    16-bit tensors; ``stats`` clip statistics; ``out_sq`` (``[..., out]``, when the
    quantizer knows it: GPTQ) each output row's squared output error ``d G d^T``
    against the Gram matrix it was quantized with, so meters need not multiply by it.
    """

    option: QuantOption
    shape: tuple[int, ...]
    parts: list[tuple[mx.array, mx.array, mx.array]] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)
    bits: list[int] = field(default_factory=list)
    group_sizes: list[int] = field(default_factory=list)
    perm: np.ndarray | None = None
    fp: mx.array | None = None
    stats: dict = field(default_factory=dict)
    out_sq: np.ndarray | None = None

    @property
    def dtype(self) -> mx.Dtype:
        """The narrowest dtype that holds the dequantized weight exactly: its scales' (or its 16-bit weight's).

        Why: a quantized weight swapped into a float32 forward in this dtype gives the same products (MLX
        promotes it to float32 exactly) at half float32's memory."""
        return self.fp.dtype if self.fp is not None else self.parts[0][1].dtype

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """The weight the stored codes represent, ``[..., out, in]`` in original channel order.

        A tensor of more than :data:`DEQUANT_BLOCK_WEIGHTS` is dequantized a block of output rows at a time into
        one array (rows are independent: the same values). Why: MLX's dequantization of a whole tensor held about
        four float32 copies of it at once (3.6 GB for one of Llama-3-70B's 28,672 x 8,192 tensors)."""
        rows = self.shape[-2] if len(self.shape) >= 2 else 1
        step = max(1, DEQUANT_BLOCK_WEIGHTS // max(1, math.prod(self.shape) // max(rows, 1)))
        if self.fp is not None or rows <= step:
            return self._dequantize(dtype)
        out = mx.zeros(self.shape, dtype=dtype)
        for r0 in range(0, rows, step):
            out[..., r0 : r0 + step, :] = self.rows(slice(r0, r0 + step))._dequantize(dtype)
            mx.eval(out)  # in place: the array's only reference
        return out

    def _dequantize(self, dtype: mx.Dtype) -> mx.array:
        if self.fp is not None:
            return self.fp.astype(dtype)
        cols = [
            mx.dequantize(w, s, b, group_size=g, bits=bits).astype(dtype)
            for (w, s, b), g, bits in zip(self.parts, self.group_sizes, self.bits)
        ]
        wq = cols[0] if len(cols) == 1 else mx.concatenate(cols, axis=-1)
        if self.perm is not None:
            inv = np.argsort(self.perm.astype(np.int64))
            wq = mx.take(wq, mx.array(inv.astype(np.int32)), axis=-1)
        return wq

    def rows(self, sl: slice | mx.array) -> "QuantizedTensor":
        """Output rows ``sl`` (axis -2: a slice or an array of row indices) as a tensor of their own (the same codes,
        scales and biases, taken), so a large weight can be dequantized a block of rows, or a row sample, at a time."""
        n = len(range(*sl.indices(self.shape[-2]))) if isinstance(sl, slice) else int(sl.shape[0])
        out_sq = sl if isinstance(sl, slice) else np.asarray(sl)
        return replace(self, shape=self.shape[:-2] + (n, self.shape[-1]),
                       parts=[(w[..., sl, :], s[..., sl, :], b[..., sl, :]) for w, s, b in self.parts],
                       fp=None if self.fp is None else self.fp[..., sl, :],
                       out_sq=None if self.out_sq is None else self.out_sq[..., out_sq])

    def stored(self) -> "QuantizedTensor":
        """Only what :meth:`dequantize` reads (codes, scales, biases, order or 16-bit weight).

        Why: a weight that waits for later use (the importance pass's reference) is held at its stored size, a
        3-bit g64 weight 0.44 bytes a weight against float16's 2."""
        return replace(self, stats={}, out_sq=None)

    def nbytes(self) -> int:
        """Bytes of every stored array (codes, scales, biases, permutation or 16-bit weight)."""
        if self.fp is not None:
            return self.fp.size * 2
        n = sum(w.nbytes + s.nbytes + b.nbytes for w, s, b in self.parts)
        if self.perm is not None:
            n += self.perm.size * perm_bits(self.shape[-1]) // 8
        return n


# --------------------------------------------------------------------------
# numpy reference of MLX's storage format
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


def _bf16_round(x: np.ndarray) -> np.ndarray:
    """Round float32 values to the nearest bfloat16 (ties to even), returned as float32."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


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
    q = unpack_codes(packed, bits, k)
    sg = np.repeat(s, group_size, axis=-1)
    bg = np.repeat(b, group_size, axis=-1)
    if kind == "bfloat16":
        return _bf16_round(_bf16_round(sg * q.astype(np.float32)) + bg)
    return sg * q.astype(s.dtype) + bg  # numpy rounds each fp16/fp32 op like MLX


# --------------------------------------------------------------------------
# MLX affine quantization building blocks
# --------------------------------------------------------------------------
def affine_params(wmin: mx.array, wmax: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    """MLX's per-group float32 (scale, bias) for the range ``[wmin, wmax]``.

    The larger-magnitude edge is made exactly representable and becomes the
    bias, so about half the scales are negative (as in ``mx.quantize``).
    """
    n_bins = float((1 << bits) - 1)
    mask = mx.abs(wmin) > mx.abs(wmax)
    scale = mx.maximum((wmax - wmin) / n_bins, _EPS)
    scale = mx.where(mask, scale, -scale)
    edge = mx.where(mask, wmin, wmax)
    q0 = mx.round(edge / scale)
    nonzero = q0 != 0
    scale = mx.where(nonzero, edge / mx.where(nonzero, q0, 1.0), scale)
    bias = mx.where(nonzero, edge, 0.0)
    return scale, bias


def affine_codes(w: mx.array, scales: mx.array, biases: mx.array, bits: int) -> mx.array:
    """Nearest codes of ``w`` (``[..., groups, g]``) for per-group ``scales``/``biases`` (``[..., groups]``).

    Pass the stored (16-bit) scales so that the stored triple dequantizes to
    the nearest representable value.
    """
    s = scales.astype(mx.float32)[..., None]
    b = biases.astype(mx.float32)[..., None]
    safe = mx.where(s == 0, 1.0, s)
    q = mx.clip(mx.round((w - b) / safe), 0, (1 << bits) - 1)
    return mx.where(s == 0, 0.0, q)


def _group_error(e: mx.array, weight: mx.array | None, metric: str) -> mx.array:
    """Per-group error of residuals ``e`` [B, R, G, g]: squared, diag- or block-weighted."""
    if weight is None:
        return (e * e).sum(-1)
    if metric == "diag":  # weight: [Bg, 1, G, g]
        return (e * e * weight).sum(-1)
    et = e.transpose(0, 2, 1, 3)  # [B, G, R, g]; weight: [Bg, G, g, g]
    return ((et @ weight) * et).sum(-1).transpose(0, 2, 1)


def _candidate_error(
    w: mx.array,
    target: mx.array,
    scale: mx.array,
    bias: mx.array,
    code_scale: mx.array,
    weight: mx.array | None,
    n_bins: float,
    dtype: mx.Dtype,
    metric: str,
) -> mx.array:
    """Per-group error of storing (``scale``, ``bias``) with codes rounded against ``code_scale``.

    Dequantizes as MLX does in ``dtype`` (``round(round(scale*q) + bias)``).
    """
    q = _level_codes(w, bias, code_scale, n_bins)
    deq = _round_to(_round_to(scale[..., None] * q, dtype) + bias[..., None], dtype)
    return _residual_error(deq, target, weight, metric)


def _round_to(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """Round float32 ``x`` to the nearest ``dtype`` value, in float32 arithmetic (fuses under compile).

    Same result as ``x.astype(dtype).astype(mx.float32)`` (float16 subnormals
    included; no overflow handling), about twice as fast on the CPU.
    """
    if dtype == mx.float32:
        return x
    if dtype == mx.bfloat16:
        c = x * 65537.0  # Veltkamp split keeps 8 significant bits
        return c - (c - x)
    c = x * 8193.0  # 11 significant bits
    normal = c - (c - x)
    subnormal = (x + 0.75) - 0.75  # float32 spacing at 0.75 is 2**-24, float16's subnormal step
    return mx.where(mx.abs(x) < 6.103515625e-05, subnormal, normal)


_ROUNDER = 12582912.0  # 1.5 * 2**23: x + this - this rounds float32 x to an integer, ties to even


def clipped_rint(x: mx.array, n_bins: float | mx.array) -> mx.array:
    """``clip(round(x), 0, n_bins)`` (round half to even), bit-identical and cheaper on the CPU.

    Adding and subtracting 1.5 * 2**23 rounds any ``|x| < 2**22`` to the nearest
    integer (ties to even) in float32 arithmetic; larger magnitudes keep their
    sign and lie beyond the clip range, so the clipped result is the same for
    every input (infinities and NaN included).
    """
    return mx.clip((x + _ROUNDER) - _ROUNDER, 0.0, n_bins)


def _level_codes(w: mx.array, bias: mx.array, code_scale: mx.array, n_bins: float) -> mx.array:
    """Codes of ``w`` [..., G, g] for per-group ``bias``/``code_scale`` [..., G] (float32 integers)."""
    return clipped_rint((w - bias[..., None]) / code_scale[..., None], n_bins)


def _level_table(scale: mx.array, bias: mx.array, levels: mx.array, dtype: mx.Dtype) -> mx.array:
    """Every code's dequantized value per group, ``[..., G, levels]``: ``round(round(scale*q) + bias)`` in ``dtype``."""
    return _round_to(_round_to(scale[..., None] * levels, dtype) + bias[..., None], dtype)


def _residual_error(deq: mx.array, target: mx.array, weight: mx.array | None, metric: str) -> mx.array:
    """Per-group error of the dequantized values ``deq`` against ``target``."""
    return _group_error(deq - target, weight, metric)


def _lut_candidate_error(
    w: mx.array,
    target: mx.array,
    scale: mx.array,
    bias: mx.array,
    code_scale: mx.array,
    weight: mx.array | None,
    n_bins: float,
    dtype: mx.Dtype,
    metric: str,
) -> mx.array:
    """:func:`_candidate_error` with the two roundings done once per (group, code) instead of once per weight.

    The dequantized value of a weight depends only on its group and code, so
    a ``[..., G, 2**bits]`` table of them, gathered by code, gives bit-identical
    values at a fraction of the elementwise work when ``2**bits`` is below the
    group size.
    """
    fns = _lut_fns(n_bins, dtype, metric, weight is not None)
    q = fns[0](w, bias, code_scale).astype(mx.uint16)  # casting outside the compiled kernel is faster
    table = fns[1](scale, bias)
    deq = mx.take_along_axis(table, q, axis=-1)
    return fns[2](deq, target) if weight is None else fns[2](deq, target, weight)


_compiled: dict = {}


def _lut_fns(n_bins: float, dtype: mx.Dtype, metric: str, weighted: bool) -> tuple:
    """Compiled pieces of :func:`_lut_candidate_error`: codes, level table, error of the gathered values."""
    key = ("lut", n_bins, dtype, metric, weighted)
    if key not in _compiled:
        levels = mx.arange(int(n_bins) + 1, dtype=mx.float32)
        mx.eval(levels)  # a constant of the compiled table: evaluated here, so any thread can use it
        codes = mx.compile(partial(_level_codes, n_bins=n_bins))
        table = mx.compile(lambda s, b: _level_table(s, b, levels, dtype))
        if weighted:
            err = mx.compile(lambda d, t, wt: _residual_error(d, t, wt, metric))
        else:
            err = mx.compile(lambda d, t: _residual_error(d, t, None, metric))
        _compiled[key] = (codes, table, err)
    return _compiled[key]


def _error_fn(n_bins: float, dtype: mx.Dtype, metric: str, weighted: bool, group_size: int | None = None):
    """A compiled (fused) :func:`_candidate_error` for one bit width, dtype and metric.

    With ``group_size`` at least twice the number of codes, the table-lookup
    form :func:`_lut_candidate_error` (same values, less work) is returned.
    """
    if group_size is not None and 2 * (int(n_bins) + 1) <= group_size:
        fn = partial(_lut_candidate_error, n_bins=n_bins, dtype=dtype, metric=metric)
        if weighted:
            return lambda w, t, s, b, cs, wt: fn(w, t, s, b, cs, wt)
        return lambda w, t, s, b, cs: fn(w, t, s, b, cs, None)
    key = (n_bins, dtype, metric, weighted)
    if key not in _compiled:
        fn = partial(_candidate_error, n_bins=n_bins, dtype=dtype, metric=metric)
        if weighted:
            _compiled[key] = mx.compile(lambda w, t, s, b, cs, wt: fn(w, t, s, b, cs, wt))
        else:
            _compiled[key] = mx.compile(lambda w, t, s, b, cs: fn(w, t, s, b, cs, None))
    return _compiled[key]


@dataclass
class ClipResult:
    """Per-group outcome of :func:`clip_search` for weights shaped ``[B, R, groups, g]``."""

    scales: mx.array  # [B, R, groups], stored dtype
    biases: mx.array
    codes: mx.array | None  # [B, R, groups, g], float32 integers (None when not asked for)
    factor: mx.array  # [B, R, groups] chosen shrink factor (0 marks plain MLX rounding)
    err: mx.array  # [B, R, groups] optimised error of the chosen candidate
    base_err: mx.array  # same error for plain mx.quantize
    clipped: int  # weights outside the chosen range


def gram_weights(gram: mx.array, group_size: int, metric: str) -> mx.array:
    """The part of a Gram matrix ``[Bg, k, k]`` the per-group error uses.

    ``"block"``: the diagonal ``g x g`` block of every group, ``[Bg, G, g, g]``
    (exact output error of a group when other groups are exact); ``"diag"``:
    the diagonal only, ``[Bg, 1, G, g]`` (input-energy-weighted squared error).
    """
    if metric not in CLIP_METRICS:
        raise ValueError(f"clip metric must be one of {CLIP_METRICS}, got {metric!r}")
    bg, k, _ = gram.shape
    ng = k // group_size
    if metric == "diag":
        return mx.diagonal(gram, axis1=1, axis2=2).reshape(bg, 1, ng, group_size)
    g5 = gram.reshape(bg, ng, group_size, ng, group_size)
    return mx.diagonal(g5, axis1=1, axis2=3).transpose(0, 3, 1, 2)


def clip_search(
    w: mx.array,
    bits: int,
    target: mx.array | None = None,
    weight: mx.array | None = None,
    metric: str = "block",
    factors: Sequence[float] = DEFAULT_CLIP_FACTORS,
    dtype: mx.Dtype = mx.float16,
    rules: Sequence[str] = CLIP_RULES,
    codes: bool = True,
) -> ClipResult:
    """Per group, pick the shrunken range ``[f*min, f*max]`` (towards zero) with the least error.

    Each range is tried with MLX's edge-exact scale (``"edge"``) and with plain
    min/max levels (``"minmax"``, which can reproduce an existing min/max
    quantization grid exactly).

    ``w`` ``[B, R, G, g]`` holds the values to quantize (already in ``dtype``),
    ``target`` the values the error is measured against (default ``w``),
    ``weight`` the output of :func:`gram_weights` (None: plain squared error).
    Plain MLX rounding is always a candidate, so the chosen error never
    exceeds that of ``mx.quantize``. Codes are computed against the rounded
    stored scales, so the stored triple dequantizes to what was scored. ``codes=False`` skips the codes and the
    clipped count (None and 0) for a caller that wants the scales and biases alone.
    """
    bad = [r for r in rules if r not in CLIP_RULES]
    if bad:
        raise ValueError(f"clip rules must be among {CLIP_RULES}, got {bad}")
    target = w if target is None else target
    n_bins = float((1 << bits) - 1)
    err_fn = _error_fn(n_bins, dtype, metric, weight is not None, int(w.shape[-1]))
    extra = () if weight is None else (weight,)
    if metric == "diag" or weight is None:
        return _clip_search_batched(w, target, extra, bits, n_bins, factors, rules, dtype, err_fn, codes)
    wmin, wmax = w.min(-1), w.max(-1)
    scale, bias = affine_params(wmin, wmax, bits)
    best_s, best_b = scale.astype(dtype), bias.astype(dtype)
    best_cs = scale  # MLX rounds against its float32 scale
    base_err = err_fn(w, target, best_s.astype(mx.float32), best_b.astype(mx.float32), best_cs, *extra)
    best_err, best_f = base_err, mx.zeros_like(base_err)
    best_lo, best_hi = wmin, wmax
    mx.eval(base_err, best_s, best_b)
    for f, rule in itertools.product(factors, rules):
        lo = mx.where(wmin < 0, wmin * f, wmin).astype(dtype).astype(mx.float32)
        hi = mx.where(wmax > 0, wmax * f, wmax).astype(dtype).astype(mx.float32)
        if rule == "edge":
            s, b = affine_params(lo, hi, bits)
        else:  # plain min/max: the levels span exactly [lo, hi]
            s, b = mx.maximum((hi - lo) / n_bins, _EPS), lo
        s, b = s.astype(dtype), b.astype(dtype)
        sf = s.astype(mx.float32)
        err = err_fn(w, target, sf, b.astype(mx.float32), sf, *extra)
        better = err < best_err
        best_s, best_b = mx.where(better, s, best_s), mx.where(better, b, best_b)
        best_cs = mx.where(better, sf, best_cs)
        best_err, best_f = mx.where(better, err, best_err), mx.where(better, f, best_f)
        best_lo, best_hi = mx.where(better, lo, best_lo), mx.where(better, hi, best_hi)
        mx.eval(best_s, best_b, best_cs, best_err, best_f, best_lo, best_hi)
    if not codes:
        return ClipResult(best_s, best_b, None, best_f, best_err, base_err, 0)
    q = mx.clip(mx.round((w - best_b.astype(mx.float32)[..., None]) / best_cs[..., None]), 0.0, n_bins)
    outside = (w < best_lo[..., None]) | (w > best_hi[..., None])
    return ClipResult(best_s, best_b, q, best_f, best_err, base_err, int(outside.sum().item()))


BATCH_ELEMENTS = 1 << 22  # candidate x weight elements scored per evaluation by the batched clip search


def _clip_search_batched(
    w: mx.array,
    target: mx.array,
    extra: tuple,
    bits: int,
    n_bins: float,
    factors: Sequence[float],
    rules: Sequence[str],
    dtype: mx.Dtype,
    err_fn,
    codes: bool = True,
) -> ClipResult:
    """:func:`clip_search` with every candidate scored in one batched computation (candidates on a new axis).

    Same candidates, same per-candidate error values and the same choice as the
    one-candidate-at-a-time loop: the first candidate (in the loop's order,
    plain rounding first) with the least error, NaN errors never chosen. Rows
    are taken in chunks so that at most :data:`BATCH_ELEMENTS` candidate
    values are live at once. Needs an elementwise error (``"diag"`` or none).
    """
    nb, rows, ng, gs = (int(d) for d in w.shape)
    n_c = 1 + len(factors) * len(rules)
    step = max(1, BATCH_ELEMENTS // max(1, n_c * nb * ng * gs))
    fs = mx.array([0.0] + [float(f) for f, _ in itertools.product(factors, rules)], dtype=mx.float32)
    pos = mx.arange(n_c, dtype=mx.int32).reshape(n_c, 1, 1, 1)
    f_axis = mx.array([float(f) for f in factors], dtype=mx.float32).reshape(-1, 1, 1, 1)
    out: dict[str, list[mx.array]] = {k: [] for k in ("s", "b", "err", "base", "f", "codes")}
    clipped = 0
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        wc, tc = w[:, r0:r1], target[:, r0:r1]
        wmin, wmax = wc.min(-1), wc.max(-1)
        scale, bias = affine_params(wmin, wmax, bits)
        # every (factor, rule) candidate at once, factors on a new leading axis (the loop's values, elementwise)
        lo = mx.where(wmin < 0, wmin * f_axis, wmin).astype(dtype).astype(mx.float32)  # [F, B, r, G]
        hi = mx.where(wmax > 0, wmax * f_axis, wmax).astype(dtype).astype(mx.float32)
        by_rule = [affine_params(lo, hi, bits) if rule == "edge" else (mx.maximum((hi - lo) / n_bins, _EPS), lo)
                   for rule in rules]  # "minmax": the levels span exactly [lo, hi]

        def candidates(first: mx.array, per_rule: list[mx.array]) -> mx.array:
            if n_c == 1:  # no clip factors: plain rounding only
                return first[None]
            return mx.concatenate([first[None], mx.stack(per_rule, 1).reshape(n_c - 1, *first.shape)])

        s_all = candidates(scale.astype(dtype), [sr.astype(dtype) for sr, _ in by_rule])  # [C, B, r, G]
        b_all = candidates(bias.astype(dtype), [br.astype(dtype) for _, br in by_rule])
        cs_all = candidates(scale, [sr.astype(dtype).astype(mx.float32) for sr, _ in by_rule])
        lo_all = candidates(wmin, [lo] * len(rules))
        hi_all = candidates(wmax, [hi] * len(rules))
        err_all = err_fn(wc[None], tc[None], s_all.astype(mx.float32), b_all.astype(mx.float32), cs_all, *extra)
        base_err = err_all[0]
        scored = mx.concatenate([err_all[:1], mx.where(mx.isnan(err_all[1:]), mx.inf, err_all[1:])])
        least = scored.min(0, keepdims=True)
        first = mx.where(scored == least, pos, n_c).min(0)  # first candidate reaching the least error
        idx = mx.where(mx.isnan(base_err), 0, first)[None]

        def pick(a: mx.array) -> mx.array:
            return mx.take_along_axis(a, idx, axis=0)[0]

        best_b = pick(b_all)
        chosen = {"s": pick(s_all), "b": best_b, "err": pick(err_all), "base": base_err, "f": fs[idx[0]]}
        if codes:
            best_cs = pick(cs_all)
            chosen["codes"] = mx.clip(mx.round((wc - best_b.astype(mx.float32)[..., None]) / best_cs[..., None]),
                                      0.0, n_bins)
            n_out = ((wc < pick(lo_all)[..., None]) | (wc > pick(hi_all)[..., None])).sum()
            mx.eval(*chosen.values(), n_out)
            clipped += int(n_out.item())
        else:
            mx.eval(*chosen.values())
        for k, v in chosen.items():
            out[k].append(v)

    def cat(k: str) -> mx.array | None:
        return None if not out[k] else out[k][0] if len(out[k]) == 1 else mx.concatenate(out[k], axis=1)

    return ClipResult(cat("s"), cat("b"), cat("codes"), cat("f"), cat("err"), cat("base"), clipped)


# --------------------------------------------------------------------------
# error measures
# --------------------------------------------------------------------------
SUM_CHUNK = 256  # terms per float32 partial sum (:func:`exact_sums`)


def _run_sums(x: mx.array) -> mx.array:
    """Float32 sums of ``x`` over runs of at most :data:`SUM_CHUNK` consecutive terms of its last axis."""
    x = x.astype(mx.float32)
    if x.ndim == 0:
        return x
    k = int(x.shape[-1])
    c = next(c for c in range(min(k, SUM_CHUNK), 0, -1) if k % c == 0)
    return x.reshape(*x.shape[:-1], k // c, c).sum(-1)


def exact_sums(*terms: mx.array) -> tuple[float, ...]:
    """The sum of all of each of ``terms``, evaluated together: MLX sums short runs, the runs' sums are added
    in double precision.

    Why: MLX's CPU backend sums in one float32 running sum per reduction, which stops growing at
    ``2^24`` times the terms' size (4,096 x 14,336 squares of uniform values summed to 16,777,216,
    14% short) and drifts long before (rows of 8,192 near-equal terms: 3e-5).
    """
    runs = [_run_sums(t) for t in terms]
    mx.eval(runs)
    return tuple(float(np.asarray(r, dtype=np.float64).sum()) for r in runs)


def weight_error(w: mx.array, wq: mx.array) -> float:
    """Relative Frobenius error ``||Wq - W|| / ||W||`` of a quantized weight."""
    w32, d = w.astype(mx.float32), wq.astype(mx.float32) - w.astype(mx.float32)
    num, den = exact_sums(d * d, w32 * w32)
    return math.sqrt(num / den)


def output_error(w: mx.array, wq: mx.array, gram: mx.array) -> float:
    """Relative output error ``||X(Wq-W)^T||_F / ||X W^T||_F`` from the Gram matrix ``G = X^T X``.

    Computed as ``sqrt(tr(D G D^T) / tr(W G W^T))`` with ``D = Wq - W``; ``gram``
    is ``[in, in]`` or per expert ``[E, in, in]`` for banks ``[E, out, in]``.
    """
    return relative_error(*output_error_sums(w, wq, gram))


def output_error_sums(w: mx.array, wq: mx.array, gram: mx.array) -> tuple[float, float]:
    """``(tr(D G D^T), tr(W G W^T))`` of :func:`output_error`; sums over blocks of rows add up."""
    g = gram.astype(mx.float32)
    w32 = w.astype(mx.float32)
    d = wq.astype(mx.float32) - w32
    return exact_sums((d @ g) * d, (w32 @ g) * w32)


def relative_error(num: float, den: float) -> float:
    """sqrt(num / den); a zero reference (all-zero weight or inputs) gives the absolute error (0 when exact)."""
    if den > 0:
        return math.sqrt(num / den)
    return 0.0 if num == 0 else math.sqrt(num)


# --------------------------------------------------------------------------
# whole-weight quantization
# --------------------------------------------------------------------------
def _as_banks(w: mx.array, gram: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """``w`` as ``[B, R, in]`` and ``gram`` as ``[Bg, in, in]`` (Bg = 1 or B)."""
    if w.ndim not in (2, 3):
        raise ValueError(f"weight must be [out, in] or [experts, out, in], got shape {tuple(w.shape)}")
    w3 = w[None] if w.ndim == 2 else w
    if gram is None:
        return w3, None
    g3 = gram[None] if gram.ndim == 2 else gram
    in_f = w3.shape[-1]
    if g3.ndim != 3 or g3.shape[-2:] != (in_f, in_f) or g3.shape[0] not in (1, w3.shape[0]):
        raise ValueError(
            f"gram shape {tuple(gram.shape)} does not match weight shape {tuple(w.shape)} "
            f"(expected [{in_f}, {in_f}] or [{w3.shape[0]}, {in_f}, {in_f}])"
        )
    return w3, g3.astype(mx.float32)


def act_order(in_features: int, gram: mx.array | None) -> np.ndarray:
    """Input channels by activation energy (diagonal of ``gram``, summed over experts), descending."""
    if gram is None:
        return np.arange(in_features)
    g3 = gram[None] if gram.ndim == 2 else gram
    energy = np.asarray(mx.diagonal(g3.astype(mx.float32), axis1=1, axis2=2).sum(0))
    return np.argsort(-energy, kind="stable")


def default_clip_factors(bits: int) -> tuple[float, ...]:
    """Range-shrink factors the clip search tries by default for ``bits``-bit groups."""
    return LOW_BIT_CLIP_FACTORS if bits <= 2 else DEFAULT_CLIP_FACTORS


def permute_inputs(
    w: mx.array, gram: mx.array | None, option: QuantOption, natural_order: bool = False
) -> tuple[mx.array, mx.array | None, np.ndarray | None]:
    """Weight ``[B, R, in]`` (float32) and Gram ``[Bg, in, in]`` in the order the option stores them.

    Mixed options use act-order (:func:`act_order`; the identity with
    ``natural_order``) and return the stored permutation (uint16 or uint32);
    uniform options keep the order (``None``).
    """
    wf = w.astype(mx.float32)
    if not option.is_mixed:
        return wf, gram, None
    in_f = int(w.shape[-1])
    order = np.arange(in_f) if natural_order else act_order(in_f, gram)
    idx = mx.array(order.astype(np.int32))
    wf = mx.take(wf, idx, axis=-1)
    if gram is not None:
        gram = mx.take(mx.take(gram, idx, axis=-1), idx, axis=-2)
    return wf, gram, order.astype(np.uint16 if perm_bits(in_f) == 16 else np.uint32)


def pack_part(codes: mx.array, scales: mx.array, biases: mx.array, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """MLX's stored triple from integer codes ``[..., k]`` and per-group ``scales``/``biases`` ``[..., k/g]``."""
    return pack_codes_mx(codes, bits), scales, biases


def quantize_weight(
    w: mx.array,
    option: QuantOption,
    gram: mx.array | None = None,
    clip: bool = True,
    scale_dtype: mx.Dtype = mx.float16,
    *,
    clip_factors: Sequence[float] | None = None,
    clip_metric: str = "block",
    natural_order: bool = False,
) -> QuantizedTensor:
    """Quantize ``w`` (``[out, in]`` or expert bank ``[E, out, in]``) with ``option``.

    Mixed options sort input channels by ``gram`` (``X^T X``, ``[in, in]`` or
    ``[E, in, in]``) energy first. Each segment is MLX affine quantization; with
    ``clip`` a per-group range search lowers the output error (weight error
    without ``gram``); ``clip_factors`` defaults to :data:`DEFAULT_CLIP_FACTORS`
    (:data:`LOW_BIT_CLIP_FACTORS` for 2-bit segments). Without ``clip`` every
    part equals ``mx.quantize`` of the weight cast to ``scale_dtype``.
    ``natural_order`` keeps mixed segments in channel order (see :func:`promote_to_uniform`).
    """
    shape = tuple(int(d) for d in w.shape)
    if option.keep16:
        return QuantizedTensor(option, shape, fp=w.astype(scale_dtype))
    w = w if w.dtype == mx.float32 else w.astype(mx.float32)  # a 16-bit source's block: every step in float32
    if clip_metric not in CLIP_METRICS:
        raise ValueError(f"clip metric must be one of {CLIP_METRICS}, got {clip_metric!r}")
    w3, g3 = _as_banks(w, gram)
    widths = option.split(shape[-1])
    wf, g3, perm = permute_inputs(w3, g3, option, natural_order)
    qt = QuantizedTensor(option, shape, perm=perm)
    base_total = best_total = 0.0
    clipped = 0
    start = 0
    for seg, k in zip(option.segments, widths):
        if k == 0:
            continue
        target = mx.contiguous(wf[..., start : start + k])  # strided views slow every candidate down
        ws = target.astype(scale_dtype)
        mx.eval(target, ws)
        if not clip:
            part = mx.quantize(ws, group_size=seg.group_size, bits=seg.bits)
        else:
            b, r, ng = ws.shape[0], ws.shape[1], k // seg.group_size
            weight = None
            if g3 is not None:
                weight = gram_weights(g3[:, start : start + k, start : start + k], seg.group_size, clip_metric)
            res = clip_search(
                ws.astype(mx.float32).reshape(b, r, ng, seg.group_size),
                seg.bits,
                target=target.reshape(b, r, ng, seg.group_size),
                weight=weight,
                metric=clip_metric,
                factors=clip_factors if clip_factors is not None else default_clip_factors(seg.bits),
                dtype=scale_dtype,
            )
            part = pack_part(res.codes.reshape(b, r, k), res.scales, res.biases, seg.bits)
            base_total += float(res.base_err.sum().item())
            best_total += float(res.err.sum().item())
            clipped += res.clipped
        qt.parts.append(tuple(a[0] for a in part) if len(shape) == 2 else tuple(part))
        qt.widths.append(k)
        qt.bits.append(seg.bits)
        qt.group_sizes.append(seg.group_size)
        start += k
    if clip:
        qt.stats = {
            "clipped_fraction": clipped / float(np.prod(shape)),
            "clip_improvement": 1.0 - best_total / base_total if base_total > 0 else 0.0,
            "clip_metric": clip_metric if gram is not None else "weight",
            "clip_base_err": base_total,  # summed group errors of plain rounding and of the chosen ranges
            "clip_best_err": best_total,
        }
    return qt


def promote_to_uniform(qt: QuantizedTensor) -> QuantizedTensor:
    """Rewrite a natural-order mixed tensor losslessly as one uniform MLX tensor (stock-loadable, larger).

    Codes are re-packed at the highest width and each segment's scales and biases
    repeated for the smallest group size, so the stored values dequantize to the
    same weight. A tensor stored with a non-identity permutation cannot be
    promoted (stock MLX has no input permutation): quantize it with
    ``natural_order=True``.
    """
    if not qt.option.is_mixed or not qt.parts:
        return qt
    in_f = qt.shape[-1]
    if qt.perm is not None and not np.array_equal(qt.perm.astype(np.int64), np.arange(in_f)):
        raise ValueError(f"{qt.option.desc}: an act-ordered mixed tensor cannot be promoted losslessly")
    bits, group = max(qt.bits), min(qt.group_sizes)
    codes, scales, biases = [], [], []
    for (w, s, b), k, nb, g in zip(qt.parts, qt.widths, qt.bits, qt.group_sizes):
        codes.append(unpack_codes(w, nb, k))
        scales.append(mx.repeat(s, g // group, axis=-1))
        biases.append(mx.repeat(b, g // group, axis=-1))
    packed = pack_codes_mx(np.concatenate(codes, axis=-1), bits)
    stats = dict(qt.stats, promoted_from=qt.option.desc)
    out = QuantizedTensor(QuantOption.uniform(bits, group), qt.shape, stats=stats, out_sq=qt.out_sq)  # same values
    out.parts = [(packed, mx.concatenate(scales, axis=-1), mx.concatenate(biases, axis=-1))]
    out.widths, out.bits, out.group_sizes = [in_f], [bits], [group]
    return out
