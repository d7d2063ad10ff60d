"""The write rule, for every command that writes: a run replaces only what mlx-dq wrote, never an input.

One tree (a source model folder, calibration text, a measurement, a plan, an earlier output holding a
user's notes) is built once; every writing command is pointed at each of its places, with and without
--force, and every file the run did not create must keep its sha256; a refusal is one ``Error:`` line.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
from cli_checks import cli, one_error_line
from fixtures_models import make_tiny_model_folder

from mlx_dq.conversion.resolve import plan_from_options
from mlx_dq.measure.stream import measure
from mlx_dq.model.sources import resolve
from mlx_dq.plan.plan import save_plan

GRID = {"default": ["1.0:2b_64g", "1.0:4b_64g", "1.0:8b_64g"]}
CALIB = ["--rows", "4", "--seq-len", "32", "--method", "rtn", "--no-clip"]
LEFTOVER = re.compile(r"\.(partial|old)-\d+$|\.lock$|\.state\.tmp\.")


def snapshot(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` (relative paths)."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> dict[str, Path]:
    """Source folder, calibration text, grid, a measurement, a plan, an MLX kept-16 config and two earlier
    outputs (one holding a user's notes), made once."""
    root = tmp_path_factory.mktemp("write_rule")
    (root / "grid.json").write_text(json.dumps({"roles": GRID}))
    src = make_tiny_model_folder(root, "llama", 2, name="src")
    calib = root / "calib.txt"
    calib.write_text("The quick brown fox jumps over the lazy dog near the river bank. " * 200)
    measure(str(src), out_path=root / "m.json", grid=str(root / "grid.json"), calib=str(calib), rows=4, seq_len=32,
            clip=False, method="rtn", kl_scale=False, progress=False)
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import build_model

    source = resolve(str(src))
    save_plan(plan_from_options({k: "1.0:4b_64g" for k in quantizable_modules(build_model(source.config))}, source),
              root / "plan.json")
    assert cli("export", root / "plan.json", "--to", "mlx-kept16", "-o", root / "k16.json").exit_code == 0
    for name in ("old", "clean"):
        r = cli("convert", "--model", src, "--plan", root / "plan.json", "-o", root / name, "--calib", calib, *CALIB)
        assert r.exit_code == 0, r.output
    (root / "old" / "notes.txt").write_text("my notes on this model")
    return {"root": root, "src": src, "calib": calib, "grid": root / "grid.json", "m": root / "m.json",
            "plan": root / "plan.json", "k16": root / "k16.json", "old": root / "old", "clean": root / "clean"}


def _places(t: dict[str, Path]) -> list[Path]:
    return [t["src"], t["src"] / "config.json", t["src"] / "model.safetensors", t["calib"], t["m"], t["plan"],
            t["old"], t["old"] / "notes.txt", t["old"] / "mlx_dq.json", t["k16"]]


def _commands(t: dict[str, Path]) -> dict[str, tuple[list, set[str], bool]]:
    """Each writing command: its arguments before ``-o``, the files it may replace (mlx-dq's, of the kind it
    writes), and whether it reads the source folder (which then gains no file)."""
    root = t["root"]
    rel = lambda p: str(p.relative_to(root))  # noqa: E731
    return {
        "measure": (["measure", "--model", t["src"], "--calib", t["calib"], "--grid", t["grid"], "--rows", "4",
                     "--seq-len", "32", "--method", "rtn", "--no-kl-scale"], {rel(t["m"])}, True),
        "optimize": (["optimize", t["m"], "--bpw", "4", "--model", t["src"]], {rel(t["plan"])}, True),
        "convert": (["convert", "--model", t["src"], "--measurement", t["m"], "--bpw", "4", "--calib", t["calib"],
                     *CALIB], set(), True),
        "distill": (["distill", t["old"], "--model", t["src"], "--calib", t["calib"], "--rows", "2", "--seq-len",
                     "16", "--steps", "1", "--batch-size", "1"], set(), True),
        "import-plan": (["import-plan", t["k16"], "--model", t["src"]], {rel(t["plan"])}, True),
        "export": (["export", t["old"], "--to", "dynquant"], {rel(t["k16"])}, False),  # an earlier export
        "plot": (["plot", t["m"]], set(), False),
    }


def _check_run(t: dict[str, Path], args: list, allowed: set[str], reads_source: bool) -> None:
    """Run ``args``; nothing existing but ``allowed`` changes, no leftovers, a refusal is one line."""
    root = t["root"]
    before, src_before = snapshot(root), sorted(os.listdir(t["src"]))
    r = cli(*args)
    if r.exit_code != 0:
        one_error_line(r)
    after = snapshot(root)
    changed = {k for k, v in before.items() if after.get(k) != v} - allowed
    assert not changed, f"{args}: changed {sorted(changed)}\n{r.output}"
    if reads_source:
        assert sorted(os.listdir(t["src"])) == src_before, f"{args}: wrote into the source folder"
    left = [p for p in root.rglob("*") if LEFTOVER.search(p.name)]
    assert not left, f"{args}: left {left}"


@pytest.mark.parametrize("command", ["measure", "optimize", "convert", "distill", "import-plan", "export", "plot"])
def test_every_writing_command_keeps_what_it_did_not_write(tree, command):
    args, allowed, reads_source = _commands(tree)[command]
    for place in _places(tree):
        for force in ([], ["--force"], *([["--force", "--no-resume"]] if command == "measure" else [])):
            _check_run(tree, [*args, "-o", place, *force], allowed | ({f"{Path(place).name}.state.safetensors"}
                                                                        if command == "measure" else set()),
                       reads_source)


def test_eval_and_upload_write_only_the_output_folders_own_files(tree):
    """eval writes its results into an output's manifest and card, nothing else; upload --list writes nothing."""
    _check_run(tree, ["eval", tree["old"], "--rows", "1", "--seq-len", "16", "--no-speed"],
               {"old/mlx_dq.json", "old/README.md"}, True)
    _check_run(tree, ["eval", tree["src"], "--rows", "1", "--seq-len", "16", "--no-speed"], set(), True)
    _check_run(tree, ["upload", tree["clean"], "someone/model", "--list"], set(), False)


def test_help_of_every_writing_command_states_the_rule():
    from mlx_dq.safety import WRITE_RULE

    first = WRITE_RULE.split(":")[0]
    for command in ("measure", "optimize", "convert", "distill", "import-plan", "export", "plot"):
        text = " ".join(cli(command, "--help").output.split())
        assert first in text, command


# --------------------------------------------------------------------------- the numbered cases
def _fresh_output(tree, tmp_path: Path, name: str) -> Path:
    out = tmp_path / name
    shutil.copytree(tree["clean"], out)
    return out


def test_case1_force_never_deletes_the_calibration_file_or_a_users_file(tree, tmp_path):
    out = _fresh_output(tree, tmp_path, "out")
    shutil.copy(tree["calib"], out / "calib.txt")
    before = snapshot(out)
    r = cli("convert", "--model", tree["src"], "--measurement", tree["m"], "--bpw", "4", "--calib",
            out / "calib.txt", "-o", out, "--force", *CALIB[2:])
    one_error_line(r, "calibration text")
    r = cli("distill", tree["clean"], "--model", tree["src"], "--calib", out / "calib.txt", "-o", out, "--force",
            "--rows", "2", "--seq-len", "16", "--steps", "1", "--batch-size", "1")
    one_error_line(r, "calibration text")
    assert snapshot(out) == before
    (out / "calib.txt").rename(out / "eval.log")  # any other file of the user's: named, kept
    r = cli("convert", "--model", tree["src"], "--plan", tree["plan"], "-o", out, "--force", *CALIB)
    one_error_line(r, "eval.log")
    assert (out / "eval.log").exists()


def test_a_second_calibration_source_is_an_input_too(tree, tmp_path):
    """``--calib bundled --calib FILE``: an output that would replace FILE is refused as for one source."""
    out = _fresh_output(tree, tmp_path, "out")
    shutil.copy(tree["calib"], out / "calib.txt")
    before = snapshot(out)
    two = ["--calib", "bundled", "--calib", out / "calib.txt"]
    r = cli("convert", "--model", tree["src"], "--measurement", tree["m"], "--bpw", "4", *two, "-o", out, "--force",
            *CALIB[2:])
    one_error_line(r, "calibration text")
    r = cli("distill", tree["clean"], "--model", tree["src"], *two, "-o", out, "--force",
            "--rows", "2", "--seq-len", "16", "--steps", "1", "--batch-size", "1")
    one_error_line(r, "calibration text")
    r = cli("measure", "--model", tree["src"], *two, "--grid", tree["grid"], "--rows", "4", "--seq-len", "32",
            "--method", "rtn", "--no-kl-scale", "-o", out / "calib.txt", "--force")
    one_error_line(r, "calibration text")
    assert snapshot(out) == before


def test_case2_measure_never_writes_into_the_source_folder(tree, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tree["src"], src)
    before = snapshot(src)
    base = ["measure", "--model", src, "--grid", tree["grid"], "--calib", tree["calib"], "--rows", "4",
            "--seq-len", "32", "--method", "rtn", "--no-kl-scale", "--force", "--no-resume"]
    for target in (src / "config.json", src / "model.safetensors", src / "new.json"):
        one_error_line(cli(*base, "-o", target), "input")
    assert snapshot(src) == before


def test_case3_import_plan_never_overwrites_the_config_it_read(tree, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tree["src"], src)
    before = snapshot(src)
    one_error_line(cli("import-plan", tree["k16"], "--model", src, "-o", src / "config.json", "--force"), "input")
    one_error_line(cli("import-plan", tree["k16"], "--model", src / "config.json", "-o", src / "config.json",
                         "--force"), "input")
    assert snapshot(src) == before


def test_case5_a_second_convert_into_the_same_output_stops_naming_the_first(tree, tmp_path, monkeypatch):
    """The first convert is held inside its run; the second, into the same new folder, must refuse."""
    from mlx_dq.conversion import pipeline as convert_mod

    started, release = threading.Event(), threading.Event()
    real_rows = convert_mod.calib_mod.calibration_rows
    first_thread: list[threading.Thread] = []

    def held_rows(*a, **k):
        if threading.current_thread() in first_thread:
            started.set()
            release.wait(60)
        return real_rows(*a, **k)

    monkeypatch.setattr(convert_mod.calib_mod, "calibration_rows", held_rows)
    out, results = tmp_path / "out", {}
    args = ["convert", "--model", tree["src"], "--plan", tree["plan"], "-o", out, *CALIB]
    first = threading.Thread(target=lambda: results.setdefault("first", cli(*args)))
    first_thread.append(first)
    first.start()
    try:
        assert started.wait(60)
        second = cli(*args)
    finally:
        release.set()
        first.join(120)
    assert results["first"].exit_code == 0, results["first"].output
    one_error_line(second, f"PID {os.getpid()}")
    assert "wrote" not in second.output
    assert (out / "mlx_dq.json").exists()


# --------------------------------------------------------------------------- the unclear cases
def test_measure_force_starts_over_instead_of_refusing(tree, tmp_path):
    m = tmp_path / "m.json"
    shutil.copy(tree["m"], m)
    base = ["measure", "--model", tree["src"], "--grid", tree["grid"], "--calib", tree["calib"], "--rows", "4",
            "--seq-len", "16", "--method", "rtn", "--no-kl-scale", "-o", m]
    one_error_line(cli(*base), "--no-resume")  # other settings: not resumed, not replaced
    r = cli(*base, "--force")  # implies --no-resume
    assert r.exit_code == 0, r.output
    assert json.loads(m.read_text())["calibration"]["seq_len"] == 16
    notes = tmp_path / "notes.txt"
    notes.write_text("mine")
    line = one_error_line(cli(*base[:-1], notes, "--force"), "not a measurement")
    assert "force=True" not in line and notes.read_text() == "mine"


def test_a_dangling_link_as_output_is_refused_before_any_work(tree, tmp_path):
    link = tmp_path / "dangl"
    link.symlink_to(tmp_path / "missing" / "x")
    r = cli("convert", "--model", tree["src"], "--plan", tree["plan"], "-o", link, *CALIB)
    one_error_line(r, "symbolic link")
    assert "quantiz" not in r.output.lower()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangl"]


def test_the_current_folder_as_output_is_refused_up_front(tree, tmp_path, monkeypatch):
    out = _fresh_output(tree, tmp_path, "out")
    before = snapshot(out)
    monkeypatch.chdir(out)
    one_error_line(cli("convert", "--model", tree["src"], "--plan", tree["plan"], "-o", ".", "--force", *CALIB),
                     "current folder")
    assert snapshot(out) == before


def test_a_link_to_an_earlier_output_is_replaced_without_leftovers(tree, tmp_path):
    out = _fresh_output(tree, tmp_path, "out")
    link = tmp_path / "link"
    link.symlink_to(out)
    r = cli("convert", "--model", tree["src"], "--plan", tree["plan"], "-o", link, "--force", *CALIB)
    assert r.exit_code == 0, r.output
    assert link.is_symlink() and (link / "mlx_dq.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out"]


def test_the_command_line_names_flags_and_python_names_arguments(tree, tmp_path):
    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.errors import OutputError

    out = _fresh_output(tree, tmp_path, "out")
    line = one_error_line(cli("convert", "--model", tree["src"], "--plan", tree["plan"], "-o", out, *CALIB),
                            "--force")
    assert "force=True" not in line
    with pytest.raises(OutputError, match="force=True") as e:
        convert(str(tree["src"]), out, plan=str(tree["plan"]), rows=4, seq_len=32, method="rtn", clip=False)
    assert "--force" not in str(e.value)
