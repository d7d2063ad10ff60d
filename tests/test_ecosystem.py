"""Fitting the MLX ecosystem: model cards, hub uploads, carried tokenizer files, the Python API, OpenBLAS, plots."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures_models import make_tiny_model_folder

import mlx_dq
from mlx_dq.cli import main
from mlx_dq.conversion import card, hub
from mlx_dq.model.capture import quantizable_modules
from mlx_dq.model.sources import build_model, resolve
from mlx_dq.runtime import openblas

ROOT = Path(__file__).resolve().parents[1]
CALIB = {"rows": 4, "seq_len": 32, "progress": False, "method": "rtn"}
SOURCE_CARD = "---\nlicense: apache-2.0\nbase_model: someorg/tiny-base\nlanguage:\n- en\ntags:\n- chat\n---\n# tiny\n"
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.7, "top_p": 0.9, "do_sample": True}


def _recipe(folder: Path, mixed: bool) -> dict[str, str]:
    mods = quantizable_modules(build_model(resolve(str(folder)).config))
    return {p: ("0.25:4b_32g/0.75:3b_32g" if mixed and "layers.1.mlp" in p else "1.0:4b_64g") for p in mods}


@pytest.fixture(scope="module")
def carded_source(tmp_path_factory) -> Path:
    """A tiny llama with a source model card and a generation config next to its tokenizer."""
    folder = make_tiny_model_folder(tmp_path_factory.mktemp("src"), "llama", 2, name="tiny-chat")
    (folder / "README.md").write_text(SOURCE_CARD)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=3))
    return folder


@pytest.fixture(scope="module")
def mixed_out(carded_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("outs") / "tiny-mixed"
    mlx_dq.convert(str(carded_source), str(out), plan=_recipe(carded_source, True), **CALIB)
    return out


@pytest.fixture(scope="module")
def stock_out(carded_source, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("outs") / "tiny-stock"
    mlx_dq.conversion.pipeline.convert(str(carded_source), out, plan=_recipe(carded_source, False), **CALIB)
    return out


def _digest(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# -- plots as installed ------------------------------------------------------------------------------------


def test_matplotlib_is_a_core_dependency():
    text = (ROOT / "pyproject.toml").read_text()
    core = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M).group(1)
    assert re.search(r'"matplotlib>=', core), core


def test_installed_plot_command_writes_pngs(tmp_path):
    from test_plots import synthetic_measurement

    from mlx_dq.measure.records import save_measurement

    meas = tmp_path / "m.json"
    save_measurement(synthetic_measurement(), meas)
    proc = subprocess.run([sys.executable, "-m", "mlx_dq", "plot", str(meas), "-o", str(tmp_path / "figs")],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, MLX_DQ_NO_OPENBLAS="1"))
    assert proc.returncode == 0, proc.stderr
    pngs = sorted((tmp_path / "figs").glob("*.png"))
    assert len(pngs) >= 3 and all(p.read_bytes()[:4] == b"\x89PNG" for p in pngs)


# -- OpenBLAS ------------------------------------------------------------------------------------------------

LIB = openblas.OPENBLAS_PATH


@pytest.mark.parametrize("platform, env, exists, expected", [
    ("linux", {}, True, LIB),
    ("linux", {"LD_PRELOAD": "/x/libfoo.so"}, True, f"{LIB}:/x/libfoo.so"),
    ("linux", {"LD_PRELOAD": "/other/libopenblas.so.0"}, True, None),  # an OpenBLAS is preloaded already
    ("linux", {"LD_PRELOAD": LIB}, True, None),
    ("linux", {}, False, None),  # not installed
    ("darwin", {}, True, None),  # never on macOS
    ("linux", {"MLX_DQ_NO_OPENBLAS": "1"}, True, None),  # opted out
    ("linux", {"MLX_DQ_NO_OPENBLAS": "0"}, True, LIB),
    ("linux", {"MLX_DQ_OPENBLAS_REEXEC": "1"}, True, None),  # already re-executed once
])
def test_openblas_preload_decision(platform, env, exists, expected):
    assert openblas.preload_value(platform, env, exists) == expected


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", openblas.GUARD_VAR, openblas.OPT_OUT_VAR, openblas.PATH_VAR)}
    env.update(extra)
    return env


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.isfile(LIB),
                    reason="needs Linux with Debian's libopenblas0-pthread")
def test_command_reexecutes_once_with_openblas():
    proc = subprocess.run([sys.executable, "-m", "mlx_dq", "--version"], capture_output=True, text=True,
                          timeout=120, env=_clean_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("preloading OpenBLAS") == 1, proc.stderr
    assert "version" in proc.stdout
    probe = ("from mlx_dq.runtime.openblas import maybe_reexec; maybe_reexec(); import os; "
             "print(os.environ.get('LD_PRELOAD')); print(open('/proc/self/maps').read().count('libopenblas') > 0)")
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=_clean_env())
    assert proc.stdout.split() == [LIB, "True"], (proc.stdout, proc.stderr)
    # opted out: no re-exec, no note
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          env=_clean_env(MLX_DQ_NO_OPENBLAS="1"))
    assert proc.stdout.split()[0] == "None" and "OpenBLAS" not in proc.stderr


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the re-exec happens on Linux only")
def test_reexec_does_not_loop_when_the_preload_does_not_look_like_openblas(tmp_path):
    # A library whose name is not libopenblas: only the guard variable stops a second re-exec.
    libm = next((p for p in ("/usr/lib/x86_64-linux-gnu/libm.so.6", "/lib/x86_64-linux-gnu/libm.so.6",
                             "/usr/lib/aarch64-linux-gnu/libm.so.6") if os.path.isfile(p)), None)
    if libm is None:
        pytest.skip("no libm.so.6 found to preload")
    proc = subprocess.run([sys.executable, "-m", "mlx_dq", "--version"], capture_output=True, text=True,
                          timeout=120, env=_clean_env(MLX_DQ_OPENBLAS_PATH=libm))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("preloading OpenBLAS") == 1, proc.stderr


# -- carried tokenizer files and chat template --------------------------------------------------------------


def test_tokenizer_chat_template_and_generation_config_carried_unchanged(carded_source, mixed_out):
    from mlx_lm.utils import load_tokenizer

    carried = [n for n in os.listdir(carded_source) if hub._matches(n, hub.CARRIED_FILES)]
    assert "generation_config.json" in carried and "tokenizer.json" in carried
    for name in carried:
        assert (mixed_out / name).read_bytes() == (carded_source / name).read_bytes(), name
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
    src_tok = load_tokenizer(carded_source)
    out_tok = load_tokenizer(mixed_out)
    rendered = out_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == src_tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|im_start|>assistant" in rendered and "What is 2 + 3?" in rendered


def test_source_without_tokenizer_files_falls_back_to_saving_the_tokenizer(tmp_path):
    """A source without tokenizer files in its folder falls back to saving the loaded tokenizer."""

    class NoFiles:
        def _tokenizer_dir(self):
            return tmp_path / "empty"

        def save_tokenizer(self, dst):
            (Path(dst) / "tokenizer.json").write_text("{}")

    (tmp_path / "empty").mkdir()
    assert hub.carry_source_files(NoFiles(), tmp_path / "dst") == ["tokenizer.json"]


# -- model card -----------------------------------------------------------------------------------------------


def test_card_carries_source_fields_method_bit_map_command_and_loading(carded_source, mixed_out, stock_out):
    text = (mixed_out / "README.md").read_text()
    meta = card.front_matter(text)
    assert meta["license"] == "apache-2.0" and meta["base_model"] == "someorg/tiny-base"
    assert meta["language"] == ["en"] and meta["library_name"] == "mlx" and "mlx-dq" in meta["tags"]
    manifest = json.loads((mixed_out / "mlx_dq.json").read_text())
    assert "round-to-nearest" in text and "fixed per-tensor recipe" in text
    for i in range(2):  # one bit-map row per decoder layer
        assert re.search(rf"^\s+{i} ", text, re.M)
    assert re.search(r"^\s+1 .*\dm", text, re.M) and not re.search(r"^\s+0 .*\dm", text, re.M)  # mixed: layer 1
    assert f"{manifest['accounting']['average_bits_all']:.3f} bits per weight" in text
    assert "Not evaluated yet" in text
    assert "mlx_dq.convert(" in text and manifest["provenance"]["command"] in text
    assert "--trust-remote-code" in text and "Security note" in text and "mlx_dq.load(" in text
    assert "mlx_dq generate" in text
    stock = (stock_out / "README.md").read_text()
    assert "--trust-remote-code" not in stock and "mlx_lm.server --model" in stock and "from mlx_lm import load" in stock


def test_card_from_cli_records_the_exact_command(carded_source, tmp_path):
    plan = tmp_path / "recipe.json"
    from mlx_dq.conversion.resolve import plan_from_options
    from mlx_dq.plan.plan import save_plan

    save_plan(plan_from_options(_recipe(carded_source, False), resolve(str(carded_source))), plan)
    out = tmp_path / "cli-out"
    args = ["convert", "--model", str(carded_source), "--plan", str(plan), "-o", str(out), "--rows", "2",
            "--seq-len", "32", "--method", "rtn"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    import shlex

    assert f"```bash\n{shlex.join(['mlx_dq', *args])}\n```" in (out / "README.md").read_text()


def test_eval_updates_the_cards_results(carded_source, stock_out, tmp_path):
    import shutil

    out = tmp_path / "evaluated"
    shutil.copytree(stock_out, out)
    before = (out / "README.md").read_text()
    edited = before.replace("## Method", "A note the user added.\n\n## Method")
    (out / "README.md").write_text(edited)
    res = CliRunner().invoke(main, ["eval", str(out), "--rows", "2", "--seq-len", "32", "--no-speed"])
    assert res.exit_code == 0, res.output
    results = json.loads((out / "mlx_dq.json").read_text())["results"]
    text = (out / "README.md").read_text()
    assert "Not evaluated yet" not in text and "A note the user added." in text
    assert f"| {results['kl_divergence']:.4f} |" in text and f"| {results['top1_agreement']:.4f} |" in text
    assert f"| {results['perplexity']:.3f} |" in text and f"| {results['base_perplexity']:.3f} |" in text
    assert results["evaluation"]["text_digest"] in text
    assert text.count("<!-- mlx-dq:results -->") == 1


def test_replace_section_appends_when_missing_and_replaces_once():
    text = card.replace_section("# card\n", "results", "one")
    assert text.endswith("<!-- mlx-dq:results -->\none\n<!-- /mlx-dq:results -->\n")
    again = card.replace_section(text, "results", "two")
    assert "one" not in again and again.count("two") == 1


# -- hub upload ---------------------------------------------------------------------------------------------


def test_upload_file_list_is_exact(mixed_out, carded_source, tmp_path):
    import shutil

    out = tmp_path / "listed"
    shutil.copytree(mixed_out, out)
    (out / ".cache").mkdir()
    (out / ".cache" / "x").write_text("junk")
    (out / ".hidden").write_text("junk")
    (out / "__pycache__").mkdir()
    (out / "__pycache__" / "mlx_dq_model.cpython-311.pyc").write_bytes(b"junk")
    (out / "config.json.tmp").write_text("junk")
    tokenizer = sorted(n for n in os.listdir(carded_source) if hub._matches(n, hub.CARRIED_FILES))
    expected = sorted(["README.md", "config.json", "mlx_dq.json", "mlx_dq_model.py", "model.safetensors",
                       "plan.json", *tokenizer])
    assert hub.upload_files(out) == expected
    res = CliRunner().invoke(main, ["upload", str(out), "someone/tiny", "--list"])
    assert res.exit_code == 0 and res.output.split() == expected


def test_upload_refuses_an_incomplete_folder(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / "config.json").write_text("{}")
    with pytest.raises(hub.HubError, match="not a complete mlx-dq output"):
        hub.upload_files(tmp_path / "half")


@pytest.mark.parametrize("how", ["HF_HUB_OFFLINE", "no network"])
def test_upload_offline_fails_at_once_and_leaves_the_folder(mixed_out, tmp_path, monkeypatch, how):
    import shutil
    import socket

    out = tmp_path / "kept"
    shutil.copytree(mixed_out, out)
    before = _digest(out)
    if how == "HF_HUB_OFFLINE":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        with socket.socket() as s:  # a port nobody listens on: connection refused at once
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    res = CliRunner().invoke(main, ["upload", str(out), "someone/tiny"])
    assert res.exit_code == 1
    assert res.output.startswith("Error: cannot upload: ") and res.output.count("\n") == 1, res.output
    assert ("HF_HUB_OFFLINE" in res.output) == (how == "HF_HUB_OFFLINE")
    assert "is complete" in res.output
    assert _digest(out) == before


def test_convert_with_upload_repo_offline_fails_before_any_work(carded_source, tmp_path, monkeypatch):
    import mlx_dq.conversion.pipeline as conv

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(conv, "convert", lambda *a, **k: pytest.fail("convert started while offline"))
    out = tmp_path / "never"
    res = CliRunner().invoke(main, ["convert", "--model", str(carded_source), "--bpw", "4", "-o", str(out),
                                    "--upload-repo", "someone/tiny"])
    assert res.exit_code == 1 and "HF_HUB_OFFLINE" in res.output, res.output
    assert not out.exists() and not any(tmp_path.iterdir())
    with pytest.raises(hub.HubError, match="HF_HUB_OFFLINE"):
        mlx_dq.convert(str(carded_source), str(out), bpw=4.0, upload_repo="someone/tiny")
    res = CliRunner().invoke(main, ["convert", "--model", str(carded_source), "--bpw", "4", "-o", str(out),
                                    "--upload-repo", "not a repo"])
    assert res.exit_code == 1 and "USER/NAME" in res.output


def test_upload_sends_exactly_the_listed_files_and_names_the_repo_in_the_card(mixed_out, tmp_path, monkeypatch):
    import shutil

    import huggingface_hub

    out = tmp_path / "sent"
    shutil.copytree(mixed_out, out)
    calls = {}
    monkeypatch.setattr(hub, "check_online", lambda timeout=None: None)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_test")
    monkeypatch.setattr(huggingface_hub, "create_repo", lambda repo_id, **k: calls.setdefault("repo", repo_id)
                        and f"https://huggingface.co/{repo_id}")
    monkeypatch.setattr(huggingface_hub, "upload_folder", lambda **k: calls.setdefault("upload", k))
    res = CliRunner().invoke(main, ["upload", str(out), "someone/tiny"])
    assert res.exit_code == 0, res.output
    assert calls["repo"] == "someone/tiny" and calls["upload"]["repo_id"] == "someone/tiny"
    assert calls["upload"]["allow_patterns"] == hub.upload_files(out)
    text = (out / "README.md").read_text()
    assert 'mlx_dq.load("someone/tiny")' in text and "--model someone/tiny --trust-remote-code" in text


# -- Python API ------------------------------------------------------------------------------------------------


def test_python_api_reads_like_mlx_lm(carded_source, tmp_path):
    import mlx_lm

    from mlx_dq.conversion.pipeline import convert as inner
    from mlx_dq.conversion.pipeline import convert_as_mlx_lm

    assert mlx_dq.convert is convert_as_mlx_lm

    assert inner is not mlx_dq.convert
    params = inspect.signature(mlx_dq.convert).parameters
    assert list(params)[:3] == ["hf_path", "mlx_path", "bpw"] and {"upload_repo", "dtype"} <= set(params)
    mlx_params = inspect.signature(mlx_lm.convert).parameters
    assert {"hf_path", "mlx_path", "upload_repo", "dtype"} <= set(mlx_params)
    out = tmp_path / "api"
    manifest = mlx_dq.convert(hf_path=str(carded_source), mlx_path=str(out), plan=_recipe(carded_source, False),
                              dtype="float16", **CALIB)
    assert (out / "README.md").is_file() and manifest["provenance"]["command"].startswith("mlx_dq.convert(")
    model, _ = mlx_lm.load(str(out))
    bf = mlx_dq.convert(str(carded_source), str(tmp_path / "bf"), plan=_recipe(carded_source, False),
                        dtype="bfloat16", **CALIB)
    assert bf["provenance"]["settings"]["dtype"] == "bfloat16"
    assert json.loads((tmp_path / "bf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="bfloat16"):
        mlx_dq.convert(str(carded_source), str(tmp_path / "bf-gptq"), plan=_recipe(carded_source, False),
                       dtype="bfloat16", **{**CALIB, "method": "gptq"})


@pytest.mark.parametrize("first", ["import mlx_dq", "from mlx_dq.conversion.pipeline import convert", "import mlx_dq.conversion.pipeline"])
def test_mlx_dq_convert_is_callable_whatever_is_imported_first(first):
    code = (f"{first}\nimport mlx_dq, inspect\nfrom mlx_dq.conversion.pipeline import quantize_model, convert as c\n"
            "assert callable(mlx_dq.convert) and callable(c) and c is not mlx_dq.convert\n"
            "from mlx_dq import convert as api\nassert api is mlx_dq.convert\n"
            "print(list(inspect.signature(api).parameters)[:2])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, MLX_DQ_NO_OPENBLAS="1"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['hf_path', 'mlx_path']"


def test_upload_command_and_option_have_help():
    res = CliRunner().invoke(main, ["upload", "--help"])
    assert res.exit_code == 0 and res.output.startswith("Usage: mlx_dq upload")
    res = CliRunner().invoke(main, ["convert", "--help"])
    assert "--upload-repo" in res.output
