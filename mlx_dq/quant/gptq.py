"""Error-compensating quantization (GPTQ) with activation-weighted scale search.

Rounding every weight to its nearest code ignores that the output error of a
linear layer is ``||X (Wq - W)^T||``: errors on correlated input channels can
cancel. GPTQ quantizes input channels one at a time and pushes each channel's
rounding error onto the channels not yet quantized, through the inverse of
the (damped) Gram matrix ``H = X^T X`` of the layer's inputs.

Channel order:

- Mixed options: channels are sorted by activation energy (``diag(H)``,
  descending). That order is both the segment assignment (the most active
  channels get the widest segment) and the stored permutation, so GPTQ simply
  runs in storage order, and every group's scale/bias is chosen when the
  quantizer reaches the group's first column, from the error-updated weights.
- Uniform options stay in natural channel order (stock MLX cannot store a
  permutation). With ``act_order=True`` they use GPTQ's "static groups":
  every group's scale/bias is chosen up front from the original weights in
  natural order, then columns are processed in act-order. With
  ``act_order=False`` columns run in natural order and groups are chosen
  lazily from the updated weights, as for mixed options.

Group parameters come from :func:`mlx_dq.quant.affine.clip_search` (range shrinking)
and, with ``weighted_scales``, a refinement that minimises the input-energy
weighted error ``sum_j diag(H)_j (w_j - q_j)^2`` over shifted/rescaled ranges
and a weighted least-squares refit (:func:`refine_group_params`). Codes are
computed against the rounded 16-bit scales and biases, and the value GPTQ
feeds back is exactly what ``mx.dequantize`` returns for the stored triple on
MLX's CPU backend (``round16(round16(scale*q) + bias)``; Metal's rounding is
not verified here).

Expert banks ``[E, out, in]``: with one shared Hessian the experts are folded
into rows (one factorisation for all); with per-expert Hessians the experts
are processed together, vectorised, in one channel order (energy summed over
experts), each with its own factor and damping.

Sequential quantization: the converter (:mod:`mlx_dq.quant.dispatch`) accumulates
``H`` from the inputs each decoder layer receives when every earlier layer is
already quantized, and passes it here (:func:`gptq_quantize`); within a layer
all tensors see the unquantized layer's inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.quant import linalg
from mlx_dq.quant.affine import (
    QuantizedTensor,
    _as_banks,
    affine_params,
    clip_search,
    clipped_rint,
    default_clip_factors,
    output_error,
    pack_codes_mx,
    quantize_weight,
    weight_error,
)
from mlx_dq.quant.affine import (
    act_order as energy_order,
)
from mlx_dq.quant.options import QuantOption, perm_bits
from mlx_dq.runtime.threads import map_ahead

SPAN_COLUMNS = 1024  # GPTQ's blocks update the columns beyond their span of this many columns once per span
F16_ROUND_LIMIT = 6e4  # GPTQ's column loop rounds to fp16 by float32 arithmetic where |values| stay below this
TRANSPOSE_ROWS = 256  # rows of a weight gathered and transposed at a time into GPTQ's column-major copy
SUB_COLUMNS = 16  # GPTQ's columns update each other one by one within sub-blocks of this many columns
ERROR_CHANNELS = 1024  # input channels per piece of GPTQ's output error: bounded temporaries, float32 sums this long
PARAM_CHUNK = 2**20  # weights per call of the group-parameter search: its candidates' temporaries stay small
DEFAULT_SHIFTS: tuple[float, ...] = (-0.5, -0.25, 0.25, 0.5)  # bias shifts, in quantization steps
DEFAULT_RESCALES: tuple[float, ...] = (0.9, 0.95, 1.05)  # scale multipliers around the range centre
# Relative damping of H. On SmolLM2 layers with 4k-16k calibration tokens, 0.1 gave the lowest
# output error on held-out text of another domain at 2, 3 and 4 bits (benchmarks/compensation.py);
# 0.01 (GPTQ's usual value) fits the calibration rows more closely but generalises worse.
DEFAULT_DAMP = 0.1
MAX_DAMP_RETRIES = 6
SCALE_WEIGHTS = ("diag", "gptq")


# --------------------------------------------------------------------------
# Hessian preparation
# --------------------------------------------------------------------------
def damped_hessian(gram: np.ndarray, damp: float, copy: bool = True) -> tuple[np.ndarray, float]:
    """``H`` (``[B, k, k]``) with dead channels set to 1 and ``damp * mean(diag(H))`` added to the diagonal.

    Each of the ``B`` matrices is damped by its own mean diagonal. Returns the
    damped float32 matrices and the largest absolute damping added; ``copy=False``
    damps a float32 ``gram`` in place (one ``k x k`` copy less at 14,336 channels: 822 MB).
    """
    if damp < 0:
        raise ValueError(f"damp must be >= 0, got {damp}")
    h = np.array(gram, dtype=np.float32, copy=copy)
    diag = np.einsum("bii->bi", h)  # writable view of every diagonal
    diag[:], lam = _damped_diagonal(diag, damp)
    return h, float(lam.max()) if lam.size else 0.0


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
    step = linalg._rows_per_chunk(g.shape[-1])
    for i0 in range(0, a.shape[0], step):  # np.take, not fancy indexing: 10x faster (8,192 channels: 1.6 -> 0.16 s)
        np.take(np.take(g, rev[i0:i0 + step], axis=0), rev, axis=1, out=a[i0:i0 + step], mode="clip")
    np.einsum("ii->i", a)[:] = diag


def _all_finite(a: np.ndarray) -> bool:
    """Whether every entry of ``a`` (``[..., k, k]``) is finite, checked a chunk of rows at a time: ``np.isfinite``
    of the whole matrix is a ``k x k`` bool array (822 MB at 28,672 channels, which set a Llama-3-70B layer's peak)."""
    step = linalg._rows_per_chunk(a.shape[-1])
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
    """What is left of a Gram matrix whose buffer became its Hessian factor (:func:`consume_gram`): its shape and
    undamped diagonal, which is all GPTQ reads once the factor is made. Anything else that needs the Gram itself
    fails loudly (it has no ``astype`` and cannot be multiplied)."""

    shape: tuple[int, ...]  # [1, k, k]: one bank, as GPTQ sees a Gram
    diag: np.ndarray  # [Bg, k] float32
    order: np.ndarray  # the channels by energy (act order), the sequence its factor was made for

    @property
    def ndim(self) -> int:
        return len(self.shape)


def can_consume(gram: object) -> bool:
    """Whether :func:`consume_gram` can take ``gram``: an MLX float32 ``[k, k]`` array (the caller also knows that
    nothing else will read it)."""
    return isinstance(gram, mx.array) and gram.ndim == 2 and gram.dtype == mx.float32


def consume_gram(gram: mx.array, factor_cache: dict, damp: float = DEFAULT_DAMP) -> FactoredGram:
    """Factor ``gram`` (``[k, k]``, float32, read by nothing else afterwards) for the act-order channel sequence every
    GPTQ option of :func:`gptq_quantize_many` uses (uniform with act order, mixed in energy order), in the Gram's own
    buffer, into ``factor_cache``; returns the stand-in to pass as the Gram from then on.

    Why: the Gram and its factor were two ``k x k`` arrays while a tensor's options were measured (822 MB each at
    Llama-3-8B's 14,336-channel ``down_proj`` input, 3.3 GB at 70B's)."""
    mx.eval(gram)
    k = int(gram.shape[-1])
    diag = np.einsum("bii->bi", np.asarray(gram)[None]).astype(np.float32)
    seq = energy_order(k, gram)
    key = _factor_key(damp, 1, seq)
    factor_cache[key] = factor_hessian(gram, seq, damp, consume=True)
    return FactoredGram((1, k, k), diag, seq)


def _factor_key(damp: float, banks: int, seq: np.ndarray) -> tuple:
    return float(damp), banks, np.asarray(seq, dtype=np.int64).tobytes()


# --------------------------------------------------------------------------
# group parameters
# --------------------------------------------------------------------------
def dequant_f16(q: np.ndarray, scales: np.ndarray, biases: np.ndarray) -> np.ndarray:
    """What ``mx.dequantize`` returns for codes ``q`` and fp16 ``scales``/``biases`` (broadcast), as float32.

    MLX's CPU backend rounds ``scale*q`` and the sum to fp16, as numpy's fp16 arithmetic does
    (float32 operations rounded to fp16 after each step; ``scale*q`` itself is exact in float32).
    """
    s = np.asarray(scales, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32)
    prod = (s * q).astype(np.float16).astype(np.float32)
    return (prod + b).astype(np.float16).astype(np.float32)


def codes_f16(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """Nearest codes of float32 ``w`` for fp16 ``scales``/``biases`` (broadcast), clipped to ``bits``."""
    s = np.asarray(scales, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32)
    safe = np.where(s == 0, 1.0, s)
    q = np.clip(np.rint((w - b) / safe), 0, (1 << bits) - 1)
    return np.where(s == 0, 0.0, q).astype(np.float32)


def _candidate_parts(w: mx.array, s16: mx.array, b16: mx.array, n_bins: mx.array):
    """Codes of ``w`` [..., G, g] for fp16 ``s16``/``b16`` [..., G] before zero-scale groups are zeroed, and the
    float32 scale, bias and keep mask broadcast over the group.

    Why this shape: the zero-scale test and the safe divisor are made per group, not per weight; a
    per-weight ``where`` made the compiled CPU kernel four times slower. A zero scale gives ``e = b - w``
    whatever the code, so the error needs no masking.
    """
    s = s16.astype(mx.float32)
    b = b16.astype(mx.float32)[..., None]
    keep = (s != 0).astype(mx.float32)[..., None]
    q = clipped_rint((w - b) / mx.where(s == 0, 1.0, s)[..., None], n_bins)
    return q, s[..., None], b, keep


@mx.compile
def _codes(w: mx.array, s16: mx.array, b16: mx.array, n_bins: mx.array) -> mx.array:
    """The codes of :func:`_candidate_error_only` (0 in zero-scale groups)."""
    q, _, _, keep = _candidate_parts(w, s16, b16, n_bins)
    return q * keep


@mx.compile
def _candidate_error_only(w: mx.array, weight: mx.array, s16: mx.array, b16: mx.array, n_bins: mx.array):
    """Weighted squared error per group of ``w`` [..., G, g] for fp16 ``s16``/``b16`` [..., G] (codes not written;
    :func:`_codes` gives them)."""
    q, s, b, _ = _candidate_parts(w, s16, b16, n_bins)
    e = s * q + b - w
    return (e * e * weight).sum(-1)


def _fixed_sums(w: mx.array, weight: mx.array) -> tuple[mx.array, mx.array]:
    """Per group ``sum weight`` and ``sum weight*w``: the parts of :func:`_weighted_lsq` the codes do not change."""
    wt = mx.broadcast_to(weight, w.shape)
    return wt.sum(-1), (wt * w).sum(-1)


def _weighted_lsq(w: mx.array, weight: mx.array, q: mx.array, s16: mx.array, b16: mx.array,
                  fixed: tuple[mx.array, mx.array] | None = None):
    """Per-group (scale, bias) minimising ``sum weight*(w - scale*q - bias)^2`` for fixed codes ``q``;
    ``fixed``: :func:`_fixed_sums` when already made (each refit of one call shares them).

    Not compiled: MLX's CPU backend ran the compiled five-reduction graph 1.5x slower (same values)."""
    wt = mx.broadcast_to(weight, w.shape)
    wq = wt * q
    sd, sw = _fixed_sums(w, weight) if fixed is None else fixed
    sq, sqq, sqw = wq.sum(-1), (wq * q).sum(-1), (wq * w).sum(-1)
    det = sd * sqq - sq * sq
    ok = det > 1e-9 * mx.maximum(sd * sqq, 1e-30)
    s_ls = mx.where(ok, (sd * sqw - sq * sw) / mx.where(ok, det, 1.0), s16.astype(mx.float32))
    b_ls = mx.where(ok, (sw - s_ls * sq) / mx.where(sd > 0, sd, 1.0), b16.astype(mx.float32))
    return s_ls, b_ls


def refine_group_params(
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    bits: int,
    weight: mx.array | None = None,
    shifts: tuple[float, ...] = DEFAULT_SHIFTS,
    rescales: tuple[float, ...] = DEFAULT_RESCALES,
    refits: int = 2,
) -> tuple[mx.array, mx.array]:
    """Improve per-group fp16 ``scales``/``biases`` (``[..., G]``) for ``w`` (``[..., G, g]``) under a weighted error.

    Tries the range shifted by fractions of a step, rescaled around its centre,
    and ``refits`` rounds of weighted least squares of ``(scale, bias)`` for the
    current codes; keeps, per group, whichever has the least
    ``sum_j weight_j (w_j - q_j)^2`` (``weight`` broadcasts to ``w``; None
    means plain squared error). Never worse than the input parameters.
    """
    w = w.astype(mx.float32)
    wt = mx.array(1.0) if weight is None else weight.astype(mx.float32)
    n_bins = mx.array(float((1 << bits) - 1))
    best_s, best_b = scales.astype(mx.float16), biases.astype(mx.float16)
    best_err = _candidate_error_only(w, wt, best_s, best_b, n_bins)
    s32, b32 = best_s.astype(mx.float32), best_b.astype(mx.float32)
    centre = b32 + s32 * n_bins / 2

    def consider(s: mx.array, b: mx.array) -> None:
        nonlocal best_s, best_b, best_err
        s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
        ok = mx.isfinite(s16) & mx.isfinite(b16)
        s16, b16 = mx.where(ok, s16, best_s), mx.where(ok, b16, best_b)
        err = _candidate_error_only(w, wt, s16, b16, n_bins)
        better = err < best_err
        best_s, best_b = mx.where(better, s16, best_s), mx.where(better, b16, best_b)
        best_err = mx.where(better, err, best_err)

    # the shifted and rescaled ranges, scored at once on a new leading axis; per group the first one with
    # the least error replaces the input when strictly better (what considering them in turn would keep)
    lead = (-1,) + (1,) * s32.ndim
    t_axis = mx.array([float(t) for t in shifts], dtype=mx.float32).reshape(lead)
    f_axis = mx.array([float(f) for f in rescales], dtype=mx.float32).reshape(lead)
    if shifts or rescales:
        cand_s = mx.concatenate([mx.broadcast_to(s32, (len(shifts),) + s32.shape), s32 * f_axis])
        cand_b = mx.concatenate([b32 + t_axis * s32, centre - s32 * f_axis * n_bins / 2])
        s16, b16 = cand_s.astype(mx.float16), cand_b.astype(mx.float16)
        errs = _candidate_error_only(w[None], wt, s16, b16, n_bins)
        errs = mx.where(mx.isfinite(s16) & mx.isfinite(b16) & ~mx.isnan(errs), errs, mx.inf)
        least = errs.min(0)
        pos = mx.arange(errs.shape[0], dtype=mx.int32).reshape(lead)
        first = mx.where(errs == least, pos, errs.shape[0]).min(0, keepdims=True)
        better = least < best_err
        best_s = mx.where(better, mx.take_along_axis(s16, first, axis=0)[0], best_s)
        best_b = mx.where(better, mx.take_along_axis(b16, first, axis=0)[0], best_b)
        best_err = mx.where(better, least, best_err)
    mx.eval(best_s, best_b, best_err)
    fixed = _fixed_sums(w, wt) if refits else None
    for _ in range(refits):
        best_q = _codes(w, best_s, best_b, n_bins)
        consider(*_weighted_lsq(w, wt, best_q, best_s, best_b, fixed))
        mx.eval(best_s, best_b, best_err)
    return best_s, best_b


def choose_group_params(
    w: np.ndarray,
    bits: int,
    weight: np.ndarray | None = None,
    clip: bool = True,
    weighted: bool = True,
) -> tuple[np.ndarray, np.ndarray]:
    """fp16 scales/biases (``[B, R, G]``) for groups ``w`` (``[B, R, G, g]``, float32).

    Starts from MLX's own range rule; ``clip`` runs :func:`mlx_dq.quant.affine.clip_search`
    (plain squared error, or ``weight``-weighted when ``weighted``); ``weighted``
    then refines with :func:`refine_group_params` under the ``weight``
    (``[Bg, 1, G, g]``, e.g. ``diag(H)``) weighted error.

    Rows go in chunks of about :data:`PARAM_CHUNK` weights, on worker threads when called from the main thread
    (:func:`~mlx_dq.runtime.threads.map_ahead`): MLX's CPU elementwise kernels use one core each. Without ``clip`` the start
    is not scored (nothing to compare it with). Same values either way; 8,192 x 8,192 at 4 bits: 3.6 -> 2.2 s here.
    """
    wei = None if not weighted or weight is None else mx.array(weight)
    per_row = max(1, int(np.prod(w.shape)) // max(1, w.shape[1]))
    step = max(1, PARAM_CHUNK // per_row)
    s_out = np.empty(w.shape[:-1], dtype=np.float16)
    b_out = np.empty_like(s_out)

    def rows_params(r0: int) -> tuple[mx.array, mx.array]:
        wm = mx.array(w[:, r0 : r0 + step])
        w16 = wm.astype(mx.float16).astype(mx.float32)
        if clip:
            res = clip_search(w16, bits, target=wm, weight=wei, metric="diag", factors=default_clip_factors(bits),
                              dtype=mx.float16, codes=False)  # the scales and biases alone: GPTQ rounds itself
            s, b = res.scales, res.biases
        else:  # MLX's range rule: clip_search's only candidate without factors, not scored here
            s, b = (x.astype(mx.float16) for x in affine_params(w16.min(-1), w16.max(-1), bits))
        return refine_group_params(wm, s, b, bits, wei) if weighted else (s, b)

    # rows are independent: the same values in bounded temporaries, on worker threads when called from the main one
    starts = list(range(0, w.shape[1], step))
    for r0, (s, b) in zip(starts, map_ahead(rows_params, starts)):
        s_out[:, r0 : r0 + step], b_out[:, r0 : r0 + step] = np.asarray(s), np.asarray(b)
    return s_out, b_out


# --------------------------------------------------------------------------
# GPTQ core
# --------------------------------------------------------------------------
@dataclass
class GPTQResult:
    """Raw GPTQ output in storage channel order, rows ``[B, R]`` (experts folded as the Hessian dictates).

    ``codes`` ``[B, R, k]``; ``scales``/``biases`` ``[B, R, k/g]`` per group
    (fp16, groups laid out segment after segment); ``assumed`` ``[B, R, k]``
    the dequantized weight GPTQ compensated for (the fp16 values ``mx.dequantize``
    yields, stored as fp16: half a float32 copy's memory); ``order`` original channel of each storage
    column; ``extra_damp`` damping added beyond the requested one;
    ``clipped`` how many error-updated weights fell outside their group's range
    (per bank ``[B]`` when the banks are several options of one weight).
    """

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    assumed: np.ndarray
    order: np.ndarray
    damp_abs: float
    extra_damp: float
    out_sq: np.ndarray  # [B, R]: each row's squared output error against the undamped Gram
    clipped: int | np.ndarray = 0


def _group_layout(option: QuantOption, in_f: int) -> list[tuple[int, int, int]]:
    """``(start, size, bits)`` of every group, in storage order, segment after segment."""
    groups, start = [], 0
    for seg, k in zip(option.segments, option.split(in_f)):
        for g0 in range(start, start + k, seg.group_size):
            groups.append((g0, seg.group_size, seg.bits))
        start += k
    return groups


def _shared_layout(options: Sequence[QuantOption], in_f: int) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """The group layout of the first option and every option's bits per group ``[len(options), G]``.

    Options batched into one GPTQ pass must place their groups identically (only the widths may differ).
    """
    layouts = [_group_layout(o, in_f) for o in options]
    starts = [(g0, gs) for g0, gs, _ in layouts[0]]
    if any([(g0, gs) for g0, gs, _ in lay] != starts for lay in layouts[1:]):
        raise ValueError("options quantized in one GPTQ pass need the same group layout: "
                         + ", ".join(o.desc for o in options))
    return layouts[0], np.array([[b for _, _, b in lay] for lay in layouts], dtype=np.int64)


def gptq_core(
    w: np.ndarray,
    gram: np.ndarray,
    option: QuantOption | Sequence[QuantOption],
    order: np.ndarray,
    *,
    static_groups: bool,
    process_order: np.ndarray | None = None,
    damp: float = DEFAULT_DAMP,
    block_size: int = 128,
    clip: bool = True,
    weighted_scales: bool = True,
    scale_weight: str = "diag",
    factor: HessianFactor | None = None,
) -> GPTQResult:
    """GPTQ on ``w`` ``[B, R, in]`` with Gram ``[1 or B, in, in]``; storage column ``j`` is channel ``order[j]``.

    Columns are processed in storage order, or in ``process_order`` (storage
    positions) with ``static_groups`` (group parameters fixed up front from
    the original weights). Without static groups, blocks end on group
    boundaries and each group's parameters are chosen from the updated weights
    when its first column comes up. ``scale_weight`` picks the per-channel
    weights of the scale search: ``"diag"`` (``diag(H)``, input energy) or
    ``"gptq"`` (``1/[H^-1]_jj`` over the not-yet-quantized channels, the
    damage GPTQ's own objective assigns to that channel's error). ``factor``
    reuses a :func:`factor_hessian` result made for the same sequence and damping.
    ``option`` may be a list with one option per bank (several options of one weight,
    stacked on the bank axis, sharing one Gram matrix and group layout): each bank is
    quantized exactly as alone, in one pass over the columns.
    """
    if scale_weight not in SCALE_WEIGHTS:
        raise ValueError(f"scale_weight must be one of {SCALE_WEIGHTS}, got {scale_weight!r}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    w = np.asarray(w, dtype=np.float32)
    nb, rows, k = w.shape
    options = [option] if isinstance(option, QuantOption) else list(option)
    if len(options) > 1 and (len(options) != nb or gram.shape[0] != 1):
        raise ValueError(f"{len(options)} options need as many banks ({nb} given) and one shared Gram matrix")
    groups, g_bits = _shared_layout(options, k)  # g_bits [1 or B, G]
    gid = np.empty(k, dtype=np.int64)
    for i, (g0, gs, _) in enumerate(groups):
        gid[g0 : g0 + gs] = i
    q_max = ((1 << g_bits) - 1).astype(np.float32)
    g_start = np.array([g0 for g0, _, _ in groups])
    per_bank = len(options) > 1

    identity = np.array_equal(order, np.arange(k))
    # storage order (a view when it is the original order; banks of one broadcast weight stay one weight): only the
    # group parameters fixed up front read it
    ws = None if not static_groups else w if identity else \
        np.broadcast_to(np.take(w[:1], order, axis=2), w.shape) if w.strides[0] == 0 else np.take(w, order, axis=2)
    if not isinstance(gram, FactoredGram):
        gram = np.asarray(gram, dtype=np.float32)
    diag = gram.diag if isinstance(gram, FactoredGram) else np.einsum("bii->bi", gram)
    energy = diag[:, order].copy()  # undamped diag(H), storage order [Bg, k]
    porder = np.arange(k) if process_order is None else np.asarray(process_order)
    if not static_groups and process_order is not None and not np.array_equal(porder, np.arange(k)):
        raise ValueError("a custom process order needs static_groups=True")

    sequence = np.asarray(order)[porder]
    if factor is None:
        factor = factor_hessian(gram, sequence, damp)
    elif factor.damp != damp or not np.array_equal(factor.sequence, sequence) or factor.u.shape[0] != gram.shape[0]:
        raise ValueError("the Hessian factor was made for another channel sequence, damping or expert count")
    u, lam, extra = factor.u, factor.damp_abs, factor.extra_damp
    if scale_weight == "gptq":
        energy = np.empty_like(energy)
        energy[:, porder] = 1.0 / np.einsum("bii->bi", u) ** 2
    scales = np.zeros((len(groups), nb, rows), dtype=np.float16)  # group-major: contiguous per column
    biases = np.zeros_like(scales)

    def params_for(block: np.ndarray, first: int, count: int, gsz: int) -> None:
        # block: [B, R, count*gsz] storage columns starting at group index `first`; banks of one width per call
        wg = block.reshape(nb, rows, count, gsz)
        wt = energy[:, g_start[first] : g_start[first] + count * gsz].reshape(-1, 1, count, gsz)
        widths = g_bits[:, first]
        for bits in np.unique(widths):
            banks = slice(None) if len(widths) == 1 else np.flatnonzero(widths == bits)
            s, b = choose_group_params(wg[banks], int(bits), wt, clip=clip, weighted=weighted_scales)
            scales[first : first + count, banks] = s.transpose(2, 0, 1)
            biases[first : first + count, banks] = b.transpose(2, 0, 1)

    if static_groups:  # all groups from the original weights, one call per segment
        i = 0
        while i < len(groups):
            j = i
            while j < len(groups) and groups[j][1] == groups[i][1] and np.array_equal(g_bits[:, j], g_bits[:, i]):
                j += 1
            g0, gsz, _ = groups[i]
            params_for(ws[:, :, g0 : g0 + (j - i) * gsz], i, j - i, gsz)
            i = j

    # blocks in processing order; without static groups they end on group boundaries
    bounds = [0]
    while bounds[-1] < k:
        end = min(k, bounds[-1] + block_size)
        if not static_groups:
            g = gid[end - 1]
            end = max(end, int(g_start[g] + groups[g][1]))
        bounds.append(end)

    # [Bg, k, C] in processing order, C = B/Bg * R: the columns not yet reached live in MLX (the lazy block updates,
    # most of GPTQ's multiply-adds, run there, on the default device); each block's columns come back to numpy.
    # Banks sharing one Hessian factor sit side by side in a column (one wide product instead of a batch of narrow
    # ones: 2-3x faster on the CPU for ten banks of 256 rows); banks with their own factor stay a batch.
    bg = u.shape[0]
    wide = nb // bg * rows
    rest = _pending_columns(w, sequence, bg)
    del ws  # the storage-order copy is not read again
    u_mx = factor.u_mx
    codes = np.zeros((nb, k, rows), dtype=np.uint8)
    assumed = np.zeros((nb, k, rows), dtype=np.float16)  # every value is an fp16 value: exact, half the memory
    sp_of, gid_of = porder.tolist(), gid.tolist()  # Python ints: the column loop indexes with them, no numpy scalars
    first_of_group = set(g_start.tolist())
    clipped = np.zeros(nb, dtype=np.int64) if per_bank else 0
    group_cache: dict[int, tuple] = {}  # float32 views of a group's final parameters, made once per group

    def group_params(g: int) -> tuple:
        if g not in group_cache:
            if not static_groups:  # groups come up one after another: the last one is done
                group_cache.clear()
            sg, bg_ = scales[g].astype(np.float32), biases[g].astype(np.float32)
            zero = sg == 0
            qm = q_max[:, g, None] if per_bank else float(q_max[0, g])  # per bank [B, 1]: float32 like the codes
            # fp16 rounding by float32 arithmetic (_round_f16) where no value can reach the end of fp16's range
            small = float(np.max(np.abs(sg) * (q_max[:, g, None] if per_bank else q_max[0, g]) + np.abs(bg_))) \
                < F16_ROUND_LIMIT
            group_cache[g] = (sg, bg_, np.where(zero, np.float32(1.0), sg), zero if zero.any() else None, qm, small)
        return group_cache[g]

    widest = max(b1 - b0 for b0, b1 in zip(bounds[:-1], bounds[1:]))
    scratch = np.empty((bg, widest, wide), dtype=np.float32)
    outside = np.empty((nb, widest, rows), dtype=bool)  # a block's weights outside their group's range, counted once
    esq = np.zeros((bg, wide), dtype=np.float64)  # sum of GPTQ's scaled errors e^2 per row
    raw_buf, q_buf = np.empty((nb, rows), dtype=np.float32), np.empty((nb, rows), dtype=np.float32)
    dq_buf = np.empty((nb, rows), dtype=np.float32)
    tmp_buf, tmp2_buf = np.empty((nb, rows), dtype=np.float32), np.empty((nb, rows), dtype=np.float32)
    # blocks in spans of about SPAN_COLUMNS: a block's errors update the rest of its span at once, a span's errors the
    # columns beyond it, so the remaining columns are rewritten once a span, not once a block
    spans = [0]
    for b in bounds[1:]:
        if b - spans[-1] >= SPAN_COLUMNS or b == k:
            spans.append(b)
    serr = np.empty((bg, max(b1 - b0 for b0, b1 in zip(spans[:-1], spans[1:])), wide), dtype=np.float32)
    s0, s1, span, span_ends = 0, 0, rest, iter(spans[1:])
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        if b0 == s1:  # a new span: the columns beyond the last one get its errors
            if s1 > s0:
                rest = rest - mx.matmul(u_mx[:, s0:s1, s1:].transpose(0, 2, 1), mx.array(serr[:, : s1 - s0]))
            s0, s1 = b0, next(span_ends)
            span, rest = rest[:, : s1 - s0, :], rest[:, s1 - s0 :, :]
        err = serr[:, b0 - s0 : b1 - s0]  # this block's errors, column by column
        wt_ = _columns(span, b1 - b0)  # this block's columns; column p is wt_[:, p - b0]
        cuts = iter(_sub_blocks(b0, b1, None if static_groups else g_start))
        c0, c1 = b0, next(cuts)
        for p in range(b0, b1):
            sp = sp_of[p]
            g = gid_of[sp]
            if not static_groups and sp in first_of_group:
                gsz = groups[g][1]
                params_for(wt_[:, p - b0 : p - b0 + gsz, :].reshape(bg, gsz, nb // bg, rows).transpose(0, 2, 3, 1)
                           .reshape(nb, rows, gsz), g, 1, gsz)
            s, bi, safe, zero, qm, small = group_params(g)
            if p > c0:  # the sub-block's earlier errors reach this column in one small product
                corr = np.matmul(u[:, c0:p, p][:, None, :], err[:, c0 - b0 : p - b0], out=scratch[:, :1])
                np.subtract(wt_[:, p - b0], corr[:, 0], out=wt_[:, p - b0])
            col = wt_[:, p - b0, :].reshape(nb, rows)
            # same values as codes_f16 / dequant_f16, with the division done once and the parameters converted once;
            # into reused buffers (at 256-row banks the calls, not the arithmetic, are most of the time)
            raw = np.rint(np.divide(np.subtract(col, bi, out=raw_buf), safe, out=raw_buf), out=raw_buf)
            q = np.minimum(np.maximum(raw, 0.0, out=q_buf), qm, out=q_buf)  # np.clip's values, without its dispatch
            out = np.not_equal(q, raw, out=outside[:, p - b0])  # rounded outside the range (weights are finite)
            if zero is not None:
                q[zero] = 0.0
                out &= ~zero
            codes[:, sp, :] = q
            if small:  # dequant_f16's values, rounded to fp16 without conversions
                dq = _round_f16(np.multiply(s, q, out=dq_buf), tmp_buf, tmp2_buf)  # s * q is exact in float32
                _round_f16(np.add(dq, bi, out=dq), tmp_buf, tmp2_buf)
            else:
                dq = dequant_f16(q, s, bi)
            assumed[:, sp, :] = dq
            e = err[:, p - b0, :]  # this column's scaled errors, written in place
            np.divide(np.subtract(wt_[:, p - b0, :], dq.reshape(bg, wide), out=e), u[:, p, p, None], out=e)
            if p + 1 == c1 < b1:  # the sub-block's errors update the rest of the block in one product
                upd = np.matmul(u[:, c0:c1, c1:b1].transpose(0, 2, 1), err[:, c0 - b0 : c1 - b0],
                                out=scratch[:, : b1 - c1])
                np.subtract(wt_[:, c1 - b0 :, :], upd, out=wt_[:, c1 - b0 :, :])
                c0, c1 = c1, next(cuts)
        esq += np.square(err, dtype=np.float64).sum(1)
        n_out = np.count_nonzero(outside[:, : b1 - b0].reshape(nb, -1), axis=1)
        clipped += n_out if per_bank else int(n_out.sum())
        span = span[:, b1 - b0 :, :]
        if b1 < s1:
            span = span - mx.matmul(u_mx[:, b0:b1, b1:s1].transpose(0, 2, 1), mx.array(err))
    esq = esq.reshape(nb, rows)
    return GPTQResult(
        codes=codes.transpose(0, 2, 1),
        scales=scales.transpose(1, 2, 0),
        biases=biases.transpose(1, 2, 0),
        assumed=assumed.transpose(0, 2, 1),
        order=np.asarray(order),
        damp_abs=lam,
        extra_damp=extra,
        clipped=clipped,
        out_sq=_output_error_rows(esq, w, assumed, order, porder, factor),
    )


def _round_f16(x: np.ndarray, tmp: np.ndarray, tmp2: np.ndarray) -> np.ndarray:
    """Round float32 ``x`` in place to its nearest fp16 value (ties to even), as ``x.astype(np.float16)`` does, where
    ``|x|`` is in fp16's normal range (below 65520) or ``x`` is already a multiple of fp16's subnormal step 2^-24:
    true of every product ``scale * code`` and every float32 sum of two fp16 values (a sum below 2^-14 is exact).
    ``tmp``, ``tmp2``: float32 scratch of ``x``'s shape.

    Veltkamp's split: ``c = x (2^13 + 1)``, ``c - (c - x)`` keeps ``x``'s 11 leading bits, rounded to nearest.
    Why: numpy's fp16 conversions cost twice as much, and a lookup table of each group's dequantized levels was no
    faster (its reads miss the cache: one line per row). Tested equal to the conversions, ties included."""
    np.multiply(x, np.float32(2**13 + 1), out=tmp)
    np.subtract(tmp, x, out=tmp2)
    return np.subtract(tmp, tmp2, out=x)


def _columns(span: mx.array, n: int) -> np.ndarray:
    """The first ``n`` columns of GPTQ's lazily updated ``span`` (``[B, columns, R]``) as a writable numpy array;
    MLX evaluates the updates first, so a profile counts them as MLX's work.

    Contiguous columns come as a view of MLX's buffer, not a copy (5.9 s of numpy copies in an 8B-shape measure):
    the column loop rewrites them in place, and nothing reads a block's columns from ``span`` again (later
    updates read only the columns beyond the block)."""
    cols = span[:, :n, :]
    mx.eval(cols)
    view = np.asarray(cols)
    return view if view.flags.c_contiguous and view.flags.writeable else np.array(view)


def _sub_blocks(b0: int, b1: int, group_starts: np.ndarray | None) -> list[int]:
    """Ends of the sub-blocks of GPTQ's block ``[b0, b1)``: every :data:`SUB_COLUMNS` columns and, when groups are
    chosen as the columns come up (``group_starts``), at each group's first column too, so a group's columns have
    every earlier error when its parameters are chosen.

    Why: within a sub-block each column's error updates the sub-block's later columns one by one (elementwise,
    memory-bound); a finished sub-block updates the rest of the block in one matrix product. At 128-column blocks
    of ten 256-row banks this took a block's updates from 9.3 to 2.5 ms here; the values agree to float rounding."""
    cuts = set(range(b0 + SUB_COLUMNS, b1, SUB_COLUMNS)) | {b1}
    if group_starts is not None:
        cuts |= {int(g) for g in group_starts if b0 < g < b1}
    return sorted(cuts)


def _pending_columns(w: np.ndarray, sequence: np.ndarray, bg: int) -> mx.array:
    """GPTQ's columns in processing order, channel ``sequence[p]`` of ``w`` (``[B, R, k]``) at position ``p``, as
    MLX's ``[bg, k, B/bg * R]``: for one shared factor (``bg`` 1) the banks side by side in each column, else one
    bank per factor. The banks of several options of one weight are one weight broadcast: read once.

    Written by numpy into the MLX array's own buffer, :data:`TRANSPOSE_ROWS` rows at a time (gathered within the
    rows, then transposed while they are in the cache). Why: MLX's transposed and gathered copies on the CPU cost
    13-19 ns a value, 2.0 s at 8,192 x 8,192 with act order; the updates then read the columns contiguously."""
    nb, rows, k = w.shape
    one = bg == 1 and nb > 1 and w.strides[0] == 0  # np.broadcast_to of one weight
    natural = np.array_equal(sequence, np.arange(k))
    out = mx.zeros((bg, k, nb // bg * rows), dtype=mx.float32)
    mx.eval(out)
    view = np.asarray(out)  # a writable view of the new array's buffer: nothing else holds it yet

    def write_columns(piece: tuple[int, int]) -> None:  # numpy's operators: benchmarks/scale.py counts it as numpy
        b, r0 = piece
        f, at = (b, 0) if bg > 1 else (0, b * rows)  # its factor's slot and its first row there
        r1 = min(rows, r0 + TRANSPOSE_ROWS)
        part = w[b, r0:r1] if natural else np.take(w[b, r0:r1], sequence, axis=1)
        if one:  # transposed once, then copied to every bank's place
            part = np.ascontiguousarray(part.T)
            for j in range(nb):
                view[0, :, j * rows + r0 : j * rows + r1] = part
        else:
            view[f, :, at + r0 : at + r1] = part.T

    # numpy's gathers and copies release the GIL: the pieces (disjoint rows of the buffer) run on worker threads
    pieces = [(b, r0) for b in range(1 if one else nb) for r0 in range(0, rows, TRANSPOSE_ROWS)]
    for _ in map_ahead(write_columns, pieces):
        pass
    return out


@mx.compile
def _damped_sums(w: mx.array, assumed: mx.array, added: mx.array) -> mx.array:
    """Per bank and row, ``sum_c added_c (w_c - assumed_c)^2`` over channels (axis 1) of ``[B or 1, C, R]`` arrays;
    compiled: one fused pass, 2x numpy's einsum here and 8x MLX's uncompiled ops."""
    d = w - assumed
    return (d * d * added).sum(1)


def _output_error_rows(esq: np.ndarray, w: np.ndarray, assumed: np.ndarray, order: np.ndarray, porder: np.ndarray,
                       factor: HessianFactor) -> np.ndarray:
    """Per bank and output row, ``d H d^T`` for the quantization error ``d`` (undamped ``H``), from GPTQ's own errors.

    GPTQ leaves ``W - Q = E U`` with ``H_damped^-1 = U^T U``, so ``(W-Q) H_damped (W-Q)^T = E E^T``:
    the row's sum of ``e^2`` less what damping added, ``sum_j added_j d_j^2``. Exact up to float
    rounding, and it costs ``rows x in`` instead of the ``rows x in^2`` of multiplying by the Gram.
    """
    k = w.shape[-1]
    added = np.empty(factor.added.shape, dtype=np.float32)
    added[:, porder] = factor.added  # storage order
    damped = np.zeros_like(esq)
    stored = np.array_equal(order, np.arange(k))  # the channels in their own order: a slice, not a gather
    src = w[:1] if w.strides[0] == 0 else w  # the banks of several options of one weight: one weight broadcast

    def part(c0: int) -> mx.array:  # channels c0 to c0 + ERROR_CHANNELS: float32 sums of that many terms at most
        c1 = min(k, c0 + ERROR_CHANNELS)
        # (mx.array of a non-contiguous numpy slice copies element by element: many times slower than a contiguous one)
        wc = mx.array(np.ascontiguousarray(src[:, :, c0:c1]) if stored else np.take(src, order[c0:c1], axis=2))
        return _damped_sums(wc.transpose(0, 2, 1), mx.array(np.ascontiguousarray(assumed[:, c0:c1])),
                            mx.array(added[:, c0:c1, None]))  # map_ahead evaluates it, as MLX's work

    for p in map_ahead(part, range(0, k, ERROR_CHANNELS)):  # bounded temporaries, on worker threads from the main one
        damped += np.asarray(p, dtype=np.float64)  # added in float64, in channel order whatever the thread
    return esq - damped


def gptq_quantize(
    w: mx.array | np.ndarray,
    option: QuantOption,
    gram: mx.array | np.ndarray,
    *,
    damp: float = DEFAULT_DAMP,
    block_size: int = 128,
    act_order: bool = True,
    clip: bool = True,
    weighted_scales: bool = True,
    scale_weight: str = "diag",
    error_stats: bool = True,
    factor_cache: dict | None = None,
    natural_order: bool = False,
) -> QuantizedTensor:
    """Quantize ``w`` with ``option`` by GPTQ error compensation against the input Gram ``gram``.

    ``w``: ``[out, in]`` or expert bank ``[E, out, in]``. ``gram``: ``X^T X``
    of the inputs this tensor sees, ``[in, in]`` (a bank with one shared
    Hessian: one factorisation for all experts) or ``[E, in, in]`` (per
    expert). For sequential quantization pass the Gram of the inputs produced
    by the already-quantized earlier layers. ``damp`` adds ``damp *
    mean(diag(H))`` to the diagonal; ``scale_weight`` weights the scale search
    (see :func:`gptq_core`). ``factor_cache``: a dict kept by the caller for
    one Gram matrix; the factorised Hessian is stored there and reused by
    later calls with other options (all act-ordered options share it). The result is an ordinary
    :class:`~mlx_dq.quant.affine.QuantizedTensor` (uniform options: natural channel
    order, stock-MLX loadable; mixed options: act-order permutation). Its
    ``stats`` carry the settings, timing and (``error_stats``) the relative
    output error from ``gram`` and the weight error.
    """
    if option.keep16:
        return quantize_weight(mx.array(w) if isinstance(w, np.ndarray) else w, option)
    return gptq_quantize_many(w, [option], gram, damp=damp, block_size=block_size, act_order=act_order, clip=clip,
                              weighted_scales=weighted_scales, scale_weight=scale_weight, error_stats=error_stats,
                              factor_cache=factor_cache, natural_order=natural_order)[0]


def batch_key(option: QuantOption, in_f: int, act_order: bool = True, natural_order: bool = False) -> tuple:
    """Options with equal keys can share one GPTQ pass: same channel order, group sizes and group placement."""
    kind = ("mixed", natural_order) if option.is_mixed else ("uniform", act_order)
    return kind, tuple((g0, gs) for g0, gs, _ in _group_layout(option, in_f))


def gptq_quantize_many(
    w: mx.array | np.ndarray,
    options: Sequence[QuantOption],
    gram: mx.array | np.ndarray,
    *,
    damp: float = DEFAULT_DAMP,
    block_size: int = 128,
    act_order: bool = True,
    clip: bool = True,
    weighted_scales: bool = True,
    scale_weight: str = "diag",
    error_stats: bool = True,
    factor_cache: dict | None = None,
    natural_order: bool = False,
) -> list[QuantizedTensor]:
    """:func:`gptq_quantize` of one weight with several options of one :func:`batch_key`, in one pass.

    The options are stacked on GPTQ's bank axis (one Hessian factor, one loop over
    the columns), which saves the per-column and per-group overhead that dominates
    small tensors; every result equals that of its own :func:`gptq_quantize` call.
    A single option may be any option (expert banks included); several need a 2-D
    weight (or a bank with one shared Hessian).
    """
    t0 = time.perf_counter()
    shape = tuple(int(d) for d in w.shape)
    options = list(options)
    if not options or any(o.keep16 for o in options):
        raise ValueError("gptq_quantize_many needs one or more quantized (not 16-bit) options")
    if gram is None:
        raise ValueError("gptq_quantize needs the Gram matrix X^T X of the tensor's inputs")
    wm = mx.array(w) if isinstance(w, np.ndarray) else w
    factored = gram if isinstance(gram, FactoredGram) else None  # consumed by its factor: diagonal and shape only
    gm = None if factored else mx.array(gram) if isinstance(gram, np.ndarray) else gram
    w3, g3 = _as_banks(wm, gm) if factored is None else (_as_banks(wm, None)[0], None)
    if factored is not None and (factored.shape[-1] != shape[-1] or w3.shape[0] != 1 or error_stats):
        raise ValueError(f"a consumed Gram matrix of shape {factored.shape} for a weight of shape {shape}"
                         + (" (error_stats needs the Gram itself)" if error_stats else ""))
    in_f = shape[-1]
    for option in options:
        if not option.fits(in_f):
            raise ValueError(f"option {option.desc} does not fit a tensor with {in_f} input channels")
    if len({batch_key(o, in_f, act_order, natural_order) for o in options}) > 1:
        raise ValueError("options quantized in one GPTQ pass need the same channel order and group layout: "
                         + ", ".join(o.desc for o in options))
    w32 = w3 if w3.dtype == mx.float32 else w3.astype(mx.float32)
    mx.eval(w32, *([] if g3 is None else [g3]))  # MLX's work as MLX's (a profile then does not count it as numpy's)
    wnp = np.asarray(w32)  # a view: GPTQ reads, never writes
    gnp = factored if factored is not None else np.asarray(g3)  # a view: GPTQ only reads it (a copy: 822 MB at 14,336)
    n_exp, out_f = wnp.shape[0], wnp.shape[1]
    folded = gnp.shape[0] == 1 and n_exp > 1
    if folded:  # one Hessian for every expert: experts are just more rows
        wnp = wnp.reshape(1, n_exp * out_f, in_f)
    if len(options) > 1:
        if wnp.shape[0] != 1:
            raise ValueError("several options in one GPTQ pass need a 2-D weight or one shared Hessian")
        wnp = np.broadcast_to(wnp, (len(options),) + wnp.shape[1:])

    mixed = options[0].is_mixed
    energy = energy_order(in_f, g3) if factored is None else factored.order
    if mixed:  # the processing order is also the segment assignment and the stored permutation
        order, process, static = (np.arange(in_f) if natural_order else energy), None, False
    elif act_order:
        order, static = np.arange(in_f), True
        process = energy
    else:
        order, process, static = np.arange(in_f), None, False
    factor = None
    if factor_cache is not None:
        seq = order if process is None else order[process]
        key = _factor_key(damp, gnp.shape[0], seq)
        factor = factor_cache.get(key)
        if factor is None:
            factor = factor_cache[key] = factor_hessian(gnp, seq, damp)
    res = gptq_core(
        wnp,
        gnp,
        options if len(options) > 1 else options[0],
        order,
        factor=factor,
        static_groups=static,
        process_order=process,
        damp=damp,
        block_size=block_size,
        clip=clip,
        weighted_scales=weighted_scales,
        scale_weight=scale_weight,
    )
    seconds = (time.perf_counter() - t0) / len(options)
    out = []
    for i, option in enumerate(options):
        bank = slice(None) if len(options) == 1 else slice(i, i + 1)
        qt = _to_quantized(res, bank, option, shape, in_f, mixed)
        qt.out_sq = res.out_sq[bank].reshape(shape[:-1])
        clipped = res.clipped if len(options) == 1 else int(res.clipped[i])
        qt.stats = {
            "method": "gptq",
            "damp": damp,
            "extra_damp": res.extra_damp,
            "clipped_fraction": clipped / float(np.prod(shape)),
            "act_order": bool(act_order or mixed),
            "static_groups": static,
            "clip": clip,
            "weighted_scales": weighted_scales,
            "scale_weight": scale_weight,
            "hessian": "per_expert" if (len(shape) == 3 and not folded) else "shared",
            "seconds": seconds,
        }
        if error_stats:
            wq = mx.array(res.assumed[bank][:, :, np.argsort(order)].reshape(shape).astype(np.float32))
            qt.stats["output_error"] = output_error(wm, wq, gm)
            qt.stats["weight_error"] = weight_error(wm, wq)
        out.append(qt)
    return out


def _to_quantized(res: GPTQResult, bank: slice, option: QuantOption, shape: tuple[int, ...], in_f: int,
                  mixed: bool) -> QuantizedTensor:
    """The packed :class:`~mlx_dq.quant.affine.QuantizedTensor` of GPTQ's banks ``bank`` for ``option``."""
    perm = res.order.astype(np.uint16 if perm_bits(in_f) == 16 else np.uint32) if mixed else None
    qt = QuantizedTensor(option, shape, perm=perm)
    lead = (shape[0],) if len(shape) == 3 else ()
    out_f = shape[-2]
    start = gstart = 0
    for seg, k in zip(option.segments, option.split(in_f)):
        if k == 0:
            continue
        ng = k // seg.group_size
        codes = res.codes[bank, :, start : start + k].reshape(*lead, out_f, k)
        sc = res.scales[bank, :, gstart : gstart + ng].reshape(*lead, out_f, ng)
        bi = res.biases[bank, :, gstart : gstart + ng].reshape(*lead, out_f, ng)
        qt.parts.append((pack_codes_mx(codes, seg.bits), mx.array(sc), mx.array(bi)))
        qt.widths.append(k)
        qt.bits.append(seg.bits)
        qt.group_sizes.append(seg.group_size)
        start += k
        gstart += ng
    return qt
