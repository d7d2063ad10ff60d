"""Other tools' files through real commands: dynquant manifests (002), kept-16-bit MLX configs (003),
dashq records (004), ExLlamaV2 measurements without embedding/head (000, 001); our manifest's facts and schema."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from click.testing import CliRunner
from fixtures_models import save_tokenizer, tiny_tokenizer
from mlx.utils import tree_flatten
from seeds import seed_path

from mlx_dq.cli import main
from mlx_dq.formats import dashq, detect, dynquant, mlx_kept16
from mlx_dq.formats.common import map_names, modules_for, storable_option
from mlx_dq.measure.records import (
    JointGroup,
    JointOption,
    Measurement,
    OptionRecord,
    save_measurement,
)
from mlx_dq.model.sources import build_model
from mlx_dq.plan.plan import load_plan
from mlx_dq.plan.solver import optimize
from mlx_dq.quant.options import QuantOption

SCHEMA = Path(__file__).resolve().parents[1] / "mlx_dq" / "schemas" / "manifest.schema.json"


def run(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


# --------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def seed002() -> dict:
    return json.loads(seed_path("002").read_text())


def lfm2_moe_config(seed: dict, hidden: int = 128) -> dict:
    """A tiny mlx-lm lfm2_moe config with the seed's layer count and attention/convolution layout."""
    names = seed["layers"]
    n_layers = 1 + max(int(k.split(".")[2]) for k in names if k.startswith("model.layers."))
    attn = sorted({int(k.split(".")[2]) for k in names if ".self_attn." in k})
    tok = tiny_tokenizer()
    return {
        "model_type": "lfm2_moe", "architectures": ["Lfm2MoeForCausalLM"], "vocab_size": len(tok),
        "hidden_size": hidden, "intermediate_size": 2 * hidden, "moe_intermediate_size": hidden,
        "num_hidden_layers": n_layers, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "use_expert_bias": True, "num_dense_layers": 0, "norm_eps": 1e-5, "conv_bias": False, "conv_L_cache": 3,
        "rope_theta": 10000.0, "full_attn_idxs": attn, "tie_word_embeddings": True,
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
    }


@pytest.fixture(scope="module")
def lfm2_moe(tmp_path_factory, seed002) -> Path:
    """A tiny random LFM2-MoE (mlx-lm's lfm2_moe class) laid out like seed 002's model, as an HF folder."""
    cfg = lfm2_moe_config(seed002)
    mx.random.seed(0)
    weights = {k: v.astype(mx.float32) for k, v in tree_flatten(build_model(cfg).parameters())}
    folder = tmp_path_factory.mktemp("lfm2") / "lfm2-moe-tiny"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_tokenizer(folder, cfg["vocab_size"])
    return folder


@pytest.fixture(scope="module")
def converted002(lfm2_moe, tmp_path_factory) -> tuple[Path, str]:
    """``mlx_dq convert --plan <seed 002>`` of the tiny LFM2-MoE: the output folder and what it printed."""
    out = tmp_path_factory.mktemp("o002") / "out"
    res = run("convert", "--model", lfm2_moe, "--plan", seed_path("002"), "-o", out, "--method", "rtn",
              "--rows", 2, "--seq-len", 32)
    assert res.exit_code == 0, res.output
    return out, res.output


# --------------------------------------------------------------------------- seeds folder rule
def test_seed_path_skips_without_folder_and_fails_when_present_but_unreadable(tmp_path, monkeypatch):
    import seeds

    monkeypatch.setattr(seeds, "SEEDS_DIR", tmp_path / "absent")
    with pytest.raises(pytest.skip.Exception):
        seeds.seed_path("002")
    monkeypatch.setattr(seeds, "SEEDS_DIR", tmp_path)
    with pytest.raises(pytest.fail.Exception, match="has no 002"):
        seeds.seed_path("002")
    (tmp_path / "002_x.txt").write_bytes(b"")
    with pytest.raises(pytest.fail.Exception, match="empty"):
        seeds.seed_path("002")
    (tmp_path / "002_x.txt").write_text("{}")
    assert seeds.seed_path("002") == tmp_path / "002_x.txt"


