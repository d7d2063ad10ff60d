"""Predicted cost of ``measure`` and ``convert`` from the model's shapes alone (no weights loaded).

The work is counted in multiply-adds from the tensor shapes (the skeleton is
built lazily: MLX arrays are never evaluated), turned into time with the
machine's float32 matmul rate (timed here in a fraction of a second, or given),
and the peak memory and disk follow the streaming design: the calibration rows'
hidden states, plus the larger of three stages: one decoder layer (the embedding
and head released meanwhile), the embedding/head (an untied model's in their
16-bit source dtype, a tied table in float32) with the head's logits
``HEAD_CHUNK`` positions at a time and the head-KL reference cache, or the
embedding pass (the table in float32). The time is a floor (matmul-bound work at the plain-matmul rate): the
quantizers' bookkeeping makes real runs slower; ``TIME_FACTOR`` is the ratio
observed on the benchmark machine (see ``benchmarks/scale.py``).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Sequence

from mlx_dq.quant.scale_search import BATCH_ELEMENTS

BASE_RSS = 600 * 2**20  # Python, MLX, mlx-lm, tokenizer: measured on an empty measure run
TIME_FACTOR = 3.0  # real seconds / matmul-bound seconds observed on a 2-core CPU (GPTQ bookkeeping, small matmuls)
FIXED_S = 5.0  # start-up: imports, tokenizer, calibration text
# per (tensor, option) overhead that does not scale with the shapes (Python bookkeeping, small arrays), set from
# the README command's run (docs/cost.md#figures-behind-the-code)
OPTION_S = {"rtn": 0.1, "gptq": 0.1}
TENSOR_S = 0.15  # per tensor overhead of convert
JSON_BYTES_PER_OPTION = 600  # measurement JSON per (tensor, option)
QUANT_COPIES = 6  # float32 copies of the largest block of rows alive while it is quantized (GPTQ working arrays)
CLIP_SEARCH_BYTES = 3 * 4 * BATCH_ELEMENTS  # the batched clip search's live float32 candidate arrays (one row chunk):
# the converter's scale search (GPTQ) and rounding use it, a measurement only with --clip


@dataclass
class Estimate:
    """Predicted work, time, peak memory and disk of one run."""

    what: str
    macs: float = 0.0
    measurements: int = 0  # (tensor, option) errors measured
    seconds: float = 0.0
    peak_bytes: int = 0
    disk_bytes: int = 0
    flops: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)
    factor: float = TIME_FACTOR  # real / matmul-bound seconds assumed for this kind of run

    def lines(self) -> list[str]:
        """Human-readable summary, one fact a line."""
        return [
            f"{self.what}: {self.macs / 1e12:.2f} T multiply-adds"
            + (f", {self.measurements} (tensor, option) errors" if self.measurements else ""),
            f"  time: about {format_seconds(self.seconds)} at {self.flops / 1e9:.1f} GFLOP/s float32 matmul "
            f"(x{self.factor:g} for " + ("the quantizers' own overhead)" if self.factor == TIME_FACTOR
                                         else "autograd and dequantizing)"),
            f"  peak memory: about {self.peak_bytes / 2**30:.2f} GiB",
            f"  disk: about {self.disk_bytes / 2**20:.1f} MiB written",
        ]


def physical_memory() -> int | None:
    """Bytes of memory this machine has (Linux, macOS), or None where the system does not say."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def summary_line(parts: Sequence[Estimate], memory: int | None = None) -> str:
    """The one line said before a run starts: its predicted time, peak memory and disk, and a warning when the
    peak is above ``memory`` (the machine's), so a user learns it before hours of work, not after."""
    seconds = sum(p.seconds for p in parts)
    peak = max((p.peak_bytes for p in parts), default=0)
    disk = sum(p.disk_bytes for p in parts)
    line = (f"expected: about {format_seconds(seconds)} on this machine, peak memory about {peak / 2**30:.1f} GiB, "
            f"{disk / 2**20:.0f} MiB written (--estimate: the parts)")
    if memory is not None and peak > memory:
        line += (f"; WARNING: this machine has {memory / 2**30:.1f} GiB of memory, so the run may swap heavily "
                 "or be stopped by the system")
    return line


def format_seconds(s: float) -> str:
    """A duration for people: seconds, minutes or hours."""
    return f"{s:.0f} s" if s < 120 else (f"{s / 60:.1f} min" if s < 7200 else f"{s / 3600:.1f} h")


