"""Plot helpers: figure structure, data placed where it belongs, clear errors on bad input."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
from matplotlib.colors import to_rgba
from matplotlib.figure import Figure

from mlx_dq.cli import main
from mlx_dq.errors import InputError
from mlx_dq.evaluation import plots
from mlx_dq.measure.records import (
    JointGroup,
    JointOption,
    Measurement,
    OptionRecord,
    TensorRecord,
    save_measurement,
)
from mlx_dq.plan.solver import optimize
from mlx_dq.quant.options import QuantOption

HIDDEN, INTER = 128, 256
SHAPES = {
    "self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (64, HIDDEN), "self_attn.v_proj": (64, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HIDDEN), "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTER),
}
KIND_FACTOR = {k: 1.0 + 0.25 * i for i, k in enumerate(SHAPES)}
BITS = (2, 3, 4, 6, 8)


def synthetic_error(layer: int, kind: str, bits: int) -> float:
    """The error the synthetic measurement records: halves per extra bit, grows with depth and kind."""
    return 0.3 * 2.0 ** -(bits - 2) * (1.0 + 0.5 * layer) * KIND_FACTOR[kind]


def synthetic_measurement(layers: int = 3, head: bool = True) -> Measurement:
    """A llama-shaped measurement with errors from :func:`synthetic_error` (group 64, whole-tensor options)."""
    m = Measurement(model={"spec": "synthetic"})
    for i in range(layers):
        for kind, shape in SHAPES.items():
            t = m.add_tensor(f"model.layers.{i}.{kind}", shape)
            for b in BITS:
                t.add_option(QuantOption.parse(f"1.0:{b}b_64g"), synthetic_error(i, kind, b))
    if head:
        t = m.add_tensor("lm_head", (320, HIDDEN))
        for b in (4, 6, 8):
            t.add_option(QuantOption.parse(f"1.0:{b}b_64g"), 0.01 * 2.0 ** -(b - 4))
    return m


def joint_measurement(layers: int = 2) -> Measurement:
    """ExLlamaV2-style joint modules: one attention group per layer with three joint options."""
    m = Measurement(source_format="exl2_v2")
    members = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
    for i in range(layers):
        gkey = f"model.layers.{i}.self_attn"
        keys = [f"model.layers.{i}.{k}" for k in members]
        for k, kind in zip(keys, members):
            m.tensors[k] = TensorRecord(k, SHAPES[kind], group=gkey)
        g = JointGroup(gkey, keys)
        for b in (2, 4, 8):
            opt = QuantOption.parse(f"1.0:{b}b_64g")
            recs = {k: OptionRecord(opt, 0.0, opt.storage_bits(m.tensors[k].shape), None) for k in keys}
            g.options.append(JointOption(recs, sum(r.total_bits for r in recs.values()), 0.1 * (i + 1) / b))
        m.groups[gkey] = g
    return m


def _panels(fig: Figure) -> list:
    """Axes of a figure that are not colorbars."""
    return [a for a in fig.axes if a.get_label() != "<colorbar>"]


@pytest.mark.parametrize("key, expected", [
    ("model.layers.3.self_attn.q_proj", (3, "self_attn.q_proj")),
    ("model.layers.12.mlp.down_proj.weight", (12, "mlp.down_proj")),
    ("model.layers.0.mlp.experts.17.gate_proj", (0, "mlp.experts.*.gate_proj")),
    ("model.layers.5.self_attn", (5, "self_attn")),
    ("transformer.h.7.attn.c_attn", (7, "attn.c_attn")),
    ("blocks.2", (2, "blocks")),
    ("encoder.0.fc1", (0, "fc1")),
    ("lm_head", (None, "lm_head")),
    ("model.embed_tokens", (None, "model.embed_tokens")),
])
def test_layer_and_kind(key, expected):
    assert plots.layer_and_kind(key) == expected


def test_error_vs_bpw_one_panel_per_kind_one_curve_per_layer():
    fig = plots.error_vs_bpw(synthetic_measurement(layers=3))
    panels = _panels(fig)
    assert [a.get_title() for a in panels] == list(SHAPES) + ["lm_head"]
    assert len(fig.axes) == len(panels) + 1  # one colorbar for depth
    for a in panels[:-1]:
        assert len(a.lines) == 3 and a.get_yscale() == "log"
    assert len(panels[-1].lines) == 1
    q = panels[0]
    np.testing.assert_allclose(q.lines[2].get_ydata(), [synthetic_error(2, "self_attn.q_proj", b) for b in BITS])
    np.testing.assert_allclose(q.lines[0].get_xdata(), [b + 32 / 64 for b in BITS])
    assert to_rgba(q.lines[0].get_color()) != to_rgba(q.lines[2].get_color())  # coloured by depth


def test_error_vs_bpw_role_filter_and_frontier():
    m = synthetic_measurement(layers=2)
    assert [a.get_title() for a in _panels(plots.error_vs_bpw(m, "q_proj"))] == ["self_attn.q_proj"]
    assert [a.get_title() for a in _panels(plots.error_vs_bpw(m, "attn_in"))] == [
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    # an option that costs more and hurts more than another is dropped from the frontier only
    m.tensor("model.layers.0.self_attn.q_proj").add_option(QuantOption.parse("1.0:4b_32g"), 0.9)
    full = plots.error_vs_bpw(m, "q_proj", frontier=False)
    front = plots.error_vs_bpw(m, "q_proj")
    assert len(_panels(full)[0].lines[0].get_xdata()) == len(BITS) + 1
    assert len(_panels(front)[0].lines[0].get_xdata()) == len(BITS)


def test_error_vs_bpw_into_given_axes():
    fig = Figure()
    ax = fig.add_subplot()
    assert plots.error_vs_bpw(synthetic_measurement(2), "down_proj", ax=ax) is fig
    assert len(ax.lines) == 2
    with pytest.raises(ValueError, match="needs 7 axes"):
        plots.error_vs_bpw(synthetic_measurement(2, head=False), ax=ax)


def test_error_vs_bpw_bad_input():
    with pytest.raises(ValueError, match="unknown role 'nope'.*self_attn.q_proj"):
        plots.error_vs_bpw(synthetic_measurement(), "nope")
    with pytest.raises(ValueError, match="empty"):
        plots.error_vs_bpw(Measurement())


def test_joint_modules_are_one_curve_each():
    m = joint_measurement(layers=2)
    fig = plots.error_vs_bpw(m)
    (panel,) = _panels(fig)
    assert panel.get_title() == "self_attn" and len(panel.lines) == 2
    numel = sum(m.tensors[k].numel for k in m.groups["model.layers.1.self_attn"].members)
    expect_bpw = [o.total_bits / numel for o in m.groups["model.layers.1.self_attn"].options]
    np.testing.assert_allclose(panel.lines[1].get_xdata(), expect_bpw)
    np.testing.assert_allclose(panel.lines[1].get_ydata(), [0.2 / b for b in (2, 4, 8)])
    heat = plots.error_heatmap(m, "1.0:4b_64g")
    np.testing.assert_allclose(_panels(heat)[0].images[0].get_array().filled(np.nan), [[0.1 / 4], [0.2 / 4]])


def test_error_heatmap_at_option_and_at_bpw():
    m = synthetic_measurement(layers=3)
    expected = [[synthetic_error(i, k, 4) for k in SHAPES] for i in range(3)]
    for at in ("1.0:4b_64g", QuantOption.parse("1.0:4b_64g"), 4.4):
        fig = plots.error_heatmap(m, at)
        (panel,) = _panels(fig)
        np.testing.assert_allclose(panel.images[0].get_array().filled(np.nan), expected)
        assert [t.get_text() for t in panel.get_xticklabels()] == list(SHAPES)
        assert type(panel.images[0].norm).__name__ == "LogNorm"
        assert len(fig.axes) == 2


def test_experts_share_a_panel_and_the_heat_map_shows_the_worst():
    m = Measurement()
    opt = QuantOption.parse("1.0:4b_64g")
    for e, err in ((0, 0.1), (1, 0.3), (2, 0.2)):
        m.add_tensor(f"model.layers.0.mlp.experts.{e}.gate_proj", (128, 128)).add_option(opt, err)
    (panel,) = _panels(plots.error_vs_bpw(m))
    assert panel.get_title() == "mlp.experts.*.gate_proj" and len(panel.lines) == 3
    (heat,) = _panels(plots.error_heatmap(m, opt))
    assert heat.images[0].get_array().filled(np.nan).tolist() == [[0.3]]


def test_error_heatmap_of_predicted_damage():
    m = synthetic_measurement(layers=2)
    for i in range(2):
        for j, kind in enumerate(SHAPES):
            m.tensor(f"model.layers.{i}.{kind}").importance = 1.0 + 10 * i + j
    fig = plots.error_heatmap(m, "1.0:3b_64g", damage=True)
    expected = [[(1.0 + 10 * i + j) * synthetic_error(i, k, 3) ** 2 for j, k in enumerate(SHAPES)] for i in range(2)]
    np.testing.assert_allclose(_panels(fig)[0].images[0].get_array().filled(np.nan), expected)
    assert "damage" in _panels(fig)[0].get_title()


def test_error_heatmap_bad_input():
    m = synthetic_measurement()
    with pytest.raises(ValueError, match="1.0:5b_32g was not measured"):
        plots.error_heatmap(m, "1.0:5b_32g")
    with pytest.raises(ValueError):
        plots.error_heatmap(m, "five bits")
    with pytest.raises(ValueError, match="expected a bits-per-weight number"):
        plots.error_heatmap(m, [4])
    with pytest.raises(ValueError, match="empty"):
        plots.error_heatmap(Measurement(), 4.0)
    only_head = Measurement()
    only_head.add_tensor("lm_head", (320, HIDDEN)).add_option(QuantOption.parse("1.0:4b_64g"), 0.1)
    with pytest.raises(ValueError, match="numbered layers"):
        plots.error_heatmap(only_head, 4.0)


def test_bit_map_places_each_tensor():
    m = synthetic_measurement(layers=3)
    plan = optimize(m, 4.0)
    fig = plots.bit_map(plan)
    (panel,) = _panels(fig)
    grid = panel.images[0].get_array().filled(np.nan)
    assert grid.shape == (3, len(SHAPES))
    for i in range(3):
        for j, kind in enumerate(SHAPES):
            e = plan.entry(f"model.layers.{i}.{kind}")
            assert grid[i, j] == pytest.approx(e.bits / e.numel)
    assert "target 4" in panel.get_title()
    with pytest.raises(ValueError, match="numbered layers"):
        plan.tensors = [e for e in plan.tensors if e.key == "lm_head"]
        plots.bit_map(plan)


def test_bit_maps_side_by_side_on_one_scale():
    m = synthetic_measurement(layers=3)
    fig = plots.bit_maps(m, (3.0, 5.0))
    panels = _panels(fig)
    assert len(panels) == 2 and len(fig.axes) == 3
    assert [a.get_title().split(":")[0] for a in panels] == ["target 3", "target 5"]
    assert panels[0].images[0].get_clim() == panels[1].images[0].get_clim()
    assert np.nanmean(panels[1].images[0].get_array()) > np.nanmean(panels[0].images[0].get_array())
    with pytest.raises(ValueError, match="at least one"):
        plots.bit_maps(m, ())
    with pytest.raises(ValueError):
        plots.bit_maps(m, (1.0,))  # below the cheapest option


def _write_quality(path: Path, rows: list[dict], fields: list[str]) -> Path:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return path


QUALITY_ROWS = [
    {"family": "source", "method": "source (float32)", "bpw": 16.0, "kl": 0.0, "top1": 1.0, "perplexity": 16.5},
    {"family": "mlx-dq", "method": "mlx-dq @3.5", "bpw": 3.5, "kl": 0.08, "top1": 0.8, "perplexity": 19.0},
    {"family": "mlx-dq", "method": "mlx-dq @2.5", "bpw": 2.5, "kl": 0.4, "top1": 0.6, "perplexity": 30.0},
    {"family": "mlx-dq", "method": "mlx-dq @4.5", "bpw": 4.5, "kl": 0.02, "top1": 0.9, "perplexity": 17.0},
    {"family": "mlx-lm uniform", "method": "mlx-lm 4-bit g64", "bpw": 4.5, "kl": 0.05, "top1": 0.85,
     "perplexity": 18.0},
    {"family": "mlx-lm uniform", "method": "mlx-lm 3-bit g64", "bpw": 3.5, "kl": 0.3, "top1": 0.7,
     "perplexity": 25.0},
    {"family": "mlx-lm dynamic_quant", "method": "dq @4.7", "bpw": 4.7, "kl": "", "top1": "", "perplexity": ""},
]


def test_kl_vs_bpw(tmp_path):
    path = _write_quality(tmp_path / "q.csv", QUALITY_ROWS, ["family", "method", "bpw", "kl", "top1", "perplexity"])
    fig = plots.kl_vs_bpw(path)
    kl, ppl = _panels(fig)
    assert kl.get_yscale() == "log"
    assert [line.get_label() for line in kl.lines] == ["mlx-dq", "mlx-lm uniform"]  # the blank row is skipped
    np.testing.assert_allclose(kl.lines[0].get_xdata(), [2.5, 3.5, 4.5])
    np.testing.assert_allclose(kl.lines[0].get_ydata(), [0.4, 0.08, 0.02])
    np.testing.assert_allclose(ppl.lines[1].get_ydata(), [25.0, 18.0])
    assert ppl.lines[-1].get_ydata()[0] == 16.5  # the source model's perplexity
    assert kl.lines[0].get_linewidth() > 0 and kl.lines[1].get_linewidth() == 0  # targets joined, baselines not


def test_kl_vs_bpw_other_column_names(tmp_path):
    rows = [{"method": r["method"], "bpw": r["bpw"], "kl": r["kl"], "ppl": r["perplexity"]} for r in QUALITY_ROWS]
    path = _write_quality(tmp_path / "q.csv", rows, ["method", "bpw", "kl", "ppl"])
    kl, ppl = _panels(plots.kl_vs_bpw(path))
    assert [line.get_label() for line in kl.lines] == ["mlx-dq", "mlx-lm"]
    np.testing.assert_allclose(ppl.lines[0].get_ydata(), [30.0, 19.0, 17.0])


def test_kl_vs_bpw_bad_input(tmp_path):
    with pytest.raises(InputError, match="no quality table"):
        plots.kl_vs_bpw(tmp_path / "missing.csv")
    bad = _write_quality(tmp_path / "bad.csv", [{"method": "x", "bpw": 3}], ["method", "bpw"])
    with pytest.raises(ValueError, match="lacks the column.*kl"):
        plots.kl_vs_bpw(bad)
    only_source = _write_quality(tmp_path / "src.csv", QUALITY_ROWS[:1], ["family", "method", "bpw", "kl", "top1",
                                                                          "perplexity"])
    with pytest.raises(ValueError, match="no quantized rows"):
        plots.kl_vs_bpw(only_source)


def test_plot_command_writes_pngs(tmp_path):
    meas = tmp_path / "m.json"
    save_measurement(synthetic_measurement(), meas)
    quality = _write_quality(tmp_path / "q.csv", QUALITY_ROWS, ["family", "method", "bpw", "kl", "top1",
                                                                "perplexity"])
    out = tmp_path / "figs"
    res = CliRunner().invoke(main, ["plot", str(meas), "-o", str(out), "--targets", "3,4.5", "--quality",
                                    str(quality)])
    assert res.exit_code == 0, res.output
    names = sorted(p.name for p in out.iterdir())
    assert names == ["bit_maps.png", "damage_heatmap.png", "error_heatmap.png", "error_vs_bpw.png",
                     "kl_vs_bpw.png"]
    assert all((out / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    res = CliRunner().invoke(main, ["plot", str(meas), "-o", str(tmp_path / "f2"), "--targets", "3,x"])
    assert res.exit_code != 0 and "--targets" in res.output
    res = CliRunner().invoke(main, ["plot", str(meas), "-o", str(tmp_path / "f3"), "--targets", "1.0"])
    assert res.exit_code != 0 and "1" in res.output


def test_measure_command_writes_plots(tiny_llama, tmp_path):
    out = tmp_path / "figs"
    res = CliRunner().invoke(main, ["measure", "--model", str(tiny_llama), "--rows", "2", "--seq-len", "32",
                                    "--grid", "fast", "--importance", "none", "-o", str(tmp_path / "m.json"),
                                    "--plot", str(out)])
    assert res.exit_code == 0, res.output
    assert sorted(p.name for p in out.iterdir()) == ["bit_maps.png", "damage_heatmap.png", "error_heatmap.png",
                                                           "error_vs_bpw.png"]
    assert f"wrote {out / 'bit_maps.png'}" in res.output
