"""Quantization math: MLX storage format, round trips, clip search, error measures."""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_dq.quant import storage
from mlx_dq.quant.affine import (
    QuantizedTensor,
    act_order,
    output_error,
    quantize_weight,
    weight_error,
)
from mlx_dq.quant.options import VALID_BITS, VALID_GROUPS, QuantOption, Segment
from mlx_dq.quant.scale_search import clip_search
from mlx_dq.quant.storage import dequantize_ref, pack_codes, pack_codes_mx, unpack_codes

BITS_GROUPS = list(itertools.product(VALID_BITS, VALID_GROUPS))


def heavy_tailed(shape: tuple[int, ...], seed: int = 0) -> mx.array:
    """Weights like a trained layer's: Student-t rows with a few large-scale input channels."""
    rng = np.random.default_rng(seed)
    w = rng.standard_t(4, size=shape) * 0.02
    w *= 1.0 + 3.0 * (rng.random(shape[-1]) < 0.02)
    return mx.array(w.astype(np.float32))


def random_gram(in_f: int, n: int = 512, seed: int = 1) -> tuple[mx.array, np.ndarray]:
    """A Gram matrix X^T X of correlated inputs with uneven channel energy, and X itself."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, in_f)) * rng.lognormal(0.0, 1.0, in_f)
    x = x + 0.5 * rng.standard_normal((n, 1))
    x = x.astype(np.float32)
    return mx.array(x.T @ x), x


def save_load(qt: QuantizedTensor, path) -> tuple[QuantizedTensor, int]:
    """Save a quantized tensor's arrays with safetensors, load them back; also return the file's array bytes."""
    arrays = {}
    for i, (w, s, b) in enumerate(qt.parts):
        arrays[f"seg{i}.weight"], arrays[f"seg{i}.scales"], arrays[f"seg{i}.biases"] = w, s, b
    if qt.perm is not None:
        arrays["perm"] = mx.array(qt.perm)
    if qt.fp is not None:
        arrays["weight"] = qt.fp
    mx.save_safetensors(str(path), arrays)
    loaded = mx.load(str(path))
    assert set(loaded) == set(arrays)
    parts = [(loaded[f"seg{i}.weight"], loaded[f"seg{i}.scales"], loaded[f"seg{i}.biases"]) for i in range(len(qt.parts))]
    perm = np.array(loaded["perm"]) if "perm" in loaded else None
    back = QuantizedTensor(
        qt.option, qt.shape, parts, list(qt.widths), list(qt.bits), list(qt.group_sizes), perm=perm, fp=loaded.get("weight")
    )
    return back, sum(a.nbytes for a in loaded.values())


def reference_weight(qt: QuantizedTensor) -> np.ndarray:
    """Dequantize every segment with the numpy reference and undo the permutation."""
    cols = [dequantize_ref(w, s, b, bits, g) for (w, s, b), bits, g in zip(qt.parts, qt.bits, qt.group_sizes)]
    full = np.concatenate(cols, axis=-1).astype(np.float32)
    if qt.perm is not None:
        full = full[..., np.argsort(qt.perm.astype(np.int64))]
    return full


# ----------------------------------------------------------------- packing
@pytest.mark.parametrize("bits,group", BITS_GROUPS)
def test_reference_is_bit_exact_with_mlx(bits: int, group: int) -> None:
    w = heavy_tailed((48, 384), seed=bits * group).astype(mx.float16)
    packed, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    codes = unpack_codes(packed, bits, 384)
    assert codes.max() <= (1 << bits) - 1
    assert np.array_equal(pack_codes(codes, bits), np.array(packed))
    ref = dequantize_ref(packed, scales, biases, bits, group)
    got = np.array(mx.dequantize(packed, scales, biases, group_size=group, bits=bits))
    assert ref.dtype == np.float16
    assert np.array_equal(ref.view(np.uint16), got.view(np.uint16))


@pytest.mark.parametrize("bits", VALID_BITS)
def test_pack_codes_is_what_mlx_unpacks(bits: int) -> None:
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(5, 256))
    packed = mx.array(pack_codes(codes, bits))
    ones = mx.ones((5, 256 // 32), dtype=mx.float32)
    back = mx.dequantize(packed, ones, mx.zeros_like(ones), group_size=32, bits=bits)
    assert np.array_equal(np.array(back).astype(np.int64), codes)


@pytest.mark.parametrize("bits", VALID_BITS)
def test_pack_codes_mx_gives_the_reference_words(bits: int) -> None:
    """The MLX packer writes the numpy reference's words, for every width, leading axes and codes at both ends."""
    rng = np.random.default_rng(10 + bits)
    codes = rng.integers(0, 1 << bits, size=(3, 4, 192)).astype(np.uint8)
    codes[0, 0] = (1 << bits) - 1  # every bit set: a code crossing a word boundary must land in both words
    codes[0, 1] = 0
    got = pack_codes_mx(codes, bits)
    assert got.dtype == mx.uint32 and got.shape == (3, 4, 192 * bits // 32)
    assert np.array_equal(np.array(got), pack_codes(codes, bits))
    assert np.array_equal(np.array(pack_codes_mx(mx.array(codes.astype(np.float32)), bits)), pack_codes(codes, bits))
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_codes_mx(codes[..., :40], bits)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32])
def test_reference_matches_other_scale_dtypes(dtype: mx.Dtype) -> None:
    w = heavy_tailed((32, 256), seed=3).astype(dtype)
    for bits in (3, 4, 6):
        packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
        got = np.array(mx.dequantize(packed, scales, biases, group_size=64, bits=bits).astype(mx.float32))
        assert np.array_equal(dequantize_ref(packed, scales, biases, bits, 64).astype(np.float32), got)


