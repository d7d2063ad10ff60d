"""Mixed-proportion layers: Linear, Embedding and expert bank holding a mixed option's data.

Each layer stores, as plain MLX parameters with stable names (so
``model.save_weights`` / safetensors round-trip them), for every non-empty
segment ``i``: ``weight_{i}`` (packed uint32 codes), ``scales_{i}``,
``biases_{i}``; ``perm`` (uint16/uint32 input order, mixed options only: column
``j`` of the concatenated segments is original input channel ``perm[j]``); and
``bias`` for a Linear/expert bank that has one. The option itself is kept as the
non-parameter attributes ``option`` / ``option_desc``.

The forward path (fused Metal kernel, per-segment quantized matmuls, or the
portable cached-fp32 matmul) is chosen in :mod:`mlx_dq.layers.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

from mlx_dq.layers import kernels
from mlx_dq.quant.affine import QuantizedTensor
from mlx_dq.quant.options import QuantOption, perm_bits


@dataclass(frozen=True)
class _Layout:
    """Bits, group size and width (input channels) of each stored segment."""

    bits: tuple[int, ...]
    group_sizes: tuple[int, ...]
    widths: tuple[int, ...]


class _Cache:
    """Lazily built float32 weight (permutation folded in); not a parameter."""

    def __init__(self) -> None:
        self.sources: tuple = ()
        self.weight: mx.array | None = None


class _MixedWeight(nn.Module):
    """Shared storage and dequantization for the mixed layers (weight ``[..., out, in]``)."""

    def __init__(self, shape: tuple[int, ...], option: QuantOption | str, scale_dtype: mx.Dtype = mx.float16):
        super().__init__()
        if isinstance(option, str):
            option = QuantOption.parse(option)
        if option.keep16:
            raise ValueError("a 16-bit option has no quantized layer; keep the original module")
        *lead, out_f, in_f = shape
        segs = [(s, k) for s, k in zip(option.segments, option.split(in_f)) if k > 0]
        self.option = option
        self.option_desc = option.desc
        self._layout = _Layout(
            tuple(s.bits for s, _ in segs), tuple(s.group_size for s, _ in segs), tuple(k for _, k in segs)
        )
        for i, (s, k) in enumerate(segs):
            setattr(self, f"weight_{i}", mx.zeros((*lead, out_f, k * s.bits // 32), dtype=mx.uint32))
            setattr(self, f"scales_{i}", mx.zeros((*lead, out_f, k // s.group_size), dtype=scale_dtype))
            setattr(self, f"biases_{i}", mx.zeros((*lead, out_f, k // s.group_size), dtype=scale_dtype))
        if option.is_mixed:
            self.perm = mx.arange(in_f).astype(mx.uint16 if perm_bits(in_f) == 16 else mx.uint32)
        self._cache = _Cache()
        self.freeze()

    # ------------------------------------------------------------- storage
    @property
    def parts(self) -> list[tuple[mx.array, mx.array, mx.array]]:
        """``(packed, scales, biases)`` of each segment, in stored order."""
        return [
            (self[f"weight_{i}"], self[f"scales_{i}"], self[f"biases_{i}"]) for i in range(len(self._layout.bits))
        ]

    @property
    def seg_bits(self) -> tuple[int, ...]:
        """Bit width of each stored segment."""
        return self._layout.bits

    @property
    def seg_group_sizes(self) -> tuple[int, ...]:
        """Group size of each stored segment."""
        return self._layout.group_sizes

    @property
    def seg_widths(self) -> tuple[int, ...]:
        """Input channels of each stored segment."""
        return self._layout.widths

    def _perm(self) -> mx.array | None:
        return self.get("perm")

    def _fill(self, qt: QuantizedTensor) -> None:
        if qt.fp is not None or qt.option.keep16:
            raise ValueError("a 16-bit QuantizedTensor has no mixed layer")
        if tuple(qt.bits) != self._layout.bits or tuple(qt.widths) != self._layout.widths:
            raise ValueError(
                f"QuantizedTensor segments (bits {qt.bits}, widths {qt.widths}) do not match "
                f"option {self.option_desc} for this layer (bits {self._layout.bits}, widths {self._layout.widths})"
            )
        for i, (w, s, b) in enumerate(qt.parts):
            setattr(self, f"weight_{i}", w)
            setattr(self, f"scales_{i}", s)
            setattr(self, f"biases_{i}", b)
        if qt.perm is not None:
            self.perm = mx.array(qt.perm)

    # ------------------------------------------------------------- weights
    def dequantize(self) -> mx.array:
        """The float32 weight in original channel order (scale*q + bias computed in fp32)."""
        return kernels.dequantize_parts(self.parts, self.seg_bits, self.seg_group_sizes, self._perm())

    def cached_weight(self) -> mx.array:
        """The dequantized fp32 weight used by the portable path, built on first use.

        Costs 4 bytes per weight of memory until :meth:`clear_cache`; rebuilt when
        the stored arrays are replaced (e.g. by ``load_weights``).
        """
        sources = tuple(a for part in self.parts for a in part) + ((self["perm"],) if "perm" in self else ())
        cache = self._cache
        if cache.weight is None or len(cache.sources) != len(sources) or any(
            a is not b for a, b in zip(cache.sources, sources)
        ):
            # row-contiguous copy: the permuted gather's output otherwise makes every
            # matmul copy the weight again (docs/cost.md#figures-behind-the-code)
            cache.weight = mx.contiguous(self.dequantize())
            mx.eval(cache.weight)
            cache.sources = sources
        return cache.weight

    def clear_cache(self) -> None:
        """Drop the cached fp32 weight of the portable path."""
        self._cache = _Cache()

    def _matmul(self, x: mx.array) -> mx.array:
        """``x @ W^T`` through the path that fits the backend, the number of rows and the CPU cache choice."""
        perm = self._perm()
        path = kernels.matmul_path(x.size // x.shape[-1], perm is not None)
        if path == "cached":
            return kernels.portable_matmul(x, self.cached_weight())
        if path == "fused":
            return kernels.fused_mixed_matmul(x, perm, self.parts, self.seg_bits, self.seg_group_sizes)
        if path == "streamed":
            self._drop_cache()  # the cache was turned off after it was built: free its float32
            return kernels.streamed_matmul(x, perm, self.parts, self.seg_bits, self.seg_group_sizes)
        return kernels.segmented_quantized_matmul(x, perm, self.parts, self.seg_bits, self.seg_group_sizes)

    def _drop_cache(self) -> None:
        if self._cache.weight is not None:
            self.clear_cache()

    def cache_bytes(self) -> int:
        """Bytes the CPU float32 cache of this weight takes when built (4 per weight)."""
        return 4 * int(np.prod(self["weight_0"].shape[:-1])) * sum(self.seg_widths)

    def packed_bytes(self) -> int:
        """Bytes of the stored arrays (codes, scales, biases, permutation; a Linear's bias too)."""
        return sum(int(v.nbytes) for _, v in tree_flatten(self.parameters()))

    def _extra_repr(self) -> str:
        return f"option={self.option_desc!r}"


class MixedLinear(_MixedWeight):
    """A Linear layer whose weight is stored with a (possibly mixed-proportion) option."""

    def __init__(self, input_dims: int, output_dims: int, option: QuantOption | str, bias: bool = False,
                 scale_dtype: mx.Dtype = mx.float16):
        super().__init__((output_dims, input_dims), option, scale_dtype)
        self.input_dims, self.output_dims = input_dims, output_dims
        if bias:
            self.bias = mx.zeros((output_dims,))

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, bias: mx.array | None = None) -> "MixedLinear":
        """Build the layer from a quantized ``[out, in]`` weight and the Linear's own bias."""
        if len(qt.shape) != 2:
            raise ValueError(f"MixedLinear needs a 2-D weight, got shape {qt.shape}")
        out_f, in_f = qt.shape
        layer = cls(in_f, out_f, qt.option, bias=bias is not None, scale_dtype=_scale_dtype(qt))
        layer._fill(qt)
        if bias is not None:
            layer.bias = bias
        return layer

    def __call__(self, x: mx.array) -> mx.array:
        """``x @ W^T (+ bias)``."""
        y = self._matmul(x)
        if "bias" in self:
            y = y + self["bias"]
        return y


