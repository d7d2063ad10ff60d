"""benchmarks/kl_parts.py: the KL of a quantized model's parts alone, on a tiny tied model."""

from __future__ import annotations

import re
import sys

import pytest
from script_loader import load_script

from mlx_dq.conversion.pipeline import convert


def _module():
    return load_script("benchmarks/kl_parts.py", "kl_parts")


def test_parts_cover_every_layer_once():
    parts = _module().parts(7)
    thirds = [f for name, f in parts.items() if name.startswith("layers ")]
    assert [name for name in parts if name.startswith("layers ")] == ["layers 0-2", "layers 3-5", "layers 6-6"]
    for i in range(7):
        assert sum(f("model.layers.x.mlp.up_proj", i) for f in thirds) == 1
    assert parts["outside the layers (embedding, head)"]("model.embed_tokens.weight", None)
    assert not parts["decoder layers"]("model.embed_tokens.weight", None)


def test_kl_parts_reports_each_part(tiny_qwen2, tmp_path, monkeypatch, capsys):
    """Quantizing nothing costs nothing; each part costs less than everything; both tied sides are scored."""
    out = tmp_path / "out"
    recipe = {"model.embed_tokens": "1.0:2b_64g", "model.layers.0.mlp.down_proj": "1.0:2b_64g"}
    convert(str(tiny_qwen2), out, plan=recipe, method="rtn", rows=4, seq_len=32, progress=False)
    text = tmp_path / "eval.txt"
    text.write_text(" ".join(f"word{i % 37} and more text {i}." for i in range(400)))
    monkeypatch.setattr(sys, "argv", ["kl_parts.py", str(out), "--text", str(text), "--rows", "2", "--seq-len", "24"])
    _module().main()
    lines = capsys.readouterr().out.splitlines()
    kl = {m.group(1).strip(): float(m.group(2)) for m in
          (re.match(r"(.{40}) +\d+ +([0-9.]+) ", ln) for ln in lines) if m}
    assert kl["everything"] > 0
    assert kl["attention"] == pytest.approx(0.0, abs=1e-6)  # no attention tensor was quantized
    assert 0 < kl["layers 0-0"] < kl["everything"] and 0 < kl["outside the layers (embedding, head)"] < kl["everything"]
    assert kl["tied embedding: lookup side only"] > 0 and kl["tied embedding: head side only"] > 0
