"""The KV cache of a generation, kept in the weights' 16-bit dtype when the model is asked to stay small.

On the CPU a mixed model computes in float32 (MLX's float16 CPU matmuls are far slower), so mlx-lm's KV cache
would be float32 too: twice what the same model holds on a Mac, where it computes in its file's 16-bit dtype.
With the CPU float32 cache off (``MLX_DQ_CPU_CACHE=0``: the model kept at its file size) the cache stores keys and
values in the mixed weights' dtype, as on a Mac, and hands them back in the dtype the attention computes in.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache


class _StoredIn:
    """Mixin: ``update_and_fetch`` stores keys and values in ``store_dtype`` and returns them in the caller's."""

    store_dtype: mx.Dtype

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        k, v = super().update_and_fetch(keys.astype(self.store_dtype), values.astype(self.store_dtype))  # type: ignore[misc]
        return k.astype(keys.dtype), v.astype(values.dtype)


class SmallKVCache(_StoredIn, KVCache):
    """mlx-lm's KVCache storing in ``store_dtype``."""


class SmallRotatingKVCache(_StoredIn, RotatingKVCache):
    """mlx-lm's RotatingKVCache storing in ``store_dtype``."""


_SMALL = {KVCache: SmallKVCache, RotatingKVCache: SmallRotatingKVCache}


def store_caches_in(caches: list[Any], dtype: mx.Dtype) -> list[Any]:
    """``caches`` (empty mlx-lm caches) made to store keys and values in ``dtype``; kinds other than KVCache and
    RotatingKVCache (quantized, state-space, batched) are left as they are."""
    for c in caches:
        small = _SMALL.get(type(c))
        if small is not None:
            c.__class__ = small
            c.store_dtype = dtype
    return caches


def generation_cache(model: nn.Module, max_kv_size: int | None = None) -> list[Any]:
    """mlx-lm's prompt cache for ``model``; with mixed layers on the CPU and their float32 cache off, it stores
    keys and values in the mixed weights' 16-bit dtype (half of float32), so the generation stays near the file
    size."""
    from mlx_dq.layers import kernels
    from mlx_dq.layers.mixed import mixed_layers, weights_dtype

    caches = make_prompt_cache(model, max_kv_size=max_kv_size)
    layers = mixed_layers(model)
    if layers and kernels.backend() == "cpu" and not kernels.cpu_cache_enabled():
        store_caches_in(caches, weights_dtype(layers))
    return caches