def test_seeds_are_found_beside_the_repository_root():
    import seeds

    assert seeds.SEEDS_DIR == Path(__file__).resolve().parents[1].parent / "shared" / "seeds"


# --------------------------------------------------------------------------- 002: dynquant manifest
def test_seed002_converts_with_its_per_tensor_widths(converted002, seed002):
    out, printed = converted002
    plan = load_plan(out / "plan.json")
    mapped, unmapped = plan.source["mapped"], plan.source["unmapped"]
    assert len(mapped) + len(unmapped) == len(seed002["layers"])
    # every unmapped name is a shared-expert projection mlx-lm's lfm2_moe lacks, and is listed in the output
    assert unmapped and all(re.search(r"\.moe\.sw[123]$", k) for k in unmapped)
    assert all(k in printed for k in unmapped) and "72 unmapped" in printed
    qconf = json.loads((out / "config.json").read_text())["quantization"]
    manifest = json.loads((out / "mlx_dq.json").read_text())
    arrays = mx.load(str(out / "model.safetensors"))
    checked = 0
    for theirs, ours in mapped.items():
        rec = seed002["layers"][theirs]
        opt, note = storable_option(rec["bits"], rec["group_size"], manifest["modules"][ours]["shape"][-1])
        assert note is None  # every width of this seed is storable in MLX
        assert qconf[ours] == {"group_size": rec["group_size"], "bits": rec["bits"], "mode": "affine"}
        assert manifest["modules"][ours]["packing"]["bits"] == rec["bits"]
        shape = manifest["modules"][ours]["shape"]
        # the stored arrays themselves: packed words and one scale per group at that width
        assert arrays[f"{ours}.weight"].shape[-1] * 32 == shape[-1] * rec["bits"]
        assert arrays[f"{ours}.scales"].shape[-1] == shape[-1] // rec["group_size"]
        checked += 1
    assert checked == 133
    assert set(mapped.values()) >= {"model.embed_tokens", "model.layers.0.feed_forward.switch_mlp.down_proj",
                                    "model.layers.3.self_attn.out_proj"}


def test_seed002_output_loads_and_runs_in_mlx_lm(converted002):
    from mlx_lm import load

    model, _ = load(str(converted002[0]))
    logits = model(mx.array([[1, 2, 3, 4]]))
    mx.eval(logits)
    assert np.isfinite(np.array(logits.astype(mx.float32))).all()


def test_import_plan_command_lists_mapping(lfm2_moe, tmp_path):
    res = run("import-plan", seed_path("002"), "--model", lfm2_moe, "-o", tmp_path / "p.json")
    assert res.exit_code == 0, res.output
    assert "imported 133 tensors" in res.output and "model.layers.0.moe.sw1" in res.output
    plan = load_plan(tmp_path / "p.json")
    assert plan.entry("model.layers.1.feed_forward.switch_mlp.gate_proj").option == "1.0:2b_128g"  # 1.moe.w1: 2-bit


def test_name_mapping_and_storability_rules():
    modules = {"model.layers.0.self_attn.out_proj": [64, 64], "model.embed_tokens": [100, 64],
               "model.layers.0.feed_forward.switch_mlp.up_proj": [4, 32, 64]}
    mapped, unmapped = map_names(["model.layers.0.self_attn.o_proj", "embed_tokens.weight", "model.layers.0.moe.w3",
                                  "model.layers.0.moe.sw2", "model.layers.9.conv.in_proj"], modules, "lfm2_moe")
    assert mapped == {"model.layers.0.self_attn.o_proj": "model.layers.0.self_attn.out_proj",
                      "embed_tokens.weight": "model.embed_tokens",
                      "model.layers.0.moe.w3": "model.layers.0.feed_forward.switch_mlp.up_proj"}
    assert set(unmapped) == {"model.layers.0.moe.sw2", "model.layers.9.conv.in_proj"}
    assert storable_option(7, 64, 128)[0].desc == "1.0:8b_64g"  # widths round up, never down
    assert storable_option(4, 128, 96)[0].desc == "1.0:4b_32g"  # group that does not divide the inputs
    assert storable_option(None, None, 96)[0].keep16


