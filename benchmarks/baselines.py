"""mlx-lm's own quantization methods, built in memory from a float model for side-by-side comparison.

Every variant is made with mlx-lm's code, nothing re-implemented: uniform affine quantization
(``mlx_lm.utils.quantize_model``), the ``mixed_*`` recipes (``mlx_lm.convert.mixed_quant_predicate_builder``),
its calibrated quantizers GPTQ (``mlx_lm.quant.gptq.gptq_quantize``) and AWQ
(``mlx_lm.quant.awq.awq_quantize``), given our calibration rows directly (their command lines
download a calibration text), its distillation DWQ (``mlx_lm.quant.dwq.dwq_quantize``, likewise given our rows;
:func:`dwq`), and ``dynamic_quant`` (``mlx_lm.quant.dynamic_quant``: gradient sensitivities, then a threshold
between two precision levels found by binary search on the bits per weight).

As in an mlx-lm checkpoint, the model is cast to 16-bit before quantizing, so scales and biases
are 16-bit like mlx-dq's. Bits per weight are counted with :func:`mlx_dq.evaluation.metrics.weight_storage`
(the same rule for every method). ``dynamic_quant`` normally downloads its calibration text;
here it is given our calibration rows.

Two planning baselines work on a measurement instead, at the optimizer's budget: a single greedy pass
(:func:`greedy_single_pass`) and mlx-lm's dynamic_quant two-level rule (:func:`dynamic_quant_threshold`).
"""

from __future__ import annotations

import contextlib
import copy
import heapq
import io
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map

from mlx_dq.measure.records import Measurement, OptionRecord
from mlx_dq.plan.plan import Plan
from mlx_dq.plan.solver import Item, build_problem, check_range, make_plan, range_error
from mlx_dq.quant.options import QuantOption

UNIFORM_BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
MIXED_RECIPES = ("mixed_3_4", "mixed_3_6", "mixed_4_6")
MIXED_GROUP_SIZE = 64  # mlx-lm's default group size, used by its recipes when none is given
# dynamic_quant's command-line defaults: 4-bit g64 low level, 5-bit g64 high level, 5.0 bpw target
DYNAMIC_LEVELS = (4, 64, 5, 64)
DYNAMIC_TARGET = 5.0
# mlx_lm.gptq's command-line defaults: GPTQ layers 4-bit g64, every other quantizable layer (embedding) 6-bit g64
GPTQ_DEFAULTS = {"bits": 4, "group_size": 64, "fallback_bits": 6, "fallback_group_size": 64}
# mlx_lm.awq's command-line defaults: 4-bit g64 blocks, embedding (and head) 4-bit g32, 20-point grids
AWQ_DEFAULTS = {"bits": 4, "group_size": 64, "embed_bits": 4, "embed_group_size": 32, "n_grid": 20}
# mlx_lm.dwq's command-line defaults (Adam, constant learning rate; its data: 2,048 samples x 1,025 tokens,
# batch 4, one pass = 512 steps) and dwq_quantize's default temperature
DWQ_DEFAULTS = {"bits": 4, "group_size": 64, "lr": 1e-6, "batch_size": 4, "temperature": 2.0, "seed": 123}


@dataclass
class Baseline:
    """One mlx-lm-quantized variant of a model: its name, method, settings, model and config."""

    name: str
    method: str
    model: nn.Module
    config: dict
    build_s: float
    params: dict = field(default_factory=dict)


def cast_copy(model: nn.Module, dtype: mx.Dtype = mx.float16) -> nn.Module:
    """A deep copy of ``model`` with every floating parameter cast to ``dtype``."""
    out = copy.deepcopy(model)
    out.update(
        tree_map(lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v, out.parameters())
    )
    return out


def _quantize(
    model: nn.Module,
    config: dict,
    group_size: int,
    bits: int,
    predicate: Callable | None = None,
    dtype: mx.Dtype = mx.float16,
) -> tuple[nn.Module, dict]:
    """mlx-lm's ``quantize_model`` on a 16-bit copy (its progress print silenced)."""
    from mlx_lm.utils import quantize_model

    q = cast_copy(model, dtype)
    with contextlib.redirect_stdout(io.StringIO()):
        q, qconfig = quantize_model(q, copy.deepcopy(config), group_size, bits, quant_predicate=predicate)
    mx.eval(q.parameters())
    return q, qconfig


