"""GPTQ's column loop: quantize input channels one at a time and push each channel's rounding error onto the
channels not yet quantized, through the upper Cholesky factor of the damped ``H^-1``
(:mod:`mlx_dq.quant.hessian`).

The loop runs in blocks of columns (each block's errors update the rest of its span in one product, each
span's errors the columns beyond it) and within a block in sub-blocks; the columns not yet reached live in MLX,
the block being quantized in numpy. Each column's codes and fed-back values are MLX's stored arithmetic
(:mod:`mlx_dq.quant.storage`): the value GPTQ compensates for is what ``mx.dequantize`` returns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import mlx.core as mx
import numpy as np

from mlx_dq.quant import storage
from mlx_dq.quant.hessian import FactoredGram, HessianFactor, factor_hessian
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.scale_search import choose_group_params
from mlx_dq.quant.spec import QuantizerSpec
from mlx_dq.runtime.threads import map_ahead

SPAN_COLUMNS = 1024  # GPTQ's blocks update the columns beyond their span of this many columns once per span
F16_ROUND_LIMIT = 6e4  # GPTQ's column loop rounds to fp16 by float32 arithmetic where |values| stay below this
TRANSPOSE_ROWS = 256  # rows of a weight gathered and transposed at a time into GPTQ's column-major copy
SUB_COLUMNS = 16  # GPTQ's columns update each other one by one within sub-blocks of this many columns
ERROR_CHANNELS = 1024  # input channels per piece of GPTQ's output error: bounded temporaries, float32 sums this long


@dataclass
class GPTQResult:
    """Raw GPTQ output in storage channel order, rows ``[B, R]`` (experts folded as the Hessian dictates).

    ``codes`` ``[B, R, k]``; ``scales``/``biases`` ``[B, R, k/g]`` per group
    (fp16, groups laid out segment after segment); ``assumed`` ``[B, R, k]``
    the dequantized weight GPTQ compensated for (the fp16 values ``mx.dequantize``
    yields, stored as fp16: half a float32 copy's memory); ``order`` original channel of each storage
    column; ``extra_damp`` damping added beyond the requested one;
    ``clipped`` how many error-updated weights fell outside their group's range
    (per bank ``[B]`` when the banks are several options of one weight).
    """

    codes: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    assumed: np.ndarray
    order: np.ndarray
    damp_abs: float
    extra_damp: float
    out_sq: np.ndarray  # [B, R]: each row's squared output error against the undamped Gram
    clipped: int | np.ndarray = 0


def group_layout(option: QuantOption, in_f: int) -> list[tuple[int, int, int]]:
    """``(start, size, bits)`` of every group, in storage order, segment after segment."""
    groups, start = [], 0
    for seg, k in zip(option.segments, option.split(in_f)):
        for g0 in range(start, start + k, seg.group_size):
            groups.append((g0, seg.group_size, seg.bits))
        start += k
    return groups


def _shared_layout(options: Sequence[QuantOption], in_f: int) -> tuple[list[tuple[int, int, int]], np.ndarray]:
    """The group layout of the first option and every option's bits per group ``[len(options), G]``.

    Options batched into one GPTQ pass must place their groups identically (only the widths may differ).
    """
    layouts = [group_layout(o, in_f) for o in options]
    starts = [(g0, gs) for g0, gs, _ in layouts[0]]
    if any([(g0, gs) for g0, gs, _ in lay] != starts for lay in layouts[1:]):
        raise ValueError("options quantized in one GPTQ pass need the same group layout: "
                         + ", ".join(o.desc for o in options))
    return layouts[0], np.array([[b for _, _, b in lay] for lay in layouts], dtype=np.int64)


@dataclass
class _Loop:
    """What GPTQ's column loop reads and writes, in storage order: the group layout (``groups``, per bank
    ``g_bits`` and ``q_max`` ``[1 or B, G]``, ``gid`` per column), the factor ``u`` ``[Bg, k, k]``, the scale-search
    weights ``energy`` ``[Bg, k]``, the chosen group parameters (group-major ``[G, B, R]``: contiguous per
    column) and the outputs (column-major ``[B, k, R]``)."""

    nb: int
    rows: int
    groups: list[tuple[int, int, int]]
    g_bits: np.ndarray
    gid: np.ndarray
    g_start: np.ndarray
    q_max: np.ndarray
    per_bank: bool
    static: bool
    spec: QuantizerSpec
    energy: np.ndarray
    u: np.ndarray
    porder: np.ndarray
    pending: mx.array | None = None  # the columns not reached yet (taken by the loop, so they go as it goes)
    scales: np.ndarray = field(init=False)
    biases: np.ndarray = field(init=False)
    codes: np.ndarray = field(init=False)
    assumed: np.ndarray = field(init=False)
    esq: np.ndarray = field(init=False)
    clipped: int | np.ndarray = 0
    sp_of: list[int] = field(init=False)  # Python ints: the column loop indexes with them, no numpy scalars
    gid_of: list[int] = field(init=False)
    first_of_group: set[int] = field(init=False)
    group_cache: dict = field(default_factory=dict)  # float32 views of a group's final parameters, made once per group

    def __post_init__(self) -> None:
        k, bg = len(self.gid), self.u.shape[0]
        self.scales = np.zeros((len(self.groups), self.nb, self.rows), dtype=np.float16)
        self.biases = np.zeros_like(self.scales)
        self.codes = np.zeros((self.nb, k, self.rows), dtype=np.uint8)
        self.assumed = np.zeros((self.nb, k, self.rows), dtype=np.float16)  # fp16 values: exact, half the memory
        self.esq = np.zeros((bg, self.nb // bg * self.rows), dtype=np.float64)  # sum of scaled errors e^2 per row
        self.clipped = np.zeros(self.nb, dtype=np.int64) if self.per_bank else 0
        self.sp_of, self.gid_of = self.porder.tolist(), self.gid.tolist()
        self.first_of_group = set(self.g_start.tolist())


def _layout_loop(w: np.ndarray, options: list[QuantOption], energy: np.ndarray, factor: HessianFactor,
                 porder: np.ndarray, spec: QuantizerSpec, static: bool) -> _Loop:
    """The loop's state for ``w`` ``[B, R, k]``: the options' shared group layout, and the scale-search weights
    (``energy``, undamped ``diag(H)`` in storage order, or GPTQ's ``1/[H^-1]_jj`` with ``scale_weight="gptq"``)."""
    nb, rows, k = w.shape
    groups, g_bits = _shared_layout(options, k)  # g_bits [1 or B, G]
    gid = np.empty(k, dtype=np.int64)
    for i, (g0, gs, _) in enumerate(groups):
        gid[g0 : g0 + gs] = i
    if spec.scale_weight == "gptq":
        energy = np.empty_like(energy)
        energy[:, porder] = 1.0 / np.einsum("bii->bi", factor.u) ** 2
    return _Loop(nb, rows, groups, g_bits, gid, np.array([g0 for g0, _, _ in groups]),
                 ((1 << g_bits) - 1).astype(np.float32), len(options) > 1, static, spec, energy, factor.u, porder)


def _params_for(loop: _Loop, block: np.ndarray, first: int, count: int, gsz: int) -> None:
    """Choose the parameters of ``count`` groups of ``gsz`` from group index ``first`` on, from ``block``
    ``[B, R, count*gsz]`` (their storage columns); banks of one width per call."""
    wg = block.reshape(loop.nb, loop.rows, count, gsz)
    start = loop.g_start[first]
    wt = loop.energy[:, start : start + count * gsz].reshape(-1, 1, count, gsz)
    widths = loop.g_bits[:, first]
    for bits in np.unique(widths):
        banks = slice(None) if len(widths) == 1 else np.flatnonzero(widths == bits)
        s, b = choose_group_params(wg[banks], int(bits), wt, clip=loop.spec.clip, weighted=loop.spec.weighted_scales)
        loop.scales[first : first + count, banks] = s.transpose(2, 0, 1)
        loop.biases[first : first + count, banks] = b.transpose(2, 0, 1)


def _static_group_params(loop: _Loop, w: np.ndarray, order: np.ndarray) -> None:
    """Every group's parameters up front from the original weights (static groups), one call per run of groups of
    one size and width."""
    identity = np.array_equal(order, np.arange(w.shape[-1]))
    # storage order (a view when it is the original order; banks of one broadcast weight stay one weight)
    ws = w if identity else \
        np.broadcast_to(np.take(w[:1], order, axis=2), w.shape) if w.strides[0] == 0 else np.take(w, order, axis=2)
    groups, g_bits, i = loop.groups, loop.g_bits, 0
    while i < len(groups):
        j = i
        while j < len(groups) and groups[j][1] == groups[i][1] and np.array_equal(g_bits[:, j], g_bits[:, i]):
            j += 1
        g0, gsz, _ = groups[i]
        _params_for(loop, ws[:, :, g0 : g0 + (j - i) * gsz], i, j - i, gsz)
        i = j


def _group_params(loop: _Loop, g: int) -> tuple:
    """Group ``g``'s float32 scale, bias, safe divisor, zero-scale mask (None when no scale is 0), highest code
    and whether fp16 rounding by float32 arithmetic applies; cached until the next group comes up."""
    cache = loop.group_cache
    if g not in cache:
        if not loop.static:  # groups come up one after another: the last one is done
            cache.clear()
        sg, bg_ = loop.scales[g].astype(np.float32), loop.biases[g].astype(np.float32)
        zero = sg == 0
        per_bank, q_max = loop.per_bank, loop.q_max
        qm = q_max[:, g, None] if per_bank else float(q_max[0, g])  # per bank [B, 1]: float32 like the codes
        # fp16 rounding by float32 arithmetic where no value can reach the end of fp16's range
        small = float(np.max(np.abs(sg) * (q_max[:, g, None] if per_bank else q_max[0, g]) + np.abs(bg_))) \
            < F16_ROUND_LIMIT
        cache[g] = (sg, bg_, np.where(zero, np.float32(1.0), sg), zero if zero.any() else None, qm, small)
    return cache[g]


def _block_bounds(loop: _Loop, k: int) -> list[int]:
    """Ends of GPTQ's blocks in processing order (``[0, ..., k]``); without static groups they end on group
    boundaries."""
    bounds = [0]
    while bounds[-1] < k:
        end = min(k, bounds[-1] + loop.spec.block_size)
        if not loop.static:
            g = loop.gid[end - 1]
            end = max(end, int(loop.g_start[g] + loop.groups[g][1]))
        bounds.append(end)
    return bounds


@dataclass
class _Scratch:
    """Buffers the column loop reuses (at 256-row banks the calls, not the arithmetic, are most of the time)."""

    matmul: np.ndarray  # [Bg, widest block, C]
    outside: np.ndarray  # [B, widest block, R]: a block's weights outside their group's range, counted once
    raw: np.ndarray
    q: np.ndarray
    dq: np.ndarray
    round: tuple[np.ndarray, np.ndarray]

    @classmethod
    def make(cls, nb: int, rows: int, bg: int, widest: int) -> "_Scratch":
        def col() -> np.ndarray:
            return np.empty((nb, rows), dtype=np.float32)

        return cls(np.empty((bg, widest, nb // bg * rows), dtype=np.float32),
                   np.empty((nb, widest, rows), dtype=bool), col(), col(), col(), (col(), col()))


def _run_block(loop: _Loop, wt_: np.ndarray, err: np.ndarray, b0: int, b1: int, buf: _Scratch) -> None:
    """Quantize the columns ``[b0, b1)`` (processing order) of ``wt_`` (``[Bg, b1-b0, C]``, updated in place), each
    column's scaled error into ``err``; within the block, sub-blocks update each other by small products."""
    u, nb, rows, groups, static = loop.u, loop.nb, loop.rows, loop.groups, loop.static
    bg, wide = u.shape[0], wt_.shape[-1]
    sp_of, gid_of, first_of_group = loop.sp_of, loop.gid_of, loop.first_of_group
    codes, assumed, outside, scratch = loop.codes, loop.assumed, buf.outside, buf.matmul
    cuts = iter(_sub_blocks(b0, b1, None if static else loop.g_start))
    c0, c1 = b0, next(cuts)
    for p in range(b0, b1):
        sp = sp_of[p]
        g = gid_of[sp]
        if not static and sp in first_of_group:
            gsz = groups[g][1]
            _params_for(loop, wt_[:, p - b0 : p - b0 + gsz, :].reshape(bg, gsz, nb // bg, rows).transpose(0, 2, 3, 1)
                        .reshape(nb, rows, gsz), g, 1, gsz)
        s, bi, safe, zero, qm, small = _group_params(loop, g)
        if p > c0:  # the sub-block's earlier errors reach this column in one small product
            corr = np.matmul(u[:, c0:p, p][:, None, :], err[:, c0 - b0 : p - b0], out=scratch[:, :1])
            np.subtract(wt_[:, p - b0], corr[:, 0], out=wt_[:, p - b0])
        col = wt_[:, p - b0, :].reshape(nb, rows)
        # the division by the group's safe divisor, made once per group; into reused buffers
        q = storage.codes(col, safe, bi, qm, zero_scales="divide", out=buf.q, raw=buf.raw)
        out = np.not_equal(q, buf.raw, out=outside[:, p - b0])  # rounded outside the range (weights are finite)
        if zero is not None:
            q[zero] = 0.0
            out &= ~zero
        codes[:, sp, :] = q
        dq = storage.dequantize(q, s, bi, "float16", out=buf.dq, scratch=buf.round if small else None)
        assumed[:, sp, :] = dq
        e = err[:, p - b0, :]  # this column's scaled errors, written in place
        np.divide(np.subtract(wt_[:, p - b0, :], dq.reshape(bg, wide), out=e), u[:, p, p, None], out=e)
        if p + 1 == c1 < b1:  # the sub-block's errors update the rest of the block in one product
            upd = np.matmul(u[:, c0:c1, c1:b1].transpose(0, 2, 1), err[:, c0 - b0 : c1 - b0],
                            out=scratch[:, : b1 - c1])
            np.subtract(wt_[:, c1 - b0 :, :], upd, out=wt_[:, c1 - b0 :, :])
            c0, c1 = c1, next(cuts)
    loop.esq += np.square(err, dtype=np.float64).sum(1)
    n_out = np.count_nonzero(outside[:, : b1 - b0].reshape(nb, -1), axis=1)
    loop.clipped += n_out if loop.per_bank else int(n_out.sum())


def _run_spans(loop: _Loop, u_mx: mx.array, bounds: list[int]) -> None:
    """The blocks in spans of about :data:`SPAN_COLUMNS`: a block's errors update the rest of its span at once, a
    span's errors the columns beyond it, so the remaining columns are rewritten once a span, not once a block.
    The lazy updates (most of GPTQ's multiply-adds) run in MLX; each block's columns come back to numpy."""
    k, bg = bounds[-1], loop.u.shape[0]
    rest, loop.pending = loop.pending, None  # the only reference: the columns go as the loop goes
    spans = [0]
    for b in bounds[1:]:
        if b - spans[-1] >= SPAN_COLUMNS or b == k:
            spans.append(b)
    wide = loop.nb // bg * loop.rows
    serr = np.empty((bg, max(b1 - b0 for b0, b1 in zip(spans[:-1], spans[1:])), wide), dtype=np.float32)
    buf = _Scratch.make(loop.nb, loop.rows, bg, max(b1 - b0 for b0, b1 in zip(bounds[:-1], bounds[1:])))
    s0, s1, span, span_ends = 0, 0, rest, iter(spans[1:])
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        if b0 == s1:  # a new span: the columns beyond the last one get its errors
            if s1 > s0:
                rest = rest - mx.matmul(u_mx[:, s0:s1, s1:].transpose(0, 2, 1), mx.array(serr[:, : s1 - s0]))
            s0, s1 = b0, next(span_ends)
            span, rest = rest[:, : s1 - s0, :], rest[:, s1 - s0 :, :]
        err = serr[:, b0 - s0 : b1 - s0]  # this block's errors, column by column
        _run_block(loop, _columns(span, b1 - b0), err, b0, b1, buf)
        span = span[:, b1 - b0 :, :]
        if b1 < s1:
            span = span - mx.matmul(u_mx[:, b0:b1, b1:s1].transpose(0, 2, 1), mx.array(err))


def gptq_core(
    w: np.ndarray,
    gram: np.ndarray,
    option: QuantOption | Sequence[QuantOption],
    order: np.ndarray,
    spec: QuantizerSpec | None = None,
    *,
    static_groups: bool,
    process_order: np.ndarray | None = None,
    factor: HessianFactor | None = None,
) -> GPTQResult:
    """GPTQ on ``w`` ``[B, R, in]`` with Gram ``[1 or B, in, in]``; storage column ``j`` is channel ``order[j]``.

    Columns are processed in storage order, or in ``process_order`` (storage
    positions) with ``static_groups`` (group parameters fixed up front from
    the original weights). Without static groups, blocks end on group
    boundaries and each group's parameters are chosen from the updated weights
    when its first column comes up. ``spec`` gives the damping, block size, clip search and scale-search
    weights (:class:`~mlx_dq.quant.spec.QuantizerSpec`). ``factor``
    reuses a :func:`~mlx_dq.quant.hessian.factor_hessian` result made for the same sequence and damping.
    ``option`` may be a list with one option per bank (several options of one weight,
    stacked on the bank axis, sharing one Gram matrix and group layout): each bank is
    quantized exactly as alone, in one pass over the columns.
    """
    spec = QuantizerSpec() if spec is None else spec
    w = np.asarray(w, dtype=np.float32)
    nb, rows, k = w.shape
    options = [option] if isinstance(option, QuantOption) else list(option)
    if len(options) > 1 and (len(options) != nb or gram.shape[0] != 1):
        raise ValueError(f"{len(options)} options need as many banks ({nb} given) and one shared Gram matrix")
    if not isinstance(gram, FactoredGram):
        gram = np.asarray(gram, dtype=np.float32)
    diag = gram.diag if isinstance(gram, FactoredGram) else np.einsum("bii->bi", gram)
    porder = np.arange(k) if process_order is None else np.asarray(process_order)
    if not static_groups and process_order is not None and not np.array_equal(porder, np.arange(k)):
        raise ValueError("a custom process order needs static_groups=True")
    sequence = np.asarray(order)[porder]
    if factor is None:
        factor = factor_hessian(gram, sequence, spec.damp)
    elif factor.damp != spec.damp or not np.array_equal(factor.sequence, sequence) \
            or factor.u.shape[0] != gram.shape[0]:
        raise ValueError("the Hessian factor was made for another channel sequence, damping or expert count")
    loop = _layout_loop(w, options, diag[:, order].copy(), factor, porder, spec, static_groups)
    if static_groups:
        _static_group_params(loop, w, order)
    # [Bg, k, C] in processing order, C = B/Bg * R. Banks sharing one Hessian factor sit side by side in a column
    # (one wide product instead of a batch of narrow ones); banks with their own factor stay a batch.
    loop.pending = _pending_columns(w, sequence, factor.u.shape[0])
    _run_spans(loop, factor.u_mx, _block_bounds(loop, k))
    return GPTQResult(
        codes=loop.codes.transpose(0, 2, 1),
        scales=loop.scales.transpose(1, 2, 0),
        biases=loop.biases.transpose(1, 2, 0),
        assumed=loop.assumed.transpose(0, 2, 1),
        order=np.asarray(order),
        damp_abs=factor.damp_abs,
        extra_damp=factor.extra_damp,
        clipped=loop.clipped,
        out_sq=_output_error_rows(loop.esq.reshape(nb, rows), w, loop.assumed, order, porder, factor),
    )


def _columns(span: mx.array, n: int) -> np.ndarray:
    """The first ``n`` columns of GPTQ's lazily updated ``span`` (``[B, columns, R]``) as a writable numpy array;
    MLX evaluates the updates first, so a profile counts them as MLX's work.

    Contiguous columns come as a view of MLX's buffer, not a copy (5.9 s of numpy copies in an 8B-shape measure):
    the column loop rewrites them in place, and nothing reads a block's columns from ``span`` again (later
    updates read only the columns beyond the block)."""
    cols = span[:, :n, :]
    mx.eval(cols)
    view = np.asarray(cols)
    return view if view.flags.c_contiguous and view.flags.writeable else np.array(view)


def _sub_blocks(b0: int, b1: int, group_starts: np.ndarray | None) -> list[int]:
    """Ends of the sub-blocks of GPTQ's block ``[b0, b1)``: every :data:`SUB_COLUMNS` columns and, when groups are
    chosen as the columns come up (``group_starts``), at each group's first column too, so a group's columns have
    every earlier error when its parameters are chosen.

    Why: within a sub-block each column's error updates the sub-block's later columns one by one (elementwise,
    memory-bound); a finished sub-block updates the rest of the block in one matrix product. At 128-column blocks
    of ten 256-row banks this took a block's updates from 9.3 to 2.5 ms here; the values agree to float rounding."""
    cuts = set(range(b0 + SUB_COLUMNS, b1, SUB_COLUMNS)) | {b1}
    if group_starts is not None:
        cuts |= {int(g) for g in group_starts if b0 < g < b1}
    return sorted(cuts)


def _pending_columns(w: np.ndarray, sequence: np.ndarray, bg: int) -> mx.array:
    """GPTQ's columns in processing order, channel ``sequence[p]`` of ``w`` (``[B, R, k]``) at position ``p``, as
    MLX's ``[bg, k, B/bg * R]``: for one shared factor (``bg`` 1) the banks side by side in each column, else one
    bank per factor. The banks of several options of one weight are one weight broadcast: read once.

    Written by numpy into the MLX array's own buffer, :data:`TRANSPOSE_ROWS` rows at a time (gathered within the
    rows, then transposed while they are in the cache). Why: MLX's transposed and gathered copies on the CPU cost
    13-19 ns a value, 2.0 s at 8,192 x 8,192 with act order; the updates then read the columns contiguously."""
    nb, rows, k = w.shape
    one = bg == 1 and nb > 1 and w.strides[0] == 0  # np.broadcast_to of one weight
    natural = np.array_equal(sequence, np.arange(k))
    out = mx.zeros((bg, k, nb // bg * rows), dtype=mx.float32)
    mx.eval(out)
    view = np.asarray(out)  # a writable view of the new array's buffer: nothing else holds it yet

    def write_columns(piece: tuple[int, int]) -> None:  # numpy's operators: benchmarks/scale.py counts it as numpy
        b, r0 = piece
        f, at = (b, 0) if bg > 1 else (0, b * rows)  # its factor's slot and its first row there
        r1 = min(rows, r0 + TRANSPOSE_ROWS)
        part = w[b, r0:r1] if natural else np.take(w[b, r0:r1], sequence, axis=1)
        if one:  # transposed once, then copied to every bank's place
            part = np.ascontiguousarray(part.T)
            for j in range(nb):
                view[0, :, j * rows + r0 : j * rows + r1] = part
        else:
            view[f, :, at + r0 : at + r1] = part.T

    # numpy's gathers and copies release the GIL: the pieces (disjoint rows of the buffer) run on worker threads
    pieces = [(b, r0) for b in range(1 if one else nb) for r0 in range(0, rows, TRANSPOSE_ROWS)]
    for _ in map_ahead(write_columns, pieces):
        pass
    return out


@mx.compile
def _damped_sums(w: mx.array, assumed: mx.array, added: mx.array) -> mx.array:
    """Per bank and row, ``sum_c added_c (w_c - assumed_c)^2`` over channels (axis 1) of ``[B or 1, C, R]`` arrays;
    compiled: one fused pass, 2x numpy's einsum here and 8x MLX's uncompiled ops."""
    d = w - assumed
    return (d * d * added).sum(1)


def _output_error_rows(esq: np.ndarray, w: np.ndarray, assumed: np.ndarray, order: np.ndarray, porder: np.ndarray,
                       factor: HessianFactor) -> np.ndarray:
    """Per bank and output row, ``d H d^T`` for the quantization error ``d`` (undamped ``H``), from GPTQ's own errors.

    GPTQ leaves ``W - Q = E U`` with ``H_damped^-1 = U^T U``, so ``(W-Q) H_damped (W-Q)^T = E E^T``:
    the row's sum of ``e^2`` less what damping added, ``sum_j added_j d_j^2``. Exact up to float
    rounding, and it costs ``rows x in`` instead of the ``rows x in^2`` of multiplying by the Gram.
    """
    k = w.shape[-1]
    added = np.empty(factor.added.shape, dtype=np.float32)
    added[:, porder] = factor.added  # storage order
    damped = np.zeros_like(esq)
    stored = np.array_equal(order, np.arange(k))  # the channels in their own order: a slice, not a gather
    src = w[:1] if w.strides[0] == 0 else w  # the banks of several options of one weight: one weight broadcast

    def part(c0: int) -> mx.array:  # channels c0 to c0 + ERROR_CHANNELS: float32 sums of that many terms at most
        c1 = min(k, c0 + ERROR_CHANNELS)
        # (mx.array of a non-contiguous numpy slice copies element by element: many times slower than a contiguous one)
        wc = mx.array(np.ascontiguousarray(src[:, :, c0:c1]) if stored else np.take(src, order[c0:c1], axis=2))
        return _damped_sums(wc.transpose(0, 2, 1), mx.array(np.ascontiguousarray(assumed[:, c0:c1])),
                            mx.array(added[:, c0:c1, None]))  # map_ahead evaluates it, as MLX's work

    for p in map_ahead(part, range(0, k, ERROR_CHANNELS)):  # bounded temporaries, on worker threads from the main one
        damped += np.asarray(p, dtype=np.float64)  # added in float64, in channel order whatever the thread
    return esq - damped
