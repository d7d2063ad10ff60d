"""Mixed-proportion layers: forward equals x @ dequantized^T, save/load round trip, tied head, expert banks."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear
from test_kernels import np_dequant

from mlx_dq.layers import kernels
from mlx_dq.layers.mixed import (
    MixedEmbedding,
    MixedLinear,
    MixedSwitchLinear,
    empty_mixed_layer,
    mixed_layer_from_quantized,
)
from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.options import QuantOption

OPTIONS = [
    "0.1:4b_32g/0.9:3b_32g",
    "0.25:8b_64g/0.5:5b_32g/0.25:2b_128g",
    "0.3:6b_128g/0.7:4b_64g",
    "0.2:5b_32g/0.3:4b_32g/0.3:3b_64g/0.2:2b_32g",
    "1.0:4b_64g",
    "1.0:3b_32g",
    "1.0:6b_128g",
]


def _gram(k: int, seed: int) -> mx.array:
    x = mx.random.normal((4 * k, k), key=mx.random.key(seed)) * mx.linspace(0.1, 3.0, k)
    return x.T @ x


def _quantized(shape, desc, seed=0, clip=False, scale_dtype=mx.float16):
    w = mx.random.normal(shape, key=mx.random.key(seed)) * 0.05
    return quantize_weight(w, QuantOption.parse(desc), gram=_gram(shape[-1], seed + 1), clip=clip,
                           scale_dtype=scale_dtype)


def _np_weight(qt) -> np.ndarray:
    """float64 numpy dequantization of a QuantizedTensor (identity order for uniform options)."""
    perm = qt.perm if qt.perm is not None else np.arange(qt.shape[-1])
    parts = [(np.array(w), s, b) for w, s, b in qt.parts]
    return np_dequant(parts, qt.bits, qt.group_sizes, perm)


def _rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


@pytest.mark.parametrize("desc", OPTIONS)
def test_linear_forward_equals_dequantized_matmul(desc):
    """Forward equals x @ W^T + b with W dequantized in numpy float64, for mixed and uniform options."""
    qt = _quantized((72, 256), desc, seed=3)
    bias = mx.random.normal((72,), key=mx.random.key(9))
    layer = MixedLinear.from_quantized(qt, bias=bias)
    assert layer.option_desc == QuantOption.parse(desc).desc
    assert ("perm" in layer.parameters()) == QuantOption.parse(desc).is_mixed
    w64 = _np_weight(qt)
    np.testing.assert_allclose(np.array(layer.dequantize()), w64, rtol=1e-6, atol=1e-7)
    for shape in [(256,), (1, 256), (2, 5, 256)]:
        x = mx.random.normal(shape, key=mx.random.key(len(shape)))
        y = layer(x)
        assert y.shape == (*shape[:-1], 72) and y.dtype == mx.float32
        assert _rel(y, np.array(x, dtype=np.float64) @ w64.T + np.array(bias)) < 1e-5


def test_linear_with_clip_search_and_bf16_input():
    """Clip-searched weights with bfloat16 scales and input: output in bf16, values match numpy."""
    qt = _quantized((40, 192), "0.34:5b_64g/0.66:3b_32g", seed=5, clip=True, scale_dtype=mx.bfloat16)
    layer = MixedLinear.from_quantized(qt)
    assert layer["scales_0"].dtype == mx.bfloat16
    x = mx.random.normal((3, 192), key=mx.random.key(2)).astype(mx.bfloat16)
    y = layer(x)
    assert y.dtype == mx.bfloat16
    ref = np.array(x.astype(mx.float32), dtype=np.float64) @ _np_weight(qt).T
    assert _rel(y.astype(mx.float32), ref) < 8e-3  # output rounded to bfloat16


def test_portable_path_never_uses_quantized_matmul(monkeypatch):
    """On CPU no layer calls MLX's quantized_matmul or gather_qmm (70x slower there)."""
    assert not kernels.metal_active()

    def refuse(*a, **k):
        raise AssertionError("quantized_matmul called on the portable path")

    monkeypatch.setattr(mx, "quantized_matmul", refuse)
    monkeypatch.setattr(mx, "gather_qmm", refuse)
    layer = MixedLinear.from_quantized(_quantized((16, 128), "0.5:4b_32g/0.5:2b_32g"))
    mx.eval(layer(mx.ones((4, 128))))
    bank = MixedSwitchLinear.from_quantized(_quantized((3, 16, 128), "0.5:4b_32g/0.5:2b_32g"))
    mx.eval(bank(mx.ones((2, 1, 1, 128)), mx.array([[0, 2], [1, 1]])))