def _rate(flops: float | None) -> float:
    """``flops`` checked (a positive finite FLOP/s; InputError otherwise), or this machine's rate timed when None."""
    if flops is None:
        return matmul_flops()
    from mlx_dq.safety import finite_number

    return finite_number(flops, "flops (float32 FLOP/s)", positive=True)


def matmul_flops(n: int = 1024) -> float:
    """FLOP/s of a plain float32 ``mx.matmul`` [n, n] x [n, n] on the default device (best of 3)."""
    import mlx.core as mx

    a, b = mx.random.normal((n, n)), mx.random.normal((n, n))
    mx.eval(a, b, a @ b)
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        mx.eval(a @ b)
        best = min(best, time.perf_counter() - t)
    return 2 * n**3 / best


def _shapes(source: Any) -> tuple[list[list[tuple[str, tuple[int, ...]]]], list[tuple[str, tuple[int, ...]]], int,
                                  set[str]]:
    """Per decoder layer the (path, weight shape) of its quantizable tensors, the other ones, the hidden size and
    which of the other ones are lookup tables only (:func:`mlx_dq.model.runner.lookup_tables`)."""
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.runner import align_to_source, layer_prefix, lookup_tables
    from mlx_dq.model.sources import build_model
    from mlx_dq.names import role_of

    model = build_model(source.config)
    align_to_source(model, source.weight_names())
    prefix = layer_prefix(model, model.layers)
    layers = [[(p, tuple(int(d) for d in m.weight.shape))
               for p, m in quantizable_modules(layer, prefix=f"{prefix}{i}.").items() if role_of(p) is not None]
              for i, layer in enumerate(model.layers)]
    outside = {p: m for p, m in quantizable_modules(model).items()
               if not p.startswith(prefix) and role_of(p) is not None}
    other = [(p, tuple(int(d) for d in m.weight.shape)) for p, m in outside.items()]
    hidden = int(source.config.get("hidden_size") or other[0][1][-1])
    return layers, other, hidden, set(lookup_tables(outside))


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _block_numel(shape: tuple[int, ...]) -> int:
    """Elements quantized at once for a weight of ``shape``: one block of output rows (:func:`mlx_dq.quant.dispatch.row_blocks`)."""
    from mlx_dq.quant.dispatch import row_blocks

    blocks = row_blocks(shape)
    if blocks is None:
        return _numel(shape)
    return (blocks[0].stop - blocks[0].start) * _numel(shape) // shape[-2]


def _fitting(grid: dict, path: str, in_f: int) -> list:
    from mlx_dq.names import role_of
    from mlx_dq.quant.options import QuantOption

    return [o for o in grid[role_of(path)] if o.fits(in_f)] or [QuantOption.fp16()]


