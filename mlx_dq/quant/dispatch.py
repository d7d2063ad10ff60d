"""The quantizer: one per-tensor dispatch, and a model quantized one decoder layer at a time.

:func:`quantize_tensor` is the only place that turns a weight, an option and the
Gram matrix of its inputs into codes, as a :class:`~mlx_dq.quant.spec.QuantizerSpec` says: GPTQ error
compensation (``method="gptq"``) or round-to-nearest with the clip search (``"rtn"``). The measurer calls it for
every option it measures and the converter for every tensor it writes, so the
errors a plan is built on are those of the tensors conversion produces.

:func:`quantize_stream` streams a model through :class:`~mlx_dq.model.runner.LayerRunner`:
each layer's inputs are collected over the calibration rows, every tensor is
quantized with its planned option, and (``sequential``) the layer's output for
the next layer is computed with the *quantized* weights, so errors do not pile
up unseen. Peak memory is about one layer plus activations.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from tqdm import tqdm

from mlx_dq.errors import InputError
from mlx_dq.model.runner import LayerRunner, free_table, record_head_inputs
from mlx_dq.quant.affine import QuantizedTensor, promote_to_uniform, quantize_weight
from mlx_dq.quant.gptq import (
    batch_key,
    can_consume,
    consume_gram,
    gptq_quantize,
    gptq_quantize_many,
)
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.rowsplit import RowSplitCodes
from mlx_dq.quant.spec import QuantizerSpec
from mlx_dq.runtime import distributed as dist
from mlx_dq.runtime.threads import (
    ahead_workers,
    evaluated_result,
    map_ahead,
    thread_map,
)
from mlx_dq.safety import check_finite_weight

ROW_BLOCK_BYTES = 64 * 2**20  # float32 bytes of one block of output rows quantized at a time (large tensors)
GPTQ_BATCH_BYTES = 128 * 2**20  # float32 bytes of the weight copies one batched GPTQ pass over several options holds


# --------------------------------------------------------------------------
# one tensor
# --------------------------------------------------------------------------
def row_blocks(shape: Sequence[int], budget: int | None = None) -> list[slice] | None:
    """Slices of output rows (axis -2) of at most ``budget`` float32 bytes each (default
    :data:`ROW_BLOCK_BYTES`); None when one block holds the whole tensor.

    Rounding, the clip search and GPTQ (given the shared Gram matrix) treat
    output rows independently, so a large tensor can be quantized and metered
    block by block: float32 temporaries then scale with the block, not with a
    151,936-row vocabulary.
    """
    if len(shape) < 2:
        return None
    budget = ROW_BLOCK_BYTES if budget is None else budget
    rows, per_row = int(shape[-2]), 4 * math.prod(int(d) for d in shape) // max(1, int(shape[-2]))
    step = max(1, budget // max(1, per_row))
    if rows <= step:
        return None
    return [slice(r0, min(rows, r0 + step)) for r0 in range(0, rows, step)]


def block_budget() -> int:
    """Float32 bytes of one block of rows quantized here: :data:`ROW_BLOCK_BYTES` shared by the blocks quantized at
    once (:func:`quantized_blocks` on worker threads), so a large tensor's working memory stays that of one block."""
    return ROW_BLOCK_BYTES // ahead_workers()


def quantize_tensor(w: mx.array, option: QuantOption, gram: mx.array | None, spec: QuantizerSpec | None = None, *,
                    factor_cache: dict | None = None) -> QuantizedTensor:
    """Quantize one weight with ``option``: GPTQ when a Gram matrix is there and ``spec.method == "gptq"``, else
    RTN + clip (``spec``: :class:`~mlx_dq.quant.spec.QuantizerSpec`, default its defaults).

    ``gram`` is ``[in, in]``, or ``[E, in, in]`` (one per expert) for an expert bank.
    ``spec.promote_mixed`` quantizes a mixed option in natural channel order and rewrites it
    losslessly as one uniform tensor at its highest width (stock-loadable).
    ``factor_cache`` (a dict) reuses Hessian factors across options of one tensor.
    """
    spec = QuantizerSpec() if spec is None else spec
    if option.keep16:
        return quantize_weight(w, option, scale_dtype=spec.scale_dtype)
    natural = spec.promote_mixed and option.is_mixed
    if spec.method == "gptq" and gram is not None:
        if spec.scale_dtype != mx.float16:
            raise ValueError("GPTQ rounds its codes against float16 scales: bfloat16 output needs method rtn")
        qt = gptq_quantize(w, option, gram, spec, factor_cache=factor_cache,
                           error_stats=False)  # callers meter the error themselves
    else:
        qt = quantize_weight(w, option, gram=gram, clip=spec.clip, scale_dtype=spec.scale_dtype,
                             natural_order=natural)
    return promote_to_uniform(qt) if natural else qt


