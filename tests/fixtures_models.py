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

from mlx_dq.sources import build_model

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
    """An HF-style config.json dict for a tiny llama / qwen2 / qwen3_moe model."""
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
        "tie_word_embeddings": model_type == "qwen2" if tie is None else tie,
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    if model_type == "llama":
        cfg["architectures"] = ["LlamaForCausalLM"]
    elif model_type == "qwen2":
        cfg["architectures"] = ["Qwen2ForCausalLM"]
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
