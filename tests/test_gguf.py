"""GGUF sources: files written here with the gguf package (llama, qwen2, gemma3) and the bundled SmolLM2."""

from __future__ import annotations

import math

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures_models import (
    CHAT_TEMPLATE,
    llama_cpp_permute,
    random_weights,
    spm_vocab,
    tiny_config,
    tiny_tokenizer,
    write_tiny_gguf,
)
from mlx.utils import tree_flatten
from mlx_lm import generate
from mlx_lm.utils import load_tokenizer

from mlx_dq.model.sources import build_model, resolve

TEXT = "the quick brown fox said hello to the lazy dog, 12 times"


def _reference(config: dict, stored: dict[str, np.ndarray]) -> nn.Module:
    """An mlx-lm model holding exactly the weights the GGUF file represents."""
    model = build_model(config)
    names = {k for k, _ in tree_flatten(model.parameters())}
    model.load_weights([(k, mx.array(v)) for k, v in stored.items() if k in names], strict=True)
    return model


def _write(tmp_path, model_type, layers, qtypes, **kw):
    config = tiny_config(model_type, layers, **kw)
    weights = random_weights(config, seed=11)
    path = tmp_path / f"{model_type}.gguf"
    stored = write_tiny_gguf(path, config, weights, qtypes)
    return path, config, weights, stored


def _ids(tok) -> mx.array:
    return mx.array([tok.encode(TEXT)])


def test_llama_gguf_unpermutes_qk_and_dequantizes_k_quants(tmp_path):
    qtypes = {"mlp.down_proj": "Q4_K", "embed_tokens": "Q8_0", "lm_head": "F16", "_proj": "Q8_0"}
    path, config, weights, stored = _write(tmp_path, "llama", 2, qtypes)
    src = resolve(str(path))
    assert src.kind == "gguf" and src.config["model_type"] == "llama"
    assert src.config["tie_word_embeddings"] is False
    assert src.config["rope_theta"] == config["rope_theta"]
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size"):
        assert src.config[key] == config[key], key

    q_name, k_name = "model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    loaded = src.load_weights([q_name, k_name, "model.layers.0.mlp.down_proj.weight"])
    # Q8_0 keeps the weight to ~1%: the loaded rows are the original rows, not llama.cpp's order.
    q_orig = np.array(weights[q_name])
    np.testing.assert_allclose(np.array(loaded[q_name]), q_orig, atol=0.02 * np.abs(q_orig).max())
    assert not np.allclose(np.array(loaded[q_name]), llama_cpp_permute(q_orig, 4), atol=0.02 * np.abs(q_orig).max())
    np.testing.assert_array_equal(np.array(loaded[k_name]), stored[k_name])
    np.testing.assert_array_equal(np.array(loaded["model.layers.0.mlp.down_proj.weight"]), stored["model.layers.0.mlp.down_proj.weight"])

    model = src.model()
    tok = src.tokenizer()
    np.testing.assert_allclose(np.array(model(_ids(tok))), np.array(_reference(config, stored)(_ids(tok))), atol=1e-4)


def test_qwen2_gguf_tied_with_biases(tmp_path):
    path, config, weights, stored = _write(tmp_path, "qwen2", 2, {"_proj": "Q8_0", "embed_tokens": "Q8_0"})
    src = resolve(str(path))
    assert src.config["model_type"] == "qwen2" and src.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in src.weight_names()
    bias = src.load_weights(["model.layers.0.self_attn.q_proj.bias"])["model.layers.0.self_attn.q_proj.bias"]
    np.testing.assert_array_equal(np.array(bias), np.array(weights["model.layers.0.self_attn.q_proj.bias"]))
    # qwen2 rows are not permuted by llama.cpp.
    q = "model.layers.0.self_attn.q_proj.weight"
    np.testing.assert_array_equal(np.array(src.load_weights([q])[q]), stored[q])
    tok = src.tokenizer()
    np.testing.assert_allclose(np.array(src.model()(_ids(tok))), np.array(_reference(config, stored)(_ids(tok))), atol=1e-4)


