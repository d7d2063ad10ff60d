"""One reading of tensor paths for every stage: roles, decoder-layer index, head scope, config.json's default."""

from __future__ import annotations

import pytest

from mlx_dq.names import (
    default_bits_group,
    in_head_scope,
    layer_index,
    role_of,
    split_layer,
)


@pytest.mark.parametrize("path,expected", [
    ("model.layers.12.mlp.down_proj", ("model.layers.", 12, "mlp.down_proj")),
    ("layers.0.attention.wq.weight", ("layers.", 0, "attention.wq.weight")),
    ("model.embed_tokens", None),
    ("lm_head", None),
    ("transformer.h.3.attn.c_attn", None),  # GPT-2's blocks are not decoder layers of a checkpoint's layout
])
def test_split_layer_reads_decoder_layers(path, expected):
    assert split_layer(path) == expected


def test_other_containers_on_request():
    assert split_layer("transformer.h.3.attn.c_attn", containers=None) == ("transformer.h.", 3, "attn.c_attn")
    assert layer_index("blocks.7.ff", containers=None) == 7 and layer_index("blocks.7.ff") is None
    assert layer_index("model.layers.5.self_attn.q_proj.weight") == 5


def test_one_role_classifier_for_grids_and_measurement_files():
    from mlx_dq.measure import records as measurement

    assert measurement.role_of is role_of  # the grids name roles, the measurement files classify by this one
    assert role_of("transformer.word_embeddings") == "embed_head"
    assert role_of("transformer.h.0.attn.c_proj") == "attn_out" and role_of("transformer.h.0.mlp.c_proj") == "mlp_out"
    assert role_of("model.layers.0.mlp.switch_mlp.down_proj") == "expert_out"


def test_head_scope_includes_tied_pairs():
    assert in_head_scope("embed_head", "model.embed_tokens")
    assert not in_head_scope("mlp_in", "model.layers.0.mlp.up_proj")
    assert in_head_scope("default", "model.embed_tokens", {"lm_head": "model.embed_tokens"})


def test_default_bits_and_group_are_the_most_common_by_weights():
    # two small 4-bit tensors and one large 3-bit tensor: weights decide, not the count of modules
    assert default_bits_group([(4, 64, 100), (4, 64, 100), (3, 64, 1000)]) == (3, 64)
    assert default_bits_group([(4, 64, 10), (3, 32, 10)]) == (4, 64)  # a tie goes to the first seen
    assert default_bits_group([]) == (4, 64)
