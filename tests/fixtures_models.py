"""Tiny random-weight models saved as Hugging Face folders, for fast tests.

Models are mlx-lm's own classes (llama, qwen2, qwen3_moe) with random weights;
the tokenizer is a small byte-level BPE trained here on a few lines written
here. Widths are multiples of 128 so every MLX group size (32/64/128) applies.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

from mlx_dq.model.sources import build_model

TRAIN_TEXT = [
    "The quick brown fox jumps over the lazy dog near the quiet river bank.",
    "A small model learns to count: one, two, three, four, five, six, seven.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))",
    "Question: what is the capital of France? Answer: the capital is Paris.",
    "Rain fell on the old stone bridge while the town slept until morning.",
    "x = 3 * (y + 4) - z / 2; the sum of the squares is x^2 + y^2.",
    "She said hello, he said goodbye, and the cat said nothing at all.",
]
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
VOCAB_SIZE = 320


@lru_cache(maxsize=4)
def tiny_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE ``PreTrainedTokenizerFast`` of exactly ``vocab_size`` tokens, trained on TRAIN_TEXT."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAIN_TEXT * 4, trainer)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}: give more text")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def tiny_config(
    model_type: str,
    num_layers: int = 2,
    *,
    hidden: int = 128,
    intermediate: int = 256,
    heads: int = 4,
    kv_heads: int = 2,
    vocab_size: int = VOCAB_SIZE,
    num_experts: int = 4,
    top_k: int = 2,
    tie: bool | None = None,
) -> dict:
    """An HF-style config.json dict for a tiny llama / qwen2 / qwen3_moe / gemma3_text model."""
    tok = tiny_tokenizer(vocab_size)
    cfg = {
        "model_type": model_type,
        "hidden_size": hidden,
        "num_hidden_layers": num_layers,
        "intermediate_size": intermediate,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "rms_norm_eps": 1e-5,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "max_position_embeddings": 512,
        "tie_word_embeddings": model_type in ("qwen2", "gemma3_text") if tie is None else tie,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    if model_type == "llama":
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif model_type == "qwen2":
        cfg["architectures"] = ["Qwen2ForCausalLM"]
    elif model_type == "gemma3_text":
        cfg.update(
            architectures=["Gemma3ForCausalLM"],
            query_pre_attn_scalar=hidden // heads,
            sliding_window=512,
            rope_theta=1_000_000.0,
            rope_local_base_freq=10000.0,
        )
    elif model_type == "qwen3_moe":
        cfg.update(
            architectures=["Qwen3MoeForCausalLM"],
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            moe_intermediate_size=intermediate // 2,
            norm_topk_prob=True,
        )
    else:
        raise ValueError(f"no tiny config for model type {model_type!r}")
    return cfg


def random_weights(config: dict, seed: int = 0) -> dict[str, mx.array]:
    """Random float32 weights for ``config`` under HF checkpoint names (qwen3_moe experts one by one)."""
    mx.random.seed(seed)
    model = build_model(config)
    rng = np.random.default_rng(seed)
    out: dict[str, mx.array] = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            # Not all ones, so a wrong norm offset or a swapped norm shows in the logits.
            p = mx.array(1.0 + 0.2 * rng.standard_normal(p.shape).astype(np.float32))
        elif name.endswith(".bias"):
            p = mx.array(0.05 * rng.standard_normal(p.shape).astype(np.float32))
        p = p.astype(mx.float32)
        if ".switch_mlp." in name:
            layer, proj = name.split(".mlp.switch_mlp.")
            for e in range(p.shape[0]):
                out[f"{layer}.mlp.experts.{e}.{proj}"] = p[e]
        else:
            out[name] = p
    mx.eval(out)
    return out


def save_tokenizer(dst: Path, vocab_size: int = VOCAB_SIZE) -> None:
    """Write tokenizer.json, tokenizer_config.json and the chat template into ``dst``."""
    tiny_tokenizer(vocab_size).save_pretrained(str(dst))


def make_tiny_model_folder(
    tmp: Path,
    model_type: str,
    num_layers: int = 2,
    *,
    shards: int = 1,
    seed: int = 0,
    dtype: mx.Dtype = mx.float32,
    name: str | None = None,
    **config_kwargs,
) -> Path:
    """Save a tiny random ``model_type`` model as an HF folder under ``tmp`` and return the folder.

    ``shards > 1`` splits the weights over ``model-0000i-of-0000n.safetensors`` with an index file.
    Extra keyword arguments go to :func:`tiny_config` (hidden, intermediate, heads, tie, ...).
    """
    config = tiny_config(model_type, num_layers, **config_kwargs)
    folder = Path(tmp) / (name or f"{model_type}-{num_layers}l-s{seed}" + (f"-{shards}sh" if shards > 1 else ""))
    folder.mkdir(parents=True, exist_ok=True)
    weights = {k: v.astype(dtype) for k, v in random_weights(config, seed).items()}
    if config["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    if shards <= 1:
        mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    else:
        keys = list(weights)
        weight_map = {}
        for s, chunk in enumerate(np.array_split(np.arange(len(keys)), shards)):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {keys[i]: weights[keys[i]] for i in chunk}
            mx.save_safetensors(str(folder / fname), part, metadata={"format": "mlx"})
            weight_map.update({k: fname for k in part})
        index = {"metadata": {"total_size": sum(v.nbytes for v in weights.values())}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    save_tokenizer(folder, config["vocab_size"])
    return folder


# -- GGUF files written the way llama.cpp's convert_hf_to_gguf.py writes them ------------------------------

GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "gemma3_text": "gemma3"}
GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` of Q/K rows (HF half-split rotary -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_name(hf: str, model_type: str) -> str:
    base, kind = hf.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, bid, rest = base.split(".", 3)
        if rest == "post_attention_layernorm":
            leaf = "post_attention_norm" if model_type == "gemma3_text" else "ffn_norm"
        elif rest == "pre_feedforward_layernorm":
            leaf = "ffn_norm"
        elif rest == "post_feedforward_layernorm":
            leaf = "post_ffw_norm"
        else:
            leaf = GGUF_NAMES[rest]
        return f"blk.{bid}.{leaf}.{kind}"
    return f"{GGUF_NAMES[base]}.{kind}"


def random_q4_k(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random but valid Q4_K blocks (144 bytes per 256 weights) for a ``[rows, cols]`` tensor."""
    import gguf

    rng = np.random.default_rng(seed)
    n_blocks = cols // 256
    blocks = rng.integers(0, 256, size=(rows, n_blocks, 144), dtype=np.uint8)
    scales = np.stack([rng.uniform(0.002, 0.01, (rows, n_blocks)), rng.uniform(0.0, 0.01, (rows, n_blocks))], -1)
    blocks[..., :4] = scales.astype(np.float16).view(np.uint8).reshape(rows, n_blocks, 4)
    out = blocks.reshape(rows, n_blocks * 144)
    assert gguf.quants.quant_shape_from_byte_shape(out.shape, gguf.GGMLQuantizationType.Q4_K) == (rows, cols)
    return out


