"""One tensor's options measured: each fitting option quantized with the converter's quantizer and metered.

The records hold every option's output error, weight error, storage bits and clip statistics, and (for the
head) its end-to-end damage.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np
from tqdm import tqdm

from mlx_dq.measure.meter import ErrorMeter, looked_up_rows, output_row_sample
from mlx_dq.measure.records import TensorRecord
from mlx_dq.model.capture import InputStats
from mlx_dq.quant.affine import QuantizedTensor
from mlx_dq.quant.dispatch import (
    join_rows,
    option_quantizer,
    quantize_rows,
    quantized_blocks,
)
from mlx_dq.quant.gptq import FactoredGram, can_consume, consume_gram
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.spec import QuantizerSpec
from mlx_dq.safety import check_finite_weight

REFERENCE_OPTION = "1.0:3b_64g"  # the option each tensor's importance is measured at


def fitting_options(options: Sequence[QuantOption], in_features: int) -> list[QuantOption]:
    """The options measured for a tensor with ``in_features`` input channels (16-bit when none fits)."""
    return [o for o in options if o.fits(in_features)] or [QuantOption.fp16()]


def reference_option(options: Sequence[QuantOption], in_features: int, ref: str = REFERENCE_OPTION) -> QuantOption:
    """The reference option for importance: ``ref`` when it fits, else the fitting option nearest in bpw."""
    want = QuantOption.parse(ref)
    if want.fits(in_features):
        return want
    fitting = [o for o in options if not o.keep16 and o.fits(in_features)]
    if not fitting:
        return QuantOption.fp16()
    return min(fitting, key=lambda o: (abs(o.nominal_bpw() - want.nominal_bpw()), o.desc))


@dataclass(frozen=True)
class HowToMeasure:
    """How :func:`measure_tensor` measures a tensor beyond its quantizer: which options, which rows, what it reports.

    ``progress``: a bar over the options. ``only`` (option descriptions) measures just those (one rank's share).
    ``sample_rows > 0`` measures a linear layer's options on a seeded random subset of that many output rows (see
    :func:`output_row_sample`); options in ``kept`` are still quantized on every row. ``timings`` (a dict) receives
    each measured option's wall seconds, which balance the work of later layers over ranks. ``sample`` (row indices,
    row weights) gives the rows instead (``damage_fn`` then gets those rows' dequantized weights). ``energy``: every
    output row's ``w_i G w_i^T`` when known (the sample and the meter use it). ``consume_gram``: ``stats.gram`` is
    this tensor's alone, read by nothing else afterwards (see :func:`_consumed`). Why one value: each caller sets
    a few of these, and the call stays short.
    """

    progress: bool = False
    only: set[str] | None = None
    sample_rows: int = 0
    timings: dict[str, float] | None = None
    sample: tuple[mx.array, mx.array] | None = None
    energy: mx.array | np.ndarray | None = None
    consume_gram: bool = False


def measure_tensor(
    key: str,
    w: mx.array,
    options: Sequence[QuantOption],
    stats: InputStats | None,
    role: str,
    *,
    spec: QuantizerSpec,
    lookup: InputStats | None = None,
    kept: dict[str, mx.array] | None = None,
    damage_fn: Callable[[mx.array], float] | None = None,
    how: HowToMeasure = HowToMeasure(),
) -> TensorRecord:
    """Record every fitting option's output error, weight error, bits and clip stats for one tensor.

    ``stats`` holds the Gram matrix of the tensor's inputs (a linear layer or tied head); ``lookup`` the token
    counts of an embedding used as a lookup table. ``spec`` is the converter's quantizer ("gptq": error
    compensation against the Gram matrix, so the errors are the ones conversion produces; "rtn": rounding, plus
    the clip search when ``spec.clip``). When ``kept`` is a dict whose keys name options, their quantized tensors
    are stored in it (:meth:`~mlx_dq.quant.affine.QuantizedTensor.stored`); ``damage_fn(wq)`` when given measures
    each option's end-to-end damage. ``how``: the rows, options and reports (:class:`HowToMeasure`)."""
    sample, energy, timings = how.sample, how.energy, how.timings
    check_finite_weight(key, w)
    shape = tuple(int(d) for d in w.shape)
    gram = stats.gram if stats is not None else None
    counts = lookup.token_counts if lookup is not None and gram is None else None
    if sample is None and damage_fn is None:
        sample = output_row_sample(key, w, gram, how.sample_rows, energy=energy) if gram is not None else \
            looked_up_rows(counts) if counts is not None and not kept else None
    rows_idx, row_weights = sample if sample is not None else (None, None)
    w_full, w = w, w if rows_idx is None else w[rows_idx]
    counts = counts[np.asarray(rows_idx)] if counts is not None and rows_idx is not None else counts
    meter = ErrorMeter(w, gram, counts, row_weights, None if energy is None else
                       np.asarray(energy, dtype=np.float64)[slice(None) if rows_idx is None else np.asarray(rows_idx)])
    rec = TensorRecord(key, shape, role=role)
    every = fitting_options(options, shape[-1])
    fitting = [o for o in every if how.only is None or o.desc in how.only]
    factors: dict = {}
    in_kept = [o for o in fitting if kept is not None and o.desc in kept]
    gram = _consumed(stats, meter, fitting, kept, factors, spec, energy) if how.consume_gram else gram
    # the converter's quantizer, options batched as in one process whatever this rank's share (the same rounding)
    quantized = option_quantizer(w, [o for o in every if kept is None or o.desc not in kept], gram, spec,
                                 factor_cache=factors, only={o.desc for o in fitting})
    for opt in tqdm(fitting, desc=key, unit="option", disable=not how.progress, leave=False):
        t_opt = time.perf_counter()
        damage = None
        if meter.blocks is not None:  # a large tensor: quantized, metered and its damage taken block by block
            wq, qt, err, werr, clip_stats, damage = _measure_in_blocks(w, opt, gram, meter, spec, factors,
                                                                       damage_fn, keep=opt in in_kept)
        else:
            if opt in in_kept:  # every row, a block of rows at a time; dequantized in the scales' dtype (exact)
                qt = quantize_rows(w_full, opt, gram, spec, factor_cache=factors)
            else:
                t_q = time.perf_counter()
                qt, share = quantized(opt)
                t_opt += (time.perf_counter() - t_q) - share  # this option's share of a batch's time
            picked = qt.rows(rows_idx) if rows_idx is not None and opt in in_kept else qt  # the sampled rows alone
            wq = picked.dequantize(qt.dtype if opt in in_kept else mx.float32)
            err, werr = meter(wq, picked.out_sq)
            clip_stats = {k: float(qt.stats[k]) for k in ("clipped_fraction", "clip_improvement") if k in qt.stats}
        damage = damage_fn(wq) if damage_fn is not None and damage is None else damage
        rec.add_option(opt, err, weight_err=werr, clip=clip_stats or None, damage=damage)
        if opt in in_kept:
            kept[opt.desc] = qt.stored()
        if timings is not None:
            timings[opt.desc] = time.perf_counter() - t_opt
    if rows_idx is not None:
        rec.extra["sampled_rows"] = int(rows_idx.shape[0])
    rec.extra.update(_input_facts(key, stats, lookup))
    return rec