def uniform(
    model: nn.Module, config: dict, bits: int, group_size: int, dtype: mx.Dtype = mx.float16
) -> tuple[nn.Module, dict]:
    """mlx-lm's uniform affine quantization of every quantizable layer at ``bits`` and ``group_size``."""
    from mlx_dq.quant.options import VALID_BITS, VALID_GROUPS

    if bits not in VALID_BITS or group_size not in VALID_GROUPS:
        raise ValueError(f"bits must be in {VALID_BITS} and group size in {VALID_GROUPS}, got {bits}, {group_size}")
    return _quantize(model, config, group_size, bits, dtype=dtype)


def mixed_recipe(
    model: nn.Module, config: dict, recipe: str, group_size: int = MIXED_GROUP_SIZE, dtype: mx.Dtype = mx.float16
) -> tuple[nn.Module, dict]:
    """mlx-lm's ``mixed_*`` recipe (``mlx_lm.convert --quant-predicate``): more bits for some v_proj/down_proj and lm_head."""
    from mlx_lm.convert import QUANT_RECIPES, mixed_quant_predicate_builder

    if recipe not in QUANT_RECIPES:
        raise ValueError(f"unknown mlx-lm recipe {recipe!r}; mlx-lm has {QUANT_RECIPES}")
    predicate = mixed_quant_predicate_builder(recipe, model, group_size)
    return _quantize(model, config, group_size, None, predicate=predicate, dtype=dtype)


def dynamic_sensitivities(
    model: nn.Module,
    rows: mx.array,
    levels: Sequence[int] = DYNAMIC_LEVELS,
    batch_size: int = 4,
) -> dict[str, float]:
    """Per-layer sensitivities from mlx-lm's ``dynamic_quant.estimate_sensitivities`` on our calibration rows.

    Gradient of the KL to the float model, taken at the low-bit weights, dotted with the
    low-to-high weight change; ``levels`` is (low bits, low group, high bits, high group).
    """
    from mlx_lm.quant.dynamic_quant import estimate_sensitivities

    low_bits, low_group, high_bits, high_group = levels
    f32 = cast_copy(model, mx.float32)
    sens = estimate_sensitivities(f32, rows, low_bits, low_group, high_bits, high_group, batch_size=batch_size)
    return {k: float(v) for k, v in sens}


def dynamic_quant(
    model: nn.Module,
    config: dict,
    sensitivities: dict[str, float],
    target_bpw: float = DYNAMIC_TARGET,
    levels: Sequence[int] = DYNAMIC_LEVELS,
    dtype: mx.Dtype = mx.float16,
) -> tuple[nn.Module, dict]:
    """mlx-lm's ``dynamic_quant``: layers above a sensitivity threshold get the high level, the rest the low level.

    The threshold comes from ``dynamic_quant.estimate_threshold`` (binary search with mlx-lm's own
    bits-per-weight count on the 16-bit model), exactly as its command line does.
    """
    from mlx_lm.quant.dynamic_quant import estimate_threshold

    low_bits, low_group, high_bits, high_group = levels
    if not low_bits + 32 / low_group <= target_bpw <= high_bits + 32 / high_group:
        raise ValueError(
            f"target {target_bpw} bpw is outside what levels {tuple(levels)} can reach "
            f"({low_bits + 32 / low_group:.3f}..{high_bits + 32 / high_group:.3f})"
        )
    q16 = cast_copy(model, dtype)
    threshold = estimate_threshold(q16, sensitivities, target_bpw, low_bits, low_group, high_bits, high_group)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not hasattr(module, "to_quantized"):
            return False
        if sensitivities[path] > threshold:
            return {"bits": high_bits, "group_size": high_group}
        return True

    return _quantize(model, config, low_group, low_bits, predicate=predicate, dtype=dtype)


def uniform_variants(
    model: nn.Module,
    config: dict,
    bits: Sequence[int] = UNIFORM_BITS,
    group_sizes: Sequence[int] = GROUP_SIZES,
) -> Iterator[Baseline]:
    """Yield mlx-lm's uniform quantization for every bits x group pair, one model at a time."""
    for b in bits:
        for g in group_sizes:
            t0 = time.perf_counter()
            q, qc = uniform(model, config, b, g)
            yield Baseline(f"mlx-lm {b}-bit g{g}", "mlx-lm uniform", q, qc, time.perf_counter() - t0,
                           {"bits": b, "group_size": g})


