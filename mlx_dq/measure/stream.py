"""The measure stage's layer stream: every option's error for every tensor, and each tensor's importance.

``measure`` streams a model one decoder layer at a time over calibration rows, so peak memory is one layer plus the
rows' hidden states, whatever the depth; each tensor's options are measured with the converter's quantizer, and
importances in KL units make the errors comparable across tensors. Resumable after each layer, and shared over
ranks when started by ``mlx.launch``. How it works: docs/pipeline.md, "How the measurer works".
"""

from __future__ import annotations

import gc
import hashlib
import json
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from tqdm import tqdm

from mlx_dq.data import calib as calib_mod
from mlx_dq.errors import InputError
from mlx_dq.measure.checkpoint import drop_states, load_state, save_state, state_path
from mlx_dq.measure.grids import load_grid
from mlx_dq.measure.head import measure_head
from mlx_dq.measure.importance import (
    perturbed_output,
    residual_importance,
    robust_energy,
)
from mlx_dq.measure.meter import lookup_error
from mlx_dq.measure.model_kl import kl_importance
from mlx_dq.measure.records import (
    Measurement,
    TensorRecord,
    load_measurement,
    save_measurement,
)
from mlx_dq.measure.run import (
    MeasureRun,
    grid_options,
    importance_key,
    importance_option,
    learn_rates,
    owned_options,
    package_versions,
    sample_owner,
    share_options,
)
from mlx_dq.measure.swap import rows_swapped
from mlx_dq.measure.tensor import (
    REFERENCE_OPTION,
    HowToMeasure,
    fitting_options,
    measure_tensor,
    reference_option,
)
from mlx_dq.model.capture import GramCollector, InputStats, quantizable_modules
from mlx_dq.model.cpu_forward import cpu_forward
from mlx_dq.model.runner import LayerRunner, probe_layers
from mlx_dq.model.sources import resolve
from mlx_dq.names import role_of
from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.dispatch import tensor_work
from mlx_dq.runtime import distributed as dist
from mlx_dq.runtime.threads import thread_map
from mlx_dq.safety import flag
from mlx_dq.settings import MeasureSettings

KL_SAMPLE_LAYERS = 8  # decoder layers whose joint perturbation is carried to the logits to scale importance to KL
TIMING_KEYS = ("timing",)  # fields that differ between otherwise identical runs


def _digest(*parts: Any) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else json.dumps(p, sort_keys=True, default=str).encode())
    return h.hexdigest()[:16]


def strip_timing(doc: dict) -> dict:
    """A measurement JSON document without its timing fields (for comparing runs)."""
    out = dict(doc)
    out["extra"] = {k: v for k, v in (doc.get("extra") or {}).items() if k not in TIMING_KEYS}
    return out


def measure(
    spec_or_source: Any,
    *,
    out_path: str | Path | None = None,
    resume: bool = True,
    progress: bool = True,
    settings: MeasureSettings | None = None,
    _fail_after_layer: int | None = None,
    **options: Any,
) -> Measurement:
    """Measure every quantizable tensor of a model under every option of its grid role.

    Streams one decoder layer at a time (see docs/pipeline.md, "How the measurer works"); writes and
    resumes ``out_path`` when given; returns the in-memory measurement.
    ``options`` are :class:`~mlx_dq.settings.MeasureSettings` fields (or pass
    ``settings``): ``method``/``clip`` choose the quantizer whose errors are
    measured (default: the converter's, GPTQ with the clip search); ``kl_scale``
    puts every importance in KL units and measures the head's options end to end;
    ``head_chunk`` bounds the head's logits to ``[head_chunk, vocab]`` floats at a
    time; ``sample_rows > 0`` measures each linear layer's options on that many
    random output rows (the importance reference on all; the head's two anchor options on
    all and its others on ``HEAD_SAMPLE_FACTOR`` times as many, see :mod:`mlx_dq.measure.head`).
    """
    run = _start(spec_or_source, (settings or MeasureSettings()).with_options(**options), out_path, progress)
    old = _resume(run) if resume else None
    if old is not None:
        return old
    with cpu_forward():
        return _measure_all(run, _fail_after_layer)


def _measure_all(run: MeasureRun, _fail_after_layer: int | None) -> Measurement:
    """The stages after the start: embedding, decoder layers (resumable), head; the finished record."""
    _embed(run)
    bar = tqdm(total=len(run.runner.layers), desc="measure", unit="layer", disable=not run.progress,
               initial=run.start_layer)
    for i in range(run.start_layer, len(run.runner.layers)):
        _measure_layer(run, i)
        bar.update(1)
        if _fail_after_layer is not None and i == _fail_after_layer:
            raise RuntimeError(f"simulated interruption after layer {i}")
    bar.close()
    measure_head(run)
    return _finish(run)