def _consumed(stats: InputStats, meter: "ErrorMeter", fitting: list[QuantOption], kept: dict | None,
              factors: dict, spec: QuantizerSpec, energy: Any) -> Any:
    """The Gram matrix of ``stats`` factorised in its own buffer into ``factors`` when every option is GPTQ's with
    that factor (GPTQ, the rows' energies given, a 2-D float32 Gram, every option ``kept`` among ``fitting``);
    then ``stats.gram`` and the meter hold the stand-in (diagonal and shape, :class:`~mlx_dq.quant.gptq.FactoredGram`),
    so anything still needing the Gram fails loudly. Why: the Gram and its factor were two ``k x k`` arrays
    through a tensor's options (822 MB each at Llama-3-8B's ``down_proj``, 3.3 GB at 70B's)."""
    gram = stats.gram
    kept_ok = kept is None or set(kept) <= {o.desc for o in fitting}
    if not (spec.method == "gptq" and energy is not None and can_consume(gram) and meter.w.ndim == 2 and kept_ok):
        return gram
    stats.gram = meter.g = consume_gram(gram, factors, spec)
    return stats.gram


def _input_facts(key: str, stats: InputStats | None, lookup: InputStats | None) -> dict[str, Any]:
    """What a tensor's record says about its inputs: energy, rows, shared inputs, lookup-table errors."""
    if stats is not None:
        shared = [p for p in stats.group if p != key]
        return {"act_energy": _energy_summary(stats), "input_rows": int(stats.rows),
                **({"shares_input_with": shared} if shared else {})}
    return {"input_rows": int(lookup.rows), "err_kind": "lookup"} if lookup is not None else {}


