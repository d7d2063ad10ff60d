"""The converter: measure (or reuse) -> optimize -> quantize -> write an MLX model folder.

Quantization streams the source one decoder layer at a time, like the
measurer: each layer's weights are loaded, the inputs of its linear layers are
captured over calibration rows (Gram matrices ``X^T X``), every tensor is
quantized with its planned option (GPTQ error compensation by default, or
round-to-nearest with clip search), and the layer's output for the next layer
is computed with the *quantized* weights (sequential quantization), so errors
do not pile up unseen. Peak memory is about one layer plus activations.

The output folder holds safetensors shards, ``config.json`` that mlx-lm reads
(a ``quantization`` entry for every quantized module), tokenizer files, the
manifest ``mlx_dq.json`` and, when the plan has mixed-proportion tensors, a
``model_file`` that wraps mlx-lm's own model class (see :mod:`mlx_dq.loader`).
It is written into a temporary sibling folder and renamed into place at the
end, so an interrupted convert never leaves a folder that looks complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from tqdm import tqdm

from . import distributed as dist
from .capture import GramCollector, iter_batches, quantizable_modules
from .measurement import Measurement, load_measurement
from .optimize import Plan, load_plan, optimize, save_plan
from .options import QuantOption
from .gptq import DEFAULT_DAMP
from .quant import QuantizedTensor, output_error, promote_to_uniform, quantize_weight

MANIFEST_NAME = "mlx_dq.json"
MANIFEST_SCHEMA = "mlx_dq.manifest"
MANIFEST_VERSION = 2  # 2: module "bits" -> "storage_bits", "dense_bytes" -> "kept16_bytes", facts added
MODEL_FILE = "mlx_dq_model.py"
DEFAULT_SHARD_BYTES = 4 << 30
DEFAULT_ROWS = 32
DEFAULT_SEQ_LEN = 512
METHODS = ("gptq", "rtn")

MODEL_FILE_TEXT = '''"""mlx-lm model file for an mlx-dq output with mixed-proportion layers.

mlx-lm loads it with ``trust_remote_code=True`` (CLIs: ``--trust-remote-code``).
It wraps mlx-lm's own model class for this folder's ``model_type`` and swaps in
mlx-dq's mixed layers listed under ``mlx_dq.mixed`` in config.json.
"""

import json
from pathlib import Path

try:
    from mlx_dq.loader import mixed_model_classes
except ImportError as e:  # pragma: no cover - depends on the user's environment
    raise ImportError("this model has mixed-proportion layers: install mlx-dq (pip install mlx-dq)") from e

_CONFIG = json.loads((Path(__file__).parent / "config.json").read_text())
Model, ModelArgs = mixed_model_classes(_CONFIG)
'''


# --------------------------------------------------------------------------
# one tensor
# --------------------------------------------------------------------------
def quantize_tensor(
    w: mx.array, option: QuantOption, gram: mx.array | None, *, method: str = "gptq", clip: bool = True,
    damp: float = DEFAULT_DAMP,
    promote: bool = False,
    factor_cache: dict | None = None,
    scale_dtype: mx.Dtype = mx.float16,
) -> QuantizedTensor:
    """Quantize one weight with ``option``: GPTQ when a Gram matrix is there and ``method == "gptq"``, else RTN + clip.

    ``promote`` quantizes a mixed option in natural channel order and rewrites it
    losslessly as one uniform tensor at its highest width (stock-loadable).
    ``factor_cache`` (a dict) reuses Hessian factors across options of one tensor.
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if option.keep16:
        return quantize_weight(w, option, scale_dtype=scale_dtype)
    natural = promote and option.is_mixed
    if method == "gptq" and gram is not None:
        from .gptq import gptq_quantize

        if scale_dtype != mx.float16:
            raise ValueError("GPTQ rounds its codes against float16 scales: bfloat16 output needs method rtn")
        qt = gptq_quantize(w, option, gram, damp=damp, clip=clip, natural_order=natural,
                           factor_cache=factor_cache, error_stats=False)  # callers meter the error themselves
    else:
        qt = quantize_weight(w, option, gram=gram, clip=clip, scale_dtype=scale_dtype, natural_order=natural)
    return promote_to_uniform(qt) if natural else qt