def test_pack_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_codes(np.zeros((2, 40), dtype=np.uint8), 4)
    with pytest.raises(ValueError, match="do not fit in 2 bits"):
        pack_codes(np.full((2, 32), 4, dtype=np.uint8), 2)
    with pytest.raises(ValueError, match="do not hold"):
        unpack_codes(np.zeros((2, 3), dtype=np.uint32), 4, 32)


# -------------------------------------------------------------- round trips
def _check_round_trip(qt: QuantizedTensor, tmp_path) -> None:
    back, nbytes = save_load(qt, tmp_path / "t.safetensors")
    assert qt.option.storage_bits(qt.shape) == 8 * nbytes == 8 * qt.nbytes()
    ref = reference_weight(back)
    got = np.array(back.dequantize())
    assert got.shape == qt.shape
    assert np.array_equal(ref, got)
    assert np.array_equal(got, np.array(qt.dequantize()))


@pytest.mark.parametrize("bits,group", BITS_GROUPS)
def test_round_trip_uniform(bits: int, group: int, tmp_path) -> None:
    in_f = 1536 if group == 128 else 576
    w = heavy_tailed((40, in_f), seed=bits + group)
    gram, _ = random_gram(in_f, n=64)
    qt = quantize_weight(w, QuantOption.uniform(bits, group), gram=gram)
    assert qt.perm is None and len(qt.parts) == 1
    _check_round_trip(qt, tmp_path)


def _random_option(rng: np.random.Generator, n_seg: int) -> QuantOption:
    bits = sorted(rng.choice(VALID_BITS, size=n_seg, replace=False).tolist(), reverse=True)
    props = rng.dirichlet(np.ones(n_seg))
    props = np.maximum(np.round(props, 3), 0.001)
    props[-1] = 1.0 - props[:-1].sum()
    return QuantOption(tuple(Segment(int(b), int(rng.choice(VALID_GROUPS)), float(p)) for b, p in zip(bits, props)))


MIXED_CASES = [(n_seg, shape, seed) for seed, (n_seg, shape) in enumerate(
    itertools.product((2, 3), [(24, 576), (16, 1536), (8, 4096), (3, 16, 768)])
)]


@pytest.mark.parametrize("n_seg,shape,seed", MIXED_CASES)
def test_round_trip_mixed(n_seg: int, shape: tuple[int, ...], seed: int, tmp_path) -> None:
    rng = np.random.default_rng(seed)
    opt = _random_option(rng, n_seg)
    while not opt.fits(shape[-1]):
        opt = _random_option(rng, n_seg)
    w = heavy_tailed(shape, seed=seed)
    gram, _ = random_gram(shape[-1], n=64, seed=seed)
    qt = quantize_weight(w, opt, gram=gram)
    assert qt.perm is not None and qt.perm.dtype == np.uint16
    assert sum(qt.widths) == shape[-1] and qt.widths == [k for k in opt.split(shape[-1]) if k]
    _check_round_trip(qt, tmp_path)


def test_round_trip_keep16(tmp_path) -> None:
    w = heavy_tailed((8, 64))
    qt = quantize_weight(w, QuantOption.fp16())
    back, nbytes = save_load(qt, tmp_path / "k.safetensors")
    assert 8 * nbytes == QuantOption.fp16().storage_bits(qt.shape)
    assert np.array_equal(np.array(back.dequantize()), np.array(w.astype(mx.float16).astype(mx.float32)))


