"""Forward replay: a rerun with one submodule changed reuses the calls it cannot affect, with the same values."""

from __future__ import annotations

import contextlib
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

import mlx_dq.measure.importance as importance_mod
from mlx_dq.model.replay import record_calls, replay
from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.options import QuantOption

CALLS: Counter = Counter()


class Counted(nn.Linear):
    """A linear layer that counts its calls."""

    def __call__(self, x):
        CALLS[id(self)] += 1
        return super().__call__(x)


class Scale(nn.Module):
    """Called twice per forward, like a rotary embedding on queries and keys."""

    def __call__(self, x):
        CALLS[id(self)] += 1
        return x * 1.5


class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.a, self.b, self.c = Counted(d, d), Counted(d, d), Counted(d, d)
        self.s = Scale()

    def __call__(self, x):
        u, v = self.s(self.a(x)), self.s(self.b(x))
        return self.c(mx.tanh(u) * v)


class Net(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.first = Counted(d, d)
        self.block = Block(d)
        self.last = Counted(d, d)

    def __call__(self, x):
        h = self.first(x)
        return self.last(self.block(h) + h)


def _linears(net: Net) -> dict[str, nn.Module]:
    return {"first": net.first, "a": net.block.a, "b": net.block.b, "c": net.block.c, "last": net.last}


def test_replay_gives_the_full_rerun_and_skips_what_came_before():
    mx.random.seed(0)
    net, x = Net(32), mx.random.normal((8, 32))
    mx.eval(net.parameters())
    lins = _linears(net)
    with record_calls(net, lins.values()) as log:
        ref = net(x)
        mx.eval(ref)
    # per target: the linears that still run, and the calls of the twice-called module
    runs = {"first": ({"first", "a", "b", "c", "last"}, 2), "a": ({"a", "b", "c", "last"}, 2),
            "b": ({"b", "c", "last"}, 1), "c": ({"c", "last"}, 0), "last": ({"last"}, 0)}
    for name, mod in lins.items():
        w = mod.weight
        mod.weight = w + 0.01 * mx.random.normal(w.shape)
        try:
            full = net(x)
            mx.eval(full)
            CALLS.clear()
            with replay(net, log, mod):
                fast = net(x)
            mx.eval(fast)
        finally:
            mod.weight = w
        assert np.array_equal(np.array(full), np.array(fast)), name
        assert not np.array_equal(np.array(full), np.array(ref)), name
        assert {n for n, m in lins.items() if CALLS[id(m)]} == runs[name][0], name
        assert CALLS[id(net.block.s)] == runs[name][1], name


class InPlace(nn.Module):
    """Assigns into a submodule's output, as some model code does."""

    def __init__(self, d: int):
        super().__init__()
        self.a, self.b = nn.Linear(d, d), nn.Linear(d, d)

    def __call__(self, x):
        u = self.a(x)
        u[..., 0] += 1.0
        return self.b(u)


def test_a_replayed_output_assigned_into_leaves_the_record_as_it_was():
    mx.random.seed(1)
    net, x = InPlace(8), mx.random.normal((4, 8))
    mx.eval(net.parameters())
    with record_calls(net, [net.b]) as log:
        mx.eval(net(x))
    w = net.b.weight
    net.b.weight = w * 1.1
    try:
        full = net(x)
        for _ in range(2):  # each replay would add one more had the record been changed
            with replay(net, log, net.b):
                fast = net(x)
            assert np.array_equal(np.array(full), np.array(fast))
        assert np.array_equal(np.array(next(iter(log.outputs.values()))), np.array(net.a(x)))
    finally:
        net.b.weight = w


def test_replay_refuses_a_target_not_recorded():
    net = Net(8)
    with record_calls(net, [net.first]) as log:
        net(mx.zeros((1, 8)))
    with pytest.raises(ValueError, match="no call of this target"):
        with replay(net, log, net.last):
            pass


def test_record_keeps_only_what_a_target_reuses():
    net = Net(8)
    with record_calls(net, [net.block.c]) as log:
        net(mx.zeros((1, 8)))
    kept = {k[0] for k in log.outputs}
    assert kept == {id(net.first), id(net.block.a), id(net.block.b), id(net.block.s)}
    assert type(net.first) is Counted and type(net.block.s) is Scale  # classes restored


def _layer(model_type: str):
    """One decoder layer of an mlx-lm model with random weights, its input and its call arguments."""
    from mlx_lm.models import llama, qwen3_moe

    mx.random.seed(3)
    if model_type == "llama":
        args = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                               num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=50)
        layer = llama.TransformerBlock(args)
    else:
        args = qwen3_moe.ModelArgs(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=1,
                                   intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                                   rms_norm_eps=1e-5, vocab_size=50, head_dim=16, num_experts=4,
                                   num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                   moe_intermediate_size=32, rope_theta=10000.0, max_position_embeddings=64,
                                   tie_word_embeddings=False, norm_topk_prob=True)
        layer = qwen3_moe.Qwen3MoeDecoderLayer(args, 0)
    mx.eval(layer.parameters())
    return layer, mx.random.normal((2, 16, 64)), (("causal", None), {})


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_residual_importance_is_that_of_full_reruns(model_type, monkeypatch):
    from mlx_dq.model.capture import quantizable_modules

    layer, h, call = _layer(model_type)
    mods = quantizable_modules(layer, "layers.0.")
    refs = {p: quantize_weight(m.weight, QuantOption.parse("1.0:3b_64g" if m.weight.shape[-1] >= 64 else "1.0:3b_32g"))
            for p, m in mods.items()}
    fast = importance_mod.residual_importance(layer, h, call, mods, refs)
    monkeypatch.setattr(importance_mod, "replay", lambda *a: contextlib.nullcontext())
    full = importance_mod.residual_importance(layer, h, call, mods, refs)
    assert fast == full
    assert all(v["damage"] > 0 for v in full.values())