def _energy_summary(stats: InputStats) -> dict[str, float]:
    """Compact activation-energy figures from the Gram diagonal (what act-order sorts by)."""
    g = stats.gram
    diag = np.asarray(g.diag.sum(0) if isinstance(g, FactoredGram) else
                      mx.diagonal(g, axis1=-2, axis2=-1).reshape(-1, g.shape[-1]).sum(0), dtype=np.float64)
    total = float(diag.sum())
    if total <= 0:
        return {"top1pct": 0.0, "top10pct": 0.0, "max_over_mean": 0.0}
    s = np.sort(diag)[::-1]
    k1, k10 = max(1, math.ceil(0.01 * s.size)), max(1, math.ceil(0.10 * s.size))
    return {
        "top1pct": round(float(s[:k1].sum() / total), 6),
        "top10pct": round(float(s[:k10].sum() / total), 6),
        "max_over_mean": round(float(s[0] / (total / s.size)), 4),
    }


def _measure_in_blocks(w: mx.array, opt: QuantOption, gram: mx.array | None, meter: ErrorMeter,
                       spec: QuantizerSpec, factors: dict, damage: Any = None, keep: bool = False
                       ) -> tuple[mx.array | None, QuantizedTensor | None, float, float, dict, float | None]:
    """One option of a large tensor, quantized and metered per block of output rows
    (see :func:`~mlx_dq.quant.dispatch.row_blocks`).

    Returns the dequantized weight (assembled in one preallocated float32 array, only when ``damage`` needs
    the whole weight), the whole quantized tensor (its blocks joined, only when ``keep``), the errors, the
    clip statistics and the damage when ``damage`` has a ``blocks()`` accumulator
    (see :meth:`~mlx_dq.measure.head_kl.HeadKL.damage_fn`).
    The codes of every row are those of the one-piece quantizer (rows are independent); error
    sums and the clip improvement add the blocks' float32 sums in double precision, so they
    equal the one-piece figures to float rounding.
    """
    shape = tuple(int(d) for d in w.shape)
    acc = damage.blocks() if hasattr(damage, "blocks") else None
    wq_all = mx.zeros(shape, dtype=mx.float32) if damage is not None and acc is None else None
    kept: list[QuantizedTensor] = []
    onum = wnum = base = best = 0.0
    clipped, have = 0, set()
    quantized = quantized_blocks(lambda sl: w[..., sl, :], meter.blocks, opt, gram, spec,
                                 factor_cache=factors)  # the converter's quantizer, blocks ahead on worker threads
    for i, (qt, sl) in enumerate(zip(quantized, meter.blocks)):
        wb = w[..., sl, :]
        wq = qt.dequantize(mx.float32)
        o, w_ = meter.partial(i, wq, qt.out_sq)
        onum, wnum = onum + o, wnum + w_
        st = qt.stats
        if "clipped_fraction" in st:  # back to a count: exact (the fraction is count / size)
            clipped += round(st["clipped_fraction"] * math.prod(int(d) for d in wb.shape))
            have.add("clipped_fraction")
        if "clip_improvement" in st:
            base, best = base + st["clip_base_err"], best + st["clip_best_err"]
            have.add("clip_improvement")
        if wq_all is not None:
            wq_all[..., sl, :] = wq  # in place: the array's only reference
            mx.eval(wq_all)
        if acc is not None:
            acc.add(i, sl, wq)
        if keep:
            mx.eval(*[a for p in qt.parts for a in p])
            kept.append(qt.stored())
        del qt, wq
    err, werr = meter.result(onum, wnum)
    stats = {}
    if "clipped_fraction" in have:
        stats["clipped_fraction"] = clipped / float(np.prod(shape))
    if "clip_improvement" in have:
        stats["clip_improvement"] = 1.0 - best / base if base > 0 else 0.0
    return wq_all, join_rows(kept) if keep else None, err, werr, stats, acc.value() if acc is not None else None