def _start(spec_or_source: Any, s: MeasureSettings, out_path: str | Path | None, progress: bool) -> MeasureRun:
    """Resolve the source, draw the calibration rows, build the runner and the empty measurement record."""
    t_start = time.perf_counter()
    source = resolve(str(spec_or_source)) if isinstance(spec_or_source, (str, Path)) else spec_or_source
    texts, tokens = calib_mod.calibration_rows(source.tokenizer(), s.calib, s.rows, s.seq_len, s.seed)
    grid_map = load_grid(s.grid)
    n_imp = min(s.importance_rows, s.rows)
    share = dist.RowShare(s.rows, s.batch_size, n_imp)  # one rank: every batch, as before
    runner = LayerRunner(source, tokens, s.batch_size, share, s.expert_mode)
    layers = runner.layers
    clip, kl_scale = s.resolved_clip, s.resolved_kl_scale
    m = Measurement(
        model={"spec": str(getattr(source, "spec", spec_or_source)), "model_type": source.config.get("model_type"),
               "num_layers": len(layers), "fingerprint": source.fingerprint()},
        calibration={"source": calib_mod.calib_label(s.calib), "text_digest": calib_mod.text_digest(texts),
                     "rows": s.rows, "seq_len": s.seq_len, "seed": s.seed,
                     "tokens_digest": _digest(np.asarray(tokens).tobytes())},
        grid={"source": str(s.grid) if s.grid else "default",
              "roles": {r: [o.desc for o in opts] for r, opts in sorted(grid_map.items())}},
        versions=package_versions(),
        last_module_idx=-1,
    )
    m.extra = {
        "importance": {"method": s.importance, "reference": REFERENCE_OPTION, "rows": n_imp,
                       "predicts": "damage ~ importance * err**2"},
        "expert_gram": s.expert_mode, "clip": clip, "method": s.method, "complete": False,
    }
    if s.sample_rows:  # only when set, so measurements without it keep their settings digest
        m.extra["sample_rows"] = int(s.sample_rows)
    if kl_scale:
        m.extra["importance"]["kl_scale"] = {"samples": [], "lookups": {}}
    digest = _digest(m.model, m.calibration, m.grid, m.extra)
    m.extra["settings_digest"] = digest
    m.extra["timing"] = {"layers_s": [], "total_s": None}
    run = MeasureRun(s, source, runner, tokens, grid_map, m, digest, Path(out_path) if out_path is not None else None,
                     progress and dist.is_root(), clip, kl_scale, n_imp, t_start=t_start)
    run.sample_layers = set(np.linspace(0, len(layers) - 1, min(KL_SAMPLE_LAYERS, len(layers)))
                            .round().astype(int).tolist())
    return run


def _resume(run: MeasureRun) -> Measurement | None:
    """Continue from ``run.out`` when it holds this measurement: the finished one, or its state after some layer."""
    out, m = run.out, run.m
    if out is None or not (out.exists() or dist.active()):
        return None
    old = dist.broadcast(load_measurement(out) if dist.is_root() and out.exists() else None)
    if old is None:
        return None
    if old.extra.get("settings_digest") != run.digest:
        raise InputError(
            f"{out} was measured with different settings (model, calibration, grid or importance); "
            f"pass {flag('resume', False)} to overwrite it"
        )
    if old.extra.get("complete"):
        return old
    done_idx = old.last_module_idx if old.last_module_idx is not None else -1
    if dist.active():  # every rank must hold its state of the last layer the file records
        st = load_state(out, run.digest, done_idx, run.runner.share.batches) if done_idx >= 0 else None
        state = st if all(dist.gather_objects(st is not None)) else None
    else:
        state = load_state(out, run.digest)
    if state is not None and state[1] <= done_idx:
        run.hidden, done, run.carried = state
        run.start_layer = done + 1
        keep = tuple(f"{run.runner.prefix}{i}." for i in range(run.start_layer))
        m.tensors = {k: t for k, t in old.tensors.items() if k.startswith(keep)}
        m.last_module_idx = done
        m.extra["timing"] = {k: (v[:run.start_layer] if isinstance(v, list) else v)
                             for k, v in old.extra.get("timing", {}).items()}
        if run.kl_scale:
            m.extra["importance"]["kl_scale"] = old.extra["importance"]["kl_scale"]
    return None


