"""Names: a tensor's role, its decoder layer and whether it is embedding/head, read from its path.

One classifier and one layer pattern for the whole package (grids, measurement
files, sources, reports, plots and the optimizer all read paths through here),
so a name means the same thing at every stage.
"""

from __future__ import annotations

import re
from typing import Iterable, Mapping

MANIFEST_NAME = "mlx_dq.json"  # an output folder's manifest
MANIFEST_SCHEMA = "mlx_dq.manifest"
MODEL_FILE = "mlx_dq_model.py"  # the model file shim of folders with mixed-proportion layers

# Files of a source model folder that an output carries unchanged (cf. mlx-lm's download patterns).
CARRIED_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "*.tiktoken", "tiktoken.model",
    "chat_template.jinja", "chat_template.json", "generation_config.json",
)

ROLES = ("attn_in", "attn_out", "mlp_in", "mlp_out", "embed_head", "expert_in", "expert_out", "default")
HEAD_ROLES = ("embed_head", "embed", "head")  # "embed"/"head": roles of older measurement files

_ATTN_IN = {"q_proj", "k_proj", "v_proj", "qkv", "qkv_proj", "query_key_value", "wqkv", "c_attn", "wq", "wk", "wv"}
_ATTN_OUT = {"o_proj", "out_proj", "dense", "wo"}
_MLP_IN = {"gate_proj", "up_proj", "gate_up_proj", "w1", "w3", "fc1", "c_fc", "dense_h_to_4h"}
_MLP_OUT = {"down_proj", "w2", "fc2", "dense_4h_to_h"}
_EMBED_HEAD = {"embed_tokens", "lm_head", "wte", "tok_embeddings", "token_embd", "word_embeddings", "embeddings",
               "output"}
_EXPERT = re.compile(r"(^|\.)(switch_mlp|experts)(\.|$)")

# a numbered block of a layer container: ``model.layers.3.mlp`` -> ("layers", 3); GPT-2's ``h.3``, ``blocks.3``
LAYER_RE = re.compile(r"(?:^|\.)(layers|layer|h|blocks|block)\.(\d+)(?=\.|$)")
DECODER_CONTAINERS = ("layers",)  # what checkpoints and manifests name their decoder layers


def role_of(name: str) -> str:
    """Role of a parameter path such as ``model.layers.3.self_attn.q_proj(.weight)``.

    Expert banks (``switch_mlp.*``, ``experts.*``) map to ``expert_in`` /
    ``expert_out``; unknown layers map to ``"default"``.
    """
    parts = [p for p in name.split(".") if p]
    if parts and parts[-1] in ("weight", "scales", "biases"):
        parts = parts[:-1]
    if not parts:
        raise ValueError(f"empty parameter path: {name!r}")
    leaf = parts[-1].lower()
    parents = {p.lower() for p in parts[:-1]}
    if _EXPERT.search(".".join(parts[:-1]).lower()):
        return "expert_out" if leaf in _MLP_OUT else "expert_in"
    if leaf in _EMBED_HEAD and (leaf != "output" or len(parts) == 1):
        return "embed_head"
    if leaf == "c_proj":  # GPT-2 style: c_proj ends both attention and MLP
        return "mlp_out" if parents & {"mlp", "ffn", "feed_forward"} else "attn_out"
    if leaf in _ATTN_IN:
        return "attn_in"
    if leaf in _ATTN_OUT:
        return "mlp_out" if leaf == "dense" and parents & {"mlp", "ffn"} else "attn_out"
    if leaf in _MLP_IN:
        return "mlp_in"
    if leaf in _MLP_OUT:
        return "mlp_out"
    return "default"


def split_layer(name: str, containers: Iterable[str] | None = DECODER_CONTAINERS) -> tuple[str, int, str] | None:
    """``(prefix, index, rest)`` of a path inside a numbered layer (``model.layers.``, 3, ``mlp.down_proj``), or None.

    ``containers`` limits the container names (None: any of ``layers``, ``layer``, ``h``, ``blocks``, ``block``).
    """
    allowed = None if containers is None else set(containers)
    for m in LAYER_RE.finditer(name):
        if allowed is None or m.group(1) in allowed:
            start = m.start(1)
            return name[:start] + m.group(1) + ".", int(m.group(2)), name[m.end():].lstrip(".")
    return None


def layer_index(name: str, containers: Iterable[str] | None = DECODER_CONTAINERS) -> int | None:
    """The decoder layer a parameter path belongs to (``...layers.N....``), or ``None``."""
    found = split_layer(name, containers)
    return None if found is None else found[1]


def in_head_scope(role: str, key: str, tied: Mapping[str, str] | None = None) -> bool:
    """Whether a tensor is the embedding or head (planned with ``--head-option``), tied pairs included."""
    tied = tied or {}
    return role in HEAD_ROLES or key in tied or key in tied.values()


def default_bits_group(entries: Iterable[tuple[int, int, int]]) -> tuple[int, int]:
    """config.json's default ``(bits, group_size)``: the most common setting by weights over ``(bits, gs, numel)``.

    Ties go to the setting seen first; (4, 64) when there is none. Every quantized
    module is listed on its own as well, so this only sets the folder-wide entry.
    """
    weight: dict[tuple[int, int], int] = {}
    for bits, gs, numel in entries:
        weight[(bits, gs)] = weight.get((bits, gs), 0) + int(numel)
    return max(weight, key=weight.get) if weight else (4, 64)
