"""Forward paths for mixed-proportion weights: a fused Metal kernel and its portable twin.

A mixed weight is stored as segments of input channels (act-order: column ``j``
of the concatenated segments is original input channel ``perm[j]``), each an MLX
affine-quantized block with its own bits and group size. Paths, chosen by
:func:`matmul_path` from :func:`backend`, the rows of x and :func:`cpu_cache_enabled`:

* Metal, decode (at most ``DECODE_MAX_ROWS`` rows of x): ONE fused kernel
  (``KERNEL_SOURCE`` through ``mx.fast.metal_kernel``) reads x through the
  permutation and accumulates every segment in a single pass.
* Metal, prefill (more rows) and expert banks: x is permuted once, split by
  segment, and MLX's ``quantized_matmul`` / ``gather_qmm`` results are summed.
* Another GPU backend (MLX's CUDA build): the same per-segment quantized matmuls
  for any number of rows; the weight stays at its packed size.
* CPU, cache on (the default, ``MLX_DQ_CPU_CACHE`` unset or ``1``): the weight is
  dequantized once in float32 with the permutation folded in (``W[:, argsort(perm)]``)
  and cached; every call is one fp32 matmul, because MLX's CPU ``quantized_matmul``
  is far slower (docs/cost.md#figures-behind-the-code). Memory cost of the cache: 4
  bytes per weight (out*in*4 bytes per layer, e.g. 64 MiB for 4096x4096), on top of
  the packed codes; ``clear_cache()`` on a layer drops it.
* CPU, cache off (``MLX_DQ_CPU_CACHE=0`` or :func:`set_cpu_cache`): nothing but the
  packed weight is kept. Up to ``CPU_QMM_MAX_ROWS`` rows (decode) go through the
  per-segment quantized matmuls (memory-bound: as fast as the cached path at 8B shapes,
  2-50x slower on SmolLM2's small layers); more rows (prefill) read x through the
  permutation and dequantize the weight. Both take the weight one block of output rows
  after another, ``CPU_CHUNK_BYTES`` of float32 per block (the dequantized rows, or
  the rows' scales and biases widened to float32 for the quantized matmul), so the
  transient float32 is a few blocks, not the weight: MLX's CPU backend allocates an
  op's output when it dispatches the op, up to about a hundred ops ahead of the
  computation, so the size of each block is what bounds it (SmolLM2's tied head with its
  scales widened whole took 3.6 MiB per decoded token, 2 MiB blocks 12 MiB over a
  prefill: benchmarks/results/apple_silicon.md has the figures).

What is and is not verified on a machine without Apple silicon:

* Verified (tests/test_kernels.py): the kernel MLX generates for our call, i.e.
  its own signature and template line wrapped around ``KERNEL_SOURCE`` verbatim,
  captured with ``mx.export_function`` + ``verbose=True`` (no GPU needed), is
  compiled by g++ (C++20) with the same template arguments MLX would instantiate.
  The harness only supplies what C++ lacks: ``device``/``constant`` defined empty,
  ``[[...]]`` attributes ignored, ``float16_t`` = ``_Float16``, ``bfloat16_t`` a
  round-to-nearest-even struct, ``uint3``, and ``metal::simd_sum`` as a barrier
  reduction over 32 real threads (one per lane, grid (32, N): one simdgroup per
  output row). It runs on random inputs for every bits in {2,3,4,5,6,8} x group
  in {32,64,128} and random mixed options (2-6 segments, boundaries off multiples
  of 512, odd N, 1..8 rows of x, fp32/fp16/bf16 x, fp16/bf16 scales, uint16 and
  uint32 permutations, segments with more than 32 chunks so lanes loop) against a
  numpy float64 dequantize-then-matmul reference, within 2e-6 (fp32 output) /
  1e-3 (fp16) / 4e-3 (bf16) of the largest output. This covers the code
  extraction across uint32 word boundaries, per-segment scales/biases, reads of x
  through the permutation, per-lane accumulation and the 32-lane reduction. A
  flipped code bit is detected (the comparison is not vacuous).
* Verified: the generated source contains ``KERNEL_SOURCE`` with the expected
  template arguments and buffer types; the launch uses the geometry the harness
  emulates (grid (32, N, 1), 32-wide threadgroups); the Python side of the Metal branch
  (which path for how many rows, per-segment ``quantized_matmul``/``gather_qmm``
  with the permutation) runs against numpy on MLX's CPU implementations of those ops.
* NOT verified here: that Apple's Metal compiler accepts the source; Metal-specific
  semantics (address spaces, which the harness erases; the hardware ``simd_sum``
  reduction order, emulated here as a lane-order sum; half/bfloat conversions on the
  GPU); that a (32, 4, 1) threadgroup forms one simdgroup per grid row (the harness
  assumes it; Metal numbers threads x-fastest); partial threadgroups at the grid
  edge; the Metal quantized matmuls
  themselves; kernel compile time (one build per layer shape and option) and any
  speed. ``test_metal_kernel_matches_portable`` (tests/test_kernels.py) and
  ``test_metal_layers_match_dequantized_matmul`` (tests/test_mixed.py) run the real
  kernel and layers on Apple silicon and are skipped elsewhere.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.errors import InputError

DECODE_MAX_ROWS = 8  # rows of x up to which the fused kernel runs (its acc[] size)
# CPU without the cache: rows of x up to which the per-segment quantized matmuls run; beyond, blocks are
# dequantized (MLX's CPU quantized matmul costs about one dequantization per 4 rows at SmolLM2 shapes)
CPU_QMM_MAX_ROWS = 4
# float32 bytes of one block of output rows (CPU, cache off): the peak over a forward grows with it (several
# blocks are allocated ahead of the computation); prefill slows below it (more, smaller matmuls)
CPU_CHUNK_BYTES = 512 << 10
CPU_CACHE_ENV = "MLX_DQ_CPU_CACHE"
MAX_SEGMENTS = 6  # one segment per distinct bit width in {8,6,5,4,3,2}
SIMD_WIDTH = 32
ROWS_PER_THREADGROUP = 4  # simdgroups (one output row each) per threadgroup

KERNEL_NAME = "mlx_dq_mixed_qmv"

# Body of the fused decode kernel, written in the subset of Metal Shading Language
# that is also C++ (tests compile this very string with g++). One simdgroup
# computes one output row: lane l takes chunks l, l+32, ... of 32 codes of every
# segment (a chunk is exactly BITS uint32 words and lies in one group), extracts
# codes across word boundaries, reads x through the permutation, and keeps
# sum(x*q) and sum(x) so that acc += scale*sum(x*q) + bias*sum(x).
# Template constants: T (output type), M (rows of x, <= 8), N, K, and per segment
# s in 0..5: BITSs, GROUPs, WIDTHs (WIDTHs == 0: unused segment).
KERNEL_SOURCE = r"""
#define MIXDQ_SEGMENT(WQ, SC, BI, BITS, GS, WIDTH, START)                       \
  {                                                                            \
    const uint32_t words_per_row = (uint32_t)(WIDTH) * (uint32_t)(BITS) / 32u; \
    const uint32_t groups_per_row = (uint32_t)(WIDTH) / (uint32_t)(GS);        \
    const uint32_t mask = (1u << (uint32_t)(BITS)) - 1u;                       \
    const uint32_t chunks = (uint32_t)(WIDTH) / 32u;                           \
    for (uint32_t c = lane; c < chunks; c += 32u) {                            \
      uint32_t wb[8];                                                          \
      for (uint32_t i = 0; i < (uint32_t)(BITS); ++i) {                        \
        wb[i] = WQ[row * words_per_row + c * (uint32_t)(BITS) + i];            \
      }                                                                        \
      const uint32_t g = (c * 32u) / (uint32_t)(GS);                           \
      const float scale = float(SC[row * groups_per_row + g]);                 \
      const float bias = float(BI[row * groups_per_row + g]);                  \
      float qx[8];                                                             \
      float xs[8];                                                             \
      for (int m = 0; m < M; ++m) {                                            \
        qx[m] = 0.0f;                                                          \
        xs[m] = 0.0f;                                                          \
      }                                                                        \
      for (uint32_t j = 0; j < 32u; ++j) {                                     \
        const uint32_t bit = j * (uint32_t)(BITS);                             \
        const uint32_t wi = bit >> 5;                                          \
        const uint32_t off = bit & 31u;                                        \
        uint32_t q = wb[wi] >> off;                                            \
        if (off + (uint32_t)(BITS) > 32u) {                                    \
          q |= wb[wi + 1] << (32u - off);                                      \
        }                                                                      \
        q &= mask;                                                             \
        const float qf = float(q);                                             \
        const uint32_t col = (uint32_t)(perm[(uint32_t)(START) + c * 32u + j]); \
        for (int m = 0; m < M; ++m) {                                          \
          const float xv = float(x[(uint32_t)m * (uint32_t)K + col]);          \
          qx[m] += xv * qf;                                                    \
          xs[m] += xv;                                                         \
        }                                                                      \
      }                                                                        \
      for (int m = 0; m < M; ++m) {                                            \
        acc[m] += scale * qx[m] + bias * xs[m];                                \
      }                                                                        \
    }                                                                          \
  }

  const uint32_t lane = (uint32_t)thread_index_in_simdgroup;
  const uint32_t row = (uint32_t)thread_position_in_grid.y;
  if (row >= (uint32_t)N) {
    return;
  }
  float acc[8];
  for (int m = 0; m < M; ++m) {
    acc[m] = 0.0f;
  }
  MIXDQ_SEGMENT(w0, s0, b0, BITS0, GROUP0, WIDTH0, 0)
  MIXDQ_SEGMENT(w1, s1, b1, BITS1, GROUP1, WIDTH1, WIDTH0)
  MIXDQ_SEGMENT(w2, s2, b2, BITS2, GROUP2, WIDTH2, WIDTH0 + WIDTH1)
  MIXDQ_SEGMENT(w3, s3, b3, BITS3, GROUP3, WIDTH3, WIDTH0 + WIDTH1 + WIDTH2)
  MIXDQ_SEGMENT(w4, s4, b4, BITS4, GROUP4, WIDTH4, WIDTH0 + WIDTH1 + WIDTH2 + WIDTH3)
  MIXDQ_SEGMENT(w5, s5, b5, BITS5, GROUP5, WIDTH5, WIDTH0 + WIDTH1 + WIDTH2 + WIDTH3 + WIDTH4)
  for (int m = 0; m < M; ++m) {
    const float total = metal::simd_sum(acc[m]);
    if (lane == 0u) {
      out[(uint32_t)m * (uint32_t)N + row] = static_cast<T>(total);
    }
  }
