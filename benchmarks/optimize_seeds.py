"""Benchmark the optimizer on measurement files (by default the ExLlamaV2 seeds 000 and 001).

For each file and bpw target it prints the achieved bpw, the objective (sum of
importance * err^2), the LP lower bound, the gap and the wall time, next to a
single greedy pass and mlx-lm's dynamic_quant two-level rule (4/5 bits) on the
same measurement, at the same budget (the two levels are the adjacent bit widths
whose all-low / all-high plans bracket the target, 4/5 when both do).

    python benchmarks/optimize_seeds.py [FILE ...] [--targets 2.5 3.0 ...] [--json out.json]

FILE may be any measurement, e.g. one of the bundled model written by
``mlx_dq.measure.stream.measure("smollm2-135m", out_path=FILE)``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from baselines import dynamic_quant_threshold, greedy_single_pass

from mlx_dq.measure.records import load_measurement
from mlx_dq.plan.plan import Plan
from mlx_dq.plan.solver import optimize

SEEDS = Path(__file__).resolve().parents[2] / "shared" / "seeds"
TARGETS = (2.5, 3.0, 3.5, 4.0, 5.0)


def _run(fn, *args, **kw) -> tuple[Plan | None, float, str]:
    """Run one planner, returning its plan (or None and the error) and its wall time."""
    t0 = time.perf_counter()
    try:
        plan = fn(*args, **kw)
    except ValueError as e:
        return None, time.perf_counter() - t0, str(e)
    return plan, time.perf_counter() - t0, ""


def _two_level(m, target: float) -> tuple[Plan | None, str]:
    """mlx-lm's two-level rule with mlx-lm's default 4/5 bits, else the adjacent widths that bracket the target."""
    err = ""
    for low, high in ((4, 5), (2, 3), (3, 4), (5, 6), (6, 8)):
        plan, _, err = _run(dynamic_quant_threshold, m, target, low, high)
        if plan is not None:
            return plan, ""
    return None, err


def bench_file(path: Path, targets: list[float]) -> list[dict]:
    """Plan every target on one measurement file and print one row per target."""
    t0 = time.perf_counter()
    m = load_measurement(path)
    load_s = time.perf_counter() - t0
    n_items = len(m.tensors) - len(m.grouped_keys()) + len(m.groups)
    print(f"\n{path.name}: {m.source_format}, {len(m.tensors)} tensors, {n_items} knapsack items, load {load_s:.2f} s")
    print(f"{'target':>6} {'achieved':>9} {'objective':>11} {'bound':>11} {'gap':>9} {'gap%':>7} {'time s':>7} "
          f"{'method':>20} | {'greedy':>11} {'g.bpw':>7} | {'dyn-quant':>11} {'d.bpw':>7}")
    rows = []
    for target in targets:
        plan, wall, err = _run(optimize, m, target)
        greedy, _, _ = _run(greedy_single_pass, m, target)
        dq, dq_err = _two_level(m, target)
        if plan is None:
            print(f"{target:6.2f}  impossible: {err}")
            rows.append({"file": path.name, "target": target, "error": err})
            continue
        gap_pct = 100 * plan.gap / plan.objective if plan.objective else 0.0
        g = f"{greedy.objective:11.6g} {greedy.achieved_bpw:7.4f}" if greedy else f"{'n/a':>11} {'':>7}"
        d = f"{dq.objective:11.6g} {dq.achieved_bpw:7.4f}" if dq else f"{'n/a':>11} {'':>7}"
        print(f"{target:6.2f} {plan.achieved_bpw:9.4f} {plan.objective:11.6g} {plan.lower_bound:11.6g} "
              f"{plan.gap:9.3g} {gap_pct:7.4f} {wall:7.2f} {plan.method:>20} | {g} | {d}")
        ok = target - 0.02 <= plan.achieved_bpw <= target and wall < 5.0
        rows.append({
            "file": path.name, "target": target, "achieved_bpw": plan.achieved_bpw, "objective": plan.objective,
            "lower_bound": plan.lower_bound, "gap": plan.gap, "wall_s": wall, "method": plan.method,
            "greedy_objective": greedy.objective if greedy else None,
            "greedy_bpw": greedy.achieved_bpw if greedy else None,
            "dynamic_quant_objective": dq.objective if dq else None,
            "dynamic_quant_bpw": dq.achieved_bpw if dq else None, "dynamic_quant_note": dq_err or None,
            "dynamic_quant_levels": dq.settings.get("baseline") if dq else None,
            "meets_goal": ok,
        })
    return rows


def main() -> None:
    """Parse arguments, benchmark each file, optionally save the rows as JSON."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="*", type=Path, help="measurement files [default: seeds 000 and 001]")
    ap.add_argument("--targets", nargs="+", type=float, default=list(TARGETS))
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args()
    files = args.files or [p for pre in ("000", "001") for p in sorted(SEEDS.glob(f"{pre}_*.txt"))]
    if not files:
        ap.error(f"no measurement files given and no seeds found in {SEEDS}")
    rows = [r for f in files for r in bench_file(f, args.targets)]
    met = sum(bool(r.get("meets_goal")) for r in rows)
    print(f"\n{met}/{len(rows)} runs within 0.02 bpw below target and under 5 s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
