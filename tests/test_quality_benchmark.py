"""benchmarks/quality.py: one model built once and scored on several texts, with the goal check per text."""

from __future__ import annotations

import csv
import math
import sys

import pytest
from click.testing import CliRunner
from script_loader import load_script


@pytest.fixture(scope="module")
def quality():
    yield load_script("benchmarks/quality.py", "quality_benchmark")
    sys.modules.pop("quality_benchmark", None)


def _row(text, family, method, bpw, kl):
    return {"text": text, "family": family, "method": method, "bpw": str(bpw), "kl": str(kl)}


def _rows(dq35: float, dq4: float, g64: float, gptq: float, awq: float, text: str = "t") -> list[dict]:
    return [_row(text, "mlx-dq", "mlx-dq @3.5", 3.5, dq35), _row(text, "mlx-dq", "mlx-dq @4", 4.0, dq4),
            _row(text, "mlx-lm uniform", "mlx-lm 4-bit g64", 4.5, g64),
            _row(text, "mlx-lm uniform", "mlx-lm 4-bit g64x", 4.5, 0.001),  # another name: not the anchor
            _row(text, "mlx-lm GPTQ", "mlx-lm GPTQ 4-bit g64, embedding 6-bit g64 (its defaults)", 4.9, gptq),
            _row(text, "mlx-lm AWQ", "mlx-lm AWQ 4-bit g64, embedding 4-bit g32 (its defaults)", 4.7, awq)]


def test_goal_status_compares_the_right_rows(quality):
    status = {(g["target"], g["family"]): g for g in quality.goal_status(_rows(0.3, 0.2, 0.4, 0.25, 0.22))}
    g35, g4 = status[(3.5, "mlx-dq")], status[(4.0, "mlx-dq")]
    assert g35["met"] is True and g35["lm"]["method"] == "mlx-lm 4-bit g64"
    assert g4["met"] is True and g4["lm"]["method"].startswith("mlx-lm AWQ")  # the better calibrated method
    assert (3.5, "mlx-dq --mlx-lm-compatible") not in status  # a family that was not run at all
    compat = _rows(0.3, 0.2, 0.4, 0.25, 0.22) + [_row("t", "mlx-dq --mlx-lm-compatible", "mlx-dq --mlx-lm-compatible @4",
                                                      4.0, 0.3)]
    status = {(g["target"], g["family"]): g for g in quality.goal_status(compat)}
    assert status[(3.5, "mlx-dq --mlx-lm-compatible")]["met"] is None  # its 3.5 row is missing
    assert status[(4.0, "mlx-dq --mlx-lm-compatible")]["met"] is False
    above = _rows(0.3, 0.2, 0.4, 0.25, 0.22) + [_row("t", "mlx-lm GPTQ", "mlx-lm GPTQ 4-bit g64, embedding 8-bit", 5.75, 0.1)]
    status = {(g["target"], g["family"]): g for g in quality.goal_status(above)}
    assert status[(4.0, "mlx-dq")]["lm"]["method"].startswith("mlx-lm AWQ")  # 5.75 bpw is not a 4-bit method's range
    missed = {(g["target"], g["family"]): g for g in quality.goal_status(_rows(0.5, 0.23, 0.4, 0.25, 0.22))}
    assert missed[(3.5, "mlx-dq")]["met"] is False and missed[(4.0, "mlx-dq")]["met"] is False


def test_worst_text_is_the_one_with_the_highest_ratio(quality):
    rows = _rows(0.30, 0.2, 0.4, 0.25, 0.22, "a") + _rows(0.39, 0.2, 0.4, 0.25, 0.22, "b") \
        + _rows(0.10, 0.2, 0.4, 0.25, 0.22, "c")
    assert quality.worst_text(rows) == "b"
    assert quality.worst_text(rows[:2]) is None


