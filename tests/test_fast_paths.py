"""The fast paths of the quantizers equal their straightforward reference forms on random data.

The references below are the plain formulations (``mx.round`` rounding, the
dequantized value computed per weight, the GPTQ column step through
``codes_f16`` / ``dequant_f16`` from storage_reference.py, numpy's conversions); the fast paths
must give bit-identical codes, scales, biases and errors.
"""

from __future__ import annotations

from functools import partial

import mlx.core as mx
import numpy as np
import pytest
from storage_reference import codes_f16, dequant_f16

import mlx_dq.quant.scale_search as quant
from mlx_dq.quant import scale_search as gptq
from mlx_dq.quant import storage
from mlx_dq.quant.affine import act_order
from mlx_dq.quant.gptq_core import gptq_core, group_layout
from mlx_dq.quant.hessian import factor_hessian
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.scale_search import choose_group_params, clip_search, gram_weights
from mlx_dq.quant.spec import QuantizerSpec
from mlx_dq.quant.storage import clipped_rint


def test_clipped_rint_equals_clipped_round() -> None:
    rng = np.random.default_rng(0)
    x = np.concatenate([
        rng.uniform(-20, 300, 20000),
        np.arange(-10, 270) + 0.5,  # ties go to the even integer
        np.arange(-10, 270) - 0.5,
        [2.0**22 - 0.5, 2.0**22, 2.0**23 + 3, 1e30, -1e30, -2.0**22, -2.0**22 - 1, 0.0, -0.0, np.inf, -np.inf],
    ]).astype(np.float32)
    for n_bins in (3.0, 7.0, 255.0):
        got = np.array(clipped_rint(mx.array(x), n_bins))
        want = np.array(mx.clip(mx.round(mx.array(x)), 0.0, n_bins))
        assert np.array_equal(got, want)
    nan = np.array(clipped_rint(mx.array(np.array([np.nan], np.float32)), 7.0))
    assert np.isnan(nan).all()


def _reference_candidate_error(w, target, scale, bias, code_scale, weight, n_bins, dtype, metric):
    """The per-weight formulation: codes by mx.round, both roundings applied to every weight."""
    s, b = scale[..., None], bias[..., None]
    q = mx.clip(mx.round((w - b) / code_scale[..., None]), 0.0, n_bins)
    deq = storage.round_to(storage.round_to(s * q, dtype) + b, dtype)
    return quant._group_error(deq - target, weight, metric)


def _reference_error_fn(n_bins, dtype, metric, weighted, group_size=None):
    fn = partial(_reference_candidate_error, n_bins=n_bins, dtype=dtype, metric=metric)
    if weighted:
        return lambda w, t, s, b, cs, wt: fn(w, t, s, b, cs, wt)
    return lambda w, t, s, b, cs: fn(w, t, s, b, cs, None)


CLIP_CASES = [(bits, g, metric, weighted, dtype)
              for bits, g in [(2, 32), (3, 64), (4, 32), (4, 128), (5, 64), (8, 64)]
              for metric, weighted in [("diag", True), ("block", True), ("diag", False)]
              for dtype in [mx.float16, mx.bfloat16]]


def _reference_clip_search(w, bits, target, weight, metric, dtype, factors=quant.DEFAULT_CLIP_FACTORS,
                           rules=quant.CLIP_RULES):
    """clip_search as a loop over candidates, one evaluation each, per-weight error (the plain form)."""
    n_bins = float((1 << bits) - 1)
    err_fn = _reference_error_fn(n_bins, dtype, metric, weight is not None)
    extra = () if weight is None else (weight,)
    wmin, wmax = w.min(-1), w.max(-1)
    scale, bias = storage.affine_params(wmin, wmax, bits)
    best_s, best_b, best_cs = scale.astype(dtype), bias.astype(dtype), scale
    base_err = err_fn(w, target, best_s.astype(mx.float32), best_b.astype(mx.float32), best_cs, *extra)
    best_err, best_f, best_lo, best_hi = base_err, mx.zeros_like(base_err), wmin, wmax
    for f in factors:
        for rule in rules:
            lo = mx.where(wmin < 0, wmin * f, wmin).astype(dtype).astype(mx.float32)
            hi = mx.where(wmax > 0, wmax * f, wmax).astype(dtype).astype(mx.float32)
            if rule == "edge":
                s, b = storage.affine_params(lo, hi, bits)
            else:
                s, b = mx.maximum((hi - lo) / n_bins, storage.EPS), lo
            s, b = s.astype(dtype), b.astype(dtype)
            sf = s.astype(mx.float32)
            err = err_fn(w, target, sf, b.astype(mx.float32), sf, *extra)
            better = err < best_err
            best_s, best_b = mx.where(better, s, best_s), mx.where(better, b, best_b)
            best_cs = mx.where(better, sf, best_cs)
            best_err, best_f = mx.where(better, err, best_err), mx.where(better, f, best_f)
            best_lo, best_hi = mx.where(better, lo, best_lo), mx.where(better, hi, best_hi)
            mx.eval(best_s, best_b, best_cs, best_err, best_f, best_lo, best_hi)
    codes = mx.clip(mx.round((w - best_b.astype(mx.float32)[..., None]) / best_cs[..., None]), 0.0, n_bins)
    outside = (w < best_lo[..., None]) | (w > best_hi[..., None])
    return quant.ClipResult(best_s, best_b, codes, best_f, best_err, base_err, int(outside.sum().item()))