def mixed_variants(model: nn.Module, config: dict, recipes: Sequence[str] = MIXED_RECIPES) -> Iterator[Baseline]:
    """Yield mlx-lm's mixed recipes, one model at a time."""
    for r in recipes:
        t0 = time.perf_counter()
        q, qc = mixed_recipe(model, config, r)
        yield Baseline(f"mlx-lm {r}", "mlx-lm mixed", q, qc, time.perf_counter() - t0,
                       {"recipe": r, "group_size": MIXED_GROUP_SIZE})


def dynamic_variants(
    model: nn.Module,
    config: dict,
    sensitivities: dict[str, float],
    targets: Sequence[float],
    levels: Sequence[int] = DYNAMIC_LEVELS,
) -> Iterator[Baseline]:
    """Yield mlx-lm's dynamic_quant at each target bpw from one set of sensitivities."""
    for t in targets:
        t0 = time.perf_counter()
        q, qc = dynamic_quant(model, config, sensitivities, t, levels)
        lb, lg, hb, hg = levels
        yield Baseline(f"mlx-lm dynamic_quant {lb}b{lg}/{hb}b{hg} @{t:g}", "mlx-lm dynamic_quant", q, qc,
                       time.perf_counter() - t0, {"target_bpw": t, "levels": list(levels)})