def gpt2_vocab(vocab_size: int = VOCAB_SIZE) -> dict:
    """GGUF tokenizer metadata (llama.cpp's "gpt2" byte-level BPE) of :func:`tiny_tokenizer`."""
    tok = tiny_tokenizer(vocab_size)
    state = json.loads(tok.backend_tokenizer.to_str())
    tokens = [t for t, _ in sorted(state["model"]["vocab"].items(), key=lambda kv: kv[1])]
    return {
        "model": "gpt2",
        "tokens": tokens,
        "types": [3 if t in SPECIAL_TOKENS else 1 for t in tokens],
        "merges": [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]],
        "bos": tok.bos_token_id,
        "eos": tok.eos_token_id,
        "add_bos": False,
    }


SPM_PIECES = ["\u2581", "h", "e", "l", "o", "w", "r", "d", "t", "\u2581h", "\u2581w", "ll", "llo", "\u2581hello",
              "or", "orl", "orld", "\u2581world", "\u2581t", "he", "\u2581the"]


def spm_vocab() -> dict:
    """GGUF tokenizer metadata of a tiny SentencePiece ("llama") vocabulary, as Gemma files carry.

    Pieces are listed best first, as Gemma's converter writes them; ``<0xNN>`` byte pieces cover the rest.
    """
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + SPM_PIECES
    return {
        "model": "llama",
        "tokens": tokens,
        "types": [3, 3, 3, 2, 3, 3] + [6] * 256 + [1] * len(SPM_PIECES),
        "scores": [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(SPM_PIECES))],
        "bos": 2,
        "eos": 1,
    }


