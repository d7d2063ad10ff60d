"""Plain numpy forms of MLX's affine storage arithmetic, written independently of the package, as test references."""

from __future__ import annotations

import numpy as np


def codes_f16(w, scales, biases, bits):
    """Nearest codes of float32 ``w`` for fp16 ``scales``/``biases`` (broadcast), clipped to ``bits``: the plain form."""
    s = np.asarray(scales, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32)
    safe = np.where(s == 0, 1.0, s)
    q = np.clip(np.rint((w - b) / safe), 0, (1 << bits) - 1)
    return np.where(s == 0, 0.0, q).astype(np.float32)


def dequant_f16(q, scales, biases):
    """``mx.dequantize``'s values for fp16 ``scales``/``biases``, rounded by numpy's fp16 conversions."""
    s = np.asarray(scales, dtype=np.float32)
    b = np.asarray(biases, dtype=np.float32)
    prod = (s * q).astype(np.float16).astype(np.float32)
    return (prod + b).astype(np.float16).astype(np.float32)