def _to_16_bit(model: nn.Module, dtype: mx.Dtype) -> nn.Module:
    """Cast every floating parameter (scales, biases, norms, float layers) of ``model`` to ``dtype``, in place."""
    model.update(tree_map(lambda v: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    mx.eval(model.parameters())
    return model


def gptq(
    model: nn.Module,
    config: dict,
    rows: mx.array,
    bits: int = GPTQ_DEFAULTS["bits"],
    group_size: int = GPTQ_DEFAULTS["group_size"],
    fallback_bits: int = GPTQ_DEFAULTS["fallback_bits"],
    fallback_group_size: int = GPTQ_DEFAULTS["fallback_group_size"],
    batch_size: int = 8,
    dtype: mx.Dtype = mx.float16,
) -> tuple[nn.Module, dict]:
    """mlx-lm's GPTQ (``mlx_lm.quant.gptq.gptq_quantize``) calibrated on token ``rows``.

    Every Linear gets GPTQ at ``bits``/``group_size`` (mlx-lm supports 2, 4, 8 bits); the other
    quantizable layers (the embedding) get plain rounding at the fallback width. Runs on a float32
    copy (its Hessians accumulate in the input dtype), then stores scales and biases in ``dtype``
    as a 16-bit checkpoint would.
    """
    from mlx_lm.quant.gptq import gptq_quantize

    if bits not in (2, 4, 8):
        raise ValueError(f"mlx-lm's GPTQ supports 2, 4 or 8 bits, got {bits}")
    q = cast_copy(model, mx.float32)
    with contextlib.redirect_stderr(io.StringIO()):  # its tqdm bars
        q, qconf = gptq_quantize(q, rows, bits, group_size, fallback_bits, fallback_group_size, batch_size=batch_size)
    qconfig = copy.deepcopy(config)
    qconfig["quantization"] = qconf
    return _to_16_bit(q, dtype), qconfig


def awq(
    model: nn.Module,
    config: dict,
    rows: mx.array,
    bits: int = AWQ_DEFAULTS["bits"],
    group_size: int = AWQ_DEFAULTS["group_size"],
    embed_bits: int = AWQ_DEFAULTS["embed_bits"],
    embed_group_size: int = AWQ_DEFAULTS["embed_group_size"],
    n_grid: int = AWQ_DEFAULTS["n_grid"],
    dtype: mx.Dtype = mx.float16,
) -> tuple[nn.Module, dict]:
    """mlx-lm's AWQ (``mlx_lm.quant.awq.awq_quantize``) calibrated on token ``rows``.

    Activation-aware scales and clipping searched per block, then rounding at ``bits``/``group_size``;
    the embedding (and an untied head) at ``embed_bits``/``embed_group_size``. Only the architectures
    in mlx-lm's ``AWQ_MODEL_CONFIGS`` (llama, qwen2, gemma3_text, ...) are supported. Runs in float32,
    then stores scales and biases in ``dtype``.
    """
    from mlx_lm.quant.awq import AWQ_MODEL_CONFIGS, awq_quantize, update_config

    model_type = config.get("model_type")
    if model_type not in AWQ_MODEL_CONFIGS:
        raise ValueError(f"mlx-lm's AWQ does not support {model_type!r} models (it has {sorted(AWQ_MODEL_CONFIGS)})")
    q = cast_copy(model, mx.float32)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        awq_quantize(q, rows, AWQ_MODEL_CONFIGS[model_type], group_size=group_size, bits=bits,
                     embed_group_size=embed_group_size, embed_bits=embed_bits, n_grid=n_grid)
        qconfig = update_config(q, copy.deepcopy(config))
    return _to_16_bit(q, dtype), qconfig


@contextlib.contextmanager
def dequantized_matmuls() -> Iterator[None]:
    """While inside, quantized layers multiply through their dequantized weights instead of ``mx.quantized_matmul``.

    ``nn.QuantizedLinear.__call__`` and ``nn.QuantizedEmbedding.as_linear`` (a tied head) become
    ``x @ mx.dequantize(w, scales, biases).T`` (+ bias): the same function of the scales and biases, with the same
    gradients, but far faster on MLX's CPU backend. Non-affine modes keep MLX's own path. Restored on exit.
    """
    linear_call, embedding_as_linear = nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear

    def weight(m: nn.Module) -> mx.array:
        return mx.dequantize(m["weight"], m["scales"], m.get("biases"), group_size=m.group_size, bits=m.bits,
                             mode=m.mode)

    def call(self: nn.QuantizedLinear, x: mx.array) -> mx.array:
        if self.mode != "affine":
            return linear_call(self, x)
        y = x @ weight(self).T
        return y + self["bias"] if "bias" in self else y

    def as_linear(self: nn.QuantizedEmbedding, x: mx.array) -> mx.array:
        return embedding_as_linear(self, x) if self.mode != "affine" else x @ weight(self).T

    nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear = call, as_linear
    try:
        yield
    finally:
        nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear = linear_call, embedding_as_linear


def _quantized_arrays(model: nn.Module) -> dict[str, mx.array]:
    """Codes, scales and biases of every affine quantized layer, by parameter name."""
    return {f"{p}.{k}": m[k] for p, m in model.named_modules()
            if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) and m.mode == "affine"
            for k in ("weight", "scales", "biases")}


def dwq(
    model: nn.Module,
    config: dict,
    rows: mx.array,
    *,
    steps: int | None = None,
    lr: float = DWQ_DEFAULTS["lr"],
    relative_lr: float | None = None,
    bits: int = DWQ_DEFAULTS["bits"],
    group_size: int = DWQ_DEFAULTS["group_size"],
    batch_size: int = 1,
    temperature: float = DWQ_DEFAULTS["temperature"],
    seed: int = DWQ_DEFAULTS["seed"],
    valid_rows: mx.array | None = None,
    dtype: mx.Dtype = mx.float16,
) -> tuple[nn.Module, dict, dict]:
    """mlx-lm's DWQ (``mlx_lm.quant.dwq.dwq_quantize``): the uniform ``bits``/``group_size`` model's scales and biases
    distilled against ``model``'s logits on token ``rows``.

    Starts from :func:`uniform` (the ``mlx-lm {bits}-bit g{group_size}`` row's model, 16-bit scales and biases),
    cast to float32, and runs mlx-lm's own ``dwq_quantize`` with dtype float32, ``model`` (the float32 source) as
    teacher (its full logits for each batch, as ``mlx_lm.dwq`` computes them without a target directory) and Adam
    with a constant learning rate and bias correction, as ``mlx_lm.dwq``'s ``main`` builds it. What DWQ trains is
    its own choice: the scales and biases of every affine layer under 8 bits, and every parameter it does not find
    frozen (the norm weights). DWQ makes one pass over its data, ``batch_size`` rows a step (rows of length L give
    L - 1 inputs and L - 1 scored positions); ``steps`` None: ``len(rows) // batch_size`` steps, else the rows are
    repeated in order up to ``steps * batch_size`` (DWQ shuffles the batches). ``relative_lr``: use
    ``relative_lr * median |scale|`` of the starting model as the (absolute) learning rate instead of ``lr``.
    ``valid_rows`` (None: ``rows``) are what DWQ reports its validation loss on, before and after; they change
    nothing. Quantized matmuls run through dequantized weights (:func:`dequantized_matmuls`). Scales, biases and
    norms are then stored in ``dtype``, as a 16-bit checkpoint would hold them.

    Returns the model, its config and a record: settings, steps, tokens, DWQ's validation losses, seconds, and the
    share of stored scales and biases the distillation changed.
    """
    from mlx.optimizers import Adam
    from mlx_lm.quant.dwq import dwq_quantize

    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] < 3:
        raise ValueError(f"rows must be [n, L] tokens with L >= 3, got shape {rows.shape}")
    if not 1 <= batch_size <= rows.shape[0]:
        raise ValueError(f"batch_size must be between 1 and the number of rows ({rows.shape[0]}), got {batch_size}")
    n_steps = rows.shape[0] // batch_size if steps is None else steps
    if n_steps < 1:
        raise ValueError(f"need steps >= 1, got {steps}")
    t0 = time.perf_counter()
    q, qconfig = uniform(model, config, bits, group_size, dtype=dtype)
    start = _quantized_arrays(q)
    _to_16_bit(q, mx.float32)
    if relative_lr is not None:
        scales = np.concatenate([np.abs(np.asarray(v.astype(mx.float32))).ravel()
                                 for k, v in start.items() if k.endswith(".scales")])
        lr = relative_lr * float(np.median(scales))
    order = [rows[i % rows.shape[0]].tolist() for i in range(n_steps * batch_size)]
    train = [(r, 0) for r in order]  # (tokens, offset): the items mlx-lm's iterate_batches takes
    valid = train if valid_rows is None else [(r, 0) for r in np.asarray(valid_rows).tolist()]

    def target_fn(batch: mx.array, idx: int, split: str) -> mx.array:
        return model(batch)

    log = io.StringIO()
    np_state = np.random.get_state()  # iterate_batches seeds numpy's global generator
    try:
        with dequantized_matmuls(), contextlib.redirect_stdout(log), contextlib.redirect_stderr(io.StringIO()):
            dwq_quantize(q, target_fn, Adam(learning_rate=lr, bias_correction=True), train, valid,
                         batch_size=batch_size, max_seq_length=rows.shape[1], seed=seed, dtype=mx.float32,
                         gradient_checkpoint=False, temperature=temperature)
    finally:
        np.random.set_state(np_state)
    q.eval()
    _to_16_bit(q, dtype)
    after = _quantized_arrays(q)
    changed = {kind: float(np.mean(np.concatenate([np.asarray(after[k] != start[k]).ravel()
                                                   for k in start if k.endswith("." + kind)])))
               for kind in ("scales", "biases")}
    losses = [float(v) for v in re.findall(r"Validation: it=\d+, loss=([-\d.e+]+)", log.getvalue())]
    record = {"bits": bits, "group_size": group_size, "rows": int(rows.shape[0]), "seq_len": int(rows.shape[1]),
              "steps": n_steps, "batch_size": batch_size, "tokens": n_steps * batch_size * (int(rows.shape[1]) - 1),
              "lr": lr, "relative_lr": relative_lr, "temperature": temperature, "seed": seed,
              "valid_rows": len(valid), "valid_loss": losses, "changed": changed,
              "seconds": time.perf_counter() - t0}
    return q, qconfig, record