def estimate_measure(source: Any, *, rows: int = 16, seq_len: int = 512, grid: Any = None, method: str = "gptq",
                     importance_rows: int | None = None, kl_scale: bool = True, sample_rows: int | None = None,
                     flops: float | None = None, clip: bool = False) -> Estimate:
    """Predicted cost of :func:`mlx_dq.measure.stream.measure` with these settings (shapes only); ``clip``: the clip
    candidates searched (their batched arrays held)."""
    from mlx_dq.measure.grids import load_grid
    from mlx_dq.measure.head import HEAD_SAMPLE_FACTOR
    from mlx_dq.measure.head_kl import REF_CACHE_BYTES
    from mlx_dq.measure.stream import KL_SAMPLE_LAYERS
    from mlx_dq.model.runner import HEAD_CHUNK
    from mlx_dq.quant.dispatch import row_blocks

    grid_map = grid if isinstance(grid, dict) else load_grid(grid)
    from mlx_dq.settings import MeasureSettings

    sample_rows = MeasureSettings.sample_rows if sample_rows is None else sample_rows
    importance_rows = MeasureSettings.importance_rows if importance_rows is None else importance_rows
    layers, other, hidden, lookup_only = _shapes(source)
    tokens, imp = rows * seq_len, min(importance_rows, rows) * seq_len
    # GPTQ: its triangular updates (out x in^2 / 2), the error from its own errors; rounding: the error against the Gram
    per_opt = 0.5 if method == "gptq" else 1
    macs, n_meas, biggest_layer = 0.0, 0, 0
    for tensors in layers:
        params = sum(_numel(s) for _, s in tensors)
        biggest_layer = max(biggest_layer, params)
        macs += 2 * tokens * params + 3 * imp * params  # forward (+ the layer's Grams), importance reruns
        for path, s in tensors:
            opts = _fitting(grid_map, path, s[-1])
            n_meas += len(opts)
            out = min(s[-2], sample_rows) if sample_rows else s[-2]
            macs += (len(opts) - 1) * out * s[-1] ** 2 * per_opt + s[-2] * s[-1] ** 2 * per_opt
            macs += out * s[-1] ** 2  # the meter's reference sum (the row energies come from the forward)
    vocab = max((s[0] for _, s in other), default=0)
    heads = [(p, s) for p, s in other]
    macs += imp * vocab * hidden  # the importance rows' logits (the base perplexity; the Gram needs none)
    if kl_scale and vocab:  # the copies carried to the logits (sampled layers, the lookup table): one pass each
        macs += (min(KL_SAMPLE_LAYERS, len(layers)) + 1) * imp * vocab * hidden
    head_extra = 0
    for path, s in heads:
        opts = _fitting(grid_map, path, s[-1])
        n_meas += len(opts)
        if path in lookup_only:  # metered on its looked-up rows only: elementwise work, no multiply-adds
            continue
        full = len(opts)
        sampled = min(s[-2], HEAD_SAMPLE_FACTOR * sample_rows + min(tokens, s[-2]))  # + every looked-up row
        if kl_scale and sample_rows and full > 2 and sampled < s[-2]:  # two anchors end to end, the rest sampled
            full = 2  # the rest: quantized and their damage predicted from the error against the Gram
            macs += (len(opts) - full) * sampled * s[-1] ** 2 * (per_opt + 1) + s[-2] * s[-1] ** 2  # + energies
        macs += full * s[-2] * s[-1] ** 2 * per_opt + s[-2] * s[-1] ** 2  # + the meter's reference sum
        if kl_scale:
            cached = min(REF_CACHE_BYTES, imp * vocab * 4)
            recompute = 1 - cached / max(1, imp * vocab * 4)
            if row_blocks(s) is not None:  # KL block by block: original and quantized rows each time, + the
                # reference pass (its log-normaliser, with the carried copies)
                macs += (2 * full + 1) * imp * vocab * hidden
            else:
                macs += full * imp * vocab * hidden * (1 + recompute)  # each full option's KL (+ recomputed refs)
            head_extra = cached
    f = _rate(flops)
    held = _held_bytes(source, untied=bool(lookup_only))
    other_f32 = _outside_bytes(other, held[1])
    largest = max([_numel(s) for t in layers for _, s in t] + [_numel(s) for _, s in other])
    states = 4 * tokens * hidden * 2  # hidden states of the calibration rows and the next layer's
    logits = 4 * HEAD_CHUNK * vocab * 4  # one chunk's logits, log-softmax and KL temporaries
    one_block = [_numel(s) for _, s in heads if row_blocks(s) is None]
    if kl_scale and one_block:  # a head of one row block: its KL swaps in a whole dequantized float32 copy
        head_extra += 4 * max(one_block)
    peak = BASE_RSS + states + max(_probe_bytes(other, lookup_only), (CLIP_SEARCH_BYTES if clip else 0)
                                   + _stage_peak(layers, other, biggest_layer, other_f32 + logits + head_extra, method,
                                                 held[0]))  # RTN: options per Gram block
    disk = 4 * tokens * hidden + 4 * KL_STATE * imp * hidden + JSON_BYTES_PER_OPTION * n_meas  # state + JSON
    seconds = TIME_FACTOR * 2 * macs / f + FIXED_S + OPTION_S.get(method, 0.3) * n_meas
    return Estimate("measure", macs=macs, measurements=n_meas, seconds=seconds, peak_bytes=peak,
                    disk_bytes=int(disk), flops=f,
                    detail={"layers": len(layers), "tokens": tokens, "vocab": vocab, "largest_tensor": largest})


def _outside_bytes(other: list, per_weight: int = 6) -> int:
    """Bytes of the tensors outside the layers held at once: the largest at ``per_weight`` bytes a weight while it
    loads and is measured (an untied embedding and its head are loaded, measured and released one after the other)."""
    return per_weight * max([_numel(s) for _, s in other] + [0])


