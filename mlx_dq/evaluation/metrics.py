"""Evaluation of a model on token rows: perplexity, KL divergence and top-1 agreement against a
base model, bits per weight with one accounting rule for every method, size and speed.

Everything is computed in float32 from the model's logits. On the MLX CPU
backend, evaluate a quantized model through dequantized float32 weights:
CPU quantized matmuls are far slower (docs/cost.md#figures-behind-the-code)
and low-precision matmuls accumulate error.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map, tree_unflatten
from tqdm import tqdm

from mlx_dq.conversion.writer import read_manifest, recorded_source
from mlx_dq.errors import InputError, IntegrityError
from mlx_dq.names import MANIFEST_NAME


def perplexity(model: nn.Module, rows: mx.array, batch_size: int = 8, progress: bool = False) -> float:
    """Perplexity of ``model`` on ``[n, seq_len]`` token rows: exp of the mean next-token loss in float32.

    Every position but the last of each row predicts the next token; the model is used as given.
    """
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [n_rows, seq_len >= 2], got shape {tuple(rows.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    total = 0.0
    count = 0
    starts = range(0, rows.shape[0], batch_size)
    for i in tqdm(starts, desc="perplexity", unit="batch", disable=not progress):
        batch = rows[i : i + batch_size]
        logits = model(batch[:, :-1]).astype(mx.float32)
        loss = nn.losses.cross_entropy(logits, batch[:, 1:], reduction="sum")
        total += float(loss.item())
        count += batch[:, 1:].size
    return math.exp(total / count)


# ----------------------------------------------------------------------------
# KL divergence, bits-per-weight accounting and whole-model evaluation
# ----------------------------------------------------------------------------

CPU_NOTE = "evaluated through dequantized float32 weights on the CPU (MLX CPU quantized matmuls are slow)"
STORED_SCALE_BITS = 16  # every method is charged 16 bits per scale and per bias


def _on_cpu() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _mixed_module():
    """mlx_dq.layers.mixed when it is available (its layers dequantize themselves), else None."""
    try:
        from mlx_dq.layers import mixed
    except ImportError:
        return None
    return mixed


def _is_mixed_layer(module: nn.Module) -> bool:
    mixed = _mixed_module()
    return mixed is not None and type(module).__module__ == mixed.__name__ and hasattr(module, "dequantize")


def _float_layer(module: nn.Module) -> nn.Module:
    """The float equivalent of an mlx-dq mixed layer, from its ``dequantize()``."""
    from mlx_lm.models.switch_layers import SwitchLinear

    out = module.dequantize()
    if isinstance(out, nn.Module):
        return out
    weight = out.astype(mx.float32)
    bias = module.get("bias") if isinstance(module, dict) else getattr(module, "bias", None)
    if weight.ndim == 3:
        layer = SwitchLinear(weight.shape[2], weight.shape[1], weight.shape[0], bias=bias is not None)
    elif "Embedding" in type(module).__name__:
        layer = nn.Embedding(weight.shape[0], weight.shape[1])
    else:
        layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    layer.weight = weight
    if bias is not None:
        layer.bias = bias
    return layer


def dequantize_model(model: nn.Module) -> nn.Module:
    """Replace every quantized layer by a float32 one (in place) and cast all float parameters to float32.

    Uses mlx-lm's own dequantizer for QuantizedLinear / QuantizedEmbedding / QuantizedSwitchLinear
    and each mlx-dq mixed layer's ``dequantize()``; on the CPU this evaluates exactly and far faster.
    """
    from mlx_lm.utils import dequantize_model as mlx_lm_dequantize

    model = mlx_lm_dequantize(model)
    mixed_layers = [(name, _float_layer(m)) for name, m in model.named_modules() if _is_mixed_layer(m)]
    if mixed_layers:
        model.update_modules(tree_unflatten(mixed_layers))
    model.update(
        tree_map(
            lambda v: v.astype(mx.float32) if isinstance(v, mx.array) and mx.issubdtype(v.dtype, mx.floating) else v,
            model.parameters(),
        )
    )
    return model


def _counted(m: nn.Module) -> tuple[int, int] | None:
    """``(stored bits, weights)`` of one layer's weight when it is a counted layer, else None."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    if _is_mixed_layer(m) and hasattr(m, "option"):
        shape = (*m["scales_0"].shape[:-1], sum(m.seg_widths))
        return m.option.storage_bits(shape), math.prod(shape)
    if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding, QuantizedSwitchLinear)):
        floating = mx.issubdtype(m.scales.dtype, mx.floating)
        scale_bits = STORED_SCALE_BITS if floating else m.scales.itemsize * 8
        n_groups = m.scales.size + (m.biases.size if m.get("biases") is not None else 0)
        return m.weight.size * 32 + n_groups * scale_bits, m.weight.size * 32 // m.bits
    if isinstance(m, (nn.Linear, nn.Embedding, SwitchLinear)):
        return m.weight.size * 16, m.weight.size
    return None


