"""Cost at scale: the head runs in chunks of positions, with the same results as in one piece."""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures_models import random_weights, save_tokenizer, tiny_config
from mlx.utils import tree_flatten, tree_map

from mlx_dq.measure import head as head_mod
from mlx_dq.measure import head_kl as head_kl_mod
from mlx_dq.measure import meter as meter_mod
from mlx_dq.measure import stream as measure_mod
from mlx_dq.measure import tensor as tensor_mod
from mlx_dq.measure.stream import measure

GRID = {"default": ["1.0:2b_64g", "1.0:3b_64g", "1.0:4b_64g", "1.0:8b_64g"]}
BIG_VOCAB = 2048  # > the tokenizer's 320: rows only use the first ids, the head still has every row


def _big_vocab_folder(tmp: Path, model_type: str, tie: bool) -> Path:
    """A 1-layer model whose head has BIG_VOCAB rows (the tokenizer keeps its small vocabulary)."""
    cfg = tiny_config(model_type, 1, tie=tie)
    cfg["vocab_size"] = BIG_VOCAB
    folder = tmp / f"{model_type}-bigvocab-{'tied' if tie else 'untied'}"
    folder.mkdir(parents=True)
    weights = random_weights(cfg, seed=3)
    if tie:
        weights.pop("lm_head.weight", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def grid_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("grid") / "grid.json"
    path.write_text(json.dumps({"description": "test grid", "roles": GRID}))
    return path


@pytest.fixture(scope="module")
def big_vocab(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("bigvocab")
    return {"untied": _big_vocab_folder(tmp, "llama", tie=False), "tied": _big_vocab_folder(tmp, "qwen2", tie=True)}


def _spy_head(monkeypatch) -> list[int]:
    """Record the number of positions of every head call (and still run it)."""
    seen: list[int] = []
    orig = head_kl_mod.head_logits

    def spy(model, tokens, hidden):
        seen.append(int(tokens.shape[0]) * int(tokens.shape[1]))
        return orig(model, tokens, hidden)

    monkeypatch.setattr(head_kl_mod, "head_logits", spy)
    return seen


def _run(folder: Path, grid_file: Path, **kw):
    return measure(str(folder), grid=str(grid_file), rows=3, seq_len=48, batch_size=2, importance_rows=2,
                   method="rtn", progress=False, **kw)


def _assert_same(a, b, rel: float = 1e-4) -> None:
    assert a.base_perplexity == pytest.approx(b.base_perplexity, rel=rel)
    assert a.extra["importance"]["kl_scale"]["scale"] == pytest.approx(b.extra["importance"]["kl_scale"]["scale"],
                                                                       rel=rel)
    assert set(a.tensors) == set(b.tensors)
    for key, ta in a.tensors.items():
        tb = b.tensors[key]
        # a head's importance is its reference option's damage / err**2: it carries the damage's tolerance below
        end_to_end = any(o.damage is not None for o in ta.options)
        assert ta.importance == pytest.approx(tb.importance, rel=1e-3 if end_to_end else rel, abs=1e-9), key
        for oa, ob in zip(ta.options, tb.options):
            assert oa.option.desc == ob.option.desc
            assert oa.err == pytest.approx(ob.err, rel=rel, abs=1e-9), (key, oa.option.desc)
            if oa.damage is None:
                assert ob.damage is None
            else:
                # abs: the one-piece KL's float32 log-softmax is off by about 1e-7 nats per position (checked
                # against float64: the block-by-block sums are the closer of the two)
                assert oa.damage == pytest.approx(ob.damage, rel=1e-3, abs=3e-7), (key, oa.option.desc)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_chunked_head_equals_one_piece(big_vocab, grid_file, monkeypatch, kind):
    """Head chunks of 7 positions with a tiny reference cache give the one-piece head's numbers."""
    whole = _run(big_vocab[kind], grid_file, head_chunk=48)
    seen = _spy_head(monkeypatch)
    monkeypatch.setattr(head_kl_mod, "REF_CACHE_BYTES", 3 * 7 * BIG_VOCAB * 4)  # 3 of the 14 chunks kept
    made = []
    orig_init = head_kl_mod.HeadKL.__init__

    def init(self, *a, **k):
        k["cache_bytes"] = head_kl_mod.REF_CACHE_BYTES
        orig_init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(head_kl_mod.HeadKL, "__init__", init)
    chunked = _run(big_vocab[kind], grid_file, head_chunk=7)
    assert seen and max(seen) <= 7  # no head call ever saw more than 7 positions
    assert made and made[0].recomputed > 0 and made[0].cached_bytes <= head_kl_mod.REF_CACHE_BYTES
    assert made[0].cached_bytes > 0
    head = "lm_head" if kind == "untied" else "model.embed_tokens"
    assert all(o.damage is not None for o in chunked.tensors[head].options)
    _assert_same(chunked, whole)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_head_in_row_blocks_equals_one_piece(big_vocab, grid_file, monkeypatch, kind):
    """Embedding and head options quantized and metered in blocks of rows give the one-piece measurement."""
    from mlx_dq.quant import dispatch as quantize_mod

    whole = _run(big_vocab[kind], grid_file)
    blocks_seen = []
    orig = quantize_mod.row_blocks

    def spy(shape, budget=None):
        out = orig(shape, budget)
        blocks_seen.append(0 if out is None else len(out))
        return out

    added, assembled = [], []
    orig_add, orig_blocks = head_kl_mod.HeadBlockKL.add, tensor_mod._measure_in_blocks

    def add(self, i, sl, wq):
        added.append(int(wq.shape[0]))
        return orig_add(self, i, sl, wq)

    def in_blocks(*a, **k):
        wq = orig_blocks(*a, **k)
        if len(a) > 6 and a[6] is not None:  # the head (damage, after w, opt, gram, meter, spec, factors)
            assembled.append(wq[0] is not None)
        return wq

    monkeypatch.setattr(quantize_mod, "ROW_BLOCK_BYTES", 4 * 128 * 150)  # 150 rows of 128 channels a block
    monkeypatch.setattr(meter_mod, "row_blocks", spy)
    monkeypatch.setattr(head_kl_mod, "row_blocks", spy)
    monkeypatch.setattr(head_kl_mod.HeadBlockKL, "add", add)
    monkeypatch.setattr(tensor_mod, "_measure_in_blocks", in_blocks)
    blocked = _run(big_vocab[kind], grid_file)
    assert max(blocks_seen) >= 6  # the 2048-row embedding/head went in blocks
    assert added and max(added) <= 150 and sum(added) % BIG_VOCAB == 0  # its KL taken block by block
    assert assembled and not any(assembled)  # and no dequantized copy of the whole head built
    _assert_same(blocked, whole, rel=3e-5)  # float32 sums in another order: 1.1e-5 apart on some rows
    head = "lm_head" if kind == "untied" else "model.embed_tokens"
    for key in {head, "model.embed_tokens"}:
        for oa, ob in zip(blocked.tensors[key].options, whole.tensors[key].options):
            assert (oa.clip or {}) == pytest.approx(ob.clip or {}, rel=1e-5, abs=1e-9)


def _head_model(tmp_path: Path, model_type: str):
    """A one-layer model with a 700-token vocabulary (tied for Gemma, whose logits are soft-capped), tokens, final
    hidden states and the module that makes the logits."""
    from mlx_dq.model.sources import resolve

    cfg = tiny_config(model_type, 1, tie=model_type != "llama")
    cfg["vocab_size"] = 700
    cfg["sliding_window_pattern"] = 1  # one layer
    folder = tmp_path / model_type
    folder.mkdir()
    weights = random_weights(cfg, seed=5)
    if cfg["tie_word_embeddings"]:
        weights.pop("lm_head.weight", None)
    (folder / "config.json").write_text(json.dumps(cfg))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    model = resolve(str(folder)).model(mx.float32)
    rng = __import__("numpy").random.default_rng(1)
    tokens = mx.array(rng.integers(0, 700, size=(2, 30)).astype("int32"))
    hidden = mx.array(rng.standard_normal((2, 30, cfg["hidden_size"])).astype("float32"))
    return model, tokens, hidden, model.lm_head if not cfg["tie_word_embeddings"] else model.model.embed_tokens


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_head_block_kl_equals_the_swapped_head(tmp_path, model_type):
    """The head's KL summed over blocks of vocabulary rows equals the KL of the whole quantized head swapped in."""
    from mlx_dq.quant.affine import quantize_weight
    from mlx_dq.quant.options import QuantOption

    model, tokens, hidden, mod = _head_model(tmp_path, model_type)
    head = head_kl_mod.HeadKL(model, tokens, hidden, chunk=8, cache_bytes=0)
    w = mod.weight
    wq = quantize_weight(w, QuantOption.parse("1.0:2b_64g"), clip=False).dequantize(mx.float32)
    direct = head.damage_fn(mod)(wq)
    acc = head.damage_fn(mod).blocks()
    for i, sl in enumerate((slice(0, 250), slice(250, 251), slice(251, 700))):
        acc.add(i, sl, wq[sl])
    assert direct > 0.01
    assert acc.value() == pytest.approx(direct, rel=1e-4)
    assert mx.array_equal(mod.weight, w)  # the original weight is back


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text"])
def test_carried_copies_kl_in_one_pass_equals_each_through_the_head(tmp_path, monkeypatch, model_type):
    """kl_many: the KL of several final hidden states in one pass over blocks of vocabulary rows equals each one's
    KL through the whole head, its reference log-normaliser is the logits' logsumexp, no product has more than
    ``chunk x vocabulary`` logits, and the head's weight is back after it."""
    from mlx_dq.quant import dispatch as quantize_mod

    model, tokens, hidden, mod = _head_model(tmp_path, model_type)
    w = mod.weight
    rng = np.random.default_rng(2)
    hs = [hidden + eps * mx.array(rng.standard_normal(hidden.shape).astype("float32")) for eps in (0.05, 0.1, 0.5)]
    head = head_kl_mod.HeadKL(model, tokens, hidden, chunk=8, cache_bytes=0)
    direct = [head.kl(h) for h in hs]
    monkeypatch.setattr(quantize_mod, "ROW_BLOCK_BYTES", 4 * int(w.shape[1]) * 300)  # blocks of 300, 300, 100 rows
    sizes = []
    orig = head_kl_mod.head_logits

    def spy(m, t, h):
        out = orig(m, t, h)
        sizes.append(int(out.size))
        return out

    monkeypatch.setattr(head_kl_mod, "head_logits", spy)
    blocked = head_kl_mod.HeadKL(model, tokens, hidden, chunk=8, cache_bytes=0)
    many = blocked.kl_many(mod, hs)
    assert len(blocked.blocks(mod)) == 3
    assert min(direct) > 1e-4
    assert many == pytest.approx(direct, rel=1e-3, abs=2e-7)  # the whole-head path: float32 log-softmax
    assert sizes and max(sizes) <= 8 * 700 and len(sizes) > 3 * 4  # spans of 18 positions per block of 300 rows
    m, s = blocked.ref_norm(mod)
    lse = mx.logsumexp(orig(model, tokens, hidden), -1).reshape(-1)
    assert mx.allclose(m + mx.log(s), lse, rtol=1e-6, atol=1e-5)
    assert blocked.kl_many(mod, []) == [] and mod.weight is w


def test_position_shares_of_the_carried_kl_join_to_one_pass(tmp_path):
    """position_sums over consecutive shares of the positions (as ranks take them), joined in order, give
    bit for bit kl_many's KLs and reference log-normaliser; a share of the positions is only that share."""
    model, tokens, hidden, mod = _head_model(tmp_path, "llama")
    rng = np.random.default_rng(3)
    hs = [hidden + eps * mx.array(rng.standard_normal(hidden.shape).astype("float32")) for eps in (0.05, 0.3)]
    one = head_kl_mod.HeadKL(model, tokens, hidden, chunk=8, cache_bytes=0)
    want, norm = one.kl_many(mod, hs), one.ref_norm(mod)
    n = one.positions
    for cuts in ([0, n // 2, n], [0, 5, n // 3, n]):
        head = head_kl_mod.HeadKL(model, tokens, hidden, chunk=8, cache_bytes=0)
        parts = [head.position_sums(mod, hs, slice(a, b)) for a, b in zip(cuts, cuts[1:])]
        assert [int(p["m"].shape[0]) for p in parts] == [b - a for a, b in zip(cuts, cuts[1:])]
        assert parts[0]["d"].shape == (2, cuts[1])
        assert head.kls_from_sums(head.join_sums(parts)) == want
        assert all(mx.array_equal(a, b).item() for a, b in zip(head.ref_norm(mod), norm))
    half = head.position_sums(mod, hs, slice(0, n // 2))
    assert head.kls_from_sums(head.join_sums([half, half])) != want  # the shares matter


def test_chunked_tensor_kl_equals_direct(big_vocab):
    """``tensor_kl`` with small head chunks equals the KL computed from whole-model logits."""
    import mlx.nn as nn

    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import resolve
    from mlx_dq.quant.affine import quantize_weight
    from mlx_dq.quant.options import QuantOption

    source = resolve(str(big_vocab["tied"]))
    model = source.model(mx.float32)
    tokens = mx.array(__import__("numpy").random.default_rng(0).integers(0, 320, size=(2, 40)).astype("int32"))
    mods = {p: m for p, m in quantizable_modules(model).items() if p in ("model.embed_tokens", "model.layers.0.mlp.up_proj")}
    opts = {p: QuantOption.parse("1.0:2b_64g") for p in mods}
    from mlx_dq.measure.model_kl import tensor_kl

    got = tensor_kl(model, tokens, mods, opts, clip=False, chunk=9)
    ref = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
    for path, mod in mods.items():  # plain rounding (no clip, single option): the Gram plays no part
        w = mod.weight
        mod.weight = quantize_weight(w, opts[path], clip=False).dequantize(mx.float32)
        try:
            logp = nn.log_softmax(model(tokens).astype(mx.float32), axis=-1)
        finally:
            mod.weight = w
        kl = float((mx.exp(ref) * (ref - logp)).sum(-1).mean().item())
        assert kl > 0 and got[path]["kl"] == pytest.approx(kl, rel=1e-3), path


def test_head_chunk_must_be_positive(big_vocab, grid_file):
    with pytest.raises(ValueError, match="head chunk"):
        _run(big_vocab["untied"], grid_file, head_chunk=0)


# -- output-row subsampling ---------------------------------------------------------------------------------


def test_row_sample_is_seeded_stratified_and_bounded():
    import numpy as np

    from mlx_dq.measure.meter import output_row_sample

    rng = np.random.default_rng(0)
    w = rng.standard_normal((1000, 64)).astype("float32")
    w[[7, 500]] *= 50  # two rows carry most of the output energy: always in the sample
    w, g = mx.array(w), mx.eye(64)
    a, wa = output_row_sample("model.layers.0.mlp.up_proj", w, g, 100)
    b, _ = output_row_sample("model.layers.0.mlp.up_proj", w, g, 100)
    c, _ = output_row_sample("model.layers.1.mlp.up_proj", w, g, 100)
    ia = a.tolist()
    assert len(ia) == 100 == len(set(ia)) and max(ia) < 1000 and ia == sorted(ia)
    assert ia == b.tolist() and ia != c.tolist()
    assert 7 in ia and 500 in ia
    wl = dict(zip(ia, wa.tolist()))
    assert wl[7] == 1.0 and sum(x == 1.0 for x in wl.values()) == 25
    assert sum(wl.values()) == pytest.approx(1000)  # the weights count every row once
    assert output_row_sample("x", w[:100], g, 100) is None and output_row_sample("x", w, g, 0) is None


@pytest.mark.parametrize("method,clip", [("rtn", True), ("gptq", True)])
def test_sampled_rows_error_equals_full_quantization_on_those_rows(method, clip):
    """Rows are independent: the subset's error equals the full quantization's error restricted to those rows."""
    import numpy as np

    from mlx_dq.measure.meter import output_row_sample
    from mlx_dq.measure.tensor import HowToMeasure, measure_tensor
    from mlx_dq.model.capture import InputStats
    from mlx_dq.quant.affine import output_error
    from mlx_dq.quant.dispatch import quantize_tensor
    from mlx_dq.quant.options import QuantOption
    from mlx_dq.quant.spec import QuantizerSpec

    rng = np.random.default_rng(1)
    w = mx.array(rng.standard_normal((300, 128)).astype("float32"))
    x = rng.standard_normal((512, 128)).astype("float32") * np.linspace(0.2, 3, 128, dtype="float32")
    gram = mx.array(x.T @ x)
    opts = [QuantOption.parse(d) for d in ("1.0:2b_64g", "1.0:3b_64g", "0.5:4b_32g/0.5:3b_64g")]
    kept = {"1.0:3b_64g": None}
    rec = measure_tensor("t", w, opts, InputStats(gram=gram, rows=512), "default",
                         spec=QuantizerSpec(method=method, clip=clip), kept=kept, how=HowToMeasure(sample_rows=64))
    idx, rw = output_row_sample("t", w, gram, 64)
    assert rec.extra["sampled_rows"] == 64 and kept["1.0:3b_64g"].shape == (300, 128)
    for o in rec.options:
        wq = quantize_tensor(w, o.option, gram, QuantizerSpec(method=method, clip=clip)).dequantize(mx.float32)
        d, ws = (wq - w)[idx], w[idx]
        want = float(mx.sqrt((rw * ((d @ gram) * d).sum(1)).sum() / (rw * ((ws @ gram) * ws).sum(1)).sum()).item())
        assert o.err == pytest.approx(want, rel=1e-3), o.option.desc
        assert abs(o.err - output_error(w, wq, gram)) < 0.15 * output_error(w, wq, gram)  # an estimate of the whole


def test_measure_records_sample_rows_in_its_settings(big_vocab, grid_file):
    from mlx_dq.settings import MeasureSettings

    plain = _run(big_vocab["untied"], grid_file, kl_scale=False, sample_rows=0)
    sampled = _run(big_vocab["untied"], grid_file, kl_scale=False, sample_rows=64)
    assert "sample_rows" not in plain.extra and sampled.extra["sample_rows"] == 64
    default = _run(big_vocab["untied"], grid_file, kl_scale=False)
    assert default.extra["sample_rows"] == MeasureSettings.sample_rows == 256
    assert plain.extra["settings_digest"] != sampled.extra["settings_digest"]
    up = "model.layers.0.mlp.up_proj"  # 256 output rows: measured on 64
    assert sampled.tensors[up].extra["sampled_rows"] == 64 and "sampled_rows" not in plain.tensors[up].extra
    assert sampled.tensors["lm_head"].extra["sampled_rows"] == 64
    assert sampled.tensors[up].options[0].err != plain.tensors[up].options[0].err
    with pytest.raises(ValueError, match="sample_rows"):
        _run(big_vocab["untied"], grid_file, sample_rows=-1)


# -- --estimate ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["rtn", "gptq"])
def test_estimate_matches_a_real_run(big_vocab, grid_file, tmp_path, method):
    """Work counts exactly, MLX memory and disk closely; time is a benchmark's business, not a unit test's."""
    from mlx_dq.conversion.estimate import BASE_RSS, estimate_convert, estimate_measure
    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.evaluation.metrics import folder_bytes
    from mlx_dq.model.sources import resolve

    folder = big_vocab["untied"]
    src = resolve(str(folder))
    est = estimate_measure(src, rows=4, seq_len=64, grid=str(grid_file), method=method)
    mx.reset_peak_memory()
    m = measure(str(folder), grid=str(grid_file), rows=4, seq_len=64, method=method, progress=False,
                out_path=tmp_path / "m.json")
    assert est.measurements == sum(len(t.options) for t in m.tensors.values())
    mem = mx.get_peak_memory()
    assert 0.5 * mem < est.peak_bytes - BASE_RSS < 2.0 * mem, (est.peak_bytes - BASE_RSS, mem)
    assert math.isfinite(est.seconds) and est.seconds > 0
    conv, meas = estimate_convert(src, bpw=3.5, rows=4, seq_len=64, method=method, measure_first=False,
                                  measurement_bytes=(tmp_path / "m.json").stat().st_size, flops=est.flops)
    assert meas is None
    mx.reset_peak_memory()
    convert(str(folder), tmp_path / "q", bpw=3.5, measurement=tmp_path / "m.json", rows=4, seq_len=64, method=method,
            progress=False)
    mem = mx.get_peak_memory()
    assert 0.5 * mem < conv.peak_bytes - BASE_RSS < 2.0 * mem, (conv.peak_bytes - BASE_RSS, mem)
    disk = folder_bytes(tmp_path / "q")
    assert 0.8 * disk < conv.disk_bytes < 1.25 * disk, (conv.disk_bytes, disk)
    weights = sum(f.stat().st_size for f in (tmp_path / "q").glob("*.safetensors"))
    assert conv.detail["quantized_params"] * 3.5 / 8 <= weights < conv.detail["quantized_params"] * 3.6 / 8


def test_estimate_cli_prints_and_does_no_work(big_vocab, tmp_path):
    from click.testing import CliRunner

    from mlx_dq.cli import main

    r = CliRunner().invoke(main, ["convert", "--model", str(big_vocab["untied"]), "--bpw", "3.5", "-o",
                                  str(tmp_path / "q"), "--estimate", "--flops", "1e10"])
    assert r.exit_code == 0, r.output
    assert "measure:" in r.output and "convert (quantize stage)" in r.output and "total: about" in r.output
    assert "10.0 GFLOP/s" in r.output and not (tmp_path / "q").exists()
    r = CliRunner().invoke(main, ["measure", "--model", str(big_vocab["untied"]), "-o", str(tmp_path / "m.json"),
                                  "--estimate", "--method", "rtn"])
    assert r.exit_code == 0, r.output
    assert "(tensor, option) errors" in r.output and not (tmp_path / "m.json").exists()
    r = CliRunner().invoke(main, ["measure", "--model", str(tmp_path / "nope"), "-o", str(tmp_path / "m.json"),
                                  "--estimate"])
    assert r.exit_code != 0 and "Error:" in r.output and "Traceback" not in r.output


def test_summary_line_says_time_memory_disk_and_warns_when_memory_is_short():
    from mlx_dq.conversion.estimate import Estimate, summary_line

    parts = [Estimate("measure", seconds=600.0, peak_bytes=3 * 2**30, disk_bytes=2**20),
             Estimate("convert", seconds=300.0, peak_bytes=2 * 2**30, disk_bytes=59 * 2**20)]
    line = summary_line(parts, memory=16 * 2**30)
    assert "about 15.0 min" in line and "peak memory about 3.0 GiB" in line and "60 MiB written" in line
    assert "WARNING" not in line
    short = summary_line(parts, memory=2 * 2**30)
    assert short.startswith(line) and "WARNING: this machine has 2.0 GiB" in short
    assert "WARNING" not in summary_line(parts, memory=None)  # a system that does not say: no guess


def test_convert_and_measure_say_their_cost_before_working(big_vocab, grid_file, tmp_path, monkeypatch):
    """One stderr line before any work: the predicted time and memory (a warning when memory is short)."""
    from click.testing import CliRunner

    from mlx_dq.cli import main
    from mlx_dq.conversion import estimate as estimate_mod
    from mlx_dq.conversion import pipeline as convert_mod
    from mlx_dq.errors import InputError

    def stop(*a, **k):  # the run itself is not this test's business
        raise InputError("the run starts here")

    monkeypatch.setattr(measure_mod, "measure", stop)
    monkeypatch.setattr(convert_mod, "convert", stop)
    monkeypatch.setattr(estimate_mod, "physical_memory", lambda: 1024)
    folder = str(big_vocab["untied"])
    for args in (["measure", "--model", folder, "-o", str(tmp_path / "m.json"), "--grid", str(grid_file)],
                 ["convert", "--model", folder, "--bpw", "3.5", "-o", str(tmp_path / "q"), "--method", "rtn"]):
        r = CliRunner().invoke(main, args)
        assert r.exit_code != 0 and "the run starts here" in r.stderr, r.output
        assert r.stderr.count("mlx_dq: expected: about") == 1 and "peak memory about" in r.stderr
        assert r.stderr.index("expected:") < r.stderr.index("the run starts here")
        assert "WARNING: this machine has 0.0 GiB" in r.stderr
        assert "expected:" not in r.stdout
    monkeypatch.setattr(estimate_mod, "physical_memory", lambda: 2**50)
    r = CliRunner().invoke(main, ["convert", "--model", folder, "--bpw", "3.5", "-o", str(tmp_path / "q")])
    assert "expected: about" in r.stderr and "WARNING" not in r.stderr
    r = CliRunner().invoke(main, ["convert", "--model", str(tmp_path / "nope"), "--bpw", "3.5", "-o",
                                  str(tmp_path / "q")])
    assert r.exit_code != 0 and r.output.count("Error:") == 1 and "does not exist" in r.output
    assert "expected:" not in r.output  # a model that cannot be read: its one-line error, before any estimate


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_converter_head_gram_is_that_of_the_final_normed_states(big_vocab, monkeypatch, kind):
    """The head's Gram (taken without evaluating any logits) is X^T X of the normed final hidden states."""
    from mlx_dq.data.calib import calibration_rows
    from mlx_dq.model.sources import resolve
    from mlx_dq.quant import dispatch as quantize_mod
    from mlx_dq.quant.options import QuantOption

    src = resolve(str(big_vocab[kind]))
    _, tokens = calibration_rows(src.tokenizer(), None, 3, 40, 0)
    seen: dict = {}
    orig_outside, orig_all = quantize_mod._quantize_outside, quantize_mod._quantize_all

    def outside(runner, hidden, options, how, **kw):
        seen["hidden"], seen["net"] = hidden, runner.net
        return orig_outside(runner, hidden, options, how, **kw)

    def quantize_all(mods, stats, options, how, **kw):
        seen.setdefault("stats", []).append(stats)
        return orig_all(mods, stats, options, how, **kw)

    monkeypatch.setattr(quantize_mod, "_quantize_outside", outside)
    monkeypatch.setattr(quantize_mod, "_quantize_all", quantize_all)
    options = {"lm_head" if kind == "untied" else "model.embed_tokens": QuantOption.uniform(4, 32)}
    list(quantize_mod.quantize_stream(src, options, tokens, progress=False, batch_size=2))
    head = next(iter(options))
    gram = seen["stats"][-1][head].gram
    x = seen["net"].model.norm(seen["hidden"]).astype(mx.float32).reshape(-1, int(seen["hidden"].shape[-1]))
    expect = x.T @ x
    assert float(mx.abs(gram - expect).max()) <= 1e-4 * float(mx.abs(expect).max())


@pytest.mark.parametrize("desc", ["1.0:3b_64g", "0.25:4b_32g/0.75:2b_64g", "fp16"])
def test_written_error_in_row_blocks_equals_one_piece(monkeypatch, desc):
    """The converter's recorded output error of a large tensor, taken block by block of rows, is the whole one's."""
    from mlx_dq.conversion import writer
    from mlx_dq.quant import dispatch as quantize_mod
    from mlx_dq.quant.affine import output_error
    from mlx_dq.quant.dispatch import quantize_tensor
    from mlx_dq.quant.options import QuantOption
    from mlx_dq.quant.spec import QuantizerSpec

    rng = np.random.default_rng(2)
    w = mx.array(rng.standard_normal((600, 128)).astype("float32"))
    x = mx.array(rng.standard_normal((300, 128)).astype("float32"))
    gram = x.T @ x
    opt = QuantOption.fp16() if desc == "fp16" else QuantOption.parse(desc)
    qt = quantize_tensor(w, opt, gram, QuantizerSpec(method="rtn", clip=False))
    for sl in (slice(0, 150), slice(150, 151), slice(151, 600)):
        assert mx.array_equal(qt.rows(sl).dequantize(), qt.dequantize()[sl])
    whole = output_error(w, qt.dequantize(mx.float32), gram)
    monkeypatch.setattr(quantize_mod, "ROW_BLOCK_BYTES", 4 * 128 * 150)  # 4 blocks of 150 rows
    assert len(quantize_mod.row_blocks(w.shape)) == 4
    seen = []
    orig = qt.rows
    monkeypatch.setattr(qt, "rows", lambda sl: (seen.append(sl), orig(sl))[1])
    got = writer._output_error(qt, w, gram)
    assert len(seen) == 4
    assert got == pytest.approx(whole, rel=1e-5, abs=1e-9)


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_embedding_and_head_are_not_held_through_the_layers(big_vocab, grid_file, monkeypatch, kind):
    """The embedding and head are released while the layers run; an untied embedding also before the head's options."""
    held: list[int] = []
    orig = measure_mod._measure_layer

    def spy(run, i):
        held.append(sum(int(p.size) for mod in run.runner.outside_modules().values()
                        for _, p in tree_flatten(mod.parameters())))
        return orig(run, i)

    embed_max: list[float] = []
    orig_head = head_mod._measure_head_tensor

    head_held: list[int] = []

    def head_spy(run, path, mod, *a):
        if path == "lm_head":  # an untied embedding is measured first, then replaced by a zero view
            embed_max.append(float(mx.abs(run.runner.net.model.embed_tokens.weight).max()))
        elif kind == "untied":  # ... with only itself loaded: the head comes after
            head_held.append(int(run.runner.net.lm_head.weight.size))
        return orig_head(run, path, mod, *a)

    monkeypatch.setattr(measure_mod, "_measure_layer", spy)
    monkeypatch.setattr(head_mod, "_measure_head_tensor", head_spy)
    m = _run(big_vocab[kind], grid_file)
    assert held == [0]
    assert embed_max == ([0.0] if kind == "untied" else [])
    assert head_held == ([0] if kind == "untied" else [])
    head = "model.embed_tokens" if kind == "tied" else "lm_head"
    assert m.tensors[head].shape[0] == BIG_VOCAB and all(o.damage is not None for o in m.tensors[head].options)
    monkeypatch.setattr(measure_mod, "_measure_layer", orig)
    monkeypatch.setattr(measure_mod.LayerRunner, "free_outside", lambda self: None)
    monkeypatch.setattr(head_mod, "free_table", lambda mod: None)
    monkeypatch.setattr(head_mod, "_measure_head_tensor", orig_head)
    _assert_same(m, _run(big_vocab[kind], grid_file))


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_converter_releases_embedding_and_head_through_the_layers(big_vocab, monkeypatch, kind):
    """The conversion holds no embedding or head while it quantizes the layers; the result is the same."""
    from mlx_dq.data.calib import calibration_rows
    from mlx_dq.model.sources import resolve
    from mlx_dq.quant import dispatch as quantize_mod
    from mlx_dq.quant.options import QuantOption

    src = resolve(str(big_vocab[kind]))
    _, tokens = calibration_rows(src.tokenizer(), None, 3, 40, 0)
    head = "lm_head" if kind == "untied" else "model.embed_tokens"
    options = {head: QuantOption.uniform(4, 32), "model.layers.0.mlp.down_proj": QuantOption.uniform(3, 64),
               "model.embed_tokens": QuantOption.uniform(3, 32)}
    held: list[int] = []
    orig = quantize_mod.LayerRunner.forward
    orig_all, orig_tables = quantize_mod._quantize_all, quantize_mod.LayerRunner.lookup_tables
    runners, head_held = [], []

    def lookup_tables(self):
        runners.append(self)
        return orig_tables(self)

    def quantize_all(mods, *a, **kw):  # an untied embedding is quantized with the head not loaded
        if kind == "untied" and list(mods) == ["model.embed_tokens"]:
            head_held.append(int(runners[-1].net.lm_head.weight.size))
        return orig_all(mods, *a, **kw)

    def forward(self, i, hidden, col):
        held.append(sum(int(p.size) for mod in self.outside_modules().values()
                        for _, p in tree_flatten(mod.parameters())))
        return orig(self, i, hidden, col)

    def parts() -> dict[str, mx.array]:
        out = list(quantize_mod.quantize_stream(src, options, tokens, progress=False, batch_size=2))
        return {t.path: t.qt.dequantize(mx.float32) for p in out for t in p.tensors}

    monkeypatch.setattr(quantize_mod.LayerRunner, "forward", forward)
    monkeypatch.setattr(quantize_mod.LayerRunner, "lookup_tables", lookup_tables)
    monkeypatch.setattr(quantize_mod, "_quantize_all", quantize_all)
    got = parts()
    assert held and set(held) == {0}
    assert head_held == ([0] if kind == "untied" else [])
    monkeypatch.setattr(quantize_mod.LayerRunner, "free_outside", lambda self: None)
    want = parts()
    assert set(got) == set(want) and set(options) <= set(got)
    for k in got:
        assert mx.array_equal(got[k], want[k]), k


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_embedding_pass_loads_no_untied_head(big_vocab, grid_file, monkeypatch, kind):
    """Embedding the rows (measure and convert) reads the embedding but not an untied head, which the pass never
    calls; the first hidden states equal those made with everything outside the layers loaded."""
    from mlx_dq.data.calib import calibration_rows
    from mlx_dq.model.runner import LayerRunner
    from mlx_dq.model.sources import ModelSource, resolve
    from mlx_dq.quant import dispatch as quantize_mod
    from mlx_dq.quant.options import QuantOption

    src = resolve(str(big_vocab[kind]))
    _, tokens = calibration_rows(src.tokenizer(), None, 3, 40, 0)
    full = LayerRunner(src, tokens, 2)
    full.load_outside()
    want = mx.concatenate(full.probe(), axis=0)
    read: list[str] = []
    seen: list[list[str]] = []
    orig_probe, orig_load = LayerRunner.probe, ModelSource.load_weights

    def load_weights(self, names, *a, **k):
        names = list(names)
        read.extend(n for n in names if n.startswith(("lm_head", "model.embed_tokens")))
        return orig_load(self, names, *a, **k)

    def probe(self, *a, **kw):
        seen.append(sorted(read))
        read.clear()
        out = orig_probe(self, *a, **kw)
        if len(seen) == 2:  # the conversion's pass, on these tokens
            assert mx.array_equal(mx.concatenate(out, axis=0), want)
        return out

    monkeypatch.setattr(LayerRunner, "probe", probe)
    monkeypatch.setattr(ModelSource, "load_weights", load_weights)
    _run(big_vocab[kind], grid_file)
    read.clear()  # what the measurement's later stages read
    list(quantize_mod.quantize_stream(src, {"model.layers.0.mlp.down_proj": QuantOption.uniform(4, 32)}, tokens,
                                      progress=False, batch_size=2))
    assert seen == [["model.embed_tokens.weight"]] * 2


def test_shard_writer_streams_arrays_to_disk(tmp_path):
    """Shards hold every dtype the converter writes, load in MLX and the safetensors library, split at the size
    limit; each array's bytes are on disk when added (memory holds none of a shard); a name written twice fails."""
    from safetensors import safe_open

    from mlx_dq.conversion.writer import ShardWriter

    rng = np.random.default_rng(0)
    arrays = {"a.weight": mx.array(rng.integers(0, 2**32, (7, 5), dtype=np.uint32)),
              "a.scales": mx.array(rng.normal(size=(7, 3)).astype(np.float16)),
              "b.weight": mx.array(rng.normal(size=(4, 6)).astype(np.float32)).astype(mx.bfloat16),
              "b.perm": mx.array(rng.permutation(6).astype(np.int32)),
              "c.norm": mx.array(rng.normal(size=(9,)).astype(np.float32)),
              "c.ids": mx.array(np.arange(3, dtype=np.uint8)), "c.empty": mx.zeros((0, 4), mx.float16)}
    writer = ShardWriter(tmp_path, max_bytes=200)
    writer.add({})  # a part with nothing to write starts no shard
    assert not list(tmp_path.iterdir())
    added = 0
    for name, a in arrays.items():
        writer.add({name: a})
        added += a.nbytes
        data = sorted(tmp_path.glob("shard-*.data"))
        assert sum(p.stat().st_size for p in data) + sum(p.stat().st_size for p in tmp_path.glob("*.safetensors")) \
            >= added  # written when added
    with pytest.raises(ValueError, match="written twice"):
        writer.add({"a.weight": arrays["a.weight"]})
    writer.add({})
    files = writer.close()
    assert len(files) > 1 and not list(tmp_path.glob("*.data"))
    got = {}
    for f in files:
        got.update(mx.load(str(f)))
        with safe_open(str(f), framework="numpy") as ref:  # the reference reader (numpy: no bfloat16)
            for k in ref.keys():
                if arrays[k].dtype != mx.bfloat16:
                    assert np.array_equal(ref.get_tensor(k), np.array(arrays[k]))
    assert set(got) == set(arrays)
    for name, a in arrays.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape and mx.array_equal(got[name], a)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == added and set(index["weight_map"]) == set(arrays)


def test_conversion_drops_each_layer_before_the_next(big_vocab, tmp_path, monkeypatch):
    """While the converter reruns a layer on its quantized weights (and quantizes the head), no float32 weight or
    Gram of that layer, and no float32 copy of an untied embedding, is still alive: each was dropped once written."""
    import gc
    import weakref

    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.model.runner import LayerRunner
    from mlx_dq.quant import dispatch as quantize_mod

    refs: list = []
    alive: list[int] = []
    orig_forward, orig_outside = LayerRunner.forward, quantize_mod._quantize_outside
    orig_all = quantize_mod._quantize_all

    def forward(self, i, hidden, col=None):
        if col is None:  # the rerun on quantized weights
            gc.collect()
            alive.append(sum(r() is not None for r in refs))
            refs.clear()
        return orig_forward(self, i, hidden, col)

    def quantize_all(mods, stats, *a, **kw):
        refs.extend(weakref.ref(m.weight) for m in mods.values())
        refs.extend(weakref.ref(st.gram) for st in stats.values() if st.gram is not None)
        return orig_all(mods, stats, *a, **kw)

    def outside(*a, **kw):
        gc.collect()
        alive.append(sum(r() is not None for r in refs))  # the untied embedding's float32 table
        return orig_outside(*a, **kw)

    monkeypatch.setattr(LayerRunner, "forward", forward)
    monkeypatch.setattr(quantize_mod, "_quantize_all", quantize_all)
    monkeypatch.setattr(quantize_mod, "_quantize_outside", outside)
    recipe = {"model.layers.0.mlp.down_proj": "1.0:3b_64g", "model.layers.0.self_attn.q_proj": "1.0:4b_32g",
              "model.embed_tokens": "1.0:4b_32g", "lm_head": "1.0:4b_64g"}
    convert(str(big_vocab["untied"]), tmp_path / "out", plan=recipe, rows=3, seq_len=40, progress=False)
    assert len(alive) == 2 and alive == [0, 0]


@pytest.mark.parametrize("kind", ["untied", "tied"])
def test_output_energy_is_the_gram_form_and_the_record_keeps_its_error(big_vocab, tmp_path, monkeypatch, kind):
    """A linear layer's recorded output energy per row equals ``w_i G w_i^T`` (biases removed: the tied model is a
    qwen2 with q/k/v biases), and a conversion that takes its records' reference sums from it writes the same
    errors as one that multiplies them out against the Gram."""
    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.data.calib import calibration_rows
    from mlx_dq.model import capture as capture_mod
    from mlx_dq.model.runner import LayerRunner
    from mlx_dq.model.sources import resolve

    src = resolve(str(big_vocab[kind]))
    _, tokens = calibration_rows(src.tokenizer(), None, 3, 40, 0)
    runner = LayerRunner(src, tokens, 2)
    runner.load_for_probe()
    hidden = runner.join(runner.probe())
    mods = runner.load(0)
    with runner.collector(mods, output_energy=True) as col:
        runner.forward(0, hidden, col)
    assert set(col.energies) == set(mods)
    for path, mod in mods.items():
        w = mod.weight.astype(mx.float32)
        want = np.asarray(((w @ col.stats[path].gram) * w).sum(1), dtype=np.float64)
        np.testing.assert_allclose(np.asarray(col.energies[path], dtype=np.float64), want, rtol=2e-4,
                                   atol=1e-6 * want.max())

    recipe = {"model.layers.0.mlp.down_proj": "1.0:3b_64g", "model.layers.0.self_attn.q_proj": "0.5:4b_32g/0.5:3b_32g",
              "model.layers.0.mlp.up_proj": "1.0:4b_64g"}
    from mlx_dq.conversion import writer as writer_mod

    errs, products = {}, {True: 0, False: 0}
    orig_sums = writer_mod.exact_sums
    for on in (True, False):
        monkeypatch.setattr(capture_mod.GramCollector, "record_output",
                            capture_mod.GramCollector.record_output if on else lambda self, *a: None)

        def sums(*a, on=on):
            products[on] += 1
            return orig_sums(*a)

        monkeypatch.setattr(writer_mod, "exact_sums", sums)
        m = convert(str(big_vocab[kind]), tmp_path / f"out-{on}", plan=recipe, rows=3, seq_len=40, progress=False)
        errs[on] = {k: r["err"] for k, r in m["modules"].items() if r["err"] is not None}
    assert set(errs[True]) == set(errs[False]) and set(recipe) <= set(errs[True])
    for k, e in errs[False].items():
        assert errs[True][k] == pytest.approx(e, rel=1e-4)
    assert products[False] - products[True] == len(recipe)  # the layer's GPTQ records multiplied nothing out


def test_row_sample_from_recorded_energies(big_vocab, grid_file, monkeypatch):
    """The stratified row sample drawn from the forward's recorded output energies is the one the Gram gives,
    and the measurer uses them (no Gram product per tensor) with the same results."""
    from mlx_dq.measure.meter import output_row_sample

    rng = np.random.default_rng(1)
    x = rng.normal(size=(300, 48)).astype(np.float32)
    w = mx.array(rng.normal(size=(200, 48)).astype(np.float32) * np.linspace(0.1, 3, 200, dtype=np.float32)[:, None])
    gram = mx.array(x.T @ x)
    energy = mx.sum(mx.square(mx.array(x) @ w.T), axis=0)
    a, b = output_row_sample("t", w, gram, 40), output_row_sample("t", w, gram, 40, energy=energy)
    assert mx.array_equal(a[0], b[0]) and mx.array_equal(a[1], b[1])

    given: list[bool] = []
    orig = meter_mod.output_row_sample

    def spy(key, w, gram, n, must=None, energy=None):
        given.append(energy is not None)
        return orig(key, w, gram, n, must, energy)

    monkeypatch.setattr(tensor_mod, "output_row_sample", spy)
    monkeypatch.setattr(head_mod, "output_row_sample", spy)
    m = _run(big_vocab["untied"], grid_file, sample_rows=64)
    assert given and all(given[:7])  # the layer's tensors
    monkeypatch.setattr(measure_mod.GramCollector, "record_output", lambda self, *a: None)
    _assert_same(m, _run(big_vocab["untied"], grid_file, sample_rows=64))


def test_error_meter_takes_its_reference_from_given_energies(monkeypatch):
    """Given the rows' energies, the error meter's reference sum is theirs (the head computes them once for its
    sample and every meter), equal to the Gram product it no longer makes; the weight sums are unchanged."""
    from mlx_dq.measure.meter import ErrorMeter, output_energies

    rng = np.random.default_rng(2)
    x = rng.normal(size=(200, 48)).astype(np.float32)
    w = mx.array(rng.normal(size=(120, 48)).astype(np.float32))
    gram = mx.array(x.T @ x)
    wq = w + 0.01 * mx.array(rng.normal(size=(120, 48)).astype(np.float32))
    energy = output_energies(w, gram)
    for rw in (None, mx.array(rng.uniform(0.5, 2.0, size=120).astype(np.float32))):
        a = ErrorMeter(w, gram, None, rw)
        products: list[int] = []
        orig = ErrorMeter._squares
        monkeypatch.setattr(ErrorMeter, "_squares",
                            lambda self, v, g: products.append(g is not None) or orig(self, v, g))
        b = ErrorMeter(w, gram, None, rw, energy)
        monkeypatch.setattr(ErrorMeter, "_squares", orig)
        assert not any(products)
        assert b.oden == pytest.approx(a.oden, rel=1e-5) and b.wden == a.wden
        assert b(wq)[0] == pytest.approx(a(wq)[0], rel=1e-5) and b(wq)[1] == a(wq)[1]


def test_looked_up_rows_are_swapped_in_place_and_back():
    """The lookup probe changes a float32 table's rows in its own buffer (the same array, no copy of the table) and
    restores them, also when the probe fails; a 16-bit table gets a changed copy and then its own array back."""
    import mlx.nn as nn

    from mlx_dq.measure.swap import rows_swapped

    emb = nn.Embedding(50, 8)
    emb.weight = mx.random.normal((50, 8), key=mx.random.key(0))
    mx.eval(emb.weight)
    table, orig = emb.weight, np.array(emb.weight)
    ids, new = np.array([3, 7, 41]), mx.ones((3, 8))
    with rows_swapped(emb, ids, new):
        assert emb.weight is table  # changed in place
        inside = np.array(emb(mx.array([7, 2])))
    assert np.array_equal(inside[0], np.ones(8)) and np.array_equal(inside[1], orig[2])
    assert emb.weight is table and np.array_equal(np.asarray(emb.weight), orig)
    with pytest.raises(RuntimeError):
        with rows_swapped(emb, ids, new):
            raise RuntimeError("probe failed")
    assert np.array_equal(np.asarray(emb.weight), orig)
    half = emb.weight = table.astype(mx.bfloat16)
    with rows_swapped(emb, ids, new):
        assert emb.weight is not half
        assert np.array_equal(np.array(emb.weight[mx.array(ids)].astype(mx.float32)), np.ones((3, 8)))
    assert emb.weight is half


def test_consumed_gram_measures_the_same():
    """A tensor whose Gram is its own (``consume_gram``) is measured with the Gram's buffer turned into the Hessian
    factor: the same record and kept weight as with the Gram kept beside its factor; the collector's stats then hold
    the stand-in, and a Gram shared with another tensor, or an option the factor cannot serve, is left alone."""
    from mlx_dq.measure.meter import output_energies
    from mlx_dq.measure.tensor import HowToMeasure, measure_tensor
    from mlx_dq.model.capture import InputStats
    from mlx_dq.quant.gptq import FactoredGram
    from mlx_dq.quant.options import QuantOption
    from mlx_dq.quant.spec import QuantizerSpec

    rng = np.random.default_rng(4)
    x = rng.normal(size=(512, 128)).astype(np.float32)
    w = mx.array(rng.normal(size=(40, 128)).astype(np.float32))
    opts = [QuantOption.parse(d) for d in ("1.0:4b_32g", "1.0:3b_64g", "0.25:4b_32g/0.75:3b_32g", "1.0:2b_32g")]
    energy = output_energies(w, mx.array(x.T @ x))
    recs, kepts, stats = [], [], []
    for consume, group in ((False, ("t",)), (True, ("t",)), (True, ("t", "u"))):
        st = InputStats(gram=mx.array(x.T @ x), rows=512, group=group)
        mx.eval(st.gram)
        kept = {"1.0:4b_32g": None}
        how = HowToMeasure(sample_rows=16, energy=energy, consume_gram=consume and len(group) == 1)
        recs.append(measure_tensor("t", w, opts, st, "default", spec=QuantizerSpec(method="gptq", clip=True),
                                   kept=kept, how=how))
        kepts.append(kept["1.0:4b_32g"])
        stats.append(st)
    assert isinstance(stats[1].gram, FactoredGram) and isinstance(stats[0].gram, mx.array)
    assert isinstance(stats[2].gram, mx.array) and np.array_equal(np.asarray(stats[2].gram), x.T @ x)
    for rec, kept in zip(recs[1:], kepts[1:]):
        assert rec.options == recs[0].options
        assert {k: v for k, v in rec.extra.items() if k != "shares_input_with"} == recs[0].extra
        assert mx.array_equal(kept.dequantize(), kepts[0].dequantize()).item()
    st = InputStats(gram=mx.array(x.T @ x), rows=512, group=("t",))
    # the kept option is not measured: its caller needs the Gram
    measure_tensor("t", w, opts, st, "default", spec=QuantizerSpec(method="gptq", clip=True),
                   kept={"1.0:8b_32g": None}, how=HowToMeasure(sample_rows=16, energy=energy, consume_gram=True))
    assert isinstance(st.gram, mx.array)


def test_converter_consumes_a_tensors_own_gram_with_the_same_output(big_vocab, tmp_path, monkeypatch):
    """The converter turns the Gram of a tensor with its own input (``down_proj``, ``o_proj``) into its Hessian
    factor in place, and not a Gram that q/k/v or gate/up share: the written tensors and records are the same as
    with every Gram kept beside its factor."""
    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.names import MANIFEST_NAME
    from mlx_dq.quant import dispatch as quantize_mod

    consumed: list[tuple[int, ...]] = []
    orig = quantize_mod.consume_gram
    monkeypatch.setattr(quantize_mod, "consume_gram",
                        lambda g, c, d: consumed.append(tuple(g.shape)) or orig(g, c, d))
    recipe = {"model.layers.0.mlp.down_proj": "0.25:4b_32g/0.75:3b_32g", "model.layers.0.self_attn.o_proj": "1.0:4b_32g",
              "model.layers.0.mlp.gate_proj": "1.0:3b_64g", "model.layers.0.self_attn.q_proj": "1.0:4b_32g"}
    convert(str(big_vocab["untied"]), tmp_path / "a", plan=recipe, rows=3, seq_len=40, progress=False)
    assert len(consumed) == 2  # down_proj and o_proj
    monkeypatch.setattr(quantize_mod, "_can_consume", lambda *a: False)
    convert(str(big_vocab["untied"]), tmp_path / "b", plan=recipe, rows=3, seq_len=40, progress=False)
    fa, fb = sorted((tmp_path / "a").glob("*.safetensors")), sorted((tmp_path / "b").glob("*.safetensors"))
    assert [f.name for f in fa] == [f.name for f in fb]
    for x, y in zip(fa, fb):
        a, b = mx.load(str(x)), mx.load(str(y))
        assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]).item() for k in a)
    ra = json.loads((tmp_path / "a" / MANIFEST_NAME).read_text())["modules"]
    rb = json.loads((tmp_path / "b" / MANIFEST_NAME).read_text())["modules"]
    assert ra == rb


@pytest.mark.parametrize("block_bytes", [None, 4 * 128 * 128])
def test_a_16bit_source_is_measured_and_converted_as_its_float32_copy(grid_file, tmp_path, monkeypatch, block_bytes):
    """A bfloat16 model's decoder layers, untied head and lookup table stay in bfloat16 while they are measured and
    quantized (half their memory), and every record and written tensor equals those of the same weights stored in
    float32: every step reads them in float32, which holds bfloat16 values exactly. With ``block_bytes`` every
    16-bit product of more than 128 x 128 weights is taken 128 output rows (64 of 256 inputs) at a time
    (:func:`~mlx_dq.model.runner.half_linear`), with the same results."""
    import shutil

    from fixtures_models import make_tiny_model_folder

    from mlx_dq.conversion.pipeline import convert
    from mlx_dq.model import runner as runner_mod
    from mlx_dq.model.runner import LayerRunner

    if block_bytes is not None:
        monkeypatch.setattr(runner_mod, "HALF_BLOCK_BYTES", block_bytes)
    blocked = []
    orig_half = runner_mod.half_linear

    def half_linear(mod, x, *a):
        y = orig_half(mod, x, *a)
        blocked.append(y is not None)
        return y

    monkeypatch.setattr(runner_mod, "half_linear", half_linear)
    outside: dict[str, set] = {}
    orig_outside = LayerRunner.load_outside

    def load_outside(self, *a, **k):  # the dtypes of the tables it loads
        before = {p: m.weight for p, m in self.outside_modules().items()}
        orig_outside(self, *a, **k)
        outside.setdefault(str(self.source.path), set()).update(
            (p, str(m.weight.dtype)) for p, m in self.outside_modules().items() if m.weight is not before[p])

    monkeypatch.setattr(LayerRunner, "load_outside", load_outside)

    b16 = make_tiny_model_folder(tmp_path, "llama", dtype=mx.bfloat16, seed=5, name="b16", hidden=128,
                                 intermediate=256)
    f32 = tmp_path / "f32"
    shutil.copytree(b16, f32)
    mx.save_safetensors(str(f32 / "model.safetensors"),
                        {k: v.astype(mx.float32) for k, v in mx.load(str(b16 / "model.safetensors")).items()})
    seen: dict[str, set] = {}
    eager: dict[str, set] = {}  # a 16-bit layer's products are evaluated one by one (their float32 copies one at a time)
    orig, orig_free = LayerRunner.load, LayerRunner.free

    def load(self, i):
        mods = orig(self, i)
        seen.setdefault(str(self.source.path), set()).update(str(m.weight.dtype) for m in mods.values())
        eager.setdefault(str(self.source.path), set()).update("_half_base" in type(m).__dict__ for m in mods.values())
        return mods

    def free(self, i):
        orig_free(self, i)
        assert not any("_half_base" in type(m).__dict__ for _, m in self.layers[i].named_modules())

    monkeypatch.setattr(LayerRunner, "load", load)
    monkeypatch.setattr(LayerRunner, "free", free)
    runs = {}
    for name in ("b16", "f32"):
        folder = tmp_path / name
        m = measure(str(folder), grid=str(grid_file), rows=3, seq_len=48, batch_size=2, importance_rows=2,
                    method="gptq", progress=False)
        convert(str(folder), tmp_path / f"out-{name}", measurement=m, bpw=3.5, dtype="float16", rows=3, seq_len=48,
                progress=False)
        runs[name] = m
    assert [seen[str(tmp_path / n)] for n in ("b16", "f32")] == [{"mlx.core.bfloat16"}, {"mlx.core.float32"}]
    assert [eager[str(tmp_path / n)] for n in ("b16", "f32")] == [{True}, {False}]
    assert any(blocked) == (block_bytes is not None)  # only 16-bit weights over the block size go by blocks
    assert outside[str(b16)] == {("model.embed_tokens", "mlx.core.float32"),  # float32 only to embed the rows
                                 ("model.embed_tokens", "mlx.core.bfloat16"), ("lm_head", "mlx.core.bfloat16")}
    assert {d for _, d in outside[str(f32)]} == {"mlx.core.float32"}
    from mlx_dq.conversion.estimate import _held_bytes
    from mlx_dq.model.sources import resolve

    held = {n: _held_bytes(resolve(str(tmp_path / n)), untied=True) for n in ("b16", "f32")}
    assert held == {"b16": (2, 2), "f32": (4, 4)}  # the estimate counts a 16-bit layer and head at 2 bytes a weight
    assert _held_bytes(resolve(str(b16)), untied=False) == (2, 4)  # a tied table is float32
    _assert_same(runs["b16"], runs["f32"], rel=1e-6)
    fa, fb = sorted((tmp_path / "out-b16").glob("*.safetensors")), sorted((tmp_path / "out-f32").glob("*.safetensors"))
    assert fa and [f.name for f in fa] == [f.name for f in fb]
    for x, y in zip(fa, fb):
        a, b = mx.load(str(x)), mx.load(str(y))
        assert sorted(a) == sorted(b) and all(mx.array_equal(a[k], b[k]).item() for k in a), x.name


def test_large_gram_grows_in_its_own_buffer_in_the_one_process_order(monkeypatch):
    """A Gram larger than GRAM_CHUNK_BYTES is added to in place, its product a block of columns at a time (no
    second k x k array): the sums equal X^T X, the buffer is the same array throughout, and folding each batch's
    own Gram in order (as ranks do) gives the same bits as adding every batch to one running Gram."""
    from mlx_dq.model import capture

    monkeypatch.setattr(capture, "GRAM_CHUNK_BYTES", 4 * 96 * 10)  # 10 columns of a 96-channel input at a time
    rng = np.random.default_rng(7)
    xs = [mx.array(rng.standard_normal((n, 96)).astype(np.float32)) for n in (40, 33, 50)]
    g = None
    for x in xs:
        before = g
        g = capture.add_gram(g, x)
        assert before is None or g is before
    whole = mx.concatenate(xs)
    assert np.allclose(np.asarray(g), np.asarray(whole.T @ whole), rtol=1e-5, atol=1e-4)
    folded = [capture.add_gram(None, x) for x in xs]
    assert mx.array_equal((folded[0] + folded[1]) + folded[2], g).item()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    capture.add_gram(g, xs[0])
    assert mx.get_peak_memory() - base < 0.5 * g.nbytes  # no second Gram-sized array


@pytest.mark.parametrize("bias", [False, True])
def test_half_linear_products_by_row_blocks_equal_the_whole_product(monkeypatch, bias):
    """A 16-bit linear layer over the block size meets a float32 input a block of output rows at a time, with the
    whole product's values bit for bit, evaluated block by block (no whole float32 copy of the weight) or lazily
    inside ``lazy_products``; other inputs, weights and module kinds are left to the module's own call."""
    from mlx_dq.model import runner as runner_mod

    monkeypatch.setattr(runner_mod, "HALF_BLOCK_BYTES", 4 * 256 * 100)  # 64 rows of a 256-input weight (a multiple)
    lin = nn.Linear(256, 1500, bias=bias)
    lin.update(tree_map(lambda a: a.astype(mx.bfloat16), lin.parameters()))
    if bias:
        lin.bias = lin.bias.astype(mx.float32)
    x = mx.random.normal((3, 32, 256), key=mx.random.key(1))
    mx.eval(lin.parameters(), x)
    peaks, outs = [], []
    for f in (lambda: nn.Linear.__call__(lin, x), lambda: runner_mod.half_linear(lin, x),
              lambda: runner_mod.half_linear(lin, x, eager=False)):
        mx.reset_peak_memory()
        base = mx.get_active_memory()
        outs.append(f())
        mx.eval(outs[-1])
        peaks.append(mx.get_peak_memory() - base)
    whole = outs[0]
    assert all(o.dtype == mx.float32 and o.shape == (3, 32, 1500) for o in outs)
    assert all(mx.array_equal(o, whole).item() for o in outs[1:])
    assert peaks[1] < peaks[0] - 2 * 1500 * 256  # the weight's float32 copy is never whole
    lin.__class__ = runner_mod.half_class(nn.Linear)
    assert mx.array_equal(lin(x), whole).item()
    with runner_mod.lazy_products():
        assert mx.array_equal(lin(x), whole).item()
    runner_mod.plain_class(lin)
    assert type(lin) is nn.Linear
    assert runner_mod.half_linear(lin, x.astype(mx.bfloat16)) is None  # a 16-bit input: MLX's own product
    small = nn.Linear(256, 30)
    small.update(tree_map(lambda a: a.astype(mx.bfloat16), small.parameters()))
    assert runner_mod.half_linear(small, x) is None  # within one block
    assert runner_mod.half_linear(nn.Embedding(150, 256), x) is None
