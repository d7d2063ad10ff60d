"""Tests for the sensitivity measurer: exact Gram-based errors, streaming, resume, generic modules."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures_models import (
    make_tiny_model_folder,
    random_weights,
    save_tokenizer,
    tiny_tokenizer,
)
from mlx.utils import tree_unflatten

from mlx_dq.data import calib
from mlx_dq.evaluation.metrics import perplexity
from mlx_dq.measure.importance import robust_energy
from mlx_dq.measure.model_kl import measure_module
from mlx_dq.measure.stream import measure, strip_timing
from mlx_dq.measure.tensor import reference_option
from mlx_dq.model.sources import resolve
from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.spec import QuantizerSpec

GRID = {"default": ["1.0:2b_64g", "1.0:3b_64g", "0.5:4b_32g/0.5:3b_64g", "1.0:4b_32g", "1.0:4b_128g", "1.0:8b_64g"]}


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grid") / "grid.json"
    path.write_text(json.dumps({"description": "test grid", "roles": GRID}))
    return path


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("models")
    return {
        "llama": make_tiny_model_folder(tmp, "llama", num_layers=3),
        "qwen2": make_tiny_model_folder(tmp, "qwen2", num_layers=2),
        "qwen3_moe": make_tiny_model_folder(tmp, "qwen3_moe", num_layers=2),
    }


def _run(folder: Path, grid: Path, out: Path | None = None, **kw):
    kw.setdefault("rows", 4)
    kw.setdefault("seq_len", 48)
    kw.setdefault("batch_size", 2)
    kw.setdefault("clip", False)  # the clip search is tested with the quantizer; here it only costs time
    kw.setdefault("method", "rtn")  # errors checked against plain rounding below; gptq has its own tests
    return measure(str(folder), grid=str(grid), out_path=out, progress=False, **kw)


class _Recorder(nn.Module):
    """Wraps a layer and keeps every (input, extra args) it is called with."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.seen: list = []

    def __call__(self, x, *args, **kwargs):
        self.seen.append((x, args, kwargs))
        return self.inner(x, *args, **kwargs)


def _direct_errors(folder: Path, tokens: mx.array, paths: list[str], option: str) -> dict[str, float]:
    """Relative output errors from running the whole model and re-multiplying each layer's actual inputs.

    Expert banks are re-run with mx.gather_mm on the inputs and routing the model gave them.
    """
    model = resolve(str(folder)).model(mx.float32)
    recs = {}
    for p in paths:
        recs[p] = _Recorder(dict(model.named_modules())[p])
        model.update_modules(tree_unflatten([(p, recs[p])]))
    mx.eval(model(tokens))
    out = {}
    for p, rec in recs.items():
        w = rec.inner.weight
        wq = quantize_weight(w, QuantOption.parse(option), clip=False).dequantize(mx.float32)
        num = den = 0.0
        for x, args, kwargs in rec.seen:
            if args:  # expert bank called as (x, indices, sorted_indices=...)
                y = mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=args[0], **kwargs)
                yq = mx.gather_mm(x, wq.swapaxes(-1, -2), rhs_indices=args[0], **kwargs)
            else:
                y, yq = x @ w.T, x @ wq.T
            num += float(((yq - y) ** 2).sum().item())
            den += float((y**2).sum().item())
        out[p] = (num / den) ** 0.5
    return out


def _tokens(folder: Path, rows: int, seq_len: int, seed: int = 0) -> mx.array:
    src = resolve(str(folder))
    return calib.calibration_rows(src.tokenizer(), None, rows, seq_len, seed)[1]  # the rows measure draws


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3_moe"])
def test_gram_errors_match_direct_errors(folders, grid_file, family):
    folder = folders[family]
    m = _run(folder, grid_file)
    keys = [k for k in m.tensors if ".layers." in k or k == "lm_head"]
    assert len(keys) >= 7 * 2
    for desc in ("1.0:3b_64g", "1.0:2b_64g"):
        direct = _direct_errors(folder, _tokens(folder, 4, 48), keys, desc)
        for k in keys:
            assert m.tensors[k].find(desc).err == pytest.approx(direct[k], rel=1e-4), (k, desc)