@pytest.mark.parametrize("bits,g,metric,weighted,dtype", CLIP_CASES)
def test_clip_search_equals_reference(bits, g, metric, weighted, dtype, monkeypatch) -> None:
    rng = np.random.default_rng(bits * 1000 + g)
    rows, groups = 48, 3
    w = (rng.standard_t(3, size=(1, rows, groups, g)) * 0.02).astype(np.float32)
    w[0, 0, 0] = 1e-6 * rng.standard_normal(g)  # tiny group: float16 subnormal values
    w[0, 1, 1] = 0.01  # constant group
    x = rng.standard_normal((4 * groups * g, groups * g)).astype(np.float32) * np.exp(rng.standard_normal(groups * g))
    weight = gram_weights(mx.array((x.T @ x)[None]), g, metric) if weighted else None
    target = mx.array(w)
    wd = target.astype(dtype).astype(mx.float32)
    monkeypatch.setattr(quant, "BATCH_ELEMENTS", 5000)  # several row chunks
    fast = clip_search(wd, bits, target=target, weight=weight, metric=metric, dtype=dtype)
    ref = _reference_clip_search(wd, bits, target=target, weight=weight, metric=metric, dtype=dtype)
    for name in ("scales", "biases", "codes", "factor", "err", "base_err"):
        assert mx.array_equal(getattr(fast, name), getattr(ref, name)).item(), name
    assert fast.clipped == ref.clipped


def test_refine_candidate_error_equals_reference() -> None:
    rng = np.random.default_rng(3)
    w = mx.array((rng.standard_normal((2, 40, 4, 64)) * 0.05).astype(np.float32))
    wt = mx.array(rng.random((1, 1, 4, 64)).astype(np.float32))
    s = mx.array((rng.random((2, 40, 4)) * 0.02).astype(np.float16))
    s = mx.where(mx.array(rng.random((2, 40, 4)) < 0.1), mx.array(0.0, mx.float16), s)  # some zero scales
    b = mx.array((-rng.random((2, 40, 4)) * 0.1).astype(np.float16))
    for bits in (2, 4, 8):
        n_bins = float((1 << bits) - 1)
        q = gptq._codes(w, s, b, mx.array(n_bins))
        err = gptq._candidate_error_only(w, wt, s, b, mx.array(n_bins))
        s32, b32 = s.astype(mx.float32)[..., None], b.astype(mx.float32)[..., None]
        q_ref = mx.clip(mx.round((w - b32) / mx.where(s32 == 0, 1.0, s32)), 0, n_bins)
        q_ref = mx.where(s32 == 0, 0.0, q_ref)
        e = s32 * q_ref + b32 - w
        assert mx.array_equal(q, q_ref).item()
        assert mx.array_equal(err, (e * e * wt).sum(-1)).item()


