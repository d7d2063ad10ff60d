"""Option data model: EXL2-style descriptions, geometry and exact storage bits."""

from __future__ import annotations

import math

import pytest

from mlx_dq.quant.options import QuantOption, Segment, perm_bits

# descriptions as they appear in ExLlamaV2 measurement files
EXL2_DESCS = [
    "0.05:3b_32g/0.95:2b_32g s4",
    "0.1:4b_32g/0.4:3b_32g/0.5:2b_32g s4",
    "0.05:8b_32g/0.05:6b_32g/0.9:5b_32g s4",
    "0.1:8b_128g/0.9:6b_128g s4",
    "0.6:4b_64g/0.4:3b_64g s4",
    "1.0:4b_128g s4",
]


@pytest.mark.parametrize("desc", EXL2_DESCS)
def test_exl2_descriptions_parse_and_print(desc: str) -> None:
    opt = QuantOption.parse(desc)
    assert opt.desc == desc.removesuffix(" s4")
    assert QuantOption.parse(opt.desc) == opt
    assert math.isclose(sum(s.prop for s in opt.segments), 1.0)
    assert QuantOption.from_exl2_qparams(opt.to_exl2_qparams()) == opt


def test_parse_normalises_order_spacing_and_keep16() -> None:
    opt = QuantOption.parse(" 0.9:3b_32g / 0.1:4b_32g ")
    assert opt.desc == "0.1:4b_32g/0.9:3b_32g" and opt.is_mixed and opt.max_bits == 4
    assert QuantOption.parse("1.0:4b_64g") == QuantOption.uniform(4, 64)
    assert QuantOption.parse("16bit").keep16 and QuantOption.parse("fp16") == QuantOption.fp16()
    assert str(QuantOption.fp16()) == "16bit"


@pytest.mark.parametrize(
    "desc,match",
    [
        ("", "empty option"),
        ("4bit", "cannot parse"),
        ("1.0:4b", "cannot parse"),
        ("1.0:7b_32g", "bits must be one of"),
        ("1.0:4b_48g", "group size must be one of"),
        ("0.5:4b_32g/0.4:3b_32g", "sum to 1"),
        ("0.5:4b_32g/0.5:4b_64g", "distinct"),
        ("0.0:4b_32g/1.0:3b_32g", "proportion"),
    ],
)
def test_bad_descriptions_are_named(desc: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        QuantOption.parse(desc)


def test_segment_validation() -> None:
    with pytest.raises(ValueError, match="bits"):
        Segment(1, 32, 1.0)
    with pytest.raises(ValueError, match="a 16-bit option has no segments"):
        QuantOption((Segment(4, 32, 1.0),), keep16=True)


def test_split_falls_on_groups_and_fast_path_boundaries() -> None:
    opt = QuantOption.parse("0.1:4b_32g/0.9:3b_64g")
    assert opt.split(576) == [64, 512]  # 10% of 576 rounded up to whole 64-groups
    assert opt.split(4096) == [512, 3584]  # wide tensors: multiples of 512
    three = QuantOption.parse("0.05:6b_32g/0.25:4b_32g/0.7:3b_32g")
    widths = three.split(1536)
    assert sum(widths) == 1536 and all(k % 32 == 0 for k in widths)
    with pytest.raises(ValueError, match="in_features=576"):
        QuantOption.uniform(4, 128).split(576)
    assert not QuantOption.uniform(4, 128).fits(576) and QuantOption.uniform(4, 64).fits(576)


def test_storage_bits_counts_codes_scales_and_permutation() -> None:
    assert QuantOption.uniform(4, 64).storage_bits((1536, 576)) == 1536 * 576 * 4 + 1536 * 9 * 32
    assert QuantOption.uniform(4, 64).bpw((1536, 576)) == 4.5
    mixed = QuantOption.parse("0.1:4b_32g/0.9:3b_64g")
    expect = 100 * (64 * 4 + 2 * 32 + 512 * 3 + 8 * 32) + 576 * 16
    assert mixed.storage_bits((100, 576)) == expect
    # one permutation per expert bank
    assert mixed.storage_bits((4, 100, 576)) == 4 * (expect - 576 * 16) + 576 * 16
    assert QuantOption.fp16().storage_bits((10, 64)) == 10 * 64 * 16
    assert perm_bits(576) == 16 and perm_bits(70000) == 32
    assert math.isclose(QuantOption.parse("0.25:3b_64g/0.75:2b_64g").nominal_bpw(), 2.75)


# ------------------------------------------------------------------ grids
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from mlx_dq.measure.grids import grid_names, load_grid  # noqa: E402
from mlx_dq.names import ROLES, role_of  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["default", "fast"])
def test_builtin_grids_cover_roles_and_range(name: str) -> None:
    grid = load_grid(name)
    assert tuple(grid) == ROLES
    for role, opts in grid.items():
        assert 5 <= len(opts) <= 25, role
        bpws = [o.nominal_bpw() for o in opts]
        assert bpws == sorted(bpws)
        assert min(bpws) <= 2.5 and max(bpws) >= 8.5, role
        assert any(o.is_mixed for o in opts) and any(not o.is_mixed for o in opts)
        assert not any(o.keep16 for o in opts)
        assert len([o for o in opts if o.fits(576)]) >= 5  # small models: in_features 576
    if name == "default":
        assert min(o.nominal_bpw() for o in grid["attn_in"]) <= 2.25
        assert 15 <= len(grid["attn_in"]) <= 25