def _held_bytes(source: Any, untied: bool = False) -> tuple[int, int]:
    """Bytes a weight holds: in a decoder layer (its 16-bit source dtype kept) and in the largest outside table while
    it is measured or quantized (an untied model's head and table keep a 16-bit source dtype; a tied table is
    float32, read by rows from 16-bit safetensors; with its whole source copy beside it from GGUF)."""
    dtypes = source.stored_dtypes() if hasattr(source, "stored_dtypes") else None
    if not dtypes:
        return 4, 6
    half = dtypes <= {"float16", "bfloat16"}
    return (2 if half else 4), (2 if half and untied else 4 if half or dtypes == {"float32"} else 6)


def _probe_bytes(other: list, lookup_only: set) -> int:
    """The embedding pass's float32 lookup table (an untied model's; a tied one is counted with the head): that
    pass holds nothing else of note."""
    return 4 * max([_numel(s) for p, s in other if p in lookup_only] + [0])


def _stage_peak(layers: list, other: list, biggest_layer: int, outside_bytes: int, method: str = "gptq",
                weight_bytes: int = 4) -> int:
    """Bytes of the larger stage: a decoder layer (the embedding and head released) or the embedding/head stage."""
    def block(shapes: list) -> int:
        return QUANT_COPIES * 4 * max([_block_numel(s) for _, s in shapes] + [0])

    layer_stage = max([_layer_bytes(t, method, weight_bytes) + block(t) for t in layers] + [2 * 4 * biggest_layer])
    return max(layer_stage, outside_bytes + block(other))


def _layer_bytes(tensors: list, method: str, weight_bytes: int = 4) -> int:
    """One decoder layer's weights (``weight_bytes`` each), the Grams of its inputs (the tensors of one block with one input width
    share one: q/k/v, gate/up) and, for GPTQ, the factor of the widest shared input (one ``k x k`` buffer beside
    its Gram; a tensor's own Gram becomes its factor in place, :func:`mlx_dq.quant.gptq.consume_gram`).

    Why the Grams: at Llama-3-70B shapes the 28,672-channel ``down_proj`` input's Gram is 3.3 GB, about the
    layer's weights."""
    weights = weight_bytes * sum(_numel(s) for _, s in tensors)
    inputs = Counter((p.rsplit(".", 1)[0], s[-1], s[0] if len(s) == 3 else 1) for p, s in tensors)
    grams = 4 * sum(banks * k * k for _, k, banks in inputs)
    shared = max((banks * k * k for (_, k, banks), n in inputs.items() if n > 1 or banks > 1), default=0)
    return weights + grams + (4 * shared if method == "gptq" else 0)


KL_STATE = 9  # perturbed copies of the importance rows carried for the KL scale (KL_SAMPLE_LAYERS) and the lookup


