"""Never a wrong number, never a traceback from a damaged output folder.

The source a folder was made from is recorded as an absolute path and checked
by its fingerprint before ``eval`` or ``distill`` compare with it; ``verify``
(and ``upload``) compare every weight file with its recorded sha256; loading
checks the weight headers first. A seeded fuzz damages one copy of a converted
folder per case (truncated, byte-flipped, removed or edited files) and runs
``inspect``, ``verify``, ``generate`` and ``eval`` on it: each ends cleanly.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
from cli_checks import cli, one_error_line
from fixtures_models import make_tiny_model_folder

from mlx_dq.conversion.resolve import plan_from_options
from mlx_dq.model.sources import resolve
from mlx_dq.plan.plan import save_plan

CALIB = ["--rows", "2", "--seq-len", "16", "--method", "rtn", "--no-clip"]
EVAL = ["--rows", "1", "--seq-len", "8", "--batch-size", "1", "--no-speed", "--no-write"]
SEED = 4747
CASES = 300


def clean(result) -> bool:
    """True when a run succeeded; asserts a failed run is one clean error line."""
    if result.exit_code == 0 and result.exception is None:
        return True
    one_error_line(result)
    return False


def _convert(src: Path, out: Path, mixed: bool = True) -> Path:
    """Convert ``src`` into ``out`` with 4-bit layers (and mixed 4/3-bit MLP layers, which add the model file)."""
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import build_model

    source = resolve(str(src))
    mods = quantizable_modules(build_model(source.config))
    opts = {k: ("0.5:4b_32g/0.5:3b_64g" if mixed and "mlp" in k else "1.0:4b_64g") for k in mods}
    plan = out.parent / f"{out.name}-plan.json"
    save_plan(plan_from_options(opts, source), plan)
    r = cli("convert", "--model", src, "--plan", plan, "-o", out, *CALIB)
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, Path]:
    """One tiny llama, its converted folder, and a text file to evaluate on."""
    tmp = tmp_path_factory.mktemp("integrity")
    src = make_tiny_model_folder(tmp, "llama", 2, name="src")
    text = tmp / "eval.txt"
    text.write_text("def add(a, b):\n    return a + b\n\nprint(add(2, 3))\n" * 8)
    return {"tmp": tmp, "src": src, "out": _convert(src, tmp / "out"), "text": text}


def _copy(folder: Path, dst: Path) -> Path:
    shutil.copytree(folder, dst)
    return dst


def _data_start(path: Path) -> int:
    """Where a safetensors file's tensor data begins (after the length prefix and the header)."""
    with open(path, "rb") as fh:
        return 8 + int.from_bytes(fh.read(8), "little")


def _xor(path: Path, start: int, count: int, rng: random.Random) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, min(start + count, len(data))):
        data[i] ^= rng.randrange(1, 256)
    path.write_bytes(bytes(data))


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "mlx_dq.json").read_text())


# --------------------------------------------------------------------------- the source eval and distill compare with
def test_the_source_is_recorded_by_absolute_path_and_found_from_any_folder(made, tmp_path, monkeypatch):
    work = tmp_path / "a"
    src = make_tiny_model_folder(work, "llama", 2, name="src")
    monkeypatch.chdir(work)
    out = _convert(Path("src"), Path("out"))  # a relative --model, as users type it
    assert _manifest(out)["provenance"]["source"]["spec"] == str(src.resolve())
    other = tmp_path / "b"
    make_tiny_model_folder(other, "llama", 2, name="src", seed=1)  # another model under the same name
    monkeypatch.chdir(other)
    r = cli("eval", work / "out", "--text", made["text"], *EVAL)
    assert r.exit_code == 0, r.output
    assert f"(base: {src.resolve()})" in r.output


def test_eval_and_distill_refuse_a_source_whose_fingerprint_changed(made, tmp_path):
    src = _copy(made["src"], tmp_path / "src")
    out = _convert(src, tmp_path / "out", mixed=False)
    other = make_tiny_model_folder(tmp_path, "llama", 2, name="other", seed=1)
    shutil.copy(other / "model.safetensors", src / "model.safetensors")  # the source folder now holds another model
    before = (out / "mlx_dq.json").read_text()
    line = one_error_line(cli("eval", out, "--text", made["text"], *EVAL[:-1]), "fingerprint", "--base")
    assert str(src) in line and str(out) in line
    assert (out / "mlx_dq.json").read_text() == before  # no wrong results written
    line = one_error_line(cli("distill", out, "-o", tmp_path / "d", "--rows", "1", "--seq-len", "8", "--steps", "1"),
                       "fingerprint", "--model")
    assert str(src) in line and not (tmp_path / "d").exists()


