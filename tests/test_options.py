"""Option data model: EXL2-style descriptions, geometry and exact storage bits."""

from __future__ import annotations

import math

import pytest

from mlx_dq.options import QuantOption, Segment, perm_bits

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
