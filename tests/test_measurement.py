"""Measurement files: our JSON round trip, both ExLlamaV2 forms, clear errors, atomic writes."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import numpy as np
import pytest
from seeds import seed_path  # noqa: E402

from mlx_dq.measure import records as meas
from mlx_dq.measure.exl2 import map_exl2_qparams
from mlx_dq.measure.records import (
    JointGroup,
    JointOption,
    Measurement,
    OptionRecord,
    load_measurement,
    save_measurement,
)
from mlx_dq.quant.options import QuantOption


@functools.lru_cache(maxsize=None)
def _loaded(path: Path) -> Measurement:
    """Each seed is parsed once per test session (tests only read it)."""
    return load_measurement(path)


def _seed(prefix: str) -> Path:
    return seed_path(prefix)


def _synthetic(rng: np.random.Generator) -> Measurement:
    """A measurement with plain tensors, a joint group, a tied head and provenance."""
    m = Measurement(
        base_perplexity=9.5, model={"name": "tiny", "hash": "abc"},
        calibration={"source": "default", "rows": 8, "seq_len": 128, "seed": 0, "hash": "def"},
        grid="default", versions={"mlx": "0.32", "mlx_lm": "0.32", "mlx_dq": "0.1.0"},
        last_module_idx=1, tied={"lm_head": "model.embed_tokens"},
    )
    opts = [QuantOption.parse(d) for d in ("1.0:2b_64g", "1.0:4b_64g", "0.25:6b_32g/0.75:4b_32g", "16bit")]
    for i in range(2):
        for name, shape in (("self_attn.q_proj", (64, 128)), ("mlp.down_proj", (128, 256))):
            t = m.add_tensor(f"model.layers.{i}.{name}", shape, importance=float(rng.uniform(0.5, 2)))
            for o in opts:
                t.add_option(o, float(rng.uniform(0, 0.2)), weight_err=float(rng.uniform(0, 0.1)),
                             clip={"clipped_fraction": 0.01, "clip_improvement": 0.02})
    m.add_tensor("model.embed_tokens", (1000, 64)).add_option(opts[1], 0.03)
    g = JointGroup("model.layers.1.mlp", ["model.layers.1.mlp.gate_proj", "model.layers.1.mlp.up_proj"])
    for k in g.members:
        m.add_tensor(k, (256, 128)).group = g.key
    for o in opts[:3]:
        recs = {k: OptionRecord(o, o.bpw((256, 128)), o.storage_bits((256, 128)), None) for k in g.members}
        g.options.append(JointOption(recs, sum(r.total_bits for r in recs.values()), float(rng.uniform(0, 0.1))))
    m.groups[g.key] = g
    return m


def test_our_format_round_trip(tmp_path: Path) -> None:
    m = _synthetic(np.random.default_rng(0))
    path = tmp_path / "m.json"
    save_measurement(m, path)
    back = load_measurement(path)
    assert back == m
    doc = json.loads(path.read_text())
    assert doc["format"] == "mlx_dq.measurement" and doc["version"] == 1
    # ExLlamaV2 old-form fields are all present on every per-linear record
    for rec in doc["measurement"]:
        assert {"key", "numel", "options"} <= set(rec)
        for o in rec["options"]:
            assert {"desc", "bpw", "total_bits", "err", "qparams", "mlx"} <= set(o)
    assert {"last_module_idx", "base_perplexity", "model", "calibration", "grid", "versions"} <= set(doc)


def test_add_option_counts_mlx_storage() -> None:
    m = Measurement()
    t = m.add_tensor("model.layers.0.mlp.up_proj", (256, 512))
    rec = t.add_option(QuantOption.uniform(4, 64), 0.01)
    # 4-bit codes + one 16-bit scale and one 16-bit bias per 64 weights
    assert rec.total_bits == 256 * 512 * 4 + 256 * (512 // 64) * 32
    assert rec.bpw == pytest.approx(4.5)
    assert t.role == "mlp_in"


@pytest.mark.parametrize("prefix", ["000", "001"])
def test_exl2_seeds_round_trip(prefix: str, tmp_path: Path) -> None:
    m = _loaded(_seed(prefix))
    out = tmp_path / "ours.json"
    save_measurement(m, out)
    assert load_measurement(out) == m


def test_exl2_old_form_seed_contents() -> None:
    path = _seed("000")
    raw = json.loads(path.read_text())
    m = _loaded(path)
    assert m.source_format == "exl2_v1"
    assert m.base_perplexity == raw["base_perplexity"]
    assert len(m.tensors) == len(raw["measurement"])
    # a 32-layer model with grouped-query attention (4096 hidden, 1024 kv, 14336 MLP)
    assert m.tensors["model.layers.0.self_attn.q_proj"].shape == (4096, 4096)
    assert m.tensors["model.layers.0.self_attn.k_proj"].shape == (1024, 4096)
    assert m.tensors["model.layers.0.mlp.down_proj"].shape == (4096, 14336)
    assert m.last_module_idx == 31
    first = raw["measurement"][0]
    t = m.tensors[first["key"]]
    kept = {r.exl2_desc: r for r in t.options}
    for o in first["options"]:
        if o["desc"] in kept:  # the error and the original description travel unchanged
            assert kept[o["desc"]].err == o["err"]
    # every mapped option is a valid MLX option and stored bits are MLX's
    for r in t.options:
        assert r.option.storage_bits(t.shape) == r.total_bits
        assert all(s.group_size == 128 for s in r.option.segments)


def test_exl2_current_form_seed_contents() -> None:
    path = _seed("001")
    raw = json.loads(path.read_text())["measurement"]
    m = _loaded(path)
    assert m.source_format == "exl2_v2"
    measured = [k for k, v in raw.items() if v]
    assert sorted(m.groups) == sorted(measured)
    g = m.groups["model.layers.0.self_attn"]
    assert g.members == [f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    assert m.tensors["model.layers.0.self_attn.k_proj"].shape == (512, 4096)
    assert m.tensors["model.layers.0.mlp.down_proj"].shape == (4096, 11008)
    accs = {o["accuracy"] for o in raw["model.layers.0.self_attn"]}
    for o in g.options:
        assert o.accuracy in accs and o.err == pytest.approx(1 - o.accuracy)
        assert o.total_bits == sum(r.total_bits for r in o.members.values())


def test_exl2_mapping_rules() -> None:
    qp = {"group_size": {"4": 32}, "bits": [4], "bits_prop": [1.0], "scale_bits": 4}
    assert map_exl2_qparams(qp).desc == "1.0:4b_128g"
    assert map_exl2_qparams(qp, mode="layout").desc == "1.0:4b_32g"
    odd = {"group_size": {"7": 32, "1": 32}, "bits": [7, 1], "bits_prop": [0.5, 0.5], "scale_bits": 4}
    assert [s.bits for s in map_exl2_qparams(odd, mode="layout").segments] == [8, 2]
    with pytest.raises(ValueError, match="mode"):
        map_exl2_qparams(qp, mode="nearest")
    with pytest.raises(ValueError, match="malformed"):
        map_exl2_qparams({"bits": [4]})


def test_exl2_old_form_with_given_shapes(tmp_path: Path) -> None:
    """A hand-made old-form file with shapes given: maps, keeps desc/err, dedupes equal MLX options."""
    qp = lambda b, g: {"group_size": {str(b): g}, "bits": [b], "bits_prop": [1.0], "scale_bits": 4}  # noqa: E731
    doc = {"measurement": [{"key": "model.layers.0.mlp.up_proj", "numel": 256 * 512, "options": [
        # EXL2 counts codes, 4-bit scales per group and output column, 48 bits per group
        {"desc": "1.0:4b_32g s4", "bpw": 4.1, "total_bits": 512 * 256 * 4 + 16 * 256 * 4 + 16 * 48, "err": 0.02,
         "qparams": qp(4, 32)},
        {"desc": "1.0:4b_128g s4", "bpw": 4.0, "total_bits": 512 * 256 * 4 + 4 * 256 * 4 + 4 * 48, "err": 0.03,
         "qparams": qp(4, 128)},
        {"desc": "1.0:3b_32g s4", "bpw": 3.1, "total_bits": 512 * 256 * 3 + 16 * 256 * 4 + 16 * 48, "err": 0.05,
         "qparams": qp(3, 32)},
    ]}], "last_module_idx": 3, "base_perplexity": 5.0}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    m = load_measurement(path, shapes={"model.layers.0.mlp.up_proj": (256, 512)})
    assert load_measurement(path) == m  # the same shape is recovered from total_bits
    t = m.tensors["model.layers.0.mlp.up_proj"]
    assert [r.option.desc for r in t.options] == ["1.0:4b_128g", "1.0:3b_128g"]
    assert [r.err for r in t.options] == [0.02, 0.05]  # 4b_32g s4 is nearer 4b_128g's MLX storage
    assert t.options[0].total_bits == 256 * 512 * 4 + 256 * 4 * 32


@pytest.mark.parametrize(
    "content, message",
    [
        ("not json at all", "not valid JSON"),
        ('{"measurement": [{"key": "a", "numel": 4', "truncated"),
        ("{}", "not a measurement"),
        ("[1, 2, 3]", "not a measurement"),
        ("", "empty"),
        ('{"format": "mlx_dq.measurement", "version": 99, "measurement": []}', "version"),
        ('{"measurement": [{"key": "a", "numel": 4096, "options": [{"desc": "x", "total_bits": 1, "err": 0.1}]}]}',
         "qparams"),
        ('{"measurement": {"model.layers.0.mlp": [{"accuracy": 0.9}]}}', "total_bits"),
        ('{"format": "mlx_dq.measurement", "version": 1, "measurement": [{"key": "a", "shape": [4, 4], '
         '"options": [{"mlx": "1.0:4b_64g", "bpw": 4.5, "total_bits": 72}]}]}', "err"),
        ('{"format": "mlx_dq.measurement", "version": 1, "measurement": [{"key": "a", "shape": [4, 4], '
         '"options": [{"mlx": "1.0:9b_64g", "bpw": 4.5, "total_bits": 72, "err": 0.1}]}]}', "bits must be"),
    ],
)
def test_bad_files_fail_clearly(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message) as e:
        load_measurement(path)
    assert str(path) in str(e.value)


@pytest.mark.parametrize("prefix", ["002", "003", "004"])
def test_other_seed_kinds_are_rejected(prefix: str) -> None:
    path = _seed(prefix)
    with pytest.raises(ValueError, match="not a measurement") as e:
        load_measurement(path)
    assert str(path) in str(e.value)


def test_truncated_seed_is_rejected(tmp_path: Path) -> None:
    text = _seed("001").read_text()
    path = tmp_path / "cut.json"
    path.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match="truncated"):
        load_measurement(path)


def test_missing_file() -> None:
    with pytest.raises(ValueError, match="no such"):
        load_measurement("/nonexistent/measurement.json")


def test_atomic_write_keeps_old_file_on_failure(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    m = _synthetic(np.random.default_rng(1))
    path = tmp_path / "m.json"
    save_measurement(m, path)
    before = path.read_bytes()

    def boom(doc, f, **kw):  # write half a document, then die
        f.write('{"format": "mlx_dq.measurement", "meas')
        raise KeyboardInterrupt

    monkeypatch.setattr(meas.json, "dump", boom)
    with pytest.raises(KeyboardInterrupt):
        save_measurement(m, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["m.json"]


def test_tensor_record_validates_shape() -> None:
    with pytest.raises(ValueError, match="shape"):
        meas.TensorRecord("x", (16,))
    with pytest.raises(ValueError, match="numel"):
        meas.TensorRecord("x", (4, 4), numel=17)
    assert math.prod(meas.TensorRecord("x", (2, 4, 8)).shape) == 64
