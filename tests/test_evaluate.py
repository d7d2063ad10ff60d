"""KL divergence, top-1 agreement, dequantized evaluation and bits-per-weight accounting on tiny models."""

from __future__ import annotations

import math

import baselines
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_dq.evaluation import metrics as evaluate
from mlx_dq.model.sources import load_model


@pytest.fixture(scope="module")
def llama(tiny_llama):
    model, tokenizer, config = load_model(str(tiny_llama))
    return model, tokenizer, config


@pytest.fixture(scope="module")
def qwen2(tiny_qwen2):
    model, tokenizer, config = load_model(str(tiny_qwen2))
    return model, tokenizer, config


@pytest.fixture(scope="module")
def rows() -> mx.array:
    return mx.array(np.random.default_rng(1).integers(0, 320, size=(6, 24)), dtype=mx.int32)


def _logits(model: nn.Module, rows: mx.array) -> np.ndarray:
    out = model(rows).astype(mx.float32)
    mx.eval(out)
    return np.array(out, dtype=np.float64)


def test_kl_of_model_against_itself_is_zero(llama, rows):
    model = llama[0]
    r = evaluate.kl_divergence(model, model, rows, batch_size=4)
    assert r["kl"] == 0.0
    assert r["kl_max"] == 0.0
    assert r["top1"] == 1.0
    assert r["perplexity"] == pytest.approx(r["base_perplexity"], rel=1e-12)
    assert r["tokens"] == 6 * 23
    assert r["perplexity"] == pytest.approx(evaluate.perplexity(model, rows), rel=1e-5)


def test_kl_matches_float64_numpy(llama, rows):
    model, _, config = llama
    q, _ = baselines.uniform(model, config, 3, 64)
    q = evaluate.dequantize_model(q)
    r = evaluate.kl_divergence(model, q, rows, batch_size=4)

    def logsoftmax(z: np.ndarray) -> np.ndarray:
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))

    lp = logsoftmax(_logits(model, rows[:, :-1]))
    lq = logsoftmax(_logits(q, rows[:, :-1]))
    kl = (np.exp(lp) * (lp - lq)).sum(-1)
    targets = np.array(rows[:, 1:])[..., None]
    nll_q = -np.take_along_axis(lq, targets, -1).mean()
    assert r["kl"] == pytest.approx(kl.mean(), rel=1e-4)
    assert r["kl_max"] == pytest.approx(kl.max(), rel=1e-4)
    assert r["top1"] == pytest.approx((lp.argmax(-1) == lq.argmax(-1)).mean())
    assert r["perplexity"] == pytest.approx(math.exp(nll_q), rel=1e-5)


def test_kl_positive_and_grows_as_bits_fall(llama, rows):
    model, _, config = llama
    kls = []
    for bits in (8, 4, 3, 2):
        q, _ = baselines.uniform(model, config, bits, 32)
        kls.append(evaluate.kl_divergence(model, evaluate.dequantize_model(q), rows, batch_size=3)["kl"])
    assert kls[0] > 0
    assert kls == sorted(kls), kls


def test_reference_gives_the_same_numbers(llama, rows):
    model, _, config = llama
    q = evaluate.dequantize_model(baselines.uniform(model, config, 4, 128)[0])
    ref = evaluate.reference(model, rows, batch_size=4)
    direct = evaluate.kl_divergence(model, q, rows, batch_size=4)
    cached = evaluate.kl_divergence(ref, q, rows, batch_size=4)
    for key in ("kl", "kl_max", "top1", "perplexity", "base_perplexity", "tokens"):
        assert cached[key] == pytest.approx(direct[key], rel=1e-6)
    assert ref.perplexity == pytest.approx(evaluate.perplexity(model, rows), rel=1e-5)
    with pytest.raises(ValueError, match="other rows"):
        evaluate.kl_divergence(ref, q, rows[:, :-2], batch_size=4)
    with pytest.raises(ValueError, match="batch_size"):
        evaluate.kl_divergence(ref, q, rows, batch_size=2)


def test_bad_rows_are_refused(llama):
    model = llama[0]
    with pytest.raises(ValueError, match="rows must be"):
        evaluate.kl_divergence(model, model, mx.zeros((8,), dtype=mx.int32))
    with pytest.raises(ValueError, match="batch_size"):
        evaluate.kl_divergence(model, model, mx.zeros((2, 8), dtype=mx.int32), batch_size=0)


@pytest.mark.parametrize("fixture", ["llama", "qwen2"])
def test_dequantize_model_keeps_the_logits(fixture, request, rows):
    model, _, config = request.getfixturevalue(fixture)
    # quantize a float32 copy so the quantized forward itself runs in float32
    q, _ = baselines.uniform(model, config, 4, 32, dtype=mx.float32)
    kinds = {type(m).__name__ for _, m in q.named_modules()}
    assert "QuantizedLinear" in kinds and "QuantizedEmbedding" in kinds
    expected = _logits(q, rows)
    d = evaluate.dequantize_model(q)
    kinds = {type(m).__name__ for _, m in d.named_modules()}
    assert not any(k.startswith("Quantized") for k in kinds)
    got = _logits(d, rows)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    assert all(v.dtype == mx.float32 for _, v in nn.utils.tree_flatten(d.parameters()))