# --------------------------------------------------------------------------- planning baselines
def greedy_single_pass(measurement: Measurement, target_bpw: float, **kw: Any) -> Plan:
    """Baseline: a single greedy pass with no backtracking.

    Start from the cheapest options and upgrade by best damage decrease per bit
    until no upgrade fits.
    """
    t0 = time.perf_counter()
    p = build_problem(measurement, target_bpw, **kw)
    check_range(p)
    choice = [int(np.argmin(np.where(it.bits == it.bits.min(), it.damage, np.inf))) for it in p.items]
    used = sum(int(it.bits[j]) for it, j in zip(p.items, choice))

    def best_upgrade(i: int) -> tuple[float, int] | None:
        it = p.items[i]
        db = it.bits - it.bits[choice[i]]
        dd = it.damage - it.damage[choice[i]]
        ok = (db > 0) & (dd < 0) & (db <= p.budget - used)
        if not ok.any():
            return None
        r = np.where(ok, -dd / np.maximum(db, 1), -np.inf)
        j = int(np.argmax(r))
        return float(r[j]), j

    heap = []
    for i in range(len(p.items)):
        b = best_upgrade(i)
        if b is not None:
            heapq.heappush(heap, (-b[0], i, b[1], choice[i]))
    while heap:
        _, i, j, frm = heapq.heappop(heap)
        it = p.items[i]
        if frm != choice[i] or it.bits[j] - it.bits[frm] > p.budget - used:
            b = best_upgrade(i)  # stale or no longer fits: re-rank this item
            if b is not None:
                heapq.heappush(heap, (-b[0], i, b[1], choice[i]))
            continue
        used += int(it.bits[j] - it.bits[frm])
        choice[i] = j
        b = best_upgrade(i)
        if b is not None:
            heapq.heappush(heap, (-b[0], i, b[1], choice[i]))
    p.settings["baseline"] = "greedy single pass"
    return make_plan(p, measurement, choice, None, "greedy-single-pass", t0)


