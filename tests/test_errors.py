"""Errors as types: a user's mistake (MlxDqError, or the system refusing a path) is one ``Error:`` line with exit
status 1; any other exception is a bug and keeps its traceback. Plus the reported arguments that used to crash."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures_models import make_tiny_model_folder

from mlx_dq.cli import main
from mlx_dq.cli.estimate import announce
from mlx_dq.errors import InputError, MlxDqError
from mlx_dq.runtime import openblas, threads

QUICK = ["--rows", "2", "--seq-len", "16", "--method", "rtn"]


def cli(*args: str, input: bytes | str | None = None):
    """Run the CLI in-process; an exception that escapes the command is kept in ``result.exception``."""
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def one_error(result, *needles: str) -> str:
    """Exit status 1, exactly one ``Error:`` line and no traceback; returns that line."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert result.exit_code == 1, result.output
    lines = [ln for ln in result.output.splitlines() if "Error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("Error: "), result.output
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A tiny llama folder, and copies whose config.json lacks hidden_size or gives the layer count as text."""
    tmp = tmp_path_factory.mktemp("errors")
    good = make_tiny_model_folder(tmp, "llama", 2)
    out = {"tmp": tmp, "good": good}
    for name, edit in (("no_hidden", lambda c: c.pop("hidden_size")),
                       ("text_layers", lambda c: c.update(num_hidden_layers="2"))):
        dst = shutil.copytree(good, tmp / name)
        config = json.loads((dst / "config.json").read_text())
        edit(config)
        (dst / "config.json").write_text(json.dumps(config))
        out[name] = dst
    return out


# ---------------------------------------------------------------------------------------------- the boundary
def test_an_mlx_dq_error_is_one_line(monkeypatch, folders):
    def refuse(spec):
        raise InputError(f"{spec}: refused for this test")

    monkeypatch.setattr("mlx_dq.model.sources.resolve", refuse)
    assert one_error(cli("info", folders["good"])) == f"Error: {folders['good']}: refused for this test"


@pytest.mark.parametrize("bug", [KeyError("model_type"), RuntimeError("internal"), ValueError("a bare ValueError")])
def test_a_bug_keeps_its_traceback(monkeypatch, folders, bug):
    """A KeyError, RuntimeError or plain ValueError from a bug escapes the command: it is not an ``Error:`` line."""
    def broken(spec):
        raise bug

    monkeypatch.setattr("mlx_dq.model.sources.resolve", broken)
    result = cli("info", folders["good"])
    assert result.exception is bug
    assert "Error:" not in result.output
    assert not isinstance(bug, MlxDqError)


def test_a_system_error_names_its_file(monkeypatch, folders):
    def denied(spec):
        raise PermissionError(13, "Permission denied", f"{spec}/config.json")

    monkeypatch.setattr("mlx_dq.model.sources.resolve", denied)
    assert one_error(cli("info", folders["good"])) == f"Error: {folders['good']}/config.json: Permission denied"


# ---------------------------------------------------------------------------------------------- --flops
@pytest.mark.parametrize("flops", ["-5", "0", "nan", "inf"])
@pytest.mark.parametrize("command", ["measure", "convert"])
def test_estimate_refuses_a_rate_that_is_not_positive_and_finite(folders, tmp_path, command, flops):
    args = ["--bpw", "4"] if command == "convert" else []
    result = cli(command, "--model", folders["good"], *args, "-o", tmp_path / "out", "--estimate", "--flops", flops)
    one_error(result, "--flops")
    assert "about" not in result.output


# ---------------------------------------------------------------------------------------------- bad config.json
@pytest.mark.parametrize("command", ["info", "measure", "convert"])
def test_config_without_hidden_size_names_it(folders, tmp_path, command):
    args = {"info": [], "measure": ["-o", tmp_path / "m.json", *QUICK],
            "convert": ["--bpw", "4", "-o", tmp_path / "out", *QUICK]}[command]
    model = [folders["no_hidden"]] if command == "info" else ["--model", folders["no_hidden"]]
    one_error(cli(command, *model, *args), "hidden_size")


@pytest.mark.parametrize("command", ["info", "convert"])
def test_config_with_a_text_layer_count_says_so(folders, tmp_path, command):
    args = [] if command == "info" else ["--bpw", "4", "-o", tmp_path / "out", *QUICK]
    model = [folders["text_layers"]] if command == "info" else ["--model", folders["text_layers"]]
    line = one_error(cli(command, *model, *args), "num_hidden_layers", "whole number")
    assert "tokenizer" not in line


# ---------------------------------------------------------------------------------------------- generate
def test_generate_refuses_binary_stdin(folders):
    one_error(cli("generate", "--model", folders["good"], "--prompt", "-", input=b"\xff\xfe\x00binary"), "UTF-8")


def test_generate_refuses_an_empty_prompt(folders):
    one_error(cli("generate", "--model", folders["good"], "--prompt", "", "--no-chat", "-m", "2"), "empty")


# ---------------------------------------------------------------------------------------------- MLX_DQ_THREADS
def test_too_many_threads_are_refused_before_any_work(monkeypatch, folders):
    monkeypatch.setenv(threads.ENV, "99999")
    with pytest.raises(InputError, match="at most"):
        threads.workers()
    one_error(cli("info", folders["good"]), threads.ENV, str(threads.max_env_workers()))
    monkeypatch.setenv(threads.ENV, str(threads.max_env_workers()))
    assert threads.workers() == threads.max_env_workers()


# ---------------------------------------------------------------------------------------------- convert --bpw 9
def test_convert_refuses_a_target_outside_the_grid_before_measuring(monkeypatch, folders, tmp_path):
    def no_measuring(*a, **kw):
        raise AssertionError("measured before refusing the target")

    monkeypatch.setattr("mlx_dq.measure.stream.measure", no_measuring)
    line = one_error(cli("convert", "--model", folders["good"], "--bpw", "9", "-o", tmp_path / "out", *QUICK),
                     "9 bpw", "8.5000")
    assert "option grid" in line
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- OpenBLAS
def test_missing_openblas():
    absent = dict(lib_exists=False)
    assert openblas.missing("linux", {}, **absent)
    assert not openblas.missing("linux", {}, lib_exists=True)
    assert not openblas.missing("darwin", {}, **absent)
    assert not openblas.missing("linux", {openblas.OPT_OUT_VAR: "1"}, **absent)
    assert not openblas.missing("linux", {"LD_PRELOAD": "/opt/lib/libopenblas.so.0"}, **absent)


def test_first_run_without_openblas_says_what_to_install(monkeypatch, folders, tmp_path, capsys):
    """The one line said before a run, and --estimate, name the package and the time with it (both estimated)."""
    monkeypatch.setattr("sys.platform", "linux")
    monkeypatch.delenv(openblas.OPT_OUT_VAR, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "")
    monkeypatch.setenv(openblas.PATH_VAR, str(tmp_path / "no-libopenblas.so"))
    announce(str(folders["good"]), "measure", rows=2, seq_len=16, method="rtn", kl_scale=False, sample_rows=0)
    line = capsys.readouterr().err.strip()
    assert line.count("\n") == 0 and line.startswith("mlx_dq: expected: about ")
    assert f"`{openblas.INSTALL}` would make it about " in line
    result = cli("convert", "--model", folders["good"], "--bpw", "4", "-o", tmp_path / "o", "--estimate",
                 "--flops", "1e9")
    assert result.exit_code == 0 and openblas.INSTALL in result.output.splitlines()[-1], result.output
    monkeypatch.setenv(openblas.PATH_VAR, str(folders["good"] / "config.json"))  # a file there: nothing to say
    announce(str(folders["good"]), "measure", rows=2, seq_len=16, method="rtn", kl_scale=False, sample_rows=0)
    assert openblas.INSTALL not in capsys.readouterr().err
