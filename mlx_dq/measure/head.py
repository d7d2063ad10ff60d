"""The measurer's head stage: the embedding and head tensors, measured after the decoder layers.

The final hidden states go through the model's own norm and head: the base perplexity, the head's Gram matrix, the
carried perturbations' KL (which puts every importance in nats) and the head's options, each priced end to end.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_dq.measure.head_kl import HeadKL, add_lookup_damage, chunked_nll_sum
from mlx_dq.measure.importance import depth_kl_scales
from mlx_dq.measure.meter import (
    ErrorMeter,
    output_energies,
    output_row_sample,
    sampled_row_count,
)
from mlx_dq.measure.records import OptionRecord, TensorRecord
from mlx_dq.measure.run import (
    MeasureRun,
    grid_options,
    owned_options,
    share_options,
)
from mlx_dq.measure.tensor import (
    HowToMeasure,
    fitting_options,
    measure_tensor,
    reference_option,
)
from mlx_dq.model.capture import GramCollector, InputStats
from mlx_dq.model.runner import free_table, record_head_inputs
from mlx_dq.names import layer_index, role_of
from mlx_dq.quant.dispatch import option_batches
from mlx_dq.quant.options import QuantOption
from mlx_dq.runtime import distributed as dist
from mlx_dq.runtime.distributed import iter_batches

HEAD_SAMPLE_FACTOR = 8  # the head's predicted options are measured on sample_rows x this many rows (+ looked-up ones)


def measure_head(run: MeasureRun) -> None:
    """Head and embedding: the final hidden states through the model's own norm and head."""
    s, m, model, tokens, share = run.s, run.m, run.runner.net, run.tokens, run.runner.share
    clock = _Clock(m.extra.setdefault("timing", {}).setdefault("head", {}))
    head_mods = {p: mod for p, mod in run.runner.outside_modules().items() if role_of(p) is not None}
    dist.set_stage("head")
    owner: dict[tuple[str, str], int] = {}
    # an untied embedding is a lookup table (no Gram): measured first, with only itself loaded, then released, so the
    # head's options have the room; its importance takes the KL scale once known
    lookup_only = [p for p in run.runner.lookup_tables() if p in head_mods]
    recs = {}
    for path in lookup_only:
        run.runner.load_outside(only=[path])
        table = head_mods[path]  # loaded: the split needs the shape
        own = share_options(run, {path: table}, {path: _head_passes(run, path, table, None)})
        owner.update(own)
        recs[path] = _measure_head_tensor(run, path, head_mods[path], None, None, 1.0, own)
        free_table(head_mods[path])
    clock("lookup_tables_s")
    run.runner.load_outside(skip=lookup_only)
    with run.runner.collector(head_mods) as head_col:
        for sl in iter_batches(s.rows, 1):  # the head's Gram from this rank's rows, without a logit
            if share.owns_row(sl.start):
                record_head_inputs(model, tokens[sl], run.hidden[sl],
                                   lambda: share.flush(head_col, sl.start, owned=True), s.head_chunk)
    # the base perplexity: the importance rows' logits, head_chunk positions at a time, each row on one rank (every
    # rank holds those rows), summed in row order below
    nlls = [(r, chunked_nll_sum(model, tokens[r:r + 1], run.hidden[r:r + 1], s.head_chunk))
            for r in range(run.n_imp) if r % dist.size() == dist.rank()]
    dist.reduce_stats(head_col)
    nll = 0.0
    for _, v in sorted(x for part in dist.gather_objects(nlls) for x in part):  # row order, as one process sums
        nll += v
    m.base_perplexity = math.exp(nll / (run.n_imp * (s.seq_len - 1)))
    clock("inputs_s")
    head_kl = HeadKL(model, tokens[:run.n_imp], run.hidden[:run.n_imp], s.head_chunk) if run.kl_scale else None
    logit_mods = [mod for p, mod in head_mods.items() if head_col.stats.get(p) is not None]
    kls = _carried_kls(run, head_kl, logit_mods[0] if len(logit_mods) == 1 else None) if run.kl_scale else {}
    scale = _kl_scale(run, kls) if run.kl_scale else 1.0
    run.lookup_weight = _lookup_kls(run, kls) if run.kl_scale else {}
    clock("carried_kl_s")
    no_inputs = sorted(p for p in head_mods if head_col.stats.get(p) is None)
    if sorted(lookup_only) != no_inputs:
        raise RuntimeError(f"tables measured as lookups only {sorted(lookup_only)} differ from those the head "
                           f"did not use {no_inputs}")
    for path in lookup_only:
        if s.importance == "residual":
            recs[path][0].importance = _lookup_weight(run, path, scale)
    rest = {p: mod for p, mod in head_mods.items() if p not in lookup_only}
    own = share_options(run, rest, {p: _head_passes(run, p, mod, head_col.stats.get(p)) for p, mod in rest.items()})
    owner.update(own)
    for path, mod in rest.items():
        recs[path] = _measure_head_tensor(run, path, mod, head_col, head_kl, scale, own)
    clock("options_s")
    head_recs = [recs[p] for p in head_mods]
    if owner:
        merged = dist.gather_layer([r for r, _, _ in head_recs], {}, {}, owner, list(head_mods))[0]
        head_recs = [(r, mod, fn) for r, (_, mod, fn) in zip(merged, head_recs)]
        clock("gather_s")
    for rec, mod, fn in head_recs:
        path = rec.key
        if fn is not None:
            ref_rec = rec.find(reference_option([o.option for o in rec.options], int(mod.weight.shape[-1])))
            if ref_rec is not None and ref_rec.err:
                rec.importance = ref_rec.damage / ref_rec.err**2  # for reports; the optimizer uses the damage
        m.tensors[path] = rec
    del head_kl


