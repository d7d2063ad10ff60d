"""mlx-lm's DWQ as a quality-benchmark baseline (benchmarks/baselines.py: dwq), on a tiny random llama."""

from __future__ import annotations

import sys

import baselines
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures_models import make_tiny_model_folder
from mlx.utils import tree_flatten
from script_loader import load_script

from mlx_dq.evaluation import metrics as evaluate
from mlx_dq.model.sources import load_model


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory):
    """A 2-layer llama with a tied head, so the quantized embedding is trained through ``as_linear`` too."""
    return load_model(str(make_tiny_model_folder(tmp_path_factory.mktemp("dwq"), "llama", 2, tie=True)))


def _rows(n: int, seq: int, seed: int) -> mx.array:
    return mx.array(np.random.default_rng(seed).integers(0, 320, size=(n, seq)), dtype=mx.int32)


def _kl(model: nn.Module, q: nn.Module, rows: mx.array) -> float:
    return evaluate.kl_divergence(model, q, rows, batch_size=4)["kl"]


def test_dequantized_path_matches_quantized_matmul_and_its_gradients():
    mx.random.seed(0)
    lin = nn.QuantizedLinear.from_linear(nn.Linear(128, 32), group_size=64, bits=4)
    emb = nn.QuantizedEmbedding.from_embedding(nn.Embedding(16, 128), group_size=64, bits=4)
    x = mx.random.normal((3, 128))

    def loss(m: nn.Module, s: mx.array, b: mx.array, call) -> mx.array:
        m.scales, m.biases = s, b
        return (call(m, x) ** 2).sum()

    for m, call in ((lin, lambda m, x: m(x)), (emb, lambda m, x: m.as_linear(x))):
        fast = mx.value_and_grad(lambda s, b: loss(m, s, b, call), argnums=(0, 1))(m.scales, m.biases)
        with baselines.dequantized_matmuls():
            slow = mx.value_and_grad(lambda s, b: loss(m, s, b, call), argnums=(0, 1))(m.scales, m.biases)
        assert np.allclose(np.array(fast[0]), np.array(slow[0]), rtol=1e-5)
        for g_fast, g_slow in zip(fast[1], slow[1]):
            assert np.allclose(np.array(g_fast), np.array(g_slow), rtol=1e-4, atol=1e-4)


def test_dwq_trains_scales_and_biases_only_and_lowers_kl(tied_llama):
    model, _, config = tied_llama
    linear_call, as_linear = nn.QuantizedLinear.__call__, nn.QuantizedEmbedding.as_linear
    rows = _rows(3, 24, seed=1)
    start, _ = baselines.uniform(model, config, 4, 64)
    q, qconfig, rec = baselines.dwq(model, config, rows, relative_lr=3e-3, valid_rows=rows[:1])
    # the patch is gone again
    assert nn.QuantizedLinear.__call__ is linear_call and nn.QuantizedEmbedding.as_linear is as_linear
    assert qconfig["quantization"]["bits"] == 4 and qconfig["quantization"]["group_size"] == 64
    assert rec["steps"] == 3 and rec["tokens"] == 3 * 23 and len(rec["valid_loss"]) == 2
    assert rec["lr"] > 0 and rec["changed"]["scales"] > 0.5 and rec["changed"]["biases"] > 0.2
    before, after = dict(tree_flatten(start.parameters())), dict(tree_flatten(q.parameters()))
    assert before.keys() == after.keys()
    assert any(k.endswith("embed_tokens.scales") for k in after) and not any(k.startswith("lm_head") for k in after)
    for k, v in after.items():
        assert v.dtype == before[k].dtype and v.dtype != mx.float32
        if k.endswith(".weight") and v.dtype == mx.uint32:  # the codes
            assert mx.array_equal(v, before[k]), k
        elif k.endswith((".scales", ".biases")):
            assert not mx.array_equal(v, before[k]), k
    assert evaluate.bits_per_weight(q) == pytest.approx(4.5, abs=1e-12)
    kl_before, kl_after = _kl(model, start, rows), _kl(model, q, rows)
    assert np.isfinite(kl_after) and kl_after < kl_before


def test_dwq_step_count_and_bad_settings(tied_llama):
    model, _, config = tied_llama
    rows = _rows(2, 8, seed=2)
    q, _, rec = baselines.dwq(model, config, rows, steps=3, lr=1e-6, valid_rows=rows[:1])
    assert rec["steps"] == 3 and rec["lr"] == 1e-6 and rec["tokens"] == 3 * 7
    with pytest.raises(ValueError, match="batch_size"):
        baselines.dwq(model, config, rows, batch_size=3)
    with pytest.raises(ValueError, match="L >= 3"):
        baselines.dwq(model, config, rows[:, :2])


@pytest.fixture(scope="module")
def quality():
    yield load_script("benchmarks/quality.py", "quality_dwq")
    sys.modules.pop("quality_dwq", None)


def test_quality_lists_the_dwq_row_and_counts_it_in_the_4_bpw_goal(quality, tied_llama, tmp_path):
    import re

    from mlx_dq.settings import DistillSettings

    model, _, config = tied_llama
    rows = _rows(4, 16, seed=3)
    dwq = [v for v in quality.mlx_lm_variants(model, config, rows, tmp_path, "tiny", rows, rows, DistillSettings())
           if v.family == "mlx-lm DWQ"]  # building is lazy: nothing is built here
    assert [v.name for v in dwq] == ["mlx-lm DWQ 4-bit g64"]
    assert re.compile(r"^mlx-lm (DWQ|4-bit g64)").search(dwq[0].name)
    assert "40 steps of 1 row(s)" in dwq[0].notes and "4 x 16 tokens" in dwq[0].notes
    other = quality.mlx_lm_variants(model, config, rows, tmp_path, "tiny", rows, rows, DistillSettings(steps=3))
    assert [v.name for v in other if v.family == "mlx-lm DWQ"][0].startswith("mlx-lm DWQ 4-bit g64, 3 steps")
    assert not any(v.family == "mlx-lm DWQ" for v in quality.mlx_lm_variants(model, config, rows, tmp_path, "tiny"))
    def row(fam: str, m: str, bpw: float, kl: float) -> dict:
        return {"text": "t", "family": fam, "method": m, "bpw": str(bpw), "kl": str(kl)}

    table = [row("mlx-dq", "mlx-dq @4", 4.0, 0.2), row("mlx-lm GPTQ", "mlx-lm GPTQ 4-bit g64", 4.9, 0.3),
             row("mlx-lm DWQ", "mlx-lm DWQ 4-bit g64", 4.5, 0.25)]
    goal = next(g for g in quality.goal_status(table) if g["target"] == 4.0 and g["family"] == "mlx-dq")
    assert goal["lm"]["method"] == "mlx-lm DWQ 4-bit g64" and goal["met"] is True
