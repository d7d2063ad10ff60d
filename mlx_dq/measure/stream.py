"""The sensitivity measurer: how much each quantization option hurts each tensor.

``measure`` streams a model layer by layer over calibration rows: it embeds the
rows, then for each decoder layer loads only that layer's weights, runs the
layer in float32 through mlx-lm's own code while capturing the inputs of every
linear layer (Gram matrices ``X^T X``, see :mod:`mlx_dq.model.capture`), measures
every option of the tensor's grid role and frees the layer. Peak memory is one
layer plus the hidden states of the calibration rows, independent of depth.

The output error of an option is ``||X(Wq-W)^T||_F / ||X W^T||_F`` on the
captured inputs, computed exactly from the Gram matrix. Errors are made
comparable across layers by an *importance* per tensor, defined so that
``importance * err**2`` predicts the damage of quantizing that tensor:

- ``"residual"`` (default): quantize only that tensor at a reference option
  (``1.0:3b_64g``), rerun its decoder layer on a few rows and take the squared
  change of the layer's residual-stream output relative to the output's
  *robust* energy (channels x median channel energy, see :func:`robust_energy`),
  divided by the tensor's own squared error on those rows. The robust energy
  matters: normalising by the plain norm lets a few "massive activation"
  channels hide the damage of every layer after them. The embedding's lookup
  output is the residual stream at layer 0 (same definition); the head's output
  is the logits (see KL units below).

  Evidence (``benchmarks/measure_importance.py`` on SmolLM2-135M, 35 tensors of
  layers 0/7/15/22/29 at their reference option, KL on 2 x 256 held-out
  tokens): Spearman rank correlation with the end-to-end KL is 0.92 for
  ``importance * err**2``, 0.48 for ``err**2`` alone and 0.57 when the damage is
  taken relative to the plain output norm; the KL / prediction ratio stays
  within 0.20..0.38 for 80% of the tensors. It costs a few reruns of each layer
  on ``importance_rows`` rows (about as long as measuring the options).
- ``"kl"`` (opt-in, needs the whole model in memory): the end-to-end KL
  divergence of the next-token distribution when only that tensor is quantized
  at the reference option, divided by its squared error.
- ``"none"``: importance 1 everywhere.

KL units (``kl_scale``, on by default with ``"residual"``): the residual
damage ranks tensors well but has no common unit with the head, whose error
lands on the logits. So for up to ``KL_SAMPLE_LAYERS`` decoder layers spread
over the depth, the layer's output with all its tensors at the reference
option is carried on through the remaining layers (one extra pass of the
importance rows per carried copy, still one layer in memory) and turned into
a KL divergence at the end; each sampled layer's ``KL / predicted damage``,
interpolated log-linearly over the depth (:func:`depth_kl_scales`), rescales
the importances of every layer to nats (``sum(KL) / sum(predicted)``, the
common scale, is kept for the record and prices the tied lookup side). The
head (or tied embedding/head) is measured end to end: each option's KL on the
importance rows is stored as its ``damage``, which the optimizer uses as is.
With ``sample_rows`` (the default) only two anchor options are run through the
head (:func:`head_anchors`); the others' damage is
the anchor's KL per squared output error times their own squared error on a
row sample (on SmolLM2-135M within -8%..+3% of the measured KL, the same plan
and byte-identical weights at 3.5 bpw). Why measure the head end to end: on
SmolLM2-135M the old unit-less head importance let the optimizer put the
28M-weight tied head at 2 bits at a 3.5 bpw target;
that head alone costs KL 0.67 (GPTQ) while the whole 3.5 bpw model measured
0.67. A tied head's damage adds the lookup side of the same codes: each
lookup table, quantized alone at the reference option, gives a perturbed copy
of the first hidden states that is carried to the logits like a sampled
layer's, so the lookup's KL per squared lookup error is measured end to end
(:func:`_lookup_samples`); an option's lookup damage is that ratio times its
own squared lookup error. It is not small: quantizing only SmolLM2's lookup
costs KL 0.65 at 2 bits, 0.07 at 3 bits; Gemma-3-270M's at 2.8 bpw 0.29,
which the earlier prediction from layer 0's residual energy put at 0.009.
An untied lookup table's importance is the same ratio.

Options are measured with the converter's quantizer by default
(``method="gptq"`` with the clip search), so the optimizer sees the errors
conversion produces: GPTQ lowers the output error by about a quarter at 3 bits
but not evenly across tensors. ``method="rtn"`` measures plain rounding
(``clip`` off by default there: the clip search costs about five times as
long), about three times faster.

Resumable: after each layer the measurement file is written atomically with
``last_module_idx`` and the hidden states are saved next to it
(``<file>.state.safetensors``); a restart continues from the next layer and the
result equals an uninterrupted run.

``measure_module`` is the generic path for any ``mlx.nn.Module``.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import math
import os
import platform
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from mlx_dq.data import calib as calib_mod
from mlx_dq.errors import InputError
from mlx_dq.measure.grids import load_grid
from mlx_dq.measure.records import (
    Measurement,
    TensorRecord,
    load_measurement,
    save_measurement,
)
from mlx_dq.model.capture import GramCollector, InputStats, quantizable_modules
from mlx_dq.model.cpu_forward import cpu_forward
from mlx_dq.model.replay import record_calls, replay
from mlx_dq.model.runner import (  # noqa: F401
    HEAD_CHUNK,
    LayerRunner,
    align_to_source,
    free_module,
    free_table,
    head_logits,
    layer_prefix,
    load_into,
    position_chunks,
    probe_layers,
    record_head_inputs,
)
from mlx_dq.model.sources import HALF_DTYPES, resolve
from mlx_dq.names import layer_index, role_of
from mlx_dq.quant.affine import (
    QuantizedTensor,
    exact_sums,
    output_error,
    quantize_weight,
    relative_error,
)
from mlx_dq.quant.dispatch import (  # noqa: F401  (METHODS re-exported)
    METHODS,
    block_budget,
    join_rows,
    option_quantizer,
    quantize_rows,
    quantized_blocks,
    row_blocks,
    tensor_work,
)
from mlx_dq.quant.gptq import FactoredGram, can_consume, consume_gram
from mlx_dq.quant.options import QuantOption
from mlx_dq.runtime import distributed as dist
from mlx_dq.runtime.distributed import iter_batches
from mlx_dq.runtime.threads import thread_map
from mlx_dq.safety import check_finite_weight, flag
from mlx_dq.settings import IMPORTANCE_MODES, MeasureSettings  # noqa: F401  (IMPORTANCE_MODES re-exported)

DEFAULT_ROWS = MeasureSettings.rows  # the defaults live in mlx_dq.settings; these names stay for scripts
DEFAULT_SEQ_LEN = MeasureSettings.seq_len
DEFAULT_BATCH = MeasureSettings.batch_size
DEFAULT_IMPORTANCE_ROWS = MeasureSettings.importance_rows
REFERENCE_OPTION = "1.0:3b_64g"
KL_SAMPLE_LAYERS = 8  # decoder layers whose joint perturbation is carried to the logits to scale importance to KL
HEAD_SAMPLE_FACTOR = 8  # the head's predicted options are measured on sample_rows x this many rows (+ looked-up ones)
REF_CACHE_BYTES = 128 * 2**20  # reference log-probabilities kept for the head's KL (carried perturbations and
# one-block heads; a larger head's options go block by block); the rest are recomputed
TIMING_KEYS = ("timing",)  # fields that differ between otherwise identical runs


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------
def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


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


def _lookup_error(w: mx.array, wq: mx.array, counts: np.ndarray) -> float:
    """Relative error of embedding lookups weighted by how often each token occurs."""
    c = mx.array(counts.astype(np.float32))[:, None]
    w32 = w.astype(mx.float32)
    d = wq.astype(mx.float32) - w32
    num, den = exact_sums(c * d * d, c * w32 * w32)
    return math.sqrt(num / den)


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


# --------------------------------------------------------------------------
# per-tensor measurement
# --------------------------------------------------------------------------
def _evaluated(a: mx.array) -> mx.array:
    """``a`` evaluated by MLX before numpy reads it, so profiles count the work as MLX's, not numpy's."""
    mx.eval(a)
    return a


def output_energies(w: mx.array, gram: mx.array) -> np.ndarray:
    """Each output row's energy ``w_i G w_i^T`` of a 2-D weight (float64), by blocks of rows: no temporary the size
    of a 151,936-row head."""
    g32 = gram.astype(mx.float32)
    return np.concatenate([np.asarray(_evaluated(((wb @ g32) * wb).sum(1)), dtype=np.float64)
                           for wb in (w[sl].astype(mx.float32) for sl in row_blocks(w.shape) or [slice(None)])])


def output_row_sample(key: str, w: mx.array, gram: mx.array, n: int,
                      must: np.ndarray | None = None,
                      energy: mx.array | np.ndarray | None = None) -> tuple[mx.array, mx.array] | None:
    """A seeded, stratified sample of ``n`` output rows of a 2-D weight and each row's weight; None when not smaller.

    Rounding, the clip search and GPTQ treat output rows independently (the
    Gram matrix is shared, each row's error is its own), so a weighted sum over
    a subset of rows estimates the whole tensor's squared output error at
    ``n / rows`` of the cost. Plain uniform sampling misses the few rows that
    carry most of the output energy in LLMs (massive-activation channels): on
    SmolLM2 it put one ``o_proj`` error 44% off. So the ``n // 4`` rows of
    largest output energy ``w_i G w_i^T`` are always taken (weight 1) and the
    rest are drawn uniformly (weight ``remaining / drawn``). Seeded by the name.
    The rows ``must`` (e.g. the tokens a tied embedding looks up) are taken as
    well, with weight 1, beyond the ``n``. ``energy``: the rows' output energies when the forward recorded
    them (:attr:`~mlx_dq.model.capture.GramCollector.energies`), else they are multiplied out against the Gram.
    """
    rows = int(w.shape[0])
    must = np.unique(np.asarray(must, dtype=np.int64)) if must is not None else np.empty(0, dtype=np.int64)
    if n <= 0 or w.ndim != 2 or gram.ndim != 2 or rows <= n + must.size:
        return None
    energy = output_energies(w, gram) if energy is None else np.asarray(energy, dtype=np.float64)
    by_energy = np.argsort(-energy, kind="stable")
    top = np.concatenate([must, by_energy[~np.isin(by_energy, must)][: n // 4]])
    rest = np.setdiff1d(np.arange(rows), top)
    rng = np.random.default_rng(zlib.crc32(key.encode()))
    drawn = rng.choice(rest, size=n + must.size - top.size, replace=False)
    idx = np.concatenate([top, drawn])
    weights = np.concatenate([np.ones(top.size), np.full(drawn.size, rest.size / drawn.size)])
    order = np.argsort(idx)
    return mx.array(idx[order].astype(np.int32)), mx.array(weights[order].astype(np.float32))


class _ErrorMeter:
    """``wq -> (err, weight_err)`` with the reference energies computed once, row block by row block.

    ``err`` is the relative output error ``sqrt(tr(D G D^T) / tr(W G W^T))`` when a
    Gram matrix is given (per expert ``[E, in, in]`` for banks: a sum over experts),
    the token-frequency-weighted lookup error for an embedding with ``counts``,
    else the weight error. Same formulas as :func:`mlx_dq.quant.affine.output_error`.
    ``row_weights`` (``[rows]``, 2-D weights with a Gram) weights each output row's sums; ``energy``
    (``[rows]``, 2-D) gives the rows' ``w_i G w_i^T``, so ``tr(W G W^T)`` is not multiplied out again.
    Large tensors are summed over blocks of output rows (:func:`row_blocks`, float32
    per block, the blocks added in double precision), so no temporary is the
    size of the tensor; a tensor of one block is computed exactly as in one piece.
    """

    def __init__(self, w: mx.array, gram: mx.array | None, counts: np.ndarray | None,
                 row_weights: mx.array | None = None, energy: np.ndarray | None = None):
        self.w, self.rw = w, None if row_weights is None else row_weights[:, None]
        self.g = None if gram is None else gram.astype(mx.float32)
        self.c = None if counts is None or gram is not None else mx.array(counts.astype(np.float32))[:, None]
        self.blocks = row_blocks(w.shape, block_budget()) if row_weights is None else None
        self.w32 = w.astype(mx.float32) if self.blocks is None else None
        self.wden = self.oden = 0.0
        known = energy is not None and self.g is not None and w.ndim == 2  # the rows' w_i G w_i^T, given
        for i in range(len(self.blocks or [None])):
            if known:
                (wden,) = exact_sums(self._squares(self._w32(i), None))
            else:
                oden, wden = self._sums(i, self._w32(i))
                self.oden += oden
            self.wden += wden
        if known:
            e = np.asarray(energy, dtype=np.float64)
            self.oden = float(np.sum(e if self.rw is None else e * np.asarray(self.rw[:, 0], dtype=np.float64)))

    def _w32(self, i: int) -> mx.array:
        return self.w32 if self.blocks is None else self.w[..., self.blocks[i], :].astype(mx.float32)

    def _c(self, i: int) -> mx.array:
        return self.c if self.blocks is None else self.c[self.blocks[i]]

    def _squares(self, x: mx.array, g: mx.array | None) -> mx.array:
        """The terms of ``sum(x*x)`` or ``sum((x@g)*x)``, each row weighted by ``row_weights`` when given."""
        sq = x * x if g is None else (x @ g) * x
        return sq if self.rw is None else self.rw * sq

    def _sums(self, i: int, x: mx.array) -> tuple[float, float]:
        """The (output, weight) squared sums of block ``i``'s rows ``x``: against the Gram, the token counts or plain."""
        wsq = self._squares(x, None)
        if self.g is not None:
            return exact_sums(self._squares(x, self.g), wsq)
        if self.c is not None:
            return exact_sums(self._c(i) * x * x, wsq)
        (wsum,) = exact_sums(wsq)
        return wsum, wsum

    def partial(self, i: int, wq: mx.array, known: np.ndarray | None = None) -> tuple[float, float]:
        """The (output, weight) squared-error sums of block ``i`` (``wq``: that block's rows; the whole tensor when one).

        ``known``: the rows' squared output errors as the quantizer computed them against this Gram
        (:attr:`~mlx_dq.quant.affine.QuantizedTensor.out_sq`), so only the weight error is computed here."""
        d = wq.astype(mx.float32) - self._w32(i)
        if known is None or self.g is None:
            return self._sums(i, d)
        (wsum,) = exact_sums(self._squares(d, None))
        rw = None if self.rw is None else np.asarray(self.rw[:, 0], dtype=np.float64)
        osum = float(known.sum()) if rw is None else float((known * rw).sum())
        return osum, wsum

    def result(self, onum: float, wnum: float) -> tuple[float, float]:
        """(err, weight_err) from summed squared errors."""
        den = self.oden if self.g is not None or self.c is not None else self.wden
        return relative_error(onum, den), relative_error(wnum, self.wden)

    def __call__(self, wq: mx.array, known: np.ndarray | None = None) -> tuple[float, float]:
        if self.blocks is None:
            return self.result(*self.partial(0, wq, known))
        onum = wnum = 0.0
        for i, sl in enumerate(self.blocks):
            o, w_ = self.partial(i, wq[..., sl, :], None if known is None else known[..., sl])
            onum, wnum = onum + o, wnum + w_
        return self.result(onum, wnum)


def measure_tensor(
    key: str,
    w: mx.array,
    options: Sequence[QuantOption],
    stats: InputStats | None,
    role: str,
    lookup: InputStats | None = None,
    clip: bool = True,
    kept: dict[str, mx.array] | None = None,
    method: str = "rtn",
    damage_fn: Callable[[mx.array], float] | None = None,
    progress: bool = False,
    only: set[str] | None = None,
    sample_rows: int = 0,
    timings: dict[str, float] | None = None,
    sample: tuple[mx.array, mx.array] | None = None,
    energy: mx.array | np.ndarray | None = None,
    consume_gram: bool = False,
) -> TensorRecord:
    """Record every fitting option's output error, weight error, bits and clip stats for one tensor.

    ``stats`` holds the Gram matrix of the tensor's inputs (a linear layer or tied head); ``lookup`` the token
    counts of an embedding used as a lookup table. ``method`` is the converter's quantizer ("gptq": error
    compensation against the Gram matrix, so the errors are the ones conversion produces; "rtn": rounding, plus
    the clip search when ``clip``). When ``kept`` is a dict whose keys name options, their quantized tensors are
    stored in it (:meth:`~mlx_dq.quant.affine.QuantizedTensor.stored`); ``damage_fn(wq)`` when given measures each
    option's end-to-end damage. ``progress``: a bar over the options. ``only`` (option descriptions) measures
    just those (one rank's share). ``sample_rows > 0`` measures a linear layer's options on a seeded random
    subset of that many output rows (see :func:`output_row_sample`); options in ``kept`` are still quantized on every row. ``timings`` (a dict)
    receives each measured option's wall seconds, which balance the work of later layers over ranks.
    ``sample`` (row indices, row weights) gives the rows instead (``damage_fn`` then gets those rows' dequantized
    weights). ``energy``: every output row's ``w_i G w_i^T`` when known (the sample and the meter use it).
    ``consume_gram``: ``stats.gram`` is this tensor's alone, read by nothing else afterwards (see :func:`_consumed`)."""
    check_finite_weight(key, w)
    shape = tuple(int(d) for d in w.shape)
    gram = stats.gram if stats is not None else None
    counts = lookup.token_counts if lookup is not None and gram is None else None
    if sample is None and damage_fn is None:
        sample = output_row_sample(key, w, gram, sample_rows, energy=energy) if gram is not None else \
            looked_up_rows(counts) if counts is not None and not kept else None
    rows_idx, row_weights = sample if sample is not None else (None, None)
    w_full, w = w, w if rows_idx is None else w[rows_idx]
    counts = counts[np.asarray(rows_idx)] if counts is not None and rows_idx is not None else counts
    meter = _ErrorMeter(w, gram, counts, row_weights, None if energy is None else
                        np.asarray(energy, dtype=np.float64)[slice(None) if rows_idx is None else np.asarray(rows_idx)])
    rec = TensorRecord(key, shape, role=role)
    fitting = [o for o in fitting_options(options, shape[-1]) if only is None or o.desc in only]
    factors: dict = {}
    in_kept = [o for o in fitting if kept is not None and o.desc in kept]
    gram = _consumed(stats, meter, fitting, kept, factors, method, energy) if consume_gram else gram
    quantized = option_quantizer(w, [o for o in fitting if o not in in_kept], gram, method=method, clip=clip,
                                 factor_cache=factors)  # the converter's quantizer, options batched
    for opt in tqdm(fitting, desc=key, unit="option", disable=not progress, leave=False):
        t_opt = time.perf_counter()
        damage = None
        if meter.blocks is not None:  # a large tensor: quantized, metered and its damage taken block by block
            wq, qt, err, werr, clip_stats, damage = _measure_in_blocks(w, opt, gram, meter, method, clip, factors,
                                                                       damage_fn, keep=opt in in_kept)
        else:
            if opt in in_kept:  # every row, a block of rows at a time; dequantized in the scales' dtype (exact)
                qt = quantize_rows(w_full, opt, gram, method=method, clip=clip, factor_cache=factors)
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


def _consumed(stats: InputStats, meter: "_ErrorMeter", fitting: list[QuantOption], kept: dict | None,
              factors: dict, method: str, energy: Any) -> Any:
    """The Gram matrix of ``stats`` factorised in its own buffer into ``factors`` when every option is GPTQ's with
    that factor (GPTQ, the rows' energies given, a 2-D float32 Gram, every option ``kept`` among ``fitting``);
    then ``stats.gram`` and the meter hold the stand-in (diagonal and shape, :class:`~mlx_dq.quant.gptq.FactoredGram`),
    so anything still needing the Gram fails loudly. Why: the Gram and its factor were two ``k x k`` arrays
    through a tensor's options (822 MB each at Llama-3-8B's ``down_proj``, 3.3 GB at 70B's)."""
    gram = stats.gram
    kept_ok = kept is None or set(kept) <= {o.desc for o in fitting}
    if not (method == "gptq" and energy is not None and can_consume(gram) and meter.w.ndim == 2 and kept_ok):
        return gram
    stats.gram = meter.g = consume_gram(gram, factors)
    return stats.gram


def looked_up_rows(counts: np.ndarray) -> tuple[mx.array, None] | None:
    """The rows of a lookup table that the calibration tokens use, when not all of them: the lookup error is
    theirs alone (a row never looked up has weight 0), so its options are quantized and metered on those rows
    (about 3% of a 128k vocabulary for 4,096 tokens); the weight error is then theirs too."""
    used = np.flatnonzero(counts > 0)
    return (mx.array(used.astype(np.int32)), None) if 0 < used.size < counts.size else None


def _input_facts(key: str, stats: InputStats | None, lookup: InputStats | None) -> dict[str, Any]:
    """What a tensor's record says about its inputs: energy, rows, shared inputs, lookup-table errors."""
    if stats is not None:
        shared = [p for p in stats.group if p != key]
        return {"act_energy": _energy_summary(stats), "input_rows": int(stats.rows),
                **({"shares_input_with": shared} if shared else {})}
    return {"input_rows": int(lookup.rows), "err_kind": "lookup"} if lookup is not None else {}


def _measure_in_blocks(w: mx.array, opt: QuantOption, gram: mx.array | None, meter: _ErrorMeter, method: str,
                       clip: bool, factors: dict, damage: Any = None, keep: bool = False
                       ) -> tuple[mx.array | None, QuantizedTensor | None, float, float, dict, float | None]:
    """One option of a large tensor, quantized and metered per block of output rows (see :func:`row_blocks`).

    Returns the dequantized weight (assembled in one preallocated float32 array, only when ``damage`` needs
    the whole weight), the whole quantized tensor (its blocks joined, only when ``keep``), the errors, the
    clip statistics and the damage when ``damage`` has a ``blocks()`` accumulator (see :meth:`_HeadKL.damage_fn`).
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
    quantized = quantized_blocks(lambda sl: w[..., sl, :], meter.blocks, opt, gram, method=method, clip=clip,
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


# --------------------------------------------------------------------------
# running the model's own code one layer at a time
# --------------------------------------------------------------------------
def _nll_sum(logits: mx.array, tokens: mx.array) -> float:
    loss = nn.losses.cross_entropy(logits[:, :-1], tokens[:, 1:], reduction="sum")
    return float(loss.item())


def chunked_nll_sum(model: nn.Module, tokens: mx.array, hidden: mx.array, chunk: int = HEAD_CHUNK,
                    flush: Callable[[], None] | None = None) -> float:
    """Summed next-token NLL of ``tokens`` from final hidden states, the head run ``chunk`` positions at a time.

    Equals ``_nll_sum(head_logits(model, tokens, hidden), tokens)`` (norm and head act per
    position) without materialising more than ``[rows, chunk, vocab]`` logits.
    ``flush`` is called after each chunk (a Gram collector watching the head).
    """
    seq = int(tokens.shape[1])
    total = 0.0
    for sl in position_chunks(seq, chunk):
        n_t = min(sl.stop, seq - 1) - sl.start  # positions of this chunk that have a next token
        logits = head_logits(model, tokens[:, sl], hidden[:, sl])
        if n_t > 0:
            loss = nn.losses.cross_entropy(logits[:, :n_t], tokens[:, sl.start + 1:sl.start + 1 + n_t],
                                           reduction="sum")
            total += float(loss.item())
        if flush is not None:
            flush()
        del logits
    return total


# --------------------------------------------------------------------------
# importance
# --------------------------------------------------------------------------
def robust_energy(h: mx.array) -> float:
    """Energy of hidden states ``[..., channels]`` measured as channels x the median channel's energy.

    Unlike the plain sum of squares it ignores the few "massive activation"
    channels that dominate the residual stream's norm in many LLMs (in SmolLM2
    one channel holds ~560x the mean energy from layer 11 on) and that the
    following norms scale away.
    """
    e = np.asarray((h.astype(mx.float32) ** 2).reshape(-1, h.shape[-1]).sum(0), dtype=np.float64)
    return float(np.median(e) * e.size)


def residual_importance(
    layer: nn.Module,
    h: mx.array,
    call: tuple[tuple, dict],
    mods: dict[str, nn.Module],
    refs: dict[str, QuantizedTensor],
    expert_mode: str = "per_expert",
) -> dict[str, dict[str, float]]:
    """Per tensor: squared change of ``layer``'s output when only it uses ``refs[path]``, relative to the output.

    The change is divided by :func:`robust_energy` of the layer's output.
    Returns ``{path: {"damage", "err", "importance"}}`` with ``importance =
    damage / err**2``, both measured on the rows ``h``.

    Each rerun reuses the submodule calls made before the changed tensor's (:mod:`mlx_dq.model.replay`): the same
    values, a fraction of the work for the later tensors of a layer.
    """
    args, kwargs = call
    with GramCollector(mods, expert_mode) as col, record_calls(layer, [mods[p] for p in refs]) as log:
        ref = layer(h, *args, **kwargs)
        mx.eval(ref)
        inputs = col.take_inputs()  # plain linear layers: their error from the inputs, no Gram (in x in) needed
        col.flush()
    energy = robust_energy(ref)
    out = {}
    for path, ref_qt in refs.items():
        mod = mods[path]
        w = mod.weight
        mod.weight = wq = ref_qt.dequantize(ref_qt.dtype)  # exact, not the layer's dtype (bfloat16 would round it)
        try:
            with replay(layer, log, mod) if id(mod) in log.reuse else contextlib.nullcontext():
                y = layer(h, *args, **kwargs)
            damage = exact_sums((y - ref) ** 2)[0] / energy
        finally:
            mod.weight = w
        err = input_error(w, wq, inputs[path]) if path in inputs else output_error(w, wq, col.stats[path].gram)
        out[path] = {"damage": damage, "err": err, "importance": damage / err**2 if err > 0 else 0.0}
    return out


def input_error(w: mx.array, wq: mx.array, x: mx.array) -> float:
    """:func:`~mlx_dq.quant.affine.output_error` from the inputs ``x`` (``[rows, in]``) themselves:
    ``||x (wq - w)^T|| / ||x w^T||``. Why: ``rows x in x out`` multiply-adds instead of the Gram's
    ``rows x in^2`` plus ``out x in^2`` (at Llama-3-70B's 28,672-channel input, 0.5 T instead of 8.4 T)."""
    w32 = w.astype(mx.float32)
    y, d = x @ w32.T, x @ (wq.astype(mx.float32) - w32).T
    return relative_error(*exact_sums(d * d, y * y))


def _perturbed_output(layer: nn.Module, h: mx.array, call: tuple[tuple, dict], mods: dict[str, nn.Module],
                      refs: dict[str, QuantizedTensor]) -> mx.array:
    """``layer``'s output on ``h`` with every tensor in ``refs`` quantized at once (weights restored after)."""
    args, kwargs = call
    saved = {p: mods[p].weight for p in refs}
    try:
        for p, ref_qt in refs.items():
            mods[p].weight = ref_qt.dequantize(ref_qt.dtype)  # exact: the float32 forward promotes it
        y = layer(h, *args, **kwargs).astype(mx.float32)
        mx.eval(y)
    finally:
        for p, w in saved.items():
            mods[p].weight = w
    return y


@mx.compile
def _kl_rows(ref_logp: mx.array, logits: mx.array) -> mx.array:
    """Summed KL(ref || q) over the positions of one row (nats).

    Compiled: the elementwise steps fuse, so fewer ``[positions, vocab]`` float32
    temporaries are live (the same values as the uncompiled expression).
    """
    logp = nn.log_softmax(logits.astype(mx.float32), axis=-1)
    return (mx.exp(ref_logp) * (ref_logp - logp)).sum()


def _add_lookup_damage(head_fn: Callable[[mx.array], float], w: mx.array, lookup: InputStats,
                       importance: float) -> Callable[[mx.array], float]:
    """A tied head's damage: its measured KL plus ``importance * err**2`` of the lookup (token-count weighted).

    The lookup side cannot be measured end to end in the same pass (its effect runs through every layer),
    and it is not small: on SmolLM2-135M quantizing only the lookup at 2 bits costs KL 0.65, at 3 bits 0.07.
    """
    meter = _ErrorMeter(w, None, lookup.token_counts)
    parts: list[float] = []

    def fn(wq: mx.array) -> float:
        parts.append(importance * meter(wq)[0] ** 2)
        return head_fn(wq) + parts[-1]

    fn.lookup_damage = parts  # type: ignore[attr-defined]
    if hasattr(head_fn, "blocks"):
        fn.blocks = lambda: _LookupBlocks(head_fn.blocks(), meter, importance, parts)  # type: ignore[attr-defined]
    return fn


class _LookupBlocks:
    """:func:`_add_lookup_damage`'s sum fed block by block: the head's block KL plus the lookup meter's block sums."""

    def __init__(self, head: "_HeadBlockKL", meter: _ErrorMeter, importance: float, parts: list[float]):
        self.head, self.meter, self.importance, self.parts = head, meter, importance, parts
        self.sums = [0.0, 0.0]

    def add(self, i: int, sl: slice, wq: mx.array) -> None:
        """Row block ``i`` (rows ``sl``; the measurer's row blocks are the meter's) quantized to ``wq``."""
        self.head.add(i, sl, wq)
        o, w_ = self.meter.partial(i, wq)
        self.sums = [self.sums[0] + o, self.sums[1] + w_]

    def value(self) -> float:
        self.parts.append(self.importance * self.meter.result(*self.sums)[0] ** 2)
        return self.head.value() + self.parts[-1]


def _swap_dtype(w: mx.array) -> mx.Dtype:
    """The dtype a quantized stand-in for ``w`` takes in the head: a 16-bit head's is float32 (its values are not
    16-bit numbers), the product being float32 anyway."""
    return mx.float32 if w.dtype in HALF_DTYPES else w.dtype


class _HeadKL:
    """End-to-end KL from the final hidden states of the importance rows: for carried perturbations and head options.

    Two ways through the head. :meth:`kl_many` (carried copies) and :class:`_HeadBlockKL` (head options) go a block
    of vocabulary rows at a time, every position of the block before the next: each block of a 16-bit head is
    widened once per pass, the products have all the positions the logit budget allows, and the reference
    log-normaliser comes from the same pass (online, as in a blocked softmax). :meth:`kl` runs the whole head
    ``chunk`` positions at a time with the reference log-probabilities of the first chunks cached up to
    ``cache_bytes`` (built on first use; the others recomputed). Either way memory stays bounded for any
    vocabulary and number of rows: logits never exceed ``[chunk, vocab]`` floats.
    """

    def __init__(self, model: nn.Module, tokens: mx.array, hidden: mx.array, chunk: int = HEAD_CHUNK,
                 cache_bytes: int = REF_CACHE_BYTES):
        self.model, self.tokens, self.hidden = model, tokens, hidden
        self.chunk, self.cache_bytes = chunk, cache_bytes
        self.chunks = [(r, sl) for r in range(int(tokens.shape[0])) for sl in position_chunks(int(tokens.shape[1]),
                                                                                               chunk)]
        self.ref: list[mx.array | None] | None = None  # the cached reference log-probabilities (kl), when built
        self.cached_bytes = self.recomputed = 0
        self.positions = int(tokens.shape[0]) * int(tokens.shape[1])
        self._norm: tuple[mx.array, mx.array] | None = None  # the reference's maximum and sum per position, flat

    def _ref_cache(self) -> list[mx.array | None]:
        """The reference log-probabilities of the first chunks, up to ``cache_bytes`` (built once)."""
        if self.ref is not None:
            return self.ref
        self.ref, used, per_pos = [], 0, None
        for r, sl in self.chunks:
            lp = None
            if per_pos is None or used + per_pos * (sl.stop - sl.start) <= self.cache_bytes:
                lp = self._ref_logp(r, sl)
                mx.eval(lp)
                per_pos = lp.nbytes // (sl.stop - sl.start)
                if used + lp.nbytes > self.cache_bytes:
                    lp = None
                else:
                    used += lp.nbytes
            self.ref.append(lp)
        self.cached_bytes = used
        self.recomputed = sum(lp is None for lp in self.ref)
        return self.ref

    def _ref_logp(self, r: int, sl: slice) -> mx.array:
        logits = head_logits(self.model, self.tokens[r:r + 1, sl], self.hidden[r:r + 1, sl])
        return nn.log_softmax(logits.astype(mx.float32), axis=-1)

    def kl(self, hidden: mx.array, swap: tuple[nn.Module, mx.array] | None = None) -> float:
        """Mean KL per position when the final hidden states are ``hidden`` (and ``swap=(mod, wq)`` sets a weight)."""
        total = 0.0
        for (r, sl), lp in zip(self.chunks, self._ref_cache()):
            if lp is None:
                lp = self._ref_logp(r, sl)  # with the original weights
            if swap is not None:
                mod, wq = swap
                w = mod.weight
                mod.weight = wq
                try:
                    logits = head_logits(self.model, self.tokens[r:r + 1, sl], hidden[r:r + 1, sl])
                    total += _kl_rows(lp, logits).item()
                finally:
                    mod.weight = w
            else:
                total += _kl_rows(lp, head_logits(self.model, self.tokens[r:r + 1, sl], hidden[r:r + 1, sl])).item()
        return total / self.positions

    def flat(self, hidden: mx.array) -> mx.array:
        """``hidden`` ``[rows, positions, channels]`` as one row: the norm and head act per position."""
        return hidden.reshape(1, self.positions, int(hidden.shape[-1]))

    def spans(self, block_rows: int, vocab: int) -> list[slice]:
        """Position slices of the flat rows for products with ``block_rows`` vocabulary rows: at most
        ``chunk x vocab`` logits each, the bound of a :meth:`kl` call over the whole head."""
        return list(iter_batches(self.positions, max(1, self.chunk * vocab // max(1, block_rows))))

    def blocks(self, mod: nn.Module) -> list[slice]:
        """Blocks of the head's vocabulary rows for :meth:`kl_many` (:func:`row_blocks`' blocks, or one)."""
        w = mod.weight
        return row_blocks(tuple(w.shape)) or [slice(0, int(w.shape[0]))]

    def kl_many(self, mod: nn.Module, hiddens: Sequence[mx.array]) -> list[float]:
        """Mean KL per position for each of ``hiddens`` (final hidden states), in one pass over the head ``mod``'s
        vocabulary blocks; the reference logits' running maximum and sum are kept for :meth:`ref_norm`.

        Per position, with ``r`` the reference logits, ``q`` another's, ``M`` and ``M'`` their running maxima:
        ``S = sum exp(r - M)``, ``D = sum exp(r - M) (r - q)`` and ``S' = sum exp(q - M')`` add up over blocks
        (rescaled when a maximum grows); then ``KL = D / S + (M' - M) + log(S' / S)``. Taking the log of the ratio
        keeps float32's error at the KL's scale, not at ``log(vocabulary)``'s."""
        w = mod.weight
        blocks = self.blocks(mod)
        spans = self.spans(max(b.stop - b.start for b in blocks), int(w.shape[0]))
        hs = [self.flat(self.hidden)] + [self.flat(h) for h in hiddens]
        zeros = mx.zeros((1, self.positions), dtype=self.tokens.dtype)  # the lookup's output is replaced
        new = lambda: [mx.full((c.stop - c.start,), -mx.inf, dtype=mx.float32) for c in spans]  # noqa: E731
        m, s = new(), [mx.zeros((c.stop - c.start,), dtype=mx.float32) for c in spans]
        acc = [(new(), [mx.zeros_like(x) for x in s], [mx.zeros_like(x) for x in s]) for _ in hiddens]  # M', S', D
        try:
            for sl in blocks:
                mod.weight = w[sl].astype(_swap_dtype(w))
                mx.eval(mod.weight)  # widened once for every position
                for c, ps in enumerate(spans):
                    r = head_logits(self.model, zeros[:, ps], hs[0][:, ps])[0]
                    m_new, scale, e, s[c] = _online_ref(m[c], s[c], r)
                    for j, (mq, sq, dot) in enumerate(acc):
                        q = head_logits(self.model, zeros[:, ps], hs[j + 1][:, ps])[0]
                        mq[c], sq[c], dot[c] = _online_other(mq[c], sq[c], dot[c], scale, e, r, q)
                    m[c] = m_new
                    mx.eval(m[c], s[c], *[x[c] for a in acc for x in a])
        finally:
            mod.weight = w
        self._norm = mx.concatenate(m), mx.concatenate(s)
        m_all, s_all = self._norm
        return [((mx.concatenate(d) / s_all + (mx.concatenate(mq) - m_all) + mx.log(mx.concatenate(sq) / s_all))
                 .sum().item()) / self.positions for mq, sq, d in acc]

    def ref_norm(self, mod: nn.Module) -> tuple[mx.array, mx.array]:
        """The reference logits' maximum ``M`` and ``sum exp(r - M)`` per position, flat (one :meth:`kl_many` pass,
        once): ``LSE(r) = M + log S``."""
        if self._norm is None:
            self.kl_many(mod, [])
        return self._norm

    def damage_fn(self, mod: nn.Module) -> Callable[[mx.array], float]:
        """``wq -> KL`` with the head (or tied embedding) weight of ``mod`` replaced by ``wq``.

        Its ``blocks()`` gives the same KL fed one block of vocabulary rows at a
        time (:class:`_HeadBlockKL`), so no dequantized copy of a large head is built.
        """

        def fn(wq: mx.array) -> float:
            return self.kl(self.hidden, swap=(mod, wq.astype(_swap_dtype(mod.weight))))

        fn.blocks = lambda: _HeadBlockKL(self, mod)  # type: ignore[attr-defined]
        return fn


@mx.compile
def _online_ref(m: mx.array, s: mx.array, r: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """One block of reference logits ``r`` ``[positions, rows]`` into the running maximum ``m`` and sum ``s``:
    the new maximum, the rescale factor of the old sums, ``exp(r - max)`` and the new sum."""
    m_new = mx.maximum(m, r.max(-1))
    scale = mx.exp(m - m_new)
    e = mx.exp(r - m_new[:, None])
    return m_new, scale, e, s * scale + e.sum(-1)


def _running_sum_exp(mq: mx.array, sq: mx.array, q: mx.array) -> tuple[mx.array, mx.array]:
    """One block of logits ``q`` ``[positions, rows]`` into a running maximum ``mq`` and ``sum exp(q - max)``."""
    mq_new = mx.maximum(mq, q.max(-1))
    return mq_new, sq * mx.exp(mq - mq_new) + mx.exp(q - mq_new[:, None]).sum(-1)


@mx.compile
def _online_other(mq: mx.array, sq: mx.array, dot: mx.array, scale: mx.array, e: mx.array, r: mx.array,
                  q: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """One block of another's logits ``q`` into its running maximum and ``sum exp(q - max)`` and the running
    ``sum exp(r - M) (r - q)`` (``scale``, ``e``: from :func:`_online_ref`)."""
    return *_running_sum_exp(mq, sq, q), dot * scale + (e * (r - q)).sum(-1)


class _HeadBlockKL:
    """One head option's KL accumulated over blocks of vocabulary rows: memory bounded by the block, not the vocabulary.

    Per position, ``KL(ref || q) = sum_v p_v (r_v - q_v) + LSE(q) - LSE(r)`` with
    ``r``, ``q`` the reference and quantized logits and ``p = softmax(r)``. The
    sum and ``LSE(q)`` (by ``logaddexp``) add up over blocks, so each block's
    original and quantized rows go through the model's own head in one call (the
    two stacked as one weight), for as many positions as the logit budget allows
    (:meth:`_HeadKL.spans`), and its logits are dropped. Why: the whole
    dequantized head was one more float32 copy of the vocabulary x hidden matrix
    (519 MiB at 151,936 x 896), the largest item of the head stage's peak.
    Logit transforms must act per logit (scaling, soft-capping), as in mlx-lm's models.
    """

    def __init__(self, head: _HeadKL, mod: nn.Module):
        self.head, self.mod = head, mod
        self.m_ref, self.s_ref = head.ref_norm(mod)
        self.lse_ref = self.m_ref + mx.log(self.s_ref)
        self.vocab = int(mod.weight.shape[0])
        self.hidden = head.flat(head.hidden)
        self.dot = mx.zeros_like(self.lse_ref)
        self.m_q = mx.full(self.lse_ref.shape, -mx.inf, dtype=mx.float32)
        self.s_q = mx.zeros_like(self.lse_ref)
        self.zeros = mx.zeros((1, head.positions), dtype=head.tokens.dtype)  # ids must fit the stacked rows

    def add(self, i: int, sl: slice, wq: mx.array) -> None:
        """Account for vocabulary rows ``sl`` (row block ``i``) quantized to ``wq``."""
        w, h = self.mod.weight, self.head
        n, dt = int(wq.shape[0]), _swap_dtype(w)
        self.mod.weight = mx.concatenate([w[sl].astype(dt), wq.astype(dt)])
        try:
            for ps in h.spans(2 * n, self.vocab):
                logits = head_logits(h.model, self.zeros[:, ps], self.hidden[:, ps])[0]
                self.m_q[ps], self.s_q[ps], self.dot[ps] = _block_other(
                    self.m_q[ps], self.s_q[ps], self.dot[ps], self.lse_ref[ps], logits[..., :n], logits[..., n:])
                mx.eval(self.dot, self.m_q, self.s_q)
        finally:
            self.mod.weight = w

    def value(self) -> float:
        """Mean KL per position over every block added (all the vocabulary rows)."""
        kl = self.dot + (self.m_q - self.m_ref) + mx.log(self.s_q / self.s_ref)
        return kl.sum().item() / self.head.positions


@mx.compile
def _block_other(mq: mx.array, sq: mx.array, dot: mx.array, lse_ref: mx.array, r: mx.array,
                 q: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """A block of quantized logits ``q`` (reference ``r``) into the running maximum and ``sum exp(q - max)`` of
    ``q`` and the running ``sum p (r - q)``, ``p = exp(r - LSE(r))``."""
    return *_running_sum_exp(mq, sq, q), dot + (mx.exp(r - lse_ref[:, None]) * (r - q)).sum(-1)


# --------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------
def _state_path(path: Path) -> Path:
    return path.with_name(path.name + ".state.safetensors")


def _save_state(path: Path, hidden: mx.array, layer: int, settings: str,
                carried: dict[int, mx.array] | None = None) -> None:
    sp = _state_path(path)
    tmp = sp.with_name(sp.name.replace(".state.safetensors", ".state.tmp.safetensors"))
    arrays = {"hidden": hidden, **{f"carried.{k}": v for k, v in (carried or {}).items()}}
    mx.save_safetensors(str(tmp), arrays, metadata={"layer": str(layer), "settings": settings})
    os.replace(tmp, sp)


def _load_state(path: Path, settings: str) -> tuple[mx.array, int, dict[int, mx.array]] | None:
    sp = _state_path(path)
    if not sp.exists():
        return None
    arrays, meta = mx.load(str(sp), return_metadata=True)
    if meta.get("settings") != settings:
        return None
    carried = {int(k.split(".", 1)[1]): v for k, v in arrays.items() if k.startswith("carried.")}
    return arrays["hidden"], int(meta["layer"]), carried


def strip_timing(doc: dict) -> dict:
    """A measurement JSON document without its timing fields (for comparing runs)."""
    out = dict(doc)
    out["extra"] = {k: v for k, v in (doc.get("extra") or {}).items() if k not in TIMING_KEYS}
    return out


# --------------------------------------------------------------------------
# the streaming measurer
# --------------------------------------------------------------------------
def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("mlx", "mlx-lm", "mlx-dq"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "unknown"
    return out


def _grid_options(grid: dict[str, list[QuantOption]], role: str, key: str) -> list[QuantOption]:
    if role not in grid:
        raise InputError(f"{key}: the grid has no options for role {role!r} (roles: {sorted(grid)})")
    return list(grid[role])


@dataclass
class _Run:
    """The state of one streaming measurement: settings, the runner, the carried activations and the record."""

    s: MeasureSettings
    source: Any
    runner: LayerRunner
    tokens: mx.array
    grid_map: dict
    m: Measurement
    digest: str
    out: Path | None
    progress: bool
    clip: bool
    kl_scale: bool
    n_imp: int
    hidden: Any = None
    start_layer: int = 0
    carried: dict = field(default_factory=dict)  # layer -> importance rows' hidden states with that layer quantized
    sample_layers: set = field(default_factory=set)
    embed_lookup: dict = field(default_factory=dict)
    embed_importance: float = 0.0
    lookup_weight: dict = field(default_factory=dict)  # lookup table -> KL per squared lookup error, end to end
    t_start: float = 0.0
    rates: dict = field(default_factory=dict)  # option -> [seconds, weights] measured so far on every rank


def measure(
    spec_or_source: Any,
    *,
    out_path: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    settings: MeasureSettings | None = None,
    _fail_after_layer: int | None = None,
    **options: Any,
) -> Measurement:
    """Measure every quantizable tensor of a model under every option of its grid role.

    Streams one decoder layer at a time (see the module docstring); writes and
    resumes ``out_path`` when given; returns the in-memory measurement.
    ``options`` are :class:`~mlx_dq.settings.MeasureSettings` fields (or pass
    ``settings``): ``method``/``clip`` choose the quantizer whose errors are
    measured (default: the converter's, GPTQ with the clip search); ``kl_scale``
    puts every importance in KL units and measures the head's options end to end;
    ``head_chunk`` bounds the head's logits to ``[head_chunk, vocab]`` floats at a
    time; ``sample_rows > 0`` measures each linear layer's options on that many
    random output rows (the importance reference on all; the head's two anchor options on
    all and its others on ``HEAD_SAMPLE_FACTOR`` times as many, see :func:`_head_by_anchors`).
    """
    run = _start(spec_or_source, (settings or MeasureSettings()).with_options(**options), out_path, progress)
    old = _resume(run) if resume else None
    if old is not None:
        return old
    with cpu_forward():
        return _measure_all(run, _fail_after_layer)


def _measure_all(run: _Run, _fail_after_layer: int | None) -> Measurement:
    """The stages after the start: embedding, decoder layers (resumable), head; the finished record."""
    _embed(run)
    bar = tqdm(total=len(run.runner.layers), desc="measure", unit="layer", disable=not run.progress,
               initial=run.start_layer)
    for i in range(run.start_layer, len(run.runner.layers)):
        _measure_layer(run, i)
        bar.update(1)
        if _fail_after_layer is not None and i == _fail_after_layer:
            raise RuntimeError(f"simulated interruption after layer {i}")
    bar.close()
    _measure_head(run)
    return _finish(run)


def _start(spec_or_source: Any, s: MeasureSettings, out_path: str | Path | None, progress: bool) -> _Run:
    """Resolve the source, draw the calibration rows, build the runner and the empty measurement record."""
    t_start = time.perf_counter()
    source = resolve(str(spec_or_source)) if isinstance(spec_or_source, (str, Path)) else spec_or_source
    texts, tokens = calib_mod.calibration_rows(source.tokenizer(), s.calib, s.rows, s.seq_len, s.seed)
    grid_map = load_grid(s.grid)
    n_imp = min(s.importance_rows, s.rows)
    share = dist.RowShare(s.rows, s.batch_size, n_imp)  # one rank: every batch, as before
    runner = LayerRunner(source, tokens, s.batch_size, share, s.expert_mode)
    layers = runner.layers
    clip, kl_scale = s.resolved_clip, s.resolved_kl_scale
    m = Measurement(
        model={"spec": str(getattr(source, "spec", spec_or_source)), "model_type": source.config.get("model_type"),
               "num_layers": len(layers), "fingerprint": source.fingerprint()},
        calibration={"source": str(s.calib) if s.calib else "default", "text_digest": calib_mod.text_digest(texts),
                     "rows": s.rows, "seq_len": s.seq_len, "seed": s.seed,
                     "tokens_digest": _digest(np.asarray(tokens).tobytes())},
        grid={"source": str(s.grid) if s.grid else "default",
              "roles": {r: [o.desc for o in opts] for r, opts in sorted(grid_map.items())}},
        versions=_versions(),
        last_module_idx=-1,
    )
    m.extra = {
        "importance": {"method": s.importance, "reference": REFERENCE_OPTION, "rows": n_imp,
                       "predicts": "damage ~ importance * err**2"},
        "expert_gram": s.expert_mode, "clip": clip, "method": s.method, "complete": False,
    }
    if s.sample_rows:  # only when set, so measurements without it keep their settings digest
        m.extra["sample_rows"] = int(s.sample_rows)
    if kl_scale:
        m.extra["importance"]["kl_scale"] = {"samples": [], "lookups": {}}
    digest = _digest(m.model, m.calibration, m.grid, m.extra)
    m.extra["settings_digest"] = digest
    m.extra["timing"] = {"layers_s": [], "total_s": None}
    run = _Run(s, source, runner, tokens, grid_map, m, digest, Path(out_path) if out_path is not None else None,
               progress and dist.is_root(), clip, kl_scale, n_imp, t_start=t_start)
    run.sample_layers = set(np.linspace(0, len(layers) - 1, min(KL_SAMPLE_LAYERS, len(layers)))
                            .round().astype(int).tolist())
    return run


def _resume(run: _Run) -> Measurement | None:
    """Continue from ``run.out`` when it holds this measurement: the finished one, or its state after some layer."""
    out, m = run.out, run.m
    if out is None or not (out.exists() or dist.active()):
        return None
    old = dist.broadcast(load_measurement(out) if dist.is_root() and out.exists() else None)
    if old is None:
        return None
    if old.extra.get("settings_digest") != run.digest:
        raise InputError(
            f"{out} was measured with different settings (model, calibration, grid or importance); "
            f"pass {flag('resume', False)} to overwrite it"
        )
    if old.extra.get("complete"):
        return old
    done_idx = old.last_module_idx if old.last_module_idx is not None else -1
    if dist.active():  # every rank must hold its state of the last layer the file records
        st = dist.load_state(out, done_idx, run.digest, run.runner.share.batches) if done_idx >= 0 else None
        state = (st[0], done_idx, st[1]) if all(dist.gather_objects(st is not None)) else None
    else:
        state = _load_state(out, run.digest)
    if state is not None and state[1] <= done_idx:
        run.hidden, done, run.carried = state
        run.start_layer = done + 1
        keep = tuple(f"{run.runner.prefix}{i}." for i in range(run.start_layer))
        m.tensors = {k: t for k, t in old.tensors.items() if k.startswith(keep)}
        m.last_module_idx = done
        m.extra["timing"] = {k: (v[:run.start_layer] if isinstance(v, list) else v)
                             for k, v in old.extra.get("timing", {}).items()}
        if run.kl_scale:
            m.extra["importance"]["kl_scale"] = old.extra["importance"]["kl_scale"]
    return None


def _embed(run: _Run) -> None:
    """Embed the rows (recording the layers' call arguments) with only the embedding and small non-layer weights
    loaded."""
    runner = run.runner
    runner.load_for_probe()
    embed_mods = {p: mod for p, mod in quantizable_modules(runner.net).items() if isinstance(mod, nn.Embedding)}
    with runner.collector(embed_mods) as embed_col:
        firsts = runner.probe(flush=embed_col.flush)
    run.embed_lookup = dict(embed_col.lookups)
    h0 = mx.concatenate(firsts, axis=0)[:run.n_imp]
    run.embed_importance = float((h0 * h0).sum().item()) / robust_energy(h0)  # without kl_scale: err**2 of the total
    if run.kl_scale:
        _lookup_samples(run, embed_mods)
    if run.hidden is None:
        run.hidden = runner.join(firsts)
    runner.free_outside()  # back for the head stage


def _lookup_samples(run: _Run, embed_mods: dict[str, nn.Module]) -> None:
    """Each lookup table quantized alone at its reference option: the importance rows' first hidden states, kept
    in ``run.carried`` (keys -1, -2, ...) to travel to the logits like a sampled layer's perturbed copy.

    The head stage turns each into the lookup side's KL per squared lookup error (:func:`_lookup_kls`). Why:
    predicted from layer 0's residual energy, Gemma-3-270M's tied lookup at 2.8 bpw was priced at KL 0.009
    where quantizing only the lookup costs 0.29 on calibration-like text, so plans starved the embedding.
    """
    info = run.m.extra["importance"]["kl_scale"]["lookups"]
    if run.start_layer > 0:  # resumed: the copies and their errors are in the saved state and measurement
        return
    tokens = run.tokens[:run.n_imp]
    ids, counts = np.unique(np.asarray(tokens), return_counts=True)
    rows = mx.array(ids)
    for k, path in enumerate(sorted(p for p in embed_mods if p in run.embed_lookup)):
        mod = embed_mods[path]
        w = mod.weight
        ref = reference_option(_grid_options(run.grid_map, role_of(path), path), int(w.shape[-1]))
        wq = quantize_weight(w[rows], ref, clip=run.clip).dequantize(mx.float32).astype(w.dtype)
        info[path] = {"key": -1 - k, "option": ref.desc, "err": _lookup_error(w[rows], wq, counts)}
        if dist.rank() != 0:  # one copy, made and carried on the first rank
            continue
        with _rows_swapped(mod, ids, wq):  # quantization is per row: the looked-up rows are enough
            run.carried[-1 - k] = probe_layers(run.runner.net, tokens)[0]
            mx.eval(run.carried[-1 - k])


@contextlib.contextmanager
def _rows_swapped(mod: nn.Module, ids: np.ndarray, rows: mx.array) -> Iterator[None]:
    """``mod.weight`` with rows ``ids`` replaced by ``rows`` while inside, then the original again.

    A float32 table is changed in its own buffer (the replaced rows kept aside), not copied: at Llama-3-8B's
    128,256 x 4,096 a copy of the table with the rows changed was 2.1 GB (4.2 GB at 70B's width)."""
    w = mod.weight
    mx.eval(w)
    if w.dtype != mx.float32:
        changed = mx.array(w)
        changed[mx.array(ids)] = rows.astype(w.dtype)
        mod.weight = changed
        try:
            yield
        finally:
            mod.weight = w
        return
    table = np.asarray(w)  # a writable view of the table's buffer
    saved = table[ids].copy()
    table[ids] = np.asarray(rows.astype(mx.float32))
    try:
        yield
    finally:
        table[ids] = saved


def _carried_kls(run: _Run, head_kl: "_HeadKL", mod: nn.Module | None) -> dict[int, float]:
    """The KL of every copy this rank carried to the final hidden states (sampled layers and lookup tables), keyed
    as ``run.carried``, which they leave. One pass over the head ``mod``'s vocabulary for all of them
    (:meth:`_HeadKL.kl_many`); each on its own through the whole head when the logits' module is not known."""
    keys = sorted(run.carried)
    hiddens = [run.carried.pop(k) for k in keys]
    if mod is None:
        return {k: head_kl.kl(h) for k, h in zip(keys, hiddens)}
    return dict(zip(keys, head_kl.kl_many(mod, hiddens)))


def _lookup_kls(run: _Run, kls: dict[int, float]) -> dict[str, float]:
    """Each lookup table's KL per squared lookup error, from its copy carried to the final hidden states."""
    info = run.m.extra["importance"].get("kl_scale", {}).get("lookups", {})
    mine = {p: kls[d["key"]] for p, d in info.items() if d["key"] in kls}
    kls = {k: v for part in dist.gather_objects(mine) for k, v in part.items()}
    for path, d in info.items():
        d["kl"] = kls[path]
    return {p: d["kl"] / d["err"] ** 2 if d["err"] > 0 else 0.0 for p, d in info.items()}


def _measure_layer(run: _Run, i: int) -> None:
    """Decoder layer ``i``: collect its inputs, measure every option of its tensors, their importance; save."""
    t0 = time.perf_counter()
    runner, m = run.runner, run.m
    layer = runner.layers[i]
    mods = {p: mod for p, mod in runner.load(i).items() if role_of(p) is not None}
    dist.set_stage(i)
    with runner.collector(mods, output_energy=True) as col:
        new_hidden = runner.forward(i, run.hidden, col)
    t1 = time.perf_counter()
    call0 = runner.calls[0][i]
    for k in run.carried:  # perturbed copies of earlier layers travel on through this one
        run.carried[k] = layer(run.carried[k], *call0[0], **call0[1]).astype(mx.float32)
        mx.eval(run.carried[k])
    records, refs, owner, timings = _measure_options(run, mods, col)
    col.release()  # the Grams are not read again (1 GB at Llama-3-8B shapes): the importance pass records its inputs
    t2 = time.perf_counter()
    _layer_importance(run, i, mods, records, refs, owner, timings)
    run.hidden = new_hidden
    del new_hidden, refs, col
    runner.free(i)
    gc.collect()  # the capture's temporary classes form reference cycles; free this layer's arrays now
    for rec in records:
        m.tensors[rec.key] = rec
    m.last_module_idx = i
    t3 = time.perf_counter()
    m.extra["timing"]["layers_s"].append(round(t3 - t0, 3))
    for name, dt in (("forward_s", t1 - t0), ("options_s", t2 - t1), ("importance_s", t3 - t2)):
        m.extra["timing"].setdefault(name, []).append(round(dt, 3))
    _save_layer(run, i)


def _measure_options(run: _Run, mods: dict[str, nn.Module], col: GramCollector) -> tuple[list, dict, dict, dict]:
    """Every option of every tensor of a layer (this rank's share): records, the reference options' weights for
    importance, the option owners and this rank's option seconds (path -> option -> s)."""
    s = run.s
    records, refs, timings = [], {}, {}
    owner = _share_options(run, mods)  # {} with one rank

    grid = {p: _grid_options(run.grid_map, role_of(p), p) for p in mods}
    refs_opt = {p: reference_option(grid[p], int(mod.weight.shape[-1])) for p, mod in mods.items()}

    def one(path: str, w: mx.array, stats: InputStats | None) -> tuple[TensorRecord, dict]:
        kept = {refs_opt[path].desc: None}
        rec = measure_tensor(path, w, grid[path], stats, role_of(path), clip=run.clip, kept=kept, method=s.method,
                             only=_owned(owner, path), sample_rows=s.sample_rows, timings=timings[path],
                             energy=col.energies.get(path), consume_gram=stats is not None and len(stats.group) <= 1)
        return rec, kept

    for path in mods:
        timings[path] = {}
    measured = thread_map(one, [(p, mod.weight, col.stats.get(p)) for p, mod in mods.items()],
                          cost=lambda p, w, st: tensor_work(w))  # tensors in parallel, the dearest first
    for (path, mod), (rec, kept) in zip(mods.items(), measured):
        opts, ref = grid[path], refs_opt[path]
        records.append(rec)
        if s.importance == "residual" and owner and owner.get(
                (path, ref.desc), owner.get((path, fitting_options(opts, int(mod.weight.shape[-1]))[0].desc))
        ) != dist.rank():
            rec.extra["importance_ref"] = ref.desc  # another rank computes this tensor's importance
        elif s.importance == "residual":
            if kept[ref.desc] is None:  # the reference is not one of the grid's options
                gram = col.stats[path].gram
                kept[ref.desc] = quantize_weight(
                    mod.weight, ref, gram=gram.sum(0) if gram.ndim == 3 else gram, clip=run.clip).stored()
            refs[path] = kept[ref.desc]
            rec.extra["importance_ref"] = ref.desc
    return records, refs, owner, timings


def _layer_importance(run: _Run, i: int, mods: dict[str, nn.Module], records: list, refs: dict,
                      owner: dict, timings: dict) -> None:
    """Residual importance of a layer's tensors, and (sampled layers) the perturbed copy carried to the logits.

    When distributed, also gathers the layer's results and every rank's option ``timings``."""
    s, layer, call0 = run.s, run.runner.layers[i], run.runner.calls[0][i]
    hidden = run.hidden
    imp = {}
    if s.importance == "residual" and refs:
        imp = residual_importance(layer, hidden[:run.n_imp], call0, mods, refs, s.expert_mode)
    if owner:  # gather every rank's options, importances (and the sampled layers' references)
        records[:], imp, refs = dist.gather_layer(
            records, imp, refs if run.kl_scale and i in run.sample_layers else {}, owner, list(mods))
        _learn_rates(run, mods, timings)  # once every rank is past its share
    if s.importance != "residual":
        return
    for rec in records:
        r = imp[rec.key]
        rec.importance = r["importance"]
        rec.extra["importance_detail"] = {"damage": r["damage"], "err": r["err"]}
    if run.kl_scale and i in run.sample_layers:
        if _sample_owner(run, i) == dist.rank():  # each carried copy travels on one rank, in turn
            run.carried[i] = _perturbed_output(layer, hidden[:run.n_imp], call0, mods, refs)
        run.m.extra["importance"]["kl_scale"]["samples"].append(
            {"layer": i, "predicted": sum(imp[p]["damage"] for p in refs)})


def _save_layer(run: _Run, i: int) -> None:
    """Write the measurement and the carried state after layer ``i`` (every rank's state when distributed)."""
    out = run.out
    if out is not None and dist.active():  # a layer is done once every rank has its state
        dist.save_state(out, i, run.hidden, run.digest, run.carried)
        dist.barrier()
        if dist.is_root():
            save_measurement(run.m, out)
        dist.drop_states(out, before=i - 1)
    elif out is not None:
        save_measurement(run.m, out)
        _save_state(out, run.hidden, i, run.digest, run.carried)


def _sample_owner(run: _Run, i: int) -> int:
    """The rank that carries sampled layer ``i``'s perturbed copy to the logits (the samples in turn over ranks)."""
    return sorted(run.sample_layers).index(i) % dist.size()


def _kl_scale(run: _Run, kls: dict[int, float]) -> float:
    """Turn the sampled layers' carried perturbations (``kls``: their KL) into KL and rescale every importance to
    nats; the scale."""
    info = run.m.extra["importance"]["kl_scale"]
    mine = {x["layer"]: kls[x["layer"]] for x in info["samples"] if _sample_owner(run, x["layer"]) == dist.rank()}
    kls = {k: v for part in dist.gather_objects(mine) for k, v in part.items()}
    for sample in info["samples"]:
        sample["kl"] = kls[sample["layer"]]
    pred = sum(x["predicted"] for x in info["samples"])
    info["scale"] = sum(x["kl"] for x in info["samples"]) / pred if pred > 0 else 1.0
    scale = info["scale"]
    by_layer = depth_kl_scales(info["samples"], range(len(run.runner.layers)), scale)
    info["depth"] = "log-linear between the sampled layers' KL / predicted damage"
    for rec in run.m.tensors.values():
        rec.importance *= by_layer.get(layer_index(rec.key), scale)
    return scale


def depth_kl_scales(samples: Sequence[dict], layers: Sequence[int], default: float) -> dict[int, float]:
    """Per decoder layer: KL per unit of predicted damage, log-linear between the sampled layers, flat beyond.

    Why: what a layer's perturbation costs at the logits depends on its depth. One scale for the whole
    model priced Gemma-3-270M's last layers 10-26x too cheap (the sampled layers' KL / predicted ratios
    span 0.37..26 of the common scale), so a 3.5 bpw plan put its last five layers at 2 bits. Samples
    without a positive KL and prediction are left out; with none left every layer gets ``default``.
    """
    pts = sorted((x["layer"], math.log(x["kl"] / x["predicted"])) for x in samples
                 if x.get("kl", 0) > 0 and x.get("predicted", 0) > 0)
    if not pts:
        return {i: default for i in layers}
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return {i: float(math.exp(np.interp(i, xs, ys))) for i in layers}


def _measure_head(run: _Run) -> None:
    """Head and embedding: the final hidden states through the model's own norm and head."""
    s, m, model, tokens, share = run.s, run.m, run.runner.net, run.tokens, run.runner.share
    head_mods = {p: mod for p, mod in run.runner.outside_modules().items() if role_of(p) is not None}
    dist.set_stage("head")
    owner: dict[tuple[str, str], int] = {}
    # an untied embedding is a lookup table (no Gram): measured first, with only itself loaded, then released, so the
    # head's options have the room; its importance takes the KL scale once known
    lookup_only = [p for p in run.runner.lookup_tables() if p in head_mods]
    recs = {}
    for path in lookup_only:
        run.runner.load_outside(only=[path])
        own = _share_options(run, {path: head_mods[path]})  # after loading: the split needs the shape
        owner.update(own)
        recs[path] = _measure_head_tensor(run, path, head_mods[path], None, None, 1.0, own)
        free_table(head_mods[path])
    run.runner.load_outside(skip=lookup_only)
    nlls = []
    with run.runner.collector(head_mods) as head_col:
        for sl in iter_batches(s.rows, 1):  # one row, head_chunk positions at a time: logits are [chunk, vocab]
            if not share.owns_row(sl.start):
                continue
            flush = lambda: share.flush(head_col, sl.start, owned=True)  # noqa: E731
            if sl.start < run.n_imp:  # the base perplexity: the importance rows' logits only
                nlls.append((sl.start, chunked_nll_sum(model, tokens[sl], run.hidden[sl], s.head_chunk, flush=flush)))
            else:  # the other rows feed the head's Gram alone, without a logit
                record_head_inputs(model, tokens[sl], run.hidden[sl], flush, s.head_chunk)
    dist.reduce_stats(head_col)
    nll = 0.0
    for _, v in sorted(x for part in dist.gather_objects(nlls) for x in part):  # row order, as one process sums
        nll += v
    m.base_perplexity = math.exp(nll / (run.n_imp * (s.seq_len - 1)))
    head_kl = _HeadKL(model, tokens[:run.n_imp], run.hidden[:run.n_imp], s.head_chunk) if run.kl_scale else None
    logit_mods = [mod for p, mod in head_mods.items() if head_col.stats.get(p) is not None]
    kls = _carried_kls(run, head_kl, logit_mods[0] if len(logit_mods) == 1 else None) if run.kl_scale else {}
    scale = _kl_scale(run, kls) if run.kl_scale else 1.0
    run.lookup_weight = _lookup_kls(run, kls) if run.kl_scale else {}
    no_inputs = sorted(p for p in head_mods if head_col.stats.get(p) is None)
    if sorted(lookup_only) != no_inputs:
        raise RuntimeError(f"tables measured as lookups only {sorted(lookup_only)} differ from those the head "
                           f"did not use {no_inputs}")
    for path in lookup_only:
        if s.importance == "residual":
            recs[path][0].importance = _lookup_weight(run, path, scale)
    rest = {p: mod for p, mod in head_mods.items() if p not in lookup_only}
    own = _share_options(run, rest)
    owner.update(own)
    for path, mod in rest.items():
        recs[path] = _measure_head_tensor(run, path, mod, head_col, head_kl, scale, own)
    head_recs = [recs[p] for p in head_mods]
    if owner:
        merged = dist.gather_layer([r for r, _, _ in head_recs], {}, {}, owner, list(head_mods))[0]
        head_recs = [(r, mod, fn) for r, (_, mod, fn) in zip(merged, head_recs)]
    for rec, mod, fn in head_recs:
        path = rec.key
        if fn is not None:
            ref_rec = rec.find(reference_option([o.option for o in rec.options], int(mod.weight.shape[-1])))
            if ref_rec is not None and ref_rec.err:
                rec.importance = ref_rec.damage / ref_rec.err**2  # for reports; the optimizer uses the damage
        m.tensors[path] = rec
    del head_kl


def _lookup_weight(run: _Run, path: str, scale: float) -> float:
    """A lookup table's KL per squared lookup error: measured end to end when in KL units, else predicted."""
    return run.lookup_weight.get(path, run.embed_importance * scale)


def _measure_head_tensor(run: _Run, path: str, mod: nn.Module, head_col: GramCollector, head_kl: Any,
                         scale: float, owner: dict) -> tuple[TensorRecord, nn.Module, Any]:
    """One embedding or head tensor's options (end-to-end KL damage for the head when in KL units)."""
    s, m, embed_lookup = run.s, run.m, run.embed_lookup
    role = role_of(path)
    stats = head_col.stats.get(path) if head_col is not None else None
    lookup = embed_lookup.get(path) if stats is None else None
    fn = None
    if head_kl is not None and stats is not None:
        fn = head_kl.damage_fn(mod)
        if path in embed_lookup:  # tied: the same codes also feed layer 0 through the lookup
            fn = _add_lookup_damage(fn, mod.weight, embed_lookup[path], _lookup_weight(run, path, scale))
    opts = _grid_options(run.grid_map, role, path)
    rec = None
    if fn is not None and not owner and s.sample_rows > 0:  # one rank: anchors end to end, the rest predicted
        rec = _head_by_anchors(run, path, mod.weight, opts, stats, fn, _lookup_weight(run, path, scale))
    if rec is None:
        rec = measure_tensor(path, mod.weight, opts, stats, role, lookup=lookup, clip=run.clip, method=s.method,
                             damage_fn=fn, progress=run.progress, sample_rows=s.sample_rows, only=_owned(owner, path))
        if fn is not None and path in embed_lookup:
            rec.extra["lookup_damage"] = [round(x, 6) for x in fn.lookup_damage]
    if stats is not None and path in embed_lookup:
        m.tied = {"lm_head": path}
        rec.extra["tied_head"] = True
    elif stats is None and s.importance == "residual":
        rec.importance = _lookup_weight(run, path, scale)
    if fn is not None:
        rec.extra["damage"] = "KL of the next-token distribution with only this tensor quantized (head)"
        if path in embed_lookup:
            rec.extra["damage"] += (" plus the lookup side's KL: lookup error^2 x the KL per squared error of the"
                                    " lookup alone at the reference option, carried to the logits")
    return rec, mod, fn


def head_anchors(options: Sequence[QuantOption], in_features: int) -> list[QuantOption]:
    """The head options measured end to end: the reference option and the mixed option nearest it in bits."""
    fitting = fitting_options(options, in_features)
    anchors = [reference_option(fitting, in_features)]
    mixed = [o for o in fitting if o.is_mixed and not anchors[0].is_mixed]
    if mixed:
        anchors.append(min(mixed, key=lambda o: (abs(o.nominal_bpw() - anchors[0].nominal_bpw()), o.desc)))
    return anchors


def _head_by_anchors(run: _Run, path: str, w: mx.array, options: Sequence[QuantOption], stats: InputStats,
                     fn: Callable[[mx.array], float], lookup_weight: float) -> TensorRecord | None:
    """The head's options: end-to-end KL at :func:`head_anchors`, the others predicted from it; None if no gain.

    Each anchor gives the head's KL per squared output error for its kind
    (whole-tensor or mixed options); another option's damage is that ratio
    times its squared output error, measured on a row sample
    (``HEAD_SAMPLE_FACTOR * sample_rows`` rows plus every token row the lookup
    uses), plus the lookup side as in :func:`_add_lookup_damage` (exact: every
    looked-up row is in the sample). Why: the head's options, each quantized on
    every vocabulary row and run through the head, were most of a small model's
    measurement. Measured on every option, the head's KL per squared error stays
    within 16.3-17.7 for SmolLM2-135M's whole-tensor options from 2 to 8 bits and
    19.7-22.2 for its mixed ones (24.0 at 7.2 bits); Gemma-3-270M: 26.5-30.5 and 32.9-37.8.
    """
    role, in_f = role_of(path), int(w.shape[-1])
    fitting = fitting_options(options, in_f)
    anchors = head_anchors(fitting, in_f)
    lookup = run.embed_lookup.get(path)
    must = np.nonzero(lookup.token_counts)[0] if lookup is not None else None
    energy = output_energies(w, stats.gram)  # once, for the sample and every meter below
    sample = output_row_sample(path, w, stats.gram, HEAD_SAMPLE_FACTOR * run.s.sample_rows, must, energy=energy)
    if sample is None or len(fitting) <= len(anchors):
        return None
    rec = measure_tensor(path, w, anchors, stats, role, clip=run.clip, method=run.s.method, damage_fn=fn,
                         progress=run.progress, energy=energy)
    parts = list(getattr(fn, "lookup_damage", [0.0] * len(rec.options)))
    ratio = {r.option.is_mixed: max(r.damage - lp, 0.0) / r.err ** 2 if r.err else 0.0
             for r, lp in zip(rec.options, parts)}  # head KL per squared output error, whole and mixed options
    idx, row_w = sample
    ws = w[idx]
    lk_meter = _ErrorMeter(ws, None, lookup.token_counts[np.asarray(idx)]) if lookup is not None else None
    for mixed in (False, True):
        group = [o for o in fitting if o not in anchors and o.is_mixed == mixed]
        if not group:
            continue
        meter, k = _ErrorMeter(ws, stats.gram, None, row_w, energy[np.asarray(idx)]), \
            ratio.get(mixed, ratio[anchors[0].is_mixed])

        def predicted(wq: mx.array) -> float:
            lk = lookup_weight * lk_meter(wq)[0] ** 2 if lk_meter is not None else 0.0
            parts.append(lk)
            return k * meter(wq)[0] ** 2 + lk

        part = measure_tensor(path, w, group, stats, role, clip=run.clip, method=run.s.method,
                              damage_fn=predicted, progress=run.progress, sample=sample, energy=energy)
        rec.options += part.options
    order = {o.desc: i for i, o in enumerate(fitting)}
    by_option = sorted(zip(rec.options, parts), key=lambda rp: order[rp[0].desc])
    rec.options = [r for r, _ in by_option]
    rec.extra.update(part.extra, head_anchors=[o.desc for o in anchors],
                     head_kl_per_err2={("mixed" if k else "whole"): v for k, v in ratio.items()})
    if lookup is not None:
        rec.extra["lookup_damage"] = [round(lp, 6) for _, lp in by_option]
    return rec


def _finish(run: _Run) -> Measurement:
    """Whole-model importance (``importance="kl"``), mark complete, write the file and drop the state."""
    s, m, out = run.s, run.m, run.out
    if s.importance == "kl":
        kl_importance(run.source, m, run.tokens[:run.n_imp], run.grid_map, clip=run.clip, progress=run.progress)
    m.extra["complete"] = True
    m.extra["timing"]["total_s"] = round(time.perf_counter() - run.t_start, 3)
    if out is not None and dist.is_root():
        save_measurement(m, out)
        _state_path(out).unlink(missing_ok=True)
    if out is not None and dist.active():
        dist.barrier()
        dist.drop_states(out)
    dist.set_stage(None)
    return m


def _share_options(run: _Run, mods: dict[str, nn.Module]) -> dict[tuple[str, str], int]:
    """The rank that measures each (tensor, option) of ``mods``, balanced by cost; {} with one rank.

    The cost of an option is its seconds per weight measured on the earlier
    layers (every rank holds the same table) times the tensor's size; until each
    option has been timed once, a rough model (:func:`~mlx_dq.runtime.distributed.option_cost`).
    Any split gives the same measurement: only the time depends on it.
    """
    if not dist.active():
        return {}
    units = [(p, o) for p, mod in mods.items()
             for o in fitting_options(_grid_options(run.grid_map, role_of(p), p), int(mod.weight.shape[-1]))]
    if all(o.desc in run.rates for _, o in units):
        costs = [mods[p].weight.size * run.rates[o.desc][0] / run.rates[o.desc][1] for p, o in units]
    else:
        costs = [dist.option_cost(tuple(mods[p].weight.shape), run.s.method, run.clip, o.keep16) for p, o in units]
    return {(p, o.desc): r for (p, o), r in zip(units, dist.split_by_cost(costs))}


def _owned(owner: dict[tuple[str, str], int], path: str) -> set[str] | None:
    """The option descriptions of ``path`` this rank measures (None: one rank measures every option)."""
    return {d for (p, d), r in owner.items() if p == path and r == dist.rank()} if owner else None


def _learn_rates(run: _Run, mods: dict[str, nn.Module], timings: dict[str, dict[str, float]]) -> None:
    """Add every rank's option timings of this layer to ``run.rates`` (the same table on every rank)."""
    if not dist.active():
        return
    for part in dist.gather_objects(timings):
        for path, per in sorted(part.items()):
            for desc, sec in sorted(per.items()):
                acc = run.rates.setdefault(desc, [0.0, 0])
                acc[0] += sec
                acc[1] += int(mods[path].weight.size)


def kl_importance(source: Any, m: Measurement, tokens: mx.array, grid_map: dict, clip: bool = True,
                  progress: bool = True) -> None:
    """Set each tensor's importance to end-to-end KL / err**2 at its reference option (whole model in memory)."""
    model = source.model(mx.float32)
    mods = {p: mod for p, mod in quantizable_modules(model).items() if p in m.tensors}
    options = {p: reference_option(grid_map[role_of(p)], int(mod.weight.shape[-1])) for p, mod in mods.items()}
    results = tensor_kl(model, tokens, mods, options, clip=clip, progress=progress)
    for key, r in results.items():
        rec = m.tensors[key]
        rec.importance = r["kl"] / r["err"] ** 2 if r["err"] > 0 else 0.0
        rec.extra["importance_detail"] = r
        rec.extra["importance_ref"] = r["option"]


def tensor_kl(
    model: nn.Module,
    tokens: mx.array,
    mods: dict[str, nn.Module],
    options: dict[str, QuantOption],
    clip: bool = True,
    progress: bool = False,
    chunk: int = HEAD_CHUNK,
) -> dict[str, dict[str, float]]:
    """End-to-end KL(fp || quantized) per tensor when only that tensor is quantized with ``options[path]``.

    ``model`` has all weights loaded. Returns ``{path: {"kl", "err", "option"}}``
    where ``err`` is the tensor's relative output error on the same ``tokens``.
    KL is the mean over all positions, in nats; the head runs ``chunk`` positions at a time.
    """
    layers = model.layers
    prefix = layer_prefix(model, layers)
    with GramCollector(mods) as col:
        h, calls = probe_layers(model, tokens)
        col.flush()
        hs = [h]
        for j, layer in enumerate(layers):
            args, kwargs = calls[j]
            h = layer(h, *args, **kwargs).astype(mx.float32)
            mx.eval(h)
            col.flush()
            hs.append(h)
        for r in range(int(tokens.shape[0])):  # the head's input Gram, chunk by chunk
            for sl in position_chunks(int(tokens.shape[1]), chunk):
                head_logits(model, tokens[r:r + 1, sl], h[r:r + 1, sl])  # records the input; logits never evaluated
                col.flush()
    ref = _HeadKL(model, tokens, h, chunk)
    out = {}
    for path in tqdm(list(mods), desc="kl", disable=not progress):
        mod = mods[path]
        stats = col.stats.get(path)
        gram = None if stats is None else (stats.gram.sum(0) if stats.gram.ndim == 3 else stats.gram)
        wq = quantize_weight(mod.weight, options[path], gram=gram, clip=clip).dequantize(mx.float32)
        w = mod.weight
        mod.weight = wq
        try:
            if path.startswith(prefix):
                i = int(path[len(prefix):].split(".")[0])
                x = hs[i]
            elif not isinstance(mod, nn.Embedding):  # an untied head: the final hidden states as they are
                i, x = len(layers), hs[-1]
            else:  # embedding (perhaps tied): the whole model from the quantized lookup on
                i, x = 0, probe_layers(model, tokens)[0]
            for j in range(i, len(layers)):
                args, kwargs = calls[j]
                x = layers[j](x, *args, **kwargs).astype(mx.float32)
            mx.eval(x)
        finally:
            mod.weight = w
        kl = ref.kl(x, swap=None if path.startswith(prefix) else (mod, wq))
        if stats is not None:
            err = output_error(w, wq, stats.gram if stats.gram.ndim == 2 or stats.gram.shape[0] > 1 else stats.gram[0])
        else:
            lk = col.lookups[path]
            err = _lookup_error(w, wq, lk.token_counts)
        out[path] = {"kl": kl, "err": err, "option": options[path].desc}
    return out


# --------------------------------------------------------------------------
# generic path: any mlx.nn.Module
# --------------------------------------------------------------------------
def measure_module(
    module: nn.Module,
    inputs: Sequence[Any],
    grid: str | Path | dict | None = None,
    *,
    importance: bool = True,
    clip: bool = True,
    role: Callable[[str], str | None] | None = None,
) -> Measurement:
    """Measure every ``nn.Linear`` of any module on ``inputs`` (a list of batches; tuples are unpacked).

    Importance is the relative squared change of the module's output when only
    that tensor is quantized at the reference option, divided by its squared error.
    """

    role = role or role_of
    grid_map = grid if isinstance(grid, dict) else load_grid(grid)
    if not inputs:
        raise ValueError("measure_module needs at least one input batch")
    mods = {p: m for p, m in quantizable_modules(module).items() if isinstance(m, nn.Linear)}
    if not mods:
        raise ValueError("the module has no nn.Linear layers to measure")

    def run(batch: Any) -> mx.array:
        y = module(*batch) if isinstance(batch, tuple) else module(batch)
        return y.astype(mx.float32)

    refs_out = []
    with GramCollector(mods) as col:
        for batch in inputs:
            y = run(batch)
            mx.eval(y)
            col.flush()
            refs_out.append(y)
    energy = sum(float((y * y).sum().item()) for y in refs_out)
    tensors = []
    for path, mod in mods.items():
        r = role(path)
        opts = _grid_options(grid_map, r, path) if r is not None else None
        if opts is None:
            continue
        rec = measure_tensor(path, mod.weight, opts, col.stats[path], r, clip=clip)
        if importance:
            ref = reference_option(opts, int(mod.weight.shape[-1]))
            wq = quantize_weight(mod.weight, ref, gram=col.stats[path].gram, clip=clip).dequantize(mx.float32)
            w = mod.weight
            mod.weight = wq
            try:
                damage = sum(float(((run(b) - y) ** 2).sum().item()) for b, y in zip(inputs, refs_out)) / energy
            finally:
                mod.weight = w
            err = output_error(w, wq, col.stats[path].gram)
            rec.importance = damage / err**2 if err > 0 else 0.0
            rec.extra["importance_ref"] = ref.desc
            rec.extra["importance_detail"] = {"damage": damage, "err": err}
        tensors.append(rec)
    m = Measurement(
        model={"spec": type(module).__name__, "model_type": None, "num_layers": None, "fingerprint": None},
        calibration={"source": "inputs", "batches": len(inputs)},
        grid={"source": "dict" if isinstance(grid, dict) else (str(grid) if grid else "default"),
              "roles": {k: [o.desc for o in v] for k, v in sorted(grid_map.items())}},
        versions=_versions(),
        last_module_idx=None,
    )
    m.extra = {"importance": {"method": "module_output" if importance else "none", "reference": REFERENCE_OPTION,
                              "predicts": "damage ~ importance * err**2"},
               "clip": clip, "complete": True}
    m.tensors = {t.key: t for t in tensors}
    return m