class _Clock:
    """Seconds since the previous call, added under a name to ``into`` (the head stage's timing breakdown)."""

    def __init__(self, into: dict):
        self.into, self.t = into, time.perf_counter()

    def __call__(self, name: str) -> None:
        now = time.perf_counter()
        self.into[name] = round(self.into.get(name, 0.0) + now - self.t, 3)
        self.t = now


def _lookup_weight(run: MeasureRun, path: str, scale: float) -> float:
    """A lookup table's KL per squared lookup error: measured end to end when in KL units, else predicted."""
    return run.lookup_weight.get(path, run.embed_importance * scale)


def _measure_head_tensor(run: MeasureRun, path: str, mod: nn.Module, head_col: GramCollector, head_kl: Any,
                         scale: float, owner: dict) -> tuple[TensorRecord, nn.Module, Any]:
    """One embedding or head tensor's options (end-to-end KL damage for the head when in KL units)."""
    s, m, embed_lookup = run.s, run.m, run.embed_lookup
    role = role_of(path)
    stats = head_col.stats.get(path) if head_col is not None else None
    lookup = embed_lookup.get(path) if stats is None else None
    fn = None
    if head_kl is not None and stats is not None:
        fn = head_kl.damage_fn(mod)
        if path in embed_lookup:  # tied: the same codes also feed layer 0 through the lookup
            fn = add_lookup_damage(fn, mod.weight, embed_lookup[path], _lookup_weight(run, path, scale))
    opts = grid_options(run.grid_map, role, path)
    rec = None
    if fn is not None and s.sample_rows > 0:  # anchors end to end, the rest predicted (each rank its share)
        rec = _head_by_anchors(run, path, mod.weight, opts, stats, fn, _lookup_weight(run, path, scale),
                               owned_options(owner, path))
    if rec is None:
        rec = measure_tensor(path, mod.weight, opts, stats, role, spec=s.quantizer(), lookup=lookup, damage_fn=fn,
                             how=HowToMeasure(progress=run.progress, only=owned_options(owner, path),
                                              sample_rows=s.sample_rows))
        if fn is not None and path in embed_lookup:
            rec.extra["lookup_damage"] = [round(x, 6) for x in fn.lookup_damage]
    if stats is not None and path in embed_lookup:
        m.tied = {"lm_head": path}
        rec.extra["tied_head"] = True
    elif stats is None and s.importance == "residual":
        rec.importance = _lookup_weight(run, path, scale)
    if fn is not None:
        rec.extra["damage"] = "KL of the next-token distribution with only this tensor quantized (head)"
        if path in embed_lookup:
            rec.extra["damage"] += (" plus the lookup side's KL: lookup error^2 x the KL per squared error of the"
                                    " lookup alone at the reference option, carried to the logits")
    return rec, mod, fn


def head_anchors(options: Sequence[QuantOption], in_features: int) -> list[QuantOption]:
    """The head options measured end to end: the reference option and the mixed option nearest it in bits."""
    fitting = fitting_options(options, in_features)
    anchors = [reference_option(fitting, in_features)]
    mixed = [o for o in fitting if o.is_mixed and not anchors[0].is_mixed]
    if mixed:
        anchors.append(min(mixed, key=lambda o: (abs(o.nominal_bpw() - anchors[0].nominal_bpw()), o.desc)))
    return anchors


