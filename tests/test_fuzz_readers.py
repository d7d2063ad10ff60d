"""Fuzzing the measurement, plan and manifest readers through the CLI: every damaged file is one clean error.

Each file is a valid mlx-dq file with one damage that makes it wrong: truncated,
a field of the wrong type, NaN / infinite / negative numbers, a missing required
field, an unknown field, or a huge number that disagrees with the rest. Each is
fed to the command that reads it (``optimize`` for measurements, ``convert
--plan`` for plans, ``inspect`` for manifests), which must exit 1 with one
``Error:`` line and no traceback.
"""

from __future__ import annotations

import copy
import json
import math
import random
from pathlib import Path
from typing import Any, Callable

import pytest
from click.testing import CliRunner
from fixtures_models import make_tiny_model_folder

from mlx_dq.cli import main
from mlx_dq.measure.stream import measure

SEED = 1234
PER_READER = 200  # 600 damaged files in all
GRID = {"default": ["1.0:3b_64g", "1.0:4b_64g", "0.5:4b_32g/0.5:3b_64g", "1.0:8b_64g"]}
CALIB = ["--rows", "4", "--seq-len", "32", "--method", "rtn", "--no-clip"]

WRONG = {
    "num": ["abc", [1], {"a": 1}, True],
    "int": ["abc", 1.5, [1], {"a": 1}, True],
    "str": [1, 2.5, [], {}, True],
    "list": ["abc", 5, {"a": 1}, True, [1.5, 2], None],
    "obj": ["abc", 5, [], True],
}
BAD_NUMBERS = [math.nan, math.inf, -math.inf, -1.0]
HUGE = [10**30, 2**64 + 1, 10**400]


# --------------------------------------------------------------------------- damaging a document
def _get(doc: Any, path: tuple) -> Any:
    for p in path:
        doc = doc[p]
    return doc


def _set(doc: Any, path: tuple, value: Any) -> None:
    _get(doc, path[:-1])[path[-1]] = value


def _delete(doc: Any, path: tuple) -> None:
    del _get(doc, path[:-1])[path[-1]]


def damage(doc: dict, fields: list[tuple[tuple, str, bool, bool]], objects: list[tuple], extra: Callable | None,
           rng: random.Random) -> tuple[str, str]:
    """One damaged copy of ``doc`` as JSON text, and a label saying what was damaged.

    ``fields``: (path, kind, required, huge_is_wrong) of the fields the reader uses;
    ``objects``: paths of closed objects that take no unknown field; ``extra``: a
    document-specific "extra entry" damage (or None).
    """
    doc = copy.deepcopy(doc)
    kind = rng.choice(["truncate", "type", "number", "missing", "extra", "huge"])
    if kind == "truncate":
        text = json.dumps(doc, indent=1)
        cut = rng.randrange(0, len(text) - 1)
        return text[:cut], f"truncated at {cut}"
    if kind == "type":
        path, k, _, _ = rng.choice(fields)
        value = rng.choice(WRONG[k])
        _set(doc, path, value)
        return json.dumps(doc), f"{path} = {value!r}"
    if kind == "number":
        path, k, _, _ = rng.choice([f for f in fields if f[1] in ("num",)])
        value = rng.choice(BAD_NUMBERS)
        _set(doc, path, value)
        return json.dumps(doc), f"{path} = {value!r}"  # json.dumps writes NaN / Infinity, as other tools do
    if kind == "missing":
        path = rng.choice([f[0] for f in fields if f[2]])
        _delete(doc, path)
        return json.dumps(doc), f"{path} deleted"
    if kind == "extra":
        if extra is not None and (not objects or rng.random() < 0.3):
            return json.dumps(extra(doc, rng)), "extra entry"
        path = rng.choice(objects)
        _get(doc, path)["unexpected_field"] = rng.choice([1, "x", None, [], {}])
        return json.dumps(doc), f"extra field in {path}"
    path, k, _, _ = rng.choice([f for f in fields if f[3]])
    value = rng.choice(HUGE)
    if k == "list":
        dims = list(_get(doc, path))
        dims[rng.randrange(len(dims))] = value
        value = dims
    _set(doc, path, value)
    return json.dumps(doc), f"{path} = huge"


def assert_clean_error(result, label: str) -> None:
    assert not (result.exception and not isinstance(result.exception, SystemExit)), (
        f"{label}: traceback: {result.exception!r}")
    assert result.exit_code == 1, f"{label}: exit {result.exit_code}\n{result.output}"
    lines = [ln for ln in result.output.splitlines() if "Error:" in ln]
    assert len(lines) == 1 and lines[0].startswith("Error: "), f"{label}: {result.output}"
    assert "Traceback" not in result.output, label


# --------------------------------------------------------------------------- the valid files
@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("fuzz")
    grid = tmp / "grid.json"
    grid.write_text(json.dumps({"roles": GRID}))
    model = make_tiny_model_folder(tmp, "llama", 2)
    m = tmp / "m.json"
    measure(str(model), grid=str(grid), out_path=m, rows=4, seq_len=32, batch_size=2, clip=False, method="rtn",
            kl_scale=False, progress=False)
    runner = CliRunner()
    plan = tmp / "plan.json"
    r = runner.invoke(main, ["optimize", str(m), "--bpw", "4", "-o", str(plan)])
    assert r.exit_code == 0, r.output
    out = tmp / "out"
    r = runner.invoke(main, ["convert", "--model", str(model), "--plan", str(plan), "-o", str(out), *CALIB])
    assert r.exit_code == 0, r.output
    assert runner.invoke(main, ["inspect", str(out)]).exit_code == 0
    return {"tmp": tmp, "model": model, "m": m, "plan": plan, "out": out}


