"""Frequent-token rows: the split table's arithmetic, its bits, and a conversion that plans, writes and loads it."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from click.testing import CliRunner

import mlx_dq
from mlx_dq.cli import main
from mlx_dq.conversion.pipeline import convert, quantize_model
from mlx_dq.conversion.resolve import (
    cold_rows_notes,
    planned_row_splits,
    row_splits,
    with_row_splits,
)
from mlx_dq.evaluation import metrics as evaluate
from mlx_dq.layers.rowsplit import RowSplitEmbedding
from mlx_dq.plan.plan import Plan, PlanEntry
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.rowsplit import (
    ID_BITS,
    HotRows,
    extra_bits,
    hot_counts,
    hot_ids,
    rows_worth_it,
    stepped_up,
)

CALIB = {"rows": 4, "seq_len": 32, "progress": False}
TOKENS = mx.array([[1, 5, 9, 17, 33, 65, 2, 7]])
GRID = ["1.0:2b_64g", "1.0:3b_64g", "0.25:4b_64g/0.75:3b_64g", "1.0:4b_64g", "1.0:5b_64g"]
HOT = {"embed": HotRows(np.array([900, 500, 300] + [10] * 37), 5000)}


@pytest.mark.parametrize("desc, want", [
    ("1.0:3b_64g", "1.0:5b_64g"),
    ("0.25:4b_64g/0.75:3b_64g", "0.25:6b_64g/0.75:5b_64g"),
    ("1.0:6b_32g", "1.0:8b_32g"),
    ("1.0:8b_64g", None),
    ("0.5:8b_64g/0.5:6b_64g", None),  # both would be 8-bit: no such option
    ("16bit", None),
])
def test_stepped_up_goes_two_widths_up(desc, want):
    got = stepped_up(QuantOption.parse(desc))
    assert (got.desc if got is not None else None) == want


def test_hot_ids_are_the_seen_ids_sorted_and_capped_by_frequency():
    tokens = np.array([[7, 7, 7, 3, 3, 9, 1], [9, 9, 7, 3, 0, 0, 0]])
    assert hot_ids(tokens, 100).tolist() == [0, 1, 3, 7, 9]
    assert hot_ids(tokens, 100, cap=2 / 100).tolist() == [0, 7]  # 7 (4 times), then the lowest id seen 3 times
    assert hot_ids(tokens, 12).tolist() == [7]  # the default cap: an eighth of the rows
    assert hot_ids(np.array([[5, 140]]), 100).tolist() == [5]  # ids outside the table are ignored


def test_rows_repay_their_bits_by_their_tokens_share_of_the_gain():
    hot = hot_counts(np.array([[3, 3, 3, 3, 3, 8, 8, 8, 1, 2]]), 100)
    assert hot.counts.tolist() == [5, 3, 1, 1] and hot.total == 10
    assert rows_worth_it(hot, gain=1.0, price=0.001, row_bits=100) == 2  # shares 0.5 and 0.3 beat 0.1; 0.1 does not
    assert rows_worth_it(hot, gain=1.0, price=0.0, row_bits=100) == 4
    assert rows_worth_it(hot, gain=0.0, price=0.0, row_bits=100) == 0  # no gain, no rows


@pytest.mark.parametrize("desc", ["1.0:3b_64g", "0.25:4b_64g/0.75:3b_64g"])
def test_extra_bits_are_the_two_parts_less_the_one_table(desc):
    opt, shape, n = QuantOption.parse(desc), (1000, 128), 37
    up = stepped_up(opt)
    parts = up.storage_bits((n, 128)) + opt.storage_bits((1000 - n, 128)) + n * ID_BITS
    assert extra_bits(opt, n, shape) == parts - opt.storage_bits(shape) > 0
    assert extra_bits(QuantOption.parse("1.0:8b_64g"), n, shape) == 0


def _split_of(table: mx.array, ids: np.ndarray, bits: tuple[int, int] | None) -> RowSplitEmbedding:
    """The split of ``table`` into float parts, or (``bits``: hot, cold) stock quantized ones."""
    cold_ids = np.setdiff1d(np.arange(table.shape[0]), ids)
    parts = []
    for rows, b in zip((ids, cold_ids), bits or (None, None)):
        emb = nn.Embedding(len(rows), table.shape[1])
        emb.weight = table[mx.array(rows)]
        parts.append(emb if b is None else emb.to_quantized(group_size=64, bits=b))
    return RowSplitEmbedding(parts[0], parts[1], mx.array(ids.astype(np.int32)))


@pytest.mark.parametrize("bits", [None, (6, 3)])
def test_split_table_looks_up_and_projects_as_one_table(bits):
    rng = np.random.default_rng(0)
    table = mx.array(rng.standard_normal((50, 64)).astype(np.float32))
    ids = np.array([2, 3, 11, 40, 49])
    split = _split_of(table, ids, bits)
    assert split.num_embeddings == 50
    full = evaluate.dequantize_model(_split_of(table, ids, bits)) if bits else split
    whole = full.table()  # the table the parts hold, in id order
    manual = mx.concatenate([full.hot.weight, full.cold.weight])[mx.array(np.argsort(
        np.concatenate([ids, np.setdiff1d(np.arange(50), ids)])))]
    np.testing.assert_array_equal(np.array(whole), np.array(manual))
    if bits is None:
        np.testing.assert_array_equal(np.array(whole), np.array(table))
    q = mx.array([[0, 2, 49, 7], [40, 40, 1, 3]])
    np.testing.assert_allclose(np.array(split(q).astype(mx.float32)), np.array(whole[q]), rtol=1e-3, atol=1e-3)
    x = mx.array(rng.standard_normal((2, 3, 64)).astype(np.float32))
    np.testing.assert_allclose(np.array(split.as_linear(x).astype(mx.float32)), np.array(x @ whole.T),
                               rtol=1e-3, atol=2e-2)
    if bits:  # the hot rows are the finer ones
        err = np.abs(np.array(whole) - np.array(table)).mean(axis=1)
        assert err[ids].mean() < 0.3 * np.delete(err, ids).mean()


def _plan(option: str, scope: str = "budget") -> Plan:
    entries = [PlanEntry("layers.0.w", "1.0:3b_64g", 3584, [64, 128], 8192),
               PlanEntry("embed", option, QuantOption.parse(option).storage_bits((1000, 128)), [1000, 128], 128000,
                         scope=scope)]
    used = sum(e.bits for e in entries)
    return Plan(target_bpw=3.6, achieved_bpw=used / 136192, objective=0.0, lower_bound=None, gap=None,
                budget_bits=int(3.6 * 136192), used_bits=used, numel=136192, total_bpw=used / 136192, tensors=entries)


def _table_measured_at_two_options():
    """A measurement of the table "embed" at 3 bits (error 0.5) and 5 bits (0.1), and one hot row's extra bits."""
    from types import SimpleNamespace
    opts = [SimpleNamespace(option=QuantOption.parse(d), err=e, damage=None)
            for d, e in (("1.0:3b_64g", 0.5), ("1.0:5b_64g", 0.1))]
    n = HOT["embed"].counts.size
    return (SimpleNamespace(tensors={"embed": SimpleNamespace(importance=1.0, options=opts)}),
            extra_bits(QuantOption.parse("1.0:3b_64g"), n, (1000, 128)) / n)


