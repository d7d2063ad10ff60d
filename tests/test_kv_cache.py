"""The generation's KV cache: kept in the weights' 16-bit dtype when a mixed model runs with the CPU cache off."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from fixtures_models import tiny_config
from mlx_lm.models.cache import KVCache, QuantizedKVCache, RotatingKVCache

from mlx_dq.layers import kernels
from mlx_dq.layers.kv_cache import (
    SmallKVCache,
    SmallRotatingKVCache,
    generation_cache,
    store_caches_in,
)
from mlx_dq.layers.mixed import memory_note, mixed_layer_from_quantized
from mlx_dq.model.sources import build_model
from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.options import QuantOption


def _tiny_mixed_llama(scale_dtype=mx.float16):
    """A random two-layer llama whose MLP down projections are mixed layers with ``scale_dtype`` scales."""
    mx.random.seed(3)
    model = build_model(tiny_config("llama", 2))
    for layer in model.model.layers:
        w = layer.mlp.down_proj.weight
        qt = quantize_weight(w, QuantOption.parse("0.25:4b_32g/0.75:3b_32g"), clip=False, scale_dtype=scale_dtype)
        layer.mlp.down_proj = mixed_layer_from_quantized(layer.mlp.down_proj, qt)
    mx.eval(model.parameters())
    return model


def _run(model, caches, ids):
    """Logits of the prompt ``ids`` then of three greedy decode steps, through ``caches``."""
    out = [model(ids, cache=caches)[:, -1]]
    for _ in range(3):
        out.append(model(mx.argmax(out[-1], axis=-1)[:, None], cache=caches)[:, -1])
    return np.array(mx.concatenate(out))


@pytest.fixture
def cache_off(monkeypatch):
    monkeypatch.setenv(kernels.CPU_CACHE_ENV, "0")
    kernels.set_cpu_cache(None)
    yield


@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.bfloat16])
def test_cache_off_stores_keys_and_values_in_the_weights_dtype(cache_off, scale_dtype):
    """Cache off on the CPU: the KV cache holds the weights' 16-bit dtype (half the float32 bytes of mlx-lm's own
    cache on the same model), the attention still gets float32, and the logits stay within 16-bit rounding."""
    model = _tiny_mixed_llama(scale_dtype)
    ids = mx.random.randint(0, 200, (1, 9), key=mx.random.key(4))
    small = generation_cache(model)
    assert all(type(c) is SmallKVCache for c in small)
    plain = [KVCache() for _ in model.layers]
    got, want = _run(model, small, ids), _run(model, plain, ids)
    assert all(c.keys.dtype == scale_dtype and c.values.dtype == scale_dtype for c in small)
    assert all(c.keys.dtype == mx.float32 for c in plain)
    assert sum(c.nbytes for c in small) * 2 == sum(c.nbytes for c in plain)
    assert small[0].offset == plain[0].offset == 12
    np.testing.assert_allclose(got, want, rtol=0, atol=3e-2 * np.abs(want).max())
    assert not np.array_equal(got, want)  # the keys really went through 16 bits


def test_cache_on_or_a_gpu_keeps_mlx_lms_cache(monkeypatch):
    """Cache on (the CPU default), or not the CPU: mlx-lm's own caches, unchanged."""
    model = _tiny_mixed_llama()
    monkeypatch.delenv(kernels.CPU_CACHE_ENV, raising=False)
    kernels.set_cpu_cache(None)
    assert all(type(c) is KVCache for c in generation_cache(model))
    monkeypatch.setenv(kernels.CPU_CACHE_ENV, "0")
    monkeypatch.setattr(kernels, "backend", lambda: "gpu")
    assert all(type(c) is KVCache for c in generation_cache(model))


def test_rotating_and_other_cache_kinds(cache_off):
    """A bounded (rotating) cache stays bounded and stores 16 bits; kinds it does not know are left as they are;
    a model with no mixed layer keeps mlx-lm's cache."""
    model = _tiny_mixed_llama()
    caches = store_caches_in([RotatingKVCache(max_size=5) for _ in model.layers], mx.bfloat16)
    assert all(type(c) is SmallRotatingKVCache and c.max_size == 5 for c in caches)
    ids = mx.random.randint(0, 200, (1, 9), key=mx.random.key(6))
    mx.eval(model(ids, cache=caches), model(ids[:, :1], cache=caches))
    assert caches[0].keys.dtype == mx.bfloat16 and caches[0].keys.shape[2] <= 9 and caches[0].offset == 10
    quantized = store_caches_in([QuantizedKVCache()], mx.float16)
    assert type(quantized[0]) is QuantizedKVCache
    assert all(type(c) is KVCache for c in generation_cache(build_model(tiny_config("llama", 2))))
    assert "KV cache is kept in float16" in memory_note(model)