def test_an_older_manifest_with_a_relative_source_is_resolved_and_still_checked(made, tmp_path, monkeypatch):
    from mlx_dq.evaluation.metrics import manifest_base

    work = tmp_path / "a"
    src = _copy(made["src"], work / "src")
    out = _convert(src, work / "out", mixed=False)
    manifest = _manifest(out)
    manifest["provenance"]["source"]["spec"] = "src"  # what earlier versions recorded
    (out / "mlx_dq.json").write_text(json.dumps(manifest))
    other = tmp_path / "b"
    make_tiny_model_folder(other, "llama", 2, name="src", seed=1)
    monkeypatch.chdir(other)
    assert manifest_base(out) == str(src.resolve())  # beside the folder, not the other `src` here
    shutil.rmtree(src)
    one_error_line(cli("eval", out, "--text", made["text"], *EVAL), "fingerprint", str(other / "src"))


def test_hub_ids_and_bundled_names_are_recorded_as_given(tmp_path):
    from mlx_dq.model.sources import DEFAULT_MODEL, ModelSource, recorded_spec

    assert recorded_spec(ModelSource("user/model", "hub", tmp_path, {})) == "user/model"
    assert recorded_spec(ModelSource(DEFAULT_MODEL, "default", tmp_path / "x.gguf", {})) == DEFAULT_MODEL
    assert recorded_spec(ModelSource("m.gguf", "gguf", Path("m.gguf"), {})) == str(Path("m.gguf").resolve())


# --------------------------------------------------------------------------- changed and damaged weights
def test_verify_names_a_changed_weight_file_and_inspect_says_it_checks_sizes(made, tmp_path):
    ok = cli("verify", made["out"])
    assert ok.exit_code == 0 and "sha256" in ok.output, ok.output
    folder = _copy(made["out"], tmp_path / "changed")
    weights = folder / "model.safetensors"
    _xor(weights, _data_start(weights) + 100, 1000, random.Random(0))
    one_error_line(cli("verify", folder), "model.safetensors", "sha256")
    shown = cli("inspect", folder)  # sizes and headers are intact: inspect passes, and says what it checked
    assert shown.exit_code == 0 and "mlx_dq verify" in shown.output and "sha256" in shown.output
    assert "sha256" in cli("inspect", "--help").output


def test_a_damaged_header_or_cut_weights_give_one_error_line(made, tmp_path):
    folder = _copy(made["out"], tmp_path / "header")
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data.replace(b'"dtype"', b'"dtypf"', 1))  # MLX: RuntimeError key 'dtype' not found
    for args in (["generate", "--model", folder, "-p", "hi", "--max-tokens", "2"],
                 ["eval", folder, "--text", made["text"], *EVAL], ["inspect", folder], ["verify", folder]):
        one_error_line(cli(*args), "model.safetensors")
    cut = _copy(made["out"], tmp_path / "cut")
    with open(cut / "model.safetensors", "r+b") as fh:
        fh.truncate(len(data) - 100)
    one_error_line(cli("generate", "--model", cut, "-p", "hi", "--max-tokens", "2"), "model.safetensors")


def test_inspect_summarizes_a_measurement_file(made, tmp_path):
    from mlx_dq.measure.stream import measure

    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"roles": {"default": ["1.0:3b_64g", "1.0:4b_64g"]}}))
    m = tmp_path / "m.json"
    measure(str(made["src"]), out_path=m, grid=str(grid), rows=2, seq_len=16, batch_size=1, clip=False,
            method="rtn", kl_scale=False, progress=False)
    r = cli("inspect", m)
    assert r.exit_code == 0, r.output
    assert "mlx_dq.measurement measurement" in r.output