def test_gemma3_gguf_norm_offset(tmp_path):
    # mlx-lm's gemma3_text needs at least sliding_window_pattern (6) layers.
    path, config, weights, stored = _write(tmp_path, "gemma3_text", 6, {"_proj": "Q8_0"})
    src = resolve(str(path))
    assert src.config["model_type"] == "gemma3_text"
    assert src.config["rope_theta"] == config["rope_theta"]
    assert src.config["head_dim"] == config["head_dim"]
    # A model built from the config alone is tied too (mlx-lm's gemma3_text ties in its sanitize).
    assert [k for k, _ in tree_flatten(build_model(src.config).parameters())] == src.weight_names()
    assert "lm_head.weight" not in src.weight_names()
    norms = [n for n in src.weight_names() if n.endswith("norm.weight")]
    assert any(".q_norm." in n for n in norms) and any("post_feedforward_layernorm" in n for n in norms)
    loaded = src.load_weights(norms)
    for n in norms:
        # The file holds 1 + w; mlx-lm wants w.
        np.testing.assert_allclose(np.array(loaded[n]), np.array(weights[n]), atol=1e-6)
    tok = src.tokenizer()
    np.testing.assert_allclose(np.array(src.model()(_ids(tok))), np.array(_reference(config, stored)(_ids(tok))), atol=1e-4)


