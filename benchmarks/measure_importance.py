"""Does the measurer's cheap importance predict end-to-end damage?

For a sample of tensors of a measured model (default: every tensor of a few
decoder layers spread over the depth), quantize only that tensor at its
reference option and compute the KL divergence of the model's next-token
distribution from the float32 model on held-out text (the default evaluation
text, not the calibration rows). Then compare rank correlations (Spearman)
with the KL of:

- ``err**2`` alone (no importance: every tensor counts the same),
- ``importance * err**2`` with the measurement's importance (default: the
  relative damage to the layer's residual-stream output).

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/measure_importance.py --measurement /tmp/m.json
"""

from __future__ import annotations

import argparse
import json
import time

import mlx.core as mx
import numpy as np


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman rank correlation (no ties expected in continuous data)."""
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> None:
    """Compute per-tensor KL for the sample and print the correlations."""
    from mlx_dq.data import calib
    from mlx_dq.measure.model_kl import tensor_kl
    from mlx_dq.measure.records import load_measurement
    from mlx_dq.model.capture import quantizable_modules
    from mlx_dq.model.sources import resolve
    from mlx_dq.quant.options import QuantOption

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--measurement", required=True, help="measurement JSON written by mlx_dq measure")
    ap.add_argument("--model", default=None, help="model spec [default: the one recorded in the measurement]")
    ap.add_argument("--layers", default="0,7,15,22,29", help="decoder layers whose tensors are sampled")
    ap.add_argument("--rows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", default=None, help="also write the per-tensor figures here")
    args = ap.parse_args()

    m = load_measurement(args.measurement)
    src = resolve(args.model or m.model["spec"])
    model = src.model(mx.float32)
    tokens = calib.sample_rows(src.tokenizer(), calib.default_eval_texts(), args.rows, args.seq_len, seed=0)
    layers = [int(x) for x in args.layers.split(",")]
    mods = {p: mod for p, mod in quantizable_modules(model).items()
            if p in m.tensors and any(p.startswith(f"model.layers.{i}.") for i in layers)}
    options = {p: QuantOption.parse(m.tensors[p].extra.get("importance_ref", "1.0:3b_64g")) for p in mods}
    t0 = time.perf_counter()
    kl = tensor_kl(model, tokens, mods, options, progress=True)
    secs = time.perf_counter() - t0

    rows = []
    for p in mods:
        t = m.tensors[p]
        err = t.find(options[p]).err
        rows.append({"key": p, "option": options[p].desc, "err": err, "importance": t.importance,
                     "kl": kl[p]["kl"], "err_eval": kl[p]["err"]})
    k = np.array([r["kl"] for r in rows])
    e2 = np.array([r["err"] ** 2 for r in rows])
    imp = np.array([r["importance"] for r in rows])
    print(f"{'tensor':<42} {'err':>7} {'importance':>10} {'imp*err^2':>10} {'KL':>10}")
    for r in sorted(rows, key=lambda r: -r["kl"]):
        print(f"{r['key']:<42} {r['err']:>7.4f} {r['importance']:>10.4g} {r['importance'] * r['err'] ** 2:>10.3g} "
              f"{r['kl']:>10.3g}")
    print(f"\n{len(rows)} tensors, {args.rows} x {args.seq_len} held-out tokens, KL pass {secs:.0f} s")
    print(f"Spearman(KL, err^2)              = {spearman(k, e2):+.3f}")
    print(f"Spearman(KL, importance * err^2) = {spearman(k, imp * e2):+.3f}")
    print(f"Spearman(KL, importance)         = {spearman(k, imp):+.3f}")
    ratio = k / (imp * e2)
    print(f"KL / (importance * err^2): median {np.median(ratio):.3g}, 10-90% range "
          f"{np.percentile(ratio, 10):.3g}..{np.percentile(ratio, 90):.3g} (flat = comparable across tensors)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
