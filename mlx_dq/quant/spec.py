"""One value that says how a weight is quantized: :class:`QuantizerSpec`.

The settings make it (:meth:`mlx_dq.settings.QuantizeSettings.quantizer`,
:meth:`mlx_dq.settings.MeasureSettings.quantizer`) and every quantizer takes it whole (the dispatch, GPTQ,
the measurer), so the errors a plan is built on come from the same knobs as the tensors conversion writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

METHODS = ("gptq", "rtn")  # GPTQ error compensation, or round-to-nearest with the clip search
SCALE_WEIGHTS = ("diag", "gptq")  # GPTQ's scale-search weights: input energy, or GPTQ's own 1/[H^-1]_jj
DEFAULT_DAMP = 0.1  # relative damping of GPTQ's H (why 0.1, not GPTQ's usual 0.01: docs/quality.md#figures-behind-the-code)


@dataclass(frozen=True)
class QuantizerSpec:
    """How a weight is quantized.

    ``method``: ``"gptq"`` (error compensation against the Gram matrix of the inputs) or ``"rtn"`` (round to
    nearest); ``clip``: the clip search of the group ranges; ``damp``: GPTQ adds ``damp * mean(diag(H))`` to
    ``H``'s diagonal; ``block_size``: GPTQ's columns per block; ``act_order``: GPTQ processes uniform options'
    channels by activation energy (static groups), else in natural order; ``weighted_scales``: GPTQ refines each
    group's scale and bias under the ``scale_weight``-weighted error (``"diag"``: input energy, ``"gptq"``:
    ``1/[H^-1]_jj``); ``promote_mixed``: mixed options keep natural channel order and are stored as one uniform
    tensor at their highest width (stock-loadable); ``scale_dtype``: the dtype of scales, biases and 16-bit tensors.
    """

    method: str = "gptq"
    clip: bool = True
    damp: float = DEFAULT_DAMP
    block_size: int = 128
    act_order: bool = True
    weighted_scales: bool = True
    scale_weight: str = "diag"
    promote_mixed: bool = False
    scale_dtype: Any = mx.float16

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
        if self.scale_weight not in SCALE_WEIGHTS:
            raise ValueError(f"scale_weight must be one of {SCALE_WEIGHTS}, got {self.scale_weight!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.damp < 0:
            raise ValueError(f"damp must be >= 0, got {self.damp}")