def test_save_load_round_trip_is_identical(tmp_path):
    """save_weights -> fresh layers -> load_weights gives identical outputs under stable names."""
    class Tiny(nn.Module):
        def __init__(self, descs):
            super().__init__()
            self.embed = MixedEmbedding(64, 128, descs[0])
            self.proj = MixedLinear(128, 96, descs[1], bias=True)
            self.experts = MixedSwitchLinear(96, 32, 4, descs[2])

        def __call__(self, ids, idx):
            h = self.proj(self.embed(ids))
            return self.experts(mx.expand_dims(h, (-2, -3)), idx), self.embed.as_linear(self.embed(ids))

    descs = ["0.25:6b_32g/0.75:4b_64g", "0.5:5b_32g/0.5:3b_32g", "0.1:4b_32g/0.9:2b_32g"]
    src = Tiny(descs)
    src.embed = MixedEmbedding.from_quantized(_quantized((64, 128), descs[0], seed=1))
    src.proj = MixedLinear.from_quantized(_quantized((96, 128), descs[1], seed=2), bias=mx.arange(96) / 96.0)
    src.experts = MixedSwitchLinear.from_quantized(_quantized((4, 32, 96), descs[2], seed=3))
    path = tmp_path / "model.safetensors"
    src.save_weights(str(path))
    saved = mx.load(str(path))
    assert {"embed.weight_0", "embed.scales_1", "embed.perm", "proj.biases_1", "proj.bias",
            "experts.weight_1", "experts.perm"} <= set(saved)
    assert saved["proj.perm"].dtype == mx.uint16 and saved["proj.weight_0"].dtype == mx.uint32

    dst = Tiny(descs)
    ids, idx = mx.array([[1, 5, 63]]), mx.array([[[0, 3], [1, 2], [3, 3]]])
    before = dst(ids, idx)  # builds caches from the placeholder weights
    dst.load_weights(str(path), strict=True)
    from mlx.utils import tree_flatten

    loaded, saved_params = dict(tree_flatten(dst.parameters())), dict(tree_flatten(src.parameters()))
    assert loaded.keys() == saved_params.keys()
    assert all(mx.array_equal(loaded[k], saved_params[k]).item() and loaded[k].dtype == saved_params[k].dtype
               for k in loaded)
    got, ref = dst(ids, idx), src(ids, idx)
    for a, b in zip(got, ref):  # same values; BLAS may round differently for other buffer alignments
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-6, atol=1e-7)
    assert not mx.array_equal(before[0], ref[0]).item()  # caches were rebuilt after loading


def test_embedding_rows_and_tied_head():
    """Embedding lookups and as_linear equal the numpy-dequantized table."""
    qt = _quantized((100, 128), "0.25:5b_32g/0.75:3b_64g", seed=11)
    emb = MixedEmbedding.from_quantized(qt)
    w64 = _np_weight(qt)
    ids = mx.array([[0, 7, 99], [7, 7, 3]])
    rows = emb(ids)
    assert rows.shape == (2, 3, 128)
    np.testing.assert_allclose(np.array(rows), w64[np.array(ids)], rtol=1e-6, atol=1e-7)
    x = mx.random.normal((2, 128), key=mx.random.key(4))
    assert _rel(emb.as_linear(x), np.array(x, dtype=np.float64) @ w64.T) < 1e-5
    # once the tied head built its cache, lookups read it and stay identical
    assert mx.array_equal(emb(ids), rows).item()


