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

Group parameters come from :func:`mlx_dq.quant.scale_search.choose_group_params` (range
shrinking and, with ``weighted_scales``, a refinement under the input-energy weighted error). Codes are
computed against the rounded 16-bit scales and biases, and the value GPTQ
feeds back is exactly what ``mx.dequantize`` returns for the stored triple on
MLX's CPU backend (:func:`mlx_dq.quant.storage.dequantize`; Metal's rounding is
not verified here).

This module holds the entry points; the column loop is :mod:`mlx_dq.quant.gptq_core`, the Hessian factor
:mod:`mlx_dq.quant.hessian`, and every knob a :class:`~mlx_dq.quant.spec.QuantizerSpec`.

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

from mlx_dq.quant.affine import (
    QuantizedTensor,
    as_banks,
    output_error,
    quantize_weight,
    weight_error,
)
from mlx_dq.quant.affine import act_order as energy_order
from mlx_dq.quant.gptq_core import GPTQResult, gptq_core, group_layout
from mlx_dq.quant.hessian import FactoredGram, HessianFactor, factor_hessian, factor_key
from mlx_dq.quant.options import QuantOption, perm_bits
from mlx_dq.quant.spec import QuantizerSpec
from mlx_dq.quant.storage import pack_codes_mx

_DEFAULT = QuantizerSpec()


def gptq_quantize(
    w: mx.array | np.ndarray,
    option: QuantOption,
    gram: mx.array | np.ndarray,
    spec: QuantizerSpec | None = None,
    *,
    error_stats: bool = True,
    factor_cache: dict | None = None,
) -> QuantizedTensor:
    """Quantize ``w`` with ``option`` by GPTQ error compensation against the input Gram ``gram``.

    ``w``: ``[out, in]`` or expert bank ``[E, out, in]``. ``gram``: ``X^T X``
    of the inputs this tensor sees, ``[in, in]`` (a bank with one shared
    Hessian: one factorisation for all experts) or ``[E, in, in]`` (per
    expert). For sequential quantization pass the Gram of the inputs produced
    by the already-quantized earlier layers. ``spec`` (:class:`~mlx_dq.quant.spec.QuantizerSpec`) gives the
    damping (``damp * mean(diag(H))`` added to the diagonal), block size, channel order, clip search and scale
    weights; ``spec.promote_mixed`` keeps a mixed option in natural channel order. ``factor_cache``: a dict
    kept by the caller for one Gram matrix; the factorised Hessian is stored there and reused by
    later calls with other options (all act-ordered options share it). The result is an ordinary
    :class:`~mlx_dq.quant.affine.QuantizedTensor` (uniform options: natural channel
    order, stock-MLX loadable; mixed options: act-order permutation). Its
    ``stats`` carry the settings, timing and (``error_stats``) the relative
    output error from ``gram`` and the weight error.
    """
    if option.keep16:
        return quantize_weight(mx.array(w) if isinstance(w, np.ndarray) else w, option)
    return gptq_quantize_many(w, [option], gram, spec, error_stats=error_stats, factor_cache=factor_cache)[0]


def batch_key(option: QuantOption, in_f: int, spec: QuantizerSpec | None = None) -> tuple:
    """Options with equal keys can share one GPTQ pass: same channel order, group sizes and group placement."""
    spec = _DEFAULT if spec is None else spec
    kind = ("mixed", spec.promote_mixed) if option.is_mixed else ("uniform", spec.act_order)
    return kind, tuple((g0, gs) for g0, gs, _ in group_layout(option, in_f))


@dataclass
class _Banks:
    """One weight and its Gram as GPTQ works on them: the MLX weight ``wm`` and Gram ``gm`` (None when consumed),
    the Gram as banks ``g3``, and numpy views ``wnp`` ``[B, R, in]`` (experts folded into rows when they share
    one Hessian, options stacked on the bank axis) and ``gnp`` (or the consumed Gram's stand-in)."""

    wm: mx.array
    gm: mx.array | None
    g3: mx.array | None
    wnp: np.ndarray
    gnp: np.ndarray | FactoredGram
    folded: bool


def _as_gptq_banks(w: mx.array | np.ndarray, gram: mx.array | np.ndarray | FactoredGram, options: list[QuantOption],
                   spec: QuantizerSpec, error_stats: bool) -> _Banks:
    """Check ``w``, ``gram`` and ``options`` and lay them out as :class:`_Banks`."""
    shape = tuple(int(d) for d in w.shape)
    if not options or any(o.keep16 for o in options):
        raise ValueError("gptq_quantize_many needs one or more quantized (not 16-bit) options")
    if gram is None:
        raise ValueError("gptq_quantize needs the Gram matrix X^T X of the tensor's inputs")
    wm = mx.array(w) if isinstance(w, np.ndarray) else w
    factored = gram if isinstance(gram, FactoredGram) else None  # consumed by its factor: diagonal and shape only
    gm = None if factored else mx.array(gram) if isinstance(gram, np.ndarray) else gram
    w3, g3 = as_banks(wm, gm) if factored is None else (as_banks(wm, None)[0], None)
    if factored is not None and (factored.shape[-1] != shape[-1] or w3.shape[0] != 1 or error_stats):
        raise ValueError(f"a consumed Gram matrix of shape {factored.shape} for a weight of shape {shape}"
                         + (" (error_stats needs the Gram itself)" if error_stats else ""))
    in_f = shape[-1]
    for option in options:
        if not option.fits(in_f):
            raise ValueError(f"option {option.desc} does not fit a tensor with {in_f} input channels")
    if len({batch_key(o, in_f, spec) for o in options}) > 1:
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
    return _Banks(wm, gm, g3, wnp, gnp, folded)


