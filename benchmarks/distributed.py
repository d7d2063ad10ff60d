"""Speedup of a two-rank measurement (mx.distributed ring backend on localhost) over one rank, and its traffic.

Measures the bundled SmolLM2-135M (optionally only its first ``--layers``
decoder layers, written to a temporary folder) once with one rank and once
with two, every rank limited to one BLAS/OpenMP thread and ``--threads``
mlx-dq worker threads (default 1: each rank stands for one Mac's core, the
one-rank run included, so that the one-rank run does not use both of this
machine's cores for its options while each of two ranks gets one), and prints the wall
times, the speedup, whether both measurements are identical, and the bytes
each rank contributed to collectives per decoder layer (Gram sums and
gathered results). ``--shape 8b`` measures a one-layer random model at
Llama-3-8B's shapes (``benchmarks/scale.py``'s) instead. Run from the
repository root:

    python benchmarks/distributed.py                      # the whole bundled model, README settings
    python benchmarks/distributed.py --shape 8b --rows 8  # one 8B-shaped layer and its head

On a 2-core machine the two ranks share the two cores with anything else
running; the figure is only meaningful on an otherwise idle machine. Note
that MLX's ring backend (0.32.4) waits for a peer by spinning: a rank that
finishes its share first keeps a core busy until the other arrives, which
costs nothing when each rank has its own Mac but slows the working rank when
both share two cores with other jobs.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def truncated_model(layers: int, folder: Path) -> str:
    """The bundled model with only its first ``layers`` decoder layers, as a Hugging Face folder."""
    import mlx.core as mx

    from mlx_dq.model.sources import resolve

    src = resolve("smollm2-135m")
    if layers >= src.num_layers:
        return "smollm2-135m"
    weights = dict(src.other_weights())
    for i in range(layers):
        weights.update(dict(src.layer_weights(i)))
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    config = dict(src.config, num_hidden_layers=layers)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    src.save_tokenizer(folder)
    return str(folder)


def scale_model(shape: str, folder: Path) -> str:
    """A one-decoder-layer random-weight model at one of ``benchmarks/scale.py``'s shapes (e.g. Llama-3-8B's)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    import scale

    if shape not in scale.SHAPES:
        sys.exit(f"--shape {shape!r}: use one of {', '.join(scale.SHAPES)}")
    spec = dict(scale.SHAPES[shape], layers=1)
    subprocess.run([sys.executable, "-c", scale.BUILD, str(folder), json.dumps(spec), str(REPO / "tests")],
                   check=True, capture_output=True)
    return str(folder)


def worker(args: argparse.Namespace) -> None:
    """One rank: measure, then print this rank's timing and traffic as one JSON line."""
    from mlx_dq.measure.stream import measure
    from mlx_dq.runtime import distributed as dist

    t0 = time.perf_counter()
    m = measure(args.model, rows=args.rows, seq_len=args.seq_len, grid=args.grid, out_path=args.out, resume=False,
            method=args.method, progress=False)
    wall = time.perf_counter() - t0
    layers = {k: v for k, v in dist.TRAFFIC.by_layer.items() if isinstance(k, int)}
    print("RESULT " + json.dumps({"rank": dist.rank(), "size": dist.size(), "measure_s": wall,
                                  "gram_bytes": dist.TRAFFIC.gram_bytes, "object_bytes": dist.TRAFFIC.object_bytes,
                                  "calls": dist.TRAFFIC.calls, "layers": layers,
                                  "head": dist.TRAFFIC.by_layer.get("head"), "wait_s": dist.TRAFFIC.wait_s,
                                  "timing": {k: v for k, v in m.extra["timing"].items()}},
                                 default=str), flush=True)


