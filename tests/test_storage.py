"""MLX affine storage arithmetic in one module: every former copy's path equals storage's bit for bit, and
storage agrees with MLX's own ``mx.quantize`` / ``mx.dequantize`` where MLX is the definition."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from storage_reference import codes_f16, dequant_f16

from mlx_dq.quant import scale_search, storage
from mlx_dq.quant.options import VALID_BITS, VALID_GROUPS

BITS_GROUPS = list(itertools.product(VALID_BITS, VALID_GROUPS))


def _weights(bits: int, group: int, rows: int = 24, cols: int = 256) -> mx.array:
    rng = np.random.default_rng(bits * 1000 + group)
    w = (rng.standard_t(3, size=(rows, cols)) * 0.02).astype(np.float32)
    w[0, :group] = 0.0  # an all-zero group: scale 0
    w[1, :group] = 1e-6 * rng.standard_normal(group)  # float16 subnormal values
    return mx.array(w).astype(mx.float16)


# the copies the storage module replaced, as they were written
def _affine_codes(w, scales, biases, bits):
    s = scales.astype(mx.float32)[..., None]
    b = biases.astype(mx.float32)[..., None]
    safe = mx.where(s == 0, 1.0, s)
    q = mx.clip(mx.round((w - b) / safe), 0, (1 << bits) - 1)
    return mx.where(s == 0, 0.0, q)


def _level_codes(w, bias, code_scale, n_bins):
    return storage.clipped_rint((w - bias[..., None]) / code_scale[..., None], n_bins)


def _clip_search_codes(w, best_b, best_cs, n_bins):
    return mx.clip(mx.round((w - best_b.astype(mx.float32)[..., None]) / best_cs[..., None]), 0.0, n_bins)


def _candidate_codes(w, s16, b16, n_bins):
    s = s16.astype(mx.float32)
    b = b16.astype(mx.float32)[..., None]
    keep = (s != 0).astype(mx.float32)[..., None]
    return storage.clipped_rint((w - b) / mx.where(s == 0, 1.0, s)[..., None], n_bins) * keep


def _round_f16(x, tmp, tmp2):
    np.multiply(x, np.float32(2**13 + 1), out=tmp)
    np.subtract(tmp, x, out=tmp2)
    return np.subtract(tmp, tmp2, out=x)


def _bf16_round(x):
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    return u.astype(np.uint32).view(np.float32)


def _dequantize_ref(q, s, b, kind):
    if kind == "bfloat16":
        return _bf16_round(_bf16_round(s * q.astype(np.float32)) + b)
    return s * q.astype(s.dtype) + b


def _same(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, equal_nan=True)


@pytest.mark.parametrize("bits,group", BITS_GROUPS)
def test_codes_and_packing_equal_every_former_copy_and_mlx(bits: int, group: int) -> None:
    w16 = _weights(bits, group)
    packed, s, b = mx.quantize(w16, group_size=group, bits=bits)
    wg = w16.astype(mx.float32).reshape(w16.shape[0], -1, group)
    q_mlx = storage.unpack_codes(packed, bits, w16.shape[-1]).reshape(wg.shape)
    q_max = (1 << bits) - 1
    q = storage.codes(wg, s[..., None], b[..., None], q_max)
    assert _same(q, _affine_codes(wg, s, b, bits))
    scale32, _ = storage.affine_params(wg.min(-1), wg.max(-1), bits)  # MLX rounds against its float32 scale
    mlx_codes = storage.codes(wg, scale32[..., None], b[..., None], float(q_max), zero_scales="divide")
    assert np.array_equal(np.array(mlx_codes), q_mlx)
    s32, b32 = s.astype(mx.float32), b.astype(mx.float32)
    nonzero = mx.where(s32 == 0, 1.0, s32)  # the callers that divide as is never see a zero scale
    for rounding in ("round", "shift"):
        got = storage.codes(wg, nonzero[..., None], b32[..., None], float(q_max), zero_scales="divide",
                            rounding=rounding)
        assert _same(got, _level_codes(wg, b32, nonzero, float(q_max)))
        assert _same(got, _clip_search_codes(wg, b, nonzero, float(q_max)))
    n_bins = mx.array(float(q_max))
    got = storage.codes(wg, s32[..., None], b32[..., None], n_bins, zero_scales="ignore", rounding="shift")
    assert _same(got * (s32 != 0).astype(mx.float32)[..., None], _candidate_codes(wg, s, b, n_bins))
    assert _same(scale_search._codes(wg, s, b, n_bins), _candidate_codes(wg, s, b, n_bins))
    wn, sn, bn = np.array(wg), np.array(s32)[..., None], np.array(b32)[..., None]
    assert _same(storage.codes(wn, sn, bn, q_max), codes_f16(wn, sn, bn, bits))
    out, raw = np.empty_like(wn), np.empty_like(wn)
    assert _same(storage.codes(wn, sn, bn, float(q_max), out=out, raw=raw), codes_f16(wn, sn, bn, bits))
    codes = q_mlx.reshape(w16.shape)
    assert np.array_equal(storage.pack_codes(codes, bits), np.array(packed))
    assert np.array_equal(np.array(storage.pack_codes_mx(codes, bits)), np.array(packed))


@pytest.mark.parametrize("bits,group", BITS_GROUPS)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_dequantization_equals_every_former_copy_and_mlx(bits: int, group: int, dtype) -> None:
    w = _weights(bits, group).astype(dtype)
    packed, s, b = mx.quantize(w, group_size=group, bits=bits)
    want = mx.dequantize(packed, s, b, group_size=group, bits=bits).astype(mx.float32)
    k = w.shape[-1]
    q = storage.unpack_codes(packed, bits, k).astype(np.float32)
    ref = storage.dequantize_ref(packed, s, b, bits, group)
    assert np.array_equal(np.asarray(ref, dtype=np.float32), np.array(want))
    sg, bg = mx.repeat(s, group, axis=-1).astype(mx.float32), mx.repeat(b, group, axis=-1).astype(mx.float32)
    got = storage.dequantize(mx.array(q), sg, bg, dtype)
    assert np.array_equal(np.array(got), np.array(want))
    assert _same(got, storage.round_to(storage.round_to(sg * mx.array(q), dtype) + bg, dtype))
    kind = "float16" if dtype == mx.float16 else "bfloat16"
    s_np = np.array(s.astype(mx.float32)) if kind == "bfloat16" else np.array(s)
    b_np = np.array(b.astype(mx.float32)) if kind == "bfloat16" else np.array(b)
    sn, bn = np.repeat(s_np, group, axis=-1), np.repeat(b_np, group, axis=-1)
    assert _same(ref, _dequantize_ref(q.astype(np.uint16), sn, bn, kind))
    if kind == "float16":
        s32, b32 = sn.astype(np.float32), bn.astype(np.float32)
        assert _same(storage.dequantize(q, s32, b32, np.float16), dequant_f16(q, s32, b32))
        out, scratch = np.empty_like(q), (np.empty_like(q), np.empty_like(q))
        fast = storage.dequantize(q, s32, b32, "float16", out=out, scratch=scratch)
        t1, t2 = np.empty_like(q), np.empty_like(q)
        old = _round_f16(np.multiply(s32, q, out=np.empty_like(q)), t1, t2)
        old = _round_f16(np.add(old, b32, out=old), t1, t2)
        assert _same(fast, old) and _same(fast, dequant_f16(q, s32, b32))


def test_affine_params_are_mlxs_rule() -> None:
    w = _weights(4, 64).astype(mx.float32).reshape(24, -1, 64)
    s, b = storage.affine_params(w.min(-1), w.max(-1), 4)
    _, ms, mb = mx.quantize(w.reshape(24, -1).astype(mx.float16), group_size=64, bits=4)
    assert np.array_equal(np.array(s.astype(mx.float16)), np.array(ms))
    assert np.array_equal(np.array(b.astype(mx.float16)), np.array(mb))


def test_bad_forms_are_refused() -> None:
    with pytest.raises(ValueError, match="zero_scales"):
        storage.codes(mx.zeros((2, 4)), mx.ones((2, 1)), mx.zeros((2, 1)), 3, zero_scales="skip")
