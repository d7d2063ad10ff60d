"""Quantization math: apply a :class:`~mlx_dq.options.QuantOption` to one weight.

Every segment is stored exactly as MLX affine group quantization stores a
weight (packed uint32 codes, 16-bit scales and biases), so each segment can be
fed to ``mx.quantized_matmul`` / ``mx.dequantize`` as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .options import QuantOption, perm_bits


@dataclass
class QuantizedTensor:
    """One weight after quantization with ``option``.

    ``parts`` holds, for every non-empty segment in order, the MLX triple
    ``(packed uint32 [..., out, k*bits/32], scales [..., out, k/g], biases)``;
    ``widths`` the number of input channels of each; ``perm`` the input-channel
    order (mixed options only: column ``j`` of the concatenated segments is
    original input channel ``perm[j]``); ``fp`` the weight itself for kept
    16-bit tensors; ``stats`` clip statistics.
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

    def dequantize(self, dtype: mx.Dtype = mx.float32) -> mx.array:
        """The weight the stored codes represent, ``[..., out, in]`` in original channel order."""
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

    def nbytes(self) -> int:
        """Bytes of every stored array (codes, scales, biases, permutation or 16-bit weight)."""
        if self.fp is not None:
            return self.fp.size * 2
        n = sum(w.nbytes + s.nbytes + b.nbytes for w, s, b in self.parts)
        if self.perm is not None:
            n += self.perm.size * perm_bits(self.shape[-1]) // 8
        return n


def quantize_weight(
    w: mx.array,
    option: QuantOption,
    gram: mx.array | None = None,
    clip: bool = True,
    scale_dtype: mx.Dtype = mx.float16,
) -> QuantizedTensor:
    """Quantize ``w`` (``[..., out, in]``) with ``option``.

    Minimal round-to-nearest version; the clip search and act-order from the
    Gram matrix ``gram`` (``[in, in]``) refine it.
    """
    shape = tuple(int(d) for d in w.shape)
    if option.keep16:
        return QuantizedTensor(option, shape, fp=w.astype(scale_dtype))
    wf = w.astype(mx.float32)
    perm = None
    if option.is_mixed:
        in_f = shape[-1]
        if gram is not None:
            energy = np.asarray(mx.diagonal(gram.astype(mx.float32)))
            order = np.argsort(-energy, kind="stable")
        else:
            order = np.arange(in_f)
        perm = order.astype(np.uint16 if perm_bits(in_f) == 16 else np.uint32)
        wf = mx.take(wf, mx.array(order.astype(np.int32)), axis=-1)
    qt = QuantizedTensor(option, shape, perm=perm)
    start = 0
    for seg, k in zip(option.segments, option.split(shape[-1])):
        if k == 0:
            continue
        ws = wf[..., start : start + k].astype(scale_dtype)
        packed, scales, biases = mx.quantize(ws, group_size=seg.group_size, bits=seg.bits)
        qt.parts.append((packed, scales, biases))
        qt.widths.append(k)
        qt.bits.append(seg.bits)
        qt.group_sizes.append(seg.group_size)
        start += k
    return qt
