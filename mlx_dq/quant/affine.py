"""Round-to-nearest quantization: apply a :class:`~mlx_dq.quant.options.QuantOption` to one weight, and the
error measures every stage shares.

Every segment is stored exactly as MLX affine group quantization stores a
weight (packed uint32 codes, 16-bit scales and biases; :mod:`mlx_dq.quant.storage`),
so each segment can be fed to ``mx.quantized_matmul`` / ``mx.dequantize`` as is.

- :class:`QuantizedTensor` one quantized weight (its stored segments, order and stats);
- :func:`quantize_weight` RTN with the clip search (:mod:`mlx_dq.quant.scale_search`);
- :func:`permute_inputs` / :func:`act_order` / :func:`as_banks` the channel order and bank layout the
  quantizers share;
- :func:`output_error` / :func:`weight_error` / :func:`exact_sums` error measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.quant.options import QuantOption, perm_bits
from mlx_dq.quant.scale_search import (
    CLIP_METRICS,
    clip_search,
    default_clip_factors,
    gram_weights,
)
from mlx_dq.quant.storage import pack_codes_mx, pack_part, unpack_codes

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
def as_banks(w: mx.array, gram: mx.array | None) -> tuple[mx.array, mx.array | None]:
    """``w`` as ``[B, R, in]`` and ``gram`` as ``[Bg, in, in]`` (Bg = 1 or B, float32), checked: the bank layout
    every quantizer works in (a 2-D weight is one bank)."""
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
    w3, g3 = as_banks(w, gram)
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