def _reference_gptq_core(w, gram, option, order, *, static_groups, process_order=None, block_size=128):
    """GPTQ's column loop in its plain form (the codes and values from codes_f16 / dequant_f16 per column)."""
    w = np.asarray(w, dtype=np.float32)
    nb, rows, k = w.shape
    groups = group_layout(option, k)
    gid = np.empty(k, dtype=np.int64)
    for i, (g0, gs, _) in enumerate(groups):
        gid[g0:g0 + gs] = i
    g_bits = np.array([b for _, _, b in groups])
    q_max = (1 << g_bits) - 1
    g_start = np.array([g0 for g0, _, _ in groups])
    ws = w[:, :, order]
    energy = np.einsum("bii->bi", gram)[:, order].copy()
    porder = np.arange(k) if process_order is None else np.asarray(process_order)
    u = factor_hessian(gram, np.asarray(order)[porder]).u
    scales = np.zeros((len(groups), nb, rows), dtype=np.float16)
    biases = np.zeros_like(scales)

    def params_for(block, first, count, gsz, bits):
        wg = block.reshape(nb, rows, count, gsz)
        wt = energy[:, g_start[first]:g_start[first] + count * gsz].reshape(-1, 1, count, gsz)
        s, b = choose_group_params(wg, bits, wt)
        scales[first:first + count] = s.transpose(2, 0, 1)
        biases[first:first + count] = b.transpose(2, 0, 1)

    if static_groups:
        i = 0
        while i < len(groups):
            j = i
            while j < len(groups) and groups[j][1:] == groups[i][1:]:
                j += 1
            g0, gsz, bits = groups[i]
            params_for(ws[:, :, g0:g0 + (j - i) * gsz], i, j - i, gsz, bits)
            i = j
    bounds = [0]
    while bounds[-1] < k:
        end = min(k, bounds[-1] + block_size)
        if not static_groups:
            g = gid[end - 1]
            end = max(end, int(g_start[g] + groups[g][1]))
        bounds.append(end)
    wt_ = np.ascontiguousarray(ws[:, :, porder].transpose(0, 2, 1))
    codes = np.zeros((nb, k, rows), dtype=np.uint8)
    assumed = np.zeros((nb, k, rows), dtype=np.float32)
    clipped = 0
    for b0, b1 in zip(bounds[:-1], bounds[1:]):
        err = np.zeros((nb, b1 - b0, rows), dtype=np.float32)
        for p in range(b0, b1):
            sp = int(porder[p])
            g = int(gid[sp])
            if not static_groups and sp == g_start[g]:
                gsz = groups[g][1]
                params_for(wt_[:, p:p + gsz, :].transpose(0, 2, 1), g, 1, gsz, int(g_bits[g]))
            s, bi = scales[g].astype(np.float32), biases[g].astype(np.float32)
            col = wt_[:, p, :]
            q = codes_f16(col, s, bi, int(g_bits[g]))
            dq = dequant_f16(q, s, bi)
            raw = np.rint((col - bi) / np.where(s == 0, 1.0, s))
            clipped += int(np.count_nonzero(((raw < 0) | (raw > q_max[g])) & (s != 0)))
            codes[:, sp, :] = q
            assumed[:, sp, :] = dq
            e = (col - dq) / u[:, p, p][:, None]
            if p + 1 < b1:
                wt_[:, p + 1:b1, :] -= u[:, p, p + 1:b1, None] * e[:, None, :]
            err[:, p - b0, :] = e
        if b1 < k:
            wt_[:, b1:, :] -= np.matmul(u[:, b0:b1, b1:].transpose(0, 2, 1), err)
    return codes.transpose(0, 2, 1), scales.transpose(1, 2, 0), biases.transpose(1, 2, 0), \
        assumed.transpose(0, 2, 1), clipped


@pytest.mark.parametrize("desc,static", [("1.0:3b_64g", True), ("1.0:4b_32g", False),
                                         ("0.25:5b_32g/0.75:2b_64g", False), ("1.0:8b_64g", True)])
def test_gptq_core_equals_reference(desc, static) -> None:
    rng = np.random.default_rng(7)
    rows, in_f = 40, 256
    w = (rng.standard_t(3, size=(1, rows, in_f)) * 0.02).astype(np.float32)
    w[0, 3, :64] = 1e-9  # a group whose float16 scale underflows to zero
    x = rng.standard_normal((1024, in_f)).astype(np.float32) * np.exp(rng.standard_normal(in_f)).astype(np.float32)
    gram = (x.T @ x)[None]
    opt = QuantOption.parse(desc)
    energy = act_order(in_f, mx.array(gram))
    order, process = (energy, None) if opt.is_mixed else (np.arange(in_f), energy if static else None)
    res = gptq_core(w, gram, opt, order, QuantizerSpec(block_size=48), static_groups=static, process_order=process)
    ref = _reference_gptq_core(w, gram, opt, order, static_groups=static, process_order=process, block_size=48)
    assert np.array_equal(res.codes, ref[0])
    assert np.array_equal(res.scales, ref[1]) and np.array_equal(res.biases, ref[2])
    assert np.array_equal(res.assumed, ref[3])
    assert res.clipped == ref[4]