def quantized_blocks(piece: Callable[[slice], mx.array], blocks: Sequence[slice], option: QuantOption,
                     gram: Any, spec: QuantizerSpec | None = None, *,
                     factor_cache: dict | None = None) -> Iterator[QuantizedTensor]:
    """:func:`quantize_tensor` of ``piece(sl)`` for each of ``blocks``, in order, each result evaluated.

    The first block is quantized here (GPTQ's Hessian factor is made once, into ``factor_cache``), the
    others ahead of the caller on worker threads (:func:`~mlx_dq.runtime.threads.map_ahead`). Why: a large head's options
    are quantized one 64 MiB block after another while their error and KL are taken, and the group-parameter
    search and GPTQ's column loop run on one core. Rows are independent: the codes are the same on any thread."""
    factors = {} if factor_cache is None else factor_cache

    def one(sl: slice) -> QuantizedTensor:
        return evaluated_result(quantize_tensor(piece(sl), option, gram, spec, factor_cache=factors))

    if not blocks:
        return
    yield one(blocks[0])
    evaluated_result((gram, factors))  # read by the workers: nothing lazy crosses threads
    yield from map_ahead(one, list(blocks[1:]))


def quantize_rows(w: mx.array, option: QuantOption, gram: mx.array | None, spec: QuantizerSpec | None = None, *,
                  rows: np.ndarray | None = None, factor_cache: dict | None = None) -> QuantizedTensor:
    """:func:`quantize_tensor` of a large tensor one block of output rows at a time (:func:`row_blocks`).

    Rows are independent (the Gram matrix and the channel order are the whole
    tensor's), so the codes, scales and biases equal the one-piece result;
    the packed blocks are joined. Working memory scales with the block.
    Tensors of one block go to :func:`quantize_tensor` as they are.
    ``rows`` (indices of a 2-D ``w``): quantize only those rows, in that order.
    """
    shape = tuple(int(d) for d in w.shape) if rows is None else (len(rows), int(w.shape[-1]))

    def piece(sl: slice) -> mx.array:
        return w[..., sl, :] if rows is None else mx.take(w, mx.array(rows[sl].astype(np.int32)), axis=0)

    blocks = row_blocks(shape, block_budget())
    if blocks is None or option.keep16:
        whole = w if rows is None else piece(slice(None))
        if rows is not None:
            mx.eval(whole)  # made here: a worker thread's lazy array cannot be evaluated by the caller's thread
        return quantize_tensor(whole, option, gram, spec, factor_cache=factor_cache)
    parts, count, base, best, seconds = [], 0, 0.0, 0.0, 0.0
    for qt in quantized_blocks(piece, blocks, option, gram, spec, factor_cache=factor_cache):
        st = qt.stats
        if "clipped_fraction" in st:  # back to a count: exact (the fraction is count / size)
            count += round(st["clipped_fraction"] * math.prod(qt.shape))
        base, best = base + st.get("clip_base_err", 0.0), best + st.get("clip_best_err", 0.0)
        seconds += st.get("seconds", 0.0)
        parts.append(qt)
    out = join_rows(parts)
    st = dict(out.stats)
    if "clipped_fraction" in st:
        st["clipped_fraction"] = count / float(math.prod(out.shape))
    if "clip_improvement" in st:
        st.update(clip_base_err=base, clip_best_err=best, clip_improvement=1.0 - best / base if base > 0 else 0.0)
    if "seconds" in st:
        st["seconds"] = seconds
    if "extra_damp" in st:
        st["extra_damp"] = max(q.stats["extra_damp"] for q in parts)
    out.stats = st
    return out