def _leaves(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module)]


def weight_storage(model: nn.Module) -> tuple[int, int]:
    """``(stored bits, weights)`` over the weights of every Linear, Embedding and expert bank.

    Quantized weights count their packed codes plus 16 bits per scale and per bias (whatever
    dtype they are held in), unquantized ones 16 bits per element; norms, layer biases and
    other parameters are excluded, and a tied head (the embedding used as a linear) counts once.
    mlx-dq mixed layers count ``option.storage_bits(shape)`` (their permutation included), a table with
    frequent-token rows its two parts plus 32 bits per hot row id.
    """
    counts = [c for c in map(_counted, _leaves(model)) if c is not None]
    if not counts:
        raise InputError(f"{type(model).__name__} has no Linear, Embedding or expert-bank weights to count")
    ids = sum(int(m["hot_ids"].size) for m in model.modules() if type(m).__name__ == "RowSplitEmbedding")
    return sum(c[0] for c in counts) + ids * 32, sum(c[1] for c in counts)


def bits_per_weight(model: nn.Module) -> float:
    """Stored bits per weight of ``model`` as defined by :func:`weight_storage` (same rule for every method)."""
    bits, weights = weight_storage(model)
    return bits / weights


def stored_bytes(model: nn.Module) -> int:
    """Bytes the model stores: counted weights per :func:`weight_storage`, every other parameter at 16 bits."""
    total_bits = 0
    for m in _leaves(model):
        counted = _counted(m)
        if counted is None:
            total_bits += sum(v.size * 16 for _, v in tree_flatten(m.parameters()))
        else:
            total_bits += counted[0]
            bias = m.get("bias") if isinstance(m, dict) else None
            total_bits += bias.size * 16 if isinstance(bias, mx.array) else 0
    return total_bits // 8


def folder_bytes(folder: str | Path) -> int:
    """Bytes on disk of the weight files (``*.safetensors``) in a model folder."""
    files = list(Path(folder).glob("*.safetensors"))
    if not files:
        raise InputError(f"no .safetensors files in {folder}")
    return sum(f.stat().st_size for f in files)


def _logprobs(model: nn.Module, batch: mx.array) -> mx.array:
    """Float32 next-token log-probabilities for every position but the last of each row."""
    logits = model(batch[:, :-1]).astype(mx.float32)
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def _check_rows(rows: mx.array, batch_size: int) -> None:
    if rows.ndim != 2 or rows.shape[1] < 2:
        raise ValueError(f"rows must be [n_rows, seq_len >= 2], got shape {tuple(rows.shape)}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")


@dataclass
class Reference:
    """The base model's log-probabilities on fixed rows, computed once to compare many models against."""

    rows: mx.array
    batch_size: int
    logprobs: list[mx.array]
    perplexity: float
    seconds: float


def reference(base_model: nn.Module, rows: mx.array, batch_size: int = 4, progress: bool = False) -> Reference:
    """Run the base model once over ``rows`` and keep its float32 log-probabilities (``rows x seq x vocab`` floats)."""
    _check_rows(rows, batch_size)
    t0 = time.perf_counter()
    out = []
    nll = 0.0
    for i in tqdm(range(0, rows.shape[0], batch_size), desc="reference", unit="batch", disable=not progress):
        batch = rows[i : i + batch_size]
        lp = _logprobs(base_model, batch)
        mx.eval(lp)
        out.append(lp)
        nll -= float(mx.take_along_axis(lp, batch[:, 1:, None], axis=-1).sum().item())
    ppl = math.exp(nll / (rows.shape[0] * (rows.shape[1] - 1)))
    return Reference(rows, batch_size, out, ppl, time.perf_counter() - t0)


