"""mlx-lm's quantization methods built in memory, and their bits-per-weight accounting."""

from __future__ import annotations

import baselines
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_dq.evaluation import metrics as evaluate
from mlx_dq.model.sources import load_model


@pytest.fixture(scope="module")
def llama(tiny_llama):
    return load_model(str(tiny_llama))


def _array_bpw(model: nn.Module) -> float:
    """Bits per weight counted straight from the stored arrays: sum of nbytes * 8 / weights."""
    bits = weights = 0
    for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module):
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            bits += (m.weight.nbytes + m.scales.nbytes + m.biases.nbytes) * 8
            weights += m.weight.size * 32 // m.bits
        elif isinstance(m, (nn.Linear, nn.Embedding)):
            bits += m.weight.nbytes * 8
            weights += m.weight.size
    return bits / weights


@pytest.mark.parametrize("bits", baselines.UNIFORM_BITS)
@pytest.mark.parametrize("group", baselines.GROUP_SIZES)
def test_uniform_bpw_is_bits_plus_32_over_group(llama, bits, group):
    model, _, config = llama
    q, qconfig = baselines.uniform(model, config, bits, group)
    assert qconfig["quantization"]["bits"] == bits and qconfig["quantization"]["group_size"] == group
    kinds = [type(m) for _, m in q.named_modules()]
    assert nn.Linear not in kinds and nn.Embedding not in kinds
    assert nn.QuantizedLinear in kinds and nn.QuantizedEmbedding in kinds
    assert evaluate.bits_per_weight(q) == pytest.approx(bits + 32 / group, abs=1e-12)
    assert _array_bpw(q) == pytest.approx(bits + 32 / group, abs=1e-12)


def test_mixed_3_6_bpw_matches_mlx_lm_arrays(llama):
    model, _, config = llama
    q, qconfig = baselines.mixed_recipe(model, config, "mixed_3_6")
    widths = {m.bits for _, m in q.named_modules() if isinstance(m, nn.QuantizedLinear)}
    assert widths == {3, 6}
    # the recipe's own rule: lm_head and the last eighth of layers' v_proj/down_proj take the high width
    last = q.model.layers[-1]
    assert q.lm_head.bits == 6 and last.self_attn.v_proj.bits == 6 and last.mlp.down_proj.bits == 6
    assert last.self_attn.q_proj.bits == 3 and q.model.layers[0].self_attn.v_proj.bits == 3
    assert qconfig["quantization"]["model.layers.1.self_attn.v_proj"]["bits"] == 6
    assert all(v.dtype != mx.float32 for _, v in tree_flatten(q.parameters()))
    assert evaluate.bits_per_weight(q) == pytest.approx(_array_bpw(q), abs=1e-12)
    assert 3.5 < evaluate.bits_per_weight(q) < 6.5


def test_dynamic_quant_uses_mlx_lm_threshold(llama):
    model, _, config = llama
    rows = mx.array(np.random.default_rng(0).integers(0, 320, size=(4, 32)), dtype=mx.int32)
    sens = baselines.dynamic_sensitivities(model, rows, batch_size=2)
    quantizable = {k for k, m in model.named_modules() if hasattr(m, "to_quantized") and k}
    assert set(sens) == quantizable
    q, _ = baselines.dynamic_quant(model, config, sens, target_bpw=5.0)
    bits = {k: m.bits for k, m in q.named_modules() if hasattr(m, "bits")}
    assert set(bits.values()) == {4, 5}
    high = [sens[k] for k, b in bits.items() if b == 5]
    low = [sens[k] for k, b in bits.items() if b == 4]
    assert min(high) > max(low)
    assert 4.5 < evaluate.bits_per_weight(q) <= 5.5
    more, _ = baselines.dynamic_quant(model, config, sens, target_bpw=5.4)
    assert evaluate.bits_per_weight(more) > evaluate.bits_per_weight(q)


def test_bad_settings_are_refused(llama):
    model, _, config = llama
    with pytest.raises(ValueError, match="bits must be"):
        baselines.uniform(model, config, 7, 64)
    with pytest.raises(ValueError, match="mixed_9_9"):
        baselines.mixed_recipe(model, config, "mixed_9_9")
    with pytest.raises(ValueError, match="outside"):
        baselines.dynamic_quant(model, config, {}, target_bpw=3.0)


def test_variants_cover_every_pair(llama):
    model, _, config = llama
    names = [b.name for b in baselines.uniform_variants(model, config, bits=(2, 8), group_sizes=(32, 128))]
    assert names == ["mlx-lm 2-bit g32", "mlx-lm 2-bit g128", "mlx-lm 8-bit g32", "mlx-lm 8-bit g128"]


def _calib_rows(n: int = 4, seq: int = 32, seed: int = 0) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 320, size=(n, seq)), dtype=mx.int32)


def _kl_to(model: nn.Module, q: nn.Module, rows: mx.array) -> float:
    ref = evaluate.reference(model, rows, 2)
    return evaluate.evaluate_model(q, rows, base=ref, batch_size=2)["kl"]


