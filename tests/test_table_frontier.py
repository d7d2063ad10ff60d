"""benchmarks/table_frontier.py: one conversion per table option at one whole-model bpw, on a tiny tied model."""

from __future__ import annotations

import json
import math
import sys
import tempfile
from pathlib import Path

import pytest
from script_loader import load_script

from mlx_dq.measure.records import load_measurement
from mlx_dq.measure.stream import measure


def _module():
    return load_script("benchmarks/table_frontier.py", "table_frontier")


@pytest.fixture(scope="module")
def tiny_measurement(tiny_qwen2, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("frontier")
    grid = folder / "grid.json"
    grid.write_text(json.dumps({"roles": {"default": ["1.0:2b_64g", "1.0:3b_64g", "1.0:4b_64g", "1.0:8b_64g"]}}))
    out = folder / "m.json"
    measure(str(tiny_qwen2), out_path=out, grid=str(grid), rows=2, seq_len=16, batch_size=1, clip=False,
            method="rtn", kl_scale=False, progress=False)
    return out


def test_decoder_bpw_puts_the_whole_model_on_the_target(tiny_measurement):
    m = load_measurement(tiny_measurement)
    table = m.tensors["model.embed_tokens"].numel
    total = m.numel()
    # 4-bit codes with a 16-bit scale and bias per 64 weights: 4.5 bits each
    want = (4.0 * total - 4.5 * table) / (total - table)
    assert _module().decoder_bpw(m, "1.0:4b_64g", 4.0) == pytest.approx(want, rel=1e-9)
    assert _module().decoder_bpw(m, "1.0:3b_64g", 3.5) == pytest.approx(3.5, rel=1e-9)


def test_one_line_per_table_option(tiny_qwen2, tiny_measurement, tmp_path, monkeypatch, capsys):
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}." for i in range(400)))
    monkeypatch.setattr(sys, "argv", [
        "table_frontier.py", "--model", str(tiny_qwen2), "--measurement", str(tiny_measurement), "--bpw", "4.0",
        "--table-options", "1.0:3b_64g,1.0:4b_64g", "--texts", str(text), "--rows", "2", "--seq-len", "24",
        "--keep", str(tmp_path / "conversions")])
    _module().main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split("\t")[:3] == ["table option", "decoder bpw", "whole bpw"]
    rows = {ln.split("\t")[0]: [float(x) for x in ln.split("\t")[1:]] for ln in lines[1:]}
    assert list(rows) == ["1.0:3b_64g", "1.0:4b_64g"]
    assert rows["1.0:3b_64g"][0] > 4.0 > rows["1.0:4b_64g"][0]  # a narrower table leaves the decoder more
    for dec, whole, kl in rows.values():
        assert 3.5 < whole <= 4.0 + 1e-3 and math.isfinite(kl) and kl > 0
    assert sorted(p.name for p in (tmp_path / "conversions").iterdir()) == ["1.0_3b_64g", "1.0_4b_64g"]


def test_conversions_not_kept_are_removed(tiny_qwen2, tiny_measurement, tmp_path, monkeypatch, capsys):
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}." for i in range(400)))
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.setattr(sys, "argv", [
        "table_frontier.py", "--model", str(tiny_qwen2), "--measurement", str(tiny_measurement), "--bpw", "4.0",
        "--table-options", "1.0:4b_64g", "--texts", str(text), "--rows", "2", "--seq-len", "24"])
    _module().main()
    assert capsys.readouterr().out.splitlines()[1].startswith("1.0:4b_64g\t")
    assert list(scratch.iterdir()) == []


def test_an_option_the_table_cannot_take_stops_before_any_work(tiny_measurement, monkeypatch, capsys):
    """The tiny table's 128 input features hold no group of 256: one line, nothing converted."""
    monkeypatch.setattr(sys, "argv", ["table_frontier.py", "--model", "no-such-model", "--measurement",
                                      str(tiny_measurement), "--table-options", "1.0:3b_64g,1.0:4b_256g"])
    with pytest.raises(SystemExit) as e:
        _module().main()
    assert str(e.value).startswith("error: ") and "256" in str(e.value) and "\n" not in str(e.value)
    assert capsys.readouterr().out == ""


def test_a_decoder_budget_out_of_reach_is_a_line_not_a_crash(tiny_qwen2, tiny_measurement, tmp_path, monkeypatch,
                                                            capsys):
    """An 8-bit table at 2.6 bpw leaves the decoder below its cheapest option (2.5 bpw): that option's line says
    so, and the next option is still converted."""
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}." for i in range(400)))
    monkeypatch.setattr(sys, "argv", [
        "table_frontier.py", "--model", str(tiny_qwen2), "--measurement", str(tiny_measurement), "--bpw", "2.6",
        "--table-options", "1.0:8b_64g,1.0:2b_64g", "--texts", str(text), "--rows", "2", "--seq-len", "24"])
    _module().main()
    lines = capsys.readouterr().out.splitlines()[1:]
    first, second = (ln.split("\t") for ln in lines)
    assert first[0] == "1.0:8b_64g" and float(first[1]) < 2.5 and first[2:4] == ["-", "-"] and first[4]
    assert second[0] == "1.0:2b_64g" and float(second[3]) > 0