def _reference_refine(w, scales, biases, bits, weight, shifts=gptq.DEFAULT_SHIFTS, rescales=gptq.DEFAULT_RESCALES,
                      refits=2):
    """refine_group_params in its plain form: every candidate evaluated and its codes kept as it goes."""
    w = w.astype(mx.float32)
    wt = weight.astype(mx.float32)
    n_bins = float((1 << bits) - 1)

    def cand(s16, b16):
        s, b = s16.astype(mx.float32)[..., None], b16.astype(mx.float32)[..., None]
        q = mx.where(s == 0, 0.0, mx.clip(mx.round((w - b) / mx.where(s == 0, 1.0, s)), 0, n_bins))
        e = s * q + b - w
        return (e * e * wt).sum(-1), q

    best_s, best_b = scales.astype(mx.float16), biases.astype(mx.float16)
    best_err, best_q = cand(best_s, best_b)
    s32, b32 = best_s.astype(mx.float32), best_b.astype(mx.float32)
    centre = b32 + s32 * n_bins / 2
    cands = [(s32, b32 + t * s32) for t in shifts] + [(s32 * f, centre - s32 * f * n_bins / 2) for f in rescales]

    def consider(s, b):
        nonlocal best_s, best_b, best_err, best_q
        s16, b16 = s.astype(mx.float16), b.astype(mx.float16)
        ok = mx.isfinite(s16) & mx.isfinite(b16)
        s16, b16 = mx.where(ok, s16, best_s), mx.where(ok, b16, best_b)
        err, q = cand(s16, b16)
        better = err < best_err
        best_s, best_b = mx.where(better, s16, best_s), mx.where(better, b16, best_b)
        best_err = mx.where(better, err, best_err)
        best_q = mx.where(better[..., None], q, best_q)
        mx.eval(best_s, best_b, best_err, best_q)

    for s, b in cands:
        consider(s, b)
    for _ in range(refits):
        consider(*gptq._weighted_lsq(w, wt, best_q, best_s, best_b))
    return best_s, best_b