# --------------------------------------------------------------------------- our manifest: schema and 002's facts
def test_manifest_validates_against_the_committed_schema(converted002):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(SCHEMA.read_text())
    manifest = json.loads((converted002[0] / "mlx_dq.json").read_text())
    jsonschema.validate(manifest, schema)
    bad = json.loads(json.dumps(manifest))
    name = next(iter(bad["modules"]))
    bad["modules"][name]["bits"] = bad["modules"][name]["storage_bits"]  # the old, colliding meaning of "bits"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)
    bad = json.loads(json.dumps(manifest))
    del bad["files"][0]["sha256"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, schema)


def _leaf_paths(d, prefix: str = "") -> set[str]:
    out = set()
    for k, v in d.items():
        key = "*" if prefix.endswith(("modules.", "layers.")) else k
        path = prefix + key
        if isinstance(v, dict) and v:
            out |= _leaf_paths(v, path + ".")
        else:
            out.add(path)
    return out


def _get(doc: dict, path: str, module: str | None):
    cur = doc
    for part in path.split("."):
        cur = cur[module if part == "*" else part]
    return cur


def test_manifest_facts_match_seed002_field_by_field(converted002, seed002):
    out, _ = converted002
    ours = json.loads((out / "mlx_dq.json").read_text())
    mapped = load_plan(out / "plan.json").source["mapped"]
    # every field of 002 is in the table: covered (same name), renamed, or not applicable with a reason
    paths = _leaf_paths(seed002)
    assert paths <= set(dynquant.FIELD_TABLE), sorted(paths - set(dynquant.FIELD_TABLE))
    theirs_mod = "model.layers.0.moe.w2"
    our_mod = mapped[theirs_mod]
    for path, (status, where) in dynquant.FIELD_TABLE.items():
        assert status in ("covered", "renamed", "not applicable")
        if status == "not applicable":
            continue
        value = _get(ours, where, our_mod)  # KeyError: a fact we claim to have is missing
        if status == "covered":
            assert where == path or where.split(".")[-1] == path.split(".")[-1]
        assert value is not None or path in ("provenance.widths_from",), path
    # same meanings, compared value by value on a module imported from 002
    t = seed002["layers"][theirs_mod]
    pk = ours["modules"][our_mod]["packing"]
    for k in ("bits", "group_size", "symmetric", "has_offsets", "words_per_group"):
        assert pk[k] == t[k], k
    assert ours["modules"][our_mod]["bpw"] == pytest.approx(t["bits_per_weight"])  # bits + 2 x 16 / group
    for rec, nbytes in ((t, t["nbytes"]), (pk, ours["modules"][our_mod]["bytes"])):
        assert rec["num_groups"] == rec["in_features"] // rec["group_size"]
        assert nbytes == rec["num_rows"] * rec["num_groups"] * (4 * rec["words_per_group"] + 4)
    assert ours["quantization_config"]["group_size"] == seed002["quantization_config"]["group_size"]
    assert ours["quantization_config"]["symmetric"] == seed002["quantization_config"]["symmetric"]
    assert ours["tied"] == seed002["tied"]
    assert sorted(ours["expert_banks"]) == sorted(mapped[b] for b in seed002["expert_banks"])
    for acc in (seed002["accounting"], {"packed_nbytes": ours["accounting"]["packed_bytes"],
                                        "dense_nbytes": ours["accounting"]["unquantized_bytes"],
                                        "total_nbytes": ours["accounting"]["array_bytes"],
                                        "quantized_elements": ours["accounting"]["quantized_elements"],
                                        "average_bits": ours["accounting"]["average_bits_quantized"]}):
        assert acc["packed_nbytes"] + acc["dense_nbytes"] == acc["total_nbytes"]
        assert acc["average_bits"] == pytest.approx(8 * acc["packed_nbytes"] / acc["quantized_elements"], rel=1e-5)
    assert [f["name"] for f in ours["files"]] == seed002["files"]
    assert ours["provenance"]["widths_from"]["format"] == "dynquant"
    assert ours["provenance"]["allocator"].startswith("imported:dynquant")
    routers = [k for k in ours["modules"] if k.endswith("feed_forward.gate")]
    assert sorted(ours["quantization_config"]["modules_to_not_convert"]) == sorted(routers)