#undef MIXDQ_SEGMENT
"""

KERNEL_INPUTS = ["x", "perm"] + [f"{k}{i}" for i in range(MAX_SEGMENTS) for k in ("w", "s", "b")]
KERNEL_OUTPUTS = ["out"]

_kernel = None


_cpu_cache: bool | None = None  # set_cpu_cache's choice; None: the environment decides


def backend() -> str:
    """Where MLX runs by default: ``"metal"``, ``"gpu"`` (another GPU backend, e.g. CUDA) or ``"cpu"``."""
    if mx.default_device() != mx.gpu:
        return "cpu"
    return "metal" if mx.metal.is_available() else "gpu"


def metal_active() -> bool:
    """True when MLX runs on a Metal GPU by default (fused kernel and quantized matmuls apply)."""
    return backend() == "metal"


def cpu_cache_enabled() -> bool:
    """Whether mixed layers keep a float32 copy of their weight on the CPU (faster, 4 bytes per weight).

    :func:`set_cpu_cache` decides when it was called; otherwise ``MLX_DQ_CPU_CACHE``
    (``0``/``off``/``false``/``no``: off; unset, ``1``/``on``/``true``/``yes``: on).
    """
    if _cpu_cache is not None:
        return _cpu_cache
    raw = os.environ.get(CPU_CACHE_ENV, "").strip().lower()
    if raw in ("", "1", "on", "true", "yes"):
        return True
    if raw in ("0", "off", "false", "no"):
        return False
    raise InputError(f"{CPU_CACHE_ENV}={raw!r}: use 1 (keep a float32 copy of mixed weights on the CPU) or 0 "
                     "(compute from the packed weights: the model stays at its file size)")


def set_cpu_cache(enabled: bool | None) -> None:
    """Turn the CPU float32 cache on or off for every mixed layer (``None``: back to ``MLX_DQ_CPU_CACHE``).

    Layers drop a cache they built at their next call once it is off.
    """
    global _cpu_cache
    _cpu_cache = enabled


def matmul_path(rows: int, mixed: bool) -> str:
    """The forward path of a stored weight for ``rows`` rows of x (``mixed``: it has a permutation).

    ``"fused"`` (Metal decode kernel), ``"segmented"`` (per-segment quantized matmuls),
    ``"cached"`` (float32 copy, CPU) or ``"streamed"`` (CPU without the copy).
    """
    where = backend()
    if where == "metal":
        return "fused" if mixed and rows <= DECODE_MAX_ROWS else "segmented"
    if where == "gpu":
        return "segmented"
    return "cached" if cpu_cache_enabled() else "streamed"


def _get_kernel():
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.metal_kernel(
            name=KERNEL_NAME,
            input_names=KERNEL_INPUTS,
            output_names=KERNEL_OUTPUTS,
            source=KERNEL_SOURCE,
        )
    return _kernel


def kernel_template(
    out_dtype: mx.Dtype, rows: int, n: int, k: int,
    bits: Sequence[int], group_sizes: Sequence[int], widths: Sequence[int],
) -> list[tuple[str, object]]:
    """Template arguments of the fused kernel for one call (unused segments get width 0)."""
    if not 1 <= len(bits) <= MAX_SEGMENTS:
        raise ValueError(f"the fused kernel takes 1..{MAX_SEGMENTS} segments, got {len(bits)}")
    if not 1 <= rows <= DECODE_MAX_ROWS:
        raise ValueError(f"the fused kernel takes 1..{DECODE_MAX_ROWS} rows of x, got {rows}")
    if sum(widths) != k:
        raise ValueError(f"segment widths {list(widths)} do not add up to K={k}")
    tmpl: list[tuple[str, object]] = [("T", out_dtype), ("M", rows), ("N", n), ("K", k)]
    pad = MAX_SEGMENTS - len(bits)
    b = list(bits) + [8] * pad
    g = list(group_sizes) + [32] * pad
    w = list(widths) + [0] * pad
    for i in range(MAX_SEGMENTS):
        tmpl += [(f"BITS{i}", int(b[i])), (f"GROUP{i}", int(g[i])), (f"WIDTH{i}", int(w[i]))]
    return tmpl


def fused_mixed_matmul(
    x: mx.array,
    perm: mx.array,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
    verbose: bool = False,
) -> mx.array:
    """``x @ W^T`` for a mixed weight with the fused Metal kernel (x: ``[..., K]``, at most 8 rows).

    ``verbose=True`` makes MLX print the generated Metal source (works under
    ``mx.export_function`` without a GPU).
    """
    widths = [int(s.shape[-1]) * int(g) for (_, s, _), g in zip(parts, group_sizes)]
    k = int(x.shape[-1])
    n = int(parts[0][0].shape[-2])
    lead = x.shape[:-1]
    rows = int(np.prod(lead)) if lead else 1
    x2 = x.reshape(rows, k)
    flat = []
    for i in range(MAX_SEGMENTS):
        flat.extend(parts[i] if i < len(parts) else parts[0])
    tg_rows = min(ROWS_PER_THREADGROUP, n)
    out = _get_kernel()(
        inputs=[x2, perm, *flat],
        template=kernel_template(x.dtype, rows, n, k, bits, group_sizes, widths),
        grid=(SIMD_WIDTH, n, 1),
        threadgroup=(SIMD_WIDTH, tg_rows, 1),
        output_shapes=[(rows, n)],
        output_dtypes=[x.dtype],
        verbose=verbose,
    )[0]
    return out.reshape(*lead, n)


def generated_metal_source(
    x: mx.array,
    perm: mx.array,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
) -> str:
    """The Metal source MLX generates for :func:`fused_mixed_matmul` on these inputs.

    Traces the call with ``mx.export_function`` (no GPU needed) and captures what
    MLX prints on the process's stdout; lets the kernel be inspected or compiled
    off-device.
    """

    def fn(xx: mx.array) -> mx.array:
        return fused_mixed_matmul(xx, perm, parts, bits, group_sizes, verbose=True)

    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            mx.export_function(lambda *a, **k: None, fn, x)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
    start = text.find(f"Generated source code for `{KERNEL_NAME}`")
    if start < 0:
        raise RuntimeError("MLX printed no generated Metal source for the fused kernel")
    return text[start:].split("```")[1].strip("\n")


def segmented_quantized_matmul(
    x: mx.array,
    perm: mx.array | None,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
) -> mx.array:
    """``x @ W^T`` as a sum of MLX quantized matmuls, one per segment.

    Metal prefill and other GPU backends (the CPU without the float32 cache runs them per block of rows:
    :func:`streamed_matmul`).
    """
    return _sum_over_segments(x, perm, parts, bits, group_sizes, lambda xs, w, s, b, g, nb: mx.quantized_matmul(
        xs, w, s, b, transpose=True, group_size=g, bits=nb))


def segmented_gather_qmm(
    x: mx.array,
    perm: mx.array | None,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
    indices: mx.array,
    sorted_indices: bool = False,
) -> mx.array:
    """Expert-bank ``gather_qmm`` summed over segments, x read through the bank's permutation."""
    return _sum_over_segments(x, perm, parts, bits, group_sizes, lambda xs, w, s, b, g, nb: mx.gather_qmm(
        xs, w, s, b, rhs_indices=indices, transpose=True, group_size=g, bits=nb, sorted_indices=sorted_indices))