def test_streamed_perplexity_equals_full_model(folders, grid_file):
    folder = folders["llama"]
    m = _run(folder, grid_file, importance="none")
    model = resolve(str(folder)).model(mx.float32)
    assert m.base_perplexity == pytest.approx(perplexity(model, _tokens(folder, 4, 48)), rel=1e-4)


def test_base_perplexity_is_the_importance_rows_and_the_head_gram_all_rows(folders, grid_file, monkeypatch):
    """Only the importance rows' logits are made (the base perplexity); every row still feeds the head's Gram."""
    from mlx_dq.measure import head as head_mod

    folder = folders["llama"]
    nll_rows, grams = [], {}
    real_nll = head_mod.chunked_nll_sum
    monkeypatch.setattr(head_mod, "chunked_nll_sum",
                        lambda model, tokens, *a, **k: nll_rows.append(int(tokens.shape[0])) or real_nll(model, tokens,
                                                                                                          *a, **k))
    m = _run(folder, grid_file, rows=6, importance_rows=2)
    assert m.extra["importance"]["rows"] == 2 and sum(nll_rows) == 2
    model = resolve(str(folder)).model(mx.float32)
    tokens = _tokens(folder, 6, 48)
    assert m.base_perplexity == pytest.approx(perplexity(model, tokens[:2]), rel=1e-4)
    assert m.base_perplexity != pytest.approx(perplexity(model, tokens), rel=1e-4)
    # the head's options were measured against the Gram of all six rows: the same errors as the all-logit path
    monkeypatch.setattr(head_mod, "record_head_inputs",
                        lambda model, tokens, hidden, flush, chunk: real_nll(model, tokens, hidden, chunk, flush=flush))
    again = _run(folder, grid_file, rows=6, importance_rows=2)
    head = [k for k in m.tensors if "lm_head" in k or "embed" in k]
    assert head
    for k in head:
        assert [o.err for o in m.tensors[k].options] == [o.err for o in again.tensors[k].options], k