@pytest.mark.parametrize("desc", ["0.1:4b_32g/0.9:3b_32g", "1.0:5b_64g"])
@pytest.mark.parametrize("sort", [False, True])
def test_switch_matches_mlx_lm_switch_linear(desc, sort):
    """The expert bank equals mlx-lm's SwitchLinear holding the dequantized weights."""
    e, out_f, in_f = 6, 48, 256
    qt = _quantized((e, out_f, in_f), desc, seed=21)
    bias = mx.random.normal((e, out_f), key=mx.random.key(22))
    bank = MixedSwitchLinear.from_quantized(qt, bias=bias)
    assert bank.input_dims == in_f and bank.output_dims == out_f and bank.num_experts == e
    stock = SwitchLinear(in_f, out_f, e, bias=True)
    stock.weight = mx.array(_np_weight(qt).astype(np.float32))
    stock.bias = bias
    x = mx.random.normal((2, 5, 1, 1, in_f), key=mx.random.key(23))
    idx = mx.random.randint(0, e, (2, 5, 3), key=mx.random.key(24))
    if sort:
        from mlx_lm.models.switch_layers import _gather_sort

        xs, idx_s, _ = _gather_sort(x, idx)
        got, ref = bank(xs, idx_s, sorted_indices=True), stock(xs, idx_s, sorted_indices=True)
    else:
        got, ref = bank(x, idx), stock(x, idx)
    assert got.shape == ref.shape
    assert _rel(got, ref) < 1e-5


def test_switch_glu_with_mixed_banks():
    """A whole mlx-lm SwitchGLU runs with mixed banks in place of its SwitchLinear layers."""
    glu = SwitchGLU(128, 64, 4)
    ref_glu = SwitchGLU(128, 64, 4)
    for name in ("gate_proj", "up_proj", "down_proj"):
        sl = getattr(glu, name)
        qt = quantize_weight(sl.weight, QuantOption.parse("0.5:4b_32g/0.5:3b_32g"), clip=False)
        setattr(glu, name, mixed_layer_from_quantized(sl, qt))
        getattr(ref_glu, name).weight = getattr(glu, name).dequantize()
    x = mx.random.normal((1, 3, 128), key=mx.random.key(31))
    idx = mx.array([[[0, 1], [2, 3], [3, 0]]])
    assert _rel(glu(x, idx), ref_glu(x, idx)) < 1e-5


def test_mixed_layer_from_quantized_picks_classes():
    """The right layer class per original module; stock MLX classes for uniform options on request."""
    lin, emb, sw = nn.Linear(128, 32, bias=True), nn.Embedding(50, 128), SwitchLinear(128, 32, 3, bias=False)
    mixed = "0.5:4b_32g/0.5:3b_32g"
    assert isinstance(mixed_layer_from_quantized(lin, _quantized((32, 128), mixed)), MixedLinear)
    assert "bias" in mixed_layer_from_quantized(lin, _quantized((32, 128), mixed))
    assert isinstance(mixed_layer_from_quantized(emb, _quantized((50, 128), mixed)), MixedEmbedding)
    assert isinstance(mixed_layer_from_quantized(sw, _quantized((3, 32, 128), mixed)), MixedSwitchLinear)
    # uniform options can become MLX's own layers, with identical dequantized weights
    qt = _quantized((32, 128), "1.0:4b_64g")
    stock = mixed_layer_from_quantized(lin, qt, prefer_stock=True)
    assert isinstance(stock, nn.QuantizedLinear) and (stock.bits, stock.group_size) == (4, 64)
    assert mx.array_equal(stock.weight, qt.parts[0][0]).item()
    assert isinstance(mixed_layer_from_quantized(emb, _quantized((50, 128), "1.0:4b_64g"), prefer_stock=True),
                      nn.QuantizedEmbedding)
    assert isinstance(mixed_layer_from_quantized(sw, _quantized((3, 32, 128), "1.0:4b_64g"), prefer_stock=True),
                      QuantizedSwitchLinear)
    assert isinstance(mixed_layer_from_quantized(lin, _quantized((32, 128), mixed), prefer_stock=True), MixedLinear)


def test_bad_inputs_raise_clear_errors():
    """16-bit options, unknown modules and wrong weight ranks raise ValueError naming the problem."""
    with pytest.raises(ValueError, match="16-bit"):
        mixed_layer_from_quantized(nn.Linear(64, 8), quantize_weight(mx.zeros((8, 64)), QuantOption.fp16()))
    with pytest.raises(ValueError, match="Conv1d"):
        mixed_layer_from_quantized(nn.Conv1d(64, 8, 1), _quantized((8, 64), "1.0:4b_32g"))
    with pytest.raises(ValueError, match="2-D"):
        MixedLinear.from_quantized(_quantized((2, 8, 64), "1.0:4b_32g"))
    with pytest.raises(ValueError, match="3-D"):
        MixedSwitchLinear.from_quantized(_quantized((8, 64), "1.0:4b_32g"))
    with pytest.raises(ValueError, match="16-bit"):
        MixedLinear(64, 8, "16bit")


