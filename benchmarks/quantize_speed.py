"""Time quantize_weight on one 1536x576 and one 4096x4096 weight, with and without clip search.

Run: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
     python benchmarks/quantize_speed.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.options import QuantOption


def _weights(out_f: int, in_f: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Heavy-tailed weights and a Gram matrix of correlated inputs with uneven channel energy."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=(out_f, in_f)) * 0.02).astype(np.float32)
    x = (rng.standard_normal((2048, in_f)) * rng.lognormal(0, 1, in_f)).astype(np.float32)
    return mx.array(w), mx.array(x.T @ x)


def _time(fn, repeats: int) -> tuple[float, float]:
    """Best wall time and best process CPU time of ``fn`` over ``repeats`` runs (evaluating every array).

    CPU time (all threads) is reported too because the machine may be shared.
    """
    wall = cpu = float("inf")
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        qt = fn()
        mx.eval([a for part in qt.parts for a in part])
        wall, cpu = min(wall, time.perf_counter() - t), min(cpu, time.process_time() - c)
    return wall, cpu


def main() -> None:
    """Print one line per (shape, option, mode) with the best time in seconds."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    options = [QuantOption.parse(d) for d in ("1.0:4b_64g", "1.0:2b_64g", "0.1:4b_64g/0.9:3b_64g")]
    heads = ("no clip", "clip", "clip+gram", "clip+diag")
    print(f"{'shape':>11} {'option':<24} " + " ".join(f"{h:>15}" for h in heads))
    print(f"{'':>11} {'':<24} " + " ".join(f"{'wall/cpu s':>15}" for _ in heads) + f"  (best of {args.repeats})")
    for out_f, in_f in ((1536, 576), (4096, 4096)):
        w, gram = _weights(out_f, in_f)
        mx.eval(w, gram)
        for opt in options:
            cols = [
                _time(lambda: quantize_weight(w, opt, gram=gram, clip=False), args.repeats),
                _time(lambda: quantize_weight(w, opt, clip=True), args.repeats),
                _time(lambda: quantize_weight(w, opt, gram=gram, clip=True), args.repeats),
                _time(lambda: quantize_weight(w, opt, gram=gram, clip=True, clip_metric="diag"), args.repeats),
            ]
            print(f"{out_f:>5}x{in_f:<5} {opt.desc:<24} " + " ".join(f"{w:7.2f}/{c:<7.2f}" for w, c in cols))


if __name__ == "__main__":
    main()