def test_grid_files_ship_with_package_and_match_user_copies() -> None:
    assert {"default", "fast"} <= set(grid_names())
    top = REPO / "configs"
    if not top.is_dir():
        pytest.skip("not a source checkout")
    for name in grid_names():
        shipped = (REPO / "mlx_dq" / "configs" / f"{name}.json").read_text()
        assert (top / f"{name}.json").read_text() == shipped, f"configs/{name}.json differs from the package copy"


def test_user_grid_from_path_fills_missing_roles(tmp_path) -> None:
    path = tmp_path / "g.json"
    path.write_text(json.dumps({"roles": {"attn_in": ["1.0:4b_64g", "0.1:5b_64g/0.9:4b_64g"], "default": ["1.0:3b_64g"]}}))
    grid = load_grid(path)
    assert [o.desc for o in grid["attn_in"]] == ["1.0:4b_64g", "0.1:5b_64g/0.9:4b_64g"]
    assert [o.desc for o in grid["mlp_out"]] == ["1.0:3b_64g"]
    path.write_text(json.dumps({"roles": {"mlp_in": ["1.0:8b_64g"]}}))
    grid = load_grid(str(path))
    assert [o.desc for o in grid["mlp_in"]] == ["1.0:8b_64g"]
    assert grid["embed_head"] == load_grid()["embed_head"]


@pytest.mark.parametrize(
    "content,match",
    [
        ({"roles": {"attention": ["1.0:4b_64g"]}}, "unknown role 'attention'"),
        ({"roles": {"mlp_in": ["1.0:4b_64g", "1.0:9b_64g"]}}, r"role 'mlp_in' entry 1 \('1.0:9b_64g'\)"),
        ({"roles": {"mlp_in": ["16bit"]}}, "16-bit is chosen by the optimizer"),
        ({"roles": {"mlp_in": ["1.0:4b_64g", "1.0:4b_64g s4"]}}, "twice"),
        ({"roles": {"mlp_in": []}}, "non-empty list"),
        ({"mlp_in": ["1.0:4b_64g"]}, "'roles' object"),
        ({"roles": {}, "bits": 4}, "unknown top-level keys"),
    ],
)
def test_bad_user_grids_are_named(content: dict, match: str, tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        load_grid(path)


def test_grid_file_errors(tmp_path) -> None:
    with pytest.raises(ValueError, match="not found"):
        load_grid(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="unknown option grid 'huge'"):
        load_grid("huge")
    (tmp_path / "broken.json").write_text("{roles: ")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_grid(tmp_path / "broken.json")


@pytest.mark.parametrize(
    "name,role",
    [
        ("model.layers.3.self_attn.q_proj", "attn_in"),
        ("model.layers.3.self_attn.k_proj.weight", "attn_in"),
        ("model.layers.3.self_attn.qkv_proj", "attn_in"),
        ("model.layers.3.self_attn.o_proj", "attn_out"),
        ("model.layers.3.attention.out_proj", "attn_out"),
        ("transformer.h.0.self_attention.dense", "attn_out"),
        ("model.layers.3.mlp.gate_proj", "mlp_in"),
        ("model.layers.3.mlp.up_proj", "mlp_in"),
        ("model.layers.3.mlp.down_proj", "mlp_out"),
        ("transformer.h.0.mlp.c_proj", "mlp_out"),
        ("transformer.h.0.attn.c_proj", "attn_out"),
        ("model.embed_tokens", "embed_head"),
        ("lm_head", "embed_head"),
        ("model.layers.3.mlp.switch_mlp.gate_proj", "expert_in"),
        ("model.layers.3.mlp.switch_mlp.up_proj.weight", "expert_in"),
        ("model.layers.3.mlp.switch_mlp.down_proj", "expert_out"),
        ("model.layers.3.block_sparse_moe.switch_mlp.w2", "expert_out"),
        ("model.layers.3.mlp.shared_expert.down_proj", "mlp_out"),
        ("heads.0.proj", "default"),
        ("groups.2.blocks.1.fc", "default"),
    ],
)
def test_role_of_maps_mlx_lm_paths(name: str, role: str) -> None:
    assert role_of(name) == role


def test_role_of_rejects_empty_path() -> None:
    with pytest.raises(ValueError, match="empty parameter path"):
        role_of("")