@pytest.mark.parametrize("fallback", [6, 4])
def test_gptq_builds_and_counts_like_other_rows(llama, fallback):
    model, _, config = llama
    q, qconfig = baselines.gptq(model, config, _calib_rows(), fallback_bits=fallback)
    linear = {m.bits for _, m in q.named_modules() if isinstance(m, nn.QuantizedLinear)}
    embed = [m for _, m in q.named_modules() if isinstance(m, nn.QuantizedEmbedding)]
    assert linear == {4} and len(embed) == 1 and embed[0].bits == fallback
    assert qconfig["quantization"]["bits"] == 4 and qconfig["quantization"]["group_size"] == 64
    assert all(v.dtype != mx.float32 for _, v in tree_flatten(q.parameters()))
    # one rule: 16-bit scales and biases, so 4-bit g64 is 4.5 and the 6-bit embedding adds bits
    assert evaluate.bits_per_weight(q) == pytest.approx(_array_bpw(q), abs=1e-12)
    if fallback == 4:
        assert evaluate.bits_per_weight(q) == pytest.approx(4.5, abs=1e-12)
    else:
        assert 4.5 < evaluate.bits_per_weight(q) < 6.5
    kl = _kl_to(model, q, _calib_rows(seed=1))
    rtn_kl = _kl_to(model, baselines.uniform(model, config, 4, 64)[0], _calib_rows(seed=1))
    assert np.isfinite(kl) and 0 < kl < 10 * rtn_kl


def test_gptq_refuses_widths_mlx_lm_lacks(llama):
    model, _, config = llama
    with pytest.raises(ValueError, match="2, 4 or 8"):
        baselines.gptq(model, config, _calib_rows(), bits=3)


def test_awq_builds_and_counts_like_other_rows(llama):
    model, _, config = llama
    q, qconfig = baselines.awq(model, config, _calib_rows())
    linear = {(m.bits, m.group_size) for _, m in q.named_modules() if isinstance(m, nn.QuantizedLinear)}
    embed = [m for _, m in q.named_modules() if isinstance(m, nn.QuantizedEmbedding)]
    assert (4, 64) in linear and len(embed) == 1 and (embed[0].bits, embed[0].group_size) == (4, 32)
    assert qconfig["quantization"]["model.layers.0.mlp.down_proj"]["bits"] == 4
    assert all(v.dtype != mx.float32 for _, v in tree_flatten(q.parameters()))
    assert evaluate.bits_per_weight(q) == pytest.approx(_array_bpw(q), abs=1e-12)
    assert 4.5 <= evaluate.bits_per_weight(q) < 5.0
    kl = _kl_to(model, q, _calib_rows(seed=1))
    assert np.isfinite(kl) and kl > 0


def test_awq_refuses_architectures_mlx_lm_lacks(llama):
    model, _, config = llama
    with pytest.raises(ValueError, match="does not support 'mystery'"):
        baselines.awq(model, {**config, "model_type": "mystery"}, _calib_rows())


def test_planning_baselines_respect_budget_and_lose_to_the_optimizer() -> None:
    """The greedy pass and mlx-lm's two-level rule on a measurement: within budget, never better than optimize."""
    import math

    from mlx_dq.measure.records import Measurement, OptionRecord, TensorRecord
    from mlx_dq.plan.solver import optimize
    from mlx_dq.quant.options import QuantOption

    whole = [QuantOption.uniform(b, g) for b in (2, 3, 4, 5, 6, 8) for g in (32, 64, 128)]
    mixed = [QuantOption.parse(d) for d in ("0.1:4b_32g/0.9:3b_32g", "0.25:6b_64g/0.75:4b_64g",
                                            "0.5:3b_128g/0.5:2b_128g")]
    rng = np.random.default_rng(10)
    m = Measurement()
    for i in range(60):  # real storage bits; error falls with bits, with per-tensor sensitivity
        t = TensorRecord(f"model.layers.{i}.self_attn.o_proj", (64, 256), importance=float(rng.uniform(0.2, 3)))
        for opt in whole + mixed:
            err = float(rng.uniform(0.5, 1.5)) * 2.0 ** -opt.nominal_bpw()
            bits = opt.storage_bits(t.shape)
            t.options.append(OptionRecord(opt, bits / t.numel, bits, err))
        m.tensors[t.key] = t
    lo4 = sum(t.find(QuantOption.uniform(4, 64)).total_bits for t in m.tensors.values())
    hi5 = sum(t.find(QuantOption.uniform(5, 64)).total_bits for t in m.tensors.values())
    n = m.numel()
    target = (lo4 + hi5) / 2 / n
    ours = optimize(m, target)
    greedy = baselines.greedy_single_pass(m, target)
    dq = baselines.dynamic_quant_threshold(m, target)
    for plan in (ours, greedy, dq):
        assert plan.used_bits <= math.floor(target * n)
    assert {e.option for e in dq.tensors} == {"1.0:4b_64g", "1.0:5b_64g"}
    assert "60/60 items had both measured" in dq.settings["baseline"]
    with pytest.raises(ValueError, match="two-level range"):
        baselines.dynamic_quant_threshold(m, 1.01 * hi5 / n)
    assert ours.objective <= greedy.objective * (1 + 1e-12)
    assert ours.objective < dq.objective