def test_upload_runs_the_checks_of_verify(made, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    entry = _copy(made["out"], tmp_path / "entry")
    (entry / "evil.py").write_text((entry / "mlx_dq_model.py").read_text())
    config = json.loads((entry / "config.json").read_text())
    config["model_file"] = "evil.py"
    (entry / "config.json").write_text(json.dumps(config))
    for extra in ([], ["--list"]):
        one_error_line(cli("upload", entry, "user/name", *extra), "evil.py", "verify")
    changed = _copy(made["out"], tmp_path / "changed")
    _xor(changed / "model.safetensors", _data_start(changed / "model.safetensors"), 8, random.Random(1))
    one_error_line(cli("upload", changed, "user/name"), "model.safetensors", "sha256")
    listed = cli("upload", made["out"], "user/name", "--list")
    assert listed.exit_code == 0 and "model.safetensors" in listed.output

# --------------------------------------------------------------------------- the fuzz
CONFIG_KEYS = ["model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
               "num_key_value_heads", "intermediate_size", "rms_norm_eps", "rope_theta", "tie_word_embeddings",
               "quantization", "mlx_dq", "model_file", "head_dim", "max_position_embeddings"]
WRONG_VALUES = ["abc", -1, 0, 3, None, [1], {}, 1.5, True]


def _edit_config(folder: Path, rng: random.Random) -> str:
    """Edit config.json the way a hand (or a bad tool) might: cut, retyped, a field dropped or changed."""
    path = folder / "config.json"
    text = path.read_text()
    config = json.loads(text)
    how = rng.choice(["cut", "not_object", "drop", "retype", "retype", "bits", "group", "mixed", "model_file"])
    if how == "cut":
        path.write_text(text[: rng.randrange(len(text))])
        return "config.json cut short"
    if how == "not_object":
        path.write_text(json.dumps(rng.choice([[], 5, "x", None])))
        return "config.json not an object"
    key = rng.choice(CONFIG_KEYS)
    if how == "drop":
        config.pop(key, None)
    elif how == "retype":
        config[key] = rng.choice(WRONG_VALUES)
    elif how in ("bits", "group"):
        q = config["quantization"]
        target = q if rng.random() < 0.5 else q[rng.choice([k for k, v in q.items() if isinstance(v, dict)])]
        target[how if how == "bits" else "group_size"] = rng.choice([2, 3, 5, 8, 16, 32, 128, "x", None])
        key = "quantization"
    elif how == "mixed":
        mixed = config["mlx_dq"]["mixed"]
        name = rng.choice(sorted(mixed))
        mixed[name]["option"] = rng.choice(["1.0:4b_64g", "0.5:3b_64g/0.5:4b_32g", "garbage", 7, None])
        key = f"mlx_dq.mixed.{name}"
    else:
        config["model_file"] = rng.choice(["evil.py", "../x.py", 5, None])
    path.write_text(json.dumps(config))
    return f"config.json {how} {key}"


def damage(folder: Path, rng: random.Random) -> str:
    """Damage ``folder`` in one way and return a label for the failure message."""
    weights = folder / "model.safetensors"
    kind = rng.choice(["truncate", "header", "header", "data", "prefix", "remove", "config", "config", "json_byte"])
    if kind == "truncate":
        name = rng.choice(["model.safetensors", "model.safetensors", "config.json", "tokenizer.json", "mlx_dq.json",
                           "mlx_dq_model.py", "tokenizer_config.json"])
        size = (folder / name).stat().st_size
        cut = rng.randrange(size)
        with open(folder / name, "r+b") as fh:
            fh.truncate(cut)
        return f"{name} truncated to {cut} bytes"
    if kind in ("header", "data", "prefix"):
        start = _data_start(weights)
        lo, hi = {"header": (8, start), "data": (start, weights.stat().st_size), "prefix": (0, 8)}[kind]
        at, count = rng.randrange(lo, hi), rng.choice([1, 1, 2, 8, 1000] if kind == "data" else [1, 1, 2])
        _xor(weights, at, count, rng)
        return f"model.safetensors: {count} {kind} byte(s) flipped at {at}"
    if kind == "remove":
        name = rng.choice(sorted(p.name for p in folder.iterdir()))
        (folder / name).unlink()
        return f"{name} removed"
    if kind == "config":
        return _edit_config(folder, rng)
    name = rng.choice(["config.json", "tokenizer.json", "tokenizer_config.json", "mlx_dq.json"])
    at = rng.randrange((folder / name).stat().st_size)
    _xor(folder / name, at, 1, rng)
    return f"{name}: byte {at} flipped"


def test_every_damaged_folder_ends_in_one_clean_line(made, tmp_path):
    rng, failures = random.Random(SEED), []
    seen = {"inspect": 0, "verify": 0, "generate": 0, "eval": 0}
    for n in range(CASES):
        folder = _copy(made["out"], tmp_path / f"case{n}")
        label = damage(folder, rng)
        runs = {
            "inspect": cli("inspect", folder),
            "verify": cli("verify", folder),
            "generate": cli("generate", "--model", folder, "-p", "hi", "--max-tokens", "2", "--no-chat"),
            "eval": cli("eval", folder, "--text", made["text"], *EVAL),
        }
        for name, r in runs.items():
            try:
                seen[name] += not clean(r)
            except AssertionError as e:
                failures.append(f"case {n} ({label}), {name}: {str(e)[:300]}")
        if label.startswith(("model.safetensors", "mlx_dq_model.py")):  # changed, cut or removed: verify sees it
            assert runs["verify"].exit_code != 0, f"case {n} ({label}): verify passed"
        shutil.rmtree(folder)
    assert not failures, "\n".join(failures)
    assert all(seen.values()), seen  # each command met damage it refused


def test_an_output_of_the_bundled_gemma_name_finds_its_source(made, tmp_path, monkeypatch):
    """``convert --model gemma3-270m`` records the name with kind "gguf"; eval must resolve it as the name."""
    from mlx_dq.conversion import writer
    from mlx_dq.model import sources

    out = _copy(made["out"], tmp_path / "out")
    manifest = _manifest(out)
    manifest["provenance"]["source"].update(spec=sources.GEMMA_MODEL, kind="gguf", fingerprint="f" * 64)
    (out / "mlx_dq.json").write_text(json.dumps(manifest))
    asked = []

    def resolve(spec):
        asked.append(spec)
        if spec != sources.GEMMA_MODEL:
            raise ValueError(f"model path {spec} does not exist")
        return type("S", (), {"fingerprint": lambda self: "f" * 64})()

    monkeypatch.setattr(sources, "resolve", resolve)
    assert writer.recorded_source(out) == sources.GEMMA_MODEL
    assert asked == [sources.GEMMA_MODEL]