def _embed(run: MeasureRun) -> None:
    """Embed the rows (recording the layers' call arguments) with only the embedding and small non-layer weights
    loaded."""
    runner = run.runner
    runner.load_for_probe()
    embed_mods = {p: mod for p, mod in quantizable_modules(runner.net).items() if isinstance(mod, nn.Embedding)}
    with runner.collector(embed_mods) as embed_col:
        firsts = runner.probe(flush=embed_col.flush)
    run.embed_lookup = dict(embed_col.lookups)
    h0 = mx.concatenate(firsts, axis=0)[:run.n_imp]
    run.embed_importance = float((h0 * h0).sum().item()) / robust_energy(h0)  # without kl_scale: err**2 of the total
    if run.kl_scale:
        _lookup_samples(run, embed_mods)
    if run.hidden is None:
        run.hidden = runner.join(firsts)
    runner.free_outside()  # back for the head stage


def _lookup_samples(run: MeasureRun, embed_mods: dict[str, nn.Module]) -> None:
    """Each lookup table quantized alone at its reference option: the importance rows' first hidden states, kept
    in ``run.carried`` (keys -1, -2, ...) to travel to the logits like a sampled layer's perturbed copy.

    The head stage (:mod:`mlx_dq.measure.head`) turns each into the lookup side's KL per squared lookup error.
    Why: predicted from layer 0's residual energy, the lookup side was priced far too cheap and plans starved the
    embedding (see docs/pipeline.md).
    """
    info = run.m.extra["importance"]["kl_scale"]["lookups"]
    if run.start_layer > 0:  # resumed: the copies and their errors are in the saved state and measurement
        return
    tokens = run.tokens[:run.n_imp]
    ids, counts = np.unique(np.asarray(tokens), return_counts=True)
    rows = mx.array(ids)
    for k, path in enumerate(sorted(p for p in embed_mods if p in run.embed_lookup)):
        mod = embed_mods[path]
        w = mod.weight
        ref = reference_option(grid_options(run.grid_map, role_of(path), path), int(w.shape[-1]))
        wq = quantize_weight(w[rows], ref, clip=run.clip).dequantize(mx.float32).astype(w.dtype)
        info[path] = {"key": -1 - k, "option": ref.desc, "err": lookup_error(w[rows], wq, counts)}
        if dist.rank() != 0:  # one copy, made and carried on the first rank
            continue
        with rows_swapped(mod, ids, wq):  # quantization is per row: the looked-up rows are enough
            run.carried[-1 - k] = probe_layers(run.runner.net, tokens)[0]
            mx.eval(run.carried[-1 - k])


def _measure_layer(run: MeasureRun, i: int) -> None:
    """Decoder layer ``i``: collect its inputs, measure every option of its tensors, their importance; save."""
    t0 = time.perf_counter()
    runner, m = run.runner, run.m
    layer = runner.layers[i]
    mods = {p: mod for p, mod in runner.load(i).items() if role_of(p) is not None}
    dist.set_stage(i)
    with runner.collector(mods, output_energy=True) as col:
        new_hidden = runner.forward(i, run.hidden, col)
    t1 = time.perf_counter()
    call0 = runner.calls[0][i]
    for k in run.carried:  # perturbed copies of earlier layers travel on through this one
        run.carried[k] = layer(run.carried[k], *call0[0], **call0[1]).astype(mx.float32)
        mx.eval(run.carried[k])
    carried = (time.perf_counter() - t1, len(run.carried))
    records, refs, owner, timings = _measure_options(run, mods, col, i)
    col.release()  # the Grams are not read again (1 GB at Llama-3-8B shapes): the importance pass records its inputs
    t2 = time.perf_counter()
    _layer_importance(run, i, mods, records, refs, owner, timings, carried)
    run.hidden = new_hidden
    del new_hidden, refs, col
    runner.free(i)
    gc.collect()  # the capture's temporary classes form reference cycles; free this layer's arrays now
    for rec in records:
        m.tensors[rec.key] = rec
    m.last_module_idx = i
    t3 = time.perf_counter()
    m.extra["timing"]["layers_s"].append(round(t3 - t0, 3))
    for name, dt in (("forward_s", t1 - t0), ("options_s", t2 - t1), ("importance_s", t3 - t2)):
        m.extra["timing"].setdefault(name, []).append(round(dt, 3))
    _save_layer(run, i)


