"""Converter and loader: output folders that mlx-lm and mlx_dq.load read back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest

import mlx_dq
from mlx_dq.conversion.pipeline import convert, quantize_model
from mlx_dq.conversion.report import bit_map
from mlx_dq.conversion.writer import read_manifest
from mlx_dq.model.capture import quantizable_modules
from mlx_dq.model.sources import build_model, resolve

CALIB = {"rows": 4, "seq_len": 32, "progress": False}
TOKENS = mx.array([[1, 5, 9, 17, 33, 65, 2, 7]])


def _recipe(folder: Path, pick) -> dict[str, str]:
    """Module path -> option description for every quantizable tensor, chosen by ``pick(path, module)``."""
    mods = quantizable_modules(build_model(resolve(str(folder)).config))
    return {p: pick(p, m) for p, m in mods.items() if pick(p, m)}


def _mixed_everywhere(path: str, mod) -> str:
    return "0.25:4b_32g/0.75:3b_32g" if "layers.1" in path or "embed" in path else "1.0:4b_64g"


def _logits(model) -> np.ndarray:
    return np.array(model(TOKENS).astype(mx.float32))


def test_mixed_output_loads_everywhere_with_identical_logits(tiny_llama, tmp_path):
    recipe = _recipe(tiny_llama, _mixed_everywhere)
    out = tmp_path / "out"
    manifest = convert(str(tiny_llama), out, plan=recipe, **CALIB)
    ref, _ = quantize_model(str(tiny_llama), recipe, rows=4, seq_len=32)
    expected = _logits(ref)

    model, tok = mlx_dq.load(out)
    np.testing.assert_array_equal(_logits(model), expected)
    remote, _ = mlx_lm.load(str(out), model_config={}, **{"trust_remote_code": True})
    np.testing.assert_array_equal(_logits(remote), expected)
    with pytest.raises(ValueError, match="trust_remote_code"):
        mlx_lm.load(str(out))

    config = json.loads((out / "config.json").read_text())
    assert config["model_file"] == "mlx_dq_model.py"
    assert set(config["mlx_dq"]["mixed"]) == {k for k, v in recipe.items() if "/" in v}
    for key, desc in recipe.items():
        if "/" not in desc:
            assert config["quantization"][key] == {"group_size": 64, "bits": 4, "mode": "affine"}
    acc = manifest["accounting"]
    assert acc["predicted_bytes"] == acc["array_bytes"]
    assert manifest["mixed_modules"] and not manifest["expert_banks"]


def test_stock_output_loads_in_plain_mlx_lm(tiny_qwen2, tmp_path):
    recipe = _recipe(tiny_qwen2, lambda p, m: "1.0:3b_32g" if "mlp" in p else "1.0:5b_64g")
    out = tmp_path / "stock"
    manifest = convert(str(tiny_qwen2), out, plan=recipe, method="rtn", **CALIB)
    config = json.loads((out / "config.json").read_text())
    assert "model_file" not in config and "mlx_dq" not in config
    model, _ = mlx_lm.load(str(out))
    ref, _ = quantize_model(str(tiny_qwen2), recipe, rows=4, seq_len=32, method="rtn")
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=0, atol=0)
    # qwen2's head is tied to its embedding: one tensor, listed as tied
    assert manifest["tied"] == {"lm_head": "model.embed_tokens"}
    assert "lm_head" not in " ".join(manifest["modules"])


@pytest.mark.parametrize("bank_option", ["1.0:4b_32g", "0.25:6b_32g/0.75:3b_32g"])
def test_expert_banks_convert_and_load(tiny_qwen3_moe, tmp_path, bank_option):
    recipe = _recipe(tiny_qwen3_moe, lambda p, m: bank_option if "switch_mlp" in p else
                     ("1.0:8b_64g" if p.endswith("mlp.gate") else "1.0:4b_64g"))
    out = tmp_path / "moe"
    manifest = convert(str(tiny_qwen3_moe), out, plan=recipe, **CALIB)
    banks = manifest["expert_banks"]
    assert banks and all(len(manifest["modules"][b]["shape"]) == 3 for b in banks)
    ref, _ = quantize_model(str(tiny_qwen3_moe), recipe, rows=4, seq_len=32)
    model, _ = mlx_dq.load(out)
    np.testing.assert_allclose(_logits(model), _logits(ref), rtol=1e-5, atol=1e-5)


def test_interrupted_convert_leaves_nothing_that_looks_complete(tiny_llama, tmp_path):
    recipe = _recipe(tiny_llama, lambda p, m: "1.0:4b_64g")
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="simulated interruption"):
        convert(str(tiny_llama), out, plan=recipe, _fail_after_layer=0, **CALIB)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []


def test_existing_output_is_not_overwritten_without_force(tiny_llama, tmp_path):
    recipe = _recipe(tiny_llama, lambda p, m: "1.0:4b_64g")
    out = tmp_path / "out"
    convert(str(tiny_llama), out, plan=recipe, **CALIB)
    stamp = (out / "mlx_dq.json").stat().st_mtime_ns
    from mlx_dq.errors import OutputError

    with pytest.raises(OutputError, match="force=True"):  # the Python API names the argument, not the flag
        convert(str(tiny_llama), out, plan=recipe, **CALIB)
    assert (out / "mlx_dq.json").stat().st_mtime_ns == stamp
    convert(str(tiny_llama), out, plan=_recipe(tiny_llama, lambda p, m: "1.0:8b_64g"), force=True, **CALIB)
    assert all(r["option"] == "1.0:8b_64g" for r in read_manifest(out)["modules"].values())


def test_bpw_target_pipeline_meets_target_and_reports(tiny_llama, tmp_path):
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"roles": {"default": ["1.0:2b_64g", "0.25:3b_64g/0.75:2b_64g", "1.0:3b_64g",
                                                      "1.0:4b_64g", "0.5:6b_32g/0.5:4b_32g", "1.0:8b_64g"]}}))
    out = tmp_path / "out"
    manifest = convert(str(tiny_llama), out, bpw=3.5, measure_kwargs={"grid": str(grid), "rows": 4, "seq_len": 32},
                       **CALIB)
    acc = manifest["accounting"]
    assert 3.5 - 0.1 <= acc["average_bits"] <= 3.5
    assert acc["predicted_bytes"] == acc["array_bytes"]
    assert (out / "measurement.json").exists() and (out / "plan.json").exists()
    text = bit_map(read_manifest(out))
    assert "average_bits" in text and "    0 " in text


def test_plan_with_unknown_tensor_is_refused(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="does not have"):
        convert(str(tiny_llama), tmp_path / "o", plan={"model.layers.9.mlp.up_proj": "1.0:4b_64g"}, **CALIB)


def test_read_manifest_rejects_foreign_json(tmp_path):
    (tmp_path / "mlx_dq.json").write_text(json.dumps({"schema": "dynquant_checkpoint_v2"}))
    with pytest.raises(ValueError, match="not an mlx-dq manifest"):
        read_manifest(tmp_path)


@pytest.mark.parametrize("method", ["gptq", "rtn"])
def test_promoted_mixed_tensors_are_lossless_and_uniform(method):
    from mlx_dq.quant.dispatch import quantize_tensor
    from mlx_dq.quant.options import QuantOption
    from mlx_dq.quant.spec import QuantizerSpec

    mx.random.seed(3)
    w = mx.random.normal((64, 256))
    x = mx.random.normal((512, 256))
    gram = x.T @ x
    for desc in ["0.25:4b_32g/0.75:3b_64g", "0.5:6b_64g/0.5:2b_32g"]:
        opt = QuantOption.parse(desc)
        mixed = quantize_tensor(w, opt, gram, QuantizerSpec(method=method))
        promoted = quantize_tensor(w, opt, gram, QuantizerSpec(method=method, promote_mixed=True))
        assert not promoted.option.is_mixed and promoted.perm is None
        assert promoted.option.segments[0].bits == opt.segments[0].bits
        assert promoted.nbytes() * 8 == promoted.option.storage_bits(w.shape)
        assert promoted.stats["promoted_from"] == desc
        # the same weight as the natural-order mixed tensor it came from, bit for bit
        from mlx_dq.quant.affine import quantize_weight
        if method == "rtn":
            natural = quantize_weight(w, opt, gram, natural_order=True)
            assert mx.array_equal(promoted.dequantize(), natural.dequantize()).item()
        assert mixed.perm is not None


def test_promote_mixed_output_loads_in_plain_mlx_lm(tiny_llama, tmp_path):
    recipe = _recipe(tiny_llama, _mixed_everywhere)
    out = tmp_path / "promoted"
    manifest = convert(str(tiny_llama), out, plan=recipe, promote_mixed=True, **CALIB)
    config = json.loads((out / "config.json").read_text())
    assert "model_file" not in config and not manifest["mixed_modules"]
    promoted = {k: r for k, r in manifest["modules"].items() if recipe[k] != r["option"]}
    assert promoted and all(r["option"] == "1.0:4b_32g" for r in promoted.values())
    model, _ = mlx_lm.load(str(out))
    assert np.isfinite(_logits(model)).all()
    acc = manifest["accounting"]
    assert acc["predicted_bytes"] == acc["array_bytes"]


def test_user_text_beside_the_bundled_set_calibrates_both_stages(tiny_llama, tmp_path):
    """``calib=("bundled", FILE)``: the measurement and the quantizer draw from both, and say so."""
    from mlx_dq.data import calib as calib_mod
    from mlx_dq.measure.records import load_measurement

    six = {**CALIB, "rows": 6}  # one row of each bundled file and one of mine.txt
    mine = tmp_path / "mine.txt"
    mine.write_text("Section 4. Redistribution. You may reproduce copies of the Work. " * 60, encoding="utf-8")
    with pytest.raises(ValueError, match="does not exist"):  # a bad second source fails before any work
        convert(str(tiny_llama), tmp_path / "bad", bpw=4.0, calib=("bundled", str(tmp_path / "nope.txt")), **six)
    assert not (tmp_path / "bad").exists()
    out = tmp_path / "out"
    manifest = convert(str(tiny_llama), out, bpw=4.0, calib=("bundled", str(mine)),
                       measure_kwargs={"rows": 6, "seq_len": 32}, **six)
    digest = calib_mod.text_digest([*calib_mod.default_calibration_texts(), mine.read_text(encoding="utf-8")])
    used = manifest["provenance"]["calibration"]
    assert used["source"] == f"bundled + {mine}" and used["text_digest"] == digest
    measured = load_measurement(out / "measurement.json").calibration
    assert measured["source"] == f"bundled + {mine}" and measured["text_digest"] == digest
