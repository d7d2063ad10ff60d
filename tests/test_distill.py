"""Distillation of quantized scales and biases against the source's logits (mlx_dq.conversion.distill, ``mlx_dq distill``)."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner

import mlx_dq
from mlx_dq.cli import main
from mlx_dq.conversion.distill import (
    KL_PASS_BYTES,
    _Teacher,
    distill,
    kl_pass_rows,
    make_student,
    mean_kl,
)
from mlx_dq.conversion.pipeline import convert
from mlx_dq.data import calib
from mlx_dq.evaluation import metrics as evaluate
from mlx_dq.model.capture import quantizable_modules
from mlx_dq.model.sources import build_model, load_model, resolve
from mlx_dq.settings import DistillSettings

ROWS = {"rows": 4, "seq_len": 64}
TRAIN = {**ROWS, "steps": 30, "lr": 1e-3, "progress": False}
MIXED = "0.25:4b_32g/0.75:2b_32g"


def _recipe(folder: Path, pick) -> dict[str, str]:
    mods = quantizable_modules(build_model(resolve(str(folder)).config))
    return {p: pick(p) for p in mods}


def _arrays(folder: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update({k: np.array(v.astype(mx.float32) if v.dtype in (mx.float16, mx.bfloat16) else v)
                    for k, v in mx.load(str(f)).items()})
    return out


def _train_kl(source: Path, folder: Path) -> float:
    """KL(source || folder's model) on the distillation's own rows, measured by mlx_dq.evaluation.metrics."""
    base, tok, _ = load_model(str(source))
    _, rows = calib.calibration_rows(tok, None, ROWS["rows"], ROWS["seq_len"], 0)
    model, _ = mlx_dq.load(folder)
    return evaluate.kl_divergence(base, evaluate.dequantize_model(model), rows)["kl"]


@pytest.fixture(scope="module")
def llama_q(tiny_llama, tmp_path_factory) -> Path:
    """tiny llama at 2-4 bits: mixed-proportion layers (layer 1, embedding) and stock ones (layer 0, head)."""
    out = tmp_path_factory.mktemp("distill") / "q"
    recipe = _recipe(tiny_llama, lambda p: MIXED if "layers.1" in p or "embed" in p else "1.0:3b_64g")
    convert(str(tiny_llama), out, plan=recipe, method="rtn", rows=4, seq_len=32, progress=False)
    return out


@pytest.fixture(scope="module")
def llama_dq(tiny_llama, llama_q) -> tuple[Path, dict]:
    out = llama_q.parent / "dq"
    rec = distill(str(tiny_llama), llama_q, out, **TRAIN)
    return out, rec


def test_distillation_lowers_kl_on_training_rows(tiny_llama, llama_q, llama_dq):
    out, rec = llama_dq
    before, after = _train_kl(tiny_llama, llama_q), _train_kl(tiny_llama, out)
    assert after < 0.8 * before, (before, after)
    assert rec["kl_train_before"] == pytest.approx(before, rel=1e-3)
    assert rec["kl_train_after"] == pytest.approx(after, rel=1e-3)


def test_codes_stay_and_mixed_scales_and_biases_move(llama_q, llama_dq):
    out, _ = llama_dq
    a, b = _arrays(llama_q), _arrays(out)
    assert a.keys() == b.keys()
    for k in a:
        if k.rsplit(".", 1)[-1].startswith(("weight", "perm")):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)  # codes, permutations and norms unchanged
    mixed = json.loads((llama_q / "config.json").read_text())["mlx_dq"]["mixed"]
    assert "model.layers.1.mlp.down_proj" in mixed
    for path in ("model.layers.1.mlp.down_proj", "model.embed_tokens"):
        for name in ("scales_0", "scales_1", "biases_0", "biases_1"):
            assert not np.array_equal(a[f"{path}.{name}"], b[f"{path}.{name}"]), (path, name)
    for name in ("scales", "biases"):  # a stock layer too
        assert not np.array_equal(a[f"model.layers.0.self_attn.q_proj.{name}"],
                                  b[f"model.layers.0.self_attn.q_proj.{name}"])
    # scale changes stay moderate: the same groups, not new ones
    rel = np.abs(b["model.layers.1.mlp.down_proj.scales_1"] / a["model.layers.1.mlp.down_proj.scales_1"] - 1)
    assert 0 < np.median(rel) < 0.2


def test_output_loads_and_generates_like_the_input(llama_q, llama_dq):
    out, rec = llama_dq
    assert (out / "config.json").read_text() == (llama_q / "config.json").read_text()
    manifest = json.loads((out / "mlx_dq.json").read_text())
    assert manifest["provenance"]["distill"]["kl_train_after"] == rec["kl_train_after"]
    listed = {f["name"]: f["bytes"] for f in manifest["files"]}
    assert listed == {p.name: p.stat().st_size for p in out.glob("*.safetensors")}
    model, tok = mlx_dq.load(out)
    text = mlx_lm.generate(model, tok, "def add(a, b):", max_tokens=4)
    assert isinstance(text, str) and text
    remote, _ = mlx_lm.load(str(out), model_config={}, trust_remote_code=True)
    ids = mx.array([[1, 5, 9, 17]])
    np.testing.assert_allclose(np.array(remote(ids)), np.array(model(ids)), rtol=1e-5, atol=1e-5)
    result = CliRunner().invoke(main, ["verify", str(out)])
    assert result.exit_code == 0, result.output
    card = (out / "README.md").read_text()
    assert card.count("- **Distillation:** ") == 1 and f"{TRAIN['steps']} Adam steps" in card
    assert "**Distillation:**" not in (llama_q / "README.md").read_text()


def test_same_seed_same_folder_other_seed_other_folder(tiny_llama, llama_q, llama_dq, tmp_path):
    out, _ = llama_dq
    again = tmp_path / "again"
    distill(str(tiny_llama), llama_q, again, **TRAIN)
    a, b = _arrays(out), _arrays(again)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    other = tmp_path / "other"
    distill(str(tiny_llama), llama_q, other, **{**TRAIN, "seed": 1})
    c = _arrays(other)
    assert any(not np.array_equal(a[k], c[k]) for k in a if ".scales" in k)


def test_tied_stock_model_stays_stock_and_norms_train(tiny_qwen2, tmp_path):
    q = tmp_path / "q"
    convert(str(tiny_qwen2), q, plan=_recipe(tiny_qwen2, lambda p: "1.0:3b_32g"), method="rtn", rows=4, seq_len=32,
            progress=False)
    out = tmp_path / "dq"
    rec = distill(None, q, out, train_norms=True, **TRAIN)  # source read from the manifest
    assert rec["kl_train_after"] < 0.8 * rec["kl_train_before"]
    assert rec["norms"] and all(n.endswith("norm") for n in rec["norms"])
    a, b = _arrays(q), _arrays(out)
    assert not np.array_equal(a["model.norm.weight"], b["model.norm.weight"])
    np.testing.assert_array_equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])
    assert not np.array_equal(a["model.embed_tokens.scales"], b["model.embed_tokens.scales"])  # the tied head
    model, _ = mlx_lm.load(str(out))  # no model file: plain mlx-lm loads it
    assert model(mx.array([[1, 2, 3]])).shape[-1] == 320


def test_expert_banks_distil(tiny_qwen3_moe, tmp_path):
    q = tmp_path / "q"
    recipe = _recipe(tiny_qwen3_moe, lambda p: "1.0:8b_64g" if p.endswith("mlp.gate") else
                     (MIXED if "switch_mlp" in p else "1.0:3b_64g"))
    convert(str(tiny_qwen3_moe), q, plan=recipe, method="rtn", rows=4, seq_len=32, progress=False)
    rec = distill(str(tiny_qwen3_moe), q, tmp_path / "dq", **{**TRAIN, "steps": 15})
    assert rec["kl_train_after"] < rec["kl_train_before"]
    a, b = _arrays(q), _arrays(tmp_path / "dq")
    bank = "model.layers.0.mlp.switch_mlp.up_proj"
    assert a[f"{bank}.scales_1"].ndim == 3 and not np.array_equal(a[f"{bank}.scales_1"], b[f"{bank}.scales_1"])
    np.testing.assert_array_equal(a[f"{bank}.weight_1"], b[f"{bank}.weight_1"])


def _cli(*args: str):
    return CliRunner().invoke(main, ["distill", *args])


@pytest.mark.parametrize("make_args,message", [
    (lambda src, q, t: [str(src), "-o", str(t / "o")], "not a quantized model folder"),
    (lambda src, q, t: [str(t), "-o", str(t / "o")], "not a model folder"),
    (lambda src, q, t: [str(q), "-o", str(q / "inside")], "lies inside the quantized model"),
    (lambda src, q, t: [str(q), "-o", str(t / "o"), "--rows", "2", "--batch-size", "3"], "batch_size"),
    (lambda src, q, t: [str(q), "-o", str(t / "o"), "--lr", "0"], "--lr"),
    (lambda src, q, t: [str(q), "-o", str(t / "o"), "--steps", "0"], "--steps"),
    (lambda src, q, t: [str(q), "-o", str(t / "o"), "--model", "qwen2"], "qwen2"),
])
def test_bad_input_is_one_line_error(tiny_llama, tiny_qwen2, llama_q, tmp_path, make_args, message):
    args = make_args(tiny_llama, llama_q, tmp_path)
    if "qwen2" in args:
        args[args.index("qwen2")] = str(tiny_qwen2)
        message = "not the quantized model's source"
    result = _cli(*args)
    assert result.exit_code != 0
    assert message in result.output, result.output
    assert "Traceback" not in result.output and result.exception is None or isinstance(result.exception, SystemExit)
    assert not (tmp_path / "o").exists()


def test_existing_output_needs_force(tiny_llama, llama_q, llama_dq):
    out, _ = llama_dq
    result = _cli(str(llama_q), "-o", str(out), "--model", str(tiny_llama), "--steps", "1", "--rows", "2",
                  "--seq-len", "16")
    assert result.exit_code != 0 and "--force" in result.output


def test_cli_distils_and_reports(tiny_llama, llama_q, tmp_path):
    out = tmp_path / "cli"
    result = _cli(str(llama_q), "-o", str(out), "--steps", "3", "--rows", "2", "--seq-len", "32")
    assert result.exit_code == 0, result.output
    assert "steps will take about" in result.output and "KL on the training rows:" in result.output
    assert result.stderr.count("mlx_dq: expected: about") == 1  # said before the source model is loaded
    assert result.output.index("expected: about") < result.output.index("steps will take about")
    assert json.loads((out / "mlx_dq.json").read_text())["provenance"]["distill"]["settings"]["steps"] == 3


def test_cli_defaults_are_the_settings_defaults():
    params = {p.name: (p.default if isinstance(p.default, bool) else False) if getattr(p, "is_flag", False) else p.default
              for p in main.commands["distill"].params}  # an unset flag is False
    s = DistillSettings()
    for name in DistillSettings.names():
        assert params[name] == getattr(s, name), name


# --------------------------------------------------------------------------
# convert --distill: the same training inside the conversion, before the folder is published
# --------------------------------------------------------------------------
CONVERT = {"method": "rtn", "rows": 4, "seq_len": 32, "progress": False}
DISTILL = {"rows": ROWS["rows"], "seq_len": ROWS["seq_len"], "steps": 30, "lr": 1e-3}


def _llama_recipe(tiny_llama: Path) -> dict[str, str]:
    return _recipe(tiny_llama, lambda p: MIXED if "layers.1" in p or "embed" in p else "1.0:3b_64g")


def test_convert_distill_trains_scales_keeps_codes_and_records_it(tiny_llama, llama_q, tmp_path):
    out = tmp_path / "cd"
    manifest = mlx_dq.convert(str(tiny_llama), out, plan=_llama_recipe(tiny_llama), distill=DISTILL, **CONVERT)
    rec = manifest["provenance"]["distill"]
    assert rec["settings"]["steps"] == 30 and rec["settings"]["seq_len"] == ROWS["seq_len"]
    assert json.loads((out / "mlx_dq.json").read_text())["provenance"]["distill"]["kl_train_after"] \
        == rec["kl_train_after"]
    before, after = _train_kl(tiny_llama, llama_q), _train_kl(tiny_llama, out)  # llama_q: the same conversion
    assert after < 0.8 * before, (before, after)
    assert rec["kl_train_before"] == pytest.approx(before, rel=1e-3)
    assert rec["kl_train_after"] == pytest.approx(after, rel=1e-3)
    a, b = _arrays(llama_q), _arrays(out)
    assert a.keys() == b.keys()
    for k in a:
        if k.rsplit(".", 1)[-1].startswith(("weight", "perm")):
            np.testing.assert_array_equal(a[k], b[k], err_msg=k)
    assert not np.array_equal(a["model.layers.1.mlp.down_proj.scales_1"], b["model.layers.1.mlp.down_proj.scales_1"])
    card = (out / "README.md").read_text()
    assert "**Distillation:**" in card and "30 Adam steps" in card
    listed = {f["name"]: f["bytes"] for f in manifest["files"]}
    assert listed == {p.name: p.stat().st_size for p in out.glob("*.safetensors")}
    assert CliRunner().invoke(main, ["verify", str(out)]).exit_code == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cd"]  # no partial folder left beside it


def test_convert_distill_failure_leaves_nothing_that_looks_complete(tiny_llama, tmp_path, monkeypatch):
    from mlx_dq.conversion import distill as distill_mod

    def broken(*args, **kwargs):
        raise RuntimeError("stopped while distilling")

    monkeypatch.setattr(distill_mod, "distill_model", broken)
    out = tmp_path / "cd"
    with pytest.raises(RuntimeError, match="stopped while distilling"):
        convert(str(tiny_llama), out, plan=_llama_recipe(tiny_llama), distill=True, **CONVERT)
    assert list(tmp_path.iterdir()) == []


def test_convert_distill_settings_are_checked_first(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="steps"):
        convert(str(tiny_llama), tmp_path / "o", plan=_llama_recipe(tiny_llama), distill={"steps": 0}, **CONVERT)
    with pytest.raises(TypeError, match="no option"):
        convert(str(tiny_llama), tmp_path / "o", plan=_llama_recipe(tiny_llama), distill={"stepz": 3}, **CONVERT)
    assert not (tmp_path / "o").exists()


def _convert_cli(*args: str):
    return CliRunner().invoke(main, ["convert", *args])


@pytest.mark.parametrize("flag", [["--distill-steps", "3"], ["--distill-rows", "2"], ["--distill-seq-len", "16"],
                                  ["--distill-lr", "0.01"]])
def test_convert_distill_options_without_distill_are_refused(tiny_llama, tmp_path, flag):
    result = _convert_cli("--model", str(tiny_llama), "--bpw", "3.5", "-o", str(tmp_path / "o"), *flag)
    assert result.exit_code != 0 and f"{flag[0]} would be ignored without --distill" in result.output
    assert not (tmp_path / "o").exists()


def test_convert_cli_distills_with_its_options(tiny_llama, llama_q, tmp_path):
    out = tmp_path / "o"
    result = _convert_cli("--model", str(tiny_llama), "--plan", str(llama_q / "plan.json"), "-o", str(out),
                          "--method", "rtn",
                          "--rows", "4", "--seq-len", "32", "--seed", "3", "--distill", "--distill-steps", "4",
                          "--distill-rows", "3", "--distill-seq-len", "24", "--distill-lr", "0.002")
    assert result.exit_code == 0, result.output
    assert "distilled: KL on its 3 x 24 training tokens" in result.output
    d = json.loads((out / "mlx_dq.json").read_text())["provenance"]["distill"]["settings"]
    assert (d["steps"], d["rows"], d["seq_len"], d["lr"], d["seed"]) == (4, 3, 24, 0.002, 3)


def test_convert_estimate_counts_the_distillation(tiny_llama, tmp_path):
    args = ["--model", str(tiny_llama), "--bpw", "3.5", "-o", str(tmp_path / "o"), "--estimate", "--flops", "1e7"]
    plain = _convert_cli(*args)
    with_d = _convert_cli(*args, "--distill", "--distill-steps", "7", "--distill-seq-len", "40")
    assert plain.exit_code == 0 and with_d.exit_code == 0, with_d.output
    assert "distill" not in plain.output
    assert f"distill (7 steps, {DistillSettings.rows} x 40 tokens)" in with_d.output

    def total(text: str) -> float:
        return float(text.split("total: about ", 1)[1].split(" min", 1)[0])  # minutes

    assert total(with_d.output) > total(plain.output)
    assert not (tmp_path / "o").exists()


def test_kl_passes_over_several_rows_give_the_one_row_mean(tiny_llama, llama_q):
    """The before/after KL goes through several rows per forward (each forward dequantizes every layer); the mean
    must be the one-row-at-a-time mean, also when the last pass is short."""
    base, tok, _ = load_model(str(tiny_llama), dtype=mx.float32)
    _, rows = calib.calibration_rows(tok, None, 5, 32, 0)
    model, _ = mlx_dq.load(llama_q)
    make_student(model)
    teacher = _Teacher(base, rows, 1.0, 1 << 30)
    one = mean_kl(model, teacher, rows, per_pass=1)
    assert one > 0
    for per_pass in (2, 5):
        assert mean_kl(model, teacher, rows, per_pass=per_pass) == pytest.approx(one, rel=1e-5)
    assert kl_pass_rows(40, 128, 16) == 40
    assert kl_pass_rows(40, 128, 262_144) == max(1, KL_PASS_BYTES // (127 * 262_144 * 4)) == 2
    assert kl_pass_rows(40, 4096, 262_144) == 1
