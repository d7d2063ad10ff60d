"""Distillation of a quantized folder's scales and biases against the source model's logits.

The integer codes of every quantized layer stay as they are; the per-group
scales and biases (and, optionally, the norm weights) are trained with Adam to
minimise KL(source || quantized) of the next-token distribution on calibration
rows (the calibration text, never an evaluation text). This is DWQ's idea
(``mlx_lm.dwq``), applied to every quantized layer kind mlx-dq writes: stock
``QuantizedLinear`` / ``QuantizedEmbedding`` / ``QuantizedSwitchLinear`` and
the mixed-proportion layers of :mod:`mlx_dq.layers.mixed`, segment by segment.

Training runs through a differentiable dequantize-then-matmul path in float32
(``mx.dequantize`` has gradients with respect to scales and biases; so has
``mx.quantized_matmul`` on mlx 0.32.4, but it is far slower on the CPU). Each
scale is trained as ``s0 * (1 + a)`` and each bias as ``b0 + |s0| * c``, so one
learning rate means the same relative step for every layer. The result is
written as a new folder with the same files, tensor names, dtypes and config
as the input (so it loads exactly as the input did), a refreshed manifest that
records the distillation, and an atomic publish.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from tqdm import tqdm

from mlx_dq.conversion.estimate import format_seconds
from mlx_dq.conversion.writer import (
    DEFAULT_SHARD_BYTES,
    ShardWriter,
    prepare_output,
    publish,
)
from mlx_dq.data import calib as calib_mod
from mlx_dq.errors import InputError
from mlx_dq.layers import kernels
from mlx_dq.names import MANIFEST_NAME
from mlx_dq.settings import TEACHER_CACHE_BYTES, DistillSettings


# --------------------------------------------------------------------------
# trainable stand-ins for the quantized layers
# --------------------------------------------------------------------------
class _Fixed:
    """What training leaves as it is: packed codes, initial scales/biases (float32), layout; not parameters."""

    def __init__(self, parts: list, bits: tuple[int, ...], group_sizes: tuple[int, ...], perm: mx.array | None,
                 keys: list[tuple[str, str]]):
        self.codes = [w for w, _, _ in parts]
        self.dtypes = [s.dtype for _, s, _ in parts]
        self.s0 = [s.astype(mx.float32) for _, s, _ in parts]
        self.b0 = [b.astype(mx.float32) for _, _, b in parts]
        self.abs0 = [mx.abs(s) for s in self.s0]
        self.bits, self.group_sizes, self.perm, self.keys = bits, group_sizes, perm, keys


class _Trainable(nn.Module):
    """A quantized layer during training: fixed codes, scales ``s0*(1+a)``, biases ``b0+|s0|*c`` (float32).

    ``kind`` is "linear", "embedding" or "switch"; ``keys`` names the stored scale/bias arrays of each
    segment (``scales`` / ``biases`` for stock layers, ``scales_i`` / ``biases_i`` for mixed ones).
    """

    def __init__(self, layer: nn.Module, kind: str):
        super().__init__()
        if hasattr(layer, "parts"):  # mlx-dq mixed layer
            parts = layer.parts
            bits, gs, perm = tuple(layer.seg_bits), tuple(layer.seg_group_sizes), layer.get("perm")
            keys = [(f"scales_{i}", f"biases_{i}") for i in range(len(parts))]
        else:  # MLX / mlx-lm stock quantized layer
            parts = [(layer["weight"], layer["scales"], layer["biases"])]
            bits, gs, perm = (int(layer.bits),), (int(layer.group_size),), None
            keys = [("scales", "biases")]
        self.kind = kind
        self._fixed = _Fixed(parts, bits, gs, perm, keys)
        self.a = [mx.zeros(s.shape) for _, s, _ in parts]
        self.c = [mx.zeros(s.shape) for _, s, _ in parts]
        if "bias" in layer:
            self.bias = layer["bias"].astype(mx.float32)

    def _params(self, rows: mx.array | None = None) -> list[tuple[mx.array, mx.array, mx.array]]:
        f = self._fixed
        out = []
        for w, s0, b0, m, a, c in zip(f.codes, f.s0, f.b0, f.abs0, self.a, self.c):
            s, b = s0 * (1 + a), b0 + m * c
            if rows is not None:
                w, s, b = w[rows], s[rows], b[rows]
            out.append((w, s, b))
        return out

    def weight(self, rows: mx.array | None = None) -> mx.array:
        """The float32 weight (rows ``rows`` only, for an embedding lookup), differentiable in ``a`` and ``c``."""
        f = self._fixed
        return kernels.dequantize_parts(self._params(rows), f.bits, f.group_sizes, f.perm)

    def trained(self) -> dict[str, mx.array]:
        """The trained scales and biases under their stored names, in their stored dtypes."""
        out = {}
        for (ks, kb), (_, s, b), dt in zip(self._fixed.keys, self._params(), self._fixed.dtypes):
            out[ks], out[kb] = s.astype(dt), b.astype(dt)
        return out

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ W^T``: the tied output head."""
        return x @ self.weight().T

    def __call__(self, x: mx.array, indices: mx.array | None = None, sorted_indices: bool = False) -> mx.array:
        if self.kind == "embedding":
            return self.weight(x)
        if self.kind == "switch":
            y = mx.gather_mm(x, self.weight().swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
            if "bias" in self:
                y = y + mx.expand_dims(self["bias"][indices], -2)
            return y
        y = x @ self.weight().T
        return y + self["bias"] if "bias" in self else y


def quantized_layers(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Every affine-quantized layer of ``model`` (stock or mlx-dq mixed): path -> (layer, kind)."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear

    from mlx_dq.layers.mixed import MixedEmbedding, MixedLinear, MixedSwitchLinear

    out = {}
    for path, m in model.named_modules():
        if isinstance(m, MixedEmbedding):
            out[path] = (m, "embedding")
        elif isinstance(m, MixedSwitchLinear):
            out[path] = (m, "switch")
        elif isinstance(m, MixedLinear):
            out[path] = (m, "linear")
        elif isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
            if getattr(m, "mode", "affine") != "affine":
                continue
            kind = ("embedding" if isinstance(m, nn.QuantizedEmbedding)
                    else "switch" if isinstance(m, QuantizedSwitchLinear) else "linear")
            out[path] = (m, kind)
    return out


def _norm_paths(model: nn.Module) -> list[str]:
    """Modules with a 1-D ``weight`` whose type is a norm (RMSNorm, LayerNorm and their model-specific kin)."""
    return [p for p, m in model.named_modules()
            if "Norm" in type(m).__name__ and "weight" in m and m["weight"].ndim == 1]


def make_student(model: nn.Module, train_norms: bool = False) -> tuple[dict[str, _Trainable], list[str]]:
    """Turn a loaded quantized model into a trainable float32 student (in place).

    Returns the trainable stand-ins by path and the trained norm paths; only the scale/bias
    offsets (and norm weights with ``train_norms``) are left unfrozen.
    """
    layers = quantized_layers(model)
    if not layers:
        raise InputError("the model has no affine-quantized layer: nothing to distill")
    student = {p: _Trainable(m, kind) for p, (m, kind) in layers.items()}
    for p, t in student.items():
        model.update_modules(tree_unflatten([(p, t)]))
    model.update(tree_map(lambda v: v.astype(mx.float32)
                          if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    model.freeze()
    for t in student.values():
        t.unfreeze(keys=[f"{k}.{i}" for k in ("a", "c") for i in range(len(t.a))], recurse=False)
    norms = _norm_paths(model) if train_norms else []
    mods = dict(model.named_modules())
    for p in norms:
        mods[p].unfreeze(keys=["weight"], recurse=False)
    return student, norms


# --------------------------------------------------------------------------
# the loss and the loop
# --------------------------------------------------------------------------
def _log_softmax(logits: mx.array, temperature: float) -> mx.array:
    z = logits.astype(mx.float32) / temperature
    return z - mx.logsumexp(z, axis=-1, keepdims=True)


def kl_loss(student_logits: mx.array, teacher_logprobs: mx.array, temperature: float = 1.0) -> mx.array:
    """Mean over positions of KL(teacher || student) at ``temperature`` (teacher given as log-probabilities)."""
    lq = _log_softmax(student_logits, temperature)
    return (mx.exp(teacher_logprobs) * (teacher_logprobs - lq)).sum(axis=-1).mean()


class _Teacher:
    """The source's log-probabilities for each training row, kept when they fit in memory, else recomputed."""

    def __init__(self, model: nn.Module, rows: mx.array, temperature: float, cache_bytes: int):
        self.model, self.rows, self.t = model, rows, temperature
        n, seq = rows.shape
        self.vocab = int(model(rows[:1, :2]).shape[-1])
        self.keep = n * (seq - 1) * self.vocab * 4 <= cache_bytes
        self.cache: dict[int, mx.array] = {}

    def __call__(self, idx: list[int]) -> mx.array:
        out = []
        for i in idx:
            if i in self.cache:
                out.append(self.cache[i])
                continue
            lp = _log_softmax(self.model(self.rows[i : i + 1, :-1]), self.t)
            mx.eval(lp)
            if self.keep:
                self.cache[i] = lp
            out.append(lp)
        return out[0] if len(out) == 1 else mx.concatenate(out, axis=0)


# Bytes of float32 logits one pass of :func:`mean_kl` may hold. Why: every student forward dequantizes every layer
# (the head too), 1.5 of its 2 s per 128-token row at SmolLM2-135M, so rows go through together; the cap keeps a
# large vocabulary's logits (Gemma-3's 262,144) to a few rows.
KL_PASS_BYTES = 256 << 20


def kl_pass_rows(n_rows: int, seq_len: int, vocab: int) -> int:
    """Rows per forward of :func:`mean_kl`: as many as keep their logits under :data:`KL_PASS_BYTES`, at least one."""
    return max(1, min(n_rows, KL_PASS_BYTES // max(1, (seq_len - 1) * vocab * 4)))


def mean_kl(model: nn.Module, teacher: Callable[[list[int]], mx.array], rows: mx.array,
            temperature: float = 1.0, per_pass: int = 1) -> float:
    """Mean KL(teacher || model) over every position of ``rows``, ``per_pass`` rows per forward (no gradients).

    Every row has the same length, so the mean over a pass's positions is the mean of its rows' means."""
    total, n = 0.0, int(rows.shape[0])
    for start in range(0, n, per_pass):
        stop = min(n, start + per_pass)
        loss = kl_loss(model(rows[start:stop, :-1]), teacher(list(range(start, stop))), temperature)
        total += float(loss.item()) * (stop - start)
    return total / n


def train(model: nn.Module, teacher: Callable[[list[int]], mx.array], rows: mx.array, s: DistillSettings,
          progress: bool = True, say: Callable[[str], None] = print) -> dict:
    """Adam on the unfrozen parameters of ``model`` for ``s.steps`` steps; returns losses and timings.

    Rows are visited in a seeded order, ``s.batch_size`` per step, one epoch after another. The time of
    the first step is measured and the whole run's time extrapolated from it before going on.
    """
    rng = np.random.default_rng(s.seed)
    order: list[int] = []

    def next_batch() -> list[int]:
        nonlocal order
        if len(order) < s.batch_size:
            order += rng.permutation(rows.shape[0]).tolist()
        batch, order = order[: s.batch_size], order[s.batch_size :]
        return sorted(batch)

    opt = optim.Adam(learning_rate=optim.cosine_decay(s.lr, s.steps, s.lr * 0.1))

    def loss_fn(m: nn.Module, x: mx.array, lp: mx.array) -> mx.array:
        return kl_loss(m(x), lp, s.temperature)

    step_fn = nn.value_and_grad(model, loss_fn)
    losses = []
    t0 = time.perf_counter()
    bar = None
    for step in range(s.steps):
        idx = next_batch()
        lp = teacher(idx)
        ts = time.perf_counter()
        loss, grads = step_fn(model, rows[mx.array(idx), :-1], lp)
        opt.update(model, grads)
        mx.eval(loss, model.trainable_parameters(), opt.state)
        losses.append(float(loss.item()))
        if step == 0:
            first = time.perf_counter() - ts
            say(f"one step ({s.batch_size} x {rows.shape[1]} tokens) took {first:.1f} s: "
                f"{s.steps} steps will take about {format_seconds(first * s.steps)}")
            bar = tqdm(total=s.steps, initial=1, desc="distill", unit="step", disable=not progress)
        else:
            bar.update(1)
        bar.set_postfix(kl=f"{losses[-1]:.4f}")
    if bar is not None:
        bar.close()
    return {"losses": losses, "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------
# folders
# --------------------------------------------------------------------------
def _read_config(folder: Path) -> dict:
    path = folder / "config.json"
    if not folder.is_dir() or not path.is_file():
        raise InputError(f"{folder} is not a model folder (no config.json)")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise InputError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict) or not (config.get("quantization") or (config.get("mlx_dq") or {}).get("mixed")):
        raise InputError(f"{folder} is not a quantized model folder (config.json has no quantization)")
    return config


def _weight_files(folder: Path) -> list[Path]:
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InputError(f"no .safetensors files in {folder}")
    return files


def source_spec(folder: Path, source: str | None) -> str:
    """The source model to distil ``folder`` against: ``source`` when given, else the one its manifest records
    (refused when its fingerprint is not the recorded one: it would train against another teacher)."""
    if source is not None:
        return str(source)
    from mlx_dq.conversion.writer import recorded_source

    spec = recorded_source(folder, flag="--model")  # checked against the recorded fingerprint
    if not spec:
        raise InputError(f"{folder} does not record its source model: give the source (--model)")
    return spec


def _check_same_model(teacher_cfg: dict, student_cfg: dict, source: str) -> None:
    for key in ("model_type", "hidden_size", "num_hidden_layers", "vocab_size"):
        a, b = teacher_cfg.get(key), student_cfg.get(key)
        if a is not None and b is not None and a != b:
            raise InputError(f"the source {source} is not the quantized model's source: {key} {a} != {b}")


def _refresh_manifest(folder: Path, files: list[Path], record: dict) -> dict | None:
    """Update ``folder``'s manifest for distilled weights: file digests and sizes, ``provenance.distill``."""
    if not (folder / MANIFEST_NAME).exists():
        return None
    from mlx_dq.formats.common import file_digest

    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    manifest.pop("results", None)  # measured on the model before distillation
    manifest["files"] = [{"name": p.name, "bytes": p.stat().st_size, "sha256": file_digest(p)}
                         for p in sorted(files)]
    manifest["accounting"]["weights_on_disk_bytes"] = int(sum(p.stat().st_size for p in files))
    manifest["provenance"]["distill"] = record
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2))
    return manifest


def _check_all_found(folder: Path, updates: dict[str, mx.array], seen: set[str]) -> None:
    missing = sorted(set(updates) - seen)
    if missing:
        raise InputError(f"trained arrays not found in {folder}: {', '.join(missing[:4])}")


def _replace_arrays(arrays: dict[str, mx.array], updates: dict[str, mx.array], seen: set[str]) -> bool:
    changed = False
    for k in list(arrays):
        if k in updates:
            if updates[k].shape != arrays[k].shape or updates[k].dtype != arrays[k].dtype:
                raise InputError(f"trained {k} has shape/dtype {updates[k].shape}/{updates[k].dtype}, "
                                 f"stored {arrays[k].shape}/{arrays[k].dtype}")
            arrays[k] = updates[k]
            seen.add(k)
            changed = True
    return changed


def store_in_place(folder: Path, updates: dict[str, mx.array], record: dict) -> dict | None:
    """Write ``updates`` into ``folder``'s weight files (same names, shapes, dtypes) and refresh its manifest.

    For a folder that is not yet published (the converter's partial folder): each changed file is
    written beside itself and renamed over it. Returns the refreshed manifest (None without one).
    """
    weights, seen = _weight_files(folder), set()
    for f in weights:
        arrays = mx.load(str(f))
        if _replace_arrays(arrays, updates, seen):
            mx.eval(arrays)
            tmp = f.with_name(f".{f.stem}.tmp.safetensors")
            mx.save_safetensors(str(tmp), arrays, metadata={"format": "mlx"})
            tmp.replace(f)
    _check_all_found(folder, updates, seen)
    return _refresh_manifest(folder, weights, record)


def _write(folder: Path, out: Path, updates: dict[str, mx.array], record: dict, force: bool,
           shard_bytes: int) -> dict | None:
    """Copy ``folder`` into a partial sibling of ``out`` with ``updates`` replacing stored arrays; publish it."""
    tmp = prepare_output(out, force)
    try:
        weights = _weight_files(folder)
        for f in folder.iterdir():
            if f.is_file() and f not in weights and f.name != "model.safetensors.index.json":
                shutil.copy2(f, tmp / f.name)
        writer = ShardWriter(tmp, shard_bytes)
        seen: set[str] = set()
        for f in weights:
            arrays = mx.load(str(f))
            _replace_arrays(arrays, updates, seen)
            writer.add(arrays)
        _check_all_found(folder, updates, seen)
        files = writer.close()
        manifest = _refresh_manifest(tmp, files, record)
        if manifest is not None:
            from mlx_dq.conversion.card import note_distillation

            note_distillation(tmp, manifest)
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _put_back(model: nn.Module, layers: dict[str, tuple[nn.Module, str]], dtypes: dict[str, Any]) -> None:
    """Undo :func:`make_student`: the original quantized layers back in place, every other array in its dtype."""
    for p, (m, _) in layers.items():
        model.update_modules(tree_unflatten([(p, m)]))
    model.load_weights([(k, v.astype(dtypes[k])) for k, v in tree_flatten(model.parameters())
                        if k in dtypes and v.dtype != dtypes[k]], strict=False)


def distill_model(model: nn.Module, base: nn.Module, tokens: mx.array, settings: DistillSettings | None = None,
                  *, progress: bool = True, say: Callable[[str], None] | None = None
                  ) -> tuple[dict[str, mx.array], dict]:
    """Distil the loaded quantized ``model``'s scales and biases against ``base`` on ``tokens``, in memory.

    ``model`` ends with its own layers and dtypes and the trained values in place (as they would be
    stored). Returns the trained arrays by their stored names (in their stored dtypes) and the record:
    layers, trained values, norms, KL on ``tokens`` before and after, per-step losses and training time.
    Only ``settings``' steps, batch_size, lr, seed, temperature and train_norms apply here: ``tokens`` are the rows.
    """
    s = settings or DistillSettings()
    say = say or (lambda m: tqdm.write(m))
    layers = quantized_layers(model)
    dtypes = {k: v.dtype for k, v in tree_flatten(model.parameters())}
    student, norms = make_student(model, s.train_norms)
    n_train = sum(v.size for _, v in tree_flatten(model.trainable_parameters()))
    say(f"distilling {len(student)} quantized layers ({n_train:,} trained values"
        f"{f', {len(norms)} norms' if norms else ''}) on {tokens.shape[0]} x {tokens.shape[1]} calibration tokens, "
        f"{s.steps} steps")
    teacher = _Teacher(base, tokens, s.temperature, TEACHER_CACHE_BYTES)
    per_pass = kl_pass_rows(int(tokens.shape[0]), int(tokens.shape[1]), teacher.vocab)
    try:
        kl_before = mean_kl(model, teacher, tokens, s.temperature, per_pass)
        say(f"KL on the training rows before: {kl_before:.5f}")
        log = train(model, teacher, tokens, s, progress=progress, say=say)
        updates: dict[str, mx.array] = {}
        for p, t in student.items():
            updates.update({f"{p}.{k}": v for k, v in t.trained().items()})
        mods = dict(model.named_modules())
        for p in norms:
            updates[f"{p}.weight"] = mods[p]["weight"].astype(dtypes[f"{p}.weight"])
        mx.eval(updates)
    finally:
        _put_back(model, layers, dtypes)
    model.load_weights(list(updates.items()), strict=False)
    # the KL after, with the values exactly as stored (16-bit scales and biases), through the same float32 path
    make_student(model)
    try:
        kl_after = mean_kl(model, teacher, tokens, s.temperature, per_pass)
    finally:
        _put_back(model, layers, dtypes)
    say(f"KL on the training rows after: {kl_after:.5f}")
    record = {"layers": len(student), "trained_values": int(n_train), "norms": norms,
              "kl_train_before": kl_before, "kl_train_after": kl_after,
              "losses": [round(v, 6) for v in log["losses"]], "train_seconds": round(log["seconds"], 2)}
    return updates, record


def distill_folder(source: Any, spec: str, folder: Path, s: DistillSettings, *, input_label: str,
                   progress: bool = True, say: Callable[[str], None] | None = None) -> tuple[dict[str, mx.array], dict]:
    """Distil the quantized ``folder`` against its source (``source`` resolved from ``spec``) on ``s``' rows.

    Returns the trained arrays by stored name and the provenance record (source, ``input_label``,
    settings, calibration digest, :func:`distill_model`'s record, seconds) that the stage and
    ``convert --distill`` both store.
    """
    from mlx_dq.loader import load as dq_load
    from mlx_dq.model.sources import load_model

    t_start = time.perf_counter()
    texts, tokens = calib_mod.calibration_rows(source.tokenizer(), s.calib, s.rows, s.seq_len, s.seed)
    base, _, _ = load_model(spec, dtype=mx.float32)
    base.eval()
    model, _ = dq_load(folder)
    updates, core = distill_model(model, base, tokens, s, progress=progress, say=say)
    del model, base
    record = {
        "source": spec, "input": input_label, "settings": {**s.as_dict(), "calib": calib_mod.calib_label(s.calib)},
        "text_digest": calib_mod.text_digest(texts), **core, "seconds": round(time.perf_counter() - t_start, 2),
    }
    return updates, record


def distill(
    source: str | None,
    quantized_folder: str | Path,
    out_folder: str | Path,
    *,
    force: bool = False,
    progress: bool = True,
    say: Callable[[str], None] | None = None,
    shard_bytes: int = DEFAULT_SHARD_BYTES,
    settings: DistillSettings | None = None,
    **options: Any,
) -> dict:
    """Distil ``quantized_folder``'s scales and biases against ``source`` and write the result to ``out_folder``.

    ``options`` are :class:`~mlx_dq.settings.DistillSettings` fields (calib, rows, seq_len, steps,
    batch_size, lr, seed, temperature, train_norms). ``source`` None: the source recorded in the
    folder's manifest. Calibration rows come from ``calib`` (default: the bundled calibration text).
    The codes never change; the output has the input's files, tensor names, dtypes and config.
    Returns the distillation record (also in the output manifest under ``provenance.distill``):
    KL on the training rows before and after, per-step losses and timings.
    """
    from mlx_dq.model.sources import resolve
    from mlx_dq.safety import guard_output_folder, output_lock

    s = (settings or DistillSettings()).with_options(**options)
    folder, out = Path(quantized_folder), Path(out_folder)
    q_config = _read_config(folder)
    _weight_files(folder)
    spec = source_spec(folder, source)
    src = resolve(spec)
    guard_output_folder(out, force, [("quantized model", folder), ("source model", src.path),
                                     *calib_mod.calib_inputs(s.calib)])
    calib_mod.check_calib(s.calib)
    _check_same_model(src.config, q_config, spec)
    with output_lock(out):  # a second run into the same output stops, naming this one
        updates, record = distill_folder(src, spec, folder, s, input_label=str(folder), progress=progress, say=say)
        _write(folder, out, updates, record, force, shard_bytes)
    return record


__all__ = ["DistillSettings", "distill", "distill_folder", "distill_model", "kl_loss", "kl_pass_rows", "make_student", "mean_kl", "quantized_layers",
           "source_spec", "store_in_place", "train"]
