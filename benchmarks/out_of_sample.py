"""The out-of-sample table: every (model, text) pair of several quality runs, worst ratio first, with leave-one-out.

Reads the ``quality.csv`` of one ``benchmarks/quality.py`` run per model and, for each (model, text) pair, the
goals' ratios (mlx-dq KL / mlx-lm KL): 3.5 bpw against mlx-lm 4-bit g64, 4.0 bpw against mlx-lm's best calibrated
4-bit row. Texts the defaults were tuned on (``--tuned``) are marked; the others are out of sample. When the runs
hold more than one mlx-dq variant (e.g. with and without ``--distill``), the leave-one-domain-out figure picks, for
each text, the variant with the lowest worst ratio on the OTHER texts (every model) and reports its ratio on the
held-out text: what choosing a default among those variants would give on a domain nobody tuned on.

    python benchmarks/out_of_sample.py --run smollm2-135m=results/oos_smollm2 --run gemma3-270m=results/oos_gemma \\
        --tuned pydoc,shakespeare,dialog -o results/out_of_sample.md
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import click
import quality

GOAL_RATIO = 0.9  # the goal: mlx-dq's KL at most 0.9x the mlx-lm row's


def read_runs(runs: dict[str, list[Path]]) -> dict[tuple[str, str], list[dict]]:
    """(model, text) -> that text's rows of the model's quality.csv files (one model may have several runs; a row of
    a later run replaces an earlier run's row of the same method, so a re-run row is listed after the run it mends)."""
    out: dict[tuple[str, str], dict[str, dict]] = {}
    for model, folders in runs.items():
        for folder in folders:
            path = folder / "quality.csv" if folder.is_dir() else folder
            with path.open(newline="") as f:
                for r in csv.DictReader(f):
                    out.setdefault((model, r["text"]), {})[r["method"]] = r
    return {k: list(v.values()) for k, v in out.items()}


def ratios(rows: list[dict]) -> dict[tuple[float, str], tuple[float, dict, dict]]:
    """(goal target, mlx-dq family) -> (ratio, mlx-dq row, mlx-lm row) for every goal with both rows present."""
    out = {}
    for g in quality.goal_status(rows):
        if g["dq"] and g["lm"]:
            out[(g["target"], g["family"])] = (float(g["dq"]["kl"]) / float(g["lm"]["kl"]), g["dq"], g["lm"])
    return out


def leave_one_out(table: dict[tuple[str, str], dict], target: float) -> list[tuple[str, str, str, float]]:
    """For each (model, text): the family with the lowest worst ratio on the other texts, and its ratio there."""
    out = []
    texts = {t for _, t in table}
    for (model, text), fams in sorted(table.items()):
        candidates = [f for (tg, f) in fams if tg == target]
        if not candidates:
            continue

        def worst_elsewhere(fam: str) -> float:
            vals = [v[(target, fam)][0] for (m, t), v in table.items() if t != text and (target, fam) in v]
            return max(vals) if vals and len(texts) > 1 else math.inf

        pick = min(candidates, key=worst_elsewhere)
        out.append((model, text, pick, fams[(target, pick)][0]))
    return sorted(out, key=lambda x: -x[3])


def render(table: dict[tuple[str, str], dict], tuned: set[str], runs: dict[str, list[Path]]) -> list[str]:
    """Markdown lines of the report."""
    lines = ["# Out of sample: mlx-dq against mlx-lm on every model and text, worst first", "",
             f"Goal: ratio = mlx-dq KL / mlx-lm KL <= {GOAL_RATIO} at 3.5 bpw against mlx-lm 4-bit g64 (4.5 bpw) and "
             "at 4.0 bpw against mlx-lm's best calibrated 4-bit row (GPTQ, AWQ or DWQ, at most 5 bpw). Texts marked "
             f"'tuned' ({', '.join(sorted(tuned)) or 'none'}) were looked at when the defaults were chosen; every "
             "other text is out of sample. Runs: " + "; ".join(f"{m}: " + ", ".join(f"`{p}`" for p in ps)
                                                      for m, ps in runs.items()) + ".", ""]
    flat = [(m, t, tg, fam, r, dq, lm) for (m, t), v in table.items() for (tg, fam), (r, dq, lm) in v.items()]
    flat.sort(key=lambda x: -x[4])
    out_of_sample = [x for x in flat if x[1] not in tuned and x[3] == "mlx-dq"]
    if out_of_sample:
        m, t, tg, fam, r, dq, lm = out_of_sample[0]
        lines += [f"**Worst out-of-sample pair with the defaults: {m} on {t}, {tg:g} bpw: ratio {r:.2f}** "
                  f"({dq['method']} KL {float(dq['kl']):.4f} vs {lm['method']} KL {float(lm['kl']):.4f}).", ""]
    lines += ["| model | text | sample | goal | mlx-dq row | KL | mlx-lm row | KL | ratio | <= 0.9 |",
              "|---|---|---|---|---|---:|---|---:|---:|---|"]
    for m, t, tg, fam, r, dq, lm in flat:
        lines.append(f"| {m} | {t} | {'tuned' if t in tuned else 'held out'} | {tg:g} | {dq['method']} | "
                     f"{float(dq['kl']):.4f} | {lm['method']} | {float(lm['kl']):.4f} | {r:.2f} | "
                     f"{'yes' if r <= GOAL_RATIO else '**no**'} |")
    families = {x[3] for x in flat}
    if len(families) > 1:
        lines += ["", "Leave one domain out: for each held-out text, the mlx-dq variant whose worst ratio on the "
                  "other texts (all models) is lowest, and its ratio on the held-out text.", "",
                  "| goal | model | held-out text | variant chosen on the others | ratio |", "|---|---|---|---|---:|"]
        for tg in sorted({x[2] for x in flat}):
            for m, t, pick, r in leave_one_out(table, tg):
                lines.append(f"| {tg:g} | {m} | {t} | {pick} | {r:.2f} |")
    return lines


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--run", "run_specs", multiple=True, required=True,
              help="MODEL=FOLDER of a quality.py run (or its CSV); repeat a model for several runs of it.")
@click.option("--tuned", default="pydoc,shakespeare,dialog", show_default=True,
              help="Texts the defaults were tuned on (marked; not out of sample).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, path_type=Path), required=True)
def main(run_specs: tuple[str, ...], tuned: str, output: Path) -> None:
    """Write the out-of-sample report of several quality.py runs."""
    runs: dict[str, list[Path]] = {}
    for spec in run_specs:
        model, sep, folder = spec.partition("=")
        if not sep:
            raise click.BadParameter(f"{spec!r}: expected MODEL=FOLDER", param_hint="--run")
        runs.setdefault(model, []).append(Path(folder))
    table = {k: ratios(v) for k, v in read_runs(runs).items()}
    table = {k: v for k, v in table.items() if v}
    if not table:
        raise click.ClickException("no (model, text) pair has both an mlx-dq goal row and its mlx-lm row")
    lines = render(table, {t for t in tuned.split(",") if t}, runs)
    output.write_text("\n".join(lines) + "\n")
    click.echo("\n".join(lines[:12]))


if __name__ == "__main__":
    main()