def join_rows(blocks: Sequence[QuantizedTensor]) -> QuantizedTensor:
    """One tensor from the quantized blocks of output rows of one weight (in order): their codes, scales, biases
    and known row errors joined; the first block's option, order and stats."""
    out = replace(blocks[0], shape=blocks[0].shape[:-2] + (sum(q.shape[-2] for q in blocks), blocks[0].shape[-1]))
    out.parts = [tuple(mx.concatenate([q.parts[j][i] for q in blocks], axis=-2) for i in range(3))
                 for j in range(len(out.parts))]
    if out.fp is not None:
        out.fp = mx.concatenate([q.fp for q in blocks], axis=-2)
    known = [q.out_sq for q in blocks]
    out.out_sq = np.concatenate(known, axis=-1) if all(k is not None for k in known) else None
    return out


def option_batches(options: Sequence[QuantOption], shape: Sequence[int], spec: QuantizerSpec | None = None, *,
                   shared: bool = True, batch_bytes: int = GPTQ_BATCH_BYTES) -> list[list[QuantOption]]:
    """The passes :func:`option_quantizer` makes over ``options`` of a ``shape`` weight, in the order of their first
    options: GPTQ options of one :func:`~mlx_dq.quant.gptq.batch_key` in order, up to ``batch_bytes`` of stacked
    float32 weight copies a pass, and every other option alone. ``shared``: one Gram matrix for the whole weight.

    Why a function of its own: ranks that share a tensor's options hand each other whole passes, and every rank
    forms them from one process's list, since a pass's stacked matmuls round differently when it holds other options.
    """
    spec = QuantizerSpec() if spec is None else spec
    in_f = int(shape[-1])
    per_batch = max(1, batch_bytes // (3 * 4 * math.prod(int(d) for d in shape)))
    passes: list[list[QuantOption]] = []
    filling: dict[tuple, list[QuantOption]] = {}
    for o in options:
        if not _batchable(o, in_f, spec, shared):
            passes.append([o])
            continue
        key = batch_key(o, in_f, spec)
        if key not in filling or len(filling[key]) >= per_batch:
            filling[key] = []
            passes.append(filling[key])
        filling[key].append(o)
    return passes


def _batchable(option: QuantOption, in_f: int, spec: QuantizerSpec, shared: bool) -> bool:
    """Whether :func:`option_quantizer` quantizes ``option`` in a GPTQ pass (a batch of one, too)."""
    return spec.method == "gptq" and shared and not option.keep16 and option.fits(in_f)


def option_quantizer(
    w: mx.array, options: Sequence[QuantOption], gram: mx.array | None, spec: QuantizerSpec | None = None, *,
    factor_cache: dict | None = None, batch_bytes: int = GPTQ_BATCH_BYTES, only: set[str] | None = None,
) -> Callable[[QuantOption], tuple[QuantizedTensor, float]]:
    """A function giving :func:`quantize_tensor`'s result and seconds for each of ``options``, asked in their order.

    GPTQ options that share a channel order and group layout (:func:`~mlx_dq.quant.gptq.batch_key`)
    are quantized together in one pass over the columns, up to ``batch_bytes`` of stacked
    float32 weight copies at a time (:func:`option_batches`): identical codes, scales and biases, much less
    per-column overhead for small tensors. Each batch is made when its first option
    is asked for; the seconds are the batch's, shared evenly. ``only`` (option descriptions): just those are asked
    for (one rank's share); the passes are still those of all ``options``, so every result is one process's.
    """
    spec = QuantizerSpec() if spec is None else spec
    shared = gram is not None and (w.ndim == 2 or gram.ndim == 2)
    batches = option_batches(options, tuple(int(d) for d in w.shape), spec, shared=shared, batch_bytes=batch_bytes)
    keyed = {o.desc: b for b in batches for o in b if _batchable(o, int(w.shape[-1]), spec, shared)}
    ready: dict[str, tuple[QuantizedTensor, float]] = {}

    def get(option: QuantOption) -> tuple[QuantizedTensor, float]:
        if option.desc in ready:
            return ready.pop(option.desc)
        t0 = time.perf_counter()
        if option.desc not in keyed:
            qt = quantize_tensor(w, option, gram, spec, factor_cache=factor_cache)
            return qt, time.perf_counter() - t0
        batch = keyed[option.desc]
        qts = gptq_quantize_many(w, batch, gram, spec, factor_cache=factor_cache, error_stats=False)
        seconds = (time.perf_counter() - t0) / len(batch)
        ready.update({o.desc: (q, seconds) for o, q in zip(batch, qts)
                      if o.desc != option.desc and (only is None or o.desc in only)})
        return qts[[o.desc for o in batch].index(option.desc)], seconds

    return get


# --------------------------------------------------------------------------
# a whole model, one decoder layer at a time
# --------------------------------------------------------------------------
@dataclass
class QuantizedModule:
    """One quantized linear layer, expert bank or embedding: its path, module, codes, input Gram and fp32 weight
    (a table with frequent-token rows: ``qt`` holds the other rows, ``split`` the hot ones)."""

    path: str
    module: nn.Module
    qt: QuantizedTensor  # a row-split table: its cold rows
    gram: Any  # the input Gram; its stand-in (mlx_dq.quant.hessian.FactoredGram) once it became the Hessian factor
    weight: mx.array | None  # None for a lookup table (no Gram: its record needs no weight)
    split: RowSplitCodes | None = None
    energy: mx.array | None = None  # output energy per output row, w_i G w_i^T, when the forward recorded it


@dataclass
class StreamPart:
    """What :func:`quantize_stream` yields per decoder layer (then once for embedding/head/final norm).

    ``tensors``: the quantized modules in model order; ``plain``: the other
    parameters of that part (norms, biases) by full name, as they are.
    """

    tensors: list[QuantizedModule] = field(default_factory=list)
    plain: dict[str, mx.array] = field(default_factory=dict)


@dataclass(frozen=True)
class StreamOptions:
    """How :func:`quantize_stream` quantizes: the quantizer ``spec`` (see
    :meth:`mlx_dq.settings.QuantizeSettings.quantizer`), and ``sequential``: each layer's inputs come from the
    already-quantized earlier layers."""

    spec: QuantizerSpec = QuantizerSpec()
    sequential: bool = True


def tensor_work(w: mx.array) -> int:
    """Relative cost of quantizing one weight with GPTQ (rows x columns^2), to start the dearest tensors first."""
    return int(w.size) * int(w.shape[-1])


def _quantize_one(w: mx.array, option: QuantOption, gram: Any, how: StreamOptions,
                  split: tuple[np.ndarray, QuantOption] | None, factor_cache: dict | None = None
                  ) -> tuple[QuantizedTensor, RowSplitCodes | None]:
    """One tensor with its planned option; a table with frequent-token rows ``split`` (ids, hot option): the
    other rows with ``option`` and the hot ones with theirs, one block of rows at a time (no copy of the table).
    ``factor_cache``: holds the Hessian factor of a consumed Gram (see :func:`_can_consume`)."""
    spec, factors = how.spec, {} if factor_cache is None else factor_cache
    if split is None:
        return quantize_rows(w, option, gram, spec, factor_cache=factors), None
    ids, hot_option = split
    cold = np.setdiff1d(np.arange(int(w.shape[0])), ids)
    return (quantize_rows(w, option, gram, spec, rows=cold, factor_cache=factors),
            RowSplitCodes(ids, quantize_rows(w, hot_option, gram, spec, rows=ids, factor_cache=factors)))


def _quantize_all(mods: dict[str, nn.Module], stats: dict, options: dict[str, QuantOption],
                  how: StreamOptions, parallel: bool = True,
                  splits: dict[str, tuple[np.ndarray, QuantOption]] | None = None,
                  energies: dict[str, mx.array] | None = None) -> list[QuantizedModule]:
    """Quantize ``mods`` with their planned options (16-bit when unplanned); ranks share the work when distributed.

    ``parallel``: several tensors at once on the CPU (:mod:`mlx_dq.runtime.threads`); off for the embedding and
    head, whose row blocks would then be in memory side by side. ``splits``: tables stored with
    frequent-token rows (path -> hot ids, hot option). ``energies``: output energy per row, by path.
    """
    splits = splits or {}
    if dist.active():
        return list(_run_shared(mods, stats, options, how, splits, energies or {}))
    grams = {p: st.gram for p, st in stats.items() if p in mods}
    for path, mod in mods.items():
        check_finite_weight(path, mod.weight)

    def one(path: str, w: mx.array, gram: mx.array | None) -> tuple[QuantizedTensor, RowSplitCodes | None]:
        opt, cache = options.get(path, QuantOption.fp16()), {}
        if _can_consume(w, opt, stats.get(path), how, splits.get(path), (energies or {}).get(path)):
            gram = grams[path] = stats[path].gram = consume_gram(gram, cache, how.spec)
        return _quantize_one(w, opt, gram, how, splits.get(path), cache)

    qts = thread_map(one, [(p, mod.weight, grams.get(p)) for p, mod in mods.items()], None if parallel else 1,
                     cost=lambda p, w, g: tensor_work(w))
    return [QuantizedModule(p, mod, qt, grams.get(p), mod.weight, split, (energies or {}).get(p))
            for (p, mod), (qt, split) in zip(mods.items(), qts)]


def _can_consume(w: mx.array, option: QuantOption, st: Any, how: StreamOptions, split: Any, energy: Any) -> bool:
    """Whether a tensor's Gram may become its Hessian factor in place (:func:`~mlx_dq.quant.gptq.consume_gram`): GPTQ in
    act order on a 2-D weight, a float32 Gram no other tensor shares, one option (no frequent-token rows), and the
    rows' output energies known, so the record needs no Gram. Why: one ``k x k`` array instead of two while the
    tensor is quantized (822 MB at Llama-3-8B's 14,336-channel ``down_proj`` input)."""
    gram = None if st is None else st.gram
    spec = how.spec
    return (spec.method == "gptq" and not option.keep16 and not (spec.promote_mixed and option.is_mixed)
            and split is None and energy is not None and w.ndim == 2 and can_consume(gram) and len(st.group) <= 1)


def _run_shared(mods: dict[str, nn.Module], stats: dict, options: dict[str, QuantOption],
                how: StreamOptions, splits: dict[str, tuple[np.ndarray, QuantOption]],
                energies: dict[str, mx.array]) -> Iterator[QuantizedModule]:
    """Quantize this rank's share of ``mods`` (balanced by cost), gather every rank's, yield all in order."""
    for path, mod in mods.items():  # every rank checks every weight, so a bad one stops all ranks alike
        check_finite_weight(path, mod.weight)
    opts = {p: options.get(p, QuantOption.fp16()) for p in mods}
    costs = [dist.option_cost(tuple(m.weight.shape), how.spec.method, how.spec.clip, opts[p].keep16)
             for p, m in mods.items()]
    owner = dict(zip(mods, dist.split_by_cost(costs)))
    mine = {}
    for path, mod in mods.items():
        if owner[path] == dist.rank():
            st = stats.get(path)
            mine[path] = _quantize_one(mod.weight, opts[path], st.gram if st is not None else None, how,
                                       splits.get(path))
    every = {k: v for part in dist.gather_objects(mine) for k, v in part.items()}
    for path, mod in mods.items():
        st = stats.get(path)
        yield QuantizedModule(path, mod, every[path][0], st.gram if st is not None else None, mod.weight,
                              every[path][1], energies.get(path))


def _check_plan_names(runner: LayerRunner, options: dict[str, QuantOption], source: Any) -> None:
    from mlx_dq.model.capture import quantizable_modules

    unknown = sorted(set(options) - set(quantizable_modules(runner.net)))
    if unknown:
        raise InputError(
            f"the plan names tensors this {source.config.get('model_type')} model does not have: {unknown[:3]}"
            + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else "")
        )


