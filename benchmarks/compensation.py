"""Output error of rounding vs GPTQ error compensation on real SmolLM2 layers, and time per tensor.

For some decoder layers of the bundled SmolLM2-135M, the input Gram matrix of
q/o/gate/down projections is captured twice: on calibration rows (used to
quantize) and on held-out rows from the evaluation text (a different domain).
The table gives the mean relative output error ||X(Wq-W)^T|| / ||XW^T|| over
those tensors, as "calibration / held-out", for: plain rounding (RTN), RTN
with the clip search, GPTQ, GPTQ with activation-weighted scales, the same in
natural channel order, and with another damping (``--alt-damp``). Then the time to quantize
random 1536x576, 576x1536 and 4096x4096 weights with each method.

Run: LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
     python benchmarks/compensation.py [--layers 2,15,28] [--rows 16] [--seq-len 256] [--no-timing]

Note: the model's own weights are a dequantized Q4_1 (4-bit, group 32) model,
so 4-bit group-32 options can partly rebuild the original grid; the table uses
group 64 at every width.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import mlx.core as mx
import numpy as np

from mlx_dq.data import calib
from mlx_dq.model.capture import GramCollector
from mlx_dq.model.sources import load_model
from mlx_dq.quant.affine import QuantizedTensor, output_error, quantize_weight
from mlx_dq.quant.gptq import gptq_quantize
from mlx_dq.quant.options import QuantOption
from mlx_dq.quant.spec import QuantizerSpec

OPTIONS = ("1.0:2b_64g", "1.0:3b_64g", "1.0:4b_64g", "0.25:4b_32g/0.75:3b_64g")
PROJS = ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
Method = Callable[[mx.array, QuantOption, mx.array], QuantizedTensor]


def methods(alt_damp: float) -> dict[str, Method]:
    """The quantizers compared, by column name."""
    return {
        "RTN": lambda w, o, g: quantize_weight(w, o, g, clip=False),
        "RTN+clip": lambda w, o, g: quantize_weight(w, o, g, clip=True),
        "GPTQ": lambda w, o, g: gptq_quantize(w, o, g, QuantizerSpec(weighted_scales=False), error_stats=False),
        "GPTQ+wtd": lambda w, o, g: gptq_quantize(w, o, g, error_stats=False),
        "GPTQ+wtd nat": lambda w, o, g: gptq_quantize(w, o, g, QuantizerSpec(act_order=False), error_stats=False),
        f"GPTQ+wtd d={alt_damp:g}": lambda w, o, g: gptq_quantize(w, o, g, QuantizerSpec(damp=alt_damp),
                                                                  error_stats=False),
    }


def capture(model, rows: mx.array, layers: list[int], batch: int = 4) -> dict[str, tuple[mx.array, mx.array]]:
    """``{name: (weight, gram)}`` for the chosen projections, from a forward pass over ``rows``."""
    mods = {}
    for li in layers:
        layer = model.model.layers[li]
        for p in PROJS:
            mod = layer
            for part in p.split("."):
                mod = getattr(mod, part)
            mods[f"layers.{li}.{p}"] = mod
    with GramCollector(mods) as col:
        for i in range(0, rows.shape[0], batch):
            mx.eval(model(rows[i : i + batch]))
            col.flush()
    return {n: (m.weight, col.stats[n].gram) for n, m in mods.items()}


def add_layer_args(ap: argparse.ArgumentParser) -> None:
    """The model, layers and token counts of :func:`capture_both` (shared with ``scale_search.py``)."""
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--layers", default="2,15,28", help="comma-separated decoder layer indices")
    ap.add_argument("--rows", type=int, default=16, help="calibration (and held-out) rows")
    ap.add_argument("--seq-len", type=int, default=256)


def capture_both(args: argparse.Namespace) -> tuple[list[int], dict, dict]:
    """The chosen layers and their ``{name: (weight, gram)}`` on calibration rows and on held-out rows of the
    evaluation text (:func:`add_layer_args`' settings)."""
    model, tokenizer, _ = load_model(args.model)
    cal_rows = calib.sample_rows(tokenizer, calib.default_calibration_texts(), args.rows, args.seq_len)
    held_rows = calib.sample_rows(tokenizer, calib.default_eval_texts(), args.rows, args.seq_len, seed=1)
    layers = [int(x) for x in args.layers.split(",")]
    return layers, capture(model, cal_rows, layers), capture(model, held_rows, layers)


def real_table(args: argparse.Namespace) -> None:
    """Print the output-error table on real layers."""
    t0 = time.perf_counter()
    layers, cal, held = capture_both(args)
    print(f"# model {args.model}, layers {layers}, {len(cal)} tensors, calibration {args.rows}x{args.seq_len} tokens, "
          f"held-out {args.rows}x{args.seq_len} (evaluation text); loading+capture {time.perf_counter() - t0:.1f}s")
    meth = methods(args.alt_damp)
    head = f"{'option':<26}" + "".join(f"{m:>20}" for m in meth)
    print("mean relative output error, calibration / held-out")
    print(head)
    totals = {m: 0.0 for m in meth}
    for desc in OPTIONS:
        opt = QuantOption.parse(desc)
        errs = {m: ([], []) for m in meth}
        for name, (w, g) in cal.items():
            g_held = held[name][1]
            for m, fn in meth.items():
                t = time.perf_counter()
                wq = fn(w, opt, g).dequantize()
                mx.eval(wq)
                totals[m] += time.perf_counter() - t
                errs[m][0].append(output_error(w, wq, g))
                errs[m][1].append(output_error(w, wq, g_held))
        cells = "".join(f"{np.mean(c):>10.4f} /{np.mean(h):>7.4f}" for c, h in errs.values())
        print(f"{desc:<26}{cells}", flush=True)
    print(f"{'total seconds':<26}" + "".join(f"{totals[m]:>20.1f}" for m in meth))


def _random_problem(out_f: int, in_f: int, seed: int = 0) -> tuple[mx.array, mx.array]:
    """Heavy-tailed weights and a Gram of correlated inputs with uneven channel energy."""
    rng = np.random.default_rng(seed)
    w = (rng.standard_t(4, size=(out_f, in_f)) * 0.02).astype(np.float32)
    mix = rng.standard_normal((in_f, in_f)).astype(np.float32) / np.sqrt(in_f)
    x = (rng.standard_normal((2 * in_f, in_f)).astype(np.float32) @ mix) * rng.lognormal(0, 1, in_f).astype(np.float32)
    return mx.array(w), mx.array(x.T @ x)


def timing_table(args: argparse.Namespace) -> None:
    """Print seconds per tensor for each method on random weights."""
    meth = {k: v for k, v in methods(args.alt_damp).items() if k in ("RTN", "RTN+clip", "GPTQ", "GPTQ+wtd")}
    print("\nseconds per tensor, wall / CPU (one run each, random weights, this machine)")
    print(f"{'shape':<12}{'option':<26}" + "".join(f"{m:>16}" for m in meth) + f"{'GPTQ err':>10}{'RTN err':>10}")
    shapes = [(1536, 576), (576, 1536)] + ([] if args.no_large else [(4096, 4096)])
    for out_f, in_f in shapes:
        w, g = _random_problem(out_f, in_f)
        mx.eval(w, g)
        for desc in ("1.0:4b_64g", "0.25:4b_32g/0.75:3b_64g"):
            if (out_f, in_f) == (4096, 4096) and desc != "1.0:4b_64g":
                continue
            opt = QuantOption.parse(desc)
            secs, errs = [], {}
            for m, fn in meth.items():
                t, c = time.perf_counter(), time.process_time()
                qt = fn(w, opt, g)
                mx.eval([a for part in qt.parts for a in part])
                secs.append((time.perf_counter() - t, time.process_time() - c))
                errs[m] = output_error(w, qt.dequantize(), g)
            print(f"{f'{out_f}x{in_f}':<12}{desc:<26}" + "".join(f"{s:>8.2f} /{c:>6.2f}" for s, c in secs)
                  + f"{errs['GPTQ+wtd']:>10.4f}{errs['RTN']:>10.4f}", flush=True)


def main() -> None:
    """Parse arguments and print both tables."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_layer_args(ap)
    ap.add_argument("--alt-damp", type=float, default=0.01,
                    help="damping of the extra GPTQ column (the others use gptq.DEFAULT_DAMP)")
    ap.add_argument("--no-real", action="store_true", help="skip the real-layer table")
    ap.add_argument("--no-timing", action="store_true", help="skip the timing table")
    ap.add_argument("--no-large", action="store_true", help="skip the 4096x4096 timing")
    args = ap.parse_args()
    if not args.no_real:
        real_table(args)
    if not args.no_timing:
        timing_table(args)


if __name__ == "__main__":
    main()