def test_row_splits_price_the_rows_with_the_plans_error_power():
    """The rows' gain is the damage the optimizer saw: ``importance * err ** err_power`` with the plan's power."""
    m, row_bits = _table_measured_at_two_options()
    price = 6e-4 / row_bits  # the rarest rows (share 0.002) repay a gain of 0.4 (power 1), not one of 0.24 (power 2)
    got = {}
    for power in (1.0, 2.0):
        p = _plan("1.0:3b_64g")
        p.multiplier, p.settings = price, {"err_power": power}
        got[power] = row_splits(p, HOT, m)["embed"]["rows"]
        assert got[power] == rows_worth_it(HOT["embed"], 0.5**power - 0.1**power, price, row_bits)
    assert (got[1.0], got[2.0]) == (40, 3)


def test_row_splits_price_the_rows_at_the_plans_head_weight():
    """The rows' gain is weighted as the optimizer weighted the table's damage (``head_damage_weight``); a plan
    that records no weight (older files) counts it whole."""
    m, row_bits = _table_measured_at_two_options()
    price = 1e-2 / row_bits  # rows of share >= 0.042 repay the whole gain (0.24), >= 0.083 half of it
    got = {}
    for weight in (None, 1.0, 0.5):
        p = _plan("1.0:3b_64g")
        p.multiplier, p.settings = price, {"err_power": 2.0, **({} if weight is None else {"head_damage_weight": weight})}
        got[weight] = row_splits(p, HOT, m)["embed"]["rows"]
        assert got[weight] == rows_worth_it(HOT["embed"], (weight or 1.0) * (0.5**2 - 0.1**2), price, row_bits)
    assert (got[None], got[1.0], got[0.5]) == (3, 3, 2)


def test_row_splits_need_a_budget_table_with_room_to_step_up():
    assert row_splits(_plan("1.0:3b_64g"), HOT)["embed"]["rows"] == 40  # no measurement: every candidate row
    assert row_splits(_plan("1.0:3b_64g", scope="head"), HOT) == {}  # a fixed head option stays as given
    assert row_splits(_plan("1.0:8b_64g"), HOT) == {}
    assert row_splits(_plan("1.0:3b_64g"), {"embed": HotRows(np.array([], dtype=int), 0)}) == {}


def test_cold_rows_notes_name_a_lookup_table_planned_below_3_5_bpw():
    """Rows outside the frequent ones below mlx-lm's 3-bit g64 get one line saying how many and what to do."""
    p = _plan("1.0:2b_64g")
    p.settings = {"row_split": {"embed": {"option": "1.0:4b_64g", "rows": 40, "extra_bits": 1}}}
    (note,) = cold_rows_notes(p, {"embed"})
    assert note.startswith("embed: 960 of its 1,000 rows (all but the 40 frequent tokens')")
    assert "2.50 bpw (1.0:2b_64g)" in note and "--calib" in note
    (note,) = cold_rows_notes(_plan("1.0:2b_64g"), {"embed"})  # no frequent rows: every row
    assert note.startswith("embed: all 1,000 rows are stored at 2.50 bpw")
    assert cold_rows_notes(_plan("1.0:3b_64g"), {"embed"}) == []  # 3.5 bpw
    assert cold_rows_notes(_plan("1.0:2b_64g"), set()) == []  # not a lookup table