def _head_by_anchors(run: MeasureRun, path: str, w: mx.array, options: Sequence[QuantOption], stats: InputStats,
                     fn: Callable[[mx.array], float], lookup_weight: float,
                     only: set[str] | None = None) -> TensorRecord | None:
    """The head's options: end-to-end KL at :func:`head_anchors`, the others predicted from it; None if no gain.

    Each anchor gives the head's KL per squared output error for its kind
    (whole-tensor or mixed options); another option's damage is that ratio
    times its squared output error, measured on a row sample
    (``HEAD_SAMPLE_FACTOR * sample_rows`` rows plus every token row the lookup
    uses), plus the lookup side as in :func:`~mlx_dq.measure.head_kl.add_lookup_damage` (exact: every
    looked-up row is in the sample). Why: the head's options, each quantized on
    every vocabulary row and run through the head, were most of a small model's
    measurement, and the KL per squared error stays nearly constant within each
    kind (see docs/pipeline.md). ``only`` (several ranks): this rank's options; every rank measures its share of
    the anchors and of the predicted options, on the same global sample, and returns the whole record (the same on
    every rank, and the same as one process's).
    """
    role, in_f = role_of(path), int(w.shape[-1])
    fitting = fitting_options(options, in_f)
    anchors = head_anchors(fitting, in_f)
    lookup = run.embed_lookup.get(path)
    must = np.nonzero(lookup.token_counts)[0] if lookup is not None else None
    energy = output_energies(w, stats.gram)  # once, for the sample and every meter below
    sample = output_row_sample(path, w, stats.gram, HEAD_SAMPLE_FACTOR * run.s.sample_rows, must, energy=energy)
    if sample is None or len(fitting) <= len(anchors):
        return None
    anchor_at = {o.desc: i for i, o in enumerate(anchors)}
    clock = _Clock(run.m.extra["timing"]["head"])
    rec = measure_tensor(path, w, anchors, stats, role, spec=run.s.quantizer(), damage_fn=fn,
                         how=HowToMeasure(progress=run.progress, energy=energy, only=only))
    parts = list(getattr(fn, "lookup_damage", [0.0] * len(rec.options)))
    clock("anchors_s")
    got = sorted(_every_rank(list(zip(rec.options, parts)), only), key=lambda rp: anchor_at[rp[0].option.desc])
    clock("anchors_gather_s")
    rec.options, parts = [r for r, _ in got], [lp for _, lp in got]  # every rank needs both anchors' ratios
    ratio = {r.option.is_mixed: max(r.damage - lp, 0.0) / r.err ** 2 if r.err else 0.0
             for r, lp in zip(rec.options, parts)}  # head KL per squared output error, whole and mixed options
    idx, row_w = sample
    ws = w[idx]
    lk_meter = ErrorMeter(ws, None, lookup.token_counts[np.asarray(idx)]) if lookup is not None else None
    for mixed in (False, True):
        group = [o for o in fitting if o not in anchors and o.is_mixed == mixed]  # measured: this rank's share
        if not any(only is None or o.desc in only for o in group):  # the sample and ratio: the same on every rank
            continue
        meter, k = ErrorMeter(ws, stats.gram, None, row_w, energy[np.asarray(idx)]), \
            ratio.get(mixed, ratio[anchors[0].is_mixed])

        def predicted(wq: mx.array) -> float:
            lk = lookup_weight * lk_meter(wq)[0] ** 2 if lk_meter is not None else 0.0
            parts.append(lk)
            return k * meter(wq)[0] ** 2 + lk

        part = measure_tensor(path, w, group, stats, role, spec=run.s.quantizer(), damage_fn=predicted,
                              how=HowToMeasure(progress=run.progress, sample=sample, energy=energy, only=only))
        rec.options += part.options
    n = len(anchors)
    clock("predicted_s")
    predicted = _every_rank(list(zip(rec.options[n:], parts[n:])), only)
    order = {o.desc: i for i, o in enumerate(fitting)}
    by_option = sorted(list(zip(rec.options[:n], parts[:n])) + predicted, key=lambda rp: order[rp[0].desc])
    rec.options = [r for r, _ in by_option]
    rec.extra.update(sampled_rows=int(idx.shape[0]), head_anchors=[o.desc for o in anchors],
                     head_kl_per_err2={("mixed" if k else "whole"): v for k, v in ratio.items()})
    if lookup is not None:
        rec.extra["lookup_damage"] = [round(lp, 6) for _, lp in by_option]
    return rec


