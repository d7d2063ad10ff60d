"""The converter: measure (or reuse) -> optimize -> quantize -> write an MLX model folder.

The plan comes from :mod:`mlx_dq.conversion.resolve` (given, read, or optimized from a
measurement made with this conversion's own rows and quantizer); the model is
quantized layer by layer by :func:`mlx_dq.quant.dispatch.quantize_stream` (GPTQ error
compensation by default, each layer fed the quantized model's activations) and
written by :mod:`mlx_dq.conversion.writer`: safetensors shards, ``config.json`` that
mlx-lm reads, tokenizer files, the manifest ``mlx_dq.json``, a model card and,
when the plan has mixed-proportion tensors, a ``model_file`` that wraps mlx-lm's
own model class (see :mod:`mlx_dq.loader`). The folder is built in a temporary
sibling and renamed into place at the end, so an interrupted convert never
leaves a folder that looks complete.

``mlx_dq.convert(hf_path, mlx_path, bpw=...)`` is :func:`convert_as_mlx_lm`, with mlx-lm's argument names.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_unflatten

from mlx_dq import __version__
from mlx_dq.conversion import hub
from mlx_dq.conversion.card import source_metadata, write_card
from mlx_dq.conversion.resolve import (
    InputChecks,
    available_hot_rows,
    cold_rows_notes,
    embedding_tables,
    model_shapes,
    plan_from_options,
    planned_row_splits,
    resolve_plan,
)
from mlx_dq.conversion.writer import (
    DEFAULT_SHARD_BYTES,
    MODEL_FILE_TEXT,
    ShardWriter,
    WrittenTensors,
    build_manifest,
    output_config,
    prepare_output,
    publish,
    tensor_arrays,
    tensor_record,
)
from mlx_dq.data import calib as calib_mod
from mlx_dq.errors import InputError
from mlx_dq.formats.facts import add_facts
from mlx_dq.layers.mixed import mixed_layer_from_quantized
from mlx_dq.layers.rowsplit import RowSplitEmbedding
from mlx_dq.measure.records import Measurement, save_measurement
from mlx_dq.model.sources import build_model, resolve
from mlx_dq.names import MANIFEST_NAME, MODEL_FILE
from mlx_dq.plan.keeprules import key_matches
from mlx_dq.plan.plan import Plan, load_plan, save_plan
from mlx_dq.quant.dispatch import StreamOptions, quantize_stream
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.rowsplit import HotRows
from mlx_dq.runtime import distributed as dist
from mlx_dq.safety import check_bpw, guard_output_folder, output_lock
from mlx_dq.settings import DistillSettings, PlanSettings, QuantizeSettings


# --------------------------------------------------------------------------
# in memory
# --------------------------------------------------------------------------
def quantize_model(
    model: str,
    plan: Plan | str | Path | dict,
    *,
    progress: bool = False,
    settings: QuantizeSettings | None = None,
    **options: Any,
) -> tuple[nn.Module, Any]:
    """The model quantized with ``plan`` in memory (same arithmetic as :func:`convert`), and its tokenizer.

    ``options`` are :class:`~mlx_dq.settings.QuantizeSettings` fields (float16 only).
    Uniform tensors become MLX's own quantized layers, mixed ones mlx-dq's mixed
    layers, 16-bit ones stay as they are (rounded to float16); a plan's frequent-token
    rows (``settings["row_split"]``) give :class:`~mlx_dq.layers.rowsplit.RowSplitEmbedding` tables.
    """
    s = (settings or QuantizeSettings()).with_options(**options)
    if s.dtype != "float16" or s.promote_mixed:
        raise ValueError("quantize_model builds float16 models with mixed layers as they are")
    source = resolve(str(model))
    if isinstance(plan, dict):
        the_plan = plan_from_options(plan, source)
    else:
        the_plan = load_plan(plan) if isinstance(plan, (str, Path)) else plan
    options_ = {e.key: QuantOption.parse(e.option) for e in the_plan.tensors}
    tokenizer = source.tokenizer()
    texts, tokens = calib_mod.calibration_rows(tokenizer, s.calib, s.rows, s.seq_len, s.seed)
    splits = planned_row_splits(the_plan, calib_mod.text_token_ids(tokenizer, texts, tokens))
    net = build_model(source.config)
    templates = dict(net.named_modules())
    layers_new: dict[str, tuple[nn.Module, Any, Any]] = {}
    plain: dict[str, mx.array] = {}
    how = StreamOptions(s.quantizer(), sequential=s.sequential)
    for part in quantize_stream(source, options_, tokens, how=how, progress=progress, row_splits=splits):
        for t in part.tensors:
            if t.qt.fp is not None:
                plain[f"{t.path}.weight"] = t.qt.fp.astype(mx.float16)
                if "bias" in t.module:
                    plain[f"{t.path}.bias"] = t.module["bias"].astype(mx.float16)
                continue
            layers_new[t.path] = (templates[t.path], t.qt, t.split)
        plain.update({k: v.astype(mx.float16) for k, v in part.plain.items()})
    for path, (template, qt, split) in layers_new.items():
        new = mixed_layer_from_quantized(template, qt, prefer_stock=True)
        if split is not None:
            new = RowSplitEmbedding(mixed_layer_from_quantized(template, split.hot, prefer_stock=True), new,
                                    mx.array(split.ids.astype(np.int32)))
        if "bias" in new:
            new.bias = plain.pop(f"{path}.bias")
        net.update_modules(tree_unflatten([(path, new)]))
    if plain:
        net.load_weights(list(plain.items()), strict=False)
    mx.eval(net.parameters())
    return net, tokenizer


# --------------------------------------------------------------------------
# to a folder
# --------------------------------------------------------------------------
@dataclass
class _Job:
    """One conversion: its source, settings, output dtype, plan, the notes the input checks made and how its
    folder is written (``force``: replace an earlier output; ``shard_bytes``; ``command`` and ``card_ref`` for
    the manifest and card; ``t_start``: when the conversion started, for the manifest's seconds)."""

    source: Any
    q: QuantizeSettings
    p: PlanSettings
    dtype: str
    out_dtype: Any
    out: Path
    force: bool = False
    notes: list[str] = field(default_factory=list)
    plan: Plan | None = None
    measurement: Measurement | None = None
    distill: DistillSettings | None = None
    shard_bytes: int = DEFAULT_SHARD_BYTES
    command: str | None = None
    card_ref: str | None = None
    t_start: float = 0.0


def convert(
    model: str,
    out_dir: str | Path,
    *,
    plan: Plan | str | Path | dict | None = None,
    measurement: Measurement | str | Path | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
    progress: bool = True,
    measure_kwargs: dict | None = None,
    command: str | None = None,
    card_ref: str | None = None,
    allow_incomplete: bool = False,
    allow_other_model: bool = False,
    distill: bool | dict | DistillSettings | None = None,
    _fail_after_layer: int | None = None,
    **options: Any,
) -> dict:
    """Convert ``model`` (any source :func:`mlx_dq.model.sources.resolve` accepts) into an MLX folder ``out_dir``.

    ``options`` are fields of :class:`~mlx_dq.settings.QuantizeSettings` (calib,
    rows, seq_len, seed, method, sequential, clip, damp, dtype, promote_mixed) and
    :class:`~mlx_dq.settings.PlanSettings` (bpw, head_option, keep,
    keep_outside_budget, mlx_lm_compatible). ``head_option`` None puts
    embedding/head into the bpw budget; ``dtype`` is that of scales, biases and
    16-bit tensors (bfloat16 needs ``method="rtn"``; auto: the source's). A
    measurement made here uses the same rows and quantizer (``measure_kwargs``
    overrides :class:`~mlx_dq.settings.MeasureSettings` fields). ``command`` and
    ``card_ref`` go into the model card; ``allow_incomplete`` /
    ``allow_other_model`` accept an unfinished measurement or one (or a plan) made
    for another model of the same tensor names and shapes. ``distill`` (True, a dict of
    :class:`~mlx_dq.settings.DistillSettings` fields, or the settings) distils the quantized scales and
    biases against the source before the folder is published (:func:`mlx_dq.conversion.distill.distill_model`;
    calibration text and seed default to this conversion's). Returns the manifest.
    """
    t_start = time.perf_counter()
    job = replace(_prepare(model, out_dir, plan, measurement, force, options), shard_bytes=shard_bytes,
                  command=command, card_ref=card_ref, t_start=t_start)
    # a second run into the same output stops now, naming this one (rank 0 alone writes, so it alone locks)
    with output_lock(job.out) if dist.is_root() else contextlib.nullcontext():
        job.distill = distill_settings(distill, job.q)
        meas_path = job.out.parent / f".{job.out.name}.measurement.json"
        mkw = {**job.q.measure_defaults(), **(measure_kwargs or {})}
        q = job.q
        texts, tokens = calib_mod.calibration_rows(job.source.tokenizer(), q.calib, q.rows, q.seq_len, q.seed)
        text_ids = calib_mod.text_token_ids(job.source.tokenizer(), texts, tokens)
        if dist.is_root() or (plan is None and measurement is None):  # measuring takes every rank
            job.plan, job.measurement = resolve_plan(
                job.source, job.p, plan=plan, measurement=measurement, measurement_path=meas_path,
                measure_kwargs=mkw, progress=progress, checks=InputChecks(allow_incomplete, allow_other_model),
                notes=job.notes, hot_rows=_hot_rows(job, text_ids),
            )
        job.plan = dist.broadcast(job.plan)  # rank 0's plan is the one every rank applies
        job.notes += cold_rows_notes(job.plan, embedding_tables(job.source.config))
        options_ = {e.key: QuantOption.parse(e.option) for e in job.plan.tensors}
        unplanned = sorted(k for k in model_shapes(job.source.config) if k not in options_)
        if unplanned and not isinstance(plan, dict):
            job.notes.append(f"{len(unplanned)} tensor(s) not in the plan stay 16-bit: {', '.join(unplanned[:4])}"
                             + (f" (and {len(unplanned) - 4} more)" if len(unplanned) > 4 else ""))
        how = StreamOptions(q.quantizer(job.out_dtype), sequential=q.sequential)
        stream = quantize_stream(job.source, options_, tokens, how=how, progress=progress and dist.is_root(),
                                 row_splits=planned_row_splits(job.plan, text_ids),
                                 _fail_after_layer=_fail_after_layer)
        if not dist.is_root():  # the other ranks quantize their share; rank 0 writes the folder
            for _ in stream:
                pass
            return dist.broadcast(None)
        manifest = _write_folder(job, stream, texts, measurement if isinstance(measurement, (str, Path)) else None,
                                 out_dir, progress)
        meas_path.unlink(missing_ok=True)
        Path(str(meas_path) + ".state.safetensors").unlink(missing_ok=True)
        return dist.broadcast(manifest)


def _hot_rows(job: _Job, tokens: np.ndarray) -> dict[str, HotRows]:
    """Frequent-token rows each lookup table may store finer: the ids of the calibration text's ``tokens`` (none
    when turned off or for stock-loadable output)."""
    if not job.p.frequent_rows or job.p.mlx_lm_compatible or job.q.promote_mixed:
        return {}
    return available_hot_rows(job.source.config, tokens)


def distill_settings(distill: bool | dict | DistillSettings | None, q: QuantizeSettings) -> DistillSettings | None:
    """What ``convert(distill=...)`` asks for: None (no distillation) or checked settings.

    True or a dict start from :class:`~mlx_dq.settings.DistillSettings`' defaults with the conversion's
    calibration text and seed; given settings are used as they are.
    """
    if distill is None or distill is False:
        return None
    if isinstance(distill, DistillSettings):
        return distill.with_options()
    base = DistillSettings(calib=q.calib, seed=q.seed)
    if distill is True:
        return base.with_options()
    if isinstance(distill, dict):
        return base.with_options(**distill)
    raise TypeError(f"distill must be True, a dict of DistillSettings fields or DistillSettings, got {distill!r}")


def _distill_partial(job: _Job, tmp: Path, manifest: dict, progress: bool) -> dict:
    """Distil the complete (unpublished) folder ``tmp`` in place against the source; return its new manifest."""
    from mlx_dq.conversion.distill import distill_folder, store_in_place

    updates, record = distill_folder(job.source, job.source.spec, tmp, job.distill, input_label="this conversion",
                                     progress=progress)
    return store_in_place(tmp, updates, record) or manifest


def _prepare(model: str, out_dir: str | Path, plan: Any, measurement: Any, force: bool, options: dict) -> _Job:
    """Check every argument before any work (settings, bpw, head option, output folder, calibration, keep)."""
    qopts, rest = QuantizeSettings.split(options)
    popts, rest = PlanSettings.split(rest)
    if rest:
        raise TypeError(f"convert() got unexpected keyword argument(s): {', '.join(sorted(rest))}")
    q = QuantizeSettings().with_options(**qopts)
    p = PlanSettings().with_options(**{**popts, **({"keep": tuple(popts["keep"])} if "keep" in popts else {})})
    out = Path(out_dir)
    if plan is not None and (p.bpw is not None or measurement is not None):
        raise InputError("a plan is applied as is: do not give a bpw target or a measurement with it")
    if p.bpw is not None:
        check_bpw(p.bpw)
    if p.head_option is not None:
        QuantOption.parse(p.head_option)
    source = resolve(str(model))
    dtype = q.dtype
    if dtype == "auto":  # a bfloat16 source stays bfloat16 (scales, biases and 16-bit tensors)
        declared = source.config.get("torch_dtype") or source.config.get("dtype") or ""
        dtype = "bfloat16" if str(declared).endswith("bfloat16") else "float16"
    out_dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    if out_dtype == mx.bfloat16 and q.method == "gptq":
        raise InputError("bfloat16 output needs method rtn (--method rtn): GPTQ rounds its codes against "
                         "float16 scales")
    guard_output_folder(out, force, [
        ("source model", source.path),
        ("measurement", measurement if isinstance(measurement, (str, Path)) else None),
        ("plan", plan if isinstance(plan, (str, Path)) else None),
        *calib_mod.calib_inputs(q.calib),
    ])
    calib_mod.check_calib(q.calib)  # a bad calibration file fails now, not after the measurement
    for pat in p.keep:  # a keep pattern that matches nothing fails now, not after the measurement
        if not any(key_matches(k, [pat]) for k in model_shapes(source.config)):
            raise InputError(f"keep pattern {pat!r} matches no tensor of {source.spec}")
    return _Job(source, q, p, dtype, out_dtype, out, force)


def _write_folder(job: _Job, stream: Any, texts: Any, measurement_file: Any, out_dir: Any,
                  progress: bool = True) -> dict:
    """Write the quantized stream, config, plan, measurement, manifest and card into a partial folder; publish it."""
    q, p, source, dtype, command, card_ref = job.q, job.p, job.source, job.dtype, job.command, job.card_ref
    tmp = prepare_output(job.out, job.force)
    try:
        writer = ShardWriter(tmp, job.shard_bytes)
        records, mixed, qconf, other_bytes, splits = _write_tensors(writer, stream, job.out_dtype, dtype)
        files = writer.close()
        config = output_config(source.config, qconf, mixed, dtype, {k: r["numel"] for k, r in records.items()},
                               splits)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if mixed or splits:
            (tmp / MODEL_FILE).write_text(MODEL_FILE_TEXT)
        hub.carry_source_files(source, tmp)  # tokenizer, chat template, generation config: unchanged
        if job.measurement is not None:
            save_measurement(job.measurement, tmp / "measurement.json")
        save_plan(job.plan, tmp / "plan.json")
        written = WrittenTensors(records, mixed, files, other_bytes, writer.nbytes, splits)
        manifest = build_manifest(
            source, job.plan, written, config, __version__,
            calib={"source": calib_mod.calib_label(q.calib), "rows": q.rows, "seq_len": q.seq_len,
                   "seed": q.seed, "text_digest": calib_mod.text_digest(texts)},
            settings={"method": q.method, "sequential": q.sequential, "clip": q.clip, "damp": q.damp,
                      "dtype": dtype, "promote_mixed": q.promote_mixed,
                      "mlx_lm_compatible": p.mlx_lm_compatible, "head_option": p.head_option},
            seconds=time.perf_counter() - job.t_start,
        )
        add_facts(manifest, tmp, files, job.plan, measurement_file, job.measurement)
        manifest["provenance"]["command"] = command
        manifest["provenance"]["checks"] = job.notes
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        if job.distill is not None:  # the folder is complete but not yet published: distil it in place
            manifest = _distill_partial(job, tmp, manifest, progress)
        write_card(tmp, manifest, name=Path(card_ref or job.out.resolve()).name, ref=card_ref or str(out_dir),
                   metadata=source_metadata(source), command=command)
        publish(tmp, job.out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _write_tensors(writer: ShardWriter, stream: Any, out_dtype: Any,
                   dtype: str) -> tuple[dict, dict, dict, int, dict]:
    """Write every part of the stream; return the manifest records, mixed and uniform module configs, other
    bytes and the tables with frequent-token rows (path -> {"rows": n}; each part is a module of its own)."""
    records: dict[str, dict] = {}
    mixed: dict[str, dict] = {}
    qconf: dict[str, dict] = {}
    splits: dict[str, dict] = {}
    other_bytes = 0
    for part in stream:
        other_bytes += _write_part(writer, part, out_dtype, dtype, records, mixed, qconf, splits)
        del part  # before the next part is made: this one's float32 weights and Grams are not needed any more
    return records, mixed, qconf, other_bytes, splits


def _write_part(writer: ShardWriter, part: Any, out_dtype: Any, dtype: str, records: dict, mixed: dict,
                qconf: dict, splits: dict) -> int:
    """Write one part's tensors and plain parameters, adding to the records and configs; return its other bytes."""
    other_bytes = 0
    for t in part.tensors:
        pieces = [(t.path, t.qt, t.gram)]
        if t.split is not None:  # the parts' output errors are not metered (err null)
            pieces = [(f"{t.path}.hot", t.split.hot, None), (f"{t.path}.cold", t.qt, None)]
            ids = mx.array(t.split.ids.astype(np.int32))
            writer.add({f"{t.path}.hot_ids": ids})
            other_bytes += ids.nbytes
            splits[t.path] = {"rows": int(ids.size)}
        for path, qt, gram in pieces:
            arrays = tensor_arrays(path, qt, out_dtype)
            writer.add(arrays)
            opt = qt.option
            if opt.is_mixed:
                mixed[path] = {"option": opt.desc, "shape": list(qt.shape)}
            elif not opt.keep16:
                seg = opt.segments[0]
                qconf[path] = {"group_size": seg.group_size, "bits": seg.bits, "mode": "affine"}
            records[path] = tensor_record(qt, gram, t.weight, arrays, dtype, energy=t.energy)
    plain = {k: v.astype(out_dtype) for k, v in part.plain.items()}  # norms, biases: as they are
    writer.add(plain)
    return other_bytes + sum(v.nbytes for v in plain.values())


# --------------------------------------------------------------------------
# ``mlx_dq.convert(hf_path, mlx_path, ...)``: mlx-lm's argument names
# --------------------------------------------------------------------------
def _python_call(hf_path: Any, mlx_path: Any, bpw: Any, kwargs: dict) -> str:
    args = [repr(str(hf_path)), repr(str(mlx_path))] + ([f"bpw={bpw!r}"] if bpw is not None else [])
    args += [f"{k}={v!r}" for k, v in kwargs.items()]
    return f"mlx_dq.convert({', '.join(args)})"


def convert_as_mlx_lm(
    hf_path: str,
    mlx_path: str | Path = "mlx_model",
    bpw: float | None = None,
    *,
    upload_repo: str | None = None,
    dtype: str | None = None,
    private: bool = False,
    command: str | None = None,
    **options: Any,
) -> dict:
    """Measure, optimize and quantize ``hf_path`` to ``bpw`` bits per weight into the MLX folder ``mlx_path``.

    ``hf_path`` is an HF folder, hub id, .gguf file or ``smollm2-135m``; ``dtype``
    the dtype of scales, biases and 16-bit tensors (float16; bfloat16 or auto with
    ``method="rtn"``); ``upload_repo`` uploads the finished folder (checked for
    network and token before any work starts). Other options (``plan``,
    ``measurement``, ``mlx_lm_compatible``, ``calib``, ``rows``, ...) are those of
    :func:`convert`. Returns the manifest.
    """
    if upload_repo is not None:
        hub.check_upload_ready(upload_repo)
    shown = {k: v for k, v in options.items() if k not in ("progress",)}
    if upload_repo is not None:
        shown["upload_repo"] = upload_repo
    if dtype is not None:
        shown["dtype"] = dtype
    manifest = convert(hf_path, mlx_path, bpw=bpw, dtype=dtype or "float16",
                       command=command or _python_call(hf_path, mlx_path, bpw, shown), card_ref=upload_repo,
                       **options)
    if upload_repo is not None:
        try:
            hub.upload_output(mlx_path, upload_repo, private=private)
        except hub.HubError as e:
            raise hub.HubError(f"{e}. The converted folder {mlx_path} is complete: upload it later with "
                               f"`mlx_dq upload {mlx_path} {upload_repo}`") from e
    return manifest
