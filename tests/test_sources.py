"""Model sources: HF folders (plain and sharded), hub ids, bad input, lazy per-layer loading."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest
from fixtures_models import make_tiny_model_folder, tiny_tokenizer
from mlx.utils import tree_flatten
from mlx_lm import load as mlx_lm_load
from mlx_lm.tokenizer_utils import TokenizerWrapper
from mlx_lm.utils import load_tokenizer

from mlx_dq.model.sources import ModelSource, build_model, load_model, resolve

TEXT = "the quick brown fox said hello to the lazy dog"


def _ids(tokenizer) -> mx.array:
    return mx.array([tokenizer.encode(TEXT)])


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_qwen3_moe"])
def test_folder_source_matches_mlx_lm(fixture, request):
    folder = request.getfixturevalue(fixture)
    src = resolve(str(folder))
    assert isinstance(src, ModelSource) and src.kind == "folder" and src.path == folder
    ref, ref_tok = mlx_lm_load(str(folder))
    assert src.weight_names() == [k for k, _ in tree_flatten(ref.parameters())]
    assert src.weight_names() == [k for k, _ in tree_flatten(build_model(src.config).parameters())]
    assert src.num_layers == 2

    model, tok, config = load_model(str(folder))
    assert config["model_type"] == json.loads((folder / "config.json").read_text())["model_type"]
    assert all(v.dtype == mx.float32 for _, v in tree_flatten(model.parameters()))
    np.testing.assert_allclose(np.array(model(_ids(tok))), np.array(ref(_ids(ref_tok))), atol=1e-5)


def test_sharded_folder_equals_single_file(tmp_path):
    single = make_tiny_model_folder(tmp_path, "llama", 2, seed=3)
    sharded = make_tiny_model_folder(tmp_path, "llama", 2, seed=3, shards=3)
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    a, b = resolve(str(single)), resolve(str(sharded))
    assert a.weight_names() == b.weight_names()
    wa, wb = a.load_weights(a.weight_names()), b.load_weights(b.weight_names())
    for name in wa:
        assert mx.array_equal(wa[name], wb[name]), name
    ref, ref_tok = mlx_lm_load(str(sharded))
    model, tok, _ = load_model(str(sharded))
    np.testing.assert_allclose(np.array(model(_ids(tok))), np.array(ref(_ids(ref_tok))), atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_large_16bit_tensors_are_read_into_float32_by_rows(dtype, tmp_path, monkeypatch):
    """A large 2-D 16-bit tensor goes into float32 a block of rows at a time (no whole 16-bit copy beside it), with
    the values a plain cast gives, sharded or not; ``as_stored`` names keep their 16-bit dtype."""
    from mlx_dq.model import sources as sources_mod

    read: list[str] = []
    orig = sources_mod._SafetensorsWeights.float32_by_rows
    def by_rows(self, key):
        out = orig(self, key)
        if out is not None:
            read.append(key)
        return out

    monkeypatch.setattr(sources_mod._SafetensorsWeights, "float32_by_rows", by_rows)
    monkeypatch.setattr(sources_mod, "ROWS_READ_BYTES", 2 * 128 * 7)  # 7 rows of 128 channels at a time
    for shards in (1, 2):
        folder = make_tiny_model_folder(tmp_path, "llama", 1, seed=4, dtype=dtype, shards=shards, tie=False)
        src = resolve(str(folder))
        names = src.weight_names()
        q = "model.layers.0.self_attn.q_proj.weight"
        got = src.load_weights(names, as_stored={q})
        raw = {k: v for f in folder.glob("*.safetensors") for k, v in mx.load(str(f)).items()}
        assert got[q].dtype == dtype and mx.array_equal(got[q], raw[q]).item()
        for k in names:
            if k != q:
                assert got[k].dtype == mx.float32 and mx.array_equal(got[k], raw[k].astype(mx.float32)).item(), k
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.weight"} <= set(read)
    assert q not in read and not any(k.endswith("norm.weight") for k in read)  # 1-D: read whole


def test_moe_layer_weights_are_stacked_like_mlx_lm(tiny_qwen3_moe):
    src = resolve(str(tiny_qwen3_moe))
    ref, _ = mlx_lm_load(str(tiny_qwen3_moe))
    ref_params = dict(tree_flatten(ref.parameters()))
    layer = src.layer_weights(1)
    assert set(layer) == {k for k in ref_params if k.startswith("model.layers.1.")}
    assert layer["model.layers.1.mlp.switch_mlp.gate_proj.weight"].shape[0] == 4
    for name, w in layer.items():
        assert w.dtype == mx.float32
        assert mx.array_equal(w, ref_params[name]), name
    other = src.other_weights()
    assert set(other) == {k for k in ref_params if ".layers." not in k}
    # Asking for one stacked bank alone works too.
    one = src.load_weights(["model.layers.0.mlp.switch_mlp.down_proj.weight"])
    assert mx.array_equal(one["model.layers.0.mlp.switch_mlp.down_proj.weight"], ref_params["model.layers.0.mlp.switch_mlp.down_proj.weight"])


@pytest.mark.parametrize("model_type", ["llama", "qwen3_moe"])
def test_layer_weights_read_only_that_layer(tmp_path, model_type):
    folder = make_tiny_model_folder(tmp_path, model_type, 8, hidden=256, intermediate=512)
    src = resolve(str(folder))
    total = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    src.weight_names()
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    layer = src.layer_weights(5)
    layer_bytes = sum(v.nbytes for v in layer.values())
    peak = mx.get_peak_memory() - base
    assert layer_bytes < total / 6
    # Stacking experts briefly holds the per-expert tensors next to the stacked bank.
    assert peak <= 2.5 * layer_bytes, (peak, layer_bytes, total)


def test_tokenizer_and_save_tokenizer(tiny_llama, tmp_path):
    src = resolve(str(tiny_llama))
    tok = src.tokenizer()
    assert isinstance(tok, TokenizerWrapper)
    assert tok.encode(TEXT) == tiny_tokenizer().encode(TEXT)
    src.save_tokenizer(tmp_path / "out")
    assert (tmp_path / "out" / "tokenizer.json").is_file()
    again = load_tokenizer(tmp_path / "out")
    messages = [{"role": "user", "content": "hi"}]
    assert again.encode(TEXT) == tok.encode(TEXT)
    assert again.apply_chat_template(messages, tokenize=False) == tok.apply_chat_template(messages, tokenize=False)
    assert "<|im_start|>user" in again.apply_chat_template(messages, tokenize=False)


def test_fingerprint_is_stable_and_tracks_weights(tmp_path, tiny_llama):
    a = resolve(str(tiny_llama)).fingerprint()
    assert a == resolve(str(tiny_llama)).fingerprint()
    other = make_tiny_model_folder(tmp_path, "llama", 2, seed=7)
    assert resolve(str(other)).fingerprint() != a


def test_nested_rope_parameters_are_lifted(tmp_path):
    folder = make_tiny_model_folder(tmp_path, "llama", 2, seed=1)
    cfg = json.loads((folder / "config.json").read_text())
    theta = cfg.pop("rope_theta")
    cfg["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    (folder / "config.json").write_text(json.dumps(cfg))
    src = resolve(str(folder))
    assert theta == 10000.0 and src.config["rope_theta"] == 500000.0


def test_hub_id_offline_fails_fast_naming_the_id(tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    code = "from mlx_dq.model.sources import resolve; resolve('someorg/tiny-missing-model')"
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    elapsed = time.monotonic() - start
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx_dq.errors.InputError") and "someorg/tiny-missing-model" in last and "HF_HUB_OFFLINE" in last
    assert elapsed < 60


def test_hub_id_served_from_local_cache_when_offline(tmp_path, tiny_llama):
    # The hub cache layout huggingface_hub itself reads: refs/main -> snapshots/<commit>/.
    repo = tmp_path / "hf" / "hub" / "models--someorg--tiny-llama"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots").mkdir()
    shutil.copytree(tiny_llama, repo / "snapshots" / commit)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    code = (
        "from mlx_dq.model.sources import resolve; s = resolve('someorg/tiny-llama'); "
        "print(s.kind, s.config['model_type'], len(s.weight_names()), s.path.name)"
    )
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    kind, model_type, n, name = proc.stdout.split()
    assert (kind, model_type, name) == ("hub", "llama", commit)
    assert int(n) == len(resolve(str(tiny_llama)).weight_names())


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    folder = make_tiny_model_folder(tmp_path, "llama", 2, name="notok")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (folder / f).unlink()
    src = resolve(str(folder))
    with pytest.raises(ValueError, match="tokenizer"):
        src.tokenizer()


def test_missing_path(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve(str(tmp_path / "no-such-model"))
    with pytest.raises(ValueError, match="does not exist"):
        resolve(str(tmp_path / "model.gguf"))


def test_unknown_architecture(tmp_path):
    folder = make_tiny_model_folder(tmp_path, "llama", 2, name="weird")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model_type"] = "not_a_real_arch"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="not_a_real_arch"):
        resolve(str(folder))


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"hidden_size": 4}'])
def test_corrupt_config(tmp_path, content):
    folder = make_tiny_model_folder(tmp_path, "llama", 2, name="corrupt")
    (folder / "config.json").write_text(content)
    with pytest.raises(ValueError, match="config.json"):
        resolve(str(folder))


def test_folder_without_weights_or_config(tmp_path):
    folder = make_tiny_model_folder(tmp_path, "llama", 2, name="noweights")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="safetensors"):
        resolve(str(folder))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="config.json"):
        resolve(str(empty))


def test_already_quantized_folder_is_refused(tmp_path):
    folder = make_tiny_model_folder(tmp_path, "llama", 2, name="quantized")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="already quantized"):
        resolve(str(folder))


def test_unknown_weight_name(tiny_llama):
    src = resolve(str(tiny_llama))
    with pytest.raises(ValueError, match="model.layers.9.mlp.up_proj.weight"):
        src.load_weights(["model.layers.9.mlp.up_proj.weight"])
    with pytest.raises(ValueError, match="layer 5"):
        src.layer_weights(5)