def _tied_folder(tmp: Path, model_type: str, **extra) -> Path:
    """A tiny tied-embedding model of a family the shared fixtures do not build (qwen3, gemma3_text)."""
    tok = tiny_tokenizer()
    cfg = dict(model_type=model_type, hidden_size=128, num_hidden_layers=3, intermediate_size=256,
               num_attention_heads=4, head_dim=32, num_key_value_heads=2, vocab_size=320, rms_norm_eps=1e-6,
               rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, **extra)
    folder = tmp / model_type
    folder.mkdir()
    weights = random_weights(cfg)
    weights.pop("lm_head.weight", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    save_tokenizer(folder)
    return folder


@pytest.mark.parametrize("model_type,extra", [
    ("qwen3", {}),
    # sliding windows shorter than the rows, so the layers get explicit window masks; scaled embeddings
    ("gemma3_text", {"sliding_window": 16, "sliding_window_pattern": 2, "query_pre_attn_scalar": 32}),
])
def test_other_families_stream_like_the_full_model(tmp_path, grid_file, model_type, extra):
    folder = _tied_folder(tmp_path, model_type, **extra)
    m = _run(folder, grid_file, importance="none")
    assert len([k for k in m.tensors if ".layers." in k]) == 3 * 7
    assert "lm_head" not in m.tensors and m.tensors["model.embed_tokens"].extra.get("tied_head")
    model = resolve(str(folder)).model(mx.float32)
    assert m.base_perplexity == pytest.approx(perplexity(model, _tokens(folder, 4, 48)), rel=1e-4)


def test_records_have_bits_shapes_and_importance(folders, grid_file):
    m = _run(folders["qwen3_moe"], grid_file)
    bank = m.tensors["model.layers.0.mlp.switch_mlp.gate_proj"]
    assert bank.shape[0] == 4 and bank.extra["shares_input_with"] == ["model.layers.0.mlp.switch_mlp.up_proj"]
    for t in m.tensors.values():
        errs = {o.desc: o.err for o in t.options}
        assert errs["1.0:2b_64g"] > errs["1.0:3b_64g"] > errs["1.0:8b_64g"] > 0
        for o in t.options:
            assert o.total_bits == o.option.storage_bits(t.shape)
        assert t.importance > 0
    assert m.tensors["model.embed_tokens"].extra["err_kind"] == "lookup"
    assert "lm_head" in m.tensors


def test_options_that_do_not_fit_are_skipped(tmp_path, grid_file):
    folder = make_tiny_model_folder(tmp_path, "llama", num_layers=1, hidden=96, intermediate=192, heads=3, kv_heads=1)
    m = _run(folder, grid_file)
    q = m.tensors["model.layers.0.self_attn.q_proj"]  # in_features 96: only groups of 32 fit
    assert [o.desc for o in q.options] == ["1.0:4b_32g"]
    assert q.extra["importance_ref"] == "1.0:4b_32g"


def test_resume_after_interruption_equals_uninterrupted(folders, grid_file, tmp_path):
    folder = folders["llama"]
    full, part = tmp_path / "full.json", tmp_path / "part.json"
    _run(folder, grid_file, full)
    with pytest.raises(RuntimeError, match="after layer 0"):
        _run(folder, grid_file, part, _fail_after_layer=0)
    saved = json.loads(part.read_text())
    assert saved["last_module_idx"] == 0 and not saved["extra"]["complete"]
    assert Path(str(part) + ".state.safetensors").exists()
    _run(folder, grid_file, part)
    a, b = json.loads(full.read_text()), json.loads(part.read_text())
    assert strip_timing(a) == strip_timing(b)
    # layer 0 was not measured again: its timing is the interrupted run's
    assert b["extra"]["timing"]["layers_s"][0] == saved["extra"]["timing"]["layers_s"][0]
    assert b["extra"]["complete"] and not Path(str(part) + ".state.safetensors").exists()


def test_deterministic_and_seed_changes_rows(folders, grid_file, tmp_path):
    folder = folders["qwen2"]
    runs = []
    for i, seed in enumerate((3, 3, 4)):
        _run(folder, grid_file, tmp_path / f"{i}.json", seed=seed, clip=True, importance="none")
        runs.append(json.loads((tmp_path / f"{i}.json").read_text()))
    assert strip_timing(runs[0]) == strip_timing(runs[1])
    opt = runs[0]["measurement"][0]["options"][0]
    assert set(opt["clip"]) == {"clipped_fraction", "clip_improvement"} and opt["clip"]["clip_improvement"] >= 0
    assert runs[0]["calibration"]["tokens_digest"] != runs[2]["calibration"]["tokens_digest"]


def test_resume_refuses_other_settings(folders, grid_file, tmp_path):
    out = tmp_path / "m.json"
    _run(folders["llama"], grid_file, out, rows=2)
    with pytest.raises(ValueError, match="different settings"):
        _run(folders["llama"], grid_file, out, rows=3)
    _run(folders["llama"], grid_file, out, rows=3, resume=False)
    assert json.loads(out.read_text())["calibration"]["rows"] == 3


def test_bad_arguments(folders, grid_file):
    with pytest.raises(ValueError, match="importance"):
        _run(folders["llama"], grid_file, importance="bogus")
    with pytest.raises(ValueError, match="rows"):
        _run(folders["llama"], grid_file, rows=0)


class _Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.f1 = nn.Linear(d, 2 * d)
        self.f2 = nn.Linear(2 * d, d)

    def __call__(self, x):
        return x + self.f2(nn.gelu(self.f1(x)))


class _Net(nn.Module):
    """A small non-LLM model with parts named groups.N.M.f1 / heads.0."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.groups = [[_Block(d), _Block(d)], [_Block(d)]]
        self.heads = [nn.Linear(d, 32)]

    def __call__(self, x):
        for g in self.groups:
            for b in g:
                x = b(x)
        return self.heads[0](x)


def test_measure_module_generic(grid_file):
    mx.random.seed(1)
    net = _Net()
    mx.eval(net.parameters())
    inputs = [mx.random.normal((16, 64)) for _ in range(3)]
    m = measure_module(net, inputs, grid=str(grid_file))
    assert sorted(m.tensors) == sorted(
        ["groups.0.0.f1", "groups.0.0.f2", "groups.0.1.f1", "groups.0.1.f2", "groups.1.0.f1", "groups.1.0.f2",
         "heads.0"]
    )
    # direct error of groups.0.1.f2 from its actual inputs
    blk = net.groups[0][1]
    x = net.groups[0][0](mx.concatenate(inputs))
    xin = nn.gelu(blk.f1(x))
    w = blk.f2.weight
    rec = m.tensors["groups.0.1.f2"]
    for o in rec.options:
        wq = quantize_weight(w, o.option, gram=xin.T @ xin).dequantize(mx.float32)
        direct = float(mx.linalg.norm(xin @ (wq - w).T) / mx.linalg.norm(xin @ w.T))
        assert o.err == pytest.approx(direct, rel=1e-3)
    assert all(t.importance > 0 for t in m.tensors.values())


def test_measure_module_needs_inputs_and_linears(grid_file):
    with pytest.raises(ValueError, match="input batch"):
        measure_module(_Net(), [], grid=str(grid_file))
    with pytest.raises(ValueError, match="no nn.Linear"):
        measure_module(nn.ReLU(), [mx.zeros((2, 2))], grid=str(grid_file))


@pytest.mark.slow
def test_bundled_model_gram_errors_match_direct(tmp_path):
    from mlx_dq.model.sources import DEFAULT_MODEL

    grid = tmp_path / "grid.json"
    grid.write_text(json.dumps({"description": "one option", "roles": {"default": ["0.5:4b_32g/0.5:3b_64g"]}}))
    src = resolve(DEFAULT_MODEL)
    m = measure(DEFAULT_MODEL, rows=2, seq_len=64, grid=str(grid), clip=False, importance="none", method="rtn",
                progress=False, sample_rows=0)  # every output row: compared with the whole tensor's error
    keys = [f"model.layers.{i}.{p}" for i in (0, src.num_layers - 1)
            for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj")]
    model = src.model(mx.float32)
    tokens = calib.calibration_rows(src.tokenizer(), None, 2, 64, 0)[1]
    recs = {}
    for p in keys:
        recs[p] = _Recorder(dict(model.named_modules())[p])
        model.update_modules(tree_unflatten([(p, recs[p])]))
    mx.eval(model(tokens))
    for p, rec in recs.items():
        x = mx.concatenate([s[0].reshape(-1, s[0].shape[-1]) for s in rec.seen])
        w = rec.inner.weight
        for desc in ("0.5:4b_32g/0.5:3b_64g",):  # act-order from x's energy
            wq = quantize_weight(w, QuantOption.parse(desc), gram=x.T @ x, clip=False).dequantize(mx.float32)
            direct = float(mx.linalg.norm(x @ wq.T - x @ w.T) / mx.linalg.norm(x @ w.T))
            assert m.tensors[p].find(desc).err == pytest.approx(direct, rel=1e-4), (p, desc)
    assert m.base_perplexity == pytest.approx(perplexity(model, tokens), rel=1e-4)


def test_robust_energy_ignores_a_massive_channel():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((2, 64, 128)).astype(np.float32)
    spiked = h.copy()
    spiked[..., 5] *= 300.0  # one "massive activation" channel
    base = robust_energy(mx.array(h))
    assert robust_energy(mx.array(spiked)) == pytest.approx(base, rel=0.05)
    assert float((mx.array(spiked) ** 2).sum()) > 50 * base
    assert base == pytest.approx(float((h**2).sum()), rel=0.1)


def test_reference_option_falls_back_to_nearest_fitting():
    opts = [QuantOption.parse(d) for d in ("1.0:2b_32g", "1.0:4b_32g", "1.0:3b_64g")]
    assert reference_option(opts, 128).desc == "1.0:3b_64g"
    assert reference_option(opts, 96).desc == "1.0:2b_32g"  # 3b_64g (3.5 bpw) does not fit; 2b_32g is 3.0, 4b_32g 5.0
    assert reference_option(opts[2:], 96).keep16


def test_kl_importance_mode(folders, grid_file):
    m = _run(folders["llama"], grid_file, importance="kl", importance_rows=2)
    for key in ("model.layers.1.mlp.down_proj", "lm_head", "model.embed_tokens"):
        t = m.tensors[key]
        det = t.extra["importance_detail"]
        assert det["kl"] > 0 and t.importance == pytest.approx(det["kl"] / det["err"] ** 2)
    assert m.extra["importance"]["method"] == "kl"


def test_gptq_measurement_gives_the_converters_errors(folders, grid_file):
    """method="gptq" records the error of the converter's own quantizer, lower than rounding."""
    from mlx_dq.quant.dispatch import quantize_tensor

    folder = folders["llama"]
    rtn = _run(folder, grid_file, kl_scale=False)
    gq = _run(folder, grid_file, method="gptq", clip=True, kl_scale=False)
    assert gq.extra["method"] == "gptq" and gq.extra["clip"] is True
    lower = total = 0
    for k, t in gq.tensors.items():
        if ".layers." not in k:
            continue
        for o in t.options:
            r = rtn.tensors[k].find(o.option)
            total += 1
            lower += o.err < r.err
    assert lower >= 0.9 * total, (lower, total)
    # one tensor checked against quantize_tensor on directly captured inputs
    src = resolve(str(folder))
    model = src.model(mx.float32)
    key = "model.layers.1.mlp.down_proj"
    rec = _Recorder(dict(model.named_modules())[key])
    model.update_modules(tree_unflatten([(key, rec)]))
    mx.eval(model(_tokens(folder, 4, 48)))
    x = mx.concatenate([s[0].reshape(-1, s[0].shape[-1]) for s in rec.seen])
    w = rec.inner.weight
    wq = quantize_tensor(w, QuantOption.parse("1.0:3b_64g"), x.T @ x).dequantize(mx.float32)
    direct = float(mx.linalg.norm(x @ wq.T - x @ w.T) / mx.linalg.norm(x @ w.T))
    assert gq.tensors[key].find("1.0:3b_64g").err == pytest.approx(direct, rel=1e-3)


def test_kl_scale_matches_whole_model_kl(folders, grid_file):
    """The carried perturbations give the same KL as quantizing a layer's tensors in the whole model."""
    from mlx_dq.names import role_of

    folder = folders["llama"]
    m = _run(folder, grid_file, importance_rows=2)
    info = m.extra["importance"]["kl_scale"]
    assert [s["layer"] for s in info["samples"]] == [0, 1, 2]
    pred = sum(s["predicted"] for s in info["samples"])
    assert info["scale"] == pytest.approx(sum(s["kl"] for s in info["samples"]) / pred)
    for sample in info["samples"]:  # every sampled layer is priced by its own KL per predicted damage
        recs = [t for k, t in m.tensors.items() if k.startswith(f"model.layers.{sample['layer']}.")]
        assert recs
        for t in recs:
            d = t.extra["importance_detail"]
            raw = d["damage"] / d["err"] ** 2
            assert t.importance == pytest.approx(raw * sample["kl"] / sample["predicted"], rel=1e-6)
    src = resolve(str(folder))
    model = src.model(mx.float32)
    tokens = _tokens(folder, 4, 48)[:2]
    ref = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    for sample in info["samples"]:
        i = sample["layer"]
        mods = {p: mod for p, mod in dict(model.named_modules()).items()
                if p.startswith(f"model.layers.{i}.") and isinstance(mod, nn.Linear) and role_of(p)}
        saved = {}
        for p, mod in mods.items():
            desc = m.tensors[p].extra["importance_ref"]
            saved[p] = mod.weight
            mod.weight = quantize_weight(mod.weight, QuantOption.parse(desc), clip=False).dequantize(mx.float32)
        logp = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
        kl = float((mx.exp(ref) * (ref - logp)).sum(-1).mean())
        for p, w in saved.items():
            mods[p].weight = w
        assert sample["kl"] == pytest.approx(kl, rel=0.02, abs=1e-7), i
    # importance is now in KL units, and the head's options carry their own end-to-end damage
    head = m.tensors["lm_head"]
    assert all(o.damage is not None and o.damage >= 0 for o in head.options)
    by_bits = sorted(head.options, key=lambda o: o.bpw)
    assert by_bits[0].damage > by_bits[-1].damage
    assert all(o.damage is None for k, t in m.tensors.items() if k != "lm_head" for o in t.options)


def test_lookup_side_priced_by_its_own_kl_end_to_end(folders, grid_file):
    """A lookup table's KL per squared lookup error comes from the lookup alone quantized in the whole model."""
    from mlx_dq.measure.meter import lookup_error

    folder = folders["llama"]  # untied: the embedding is only a lookup table
    m = _run(folder, grid_file, importance_rows=2)
    info = m.extra["importance"]["kl_scale"]["lookups"]["model.embed_tokens"]
    emb = m.tensors["model.embed_tokens"]
    assert emb.importance == pytest.approx(info["kl"] / info["err"] ** 2, rel=1e-9)
    model = resolve(str(folder)).model(mx.float32)
    tokens = _tokens(folder, 4, 48)[:2]
    ref = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    w = model.model.embed_tokens.weight
    wq = quantize_weight(w, QuantOption.parse(info["option"]), clip=False).dequantize(mx.float32)
    counts = np.bincount(np.asarray(tokens).ravel(), minlength=w.shape[0])
    assert info["err"] == pytest.approx(lookup_error(w, wq, counts), rel=1e-5)
    model.model.embed_tokens.weight = wq
    logp = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    kl = float((mx.exp(ref) * (ref - logp)).sum(-1).mean())
    assert kl > 0 and info["kl"] == pytest.approx(kl, rel=0.02)


def test_depth_kl_scales_interpolate_between_samples():
    """Layers between sampled ones get the log-linear mean of their ratios, layers beyond get the nearest's."""
    from mlx_dq.measure.importance import depth_kl_scales

    samples = [{"layer": 1, "kl": 0.2, "predicted": 0.1}, {"layer": 5, "kl": 0.8, "predicted": 0.1},
               {"layer": 3, "kl": 0.0, "predicted": 0.1}]  # no KL: left out
    got = depth_kl_scales(samples, range(7), default=9.0)
    assert got[0] == pytest.approx(2.0) and got[1] == pytest.approx(2.0)
    assert got[3] == pytest.approx(4.0)  # geometric mean of 2 and 8
    assert got[5] == pytest.approx(8.0) and got[6] == pytest.approx(8.0)
    assert depth_kl_scales(samples[2:], range(3), default=9.0) == {0: 9.0, 1: 9.0, 2: 9.0}


def test_tied_head_damage_counts_both_sides(tmp_path, grid_file):
    """A tied embedding/head is priced by its head KL plus the lookup side, close to the whole-model KL."""
    folder = make_tiny_model_folder(tmp_path, "llama", num_layers=2, tie=True)
    m = _run(folder, grid_file, importance_rows=2)
    emb = m.tensors["model.embed_tokens"]
    assert emb.extra.get("tied_head") and "lookup" in emb.extra["damage"]
    src = resolve(str(folder))
    model = src.model(mx.float32)
    tokens = _tokens(folder, 4, 48)[:2]
    ref = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    w = model.model.embed_tokens.weight
    for desc in ("1.0:2b_64g", "1.0:4b_32g"):
        o = emb.find(desc)
        model.model.embed_tokens.weight = quantize_weight(w, o.option, clip=False).dequantize(mx.float32)
        logp = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
        kl = float((mx.exp(ref) * (ref - logp)).sum(-1).mean())
        model.model.embed_tokens.weight = w
        assert 0.5 * kl < o.damage < 2.0 * kl, (desc, o.damage, kl)


def test_head_options_predicted_from_anchors_on_a_row_sample(tmp_path, grid_file):
    """With a row sample, the head's anchors keep their end-to-end KL and the others are predicted close to it."""
    from mlx_dq.measure.head import head_anchors

    folder = make_tiny_model_folder(tmp_path, "llama", num_layers=2, tie=True)
    exact = _run(folder, grid_file, importance_rows=2, sample_rows=0)
    fast = _run(folder, grid_file, importance_rows=2, sample_rows=8)
    e, f = exact.tensors["model.embed_tokens"], fast.tensors["model.embed_tokens"]
    anchors = head_anchors([o.option for o in e.options], int(e.shape[-1]))
    assert f.extra["head_anchors"] == [o.desc for o in anchors] and len(anchors) == 2
    assert [o.desc for o in f.options] == [o.desc for o in e.options]  # every option, in the grid's order
    assert len(f.extra["lookup_damage"]) == len(f.options)
    assert f.extra["sampled_rows"] < e.shape[0]
    for a in anchors:  # measured end to end, exactly as without the sample
        assert f.find(a).damage == pytest.approx(e.find(a).damage, rel=1e-5)
    predicted = [o for o in e.options if o.option not in anchors]
    assert predicted
    for o in predicted:
        got = f.find(o.option).damage
        assert 0.6 * o.damage < got < 1.6 * o.damage, (o.desc, got, o.damage)
    by_bits = sorted(f.options, key=lambda o: o.bpw)
    assert by_bits[0].damage > by_bits[-1].damage


@pytest.mark.parametrize("block_rows", [0, 70])
def test_reference_weights_wait_at_their_stored_size(block_rows, monkeypatch):
    """The importance pass's reference waits as its codes, scales and biases (a 3-bit g64 weight: under a quarter of
    float16's bytes), whole rows joined when measured in blocks, and dequantizes to the weight quantized in one piece."""
    from mlx_dq.measure.tensor import measure_tensor
    from mlx_dq.model.capture import InputStats
    from mlx_dq.quant import dispatch as quantize_mod

    rng = np.random.default_rng(3)
    w = mx.array(rng.standard_normal((300, 128)).astype("float32"))
    x = rng.standard_normal((256, 128)).astype("float32")
    gram = mx.array(x.T @ x)
    ref = QuantOption.parse("1.0:3b_64g")
    whole = quantize_weight(w, ref, gram=gram).dequantize(mx.float32)
    if block_rows:
        monkeypatch.setattr(quantize_mod, "ROW_BLOCK_BYTES", 4 * 128 * block_rows)
    kept = {ref.desc: None}
    measure_tensor("t", w, [ref, QuantOption.parse("1.0:4b_64g")], InputStats(gram=gram, rows=256), "default",
                   spec=QuantizerSpec(method="rtn", clip=True), kept=kept)
    qt = kept[ref.desc]
    assert qt.out_sq is None and not qt.stats and qt.shape == (300, 128)
    assert qt.nbytes() < 0.25 * w.size * 2
    assert mx.array_equal(qt.dequantize(mx.float32), whole).item()


def test_collector_release_drops_the_grams():
    from mlx_dq.model.capture import GramCollector

    lin = nn.Linear(16, 8)
    with GramCollector({"lin": lin}) as col:
        lin(mx.random.normal((4, 16)))
        col.flush()
    assert col.stats["lin"].gram is not None
    col.release()
    assert col.stats["lin"].gram is None and col.stats["lin"].rows == 4


def test_lookup_table_measured_on_its_looked_up_rows_only():
    """An untied embedding's options are metered on the rows the tokens use: the same lookup errors as on every row."""
    from mlx_dq.measure.tensor import measure_tensor
    from mlx_dq.model.capture import InputStats

    w = mx.random.normal((300, 64), key=mx.random.key(1))
    counts = np.zeros(300)
    counts[[3, 7, 7, 250, 299]] = [2, 5, 1, 1, 3]
    lookup = InputStats(group=("emb",), rows=12, token_counts=counts)
    opts = [QuantOption.parse(d) for d in ("1.0:2b_32g", "1.0:4b_64g", "0.5:4b_32g/0.5:3b_32g")]
    rec = measure_tensor("emb", w, opts, None, "embedding", spec=QuantizerSpec(method="rtn", clip=True), lookup=lookup)
    assert rec.extra["sampled_rows"] == 4
    for o, r in zip(opts, rec.options):
        wq = quantize_weight(w, o, clip=True).dequantize(mx.float32)
        c = mx.array(counts.astype(np.float32))[:, None]
        want = float(mx.sqrt((c * (wq - w) ** 2).sum() / (c * w * w).sum()).item())
        assert abs(r.err - want) <= 1e-5 * want, (o.desc, r.err, want)


def test_input_error_equals_the_gram_form():
    """The importance pass takes a linear layer's error from its inputs, with the Gram form's value."""
    from mlx_dq.measure.importance import input_error
    from mlx_dq.quant.affine import output_error

    x = mx.random.normal((96, 64), key=mx.random.key(2)) * mx.linspace(0.1, 3.0, 64)
    w = mx.random.normal((48, 64), key=mx.random.key(3))
    wq = quantize_weight(w, QuantOption.parse("1.0:3b_32g")).dequantize(mx.float32)
    got, want = input_error(w, wq, x), output_error(w, wq, x.T @ x)
    assert got > 0.01 and abs(got - want) <= 1e-5 * want