def test_exported_dynquant_and_kept16_forms_reimport_to_the_same_widths(converted002, lfm2_moe, tmp_path):
    out, _ = converted002
    manifest = json.loads((out / "mlx_dq.json").read_text())
    for form, mod in (("dynquant", dynquant), ("mlx-kept16", mlx_kept16)):
        path = tmp_path / f"{form}.json"
        res = run("export", out, "--to", form, "-o", path)
        assert res.exit_code == 0, res.output
        doc = json.loads(path.read_text())
        assert detect(doc) == mod.FORM
        modules, model_type = modules_for(str(lfm2_moe))
        plan = mod.to_plan(doc, modules, model_type, path=str(path))
        assert not plan.source["unmapped"]
        got = {e.key: e.option for e in plan.tensors}
        for k, r in manifest["modules"].items():
            assert got.get(k, "16bit") == r["option"], (form, k)
        shown = run("inspect", path)
        assert shown.exit_code == 0 and ("dynquant manifest" in shown.output or "kept 16-bit" in shown.output)
    # a plan exports too (widths from the plan; no files or byte counts to state)
    res = run("export", out / "plan.json", "--to", "dynquant", "-o", tmp_path / "plan-dq.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "plan-dq.json").read_text())
    plan = load_plan(out / "plan.json")
    assert {k: v["bits"] for k, v in doc["layers"].items()} == {
        e.key: QuantOption.parse(e.option).segments[0].bits for e in plan.tensors if e.option != "16bit"}
    res = CliRunner().invoke(main, ["export", str(out / "plan.json"), "--to", "dashq", "-o", str(tmp_path / "x")])
    assert res.exit_code != 0 and "needs a manifest" in res.output


def test_convert_applies_a_kept16_config(tiny_llama, tmp_path):
    """An MLX config with kept_16bit goes straight into convert --plan: defaults, own entries, kept names."""
    cfg = {"bits": 8, "group_size": 32, "mode": "affine",
           "kept_16bit": ["model.layers.0.mlp.down_proj.weight", "lm_head.weight"],
           "tensors": {"model.layers.1.self_attn.q_proj.weight": {"bits": 4, "group_size": 64, "shape": [128, 128]}},
           "scan": {"rule": "hand-written"}}
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    res = run("convert", "--model", tiny_llama, "--plan", tmp_path / "c.json", "-o", tmp_path / "out",
              "--method", "rtn", "--rows", 2, "--seq-len", 32)
    assert res.exit_code == 0, res.output
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert q["model.layers.1.self_attn.q_proj"] == {"group_size": 64, "bits": 4, "mode": "affine"}
    assert "model.layers.0.mlp.down_proj" not in q and "lm_head" not in q
    assert q["model.layers.0.self_attn.q_proj"] == {"group_size": 32, "bits": 8, "mode": "affine"}


# --------------------------------------------------------------------------- 003: kept-16-bit scan from the CLI
def test_seed003_kept_names_from_the_cli_alone(tmp_path):
    from test_optimize import _seed003_like

    cfg = json.loads(seed_path("003").read_text())
    m, expected, _ = _seed003_like(cfg)
    save_measurement(m, tmp_path / "m.json")
    res = run("optimize", tmp_path / "m.json", "--bpw", 6.0, "--head-option", "budget",
              "--part", "backbone=layers.*,embed_tokens", "--part", "depth=groups.*,heads.*,in_proj",
              "--keep-most-sensitive", "backbone=2", "--keep-most-sensitive", "depth=999", "--keep-outside-budget",
              "--mlx-config", tmp_path / "c.json", "-o", tmp_path / "p.json")
    assert res.exit_code == 0, res.output
    out = json.loads((tmp_path / "c.json").read_text())
    assert sorted(out["kept_16bit"]) == sorted(cfg["kept_16bit"]) and len(out["kept_16bit"]) == 210
    assert set(out["tensors"]) == set(cfg["tensors"]) and len(out["tensors"]) == 112
    assert out["scan"]["keep_backbone"] == cfg["scan"]["keep_backbone"]
    assert out["scan"]["keep_depth"] == cfg["scan"]["keep_depth"]
    plan = load_plan(tmp_path / "p.json")
    kept_numel = sum(m.tensors[k].numel for k in expected)
    assert plan.numel == m.numel() - kept_numel  # kept tensors are outside the budget
    assert plan.achieved_bpw <= 6.0 and plan.total_bpw > plan.achieved_bpw


def test_keep_ties_inside_a_joint_module_go_by_measured_damage():
    """Two members of one jointly measured module tie on the module's sensitivity; the one whose width moves
    the module's measured error more is kept, whatever the names' order."""
    m = Measurement()
    a, b = "model.layers.0.self_attn.a_proj", "model.layers.0.self_attn.b_proj"
    for k in (a, b):
        m.add_tensor(k, (64, 64)).group = "model.layers.0.self_attn"
    g = JointGroup("model.layers.0.self_attn", [a, b])
    lo, hi = QuantOption.uniform(4, 64), QuantOption.uniform(8, 64)
    errs = {(lo, lo): 0.05, (hi, lo): 0.049, (lo, hi): 0.01, (hi, hi): 0.005}  # b's width matters, a's hardly
    for (oa, ob), err in errs.items():
        recs = {a: OptionRecord(oa, oa.bpw((64, 64)), oa.storage_bits((64, 64)), None),
                b: OptionRecord(ob, ob.bpw((64, 64)), ob.storage_bits((64, 64)), None)}
        g.options.append(JointOption(recs, sum(r.total_bits for r in recs.values()), err))
    m.groups[g.key] = g
    plan = optimize(m, 12.0, head_option=None, keep_most_sensitive=1)
    assert plan.kept == [b]


def test_keep_rule_errors_are_one_line(tmp_path):
    from test_optimize import _seed003_like

    m, _, _ = _seed003_like(None)
    save_measurement(m, tmp_path / "m.json")
    for args, msg in ((["--part", "nonsense"], "NAME=PATTERN"),
                      (["--part", "a=layers.*", "--keep-most-sensitive", "b=1"], "no --part defines: b"),
                      (["--keep-most-sensitive", "x"], "N or PART=N")):
        res = CliRunner().invoke(main, ["optimize", str(tmp_path / "m.json"), "--bpw", "6", *args])
        assert res.exit_code != 0 and f"Error:" in res.output and msg in res.output, res.output
        assert "Traceback" not in res.output


# --------------------------------------------------------------------------- 004: dashq record
def test_seed004_round_trips_through_our_record_form():
    seed = json.loads(seed_path("004").read_text())
    rec = dashq.from_dashq(seed)
    assert dashq.to_dashq(rec) == seed
    assert rec["schema"] == dashq.RECORD_SCHEMA and not any(rec["extra"].values())  # every field has our name
    t = rec["technique"]
    assert (t["error_compensation"], t["optimal_shrinkage"], t["weighted_quantization"], t["moe_hessian_scope"]) == (
        seed["params"]["use_error_compensation"], seed["params"]["use_optimal_shrinkage"],
        seed["params"]["use_weighted_quantization"], seed["params"]["moe_hessian_scope"])
    assert rec["results"]["perplexity"] == seed["results"]["PPL"]
    tasks = rec["results"]["tasks"]
    assert len(tasks) == 11 and tasks["arc_easy"] == seed["results"]["arc_easy"]
    zero_shot = [v for k, v in tasks.items() if k not in ("gsm8k_cot", "mmlu")]  # the record's own average
    assert rec["results"]["zeroshot_average"] == pytest.approx(sum(zero_shot) / len(zero_shot))
    assert len(rec["modules"]) == len(seed["quantized_modules"])


def test_our_output_exports_as_a_dashq_record(converted002, tmp_path):
    out, _ = converted002
    manifest = json.loads((out / "mlx_dq.json").read_text())
    manifest["results"] = {"perplexity": 12.5, "model_size_bytes": 2_000_000, "tasks": {"arc_easy": 50.0}}
    (tmp_path / "mlx_dq.json").write_text(json.dumps(manifest))
    res = run("export", tmp_path / "mlx_dq.json", "--to", "dashq", "-o", tmp_path / "d.json")
    assert res.exit_code == 0, res.output
    doc = json.loads((tmp_path / "d.json").read_text())
    assert detect(doc) == "dashq" and doc["method"] == "mlx_dq"
    rec = dashq.from_dashq(doc)
    assert dashq.to_dashq(rec) == doc
    assert rec["technique"]["error_compensation"] is False  # converted with --method rtn
    assert doc["params"]["use_optimal_shrinkage"] is True and doc["results"]["PPL"] == 12.5
    assert doc["results"]["arc_easy"] == 50.0 and "zeroshot_avg" not in doc["results"]
    n_quant = sum(1 for r in manifest["modules"].values() if r["option"] != "16bit")
    assert len(doc["quantized_modules"]) == n_quant
    shown = run("inspect", seed_path("004"))
    assert shown.exit_code == 0 and "optimal_shrinkage=True" in shown.output and "arc_easy" in shown.output


# --------------------------------------------------------------------------- 000/001: EXL2 without a head
EXL2_MODELS = {
    "000": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256),
    "001": dict(hidden_size=4096, num_hidden_layers=48, intermediate_size=11008, num_attention_heads=32,
                num_key_value_heads=4, vocab_size=64000),
}


