"""Read GGUF files (llama, qwen2, gemma3) as float weights, an mlx-lm config and a tokenizer.

The file is memory-mapped with ``gguf.GGUFReader``; a tensor is dequantized
(``gguf.quants.dequantize``: every GGML type, K-quants and IQ types included)
only when it is asked for. Three things llama.cpp's converter changes are
undone here:

* llama Q/K projection rows are permuted for llama.cpp's rotary layout
  (``convert_hf_to_gguf.py``: ``LlamaModel.permute``); qwen2 and gemma3 are not.
* gemma3 stores every ``*norm.weight`` as ``1 + w``; mlx-lm's ``gemma3_text``
  (like transformers) stores ``w`` and computes ``1 + w`` itself.
* ``rope_theta`` goes to the top level of the config (mlx-lm reads it there;
  a missing value silently means 10000).
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Any, Iterable

import gguf
import mlx.core as mx
import numpy as np

from mlx_dq.errors import InputError

MT = gguf.MODEL_TENSOR

# GGUF tensor kind -> Hugging Face module path, shared by the supported families.
_COMMON_NAMES: dict[Any, str] = {
    MT.TOKEN_EMBD: "model.embed_tokens",
    MT.OUTPUT_NORM: "model.norm",
    MT.OUTPUT: "lm_head",
    MT.ATTN_NORM: "model.layers.{bid}.input_layernorm",
    MT.ATTN_Q: "model.layers.{bid}.self_attn.q_proj",
    MT.ATTN_K: "model.layers.{bid}.self_attn.k_proj",
    MT.ATTN_V: "model.layers.{bid}.self_attn.v_proj",
    MT.ATTN_OUT: "model.layers.{bid}.self_attn.o_proj",
    MT.FFN_NORM: "model.layers.{bid}.post_attention_layernorm",
    MT.FFN_GATE: "model.layers.{bid}.mlp.gate_proj",
    MT.FFN_UP: "model.layers.{bid}.mlp.up_proj",
    MT.FFN_DOWN: "model.layers.{bid}.mlp.down_proj",
}
_GEMMA3_NAMES: dict[Any, str] = {
    **_COMMON_NAMES,
    MT.ATTN_Q_NORM: "model.layers.{bid}.self_attn.q_norm",
    MT.ATTN_K_NORM: "model.layers.{bid}.self_attn.k_norm",
    MT.ATTN_POST_NORM: "model.layers.{bid}.post_attention_layernorm",
    MT.FFN_NORM: "model.layers.{bid}.pre_feedforward_layernorm",
    MT.FFN_POST_NORM: "model.layers.{bid}.post_feedforward_layernorm",
}

# GGUF architecture -> (mlx-lm model_type, HF architectures entry, tensor names).
SUPPORTED_ARCHS: dict[str, tuple[str, str, dict[Any, str]]] = {
    "llama": ("llama", "LlamaForCausalLM", _COMMON_NAMES),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", _COMMON_NAMES),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", _GEMMA3_NAMES),
}

# Tensors that carry no weight of their own in mlx-lm (derived from the config).
_IGNORED = {gguf.TENSOR_NAMES[MT.ROPE_FREQS] + ".weight"}


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight (or bias) with ``n_head`` heads."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_divisors(theta: float, dim: int, scaling: dict) -> np.ndarray:
    """Per-frequency divisors of Llama 3 rope scaling, as llama.cpp computes them for ``rope_freqs``."""
    freqs = 1.0 / theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mid = 1.0 / ((1.0 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


class GGUFFile:
    """A memory-mapped GGUF model: HF-named tensors, an mlx-lm config, tokenizer files."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the gguf package raises ValueError/struct errors on junk
            raise InputError(f"{self.path} is not a readable GGUF file: {e}") from e
        self.arch = str(self.meta("general.architecture", ""))
        if self.arch not in SUPPORTED_ARCHS:
            raise InputError(
                f"GGUF architecture {self.arch!r} in {self.path} is not supported; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHS))}"
            )
        if int(self.meta("split.count", 1)) > 1:
            raise InputError(f"{self.path} is one part of a split GGUF; merge the parts first (llama-gguf-split --merge)")

    def meta(self, key: str, default: Any = None) -> Any:
        """One metadata value (scalars, strings and arrays as Python values), or ``default``."""
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def _arch_meta(self, key: str, default: Any = None, required: bool = False) -> Any:
        value = self.meta(f"{self.arch}.{key}", default)
        if required and value is None:
            raise InputError(f"{self.path} lacks the metadata key {self.arch}.{key}")
        return value

    @cached_property
    def tensors(self) -> dict[str, Any]:
        """HF tensor name -> ``gguf.ReaderTensor`` (no data read)."""
        names = SUPPORTED_ARCHS[self.arch][2]
        n_layers = int(self._arch_meta("block_count", required=True))
        to_hf: dict[str, str] = {}
        for kind, hf in names.items():
            base = gguf.TENSOR_NAMES[kind]
            for bid in range(n_layers) if "{bid}" in base else [None]:
                for suffix in (".weight", ".bias"):
                    to_hf[base.format(bid=bid) + suffix] = hf.format(bid=bid) + suffix
        out = {}
        for t in self.reader.tensors:
            if t.name in _IGNORED:
                continue
            if t.name not in to_hf:
                raise InputError(f"GGUF tensor {t.name!r} in {self.path} has no mlx-lm name for {self.arch}")
            out[to_hf[t.name]] = t
        return out

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one HF-named tensor in HF layout (``[out, in]`` for a linear weight)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def read(self, names: Iterable[str]) -> dict[str, mx.array]:
        """Dequantize only the named tensors to float32, undoing llama.cpp's layout changes."""
        cfg = self.config
        out = {}
        for name in names:
            t = self.tensors[name]
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
            w = w.reshape(self.shape(name))
            if self.arch == "llama" and ".self_attn.q_proj." in name:
                w = unpermute_qk(w, cfg["num_attention_heads"])
            elif self.arch == "llama" and ".self_attn.k_proj." in name:
                w = unpermute_qk(w, cfg["num_key_value_heads"])
            if self.arch == "gemma3" and name.endswith("norm.weight"):
                w = w - 1.0
            out[name] = mx.array(w)
        return out

    @cached_property
    def config(self) -> dict:
        """An mlx-lm/HF-style config.json dict built from the GGUF metadata."""
        model_type, hf_arch, _ = SUPPORTED_ARCHS[self.arch]
        m = self._arch_meta
        n_heads = int(m("attention.head_count", required=True))
        n_kv = m("attention.head_count_kv", n_heads)
        hidden = int(m("embedding_length", required=True))
        n_layers = int(m("block_count", required=True))
        vocab = int(m("vocab_size", 0))
        if "model.embed_tokens.weight" in self.tensors:
            vocab = self.shape("model.embed_tokens.weight")[0]
        cfg: dict[str, Any] = {
            "model_type": model_type,
            "architectures": [hf_arch],
            "hidden_size": hidden,
            "num_hidden_layers": n_layers,
            "intermediate_size": int(m("feed_forward_length", required=True)),
            "num_attention_heads": n_heads,
            "num_key_value_heads": int(n_kv if not isinstance(n_kv, list) else n_kv[0]),
            "rms_norm_eps": float(m("attention.layer_norm_rms_epsilon", 1e-6)),
            "vocab_size": vocab,
            "max_position_embeddings": int(m("context_length", 4096)),
            "tie_word_embeddings": "lm_head.weight" not in self.tensors,
            "rope_theta": float(m("rope.freq_base", 10000.0)),
        }
        head_dim = m("attention.key_length")
        if head_dim is not None:
            cfg["head_dim"] = int(head_dim)
        if (scaling := m("rope.scaling.type")) not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": scaling, "type": scaling, "factor": float(m("rope.scaling.factor", 1.0))}
            if (orig := m("rope.scaling.original_context_length")) is not None:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        if self.arch == "llama" and (freqs := self._rope_freqs()) is not None:
            cfg["rope_scaling"] = self._llama3_rope_scaling(freqs, cfg)
        if self.arch == "gemma3":
            hd = cfg.get("head_dim", hidden // n_heads)
            # llama.cpp: 27B (62 layers) scales queries by hidden/heads, the others by head_dim.
            cfg["query_pre_attn_scalar"] = hidden // n_heads if n_layers == 62 else hd
            if (window := m("attention.sliding_window")) is not None:
                cfg["sliding_window"] = int(window)
            cfg["rope_local_base_freq"] = 10000.0
        for key in ("bos_token_id", "eos_token_id", "padding_token_id"):
            if (tid := self.meta(f"tokenizer.ggml.{key}")) is not None:
                cfg[key.replace("padding", "pad")] = int(tid)
        return cfg

    def _rope_freqs(self) -> np.ndarray | None:
        """llama.cpp's per-frequency rope divisors (``rope_freqs.weight``), if the file has them."""
        name = gguf.TENSOR_NAMES[MT.ROPE_FREQS] + ".weight"
        for t in self.reader.tensors:
            if t.name == name:
                return gguf.quants.dequantize(t.data, t.tensor_type).reshape(-1).astype(np.float64)
        return None

    def _llama3_rope_scaling(self, freqs: np.ndarray, cfg: dict) -> dict:
        """The HF ``llama3`` rope_scaling that produced ``freqs`` (llama.cpp stores only the result).

        The factor is the largest divisor; the other settings are Llama 3's published values
        (low 1, high 4, original context 8192), checked against every stored divisor.
        """
        scaling = {
            "rope_type": "llama3",
            "factor": float(freqs.max()),
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": int(self._arch_meta("rope.scaling.original_context_length", 8192)),
        }
        dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        if freqs.shape != (dim // 2,) or not np.allclose(llama3_rope_divisors(cfg["rope_theta"], dim, scaling), freqs, rtol=1e-4):
            raise InputError(f"{self.path}: rope_freqs does not match llama3 rope scaling; this rope variant is not supported")
        return scaling

    def tokenizer_config(self) -> dict:
        """The tokenizer's construction dict (special tokens, BOS/EOS flags, chat template)."""
        tokens = self.reader.fields.get("tokenizer.ggml.tokens")
        n_tokens = len(tokens.data) if tokens is not None else 0
        cfg: dict[str, Any] = {}
        for name, key in (("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding")):
            tid = self.meta(f"tokenizer.ggml.{key}_token_id")
            if tid is not None and 0 <= int(tid) < n_tokens:
                cfg[name] = tokens.contents(int(tid))
        tokenizer_type = self.meta("tokenizer.ggml.model")
        # llama.cpp adds BOS to a sentencepiece vocabulary unless the file says otherwise.
        cfg["add_bos_token"] = bool(self.meta("tokenizer.ggml.add_bos_token", tokenizer_type == "llama"))
        cfg["add_eos_token"] = bool(self.meta("tokenizer.ggml.add_eos_token", False))
        if (template := self.meta("tokenizer.chat_template")) is not None:
            cfg["chat_template"] = template
        return cfg

    def write_tokenizer(self, dst: str | Path) -> Path:
        """Rebuild the tokenizer from the GGUF metadata and save it (tokenizer.json, tokenizer_config.json, chat template) in ``dst``."""
        from transformers import PreTrainedTokenizerFast

        backend = self._backend_tokenizer()
        tok = PreTrainedTokenizerFast(tokenizer_object=backend, **self.tokenizer_config())
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(str(dst))
        return dst

    def _backend_tokenizer(self):
        """A ``tokenizers.Tokenizer`` for this vocabulary, built by transformers' GGUF tokenizer converter."""
        try:  # transformers >= 5
            from transformers.integrations.gguf.gguf_tokenizer_mapping import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:  # transformers 4.x
            from transformers.integrations.ggml import (
                GGUF_TOKENIZER_MAPPING,  # type: ignore
                convert_gguf_tokenizer,
            )

        fields = {}
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
            value = self.meta(f"tokenizer.{key}")
            if value is not None:
                fields[name] = value
        if not fields.get("tokens"):
            raise InputError(f"{self.path} has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        backend, _ = convert_gguf_tokenizer(self.arch, fields)
        if fields.get("pre_tokenizer_type") == "smollm":
            # llama.cpp's "smollm" pre-tokenizer splits digits one by one before the GPT-2 split.
            from tokenizers import pre_tokenizers

            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Digits(individual_digits=True), backend.pre_tokenizer]
            )
        return backend

    def write_config(self, dst: str | Path) -> Path:
        """Write the mlx-lm config.json built from the metadata into ``dst``."""
        dst = Path(dst)
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "config.json").write_text(json.dumps(self.config, indent=2))
        return dst / "config.json"
