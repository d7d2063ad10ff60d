"""Seconds per decoder layer (forward, options, importance) and for the head when measuring the bundled model.

Measures the first ``--layers`` decoder layers of SmolLM2-135M (written to a
temporary folder) with the measurement defaults, once per ``--sample-rows``
value, and prints the per-stage seconds from the measurement's own timing
record plus the process CPU time. Compare revisions by running it on each.

Run:
    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/measure_speed.py --layers 2 --sample-rows 0,256 [--rows 32]
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from distributed import truncated_model  # noqa: E402  (the sibling benchmark's model cutter)

from mlx_dq.measure.stream import measure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="Decoder layers of the bundled model to measure.")
    ap.add_argument("--sample-rows", default="0,256", help="Comma-separated sample_rows values (0: every row).")
    ap.add_argument("--rows", type=int, default=16, help="Calibration rows (convert's own measurement uses 32).")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--grid", default=None, help="Option grid (default: the built-in default grid).")
    args = ap.parse_args()
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start")
    with tempfile.TemporaryDirectory() as tmp:
        model = truncated_model(args.layers, Path(tmp) / "model")
        for n in (int(x) for x in args.sample_rows.split(",")):
            t, c = time.perf_counter(), time.process_time()
            m = measure(model, out_path=None, progress=False, rows=args.rows, seq_len=args.seq_len, grid=args.grid,
                        sample_rows=n)
            wall, cpu = time.perf_counter() - t, time.process_time() - c
            tm = m.extra["timing"]
            k = len(tm["layers_s"])

            def mean(key: str) -> float:
                return sum(tm[key]) / k

            print(f"sample_rows={n}: per decoder layer {mean('layers_s'):.1f} s (forward {mean('forward_s'):.1f}, "
                  f"options {mean('options_s'):.1f}, importance {mean('importance_s'):.1f}); "
                  f"head and embedding {tm['total_s'] - sum(tm['layers_s']):.1f} s; "
                  f"whole run {wall:.1f} s wall, {cpu:.1f} s CPU ({args.layers} layers, {args.rows} x {args.seq_len})",
                  flush=True)


if __name__ == "__main__":
    main()
