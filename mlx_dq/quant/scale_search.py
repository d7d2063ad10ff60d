"""The per-group scale/bias search: RTN's clip search and GPTQ's weighted refinement.

- :func:`clip_search` per-group range shrinking ("optimal shrinkage") scored
  by output error (diagonal Gram blocks), input-energy-weighted or plain error;
- :func:`refine_group_params` / :func:`choose_group_params` GPTQ's group parameters: MLX's range rule, the clip
  search, then shifted/rescaled ranges and a weighted least-squares refit under the input-energy weighted error
  ``sum_j diag(H)_j (w_j - q_j)^2``.

Every candidate is scored on the values its stored (16-bit) triple dequantizes to
(:mod:`mlx_dq.quant.storage`), so the search optimises what is stored.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import partial
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.quant import storage
from mlx_dq.quant.storage import EPS, affine_params
from mlx_dq.runtime.threads import map_ahead

DEFAULT_CLIP_FACTORS: tuple[float, ...] = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7)
# 2-bit groups gain from shrinking further (docs/quality.md#figures-behind-the-code)
LOW_BIT_CLIP_FACTORS: tuple[float, ...] = DEFAULT_CLIP_FACTORS + (0.65, 0.6, 0.55, 0.5)
CLIP_METRICS = ("block", "diag")
CLIP_RULES = ("edge", "minmax")  # MLX's edge-exact scale, plain min/max scale
BATCH_ELEMENTS = 1 << 22  # candidate x weight elements scored per evaluation by the batched clip search
PARAM_CHUNK = 2**20  # weights per call of the group-parameter search: its candidates' temporaries stay small
DEFAULT_SHIFTS: tuple[float, ...] = (-0.5, -0.25, 0.25, 0.5)  # bias shifts, in quantization steps
DEFAULT_RESCALES: tuple[float, ...] = (0.9, 0.95, 1.05)  # scale multipliers around the range centre


def default_clip_factors(bits: int) -> tuple[float, ...]:
    """Range-shrink factors the clip search tries by default for ``bits``-bit groups."""
    return LOW_BIT_CLIP_FACTORS if bits <= 2 else DEFAULT_CLIP_FACTORS


# --------------------------------------------------------------------------
# the clip search
# --------------------------------------------------------------------------
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
    deq = storage.dequantize(q, scale[..., None], bias[..., None], dtype)
    return _residual_error(deq, target, weight, metric)




def _level_codes(w: mx.array, bias: mx.array, code_scale: mx.array, n_bins: float) -> mx.array:
    """Codes of ``w`` [..., G, g] for per-group ``bias``/``code_scale`` [..., G] (float32 integers)."""
    return storage.codes(w, code_scale[..., None], bias[..., None], n_bins, zero_scales="divide", rounding="shift")


def _level_table(scale: mx.array, bias: mx.array, levels: mx.array, dtype: mx.Dtype) -> mx.array:
    """Every code's dequantized value per group, ``[..., G, levels]``: ``round(round(scale*q) + bias)`` in ``dtype``."""
    return storage.dequantize(levels, scale[..., None], bias[..., None], dtype)


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
            s, b = mx.maximum((hi - lo) / n_bins, EPS), lo
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
    q = storage.codes(w, best_cs[..., None], best_b[..., None], n_bins, zero_scales="divide")
    outside = (w < best_lo[..., None]) | (w > best_hi[..., None])
    return ClipResult(best_s, best_b, q, best_f, best_err, base_err, int(outside.sum().item()))




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
        by_rule = [affine_params(lo, hi, bits) if rule == "edge" else (mx.maximum((hi - lo) / n_bins, EPS), lo)
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
            chosen["codes"] = storage.codes(wc, best_cs[..., None], best_b[..., None], n_bins, zero_scales="divide")
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
# GPTQ's group parameters
# --------------------------------------------------------------------------
def _candidate_parts(w: mx.array, s16: mx.array, b16: mx.array, n_bins: mx.array):
    """Codes of ``w`` [..., G, g] for fp16 ``s16``/``b16`` [..., G] before zero-scale groups are zeroed, and the
    float32 scale, bias and keep mask broadcast over the group.

    Why this shape: the zero-scale test and the safe divisor are made per group, not per weight; a
    per-weight ``where`` made the compiled CPU kernel four times slower. A zero scale gives ``e = b - w``
    whatever the code, so the error needs no masking.
    """
    s = s16.astype(mx.float32)[..., None]
    b = b16.astype(mx.float32)[..., None]
    keep = (s != 0).astype(mx.float32)
    q = storage.codes(w, s, b, n_bins, zero_scales="ignore", rounding="shift")
    return q, s, b, keep


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
    e = storage.dequantize(q, s, b, mx.float32) - w  # unrounded: the weighted search scores float32 levels
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

    Starts from MLX's own range rule; ``clip`` runs :func:`clip_search`
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