def _nearest_choice(it: Item, opt: QuantOption) -> tuple[int, bool]:
    """The item's choice equal to ``opt`` for every member (exact: True), else the one nearest in bpw."""
    def options_of(c: Any) -> list:
        if c is None:
            return [QuantOption.fp16()]
        if isinstance(c, OptionRecord):
            return [c.option]
        return [QuantOption.fp16() if r is None else r.option for r in c.members.values()]

    for j, c in enumerate(it.choices):
        if all(o == opt for o in options_of(c)):
            return j, True
    same_bits = [j for j, c in enumerate(it.choices)
                 if all(not o.is_mixed and o.max_bits == opt.max_bits for o in options_of(c))]
    pool = same_bits or range(len(it.choices))
    want = opt.nominal_bpw()
    return min(pool, key=lambda j: (abs(it.bits[j] / it.numel - want), it.damage[j])), False


def dynamic_quant_threshold(
    measurement: Measurement,
    target_bpw: float,
    low_bits: int = 4,
    high_bits: int = 5,
    *,
    low_group_size: int = 64,
    high_group_size: int = 64,
    **kw: Any,
) -> Plan:
    """Baseline: mlx-lm's dynamic_quant two-level rule on this measurement.

    mlx-lm ranks tensors by sensitivity per million weights (the loss change
    between low and high bits) and puts those above a threshold, found by
    bisection on the bpw, at high bits. Here sensitivity is the measured damage
    difference between the low and high option per million weights, and the
    threshold is set exactly: the most sensitive tensors go high while the plan fits.
    """
    t0 = time.perf_counter()
    p = build_problem(measurement, target_bpw, **kw)
    lo_opt = QuantOption.uniform(low_bits, low_group_size)
    hi_opt = QuantOption.uniform(high_bits, high_group_size)
    low_x = [_nearest_choice(it, lo_opt) for it in p.items]
    high_x = [_nearest_choice(it, hi_opt) for it in p.items]
    low, high = [j for j, _ in low_x], [j for j, _ in high_x]
    exact = sum(a and b for (_, a), (_, b) in zip(low_x, high_x))
    used = sum(int(it.bits[j]) for it, j in zip(p.items, low))
    top = sum(int(it.bits[j]) for it, j in zip(p.items, high))
    if not used <= p.budget <= top:
        raise range_error(p, used, max(top, used), f"outside the two-level range of {lo_opt.desc} / {hi_opt.desc}")
    sens = [(float(it.damage[lj] - it.damage[hj]) / (it.numel / 1e6), i)
            for i, (it, lj, hj) in enumerate(zip(p.items, low, high))]
    sens.sort(key=lambda s: (-s[0], s[1]))
    choice = list(low)
    for _, i in sens:
        it = p.items[i]
        extra = int(it.bits[high[i]] - it.bits[low[i]])
        if used + extra > p.budget:
            break
        choice[i] = high[i]
        used += extra
    p.settings["baseline"] = (f"mlx-lm dynamic_quant rule {lo_opt.desc} / {hi_opt.desc} "
                              f"({exact}/{len(p.items)} items had both measured; others use the nearest option)")
    return make_plan(p, measurement, choice, None, "dynamic-quant-threshold", t0)