@pytest.mark.parametrize("prefix", ["000", "001"])
def test_exl2_plans_print_the_whole_models_bpw(prefix, tmp_path):
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "rms_norm_eps": 1e-5,
           "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
           **EXL2_MODELS[prefix]}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    seed = seed_path(prefix)
    res = run("optimize", seed, "--bpw", 4.0, "--model", tmp_path / "config.json", "--exl2-report",
              tmp_path / "r.csv", "-o", tmp_path / "p.json")
    assert res.exit_code == 0, res.output
    plan = load_plan(tmp_path / "p.json")
    head = {e.key: e for e in plan.tensors if e.scope == "head"}
    assert set(head) == {"model.embed_tokens", "lm_head"}
    assert all(e.option == "1.0:6b_64g" and e.shape == [cfg["vocab_size"], 4096] for e in head.values())
    whole = sum(e.bits for e in plan.tensors) / sum(e.numel for e in plan.tensors)
    printed = float(re.search(r"whole model ([0-9.]+) bpw", res.output).group(1))
    assert printed == pytest.approx(whole, abs=1e-4)
    decoder_only = plan.used_bits / plan.numel
    assert abs(printed - decoder_only) > 1e-3  # the head is really counted
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    assert len(rows) == sum(1 for e in plan.tensors if e.scope == "budget")
    for r in rows[:50]:
        e = plan.entry(r["tensor"])
        assert float(r["mlx_bpw"]) == pytest.approx(e.bits / e.numel, abs=1e-4)
        assert float(r["exl2_bpw"]) > 0 and r["exl2_option"]
    assert "EXL2 -> MLX mapping over" in res.output and "--exl2-map storage" in res.output
    # 16-bit head when it joins the budget but was never measured; without a model a clear "not counted"
    res16 = run("optimize", seed, "--bpw", 4.0, "--model", tmp_path / "config.json", "--head-option", "budget",
                "-o", tmp_path / "p16.json")
    assert "at 16bit" in res16.output and load_plan(tmp_path / "p16.json").entry("lm_head").option == "16bit"
    bare = run("optimize", seed, "--bpw", 4.0, "--exl2-map", "layout", "-o", tmp_path / "p0.json")
    assert "NOT counted" in bare.output and "--exl2-map layout" in bare.output