def test_benchmark_scores_each_row_on_each_text(quality, tiny_llama, tmp_path):
    out = tmp_path / "q"
    args = ["--model", str(tiny_llama), "--texts", "pydoc,dialog", "--rows", "2", "--seq-len", "32",
            "--batch-size", "2", "--calib-rows", "2", "--calib-seq-len", "32", "--lm-calib-rows", "4",
            "--lm-calib-seq-len", "32", "--bpw", "4", "--rtn-targets", "", "--dq-modes", "mixed",
            "--dq-calib-rows", "4", "--dq-calib-seq-len", "32", "--dq-measure-method", "rtn", "--dq-grid", "fast",
            "--select", r"^mlx-lm 4-bit g64$|GPTQ .*its defaults|AWQ .*its defaults|^mlx-dq @4$",
            "--label", "Partial result: test run", "--out", str(out)]
    result = CliRunner().invoke(quality.main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with (out / "quality.csv").open() as f:
        rows = list(csv.DictReader(f))
    by = {(r["text"], r["method"]): r for r in rows}
    methods = {r["method"] for r in rows}
    assert len(methods) == 5, methods  # source + 4 selected rows, nothing else built
    for text in ("pydoc", "dialog"):
        for m in methods:
            assert (text, m) in by
        assert float(by[(text, "mlx-dq @4")]["bpw"]) <= 4.0 + 1e-9
        assert float(by[(text, "mlx-lm 4-bit g64")]["bpw"]) == pytest.approx(4.5)
        for m in methods - {"source (float32)"}:
            assert math.isfinite(float(by[(text, m)]["kl"])) and float(by[(text, m)]["kl"]) > 0
    # a model is built once: the same bpw on both texts, but scored differently on each
    for m in methods:
        assert by[("pydoc", m)]["bpw"] == by[("dialog", m)]["bpw"]
    assert by[("pydoc", "mlx-lm 4-bit g64")]["kl"] != by[("dialog", "mlx-lm 4-bit g64")]["kl"]
    md = (out / "quality.md").read_text()
    assert "**Partial result: test run**" in md
    assert "## Text: pydoc" in md and "## Text: dialog" in md
    summary, tables = md.split("## Text: ", 1)  # the summary of every goal comes first, then one section per text
    assert "Goals per text, worst text first" in summary
    assert tables.count("| 4 bpw vs mlx-lm's best 4-bit calibrated method (GPTQ, AWQ or DWQ, at most 5 bpw) | mlx-dq @4 |") == 2
    for text in ("pydoc", "dialog"):  # the summary: one row per text and goal
        assert summary.count(f"| {text} | 4 bpw vs mlx-lm's best 4-bit calibrated method (GPTQ, AWQ or DWQ, at most 5 bpw) | mlx-dq @4 |") == 1
    ratio = {t: float(by[(t, "mlx-dq @4")]["kl"]) / min(float(r["kl"]) for (tt, m), r in by.items()
                                                      if tt == t and ("GPTQ" in m or "AWQ" in m))
             for t in ("pydoc", "dialog")}
    assert f"over the goals): `{max(ratio, key=ratio.get)}`" in md
    assert (out / "quality.png").stat().st_size > 0
    # resumed: nothing is rebuilt, the report is the same rows
    again = CliRunner().invoke(quality.main, args, catch_exceptions=False)
    assert again.exit_code == 0 and "[pydoc]" not in again.output


def test_unknown_text_is_refused(quality, tmp_path):
    result = CliRunner().invoke(quality.main, ["--texts", "poetry", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "unknown evaluation text 'poetry'" in result.output


def test_plots_read_one_text_of_a_multi_text_table(tmp_path):
    from mlx_dq.evaluation import plots

    path = tmp_path / "q.csv"
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["text", "family", "method", "bpw", "kl"])
        w.writeheader()
        for text, kl in (("pydoc", 0.1), ("dialog", 0.3)):
            w.writerow({"text": text, "family": "mlx-lm uniform", "method": "mlx-lm 4-bit g64", "bpw": 4.5, "kl": kl})
    rows = plots.read_quality_table(path)
    assert [(r["method"], r["kl"]) for r in rows] == [("mlx-lm 4-bit g64", 0.1)]


def test_goal_summary_orders_texts_worst_first(quality):
    rows = _rows(0.30, 0.2, 0.4, 0.25, 0.22, "a") + _rows(0.50, 0.2, 0.4, 0.25, 0.22, "b") \
        + _rows(0.10, 0.2, 0.4, 0.25, 0.22, "c")
    lines = quality.goal_summary(rows)
    body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith("| text")]
    assert [ln.split(" | ")[0][2:] for ln in body[::2]] == ["b", "a", "c"]  # two goals per text
    assert "| **no** |" in body[0] and body[0].endswith("| 1.25 | **no** |")  # b at 3.5: 0.50 / 0.40
    assert body[1].endswith("| yes |") and "mlx-lm AWQ" in body[1]  # 0.2 <= the better calibrated row, 0.22
    assert quality.goal_summary([_row("t", "mlx-lm uniform", "mlx-lm 4-bit g64", 4.5, 0.4)])[-1].endswith("not run |")
    assert quality.goal_summary([]) == []


def test_distilled_rows_join_the_goals_beside_the_undistilled_ones(quality):
    plain = _rows(0.5, 0.2, 0.4, 0.25, 0.22)
    assert all(g["family"] != quality.DISTILL_FAMILY for g in quality.goal_status(plain))  # not run: not shown
    rows = plain + [_row("t", quality.DISTILL_FAMILY, f"{quality.DISTILL_FAMILY} @3.5", 3.5, 0.36)]
    status = {(g["target"], g["family"]): g for g in quality.goal_status(rows)}
    assert status[(3.5, "mlx-dq")]["met"] is False and status[(3.5, quality.DISTILL_FAMILY)]["met"] is True
    assert (4.0, quality.DISTILL_FAMILY) not in status  # no distilled row at 4.0
    body = [ln for ln in quality.goal_summary(rows) if ln.startswith("| t |")]
    assert [ln.split(" | ")[2] for ln in body] == ["mlx-dq @3.5", f"{quality.DISTILL_FAMILY} @3.5", "mlx-dq @4"]
    assert quality.worst_text(rows) == "t"


def test_distilled_row_is_built_and_scored_on_each_text(quality, tiny_llama, tmp_path):
    out = tmp_path / "q"
    args = ["--model", str(tiny_llama), "--texts", "pydoc,dialog", "--rows", "2", "--seq-len", "32",
            "--batch-size", "2", "--bpw", "4", "--rtn-targets", "", "--dq-modes", "mixed", "--dq-calib-rows", "4",
            "--dq-calib-seq-len", "32", "--dq-measure-method", "rtn", "--dq-grid", "fast", "--only", "mlx-dq",
            "--distill-targets", "4", "--distill-steps", "3", "--distill-rows", "2", "--distill-seq-len", "16",
            "--out", str(out)]
    result = CliRunner().invoke(quality.main, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    with (out / "quality.csv").open() as f:
        by = {(r["text"], r["method"]): r for r in csv.DictReader(f)}
    name = f"{quality.DISTILL_FAMILY} @4"
    for text in ("pydoc", "dialog"):
        d, p = by[(text, name)], by[(text, "mlx-dq @4")]
        assert d["family"] == quality.DISTILL_FAMILY and d["bpw"] == p["bpw"]  # same codes, same bits
        assert d["kl"] != p["kl"] and "3 steps, 2 x 16" in d["notes"]
    assert "distilled in" in result.output
    md = (out / "quality.md").read_text()
    assert f"| {name} |" in md.split("## Text: ", 1)[0]  # in the goal summary


def test_distill_options_need_distill_targets(quality, tmp_path):
    result = CliRunner().invoke(quality.main, ["--distill-steps", "3", "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--distill-steps apply to distilled rows only" in result.output


def test_streamed_reference_scores_the_same(quality, tiny_llama, tmp_path):
    """--stream-reference (the source recomputed beside each model, for large vocabularies) gives the same rows."""
    base = ["--model", str(tiny_llama), "--texts", "pydoc", "--rows", "2", "--seq-len", "32", "--batch-size", "1",
            "--only", "mlx-lm", "--select", r"^mlx-lm 4-bit g64$"]
    rows = {}
    for flag in ("--keep-reference", "--stream-reference"):
        out = tmp_path / flag.strip("-")
        result = CliRunner().invoke(quality.main, base + [flag, "--out", str(out)], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        with (out / "quality.csv").open() as f:
            rows[flag] = {r["method"]: r for r in csv.DictReader(f)}
    kept, streamed = rows["--keep-reference"], rows["--stream-reference"]
    assert set(kept) == set(streamed) == {"source (float32)", "mlx-lm 4-bit g64"}
    for m in kept:
        for key in ("kl", "top1", "perplexity", "bpw"):
            assert float(streamed[m][key]) == pytest.approx(float(kept[m][key]), rel=1e-4, abs=1e-7)
    assert float(streamed["mlx-lm 4-bit g64"]["kl"]) > 0


def test_reduced_calibration_is_in_the_calibrated_rows_names(quality):
    assert quality.calibration_suffix(*quality.LM_CALIB) == ""  # the usual calibration: names as before
    assert quality.calibration_suffix(8, 256) == ", calibrated on 8 x 256 tokens"
    assert quality.calibration_suffix(32, 256) != quality.calibration_suffix(8, 512)
    rows = [{"family": "mlx-lm GPTQ", "method": "mlx-lm GPTQ a", "notes": "calibrated on 16 x 512 tokens"},
            {"family": "mlx-lm AWQ", "method": "mlx-lm AWQ b, calibrated on 8 x 256 tokens",
             "notes": "calibrated on 8 x 256 tokens"},
            {"family": "mlx-lm uniform", "method": "mlx-lm 4-bit g64", "notes": "not calibrated"}]
    note = quality.calibrated_note(rows, 32, 512)
    assert "mlx-lm GPTQ a: calibrated on 16 x 512 tokens" in note  # each row's own, not this run's 32 x 512
    assert "mlx-lm AWQ b, calibrated on 8 x 256 tokens: calibrated on 8 x 256 tokens" in note
    assert "32 rows" not in note and "4-bit g64:" not in note
    assert "32 rows x 512 tokens" in quality.calibrated_note(rows[2:], 32, 512)  # none in the table: this run's


def test_mlx_dq_rows_can_be_planned_from_a_saved_measurement(quality, tiny_llama, tmp_path):
    base = ["--model", str(tiny_llama), "--texts", "pydoc", "--rows", "2", "--seq-len", "32", "--batch-size", "2",
            "--bpw", "4", "--rtn-targets", "", "--dq-modes", "mixed", "--dq-calib-rows", "4", "--dq-calib-seq-len",
            "32", "--dq-measure-method", "rtn", "--dq-grid", "fast", "--only", "mlx-dq"]
    first = CliRunner().invoke(quality.main, base + ["--out", str(tmp_path / "a")], catch_exceptions=False)
    assert first.exit_code == 0, first.output
    saved = next((tmp_path / "a" / "cache").glob("*.measurement.rtn.*.json"))
    args = base + ["--dq-measurement", str(saved), "--out", str(tmp_path / "b")]
    again = CliRunner().invoke(quality.main, args, catch_exceptions=False)
    assert again.exit_code == 0, again.output
    assert "saved, not measured again" in again.output and not (tmp_path / "b" / "cache").exists()
    rows = {}
    for d in ("a", "b"):
        with (tmp_path / d / "quality.csv").open() as f:
            rows[d] = {r["method"]: r for r in csv.DictReader(f)}
    a, b = rows["a"]["mlx-dq @4"], rows["b"]["mlx-dq @4"]
    assert float(b["kl"]) == pytest.approx(float(a["kl"]), rel=1e-5) and b["bpw"] == a["bpw"]  # the same plan
    assert saved.name in b["notes"] and saved.name not in a["notes"]
    assert f"planned from the saved measurement `{saved.name}`" in (tmp_path / "b" / "quality.md").read_text()
    # a file that is not a measurement, or one of another model, is refused before anything runs
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    for path, msg in ((bad, "not a readable measurement"), ):
        result = CliRunner().invoke(quality.main, base + ["--dq-measurement", str(path), "--out", str(tmp_path / "c")])
        assert result.exit_code == 2 and msg in result.output, result.output
    other = tmp_path / "other.json"
    other.write_text(saved.read_text().replace(str(tiny_llama), "another-model"))
    result = CliRunner().invoke(quality.main, base + ["--dq-measurement", str(other), "--out", str(tmp_path / "c")])
    assert result.exit_code == 2 and "measures 'another-model'" in result.output, result.output