def test_splits_that_do_not_fit_are_left_out_with_a_note():
    p, notes = _plan("1.0:3b_64g"), []

    def no_room(target: float) -> Plan:
        raise ValueError(f"{target:.3f} bpw is below the smallest achievable size")

    p.budget_bits = p.used_bits  # nothing left for the rows
    assert with_row_splits(p, HOT, no_room, notes) is p
    assert "settings" not in p.settings and "frequent-token rows left out" in notes[0]


def test_replanning_frees_the_rows_bits_even_when_plans_leave_slack():
    p, notes, asked = _plan("1.0:3b_64g"), [], []

    def slack(target: float) -> Plan:  # like the optimizer: at or a little under the budget it is given
        asked.append(target)
        q = _plan("1.0:3b_64g")
        q.budget_bits = int(target * q.numel)
        q.used_bits = min(q.used_bits, q.budget_bits - 100)
        return q

    p.used_bits = p.budget_bits - 100
    extra = row_splits(p, HOT)["embed"]["extra_bits"]
    got = with_row_splits(p, HOT, slack, notes)
    assert not notes and got.settings["row_split"]["embed"]["rows"] == 40
    assert got.used_bits <= p.budget_bits and got.target_bpw == p.target_bpw
    assert asked == [pytest.approx((p.budget_bits - extra) / p.numel)]


def test_planned_rows_keep_the_plan_count_under_other_calibration():
    p = _plan("1.0:3b_64g")
    p.settings = {"row_split": {"embed": {"option": "1.0:5b_64g", "rows": 2, "extra_bits": 0}}}
    ids, opt = planned_row_splits(p, np.array([[4, 4, 4, 9, 9, 1]]))["embed"]
    assert ids.tolist() == [4, 9] and opt.desc == "1.0:5b_64g"


def _convert(src: Path, out: Path, **kw) -> dict:
    grid = out.parent / "grid.json"
    grid.write_text(json.dumps({"roles": {"default": GRID}}))
    return convert(str(src), out, bpw=2.7, measure_kwargs={"grid": str(grid), "rows": 4, "seq_len": 32}, **kw,
                   **CALIB)


def test_convert_plans_writes_and_loads_frequent_rows_within_the_target(tiny_qwen2, tmp_path):
    manifest = _convert(tiny_qwen2, tmp_path / "out")
    out = tmp_path / "out"
    plan = json.loads((out / "plan.json").read_text())
    split = plan["settings"]["row_split"]["model.embed_tokens"]
    assert manifest["row_split_modules"] == {"model.embed_tokens": {"rows": split["rows"]}}
    mods = manifest["modules"]
    assert mods["model.embed_tokens.hot"]["option"] == split["option"] == stepped_up(
        QuantOption.parse(mods["model.embed_tokens.cold"]["option"])).desc
    assert manifest["tied"] == {"lm_head": "model.embed_tokens"}
    cold = QuantOption.parse(mods["model.embed_tokens.cold"]["option"])  # a note only for cold rows below 3.5 bpw
    notes = [n for n in manifest["provenance"]["checks"] if n.startswith("model.embed_tokens: ")]
    assert len(notes) == (cold.nominal_bpw() < 3.5)
    acc = manifest["accounting"]
    assert acc["average_bits"] <= 2.7 and acc["predicted_bytes"] == acc["array_bytes"]
    assert plan["achieved_bpw"] == pytest.approx(acc["average_bits"])

    model, _ = mlx_dq.load(out)
    assert isinstance(model.model.embed_tokens, RowSplitEmbedding)
    assert evaluate.bits_per_weight(model) == pytest.approx(acc["average_bits"])
    remote, _ = mlx_lm.load(str(out), model_config={}, trust_remote_code=True)
    np.testing.assert_array_equal(np.array(model(TOKENS)), np.array(remote(TOKENS)))
    in_memory, _ = quantize_model(str(tiny_qwen2), out / "plan.json", rows=4, seq_len=32)  # the plan's rows too
    assert isinstance(in_memory.model.embed_tokens, RowSplitEmbedding)
    np.testing.assert_array_equal(np.array(in_memory(TOKENS)), np.array(model(TOKENS)))

    plain = _convert(tiny_qwen2, tmp_path / "plain", frequent_rows=False)
    assert plain["row_split_modules"] == {} and "model.embed_tokens" in plain["modules"]


def test_cli_refuses_to_ignore_no_frequent_rows_with_a_plan(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text("{}")
    res = CliRunner().invoke(main, ["convert", "--model", "x", "--plan", str(plan), "--no-frequent-rows",
                                    "-o", str(tmp_path / "o")])
    assert res.exit_code != 0 and "--no-frequent-rows" in res.output