def test_convert_with_a_measurement_lacking_the_head_applies_head_option(tiny_llama, tmp_path):
    """A measurement without embedding/head (as ExLlamaV2's): --head-option applies to them, and it is said."""
    modules, _ = modules_for(str(tiny_llama))
    m = Measurement(source_format="exl2_v1")
    rng = np.random.default_rng(0)
    for k, shape in modules.items():
        if k.endswith(("embed_tokens", "lm_head")):
            continue
        t = m.add_tensor(k, shape)
        for bits in (3, 4, 8):
            t.add_option(QuantOption.uniform(bits, 64), float(rng.uniform(0.5, 1.0) * 2.0 ** -bits))
    save_measurement(m, tmp_path / "m.json")
    res = run("convert", "--model", tiny_llama, "--measurement", tmp_path / "m.json", "--bpw", 4.0,
              "--head-option", "1.0:8b_64g", "-o", tmp_path / "out", "--method", "rtn", "--rows", 2,
              "--seq-len", 32, "--keep", "model.layers.0.mlp.down_proj", "--keep-outside-budget")
    assert res.exit_code == 0, res.output
    q = json.loads((tmp_path / "out" / "config.json").read_text())["quantization"]
    assert q["model.embed_tokens"]["bits"] == 8 and q["lm_head"]["bits"] == 8
    assert "model.layers.0.mlp.down_proj" not in q  # kept 16-bit, and outside the 4.0 bpw budget:
    plan = load_plan(tmp_path / "out" / "plan.json")
    assert plan.numel == m.numel() - m.tensors["model.layers.0.mlp.down_proj"].numel and plan.achieved_bpw <= 4.0
    assert "not in the measurement" in res.output
    whole = float(re.search(r"whole model ([0-9.]+) bpw", res.output).group(1))
    manifest = json.loads((tmp_path / "out" / "mlx_dq.json").read_text())
    assert whole == pytest.approx(manifest["accounting"]["average_bits_all"], abs=1e-4)


