"""What GPTQ's group scale search buys, and what a cheaper one would cost (SmolLM2-135M layers, one CPU thread).

GPTQ chooses each group's fp16 scale and bias by :func:`mlx_dq.quant.scale_search.refine_group_params`: MLX's range rule,
then seven shifted or rescaled ranges, then two weighted least-squares refits. On a 2-core CPU that search costs
about as much as GPTQ's own matrix updates at 4,096 input channels, so this script prices each part of it:

- seconds per million weights of the search alone (one thread, a 256 x 4,096 weight at 4 bits, median of runs);
- the mean relative output error ``||X (Wq - W)^T|| / ||X W^T||`` of GPTQ with that search on real SmolLM2-135M
  layers (q/o/gate/down of the chosen layers), against the calibration Gram it was quantized with and against a
  held-out Gram from the evaluation text (another domain), for 2-, 3- and 4-bit g64 and a mixed option;
- with ``--hot-loop 4096,8192``: GPTQ alone on a ``h x h`` tensor with each search, as ``scale.py``'s hot loop
  times it (4-bit g64, factor cached, median of three runs taken in turn), against a plain matmul.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/scale_search.py [--layers 2,15,28] [--clip] [--hot-loop 4096,8192]
"""

from __future__ import annotations

import argparse
import functools
import time

import mlx.core as mx
import numpy as np
from compensation import OPTIONS, add_layer_args, capture_both
from scale import hot_loop_problem

from mlx_dq.quant import scale_search as search_mod
from mlx_dq.quant.affine import output_error
from mlx_dq.quant.gptq import gptq_quantize
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.spec import QuantizerSpec
from mlx_dq.quant.storage import affine_params

# refine_group_params' keyword arguments per variant; "default" is the library's own search
VARIANTS: dict[str, dict] = {
    "default": {},
    "one refit": {"refits": 1},
    "+-0.5 shifts only": {"shifts": (-0.5, 0.5), "rescales": ()},
    "+-0.5 shifts, one refit": {"shifts": (-0.5, 0.5), "rescales": (), "refits": 1},
    "refits only": {"shifts": (), "rescales": ()},
    "three refits only": {"shifts": (), "rescales": (), "refits": 3},
    "range rule only": {"shifts": (), "rescales": (), "refits": 0},
}


def search_seconds(rounds: int = 7) -> dict[str, float]:
    """Seconds per million weights of each variant's search on a 256 x 4,096 weight (4 bits, g64): the variants
    run in turn, ``rounds`` times, and each keeps its fastest run (this VM's timings vary by a third run to run)."""
    rng = np.random.default_rng(0)
    w = mx.array((rng.standard_normal((1, 256, 64, 64)) * 0.02).astype(np.float32))
    wt = mx.array((rng.random((1, 1, 64, 64)) * np.exp(rng.standard_normal(64))).astype(np.float32))
    w16 = w.astype(mx.float16).astype(mx.float32)
    s, b = (x.astype(mx.float16) for x in affine_params(w16.min(-1), w16.max(-1), 4))
    mx.eval(w, wt, s, b)
    best = {name: float("inf") for name in VARIANTS}
    for _ in range(rounds + 1):  # the first round compiles
        for name, kw in VARIANTS.items():
            t = time.perf_counter()
            mx.eval(*search_mod.refine_group_params(w, s, b, 4, wt, **kw))
            best[name] = min(best[name], time.perf_counter() - t)
    return {name: sec / (w.size / 1e6) for name, sec in best.items()}


def hot_loop(sizes: list[int]) -> None:
    """Print GPTQ alone on ``h x h`` with each variant's search: median of three runs, variants in turn."""
    from mlx_dq.conversion.estimate import matmul_flops
    from mlx_dq.quant.dispatch import quantize_tensor

    flops = matmul_flops(2048)
    print(f"\nGPTQ alone (4-bit g64, factor cached, no clip candidates); plain matmul {flops / 1e9:.1f} GFLOP/s")
    orig = search_mod.refine_group_params
    try:
        for h in sizes:
            w, gram, opt, cache = hot_loop_problem(h)
            runs: dict[str, list[float]] = {name: [] for name in VARIANTS}
            for _ in range(3):
                for name, kw in VARIANTS.items():
                    search_mod.refine_group_params = functools.partial(orig, **kw)
                    t = time.perf_counter()
                    mx.eval(*quantize_tensor(w, opt, gram, QuantizerSpec(clip=False), factor_cache=cache).parts[0])
                    runs[name].append(time.perf_counter() - t)
            for name, v in runs.items():
                sec = sorted(v)[1]
                print(f"{h} x {h}  {name:<26} {sec:6.2f} s = {h ** 3 / sec / flops:4.0%} of matmul  "
                      f"({', '.join(f'{t:.2f}' for t in v)})", flush=True)
    finally:
        search_mod.refine_group_params = orig


def main() -> None:
    """Print the cost and the output errors of every variant."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(ap)
    ap.add_argument("--clip", action="store_true", help="start from the clip search (convert's default), not the range")
    ap.add_argument("--hot-loop", default="", help="comma-separated sizes h: also time GPTQ alone on h x h tensors")
    args = ap.parse_args()
    ms = {name: sec * 1e3 for name, sec in search_seconds().items()}  # before the model: nothing else in memory
    layers, cal, held = capture_both(args)
    print(f"# {args.model}, layers {layers}, {len(cal)} tensors, {args.rows} x {args.seq_len} tokens each for the "
          f"calibration and held-out Grams; GPTQ (act order, damping {QuantizerSpec().damp}), clip search: {args.clip}")
    print("mean relative output error, calibration / held-out; search ms per million weights on one thread")
    orig = search_mod.refine_group_params
    try:
        for name, kw in VARIANTS.items():
            search_mod.refine_group_params = functools.partial(orig, **kw)  # choose_group_params looks it up by name
            cells = []
            for desc in OPTIONS:
                opt = QuantOption.parse(desc)
                c, h = [], []
                for tensor, (w, g) in cal.items():
                    wq = gptq_quantize(w, opt, g, QuantizerSpec(clip=args.clip), error_stats=False).dequantize()
                    c.append(output_error(w, wq, g))
                    h.append(output_error(w, wq, held[tensor][1]))
                cells.append(f"{desc} {np.mean(c):.5f} / {np.mean(h):.5f}")
            print(f"{name:<26} {ms[name]:6.1f} ms | " + " | ".join(cells), flush=True)
    finally:
        search_mod.refine_group_params = orig
    if args.hot_loop:
        hot_loop([int(h) for h in args.hot_loop.split(",")])


if __name__ == "__main__":
    main()