def estimate_convert(source: Any, *, bpw: float | None, rows: int = 32, seq_len: int = 512, method: str = "gptq",
                     measure_first: bool = True, measure_kwargs: dict | None = None,
                     measurement_bytes: int | None = None,
                     flops: float | None = None) -> tuple[Estimate, Estimate | None]:
    """Predicted cost of :func:`mlx_dq.conversion.pipeline.convert` (and of the measurement it runs first when none is given).

    ``measurement_bytes``: size of a given measurement file (copied into the output).
    """
    layers, other, hidden, lookup_only = _shapes(source)
    f = _rate(flops)
    meas = estimate_measure(source, method=method, flops=f, **(measure_kwargs or {})) if measure_first else None
    tokens = rows * seq_len
    # GPTQ's updates (out x in^2 / 2; the record's error is GPTQ's own, its reference sum the forward's output
    # energy); rounding: the record's error and reference sums against the Gram
    per_q = 0.5 if method == "gptq" else 2
    macs, biggest_layer = 0.0, 0
    quant_params = 0
    for tensors in layers:
        params = sum(_numel(s) for _, s in tensors)
        quant_params += params
        biggest_layer = max(biggest_layer, params)
        macs += 2 * tokens * params  # forward + Grams, then the sequential forward with quantized weights
        macs += sum(_numel(s) * s[-1] for _, s in tensors) * per_q
    vocab = max((s[0] for _, s in other), default=0)
    # the head's Gram needs no logits, so its record's reference sum is multiplied out against the Gram
    macs += sum(_numel(s) * s[-1] for _, s in other) * (per_q + 1 if method == "gptq" else per_q)
    quant_params += sum(_numel(s) for _, s in other)
    total_params = sum(_numel(s) for _, s in _all_params(source))
    bits = bpw if bpw is not None else 16.0
    n_tensors = sum(len(t) for t in layers) + len(other)
    if measurement_bytes is None:  # the measurement JSON is copied into the output
        n_opts = (meas or estimate_measure(source, method=method, flops=f, **(measure_kwargs or {}))).measurements
        measurement_bytes = JSON_BYTES_PER_OPTION * n_opts
    disk = quant_params * bits / 8 + (total_params - quant_params) * 2 + _side_bytes(source) \
        + measurement_bytes + 500 * n_tensors + 16 * 2**10  # weights, tokenizer, JSON records, card
    held = _held_bytes(source, untied=bool(lookup_only))
    peak = BASE_RSS + 4 * tokens * hidden * 2 + max(_probe_bytes(other, lookup_only), CLIP_SEARCH_BYTES + _stage_peak(
        layers, other, biggest_layer, _outside_bytes(other, held[1]) + 4 * 128 * vocab * 2, method, held[0]))
    if meas is not None:
        peak = max(peak, meas.peak_bytes)
    est = Estimate("convert" + (" (quantize stage)" if meas is not None else ""), macs=macs,
                   seconds=TIME_FACTOR * 2 * macs / f + FIXED_S + TENSOR_S * n_tensors, peak_bytes=peak, disk_bytes=int(disk), flops=f,
                   detail={"quantized_params": quant_params, "bpw": bits})
    return est, meas


# distillation: real / matmul-bound seconds (autograd, dequantizing every step), set from a SmolLM2-135M run
# (docs/cost.md#figures-behind-the-code)
DISTILL_TIME_FACTOR = 3.0


def estimate_distill(source: Any, *, rows: int, seq_len: int, steps: int, batch_size: int = 1,
                     flops: float | None = None) -> Estimate:
    """Predicted cost of distilling a quantized ``source`` (:func:`mlx_dq.conversion.distill.distill_model`), shapes only.

    Each step is a forward and a backward pass (three times the forward's multiply-adds) through the
    dequantized float32 weights; the source's log-probabilities and the KL before and after are one
    forward pass over every row each. Peak memory: the float32 source and student, Adam's two moments
    of the trained scales and biases, and the cached source log-probabilities.
    """
    params = _all_params(source)
    total = sum(_numel(s) for _, s in params)
    layers, other, hidden, _ = _shapes(source)
    vocab = max((s[0] for _, s in other), default=0)
    f = _rate(flops)
    macs = 3.0 * steps * batch_size * (seq_len - 1) * total + 3.0 * rows * (seq_len - 1) * total
    from mlx_dq.settings import TEACHER_CACHE_BYTES

    cache = rows * (seq_len - 1) * vocab * 4
    peak = BASE_RSS + 3 * 4 * total + min(cache, TEACHER_CACHE_BYTES) \
        + 4 * 4 * batch_size * seq_len * max(vocab, hidden)
    return Estimate(f"distill ({steps} steps, {rows} x {seq_len} tokens)", macs=macs,
                    seconds=DISTILL_TIME_FACTOR * 2 * macs / f + FIXED_S, peak_bytes=int(peak), disk_bytes=0, flops=f,
                    detail={"params": total}, factor=DISTILL_TIME_FACTOR)


def _all_params(source: Any) -> list[tuple[str, tuple[int, ...]]]:
    from mlx.utils import tree_flatten

    from mlx_dq.model.runner import align_to_source
    from mlx_dq.model.sources import build_model

    model = build_model(source.config)
    align_to_source(model, source.weight_names())
    return [(k, tuple(int(d) for d in v.shape)) for k, v in tree_flatten(model.parameters())]


def _side_bytes(source: Any) -> int:
    """Bytes of the source folder's files other than weights (tokenizer, config), copied into the output."""
    from pathlib import Path

    path = Path(getattr(source, "path", "") or "")
    if not path.is_dir():
        return 2**20
    return sum(f.stat().st_size for f in path.iterdir()
               if f.is_file() and not f.name.endswith((".safetensors", ".gguf", ".bin", ".pt", ".pth")))