def test_inspect_reads_every_seed_form():
    for prefix, word in (("002", "dynquant manifest"), ("003", "kept 16-bit"), ("004", "dashq record")):
        res = run("inspect", seed_path(prefix))
        assert res.exit_code == 0 and word in res.output, res.output
    res = run("inspect", seed_path("001"))
    assert res.exit_code == 0 and "not in this file" in res.output


def test_exl2_uniform_mapping_makes_stock_loadable_plans_from_seed001(tmp_path):
    """Seed 001's joint options are mixed below ~7.4 bpw; --exl2-map uniform maps each to one MLX width."""
    seed = seed_path("001")
    res = CliRunner().invoke(main, ["optimize", str(seed), "--bpw", "4.0", "--mlx-lm-compatible",
                                    "-o", str(tmp_path / "p.json")])
    assert res.exit_code != 0 and "Error:" in res.output
    res = run("optimize", seed, "--bpw", 4.0, "--mlx-lm-compatible", "--exl2-map", "uniform",
              "--exl2-report", tmp_path / "r.csv", "-o", tmp_path / "p.json")
    assert res.exit_code == 0, res.output
    plan = load_plan(tmp_path / "p.json")
    assert 3.98 <= plan.achieved_bpw <= 4.0
    assert all(not QuantOption.parse(e.option).is_mixed for e in plan.tensors)
    rows = list(csv.DictReader(open(tmp_path / "r.csv")))
    mixed_src = [r for r in rows if "/" in r["exl2_option"]]
    assert mixed_src  # mixed EXL2 options were chosen and stored as one width: the report says how far apart
    assert all(float(r["difference"]) == pytest.approx(float(r["mlx_bpw"]) - float(r["exl2_bpw"]), abs=2e-4)
               for r in rows)