def _swap_in_mixed_layers(model: nn.Module, desc: str) -> list[tuple[str, nn.Module]]:
    """Replace every Linear, Embedding and SwitchLinear of ``model`` by its mixed layer."""
    from mlx.utils import tree_unflatten

    swaps = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding, SwitchLinear)):
            qt = quantize_weight(mod.weight, QuantOption.parse(desc), clip=False)
            swaps.append((name, mixed_layer_from_quantized(mod, qt)))
    model.update_modules(tree_unflatten(swaps))
    return swaps


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_mlx_lm_model_with_mixed_layers_matches_dequantized_model(arch):
    """mlx-lm models (tied head through ``embed_tokens.as_linear``, MoE through SwitchGLU) run mixed layers."""
    from mlx.utils import tree_flatten, tree_unflatten
    from mlx_lm.models import llama, qwen3_moe

    common = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=96, tie_word_embeddings=True)
    if arch == "llama":
        mod, args = llama, llama.ModelArgs(model_type="llama", **common)
    else:
        mod, args = qwen3_moe, qwen3_moe.ModelArgs(
            model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
            moe_intermediate_size=128, head_dim=32, rope_theta=10000.0, max_position_embeddings=256,
            norm_topk_prob=True, **common)
    mx.random.seed(0)
    model = mod.Model(args)
    weights = dict(tree_flatten(model.parameters()))
    swaps = _swap_in_mixed_layers(model, "0.25:5b_32g/0.75:3b_32g")
    kinds = {type(m) for _, m in swaps}
    assert MixedEmbedding in kinds and MixedLinear in kinds
    assert (MixedSwitchLinear in kinds) == (arch == "qwen3_moe")

    ref = mod.Model(args)
    ref.load_weights(list(weights.items()))
    ref.update(tree_unflatten([(f"{name}.weight", m.dequantize()) for name, m in swaps]))
    tokens = mx.array([[3, 17, 42, 95, 0, 8]])
    got, want = model(tokens), ref(tokens)
    assert got.shape == (1, 6, 96)
    assert _rel(got, want) < 1e-4


@pytest.mark.metal
@pytest.mark.skipif(not kernels.metal_active(), reason="needs Apple silicon with Metal")
@pytest.mark.parametrize("rows", [1, 3, 8, 9, 64])
@pytest.mark.parametrize("desc", ["0.1:4b_32g/0.9:3b_32g", "0.25:6b_64g/0.75:5b_32g", "1.0:4b_64g"])
def test_metal_layers_match_dequantized_matmul(rows, desc):
    """On Metal: fused decode (<= 8 rows), per-segment quantized matmuls (more rows), banks, embedding."""
    qt = _quantized((96, 1024), desc, seed=rows)
    layer = MixedLinear.from_quantized(qt)
    x = mx.random.normal((rows, 1024), key=mx.random.key(1)).astype(mx.float16)
    ref = x.astype(mx.float32) @ layer.dequantize().T
    assert _rel(layer(x).astype(mx.float32), ref) < 2e-3
    emb = MixedEmbedding.from_quantized(qt)
    assert _rel(emb.as_linear(x).astype(mx.float32), ref) < 2e-3
    ids = mx.array([0, 5, 95])
    assert _rel(emb(ids).astype(mx.float32), layer.dequantize()[ids]) < 1e-3
    bank = MixedSwitchLinear.from_quantized(_quantized((3, 96, 1024), desc, seed=rows))
    idx = mx.array([[0, 2]] * rows)
    xb = mx.expand_dims(x, (-2, -3))
    want = mx.gather_mm(xb.astype(mx.float32), bank.dequantize().swapaxes(-1, -2), rhs_indices=idx)
    assert _rel(bank(xb, idx).astype(mx.float32), want) < 2e-3