def write_tiny_gguf(
    path: Path,
    config: dict,
    weights: dict[str, mx.array],
    qtypes: dict[str, str] | None = None,
    default_qtype: str = "F32",
    extra: dict[str, np.ndarray] | None = None,
    vocab: dict | None = None,
) -> dict[str, np.ndarray]:
    """Write ``weights`` (HF names) as a GGUF for llama/qwen2/gemma3 the way llama.cpp does; return what was stored.

    ``qtypes`` maps a substring of an HF name to a GGML type name ("Q8_0", "Q4_K", "F16", ...);
    "Q4_K" stores random valid blocks (the gguf package cannot quantize K-quants) instead of the weight.
    ``vocab`` is the tokenizer metadata (:func:`gpt2_vocab`, the default, or :func:`spm_vocab`).
    ``extra`` holds float32 tensors stored as is under their GGUF names (e.g. ``rope_freqs.weight``).
    The returned dict holds, per HF name, the float weight the file now represents in HF layout.
    """
    import gguf

    arch = GGUF_ARCH[config["model_type"]]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])

    vocab = vocab or gpt2_vocab(config["vocab_size"])
    writer.add_tokenizer_model(vocab["model"])
    writer.add_tokenizer_pre(vocab.get("pre", "default"))
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if "scores" in vocab:
        writer.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(vocab["bos"])
    writer.add_eos_token_id(vocab["eos"])
    if "add_bos" in vocab:
        writer.add_add_bos_token(vocab["add_bos"])
    writer.add_chat_template(CHAT_TEMPLATE)

    qtypes = qtypes or {}
    stored: dict[str, np.ndarray] = {}
    for i, (name, w) in enumerate(weights.items()):
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue
        w = np.array(w.astype(mx.float32))
        hf_w = w
        if arch == "gemma3" and name.endswith("norm.weight"):
            w = w + 1.0
        if arch == "llama" and ".q_proj." in name:
            w = llama_cpp_permute(w, config["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            w = llama_cpp_permute(w, config["num_key_value_heads"])
        qname = next((q for key, q in qtypes.items() if key in name), default_qtype) if w.ndim == 2 else "F32"
        qtype = gguf.GGMLQuantizationType[qname]
        if qname == "Q4_K":
            data = random_q4_k(*w.shape, seed=i)
        else:
            data = gguf.quants.quantize(w, qtype)
        stored_w = gguf.quants.dequantize(data, qtype).reshape(w.shape).astype(np.float32)
        if arch == "llama" and ".q_proj." in name:
            stored_w = _inverse(stored_w, config["num_attention_heads"])
        if arch == "llama" and ".k_proj." in name:
            stored_w = _inverse(stored_w, config["num_key_value_heads"])
        if arch == "gemma3" and name.endswith("norm.weight"):
            stored_w = stored_w - 1.0
        stored[name] = stored_w if qname != "F32" else hf_w
        writer.add_tensor(_gguf_name(name, config["model_type"]), data, raw_dtype=qtype if qname not in ("F32", "F16") else None)
    for gguf_name, data in (extra or {}).items():
        writer.add_tensor(gguf_name, np.asarray(data, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def _inverse(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of :func:`llama_cpp_permute`, found by permuting row indices (independent of the product code)."""
    idx = llama_cpp_permute(np.arange(w.shape[0]), n_head)
    out = np.empty_like(w)
    out[idx] = w
    return out