@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
def test_refine_group_params_equals_reference(bits) -> None:
    rng = np.random.default_rng(bits)
    w = mx.array((rng.standard_t(3, size=(2, 30, 5, 64)) * 0.02).astype(np.float32))
    wt = mx.array((rng.random((1, 1, 5, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32))
    res = clip_search(w.astype(mx.float16).astype(mx.float32), bits, target=w, weight=wt, metric="diag")
    got = gptq.refine_group_params(w, res.scales, res.biases, bits, wt)
    want = _reference_refine(w, res.scales, res.biases, bits, wt)
    assert mx.array_equal(got[0], want[0]).item() and mx.array_equal(got[1], want[1]).item()
    assert not mx.array_equal(got[0], res.scales).item()  # the refinement changed something


# --------------------------------------------------------------------------
# measuring a large tensor in blocks of output rows
# --------------------------------------------------------------------------
BLOCK_CASES = [(method, clip, desc, kind)
               for method, clip in [("rtn", False), ("rtn", True), ("gptq", True)]
               for desc in ["1.0:3b_64g", "0.25:4b_64g/0.75:2b_64g"]
               for kind in ["gram", "lookup", "plain", "bank"]
               if not (method == "gptq" and kind != "gram")]


@pytest.mark.parametrize("method,clip,desc,kind", BLOCK_CASES)
def test_measure_in_row_blocks_equals_one_piece(method, clip, desc, kind, monkeypatch) -> None:
    """Row blocks give the one-piece codes bit for bit, errors to float rounding and the same clip counts."""
    from mlx_dq.measure import tensor as tensor_mod
    from mlx_dq.model.capture import InputStats
    from mlx_dq.quant import dispatch as quantize_mod

    rng = np.random.default_rng(5)
    rows, in_f = 300, 128
    shape = (2, rows, in_f) if kind == "bank" else (rows, in_f)
    w = mx.array((rng.standard_normal(shape) * rng.uniform(0.2, 3.0, (rows, 1))).astype(np.float32))
    x = rng.standard_normal((512, in_f)).astype(np.float32) * rng.uniform(0.1, 4.0, in_f).astype(np.float32)
    gram = mx.array(x.T @ x)
    if kind == "bank":
        gram = mx.stack([gram, gram * 0.5 + mx.eye(in_f)])
    stats = InputStats(gram=gram, rows=512) if kind in ("gram", "bank") else None
    lookup = None
    if kind == "lookup":
        lookup = InputStats(gram=None, rows=512, token_counts=rng.integers(0, 9, rows).astype(np.float64))
    opts = [QuantOption.parse(desc)]

    def run(budget: int | None):
        seen = []
        monkeypatch.setattr(quantize_mod, "ROW_BLOCK_BYTES", budget or 2**40)
        rec = tensor_mod.measure_tensor("t", w, opts, stats, "default", spec=QuantizerSpec(method=method, clip=clip),
                                         lookup=lookup, damage_fn=lambda wq: seen.append(np.array(wq)) or 0.0)
        return rec.options[0], seen[0]

    one, wq_one = run(None)
    assert quantize_mod.row_blocks(shape, 4 * in_f * 70 * (2 if kind == "bank" else 1)) is not None
    blocked, wq_blocked = run(4 * in_f * 70 * (2 if kind == "bank" else 1))  # 70 rows a block: 5 blocks, one short
    assert np.array_equal(wq_blocked, wq_one)
    assert blocked.err == pytest.approx(one.err, rel=1e-5)
    assert blocked.weight_err == pytest.approx(one.weight_err, rel=1e-5)
    assert (blocked.clip or {}).keys() == (one.clip or {}).keys()
    if one.clip:
        assert blocked.clip["clipped_fraction"] == one.clip["clipped_fraction"]
        if "clip_improvement" in one.clip:
            assert blocked.clip["clip_improvement"] == pytest.approx(one.clip["clip_improvement"], rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("method,clip,desc,promote", [
    ("rtn", False, "0.25:4b_64g/0.75:2b_64g", False), ("rtn", True, "1.0:3b_64g", False),
    ("gptq", True, "1.0:3b_64g", False), ("gptq", True, "0.25:4b_64g/0.75:2b_64g", False),
    ("gptq", True, "0.25:4b_64g/0.75:2b_64g", True)])
@pytest.mark.parametrize("bank", [False, True])
def test_quantize_rows_equals_one_piece(method, clip, desc, promote, bank, monkeypatch) -> None:
    """The converter's row-block quantizer stores the one-piece codes, scales and biases bit for bit."""
    from mlx_dq.quant import dispatch as quantize_mod

    rng = np.random.default_rng(6)
    rows, in_f = 300, 128
    shape = (2, rows, in_f) if bank else (rows, in_f)
    w = mx.array((rng.standard_normal(shape) * rng.uniform(0.2, 3.0, (rows, 1))).astype(np.float32))
    x = rng.standard_normal((512, in_f)).astype(np.float32) * rng.uniform(0.1, 4.0, in_f).astype(np.float32)
    gram = mx.array(x.T @ x)
    opt = QuantOption.parse(desc)
    spec = QuantizerSpec(method=method, clip=clip, promote_mixed=promote)
    one = quantize_mod.quantize_tensor(w, opt, gram, spec)
    monkeypatch.setattr(quantize_mod, "ROW_BLOCK_BYTES", 4 * in_f * 70 * (2 if bank else 1))
    assert quantize_mod.row_blocks(shape) is not None
    threads, orig = [], quantize_mod.quantize_tensor

    def spy(*a, **k):
        threads.append(__import__("threading").get_ident())
        return orig(*a, **k)

    monkeypatch.setattr(quantize_mod, "quantize_tensor", spy)
    monkeypatch.setenv("MLX_DQ_THREADS", "2")
    blocked = quantize_mod.quantize_rows(w, opt, gram, spec)
    # the blocks after the first on worker threads, each half the single-thread budget (70 rows)
    assert len(threads) == len(quantize_mod.row_blocks(shape, quantize_mod.ROW_BLOCK_BYTES // 2)) == 9
    assert len(set(threads)) > 1
    assert blocked.shape == one.shape and blocked.bits == one.bits and blocked.widths == one.widths
    assert (blocked.perm is None) == (one.perm is None)
    if one.perm is not None:
        assert np.array_equal(blocked.perm, one.perm)
    for pa, pb in zip(blocked.parts, one.parts):
        for a, b in zip(pa, pb):
            assert a.shape == b.shape and np.array_equal(np.array(a), np.array(b))
    assert blocked.stats.get("clipped_fraction") == one.stats.get("clipped_fraction")
    if "clip_improvement" in one.stats:
        assert blocked.stats["clip_improvement"] == pytest.approx(one.stats["clip_improvement"], rel=1e-5)