class MixedEmbedding(_MixedWeight):
    """An Embedding stored with a mixed option; ``as_linear`` serves as a tied output head."""

    def __init__(self, num_embeddings: int, dims: int, option: QuantOption | str,
                 scale_dtype: mx.Dtype = mx.float16):
        super().__init__((num_embeddings, dims), option, scale_dtype)
        self.num_embeddings, self.dims = num_embeddings, dims

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor) -> "MixedEmbedding":
        """Build the layer from a quantized ``[num_embeddings, dims]`` table."""
        if len(qt.shape) != 2:
            raise ValueError(f"MixedEmbedding needs a 2-D table, got shape {qt.shape}")
        layer = cls(qt.shape[0], qt.shape[1], qt.option, scale_dtype=_scale_dtype(qt))
        layer._fill(qt)
        return layer

    def __call__(self, ids: mx.array) -> mx.array:
        """Rows ``ids`` of the table, dequantizing only the gathered rows.

        float32 on the CPU, the scales' dtype on a GPU.
        """
        on_cpu = kernels.backend() == "cpu"
        if on_cpu and self._cache.weight is not None:
            if kernels.cpu_cache_enabled():
                return self.cached_weight()[ids]
            self._drop_cache()
        rows = [(w[ids], s[ids], b[ids]) for w, s, b in self.parts]
        out = kernels.dequantize_parts(rows, self.seg_bits, self.seg_group_sizes, self._perm())
        if not on_cpu:
            out = out.astype(self["scales_0"].dtype)
        return out

    def as_linear(self, x: mx.array) -> mx.array:
        """``x @ table^T``: the tied output head (mlx-lm calls ``embed_tokens.as_linear``)."""
        return self._matmul(x)


