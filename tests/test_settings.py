"""Stage settings own the defaults: the command line shows exactly the library's defaults."""

from __future__ import annotations

import inspect

import pytest

from mlx_dq.cli import main
from mlx_dq.settings import MeasureSettings, PlanSettings, QuantizeSettings

# CLI flags that state a setting negatively, and values the CLI spells its own way
NEGATED = {"no_sequential": "sequential", "no_clip": "clip"}
CLI_SPELLING = {("head_option", "budget"): None, ("calib", ()): None}
# settings with no command-line option: library-only knobs
LIBRARY_ONLY = {
    "measure": {"importance_rows", "batch_size", "expert_mode", "head_chunk", "damp"},
    "convert": {"damp"},
}


def _cli_defaults(command: str) -> dict[str, object]:
    """The values a command passes on when given only its required output (negated flags turned round)."""
    ctx = main.commands[command].make_context(command, ["-o", "out"])
    out = {}
    for name, value in ctx.params.items():
        if name in NEGATED:
            name, value = NEGATED[name], not value
        if isinstance(value, (list, tuple)):
            value = tuple(value)
        out[name] = CLI_SPELLING.get((name, value), value)
    return out


@pytest.mark.parametrize("command,classes", [("measure", (MeasureSettings,)),
                                             ("convert", (QuantizeSettings, PlanSettings))])
def test_cli_defaults_are_the_settings_defaults(command, classes):
    cli = _cli_defaults(command)
    for cls in classes:
        settings = cls()
        for name in cls.names():
            if name in LIBRARY_ONLY[command]:
                assert name not in cli, f"{name} has a CLI option now: check its default here"
                continue
            assert name in cli, f"{command} has no option for {cls.__name__}.{name}"
            assert cli[name] == getattr(settings, name), (command, name, cli[name], getattr(settings, name))


def test_the_check_would_see_a_disagreeing_default(monkeypatch):
    import click

    opt = next(p for p in main.commands["convert"].params if p.name == "rows")
    assert isinstance(opt, click.Option)
    monkeypatch.setattr(opt, "default", 16)
    with pytest.raises(AssertionError):
        test_cli_defaults_are_the_settings_defaults("convert", (QuantizeSettings, PlanSettings))


def test_library_functions_take_their_defaults_from_the_settings():
    from mlx_dq.conversion import pipeline as conv
    from mlx_dq.measure import stream as meas

    assert QuantizeSettings().rows == 32
    assert QuantizeSettings().measure_defaults()["rows"] == QuantizeSettings().rows  # convert measures with its rows
    for fn in (meas.measure, conv.convert, conv.quantize_model):
        params = inspect.signature(fn).parameters
        assert "rows" not in params and "method" not in params  # no second copy of a default


def test_unknown_or_bad_settings_are_refused():
    with pytest.raises(TypeError, match="no option"):
        MeasureSettings().with_options(rowz=3)
    with pytest.raises(ValueError, match="method"):
        QuantizeSettings().with_options(method="awq")
    with pytest.raises(ValueError, match="importance"):
        MeasureSettings().with_options(importance="loud")
    assert MeasureSettings(method="rtn").resolved_clip is False and MeasureSettings().resolved_clip is False
    assert MeasureSettings(clip=True).resolved_clip is True