def test_metal_branch_dispatch_and_segment_matmuls_on_cpu(monkeypatch):
    """The Metal branch of the layers, run on CPU: per-segment quantized matmuls / gather_qmm are real
    (MLX's CPU kernels, small shapes), the fused kernel launch is replaced by a recorder."""
    calls = []

    def fake_fused(x, perm, parts, bits, group_sizes, verbose=False):
        calls.append(x.size // x.shape[-1])
        return kernels.segmented_quantized_matmul(x, perm, parts, bits, group_sizes)

    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    monkeypatch.setattr(kernels, "fused_mixed_matmul", fake_fused)
    mixed = _quantized((40, 256), "0.25:6b_32g/0.5:4b_64g/0.25:2b_32g", seed=41)
    layer = MixedLinear.from_quantized(mixed)
    w64 = _np_weight(mixed)
    for shape in [(1, 256), (2, 4, 256), (9, 256), (3, 7, 256)]:
        x = mx.random.normal(shape, key=mx.random.key(shape[0]))
        assert _rel(layer(x), np.array(x, dtype=np.float64) @ w64.T) < 1e-5
    assert calls == [1, 8]  # fused only for <= 8 rows of a mixed weight
    uni = MixedLinear.from_quantized(_quantized((40, 256), "1.0:5b_64g", seed=42))
    mx.eval(uni(mx.ones((1, 256))))
    assert calls == [1, 8]  # uniform weights go to MLX's own quantized matmul
    emb = MixedEmbedding.from_quantized(mixed)
    ids = mx.array([1, 39])
    assert emb(ids).dtype == mx.float16
    np.testing.assert_allclose(np.array(emb(ids).astype(mx.float32)), w64[[1, 39]], rtol=2e-3, atol=2e-3)
    _assert_bank_matches_numpy(256, seed=43)


def _assert_bank_matches_numpy(in_features: int, seed: int) -> MixedSwitchLinear:
    """A 3-expert mixed bank's gathered matmul on 4 tokens x 2 experts equals numpy's; returns the bank."""
    bank_qt = _quantized((3, 40, in_features), "0.5:5b_32g/0.5:3b_32g", seed=seed)
    bank = MixedSwitchLinear.from_quantized(bank_qt)
    x = mx.random.normal((4, 1, 1, in_features), key=mx.random.key(seed + 1))
    idx = mx.array([[0, 2], [1, 1], [2, 0], [0, 0]])
    want = np.einsum("bk,bjok->bjo", np.array(x[:, 0, 0], dtype=np.float64), _np_weight(bank_qt)[np.array(idx)])
    assert _rel(bank(x, idx)[:, :, 0], want) < 1e-5
    return bank


@pytest.mark.parametrize("kind", ["linear", "embedding", "switch"])
def test_empty_mixed_layer_loads_saved_weights(kind, tmp_path):
    """A placeholder built from the original module and the option description loads the saved layer."""
    desc = "0.3:6b_32g/0.7:3b_64g"
    if kind == "linear":
        orig, shape = nn.Linear(128, 24, bias=True), (24, 128)
    elif kind == "embedding":
        orig, shape = nn.Embedding(24, 128), (24, 128)
    else:
        orig, shape = SwitchLinear(128, 24, 3, bias=True), (3, 24, 128)
    layer = mixed_layer_from_quantized(orig, _quantized(shape, desc, seed=51))
    layer.save_weights(str(tmp_path / "w.safetensors"))
    empty = empty_mixed_layer(orig, layer.option_desc)
    assert type(empty) is type(layer)
    empty.load_weights(str(tmp_path / "w.safetensors"), strict=True)
    assert mx.array_equal(empty.dequantize(), layer.dequantize()).item()
    with pytest.raises(ValueError, match="Conv1d"):
        empty_mixed_layer(nn.Conv1d(4, 4, 1), desc)


# ----------------------------------------------------------------------------- backends and the CPU cache


@pytest.fixture
def cache_off(monkeypatch):
    """The CPU float32 cache off through the environment, as a user turns it off."""
    monkeypatch.setenv(kernels.CPU_CACHE_ENV, "0")
    kernels.set_cpu_cache(None)
    assert not kernels.cpu_cache_enabled()
    yield


@pytest.mark.parametrize("block_rows", [None, 8])
def test_cpu_cache_off_matches_numpy_and_keeps_no_float_copy(cache_off, monkeypatch, block_rows):
    """Cache off: decode (quantized matmuls) and prefill (dequantized blocks, one or many) equal numpy, in x's
    dtype, and no float32 weight is left on the layer; a cache built before it was turned off is dropped."""
    if block_rows:
        monkeypatch.setattr(kernels, "CPU_CHUNK_BYTES", 4 * 256 * block_rows)  # 72 rows: 9 blocks
    qt = _quantized((72, 256), "0.25:6b_32g/0.5:4b_64g/0.25:2b_32g", seed=61)
    layer = MixedLinear.from_quantized(qt, bias=mx.arange(72) / 72.0)
    w64 = _np_weight(qt)
    for shape in [(1, 256), (3, 256), (2, 5, 256), (40, 256)]:
        x = mx.random.normal(shape, key=mx.random.key(shape[0]))
        assert _rel(layer(x), np.array(x, dtype=np.float64) @ w64.T + np.arange(72) / 72.0) < 1e-5
        assert layer._cache.weight is None
    xb = mx.random.normal((12, 256), key=mx.random.key(5)).astype(mx.bfloat16)
    assert MixedLinear.from_quantized(qt)(xb).dtype == mx.bfloat16  # (a float32 bias would promote)
    kernels.set_cpu_cache(True)
    mx.eval(layer(x))
    assert layer._cache.weight is not None
    kernels.set_cpu_cache(False)
    try:
        mx.eval(layer(x))
        assert layer._cache.weight is None
    finally:
        kernels.set_cpu_cache(None)


def test_cpu_cache_off_embedding_head_and_banks(cache_off):
    """Cache off: lookups, the tied head and expert banks equal numpy without building a cache."""
    qt = _quantized((100, 128), "0.25:5b_32g/0.75:3b_64g", seed=62)
    emb = MixedEmbedding.from_quantized(qt)
    w64 = _np_weight(qt)
    for rows in (1, 20):
        x = mx.random.normal((rows, 128), key=mx.random.key(rows))
        assert _rel(emb.as_linear(x), np.array(x, dtype=np.float64) @ w64.T) < 1e-5
    ids = mx.array([[0, 7, 99]])
    np.testing.assert_allclose(np.array(emb(ids)), w64[np.array(ids)], rtol=1e-6, atol=1e-7)
    bank = _assert_bank_matches_numpy(128, seed=63)
    assert emb._cache.weight is None and bank._cache.weight is None


def test_cpu_cache_off_peak_memory_stays_below_the_float_weight(monkeypatch):
    """MLX's peak over a 64-row forward of a 2048 x 2048 mixed layer: cache on adds at least the 16 MiB float32
    weight, cache off less than a quarter of it (the blocks are dequantized one after another)."""
    monkeypatch.setattr(kernels, "CPU_CHUNK_BYTES", 256 << 10)
    layer = MixedLinear.from_quantized(quantize_weight(mx.random.normal((2048, 2048), key=mx.random.key(65)) * 0.02,
                                                       QuantOption.parse("0.5:4b_64g/0.5:3b_64g"), clip=False))
    x = mx.random.normal((64, 2048), key=mx.random.key(66))
    mx.eval(layer.parameters(), x)
    fp32 = 2048 * 2048 * 4
    peaks = {}
    for cache in (False, True):
        kernels.set_cpu_cache(cache)
        try:
            mx.clear_cache()
            mx.reset_peak_memory()
            base = mx.get_active_memory()
            mx.eval(layer(x))
            peaks[cache] = mx.get_peak_memory() - base
        finally:
            kernels.set_cpu_cache(None)
    assert peaks[True] >= fp32
    assert peaks[False] < fp32 / 4, peaks


class _TinyMixedModel(nn.Module):
    """Embedding, two mixed MLP blocks and the tied head: the shape of a decoder's forward, small."""

    def __init__(self, vocab: int = 600, dims: int = 128, hidden: int = 192):
        super().__init__()
        self.embed = MixedEmbedding.from_quantized(_quantized((vocab, dims), "0.25:4b_64g/0.75:3b_64g", seed=70))
        self.blocks = [(MixedLinear.from_quantized(_quantized((hidden, dims), "0.1:4b_32g/0.9:3b_32g", seed=71 + i)),
                        MixedLinear.from_quantized(_quantized((dims, hidden), "0.5:3b_64g/0.5:2b_64g", seed=73 + i),
                                                   bias=mx.arange(dims) / dims))
                       for i in range(2)]

    def __call__(self, ids: mx.array) -> mx.array:
        h = self.embed(ids)
        for up, down in self.blocks:
            h = h + down(nn.silu(up(h)))
        return self.embed.as_linear(h)


@pytest.mark.parametrize("rows", [1, 3, 12])
def test_cpu_cache_off_forward_matches_cached_forward(monkeypatch, rows):
    """A tiny mixed model's lazy forward with the cache off equals the cached one within float32 rounding, and
    does not depend on the block size (decode: bit for bit, the same quantized matmuls on fewer rows each)."""
    model = _TinyMixedModel()
    ids = mx.random.randint(0, 600, (1, rows), key=mx.random.key(rows))
    out = {}
    for cache, chunk in [(True, None), (False, None), (False, 1 << 10)]:
        if chunk:
            monkeypatch.setattr(kernels, "CPU_CHUNK_BYTES", chunk)  # every weight in several blocks (head: 10+)
        kernels.set_cpu_cache(cache)
        try:
            out[cache, chunk] = np.array(model(ids))
        finally:
            kernels.set_cpu_cache(None)
    assert _rel(out[False, None], out[True, None]) < 1e-5
    if rows <= kernels.CPU_QMM_MAX_ROWS:
        np.testing.assert_array_equal(out[False, 1 << 10], out[False, None])
    else:
        np.testing.assert_allclose(out[False, 1 << 10], out[False, None], rtol=1e-5, atol=1e-6)
    assert all(m._cache.weight is None for m in [model.embed] + [m for b in model.blocks for m in b])  # dropped


def test_cpu_cache_off_decode_equals_the_whole_weight_quantized_matmul(monkeypatch):
    """Decode in row blocks gives exactly what one quantized matmul per segment on the whole weight gives."""
    monkeypatch.setattr(kernels, "CPU_CHUNK_BYTES", 2 << 10)
    qt = _quantized((200, 256), "0.25:6b_32g/0.5:4b_64g/0.25:2b_32g", seed=75)
    layer = MixedLinear.from_quantized(qt)
    x = mx.random.normal((2, 256), key=mx.random.key(76))
    whole = kernels.segmented_quantized_matmul(x, layer["perm"], layer.parts, layer.seg_bits, layer.seg_group_sizes)
    blocked = kernels.streamed_matmul(x, layer["perm"], layer.parts, layer.seg_bits, layer.seg_group_sizes)
    np.testing.assert_array_equal(np.array(blocked), np.array(whole))


def test_cpu_cache_off_decode_peak_stays_below_the_heads_float_scales(monkeypatch):
    """A lazy decode step through layers and a 32768-row tied head: its scales and biases widened to float32 whole
    (what one quantized matmul per segment does: 2 MiB here) were the step's peak; in blocks it is a fraction."""
    monkeypatch.setattr(kernels, "CPU_CHUNK_BYTES", 32 << 10)
    w = mx.random.normal((32768, 512), key=mx.random.key(77)) * 0.02
    head = MixedEmbedding.from_quantized(quantize_weight(w, QuantOption.parse("0.25:4b_64g/0.75:3b_64g"), clip=False))
    del w
    layers = [MixedLinear.from_quantized(_quantized((512, 512), "0.5:4b_64g/0.5:3b_64g", seed=78 + i))
              for i in range(4)]
    x = mx.random.normal((1, 1, 512), key=mx.random.key(82))
    mx.eval(head.parameters(), [m.parameters() for m in layers], x)
    widened = 32768 * (512 // 64) * 2 * 4

    def peak(head_matmul) -> int:
        h = x
        for m in layers:
            h = m(h)
        mx.clear_cache()
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        mx.eval(head_matmul(h))
        return mx.get_peak_memory() - base

    kernels.set_cpu_cache(False)
    try:
        whole = peak(lambda h: kernels.segmented_quantized_matmul(h.astype(mx.float32), head["perm"], head.parts,
                                                                  head.seg_bits, head.seg_group_sizes))
        blocked = peak(head.as_linear)
    finally:
        kernels.set_cpu_cache(None)
    assert whole >= widened
    assert blocked < widened / 3, (blocked, widened)


def test_gpu_backends_use_segment_matmuls_and_no_cache(monkeypatch):
    """A non-Metal GPU (MLX's CUDA build) runs per-segment quantized matmuls for every row count, never the
    float32 cache nor the Metal kernel; Metal keeps the fused decode kernel (run here on MLX's CPU ops)."""
    fused = []
    monkeypatch.setattr(kernels, "backend", lambda: "gpu")
    monkeypatch.setattr(kernels, "fused_mixed_matmul", lambda *a, **k: fused.append(1))
    qt = _quantized((40, 256), "0.25:6b_32g/0.75:4b_64g", seed=67)
    layer, emb = MixedLinear.from_quantized(qt), MixedEmbedding.from_quantized(qt)
    w64 = _np_weight(qt)
    for rows in (1, 9):
        x = mx.random.normal((rows, 256), key=mx.random.key(rows))
        assert kernels.matmul_path(rows, True) == "segmented"
        assert _rel(layer(x), np.array(x, dtype=np.float64) @ w64.T) < 1e-5
        assert _rel(emb.as_linear(x), np.array(x, dtype=np.float64) @ w64.T) < 1e-5
    assert emb(mx.array([3])).dtype == mx.float16  # lookups in the scales' dtype on a GPU, as on Metal
    assert fused == [] and layer._cache.weight is None and emb._cache.weight is None
    monkeypatch.setattr(kernels, "backend", lambda: "metal")
    assert [kernels.matmul_path(r, m) for r, m in [(1, True), (8, True), (9, True), (1, False)]] == \
        ["fused", "fused", "segmented", "segmented"]


def test_cpu_cache_setting_parses_and_overrides(monkeypatch):
    """MLX_DQ_CPU_CACHE: on by default, 0/off turn it off, junk is an InputError naming the variable;
    set_cpu_cache wins over the environment until reset."""
    from mlx_dq.errors import InputError

    monkeypatch.delenv(kernels.CPU_CACHE_ENV, raising=False)
    assert kernels.cpu_cache_enabled() and kernels.matmul_path(1, True) == "cached"
    for raw, want in [("0", False), ("off", False), ("1", True), ("yes", True)]:
        monkeypatch.setenv(kernels.CPU_CACHE_ENV, raw)
        assert kernels.cpu_cache_enabled() is want
    monkeypatch.setenv(kernels.CPU_CACHE_ENV, "maybe")
    with pytest.raises(InputError, match=kernels.CPU_CACHE_ENV):
        kernels.cpu_cache_enabled()
    kernels.set_cpu_cache(False)
    try:
        assert kernels.matmul_path(1, True) == "streamed"
    finally:
        kernels.set_cpu_cache(None)


def test_memory_note_states_the_cache_cost(monkeypatch):
    """memory_note: the float32 bytes the cache adds (4 per weight, expert banks included), or what it saves."""
    from mlx_dq.layers.mixed import memory_note, mixed_layers

    class Two(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = MixedLinear.from_quantized(_quantized((64, 256), "0.5:4b_32g/0.5:3b_32g", seed=68))
            self.b = MixedSwitchLinear.from_quantized(_quantized((2, 32, 128), "1.0:4b_64g", seed=69))
            self.c = nn.Linear(8, 8)

    model = Two()
    assert len(mixed_layers(model)) == 2
    mib = (64 * 256 + 2 * 32 * 128) * 4 / (1 << 20)
    monkeypatch.delenv(kernels.CPU_CACHE_ENV, raising=False)
    note = memory_note(model)
    assert "cache on" in note and f"add {mib:,.0f} MiB" in note and "MLX_DQ_CPU_CACHE=0" in note
    monkeypatch.setenv(kernels.CPU_CACHE_ENV, "0")
    assert "cache off" in memory_note(model) and f"({mib:,.0f} MiB saved)" in memory_note(model)
    assert memory_note(nn.Linear(4, 4)) is None
    monkeypatch.setattr(kernels, "backend", lambda: "gpu")
    assert memory_note(model) is None
