"""Residual importance in KL units: how much a tensor's output error costs the model, so errors compare across layers.

A tensor's importance is the squared change of its decoder layer's residual output when only it is quantized at
the reference option, per unit of its own squared error; sampled layers' KL at the logits rescales it to nats
(``importance * err**2`` then predicts the tensor's KL; see docs/pipeline.md, "How the measurer works").
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dq.measure.swap import weight_as
from mlx_dq.model.capture import GramCollector
from mlx_dq.model.replay import record_calls, replay
from mlx_dq.quant.affine import (
    QuantizedTensor,
    exact_sums,
    output_error,
    relative_error,
)


def robust_energy(h: mx.array) -> float:
    """Energy of hidden states ``[..., channels]`` measured as channels x the median channel's energy.

    Unlike the plain sum of squares it ignores the few "massive activation"
    channels that dominate the residual stream's norm in many LLMs and that the
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
    seconds: dict[str, float] | None = None,
) -> dict[str, dict[str, float]]:
    """Per tensor: squared change of ``layer``'s output when only it uses ``refs[path]``, relative to the output.

    The change is divided by :func:`robust_energy` of the layer's output.
    Returns ``{path: {"damage", "err", "importance"}}`` with ``importance =
    damage / err**2``, both measured on the rows ``h``; ``seconds`` (a dict) receives each path's rerun time
    (for sharing the work over ranks).

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
        t0 = time.perf_counter()
        mod = mods[path]
        wq = ref_qt.dequantize(ref_qt.dtype)  # exact, not the layer's dtype (bfloat16 would round it)
        with weight_as(mod, wq) as w:
            with replay(layer, log, mod) if id(mod) in log.reuse else contextlib.nullcontext():
                y = layer(h, *args, **kwargs)
            damage = exact_sums((y - ref) ** 2)[0] / energy
        err = input_error(w, wq, inputs[path]) if path in inputs else output_error(w, wq, col.stats[path].gram)
        out[path] = {"damage": damage, "err": err, "importance": damage / err**2 if err > 0 else 0.0}
        if seconds is not None:
            seconds[path] = time.perf_counter() - t0
    return out


def input_error(w: mx.array, wq: mx.array, x: mx.array) -> float:
    """:func:`~mlx_dq.quant.affine.output_error` from the inputs ``x`` (``[rows, in]``) themselves:
    ``||x (wq - w)^T|| / ||x w^T||``. Why: ``rows x in x out`` multiply-adds instead of the Gram's
    ``rows x in^2`` plus ``out x in^2`` (at Llama-3-70B's 28,672-channel input, 0.5 T instead of 8.4 T)."""
    w32 = w.astype(mx.float32)
    y, d = x @ w32.T, x @ (wq.astype(mx.float32) - w32).T
    return relative_error(*exact_sums(d * d, y * y))


def perturbed_output(layer: nn.Module, h: mx.array, call: tuple[tuple, dict], mods: dict[str, nn.Module],
                     refs: dict[str, QuantizedTensor]) -> mx.array:
    """``layer``'s output on ``h`` with every tensor in ``refs`` quantized at once (weights restored after)."""
    args, kwargs = call
    with contextlib.ExitStack() as swaps:
        for p, ref_qt in refs.items():
            swaps.enter_context(weight_as(mods[p], ref_qt.dequantize(ref_qt.dtype)))  # exact: the forward promotes it
        y = layer(h, *args, **kwargs).astype(mx.float32)
        mx.eval(y)
    return y


def depth_kl_scales(samples: Sequence[dict], layers: Sequence[int], default: float) -> dict[int, float]:
    """Per decoder layer: KL per unit of predicted damage, log-linear between the sampled layers, flat beyond.

    Why: what a layer's perturbation costs at the logits depends on its depth, and one scale for the whole
    model priced the last layers far too cheap (see docs/pipeline.md). Samples without a positive KL and
    prediction are left out; with none left every layer gets ``default``.
    """
    pts = sorted((x["layer"], math.log(x["kl"] / x["predicted"])) for x in samples
                 if x.get("kl", 0) > 0 and x.get("predicted", 0) > 0)
    if not pts:
        return {i: default for i in layers}
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    return {i: float(math.exp(np.interp(i, xs, ys))) for i in layers}