class MixedSwitchLinear(_MixedWeight):
    """An expert bank ``[E, out, in]`` stored with one option and one permutation per bank."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, option: QuantOption | str,
                 bias: bool = False, scale_dtype: mx.Dtype = mx.float16):
        super().__init__((num_experts, output_dims, input_dims), option, scale_dtype)
        self.input_dims, self.output_dims, self.num_experts = input_dims, output_dims, num_experts
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @classmethod
    def from_quantized(cls, qt: QuantizedTensor, bias: mx.array | None = None) -> "MixedSwitchLinear":
        """Build the bank from a quantized ``[E, out, in]`` weight and its ``[E, out]`` bias."""
        if len(qt.shape) != 3:
            raise ValueError(f"MixedSwitchLinear needs a 3-D expert bank, got shape {qt.shape}")
        e, out_f, in_f = qt.shape
        layer = cls(in_f, out_f, e, qt.option, bias=bias is not None, scale_dtype=_scale_dtype(qt))
        layer._fill(qt)
        if bias is not None:
            layer.bias = bias
        return layer

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        """Same contract as mlx-lm's ``SwitchLinear``: expert ``indices[...]`` applied to ``x``."""
        path = kernels.matmul_path(x.size // x.shape[-1], "perm" in self)
        if path == "cached":
            w = self.cached_weight()
            y = mx.gather_mm(
                x.astype(mx.float32), w.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices
            ).astype(x.dtype)
        else:  # a GPU, or the CPU without the cache (computed in float32 there, from the packed bank)
            if path == "streamed":
                self._drop_cache()
            xs = x.astype(mx.float32) if path == "streamed" else x
            y = kernels.segmented_gather_qmm(
                xs, self._perm(), self.parts, self.seg_bits, self.seg_group_sizes, indices, sorted_indices
            ).astype(x.dtype)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


MixedLayer = MixedLinear | MixedEmbedding | MixedSwitchLinear


def mixed_layers(model: nn.Module) -> list[_MixedWeight]:
    """Every mixed layer of ``model`` (row-split tables' parts included)."""
    return [m for _, m in model.named_modules() if isinstance(m, _MixedWeight)]


def weights_dtype(layers: list[_MixedWeight]) -> mx.Dtype:
    """The floating dtype the mixed layers were stored in (their scales'): the model's dtype on a Mac."""
    return _scale_dtype(layers[0]) if layers else mx.float16


def memory_note(model: nn.Module) -> str | None:
    """One line on what the CPU float32 cache costs ``model``, or None when it does not apply (a GPU, no mixed
    layer): so that ``mlx_dq generate`` can say why memory exceeds the file size, and how to avoid it."""
    layers = mixed_layers(model)
    if not layers or kernels.backend() != "cpu":
        return None
    cache = sum(m.cache_bytes() for m in layers)
    packed = sum(m.packed_bytes() for m in layers)
    mib = 1 << 20
    if kernels.cpu_cache_enabled():
        return (f"mlx-dq: CPU float32 cache on: {len(layers)} mixed tensors add {cache / mib:,.0f} MiB to their "
                f"{packed / mib:,.0f} MiB packed ({kernels.CPU_CACHE_ENV}=0 keeps them at their file size; "
                "decode and prefill are slower then)")
    return (f"mlx-dq: CPU float32 cache off: {len(layers)} mixed tensors stay at "
            f"{packed / mib:,.0f} MiB packed ({cache / mib:,.0f} MiB saved); the KV cache is kept in "
            f"{str(weights_dtype(layers)).removeprefix('mlx.core.')}")


def _scale_dtype(qt: QuantizedTensor | _MixedWeight) -> mx.Dtype:
    return qt.parts[0][1].dtype if qt.parts else mx.float16


def mixed_layer_from_quantized(module: nn.Module, qt: QuantizedTensor, prefer_stock: bool = False) -> nn.Module:
    """The layer that replaces ``module`` (nn.Linear, nn.Embedding or SwitchLinear) once quantized as ``qt``.

    With ``prefer_stock=True`` a uniform option gives MLX's / mlx-lm's own quantized
    class (loadable without custom code); otherwise the mixed layer, whose CPU path
    avoids MLX's slow CPU quantized matmul.
    """
    if qt.fp is not None or qt.option.keep16:
        raise ValueError(f"option {qt.option.desc} keeps the tensor 16-bit: keep the original module")
    uniform = prefer_stock and not qt.option.is_mixed and len(qt.parts) == 1
    if isinstance(module, nn.Linear):
        bias = module.get("bias")
        if uniform:
            stock = nn.QuantizedLinear(qt.shape[1], qt.shape[0], bias is not None, qt.group_sizes[0], qt.bits[0])
            _set_stock(stock, qt, bias)
            return stock
        return MixedLinear.from_quantized(qt, bias=bias)
    if isinstance(module, nn.Embedding):
        if uniform:
            stock = nn.QuantizedEmbedding(qt.shape[0], qt.shape[1], qt.group_sizes[0], qt.bits[0])
            _set_stock(stock, qt, None)
            return stock
        return MixedEmbedding.from_quantized(qt)
    if isinstance(module, SwitchLinear):
        bias = module.get("bias")
        if uniform:
            e, out_f, in_f = qt.shape
            stock = QuantizedSwitchLinear(in_f, out_f, e, bias is not None, qt.group_sizes[0], qt.bits[0])
            _set_stock(stock, qt, bias)
            return stock
        return MixedSwitchLinear.from_quantized(qt, bias=bias)
    raise ValueError(f"no mixed layer for module type {type(module).__name__} (Linear, Embedding, SwitchLinear)")


def empty_mixed_layer(module: nn.Module, option: QuantOption | str, scale_dtype: mx.Dtype = mx.float16) -> nn.Module:
    """A placeholder mixed layer shaped for ``module`` (Linear, Embedding or SwitchLinear) and ``option``.

    For loaders: build it in place of the original module, then ``load_weights``
    fills its ``weight_{i}`` / ``scales_{i}`` / ``biases_{i}`` / ``perm`` / ``bias``.
    """
    if isinstance(module, nn.Linear):
        out_f, in_f = module.weight.shape
        return MixedLinear(in_f, out_f, option, bias="bias" in module, scale_dtype=scale_dtype)
    if isinstance(module, nn.Embedding):
        num, dims = module.weight.shape
        return MixedEmbedding(num, dims, option, scale_dtype=scale_dtype)
    if isinstance(module, SwitchLinear):
        e, out_f, in_f = module.weight.shape
        return MixedSwitchLinear(in_f, out_f, e, option, bias="bias" in module, scale_dtype=scale_dtype)
    raise ValueError(f"no mixed layer for module type {type(module).__name__} (Linear, Embedding, SwitchLinear)")


def _set_stock(layer: nn.Module, qt: QuantizedTensor, bias: mx.array | None) -> None:
    layer.weight, layer.scales, layer.biases = qt.parts[0]
    if bias is not None:
        layer.bias = bias
