"""One pipeline, whatever the entry point: CLI == Python API, and measuring uses the converter's quantizer.

- ``mlx_dq convert`` and :func:`mlx_dq.conversion.pipeline.convert` with the same settings
  write byte-identical folders (timing fields aside), defaults included: both
  take them from :mod:`mlx_dq.settings` (the measurement convert makes uses its
  32 rows from either side).
- For llama and qwen3_moe (expert banks) with both methods, the error
  ``measure`` records for the option a plan picks equals the error of the
  tensor the converter writes for that option (same inputs: non-sequential
  conversion, same rows and batches).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner

from mlx_dq.cli import main
from mlx_dq.conversion.pipeline import convert
from mlx_dq.conversion.writer import tensor_arrays, tensor_record
from mlx_dq.data import calib as calib_mod
from mlx_dq.measure.stream import measure, strip_timing
from mlx_dq.model.sources import resolve
from mlx_dq.plan.solver import optimize
from mlx_dq.quant.dispatch import StreamOptions, quantize_stream
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.spec import QuantizerSpec


def _files(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _comparable(name: str, data: bytes) -> object:
    """File contents without the fields that time the run.

    Those are the manifest's quantization seconds and the digest of the
    measurement file (which holds per-layer timings), the measurement's timing
    and the optimizer's wall time in the plan.
    """
    if name == "mlx_dq.json":
        doc = json.loads(data)
        doc["provenance"].pop("quantization_seconds")
        doc["provenance"]["measurement"].pop("sha256")
        return doc
    if name == "measurement.json":
        return strip_timing(json.loads(data))
    if name == "plan.json":
        doc = json.loads(data)
        doc.pop("wall_s")
        return doc
    return data


def test_cli_and_python_api_write_identical_folders(tiny_llama, tmp_path, monkeypatch):
    args = ["convert", "--model", str(tiny_llama), "--bpw", "4", "--seq-len", "32", "--method", "rtn", "-o", "out"]
    (tmp_path / "cli").mkdir()
    (tmp_path / "api").mkdir()
    monkeypatch.chdir(tmp_path / "cli")
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    cli_manifest = json.loads((tmp_path / "cli" / "out" / "mlx_dq.json").read_text())
    monkeypatch.chdir(tmp_path / "api")
    convert(str(tiny_llama), "out", bpw=4.0, seq_len=32, method="rtn", progress=False,
            command=cli_manifest["provenance"]["command"])
    a, b = _files(tmp_path / "cli" / "out"), _files(tmp_path / "api" / "out")
    assert sorted(a) == sorted(b)
    assert "measurement.json" in a and "model.safetensors" in a
    differ = [n for n in a if _comparable(n, a[n]) != _comparable(n, b[n])]
    assert differ == []
    measured = json.loads(a["measurement.json"])["calibration"]
    assert measured["rows"] == 32 == cli_manifest["provenance"]["calibration"]["rows"]


def test_the_comparison_sees_a_different_setting(tiny_llama, tmp_path):
    """The folder comparison above can fail: one setting changed gives different weights."""
    recipe = {"model.layers.0.mlp.down_proj": "1.0:4b_64g"}
    convert(str(tiny_llama), tmp_path / "a", plan=recipe, rows=4, seq_len=32, progress=False, command="x")
    convert(str(tiny_llama), tmp_path / "b", plan=recipe, rows=4, seq_len=32, seed=1, progress=False, command="x")
    a, b = _files(tmp_path / "a"), _files(tmp_path / "b")
    assert a["model.safetensors"] != b["model.safetensors"]


@pytest.mark.parametrize("method,clip", [("gptq", None), ("rtn", None), ("rtn", True)])
@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_measure_and_convert_use_the_same_quantizer(tiny_llama, tiny_qwen3_moe, family, method, clip):
    """``clip=None``: each method's default; rtn with the clip search is where expert banks' Grams matter most."""
    folder = {"llama": tiny_llama, "qwen3_moe": tiny_qwen3_moe}[family]
    rows, seq_len = 4, 32
    m = measure(str(folder), rows=rows, seq_len=seq_len, method=method, clip=clip, grid="fast", importance="none",
                kl_scale=False, progress=False)
    plan = optimize(m, 3.5)
    options = {e.key: QuantOption.parse(e.option) for e in plan.tensors}
    source = resolve(str(folder))
    _, tokens = calib_mod.calibration_rows(source.tokenizer(), None, rows, seq_len, 0)
    how = StreamOptions(QuantizerSpec(method=method, clip=m.extra["clip"]), sequential=False)
    compared = 0
    banks = 0
    for part in quantize_stream(source, options, tokens, how=how, progress=False):
        for t in part.tensors:
            opt = options.get(t.path)
            if opt is None or opt.keep16 or t.gram is None or t.path not in m.tensors:
                continue
            if not t.path.startswith("model.layers."):
                continue  # embedding/head: measured one row at a time, so their Gram sums differ in the last bits
            arrays = tensor_arrays(t.path, t.qt, mx.float16)
            converted = tensor_record(t.qt, t.gram, t.weight, arrays, energy=t.energy)["err"]
            measured = m.tensors[t.path].find(opt).err
            assert converted == pytest.approx(measured, rel=1e-5, abs=1e-9), (t.path, opt.desc)
            compared += 1
            banks += t.weight.ndim == 3
    assert compared >= 7 * 2
    assert (banks > 0) == (family == "qwen3_moe")
