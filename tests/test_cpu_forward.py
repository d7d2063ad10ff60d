"""The CPU forward's attention and SwiGLU: the exponential against float64, both against MLX's and mlx-lm's own,
and the swap's scope."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import activations, llama

from mlx_dq.model import cpu_forward as cf
from mlx_dq.model.cpu_forward import (
    blocked_attention,
    cpu_forward,
    exp_nonpositive,
    silu_product,
    softmax_rows,
)


def _ulps(got: np.ndarray, want64: np.ndarray) -> np.ndarray:
    return np.abs(got.astype(np.float64) - want64) / np.spacing(want64.astype(np.float32)).astype(np.float64)


def test_exp_nonpositive_is_within_one_ulp_of_float64():
    rng = np.random.default_rng(0)
    x = np.concatenate([-rng.uniform(0, 87, 200_000), -rng.uniform(0, 1e-3, 10_000),
                        -np.arange(0, 87, 0.5)]).astype(np.float32)
    got = np.array(exp_nonpositive(mx.array(x)))
    assert _ulps(got, np.exp(x.astype(np.float64))).max() <= 1.0
    # the softmax's fixed points: exp(0) = 1 exactly, masked scores (-inf) and scores beyond the floor give 0
    edge = np.array(exp_nonpositive(mx.array([0.0, -np.inf, -87.5, -1e30, -0.0], dtype=mx.float32)))
    assert edge.tolist() == [1.0, 0.0, 0.0, 0.0, 1.0]


def test_softmax_rows_matches_float64():
    rng = np.random.default_rng(1)
    s = rng.normal(0, 6, (3, 7, 300)).astype(np.float32)
    s[..., 200:] = -np.inf
    got = np.array(softmax_rows(mx.array(s)))
    s64 = s.astype(np.float64)
    e = np.exp(s64 - s64.max(-1, keepdims=True))
    want = e / e.sum(-1, keepdims=True)
    assert np.abs(got - want).max() < 1e-6
    assert (got[..., 200:] == 0).all()


def _reference64(q, k, v, scale, causal):
    """Attention in float64 numpy (grouped heads repeated), for the accuracy of both float32 paths."""
    q64, k64, v64 = (np.array(a, dtype=np.float64) for a in (q, k, v))
    rep = q64.shape[1] // k64.shape[1]
    k64, v64 = np.repeat(k64, rep, axis=1), np.repeat(v64, rep, axis=1)
    s = q64 @ k64.swapaxes(-1, -2) * scale
    n_q, n_k = s.shape[-2:]
    if causal:
        s = np.where(np.arange(n_k)[None] <= np.arange(n_k - n_q, n_k)[:, None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v64


@pytest.mark.parametrize("heads,kv,n_q,n_k,causal", [
    (6, 2, 300, 300, True),   # grouped queries; the last block is short
    (4, 4, 128, 128, True),   # one block, plain multi-head
    (6, 3, 40, 200, True),    # fewer queries than keys: the causal window is offset (a cache's case)
    (4, 2, 150, 150, False),  # no mask
])
def test_blocked_attention_matches_mlx(heads, kv, n_q, n_k, causal):
    mx.random.seed(3)
    b, d = 2, 32
    q = mx.random.normal((b, heads, n_q, d)) * 2
    k, v = mx.random.normal((b, kv, n_k, d)) * 2, mx.random.normal((b, kv, n_k, d))
    scale = d ** -0.5
    mine = blocked_attention(q, k, v, scale, causal, block=64)
    theirs = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask="causal" if causal else None)
    want = _reference64(q, k, v, scale, causal)
    assert mine.shape == theirs.shape
    err_mine, err_theirs = np.abs(np.array(mine) - want).max(), np.abs(np.array(theirs) - want).max()
    assert err_mine < 1e-5 and err_mine <= 4 * err_theirs + 1e-6


def test_the_swap_is_scoped_nested_and_keeps_other_calls():
    original = mx.fast.scaled_dot_product_attention
    mx.random.seed(4)
    q, k, v = (mx.random.normal((1, 2, 16, 8)) for _ in range(3))
    mask = mx.random.normal((16, 16))
    with cpu_forward():
        swapped = mx.fast.scaled_dot_product_attention
        assert swapped is not original
        with cpu_forward():
            assert mx.fast.scaled_dot_product_attention is swapped
        assert mx.fast.scaled_dot_product_attention is swapped  # the inner exit does not restore early
        # an array mask, sinks and 16-bit inputs reach MLX's own function: the very same values
        assert np.array_equal(np.array(swapped(q, k, v, scale=0.3, mask=mask)),
                              np.array(original(q, k, v, scale=0.3, mask=mask)))
        h = [a.astype(mx.float16) for a in (q, k, v)]
        assert np.array_equal(np.array(swapped(*h, scale=0.3, mask="causal")),
                              np.array(original(*h, scale=0.3, mask="causal")))
        sinks = mx.zeros((2,))
        assert np.array_equal(np.array(swapped(q, k, v, scale=0.3, mask="causal", sinks=sinks)),
                              np.array(original(q, k, v, scale=0.3, mask="causal", sinks=sinks)))
    assert mx.fast.scaled_dot_product_attention is original
    with pytest.raises(RuntimeError):
        with cpu_forward():
            raise RuntimeError("boom")
    assert mx.fast.scaled_dot_product_attention is original and cf._depth == 0


def test_silu_product_matches_float64_and_its_blocks_change_nothing():
    rng = np.random.default_rng(5)
    gate = rng.normal(0, 5, (3, 50, 96)).astype(np.float32)
    gate[0, 0, :4] = [0.0, -100.0, 100.0, -88.0]
    x = rng.normal(0, 1, gate.shape).astype(np.float32)
    g64, x64 = gate.astype(np.float64), x.astype(np.float64)
    want = g64 / (1 + np.exp(-g64)) * x64
    whole = np.array(silu_product(mx.array(gate), mx.array(x), block=10**9))
    assert (np.abs(whole - want) <= 1e-6 * np.abs(want) + 1e-30).all()
    blocks = np.array(silu_product(mx.array(gate), mx.array(x), block=96 * 7))  # 7 rows a block, the last short
    assert np.array_equal(blocks, whole)
    theirs = np.array(activations.swiglu(mx.array(gate), mx.array(x)))
    assert np.abs(whole - theirs).max() <= 1e-5 * np.abs(theirs).max()


def test_the_swiglu_swap_reaches_model_modules_and_is_restored():
    assert llama.swiglu is activations.swiglu
    gate, x = mx.random.normal((4, 8)), mx.random.normal((4, 8))
    with cpu_forward():
        swapped = llama.swiglu
        assert swapped is not activations.swiglu
        h = (gate.astype(mx.float16), x.astype(mx.float16))  # 16-bit: mlx-lm's own, the very same values
        assert np.array_equal(np.array(swapped(*h)), np.array(activations.swiglu(*h)))
    assert llama.swiglu is activations.swiglu


def test_a_model_layer_gives_the_same_output_with_the_swap(tiny_llama, monkeypatch):
    from mlx_dq.model.runner import LayerRunner
    from mlx_dq.model.sources import resolve

    src = resolve(str(tiny_llama))
    tokens = mx.array(np.random.default_rng(0).integers(0, 200, (2, 200)), dtype=mx.int32)
    runner = LayerRunner(src, tokens, 2)
    runner.load_for_probe()
    hidden = runner.join(runner.probe())
    runner.load(0)
    args, kwargs = runner.calls[0][0]
    plain = runner.layers[0](hidden, *args, **kwargs)  # MLX's own attention
    calls = []
    for name, fn in (("blocked_attention", blocked_attention), ("silu_product", silu_product)):
        monkeypatch.setattr(cf, name, lambda *a, _n=name, _f=fn, **kw: calls.append(_n) or _f(*a, **kw))
    mine = runner.forward(0, hidden)
    assert set(calls) == {"blocked_attention", "silu_product"}, "the runner's forward did not use both fast paths"
    assert np.abs(np.array(mine) - np.array(plain)).max() <= 1e-5 * float(mx.abs(plain).max())