def kl_divergence(
    base_model: nn.Module | Reference,
    model: nn.Module,
    rows: mx.array,
    batch_size: int = 4,
    progress: bool = False,
) -> dict:
    """Mean KL(base || model) of the next-token distributions over every position, plus top-1 agreement and both perplexities.

    Computed in float32 from log-softmax (``sum p (log p - log q)``, no division or log of a probability).
    ``base_model`` may be a :class:`Reference` made once on the same rows (faster when comparing many models).
    Returns ``kl``, ``kl_max`` (worst single position), ``top1``, ``perplexity``, ``base_perplexity``,
    ``tokens`` and ``forward_s`` (time spent in ``model``'s forward passes).
    """
    _check_rows(rows, batch_size)
    if isinstance(base_model, Reference):
        if base_model.rows.shape != rows.shape or not mx.array_equal(base_model.rows, rows).item():
            raise ValueError("the reference was computed on other rows")
        if base_model.batch_size != batch_size:
            raise ValueError(f"the reference used batch_size {base_model.batch_size}, not {batch_size}")
    kl_sum = nll_p = nll_q = 0.0
    kl_max = 0.0
    agree = count = 0
    forward_s = 0.0
    for b, i in enumerate(
        tqdm(range(0, rows.shape[0], batch_size), desc="kl", unit="batch", disable=not progress)
    ):
        batch = rows[i : i + batch_size]
        targets = batch[:, 1:, None]
        lp = base_model.logprobs[b] if isinstance(base_model, Reference) else _logprobs(base_model, batch)
        mx.eval(lp)
        t0 = time.perf_counter()
        lq = _logprobs(model, batch)
        mx.eval(lq)
        forward_s += time.perf_counter() - t0
        kl = (mx.exp(lp) * (lp - lq)).sum(axis=-1)
        same = (mx.argmax(lp, axis=-1) == mx.argmax(lq, axis=-1)).sum()
        np_ = -mx.take_along_axis(lp, targets, axis=-1).sum()
        nq = -mx.take_along_axis(lq, targets, axis=-1).sum()
        kmax = kl.max()
        mx.eval(kl, same, np_, nq, kmax)
        kl_sum += float(kl.astype(mx.float32).sum().item())
        kl_max = max(kl_max, float(kmax.item()))
        agree += int(same.item())
        nll_p += float(np_.item())
        nll_q += float(nq.item())
        count += int(kl.size)
    return {
        "kl": kl_sum / count,
        "kl_max": kl_max,
        "top1": agree / count,
        "perplexity": math.exp(nll_q / count),
        "base_perplexity": math.exp(nll_p / count),
        "tokens": count,
        "forward_s": forward_s,
    }


def generation_speed(model: nn.Module, tokenizer, prompt: str = "The capital of France is", max_tokens: int = 32) -> float:
    """Decode tokens per second of a short greedy generation with mlx-lm's ``stream_generate``."""
    from mlx_lm import stream_generate

    from mlx_dq.layers.kv_cache import generation_cache

    last = None
    for last in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, prompt_cache=generation_cache(model)):
        pass
    if last is None:
        raise InputError("generation produced no tokens")
    return float(last.generation_tps)


def evaluate_model(
    model: nn.Module,
    rows: mx.array,
    base: nn.Module | Reference | None = None,
    batch_size: int = 4,
    folder: str | Path | None = None,
    tokenizer=None,
    dequantize: bool | None = None,
    progress: bool = False,
) -> dict:
    """Evaluate a (quantized) model: perplexity, KL and top-1 against ``base``, bits per weight, size and speed.

    Size and bits per weight are read from the quantized layers first; then, on the CPU (``dequantize``
    None) or when asked, the model is evaluated through dequantized float32 weights (``evaluated_as`` says so).
    ``size_bytes`` is the weight files on disk when ``folder`` is given, else the stored bytes in memory.
    """
    _check_rows(rows, batch_size)
    bits, weights = weight_storage(model)
    size = folder_bytes(folder) if folder is not None else stored_bytes(model)
    if dequantize is None:
        dequantize = _on_cpu()
    if dequantize:
        model = dequantize_model(model)
    result: dict = {
        "bits_per_weight": bits / weights,
        "weights": weights,
        "size_bytes": size,
        "evaluated_as": CPU_NOTE if dequantize else "quantized layers as stored",
        "rows": int(rows.shape[0]),
        "seq_len": int(rows.shape[1]),
    }
    if base is not None:
        result.update(kl_divergence(base, model, rows, batch_size, progress=progress))
    else:
        t0 = time.perf_counter()
        result["perplexity"] = perplexity(model, rows, batch_size=batch_size, progress=progress)
        result["forward_s"] = time.perf_counter() - t0
        result["tokens"] = int(rows.shape[0] * (rows.shape[1] - 1))
    result["tokens_per_s"] = result["tokens"] / max(result["forward_s"], 1e-9)
    if tokenizer is not None:
        result["generation_tokens_per_s"] = generation_speed(model, tokenizer)
    return result