def run(n: int, args: argparse.Namespace, model: str, out: Path) -> list[dict]:
    """Run the measurement on ``n`` ranks of the ring backend on localhost; each rank's JSON result line.

    The ranks are started the way ``mlx.launch -n N --backend ring`` starts them
    (``MLX_RANK`` and a ``MLX_HOSTFILE`` listing one localhost port per rank),
    but without the launcher's output-forwarding threads: in mlx 0.32.4 they
    poll the ranks' stdin pipes without waiting and keep a core busy, which on a
    2-core machine would take a whole core from the ranks being timed.
    """
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1",
               MLX_DQ_THREADS=str(args.threads),
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    cmd = [sys.executable, __file__, "--worker", "--model", model, "--rows", str(args.rows), "--seq-len",
           str(args.seq_len), "--grid", args.grid, "--method", args.method, "--out", str(out)]
    if n > 1:
        hostfile = out.with_suffix(".hosts.json")
        hostfile.write_text(json.dumps([[f"127.0.0.1:{args.port + r}"] for r in range(n)]))
        env["MLX_HOSTFILE"] = str(hostfile)
    t0 = time.perf_counter()
    procs = [subprocess.Popen(cmd, env=dict(env, MLX_RANK=str(r)) if n > 1 else env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(n)]
    outs = []
    for p in procs:
        o, e = p.communicate()
        outs.append((p.returncode, o, e))
        if p.returncode != 0:
            for q in procs:
                if q.poll() is None:
                    q.kill()
    wall = time.perf_counter() - t0
    bad = [(r, o, e) for r, (rc, o, e) in enumerate(outs) if rc != 0]
    if bad:
        sys.exit(f"rank {bad[0][0]} of {n} failed:\n{bad[0][1][-2000:]}\n{bad[0][2][-2000:]}")
    results = [json.loads(line[len("RESULT "):]) for _, o, _ in outs for line in o.splitlines()
               if line.startswith("RESULT ")]
    for r in results:
        r["process_s"] = wall
    return sorted(results, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=30, help="Decoder layers of the bundled model to measure.")
    ap.add_argument("--shape", default=None, help="instead of the bundled model: a one-layer random model at this "
                    "shape of benchmarks/scale.py (8b, 70b, 0.5b, tiny)")
    ap.add_argument("--rows", type=int, default=32, help="Calibration rows (the README's convert uses 32).")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--grid", default="default")
    ap.add_argument("--method", default="gptq")
    ap.add_argument("--threads", type=int, default=1,
                    help="mlx-dq worker threads per rank (MLX_DQ_THREADS); 1 emulates one core per Mac, as the "
                         "one-rank run gets too")
    ap.add_argument("--port", type=int, default=42300)
    ap.add_argument("--json", default=None, help="also write every rank's raw result (per-layer timings) here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    from mlx_dq.measure.stream import strip_timing

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = scale_model(args.shape, tmp / "model") if args.shape else truncated_model(args.layers, tmp / "model")
        one = run(1, args, model, tmp / "one.json")
        two = run(2, args, model, tmp / "two.json")
        same = strip_timing(json.loads((tmp / "one.json").read_text())) == strip_timing(
            json.loads((tmp / "two.json").read_text()))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "one": one, "two": two}, indent=1))
    t1, t2 = one[0]["measure_s"], max(r["measure_s"] for r in two)
    name = f"{args.shape} shape (benchmarks/scale.py), 1 decoder layer" if args.shape else \
        f"smollm2-135m, {args.layers} decoder layers"
    print(f"model: {name}; {args.rows} rows x {args.seq_len} tokens; "
          f"grid {args.grid}; method {args.method}; one BLAS thread and {args.threads} mlx-dq worker "
          f"thread(s) per rank")
    print(f"1 rank : measure {t1:8.1f} s   (whole process {one[0]['process_s']:.1f} s)")
    print(f"2 ranks: measure {t2:8.1f} s   (whole processes {two[0]['process_s']:.1f} s)")
    print(f"speedup: {t1 / t2:.2f}x (measure), {one[0]['process_s'] / two[0]['process_s']:.2f}x (whole processes)")
    print(f"measurements identical (timing aside): {same}")
    for r in two:
        layers = r["layers"].values()
        n = max(len(layers), 1)
        gram = sum(v["gram"] for v in layers) / n
        obj = sum(v["object"] for v in layers) / n
        print(f"rank {r['rank']}: per decoder layer {gram / 2**20:.2f} MiB into Gram all_sums + "
              f"{obj / 2**20:.3f} MiB of gathered results; head {sum((r['head'] or {}).values()) / 2**20:.2f} MiB; "
              f"{r['calls']} collectives in all")
    for r in one + two:
        waits = r.get("wait_s") or {}
        tm = r.get("timing") or {}
        who = f"rank {r['rank']} of {r['size']}"
        print(f"{who}: waited {sum(waits.values()):.1f} s in collectives "
              f"(decoder layers {sum(v for k, v in waits.items() if k.isdigit()):.1f} s, "
              f"head {waits.get('head', 0.0):.1f} s); summed over the decoder layers: forward "
              f"{sum(tm.get('forward_s', [])):.1f} s, options {sum(tm.get('options_s', [])):.1f} s, "
              f"importance and gathers {sum(tm.get('importance_s', [])):.1f} s; embedding and head "
              f"{r['measure_s'] - sum(tm.get('layers_s', [])):.1f} s")
        if tm.get("head"):
            print("    head: " + ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in tm["head"].items()))


if __name__ == "__main__":
    main()
