"""Does measuring on a random subset of output rows keep the errors and the plan? (SmolLM2-135M, a few layers)

Runs the bundled SmolLM2-135M on calibration rows once, collecting the Gram
matrices of the chosen decoder layers' linear tensors, then measures every
option of the default grid (GPTQ + clip, as ``measure`` does) for each tensor
twice: on all output rows and on ``--sample-rows`` random rows. Prints the
relative difference of every option's error, the time of both, and the
3.5 bpw plans the optimizer makes from each (importance from the tensor's
role-free default, 1, so only the errors differ) and how many tensors differ.

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        python benchmarks/row_sample.py --layers 0,15,29 --sample-rows 256
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx
import numpy as np


def main() -> None:
    from mlx_dq.data import calib as calib_mod
    from mlx_dq.measure.grids import load_grid
    from mlx_dq.measure.records import Measurement
    from mlx_dq.measure.tensor import HowToMeasure, measure_tensor
    from mlx_dq.model.capture import GramCollector, quantizable_modules
    from mlx_dq.model.runner import probe_layers
    from mlx_dq.model.sources import default_gguf_path, resolve
    from mlx_dq.names import role_of
    from mlx_dq.plan.solver import optimize
    from mlx_dq.quant.spec import QuantizerSpec

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", default="0,15,29")
    ap.add_argument("--sample-rows", type=int, default=256)
    ap.add_argument("--rows", type=int, default=8, help="calibration rows of 512 tokens")
    ap.add_argument("--bpw", type=float, default=3.5)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    layers = [int(x) for x in args.layers.split(",")]

    source = resolve(str(default_gguf_path()))
    model = source.model(mx.float32)
    _, tokens = calib_mod.calibration_rows(source.tokenizer(), None, args.rows, 512, 0)
    mods = {p: m for i in layers for p, m in quantizable_modules(model.layers[i], prefix=f"model.layers.{i}.").items()}
    with GramCollector(mods) as col:
        for r in range(args.rows):
            h, calls = probe_layers(model, tokens[r:r + 1])
            for j in range(max(layers) + 1):
                h = model.layers[j](h, *calls[j][0], **calls[j][1]).astype(mx.float32)
                mx.eval(h)
                col.flush()
    grid = load_grid(None)
    recs: dict[str, dict] = {"full": {}, "sampled": {}}
    secs = {"full": 0.0, "sampled": 0.0}
    diffs = []
    for path, mod in mods.items():
        role = role_of(path)
        for kind, n in (("full", 0), ("sampled", args.sample_rows)):
            t = time.perf_counter()
            recs[kind][path] = measure_tensor(path, mod.weight, grid[role], col.stats[path], role,
                                              spec=QuantizerSpec(method="gptq", clip=True),
                                              how=HowToMeasure(sample_rows=n))
            secs[kind] += time.perf_counter() - t
        for a, b in zip(recs["full"][path].options, recs["sampled"][path].options):
            diffs.append(abs(b.err - a.err) / a.err)
        worst = max(abs(b.err - a.err) / a.err for a, b in zip(recs["full"][path].options,
                                                                recs["sampled"][path].options))
        print(f"{path:40s} rows {mod.weight.shape[0]:5d}  worst option error difference {worst:.2%}", flush=True)
    if args.json:  # the errors first: the plans below are the cheap part
        Path(args.json).write_text(json.dumps({k: {p: [(o.option.desc, o.err) for o in r.options] for p, r in v.items()}
                                               for k, v in recs.items()}, indent=1))
    plans = {}
    for kind in ("full", "sampled"):
        m = Measurement(model={"spec": "smollm2-subset"}, calibration={}, grid={}, versions={})
        m.tensors = recs[kind]
        plans[kind] = {e.key: e.option for e in optimize(m, args.bpw).tensors}
    differ = [k for k in plans["full"] if plans["full"][k] != plans["sampled"][k]]
    d = np.array(diffs)
    print(f"\noption errors: median difference {np.median(d):.2%}, 95th percentile {np.quantile(d, 0.95):.2%}, "
          f"max {d.max():.2%} over {d.size} (tensor, option) pairs")
    print(f"seconds: full {secs['full']:.1f}, sampled {secs['sampled']:.1f} ({secs['sampled'] / secs['full']:.0%})")
    print(f"{args.bpw} bpw plans over these {len(mods)} tensors: {len(differ)} differ" +
          "".join(f"\n  {k}: {plans['full'][k]} -> {plans['sampled'][k]}" for k in differ))
    if args.json:
        Path(args.json).with_suffix(".summary.json").write_text(json.dumps({"args": vars(args), "seconds": secs, "differ": differ,
                                               "plans": plans, "median": float(np.median(d)),
                                               "p95": float(np.quantile(d, 0.95)), "max": float(d.max())}, indent=1))


if __name__ == "__main__":
    main()