# ----------------------------------------------------------------------------
# evaluating an output folder and recording the results in its manifest
# ----------------------------------------------------------------------------


def load_for_eval(spec: str) -> tuple[nn.Module, Any, dict, Path | None]:
    """Load what ``mlx_dq eval`` evaluates: ``(model, tokenizer, config, folder)``.

    A quantized folder (an mlx-dq output with ``mlx_dq.json``, or any folder whose config has
    ``quantization``) loads as stored, through ``mlx_dq.load`` (mlx-lm's loader with mixed layers);
    ``folder`` is then that folder. Anything else is a model source, loaded in float32.
    """
    path = Path(spec).expanduser()
    config_path = path / "config.json"
    if path.is_dir() and config_path.exists():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise IntegrityError(f"{config_path} cannot be read as JSON: {e}") from None
        if not isinstance(config, dict):
            raise IntegrityError(f"{config_path} is not a JSON object")
        if (path / MANIFEST_NAME).exists() or "quantization" in config:
            try:
                from mlx_dq.loader import load as dq_load
            except ImportError:
                from mlx_lm import load as lm_load

                model, tokenizer = lm_load(str(path), trust_remote_code=bool(config.get("model_file")))
            else:
                model, tokenizer = dq_load(path)
            return model, tokenizer, config, path
    from mlx_dq.model.sources import load_model

    model, tokenizer, config = load_model(spec, dtype=mx.float32)
    return model, tokenizer, config, None


def manifest_base(folder: str | Path) -> str | None:
    """The source model an mlx-dq output was made from (its manifest's provenance), if recorded; InputError when
    that source is not found or is another model than the one recorded (its fingerprint differs)."""
    return recorded_source(folder, flag="--base")


def results_block(result: dict, base_model: nn.Module | None = None, manifest: dict | None = None) -> dict:
    """The ``results`` record of a manifest (cf. the ``results`` of other quantizers' records): quality, size, time."""
    from mlx_dq import __version__

    provenance = (manifest or {}).get("provenance", {})
    original = None
    if base_model is not None:
        original = sum(v.size for _, v in tree_flatten(base_model.parameters())) * 2
    block = {
        "perplexity": result.get("perplexity"),
        "base_perplexity": result.get("base_perplexity"),
        "kl_divergence": result.get("kl"),
        "kl_divergence_max": result.get("kl_max"),
        "top1_agreement": result.get("top1"),
        "bits_per_weight": result.get("bits_per_weight"),
        "model_size_bytes": result.get("size_bytes"),
        "original_size_bytes": original,
        "quantization_seconds": provenance.get("quantization_seconds"),
        "tokens_per_s": result.get("tokens_per_s"),
        "generation_tokens_per_s": result.get("generation_tokens_per_s"),
        "evaluation": {k: result.get(k) for k in ("text", "text_digest", "rows", "seq_len", "seed", "tokens",
                                                  "base", "evaluated_as")},
        "mlx_dq": __version__,
    }
    if original:
        block["original_size_note"] = "base model parameters at 16 bits"
    return block


def write_results(folder: str | Path, block: dict) -> Path:
    """Add (or replace) the ``results`` block of the folder's manifest, atomically."""
    path = Path(folder) / MANIFEST_NAME
    manifest = read_manifest(folder)
    manifest["results"] = block
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=2))
    os.replace(tmp, path)
    return path