# ---------------------------------------------------------------- semantics
@pytest.mark.parametrize("desc", ["1.0:3b_64g", "0.3:5b_32g/0.7:3b_64g"])
def test_without_clip_parts_equal_mx_quantize(desc: str) -> None:
    opt = QuantOption.parse(desc)
    w = heavy_tailed((32, 576), seed=7)
    gram, _ = random_gram(576, n=64)
    qt = quantize_weight(w, opt, gram=gram, clip=False)
    order = qt.perm.astype(np.int64) if qt.perm is not None else np.arange(576)
    wp = mx.take(w, mx.array(order.astype(np.int32)), axis=-1).astype(mx.float16)
    start = 0
    for (p, s, b), k, bits, g in zip(qt.parts, qt.widths, qt.bits, qt.group_sizes):
        ep, es, eb = mx.quantize(wp[:, start : start + k], group_size=g, bits=bits)
        assert np.array_equal(np.array(p), np.array(ep))
        assert np.array_equal(np.array(s), np.array(es)) and np.array_equal(np.array(b), np.array(eb))
        start += k
    assert qt.stats == {}


def test_act_order_follows_gram_energy() -> None:
    rng = np.random.default_rng(0)
    energy = rng.permutation(np.arange(1, 65)).astype(np.float32)
    gram = mx.array(np.diag(energy))
    assert np.array_equal(act_order(64, gram), np.argsort(-energy))
    assert np.array_equal(act_order(64, None), np.arange(64))
    qt = quantize_weight(heavy_tailed((8, 64)), QuantOption.parse("0.5:4b_32g/0.5:2b_32g"), gram=gram)
    assert np.array_equal(qt.perm, np.argsort(-energy))
    qt = quantize_weight(heavy_tailed((8, 64)), QuantOption.parse("0.5:4b_32g/0.5:2b_32g"))
    assert np.array_equal(qt.perm, np.arange(64))


def test_codes_are_nearest_for_stored_scales() -> None:
    w = heavy_tailed((16, 256), seed=5)
    qt = quantize_weight(w, QuantOption.uniform(3, 32))
    (p, s, b), = qt.parts
    codes = unpack_codes(p, 3, 256).astype(np.float32)
    sg = np.repeat(np.array(s).astype(np.float32), 32, -1)
    bg = np.repeat(np.array(b).astype(np.float32), 32, -1)
    w16 = np.array(w.astype(mx.float16)).astype(np.float32)
    levels = sg[..., None] * np.arange(8, dtype=np.float32) + bg[..., None]
    best = np.abs(levels - w16[..., None]).min(-1)
    chosen = np.abs(sg * codes + bg - w16)
    assert np.all(chosen <= best + 1e-6)


def _block_error(w: mx.array, wq: mx.array, gram: mx.array, group: int) -> float:
    """Sum over groups of e^T G_gg e: the quantity the block clip search minimises."""
    e = np.array(wq) - np.array(w)
    g = np.array(gram)
    total = 0.0
    for j in range(0, e.shape[-1], group):
        ej = e[:, j : j + group]
        total += float(np.einsum("ri,ij,rj->", ej, g[j : j + group, j : j + group], ej))
    return total


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_clip_search_never_increases_its_error(bits: int) -> None:
    w = heavy_tailed((64, 256), seed=bits)
    gram, _ = random_gram(256, n=128, seed=bits)
    opt = QuantOption.uniform(bits, 64)
    plain = quantize_weight(w, opt, clip=False).dequantize()
    clipped = quantize_weight(w, opt).dequantize()
    e_plain, e_clip = weight_error(w, plain), weight_error(w, clipped)
    assert e_clip <= e_plain * (1 + 1e-6)
    weighted = quantize_weight(w, opt, gram=gram)
    assert weighted.stats["clip_metric"] == "block"
    b_plain = _block_error(w, plain, gram, 64)
    b_clip = _block_error(w, weighted.dequantize(), gram, 64)
    assert b_clip <= b_plain * (1 + 1e-6)
    diag = np.diag(np.array(gram))
    d_plain = float((diag * (np.array(plain) - np.array(w)) ** 2).sum())
    d_clip_w = quantize_weight(w, opt, gram=gram, clip_metric="diag").dequantize()
    assert float((diag * (np.array(d_clip_w) - np.array(w)) ** 2).sum()) <= d_plain * (1 + 1e-6)
    if bits <= 3:  # heavy tails: shrinking the range must pay off
        assert e_clip < 0.95 * e_plain and b_clip < 0.95 * b_plain
        assert 0.0 < weighted.stats["clipped_fraction"] < 0.5
        assert weighted.stats["clip_improvement"] > 0.05
        assert abs(weighted.stats["clip_improvement"] - (1 - b_clip / b_plain)) < 0.02


