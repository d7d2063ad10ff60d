"""Whole-model KL: each tensor quantized alone with the whole model in memory, and ``measure_module`` for any module.

``importance="kl"`` replaces the streamed importances by each tensor's end-to-end KL per squared error;
:func:`measure_module` measures every ``nn.Linear`` of any ``mlx.nn.Module`` on given input batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
from tqdm import tqdm

from mlx_dq.measure.grids import load_grid
from mlx_dq.measure.head_kl import HeadKL
from mlx_dq.measure.meter import lookup_error
from mlx_dq.measure.records import Measurement
from mlx_dq.measure.run import grid_options, package_versions
from mlx_dq.measure.swap import weight_as
from mlx_dq.measure.tensor import REFERENCE_OPTION, measure_tensor, reference_option
from mlx_dq.model.capture import GramCollector, quantizable_modules
from mlx_dq.model.runner import (
    HEAD_CHUNK,
    head_logits,
    layer_prefix,
    position_chunks,
    probe_layers,
)
from mlx_dq.names import role_of
from mlx_dq.quant.affine import output_error, quantize_weight
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.spec import QuantizerSpec


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
    ref = HeadKL(model, tokens, h, chunk)
    out = {}
    for path in tqdm(list(mods), desc="kl", disable=not progress):
        mod = mods[path]
        stats = col.stats.get(path)
        gram = None if stats is None else (stats.gram.sum(0) if stats.gram.ndim == 3 else stats.gram)
        wq = quantize_weight(mod.weight, options[path], gram=gram, clip=clip).dequantize(mx.float32)
        with weight_as(mod, wq) as w:
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
        kl = ref.kl(x, swap=None if path.startswith(prefix) else (mod, wq))
        if stats is not None:
            err = output_error(w, wq, stats.gram if stats.gram.ndim == 2 or stats.gram.shape[0] > 1 else stats.gram[0])
        else:
            lk = col.lookups[path]
            err = lookup_error(w, wq, lk.token_counts)
        out[path] = {"kl": kl, "err": err, "option": options[path].desc}
    return out


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
        opts = grid_options(grid_map, r, path) if r is not None else None
        if opts is None:
            continue
        rec = measure_tensor(path, mod.weight, opts, col.stats[path], r, spec=QuantizerSpec(method="rtn", clip=clip))
        if importance:
            ref = reference_option(opts, int(mod.weight.shape[-1]))
            wq = quantize_weight(mod.weight, ref, gram=col.stats[path].gram, clip=clip).dequantize(mx.float32)
            with weight_as(mod, wq) as w:
                damage = sum(float(((run(b) - y) ** 2).sum().item()) for b, y in zip(inputs, refs_out)) / energy
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
        versions=package_versions(),
        last_module_idx=None,
    )
    m.extra = {"importance": {"method": "module_output" if importance else "none", "reference": REFERENCE_OPTION,
                              "predicts": "damage ~ importance * err**2"},
               "clip": clip, "complete": True}
    m.tensors = {t.key: t for t in tensors}
    return m