def _llama_cpp_rope_factors(theta: float, dim: int, rs: dict) -> list[float]:
    """llama.cpp's convert_hf_to_gguf loop for Llama 3 ``rope_freqs`` (written out independently)."""
    factors = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi / (1.0 / theta ** (i / dim))
        old = rs["original_max_position_embeddings"]
        if wavelen < old / rs["high_freq_factor"]:
            factors.append(1.0)
        elif wavelen > old / rs["low_freq_factor"]:
            factors.append(rs["factor"])
        else:
            smooth = (old / wavelen - rs["low_freq_factor"]) / (rs["high_freq_factor"] - rs["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rs["factor"] + smooth))
    return factors


def test_llama3_rope_freqs_become_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    config = dict(tiny_config("llama", 2), rope_theta=500000.0, rope_scaling=rope)
    weights = random_weights(config, seed=5)
    factors = _llama_cpp_rope_factors(config["rope_theta"], config["head_dim"], rope)
    assert {1.0, 32.0} < set(factors)  # all three regions of the rule are exercised
    path = tmp_path / "llama3.gguf"
    stored = write_tiny_gguf(path, config, weights, extra={"rope_freqs.weight": np.array(factors)})
    src = resolve(str(path))
    assert src.config["rope_scaling"] == rope
    assert "rope_freqs.weight" not in src.weight_names()
    ids = mx.array([list(range(3, 300))])  # long enough for the low frequencies to matter
    np.testing.assert_allclose(np.array(src.model()(ids)), np.array(_reference(config, stored)(ids)), atol=1e-4)

    bad = tmp_path / "bad_rope.gguf"
    write_tiny_gguf(bad, config, weights, extra={"rope_freqs.weight": np.linspace(1, 7, len(factors))})
    with pytest.raises(ValueError, match="rope_freqs"):
        resolve(str(bad))


def test_gguf_tokenizer_rebuilt_from_metadata(tmp_path):
    path, config, _, _ = _write(tmp_path, "llama", 2, {})
    src = resolve(str(path))
    tok = src.tokenizer()
    ref = tiny_tokenizer()
    for text in (TEXT, "def add(a, b):\n    return a + b", "Rain fell on the bridge."):
        assert tok.encode(text) == ref.encode(text)
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("<|im_start|>") == [ref.convert_tokens_to_ids("<|im_start|>")]
    assert tok.eos_token_ids == {ref.eos_token_id}
    messages = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(messages, tokenize=False)
    assert tok.chat_template == CHAT_TEMPLATE
    src.save_tokenizer(tmp_path / "out")
    saved = load_tokenizer(tmp_path / "out")
    assert saved.encode(TEXT) == ref.encode(TEXT)
    assert saved.apply_chat_template(messages, tokenize=False) == ref.apply_chat_template(messages, tokenize=False)


def test_gemma3_sentencepiece_tokenizer(tmp_path):
    vocab = spm_vocab()
    config = tiny_config("gemma3_text", 6, vocab_size=len(vocab["tokens"]))
    path = tmp_path / "gemma_spm.gguf"
    write_tiny_gguf(path, config, random_weights(config), vocab=vocab)
    src = resolve(str(path))
    tok = src.tokenizer()
    idx = {t: i for i, t in enumerate(vocab["tokens"])}
    # SentencePiece BPE by piece rank: h e l l o -> h e ll o -> h e llo -> he llo; BOS first (llama.cpp's default).
    assert tok.encode("hello world") == [idx["<bos>"], idx["he"], idx["llo"], idx["\u2581world"]]
    # Characters outside the pieces fall back to byte tokens.
    assert tok.encode("hello, world!")[3] == idx["<0x2C>"]
    assert tok.decode(tok.encode("hello, world!"), skip_special_tokens=True) == "hello, world!"
    assert tok.encode("<end_of_turn>")[-1] == idx["<end_of_turn>"]
    assert tok.eos_token_ids == {idx["<eos>"]}


def test_gguf_reads_only_requested_tensors(tmp_path, monkeypatch):
    path, _, _, _ = _write(tmp_path, "llama", 4, {"_proj": "Q8_0"})
    src = resolve(str(path))
    src.weight_names()
    seen = []
    real = gguf.quants.dequantize

    def counting(data, qtype):
        seen.append(data.shape)
        return real(data, qtype)

    monkeypatch.setattr(gguf.quants, "dequantize", counting)
    layer = src.layer_weights(2)
    assert len(seen) == len(layer) == 9
    assert all(n.startswith("model.layers.2.") for n in layer)


def _bare_gguf(path, arch: str):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_gguf_architecture(tmp_path):
    with pytest.raises(ValueError, match="'gpt2'"):
        resolve(str(_bare_gguf(tmp_path / "gpt2.gguf", "gpt2")))


def test_gguf_missing_metadata(tmp_path):
    with pytest.raises(ValueError, match=r"lacks the metadata key llama\.attention\.head_count"):
        resolve(str(_bare_gguf(tmp_path / "bare.gguf", "llama")))


def test_corrupt_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="junk.gguf"):
        resolve(str(path))


ENGLISH = (
    "The morning train left the station a few minutes late. Most of the passengers were reading or "
    "looking out of the window at the fields, which were still wet from the night's rain. A young woman "
    "near the door was talking quietly on her phone about a meeting she was going to miss. When the train "
    "stopped at the next town, an old man with a small dog got on and sat down across from her. The dog "
    "looked up at everyone with great interest, and soon half of the carriage was smiling at it."
)


@pytest.mark.slow
def test_bundled_default_generates_and_has_sane_perplexity(bundled_gguf):
    src = resolve("smollm2-135m")
    assert src.kind == "default" and src.path == bundled_gguf
    cfg = src.config
    assert (cfg["model_type"], cfg["num_hidden_layers"], cfg["hidden_size"]) == ("llama", 30, 576)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    model, tok = src.model(), src.tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True)
    assert "Paris" in generate(model, tok, prompt, max_tokens=24)
    ids = mx.array([tok.encode(ENGLISH)])
    logits = model(ids[:, :-1])
    nll = nn.losses.cross_entropy(logits, ids[:, 1:], reduction="mean").item()
    # A 135M model on plain English: well under 30; a wrong Q/K order or tokenizer gives hundreds.
    assert math.exp(nll) < 30
