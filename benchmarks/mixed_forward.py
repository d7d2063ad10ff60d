"""Forward time of a mixed 10%/90% layer relative to a uniform layer on the portable path.

Run (Linux CPU): LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
    python benchmarks/mixed_forward.py [--json out.json]

For each shape and batch it times repeated calls, interleaved; the goal is judged on
the median over repetitions of (mixed call time / the neighbouring uniform call),
which cancels slow load swings of a shared machine; fastest calls are shown too:
  mixed    MixedLinear "0.1:4b_32g/0.9:3b_32g" (cached fp32 weight, permutation folded in)
  uniform  MixedLinear "1.0:4b_32g" (same path, one segment, no permutation)   <- the 1.15x goal
  xperm    alternative: permute x per call, one matmul on the concatenated segments
  fp32     nn.Linear with the dequantized weight (the floor)
and once: the first call (cache build) and MLX's own QuantizedLinear (CPU quantized_matmul).
"""

from __future__ import annotations

import json
import statistics
import time

import click
import mlx.core as mx
import mlx.nn as nn

from mlx_dq.layers import kernels
from mlx_dq.layers.mixed import MixedLinear
from mlx_dq.quant.affine import quantize_weight
from mlx_dq.quant.options import QuantOption

SHAPES = [(576, 1536), (1536, 576), (4096, 4096)]
BATCHES = [1, 512]
MIXED, UNIFORM = "0.1:4b_32g/0.9:3b_32g", "1.0:4b_32g"
GOAL = 1.15


def _time_once(fn, x: mx.array) -> float:
    t0 = time.perf_counter()
    mx.eval(fn(x))
    return time.perf_counter() - t0


def time_interleaved(fns: dict, x: mx.array, repeats: int) -> dict[str, list[float]]:
    """Seconds of each call of each function, calls interleaved so neighbours share machine load."""
    for fn in fns.values():
        mx.eval(fn(x))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for rep in range(repeats):
        order = list(fns.items())
        for k, fn in order[::-1] if rep % 2 else order:  # alternate the order: no first-mover bias
            samples[k].append(_time_once(fn, x))
    return samples


def bench_shape(in_f: int, out_f: int, batch: int, repeats: int) -> dict:
    """Times of every variant for one ``in_f -> out_f`` layer and batch of tokens."""
    w = mx.random.normal((out_f, in_f), key=mx.random.key(0)) * 0.02
    mixed = MixedLinear.from_quantized(quantize_weight(w, QuantOption.parse(MIXED), clip=False))
    uniform = MixedLinear.from_quantized(quantize_weight(w, QuantOption.parse(UNIFORM), clip=False))
    x = mx.random.normal((batch, in_f), key=mx.random.key(1))
    mx.eval(mixed.parameters(), uniform.parameters(), x)

    t0 = time.perf_counter()
    mx.eval(mixed(x))
    first_call = time.perf_counter() - t0

    fp = nn.Linear(in_f, out_f, bias=False)
    fp.weight = mx.contiguous(mixed.dequantize())
    wcat = mx.concatenate(
        [mx.dequantize(p, s.astype(mx.float32), b.astype(mx.float32), group_size=g, bits=nb)
         for (p, s, b), nb, g in zip(mixed.parts, mixed.seg_bits, mixed.seg_group_sizes)], axis=-1)
    perm = mixed["perm"].astype(mx.uint32)
    mx.eval(fp.parameters(), wcat)

    def xperm(v: mx.array) -> mx.array:
        return mx.take(v, perm, axis=-1) @ wcat.T

    reps = max(15, min(repeats, int(2e9 // (in_f * out_f * batch))))
    t = time_interleaved({"mixed": mixed, "uniform": uniform, "xperm": xperm, "fp32": fp}, x, reps)
    stock = nn.QuantizedLinear(in_f, out_f, bias=False, group_size=32, bits=4)
    stock.weight, stock.scales, stock.biases = uniform.parts[0]
    # MLX's CPU quantized matmul takes tens of seconds at the largest size: one cold call there
    t["mlx_qmm"] = time_interleaved({"q": stock}, x, 2)["q"] if in_f * out_f * batch < 1e9 else [_time_once(stock, x)]
    ms = {k: min(v) * 1e3 for k, v in t.items()}
    ms["first_call"] = first_call * 1e3
    pair = [a / b for a, b in zip(t["mixed"], t["uniform"])]
    return {"in": in_f, "out": out_f, "batch": batch, "repeats": reps, "ms": ms,
            "median_ms": {k: statistics.median(v) * 1e3 for k, v in t.items()},
            "ratio_of_min": ms["mixed"] / ms["uniform"], "ratio_paired_median": statistics.median(pair)}


@click.command()
@click.option("--repeats", default=200, show_default=True, help="most timed calls per variant (fewer for big shapes)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None, help="also write results here")
def main(repeats: int, json_path: str | None) -> None:
    """Print mixed/uniform forward-time ratios on the portable path against the 1.15x goal."""
    if kernels.metal_active():
        raise click.ClickException("this benchmark measures the portable path; run it with the CPU device")
    rows = []
    click.echo(f"mixed {MIXED} vs uniform {UNIFORM}, portable path; ms = fastest call; "
               "ratio = median paired mixed/uniform, min = ratio of fastest calls")
    click.echo(f"{'shape':>11} {'batch':>5} {'mixed':>8} {'uniform':>8} {'ratio':>6} {'min':>6} {'goal':>5} "
               f"{'xperm':>8} {'fp32':>8} {'1st call':>9} {'mlx qmm':>9}")
    for in_f, out_f in SHAPES:
        for batch in BATCHES:
            r = bench_shape(in_f, out_f, batch, repeats)
            ms = r["ms"]
            ok = "ok" if r["ratio_paired_median"] <= GOAL else "MISS"
            click.echo(
                f"{in_f:>5}->{out_f:<5} {batch:>5} {ms['mixed']:8.3f} {ms['uniform']:8.3f} "
                f"{r['ratio_paired_median']:6.3f} {r['ratio_of_min']:6.3f} {ok:>5} {ms['xperm']:8.3f} "
                f"{ms['fp32']:8.3f} {ms['first_call']:9.2f} {ms['mlx_qmm']:9.2f}"
            )
            rows.append(r)
    worst = max(r["ratio_paired_median"] for r in rows)
    click.echo(f"worst mixed/uniform ratio {worst:.3f} (goal <= {GOAL})")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"mixed": MIXED, "uniform": UNIFORM, "goal": GOAL, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
