"""benchmarks/apple_check.py off Apple silicon: runs the parts it can, says which need a Mac, exits 0; its
correctness checks fail when a forward path is wrong; its results file keeps other backends' sections."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from script_loader import load_script

from mlx_dq.layers import kernels

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "apple_check.py"


def _module():
    return load_script(SCRIPT, "apple_check")


@pytest.mark.skipif(kernels.metal_active(), reason="checks the mode for machines without Apple silicon")
def test_quick_run_off_apple_silicon(tmp_path):
    """The quick run: exit 0, the Mac-only parts named, every CPU path timed, correctness passed, file written."""
    out = tmp_path / "r.md"
    res = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--skip-generate", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "need Apple silicon" in res.stdout and "correctness: pass" in res.stdout
    text = out.read_text()
    assert "<!-- apple_check:cpu -->" in text and f"MLX {mx.__version__}" in text
    assert "Metal-only tests" in text and "need Apple silicon" in text
    assert re.search(r"MixedLinear streamed, 64 row\(s\): relative error \S+ \(limit 1e-05\) pass", text)
    rows = re.findall(r"^\| tiny (\d+x\d+) \| (\d+) \| (cached|streamed) \| ([\d.]+) \| ([\d.]+) \| (\d+)% \|", text,
                      flags=re.M)
    assert {(s, r, p) for s, r, p, *_ in rows} == {(s, r, p) for s in ("256x512", "512x256") for r in ("1", "64")
                                                   for p in ("cached", "streamed")}
    assert all(float(m) > 0 and float(u) > 0 for *_, m, u, _ in rows)
    assert "`--scale` runs it anyway" in text


def test_correctness_check_fails_on_a_wrong_path(monkeypatch):
    """A forward path that is off by a little makes part 1 fail (the check is not vacuous)."""
    mod = _module()
    real = kernels.streamed_matmul
    monkeypatch.setattr(kernels, "streamed_matmul", lambda *a: real(*a) * 1.001)
    monkeypatch.setattr(kernels, "backend", lambda: "cpu")
    report: list[str] = []
    assert mod.part_correctness(report) is False
    failed = [line for line in report if line.endswith("FAIL")]
    assert failed and all("streamed" in line for line in failed)


def test_results_file_keeps_other_backends_sections():
    """Writing one backend's section replaces only that section."""
    mod = _module()
    text = mod.merge_section("", "cpu", "## Run on CPU\nold figure")
    text = mod.merge_section(text, "metal", "## Run on Metal\nmetal figure")
    text = mod.merge_section(text, "cpu", "## Run on CPU\nnew figure")
    assert text.startswith("# apple_check results")
    assert text.count("<!-- apple_check:cpu -->") == 1 and text.count("<!-- apple_check:metal -->") == 1
    assert "new figure" in text and "old figure" not in text and "metal figure" in text