def test_dequantize_model_handles_mixed_layers(llama, rows):
    mixed = pytest.importorskip("mlx_dq.layers.mixed")
    from mlx_dq.quant.affine import quantize_weight
    from mlx_dq.quant.options import QuantOption

    model, _, config = llama
    m = baselines.cast_copy(model, mx.float32)
    option = QuantOption.parse("0.25:4b_32g/0.75:3b_32g")
    lin = m.layers[0].mlp.down_proj
    qt = quantize_weight(lin.weight, option)
    m.layers[0].mlp.down_proj = mixed.MixedLinear.from_quantized(qt)
    bits, weights = evaluate.weight_storage(m)
    _, ref_weights = evaluate.weight_storage(model)
    assert weights == ref_weights
    assert bits == 16 * (ref_weights - lin.weight.size) + option.storage_bits(lin.weight.shape)
    expected = _logits(m, rows)
    d = evaluate.dequantize_model(m)
    assert isinstance(d.layers[0].mlp.down_proj, nn.Linear)
    np.testing.assert_allclose(_logits(d, rows), expected, rtol=1e-4, atol=1e-4)
    # the layer dequantizes in float32; QuantizedTensor.dequantize rounds through the 16-bit scales' dtype
    np.testing.assert_allclose(np.array(d.layers[0].mlp.down_proj.weight), np.array(qt.dequantize()), atol=1e-4)


def test_tied_embedding_counts_once(qwen2):
    model, _, config = qwen2
    assert config["tie_word_embeddings"]
    expected = sum(
        m.weight.size for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
    )
    bits, weights = evaluate.weight_storage(model)
    assert weights == expected and bits == 16 * expected


def test_evaluate_model_reports_size_bpw_and_cpu_note(llama, rows):
    model, _, config = llama
    q, _ = baselines.uniform(model, config, 4, 64)
    r = evaluate.evaluate_model(q, rows, base=model, batch_size=3)
    assert r["bits_per_weight"] == pytest.approx(4.5)
    # 4.5 bpw weights + every other parameter (norms) at 16 bits
    norms = sum(v.size for k, v in nn.utils.tree_flatten(model.parameters()) if "norm" in k)
    assert r["size_bytes"] == r["weights"] * 4.5 / 8 + 2 * norms
    assert r["kl"] > 0 and 0 < r["top1"] <= 1 and r["tokens_per_s"] > 0
    if mx.default_device().type == mx.DeviceType.cpu:
        assert "dequantized float32" in r["evaluated_as"]


@pytest.fixture(scope="module")
def quantized_folder(tiny_llama, tmp_path_factory):
    """An mlx-lm 4-bit g64 folder of the tiny llama, written by mlx-lm's own converter."""
    from mlx_lm.convert import convert

    out = tmp_path_factory.mktemp("q") / "llama-4bit"
    convert(str(tiny_llama), str(out), quantize=True, q_bits=4, q_group_size=64, dtype="float16")
    return out


def test_eval_cli_on_an_mlx_lm_folder(quantized_folder, tiny_llama):
    from click.testing import CliRunner

    from mlx_dq.cli import main

    args = ["eval", str(quantized_folder), "--base", str(tiny_llama), "--rows", "2", "--seq-len", "16", "--no-speed"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert "dequantized float32 weights" in res.output
    assert "KL divergence" in res.output and "bits per weight: 4.5000" in res.output
    assert not (quantized_folder / "mlx_dq.json").exists()


def test_eval_cli_writes_results_into_the_manifest(tiny_llama, tmp_path):
    import json

    from click.testing import CliRunner

    conv = pytest.importorskip("mlx_dq.conversion.pipeline")
    from mlx_dq.cli import main

    out = tmp_path / "dq"
    conv.convert(str(tiny_llama), out, bpw=4.0, rows=2, seq_len=16, progress=False)
    res = CliRunner().invoke(main, ["eval", str(out), "--rows", "2", "--seq-len", "16", "--no-speed"])
    assert res.exit_code == 0, res.output
    assert f"base: {tiny_llama}" in res.output  # found through the manifest's provenance
    manifest = json.loads((out / "mlx_dq.json").read_text())
    block = manifest["results"]
    assert block["kl_divergence"] > 0 and 0 < block["top1_agreement"] <= 1
    assert block["perplexity"] > 1 and block["base_perplexity"] > 1
    assert block["quantization_seconds"] == manifest["provenance"]["quantization_seconds"]
    assert block["model_size_bytes"] == sum(f.stat().st_size for f in out.glob("*.safetensors"))
    assert block["original_size_bytes"] > block["model_size_bytes"]
    assert block["evaluation"]["rows"] == 2 and block["evaluation"]["base"] == str(tiny_llama)


def test_eval_cli_refuses_a_missing_model(tmp_path):
    from click.testing import CliRunner

    from mlx_dq.cli import main

    res = CliRunner().invoke(main, ["eval", str(tmp_path / "nowhere"), "--no-speed"])
    assert res.exit_code != 0 and "nowhere" in res.output