def _measurement_fields(doc: dict) -> tuple[list, list]:
    fields = [(("format",), "str", True, False), (("version",), "int", True, False),
              (("measurement",), "list", True, False), (("tied",), "obj", False, False),
              (("extra",), "obj", False, False)]
    objects = [()]
    for i, t in enumerate(doc["measurement"]):
        base = ("measurement", i)
        objects.append(base)
        fields += [(base + ("key",), "str", True, False), (base + ("shape",), "list", True, True),
                   (base + ("numel",), "int", False, True), (base + ("importance",), "num", False, False),
                   (base + ("role",), "str", False, False), (base + ("options",), "list", True, False)]
        for j in range(len(t["options"])):
            o = base + ("options", j)
            objects.append(o)
            fields += [(o + ("mlx",), "str", True, False), (o + ("bpw",), "num", True, True),
                       (o + ("total_bits",), "int", True, True), (o + ("err",), "num", True, False)]
    return fields, objects


def _plan_fields(doc: dict) -> tuple[list, list]:
    fields = [(("format",), "str", True, False), (("version",), "int", True, False),
              (("tensors",), "list", True, False)]
    for name in ("target_bpw", "achieved_bpw", "objective", "total_bpw"):
        fields.append(((name,), "num", True, False))
    for name in ("budget_bits", "used_bits", "numel"):
        fields.append(((name,), "int", True, False))
    objects = [()]
    for i in range(len(doc["tensors"])):
        e = ("tensors", i)
        objects.append(e)
        fields += [(e + ("key",), "str", True, False), (e + ("option",), "str", True, False),
                   (e + ("bits",), "int", True, False), (e + ("shape",), "list", True, True),
                   (e + ("numel",), "int", True, True), (e + ("err",), "num", False, False),
                   (e + ("scope",), "str", False, False)]
    return fields, objects


def _manifest_fields(doc: dict) -> tuple[list, list]:
    fields = [(("schema",), "str", True, False), (("modules",), "obj", True, False),
              (("accounting",), "obj", False, False), (("tied",), "obj", False, False),
              (("files",), "list", False, False)]
    for name in doc["accounting"]:
        if doc["accounting"][name] is not None:
            fields.append((("accounting", name), "num", False, False))
    for i in range(len(doc["files"])):
        fields += [(("files", i, "name"), "str", True, False), (("files", i, "bytes"), "int", True, True)]
    for name, rec in doc["modules"].items():
        r = ("modules", name)
        bits = "storage_bits" if "storage_bits" in rec else "bits"
        fields += [(r + ("option",), "str", True, False), (r + ("shape",), "list", True, True),
                   (r + ("numel",), "int", True, True), (r + (bits,), "int", True, True),
                   (r + ("bpw",), "num", True, True), (r + ("bytes",), "int", True, False)]
    return fields, []


def _manifest_extra(doc: dict, rng: random.Random) -> dict:
    """An extra module the folder's config.json does not quantize, or an extra file that is not there."""
    if rng.random() < 0.5:
        rec = next(r for r in doc["modules"].values() if r["option"] != "16bit")
        doc["modules"]["model.layers.0.mlp.extra_proj"] = dict(rec)
    else:
        doc["files"].append({"name": "model-00002-of-00002.safetensors", "bytes": 1024})
    return doc


# --------------------------------------------------------------------------- the fuzz
def test_fuzzed_files_always_give_one_clean_error(files):
    rng = random.Random(SEED)
    runner = CliRunner()
    tmp = files["tmp"]
    counts = {}

    m_doc = json.loads(files["m"].read_text())
    fields, objects = _measurement_fields(m_doc)
    bad = tmp / "bad-measurement.json"
    for n in range(PER_READER):
        text, label = damage(m_doc, fields, objects, None, rng)
        bad.write_text(text)
        r = runner.invoke(main, ["optimize", str(bad), "--bpw", "4", "-o", str(tmp / "fuzz-plan.json")])
        assert_clean_error(r, f"measurement #{n}: {label}")
        assert not (tmp / "fuzz-plan.json").exists()
    counts["measurement"] = PER_READER

    p_doc = json.loads(files["plan"].read_text())
    fields, objects = _plan_fields(p_doc)
    bad = tmp / "bad-plan.json"
    for n in range(PER_READER):
        text, label = damage(p_doc, fields, objects, None, rng)
        bad.write_text(text)
        r = runner.invoke(main, ["convert", "--model", str(files["model"]), "--plan", str(bad),
                                 "-o", str(tmp / "fuzz-out"), *CALIB])
        assert_clean_error(r, f"plan #{n}: {label}")
        assert not (tmp / "fuzz-out").exists()
    counts["plan"] = PER_READER

    manifest = files["out"] / "mlx_dq.json"
    good = manifest.read_text()
    f_doc = json.loads(good)
    fields, objects = _manifest_fields(f_doc)
    try:
        for n in range(PER_READER):
            text, label = damage(f_doc, fields, objects, _manifest_extra, rng)
            manifest.write_text(text)
            assert_clean_error(runner.invoke(main, ["inspect", str(files["out"])]), f"manifest #{n}: {label}")
    finally:
        manifest.write_text(good)
    counts["manifest"] = PER_READER
    assert sum(counts.values()) >= 500
