"""The sensitivity notebook runs top to bottom in a fresh kernel and every figure cell shows an image."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from seeds import seed_path
from test_plots import QUALITY_ROWS, _write_quality, synthetic_measurement

from mlx_dq.measure.records import save_measurement

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "sensitivity.ipynb"


def run_notebook(monkeypatch: pytest.MonkeyPatch, measurement: str | None, quality: str) -> nbformat.NotebookNode:
    """Execute the notebook in a new python3 kernel (this interpreter) with the given environment."""
    if measurement is None:
        monkeypatch.delenv("MLX_DQ_MEASUREMENT", raising=False)
    else:
        monkeypatch.setenv("MLX_DQ_MEASUREMENT", measurement)
    monkeypatch.setenv("MLX_DQ_QUALITY_CSV", quality)
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nb.cells.append(nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    NotebookClient(nb, timeout=300, kernel_name="python3",
                   resources={"metadata": {"path": str(NOTEBOOK.parent)}}).execute()
    return nb


def _tagged(nb: nbformat.NotebookNode, tag: str) -> list:
    return [c for c in nb.cells if tag in c.metadata.get("tags", [])]


def _has_png(cell) -> bool:
    return any("image/png" in o.get("data", {}) for o in cell.outputs)


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs)


def _check_figures(nb: nbformat.NotebookNode) -> None:
    figures = _tagged(nb, "figure")
    assert len(figures) == 4
    for cell in figures:
        assert _has_png(cell), f"no image from: {cell.source}"
    assert Path(_text(nb.cells[-1]).strip()).resolve() == Path(sys.executable).resolve()


def test_committed_notebook_has_no_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)
    assert len(_tagged(nb, "figure")) == 4 and len(_tagged(nb, "quality-figure")) == 1


def test_notebook_on_a_generated_measurement(tmp_path, monkeypatch):
    path = tmp_path / "measurement.json"
    save_measurement(synthetic_measurement(layers=4), path)
    quality = _write_quality(tmp_path / "quality.csv", QUALITY_ROWS,
                             ["family", "method", "bpw", "kl", "top1", "perplexity"])
    nb = run_notebook(monkeypatch, str(path), str(quality))
    _check_figures(nb)
    (kl_cell,) = _tagged(nb, "quality-figure")
    assert _has_png(kl_cell)
    assert str(path) in _text(nb.cells[2]) and "29 tensors" in _text(nb.cells[2])


@pytest.mark.slow
def test_notebook_on_the_exl2_seed_by_default(tmp_path, monkeypatch):
    seed = seed_path("000")  # skips without ../shared/seeds, fails when it is there but unreadable
    nb = run_notebook(monkeypatch, None, str(tmp_path / "absent.csv"))
    _check_figures(nb)
    assert seed.name in _text(nb.cells[2]) and "exl2_v1" in _text(nb.cells[2])
    (kl_cell,) = _tagged(nb, "quality-figure")
    assert not _has_png(kl_cell) and "figure skipped" in _text(kl_cell) and "absent.csv" in _text(kl_cell)


@pytest.mark.slow
def test_notebook_measures_a_tiny_model_without_a_file(tmp_path, monkeypatch):
    nb = run_notebook(monkeypatch, "generate", str(tmp_path / "absent.csv"))
    _check_figures(nb)
    assert "tiny random llama" in _text(nb.cells[2])
