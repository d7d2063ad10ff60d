"""Peak memory of ``mlx_dq.measure.stream`` as the number of layers doubles.

Builds two synthetic llama models of the same width (hidden 1024 by default,
so the weights dominate), one with N layers and one with 2N, measures each in
its own subprocess and prints the weight bytes on disk and the child's peak
RSS (``ru_maxrss``). Streaming keeps one layer in memory, so the peak should
stay flat while the weights double.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/measure_memory.py [--layers 8] [--hidden 1024]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, resource, sys, time
from mlx_dq.measure.stream import measure
folder, grid, rows, seq_len = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
t = time.perf_counter()
m = measure(folder, grid=grid, rows=rows, seq_len=seq_len, progress=False)
print(json.dumps({"seconds": time.perf_counter() - t, "tensors": len(m.tensors),
                  "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


BUILD = """
import sys
import mlx.core as mx
sys.path.insert(0, sys.argv[4])
from fixtures_models import make_tiny_model_folder
h = int(sys.argv[3])
print(make_tiny_model_folder(sys.argv[1], "llama", num_layers=int(sys.argv[2]), hidden=h, intermediate=4 * h,
                             heads=h // 64, kv_heads=h // 256, dtype=mx.float16))
"""


def build(tmp: Path, layers: int, hidden: int) -> Path:
    """A random-weight llama folder (float16 on disk) with ``layers`` layers of width ``hidden``.

    Built in a subprocess: Linux carries a process's peak RSS across fork and
    exec, so this process must stay small for the measuring child's figure to be its own.
    """
    res = subprocess.run([sys.executable, "-c", BUILD, str(tmp), str(layers), str(hidden), str(ROOT / "tests")],
                         capture_output=True, text=True, check=True)
    return Path(res.stdout.strip().splitlines()[-1])


def main() -> None:
    """Build the two models, measure each in a subprocess and print a table."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8, help="layers of the smaller model (the other has twice as many)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        grid = tmp / "grid.json"
        grid.write_text(json.dumps({"description": "benchmark", "roles": {"default": ["1.0:3b_64g", "1.0:4b_64g"]}}))
        print(f"{'layers':>6} {'weights MB':>10} {'peak RSS MB':>11} {'seconds':>8}")
        for n in (args.layers, 2 * args.layers):
            folder = build(tmp, n, args.hidden)
            size = sum(f.stat().st_size for f in folder.glob("*.safetensors")) / 2**20
            t = time.perf_counter()
            res = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(grid), str(args.rows),
                                  str(args.seq_len)], capture_output=True, text=True, check=True)
            out = json.loads(res.stdout.strip().splitlines()[-1])
            print(f"{n:>6} {size * 2:>10.0f} {out['peak_rss_mb']:>11.0f} {time.perf_counter() - t:>8.1f}")
            print(f"{'':>6} (weights MB counts float32, as measured; {size:.0f} MB float16 on disk)")


if __name__ == "__main__":
    main()