def quantize_stream(
    source: Any,
    options: dict[str, QuantOption],
    tokens: mx.array,
    *,
    how: StreamOptions | None = None,
    batch_size: int = 4,
    progress: bool = True,
    row_splits: dict[str, tuple[np.ndarray, QuantOption]] | None = None,
    _fail_after_layer: int | None = None,
) -> Iterator[StreamPart]:
    """Quantize ``source`` one decoder layer at a time over calibration ``tokens``; yield a :class:`StreamPart` each.

    Every linear layer, expert bank and embedding is quantized with ``options``
    (16-bit when it has no entry). ``how`` (default :class:`StreamOptions`' defaults) says how. ``row_splits``
    (table path -> hot ids, hot option) stores those tables with frequent-token rows.
    """
    how = StreamOptions() if how is None else how
    runner = LayerRunner(source, tokens, batch_size)
    _check_plan_names(runner, options, source)
    runner.load_for_probe()
    hidden = runner.join(runner.probe())
    runner.free_outside()  # back for the last part
    layers, prefix = runner.layers, runner.prefix
    bar = tqdm(total=len(layers) + 1, desc="quantize", unit="layer", disable=not (progress and dist.is_root()))
    for i, layer in enumerate(layers):
        mods = runner.load(i)
        with runner.collector(mods, output_energy=True) as col:
            out = runner.forward(i, hidden, col)
        part = StreamPart(_quantize_all(mods, col.stats, options, how, energies=col.energies))
        lp = f"{prefix}{i}."
        weights = {f"{p}.weight" for p in mods}
        part.plain = {lp + k: v for k, v in tree_flatten(layer.parameters()) if lp + k not in weights}
        yield part
        codes = {t.path: t.qt for t in part.tensors} if how.sequential else {}
        del part  # with the consumer's reference gone, the float32 weights and Grams go before the rerun
        col.release()
        for path, qt in codes.items():  # one at a time: together their dequantizing temporaries doubled the peak
            mods[path].weight = qt.dequantize(qt.dtype)  # exact, and promoted to float32 by the forward
            mx.eval(mods[path].weight)
        if how.sequential:
            out = runner.forward(i, hidden, None)
        hidden = out
        del codes, col
        runner.free(i)
        bar.update(1)
        if _fail_after_layer is not None and i == _fail_after_layer:
            raise RuntimeError(f"simulated interruption after layer {i}")
    tables, first = runner.lookup_tables(), []
    for p in tables:  # an untied embedding alone (rounding: no Gram), released before the norm and head are loaded
        runner.load_outside(only=[p])
        done = _quantize_all({p: runner.outside_modules()[p]}, {}, options, how, parallel=False, splits=row_splits)
        for t in done:  # no Gram, so its record needs no weight: not held through the head (2.1 GB at Llama-3-8B)
            t.weight = None
        first += done
        free_table(runner.outside_modules()[p])
        del done
    runner.load_outside(skip=tables)
    part = _quantize_outside(runner, hidden, options, how, skip=tables, splits=row_splits)
    part.tensors = first + part.tensors
    yield part
    bar.update(1)
    bar.close()


def _quantize_outside(runner: LayerRunner, hidden: Any, options: dict[str, QuantOption],
                      how: StreamOptions, skip: Sequence[str] = (), splits: dict | None = None) -> StreamPart:
    """Embedding and head (inputs: the final hidden states through the model's norm), and the other parameters;
    ``skip``: tables quantized already (their weights are neither quantized nor written here)."""
    head_mods = {p: m for p, m in runner.outside_modules().items() if p not in skip}
    net, tokens, share = runner.net, runner.tokens, runner.share
    with runner.collector(head_mods) as col:
        for b, sl in enumerate(runner.batches):
            if not share.owns(b):  # another rank's rows: their inputs would be dropped
                continue
            record_head_inputs(net, tokens[sl], hidden[sl], lambda: share.flush(col, b))
    dist.reduce_stats(col)
    part = StreamPart(_quantize_all(head_mods, col.stats, options, how, parallel=False, splits=splits))
    done = {f"{p}.weight" for p in list(head_mods) + list(skip)}
    part.plain = {k: v for k, v in tree_flatten(net.parameters()) if not k.startswith(runner.prefix) and k not in done}
    return part