@pytest.mark.parametrize("name", ["import-plan", "export"])
def test_new_commands_have_help(name):
    res = run(name, "--help")
    assert res.exit_code == 0 and res.output.startswith(f"Usage: mlx_dq {name}")


def test_bfloat16_source_stays_bfloat16(tmp_path):
    """--dtype auto on a bfloat16 source: scales, biases and 16-bit tensors in bfloat16, codes rounded against
    exactly those scales (without clip search: equal to mx.quantize of the bfloat16 weight)."""
    from fixtures_models import make_tiny_model_folder
    from mlx_lm import load

    src = make_tiny_model_folder(tmp_path, "llama", 2, dtype=mx.bfloat16, name="bf16")
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}))
    plan = {"model.layers.0.mlp.down_proj": "1.0:4b_64g", "model.layers.1.self_attn.q_proj": "1.0:3b_32g"}
    from mlx_dq.conversion.pipeline import convert

    convert(str(src), tmp_path / "out", plan=plan, method="rtn", clip=False, dtype="auto", rows=2, seq_len=32,
            progress=False)
    out = tmp_path / "out"
    arrays = mx.load(str(out / "model.safetensors"))
    src_w = mx.load(str(src / "model.safetensors"))
    for key, desc in plan.items():
        opt = QuantOption.parse(desc)
        seg = opt.segments[0]
        assert arrays[f"{key}.scales"].dtype == mx.bfloat16 and arrays[f"{key}.biases"].dtype == mx.bfloat16
        w, s, b = mx.quantize(src_w[f"{key}.weight"], group_size=seg.group_size, bits=seg.bits)
        assert s.dtype == mx.bfloat16
        assert mx.array_equal(arrays[f"{key}.weight"], w) and mx.array_equal(arrays[f"{key}.scales"], s)
    assert arrays["model.layers.0.self_attn.k_proj.weight"].dtype == mx.bfloat16
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    manifest = json.loads((out / "mlx_dq.json").read_text())
    assert manifest["modules"]["model.layers.0.mlp.down_proj"]["packing"]["scale_dtype"] == "bfloat16"
    model, _ = load(str(out))
    logits = model(mx.array([[1, 2, 3]]))
    assert np.isfinite(np.array(logits.astype(mx.float32))).all()
    with pytest.raises(ValueError, match="needs method rtn"):
        convert(str(src), tmp_path / "out2", plan=plan, method="gptq", dtype="bfloat16", rows=2, seq_len=32,
                progress=False)
    assert not (tmp_path / "out2").exists()


def test_wrong_forms_get_one_line_errors(tiny_llama, tmp_path):
    res = CliRunner().invoke(main, ["optimize", str(seed_path("002")), "--bpw", "3"])
    assert res.exit_code != 0 and "dynquant file, not a measurement" in res.output and "convert --plan" in res.output
    res = CliRunner().invoke(main, ["convert", "--model", str(tiny_llama), "--plan", str(seed_path("004")),
                                    "-o", str(tmp_path / "out")])
    assert res.exit_code != 0 and "Error:" in res.output and "not a plan" in res.output
    assert "Traceback" not in res.output and not (tmp_path / "out").exists()
    (tmp_path / "broken.json").write_text(json.dumps({"schema": "dynquant_checkpoint_v2", "layers": {"x": {}}}))
    res = CliRunner().invoke(main, ["convert", "--model", str(tiny_llama), "--plan", str(tmp_path / "broken.json"),
                                    "-o", str(tmp_path / "out")])
    assert res.exit_code != 0 and "no integer bits" in res.output