def tensor_arrays(path: str, qt: QuantizedTensor, dtype: mx.Dtype) -> dict[str, mx.array]:
    """The arrays stored for module ``path`` quantized as ``qt`` (names as the loading layer expects).

    Scales and biases keep the 16-bit dtype they were quantized with (the codes
    were rounded against exactly those values); ``dtype`` applies to 16-bit tensors.
    """
    if qt.fp is not None:
        return {f"{path}.weight": qt.fp.astype(dtype)}
    if not qt.option.is_mixed:
        w, s, b = qt.parts[0]
        return {f"{path}.weight": w, f"{path}.scales": s, f"{path}.biases": b}
    out = {}
    for i, (w, s, b) in enumerate(qt.parts):
        out[f"{path}.weight_{i}"] = w
        out[f"{path}.scales_{i}"] = s
        out[f"{path}.biases_{i}"] = b
    out[f"{path}.perm"] = mx.array(qt.perm)
    return out


# --------------------------------------------------------------------------
# output folder
# --------------------------------------------------------------------------
class ShardWriter:
    """Writes arrays into numbered safetensors shards as they come, then names them like mlx-lm does."""

    def __init__(self, folder: Path, max_bytes: int = DEFAULT_SHARD_BYTES):
        self.folder = folder
        self.max_bytes = max_bytes
        self.pending: dict[str, mx.array] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.nbytes = 0

    def add(self, arrays: dict[str, mx.array]) -> None:
        """Queue ``arrays``; a shard is written when it would grow past ``max_bytes``."""
        size = sum(a.nbytes for a in arrays.values())
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        self.pending.update(arrays)
        self.pending_bytes += size
        self.nbytes += size

    def _flush(self) -> None:
        if not self.pending:
            return
        path = self.folder / f"shard-{len(self.files):05d}.safetensors"
        mx.save_safetensors(str(path), self.pending, metadata={"format": "mlx"})
        self.files.append((path, sorted(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, rename shards (``model.safetensors`` or ``model-0000i-of-0000n``), write the index."""
        self._flush()
        n = len(self.files)
        out, weight_map = [], {}
        for i, (path, keys) in enumerate(self.files):
            name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.folder / name)
            out.append(self.folder / name)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
            (self.folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return out


def _prepare_output(out: Path, force: bool) -> Path:
    """Check ``out`` may be written and return a fresh temporary sibling folder to build it in.

    Leftover ``.NAME.partial-PID`` folders of killed conversions in the same parent are removed first.
    """
    from .safety import guard_output_folder, make_partial_folder

    guard_output_folder(out, force)
    return make_partial_folder(out)


def _publish(tmp: Path, out: Path) -> None:
    """Move the finished folder into place (replacing an old one only now, when the new one is complete)."""
    from .safety import publish_folder

    publish_folder(tmp, out)


# --------------------------------------------------------------------------
# plan resolution
# --------------------------------------------------------------------------
def resolve_plan(
    source: Any,
    *,
    bpw: float | None,
    plan: Plan | str | Path | dict | None,
    measurement: Measurement | str | Path | None,
    measurement_path: Path | None,
    mlx_lm_compatible: bool,
    head_option: str | None,
    keep: Iterable[str],
    measure_kwargs: dict,
    progress: bool,
    keep_outside_budget: bool = False,
    allow_incomplete: bool = False,
    allow_other_model: bool = False,
    notes: list[str] | None = None,
) -> tuple[Plan, Measurement | None]:
    """The plan to apply: given as is, or optimized from a given or freshly measured measurement.

    A given measurement or plan must have been made for ``source`` (fingerprint
    and shapes; see :func:`mlx_dq.safety.check_belongs_to`) and a measurement
    must be complete, unless the ``allow_*`` flags say otherwise; what the
    checks could not check goes into ``notes``.
    """
    from .safety import check_measurement_input, check_plan_input

    notes = [] if notes is None else notes
    if isinstance(plan, dict):
        return plan_from_options(plan, source), None
    if plan is not None:
        if isinstance(plan, (str, Path)):  # ours, or a foreign file mapped onto this model (mlx_dq.formats)
            from .formats import load_plan_any

            p = load_plan_any(plan, source)
        else:
            p = plan
        notes += check_plan_input(p, plan, source, allow_other_model)
        return p, None
    if bpw is None:
        raise ValueError("give a bits-per-weight target (bpw) or a plan")
    if measurement is None:
        from .measure import measure

        m = measure(source, out_path=measurement_path, progress=progress, **measure_kwargs)
    else:
        m = load_measurement(measurement) if isinstance(measurement, (str, Path)) else measurement
        notes += check_measurement_input(m, measurement, source, allow_incomplete, allow_other_model)
    p = optimize(m, bpw, head_option=head_option, keep=tuple(keep), mlx_lm_compatible=mlx_lm_compatible,
                 keep_outside_budget=keep_outside_budget)
    from .formats.common import model_modules
    from .formats.exl2 import complete_head

    complete_head(p, model_modules(source), head_option)  # an EXL2 measurement has no embedding/head
    return p, m


def plan_from_options(options: dict[str, str], source: Any) -> Plan:
    """A plan from a hand-written mapping of module path -> option description (a fixed recipe)."""
    from .optimize import PlanEntry
    from .sources import build_model

    mods = quantizable_modules(build_model(source.config))
    entries, used, numel = [], 0, 0
    for key, desc in options.items():
        if key not in mods:
            raise ValueError(f"the recipe names a tensor the model does not have: {key!r}")
        opt = QuantOption.parse(desc)
        shape = [int(d) for d in mods[key].weight.shape]
        bits = opt.storage_bits(shape)
        entries.append(PlanEntry(key=key, option=opt.desc, bits=bits, shape=shape, numel=math.prod(shape)))
        used, numel = used + bits, numel + math.prod(shape)
    bpw = used / numel if numel else 0.0
    return Plan(target_bpw=bpw, achieved_bpw=bpw, objective=0.0, lower_bound=None, gap=None, budget_bits=used,
                used_bits=used, numel=numel, total_bpw=bpw, tensors=entries, method="recipe")


# --------------------------------------------------------------------------
# the streaming quantizer
# --------------------------------------------------------------------------
def quantize_stream(
    source: Any,
    options: dict[str, QuantOption],
    tokens: mx.array,
    *,
    method: str = "gptq",
    sequential: bool = True,
    clip: bool = True,
    damp: float = DEFAULT_DAMP,
    promote_mixed: bool = False,
    batch_size: int = 4,
    progress: bool = True,
    _fail_after_layer: int | None = None,
    scale_dtype: mx.Dtype = mx.float16,
) -> Iterator[tuple | dict]:
    """Quantize ``source`` one decoder layer at a time over calibration ``tokens``.

    Yields ``(path, module, QuantizedTensor, gram, fp32 weight)`` for every
    linear layer, expert bank and embedding (16-bit when ``options`` has no entry
    for it), and dicts of the remaining parameters (norms, biases) by full name.
    With ``sequential`` each layer's output is recomputed with its quantized
    weights before it feeds the next layer.
    """
    from .measure import _free, _layer_prefix, _load_into, head_logits, position_chunks, probe_layers
    from .sources import build_model

    net = build_model(source.config)
    layers = net.layers
    prefix = _layer_prefix(net, layers)
    all_mods = quantizable_modules(net)
    unknown = sorted(set(options) - set(all_mods))
    if unknown:
        raise ValueError(
            f"the plan names tensors this {source.config.get('model_type')} model does not have: {unknown[:3]}"
            + (f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else "")
        )

    def run(mods: dict[str, nn.Module], stats: dict) -> Iterator[tuple]:
        from .safety import check_finite_weight

        if dist.active():  # each rank quantizes its share of the tensors (balanced by cost); all get every result
            yield from _run_shared(mods, stats, options, method=method, clip=clip, damp=damp,
                                   promote=promote_mixed, scale_dtype=scale_dtype)
            return
        for path, mod in mods.items():
            st = stats.get(path)
            gram = st.gram if st is not None else None
            w = mod.weight
            check_finite_weight(path, w)
            qt = quantize_tensor(w, options.get(path, QuantOption.fp16()), gram, method=method, clip=clip, damp=damp,
                                 promote=promote_mixed, scale_dtype=scale_dtype)
            yield path, mod, qt, gram, w

    _load_into(net, dict(source.other_weights()))
    batches = list(iter_batches(int(tokens.shape[0]), batch_size))
    share = dist.RowShare(int(tokens.shape[0]), batch_size)  # one rank: every batch, as before
    progress = progress and dist.is_root()
    calls, firsts = [], []
    for sl in batches:
        h0, call = probe_layers(net, tokens[sl])
        mx.eval(h0)
        calls.append(call)
        firsts.append(h0)
    hidden = share.join([f for b, f in enumerate(firsts) if share.runs(b)])
    del firsts

    def forward(layer: nn.Module, i: int, col: GramCollector | None) -> mx.array:
        ys = []
        for b, sl in enumerate(batches):
            if not share.runs(b):
                continue
            args, kwargs = calls[b][i]
            y = layer(hidden[sl], *args, **kwargs).astype(mx.float32)
            mx.eval(y)
            if col is not None:
                share.flush(col, b)
            ys.append(y)
        if col is not None:
            dist.reduce_stats(col)
        return share.join(ys)

    bar = tqdm(total=len(layers) + 1, desc="quantize", unit="layer", disable=not progress)
    for i, layer in enumerate(layers):
        _load_into(net, dict(source.layer_weights(i)))
        lp = f"{prefix}{i}."
        mods = quantizable_modules(layer, prefix=lp)
        with GramCollector(mods) as col:
            out = forward(layer, i, col)
        fake = {}
        for item in run(mods, col.stats):
            fake[item[0]] = item[2].dequantize(mx.float32)
            yield item
        weights = {f"{p}.weight" for p in mods}
        yield {lp + k: v for k, v in tree_flatten(layer.parameters()) if lp + k not in weights}
        if sequential:
            for path, wq in fake.items():
                mods[path].weight = wq
            out = forward(layer, i, None)
        hidden = out
        del fake, col
        _free(layer)
        bar.update(1)
        if _fail_after_layer is not None and i == _fail_after_layer:
            raise RuntimeError(f"simulated interruption after layer {i}")

    head_mods = {p: m for p, m in all_mods.items() if not p.startswith(prefix)}
    with GramCollector(head_mods) as col:
        for b, sl in enumerate(batches):
            if not share.runs(b):
                continue
            h = hidden[sl]
            for psl in position_chunks(int(tokens.shape[1])):  # logits never [calibration tokens, vocab]
                mx.eval(head_logits(net, tokens[sl, psl], h[:, psl]))
                share.flush(col, b)
    dist.reduce_stats(col)
    yield from run(head_mods, col.stats)
    done = {f"{p}.weight" for p in head_mods}
    yield {k: v for k, v in tree_flatten(net.parameters()) if not k.startswith(prefix) and k not in done}
    bar.update(1)
    bar.close()


def _run_shared(mods: dict[str, nn.Module], stats: dict, options: dict[str, QuantOption], *, method: str,
                clip: bool, damp: float, promote: bool, scale_dtype: mx.Dtype = mx.float16) -> Iterator[tuple]:
    """Quantize this rank's share of ``mods`` (balanced by cost), gather every rank's, yield all in order."""
    from .safety import check_finite_weight

    for path, mod in mods.items():  # every rank checks every weight, so a bad one stops all ranks alike
        check_finite_weight(path, mod.weight)
    opts = {p: options.get(p, QuantOption.fp16()) for p in mods}
    costs = [dist.option_cost(tuple(m.weight.shape), method, clip, opts[p].keep16) for p, m in mods.items()]
    owner = dict(zip(mods, dist.split_by_cost(costs)))
    mine = {}
    for path, mod in mods.items():
        if owner[path] == dist.rank():
            st = stats.get(path)
            mine[path] = quantize_tensor(mod.weight, opts[path], st.gram if st is not None else None, method=method,
                                         clip=clip, damp=damp, promote=promote, scale_dtype=scale_dtype)
    every = {k: v for part in dist.gather_objects(mine) for k, v in part.items()}
    for path, mod in mods.items():
        st = stats.get(path)
        yield path, mod, every[path], st.gram if st is not None else None, mod.weight


def _record(qt: QuantizedTensor, gram: mx.array | None, w: mx.array, arrays: dict[str, mx.array],
            dtype: str = "float16") -> dict:
    """The manifest record of one quantized tensor (``storage_bits``: codes + scales + biases + permutation)."""
    from .formats.facts import packing_facts

    opt = qt.option
    g2 = None if gram is None else (gram.sum(0) if gram.ndim == 3 else gram)
    err = output_error(w, qt.dequantize(mx.float32), g2) if g2 is not None and not opt.keep16 else None
    return {
        "option": opt.desc,
        "shape": list(qt.shape),
        "numel": int(math.prod(qt.shape)),
        "storage_bits": int(opt.storage_bits(qt.shape)),
        "bpw": opt.bpw(qt.shape),
        "packing": packing_facts(opt, qt.shape, dtype),
        "bytes": int(sum(a.nbytes for a in arrays.values())),
        "err": err,
        "clip": {k: qt.stats[k] for k in ("clipped_fraction", "clip_improvement") if k in qt.stats},
    }


def quantize_model(
    model: str,
    plan: Plan | str | Path | dict,
    *,
    calib: str | Path | None = None,
    rows: int = DEFAULT_ROWS,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    method: str = "gptq",
    sequential: bool = True,
    clip: bool = True,
    damp: float = DEFAULT_DAMP,
    dtype: str = "float16",
    progress: bool = False,
) -> tuple[nn.Module, Any]:
    """The model quantized with ``plan`` in memory (same arithmetic as :func:`convert`), and its tokenizer.

    Uniform tensors become MLX's own quantized layers, mixed ones mlx-dq's mixed
    layers, 16-bit ones stay as they are (rounded to ``dtype``).
    """
    from . import calib as calib_mod
    from .loader import _set_module
    from .mixed import mixed_layer_from_quantized
    from .sources import build_model, resolve

    source = resolve(str(model))
    if isinstance(plan, dict):
        the_plan = plan_from_options(plan, source)
    else:
        the_plan = load_plan(plan) if isinstance(plan, (str, Path)) else plan
    options = {e.key: QuantOption.parse(e.option) for e in the_plan.tensors}
    out_dtype = {"float16": mx.float16}[dtype]
    tokenizer = source.tokenizer()
    _, tokens = calib_mod.calibration_rows(tokenizer, calib, rows, seq_len, seed)
    net = build_model(source.config)
    layers_new: dict[str, nn.Module] = {}
    plain: dict[str, mx.array] = {}
    for item in quantize_stream(source, options, tokens, method=method, sequential=sequential, clip=clip,
                                damp=damp, progress=progress):
        if isinstance(item, dict):
            plain.update({k: v.astype(out_dtype) for k, v in item.items()})
            continue
        path, mod, qt, _gram, _w = item
        if qt.fp is not None:
            plain[f"{path}.weight"] = qt.fp.astype(out_dtype)
            if "bias" in mod:
                plain[f"{path}.bias"] = mod["bias"].astype(out_dtype)
            continue
        template = dict(net.named_modules())[path]
        layers_new[path] = (template, qt)
    for path, (template, qt) in layers_new.items():
        new = mixed_layer_from_quantized(template, qt, prefer_stock=True)
        if "bias" in new:
            new.bias = plain.pop(f"{path}.bias")
        _set_module(net, path, new)
    if plain:
        net.load_weights(list(plain.items()), strict=False)
    mx.eval(net.parameters())
    return net, tokenizer


def convert(
    model: str,
    out_dir: str | Path,
    *,
    bpw: float | None = None,
    plan: Plan | str | Path | dict | None = None,
    measurement: Measurement | str | Path | None = None,
    mlx_lm_compatible: bool = False,
    promote_mixed: bool = False,
    head_option: str | None = None,
    keep: Iterable[str] = (),
    keep_outside_budget: bool = False,
    calib: str | Path | None = None,
    rows: int = DEFAULT_ROWS,
    seq_len: int = DEFAULT_SEQ_LEN,
    seed: int = 0,
    method: str = "gptq",
    sequential: bool = True,
    clip: bool = True,
    damp: float = DEFAULT_DAMP,
    dtype: str = "float16",
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    force: bool = False,
    progress: bool = True,
    measure_kwargs: dict | None = None,
    command: str | None = None,
    card_ref: str | None = None,
    allow_incomplete: bool = False,
    allow_other_model: bool = False,
    _fail_after_layer: int | None = None,
) -> dict:
    """Convert ``model`` (any source :func:`mlx_dq.sources.resolve` accepts) into an MLX folder ``out_dir``.

    Returns the manifest written to ``out_dir/mlx_dq.json``. ``head_option``
    None puts embedding/head into the bpw budget (so ``bpw`` is the whole
    model's average); a description fixes them outside it.
    ``dtype`` is the dtype of scales, biases and 16-bit tensors: float16, bfloat16 (with
    ``method="rtn"``) or auto (bfloat16 when the source's config says so). ``command`` (the
    command line that made it) and ``card_ref`` (the name to load it by, e.g. a
    hub repo id) go into the folder's model card ``README.md``. ``allow_incomplete``
    accepts an unfinished measurement and ``allow_other_model`` a measurement or
    plan made for another model of the same tensor names and shapes; what the
    checks noticed is listed under ``provenance.checks`` of the manifest.
    """
    from . import __version__
    from . import calib as calib_mod
    from .optimize import _match
    from .safety import check_bpw, guard_output_folder, model_shapes
    from .sources import resolve

    t_start = time.perf_counter()
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if dtype not in ("float16", "bfloat16", "auto"):
        raise ValueError(f"dtype must be float16, bfloat16 or auto (the source's), got {dtype!r}")
    out = Path(out_dir)
    if plan is not None and (bpw is not None or measurement is not None):
        raise ValueError("a plan is applied as is: do not give a bpw target or a measurement with it")
    if bpw is not None:
        check_bpw(bpw)
    if head_option is not None:
        QuantOption.parse(head_option)
    source = resolve(str(model))
    if dtype == "auto":  # a bfloat16 source stays bfloat16 (scales, biases and 16-bit tensors)
        declared = source.config.get("torch_dtype") or source.config.get("dtype") or ""
        dtype = "bfloat16" if str(declared).endswith("bfloat16") else "float16"
    out_dtype = {"float16": mx.float16, "bfloat16": mx.bfloat16}[dtype]
    if out_dtype == mx.bfloat16 and method == "gptq":
        raise ValueError("bfloat16 output needs method rtn (--method rtn): GPTQ rounds its codes against "
                         "float16 scales")
    guard_output_folder(out, force, [
        ("source model", source.path),
        ("measurement", measurement if isinstance(measurement, (str, Path)) else None),
        ("plan", plan if isinstance(plan, (str, Path)) else None),
    ])
    if calib is not None:  # a bad calibration file fails now, not after the measurement
        calib_mod.load_texts(calib)
    for pat in keep:  # a keep pattern that matches nothing fails now, not after the measurement
        if not any(_match(k, [pat]) for k in model_shapes(source.config)):
            raise ValueError(f"keep pattern {pat!r} matches no tensor of {source.spec}")
    notes: list[str] = []
    mkw = dict(measure_kwargs or {})
    mkw.setdefault("calib", calib)
    mkw.setdefault("seed", seed)
    mkw.setdefault("method", method)  # measure the errors this conversion will produce
    mkw.setdefault("clip", None if clip else False)
    meas_path = out.parent / f".{out.name}.measurement.json"
    the_plan, meas = None, None
    if dist.is_root() or (plan is None and measurement is None):  # measuring takes every rank
        the_plan, meas = resolve_plan(
            source, bpw=bpw, plan=plan, measurement=measurement, measurement_path=meas_path,
            mlx_lm_compatible=mlx_lm_compatible, head_option=head_option, keep=keep, measure_kwargs=mkw,
            progress=progress, keep_outside_budget=keep_outside_budget, allow_incomplete=allow_incomplete,
            allow_other_model=allow_other_model, notes=notes,
        )
    the_plan = dist.broadcast(the_plan)  # rank 0's plan is the one every rank applies
    options = {e.key: QuantOption.parse(e.option) for e in the_plan.tensors}
    unplanned = sorted(k for k in model_shapes(source.config) if k not in options)
    if unplanned and not isinstance(plan, dict):
        notes.append(f"{len(unplanned)} tensor(s) not in the plan stay 16-bit: {', '.join(unplanned[:4])}"
                     + (f" (and {len(unplanned) - 4} more)" if len(unplanned) > 4 else ""))

    texts, tokens = calib_mod.calibration_rows(source.tokenizer(), calib, rows, seq_len, seed)
    if not dist.is_root():  # the other ranks quantize their share; rank 0 writes the folder
        for _ in quantize_stream(source, options, tokens, method=method, sequential=sequential, clip=clip,
                                 damp=damp, promote_mixed=promote_mixed, progress=False,
                                 _fail_after_layer=_fail_after_layer):
            pass
        return dist.broadcast(None)
    tmp = _prepare_output(out, force)
    try:
        writer = ShardWriter(tmp, shard_bytes)
        records: dict[str, dict] = {}
        mixed: dict[str, dict] = {}
        qconf: dict[str, dict] = {}
        stream = quantize_stream(source, options, tokens, method=method, sequential=sequential, clip=clip,
                                 damp=damp, promote_mixed=promote_mixed, progress=progress,
                                 _fail_after_layer=_fail_after_layer, scale_dtype=out_dtype)
        other_bytes = 0
        for item in stream:
            if isinstance(item, dict):  # parameters that stay as they are (norms, biases)
                plain = {k: v.astype(out_dtype) for k, v in item.items()}
                other_bytes += sum(v.nbytes for v in plain.values())
                writer.add(plain)
                continue
            path, mod, qt, gram, w = item
            arrays = tensor_arrays(path, qt, out_dtype)
            writer.add(arrays)
            opt = qt.option
            if opt.is_mixed:
                mixed[path] = {"option": opt.desc, "shape": list(qt.shape)}
            elif not opt.keep16:
                seg = opt.segments[0]
                qconf[path] = {"group_size": seg.group_size, "bits": seg.bits, "mode": "affine"}
            records[path] = _record(qt, gram, w, arrays, dtype)

        files = writer.close()
        config = _output_config(source.config, qconf, mixed, dtype)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        if mixed:
            (tmp / MODEL_FILE).write_text(MODEL_FILE_TEXT)
        from .hub import carry_source_files

        carry_source_files(source, tmp)  # tokenizer, chat template, generation config: unchanged
        if meas is not None:
            from .measurement import save_measurement

            save_measurement(meas, tmp / "measurement.json")
        save_plan(the_plan, tmp / "plan.json")
        manifest = _manifest(
            source, the_plan, records, mixed, files, config, __version__, other_bytes, writer.nbytes,
            calib={"source": str(calib) if calib else "default", "rows": rows, "seq_len": seq_len, "seed": seed,
                   "text_digest": calib_mod.text_digest(texts)},
            settings={"method": method, "sequential": sequential, "clip": clip, "damp": damp, "dtype": dtype,
                      "promote_mixed": promote_mixed,
                      "mlx_lm_compatible": mlx_lm_compatible, "head_option": head_option},
            seconds=time.perf_counter() - t_start,
        )
        from .formats.facts import add_facts

        add_facts(manifest, tmp, files, the_plan, measurement if isinstance(measurement, (str, Path)) else None, meas)
        manifest["provenance"]["command"] = command
        manifest["provenance"]["checks"] = notes
        (tmp / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
        from .card import source_metadata, write_card

        write_card(tmp, manifest, name=Path(card_ref or out.resolve()).name, ref=card_ref or str(out_dir),
                   metadata=source_metadata(source), command=command)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    meas_path.unlink(missing_ok=True)
    Path(str(meas_path) + ".state.safetensors").unlink(missing_ok=True)
    return dist.broadcast(manifest)


def _output_config(src: dict, qconf: dict[str, dict], mixed: dict[str, dict], dtype: str = "float16") -> dict:
    """config.json for the output: source config + mlx-lm ``quantization`` (+ ``model_file`` and mixed layers)."""
    config = {k: v for k, v in src.items() if k not in ("quantization", "quantization_config", "model_file")}
    config["torch_dtype"] = dtype
    if qconf:
        weight = {}
        for e in qconf.values():
            key = (e["bits"], e["group_size"])
            weight[key] = weight.get(key, 0) + 1
        bits, gs = max(weight, key=weight.get)
        config["quantization"] = {"group_size": gs, "bits": bits, "mode": "affine", **dict(sorted(qconf.items()))}
    if mixed:
        config["model_file"] = MODEL_FILE
        config["mlx_dq"] = {"mixed": dict(sorted(mixed.items()))}
    return config


def _manifest(
    source: Any, plan: Plan, records: dict, mixed: dict, files: list[Path], config: dict, version: str,
    other_bytes: int, array_bytes: int, calib: dict, settings: dict, seconds: float,
) -> dict:
    """The accounting and provenance record written as ``mlx_dq.json``."""
    import mlx_lm

    quant = {k: r for k, r in records.items() if r["option"] != "16bit"}
    q_bits = sum(r["storage_bits"] for r in records.values())
    numel = sum(r["numel"] for r in records.values())
    budget_keys = {e.key for e in plan.tensors if e.scope == "budget"}
    b_bits = sum(r["storage_bits"] for k, r in records.items() if k in budget_keys)
    b_numel = sum(r["numel"] for k, r in records.items() if k in budget_keys)
    disk = sum(f.stat().st_size for f in files)
    packed = sum(r["storage_bits"] for r in quant.values()) // 8
    tied = {}
    if config.get("tie_word_embeddings") or any(k.endswith("embed_tokens") for k in records) and not any(
        k.endswith("lm_head") for k in records
    ):
        emb = [k for k in records if k.endswith("embed_tokens")]
        if emb:
            tied = {"lm_head": emb[0]}
    return {
        "schema": MANIFEST_SCHEMA,
        "schema_version": MANIFEST_VERSION,
        "mlx_dq": version,
        "mlx_lm": getattr(mlx_lm, "__version__", "unknown"),
        "mlx": mx.__version__,
        "accounting": {
            "packed_bytes": int(packed),
            "kept16_bytes": int(sum(r["bytes"] for k, r in records.items() if k not in quant)),
            "predicted_tensor_bytes": int(q_bits // 8),
            "other_bytes": int(other_bytes),
            "predicted_bytes": int(q_bits // 8 + other_bytes),
            "array_bytes": int(array_bytes),
            "weights_on_disk_bytes": int(disk),
            "quantized_elements": int(sum(r["numel"] for r in quant.values())),
            "elements": int(numel),
            "average_bits": b_bits / b_numel if b_numel else None,
            "average_bits_all": q_bits / numel if numel else None,
            "target_bpw": plan.target_bpw,
        },
        "tied": tied,
        "expert_banks": sorted(k for k, r in records.items() if len(r["shape"]) == 3),
        "mixed_modules": sorted(mixed),
        "loading": (
            "mlx_lm.load(path, trust_remote_code=True) / --trust-remote-code, or mlx_dq.load(path)"
            if mixed else "mlx_lm.load(path) / mlx_lm.generate --model path"
        ),
        "provenance": {
            "source": {"spec": source.spec, "kind": source.kind, "fingerprint": source.fingerprint(),
                       "model_type": source.config.get("model_type")},
            "plan": {"target_bpw": plan.target_bpw, "achieved_bpw": plan.achieved_bpw,
                     "objective": plan.objective, "lower_bound": plan.lower_bound, "gap": plan.gap,
                     "method": plan.method, "source": plan.source},
            "calibration": calib,
            "settings": settings,
            "quantization_seconds": round(seconds, 2),
        },
        "modules": dict(sorted(records.items())),
    }


# --------------------------------------------------------------------------
# ``mlx_dq.convert(hf_path, mlx_path, ...)``: this module is also the API function
# --------------------------------------------------------------------------
class _CallableModule(type(os)):
    """``mlx_dq.convert`` is this module; calling it runs :func:`mlx_dq.api.convert` (mlx-lm's argument names).

    The package attribute and the submodule stay one object, so ``from
    mlx_dq.convert import convert`` and ``mlx_dq.convert(...)`` both keep working
    whatever is imported first.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        from .api import convert as api_convert

        return api_convert(*args, **kwargs)


def _install_callable() -> None:
    import inspect
    import sys

    from .api import convert as api_convert

    mod = sys.modules[__name__]
    mod.__class__ = _CallableModule
    mod.__signature__ = inspect.signature(api_convert)


_install_callable()