def test_clip_search_lowers_output_error_with_gram() -> None:
    w = heavy_tailed((64, 512), seed=11)
    gram, _ = random_gram(512, n=256, seed=11)
    opt = QuantOption.uniform(3, 64)
    plain = output_error(w, quantize_weight(w, opt, clip=False).dequantize(), gram)
    for metric in ("block", "diag"):
        got = output_error(w, quantize_weight(w, opt, gram=gram, clip_metric=metric).dequantize(), gram)
        assert got < plain


def test_expert_bank_with_shared_and_per_expert_gram(tmp_path) -> None:
    w = heavy_tailed((4, 32, 256), seed=2)
    shared, _ = random_gram(256, n=64)
    per = mx.stack([random_gram(256, n=64, seed=s)[0] for s in range(4)])
    opt = QuantOption.parse("0.25:4b_64g/0.75:2b_64g")
    for gram in (shared, per):
        qt = quantize_weight(w, opt, gram=gram)
        assert qt.parts[0][0].shape[:2] == (4, 32)
        _check_round_trip(qt, tmp_path)
        plain = quantize_weight(w, opt, gram=gram, clip=False)
        assert output_error(w, qt.dequantize(), gram) < output_error(w, plain.dequantize(), gram)
    expect = np.argsort(-np.array(mx.diagonal(per, axis1=1, axis2=2).sum(0)), kind="stable")
    assert np.array_equal(quantize_weight(w, opt, gram=per).perm, expect)


def test_bad_inputs_are_named() -> None:
    w = heavy_tailed((8, 64))
    with pytest.raises(ValueError, match="gram shape"):
        quantize_weight(w, QuantOption.uniform(4, 32), gram=mx.eye(32))
    with pytest.raises(ValueError, match="clip metric"):
        quantize_weight(w, QuantOption.uniform(4, 32), clip_metric="fro")
    with pytest.raises(ValueError, match="in_features=64"):
        quantize_weight(w, QuantOption.uniform(4, 128))
    with pytest.raises(ValueError, match="weight must be"):
        quantize_weight(mx.zeros((64,)), QuantOption.uniform(4, 32))
    with pytest.raises(ValueError, match="clip rules"):
        clip_search(w.reshape(1, 8, 2, 32), 4, rules=("median",))


# ------------------------------------------------------------ error measures
def test_output_error_equals_direct_computation() -> None:
    rng = np.random.default_rng(4)
    w = heavy_tailed((48, 128), seed=4)
    wq = quantize_weight(w, QuantOption.uniform(3, 32)).dequantize()
    x = rng.standard_normal((300, 128)).astype(np.float32) * rng.lognormal(0, 1, 128).astype(np.float32)
    gram = mx.array(x.T.astype(np.float64) @ x.astype(np.float64))
    direct = np.linalg.norm(x @ (np.array(wq) - np.array(w)).T) / np.linalg.norm(x @ np.array(w).T)
    assert abs(output_error(w, wq, gram) - direct) < 1e-4 * direct
    # expert banks with one Gram matrix per expert
    wb = heavy_tailed((3, 16, 64), seed=9)
    wbq = quantize_weight(wb, QuantOption.uniform(2, 32)).dequantize()
    xs = [rng.standard_normal((100, 64)).astype(np.float32) for _ in range(3)]
    grams = mx.array(np.stack([xi.T @ xi for xi in xs]))
    num = sum(np.linalg.norm(xi @ (np.array(wbq[i]) - np.array(wb[i])).T) ** 2 for i, xi in enumerate(xs))
    den = sum(np.linalg.norm(xi @ np.array(wb[i]).T) ** 2 for i, xi in enumerate(xs))
    assert abs(output_error(wb, wbq, grams) - np.sqrt(num / den)) < 1e-4 * np.sqrt(num / den)


def test_weight_error_is_relative_frobenius() -> None:
    w = mx.array(np.array([[3.0, 4.0]], dtype=np.float32))
    assert weight_error(w, w) == 0.0
    assert abs(weight_error(w, mx.array(np.array([[3.0, 4.5]], dtype=np.float32))) - 0.1) < 1e-7


