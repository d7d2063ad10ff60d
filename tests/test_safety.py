"""Bad inputs and faults: nothing a user has is lost, nothing wrong passes silently, every refusal is one line."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from click.testing import CliRunner
from fixtures_models import make_tiny_model_folder

from mlx_dq.cli import main
from mlx_dq.conversion.resolve import plan_from_options
from mlx_dq.measure.stream import measure
from mlx_dq.model.sources import resolve
from mlx_dq.plan.plan import save_plan

GRID = {"default": ["1.0:2b_64g", "1.0:3b_64g", "1.0:4b_64g", "0.5:4b_32g/0.5:3b_64g", "1.0:8b_64g"]}
CALIB = ["--rows", "4", "--seq-len", "32", "--method", "rtn", "--no-clip"]


def cli(*args: str, input: str | None = None):
    """Run the CLI in-process; exceptions are kept in the result (a traceback shows as a non-SystemExit)."""
    return CliRunner().invoke(main, [str(a) for a in args], input=input)


def assert_clean_error(result, *needles: str) -> str:
    """Exit code 1, one ``Error:`` line, no traceback; returns the error line."""
    assert not (result.exception and not isinstance(result.exception, SystemExit)), (
        f"traceback instead of an error: {result.exception!r}\n{result.output}")
    assert result.exit_code in (1, 2), result.output
    lines = [ln[ln.index("Error:"):] for ln in result.output.splitlines() if "Error:" in ln]
    assert len(lines) == 1, result.output
    assert "Traceback" not in result.output
    for n in needles:
        assert n.lower() in result.output.lower(), result.output
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """Tiny llama and qwen2 folders (same tensor names and shapes), a grid and their measurements."""
    tmp = tmp_path_factory.mktemp("safety")
    grid = tmp / "grid.json"
    grid.write_text(json.dumps({"roles": GRID}))
    llama = make_tiny_model_folder(tmp, "llama", 2)
    qwen2 = make_tiny_model_folder(tmp, "qwen2", 2)
    kw = dict(grid=str(grid), rows=4, seq_len=32, batch_size=2, clip=False, method="rtn", kl_scale=False,
              progress=False)
    measure(str(llama), out_path=tmp / "llama.json", **kw)
    measure(str(qwen2), out_path=tmp / "qwen2.json", **kw)
    with pytest.raises(RuntimeError, match="simulated"):
        measure(str(llama), out_path=tmp / "partial.json", _fail_after_layer=0, **kw)
    return {"tmp": tmp, "grid": grid, "llama": llama, "qwen2": qwen2, "m_llama": tmp / "llama.json",
            "m_qwen2": tmp / "qwen2.json", "m_partial": tmp / "partial.json"}


def _plan_file(folder: Path, path: Path, desc: str = "1.0:4b_64g") -> Path:
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import build_model

    src = resolve(str(folder))
    mods = quantizable_modules(build_model(src.config))
    plan = plan_from_options({k: desc for k in mods}, src)
    save_plan(plan, path)
    return path


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def _tree(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}


# --------------------------------------------------------------------------- case 1
def test_force_never_deletes_the_source_model(work, tmp_path):
    src = _copy(work["llama"], tmp_path / "src")
    (src / "notes.txt").write_text("my notes")
    plan = _plan_file(src, tmp_path / "plan.json")
    before = _tree(src)
    for out in (src, tmp_path, src / "sub"):  # the source itself, a folder holding it, a folder inside it
        r = cli("convert", "--model", src, "--plan", plan, "-o", out, "--force", *CALIB)
        assert_clean_error(r, "source")
        assert _tree(src) == before
    # the plan being read is protected too
    plans = tmp_path / "plans"
    plans.mkdir()
    shutil.copy(plan, plans / "plan.json")
    r = cli("convert", "--model", src, "--plan", plans / "plan.json", "-o", plans, "--force", *CALIB)
    assert_clean_error(r, "plan")
    assert (plans / "plan.json").exists()


def test_force_replaces_only_an_earlier_mlx_dq_output(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    other = tmp_path / "photos"
    other.mkdir()
    (other / "cat.jpg").write_bytes(b"\xff\xd8 not a model")
    r = cli("convert", "--model", work["llama"], "--plan", plan, "-o", other, "--force", *CALIB)
    assert_clean_error(r, "not an earlier mlx-dq output")
    assert (other / "cat.jpg").read_bytes() == b"\xff\xd8 not a model"
    out = tmp_path / "out"
    assert cli("convert", "--model", work["llama"], "--plan", plan, "-o", out, *CALIB).exit_code == 0
    r = cli("convert", "--model", work["llama"], "--plan", plan, "-o", out, "--force", *CALIB)
    assert r.exit_code == 0, r.output


# --------------------------------------------------------------------------- case 2
def test_unfinished_measurement_is_refused(work, tmp_path):
    m = work["m_partial"]
    assert json.loads(m.read_text())["extra"]["complete"] is False
    r = cli("optimize", m, "--bpw", "4", "-o", tmp_path / "plan.json")
    assert_clean_error(r, "unfinished", "resume")
    assert not (tmp_path / "plan.json").exists()
    r = cli("convert", "--model", work["llama"], "--measurement", m, "--bpw", "4", "-o", tmp_path / "o", *CALIB)
    assert_clean_error(r, "unfinished")
    assert not (tmp_path / "o").exists()


def test_unfinished_measurement_with_flag_reports_the_whole_model(work, tmp_path):
    out = tmp_path / "o"
    r = cli("convert", "--model", work["llama"], "--measurement", work["m_partial"], "--bpw", "4", "-o", out,
            "--allow-incomplete", *CALIB)
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "mlx_dq.json").read_text())
    whole = manifest["accounting"]["average_bits_all"]
    assert whole > 5  # layer 1, embedding and head stay 16-bit
    assert f"{whole:.4f} bpw whole model" in r.output
    assert "16-bit" in r.output and "not in the plan" in r.output
    r = cli("optimize", work["m_partial"], "--bpw", "4", "-o", tmp_path / "p.json", "--allow-incomplete")
    assert r.exit_code == 0, r.output
    assert "not measured" in r.output
    assert f"whole model: {whole:.4f} bpw" in r.output  # the same plan, so the same whole-model size


# --------------------------------------------------------------------------- case 3
def test_measurement_or_plan_of_another_model_is_refused(work, tmp_path):
    r = cli("convert", "--model", work["llama"], "--measurement", work["m_qwen2"], "--bpw", "4",
            "-o", tmp_path / "o", *CALIB)
    line = assert_clean_error(r, "another model")
    assert str(work["qwen2"]) in r.output and str(work["llama"]) in r.output, line
    assert not (tmp_path / "o").exists()
    plan = tmp_path / "plan.json"
    assert cli("optimize", work["m_qwen2"], "--bpw", "4", "-o", plan).exit_code == 0
    r = cli("convert", "--model", work["llama"], "--plan", plan, "-o", tmp_path / "o", *CALIB)
    assert_clean_error(r, "another model")
    # an explicit flag allows same-architecture reuse; the printed bpw is the whole written model's
    r = cli("convert", "--model", work["llama"], "--measurement", work["m_qwen2"], "--bpw", "4",
            "-o", tmp_path / "o", "--allow-other-model", *CALIB)
    assert r.exit_code == 0, r.output
    manifest = json.loads((tmp_path / "o" / "mlx_dq.json").read_text())
    assert manifest["modules"]["lm_head"]["option"] == "16bit"  # qwen2 has a tied head: llama's is unplanned
    assert f"{manifest['accounting']['average_bits_all']:.4f} bpw whole model" in r.output
    assert "lm_head" in r.output


def test_shape_mismatch_is_refused_even_with_the_flag(work, tmp_path):
    wide = make_tiny_model_folder(tmp_path, "llama", 2, hidden=256, name="wide")
    r = cli("convert", "--model", wide, "--measurement", work["m_llama"], "--bpw", "4", "-o", tmp_path / "o",
            "--allow-other-model", *CALIB)
    assert_clean_error(r, "shape")


# --------------------------------------------------------------------------- case 4
def test_optimize_never_overwrites_its_input_or_a_foreign_file(work, tmp_path):
    m = tmp_path / "m.json"
    shutil.copy(work["m_llama"], m)
    before = m.read_bytes()
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", m), "input")
    assert_clean_error(cli("optimize", m, "--bpw", "4", "--mlx-config", m, "-o", tmp_path / "p.json"), "input")
    assert m.read_bytes() == before
    notes = tmp_path / "notes.txt"
    notes.write_text("important")
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", notes), "not a plan")
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", notes, "--force"), "not a plan")  # never a user's file
    assert notes.read_text() == "important"
    plan = tmp_path / "p.json"
    assert cli("optimize", m, "--bpw", "4", "-o", plan).exit_code == 0
    assert cli("optimize", m, "--bpw", "3", "-o", plan).exit_code == 0  # an earlier plan is replaced


# --------------------------------------------------------------------------- case 5
def _edit_weight(folder: Path, name: str, fn) -> None:
    path = folder / "model.safetensors"
    w = dict(mx.load(str(path)))
    w[name] = fn(w[name])
    mx.save_safetensors(str(path), w, metadata={"format": "mlx"})


def test_measure_handles_an_all_zero_tensor(work, tmp_path):
    src = _copy(work["llama"], tmp_path / "pruned")
    _edit_weight(src, "model.layers.0.mlp.up_proj.weight", mx.zeros_like)
    out = tmp_path / "m.json"
    r = cli("measure", "--model", src, "--grid", work["grid"], "-o", out, "--no-kl-scale", *CALIB)
    assert r.exit_code == 0, (r.output, r.exception)
    rec = next(t for t in json.loads(out.read_text())["measurement"] if t["key"] == "model.layers.0.mlp.up_proj")
    assert [o["err"] for o in rec["options"]] == [0.0] * len(rec["options"])


def test_measure_names_a_nan_weight(work, tmp_path):
    src = _copy(work["llama"], tmp_path / "nan")
    _edit_weight(src, "model.layers.1.self_attn.k_proj.weight", lambda w: mx.where(mx.arange(w.size).reshape(w.shape) == 7, math.nan, w))
    r = cli("measure", "--model", src, "--grid", work["grid"], "-o", tmp_path / "m.json", "--no-kl-scale", *CALIB)
    assert_clean_error(r, "model.layers.1.self_attn.k_proj", "nan")
    plan = _plan_file(src, tmp_path / "plan.json")
    r = cli("convert", "--model", src, "--plan", plan, "-o", tmp_path / "o", *CALIB)
    assert_clean_error(r, "model.layers.1.self_attn.k_proj", "nan")
    assert not (tmp_path / "o").exists() and not any(".partial-" in p.name for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- case 6
def test_optimize_nan_error_is_a_clean_error(work, tmp_path):
    doc = json.loads(work["m_llama"].read_text())
    doc["measurement"][0]["options"][1]["err"] = math.nan
    bad = tmp_path / "nan.json"
    bad.write_text(json.dumps(doc))  # json.dumps writes NaN by default, as other tools may
    assert_clean_error(cli("optimize", bad, "--bpw", "4", "-o", tmp_path / "p.json"), "err")
    doc["measurement"][0]["options"][1]["err"] = -0.5
    bad.write_text(json.dumps(doc))
    assert_clean_error(cli("optimize", bad, "--bpw", "4", "-o", tmp_path / "p.json"), "err")


def test_optimize_into_an_unwritable_place_writes_nothing(work, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert_clean_error(cli("optimize", work["m_llama"], "--bpw", "4", "-o", blocker / "plan.json"), "write")
    plan = tmp_path / "plan.json"
    r = cli("optimize", work["m_llama"], "--bpw", "4", "-o", plan, "--mlx-config", blocker / "cfg.json")
    assert_clean_error(r, "write")
    assert not plan.exists()


# --------------------------------------------------------------------------- case 7
def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_partial_folders_of_killed_conversions_are_cleaned(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    parent = tmp_path / "outs"
    parent.mkdir()
    out = parent / "model"
    # a conversion killed while it wrote (same output name), and one of another output in the same parent
    dead = [parent / f".model.partial-{_dead_pid()}", parent / f".other.partial-{_dead_pid()}"]
    for d in dead:
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"\0" * 1024)
        (d / ".mlx_dq_partial").write_text("")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        alive = parent / f".third.partial-{sleeper.pid}"
        alive.mkdir()
        (alive / ".mlx_dq_partial").write_text("")
        stranger = parent / f".mine.partial-{_dead_pid()}"  # not made by mlx-dq: left alone
        stranger.mkdir()
        r = cli("convert", "--model", work["llama"], "--plan", plan, "-o", out, *CALIB)
        assert r.exit_code == 0, r.output
        assert not any(d.exists() for d in dead)
        assert alive.exists() and stranger.exists()
        assert sorted(p.name for p in parent.iterdir()) == sorted([".mine.partial-" + stranger.name.split("-")[-1],
                                                                   alive.name, "model"])
    finally:
        sleeper.kill()
        sleeper.wait()
    r = cli("convert", "--help")
    assert ".partial-" in r.output


# --------------------------------------------------------------------------- case 8
@pytest.mark.parametrize("args,needle", [(["--bpw", b], "bpw") for b in ("-1", "nan", "inf", "0", "17")]
                         + [(["--bpw", "4", "--keep", "model.layers.9.*"], "keep pattern"),
                            (["--bpw", "4", "--head-option", "1.0:4b_100g"], "head-option")])
def test_impossible_arguments_are_refused_before_any_work(work, tmp_path, monkeypatch, args, needle):
    import mlx_dq.measure.stream

    def no_measuring(*a, **k):
        raise AssertionError("measured before checking the arguments")

    monkeypatch.setattr(mlx_dq.measure.stream, "measure", no_measuring)
    r = cli("convert", "--model", work["llama"], *args, "-o", tmp_path / "o", *CALIB)
    assert_clean_error(r, needle)
    assert not (tmp_path / "o").exists()


def test_bpw_outside_the_measurements_range_is_refused_before_quantizing(work, tmp_path, monkeypatch):
    import mlx_dq.conversion.pipeline

    monkeypatch.setattr(mlx_dq.conversion.pipeline, "quantize_stream", lambda *a, **k: (_ for _ in ()).throw(
        AssertionError("quantized before checking the arguments")))
    r = cli("convert", "--model", work["llama"], "--measurement", work["m_llama"], "--bpw", "12",
            "-o", tmp_path / "o", *CALIB)
    assert_clean_error(r, "achievable range")
    r = cli("convert", "--model", work["llama"], "--measurement", work["m_llama"], "--bpw", "4",
            "--head-option", "1.0:7b_64g", "-o", tmp_path / "o", *CALIB)
    assert_clean_error(r, "head-option")


# --------------------------------------------------------------------------- case 9
def test_plan_with_bpw_or_planning_flags_is_refused(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    for extra in (["--bpw", "3"], ["--measurement", str(work["m_llama"])], ["--keep", "lm_head"],
                  ["--mlx-lm-compatible"], ["--head-option", "1.0:8b_64g"]):
        r = cli("convert", "--model", work["llama"], "--plan", plan, "-o", tmp_path / "o", *extra, *CALIB)
        assert_clean_error(r, "--plan", extra[0])
        assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- smaller ones
def test_binary_calibration_file_is_named(work, tmp_path):
    binary = tmp_path / "calib.txt"
    binary.write_bytes(bytes(range(256)) * 4)
    r = cli("measure", "--model", work["llama"], "--calib", binary, "-o", tmp_path / "m.json", *CALIB)
    assert_clean_error(r, str(binary))


def test_outputs_are_world_readable_like_every_other_file(work, tmp_path):
    plan = tmp_path / "plan.json"
    out = tmp_path / "o"
    assert cli("optimize", work["m_llama"], "--bpw", "4", "-o", plan).exit_code == 0
    r = cli("convert", "--model", work["llama"], "--measurement", work["m_llama"], "--bpw", "4", "-o", out, *CALIB)
    assert r.exit_code == 0, r.output
    expected = 0o666 & ~_umask()
    for p in (plan, out / "plan.json", out / "measurement.json", out / "config.json"):
        assert p.stat().st_mode & 0o777 == expected, p


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_existing_empty_output_folder_keeps_its_mode(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    out = tmp_path / "private"
    out.mkdir()
    os.chmod(out, 0o700)
    assert cli("convert", "--model", work["llama"], "--plan", plan, "-o", out, *CALIB).exit_code == 0
    assert out.stat().st_mode & 0o777 == 0o700
    assert (out / "mlx_dq.json").exists()


def test_inspect_checks_files_and_config_against_the_manifest(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    out = tmp_path / "o"
    assert cli("convert", "--model", work["llama"], "--plan", plan, "-o", out, *CALIB).exit_code == 0
    assert cli("inspect", out).exit_code == 0
    broken = _copy(out, tmp_path / "missing")
    (broken / "model.safetensors").unlink()
    assert_clean_error(cli("inspect", broken), "model.safetensors", "missing")
    short = _copy(out, tmp_path / "short")
    with open(short / "model.safetensors", "r+b") as f:
        f.truncate(100)
    assert_clean_error(cli("inspect", short), "model.safetensors", "size")
    edited = _copy(out, tmp_path / "edited")
    cfg = json.loads((edited / "config.json").read_text())
    cfg["quantization"]["model.layers.0.mlp.up_proj"] = {"group_size": 64, "bits": 8, "mode": "affine"}
    (edited / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(cli("inspect", edited), "model.layers.0.mlp.up_proj", "config.json")


# --------------------------------------------------------------------------- generate and verify
@pytest.fixture(scope="module")
def mixed_folder(work) -> Path:
    plan = _plan_file(work["llama"], work["tmp"] / "mixed-plan.json", "0.5:4b_32g/0.5:3b_64g")
    out = work["tmp"] / "mixed"
    r = cli("convert", "--model", work["llama"], "--plan", plan, "-o", out, *CALIB)
    assert r.exit_code == 0, r.output
    assert json.loads((out / "config.json").read_text())["model_file"] == "mlx_dq_model.py"
    return out


def test_verify_passes_on_a_fresh_mixed_output_and_fails_when_altered(mixed_folder, tmp_path):
    r = cli("verify", mixed_folder)
    assert r.exit_code == 0, r.output
    assert "byte-identical" in r.output
    code = _copy(mixed_folder, tmp_path / "code")
    with open(code / "mlx_dq_model.py", "a") as f:
        f.write("\nimport os  # one more line\n")
    assert_clean_error(cli("verify", code), "mlx_dq_model.py", "altered")
    entry = _copy(mixed_folder, tmp_path / "entry")
    (entry / "evil.py").write_text((mixed_folder / "mlx_dq_model.py").read_text())
    cfg = json.loads((entry / "config.json").read_text())
    cfg["model_file"] = "evil.py"
    (entry / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(cli("verify", entry), "evil.py")
    cfg["model_file"] = "../mixed/mlx_dq_model.py"  # a path outside the folder
    (entry / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(cli("verify", entry), "model_file")


def test_generate_loads_through_mlx_dq_and_never_runs_folder_code(mixed_folder, tmp_path):
    trap = _copy(mixed_folder, tmp_path / "trap")
    (trap / "mlx_dq_model.py").write_text("raise SystemExit('folder code ran')\n")
    r = cli("generate", "--model", trap, "--prompt", "The quick brown", "--max-tokens", "4")
    assert r.exit_code == 0, (r.output, r.exception)
    assert "folder code ran" not in r.output
    assert "Generation:" in r.output or "tokens-per-sec" in r.output
    assert_clean_error(cli("generate", "--model", tmp_path, "--prompt", "x"), "config.json")


def test_exl2_measurement_says_what_it_cannot_check_and_leaves_out(work, tmp_path):
    from mlx_dq.measure.exl2 import exl2_storage_bits

    doc = json.loads(work["m_llama"].read_text())
    records = []
    for t in doc["measurement"]:
        if t["role"] == "embed_head":  # ExLlamaV2 files have no embedding or head records
            continue
        out_f, in_f = t["shape"]
        opts = [{"desc": o["desc"], "err": o["err"], "qparams": o["qparams"],
                 "total_bits": exl2_storage_bits(in_f, out_f, o["qparams"])} for o in t["options"]]
        records.append({"key": t["key"], "numel": t["numel"], "options": opts})
    exl2 = tmp_path / "exl2.json"
    exl2.write_text(json.dumps({"measurement": records, "last_module_idx": 1, "base_perplexity": 10.0}))
    out = tmp_path / "o"
    r = cli("convert", "--model", work["llama"], "--measurement", exl2, "--bpw", "4", "-o", out, *CALIB)
    assert r.exit_code == 0, r.output
    assert "no model fingerprint" in r.output and "cannot check" in r.output
    assert "lm_head" in r.output and "model.embed_tokens" in r.output  # what the file leaves out, and how
    manifest = json.loads((out / "mlx_dq.json").read_text())
    assert f"{manifest['accounting']['average_bits_all']:.4f} bpw whole model" in r.output
    assert manifest["modules"]["lm_head"]["option"] == "16bit"


def test_a_replaced_output_is_kept_until_the_new_one_is_in_place(tmp_path):
    from mlx_dq.safety import clean_leftovers

    old = tmp_path / f".model.old-{_dead_pid()}"
    old.mkdir()
    (old / "mlx_dq.json").write_text(json.dumps({"schema": "mlx_dq.manifest"}))
    assert clean_leftovers(tmp_path) == [] and old.exists()  # killed between the renames: the only copy
    (tmp_path / "model").mkdir()
    assert clean_leftovers(tmp_path) == [old] and not old.exists()


# --------------------------------------------------------------------------- every named output file
def _foreign(tmp_path: Path) -> Path:
    notes = tmp_path / "notes.txt"
    notes.write_text("important")
    return notes


def test_import_plan_never_overwrites_its_input_or_a_foreign_file(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    kept = tmp_path / "kept.json"
    assert cli("export", plan, "--to", "mlx-kept16", "-o", kept).exit_code == 0
    before = kept.read_bytes()
    assert_clean_error(cli("import-plan", kept, "--model", work["llama"], "-o", kept), "input")
    assert kept.read_bytes() == before
    notes = _foreign(tmp_path)
    assert_clean_error(cli("import-plan", kept, "--model", work["llama"], "-o", notes), "not a plan")
    assert_clean_error(cli("import-plan", kept, "--model", work["llama"], "-o", notes, "--force"), "not a plan")
    assert notes.read_text() == "important"
    out = tmp_path / "imported.json"
    assert cli("import-plan", kept, "--model", work["llama"], "-o", out).exit_code == 0
    assert cli("import-plan", kept, "--model", work["llama"], "-o", out).exit_code == 0  # an earlier plan
    assert oct(out.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_export_never_overwrites_its_input_or_a_foreign_file(work, tmp_path):
    plan = _plan_file(work["llama"], tmp_path / "plan.json")
    before = plan.read_bytes()
    assert_clean_error(cli("export", plan, "--to", "dynquant", "-o", plan), "input")
    assert plan.read_bytes() == before
    notes = _foreign(tmp_path)
    assert_clean_error(cli("export", plan, "--to", "dynquant", "-o", notes), "not an earlier export")
    assert_clean_error(cli("export", plan, "--to", "dynquant", "-o", notes, "--force"), "not an earlier export")
    assert notes.read_text() == "important"
    other = _plan_file(work["llama"], tmp_path / "other-plan.json")  # a plan is not what export writes
    assert_clean_error(cli("export", plan, "--to", "mlx-kept16", "-o", other), "not an earlier export")
    out = tmp_path / "dq.json"
    assert cli("export", plan, "--to", "dynquant", "-o", out).exit_code == 0
    assert cli("export", plan, "--to", "mlx-kept16", "-o", out).exit_code == 0  # an earlier export is replaced
    from mlx_dq.formats.dashq import RECORD_SCHEMA

    record = tmp_path / "record.json"
    record.write_text(json.dumps({"schema": RECORD_SCHEMA, "method": "mlx_dq"}))
    assert cli("export", plan, "--to", "dynquant", "-o", record).exit_code == 0  # a record is an export too


def test_optimize_side_outputs_never_overwrite_an_input_or_a_foreign_file(work, tmp_path):
    m = tmp_path / "m.json"
    shutil.copy(work["m_llama"], m)
    before = m.read_bytes()
    p = tmp_path / "p.json"
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", p, "--exl2-report", m), "input")
    assert m.read_bytes() == before
    notes = _foreign(tmp_path)
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", p, "--mlx-config", notes), "not an MLX config")
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", p, "--exl2-report", notes), "not an EXL2 report")
    assert notes.read_text() == "important"
    assert not p.exists()
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", p, "--exl2-report", p), "same file")
    cfg = tmp_path / "cfg.json"
    assert cli("optimize", m, "--bpw", "4", "-o", p, "--mlx-config", cfg).exit_code == 0
    assert cli("optimize", m, "--bpw", "3", "-o", p, "--mlx-config", cfg).exit_code == 0  # earlier config replaced
    assert_clean_error(cli("optimize", m, "--bpw", "4", "-o", p, "--mlx-config", notes, "--force"), "not an MLX")
    assert notes.read_text() == "important"


def test_measure_never_overwrites_its_inputs_or_a_foreign_file(work, tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    before = text.read_bytes()
    base = ["measure", "--model", work["llama"], "--grid", work["grid"], "--calib", text, *CALIB, "--no-kl-scale"]
    assert_clean_error(cli(*base, "-o", text, "--no-resume"), "input")
    assert text.read_bytes() == before
    grid_before = work["grid"].read_bytes()
    assert_clean_error(cli(*base, "-o", work["grid"], "--no-resume"), "input")
    assert work["grid"].read_bytes() == grid_before
    notes = _foreign(tmp_path)
    assert_clean_error(cli(*base, "-o", notes, "--no-resume"), "not a measurement")
    assert_clean_error(cli(*base, "-o", notes, "--no-resume", "--force"), "not a measurement")
    assert notes.read_text() == "important"


@pytest.mark.parametrize("shape", [(5,), (3, 7), (2, 3, 4), (1 << 13, 2049)])
def test_finite_check_counts_every_bad_weight(shape):
    """The finiteness check goes over a large tensor in pieces: a NaN or infinity anywhere, the last row
    included, is counted; a clean tensor of any rank passes."""
    from mlx_dq.safety import check_finite_weight

    w = mx.zeros(shape, dtype=mx.bfloat16)
    check_finite_weight("clean", w)
    flat = mx.zeros((math.prod(shape),), dtype=mx.bfloat16)
    bad = flat.at[mx.array([0, flat.size - 1])].add(mx.array([math.nan, math.inf], dtype=mx.bfloat16))
    with pytest.raises(ValueError, match=r"'t' has 2 NaN or infinite"):
        check_finite_weight("t", bad.reshape(shape))