def _head_passes(run: MeasureRun, path: str, mod: nn.Module, stats: InputStats | None) -> list[list[QuantOption]]:
    """An embedding or head tensor's options as the passes one process quantizes them in (as
    :func:`_measure_head_tensor` measures them), for :func:`~mlx_dq.measure.run.share_options`."""
    shape = tuple(int(d) for d in mod.weight.shape)
    fitting = fitting_options(grid_options(run.grid_map, role_of(path), path), shape[-1])
    n, spec = run.s.sample_rows, run.s.quantizer()
    if stats is None:  # a lookup table: rounded, each option alone
        return [[o] for o in fitting]
    if not run.kl_scale:  # no damage function: sample_rows rows, as a decoder tensor
        rows = sampled_row_count(shape, stats.gram.ndim, n) or shape[0]
        return option_batches(fitting, (rows,) + shape[1:], spec)
    anchors = head_anchors(fitting, shape[-1])
    lookup = run.embed_lookup.get(path)
    must = int(np.count_nonzero(lookup.token_counts)) if lookup is not None else 0
    rows = sampled_row_count(shape, stats.gram.ndim, HEAD_SAMPLE_FACTOR * n, must)
    if rows is None or len(fitting) <= len(anchors):
        return option_batches(fitting, shape, spec)  # every option end to end (:func:`_head_by_anchors` is None)
    rest = [o for o in fitting if o not in anchors]
    return option_batches(anchors, shape, spec) + option_batches(rest, (rows,) + shape[1:], spec)


def _every_rank(pairs: list[tuple[OptionRecord, float]], only: set[str] | None) -> list[tuple[OptionRecord, float]]:
    """Every rank's (option record, lookup damage) ``pairs`` when the options are shared over ranks (``only`` given),
    in rank order; ``pairs`` as they are in one process."""
    if only is None:
        return pairs
    return [x for part in dist.gather_objects(pairs) for x in part]


def _carried_kls(run: MeasureRun, head_kl: "HeadKL", mod: nn.Module | None) -> dict[int, float]:
    """The KL of every carried copy (sampled layers and lookup tables), keyed as ``run.carried`` (which they leave),
    on every rank. One pass over the head ``mod``'s vocabulary for all of them (:meth:`HeadKL.kl_many`; several
    ranks share its positions); each copy on its own rank through the whole head when the logits' module is not
    known."""
    if mod is not None and dist.active():
        return _carried_kls_shared(run, head_kl, mod)
    keys = sorted(run.carried)
    hiddens = [run.carried.pop(k) for k in keys]
    if mod is not None:
        return dict(zip(keys, head_kl.kl_many(mod, hiddens)))
    mine = {k: head_kl.kl(h) for k, h in zip(keys, hiddens)}
    return {k: v for part in dist.gather_objects(mine) for k, v in part.items()}


def _carried_kls_shared(run: MeasureRun, head_kl: "HeadKL", mod: nn.Module) -> dict[int, float]:
    """:func:`_carried_kls` over several ranks: every copy goes to every rank, each rank runs the reference and
    the copies on its share of the positions, and the per-position sums are joined in position order, so every
    rank has every copy's KL, the same as one process's. Why: each rank ran the reference logits in full before
    its own copies (a whole pass over the head per rank, most of the stage at 8B shapes)."""
    copies = {k: v for part in dist.gather_objects({k: run.carried.pop(k) for k in sorted(run.carried)})
              for k, v in part.items()}
    keys = sorted(copies)
    n, r, size = head_kl.positions, dist.rank(), dist.size()
    mine = head_kl.position_sums(mod, [copies.pop(k) for k in keys], slice(n * r // size, n * (r + 1) // size))
    return dict(zip(keys, head_kl.kls_from_sums(head_kl.join_sums(dist.gather_objects(mine)))))


def _lookup_kls(run: MeasureRun, kls: dict[int, float]) -> dict[str, float]:
    """Each lookup table's KL per squared lookup error, from its copy carried to the final hidden states (``kls``:
    every copy's KL)."""
    info = run.m.extra["importance"].get("kl_scale", {}).get("lookups", {})
    for d in info.values():
        d["kl"] = kls[d["key"]]
    return {p: d["kl"] / d["err"] ** 2 if d["err"] > 0 else 0.0 for p, d in info.items()}


def _kl_scale(run: MeasureRun, kls: dict[int, float]) -> float:
    """Turn the sampled layers' carried perturbations (``kls``: every copy's KL) into KL and rescale every importance
    to nats; the scale."""
    info = run.m.extra["importance"]["kl_scale"]
    for sample in info["samples"]:
        sample["kl"] = kls[sample["layer"]]
    pred = sum(x["predicted"] for x in info["samples"])
    info["scale"] = sum(x["kl"] for x in info["samples"]) / pred if pred > 0 else 1.0
    scale = info["scale"]
    by_layer = depth_kl_scales(info["samples"], range(len(run.runner.layers)), scale)
    info["depth"] = "log-linear between the sampled layers' KL / predicted damage"
    for rec in run.m.tensors.values():
        rec.importance *= by_layer.get(layer_index(rec.key), scale)
    return scale