@pytest.mark.parametrize("bits", VALID_BITS)
def test_clip_search_without_factors_is_mx_quantize(bits: int) -> None:
    w = heavy_tailed((32, 256), seed=bits).astype(mx.float16)
    res = clip_search(w.astype(mx.float32).reshape(1, 32, 4, 64), bits, factors=())
    packed, scales, biases = mx.quantize(w, group_size=64, bits=bits)
    assert np.array_equal(np.array(res.codes).reshape(32, 256), unpack_codes(packed, bits, 256))
    assert np.array_equal(np.array(res.scales)[0], np.array(scales))
    assert np.array_equal(np.array(res.biases)[0], np.array(biases))
    assert float(res.factor.max()) == 0.0 and res.clipped == 0


def test_codes_round_against_given_scales() -> None:
    w = heavy_tailed((4, 64), seed=3).reshape(4, 2, 32)
    scales = mx.full((4, 2), 0.01, dtype=mx.float16)
    biases = mx.full((4, 2), -0.05, dtype=mx.float16)
    q = np.array(storage.codes(w, scales[..., None], biases[..., None], 15))
    expect = np.clip(np.rint((np.array(w) + 0.05) / np.float32(np.float16(0.01))), 0, 15)
    assert np.array_equal(q, expect)


def test_clip_search_reproduces_an_existing_min_max_grid() -> None:
    """Weights already on a 4-bit min/max grid (as in Q4_1 GGUF files) come back exactly."""
    rng = np.random.default_rng(8)
    q = rng.integers(0, 16, size=(16, 8, 32))
    q[..., 0], q[..., 1] = 0, 15
    d = rng.uniform(0.001, 0.01, size=(16, 8, 1)).astype(np.float16).astype(np.float32)
    m = -rng.uniform(0.0, 0.1, size=(16, 8, 1)).astype(np.float16).astype(np.float32)
    w = mx.array((m + d * q).reshape(16, 256).astype(np.float16).astype(np.float32))
    plain = weight_error(w, quantize_weight(w, QuantOption.uniform(4, 32), clip=False).dequantize())
    searched = weight_error(w, quantize_weight(w, QuantOption.uniform(4, 32)).dequantize())
    assert plain > 1e-2 and searched < 0.02 * plain  # exact up to fp16 rounding of the grid itself


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_float32_rounding_matches_casts(dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([rng.standard_t(4, 20000) * 0.02, rng.uniform(-1e-4, 1e-4, 20000), rng.uniform(-6e4, 6e4, 2000)])
    x = mx.array(x.astype(np.float32))
    expect = np.array(x.astype(dtype).astype(mx.float32))
    assert np.array_equal(np.array(storage.round_to(x, dtype)), expect)
    assert np.array_equal(np.array(mx.compile(lambda a: storage.round_to(a, dtype))(x)), expect)


# ------------------------------------------------------------- real weights
def _gguf_weight(path, name: str) -> mx.array:
    """A float32 weight from the bundled Q4_1 GGUF (MLX reads it as affine 4-bit group 32)."""
    t = mx.load(str(path))
    return mx.dequantize(t[f"{name}.weight"], t[f"{name}.scales"], t[f"{name}.biases"], group_size=32, bits=4).astype(
        mx.float32
    )


@pytest.mark.slow
def test_real_weights_clip_gain_and_grid_order(bundled_gguf) -> None:
    from mlx_dq.measure.grids import load_grid

    down = _gguf_weight(bundled_gguf, "blk.3.ffn_down")  # [576, 1536]
    for bits in (2, 3):
        opt = QuantOption.uniform(bits, 64)
        plain = weight_error(down, quantize_weight(down, opt, clip=False).dequantize())
        clipped = weight_error(down, quantize_weight(down, opt).dequantize())
        assert clipped < 0.9 * plain, (bits, plain, clipped)
    errs = [(o.bpw(down.shape), weight_error(down, quantize_weight(down, o).dequantize())) for o in load_grid()["mlp_out"]]
    errs.sort()
    assert all(b[1] < a[1] for a, b in zip(errs, errs[1:])), errs


def test_bfloat16_scales_round_trip(tmp_path) -> None:
    w = heavy_tailed((16, 576), seed=12)
    gram, _ = random_gram(576, n=64)
    opt = QuantOption.parse("0.25:6b_64g/0.75:3b_32g")
    qt = quantize_weight(w, opt, gram=gram, scale_dtype=mx.bfloat16)
    assert all(s.dtype == mx.bfloat16 and b.dtype == mx.bfloat16 for _, s, b in qt.parts)
    back, nbytes = save_load(qt, tmp_path / "bf.safetensors")
    assert 8 * nbytes == opt.storage_bits(qt.shape)
    assert np.array_equal(reference_weight(back), np.array(back.dequantize()))
    plain = quantize_weight(w, opt, gram=gram, clip=False, scale_dtype=mx.bfloat16)
    assert output_error(w, qt.dequantize(), gram) < output_error(w, plain.dequantize(), gram)


def test_error_sums_stay_exact_beyond_float32_running_sums():
    """Sums of millions of terms (a head's row block, a layer's outputs) are taken by rows, then in double
    precision: MLX's CPU full reduction keeps one float32 running sum, which stops at 2^24 times a term."""
    from mlx_dq.quant.affine import exact_sums, output_error_sums

    ones = mx.ones((2000, 10000))
    assert exact_sums(ones, 2 * ones) == (20_000_000.0, 40_000_000.0)
    w = mx.random.normal((2048, 8192), key=mx.random.key(7))
    wq = w + 0.01
    num, den = output_error_sums(w, wq, mx.eye(8192))
    w64 = np.asarray(w, dtype=np.float64)
    d64 = np.asarray(wq, dtype=np.float64) - w64
    assert num == pytest.approx(float((d64 * d64).sum()), rel=1e-5)
    assert den == pytest.approx(float((w64 * w64).sum()), rel=1e-5)
    assert weight_error(w, wq) == pytest.approx(math.sqrt(float((d64 * d64).sum() / (w64 * w64).sum())), rel=1e-5)


@pytest.mark.parametrize("desc", ["1.0:3b_64g", "0.25:4b_32g/0.75:3b_64g"])
def test_large_tensors_dequantize_by_row_blocks_to_the_same_values(desc, monkeypatch):
    """Above DEQUANT_BLOCK_WEIGHTS a tensor is dequantized a block of rows at a time into one array: the same
    values as in one piece, for uniform and mixed (permuted) tensors, with less memory at its peak."""
    from mlx_dq.quant import affine as quant_mod

    rng = np.random.default_rng(11)
    w = mx.array(rng.standard_normal((200, 256)).astype(np.float32))
    x = rng.standard_normal((300, 256)).astype(np.float32) * np.linspace(0.1, 3, 256, dtype=np.float32)
    qt = quant_mod.quantize_weight(w, QuantOption.parse(desc), gram=mx.array(x.T @ x))
    mx.eval([a for p in qt.parts for a in p])
    peaks = []
    for weights in (None, 256 * 30):  # whole; 30 rows at a time, a ragged last block
        if weights:
            monkeypatch.setattr(quant_mod, "DEQUANT_BLOCK_WEIGHTS", weights)
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        out = qt.dequantize(mx.float16)
        mx.eval(out)
        peaks.append(mx.get_peak_memory() - base)
        if weights is None:
            whole = out
    assert out.dtype == mx.float16 and mx.array_equal(out, whole).item()
    assert peaks[1] < 0.6 * peaks[0], peaks
    assert mx.array_equal(qt.dequantize(mx.float32), whole.astype(mx.float32)).item()


@pytest.mark.parametrize("desc", ["1.0:3b_64g", "0.25:4b_32g/0.75:3b_64g"])
def test_sampled_rows_of_a_quantized_tensor_dequantize_alone(desc):
    """``rows`` with an array of row indices takes those rows' codes (and known row errors): dequantized alone they
    equal the same rows of the whole tensor, so a meter reading a row sample need not dequantize every row."""
    from mlx_dq.quant.gptq import gptq_quantize

    rng = np.random.default_rng(12)
    w = mx.array(rng.standard_normal((120, 256)).astype(np.float32))
    x = rng.standard_normal((300, 256)).astype(np.float32)
    qt = gptq_quantize(w, QuantOption.parse(desc), mx.array(x.T @ x))
    assert qt.out_sq is not None
    idx = np.array([0, 7, 8, 50, 119], dtype=np.int32)
    part = qt.rows(mx.array(idx))
    assert part.shape == (5, 256)
    assert mx.array_equal(part.dequantize(), qt.dequantize()[mx.array(idx)]).item()
    np.testing.assert_array_equal(part.out_sq, qt.out_sq[idx])