def _measure_options(run: MeasureRun, mods: dict[str, nn.Module], col: GramCollector,
                     i: int) -> tuple[list, dict, dict, dict]:
    """Every option of every tensor of decoder layer ``i`` (this rank's share): records, the reference options'
    weights for importance, the option owners and this rank's option seconds (path -> option -> s)."""
    s = run.s
    records, refs, timings = [], {}, {}
    owner = share_options(run, mods, layer=i)  # {} with one rank

    grid = {p: grid_options(run.grid_map, role_of(p), p) for p in mods}
    refs_opt = {p: reference_option(grid[p], int(mod.weight.shape[-1])) for p, mod in mods.items()}

    def one(path: str, w: mx.array, stats: InputStats | None) -> tuple[TensorRecord, dict]:
        kept = {refs_opt[path].desc: None}
        how = HowToMeasure(only=owned_options(owner, path), sample_rows=s.sample_rows, timings=timings[path],
                           energy=col.energies.get(path), consume_gram=stats is not None and len(stats.group) <= 1)
        rec = measure_tensor(path, w, grid[path], stats, role_of(path), spec=s.quantizer(), kept=kept, how=how)
        return rec, kept

    for path in mods:
        timings[path] = {}
    measured = thread_map(one, [(p, mod.weight, col.stats.get(p)) for p, mod in mods.items()],
                          cost=lambda p, w, st: tensor_work(w))  # tensors in parallel, the dearest first
    for (path, mod), (rec, kept) in zip(mods.items(), measured):
        opts, ref = grid[path], refs_opt[path]
        records.append(rec)
        in_f = int(mod.weight.shape[-1])
        if s.importance == "residual" and owner and owner.get(
                (path, importance_option(run, path, fitting_options(opts, in_f), in_f))) != dist.rank():
            rec.extra["importance_ref"] = ref.desc  # another rank computes this tensor's importance
        elif s.importance == "residual":
            if kept[ref.desc] is None:  # the reference is not one of the grid's options
                gram = col.stats[path].gram
                kept[ref.desc] = quantize_weight(
                    mod.weight, ref, gram=gram.sum(0) if gram.ndim == 3 else gram, clip=run.clip).stored()
            refs[path] = kept[ref.desc]
            rec.extra["importance_ref"] = ref.desc
    return records, refs, owner, timings


def _layer_importance(run: MeasureRun, i: int, mods: dict[str, nn.Module], records: list, refs: dict,
                      owner: dict, timings: dict, carried: tuple[float, int]) -> None:
    """Residual importance of a layer's tensors, and (sampled layers) the perturbed copy carried to the logits.

    When distributed, also gathers the layer's results and every rank's option ``timings`` (with the importance
    reruns' seconds) and ``carried`` (seconds, copies carried through this layer)."""
    s, layer, call0 = run.s, run.runner.layers[i], run.runner.calls[0][i]
    hidden = run.hidden
    imp = {}
    if s.importance == "residual" and refs:
        seconds: dict[str, float] = {}
        imp = residual_importance(layer, hidden[:run.n_imp], call0, mods, refs, s.expert_mode, seconds)
        for path, sec in seconds.items():
            timings[path][importance_key(path)] = sec
    if owner:  # gather every rank's options, importances (and the sampled layers' references)
        records[:], imp, refs = dist.gather_layer(
            records, imp, refs if run.kl_scale and i in run.sample_layers else {}, owner, list(mods))
        learn_rates(run, mods, timings, carried)  # once every rank is past its share
    if s.importance != "residual":
        return
    for rec in records:
        r = imp[rec.key]
        rec.importance = r["importance"]
        rec.extra["importance_detail"] = {"damage": r["damage"], "err": r["err"]}
    if run.kl_scale and i in run.sample_layers:
        if sample_owner(run, i) == dist.rank():  # each carried copy travels on one rank, in turn
            run.carried[i] = perturbed_output(layer, hidden[:run.n_imp], call0, mods, refs)
        run.m.extra["importance"]["kl_scale"]["samples"].append(
            {"layer": i, "predicted": sum(imp[p]["damage"] for p in refs)})


def _save_layer(run: MeasureRun, i: int) -> None:
    """Write the measurement and the carried state after layer ``i`` (every rank's state when distributed)."""
    out = run.out
    if out is not None and dist.active():  # a layer is done once every rank has its state
        save_state(out, i, run.hidden, run.digest, run.carried)
        dist.barrier()
        if dist.is_root():
            save_measurement(run.m, out)
        drop_states(out, before=i - 1)
    elif out is not None:
        save_measurement(run.m, out)
        save_state(out, i, run.hidden, run.digest, run.carried)


def _finish(run: MeasureRun) -> Measurement:
    """Whole-model importance (``importance="kl"``), mark complete, write the file and drop the state."""
    s, m, out = run.s, run.m, run.out
    if s.importance == "kl":
        kl_importance(run.source, m, run.tokens[:run.n_imp], run.grid_map, clip=run.clip, progress=run.progress)
    m.extra["complete"] = True
    m.extra["timing"]["total_s"] = round(time.perf_counter() - run.t_start, 3)
    if out is not None and dist.is_root():
        save_measurement(m, out)
        state_path(out).unlink(missing_ok=True)
    if out is not None and dist.active():
        dist.barrier()
        drop_states(out)
    dist.set_stage(None)
    return m