def _channel_order(mixed: bool, energy: np.ndarray, spec: QuantizerSpec) -> tuple[np.ndarray, np.ndarray | None, bool]:
    """``(order, process_order, static_groups)`` for :func:`~mlx_dq.quant.gptq_core.gptq_core`: mixed options run
    in storage order, which is the energy order (the segment assignment and the stored permutation) unless
    ``spec.promote_mixed`` keeps natural order; uniform options keep natural order, processed in energy order with
    static groups when ``spec.act_order``."""
    natural = np.arange(len(energy))
    if mixed:
        return (natural if spec.promote_mixed else energy), None, False
    if spec.act_order:
        return natural, energy, True
    return natural, None, False


def _cached_factor(factor_cache: dict | None, gnp: np.ndarray | FactoredGram, seq: np.ndarray,
                   damp: float) -> HessianFactor | None:
    """The Hessian factor for ``seq`` from ``factor_cache``, made and stored there when missing (None without a
    cache: the core makes its own)."""
    if factor_cache is None:
        return None
    key = factor_key(damp, gnp.shape[0], seq)
    factor = factor_cache.get(key)
    if factor is None:
        factor = factor_cache[key] = factor_hessian(gnp, seq, damp)
    return factor


def _gptq_stats(res: GPTQResult, i: int, n: int, shape: tuple[int, ...], spec: QuantizerSpec, mixed: bool,
                static: bool, folded: bool, seconds: float) -> dict:
    """The settings, clip count and time of bank ``i`` of ``n`` options."""
    clipped = res.clipped if n == 1 else int(res.clipped[i])
    return {
        "method": "gptq",
        "damp": spec.damp,
        "extra_damp": res.extra_damp,
        "clipped_fraction": clipped / float(np.prod(shape)),
        "act_order": bool(spec.act_order or mixed),
        "static_groups": static,
        "clip": spec.clip,
        "weighted_scales": spec.weighted_scales,
        "scale_weight": spec.scale_weight,
        "hessian": "per_expert" if (len(shape) == 3 and not folded) else "shared",
        "seconds": seconds,
    }


def gptq_quantize_many(
    w: mx.array | np.ndarray,
    options: Sequence[QuantOption],
    gram: mx.array | np.ndarray,
    spec: QuantizerSpec | None = None,
    *,
    error_stats: bool = True,
    factor_cache: dict | None = None,
) -> list[QuantizedTensor]:
    """:func:`gptq_quantize` of one weight with several options of one :func:`batch_key`, in one pass.

    The options are stacked on GPTQ's bank axis (one Hessian factor, one loop over
    the columns), which saves the per-column and per-group overhead that dominates
    small tensors; every result equals that of its own :func:`gptq_quantize` call.
    A single option may be any option (expert banks included); several need a 2-D
    weight (or a bank with one shared Hessian).
    """
    t0 = time.perf_counter()
    spec = _DEFAULT if spec is None else spec
    shape = tuple(int(d) for d in w.shape)
    options = list(options)
    banks = _as_gptq_banks(w, gram, options, spec, error_stats)
    in_f, mixed = shape[-1], options[0].is_mixed
    energy = energy_order(in_f, banks.g3) if banks.g3 is not None else banks.gnp.order
    order, process, static = _channel_order(mixed, energy, spec)
    factor = _cached_factor(factor_cache, banks.gnp, order if process is None else order[process], spec.damp)
    res = gptq_core(banks.wnp, banks.gnp, options if len(options) > 1 else options[0], order, spec,
                    factor=factor, static_groups=static, process_order=process)
    seconds = (time.perf_counter() - t0) / len(options)
    out = []
    for i, option in enumerate(options):
        bank = slice(None) if len(options) == 1 else slice(i, i + 1)
        qt = _to_quantized(res, bank, option, shape, in_f, mixed)
        qt.out_sq = res.out_sq[bank].reshape(shape[:-1])
        qt.stats = _gptq_stats(res, i, len(options), shape, spec, mixed, static, banks.folded, seconds)
        if error_stats:
            wq = mx.array(res.assumed[bank][:, :, np.argsort(order)].reshape(shape).astype(np.float32))
            qt.stats["output_error"] = output_error(banks.wm, wq, banks.gm)
            qt.stats["weight_error"] = weight_error(banks.wm, wq)
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


def can_consume(gram: object) -> bool:
    """Whether :func:`consume_gram` can take ``gram``: an MLX float32 ``[k, k]`` array (the caller also knows that
    nothing else will read it)."""
    return isinstance(gram, mx.array) and gram.ndim == 2 and gram.dtype == mx.float32


def consume_gram(gram: mx.array, factor_cache: dict, spec: QuantizerSpec | None = None) -> FactoredGram:
    """Factor ``gram`` (``[k, k]``, float32, read by nothing else afterwards) for the act-order channel sequence every
    GPTQ option of :func:`gptq_quantize_many` uses (uniform with act order, mixed in energy order), in the Gram's own
    buffer, at ``spec``'s damping, into ``factor_cache``; returns the stand-in to pass as the Gram from then on.

    Why: the Gram and its factor were two ``k x k`` arrays while a tensor's options were measured (822 MB each at
    Llama-3-8B's 14,336-channel ``down_proj`` input, 3.3 GB at 70B's)."""
    damp = (_DEFAULT if spec is None else spec).damp
    mx.eval(gram)
    k = int(gram.shape[-1])
    diag = np.einsum("bii->bi", np.asarray(gram)[None]).astype(np.float32)
    seq = energy_order(k, gram)
    key = factor_key(damp, 1, seq)
    factor_cache[key] = factor_hessian(gram, seq, damp, consume=True)
    return FactoredGram((1, k, k), diag, seq)
