"""One QuantizerSpec: made from the settings, passed whole to the dispatch, GPTQ and the measurer."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest

from mlx_dq.quant.spec import DEFAULT_DAMP, QuantizerSpec
from mlx_dq.settings import MeasureSettings, QuantizeSettings


def test_settings_make_the_spec():
    q = QuantizeSettings(method="rtn", clip=False, damp=0.05, promote_mixed=True)
    assert q.quantizer(mx.bfloat16) == QuantizerSpec(method="rtn", clip=False, damp=0.05, promote_mixed=True,
                                                     scale_dtype=mx.bfloat16)
    assert QuantizeSettings().quantizer() == QuantizerSpec()
    m = MeasureSettings(**{k: v for k, v in q.measure_defaults().items()})
    assert m.quantizer() == QuantizerSpec(method="rtn", clip=False, damp=0.05)
    assert MeasureSettings().quantizer() == QuantizerSpec(clip=False, damp=DEFAULT_DAMP)


@pytest.mark.parametrize("bad", [{"method": "awq"}, {"damp": -1.0}, {"block_size": 0}, {"scale_weight": "energy"}])
def test_a_spec_that_cannot_run_is_refused(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        QuantizerSpec(**bad)


def test_non_default_damping_reaches_the_measurement_and_the_conversion(tiny_llama, tmp_path, monkeypatch):
    """convert(damp=0.05) without a measurement measures and converts with damping 0.05: every GPTQ call sees it."""
    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.quant import dispatch

    seen: list = []
    for name in ("gptq_quantize", "gptq_quantize_many"):
        orig = getattr(dispatch, name)

        def spy(w, opts, gram, spec=None, *a, _orig=orig, **kw):
            seen.append(getattr(spec, "damp", kw.get("damp")))
            return _orig(w, opts, gram, spec, *a, **kw)

        monkeypatch.setattr(dispatch, name, spy)
    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"roles": {"default": ["1.0:2b_64g", "1.0:3b_64g", "1.0:4b_64g", "1.0:8b_64g"]}}))
    convert(str(tiny_llama), tmp_path / "out", bpw=3.5, damp=0.05, rows=4, seq_len=32, progress=False,
            measure_kwargs={"grid": str(grid)})
    assert len(seen) > 10 and set(seen) == {0.05}