def _sum_over_segments(
    x: mx.array,
    perm: mx.array | None,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
    matmul: Callable[..., mx.array],
) -> mx.array:
    """``sum_i matmul(x_i, w_i, s_i, b_i, g_i, bits_i)`` over the segments' slices of x read through ``perm``."""
    xp = x if perm is None else mx.take(x, perm.astype(mx.uint32), axis=-1)
    out, start = None, 0
    for (w, s, b), nb, g in zip(parts, bits, group_sizes):
        k = int(s.shape[-1]) * int(g)
        y = matmul(xp[..., start : start + k], w, s, b, g, nb)
        out = y if out is None else out + y
        start += k
    return out


def streamed_matmul(
    x: mx.array,
    perm: mx.array | None,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
) -> mx.array:
    """``x @ W^T`` on the CPU without keeping a float32 weight, computed in float32, returned in x's dtype.

    Few rows: per-segment quantized matmuls. More: each block of output rows is
    dequantized segment by segment and multiplied. Either way the weight is taken one
    block of output rows after another, ``CPU_CHUNK_BYTES`` of float32 per block (the
    dequantized rows, or the rows' scales and biases widened to float32), so no float32
    copy of the weight, nor of all its scales, exists at any time, and none is kept.
    """
    x32 = x.astype(mx.float32)
    xp = x32 if perm is None else mx.take(x32, perm.astype(mx.uint32), axis=-1)
    if x.size // x.shape[-1] <= CPU_QMM_MAX_ROWS:
        groups = sum(int(s.shape[-1]) for _, s, _ in parts)
        out = _by_row_blocks(xp, parts, bits, group_sizes, max(1, CPU_CHUNK_BYTES // (8 * groups)), _qmm_block)
    else:
        out = _by_row_blocks(xp, parts, bits, group_sizes, max(1, CPU_CHUNK_BYTES // (4 * int(x.shape[-1]))),
                             _dequantized_block)
    return out.astype(x.dtype)


def _qmm_block(xs: mx.array, w: mx.array, s: mx.array, b: mx.array, g: int, nb: int) -> mx.array:
    """One block of one segment through MLX's quantized matmul (scales widened here, after the block's wait)."""
    return mx.quantized_matmul(xs, w, s.astype(mx.float32), b.astype(mx.float32), transpose=True, group_size=g,
                               bits=nb)


def _dequantized_block(xs: mx.array, w: mx.array, s: mx.array, b: mx.array, g: int, nb: int) -> mx.array:
    """One block of one segment dequantized in float32 (scale*q + bias in fp32) and multiplied."""
    return xs @ mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=nb).T


def _by_row_blocks(
    xp: mx.array,
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
    block: int,
    product: Callable[..., mx.array],
) -> mx.array:
    """``xp @ W^T`` (xp already in stored column order) as ``product`` over blocks of ``block`` output rows.

    Each block waits (``mx.depends``) for the previous block's result, the first for
    xp, so that MLX's graph order takes the blocks one after another, after x: a block's
    float32 (dequantized rows, or widened scales and biases) needs only the weights,
    and nothing else would keep the blocks of a lazy forward from being made together.
    """
    n = int(parts[0][0].shape[-2])
    outs: list[mx.array] = []
    for a in range(0, n, block):
        after = outs[-1] if outs else xp
        rows = [tuple(mx.depends([w[a : a + block], s[a : a + block], b[a : a + block]], [after]))
                for w, s, b in parts]
        outs.append(_sum_over_segments(xp, None, rows, bits, group_sizes, product))
    return outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=-1)


def dequantize_parts(
    parts: Sequence[tuple[mx.array, mx.array, mx.array]],
    bits: Sequence[int],
    group_sizes: Sequence[int],
    perm: mx.array | None,
) -> mx.array:
    """The float32 weight ``[..., out, in]`` in original channel order.

    Scales and biases are widened to float32 first, so ``scale*q + bias`` is
    computed in fp32 (not rounded to the 16-bit storage type).
    """
    cols = [
        mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=nb)
        for (w, s, b), nb, g in zip(parts, bits, group_sizes)
    ]
    wq = cols[0] if len(cols) == 1 else mx.concatenate(cols, axis=-1)
    if perm is not None:
        wq = mx.take(wq, inverse_permutation(perm), axis=-1)
    return wq


def inverse_permutation(perm: mx.array) -> mx.array:
    """``inv`` with ``inv[perm[j]] = j`` (as uint32), i.e. original channel -> stored column."""
    return mx.argsort(perm.astype(mx.uint32)).astype(mx.uint32)


def portable_matmul(x: mx.array, w_fp32: mx.array) -> mx.array:
    """``x @ W^T`` in float32 on a cached dequantized weight, returned in x's dtype."""
    return (x.astype(mx.float32) @ w_fp32.T).astype(x.dtype)
